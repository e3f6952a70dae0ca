"""The library as programs use it carelessly: abandoned and interleaved streams, threads, close, wrong
arguments, odd chats.  Every case ends in the output a fresh engine gives or in one clear exception."""

from __future__ import annotations

import threading

import pytest

import edgespec
from edgespec import ChatSession, SamplingParams
from edgespec.engine import result_of
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
                lambda: list(engine.stream_tokens([1, 2], SamplingParams())), engine.forget_cache):
        with pytest.raises(EdgespecError, match=r"closed.*edgespec\.load"):
            use()


def test_an_exception_leaving_a_with_block_closes_the_engine_and_passes_through(tiny_models):
    with pytest.raises(RuntimeError, match="boom"):
        with load(tiny_models["target"]) as engine:
            next(engine.stream(PROMPTS[0], **GREEDY))
            raise RuntimeError("boom")
    with pytest.raises(EdgespecError, match="closed"):
        engine.generate(PROMPTS[0])
