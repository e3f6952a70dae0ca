"""Dropping a chat's oldest turn by shifting the KV cache (llama_memory_seq_rm + seq_add) instead of recomputing."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import ChatSession, Done, Notice, SamplingParams
from edgespec.backend import LlamaModel, dropped_span
from edgespec.loading import load_engine
from tinygguf import write_tiny_model

SYSTEM, DROPPED, KEPT = list(range(100, 120)), list(range(200, 250)), list(range(250, 310))  # ids the tiny vocabulary has


def test_dropped_span_is_the_one_span_left_out():
    cached = SYSTEM + DROPPED + KEPT
    assert dropped_span(cached, SYSTEM + KEPT + [7, 8]) == (len(SYSTEM), len(SYSTEM) + len(DROPPED))
    # the kept part may end early (a reply that tokenizes differently when rendered again)
    assert dropped_span(cached, SYSTEM + KEPT[:40] + [7]) == (len(SYSTEM), len(SYSTEM) + len(DROPPED))


def test_dropped_span_of_the_longest_match_when_the_text_repeats():
    cached = SYSTEM + DROPPED + KEPT[:40] + [9] * 5 + KEPT
    start = len(SYSTEM)
    assert dropped_span(cached, SYSTEM + KEPT + [7]) == (start, start + len(DROPPED) + 45)


@pytest.mark.parametrize("context", [
    SYSTEM + DROPPED + KEPT + [7],  # the cache extended: nothing to shift
    SYSTEM + DROPPED[:10] + [1, 2, 3],  # an edit: nothing after it is in the cache
    SYSTEM + KEPT[:31] + [7] * 40,  # fewer than MIN_SHIFTED_TOKENS match
    SYSTEM + KEPT[:20],  # the context ends before MIN_SHIFTED_TOKENS could match
])
def test_dropped_span_is_none_unless_a_long_run_of_the_cache_follows(context):
    assert dropped_span(SYSTEM + DROPPED + KEPT, context) is None


@pytest.fixture(scope="module")
def one_layer_path(tmp_path_factory):
    # In a one-layer model a token's keys and values depend on that token and its position only,
    # so a correctly shifted cache holds what a fresh prefill of the kept tokens computes.
    return write_tiny_model(tmp_path_factory.mktemp("one-layer") / "one_layer.gguf", seed=11, n_layer=1)


def test_a_shifted_cache_has_the_positions_and_logits_of_a_fresh_one(one_layer_path):
    rng = np.random.default_rng(3)
    system, dropped, kept = (rng.integers(10, 200, n).tolist() for n in (20, 50, 60))
    shifted, fresh, unshifted = (LlamaModel(one_layer_path, n_ctx=512, n_threads=1) for _ in range(3))
    try:
        shifted.decode(system + dropped + kept, n_logits=0)
        shifted.drop_span(len(system), len(system) + len(dropped))
        assert shifted.cached == system + kept
        assert shifted.cached_positions() == (0, len(system + kept) - 1)
        after_shift = shifted.decode([5], 1)[0]
        assert shifted.cached_positions() == (0, len(system + kept))
        expected = fresh.decode(system + kept + [5], 1)[0]
        with_the_span = unshifted.decode(system + dropped + kept + [5], 1)[0]
    finally:
        for model in (shifted, fresh, unshifted):
            model.close()
    # equal up to rounding (the keys are rotated again and stored in f16), unlike with the span still there
    assert np.abs(after_shift - expected).max() < 1e-3
    assert np.abs(with_the_span - expected).max() > 0.05


@pytest.mark.parametrize("allowed", [False, True])
def test_the_engine_shifts_only_for_a_caller_that_allows_it(one_layer_path, allowed):
    # a server's or a batch's next prompt must get what a fresh prefill computes, whatever came before
    engine = load_engine(one_layer_path, "none", n_ctx=512, cost_curve=[1.0], notice=lambda _: None)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        list(engine.stream_tokens(SYSTEM + DROPPED + KEPT, params))
        events = list(engine.stream_tokens(SYSTEM + KEPT + [7], params, shift_dropped_span=allowed))
    finally:
        engine.close()
    reused = events[-1].result.stats.prompt_tokens_reused
    assert reused == (len(SYSTEM + KEPT) if allowed else len(SYSTEM))


FILLER = ("Here is a note about gardening: water the tomatoes every morning, keep the basil in the sun, "
          "and pick the beans before they grow woody. ") * 3
QUESTIONS = (FILLER + "Summarise it.", FILLER + "Which plant needs sun?", FILLER + "When do I water?",
             "What is the capital of France?")


# The first two replies are written, not generated: how long the model's replies are depends on the CPU's
# kernels, and with it whether the fourth turn has to drop one, or two.  With these (~75 tokens each) the
# fourth turn drops exactly the first, however long (0 to 48 tokens) the generated third reply is.
WRITTEN_REPLY = ("Water the tomatoes every morning, keep the basil in the sun, and pick the beans before "
                 "they grow woody. ") * 3


def chat_past_the_context(engine) -> tuple[list[str], object, ChatSession]:
    """Four turns through a 512-token context, the last after the first turn is dropped."""
    session = ChatSession(engine, system_prompt="You are a helpful assistant.")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    for question in QUESTIONS[:2]:
        session.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": WRITTEN_REPLY}]
    notices, result = [], None
    for question in QUESTIONS[2:]:
        for event in session.stream(question, params):
            if isinstance(event, Notice):
                notices.append(event.text)
            elif isinstance(event, Done):
                result = event.result
    assert session.first_visible == 2, "the first turn must have been dropped"
    return notices, result, session


@pytest.mark.parametrize("bit_exact", [False, True])
def test_a_chat_that_outgrows_its_context_shifts_out_its_oldest_turn(smollm2_path, bit_exact):
    engine = load_engine(smollm2_path, "none", n_ctx=512, cost_curve=[1.0], bit_exact=bit_exact, notice=lambda _: None)
    try:
        notices, result, session = chat_past_the_context(engine)
        target = engine.target
        assert target.cached_positions() == (0, len(target.cached) - 1)
        new_tokens = len(engine.tokenize(QUESTIONS[-1]))
        engine.forget_cache()  # what a fresh session over the kept turns answers
        fresh = ChatSession(engine, system_prompt=session.system_prompt)
        fresh.messages = session.messages[session.first_visible:-1]  # the kept turns and the question
        reference = [event for event in fresh.stream_reply(SamplingParams(temperature=0.0, max_tokens=48))
                     if isinstance(event, Done)][0].result
    finally:
        engine.close()
    assert result.token_ids and result.finish_reason in ("stop", "length")
    if bit_exact:  # the kept turns were computed again: the reply is a fresh session's, token for token
        assert result.token_ids == reference.token_ids
    assert len(notices) == 1 and "left the oldest 2 message(s)" in notices[0]
    if bit_exact:  # the kept turns (~230 tokens after what they share with the dropped one) are computed again
        assert "shifted" not in notices[0]
        assert result.stats.prompt_tokens_evaluated > new_tokens + 150
    else:
        assert "shifted in the cache, not recomputed" in notices[0]
        assert result.stats.prompt_tokens_evaluated <= new_tokens + 12


def test_the_draft_models_cache_is_shifted_with_the_targets(tiny_models):
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=256, draft_tokens=2,
                         cost_curve=[1.0, 1.2, 1.4], notice=lambda _: None)
    engine.configure(mode="draft-model")
    dropped_spans = []
    drop_span = engine.draft_model.drop_span
    engine.draft_model.drop_span = lambda start, end: (dropped_spans.append((start, end)), drop_span(start, end))
    session = ChatSession(engine, system_prompt="system")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    try:
        for i in range(6):
            session.send(f"turn {i}: " + "the cat sat on the mat and the dog " * 2, params)
        assert session.first_visible > 0 and dropped_spans
        draft = engine.draft_model
        assert draft.cached_positions() == (0, len(draft.cached) - 1)
        prompt = engine.chat_tokens(session.visible_messages(), add_generation_prompt=False)
        assert draft.cached[:40] == prompt[:40]
    finally:
        engine.close()
