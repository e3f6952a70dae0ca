"""Buffers for KV states: the prompt cache's snapshots, megabytes each, kept in memory maps of their own."""

from __future__ import annotations

import mmap

# Private maps count as the process's anonymous memory, as heap would (a shared one counts as shmem).
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def state_buffer(size: int) -> mmap.mmap | bytearray:
    """size writable bytes for a KV state, in an anonymous memory map of their own.

    States are megabytes each and of every size.  Kept on the heap, those a store evicts leave holes
    that malloc keeps and the next, larger state cannot use: a server's RSS grew hundreds of MB past
    what its store held.  A map goes back to the system whole when its last reference goes.
    """
    return mmap.mmap(-1, size, **_PRIVATE) if size > 0 else bytearray()
