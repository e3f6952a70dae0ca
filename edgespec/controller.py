"""Chooses how many tokens to draft at each step, so that expected tokens per second is highest.

A plan that drafts k tokens is worth E(k) / C(k):

    E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i     tokens per step: the accepted drafts plus the
                                                target's own correction or bonus token
    C(k) = T(k + 1) + k * c_d                   one target pass over k + 1 tokens, plus drafting

where a_i is the estimated chance that draft position i is accepted when every position before it
was. k = 0 is plain decoding, so when no draft length pays the controller stops drafting, and
then probes on a deterministic schedule so that it notices when drafting pays again: a probe
drafts `probe_k` tokens after enough backed-off steps that the expected throughput lost to
probes stays under `probe_budget` (a fraction of plain decoding), and again at once after a
probe that was fully accepted.

A drafter whose proposals cost nothing (n-grams) needs no probes: its controller is made with
hindsight=True and is shown, every step, the whole proposal the drafter could make (foresee), which
it scores against the tokens that follow (settle). It then learns the acceptance of every draft
position at every step, including the steps where it drafts nothing.

The controller only decides how much is proposed; verification is untouched, so output stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .costs import CostModel, best_speedup

# n-gram match lengths 1, 2-3, 4-7, 8-15 and 16+ get their own estimates; 0 means "no signal".
# Longer matches are accepted more often, and at every depth, not only the first.
SIGNAL_BUCKETS = 5
# Starting guesses for an n-gram drafter's acceptance at every depth, per bucket (no match, 1, 2-3,
# 4-7, 8-15, 16+), scored in hindsight on Qwen2.5-Coder-1.5B's greedy replies to the bench's five
# workloads. Each counts as PRIOR_WEIGHT observations, so a workload that behaves otherwise
# overrides it within a few steps; without them every run would start from prior_acceptance.
NGRAM_PRIOR_BY_BUCKET = (0.6, 0.25, 0.6, 0.88, 0.9, 0.95)

# Pseudo-observations behind the starting guess for position 1; small, so real outcomes win fast.
PRIOR_WEIGHT = 2.0
# How many observations a position's own estimate needs before it outweighs its prior (the
# position before it, or the drafter's pooled estimate for a signal bucket).
BORROW_WEIGHT = 1.0
# A position with little data is assumed slightly worse than the one before it, so long drafts
# are earned by observed acceptance rather than extrapolated from a lucky streak at position 1.
DEPTH_SHRINK = 0.98
# A controller that learns in hindsight gets an observation every step, not only when it drafts,
# so it can afford a shorter memory: it notices within a few tokens that a copy has begun.
HINDSIGHT_DECAY = 0.9
# A drafter is probed only if, accepted this often, it would beat plain decoding. Not 1.0: a drafter
# that is always right makes a 15-token draft look worth 1.11x on this CPU's cheap 16-token pass even
# at a draft-model cost of 43% of a target step, and probing it cost chat replies 10-13%.
PROBE_ACCEPTANCE = 0.9


class _DecayedCounts:
    """Accepted and tried counts per draft position, each multiplied by `decay` per observation."""

    def __init__(self, k_max: int, first_hits: float = 0.0, first_tries: float = 0.0) -> None:
        self.hits = np.zeros(k_max)
        self.tries = np.zeros(k_max)
        self.hits[0] = first_hits
        self.tries[0] = first_tries

    def decay(self, factor: float) -> None:
        self.hits *= factor
        self.tries *= factor

    def observe_position(self, position: int, accepted: bool) -> None:
        """One draft position (0-based) reached, and whether it was accepted."""
        if position < len(self.tries):
            self.tries[position] += 1.0
            self.hits[position] += accepted

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        self.decay(decay)
        depth = len(self.tries)
        accepted = min(accepted, depth)
        self.hits[:accepted] += 1.0
        self.tries[:accepted] += 1.0
        # The first rejected position was tried too; positions after it were never reached.
        if accepted < min(proposed, depth):
            self.tries[accepted] += 1.0


@dataclass
class _Foreseen:
    """A foreseen proposal: tokens guessed for context[start:], checked up to `checked`."""

    start: int
    tokens: list[int]
    bucket: _DecayedCounts
    checked: int = 0

    def settle(self, context: list[int], pooled: _DecayedCounts) -> bool:
        """Count the newly known positions; True while some are still unknown."""
        while self.checked < len(self.tokens) and self.start + self.checked < len(context):
            accepted = context[self.start + self.checked] == self.tokens[self.checked]
            for counts in (pooled, self.bucket):
                counts.observe_position(self.checked, accepted)
            self.checked += 1
            if not accepted:
                return False  # later positions would never have been reached
        return self.checked < len(self.tokens)


@dataclass
class _ProbeSchedule:
    idle_steps: int = 0  # consecutive backed-off steps since the last draft or probe
    due: bool = False  # the last probe was fully accepted: probe again at once


class DraftLengthController:
    """Picks k for each step from a cost curve and online acceptance estimates.

    One controller serves one drafter (the engine keeps one per drafter). Call `choose` before
    drafting and `update` after verification, with the same signal: the n-gram match length
    (0 when there is none), whose buckets keep estimates of their own.
    """

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        fixed_k: int | None = None,
        *,
        p_min: float | None = None,
        decay: float = 0.95,
        prior_acceptance: float = 0.6,
        probe_budget: float = 0.01,
        probe_k: int = 1,
        hindsight: bool = False,
        prior_by_bucket: Sequence[float] = (),
    ) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if fixed_k is not None and not 0 <= fixed_k <= k_max:
            raise ValueError(f"fixed_k must be in 0..k_max={k_max}, got {fixed_k}")
        if p_min is not None and not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        if not 0.0 < probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if not 1 <= probe_k <= k_max:
            raise ValueError(f"probe_k must be in 1..k_max={k_max}, got {probe_k}")
        self.k_max = k_max
        self.fixed_k = fixed_k
        self.decay = decay
        self.prior_acceptance = prior_acceptance
        self.probe_budget = probe_budget
        self.probe_k = probe_k
        self.hindsight = hindsight
        self._prior_by_bucket = tuple(prior_by_bucket)
        self._foreseen: list[_Foreseen] = []  # proposals waiting to be checked against the text
        self._foreseen_context: list[int] | None = None  # the context they were made on
        self._p_min_setting = p_min
        self.set_cost(cost)
        # The starting guess for position 1 is stored as pseudo-counts that decay like real
        # ones, so a drafter that is always wrong drives its estimate all the way to 0.
        self._pooled = _DecayedCounts(k_max, PRIOR_WEIGHT * prior_acceptance, PRIOR_WEIGHT)
        self._bucketed: dict[int, _DecayedCounts] = {}
        self._schedules: dict[int, _ProbeSchedule] = {}
        self._probing: int | None = None  # the signal bucket of the probe just chosen
        self._thresholds: tuple[float, ...] = ()
        self.reset_stats()

    def set_cost(self, cost: CostModel) -> None:
        """Use another cost curve (e.g. measured again) from the next choice on; the acceptance
        estimates are kept."""
        self.cost = cost
        # Plan cost for k = 0..k_max drafted tokens.
        self._plan_seconds = np.array([cost.target(k + 1) + cost.draft(k) for k in range(self.k_max + 1)])
        # When even a drafter accepted this often could not beat plain decoding at these costs,
        # probing cannot find anything worth drafting (a draft model on a CPU where its tokens are dear).
        self._worth_probing = best_speedup(cost, PROBE_ACCEPTANCE, self.k_max)[1] > 1.0

    # -- acceptance estimates -------------------------------------------------------------

    def acceptance(self, signal: int = 0) -> np.ndarray:
        """Estimated a_1..a_k_max for this signal bucket (a copy)."""
        # Each bucket leans on the one below it (shorter matches), the first on the pooled estimate.
        rates = self._pooled_rates()
        for key in range(_bucket(signal) + 1):
            counts = self._bucketed.get(key)
            if counts is not None:
                rates = (counts.hits + BORROW_WEIGHT * rates) / (counts.tries + BORROW_WEIGHT)
        return rates

    def _pooled_rates(self) -> np.ndarray:
        counts = self._pooled
        rates = np.empty(self.k_max)
        rates[0] = counts.hits[0] / counts.tries[0]
        # A position with few observations leans on the one before it (see DEPTH_SHRINK).
        for i in range(1, self.k_max):
            prior = DEPTH_SHRINK * rates[i - 1]
            rates[i] = (counts.hits[i] + BORROW_WEIGHT * prior) / (counts.tries[i] + BORROW_WEIGHT)
        return rates

    # -- choosing k -----------------------------------------------------------------------

    def choose(self, signal: int = 0, available: int | None = None) -> int:
        """How many tokens to draft this step; `available` caps it (n-gram continuation
        length, room left in the context or in max_tokens)."""
        limit = self.k_max if available is None else max(0, min(self.k_max, available))
        self._steps += 1
        self._probing = None
        self._thresholds = ()
        if self.fixed_k is not None:
            k = min(self.fixed_k, limit)
            self._thresholds = (self._p_min_setting or 0.0,) * k
        elif limit == 0:
            self._unavailable_steps += 1
            k = 0
        else:
            k = self._choose_auto(signal, limit)
        self._k_total += k
        return k

    def best(self, signal: int = 0, available: int | None = None) -> tuple[int, float]:
        """The draft length with the highest expected tokens per second now, and that rate.

        Changes nothing (no probe is scheduled, no step counted): the engine's
        combined drafter asks each drafter's controller, then lets the winner choose().
        """
        limit = self.k_max if available is None else max(0, min(self.k_max, available))
        rates = self._rates(self.acceptance(signal), limit)
        if self.fixed_k is not None:
            k = min(self.fixed_k, limit)
        else:
            k = int(np.argmax(rates))
        return k, float(rates[k])

    def stop_thresholds(self) -> tuple[float, ...]:
        """p_min for each position of the draft chosen last: stop drafting before position i when the draft
        model's top probability is below the (i-1)-th entry."""
        return self._thresholds

    def _choose_auto(self, signal: int, limit: int) -> int:
        alphas = self.acceptance(signal)
        rates = self._rates(alphas, limit)
        k = int(np.argmax(rates))  # ties go to the shorter draft
        key = _bucket(signal)
        schedule = self._schedules.setdefault(key, _ProbeSchedule())
        if k > 0 or self.hindsight:  # hindsight learns without probing
            schedule.idle_steps, schedule.due = 0, False
            self._thresholds = self._stop_thresholds(alphas, k, rates[k])
            return k
        probe_k = min(self.probe_k, limit)
        if not self._worth_probing:
            self._k0_steps += 1
            return 0
        # Each probe is expected to lose this fraction of a plain step's throughput; spacing
        # probes by loss / budget steps keeps the total loss under the budget.
        loss = 1.0 - rates[probe_k] / rates[0]
        if schedule.due or schedule.idle_steps >= loss / self.probe_budget:
            schedule.idle_steps, schedule.due = 0, False
            self._probing = key
            self._probe_steps += 1
            # A probe is for information: the draft is not cut short by p_min.
            self._thresholds = (0.0,) * probe_k
            return probe_k
        schedule.idle_steps += 1
        self._k0_steps += 1
        return 0

    def _rates(self, alphas: np.ndarray, limit: int) -> np.ndarray:
        """Expected tokens per second for k = 0..limit."""
        reach = np.cumprod(alphas[:limit])
        tokens = 1.0 + np.concatenate(([0.0], np.cumsum(reach)))
        return tokens / self._plan_seconds[: limit + 1]

    # -- p_min ----------------------------------------------------------------------------

    def p_min(self, position: int) -> float:
        """Stop drafting before position `position` (1-based) of the current step when the draft
        model's top probability for it is below this.

        Tuned rule (when no fixed p_min was given): drafting token j is worth it when what it
        adds, P(j-1 accepted) * q * (1 + expected accepted tokens after j), is worth the time it
        adds, R * (C(k) - T(j) - j * c_d), at R, the best expected tokens per second. Taking the
        draft's own top probability for q gives the break-even q. It is never above the
        estimated a_j of the chosen plan, so drafting stops only where the draft itself is
        less sure than the drafter usually is. A fixed p_min replaces the rule; with fixed k
        and no fixed p_min it is 0, and probes always draft in full. Beyond the chosen k it
        is 1: never draft past k.
        """
        if 1 <= position <= len(self._thresholds):
            return self._thresholds[position - 1]
        return 1.0

    def _stop_thresholds(self, alphas: np.ndarray, k: int, rate: float) -> tuple[float, ...]:
        if self._p_min_setting is not None:
            return (self._p_min_setting,) * k
        a = alphas[:k]
        reached = np.concatenate(([1.0], np.cumprod(a)[:-1]))  # P(positions before j accepted)
        after = np.zeros(k)  # expected accepted tokens after j, given j was accepted
        for j in range(k - 2, -1, -1):
            after[j] = a[j + 1] * (1.0 + after[j + 1])
        positions = np.arange(1, k + 1)
        stop_seconds = np.array([self.cost.target(j) for j in positions]) + self.cost.draft(positions)
        saved = self._plan_seconds[k] - stop_seconds
        with np.errstate(divide="ignore", invalid="ignore"):
            threshold = np.where(reached > 0, rate * saved / (reached * (1.0 + after)), 1.0)
        return tuple(float(t) for t in np.clip(threshold, 0.0, 1.0))

    # -- learning -------------------------------------------------------------------------

    def update(self, proposed: int, accepted: int, signal: int = 0) -> None:
        """Record one verification: `proposed` tokens were drafted, the first `accepted` kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        key = _bucket(signal)
        probing, self._probing = self._probing == key, None
        if proposed == 0:
            return
        self._pooled.observe(proposed, accepted, self.decay)
        bucket = self._bucket_counts(key)
        bucket.observe(proposed, accepted, self.decay)
        if probing and accepted == proposed:
            self._schedules[key].due = True

    def foresee(self, context: list[int], tokens: Sequence[int], signal: int = 0) -> None:
        """Record what a deterministic drafter would propose after context (as many tokens as it
        can, whatever k is chosen), to be checked by settle() as the text goes on.

        This is how an n-gram drafter's controller learns (one made with hindsight=True): every
        step teaches it the acceptance of every draft position up to k_max, also at steps where
        it drafts nothing.  The check is fair at any temperature: the tokens that follow are
        sampled from the target's distribution, so a foreseen token matches the next one with
        the probability that verification would have accepted it.
        """
        if context is not self._foreseen_context:
            self._foreseen, self._foreseen_context = [], context  # a new text: old proposals say nothing
        if not tokens:
            return
        bucket = self._bucket_counts(_bucket(signal))
        for counts in (self._pooled, bucket):
            counts.decay(self.decay)  # once per proposal, as update() decays once per verification
        self._foreseen.append(_Foreseen(len(context), list(tokens[: self.k_max]), bucket))

    def settle(self, context: list[int]) -> None:
        """Score the recorded proposals against the tokens context has gained since, position by
        position: each position counts once the token it guessed is known."""
        if context is not self._foreseen_context:
            self._foreseen, self._foreseen_context = [], None
            return
        pending = []
        for entry in self._foreseen:
            if entry.settle(context, self._pooled):
                pending.append(entry)
        self._foreseen = pending

    def _bucket_counts(self, key: int) -> _DecayedCounts:
        counts = self._bucketed.get(key)
        if counts is None:
            counts = self._bucketed[key] = _DecayedCounts(self.k_max)
            if key < len(self._prior_by_bucket):
                counts.hits[:] = PRIOR_WEIGHT * self._prior_by_bucket[key]
                counts.tries[:] = PRIOR_WEIGHT
        return counts

    def reset_stats(self) -> None:
        """Start counting steps afresh (e.g. per generation); the estimates are kept."""
        self._steps = 0
        self._k_total = 0
        self._k0_steps = 0
        self._probe_steps = 0
        self._unavailable_steps = 0

    @property
    def stats(self) -> dict:
        """steps: choose() calls; mean_k: mean chosen k over them; k0_steps: steps that fell
        back to plain decoding although drafting was possible; probe_steps: probes;
        unavailable_steps: steps with nothing to draft (available == 0)."""
        return {
            "steps": self._steps,
            "mean_k": self._k_total / self._steps if self._steps else 0.0,
            "k0_steps": self._k0_steps,
            "probe_steps": self._probe_steps,
            "unavailable_steps": self._unavailable_steps,
        }


def _bucket(signal: int) -> int:
    return 0 if signal <= 0 else min(int(signal).bit_length(), SIGNAL_BUCKETS)
