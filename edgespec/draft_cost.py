"""What a draft model's token costs, as a share of a one-token target pass: measured, and checked.

The share is what `--draft auto` and the per-step choice between drafters weigh, so it must hold
whatever else the machine is doing. Timing the draft alone and dividing by a target pass timed at
another moment (or cached from another day) compares two loads, not two models: on a busy 2-core
machine that put a 0.5B draft token at 1-5% of a 1.5B target step. So the two models are timed in
turns, a few passes each under about the same load, and the share is the median of the turns' ratios.
Each model's time in a turn is its fastest pass: load only ever slows a pass, and the first pass
after the other model's shares the cores with that model's threads, still spinning.

A share below what the draft's size allows is discarded, not used: on a CPU a token's pass reads
every weight once, so a draft's token costs about its file's share of the target's bytes (the
Qwen2.5-Coder 0.5B Q4_K_M file is 44% of the 1.5B one; its token measures 45% of a step). Such a
share is measured once more; if it is still too low, the size-based estimate stands in for it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Protocol

from .backend import time_forward

# How far below the draft's share of the target's bytes a measured share may fall and still be
# believed: small models spend relatively more on overheads, never less, so half is generous.
SIZE_SHARE_MARGIN = 0.5
ROUNDS = 4  # turns of both models; a second set only where the first gives a share too low to be true
PASSES_PER_TURN = 2


class TimedModel(Protocol):
    """What is read of a loaded model (a backend LlamaModel)."""

    path: Path
    n_gpu_layers: int
    bos_id: int


def draft_token_share(target: TimedModel, draft: TimedModel, notice: Callable[[str], None] | None = None,
                      timer: Callable[[TimedModel, int, int], float] = time_forward) -> float:
    """measure_draft_share over one-token passes of the two loaded models (timer: seconds for one model's
    pass over n tokens), checked against their sizes."""
    filler = max(target.bos_id, 0)
    return measure_draft_share(lambda: timer(target, 1, filler), lambda: timer(draft, 1, filler),
                               least_plausible_share(target, draft), size_share(target, draft), notice)


def least_plausible_share(target: TimedModel, draft: TimedModel) -> float:
    """The smallest share of a target step a draft token can take, from the models' file sizes;
    0.0 where the bytes argument does not hold (a model offloaded to a GPU)."""
    if target.n_gpu_layers != 0 or draft.n_gpu_layers != 0:
        return 0.0
    return SIZE_SHARE_MARGIN * size_share(target, draft)


def size_share(target: TimedModel, draft: TimedModel) -> float:
    """The draft's file size as a share of the target's: what a token costs on a CPU, where a pass reads
    every weight once."""
    return Path(draft.path).stat().st_size / Path(target.path).stat().st_size


def measure_draft_share(
    time_target: Callable[[], float],
    time_draft: Callable[[], float],
    least_share: float,
    estimate: float,
    notice: Callable[[str], None] | None = None,
    rounds: int = ROUNDS,
) -> float:
    """The draft model's cost per token as a share of a one-token target pass.

    time_target and time_draft time one one-token pass of each model. A share below least_share
    is measured again; if it stays below, the estimate is used instead and notice says so.
    """
    time_target(), time_draft()  # the first passes after loading page the weights in
    share = _median_ratio(time_target, time_draft, rounds)
    if share >= least_share:
        return share
    share = _median_ratio(time_target, time_draft, rounds)
    if share >= least_share:
        return share
    if notice is not None:
        notice(f"a draft token measured at {share:.0%} of a target step, less than its size allows (at least "
               f"{least_share:.0%}; a busy machine?): using {estimate:.0%}, its share of the target's bytes")
    return estimate


def _median_ratio(time_target: Callable[[], float], time_draft: Callable[[], float], rounds: int) -> float:
    ratios = []
    for _ in range(rounds):
        target_seconds = min(time_target() for _ in range(PASSES_PER_TURN))
        ratios.append(min(time_draft() for _ in range(PASSES_PER_TURN)) / target_seconds)
    return statistics.median(ratios)
