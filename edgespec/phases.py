"""Where the decoding loop's time goes, phase by phase (for `edgespec bench --overhead`)."""

from __future__ import annotations

import time

from .backend import LlamaModel


class PhaseClock:
    """Nanoseconds per phase of the decoding loop, summed over steps (for `edgespec bench --overhead`).

    A lap charges the time since the previous lap to a phase, except what the
    models spent inside llama_decode meanwhile, which goes to target_decode or
    draft_decode: the other phases are the loop's own overhead.  The engine
    holds None by default, which costs one test per phase.
    """

    PHASES = ("target_decode", "draft_decode", "propose", "logits", "verify", "rewind", "text", "controller", "stats")

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None):
        self.ns = dict.fromkeys(self.PHASES, 0)
        self.steps = 0
        self._models = {"target_decode": target, "draft_decode": draft} if draft is not None else {"target_decode": target}
        self._last = 0
        self._decode_seen: dict[str, int] = {}

    def start(self) -> None:
        """Begin a step: what happened since the last lap (the caller's own work) is not charged."""
        self._decode_seen = {name: model.decode_ns for name, model in self._models.items()}
        self._last = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        now = time.perf_counter_ns()
        elapsed = now - self._last
        for name, model in self._models.items():
            inside = model.decode_ns - self._decode_seen[name]
            self._decode_seen[name] = model.decode_ns
            self.ns[name] += inside
            elapsed -= inside
        self.ns[phase] += elapsed
        self._last = now
