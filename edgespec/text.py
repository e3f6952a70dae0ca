"""Text in and out: whether a string given is text at all, and generated token bytes -> text that is safe to
show (whole UTF-8 characters, stop strings cut)."""

from __future__ import annotations

import codecs
from typing import Sequence


def surrogate_problem(text: str) -> str | None:
    """What makes text no text, for an error message ("holds a lone UTF-16 surrogate ('\\ud800' at character
    6), which is not text"), or None.  JSON's escapes and Python's str can hold half of a UTF-16 pair, which
    has no UTF-8 form, so no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"holds a lone UTF-16 surrogate ({text[error.start]!r} at character {error.start}), "
                "which is not text")
    return None


def surrogates_escaped(text: str) -> str:
    """text with each lone surrogate written as its escape ("\\ud800"), so that it can be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_kind(value: object) -> str:
    """What a value parsed from JSON is, in JSON's words ("array", "null"): an error names what was written, not
    Python's type."""
    kinds = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def check_text(text: object, what: str) -> None:
    """Refuse what is not a str, or no text (see surrogate_problem), naming what it is ("the prompt")."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, not {type(text).__name__}")
    if problem := surrogate_problem(text):
        raise ValueError(f"{what} {problem}; give the character whole or leave it out")


class TextAssembler:
    """Token bytes -> text that is safe to show now.

    Holds back an incomplete UTF-8 sequence, and any tail that could be the
    start of a stop string, until the next token settles it.
    """

    def __init__(self, stops: Sequence[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""
        self._released: list[str] = []  # joined only when asked: appending stays O(1) per token
        self.stopped = False

    def feed(self, data: bytes) -> str:
        text = self._held + self._decoder.decode(data)
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut], "")
        hold = max((_overlap(text, s) for s in self._stops), default=0)
        return self._release(text[: len(text) - hold], text[len(text) - hold :])

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def flush(self) -> str:
        """At the end: the text held back for a stop string that never came.  The bytes of a character
        cut off by the end (max_tokens in the middle of an emoji) are dropped: shown, they would be a
        U+FFFD the model never wrote."""
        if self.stopped:
            return ""
        self._decoder.reset()
        return self._release(self._held, "")

    def _release(self, out: str, held: str) -> str:
        self._held = held
        self._released.append(out)
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
