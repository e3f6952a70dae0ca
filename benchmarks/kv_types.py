"""What a quantised KV cache costs and saves, per --kv-type, against f16.

For each KV setup (f16, q8_0, q4_0; with --flash-attn also each of them with
flash attention, which quantises the values too) it loads the target alone
and reports:
- the KV cache's size as llama.cpp allocates it (its log) and as `edgespec plan` counts it;
- prefill tok/s over a long (--context-tokens) chat prompt, and plain decoding's
  tok/s right after it (the cache then holds that long context);
- n-gram drafting on bench suites at T=0: acceptance, decode tok/s, and how many
  of the greedy tokens equal f16's (a quantised cache changes the logits).

Setups are rotated per repeat so a drifting machine does not favour one.
Each setup calibrates its own speed once (cached per KV setup).

Run (Qwen2.5-Coder-1.5B, the default target):
  .venv/bin/python benchmarks/kv_types.py --json benchmarks/results/kv_types.json
Check the script quickly:
  .venv/bin/python benchmarks/kv_types.py --model smollm2-135m-instruct --context-tokens 300 \
      --n-ctx 512 --decode-tokens 8 --prompts 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from edgespec import SamplingParams
from edgespec.commands.bench.workloads import load_workloads
from edgespec.engine import result_of
from edgespec.loading import load_engine

ROOT = Path(__file__).resolve().parent.parent
LONG_TEXT_FILES = ("edgespec/engine.py", "edgespec/session.py", "edgespec/drafters.py", "edgespec/planner.py")


def long_prompt_ids(engine, n_tokens: int) -> list[int]:
    """A chat prompt of about n_tokens: a request to explain edgespec's own source, cut to fit."""
    source = "\n\n".join((ROOT / name).read_text(encoding="utf-8") for name in LONG_TEXT_FILES)
    chars = n_tokens * 3
    for _ in range(6):  # characters per token vary; a few corrections land within a few tokens
        ids = engine.prompt_tokens("Explain what this code does, file by file.\n\n" + source[:chars])
        if abs(len(ids) - n_tokens) <= 8 or chars >= len(source):
            break
        chars = int(chars * n_tokens / len(ids))
    return ids


def run_setup(args, kv_type: str, flash_attn: bool, reference: dict | None) -> dict:
    engine = load_engine(args.model, "ngram", n_ctx=args.n_ctx, n_threads=args.threads, kv_type=kv_type,
                         flash_attn=flash_attn, notice=lambda text: print(f"  {text}", file=sys.stderr))
    try:
        figures = {"kv_type": kv_type, "flash_attn": flash_attn,
                   "kv_bytes_llama_cpp": engine.target.kv_buffer_bytes,
                   "kv_bytes_planned": engine.plan.parts[0].kv_bytes}
        figures.update(long_context(engine, args))
        figures.update(suites(engine, args, reference))
    finally:
        engine.close()
    return figures


def long_context(engine, args) -> dict:
    ids = long_prompt_ids(engine, args.context_tokens)
    engine.configure(mode="none")
    engine.forget_cache()
    stats = result_of(engine.stream_tokens(ids, SamplingParams(temperature=0.0, max_tokens=args.decode_tokens))).stats
    return {"context_tokens": len(ids), "prefill_tokens_per_second": (len(ids) - 1) / stats.prefill_seconds,
            "long_decode_tokens_per_second": stats.decode_tokens_per_second}


def suites(engine, args, reference: dict | None) -> dict:
    engine.configure(mode="ngram")
    proposed = accepted = same = compared = 0
    speeds, outputs = [], {}
    for prompt in load_workloads(args.suites.split(","), args.prompts):
        engine.forget_cache()
        engine.forget_learning()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens or prompt.max_tokens)
        result = result_of(engine.stream_tokens(engine.prompt_tokens(prompt.prompt), params))
        stats, outputs[prompt.id] = result.stats, result.token_ids
        proposed, accepted = proposed + stats.draft_tokens_proposed, accepted + stats.draft_tokens_accepted
        speeds.append(stats.decode_tokens_per_second)
        if reference is not None:
            theirs = reference["outputs"][prompt.id]
            compared += len(theirs)
            same += next((i for i, (a, b) in enumerate(zip(result.token_ids, theirs)) if a != b),
                         min(len(result.token_ids), len(theirs)))
    return {"acceptance": accepted / proposed if proposed else None,
            "ngram_decode_tokens_per_second": statistics.median(speeds),
            "tokens_as_f16": same / compared if compared else None, "outputs": outputs}


def print_table(rows: list[dict]) -> None:
    base = next((r for r in rows if r["kv_type"] == "f16" and not r["flash_attn"]), rows[0])
    print(f"{'KV setup':<16}{'KV MiB (llama.cpp / plan)':>27}{'saved':>8}{'prefill tok/s':>15}{'decode tok/s':>14}"
          f"{'ngram acc':>11}{'ngram tok/s':>13}{'same as f16':>13}")
    for r in rows:
        name = r["kv_type"] + (" +FA" if r["flash_attn"] else "")
        saved = 1 - r["kv_bytes_llama_cpp"] / base["kv_bytes_llama_cpp"]
        same = "-" if r["tokens_as_f16"] is None else f"{r['tokens_as_f16']:.0%}"
        accept = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"{name:<16}{r['kv_bytes_llama_cpp'] / 2**20:>15.1f} / {r['kv_bytes_planned'] / 2**20:<9.1f}"
              f"{saved:>8.0%}{r['prefill_tokens_per_second']:>15.1f}{r['long_decode_tokens_per_second']:>14.2f}"
              f"{accept:>11}{r['ngram_decode_tokens_per_second']:>13.2f}{same:>13}")
    print(f"(prefill and decode over a {base['context_tokens']}-token context; 'same as f16': greedy tokens "
          "before the first difference from the f16 run, of all f16 tokens)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0")
    parser.add_argument("--flash-attn", action="store_true", help="also run every KV type with flash attention")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--context-tokens", type=int, default=3000)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--suites", default="code-edit,summarize")
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts of each suite")
    parser.add_argument("--max-tokens", type=int, default=None, help="override every prompt's max_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setups = [(kv, False) for kv in args.kv_types.split(",")]
    setups += [(kv, True) for kv in args.kv_types.split(",")] if args.flash_attn else []
    runs = []
    for repeat in range(args.repeats):
        for kv_type, flash_attn in setups[repeat % len(setups):] + setups[:repeat % len(setups)]:
            print(f"repeat {repeat}: {kv_type}{' +FA' if flash_attn else ''}", file=sys.stderr, flush=True)
            reference = next((r for r in runs if r["kv_type"] == "f16" and not r["flash_attn"]), None)
            runs.append({"repeat": repeat, **run_setup(args, kv_type, flash_attn, reference)})
    rows = [median_row([r for r in runs if (r["kv_type"], r["flash_attn"]) == setup]) for setup in setups]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs}, indent=1) + "\n")
    return 0


def median_row(runs: list[dict]) -> dict:
    """One setup's figures: medians of the speeds over its repeats, the rest from its first run."""
    row = dict(runs[0])
    for name in ("prefill_tokens_per_second", "long_decode_tokens_per_second", "ngram_decode_tokens_per_second"):
        row[name] = statistics.median(r[name] for r in runs)
    return row


if __name__ == "__main__":
    sys.exit(main())
