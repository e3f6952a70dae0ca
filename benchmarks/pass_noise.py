"""How noisy one pass's time is during generation: what the speed guard's pass prices react to.

The controller prices each pass width by what its recent passes took (controller.SpeedGuard), so the noise
of a single pass's time, and how long a slow or fast spell lasts, decide how far its plans move by chance.
This runs a generation-like sequence of passes (mostly one token, the wider ones at random, the context
growing by one token a pass as in decoding) and gives, per width, the spread of each pass's time over the
median one-token pass, the spread of log(time) about the width's median, and how much one pass's
deviation carries to the next (the lag-1 and lag-5 autocorrelation of those log deviations).
benchmarks/ngram_sim.py --seconds-noise SD --noise-rho RHO replays the held-out replies with noise of that
size, to see what it costs the controller's choices.

Run on an idle machine (about a minute a trace):
  .venv/bin/python benchmarks/pass_noise.py --traces 2 --json benchmarks/results/avx512-pass-noise.json
Check the script quickly:
  .venv/bin/python benchmarks/pass_noise.py --model smollm2-135m-instruct --passes 40 --traces 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from edgespec.backend import LlamaModel
from edgespec.fetch import resolve_model

# About how often each width ran in the held-out code edits' generations (avx512-pricing-fixed-vs-measured).
WIDTH_SHARES = {1: 0.66, 2: 0.06, 3: 0.03, 4: 0.06, 5: 0.04, 6: 0.05, 8: 0.03, 16: 0.07}


def trace(model: LlamaModel, passes: int, rng: np.random.Generator, depth: int) -> list[tuple[int, float]]:
    """(width, seconds) of `passes` passes at random widths, the cache growing by one token a pass from depth."""
    filler = max(model.bos_id, 0)
    model.rewind(0)
    model.decode([filler] * depth, 1)
    widths, shares = list(WIDTH_SHARES), np.array(list(WIDTH_SHARES.values()))
    timed = []
    for _ in range(passes):
        width = int(rng.choice(widths, p=shares / shares.sum()))
        kept = len(model.cached)
        started = time.perf_counter()
        model.decode([filler] * width, n_logits=width)
        timed.append((width, time.perf_counter() - started))
        model.rewind(kept + 1)  # as if the first token was kept
    return timed


def summary(timed: list[tuple[int, float]]) -> dict:
    widths = np.array([w for w, _ in timed])
    seconds = np.array([s for _, s in timed])
    plain = float(np.median(seconds[widths == 1]))
    medians = {int(w): float(np.median(seconds[widths == w])) for w in sorted(set(widths))}
    deviation = np.log(seconds / np.array([medians[int(w)] for w in widths]))
    return {
        "plain_ms": plain * 1000,
        "widths": {w: {"passes": int((widths == w).sum()), "median_over_plain": medians[w] / plain,
                       "quantiles_over_plain": [float(q) for q in np.quantile(seconds[widths == w] / plain,
                                                                                 [0.05, 0.25, 0.75, 0.95])],
                       "log_sd": float(np.std(deviation[widths == w]))} for w in medians},
        "log_sd": float(np.std(deviation)),
        "autocorrelation": {lag: float(np.corrcoef(deviation[:-lag], deviation[lag:])[0, 1]) for lag in (1, 5)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--passes", type=int, default=700, help="passes per trace")
    parser.add_argument("--traces", type=int, default=2)
    parser.add_argument("--depth", type=int, default=250, help="cached tokens before the first pass")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    model = LlamaModel(resolve_model(args.model), n_ctx=args.depth + args.passes + 64)
    rng = np.random.default_rng(args.seed)
    traces = []
    for i in range(args.traces):
        found = summary(trace(model, args.passes, rng, args.depth))
        traces.append(found)
        shape = "  ".join(f"T({w}) {v['median_over_plain']:.2f}" for w, v in found["widths"].items() if w > 1)
        print(f"trace {i + 1}: T(1) {found['plain_ms']:.1f} ms, {shape}; log sd {found['log_sd']:.3f}, "
              f"autocorrelation lag 1 {found['autocorrelation'][1]:.2f}, lag 5 {found['autocorrelation'][5]:.2f}")
    model.close()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "passes": args.passes,
                       "depth": args.depth, "traces": traces}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
