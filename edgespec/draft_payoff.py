"""Whether a draft model can pay on this machine, judged from costs measured here.

`--draft auto` asks this three times, each before spending more: before fetching or reading a draft model
(could a draft of its size, at the least its token can cost, beat plain decoding on the target's measured
curve?), before loading one (does its share of a target step, remembered with the curve, leave room to
pay?), and after loading and timing it.  Each answer is a reason why not, or None.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .backend import RUNTIME, default_threads
from .catalog import load_catalog
from .calibration import CalibrationCache, CalibrationKey, draft_model_key
from .cost_profile import CostProfile, remembered_profile
from .costs import CostModel, best_speedup
from .limits import kv_cache_label, kv_cache_types
from .planner import Plan

# A draft model of the target's family is typically accepted this often (the Qwen2.5-Coder
# 0.5B/1.5B pair: 0.97 at T = 0 on code edits, less on prose).  `--draft auto` keeps a draft model
# only when, at that acceptance and at the costs measured on this machine, it would beat plain
# decoding by a clear margin; otherwise its passes would only slow the n-gram drafter down.
TYPICAL_DRAFT_ACCEPTANCE = 0.8
MIN_DRAFT_GAIN = 1.05


def why_it_cannot_pay(cost: CostModel, k_max: int, name: str) -> str | None:
    """Why a draft model at cost's draft_seconds_per_token would not pay here even at its typical acceptance
    (the best draft length up to k_max gains under MIN_DRAFT_GAIN over plain decoding), or None."""
    gain = best_speedup(cost, TYPICAL_DRAFT_ACCEPTANCE, k_max)[1]
    if gain >= MIN_DRAFT_GAIN:
        return None
    return (f"{name} would gain at most {gain:.2f}x over plain decoding here even at {TYPICAL_DRAFT_ACCEPTANCE:.0%} "
            f"acceptance (a draft token costs {draft_token_share(cost):.0%} of a target step, measured)")


# A draft token reads the draft's weights as a target step reads the target's, so on a CPU it costs at least
# about the draft's share of the two models' bytes: the 0.5B beside the 1.5B, 44% of the bytes, cost 45-69%
# of a target step on the CPUs measured.  Half that share is the floor used to rule a draft model out before
# it is fetched or read; a GPU's small kernels make no such promise, so there the floor is nothing.
CPU_SHARE_FLOOR_OF_BYTES = 0.5


def catalog_draft_share_floor(plan: Plan, target_path: Path, draft: Path | str) -> float:
    """The least a token of a catalog draft (its file, or its name when not on disk) can cost, as a share of a
    target step under plan, before it is timed: on a CPU plan CPU_SHARE_FLOOR_OF_BYTES of its share of the two
    models' bytes; on a GPU, or with its size unknown, 0."""
    draft_bytes = draft.stat().st_size if isinstance(draft, Path) else load_catalog().get(draft).size
    target_bytes = target_path.stat().st_size
    if plan.device != "cpu" or not draft_bytes or target_bytes <= 0:
        return 0.0
    return CPU_SHARE_FLOOR_OF_BYTES * draft_bytes / target_bytes


def why_it_cannot_pay_at_floor(cost: CostModel, k_max: int, name: str, floor: float = 0.0) -> str | None:
    """Why the draft model name would not pay on cost's target curve even at the typical acceptance and a
    token costing only floor of a target step (catalog_draft_share_floor); or None.  Decided from the target
    alone: where wide passes cost nearly as many one-token ones, as on a small CPU, the draft need not be
    fetched or read."""
    cheapest = dataclasses.replace(cost, draft_seconds_per_token=floor * cost.target(1))
    gain = best_speedup(cheapest, TYPICAL_DRAFT_ACCEPTANCE, k_max)[1]
    if gain >= MIN_DRAFT_GAIN:
        return None
    price = ("nothing" if floor == 0 else
             f"only {floor:.0%} of a target step, half its share of the two models' bytes")
    return (f"{name} would gain at most {gain:.2f}x over plain decoding here even at "
            f"{TYPICAL_DRAFT_ACCEPTANCE:.0%} acceptance and a token costing {price} (the target's passes, measured)")


def draft_token_share(cost: CostModel) -> float:
    """The draft model's time per token as a fraction of a one-token target pass."""
    return cost.draft_seconds_per_token / cost.target(1)


def why_known_not_to_pay(target_path: Path, draft_path: Path, plan: Plan, n_threads: int | None,
                         bit_exact: bool = False) -> str | None:
    """Why the plan's draft model cannot pay here, by the target's cached curve and the draft's share timed with
    it, both keyed as the loaded models will be (cost_profile.Calibrator), at the longest draft the loaded
    engine will verify; None when either is not cached, or when it may pay."""
    profile = cached_profile(target_path, draft_path, plan, n_threads)
    if profile is None:
        return None
    return why_it_cannot_pay(profile.cost, longest_draft(profile, bit_exact), draft_path.name)


def longest_draft(profile: CostProfile, bit_exact: bool) -> int:
    """The longest draft a step may verify on profile, as the engine loaded on it will (drafting.Planner's
    max_draft_tokens): under bit_exact, no wider than the passes that are bit-identical to one-token ones."""
    return (min(profile.exact_width, profile.widest) if bit_exact else profile.widest) - 1


def cached_profile(target_path: Path, draft_path: Path | None, plan: Plan, n_threads: int | None) -> CostProfile | None:
    """The target's cost profile as cached for the models the plan loads, with the draft's remembered share
    (cost_profile.remembered_profile; draft_path None: the curve alone); None when not cached."""
    threads = default_threads() if n_threads is None else n_threads
    target_key = CalibrationKey.for_model(target_path, plan.target_gpu_layers, threads, RUNTIME,
                                          kv_cache=_cache_label(plan.kv_type, plan.flash_attn))
    draft_key = None if draft_path is None else draft_model_key(
        draft_path, plan.draft_gpu_layers, _cache_label(plan.draft_kv_type, plan.flash_attn))
    return remembered_profile(CalibrationCache(), target_key, draft_key)


def _cache_label(kv_type: str, flash_attn: bool) -> str:
    """The KV cache label of a model loaded with these settings (backend.LlamaModel's kv_cache_label)."""
    return kv_cache_label(*kv_cache_types(kv_type, flash_attn), flash_attn)
