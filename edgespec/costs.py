"""What a target pass costs per width and per number of sequences, and what a drafter could gain.

The engine measures the curve at load (cost_profile.py) or is given one; the draft-length
controllers choose k against it, `--draft auto` asks best_speedup whether a draft model can pay
on this machine at all, and the scheduler prices passes shared by several sequences with
pass_seconds (how many to decode together, each one's draft rows, a new prompt's chunk).
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
    # (n sequences, rows each, a pass over them / one sequence's pass over as many rows): what spreading a
    # pass's rows over sequences, each with its own context, costs; () prices them as one sequence's rows
    sequences: Sequence[tuple[int, int, float]] = ()

    def __post_init__(self) -> None:
        try:  # a library caller's cost_curve="1.0" would be read as the digits of a string
            seconds = () if isinstance(self.forward_seconds, str) else tuple(float(s) for s in self.forward_seconds)
        except (TypeError, ValueError):
            seconds = ()
        if not seconds or not all(math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError("a cost curve (cost_curve) must be the seconds of a pass over 1, 2, ... tokens, each "
                             f"positive and finite, like (1.0, 1.2, 1.4), not {self.forward_seconds!r}")
        object.__setattr__(self, "forward_seconds", seconds)
        for name in ("draft_seconds_per_token", "heads_seconds_per_token"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            object.__setattr__(self, name, value)
        grid = tuple((int(n), int(rows), float(factor)) for n, rows, factor in self.sequences)
        if not all(n >= 1 and rows >= 1 and math.isfinite(factor) and factor > 0 for n, rows, factor in grid):
            raise ValueError(f"sequences must be (n >= 1, rows >= 1, factor > 0) triples, got {grid!r}")
        object.__setattr__(self, "sequences", grid)
        object.__setattr__(self, "_factors", {})

    def target(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"a target pass covers at least one token, got n={n}")
        measured = len(self.forward_seconds)
        if n <= measured:
            return self.forward_seconds[n - 1]
        # Unmeasured widths get no batching gain beyond the widest measured pass: over-estimating
        # keeps the controller off widths nobody timed.
        return max(self.forward_seconds) * n / measured

    def pass_seconds(self, n_sequences: int, rows: int) -> float:
        """One pass over `rows` rows spread over n_sequences sequences, each with its own context
        (0 for no rows: a pass not taken)."""
        if rows < 1:
            return 0.0
        single = self.target(rows)
        if n_sequences <= 1 or not self.sequences:
            return single
        return single * self._factor(n_sequences, max(1, round(rows / n_sequences)))

    def _factor(self, n_sequences: int, rows_each: int) -> float:
        """The grid's factor, interpolated over rows each and then over sequences (clamped at its edges);
        one sequence's factor is 1 by definition."""
        key = (n_sequences, rows_each)
        factor = self._factors.get(key)
        if factor is None:
            by_n: dict[int, list[tuple[int, float]]] = {}
            for n, rows, f in sorted(self.sequences):
                by_n.setdefault(n, []).append((rows, f))
            counts = [1] + [n for n in sorted(by_n) if n > 1]
            at_rows = [1.0] + [float(np.interp(rows_each, [r for r, _ in by_n[n]], [f for _, f in by_n[n]]))
                               for n in counts[1:]]
            factor = self._factors[key] = float(np.interp(n_sequences, counts, at_rows))
        return factor

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


# How much dearer per prompt token than the cheapest chunk a wider chunk may be: within it, a wider chunk
# wins, since the new sequence starts decoding passes sooner (until then its place in the pass is idle).
PREFILL_TOLERANCE = 0.1


def prefill_rows(cost: CostModel, n_sequences: int, rows: int, budget: int) -> int:
    """How many prompt tokens to feed into a pass over `rows` decode rows of n_sequences sequences (one more
    sequence, the new one, gets the prompt rows): at most budget.

    A prompt token folded into a pass costs what it adds to the pass, (T(rows + c) - T(rows)) / c per token
    for a chunk of c; the weights are read for the decode rows anyway.  The widest chunk whose tokens cost
    at most PREFILL_TOLERANCE more than the cheapest chunk's wins.  On a CPU (a curve that grows slower
    than its width) that is the whole budget; on a curve that turns steeper past some width (a GPU's
    compute limit) the chunk stops there, and the running sequences' steps stay short.
    """
    if budget <= 1:
        return max(budget, 0)
    base = cost.pass_seconds(n_sequences, rows)
    chunks = sorted({budget} | {c for c in (2 ** i for i in range(budget.bit_length())) if c < budget}
                    | {w - rows for w in range(rows + 1, len(cost.forward_seconds) + 1) if w - rows < budget})
    per_token = [(cost.pass_seconds(n_sequences + 1, rows + c) - base) / c for c in chunks]
    cheapest = min(per_token)
    return max(c for c, seconds in zip(chunks, per_token) if seconds <= cheapest + abs(cheapest) * PREFILL_TOLERANCE)
