"""End-to-end exactness of the engine on tiny GGUF models (real llama.cpp, no mocks)."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter

import numpy as np
import pytest

from edgespec import Done, SamplingParams, Step
from edgespec.backend import LlamaModel, probe_pass_widths
from edgespec.errors import flag_worded
from edgespec.loading import load_engine
from edgespec.drafters import Drafter
from edgespec.text import TextAssembler
from edgespec.errors import ContextOverflowError, VocabMismatchError
from edgespec.sampling import to_probs

PROMPTS = [
    "the cat sat on the mat and the cat",
    "hello world, hello world, hello",
    "Add type hints: def add(a, b): return a + b",
]


# A cost per pass width (in one-token passes) for the engines whose drafts the tests count: with
# it the draft lengths do not depend on how fast or busy the test machine is. Widths up to 9, so
# up to 8 draft tokens.
FIXED_COST = (1.0, 1.3, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1, 3.4)


@pytest.fixture(scope="module")
def engine(tiny_models):
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=512, draft_tokens=3, cost_curve=FIXED_COST)
    yield engine
    engine.close()


def generate_ids(engine, mode, prompt, params, draft_tokens):
    engine.configure(mode=mode)
    engine.configure(draft_tokens=draft_tokens)
    return engine.generate(prompt, params, raw=True)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("draft_tokens", [1, 3, 8, "auto"])
def test_greedy_output_is_identical_in_every_mode(engine, prompt, draft_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = generate_ids(engine, "none", prompt, params, draft_tokens)
    assert plain.stats.target_passes_per_token >= 1.0
    for mode in ("combined", "draft-model", "ngram"):
        result = generate_ids(engine, mode, prompt, params, draft_tokens)
        assert result.token_ids == plain.token_ids, mode
        assert result.text == plain.text
        assert result.stats.draft_tokens_accepted <= result.stats.draft_tokens_proposed


def test_speculation_saves_target_passes_on_a_repetitive_text(engine):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    result = generate_ids(engine, "ngram", PROMPTS[1], params, 4)
    stats = result.stats
    assert 0 < stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    assert stats.target_forward_passes == stats.steps
    assert stats.target_forward_passes == stats.tokens_generated - stats.draft_tokens_accepted
    assert stats.target_passes_per_token < 1.0


def exact_two_token_law(target_path, prompt_ids, params):
    """P(first two tokens) computed from the target's own logits."""
    model = LlamaModel(target_path, n_ctx=256)
    first = to_probs(model.decode(prompt_ids, 1)[0], params)
    law = {}
    for x1 in np.flatnonzero(first):
        model.rewind(len(prompt_ids))
        second = to_probs(model.decode([int(x1)], 1)[0], params)
        for x2 in np.flatnonzero(second):
            law[(int(x1), int(x2))] = first[x1] * second[x2]
    model.close()
    return law


def test_a_ctrl_c_as_a_free_call_returns_leaves_nothing_to_free_twice(tiny_models, monkeypatch):
    # A Ctrl+C raised just as llama.cpp's free returned left the handle set, and close() or __del__ freed it
    # again: "edgespec: interrupted", then "double free or corruption" and exit -6 (or -11).
    import llama_cpp

    model = LlamaModel(tiny_models["target"], n_ctx=256)
    calls = Counter()

    def interrupted_free(name):
        def free(handle):  # frees nothing (a second real free would crash the test); what counts is the calls
            calls[name] += 1
            raise KeyboardInterrupt  # the Ctrl+C, due as the call returns
        return free

    for name in ("llama_free", "llama_model_free", "llama_batch_free"):
        monkeypatch.setattr(llama_cpp, name, interrupted_free(name))
    for _ in range(4):  # each close cut short by a Ctrl+C, then done again, as __del__ does
        try:
            model.close()
        except KeyboardInterrupt:
            pass
    assert calls == {"llama_free": 1, "llama_model_free": 1, "llama_batch_free": 1}


@pytest.mark.parametrize("bit_exact", [False, True])
def test_sampled_draft_model_output_has_the_targets_distribution(engine, tiny_models, bit_exact):
    prompt = PROMPTS[0]
    prompt_ids = engine.prompt_tokens(prompt, raw=True)
    law = exact_two_token_law(tiny_models["target"], prompt_ids, SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0))
    engine.configure(mode="draft-model", draft_tokens=2, bit_exact=bit_exact)
    n = 3000
    counts, proposed, accepted = Counter(), 0, 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, max_tokens=2, seed=seed)
        result = engine.generate(prompt, params, raw=True)
        counts[tuple(result.token_ids)] += 1
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
    assert 0.2 < accepted / proposed < 0.95, "the draft must be right sometimes and wrong sometimes"
    assert set(counts) <= set(law), "emitted a pair the target gives probability 0"
    # chi-square over outcomes with enough expected mass, the rest pooled
    stat, pooled_expected, pooled_count, bins = 0.0, 0.0, 0, 0
    for outcome, prob in law.items():
        expected = prob * n
        if expected >= 5:
            stat += (counts[outcome] - expected) ** 2 / expected
            bins += 1
        else:
            pooled_expected += expected
            pooled_count += counts[outcome]
    if pooled_expected > 0:
        stat += (pooled_count - pooled_expected) ** 2 / pooled_expected
        bins += 1
    # the 1e-4 upper quantile of chi-square is below 2 * dof + 25 for these dof; seeds are fixed
    assert stat < 2 * (bins - 1) + 25, (stat, bins)


def test_a_fixed_seed_reproduces_a_sampled_run(engine):
    engine.configure(mode="draft-model")
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=42)
    first = engine.generate(PROMPTS[2], params, raw=True)
    again = engine.generate(PROMPTS[2], params, raw=True)
    assert first.token_ids == again.token_ids


def test_vocabulary_mismatch_names_both_files(tiny_models):
    with pytest.raises(VocabMismatchError) as error:
        load_engine(tiny_models["target"], tiny_models["mismatch"], n_ctx=256, draft_tokens=2)
    message = str(error.value)
    assert "mismatch.gguf" in message and "target.gguf" in message and "\n" not in message


def test_stop_string_max_tokens_and_context_limit(engine, tiny_models):
    engine.configure(mode="ngram")
    plain = engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40), raw=True)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 40
    stop = plain.text[10:14]
    stopped = engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)), raw=True)
    assert stopped.finish_reason == "stop"
    assert stopped.text == plain.text[: plain.text.index(stop)]

    small = load_engine(tiny_models["target"], "ngram", n_ctx=256, draft_tokens=4, cost_curve=FIXED_COST)
    result = small.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1000), raw=True)
    assert result.finish_reason == "context"
    assert len(small.prompt_tokens(PROMPTS[0], raw=True)) + len(result.token_ids) == small.n_ctx
    with pytest.raises(ContextOverflowError, match="maximum context length is 256 tokens"):
        small.generate("word " * 300, SamplingParams(), raw=True)
    exactly_full = small.prompt_tokens("word " * 300, raw=True)[: small.n_ctx]
    with pytest.raises(ContextOverflowError, match="it has 256 tokens, which leaves no room for a reply"):
        list(small.stream_tokens(exactly_full, SamplingParams()))
    small.close()


def test_a_stop_string_that_never_comes_whole_holds_back_no_text_of_a_stream(engine, tiny_models):
    """A stream's text (its Steps' and its Done's) is its answer's, also when the answer ends (max_tokens, a
    full context) while its last characters wait as the start of a stop string that never comes whole."""
    engine.configure(mode="ngram")
    small = load_engine(tiny_models["target"], "ngram", n_ctx=256, draft_tokens=4, cost_curve=FIXED_COST)
    try:
        endings = ((engine, PROMPTS[1], 40, "length"), (small, PROMPTS[0], 1000, "context"))
        for model, prompt, max_tokens, ending in endings:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            free = model.generate(prompt, params, raw=True)
            assert free.finish_reason == ending and len(free.text) > 3
            # it starts with the answer's last three characters and goes on with one the answer lacks
            never = free.text[-3:] + next(c for c in "~@#\u2603" if c not in free.text)
            events = list(model.stream(prompt, dataclasses.replace(params, stop=(never,)), raw=True))
            done = events[-1]
            assert "".join(event.text for event in events) == done.result.text == free.text
            assert done.text == free.text[-3:] and done.result.finish_reason == ending
    finally:
        small.close()


def test_a_character_cut_off_by_the_end_is_dropped_not_shown_as_a_replacement():
    text = TextAssembler(stops=())
    assert text.feed("ok 🙂".encode()[:-2]) == "ok "
    assert text.flush() == "" and text.text == "ok "


def test_streamed_pieces_add_up_to_the_text(engine):
    engine.configure(mode="draft-model")
    events = list(engine.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30), raw=True))
    assert isinstance(events[-1], Done)
    steps = [e for e in events if isinstance(e, Step)]
    pieces = "".join(t.text for e in steps for t in e.tokens) + events[-1].text
    assert pieces == events[-1].result.text
    assert [t.id for e in steps for t in e.tokens] == events[-1].result.token_ids
    drafted = sum(t.drafted for e in steps for t in e.tokens)
    assert drafted == events[-1].result.stats.draft_tokens_accepted


def test_cancel_stops_within_a_step(engine):
    engine.configure(mode="ngram")
    cancel = threading.Event()
    steps = 0
    for event in engine.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=200), raw=True, cancel=cancel):
        if isinstance(event, Step):
            steps += 1
            if steps == 3:
                cancel.set()
        else:
            result = event.result
    assert result.finish_reason == "cancelled" and steps == 3
    # the cache stayed consistent: the next greedy run equals a fresh plain run
    params = SamplingParams(temperature=0.0, max_tokens=20)
    after = engine.generate(PROMPTS[2], params, raw=True)
    engine.configure(mode="none")
    assert engine.generate(PROMPTS[2], params, raw=True).token_ids == after.token_ids


@pytest.fixture
def long_prompt_engine(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=4096, draft_tokens=3, cost_curve=FIXED_COST)
    yield engine
    engine.close()


def test_a_cancel_during_a_long_prefill_stops_it_after_the_current_chunk(long_prompt_engine):
    # The prompt went into the cache whole before a cancel was looked at: an Esc in a long prompt's
    # prefill waited for all of it (13 s for 9,000 characters on SmolLM2 with one thread).
    engine = long_prompt_engine
    prompt = engine.prompt_tokens(" ".join(PROMPTS) * 40, raw=True)[:3 * engine.target.n_batch]
    assert len(prompt) > 2 * engine.target.n_batch
    cancel, decode = threading.Event(), engine.target.decode

    def decode_then_cancel(*args, **kwargs):  # the real pass, then the user's Esc
        rows = decode(*args, **kwargs)
        cancel.set()
        return rows

    engine.target.decode = decode_then_cancel
    try:
        [done] = engine.stream_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=20), cancel=cancel)
    finally:
        del engine.target.decode
    assert done.result.finish_reason == "cancelled" and done.result.token_ids == []
    assert engine.target.cached == prompt[:engine.target.n_batch]  # one chunk of three, and a consistent cache
    params = SamplingParams(temperature=0.0, max_tokens=20)
    after = engine.generate(PROMPTS[2], params, raw=True)
    engine.configure(mode="none")
    assert engine.generate(PROMPTS[2], params, raw=True).token_ids == after.token_ids


def test_text_is_never_split_inside_a_utf8_character():
    text = TextAssembler(stops=())
    data = "héllo 世界 🙂".encode()
    pieces = [text.feed(data[i : i + 1]) for i in range(len(data))] + [text.flush()]
    assert "".join(pieces) == "héllo 世界 🙂"
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_possible_stop_string_is_held_back_until_settled():
    text = TextAssembler(stops=("END",))
    assert text.feed(b"abc E") == "abc "
    assert text.feed(b"N") == ""
    assert text.feed(b"x") == "ENx"
    assert text.feed(b" EN") == " "
    assert text.feed(b"D tail") == "" and text.stopped
    assert text.text == "abc ENx "


# -- the adaptive draft length (auto k) in the real loop ------------------------------------

# A CPU-like cost per pass width (in single steps), given to the engine, so the controller's
# choices do not depend on how busy the test machine is.
CPU_LIKE_COST = (1.0, 1.5, 2.2, 3.0, 3.6, 4.2, 6.5, 8.8, 9.0, 9.2, 9.4, 9.6, 9.8, 10.0, 10.2, 10.4, 10.5)


class ScriptedDrafter(Drafter):
    """Test-only drafter: proposes the target's own greedy continuation, or a token it never emits."""

    name = "ngram"
    forward_passes = 0

    def __init__(self, reference: list[int], prompt_len: int, wrong_token: int):
        self.reference, self.prompt_len, self.wrong_token = reference, prompt_len, wrong_token
        self.right = False

    def peek(self, context):
        from edgespec.drafters import Hint, ngram_signal

        return Hint(ngram_signal("context", 8), None)  # an 8-token match, right or wrong alike

    def propose(self, context, k, params, rng, stop_below=()):
        from edgespec.drafters import Proposal

        done = len(context) - self.prompt_len
        if self.right:
            return Proposal(self.reference[done : done + k])
        return Proposal([self.wrong_token] * k)


def drive(engine, prompt_ids, steps):
    """Proposed draft tokens per step, and the tokens each step emitted."""
    proposed, emitted = [], []
    events = engine.stream_tokens(prompt_ids, SamplingParams(temperature=0.0, max_tokens=steps * 40))
    for event in events:
        if isinstance(event, Step):
            proposed.append(event.drafted)
            emitted.append(len(event.tokens))
            if len(proposed) == steps:
                break
    events.close()  # releases the engine for the next generation
    return proposed, emitted


@pytest.fixture
def auto_engine(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=4096, draft_tokens="auto", n_threads=1,
                         cost_curve=CPU_LIKE_COST)
    assert engine.max_draft_tokens == len(CPU_LIKE_COST) - 1
    prompt_ids = engine.prompt_tokens(PROMPTS[0], raw=True)
    engine.configure(mode="none")
    reference = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3000), raw=True).token_ids
    wrong = engine.tokenize("<|user|>")[0]  # a control token: its output row is zero, so never the argmax
    drafter = ScriptedDrafter(reference, len(prompt_ids), wrong)
    engine.planner.drafters["ngram"] = drafter
    engine.configure(mode="ngram")
    yield engine, prompt_ids, drafter, reference
    engine.close()


def test_auto_k_keeps_greedy_output_exact(auto_engine):
    engine, prompt_ids, drafter, reference = auto_engine
    for right in (True, False):
        drafter.right = right
        result = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200), raw=True)
        assert result.token_ids == reference[:200]


def test_auto_k_backs_off_from_a_drafter_that_is_always_wrong_then_recovers(auto_engine):
    engine, prompt_ids, drafter, _ = auto_engine
    proposed, emitted = drive(engine, prompt_ids, 400)
    assert all(n == 1 for n in emitted), "every draft token must be rejected"
    settled = next(i for i, k in enumerate(proposed) if k == 0)
    assert settled <= 10, f"still drafting after {settled} steps"
    # after settling, the cost per token stays within 5% of plain decoding's
    tail = proposed[settled:]
    cost = sum(CPU_LIKE_COST[k] for k in tail)
    assert len(tail) * CPU_LIKE_COST[0] / cost >= 0.95, (sum(tail), len(tail))

    drafter.right = True
    # 120 steps of up to 17 tokens stay inside the 3000-token reference the drafter copies from
    proposed, emitted = drive(engine, prompt_ids, 120)
    assert max(proposed[-50:]) >= 4, "k did not come back once the drafter was right"
    assert sum(emitted[-50:]) / 50 >= 4


# -- calibration: a given curve, the first-load notice, stale curves -------------------------

# Two machines as their measured curves: a GPU-like one where a wide pass costs about one token,
# and a slow CPU where a pass costs per token (so no draft pays).
GPU_LIKE = tuple(1.0 + 0.01 * n for n in range(33))
SLOW_CPU = tuple(float(n) for n in range(1, 34))


def plant_curve(engine, curve, stale=False):
    """Store `curve` as this machine's measured curve for engine's target, as an earlier load would."""
    from edgespec.backend import RUNTIME
    from edgespec.calibration import CalibrationCache, CalibrationKey

    cache = CalibrationCache()
    key = CalibrationKey.for_model(engine.target.path, engine.target.n_gpu_layers, engine.target.n_threads, RUNTIME)
    cache.store(key, len(curve), curve)
    if stale:
        cache.mark_stale(key)
    return cache, key


def k_per_step(tiny_models, measured_curve, **load):
    """The draft length of every step of one greedy n-gram generation, on a machine that measured `measured_curve`."""
    probe = load_engine(tiny_models["target"], "none", n_ctx=1024, draft_tokens=0, n_threads=1, cost_curve=(1.0,))
    plant_curve(probe, measured_curve)
    probe.close()
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=1024, draft_tokens="auto", n_threads=1, **load)
    ks = []
    for event in engine.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=120), raw=True):
        if isinstance(event, Step):
            ks.append(event.drafted)
    engine.close()
    return ks


def test_a_given_cost_curve_makes_the_draft_lengths_independent_of_the_machine(tiny_models):
    measured = [k_per_step(tiny_models, curve) for curve in (GPU_LIKE, SLOW_CPU)]
    assert measured[0] != measured[1], "the measured curve steers the controller"
    given = [k_per_step(tiny_models, curve, cost_curve=CPU_LIKE_COST) for curve in (GPU_LIKE, SLOW_CPU)]
    assert given[0] == given[1]
    assert max(given[0]) > 0


def test_the_first_load_says_it_measures_and_later_loads_reuse_the_measurement(tiny_models):
    notices = []
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    assert any("measuring this model's speed, once" in n for n in notices), notices
    assert engine.plain_step_seconds > 0 and not engine.calibration_due
    engine.close()
    notices.clear()
    load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append).close()
    assert not any("measuring" in n for n in notices), notices
    given = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append,
                        cost_curve=(1.0, 1.5, 2.0))
    assert not any("measuring" in n for n in notices)
    assert given.max_draft_tokens == 2 and given.plain_step_seconds is None and not given.calibration_due
    given.close()


def test_a_cache_folder_that_cannot_be_written_is_named_once_at_the_measurement(tiny_models, tmp_path, monkeypatch):
    # EDGESPEC_CACHE_DIR=/dev/null measured the model's speed at every start, saying each time that later runs
    # would reuse it.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(blocker))
    notices = []
    load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append).close()
    unsaved = [n for n in notices if "cannot save this model's speed" in n]
    assert len(unsaved) == 1 and f"{blocker} is not a folder" in unsaved[0] and "EDGESPEC_CACHE_DIR" in unsaved[0]


def test_exact_width_probe_keeps_to_its_budget(tiny_models):
    model = LlamaModel(tiny_models["target"], n_ctx=256, n_threads=1)
    probe = model.tokenize("the cat sat on the mat and the dog " * 8, add_special=True)
    full = probe_pass_widths(model, probe, 33)
    # Which widths are exact is the kernels' to say (all 33 with this x86 build's, not with every backend's):
    # the widths are checked narrowest first up to the first that is not
    exact = full.exact_width
    assert 1 <= exact <= 33 and all(full.drift[w] == 0.0 for w in range(2, exact + 1))
    assert set(full.drift) == set(range(2, min(exact + 1, 33) + 1))
    assert exact == 33 or full.drift[exact + 1] > 0.0
    quick = probe_pass_widths(model, probe, 33, budget_seconds=0.0)
    assert set(quick.drift) == {2}, "only the width always checked"
    assert quick.exact_width == (2 if quick.drift[2] == 0.0 else 1)
    assert model.cached == [] and model.forward_passes == 0
    model.close()


# An old measurement, e.g. taken under load: 1000 s per pass, exact up to width 3.
OLD_CURVE = (1000.0, 1001.0, 1002.0)


def test_a_stale_curve_is_measured_again_at_load_but_keeps_its_exact_width(tiny_models):
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    cache, key = plant_curve(first, OLD_CURVE, stale=True)
    first.close()
    notices = []
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    assert any("measuring this model's speed again" in n for n in notices), notices
    assert engine.exact_width == 3, "bit-exactness does not depend on load: the width is kept"
    assert engine.plain_step_seconds < OLD_CURVE[0] and not engine.calibration_due
    assert cache.load_entry(key) is not None
    engine.close()


def test_a_stale_curve_can_be_used_at_once_and_measured_between_generations(tiny_models):
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    cache, key = plant_curve(first, OLD_CURVE, stale=True)
    first.close()
    notices = []
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append,
                         measure_stale_curve=False)
    assert not any("measuring" in n for n in notices), "nothing measured at load"
    assert engine.plain_step_seconds == OLD_CURVE[0] and engine.calibration_due

    events = engine.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30), raw=True)
    assert isinstance(next(events), Step)  # a generation is running
    remeasure = threading.Thread(target=engine.recalibrate)
    remeasure.start()
    remeasure.join(timeout=0.5)
    assert remeasure.is_alive(), "re-measuring waits for the generation to end"
    assert engine.plain_step_seconds == OLD_CURVE[0]
    result = [e for e in events if isinstance(e, Done)][0].result
    remeasure.join(timeout=60)
    assert not remeasure.is_alive()
    assert result.finish_reason == "length"
    assert engine.plain_step_seconds < OLD_CURVE[0] and not engine.calibration_due
    assert engine.exact_width == 3 and cache.load_entry(key) is not None
    engine.close()


def test_a_generations_speedup_is_against_its_own_plain_pace_not_the_calibrated_one(tiny_models):
    # A cached curve is kept while only the machine's speed moves: its one-token pass may be of a slower hour.
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    plant_curve(first, OLD_CURVE)
    first.close()
    engine = load_engine(tiny_models["target"], "none", n_ctx=256, n_threads=1)
    assert engine.plain_step_seconds == OLD_CURVE[0], "the fresh cached curve is used as it is"
    steps = list(engine.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12), raw=True))
    first_step, done = steps[0], steps[-1]
    assert 0 < first_step.stats.plain_step_seconds < 1.0, "from the first timed pass on, this generation's own"
    stats = done.result.stats
    assert stats.tokens_generated == 12 and 0 < stats.plain_step_seconds < 1.0
    assert stats.decode_speedup < 10, "against 1000 s a pass it would read 100000x"
    engine.close()


def test_a_plain_generation_estimates_plain_decoding_at_exactly_its_own_time(tiny_models):
    # Whatever its steps took: a plain generation is plain decoding, so it cannot read faster or slower
    # than itself (the median step alone read 0.94-1.01x on Qwen).
    engine = load_engine(tiny_models["target"], "none", n_ctx=256, n_threads=1)
    steps = [e for e in engine.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20), raw=True)
             if isinstance(e, Step)]
    engine.close()
    stats = steps[-1].stats
    assert stats.tokens_generated >= 1 and stats.decode_seconds > 0
    assert stats.tokens_generated * stats.plain_step_seconds == pytest.approx(stats.decode_seconds, rel=1e-9)
    assert stats.decode_speedup == pytest.approx(1.0, rel=1e-9)


# -- --draft auto keeps the draft model only where its measured cost pays ----------------------

CHEAP_WIDE_PASSES = (1.0, 1.6, 2.1, 2.2, 3.2)  # the AVX2 EPYC's shape


@pytest.fixture
def auto_draft(tiny_models, tmp_path, monkeypatch):
    """--draft auto resolves to the tiny draft: the user imported it as the tiny target's draft."""
    from edgespec.model_import import import_model

    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "store"))
    import_model(tiny_models["target"], name="tiny-target")
    import_model(tiny_models["draft"], name="tiny-draft", draft_for="tiny-target")
    return tiny_models


@pytest.mark.parametrize("draft_share, kept", [(0.4, False), (0.05, True)])
def test_draft_auto_drops_a_draft_model_whose_measured_cost_cannot_pay(auto_draft, draft_share, kept):
    from edgespec.costs import CostModel

    notices = []
    engine = load_engine(auto_draft["target"], "auto", n_threads=1, notice=notices.append,
                         cost_curve=CostModel(CHEAP_WIDE_PASSES, draft_seconds_per_token=draft_share))
    try:
        assert (engine.draft_model is not None) is kept
        assert engine.mode == ("combined" if kept else "ngram")
        line = notices[-1]
        assert ("n-grams only" in line) is not kept and f"{draft_share:.0%}" in line
        if not kept:  # the library names the parameter, the command line its flag (errors.Wording)
            assert f"draft={str(auto_draft['draft'])!r}" in line and f"--draft {auto_draft['draft']}" in flag_worded(line)
            assert engine.plan.mode == "ngram"
            assert engine.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=8), raw=True).token_ids
    finally:
        engine.close()


def test_an_explicit_draft_model_is_kept_with_a_warning_when_it_cannot_pay(auto_draft):
    from edgespec.costs import CostModel

    notices = []
    engine = load_engine(auto_draft["target"], auto_draft["draft"], n_threads=1, notice=notices.append,
                         cost_curve=CostModel(CHEAP_WIDE_PASSES, draft_seconds_per_token=0.4))
    try:
        assert engine.draft_model is not None and engine.mode == "combined"
        assert "as asked" in notices[-1] and "draft='ngram'" in notices[-1]
        assert "--draft ngram" in flag_worded(notices[-1])
    finally:
        engine.close()


def test_a_draft_model_that_cannot_pay_is_not_fed_the_prompt_until_it_drafts(auto_draft):
    """Kept as asked where its tokens cost too much, the draft model is never chosen per step, so feeding it
    the prompt would only add its prefill to the wait; a fixed draft length drafts with it, caught up."""
    from edgespec.costs import CostModel

    # at 80% of a target step a draft token loses even where 90% of the drafts are kept (controller.PROBE_ACCEPTANCE)
    engine = load_engine(auto_draft["target"], auto_draft["draft"], n_threads=1, notice=lambda line: None,
                         cost_curve=CostModel(CHEAP_WIDE_PASSES, draft_seconds_per_token=0.8))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    try:
        prompt_ids = engine.prompt_tokens(prompt, raw=True)
        engine.configure(mode="none")
        plain = engine.generate(prompt, params, raw=True)
        passes = engine.draft_model.forward_passes
        engine.configure(mode="combined")
        combined = engine.generate(prompt, params, raw=True)
        assert engine.draft_model.forward_passes == passes and combined.stats.draft_forward_passes == 0
        assert engine.draft_model.cached[: len(prompt_ids) - 1] != prompt_ids[:-1]
        assert combined.token_ids == plain.token_ids

        engine.configure(mode="draft-model", draft_tokens=2)
        drafted = engine.generate(prompt, params, raw=True)
        assert drafted.stats.draft_tokens_proposed > 0 and drafted.stats.draft_forward_passes > 0
        assert engine.draft_model.cached[: len(prompt_ids) - 1] == prompt_ids[:-1]
        assert drafted.token_ids == plain.token_ids
    finally:
        engine.close()


# -- and decides on it before loading it, from the share timed with the target's cached curve -------------

def remember_curve_and_draft_share(models, curve, share=None):
    """The calibration an earlier `--draft auto` load on this machine left: the target's curve and, when share
    is given, the draft token's share of a target step timed with it (both models on the CPU, f16 caches)."""
    from edgespec.backend import RUNTIME
    from edgespec.calibration import CalibrationCache, CalibrationKey, draft_model_key

    cache, key = CalibrationCache(), CalibrationKey.for_model(models["target"], 0, 1, RUNTIME)
    cache.store(key, len(curve), curve)
    if share is not None:
        cache.store_draft_share(key, draft_model_key(models["draft"], 0), share)
    return cache, key


@pytest.fixture
def model_loads(monkeypatch):
    """The path of every model load_engine loads, in order."""
    import edgespec.loading

    loaded = []

    class CountedModel(LlamaModel):
        def __init__(self, path, **options):
            loaded.append(str(path))
            super().__init__(path, **options)

    monkeypatch.setattr(edgespec.loading, "LlamaModel", CountedModel)
    return loaded


@pytest.fixture
def draft_share_timings(monkeypatch):
    """Every timing of a draft token's share, each answering 0.9 of a target step (draft_cost.py times it)."""
    import edgespec.cost_profile

    timed = []

    def share(target, draft, notice=None):
        timed.append(str(draft.path))
        return 0.9

    monkeypatch.setattr(edgespec.cost_profile, "draft_token_share", share)
    return timed


def test_draft_auto_does_not_load_a_draft_model_that_its_remembered_share_says_cannot_pay(auto_draft, model_loads,
                                                                                          draft_share_timings):
    remember_curve_and_draft_share(auto_draft, GPU_LIKE, share=0.9)
    notices = []
    engine = load_engine(auto_draft["target"], "auto", n_threads=1, notice=notices.append)
    try:
        assert model_loads == [str(auto_draft["target"])] and draft_share_timings == []
        assert engine.draft_model is None and engine.mode == "ngram" and engine.plan.mode == "ngram"
        assert engine.plan.reason.startswith("n-grams only:") and "90%" in engine.plan.reason
        said = [line for line in notices if "n-grams only" in line]
        assert len(said) == 1 and "90%" in said[0] and f"--draft {auto_draft['draft']}" in flag_worded(said[0])
        assert engine.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=8), raw=True).token_ids
    finally:
        engine.close()


def test_a_draft_models_share_is_timed_once_per_curve_and_a_draft_that_pays_is_loaded(auto_draft, model_loads,
                                                                                      draft_share_timings):
    cache, key = remember_curve_and_draft_share(auto_draft, GPU_LIKE)
    for _ in range(2):  # timed at the first load, which drops it; not loaded at the second
        load_engine(auto_draft["target"], "auto", n_threads=1, notice=lambda line: None).close()
    assert model_loads == [str(auto_draft["target"]), str(auto_draft["draft"]), str(auto_draft["target"])]
    assert draft_share_timings == [str(auto_draft["draft"])]
    assert list(cache.read(key).draft_shares.values()) == [0.9]

    cache.store(key, len(GPU_LIKE), GPU_LIKE)  # the curve measured again: its shares go with it
    assert cache.read(key).draft_shares == {}
    remember_curve_and_draft_share(auto_draft, GPU_LIKE, share=0.05)
    engine = load_engine(auto_draft["target"], "auto", n_threads=1, notice=lambda line: None)
    try:
        assert engine.draft_model is not None and engine.mode == "combined"
        assert engine.cost.draft_seconds_per_token == pytest.approx(0.05 * GPU_LIKE[0])
        assert draft_share_timings == [str(auto_draft["draft"])], "the remembered share, not timed again"
    finally:
        engine.close()


def test_the_plan_leaves_out_a_draft_model_known_not_to_pay_and_a_stale_curve_knows_nothing(auto_draft):
    from edgespec.cost_profile import remembered_profile
    from edgespec.loading import plan_load

    cache, key = remember_curve_and_draft_share(auto_draft, GPU_LIKE, share=0.9)
    draft_key = next(iter(cache.read(key).draft_shares))
    assert remembered_profile(cache, key, draft_key).cost.draft_seconds_per_token == pytest.approx(0.9)
    assert remembered_profile(cache, key, "another draft") is None
    notices = []
    _, draft_path, plan, _ = plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1, notice=notices.append)
    assert draft_path == auto_draft["draft"] and plan.mode == "ngram" and [p.role for p in plan.parts] == ["target"]
    assert plan.reason.startswith("n-grams only:") and sum("n-grams only" in line for line in notices) == 1
    for planned in (plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=2, notice=notices.append),
                    plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1, remembered_costs=False)):
        assert planned[2].mode == "draft-model", "another key, or costs not to be read: the run decides"
    cache.mark_stale(key)
    assert remembered_profile(cache, key, draft_key) is None, "a curve worth measuring again decides nothing"
    assert plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1)[2].mode == "draft-model"


# -- --draft auto fetches and reads a draft model only where the target's curve leaves it room to pay -------

def test_a_curve_that_no_draft_model_of_its_size_can_beat_leaves_the_draft_unread(auto_draft, model_loads,
                                                                                  draft_share_timings, monkeypatch):
    import edgespec.planner
    from edgespec.loading import plan_load

    remember_curve_and_draft_share(auto_draft, SLOW_CPU)  # passes as dear as their tokens: nothing to win
    headers = []
    read_header = edgespec.planner.read_gguf_info
    monkeypatch.setattr(edgespec.planner, "read_gguf_info",
                        lambda path, *args, **kwargs: headers.append(str(path)) or read_header(path, *args, **kwargs))
    notices = []
    engine = load_engine(auto_draft["target"], "auto", n_threads=1, notice=notices.append)
    try:
        assert model_loads == [str(auto_draft["target"])] and draft_share_timings == []
        assert str(auto_draft["target"]) in headers and str(auto_draft["draft"]) not in headers, \
            "not even the draft's header is read"
        assert engine.draft_model is None and engine.mode == "ngram" and engine.plan.mode == "ngram"
        said = [line for line in notices if "n-grams only" in line]
        assert len(said) == 1 and "half its share of the two models' bytes" in said[0]
        assert f"--draft {auto_draft['draft']}" in flag_worded(said[0]), "the draft on disk, to use it anyway"
        assert engine.plan.reason.startswith("n-grams only: draft.gguf would gain at most 1.00x")
    finally:
        engine.close()
    planned = plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1, notice=lambda line: None)
    assert planned.draft_path is None and planned.deferred_draft is None and planned.plan.mode == "ngram"
    assert plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=2).plan.mode == "draft-model", \
        "a curve of other threads says nothing about these"


def test_a_draft_model_is_ruled_out_at_the_least_its_size_lets_its_token_cost_on_a_cpu(auto_draft, model_loads):
    import dataclasses

    from edgespec.draft_payoff import catalog_draft_share_floor
    from edgespec.loading import plan_load

    remember_curve_and_draft_share(auto_draft, CHEAP_WIDE_PASSES)  # a free draft would gain 1.34x on it
    notices = []
    planned = plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1, notice=notices.append)
    floor = 0.5 * auto_draft["draft"].stat().st_size / auto_draft["target"].stat().st_size
    assert catalog_draft_share_floor(planned.plan, auto_draft["target"], auto_draft["draft"]) == pytest.approx(floor)
    assert planned.draft_path is None and planned.plan.mode == "ngram" and 0.25 < floor < 0.5
    assert f"a token costing only {floor:.0%} of a target step" in planned.plan.reason
    on_a_gpu = dataclasses.replace(planned.plan, device="cuda")
    assert catalog_draft_share_floor(on_a_gpu, auto_draft["target"], auto_draft["draft"]) == 0, \
        "a GPU's small kernels promise no floor"


@pytest.fixture
def unfetched_draft(tiny_models, tmp_path, monkeypatch):
    """The tiny target in the catalog, paired with a draft that is not on disk and that a local Hub serves;
    yields the Hub (its requests say whether the draft was fetched)."""
    import json

    import huggingface_hub.constants
    from edgespec.model_import import import_model
    from models_helpers import HubServer

    store = tmp_path / "store"
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(store))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import_model(tiny_models["target"], name="tiny-target")
    user = json.loads((store / "models.json").read_text())
    user["models"].append({"name": "tiny-draft", "size": tiny_models["draft"].stat().st_size, "sources": [
        {"kind": "hf", "repo": "test-org/tiny-GGUF", "file": "tiny-draft.gguf", "revision": "main"}]})
    user["pairs"] = [{"name": "tiny-target with tiny-draft", "target": "tiny-target", "draft": ["tiny-draft"]}]
    (store / "models.json").write_text(json.dumps(user))
    with HubServer({"test-org/tiny-GGUF/tiny-draft.gguf": tiny_models["draft"].read_bytes()}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def curve_measured_as(monkeypatch, curve):
    """Calibration measures this curve, whatever this machine's speed (curve_timing.measure_curve times it)."""
    import edgespec.cost_profile

    monkeypatch.setattr(edgespec.cost_profile, "measure_curve", lambda measure, max_width, **_: curve[:max_width])


def test_a_first_run_measures_the_target_before_fetching_a_draft_model_that_cannot_pay(
        unfetched_draft, tiny_models, model_loads, draft_share_timings, monkeypatch):
    curve_measured_as(monkeypatch, SLOW_CPU)
    notices = []
    for run in range(2):  # the first measures the curve; the second reads it
        engine = load_engine("tiny-target", "auto", n_threads=1, notice=notices.append)
        try:
            assert engine.draft_model is None and engine.mode == "ngram" and engine.plan.mode == "ngram"
            result = engine.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=4), raw=True)
            assert result.token_ids
        finally:
            engine.close()
        said = [line for line in notices if "n-grams only" in line]
        assert len(said) == run + 1 and "half its share of the two models' bytes" in said[-1]
        why = "n-grams only: tiny-draft would gain at most"
        assert engine.plan.reason.startswith(why) and result.stats.plan_reason == engine.plan.reason, \
            "the stats say why the draft model was left out, on the run that measured the curve too"
        assert "--draft tiny-draft" in flag_worded(said[-1]), "named by its catalog name, which fetches it"
    assert unfetched_draft.requests == [], "the draft was never fetched"
    assert model_loads == [str(tiny_models["target"])] * 2 and draft_share_timings == []


def test_a_first_run_fetches_the_draft_model_once_the_measured_curve_leaves_it_room(
        unfetched_draft, tiny_models, model_loads, draft_share_timings, monkeypatch):
    curve_measured_as(monkeypatch, GPU_LIKE)
    engine = load_engine("tiny-target", "auto", n_threads=1, notice=lambda line: None)
    engine.close()
    assert ("GET", "/test-org/tiny-GGUF/resolve/main/tiny-draft.gguf") in unfetched_draft.requests
    fetched = model_loads[-1]
    assert model_loads[:2] == [str(tiny_models["target"])] * 2 and fetched.endswith("tiny-draft.gguf")
    assert draft_share_timings == [fetched], "loaded beside the target and its share timed, as on any first load"


@pytest.mark.parametrize("curve, loads", [(SLOW_CPU, ["target"]), (GPU_LIKE, ["target", "target", "draft"])])
def test_a_first_run_measures_the_target_before_loading_a_draft_model_on_disk(auto_draft, model_loads,
                                                                               draft_share_timings, monkeypatch,
                                                                               curve, loads):
    curve_measured_as(monkeypatch, curve)
    notices = []
    load_engine(auto_draft["target"], "auto", n_threads=1, notice=notices.append).close()
    assert model_loads == [str(auto_draft[role]) for role in loads]
    assert draft_share_timings == [str(auto_draft["draft"])] * ("draft" in loads)
    if curve is SLOW_CPU:
        said = [line for line in notices if "n-grams only" in line]
        assert len(said) == 1 and f"--draft {auto_draft['draft']}" in flag_worded(said[0]), "named by its file"


def test_without_pulling_nothing_is_fetched_and_a_given_cost_curve_fetches_as_before(unfetched_draft, tiny_models,
                                                                                    model_loads):
    from edgespec.costs import CostModel

    load_engine("tiny-target", "auto", n_threads=1, notice=lambda line: None, pull=False).close()
    assert model_loads == [str(tiny_models["target"])] and unfetched_draft.requests == []
    engine = load_engine("tiny-target", "auto", n_threads=1, notice=lambda line: None,
                         cost_curve=CostModel(GPU_LIKE, draft_seconds_per_token=0.05))
    try:  # nothing measured: the given curve decides after loading, as it did before
        assert engine.draft_model is not None and model_loads[-1].endswith("tiny-draft.gguf")
    finally:
        engine.close()


def test_under_bit_exact_the_plan_judges_a_remembered_draft_at_the_widest_exact_pass(auto_draft):
    from edgespec.calibration import draft_model_key
    from edgespec.loading import plan_load

    cache, key = remember_curve_and_draft_share(auto_draft, GPU_LIKE)
    cache.store(key, 1, GPU_LIKE)  # no pass wider than one token is bit-identical to one-token passes here
    cache.store_draft_share(key, draft_model_key(auto_draft["draft"], 0), 0.05)  # a draft that pays at any length
    assert plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1).plan.mode == "draft-model"
    planned = plan_load(auto_draft["target"], "auto", n_ctx=256, n_threads=1, bit_exact=True, notice=lambda line: None)
    assert planned.plan.mode == "ngram" and planned.draft_path is None, "a bit-exact step verifies no draft at all"
    assert planned.plan.reason.startswith("n-grams only:")


def test_a_generation_that_shared_its_passes_claims_no_speedup_of_its_own(tiny_models):
    # its time is the other sequences' too: batch --parallel records read 0.02-0.2x plain decoding
    from edgespec.generation import Done
    from edgespec.scheduler import Job

    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)  # a measured curve: a pace
    params = SamplingParams(temperature=0.0, max_tokens=12)
    alone = engine.generate(PROMPTS[0], params, raw=True).stats

    def both(max_tokens: int) -> list:
        jobs = iter([Job(i, engine.prompt_tokens(p, raw=True), dataclasses.replace(params, max_tokens=max_tokens))
                     for i, p in enumerate(PROMPTS[:2])])
        return [event.result.stats for _, event in engine.scheduler(2).run(lambda wait: next(jobs, None))
                if isinstance(event, Done)]

    # A first round leaves each prompt in a sequence's cache, so that in the second both decode from the first
    # pass on: else how many prompt tokens a pass carries follows the measured curve, and on a busy machine the
    # second prompt was whole only once the first generation had ended.
    both(max_tokens=2)
    together = both(max_tokens=12)
    lone = iter([Job(0, engine.prompt_tokens(PROMPTS[2], raw=True), params)])  # its prompt fed in chunks of its own
    [lone_stats] = [event.result.stats for _, event in engine.scheduler(2).run(lambda wait: next(lone, None))
                    if isinstance(event, Done)]
    engine.close()
    assert lone_stats.prompt_tokens_reused < lone_stats.prompt_tokens - 1 and lone_stats.decode_speedup > 0
    assert alone.plain_step_seconds > 0 and alone.decode_speedup > 0
    assert len(together) == 2
    assert all(s.prompt_tokens_reused == s.prompt_tokens - 1 for s in together), "each prompt was cached whole"
    assert all(s.plain_step_seconds == s.decode_speedup == s.end_to_end_speedup == 0.0 for s in together)
