"""A draft model's cost per token: timed against target passes under the same load, and never
below what its size allows (issue 25, section 5: calibration under load)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from edgespec.draft_cost import (
    PASSES_PER_TURN,
    ROUNDS,
    SIZE_SHARE_MARGIN,
    draft_token_share,
    least_plausible_share,
    measure_draft_share,
    size_share,
)
from edgespec.loading import load_engine


class LoadedMachine:
    """One-token pass times of a target and a draft on a loaded machine: a model's pass costs its
    idle time times the load of the round it is timed in (round 0 is the warm-up pass), as
    target_load(round) and draft_load(round) say; spikes[(model, call)] overrides one pass."""

    def __init__(self, target_seconds, draft_seconds, target_load, draft_load=None, spikes=None):
        self.seconds = {"target": target_seconds, "draft": draft_seconds}
        self.loads = {"target": target_load, "draft": draft_load or target_load}
        self.spikes = dict(spikes or {})
        self.calls = []

    def _time(self, model):
        call = self.calls.count(model)
        self.calls.append(model)
        round_ = 0 if call == 0 else 1 + (call - 1) // PASSES_PER_TURN
        return self.spikes.get((model, call), self.seconds[model] * self.loads[model](round_))

    def time_target(self):
        return self._time("target")

    def time_draft(self):
        return self._time("draft")


SHARE = 0.031 / 0.070


def test_the_share_holds_under_load_that_changes_between_turns():
    loads = [1.0, 1.0, 6.0, 2.0, 9.0, 3.0, 1.0, 5.0, 7.0]
    machine = LoadedMachine(0.070, 0.031, lambda round_: loads[round_])
    share = measure_draft_share(machine.time_target, machine.time_draft, least_share=0.2, estimate=0.44)
    assert share == pytest.approx(SHARE)
    turn = ["target"] * PASSES_PER_TURN + ["draft"] * PASSES_PER_TURN
    assert machine.calls == ["target", "draft", *turn * ROUNDS], "a warm-up pass each, then turns"


def test_a_pass_or_a_turn_caught_by_a_burst_of_load_does_not_move_the_share():
    machine = LoadedMachine(0.070, 0.031, lambda round_: 1.0,
                            spikes={("draft", 1): 30 * 0.031, ("target", 3): 30 * 0.070, ("target", 4): 30 * 0.070})
    share = measure_draft_share(machine.time_target, machine.time_draft, least_share=0.2, estimate=0.44)
    assert share == pytest.approx(SHARE)


def test_a_share_below_what_the_size_allows_is_measured_again_then_replaced_by_the_size_estimate():
    # Every target pass caught under load, every draft pass idle: 2% of a step, as seen in the issue.
    machine = LoadedMachine(0.070, 0.031, target_load=lambda round_: 20.0, draft_load=lambda round_: 1.0)
    notices = []
    share = measure_draft_share(machine.time_target, machine.time_draft, least_share=0.22, estimate=0.44,
                                notice=notices.append)
    assert share == 0.44
    assert len(machine.calls) == 2 + 2 * ROUNDS * 2 * PASSES_PER_TURN, "a warm-up pass each, then two sets of turns"
    assert len(notices) == 1 and "less than its size allows" in notices[0] and "44%" in notices[0]


def test_a_low_first_set_that_the_second_contradicts_keeps_the_measurement():
    def target_load(round_):
        return 20.0 if 1 <= round_ <= ROUNDS else 1.0

    machine = LoadedMachine(0.070, 0.031, target_load=target_load, draft_load=lambda round_: 1.0)
    notices = []
    share = measure_draft_share(machine.time_target, machine.time_draft, least_share=0.22, estimate=0.44,
                                notice=notices.append)
    assert share == pytest.approx(SHARE) and notices == []


@dataclass
class FileModel:
    path: Path
    n_gpu_layers: int = 0
    bos_id: int = 1

    def time_forward(self, n_tokens, filler):
        return self.path.stat().st_size * 1e-9  # a pass reads every weight once


def model_file(tmp_path, name, size):
    path = tmp_path / name
    path.write_bytes(bytes(size))
    return path


def test_the_least_share_is_the_draft_share_of_the_target_bytes_with_a_margin(tmp_path):
    target = FileModel(model_file(tmp_path, "target.gguf", 1000))
    draft = FileModel(model_file(tmp_path, "draft.gguf", 440))
    assert size_share(target, draft) == pytest.approx(0.44)
    assert least_plausible_share(target, draft) == pytest.approx(SIZE_SHARE_MARGIN * 0.44)
    assert draft_token_share(target, draft, timer=FileModel.time_forward) == pytest.approx(0.44)


def test_no_size_bound_where_a_model_runs_on_a_gpu(tmp_path):
    target = FileModel(model_file(tmp_path, "target.gguf", 1000), n_gpu_layers=-1)
    draft = FileModel(model_file(tmp_path, "draft.gguf", 440))
    assert least_plausible_share(target, draft) == 0.0


def test_a_loaded_draft_model_never_costs_less_than_its_size_allows(tiny_models):
    """Whatever the timings on this machine, the share the engine uses is at least the size bound."""
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=256, n_threads=1)
    try:
        assert engine.draft_model is not None
        share = engine.cost.draft_seconds_per_token / engine.cost.target(1)  # as loading.py reads it
        assert share >= least_plausible_share(engine.target, engine.draft_model) > 0
    finally:
        engine.close()
