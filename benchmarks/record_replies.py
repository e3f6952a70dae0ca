"""Record a model's replies to the held-out workloads, for the n-gram drafting simulator.

Each prompt is rendered with the model's chat template and decoded plainly (no drafting), by default
at T = 0, so the recorded reply is exactly what every drafted run must reproduce: benchmarks/ngram_sim.py
replays it to tell what each draft would have kept, without timing anything.

Run (minutes on a CPU; the output is deterministic for one machine's kernels):
    .venv/bin/python benchmarks/record_replies.py \
        --model qwen2.5-coder-1.5b-instruct --out benchmarks/workloads-heldout/replies-qwen2.5-coder-1.5b.jsonl
Sampled replies, one per seed, for the simulator at T > 0 (--draft ngram records them faster, and
rejection sampling keeps them samples of the target's own distribution):
    .venv/bin/python benchmarks/record_replies.py --draft ngram --temperature 0.7 --seeds 1,2,3 \
        --suites explain,chat,story --out replies-t07.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgespec.commands.bench.workloads import load_workloads
from edgespec.engine import result_of
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams

EPYC_CURVE = (1.0, 1.58, 2.23, 2.67, 3.1325, 3.565, 3.9975, 4.4, 4.5, 4.6, 4.7, 4.8, 4.9, 5.0, 5.1, 5.2)
HELDOUT_DIR = Path(__file__).parent / "workloads-heldout"
HELDOUT_SUITES = ("explain", "extract", "code-edit", "refactor", "summary-quote", "chat", "story")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="target GGUF: path or catalog name")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write, one reply per line")
    parser.add_argument("--suites", default=",".join(HELDOUT_SUITES), help="comma-separated held-out suites")
    parser.add_argument("--workloads", type=Path, default=HELDOUT_DIR, help="folder of <suite>.jsonl files")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--draft", choices=("none", "ngram"), default="none",
                        help="ngram: record faster with n-gram drafting (the same tokens at T = 0, but where the "
                             "target's two best tokens tie within the kernels' drift between pass widths)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (1 on a busy machine: ggml's threads spin-wait)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, one reply per seed (the id gains '@SEED'): an n-gram draft is "
                             "a point proposal, so replaying a sampled reply with T = 0's rule keeps a draft token with "
                             "the target's probability of it, as rejection sampling would")
    parser.add_argument("--seeds", default="1234", help="comma-separated seeds, with --temperature above 0")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")] if args.temperature > 0 else [None]
    # the first prompt of every kind, then the second ...: an interrupted recording still covers every kind
    prompts = sorted(load_workloads(args.suites.split(","), directory=args.workloads),
                     key=lambda prompt: (prompt.id.rsplit("-", 1)[-1], prompt.suite))
    # a fixed cost curve (issue 27's EPYC one) skips measuring this machine
    engine = load_engine(args.model, args.draft, n_ctx=args.n_ctx, pull=False, cost_curve=EPYC_CURVE, n_threads=args.threads)
    done = _already_recorded(args.out)
    with args.out.open("a", encoding="utf-8") as out:
        for prompt, seed in ((prompt, seed) for prompt in prompts for seed in seeds):
            row_id = prompt.id if seed is None else f"{prompt.id}@{seed}"
            if row_id in done:
                continue
            prompt_ids = engine.prompt_tokens(prompt.prompt)
            sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed)
            result = result_of(engine.stream_tokens(prompt_ids, sampling))
            row = {"suite": prompt.suite, "id": row_id, "model": engine.target_path.name, "draft": args.draft,
                   "temperature": args.temperature, "seed": seed,
                   "prompt_ids": prompt_ids, "reply_ids": result.token_ids, "finish_reason": result.finish_reason,
                   # what the simulator's drafter cuts drafts at, and (taken as) the token that ended a stopped reply
                   "end_tokens": sorted(engine.target.end_of_generation_ids), "end_token": engine.target.eos_id}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{row_id}: {len(result.token_ids)} tokens ({result.finish_reason})", file=sys.stderr)
    engine.close()
    return 0


def _already_recorded(path: Path) -> set[str]:
    """Ids already in the output file, so that an interrupted recording resumes where it stopped."""
    if not path.is_file():
        return set()
    return {json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


if __name__ == "__main__":
    sys.exit(main())
