"""What learning from usage (EDGESPEC_LEARN_HEADS=1) costs a decoding step, against the step itself.

With heads drafting, the target keeps the hidden states of the rows that
verification kept and hands them, with the tokens that followed, to the
usage log (edgespec.heads.usage), which writes chunk files.  The time spent
in that bookkeeping is counted where it happens (HiddenStateModel.usage_seconds,
the chunk writes included), so the figure does not rest on comparing two
noisy speeds.  It must stay under 1% of a step for the feature to be on by
default.  Every reply is also checked against plain decoding's.

Needs heads trained for the target (`edgespec heads train`, or --heads FILE).
Run on an idle machine (the usage is written to a temporary folder, not the cache dir):
  .venv/bin/python benchmarks/heads_usage_cost.py --json benchmarks/results/heads_usage_cost.json
Check the script quickly:
  .venv/bin/python benchmarks/heads_usage_cost.py --model smollm2-135m-instruct --prompts 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from edgespec import SamplingParams
from edgespec.commands.bench.workloads import load_workloads
from edgespec.heads.usage import UsageLog
from edgespec.loading import load_engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", type=Path, default=None, help="heads file (default: the model's own)")
    parser.add_argument("--suites", default="chat,creative,code-edit")
    parser.add_argument("--prompts", type=int, default=2, help="the first N prompts of each suite")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    notice = lambda text: print(f"  {text}", file=sys.stderr)  # noqa: E731
    engine = load_engine(args.model, "heads", heads_path=args.heads, n_threads=args.threads, notice=notice)
    prompts = load_workloads(args.suites.split(","), args.prompts)
    steps = decode_seconds = 0.0
    same = True
    with tempfile.TemporaryDirectory() as folder:
        target = engine.target
        target.usage_sink = log = UsageLog(Path(folder) / "usage", target.n_embd)
        try:
            for prompt in prompts:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
                engine.configure(mode="heads")
                result = engine.generate(prompt.prompt, params)
                engine.configure(mode="none")
                same &= engine.generate(prompt.prompt, params).token_ids == result.token_ids
                steps += result.stats.steps
                decode_seconds += result.stats.decode_seconds
                print(f"  {prompt.suite}/{prompt.id}: {result.stats.steps} steps", file=sys.stderr, flush=True)
            started = time.perf_counter()
            log.flush()
            closing = time.perf_counter() - started
            kept = sum(chunk.stat().st_size for chunk in (Path(folder) / "usage").glob("*.npz"))
        finally:
            engine.close()
    step_ms = decode_seconds / max(steps, 1) * 1000
    usage_ms = target.usage_seconds / max(steps, 1) * 1000
    result = {"model": engine.target_path.name, "steps": int(steps), "step_ms": round(step_ms, 3),
              "usage_ms_per_step": round(usage_ms, 4), "share_of_a_step": round(usage_ms / step_ms, 5),
              "last_flush_ms": round(closing * 1000, 2), "bytes_kept": kept, "same_as_plain": same}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
