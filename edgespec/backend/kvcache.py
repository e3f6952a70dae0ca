"""Where a new context departs from a KV cache's tokens: pure token arithmetic, no llama.cpp.

common_prefix_length says how much of a cache a prompt reuses; dropped_span
finds the one span a chat left out (its oldest turn), which Context.drop_span
then removes as llama.cpp's context shift does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


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
