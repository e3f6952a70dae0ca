"""Does planning on the pass prices seen in generation (calibration.priced_curve) help a new process?  A replay.

The cached curve is one calibration's; what passes cost in generation differs from it by width.  This draws
N such differences at random (a log factor per knot width, normal with mean `--mean` and spread `--spread`,
interpolated in log width; passes never cheaper than narrower ones) and replays the recorded replies
(ngram_sim.py) three ways on each: planned on the cached curve, on the cached curve at the prices the other
prompts' replays paid (what a new process loads after they ran), and on the true curve; passes are always
paid at the true curve.  Per kind it prints the mean and the lowest over the N draws, whole kind / worst prompt.

Run:
    .venv/bin/python benchmarks/pass_prices_sim.py benchmarks/workloads-heldout/replies-qwen2.5-coder-1.5b-t07.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ngram_sim  # noqa: E402
from edgespec.costs import CostModel  # noqa: E402

KNOTS = (2, 3, 4, 6, 8, 12, 16, 24, 33)
PLANS = ("cached", "learned prices", "true curve")


def perturbed(curve: CostModel, rng: np.random.Generator, mean: float, spread: float) -> CostModel:
    widths = np.arange(1, len(curve.forward_seconds) + 1)
    logs = rng.normal(mean, spread, len(KNOTS))
    factor = np.exp(np.interp(np.log(widths), np.log(KNOTS), logs))
    factor[0] = 1.0
    return CostModel(tuple(np.maximum.accumulate(np.array(curve.forward_seconds) * factor)))


def replay(rows: list[dict], true: CostModel, cached: CostModel, plan: str) -> dict:
    if plan == "true curve":
        results = ngram_sim.simulate(rows, true)
    else:
        results = ngram_sim.simulate(rows, true, plan_cost=cached, plan_cost_for=ngram_sim.prices_from_others(
            rows, true, cached) if plan == "learned prices" else None)
    with contextlib.redirect_stdout(io.StringIO()):
        return ngram_sim.report(rows, results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path, nargs="+", help="JSONL files from record_replies.py")
    parser.add_argument("--cached", default="benchmarks/results/avx2-nocopy-t07-fixed.json",
                        help="the cached curve: a bench JSON (its calibrated curve)")
    parser.add_argument("--draws", type=int, default=12)
    parser.add_argument("--mean", type=float, default=0.08, help="mean log factor: generation dearer than calibration")
    parser.add_argument("--spread", type=float, default=0.12)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.replies for line in path.read_text().splitlines() if line.strip()]
    cached = CostModel(ngram_sim.curve_named(args.cached))
    rng = np.random.default_rng(args.seed)
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for _ in range(args.draws):
        true = perturbed(cached, rng, args.mean, args.spread)
        for plan in PLANS:
            for kind, summary in replay(rows, true, cached, plan).items():
                figures.setdefault(kind, {}).setdefault(plan, []).append((summary["speedup"], summary["worst_prompt"]))
    print(f"{'kind':14s} " + "  ".join(f"{plan + ': mean / lowest':>34s}" for plan in PLANS))
    for kind, by_plan in figures.items():
        cells = []
        for plan in PLANS:
            v = np.array(by_plan[plan])
            cells.append(f"{v[:, 0].mean():.3f}/{v[:, 1].mean():.3f}  {v[:, 0].min():.3f}/{v[:, 1].min():.3f}")
        print(f"{kind:14s} " + "  ".join(f"{cell:>34s}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
