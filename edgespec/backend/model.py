"""A loaded GGUF model: its weights, its vocabulary and its context, as the rest of edgespec uses them.

The three parts follow llama.cpp's own objects (weights.py: llama_model;
vocabulary.py: llama_vocab; context.py: llama_context and its KV cache).
LlamaModel loads them together, names the model in errors, and makes room for
several sequences by opening a new context; probing.py measures its passes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..limits import checked_threads, kv_cache_types
from .context import Context
from .runtime import default_threads, forget_log
from .vocabulary import Vocabulary
from .weights import Weights


class LlamaModel:
    """A loaded GGUF model with one context and its KV cache.

    The context holds one sequence, or several after reserve_sequences().
    ``cached`` always lists the tokens whose keys and values sit in the KV
    cache of sequence 0, at positions 0..len(cached)-1; cached_of(seq) does
    so for any sequence.

    kv_type is the cache's type (f16, q8_0, q4_0).  Flash attention stays off
    unless flash_attn, and without it llama.cpp keeps the values in f16, so
    only the keys take kv_type (edgespec.limits.kv_cache_types).
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, n_gpu_layers: int = 0,
                 n_threads: int | None = None, n_batch: int = 512, kv_type: str = "f16", flash_attn: bool = False):
        self.type_k, self.type_v = kv_cache_types(kv_type, flash_attn)
        self.flash_attn = flash_attn
        self.n_threads = default_threads() if n_threads is None else checked_threads(n_threads)
        self.weights = Weights(path, n_gpu_layers)
        self.vocab = Vocabulary(self.weights.handle)
        self.context: Context | None = None
        self._open_context(n_ctx, n_batch, n_seq=1)

    def _open_context(self, n_ctx: int, n_batch: int, n_seq: int) -> None:
        try:
            self.context = Context(self.weights, self.vocab.n_vocab, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq,
                                   n_threads=self.n_threads, type_k=self.type_k, type_v=self.type_v,
                                   flash_attn=self.flash_attn)
        except Exception:
            self.weights.free()
            raise

    def reserve_sequences(self, n_seq: int) -> None:
        """Make room for n_seq sequences of n_ctx tokens each, in a new context: every cache starts empty."""
        old = self.context
        if n_seq == old.n_seq:
            return
        old.free()
        forget_log()  # so kv_buffer_bytes is the new context's
        self._open_context(old.n_ctx, old.n_batch, n_seq)
        self.context.forward_passes, self.context.decode_ns = old.forward_passes, old.decode_ns

    def close(self) -> None:
        if getattr(self, "context", None) is not None:
            self.context.free()
            self.context = None
        if getattr(self, "weights", None) is not None:
            self.weights.free()

    def __del__(self):
        self.close()

    # -- what the model is -----------------------------------------------------

    @property
    def path(self) -> Path:
        return self.weights.path

    @property
    def n_gpu_layers(self) -> int:
        return self.weights.n_gpu_layers

    def metadata(self, key: str) -> str | None:
        return self.weights.metadata(key)

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = False,
                 plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """See Vocabulary.tokenize."""
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special, plain_spans=plain_spans)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for (special tokens render as empty)."""
        return self.vocab.token_bytes(token)

    def token_text(self, token: int) -> bytes:
        return self.vocab.token_text(token)

    def token_spelling(self, token: int) -> str:
        """See Vocabulary.token_spelling."""
        return self.vocab.token_spelling(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocab.is_end_of_generation(token)

    @property
    def end_of_generation_ids(self) -> frozenset[int]:
        return self.vocab.end_of_generation_ids

    @property
    def bos_id(self) -> int:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int:
        return self.vocab.eos_id

    # -- its context -------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Tokens per sequence."""
        return self.context.n_ctx

    @property
    def n_batch(self) -> int:
        return self.context.n_batch

    @property
    def n_seq(self) -> int:
        return self.context.n_seq

    @property
    def kv_buffer_bytes(self) -> int | None:
        return self.context.kv_buffer_bytes

    @property
    def kv_cache_label(self) -> str:
        return self.context.kv_cache_label

    @property
    def can_shift(self) -> bool:
        return self.context.can_shift

    @property
    def forward_passes(self) -> int:
        return self.context.forward_passes

    @property
    def decode_ns(self) -> int:
        return self.context.decode_ns

    @property
    def cached(self) -> list[int]:
        """The tokens in sequence 0's KV cache."""
        return self.context.cached_of(0)

    def cached_of(self, seq: int) -> list[int]:
        return self.context.cached_of(seq)

    def rewind(self, n_keep: int, seq: int = 0) -> None:
        self.context.rewind(n_keep, seq)

    def copy_sequence(self, source: int, dest: int, n_keep: int) -> None:
        self.context.copy_sequence(source, dest, n_keep)

    def drop_span(self, start: int, end: int, seq: int = 0) -> None:
        self.context.drop_span(start, end, seq)

    def cached_positions(self, seq: int = 0) -> tuple[int, int]:
        return self.context.cached_positions(seq)

    def state_bytes(self, seq: int = 0):
        return self.context.state_bytes(seq)

    def load_state(self, data: bytes | bytearray, tokens: Sequence[int], seq: int = 0) -> bool:
        return self.context.load_state(data, tokens, seq)

    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True, seq: int = 0) -> np.ndarray | None:
        """See Context.decode."""
        return self.context.decode(tokens, n_logits, copy=copy, seq=seq)

    def decode_sequences(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        return self.context.decode_sequences(parts)
