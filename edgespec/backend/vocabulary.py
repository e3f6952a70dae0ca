"""A model's vocabulary (llama_vocab): text <-> token ids, and its split of text at special tokens.

Vocabulary keeps the vocabulary pointer and the token pieces it has read; the
functions below do the C calls and the splitting that keeps message contents
plain text.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
from typing import Sequence

import llama_cpp

# Token kinds llama.cpp's tokenizer splits text at; the control ones only with parse_special.
CONTROL_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
SPECIAL_ATTRS = CONTROL_ATTRS | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
_C_WHITESPACE = " \t\n\v\f\r"  # C's isspace(), which llama.cpp strips with


class Vocabulary:
    """A model's vocabulary: text <-> token ids, token pieces, and its special tokens."""

    def __init__(self, weights_handle):
        self._vocab = llama_cpp.llama_model_get_vocab(weights_handle)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._pieces: dict[int, bytes] = {}

    def tokenize(
        self, text: str, *, add_special: bool, parse_special: bool = False, plain_spans: Sequence[tuple[int, int]] = ()
    ) -> list[int]:
        """Text -> token ids; add_special adds the BOS/EOS tokens the model asks for.

        With parse_special, text spelling a control token (``<|im_end|>``)
        becomes that token: right for a chat template's own markers or --raw
        input, wrong for anything a user wrote.  The [start, end) character
        ranges in plain_spans (message contents) stay plain text even then.
        Outside them the ids are exactly what llama.cpp gives for the whole
        text, as its tokenizer also splits text at control tokens first and
        tokenizes the pieces in between on their own.  The split is done here
        even without plain_spans: llama.cpp's takes time quadratic in the
        markers, and a 2 MB raw prompt of them held the engine for a minute.
        """
        if not parse_special:
            return tokenize(self._vocab, text, add_special, parse_special)
        ids = [self.bos_id] if add_special and llama_cpp.llama_vocab_get_add_bos(self._vocab) else []
        spans = [(a, b) for a, b in plain_spans if a < b]
        for piece in split_at_special_tokens(text, self._special_tokens, spans):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += tokenize(self._vocab, text[piece[0] : piece[1]], False, False)
        if add_special and llama_cpp.llama_vocab_get_add_eos(self._vocab):
            ids.append(self.eos_id)
        return ids

    @functools.cached_property
    def _special_tokens(self) -> list[tuple[int, str, int]]:
        return special_tokens(self._vocab, self.n_vocab)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for (special tokens render as empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self._vocab, self._checked(token))
        return piece

    def token_text(self, token: int) -> bytes:
        """The token's entry in the vocabulary, as stored (for comparing vocabularies)."""
        return token_text(self._vocab, self._checked(token))

    def token_spelling(self, token: int) -> str:
        """The token written as text, a control token as its text (``<s>``, ``<|im_end|>``): what a chat
        template's bos_token and eos_token stand for, as llama.cpp renders templates."""
        return token_piece(self._vocab, self._checked(token), special=True).decode("utf-8", "replace")

    def _checked(self, token: int) -> int:
        # llama.cpp looks a token up with std::vector::at: an id outside the vocabulary throws through the
        # C API and aborts the process, where a ValueError can be caught and named
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        return token

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @functools.cached_property
    def end_of_generation_ids(self) -> frozenset[int]:
        """Every token that ends a generation (EOS, end of turn, and the like: llama.cpp's EOG set)."""
        return frozenset(token for token in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos_id(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos_id(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)


def tokenize(vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenization of the whole text."""
    data = text.encode("utf-8")
    capacity = len(data) + 16
    buf = (llama_cpp.llama_token * capacity)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    if n < 0:
        capacity = -n
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    return list(buf[:n])


def token_piece(vocab, token: int, special: bool = False) -> bytes:
    """The raw bytes a token stands for; special tokens render as empty, or with special as their text."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


def token_text(vocab, token: int) -> bytes:
    """The token's entry in the vocabulary, as stored (for comparing vocabularies)."""
    return llama_cpp.llama_vocab_get_text(vocab, token) or b""


def special_tokens(vocab, n_vocab: int) -> list[tuple[int, str, int]]:
    """(id, text, attributes) of every token llama.cpp splits text at, longest text first."""
    found = []
    for token in range(n_vocab):
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & SPECIAL_ATTRS and token_text(vocab, token):
            found.append((token, token_text(vocab, token).decode("utf-8", "replace"), attr))
    found.sort(key=lambda special: -len(special[1].encode("utf-8")))  # as llama.cpp orders them
    return found


def split_at_special_tokens(text: str, specials: list[tuple[int, str, int]], plain_spans: list[tuple[int, int]]) -> list:
    """llama.cpp's partition of text into special token ids and (start, end) ranges of text.

    The longest special tokens go first, each splitting every range still
    text at its occurrences; a control token overlapping a plain span stays
    text.  User-defined tokens split everywhere, as llama.cpp does with
    parse_special off.
    """
    pieces: list = [(0, len(text))]
    plain = _Spans(plain_spans)
    for special in specials:
        if special[1] in text:
            pieces = [part for piece in pieces for part in
                      ([piece] if isinstance(piece, int) else _split_range(text, *piece, special, plain))]
    return pieces


class _Spans:
    """[start, end) ranges, sorted once, so that each marker found is looked up rather than checked against every
    range: a chat of 60,000 short messages has 120,000 markers."""

    def __init__(self, spans):
        ordered = sorted(spans)
        self._starts = [a for a, _ in ordered]
        self._max_ends = list(itertools.accumulate((b for _, b in ordered), max))  # of every range up to each

    def overlap(self, start: int, stop: int) -> bool:
        """Whether any range overlaps [start, stop)."""
        before = bisect.bisect_left(self._starts, stop)  # the ranges that start before stop
        return before > 0 and self._max_ends[before - 1] > start


def _split_range(text: str, base: int, end: int, special: tuple[int, str, int], plain_spans: _Spans) -> list:
    """text[base:end] split at one special token's occurrences, as llama.cpp's tokenizer does."""
    token, spelling, attr = special
    controls = attr & CONTROL_ATTRS
    pieces: list = []
    match = text.find(spelling, base, end)
    while match >= 0:
        stop = match + len(spelling)
        if controls and plain_spans.overlap(match, stop):
            match = text.find(spelling, match + 1, end)  # inside a message: plain text
            continue
        left = match
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
            while left > base and text[left - 1] in _C_WHITESPACE:
                left -= 1
        if left > base:
            pieces.append((base, left))
        pieces.append(token)
        base = stop
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
            while base < end and text[base] in _C_WHITESPACE:
                base += 1
        match = text.find(spelling, base, end)
    if base < end:
        pieces.append((base, end))
    return pieces
