"""Which token prefixes came before: the disk prompt cache keeps a snapshot only of a prefix that came back.

A server's clients mostly send prompts nobody sends again; a snapshot of each
would fill the disk with files never read.  So the disk store first notes a
prompt's fingerprints, and keeps a snapshot only when a later prompt starts
with one it noted: the same prompt run again, a document or system prompt
shared by requests, a chat's next turn (which starts with the last one).

A fingerprint is a hash of a prompt's first k * BLOCK_TOKENS tokens, for every
k, each hash chained from the one before, so a prompt sharing its first n
tokens with a noted one matches the fingerprints of about n of them.  They are
16-byte records appended to one file in the prefix-cache dir, shared by every
process, which keeps the last MAX_RECORDS.  Losing some (two processes
rewriting it at once) only means a snapshot kept later.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Sequence

from .files import atomic_write, open_regular

BLOCK_TOKENS = 64
RECORD_BYTES = 16
MAX_RECORDS = 16384  # 256 KiB: the fingerprints of about a million tokens of prompts


def fingerprints(seed: str, tokens: Sequence[int]) -> list[bytes]:
    """One hash per whole block of tokens: index i covers tokens[:(i + 1) * BLOCK_TOKENS] and seed."""
    found, previous = [], hashlib.blake2b(seed.encode(), digest_size=RECORD_BYTES).digest()
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        block = struct.pack(f"<{BLOCK_TOKENS}i", *tokens[end - BLOCK_TOKENS:end])
        previous = hashlib.blake2b(previous + block, digest_size=RECORD_BYTES).digest()
        found.append(previous)
    return found


class PrefixSightings:
    """The fingerprints of recent prompts, in one file of 16-byte records."""

    def __init__(self, path: str | os.PathLike, max_records: int = MAX_RECORDS):
        self.path = Path(path)
        self.max_records = max_records

    def seen_then_note(self, seed: str, tokens: Sequence[int]) -> int:
        """How many leading tokens of tokens (a multiple of BLOCK_TOKENS) came in a noted prompt; then note tokens.

        seed names what the tokens are for (a model's identity): the same ids in another model do not count.
        OSError if they cannot be noted (a read-only dir).
        """
        prints = fingerprints(seed, tokens)
        noted = self._read()
        seen = max((i + 1 for i, found in enumerate(prints) if found in noted), default=0)
        self._note(prints)
        return seen * BLOCK_TOKENS

    def _read(self) -> set[bytes]:
        try:
            with open_regular(self.path) as f:
                size = os.fstat(f.fileno()).st_size
                if size % RECORD_BYTES:
                    return set()  # a torn write: the next note starts the file afresh
                f.seek(max(0, size - self.max_records * RECORD_BYTES))
                data = f.read()
        except OSError:
            return set()
        return {data[i:i + RECORD_BYTES] for i in range(0, len(data), RECORD_BYTES)}

    def _note(self, prints: list[bytes]) -> None:
        new = b"".join(prints)
        size = self._own_size()
        if size is None or size % RECORD_BYTES or size + len(new) > 2 * self.max_records * RECORD_BYTES:
            self._rewrite(new, size)
        else:
            self._append(new)

    def _own_size(self) -> int | None:
        """The file's size (0 when there is none yet), or None when something else is in its place: a symlink
        (appending would write into the file it points at, perhaps the user's), a FIFO or a device.  Those are
        replaced by a file of the new records."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return 0
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def _append(self, new: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # non-blocking, and written only if a regular file: a FIFO in its place must not hang the prompt
        # O_NOFOLLOW: a symlink put there since _own_size looked is refused (OSError), not written through
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        descriptor = os.open(self.path, flags, 0o666)
        try:
            if stat.S_ISREG(os.fstat(descriptor).st_mode):
                os.write(descriptor, new)
        finally:
            os.close(descriptor)

    def _rewrite(self, new: bytes, size: int | None) -> None:
        """Keep the last max_records records (none after a torn write, or from what was not the file), new ones
        included, in one rename."""
        kept = b""
        if size is not None and size % RECORD_BYTES == 0:
            with open_regular(self.path) as f:
                f.seek(max(0, size - (self.max_records * RECORD_BYTES - len(new))))
                kept = f.read()
        atomic_write(self.path, (kept + new)[-self.max_records * RECORD_BYTES:])
