"""How far the shape of the cost curve moves on this machine: within one measurement, and from one minute to the next.

The controller plans every draft on T(n)/T(1).  This times pairs of passes (a one-token pass, then one over
n tokens) in rounds, and gives each width's paired ratio as a median and quartiles; then it measures the
whole curve as the calibration does, several times in a row, with the narrow widths' extra rounds
(curve_timing.NARROW_SAMPLES) and without them.  Run it twice, minutes apart, to see the machine move.

Run on an idle machine (Qwen2.5-Coder-1.5B; about a minute):
  .venv/bin/python benchmarks/curve_drift.py --json benchmarks/results/curve-drift.json
Check the script quickly:
  .venv/bin/python benchmarks/curve_drift.py --model smollm2-135m-instruct --pairs 3 --curves 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from edgespec.backend import LlamaModel, time_forward
from edgespec.curve_timing import measure_curve
from edgespec.fetch import resolve_model
from edgespec.limits import MAX_DRAFT_TOKENS


def quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--widths", default="2,3,4,8,16")
    parser.add_argument("--pairs", type=int, default=30, help="rounds of paired passes")
    parser.add_argument("--curves", type=int, default=5, help="curves measured each way")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    widths = [int(w) for w in args.widths.split(",")]
    model = LlamaModel(resolve_model(args.model), n_ctx=512, n_threads=args.threads)
    filler = max(model.bos_id, 0)
    model.decode([filler] * 64, 1)  # a few cached tokens, as behind a prompt
    ratios: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(args.pairs):
        for width in widths:
            plain = time_forward(model, 1, filler)
            ratios[width].append(time_forward(model, width, filler) / plain)
    curves = {"three samples": [], "narrow rounds": []}
    for _ in range(args.curves):
        for name, narrow_budget in (("three samples", 0.0), ("narrow rounds", 2.0)):
            curve = measure_curve(lambda n: time_forward(model, n, filler), MAX_DRAFT_TOKENS + 1,
                                  narrow_budget_seconds=narrow_budget)
            curves[name].append([s / curve[0] for s in curve[:4]])
    model.close()

    results = {"model": args.model, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "pairs": args.pairs,
               "paired_ratio": {w: {"median": statistics.median(r), "quartiles": quartiles(r)}
                                for w, r in ratios.items()},
               "curves": curves}
    print(f"{results['measured_at']}, {args.pairs} pairs: " + "  ".join(
        f"T({w})/T(1) {statistics.median(r):.2f} [{quartiles(r)[0]:.2f}-{quartiles(r)[2]:.2f}]"
        for w, r in ratios.items()), file=sys.stderr)
    for name, measured in curves.items():
        spread = [c[1] for c in measured]
        print(f"calibration, {name}: T(2)/T(1) " + ", ".join(f"{x:.2f}" for x in spread), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
