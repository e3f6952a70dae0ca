#!/usr/bin/env bash
# Plain decoding through edgespec's loop against llama.cpp's own llama-bench at the same depth and threads,
# interleaved: `edgespec run --draft none` at T=0 and T=0.8 (the default filters), `llama-bench -p 0 -n N -d D`,
# where D is the prompt's length in tokens.  The issue's rule: edgespec's T=0 median within 3% of llama-bench's.
#
#   benchmarks/plain_vs_llama_bench.sh                                    # Qwen2.5-Coder-1.5B, 2 threads
#   MODEL=smollm2-135m-instruct N=32 REPEATS=1 benchmarks/plain_vs_llama_bench.sh   # a quick check that it runs
#
# MODEL: a catalog name or a GGUF path; THREADS (default 2); N tokens (default 128); REPEATS (default 3).
# edgespec may stop before N tokens at the end of its reply; its tokens per second counts those it made.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(benchmarks/build_llama_cpp_peer.sh)
model=$(.venv/bin/edgespec models path "${MODEL:-qwen2.5-coder-1.5b-instruct}")
threads=${THREADS:-2}
n=${N:-128}
prompt=$(.venv/bin/python -c "import json; print(json.loads(open('benchmarks/workloads/code-edit.jsonl').readline())['prompt'])")
# the prompt as `edgespec run` sends it (chat template and all); a given cost curve: nothing is timed here
depth=$(.venv/bin/python -c "
import sys; from edgespec.loading import load_engine
e = load_engine(sys.argv[1], 'none', n_ctx=2048, n_threads=1, cost_curve=[1.0], notice=lambda m: None)
print(len(e.prompt_tokens(sys.argv[2]))); e.close()" "$model" "$prompt")
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for _ in $(seq "${REPEATS:-3}"); do
  "$bin/llama-bench" -m "$model" -p 0 -n "$n" -d "$depth" -t "$threads" -r 1 -o json 2>/dev/null |
    .venv/bin/python -c "import json,sys; r=json.load(sys.stdin)[0]; print('llama-bench', r['avg_ts'], r['n_gen'])" |
    tee -a "$results"
  for t in 0 0.8; do
    .venv/bin/edgespec run "$prompt" --draft none --temperature "$t" --max-tokens "$n" --n-ctx 2048 \
        --threads "$threads" --no-prompt-cache --json 2>/dev/null |
      .venv/bin/python -c "import json,sys; s=json.load(sys.stdin)['stats']; print('edgespec-T$t', s['decode_tokens_per_second'], s['tokens_generated'])" |
      tee -a "$results"
  done
done
echo "$(basename "$model"): depth $depth, $n tokens, $threads threads; medians:"
.venv/bin/python - "$results" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, tokens_per_second, _ = line.split()
    runs.setdefault(name, []).append(float(tokens_per_second))
reference = statistics.median(runs.pop("llama-bench"))
print(f"  {'llama-bench':14} {reference:8.2f} tok/s")
for name, speeds in runs.items():
    median = statistics.median(speeds)
    print(f"  {name:14} {median:8.2f} tok/s  {median / reference:.3f} of llama-bench")
EOF
