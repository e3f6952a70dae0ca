"""What the stats bar and the per-reply footers say, from the engine's stats dicts."""

from __future__ import annotations

import os
from pathlib import Path

from rich.text import Text

MODE_LABELS = {"draft-model": "draft model", "ngram": "n-gram", "none": "no drafting"}


def display_path(path: str | os.PathLike) -> str:
    """A path relative to the working directory when inside it, else with ~ for home."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        pass
    try:
        return "~/" + str(path.resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def model_name(path: str | os.PathLike | None) -> str:
    return Path(path).stem if path else "—"


def step_acceptance(previous: dict | None, current: dict) -> float | None:
    """Share of the drafted tokens accepted in the step between two stats snapshots."""
    proposed = current["draft_tokens_proposed"] - (previous["draft_tokens_proposed"] if previous else 0)
    accepted = current["draft_tokens_accepted"] - (previous["draft_tokens_accepted"] if previous else 0)
    return accepted / proposed if proposed > 0 else None


def stats_line(*, mode: str, target: str, draft: str | None, stats: dict | None,
               draft_tokens: int, context_used: int, n_ctx: int) -> Text:
    """The stats bar: mode, models and context on one line, the current reply's numbers on the next."""
    line = Text()
    line.append(MODE_LABELS.get(mode, mode), "bold")
    line.append(f"  {target}")
    if mode == "draft-model" and draft:
        line.append(f" ← {draft}", "dim")
    line.append(f"  │  ctx {context_used:,}/{n_ctx:,}\n")
    if stats and stats.get("tokens_generated"):
        fields = [f"{stats['decode_tokens_per_second']:.1f} tok/s",
                  f"accept {stats['acceptance_rate']:.0%}" if stats["draft_tokens_proposed"] else "accept –",
                  f"{stats['target_passes_per_token']:.2f} target passes/tok",
                  f"draft {draft_tokens} (avg {stats['mean_draft_tokens']:.1f}/step)"]
    else:
        fields = ["– tok/s", "accept –", "– target passes/tok", f"draft {draft_tokens}"]
    line.append("  │  ".join(fields))
    return line


def context_used(stats: dict) -> int:
    return stats["prompt_tokens"] + stats["tokens_generated"]


def reply_footer(stats: dict, plain: tuple[float, str] | None) -> str:
    """One line under a finished reply: tokens, speed, acceptance and speedup over plain decoding.

    plain is (tok/s, where it comes from) of this model decoding without drafting, or None.
    """
    tokens = stats["tokens_generated"]
    parts = []
    if stats.get("finish_reason") == "cancelled":
        parts.append("stopped")
    elif stats.get("finish_reason") == "context":
        parts.append("context full")
    parts.append(f"{tokens} tokens")
    speed = stats["decode_tokens_per_second"]
    parts.append(f"{speed:.1f} tok/s")
    mode = stats.get("mode", "none")
    if stats["draft_tokens_proposed"]:
        parts.append(
            f"{MODE_LABELS.get(mode, mode)} accepted {stats['acceptance_rate']:.0%} "
            f"({stats['draft_tokens_accepted']}/{stats['draft_tokens_proposed']})"
        )
    if mode == "none":
        parts.append("plain decoding (the speedup baseline)")
    elif plain and tokens:
        plain_speed, source = plain
        parts.append(f"{speed / plain_speed:.2f}× vs plain {plain_speed:.1f} tok/s ({source})")
    else:
        parts.append("speedup n/a (no plain-decoding speed known yet)")
    return " · ".join(parts)
