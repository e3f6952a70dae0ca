"""Plain decoding, one process per generation on both sides: `edgespec run --raw` against llama.cpp's peer drafting nothing.

The bench runs edgespec's configurations inside its own long-lived process and
each llama.cpp peer run as a fresh one.  This takes the bench out of the
comparison: the same rendered chat prompt goes to a new `edgespec run --raw
--draft none` process and to llama-speculative-simple in its plain mode
(edgespec.commands.bench.peers), the two interleaved, and it gives each pair's
ratio of decode tok/s (peer over edgespec) and their median.

Run on an idle machine, after benchmarks/build_llama_cpp_peer.sh (about four minutes):
  .venv/bin/python benchmarks/plain_vs_peer.py --llama-cpp-bin "$(benchmarks/build_llama_cpp_peer.sh)"
Check the script quickly:
  .venv/bin/python benchmarks/plain_vs_peer.py --llama-cpp-bin DIR --model smollm2-135m-instruct --rounds 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from edgespec.commands.bench.peers import LlamaCppPeer
from edgespec.fetch import resolve_model
from edgespec.loading import load_engine

ROOT = Path(__file__).resolve().parent.parent


def edgespec_plain(prompt: str, model: Path, max_tokens: int, n_ctx: int, threads: int) -> float:
    """Decode tok/s of plain decoding in a new edgespec process."""
    command = [sys.executable, "-m", "edgespec", "run", "--raw", "-", "--model", str(model), "--draft", "none",
               "--temperature", "0", "--max-tokens", str(max_tokens), "--n-ctx", str(n_ctx), "--threads", str(threads),
               "--no-prompt-cache", "--json"]
    done = subprocess.run(command, input=prompt, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout)["stats"]["decode_tokens_per_second"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-bin", required=True, help="the folder build_llama_cpp_peer.sh prints")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--workload", default=str(ROOT / "benchmarks/workloads-heldout/code-edit.jsonl"))
    parser.add_argument("--prompts", type=int, default=4, help="the workload's first N prompts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the pairs here")
    args = parser.parse_args()

    model = resolve_model(args.model)
    lines = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()][:args.prompts]
    with load_engine(model, "none", n_ctx=args.n_ctx, cost_curve=[1.0], notice=lambda _: None) as engine:
        rendered = {row["id"]: engine.render_chat([{"role": "user", "content": row["prompt"]}]) for row in lines}
    peer = LlamaCppPeer(args.llama_cpp_bin, model, draft=None, n_ctx=args.n_ctx, n_threads=args.threads)

    pairs = []
    for r in range(args.rounds):
        for prompt_id, prompt in rendered.items():
            speeds = {}
            for side in (("edgespec", "peer") if r % 2 == 0 else ("peer", "edgespec")):  # neither always first
                if side == "peer":
                    run = peer.run(prompt, spec_type="none", draft_max=None, max_tokens=args.max_tokens)
                    speeds[side] = run.tokens_generated / run.decode_seconds
                else:
                    speeds[side] = edgespec_plain(prompt, model, args.max_tokens, args.n_ctx, args.threads)
            pairs.append({"prompt_id": prompt_id, "round": r, **speeds, "peer_over_edgespec": speeds["peer"] / speeds["edgespec"]})
            print(f"{prompt_id} round {r}: edgespec {speeds['edgespec']:.1f} tok/s, peer {speeds['peer']:.1f} tok/s, "
                  f"peer / edgespec {pairs[-1]['peer_over_edgespec']:.3f}", file=sys.stderr)
    ratios = sorted(pair["peer_over_edgespec"] for pair in pairs)
    print(f"peer / edgespec plain decoding: median {statistics.median(ratios):.3f} of {len(ratios)} pairs "
          f"({ratios[0]:.3f}-{ratios[-1]:.3f})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": model.name, "rounds": args.rounds, "max_tokens": args.max_tokens, "pairs": pairs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
