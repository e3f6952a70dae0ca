"""The rolling draft-acceptance alert that `edgespec serve` (and later batch) use."""

from __future__ import annotations

import pytest

from edgespec.monitor import MIN_REQUESTS, AcceptanceMonitor


def feed(monitor: AcceptanceMonitor, mode: str, requests: list[tuple[int, int]]):
    return [monitor.observe(mode, drafted, accepted) for drafted, accepted in requests]


def test_no_verdict_until_enough_requests_drafted():
    monitor = AcceptanceMonitor(threshold=0.3, window=10)
    changes = feed(monitor, "ngram", [(10, 0)] * (MIN_REQUESTS - 1))
    assert changes == [None] * (MIN_REQUESTS - 1) and monitor.acceptance("ngram") is None
    assert not monitor.is_degraded("ngram")
    change = monitor.observe("ngram", 10, 0)
    assert change is not None and change.degraded and change.acceptance == 0.0
    assert monitor.is_degraded("ngram") and monitor.any_degraded


def test_requests_that_drafted_nothing_do_not_count():
    monitor = AcceptanceMonitor(threshold=0.3, window=2)
    assert feed(monitor, "ngram", [(0, 0)] * 5) == [None] * 5
    assert monitor.acceptance("ngram") is None


def test_trips_once_says_what_to_do_and_recovers_once():
    monitor = AcceptanceMonitor(threshold=0.3, window=3)
    changes = feed(monitor, "draft-model", [(10, 8), (10, 8), (10, 8)])
    assert changes == [None, None, None]  # 80%: healthy, nothing to report
    changes = feed(monitor, "draft-model", [(10, 0), (10, 0), (10, 0), (10, 0)])
    tripped = [c for c in changes if c is not None]
    assert len(tripped) == 1 and tripped[0].degraded
    assert changes.index(tripped[0]) == 1  # (8 + 0 + 0) / 30 < 0.3 on the second bad request
    assert "fell to 27%" in tripped[0].message and "threshold 30%" in tripped[0].message
    assert "--draft" in tripped[0].message  # it says what to do

    changes = feed(monitor, "draft-model", [(10, 9), (10, 9), (10, 9)])
    recovered = [c for c in changes if c is not None]
    assert len(recovered) == 1 and not recovered[0].degraded and "recovered" in recovered[0].message
    assert not monitor.is_degraded("draft-model")


def test_acceptance_is_pooled_over_tokens_in_the_window():
    monitor = AcceptanceMonitor(threshold=0.3, window=2)
    feed(monitor, "ngram", [(100, 0), (1, 1), (3, 3)])  # the first falls out of the window
    assert monitor.acceptance("ngram") == 1.0
    feed(monitor, "ngram", [(96, 0)])
    assert monitor.acceptance("ngram") == pytest.approx(3 / 99)


def test_modes_are_judged_apart():
    monitor = AcceptanceMonitor(threshold=0.5, window=1)
    assert monitor.observe("ngram", 10, 1).degraded
    assert monitor.observe("draft-model", 10, 9) is None
    assert monitor.is_degraded("ngram") and not monitor.is_degraded("draft-model")


@pytest.mark.parametrize("threshold, window", [(1.5, 10), (-0.1, 10), (0.3, 0)])
def test_bad_settings_are_refused(threshold, window):
    with pytest.raises(ValueError):
        AcceptanceMonitor(threshold, window)


# -- hysteresis: an acceptance hovering at the threshold must not flip the alert ------------

# Twelve requests of a batch whose pooled acceptance hovers around the default threshold (0.3):
# it crosses it on six of the eight requests judged.
HOVERING = [(10, 2), (10, 2), (10, 3), (10, 3), (10, 4), (10, 1), (10, 6), (10, 1), (10, 6), (10, 1), (10, 6), (10, 1)]


def test_an_acceptance_hovering_at_the_threshold_trips_the_alert_once():
    monitor = AcceptanceMonitor()
    changes, below = [], []
    for drafted, accepted in HOVERING:
        changes.append(monitor.observe("ngram", drafted, accepted))
        if monitor.acceptance("ngram") is not None:
            below.append(monitor.acceptance("ngram") < monitor.threshold)
    crossings = sum(a != b for a, b in zip(below, below[1:]))
    assert crossings >= 4  # a monitor without hysteresis would flip on each
    reported = [c for c in changes if c is not None]
    assert len(reported) == 1 and reported[0].degraded and monitor.is_degraded("ngram")


def test_the_batch_summary_warns_once_for_a_hovering_acceptance():
    from edgespec.commands.batch.requests import BatchRequest
    from edgespec.commands.batch.runner import RunTally, summarize

    def record(drafted: int, accepted: int) -> dict:
        usage = {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                 "speculative": {"mode": "ngram", "draft_tokens": drafted, "draft_tokens_accepted": accepted}}
        return {"error": None, "response": {"status_code": 200, "body": {"usage": usage}}}

    entries = [BatchRequest(f"r{i}", i, "/v1/chat/completions") for i in range(len(HOVERING))]
    finished = {f"r{i}": record(*figures) for i, figures in enumerate(HOVERING)}
    alerts = summarize(entries, finished, RunTally(), 0, 1.0)["draft_alerts"]
    assert len(alerts) == 1 and "fell to" in alerts[0]


def test_recovery_needs_a_margin_above_the_threshold():
    monitor = AcceptanceMonitor(threshold=0.3, window=4)
    feed(monitor, "ngram", [(10, 0)] * 4)
    assert monitor.is_degraded("ngram") and monitor.recovery_threshold == pytest.approx(0.4)
    # Above the threshold, below threshold + RECOVERY_MARGIN: still degraded, however long it lasts.
    assert feed(monitor, "ngram", [(10, 3)] * 12) == [None] * 12 and monitor.is_degraded("ngram")
    changes = feed(monitor, "ngram", [(10, 5)] * 4)
    recovered = [c for c in changes if c is not None]
    assert len(recovered) == 1 and not recovered[0].degraded and recovered[0].acceptance >= 0.4


def test_recovery_waits_until_the_window_holds_only_requests_after_the_trip():
    monitor = AcceptanceMonitor(threshold=0.3, window=5)
    changes = feed(monitor, "ngram", [(10, 2)] * 5)
    assert changes[-1] is not None and changes[-1].degraded
    # From the second full request on, the pooled acceptance is over 0.4, but requests from
    # before the trip are still in the window: the alert stands until the fifth.
    changes = feed(monitor, "ngram", [(10, 10)] * 4)
    assert changes == [None] * 4 and monitor.acceptance("ngram") == pytest.approx(0.84)
    change = monitor.observe("ngram", 10, 10)
    assert change is not None and not change.degraded and not monitor.is_degraded("ngram")


def test_a_threshold_of_one_recovers_only_at_full_acceptance():
    monitor = AcceptanceMonitor(threshold=1.0, window=1)
    assert monitor.observe("ngram", 10, 9).degraded and monitor.recovery_threshold == 1.0
    assert monitor.observe("ngram", 10, 9) is None
    assert not monitor.observe("ngram", 10, 10).degraded
