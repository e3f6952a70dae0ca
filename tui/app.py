"""edgespec chat: a Textual chat app that shows speculative decoding at work.

The App here owns the screen: layout, bindings, dialogs and the worker
threads that load models and generate.  The conversation itself (session,
settings, per-reply stats, history) is the ChatController of tui/chat.py.
A reply streams from its worker into a ReplyStream that a UI timer drains a
dozen times a second.  Entry point: `run_chat`.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Header

from edgespec import EdgespecError, Engine
from edgespec.catalog import default_pair
from edgespec.loading import load_engine, use_prompt_cache
from tui import stats as stats_text
from tui.actions import ChatActions
from tui.chat import ChatController, ReplyStream
from tui.config import KEY_ACTIONS, ChatConfig, load_config
from tui.history import ChatStore
from tui.render import BlockRenderer
from tui.settings import FLAG_SETTINGS, ChatSettings
from tui.widgets import AssistantMessage, ChatFooter, LoadingPanel, Note, PromptInput, StatsBar, UserMessage

DRAIN_INTERVAL_S = 1 / 12
STATS_INTERVAL_S = 0.25
# Most important first: a narrow footer keeps the first ones (ChatFooter)
FOOTER_ACTIONS = ("cancel", "help", "new_chat", "history", "copy_reply", "model_info", "regenerate", "cycle_mode",
                  "settings", "toggle_marks")


@dataclass
class _Generation:
    stream: ReplyStream
    view: AssistantMessage


class GenerationEnded(Message):
    """Posted by the generation thread so the UI finishes without waiting for the next tick."""


class ChatApp(ChatActions, App):
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
        self.chat = ChatController(config, store)
        self.n_threads = n_threads
        self.cost_curve = cost_curve
        self.generation: _Generation | None = None
        self.mark_drafts = True
        self.renderer = BlockRenderer(config.draft_tint)
        self.model_spec = (config.model or "", config.draft)
        self._loading: tuple[LoadingPanel, float] | None = None
        self._stats_dirty = True
        self.editing: int | None = None  # the index of the user message the prompt input edits
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
        yield ChatFooter(("submit", *FOOTER_ACTIONS))  # Enter sends: the prompt's key, first

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
            engine = load_engine(
                model or default_pair()[0], draft, pull=False, n_ctx=self.config.n_ctx, n_gpu_layers=self.config.gpu_layers,
                draft_gpu_layers=self.config.draft_gpu_layers, draft_tokens=self.chat.settings.draft_tokens,
                bit_exact=self.chat.settings.bit_exact, kv_type=self.config.kv_type,
                draft_kv_type=self.config.draft_kv_type, flash_attn=self.config.flash_attn,
                n_threads=self.n_threads, memory_budget=self.config.memory_budget, notice=notice,
                cost_curve=self.cost_curve, measure_stale_curve=False)
            if self.config.prompt_cache:  # a reopened chat restores its history instead of prefilling it
                use_prompt_cache(engine, self.config.prompt_cache_size, notice, keep_every_prompt=True)
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
        self.chat.use_engine(engine)
        self.sub_title = stats_text.model_name(engine.target_path)
        self._stats_dirty = True
        self.refresh_bindings()
        self._offer_last_chat()
        self._recalibrate_if_due()

    def _offer_last_chat(self) -> None:
        """On an empty chat, say which chat was saved last and the key that continues it."""
        if self.chat.session.messages or self.query(UserMessage):
            return
        last = self.store.list_chats(limit=1)
        if last and last[0].id != self.chat.chat_id:
            self.conversation.mount(Note(
                f"Your last chat, “{last[0].title}” ({last[0].n_messages} messages), is saved: "
                f"{self._key_label('continue_last')} continues it, {self._key_label('history')} lists them all, "
                "or type to start a new one.", "note last-chat"))

    def _key_label(self, action: str) -> str:
        keys = self.config.keymap.get(action) or KEY_ACTIONS[action][0]
        return self.get_key_display(Binding(keys.split(",")[0], action))

    # -- re-measuring the engine's speed between replies ------------------------------------

    def _recalibrate_if_due(self) -> None:
        """Re-measure a stale cost curve in the background while no reply runs; the chat can
        start at once on the old curve, and a reply sent meanwhile waits a few seconds."""
        engine = self.chat.engine
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
        if self.generation is not None and self.chat.session is not None:
            self.chat.session.cancel()
            self.generation.stream.finished.wait(timeout=30)
        self._recalibration_idle.wait(timeout=30)
        self.chat.close()

    # -- sending and streaming -----------------------------------------------------------

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self._busy():
            return
        self.prompt_input.remember(event.text)
        self.prompt_input.load_text("")
        self.store.add_prompt(event.text)
        if self.editing is not None:
            self._answer_edited(event.text)
            return
        self.chat.save(pending_prompt=event.text)
        self.conversation.mount(UserMessage(event.text, len(self.chat.session.messages)))
        self._start(lambda: self.chat.session.stream(event.text, self.chat.settings.sampling))

    def _start(self, events: Callable[[], Iterator]) -> None:
        view = AssistantMessage(self.renderer, self.mark_drafts, self._reply_title())
        self.conversation.mount(view)
        self.conversation.anchor()
        self.generation = _Generation(ReplyStream(), view)
        self.chat.begin_reply()
        self.refresh_bindings()
        self._generate(self.generation.stream, events)

    def _reply_title(self) -> str:
        engine = self.chat.engine
        return f"{stats_text.model_name(engine.target_path)} · {stats_text.MODE_LABELS[engine.mode]}"

    @work(thread=True, group="generate")
    def _generate(self, stream: ReplyStream, events: Callable[[], Iterator]) -> None:
        try:
            self.chat.stream_reply(stream, events)
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
        self.chat.acceptance.extend(acceptance)
        if live is not None:
            self.chat.show_stats(live)
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
            self.chat.save()
            return
        result = stream.result
        reply = generation.view.reply
        if reply.text != result.text:  # e.g. a stop string cut text that was already shown
            reply.set_text(result.text, reply.drafted_ranges())
        else:
            reply.finish()
        generation.view.footer.update(self.chat.reply_finished(result, reply.drafted_ranges()))
        self.chat.save()
        self._recalibrate_if_due()

    # -- the stats bar ---------------------------------------------------------------------

    def _refresh_stats(self) -> None:
        if self._loading is not None:
            panel, started = self._loading
            panel.show_elapsed(time.monotonic() - started)
        if not self._stats_dirty:
            return
        self._stats_dirty = False
        engine = self.chat.engine
        if engine is None:
            self.stats_bar.show("loading models…" if self._loading else "no model loaded", [])
            return
        measuring = not self._recalibration_idle.is_set()
        figures = dict(
            mode=engine.mode,
            target=stats_text.model_name(engine.target_path),
            draft=stats_text.model_name(engine.draft_path) if engine.draft_path else None,
            stats=self.chat.shown_stats,
            draft_tokens=engine.draft_tokens,
            context_used=self.chat.context_used,
            n_ctx=engine.n_ctx,
            status="measuring speed…" if measuring else None,
        )
        self.stats_bar.show(figures, list(self.chat.acceptance))

    # -- saving and reopening chats -------------------------------------------------------

    def _rebuild_conversation(self) -> None:
        """Show the session's messages as they are now (after reopening, or after an error)."""
        session = self.chat.session
        if self.editing is not None:
            self._end_editing()
        self.conversation.remove_children()
        if session.system_prompt:
            self.conversation.mount(Note(f"system prompt: {session.system_prompt}", "note"))
        footers = self.chat.turn_footers()
        for index, message in enumerate(session.messages):
            if message["role"] == "user":
                self.conversation.mount(UserMessage(message["content"], index))
                continue
            view = AssistantMessage(self.renderer, self.mark_drafts, "reply")
            self.conversation.mount(view)
            view.reply.set_text(message["content"], self.chat.drafted_ranges(message["content"]))
            if index in footers:
                view.footer.update(footers[index])
        self.conversation.anchor()

    def open_chat(self, chat_id: int) -> None:
        stored = self.chat.open(chat_id)
        self._rebuild_conversation()
        if stored.target != str(self.chat.engine.target_path):
            self.conversation.mount(Note(
                f"This chat was with {stats_text.model_name(stored.target)}; it continues with "
                f"{stats_text.model_name(self.chat.engine.target_path)}.", "note"))
        pending = stored.extras.get("pending_prompt")
        if pending:
            self.prompt_input.load_text(pending)
            self.conversation.mount(Note("The last prompt got no reply before edgespec stopped; "
                                         "it is back in the input.", "note"))
        self._stats_dirty = True

    def _apply_settings(self, settings: ChatSettings) -> None:
        try:
            self.chat.apply_settings(settings)
        except EdgespecError as error:  # bit-exact over a flash-attention cache: the rest still applies
            self.notify(str(error), severity="error", markup=False)
            self.chat.apply_settings(replace(settings, bit_exact=False))
        self._stats_dirty = True


def run_chat(args=None, **overrides) -> int:
    """Run the chat app; returns the exit code.

    `args` is an argparse namespace (or None), `overrides` keyword arguments;
    both may give model, draft, draft_tokens, n_ctx, gpu_layers,
    draft_gpu_layers, memory_budget, bit_exact, kv_type, draft_kv_type,
    flash_attn, temperature, top_p, top_k, min_p,
    max_tokens, system and threads.  A value of None leaves the setting to
    config.toml (threads: to llama.cpp's default).  Raises EdgespecError for a bad config file or history
    database.
    """
    values = dict(vars(args)) if args is not None else {}
    values.update(overrides)
    config = load_config().with_overrides(
        system_prompt=values.get("system"), **{name: values.get(name) for name in FLAG_SETTINGS})
    store = ChatStore()
    app = ChatApp(config, store, n_threads=values.get("threads"))
    try:
        app.run()
    finally:
        app.close_engine()
        store.close()
    return app.return_code or 0
