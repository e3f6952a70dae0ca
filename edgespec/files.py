"""Writing a file so that a reader sees the old content or the new, never half of one.

Everything edgespec writes in place of an earlier version (downloaded models,
models.json, the calibration cache, config.toml) goes through a temporary
file beside it and a rename.  What it reads back goes through read_regular,
parse_json and read_arrays: a FIFO, a device or a huge file in its place, JSON
nested past Python's recursion limit, or an archive of arrays that asks for
more memory than it holds, is an OSError or a ValueError like any other bad file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import stat
import tempfile
import time
import zipfile
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np


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


def write_named_output(path: Path, text: str) -> None:
    """text at a path the user named (batch --summary, bench --json), as that path stands: a device or a FIFO
    (/dev/stdout) is written into, a symlink's file is replaced, anything else replaced whole.  A rename
    replaced the node itself: run as root, --summary /dev/full put a JSON file in place of /dev/full.
    (edgespec's own files are replaced whole whatever stands there: atomic_write.)"""
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        atomic_write(os.path.realpath(path), text)


@contextlib.contextmanager
def update_lock(path: str | os.PathLike, wait_seconds: float = 2.0) -> Iterator[None]:
    """An exclusive lock on ``path``.lock for a read, change and write of path, so that two processes
    changing it at once (a server and a chat) do not drop each other's change.

    A lock still held after wait_seconds (by a stopped process) or not to be had at all (a read-only folder)
    lets the update go ahead unlocked: the files updated so are savings, which must never stop the caller.
    """
    try:
        descriptor = os.open(f"{os.fspath(path)}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        descriptor = None
    if descriptor is None:  # the update goes ahead, outside the except: a failure in it is its own
        yield
        return
    try:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            except OSError:  # a file system without flock
                break
        yield
    finally:
        os.close(descriptor)  # which releases the lock


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


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an .npz archive np.savez wrote (heads, a training run's state, usage chunks), read whole;
    OSError if the file cannot be read, ValueError if it is not such an archive.

    np.load allocates what a member's header declares before reading a byte of it, and inflates a compressed
    member whatever it grows to: a 460-byte file asked for 149 GiB (a MemoryError's traceback), and a 2 MB
    one took 2 GB for 8 s.  So members must be stored, as np.savez writes them, and declare no more bytes
    than they hold: reading an archive then costs at most the file's own size.
    """
    arrays = {}
    with open_regular(path) as file:
        size = os.fstat(file.fileno()).st_size
        try:
            with zipfile.ZipFile(file) as archive:
                members = archive.infolist()
                if any(m.compress_type != zipfile.ZIP_STORED for m in members):
                    raise ValueError("it holds compressed members, which np.savez never writes")
                if sum(m.file_size for m in members) > size:
                    raise ValueError("its members claim more bytes than the file holds")
                for member in members:
                    with archive.open(member) as stream:
                        _check_array_header(stream, member.file_size)
                    with archive.open(member) as stream:
                        array = np.lib.format.read_array(stream, allow_pickle=False)
                    arrays[member.filename.removesuffix(".npy")] = array
        except (zipfile.BadZipFile, EOFError) as error:
            raise ValueError(f"it is not an archive of arrays ({error})") from None
    return arrays


def _check_array_header(stream: BinaryIO, held: int) -> None:
    """ValueError unless the .npy header at the start of stream declares plain data of at most `held` bytes."""
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"an array has header version {version}, which np.savez does not write here")
    if dtype.hasobject or math.prod(shape) * dtype.itemsize > held:
        raise ValueError("an array declares more data than it holds")
