"""The chat screen's parts: prompt input, messages, streamed replies, stats bar."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Footer, LoadingIndicator, Static, TextArea

from edgespec.stats import Stats
from tui import stats as stats_text
from edgespec.control_chars import plain_text, visible_controls
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

    async def _on_paste(self, event: events.Paste) -> None:
        """A paste is text: escape sequences and control characters in it are dropped (edgespec.control_chars)."""
        event.prevent_default()  # instead of TextArea's paste, which inserts it as it came
        text = plain_text(event.text)
        if text and not self.read_only:
            self.move_cursor(self.replace(text, *self.selection).end_location)

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
            self.show_text(self.prompts[self._recall_index])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self._recall_index is None or self.cursor_location[0] < last_row:
            super().action_cursor_down(select)
            return
        self._recall_index += 1
        if self._recall_index >= len(self.prompts):
            self._recall_index = None
            self.show_text(self._unsent)
        else:
            self.show_text(self.prompts[self._recall_index])

    def show_text(self, text: str) -> None:
        """The input holding text, the cursor at its end, where typing goes on (load_text leaves it at the start:
        a draft put back and then typed into read "xdraft")."""
        self.load_text(text)
        self.move_cursor(self.document.end)


class UserMessage(Static):
    """A message the user sent; clicking it edits it (and answers it again)."""

    class EditRequested(Message):
        def __init__(self, index: int):
            super().__init__()
            self.index = index

    def __init__(self, text: str, index: int):
        super().__init__(Text(visible_controls(text)), classes="user")  # a reopened chat's text was never a paste
        self.index = index  # in the session's messages
        self.border_title = "you"
        self.tooltip = "click to edit this message and answer it again"

    def on_click(self) -> None:
        self.post_message(self.EditRequested(self.index))


class AssistantMessage(Vertical):
    """A reply with its footer line of stats."""

    def __init__(self, renderer: BlockRenderer, mark_drafts: bool, title: str):
        super().__init__(classes="assistant")
        self.reply = ReplyView(renderer, mark_drafts)
        self.footer = Static("", classes="reply-footer")
        self.border_title = Text(title)  # it names the model, whose file name is not markup

    def compose(self):
        yield self.reply
        yield self.footer


class Note(Static):
    """An error or a note in the conversation; the chat goes on."""

    def __init__(self, text: str, kind: str = "error"):
        super().__init__(Text(visible_controls(text)), classes=kind)  # it may quote a system prompt or a file name


ELAPSED_INTERVAL_S = 0.25


class LoadingPanel(Vertical):
    """Shown while the models load (and, the first time, measure their speed), with a spinner
    and what is happening now, so the screen is never frozen or silent."""

    def __init__(self, description: str):
        super().__init__(id="loading")
        self.description = visible_controls(description)  # it names the model as given: a path, not markup
        self.label = Static(Text(self.description))
        self.status = Static("", classes="loading-status")
        self._started = time.monotonic()

    def compose(self):
        yield self.label
        yield self.status
        yield LoadingIndicator()

    def on_mount(self) -> None:
        self.set_interval(ELAPSED_INTERVAL_S, self._show_elapsed)

    def _show_elapsed(self) -> None:
        self.label.update(Text(f"{self.description}  {time.monotonic() - self._started:.1f} s"))

    def show_status(self, text: str) -> None:
        self.status.update(Text(text))


class ChatFooter(Footer):
    """The footer keeps the keys that fit its width, the most important (first in `priority`) first."""

    def __init__(self, priority: tuple[str, ...]):
        super().__init__()
        self.priority = priority

    def compose(self):
        keys = list(super().compose())
        palette = [key for key in keys if key.has_class("-command-palette")]
        room = (self.size.width or 10**6) - sum(_key_width(key) + 1 for key in palette)
        kept = set()
        for key in sorted((key for key in keys if key not in palette), key=self._rank):
            if _key_width(key) > room:
                break
            kept.add(key)
            room -= _key_width(key)
        yield from (key for key in keys if key in kept or key in palette)

    def _rank(self, key: Widget) -> int:
        return self.priority.index(key.action) if key.action in self.priority else len(self.priority)

    def on_resize(self) -> None:
        self.refresh(recompose=True)


def _key_width(key: Widget) -> int:
    """Cells a FooterKey takes in a footer that is not compact: " key description "."""
    return len(key.key_display) + len(key.description) + 3


class KeysPanel(VerticalScroll):
    """F1: the keys, edgespec's own first, then the prompt's, then the editor's."""

    def __init__(self):
        super().__init__(id="keys-panel")
        self.table = Static()

    def compose(self):
        yield self.table

    def on_mount(self) -> None:
        groups: dict[str, dict[str, list]] = {"edgespec": {}, "prompt": {}, "editing": {}}
        for namespace, binding, _, _ in self.screen.active_bindings.values():
            if not binding.description:
                continue
            if namespace is self.app or namespace is self.screen:
                group = "edgespec"
            else:
                group = "prompt" if binding.action in _PROMPT_ACTIONS else "editing"
            groups[group].setdefault(binding.description, []).append(self.app.get_key_display(binding))
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for title, keys in groups.items():
            if keys:
                table.add_row(Text(title, style="underline"), "")
                for description, displays in keys.items():
                    table.add_row(Text(" ".join(dict.fromkeys(displays))), Text(description))
        self.keys_table = table  # what it shows, for the tests to read
        self.table.update(table)


_PROMPT_ACTIONS = {binding.action for binding in PromptInput.BINDINGS}


@dataclass(frozen=True)
class ModelFigures:
    """What the stats bar's first line says of the loaded models and how they draft."""

    mode: str
    target: str
    draft: str | None
    draft_tokens: int
    n_ctx: int

    @classmethod
    def of(cls, engine) -> "ModelFigures":
        return cls(mode=engine.mode, target=stats_text.model_name(engine.target_path),
                   draft=stats_text.model_name(engine.draft_path) if engine.draft_path else None,
                   draft_tokens=engine.draft_tokens, n_ctx=engine.n_ctx)


class AcceptanceBars(Widget):
    """Acceptance per draft/verify step as bars on a fixed 0-100% scale: one column a step, the newest last, or
    one a bucket of steps once there are more steps than columns.

    Textual's Sparkline scales between the lowest and highest value it is given: 99% at every step drew a flat
    bottom line beside "accept 99%", and a single step at 50% a full bar.
    """

    BARS = "▁▂▃▄▅▆▇█"
    data: reactive[tuple[float, ...]] = reactive((), layout=False)

    def render(self) -> Text:
        width, height, data = self.size.width, max(1, self.size.height), self.data
        if not width or not data:
            return Text("")
        per_column = max(1, -(-len(data) // width))  # ceiling: every step shown, in as few columns as fit
        means = [sum(data[i:i + per_column]) / len(data[i:i + per_column]) for i in range(0, len(data), per_column)]
        levels = len(self.BARS) * height
        columns = [min(levels - 1, int(mean * levels)) for mean in means]
        rows = []
        for row in reversed(range(height)):  # the top row first; each holds len(BARS) of the levels
            low = row * len(self.BARS)
            rows.append("".join(" " if level < low else "█" if level >= low + len(self.BARS)
                                else self.BARS[level - low] for level in columns))
        return Text("\n".join(rows), style="green")


class StatsBar(Horizontal):
    """Mode, models and live numbers, with a sparkline of acceptance per draft/verify step.

    Its reactive attributes are what it shows: set one and the bar redraws (once per
    change of value).  Narrower than SPARKLINE_MIN_WIDTH it drops the sparkline, and then
    each line its less important figures (tui.stats.stats_line), so that it never wraps.
    """

    models: reactive[ModelFigures | str] = reactive("loading models…", init=False)  # or a message instead
    reply: reactive[Stats | None] = reactive(None, init=False)  # the streaming reply's figures, or the last one's
    context_used: reactive[int] = reactive(0, init=False)
    status: reactive[str | None] = reactive(None, init=False)  # e.g. a re-measurement in progress
    acceptance: reactive[tuple[float, ...]] = reactive((), init=False)

    def __init__(self):
        super().__init__(id="stats")
        self.line = Static("", id="stats-line")
        self.sparkline = AcceptanceBars(id="acceptance")
        self.sparkline.tooltip = "acceptance per draft/verify step (0-100%)"

    def compose(self):
        yield self.line
        yield self.sparkline

    def on_mount(self) -> None:
        for name in ("models", "reply", "context_used", "status"):
            self.watch(self, name, self._fit, init=False)
        self._fit()

    def watch_acceptance(self, acceptance: tuple[float, ...]) -> None:
        self.sparkline.data = tuple(acceptance)

    def on_resize(self) -> None:
        self._fit()

    def _fit(self) -> None:
        width = self.content_size.width
        self.sparkline.display = width >= SPARKLINE_MIN_WIDTH
        models = self.models
        if isinstance(models, str):
            self.line.update(Text(models))
            return
        room = width - (SPARKLINE_WIDTH if self.sparkline.display else 0) if width else None
        self.line.update(stats_text.stats_line(
            mode=models.mode, target=models.target, draft=models.draft, stats=self.reply,
            draft_tokens=models.draft_tokens, context_used=self.context_used, n_ctx=models.n_ctx,
            status=self.status, width=room))


SPARKLINE_WIDTH = 31  # its width and margin in app.tcss
SPARKLINE_MIN_WIDTH = 110
