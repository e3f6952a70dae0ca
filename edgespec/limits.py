"""The ranges of the engine settings that the CLI, config.toml and the chat app accept, and the
sizes the backend asks llama.cpp for (which the memory planner must know without loading llama.cpp).

Sampling values are checked by SamplingParams; these are the settings that
size the models' contexts and threads.  A value outside its range is refused
with one line naming the setting and the range, never passed on for llama.cpp
to change silently (it takes n_ctx 0 as the trained context) or to choke on.
"""

from __future__ import annotations

import os

from .errors import BadValueError

# llama.cpp rounds a context up to a multiple of 256 tokens (0 means the
# model's trained context), so 256 is the smallest it really makes.
MIN_N_CTX = 256
# llama.cpp keeps n_ctx in a uint32 and sizes the KV cache from it.
MAX_N_CTX = 2**31 - 1
# Layer counts go to llama.cpp as int32; -1 and anything above the model's
# layer count mean every layer.
MAX_GPU_LAYERS = 2**31 - 1
# The longest draft the adaptive controller may choose; on a 2-core CPU a pass
# over 33 tokens still costs only ~18 single steps, so copying long spans pays.
MAX_DRAFT_TOKENS = 32

# How much a draft's vocabulary may be longer or shorter than its target's: tokenizers of one family
# often pad their vocabulary to a round size.
MAX_VOCAB_SIZE_DIFFERENCE = 128

# Drafting modes by drafter name, best first; "none" is plain decoding.
MODES = ("combined", "draft-model", "heads", "ngram", "none")

# The most logits rows one decode may return.  llama.cpp sizes its output
# buffer and compute graph for n_outputs_max (n_batch by default: 512 rows x
# 152k vocab x 4 bytes = 311 MB for Qwen); we only ever verify k+1 rows.
MAX_OUTPUT_ROWS = 64

# Tokens per physical pass during prefill.  Without flash attention the
# attention scores of one layer take n_ubatch x n_ctx x n_head floats, so a
# smaller ubatch keeps long contexts affordable; verification passes (at most
# MAX_DRAFT_TOKENS + 1 wide) always fit in one.
N_UBATCH = 128

# The most sequences one context decodes together (batch/serve --parallel): past 16 rows a pass on
# a CPU costs about what 16 single steps would, and each sequence adds a whole KV cache.
MAX_PARALLEL = 16

# setting -> (lowest, highest, what the range means, when that needs saying)
RANGES: dict[str, tuple[int, int, str]] = {
    "n_ctx": (MIN_N_CTX, MAX_N_CTX, ""),
    "gpu_layers": (-1, MAX_GPU_LAYERS, " (-1: all layers)"),
    "draft_gpu_layers": (-1, MAX_GPU_LAYERS, " (-1: all layers)"),
    "draft_tokens": (0, MAX_DRAFT_TOKENS, ' or "auto"'),
    "parallel": (1, MAX_PARALLEL, ""),
}


# The KV cache types --kv-type and --draft-kv-type take, as llama.cpp (and gguf) name them.
KV_TYPES = ("f16", "q8_0", "q4_0")


class SettingError(BadValueError):
    """An engine setting outside the range it can take."""


def checked_kv_type(value) -> str:
    """value if it names a KV cache type; else SettingError listing the choices."""
    if value not in KV_TYPES:
        raise SettingError(f"KV cache type must be one of {', '.join(KV_TYPES)}, not {value!r}")
    return value


# --flash-attn: "auto" is on unless --bit-exact, as llama.cpp's own "auto" is on wherever the device runs it
# (every CPU). It was 3% faster at every pass width on a 2-core Xeon and level on a 2-core EPYC (two sessions:
# one-token steps 1% slower and 6% faster, wider passes 5% slower to 8% faster); with it a row's logits depend
# on the width of its pass, which only --bit-exact cannot take (docs/benchmarks.md, "What a pass costs here";
# the EPYC's in `git show 2740b8b:docs/benchmarks.md`, stop 64).  True and False read as "on" and "off".
FLASH_ATTN_CHOICES = ("auto", "on", "off")


def checked_flash_attn(value) -> str:
    """value as one of FLASH_ATTN_CHOICES (True and False as "on" and "off"); else SettingError."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in FLASH_ATTN_CHOICES:
        raise SettingError(f"flash attention must be one of {', '.join(FLASH_ATTN_CHOICES)}, not {value!r}")
    return value


def flash_attention_on(flash_attn, bit_exact: bool) -> bool:
    """Whether a load with these settings runs flash attention: "auto" runs it unless bit_exact.
    ("on" with bit_exact is refused where the settings are checked: exactness.kv_cache_notice.)"""
    choice = checked_flash_attn(flash_attn)
    return choice == "on" or (choice == "auto" and not bit_exact)


def kv_cache_types(kv_type: str, flash_attn: bool) -> tuple[str, str]:
    """The (K, V) cache types a --kv-type gives.

    llama.cpp quantises the V cache only with flash attention (flash_attn
    is whether it runs, as flash_attention_on says); without it only the
    keys are quantised.
    """
    kv_type = checked_kv_type(kv_type)
    return kv_type, (kv_type if flash_attn else "f16")


def kv_cache_label(type_k: str, type_v: str, flash_attn: bool) -> str:
    """What a KV cache setup changes in the logits and the speed: "" for f16 keys and values without flash
    attention, else e.g. "K q8_0, V f16, flash attention off"."""
    if (type_k, type_v, flash_attn) == ("f16", "f16", False):
        return ""
    return f"K {type_k}, V {type_v}, flash attention {'on' if flash_attn else 'off'}"


def checked_switch(name: str, value) -> bool:
    """value if it is True or False; else SettingError.  A library caller's raw="no" or bit_exact=1 read as
    True, the opposite of what "no" says."""
    if not isinstance(value, bool):
        raise SettingError(f"{name} must be True or False, not {value!r}")
    return value


def checked_setting(name: str, value) -> int | str:
    """value if it is in the range of setting `name` (draft_tokens may also be "auto"); else SettingError."""
    low, high, note = RANGES[name]
    if name == "draft_tokens" and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SettingError(f"{name} must be a whole number from {low} to {high}{note}, not {value!r}")
    return value


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask, not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def checked_threads(n_threads: int) -> int:
    """n_threads if this machine can run that many llama.cpp threads; else SettingError.

    llama.cpp's threads spin at a barrier after every operation, so threads
    beyond the cores wait for one another to be scheduled: a pass slows by
    orders of magnitude, and with --threads 1000 it never seems to end.
    """
    cores = usable_cores()
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= cores:
        raise SettingError(f"n_threads must be a whole number from 1 to {cores} (the CPU cores edgespec may use "
                           f"here), not {n_threads!r}")
    return n_threads
