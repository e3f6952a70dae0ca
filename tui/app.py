"""edgespec chat: a Textual chat app that shows speculative decoding at work.

The app is made of five parts:

- ChatApp (here): the layout, the bindings, the dialogs and the actions
  (tui/actions.py), and the path of a reply: sent, generated on a worker
  thread, finished or failed.
- ChatController (tui/chat.py): the conversation itself (engine and session,
  settings, per-reply stats, history); it knows nothing of Textual.
- ConversationView (tui/conversation.py): the message widgets, and the reply
  that streams into the last one at a bounded frame rate.
- EngineHost (tui/engine_host.py): loading models and re-measuring their
  speed on worker threads.
- AppEnding (tui/ending.py): what Ctrl+Q, a closed terminal or `kill` keeps
  as the app ends.

The StatsBar (tui/widgets.py) shows reactive figures: the app sets each one
when it changes.  Entry point: `run_chat`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import replace
from typing import Callable, Iterator

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Header

from edgespec.errors import EdgespecError, as_flag
from tui import stats as stats_text
from tui.actions import ChatActions
from tui.chat import ChatController, ReplyStream, as_the_chat_can_act
from tui.config import KEY_ACTIONS, ChatConfig
from tui.conversation import ConversationView, Edit, Generation
from tui.ending import AppEnding
from tui.engine_host import EngineHost
from tui.history import ChatStore
from tui.render import BlockRenderer
from tui.settings import ChatSettings
from tui.widgets import ChatFooter, LoadingPanel, ModelFigures, PromptInput, StatsBar

# How often a reply to a new message is saved as it streams: a kill -9, the OOM killer or a power cut loses
# that much of it, not all (Ctrl+Q, SIGTERM and a closed terminal save all of it: tui/ending.py)
PARTIAL_SAVE_SECONDS = 5.0
# Most important first: a narrow footer keeps the first ones (ChatFooter)
FOOTER_ACTIONS = ("cancel", "help", "new_chat", "history", "copy_reply", "model_info", "regenerate", "cycle_mode",
                  "settings", "toggle_marks")


class ChatApp(AppEnding, ChatActions, App):
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
        self.host = EngineHost(self, config, n_threads=n_threads, cost_curve=cost_curve)
        self.generation: Generation | None = None
        self.model_spec = (config.model or "", config.draft)
        self.loading: LoadingPanel | None = None
        self.editing: int | None = None  # the index of the user message the prompt input edits
        self.set_aside_draft = ""  # what the input held when the edit began (ChatActions.begin_editing)
        self.stop_signal: int | None = None  # the STOP_SIGNALS number that ended the app, if one did
        self.kept_at: float | None = None  # when keep_what_was_written was done (time.monotonic)
        self.unsent_kept = False

    # -- layout ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as attributes: queries go to the active screen, which may be a dialog.
        self.conversation = ConversationView(BlockRenderer(self.config.draft_tint))
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
        for notice in self.store.notices:  # e.g. a damaged history was moved aside at start-up
            self._history_notice(notice)
        self.store.on_notice = self._history_notice
        unsent = self.store.take_unsent()
        if unsent:
            self.prompt_input.show_text(unsent)
            self.conversation.add_note("The message you were writing when edgespec last ended is back in the input.",
                                       "note")
        self._exit_on_stop_signals()
        self.prompt_input.focus()
        self.load_models(*self.model_spec)

    def _history_notice(self, text: str) -> None:
        self.conversation.add_note(text, "note")

    # -- loading models --------------------------------------------------------------

    def load_models(self, model: str, draft: str) -> None:
        if self.generation is not None:
            self.notify("Wait for the reply to finish (Esc stops it) before loading models.", severity="warning")
            return
        self.model_spec = (model, draft)
        self.loading = LoadingPanel(f"Loading {model or 'the default model'} (draft: {draft})…")
        self.conversation.mount(self.loading)
        self.show_models()
        settings = self.chat.settings
        self.host.load(model, draft, draft_tokens=settings.draft_tokens, bit_exact=settings.bit_exact)

    def on_engine_host_status(self, event: EngineHost.Status) -> None:
        if self.loading is not None:
            self.loading.show_status(event.text)
        else:  # said after loading (a learned-priors file or a prompt snapshot that cannot be read): a note
            self.conversation.add_note(event.text, "note")

    def _end_loading(self, notices: list[str]) -> None:
        if self.loading is not None:
            self.loading.remove()
            self.loading = None
        for notice in notices:
            # a notice of work in progress ("measuring this model's speed, once ... ...") kept after the load reads
            # as still going on: the app was taken for hung
            self.conversation.add_note(f"{notice} done" if notice.endswith("...") else notice, "note")

    def on_engine_host_load_failed(self, event: EngineHost.LoadFailed) -> None:
        self._end_loading(event.notices)
        self.conversation.add_note(
            f"Could not load the model: {event.error}\n"
            "Open the command palette (Ctrl+P) and choose “Load model…” to try another file.")
        self.show_models()

    def on_engine_host_loaded(self, event: EngineHost.Loaded) -> None:
        self._end_loading(event.notices)
        self.chat.use_engine(event.engine)
        self.sub_title = stats_text.model_name(event.engine.target_path)
        self.show_models()
        self.refresh_bindings()
        self._offer_last_chat()
        self._recalibrate_if_due()

    def _offer_last_chat(self) -> None:
        """On an empty chat, say which chat was saved last and the key that continues it."""
        if self.chat.session.messages or self.conversation.has_user_messages():
            return
        last = self.store.list_chats(limit=1)
        if last and last[0].id != self.chat.chat_id:
            self.conversation.add_note(
                f"Your last chat, “{last[0].title}” ({last[0].n_messages} messages), is saved: "
                f"{self._key_label('continue_last')} continues it, {self._key_label('history')} lists them all, "
                "or type to start a new one.", "note last-chat")

    def _key_label(self, action: str) -> str:
        keys = self.config.keymap.get(action) or KEY_ACTIONS[action][0]
        return self.get_key_display(Binding(keys.split(",")[0], action))

    def _recalibrate_if_due(self) -> None:
        """Re-measure a stale cost curve in the background while no reply runs and nothing loads."""
        if self.chat.engine is not None and self.loading is None and self.generation is None:
            self.host.recalibrate(self.chat.engine)

    def on_engine_host_measuring(self, event: EngineHost.Measuring) -> None:
        self.stats_bar.status = "measuring speed…" if event.active else None

    # -- sending, streaming, finishing ------------------------------------------------------

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self._busy():
            return
        self.prompt_input.remember(event.text)
        self.prompt_input.load_text("")
        self.store.add_prompt(event.text)
        if self.editing is not None:
            self._answer_edited(event.text)
            return
        self.chat.save(pending_prompt=event.text)  # a kill during the reply loses only the reply
        self.conversation.add_user_message(event.text, len(self.chat.session.messages))
        self.start_reply(lambda: self.chat.session.stream(event.text, self.chat.settings.sampling), event.text)

    def start_reply(self, events: Callable[[], Iterator], prompt: str | None = None, edit: Edit | None = None) -> None:
        """Generate a reply from events() on a worker thread; prompt: the new message it answers, if any;
        edit: the edit of an earlier message it answers, if any."""
        stream, label = ReplyStream(), self._reply_title()
        view = self.conversation.follow(stream, label)
        self.generation = Generation(stream, view, prompt, edit, label=label)
        self.chat.begin_reply()
        self.show_reply_figures()
        self.refresh_bindings()
        self._generate(stream, events)

    def _reply_title(self) -> str:
        engine = self.chat.engine
        return f"{stats_text.model_name(engine.target_path)} · {stats_text.engine_mode_label(engine)}"

    @work(thread=True, group="generate")
    def _generate(self, stream: ReplyStream, events: Callable[[], Iterator]) -> None:
        try:
            self.chat.stream_reply(stream, events)
        except EdgespecError as error:
            stream.error = error.worded(as_the_chat_can_act)
        except Exception as error:  # a bug must not end the app with a traceback
            self.log.error(traceback.format_exc())
            stream.error = f"generation failed: {type(error).__name__}: {error}"
        finally:
            stream.finished.set()
            self.conversation.post_message(ConversationView.StreamFinished())

    def on_conversation_view_progress(self, event: ConversationView.Progress) -> None:
        self.chat.acceptance.extend(event.acceptance)
        if event.stats is not None:
            self.chat.show_stats(event.stats)
        self.show_reply_figures()
        self._save_reply_so_far()

    def _save_reply_so_far(self) -> None:
        """Every PARTIAL_SAVE_SECONDS, save the reply to a new message as far as it has come.  A regeneration or
        an edit is not: until it ends, the chat stays stored as it was, the reply it replaces included."""
        generation = self.generation
        if generation is None or generation.prompt is None or generation.edit is not None:
            return
        now, text = time.monotonic(), generation.view.reply.text
        if text and now - generation.saved_at >= PARTIAL_SAVE_SECONDS:
            generation.saved_at = now
            self.chat.save(reply_so_far=(text, generation.label))

    def on_conversation_view_ended(self, event: ConversationView.Ended) -> None:
        generation, self.generation = self.generation, None
        self.refresh_bindings()
        self.show_models()  # a mode chosen while the reply streamed shows from now, as it applies
        stream = event.stream
        if stream.error is not None or stream.result is None:
            self._reply_failed(generation, stream.error or "the reply ended without a result")
            self._load_models_if_settings_ask()
            return
        last = self.chat.session.messages[-1] if self.chat.session.messages else {}
        stopped = {"role": "assistant", "content": stream.result.text, "cancelled": True}
        if stream.result.finish_reason == "cancelled" and last.get("role") == "user":
            # stopped before it wrote anything: no reply is kept, and an edit is undone as a failed one is
            then = ("the edit is undone" if generation.edit is not None
                    else f"{self._key_label('regenerate')} answers the message")
            self._reply_failed(generation, f"stopped before the reply began: {then}")
            return
        if stream.result.finish_reason == "cancelled" and last != stopped:
            # a regeneration stopped: the session kept the reply it was to replace, and so does the screen
            self.rebuild_conversation()
            self.conversation.add_note("stopped: the reply before it is kept")
            self.chat.save()
            return
        reply = event.message.reply
        reply.finish(stream.result.text)
        event.message.footer.update(self.chat.reply_finished(stream.result, reply.drafted_ranges(), generation.label))
        self.show_reply_figures()
        self.chat.save()
        self._load_models_if_settings_ask()
        self._recalibrate_if_due()

    def _reply_failed(self, generation: Generation, error: str) -> None:
        edit, session = generation.edit, self.chat.session
        edit_undone = edit is not None and session.messages and session.messages[-1]["role"] == "user"
        if edit_undone:
            # An edit that cannot be answered (too long for the context, say) changes nothing: the chat
            # goes back to what it was, and the edited text to the input.
            session.messages, session.turn_stats = edit.messages, edit.turn_stats
            session.first_visible = edit.first_visible
        self.rebuild_conversation()
        if edit_undone:  # still an edit: Enter must not send it as a new message (what is typed waits aside)
            self.begin_editing(edit.index)
            self.prompt_input.show_text(edit.text)
        self.conversation.add_note(error)
        refused = self.chat.reply_failed(generation.prompt)
        if refused and not self.prompt_input.text:  # nothing typed is lost: the message is back in the input
            self.prompt_input.show_text(generation.prompt)
        self.show_reply_figures()

    # -- the stats bar ---------------------------------------------------------------------

    def show_models(self) -> None:
        engine = self.chat.engine
        if engine is not None:
            self.stats_bar.models = ModelFigures.of(engine)
        else:
            self.stats_bar.models = "loading models…" if self.loading is not None else "no model loaded"

    def show_reply_figures(self) -> None:
        bar, chat = self.stats_bar, self.chat
        bar.reply, bar.context_used, bar.acceptance = chat.shown_stats, chat.context_used, tuple(chat.acceptance)

    # -- saving and reopening chats -------------------------------------------------------

    def rebuild_conversation(self) -> None:
        """Show the session's messages as they are now (after reopening, or after an error)."""
        if self.editing is not None:
            self.end_editing()
        session = self.chat.session
        self.conversation.show_messages(session.messages, session.system_prompt, self.chat.turn_footers(),
                                        self.chat.drafted_ranges, self.chat.reply_label)

    def open_chat(self, chat_id: int) -> None:
        stored = self.chat.open(chat_id)
        self.rebuild_conversation()
        if stored.target != str(self.chat.engine.target_path):
            self.conversation.add_note(
                f"This chat was with {stats_text.model_name(stored.target)}; it continues with "
                f"{stats_text.model_name(self.chat.engine.target_path)}.", "note")
        pending = stored.extras.get("pending_prompt")
        if pending:
            if self.prompt_input.text.strip():  # what is being written stays; the prompt went to the prompt history
                where = "Up on the input's first line brings it back"
            else:
                self.prompt_input.show_text(pending)
                where = "it is back in the input"
            self.conversation.add_note(f"The last prompt got no reply before edgespec stopped; {where}.", "note")
        self.apply_settings(self.chat.settings)  # which shows the models' figures, or loads them again
        self.show_reply_figures()

    def apply_settings(self, settings: ChatSettings) -> None:
        engine = self.chat.engine
        if self._needs_new_context(settings):
            # the load reads bit-exact from the chat's settings; until it is done the engine keeps its own
            self.chat.apply_settings(replace(settings, bit_exact=engine.bit_exact))
            self.chat.settings = settings
            if self.generation is None:
                self.load_models(*self.model_spec)
            else:  # the reply keeps its context; the models load again when it ends (on_conversation_view_ended)
                self.notify("The bit-exact setting takes effect from the next reply: the models load again once "
                            "this one ends.", markup=False)
            return
        try:
            self.chat.apply_settings(settings)
        except EdgespecError as error:  # bit-exact over flash attention that was asked for: the rest still applies
            self.notify(error.worded(as_flag), severity="error", markup=False)
            self.chat.apply_settings(replace(settings, bit_exact=False))
        self.show_models()

    def _needs_new_context(self, settings: ChatSettings) -> bool:
        """Whether bit-exact asks for a context without flash attention, or frees one to have it.

        flash_attn "auto" is on unless bit-exact, and a context keeps what it was made with: the models
        load again, and the chat goes on with them.
        """
        engine = self.chat.engine
        return self.config.flash_attn == "auto" and engine is not None and engine.flash_attn == settings.bit_exact

    def _load_models_if_settings_ask(self) -> None:
        """After a reply: a bit-exact switch made while it streamed loads the models again now."""
        if self.loading is None and self._needs_new_context(self.chat.settings):
            self.load_models(*self.model_spec)
