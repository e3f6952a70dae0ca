#!/usr/bin/env bash
# Plain decoding through edgespec's loop against llama.cpp's own llama-bench at the same depth and threads,
# interleaved: `edgespec run --draft none` at T=0 and T=0.8 (the default filters), `llama-bench -p 0 -n N -d D`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(benchmarks/build_llama_cpp_peer.sh)
model=$(.venv/bin/edgespec models path qwen2.5-coder-1.5b-instruct)
prompt=$(.venv/bin/python -c "import json; print(json.loads(open('benchmarks/workloads/code-edit.jsonl').readline())['prompt'])")
depth=$(.venv/bin/python -c "
import sys; from edgespec.loading import load_engine
e = load_engine(sys.argv[1], 'none', n_ctx=2048, notice=lambda m: None); print(len(e.prompt_tokens(sys.argv[2]))); e.close()" "$model" "$prompt")
n=${N:-128}
for repeat in 1 2 3; do
  "$bin/llama-bench" -m "$model" -p 0 -n "$n" -d "$depth" -t 2 -r 1 -o json 2>/dev/null |
    .venv/bin/python -c "import json,sys; r=json.load(sys.stdin)[0]; print('llama-bench', r['avg_ts'])"
  for t in 0 0.8; do
    .venv/bin/edgespec run "$prompt" --draft none --temperature "$t" --max-tokens "$n" --n-ctx 2048 --json 2>/dev/null |
      .venv/bin/python -c "import json,sys; s=json.load(sys.stdin)['stats']; print('edgespec-T$t', s['decode_tokens_per_second'], s['tokens_generated'])"
  done
done
echo "depth $depth, $n tokens, 2 threads"
