#!/usr/bin/env bash
# `edgespec batch --parallel N` on benchmarks/batch-30.jsonl (30 requests, T = 0, up to 128 tokens
# each): wall time and generated tokens per second for N = 1, 2, 4, 8 and the default, each with
# --draft none and ngram, one process per run.  Run on an idle machine: ggml's threads spin, so
# any other busy process on 2 cores cuts the figures by 2-5x.  --no-prompt-cache: no run restores
# the prompts an earlier run saved.
#
#   benchmarks/batch_parallel.sh                  # every run (~25 min on a 2-core CPU)
#   PARALLEL="1 4" DRAFTS=ngram benchmarks/batch_parallel.sh
#   INPUT=benchmarks/batch-heldout.jsonl OUT=benchmarks/results/batch-heldout benchmarks/batch_parallel.sh
#                                                 # 12 short code requests no setting was tuned on
set -euo pipefail
cd "$(dirname "$0")/.."
results=${OUT:-benchmarks/results/batch-parallel}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$results"
for n in ${PARALLEL:-1 2 4 8 default}; do
  for draft in ${DRAFTS:-none ngram}; do
    flag=(--parallel "$n"); [ "$n" = default ] && flag=()
    .venv/bin/edgespec batch "${INPUT:-benchmarks/batch-30.jsonl}" -o "$work/$draft-$n.jsonl" --model "${MODEL:-qwen2.5-coder-1.5b-instruct}" \
      --draft "$draft" "${flag[@]}" --no-prompt-cache --summary "$results/$draft-p$n.json" 2>"$work/$draft-$n.err" || true
    grep -ho "decoding [0-9]* requests together" "$work/$draft-$n.err" | head -1 || true
    tail -1 "$work/$draft-$n.err"
    cp "$work/$draft-$n.jsonl" "$results/$draft-p$n.records.jsonl"
  done
done
.venv/bin/python - "$results" <<'PY'
import json, sys
from pathlib import Path
rows = {}
for path in sorted(Path(sys.argv[1]).glob("*-p*.json")):
    draft, n = path.stem.split("-p")
    rows[(draft, n)] = json.loads(path.read_text())
base = rows.get(("none", "1"), {}).get("throughput_tokens_per_second")
print("| --parallel | --draft | wall s | generated | throughput tok/s | x sequential plain | acceptance |")
print("|---|---|---|---|---|---|---|")
for (draft, n), s in sorted(rows.items(), key=lambda kv: (kv[0][1] == "default", kv[0][1].zfill(3), kv[0][0])):
    tput = s["throughput_tokens_per_second"]
    ratio = f"{tput / base:.2f}" if base and tput else "n/a"
    acc = f"{s['mean_acceptance_rate']:.0%}" if s["mean_acceptance_rate"] is not None else "-"
    print(f"| {n} | {draft} | {s['wall_seconds']:.0f} | {s['completion_tokens']} | {tput} | {ratio} | {acc} |")
PY
