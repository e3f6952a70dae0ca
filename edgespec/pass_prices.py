"""Pass prices: what each width's passes cost in generation against the measured curve, and the curve at them.

calibration.StepTimeWatch hands each generation's passes to generation_prices, the calibration cache
merges the result into its entry (merge_prices), and the next load plans on priced_curve.
"""

from __future__ import annotations

import math
import statistics

# Pass prices: what a width's passes cost in generation against the curve, over what the one-token passes
# around them cost against it (so the load cancels).  A calibration is one minute's shape, and one width
# can be off by a third while its neighbours are right (T(4) 1.86 cached on the AVX2 EPYC, 2.1-2.7 paid in
# generation), which a process then paid for on its first drafts, before its speed guard had seen a wide
# pass (controller.SpeedGuard).  Stored per width as the summed log price and the passes it sums, both
# fading by PRICE_KEEP per generation and capped at PRICE_MAX_PASSES passes, so the prices follow what
# the machine does lately.  A width is priced from its own passes and its neighbours', each worth less
# by a factor e per PRICE_KERNEL_WIDTH of log width between them (23 and 24 wide: 0.75; 3 and 4: 0.15),
# since a measurement errs alike on widths that run alike (a sample spiked by load, a kernel's regime),
# and a width left at its measured price beside dearer ones would look free; all of it leans on the
# measurement (a price of 1.0) by PRICE_PRIOR_PASSES passes.
PRICE_KEEP = 0.8
PRICE_MAX_PASSES = 32.0
PRICE_PRIOR_PASSES = 4.0
PRICE_KERNEL_WIDTH = 0.15
# A generation's prices are taken against its one-token passes' median: with fewer than this many the
# load is unknown and the generation adds nothing.
PRICE_MIN_PLAIN_PASSES = 4
# One pass's price is held within this factor of 1: a pass that a preemption stretched says nothing of
# the width's cost.
PRICE_CLIP = 3.0

PassPrices = dict[int, tuple[float, float]]  # width -> (summed log price, passes)


def generation_prices(passes: list[tuple[int, float]]) -> PassPrices:
    """What one generation's passes, (width, seconds over the curve's), cost against the curve per width
    over one token (the median one-token pass's ratio, the load); {} without enough one-token passes."""
    plain = [ratio for width, ratio in passes if width == 1]
    if len(plain) < PRICE_MIN_PLAIN_PASSES:
        return {}
    load = statistics.median(plain)
    if not load > 0:
        return {}
    prices: PassPrices = {}
    for width, ratio in passes:
        if width > 1:
            price = min(max(ratio / load, 1.0 / PRICE_CLIP), PRICE_CLIP)
            log_sum, count = prices.get(width, (0.0, 0.0))
            prices[width] = (log_sum + math.log(price), count + 1.0)
    return prices


def merge_prices(stored: PassPrices, new: PassPrices, keep: float = PRICE_KEEP) -> PassPrices:
    """stored * keep + new, per width, each width capped at PRICE_MAX_PASSES passes."""
    merged = {}
    for width in set(stored) | set(new):
        old_sum, old_count = stored.get(width, (0.0, 0.0))
        new_sum, new_count = new.get(width, (0.0, 0.0))
        log_sum, count = keep * old_sum + new_sum, keep * old_count + new_count
        scale = min(1.0, PRICE_MAX_PASSES / count) if count > 0 else 1.0
        merged[width] = (log_sum * scale, count * scale)
    return merged


def priced_curve(curve: tuple[float, ...], prices: PassPrices) -> tuple[float, ...]:
    """The curve with each width at the price passes were paid at in generation: its own passes' and, less and
    less as the widths part (PRICE_KERNEL_WIDTH), its neighbours', leaning on the measurement by
    PRICE_PRIOR_PASSES; and no pass priced under a narrower one's."""
    priced: list[float] = []
    for width, seconds in enumerate(curve, 1):
        if width > 1 and prices:
            near = [(math.exp(-abs(math.log(width / seen)) / PRICE_KERNEL_WIDTH), log_sum, count)
                    for seen, (log_sum, count) in prices.items()]
            log_price = sum(k * log_sum for k, log_sum, _ in near) / (
                PRICE_PRIOR_PASSES + sum(k * count for k, _, count in near))
            seconds *= math.exp(log_price)
        priced.append(max(seconds, priced[-1]) if priced else seconds)
    return tuple(priced)


def read_prices(stored) -> PassPrices:
    """An entry's pass prices; none when they cannot be read (a hand-edited entry only loses them)."""
    try:
        prices = {int(width): (float(log_sum), float(count)) for width, log_sum, count in stored or ()}
    except (TypeError, ValueError):
        return {}
    if not all(width > 1 and math.isfinite(log_sum) and abs(log_sum) <= count * math.log(PRICE_CLIP) + 1e-9
               and 0 < count <= PRICE_MAX_PASSES + 1e-9 for width, (log_sum, count) in prices.items()):
        return {}
    return prices
