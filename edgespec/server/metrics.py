"""The server's Prometheus metrics and the stale-draft alert that watches them.

Each app gets its own CollectorRegistry, so several servers (the tests start
a few) never share or clash over counters.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..monitor import AcceptanceMonitor
from ..stats import Stats

log = logging.getLogger("edgespec.serve")

_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_PASSES_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5)


class ServerMetrics:
    def __init__(self, monitor: AcceptanceMonitor):
        self.registry = CollectorRegistry()
        self.monitor = monitor
        r = self.registry
        self.requests = Counter("edgespec_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("edgespec_generations", "generations the engine finished, by why they ended "
                                   "(stop, length, context, cancelled: client gone or time limit)", ["mode", "finish_reason"], registry=r)
        self.tokens_generated = Counter("edgespec_tokens_generated", "completion tokens generated", ["mode"], registry=r)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "prompt tokens, evaluated or reused from the KV cache",
                                     ["kind"], registry=r)
        self.drafted = Counter("edgespec_draft_tokens", "tokens proposed by the drafter", ["mode"], registry=r)
        self.accepted = Counter("edgespec_draft_tokens_accepted", "drafted tokens the target kept", ["mode"], registry=r)
        self.passes_per_token = Histogram("edgespec_target_passes_per_token", "target forward passes per generated token, per request",
                                          ["mode"], buckets=_PASSES_BUCKETS, registry=r)
        self.acceptance = Histogram("edgespec_acceptance_rate", "acceptance rate per request that drafted",
                                    ["mode"], buckets=_RATIO_BUCKETS, registry=r)
        self.decode_speed = Gauge("edgespec_decode_tokens_per_second", "decode speed of the last request", ["mode"], registry=r)
        self.queue_depth = Gauge("edgespec_queue_depth", "requests waiting for the engine", registry=r)
        self.rolling_acceptance = Gauge("edgespec_draft_rolling_acceptance",
                                        f"acceptance over the last {monitor.window} requests that drafted", ["mode"], registry=r)
        self.degraded = Gauge("edgespec_draft_degraded",
                              f"1 from when the rolling acceptance falls below {monitor.threshold:g} until a window "
                              f"after that is back at {monitor.recovery_threshold:g} or more", ["mode"], registry=r)

    def start_mode(self, mode: str) -> None:
        """Export the mode's series from the start, so a scrape sees zeros rather than nothing."""
        for metric in (self.tokens_generated, self.drafted, self.accepted, self.decode_speed, self.degraded):
            metric.labels(mode)
        for kind in ("evaluated", "reused"):
            self.prompt_tokens.labels(kind)

    def record_generation(self, stats: Stats) -> None:
        """One finished generation (from the engine's thread): counters, histograms and the alert."""
        mode = stats.mode
        self.generations.labels(mode, stats.finish_reason).inc()
        self.tokens_generated.labels(mode).inc(stats.tokens_generated)
        self.prompt_tokens.labels("evaluated").inc(stats.prompt_tokens_evaluated)
        self.prompt_tokens.labels("reused").inc(stats.prompt_tokens_reused)
        self.drafted.labels(mode).inc(stats.draft_tokens_proposed)
        self.accepted.labels(mode).inc(stats.draft_tokens_accepted)
        if stats.tokens_generated:
            self.passes_per_token.labels(mode).observe(stats.target_passes_per_token)
            self.decode_speed.labels(mode).set(stats.decode_tokens_per_second)
        if stats.draft_tokens_proposed:
            self.acceptance.labels(mode).observe(stats.acceptance_rate)
        change = self.monitor.observe(mode, stats.draft_tokens_proposed, stats.draft_tokens_accepted)
        rolling = self.monitor.acceptance(mode)
        if rolling is not None:
            self.rolling_acceptance.labels(mode).set(rolling)
        if change is not None:
            self.degraded.labels(mode).set(1 if change.degraded else 0)
            (log.warning if change.degraded else log.info)(change.message)
