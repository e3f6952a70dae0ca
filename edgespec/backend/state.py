"""A model's KV cache as bytes and back: llama.cpp's sequence-state API, for the prompt cache's snapshots."""

from __future__ import annotations

import ctypes
import mmap
from typing import Sequence

import llama_cpp

from ..errors import DecodeError
from .runtime import forget_log, last_error

# `model` below is a LlamaModel (not imported: the backend's package exports both).

# Private maps count as the process's anonymous memory, as heap would (a shared one counts as shmem).
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def state_buffer(size: int) -> mmap.mmap | bytearray:
    """size writable bytes for a KV state, in an anonymous memory map of their own.

    States are megabytes each and of every size.  Kept on the heap, those a store evicts leave holes
    that malloc keeps and the next, larger state cannot use: a server's RSS grew hundreds of MB past
    what its store held.  A map goes back to the system whole when its last reference goes.
    """
    return mmap.mmap(-1, size, **_PRIVATE) if size > 0 else bytearray()


def state_bytes(model, seq: int = 0) -> mmap.mmap | bytearray:
    """Sequence seq's KV cache as llama_state_seq_get_data writes it, in a buffer of its own (state_buffer)."""
    size = llama_cpp.llama_state_seq_get_size(model._ctx, seq)
    data = state_buffer(size)
    written = llama_cpp.llama_state_seq_get_data(model._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
    if written == 0 and model.cached_of(seq):
        raise DecodeError(f"llama.cpp could not serialise the KV cache of {model.path.name}: {last_error()}")
    if written < size:
        shorter = state_buffer(written)
        shorter[:] = memoryview(data)[:written]
        data = shorter
    return data


def load_state(model, data: bytes | bytearray | mmap.mmap, tokens: Sequence[int], seq: int = 0) -> bool:
    """Replace sequence seq's KV cache with data, a state of exactly tokens; False, that cache left empty, if refused.

    The caller vouches that data is a snapshot of tokens from this model and build (the prompt
    cache's header and checksum do); llama.cpp checks only sizes, and the position count is checked here.
    """
    model.rewind(0, seq)
    array = ctypes.c_uint8 * len(data)
    buffer = array.from_buffer_copy(data) if isinstance(data, bytes) else array.from_buffer(data)
    forget_log()
    loaded = llama_cpp.llama_state_seq_set_data(model._ctx, buffer, len(data), seq)
    if loaded == 0 or llama_cpp.llama_memory_seq_pos_max(model._memory, seq) != len(tokens) - 1:
        llama_cpp.llama_memory_seq_rm(model._memory, seq, 0, -1)
        return False
    model.cached_of(seq)[:] = tokens  # in place: ``cached`` is sequence 0's list itself
    return True
