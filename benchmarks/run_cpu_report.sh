#!/usr/bin/env bash
# The runs behind docs/benchmarks.md: Qwen2.5-Coder-1.5B with and without its 0.5B draft, against
# llama.cpp's own speculation, in one process per command.  Run on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(benchmarks/build_llama_cpp_peer.sh)
.venv/bin/edgespec bench --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct-q4_k_m \
  --suites "${SUITES:-code-edit}" --prompts 1 --repeats 3 --temperature 0 --max-tokens 96 \
  --llama-cpp-bin "$bin" \
  --configs "${CONFIGS:-baseline,ngram-auto,ngram-auto-exact,combined-auto,draft-model-k2,llamacpp-none,llamacpp-ngram-simple,llamacpp-draft}" \
  --json benchmarks/results/qwen-cpu-t0.json
