"""Recursive rejection of point proposals (heads' candidates) emits tokens distributed exactly as the target's p."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import SparseProbs
from edgespec.verify import accept_candidates, verify

V = 6
TRIALS = 100_000
CHI2_CRITICAL_5DOF = 25.7  # p = 1e-4; the seeds are fixed, so the test is deterministic


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def target_row(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    row = rng.dirichlet(np.full(V, 0.7))
    row[rng.random(V) < 0.3] = 0.0  # candidates the target never emits must never be accepted
    row[rng.integers(V)] += 0.05
    return row / row.sum()


def emitted(rule, p: np.ndarray, candidates, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(V)
    for _ in range(TRIALS):
        counts[rule(p, candidates, rng)[1]] += 1
    return counts


@pytest.mark.parametrize("candidates, seed", [((2,), 1), ((4, 0), 2), ((1, 3, 5), 3), ((0, 1, 2, 3, 4), 4)])
def test_the_emitted_token_follows_p_whatever_the_candidates(candidates, seed):
    p = target_row(seed)
    assert chi_square(emitted(accept_candidates, p, candidates, seed), p) < CHI2_CRITICAL_5DOF


def test_sparse_rows_give_the_same_law():
    p = target_row(7)
    sparse = SparseProbs.from_dense(p)
    counts = np.zeros(V)
    rng = np.random.default_rng(7)
    for _ in range(TRIALS):
        counts[accept_candidates(sparse, (3, 1), rng)[1]] += 1
    assert chi_square(counts, p) < CHI2_CRITICAL_5DOF


def test_the_statistical_check_rejects_a_rule_that_does_not_renormalise():
    def no_renormalising(p, candidates, rng):
        for i, x in enumerate(candidates):  # accepting later candidates with p(x) alone favours the first ones
            if rng.random() < p[x]:
                return i, x
        rest = p.copy()
        rest[list(candidates)] = 0.0
        return None, int(rng.choice(V, p=rest / rest.sum()))

    p = np.array([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    assert chi_square(emitted(no_renormalising, p, (0, 1, 2), 5), p) > 10 * CHI2_CRITICAL_5DOF


def test_greedy_rows_accept_the_argmax_and_draw_nothing():
    p = np.eye(V)[4]
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert accept_candidates(p, (1, 4, 2), rng) == (1, 4)
    assert rng.bit_generator.state == state
    assert accept_candidates(p, (1, 2), rng) == (None, 4)


def test_a_chain_of_point_proposals_draws_as_before():
    # verify() with one-hot proposals goes through accept_candidates: the same draws as the rule it replaced
    p = [target_row(s) for s in (11, 12, 13)]
    for seed in range(50):
        rng, old_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        verdict = verify(p, [0, 1], None, rng)
        assert verdict == old_rule(p, [0, 1], old_rng)


def old_rule(p, drafts, rng):
    from edgespec.sampling import sample
    from edgespec.verify import Verdict

    for i, x in enumerate(drafts):
        if p[i][x] >= 1.0 or (p[i][x] > 0.0 and rng.random() < p[i][x]):
            continue
        rest = p[i].copy()
        rest[x] = 0.0
        return Verdict(i, sample(SparseProbs.from_dense(rest), rng))
    return Verdict(len(drafts), sample(p[len(drafts)], rng))
