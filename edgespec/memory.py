"""How much memory the models may use: detected, or given with --memory-budget.

Detection looks where llama.cpp will put the weights.  With a GPU build that
is the GPU (NVIDIA through NVML or nvidia-smi, Apple through the unified
memory size); without one, or when no GPU memory can be read, it is the RAM
that can be allocated without swapping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from edgespec.errors import EdgespecError, Setting, Wording
from edgespec.units import GiB, MiB, format_size

# NVML reports free VRAM before this process has a CUDA context; the context,
# cuBLAS workspaces and the CUDA kernels then take several hundred MiB.
# llama.cpp's own `--fit` keeps the same 1 GiB per device free by default.
CUDA_HEADROOM_BYTES = 1 * GiB

# Metal's limit is MTLDevice.recommendedMaxWorkingSetSize, which Python can
# only read through PyObjC's Metal bindings.  Apple sets it to about 2/3 of
# unified memory on small Macs and 3/4 on large ones; 70% sits between.
METAL_SHARE_OF_UNIFIED_MEMORY = 0.70


# How to give the budget by hand, where it cannot be read.
_BUDGET_EXAMPLE = (Setting("memory_budget"), ", e.g. ", Setting("memory_budget", "6GiB"))


class MemoryDetectionError(EdgespecError):
    """Neither the GPU nor the RAM could be measured."""


@dataclass(frozen=True)
class MemoryBudget:
    kind: str  # "cuda" | "metal" | "cpu": where the offloaded model parts live
    total_bytes: int
    available_bytes: int  # what a plan may use
    source: str  # how the numbers were found, for the plan's table (a Wording where it names a setting)
    given: bool = False  # set by memory_budget, not found free: the memory there may be far more


def budget_override(size_bytes: int, *, gpu_offload: bool) -> MemoryBudget:
    """The budget given as memory_budget: it stands for GPU memory when the build can offload, else RAM."""
    kind = ("metal" if sys.platform == "darwin" else "cuda") if gpu_offload else "cpu"
    return MemoryBudget(kind, size_bytes, size_bytes, Wording(Setting("memory_budget")), given=True)


def detect_memory(*, gpu_offload: bool = True) -> MemoryBudget:
    """Memory for the models: the GPU's when this llama.cpp build can offload to it, else RAM."""
    if not gpu_offload:
        return ram_budget()
    if sys.platform == "darwin":
        return _metal_budget()
    budget = _nvml_budget() or _nvidia_smi_budget()
    if budget is not None:
        return budget
    ram = ram_budget()
    return MemoryBudget(
        "cpu", ram.total_bytes, ram.available_bytes,
        Wording(f"{ram.source}; this build can offload to a GPU but neither NVML nor nvidia-smi "
                "answered, so plan with ", Setting("memory_budget"), " to use it"),
    )


def ram_budget() -> MemoryBudget:
    meminfo = _read_text("/proc/meminfo")
    if meminfo is not None:
        fields = parse_meminfo(meminfo)
        if "MemAvailable" in fields and "MemTotal" in fields:
            return MemoryBudget("cpu", fields["MemTotal"], fields["MemAvailable"], "RAM: MemAvailable in /proc/meminfo")
    total, available = _sysconf_memory()
    if total is not None and available is not None:
        return MemoryBudget("cpu", total, available, "RAM: free pages from sysconf")
    windows = _windows_memory()
    if windows is not None:
        return MemoryBudget("cpu", windows[0], windows[1], "RAM: GlobalMemoryStatusEx")
    if total is not None:
        # macOS has no count of available pages in sysconf; its file cache and
        # compressor free memory on demand, so most of RAM is usable.
        return MemoryBudget("cpu", total, int(total * METAL_SHARE_OF_UNIFIED_MEMORY),
                            f"RAM: {METAL_SHARE_OF_UNIFIED_MEMORY:.0%} of physical memory from sysconf")
    raise MemoryDetectionError("could not read how much memory is free; pass ", *_BUDGET_EXAMPLE)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by field name."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            unit = parts[1].lower() if len(parts) > 1 else ""
            fields[name.strip()] = int(parts[0]) * (1024 if unit == "kb" else 1)
    return fields


def parse_nvidia_smi(text: str) -> list[tuple[int, int]]:
    """(free, total) bytes per GPU from `nvidia-smi --query-gpu=memory.free,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        free, total = (int(value.strip()) * MiB for value in line.split(","))
        gpus.append((free, total))
    return gpus


def _gpu_budget(gpus: list[tuple[int, int]], tool: str) -> MemoryBudget | None:
    """Free VRAM summed over the GPUs (llama.cpp splits layers over all of them by free memory)."""
    if not gpus:
        return None
    free = sum(f for f, _ in gpus)
    total = sum(t for _, t in gpus)
    headroom = CUDA_HEADROOM_BYTES * len(gpus)
    count = f"{len(gpus)} GPUs" if len(gpus) > 1 else "GPU"
    return MemoryBudget(
        "cuda", total, max(0, free - headroom),
        f"{tool}: {format_size(free)} free on the {count}, less {format_size(headroom)} kept for the CUDA runtime",
    )


def _nvml_budget() -> MemoryBudget | None:
    try:
        import pynvml  # from nvidia-ml-py; absent or driverless machines fall through to nvidia-smi
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            gpus.append((int(info.free), int(info.total)))
        return _gpu_budget(gpus, "NVML")
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_budget() -> MemoryBudget | None:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        completed = subprocess.run(
            [executable, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return _gpu_budget(parse_nvidia_smi(completed.stdout), "nvidia-smi")
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _metal_budget() -> MemoryBudget:
    total, _ = _sysconf_memory()
    if total is None:
        raise MemoryDetectionError("could not read the Mac's memory size; pass ", *_BUDGET_EXAMPLE)
    return MemoryBudget(
        "metal", total, int(total * METAL_SHARE_OF_UNIFIED_MEMORY),
        f"Metal: {METAL_SHARE_OF_UNIFIED_MEMORY:.0%} of {format_size(total)} unified memory "
        "(about Metal's recommended working set)",
    )


def _sysconf_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes from sysconf; either is None where the platform lacks it."""
    def pages(name: str) -> int | None:
        try:
            value = os.sysconf(name)
        except (AttributeError, ValueError, OSError):
            return None
        return value if value > 0 else None

    page_size = pages("SC_PAGE_SIZE")
    if page_size is None:
        return None, None
    total, available = pages("SC_PHYS_PAGES"), pages("SC_AVPHYS_PAGES")
    return (total * page_size if total else None), (available * page_size if available else None)


def _windows_memory() -> tuple[int, int] | None:
    """(total, available) bytes from GlobalMemoryStatusEx, the Windows counterpart of MemAvailable."""
    if sys.platform != "win32":
        return None
    import ctypes

    class MemoryStatus(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = MemoryStatus()
    status.dwLength = ctypes.sizeof(MemoryStatus)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return None
    return int(status.ullTotalPhys), int(status.ullAvailPhys)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None
