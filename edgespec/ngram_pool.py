"""Draft sources beyond the current context: a pool of recent texts, and a client's predicted output.

A generation's own context is the first place an n-gram drafter looks.  Two more sources can
offer a continuation when it has none, and every token they offer is verified like any other:

- `NgramPool`: the recent prompts and outputs of this process (a batch's other requests, the
  server's other requests under the same API key, a chat's other chats), as SuffixDecoding and
  llama.cpp's lookup cache use them across requests.  Bounded: the oldest texts are dropped once
  it holds more than max_tokens, and its index is rebuilt when dropped texts fill half of it.
- `TokenIndex`: any one token sequence indexed for lookup, such as an OpenAI-style `prediction`
  (the file a client expects the answer to mostly repeat).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

# Tokens the pool keeps, over all its texts, and the longest part of one text it keeps (the end).
POOL_MAX_TOKENS = 32_768
POOL_MAX_TEXT_TOKENS = 8_192
# The n-gram lengths the pool indexes, longest first: a match across texts needs some length to
# mean anything, and indexing a few lengths, not every one, keeps the index small.
POOL_NGRAM_LENGTHS = (12, 8, 5, 3)


class TokenIndex:
    """One token sequence, indexed by every n-gram (1..n_max) to the position after its latest occurrence."""

    def __init__(self, tokens: Sequence[int], n_max: int = 16) -> None:
        self.tokens = list(tokens)
        self._next_after: dict[tuple[int, ...], int] = {}
        for end in range(len(self.tokens)):
            for n in range(1, min(n_max, end + 1) + 1):
                self._next_after[tuple(self.tokens[end - n + 1: end + 1])] = end + 1
        self.n_max = n_max

    def lookup(self, context: Sequence[int], n_min: int = 1) -> tuple[int, int] | None:
        """(match length, position after the match) of the longest n-gram ending context, if any
        is followed by something here."""
        for n in range(min(self.n_max, len(context)), n_min - 1, -1):
            start = self._next_after.get(tuple(context[-n:]))
            if start is not None and start < len(self.tokens):
                return n, start
        return None


class NgramPool:
    """Recent texts, looked up by the n-gram that ends a context; safe to share between threads."""

    def __init__(self, max_tokens: int = POOL_MAX_TOKENS, lengths: Sequence[int] = POOL_NGRAM_LENGTHS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.lengths = tuple(sorted(set(lengths), reverse=True))
        self._texts: deque[tuple[int, tuple[int, ...]]] = deque()  # (serial, tokens), oldest first
        self._live: dict[int, tuple[int, ...]] = {}
        self._serial = 0
        self._tokens = 0
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (serial, position after it)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held now, over all texts."""
        return self._tokens

    @property
    def indexed_ngrams(self) -> int:
        """N-grams in the lookup index now: what its memory grows with (kept within a bound of the tokens held)."""
        return len(self._index)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep a text (its last POOL_MAX_TEXT_TOKENS tokens) for later lookups; drop the oldest past the bound."""
        text = tuple(tokens[-min(POOL_MAX_TEXT_TOKENS, self.max_tokens):])
        if len(text) <= min(self.lengths):
            return
        with self._lock:
            self._serial += 1
            self._texts.append((self._serial, text))
            self._live[self._serial] = text
            self._tokens += len(text)
            self._index_text(self._serial, text)
            while self._tokens > self.max_tokens:
                serial, dropped = self._texts.popleft()
                del self._live[serial]
                self._tokens -= len(dropped)
            if len(self._index) > 2 * len(self.lengths) * max(self._tokens, 1):
                self._index = {}
                for serial, text in self._texts:
                    self._index_text(serial, text)

    def _index_text(self, serial: int, text: tuple[int, ...]) -> None:
        for n in self.lengths:
            for end in range(n, len(text)):  # n-grams with a successor in the text
                self._index[text[end - n: end]] = (serial, end)

    def lookup(self, context: Sequence[int], k: int) -> tuple[int, list[int]] | None:
        """(match length, up to k tokens that followed it) for the longest indexed n-gram ending context."""
        with self._lock:
            for n in self.lengths:
                if n > len(context):
                    continue
                found = self._index.get(tuple(context[-n:]))
                if found is None:
                    continue
                text = self._live.get(found[0])
                if text is not None:  # else its text was dropped: an entry waiting for the next rebuild
                    return n, list(text[found[1]: found[1] + k])
        return None
