"""Sampling parameters and the logits -> probabilities transform.

The same transform is applied to the target's logits (p) and to the draft's
(q).  Exactness of speculative decoding only needs p to be the distribution
plain decoding would sample from, so every filter here is a deterministic
function of one row of logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# top-p and min-p only ever keep the head of the distribution; when top-k is
# off, look at this many candidates first and sort the whole vocabulary only
# if they do not cover the requested mass.
_HEAD_CANDIDATES = 1024


# Below this a temperature can overflow float64 when it divides logits; above
# 0 and below it, sampling is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-3
# numpy's default_rng takes any non-negative integer; batch records and chat
# history keep the seed as JSON, so it stays within an unsigned 64-bit word.
MAX_SEED = 2**64 - 1


def _checked_number(value, name: str, accepts, valid: str) -> float:
    """value as a float if it is a finite number `accepts` takes; else ValueError naming name and valid."""
    is_number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and accepts(float(value))):
        raise ValueError(f"{name} must be {valid}, not {value!r}")
    return float(value)


def _checked_whole(value, name: str, low: int, high: int | None, valid: str) -> int:
    is_whole = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not (is_whole and value >= low and (high is None or value <= high)):
        raise ValueError(f"{name} must be {valid}, not {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample.  Every value is checked here and nowhere else.

    A bad value raises ValueError with a message that names the field and its
    valid range; the CLI, batch bodies, config.toml and the settings screen
    all show that message.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        checked = {
            "temperature": _checked_number(self.temperature, "temperature", lambda t: t == 0 or t >= MIN_TEMPERATURE,
                                           f"0 (greedy) or a number from {MIN_TEMPERATURE} up"),
            "top_p": _checked_number(self.top_p, "top_p", lambda p: 0 < p <= 1, "a number in (0, 1] (1 switches it off)"),
            "min_p": _checked_number(self.min_p, "min_p", lambda p: 0 <= p < 1, "a number in [0, 1) (0 switches it off)"),
            "top_k": _checked_whole(self.top_k, "top_k", 0, None, "a whole number from 0 up (0 switches it off)"),
            "max_tokens": _checked_whole(self.max_tokens, "max_tokens", 1, None, "a whole number from 1 up"),
            "seed": None if self.seed is None else _checked_whole(self.seed, "seed", 0, MAX_SEED,
                                                                   "a whole number from 0 to 2**64-1"),
            "stop": (self.stop,) if isinstance(self.stop, str) else self.stop,
        }
        if not (isinstance(checked["stop"], (tuple, list)) and all(isinstance(text, str) for text in checked["stop"])):
            raise ValueError(f"stop must be a string or a list of strings, not {self.stop!r}")
        checked["stop"] = tuple(checked["stop"])
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _finite(value, name: str, valid: str) -> float:
    """value as a float, or ValueError for what is not a finite number (NaN, inf, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number {valid}, not {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number {valid}, not {value!r}")
    return number


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
