"""Rolling acceptance per drafting mode, and the alert when a draft goes stale.

A draft whose acceptance keeps falling (the target was fine-tuned, the
workload stopped copying its prompts) costs time instead of saving it.  The
monitor keeps the last `window` requests that drafted anything, per mode,
and judges the pooled acceptance (accepted / drafted tokens) over them once
it has seen `min(window, MIN_REQUESTS)` of them.  It reports a change of
state, degraded or recovered, once; callers (the server, a batch run) log it
and show the state.  Plain decoding ("none") drafts nothing and is never judged.

The state has hysteresis, so an acceptance that hovers near the threshold
does not flip the alert on and off with every request: it trips as soon as
the pooled acceptance falls below `threshold`, and clears only once every
request in the window came after the trip and their pooled acceptance is at
least `threshold + RECOVERY_MARGIN`.  So one alert and its recovery are at
least `window` requests apart.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.3
DEFAULT_WINDOW = 20
MIN_REQUESTS = 5  # judging fewer requests than this would alert on noise
RECOVERY_MARGIN = 0.1  # how far above the threshold acceptance must be to clear the alert

_ADVICE = {
    "ngram": "n-gram drafting only pays when replies copy their prompt; "
             "use a draft model (--draft FILE) or --draft none for this workload",
    "draft-model": "the draft model no longer predicts this target (was the target fine-tuned?); "
                   "replace it with a draft trained for this target, or use --draft ngram or --draft none",
}


@dataclass(frozen=True)
class AlertChange:
    mode: str
    degraded: bool  # True: it just fell below the threshold; False: it just recovered
    acceptance: float
    message: str  # one line for the log that says what happened and what to do


class AcceptanceMonitor:
    def __init__(self, threshold: float = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError("the acceptance alert threshold must be between 0 and 1")
        if window < 1:
            raise ValueError("the acceptance window must hold at least one request")
        self.threshold = threshold
        self.recovery_threshold = min(1.0, threshold + RECOVERY_MARGIN)
        self.window = window
        self._recent: dict[str, deque[tuple[int, int]]] = {}  # mode -> (drafted, accepted) per request
        self._since_trip: dict[str, int] = {}  # degraded mode -> requests that drafted since it tripped

    def observe(self, mode: str, drafted: int, accepted: int) -> AlertChange | None:
        """Record one finished request; return the change of state it caused, if any."""
        if drafted <= 0:
            return None
        recent = self._recent.setdefault(mode, deque(maxlen=self.window))
        recent.append((drafted, accepted))
        if mode in self._since_trip:
            self._since_trip[mode] += 1
        acceptance = self.acceptance(mode)
        if acceptance is None:
            return None
        if mode not in self._since_trip:
            if acceptance >= self.threshold:
                return None
            self._since_trip[mode] = 0
            return AlertChange(mode, True, acceptance, self._message(mode, True, acceptance))
        window_renewed = self._since_trip[mode] >= len(recent)
        if not window_renewed or acceptance < self.recovery_threshold:
            return None
        del self._since_trip[mode]
        return AlertChange(mode, False, acceptance, self._message(mode, False, acceptance))

    def acceptance(self, mode: str) -> float | None:
        """Pooled acceptance over the window, or None until enough requests drafted."""
        recent = self._recent.get(mode, ())
        if len(recent) < min(self.window, MIN_REQUESTS):
            return None
        drafted = sum(d for d, _ in recent)
        return sum(a for _, a in recent) / drafted

    def is_degraded(self, mode: str) -> bool:
        return mode in self._since_trip

    @property
    def any_degraded(self) -> bool:
        return bool(self._since_trip)

    def _message(self, mode: str, degraded: bool, acceptance: float) -> str:
        span = f"over the last {len(self._recent[mode])} requests"
        if not degraded:
            return f"draft acceptance ({mode}) recovered to {acceptance:.0%} {span}"
        advice = _ADVICE.get(mode, "replace the drafter or use --draft none")
        return (f"draft acceptance ({mode}) fell to {acceptance:.0%} {span}, below the alert threshold "
                f"{self.threshold:.0%}: {advice}")
