"""A llama.cpp context over loaded weights: its sequences' KV caches, forward passes and logits.

``llama_batch`` + ``llama_decode`` + ``llama_get_logits`` are both faster
than the high-level ``Llama.eval`` and let us ask for the logits of just the
rows we verify: nothing here ever allocates an n_ctx x n_vocab logits buffer.
The context knows which tokens each sequence's cache holds, and edits those
caches: rewind, share a prefix, shift a span out, save and load as bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from typing import Sequence

import numpy as np

import llama_cpp

from ..errors import ContextOverflowError, DecodeError, ModelLoadError, Setting
from ..limits import MAX_OUTPUT_ROWS, N_UBATCH, kv_cache_label
from .batch import TokenBatch
from .runtime import forget_log, last_error, logged_flash_attention, logged_kv_buffer_bytes, raise_kept_interrupt
from .state import state_buffer

_GGML_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}


def _overflow(n_tokens: int, n_ctx: int) -> ContextOverflowError:
    return ContextOverflowError(f"{n_tokens} tokens do not fit in the {n_ctx}-token context (raise ", Setting("n_ctx"),
                                " or shorten the input)")


class Context:
    """n_seq sequences of n_ctx tokens each, in one KV buffer of llama.cpp's, and the passes over them.

    With several sequences the buffer is unified (each attends to its own
    cells): with a buffer per sequence llama.cpp splits a pass into one
    physical pass per run of consecutive sequence ids holding equal numbers
    of tokens, up to one per sequence.  And flash attention is left to
    llama.cpp, which turns it on wherever the device that runs the layers
    runs the op (every CPU): without it every row's attention is computed
    over every sequence's cells and masked afterwards, so a pass over 16
    sequences 256 tokens deep cost 1.6-2.4x what it costs with it
    (Qwen2.5-Coder-1.5B, 2-core EPYC), while its kernel skips the cells a
    row does not see.  Rows in such a pass are not bit-identical to
    one-token passes anyway (the kernels follow the pass's width); flash
    attention's rounding moves them a little further (the largest logit
    difference from lone one-token passes, 8 sequences of that model 290
    deep: 1.1 with it, 0.7 without; no argmax changed).
    """

    def __init__(self, weights, n_vocab: int, *, n_ctx: int, n_batch: int, n_seq: int, n_threads: int,
                 type_k: str, type_v: str, flash_attn: bool):
        self.type_k, self.type_v = type_k, type_v
        self.n_vocab = n_vocab
        self._path = weights.path
        self._ctx = self._create(weights, n_ctx * n_seq, n_batch, n_seq, n_threads, flash_attn)
        # on when asked for; with several sequences, as llama.cpp decided
        self.flash_attn = flash_attn or (n_seq > 1 and logged_flash_attention())
        self.kv_buffer_bytes = logged_kv_buffer_bytes()  # llama.cpp's own count; None if it did not log one
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx) // n_seq  # per sequence
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        self.n_seq = n_seq
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = TokenBatch(n_batch)
        self._cached_by_seq: list[list[int]] = [[] for _ in range(n_seq)]
        self.forward_passes = 0
        self.decode_ns = 0  # time inside llama_decode, summed: what `bench --overhead` subtracts

    def _create(self, weights, n_ctx: int, n_batch: int, n_seq: int, n_threads: int, flash_attn: bool):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, N_UBATCH)
        params.n_seq_max = n_seq
        params.kv_unified = n_seq > 1  # see the class's docstring
        params.n_outputs_max = MAX_OUTPUT_ROWS
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # Flash attention tiles its reductions by the number of tokens in the
        # pass, so a verified row would differ from the same row decoded alone:
        # one sequence's context has it only when asked for (which the engine
        # refuses under --bit-exact); several sequences' see the class's docstring.
        if flash_attn:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        elif n_seq > 1:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        else:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k, params.type_v = _GGML_TYPES[self.type_k], _GGML_TYPES[self.type_v]
        forget_log()
        ctx = llama_cpp.llama_init_from_model(weights.handle, params)
        raise_kept_interrupt(ctx, llama_cpp.llama_free)  # a Ctrl+C while it allocated
        if not ctx:
            smaller_cache = () if self.type_k == "f16" else (", or ", Setting("kv_type", "f16"))
            raise ModelLoadError(f"llama.cpp could not create a {n_ctx}-token context for {self._path}: {last_error()} "
                                 "(try a smaller ", Setting("n_ctx"), *smaller_cache, ")")
        return ctx

    def free(self) -> None:
        # As Weights.free: the handle is let go of first, so a Ctrl+C on the way cannot lead to a double free.
        ctx, self._ctx = self._ctx, None
        if ctx:
            try:
                self._batch.free()
            finally:
                llama_cpp.llama_free(ctx)

    @property
    def kv_cache_label(self) -> str:
        """What the KV cache setup changes in the logits: "" for f16 keys and values without flash attention."""
        return kv_cache_label(self.type_k, self.type_v, self.flash_attn)

    # -- what the caches hold, and editing them ----------------------------------

    def cached_of(self, seq: int) -> list[int]:
        """The tokens in sequence seq's KV cache, at positions 0..len - 1."""
        return self._cached_by_seq[seq]

    def rewind(self, n_keep: int, seq: int = 0) -> None:
        """Forget every cached position of sequence seq from n_keep on."""
        cached = self._cached_by_seq[seq]
        if n_keep < len(cached):
            llama_cpp.llama_memory_seq_rm(self._memory, seq, n_keep, -1)
            del cached[n_keep:]

    def copy_sequence(self, source: int, dest: int, n_keep: int) -> None:
        """Make sequence dest's cache the first n_keep tokens of sequence source's (in the shared buffer
        the two then share those cells; nothing is copied)."""
        self.rewind(0, dest)
        llama_cpp.llama_memory_seq_cp(self._memory, source, dest, 0, n_keep)
        self._cached_by_seq[dest][:] = self._cached_by_seq[source][:n_keep]

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

    def state_bytes(self, seq: int = 0) -> mmap.mmap | bytearray:
        """Sequence seq's KV cache as llama_state_seq_get_data writes it (the prompt cache's snapshots),
        in a buffer of its own (state_buffer)."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = state_buffer(size)
        written = llama_cpp.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        if written == 0 and self._cached_by_seq[seq]:
            raise DecodeError(f"llama.cpp could not serialise the KV cache of {self._path.name}: {last_error()}")
        if written < size:
            shorter = state_buffer(written)
            shorter[:] = memoryview(data)[:written]
            data = shorter
        return data

    def load_state(self, data: bytes | bytearray | mmap.mmap, tokens: Sequence[int], seq: int = 0) -> bool:
        """Replace sequence seq's KV cache with data, a state of exactly tokens; False, that cache left empty, if refused.

        The caller vouches that data is a snapshot of tokens from this model and build (the prompt
        cache's header and checksum do); llama.cpp checks only sizes, and the position count is checked here.
        """
        self.rewind(0, seq)
        array = ctypes.c_uint8 * len(data)
        buffer = array.from_buffer_copy(data) if isinstance(data, bytes) else array.from_buffer(data)
        forget_log()
        loaded = llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(data), seq)
        if loaded == 0 or llama_cpp.llama_memory_seq_pos_max(self._memory, seq) != len(tokens) - 1:
            llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)
            if llama_cpp.llama_memory_seq_pos_max(self._memory, seq) >= 0:
                self._clear_all_for(seq)
            return False
        self._cached_by_seq[seq][:] = tokens  # in place: callers may hold the list
        return True

    def _clear_all_for(self, seq: int) -> None:
        """Empty the whole KV cache, the one way to drop a refused state's cell at position 2**31 - 1 (a crafted
        snapshot's): llama_memory_seq_rm(seq, 0, -1) ends its range just before it, and the cell left behind
        failed every later decode of seq.  DecodeError if another sequence holds tokens, which that would lose."""
        if any(cached for other, cached in enumerate(self._cached_by_seq) if other != seq):
            raise DecodeError(f"llama.cpp kept part of a refused prompt-cache state in {self._path.name}'s "
                              "KV cache; delete the prompt cache's snapshot files and run again")
        llama_cpp.llama_memory_clear(self._memory, True)
        self._cached_by_seq[seq].clear()

    # -- forward passes --------------------------------------------------------

    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True, seq: int = 0) -> np.ndarray | None:
        """Append tokens to sequence seq's cache; return the logits of the last n_logits of them.

        The result has shape (n_logits, n_vocab) and row i predicts the token
        after tokens[len(tokens) - n_logits + i].  Long inputs go in chunks of
        n_batch.  With copy=False the rows are a read-only view of llama.cpp's
        output buffer, valid until this context's next decode: a verifier that
        reads one row of four need not copy the other three (600 KB each at a
        152k vocabulary).
        """
        if not tokens:
            return None
        cached = self._cached_by_seq[seq]
        if len(cached) + len(tokens) > self.n_ctx:
            raise _overflow(len(cached) + len(tokens), self.n_ctx)
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
        self._run_and_record([(seq, chunk)])

    def _run_and_record(self, parts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Run the filled batch and record each (seq, tokens) part as cached.

        Should that raise, each sequence's cells past what is recorded are taken out again: a Ctrl+C during
        a long prefill lands as llama_decode returns, its tokens in the KV cache but not yet recorded, and
        the next pass of that sequence (placed after the recorded ones) failed as inconsistent positions.
        """
        try:
            self._run_batch()
            for seq, tokens in parts:
                self._cached_by_seq[seq].extend(tokens)
        except BaseException:
            for seq, _ in parts:
                llama_cpp.llama_memory_seq_rm(self._memory, seq, len(self._cached_by_seq[seq]), -1)
            raise

    def _run_batch(self) -> None:
        started = time.perf_counter_ns()
        status = llama_cpp.llama_decode(self._ctx, self._batch.raw)
        self.decode_ns += time.perf_counter_ns() - started
        if status != 0:
            raise DecodeError(f"llama_decode failed with status {status} on {self._path.name}: {last_error()}")
        self.forward_passes += 1

    def decode_sequences(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """One pass over several sequences: each (seq, tokens, n_logits) appends tokens to sequence seq's cache.

        Returns, per part, the logits of its last n_logits tokens: read-only
        views of llama.cpp's output buffer, valid until this context's next
        decode.  The whole pass must fit in one batch and one output buffer.
        """
        seq_ids, positions, outputs, tokens = [], [], [], []
        for seq, part, n_logits in parts:
            cached = self._cached_by_seq[seq]
            if len(cached) + len(part) > self.n_ctx:
                raise _overflow(len(cached) + len(part), self.n_ctx)
            seq_ids += [seq] * len(part)
            positions += range(len(cached), len(cached) + len(part))
            outputs += [0] * (len(part) - n_logits) + [1] * n_logits
            tokens += part
        n_rows = sum(outputs)
        if len(tokens) > self.n_batch or n_rows > MAX_OUTPUT_ROWS:
            raise ValueError(f"a pass of {len(tokens)} tokens and {n_rows} logits rows does not fit one batch")
        self._batch.fill(tokens, positions, outputs, seq_ids)
        self._run_and_record([(seq, part) for seq, part, _ in parts])
        rows, views, first = self._logits_view(n_rows), [], 0
        for seq, part, n_logits in parts:
            views.append(rows[first : first + n_logits])
            first += n_logits
        return views

    # -- hidden states, for drafting heads (backend/hidden.py) -------------------

    def output_hidden_states(self, on: bool) -> None:
        """Have the next passes return, for every token, its final-normed hidden state beside its logits
        (llama.cpp's embeddings output: every token of a pass becomes an output row)."""
        llama_cpp.llama_set_embeddings(self._ctx, on)

    def hidden_view(self, n_rows: int, n_embd: int) -> np.ndarray:
        """The hidden states of the last pass's n_rows output rows, in batch order: a view, valid until the next pass."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(self._ctx), shape=(n_rows, n_embd))

    @property
    def pools_hidden_states(self) -> bool:
        """Whether llama.cpp would pool the hidden states (an embedding model) instead of returning one per token."""
        return llama_cpp.llama_pooling_type(self._ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE

    def _logits_view(self, n_rows: int) -> np.ndarray:
        # outputs are stored contiguously in batch order
        ptr = llama_cpp.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
        rows.flags.writeable = False
        return rows
