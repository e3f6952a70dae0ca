"""What the chat app's keys and commands do: ChatApp's actions (bindings: tui.config.KEY_ACTIONS).

A mixin of ChatApp (tui/app.py), kept apart so the app module shows how the
app runs and this one what each action does.  ChatActions declares below what
it uses of the app, and uses nothing else of it (beside textual.App's own
methods: notify, push_screen, copy_to_clipboard, refresh_bindings, exit).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from textual.app import SystemCommand

from edgespec.errors import EdgespecError, as_flag
from edgespec.limits import MODES
from tui import stats as stats_text
from tui.chat import ChatController
from tui.config import COMMAND_HELP, KEY_ACTIONS, ChatConfig, load_config, save_defaults
from tui.conversation import ConversationView, Edit, Generation
from tui.history import ChatStore
from tui.history_screens import HistoryScreen
from tui.screens import LoadModelScreen, ModelInfoScreen, SettingsScreen, model_info
from tui.settings import ChatSettings
from tui.reply import BlockView
from tui.widgets import KeysPanel, LoadingPanel, PromptInput, UserMessage


class ChatActions:
    # -- what the actions use of ChatApp: its state ...
    config: ChatConfig
    store: ChatStore
    chat: ChatController  # the conversation: engine, session, settings
    conversation: ConversationView
    prompt_input: PromptInput
    generation: Generation | None  # the reply being generated, if one is
    editing: int | None  # the index of the user message the prompt input edits, if one is
    set_aside_draft: str  # what the input held when the edit began, back in it when the edit ends
    model_spec: tuple[str, str]  # the target and draft asked for last
    loading: LoadingPanel | None  # shown while models load

    # ... and its methods
    def start_reply(self, events: Callable[[], Iterator], prompt: str | None = None) -> None:
        raise NotImplementedError

    def rebuild_conversation(self) -> None:
        raise NotImplementedError

    def open_chat(self, chat_id: int) -> None:
        raise NotImplementedError

    def load_models(self, model: str, draft: str) -> None:
        raise NotImplementedError

    def apply_settings(self, settings: ChatSettings) -> None:
        raise NotImplementedError

    def show_models(self) -> None:
        """Show the loaded models' figures (mode, draft tokens) in the stats bar again."""
        raise NotImplementedError

    async def keep_what_was_written(self) -> None:
        """Stop the reply being written and save it, and keep the message being written, before the app ends."""
        raise NotImplementedError

    def show_reply_figures(self) -> None:
        """Show the chat's reply figures (stats, context, acceptance) in the stats bar again."""
        raise NotImplementedError

    # -- the actions

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "cancel":
            return True if self.generation is not None or self.editing is not None else None
        if action in ("regenerate", "new_chat", "cycle_mode", "history", "copy_reply", "continue_last", "edit_prompt"):
            return True if self.chat.session is not None else None
        return True

    def action_cancel(self) -> None:
        if self.generation is not None:
            self.chat.stop_reply(self.generation.stream)
        elif self.editing is not None:
            self.end_editing()

    # -- editing an earlier message --------------------------------------------------

    def action_edit_prompt(self) -> None:
        users = [i for i, m in enumerate(self.chat.session.messages) if m["role"] == "user"]
        if not users:
            self.notify("No message to edit yet.")
            return
        self.begin_editing(users[-1])

    def on_user_message_edit_requested(self, event: UserMessage.EditRequested) -> None:
        if self.chat.session is not None:
            self.begin_editing(event.index)

    def begin_editing(self, index: int) -> None:
        if self._busy():
            return
        messages = self.chat.session.messages
        if not (0 <= index < len(messages) and messages[index]["role"] == "user"):
            return  # a message the chat no longer has (e.g. a view left from before a rebuild)
        if self.editing is None:  # the message being written waits aside: an edit given up lost it
            self.set_aside_draft = self.prompt_input.text
        self.editing = index
        self.prompt_input.show_text(messages[index]["content"])
        later = len(messages) - index - 1
        self.prompt_input.border_title = (f"editing message {index + 1}: Enter answers it again"
                                          f"{f' and drops the {later} after it' if later else ''}; Esc cancels")
        self.prompt_input.focus()
        self.refresh_bindings()

    def end_editing(self) -> None:
        """Leave editing, sent or given up: the message being written before it is back in the input."""
        self.editing = None
        self.prompt_input.border_title = None
        self.prompt_input.show_text(self.set_aside_draft)
        self.set_aside_draft = ""
        self.refresh_bindings()

    def _answer_edited(self, text: str) -> None:
        """Replace the message being edited, forget what followed it, and answer it again.  The chat is saved
        once the reply ends: one that fails (the edited conversation does not fit) undoes the edit
        (app._reply_failed), and a kill meanwhile leaves the chat stored as it was."""
        index, session, sampling = self.editing, self.chat.session, self.chat.settings.sampling
        edit = Edit(index, text, list(session.messages), list(session.turn_stats), session.first_visible)
        self.end_editing()
        session.edit_user_message(index, text)
        self.rebuild_conversation()
        self.start_reply(lambda: session.stream_reply(sampling), edit=edit)

    def action_regenerate(self) -> None:
        if self._busy():
            return
        session, sampling = self.chat.session, self.chat.settings.sampling
        messages = session.messages
        if not messages:
            self.notify("Nothing to regenerate yet.")
            return
        if messages[-1]["role"] == "assistant":
            self.conversation.remove_last_reply()
            self.start_reply(lambda: session.stream_regenerate(sampling))
        else:  # the last reply failed: answer the prompt that is still there
            self.start_reply(lambda: session.stream_reply(sampling))

    def action_new_chat(self) -> None:
        if self._busy():
            return
        self.chat.new_chat()
        if self.editing is not None:
            self.end_editing()
        self.conversation.clear()
        self.show_reply_figures()
        self.prompt_input.focus()

    def on_block_view_copy_requested(self, event: BlockView.CopyRequested) -> None:
        self.copy_to_clipboard(event.code)
        lines = event.code.count("\n") + 1 if event.code else 0
        self.notify(f"Copied the code block ({lines} line{'s' if lines != 1 else ''}).")

    def action_continue_last(self) -> None:
        if self._busy():
            return
        last = self.store.list_chats(limit=1)
        if not last:
            self.notify("No saved chats yet.")
        elif last[0].id == self.chat.chat_id:
            self.notify("This is the chat saved last.")
        else:
            self._reopen(last[0].id)

    def action_copy_reply(self) -> None:
        if self.generation is not None:  # it copied the reply before, as if it were the one on screen
            self.notify("The reply is still being written; copy it once it ends.", severity="warning")
            return
        text = self.chat.last_reply_text()
        if not text:
            self.notify("No reply to copy yet.")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last reply ({len(text)} characters).")

    def action_cycle_mode(self) -> None:
        if self.chat.engine is None:
            return
        # Ctrl+G steps through combined, n-gram and none; the draft model alone is in the palette
        modes = [mode for mode in self.chat.available_modes() if mode != "draft-model"]
        current = self.chat.engine.mode if self.chat.engine.mode in modes else modes[-1]
        self.set_mode(modes[(modes.index(current) + 1) % len(modes)])

    def set_mode(self, mode: str) -> None:
        if mode not in self.chat.available_modes():
            self.notify("No draft model is loaded; use “Load model…” with a draft.", severity="warning")
            return
        self.chat.engine.configure(mode=mode)
        if self.generation is not None:  # the stats bar keeps the streaming reply's mode until it ends
            self.notify(f"Drafting: {stats_text.engine_mode_label(self.chat.engine, mode)} from the next reply.")
            return
        self.notify(f"Drafting: {stats_text.engine_mode_label(self.chat.engine, mode)}.")
        self.show_models()

    def action_toggle_marks(self) -> None:
        marking = not self.conversation.mark_drafts
        self.conversation.set_marking(marking)
        self.notify("Draft marks on: tinted text came from accepted draft tokens." if marking else "Draft marks off.")

    def action_history(self) -> None:
        if self._busy():
            return

        open_chat = self.chat.chat_id

        def reopen(chat_id: int | None) -> None:
            if chat_id is not None:
                self._reopen(chat_id)
            elif open_chat is not None and self.chat.chat_id is None:
                # the open chat was deleted: its conversation goes too, or the next reply would save it anew
                self.action_new_chat()

        self.push_screen(HistoryScreen(self.store.list_chats(), self.chat), reopen)

    def _reopen(self, chat_id: int) -> None:
        try:
            self.open_chat(chat_id)
        except EdgespecError as error:  # e.g. the stored chat is damaged
            self.notify(error.worded(as_flag), severity="error", markup=False)

    def action_settings(self) -> None:
        def apply(answer: tuple[ChatSettings, bool] | None) -> None:
            if answer is None:
                return
            settings, save = answer
            self.apply_settings(settings)
            if save:
                self.config = replace(self.config, **settings.config_values())
                self._save_defaults(settings)
            if self.generation is None:  # else the reply's end saves them; now would store the chat without
                self.chat.save()  # the reply a regeneration set aside, and a kill before it ended lost that too

        self.push_screen(SettingsScreen(self.chat.settings), apply)

    def _save_defaults(self, settings: ChatSettings) -> None:
        """Write the dialog's settings into config.toml over what the file holds, not over this run's flags:
        `--n-ctx 1024 --draft none`, given for one run, became every run's."""
        try:
            path = save_defaults(replace(load_config(), **settings.config_values()))
        except EdgespecError as error:  # the file was broken since the app started
            self.notify(f"Not saved as defaults: {error.worded(as_flag)}", severity="error", markup=False)
        except OSError as error:
            self.notify(f"Not saved as defaults: {error.strerror or error}", severity="error", markup=False)
        else:
            # a new chat starts from them (seed and stop strings are not saved: they stay per chat)
            self.chat.defaults = replace(self.chat.defaults, system_prompt=settings.system_prompt)
            self.notify(f"Saved as defaults in {path}.", markup=False)

    def action_model_info(self) -> None:
        self.push_screen(ModelInfoScreen(model_info(self.chat.engine, self.chat.plain_speed(),
                                                    self.chat.plain_steps.min_steps)))

    def action_load_model(self) -> None:
        def load(answer: tuple[str, str] | None) -> None:
            if answer is not None:
                self.load_models(*answer)

        self.push_screen(LoadModelScreen(*self.model_spec), load)

    def action_help(self) -> None:
        panels = self.screen.query(KeysPanel)
        if panels:
            panels.remove()
        else:
            self.screen.mount(KeysPanel())

    def _busy(self) -> bool:
        if self.chat.session is None:
            self.notify("No model is loaded.", severity="warning")
            return True
        if self.generation is not None:
            self.notify("A reply is still streaming; Esc stops it.", severity="warning")
            return True
        if self.loading is not None:
            # a reply of the old models, still running when the new ones came, froze the screen while they
            # were swapped, and was lost
            self.notify("Models are loading; send when they are ready.", severity="warning")
            return True
        return False

    def get_system_commands(self, screen) -> Iterator[SystemCommand]:
        yield from super().get_system_commands(screen)
        # only what can run now: the palette skips check_action, and "Edit prompt" while the models loaded
        # ended the app with a traceback; a drafting mode only where its drafter is loaded
        for action, (_, description) in KEY_ACTIONS.items():
            if self.check_action(action, ()):
                yield SystemCommand(description, COMMAND_HELP[action], getattr(self, f"action_{action}"))
        modes = self.chat.available_modes() if self.chat.engine is not None else ()
        for mode in (mode for mode in MODES if mode in modes):
            label = stats_text.engine_mode_label(self.chat.engine, mode)
            yield SystemCommand(f"Drafting: {label}", f"Use {mode} drafting from the next reply",
                                lambda mode=mode: self.set_mode(mode))
        yield SystemCommand("Load model…", "Load another target model and drafter", self.action_load_model)

    def action_help_quit(self) -> None:
        """Ctrl+C: stop the reply being generated, as Ctrl+C stops a command in a terminal (Esc does too);
        with none, Textual's hint on how to quit.  Its hint alone, mid-reply, left the reply running."""
        if self.generation is not None:
            self.chat.stop_reply(self.generation.stream)
            return
        super().action_help_quit()

    async def action_quit(self) -> None:
        await self.keep_what_was_written()
        self.exit()
