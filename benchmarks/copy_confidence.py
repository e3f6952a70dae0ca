"""Does the target's own confidence tell where an n-gram copy will hold, beyond the copy's length?

The n-gram controller estimates a draft's acceptance from where its match was
found and how long it is (hindsight.py).  Every verified row also gives the
target's distribution over the token it chose, for free: in a copy the target
is sure, at an edit it hesitates.  If those hesitations came before the
copy broke, the controller could draft longer where the target is sure.

At T = 0 this is settled offline on recorded replies (record_replies.py): one
teacher-forced pass per reply gives the target's top-1 probability at every
position, and at every position the real NgramDrafter proposes 16 tokens,
kept up to their first difference from the reply.  The table splits the
proposals by copy length and by whether the target was sure (top-1 of at least
--sure) of each of the --window tokens before the draft, and gives how often
the first drafted token was kept and the mean kept run.

Run (Qwen2.5-Coder-1.5B; about three minutes, most of it the teacher passes):
  .venv/bin/python benchmarks/copy_confidence.py benchmarks/workloads-heldout/replies-qwen2.5-coder-1.5b.jsonl
Check the script quickly:
  .venv/bin/python benchmarks/copy_confidence.py benchmarks/workloads-heldout/replies-smollm2-135m.jsonl \\
      --model smollm2-135m-instruct --limit 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from edgespec.backend import LlamaModel
from edgespec.drafters import NgramDrafter, copy_signal_parts
from edgespec.fetch import resolve_model
from edgespec.limits import MAX_OUTPUT_ROWS

DRAFT = 16
# Copy lengths as the controller's estimates bucket them, roughly: none, 1-2, 3-5, 6-15, 16 and more.
BUCKETS = ((1, 2), (3, 5), (6, 15), (16, 10_000))


def top1_probabilities(model: LlamaModel, prompt: list[int], reply: list[int]) -> list[float]:
    """The target's top-1 probability at each reply position (the distribution that chose reply[i])."""
    model.rewind(0)
    model.decode(prompt[:-1], 1)
    fed, top = [prompt[-1]] + reply[:-1], []
    for start in range(0, len(fed), MAX_OUTPUT_ROWS):
        chunk = fed[start:start + MAX_OUTPUT_ROWS]
        logits = model.decode(chunk, len(chunk), copy=False)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        top += (1.0 / shifted.sum(axis=1)).tolist()  # the top token's exp is 1 after the shift
    return top


def bucket_of(copy_length: int) -> str:
    for low, high in BUCKETS:
        if low <= copy_length <= high:
            return f"{low}+" if high >= 10_000 else f"{low}-{high}"
    return "none"


def proposals(prompt: list[int], reply: list[int]):
    """(position, copy length, kept run) of each 16-token proposal the n-gram drafter makes along the reply."""
    drafter = NgramDrafter()
    for position in range(1, len(reply)):
        context = prompt + reply[:position]
        tokens = drafter.propose(context, DRAFT).tokens
        if not tokens:
            continue
        _, copy_length = copy_signal_parts(drafter.peek(context).signal)
        run = 0
        while run < len(tokens) and position + run < len(reply) and tokens[run] == reply[position + run]:
            run += 1
        yield position, copy_length, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replies", nargs="+", type=Path, help="JSONL files from record_replies.py (T = 0)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--sure", type=float, default=0.8, help="top-1 probability that counts as sure")
    parser.add_argument("--window", type=int, default=3, help="tokens before the draft the target must be sure of")
    parser.add_argument("--limit", type=int, default=None, help="only the first N replies (a quick check)")
    parser.add_argument("--json", default=None, help="write the table here")
    args = parser.parse_args()

    rows = [json.loads(line) for path in args.replies for line in path.read_text().splitlines() if line.strip()]
    rows = rows[:args.limit]
    model = LlamaModel(resolve_model(args.model), n_ctx=4096)
    counts = defaultdict(lambda: [0, 0, 0])  # proposals, first token kept, tokens kept
    for row in rows:
        top = top1_probabilities(model, row["prompt_ids"], row["reply_ids"])
        for position, copy_length, run in proposals(row["prompt_ids"], row["reply_ids"]):
            sure = min(top[max(0, position - args.window):position]) >= args.sure
            for kind in (row["suite"], "all"):
                entry = counts[(kind, bucket_of(copy_length), "sure" if sure else "unsure")]
                entry[0] += 1
                entry[1] += run > 0
                entry[2] += run
        print(f"{row['id']}: done", file=sys.stderr)
    model.close()

    table = [{"kind": kind, "copy_length": bucket, "target": sure, "proposals": n,
              "first_kept": round(first / n, 3), "mean_kept": round(kept / n, 2)}
             for (kind, bucket, sure), (n, first, kept) in sorted(counts.items())]
    print(f"{'kind':<14} {'copy':>6} {'target':>7} {'drafts':>6} {'1st kept':>8} {'mean kept':>9}")
    for entry in table:
        print(f"{entry['kind']:<14} {entry['copy_length']:>6} {entry['target']:>7} {entry['proposals']:>6} "
              f"{entry['first_kept']:>8.2f} {entry['mean_kept']:>9.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "sure": args.sure, "window": args.window, "draft": DRAFT,
                       "table": table}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
