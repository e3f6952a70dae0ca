"""Text from outside the program (a paste, a model's reply, a saved chat being exported) shown safely.

A pasted or generated escape sequence is data, but a terminal or an editor
that shows it obeys it: it recolours the screen, sets the window title, or
(a BEL) rings.  `plain_text` drops escape sequences whole (CSI, OSC, DCS and
the like, with their parameters, so no "[31m" is left behind), C1 controls,
and C0 controls other than newline and tab; a carriage return becomes a
newline, as terminals send Enter inside a paste.

Text the app shows (a model's reply, a message of a reopened chat) is not
changed, only shown safely: `visible_controls` draws each control character
as a symbol (ESC as ␛), one for one, so offsets into the text still hold.
Rich and Textual drop only BEL, BS, VT, FF and CR; an ESC reached the
terminal, and a reply holding "ESC]2;...BEL" retitled its window.
`terminal_text` is the same for text written straight to a terminal
(`edgespec run`), where a carriage return is drawn too: it would move the
cursor back and let the rest of the line hide what was shown before it.
"""

from __future__ import annotations

import re

_ESCAPE_SEQUENCE = re.compile(
    r"""
    \x1b\[ [0-?]* [ -/]* [@-~]                      # CSI: ESC [ parameters intermediates final
    | \x1b[\]PX^_] .*? (?:\x07|\x1b\\|\x9c|$)       # OSC, DCS, SOS, PM, APC: up to BEL or ST, else the line's end
    | \x9b [0-?]* [ -/]* [@-~]                      # CSI as one C1 byte
    | [\x90\x98\x9d-\x9f] .*? (?:\x07|\x1b\\|\x9c|$)  # DCS, SOS, OSC, PM, APC as one C1 character
    | \x1b [ -/]* [0-~]?                            # any other escape: ESC, intermediates, final
    """,
    re.VERBOSE | re.MULTILINE,  # `.` stops at a newline: an unterminated string costs one line at most
)
# The bidirectional embeddings, overrides and isolates: a terminal or editor that honours them draws the text
# after one in another order than it is read (code that shows one thing and runs another, a reversed title).
_BIDI = "\u202a-\u202e\u2066-\u2069"
# C0 but tab, newline and carriage return (which Rich drops), DEL, C1 and bidi: what visible_controls draws
_SHOWN_CONTROL = re.compile(f"[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f{_BIDI}]")
# ... and carriage return: what terminal_text draws
_TERMINAL_CONTROL = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_BIDI}]")
# C0 but tab and newline (carriage returns are turned into newlines first), DEL, C1 and bidi
_CONTROL = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_BIDI}]")


def plain_text(text: str) -> str:
    """text without terminal escape sequences and control characters; line breaks kept as \\n."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ESCAPE_SEQUENCE.sub("", text)
    return _CONTROL.sub("", text)


def visible_controls(text: str) -> str:
    """text with each control character but tab, newline and carriage return drawn as a symbol: C0 as its
    Unicode control picture (ESC as ␛), DEL as ␡, C1 and the bidi controls as �; one character for one."""
    return _SHOWN_CONTROL.sub(_control_picture, text)


def _control_picture(match: re.Match) -> str:
    code = ord(match.group())
    return chr(0x2400 + code) if code < 0x20 else "\u2421" if code == 0x7F else "\ufffd"


def terminal_text(text: str) -> str:
    """text as visible_controls draws it, carriage returns drawn as well (as ␍): safe to write to a
    terminal as it is."""
    return _TERMINAL_CONTROL.sub(_control_picture, text)
