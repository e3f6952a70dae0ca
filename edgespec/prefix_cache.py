"""Snapshots of a model's KV cache for a token prefix, so a prompt that starts the same is not prefilled again.

Prefill cannot be sped up by speculation, and on a small CPU a few thousand
tokens take a minute.  After a generation the engine offers each model's KV
cache (the tokens in it and llama.cpp's serialised state) to a store; before
the next prefill it asks the stores for the snapshot sharing the longest
prefix with the new prompt, restores it and rolls it back to that prefix.

Two stores: DiskPrefixCache (files in the cache dir, shared across processes,
LRU under a byte cap; edgespec.prefix_files) and MemoryPrefixCache (recent
states in RAM, for a server whose clients take turns).  Both keep the same
policy: nothing under min_tokens is kept, a snapshot is kept only if it
extends a kept one (which it then replaces) or holds min_tokens that no kept
one does and that are likely to be asked for again, and the cap holds before
anything is written.  In RAM any prompt is likely to come back soon; on disk
only a prefix that already came twice is (edgespec.prefix_sightings).

A snapshot is valid for a model's content (edgespec.model_identity), not its
path: a file replaced by another of the same size and mtime is another model.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from .backend import common_prefix_length
from .model_identity import loaded_model_identity
from .units import MiB

DEFAULT_MEMORY_MAX_BYTES = 512 * MiB
# Prefill of a few hundred tokens takes seconds at most; a snapshot of them is not worth its space.
DEFAULT_MIN_TOKENS = 256


def token_array(tokens: Sequence[int]) -> array:
    """Token ids as the stores keep and compare them: 4 bytes each (a tuple of ints takes about 40)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)


@dataclass(frozen=True)
class SnapshotKey:
    """What a KV snapshot is valid for: one model's content (edgespec.model_identity, whatever its path), one
    KV setup (its K and V types and flash attention, which lays the values out otherwise), one llama.cpp build,
    and contexts of one number of sequences (llama.cpp refuses a state from a context whose KV buffers are
    laid out otherwise, as one per sequence was; `batch --parallel` reserves several sequences).

    scope is whose prompts it holds: "" for the user's own, a server client's id for that client's.  A
    snapshot serves only prompts of its own scope, since how many tokens a prompt finds cached (or how soon
    it is answered) tells what another client sent."""

    model_identity: str
    kv_type: str
    n_seq: int
    runtime: str
    scope: str = ""  # a field added after the first snapshots: theirs are the user's own

    @classmethod
    def for_model(cls, model, kv_type: str, n_seq: int, runtime: str, scope: str = "") -> SnapshotKey:
        """The key for a loaded model (a LlamaModel): its file's identity as it was when first asked."""
        return cls(loaded_model_identity(model), kv_type, n_seq, runtime, scope)

    def same_model(self, other: SnapshotKey) -> bool:
        """Same model, KV type, sequence count and scope, whatever the build."""
        return ((self.model_identity, self.kv_type, self.n_seq, self.scope)
                == (other.model_identity, other.kv_type, other.n_seq, other.scope))


@dataclass(frozen=True)
class Snapshot:
    """A kept snapshot found for a prompt: its tokens, how many lead the prompt, and where it is kept."""

    tokens: array  # of int32 token ids
    n_common: int
    handle: object  # the store's own: a path, a RAM entry's id


class PrefixStore:
    """The policy both stores share; a subclass keeps the entries: _entries, _read, _write, _delete, _sizes,
    and says how much of a prompt is likely to be asked for again: _reusable_length."""

    def __init__(self, max_bytes: int, min_tokens: int = DEFAULT_MIN_TOKENS):
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)

    def longest_prefix(self, key: SnapshotKey, tokens: Sequence[int], max_tokens: int | None = None) -> Snapshot | None:
        """The kept snapshot sharing the most leading tokens with tokens (at most max_tokens long), if any."""
        best, tokens = None, token_array(tokens)  # common_prefix_length compares slices: both must be arrays
        for kept, handle in self._entries(key):
            if max_tokens is not None and len(kept) > max_tokens:
                continue  # it would not fit in this context
            n = common_prefix_length(kept, tokens)
            if n and (best is None or n > best.n_common):
                best = Snapshot(kept, n, handle)
        return best

    def read(self, key: SnapshotKey, snapshot: Snapshot):
        """The snapshot's llama.cpp state (a buffer), checked; None if it is gone or was discarded as untrustworthy."""
        return self._read(key, snapshot)

    def discard(self, snapshot: Snapshot, reason: str) -> None:
        """Forget a snapshot llama.cpp refused."""
        self._delete(snapshot.handle)

    def save(self, key: SnapshotKey, tokens: Sequence[int], payload: Callable[[], object]) -> bool:
        """Keep payload() (a buffer the store may keep) as the state of tokens, if the policy wants it; True when kept."""
        tokens = token_array(tokens)
        if len(tokens) < self.min_tokens:
            return False
        entries = [(kept, handle, common_prefix_length(kept, tokens)) for kept, handle in self._entries(key)]
        if any(n == len(tokens) for _, _, n in entries):
            return False  # a kept snapshot already holds all of these tokens
        extended = [handle for kept, handle, n in entries if n == len(kept)]
        held = max((n for _, _, n in entries), default=0)
        if not extended and self._reusable_length(key, tokens) - held < self.min_tokens:
            return False
        data = payload()
        for handle in extended:
            self._delete(handle)
        size = self._stored_size(key, tokens, data)
        if size > self.max_bytes or not self._make_room(size):
            return False
        return self._write(key, tokens, data)

    def _make_room(self, size: int) -> bool:
        """Evict the least recently used entries until size more bytes fit under the cap."""
        entries = sorted(self._sizes(), key=lambda entry: entry[1])  # (handle, last use, bytes)
        total = sum(entry[2] for entry in entries)
        for handle, _, n_bytes in entries:
            if total + size <= self.max_bytes:
                break
            self._delete(handle)
            total -= n_bytes
        return total + size <= self.max_bytes

    def _stored_size(self, key: SnapshotKey, tokens: array, data) -> int:
        return 4 * len(tokens) + len(data)


class MemoryPrefixCache(PrefixStore):
    """Recent snapshots in RAM (the server's: its clients take turns), least recently used evicted first.

    Any prompt counts as likely to come back: the cap, not the policy, bounds what this store holds.
    It holds the buffers it is given as they are: the states from edgespec.backend.state_bytes are
    anonymous memory maps of their own, so an evicted one goes back to the system whole, rather than
    leaving a hole in the heap that the next, larger one cannot use.
    """

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_MAX_BYTES, min_tokens: int = DEFAULT_MIN_TOKENS):
        super().__init__(max_bytes, min_tokens)
        self._kept: OrderedDict[int, tuple[SnapshotKey, array, object]] = OrderedDict()
        self._next_id = 0

    @property
    def held_bytes(self) -> int:
        """The bytes of the states and tokens it holds, as counted against max_bytes."""
        return sum(4 * len(tokens) + len(data) for _, tokens, data in self._kept.values())

    def _entries(self, key):
        return [(tokens, handle) for handle, (kept_key, tokens, _) in self._kept.items() if kept_key == key]

    def _read(self, key, snapshot):
        entry = self._kept.get(snapshot.handle)
        if entry is None:
            return None
        self._kept.move_to_end(snapshot.handle)
        return entry[2]

    def _write(self, key, tokens, data) -> bool:
        self._next_id += 1
        self._kept[self._next_id] = (key, tokens, data)
        return True

    def _delete(self, handle) -> None:
        self._kept.pop(handle, None)

    def _sizes(self):
        return [(handle, order, 4 * len(tokens) + len(data))
                for order, (handle, (_, tokens, data)) in enumerate(self._kept.items())]

    def _reusable_length(self, key, tokens) -> int:
        return len(tokens)
