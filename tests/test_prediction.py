"""Predicted outputs and the cross-request pool: draft sources that change speed, never the output."""

from __future__ import annotations

import json

import pytest

from edgespec import SamplingParams
from edgespec.commands.batch.requests import BatchRequest, InvalidRequest, for_the_engine, parse_line
from edgespec.loading import load_engine, use_learning
from edgespec.ngram_pool import NgramPool
from edgespec.generation import result_of
from edgespec.prediction import MAX_PREDICTION_CHARS, prediction_text, prediction_usage
from edgespec.server.worker import MAX_CLIENT_POOLS, EngineWorker, Job

from test_serve import API_KEY, USER, ServerProcess, server_env

FIXED_COST = (1.0, 1.3, 1.6, 1.9, 2.2)
PROMPT = "the cat sat on the mat and the dog"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


# -- the field --------------------------------------------------------------------------------


def test_prediction_content_is_a_string_or_text_parts():
    assert prediction_text(None) == ""
    assert prediction_text({"type": "content", "content": "abc"}) == "abc"
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    assert prediction_text({"type": "content", "content": parts}) == "abc"


@pytest.mark.parametrize("value", [
    "abc", {"content": "abc"}, {"type": "image", "content": "abc"}, {"type": "content"},
    {"type": "content", "content": 3}, {"type": "content", "content": [{"type": "image_url"}]},
    {"type": "content", "content": "abc", "extra": 1},
    {"type": "content", "content": "x" * (MAX_PREDICTION_CHARS + 1)},
])
def test_a_bad_prediction_is_one_clear_error(value):
    with pytest.raises(ValueError, match="prediction"):
        prediction_text(value)


def test_a_huge_unknown_key_is_quoted_in_part():
    with pytest.raises(ValueError) as raised:
        prediction_text({"type": "content", "content": "x", "k" * 100_000: 1})
    assert len(str(raised.value)) < 120


def test_prediction_usage_counts_the_tokens_that_appeared_in_the_completion_as_openai_does():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert prediction_usage(text, text) == (9, 0)
    assert prediction_usage(text, [20, 21, 22, 23]) == (0, 9)
    assert prediction_usage(text, [1, 2, 3, 4, 50, 6, 7, 8, 9]) == (8, 1), "one token edited: its neighbours still count"
    assert prediction_usage(text, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == (9, 0), "the completion went on"
    assert prediction_usage(text + text, text) == (9, 9), "a block the completion has once counts once"
    assert prediction_usage([7, 8], [7, 8]) == (2, 0) and prediction_usage([7, 8], []) == (0, 2)


def test_batch_bodies_take_a_prediction():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": USER, "prediction": {"type": "content", "content": "the mat"}}}
    request = for_the_engine(parse_line(json.dumps(line).encode(), 1))
    assert isinstance(request, BatchRequest) and request.prediction == "the mat"
    line["body"]["prediction"] = {"type": "content", "content": 5}
    refused = for_the_engine(parse_line(json.dumps(line).encode(), 1))
    assert isinstance(refused, InvalidRequest) and "prediction" in refused.message


# -- the library ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=512, draft_tokens=4, cost_curve=FIXED_COST)
    yield engine
    engine.close()


def test_a_prediction_is_verified_token_by_token(engine):
    plain = engine.generate(PROMPT, GREEDY, raw=True)
    right = engine.generate(PROMPT, GREEDY, raw=True, prediction=plain.text)
    wrong = engine.generate(PROMPT, GREEDY, raw=True, prediction="zebra quantum " * 20)
    assert right.token_ids == wrong.token_ids == plain.token_ids
    assert plain.stats.accepted_prediction_tokens == plain.stats.rejected_prediction_tokens == 0
    assert right.stats.draft_tokens_accepted > 0


def test_no_more_of_a_prediction_than_a_context_holds_is_tokenized(engine):
    # a 650,000-character prediction held a server's engine for 40 s and took 5.7 GB to index whole
    tokens = engine.prediction_tokens("the cat sat on the mat. " * 40_000)  # 960,000 characters
    assert len(tokens) == engine.n_ctx == 512
    assert engine.prediction_tokens("the cat") == engine.prediction_tokens({"type": "content", "content": "the cat"})


def test_the_usage_says_how_much_of_the_prediction_appeared(engine):
    prompt = engine.prompt_tokens(PROMPT, raw=True)
    plain = result_of(engine.stream_tokens(prompt, GREEDY))
    right = result_of(engine.stream_tokens(prompt, GREEDY, prediction=plain.token_ids))
    absent = [token for token in range(100, 160) if token not in plain.token_ids]
    wrong = result_of(engine.stream_tokens(prompt, GREEDY, prediction=absent))
    assert right.token_ids == wrong.token_ids == plain.token_ids
    assert (right.stats.accepted_prediction_tokens, right.stats.rejected_prediction_tokens) == (len(plain.token_ids), 0)
    assert (wrong.stats.accepted_prediction_tokens, wrong.stats.rejected_prediction_tokens) == (0, len(absent))


def test_the_library_takes_a_prediction_in_chats_and_in_openais_form(engine):
    messages = [{"role": "user", "content": PROMPT}]
    plain = engine.chat(messages, GREEDY)
    predicted = engine.chat(messages, GREEDY, prediction={"type": "content", "content": plain.text})
    parts = engine.chat(messages, GREEDY, prediction={"type": "content", "content": [{"type": "text", "text": plain.text}]})
    assert predicted.token_ids == parts.token_ids == plain.token_ids
    assert predicted.stats.accepted_prediction_tokens > 0
    assert parts.stats.accepted_prediction_tokens == predicted.stats.accepted_prediction_tokens


@pytest.mark.parametrize("value, named", [
    (5, "not int"), (["x"], "not list"), ({"type": "text"}, '"type": "content"'),
    ("x" * (MAX_PREDICTION_CHARS + 1), "at most 1,000,000"),  # the text itself had no cap, the field's form one
])
def test_a_bad_library_prediction_is_one_clear_error(engine, value, named):
    with pytest.raises(ValueError, match="prediction") as raised:
        engine.generate(PROMPT, GREEDY, raw=True, prediction=value)
    assert named in str(raised.value)


def test_the_pool_offers_an_earlier_generation_and_changes_nothing_else(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=512, draft_tokens=4, cost_curve=FIXED_COST)
    use_learning(engine, "cold", pool=True)
    try:
        first = engine.generate(PROMPT, GREEDY, raw=True)
        assert engine.pool.tokens >= len(first.token_ids)
        engine.forget_cache()
        again = engine.generate(PROMPT, GREEDY, raw=True)
        assert again.token_ids == first.token_ids
        assert again.stats.draft_tokens_accepted >= first.stats.draft_tokens_accepted
    finally:
        engine.close()


# -- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    process = ServerProcess(["--model", str(tiny_models["target"]), "--draft", "ngram", "--threads", "1",
                             "--draft-tokens", "4", "--api-key", API_KEY],
                            server_env(tmp_path_factory.mktemp("serve-prediction")))
    yield process
    process.stop()


def test_the_server_reports_prediction_tokens_and_gives_the_same_reply(server):
    client = server.client()
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0)
    text = plain.choices[0].message.content
    predicted = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0,
                                               prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
    as_parts = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0,
                                              prediction={"type": "content", "content": parts})
    assert as_parts.choices[0].message.content == text
    assert as_parts.usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens


def test_a_bad_prediction_gets_400_naming_it(server):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                                prediction={"type": "content", "content": 7})
    assert caught.value.param == "prediction"


# -- one pool per API key ---------------------------------------------------------------------


class _EngineWithPool:
    pool = NgramPool()


def test_the_server_never_shares_a_pool_between_api_keys():
    worker = EngineWorker(_EngineWithPool(), queue_size=1, on_finished=lambda job, result: None)
    job = lambda client: Job(None, None, 60.0, client=client)
    alice, bob = worker.pool_for(job("Bearer alice")), worker.pool_for(job("Bearer bob"))
    assert alice is not bob and alice is not _EngineWithPool.pool
    assert worker.pool_for(job("Bearer alice")) is alice
    for n in range(MAX_CLIENT_POOLS):
        worker.pool_for(job(f"Bearer other-{n}"))
    assert worker.pool_for(job("Bearer alice")) is not alice  # bounded: the least recently used pool went


def test_a_client_is_known_to_the_shared_caches_by_a_hash_of_its_key():
    # the scope of its KV cells and snapshots (SequenceCache.claim), which a snapshot file keeps
    alice, bob, nobody = (Job(None, None, 60.0, client=client).client_id for client in ("Bearer alice", "Bearer bob", ""))
    assert len({alice, bob, nobody}) == 3 and "alice" not in alice
    # a request with no key read the user's own prompts (run's, the chat's: scope ""), one token a guess
    assert nobody != ""
    # the key as the server checks it: one client spelling the header two ways is one client
    assert Job(None, None, 60.0, client="bearer  alice").client_id == alice
