"""llama.cpp itself: started once at import, with its log captured and its build's features read."""

from __future__ import annotations

import ctypes
import re
import sys
from collections import deque
from typing import Callable

import llama_cpp

from ..limits import usable_cores

_recent_log_lines: deque[str] = deque(maxlen=20)
# llama.cpp's own count of the KV cache it allocated, one line per buffer (CPU, each GPU), since forget_log()
_kv_buffer_lines: list[str] = []
_KV_BUFFER_SIZE = re.compile(r"KV buffer size\s*=\s*([0-9.]+) MiB")
# llama.cpp's verdict on flash attention for a context that leaves it to llama.cpp, since forget_log()
_flash_attn_verdicts: list[bool] = []
_FLASH_ATTN_VERDICT = re.compile(r"Flash Attention (enabled|not supported)")


@llama_cpp.llama_log_callback
def _capture_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp talks a lot on stderr; keep its last lines to explain a failed load instead.
    line = text.decode("utf-8", errors="replace").strip()
    if line:
        _recent_log_lines.append(line)
        if _KV_BUFFER_SIZE.search(line):
            _kv_buffer_lines.append(line)
        verdict = _FLASH_ATTN_VERDICT.search(line)
        if verdict:
            _flash_attn_verdicts.append(verdict.group(1) == "enabled")


_kept_interrupts: list[KeyboardInterrupt] = []


def _keep_interrupt(unraisable, previous=sys.unraisablehook) -> None:
    """A Ctrl+C raised inside a callback from C, which ctypes would print as a traceback and drop: kept for
    raise_kept_interrupt.  While llama.cpp loads a model Python runs nothing but the log callback, so that is
    where a Ctrl+C lands."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and "ctypes callback" in (unraisable.err_msg or ""):
        _kept_interrupts.append(unraisable.exc_value)
    else:
        previous(unraisable)


def raise_kept_interrupt(allocated=None, free: Callable | None = None) -> None:
    """Raise the Ctrl+C a callback could not, now that llama.cpp has returned; what the call allocated (a
    handle, or NULL) is freed with free first."""
    if _kept_interrupts:
        _kept_interrupts.clear()
        if allocated:
            free(allocated)
        raise KeyboardInterrupt


sys.unraisablehook = _keep_interrupt
llama_cpp.llama_log_set(_capture_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()
_SYSTEM_INFO: bytes = llama_cpp.llama_print_system_info()
EXTRA_BUFFER_TYPES_SAFE = b"AMX_INT8 = 1" not in _SYSTEM_INFO


# What a calibrated cost curve depends on besides the model and the machine.
RUNTIME = f"llama-cpp-python {llama_cpp.__version__}"


def width_independent_kernels() -> bool:
    """False when llama.cpp was built with llamafile's tinyBLAS kernels.

    Those take over matrix products of two or more tokens but not of one, and
    round differently, so a token's logits would depend on how many tokens
    share its forward pass.  `make` builds llama-cpp-python with
    -DGGML_LLAMAFILE=OFF for that reason.
    """
    return b"LLAMAFILE = 1" not in _SYSTEM_INFO


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def default_threads() -> int:
    return min(usable_cores(), 8)


def forget_log() -> None:
    """Start a fresh log, so last_error() explains the next failure and not an older one."""
    _recent_log_lines.clear()
    _kv_buffer_lines.clear()
    _flash_attn_verdicts.clear()
    # A Ctrl+C kept from a callback during some other call (a decode, which nothing checks afterwards) was
    # answered or is stale: only one pressed during the load that follows may stop it.
    _kept_interrupts.clear()


def logged_kv_buffer_bytes() -> int | None:
    """The KV cache llama.cpp reported allocating since forget_log(), summed over its buffers
    (to 0.01 MiB, as it logs them); None when it reported none."""
    sizes = [float(_KV_BUFFER_SIZE.search(line).group(1)) for line in _kv_buffer_lines]
    return round(sum(sizes) * 1024 * 1024) if sizes else None


def logged_flash_attention() -> bool:
    """Whether llama.cpp turned flash attention on for the contexts made since forget_log() that left it
    to llama.cpp: on where the device running the layers runs the op, off (with a warning) elsewhere."""
    return bool(_flash_attn_verdicts) and all(_flash_attn_verdicts)


def last_error() -> str:
    """The line of llama.cpp's recent log that best explains a failure."""
    for line in reversed(_recent_log_lines):
        if "error" in line.lower() or "failed" in line.lower():
            return line
    return _recent_log_lines[-1] if _recent_log_lines else "no details from llama.cpp"
