"""Exact acceptance of drafted tokens by rejection sampling (pure numpy).

For draft position i with proposal x ~ q_i, accept with probability
min(1, p_i(x) / q_i(x)).  On the first rejection emit a token from
norm(max(0, p_i - q_i)); if all k are accepted emit a bonus token from p_k.
Either way exactly one token comes from the target, and the emitted sequence
is distributed exactly as sampling from p alone (Leviathan et al., 2023).

A deterministic proposal (n-gram lookup, heads) has q = one-hot(x): then the
rule is "accept with probability p(x)", and the residual is p with x removed.
Both come from one draw: sample y from p as plain decoding samples its token
(sampling.sample, one uniform); y == x is the acceptance, which happens with
probability p(x), and otherwise y is a draw from p with x removed, which is
the residual.  accept_candidates does the same for several point proposals
for one position (Medusa's typical trees; SpecInfer's recursive rejection
has the same law): the candidate equal to y is accepted, and y is the
correction when none is.  Since every emitted token costs exactly one
uniform, as in plain decoding, a run that drafts with n-grams or heads
writes, for a given seed, the tokens plain decoding writes wherever its
verification rows hold the same logits (always under --bit-exact), at any
temperature.  A draft model's q is a real distribution; its acceptance draws
its own uniform, so its runs follow p in law but not plain decoding's text.

Rows are SparseProbs (what to_probs returns) or dense vectors; a residual is
computed over the union of the two rows' supports, so a step costs O(head)
however large the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .sampling import SparseProbs, as_sparse, sample


@dataclass(frozen=True)
class Verdict:
    n_accepted: int
    next_token: int  # the correction on a rejection, else the bonus token


def verify(
    p: Sequence[np.ndarray],
    draft_tokens: Sequence[int],
    q: Sequence[np.ndarray] | None,
    rng: np.random.Generator,
) -> Verdict:
    """p: k+1 target probability rows; q: k draft rows, or None for one-hot proposals.

    Rows may be computed lazily: only p[0..n_accepted] are ever read.
    """
    k = len(draft_tokens)
    if len(p) != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {len(p)}")
    for i, x in enumerate(draft_tokens):
        if q is None:
            accepted, token = accept_candidates(p[i], (x,), rng)
            if accepted is None:
                return Verdict(i, token)
            continue
        p_x, q_x = p[i][x], q[i][x]
        if p_x >= q_x or (p_x > 0.0 and rng.random() * q_x < p_x):
            continue
        return Verdict(i, sample(_residual(p[i], q[i]), rng))
    return Verdict(k, sample(p[k], rng))


def accept_candidates(p_row, candidates: Sequence[int], rng: np.random.Generator) -> tuple[int | None, int]:
    """Point proposals for one position: (the index of the accepted candidate, it), or (None, the
    correction, a token from p_row with every candidate removed).

    One token y is sampled from p_row with one uniform, as plain decoding
    samples; candidate i is accepted when it is y, so with probability
    p(x_i), and otherwise y is the correction, distributed as p_row with the
    candidates removed and renormalised.
    """
    token = sample(p_row, rng)
    for i, x in enumerate(candidates):
        if x == token:
            return i, token
    return None, token


def _residual(p_row, q_row) -> SparseProbs:
    """norm(max(0, p - q)) up to its scale (sample normalises)."""
    p_row, q_row = as_sparse(p_row), as_sparse(q_row)
    ids = np.union1d(p_row.ids, q_row.ids)
    excess = np.maximum(p_row.values_at(ids) - q_row.values_at(ids), 0.0)
    keep = excess > 0.0
    if not keep.any():
        # only reachable through float round-off when p == q; p itself is then the right law
        return p_row
    return SparseProbs(ids[keep], excess[keep], p_row.n_vocab)
