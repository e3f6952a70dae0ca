"""Pilot tests of the chat app with tiny real GGUF models (tests/tinygguf.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time

import pytest
from rich.style import Style
from rich.table import Table

from tinygguf import write_model_family
from tui.app import ChatApp
from tui.config import KEY_ACTIONS, ChatConfig, config_path
from tui.history import ChatStore
from tui.history_screens import HistoryScreen
from tui.screens import ModelInfoScreen, SettingsScreen
from tui.reply import BlockView
from tui.widgets import AssistantMessage, Note, PromptInput, UserMessage

SIZE = (120, 40)


def pilot_test(test):
    """Run an async test body in its own event loop (no pytest async plugin needed)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_model_family(tmp_path_factory.mktemp("models"))


@pytest.fixture(autouse=True)
def user_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EDGESPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))


def make_app(models, **settings) -> ChatApp:
    values = dict(model=str(models["target"]), draft=str(models["draft"]), temperature=0.0, max_tokens=40,
                  draft_tokens=4)
    values.update(settings)
    return ChatApp(ChatConfig(**values), ChatStore(), n_threads=1)


async def wait_for(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await asyncio.sleep(0.02)  # not pilot.pause: that waits for every widget to go idle
    if pilot.app.generation is None:
        await pilot.pause()
    else:  # a streaming reply keeps the widgets busy; on a loaded machine they never go idle
        await asyncio.sleep(0.05)


async def loaded(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.chat.session is not None or pilot.app.query(Note))


async def send(pilot, text: str) -> None:
    """Type and send a prompt, and wait for the reply to end."""
    app = pilot.app
    before = len(app.query(AssistantMessage)), len(app.query(Note))
    await pilot.click(PromptInput)
    await pilot.press(*text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.generation is None and (
        len(app.query(AssistantMessage)), len(app.query(Note))) != before)


def replies(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


@pilot_test
async def test_prompt_streams_a_reply_with_draft_marks_stats_and_footer(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        [reply] = replies(app)
        assert app.chat.session.messages[-1] == {"role": "assistant", "content": reply.reply.text} or \
            app.chat.session.messages[-1]["content"] == reply.reply.text
        assert reply.reply.text
        assert reply.reply.drafted_ranges(), "the tiny draft agrees with its target often"
        assert list(app.query(UserMessage))[0].render().plain == "Hello world"
        footer = str(reply.footer.render())
        assert "40 tokens" in footer and "tok/s" in footer and "(calibrated)" in footer
        # against the calibrated one-token pass; the figure itself is this machine's (tests/test_tui_parts.py
        # checks which figures are shown), and one that this reply's passes rule out is not shown
        assert "× vs plain" in footer or "does not fit this reply" in footer
        await pilot.pause(0.3)  # the stats bar refreshes a few times a second
        bar = str(app.query_one("#stats-line").render())
        assert "draft model" in bar and "target ← draft" in bar
        assert "accept" in bar and "– tok/s" not in bar
        assert app.query_one("#acceptance").data, "per-step acceptance sparkline"
        assert app.prompt_input.text == ""

        tint = Style(bgcolor=app.config.draft_tint)
        def tinted_spans():
            return [s for view in reply.query(BlockView) for s in view.rendered.spans if s.style == tint]
        assert tinted_spans()
        await pilot.press("ctrl+t")
        assert not app.conversation.mark_drafts and not tinted_spans()
        await pilot.press("ctrl+t")
        assert tinted_spans()

        await pilot.press("ctrl+l")
        assert app.clipboard == reply.reply.text

        await pilot.press("f1")
        [panel] = app.screen.query("KeysPanel")
        table = panel.keys_table
        descriptions = [str(cell) for cell in table.columns[1]._cells]
        groups = [str(cell) for cell in table.columns[0]._cells if str(cell) in ("edgespec", "prompt", "editing")]
        assert groups == ["edgespec", "prompt", "editing"], "edgespec's own keys first, the editor's last"
        assert descriptions.index("History") < descriptions.index("Send") < descriptions.index("Cursor down")
        await pilot.press("f1")
        assert not app.screen.query("KeysPanel")

        titles = {command.title for command in app.get_system_commands(app.screen)}
        assert {description for _, description in KEY_ACTIONS.values()} <= titles
        assert {"Drafting: n-gram", "Drafting: no drafting", "Load model…"} <= titles


@pilot_test
async def test_escape_stops_the_reply_and_keeps_what_arrived(models):
    app = make_app(models, max_tokens=3000, n_ctx=4096)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("Tell me everything")
        # Enter's action, not pilot.press("enter"): a press waits for the app to go idle, and on a busy
        # machine the tiny models' whole reply (seconds long) could end before the press returned.
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
        stored = app.store.load_chat(app.chat.chat_id)  # saved before the reply: a kill now loses only the reply
        assert stored.extras["pending_prompt"] == "Tell me everything" and stored.session["messages"] == []

        reply_view = app.generation.view.reply
        await wait_for(pilot, lambda: app.conversation.max_scroll_y > 5)
        assert app.conversation.scroll_y == app.conversation.max_scroll_y  # following the stream
        app.conversation.scroll_home(animate=False)
        shown = len(reply_view.text)
        await wait_for(pilot, lambda: len(reply_view.text) > shown + 200)
        assert app.conversation.scroll_y == 0, "scrolled up: the view stays put"
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.generation is None)
        [reply] = replies(app)
        last = app.chat.session.messages[-1]
        assert last["role"] == "assistant" and last.get("cancelled")
        assert last["content"] == reply.reply.text != ""
        assert app.chat.shown_stats.finish_reason == "cancelled"
        assert app.chat.shown_stats.tokens_generated < 3000
        assert str(reply.footer.render()).startswith("stopped")
        app.chat.settings = dataclasses.replace(
            app.chat.settings, sampling=dataclasses.replace(app.chat.settings.sampling, max_tokens=20))
        await send(pilot, "Go on")  # the chat goes on after a stop
        assert app.chat.session.messages[-1]["role"] == "assistant"
        assert not app.chat.session.messages[-1].get("cancelled")


@pilot_test
async def test_regenerate_mode_switch_and_new_chat(models):
    app = make_app(models, keymap={"regenerate": "f5"})
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        first = app.chat.session.messages[-1]["content"]

        await pilot.press("f5")  # rebound in the keymap
        await wait_for(pilot, lambda: app.generation is None)
        assert [m["role"] for m in app.chat.session.messages] == ["user", "assistant"]
        assert len(replies(app)) == 1
        assert app.chat.session.messages[-1]["content"] == first  # T=0 samples the same reply

        await pilot.press("ctrl+g")
        assert app.chat.engine.mode == "ngram"
        await send(pilot, "and the cat")
        assert app.chat.shown_stats.mode == "ngram"
        await pilot.press("ctrl+g")
        assert app.chat.engine.mode == "none"
        plain_steps = app.chat.plain_steps.steps
        await send(pilot, "sat on the")
        assert app.chat.shown_stats.mode == "none" and app.chat.shown_stats.draft_tokens_proposed == 0
        assert app.chat.plain_steps.steps == plain_steps + app.chat.shown_stats.steps, "a plain reply measures the baseline"
        assert app.chat.plain_speed() is not None
        await send(pilot, "world")
        await pilot.press("ctrl+g")
        assert app.chat.engine.mode == "combined"  # n-grams or the draft model, per step
        await send(pilot, "hello")
        footer = str(replies(app)[-1].footer.render())
        assert "× vs plain" in footer or "does not fit this reply" in footer

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.session.messages == [] and not replies(app) and app.chat.chat_id is None


@pilot_test
async def test_history_and_settings_survive_a_restart(models):
    app = make_app(models, draft_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+g")  # ngram
        await send(pilot, "Hello world")
        saved = [dict(m) for m in app.chat.session.messages]
        marks = replies(app)[0].reply.drafted_ranges()
        app.chat.save(pending_prompt="never answered")  # as sending does, just before a reply that a kill cut off

    app = make_app(models, draft_tokens=5)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat.engine.draft_tokens == 5 and app.chat.engine.mode == "combined"
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("enter")
        await pilot.pause()
        assert [m["content"] for m in app.chat.session.messages] == [m["content"] for m in saved]
        assert app.chat.settings.draft_tokens == 3 and app.chat.engine.draft_tokens == 3
        assert app.chat.engine.mode == "ngram"
        [reply] = replies(app)
        assert reply.reply.text == saved[-1]["content"]
        assert reply.reply.drafted_ranges() == marks
        assert "tokens" in str(reply.footer.render())
        assert app.prompt_input.text == "never answered"
        assert "no reply" in str(app.query(Note).last().render())
        app.prompt_input.load_text("")
        await send(pilot, "and again")  # the reopened chat continues
        assert len(app.chat.session.messages) == 4


@pilot_test
async def test_up_recalls_prompts_and_ctrl_j_adds_a_line(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "first prompt")
        await pilot.press(*"two", "ctrl+j", *"lines")
        assert app.prompt_input.text == "two\nlines"
        await pilot.press("up")  # moves within the text first
        await pilot.press("up")
        assert app.prompt_input.text == "first prompt"
        await pilot.press("down")
        assert app.prompt_input.text == "two\nlines"


@pilot_test
async def test_settings_apply_to_the_chat_and_save_as_defaults(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "0.5"
        app.screen.query_one("#draft-tokens").value = "6"
        app.screen.query_one("#system-prompt").load_text("Be brief.")
        await pilot.click("#save")
        await pilot.pause()
        assert app.chat.settings.sampling.temperature == 0.5
        assert app.chat.engine.draft_tokens == 6
        text = config_path().read_text()
        assert "temperature = 0.5" in text and "draft_tokens = 6" in text and 'system_prompt = "Be brief."' in text

        await pilot.press("ctrl+s")
        app.screen.query_one("#top-p").value = "2"
        await pilot.click("#apply")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen), "an invalid value keeps the dialog open"
        assert "top_p" in str(app.screen.query_one("#settings-error").render())
        await pilot.press("escape")


@pilot_test
async def test_settings_edit_min_p_seed_stop_strings_and_bit_exact_and_refuse_bad_values_in_place(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert not app.chat.engine.bit_exact
        for field, value, problem in (("#min-p", "nan", "min_p"), ("#min-p", "1.5", "min_p"),
                                      ("#seed", "-3", "seed"), ("#seed", "two", "seed must be a whole number")):
            await pilot.press("ctrl+s")
            app.screen.query_one(field).value = value
            app.screen.query_one("#apply").press()
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen), f"{field} = {value} keeps the dialog open"
            assert problem in str(app.screen.query_one("#settings-error").render())
            await pilot.press("escape")
        await pilot.press("ctrl+s")
        app.screen.query_one("#min-p").value = "0.1"
        app.screen.query_one("#seed").value = "1234"
        app.screen.query_one("#stop").load_text("cat\\nsat\nEND")
        app.screen.query_one("#bit-exact").value = True
        app.screen.query_one("#apply").press()
        await pilot.pause()
        sampling = app.chat.settings.sampling
        assert (sampling.min_p, sampling.seed, sampling.stop) == (0.1, 1234, ("cat\nsat", "END"))
        assert app.chat.engine.bit_exact and app.chat.settings.bit_exact
        await send(pilot, "Hello world")
        assert app.chat.shown_stats.bit_exact
        assert app.store.load_chat(app.chat.chat_id).settings["bit_exact"] is True
        await pilot.press("ctrl+s")  # shown as set, the newline written back as \n
        assert app.screen.query_one("#stop").text == "cat\\nsat\nEND" and app.screen.query_one("#seed").value == "1234"
        await pilot.press("escape")


@pilot_test
async def test_model_info_shows_both_models(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f2")
        assert isinstance(app.screen, ModelInfoScreen)
        tables = [item.title for item in app.screen.renderables if isinstance(item, Table)]
        assert tables[0].startswith("edgespec plan: draft-model")
        assert tables[1:] == ["Target model", "Draft model"]
        assert "target.gguf" in app.screen.renderables[0]


@pytest.mark.parametrize("which, message", [
    ("broken", "Could not load the model"),
    ("mismatch", "cannot draft for target"),
])
@pilot_test
async def test_load_errors_show_a_message_and_the_app_keeps_running(models, tmp_path, which, message):
    if which == "broken":
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"not a gguf file at all")
        app = make_app(models, model=str(broken))
    else:
        app = make_app(models, draft=str(models["mismatch"]))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        [notice] = app.query(Note)
        assert message in str(notice.render())
        assert app.chat.session is None
        await pilot.click(PromptInput)
        await pilot.press(*"hi", "enter")
        assert not app.query(UserMessage)
        # Load a working pair from the command that the message points to.
        app.load_models(str(models["target"]), "ngram")
        await wait_for(pilot, lambda: app.chat.session is not None)
        await send(pilot, "Hello")
        assert replies(app)


@pilot_test
async def test_context_overflow_is_a_message_not_a_crash(models):
    app = make_app(models, n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("the cat sat " * 100)
        await pilot.click(PromptInput)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query(Note))
        await wait_for(pilot, lambda: app.generation is None)
        assert "context" in str(app.query(Note).last().render())
        assert app.prompt_input.text == ("the cat sat " * 100).strip(), "the refused message is back in the input"
        app.prompt_input.load_text("")
        await send(pilot, "hi")  # still usable
        assert replies(app)


@pilot_test
async def test_a_full_context_drops_the_oldest_turns_with_a_note(models):
    app = make_app(models, n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        for turn in range(4):
            app.prompt_input.load_text(f"turn {turn}: " + "the cat sat on the mat " * 8)
            await send(pilot, "")
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("left the oldest" in note for note in notes), notes
        assert len(replies(app)) == 4 and app.chat.session.messages[-1]["role"] == "assistant"


@pilot_test
async def test_the_kv_cache_settings_load_the_models_with_them_and_say_what_they_trade(models):
    app = make_app(models, kv_type="q8_0", draft_kv_type="f16")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        engine = app.chat.engine
        assert (engine.target.type_k, engine.target.type_v, engine.draft.type_k) == ("q8_0", "f16", "f16")
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("keys only" in note for note in notes), notes
        await send(pilot, "Hello world")
        assert replies(app)


@pilot_test
async def test_quitting_mid_reply_stops_the_worker_and_frees_the_models(models):
    app = make_app(models, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("Tell me everything")
        # Enter's action, not pilot.press("enter"): a press waits for the app to go idle, and on a busy
        # machine the tiny models' whole reply (seconds long) could end before the press returned.
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
        stream = app.generation.stream
        await pilot.press("ctrl+q")
    started = time.monotonic()
    app.close_engine()
    assert stream.finished.is_set() and stream.result.finish_reason == "cancelled"
    assert app.chat.engine is None and time.monotonic() - started < 5


@pilot_test
async def test_the_first_load_says_it_measures_the_models_speed(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("measuring this model's speed, once" in note for note in notes), notes


@pilot_test
async def test_a_short_plain_reply_does_not_become_the_plain_speed(models):
    """Ten tokens (here fast; in the field once 10 tokens in 34.7 s, cancelled on a busy machine)
    are too few to say how fast plain decoding is: the calibrated pass stands until there are enough."""
    app = make_app(models, draft="none", max_tokens=10)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        assert app.chat.shown_stats.mode == "none" and 0 < app.chat.shown_stats.steps < app.chat.plain_steps.min_steps
        assert app.chat.plain_speed() == (1 / app.chat.engine.plain_step_seconds, "calibrated")


@pilot_test
async def test_a_stale_speed_measurement_is_redone_between_replies_not_at_start(models):
    from edgespec.loading import load_engine
    from edgespec.backend import RUNTIME
    from edgespec.calibration import CalibrationCache, CalibrationKey

    # What an earlier run measured under load and StepTimeWatch then marked stale: exact up to width 3.
    probe = load_engine(models["target"], "none", n_ctx=256, n_threads=1, cost_curve=(1.0,))
    cache = CalibrationCache()
    key = CalibrationKey.for_model(probe.target.path, probe.target.n_gpu_layers, probe.target.n_threads, RUNTIME)
    probe.close()
    cache.store(key, 3, (1000.0, 1001.0, 1002.0))
    cache.mark_stale(key)

    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat.engine.exact_width == 3, "the chat started on the old measurement"
        assert not any("measuring" in str(note.render()) for note in app.query(Note))
        await wait_for(pilot, lambda: not app.chat.engine.calibration_due and not app.host.measuring)
        assert app.chat.engine.plain_step_seconds < 1000.0 and cache.load_entry(key) is not None
        await send(pilot, "Hello world")  # the chat goes on with the new measurement
        assert replies(app)
