"""Exact acceptance of drafted tokens by rejection sampling (pure numpy).

For draft position i with proposal x ~ q_i, accept with probability
min(1, p_i(x) / q_i(x)).  On the first rejection emit a token from
norm(max(0, p_i - q_i)); if all k are accepted emit a bonus token from p_k.
Either way exactly one token comes from the target, and the emitted sequence
is distributed exactly as sampling from p alone (Leviathan et al., 2023).

A deterministic proposal (n-gram lookup, heads) has q = one-hot(x): then the
rule is "accept with probability p(x)", and the residual is p with x removed.
accept_candidates extends that to several point proposals for one position
(the recursive rejection of SpecInfer and Medusa's typical trees): try them
in order, accept each with its probability under what remains, else remove
it and renormalise; sample from what is left when none is accepted.  The
emitted token is then distributed exactly as p.  At
temperature 0 every p row is one-hot at its argmax, so the same rule reduces
to argmax equality without drawing any random number.

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
        return Verdict(i, sample(_residual(p[i], x, q[i]), rng))
    return Verdict(k, sample(p[k], rng))


def accept_candidates(p_row, candidates: Sequence[int], rng: np.random.Generator) -> tuple[int | None, int]:
    """Recursive rejection of point proposals for one position: (the index of the accepted candidate, it),
    or (None, a token sampled from p_row with every candidate removed).

    p_row is a normalised probability row.  Candidate i is accepted with
    p(x_i) / (1 - p(x_1) - ... - p(x_{i-1})), its probability once the ones
    before it are removed; at temperature 0 (a one-hot row) that is 1 for the
    argmax and 0 for the rest, so no random number is drawn.
    """
    row, mass = as_sparse(p_row), 1.0
    for i, x in enumerate(candidates):
        p_x = row[x]
        if p_x >= mass or (p_x > 0.0 and rng.random() * mass < p_x):
            return i, x
        row = _residual(row, x, None)
        mass -= p_x
    return None, sample(row, rng)


def _residual(p_row, x: int, q_row) -> SparseProbs:
    """norm(max(0, p - q)) up to its scale (sample normalises); p with x removed for a one-hot q."""
    p_row = as_sparse(p_row)
    if q_row is None:
        keep = p_row.ids != x
        residual = SparseProbs(p_row.ids[keep], p_row.probs[keep], p_row.n_vocab)
    else:
        q_row = as_sparse(q_row)
        ids = np.union1d(p_row.ids, q_row.ids)
        excess = np.maximum(p_row.values_at(ids) - q_row.values_at(ids), 0.0)
        keep = excess > 0.0
        residual = SparseProbs(ids[keep], excess[keep], p_row.n_vocab)
    if residual.ids.size == 0:
        # only reachable through float round-off when p == q; p itself is then the right law
        return p_row
    return residual
