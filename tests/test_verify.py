"""The verifier emits tokens distributed exactly as the target's p, whatever the draft's q."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import sample
from edgespec.verify import Verdict, verify

V = 6
TRIALS = 200_000
# chi-square critical value for 5 degrees of freedom at p = 1e-4; the seeds are fixed,
# so the test is deterministic, and a correct verifier sits far below it.
CHI2_CRITICAL_5DOF = 25.7


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def random_rows(rng, n, sparsity=0.3):
    rows = rng.dirichlet(np.full(V, 0.7), size=n)
    rows[rng.random(rows.shape) < sparsity] = 0.0  # zeros make p and q disagree on their support
    rows[np.arange(n), rng.integers(0, V, n)] += 0.05
    return rows / rows.sum(axis=1, keepdims=True)


def emitted_counts(rule, p, q, k, seed):
    """Counts of the first emitted token, and of the second one when a step emits two."""
    rng = np.random.default_rng(seed)
    first, second = np.zeros(V), np.zeros(V)
    for _ in range(TRIALS):
        drafts = [sample(q[i], rng) for i in range(k)] if q is not None else list(rng.integers(0, V, k))
        verdict = rule(p, drafts, q, rng)
        tokens = drafts[: verdict.n_accepted] + [verdict.next_token]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def accept_when_p_at_least_q(p, drafts, q, rng):
    """A plausible but wrong rule: deterministic acceptance, correction sampled from p."""
    for i, x in enumerate(drafts):
        if p[i][x] < (1.0 if q is None else q[i][x]):
            return Verdict(i, sample(p[i], rng))
    return Verdict(len(drafts), sample(p[len(drafts)], rng))


@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_p_with_a_draft_distribution(k):
    rng = np.random.default_rng(k)
    p, q = random_rows(rng, k + 1), random_rows(rng, k)
    first, second = emitted_counts(verify, p, q, k, seed=100 + k)
    assert chi_square(first, p[0]) < CHI2_CRITICAL_5DOF
    assert chi_square(second, p[1]) < CHI2_CRITICAL_5DOF


def test_emitted_tokens_follow_p_with_one_hot_proposals():
    rng = np.random.default_rng(7)
    p = random_rows(rng, 3)
    first, second = emitted_counts(verify, p, None, 2, seed=8)
    assert chi_square(first, p[0]) < CHI2_CRITICAL_5DOF
    assert chi_square(second, p[1]) < CHI2_CRITICAL_5DOF


def test_the_statistical_check_rejects_a_wrong_rule():
    rng = np.random.default_rng(1)
    p, q = random_rows(rng, 2), random_rows(rng, 1)
    first, _ = emitted_counts(accept_when_p_at_least_q, p, q, 1, seed=101)
    assert chi_square(first, p[0]) > 10 * CHI2_CRITICAL_5DOF


def one_hot(index, n=V):
    row = np.zeros(n)
    row[index] = 1.0
    return row


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    rng = np.random.default_rng(0)
    p = np.array([one_hot(2), one_hot(4), one_hot(1), one_hot(5)])
    assert verify(p, [2, 4, 1], None, rng) == Verdict(3, 5)
    assert verify(p, [2, 3, 1], None, rng) == Verdict(1, 4)
    assert verify(p, [0, 4, 1], None, rng) == Verdict(0, 2)
    q = np.array([one_hot(2), one_hot(4), one_hot(0)])
    assert verify(p, [2, 4, 0], q, rng) == Verdict(2, 1)


def test_needs_one_more_target_row_than_drafts():
    with pytest.raises(ValueError):
        verify(np.ones((2, V)) / V, [1, 2], None, np.random.default_rng(0))
