"""The conversation on screen: the message widgets, and the reply streaming into the last one.

A reply streams from its worker thread into a ReplyStream (tui/chat.py).  The
view drains it at most REPLY_FRAMES_PER_SECOND times a second, whatever the
token rate: each drain re-renders the reply's open block and lays the view out
again, and on a machine with few cores that work takes CPU from decoding (ggml's
threads spin while one of them waits for a core).  A stream that ends is
drained at once.  The view tells the app through messages: Progress (the
reply's live figures, at most every PROGRESS_INTERVAL_S: the stats bar they
feed need not move faster) and Ended (the stream, complete).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from textual.containers import VerticalScroll
from textual.message import Message
from textual.timer import Timer

from edgespec.stats import Stats
from tui.chat import ReplyStream
from tui.render import BlockRenderer
from tui.widgets import AssistantMessage, Note, UserMessage

REPLY_FRAMES_PER_SECOND = 15
PROGRESS_INTERVAL_S = 0.25


@dataclass
class Generation:
    """A reply being generated: its stream, its message on screen, and the new message it answers
    (None when it answers one the chat has already: a regeneration, an edit)."""

    stream: ReplyStream
    view: AssistantMessage
    prompt: str | None = None
    edit: Edit | None = None  # the edit it answers, undone if the reply fails
    saved_at: float = field(default_factory=time.monotonic)  # when the reply so far was saved last (ChatApp)
    label: str = "reply"  # its title: the model and the drafting it is written with


@dataclass(frozen=True)
class Edit:
    """An earlier message edited: its index and new text, and the conversation as it was before (ChatSession's
    messages, turn_stats and first_visible), to go back to when the edited one cannot be answered."""

    index: int
    text: str
    messages: list
    turn_stats: list
    first_visible: int


class ConversationView(VerticalScroll):
    """The chat's messages and notes, oldest first, following the newest while it streams."""

    class Progress(Message):
        """New figures of the streaming reply: its stats so far (None if unchanged), and per-step acceptance."""

        def __init__(self, stats: Stats | None, acceptance: list[float]):
            super().__init__()
            self.stats, self.acceptance = stats, acceptance

    class Ended(Message):
        """The streaming reply is complete (stream.result) or failed (stream.error); everything is shown."""

        def __init__(self, stream: ReplyStream, message: AssistantMessage):
            super().__init__()
            self.stream, self.message = stream, message

    class StreamFinished(Message, bubble=False):
        """Posted (from any thread) when the stream's worker is done, to drain it without waiting for a frame."""

    def __init__(self, renderer: BlockRenderer, mark_drafts: bool = True):
        super().__init__(id="conversation")
        self.renderer = renderer
        self.mark_drafts = mark_drafts
        self._streaming: tuple[ReplyStream, AssistantMessage] | None = None
        self._frames: Timer | None = None
        self._pending_stats: Stats | None = None  # gathered since the last Progress
        self._pending_acceptance: list[float] = []
        self._progress_posted = 0.0  # time.monotonic() of the last Progress

    def on_mount(self) -> None:
        self.anchor()
        self._frames = self.set_interval(1 / REPLY_FRAMES_PER_SECOND, self.drain, pause=True)

    # -- messages -------------------------------------------------------------------

    def add_note(self, text: str, kind: str = "error") -> None:
        self.mount(Note(text, kind))

    def add_user_message(self, text: str, index: int) -> None:
        self.mount(UserMessage(text, index))

    def has_user_messages(self) -> bool:
        return bool(self.query(UserMessage))

    def remove_last_reply(self) -> None:
        replies = self.query(AssistantMessage)
        if replies:
            replies.last().remove()

    def clear(self) -> None:
        self.remove_children()

    def show_messages(self, messages: list[dict], system_prompt: str | None, footers: dict[int, str],
                      drafted_ranges: Callable[[str], list], label: Callable[[str], str]) -> None:
        """Show a whole conversation, final (after reopening a chat, or after an error); label(text): the title
        of the reply of that text."""
        self.remove_children()
        if system_prompt:
            self.mount(Note(f"system prompt: {system_prompt}", "note"))
        for index, message in enumerate(messages):
            if message["role"] == "user":
                self.mount(UserMessage(message["content"], index))
                continue
            view = AssistantMessage(self.renderer, self.mark_drafts, label(message["content"]))
            self.mount(view)
            view.reply.set_text(message["content"], drafted_ranges(message["content"]))
            if index in footers:
                view.footer.update(footers[index])
        self.anchor()

    def set_marking(self, mark_drafts: bool) -> None:
        """Tint (or not) the text that came from accepted draft tokens, in every reply."""
        self.mark_drafts = mark_drafts
        for message in self.query(AssistantMessage):
            message.reply.set_marking(mark_drafts)

    # -- the streaming reply ------------------------------------------------------------

    def follow(self, stream: ReplyStream, title: str) -> AssistantMessage:
        """Show the reply that `stream` receives, as it arrives."""
        message = AssistantMessage(self.renderer, self.mark_drafts, title)
        self.mount(message)
        self.anchor()
        self._streaming = (stream, message)
        self._frames.resume()
        return message

    def on_conversation_view_stream_finished(self, _: StreamFinished) -> None:
        self.drain()

    def drain(self) -> None:
        """Show what the stream received since the last drain."""
        if self._streaming is None:
            return
        stream, message = self._streaming
        finished = stream.finished.is_set()  # read first: then nothing can follow the take
        pieces, acceptance, notices, live = stream.take()
        for notice in notices:
            self.mount(Note(notice, "note"), before=message)
        if pieces:
            message.reply.append(pieces)
        self._gather_progress(live, acceptance, finished)
        if finished:
            self._streaming = None
            self._frames.pause()
            self.post_message(self.Ended(stream, message))

    def _gather_progress(self, stats: Stats | None, acceptance: list[float], finished: bool) -> None:
        """Post the figures gathered since the last Progress, if PROGRESS_INTERVAL_S passed (or the reply ended)."""
        if stats is not None:
            self._pending_stats = stats
        self._pending_acceptance.extend(acceptance)
        now = time.monotonic()
        if finished or now - self._progress_posted >= PROGRESS_INTERVAL_S:
            if self._pending_stats is not None or self._pending_acceptance:
                self.post_message(self.Progress(self._pending_stats, self._pending_acceptance))
            self._pending_stats, self._pending_acceptance, self._progress_posted = None, [], now
