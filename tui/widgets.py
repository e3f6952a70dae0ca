"""The chat screen's parts: prompt input, messages, streamed replies, stats bar."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import LoadingIndicator, Sparkline, Static, TextArea

from tui.render import BlockRenderer
from tui.reply import ReplyView


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Shift+Enter or Ctrl+J adds a line, Up recalls earlier prompts."""

    BINDINGS = [
        Binding("enter", "submit", "Send", show=True),
        Binding("shift+enter,ctrl+j", "newline", "New line", show=False),
        Binding("up", "cursor_up", "Earlier prompt", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, prompts: list[str], **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompts = prompts  # oldest first
        self._recall_index: int | None = None  # position in prompts while recalling
        self._unsent = ""  # what was typed before recalling started

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
        elif event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.action_newline()
        else:
            await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")

    def remember(self, text: str) -> None:
        if not self.prompts or self.prompts[-1] != text:
            self.prompts.append(text)
        self._recall_index = None

    def action_cursor_up(self, select: bool = False) -> None:
        if select or self.cursor_location[0] > 0 or not self.prompts:
            super().action_cursor_up(select)
            return
        if self._recall_index is None:
            self._unsent = self.text
            self._recall_index = len(self.prompts)
        if self._recall_index > 0:
            self._recall_index -= 1
            self._show(self.prompts[self._recall_index])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self._recall_index is None or self.cursor_location[0] < last_row:
            super().action_cursor_down(select)
            return
        self._recall_index += 1
        if self._recall_index >= len(self.prompts):
            self._recall_index = None
            self._show(self._unsent)
        else:
            self._show(self.prompts[self._recall_index])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(Text(text), classes="user")
        self.border_title = "you"


class AssistantMessage(Vertical):
    """A reply with its footer line of stats."""

    def __init__(self, renderer: BlockRenderer, mark_drafts: bool, title: str):
        super().__init__(classes="assistant")
        self.reply = ReplyView(renderer, mark_drafts)
        self.footer = Static("", classes="reply-footer")
        self.border_title = title

    def compose(self):
        yield self.reply
        yield self.footer


class Note(Static):
    """An error or a note in the conversation; the chat goes on."""

    def __init__(self, text: str, kind: str = "error"):
        super().__init__(Text(text), classes=kind)


class LoadingPanel(Vertical):
    """Shown while the models load (and, the first time, measure their speed), with a spinner
    and what is happening now, so the screen is never frozen or silent."""

    def __init__(self, description: str):
        super().__init__(id="loading")
        self.description = description
        self.label = Static(description)
        self.status = Static("", classes="loading-status")

    def compose(self):
        yield self.label
        yield self.status
        yield LoadingIndicator()

    def show_elapsed(self, seconds: float) -> None:
        self.label.update(f"{self.description}  {seconds:.1f} s")

    def show_status(self, text: str) -> None:
        self.status.update(Text(text))


class StatsBar(Horizontal):
    """Mode, models and live numbers, with a sparkline of acceptance per draft/verify step."""

    def __init__(self):
        super().__init__(id="stats")
        self.line = Static("", id="stats-line")
        self.sparkline = Sparkline([], id="acceptance", summary_function=lambda values: sum(values) / len(values))
        self.sparkline.tooltip = "acceptance per draft/verify step"

    def compose(self):
        yield self.line
        yield self.sparkline

    def show(self, line: Text, acceptance: list[float]) -> None:
        self.line.update(line)
        self.sparkline.data = acceptance
