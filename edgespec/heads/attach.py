"""Heads for a loaded target: the model's own heads file, read and checked, as a drafter."""

from __future__ import annotations

import os
from pathlib import Path

from ..model_identity import loaded_model_identity
from .drafter import HeadsDrafter
from .projection import LmHead
from .store import default_heads_path, load_heads


def trained_heads(model_path: str | os.PathLike) -> Path | None:
    """The model's own heads file (next to the calibration cache), when it has been trained."""
    path = default_heads_path(model_path)
    return path if path.is_file() else None


def heads_drafter(target, heads_path: str | os.PathLike | None = None) -> HeadsDrafter:
    """The heads in heads_path (default: the target's own) drafting for target, a HiddenStateModel;
    HeadsFileError (one line) when there are none, or they are damaged or another model's."""
    lm_head = LmHead(target.path)
    identity = loaded_model_identity(target)  # the file as it was loaded, whatever happened to it since
    record, heads = load_heads(heads_path or default_heads_path(target.path, identity), target.path, lm_head.rows,
                               identity)
    return HeadsDrafter(target, heads, lm_head.row, heldout_top1=record.heldout_top1)
