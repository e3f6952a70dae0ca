"""The target's lm_head, read from its GGUF file row by row and dequantized with the gguf package.

llama.cpp's lm_head is ``output.weight`` (Q6_K in Qwen2.5's files); a model
that ties it to its input embeddings has only ``token_embd.weight``.  Heads
read it out for the rows of their reduced vocabulary (their frozen
projection) and for single tokens (what a Hydra-style head sees of the token
chosen before it).  The file is memory-mapped: only the rows read are paged in.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from ..errors import ModelFileError
from ..gguf_info import read_tensor_locations

LM_HEAD_NAMES = ("output.weight", "token_embd.weight")  # the second when the model ties them


class LmHead:
    """Rows of one model's lm_head (one row per token, n_embd long), as float32."""

    def __init__(self, model_path: str | os.PathLike):
        path = Path(model_path)
        tensors = read_tensor_locations(path)
        name = next((n for n in LM_HEAD_NAMES if n in tensors), None)
        if name is None:
            raise ModelFileError(f"{path.name} has neither output.weight nor token_embd.weight, so heads cannot "
                                 "read its lm_head (pick a llama.cpp generative model)")
        where = tensors[name]
        self.tensor_name = name
        self.n_embd, self.n_vocab = where.dims[0], int(np.prod(where.dims[1:]))
        self._type = where.quant_type
        block, size = GGML_QUANT_SIZES[where.quant_type]
        row_bytes = self.n_embd // block * size
        self._raw = np.memmap(path, dtype=np.uint8, mode="r", offset=where.offset, shape=(self.n_vocab, row_bytes))
        self.row = lru_cache(maxsize=4096)(self._one_row)

    def rows(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of tokens, (len(tokens), n_embd) float32, dequantized in slices to bound memory."""
        tokens = np.asarray(tokens, dtype=np.int64)
        out = np.empty((len(tokens), self.n_embd), dtype=np.float32)
        for start in range(0, len(tokens), 2048):
            part = tokens[start:start + 2048]
            out[start:start + len(part)] = dequantize(np.asarray(self._raw[part]), self._type).reshape(len(part), -1)
        return out

    def _one_row(self, token: int) -> np.ndarray:
        return self.rows([token])[0]
