"""The bench's peer: llama-cpp-python's own prompt-lookup speculative decoding.

Llama(draft_model=LlamaPromptLookupDecoding(...)) driven through its own
create_completion(stream=True), with nothing of edgespec in the loop.

llama-cpp-python 0.3.36 forces logits for every position once a draft model
is set, but sizes its logits buffer (Llama.scores) by the constructor's
logits_all flag: n_ctx rows if it is True, else only n_batch rows.  Any
sequence longer than n_batch then dies with "could not broadcast input
array"; raising n_batch to the prompt length is not enough, because the
buffer is indexed by absolute position.  So the peer is built with
logits_all=True (PEER_WORKAROUND), which costs an n_ctx x n_vocab float32
buffer and computes nothing the library was not computing already.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ..errors import ModelLoadError
from ..sampling import SamplingParams
from .runtime import EXTRA_BUFFER_TYPES_SAFE

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
        params.use_extra_bufts = EXTRA_BUFFER_TYPES_SAFE
        return params

    api.llama_model_default_params = defaults_like_the_backend
    try:
        yield
    finally:
        api.llama_model_default_params = original
