"""Whether a draft model can pay on this machine, judged from costs measured here.

`--draft auto` asks this three times, each before spending more: before fetching a draft model (could any
draft, even one whose tokens cost nothing, beat plain decoding on the target's curve?), before loading one
(does this draft's share of a target step, remembered with the curve, leave room to pay?), and after
loading and timing it.  Each answer is a reason why not, or None.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .backend import RUNTIME, default_threads
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


def why_none_can_pay(cost: CostModel, k_max: int) -> str | None:
    """Why no draft model would pay on cost's target curve, even one whose tokens cost nothing, at the typical
    acceptance; or None.  Decided from the target alone: where wide passes cost nearly as many one-token ones,
    as on a small CPU, the draft model need not be fetched or read to know."""
    free = dataclasses.replace(cost, draft_seconds_per_token=0.0)
    gain = best_speedup(free, TYPICAL_DRAFT_ACCEPTANCE, k_max)[1]
    if gain >= MIN_DRAFT_GAIN:
        return None
    return (f"a draft model would gain at most {gain:.2f}x over plain decoding here even if its tokens cost "
            f"nothing, at {TYPICAL_DRAFT_ACCEPTANCE:.0%} acceptance (the target's passes, measured)")


def draft_token_share(cost: CostModel) -> float:
    """The draft model's time per token as a fraction of a one-token target pass."""
    return cost.draft_seconds_per_token / cost.target(1)


def why_known_not_to_pay(target_path: Path, draft_path: Path | None, plan: Plan,
                         n_threads: int | None) -> str | None:
    """Why a draft model cannot pay under plan, by the target's cached curve and (draft_path given) the draft's
    share timed with it, both keyed as the loaded models will be (cost_profile.Calibrator); with draft_path
    None, why no draft model could (why_none_can_pay).  None when what it needs is not cached, or when it may
    pay.  Judged at the curve's widest draft: under bit_exact a narrower one may still drop it once loaded."""
    profile = cached_profile(target_path, draft_path, plan, n_threads)
    if profile is None:
        return None
    if draft_path is None:
        return why_none_can_pay(profile.cost, profile.widest - 1)
    return why_it_cannot_pay(profile.cost, profile.widest - 1, draft_path.name)


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
