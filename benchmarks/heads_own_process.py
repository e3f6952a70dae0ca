"""Auto with heads against plain decoding as a user runs them: each in a process of its own.

heads_speed.py and heads_same_engine.py load a target with heads and one
without into the same process.  There the two targets ran a few percent
apart by an amount that changed from run to run, whatever mode either ran
(the heads target 1.5% slower on chat over 20 rounds in stop 41, about 6%
on explain and story over 8 in stop 42, its plain decoding included).  A
user loads one target.  So here
every reply set runs in a fresh process that loads one target:
- plain: the target without heads, plain decoding;
- ngram: the target without heads, the n-gram default (what a user without heads runs);
- auto: the target with heads, `--draft auto` (n-grams and heads, picked per step).
The configurations alternate (the order turns every round) per kind; each
process decodes the kind's first held-out prompt --replies times from cold
caches and prints the median milliseconds per generated token (per step where
nothing is drafted).  The figures are the medians over rounds of each other
configuration's time a token over auto's (above 1: auto faster), each round's
processes run back to back.

Run on an idle machine (Qwen2.5-Coder-1.5B with trained heads; about 6 minutes with the defaults):
  .venv/bin/python benchmarks/heads_own_process.py --heads HEADS --json benchmarks/results/heads-own-process.json
Copy-heavy kinds, against the n-gram default too:
  .venv/bin/python benchmarks/heads_own_process.py --heads HEADS --suites code-edit,extract --configs plain,ngram,auto
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
CONFIGS = ("plain", "ngram", "auto")
# config -> (load the heads, drafting mode)
SETTINGS = {"plain": (False, "none"), "ngram": (False, "ngram"), "auto": (True, "combined")}


def child(args) -> int:
    """One process, one target, one kind: the median ms per token of --replies cold replies, as JSON on stdout."""
    from edgespec import SamplingParams
    from edgespec.commands.bench.workloads import load_workloads
    from edgespec.engine import Done
    from edgespec.loading import load_engine

    prompt = load_workloads([args.child_suite], 1, directory=HELDOUT)[0]
    quiet = lambda text: None  # noqa: E731
    with_heads, mode = SETTINGS[args.child_config]
    if with_heads:
        engine = load_engine(args.model, "heads", heads_path=args.heads, notice=quiet)
    else:
        engine = load_engine(args.model, "ngram", notice=quiet)
    engine.configure(mode=mode, draft_tokens="auto")
    ms, steps, tokens = [], [], []
    try:
        for _ in range(args.replies):
            engine.forget_cache()
            engine.forget_learning()
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            for event in engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params):
                if isinstance(event, Done):
                    stats = event.result.stats
            ms.append(stats.decode_seconds / stats.tokens_generated * 1000)
            steps.append(stats.steps)
            tokens.append(stats.tokens_generated)
    finally:
        engine.close()
    print(json.dumps({"ms_per_token": statistics.median(ms), "steps": steps, "tokens": tokens}))
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
    parser.add_argument("--configs", default="plain,auto", help=f"two or more of {','.join(CONFIGS)}; auto is required")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replies", type=int, default=3, help="cold replies per process")
    parser.add_argument("--max-tokens", type=int, default=112)
    parser.add_argument("--json", default=None, help="write every process's figures here")
    parser.add_argument("--child-suite", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_suite:
        return child(args)
    configs = args.configs.split(",")
    if "auto" not in configs or len(configs) < 2 or not set(configs) <= set(CONFIGS):
        parser.error(f"--configs takes auto and one or more of {', '.join(CONFIGS[:-1])}")

    runs = []
    for round_ in range(args.rounds):
        order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
        for suite in args.suites.split(","):
            for config in order:
                runs.append({"round": round_, "suite": suite, "config": config, **run_child(args, suite, config)})
                print(f"round {round_ + 1}/{args.rounds} {suite} {config}: {runs[-1]['ms_per_token']:.2f} ms a token",
                      file=sys.stderr, flush=True)
    summary = {}
    for suite in args.suites.split(","):
        ms = {(r["round"], r["config"]): r["ms_per_token"] for r in runs if r["suite"] == suite}
        summary[suite] = {f"{config}_ms_median": round(statistics.median(ms[(n, config)] for n in range(args.rounds)), 2)
                          for config in configs}
        line = f"{suite:13s}" + "".join(f" {config} {summary[suite][f'{config}_ms_median']:6.2f} ms" for config in configs)
        for other in configs:
            if other == "auto":
                continue
            ratios = [ms[(n, other)] / ms[(n, "auto")] for n in range(args.rounds)]
            summary[suite][f"auto_x_{other}"] = [round(r, 3) for r in ratios]
            summary[suite][f"auto_x_{other}_median"] = round(statistics.median(ratios), 3)
            line += f"  auto x {other} {summary[suite][f'auto_x_{other}_median']:.3f}"
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "max_tokens": args.max_tokens, "replies": args.replies,
                       "summary": summary, "runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
