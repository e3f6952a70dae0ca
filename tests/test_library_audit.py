"""The library as programs use it carelessly: abandoned and interleaved streams, threads, close, wrong
arguments, odd chats.  Every case ends in the output a fresh engine gives or in one clear exception."""

from __future__ import annotations

import threading
import time

import pytest

import edgespec
from edgespec import ChatSession, SamplingParams
from edgespec.engine import Step, result_of
from edgespec.errors import ContextOverflowError, EdgespecError

CURVE = (1.0, 1.2, 1.4, 1.6)
PROMPTS = ("one two three", "four five six seven")
GREEDY = dict(max_tokens=24, temperature=0, raw=True)


def load(path, draft="ngram", **options):
    return edgespec.load(str(path), draft, pull=False, n_ctx=512, n_threads=1, cost_curve=CURVE, **options)


@pytest.fixture(scope="module")
def plain(tiny_models):
    """What plain decoding gives for each prompt: the reference every speculative run must equal."""
    with load(tiny_models["target"], "none") as engine:
        return {prompt: engine.generate(prompt, **GREEDY).token_ids for prompt in PROMPTS}


@pytest.fixture(params=["ngram", "draft-model"])
def engine(request, tiny_models):
    draft = "ngram" if request.param == "ngram" else str(tiny_models["draft"])
    with load(tiny_models["target"], draft, draft_tokens=3) as engine:
        yield engine


def test_a_stream_left_by_break_leaves_the_caches_as_a_fresh_engine_has_them(engine, plain):
    for _ in engine.stream(PROMPTS[0], **GREEDY):
        break
    assert engine.generate(PROMPTS[1], **GREEDY).token_ids == plain[PROMPTS[1]]
    steps = engine.stream(PROMPTS[1], **GREEDY)
    next(steps), next(steps)
    steps.close()
    assert engine.generate(PROMPTS[0], **GREEDY).token_ids == plain[PROMPTS[0]]


def test_a_stream_a_traceback_keeps_is_refused_naming_the_way_out_which_works(engine, plain):
    # a retry inside `except` found the failed function's stream still open, held by the traceback's frame
    import contextlib

    def fails(closing: bool):
        steps = engine.stream(PROMPTS[0], **GREEDY)
        with contextlib.closing(steps) if closing else contextlib.nullcontext(steps):
            for i, _ in enumerate(steps):
                if i == 1:
                    raise RuntimeError("the caller's own failure")

    try:
        fails(closing=False)
    except RuntimeError:
        with pytest.raises(EdgespecError, match=r"traceback.*contextlib\.closing"):
            engine.generate(PROMPTS[1], **GREEDY)
    try:
        fails(closing=True)
    except RuntimeError:
        assert engine.generate(PROMPTS[1], **GREEDY).token_ids == plain[PROMPTS[1]]


def test_a_second_stream_while_one_is_open_in_the_same_thread_is_refused_not_a_hang(engine, plain):
    first = engine.stream(PROMPTS[0], **GREEDY)
    next(first)
    second = engine.stream(PROMPTS[1], **GREEDY)
    with pytest.raises(EdgespecError, match=r"unfinished stream.*close\(\)"):
        next(second)
    with pytest.raises(EdgespecError, match="unfinished stream"):
        engine.generate(PROMPTS[1], **GREEDY)
    rest = list(first)  # the open stream is untouched by the refusals
    assert rest[-1].result.token_ids == plain[PROMPTS[0]]
    assert engine.generate(PROMPTS[1], **GREEDY).token_ids == plain[PROMPTS[1]]


def test_two_threads_take_turns_and_each_gets_plain_decodings_output(engine, plain):
    results, errors = {}, []

    def run(prompt):
        try:
            results[prompt] = [engine.generate(prompt, **GREEDY).token_ids for _ in range(3)]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert results == {prompt: [plain[prompt]] * 3 for prompt in PROMPTS}


def test_cancel_and_keyboard_interrupt_mid_stream_leave_the_engine_consistent(engine, plain):
    cancel = threading.Event()
    for step in engine.stream(PROMPTS[0], cancel=cancel, **GREEDY):
        cancel.set()
    assert step.result.finish_reason == "cancelled"
    with pytest.raises(KeyboardInterrupt):
        for index, _ in enumerate(engine.stream(PROMPTS[0], **GREEDY)):
            if index == 1:
                raise KeyboardInterrupt
    assert engine.generate(PROMPTS[1], **GREEDY).token_ids == plain[PROMPTS[1]]


def test_a_closed_engine_refuses_every_use_and_closes_twice(tiny_models):
    engine = load(tiny_models["target"])
    open_stream = engine.stream(PROMPTS[0], **GREEDY)
    next(open_stream)
    engine.close()
    engine.close()
    with pytest.raises(EdgespecError, match="closed"):
        next(open_stream)  # suspended between steps when its models were freed
    for use in (lambda: engine.generate(PROMPTS[0], **GREEDY), lambda: list(engine.stream(PROMPTS[0])),
                lambda: engine.chat([{"role": "user", "content": "hi"}]), lambda: engine.tokenize("hi"),
                lambda: list(engine.stream_tokens([1, 2], SamplingParams())), engine.forget_cache,
                lambda: engine.n_ctx, lambda: ChatSession(engine).send("hi", SamplingParams(max_tokens=2)),
                # these three went on working on a closed engine
                lambda: engine.configure(mode="none"), lambda: engine.render_chat([{"role": "user", "content": "hi"}]),
                lambda: engine.__enter__()):
        with pytest.raises(EdgespecError, match=r"closed.*edgespec\.load"):
            use()


def test_an_exception_leaving_a_with_block_closes_the_engine_and_passes_through(tiny_models):
    with pytest.raises(RuntimeError, match="boom"):
        with load(tiny_models["target"]) as engine:
            next(engine.stream(PROMPTS[0], **GREEDY))
            raise RuntimeError("boom")
    with pytest.raises(EdgespecError, match="closed"):
        engine.generate(PROMPTS[0])


@pytest.fixture(scope="module")
def shared(tiny_models):
    with load(tiny_models["target"]) as engine:
        yield engine


@pytest.mark.parametrize("call, error, words", [
    (lambda e: e.generate("hi", {"max_tokens": 3}), TypeError, "SamplingParams"),
    (lambda e: e.generate("hi", "0.5"), TypeError, "keyword arguments"),
    (lambda e: e.stream_tokens([1, 2], {"max_tokens": 3}), TypeError, "SamplingParams"),
    (lambda e: e.generate(b"hi"), TypeError, "prompt must be a str"),
    (lambda e: e.generate(None), TypeError, "prompt must be a str"),
    (lambda e: e.generate("hi", cancel=True), TypeError, "threading.Event"),
    (lambda e: e.generate("hi", temperature="0.5"), ValueError, "temperature"),
    (lambda e: e.generate("hi", max_tokens=2.5), ValueError, "max_tokens"),
    (lambda e: e.generate("hi", seed=-1), ValueError, "seed"),
    (lambda e: e.generate("hi", top_k=True), ValueError, "top_k"),
    (lambda e: e.generate("hi", temprature=0), TypeError, "temprature"),
    (lambda e: list(e.stream_tokens([10**6], SamplingParams(max_tokens=2))), EdgespecError, "token ids from 0"),
    (lambda e: list(e.stream_tokens([-1], SamplingParams(max_tokens=2))), EdgespecError, "token ids from 0"),
    (lambda e: list(e.stream_tokens("abc", SamplingParams(max_tokens=2))), EdgespecError, "token ids"),
    (lambda e: e.chat([]), ValueError, "non-empty list"),
    (lambda e: e.chat("hi"), ValueError, "list of dicts"),
])
def test_a_wrong_argument_is_one_clear_error_and_the_engine_goes_on(shared, call, error, words):
    with pytest.raises(error, match=words):
        call(shared)
    reference = shared.generate(PROMPTS[0], **GREEDY).token_ids
    assert shared.generate(PROMPTS[0], **GREEDY).token_ids == reference


def test_sampling_keywords_and_params_together_and_stop_as_string_or_list(shared):
    together = shared.generate(PROMPTS[0], SamplingParams(max_tokens=99, seed=5), max_tokens=6, raw=True)
    assert together.token_ids == shared.generate(PROMPTS[0], max_tokens=6, seed=5, raw=True).token_ids
    assert shared.generate("x", stop="e", **GREEDY).token_ids == shared.generate("x", stop=["e"], **GREEDY).token_ids


@pytest.fixture(scope="module")
def smollm(smollm2_path):
    with edgespec.load(str(smollm2_path), "ngram", pull=False, n_ctx=256, n_threads=1, cost_curve=CURVE) as engine:
        yield engine


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "42"}], [{"role": "function", "content": "42"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}],
    [{"role": "system", "content": "Only a system prompt."}],
])
def test_odd_roles_render_as_the_template_writes_them(smollm, messages):
    result = smollm.chat(messages, max_tokens=4, temperature=0)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    by_tokens = result_of(smollm.stream_tokens(smollm.chat_tokens(messages), greedy))
    assert result.token_ids == by_tokens.token_ids
    for message in messages:
        assert f"<|im_start|>{message['role']}\n{message['content']}" in smollm.render_chat(messages)


def test_a_chat_session_runs_many_turns_past_a_full_context(smollm):
    params = SamplingParams(max_tokens=40, temperature=0)
    session = ChatSession(smollm)
    notices = 0
    for turn in range(8):
        events = list(session.stream(f"Tell me a long story about the number {turn} and all around it.", params))
        notices += sum(isinstance(event, edgespec.Notice) for event in events)
        assert events[-1].result.stats.prompt_tokens + params.max_tokens <= smollm.n_ctx
    assert notices > 0 and len(session.messages) == 16 and session.first_visible > 0
    strict = ChatSession(smollm, context_policy="error")
    with pytest.raises(ContextOverflowError, match="n_ctx"):
        for turn in range(8):
            strict.send(f"Tell me a long story about the number {turn} and all around it.", params)
    assert strict.messages[-1]["role"] == "assistant"  # the refused turn left nothing behind


def test_a_chat_session_refuses_a_wrong_message_or_params_and_keeps_its_conversation(smollm):
    session = ChatSession(smollm)
    with pytest.raises(TypeError, match="message must be a str"):
        session.send(b"hi", SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="SamplingParams"):
        session.send("hi", {"max_tokens": 2})
    assert session.messages == []
    # None means the defaults; where the reply ends is the model's text, so only its bounds are checked
    result = session.send("hi", None)
    assert result.finish_reason in ("stop", "length", "context")
    assert result.stats.tokens_generated <= SamplingParams().max_tokens
    assert result.stats.prompt_tokens + result.stats.tokens_generated <= smollm.n_ctx
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


@pytest.mark.parametrize("interrupted_pass", [1, 2, 3])
def test_a_ctrl_c_as_a_pass_returns_leaves_the_caches_consistent(engine, plain, monkeypatch, interrupted_pass):
    # Python raises a Ctrl+C at the first bytecode after the C call, with the pass's tokens in the KV cache
    from edgespec.backend import context

    real, calls = context.llama_cpp.llama_decode, []

    def interrupted(*args):
        status = real(*args)
        calls.append(status)
        if len(calls) == interrupted_pass:
            raise KeyboardInterrupt
        return status

    engine.generate(PROMPTS[1], **GREEDY)
    monkeypatch.setattr(context.llama_cpp, "llama_decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[0], **GREEDY)
    monkeypatch.setattr(context.llama_cpp, "llama_decode", real)
    for prompt in (PROMPTS[0], PROMPTS[1]):
        assert engine.generate(prompt, **GREEDY).token_ids == plain[prompt]


def test_a_chat_turn_while_its_last_reply_still_streams_is_refused_and_changes_nothing(smollm):
    params = SamplingParams(max_tokens=6, temperature=0)
    session = ChatSession(smollm)
    open_reply = session.stream("one", params)
    next(open_reply)
    for turn in (lambda: session.send("two", params), lambda: session.stream("two", params)):
        with pytest.raises(EdgespecError, match=r"still streaming.*close\(\)"):
            turn()
    assert [m["content"] for m in session.messages] == ["one"]
    reply = result_of(open_reply)
    assert session.messages[-1] == {"role": "assistant", "content": reply.text}
    for _ in session.stream("two", params):
        break  # a stream left by break ends the turn: the next one is taken
    assert session.send("three", params).finish_reason in ("stop", "length")


def test_an_edit_or_system_prompt_that_is_no_text_is_refused_before_it_breaks_the_chat(smollm):
    session = ChatSession(smollm)
    session.send("hi", SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="message must be a str"):
        session.edit_user_message(0, b"hi")
    with pytest.raises(TypeError, match="system prompt must be a str"):
        session.set_system_prompt(42)
    assert session.messages[0]["content"] == "hi" and session.system_prompt is None
    with pytest.raises(TypeError, match="system prompt must be a str"):
        ChatSession(smollm, system_prompt=b"Be brief.")
    assert result_of(session.stream_regenerate(SamplingParams(max_tokens=2))).finish_reason in ("stop", "length")


def test_emptying_the_caches_under_an_open_stream_is_refused_and_the_stream_stays_exact(engine, plain):
    steps = []
    for step in engine.stream(PROMPTS[0], **GREEDY):
        with pytest.raises(EdgespecError, match="unfinished stream"):
            engine.forget_cache()
        steps.append(step)
    assert steps[-1].result.token_ids == plain[PROMPTS[0]]
    engine.forget_cache()
    assert engine.generate(PROMPTS[0], **GREEDY).token_ids == plain[PROMPTS[0]]


@pytest.mark.parametrize("curve", ["1.0", (1.0, -1.0), (), ("a",), None.__class__])
def test_a_cost_curve_that_is_no_curve_names_the_parameter(tiny_models, curve):
    with pytest.raises(ValueError, match=r"cost_curve.*like \(1\.0, 1\.2"):
        edgespec.load(str(tiny_models["target"]), "ngram", pull=False, n_ctx=512, n_threads=1, cost_curve=curve)


@pytest.mark.parametrize("steps_read", [0, 1, 3])
def test_a_reply_left_by_break_is_recorded_as_cancelled_with_what_was_shown(smollm, steps_read):
    # The user message stayed unanswered, and the next turn's stood beside it: two user messages in a row.
    params = SamplingParams(max_tokens=40, temperature=0)
    session = ChatSession(smollm)
    shown, reply = "", session.stream("Count from one to twenty.", params)
    for _ in range(steps_read):
        event = next(reply)
        shown += event.text if isinstance(event, Step) else ""
    reply.close()
    if steps_read == 0:  # never started: nothing was generated, and the message waits for stream_reply
        assert [m["role"] for m in session.messages] == ["user"]
        return
    assert session.messages[-1] == {"role": "assistant", "content": shown, "cancelled": True}
    assert session.turn_stats[-1]["finish_reason"] == "cancelled"
    session.send("And back.", params)
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_a_thread_given_an_ended_threads_ident_is_not_taken_for_the_holder_of_its_stream():
    # Python (glibc's threads) gives an ended thread's ident to the next thread made: the old lock refused
    # that thread as "this thread still holds an unfinished stream", a stream the ended thread had left
    from edgespec.generation_lock import GenerationLock

    lock = GenerationLock()
    holder = threading.Thread(target=lock.__enter__)  # starts a stream and ends with it unfinished
    holder.start()
    holder.join()
    errors, asking = [], threading.Event()

    def generate_next():
        asking.set()
        try:
            with lock:
                pass
        except EdgespecError as error:
            errors.append(error)

    waiter = threading.Thread(target=generate_next)
    waiter.start()
    asking.wait(timeout=60)
    time.sleep(0.2)  # lets the waiter ask first: the old lock refused it at once, the new one waits
    lock.__exit__()  # the left stream is closed (as its garbage collection does): the waiter goes on
    waiter.join(timeout=60)
    if waiter.ident != holder.ident:
        pytest.skip("this platform gave the next thread a new ident")
    assert not waiter.is_alive() and errors == []


@pytest.mark.parametrize("use", ["raw", "bit_exact"])
def test_a_switch_given_anything_but_true_or_false_is_refused(tiny_models, use):
    # raw="no" and bit_exact="no" read as True, the opposite of what they say
    engine = load(tiny_models["target"])
    try:
        with pytest.raises(EdgespecError, match=f"{use} must be True or False, not 'no'"):
            if use == "raw":
                engine.generate(PROMPTS[0], max_tokens=2, raw="no")
            else:
                engine.configure(bit_exact="no")
    finally:
        engine.close()
