"""How often a drafter's guesses are accepted, per draft position: what the draft-length controller plans with.

Each estimate is a decayed count of accepted and tried draft positions.  Two learners fill the counts:

- `VerifiedAcceptance` (here) learns from verification only: what was drafted and how much was kept, per
  signal class (a drafter's own label for its guess) and pooled over all classes.  A class leans on
  the pooled estimate until it has data of its own, and a position with little data leans on the one
  before it, shrunk a little.  A draft model's guesses cost passes, so this is all there is to learn
  from (the controller probes it now and then when it stops drafting).
- `HindsightAcceptance` (hindsight.py) learns from every step: the n-gram drafter's proposals cost
  nothing, so each step's whole proposal is scored against the text that follows.

`export()` hands out what a learner saw since the last export, undecayed, per class; the learned
prior store (learned.py) keeps it per model, and a new learner can start from it (`learned`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

# The starting guess of the pooled estimate for position 1, and how many observations it counts as:
# neutral (a coin flip) and weak, so this model's own outcomes here win within a few steps.
NEUTRAL_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
# How many observations a class's (or a position's) own estimate needs before it outweighs what it
# leans on: the pooled estimate for a class, the position before it for a position.
BORROW_WEIGHT = 1.0
# A position with little data is assumed somewhat worse than the one before it, so long drafts are
# earned by observed acceptance rather than extrapolated from a lucky streak at position 1.
DEPTH_SHRINK = 0.98
# A learned prior (from earlier runs of this model) counts as the observations the store weighs it at
# (learned.py: 2 where the runs disagreed, more where they agreed), never more than this per position:
# enough to start where runs of one kind of work ended, few enough that this text outvotes it in a few steps.
LEARNED_WEIGHT_MAX = 8.0
VERIFIED_DECAY = 0.95


class DecayedCounts:
    """Accepted and tried counts per draft position, each multiplied by a decay per observation."""

    def __init__(self, k_max: int) -> None:
        self.hits = np.zeros(k_max)
        self.tries = np.zeros(k_max)

    def decay(self, factor: float) -> None:
        self.hits *= factor
        self.tries *= factor

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified draft: the first `accepted` of `proposed` positions kept."""
        depth = len(self.tries)
        accepted = min(accepted, depth)
        self.hits[:accepted] += 1.0
        self.tries[:accepted] += 1.0
        # The first rejected position was tried too; positions after it were never reached.
        if accepted < min(proposed, depth):
            self.tries[accepted] += 1.0

class _Estimates:
    """The counts and the estimates made from them; the learners below decide what they observe."""

    learns_without_drafting = False

    def __init__(self, k_max: int, *, decay: float, prior_acceptance: float = NEUTRAL_ACCEPTANCE,
                 caution: float = 0.0, learned: Mapping[int, tuple[Sequence[float], Sequence[float]]] | None = None):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        if caution < 0.0:
            raise ValueError(f"caution must be >= 0, got {caution}")
        self.k_max, self.decay, self.caution = k_max, decay, caution
        # The starting guess for position 1 is stored as pseudo-counts that decay like real
        # ones, so a drafter that is always wrong drives its estimate all the way to 0.
        self._pooled = DecayedCounts(k_max)
        self._pooled.hits[0], self._pooled.tries[0] = PRIOR_WEIGHT * prior_acceptance, PRIOR_WEIGHT
        self._by_signal: dict[int, DecayedCounts] = {}
        for signal, (hits, tries) in (learned or {}).items():
            self._start_from(int(signal), np.asarray(hits, float), np.asarray(tries, float))
        self._session: dict[int, DecayedCounts] = {}  # undecayed, since the last export()

    def _start_from(self, signal: int, hits: np.ndarray, tries: np.ndarray) -> None:
        n = min(len(hits), len(tries), self.k_max)
        counts = self._counts(signal)
        scale = np.minimum(1.0, LEARNED_WEIGHT_MAX / np.maximum(tries[:n], 1e-9))
        counts.hits[:n], counts.tries[:n] = hits[:n] * scale, tries[:n] * scale

    def _counts(self, signal: int) -> DecayedCounts:
        counts = self._by_signal.get(signal)
        if counts is None:
            counts = self._by_signal[signal] = DecayedCounts(self.k_max)
        return counts

    def _session_counts(self, signal: int) -> DecayedCounts:
        counts = self._session.get(signal)
        if counts is None:
            counts = self._session[signal] = DecayedCounts(self.k_max)
        return counts

    # -- estimates --------------------------------------------------------------------------

    def mean(self, signal: int = 0) -> np.ndarray:
        """Estimated acceptance a_1..a_k_max of this signal class (a copy)."""
        return self._estimate(signal)[0]

    def planning(self, signal: int = 0) -> np.ndarray:
        """What the controller plans with: the mean less `caution` standard errors, per position."""
        rates, evidence = self._estimate(signal)
        if not self.caution:
            return rates
        return np.clip(rates - self.caution * np.sqrt(rates * (1.0 - rates) / (evidence + 1.0)), 0.0, 1.0)

    def _estimate(self, signal: int) -> tuple[np.ndarray, np.ndarray]:
        rates, evidence = self._pooled_estimate()
        counts = self._by_signal.get(signal)
        if counts is not None:
            rates = (counts.hits + BORROW_WEIGHT * rates) / (counts.tries + BORROW_WEIGHT)
            evidence = counts.tries + np.minimum(evidence, BORROW_WEIGHT)
        return rates, evidence

    def _pooled_estimate(self) -> tuple[np.ndarray, np.ndarray]:
        counts = self._pooled
        rates, evidence = np.empty(self.k_max), np.empty(self.k_max)
        rates[0], evidence[0] = counts.hits[0] / counts.tries[0], counts.tries[0]
        # A position with few observations leans on the one before it (see DEPTH_SHRINK).
        for i in range(1, self.k_max):
            prior = DEPTH_SHRINK * rates[i - 1]
            rates[i] = (counts.hits[i] + BORROW_WEIGHT * prior) / (counts.tries[i] + BORROW_WEIGHT)
            evidence[i] = counts.tries[i] + min(evidence[i - 1], BORROW_WEIGHT)
        return rates, evidence

    def export(self) -> dict[int, tuple[list[float], list[float]]]:
        """Per signal class, the (hits, tries) per position observed since the last export; then forget them."""
        session, self._session = self._session, {}
        return {signal: (counts.hits.tolist(), counts.tries.tolist())
                for signal, counts in session.items() if counts.tries.any()}


class VerifiedAcceptance(_Estimates):
    """Learns from verification only: for drafters whose proposals cost time (a draft model)."""

    def __init__(self, k_max: int, *, decay: float = VERIFIED_DECAY, prior_acceptance: float = 0.6,
                 caution: float = 0.0, learned=None):
        super().__init__(k_max, decay=decay, prior_acceptance=prior_acceptance, caution=caution, learned=learned)

    def watch(self, context: list[int], signal: int, proposal: Callable[[], Sequence[int]],
              copy: int | None = None) -> None:
        """Nothing to learn before a step: this learner sees only what verification keeps."""

    def record(self, proposed: int, accepted: int, signal: int = 0) -> None:
        """One verification: `proposed` tokens were drafted, the first `accepted` kept."""
        if proposed == 0:
            return
        for counts in (self._pooled, self._counts(signal)):
            counts.decay(self.decay)
            counts.observe(proposed, accepted)
        self._session_counts(signal).observe(proposed, accepted)
