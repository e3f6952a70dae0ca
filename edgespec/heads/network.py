"""The heads' arithmetic, in numpy float32: drafting a few tokens from one hidden state, and training.

Head j (1-based) guesses the token j + 1 places after the position whose
final-normed hidden state h it reads, i.e. the token after the one the
target itself is about to emit.  Each head is a residual block over h, read
out through a frozen slice of the target's own lm_head:

    u_j = A_j h + B_j e(y_{j-1}) + b_j        z_j = h + silu(u_j)        logits_j = P z_j

P holds the lm_head rows of a reduced vocabulary (the tokens the target
predicts most often), so logits_j ranks those tokens only.  e(y) is the
lm_head row of a token: y_0 is the token the target chose after h, y_{j-1}
for j > 1 the token head j - 1 drafted (in training: the text's own token).
With B = 0 this is Medusa's head; seeing the chosen token makes it
Hydra-style, and is the default because it measured at least as good at
every head (benchmarks/heads_forms.py; figures in heads.training).  A, B
and b start at zero, so an untrained head predicts what the lm_head itself
would from h.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

FORMS = ("hydra", "medusa")


def _silu(u: np.ndarray) -> np.ndarray:
    return u / (1.0 + np.exp(-u))


def _silu_slope(u: np.ndarray) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-u))
    return s * (1.0 + u * (1.0 - s))


@dataclass
class Heads:
    """The trainable part of the heads (A, B, b per head), the reduced vocabulary and its frozen projection."""

    form: str
    vocab: np.ndarray  # (V,) int32: reduced index -> token id
    projection: np.ndarray  # (V, d) float32: the lm_head rows of vocab
    a: np.ndarray  # (n_heads, d, d)
    b: np.ndarray  # (n_heads, d, d); zeros and unused for the Medusa form
    bias: np.ndarray  # (n_heads, d)

    @classmethod
    def fresh(cls, form: str, n_heads: int, vocab: np.ndarray, projection: np.ndarray) -> Heads:
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, not {form!r}")
        d = projection.shape[1]
        zeros = np.zeros((n_heads, d, d), dtype=np.float32)
        return cls(form, vocab.astype(np.int32), projection.astype(np.float32), zeros, zeros.copy(),
                   np.zeros((n_heads, d), dtype=np.float32))

    @property
    def n_heads(self) -> int:
        return self.a.shape[0]

    @property
    def sees_token(self) -> bool:
        return self.form == "hydra"

    def pre_activation(self, j: int, hidden: np.ndarray, token_rows: np.ndarray | None) -> np.ndarray:
        """u for head j (0-based) over rows of hidden states, and of the token rows it sees (Hydra)."""
        u = hidden @ self.a[j].T + self.bias[j]
        if self.sees_token:
            u += token_rows @ self.b[j].T
        return u

    def logits(self, j: int, hidden: np.ndarray, token_rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(logits over the reduced vocabulary, u) of head j for rows of hidden states."""
        u = self.pre_activation(j, hidden, token_rows)
        return (hidden + _silu(u)) @ self.projection.T, u

    def draft(self, hidden: np.ndarray, chosen: int, k: int, token_row: Callable[[int], np.ndarray],
              stop_below: Sequence[float] = ()) -> list[int]:
        """Up to k tokens after chosen (the target's own next token after hidden), one per head.

        Stops before head i when its top token's probability over the reduced
        vocabulary is below stop_below[i - 1].
        """
        tokens, previous = [], chosen
        h = hidden.astype(np.float32, copy=False)[None, :]
        for j in range(min(k, self.n_heads)):
            row = token_row(previous)[None, :] if self.sees_token else None
            logits = self.logits(j, h, row)[0][0]  # (logits, u)[0], its only row
            best = int(np.argmax(logits))
            if j < len(stop_below) and stop_below[j] > 0.0:
                if 1.0 / np.exp(logits - logits[best]).sum() < stop_below[j]:
                    break
            previous = int(self.vocab[best])
            tokens.append(previous)
        return tokens

    def arrays(self) -> dict[str, np.ndarray]:
        """What a heads file stores (the projection is not: it is read again from the model)."""
        return {"vocab": self.vocab, "a": self.a, "b": self.b, "bias": self.bias}


@dataclass
class Adam:
    """Adam over the heads' A, B and bias, one head at a time."""

    rate: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    moments: dict[str, np.ndarray] = field(default_factory=dict)

    def start(self, heads: Heads) -> None:
        if len(self.steps) != heads.n_heads:
            self.steps = np.zeros(heads.n_heads, dtype=np.int64)
            self.moments = {f"{kind}{name}": np.zeros_like(getattr(heads, name))
                            for name in ("a", "b", "bias") for kind in ("m_", "v_")}

    def update(self, heads: Heads, j: int, grads: dict[str, np.ndarray]) -> None:
        self.steps[j] += 1
        t = self.steps[j]
        for name, grad in grads.items():
            m, v = self.moments["m_" + name][j], self.moments["v_" + name][j]
            m *= self.beta1
            m += (1 - self.beta1) * grad
            v *= self.beta2
            v += (1 - self.beta2) * grad * grad
            step = self.rate * np.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)
            getattr(heads, name)[j] -= step * m / (np.sqrt(v) + 1e-8)


def train_step(heads: Heads, adam: Adam, j: int, hidden: np.ndarray, token_rows: np.ndarray | None,
               labels: np.ndarray) -> tuple[float, int, int]:
    """One gradient step of head j on a minibatch; labels are reduced indices, -1 where the target's token
    is outside the reduced vocabulary (left out of the loss).  Returns (loss, rows right, rows)."""
    logits, u = heads.logits(j, hidden, token_rows)
    known = labels >= 0
    n = max(int(known.sum()), 1)
    right = int((logits.argmax(axis=1) == labels).sum())
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = np.flatnonzero(known)
    loss = float(-np.log(probs[rows, labels[rows]] + 1e-12).sum() / n)
    probs[rows, labels[rows]] -= 1.0
    probs[~known] = 0.0
    probs /= n
    du = (probs @ heads.projection) * _silu_slope(u)
    grads = {"a": du.T @ hidden, "bias": du.sum(axis=0)}
    if heads.sees_token:
        grads["b"] = du.T @ token_rows
    adam.update(heads, j, grads)
    return loss, right, len(labels)


def top_k_hits(heads: Heads, j: int, hidden: np.ndarray, token_rows: np.ndarray | None,
               labels: np.ndarray, k: int = 3) -> tuple[int, int]:
    """How many rows head j gets right at top-1 and within its top k (labels as in train_step)."""
    logits = heads.logits(j, hidden, token_rows)[0]
    top1 = int((logits.argmax(axis=1) == labels).sum())
    top = np.argpartition(logits, -k, axis=1)[:, -k:]
    return top1, int((top == labels[:, None]).any(axis=1).sum())
