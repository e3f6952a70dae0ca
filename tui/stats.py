"""What the stats bar and the per-reply footers say, from the engine's Stats."""

from __future__ import annotations

import os
import statistics
import threading
from collections import deque
from pathlib import Path

from rich.text import Text

from edgespec.control_chars import visible_controls
from edgespec.stats import MIN_REPLY_TOKENS, Stats, end_to_end_speedup, plausible_speedup

MODE_LABELS = {"combined": "n-gram + draft model", "draft-model": "draft model", "heads": "heads", "ngram": "n-gram", "none": "no drafting"}


def mode_label(mode: str, draft_model: bool = True) -> str:
    """A drafting mode as the app names it: combined picks per step between n-grams and the draft model, or,
    with no draft model loaded, the heads trained for the target."""
    if mode == "combined" and not draft_model:
        return "n-gram + heads"
    return MODE_LABELS.get(mode, mode)


def engine_mode_label(engine, mode: str | None = None) -> str:
    """The engine's drafting mode (or another it can run) as the app names it."""
    return mode_label(engine.mode if mode is None else mode, draft_model=engine.draft_path is not None)


def display_path(path: str | os.PathLike) -> str:
    """A path relative to the working directory when inside it, else with ~ for home; its control
    characters drawn as symbols (a file's name is anybody's text)."""
    return visible_controls(_shortened_path(path))


def _shortened_path(path: str | os.PathLike) -> str:
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
    """The model's file name without .gguf, its control characters drawn as symbols: a file whose name
    holds an escape sequence must not retitle the terminal from the header or the stats bar."""
    return visible_controls(Path(path).stem) if path else "—"


def step_acceptance(drafted: int, accepted: int) -> float | None:
    """Share of one step's drafted tokens that were accepted; None for a step that drafted nothing."""
    return accepted / drafted if drafted > 0 else None


def stats_line(*, mode: str, target: str, draft: str | None, stats: Stats | None,
               draft_tokens: int, context_used: int, n_ctx: int, status: str | None = None,
               width: int | None = None) -> Text:
    """The stats bar: mode, models and context (and status, e.g. a re-measurement in progress)
    on one line, the current reply's numbers on the next.  Given a width, each line drops its
    least important parts until it fits, so the bar never wraps."""
    first = [(0, Text(mode_label(mode, draft_model=draft is not None), "bold")), (0, Text(f"  {target}"))]
    if mode in ("combined", "draft-model") and draft:
        first.append((3, Text(f" ← {draft}", "dim")))
    first.append((2, Text(f"  │  ctx {context_used:,}/{n_ctx:,}")))
    if status:
        first.append((1, Text(f"  │  {status}", "italic")))
    if stats and stats.tokens_generated:
        fields = [(0, f"{stats.decode_tokens_per_second:.1f} tok/s"),
                  (1, f"accept {stats.acceptance_rate:.0%}" if stats.draft_tokens_proposed else "accept –"),
                  (3, f"{stats.target_passes_per_token:.2f} target passes/tok"),
                  (2, f"draft {draft_tokens} (avg {stats.mean_draft_tokens:.1f}/step)")]
    else:
        fields = [(0, "– tok/s"), (1, "accept –"), (3, "– target passes/tok"), (2, f"draft {draft_tokens}")]
    second = [(priority, Text(("  │  " if index else "") + field)) for index, (priority, field) in enumerate(fields)]
    return Text("\n").join([_fitted(first, width), _fitted(second, width)])


def _fitted(parts: list[tuple[int, Text]], width: int | None) -> Text:
    """The parts in order, without the least important (highest number) ones that do not fit."""
    while width is not None and len(parts) > 1 and sum(part.cell_len for _, part in parts) > width:
        least = max(priority for priority, _ in parts)
        if least == 0:
            break
        drop = max(index for index, (priority, _) in enumerate(parts) if priority == least)
        parts = parts[:drop] + parts[drop + 1:]
    line = Text()
    for _, part in parts:
        line.append_text(part)
    if width is not None:
        line.truncate(width, overflow="ellipsis")
    return line


def context_used(stats: Stats) -> int:
    return stats.prompt_tokens + stats.tokens_generated


# A plain-speed estimate stands on at least this many one-token steps: fewer say more about the
# machine's mood than about the model.
MIN_PLAIN_STEPS = 32


class PlainSpeedEstimate:
    """This model's plain decoding speed, from the steps that drafted nothing, in any mode.

    The median seconds of the last `window` such steps, once there are `min_steps`: a slow,
    contended or cancelled reply moves a median little, and a short one not at all.  Fed from the
    generation thread, read from the UI thread.
    """

    def __init__(self, min_steps: int = MIN_PLAIN_STEPS, window: int = 256):
        self.min_steps = min_steps
        self._seconds: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, drafted: int, seconds: float) -> None:
        """Take one step that took `seconds` if it was a plain one (it drafted nothing)."""
        if drafted == 0 and seconds > 0:
            with self._lock:
                self._seconds.append(seconds)

    @property
    def steps(self) -> int:
        return len(self._seconds)

    def tokens_per_second(self) -> float | None:
        with self._lock:
            if len(self._seconds) < self.min_steps:
                return None
            return 1.0 / statistics.median(self._seconds)


def _second_drafters(stats: Stats) -> tuple[str, ...]:
    """Besides n-grams, the drafters that drafted in a combined reply: the draft model, the heads (which stand
    in for it where none is loaded).  A reply's stats say who drafted, not what was loaded."""
    drafted = stats.accepted_by_drafter.keys() | stats.drafted_by_position.keys()
    return tuple(name for name in ("draft-model", "heads") if name in drafted)


def _reply_mode_label(stats: Stats) -> str:
    """The reply's drafting as its footer names it: a combined reply by the drafters it drafted with."""
    if stats.mode != "combined":
        return MODE_LABELS.get(stats.mode, stats.mode)
    return " + ".join(MODE_LABELS[name] for name in ("ngram", *_second_drafters(stats)))


def _accepted_detail(stats: Stats) -> list[str]:
    """Who proposed the accepted tokens (when both drafters could), and how many a drafting step kept."""
    parts = []
    by_drafter = {name: count for name, count in stats.accepted_by_drafter.items() if count}
    if stats.mode == "combined" and _second_drafters(stats):
        names = ("ngram", *_second_drafters(stats))
        parts.append("from " + ", ".join(f"{MODE_LABELS[name]} {by_drafter.get(name, 0)}" for name in names))
    drafting_steps = stats.steps - stats.k0_steps
    if drafting_steps > 0:
        parts.append(f"{stats.draft_tokens_accepted / drafting_steps:.1f} accepted/step")
    by_head = stats.acceptance_by_position("heads")
    if by_head:
        parts.append("heads " + " ".join(f"{rate:.0%}" for rate in by_head))
    return parts


def _own_pace(stats: Stats) -> tuple[float, str] | None:
    """Plain decoding's speed by the reply's own one-token steps (Stats.plain_step_seconds, what its stats
    JSON's speedups are against), or None when its stats have none (a given cost curve, an older saved turn)."""
    if stats.decode_speedup > 0 and stats.plain_step_seconds > 0:
        return 1.0 / stats.plain_step_seconds, "its own pace"
    return None


def reply_footer(stats: Stats, plain: tuple[float, str] | None) -> str:
    """One line under a finished reply: tokens, speed, acceptance and speedup over plain decoding.

    The speedup is against the reply's own plain pace, as in its stats JSON: the machine's speed moves
    between replies by more than drafting gains on some text.  plain, (tok/s, where it comes from) of this
    model decoding without drafting, or None, stands in for replies whose stats have no pace of their own.
    """
    tokens = stats.tokens_generated
    parts = []
    if stats.finish_reason == "cancelled":
        parts.append("stopped")
    elif stats.finish_reason == "context":
        parts.append("context full")
    elif stats.finish_reason == "length":  # the reply may be unfinished: say so, as "stopped" does
        parts.append("cut at max tokens")
    parts.append(f"{tokens} tokens")
    speed = stats.decode_tokens_per_second
    parts.append(f"{speed:.1f} tok/s")
    mode = stats.mode
    if stats.draft_tokens_proposed:
        parts.append(
            f"{_reply_mode_label(stats)} accepted {stats.acceptance_rate:.0%} "
            f"({stats.draft_tokens_accepted}/{stats.draft_tokens_proposed})"
        )
        parts.extend(_accepted_detail(stats))
    plain = _own_pace(stats) or plain
    if mode == "none":
        parts.append("plain decoding (the speedup baseline)")
    elif not plain:
        parts.append("speedup n/a (no plain-decoding speed known yet)")
    elif tokens < MIN_REPLY_TOKENS:
        parts.append("speedup n/a (too few tokens to tell)")
    else:
        plain_speed, source = plain
        ratio = plausible_speedup(stats, plain_speed)
        parts.append(f"{ratio:.2f}× vs plain {plain_speed:.1f} tok/s ({source})" if ratio is not None else
                     f"speedup n/a (plain {plain_speed:.1f} tok/s ({source}) does not fit this reply)")
        if ratio is not None and stats.decode_seconds > 0:  # the wait the user saw, prefill included, which drafting cannot shorten
            whole = end_to_end_speedup(stats.prefill_seconds, stats.decode_seconds, tokens / plain_speed)
            parts.append(f"{whole:.2f}× end to end")
    return " · ".join(parts)
