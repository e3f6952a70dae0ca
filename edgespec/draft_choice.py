"""Which draft model a load plans with, before any model is loaded.

`--draft auto` considers the drafts the catalog pairs with the target, the one
on disk first, else fetched; a draft named by its path or name is taken as it
is.  Where this machine's remembered costs say that no draft model could pay
(draft_payoff.py), even at the least its token can cost, the catalog's draft is
neither fetched nor read, and the plan's reason says why.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from .catalog import load_catalog, local_path
from .draft_payoff import cached_profile, catalog_draft_share_floor, longest_draft, why_it_cannot_pay_at_floor
from .errors import Setting, Wording
from .fetch import resolve_draft, resolve_model
from .planner import Plan


def plan_without_the_draft(target_path: Path, ngram_plan: Plan, *, n_threads: int | None, bit_exact: bool,
                           measure_first: bool, pull: bool, notice) -> tuple[Plan, Path | str | None] | None:
    """The plan of n-grams alone when `--draft auto` need not fetch or read the catalog's draft for target_path,
    with the draft left to judge once the target is measured (None: none is): the target's remembered curve says
    it could not pay even at the least its token can cost, or (measure_first) none is remembered and the draft is
    on disk or may be fetched (pull), which is then the draft to judge.  None otherwise (no draft in the catalog
    for it, or it may pay)."""
    names = _catalog_drafts_for(target_path)
    if not names:
        return None
    present = _present_draft(names)
    draft = local_path(load_catalog().get(present)) if present else names[0]  # what `--draft` would take
    remembered = cached_profile(target_path, None, ngram_plan, n_threads)
    if remembered is None:
        if not (measure_first and (present or pull)):
            return None
        reason = f"n-grams only: {Path(draft).name} is used once this machine's costs say a draft model can pay"
        return say_warnings(dataclasses.replace(ngram_plan, reason=reason), notice), draft
    why = why_it_cannot_pay_at_floor(remembered.cost, longest_draft(remembered, bit_exact), Path(draft).name,
                                     catalog_draft_share_floor(ngram_plan, target_path, draft))
    if why is None:
        return None
    return ngram_only_plan(ngram_plan, why, draft, notice), None


def ngram_only_plan(ngram_plan: Plan, why: str, draft: Path | str, notice) -> Plan:
    """ngram_plan with why a draft model is left out as its reason, said once through notice with its warnings."""
    notice(ngram_only_notice(why, draft))
    return say_warnings(dataclasses.replace(ngram_plan, reason=f"n-grams only: {why}"), notice)


def say_warnings(plan: Plan, notice) -> Plan:
    """plan, its warnings said through notice."""
    for warning in plan.warnings:
        notice(warning)
    return plan


def ngram_only_notice(why: str, draft: Path | str) -> Wording:
    """draft: the file, or the catalog name of one not fetched."""
    return Wording(f"drafting with n-grams only: {why}; ", Setting("draft", str(draft)), " uses it anyway")


def draft_to_consider(target, draft, fetching: dict) -> Path | None:
    """The draft GGUF to consider, or None for n-gram / plain decoding.  fetching: resolve_model's keywords."""
    if draft in (None, "none", "ngram", "heads"):
        return None
    if draft == "auto":
        names = _catalog_drafts_for(target)
        present = _present_draft(names)
        for name in ([present] if present else names):
            path = resolve_draft(name, **fetching)
            if path is not None:
                return path
        return None
    return resolve_model(draft, **fetching)


def _present_draft(names: Sequence[str]) -> str | None:
    """The first of these catalog drafts already on disk, or None."""
    catalog = load_catalog()
    return next((name for name in names if local_path(catalog.get(name)) is not None), None)


def _catalog_drafts_for(target) -> tuple[str, ...]:
    """The drafts the catalog pairs with target (given by name or by the path of a catalog file), best first."""
    catalog = load_catalog()
    names = {str(target)}
    target_path = Path(target).expanduser()
    if target_path.is_file():
        names |= {e.name for e in catalog.models.values() if local_path(e) == target_path}
    return next((pair.drafts for pair in catalog.pairs if pair.target in names), ())
