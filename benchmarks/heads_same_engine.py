"""What a heads-loaded target costs per step in each drafting mode, against a target loaded without heads.

benchmarks/heads_speed.py compares plain decoding and n-grams on a target loaded without heads with heads
and auto on one loaded with them, so a difference between the two loaded targets reads as the modes'.
This script runs every mode on both, in rotating order per round, the same prompts and caches forgotten
before each reply, and prints per (suite, target, mode) the median milliseconds per step, the steps a
112-token reply took and the median decode tok/s, with every round's ms per step.

Run on an idle machine (about 9 minutes on the 2-core EPYC with the defaults):
  .venv/bin/python benchmarks/heads_same_engine.py --heads /tmp/heads.npz --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from edgespec import SamplingParams
from edgespec.commands.bench.workloads import load_workloads
from edgespec.engine import Done
from edgespec.loading import load_engine

HELDOUT = Path(__file__).resolve().parent / "workloads-heldout"
# (target, mode): "heads" is the target loaded with heads, "plain" without
CONFIGS = [("plain", "none"), ("plain", "ngram"), ("heads", "none"), ("heads", "ngram"), ("heads", "combined")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", type=Path, default=None, help="heads file (default: the model's own)")
    parser.add_argument("--suites", default="chat,code-edit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=112)
    args = parser.parse_args()
    prompts = load_workloads(args.suites.split(","), 1, directory=HELDOUT)
    notice = lambda text: print(f"  {text}", file=sys.stderr)  # noqa: E731
    engines = {"heads": load_engine(args.model, "heads", heads_path=args.heads, notice=notice)}
    try:
        engines["plain"] = load_engine(args.model, "ngram", notice=notice)
        steps = {}
        for round_ in range(args.rounds):
            for target, mode in CONFIGS[round_ % len(CONFIGS):] + CONFIGS[:round_ % len(CONFIGS)]:
                engine = engines[target]
                engine.configure(mode=mode, draft_tokens="auto")
                engine.forget_cache()
                engine.forget_learning()
                for prompt in prompts:
                    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
                    for event in engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params):
                        if isinstance(event, Done):
                            stats = event.result.stats
                    steps.setdefault((prompt.suite, target, mode), []).append(
                        (stats.decode_seconds / stats.steps * 1000, stats.steps, stats.decode_tokens_per_second))
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    for (suite, target, mode), runs in sorted(steps.items()):
        print(f"{suite:10s} {target:6s} {mode:9s} ms/step median {statistics.median(r[0] for r in runs):5.1f}  "
              f"steps {sorted({r[1] for r in runs})}  tok/s median {statistics.median(r[2] for r in runs):5.2f}  "
              f"per round {[round(r[0], 1) for r in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
