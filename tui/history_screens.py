"""The chat history dialog and the small dialogs it opens: rename, export to Markdown, confirm a delete."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Protocol

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from edgespec.control_chars import plain_text, visible_controls
from edgespec.errors import EdgespecError
from tui.export import default_export_path
from tui.history import ChatSummary


class HistoryActions(Protocol):
    """What the history dialog does to a chat (the app's ChatController)."""

    def delete(self, chat_id: int) -> None: ...
    def rename(self, chat_id: int, title: str) -> None: ...
    def export(self, chat_id: int, path: Path, mark_drafts: bool) -> Path: ...


class HistoryScreen(ModalScreen[int | None]):
    """Past chats, newest first; Enter reopens one, r renames, e exports, Delete removes (after asking)."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("delete", "delete_chat", "Delete chat"),
        Binding("r", "rename_chat", "Rename"),
        Binding("e", "export_chat", "Export"),
    ]

    def __init__(self, chats: list[ChatSummary], actions: HistoryActions):
        super().__init__()
        self.chats = {chat.id: chat for chat in chats}
        self.actions = actions

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="history") as dialog:
            dialog.border_title = "Past chats (Enter opens, r renames, e exports, Delete removes, Esc closes)"
            if self.chats:
                yield OptionList(*(self._option(chat) for chat in self.chats.values()), id="chats")
            else:
                yield Static("No saved chats yet.")

    @staticmethod
    def _option(chat: ChatSummary) -> Option:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
        # a title is a message's first line, or typed: escape sequences in it are drawn, not obeyed
        label = Text.assemble((when, "dim"), "  ", visible_controls(chat.title),
                              (f"  ({chat.n_messages} messages)", "dim"))
        return Option(label, id=str(chat.id))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def _highlighted(self) -> ChatSummary | None:
        lists = self.query(OptionList)
        if not lists or lists.first().highlighted is None:
            return None
        option_list = lists.first()
        return self.chats[int(option_list.get_option_at_index(option_list.highlighted).id)]

    def _done(self, change: Callable[[], None]) -> bool:
        """Make a change to the history; one it refuses (locked by another program, a read-only folder) is
        said, and the list stays as the file is."""
        try:
            change()
        except EdgespecError as error:
            self.app.notify(f"Not changed: {error}", severity="error", markup=False)
            return False
        return True

    def action_delete_chat(self) -> None:
        chat = self._highlighted()
        if chat is None:
            return

        def delete(confirmed: bool | None) -> None:
            if confirmed:
                if not self._done(lambda: self.actions.delete(chat.id)):
                    return
                del self.chats[chat.id]
                self.query_one(OptionList).remove_option(str(chat.id))

        title = visible_controls(chat.title)
        self.app.push_screen(ConfirmScreen(f"Delete the chat “{title}” ({chat.n_messages} messages)? "
                                           "This cannot be undone."), delete)

    def action_rename_chat(self) -> None:
        chat = self._highlighted()
        if chat is None:
            return

        def rename(title: str | None) -> None:
            if title is not None:
                if not self._done(lambda: self.actions.rename(chat.id, title)):
                    return
                renamed = ChatSummary(chat.id, title, chat.updated_at, chat.target, chat.n_messages)
                self.chats[chat.id] = renamed
                self.query_one(OptionList).replace_option_prompt(str(chat.id), self._option(renamed).prompt)

        self.app.push_screen(RenameScreen(visible_controls(chat.title)), rename)

    def action_export_chat(self) -> None:
        chat = self._highlighted()
        if chat is not None:
            title = visible_controls(chat.title)
            self.app.push_screen(ExportScreen(chat, self.actions.export),
                                 lambda path: path and self.app.notify(f"Exported “{title}” to {path}.", markup=False))


class ConfirmScreen(ModalScreen[bool]):
    """A question with Yes (y) and No (n, Esc)."""

    BINDINGS = [Binding("escape,n", "dismiss(False)", "No"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="confirm"):
            yield Static(Text(self.question))
            with Horizontal(classes="buttons"):
                yield Button("Yes, delete (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class RenameScreen(ModalScreen[str | None]):
    """Ask for a chat's new title."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.chat_title = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="rename") as dialog:
            dialog.border_title = "Rename chat (Enter renames, Esc cancels)"
            yield Input(self.chat_title, id="title")
            yield Static("", classes="dialog-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        title = " ".join(plain_text(event.value).split())
        if not title:
            self.query_one(".dialog-error", Static).update("A title cannot be empty; type one or press Esc.")
            return
        self.dismiss(title[:200])


class ExportScreen(ModalScreen[Path | None]):
    """Ask where to write a chat as Markdown, and whether to mark the drafted text."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, chat: ChatSummary, export):
        super().__init__()
        self.chat = chat
        self._export = export

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="export") as dialog:
            dialog.border_title = "Export chat to Markdown (Esc cancels)"
            yield Label("File (a new one: an existing file is never overwritten)")
            yield Input(str(default_export_path(Path.cwd(), self.chat.title)), id="path")
            yield Checkbox("Mark the text the draft guessed", True, id="mark-drafts")
            yield Static("", classes="dialog-error")
            with Horizontal(classes="buttons"):
                yield Button("Export", id="export-button", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self) -> None:
        self._write()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "export-button":
            self._write()
        else:
            self.dismiss(None)

    def _write(self) -> None:
        text = self.query_one("#path", Input).value.strip()
        if not text:
            self.query_one(".dialog-error", Static).update("Type a file name.")
            return
        try:
            path = self._export(self.chat.id, Path(text), self.query_one("#mark-drafts", Checkbox).value)
        except EdgespecError as error:  # e.g. the file exists already: said here, the dialog stays
            self.query_one(".dialog-error", Static).update(Text(str(error)))
            return
        self.dismiss(path)
