"""Memory sizes from the user, and the memory this machine has."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from edgespec.errors import flag_worded
from edgespec.memory import (
    CUDA_HEADROOM_BYTES,
    MemoryBudget,
    budget_override,
    detect_memory,
    parse_meminfo,
    parse_nvidia_smi,
    ram_budget,
)

MiB = 1024**2
GiB = 1024**3


def test_override_stands_for_gpu_memory_only_when_the_build_offloads():
    gpu = budget_override(6 * GiB, gpu_offload=True)
    assert gpu.kind == ("metal" if sys.platform == "darwin" else "cuda")
    assert gpu.available_bytes == gpu.total_bytes == 6 * GiB
    assert gpu.source == "memory_budget" and flag_worded(gpu.source) == "--memory-budget"
    assert budget_override(6 * GiB, gpu_offload=False).kind == "cpu"


# A real /proc/meminfo, shortened.
_MEMINFO = """\
MemTotal:       24683652 kB
MemFree:        21230844 kB
MemAvailable:   23852972 kB
Buffers:          108460 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def test_parse_meminfo():
    fields = parse_meminfo(_MEMINFO)
    assert fields["MemTotal"] == 24683652 * 1024
    assert fields["MemAvailable"] == 23852972 * 1024
    assert fields["HugePages_Total"] == 0


def test_parse_nvidia_smi_output_per_gpu():
    # `nvidia-smi --query-gpu=memory.free,memory.total --format=csv,noheader,nounits` on a two-GPU machine
    assert parse_nvidia_smi("7802, 8188\n23900, 24564\n") == [(7802 * MiB, 8188 * MiB), (23900 * MiB, 24564 * MiB)]
    with pytest.raises(ValueError):
        parse_nvidia_smi("[N/A], [N/A]\n")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux RAM detection")
def test_ram_budget_reads_memavailable_now():
    fields = parse_meminfo(Path("/proc/meminfo").read_text())
    budget = ram_budget()
    assert budget.kind == "cpu" and budget.total_bytes == fields["MemTotal"]
    assert 0 < budget.available_bytes <= budget.total_bytes
    # MemAvailable moves as other processes run; the two reads are moments apart
    assert abs(budget.available_bytes - fields["MemAvailable"]) < 0.1 * budget.total_bytes
    assert "MemAvailable" in budget.source


def test_without_offload_the_budget_is_ram():
    budget = detect_memory(gpu_offload=False)
    assert budget.kind == "cpu" and 0 < budget.available_bytes <= budget.total_bytes


@pytest.mark.skipif(sys.platform == "darwin", reason="Macs report Metal memory")
def test_gpu_build_uses_nvidia_memory_or_falls_back_to_ram_with_a_hint():
    budget = detect_memory(gpu_offload=True)
    assert isinstance(budget, MemoryBudget)
    if budget.kind == "cuda":
        # NVML or nvidia-smi answered: free VRAM, less the CUDA runtime's share
        assert budget.available_bytes <= budget.total_bytes - CUDA_HEADROOM_BYTES
        assert budget.source.startswith(("NVML", "nvidia-smi"))
    else:
        assert shutil.which("nvidia-smi") is None or "nvidia-smi" in budget.source
        assert budget.kind == "cpu" and "plan with memory_budget to use it" in budget.source
        assert "plan with --memory-budget to use it" in flag_worded(budget.source)


@pytest.mark.skipif(sys.platform != "darwin", reason="Metal budget on macOS only")
def test_metal_budget_is_most_of_unified_memory():
    budget = detect_memory(gpu_offload=True)
    assert budget.kind == "metal"
    assert 0.6 * budget.total_bytes < budget.available_bytes < 0.8 * budget.total_bytes
