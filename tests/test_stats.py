"""Stats: the typed record of a generation, and its JSON form (the keys edgespec has always written)."""

import dataclasses

import numpy as np
import pytest

from edgespec import Done, SamplingParams, Step
from edgespec.generation import DrafterSet, Generation, PlainPace
from edgespec.loading import load_engine
from edgespec.stats import Counters, Stats
from edgespec.text import TextAssembler

JSON_KEYS = [
    "mode", "plan_reason", "prompt_tokens", "prompt_tokens_reused", "prompt_tokens_evaluated", "tokens_generated",
    "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate", "target_forward_passes",
    "draft_forward_passes", "target_passes_per_token", "steps", "k0_steps", "mean_draft_tokens", "prefill_seconds",
    "decode_seconds", "decode_tokens_per_second", "finish_reason",
    # added with wide verification and the combined drafter (flash_attn with its default, after them)
    "bit_exact", "flash_attn", "widest_pass", "accepted_by_drafter", "pass_widths", "drafted_by_position",
    "accepted_by_position",
    # added with predicted outputs and the end-to-end figure
    "accepted_prediction_tokens", "rejected_prediction_tokens", "plain_step_seconds", "decode_speedup",
    "end_to_end_speedup",
]


def test_ratios_are_computed_from_the_counts_and_the_json_keeps_its_keys():
    stats = Stats.from_counts(mode="ngram", plan_reason="why", prompt_tokens=10, prompt_tokens_reused=4,
                              tokens_generated=20, draft_tokens_proposed=16, draft_tokens_accepted=12,
                              target_forward_passes=8, draft_forward_passes=0, steps=8, k0_steps=2,
                              prefill_seconds=0.5, decode_seconds=2.0, finish_reason="stop")
    assert list(stats.as_dict()) == JSON_KEYS
    assert stats.prompt_tokens_evaluated == 6 and stats.acceptance_rate == 0.75
    assert stats.target_passes_per_token == 0.4 and stats.mean_draft_tokens == 2.0
    assert stats.decode_tokens_per_second == 10.0
    assert Stats.from_dict({**stats.as_dict(), "message_index": 3}) == stats
    assert stats.decode_speedup == stats.end_to_end_speedup == 0.0  # plain decoding's speed unknown


def test_end_to_end_speedup_counts_the_prefill_that_drafting_cannot_shorten():
    # 20 tokens in 2 s after a 1 s prefill, where a plain step takes 0.25 s: plain decoding would take 5 s
    stats = Stats.from_counts(mode="ngram", plan_reason=None, prompt_tokens=10, prompt_tokens_reused=0,
                              tokens_generated=20, draft_tokens_proposed=16, draft_tokens_accepted=12,
                              target_forward_passes=8, draft_forward_passes=0, steps=8, k0_steps=2,
                              prefill_seconds=1.0, decode_seconds=2.0, finish_reason="stop", plain_step_seconds=0.25)
    assert stats.decode_speedup == pytest.approx(2.5)
    assert stats.end_to_end_speedup == pytest.approx(6.0 / 3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 9


def test_nothing_counted_gives_zero_ratios_not_a_division_error():
    empty = Stats.from_counts(mode="none", plan_reason=None, prompt_tokens=1, prompt_tokens_reused=0,
                              tokens_generated=0, draft_tokens_proposed=0, draft_tokens_accepted=0,
                              target_forward_passes=0, draft_forward_passes=0, steps=0, k0_steps=0,
                              prefill_seconds=0.0, decode_seconds=0.0, finish_reason=None)
    assert (empty.acceptance_rate, empty.target_passes_per_token, empty.mean_draft_tokens,
            empty.decode_tokens_per_second) == (0.0, 0.0, 0.0, 0.0)


def test_the_run_summary_says_nothing_was_drafted_rather_than_that_every_draft_was_rejected():
    from edgespec.commands.run import generation_summary_line

    counts = dict(mode="ngram", plan_reason=None, prompt_tokens=10, prompt_tokens_reused=0, tokens_generated=20,
                  target_forward_passes=20, draft_forward_passes=0, steps=20, k0_steps=20, prefill_seconds=0.5,
                  decode_seconds=2.0, finish_reason="stop")
    nothing = generation_summary_line(Stats.from_counts(draft_tokens_proposed=0, draft_tokens_accepted=0, **counts))
    rejected = generation_summary_line(Stats.from_counts(draft_tokens_proposed=4, draft_tokens_accepted=0, **counts))
    assert "acceptance - (nothing drafted)," in nothing and "acceptance 0% (0/4)," in rejected


def test_the_run_summary_tells_the_speedup_against_the_replys_own_pace_where_it_can_be_told():
    from edgespec.commands.run import generation_summary_line

    def line(mode="ngram", tokens=40, plain_step_seconds=0.1):  # 40 tokens in 20 passes and 2 s after 1 s of prefill
        return generation_summary_line(Stats.from_counts(
            mode=mode, plan_reason=None, prompt_tokens=10, prompt_tokens_reused=0, tokens_generated=tokens,
            draft_tokens_proposed=30, draft_tokens_accepted=20, target_forward_passes=20, draft_forward_passes=0,
            steps=20, k0_steps=5, prefill_seconds=1.0, decode_seconds=2.0, finish_reason="stop",
            plain_step_seconds=plain_step_seconds))

    assert "20.0 tok/s decode (2.00x plain decoding, 1.67x end to end)," in line()  # plain: 4 s; (1 + 4) / (1 + 2)
    assert "(speedup n/a: too few tokens to tell)" in line(tokens=10)
    # 20x from 2 tokens a pass: the pace measured cannot be this reply's
    assert "(speedup n/a: the plain pace measured does not fit this reply)" in line(plain_step_seconds=1.0)
    assert "(speedup n/a: no plain pace with a given cost curve)" in line(plain_step_seconds=0.0)
    assert "20.0 tok/s decode, " in line(mode="none")  # plain decoding is the pace itself


def test_a_snapshot_keeps_its_counts_while_the_generation_goes_on():
    counters = Counters(mode="ngram")
    counters.pass_widths[1] = 3
    counters.drafted_by_position["ngram"] = [2, 1]
    counters.tokens_generated = 3
    before = counters.snapshot()
    counters.pass_widths[1] += 1
    counters.pass_widths[4] = 1
    counters.drafted_by_position["ngram"][0] += 1
    counters.drafted_by_position["heads"] = [1]
    counters.tokens_generated = 8
    assert before.pass_widths == {1: 3} and before.drafted_by_position == {"ngram": [2, 1]}
    assert before.tokens_generated == 3
    assert counters.snapshot().drafted_by_position == {"ngram": [3, 1], "heads": [1]}


def test_each_step_carries_its_own_drafted_and_accepted_counts(tiny_models):
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=512, draft_tokens=4, n_threads=1, cost_curve=(1.0,) * 6)
    try:
        events = list(engine.stream("one two three one two three one two three one two", SamplingParams(
            temperature=0.0, max_tokens=40), raw=True))
    finally:
        engine.close()
    steps = [e for e in events if isinstance(e, Step)]
    final = events[-1].result.stats
    assert isinstance(events[-1], Done) and isinstance(final, Stats)
    assert sum(s.drafted for s in steps) == final.draft_tokens_proposed > 0
    assert sum(s.accepted for s in steps) == final.draft_tokens_accepted
    assert all(0 <= s.accepted <= s.drafted for s in steps)
    assert all(s.accepted == sum(t.drafted for t in s.tokens) or s is steps[-1] for s in steps)


def test_a_plain_pace_is_the_curve_share_of_all_steps_until_there_are_enough_one_token_steps():
    pace = PlainPace((1.0, 1.5, 2.0))
    assert pace.seconds() is None
    pace.observe(3, 0.4)  # a three-token pass at 0.4 s: a one-token pass at 0.2 s by the curve's shape
    assert pace.seconds() == pytest.approx(0.2)
    pace.observe(1, 0.1)
    assert pace.seconds() == pytest.approx(0.5 / 3.0), "all the steps' seconds over their shares of the curve"
    pace.observe(9, 5.0)  # wider than the curve: says nothing
    pace.observe(1, 0.0)
    assert pace.seconds() == pytest.approx(0.5 / 3.0)


def test_a_plain_generation_is_paced_by_its_mean_step_so_it_reads_as_fast_as_itself():
    pace = PlainPace((1.0, 1.5))
    steps = (0.1, 0.1, 0.12, 0.1, 0.3, 0.1, 0.11, 0.1, 0.13)  # leaning right, as a busy machine's do
    for seconds in steps:
        pace.observe(1, seconds)
    assert pace.seconds() == pytest.approx(sum(steps) / len(steps))


def test_plain_decodings_pace_per_token_told_pays_for_the_end_token_it_would_have_sampled():
    generation = Generation([1], SamplingParams(), DrafterSet({}), Counters("none"), np.random.default_rng(0),
                            TextAssembler(()), pace=PlainPace((1.0,)))
    for token in (5, 6, 7):
        generation.generated.append(token)
        generation.pace_step(1, 0.1, sampled_end_token=False)
    assert generation.counters.plain_step_seconds == pytest.approx(0.1)
    generation.pace_step(1, 0.1, sampled_end_token=True)  # a fourth step, which sampled the end token
    assert 3 * generation.counters.plain_step_seconds == pytest.approx(0.4), "plain decoding's four steps"


def test_a_preempted_step_counts_at_its_widths_median_in_a_drafted_generation():
    def speedup(preempted_width: int) -> float:
        pace = PlainPace((1.0, 1.5, 2.0))
        steps = [(1, 0.1)] * 8 + [(3, 0.2)] * 5  # 8 + 15 tokens
        steps[2 if preempted_width == 1 else 10] = (preempted_width, 5.0)
        for width, seconds in steps:
            pace.observe(width, seconds)
        return 23 * pace.seconds() / sum(seconds for _, seconds in steps)

    undisturbed = 23 * 0.1 / (8 * 0.1 + 5 * 0.2)
    assert speedup(1) == pytest.approx(undisturbed) and speedup(3) == pytest.approx(undisturbed)
