"""Snapshots of the chat app (pytest-textual-snapshot), the same on every machine.

Nothing on screen may depend on what a model generates (the CPU's kernels), on
how fast it does (the machine, its load), or on when the snapshot is taken:
- the reply is scripted (tests/scripted_reply.py): fixed tokens, draft marks and figures;
- the engine's cost curve is given, so nothing is measured and no notice says so;
- the memory plan is a CPU-only build's, and the logit drift the model-info screen
  shows is fixed, whatever this build and these kernels give;
- each test waits for what the screen must show, never for a time.
The tiny models (tests/tinygguf.py) stay real for loading and tokenising.
Model paths show relative to the working directory, which is the models'.
Update with: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio

import pytest

import edgespec.loading
from scripted_reply import ScriptedReply, use_script
from tinygguf import write_model_family
from tui.app import ChatApp
from tui.config import ChatConfig
from tui.history import ChatStore

SIZE = (120, 36)
COST_CURVE = (1.0, 1.05, 1.1, 1.15, 1.2)
REPLY = ("Here is **the sum** of the list:\n\n```python\ndef total(values):\n    return sum(values)\n```\n\n"
         "It adds every value, one after another, and returns the total.")
DRAFTED = [[0, 7], [REPLY.index("def"), REPLY.index("def") + 14], [REPLY.index("one after"), REPLY.index(" and")]]


@pytest.fixture
def app(tmp_path, monkeypatch):
    models = write_model_family(tmp_path / "models")
    monkeypatch.chdir(tmp_path / "models")
    # What this llama.cpp build offers (a GPU) would change the plan that the model-info screen shows.
    monkeypatch.setattr(edgespec.loading, "supports_gpu_offload", lambda: False)
    config = ChatConfig(model=str(models["target"]), draft=str(models["draft"]), draft_tokens=4,
                        temperature=0.0, max_tokens=200, memory_budget="8GiB")
    app = ChatApp(config, ChatStore(), n_threads=1, cost_curve=COST_CURVE)
    yield app
    app.close_engine()


async def _until(condition, timeout: float = 60.0) -> None:
    """Wait for condition(): a limit only against a hang, never what the test waits for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the app"
        await asyncio.sleep(0.02)


async def _ready(pilot, monkeypatch) -> None:
    app = pilot.app
    await _until(lambda: app.chat.session is not None)
    engine = app.chat.engine
    use_script(engine, ScriptedReply(REPLY, DRAFTED, mode="combined"))
    monkeypatch.setattr(engine, "drift_bound", lambda: 0.0)  # the kernels' rounding, which this screen shows
    app.prompt_input.cursor_blink = False
    await pilot.pause()  # drawn with the steady cursor before anything covers it, whatever the blink phase was


async def _send_and_finish(pilot) -> None:
    app = pilot.app
    await pilot.press(*"Hello world", "enter")
    await _until(lambda: app.generation is None and app.chat.session.messages[-1:] and
                 app.chat.session.messages[-1]["role"] == "assistant")
    await _until(lambda: app.stats_bar.reply is not None and app.stats_bar.reply.finish_reason == "stop")
    await pilot.pause()


def test_main_screen_with_a_finished_reply_and_draft_marks(app, snap_compare, monkeypatch):
    async def chat(pilot):
        await _ready(pilot, monkeypatch)
        await _send_and_finish(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=chat)


def test_model_info_screen(app, snap_compare, monkeypatch):
    async def open_info(pilot):
        await _ready(pilot, monkeypatch)
        await pilot.press("f2")
        await _until(lambda: type(pilot.app.screen).__name__ == "ModelInfoScreen")

    assert snap_compare(app, terminal_size=SIZE, run_before=open_info)


def test_main_screen_at_80x24_keeps_both_bars_on_their_lines(app, snap_compare, monkeypatch):
    """No sparkline and fewer figures in the stats bar, the most important keys in the footer."""
    async def chat(pilot):
        await _ready(pilot, monkeypatch)
        await _send_and_finish(pilot)
        bar = app.query_one("#stats-line").render()
        assert all(len(line) <= 78 for line in str(bar).splitlines()) and not app.query_one("#acceptance").display

    assert snap_compare(app, terminal_size=(80, 24), run_before=chat)
