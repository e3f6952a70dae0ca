"""What flash attention would change: pass times and how far a wide pass's rows drift from one-token steps.

edgespec keeps flash attention off (edgespec.limits.kv_cache_types): with it,
a row's logits depend on the width of its pass.  llama.cpp's own binaries
leave it to llama.cpp ("auto"), which turns it on for the CPU, so the peer the
bench compares with decodes with it.  This measures both sides of that choice
on one target, in one process, flash attention off and on:

- speed: the median seconds of a one-token step and of passes of several
  widths, at the same depth, the two contexts interleaved round by round;
- drift: the largest difference between a row's logits in a pass of width w
  and the same row decoded one token at a time, and how many rows' best token
  it changes (over tokens of real text, so the rows are not flat).

Run on an idle machine (Qwen2.5-Coder-1.5B; about three minutes):
  .venv/bin/python benchmarks/flash_attention.py --json benchmarks/results/flash-attention.json
Check the script quickly:
  .venv/bin/python benchmarks/flash_attention.py --model smollm2-135m-instruct --rounds 2 --widths 1,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from edgespec.backend import LlamaModel
from edgespec.fetch import resolve_model

TEXT = ("def merge(a, b):\n    out = dict(a)\n    for key, value in b.items():\n        out[key] = value\n"
        "    return out\n\n")


def timed_pass(model: LlamaModel, tokens: list[int]) -> float:
    """Seconds for one pass over tokens that returns every row's logits; the cache is left as it was."""
    depth = len(model.cached)
    started = time.perf_counter()
    model.decode(tokens, len(tokens), copy=False)
    spent = time.perf_counter() - started
    model.rewind(depth)
    return spent


def drift(model: LlamaModel, tokens: list[int], widths: list[int]) -> dict[int, dict]:
    """Per width: the largest logit difference between the pass's rows and one-token steps, and best tokens changed."""
    depth = len(model.cached)
    steps = np.array([model.decode([token], 1)[0] for token in tokens])
    model.rewind(depth)
    found = {}
    for width in widths:
        rows = np.array(model.decode(tokens[:width], width))
        model.rewind(depth)
        found[width] = {"max_logit_drift": round(float(np.abs(rows - steps[:width]).max()), 4),
                        "best_token_changes": int((rows.argmax(1) != steps[:width].argmax(1)).sum())}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--widths", default="1,2,3,4,8,16", help="pass widths, comma-separated")
    parser.add_argument("--depth", type=int, default=300, help="tokens in the cache before each pass")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    path = resolve_model(args.model)
    models = {flash: LlamaModel(path, n_ctx=args.depth + max(widths) + 8, n_threads=args.threads, flash_attn=flash)
              for flash in (False, True)}
    text = models[False].tokenize(TEXT, add_special=False)
    stream = text * (1 + (args.depth + max(widths)) // len(text))
    fed = stream[args.depth:args.depth + max(widths)]
    for model in models.values():
        model.decode(stream[:args.depth], 1)

    seconds: dict[tuple[bool, int], list[float]] = {}
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)  # neither always goes first
        for width in widths:
            for flash in order:
                seconds.setdefault((flash, width), []).append(timed_pass(models[flash], fed[:width]))
    drifts = {flash: drift(model, fed, [w for w in widths if w > 1]) for flash, model in models.items()}
    name = models[False].path.name
    for model in models.values():
        model.close()

    label = {False: "off", True: "on"}
    medians = {(flash, w): statistics.median(seconds[(flash, w)]) for flash in models for w in widths}
    results = {"model": name, "depth": args.depth, "rounds": args.rounds,
               "ms": {label[flash]: {w: round(medians[(flash, w)] * 1000, 2) for w in widths} for flash in models},
               "on_over_off": {w: round(medians[(True, w)] / medians[(False, w)], 3) for w in widths},
               "drift": {label[flash]: found for flash, found in drifts.items()}}
    print(f"{'width':>5} {'off ms':>8} {'on ms':>8} {'on/off':>7}  {'drift off':>9} {'drift on':>9}  "
          "(best tokens changed)", file=sys.stderr)
    for w in widths:
        off, on = drifts[False].get(w), drifts[True].get(w)
        shown = (f"{off['max_logit_drift']:>6.3f} ({off['best_token_changes']}) {on['max_logit_drift']:>6.3f} "
                 f"({on['best_token_changes']})") if off else ""
        print(f"{w:>5} {medians[(False, w)] * 1000:>8.1f} {medians[(True, w)] * 1000:>8.1f} "
              f"{results['on_over_off'][w]:>7.3f}  {shown}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
