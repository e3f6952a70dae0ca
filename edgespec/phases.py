"""Where the decoding step's time goes, phase by phase (for `edgespec bench --overhead`)."""

from __future__ import annotations

import functools
import time

from .backend import LlamaModel

# The decoder's methods that make up a step, and the phase each one's time is charged to.
TIMED_METHODS = {
    "choose_lengths": "draft_length",  # which drafter, how many tokens (n-gram controllers learn here)
    "propose": "propose",  # the drafters' proposals
    "run_pass": "target_pass",  # the target's verification pass, besides llama_decode itself
    "verify": "verify",  # rejection sampling over the target's rows
    "keep_accepted": "rewind",  # the cache cut back to what was accepted
    "learn": "controller",  # the draft-length controller's update
    "emit": "emit",  # counts, text, the step's stats
}
STEP_METHOD = "run_pass"  # one target pass per step


class PhaseClock:
    """Nanoseconds per phase of the decoder's steps, summed over steps (for `edgespec bench --overhead`).

    attach() wraps each of the decoder's step methods (TIMED_METHODS) so that
    its time goes to its phase, except what the models spent inside
    llama_decode meanwhile, which goes to target_decode or draft_decode: the
    other phases are the step's own overhead.  A decoder without a clock runs
    its methods unwrapped, at no cost.
    """

    PHASES = ("target_decode", "draft_decode", *TIMED_METHODS.values())

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None):
        self.ns = dict.fromkeys(self.PHASES, 0)
        self.steps = 0
        self._models = {"target_decode": target, "draft_decode": draft} if draft is not None else {"target_decode": target}

    def attach(self, decoder) -> None:
        """Time the decoder's steps from now on (until detach)."""
        for method, phase in TIMED_METHODS.items():
            setattr(decoder, method, self._timed(phase, getattr(decoder, method), method == STEP_METHOD))

    @staticmethod
    def detach(decoder) -> None:
        for method in TIMED_METHODS:
            vars(decoder).pop(method, None)  # the class's own method shows through again

    def _timed(self, phase: str, method, counts_step: bool):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            decode_before = {name: model.decode_ns for name, model in self._models.items()}
            started = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - started
                for name, model in self._models.items():
                    inside = model.decode_ns - decode_before[name]
                    self.ns[name] += inside
                    elapsed -= inside
                self.ns[phase] += elapsed
                self.steps += counts_step

        return timed
