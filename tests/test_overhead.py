"""`edgespec bench --overhead`: where each step's time goes, and the sampling microbenchmark."""

from __future__ import annotations

import pytest

from edgespec.commands.bench import microbench, report, runner
from edgespec.engine import PhaseClock


def test_every_phase_of_every_step_is_accounted_for(tiny_models):
    results = runner.run_bench(
        tiny_models["target"], tiny_models["draft"], suites=["code-edit"], configs=["baseline", "ngram-k2", "draft-model-k3"],
        prompts_per_suite=1, repeats=1, temperatures=[0.0, 0.8], max_tokens=16, n_ctx=1024, n_threads=1, overhead=True,
    )
    rows = {(r["temperature"], r["suite"], r["config"]): r for r in results["overhead"]}
    for run in results["runs"]:
        assert set(run["phase_ns"]) == set(PhaseClock.PHASES)
        assert run["phase_steps"] == run["steps"]
        # the clock runs inside the decode loop only, so it can't hold more than the decode time
        assert 0.5 * run["decode_seconds"] * 1e9 <= sum(run["phase_ns"].values()) <= run["decode_seconds"] * 1e9 + 1e6
        assert run["phase_ns"]["target_decode"] > 0
        assert (run["phase_ns"]["draft_decode"] > 0) == (run["config"] == "draft-model-k3")
        row = rows[(run["temperature"], "all", run["config"])]
        assert row["steps"] == run["steps"]
        assert row["overhead_ms_per_step"] == pytest.approx(sum(
            ns for phase, ns in run["phase_ns"].items() if phase not in report.DECODE_PHASES) / run["steps"] / 1e6)
        assert row["overhead_of_t1"] == pytest.approx(row["overhead_ms_per_step"] / row["t1_ms"])


def test_a_plain_bench_records_no_phases(tiny_models):
    results = runner.run_bench(tiny_models["target"], None, suites=["chat"], configs=["baseline"], prompts_per_suite=1,
                              repeats=1, temperatures=[0.0], max_tokens=4, n_ctx=1024, n_threads=1)
    assert "overhead" not in results and all("phase_ns" not in run for run in results["runs"])


def test_the_sampling_microbenchmark_samples_rows_as_peaked_as_a_models():
    """A model's rows put top-p's 95% in their 1024 heaviest tokens, so top-k off costs no whole-vocabulary sort there;
    rows flatter than that timed a path generation does not take (10 ms a row against 0.5)."""
    import numpy as np

    rows = microbench.model_like_rows(8, microbench.SAMPLING_VOCAB, np.random.default_rng(0))
    for row in rows.astype(np.float64):
        weights = np.sort(np.exp((row - row.max()) / 0.8))[::-1]
        assert weights[:1024].sum() / weights.sum() > 0.95


def test_the_sampling_microbenchmark_times_each_case():
    results = microbench.run_sampling_microbench(n_vocab=4096, rows=3, repeats=1)
    assert set(results["ms_per_row"]) == {"T=0.8 (top-k 40, top-p 0.95, min-p 0.05)", "T=0.8, top-k off", "T=0",
                                          "copy of one logits row"}
    assert all(ms > 0 for ms in results["ms_per_row"].values())
