"""Scripted replies for the chat app's tests: an Engine.stream_tokens stand-in with fixed tokens and figures.

What a model generates depends on the CPU's kernels, and how fast it does so on
the machine and its load, so a UI test that shows or waits for either is not
repeatable.  A ScriptedReply streams the text it is given in fixed tokens and
steps, with fixed figures: every step takes `seconds_per_step` of decode time.
The app, the chat session and the tokenizer around it stay real; only the
engine's generation is replaced (`use_script`), through its public method.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from edgespec.engine import Done, GenerationResult, Step, Token
from edgespec.stats import Stats

FILLER = "All work and no play. "  # what an endless reply repeats


@dataclass
class ScriptedReply:
    text: str
    drafted: list = field(default_factory=list)  # [start, end) character ranges that arrive as accepted drafts
    mode: str = "ngram"  # the Stats' mode, and the drafter of the drafted tokens (the n-gram one for "combined")
    chars_per_token: int = 3
    seconds_per_step: float = 0.025
    rejected_per_drafting_step: int = 1  # drafted tokens the verifier refused, in each step that drafted
    endless: bool = False  # after the text, stream FILLER until cancelled, whatever max_tokens says
    pause_s: float = 0.0  # between steps: lets a test see a reply while it streams; no figure depends on it
    started: threading.Event = field(default_factory=threading.Event)  # set once the first step is out

    def tokens(self, text: str, offset: int = 0) -> list[Token]:
        """text cut into tokens of chars_per_token characters, cut also where a drafted range starts or ends."""
        cuts = {0, len(text)} | {min(max(edge - offset, 0), len(text)) for span in self.drafted for edge in span}
        cuts |= set(range(0, len(text), self.chars_per_token))
        edges = sorted(cuts)
        drafter = "draft-model" if self.mode == "draft-model" else "ngram"
        return [Token(0, text[start:end], drafter if self._is_drafted(offset + start) else None)
                for start, end in zip(edges, edges[1:])]

    def _is_drafted(self, position: int) -> bool:
        return any(start <= position < end for start, end in self.drafted)

    def stream_tokens(self, prompt_ids, params, cancel: threading.Event | None = None, shift_dropped_span=False,
                      prediction=None):
        counts = _Counts(self.mode, len(prompt_ids))
        text = ""
        for step in self._steps(params.max_tokens):
            if cancel is not None and cancel.is_set():
                yield Done(GenerationResult(text, [0] * counts.tokens, "cancelled", counts.stats(self, "cancelled")))
                return
            accepted = sum(token.drafted for token in step)
            drafted = accepted + self.rejected_per_drafting_step if accepted else 0
            counts.add(len(step), drafted, accepted)
            text += "".join(token.text for token in step)
            yield Step(step, counts.stats(self), drafted=drafted, accepted=accepted)
            self.started.set()
            if self.pause_s:
                time.sleep(self.pause_s)
        reason = "length" if counts.tokens >= params.max_tokens else "stop"
        yield Done(GenerationResult(text, [0] * counts.tokens, reason, counts.stats(self, reason)))

    def _steps(self, max_tokens: int):
        """Steps of the reply: a run of drafted tokens and the target's token after them, or that token alone."""
        tokens = self.tokens(self.text)
        position = len(self.text)
        emitted, step = 0, []
        while tokens and (emitted < max_tokens or self.endless):
            token = tokens.pop(0)
            step.append(token)
            emitted += 1
            if not token.drafted or emitted == max_tokens or not tokens:
                yield step
                step = []
            if not tokens and self.endless:
                tokens, position = self.tokens(FILLER, position), position + len(FILLER)
        if step:
            yield step


class _Counts:
    def __init__(self, mode: str, prompt_tokens: int):
        self.mode, self.prompt_tokens = mode, prompt_tokens
        self.tokens = self.steps = self.k0_steps = self.proposed = self.accepted = 0

    def add(self, tokens: int, drafted: int, accepted: int) -> None:
        self.tokens += tokens
        self.steps += 1
        self.k0_steps += drafted == 0
        self.proposed += drafted
        self.accepted += accepted

    def stats(self, script: ScriptedReply, finish_reason: str | None = None) -> Stats:
        decode_seconds = self.steps * script.seconds_per_step
        by_drafter = {"draft-model" if self.mode == "draft-model" else "ngram": self.accepted}
        return Stats(
            mode=self.mode, prompt_tokens=self.prompt_tokens, prompt_tokens_evaluated=self.prompt_tokens,
            tokens_generated=self.tokens, draft_tokens_proposed=self.proposed, draft_tokens_accepted=self.accepted,
            acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
            target_forward_passes=self.steps, target_passes_per_token=self.steps / self.tokens if self.tokens else 0.0,
            steps=self.steps, k0_steps=self.k0_steps,
            mean_draft_tokens=self.proposed / self.steps if self.steps else 0.0, decode_seconds=decode_seconds,
            decode_tokens_per_second=self.tokens / decode_seconds if decode_seconds else 0.0,
            finish_reason=finish_reason, accepted_by_drafter=by_drafter if self.mode != "none" else {},
        )


def use_script(engine, script: ScriptedReply) -> ScriptedReply:
    """Make engine's generations follow script from now on (each one the whole script again)."""
    engine.stream_tokens = script.stream_tokens
    return script
