"""Sampling parameters and the logits -> probabilities transform.

The same transform is applied to the target's logits (p) and to the draft's
(q).  Exactness of speculative decoding only needs p to be the distribution
plain decoding would sample from, so every filter here is a deterministic
function of one row of logits.

Every filter keeps only the head of the distribution, so the transform picks
that head on the float32 logits first and computes probabilities for it
alone: a row of a 151,936-token vocabulary costs O(vocabulary) only in
vectorised compares, never in float64 exponentials.  The result is a
SparseProbs (ids and probabilities), which the verifier compares in O(head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from difflib import get_close_matches

import numpy as np

# top-p and min-p only ever keep the head of the distribution; when top-k is
# off, look at this many candidates first and sort the whole vocabulary only
# if they do not cover the requested mass.
_HEAD_CANDIDATES = 1024

# The top-k head is looked for first among the logits above a threshold read
# off every _SUBSAMPLE_STEP-th logit, set so that about max(8 x k, 512) pass
# (one vectorised compare); only when fewer than k pass does the selection run
# over the whole vocabulary.
_SUBSAMPLE_STEP = 64

# The float32 partition function decides whether the head covers top_p unless
# the head's mass is this close to top_p; then it is recomputed in float64.
_COVER_MARGIN = 1e-4


# Below this a temperature can overflow float64 when it divides logits; above
# 0 and below it, sampling is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-3
# numpy's default_rng takes any non-negative integer; batch records and chat
# history keep the seed as JSON, so it stays within an unsigned 64-bit word.
MAX_SEED = 2**64 - 1


def _shown(value) -> str:
    """A value as an error quotes it: cut short, so that a seed of 4,000 digits is not printed back whole."""
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _checked_number(value, name: str, accepts, valid: str) -> float:
    """value as a float if it is a finite number `accepts` takes; else ValueError naming name and valid."""
    is_number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and accepts(float(value))):
        raise ValueError(f"{name} must be {valid}, not {_shown(value)}")
    return float(value)


def _checked_whole(value, name: str, low: int, high: int | None, valid: str) -> int:
    is_whole = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not (is_whole and value >= low and (high is None or value <= high)):
        raise ValueError(f"{name} must be {valid}, not {_shown(value)}")
    return int(value)


# Every generated token is checked against every stop string: 10,000 of them cost 10 ms a token, a step of a small
# model, and a server's one request would slow every other.  OpenAI takes 4.
MAX_STOPS = 64


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
            # OpenAI takes 0, and clients send temperature 0 with top_p 0 for determinism: the nucleus
            # of mass 0 is the likeliest token alone, as in llama.cpp
            "top_p": _checked_number(self.top_p, "top_p", lambda p: 0 <= p <= 1,
                                     "a number in [0, 1] (1 switches it off, 0 keeps the likeliest token)"),
            "min_p": _checked_number(self.min_p, "min_p", lambda p: 0 <= p < 1, "a number in [0, 1) (0 switches it off)"),
            "top_k": _checked_whole(self.top_k, "top_k", 0, None, "a whole number from 0 up (0 switches it off)"),
            "max_tokens": _checked_whole(self.max_tokens, "max_tokens", 1, None, "a whole number from 1 up"),
            "seed": None if self.seed is None else _checked_whole(self.seed, "seed", 0, MAX_SEED,
                                                                   "a whole number from 0 to 2**64-1"),
            "stop": (self.stop,) if isinstance(self.stop, str) else self.stop,
        }
        if not (isinstance(checked["stop"], (tuple, list)) and all(isinstance(text, str) for text in checked["stop"])):
            raise ValueError(f"stop must be a string or a list of strings, not {_shown(self.stop)}")
        if len(checked["stop"]) > MAX_STOPS:
            raise ValueError(f"stop holds {len(checked['stop']):,} strings; at most {MAX_STOPS} are accepted")
        if "" in checked["stop"]:  # the stop check skips it, so accepted it would silently stop nothing
            raise ValueError("a stop string may not be empty (it would stop nothing); leave it out")
        checked["stop"] = tuple(checked["stop"])
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SparseProbs:
    """A probability vector over the vocabulary that stores only its nonzero entries.

    ids ascend, so a cumulative sum over probs runs in the same order as one
    over the dense vector: the same uniform draws the same id from either.
    It reads like the dense vector: len() is the vocabulary size, row[id] a
    probability (0.0 off the support), np.asarray(row) the dense copy.
    """

    __slots__ = ("ids", "probs", "n_vocab")

    def __init__(self, ids: np.ndarray, probs: np.ndarray, n_vocab: int):
        self.ids, self.probs, self.n_vocab = ids, probs, n_vocab

    @classmethod
    def from_dense(cls, row) -> "SparseProbs":
        row = np.asarray(row, dtype=np.float64)
        ids = np.flatnonzero(row)
        return cls(ids, row[ids], row.size)

    def __len__(self) -> int:
        return self.n_vocab

    def __getitem__(self, token) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < self.ids.size and self.ids[i] == token else 0.0

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        dense = np.zeros(self.n_vocab, dtype=dtype or np.float64)
        dense[self.ids] = self.probs
        return dense

    def values_at(self, ids: np.ndarray) -> np.ndarray:
        """The probabilities at ids, a sorted superset of this row's support."""
        values = np.zeros(ids.size, dtype=np.float64)
        values[np.searchsorted(ids, self.ids)] = self.probs
        return values


def as_sparse(row) -> SparseProbs:
    return row if isinstance(row, SparseProbs) else SparseProbs.from_dense(row)


def to_probs(logits: np.ndarray, params: SamplingParams) -> SparseProbs:
    """One row of logits -> the probabilities of the tokens the filters keep.

    Temperature comes first, then top-k, top-p and min-p, each renormalising.
    Among tokens with equal logits at a cut, the lower ids are kept.
    """
    n_vocab = logits.shape[-1]
    if params.greedy:
        return SparseProbs(np.array([int(np.argmax(logits))]), np.ones(1), n_vocab)
    best = float(logits.max())
    if params.top_k == 0 and params.top_p == 1.0:
        head = _min_p_candidates(logits, best, params)
    else:
        head = _top_ids(logits, params.top_k or _HEAD_CANDIDATES)
    weights = _weights(logits[head], best, params.temperature)
    if params.top_k == 0 and params.top_p < 1.0 and not _covers_top_p(logits, best, weights, params):
        head = np.arange(n_vocab)
        weights = _weights(logits, best, params.temperature)
    keep = weights > 0.0
    if params.top_p < 1.0:
        keep = _nucleus(weights, params.top_p)
    if params.min_p > 0.0:
        # weights are relative to the best token (its weight is exp(0) = 1)
        keep &= weights >= params.min_p * weights.max()
    kept = weights[keep]
    return SparseProbs(head[keep], kept / kept.sum(), n_vocab)


def _weights(logits: np.ndarray, best: float, temperature: float) -> np.ndarray:
    """exp(x / T - max / T) in float64: the unnormalised probabilities."""
    return np.exp(logits.astype(np.float64) / temperature - best / temperature)


def _top_ids(logits: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n largest logits, ascending (the lower ids among equal logits)."""
    if n >= logits.size:
        return np.arange(logits.size)
    candidates = _likely_head(logits, n)
    if candidates.size == n:
        return candidates
    if candidates.size < n:
        candidates, values = np.arange(logits.size), logits
    else:
        values = logits[candidates]
    nth = np.partition(values, values.size - n)[values.size - n]
    keep = values > nth
    ties = np.flatnonzero(values == nth)
    keep[ties[: n - int(keep.sum())]] = True
    return candidates[keep]


def _likely_head(logits: np.ndarray, n: int) -> np.ndarray:
    """Ids of logits above a threshold that about max(8n, 512) of them pass; fewer than n is possible, never wrong."""
    sample = logits[::_SUBSAMPLE_STEP]
    rank = max(8, 8 * n // _SUBSAMPLE_STEP)
    if rank >= sample.size:
        return np.arange(0)
    threshold = np.partition(sample, sample.size - rank)[sample.size - rank]
    return np.flatnonzero(logits >= threshold)


def _min_p_candidates(logits: np.ndarray, best: float, params: SamplingParams) -> np.ndarray:
    """Every id that could pass min-p (its logit within T * ln(1 / min_p) of the best), with room for round-off."""
    if params.min_p == 0.0:
        return np.arange(logits.size)
    gap = params.temperature * -np.log(params.min_p) + 1e-3 * (1.0 + abs(best))
    return np.flatnonzero(logits >= best - gap)


def _covers_top_p(logits: np.ndarray, best: float, head_weights: np.ndarray, params: SamplingParams) -> bool:
    """Whether the head holds top_p of the whole distribution's mass.

    No token outside the head outweighs the head's lightest, so where even a
    tail of nothing but such tokens leaves the head top_p, it does: a model's
    peaked row is answered without an exponential over the whole vocabulary.
    Otherwise that needs the partition function: float32 exponentials are
    cheap and accurate to ~1e-6, float64 ones only run where the answer is that close.
    """
    head_mass, heaviest_tail = head_weights.sum(), (logits.size - head_weights.size) * head_weights.min()
    if head_mass / (head_mass + heaviest_tail) >= params.top_p + _COVER_MARGIN:
        return True
    scaled = (logits - np.float32(best)) / np.float32(params.temperature)
    mass = head_mass / np.exp(scaled).sum(dtype=np.float64)
    if abs(mass - params.top_p) > _COVER_MARGIN:
        return mass >= params.top_p
    return head_mass / _weights(logits, best, params.temperature).sum() >= params.top_p


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """A mask of the smallest set of heaviest entries whose weight reaches top_p of the total (at least one)."""
    order = np.argsort(-weights, kind="stable")
    sorted_weights = weights[order]
    cut = int(np.searchsorted(np.cumsum(sorted_weights), top_p * sorted_weights.sum())) + 1
    keep = np.zeros(weights.size, dtype=bool)
    keep[order[:cut]] = True
    return keep & (weights > 0.0)


def sample(probs, rng: np.random.Generator) -> int:
    """Draw one id from a probability vector, sparse or dense (inverse CDF in id order, one uniform per draw)."""
    row = as_sparse(probs)
    u = rng.random()
    if row.ids.size == 1:
        return int(row.ids[0])
    cdf = np.cumsum(row.probs)
    return int(row.ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), row.ids.size - 1)])


def sampling_params(params: SamplingParams | None, changes: dict) -> SamplingParams:
    """params (the defaults when None) with the keyword arguments changes; a bad name or value raises
    TypeError or ValueError naming it."""
    unknown = sorted(set(changes) - {field.name for field in fields(SamplingParams)})
    if unknown:  # SamplingParams' own TypeError named its __init__, not the call the caller made
        close = get_close_matches(unknown[0], [field.name for field in fields(SamplingParams)], n=1)
        raise TypeError(f"unknown sampling setting {unknown[0]!r}" + (f"; did you mean {close[0]}?" if close else
                        f"; the settings are {', '.join(field.name for field in fields(SamplingParams))}"))
    if params is None:
        return SamplingParams(**changes)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be an edgespec.SamplingParams, not {type(params).__name__} (or give the "
                        "values as keyword arguments: temperature=0, max_tokens=200, ...)")
    return replace(params, **changes) if changes else params
