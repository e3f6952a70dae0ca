"""Chooses how many tokens to draft at each step, so that expected tokens per second is highest.

A plan that drafts k tokens is worth E(k) / C(k):

    E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i     tokens per step: the accepted drafts plus the
                                                target's own correction or bonus token
    C(k) = T(k + 1) + k * c_d                   one target pass over k + 1 tokens, plus drafting

where a_i is the drafter's estimated chance (acceptance.py, hindsight.py) that draft position i is accepted when
every position before it was. k = 0 is plain decoding, so when no draft length pays the controller
stops drafting. A drafter that learns only from what it drafts is then probed now and then, so that
the controller notices when drafting pays again: a probe drafts `probe_k` tokens. Probes spend an
allowance, in plain steps' time, that grows by `probe_budget` at each step of their signal (`watch`,
whether the drafter can propose then or not): a probe is made only while the allowance covers what
it loses if all of it is rejected, and each probe spends what it really lost against plain decoding
on the cost curve at the wide passes' present price (C(k) / T(1) less the tokens it gave). As a
probe is made only with its worst loss in hand, probes never lose more than `probe_budget` of plain
decoding's time, whatever the acceptance; and a probe that pays adds what it gained, so probes
follow each other at once while they pay and the controller finds a drafter that does. A drafter
that learns in hindsight needs no probes.

A speed guard (SpeedGuard) watches what the drafted steps really gave: their tokens against what
plain decoding would have made in their time. While they lose, the gain the estimates promise is
discounted by what was realized, so drafting backs off until the estimates earn it again; a copy
that pays is never slowed, as its realized gain is above 1. The guard also prices wide passes as
they run now: the cached curve's shape is one minute's, and on a shared CPU it moves by more than
the margin one-token drafts live on (T(2)/T(1) 1.64 one half hour, 1.87 the next, on an AVX-512
EPYC), so plans price each width by what its recent passes cost against the plain ones, leaning on
what all recent wide passes cost while a width has few passes of its own.

The controller only decides how much is proposed; verification is untouched, so output stays exact.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .acceptance import VerifiedAcceptance
from .hindsight import HindsightAcceptance
from .costs import CostModel, best_speedup

# A drafter is probed only if, accepted this often, it would beat plain decoding. Not 1.0: a drafter
# that is always right makes a 15-token draft look worth 1.11x on this CPU's cheap 16-token pass even
# at a draft-model cost of 43% of a target step, and probing it cost chat replies 10-13%.
PROBE_ACCEPTANCE = 0.9
# The speed guard's memory, per step (drafted or not), and how many plain-speed steps its verdict
# starts from: it judges on a few drafted steps' evidence, and forgets a verdict as it ages, so a
# back-off does not outlive the steps that caused it.
GUARD_DECAY = 0.97
GUARD_PRIOR_STEPS = 3.0
# The price of wide passes against the curve's: its memory, per wide pass seen (not per step, so that
# what the last few cost is kept through a stretch of plain steps instead of being forgotten and paid
# for again), and how many wide passes at the curve's own price it starts from (they fade like any).
PRICE_DECAY = 0.9
PRICE_PRIOR_PASSES = 2.0
# A width's own price leans on the wide passes' common one until it has about this many passes of its own:
# the cached curve's shape is one calibration's, and on a noisy machine one width can be off by a third
# while its neighbours are right (T(3) 1.82, T(4) 1.86 cached on the AVX2 EPYC, T(4) 2.1-2.7 in generation),
# which a common factor cannot mend: the cheap-looking width is drafted on while the others are priced fairly.
WIDTH_PRIOR_PASSES = 1.0
# The most a probe allowance holds, in probes that lose all they draft: enough that a drafter whose
# probes mostly pay is not stopped by one rejected probe while its estimate climbs, few enough that
# steps without probes save up only a short burst of them.
PROBE_SAVINGS = 3.0


class SpeedGuard:
    """The realized speedup of the recent drafted steps over plain decoding, from their passes' times.

    Each step reports its width, the tokens it produced and the seconds its target pass took (or, with
    a fixed cost curve, what the curve says); a draft model's own time is not counted here, only in
    the plans.  A plain step would have taken T(1) times the machine's present load, measured on the
    recent plain steps (1.0 before there are any), so a machine slower than when it was calibrated
    does not look like drafting that loses.  The same times give the wide passes' price: what they
    cost against the curve, over what the plain steps around them cost against it, for all of them
    (wide_price) and per width (width_prices).
    """

    def __init__(self, cost: CostModel, decay: float = GUARD_DECAY) -> None:
        self.cost, self.decay = cost, decay
        self._tokens = 0.0  # tokens the drafted steps produced, decayed
        self._plain_steps = 0.0  # plain steps their time would have bought, decayed
        self._plain_load = 0.0  # the plain steps' seconds over T(1), summed and decayed
        self._plain_count = 0.0
        # the wide passes' seconds over T(width), over the plain load then, summed and decayed
        self._wide_price = self._wide_count = PRICE_PRIOR_PASSES
        self._width_prices: dict[int, list[float]] = {}  # width -> [its passes' prices, summed; their count], decayed

    def observe(self, width: int, tokens: int, seconds: float) -> None:
        self._tokens *= self.decay
        self._plain_steps *= self.decay
        self._plain_load *= self.decay
        self._plain_count *= self.decay
        if width == 1:
            self._plain_load += seconds / self.cost.target(1)
            self._plain_count += 1.0
            return
        load = (self._plain_load + 1.0) / (self._plain_count + 1.0)
        self._tokens += tokens
        self._plain_steps += seconds / (self.cost.target(1) * load)
        price = seconds / (self.cost.target(width) * load)
        self._wide_price = self._wide_price * PRICE_DECAY + price
        self._wide_count = self._wide_count * PRICE_DECAY + 1.0
        own = self._width_prices.setdefault(width, [0.0, 0.0])
        own[0] = own[0] * PRICE_DECAY + price
        own[1] = own[1] * PRICE_DECAY + 1.0

    def gain(self) -> float:
        """Tokens per plain step's time of the recent drafted steps, leaning on 1.0 while they are few."""
        return (self._tokens + GUARD_PRIOR_STEPS) / (self._plain_steps + GUARD_PRIOR_STEPS)

    def wide_price(self) -> float:
        """What the recent passes over more than one token cost against the curve, the plain passes' load
        taken out (1.0: as the curve says), leaning on 1.0 while they are few."""
        return self._wide_price / self._wide_count

    def width_prices(self, widths: int) -> np.ndarray:
        """Each width 1..widths's price against the curve now: 1.0 for one token (the load is taken out),
        a wider pass's own recent price, leaning on the wide passes' common one (wide_price) while it
        has few passes of its own."""
        common = self.wide_price()
        prices = np.full(widths, common)
        prices[0] = 1.0
        for width, (total, count) in self._width_prices.items():
            if width <= widths:
                prices[width - 1] = (total + WIDTH_PRIOR_PASSES * common) / (count + WIDTH_PRIOR_PASSES)
        return prices


class DraftLengthController:
    """Picks k for each step from a cost curve and an acceptance estimate (acceptance.py, hindsight.py).

    One controller serves one drafter (the engine keeps one per drafter). Each step: `watch` before
    choosing (a hindsight learner scores the drafter's foreseen proposals), `choose` (or `best`, to
    compare drafters), and `update` after verification, all with the same signal, the drafter's
    class of its guess.
    """

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        fixed_k: int | None = None,
        *,
        estimate=None,
        p_min: float | None = None,
        probe_budget: float = 0.01,
        probe_k: int = 1,
    ) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if fixed_k is not None and not 0 <= fixed_k <= k_max:
            raise ValueError(f"fixed_k must be in 0..k_max={k_max}, got {fixed_k}")
        if p_min is not None and not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        if not 0.0 < probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if not 1 <= probe_k <= k_max:
            raise ValueError(f"probe_k must be in 1..k_max={k_max}, got {probe_k}")
        self.k_max = k_max
        self.fixed_k = fixed_k
        self.estimate = estimate if estimate is not None else VerifiedAcceptance(k_max)
        if self.estimate.k_max != k_max:
            raise ValueError(f"the acceptance estimate covers {self.estimate.k_max} positions, not k_max={k_max}")
        self.probe_budget = probe_budget
        self.probe_k = probe_k
        self._p_min_setting = p_min
        self._allowances: dict[int, float] = {}  # per signal: plain steps' time its probes may still lose
        self._probing: int | None = None  # the signal of the probe just chosen
        self.probes = 0  # probes chosen so far (benchmarks/heads_speed.py counts them per reply)
        self._thresholds: tuple[float, ...] = ()
        self.set_cost(cost)

    def set_cost(self, cost: CostModel) -> None:
        """Use another cost curve (e.g. measured again) from the next choice on; the acceptance
        estimates are kept, the speed guard starts afresh."""
        self.cost = cost
        # A plan drafting k = 0..k_max tokens costs its target pass over k + 1 tokens plus the drafting.
        self._pass_seconds = np.array([cost.target(k + 1) for k in range(self.k_max + 1)])
        self._drafting_seconds = np.array([cost.draft(k) for k in range(self.k_max + 1)])
        # When even a drafter accepted this often could not beat plain decoding at these costs,
        # probing cannot find anything worth drafting (a draft model on a CPU where its tokens are dear).
        self._worth_probing = best_speedup(cost, PROBE_ACCEPTANCE, self.k_max)[1] > 1.0
        self.guard = SpeedGuard(cost)

    @property
    def may_draft(self) -> bool:
        """Whether this controller expects to draft at all: at a fixed length above 0, or, choosing the length,
        where a drafter accepted PROBE_ACCEPTANCE of the time would beat plain decoding at these costs (a draft
        model on a CPU where its tokens are dear would not).  An expectation, not a promise: learned prices
        and estimates can still make a draft pay later."""
        return self.fixed_k > 0 if self.fixed_k is not None else self._worth_probing

    def acceptance(self, signal: int = 0) -> np.ndarray:
        """The acceptance a_1..a_k_max the controller plans with for this signal (a copy)."""
        return self.estimate.planning(signal)

    # -- choosing k -----------------------------------------------------------------------

    def watch(self, context: list[int], signal: int, proposal: Callable[[], Sequence[int]],
              copy: int | None = None) -> None:
        """Before choosing, at every step the drafter is considered (whether it can propose now or not): let
        the estimate learn from the drafter's whole proposal (proposal() makes it; only a hindsight learner
        calls it) and the copy it continues (Hint.copy), and add the step's budget to the signal's probe
        allowance."""
        self.estimate.watch(context, signal, proposal, copy)
        if not self.estimate.learns_without_drafting:
            held = self._allowances.get(signal, 0.0)
            self._allowances[signal] = min(held + self.probe_budget, PROBE_SAVINGS * self._probe_worst_loss())

    def choose(self, signal: int = 0, available: int | None = None) -> int:
        """How many tokens to draft this step; `available` caps it (n-gram continuation
        length, room left in the context or in max_tokens)."""
        limit = self.k_max if available is None else max(0, min(self.k_max, available))
        self._probing = None
        self._thresholds = ()
        if self.fixed_k is not None:
            k = min(self.fixed_k, limit)
            self._thresholds = (self._p_min_setting or 0.0,) * k
            return k
        if limit == 0:
            return 0
        return self._choose_auto(signal, limit)

    def best(self, signal: int = 0, available: int | None = None) -> tuple[int, float]:
        """The draft length with the highest expected tokens per second now, and that rate.

        Changes nothing (no probe is scheduled): the engine's combined drafter asks each drafter's
        controller, then lets the winner choose().
        """
        limit = self.k_max if available is None else max(0, min(self.k_max, available))
        rates = self._rates(self.acceptance(signal), limit)
        k = min(self.fixed_k, limit) if self.fixed_k is not None else int(np.argmax(rates))
        return k, float(rates[k])

    def stop_thresholds(self) -> tuple[float, ...]:
        """p_min for each position of the draft chosen last: stop drafting before position i when the draft
        model's top probability is below the (i-1)-th entry (1 past the chosen k: never draft past it)."""
        return self._thresholds

    def _choose_auto(self, signal: int, limit: int) -> int:
        alphas = self.acceptance(signal)
        rates = self._rates(alphas, limit)
        k = int(np.argmax(rates))  # ties go to the shorter draft
        if k > 0:
            self._thresholds = self._stop_thresholds(alphas, k, rates[k])
            return k
        if self.estimate.learns_without_drafting:
            return 0  # it learns from every step's proposal, drafted or not: no probes
        if not self.probe_due(signal):
            return 0
        probe_k = min(self.probe_k, limit)
        self._probing = signal
        self.probes += 1
        # A probe is for information: the draft is not cut short by p_min.
        self._thresholds = (0.0,) * probe_k
        return probe_k

    def probe_due(self, signal: int = 0) -> bool:
        """Whether a step of this signal whose plan drafts nothing probes: the draft length is chosen, the
        drafter learns only from verification, probing could find a gain, and the allowance covers what a
        probe loses at worst."""
        return (self.fixed_k is None and self._worth_probing and not self.estimate.learns_without_drafting
                and self._allowances.get(signal, 0.0) >= self._probe_worst_loss())

    def _rates(self, alphas: np.ndarray, limit: int) -> np.ndarray:
        """Expected tokens per second for k = 0..limit, at the wide passes' present price, the promised gain
        discounted while drafting loses."""
        reach = np.cumprod(alphas[:limit])
        extra = np.concatenate(([0.0], np.cumsum(reach))) * min(1.0, self.guard.gain())
        return (1.0 + extra) / self._priced_plans()[: limit + 1]

    def _probe_worst_loss(self) -> float:
        """The most one probe can lose (all of it rejected), in plain steps, at the wide passes' present price."""
        plans = self._priced_plans()
        return max(0.0, plans[self.probe_k] / plans[0] - 1.0)

    def _priced_plans(self) -> np.ndarray:
        """The plans' seconds with their target passes at the price wide passes have now (SpeedGuard)."""
        return self._priced_passes() + self._drafting_seconds

    def _priced_passes(self) -> np.ndarray:
        return self._pass_seconds * self.guard.width_prices(len(self._pass_seconds))

    def _stop_thresholds(self, alphas: np.ndarray, k: int, rate: float) -> tuple[float, ...]:
        """Tuned p_min per position (when no fixed p_min was given): drafting token j is worth it when
        what it adds, P(j-1 accepted) * q * (1 + expected accepted tokens after j), is worth the time
        it adds, R * (C(k) - T(j) - j * c_d), at R, the best expected tokens per second.  Taking the
        draft's own top probability for q gives the break-even q, never above the estimated a_j."""
        if self._p_min_setting is not None:
            return (self._p_min_setting,) * k
        a = alphas[:k]
        reached = np.concatenate(([1.0], np.cumprod(a)[:-1]))  # P(positions before j accepted)
        after = np.zeros(k)  # expected accepted tokens after j, given j was accepted
        for j in range(k - 2, -1, -1):
            after[j] = a[j + 1] * (1.0 + after[j + 1])
        positions = np.arange(1, k + 1)
        passes = self._priced_passes()
        stop_seconds = passes[positions - 1] + self.cost.draft(positions)
        saved = passes[k] + self._drafting_seconds[k] - stop_seconds
        with np.errstate(divide="ignore", invalid="ignore"):
            threshold = np.where(reached > 0, rate * saved / (reached * (1.0 + after)), 1.0)
        return tuple(float(t) for t in np.clip(threshold, 0.0, 1.0))

    # -- learning -------------------------------------------------------------------------

    def update(self, proposed: int, accepted: int, signal: int = 0, seconds: float | None = None) -> None:
        """Record one verification: `proposed` tokens were drafted, the first `accepted` kept, in a pass
        that took `seconds` (None: what the cost curve says, as with a fixed curve)."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        probing, self._probing = self._probing == signal, None
        width = proposed + 1
        if seconds is None:
            seconds = self.cost.target(width)
        self.guard.observe(width, accepted + 1, seconds)
        self.estimate.record(proposed, accepted, signal)
        if probing:  # what it lost against plain decoding, in plain steps; a probe that paid gives back its gain
            plans = self._priced_plans()
            lost = plans[proposed] / plans[0] - (accepted + 1)
            left = self._allowances.get(signal, 0.0) - lost
            self._allowances[signal] = min(left, PROBE_SAVINGS * self._probe_worst_loss())


def controller_for(drafter: str, cost: CostModel, k_max: int, fixed_k: int | None = None,
                   learned=None, prior_acceptance: float | None = None) -> DraftLengthController:
    """The controller the engine gives a drafter: an n-gram drafter's proposals are free to make, so its
    estimate learns in hindsight from every step; a draft model's (or heads') learns from verification.
    learned: the drafter's learned prior for this model (learned.py), or None for the neutral built-in
    one; prior_acceptance: what a verified drafter starts from instead of a draft model's typical rate
    (heads: their file's held-out accuracy)."""
    if drafter == "ngram":
        estimate = HindsightAcceptance(k_max, learned=learned)
    elif prior_acceptance is not None:
        estimate = VerifiedAcceptance(k_max, learned=learned, prior_acceptance=prior_acceptance)
    else:
        estimate = VerifiedAcceptance(k_max, learned=learned)
    return DraftLengthController(cost, k_max, fixed_k, estimate=estimate)
