"""Predicted Outputs in replay: what a prediction of the edited file does to n-gram drafting, timing nothing.

An editor sends the file it edits as the request's `prediction` and, mostly, in the messages as well.  For
every recorded reply (record_replies.py) whose prompt holds a fenced block (```...), the block as the prompt
has it (fences included, up to the end of the user's turn) is taken for the prediction, and the reply is
replayed (ngram_sim.replay: the real NgramDrafter and controller, each pass priced on a fixed curve) four ways:

- the prompt as recorded, without a prediction and with one;
- the block cut out of the prompt, without a prediction and with one: the file only in the prediction.

At T = 0 a replay with the block cut is a drafting figure, not a forecast of that prompt: the target would
answer another prompt otherwise.  Speedups are plain decoding's time over the replay's, per set and per
prompt, with the worst prompt's ratio to the same prompt without a prediction.

Run:
    .venv/bin/python benchmarks/prediction_sim.py benchmarks/workloads-code-edit-12/replies-qwen2.5-coder-1.5b.jsonl \\
        benchmarks/workloads-heldout/replies-qwen2.5-coder-1.5b.jsonl --curve benchmarks/results/avx512-output-rows-cost-1-34.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ngram_sim import curve_named, decoded, drafter_for, replay  # noqa: E402

from edgespec.controller import controller_for  # noqa: E402
from edgespec.costs import CostModel  # noqa: E402
from edgespec.ngram_pool import TokenIndex  # noqa: E402

FENCE = "```"


def fenced_block(prompt_ids: list[int], fence_id: int, turn_end_id: int) -> tuple[int, int] | None:
    """(start, end) of the prompt's first fence up to the end of the last turn in it: the file as sent."""
    if fence_id not in prompt_ids or turn_end_id not in prompt_ids:
        return None
    start = prompt_ids.index(fence_id)
    end = len(prompt_ids) - 1 - prompt_ids[::-1].index(turn_end_id)
    return (start, end) if start < end else None


def speedup(row: dict, prompt_ids: list[int], prediction: list[int] | None, cost: CostModel, max_tokens: int) -> float:
    drafter = drafter_for(row)
    if prediction is not None:
        drafter.use_sources(prediction=TokenIndex(prediction))
    controller = controller_for("ngram", cost, len(cost.forward_seconds) - 1)
    return replay(prompt_ids, decoded(row), cost, controller, drafter, max_tokens).speedup


def replay_set(rows: list[dict], cost: CostModel, max_tokens: int, fence_id: int, turn_end_id: int) -> dict:
    ways = ("none", "prediction", "cut, none", "cut, prediction")
    per_prompt = {}
    for row in rows:
        span = fenced_block(row["prompt_ids"], fence_id, turn_end_id)
        if span is None:
            continue
        prompt, (start, end) = row["prompt_ids"], span
        block, cut = prompt[start:end], prompt[:start] + prompt[end:]
        per_prompt[row["id"]] = dict(zip(ways, (
            speedup(row, prompt, None, cost, max_tokens), speedup(row, prompt, block, cost, max_tokens),
            speedup(row, cut, None, cost, max_tokens), speedup(row, cut, block, cost, max_tokens))))
    if not per_prompt:
        return {"prompts": 0}
    # a set's speedup: plain time over replay time, summed over its prompts (each reply's plain time weighs it)
    plain = {row["id"]: len(decoded(row)) for row in rows if row["id"] in per_prompt}
    summary = {way: sum(plain[i] for i in per_prompt) / sum(plain[i] / per_prompt[i][way] for i in per_prompt)
               for way in ways}
    worst = min(per_prompt[i]["prediction"] / per_prompt[i]["none"] for i in per_prompt)
    return {"prompts": len(per_prompt), "speedup": summary, "worst_prediction_over_none": worst, "per_prompt": per_prompt}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("replies", nargs="+", type=Path, help="record_replies.py JSONL files")
    parser.add_argument("--curve", default="bench", help="the pass curve: 'issue', 'bench' or a JSON's path (ngram_sim.py)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--fence-id", type=int, default=73594, help=f"the token {FENCE!r} (Qwen2.5's id by default)")
    parser.add_argument("--turn-end-id", type=int, default=151645, help="the token ending a turn (Qwen2.5's <|im_end|>)")
    parser.add_argument("--json", type=Path, help="write the figures here as well")
    args = parser.parse_args()
    cost = CostModel(curve_named(args.curve))
    figures = {}
    for path in args.replies:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        result = figures[str(path)] = replay_set(rows, cost, args.max_tokens, args.fence_id, args.turn_end_id)
        if not result["prompts"]:
            print(f"{path}: no prompt with a fenced block")
            continue
        print(f"{path} ({result['prompts']} prompts with a fenced block)")
        print("  " + "  ".join(f"{way} {value:.3f}" for way, value in result["speedup"].items()))
        print(f"  worst prompt, prediction / none: {result['worst_prediction_over_none']:.3f}")
        for prompt_id, ways in result["per_prompt"].items():
            print(f"    {prompt_id:16s} " + "  ".join(f"{value:.2f}" for value in ways.values()))
    if args.json:
        args.json.write_text(json.dumps({"curve": args.curve, "sets": figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
