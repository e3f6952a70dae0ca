import pytest

from edgespec.curve_timing import NARROW_SAMPLES, measure_curve


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


# -- measuring -----------------------------------------------------------------------------


def test_measures_planned_widths_narrowest_first_then_repeats_within_budget():
    timing = TimingTable(cpu_like)
    curve = measure_curve(timing, max_width=16, repeats=3, budget_seconds=100.0, narrow_budget_seconds=0.0)

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
    curve = measure_curve(timing, max_width=32, repeats=3, budget_seconds=1.55, budget_passes=0.0,
                          narrow_budget_seconds=0.0)
    # 0.1 warm-up + 0.1 + 0.2 + 0.3 + 0.4 = 1.1; width 6 would take 0.6 more, so the rest of the
    # budget repeats the narrowest widths: 1 and 2 (1.4), then 1 (1.5).
    assert timing.calls == [1, 1, 2, 3, 4, 1, 2, 1]
    assert curve == pytest.approx((0.1, 0.2, 0.3, 0.4))


def test_narrow_widths_are_measured_even_when_the_budget_is_spent_at_once():
    timing = TimingTable(lambda n: 1.0 * n)
    curve = measure_curve(timing, max_width=16, budget_seconds=0.5, budget_passes=0.0, narrow_budget_seconds=0.0)
    assert timing.calls == [1, 1, 2, 3, 4]
    assert len(curve) == 4


def test_total_time_stays_within_budget_past_the_required_widths():
    timing = TimingTable(cpu_like)
    measure_curve(timing, max_width=64, repeats=3, budget_seconds=1.0, budget_passes=0.0, narrow_budget_seconds=0.0)
    required = sum(cpu_like(n) for n in (1, 1, 2, 3, 4))
    spent = sum(cpu_like(n) for n in timing.calls)
    assert spent <= max(1.0, required)
    assert spent > 0.8  # and it does use the budget


def test_a_slower_machine_measures_the_same_widths_in_more_time():
    def avx2_like(n):  # T(1) 90 ms, T(16) about 6 T(1): a CPU three times slower than the budget was set on
        return 0.09 * (1.0 + 0.34 * (n - 1))

    by_seconds = TimingTable(avx2_like)
    short = measure_curve(by_seconds, max_width=33, repeats=3, budget_seconds=3.0, budget_passes=0.0,
                          narrow_budget_seconds=0.0)
    assert len(short) < 33  # three seconds end the curve before its widest passes

    timing = TimingTable(avx2_like)
    curve = measure_curve(timing, max_width=33, repeats=3, budget_seconds=3.0, budget_passes=60,
                          narrow_budget_seconds=0.0)
    assert len(curve) == 33 and curve[15] == pytest.approx(avx2_like(16))
    assert sum(avx2_like(n) for n in timing.calls[1:]) <= 60 * avx2_like(1)  # the warm-up aside

    fast = TimingTable(cpu_like)  # a machine where three seconds hold 60 one-token passes measures as before
    plain = TimingTable(cpu_like)
    measure_curve(fast, max_width=33, budget_seconds=3.0, budget_passes=60, narrow_budget_seconds=0.0)
    measure_curve(plain, max_width=33, budget_seconds=3.0, budget_passes=0.0, narrow_budget_seconds=0.0)
    assert fast.calls == plain.calls


# The AVX-512 EPYC's curve, T(n) / T(1) with T(1) 44.6 ms: one round to 33 is about 80 one-token passes.
AVX512_EPYC = {1: 1.0, 2: 1.79, 3: 2.6, 4: 3.25, 6: 4.16, 8: 7.35, 12: 8.31, 16: 9.02, 24: 13.49, 32: 14.16, 33: 15.12}


def avx512_like(n):
    return 0.0446 * AVX512_EPYC.get(n, n * 0.46)


def test_a_steep_curve_is_measured_to_its_widest_pass_within_the_default_budget():
    curve = measure_curve(TimingTable(avx512_like), max_width=33)
    assert len(curve) == 33 and curve[31] == pytest.approx(avx512_like(32))


def test_a_spike_in_one_wide_pass_does_not_price_its_width_within_the_default_budget():
    # Call 0 is the warm-up and calls 1-9 the first round's widths 1-24, so call 10 is the first pass over
    # 32 tokens: slowed by a quarter, as about one wide pass in seven is by 8-24% on that machine.
    timing = TimingTable(avx512_like, spikes={10: 1.25 * avx512_like(32)})
    curve = measure_curve(timing, max_width=33)
    assert timing.calls[10] == 32 and timing.calls.count(32) == 2
    assert curve[31] == pytest.approx(avx512_like(32))


def test_measures_an_unplanned_max_width():
    timing = TimingTable(cpu_like)
    curve = measure_curve(timing, max_width=10, repeats=1, budget_seconds=100.0, narrow_budget_seconds=0.0)
    assert timing.calls == [1, 1, 2, 3, 4, 6, 8, 10]
    assert len(curve) == 10
    assert curve[9] == pytest.approx(cpu_like(10))


def test_narrow_widths_get_rounds_of_their_own_up_to_their_sample_count():
    timing = TimingTable(cpu_like)
    curve = measure_curve(timing, max_width=8, repeats=3, budget_seconds=100.0, narrow_budget_seconds=100.0)
    assert timing.calls[1:19] == [1, 2, 3, 4, 6, 8] * 3, "the curve's rounds come first"
    assert timing.calls[19:] == [1, 2, 3, 4] * (NARROW_SAMPLES - 3)
    assert curve[:4] == pytest.approx(tuple(cpu_like(n) for n in (1, 2, 3, 4)))


def test_a_minute_of_load_on_one_plain_pass_does_not_make_wide_ones_look_cheap():
    # The first two timed one-token passes (calls 1 and 7) meet a burst of load, 30% slower: with
    # only the three rounds' samples, T(2)/T(1) would read 1.3x too cheap, and one-token drafts pay.
    slowed = {1: 1.3 * cpu_like(1), 7: 1.3 * cpu_like(1)}
    timing = TimingTable(cpu_like, spikes=slowed)
    curve = measure_curve(timing, max_width=8, repeats=3, budget_seconds=100.0, narrow_budget_seconds=100.0)
    assert curve[1] / curve[0] == pytest.approx(cpu_like(2) / cpu_like(1))
    without = measure_curve(TimingTable(cpu_like, spikes=slowed), max_width=8, repeats=3, budget_seconds=100.0,
                            narrow_budget_seconds=0.0)
    assert without[1] / without[0] < 0.8 * cpu_like(2) / cpu_like(1)


def test_the_narrow_rounds_keep_to_their_budget():
    timing = TimingTable(lambda n: 0.1 * n)
    measure_curve(timing, max_width=4, repeats=1, budget_seconds=100.0, narrow_budget_seconds=0.65)
    # the rounds: 1, 2, 3, 4; then 0.1 + 0.2 + 0.3 = 0.6, and width 4 would take 0.4 more
    assert timing.calls[5:] == [1, 2, 3]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_rejects_a_measure_that_returns_no_time(bad):
    with pytest.raises(ValueError, match="measure"):
        measure_curve(TimingTable(lambda n: bad), max_width=4)


# -- plausibility ---------------------------------------------------------------------------


def test_a_narrow_width_slowed_by_load_is_measured_again():
    # Calls 1 and 5 are the first two timed passes over 1 token (call 0 is the warm-up): a burst of
    # load makes their median 10x, dearer than every wider pass, which no machine computes.
    timing = TimingTable(cpu_like, spikes={1: 10 * cpu_like(1), 5: 10 * cpu_like(1)})
    notices = []
    curve = measure_curve(timing, max_width=4, repeats=3, budget_seconds=100.0, narrow_budget_seconds=0.0,
                          notice=notices.append)
    assert timing.calls[13:] == [1, 1, 1], "width 1, and only it, measured `repeats` times more"
    assert curve[0] == pytest.approx(cpu_like(1)) and notices == []


def test_a_curve_that_still_falls_with_width_is_capped_by_the_wider_passes_and_said_so():
    # Width 2 always measures dearer than widths 3 and 4: a pass over 2 tokens does less work than
    # one over 3, so its true cost is at most theirs.
    timing = TimingTable(lambda n: 0.5 if n == 2 else cpu_like(n))
    notices = []
    curve = measure_curve(timing, max_width=4, repeats=3, budget_seconds=100.0, notice=notices.append)
    assert curve == pytest.approx((cpu_like(1), cpu_like(3), cpu_like(3), cpu_like(4)))
    assert all(a <= b for a, b in zip(curve, curve[1:]))
    assert len(notices) == 1 and "slower than wider ones" in notices[0]


def test_measuring_again_keeps_to_the_budget():
    # On a machine so busy that every narrow width measures ten times a wide one, measuring them
    # all again `repeats` times would take as long again as the whole curve.
    timing = TimingTable(lambda n: 10.0 if n < 4 else 0.1)
    measure_curve(timing, max_width=4, repeats=3, budget_seconds=25.0, budget_passes=0.0, narrow_budget_seconds=0.0,
                  notice=lambda text: None)
    assert timing.calls[5:] == [1, 2, 3], "10 + 10 + 10 s: the budget of 25 s is spent"


def test_a_flat_curve_within_noise_is_not_measured_again():
    # A GPU-like machine: every width costs about the same, a few percent either way.
    jitter = {1: 1.0, 2: 0.97, 3: 1.02, 4: 0.99}
    timing = TimingTable(lambda n: jitter[n])
    notices = []
    curve = measure_curve(timing, max_width=4, repeats=1, budget_seconds=100.0, narrow_budget_seconds=0.0,
                          notice=notices.append)
    assert timing.calls == [1, 1, 2, 3, 4] and notices == []
    assert curve == pytest.approx((0.97, 0.97, 0.99, 0.99)), "still made non-decreasing"
