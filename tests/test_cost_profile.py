"""The cost profile: measured once by the Calibrator (or given), frozen, replaced when measured again,
and the cost of passes over several sequences, kept in the calibration cache beside the curve."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgespec.backend import RUNTIME
from edgespec.calibration import CalibrationCache, CalibrationKey
from edgespec.pass_prices import PRICE_KEEP, PRICE_MIN_PLAIN_PASSES, priced_curve
from edgespec.cost_profile import SEQUENCE_GRID
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams


def cache_and_key(engine):
    target = engine.target
    return CalibrationCache(), CalibrationKey.for_model(target.path, target.n_gpu_layers, target.n_threads, RUNTIME)


def test_a_profile_is_frozen_and_measuring_again_makes_a_new_one(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    first = engine.profile
    assert first.measured and first.plain_step_seconds == first.cost.target(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.exact_width = 1
    curve, drift = first.cost.forward_seconds, first.kernel_drift
    engine.recalibrate()
    assert engine.profile is not first and engine.cost is engine.profile.cost
    assert first.cost.forward_seconds == curve and first.kernel_drift == drift, "the old profile is unchanged"
    assert engine.profile.exact_width == first.exact_width and engine.kernel_drift == drift
    engine.close()


def test_a_given_curve_is_a_profile_with_nothing_measured(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, cost_curve=(1.0, 1.2, 1.4))
    assert not engine.profile.measured and engine.profile.widest == 3
    profile = engine.profile
    engine.measure_sequences()
    engine.recalibrate()
    assert engine.profile is profile and engine.cost.sequences == (), "a given curve is never measured"
    engine.close()


def test_passes_over_several_sequences_are_measured_once_and_cached(tiny_models):
    notices = []
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    assert engine.cost.sequences == (), "measured only when sequences are decoded together"
    engine.measure_sequences()
    assert sum("several sequences" in n for n in notices) == 1
    points = engine.cost.sequences
    assert points and {(n, rows) for n, rows, _ in points} <= set(SEQUENCE_GRID)
    assert all(factor > 0 for _, _, factor in points)
    cache, key = cache_and_key(engine)
    assert cache.read(key).sequences == points
    sequences_before = engine.target.n_seq, engine.target.cached
    engine.close()
    assert sequences_before == (1, []), "measured in a context of its own"

    notices.clear()
    again = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    again.measure_sequences()
    assert again.cost.sequences == points and not any("measuring" in n for n in notices)
    again.close()


def test_a_cache_written_before_sequences_were_measured_is_read_and_completed_with_one_notice(tiny_models):
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    cache, key = cache_and_key(first)
    entry = cache.read(key)
    first.close()
    cache.store(key, entry.max_width, entry.forward_seconds, drift=entry.drift)  # as the last release wrote it
    notices = []
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, notice=notices.append)
    assert not notices, "the old entry's curve is used as it is"
    assert engine.cost.forward_seconds == entry.forward_seconds
    engine.scheduler(2)
    assert len(notices) == 1 and "several sequences" in notices[0]
    assert cache.read(key).sequences == engine.cost.sequences != ()
    assert cache.read(key).forward_seconds == entry.forward_seconds
    engine.close()


def test_a_load_plans_on_the_widths_prices_and_each_generation_adds_its_passes(tiny_models):
    first = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1)
    cache, key = cache_and_key(first)
    first.close()
    cache.add_pass_prices(key, {2: (3 * math.log(1.5), 3.0), 4: (2 * math.log(0.8), 2.0)})
    entry = cache.read(key)
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=256, n_threads=1, draft_tokens=3)
    assert engine.profile.measured_curve == entry.forward_seconds, "the measurement is kept as it was"
    assert engine.cost.forward_seconds == priced_curve(entry.forward_seconds, entry.pass_prices)
    assert engine.cost.target(2) > entry.forward_seconds[1]

    result = engine.generate("one two three four one two three four one two three four one two",
                             SamplingParams(temperature=0.0, max_tokens=40))
    widths = result.stats.pass_widths
    after = cache.read(key).pass_prices
    if widths.get(1, 0) >= PRICE_MIN_PLAIN_PASSES:  # what the generation drafted follows its text: count it
        expected = {w: PRICE_KEEP * entry.pass_prices.get(w, (0.0, 0.0))[1] + widths.get(w, 0)
                    for w in set(entry.pass_prices) | {w for w in widths if w > 1}}
    else:
        expected = {w: count for w, (_, count) in entry.pass_prices.items()}
    assert {w: count for w, (_, count) in after.items()} == pytest.approx(expected)
    engine.close()
