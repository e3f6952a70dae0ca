"""The heads file: trained heads for one model file, stored next to the calibration cache.

A heads file is a numpy .npz archive (no pickles) holding the heads' arrays
and one JSON record: the format version, the model's identity (what its
content is, not its path: edgespec.model_identity, as the prompt cache keys
its snapshots), the form, the training data's size and the held-out
accuracy per head.  Its default place is
``<cache dir>/heads/<model file stem>-<identity>.npz``, so a model file that
is replaced gets no stale heads.  A file that belongs to another model, or
that numpy or zip cannot read back whole (every member has a CRC), is
refused with one line.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..calibration import cache_dir
from ..errors import EdgespecError
from ..files import atomic_write, parse_json, read_arrays
from ..model_identity import model_identity
from .network import FORMS, Heads

FORMAT = 2  # 2: the model named by edgespec.model_identity (1 had a hash of its own)


class HeadsFileError(EdgespecError):
    """A heads file is missing, damaged, or made for another model."""


def default_heads_path(model_path: str | os.PathLike, identity: str | None = None) -> Path:
    model_path = Path(model_path)
    identity = identity or model_identity(model_path)
    return cache_dir() / "heads" / f"{model_path.stem}-{identity}.npz"


@dataclass(frozen=True)
class HeadsRecord:
    """What a heads file says about itself."""

    model_identity: str
    model_name: str
    form: str
    n_heads: int
    training_tokens: int  # teacher-labelled positions the heads were trained on
    training_seconds: float
    heldout_tokens: int
    heldout_top1: tuple[float, ...]  # per head, on the target's own greedy replies to held-out prompts
    heldout_top3: tuple[float, ...]
    sources: dict = field(default_factory=dict)  # training tokens per kind of data
    format: int = FORMAT


def save_heads(path: str | os.PathLike, heads: Heads, record: HeadsRecord) -> Path:
    """Write the heads file in one rename: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    meta = json.dumps({**record.__dict__, "heldout_top1": list(record.heldout_top1),
                       "heldout_top3": list(record.heldout_top3)})
    np.savez(buffer, meta=np.frombuffer(meta.encode(), dtype=np.uint8), **heads.arrays())
    return atomic_write(path, buffer.getvalue())


def _starts_as_an_archive(path: Path) -> bool:
    """Whether path is a file that begins as the zip archive np.savez writes (a damaged heads file still does)."""
    if not path.is_file():  # a folder; a FIFO, which open() would wait on for a writer
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def read_heads(path: str | os.PathLike) -> tuple[HeadsRecord, dict[str, np.ndarray]]:
    """The record and arrays of a heads file; HeadsFileError (one line) when it cannot be read whole."""
    path = Path(path)
    try:
        arrays = read_arrays(path)
        meta = parse_json(arrays.pop("meta").tobytes().decode())  # ValueError, not RecursionError, if 100k deep
        record = HeadsRecord(**{**meta, "heldout_top1": tuple(meta["heldout_top1"]),
                                "heldout_top3": tuple(meta["heldout_top3"])})
    except FileNotFoundError:
        raise HeadsFileError(f"no heads file at {path} (train heads with `edgespec heads train --model MODEL`)") from None
    except (OSError, ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        if not _starts_as_an_archive(path):  # a folder, a source file: the advice to delete it was wrong
            raise HeadsFileError(f"{path} is not a heads file (an archive `edgespec heads train` writes); give the "
                                 "path of one, or train heads with `edgespec heads train --model MODEL`") from None
        raise HeadsFileError(f"heads file {path} is damaged (train the heads again with "
                             "`edgespec heads train --model MODEL`, or delete the file)") from None
    if record.format != FORMAT or record.form not in FORMS or not {"vocab", "a", "b", "bias"} <= arrays.keys():
        raise HeadsFileError(f"heads file {path} is of another format or version (train the heads again)")
    if not _record_holds_together(record):
        raise HeadsFileError(f"heads file {path} is damaged: its record is not one edgespec writes (train the heads "
                             "again with `edgespec heads train --model MODEL`, or delete the file)")
    return record, arrays


def _record_holds_together(record: HeadsRecord) -> bool:
    """Whether each field of a read record is of the type and range save_heads writes: the record is shown
    (heads show) and drafts with its accuracies as priors, so a string or a NaN there would fail far from here."""
    def count(value) -> bool:
        return type(value) is int and value >= 0

    def share(value) -> bool:
        return type(value) in (int, float) and 0.0 <= value <= 1.0  # False for NaN

    return (isinstance(record.model_name, str) and type(record.n_heads) is int and record.n_heads >= 1
            and count(record.training_tokens) and count(record.heldout_tokens)
            and type(record.training_seconds) in (int, float) and 0 <= record.training_seconds < math.inf
            and all(share(value) for value in (*record.heldout_top1, *record.heldout_top3))
            and isinstance(record.sources, dict) and all(count(value) for value in record.sources.values()))


def load_heads(path: str | os.PathLike, model_path: str | os.PathLike, lm_head,
               identity: str | None = None) -> tuple[HeadsRecord, Heads]:
    """The heads in path, for the model file at model_path (whose identity, when known, is given); refused with
    one line when they belong to another model.  lm_head (projection.LmHead) gives the rows of their reduced
    vocabulary."""
    record, arrays = read_heads(path)
    identity = identity or model_identity(model_path)
    if record.model_identity != identity:
        raise HeadsFileError(f"heads file {Path(path).name} was trained for {record.model_name} (another model "
                             f"file), not {Path(model_path).name} (train heads for it with `edgespec heads train`)")
    vocab, weights = arrays["vocab"], [arrays[name] for name in ("a", "b", "bias")]
    d = lm_head.n_embd
    shapes_agree = (arrays["a"].shape == arrays["b"].shape == (record.n_heads, d, d)
                    and arrays["bias"].shape == (record.n_heads, d) and vocab.ndim == 1)
    if not shapes_agree:
        raise HeadsFileError(f"heads file {path} is damaged: its arrays do not fit together or the model "
                             "(train the heads again)")
    # weights that are not finite numbers draft nothing of use, and an inf warns from inside numpy on each step
    if not all(array.dtype.kind == "f" and np.isfinite(array).all() for array in weights):
        raise HeadsFileError(f"heads file {path} is damaged: its weights are not all finite numbers "
                             "(train the heads again)")
    # a token id outside the vocabulary would index another row (numpy wraps -1) and, drafted, abort llama.cpp
    if vocab.dtype.kind not in "iu" or vocab.size == 0 or vocab.min() < 0 or vocab.max() >= lm_head.n_vocab:
        raise HeadsFileError(f"heads file {path} is damaged: its token ids are not the model's (train the heads again)")
    heads = Heads(record.form, vocab.astype(np.int32), lm_head.rows(vocab), arrays["a"].astype(np.float32),
                  arrays["b"].astype(np.float32), arrays["bias"].astype(np.float32))
    return record, heads
