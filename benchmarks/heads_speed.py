"""Heads against plain decoding and n-grams: speed, acceptance per head position, and what a GPU would gain.

Needs heads trained for the target (`edgespec heads train`, or --heads FILE).
At T=0, per suite, in 5 interleaved repeats (the configurations rotate, so a
drifting machine favours none), it runs:
- none: plain decoding, and plain-model: the same on a target loaded without heads (no hidden-state
  output), which measures what keeping the hidden states costs a step;
- ngram: n-gram drafting with the auto draft length;
- heads: heads alone, auto draft length (on a CPU the controller should find they do not pay);
- auto: n-grams and heads, picked per step (what `--draft auto` does with heads trained);
- heads-k: heads drafting every step at a fixed k (all heads): the acceptance per head position,
  the mean accepted length, and from those the speedup a flat, GPU-like cost curve
  (T(n) = T(1)) would give, with the heads' measured numpy cost at --gpu-step-ms per target step.
Every configuration's greedy tokens are checked against plain decoding's.

"chat" and "creative" have nothing to copy; "code-edit" is copy-heavy.

Run on an idle machine (Qwen2.5-Coder-1.5B with its trained heads):
  .venv/bin/python benchmarks/heads_speed.py --json benchmarks/results/heads_speed.json
Check the script quickly (tiny heads trained with `edgespec heads train --model smollm2-135m-instruct --minutes 1`):
  .venv/bin/python benchmarks/heads_speed.py --model smollm2-135m-instruct --suites chat --prompts 1 \
      --max-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edgespec import SamplingParams
from edgespec.commands.bench.workloads import load_workloads
from edgespec.engine import Done, Step
from edgespec.loading import load_engine

CONFIGS = ("none", "plain-model", "ngram", "heads", "auto", "heads-k")


def run_one(engine, config: str, prompt, max_tokens: int | None) -> dict:
    mode, draft_tokens = {"auto": ("combined", "auto"), "heads-k": ("heads", engine.max_draft_tokens),
                          "plain-model": ("none", "auto")}.get(config, (config, "auto"))
    engine.configure(mode=mode, draft_tokens=draft_tokens)
    engine.forget_cache()
    engine.forget_learning()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens or prompt.max_tokens)
    positions: list[list[int]] = []  # per draft position: [proposed, accepted]
    started, result = time.perf_counter(), None
    for event in engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params):
        if isinstance(event, Step) and event.drafted:
            positions += [[0, 0] for _ in range(event.drafted - len(positions))]
            for i in range(event.drafted):
                positions[i][0] += 1
                positions[i][1] += i < event.accepted
        elif isinstance(event, Done):
            result = event.result
    stats = result.stats
    drafting_steps = stats.steps - stats.k0_steps
    return {"config": config, "suite": prompt.suite, "id": prompt.id, "tokens": result.token_ids,
            "seconds": time.perf_counter() - started, "decode_tok_s": stats.decode_tokens_per_second,
            "proposed": stats.draft_tokens_proposed, "accepted": stats.draft_tokens_accepted,
            "drafting_steps": drafting_steps, "positions": positions,
            "accepted_by_drafter": stats.accepted_by_drafter}


def flat_curve_speedup(positions: list[list[int]], heads_share: float) -> tuple[int, float]:
    """The best k and its speedup over plain decoding when a pass of any width costs one plain step and each
    drafted token heads_share of one: E(k) / (1 + k * heads_share), E(k) = 1 + sum_j prod_{i<=j} a_i."""
    best, expected, reach = (0, 1.0), 1.0, 1.0
    for k, (proposed, accepted) in enumerate(positions, start=1):
        reach *= accepted / proposed if proposed else 0.0
        expected += reach
        best = max(best, (k, expected / (1 + k * heads_share)), key=lambda pair: pair[1])
    return best


def summarise(runs: list[dict], engine, gpu_step_ms: float) -> dict:
    plain = {(r["suite"], r["id"]): r["tokens"] for r in runs if r["config"] == "none"}
    summary = {}
    for suite in sorted({r["suite"] for r in runs}):
        row = {}
        for config in CONFIGS:
            mine = [r for r in runs if r["config"] == config and r["suite"] == suite]
            if not mine:
                continue
            positions = [[sum(r["positions"][i][j] for r in mine if len(r["positions"]) > i) for j in (0, 1)]
                         for i in range(max(len(r["positions"]) for r in mine))]
            steps = sum(r["drafting_steps"] for r in mine)
            row[config] = {
                "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in mine),
                "same_as_plain": all(r["tokens"] == plain[(r["suite"], r["id"])] for r in mine),
                "acceptance": sum(r["accepted"] for r in mine) / max(sum(r["proposed"] for r in mine), 1),
                "mean_accepted_per_drafting_step": sum(r["accepted"] for r in mine) / max(steps, 1),
                "acceptance_by_position": [round(a / p, 4) if p else None for p, a in positions]}
            if config == "heads-k":
                share = engine.cost.heads_seconds_per_token * 1000 / gpu_step_ms
                row[config]["flat_curve"] = dict(zip(("k", "speedup"), flat_curve_speedup(positions, share)))
                row[config]["flat_curve_free_heads"] = dict(zip(("k", "speedup"), flat_curve_speedup(positions, 0.0)))
        base = row["none"]["decode_tok_s_median"]
        for figures in row.values():
            figures["speedup_vs_plain"] = round(figures["decode_tok_s_median"] / base, 3)
        summary[suite] = row
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", type=Path, default=None, help="heads file (default: the model's own)")
    parser.add_argument("--suites", default="chat,creative,code-edit")
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts of each suite")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu-step-ms", type=float, default=8.0,
                        help="a target step on the GPU the flat-curve figure imagines (default: %(default)s ms)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    notice = lambda text: print(f"  {text}", file=sys.stderr)  # noqa: E731
    engine = load_engine(args.model, "heads", heads_path=args.heads, n_threads=args.threads, notice=notice)
    plain_engine = load_engine(args.model, "none", n_threads=args.threads, notice=notice)
    prompts = load_workloads(args.suites.split(","), args.prompts)
    runs = []
    try:
        for repeat in range(args.repeats):
            order = CONFIGS[repeat % len(CONFIGS):] + CONFIGS[:repeat % len(CONFIGS)]
            for config in order:
                print(f"repeat {repeat}: {config}", file=sys.stderr, flush=True)
                runner = plain_engine if config == "plain-model" else engine
                runs += [{"repeat": repeat, **run_one(runner, config, p, args.max_tokens)} for p in prompts]
        heads_ms = engine.cost.heads_seconds_per_token * 1000
        result = {"model": engine.target_path.name, "heads_ms_per_token": round(heads_ms, 3),
                  "cost_curve_relative": [round(x, 3) for x in engine.cost.relative()[:6]],
                  "summary": summarise(runs, engine, args.gpu_step_ms)}
    finally:
        engine.close()
        plain_engine.close()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
