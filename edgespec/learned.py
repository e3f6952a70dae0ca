"""What a model's drafters were accepted at on this machine before: the priors a new process starts from.

Every finished generation of `run`, `chat`, `batch` and `serve` adds what its draft-length
controllers observed (acceptance.py's export: accepted and tried counts per drafter, per signal
class, per draft position) to one JSON file next to the calibration cache,
`<cache dir>/learned-acceptance.json`, beside calibration.json (the cache dir is platformdirs'
user cache dir for edgespec, e.g. ~/.cache/edgespec on Linux; EDGESPEC_CACHE_DIR moves it).  Older
counts fade by STORE_KEEP per generation and are capped, so the file follows what the model does here
lately.  A controller made afterwards, in this process or the next, starts from those counts; a model
with no entry starts from the neutral built-in priors.

How much a learned rate is worth depends on how far the generations that saw it agreed.  Each position
also keeps the spread of its generations' own rates (SPREAD_KEEP fades it), and a prior is worth
what a Beta distribution of that spread is worth, the empirical Bayes weight p (1 - p) / var - 1,
between MIN_PRIOR_WEIGHT and acceptance.LEARNED_WEIGHT_MAX observations.  Where one kind of work
repeats (code edits all day), its copies go on alike from one reply to the next and the prior starts
a reply where the last ones ended; where kinds mix, or fewer than SPREAD_MIN_GENERATIONS generations
saw the position, it is worth the minimum, and the text at hand decides within a few steps either way.

Reset: `edgespec models forget-learning [MODEL]`, or delete the file.  The file only saves learning:
one that cannot be read or written is never an error.  One that is not a store (a crash's half, a
hand edit that broke it) is said once through the notice and moved aside to
`learned-acceptance.json.unreadable` (`.unreadable.1`, ... when that is taken) before a new one is
begun, so no edit of it is lost; one a newer edgespec wrote is read by none of its counts and never
written over.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .acceptance import LEARNED_WEIGHT_MAX
from .calibration import cache_dir
from .files import FileTooLarge, NotARegularFile, atomic_write, parse_json, read_regular, update_lock
from .notices import log_notice

LEARNED_FILE = "learned-acceptance.json"
UNREADABLE_SUFFIX = ".unreadable"  # where a file that is not a store is moved before a new one is begun
FORMAT = 4  # 2: the n-gram drafter's counts are per copy class (hindsight.HindsightAcceptance); 3: the
# prompt's copies are a class of their own (drafters.SOURCES), so a copy class of 2 held them both;
# 4: each position keeps its generations' spread, which weighs its prior
# Each finished generation multiplies the stored counts by this before adding its own.
STORE_KEEP = 0.8
# The most observations a stored position keeps; older ones are scaled away beyond it.
STORE_MAX_TRIES = 200.0
# The spread of the generations' rates at a position: a generation counts towards it where it tried the
# position at least SPREAD_MIN_TRIES times (fewer say more about chance than about the text), older
# generations fade by SPREAD_KEEP (about the last ten count), and a spread is trusted from
# SPREAD_MIN_GENERATIONS (faded) generations on.  Before that a prior is worth MIN_PRIOR_WEIGHT
# observations, as every prior was before the spread was kept.  Replayed over the five reply sets
# (benchmarks/ngram_sim.py), the tenth of a run of code edits started 1-10% faster than with a fixed
# weight of 2, and no kind of a mixed run lost more than 3%.
SPREAD_KEEP = 0.9
SPREAD_MIN_TRIES = 3.0
SPREAD_MIN_GENERATIONS = 5.0
MIN_PRIOR_WEIGHT = 2.0
# Far past what the counts of many models take; a larger file is not this store's, and is not read whole.
MAX_FILE_BYTES = 16 << 20

Counts = Mapping[int, tuple[Sequence[float], Sequence[float]]]  # signal -> (hits, tries) per position
# What the store keeps per signal: for each field, one value per position.  hits and tries are the faded
# counts; generations, rates, squares and inverse_tries the faded count of the generations that tried the
# position SPREAD_MIN_TRIES times or more, and the sums of their rates, squared rates and 1 / tries.
FIELDS = ("hits", "tries", "generations", "rates", "squares", "inverse_tries")
Stored = dict[int, dict[str, list[float]]]


def add_generation(stored: Mapping[int, Mapping[str, Sequence[float]]], new: Counts) -> Stored:
    """The store after one more generation's counts: the old ones faded, each position's tries capped at
    STORE_MAX_TRIES, and the generation's rate added to the spread where it tried the position enough."""
    merged: Stored = {}
    for signal in set(stored) | set(new):
        old = stored.get(signal, {})
        new_hits, new_tries = new.get(signal, ((), ()))
        depth = max(len(old.get("tries", ())), len(new_tries))
        entry: dict[str, list[float]] = {field: [] for field in FIELDS}
        for i in range(depth):
            hits = STORE_KEEP * _at(old.get("hits", ()), i) + _at(new_hits, i)
            tries = STORE_KEEP * _at(old.get("tries", ()), i) + _at(new_tries, i)
            scale = min(1.0, STORE_MAX_TRIES / tries) if tries > 0 else 1.0
            entry["hits"].append(hits * scale)
            entry["tries"].append(tries * scale)
            tried = _at(new_tries, i)
            counted = tried >= SPREAD_MIN_TRIES
            rate = _at(new_hits, i) / tried if counted else 0.0
            for field, value in (("generations", float(counted)), ("rates", rate), ("squares", rate * rate),
                                 ("inverse_tries", 1.0 / tried if counted else 0.0)):
                entry[field].append(SPREAD_KEEP * _at(old.get(field, ()), i) + value)
        merged[int(signal)] = entry
    return merged


def prior_weight(hits: float, tries: float, generations: float, rates: float, squares: float,
                 inverse_tries: float) -> float:
    """How many observations a stored position's rate is worth to a new controller: what a Beta distribution
    with the spread of the generations' own rates is worth, less the spread chance alone gives their counts;
    MIN_PRIOR_WEIGHT until enough generations saw the position, never above LEARNED_WEIGHT_MAX or the tries."""
    if tries <= 0.0:
        return 0.0
    if generations < SPREAD_MIN_GENERATIONS:
        return min(MIN_PRIOR_WEIGHT, tries)
    p = hits / tries
    mean = rates / generations
    spread = max(0.0, squares / generations - mean * mean) * generations / (generations - 1.0)
    between = spread - p * (1.0 - p) * inverse_tries / generations  # less what each generation's few tries add
    weight = LEARNED_WEIGHT_MAX if between <= 1e-9 else p * (1.0 - p) / between - 1.0
    return min(max(MIN_PRIOR_WEIGHT, min(LEARNED_WEIGHT_MAX, weight)), tries)


def prior_counts(stored: Mapping[int, Mapping[str, Sequence[float]]]) -> dict[int, tuple[list[float], list[float]]]:
    """The counts a new controller starts from: each stored position's rate, worth prior_weight observations."""
    counts = {}
    for signal, entry in stored.items():
        hits, tries = [], []
        for i, tried in enumerate(entry["tries"]):
            weight = prior_weight(*(float(entry[field][i]) for field in FIELDS))
            hits.append(float(entry["hits"][i]) * weight / tried if tried > 0 else 0.0)
            tries.append(weight)
        counts[int(signal)] = (hits, tries)
    return counts


def _free_name(path: Path) -> Path:
    """path, or path.1, path.2, ... whichever no file has yet: a second damaged store moved aside over the
    first one's copy lost the first hand edit."""
    candidate, number = path, 0
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def forget_all(path: Path | None = None) -> Path:
    """Delete the learned priors of every model; returns the file's path."""
    path = path if path is not None else cache_dir() / LEARNED_FILE
    path.unlink(missing_ok=True)
    return path


def _stored_entry(model_entry, drafter: str) -> Stored | None:
    """A drafter's stored counts, or None when there are none or any is not a count (a hand-edited or damaged
    file): a field missing or of another length, NaN, infinite or negative values, more hits than tries or
    more rates than generations would steer the controllers wrong."""
    entry = model_entry.get(drafter) if isinstance(model_entry, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        stored = {int(signal): {field: [float(v) for v in fields[field]] for field in FIELDS}
                  for signal, fields in entry.items()}
    except (TypeError, ValueError, KeyError, OverflowError):
        return None
    for fields in stored.values():
        columns = [fields[field] for field in FIELDS]
        if len({len(column) for column in columns}) != 1:
            return None
        for hits, tries, generations, rates, squares, inverse_tries in zip(*columns):
            # NaN fails every comparison
            if not (0.0 <= hits <= tries and 0.0 <= rates <= generations and 0.0 <= squares <= rates
                    and 0.0 <= inverse_tries and math.isfinite(tries + generations + inverse_tries)):
                return None
    return stored


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

    _write_lock = threading.Lock()  # the server's and a batch's threads finish generations concurrently;
    # update_lock keeps other processes' updates (a chat beside a server) from being written over

    def __init__(self, model_path: str | os.PathLike, path: Path | None = None, writable: bool = True,
                 notice: Callable[[str], None] = log_notice) -> None:
        self.path = path if path is not None else cache_dir() / LEARNED_FILE
        self.model = model_identity(model_path)
        self.writable = writable  # False: start from the store, never add to it (a benchmark's runs)
        self.notice = notice  # where a file that is not a store is said, once per store
        self._said = False

    def prior(self, drafter: str) -> dict[int, tuple[list[float], list[float]]] | None:
        """The counts a new controller of this drafter starts from, or None for the built-in priors."""
        stored = _stored_entry((self._read() or {}).get(self.model), drafter)
        return prior_counts(stored) if stored is not None else None

    def learn(self, drafter: str, counts: Counts) -> None:
        """Add one generation's observed counts of this drafter to the store."""
        if not counts or not self.writable:
            return
        with self._write_lock, update_lock(self.path):
            data = self._read()
            if data is None:
                return
            entry = data.get(self.model)
            damaged = entry is not None and not isinstance(entry, dict)
            if not isinstance(entry, dict):
                entry = data[self.model] = {}  # none yet, or a hand-edited entry of another shape: start it afresh
            old = _stored_entry(entry, drafter)
            if damaged or (old is None and drafter in entry):
                self._say_once(f"the learned priors of this model in {self.path} are not counts (a hand edit?); "
                               f"began its counts for {drafter} drafts anew")
            entry[drafter] = {str(s): kept for s, kept in sorted(add_generation(old or {}, counts).items())}
            self._write(data)

    def forget(self) -> bool:
        """Drop this model's learned priors; True when there were some."""
        with self._write_lock, update_lock(self.path):
            data = self._read()
            if data is None or data.pop(self.model, None) is None:
                return False
            self._write(data)
            return True

    def _read(self) -> dict:
        """The models' entries, {} where there are none to read (no file, an older format's, one that is not a
        store: said once); None for a newer edgespec's file, which this one neither reads nor writes over."""
        try:
            data = parse_json(read_regular(self.path, MAX_FILE_BYTES))
        except FileNotFoundError:
            return {}
        except NotARegularFile:  # a FIFO or a device: nothing in it to keep, and a rename replaces it
            return self._unreadable("it is not a regular file", move=False)
        except FileTooLarge:
            return self._unreadable(f"it is larger than {MAX_FILE_BYTES >> 20} MiB, which no store grows to")
        except OSError as error:  # unreadable for now (permissions): learning into it waits, as writes fail too
            return self._unreadable(error.strerror or str(error), move=False)
        except ValueError:
            return self._unreadable("it is not JSON")
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or type(data.get("format")) is not int:
            return self._unreadable("it is not a learned-priors file")
        if data["format"] > FORMAT:
            return self._unreadable(f"a newer edgespec wrote it (format {data['format']}); this one only reads "
                                    f"format {FORMAT}, so it starts from the built-in priors and leaves the file be",
                                    move=False, keep=True)
        return data["models"] if data["format"] == FORMAT else {}  # an older format's counts mean other things

    def _unreadable(self, why: str, move: bool = True, keep: bool = False) -> dict | None:
        """{} after saying once why the file is not read, and moving it aside where a write would replace it
        (move: it may hold someone's edit); keep: None, so that nothing is written over it."""
        aside = _free_name(self.path.with_name(self.path.name + UNREADABLE_SUFFIX))
        moved = False
        if move and self.writable:
            try:
                os.replace(self.path, aside)
                moved = True
            except OSError:
                pass  # then the next write fails alike, and learning is only not kept
        where = f"; moved it to {aside.name} and began a new one" if moved else ""
        self._say_once(f"the learned priors in {self.path} are not read: {why}{where}")
        return None if keep else {}

    def _say_once(self, text: str) -> None:
        """Say what is wrong with the file once per store, not at every generation's read."""
        if not self._said:
            self._said = True
            self.notice(text)

    def _write(self, models: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"format": FORMAT, "models": models}, indent=1) + "\n")
        except OSError:
            pass  # learning is a saving, never a failure
