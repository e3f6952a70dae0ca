"""How far apart calibrations made in a row price the wide passes: the curve's first round alone, against the curve.

The calibration (curve_timing.measure_curve) times one pass per planned width in a round, narrowest first,
then rounds again within its budget, and prices each width by the lower median of its samples.  About one
wide pass in seven ran 8-24% slow on an idle AVX-512 EPYC, and a width priced by such a spike is never drafted
(so its price is never corrected by generation).  This calibrates the target N times in a row, exactly as the
engine does, and gives for each the wide widths as T(n) / T(1) twice: from the first sample of each width,
about what a budget of one round priced it at, and from the curve the calibration returned.

Run on an idle machine (Qwen2.5-Coder-1.5B; about ten seconds a calibration):
  .venv/bin/python benchmarks/calibration_spread.py --calibrations 8 --json benchmarks/results/calibration-spread.json
Check the script quickly:
  .venv/bin/python benchmarks/calibration_spread.py --model smollm2-135m-instruct --calibrations 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from edgespec.backend import LlamaModel, time_forward
from edgespec.curve_timing import measure_curve
from edgespec.fetch import resolve_model
from edgespec.limits import MAX_DRAFT_TOKENS

WIDE = (8, 12, 16, 24, 32, 33)


def calibrate(model: LlamaModel) -> dict:
    """One calibration of model's curve: its first sample of each width, the curve, and the seconds spent."""
    first: dict[int, float] = {}
    spent = []

    def measure(n: int) -> float:
        seconds = time_forward(model, n, max(model.bos_id, 0))
        spent.append(seconds)
        if len(spent) > 1:  # the first call is the warm-up, which the calibration discards
            first.setdefault(n, seconds)
        return seconds

    curve = measure_curve(measure, MAX_DRAFT_TOKENS + 1)
    one = curve[0]
    return {"seconds": round(sum(spent), 2), "t1_ms": round(one * 1000, 2),
            "first_round": {w: round(first[w] / one, 3) for w in WIDE if w in first},
            "curve": {w: round(curve[w - 1] / one, 3) for w in WIDE if w <= len(curve)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--calibrations", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write every calibration's figures here")
    args = parser.parse_args()

    model = LlamaModel(resolve_model(args.model), n_ctx=2 * (MAX_DRAFT_TOKENS + 1), n_threads=args.threads)
    runs = []
    for index in range(args.calibrations):
        runs.append(calibrate(model))
        print(f"[{index + 1}/{args.calibrations}] {json.dumps(runs[-1])}", file=sys.stderr)
    name = model.path.name
    model.close()

    print(f"{name}: T(n) / T(1) over {len(runs)} calibrations, min-median-max")
    for key, label in (("first_round", "first sample (one round)"), ("curve", "the curve (lower median)")):
        cells = []
        for w in WIDE:
            values = [run[key][w] for run in runs if w in run[key]]
            if values:
                cells.append(f"T({w}) {min(values):.2f}-{statistics.median(values):.2f}-{max(values):.2f}")
        print(f"  {label:<26} " + "  ".join(cells))
    print(f"  seconds per calibration: {statistics.median(run['seconds'] for run in runs):.1f} (median)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": name, "calibrations": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
