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
