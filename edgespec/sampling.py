"""Sampling parameters and the logits -> probabilities transform.

The same transform is applied to the target's logits (p) and to the draft's
(q).  Exactness of speculative decoding only needs p to be the distribution
plain decoding would sample from, so every filter here is a deterministic
function of one row of logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# top-p and min-p only ever keep the head of the distribution; when top-k is
# off, look at this many candidates first and sort the whole vocabulary only
# if they do not cover the requested mass.
_HEAD_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 switches it off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min_p must be in [0, 1)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row of logits -> a probability vector over the whole vocabulary.

    Temperature comes first, then top-k, top-p and min-p, each renormalising.
    """
    if params.greedy:
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    full = _softmax(logits.astype(np.float64) / params.temperature)
    if params.top_k == 0 and params.top_p == 1.0:
        if params.min_p > 0.0:
            full[full < params.min_p * full.max()] = 0.0
        return full / full.sum()
    ids, kept = _sorted_head(full, params)
    if params.top_p < 1.0:
        # the smallest head whose mass reaches top_p (at least one token)
        cut = int(np.searchsorted(np.cumsum(kept), params.top_p * kept.sum())) + 1
        ids, kept = ids[:cut], kept[:cut]
    if params.min_p > 0.0:
        keep = kept >= params.min_p * kept[0]
        ids, kept = ids[keep], kept[keep]
    probs = np.zeros_like(full)
    probs[ids] = kept / kept.sum()
    return probs


def _sorted_head(full: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids by falling probability: the top-k, or enough of the head to reach top_p."""
    if params.top_k > 0:
        ids = _top_ids(full, params.top_k)
    else:
        ids = _top_ids(full, _HEAD_CANDIDATES)
        if full[ids].sum() < params.top_p:
            ids = np.argsort(-full, kind="stable")
    return ids, full[ids]


def _top_ids(probs: np.ndarray, n: int) -> np.ndarray:
    if n >= probs.size:
        return np.argsort(-probs, kind="stable")
    head = np.argpartition(-probs, n - 1)[:n]
    return head[np.argsort(-probs[head], kind="stable")]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one id from a probability vector (inverse CDF, so one uniform per draw)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))
