"""Writing a file so that a reader sees the old content or the new, never half of one.

Everything edgespec writes in place of an earlier version (downloaded models,
models.json, the calibration cache, config.toml) goes through a temporary
file beside it and a rename.  What it reads back goes through read_regular and
parse_json: a FIFO, a device or a huge file in its place, or JSON nested past
Python's recursion limit, is an OSError or a ValueError like any other bad file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO


class AtomicFile:
    """A temporary file beside ``final`` that becomes ``final`` only on commit(); else it is deleted.

    For content written in pieces (a download); atomic_write() does a whole file at once.
    """

    def __init__(self, final: str | os.PathLike):
        self.final = Path(final)

    def __enter__(self) -> AtomicFile:
        descriptor, name = tempfile.mkstemp(dir=self.final.parent, prefix=f".{self.final.name}.", suffix=".partial")
        self.temp_path = Path(name)
        self.handle = os.fdopen(descriptor, "wb")
        return self

    def commit(self) -> Path:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.temp_path, 0o666 & ~umask)  # mkstemp makes it private; these files need not be
        os.replace(self.temp_path, self.final)
        directory = os.open(self.final.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return self.final

    def __exit__(self, *exc_info) -> None:
        self.handle.close()
        self.temp_path.unlink(missing_ok=True)  # no-op after commit()


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace path's content with data (str as UTF-8) in one rename; raises OSError if it cannot."""
    with AtomicFile(path) as out:
        out.handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        return out.commit()


class NotARegularFile(OSError):
    """A FIFO, a device or a socket where edgespec expects a file it wrote."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """path opened for reading in binary; NotARegularFile if it is not a regular file.

    Opened non-blocking, then checked: a plain open of a FIFO waits for a writer, which may never come.
    """
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


class FileTooLarge(OSError):
    """A file larger than edgespec ever writes there: not read, since reading it whole could exhaust memory."""


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at path; NotARegularFile for anything else (a FIFO would hang a plain
    read, /dev/zero never ends), FileTooLarge past limit bytes, OSError if it cannot be read."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(f"{path} is larger than {limit} bytes")
    return data


def parse_json(data: bytes | str):
    """json.loads, with JSON nested past Python's recursion limit ([[[[...) raising the ValueError that any
    other malformed JSON raises, rather than a RecursionError no caller expects."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("its JSON is nested too deeply") from None
