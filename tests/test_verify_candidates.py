"""Point proposals (n-grams' drafts, heads' candidates) are accepted so that the emitted tokens are distributed
exactly as the target's p, and drawn as plain decoding draws them."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import SparseProbs, sample
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


def test_greedy_rows_accept_the_argmax():
    p = np.eye(V)[4]
    rng = np.random.default_rng(0)
    assert accept_candidates(p, (1, 4, 2), rng) == (1, 4)
    assert accept_candidates(p, (1, 2), rng) == (None, 4)


@pytest.mark.parametrize("seed", range(200))
def test_a_run_that_drafts_emits_what_plain_sampling_draws(seed):
    # one uniform per emitted token, as plain decoding spends: with the same seed and the same rows, the
    # tokens a verification emits are the ones plain decoding would have sampled, whatever was drafted
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 5))
    p = [target_row(seed * 10 + i) for i in range(k + 1)]
    plain_rng = np.random.default_rng(seed)
    plain = [sample(row, plain_rng) for row in p]
    # drafts that follow plain decoding for a while, then part from it
    drafts = [plain[i] if rng.random() < 0.7 else int(rng.integers(V)) for i in range(k)]
    verdict = verify(p, drafts, None, np.random.default_rng(seed))
    emitted = [*drafts[: verdict.n_accepted], verdict.next_token]
    assert emitted == plain[: len(emitted)]
    assert verdict.n_accepted == next((i for i in range(k) if drafts[i] != plain[i]), k)
