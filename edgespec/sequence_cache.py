"""A model context's sequences: filling one for a new prompt with as little evaluation as possible.

A new prompt's prefill evaluates only what no cache holds already:

- what its own sequence shares with it (the previous turn of a chat);
- a longer prefix another sequence of the context holds, whose cells it then
  shares (llama.cpp's unified KV buffer: nothing is copied);
- a kept KV snapshot of a long prompt (the prompt cache), restored when it
  shares clearly more;
- a chat that dropped its oldest turn: the turn is shifted out of the cache,
  as llama.cpp's context shift does, when the caller allows it.

What is left is evaluated at once (prefill), or, for sequences decoded
together, fed in chunks inside the passes that decode the others
(prompt_chunks): a prompt that another prompt still being fed shares a long
prefix with waits for that prefix's cells, then shares them.

When a sequence's generation ends, its cache is offered to the prompt cache,
which keeps what pays.  The target and the draft model each have one.

Each sequence is claimed for a scope, whose prompts alone it shares cells and
snapshots with: "" for the user's own, a server client's id for that client's
(how much of a prompt is found cached, or how soon it is answered, would
tell one client what another sent).
"""

from __future__ import annotations

import threading
from typing import Sequence

from .backend import RUNTIME, LlamaModel, common_prefix_length, dropped_span
from .prefix_cache import PrefixStore, SnapshotKey

# Restoring a snapshot reads and checks its whole file; for a handful of tokens prefill is cheaper.
MIN_RESTORE_GAIN = 32
# A prompt that shares at least this many more tokens with another sequence's cache than with its
# own shares that sequence's cells (free in llama.cpp's unified KV buffer) instead of evaluating them.
MIN_COPIED_PREFIX = 16


class SequenceCache:
    """The KV caches of one model context's sequences, and the prompt-cache stores they restore from."""

    def __init__(self, model: LlamaModel, stores: list[PrefixStore]):
        self.model = model
        self.stores = stores  # shared by the target's and the draft's caches; the engine's owner adds to it
        self._shifted_at: int | None = None  # where sequence 0's cache holds shifted keys and values
        self._scopes: dict[int, str] = {}  # whose prompts each sequence's cache holds, "" where unclaimed

    def claim(self, seq: int, scope: str) -> None:
        """Give sequence seq to scope's prompts; a cache holding another scope's is emptied first."""
        if self._scopes.get(seq, "") != scope:
            self.model.rewind(0, seq)
            if seq == 0:
                self._shifted_at = None
            self._scopes[seq] = scope

    def _same_scope(self, seq: int, other: int) -> bool:
        return self._scopes.get(seq, "") == self._scopes.get(other, "")

    def prefill(self, context: list[int], seq: int = 0, shift: bool = False,
                stop: threading.Event | None = None) -> int:
        """Put all but the last token of context in sequence seq's cache; return how many it held already.

        shift: sequence 0 may have a dropped span shifted out (see shift_out_dropped_span).  stop: once set, the
        prefill ends after the chunk of n_batch tokens it is in, the cache holding a prefix of the prompt: a long
        prompt's prefill takes seconds (13 s for 9,000 characters on SmolLM2 with one thread), and an Esc in
        them waited for all of it.
        """
        reused = self.prepare(context, seq, shift)
        todo, n_batch = context[reused:-1], self.model.n_batch
        for start in range(0, len(todo), n_batch):
            if stop is not None and stop.is_set():
                break
            self.model.decode(todo[start:start + n_batch], n_logits=0, seq=seq)
        return reused

    def prepare(self, context: list[int], seq: int = 0, shift: bool = False) -> int:
        """Leave in sequence seq's cache the longest prefix of context[:-1] that needs no evaluation
        (a snapshot restored when it pays); return its length."""
        if shift:
            self.shift_out_dropped_span(context)
        reused = self.restore_prefix(context, seq)
        self.model.rewind(reused, seq)
        return reused

    def place(self, ids: Sequence[int], free: Sequence[int], scope: str = "") -> int:
        """The free sequence whose cache, of scope's prompts, shares the longest prefix with ids; on a tie the one
        whose cache loses the fewest tokens (an empty one first), then the lowest.  A prompt that shares nothing
        took the lowest, and emptied a conversation's history while another sequence stood empty; another
        scope's cache is taken last."""
        def rank(seq: int) -> tuple[int, int, int]:
            cached = self.model.cached_of(seq)
            if cached and self._scopes.get(seq, "") != scope:
                return -1, -len(cached), -seq
            shared = common_prefix_length(cached, ids)
            return shared, shared - len(cached), -seq
        return max(free, key=rank)

    def share_prefix(self, ids: list[int], seq: int, among: int) -> int:
        """Leave in sequence seq's cache the longest prefix of ids that any of the first `among` sequences of its
        scope holds (shared from it if that pays); return its length, at most len(ids) - 1 (the last token is
        evaluated by the first step)."""
        model = self.model
        shared = {other: common_prefix_length(model.cached_of(other), ids)
                  for other in range(among) if self._same_scope(seq, other)}
        best = max(shared, key=lambda other: (shared[other], other == seq))
        keep = min(shared[seq], len(ids) - 1)
        if shared[best] - shared[seq] >= MIN_COPIED_PREFIX:
            keep = min(shared[best], len(ids) - 1)
            model.copy_sequence(best, seq, keep)
        model.rewind(keep, seq)
        return keep

    def prompt_chunks(self, prompts: Sequence[tuple[int, list[int]]], budget: int) -> dict[int, list[int]]:
        """The next chunk of each prompt still being fed, by sequence: budget tokens in all, given out in the
        order prompts lists them, (seq, context) each, the cache holding a prefix of context[:-1].

        A prompt first takes what another sequence has cached of it meanwhile
        (share_prefix), and may need no chunk after that; one that shares MIN_COPIED_PREFIX more tokens with an
        earlier prompt than it holds, while that one is still computing them,
        gets no chunk until it can take them from there.
        """
        chunks: dict[int, list[int]] = {}
        for i, (seq, context) in enumerate(prompts):
            if budget <= 0:
                break
            if any(self._computing_prefix_of(context, seq, *earlier) for earlier in prompts[:i]):
                continue
            held = self.share_prefix(context, seq, among=self.model.n_seq)
            chunks[seq] = context[held : min(len(context) - 1, held + budget)]  # [] when it got all it needs
            budget -= len(chunks[seq])
        return chunks

    def _computing_prefix_of(self, context: list[int], seq: int, other_seq: int, other: list[int]) -> bool:
        """Whether sequence other_seq, being fed prompt other, has yet to compute a prefix it shares with
        context that is worth sharing with sequence seq."""
        if not self._same_scope(seq, other_seq):
            return False  # its cells are not this prompt's to share
        common = common_prefix_length(other[:-1], context[:-1])
        return (common - len(self.model.cached_of(seq)) >= MIN_COPIED_PREFIX
                and len(self.model.cached_of(other_seq)) < common)

    def restore_prefix(self, context: list[int], seq: int = 0) -> int:
        """How many leading tokens of context[:-1] sequence seq's cache holds, after restoring a kept
        snapshot when one shares clearly more of them than the cache does now."""
        model = self.model
        reused = min(common_prefix_length(model.cached_of(seq), context), len(context) - 1)
        if seq == 0 and self._shifted_at is not None and self._shifted_at >= reused:
            self._shifted_at = None  # the shifted part is rewound: what follows is computed afresh
        if not self.stores:
            return reused
        key = snapshot_key(model, self._scopes.get(seq, ""))
        found = [(snapshot, store) for store in self.stores
                 if (snapshot := store.longest_prefix(key, context[:-1], model.n_ctx)) is not None]
        if not found:
            return reused
        snapshot, store = max(found, key=lambda pair: pair[0].n_common)
        if snapshot.n_common < reused + MIN_RESTORE_GAIN:
            return reused
        data = store.read(key, snapshot)
        if data is None:
            return reused
        if seq == 0:
            self._shifted_at = None  # the cache is replaced, or emptied if refused
        if not model.load_state(data, snapshot.tokens, seq):
            store.discard(snapshot, "llama.cpp refused its state")
            return 0
        model.rewind(snapshot.n_common, seq)
        return snapshot.n_common

    def offer(self, seq: int = 0) -> None:
        """Offer sequence seq's KV cache, exactly the tokens in it, to the prefix stores; they keep what pays."""
        if not self.stores or (seq == 0 and self._shifted_at is not None):
            return  # shifted keys and values are not what a prefill computes: a restore must give its logits
        model, key = self.model, snapshot_key(self.model, self._scopes.get(seq, ""))
        for store in self.stores:
            store.save(key, model.cached_of(seq), lambda: model.state_bytes(seq))

    def shift_out_dropped_span(self, context: list[int]) -> None:
        """When context is sequence 0's cache with one span left out (a chat dropped its oldest turn), drop
        that span from the cache and move what follows back, as llama.cpp's context shift does, so the
        prefill computes only what is new.

        The moved keys and values still carry what they attended to in the
        dropped span, so this is not the cache a fresh prefill would compute,
        nor bit-identical to it: the decoder asks for it only when allowed.
        """
        model = self.model
        if model.can_shift:
            span = dropped_span(model.cached, context[:-1])
            if span is not None:
                model.drop_span(*span)
                self._shifted_at = span[0] if self._shifted_at is None else min(span[0], self._shifted_at)


def snapshot_key(model: LlamaModel, scope: str = "") -> SnapshotKey:
    """What a snapshot of model's KV cache, of scope's prompts, is valid for; its KV setup (K and V types, flash
    attention) by label."""
    return SnapshotKey.for_model(model, model.kv_cache_label or "f16", model.n_seq, RUNTIME, scope)
