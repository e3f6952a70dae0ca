"""Auto with heads against plain decoding as a user runs them: each in a process of its own.

heads_speed.py and heads_same_engine.py load a target with heads and one
without into the same process.  There the two targets ran a few percent
apart by an amount that changed from run to run, whatever mode either ran
(the heads target 1.5% slower on chat over 20 rounds in stop 41, about 6%
on explain and story over 8 in stop 42, its plain decoding included).  A
user loads one target.  So here
every reply set runs in a fresh process that loads one target:
- plain: the target without heads, plain decoding;
- auto: the target with heads, `--draft auto` (n-grams and heads, picked per step).
The two alternate (the order swaps every round) per kind; each process
decodes the kind's first held-out prompt --replies times from cold caches
and prints the median milliseconds per step.  The figure is the median over
rounds of plain's step over auto's (above 1: auto faster), each round's pair
run back to back.

Run on an idle machine (Qwen2.5-Coder-1.5B with trained heads; about 6 minutes with the defaults):
  .venv/bin/python benchmarks/heads_own_process.py --heads HEADS --json benchmarks/results/heads-own-process.json
Check the script quickly:
  .venv/bin/python benchmarks/heads_own_process.py --model smollm2-135m-instruct --heads TINY_HEADS \\
      --suites chat --rounds 1 --replies 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HELDOUT = Path(__file__).resolve().parent / "workloads-heldout"
CONFIGS = ("plain", "auto")


def child(args) -> int:
    """One process, one target, one kind: the median ms per step of --replies cold replies, as JSON on stdout."""
    from edgespec import SamplingParams
    from edgespec.commands.bench.workloads import load_workloads
    from edgespec.engine import Done
    from edgespec.loading import load_engine

    prompt = load_workloads([args.child_suite], 1, directory=HELDOUT)[0]
    quiet = lambda text: None  # noqa: E731
    if args.child_config == "auto":
        engine = load_engine(args.model, "heads", heads_path=args.heads, notice=quiet)
        engine.configure(mode="combined", draft_tokens="auto")
    else:
        engine = load_engine(args.model, "ngram", notice=quiet)
        engine.configure(mode="none", draft_tokens="auto")
    ms, steps = [], []
    try:
        for _ in range(args.replies):
            engine.forget_cache()
            engine.forget_learning()
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            for event in engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params):
                if isinstance(event, Done):
                    stats = event.result.stats
            ms.append(stats.decode_seconds / stats.steps * 1000)
            steps.append(stats.steps)
    finally:
        engine.close()
    print(json.dumps({"ms_per_step": statistics.median(ms), "steps": steps}))
    return 0


def run_child(args, suite: str, config: str) -> dict:
    command = [sys.executable, __file__, "--child-suite", suite, "--child-config", config, "--model", args.model,
               "--replies", str(args.replies), "--max-tokens", str(args.max_tokens)]
    if args.heads is not None:
        command += ["--heads", str(args.heads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", type=Path, default=None, help="heads file (default: the model's own)")
    parser.add_argument("--suites", default="explain,story,chat")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replies", type=int, default=3, help="cold replies per process")
    parser.add_argument("--max-tokens", type=int, default=112)
    parser.add_argument("--json", default=None, help="write every process's figures here")
    parser.add_argument("--child-suite", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_suite:
        return child(args)

    runs = []
    for round_ in range(args.rounds):
        for suite in args.suites.split(","):
            for config in CONFIGS if round_ % 2 == 0 else reversed(CONFIGS):
                runs.append({"round": round_, "suite": suite, "config": config, **run_child(args, suite, config)})
                print(f"round {round_ + 1}/{args.rounds} {suite} {config}: {runs[-1]['ms_per_step']:.2f} ms a step",
                      file=sys.stderr, flush=True)
    summary = {}
    for suite in args.suites.split(","):
        step = {(r["round"], r["config"]): r["ms_per_step"] for r in runs if r["suite"] == suite}
        ratios = [step[(n, "plain")] / step[(n, "auto")] for n in range(args.rounds)]
        summary[suite] = {"plain_ms_median": round(statistics.median(step[(n, "plain")] for n in range(args.rounds)), 2),
                          "auto_ms_median": round(statistics.median(step[(n, "auto")] for n in range(args.rounds)), 2),
                          "auto_x_plain": [round(r, 3) for r in ratios],
                          "auto_x_plain_median": round(statistics.median(ratios), 3)}
        print(f"{suite:10s} plain {summary[suite]['plain_ms_median']:6.2f} ms  auto {summary[suite]['auto_ms_median']:6.2f} ms"
              f"  auto x plain {summary[suite]['auto_x_plain_median']:.3f}  rounds {summary[suite]['auto_x_plain']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "max_tokens": args.max_tokens, "replies": args.replies,
                       "summary": summary, "runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
