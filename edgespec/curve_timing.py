"""Times one target pass over n tokens, n = 1..max_width: the cost curve every draft length is planned on.

The caller supplies `measure(n) -> seconds`: one forward pass over n tokens that returns n rows
of logits (as verification does), with the KV cache restored afterwards. Widths are measured in
the order the controller needs them most, within a time budget, and the rest is interpolated.
cost_profile.py's Calibrator runs it and keeps the curve in the calibration cache (calibration.py).

The first load of a model on a machine spends at most the curve's budget (CURVE_BUDGET_SECONDS, or
CURVE_BUDGET_PASSES one-token passes on a slower machine) + NARROW_BUDGET_SECONDS here, plus the warm-up
and one pass over each width up to ALWAYS_MEASURED, measured whatever they cost.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

import numpy as np

# Every width up to 4 (where drafts usually land on a CPU), then sizes around which llama.cpp's
# batched kernels change; widths in between are interpolated. On Qwen2.5-Coder-1.5B with 2 CPU
# threads (T(1) ~ 70 ms) one round over 1..16 takes ~2.1 s; the budget leaves room for a second
# round of the narrow widths, so the n-gram controller's long copies are priced from measurements.
PLANNED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Widths measured even past the budget: without them the controller has nothing to choose from.
ALWAYS_MEASURED = 4
CURVE_BUDGET_SECONDS = 3.0
# ... or this many one-token passes' time, where that is longer: a CPU three times slower must measure
# the same widths, not a third of them. With seconds alone, an AVX2 EPYC (T(1) ~ 90 ms) stopped its
# curve at 12 tokens, one spiky sample each (T(12) read 8.1 x T(1), 5.3 measured again); past the
# curve CostModel extrapolates, so a 16-token copy was priced at ~11 one-token passes where it cost
# ~6 and was never made, while llama.cpp's 48-token copies gained 1.3x on the same prompts.
# Sized for two rounds up to the widest pass on a steep curve: an AVX-512 EPYC's round to 33 costs about
# 80 one-token passes (T(24) 13.5, T(32) 14.2, T(33) 15.1). With 60 its curve ended at 24 and passes of
# 25-33 tokens were priced 21% above their cost (no draft went past 18 tokens there). With 100, one round:
# about one wide pass in seven takes 8-24% longer than its width's median there, so most curves priced
# some wide width by a spike (benchmarks/calibration_spread.py, eight calibrations in a row: T(32)/T(1)
# 12.0-17.1 from one sample, 12.1-15.6 from two).
CURVE_BUDGET_PASSES = 180
# The narrow widths decide whether one-token drafts are made at all, and one pass's time wanders by
# +-5% on an idle CPU: with the three samples the curve's rounds give them, five curves measured in a
# row on an AVX-512 EPYC put T(2)/T(1) anywhere in 1.59-1.83. Nine samples each (resampled from 30
# pairs there) keep it within 1.57-1.72, at about 1.4 s more on that machine, with its own budget.
# What this cannot fix is the machine itself moving (the same EPYC read 1.64 one half hour and 1.87
# the next): the controller prices wide passes from the live ones for that (controller.SpeedGuard).
NARROW_SAMPLES = 9
NARROW_BUDGET_SECONDS = 2.0
# How much cheaper than a narrower pass a wider one may measure before the curve is taken to
# contradict physics: the same work at a few percent of jitter, as on a GPU where widths cost alike.
CURVE_NOISE = 0.1


def measure_curve(
    measure: Callable[[int], float],
    max_width: int,
    *,
    repeats: int = 3,
    budget_seconds: float = CURVE_BUDGET_SECONDS,
    budget_passes: float = CURVE_BUDGET_PASSES,
    narrow_budget_seconds: float = NARROW_BUDGET_SECONDS,
    notice: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """Seconds per target pass for n = 1..N, N <= max_width, from the lower medians of `measure`.

    One pass over all planned widths comes first, narrowest first, then up to `repeats - 1`
    more; the next measurement is skipped once the time measured so far plus its expected
    time would pass the budget, `budget_seconds` or `budget_passes` times the first timed
    one-token pass, whichever is longer, except that widths up to ALWAYS_MEASURED are always
    measured once. Narrow widths, the ones that matter most, get the repeats, and then rounds of
    their own (1..ALWAYS_MEASURED) until each has NARROW_SAMPLES or `narrow_budget_seconds` more
    is spent. A spike in a width measured once makes it look dearer, never cheaper, so the
    controller shuns it rather than over-drafting. The curve ends at the widest width measured;
    CostModel extrapolates beyond it.

    A curve that falls with width contradicts physics (see CURVE_NOISE): the widths that cost
    more than a wider one are measured again, and what still does is capped at the wider
    passes' cost, with a notice.
    """
    if max_width < 1 or repeats < 1:
        raise ValueError(f"need max_width >= 1 and repeats >= 1, got {max_width}, {repeats}")
    widths = sorted({w for w in PLANNED_WIDTHS if w < max_width} | {max_width})
    # The first pass after loading pages the weights in; it would say nothing about later ones.
    spent = _checked(measure(1), 1)
    samples: dict[int, list[float]] = {}
    budget = budget_seconds
    for round_ in range(repeats):
        for width in widths:
            if round_ > 0 and width not in samples:
                break  # a width skipped in the first round stays skipped
            required = round_ == 0 and width <= ALWAYS_MEASURED
            if not required and spent + _expected_seconds(samples, width) > budget:
                break
            seconds = _checked(measure(width), width)
            samples.setdefault(width, []).append(seconds)
            spent += seconds
            if width == 1 and round_ == 0:
                budget = max(budget_seconds, budget_passes * seconds)
    _sample_narrow_widths(measure, samples, narrow_budget_seconds)
    medians = _plausible_medians(measure, samples, repeats, budget, notice)
    measured = sorted(medians)
    dense = np.interp(np.arange(1, measured[-1] + 1), measured, [medians[w] for w in measured])
    return tuple(float(s) for s in dense)


def _sample_narrow_widths(measure: Callable[[int], float], samples: dict[int, list[float]],
                          budget_seconds: float) -> None:
    """Rounds over the widths up to ALWAYS_MEASURED, narrowest first, until each has NARROW_SAMPLES
    (or the next pass would take the time spent past budget_seconds): in rounds, so that a minute
    of load slows every width alike instead of one."""
    narrow = [w for w in sorted(samples) if w <= ALWAYS_MEASURED]
    spent = 0.0
    while any(len(samples[w]) < NARROW_SAMPLES for w in narrow):
        for width in narrow:
            if len(samples[width]) >= NARROW_SAMPLES:
                continue
            if spent + _expected_seconds(samples, width) > budget_seconds:
                return
            samples[width].append(_checked(measure(width), width))
            spent += samples[width][-1]


def _plausible_medians(measure: Callable[[int], float], samples: dict[int, list[float]], repeats: int,
                       budget_seconds: float, notice: Callable[[str], None] | None) -> dict[int, float]:
    """Each measured width's lower median seconds (_typical), made non-decreasing in width.

    A pass over more tokens does at least the work of a narrower one, and load only ever slows a
    pass down; so a width measured dearer than a wider one was slowed, and the wider pass's cost
    is a truer (upper) bound of its own. Beyond CURVE_NOISE such a width is measured `repeats`
    times more first (the narrowest first, within budget_seconds more).
    """
    medians = {w: _typical(s) for w, s in samples.items()}
    slowed = _slowed_widths(medians)
    if slowed:
        spent = 0.0
        for width in slowed * repeats:
            if spent >= budget_seconds:
                break
            samples[width].append(_checked(measure(width), width))
            spent += samples[width][-1]
        medians = {w: _typical(s) for w, s in samples.items()}
        if _slowed_widths(medians) and notice is not None:
            notice("some target passes measured slower than wider ones, which only a busy machine causes; "
                   "their cost is taken from the wider passes")
    widest_first = sorted(medians, reverse=True)
    for wider, width in zip(widest_first, widest_first[1:]):
        medians[width] = min(medians[width], medians[wider])
    return medians


def _typical(samples: list[float]) -> float:
    """The lower median: of a wide width's two samples the faster, since load only ever slows a pass, and a
    width priced by a spike is never drafted, so its price is never corrected by what its passes cost in
    generation (one priced low is drafted and corrected)."""
    return statistics.median_low(samples)


def _slowed_widths(medians: dict[int, float]) -> list[int]:
    """The widths measured dearer than some wider one, by more than timing noise."""
    slowed, cheapest_wider = [], math.inf
    for width in sorted(medians, reverse=True):
        if cheapest_wider < medians[width] * (1 - CURVE_NOISE):
            slowed.append(width)
        cheapest_wider = min(cheapest_wider, medians[width])
    return sorted(slowed)


def _expected_seconds(samples: dict[int, list[float]], width: int) -> float:
    if width in samples:
        return statistics.median(samples[width])
    widest = max(samples)
    return statistics.median(samples[widest]) * width / widest


def _checked(seconds: float, width: int) -> float:
    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"measure({width}) returned {seconds!r}; it must return elapsed seconds > 0")
    return seconds
