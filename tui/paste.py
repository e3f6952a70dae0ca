"""Bracketed pastes that reach the app whole and as text, whatever bytes they hold.

Textual's terminal parser (textual 8.2) reads an ESC inside a bracketed paste
as the start of a key sequence: the bytes after it, up to the paste's end,
are replayed as key presses before the rest arrives as the paste.  So
"CCC<ESC>[31mDDD" became "^31mDDDCCC" in the prompt, and a BEL inside an OSC
string was a Ctrl+G press that switched the drafting mode.

PasteSafeParser sits in front of that parser: it holds a paste back until its
end marker, makes it plain text (edgespec.control_chars), and only then hands it
on, so the parser sees a paste without escapes and makes it one Paste event.
Everything outside a paste passes through at once (a lone Esc press is not
delayed).  `guard_terminal_pastes` makes the terminal driver use it.
"""

from __future__ import annotations

from typing import Iterable

from textual._xterm_parser import XTermParser
from textual.message import Message

from edgespec.control_chars import plain_text

PASTE_START = "\x1b[200~"
PASTE_END = "\x1b[201~"
# A paste whose end never comes (a broken terminal) is handed on once this long, not held forever.
MAX_HELD_PASTE_CHARS = 4 * 2**20


class PasteSafeParser(XTermParser):
    def __init__(self, debug: bool = False) -> None:
        super().__init__(debug)
        self._in_paste = False
        self._held = ""  # the paste so far, raw
        self._recent = ""  # the end of what passed through: a start marker may be split between reads

    def feed(self, data: str) -> Iterable[Message]:
        if not data:  # the end of input: hand on what is held, then close
            if self._in_paste:
                yield from super().feed(plain_text(self._held) + PASTE_END)
                self._in_paste, self._held = False, ""
            yield from super().feed(data)
            return
        while data:
            if self._in_paste:
                data = yield from self._hold(data)
            else:
                data = yield from self._pass_until_paste(data)

    def _pass_until_paste(self, data: str):
        """Hand on data up to and including a paste's start marker; returns what follows it."""
        seen = self._recent + data
        start = seen.find(PASTE_START)
        if start == -1:
            self._recent = seen[-(len(PASTE_START) - 1):]
            yield from super().feed(data)
            return ""
        after = start + len(PASTE_START) - len(self._recent)  # in data: the marker may have begun before it
        yield from super().feed(data[:after])
        self._in_paste, self._held, self._recent = True, "", ""
        return data[after:]

    def _hold(self, data: str):
        """Hold data back until the paste ends; then hand on the paste as plain text and return what follows."""
        searched = max(0, len(self._held) - len(PASTE_END) + 1)  # an end marker may have begun in the last read
        self._held += data
        end = self._held.find(PASTE_END, searched)
        if end == -1 and len(self._held) < MAX_HELD_PASTE_CHARS:
            return ""
        if end == -1:
            end = len(self._held)
        rest = self._held[end + len(PASTE_END):]
        yield from super().feed(plain_text(self._held[:end]) + PASTE_END)
        self._in_paste, self._held = False, ""
        return rest


def guard_terminal_pastes() -> None:
    """Make Textual's Linux and macOS terminal driver read input through PasteSafeParser.

    The driver makes its parser by the module-level name XTermParser, so that name is
    replaced (for this process: call it before App.run).  A Textual that no longer has
    it keeps its own parser.
    """
    from textual.drivers import linux_driver

    if getattr(linux_driver, "XTermParser", None) is XTermParser:
        linux_driver.XTermParser = PasteSafeParser
