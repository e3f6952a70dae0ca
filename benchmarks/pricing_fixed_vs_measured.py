"""Does pricing passes by their measured times cost code edits? Plain, the default, and the default planning on a fixed curve.

The controller prices each pass width by what its recent passes took (controller.SpeedGuard), so on a
noisy machine its drafting changes from run to run at T = 0: code-edit-02's five bench runs drafted
three to eighteen wide passes and read 0.84-1.10 of plain decoding by their in-run pace.  With a fixed
cost curve (load_engine(cost_curve=...)) the guard reads the curve instead of the clock and every run
drafts as benchmarks/ngram_sim.py predicts.  This loads both engines, runs each prompt through plain
decoding, the default and the fixed-curve default, the order turning per repeat, from cold priors and
an empty KV cache each time, and gives each configuration's median of its ratios to the plain run of
the same repeat.

Run on an idle machine (about 10 minutes with the defaults):
  .venv/bin/python benchmarks/pricing_fixed_vs_measured.py --json benchmarks/results/avx512-pricing-fixed-vs-measured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from edgespec.fetch import resolve_model
from edgespec.loading import load_engine, use_learning
from edgespec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--workload", default=str(ROOT / "benchmarks/workloads-heldout/code-edit.jsonl"))
    parser.add_argument("--prompts", type=int, default=4, help="the workload's first N prompts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--curve", default=str(ROOT / "benchmarks/results/avx512-heldout-t0.json"),
                        help="a bench JSON whose meta.cost_curve_relative is the fixed curve")
    parser.add_argument("--json", default=None, help="write every run here")
    args = parser.parse_args()

    model = resolve_model(args.model)
    curve = json.loads(Path(args.curve).read_text())["meta"]["cost_curve_relative"]
    rows = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()][:args.prompts]
    quiet = lambda _: None  # noqa: E731
    measured = load_engine(model, "ngram", n_ctx=4096, notice=quiet)
    fixed = load_engine(model, "ngram", n_ctx=4096, notice=quiet, cost_curve=curve)
    for engine in (measured, fixed):
        use_learning(engine, "cold", pool=False)
    configs = {"plain": (measured, "none"), "measured": (measured, "ngram"), "fixed": (fixed, "ngram")}
    names = list(configs)

    runs = []
    for repeat in range(args.repeats):
        for row in rows:
            for name in names[repeat % 3:] + names[:repeat % 3]:
                engine, mode = configs[name]
                engine.configure(mode=mode)
                engine.forget_cache()
                engine.forget_learning()
                stats = engine.chat([{"role": "user", "content": row["prompt"]}],
                                    SamplingParams(temperature=0, max_tokens=args.max_tokens)).stats
                runs.append({"repeat": repeat, "prompt_id": row["id"], "config": name,
                             "decode_tokens_per_second": stats.decode_tokens_per_second,
                             "target_passes_per_token": stats.target_passes_per_token,
                             "pass_widths": {str(w): n for w, n in sorted(stats.pass_widths.items())}})
                print(f"{row['id']} repeat {repeat} {name}: {stats.decode_tokens_per_second:.1f} tok/s, "
                      f"widths {dict(sorted(stats.pass_widths.items()))}", file=sys.stderr)
    measured.close()
    fixed.close()

    speed = {(r["repeat"], r["prompt_id"], r["config"]): r["decode_tokens_per_second"] for r in runs}
    for row in rows:
        line = []
        for name in ("measured", "fixed"):
            ratios = [speed[(i, row["id"], name)] / speed[(i, row["id"], "plain")] for i in range(args.repeats)]
            line.append(f"{name} {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{row['id']} x plain, paired medians: " + ", ".join(line))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": model.name, "curve": args.curve, "max_tokens": args.max_tokens, "runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
