"""Multi-turn chat: KV reuse that never changes the output, cancel, context policy, persistence."""

from __future__ import annotations

import json
import threading

import pytest

from edgespec import ChatSession, Done, Notice, SamplingParams, Step
from edgespec.engine import result_of
from edgespec.loading import load_engine
from edgespec.errors import ContextOverflowError, EdgespecError, flag_worded
from edgespec.prompts import MAX_PROMPT_BYTES_PER_TOKEN

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TURNS = ["the cat sat on the mat", "and then the dog came in", "tell me about the cat again"]


FIXED_COST = (1.0, 1.2, 1.4, 1.6)


@pytest.fixture(scope="module")
def engines(tiny_models):
    """One engine for the sessions under test, one kept apart for fresh reference sessions."""
    # given cost curves: nothing is timed, so the draft lengths do not depend on the machine's speed
    reused = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=512, draft_tokens=3, cost_curve=FIXED_COST)
    fresh = load_engine(tiny_models["target"], "none", n_ctx=512, draft_tokens=0, cost_curve=FIXED_COST)
    yield reused, fresh
    reused.close()
    fresh.close()


def fresh_reply(engine, session: ChatSession, params=GREEDY):
    """What a brand-new session would answer to the same history (nothing cached)."""
    engine.forget_cache()
    reference = ChatSession(engine, session.system_prompt)
    reference.messages = [m for m in session.messages]
    return reference.stream_reply(params)


def reply_ids(events):
    return next(e.result for e in events if isinstance(e, Done)).token_ids


@pytest.mark.parametrize("mode", ["draft-model", "ngram", "none"])
def test_three_turns_with_reuse_equal_fresh_sessions(engines, mode):
    engine, fresh = engines
    engine.configure(mode=mode)
    session = ChatSession(engine, system_prompt="be brief")
    for turn, text in enumerate(TURNS):
        session.messages.append({"role": "user", "content": text})
        expected = reply_ids(fresh_reply(fresh, session))
        session.messages.pop()
        result = session.send(text, GREEDY)
        assert result.token_ids == expected, f"turn {turn + 1}"
        if turn > 0:
            # only the new user message and the template around it were decoded
            new_tokens = len(engine.tokenize(text))
            assert result.stats.prompt_tokens_reused > 0
            assert result.stats.prompt_tokens_evaluated <= new_tokens + 12
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3


def test_cancel_keeps_the_partial_reply_and_the_next_turn_is_exact(engines):
    engine, fresh = engines
    engine.configure(mode="ngram")
    session = ChatSession(engine)
    long = SamplingParams(temperature=0.0, max_tokens=400)
    steps = []
    started = threading.Event()

    def cancel_soon():
        started.wait(5)
        session.cancel()

    canceller = threading.Thread(target=cancel_soon)
    canceller.start()
    for event in session.stream(TURNS[0], long):
        if isinstance(event, Step):
            steps.append(event)
            started.set()
            canceller.join()  # the cancel comes from another thread, however busy the machine, before step 2
    last = session.messages[-1]
    assert last["role"] == "assistant" and last.get("cancelled") is True
    assert len(steps) == 1 and session.turn_stats[-1]["finish_reason"] == "cancelled"

    session.messages.append({"role": "user", "content": TURNS[1]})
    expected = reply_ids(fresh_reply(fresh, session))
    session.messages.pop()
    assert session.send(TURNS[1], GREEDY).token_ids == expected


def test_a_cancel_before_the_first_step_stops_the_reply_too(engines):
    engine, _ = engines
    engine.configure(mode="ngram")
    session = ChatSession(engine)
    events = session.stream(TURNS[0], SamplingParams(temperature=0.0, max_tokens=400))
    session.cancel()  # an Esc right after Enter, before the chat app's worker asked for the first step
    result = next(event.result for event in list(events) if isinstance(event, Done))
    assert result.finish_reason == "cancelled" and result.text == ""
    # an empty reply is no answer: the message waits, unanswered, for stream_reply
    assert session.messages == [{"role": "user", "content": TURNS[0]}] and session.turn_stats == []
    result_of(session.stream_reply(GREEDY))
    assert [m["role"] for m in session.messages] == ["user", "assistant"] and len(session.turn_stats) == 1


def test_a_reply_saved_without_its_figures_regenerates(engines):
    # a chat written by hand or by another program has no turn_stats: regenerating raised IndexError
    session = ChatSession.from_dict(engines[0], {"messages": [{"role": "user", "content": TURNS[0]},
                                                              {"role": "assistant", "content": "hi"}]})
    session.regenerate(GREEDY)
    assert [m["role"] for m in session.messages] == ["user", "assistant"] and len(session.turn_stats) == 1


def test_a_stopped_or_failed_regeneration_keeps_the_reply_it_was_to_replace(engines):
    # the reply was dropped before the new one began: a stopped regeneration left only its first words
    engine, _ = engines
    session = ChatSession(engine)
    session.send(TURNS[0], GREEDY)
    before = [dict(m) for m in session.messages], [dict(s) for s in session.turn_stats]
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=1)
    stream = session.stream_regenerate(sampled)
    next(event for event in stream if isinstance(event, Step))
    stream.close()  # leaving the stream
    assert (session.messages, session.turn_stats) == before
    for event in session.stream_regenerate(sampled):
        if isinstance(event, Step):
            session.cancel()
    assert (session.messages, session.turn_stats) == before
    result = session.regenerate(sampled)  # one that ends replaces it
    assert session.messages[1] == {"role": "assistant", "content": result.text}
    assert [turn["message_index"] for turn in session.turn_stats] == [1]

    # one that cannot start: the conversation no longer fits the context
    too_long = ChatSession.from_dict(engine, {"messages": [{"role": "user", "content": "word " * 5000},
                                                           {"role": "assistant", "content": "hi"}]})
    with pytest.raises(ContextOverflowError):
        too_long.regenerate(sampled)
    assert too_long.messages[-1] == {"role": "assistant", "content": "hi"}


def test_regenerate_and_edit_roll_back(engines):
    engine, fresh = engines
    engine.configure(mode="draft-model")
    session = ChatSession(engine)
    session.send(TURNS[0], GREEDY)
    session.send(TURNS[1], GREEDY)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=1)
    session.regenerate(sampled)
    assert len(session.messages) == 4 and len(session.turn_stats) == 2

    session.edit_user_message(0, "a different first question")
    assert len(session.messages) == 1
    reference = ChatSession(fresh)
    reference.messages = list(session.messages)
    expected = reply_ids(fresh_reply(fresh, reference))
    assert reply_ids(session.stream_reply(GREEDY)) == expected


def test_context_overflow_drops_oldest_turns_or_raises(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, draft_tokens=2, cost_curve=FIXED_COST)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    session = ChatSession(engine, system_prompt="system")
    notices = []
    for i in range(8):
        for event in session.stream(f"turn {i}: " + "the cat sat on the mat " * 3, params):
            if isinstance(event, Notice):
                notices.append(event.text)
    assert notices, "some turns must have been dropped"
    # a library user reads the parameter that avoids the shift, the chat app its flag
    assert engine.shifts_context and all(notice.endswith("(bit_exact=True recomputes)") for notice in notices)
    assert flag_worded(notices[0]).endswith("(--bit-exact recomputes)")
    assert session.first_visible > 0 and session.visible_messages()[0]["role"] == "system"
    assert len(session.messages) == 16  # the transcript keeps everything

    strict = ChatSession(engine, context_policy="error")
    with pytest.raises(ContextOverflowError):
        for i in range(8):
            strict.send(f"turn {i}: " + "the cat sat on the mat " * 3, params)
    assert strict.messages[-1]["role"] == "assistant", "a refused turn leaves the conversation as it was"
    with pytest.raises(ContextOverflowError) as overflow:
        strict.send("word " * 400, params)
    # OpenAI's words, which litellm and LangChain tell an overflow by; a batch has no chat to start anew
    assert "maximum context length is" in str(overflow.value) and "new chat" not in str(overflow.value)
    with pytest.raises(ContextOverflowError, match="characters are more tokens than fit"):
        strict.send("x" * (256 * MAX_PROMPT_BYTES_PER_TOKEN + 1), params)  # refused before it is rendered
    assert strict.messages[-1]["role"] == "assistant"
    engine.close()


def test_to_dict_round_trip(engines):
    engine, _ = engines
    session = ChatSession(engine, system_prompt="sys")
    session.send(TURNS[0], GREEDY)
    restored = ChatSession.from_dict(engine, session.to_dict())
    assert restored.messages == session.messages
    assert restored.turn_stats == session.turn_stats
    assert restored.params == GREEDY and restored.system_prompt == "sys"


def test_a_session_saved_in_another_format_is_refused_with_one_line(engines):
    engine, _ = engines
    saved = ChatSession(engine, system_prompt="sys").to_dict()
    with pytest.raises(EdgespecError, match="format 2"):
        ChatSession.from_dict(engine, {**saved, "format": 2})
    unnumbered = {key: value for key, value in saved.items() if key != "format"}
    assert ChatSession.from_dict(engine, unnumbered).system_prompt == "sys"  # saved before formats were numbered


DAMAGED_PARTS = {
    "messages": ({"messages": "abc"}, "messages"),
    "a message": ({"messages": [{"role": "user"}]}, "messages"),
    "a message's text": ({"messages": [{"role": "user", "content": 7}]}, "messages"),
    "system prompt": ({"system_prompt": ["sys"]}, "system prompt"),
    "first shown": ({"first_visible": 5}, "first shown message"),
    "first shown, not a number": ({"first_visible": "0"}, "first shown message"),
    "reply figures": ({"turn_stats": [3]}, "reply figures"),
    "settings": ({"params": "greedy"}, "sampling settings"),
    "stop texts": ({"params": {"temperature": 0, "stop": 5}}, "sampling settings"),
    "a stop text that is one string": ({"params": {"temperature": 0, "stop": "END"}}, "sampling settings"),
    "a setting edgespec lacks": ({"params": {"temperature": 0, "beams": 4}}, "sampling settings"),
    "a setting out of range": ({"params": {"temperature": -1}}, "temperature"),
    "context policy": ({"context_policy": "forget-all"}, "context_policy"),
}


@pytest.mark.parametrize("damage", DAMAGED_PARTS.values(), ids=DAMAGED_PARTS.keys())
def test_a_damaged_saved_session_is_refused_naming_the_part(engines, damage):
    engine, _ = engines
    change, named = damage
    saved = ChatSession(engine, system_prompt="sys").to_dict()
    with pytest.raises(ValueError, match=named):
        ChatSession.from_dict(engine, {**saved, **change})


def test_a_saved_session_that_is_not_a_record_is_refused(engines):
    engine, _ = engines
    with pytest.raises(ValueError, match="JSON object"):
        ChatSession.from_dict(engine, ["not", "a", "chat"])


def test_a_session_with_stop_texts_survives_the_round_trip_in_memory_and_through_json(engines):
    engine, _ = engines
    session = ChatSession(engine)
    session.params = SamplingParams(temperature=0, stop=("END", "\n\n"))
    in_memory = ChatSession.from_dict(engine, session.to_dict())  # the chat app's switch of models
    through_json = ChatSession.from_dict(engine, json.loads(json.dumps(session.to_dict())))  # a saved chat
    assert in_memory.params == through_json.params == session.params


def test_a_session_takes_sampling_as_keywords_as_the_engine_does(engines):
    # send("hi") wanted a SamplingParams, and send("hi", temperature=0) was an unexpected keyword
    engine, _ = engines
    keywords = ChatSession(engine).send(TURNS[0], temperature=0.0, max_tokens=GREEDY.max_tokens)
    given = ChatSession(engine).send(TURNS[0], GREEDY)
    assert keywords.token_ids == given.token_ids
    session = ChatSession(engine)
    session.send(TURNS[0], GREEDY)
    assert session.regenerate(max_tokens=3).stats.tokens_generated <= 3
    with pytest.raises(TypeError, match="unknown sampling setting 'temprature'; did you mean temperature"):
        session.send(TURNS[1], temprature=0)
