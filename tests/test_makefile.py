"""`make` picks llama.cpp's GPU backend by itself; `make print-cmake-args` shows the choice without building."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_VERSION = "0.3.36"
TOOLS = ("make", "uname", "md5sum", "cut", "grep", "sh", "echo")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# what the Makefile always passed for a CPU build: its md5 keys the wheelhouse
CPU_FLAGS = (f'-DGGML_LLAMAFILE=OFF "-DCMAKE_C_FLAGS={NO_AMX}" "-DCMAKE_CXX_FLAGS={NO_AMX}" '
             if platform.machine() in ("x86_64", "amd64") else "-DGGML_LLAMAFILE=OFF  ")

pytestmark = pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS) or platform.system() != "Linux",
                                reason="needs make and coreutils on Linux")


def fake_tool(folder: Path, name: str, output: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(0o755)
    return path


def print_cmake_args(tmp_path: Path, *fake_bins: Path, **env: str) -> dict:
    """Run the dry run with a PATH of the basic tools plus fake_bins, and no real CUDA toolkit in sight."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in TOOLS:
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    environ = {"PATH": os.pathsep.join([*map(str, fake_bins), str(tools)]), "HOME": str(tmp_path),
               "CUDA_HOME": str(tmp_path / "no-cuda"), **env}
    done = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO), "print-cmake-args"],
                          env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def wheelhouse_key(flags: str) -> str:
    """The Makefile's own formula, with the flags pasted into the shell line as make pastes them."""
    line = f'echo "{LLAMA_CPP_VERSION} {flags}" | md5sum | cut -c1-12'
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout.strip()


def test_a_cuda_toolkit_and_a_gpu_mean_a_cuda_build(tmp_path):
    nvcc = fake_tool(tmp_path / "cuda-bin", "nvcc")
    fake_tool(tmp_path / "driver-bin", "nvidia-smi", "GPU 0: NVIDIA H200 (UUID: GPU-0)\\n")
    out = print_cmake_args(tmp_path, tmp_path / "cuda-bin", tmp_path / "driver-bin")
    assert out["EDGESPEC_GPU"] == "cuda"
    assert out["CMAKE_ARGS"] == f"{CPU_FLAGS} -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER={nvcc}"
    assert out["WHEELHOUSE"].endswith(wheelhouse_key(out["CMAKE_ARGS"]))


def test_cuda_home_is_found_without_nvcc_on_path(tmp_path):
    nvcc = fake_tool(tmp_path / "toolkit" / "bin", "nvcc")
    fake_tool(tmp_path / "driver-bin", "nvidia-smi", "GPU 0: NVIDIA H200\\n")
    out = print_cmake_args(tmp_path, tmp_path / "driver-bin", CUDA_HOME=str(tmp_path / "toolkit"))
    assert out["CMAKE_ARGS"] == f"{CPU_FLAGS} -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER={nvcc}"


def test_a_cpu_build_keeps_its_flags_and_wheelhouse(tmp_path):
    fake_tool(tmp_path / "cuda-bin", "nvcc")
    fake_tool(tmp_path / "driver-bin", "nvidia-smi", "GPU 0: NVIDIA H200\\n")
    cases = {
        "no toolkit": print_cmake_args(tmp_path, tmp_path / "driver-bin"),
        "a toolkit but no GPU": print_cmake_args(tmp_path, tmp_path / "cuda-bin"),
        "forced": print_cmake_args(tmp_path, tmp_path / "cuda-bin", tmp_path / "driver-bin", EDGESPEC_GPU="cpu"),
    }
    for case, out in cases.items():
        assert (out["EDGESPEC_GPU"], out["CMAKE_ARGS"]) == ("cpu", CPU_FLAGS), case
        assert out["WHEELHOUSE"] == f"{tmp_path}/.cache/edgespec/wheels/{wheelhouse_key(CPU_FLAGS)}", case


def test_forcing_cuda_without_a_gpu_in_sight(tmp_path):
    nvcc = fake_tool(tmp_path / "cuda-bin", "nvcc")
    out = print_cmake_args(tmp_path, tmp_path / "cuda-bin", EDGESPEC_GPU="cuda")
    assert out["CMAKE_ARGS"] == f"{CPU_FLAGS} -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER={nvcc}"


@pytest.mark.parametrize(("choice", "message"), [
    ("cuda", "no nvcc was found"),
    ("metal", "needs macOS"),
    ("gpu", "must be cpu, cuda or metal"),
])
def test_an_impossible_choice_is_one_clear_line(tmp_path, choice, message):
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in TOOLS:
        (tools / tool).symlink_to(shutil.which(tool))
    done = subprocess.run(["make", "-s", "-C", str(REPO), "print-cmake-args"], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(tools), "HOME": str(tmp_path), "CUDA_HOME": str(tmp_path), "EDGESPEC_GPU": choice})
    assert done.returncode != 0
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
