"""What this machine is, for the calibration cache key and the benchmark report."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what the platform module knows ("" when nothing)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                # x86 says "model name"; many ARM kernels say "Hardware" or "Processor".
                if name.strip() in ("model name", "Hardware", "Processor") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor()
