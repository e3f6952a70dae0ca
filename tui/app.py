"""edgespec chat: a Textual chat app that shows speculative decoding at work.

Inference runs in a worker thread.  The thread only appends tokens and stats
to a locked hand-off (`_Stream`); a UI timer drains it a dozen times a
second, so the UI never waits for the model and the model never waits for
the UI.  Entry point: `run_chat`.
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header

from edgespec import ChatSession, Done, EdgespecError, Engine, Notice, Step, models
from edgespec.drafters import MODES
from edgespec.gguf_info import read_gguf_info
from edgespec.planner import format_plan_table
from edgespec.stats import Stats
from tui import stats as stats_text
from tui.config import KEY_ACTIONS, ChatConfig, load_config, save_defaults
from tui.history import ChatStore
from tui.render import BlockRenderer
from tui.screens import (ChatSettings, HistoryScreen, LoadModelScreen, ModelInfoScreen,
                         SettingsScreen, gguf_table)
from tui.widgets import AssistantMessage, LoadingPanel, Note, PromptInput, StatsBar, UserMessage

DRAIN_INTERVAL_S = 1 / 12
STATS_INTERVAL_S = 0.25
SPARKLINE_STEPS = 80
FOOTER_ACTIONS = ("cancel", "regenerate", "new_chat", "cycle_mode", "toggle_marks", "settings", "help")


class _Stream:
    """Hand-off from the generation thread to the UI thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pieces: list[tuple[str, bool]] = []
        self._acceptance: list[float] = []
        self._notices: list[str] = []
        self._stats: Stats | None = None
        self.result = None  # the GenerationResult, once Done arrived
        self.error: str | None = None
        self.finished = threading.Event()

    def add_step(self, step: Step, acceptance: float | None) -> None:
        with self._lock:
            self._pieces.extend((token.text, token.drafted) for token in step.tokens if token.text)
            if acceptance is not None:
                self._acceptance.append(acceptance)
            self._stats = step.stats

    def add_notice(self, text: str) -> None:
        with self._lock:
            self._notices.append(text)

    def take(self) -> tuple[list[tuple[str, bool]], list[float], list[str], Stats | None]:
        with self._lock:
            taken = self._pieces, self._acceptance, self._notices, self._stats
            self._pieces, self._acceptance, self._notices, self._stats = [], [], [], None
        return taken


@dataclass
class _Generation:
    stream: _Stream
    view: AssistantMessage


class GenerationEnded(Message):
    """Posted by the generation thread so the UI finishes without waiting for the next tick."""


class ChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "edgespec chat"
    BINDINGS = [
        Binding(keys, action, description, id=f"edgespec.{action}", show=action in FOOTER_ACTIONS)
        for action, (keys, description) in KEY_ACTIONS.items()
    ]

    def __init__(self, config: ChatConfig, store: ChatStore, *, n_threads: int | None = None,
                 cost_curve: tuple[float, ...] | None = None):
        """cost_curve fixes the engine's cost curve (see Engine.calibrate) instead of measuring it."""
        super().__init__()
        self.config = config
        self.store = store
        self.n_threads = n_threads
        self.cost_curve = cost_curve
        self.engine: Engine | None = None
        self.session: ChatSession | None = None
        self.settings = ChatSettings(config.system_prompt, config.sampling(), config.draft_tokens)
        self.chat_id: int | None = None
        self.drafted_marks: dict[str, list] = {}  # reply content key -> drafted character ranges
        self.generation: _Generation | None = None
        self.mark_drafts = True
        self.renderer = BlockRenderer(config.draft_tint)
        self.shown_stats: Stats | None = None  # live stats of the running reply, or the last reply's
        self.context_used = 0
        self.acceptance: deque[float] = deque(maxlen=SPARKLINE_STEPS)
        self.model_spec = (config.model or "", config.draft)
        self._loading: tuple[LoadingPanel, float] | None = None
        self._stats_dirty = True
        self.plain_steps = stats_text.PlainSpeedEstimate()  # of the loaded target
        self._recalibration_idle = threading.Event()  # cleared while the engine re-measures its speed
        self._recalibration_idle.set()

    # -- layout ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as attributes: queries go to the active screen, which may be a dialog.
        self.conversation = VerticalScroll(id="conversation")
        self.stats_bar = StatsBar()
        self.prompt_input = PromptInput(self.store.recent_prompts(), id="prompt")
        yield Header()
        yield self.conversation
        yield self.stats_bar
        yield self.prompt_input
        yield Footer()

    def on_mount(self) -> None:
        keymap = {f"edgespec.{action}": keys for action, keys in self.config.keymap.items()}
        if keymap:
            self.set_keymap(keymap)
        self.conversation.anchor()
        for notice in self.store.notices:  # e.g. a damaged history was moved aside at start-up
            self._history_notice(notice)
        self.store.on_notice = self._history_notice
        self.set_interval(DRAIN_INTERVAL_S, self._drain)
        self.set_interval(STATS_INTERVAL_S, self._refresh_stats)
        self.prompt_input.focus()
        self.load_models(*self.model_spec)

    def _history_notice(self, text: str) -> None:
        self.conversation.mount(Note(text, "note"))

    # -- loading models --------------------------------------------------------------

    def load_models(self, model: str, draft: str) -> None:
        if self.generation is not None:
            self.notify("Wait for the reply to finish (Esc stops it) before loading models.", severity="warning")
            return
        self.model_spec = (model, draft)
        panel = LoadingPanel(f"Loading {model or 'the default model'} (draft: {draft})…")
        self._loading = (panel, time.monotonic())
        self.conversation.mount(panel)
        self._stats_dirty = True
        self._load_worker(model, draft)

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, model: str, draft: str) -> None:
        notices: list[str] = []

        def notice(text: str) -> None:  # e.g. "measuring this model's speed": shown while it happens
            notices.append(text)
            self.call_from_thread(self._loading_status, text)

        self._recalibration_idle.wait()  # the old engine may still be measuring; it is closed after this
        try:
            # A stale speed measurement is re-measured after loading, between replies, not here.
            engine = Engine.load(
                model or models.default_pair()[0], draft, pull=False, n_ctx=self.config.n_ctx, n_gpu_layers=self.config.gpu_layers,
                draft_gpu_layers=self.config.draft_gpu_layers, draft_tokens=self.settings.draft_tokens,
                n_threads=self.n_threads, memory_budget=self.config.memory_budget, notice=notice,
                cost_curve=self.cost_curve, measure_stale_curve=False)
        except EdgespecError as error:
            self.call_from_thread(self._load_failed, str(error), notices)
        except Exception as error:  # a bug must not end the app with a traceback
            self.log.error(traceback.format_exc())
            self.call_from_thread(self._load_failed, f"loading failed: {type(error).__name__}: {error}", notices)
        else:
            self.call_from_thread(self._engine_ready, engine, notices)

    def _loading_status(self, text: str) -> None:
        if self._loading is not None:
            self._loading[0].show_status(text)

    def _end_loading(self, notices: list[str]) -> None:
        if self._loading is not None:
            self._loading[0].remove()
            self._loading = None
        for notice in notices:
            self.conversation.mount(Note(notice, "note"))

    def _load_failed(self, message: str, notices: list[str]) -> None:
        self._end_loading(notices)
        self.conversation.mount(Note(
            f"Could not load the model: {message}\n"
            "Open the command palette (Ctrl+P) and choose “Load model…” to try another file."))
        self._stats_dirty = True

    def _engine_ready(self, engine: Engine, notices: list[str]) -> None:
        self._end_loading(notices)
        previous = self.session.to_dict() if self.session is not None else None
        if self.engine is not None:
            self.engine.close()
        self.engine = engine
        self.plain_steps = stats_text.PlainSpeedEstimate()
        if previous is not None:  # the chat goes on with the new models
            self.session = ChatSession.from_dict(engine, previous)
        else:
            self.session = ChatSession(engine, system_prompt=self.settings.system_prompt or None)
        self.sub_title = stats_text.model_name(engine.target_path)
        self._stats_dirty = True
        self.refresh_bindings()
        self._recalibrate_if_due()

    # -- re-measuring the engine's speed between replies ------------------------------------

    def _recalibrate_if_due(self) -> None:
        """Re-measure a stale cost curve in the background while no reply runs; the chat can
        start at once on the old curve, and a reply sent meanwhile waits a few seconds."""
        engine = self.engine
        if engine is None or self._loading is not None or self.generation is not None:
            return
        if not engine.calibration_due or not self._recalibration_idle.is_set():
            return
        self._recalibration_idle.clear()
        self._stats_dirty = True
        self._recalibrate(engine)

    @work(thread=True, group="calibrate")
    def _recalibrate(self, engine: Engine) -> None:
        try:
            engine.recalibrate()  # takes the engine's lock: never inside a reply
        except Exception:  # the old curve stays; a failed measurement must not end the app
            self.log.error(traceback.format_exc())
        finally:
            self._recalibration_idle.set()
            self._stats_dirty = True

    def close_engine(self) -> None:
        """Stop a running reply and free the models (call after the app has exited)."""
        if self.generation is not None and self.session is not None:
            self.session.cancel()
            self.generation.stream.finished.wait(timeout=30)
        self._recalibration_idle.wait(timeout=30)
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- sending and streaming -----------------------------------------------------------

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self._busy():
            return
        self.prompt_input.remember(event.text)
        self.prompt_input.load_text("")
        self.store.add_prompt(event.text)
        self._save(pending_prompt=event.text)
        self.conversation.mount(UserMessage(event.text))
        self._start(lambda: self.session.stream(event.text, self.settings.sampling))

    def _start(self, events: Callable[[], Iterator]) -> None:
        view = AssistantMessage(self.renderer, self.mark_drafts, self._reply_title())
        self.conversation.mount(view)
        self.conversation.anchor()
        self.generation = _Generation(_Stream(), view)
        self.acceptance.clear()
        self.shown_stats = None
        self.refresh_bindings()
        self._generate(self.generation.stream, events)

    def _reply_title(self) -> str:
        return f"{stats_text.model_name(self.engine.target_path)} · {stats_text.MODE_LABELS[self.engine.mode]}"

    @work(thread=True, group="generate")
    def _generate(self, stream: _Stream, events: Callable[[], Iterator]) -> None:
        decode_seconds = 0.0  # of the reply so far, to time each step
        plain_steps = self.plain_steps
        try:
            for event in events():
                if isinstance(event, Step):
                    stream.add_step(event, stats_text.step_acceptance(event.drafted, event.accepted))
                    plain_steps.observe(event.drafted, event.stats.decode_seconds - decode_seconds)
                    decode_seconds = event.stats.decode_seconds
                elif isinstance(event, Done):
                    stream.result = event.result
                elif isinstance(event, Notice):
                    stream.add_notice(event.text)
        except EdgespecError as error:
            stream.error = str(error)
        except Exception as error:  # a bug must not end the app with a traceback
            self.log.error(traceback.format_exc())
            stream.error = f"generation failed: {type(error).__name__}: {error}"
        finally:
            stream.finished.set()
            self.post_message(GenerationEnded())

    def _drain(self) -> None:
        generation = self.generation
        if generation is None:
            return
        finished = generation.stream.finished.is_set()  # read first: then nothing can follow the take
        pieces, acceptance, notices, live = generation.stream.take()
        for notice in notices:
            self.conversation.mount(Note(notice, "note"), before=generation.view)
        if pieces:
            generation.view.reply.append(pieces)
        self.acceptance.extend(acceptance)
        if live is not None:
            self.shown_stats = live
            self.context_used = stats_text.context_used(live)
            self._stats_dirty = True
        if finished:
            self._finish(generation)

    def on_generation_ended(self, _: GenerationEnded) -> None:
        self._drain()

    def _finish(self, generation: _Generation) -> None:
        self.generation = None
        stream = generation.stream
        self._stats_dirty = True
        self.refresh_bindings()
        if stream.error is not None or stream.result is None:
            self._rebuild_conversation()
            self.conversation.mount(Note(stream.error or "the reply ended without a result"))
            self._save()
            return
        result = stream.result
        reply = generation.view.reply
        if reply.text != result.text:  # e.g. a stop string cut text that was already shown
            reply.set_text(result.text, reply.drafted_ranges())
        self.shown_stats = result.stats
        self.context_used = stats_text.context_used(result.stats)
        self.drafted_marks[_content_key(result.text)] = reply.drafted_ranges()
        generation.view.footer.update(stats_text.reply_footer(result.stats, self.plain_speed()))
        self._save()
        self._recalibrate_if_due()

    def plain_speed(self) -> tuple[float, str] | None:
        """This model's plain decoding speed in tok/s, and where it comes from.

        The median of the steps that drafted nothing (any mode) measures it
        best, once there are enough of them; until then the engine's
        calibrated one-token target pass stands in (None for a given curve).
        """
        if self.engine is None:
            return None
        measured = self.plain_steps.tokens_per_second()
        if measured is not None:
            return measured, "measured"
        seconds = self.engine.plain_step_seconds
        return (1 / seconds, "calibrated") if seconds else None

    def _last_reply_text(self) -> str:
        for message in reversed(self.session.messages):
            if message["role"] == "assistant":
                return message["content"]
        return ""

    # -- the stats bar ---------------------------------------------------------------------

    def _refresh_stats(self) -> None:
        if self._loading is not None:
            panel, started = self._loading
            panel.show_elapsed(time.monotonic() - started)
        if not self._stats_dirty:
            return
        self._stats_dirty = False
        if self.engine is None:
            self.stats_bar.show(Text("loading models…" if self._loading else "no model loaded"), [])
            return
        measuring = not self._recalibration_idle.is_set()
        line = stats_text.stats_line(
            mode=self.engine.mode,
            target=stats_text.model_name(self.engine.target_path),
            draft=stats_text.model_name(self.engine.draft_path) if self.engine.draft_path else None,
            stats=self.shown_stats,
            draft_tokens=self.engine.draft_tokens,
            context_used=self.context_used,
            n_ctx=self.engine.n_ctx,
            status="measuring speed…" if measuring else None,
        )
        self.stats_bar.show(line, list(self.acceptance))

    # -- saving and reopening chats -------------------------------------------------------

    def _save(self, pending_prompt: str | None = None) -> None:
        """Write the chat in one transaction: after each reply, and with the prompt before it."""
        if self.session is None:
            return
        first_user = next((m["content"] for m in self.session.messages if m["role"] == "user"), pending_prompt)
        if first_user is None:
            return
        replies = {_content_key(m["content"]) for m in self.session.messages if m["role"] == "assistant"}
        self.drafted_marks = {k: v for k, v in self.drafted_marks.items() if k in replies}
        extras = {"drafted": self.drafted_marks, "pending_prompt": pending_prompt}
        settings = dict(self.settings.as_dict(), mode=self.engine.mode)
        title = first_user.strip().splitlines()[0][:80]
        self.chat_id = self.store.save_chat(self.chat_id, title, str(self.engine.target_path),
                                            settings, self.session.to_dict(), extras)

    def _rebuild_conversation(self) -> None:
        """Show the session's messages as they are now (after reopening, or after an error)."""
        self.conversation.remove_children()
        if self.session.system_prompt:
            self.conversation.mount(Note(f"system prompt: {self.session.system_prompt}", "note"))
        plain = self.plain_speed()
        stats_by_message = {s["message_index"]: Stats.from_dict(s) for s in self.session.turn_stats}
        for index, message in enumerate(self.session.messages):
            if message["role"] == "user":
                self.conversation.mount(UserMessage(message["content"]))
                continue
            view = AssistantMessage(self.renderer, self.mark_drafts, "reply")
            self.conversation.mount(view)
            view.reply.set_text(message["content"], self.drafted_marks.get(_content_key(message["content"]), []))
            if index in stats_by_message:
                view.footer.update(stats_text.reply_footer(stats_by_message[index], plain))
        self.conversation.anchor()

    def open_chat(self, chat_id: int) -> None:
        stored = self.store.load_chat(chat_id)
        self.session = ChatSession.from_dict(self.engine, stored.session)
        self.chat_id = stored.id
        self.drafted_marks = dict(stored.extras.get("drafted", {}))
        self._apply_settings(ChatSettings.from_dict(stored.settings, self.session.system_prompt or "", self.settings))
        if stored.settings.get("mode") in self._available_modes():
            self.engine.configure(mode=stored.settings["mode"])
        self.shown_stats = None
        self.acceptance.clear()
        visible = self.session.visible_messages()
        self.context_used = len(self.engine.chat_tokens(visible)) if visible else 0
        self._rebuild_conversation()
        if stored.target != str(self.engine.target_path):
            self.conversation.mount(Note(
                f"This chat was with {stats_text.model_name(stored.target)}; it continues with "
                f"{stats_text.model_name(self.engine.target_path)}.", "note"))
        pending = stored.extras.get("pending_prompt")
        if pending:
            self.prompt_input.load_text(pending)
            self.conversation.mount(Note("The last prompt got no reply before edgespec stopped; "
                                         "it is back in the input.", "note"))
        self._stats_dirty = True

    def _apply_settings(self, settings: ChatSettings) -> None:
        if self.session is not None:
            self.session.set_system_prompt(settings.system_prompt or None)
        self.settings = settings
        if self.engine is not None:
            self.engine.configure(draft_tokens=settings.draft_tokens)
        self._stats_dirty = True

    # -- actions ----------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "cancel":
            return True if self.generation is not None else None
        if action in ("regenerate", "new_chat", "cycle_mode", "history", "copy_reply"):
            return True if self.session is not None else None
        return True

    def action_cancel(self) -> None:
        if self.generation is not None:
            self.session.cancel()

    def action_regenerate(self) -> None:
        if self._busy():
            return
        messages = self.session.messages
        if not messages:
            self.notify("Nothing to regenerate yet.")
            return
        if messages[-1]["role"] == "assistant":
            self.conversation.query(AssistantMessage).last().remove()
            self._start(lambda: self.session.stream_regenerate(self.settings.sampling))
        else:  # the last reply failed: answer the prompt that is still there
            self._start(lambda: self.session.stream_reply(self.settings.sampling))

    def action_new_chat(self) -> None:
        if self._busy():
            return
        self.session = ChatSession(self.engine, system_prompt=self.settings.system_prompt or None)
        self.chat_id = None
        self.drafted_marks = {}
        self.shown_stats = None
        self.context_used = 0
        self.acceptance.clear()
        self.conversation.remove_children()
        self._stats_dirty = True
        self.prompt_input.focus()

    def action_copy_reply(self) -> None:
        text = self._last_reply_text() if self.session else ""
        if not text:
            self.notify("No reply to copy yet.")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last reply ({len(text)} characters).")

    def _available_modes(self) -> list[str]:
        return [mode for mode in MODES if mode != "draft-model" or self.engine.draft_path is not None]

    def action_cycle_mode(self) -> None:
        if self.engine is None:
            return
        modes = self._available_modes()
        self.set_mode(modes[(modes.index(self.engine.mode) + 1) % len(modes)])

    def set_mode(self, mode: str) -> None:
        if mode not in self._available_modes():
            self.notify("No draft model is loaded; use “Load model…” with a draft.", severity="warning")
            return
        self.engine.configure(mode=mode)
        when = " from the next reply" if self.generation is not None else ""
        self.notify(f"Drafting: {stats_text.MODE_LABELS[mode]}{when}.")
        self._stats_dirty = True

    def action_toggle_marks(self) -> None:
        self.mark_drafts = not self.mark_drafts
        for message in self.conversation.query(AssistantMessage):
            message.reply.set_marking(self.mark_drafts)
        self.notify("Draft marks on: tinted text came from accepted draft tokens."
                    if self.mark_drafts else "Draft marks off.")

    def action_history(self) -> None:
        if self._busy():
            return

        def reopen(chat_id: int | None) -> None:
            if chat_id is not None:
                try:
                    self.open_chat(chat_id)
                except EdgespecError as error:  # e.g. the stored chat is damaged
                    self.notify(str(error), severity="error")

        self.push_screen(HistoryScreen(self.store.list_chats(), self._delete_chat), reopen)

    def _delete_chat(self, chat_id: int) -> None:
        self.store.delete_chat(chat_id)
        if chat_id == self.chat_id:
            self.chat_id = None

    def action_settings(self) -> None:
        def apply(answer: tuple[ChatSettings, bool] | None) -> None:
            if answer is None:
                return
            settings, save = answer
            self._apply_settings(settings)
            if save:
                sampling = settings.sampling
                self.config = replace(
                    self.config, system_prompt=settings.system_prompt, draft_tokens=settings.draft_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    max_tokens=sampling.max_tokens)
                self.notify(f"Saved as defaults in {save_defaults(self.config)}.")
            self._save()

        self.push_screen(SettingsScreen(self.settings), apply)

    def action_model_info(self) -> None:
        self.push_screen(ModelInfoScreen(self._model_info()))

    def _model_info(self) -> list:
        if self.engine is None:
            return ["No model is loaded."]
        plain = self.plain_speed()
        plain_line = (f"Plain decoding: {plain[0]:.1f} tok/s ({plain[1]})" if plain else
                      f"Plain decoding: n/a (it takes {self.plain_steps.min_steps} steps without drafting: "
                      "switch drafting to none and send a prompt)")
        lines = [
            f"Drafting now: {stats_text.MODE_LABELS[self.engine.mode]}; draft tokens per step: "
            f"{self.engine.draft_tokens}; context: {self.engine.n_ctx:,} tokens",
            f"Target: {stats_text.display_path(self.engine.target_path)}",
            *([f"Draft: {stats_text.display_path(self.engine.draft_path)}"] if self.engine.draft_path else []),
            plain_line,
        ]
        renderables: list = ["\n".join(lines)]
        if self.engine.plan is not None:
            renderables.append(format_plan_table(self.engine.plan))
        renderables.append(gguf_table("Target model", read_gguf_info(self.engine.target_path)))
        if self.engine.draft_path is not None:
            renderables.append(gguf_table("Draft model", read_gguf_info(self.engine.draft_path)))
        return renderables

    def action_load_model(self) -> None:
        def load(answer: tuple[str, str] | None) -> None:
            if answer is not None:
                self.load_models(*answer)

        self.push_screen(LoadModelScreen(*self.model_spec), load)

    def action_help(self) -> None:
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def _busy(self) -> bool:
        if self.session is None:
            self.notify("No model is loaded.", severity="warning")
            return True
        if self.generation is not None:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return True
        return False

    def get_system_commands(self, screen) -> Iterator[SystemCommand]:
        yield from super().get_system_commands(screen)
        for action, (_, description) in KEY_ACTIONS.items():
            yield SystemCommand(description, _COMMAND_HELP[action], getattr(self, f"action_{action}"))
        for mode in MODES:
            yield SystemCommand(f"Drafting: {stats_text.MODE_LABELS[mode]}", f"Use {mode} drafting from the next reply",
                                lambda mode=mode: self.engine and self.set_mode(mode))
        yield SystemCommand("Load model…", "Load another target model and drafter", self.action_load_model)

    async def action_quit(self) -> None:
        if self.generation is not None:
            self.session.cancel()
        self.exit()


_COMMAND_HELP = {
    "cancel": "Stop the reply being generated (keeps what has arrived)",
    "regenerate": "Sample the last reply again",
    "new_chat": "Start an empty chat",
    "copy_reply": "Copy the last reply to the clipboard",
    "cycle_mode": "Switch drafting: draft model → n-gram → none",
    "toggle_marks": "Show or hide the tint on tokens the draft guessed",
    "history": "Reopen a saved chat",
    "settings": "System prompt, temperature, top-p, top-k, max tokens, draft tokens",
    "model_info": "The memory plan and the GGUF metadata of the loaded models",
    "help": "Show or hide the key bindings",
}


def _content_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def run_chat(args=None, **overrides) -> int:
    """Run the chat app; returns the exit code.

    `args` is an argparse namespace (or None), `overrides` keyword arguments;
    both may give model, draft, draft_tokens, n_ctx, gpu_layers,
    draft_gpu_layers, memory_budget, temperature, top_p, top_k, min_p,
    max_tokens, system and threads.  A value of None leaves the setting to
    config.toml (threads: to llama.cpp's default).  Raises EdgespecError for a bad config file or history
    database.
    """
    values = dict(vars(args)) if args is not None else {}
    values.update(overrides)
    fields = ("model", "draft", "draft_tokens", "n_ctx", "gpu_layers", "draft_gpu_layers", "memory_budget",
              "temperature", "top_p", "top_k", "min_p", "max_tokens")
    config = load_config().with_overrides(
        system_prompt=values.get("system"), **{name: values.get(name) for name in fields})
    store = ChatStore()
    app = ChatApp(config, store, n_threads=values.get("threads"))
    try:
        app.run()
    finally:
        app.close_engine()
        store.close()
    return app.return_code or 0
