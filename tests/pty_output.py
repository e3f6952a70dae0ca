"""Reading everything a command wrote to a pseudo-terminal or a pipe."""

from __future__ import annotations

import errno
import os


def read_until_closed(fd: int) -> bytes:
    """All the bytes that reach `fd` until its writing end is closed. One read is not enough: a terminal's
    line discipline hands its output on in pieces, so a single read can return part of a line."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError as error:  # a pty's reading end answers EIO once the other end is closed and drained
            if error.errno != errno.EIO:
                raise
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
