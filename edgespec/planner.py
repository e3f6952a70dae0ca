"""Where each model goes, and which drafting mode fits in memory.

The plan estimates what llama.cpp will allocate for each model (weights, KV
cache, compute buffers, tokenizer) from the GGUF headers alone, then decides,
in this order:

1. offload the whole target to the GPU if it fits;
2. if it does not, offload as many target layers as fit, load no draft model
   and draft with n-grams, which cost no memory;
3. with the target fully offloaded, add the draft model if target + draft and
   both KV caches fit;
4. otherwise draft with n-grams, and say why.

Without GPU offload everything lives in RAM; the same checks then decide
whether the draft model fits next to the target in RAM.  Anything the user
forces is kept, with a warning when it exceeds the budget.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgespec.errors import Setting, Wording
from edgespec.gguf_info import GGUFInfo, read_gguf_info
from edgespec.limits import KV_TYPES, MAX_OUTPUT_ROWS, MODES, N_UBATCH, kv_cache_types
from edgespec.memory import MemoryBudget, budget_override, detect_memory
from edgespec.units import format_size, parse_size


# What edgespec.backend.LlamaModel asks llama.cpp for; the compute buffer scales with both.
DEFAULT_N_BATCH = N_UBATCH
DEFAULT_N_OUTPUTS = MAX_OUTPUT_ROWS

# llama.cpp keeps the tokenizer (token strings, merge table, lookup maps) and a
# copy of the GGUF header in RAM.  Loading with vocab_only grew the RSS by
# 16.8 MiB for SmolLM2 (49k tokens, 1.7 MiB header) and 46.9 MiB for Qwen2.5
# (152k tokens, 5.7 MiB header): about 300 bytes per token plus the header.
TOKENIZER_BYTES_PER_TOKEN = 300


@dataclass(frozen=True)
class ModelMemory:
    """One model's share of a plan.  The first four sizes count against the budget."""

    role: str  # "target" | "draft"
    model: str  # file name
    n_layer: int
    gpu_layers: int  # llama.cpp's n_gpu_layers: the last blocks; n_layer + 1 adds the output head
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    runtime_bytes: int  # tokenizer and header; in RAM, so counted only when the budget is RAM
    host_bytes: int  # what stays in RAM outside a GPU budget (CPU layers, tokenizer); 0 on CPU plans

    @property
    def budget_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.runtime_bytes

    def to_dict(self) -> dict:
        return {
            "role": self.role, "model": self.model, "n_layer": self.n_layer, "gpu_layers": self.gpu_layers,
            "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes, "runtime_bytes": self.runtime_bytes,
            "host_bytes": self.host_bytes, "total_bytes": self.budget_bytes,
        }


# What a plan's reason adds when heads trained for the target draft too (Plan.heads).
HEADS_TOO = "; the heads trained for this model draft too"


@dataclass(frozen=True)
class Plan:
    mode: str  # "draft-model" | "ngram" | "none"
    device: str  # "cuda" | "metal" | "cpu": where the counted bytes live
    target_gpu_layers: int  # pass to load_engine(n_gpu_layers=...)
    draft_gpu_layers: int  # pass to load_engine(draft_gpu_layers=...); 0 without a draft model
    parts: tuple[ModelMemory, ...]  # the target, then the draft model when the plan loads one
    total_bytes: int
    budget_bytes: int
    budget_source: str
    fits: bool
    reason: str  # one line: why this mode and these layer counts
    warnings: tuple[str, ...]
    n_ctx: int
    kv_type: str  # the target's --kv-type
    draft_kv_type: str = "f16"
    flash_attn: bool = False  # without it only the keys take the KV type (edgespec.limits.kv_cache_types)
    parallel: int = 1  # target sequences decoded together, each with a KV cache of n_ctx tokens
    # RAM the server's store of recent prompt snapshots may hold (edgespec.prefix_cache.MemoryPrefixCache);
    # counted in total_bytes when the budget is RAM
    prompt_cache_ram: int = 0
    heads: bool = False  # heads trained for the target draft too (`--draft auto` loads them beside the mode's drafter)

    def with_heads(self, heads: bool) -> Plan:
        """This plan with the heads trained for the target drafting too, or not, its reason saying which."""
        reason = self.reason.removesuffix(HEADS_TOO)
        return dataclasses.replace(self, heads=heads, reason=reason + HEADS_TOO if heads else reason)

    @property
    def drafting(self) -> str:
        """The drafters a load of this plan drafts with, as the plan shows them: its mode, and heads."""
        return f"{self.mode} + heads" if self.heads else self.mode

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "heads": self.heads, "device": self.device,
            "target_gpu_layers": self.target_gpu_layers, "draft_gpu_layers": self.draft_gpu_layers,
            "parts": [part.to_dict() for part in self.parts],
            "total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source, "fits": self.fits, "reason": self.reason,
            "warnings": list(self.warnings), "n_ctx": self.n_ctx, "kv_type": self.kv_type,
            "draft_kv_type": self.draft_kv_type, "flash_attn": self.flash_attn, "parallel": self.parallel,
            "prompt_cache_ram": self.prompt_cache_ram,
            "kv_cache_types": {part.role: self.cache_types(part.role) for part in self.parts},
        }

    def cache_types(self, role: str) -> str:
        """The K and V cache types of the target or the draft, e.g. "K q8_0, V f16"."""
        k, v = kv_cache_types(self.kv_type if role == "target" else self.draft_kv_type, self.flash_attn)
        return f"K {k}, V {v}"


def kv_bytes_per_layer(info: GGUFInfo, n_ctx: int, kv_type: str = "f16", flash_attn: bool = False) -> int:
    """Keys and values of one layer: n_ctx x n_head_kv x head_dim each, at the sizes of their types.

    Without flash attention llama.cpp keeps the values in f16 whatever kv_type says.
    """
    elements = n_ctx * info.n_head_kv * info.head_dim
    total = 0
    for cache_type in (_kv_quant_type(kv_type), _kv_quant_type(kv_cache_types(kv_type, flash_attn)[1])):
        block_size, type_size = GGML_QUANT_SIZES[cache_type]
        total += elements * type_size // block_size
    return total


def compute_bytes(info: GGUFInfo, n_ctx: int, n_batch: int = DEFAULT_N_BATCH,
                  n_outputs: int = DEFAULT_N_OUTPUTS) -> int:
    """Allowance for llama.cpp's compute buffer, which it sizes for the worst batch.

    All f32 activations except the f16 attention mask:
    - the logits rows: n_outputs x n_vocab;
    - one layer's attention scores, n_ubatch x n_ctx x n_head, counted as if
      flash attention were off (with it on, the scores do not exist and this
      overcounts).  They and the logits are never alive at once, so the
      allocator needs only the larger of the two;
    - one layer's activations for a whole ubatch: the FFN's gate and up
      projections (n_ff wide each) and two n_embd-wide tensors (the residual
      and the attention output), as ggml's allocator reuses memory across layers;
    - the attention mask, n_ubatch x n_ctx in f16.
    It bounds what llama.cpp 0.3.36 reported on CPU with n_ubatch 128 and 64
    output rows: SmolLM2-135M 12.4 / 21.6 / 41.6 MiB at n_ctx 512 / 4096 / 8192
    (formula 16.1 / 23.2 / 45.6), Qwen2.5-1.5B 38.6 / 38.6 / 56.0 MiB
    (formula 55.3 / 55.8 / 68.9).
    """
    n_ff = int(info.metadata.get(f"{info.architecture}.feed_forward_length", 4 * info.n_embd))
    logits = 4 * min(n_outputs, n_batch) * info.vocab_size
    scores = 4 * n_batch * n_ctx * info.n_head
    layer = 4 * n_batch * (2 * n_ff + 2 * info.n_embd)
    mask = 2 * n_batch * n_ctx
    # +10% for what the terms leave out: alignment and the small per-op tensors
    return (max(logits, scores) + layer + mask) * 11 // 10


def runtime_bytes(info: GGUFInfo) -> int:
    header_bytes = info.file_size - info.tensor_bytes
    return header_bytes + TOKENIZER_BYTES_PER_TOKEN * info.vocab_size


def model_memory(info: GGUFInfo, role: str, *, gpu_layers: int, on_gpu: bool, n_ctx: int,
                 kv_type: str = "f16", flash_attn: bool = False, n_batch: int = DEFAULT_N_BATCH,
                 n_outputs: int = DEFAULT_N_OUTPUTS, n_seq: int = 1) -> ModelMemory:
    """What one model needs, counted against a GPU budget (on_gpu) or against RAM; n_seq sequences
    decoded together (batch --parallel) each have a KV cache of n_ctx tokens.

    The compute buffer is counted as without flash attention, which holds the
    attention scores: with it the buffer is smaller, so this overcounts.
    """
    kv_layer = kv_bytes_per_layer(info, n_ctx, kv_type, flash_attn) * n_seq
    compute = compute_bytes(info, n_ctx, n_batch, n_outputs)
    runtime = runtime_bytes(info)
    name = os.path.basename(str(info.path))
    if not on_gpu:
        return ModelMemory(role, name, info.n_layer, 0, info.tensor_bytes, kv_layer * info.n_layer,
                           compute, runtime, 0)
    gpu_layers = max(0, min(gpu_layers, info.n_layer + 1))
    blocks = min(gpu_layers, info.n_layer)
    # llama.cpp offloads the last blocks first, and the output head only past n_layer.
    # The other tensors also hold the input embeddings, which llama.cpp keeps on
    # the CPU; GGUFInfo does not split them out, so this overcounts a little.
    weights = sum(info.layer_tensor_bytes[info.n_layer - blocks:]) if blocks else 0
    if gpu_layers > info.n_layer:
        weights += info.other_tensor_bytes
    host = (info.tensor_bytes - weights) + kv_layer * (info.n_layer - blocks) + runtime
    return ModelMemory(role, name, info.n_layer, gpu_layers, weights, kv_layer * blocks,
                       compute if gpu_layers else 0, 0, host)


def plan(target: GGUFInfo, draft: GGUFInfo | None, *, n_ctx: int, budget: MemoryBudget, gpu_offload: bool,
         kv_type: str = "f16", draft_kv_type: str | None = None, flash_attn: bool = False,
         force_gpu_layers: int | None = None, force_draft_gpu_layers: int | None = None,
         force_mode: str | None = None, n_batch: int = DEFAULT_N_BATCH, n_outputs: int = DEFAULT_N_OUTPUTS,
         parallel: int = 1, prompt_cache_ram: int = 0) -> Plan:
    """Pick GPU layers and the drafting mode for target (+ draft) within budget.

    force_* are the user's choices (--gpu-layers, --draft-gpu-layers, --draft ngram|none, or "draft-model"
    for an explicit draft file); -1 means all layers.  kv_type, draft_kv_type (default: kv_type) and
    flash_attn are the KV caches' flags; the target has `parallel` KV caches (batch --parallel).
    prompt_cache_ram, RAM a server asks for prompt snapshots, gets at most half what the models leave of a RAM budget.
    """
    draft_kv_type = kv_type if draft_kv_type is None else draft_kv_type
    _check_choices(force_mode, draft, kv_type, draft_kv_type)
    n_ctx = n_ctx if n_ctx > 0 else target.context_length
    on_gpu = gpu_offload and budget.kind != "cpu"
    available = budget.available_bytes
    size = _sizer(kv_type, draft_kv_type, parallel, on_gpu=on_gpu, n_ctx=n_ctx, flash_attn=flash_attn,
                  n_batch=n_batch, n_outputs=n_outputs)
    warnings = []
    if not on_gpu and (force_gpu_layers or force_draft_gpu_layers):
        warnings.append(Wording("no GPU offload here, so ", Setting("n_gpu_layers"), " and ",
                                Setting("draft_gpu_layers"), " are ignored"))

    full_target = size(target, "target", gpu_layers=target.n_layer + 1)
    if not on_gpu:
        target_part = full_target
    else:
        target_part = _gpu_target(size, target, force_gpu_layers, available)
    target_partial = on_gpu and force_gpu_layers is None and target_part.gpu_layers < full_target.gpu_layers
    placement = _placement(target_part, full_target, budget, on_gpu, gpu_offload)
    mode, draft_part, drafting = _choose_draft(
        size, draft, target_part, available, on_gpu=on_gpu, target_partial=target_partial,
        force_mode=force_mode, force_draft_gpu_layers=force_draft_gpu_layers,
    )

    parts = (target_part,) if draft_part is None else (target_part, draft_part)
    total = sum(part.budget_bytes for part in parts)
    fits = total <= available
    if not fits:
        forced_layers = on_gpu and (force_gpu_layers is not None or force_draft_gpu_layers is not None)
        warnings.append(_over_budget(force_mode == "draft-model" or forced_layers, total, budget, on_gpu))
    return _with_prompt_cache(Plan(
        mode=mode,
        device=budget.kind if on_gpu else "cpu",
        target_gpu_layers=target_part.gpu_layers,
        draft_gpu_layers=draft_part.gpu_layers if draft_part else 0,
        parts=parts,
        total_bytes=total,
        budget_bytes=available,
        budget_source=budget.source,
        fits=fits,
        reason=f"{placement}; {drafting}",
        warnings=tuple(warnings),
        n_ctx=n_ctx,
        kv_type=kv_type,
        draft_kv_type=draft_kv_type,
        flash_attn=flash_attn,
        parallel=parallel,
    ), prompt_cache_ram)


def plan_models(target_path, draft_path=None, *, n_ctx: int, gpu_offload: bool,
                memory_budget: str | int | None = None, **choices) -> Plan:
    """Read the GGUF headers, find the budget (--memory-budget or detected) and plan.

    choices are plan()'s keyword arguments (kv_type, draft_kv_type, flash_attn, force_*, n_batch, n_outputs).
    """
    target = read_gguf_info(target_path)
    draft = read_gguf_info(draft_path) if draft_path is not None else None
    if memory_budget is None:
        budget = detect_memory(gpu_offload=gpu_offload)
    else:
        size = memory_budget if isinstance(memory_budget, int) else parse_size(memory_budget)
        budget = budget_override(size, gpu_offload=gpu_offload)
    return plan(target, draft, n_ctx=n_ctx, budget=budget, gpu_offload=gpu_offload, **choices)


def _sizer(kv_type: str, draft_kv_type: str, parallel: int, **common):
    """model_memory for either role, with that role's KV cache type and count and the plan's other settings."""
    def size(info: GGUFInfo, role: str, *, gpu_layers: int) -> ModelMemory:
        target = role == "target"
        return model_memory(info, role, gpu_layers=gpu_layers, kv_type=kv_type if target else draft_kv_type,
                            n_seq=parallel if target else 1, **common)
    return size


def _largest_fit(size, info: GGUFInfo, role: str, room: int) -> ModelMemory:
    """The model with as many GPU layers as fit in room (none, if not even one does)."""
    for layers in range(info.n_layer + 1, 0, -1):
        part = size(info, role, gpu_layers=layers)
        if part.budget_bytes <= room:
            return part
    return size(info, role, gpu_layers=0)


def _check_choices(force_mode: str | None, draft: GGUFInfo | None, *kv_types: str) -> None:
    """ValueError for choices plan() cannot take: an unknown mode or KV type, a draft mode without a draft."""
    if force_mode is not None and force_mode not in MODES:
        raise ValueError(f"force_mode must be one of {MODES}, not {force_mode!r}")
    if force_mode == "draft-model" and draft is None:
        raise ValueError("force_mode='draft-model' needs a draft model")
    for kv_type in kv_types:
        _kv_quant_type(kv_type)


def _gpu_target(size, target: GGUFInfo, force_gpu_layers: int | None, available: int) -> ModelMemory:
    """The target's share with a GPU: the layers asked for, else as many as fit."""
    if force_gpu_layers is None:
        return _largest_fit(size, target, "target", available)
    return size(target, "target", gpu_layers=_requested_layers(force_gpu_layers, target))


def _with_prompt_cache(plan: Plan, asked: int) -> Plan:
    """plan with RAM for a server's prompt snapshots.  A cache: on a RAM budget it gets at most half of what
    the models leave, so it never pushes the machine into swap.  A GPU budget does not cover RAM: there the
    store gets what it asks for, counted apart."""
    if plan.device != "cpu":
        return dataclasses.replace(plan, prompt_cache_ram=asked)
    granted = min(asked, max(0, plan.budget_bytes - plan.total_bytes) // 2)
    warnings = plan.warnings
    if granted < asked:
        warnings += (f"prompt snapshots in RAM get {format_size(granted)}, not the {format_size(asked)} asked: "
                     "half of what the models leave of the budget" + (" (the disk prompt cache still works)"
                                                                      if granted == 0 else ""),)
    return dataclasses.replace(plan, prompt_cache_ram=granted, total_bytes=plan.total_bytes + granted,
                               warnings=warnings)


def _over_budget(forced: bool, total: int, budget: MemoryBudget, on_gpu: bool) -> str | Wording:
    """A budget memory_budget set is named so: the memory free may be far more."""
    # Automatic choices never add a draft that does not fit: an unforced plan misses through the target alone.
    needs = f"{'the forced plan' if forced else 'the target alone'} needs {format_size(total)}"
    available = budget.available_bytes
    if budget.given:
        return Wording(f"{needs}, over the {format_size(available)} budget of ", Setting("memory_budget"))
    return (f"{needs} but {format_size(available)} of {'GPU memory' if on_gpu else 'RAM'} is available; "
            "expect out-of-memory errors or swapping")


def _choose_draft(size, draft: GGUFInfo | None, target_part: ModelMemory, available: int, *, on_gpu: bool,
                  target_partial: bool, force_mode: str | None,
                  force_draft_gpu_layers: int | None) -> tuple[str, ModelMemory | None, str]:
    """(mode, the draft's share or None, why) once the target is placed."""
    as_asked = {"ngram": "n-gram drafting", "none": "no drafting", "heads": "drafting heads"}
    if force_mode in as_asked:  # heads hold a few MB of weights, and draft through the target's own pass
        return force_mode, None, f"{as_asked[force_mode]} as asked"
    if draft is None:
        return "ngram", None, "no draft model given, so n-gram drafting (it needs no memory)"
    if on_gpu and force_draft_gpu_layers is not None:
        draft_part = size(draft, "draft", gpu_layers=_requested_layers(force_draft_gpu_layers, draft))
        return "draft-model", draft_part, "the draft model as asked"
    if force_mode == "draft-model":
        room = available - target_part.budget_bytes
        draft_part = _largest_fit(size, draft, "draft", room) if on_gpu else size(draft, "draft", gpu_layers=0)
        return "draft-model", draft_part, "the draft model as asked"
    if target_partial:
        return "ngram", None, "no room for the draft model, so n-gram drafting"
    return _draft_if_it_fits(size(draft, "draft", gpu_layers=draft.n_layer + 1), target_part, available)


def _draft_if_it_fits(full_draft: ModelMemory, target_part: ModelMemory,
                      available: int) -> tuple[str, ModelMemory | None, str]:
    both = target_part.budget_bytes + full_draft.budget_bytes
    if both <= available:
        # The plan cannot know the speeds: a run measures them, and drops a draft model that does not pay there
        # (loading._settle_draft_model), which a plan saying only "draft-model" left a user to find out.
        return "draft-model", full_draft, (f"the draft model fits next to it ({format_size(both)} in all); a run "
                                           "keeps it only if its measured speed pays here, else drafts with n-grams")
    return "ngram", None, (
        f"target + draft need {format_size(both)}, more than {format_size(available)}, "
        "so n-gram drafting instead of the draft model"
    )


def _placement(target_part: ModelMemory, full_target: ModelMemory, budget: MemoryBudget,
               on_gpu: bool, gpu_offload: bool) -> str:
    if not on_gpu:
        why = "no GPU offload in this llama.cpp build" if not gpu_offload else "no GPU memory found"
        return f"CPU only ({why}): target needs {format_size(target_part.budget_bytes)} of RAM"
    if target_part.gpu_layers == full_target.gpu_layers:
        return f"whole target on the GPU ({format_size(target_part.budget_bytes)})"
    return (
        f"target needs {format_size(full_target.budget_bytes)} on the GPU, budget "
        f"{format_size(budget.available_bytes)}: {min(target_part.gpu_layers, target_part.n_layer)} "
        f"of {target_part.n_layer} layers offloaded"
    )


def _requested_layers(requested: int, info: GGUFInfo) -> int:
    """A user's layer count in llama.cpp terms: negative or too large means everything."""
    return info.n_layer + 1 if requested < 0 or requested > info.n_layer else requested


def _kv_quant_type(kv_type: str) -> GGMLQuantizationType:
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r}; use {', '.join(KV_TYPES)}")
    return GGMLQuantizationType[kv_type.upper()]
