"""The target's final-normed hidden state beside its logits, for drafting heads (llama.cpp's embeddings output).

A context made with pooling NONE and ``llama_set_embeddings(ctx, true)``
returns, for every output row of one ``llama_decode``, both the logits and
the hidden state the lm_head turned into them (``llama_get_embeddings``).
llama.cpp then outputs every token of a batch, whatever its flags say, so
the embeddings output is switched on only for passes that want every row
anyway (verification and teacher passes) and off for a prompt's prefill,
whose rows nobody reads.  The drafting also switches it off for a sequence
while heads will not draft from its next rows (`want_hidden`): then its
passes cost what a plain model's do.  A model without heads is a plain
LlamaModel: nothing here runs for it.

With a usage sink set, the hidden states of rows that verification kept
(their tokens stayed in the cache) are handed to it, with the tokens that
followed them, once those are known: training data for heads that costs no
teacher pass (heads.usage).
"""

from __future__ import annotations

from dataclasses import dataclass
import time
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
        if fresh:
            self._hand_over_kept()  # while the caches still hold the tokens that followed
        super().reserve_sequences(n_seq)
        if fresh:
            self._fresh_context()

    usage_sink = None  # called with (tokens, hidden after each but the last) of kept rows; flush() at close
    usage_seconds = 0.0  # spent keeping them (benchmarks/heads_usage_cost.py)

    def _fresh_context(self) -> None:
        self._hidden_output = False  # llama.cpp's default for a new context
        self._last_pass: dict[int, HiddenPass] = {}
        self._kept: dict[int, _KeptRows] = {}
        self._seqs_heads_draft_for: set[int] = set()  # sequences heads draft for (hidden_before asked), whose rows are kept
        self._seqs_without_hidden: set[int] = set()  # sequences whose passes return no hidden states (want_hidden)
        if self.context.pools_hidden_states:
            self.close()
            raise ModelLoadError(f"{self.path.name} pools its hidden states (an embedding model?): "
                                 "drafting heads need a generative model's per-token states")

    def _output_hidden(self, on: bool) -> None:
        if on != self._hidden_output:
            self.context.output_hidden_states(on)
            self._hidden_output = on

    def want_hidden(self, seq: int, wanted: bool) -> None:
        """Whether the sequence's next every-row passes return their hidden states (yes until told otherwise)."""
        if wanted:
            self._seqs_without_hidden.discard(seq)
        else:
            self._seqs_without_hidden.add(seq)

    def decode(self, tokens: Sequence[int], n_logits: int = 1, *, copy: bool = True, seq: int = 0):
        every_row = 0 < len(tokens) == n_logits and seq not in self._seqs_without_hidden
        self._keep_rows(seq, len(self.cached_of(seq)))
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
        every_row = (all(0 < len(part) == n_logits for _, part, n_logits in parts)
                     and any(seq not in self._seqs_without_hidden for seq, _, _ in parts))
        for seq, _, _ in parts:
            self._keep_rows(seq, len(self.cached_of(seq)))
        self._output_hidden(every_row)
        firsts = [len(self.cached_of(seq)) for seq, _, _ in parts]
        views = super().decode_sequences(parts)
        if every_row:
            rows = self.context.hidden_view(sum(len(part) for _, part, _ in parts), self.n_embd)
            offset = 0
            for (seq, part, _), first in zip(parts, firsts):
                if seq in self._seqs_without_hidden:
                    self._last_pass.pop(seq, None)
                else:
                    self._last_pass[seq] = HiddenPass(first, tuple(part), rows[offset:offset + len(part)].copy())
                offset += len(part)
        else:
            for seq, _, _ in parts:
                self._last_pass.pop(seq, None)
        return views

    def rewind(self, n_keep: int, seq: int = 0) -> None:
        self._keep_rows(seq, n_keep)
        self._stop_keeping(seq, below=n_keep)
        kept = self._last_pass.get(seq)
        if kept is not None and n_keep <= kept.first:
            del self._last_pass[seq]
        super().rewind(n_keep, seq)

    def copy_sequence(self, source: int, dest: int, n_keep: int) -> None:
        self._stop_keeping(dest)
        self._last_pass.pop(dest, None)
        super().copy_sequence(source, dest, n_keep)

    def load_state(self, data, tokens: Sequence[int], seq: int = 0) -> bool:
        self._stop_keeping(seq)
        self._last_pass.pop(seq, None)
        return super().load_state(data, tokens, seq)

    def drop_span(self, start: int, end: int, seq: int = 0) -> None:
        self._stop_keeping(seq)
        self._last_pass.pop(seq, None)  # the positions it kept have moved
        super().drop_span(start, end, seq)

    def close(self) -> None:
        if getattr(self, "_kept", None) and self.context is not None:
            self._hand_over_kept()
        if self.usage_sink is not None:
            self.usage_sink.flush()
            self.usage_sink = None
        super().close()

    def _keep_rows(self, seq: int, n_kept: int) -> None:
        """Note the rows of the sequence's last every-row pass whose tokens are still the first n_kept cached."""
        last = self._last_pass.get(seq)
        if self.usage_sink is None or last is None or seq not in self._seqs_heads_draft_for:
            return
        started = time.perf_counter()
        kept = self._kept.get(seq)
        if kept is not None and kept.end < last.first:  # a pass without hidden states came between
            self._hand_over_kept(seq)
            kept = None
        if kept is None:
            kept = self._kept[seq] = _KeptRows(last.first)
        kept.extend(last, min(n_kept, last.first + len(last.tokens)))
        self.usage_seconds += time.perf_counter() - started

    def _stop_keeping(self, seq: int, below: int = 0) -> None:
        """The cache goes back below the kept rows' end, or holds something else now: hand them over, and
        keep rows again once heads draft for this sequence again (not for a probe's passes)."""
        kept = self._kept.get(seq)
        if kept is None or below < kept.end:
            self._hand_over_kept(seq, below)
            self._seqs_heads_draft_for.discard(seq)

    def _hand_over_kept(self, seq: int | None = None, below: int = 0) -> None:
        """Give the sink the kept rows of seq (every sequence when None) whose following tokens are about to
        go (a rewind below them, another prompt or context): (tokens, hidden), a token more than rows."""
        if self.usage_sink is None or not getattr(self, "_kept", None):
            return
        started = time.perf_counter()
        for s in [seq] if seq is not None else list(self._kept):
            kept = self._kept.get(s)
            if kept is not None and below < kept.end:  # a rewind to kept.end drops only what was not kept
                del self._kept[s]
                kept.hand_over(self.cached_of(s), self.usage_sink)
        self.usage_seconds += time.perf_counter() - started

    def hidden_before(self, context: Sequence[int], seq: int = 0) -> np.ndarray | None:
        """The hidden state that predicted context[-1] (at position len(context) - 2), when the sequence's
        last every-row pass computed it on these very tokens; else None.  Asking marks the sequence as one
        heads draft for, whose kept rows go to the usage sink."""
        self._seqs_heads_draft_for.add(seq)
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
        self.want_hidden(seq, True)
        width = min(MAX_OUTPUT_ROWS, self.n_batch)
        hidden = np.empty((len(tokens), self.n_embd), dtype=np.float16)
        top = np.empty(len(tokens), dtype=np.int32)
        for start in range(0, len(tokens), width):
            chunk = list(tokens[start:start + width])
            logits = self.decode(chunk, len(chunk), copy=False, seq=seq)
            top[start:start + len(chunk)] = logits.argmax(axis=1)
            hidden[start:start + len(chunk)] = self._last_pass[seq].rows
        return hidden, top


class _KeptRows:
    """Hidden states of consecutive cache positions whose tokens verification kept, first to end (exclusive)."""

    def __init__(self, first: int):
        self.first = self.end = first
        self.rows: list[np.ndarray] = []

    def extend(self, last: HiddenPass, upto: int) -> None:
        start = max(self.end, last.first)
        if upto > start:
            self.rows.append(last.rows[start - last.first:upto - last.first].astype(np.float16))
            self.end = upto

    def hand_over(self, cached: list[int], sink) -> None:
        """(tokens at first..end-1, their hidden states) to sink, as far as the token after each is cached."""
        end = min(self.end, len(cached) - 1)
        if end - self.first >= 2:
            sink(list(cached[self.first:end + 1]), np.concatenate(self.rows)[:end - self.first])
