"""How many of a local batch's requests to decode together in each forward pass."""

from __future__ import annotations

from ...limits import MAX_PARALLEL
from ...notices import print_notice
from ...scheduler import best_parallel
from .requests import BatchError


def parallel_for(engine, asked: int | None, pending: int) -> int:
    """How many requests to decode together: as asked (checked against memory), or the best the curve allows."""
    if engine.bit_exact:
        if asked is not None and asked > 1:
            print_notice(f"running one request at a time, not {asked}: rows in a shared pass are not bit-identical "
                         "to plain decoding (--bit-exact)")
        return 1
    fit = _sequences_that_fit(engine)
    if asked is not None and asked > fit:
        raise BatchError(f"--parallel {asked} needs a KV cache per request, and the memory budget has room for "
                         f"{fit}: use --parallel {fit} or less, or a smaller --n-ctx")
    limit = asked if asked is not None else max(1, min(MAX_PARALLEL, fit, pending))
    if limit > 1:
        engine.measure_sequences()  # once per model and machine, and before the batch's clock starts
    if asked is not None:
        return asked
    parallel = best_parallel(engine.cost, limit)
    if parallel > 1:
        print_notice(f"decoding {parallel} requests together (the most tokens per second on this machine's "
                     "cost curve; --parallel N to choose)")
    # requests decoded together keep their n-grams and heads; only a draft model's cache holds one sequence
    if parallel > 1 and engine.mode in ("draft-model", "combined") and engine.draft_path is not None:
        print_notice("each request drafts without the draft model, which drafts for one sequence at a time")
    return parallel


def _sequences_that_fit(engine) -> int:
    """How many sequences' KV caches the memory plan has room for (MAX_PARALLEL without a plan)."""
    plan = engine.plan
    if plan is None or not plan.parts or plan.parts[0].kv_bytes <= 0:
        return MAX_PARALLEL
    per_sequence = plan.parts[0].kv_bytes // plan.parallel
    room = plan.budget_bytes - plan.total_bytes
    return max(1, min(MAX_PARALLEL, plan.parallel + room // per_sequence))
