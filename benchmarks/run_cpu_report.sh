#!/usr/bin/env bash
# The runs behind an earlier docs/benchmarks.md (`git show 40d86cd:docs/benchmarks.md`): Qwen2.5-Coder-1.5B
# with and without its 0.5B draft, against llama.cpp's own speculation, in one process per command.  Run on
# an idle machine: ggml's threads spin, so any other busy process on 2 cores cuts the figures by 2-5x.
#
#   benchmarks/run_cpu_report.sh                          # every suite, one prompt each (~25 min)
#   SUITES=code-edit PROMPTS=3 MAX_TOKENS=128 CONFIGS=baseline,ngram-auto benchmarks/run_cpu_report.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(benchmarks/build_llama_cpp_peer.sh)
out=${OUT:-benchmarks/results/qwen-cpu-t0.json}
.venv/bin/edgespec bench --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct-q4_k_m \
  --suites "${SUITES:-code-edit,summarize,qa-context,chat,creative}" --prompts "${PROMPTS:-1}" --repeats 3 \
  --temperature 0 --max-tokens "${MAX_TOKENS:-96}" --llama-cpp-bin "$bin" \
  --configs "${CONFIGS:-baseline,ngram-auto,ngram-auto-exact,combined-auto,draft-model-auto,llamacpp-ngram-simple,llamacpp-ngram-mod}" \
  --json "$out"
