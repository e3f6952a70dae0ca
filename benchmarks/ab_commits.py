"""Two commits' bench runs in turns: what a change did to drafting's speed against plain decoding.

Each round runs `edgespec bench` (with the arguments after --) once from each commit, in a git worktree
of its own, the order swapped every round so that a drifting machine favours neither.  Every run starts
from a fresh copy of this machine's calibration (so both price passes on the same cached curve, and
neither marks it stale for the other) and no learned priors.  Per suite it prints each run's speedup
of the first non-baseline configuration over the baseline run of its own bench, and the medians.

Run on an idle machine (about a minute a run with the arguments below):
  .venv/bin/python benchmarks/ab_commits.py b86afba HEAD --rounds 5 -- --model qwen2.5-coder-1.5b-instruct \\
      --workloads benchmarks/workloads-heldout --suites explain,extract --configs baseline,ngram \\
      --repeats 1 --prompts 1 --temperature 0 --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from edgespec.calibration import cache_dir

ROOT = Path(__file__).resolve().parent.parent
KEPT_CACHE_FILES = ("calibration.json", "model-identity.json")


def speedups(bench_json: Path) -> dict[str, list[float]]:
    """Per suite, each drafted run's decode tok/s over its own repeat's baseline run."""
    runs = json.loads(bench_json.read_text())["runs"]
    base = {(r["prompt_id"], r["repeat"], r["temperature"]): r["decode_tokens_per_second"]
            for r in runs if r["config"] == "baseline"}
    found: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        if r["config"] != "baseline":
            plain = base[r["prompt_id"], r["repeat"], r["temperature"]]
            found[r["suite"]].append(r["decode_tokens_per_second"] / plain)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.epilog = "After --, the arguments of edgespec bench (without --json)."
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = parser.parse_args(argv[:split]), argv[split + 1:]

    results: dict[str, dict[str, list[float]]] = {args.old: defaultdict(list), args.new: defaultdict(list)}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {}
        for commit in (args.old, args.new):
            trees[commit] = Path(scratch) / f"tree-{len(trees)}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[commit]), commit],
                           check=True, capture_output=True)
        try:
            for round_ in range(args.rounds):
                order = (args.old, args.new) if round_ % 2 == 0 else (args.new, args.old)
                for commit in order:
                    cache = Path(scratch) / "cache"
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                    for name in KEPT_CACHE_FILES:
                        if (cache_dir() / name).exists():
                            shutil.copy(cache_dir() / name, cache / name)
                    out = Path(scratch) / "bench.json"
                    # -m from the worktree: its own edgespec is imported, not the checkout's
                    bench = subprocess.run([sys.executable, "-m", "edgespec", "bench", *bench_args, "--json", str(out)],
                                           cwd=trees[commit], env={**os.environ, "EDGESPEC_CACHE_DIR": str(cache)},
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    if bench.returncode != 0:
                        last = (bench.stderr.strip().splitlines() or ["no message"])[-1]
                        print(f"edgespec bench at {commit} failed (exit {bench.returncode}): {last}", file=sys.stderr)
                        return 1
                    for suite, ratios in speedups(out).items():
                        results[commit][suite].extend(ratios)
                    print(f"round {round_ + 1}/{args.rounds}: {commit} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    for suite in results[args.new]:
        for commit in (args.old, args.new):
            ratios = results[commit][suite]
            print(f"{suite:14s} {commit:>12s}: median {statistics.median(ratios):.3f}  runs "
                  + ", ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
