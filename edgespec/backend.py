"""The only module that talks to llama-cpp-python.

It drives llama.cpp through its low-level C API (``llama_batch`` +
``llama_decode`` + ``llama_get_logits``), which is both faster than the
high-level ``Llama.eval`` and lets us ask for the logits of just the rows we
verify: nothing here ever allocates an n_ctx x n_vocab logits buffer.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from .errors import ContextOverflowError, ModelFileError, ModelLoadError
from .limits import checked_threads, usable_cores
from .sampling import SamplingParams

# The most logits rows one decode may return.  llama.cpp sizes its output
# buffer and compute graph for n_outputs_max (n_batch by default: 512 rows x
# 152k vocab x 4 bytes = 311 MB for Qwen); we only ever verify k+1 rows.
MAX_OUTPUT_ROWS = 64

# Token kinds llama.cpp's tokenizer splits text at; the control ones only with parse_special.
_CONTROL_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
_SPECIAL_ATTRS = _CONTROL_ATTRS | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
_C_WHITESPACE = " \t\n\v\f\r"  # C's isspace(), which llama.cpp strips with

# Tokens per physical pass during prefill.  Without flash attention the
# attention scores of one layer take n_ubatch x n_ctx x n_head floats, so a
# smaller ubatch keeps long contexts affordable; verification passes (at most
# MAX_DRAFT_TOKENS + 1 wide) always fit in one.
N_UBATCH = 128

_recent_log_lines: deque[str] = deque(maxlen=20)


@llama_cpp.llama_log_callback
def _capture_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp talks a lot on stderr; keep its last lines to explain a failed load instead.
    line = text.decode("utf-8", errors="replace").strip()
    if line:
        _recent_log_lines.append(line)


llama_cpp.llama_log_set(_capture_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()
_SYSTEM_INFO: bytes = llama_cpp.llama_print_system_info()
_EXTRA_BUFFER_TYPES_SAFE = b"AMX_INT8 = 1" not in _SYSTEM_INFO


# What a calibrated cost curve depends on besides the model and the machine.
RUNTIME = f"llama-cpp-python {llama_cpp.__version__}"


def width_independent_kernels() -> bool:
    """False when llama.cpp was built with llamafile's tinyBLAS kernels.

    Those take over matrix products of two or more tokens but not of one, and
    round differently, so a token's logits would depend on how many tokens
    share its forward pass.  `make` builds llama-cpp-python with
    -DGGML_LLAMAFILE=OFF for that reason.
    """
    return b"LLAMAFILE = 1" not in _SYSTEM_INFO


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def default_threads() -> int:
    return min(usable_cores(), 8)


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


@dataclass(frozen=True)
class PassProbe:
    """What probe_pass_widths found."""

    exact_width: int  # every pass up to this many tokens gives one-token passes' logits bit for bit
    drift: dict[int, float]  # per checked width: the largest |logit difference| from one-token passes


class LlamaModel:
    """A loaded GGUF model with one context (one sequence) and its KV cache.

    ``cached`` always lists the tokens whose keys and values sit in the KV
    cache, at positions 0..len(cached)-1.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
    ):
        self.n_threads = default_threads() if n_threads is None else checked_threads(n_threads)
        self.path = Path(path)
        self._check_file()
        self._model = self._load_model(n_gpu_layers)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._ctx = self._create_context(n_ctx, n_batch, self.n_threads)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        self.n_gpu_layers = n_gpu_layers
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = self._init_batch(n_batch)
        self._pieces: dict[int, bytes] = {}
        self.cached: list[int] = []
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
        # tokens per pass, which narrows the exact verification width (see
        # exact_pass_width: 3 with them, 7 without, on Qwen2.5-Coder-1.5B
        # Q4_K_M).  Faster plain steps win on this CPU either way.  Their AMX
        # variant segfaults on some Xeons, so `make` compiles AMX out; with an
        # AMX build they stay off.
        params.use_extra_bufts = _EXTRA_BUFFER_TYPES_SAFE
        _recent_log_lines.clear()
        model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: {_last_error()} (the file may be truncated or of an unsupported architecture)"
            )
        return model

    def _create_context(self, n_ctx: int, n_batch: int, n_threads: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, N_UBATCH)
        params.n_seq_max = 1
        params.n_outputs_max = MAX_OUTPUT_ROWS
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # Flash attention tiles its reductions by the number of tokens in the
        # pass, so a verified row would differ from the same row decoded alone.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            llama_cpp.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create a {n_ctx}-token context for {self.path}: {_last_error()} (try a smaller --n-ctx)"
            )
        return ctx

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = None

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
            return self._tokenize(text, add_special, parse_special)
        ids = [self.bos_id] if add_special and self.add_bos else []
        for piece in self._split_at_special_tokens(text, [(a, b) for a, b in plain_spans if a < b]):
            ids += [piece] if isinstance(piece, int) else self._tokenize(text[piece[0] : piece[1]], False, False)
        if add_special and llama_cpp.llama_vocab_get_add_eos(self._vocab):
            ids.append(self.eos_id)
        return ids

    def _split_at_special_tokens(self, text: str, plain_spans: list[tuple[int, int]]) -> list:
        """llama.cpp's partition of text into special token ids and (start, end) ranges of text.

        The longest special tokens go first, each splitting every range still
        text at its occurrences; a control token overlapping a plain span stays
        text.  User-defined tokens split everywhere, as llama.cpp does with
        parse_special off.
        """
        pieces: list = [(0, len(text))]
        for special in self._special_tokens:
            if special[1] in text:
                pieces = [part for piece in pieces for part in
                          ([piece] if isinstance(piece, int) else _split_range(text, *piece, special, plain_spans))]
        return pieces

    @functools.cached_property
    def _special_tokens(self) -> list[tuple[int, str, int]]:
        """(id, text, attributes) of every token llama.cpp splits text at, longest text first."""
        found = []
        for token in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, token)
            if attr & _SPECIAL_ATTRS and self.token_text(token):
                found.append((token, self.token_text(token).decode("utf-8", "replace"), attr))
        found.sort(key=lambda special: -len(special[1].encode("utf-8")))  # as llama.cpp orders them
        return found

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for (special tokens render as empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def token_text(self, token: int) -> bytes:
        """The token's entry in the vocabulary, as stored (for comparing vocabularies)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos_id(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos_id(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

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

    def rewind(self, n_keep: int) -> None:
        """Forget every cached position from n_keep on."""
        if n_keep < len(self.cached):
            llama_cpp.llama_memory_seq_rm(self._memory, 0, n_keep, -1)
            del self.cached[n_keep:]

    def _init_batch(self, n_batch: int):
        """The one llama_batch every pass reuses, with numpy views on its token, position and output-flag arrays."""
        batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        for i in range(n_batch):  # every token belongs to sequence 0, always
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
        self._batch_positions = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
        self._batch_outputs = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
        return batch

    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True) -> np.ndarray | None:
        """Append tokens to the cache; return the logits of the last n_logits of them.

        The result has shape (n_logits, n_vocab) and row i predicts the token
        after tokens[len(tokens) - n_logits + i].  Long inputs go in chunks of
        n_batch.  With copy=False the rows are a read-only view of llama.cpp's
        output buffer, valid until this model's next decode: a verifier that
        reads one row of four need not copy the other three (600 KB each at a
        152k vocabulary).
        """
        if not tokens:
            return None
        if len(self.cached) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.cached) + len(tokens)} tokens do not fit in the {self.n_ctx}-token context (raise --n-ctx or shorten the input)"
            )
        if n_logits > min(MAX_OUTPUT_ROWS, self.n_batch) or n_logits > len(tokens):
            raise ValueError(f"cannot return {n_logits} logits rows for {len(tokens)} tokens")
        first_row = len(tokens) - n_logits
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            wanted = max(0, start + len(chunk) - max(first_row, start))
            self._decode_chunk(chunk, wanted)
            if wanted:
                rows.append(self._logits_view(wanted))
        if not rows:
            return None
        if len(rows) == 1:
            return rows[0].copy() if copy else rows[0]
        return np.concatenate(rows)  # rows from several chunks: one copy of them all

    def _decode_chunk(self, chunk: Sequence[int], n_logits: int) -> None:
        n = len(chunk)
        pos0 = len(self.cached)
        self._batch_tokens[:n] = chunk
        self._batch_positions[:n] = np.arange(pos0, pos0 + n)
        self._batch_outputs[: n - n_logits] = 0
        self._batch_outputs[n - n_logits : n] = 1
        self._batch.n_tokens = n
        started = time.perf_counter_ns()
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        self.decode_ns += time.perf_counter_ns() - started
        if status != 0:
            raise ModelLoadError(f"llama_decode failed with status {status} on {self.path.name}: {_last_error()}")
        self.cached.extend(chunk)
        self.forward_passes += 1

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


def _split_range(text: str, base: int, end: int, special: tuple[int, str, int], plain_spans) -> list:
    """text[base:end] split at one special token's occurrences, as llama.cpp's tokenizer does."""
    token, spelling, attr = special
    controls = attr & _CONTROL_ATTRS
    pieces: list = []
    match = text.find(spelling, base, end)
    while match >= 0:
        stop = match + len(spelling)
        if controls and any(a < stop and match < b for a, b in plain_spans):
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


def _since(start: float) -> float:
    return time.perf_counter() - start


def _last_error() -> str:
    for line in reversed(_recent_log_lines):
        if "error" in line.lower() or "failed" in line.lower():
            return line
    return _recent_log_lines[-1] if _recent_log_lines else "no details from llama.cpp"


# -- the bench's peer ---------------------------------------------------------------
#
# llama-cpp-python's own prompt-lookup speculative decoding,
# Llama(draft_model=LlamaPromptLookupDecoding(...)) driven through its own
# create_completion(stream=True), with nothing of edgespec in the loop.  It
# lives here because this is the one module that touches llama-cpp-python.
#
# llama-cpp-python 0.3.36 forces logits for every position once a draft model
# is set, but sizes its logits buffer (Llama.scores) by the constructor's
# logits_all flag: n_ctx rows if it is True, else only n_batch rows.  Any
# sequence longer than n_batch then dies with "could not broadcast input
# array"; raising n_batch to the prompt length is not enough, because the
# buffer is indexed by absolute position.  So the peer is built with
# logits_all=True (PEER_WORKAROUND), which costs an n_ctx x n_vocab float32
# buffer and computes nothing the library was not computing already.

PEER_WORKAROUND = (
    "llama-cpp-python 0.3.36 peer built with logits_all=True: with a draft_model it sizes its logits "
    "buffer to n_batch rows unless logits_all=True and crashes once prompt+generation passes n_batch "
    "(n_batch >= prompt length is not enough); the peer only, edgespec itself is unaffected. The peer "
    "runs the same llama.cpp build and CPU kernels as edgespec"
)


@dataclass(frozen=True)
class PeerResult:
    text: str
    tokens_generated: int
    finish_reason: str
    prefill_seconds: float  # time to the first streamed chunk
    decode_seconds: float  # from the first chunk to the end of the stream


class PromptLookupPeer:
    """One loaded ``llama_cpp.Llama`` with prompt-lookup drafting, reused across runs."""

    def __init__(
        self, model_path: str | Path, *, n_ctx: int, n_threads: int, n_gpu_layers: int = 0, n_batch: int = 512,
        num_pred_tokens: int = 4,
    ):
        try:
            with _same_cpu_kernels_as_the_backend():
                self._llm = llama_cpp.Llama(
                    model_path=str(model_path),
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_threads=n_threads,
                    n_threads_batch=n_threads,
                    n_gpu_layers=n_gpu_layers,
                    logits_all=True,  # PEER_WORKAROUND
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                    verbose=False,
                )
        except ValueError as err:  # llama-cpp-python reports a failed load as ValueError
            raise ModelLoadError(f"llama-cpp-python could not load {model_path} for the peer: {err} (run the bench without the peer config)") from err

    def set_draft_tokens(self, num_pred_tokens: int) -> None:
        self._llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> PeerResult:
        """Generate after prompt_ids with a cold KV cache, so every run pays its full prefill."""
        self._llm.reset()
        start = time.perf_counter()
        chunks = self._llm.create_completion(
            list(prompt_ids),
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repeat_penalty=1.0,
            seed=params.seed,
            stop=list(params.stop),
            stream=True,
        )
        first_chunk_at = None
        pieces: list[str] = []
        content_chunks = 0
        finish_reason = "length"
        for chunk in chunks:
            choice = chunk["choices"][0]
            if choice["text"]:
                if first_chunk_at is None:
                    first_chunk_at = time.perf_counter()
                pieces.append(choice["text"])
                content_chunks += 1
            if choice["finish_reason"] is not None:
                finish_reason = choice["finish_reason"]
        end = time.perf_counter()
        first_chunk_at = first_chunk_at or end
        # The stream yields one chunk per token, except that tokens forming one
        # UTF-8 character share a chunk; a "length" finish is exactly max_tokens.
        room = self._llm.n_ctx() - len(prompt_ids)
        tokens = min(params.max_tokens, room) if finish_reason == "length" else content_chunks
        return PeerResult("".join(pieces), tokens, finish_reason, first_chunk_at - start, end - first_chunk_at)

    def close(self) -> None:
        self._llm.close()


@contextmanager
def _same_cpu_kernels_as_the_backend():
    # Llama() has no flag for the extra buffer types, so set the default it reads
    # (it calls the C API module's function, not the package's re-export)
    api = llama_cpp.llama_cpp
    original = api.llama_model_default_params

    def defaults_like_the_backend():
        params = original()
        params.use_extra_bufts = _EXTRA_BUFFER_TYPES_SAFE
        return params

    api.llama_model_default_params = defaults_like_the_backend
    try:
        yield
    finally:
        api.llama_model_default_params = original
