"""The calibration cache: measured cost curves per model and machine, and the watch that flags a stale one.

cost_profile.py's Calibrator measures a curve (curve_timing.py), the width probe, the cost of passes
over several sequences and what a draft model's token costs beside it, and keeps the results here
(CalibrationCache), keyed by what they depend on (CalibrationKey, draft_model_key).  StepTimeWatch
compares the passes seen during generation with the curve: it marks an entry stale when they no longer
match its shape, so the next load measures again, and after every generation it adds what each width's
passes cost against the curve to the entry (pass prices), so that the next load plans on what passes
cost in generation here (pass_prices.py), not on one minute's shape.  Measuring the curve again drops
the prices and the draft shares with the old curve.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import platformdirs

from .files import atomic_write, parse_json, read_regular
from .pass_prices import PassPrices, generation_prices, merge_prices, read_prices
from .sysinfo import cpu_model

MAX_AGE_DAYS = 30.0
# 2: curves reach past the bit-exact width, and entries keep the kernels' logit drift per width
CACHE_VERSION = 2
# Far past what its entries take (a few KB each); a larger file is not this cache's, and is not read whole.
MAX_CACHE_FILE_BYTES = 16 << 20
# How the cost of passes over several sequences was measured: entries measured otherwise are measured
# again.  2: with flash attention, as contexts of several sequences run (backend.context), 256 deep and
# up to 16 sequences (cost_profile.SEQUENCE_GRID); before, without it and 32 deep, which hid what
# attending over every sequence's cells costs at depth.
SEQUENCES_METHOD = 2
# How the one-sequence curve was measured: an entry measured otherwise is stale, so the next load measures
# its curve again (its widest exact width and drift kept).  2: two rounds of every width, each priced by the
# lower median of its samples (curve_timing); before, one round, where one slow pass priced a wide width
# out of drafting for good, as drafting is what would have corrected it.
CURVE_METHOD = 2
# How the widest bit-exact pass and each width's drift were found: an entry found otherwise is measured
# again whole. 2: the widths checked 264 tokens deep (backend.probing.PROBE_DEPTH), where llama.cpp's
# flash attention rounds one-token steps differently; before, 8 deep, where it does not.
WIDTH_PROBE_METHOD = 2
# The shortest time between two measurements of a model's curve that passes during generation
# call for (StepTimeWatch): a machine whose load comes and goes gets one a few times a day at most.
MIN_REMEASURE_INTERVAL_SECONDS = 6 * 3600.0
# The most passes of one generation the watch keeps for its prices (the latest): a bound for endless ones.
GENERATION_PASSES = 4096


# -- cache ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationKey:
    """What a measured curve depends on: the model file, how it runs, and the machine."""

    model_path: str
    model_size: int
    model_mtime_ns: int
    n_gpu_layers: int
    n_threads: int
    machine: str
    cpu_model: str
    cpu_count: int
    runtime: str = ""  # e.g. the llama.cpp build: new kernels change the curve
    # the KV cache types and flash attention, which change both the exact width and the speed;
    # "" is f16 keys and values without flash attention
    kv_cache: str = ""

    @classmethod
    def for_model(cls, model_path: str | os.PathLike, n_gpu_layers: int, n_threads: int, runtime: str = "",
                  kv_cache: str = ""):
        path = Path(model_path).resolve()
        stat = path.stat()
        return cls(
            model_path=str(path),
            model_size=stat.st_size,
            model_mtime_ns=stat.st_mtime_ns,
            n_gpu_layers=n_gpu_layers,
            n_threads=n_threads,
            machine=platform.machine(),
            cpu_model=cpu_model(),
            cpu_count=os.cpu_count() or 0,
            runtime=runtime,
            kv_cache=kv_cache,
        )

    def digest(self) -> str:
        fields = asdict(self)
        if not fields["kv_cache"]:
            del fields["kv_cache"]  # so the curves measured before there were KV cache types still count
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    override = os.environ.get("EDGESPEC_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("edgespec"))


def draft_model_key(model_path: str | os.PathLike, n_gpu_layers: int, kv_cache: str = "") -> str:
    """What a draft model's share of a target step depends on beyond the target's CalibrationKey (the machine,
    the threads, the build): the draft's file and how it runs."""
    path = Path(model_path).resolve()
    stat = path.stat()
    text = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, n_gpu_layers, kv_cache])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CachedCalibration:
    """A cache entry. A stale one (marked so, or too old) has a curve worth re-measuring, but its
    max_width still holds: bit-exactness depends on the model, the build and the CPU, which the
    key covers, not on how busy the machine was."""

    max_width: int  # the widest bit-exact pass
    forward_seconds: tuple[float, ...]
    stale: bool
    drift: dict[int, float] = field(default_factory=dict)  # largest logit difference from one-token passes, per width
    # (n sequences, rows each, cost against one sequence's pass of as many rows): CostModel.sequences;
    # () until a pass over several sequences is first needed (entries written before it was measured too)
    sequences: tuple[tuple[int, int, float], ...] = ()
    # width -> (summed log price, passes): what passes of that width cost in generation against the curve
    pass_prices: PassPrices = field(default_factory=dict)
    # draft_model_key -> a draft token's time over a one-token target pass, timed with this curve
    draft_shares: dict[str, float] = field(default_factory=dict)


class CalibrationCache:
    """Measured curves in one JSON file, keyed by CalibrationKey.

    The cache only saves time: an unreadable or unwritable file means measuring again, never an
    error. Writes go through a temporary file and a rename, so a reader never sees half a file.
    """

    def __init__(self, path: Path | None = None, max_age_days: float = MAX_AGE_DAYS) -> None:
        self.path = path if path is not None else cache_dir() / "calibration.json"
        self.max_age_seconds = max_age_days * 86400.0
        self.write_error: str | None = None  # why the last write failed; None once one succeeds

    def load(self, key: CalibrationKey, max_width: int, now: float | None = None) -> tuple[float, ...] | None:
        """The cached curve, or None when missing, marked stale, too old, or measured for a
        narrower max_width than asked for."""
        entry = self.load_entry(key, now)
        if entry is not None and entry[0] >= max_width:
            return entry[1]
        return None

    def load_entry(self, key: CalibrationKey, now: float | None = None) -> tuple[int, tuple[float, ...]] | None:
        """(max_width, curve) when a fresh entry is cached, else None."""
        entry = self.read(key, now)
        if entry is None or entry.stale:
            return None
        return entry.max_width, entry.forward_seconds

    def read(self, key: CalibrationKey, now: float | None = None) -> CachedCalibration | None:
        """The cached entry, fresh or stale, or None when there is none that can be read."""
        now = time.time() if now is None else now
        entry = self._read().get(key.digest())
        try:
            age = now - float(entry["measured_at"])
            max_width = int(entry["max_width"])
            curve = tuple(float(s) for s in entry["forward_seconds"])
            stale = (bool(entry["stale"]) or not 0 <= age <= self.max_age_seconds
                     or entry.get("curve_method") != CURVE_METHOD)
            drift = {int(w): float(d) for w, d in entry.get("drift", [])}
            sequences = tuple((int(n), int(rows), float(f)) for n, rows, f in entry.get("sequences", [])
                              if entry.get("sequences_method") == SEQUENCES_METHOD)
        except (TypeError, KeyError, ValueError, OverflowError):  # OverflowError: int() of 1e999, read as inf
            return None  # missing or hand-edited entry: measure again
        if entry.get("width_probe_method") != WIDTH_PROBE_METHOD:
            return None  # probed too near the start of the cache for its exact width to hold: measure again
        if max_width < 1 or not curve or not all(math.isfinite(s) and s > 0 for s in curve):
            return None
        if not all(n >= 1 and rows >= 1 and math.isfinite(f) and f > 0 for n, rows, f in sequences):
            sequences = ()  # measured again when needed
        return CachedCalibration(max_width, curve, stale, drift, sequences, read_prices(entry.get("pass_prices")),
                                 _read_draft_shares(entry.get("draft_shares")))

    def store(self, key: CalibrationKey, max_width: int, forward_seconds: tuple[float, ...], now: float | None = None,
              drift: dict[int, float] | None = None) -> None:
        entries = self._read()
        entries[key.digest()] = {
            "key": asdict(key),
            "max_width": max_width,
            "forward_seconds": list(forward_seconds),
            "drift": sorted((drift or {}).items()),
            "measured_at": time.time() if now is None else now,
            "curve_method": CURVE_METHOD,
            "width_probe_method": WIDTH_PROBE_METHOD,
            "stale": False,
        }
        self._write(entries)

    def store_sequences(self, key: CalibrationKey, sequences: tuple[tuple[int, int, float], ...]) -> None:
        """Add the cost of passes over several sequences to the entry (its age and staleness unchanged)."""
        entries = self._read()
        entry = entries.get(key.digest())
        if isinstance(entry, dict):
            entry["sequences"] = [list(point) for point in sequences]
            entry["sequences_method"] = SEQUENCES_METHOD
            self._write(entries)

    def store_draft_share(self, key: CalibrationKey, draft: str, share: float) -> None:
        """Add a draft model's share of a target step (draft: draft_model_key) to the entry; measuring the curve
        again drops it with the rest of the entry."""
        entries = self._read()
        entry = entries.get(key.digest())
        if isinstance(entry, dict):
            shares = entry.get("draft_shares")
            entry["draft_shares"] = {**(shares if isinstance(shares, dict) else {}), draft: share}
            self._write(entries)

    def add_pass_prices(self, key: CalibrationKey, prices: PassPrices) -> None:
        """Merge one generation's pass prices (generation_prices) into the entry's (its age and staleness
        unchanged)."""
        entries = self._read()
        entry = entries.get(key.digest())
        if isinstance(entry, dict) and prices:
            merged = merge_prices(read_prices(entry.get("pass_prices")), prices)
            entry["pass_prices"] = [[width, log_sum, count] for width, (log_sum, count) in sorted(merged.items())]
            self._write(entries)

    def mark_stale(self, key: CalibrationKey, now: float | None = None, min_age_seconds: float = 0.0) -> bool:
        """Mark the entry to be measured again, unless it was measured less than min_age_seconds
        before now; whether it was marked."""
        entries = self._read()
        entry = entries.get(key.digest())
        if not isinstance(entry, dict):
            return False
        now = time.time() if now is None else now
        try:
            if now - float(entry["measured_at"]) < min_age_seconds:
                return False
        except (TypeError, KeyError, ValueError):
            pass  # a hand-edited entry: measure it again
        entry["stale"] = True
        self._write(entries)
        return True

    def _read(self) -> dict:
        try:
            data = parse_json(read_regular(self.path, MAX_CACHE_FILE_BYTES))
        except (OSError, ValueError):
            return {}  # a cache: one that cannot be read is measured again and rewritten
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def _write(self, entries: dict) -> None:
        text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, text)
        except FileExistsError:  # mkdir: a file where the folder should be (EDGESPEC_CACHE_DIR=/dev/null)
            self.write_error = f"{self.path.parent} is not a folder"
        except OSError as error:  # an unwritable cache means measuring again next time (the Calibrator says so)
            self.write_error = error.strerror or str(error)
        else:
            self.write_error = None


def _read_draft_shares(stored) -> dict[str, float]:
    """An entry's draft shares; a hand-edited one that is not a positive, finite number is timed again."""
    if not isinstance(stored, dict):
        return {}
    shares = {}
    for draft, share in stored.items():
        if isinstance(share, (int, float)) and not isinstance(share, bool) and math.isfinite(share) and share > 0:
            shares[str(draft)] = float(share)
    return shares


class StepTimeWatch:
    """Compares target pass times seen during generation with the cached curve, and marks the
    cache entry stale when they disagree, so the next load measures again.

    What it compares is the curve's shape, not its scale. A busy machine slows every pass, and
    the draft-length controllers read only the shape (what a wide pass costs against a narrow
    one), so a curve that is right but slower or faster than today is no reason to measure: doing
    so at every start on a machine whose load comes and goes measured only the load, every time.
    So each width's ratio observed / cached is taken over the last `window` passes, and the entry
    is stale when the medians of two widths (each over at least `min_samples` passes) differ by
    more than a factor 1 + tolerance: wide passes got dearer or cheaper against narrow ones, as a
    curve measured under a burst of load, a changed build or an offload does. A generation that
    only ever runs one width says nothing about the shape, and marks nothing.

    An entry measured less than `min_interval_seconds` ago (by `clock`) is never marked: a shape
    that no measurement holds for long is measured again at most that often.

    The same passes price each width against the curve: `remember`, after each generation, adds what
    that generation's passes cost to the entry (generation_prices), for the next load to plan with.
    """

    def __init__(
        self,
        cache: CalibrationCache,
        key: CalibrationKey,
        forward_seconds: tuple[float, ...],
        tolerance: float = 0.5,
        min_samples: int = 16,
        window: int = 128,
        min_interval_seconds: float = MIN_REMEASURE_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache = cache
        self.key = key
        self.forward_seconds = forward_seconds
        self.tolerance = tolerance
        self.min_samples = min_samples
        self.min_interval_seconds = min_interval_seconds
        self.clock = clock
        self.drifted = False
        self._judged = False
        self._ratios: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._in_window: collections.Counter[int] = collections.Counter()  # passes of each width in _ratios
        # this generation's passes, (width, seconds over the curve's), for remember; bounded for endless ones
        self._generation: collections.deque[tuple[int, float]] = collections.deque(maxlen=GENERATION_PASSES)

    def observe(self, width: int, seconds: float) -> None:
        if not 1 <= width <= len(self.forward_seconds):
            return
        self._generation.append((width, seconds / self.forward_seconds[width - 1]))
        if self._judged:
            return
        if len(self._ratios) == self._ratios.maxlen:
            self._in_window[self._ratios[0][0]] -= 1
        self._ratios.append((width, seconds / self.forward_seconds[width - 1]))
        self._in_window[width] += 1
        # called at every pass: the medians are worth taking only once two widths have enough samples
        if sum(count >= self.min_samples for count in self._in_window.values()) < 2:
            return
        by_width: dict[int, list[float]] = {}
        for seen, ratio in self._ratios:
            by_width.setdefault(seen, []).append(ratio)
        medians = [statistics.median(r) for r in by_width.values() if len(r) >= self.min_samples]
        if len(medians) < 2 or max(medians) <= min(medians) * (1 + self.tolerance):
            return
        self._judged = True  # one verdict per watch: a new curve gets a new watch
        self.drifted = self.cache.mark_stale(self.key, self.clock(), self.min_interval_seconds)

    def remember(self) -> None:
        """After a generation: add what its passes cost per width to the cache entry's pass prices."""
        prices = generation_prices(list(self._generation))
        self._generation.clear()
        if prices:
            self.cache.add_pass_prices(self.key, prices)
