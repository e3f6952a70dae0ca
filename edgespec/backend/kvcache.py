"""Editing a KV cache in place: where a new context departs from it, and removing a span from it.

Pure token arithmetic (common_prefix_length, dropped_span) and what
LlamaModel inherits (ShiftableCache): the label of its cache types, and the
span removal that moves the positions after the span back as llama.cpp's
context shift does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import llama_cpp


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# The shortest run of cached tokens worth shifting rather than computing again: a shorter match
# after a changed span is as likely a repeated phrase as the same turns, and cheap to recompute.
MIN_SHIFTED_TOKENS = 32


def dropped_span(cached: Sequence[int], context: Sequence[int],
                 min_kept: int = MIN_SHIFTED_TOKENS) -> tuple[int, int] | None:
    """(start, end) when context is cached with cached[start:end] left out, for at least min_kept tokens after it.

    That is what dropping a chat's oldest turn looks like: the common prefix
    (the system prompt, and any template text the turns share) ends at start,
    and context goes on with the cache from end.  Of several such ends, the
    one that keeps the most tokens.  None when context extends the cache, or
    nothing long enough follows the change.
    """
    start = common_prefix_length(cached, context)
    window = list(context[start : start + min_kept])
    if start >= len(cached) or len(window) < min_kept:
        return None
    tail = np.asarray(cached[start + 1 :], dtype=np.int64)
    best_end, best_kept = None, 0
    for end in (start + 1 + np.flatnonzero(tail == window[0])).tolist():
        if list(cached[end : end + min_kept]) == window:
            kept = common_prefix_length(cached[end:], context[start:])
            if kept > best_kept:
                best_end, best_kept = end, kept
    return None if best_end is None else (start, best_end)


class ShiftableCache:
    """What a model's KV cache holds and its span edits; needs the model's type_k, type_v, flash_attn,
    _memory and _cached_by_seq."""

    @property
    def kv_cache_label(self) -> str:
        """What the KV cache setup changes in the logits: "" for f16 keys and values without flash attention."""
        if (self.type_k, self.type_v, self.flash_attn) == ("f16", "f16", False):
            return ""
        return f"K {self.type_k}, V {self.type_v}, flash attention {'on' if self.flash_attn else 'off'}"

    @property
    def can_shift(self) -> bool:
        """Whether drop_span can move cached positions (RoPE models can; some architectures cannot)."""
        return bool(llama_cpp.llama_memory_can_shift(self._memory))

    def drop_span(self, start: int, end: int, seq: int = 0) -> None:
        """Forget sequence seq's cached positions [start, end) and move the ones after them back by end - start.

        This is llama.cpp's context shift: it rotates the moved keys to their
        new positions on the next decode, which computes nothing else again.
        The moved tokens' keys and values are still the ones computed with the
        span before them, so the cache is not the one a fresh prefill of the
        remaining tokens would give, nor bit-identical to it.
        """
        cached = self._cached_by_seq[seq]
        if not 0 <= start < end <= len(cached):
            raise ValueError(f"cannot drop positions [{start}, {end}) of a {len(cached)}-token cache")
        llama_cpp.llama_memory_seq_rm(self._memory, seq, start, end)
        llama_cpp.llama_memory_seq_add(self._memory, seq, end, -1, start - end)
        del cached[start:end]

    def cached_positions(self, seq: int = 0) -> tuple[int, int]:
        """The lowest and highest position llama.cpp holds in sequence seq's cache; (-1, -1) when empty."""
        return (llama_cpp.llama_memory_seq_pos_min(self._memory, seq),
                llama_cpp.llama_memory_seq_pos_max(self._memory, seq))
