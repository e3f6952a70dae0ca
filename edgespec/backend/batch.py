"""The llama_batch a context reuses for every pass, filled through numpy views on its arrays."""

from __future__ import annotations

from typing import Sequence

import numpy as np

import llama_cpp


class TokenBatch:
    """One llama_batch of up to `capacity` tokens, each in one sequence."""

    def __init__(self, capacity: int):
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        for i in range(capacity):
            self.raw.n_seq_id[i] = 1
            self.raw.seq_id[i][0] = 0
        self._tokens = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self._positions = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self._outputs = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self._seq_ids_set = 0  # leading tokens whose sequence id may not be 0

    def fill(self, tokens: Sequence[int], positions: Sequence[int], outputs: Sequence[int],
             seq: int | Sequence[int] = 0) -> None:
        """Put tokens at positions (outputs: 1 where logits are wanted) in sequence seq, or each in its own."""
        n = len(tokens)
        self._tokens[:n], self._positions[:n], self._outputs[:n] = tokens, positions, outputs
        if isinstance(seq, int):
            # The ids are written one by one through ctypes: skip that in the usual one-sequence case.
            if seq == 0 and not self._seq_ids_set:
                self.raw.n_tokens = n
                return
            seq = [seq] * n
        seq_ids = list(seq) + [0] * max(0, self._seq_ids_set - n)
        for i, s in enumerate(seq_ids):
            self.raw.seq_id[i][0] = s
        self._seq_ids_set = len(seq_ids) if any(seq_ids) else 0
        self.raw.n_tokens = n

    def free(self) -> None:
        # Once only, however often called (as Weights.free): a second llama_batch_free is a double free.
        raw, self.raw = self.raw, None
        if raw is not None:
            llama_cpp.llama_batch_free(raw)
