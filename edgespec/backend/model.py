"""A loaded GGUF model: its KV cache, forward passes and logits, over llama.cpp's low-level C API.

``llama_batch`` + ``llama_decode`` + ``llama_get_logits`` are both faster
than the high-level ``Llama.eval`` and let us ask for the logits of just the
rows we verify: nothing here ever allocates an n_ctx x n_vocab logits buffer.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp

from ..errors import ContextOverflowError, DecodeError, ModelFileError, ModelLoadError
from ..limits import MAX_OUTPUT_ROWS, N_UBATCH, checked_threads, kv_cache_types
import edgespec.backend.tokenizer as tokenizer  # the module itself: `from . import` would name the package
from .batch import TokenBatch
from .kvcache import ShiftableCache
from .runtime import EXTRA_BUFFER_TYPES_SAFE, default_threads, forget_log, last_error, logged_kv_buffer_bytes

_GGML_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}



@dataclass(frozen=True)
class PassProbe:
    """What probe_pass_widths found."""

    exact_width: int  # every pass up to this many tokens gives one-token passes' logits bit for bit
    drift: dict[int, float]  # per checked width: the largest |logit difference| from one-token passes


class LlamaModel(ShiftableCache):
    """A loaded GGUF model with one context and its KV cache.

    The context holds one sequence, or several after reserve_sequences().
    ``cached`` always lists the tokens whose keys and values sit in the KV
    cache of sequence 0, at positions 0..len(cached)-1; cached_of(seq) does
    so for any sequence.

    kv_type is the cache's type (f16, q8_0, q4_0).  Flash attention stays off
    unless flash_attn, and without it llama.cpp keeps the values in f16, so
    only the keys take kv_type (edgespec.limits.kv_cache_types).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_type: str = "f16",
        flash_attn: bool = False,
    ):
        self.type_k, self.type_v = kv_cache_types(kv_type, flash_attn)
        self.flash_attn = flash_attn
        self.n_threads = default_threads() if n_threads is None else checked_threads(n_threads)
        self.path = Path(path)
        self._check_file()
        self._model = self._load_model(n_gpu_layers)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_gpu_layers = n_gpu_layers
        self._pieces: dict[int, bytes] = {}
        self._open_context(n_ctx, n_batch, n_seq=1)
        self.forward_passes = 0
        self.decode_ns = 0  # time inside llama_decode, summed: what `bench --overhead` subtracts

    # -- loading -------------------------------------------------------------

    def _check_file(self) -> None:
        if not self.path.is_file():
            raise ModelFileError(f"model file not found: {self.path} (check the path, or pull it with `edgespec models pull`)")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"not a GGUF file: {self.path} (edgespec loads llama.cpp GGUF models only)")

    def _load_model(self, n_gpu_layers: int):
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # The extra CPU buffer types hold weights repacked for kernels that make
        # plain decoding ~25% faster here, though they switch arithmetic at 4
        # tokens per pass, which narrows the bit-exact verification width (see
        # probe_pass_widths: 3 with them, 7 without, on Qwen2.5-Coder-1.5B
        # Q4_K_M).  Faster plain steps win on this CPU either way.  Their AMX
        # variant segfaults on some Xeons, so `make` compiles AMX out; with an
        # AMX build they stay off.
        params.use_extra_bufts = EXTRA_BUFFER_TYPES_SAFE
        forget_log()
        model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: {last_error()} (the file may be truncated or of an unsupported architecture)"
            )
        return model

    def _open_context(self, n_ctx: int, n_batch: int, n_seq: int) -> None:
        self._ctx = self._create_context(n_ctx, n_batch, self.n_threads, n_seq)
        self.kv_buffer_bytes = logged_kv_buffer_bytes()  # llama.cpp's own count; None if it did not log one
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx) // n_seq  # per sequence
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        self.n_seq = n_seq
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = TokenBatch(n_batch)
        self._cached_by_seq: list[list[int]] = [[] for _ in range(n_seq)]
        self.cached = self._cached_by_seq[0]

    def reserve_sequences(self, n_seq: int) -> None:
        """Make room for n_seq sequences of n_ctx tokens each, in a new context: every cache starts empty.

        They share one KV buffer of n_seq x n_ctx cells (each attends to its own): with a buffer
        per sequence llama.cpp splits a pass into one physical pass per run of consecutive
        sequence ids holding equal numbers of tokens, up to one per sequence.
        """
        if n_seq == self.n_seq:
            return
        n_ctx, n_batch = self.n_ctx, self.n_batch
        self._free_context()
        forget_log()  # so kv_buffer_bytes is the new context's
        self._open_context(n_ctx * n_seq, n_batch, n_seq)

    def _create_context(self, n_ctx: int, n_batch: int, n_threads: int, n_seq: int = 1):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, N_UBATCH)
        params.n_seq_max = n_seq
        params.kv_unified = n_seq > 1  # see reserve_sequences
        params.n_outputs_max = MAX_OUTPUT_ROWS
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # Flash attention tiles its reductions by the number of tokens in the
        # pass, so a verified row would differ from the same row decoded alone:
        # it is on only when asked for (which the engine refuses under --bit-exact).
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k, params.type_v = _GGML_TYPES[self.type_k], _GGML_TYPES[self.type_v]
        forget_log()
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise ModelLoadError(
                f"llama.cpp could not create a {n_ctx}-token context for {self.path}: {last_error()} "
                f"(try a smaller --n-ctx{'' if self.type_k == 'f16' else ', or --kv-type f16'})"
            )
        return ctx

    def _free_context(self) -> None:
        self._batch.free()
        llama_cpp.llama_free(self._ctx)
        self._ctx = None

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._free_context()
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()

    # -- vocabulary ----------------------------------------------------------

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
        tokenizes the pieces in between on their own.
        """
        if not (parse_special and any(start < end for start, end in plain_spans)):
            return tokenizer.tokenize(self._vocab, text, add_special, parse_special)
        ids = [self.bos_id] if add_special and llama_cpp.llama_vocab_get_add_bos(self._vocab) else []
        spans = [(a, b) for a, b in plain_spans if a < b]
        for piece in tokenizer.split_at_special_tokens(text, self._special_tokens, spans):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += tokenizer.tokenize(self._vocab, text[piece[0] : piece[1]], False, False)
        if add_special and llama_cpp.llama_vocab_get_add_eos(self._vocab):
            ids.append(self.eos_id)
        return ids

    @functools.cached_property
    def _special_tokens(self) -> list[tuple[int, str, int]]:
        return tokenizer.special_tokens(self._vocab, self.n_vocab)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for (special tokens render as empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = tokenizer.token_piece(self._vocab, token)
        return piece

    def token_text(self, token: int) -> bytes:
        """The token's entry in the vocabulary, as stored (for comparing vocabularies)."""
        return tokenizer.token_text(self._vocab, token)

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos_id(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos_id(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    def metadata(self, key: str) -> str | None:
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    # -- the KV cache and forward passes --------------------------------------

    def cached_of(self, seq: int) -> list[int]:
        """The tokens in sequence seq's KV cache (sequence 0's is ``cached``)."""
        return self._cached_by_seq[seq]

    def copy_sequence(self, source: int, dest: int, n_keep: int) -> None:
        """Make sequence dest's cache the first n_keep tokens of sequence source's (in the shared buffer
        the two then share those cells; nothing is copied)."""
        self.rewind(0, dest)
        llama_cpp.llama_memory_seq_cp(self._memory, source, dest, 0, n_keep)
        self._cached_by_seq[dest][:] = self._cached_by_seq[source][:n_keep]

    def rewind(self, n_keep: int, seq: int = 0) -> None:
        """Forget every cached position of sequence seq from n_keep on."""
        cached = self._cached_by_seq[seq]
        if n_keep < len(cached):
            llama_cpp.llama_memory_seq_rm(self._memory, seq, n_keep, -1)
            del cached[n_keep:]


    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True, seq: int = 0) -> np.ndarray | None:
        """Append tokens to sequence seq's cache; return the logits of the last n_logits of them.

        The result has shape (n_logits, n_vocab) and row i predicts the token
        after tokens[len(tokens) - n_logits + i].  Long inputs go in chunks of
        n_batch.  With copy=False the rows are a read-only view of llama.cpp's
        output buffer, valid until this model's next decode: a verifier that
        reads one row of four need not copy the other three (600 KB each at a
        152k vocabulary).
        """
        if not tokens:
            return None
        cached = self._cached_by_seq[seq]
        if len(cached) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(cached) + len(tokens)} tokens do not fit in the {self.n_ctx}-token context (raise --n-ctx or shorten the input)"
            )
        if n_logits > min(MAX_OUTPUT_ROWS, self.n_batch) or n_logits > len(tokens):
            raise ValueError(f"cannot return {n_logits} logits rows for {len(tokens)} tokens")
        first_row = len(tokens) - n_logits
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            wanted = max(0, start + len(chunk) - max(first_row, start))
            self._decode_chunk(chunk, wanted, seq)
            if wanted:
                rows.append(self._logits_view(wanted))
        if not rows:
            return None
        if len(rows) == 1:
            return rows[0].copy() if copy else rows[0]
        return np.concatenate(rows)  # rows from several chunks: one copy of them all

    def _decode_chunk(self, chunk: Sequence[int], n_logits: int, seq: int) -> None:
        n, cached = len(chunk), self._cached_by_seq[seq]
        self._batch.fill(chunk, np.arange(len(cached), len(cached) + n), [0] * (n - n_logits) + [1] * n_logits, seq)
        self._run_batch()
        cached.extend(chunk)

    def _run_batch(self) -> None:
        started = time.perf_counter_ns()
        status = llama_cpp.llama_decode(self._ctx, self._batch.raw)
        self.decode_ns += time.perf_counter_ns() - started
        if status != 0:
            raise DecodeError(f"llama_decode failed with status {status} on {self.path.name}: {last_error()}")
        self.forward_passes += 1

    def decode_sequences(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """One pass over several sequences: each (seq, tokens, n_logits) appends tokens to sequence seq's cache.

        Returns, per part, the logits of its last n_logits tokens: read-only
        views of llama.cpp's output buffer, valid until this model's next
        decode.  The whole pass must fit in one batch and one output buffer.
        """
        seq_ids, positions, outputs, tokens = [], [], [], []
        for seq, part, n_logits in parts:
            cached = self._cached_by_seq[seq]
            if len(cached) + len(part) > self.n_ctx:
                raise ContextOverflowError(
                    f"{len(cached) + len(part)} tokens do not fit in the {self.n_ctx}-token context (raise --n-ctx or shorten the input)")
            seq_ids += [seq] * len(part)
            positions += range(len(cached), len(cached) + len(part))
            outputs += [0] * (len(part) - n_logits) + [1] * n_logits
            tokens += part
        n_rows = sum(outputs)
        if len(tokens) > self.n_batch or n_rows > MAX_OUTPUT_ROWS:
            raise ValueError(f"a pass of {len(tokens)} tokens and {n_rows} logits rows does not fit one batch")
        self._batch.fill(tokens, positions, outputs, seq_ids)
        self._run_batch()
        rows, views, first = self._logits_view(n_rows), [], 0
        for seq, part, n_logits in parts:
            self._cached_by_seq[seq].extend(part)
            views.append(rows[first : first + n_logits])
            first += n_logits
        return views

    def _logits_view(self, n_rows: int) -> np.ndarray:
        # outputs are stored contiguously in batch order
        ptr = llama_cpp.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
        rows.flags.writeable = False
        return rows

    def probe_pass_widths(
        self, probe: Sequence[int], limit: int, drift_widths: Sequence[int] = (), budget_seconds: float | None = None
    ) -> PassProbe:
        """How far passes up to limit tokens wide part from one-token passes, bit for bit and in logits.

        llama.cpp's CPU kernels change arithmetic with the number of tokens in
        a pass, so a token verified in a wider pass can get slightly different
        logits from the same token decoded alone.  Widths are checked
        narrowest first, each by a pass of its own, until the first one that
        is not bit-identical; after that only drift_widths are checked, for
        the size of the difference.  With budget_seconds the one-token passes
        get a quarter of it and the checks the rest, each check skipped once
        it would end past the budget (width 2 is always checked), so every
        figure comes from a width that was checked.  probe needs 8 + limit
        tokens; the cache is left as it was.
        """
        n_keep, passes = len(self.cached), self.forward_passes
        prefix, tokens = list(probe[:8]), list(probe[8 : 8 + limit])
        self.decode(prefix, n_logits=0)
        started = time.perf_counter()
        singles = []
        for token in tokens:
            if budget_seconds is not None and len(singles) >= 2 and _since(started) > budget_seconds / 4:
                break
            singles.append(self.decode([token], 1)[0])
        exact_width, drift, last_check = 1, {}, 0.0
        for w in range(2, len(singles) + 1):
            if exact_width < w - 1 and w not in drift_widths:
                continue
            if budget_seconds is not None and w > 2 and _since(started) + last_check * w / (w - 1) > budget_seconds:
                break
            check_started = time.perf_counter()
            self.rewind(n_keep + len(prefix))
            rows = self.decode(tokens[:w], w)
            last_check = _since(check_started)
            drift[w] = float(np.max(np.abs(rows - np.stack(singles[:w]))))
            if drift[w] == 0.0 and exact_width == w - 1:
                exact_width = w
        self.forward_passes = passes
        self.rewind(n_keep)
        return PassProbe(exact_width, drift)

    def time_forward(self, n_tokens: int, filler: int) -> float:
        """Seconds for one forward pass over n_tokens, returning n_tokens logits rows.

        Used to calibrate draft lengths; the cache is left as it was.
        """
        n_keep = len(self.cached)
        start = time.perf_counter()
        self.decode([filler] * n_tokens, n_logits=min(n_tokens, MAX_OUTPUT_ROWS))
        elapsed = time.perf_counter() - start
        self.forward_passes -= 1
        self.rewind(n_keep)
        return elapsed


def _since(start: float) -> float:
    return time.perf_counter() - start
