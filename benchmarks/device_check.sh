#!/usr/bin/env bash
# A CUDA check in one device call: build llama-cpp-python with the Makefile's flags on the device
# machine, write a synthetic pair (benchmarks/synthetic_pair.py), and run the cost curve and the bench
# on full offload.  One call, because the machine goes back 30 s after a call and a build is 3-5 minutes
# of the 15 a session gets; and synthetic models, because a call carries 64 MiB (Qwen2.5-Coder-1.5B is
# 1.1 GB, SmolLM2-135M 98 MB).
#
#   benchmarks/device_check.sh prepare     # here: .device-check/ with the pruned sdist and three wheels
#   device run, carry [".device-check"]:  bash benchmarks/device_check.sh check
#
# Stop 45 ran the build half as written (204 s on the H200's 16 cores) and the two edgespec commands
# with the same arguments from a later call (docs/benchmarks.md, "A GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
dir=.device-check

prepare() {
    grep -qxF "/$dir/" .git/info/exclude || echo "/$dir/" >> .git/info/exclude
    rm -rf "$dir" && mkdir -p "$dir/whl"
    work=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
    tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    # What the build does not read, so that the sources fit the call's 64 MiB (76 MB -> 4 MB).
    # vendor/miniaudio stays: vendor/CMakeLists.txt adds it.
    src="$work/llama_cpp_python-$version"
    rm -rf "$src/.git" "$src/docker" "$src/examples" "$src/vendor/llama.cpp/"{models,docs,tests,benches,media,gguf-py,conversion,examples,.github,.git} \
        "$src/vendor/llama.cpp/tools/"* "$src/vendor/llama.cpp/ggml/src/ggml-"{virtgpu,cann,openvino,webgpu,et,metal,hexagon,sycl,vulkan,opencl}
    tar czf "$dir/src.tar.gz" -C "$work" "llama_cpp_python-$version"
    rm -rf "$work"
    # the packages edgespec's core needs that the device image lacks
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d "$dir/whl" gguf==0.19.0 platformdirs==4.14.9 diskcache==5.6.3
    du -sh "$dir"
}

check() {
    export PYTHONUNBUFFERED=1 COLUMNS=140
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$dir"/whl/*.whl || exit 1
    (PYTHONPATH=/tmp/site python3 benchmarks/synthetic_pair.py /tmp/pair > "$OUT/pair.log" 2>&1) &
    mkdir -p /tmp/build && tar xzf "$dir/src.tar.gz" -C /tmp/build
    make -s print-cmake-args
    # The Makefile's flags, one architecture, and no flash-attention kernels (edgespec keeps it off):
    # the build takes 3-5 minutes instead of far more.
    llama_flags=$(make -s --eval="print-%: ; @echo '\$(\$*)'" print-LLAMA_CMAKE_ARGS)
    export CMAKE_ARGS="$llama_flags -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF"
    export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    start=$(date +%s)
    timeout 330 python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/wheel "/tmp/build/llama_cpp_python-$version" > "$OUT/build.log" 2>&1
    rc=$?; echo "build rc $rc in $(( $(date +%s) - start )) s"; [ $rc = 0 ] || { tail -20 "$OUT/build.log"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheel/*.whl || exit 1
    wait; cat "$OUT/pair.log"
    export PYTHONPATH=/tmp/site:$PWD
    # On that image, numpy imported before llama.cpp's libraries makes the model loader segfault (plain
    # llama-cpp-python too). The command line imported numpy first when this ran (it loads llama.cpp
    # first now): load llama_cpp first, as then.
    edgespec=(python3 -c "import llama_cpp, runpy, sys; sys.argv[0] = 'edgespec'; runpy.run_module('edgespec', run_name='__main__')")
    timeout 30 "${edgespec[@]}" bench --model /tmp/pair/target.gguf --cost-curve --json "$OUT/curve.json" > "$OUT/curve.txt" 2>&1
    echo "cost curve rc $?"; grep "│" "$OUT/curve.txt"
    timeout 60 "${edgespec[@]}" bench --model /tmp/pair/target.gguf --draft /tmp/pair/draft.gguf --suites code-edit \
        --configs baseline,ngram,ngram-k16,draft-model --repeats 2 --prompts 1 --temperature 0 --max-tokens 128 \
        --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
    echo "bench rc $? (1: a mode did not reproduce plain decoding)"; grep "^│" "$OUT/bench.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    check) check ;;
    *) echo "usage: $0 prepare|check" >&2; exit 2 ;;
esac
