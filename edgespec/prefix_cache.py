"""Snapshots of a model's KV cache for a token prefix, so a prompt that starts the same is not prefilled again.

Prefill cannot be sped up by speculation, and on a small CPU a few thousand
tokens take a minute.  After a generation the engine offers each model's KV
cache (the tokens in it and llama.cpp's serialised state) to a store; before
the next prefill it asks the stores for the snapshot sharing the longest
prefix with the new prompt, restores it and rolls it back to that prefix.

Two stores: DiskPrefixCache (files in the cache dir, shared across processes,
LRU under a byte cap) and MemoryPrefixCache (a few recent states in RAM, for
a server whose clients take turns).  Both keep the same policy: nothing under
min_tokens is kept, a snapshot is kept only if it holds min_tokens that no
kept one does or it extends one (which it then replaces), and the cap holds
before anything is written.

A snapshot's own header names its model file, KV type and llama.cpp build and
checksums its tokens and payload, so a corrupt, truncated or foreign file is
discarded with a notice before llama.cpp ever reads its bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from .backend import common_prefix_length
from .calibration import cache_dir
from .files import AtomicFile
from .notices import print_notice
from .units import GiB, MiB, parse_size

FORMAT_VERSION = 1
MAGIC = b"EDGESPEC-KV\x00"
SUFFIX = ".kvstate"
DEFAULT_MAX_BYTES = 2 * GiB
DEFAULT_MEMORY_MAX_BYTES = 512 * MiB
# Prefill of a few hundred tokens takes seconds at most; a snapshot of them is not worth its disk space.
DEFAULT_MIN_TOKENS = 256
_MAX_HEADER_BYTES = 1 << 16
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class SnapshotKey:
    """What a KV snapshot is valid for: one model file, one KV setup (its K and V types and flash attention,
    which lays the values out otherwise), one llama.cpp build, and
    contexts of one number of sequences (llama.cpp refuses a state from a context whose KV buffers are
    laid out otherwise, as one per sequence was; `batch --parallel` reserves several sequences)."""

    model_path: str
    model_size: int
    model_mtime_ns: int
    kv_type: str
    n_seq: int
    runtime: str

    @classmethod
    def for_model(cls, model_path: str | os.PathLike, kv_type: str, n_seq: int, runtime: str) -> SnapshotKey:
        path = Path(model_path).resolve()
        stat = path.stat()
        return cls(str(path), stat.st_size, stat.st_mtime_ns, kv_type, n_seq, runtime)

    def same_model(self, other: SnapshotKey) -> bool:
        """Same model file, KV type and sequence count, whatever the build."""
        return (self.model_path, self.model_size, self.model_mtime_ns, self.kv_type, self.n_seq) == (
            other.model_path, other.model_size, other.model_mtime_ns, other.kv_type, other.n_seq)


@dataclass(frozen=True)
class Snapshot:
    """A kept snapshot found for a prompt: its tokens, how many lead the prompt, and where it is kept."""

    tokens: tuple[int, ...]
    n_common: int
    handle: object  # the store's own: a path, a RAM entry's id


class CorruptSnapshot(Exception):
    """A snapshot file that must not be trusted; the text says why."""


def token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


class PrefixStore:
    """The policy both stores share; a subclass keeps the entries: _entries, _read, _write, _delete, _sizes."""

    def __init__(self, max_bytes: int, min_tokens: int = DEFAULT_MIN_TOKENS):
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)

    def longest_prefix(self, key: SnapshotKey, tokens: Sequence[int], max_tokens: int | None = None) -> Snapshot | None:
        """The kept snapshot sharing the most leading tokens with tokens (at most max_tokens long), if any."""
        best, tokens = None, tuple(tokens)  # common_prefix_length compares slices: a tuple never equals a list
        for kept, handle in self._entries(key):
            if max_tokens is not None and len(kept) > max_tokens:
                continue  # it would not fit in this context
            n = common_prefix_length(kept, tokens)
            if n and (best is None or n > best.n_common):
                best = Snapshot(kept, n, handle)
        return best

    def read(self, key: SnapshotKey, snapshot: Snapshot) -> bytes | bytearray | None:
        """The snapshot's llama.cpp state, checked; None if it is gone or was discarded as untrustworthy."""
        return self._read(key, snapshot)

    def discard(self, snapshot: Snapshot, reason: str) -> None:
        """Forget a snapshot llama.cpp refused."""
        self._delete(snapshot.handle)

    def save(self, key: SnapshotKey, tokens: Sequence[int], payload: Callable[[], bytes | bytearray]) -> bool:
        """Keep payload() as the state of tokens, if the policy wants it; True when it was kept."""
        tokens = tuple(tokens)
        if len(tokens) < self.min_tokens:
            return False
        entries = [(kept, handle, common_prefix_length(kept, tokens)) for kept, handle in self._entries(key)]
        if any(n == len(tokens) for _, _, n in entries):
            return False  # a kept snapshot already holds all of these tokens
        extended = [handle for kept, handle, n in entries if n == len(kept)]
        novel = len(tokens) - max((n for _, _, n in entries), default=0)
        if novel < self.min_tokens and not extended:
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

    def _stored_size(self, key: SnapshotKey, tokens: tuple[int, ...], data) -> int:
        return 4 * len(tokens) + len(data)


class MemoryPrefixCache(PrefixStore):
    """Recent snapshots in RAM (the server's: its clients take turns), least recently used evicted first."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_MAX_BYTES, min_tokens: int = DEFAULT_MIN_TOKENS):
        super().__init__(max_bytes, min_tokens)
        self._kept: OrderedDict[int, tuple[SnapshotKey, tuple[int, ...], bytes]] = OrderedDict()
        self._next_id = 0

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
        self._kept[self._next_id] = (key, tokens, bytes(data))
        return True

    def _delete(self, handle) -> None:
        self._kept.pop(handle, None)

    def _sizes(self):
        return [(handle, order, 4 * len(tokens) + len(data))
                for order, (handle, (_, tokens, data)) in enumerate(self._kept.items())]


def max_bytes_from_env(default: int = DEFAULT_MAX_BYTES) -> int:
    """The disk cap: EDGESPEC_PROMPT_CACHE_SIZE (e.g. 2GiB), else default."""
    text = os.environ.get("EDGESPEC_PROMPT_CACHE_SIZE")
    return parse_size(text) if text else default


def prefix_cache_dir() -> Path:
    return cache_dir() / "prefix-cache"


class DiskPrefixCache(PrefixStore):
    """Snapshot files in the cache dir, shared by every edgespec process, least recently used evicted first.

    Each file: MAGIC, a 4-byte header length, the header (JSON: format, key, token count and
    checksums), the token ids (int32), llama.cpp's state.  Files are written whole through a
    temporary file and a rename, and a hit refreshes the file's modification time: the LRU's clock.
    """

    def __init__(self, directory: str | os.PathLike | None = None, max_bytes: int | None = None,
                 min_tokens: int = DEFAULT_MIN_TOKENS, notice: Callable[[str], None] = print_notice):
        super().__init__(max_bytes_from_env() if max_bytes is None else max_bytes, min_tokens)
        self.directory = Path(directory) if directory is not None else prefix_cache_dir()
        self._notice = notice
        self._write_failed = False

    def _paths(self) -> list[Path]:
        try:
            return sorted(self.directory.glob("*" + SUFFIX))
        except OSError:
            return []

    def _entries(self, key):
        found = []
        for path in self._paths():
            try:
                with open(path, "rb") as f:
                    kept_key, tokens, _ = _read_header(f, os.fstat(f.fileno()).st_size)
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
            with open(path, "rb") as f:
                kept_key, tokens, header = _read_header(f, os.fstat(f.fileno()).st_size)
                if kept_key != key or tokens != snapshot.tokens:
                    return None  # replaced by another process since it was found
                data = bytearray(header["payload_bytes"])
                if f.readinto(data) != len(data) or hashlib.sha256(data).hexdigest() != header["payload_sha256"]:
                    raise CorruptSnapshot("its payload does not match its checksum")
            os.utime(path)
        except OSError:
            return None
        except CorruptSnapshot as why:
            self._reject(path, str(why))
            return None
        return data

    def discard(self, snapshot: Snapshot, reason: str) -> None:
        self._reject(snapshot.handle, reason)

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
            if not self._write_failed:  # once per process: every later reply would say the same
                self._write_failed = True
                self._notice(f"cannot save a prefix snapshot in {self.directory}: {error.strerror or error} "
                             "(long prompts are prefilled in full; free some disk space or set EDGESPEC_CACHE_DIR)")
            return False
        return True

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
        self._notice(f"discarded the prefix snapshot {Path(path).name}: {why}; its prompt is prefilled instead")
        self._delete(path)


def _encode_header(key: SnapshotKey, tokens: tuple[int, ...], data, payload_sha256: str | None = None) -> bytes:
    header = json.dumps({
        "format": FORMAT_VERSION, "key": asdict(key), "n_tokens": len(tokens),
        "tokens_sha256": hashlib.sha256(token_bytes(tokens)).hexdigest(),
        "payload_bytes": len(data), "payload_sha256": payload_sha256 or hashlib.sha256(data).hexdigest(),
    }, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header


def _read_header(f, file_size: int) -> tuple[SnapshotKey, tuple[int, ...], dict]:
    """The key, tokens and header of an open snapshot file, read up to its payload; CorruptSnapshot if any is off."""
    start = f.read(len(MAGIC) + _LENGTH.size)
    if len(start) < len(MAGIC) + _LENGTH.size or not start.startswith(MAGIC):
        raise CorruptSnapshot("it is not an edgespec KV snapshot")
    (length,) = _LENGTH.unpack(start[len(MAGIC):])
    if length > _MAX_HEADER_BYTES:
        raise CorruptSnapshot("its header is damaged")
    try:
        header = json.loads(f.read(length))
        if header.get("format") != FORMAT_VERSION:
            raise CorruptSnapshot(f"it has snapshot format {header.get('format')!r}, not {FORMAT_VERSION}")
        key = SnapshotKey(**header["key"])
        n_tokens, n_payload = int(header["n_tokens"]), int(header["payload_bytes"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CorruptSnapshot("its header is damaged") from None
    if n_tokens <= 0 or n_payload < 0:
        raise CorruptSnapshot("its header gives a negative or zero size")
    if file_size != len(start) + length + 4 * n_tokens + n_payload:
        raise CorruptSnapshot("it is truncated or has bytes past its end")
    raw = f.read(4 * n_tokens)
    if hashlib.sha256(raw).hexdigest() != header.get("tokens_sha256"):
        raise CorruptSnapshot("its tokens do not match their checksum")
    return key, struct.unpack(f"<{n_tokens}i", raw), header
