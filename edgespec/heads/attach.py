"""Heads for a loaded target: the model's own heads file, read and checked, as a drafter."""

from __future__ import annotations

import os
from pathlib import Path

from ..model_identity import loaded_model_identity
from .drafter import HeadsDrafter
from .projection import LmHead
from .store import default_heads_path, load_heads
from .usage import UsageLog, usage_dir

LEARN_FROM_USAGE = "EDGESPEC_LEARN_HEADS"  # "1": keep what verification kept, for the next heads train (heads.usage)


def trained_heads(model_path: str | os.PathLike) -> Path | None:
    """The model's own heads file (next to the calibration cache), when it has been trained."""
    path = default_heads_path(model_path)
    return path if path.is_file() else None


def heads_drafter(target, heads_path: str | os.PathLike | None = None) -> HeadsDrafter:
    """The heads in heads_path (default: the target's own) drafting for target, a HiddenStateModel;
    HeadsFileError (one line) when there are none, or they are damaged or another model's.  With
    EDGESPEC_LEARN_HEADS=1 the target also keeps what verification kept (learn_from_usage)."""
    lm_head = LmHead(target.path)
    identity = loaded_model_identity(target)  # the file as it was loaded, whatever happened to it since
    record, heads = load_heads(heads_path or default_heads_path(target.path, identity), target.path, lm_head, identity)
    if os.environ.get(LEARN_FROM_USAGE) == "1":
        learn_from_usage(target)
    return HeadsDrafter(target, heads, lm_head.row, heldout_top1=record.heldout_top1)


def learn_from_usage(target) -> None:
    """Keep the rows verification keeps in target (a HiddenStateModel), for the next `heads train` of its model."""
    target.usage_sink = UsageLog(usage_dir(default_heads_path(target.path, loaded_model_identity(target))),
                                 target.n_embd)
