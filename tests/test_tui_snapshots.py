"""Snapshots of the chat app (pytest-textual-snapshot), kept deterministic.

Greedy decoding (T=0) on the tiny models with one thread and a fixed draft
length makes the reply and its draft marks repeatable; the engine's clock is
replaced (in the engine and the backend's calibration) by one that advances
10 ms per reading, so tok/s figures repeat too.
Model paths show relative to the working directory, which is the models'.
Update with: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import time

import pytest

import edgespec.backend.probing
import edgespec.decoder
import edgespec.generation
from tinygguf import write_model_family
from tui.app import ChatApp
from tui.config import ChatConfig
from tui.history import ChatStore
from tui.widgets import AssistantMessage

SIZE = (120, 36)


class SteppingClock:
    """time.perf_counter stand-in: every reading is 10 ms after the previous one."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 0.01
        return self.now

    def perf_counter_ns(self) -> int:
        return round(self.perf_counter() * 1e9)


@pytest.fixture
def app(tmp_path, monkeypatch):
    models = write_model_family(tmp_path / "models")
    monkeypatch.chdir(tmp_path / "models")
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EDGESPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    clock = SteppingClock()
    monkeypatch.setattr(edgespec.decoder, "time", clock)
    monkeypatch.setattr(edgespec.generation, "time", clock)
    monkeypatch.setattr(edgespec.backend.probing, "time", clock)  # the calibration's timings too
    config = ChatConfig(model=str(models["target"]), draft=str(models["draft"]), draft_tokens=4,
                        temperature=0.0, max_tokens=48, memory_budget="8GiB")
    app = ChatApp(config, ChatStore(), n_threads=1)
    yield app
    app.close_engine()


async def _until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)


async def _ready(pilot) -> None:
    await _until(pilot, lambda: pilot.app.chat.session is not None)
    pilot.app.prompt_input.cursor_blink = False
    await pilot.pause()  # drawn with the steady cursor before anything covers it, whatever the blink phase was


def test_main_screen_with_a_finished_reply_and_draft_marks(app, snap_compare):
    async def chat(pilot):
        await _ready(pilot)
        await pilot.press(*"Hello world", "enter")
        await _until(pilot, lambda: app.generation is None and app.query(AssistantMessage))
        await pilot.pause(0.4)  # the stats bar refreshes every 0.25 s

    assert snap_compare(app, terminal_size=SIZE, run_before=chat)


def test_model_info_screen(app, snap_compare):
    async def open_info(pilot):
        await _ready(pilot)
        await pilot.press("f2")

    assert snap_compare(app, terminal_size=SIZE, run_before=open_info)


def test_main_screen_at_80x24_keeps_both_bars_on_their_lines(app, snap_compare):
    """No sparkline and fewer figures in the stats bar, the most important keys in the footer."""
    async def chat(pilot):
        await _ready(pilot)
        await pilot.press(*"Hello world", "enter")
        await _until(pilot, lambda: app.generation is None and app.query(AssistantMessage))
        await pilot.pause(0.4)
        bar = app.query_one("#stats-line").render()
        assert all(len(line) <= 78 for line in str(bar).splitlines()) and not app.query_one("#acceptance").display

    assert snap_compare(app, terminal_size=(80, 24), run_before=chat)
