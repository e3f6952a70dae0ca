"""Heads against plain decoding and n-grams: speed, what finding out costs, acceptance per head position.

What issue 28 asks to show on this CPU, at T=0, on the held-out prompts
(benchmarks/workloads-heldout): prompts with nothing to copy (explain, story,
chat) and copy-heavy ones (code-edit, extract).  In --repeats interleaved
repeats (the order of the configurations rotates, so a drifting machine
favours none) it times:
- plain: plain decoding on a target loaded without heads (what a user without heads gets);
- ngram: the n-gram default on that same target (`--draft auto` without heads);
- heads: `--draft heads` (auto draft length) on the target loaded with heads;
- auto: `--draft auto` with heads trained (n-grams and heads, picked per step).
Each configuration's speed is its paired ratio per repeat: its decode tok/s over plain's on the same
prompt in the same repeat (auto also over ngram's), listed beside their median.  Per reply it counts
the steps heads drafted and how many of those were probes (the controller's drafts for information,
where its estimate says k = 0), and the mean accepted length of heads' drafts.

Once, untimed against the others (at T=0 the tokens and acceptance do not change between repeats):
- heads-k: heads drafting every step at a fixed k (all heads) on the prompts with nothing to copy:
  acceptance per head position, mean accepted length per drafting step, and from those the speedup
  a flat, GPU-like cost curve (T(n) = T(1)) would give, with the heads' measured numpy cost at
  --gpu-step-ms per target step.
Every configuration's greedy tokens are checked against plain decoding's.

Run on an idle machine (Qwen2.5-Coder-1.5B with its trained heads; about 10 minutes on the 2-core EPYC:
the first prompt of each suite, 112 tokens per reply, 100 timed replies and 3 at a fixed k):
  .venv/bin/python benchmarks/heads_speed.py --heads /tmp/heads-new.npz --prompts 1 --max-tokens 112 \
      --json benchmarks/results/heads_speed.json
Check the script quickly (tiny heads trained with `edgespec heads train --model smollm2-135m-instruct --minutes 1`):
  .venv/bin/python benchmarks/heads_speed.py --model smollm2-135m-instruct --suites chat,extract --prompts 1 \\
      --max-tokens 16 --repeats 2
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
from edgespec.engine import Done
from edgespec.loading import load_engine

HELDOUT = Path(__file__).resolve().parent / "workloads-heldout"
NOTHING_TO_COPY = ("explain", "story", "chat")
COPY_HEAVY = ("code-edit", "extract")
TIMED = ("plain", "ngram", "heads", "auto")
# config -> (engine: "plain" or "heads", drafting mode); heads-k's draft length is the engine's widest
SETTINGS = {"plain": ("plain", "none"), "ngram": ("plain", "ngram"), "heads": ("heads", "heads"),
            "auto": ("heads", "combined"), "heads-k": ("heads", "heads")}


def run_one(engines: dict, config: str, prompt, max_tokens: int | None) -> dict:
    """One reply in one configuration, from cold caches and fresh controllers: its tokens, speed and counts."""
    which, mode = SETTINGS[config]
    engine = engines[which]
    engine.configure(mode=mode, draft_tokens=engine.max_draft_tokens if config == "heads-k" else "auto")
    engine.forget_cache()
    engine.forget_learning()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens or prompt.max_tokens)
    started, result = time.perf_counter(), None
    for event in engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params):
        if isinstance(event, Done):
            result = event.result
    stats = result.stats
    drafted, accepted = stats.drafted_by_position.get("heads", []), stats.accepted_by_position.get("heads", [])
    heads = engine.planner.own.controllers.get(("heads", None))  # the auto-length controller of this reply
    return {"config": config, "suite": prompt.suite, "id": prompt.id, "tokens": result.token_ids,
            "seconds": round(time.perf_counter() - started, 3), "decode_tok_s": stats.decode_tokens_per_second,
            "steps": stats.steps, "heads_drafts": drafted[0] if drafted else 0,
            "heads_probes": heads.probes if heads is not None else 0,
            "heads_accepted": stats.accepted_by_drafter.get("heads", 0),
            "heads_positions": [[n, accepted[i] if i < len(accepted) else 0] for i, n in enumerate(drafted)],
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


def paired(runs: list[dict], config: str, over: str) -> list[float]:
    """config's decode tok/s over `over`'s, per repeat and prompt (the same prompt in the same repeat)."""
    base = {(r["repeat"], r["id"]): r["decode_tok_s"] for r in runs if r["config"] == over}
    return [round(r["decode_tok_s"] / base[(r["repeat"], r["id"])], 3)
            for r in runs if r["config"] == config and base.get((r["repeat"], r["id"]))]


def summarise_suite(runs: list[dict], plain_tokens: dict) -> dict:
    """Per timed configuration: the median tok/s, the paired ratios and their median, and per reply its
    heads drafts, probes and mean accepted length."""
    row = {}
    for config in TIMED:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        figures = {"decode_tok_s_median": round(statistics.median(r["decode_tok_s"] for r in mine), 2),
                   "same_as_plain": all(r["tokens"] == plain_tokens[r["id"]] for r in mine)}
        if config != "plain":
            ratios = paired(runs, config, "plain")
            figures.update(vs_plain=ratios, vs_plain_median=round(statistics.median(ratios), 3))
        if config == "auto":
            ratios = paired(runs, "auto", "ngram")
            figures.update(vs_ngram=ratios, vs_ngram_median=round(statistics.median(ratios), 3))
        if config in ("heads", "auto"):
            figures["replies"] = [{"repeat": r["repeat"], "id": r["id"], "heads_drafts": r["heads_drafts"],
                                   "probes": r["heads_probes"], "steps": r["steps"],
                                   "mean_accepted": round(r["heads_accepted"] / r["heads_drafts"], 3)
                                   if r["heads_drafts"] else None} for r in mine]
        row[config] = figures
    return row


def summarise_fixed_k(runs: list[dict], heads_ms: float, gpu_step_ms: float) -> dict:
    """heads-k: acceptance per head position, mean accepted length, and the flat-curve speedup."""
    if not runs:
        return {}
    depth = max(len(r["heads_positions"]) for r in runs)
    positions = [[sum(r["heads_positions"][i][j] for r in runs if len(r["heads_positions"]) > i) for j in (0, 1)]
                 for i in range(depth)]
    drafts, accepted = sum(r["heads_drafts"] for r in runs), sum(r["heads_accepted"] for r in runs)
    return {"suites": sorted({r["suite"] for r in runs}), "drafting_steps": drafts,
            "acceptance_by_position": [round(a / d, 4) if d else None for d, a in positions],
            "mean_accepted_per_drafting_step": round(accepted / max(drafts, 1), 3),
            "decode_tok_s": [round(r["decode_tok_s"], 2) for r in runs],
            "flat_curve": dict(zip(("k", "speedup"), flat_curve_speedup(positions, heads_ms / gpu_step_ms))),
            "flat_curve_free_heads": dict(zip(("k", "speedup"), flat_curve_speedup(positions, 0.0)))}


def must_show(summary: dict) -> dict:
    """The issue's speed rules, from the paired medians: auto >= 0.98x plain on every kind of text,
    and >= the n-gram default on copy-heavy text; heads alone for reference."""
    return {
        "auto_vs_plain_lowest": min((row["auto"]["vs_plain_median"], suite) for suite, row in summary.items()),
        "heads_vs_plain_lowest": min((row["heads"]["vs_plain_median"], suite) for suite, row in summary.items()),
        "auto_vs_ngram_copy_heavy_lowest": min(((row["auto"]["vs_ngram_median"], suite) for suite, row in summary.items()
                                                if suite in COPY_HEAVY), default=None),
        "all_same_as_plain": all(figures["same_as_plain"] for row in summary.values() for figures in row.values()),
    }


def measure(engines: dict, prompts: list, args) -> list[dict]:
    """Every timed configuration on every prompt, in rotating order per repeat; then heads-k once."""
    runs = []
    for repeat in range(args.repeats):
        order = TIMED[repeat % len(TIMED):] + TIMED[:repeat % len(TIMED)]
        for config in order:
            print(f"repeat {repeat + 1}/{args.repeats}: {config}", file=sys.stderr, flush=True)
            runs += [{"repeat": repeat, **run_one(engines, config, p, args.max_tokens)} for p in prompts]
    if not args.no_fixed_k:
        print("heads at a fixed k (acceptance per head position)", file=sys.stderr, flush=True)
        runs += [{"repeat": 0, **run_one(engines, "heads-k", p, args.max_tokens)}
                 for p in prompts if p.suite in NOTHING_TO_COPY]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", type=Path, default=None, help="heads file (default: the model's own)")
    parser.add_argument("--suites", default=",".join(NOTHING_TO_COPY + COPY_HEAVY))
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts of each suite")
    parser.add_argument("--max-tokens", type=int, default=None, help="per reply (default: each prompt's own)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-fixed-k", action="store_true", help="skip heads at a fixed k")
    parser.add_argument("--gpu-step-ms", type=float, default=8.0,
                        help="a target step on the GPU the flat-curve figure imagines (default: %(default)s ms)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    notice = lambda text: print(f"  {text}", file=sys.stderr)  # noqa: E731
    prompts = load_workloads(args.suites.split(","), args.prompts, directory=HELDOUT)
    engines = {"heads": load_engine(args.model, "heads", heads_path=args.heads, n_threads=args.threads, notice=notice)}
    try:
        engines["plain"] = load_engine(args.model, "ngram", n_threads=args.threads, notice=notice)
        started = time.perf_counter()
        runs = measure(engines, prompts, args)
        heads_ms = engines["heads"].cost.heads_seconds_per_token * 1000
        curve = [round(x, 3) for x in engines["heads"].cost.relative()[:6]]
    finally:
        for engine in engines.values():
            engine.close()
    plain_tokens = {r["id"]: r["tokens"] for r in runs if r["config"] == "plain" and r["repeat"] == 0}
    summary = {suite: summarise_suite([r for r in runs if r["suite"] == suite], plain_tokens)
               for suite in dict.fromkeys(p.suite for p in prompts)}
    fixed_k = [r for r in runs if r["config"] == "heads-k"]
    result = {"model": engines["heads"].target_path.name, "heads_ms_per_token": round(heads_ms, 3),
              "cost_curve_relative": curve, "minutes": round((time.perf_counter() - started) / 60, 1),
              "must_show": must_show(summary), "summary": summary,
              "heads_fixed_k": {**summarise_fixed_k(fixed_k, heads_ms, args.gpu_step_ms),
                                "same_as_plain": all(r["tokens"] == plain_tokens[r["id"]] for r in fixed_k)}}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
