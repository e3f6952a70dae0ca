"""Pilot tests of the chat app with tiny real GGUF models (tests/tinygguf.py).

No expected value here depends on what the models generate or how fast: a test that
checks what the screen shows of a reply scripts it (tests/scripted_reply.py); a test
that lets the tiny models generate checks structure and counts, or, with bit_exact
at T = 0, that a reply is plain decoding's.  The engines get a fixed cost curve, so
draft lengths never depend on this machine's speed (the tests of the speed
measurement itself pass cost_curve=None).  Tests wait for conditions, never for a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time

import pytest
from rich.style import Style
from rich.table import Table

from scripted_reply import FILLER, ScriptedReply, use_script
from edgespec import SamplingParams
from edgespec.engine import Step
from tinygguf import write_model_family, write_tiny_model
import tui.app as tui_app
from tui.app import ChatApp
from tui.ending import STOP_SIGNALS
from tui.engine_host import EngineHost
from tui.config import KEY_ACTIONS, ChatConfig, config_path
from tui.history import ChatStore
from tui.history_screens import HistoryScreen
from tui.screens import ModelInfoScreen, SettingsScreen
from tui.reply import BlockView
from tui.widgets import AssistantMessage, Note, PromptInput, UserMessage

SIZE = (120, 40)
COST_CURVE = (1.0, 1.05, 1.1, 1.15, 1.2)  # seconds per target pass over 1..5 tokens: drafts of up to 4
REPLY = ("The cat sat on the mat, and the mat was warm.\n\n```python\nprint('the cat')\n```\n\n"
         "Then the cat sat on the mat again.")
DRAFTED = [[4, 15], [REPLY.index("print"), REPLY.index("print") + 6], [REPLY.index("sat on the mat again"),
                                                                      REPLY.index(" again")]]


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


def make_app(models, cost_curve=COST_CURVE, store: ChatStore | None = None, **settings) -> ChatApp:
    values = dict(model=str(models["target"]), draft=str(models["draft"]), temperature=0.0, max_tokens=40,
                  draft_tokens=4)
    values.update(settings)
    return ChatApp(ChatConfig(**values), store or ChatStore(), n_threads=1, cost_curve=cost_curve)


async def wait_for(pilot, condition, timeout: float = 60.0) -> None:
    """Wait for condition(): the timeout only guards against a hang, it is never what a test waits for."""
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
    app = make_app(models, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        script = use_script(app.chat.engine, ScriptedReply(REPLY, DRAFTED, mode="combined"))
        await send(pilot, "Hello world")
        [reply] = replies(app)
        assert reply.reply.text == REPLY == app.chat.session.messages[-1]["content"]
        assert reply.reply.drafted_ranges() == DRAFTED
        assert list(app.query(UserMessage))[0].render().plain == "Hello world"
        stats = app.chat.shown_stats
        assert stats.finish_reason == "stop" and stats.tokens_generated == len(ScriptedReply(REPLY, DRAFTED).tokens(REPLY))
        footer = str(reply.footer.render())
        assert footer.startswith(f"{stats.tokens_generated} tokens · {stats.decode_tokens_per_second:.1f} tok/s · "
                                 f"n-gram accepted {stats.acceptance_rate:.0%}")  # its drafts were all n-grams
        bar = str(app.query_one("#stats-line").render())
        assert "n-gram + draft model" in bar and "target ← draft" in bar
        assert f"{stats.decode_tokens_per_second:.1f} tok/s" in bar and f"accept {stats.acceptance_rate:.0%}" in bar
        assert f"ctx {stats.prompt_tokens + stats.tokens_generated:,}/" in bar
        steps = [event for event in script.stream_tokens([1], SamplingParams(max_tokens=1000)) if isinstance(event, Step)]
        per_step = [step.accepted / step.drafted for step in steps if step.drafted]
        assert list(app.query_one("#acceptance").data) == list(app.chat.acceptance) == per_step and per_step
        assert app.prompt_input.text == ""

        tint = Style(bgcolor=app.config.draft_tint)
        def tinted():
            return "".join(view.rendered.plain[s.start:s.end] for view in reply.query(BlockView)
                           for s in view.rendered.spans if s.style == tint)
        assert tinted() == "".join(REPLY[start:end] for start, end in DRAFTED)
        await pilot.press("ctrl+t")
        assert not app.conversation.mark_drafts and not tinted()
        await pilot.press("ctrl+t")
        assert tinted()

        await pilot.press("ctrl+l")
        assert app.clipboard == REPLY

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
        assert {description for _, description in KEY_ACTIONS.values()} - titles == {"Stop"}  # nothing to stop
        assert {"Drafting: n-gram", "Drafting: no drafting", "Load model…"} <= titles


@pilot_test
async def test_a_message_is_not_sent_to_the_old_models_while_new_ones_load(models):
    # a reply of the old models, still running when the new ones came, froze the screen while they were
    # swapped, and was lost
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("Hello")
        app.load_models(str(models["target"]), "ngram")
        app.on_prompt_input_submitted(PromptInput.Submitted("Hello"))  # before the load can end
        assert app.generation is None and app.prompt_input.text == "Hello"
        await wait_for(pilot, lambda: app.loading is None)
        assert app.chat.session.messages == []


@pilot_test
async def test_the_palette_offers_only_what_can_run_while_the_models_load(models):
    # "Edit prompt" from the palette while the models loaded ended the app with a traceback: the palette
    # skipped the check the keys go through
    app = make_app(models, model=str(models["target"].with_name("missing.gguf")))  # no chat, as while loading
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)  # the load failed, and said so
        assert app.chat.session is None
        titles = {command.title for command in app.get_system_commands(app.screen)}
        assert not {"Edit prompt", "Regenerate", "History", "Last chat"} & titles and "Load model…" in titles
        assert not any(title.startswith("Drafting:") for title in titles)


@pilot_test
async def test_a_replys_speedup_is_against_the_plain_steps_the_chat_measured(models):
    app = make_app(models, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        engine = app.chat.engine
        use_script(engine, ScriptedReply(REPLY, DRAFTED, mode="ngram"))
        await send(pilot, "Hello")
        assert app.chat.plain_steps.steps < app.chat.plain_steps.min_steps  # and the cost curve is given, not measured
        assert "speedup n/a (no plain-decoding speed known yet)" in str(replies(app)[-1].footer.render())
        app.set_mode("none")
        use_script(engine, ScriptedReply(FILLER * 8, mode="none", chars_per_token=4, seconds_per_step=0.025))
        await send(pilot, "Count")
        assert app.chat.plain_speed() == (pytest.approx(40.0), "measured")  # 1 token per 25 ms step
        assert "plain decoding (the speedup baseline)" in str(replies(app)[-1].footer.render())
        app.set_mode("ngram")
        use_script(engine, ScriptedReply(REPLY, DRAFTED, mode="ngram", seconds_per_step=0.025))
        await send(pilot, "Again")
        stats = app.chat.shown_stats
        speedup = stats.decode_tokens_per_second / 40.0  # the same step time: tokens per step
        assert f"{speedup:.2f}× vs plain 40.0 tok/s (measured)" in str(replies(app)[-1].footer.render())


@pilot_test
async def test_escape_stops_the_reply_and_keeps_what_arrived(models):
    app = make_app(models, max_tokens=3000, n_ctx=4096)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply(REPLY, DRAFTED, endless=True, pause_s=0.002))  # until Esc
        app.prompt_input.load_text("Tell me everything")
        # Enter's action, not pilot.press("enter"): a press waits for the app to go idle, which a streaming reply
        # never is.
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
        stored = app.store.load_chat(app.chat.chat_id)  # saved before the reply: a kill now loses only the reply
        assert stored.extras["pending_prompt"] == "Tell me everything" and stored.session["messages"] == []

        reply_view = app.generation.view.reply
        await wait_for(pilot, lambda: app.conversation.max_scroll_y > 5)
        await wait_for(pilot, lambda: app.conversation.scroll_y == app.conversation.max_scroll_y)  # following it
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
        assert str(reply.footer.render()).startswith("stopped")
        use_script(app.chat.engine, ScriptedReply("Going on."))
        await send(pilot, "Go on")  # the chat goes on after a stop
        assert app.chat.session.messages[-1] == {"role": "assistant", "content": "Going on."}


async def regenerating_until_esc(app, pilot) -> list[dict]:
    """A chat with one reply, being regenerated by a reply that goes on until Esc; its messages before."""
    await loaded(pilot)
    use_script(app.chat.engine, ScriptedReply("The whole first answer."))
    await send(pilot, "Tell me")
    before = [dict(m) for m in app.chat.session.messages]
    use_script(app.chat.engine, ScriptedReply(REPLY, DRAFTED, endless=True, pause_s=0.002))
    app.action_regenerate()
    await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
    return before


@pilot_test
async def test_a_regeneration_stopped_keeps_the_reply_it_was_to_replace(models):
    # Ctrl+R then Esc left only the new reply's first words, marked stopped: the whole answer was gone
    app = make_app(models, max_tokens=3000, n_ctx=4096)
    async with app.run_test(size=SIZE) as pilot:
        before = await regenerating_until_esc(app, pilot)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.generation is None)
        assert app.chat.session.messages == before
        assert [reply.reply.text for reply in replies(app)] == ["The whole first answer."]
        assert "the reply before it is kept" in str(app.query(Note).last().render())
        assert app.store.load_chat(app.chat.chat_id).session["messages"] == before


@pilot_test
async def test_an_esc_right_after_enter_leaves_the_message_unanswered_with_no_empty_reply_saved(models):
    # An Esc before the generation thread began the reply was lost (making the session's stream clears its
    # cancel), and one before the first token saved an empty reply, marked stopped, as the answer
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply(REPLY))
        app.on_prompt_input_submitted(PromptInput.Submitted("Tell me"))
        app.action_cancel()  # this coroutine has not yielded since: the worker thread has not begun the reply
        await wait_for(pilot, lambda: app.generation is None)
        assert app.chat.session.messages == [{"role": "user", "content": "Tell me"}] and not replies(app)
        assert "stopped before the reply began" in str(app.query(Note).last().render())
        saved = app.store.load_chat(app.chat.chat_id)
        assert saved.session["messages"] == app.chat.session.messages and saved.extras["pending_prompt"] is None
        app.action_regenerate()  # answers the message left unanswered
        await wait_for(pilot, lambda: app.generation is None)
        assert app.chat.session.messages[-1] == {"role": "assistant", "content": REPLY}


@pilot_test
async def test_settings_applied_during_a_regeneration_keep_the_stored_reply(models):
    # Apply saved the chat at once, the reply being replaced set aside: a kill before the new one ended lost both
    app = make_app(models, max_tokens=3000, n_ctx=4096)
    async with app.run_test(size=SIZE) as pilot:
        before = await regenerating_until_esc(app, pilot)
        # actions and button presses, not pilot.press or click: they wait for widgets that stream to go idle
        app.action_settings()
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.query("#apply"))
        app.screen.query_one("#temperature").value = "0.5"
        app.screen.query_one("#apply").press()
        await wait_for(pilot, lambda: app.chat.settings.sampling.temperature == 0.5)
        still_regenerating = app.generation is not None
        stored_meanwhile = app.store.load_chat(app.chat.chat_id).session["messages"]
        await pilot.press("escape")  # before any assert: an endless reply left running holds the test's loop
        await wait_for(pilot, lambda: app.generation is None)
        assert still_regenerating and stored_meanwhile == before
        stored = app.store.load_chat(app.chat.chat_id)
        assert stored.session["messages"] == before and stored.settings["sampling"]["temperature"] == 0.5


@pilot_test
async def test_regenerate_mode_switch_and_new_chat(models):
    # bit-exact at T = 0: every reply is plain decoding's, so a regenerated one is the same
    app = make_app(models, keymap={"regenerate": "f5"}, bit_exact=True)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        first = app.chat.session.messages[-1]["content"]

        await pilot.press("f5")  # rebound in the keymap
        await wait_for(pilot, lambda: app.generation is None)
        assert [m["role"] for m in app.chat.session.messages] == ["user", "assistant"]
        assert len(replies(app)) == 1
        assert app.chat.session.messages[-1]["content"] == first

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
        await pilot.press("ctrl+g")
        assert app.chat.engine.mode == "combined"  # n-grams or the draft model, per step
        await send(pilot, "hello")
        assert app.chat.shown_stats.mode == "combined"

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.session.messages == [] and not replies(app) and app.chat.chat_id is None


@pilot_test
async def test_a_new_chat_starts_from_the_default_system_prompt_seed_and_stop_strings(models):
    # Ctrl+N carried a chat's seed, stop strings and system prompt into the next, unrelated chat without a word
    app = make_app(models, system_prompt="You are terse.", temperature=0.5)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        chat_own = dataclasses.replace(app.chat.settings, system_prompt="Talk like a pirate.", sampling=dataclasses.replace(
            app.chat.settings.sampling, seed=42, stop=("zebra",), temperature=0.9))
        app.apply_settings(chat_own)
        await pilot.press("ctrl+n")
        await pilot.pause()
        settings = app.chat.settings
        assert (settings.system_prompt, settings.sampling.seed, settings.sampling.stop) == ("You are terse.", None, ())
        assert app.chat.session.system_prompt == "You are terse."
        assert settings.sampling.temperature == 0.9, "the rest of the settings go on"


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
    config_path().parent.mkdir(parents=True, exist_ok=True)
    config_path().write_text('[keymap]\nhelp = "f9"\n')  # the file's own, which saving keeps
    app = make_app(models, n_ctx=1024)  # the model, draft and n_ctx given for this run, as flags give them
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        assert app.focused is app.screen.query_one("#system-prompt")  # typing goes somewhere at once
        app.screen.query_one("#temperature").value = "0.5"
        app.screen.query_one("#draft-tokens").value = "6"
        app.screen.query_one("#system-prompt").load_text("Be brief.")
        await pilot.click("#save")
        await pilot.pause()
        assert app.chat.settings.sampling.temperature == 0.5
        assert app.chat.engine.draft_tokens == 6
        text = config_path().read_text()
        assert "temperature = 0.5" in text and "draft_tokens = 6" in text and 'system_prompt = "Be brief."' in text
        assert 'help = "f9"' in text and "n_ctx = 1024" not in text
        assert str(models["target"]) not in text and str(models["draft"]) not in text
        await pilot.press("ctrl+n")  # a new chat starts from the defaults just saved
        await pilot.pause()
        assert app.chat.session.system_prompt == "Be brief." and app.chat.settings.sampling.temperature == 0.5

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
        flash_attention_engine = app.chat.engine
        assert flash_attention_engine.flash_attn  # flash_attn "auto": on until bit-exact is asked for
        app.screen.query_one("#apply").press()
        await pilot.pause()
        sampling = app.chat.settings.sampling
        assert (sampling.min_p, sampling.seed, sampling.stop) == (0.1, 1234, ("cat\nsat", "END"))
        await wait_for(pilot, lambda: app.chat.engine is not flash_attention_engine)  # the models load again
        assert not app.chat.engine.flash_attn
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
        if which == "mismatch":  # the chat app names the fix as the command line does
            assert "or --draft ngram)" in str(notice.render())
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
        assert app.prompt_input.cursor_location == app.prompt_input.document.end
        app.prompt_input.load_text("")
        await pilot.pause()  # the input shrinks back before send() clicks it
        await send(pilot, "hi")  # still usable
        assert replies(app)


@pilot_test
async def test_a_failing_chat_template_names_a_fix_the_chat_user_has(tmp_path):
    # the note said "use --raw", a flag the chat does not have
    broken = write_tiny_model(tmp_path / "broken.gguf", seed=3, chat_template="{{ 1 / 0 }}")
    app = make_app({"target": broken, "draft": broken}, draft="none")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "hi")
        note = str(app.query(Note).last().render())
        assert "the model's chat template failed: ZeroDivisionError" in note
        assert "(use edgespec run --raw to send the prompt as is)" in note
        assert not replies(app)


@pilot_test
async def test_a_full_context_drops_the_oldest_turns_with_a_note(models):
    app = make_app(models, n_ctx=256)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply("The mat is warm and the cat is asleep on it. " * 2))
        for turn in range(4):
            app.prompt_input.load_text(f"turn {turn}: " + "the cat sat on the mat " * 8)
            await send(pilot, "")
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("left the oldest" in note for note in notes), notes
        assert len(replies(app)) == 4 and app.chat.session.messages[-1]["role"] == "assistant"


@pilot_test
async def test_the_kv_cache_settings_load_the_models_with_them_and_say_what_they_trade(models):
    app = make_app(models, kv_type="q8_0", draft_kv_type="f16", flash_attn="off")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        engine = app.chat.engine
        assert (engine.target.type_k, engine.target.type_v, engine.draft_model.type_k) == ("q8_0", "f16", "f16")
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("keys only" in note for note in notes), notes
        await send(pilot, "Hello world")
        assert replies(app)


async def an_endless_reply_streaming(pilot):
    """Send a prompt whose scripted reply streams until stopped; its stream, once text has arrived."""
    app = pilot.app
    await loaded(pilot)
    use_script(app.chat.engine, ScriptedReply(REPLY, endless=True, pause_s=0.002))
    app.prompt_input.load_text("Tell me everything")
    app.prompt_input.action_submit()  # not a press, which waits for the app to go idle
    await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
    return app.generation.stream


def assert_the_stopped_reply_is_saved(app, stream) -> None:
    """The app's one chat holds the prompt and the reply stream wrote, marked cancelled, and no pending prompt."""
    [chat] = app.store.list_chats()
    saved = app.store.load_chat(chat.id)
    messages = saved.session["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1].get("cancelled") is True
    assert messages[1]["content"] == stream.result.text != "" and saved.extras["pending_prompt"] is None


@pilot_test
async def test_copying_mid_reply_copies_nothing_but_says_so(models):
    # Ctrl+L copied the reply before the one on screen, as if it were that one
    app = make_app(models, max_tokens=3000)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            use_script(app.chat.engine, ScriptedReply("An earlier reply."))
            await send(pilot, "Hello")
            app.copy_to_clipboard("")
            await an_endless_reply_streaming(pilot)
            app.action_copy_reply()
            assert app.clipboard == ""
            app.chat.session.cancel()
            await wait_for(pilot, lambda: app.generation is None)
    finally:
        app.close_engine()


@pilot_test
async def test_a_reply_is_saved_as_it_streams_so_that_a_kill_keeps_it(models, monkeypatch):
    # A kill -9, the OOM killer or a power cut mid-reply lost all of it: it was saved only at its end
    monkeypatch.setattr(tui_app, "PARTIAL_SAVE_SECONDS", 0.0)
    app = make_app(models, max_tokens=3000)

    def stored() -> list[dict]:
        return app.store.load_chat(app.chat.chat_id).session["messages"]

    async with app.run_test(size=SIZE) as pilot:
        try:
            await an_endless_reply_streaming(pilot)
            await wait_for(pilot, lambda: len(stored()) == 2)  # saved at a Progress, while it streams
            saved = stored()[1]
            assert saved["cancelled"] is True and app.generation.view.reply.text.startswith(saved["content"])
            labels = app.store.load_chat(app.chat.chat_id).extras["labels"]  # its title, for a reopening
            assert list(labels.values()) == [str(app.generation.view.border_title)]
        finally:
            app.chat.session.cancel()  # an endless reply left running would hold the test open
        await wait_for(pilot, lambda: app.generation is None)
        assert stored() == app.chat.session.messages and len(stored()) == 2  # the stopped reply, once

        before = stored()
        use_script(app.chat.engine, ScriptedReply(REPLY, endless=True, pause_s=0.002))
        app.action_regenerate()
        try:
            await wait_for(pilot, lambda: app.generation.view.reply.text)
            app._save_reply_so_far()
            assert stored() == before, "a regeneration keeps the reply it replaces stored until it ends"
        finally:
            app.chat.session.cancel()
        await wait_for(pilot, lambda: app.generation is None)


@pilot_test
async def test_quitting_mid_reply_stops_the_worker_and_frees_the_models(models):
    app = make_app(models, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        stream = await an_endless_reply_streaming(pilot)
        await pilot.press("ctrl+q")
    app.close_engine()  # waits for the worker (up to 30 s) before it frees the models
    assert stream.finished.is_set() and stream.result.finish_reason == "cancelled"
    assert app.chat.engine is None
    assert_the_stopped_reply_is_saved(app, stream)  # the reply on screen is kept, as an Esc keeps it


@pilot_test
async def test_quitting_mid_reply_saves_the_reply_and_the_typed_text_before_the_app_ends(models):
    # Saved only after the app had ended, they were lost when Textual's shutdown hung on a closed terminal.
    app = make_app(models, max_tokens=3000)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await an_endless_reply_streaming(pilot)
            app.prompt_input.load_text("and one more thing")
            await pilot.press("ctrl+q")
            [chat] = app.store.list_chats()
            messages = app.store.load_chat(chat.id).session["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1].get("cancelled") is True
            assert app.kept_at is not None
    finally:
        app.close_engine()
    assert app.store.take_unsent() == "and one more thing" and app.store.take_unsent() is None  # kept once


@pytest.mark.skipif(not STOP_SIGNALS, reason="no SIGHUP or SIGTERM here")
@pytest.mark.parametrize("stop_signal", STOP_SIGNALS)
@pilot_test
async def test_a_closed_terminal_or_kill_mid_reply_keeps_the_reply(models, stop_signal):
    # Their default ended the process with the reply on screen unsaved: only the pending prompt was stored.
    app = make_app(models, max_tokens=3000)
    number = getattr(signal, stop_signal)
    unhandled = []
    # Should the app not take the signal, it lands here instead of ending the test run.
    previous = signal.signal(number, lambda *_: unhandled.append(number))
    try:
        async with app.run_test(size=SIZE) as pilot:
            stream = await an_endless_reply_streaming(pilot)
            try:
                os.kill(os.getpid(), number)
                await wait_for(pilot, lambda: stream.finished.is_set() or unhandled, timeout=30)
            finally:
                app.chat.session.cancel()  # else leaving a failed test would wait for the endless reply
        assert not unhandled, "the app did not handle the signal"
        assert app.stop_signal == number  # so `edgespec chat` exits with 128 + number, as the signal would have
        assert signal.getsignal(number) is signal.SIG_DFL  # the app took its handler away as it ended
    finally:
        signal.signal(number, previous)
    app.close_engine()
    assert stream.result.finish_reason == "cancelled" and app.chat.engine is None
    assert_the_stopped_reply_is_saved(app, stream)


@pilot_test
async def test_a_half_written_message_is_back_in_the_input_at_the_next_start(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("half a question\nwith a second line")
        await pilot.press("ctrl+q")
    assert app.chat.session.messages == []  # quitting sent nothing

    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.prompt_input.text == "half a question\nwith a second line"
        # at the start, what was typed next went before it: "xhalf a question"
        assert app.prompt_input.cursor_location == app.prompt_input.document.end
        assert "back in the input" in str(app.query(Note).first().render())
        app.prompt_input.load_text("")  # the user decides against it
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:  # taken at the start: an input cleared since stays clear
        await loaded(pilot)
        assert app.prompt_input.text == ""
        assert not [note for note in app.query(Note) if "back in the input" in str(note.render())]


@pilot_test
async def test_reopening_a_chat_whose_prompt_got_no_reply_keeps_what_is_being_written(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        app.chat.save(pending_prompt="never answered")  # as sending does, just before a reply that a kill cut off
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text("my own draft")
        await pilot.press("ctrl+o")
        await pilot.press("enter")
        await pilot.pause()
        assert app.prompt_input.text == "my own draft"
        assert "Up on the input's first line brings it back" in str(app.query(Note).last().render())
        app.prompt_input.load_text("")


@pilot_test
async def test_a_notice_said_after_loading_is_shown_as_a_note(models):
    # Notices came only through the loading panel: one said later (a damaged learned-priors file, read at the
    # first reply) was dropped.
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.post_message(EngineHost.Status("the learned priors in x are not read: it is not JSON"))
        await wait_for(pilot, lambda: any("are not read" in str(note.render()) for note in app.query(Note)))


@pilot_test
async def test_a_mode_chosen_mid_reply_shows_in_the_stats_bar_once_the_reply_ends(models):
    # The bar switched at once, beside a reply still drafting in the old mode and a notice saying "from the next".
    app = make_app(models, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        stream = await an_endless_reply_streaming(pilot)
        before = app.stats_bar.models.mode
        try:
            await pilot.press("ctrl+g")
            assert app.chat.engine.mode != before and app.stats_bar.models.mode == before
        finally:
            app.chat.session.cancel()
        await wait_for(pilot, lambda: stream.finished.is_set() and app.generation is None)
        assert app.stats_bar.models.mode == app.chat.engine.mode != before


@pilot_test
async def test_ctrl_c_stops_a_reply_and_keeps_the_app(models):
    app = make_app(models, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        stream = await an_endless_reply_streaming(pilot)
        await pilot.press("ctrl+c")  # with the prompt focused, as it is after sending
        await wait_for(pilot, lambda: app.generation is None)
        assert stream.result.finish_reason == "cancelled" and app.is_running
        assert app.chat.session.messages[-1].get("cancelled") is True


@pilot_test
async def test_the_first_load_says_it_measures_the_models_speed(models):
    app = make_app(models, cost_curve=None)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        notes = [str(note.render()) for note in app.query(Note)]
        assert any("measuring this model's speed, once" in note for note in notes), notes
        # kept after the load, it said "..." as if still measuring: the app was taken for hung
        assert any(note.startswith("measuring this model's speed, once") and note.endswith("... done")
                   for note in notes), notes


@pilot_test
async def test_a_short_plain_reply_does_not_become_the_plain_speed(models):
    """Ten tokens (here fast; in the field once 10 tokens in 34.7 s, cancelled on a busy machine)
    are too few to say how fast plain decoding is: the calibrated pass stands until there are enough."""
    app = make_app(models, cost_curve=None, draft="none", max_tokens=10)
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

    app = make_app(models, cost_curve=None, flash_attn="off")  # the probe's KV cache setup
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat.engine.exact_width == 3, "the chat started on the old measurement"
        assert not any("measuring" in str(note.render()) for note in app.query(Note))
        await wait_for(pilot, lambda: not app.chat.engine.calibration_due and not app.host.measuring)
        assert app.chat.engine.plain_step_seconds < 1000.0 and cache.load_entry(key) is not None
        await send(pilot, "Hello world")  # the chat goes on with the new measurement
        assert replies(app)
