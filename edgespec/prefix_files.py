"""The prompt cache on disk: KV snapshot files in the cache dir, shared by every edgespec process.

Each file: MAGIC, a 4-byte header length, the header (JSON: format, key, token
count and checksums), the token ids (int32), llama.cpp's state.  Its own header
names its model (by content), KV type and llama.cpp build and checksums its
tokens and payload, so a corrupt, truncated or foreign file is discarded with a
notice before llama.cpp ever reads its bytes.  Files are written whole through
a temporary file and a rename, and a hit refreshes the file's modification
time: the LRU's clock.  A snapshot is written only of a prefix that came
before (edgespec.prefix_sightings), unless the store keeps every prompt (the
chat app's), and the store is trimmed to its cap when opened, so a smaller
cap holds from the start.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import sys
from array import array
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from .backend import state_buffer
from .calibration import cache_dir
from .files import AtomicFile, NotARegularFile, open_regular, parse_json
from .notices import log_notice
from .prefix_cache import DEFAULT_MIN_TOKENS, PrefixStore, Snapshot, SnapshotKey
from .prefix_sightings import PrefixSightings
from .units import GiB, InvalidSizeError, parse_size

# 2: keyed by the model's content, not its path, size and mtime; 3: and by whose prompts (SnapshotKey.scope), so
# that a server's snapshots from before, of every client's prompts, are not taken for the user's own
FORMAT_VERSION = 3
MAGIC = b"EDGESPEC-KV\x00"
SUFFIX = ".kvstate"
SIGHTINGS_FILE = "seen-prefixes"
DEFAULT_MAX_BYTES = 2 * GiB
_MAX_HEADER_BYTES = 1 << 16
_LENGTH = struct.Struct("<I")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # the disk (or the quota) is full: then freeing space is the fix


class CorruptSnapshot(Exception):
    """A snapshot file that must not be trusted; the text says why."""


def token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def max_bytes_from_env(default: int = DEFAULT_MAX_BYTES) -> int:
    """The disk cap: EDGESPEC_PROMPT_CACHE_SIZE (e.g. 2GiB), else default."""
    text = os.environ.get("EDGESPEC_PROMPT_CACHE_SIZE")
    try:
        return parse_size(text) if text else default
    except InvalidSizeError as error:  # the value came from the environment: say which variable to mend
        raise InvalidSizeError(f"EDGESPEC_PROMPT_CACHE_SIZE: {error}") from None


def prefix_cache_dir() -> Path:
    return cache_dir() / "prefix-cache"


class DiskPrefixCache(PrefixStore):
    """Snapshot files in the cache dir, least recently used evicted first; see the module's docstring.

    keep_every_prompt keeps a long prompt's snapshot the first time it comes, not only once it came back:
    the chat app's store, whose chats are all kept to be reopened.
    """

    def __init__(self, directory: str | os.PathLike | None = None, max_bytes: int | None = None,
                 min_tokens: int = DEFAULT_MIN_TOKENS, notice: Callable[[str], None] = log_notice,
                 keep_every_prompt: bool = False):
        super().__init__(max_bytes_from_env() if max_bytes is None else max_bytes, min_tokens)
        self.keep_every_prompt = keep_every_prompt
        self.directory = Path(directory) if directory is not None else prefix_cache_dir()
        self._notice = notice
        self._said_unwritable = False
        self._rejected: set[Path] = set()  # discarded, but left in place by a read-only dir: not said again
        self._reasons_said: set[str] = set()  # after an upgrade every old file has the same one: said once
        self._sightings = PrefixSightings(self.directory / SIGHTINGS_FILE)
        self._make_room(0)

    def _paths(self) -> list[Path]:
        try:
            return sorted(path for path in self.directory.glob("*" + SUFFIX) if path not in self._rejected)
        except OSError:
            return []

    def _entries(self, key):
        found = []
        for path in self._paths():
            try:
                with open_regular(path) as f:
                    kept_key, tokens, _ = _read_header(f, os.fstat(f.fileno()).st_size)
            except NotARegularFile:
                self._reject(path, "it is not a regular file")
                continue
            except OSError:
                continue  # gone meanwhile (another process evicted it), or unreadable: a miss
            except CorruptSnapshot as why:
                self._reject(path, str(why))
                continue
            if not kept_key.same_model(key):
                continue
            if kept_key.runtime != key.runtime:
                self._reject(path, f"it was made by another llama.cpp build ({kept_key.runtime}, this is {key.runtime})")
                continue
            found.append((tokens, path))
        return found

    def _read(self, key, snapshot):
        path = snapshot.handle
        try:
            with open_regular(path) as f:
                kept_key, tokens, header = _read_header(f, os.fstat(f.fileno()).st_size)
                if kept_key != key or tokens != snapshot.tokens:
                    return None  # replaced by another process since it was found
                data = state_buffer(header["payload_bytes"])
                if f.readinto(data) != len(data) or hashlib.sha256(data).hexdigest() != header["payload_sha256"]:
                    raise CorruptSnapshot("its payload does not match its checksum")
        except OSError:
            return None
        except CorruptSnapshot as why:
            self._reject(path, str(why))
            return None
        try:
            os.utime(path)  # the LRU's clock
        except OSError as error:
            self._cannot_write(error)
        return data

    def discard(self, snapshot: Snapshot, reason: str) -> None:
        self._reject(snapshot.handle, reason)

    def _reusable_length(self, key, tokens) -> int:
        try:
            seen = self._sightings.seen_then_note(key.model_identity + key.scope, tokens)
        except OSError as error:
            self._cannot_write(error)
            return 0  # nothing can be kept here
        return len(tokens) if self.keep_every_prompt else seen

    def _write(self, key, tokens, data) -> bool:
        header = _encode_header(key, tokens, data)
        name = hashlib.sha256(json.dumps(asdict(key), sort_keys=True).encode() + token_bytes(tokens)).hexdigest()[:32]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with AtomicFile(self.directory / (name + SUFFIX)) as out:
                out.handle.write(header)
                out.handle.write(token_bytes(tokens))
                out.handle.write(data)
                out.commit()
        except OSError as error:
            self._cannot_write(error)
            return False
        return True

    def _cannot_write(self, error: OSError) -> None:
        """Say once per process that snapshots cannot be saved here: every later prompt would say the same."""
        if self._said_unwritable:
            return
        self._said_unwritable = True
        if error.errno in _READ_ONLY:
            self._notice(f"the prompt cache in {self.directory} is read-only: its snapshots are restored, but no new "
                         "one is saved (make it writable, or set EDGESPEC_CACHE_DIR to a writable directory)")
        else:
            fix = "free some disk space or set EDGESPEC_CACHE_DIR" if error.errno in _NO_SPACE else \
                "set EDGESPEC_CACHE_DIR to a writable directory"
            self._notice(f"cannot save a prefix snapshot in {self.directory}: {error.strerror or error} "
                         f"(long prompts are prefilled in full; {fix})")

    def _delete(self, handle) -> None:
        try:
            Path(handle).unlink(missing_ok=True)
        except OSError:
            pass

    def _sizes(self):
        sizes = []
        for path in self._paths():
            try:
                stat = path.stat()
            except OSError:
                continue
            sizes.append((path, stat.st_mtime_ns, stat.st_size))
        return sizes

    def _stored_size(self, key, tokens, data) -> int:
        # a placeholder digest has the real one's length: the payload is hashed once, when written
        return len(_encode_header(key, tokens, data, payload_sha256="0" * 64)) + 4 * len(tokens) + len(data)

    def _reject(self, path: Path, why: str) -> None:
        if why not in self._reasons_said:
            self._reasons_said.add(why)
            self._notice(f"discarded the prefix snapshot {Path(path).name}: {why}; its prompt is prefilled instead")
        self._delete(path)
        if Path(path).exists() or Path(path).is_symlink():
            self._rejected.add(Path(path))


def _encode_header(key: SnapshotKey, tokens: array, data, payload_sha256: str | None = None) -> bytes:
    header = json.dumps({
        "format": FORMAT_VERSION, "key": asdict(key), "n_tokens": len(tokens),
        "tokens_sha256": hashlib.sha256(token_bytes(tokens)).hexdigest(),
        "payload_bytes": len(data), "payload_sha256": payload_sha256 or hashlib.sha256(data).hexdigest(),
    }, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header


def _read_header(f, file_size: int) -> tuple[SnapshotKey, array, dict]:
    """The key, tokens and header of an open snapshot file, read up to its payload; CorruptSnapshot if any is off."""
    start = f.read(len(MAGIC) + _LENGTH.size)
    if len(start) < len(MAGIC) + _LENGTH.size or not start.startswith(MAGIC):
        raise CorruptSnapshot("it is not an edgespec KV snapshot")
    (length,) = _LENGTH.unpack(start[len(MAGIC):])
    if length > _MAX_HEADER_BYTES:
        raise CorruptSnapshot("its header is damaged")
    try:
        header = parse_json(f.read(length))
        if header.get("format") != FORMAT_VERSION:
            raise CorruptSnapshot(f"it has snapshot format {header.get('format')!r}, not {FORMAT_VERSION}")
        key = SnapshotKey(**header["key"])
        n_tokens, n_payload = header["n_tokens"], header["payload_bytes"]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CorruptSnapshot("its header is damaged") from None
    if type(n_tokens) is not int or type(n_payload) is not int:  # 5.0 or true would pass as sizes, then fail in use
        raise CorruptSnapshot("its header is damaged")
    if n_tokens <= 0 or n_payload < 0:
        raise CorruptSnapshot("its header gives a negative or zero size")
    if file_size != len(start) + length + 4 * n_tokens + n_payload:
        raise CorruptSnapshot("it is truncated or has bytes past its end")
    raw = f.read(4 * n_tokens)
    if hashlib.sha256(raw).hexdigest() != header.get("tokens_sha256"):
        raise CorruptSnapshot("its tokens do not match their checksum")
    tokens = array("i", raw)
    if sys.byteorder == "big":
        tokens.byteswap()  # the file's ids are little-endian
    return key, tokens, header
