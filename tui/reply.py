"""A reply on screen: its Markdown blocks, streamed in at a cost that does not grow with the reply.

Every block but the last is final and rendered once.  The last, open block
can grow to hundreds of lines (a long code block); re-rendering all of it on
every update made the UI thread's work grow with the reply, and that work
took its share of the CPU (and the GIL) from decoding.  So an open block
keeps its settled lines in segments of SEGMENT_LINES lines, each rendered
once, and re-renders only the lines after them.  Prose renders line by
line, so its segments are exact; code is highlighted per segment while it
streams (a string spanning segments may be coloured wrongly for a moment)
and as a whole once the block is final.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rich.text import Text
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Static

from edgespec.control_chars import visible_controls
from tui.render import Block, BlockRenderer, split_blocks

SEGMENT_LINES = 8


def _segment_end(text: str, start: int, end: int) -> int | None:
    """Where the first SEGMENT_LINES whole lines of text[start:end] end, if more text follows them."""
    position = start
    for _ in range(SEGMENT_LINES):
        position = text.find("\n", position, end)
        if position == -1:
            return None
        position += 1
    return position if position < end else None


class BlockView(Vertical):
    """One Markdown block of a reply, shown in one segment when final, in several while it streams."""

    class CopyRequested(Message):
        """A code block was clicked: copy its code."""

        def __init__(self, code: str):
            super().__init__()
            self.code = code

    def __init__(self, block: Block):
        super().__init__(classes=block.kind)
        self.block = block
        self._source = ""  # the reply's text, which the block's offsets are in
        self._titled: tuple[str, str] | None = None  # the (kind, language) the title and tooltip show
        self._texts: list[Text] = []  # what each segment shows
        self._statics: list[Static] = []  # the segments mounted, in order
        self._settled_to: int | None = None  # while streaming: where the segment still re-rendered starts
        self._settled = 0  # while streaming: how many segments are settled
        self._mounted = False  # on_mount ran: segments can be mounted

    @property
    def rendered(self) -> Text:
        return Text("\n", end="").join(self._texts)

    def show(self, block: Block, text: str, rendered: Text) -> None:
        """Show the whole block, final: one segment."""
        self._retitle(block, text)
        self._settled_to = None
        self._texts = [rendered]
        self._sync(0)

    def grow(self, block: Block, text: str, render_part: Callable[[int, int], Text]) -> None:
        """Show an open block: settle each SEGMENT_LINES whole lines into a segment rendered once,
        and re-render only the rest; render_part(start, end) renders the block's text[start:end]."""
        moved = (block.kind, block.start, block.body_start) != (self.block.kind, self.block.start, self.block.body_start)
        if self._settled_to is None or moved:  # e.g. a fence line still arriving moves the code's start
            self._settled_to, self._settled = (block.body_start if block.kind == "code" else block.start), 0
        self._retitle(block, text)
        first_changed = self._settled
        del self._texts[self._settled:]  # the open segment: re-rendered below
        end = block.body_end if block.kind == "code" else block.end
        while (cut := _segment_end(text, self._settled_to, end)) is not None:
            self._texts.append(render_part(self._settled_to, cut))
            self._settled_to, self._settled = cut, self._settled + 1
        if self._settled_to < end or not self._texts:  # no empty line under the settled ones
            self._texts.append(render_part(self._settled_to, end))
        self._sync(first_changed)

    def _retitle(self, block: Block, text: str) -> None:
        self.block, self._source = block, text
        if (block.kind, block.language) == self._titled:  # set once: a title or tooltip set refreshes the widget
            return
        self._titled = (block.kind, block.language)
        self.set_class(block.kind == "code", "code")
        self.set_class(block.kind == "prose", "prose")
        # Text, not a str: a str title is read as markup, and the language comes from the model's output
        self.border_title = Text(visible_controls(block.language)) if block.kind == "code" and block.language else None
        self.tooltip = "click to copy this code" if block.kind == "code" else None

    @property
    def code(self) -> str:
        """A code block's code, without its fences ("" for prose)."""
        if self.block.kind != "code":
            return ""
        return self._source[self.block.body_start:self.block.body_end].rstrip("\n")

    def _sync(self, first_changed: int) -> None:
        """Bring the mounted segments up to self._texts, updating only from first_changed on."""
        if not self._mounted:  # on_mount shows what arrived before
            return
        if not self.is_attached:  # taken off the screen before its Mount was handled (the app quitting mid-reply)
            return
        for index in range(first_changed, len(self._texts)):
            if index < len(self._statics):
                self._statics[index].update(self._texts[index])
            else:
                segment = Static(self._texts[index], classes="segment")
                self._statics.append(segment)
                self.mount(segment)
        for extra in self._statics[len(self._texts):]:
            extra.remove()
        del self._statics[len(self._texts):]

    def on_mount(self) -> None:
        # Not self.is_mounted: Textual sets that only after the mount handlers ran, so a block
        # that was complete before it was mounted (the whole block in one drain) stayed empty.
        self._mounted = True
        self._sync(0)

    def on_click(self) -> None:
        if self.block.kind == "code":
            self.post_message(self.CopyRequested(self.code))


class ReplyView(Vertical):
    """A streamed reply: blocks before the last are final, so only the last is re-rendered."""

    def __init__(self, renderer: BlockRenderer, mark_drafts: bool):
        super().__init__(classes="reply")
        self.text = ""
        self.drafted = bytearray()  # 1 per character that came from an accepted draft token
        self._renderer = renderer
        self._mark = mark_drafts
        self._final_blocks = 0  # leading BlockViews that no new text can change
        self._open_from = 0  # where the first block that can still change starts
        self._streaming = True  # the last block grows in segments until finish()

    def append(self, pieces: list[tuple[str, bool]]) -> None:
        self.text += "".join(piece for piece, _ in pieces)
        for piece, drafted in pieces:
            self.drafted.extend((1 if drafted else 0,) * len(piece))
        self._render_tail()

    def set_text(self, text: str, drafted_ranges: list[list[int]]) -> None:
        """Show a whole reply (reopened, or cut by a stop string), final."""
        self.text = text
        self.drafted = bytearray(len(text))
        for start, end in drafted_ranges:
            end = min(end, len(text))
            self.drafted[start:end] = b"\x01" * max(0, end - start)
        self._final_blocks, self._open_from, self._streaming = 0, 0, False
        self._render_tail()

    def finish(self, text: str | None = None) -> None:
        """The reply is complete: render its last block whole (its code highlighted as one).

        text is the reply's final text when it may differ from what streamed in (a stop
        string cuts text that was already shown)."""
        if text is not None and text != self.text:
            self.set_text(text, self.drafted_ranges())
            return
        self._streaming = False
        self._render_tail()

    def drafted_ranges(self) -> list[list[int]]:
        ranges, position = [], self.drafted.find(1)
        while position != -1:
            end = self.drafted.find(0, position)
            end = len(self.drafted) if end == -1 else end
            ranges.append([position, end])
            position = self.drafted.find(1, end)
        return ranges

    def set_marking(self, mark: bool) -> None:
        self._mark = mark
        mask = bytes(self.drafted)
        for view in self.query_children(BlockView):
            view.show(view.block, self.text, self._renderer.render(view.block, self.text, mask, mark))

    def on_mount(self) -> None:
        self._render_tail()

    def _render_tail(self) -> None:
        if not self.is_attached:  # on_mount renders what arrived before
            return
        blocks = split_blocks(self.text, self._open_from)
        views = list(self.query_children(BlockView))
        mask = bytes(self.drafted)
        for number, block in enumerate(blocks, start=self._final_blocks):
            if number < len(views):
                view = views[number]
            else:
                view = BlockView(block)
                self.mount(view)
            if self._streaming and number == self._final_blocks + len(blocks) - 1:
                view.grow(block, self.text, lambda start, end, block=block: self._render_part(block, start, end, mask))
            else:
                view.show(block, self.text, self._renderer.render(block, self.text, mask, self._mark))
        for extra in views[self._final_blocks + len(blocks):]:  # a shorter text after set_text
            extra.remove()
        if len(blocks) > 1:
            self._final_blocks += len(blocks) - 1
            self._open_from = blocks[-1].start

    def _render_part(self, block: Block, start: int, end: int, mask: bytes) -> Text:
        if block.kind == "code":
            part = dataclasses.replace(block, body_start=start, body_end=end)
        else:
            part = dataclasses.replace(block, start=start, end=end)
        return self._renderer.render(part, self.text, mask, self._mark)
