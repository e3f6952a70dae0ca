"""Learning from usage: the hidden states of rows that verification kept, with the tokens that followed them.

While heads draft (chat, batch, serve, run), every verification pass
already returns the hidden state of each of its rows (backend.hidden).  The
rows whose tokens were kept, and the tokens that came after them, are
exactly what `heads train` collects by answering prompts, but without a
teacher pass.  UsageLog keeps them in chunk files next to the heads file,
at most max_bytes in all (the oldest go first), and `edgespec heads train`
trains on them first (read_usage).

It is off unless asked for (EDGESPEC_LEARN_HEADS=1, or load_engine's
learn_heads), as its cost per step is for benchmarks/heads_usage_cost.py to show.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np

from ..files import atomic_write, read_arrays
from .teacher import TeacherData

CHUNK_POSITIONS = 4096  # about 12 MB of float16 hidden states at Qwen2.5-1.5B's 1536
DEFAULT_MAX_BYTES = 256 << 20


def usage_dir(heads_path: str | os.PathLike) -> Path:
    """Where the usage of the model whose heads file is heads_path is kept."""
    heads_path = Path(heads_path)
    return heads_path.with_name(heads_path.name.removesuffix(".npz") + ".usage")


class UsageLog:
    """A sink for backend.hidden.HiddenStateModel.usage_sink: keeps (tokens, hidden states) in chunk files."""

    def __init__(self, directory: str | os.PathLike, n_embd: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._pending = TeacherData.empty(n_embd)

    def __call__(self, tokens: list[int], hidden: np.ndarray) -> None:
        """Tokens at consecutive positions and the hidden state after each but the last (one row fewer)."""
        self._pending.add(tokens[:-1], hidden, np.asarray(tokens[1:], dtype=np.int32), "usage")
        if len(self._pending) >= CHUNK_POSITIONS:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as one chunk, then drop the oldest chunks beyond max_bytes."""
        if not len(self._pending):
            return
        buffer = io.BytesIO()
        np.savez(buffer, **self._pending.arrays(""))
        self._pending = TeacherData.empty(self._pending.hidden.shape[1])
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.directory / f"{time.time_ns()}.npz", buffer.getvalue())
            self._trim()
        except OSError:
            pass  # learning from usage is a bonus: a full or read-only disk must not stop a reply

    def _trim(self) -> None:
        chunks = sorted(self.directory.glob("*.npz"), reverse=True)  # newest first (named by time)
        total = 0
        for chunk in chunks:
            total += chunk.stat().st_size
            if total > self.max_bytes:
                chunk.unlink(missing_ok=True)


def read_usage(directory: str | os.PathLike, n_embd: int, max_positions: int) -> TeacherData:
    """The usage kept in directory, newest first, up to max_positions; damaged chunks are left out."""
    data = TeacherData.empty(n_embd)
    for chunk in sorted(Path(directory).glob("*.npz"), reverse=True):
        try:
            part = TeacherData.from_arrays(read_arrays(chunk), "", {})
            consistent = part.hidden.ndim == 2 and part.hidden.shape[1] == n_embd and len(part) == len(part.top)
        except (OSError, ValueError, KeyError):
            continue
        if consistent:
            data.extend(part, "usage", max_positions)
    return data
