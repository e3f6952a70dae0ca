"""A new request's prompt fed in chunks inside the passes that decode the others, and what passes over
several sequences cost (the cost model's grid, the chunk size, the default number of sequences)."""

from __future__ import annotations

import math

import pytest

from edgespec.costs import CostModel, prefill_rows
from edgespec.drafting import joint_draft_lengths
from edgespec.generation import Done, Failed, Step
from edgespec.loading import load_engine
from edgespec.phases import PhaseClock
from edgespec.sampling import SamplingParams
from edgespec.scheduler import Job, best_parallel
from test_batch import models  # noqa: F401
from test_batch_parallel import trained_choice

CPU_LIKE = tuple(1.0 + (n - 1) / 3 for n in range(1, 34))  # a pass over n rows: 1 + (n - 1) / 3 single steps
FLAT_TO_16 = (1.0,) * 16  # a GPU-like curve: free rows up to 16, then every row costs (extrapolated)


# -- the cost model -----------------------------------------------------------------------------


def test_a_pass_over_several_sequences_is_priced_from_the_grid():
    plain = CostModel(CPU_LIKE)
    assert plain.pass_seconds(4, 8) == plain.target(8)  # no grid: rows cost the same whoever owns them
    grid = CostModel(CPU_LIKE, sequences=((2, 1, 1.2), (2, 4, 1.1), (4, 1, 1.5), (4, 4, 1.3)))
    assert grid.pass_seconds(1, 8) == grid.target(8)
    assert grid.pass_seconds(2, 2) == pytest.approx(grid.target(2) * 1.2)
    assert grid.pass_seconds(4, 16) == pytest.approx(grid.target(16) * 1.3)
    assert grid.pass_seconds(3, 3) == pytest.approx(grid.target(3) * 1.35)  # between 2 and 4 sequences
    assert grid.pass_seconds(8, 8) == pytest.approx(grid.target(8) * 1.5)  # past the grid: its edge
    assert grid.pass_seconds(2, 0) == 0.0
    with pytest.raises(ValueError):
        CostModel(CPU_LIKE, sequences=((2, 1, -1.0),))


def test_the_default_number_of_sequences_counts_what_several_contexts_cost():
    cheap = CostModel((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7))
    assert best_parallel(cheap, 8) == 8
    # each sequence's own context makes a pass over 8 of them cost twice one sequence's 8 rows
    dear = CostModel(cheap.forward_seconds, sequences=((2, 1, 1.0), (4, 1, 1.1), (8, 1, 2.0)))
    assert best_parallel(dear, 8) == 4


def test_each_steps_rows_are_priced_over_the_sequences_that_share_the_pass():
    choices = [trained_choice(0.9)] * 3
    cheap = joint_draft_lengths(choices, CostModel(CPU_LIKE))
    assert all(k > 0 for k in cheap) and sum(cheap) > 3
    # passes over sequences of two rows each cost three times one sequence's pass over as many rows:
    # only the row that keeps them at about one each (4 rows over 3 sequences) pays
    dear = CostModel(CPU_LIKE, sequences=((2, 1, 1.0), (2, 2, 3.0), (4, 1, 1.0), (4, 2, 3.0)))
    assert sum(joint_draft_lengths(choices, dear)) == 1
    # prompt rows the pass carries make the pass dearer already, so drafted rows cost relatively less
    flat = CostModel(FLAT_TO_16)
    assert sum(joint_draft_lengths(choices, flat, prompt_rows=0)) == 13
    assert sum(joint_draft_lengths(choices, flat, prompt_rows=13)) > 13


def test_a_prompt_chunk_is_as_wide_as_its_tokens_stay_cheap():
    # a CPU: a folded prompt token costs about the same at any width, so the whole budget goes in
    assert prefill_rows(CostModel(CPU_LIKE), 2, 2, 400) == 400
    # free rows up to 16, dear after: the chunk fills the pass to 16
    assert prefill_rows(CostModel(FLAT_TO_16), 2, 2, 400) == 14
    assert prefill_rows(CostModel(FLAT_TO_16), 0, 0, 400) == 400  # nothing to slow down: one pass of its own cost
    assert prefill_rows(CostModel(FLAT_TO_16), 2, 2, 1) == 1


# -- the scheduler feeding prompts in chunks -----------------------------------------------------


@pytest.fixture(scope="module")
def engine(models):  # noqa: F811
    engine = load_engine(models["target"], "ngram", n_ctx=512, draft_tokens="auto", cost_curve=FLAT_TO_16,
                         n_threads=1, pull=False)
    yield engine
    engine.close()


def arriving(jobs_by_call: dict[int, Job]):
    """A job source where each job arrives at the given call: the scheduler asks once before each pass
    while it has a free sequence, so a job of call c > 0 arrives after pass c - 1; when nothing is running
    the next job arrives at once, and None then ends the run."""
    calls = iter(range(10**6))

    def next_job(wait: bool):
        job = jobs_by_call.pop(next(calls), None)
        if job is None and wait and jobs_by_call:
            job = jobs_by_call.pop(min(jobs_by_call))
        return job

    return next_job


def run_with_passes(engine, next_job, parallel):
    """Every job's result, and the pass of each job's first Step and of its end; every pass a decoder step."""
    clock = PhaseClock(engine.target)
    engine.phase_clock = clock
    passes_before = engine.target.forward_passes
    results, first_step, ended = {}, {}, {}
    try:
        for key, event in engine.scheduler(parallel).run(next_job):
            if isinstance(event, Step):
                first_step.setdefault(key, clock.steps)
            else:
                results[key] = event.result if isinstance(event, Done) else event
                ended[key] = clock.steps
    finally:
        engine.phase_clock = None
    assert engine.target.forward_passes - passes_before == clock.steps, "a pass outside the decoder's steps"
    return results, first_step, ended


def test_a_long_prompt_is_fed_inside_the_others_passes_and_changes_no_token(engine):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    short, long = "The cat sat on", "the dog ran to the log and the cat sat on the mat " * 12
    alone = {text: engine.generate(text, params, raw=True) for text in (short, long)}
    long_ids = engine.prompt_tokens(long, raw=True)
    jobs = {0: Job("short", engine.prompt_tokens(short, raw=True), params), 3: Job("long", long_ids, params)}
    results, first_step, ended = run_with_passes(engine, arriving(jobs), parallel=2)

    assert results["short"].token_ids == alone[short].token_ids
    assert results["long"].token_ids == alone[long].token_ids
    # While the short one decodes (one row a pass) a pass carries 15 prompt tokens (rows are free up to 16
    # on this curve); once it has ended, the rest goes in one pass.  The last chunk's pass is the long
    # prompt's first step: none of its passes is a pass of its own while the short one runs.
    remaining, passes = len(long_ids) - 1, 2  # it arrives after the second pass
    while remaining > 0:
        passes += 1
        remaining -= 15 if passes <= ended["short"] else remaining
    assert first_step["long"] == passes, (first_step, ended)
    stats = results["long"].stats
    assert stats.prompt_tokens_reused == 0 and stats.prompt_tokens_evaluated == len(long_ids)


def test_prompts_that_arrive_together_are_fed_together(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    texts = ["The cat sat on", "A dog ran to the", "Once upon a time the"]
    alone = [engine.generate(text, params, raw=True).token_ids for text in texts]
    pending = iter([Job(i, engine.prompt_tokens(text, raw=True), params) for i, text in enumerate(texts)])
    results, first_step, _ = run_with_passes(engine, lambda wait: next(pending, None), parallel=3)
    assert [results[i].token_ids for i in range(3)] == alone
    assert first_step == {0: 1, 1: 1, 2: 1}, "every prompt was whole after the first pass"


def test_a_request_cancelled_while_its_prompt_is_fed_ends_without_a_token(engine):
    import threading

    params = SamplingParams(temperature=0.0, max_tokens=30)
    cancel = threading.Event()
    long = Job("long", engine.prompt_tokens("the dog ran to the log " * 30, raw=True), params, cancel=cancel)
    source = arriving({0: Job("short", engine.prompt_tokens("The cat sat on", raw=True), params), 2: long})

    def next_job(wait):
        job = source(wait)
        if job is long:
            cancel.set()  # cancelled before its first chunk is fed
        return job

    results, first_step, _ = run_with_passes(engine, next_job, parallel=2)
    assert results["long"].finish_reason == "cancelled" and results["long"].token_ids == []
    assert "long" not in first_step
    assert results["short"].token_ids == engine.generate("The cat sat on", params, raw=True).token_ids


def test_a_prompt_that_another_is_still_being_fed_waits_for_its_cells_and_shares_them(engine):
    document = "The cat sat on the mat and the dog sat on the log. " * 7
    prompt = engine.prompt_tokens(document, raw=True)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    alone = engine.generate(document, params, raw=True).token_ids
    engine.forget_cache()
    pending = iter([Job(i, prompt, params) for i in range(2)])
    results, first_step, _ = run_with_passes(engine, lambda wait: next(pending, None), parallel=2)
    assert results[0].token_ids == results[1].token_ids == alone
    assert first_step == {0: 1, 1: 2}, "the second waited one pass for the first one's cells"
    assert results[0].stats.prompt_tokens_reused < 16
    assert results[1].stats.prompt_tokens_reused == len(prompt) - 1
