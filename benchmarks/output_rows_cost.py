"""What a verification pass pays for its logits rows: a pass of n tokens with every row's logits, against the last row's only.

Verification needs the logits of every row it checks, so each drafted token
costs the model's output layer once more (Qwen2.5-Coder-1.5B: a 151,936 x 1,536
Q6_K matrix, about 15% of a token's multiply-adds).  llama.cpp's own
benchmarks (llama-bench's pp tests) ask for the last row only, so a curve read
from them is flatter than the one speculation pays.  This times both, over
the same tokens at the same depth, in interleaved rounds, and gives each width
as a multiple of a one-token pass (T(n) / T(1)), as the calibration does.

Run on an idle machine (Qwen2.5-Coder-1.5B; about two minutes):
  .venv/bin/python benchmarks/output_rows_cost.py --json benchmarks/results/output-rows-cost.json
Check the script quickly:
  .venv/bin/python benchmarks/output_rows_cost.py --model smollm2-135m-instruct --rounds 2 --widths 1,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from edgespec.backend import LlamaModel
from edgespec.fetch import resolve_model

TEXT = ("def merge(a, b):\n    out = dict(a)\n    for key, value in b.items():\n        out[key] = value\n"
        "    return out\n\n")


def timed_pass(model: LlamaModel, tokens: list[int], rows: int) -> float:
    """Seconds for one pass over tokens that returns the logits of its last `rows` rows; the cache is left as it was."""
    depth = len(model.cached)
    started = time.perf_counter()
    model.decode(tokens, rows, copy=False)
    spent = time.perf_counter() - started
    model.rewind(depth)
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9,10,12,16", help="pass widths, comma-separated")
    parser.add_argument("--depth", type=int, default=300, help="tokens in the cache before each pass")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    model = LlamaModel(resolve_model(args.model), n_ctx=args.depth + max(widths) + 8, n_threads=args.threads)
    text = model.tokenize(TEXT, add_special=False)
    stream = text * (1 + (args.depth + max(widths)) // len(text))
    model.decode(stream[:args.depth], 1)
    fed = stream[args.depth:args.depth + max(widths)]

    seconds: dict[tuple[int, str], list[float]] = {}
    variants = {"every row": lambda n: n, "last row": lambda n: 1}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))  # neither always goes first
        for width in widths:
            for name in order:
                spent = timed_pass(model, fed[:width], variants[name](width))
                seconds.setdefault((width, name), []).append(spent)
    name = model.path.name
    model.close()

    one = statistics.median(seconds[(1, "every row")])
    results = {"model": name, "depth": args.depth, "rounds": args.rounds, "t1_ms": round(one * 1000, 2),
               "relative": {name: {w: round(statistics.median(seconds[(w, name)]) / one, 3) for w in widths}
                            for name in variants}}
    print(f"{'width':>5} {'every row':>10} {'last row':>9}  (T(n) / T(1), T(1) {one * 1000:.1f} ms)", file=sys.stderr)
    for w in widths:
        print(f"{w:>5} {results['relative']['every row'][w]:>10.2f} {results['relative']['last row'][w]:>9.2f}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    else:
        json.dump(results, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
