"""The cost of a pass over n tokens at several cache depths: how far the calibrated curve (timed on an empty cache) is from a step's.

Calibration times T(n) on an empty cache, while a reply's passes run behind its prompt and what it has
written so far, hundreds of tokens deep; each drafted row also attends to all of them.  This times one
sequence's passes of each width at each depth, in interleaved rounds (the widths and depths rotate),
and prints T(n) / T(1) per depth beside the median milliseconds, so the curve the controller plans with
can be checked against the passes it prices.

Run on an idle machine (Qwen2.5-Coder-1.5B; about two minutes):
  .venv/bin/python benchmarks/depth_cost.py --json benchmarks/results/depth_cost.json
Check the script quickly:
  .venv/bin/python benchmarks/depth_cost.py --model smollm2-135m-instruct --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from edgespec.backend import LlamaModel, time_forward
from edgespec.fetch import resolve_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--depths", default="0,128,512,1024")
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    depths = [int(d) for d in args.depths.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    model = LlamaModel(resolve_model(args.model), n_ctx=max(depths) + max(widths) + 8, n_threads=args.threads)
    filler = max(model.bos_id, 0)
    seconds = {(d, w): [] for d in depths for w in widths}
    for r in range(args.rounds):
        for depth in (depths if r % 2 == 0 else depths[::-1]):
            model.rewind(0)
            if depth:
                model.decode([filler] * depth, 1)
            time_forward(model, 1, filler)  # the first pass at a new depth is not timed
            for width in (widths if r % 2 == 0 else widths[::-1]):
                seconds[depth, width].append(time_forward(model, width, filler))
    model.close()

    results = {"model": args.model, "rounds": args.rounds, "depths": {}}
    for depth in depths:
        ms = {w: statistics.median(seconds[depth, w]) * 1000 for w in widths}
        relative = {w: ms[w] / ms[1] for w in widths}
        results["depths"][depth] = {"ms_median": ms, "relative": relative}
        print(f"depth {depth:5d}: " + "  ".join(f"T({w}) {ms[w]:7.1f} ms {relative[w]:5.2f}" for w in widths),
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
