"""What a target pass costs per width, and what a drafter could gain against that cost.

The engine measures the curve at load (calibration.py) or is given one; the draft-length
controllers choose k against it, and `--draft auto` asks best_speedup whether a draft model
can pay on this machine at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Seconds for one target pass over n tokens (index n - 1), and per drafted token."""

    forward_seconds: Sequence[float]
    draft_seconds_per_token: float = 0.0
    heads_seconds_per_token: float = 0.0  # drafting heads' numpy time per drafted token (0 when none are loaded)

    def __post_init__(self) -> None:
        seconds = tuple(float(s) for s in self.forward_seconds)
        if not seconds or not all(math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError(f"forward_seconds must be positive and finite, got {seconds!r}")
        object.__setattr__(self, "forward_seconds", seconds)
        for name in ("draft_seconds_per_token", "heads_seconds_per_token"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            object.__setattr__(self, name, value)

    def target(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"a target pass covers at least one token, got n={n}")
        measured = len(self.forward_seconds)
        if n <= measured:
            return self.forward_seconds[n - 1]
        # Unmeasured widths get no batching gain beyond the widest measured pass: over-estimating
        # keeps the controller off widths nobody timed.
        return max(self.forward_seconds) * n / measured

    def draft(self, k: int) -> float:
        return k * self.draft_seconds_per_token

    def relative(self) -> tuple[float, ...]:
        """T(n) / T(1) for each measured n: the shape of the curve, for display."""
        single = self.forward_seconds[0]
        return tuple(s / single for s in self.forward_seconds)


def best_speedup(cost: CostModel, acceptance: float, k_max: int) -> tuple[int, float]:
    """The draft length with the highest expected speedup over plain decoding, and that speedup,
    for a drafter whose every token is accepted with probability `acceptance`."""
    speedups = [
        (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance) * cost.target(1) / (cost.target(k + 1) + cost.draft(k))
        if acceptance < 1.0 else (k + 1) * cost.target(1) / (cost.target(k + 1) + cost.draft(k))
        for k in range(k_max + 1)
    ]
    k = int(np.argmax(speedups))
    return k, float(speedups[k])
