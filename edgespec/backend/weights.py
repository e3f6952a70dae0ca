"""A GGUF model's weights and metadata, loaded by llama.cpp (llama_model)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp

from ..errors import ModelFileError, ModelLoadError
from .runtime import EXTRA_BUFFER_TYPES_SAFE, forget_log, last_error, raise_kept_interrupt


class Weights:
    """The loaded weights of one GGUF file: what contexts are made from, and its metadata."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0):
        self.path = Path(path)
        self.n_gpu_layers = n_gpu_layers
        self._check_file()
        self.handle = self._load(n_gpu_layers)  # the llama_model pointer, for the context and the vocabulary

    def _check_file(self) -> None:
        if not self.path.is_file():
            raise ModelFileError(f"model file not found: {self.path} (check the path, or pull it with `edgespec models pull`)")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"not a GGUF file: {self.path} (edgespec loads llama.cpp GGUF models only)")

    def _load(self, n_gpu_layers: int):
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
        # the file system's own bytes: a name that is not UTF-8 (Latin-1 on an old disk) is valid here too
        model = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        raise_kept_interrupt(model, llama_cpp.llama_model_free)  # a Ctrl+C while it loaded
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: {last_error()} (the file may be truncated or of an unsupported architecture)"
            )
        return model

    def metadata(self, key: str) -> str | None:
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    def free(self) -> None:
        # The handle is let go of before the call: a Ctrl+C raised as the call returns must not leave it
        # set for close() or __del__ to free again, a double free that aborts the process.
        handle, self.handle = self.handle, None
        if handle:
            llama_cpp.llama_model_free(handle)
