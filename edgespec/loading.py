"""Model names -> files -> a memory plan -> a loaded Engine.

The engine runs the decoding loop over models it is given; this module
decides which files those are (catalog lookup and download), whether the
draft model fits next to the target (the planner), and loads them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from .backend import LlamaModel, supports_gpu_offload
from .backend.hidden import HiddenStateModel
from .costs import CostModel
from .draft_choice import draft_to_consider, ngram_only_notice, ngram_only_plan, plan_without_the_draft, say_warnings
from .draft_payoff import (catalog_draft_share_floor, draft_token_share, why_it_cannot_pay, why_it_cannot_pay_at_floor,
                           why_known_not_to_pay)
from .drafters import check_vocab_compatible
from .learned import LearnedAcceptance
from .ngram_pool import NgramPool
from .engine import Engine
from .errors import BadValueError, EdgespecError, ModelFileError, Setting, Wording
from .heads.attach import heads_drafter, trained_heads
from .limits import MIN_N_CTX, checked_setting, checked_switch, flash_attention_on
from .exactness import exactness_notices
from .fetch import resolve_model
from .notices import log_notice
from .model_identity import loaded_model_identity
from .memory import MemoryDetectionError, ram_budget
from .planner import Plan, plan_models
from .prefix_files import DiskPrefixCache
from .units import format_size, parse_size


class LoadPlan(NamedTuple):
    """What load_engine will load: the model files and their memory plan.  deferred_draft is the catalog draft
    (its file, or its name when not on disk) that plan_load(measure_first=True) left out, neither fetched nor
    read, as this machine's costs were not measured yet: load_engine loads it once they say one can pay."""
    target_path: Path
    draft_path: Path | None
    plan: Plan
    deferred_draft: Path | str | None = None


def plan_load(
    target, draft="auto", *, n_ctx: int, n_gpu_layers=None, draft_gpu_layers=None,
    memory_budget=None, pull: bool = True, notice: Callable[[str], None] = log_notice, progress: bool = False,
    kv_type: str = "f16", draft_kv_type: str | None = None, flash_attn: bool | str = False, parallel: int = 1,
    prompt_cache_ram: int = 0, n_threads: int | None = None, bit_exact: bool = False, remembered_costs: bool = True,
    measure_first: bool = False,
) -> LoadPlan:
    """Resolve the model names to files and plan their memory: what load_engine will do.

    n_ctx 0 is the model's trained context.  A size out of range is refused here, before anything loads.
    pull=False never downloads: a missing target is an error, a missing draft means n-grams.
    A download is announced through notice; progress also shows a progress bar on stderr (the command line's).
    kv_type, draft_kv_type, flash_attn, n_threads and bit_exact are load_engine's; parallel counts a target KV cache
    per sequence decoded together (batch --parallel); prompt_cache_ram, the RAM a server asks for
    prompt snapshots (the plan grants what the models leave).  Under draft "auto" with remembered_costs, the
    costs this machine measured before decide first (draft_payoff.py): where the target's curve says no draft
    model could pay, the catalog's draft is neither fetched nor read, and one whose remembered share cannot
    pay is planned out, so it is not loaded only to be dropped.  measure_first: with no curve measured yet,
    the catalog's draft is left out too, to be judged once the target is measured (LoadPlan.deferred_draft).
    """
    _check_sizes(target, n_ctx=n_ctx or None, gpu_layers=n_gpu_layers, draft_gpu_layers=draft_gpu_layers,
                 parallel=parallel)
    _check_arguments(draft, notice, pull=pull, progress=progress)
    flash_attn = flash_attention_on(flash_attn, bit_exact)
    fetching = {"pull": pull, "notice": notice, "progress": progress}
    target_path = resolve_model(target, **fetching)
    planned = functools.partial(
        plan_models, target_path, n_ctx=n_ctx, gpu_offload=supports_gpu_offload(),
        memory_budget=memory_budget, force_gpu_layers=n_gpu_layers, force_draft_gpu_layers=draft_gpu_layers,
        kv_type=kv_type, draft_kv_type=draft_kv_type, flash_attn=flash_attn, parallel=parallel,
        prompt_cache_ram=prompt_cache_ram,
    )
    target_alone = planned(None, force_mode="ngram")
    _refuse_a_context_ram_cannot_hold(target_alone, target_path)
    if draft == "auto" and remembered_costs:
        draft_left_out = plan_without_the_draft(target_path, target_alone, n_threads=n_threads,
                                                bit_exact=bit_exact, measure_first=measure_first, pull=pull,
                                                notice=notice)
        if draft_left_out is not None:
            ngram_plan, deferred_draft = draft_left_out
            return LoadPlan(target_path, None, _with_trained_heads(ngram_plan, target_path, draft), deferred_draft)
    draft_path = draft_to_consider(target_path if draft == "auto" else target, draft, fetching)
    # A draft model (named or from the catalog) is only a candidate, forcing no mode: the plan drops it when it
    # does not fit.
    plan = planned(draft_path, force_mode=_FORCED_MODES.get(draft))
    why = None
    if draft == "auto" and plan.mode == "draft-model" and remembered_costs:
        why = why_known_not_to_pay(target_path, draft_path, plan, n_threads, bit_exact)
    if why is not None:
        plan = ngram_only_plan(planned(None, force_mode="ngram"), why, draft_path, notice)
    else:
        say_warnings(plan, notice)
    if draft_path is not None and plan.mode != "draft-model" and why is None:
        notice(f"not loading draft {draft_path.name}: {plan.reason}")
    return LoadPlan(target_path, draft_path, _with_trained_heads(plan, target_path, draft))


def _refuse_a_context_ram_cannot_hold(target_alone: Plan, target_path: Path) -> None:
    """A context whose KV cache outgrows this machine's RAM (n_ctx=10**9) would fail only inside llama.cpp, after a
    minute or more of allocating: refuse it before anything loads, naming the setting to lower."""
    if target_alone.device != "cpu":
        return  # the offloaded layers' caches live in GPU memory, whose allocator refuses at once
    try:
        ram = ram_budget().total_bytes
    except MemoryDetectionError:
        return  # nothing to compare with: the plan's own warning stands
    allocated = sum(part.kv_bytes + part.compute_bytes for part in target_alone.parts)
    if allocated <= ram:
        return
    if allocated * MIN_N_CTX // target_alone.n_ctx > ram:  # no context would fit: the header's sizes are the problem
        raise ModelFileError(f"model file {target_path} gives sizes whose KV cache outgrows this "
                             f"machine's {format_size(ram)} of RAM at any context; pick another file")
    sequences = Wording(" in each of ", Setting("parallel"), f"'s {target_alone.parallel} sequences") \
        if target_alone.parallel > 1 else ""
    raise BadValueError(f"a context of {target_alone.n_ctx:,} tokens", sequences,
                        f" needs {format_size(allocated)} for its KV cache and buffers, more than this machine's "
                        f"{format_size(ram)} of RAM: lower ", Setting("n_ctx"))


# The memory plan's mode for a draft setting that names no model.
_FORCED_MODES = {"heads": "heads", "ngram": "ngram", "none": "none", None: "none"}


def _with_trained_heads(plan: Plan, target_path: Path, draft) -> Plan:
    """plan, saying that the heads trained for the target draft too where `--draft auto` will load them."""
    if draft != "auto" or plan.mode == "none" or trained_heads(target_path) is None:
        return plan
    return plan.with_heads(True)


def load_engine(
    target: str | Path,
    draft: str | Path | None = "auto",
    *,
    n_ctx: int = 4096,
    n_gpu_layers: int | None = None,
    draft_gpu_layers: int | None = None,
    draft_tokens: int | str = "auto",
    n_threads: int | None = None,
    memory_budget: str | int | None = None,
    pull: bool = True,
    notice: Callable[[str], None] = log_notice,
    progress: bool = False,
    cost_curve: Sequence[float] | CostModel | None = None,
    measure_stale_curve: bool = True,
    bit_exact: bool = False,
    kv_type: str = "f16",
    draft_kv_type: str | None = None,
    flash_attn: bool | str = False,
    parallel: int = 1,
    prompt_cache_ram: int = 0,
    heads_path: str | Path | None = None,
) -> Engine:
    """Load a target and its drafter.

    target and draft take a GGUF path or a catalog name.  draft is "auto"
    (the catalog's draft for this target if it is present or can be
    fetched, fits in memory and can pay by this machine's measured costs,
    else n-grams), a model, "ngram", or "none"/None.  GPU layers left as None come from the memory plan.
    draft_tokens is a fixed k, or "auto" to choose k per step from the
    target's measured cost curve and the acceptance seen so far.
    cost_curve and measure_stale_curve are passed to Engine.calibrate().
    bit_exact verifies only in passes that llama.cpp computes bit-identically
    to one token at a time, so greedy output is plain decoding's token for
    token; by default passes are as wide as pays, exact in distribution.
    With a draft model loaded, each step picks n-grams, the draft model or no
    draft by expected speed (mode "combined").
    kv_type and draft_kv_type (default: kv_type) are the KV cache types of the
    target and the draft (f16, q8_0, q4_0); without flash attention only the keys
    take them (see exactness.kv_cache_notice).  flash_attn is "on" (True), "off"
    (False, the default) or "auto" (on unless bit_exact, as the commands load): "on" cannot go with
    bit_exact, and with flash attention on configure() cannot switch bit_exact on.
    parallel (target KV caches a Scheduler fills) and prompt_cache_ram (a server's snapshots) only plan memory.
    draft "heads" drafts with trained heads alone (heads_path, default: the model's own); "auto" adds them if trained.
    What loading decides or measures goes to notice (by default the "edgespec" logger); pull and progress: plan_load's.
    """
    exactness = exactness_notices(kv_type, draft_kv_type, flash_attn, bit_exact)  # refuses before loading
    planning = functools.partial(
        plan_load, target, draft, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, draft_gpu_layers=draft_gpu_layers,
        memory_budget=memory_budget, pull=pull, notice=notice, progress=progress, kv_type=kv_type,
        draft_kv_type=draft_kv_type, flash_attn=flash_attn, parallel=parallel, prompt_cache_ram=prompt_cache_ram,
        n_threads=n_threads, bit_exact=bit_exact, remembered_costs=cost_curve is None,
    )
    loading = functools.partial(_loaded_engine, draft=draft, n_ctx=n_ctx, n_threads=n_threads,
                                draft_tokens=draft_tokens, bit_exact=bit_exact, heads_path=heads_path,
                                calibration=(cost_curve, measure_stale_curve), notice=notice)
    return _measured_first(planning, loading, exactness, notice)


def _measured_first(planning, loading, exactness: list[str], notice) -> Engine:
    """The engine planning and loading give, where the catalog's draft model (hundreds of MB) is fetched and
    loaded on a first run only after the target's costs are measured, and only if they say a draft model can
    pay: on a small CPU none can.  exactness: the notices that follow the plan's."""
    planned = planning(measure_first=True)
    for line in exactness:
        notice(line)
    engine = loading(planned)
    if planned.deferred_draft is None:
        return engine
    target_path, _, plan, draft = planned
    why = why_it_cannot_pay_at_floor(engine.cost, engine.max_draft_tokens, Path(draft).name,
                                     catalog_draft_share_floor(plan, target_path, draft))
    if why is not None:
        notice(ngram_only_notice(why, draft))
        engine.drop_draft_model(f"n-grams only: {why}")  # not the plan's reason, that it would be judged later
        return engine
    engine.close()  # the plan again, with the draft model (fetched if need be) and the target's curve measured now
    return loading(planning())


def _loaded_engine(planned: LoadPlan, *, draft, n_ctx: int, n_threads, draft_tokens, bit_exact: bool, heads_path,
                   calibration: tuple, notice) -> Engine:
    """The planned models loaded into a calibrated Engine (calibration: Engine.calibrate's cost_curve and
    measure_stale_curve), its drafting settled."""
    target_path, draft_path, plan, _ = planned
    heads_path = heads_path or (trained_heads(target_path) if draft in ("heads", "auto") else None)
    target_model, draft_model = _load_models(target_path, draft_path, plan, n_ctx, n_threads, heads_path is not None)
    heads = _load_heads(target_model, heads_path, required=draft == "heads", notice=notice)
    if plan.heads and heads is None:  # unusable after all (said in a notice): the engine's reason must not claim them
        plan = plan.with_heads(False)
    mode = "heads" if draft == "heads" else "combined" if plan.mode == "draft-model" or heads is not None else plan.mode
    engine = Engine(target_model, draft_model, mode, draft_tokens, plan=plan, bit_exact=bit_exact, heads=heads)
    return _calibrated(engine, draft, draft_tokens, *calibration, notice)


def _calibrated(engine: Engine, draft, draft_tokens, cost_curve, measure_stale_curve: bool, notice) -> Engine:
    """The engine calibrated, its drafting settled; closed when that fails (a refused cost_curve, a Ctrl+C
    while measuring), as the caller never gets it to close."""
    try:
        engine.calibrate(cost_curve=cost_curve, notice=notice, measure_stale_curve=measure_stale_curve)
        _settle_drafting(engine, draft, draft_tokens, notice)
    except BaseException:
        engine.close()
        raise
    return engine


def _settle_drafting(engine: Engine, draft, draft_tokens, notice) -> None:
    """Say how the loaded engine drafts, where that is not what was asked, and drop a draft model that cannot pay."""
    if draft_tokens != "auto" and int(draft_tokens) > engine.max_draft_tokens:
        notice(Wording(f"drafting at most {engine.max_draft_tokens} tokens per step: ", _why_narrower(engine)))
    if engine.draft_model is not None:
        notice(_settle_draft_model(engine, keep=draft != "auto"))


def use_learning(engine: Engine, priors: str = "learn", pool: bool = True,
                 notice: Callable[[str], None] = log_notice) -> None:
    """Let the engine draw on what came before it.

    priors: "learn" starts the draft-length controllers from what this model's drafters were
    accepted at on this machine before, and adds every finished generation to it (learned.py);
    "read" only starts from it; "cold" keeps the neutral built-in priors.  pool: n-gram drafts may
    also come from this engine's earlier prompts and outputs (ngram_pool.py).  A learned-priors
    file that cannot be read is said through notice.
    """
    engine.planner.learned = (LearnedAcceptance(engine.target_path, writable=priors == "learn", notice=notice)
                              if priors != "cold" else None)
    engine.decoder.pool = NgramPool() if pool else None


def use_prompt_cache(engine: Engine, size: str | int | None = None, notice: Callable[[str], None] = log_notice,
                     keep_every_prompt: bool = False) -> None:
    """Keep KV snapshots of the engine's long prompts in the cache dir (at most size bytes, e.g. "2GiB";
    default: EDGESPEC_PROMPT_CACHE_SIZE, else 2 GiB), and restore the longest one a prompt starts with.
    A prompt's snapshot is kept once it came back (edgespec.prefix_files), or at once with keep_every_prompt."""
    max_bytes = parse_size(size) if isinstance(size, str) else size
    for model in (engine.target, engine.draft_model):
        if model is not None:
            loaded_model_identity(model)  # now: a file replaced while this process runs is not the model it holds
    engine.prefix_caches.append(DiskPrefixCache(max_bytes=max_bytes, notice=notice,
                                                keep_every_prompt=keep_every_prompt))


def _settle_draft_model(engine: Engine, keep: bool) -> str:
    """Keep the loaded draft model, or (under draft "auto") drop it when it cannot pay here; says which, and why."""
    why = why_it_cannot_pay(engine.cost, engine.max_draft_tokens, engine.draft_model.path.name)
    if why is None:
        return _draft_choice_notice(engine)
    path = engine.draft_model.path
    if keep:
        return Wording(f"drafting with n-grams and {path.name} as asked, though {why}; ", Setting("draft", "ngram"),
                       " may be faster")
    engine.drop_draft_model(f"n-grams only: {why}")
    return ngram_only_notice(why, path)


def _draft_choice_notice(engine: Engine) -> str:
    """One line on how the engine drafts with its draft model, from the measured costs."""
    name = engine.draft_model.path.name
    if engine.cost is None:
        return f"drafting with n-grams and {name}, chosen per step by expected speed"
    return (f"drafting with n-grams and {name}, chosen per step by expected speed "
            f"(a draft token costs {draft_token_share(engine.cost):.0%} of a target step here)")


def _why_narrower(engine: Engine) -> str:
    """Why the engine drafts fewer tokens per step than asked for."""
    if engine.bit_exact and engine.max_draft_tokens + 1 == engine.exact_width:
        return Wording("wider verification passes are not bit-identical to plain decoding with this model and "
                       "llama.cpp build (", Setting("bit_exact", True), ")")
    return f"the cost curve covers passes up to {engine.max_draft_tokens + 1} tokens"


def _load_heads(target, heads_path, required: bool, notice):
    """The heads drafter for target, or None: none trained, or (unless they were asked for) unusable."""
    if heads_path is None:
        if required:
            target.close()
            raise EdgespecError(f"no heads are trained for {target.path.name} (train them with "
                                f"`edgespec heads train --model {target.path}`, or use ", Setting("draft", "ngram"), ")")
        return None
    try:
        return heads_drafter(target, heads_path)
    except EdgespecError as error:
        if required:
            target.close()
            raise
        notice(Wording("not drafting with heads: ", *error.message))
        return None


def _check_sizes(target, **sizes) -> None:
    """Refuse, before anything loads, what the command line's flags refuse, for a library caller too (a string
    met a comparison's TypeError, a context of 10 tokens llama.cpp's own failure)."""
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"the model must be a catalog name or a GGUF path, not {type(target).__name__}")
    for name, value in sizes.items():
        if value is not None:
            checked_setting(name, value)


def _check_arguments(draft, notice, **switches) -> None:
    """TypeError or SettingError naming the parameter, before anything loads: draft=5 failed deep in pathlib,
    notice=5 at the first notice, and pull="no" was read as True."""
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise TypeError(f'draft must be "auto", "ngram", "heads", "none", None or a model (a catalog name or a GGUF '
                        f"path), not {type(draft).__name__}")
    if not callable(notice):
        raise TypeError(f"notice must be a function that takes the notice's text, not {type(notice).__name__}")
    for name, value in switches.items():
        checked_switch(name, value)


def _load_models(target_path: Path, draft_path: Path | None, plan: Plan, n_ctx: int,
                 n_threads, hidden_states: bool = False) -> tuple[LlamaModel, LlamaModel | None]:
    """The target and, when the plan loads one, the draft model, each with the plan's layers and KV cache;
    with hidden_states the target also outputs its hidden states, for heads."""
    target = (HiddenStateModel if hidden_states else LlamaModel)(
        target_path, n_ctx=n_ctx, n_gpu_layers=plan.target_gpu_layers, n_threads=n_threads, kv_type=plan.kv_type,
        flash_attn=plan.flash_attn)
    if plan.mode != "draft-model":
        return target, None
    return target, _load_draft(target, draft_path, n_ctx, plan, n_threads)


def _load_draft(target: LlamaModel, path: Path, n_ctx: int, plan: Plan, n_threads) -> LlamaModel:
    """Load the draft with the plan's layers and KV cache, and check it against the target; on failure free both."""
    draft = None
    try:
        draft = LlamaModel(path, n_ctx=n_ctx, n_gpu_layers=plan.draft_gpu_layers, n_threads=n_threads,
                           kv_type=plan.draft_kv_type, flash_attn=plan.flash_attn)
        check_vocab_compatible(target, draft)
    except EdgespecError:
        if draft is not None:
            draft.close()
        target.close()
        raise
    return draft
