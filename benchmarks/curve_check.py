"""Does the calibrated cost curve price a real run's passes?  Each run's pass widths priced at T(w), against its decode time.

The n-gram simulator (ngram_sim.py) and the controller both price a pass of width w at the calibrated
T(w), timed on an empty cache.  This runs `edgespec run --json` on the first held-out prompt of a few
kinds, plain and with n-grams in turns, and prints each run's decode seconds over what its passes
cost on the curve (this machine's calibration of the model, from the cache dir): a ratio near the
plain runs' for the drafted runs says the curve prices wide passes as they really run.  The runs use
a temporary cache dir holding only that calibration, so each starts cold and none leaves learned
priors behind.

Run on an idle machine (Qwen2.5-Coder-1.5B, calibrated; about three minutes):
  .venv/bin/python benchmarks/curve_check.py > benchmarks/results/curve-check.txt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from edgespec.calibration import cache_dir

HELDOUT = Path(__file__).parent / "workloads-heldout"
EDGESPEC = Path(sys.executable).with_name("edgespec")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--kinds", default="code-edit,refactor,extract")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="the calibration entry to price with is this thread count's")
    args = parser.parse_args()

    entries = json.loads((cache_dir() / "calibration.json").read_text())["entries"].values()
    name = args.model if args.model.endswith(".gguf") else f"{args.model}.gguf"
    entry = next((e for e in entries if Path(e["key"]["model_path"]).name == name and e["key"]["n_threads"] == args.threads), None)
    if entry is None:
        raise SystemExit(f"no calibration of {name} at {args.threads} threads in {cache_dir()}: run the model once first")
    curve = entry["forward_seconds"]
    with tempfile.TemporaryDirectory() as cold:
        shutil.copy(cache_dir() / "calibration.json", cold)
        run_kinds(args, curve, {**os.environ, "EDGESPEC_CACHE_DIR": cold})
    return 0


def run_kinds(args, curve: list[float], env: dict) -> None:
    for kind in args.kinds.split(","):
        prompt = json.loads((HELDOUT / f"{kind}.jsonl").read_text().splitlines()[0])["prompt"]
        for draft in ("none", "ngram") * args.rounds:
            done = subprocess.run([str(EDGESPEC), "run", "--model", args.model, "--draft", draft, "--temperature", "0",
                                   "--max-tokens", "200", "--threads", str(args.threads), "--no-prompt-cache", "--json",
                                   prompt], capture_output=True, text=True, check=True, env=env)
            stats = json.loads(done.stdout)["stats"]
            widths = {int(w): n for w, n in stats["pass_widths"].items()}
            priced = sum(curve[w - 1] * n for w, n in widths.items())
            print(f"{kind:10s} {draft:6s} tokens {stats['tokens_generated']} passes {stats['target_forward_passes']} "
                  f"decode {stats['decode_seconds']:.2f} s, on the curve {priced:.2f} s, ratio {stats['decode_seconds'] / priced:.3f} "
                  f"| prompt {stats['prompt_tokens']} tokens, widths {dict(sorted(widths.items()))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
