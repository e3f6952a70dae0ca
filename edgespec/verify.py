"""Exact acceptance of drafted tokens by rejection sampling (pure numpy).

For draft position i with proposal x ~ q_i, accept with probability
min(1, p_i(x) / q_i(x)).  On the first rejection emit a token from
norm(max(0, p_i - q_i)); if all k are accepted emit a bonus token from p_k.
Either way exactly one token comes from the target, and the emitted sequence
is distributed exactly as sampling from p alone (Leviathan et al., 2023).

A deterministic proposal (n-gram lookup) has q = one-hot(x): then the rule is
"accept with probability p(x)", and the residual is p with x removed.  At
temperature 0 every p row is one-hot at its argmax, so the same rule reduces
to argmax equality without drawing any random number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .sampling import sample


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
        p_x = p[i][x]
        q_x = 1.0 if q is None else q[i][x]
        if p_x >= q_x or (p_x > 0.0 and rng.random() * q_x < p_x):
            continue
        return Verdict(i, sample(_residual(p[i], x, None if q is None else q[i]), rng))
    return Verdict(k, sample(p[k], rng))


def _residual(p_row: np.ndarray, x: int, q_row: np.ndarray | None) -> np.ndarray:
    if q_row is None:
        residual = p_row.copy()
        residual[x] = 0.0
    else:
        residual = np.maximum(p_row - q_row, 0.0)
    if residual.sum() <= 0.0:
        # only reachable through float round-off when p == q; p itself is then the right law
        return p_row
    return residual
