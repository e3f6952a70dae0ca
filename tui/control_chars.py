"""Text from outside the app (a paste, a saved chat being exported) made plain: no terminal controls.

A pasted or generated escape sequence is data, but a terminal or an editor
that shows it obeys it: it recolours the screen, sets the window title, or
(a BEL) rings.  `plain_text` drops escape sequences whole (CSI, OSC, DCS and
the like, with their parameters, so no "[31m" is left behind), C1 controls,
and C0 controls other than newline and tab; a carriage return becomes a
newline, as terminals send Enter inside a paste.
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
# C0 but tab and newline (carriage returns are turned into newlines first), DEL, and C1
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain_text(text: str) -> str:
    """text without terminal escape sequences and control characters; line breaks kept as \\n."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ESCAPE_SEQUENCE.sub("", text)
    return _CONTROL.sub("", text)
