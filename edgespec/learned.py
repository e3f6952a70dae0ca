"""What a model's drafters were accepted at on this machine before: the priors a new process starts from.

Every finished generation of `run`, `chat`, `batch` and `serve` adds what its draft-length
controllers observed (acceptance.py's export: accepted and tried counts per drafter, per signal
class, per draft position) to one JSON file next to the calibration cache,
`<cache dir>/learned-acceptance.json`, beside calibration.json (the cache dir is platformdirs'
user cache dir for edgespec, e.g. ~/.cache/edgespec on Linux; EDGESPEC_CACHE_DIR moves it).  Older counts fade by STORE_KEEP per generation and are capped, so
the file follows what the model does here lately.  A controller made afterwards, in this process or
the next, starts from those counts (each position worth at most LEARNED_WEIGHT observations, so the
text at hand still decides within a few steps); a model with no entry starts from the neutral
built-in priors.

Reset: `edgespec models forget-learning [MODEL]`, or delete the file.  The file only saves learning:
one that cannot be read or written is ignored, never an error.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Mapping, Sequence

from .calibration import cache_dir
from .files import atomic_write, parse_json, read_regular

LEARNED_FILE = "learned-acceptance.json"
FORMAT = 3  # 2: the n-gram drafter's counts are per copy class (acceptance.HindsightAcceptance); 3: the
# prompt's copies are a class of their own (drafters.SOURCES), so a copy class of 2 held them both
# Each finished generation multiplies the stored counts by this before adding its own.
STORE_KEEP = 0.8
# The most observations a stored position keeps; older ones are scaled away beyond it.
STORE_MAX_TRIES = 200.0
# Far past what the counts of many models take; a larger file is not this store's, and is not read whole.
MAX_FILE_BYTES = 16 << 20

Counts = Mapping[int, tuple[Sequence[float], Sequence[float]]]  # signal -> (hits, tries) per position


def merge_counts(stored: Counts, new: Counts, keep: float = STORE_KEEP) -> dict[int, tuple[list[float], list[float]]]:
    """stored * keep + new, per signal and position, each position capped at STORE_MAX_TRIES tries."""
    merged = {}
    for signal in set(stored) | set(new):
        old_hits, old_tries = stored.get(signal, ((), ()))
        new_hits, new_tries = new.get(signal, ((), ()))
        depth = max(len(old_tries), len(new_tries))
        hits, tries = [], []
        for i in range(depth):
            h = keep * _at(old_hits, i) + _at(new_hits, i)
            t = keep * _at(old_tries, i) + _at(new_tries, i)
            scale = min(1.0, STORE_MAX_TRIES / t) if t > 0 else 1.0
            hits.append(h * scale)
            tries.append(t * scale)
        merged[int(signal)] = (hits, tries)
    return merged


def forget_all(path: Path | None = None) -> Path:
    """Delete the learned priors of every model; returns the file's path."""
    path = path if path is not None else cache_dir() / LEARNED_FILE
    path.unlink(missing_ok=True)
    return path


def _stored_counts(model_entry, drafter: str) -> dict[int, tuple[list[float], list[float]]] | None:
    """A drafter's counts as stored, or None when there are none or any is not a count (a hand-edited or damaged
    file): NaN, infinite or negative counts, or more hits than tries, would steer the controllers wrong."""
    entry = model_entry.get(drafter) if isinstance(model_entry, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        counts = {int(signal): ([float(h) for h in pair[0]], [float(t) for t in pair[1]])
                  for signal, pair in entry.items()}
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):
        return None
    if not all(0.0 <= h <= t and math.isfinite(t) for hits, tries in counts.values() for h, t in zip(hits, tries)):
        return None  # NaN fails every comparison
    return counts


def _at(values: Sequence[float], i: int) -> float:
    return float(values[i]) if i < len(values) else 0.0


def model_identity(model_path: str | os.PathLike) -> str:
    """A model file as the store knows it: its resolved path and size (a new download of the same name is another model)."""
    path = Path(model_path).resolve()
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return f"{path}:{size}"


class LearnedAcceptance:
    """One model's learned priors, per drafter, in the shared file."""

    _write_lock = threading.Lock()  # the server's and a batch's threads finish generations concurrently

    def __init__(self, model_path: str | os.PathLike, path: Path | None = None, writable: bool = True) -> None:
        self.path = path if path is not None else cache_dir() / LEARNED_FILE
        self.model = model_identity(model_path)
        self.writable = writable  # False: start from the store, never add to it (a benchmark's runs)

    def prior(self, drafter: str) -> dict[int, tuple[list[float], list[float]]] | None:
        """The counts a new controller of this drafter starts from, or None for the built-in priors."""
        return _stored_counts(self._read().get(self.model), drafter)

    def learn(self, drafter: str, counts: Counts) -> None:
        """Add one generation's observed counts of this drafter to the store."""
        if not counts or not self.writable:
            return
        with self._write_lock:
            data = self._read()
            if not isinstance(data.get(self.model), dict):
                data[self.model] = {}  # none yet, or a hand-edited entry of another shape: start it afresh
            old = _stored_counts(data[self.model], drafter) or {}
            data[self.model][drafter] = {str(s): pair for s, pair in sorted(merge_counts(old, counts).items())}
            self._write(data)

    def forget(self) -> bool:
        """Drop this model's learned priors; True when there were some."""
        with self._write_lock:
            data = self._read()
            if data.pop(self.model, None) is None:
                return False
            self._write(data)
            return True

    def _read(self) -> dict:
        try:
            data = parse_json(read_regular(self.path, MAX_FILE_BYTES))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("models"), dict):
            return {}
        return data["models"]

    def _write(self, models: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"format": FORMAT, "models": models}, indent=1) + "\n")
        except OSError:
            pass  # learning is a saving, never a failure
