"""What a model file holds, as a short hash: a prompt-cache snapshot is valid for that, not for a path.

A path, size and modification time do not tell two models apart: `cp -p`,
`rsync -a`, tar and container layers put another file in place with the old
one's mtime, and fine-tunes of one base at one quant type have equal sizes.
The identity hashes the GGUF header whole (metadata, tensor names, shapes,
types and offsets) and samples every tensor's data at its start, middle and
end.  A fine-tune changes every tensor it trains, so it changes the samples;
reading them costs a few MB, not the whole file.

It is worked out once per version of a file: model-identity.json in the cache
dir keeps it by the file's device, inode, size, mtime and ctime.  The ctime
cannot be set by a user, so a file rewritten in place (`cp -p` keeps the inode
and sets the mtime back) changes it.  A file changed within one tick of the
clock after it was hashed could keep all five, so, as git does with racily
clean files, an identity is kept only for a file that had not changed for
SETTLED_SECONDS when its hashing began; a fresher one is hashed again next time.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from pathlib import Path
from typing import Callable

from .calibration import cache_dir
from .files import atomic_write, open_regular, parse_json
from .gguf_info import read_gguf_info

IDENTITY_VERSION = 1
SAMPLE_BYTES = 4096
SETTLED_SECONDS = 2.0
MAX_ENTRIES = 256
_MAX_CACHE_FILE_BYTES = 1 << 20


def content_hash(path: str | os.PathLike) -> str:
    """The identity of the GGUF file at path: its header and a sample of each tensor's data, hashed."""
    info = read_gguf_info(path)
    digest = hashlib.sha256(f"edgespec model identity {IDENTITY_VERSION} {info.file_size}\n".encode())
    with open_regular(path) as f:
        digest.update(f.read(info.data_offset))
        for start, length in info.tensor_spans:
            for offset in sorted({0, max(0, length // 2 - SAMPLE_BYTES // 2), max(0, length - SAMPLE_BYTES)}):
                f.seek(start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, length - offset)))
    return digest.hexdigest()[:32]


def _file_version(stat: os.stat_result) -> list[int]:
    """What changes whenever a file's content may have: the fields the cache is keyed by."""
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class IdentityCache:
    """Model identities by file version, in a small JSON file; an unreadable or damaged one is started afresh."""

    def __init__(self, path: str | os.PathLike, clock: Callable[[], int] = time.time_ns,
                 hash_file: Callable[[Path], str] = content_hash):
        self.path = Path(path)
        self._clock = clock
        self._hash_file = hash_file

    def identity(self, model_path: str | os.PathLike) -> str:
        """model_path's identity: from the cache when the file is the version it was hashed at, else hashed now."""
        model_path = Path(model_path).resolve()
        name = str(model_path)
        version = _file_version(model_path.stat())
        entries = self._read()
        entry = entries.get(name)
        if isinstance(entry, dict) and entry.get("file") == version and isinstance(entry.get("identity"), str):
            return entry["identity"]
        started = self._clock()
        identity = self._hash_file(model_path)
        settled = max(version[3], version[4]) < started - int(SETTLED_SECONDS * 1e9)
        if settled and _file_version(model_path.stat()) == version:
            entries.pop(name, None)
            entries[name] = {"file": version, "identity": identity}
            self._write(dict(list(entries.items())[-MAX_ENTRIES:]))
        return identity

    def _read(self) -> dict:
        try:
            with open_regular(self.path) as f:
                data = parse_json(f.read(_MAX_CACHE_FILE_BYTES))
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("version") == IDENTITY_VERSION else None
        return entries if isinstance(entries, dict) else {}

    def _write(self, entries: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"version": IDENTITY_VERSION, "entries": entries}, indent=1))
        except OSError:
            pass  # a cache: the identity is hashed again next time (the prompt cache says when its dir is read-only)


def model_identity(model_path: str | os.PathLike) -> str:
    """The identity of the model file at model_path, from the cache dir's model-identity.json when it is known."""
    return IdentityCache(cache_dir() / "model-identity.json").identity(model_path)


_loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def loaded_model_identity(model) -> str:
    """The identity of a loaded model's file (model.path) as it was when first asked for this model.

    Ask right after loading: a file replaced later, while the process runs, is not what llama.cpp holds.
    """
    identity = _loaded.get(model)
    if identity is None:
        identity = _loaded[model] = model_identity(model.path)
    return identity
