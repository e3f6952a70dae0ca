"""A model's cost profile on this machine, and the Calibrator that measures (or reads) it.

A CostProfile is what the engine plans every pass with: what a target pass
costs per width and per number of sequences (a CostModel), the widest pass
that is bit-identical to one-token passes, and how far wider ones drift.  It
is frozen: the engine holds one and never changes it; measuring again makes a
new one.  A profile is either given (a fixed cost curve: nothing is timed,
only the pass widths are probed) or measured by a Calibrator, which keeps its
measurements in the calibration cache (calibration.py) so that later loads
read them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .backend import RUNTIME, LlamaModel, probe_pass_widths, probe_tokens, time_forward, time_sequence_passes
from .calibration import CachedCalibration, CalibrationCache, CalibrationKey, StepTimeWatch, draft_model_key
from .pass_prices import priced_curve
from .costs import CostModel
from .curve_timing import PLANNED_WIDTHS, measure_curve
from .draft_cost import draft_token_share
from .limits import MAX_DRAFT_TOKENS, kv_cache_label

# Passes over several sequences: how many sequences and how many rows each (a step's own token plus
# drafts), each sequence this deep in cells of its own: about as deep as a batch's short requests are
# midway, where attending in a buffer that holds every sequence's cells shows its cost (32 deep, without
# flash attention, the grid saw 16 sequences as free where 256 deep they cost 1.6-2.4x).  Each point is
# two passes timed in turns; what the budget leaves out is interpolated (calibration.SEQUENCES_METHOD:
# change it with these).
SEQUENCE_GRID = tuple((n, rows) for n in (2, 4, 8, 16) for rows in (1, 2, 4))
SEQUENCE_DEPTH = 256
SEQUENCE_BUDGET_SECONDS = 4.0

# How long the search for the widest bit-exact pass may take. Every width is checked by a pass of
# its own (on SmolLM2 all 33 are exact, ~300 one-token passes in all), so on a slow or busy
# machine the search stops early: drafts get shorter there, never inexact.
WIDTH_PROBE_BUDGET_SECONDS = 4.0


@dataclass(frozen=True)
class CostProfile:
    """What this engine's target passes cost and how exact wide ones are; never changed once made."""

    cost: CostModel
    exact_width: int  # every pass up to this many tokens gives one-token passes' logits bit for bit
    drift: tuple[tuple[int, float], ...]  # (width, largest logit difference from one-token passes), per checked width
    widest: int  # the widest pass a step may verify on this profile
    plain_step_seconds: float | None = None  # a measured one-token pass; None for a given curve
    stale: bool = False  # a cached measurement worth taking again when the caller is idle
    # the curve as calibration measured it, before the pass prices seen in generation (cost's is after);
    # () for a given curve
    measured_curve: tuple[float, ...] = ()

    @property
    def kernel_drift(self) -> dict[int, float]:
        return dict(self.drift)

    @property
    def measured(self) -> bool:
        return self.plain_step_seconds is not None


def given_profile(target: LlamaModel, cost: CostModel) -> CostProfile:
    """A profile on a given cost curve: nothing is timed or cached; the pass widths are probed (they compare
    logits, not times), all of them up to the curve's widest."""
    widest = min(len(cost.forward_seconds), MAX_DRAFT_TOKENS + 1)
    probe = probe_pass_widths(target, probe_tokens(target), widest, PLANNED_WIDTHS)
    return CostProfile(cost, probe.exact_width, tuple(sorted(probe.drift.items())), widest)


class Calibrator:
    """Measures a target's cost profile on this machine, or reads it from the calibration cache.

    A draft model's cost per token is timed once per curve (in turns with the target, draft_cost.py) and
    kept with it, so that a later load can decide on a draft before loading it (remembered_profile); the
    heads' is asked of them at every load.
    """

    def __init__(self, target: LlamaModel, cache: CalibrationCache, notice: Callable[[str], None]):
        self.target = target
        self.cache = cache
        self.notice = notice
        self.key = CalibrationKey.for_model(target.path, target.n_gpu_layers, target.n_threads, RUNTIME,
                                            kv_cache=target.kv_cache_label)

    def load(self, draft: LlamaModel | None, heads_seconds: float, measure_stale: bool = True) -> CostProfile:
        """The cached profile, or one measured now (and cached) when there is none, or when it is stale and
        measure_stale.  A stale one used as it is says so (CostProfile.stale)."""
        cached = self.cache.read(self.key)
        if cached is None:
            self.notice("measuring this model's speed, once (5-20 seconds for a small model on a CPU; "
                        "later runs reuse it) ...")
            probe = probe_pass_widths(self.target, probe_tokens(self.target), MAX_DRAFT_TOKENS + 1, PLANNED_WIDTHS,
                                      WIDTH_PROBE_BUDGET_SECONDS)
            cached = CachedCalibration(probe.exact_width, (), False, probe.drift)
        elif cached.stale and measure_stale:
            self.notice("measuring this model's speed again: the last measurement is out of date or no longer "
                        "matches this machine (a few seconds) ...")
        else:
            return self._profile(cached, draft, heads_seconds)
        return self._profile(self._measured(cached), draft, heads_seconds)

    def measure_again(self, profile: CostProfile, draft: LlamaModel | None, heads_seconds: float) -> CostProfile:
        """A new profile with the curve measured now; the exact width and drift stay (they depend on the model,
        build and CPU, not on the load), and so does the cost of several sequences, if measured."""
        kept = CachedCalibration(profile.exact_width, (), False, profile.kernel_drift, profile.cost.sequences)
        return self._profile(self._measured(kept), draft, heads_seconds)

    def with_sequences(self, profile: CostProfile) -> CostProfile:
        """The profile with the cost of passes over several sequences, measured now (and cached) unless it
        has it already (a cache written before it was measured gets it now, with one notice)."""
        if profile.cost.sequences:
            return profile
        self.notice("measuring passes over several sequences, once (a few seconds) ...")
        points = time_sequence_passes(self.target, SEQUENCE_GRID, SEQUENCE_DEPTH, max(self.target.bos_id, 0),
                                      SEQUENCE_BUDGET_SECONDS)
        self.cache.store_sequences(self.key, tuple(points))
        return dataclasses.replace(profile, cost=dataclasses.replace(profile.cost, sequences=tuple(points)))

    def watch(self, profile: CostProfile) -> StepTimeWatch:
        """What flags the profile's curve as stale when lone generations' passes no longer match its shape, and
        adds what they cost to the cache's pass prices (both against the curve as measured)."""
        return StepTimeWatch(self.cache, self.key, profile.measured_curve)

    def _measured(self, kept: CachedCalibration) -> CachedCalibration:
        """The curve measured now and stored with kept's exact width, drift and sequences."""
        filler = max(self.target.bos_id, 0)
        curve = measure_curve(lambda n: time_forward(self.target, n, filler), MAX_DRAFT_TOKENS + 1,
                              notice=self.notice)
        self.cache.store(self.key, kept.max_width, curve, drift=kept.drift)
        if self.cache.write_error is not None:
            self.notice(f"cannot save this model's speed in {self.cache.path} ({self.cache.write_error}), so every "
                        "run measures it again; point EDGESPEC_CACHE_DIR at a writable folder")
        if kept.sequences:
            self.cache.store_sequences(self.key, kept.sequences)
        return CachedCalibration(kept.max_width, curve, False, kept.drift, kept.sequences)

    def _profile(self, entry: CachedCalibration, draft: LlamaModel | None, heads_seconds: float) -> CostProfile:
        """The entry's profile with the draft's share as the entry remembers it, or as timed now (and kept)."""
        share = 0.0
        if draft is not None:
            # the KV cache as the draft was loaded with, which loading.py knows before it loads one
            draft_key = draft_model_key(draft.path, draft.n_gpu_layers,
                                        kv_cache_label(draft.type_k, draft.type_v, draft.flash_attn))
            share = entry.draft_shares.get(draft_key)
            if share is None:  # timed against target passes timed alongside (draft_cost.py)
                share = draft_token_share(self.target, draft, self.notice)
                self.cache.store_draft_share(self.key, draft_key, share)
        return _priced_profile(entry, share, heads_seconds)


def remembered_profile(cache: CalibrationCache, key: CalibrationKey, draft: str | None) -> CostProfile | None:
    """The profile cached under key with the share of a draft model (draft: its draft_model_key) timed with it,
    for deciding on that model before loading it; None unless a fresh curve and that share are both cached.
    With draft None, the curve alone (a draft share of 0), for deciding before a draft model is fetched."""
    cached = cache.read(key)
    if cached is None or cached.stale or (draft is not None and draft not in cached.draft_shares):
        return None
    return _priced_profile(cached, 0.0 if draft is None else cached.draft_shares[draft], 0.0)


def _priced_profile(entry: CachedCalibration, draft_share: float, heads_seconds: float) -> CostProfile:
    """The entry's curve at the prices its passes were paid at in generation (pass_prices.priced_curve), with a
    draft token at draft_share of its one-token pass."""
    curve = priced_curve(entry.forward_seconds, entry.pass_prices)
    cost = CostModel(curve, curve[0] * draft_share, heads_seconds, entry.sequences)
    return CostProfile(cost, entry.max_width, tuple(sorted(entry.drift.items())), MAX_DRAFT_TOKENS + 1,
                       plain_step_seconds=curve[0], stale=entry.stale, measured_curve=entry.forward_seconds)
