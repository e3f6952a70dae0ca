"""What the bench measures besides the configurations: the machine, the sampler alone, and the cost of one pass.

`run_sampling_microbench` times to_probs + sample per row without a model;
`run_cost_curve` times the target's forward pass over 1..n tokens.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

from ...sampling import SamplingParams
from ...loading import load_engine
from ...notices import print_notice
from ...sysinfo import cpu_model
from .configs import rotated
from .workloads import WORKLOADS_DIR, load_workloads

DEFAULT_N_CTX = 2048
COST_CURVE_MAX_TOKENS = 16
SAMPLING_VOCAB = 151_936  # Qwen2.5's
# The sampler's rows: a normal spread of logits with four peaks this far above it, as Qwen2.5-Coder-1.5B's own rows
# read (1,280 rows of 20 held-out replies, 10th to 90th percentile: spread 2.2-2.9, the best logit 20-27 above the
# median one).  Peaks of 8-14 over a spread of 3 made rows so flat that their 1024 heaviest tokens did not hold
# top-p's 95%, and top-k off read 10 ms a row where a model's own rows take 0.5 (stop 59 in
# `git show 2740b8b:docs/benchmarks.md`).
ROW_SPREAD = 2.6
ROW_PEAKS = (18.0, 26.0)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_description() -> dict:
    return {"cpu": cpu_model() or platform.machine(), "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def package_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def model_like_rows(rows: int, n_vocab: int, rng):
    """`rows` rows of float32 logits shaped like a model's: a spread of ROW_SPREAD, four peaks ROW_PEAKS above it."""
    logits = (rng.standard_normal((rows, n_vocab)) * ROW_SPREAD).astype("float32")
    for row in logits:
        row[rng.integers(0, n_vocab, 4)] += rng.uniform(*ROW_PEAKS, 4).astype("float32")
    return logits


def run_sampling_microbench(n_vocab: int = SAMPLING_VOCAB, rows: int = 200, repeats: int = 3, seed: int = 0) -> dict:
    """Milliseconds per row for to_probs + sample over logits shaped like a model's (model_like_rows).

    Each case draws `rows` different rows and reports the best of `repeats`
    passes over them; also the cost of copying one row, which the engine no
    longer pays (it reads llama.cpp's buffer in place).
    """
    import numpy as np

    from ...sampling import sample, to_probs

    rng = np.random.default_rng(seed)
    logits = model_like_rows(rows, n_vocab, rng)
    cases = {
        "T=0.8 (top-k 40, top-p 0.95, min-p 0.05)": SamplingParams(temperature=0.8),
        "T=0.8, top-k off": SamplingParams(temperature=0.8, top_k=0),
        "T=0": SamplingParams(temperature=0.0),
    }

    def per_row_ms(work) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for row in logits:
                work(row)
            best = min(best, (time.perf_counter_ns() - start) / rows / 1e6)
        return best

    results = {name: per_row_ms(lambda row, p=params: sample(to_probs(row, p), rng)) for name, params in cases.items()}
    results["copy of one logits row"] = per_row_ms(np.copy)
    return {"n_vocab": n_vocab, "rows": rows, "repeats": repeats, "ms_per_row": results,
            "machine": machine_description(), "load_average": load_average()}


# --------------------------------------------------------------- cost curve


def run_cost_curve(
    model: str | Path,
    *,
    max_tokens: int = COST_CURVE_MAX_TOKENS,
    repeats: int = 5,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    workloads_dir: Path = WORKLOADS_DIR,
) -> dict:
    """Time one target forward pass over n = 1..max_tokens tokens, after a real prompt.

    T(n) / T(1) is what a verification of n - 1 drafts costs in single-token
    passes: drafting k tokens can only pay if more than T(k + 1) / T(1)
    tokens come out of a step on average.
    """
    from ...backend import default_threads, time_forward

    n_threads = n_threads or default_threads()
    prompt = load_workloads(["code-edit"], 1, workloads_dir)[0]
    engine = load_engine(model, "none", n_ctx=n_ctx, n_threads=n_threads, draft_tokens=0,  # no calibration needed
                         notice=print_notice, progress=True)
    try:
        ids = engine.prompt_tokens(prompt.prompt)
        # A realistic KV length: attention cost grows with it.
        engine.generate(prompt.prompt, SamplingParams(temperature=0.0, max_tokens=1))
        widths = list(range(1, max_tokens + 1))
        seconds: dict[int, list[float]] = {n: [] for n in widths}
        time_forward(engine.target, max_tokens, ids[-1])  # warm-up
        for round_ in range(repeats):
            for n in rotated(widths, round_):
                seconds[n].append(time_forward(engine.target, n, ids[-1]))
        context_tokens = len(engine.target.cached)
    finally:
        engine.close()
    single = statistics.median(seconds[1])
    points = [
        {
            "tokens": n,
            "median_ms": statistics.median(seconds[n]) * 1e3,
            "min_ms": min(seconds[n]) * 1e3,
            "max_ms": max(seconds[n]) * 1e3,
            "relative_to_one": statistics.median(seconds[n]) / single,
            "ms_per_token": statistics.median(seconds[n]) * 1e3 / n,
        }
        for n in widths
    ]
    return {
        "meta": {
            "model": str(model),
            "context_tokens": context_tokens,
            "repeats": repeats,
            "n_threads": n_threads,
            "machine": machine_description(),
            "versions": {name: package_version(name) for name in ("edgespec", "llama-cpp-python")},
        },
        "cost_curve": points,
    }
