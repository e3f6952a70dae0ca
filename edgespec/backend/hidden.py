"""The target's final-normed hidden state beside its logits, for drafting heads (llama.cpp's embeddings output).

A context made with pooling NONE and ``llama_set_embeddings(ctx, true)``
returns, for every output row of one ``llama_decode``, both the logits and
the hidden state the lm_head turned into them (``llama_get_embeddings``).
llama.cpp then outputs every token of a batch, whatever its flags say, so
the embeddings output is switched on only for passes that want every row
anyway (verification and teacher passes) and off for a prompt's prefill,
whose rows nobody reads.  A model without heads is a plain LlamaModel:
nothing here runs for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

import llama_cpp

from ..errors import ModelLoadError
from ..limits import MAX_OUTPUT_ROWS
from .model import LlamaModel


@dataclass(frozen=True)
class HiddenPass:
    """The hidden states of one pass of one sequence: rows[i] is at position first + i, after tokens[i]."""

    first: int
    tokens: tuple[int, ...]
    rows: np.ndarray  # (len(tokens), n_embd) float32, a copy


class HiddenStateModel(LlamaModel):
    """A LlamaModel that keeps the hidden states of its every-row passes, per sequence.

    Every pass whose rows are all wanted (a verification pass, a teacher pass)
    also returns the final-normed hidden state of each row; the last such pass
    of each sequence is kept until a rewind or another pass makes it stale.
    """

    def __init__(self, path, **options):
        super().__init__(path, **options)
        self.n_embd = llama_cpp.llama_model_n_embd(self.weights.handle)
        self._fresh_context()

    def reserve_sequences(self, n_seq: int) -> None:
        fresh = n_seq != self.n_seq
        super().reserve_sequences(n_seq)
        if fresh:
            self._fresh_context()

    def _fresh_context(self) -> None:
        self._hidden_output = False  # llama.cpp's default for a new context
        self._last_pass: dict[int, HiddenPass] = {}
        if self.context.pools_hidden_states:
            self.close()
            raise ModelLoadError(f"{self.path.name} pools its hidden states (an embedding model?): "
                                 "drafting heads need a generative model's per-token states")

    def _output_hidden(self, on: bool) -> None:
        if on != self._hidden_output:
            self.context.output_hidden_states(on)
            self._hidden_output = on

    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True, seq: int = 0):
        every_row = 0 < len(tokens) == n_logits
        self._output_hidden(every_row)
        first = len(self.cached_of(seq))
        logits = super().decode(tokens, n_logits, copy=copy, seq=seq)
        if every_row:
            rows = self.context.hidden_view(len(tokens), self.n_embd).copy()
            self._last_pass[seq] = HiddenPass(first, tuple(tokens), rows)
        elif tokens:
            self._last_pass.pop(seq, None)
        return logits

    def decode_sequences(self, parts):
        every_row = all(0 < len(part) == n_logits for _, part, n_logits in parts)
        self._output_hidden(every_row)
        firsts = [len(self.cached_of(seq)) for seq, _, _ in parts]
        views = super().decode_sequences(parts)
        if every_row:
            rows = self.context.hidden_view(sum(len(part) for _, part, _ in parts), self.n_embd)
            offset = 0
            for (seq, part, _), first in zip(parts, firsts):
                self._last_pass[seq] = HiddenPass(first, tuple(part), rows[offset:offset + len(part)].copy())
                offset += len(part)
        else:
            for seq, _, _ in parts:
                self._last_pass.pop(seq, None)
        return views

    def rewind(self, n_keep: int, seq: int = 0) -> None:
        kept = self._last_pass.get(seq)
        if kept is not None and n_keep <= kept.first:
            del self._last_pass[seq]
        super().rewind(n_keep, seq)

    def copy_sequence(self, source: int, dest: int, n_keep: int) -> None:
        self._last_pass.pop(dest, None)
        super().copy_sequence(source, dest, n_keep)

    def load_state(self, data, tokens: Sequence[int], seq: int = 0) -> bool:
        self._last_pass.pop(seq, None)
        return super().load_state(data, tokens, seq)

    def drop_span(self, start: int, end: int, seq: int = 0) -> None:
        self._last_pass.pop(seq, None)  # the positions it kept have moved
        super().drop_span(start, end, seq)

    def hidden_before(self, context: Sequence[int], seq: int = 0) -> np.ndarray | None:
        """The hidden state that predicted context[-1] (at position len(context) - 2), when the sequence's
        last every-row pass computed it on these very tokens; else None."""
        kept = self._last_pass.get(seq)
        if kept is None:
            return None
        row = len(context) - 2 - kept.first
        if not 0 <= row < len(kept.tokens) or tuple(context[kept.first:kept.first + row + 1]) != kept.tokens[:row + 1]:
            return None
        return kept.rows[row]

    def last_hidden(self, seq: int = 0) -> np.ndarray | None:
        """The hidden states of the sequence's last every-row pass, one row per token, while they are current."""
        kept = self._last_pass.get(seq)
        return None if kept is None else kept.rows

    def teacher_pass(self, tokens: Sequence[int], seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Append tokens to the cache in every-row passes; return each token's hidden state (float16) and
        the target's top token after it (its argmax), for training heads.

        The passes are as wide as the output buffer allows (MAX_OUTPUT_ROWS):
        every row's logits are read once, for their argmax, and dropped.
        """
        width = min(MAX_OUTPUT_ROWS, self.n_batch)
        hidden = np.empty((len(tokens), self.n_embd), dtype=np.float16)
        top = np.empty(len(tokens), dtype=np.int32)
        for start in range(0, len(tokens), width):
            chunk = list(tokens[start:start + width])
            logits = self.decode(chunk, len(chunk), copy=False, seq=seq)
            top[start:start + len(chunk)] = logits.argmax(axis=1)
            hidden[start:start + len(chunk)] = self._last_pass[seq].rows
        return hidden, top
