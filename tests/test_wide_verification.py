"""Wide verification by default, the bit-exact cap on request, and the combined drafter, on the tiny models."""

from __future__ import annotations

import pytest

from edgespec import SamplingParams, Step
from edgespec.loading import load_engine
from edgespec.backend import RUNTIME
from edgespec.calibration import CalibrationCache, CalibrationKey

PROMPT = "hello world, hello world, hello world, hello"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
FIXED_COST = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8)


def plant_measurement(target_path, exact_width: int) -> None:
    """A cached calibration saying passes wider than exact_width are not bit-identical here."""
    probe = load_engine(target_path, "none", n_ctx=256, n_threads=1, cost_curve=(1.0,))
    key = CalibrationKey.for_model(probe.target.path, probe.target.n_gpu_layers, probe.target.n_threads, RUNTIME)
    probe.close()
    curve = tuple(1.0 + 0.1 * n for n in range(16))
    drift = {w: (0.0 if w <= exact_width else 0.25) for w in (2, 3, 4, 6, 8, 12, 16)}
    CalibrationCache().store(key, exact_width, curve, drift=drift)


@pytest.mark.parametrize("bit_exact", [False, True])
def test_bit_exact_caps_the_pass_width_and_the_stats_say_so(tiny_models, bit_exact):
    plant_measurement(tiny_models["target"], exact_width=3)
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, draft_tokens=8, bit_exact=bit_exact)
    try:
        assert engine.exact_width == 3 and engine.drift_bound() == pytest.approx(0.5)
        assert engine.max_draft_tokens == (2 if bit_exact else 32)
        result = engine.generate(PROMPT, GREEDY, raw=True)
        stats = result.stats
        assert stats.bit_exact is bit_exact
        assert stats.widest_pass == (3 if bit_exact else 9)
        engine.configure(mode="none")
        assert engine.generate(PROMPT, GREEDY, raw=True).token_ids == result.token_ids
    finally:
        engine.close()


def test_bit_exact_can_be_switched_on_a_loaded_engine(tiny_models):
    plant_measurement(tiny_models["target"], exact_width=3)
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, draft_tokens=8)
    try:
        engine.configure(bit_exact=True)
        assert engine.max_draft_tokens == 2
        assert engine.generate(PROMPT, GREEDY, raw=True).stats.widest_pass <= 3
        engine.configure(bit_exact=False)
        assert engine.max_draft_tokens == 32
    finally:
        engine.close()


def test_the_width_probe_measures_drift_once_and_the_cache_keeps_it(tiny_models):
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    drift = dict(first.kernel_drift)
    first.close()
    # how much a wide pass drifts is the kernels' (0.0 with make's CPU build, not on a GPU): only its reuse is checked
    assert drift and all(value >= 0.0 for value in drift.values())
    notices = []
    second = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    assert second.kernel_drift == drift and second.drift_bound() == 2 * max(drift.values())
    assert not any("measuring" in n for n in notices)
    second.close()


def test_a_loaded_draft_model_makes_the_combined_drafter_the_default(tiny_models):
    notices = []
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=512, n_threads=1,
                         cost_curve=FIXED_COST, notice=notices.append)
    try:
        assert engine.mode == "combined"
        assert any("drafting with n-grams and" in n for n in notices), notices
        steps = [e for e in engine.stream(PROMPT, GREEDY, raw=True) if isinstance(e, Step)]
        drafters = {t.drafter for step in steps for t in step.tokens if t.drafted}
        assert drafters and drafters <= {"ngram", "draft-model"}
        final = steps[-1].stats
        assert sum(final.accepted_by_drafter.values()) == final.draft_tokens_accepted
        assert sum(final.pass_widths.values()) == final.steps == len(steps)
        assert max(final.pass_widths) == final.widest_pass
        assert sum((width - 1) * n for width, n in final.pass_widths.items()) == final.draft_tokens_proposed
        assert final.mode == "combined"
        plain_ids = [t.id for step in steps for t in step.tokens]
        engine.configure(mode="none")
        assert engine.generate(PROMPT, GREEDY, raw=True).token_ids == plain_ids
    finally:
        engine.close()


def test_the_draft_model_is_prefilled_with_the_target(tiny_models):
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=512, n_threads=1, cost_curve=FIXED_COST)
    try:
        engine.configure(mode="draft-model", draft_tokens=2)
        ids = engine.prompt_tokens(PROMPT, raw=True)
        events = engine.stream_tokens(ids, GREEDY)
        next(events)  # the first step: the draft's cache already held the prompt before it
        passes = engine.draft_model.forward_passes
        assert engine.draft_model.cached[: len(ids) - 1] == ids[:-1]
        for _ in events:
            pass
        assert engine.draft_model.forward_passes > passes
    finally:
        engine.close()
