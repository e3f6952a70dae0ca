"""A generation and what it hands out: a Step per verification pass, then a Done (or a Failed).

These are the values every driver of the decoder sees, whether it runs one
generation at a time (Engine.generate, a chat) or several together (the
Scheduler under batch and serve).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .controller import DraftLengthController
from .drafters import Drafter
from .errors import EdgespecError
from .sampling import SamplingParams
from .ngram_pool import NgramPool
from .prediction import prediction_usage
from .stats import Counters, Stats
from .text import TextAssembler


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # may be "" while a UTF-8 character or a possible stop string is incomplete
    drafter: str | None = None  # the drafter that proposed it ("ngram", "draft-model"); None: sampled from the target

    @property
    def drafted(self) -> bool:
        """Proposed by a drafter and accepted, rather than sampled from the target."""
        return self.drafter is not None


@dataclass(frozen=True)
class Step:
    tokens: list[Token]
    stats: Stats  # the whole generation's figures so far
    drafted: int = 0  # tokens the drafter proposed in this step
    accepted: int = 0  # of those, accepted by the verifier

    @property
    def text(self) -> str:
        """The text this step added."""
        return "".join(token.text for token in self.tokens)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "context" | "cancelled"
    stats: Stats


@dataclass(frozen=True)
class Done:
    """The end of a stream: its result.  Like a Step it has text and stats: the text is what was held back
    until the end (the start of a stop string that never came whole), which the result's text holds too."""

    result: GenerationResult
    text: str = ""

    @property
    def stats(self) -> Stats:
        return self.result.stats


@dataclass(frozen=True)
class Failed:
    """A generation that could not run or finish (its prompt does not fit, the model computed NaN ...)."""

    error: EdgespecError


@dataclass
class DrafterSet:
    """What one text drafts with: its drafters and their draft-length controllers (by drafter and fixed k).

    The engine's own drafting serves its one-at-a-time generations and keeps
    what its controllers learn across them; the scheduler gives each sequence
    it decodes together with others a drafting of its own.
    """

    drafters: dict[str, Drafter]
    controllers: dict[tuple[str, int | None], DraftLengthController] = field(default_factory=dict)
    mode: str | None = None  # the drafting mode, when not the planner's


# A generation's plain pace leans on its one-token steps' median once it has this many.
PACE_MIN_PLAIN_PASSES = 8


def _median(ordered: Sequence[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class PlainPace:
    """What a plain step costs in one generation, from its own steps, for its decode_speedup.

    The calibrated one-token pass is of another hour: a cached curve is kept while only the machine's speed
    moves (StepTimeWatch reads its shape), and against it a plain run on the AVX2 EPYC read 1.55x.  So the
    pace is the generation's own, from its whole steps (pass and all: plain decoding pays the time around
    its passes too, 1-2% of a step on a CPU, more on a GPU):

    - once it has PACE_MIN_PLAIN_PASSES one-token steps, their median, scaled by how far all its steps ran
      over their own width's median.  The median is a step that nothing interfered with; the scale puts
      back what did (a preempted step, a busy moment), which plain decoding would have paid as well, in
      proportion to its time.  The median alone read plain generations at 0.94-1.01x themselves (their
      steps' times lean right), where now a plain generation's pace is its mean step; and as the scale is
      in plain decoding's time and the generation's alike, a preempted step counts at its width's median.
    - before, the seconds of all its steps over their widths' shares of the curve (T(n) / T(1), `shape`).

    None before any step was observed.
    """

    def __init__(self, shape: Sequence[float]) -> None:
        self.shape = shape
        self._by_width: dict[int, list[float]] = {}  # each width's steps' seconds, sorted
        self._seconds = 0.0  # of every step observed
        self._shares = 0.0  # their widths' shares of the curve, summed

    def observe(self, width: int, seconds: float) -> None:
        if not (seconds > 0 and 1 <= width <= len(self.shape)):
            return
        bisect.insort(self._by_width.setdefault(width, []), seconds)
        self._seconds += seconds
        self._shares += self.shape[width - 1]

    def seconds(self) -> float | None:
        plain = self._by_width.get(1, ())
        if len(plain) >= PACE_MIN_PLAIN_PASSES:
            undisturbed = sum(len(steps) * _median(steps) for steps in self._by_width.values())
            return _median(plain) * self._seconds / undisturbed
        return self._seconds / self._shares if self._shares else None


@dataclass
class Generation:
    """One generation in progress: its sequence in the target's cache, its context, sampling and figures."""

    context: list[int]
    params: SamplingParams
    drafter_set: DrafterSet
    counters: Counters
    rng: np.random.Generator
    text: TextAssembler
    seq: int = 0
    generated: list[int] = field(default_factory=list)
    decode_start: float = 0.0
    draft_passes_at_start: int = 0  # the draft model's pass count when decoding began
    pool: NgramPool | None = None  # where its prompt and output go for other generations' drafts
    prediction: Sequence[int] = ()  # the request's predicted output, for its usage (prediction_usage)
    pass_seconds: float | None = None  # its last target pass, when timed (a lone generation on a measured curve)
    pace: PlainPace = field(default_factory=lambda: PlainPace(()))  # what its plain steps cost, from its timed passes
    # its prompt is being fed into the cache in chunks, inside other sequences' passes (Decoder.step);
    # prompt_evaluated counts the tokens fed so far, prefill_start when the feeding began
    prefilling: bool = False
    prompt_evaluated: int = 0
    prefill_start: float = 0.0
    # a pass of it held another sequence's rows: its time is theirs too, so it has no speedup of its own
    shared_a_pass: bool = False

    @property
    def finished(self) -> bool:
        return self.counters.finish_reason is not None

    def finish(self, reason: str) -> None:
        """End the generation: "stop", "length", "context" or "cancelled"."""
        self.counters.finish_reason = reason

    def pace_step(self, width: int, seconds: float, sampled_end_token: bool) -> None:
        """Pace plain decoding by a timed step of this generation (PlainPace), per token told: plain decoding
        would have made a step for the end-of-generation token too, which the tokens told leave out."""
        self.pace.observe(width, seconds)
        step_seconds, told = self.pace.seconds(), len(self.generated)
        if step_seconds is not None and told:
            self.counters.plain_step_seconds = step_seconds * (told + sampled_end_token) / told

    def done(self) -> Done:
        self.counters.decode_seconds = time.perf_counter() - self.decode_start
        if self.shared_a_pass:  # its decode time is the other sequences' too: against plain decoding it read
            self.counters.plain_step_seconds = 0.0  # 0.02-0.2x, the sharing's measure; 0.0 is "unknown"
        if self.prediction:
            usage = prediction_usage(self.prediction, self.generated)
            self.counters.accepted_prediction_tokens, self.counters.rejected_prediction_tokens = usage
        # Whatever way it ended (an end token, max_tokens, a full context, a cancel), text held back as the
        # possible start of a stop string is the answer's after all.
        held = self.text.flush()
        return Done(GenerationResult(self.text.text, self.generated, self.counters.finish_reason,
                                     self.counters.snapshot()), held)


def result_of(events: Iterator) -> GenerationResult:
    """Run a stream of events to its end and return the result it finished with."""
    result = None
    for event in events:
        if isinstance(event, Done):
            result = event.result
    return result
