import itertools

import numpy as np
import pytest

from edgespec.acceptance import VerifiedAcceptance
from edgespec.hindsight import (COPY_BUCKETS, LENDING_COPY, LENDING_SOURCES, MAX_COUNTS_PER_POSITION, PAIR_WEIGHT,
                                HindsightAcceptance, PairRecord)
from edgespec.calibration import CalibrationCache, CalibrationKey, StepTimeWatch
from edgespec.pass_prices import priced_curve
from edgespec.controller import DraftLengthController, SpeedGuard, controller_for
from edgespec.costs import CostModel
from edgespec.drafters import SOURCES, NgramDrafter, ngram_signal

K_MAX = 15

# Seconds per target pass over n tokens, n = 1..16 (index n - 1).
CURVES = {
    # Measured shape of Qwen2.5-Coder-1.5B on 2 CPU threads; not smooth: 16 tokens cost
    # little more than 8, so a long draft can beat a middling one.
    "cpu": [1.0, 1.5, 2.2, 3.0, 3.6, 4.2, 6.5, 8.8, 9.0, 9.2, 9.4, 9.6, 9.8, 10.0, 10.2, 10.5],
    "gpu": [1.0, 1.0, 1.01, 1.01, 1.02, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09, 1.1, 1.11, 1.12],
    "linear": [float(n) for n in range(1, 17)],
}
ACCEPTANCE = [0.0, 0.3, 0.6, 0.8, 0.95, 1.0]


def chain_outcome(rng, alpha, proposed):
    """How many of `proposed` drafted tokens a target with per-position acceptance alpha keeps."""
    accepted = 0
    while accepted < proposed and rng.random() < alpha:
        accepted += 1
    return accepted


def brute_force_rates(curve, draft_cost, alphas, limit):
    """Expected tokens per second for k = 0..limit, by enumerating how many drafts survive."""
    rates = []
    for k in range(limit + 1):
        expected = 0.0
        for survived in range(k + 1):
            p = float(np.prod(alphas[:survived]))
            if survived < k:
                p *= 1.0 - alphas[survived]
            expected += p * (survived + 1)
        rates.append(expected / (curve[k] + k * draft_cost))
    return rates


def verified(cost, k_max=K_MAX, fixed_k=None, *, decay=0.95, prior_acceptance=0.6, **kwargs):
    """A controller whose estimate learns from verification only, as a draft model's does."""
    estimate = VerifiedAcceptance(k_max, decay=decay, prior_acceptance=prior_acceptance)
    return DraftLengthController(cost, k_max, fixed_k, estimate=estimate, **kwargs)


def hindsight(cost, k_max=K_MAX, *, decay=0.9, caution=1.0):
    """A controller whose estimate learns in hindsight, as an n-gram drafter's does."""
    estimate = HindsightAcceptance(k_max, decay=decay, caution=caution)
    return DraftLengthController(cost, k_max, estimate=estimate)


def choose(ctl, signal=0):
    """One step's k (watched first, as the engine does), and whether it was a probe (a draft chosen where
    the estimates say k = 0)."""
    ctl.watch([], signal, lambda: [])
    planned = ctl.best(signal)[0]
    k = ctl.choose(signal)
    return k, k > 0 and planned == 0


def run(ctl, outcome, steps, signal=0):
    """Drive the controller for `steps` steps; returns chosen ks, probe flags, tokens, seconds."""
    ks, probes, tokens, seconds = [], [], 0, 0.0
    for _ in range(steps):
        k, probe = choose(ctl, signal)
        accepted = outcome(k)
        ctl.update(k, accepted, signal)
        ks.append(k)
        probes.append(probe)
        tokens += accepted + 1
        seconds += ctl.cost.target(k + 1) + ctl.cost.draft(k)
    return ks, probes, tokens, seconds


def always_wrong(k):
    return 0


def always_right(k):
    return k


# -- CostModel -------------------------------------------------------------------------------


def test_cost_model_reads_measured_widths_and_extrapolates_without_batching_gain():
    cost = CostModel([0.1, 0.15, 0.2], draft_seconds_per_token=0.01)
    assert cost.target(1) == 0.1
    assert cost.target(3) == 0.2
    # Beyond the measured range the dearest measured pass sets the per-token price.
    assert cost.target(6) == pytest.approx(0.2 * 6 / 3)
    assert cost.draft(4) == pytest.approx(0.04)
    assert cost.relative() == pytest.approx((1.0, 1.5, 2.0))


@pytest.mark.parametrize(
    "seconds, draft", [([], 0.0), ([0.1, 0.0], 0.0), ([0.1, float("nan")], 0.0), ([0.1], -1.0)]
)
def test_cost_model_rejects_impossible_timings(seconds, draft):
    with pytest.raises(ValueError):
        CostModel(seconds, draft_seconds_per_token=draft)


def test_cost_model_rejects_empty_pass():
    with pytest.raises(ValueError):
        CostModel([0.1]).target(0)


# -- choosing k against a brute-force optimum -------------------------------------------------


@pytest.mark.parametrize(
    "curve_name, alpha, draft_cost",
    list(itertools.product(CURVES, ACCEPTANCE, [0.0, 0.1])),
)
def test_choice_is_the_brute_force_optimum(curve_name, alpha, draft_cost):
    curve = CURVES[curve_name]
    cost = CostModel(curve, draft_seconds_per_token=draft_cost)
    ctl = verified(cost, K_MAX, prior_acceptance=alpha, decay=1.0)
    rng = np.random.default_rng(7)
    for _ in range(400):
        ctl.update(K_MAX, chain_outcome(rng, alpha, K_MAX))
    ctl.guard = SpeedGuard(cost)  # forget how the forced 15-token drafts fared: this is about the estimates
    alphas = ctl.acceptance()
    assert alphas[0] == pytest.approx(alpha, abs=0.05)

    k = ctl.choose()

    rates = brute_force_rates(curve, draft_cost, alphas, K_MAX)
    assert rates[k] == pytest.approx(max(rates), rel=1e-9)


def test_choice_follows_the_curve_not_a_fixed_rule():
    # Near-perfect acceptance: the CPU curve's cheap 16-token pass makes k=15 best, the GPU's
    # flat curve makes the longest draft best, a linear curve gains nothing over plain decoding.
    def chosen(curve):
        ctl = verified(CostModel(curve), K_MAX, decay=1.0)
        for _ in range(200):
            ctl.update(K_MAX, K_MAX)
        return ctl.choose()

    assert chosen(CURVES["cpu"]) == 15
    assert chosen(CURVES["gpu"]) == 15
    assert chosen(CURVES["linear"]) == 0


def test_untrained_drafter_starts_from_the_prior():
    ctl = verified(CostModel(CURVES["cpu"]), K_MAX, prior_acceptance=0.6)
    alphas = ctl.acceptance()
    assert alphas[0] == pytest.approx(0.6)
    assert np.all(np.diff(alphas) <= 0)  # unseen positions are never assumed better
    # At 0.6 a 2-token pass (1.5x) pays only for one drafted token.
    assert ctl.choose() == 1


# -- back-off and recovery ------------------------------------------------------------------


@pytest.mark.parametrize("curve_name, draft_cost", [("cpu", 0.0), ("cpu", 0.2), ("gpu", 0.15)])
def test_always_wrong_drafter_settles_at_k0_and_stays_near_baseline(curve_name, draft_cost):
    ctl = verified(CostModel(CURVES[curve_name], draft_cost), K_MAX)
    ks, probes, tokens, seconds = run(ctl, always_wrong, 2000)

    settled = next(i for i in range(len(ks)) if all(k == 0 or p for k, p in zip(ks[i:], probes[i:])))
    assert settled <= 5
    baseline_seconds = tokens * ctl.cost.target(1)
    assert seconds <= 1.03 * baseline_seconds
    assert sum(k == 0 or p for k, p in zip(ks, probes)) >= 2000 - settled
    assert 0 < sum(probes) < 0.1 * 2000


def test_recovers_through_probes_when_the_drafter_turns_right():
    ctl = verified(CostModel(CURVES["cpu"]), K_MAX)
    run(ctl, always_wrong, 500)
    ks, probes, _, _ = run(ctl, always_right, 300)

    first_chosen = next(i for i, (k, p) in enumerate(zip(ks, probes)) if k > 0 and not p)
    assert first_chosen < 80
    assert any(probes[:first_chosen])
    assert not any(probes[first_chosen:])
    assert min(ks[-50:]) >= 4


def test_probe_schedule_is_deterministic():
    def trace():
        ctl = verified(CostModel(CURVES["cpu"]), K_MAX)
        return run(ctl, always_wrong, 300)[1]

    assert trace() == trace()


# Qwen2.5-Coder-1.5B's measured curve on a 2-core EPYC, with heads at 4% of a step per drafted token:
# a 1-token head draft pays only above 82% acceptance, a rejected one loses 0.82 of a plain step.
QWEN_HEADS = CostModel([1.0, 1.781, 2.463, 2.948], 0.04)
PROBE_CASES = [(QWEN_HEADS, 3), (CostModel(CURVES["cpu"], 0.2), K_MAX), (CostModel(CURVES["gpu"], 0.15), K_MAX)]


def bernoulli(alpha, seed=0):
    rng = np.random.default_rng(seed)
    return lambda k: chain_outcome(rng, alpha, k)


def probe_loss(ctl, ks, probes, outcomes):
    """What the probes lost against plain decoding, in plain steps: C(k) / T(1) less the tokens each gave."""
    plain = ctl.cost.target(1)
    return sum((ctl.cost.target(k + 1) + ctl.cost.draft(k)) / plain - (accepted + 1)
               for k, probe, accepted in zip(ks, probes, outcomes) if probe)


def run_recording(ctl, outcome, steps):
    """run(), also returning what each step's draft had accepted."""
    outcomes = []
    ks, probes, _, _ = run(ctl, lambda k: outcomes.append(outcome(k)) or outcomes[-1], steps)
    return ks, probes, outcomes


@pytest.mark.parametrize("cost, k_max", PROBE_CASES)
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.45, 0.7])
def test_probes_lose_at_most_their_budget_whatever_the_acceptance(cost, k_max, alpha):
    ctl = verified(cost, k_max, prior_acceptance=0.0)
    steps = 4000
    ks, probes, outcomes = run_recording(ctl, bernoulli(alpha), steps)
    worst = (cost.target(2) + cost.draft(1)) / cost.target(1) - 1.0  # one probe, all rejected
    assert probe_loss(ctl, ks, probes, outcomes) <= ctl.probe_budget * steps + 1e-9
    if alpha == 0.0:  # and it is spent: a drafter always wrong is probed as often as the budget allows
        assert probe_loss(ctl, ks, probes, outcomes) >= ctl.probe_budget * steps - 2 * worst


def test_probes_are_charged_what_they_cost_now_not_what_the_curve_says():
    # Wide passes 1.4x dearer against plain ones than the curve says: a probe rejected in full loses
    # 1.49 plain steps, not the curve's 0.78. Charged at the curve's price it would lose twice its budget.
    ctl = verified(QWEN_HEADS, 3, prior_acceptance=0.0)
    steps, lost = 4000, 0.0
    for _ in range(steps):
        k, probe = choose(ctl, 0)
        seconds = QWEN_HEADS.target(k + 1) * (1.4 if k > 0 else 1.0)
        ctl.update(k, 0, 0, seconds=seconds)
        if probe:
            lost += seconds / QWEN_HEADS.target(1) - 1.0
    assert lost <= ctl.probe_budget * steps * 1.05
    assert lost >= ctl.probe_budget * steps * 0.8, "and the budget is still spent"


def test_probes_that_are_often_accepted_do_not_chain_past_the_budget():
    # Heads right 45% of the time on this CPU: about half the 1-token probes are kept, and a kept probe
    # gains 0.18 of a step where a rejected one loses 0.82. Probes run as often as their real loss allows.
    ctl = verified(QWEN_HEADS, 3, prior_acceptance=0.37)
    _, probes, _ = run_recording(ctl, bernoulli(0.45, seed=3), 1000)
    assert 4 <= sum(probes) <= 1000 * ctl.probe_budget / (0.55 * 0.82 - 0.45 * 0.18) * 1.6


@pytest.mark.parametrize("cost, k_max, alpha", [(QWEN_HEADS, 3, 0.95), (CostModel(CURVES["cpu"], 0.2), K_MAX, 0.95),
                                                (CostModel(CURVES["gpu"], 0.15), K_MAX, 0.5)])
def test_a_drafter_that_starts_to_pay_is_found_through_probes(cost, k_max, alpha):
    ctl = verified(cost, k_max, prior_acceptance=0.0)
    run(ctl, always_wrong, 1000)
    ks, probes, _ = run_recording(ctl, bernoulli(alpha, seed=1), 400)
    first_chosen = next(i for i, (k, p) in enumerate(zip(ks, probes)) if k > 0 and not p)
    worst = (cost.target(2) + cost.draft(1)) / cost.target(1) - 1.0
    # a few probes' worth of budget: the estimate climbs through a run of probes that pay for each other
    assert first_chosen <= 3 * worst / ctl.probe_budget + 30
    assert sum(k > 0 for k in ks[first_chosen:]) >= 0.9 * (400 - first_chosen)


# -- separation of estimates ---------------------------------------------------------------


def test_drafters_keep_separate_estimates():
    # the engine keeps one controller per drafter
    ngram, draft = (verified(CostModel(CURVES["cpu"]), K_MAX) for _ in range(2))
    run(ngram, always_wrong, 50)
    run(draft, always_right, 50)
    assert ngram.acceptance()[0] < 0.1
    assert draft.acceptance()[0] > 0.9
    k, probe = choose(ngram)
    assert k == 0 or probe
    assert draft.choose() >= 2  # more than a probe drafts


def test_signal_classes_keep_separate_estimates():
    ctl = verified(CostModel(CURVES["cpu"]), K_MAX)
    for _ in range(100):
        run(ctl, always_wrong, 1, signal=1)
        run(ctl, always_right, 1, signal=3)
    k, probe = choose(ctl, signal=1)
    assert k == 0 or probe
    assert ctl.choose(signal=3) >= 2


def test_estimates_decay_towards_recent_outcomes():
    ctl = verified(CostModel(CURVES["cpu"]), K_MAX, decay=0.9)
    for _ in range(100):
        ctl.update(4, 4)
    for _ in range(30):
        ctl.update(4, 0)
    assert ctl.acceptance()[0] < 0.1


# -- caps, fixed k, validation --------------------------------------------------------------


def test_available_caps_k():
    ctl = verified(CostModel(CURVES["gpu"]), K_MAX)
    for _ in range(50):
        ctl.update(K_MAX, K_MAX)
    assert ctl.choose(available=3) == 3
    assert ctl.choose(available=0) == 0
    assert ctl.choose(available=-2) == 0


def test_fixed_k_ignores_estimates():
    ctl = verified(CostModel(CURVES["cpu"]), 8, fixed_k=4)
    ks, _, _, _ = run(ctl, always_wrong, 20)
    assert ks == [4] * 20
    assert ctl.choose(available=2) == 2
    assert ctl.stop_thresholds() == (0.0, 0.0)


def test_fixed_k_zero_never_drafts():
    ctl = verified(CostModel(CURVES["gpu"]), 8, fixed_k=0)
    ks, _, _, _ = run(ctl, always_right, 10)
    assert ks == [0] * 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k_max": 0},
        {"k_max": 4, "fixed_k": 5},
        {"k_max": 4, "p_min": 1.5},
        {"k_max": 4, "decay": 0.0},
        {"k_max": 4, "prior_acceptance": 1.5},
        {"k_max": 4, "probe_budget": 0.0},
        {"k_max": 4, "probe_k": 5},
    ],
)
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        verified(CostModel(CURVES["cpu"]), **kwargs)


@pytest.mark.parametrize("proposed, accepted", [(2, 3), (2, -1), (-1, -1)])
def test_update_rejects_impossible_outcomes(proposed, accepted):
    ctl = verified(CostModel(CURVES["cpu"]), 4)
    with pytest.raises(ValueError):
        ctl.update(proposed, accepted)


# -- p_min -------------------------------------------------------------------------------


def test_tuned_p_min_is_the_break_even_of_the_first_token():
    curve = CURVES["cpu"]
    ctl = verified(CostModel(curve), K_MAX, prior_acceptance=0.8, decay=1.0)
    for _ in range(20):
        ctl.update(1, 1)
        ctl.update(1, 1)
        ctl.update(1, 1)
        ctl.update(1, 0)
    assert ctl.choose() == 1
    alpha = ctl.acceptance()[0]
    best_rate = (1 + alpha) / curve[1]
    # Drafting the token costs T(2) - T(1) and returns q tokens: worth it above this q.
    assert ctl.stop_thresholds()[0] == pytest.approx(best_rate * (curve[1] - curve[0]))
    assert len(ctl.stop_thresholds()) == 1  # never past the chosen k


@pytest.mark.parametrize("curve_name", ["cpu", "gpu"])  # on the linear curve k is always 0
@pytest.mark.parametrize("draft_cost", [0.0, 0.1])
def test_tuned_p_min_never_exceeds_the_estimated_acceptance(curve_name, draft_cost):
    ctl = verified(CostModel(CURVES[curve_name], draft_cost), K_MAX)
    rng = np.random.default_rng(3)
    for _ in range(300):
        ctl.update(K_MAX, chain_outcome(rng, 0.9, K_MAX))
    ctl.guard = SpeedGuard(ctl.cost)  # forget how the forced 15-token drafts fared: this is about the estimates
    k = ctl.choose()
    alphas = ctl.acceptance()
    assert k > 0
    for position in range(1, k + 1):
        assert 0.0 <= ctl.stop_thresholds()[position - 1] <= alphas[position - 1] + 1e-12


def test_fixed_p_min_replaces_the_tuned_value_but_not_for_probes():
    ctl = verified(CostModel(CURVES["cpu"]), K_MAX, p_min=0.75)
    assert ctl.choose() == 1
    assert ctl.stop_thresholds() == (0.75,)
    ctl.update(1, 0)
    for _ in range(200):
        k, probe = choose(ctl)
        if probe:
            break
        assert k == 0
        ctl.update(0, 0)
    assert k == 1
    assert ctl.stop_thresholds() == (0.0,)


# -- learning in hindsight (n-gram drafters) ---------------------------------------------------


def hindsight_run(ctl, text, guess, start=1):
    """Decode `text` through a controller as the engine does; guess(context) is the drafter's full proposal.

    Verification at T = 0 keeps the drafts that match the text. Returns the chosen ks."""
    context, ks = list(text[:start]), []
    while len(context) < len(text):
        proposal = guess(context)
        signal = 8 if proposal else 0
        ctl.watch(context, signal, lambda: proposal)
        k = ctl.choose(signal, len(text) - len(context) - 1)
        truth = text[len(context) : len(context) + k + 1]
        accepted = 0
        while accepted < min(k, len(proposal)) and proposal[accepted] == truth[accepted]:
            accepted += 1
        ctl.update(k, accepted, signal)
        context.extend(truth[: accepted + 1])
        ks.append(k)
    return ks


def test_a_copys_token_counts_at_most_a_few_times_however_many_steps_foresaw_it():
    # one-token steps through a long copy, each foreseeing the whole copy ahead at the copy's length so far
    # (as the n-gram drafter signals it): every token is foreseen by K_MAX steps, all in one copy class
    text = list(range(1000, 1200))
    estimate, context = HindsightAcceptance(K_MAX, decay=1.0), text[:20]
    while len(context) < 150:
        signal = ngram_signal("prompt", len(context))
        estimate.watch(context, signal, lambda: text[len(context): len(context) + K_MAX])
        context.append(text[len(context)])
    counted = sum(tries[0] for _, tries in estimate.export().values())
    scored = len(context) - 21  # the positions after the first step's, each foreseen by min(K_MAX, steps) proposals
    assert scored <= counted <= MAX_COUNTS_PER_POSITION * scored < K_MAX * scored


def follow_a_repeat(source: str, copy_of) -> HindsightAcceptance:
    """A text that repeats its first 30 tokens, followed step by step through 20 tokens of the repeat, each step
    foreseeing the rest of it (all kept) with the copy the drafter would hint: copy_of(context length)."""
    sentence = list(range(1000, 1030))
    text = sentence + sentence
    estimate, context = HindsightAcceptance(K_MAX, decay=1.0), text[:32]
    while len(context) < 50:
        estimate.watch(context, ngram_signal(source, len(context) - 30),
                       lambda: text[len(context): len(context) + K_MAX], copy_of(len(context)))
        context.append(text[len(context)])
    return estimate


def test_a_copy_of_the_texts_own_writing_is_evidence_of_one_copy_however_many_tokens_it_ran():
    # One repeat of the reply's own sentence is one copy.  Counted token by token it made copies of 8-24
    # tokens look sure, and the next copy of the reply's phrasing was drafted 15 deep (stop 84).
    eight = ngram_signal("context", 8)
    one_copy = follow_a_repeat("context", lambda length: 30)  # the source stands 30 back at every step
    not_told_apart = follow_a_repeat("context", lambda length: None)
    assert np.allclose(one_copy.mean(eight), not_told_apart.mean(eight))  # the same tokens, the same mean
    assert (one_copy.planning(eight) < not_told_apart.planning(eight)).all()  # but less evidence: more caution
    # which compounds with the depth: a 15-token draft reaches its end on this one copy's word far less often
    assert np.prod(one_copy.planning(eight)) < 0.9 * np.prod(not_told_apart.planning(eight))
    copies_apart = follow_a_repeat("context", lambda length: length)  # a new copy at every step
    assert np.allclose(copies_apart.planning(eight), not_told_apart.planning(eight))

    # a quote of the prompt lends its certainty to longer copies (LENDING_SOURCES): its tokens count
    eight = ngram_signal("prompt", 8)
    quoted_once = follow_a_repeat("prompt", lambda length: 30)
    assert np.allclose(quoted_once.planning(eight), follow_a_repeat("prompt", lambda length: None).planning(eight))


def test_learned_counts_of_the_texts_own_copies_are_evidence_in_full():
    first = COPY_BUCKETS.index(1)  # no class lends to the shortest copies, whatever the source
    context, prompt = SOURCES.index("context"), SOURCES.index("prompt")
    learned = {context * len(COPY_BUCKETS) + first: ([18.0], [20.0]), prompt * len(COPY_BUCKETS) + first: ([18.0], [20.0])}
    estimate = HindsightAcceptance(K_MAX, learned=learned)
    assert estimate.planning(ngram_signal("context", 1))[0] == pytest.approx(estimate.planning(ngram_signal("prompt", 1))[0])


def test_hindsight_learns_from_steps_that_drafted_nothing():
    # The first guesses are wrong, then the drafter starts copying perfectly.  A controller that
    # only learns from what it drafts has backed off to k = 0 and waits for probes; one that
    # checks every step's proposal against the text sees the change within a few steps.
    text = list(range(400))
    guess = lambda context: [0] * 15 if len(context) < 60 else text[len(context) : len(context) + 15]
    ctl = hindsight(CostModel(CURVES["cpu"]), K_MAX, decay=0.9)
    ks = hindsight_run(ctl, text, guess)
    assert sum(ks[:59]) <= 1  # a wrong guess is drafted at most once, on the prior, and nothing probes
    assert max(ks[59:130]) >= 4  # the copy is drafted, longer as evidence at its lengths comes in
    first = next(i for i, k in enumerate(ks) if i >= 59 and k)

    ctl = verified(CostModel(CURVES["cpu"]), K_MAX, decay=0.9)  # learns from verification only
    ks = hindsight_run(ctl, text, guess)
    assert next(i for i, k in enumerate(ks) if i >= 59 and all(ks[i:i + 3])) > first


def test_hindsight_counts_each_position_once_and_stops_at_the_first_miss():
    estimate = HindsightAcceptance(4, decay=1.0)
    context = [1, 2, 3]
    estimate.watch(context, 8, lambda: [4, 5, 9, 7])
    context += [4]
    estimate.settle(context)
    context += [5, 6, 7]  # 6 where 9 was guessed: position 3 missed, position 4 never reached
    estimate.settle(context)
    estimate.settle(context)  # settling again changes nothing
    # a copy of 8 matched tokens: depths 0-3 continue copies of 8-11 tokens, one class
    assert estimate.export() == {COPY_BUCKETS.index(8): ([2.0], [3.0])}
    assert estimate.export() == {}  # an export hands out what was seen since the last one


def test_a_pair_record_leans_each_depth_on_how_its_pair_fared():
    record = PairRecord()
    record.observe((1, 2), True)
    record.observe((1, 2), False)
    rates, evidence = np.array([0.9, 0.9]), np.array([3.0, 3.0])
    record.refine([(1, 2), (3, 4)], rates, evidence)
    assert rates[0] == pytest.approx((1 + PAIR_WEIGHT * 0.9) / (2 + PAIR_WEIGHT))
    assert evidence[0] == pytest.approx(2 + min(3.0, PAIR_WEIGHT))
    assert (rates[1], evidence[1]) == (0.9, 3.0)  # a pair never drafted: the copy-length estimate alone


def test_hindsight_counts_a_pair_once_per_position_and_only_inside_copies():
    long, short = ngram_signal("context", 8), ngram_signal("context", 1)
    estimate = HindsightAcceptance(4, decay=1.0)
    context = [1, 2, 3]
    estimate.watch(context, long, lambda: [4, 5, 6, 9])
    context.append(4)
    estimate.watch(context, long, lambda: [5, 6, 7, 8])  # foresees (4, 5) at the same position again
    context += [5, 6, 7]
    estimate.watch(context, long, lambda: [4, 5, 6, 9])  # settles both, then plans (7, 4) (4, 5) (5, 6) (6, 9)
    refined = estimate.mean(long)
    plain = estimate.mean(ngram_signal("context", 9))  # the same copy classes at depths 0-2, no proposal
    assert refined[0] == pytest.approx(plain[0])  # (7, 4) was never drafted
    assert refined[1] == pytest.approx((1 + PAIR_WEIGHT * plain[1]) / (1 + PAIR_WEIGHT))  # kept once, not twice
    assert refined[3] == pytest.approx(PAIR_WEIGHT * plain[2] / (1 + PAIR_WEIGHT))  # (6, 9) was rejected

    estimate = HindsightAcceptance(4, decay=1.0)
    context = [1, 2, 3]
    estimate.watch(context, short, lambda: [4, 5, 9])  # a 1-token match: copies of 1-3 tokens teach no pairs
    context += [4, 5, 6]
    estimate.watch(context, long, lambda: [4, 5, 9])
    assert np.allclose(estimate.mean(long)[:3], estimate.mean(ngram_signal("context", 9))[:3])


def test_hindsight_forgets_proposals_made_on_another_text():
    estimate = HindsightAcceptance(4, decay=1.0)
    estimate.watch([1, 2], 8, lambda: [3, 4])
    estimate.settle([1, 2, 9, 9])  # a new list: a new generation, not the continuation of [1, 2]
    assert estimate.export() == {}


def test_a_verified_learner_learns_nothing_from_watching():
    estimate = VerifiedAcceptance(4, decay=1.0)
    before = estimate.mean(8)
    estimate.watch([1, 2], 8, lambda: pytest.fail("a verified learner never asks for the proposal"))
    assert np.array_equal(estimate.mean(8), before)


def test_an_unseen_signal_leans_on_the_pooled_estimate_until_it_has_data():
    ctl = verified(CostModel(CURVES["cpu"]), 4, decay=1.0, prior_acceptance=0.5)
    for _ in range(50):
        ctl.update(4, 4, signal=2)  # always right
    assert ctl.acceptance(5)[0] > 0.9  # never seen: as the pooled estimate
    for _ in range(50):
        ctl.update(4, 0, signal=5)
    assert ctl.acceptance(5)[0] < 0.05  # once seen, its own data wins
    assert ctl.acceptance(2)[0] > 0.95


def test_a_drafter_that_could_not_pay_at_high_acceptance_is_never_probed():
    # A draft model whose token costs 43% of a target step on this CPU's curve, cheap 16-token pass
    # included: even 90% acceptance loses to plain decoding, so probing it only costs time.
    curve = [1.0, 1.62, 2.12, 2.53, 3.11, 3.68, 5.17, 6.66, 6.99, 7.31, 7.63, 7.96, 7.95, 7.94, 7.93, 7.92]
    dear = verified(CostModel(curve, 0.43), 15)
    cheap = verified(CostModel(curve, 0.05), 15)
    dear_ks, _, _, _ = run(dear, always_wrong, 300)
    cheap_ks, _, _, _ = run(cheap, always_wrong, 300)
    assert sum(dear_ks) == 0
    assert sum(cheap_ks) > 0
    # what the decoder asks before feeding a draft model the prompt (Decoder._prefill)
    assert not dear.may_draft and cheap.may_draft
    assert DraftLengthController(CostModel(curve, 0.43), 15, fixed_k=2).may_draft
    assert not DraftLengthController(CostModel(curve, 0.05), 15, fixed_k=0).may_draft


def test_steps_without_a_proposal_leave_the_estimates_alone():
    # A long reply with no n-gram match used to decay the counts every step, until after some
    # 7000 steps they underflowed to 0/0 and the controller stopped drafting for good.
    ctl = hindsight(CostModel(CURVES["cpu"]), K_MAX, decay=0.9)
    before = ctl.acceptance(8)
    context = [1, 2, 3]
    for _ in range(8000):
        ctl.watch(context, 0, list)
    assert np.array_equal(ctl.acceptance(8), before)


# -- n-gram drafting at issue 27's cost curve: never slower, and what copies win is kept ----------------

# T(n) / T(1) of Qwen2.5-Coder-1.5B on a 2-core AVX-512 EPYC, widths between the measured ones interpolated.
EPYC = CostModel([1.0, 1.58, 2.23, 2.67, 3.1325, 3.565, 3.9975, 4.4, 4.5, 4.6, 4.7, 4.8, 4.9, 5.0, 5.1, 5.2])


def replay(prompt, reply, controller=None, rejected=None):
    """Decode `reply` after `prompt` with the real n-gram drafter and controller, as the engine drives them,
    each draft kept up to its first token that differs from the reply (T = 0).  Returns the predicted
    speedup over plain decoding on the EPYC curve, and the draft length of each step; `rejected` (a list)
    gets the reply position of each draft's first rejected token."""
    controller = controller or controller_for("ngram", EPYC, K_MAX)
    drafter, context, position, seconds, ks = NgramDrafter(), list(prompt), 0, 0.0, []
    while position < len(reply):
        hint = drafter.peek(context)
        cap = min(K_MAX, len(reply) - position - 1) if hint.available is None else 0
        controller.watch(context, hint.signal, lambda: drafter.propose(context, K_MAX).tokens if hint.available != 0 else [])
        k = controller.choose(hint.signal, cap) if cap > 0 else 0
        tokens = drafter.propose(context, k).tokens if k else []
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == reply[position + accepted]:
            accepted += 1
        if cap > 0:
            controller.update(len(tokens), accepted, hint.signal)
        if rejected is not None and accepted < len(tokens):
            rejected.append(position + accepted)
        context += reply[position: position + accepted + 1]
        position += accepted + 1
        seconds += EPYC.target(len(tokens) + 1)
        ks.append(k)
    return len(reply) * EPYC.target(1) / seconds, ks


def json_records(rng, count):
    """Records whose keys repeat and whose values never do: long matches keep predicting the previous record."""
    keys = [[501, 502, 503], [504, 505], [506, 507, 508, 509]]
    tokens = []
    for _ in range(count):
        tokens.append(600)
        for key in keys:
            tokens += key + [510] + list(rng.integers(1000, 5000, size=4)) + [511]
        tokens.append(601)
    return [int(t) for t in tokens]


def test_before_any_evidence_only_a_long_copy_earns_a_wide_pass():
    controller = controller_for("ngram", EPYC, K_MAX)
    for source in SOURCES:
        for length in range(0, 32):  # a match as long as llama.cpp's 12-token key earns one token at most
            assert controller.choose(ngram_signal(source, length), K_MAX) <= 1
        assert controller.choose(ngram_signal(source, 64), K_MAX) >= 8  # 64 tokens copied so far


def test_a_rejected_long_draft_costs_its_signal_at_once():
    rng = np.random.default_rng(5)
    block = [int(t) for t in rng.integers(1000, 5000, size=200)]
    controller = controller_for("ngram", EPYC, K_MAX)
    _, ks = replay(block, block[:120], controller)  # a copy: long drafts earned
    assert max(ks) == K_MAX
    context = block + block[:120]  # a new text, as the same copy goes on
    drafter = NgramDrafter()
    signal = drafter.peek(context).signal
    for _ in range(3):  # the copy goes on, drafting K_MAX tokens a step
        controller.watch(context, signal, lambda: drafter.propose(context, K_MAX).tokens)
        assert controller.choose(signal, K_MAX) == K_MAX
        context.extend(block[len(context) - 200: len(context) - 200 + K_MAX + 1])
        controller.update(K_MAX, K_MAX, signal)
    controller.watch(context, signal, lambda: drafter.propose(context, K_MAX).tokens)
    assert controller.choose(signal, K_MAX) == K_MAX
    missed = HindsightAcceptance(K_MAX)._classes(signal)[1]  # the class of the draft's second token
    before = controller.estimate.export()
    context.extend([block[len(context) - 200], 7])  # the copy ends at the second drafted token
    controller.update(K_MAX, 1, signal)
    controller.watch(context, signal, list)  # the next step scores the rejected draft, before it chooses
    after = controller.estimate.export()
    assert after[missed][1][0] - after[missed][0][0] == 1.0  # one miss for the class, counted at once
    assert missed not in before or before[missed][0] == before[missed][1]  # none before it


def test_copies_that_always_break_at_one_length_are_drafted_up_to_it():
    # a 12-token phrase that comes back again and again, each time followed by new tokens: a copy
    # in progress is right until the phrase ends, so drafts run up to its end and no further
    rng = np.random.default_rng(8)
    phrase = [int(t) for t in rng.integers(1000, 5000, size=12)]
    text = []
    for _ in range(30):
        text += phrase + [int(t) for t in rng.integers(5000, 9000, size=6)]
    rejected = []
    speedup, ks = replay([1, 2, 3] + text[:18], text[18:], rejected=rejected)
    assert speedup >= 1.4
    assert max(ks[10:]) >= 11  # the phrase's copies are drafted whole
    # and never past its end, where every copy so far broke (the reply starts right after a phrase, so
    # the phrase ends at positions 12, 30, ...; the few rejections left are chance matches of new tokens)
    assert [p for p in rejected if p % 18 == 12] == []


def test_a_renamed_name_stops_the_drafts_right_before_it():
    # the reply copies the prompt with one name renamed wherever it occurs (after a `self.`-like token,
    # at irregular gaps, so no copy length predicts the spot): once the rename has been seen, the drafts
    # stop before each later occurrence instead of paying for a rejected tail at each
    for seed in range(4):
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(1000, 5000, size=300)]
        spots = [int(s) for s in np.cumsum(rng.integers(6, 30, size=40)) if s < 300]
        for spot in spots:
            prompt[spot - 1], prompt[spot] = 6, 7
        reply = [8 if t == 7 else t for t in prompt]
        rejected = []
        speedup, _ = replay(prompt, reply, rejected=rejected)
        assert len([p for p in rejected if p in spots]) <= 2 < len(spots)
        assert speedup >= 1.4


def test_text_with_nothing_to_copy_is_never_slower_than_plain_decoding():
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, 300, size=80)]
    for seed in range(5):
        reply = [int(t) for t in np.random.default_rng(seed).integers(0, 300, size=200)]  # 1-2 token matches, all wrong
        speedup, _ = replay(prompt, reply)
        assert speedup >= 0.99


def test_repeating_keys_with_new_values_are_never_slower_than_plain_decoding():
    for seed in range(5):
        speedup, ks = replay([1, 2, 3], json_records(np.random.default_rng(seed), 12)[:200])
        assert speedup >= 0.98
        assert max(ks) < K_MAX  # the previous record's values are never worth a 16-row pass


def test_a_copy_keeps_its_gain():
    rng = np.random.default_rng(3)
    source = [int(t) for t in rng.integers(1000, 5000, size=300)]
    edited = source[:100] + [7, 8, 9] + source[100:200]  # a copy with one edit
    speedup, _ = replay([1] + source, edited)
    assert speedup >= 2.0


def copy_class(source, length):
    """The hindsight learner's class of copies from `source` that have gone on for `length` tokens."""
    return SOURCES.index(source) * len(COPY_BUCKETS) + COPY_BUCKETS.index(length)


def test_a_long_copy_of_the_prompt_starts_from_what_its_shorter_copies_showed():
    kept = {copy_class(source, length): ([8.0], [8.0]) for source in SOURCES for length in (4, 6, 8)}
    shown, unseen = HindsightAcceptance(K_MAX, learned=kept), HindsightAcceptance(K_MAX)
    guess = 16 / 18  # a copy of 16 tokens before any evidence (COPY_PRIOR_SHIFT 2)
    for source in SOURCES:
        long_copy = ngram_signal(source, 16)
        assert unseen.mean(long_copy)[0] == pytest.approx(guess)
        if source in LENDING_SOURCES:  # a document copied: what its copies of 4-11 tokens did is lent
            assert shown.mean(long_copy)[0] > guess
            assert shown.planning(long_copy)[0] > unseen.planning(long_copy)[0]
        else:  # the text's own records and repeats break at one spot however long they ran
            assert shown.mean(long_copy)[0] == pytest.approx(guess)


def test_only_copies_of_a_few_tokens_lend_and_a_class_s_own_misses_outweigh_the_loan():
    short = {copy_class("prompt", length): ([8.0], [8.0]) for length in COPY_BUCKETS if length < LENDING_COPY}
    assert HindsightAcceptance(K_MAX, learned=short).mean(ngram_signal("prompt", 16))[0] == pytest.approx(16 / 18)
    missed = {copy_class("prompt", 4): ([8.0], [8.0]), copy_class("prompt", 16): ([0.0], [8.0])}
    assert HindsightAcceptance(K_MAX, learned=missed).mean(ngram_signal("prompt", 16))[0] < 0.5


def test_a_whole_copy_of_the_prompt_is_drafted_wide_once_its_first_tokens_are_kept():
    rng = np.random.default_rng(5)
    block = [int(t) for t in rng.integers(1000, 5000, size=200)]
    _, ks = replay(block, block[:120])
    positions = list(itertools.accumulate((k + 1 for k in ks), initial=0))
    # before lending, each longer copy class started from its guess, and full width came at token 43
    assert min(p for p, k in zip(positions, ks) if k == K_MAX) <= 16


# -- the speed guard ---------------------------------------------------------------------------


def trained_on_copies(cost=EPYC):
    """A controller whose estimates say that every draft is kept: it drafts K_MAX tokens."""
    controller = verified(cost, K_MAX, decay=1.0)
    for _ in range(200):
        controller.update(K_MAX, K_MAX)
    controller.guard = SpeedGuard(cost)
    return controller


def test_the_speed_guard_backs_off_while_drafted_steps_lose_and_recovers():
    controller = verified(EPYC, K_MAX, decay=1.0, prior_acceptance=0.8)
    rng = np.random.default_rng(2)
    for _ in range(400):  # estimates of 0.8 per position, on much evidence
        controller.update(K_MAX, chain_outcome(rng, 0.8, K_MAX))
    controller.guard = SpeedGuard(EPYC)
    k = controller.choose()
    assert k > 0
    for _ in range(20):  # the drafts now fail: each drafted pass gives one token for T(k + 1)
        controller.update(0, 0)
        controller.update(k, 0)
    assert controller.guard.gain() < 0.75
    assert controller.choose() == 0  # the estimates, slow to move, still promise a gain; the guard does not
    for _ in range(60):  # plain steps only: the verdict fades with the steps that caused it
        controller.update(0, 0)
    assert controller.choose() == k


def test_a_slower_machine_is_not_drafting_that_loses():
    controller = trained_on_copies()
    for _ in range(30):  # every pass, plain or wide, takes 3x what the curve says
        controller.update(0, 0, seconds=3 * EPYC.target(1))
        controller.update(K_MAX, K_MAX, seconds=3 * EPYC.target(K_MAX + 1))
    assert controller.guard.gain() > 2.0
    assert controller.guard.wide_price() == pytest.approx(1.0, rel=0.1)  # the load is learned, not priced
    assert controller.choose() == K_MAX


def test_wide_passes_dearer_now_than_the_curve_says_stop_the_drafts_only_the_curve_paid_for():
    controller = verified(EPYC, K_MAX, decay=1.0, prior_acceptance=0.65)
    rng = np.random.default_rng(4)
    for _ in range(400):
        controller.update(K_MAX, chain_outcome(rng, 0.65, K_MAX))
    controller.guard = SpeedGuard(EPYC)
    assert controller.choose() == 1, "on the curve a two-token pass is 1.58 plain steps: a 0.65 draft pays"
    for _ in range(10):  # the machine's shape now: plain passes as the curve says, two-token ones 1.87 of them
        controller.update(0, 0, seconds=EPYC.target(1))
        controller.update(1, 1, seconds=1.87 * EPYC.target(1))
    assert controller.guard.gain() > 1.0, "those drafts paid: it is the price that stops the next, not the guard"
    assert controller.guard.wide_price() > 1.1
    assert controller.choose() == 0


def test_each_width_is_priced_from_its_own_passes_where_the_curve_misjudged_one():
    # The AVX2 EPYC's calibration read T(3) 1.82 and T(4) 1.86: a four-token pass looked nearly free
    # after a three-token one, while in generation it cost 2.1-2.7 one-token passes.
    dip = CostModel((1.0, 1.44, 1.82, 1.86, 2.33, 2.8, 3.85, 4.91))
    controller = verified(dip, 7, decay=1.0, prior_acceptance=0.7)
    rng = np.random.default_rng(4)
    for _ in range(400):
        controller.update(7, chain_outcome(rng, 0.7, 7))
    controller.guard = SpeedGuard(dip)
    assert controller.choose() == 3, "on the curve the cheap four-token pass is the best plan"
    for _ in range(10):  # two-token passes cost what the curve says, four-token ones 2.34 plain passes
        controller.update(0, 0, seconds=dip.target(1))
        controller.update(1, 1, seconds=dip.target(2))
        controller.update(3, 3, seconds=2.34 * dip.target(1))
    prices = controller.guard.width_prices(4)
    assert prices[0] == 1.0
    assert prices[1] < 1.05 and prices[3] == pytest.approx(2.34 / 1.86, rel=0.03)
    assert controller.guard.gain() > 1.0, "every draft was kept: the price moves the choice, not the guard"
    assert controller.choose() == 1, "a common factor (1.13 here) would still have drafted three"


def test_a_new_process_plans_on_what_the_last_one_paid_for_each_width(tmp_path):
    # The same dip, across processes: a new process's guard has seen no pass yet, so its first drafts are
    # planned on the calibration's shape unless the cache says what the widths cost in generation here.
    dip = (1.0, 1.44, 1.82, 1.86, 2.33, 2.8, 3.85, 4.91)
    cache = CalibrationCache(tmp_path / "calibration.json")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    key = CalibrationKey.for_model(model, n_gpu_layers=0, n_threads=2)
    cache.store(key, 8, dip)
    watch = StepTimeWatch(cache, key, dip)
    for _ in range(10):  # one generation of the last process, on a machine twice as busy as at calibration
        watch.observe(1, 2 * dip[0])
        watch.observe(2, 2 * dip[1])
        watch.observe(4, 2 * 2.34)
    watch.remember()

    def first_choice(curve):
        controller = verified(CostModel(curve), 7, decay=1.0, prior_acceptance=0.7)
        rng = np.random.default_rng(4)
        for _ in range(400):
            controller.update(7, chain_outcome(rng, 0.7, 7))
        controller.guard = SpeedGuard(controller.cost)  # a new process: no pass seen
        return controller.choose()

    entry = cache.read(key)
    priced = priced_curve(entry.forward_seconds, entry.pass_prices)
    assert priced[1] == pytest.approx(1.44, rel=0.05) and priced[3] > 2.1
    assert first_choice(dip) == 3
    assert first_choice(priced) == 1


def test_a_copy_that_pays_keeps_drafting_at_a_dearer_price():
    controller = trained_on_copies()
    for _ in range(30):
        controller.update(0, 0, seconds=EPYC.target(1))
        controller.update(K_MAX, K_MAX, seconds=1.3 * EPYC.target(K_MAX + 1))
    assert controller.guard.wide_price() == pytest.approx(1.3, rel=0.05)
    assert controller.choose() == K_MAX


def test_with_a_fixed_curve_the_guard_sees_what_the_curve_says():
    controller = trained_on_copies()
    for _ in range(30):
        controller.update(K_MAX, 2)  # 3 tokens for a 16-row pass: 3 / 5.2 of plain decoding's speed
    assert 3 / 5.2 < controller.guard.gain() < 0.7  # its prior of 1.0 fades as drafted steps come
