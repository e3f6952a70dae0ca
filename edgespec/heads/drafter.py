"""The heads drafter: a few tokens guessed from the target's own hidden state, no second model.

Each verification pass leaves the hidden state of every row it scored in
the target (backend.hidden.HiddenStateModel).  The row that chose the
context's last token is the one heads draft from: head 1 guesses the token
after that one, head 2 the one after, and so on.  Proposals are points (no
q rows), verified like n-grams' (verify.accept_candidates), so output stays
exact.  The first step of a generation has no such row (the prompt's
prefill outputs none) and drafts nothing.

The heads' matrix products run on the cores llama.cpp's threads leave
free, and on one at least.  OpenBLAS's worker threads spin for a while
after each product, and llama.cpp's threads want their cores for the pass
that follows: on 2 cores, with BLAS on both, each heads step of
Qwen2.5-Coder-1.5B took 80 ms longer (177 ms against 100 ms for a 4-row
step), while one BLAS thread drafts three tokens in 5 ms.
"""

from __future__ import annotations

import time

import numpy as np
from threadpoolctl import ThreadpoolController

from ..drafters import NO_PROPOSAL, Hint, Proposal, up_to_an_end
from ..limits import usable_cores
from .network import Heads


class HeadsDrafter:
    name = "heads"
    forward_passes = 0  # the heads run in numpy, beside the target's passes

    def __init__(self, target, heads: Heads, token_row, seq: int = 0, heldout_top1: tuple[float, ...] = (),
                 blas: ThreadpoolController | None = None):
        self.target = target  # a HiddenStateModel
        self.heads = heads
        self._token_row = token_row  # token id -> its lm_head row (LmHead.row, cached)
        self.seq = seq
        self.heldout_top1 = heldout_top1  # the heads file's own figures, the controller's starting guess
        self._blas = blas or ThreadpoolController()  # finding the BLAS libraries takes ~2 ms: done once
        self._blas_threads = max(1, usable_cores() - target.n_threads)

    def for_sequence(self, seq: int) -> HeadsDrafter:
        """The same heads drafting for another sequence of the target's cache."""
        return HeadsDrafter(self.target, self.heads, self._token_row, seq, self.heldout_top1, self._blas)

    def _draft(self, hidden: np.ndarray, chosen: int, k: int, stop_below=()) -> list[int]:
        with self._blas.limit(limits=self._blas_threads, user_api="blas"):  # 11 us: see the module's docstring
            return self.heads.draft(hidden, chosen, k, self._token_row, stop_below)

    def want_rows(self, wanted: bool) -> None:
        """Whether the target's next pass of this sequence keeps the hidden states heads draft from."""
        self.target.want_hidden(self.seq, wanted)

    def peek(self, context: list[int]) -> Hint:
        ready = self.target.hidden_before(context, self.seq) is not None
        return Hint(0, self.heads.n_heads if ready else 0)

    def propose(self, context, k, params=None, rng=None, stop_below=()) -> Proposal:
        hidden = self.target.hidden_before(context, self.seq) if k > 0 else None
        if hidden is None:
            return NO_PROPOSAL
        return Proposal(up_to_an_end(self._draft(hidden, context[-1], k, stop_below), self.target.end_of_generation_ids))

    def seconds_per_token(self, repeats: int = 5) -> float:
        """What drafting one token costs here (one head, its token row included): the best of repeats."""
        hidden = np.zeros(self.heads.projection.shape[1], dtype=np.float32)
        best = float("inf")
        for i in range(repeats):
            started = time.perf_counter()
            self._draft(hidden, int(self.heads.vocab[i % len(self.heads.vocab)]), 1)
            best = min(best, time.perf_counter() - started)
        return best

    @property
    def acceptance_prior(self) -> float:
        """Head 1's held-out top-1 accuracy: how often a first drafted token should be accepted at T=0."""
        return self.heldout_top1[0] if self.heldout_top1 else 0.3

