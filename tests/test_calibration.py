import dataclasses
import json
import os

import pytest

from edgespec.calibration import (
    CalibrationCache,
    CalibrationKey,
    StepTimeWatch,
    cache_dir,
    measure_curve,
)

DAY = 86400.0
NOW = 1_700_000_000.0


class TimingTable:
    """A measure callable answering from a table of seconds per width, recording each call."""

    def __init__(self, seconds_by_width, spikes=None):
        self.seconds_by_width = seconds_by_width
        self.spikes = dict(spikes or {})  # call index -> seconds to return instead
        self.calls = []

    def __call__(self, n):
        index = len(self.calls)
        self.calls.append(n)
        return self.spikes.get(index, self.seconds_by_width(n))


def cpu_like(n):
    return 0.05 * (1.0 + 0.5 * (n - 1) ** 0.8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return CalibrationCache()


@pytest.fixture
def key(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    return CalibrationKey.for_model(model, n_gpu_layers=0, n_threads=2, runtime="llama-cpp-python 0.3.36")


# -- measuring -----------------------------------------------------------------------------


def test_measures_planned_widths_narrowest_first_then_repeats_within_budget():
    timing = TimingTable(cpu_like)
    curve = measure_curve(timing, max_width=16, repeats=3, budget_seconds=100.0)

    assert timing.calls[0] == 1  # warm-up, discarded
    first_round = timing.calls[1:9]
    assert first_round == [1, 2, 3, 4, 6, 8, 12, 16]
    assert sorted(timing.calls[1:]) == sorted(first_round * 3)
    assert len(curve) == 16
    for n in (1, 2, 3, 4, 6, 8, 12, 16):
        assert curve[n - 1] == pytest.approx(cpu_like(n))
    # Widths in between are interpolated linearly.
    assert curve[4] == pytest.approx((cpu_like(4) + cpu_like(6)) / 2)
    assert curve[9] == pytest.approx((cpu_like(8) * 2 + cpu_like(12) * 2) / 4)


def test_median_of_repeats_ignores_a_spike():
    # Call 2 is the first timed pass over 2 tokens (call 0 is the warm-up).
    timing = TimingTable(cpu_like, spikes={2: 5.0})
    curve = measure_curve(timing, max_width=4, repeats=3, budget_seconds=100.0)
    assert curve[1] == pytest.approx(cpu_like(2))


def test_budget_limits_coverage_but_not_the_narrow_widths():
    timing = TimingTable(lambda n: 0.1 * n)
    curve = measure_curve(timing, max_width=32, repeats=3, budget_seconds=1.55)
    # 0.1 warm-up + 0.1 + 0.2 + 0.3 + 0.4 = 1.1; width 6 would take 0.6 more, so the rest of the
    # budget repeats the narrowest widths: 1 and 2 (1.4), then 1 (1.5).
    assert timing.calls == [1, 1, 2, 3, 4, 1, 2, 1]
    assert curve == pytest.approx((0.1, 0.2, 0.3, 0.4))


def test_narrow_widths_are_measured_even_when_the_budget_is_spent_at_once():
    timing = TimingTable(lambda n: 1.0 * n)
    curve = measure_curve(timing, max_width=16, budget_seconds=0.5)
    assert timing.calls == [1, 1, 2, 3, 4]
    assert len(curve) == 4


def test_total_time_stays_within_budget_past_the_required_widths():
    timing = TimingTable(cpu_like)
    measure_curve(timing, max_width=64, repeats=3, budget_seconds=1.0)
    required = sum(cpu_like(n) for n in (1, 1, 2, 3, 4))
    spent = sum(cpu_like(n) for n in timing.calls)
    assert spent <= max(1.0, required)
    assert spent > 0.8  # and it does use the budget


def test_measures_an_unplanned_max_width():
    timing = TimingTable(cpu_like)
    curve = measure_curve(timing, max_width=10, repeats=1, budget_seconds=100.0)
    assert timing.calls == [1, 1, 2, 3, 4, 6, 8, 10]
    assert len(curve) == 10
    assert curve[9] == pytest.approx(cpu_like(10))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_rejects_a_measure_that_returns_no_time(bad):
    with pytest.raises(ValueError, match="measure"):
        measure_curve(TimingTable(lambda n: bad), max_width=4)


# -- cache ---------------------------------------------------------------------------------


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    assert CalibrationCache().path == tmp_path / "elsewhere" / "calibration.json"


def test_round_trip(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    cache.store(key, 4, curve, now=NOW)
    assert cache.path.exists()
    assert CalibrationCache().load(key, 4, now=NOW + DAY) == curve
    assert cache.load(key, 3, now=NOW + DAY) == curve  # measured wide enough for less too


def test_miss_when_asked_for_wider_than_measured(cache, key):
    cache.store(key, 4, (0.05, 0.075, 0.11, 0.15), now=NOW)
    assert cache.load(key, 9, now=NOW) is None


def test_stale_after_max_age_or_when_from_the_future(cache, key):
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    assert cache.load(key, 2, now=NOW + 29 * DAY) is not None
    assert cache.load(key, 2, now=NOW + 31 * DAY) is None
    assert cache.load(key, 2, now=NOW - DAY) is None  # the clock went back: trust nothing


def test_marked_stale_entry_is_not_reused(cache, key):
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    cache.mark_stale(key)
    assert cache.load(key, 2, now=NOW) is None


@pytest.mark.parametrize(
    "change",
    [
        {"n_gpu_layers": -1},
        {"n_threads": 8},
        {"model_path": "/elsewhere/model.gguf"},
        {"model_size": 1},
        {"model_mtime_ns": 1},
        {"machine": "aarch64"},
        {"cpu_model": "Another CPU"},
        {"cpu_count": 64},
        {"runtime": "llama-cpp-python 0.4.0"},
    ],
)
def test_any_key_change_misses(cache, key, change):
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    assert cache.load(dataclasses.replace(key, **change), 2, now=NOW) is None
    assert cache.load(key, 2, now=NOW) is not None


def test_key_follows_the_model_file(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    before = CalibrationKey.for_model(model, 0, 2)
    assert before == CalibrationKey.for_model(model, 0, 2)
    assert before.model_size == 64
    assert before.cpu_count == os.cpu_count()

    model.write_bytes(b"GGUF" + bytes(100))
    os.utime(model, ns=(1, 1))
    after = CalibrationKey.for_model(model, 0, 2)
    assert after.digest() != before.digest()


def test_entries_for_different_keys_live_side_by_side(cache, key):
    other = dataclasses.replace(key, n_gpu_layers=-1)
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    cache.store(other, 2, (0.01, 0.011), now=NOW)
    assert cache.load(key, 2, now=NOW) == (0.05, 0.075)
    assert cache.load(other, 2, now=NOW) == (0.01, 0.011)


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 999, "entries": {}}', '{"version": 1}'])
def test_unreadable_file_is_a_miss_and_gets_replaced(cache, key, content):
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(content)
    assert cache.load(key, 2, now=NOW) is None
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    assert cache.load(key, 2, now=NOW) == (0.05, 0.075)


def test_hand_edited_entry_is_a_miss(cache, key):
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    data = json.loads(cache.path.read_text())
    del data["entries"][key.digest()]["measured_at"]
    cache.path.write_text(json.dumps(data))
    assert cache.load(key, 2, now=NOW) is None


def test_unwritable_cache_only_costs_a_new_measurement(tmp_path, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = CalibrationCache(blocker / "calibration.json")
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    assert cache.load(key, 2, now=NOW) is None
    assert cache.load_entry(key, now=NOW) is None


def test_an_entry_holds_its_width_and_curve_until_marked_stale(cache, key):
    curve = measure_curve(TimingTable(cpu_like), 8)
    cache.store(key, 8, curve, now=NOW)
    assert cache.load_entry(key, now=NOW + DAY) == (8, curve)
    cache.mark_stale(key)
    assert cache.load_entry(key, now=NOW + DAY) is None


# -- drift ---------------------------------------------------------------------------------


def watched(cache, key, curve):
    cache.store(key, len(curve), curve, now=NOW)
    return StepTimeWatch(cache, key, curve, tolerance=0.5, min_samples=8, window=16)


def test_times_matching_the_curve_keep_the_entry(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for i in range(40):
        width = i % 4 + 1
        watch.observe(width, curve[width - 1] * (1.3 if i % 2 else 0.8))
    assert not watch.drifted
    assert cache.load(key, 4, now=NOW) == curve


def test_slower_steps_mark_the_entry_stale(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for _ in range(7):
        watch.observe(2, curve[1] * 2)
    assert not watch.drifted  # too few samples to judge
    watch.observe(2, curve[1] * 2)
    assert watch.drifted
    assert cache.load(key, 4, now=NOW) is None


def test_faster_steps_mark_the_entry_stale(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(8):
        watch.observe(1, curve[0] / 3)
    assert watch.drifted


def test_drift_is_judged_on_recent_steps_only(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(100):
        watch.observe(1, curve[0])
    for _ in range(9):
        watch.observe(1, curve[0] * 3)
    assert watch.drifted  # 9 of the last 16 are slow


def test_widths_beyond_the_curve_are_not_judged(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(20):
        watch.observe(3, 10.0)
    assert not watch.drifted
