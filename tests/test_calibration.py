import dataclasses
import json
import math
import os
import random

import pytest

from edgespec.calibration import CalibrationCache, CalibrationKey, StepTimeWatch, cache_dir, draft_model_key
from edgespec.pass_prices import PRICE_CLIP, PRICE_KEEP, PRICE_MAX_PASSES, generation_prices, priced_curve

DAY = 86400.0
NOW = 1_700_000_000.0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return CalibrationCache()


@pytest.fixture
def key(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    return CalibrationKey.for_model(model, n_gpu_layers=0, n_threads=2, runtime="llama-cpp-python 0.3.36")


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


def test_a_curve_measured_the_old_way_is_stale_and_keeps_its_exact_width(cache, key):
    # Curves from before CURVE_METHOD 2 were timed in one round, where a single slow pass could price a
    # wide width out of drafting for good: they are measured again, but the width probe is not.
    cache.store(key, 8, (0.05, 0.075), now=NOW, drift={2: 0.01})
    _drop_from_every_entry(cache, "curve_method")
    entry = cache.read(key, now=NOW)
    assert entry is not None and entry.stale and entry.max_width == 8 and entry.drift == {2: 0.01}
    assert cache.load_entry(key, now=NOW) is None


def test_an_exact_width_probed_the_old_way_is_measured_again_whole(cache, key):
    # Before WIDTH_PROBE_METHOD 2 the widths were checked 8 tokens deep, where llama.cpp's flash attention
    # rounds one-token steps as wide passes do: an exact width found there is not one at a reply's depth.
    cache.store(key, 33, (0.05, 0.075), now=NOW, drift={2: 0.0})
    _drop_from_every_entry(cache, "width_probe_method")
    assert cache.read(key, now=NOW) is None


def _drop_from_every_entry(cache: CalibrationCache, field: str) -> None:
    """The cache file as an older edgespec wrote it, without field."""
    data = json.loads(cache.path.read_text())
    for entry in data["entries"].values():
        del entry[field]
    cache.path.write_text(json.dumps(data))


def test_an_entry_holds_its_width_and_curve_until_marked_stale(cache, key):
    curve = (0.05, 0.075, 0.1, 0.12, 0.14, 0.16, 0.17, 0.18)
    cache.store(key, 8, curve, now=NOW)
    assert cache.load_entry(key, now=NOW + DAY) == (8, curve)
    cache.mark_stale(key)
    assert cache.load_entry(key, now=NOW + DAY) is None


# -- drift ---------------------------------------------------------------------------------

HOUR = 3600.0


class Clock:
    """A fixed clock a test moves by hand."""

    def __init__(self, now=NOW):
        self.now = now

    def __call__(self):
        return self.now


def watched(cache, key, curve, clock=None):
    cache.store(key, len(curve), curve, now=NOW)
    return StepTimeWatch(cache, key, curve, tolerance=0.5, min_samples=8, window=32,
                         clock=clock or Clock(NOW + 7 * HOUR))


def test_times_matching_the_curve_keep_the_entry(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for i in range(80):
        width = i % 4 + 1
        watch.observe(width, curve[width - 1] * (1.3 if (i // 4) % 2 else 0.8))
    assert not watch.drifted
    assert cache.load(key, 4, now=NOW) == curve


@pytest.mark.parametrize("load", [0.3, 2.0, 5.0])
def test_a_machine_uniformly_slower_or_faster_keeps_the_entry(cache, key, load):
    # A busy machine (or one idle now that was busy then) moves every width alike: the shape the
    # controllers read is the same, and measuring again would measure only the load.
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for i in range(200):
        width = i % 4 + 1
        watch.observe(width, curve[width - 1] * load)
    assert not watch.drifted
    assert cache.load(key, 4, now=NOW) == curve


def test_wide_passes_dearer_against_narrow_ones_mark_the_entry_stale(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for _ in range(7):
        watch.observe(1, curve[0])
        watch.observe(4, curve[3] * 2)
    watch.observe(1, curve[0])
    assert not watch.drifted  # too few passes over 4 tokens to judge
    watch.observe(4, curve[3] * 2)
    assert watch.drifted
    assert cache.load(key, 4, now=NOW) is None


def test_wide_passes_cheaper_against_narrow_ones_mark_the_entry_stale(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    watch = watched(cache, key, curve)
    for _ in range(8):
        watch.observe(1, curve[0] * 3)  # the curve was measured with width 1 slowed
        watch.observe(3, curve[2])
    assert watch.drifted


def test_one_width_alone_says_nothing_about_the_shape(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(100):
        watch.observe(1, curve[0] * 3)
    assert not watch.drifted
    assert cache.load(key, 2, now=NOW) == curve


def test_drift_is_judged_on_recent_steps_only(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(100):
        watch.observe(1, curve[0])
        watch.observe(2, curve[1])
    for _ in range(9):
        watch.observe(1, curve[0])
        watch.observe(2, curve[1] * 3)
    assert watch.drifted  # 9 of the last 16 passes over 2 tokens are slow


def test_widths_beyond_the_curve_are_not_judged(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(20):
        watch.observe(1, curve[0])
        watch.observe(3, 10.0)
    assert not watch.drifted


def test_an_entry_measured_recently_is_not_marked_again(cache, key):
    curve = (0.05, 0.075)
    clock = Clock(NOW + 1 * HOUR)
    watch = watched(cache, key, curve, clock)
    for _ in range(20):
        watch.observe(1, curve[0])
        watch.observe(2, curve[1] * 3)
    assert not watch.drifted, "measured an hour ago: not again yet"
    assert cache.load(key, 2, now=NOW) == curve
    clock.now = NOW + 7 * HOUR
    later = StepTimeWatch(cache, key, curve, min_samples=8, window=32, clock=clock)
    for _ in range(20):
        later.observe(1, curve[0])
        later.observe(2, curve[1] * 3)
    assert later.drifted and cache.load(key, 2, now=NOW) is None


def test_a_machine_whose_load_comes_and_goes_measures_once_at_most_per_interval(cache, key):
    """Forty starts over two days on a machine whose load changes between starts (and within them):
    one start measures, later ones reuse the curve, even where a burst of load at measuring time
    left a wrong shape that generation then contradicts."""
    clock = Clock(NOW)
    measured_at = []

    def start(load_now, load_while_measuring):
        entry = cache.read(key, now=clock.now)
        if entry is None or entry.stale:
            measured_at.append(clock.now)
            # a burst of load during the measurement slows the wide passes more than the narrow ones
            shape = (1.0, 1.5 * load_while_measuring, 2.0 * load_while_measuring)
            cache.store(key, 3, tuple(0.05 * load_now * s for s in shape), now=clock.now)
            entry = cache.read(key, now=clock.now)
        watch = StepTimeWatch(cache, key, entry.forward_seconds, clock=clock)
        for i in range(120):  # generation: the true shape, under today's load
            width = i % 3 + 1
            watch.observe(width, 0.05 * load_now * (1.0, 1.5, 2.0)[width - 1] * (1.1 if i % 2 else 0.9))

    rng = random.Random(0)
    for _ in range(40):
        start(load_now=rng.choice([1.0, 2.0, 5.0]), load_while_measuring=rng.choice([1.0, 2.5]))
        clock.now += 1.2 * HOUR
    gaps = [b - a for a, b in zip(measured_at, measured_at[1:])]
    assert measured_at[0] == NOW and all(gap >= 6 * HOUR for gap in gaps), measured_at
    assert len(measured_at) <= 1 + 48 // 6


def test_mark_stale_says_whether_it_marked(cache, key):
    assert not cache.mark_stale(key), "no entry"
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    assert not cache.mark_stale(key, now=NOW + HOUR, min_age_seconds=2 * HOUR)
    assert cache.load(key, 2, now=NOW + HOUR) is not None
    assert cache.mark_stale(key, now=NOW + 3 * HOUR, min_age_seconds=2 * HOUR)
    assert cache.load(key, 2, now=NOW + 3 * HOUR) is None


# -- pass prices -----------------------------------------------------------------------------


def generation(watch, curve, load, prices, rounds=6):
    """One generation's passes under this load: each width at its price against the curve, with a
    one-token pass between wide ones; then the watch remembers them."""
    for _ in range(rounds):
        for width, price in prices.items():
            watch.observe(1, curve[0] * load)
            watch.observe(width, curve[width - 1] * price * load)
    watch.remember()


def test_each_generation_adds_what_its_widths_cost_against_the_one_token_passes_around_them(cache, key):
    curve = (0.05, 0.075, 0.11, 0.15)
    generation(watched(cache, key, curve), curve, load=2.0, prices={4: 1.3})
    # the next process, on a machine idle now: the load cancels
    generation(StepTimeWatch(cache, key, curve), curve, load=0.5, prices={4: 1.3})
    entry = cache.read(key, now=NOW)
    assert set(entry.pass_prices) == {4}
    log_sum, count = entry.pass_prices[4]
    assert count == pytest.approx(6 * PRICE_KEEP + 6)
    assert math.exp(log_sum / count) == pytest.approx(1.3)
    assert entry.forward_seconds == curve and not entry.stale, "the measured curve is kept as it was"


def test_a_priced_curve_leans_on_the_measurement_while_a_width_has_few_passes(cache, key):
    curve = (1.0, 1.44, 1.82, 1.86, 2.33, 2.8)
    many = {4: (32 * math.log(1.3), 32.0)}
    priced = priced_curve(curve, many)
    assert priced[0] == 1.0
    assert priced[3] / curve[3] == pytest.approx(1.3, rel=0.03), "32 passes say what width 4 costs"
    assert 1.1 < priced[4] / curve[4] < 1.25, "a near width shares much of its neighbour's price"
    assert priced[1] / curve[1] < 1.03, "a far one hardly any"
    assert list(priced) == sorted(priced), "no width is priced under a narrower one"
    one = priced_curve(curve, {4: (math.log(1.3), 1.0)})
    assert 1.0 < one[3] / curve[3] < 1.07, "one pass moves the price a little"
    assert priced_curve(curve, {}) == curve


def test_a_generation_without_enough_one_token_passes_adds_nothing(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    for _ in range(3):
        watch.observe(1, curve[0])
    for _ in range(20):
        watch.observe(2, curve[1] * 1.5)
    watch.remember()
    assert cache.read(key, now=NOW).pass_prices == {}, "the load is unknown: no price"
    assert generation_prices([(1, 1.0)] * 4 + [(2, 100.0)]) == {2: (pytest.approx(math.log(PRICE_CLIP)), 1.0)}


def test_prices_follow_the_latest_generations_and_stay_bounded(cache, key):
    curve = (0.05, 0.075, 0.11)
    watch = watched(cache, key, curve)
    for _ in range(30):
        generation(watch, curve, load=1.0, prices={2: 1.5, 3: 1.0})
    for _ in range(20):
        generation(watch, curve, load=1.0, prices={2: 1.0})
    prices = cache.read(key, now=NOW).pass_prices
    assert all(count <= PRICE_MAX_PASSES + 1e-9 for _, count in prices.values())
    assert math.exp(prices[2][0] / prices[2][1]) < 1.02, "width 2 is cheap again lately"
    assert prices[3][1] < 1.0, "width 3's old passes fade"


def test_measuring_again_drops_the_prices_and_a_damaged_list_is_ignored(cache, key):
    curve = (0.05, 0.075)
    watch = watched(cache, key, curve)
    generation(watch, curve, load=1.0, prices={2: 1.4})
    assert cache.read(key, now=NOW).pass_prices
    cache.store(key, 2, curve, now=NOW + 1)
    assert cache.read(key, now=NOW).pass_prices == {}, "prices are against the curve they were seen on"
    for damaged in ([[2, "x", 1]], [[1, 0.1, 1.0]], [[2, 50.0, 1.0]], [[2, 0.1, -1.0]], "nonsense"):
        entries = json.loads(cache.path.read_text())
        next(iter(entries["entries"].values()))["pass_prices"] = damaged
        cache.path.write_text(json.dumps(entries))
        entry = cache.read(key, now=NOW)
        assert entry is not None and entry.forward_seconds == curve and entry.pass_prices == {}, damaged


# -- a draft model's share of a target step, kept with the curve it was timed with ------------------------

def test_a_draft_share_lives_with_its_curve_and_a_damaged_one_is_timed_again(cache, key, tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF" + bytes(20))
    on_cpu, offloaded = draft_model_key(draft, 0), draft_model_key(draft, 99)
    assert on_cpu != offloaded and on_cpu != draft_model_key(draft, 0, "K q8_0, V f16, flash attention off")
    cache.store_draft_share(key, on_cpu, 0.4)
    assert cache.read(key, now=NOW) is None, "no curve, no entry to keep it in"
    cache.store(key, 2, (0.05, 0.075), now=NOW)
    cache.store_draft_share(key, on_cpu, 0.4)
    cache.store_draft_share(key, offloaded, 0.1)
    assert cache.read(key, now=NOW).draft_shares == {on_cpu: 0.4, offloaded: 0.1}
    draft.write_bytes(b"GGUF" + bytes(40))
    assert draft_model_key(draft, 0) != on_cpu, "another file is another draft"
    for damaged in ({on_cpu: "x"}, {on_cpu: -0.4}, {on_cpu: 1e999}, {on_cpu: True}, [on_cpu, 0.4], "nonsense"):
        entries = json.loads(cache.path.read_text())
        next(iter(entries["entries"].values()))["draft_shares"] = damaged
        cache.path.write_text(json.dumps(entries))
        entry = cache.read(key, now=NOW)
        assert entry is not None and entry.forward_seconds == (0.05, 0.075) and entry.draft_shares == {}, damaged
    cache.store_draft_share(key, on_cpu, 0.4)
    cache.store(key, 2, (0.05, 0.075), now=NOW + 1)
    assert cache.read(key, now=NOW).draft_shares == {}, "a share is against the curve it was timed with"
