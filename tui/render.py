"""Turn a reply's Markdown into Rich Text blocks, tinting the characters the draft guessed.

A reply only ever grows at its end, so every block but the last is final: the
view renders a finished block once and re-renders only the open one as tokens
arrive.  Markdown is parsed here, not by a Markdown widget, because the tint
has to follow source characters through code highlighting and inline markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from rich.style import Style
from rich.syntax import PygmentsSyntaxTheme
from rich.text import Text

from edgespec.control_chars import visible_controls

CODE_THEME = "monokai"
DEFAULT_DRAFT_TINT = "#24513a"

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+")
_RULE = re.compile(r"^[ \t]*([-*_])([ \t]*\1){2,}[ \t]*$")
_QUOTE = re.compile(r"^[ \t]*>[ \t]?")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+")
_NUMBERED = re.compile(r"^([ \t]*)(\d{1,3}[.)])[ \t]+")
MAX_LINK_TEXT = 300  # characters of a Markdown link's text and target drawn as a link; longer ones stay plain
MAX_LINK_TARGET = 2000
# Inline spans: (pattern, style name, group holding the visible text).
_INLINE = re.compile(
    r"(?P<code>`+)(?P<code_text>[^`\n]+?)(?P=code)"
    r"|\*\*(?P<bold>[^*\n]+?)\*\*"
    r"|__(?P<bold2>[^_\n]+?)__"
    r"|(?<![\w*])\*(?P<italic>[^*\s](?:[^*\n]*?[^*\s])?)\*(?![\w*])"
    r"|(?<!\w)_(?P<italic2>[^_\s](?:[^_\n]*?[^_\s])?)_(?!\w)"
    # bounded, as links are short: unbounded, each "[" of a long line without a closing ")" searched the rest of
    # the line, and a 160,000-character line of "[a](" took 21 s to draw
    r"|\[(?P<link>[^\]\n]{1,%d})\]\([^)\s]{1,%d}\)" % (MAX_LINK_TEXT, MAX_LINK_TARGET)
)

STYLES = {
    "heading": Style(bold=True, color="#61afef"),
    "heading1": Style(bold=True, underline=True, color="#61afef"),
    "code": Style(color="#e5c07b", bgcolor="#303030"),
    "bold": Style(bold=True),
    "italic": Style(italic=True),
    "link": Style(underline=True, color="#56b6c2"),
    "marker": Style(color="#7f848e"),
    "quote": Style(italic=True, color="#abb2bf"),
}
_INLINE_STYLE = {
    "code_text": "code", "bold": "bold", "bold2": "bold",
    "italic": "italic", "italic2": "italic", "link": "link",
}


@dataclass(frozen=True)
class Block:
    """A run of the reply, as character offsets into it."""

    kind: str  # "prose" | "code"
    start: int
    end: int
    body_start: int = 0  # code: first character after the opening fence line
    body_end: int = 0  # code: first character of the closing fence line, or end
    language: str = ""


def split_blocks(text: str, start: int = 0) -> list[Block]:
    """Split text[start:] into prose paragraphs and fenced code blocks.

    `start` must be a block start (0 or the start of a block this function
    returned), so that it lies outside any code fence.
    """
    blocks: list[Block] = []
    prose_start: int | None = None
    fence: tuple[str, int, int, str] | None = None  # marker, start, body_start, language
    position = start
    for line in text[start:].splitlines(keepends=True):
        line_end = position + len(line)
        if fence is not None:
            marker, fence_start, body_start, language = fence
            stripped = line.strip()
            if stripped and stripped == stripped[0] * len(stripped) and stripped[0] == marker[0] \
                    and len(stripped) >= len(marker):
                blocks.append(Block("code", fence_start, line_end, body_start, position, language))
                fence = None
        else:
            opening = _FENCE.match(line)
            if opening or not line.strip():
                if prose_start is not None:
                    blocks.append(Block("prose", prose_start, position))
                    prose_start = None
                if opening:
                    fence = (opening.group(1), position, line_end, opening.group(2))
            elif prose_start is None:
                prose_start = position
        position = line_end
    if fence is not None:
        marker, fence_start, body_start, language = fence
        blocks.append(Block("code", fence_start, len(text), body_start, len(text), language))
    elif prose_start is not None:
        blocks.append(Block("prose", prose_start, len(text)))
    return blocks


class BlockRenderer:
    """Renders blocks of one reply; `drafted[i]` is 1 when character i came from the draft."""

    def __init__(self, draft_tint: str = DEFAULT_DRAFT_TINT):
        self._draft_style = Style(bgcolor=draft_tint)
        self._code_theme = PygmentsSyntaxTheme(CODE_THEME)

    def render(self, block: Block, text: str, drafted: bytes, mark: bool) -> Text:
        mask = drafted if mark else None
        if block.kind == "code":
            return self._render_code(block, text, mask)
        return self._render_prose(block, text, mask)

    def _render_code(self, block: Block, text: str, mask: bytes | None) -> Text:
        code = visible_controls(text[block.body_start:block.body_end].rstrip("\n"))
        out = Text(no_wrap=False, end="")
        try:
            lexer = get_lexer_by_name(block.language or "text", stripnl=False, ensurenl=False)
        except ClassNotFound:
            lexer = get_lexer_by_name("text", stripnl=False, ensurenl=False)
        for _, token_type, value in lexer.get_tokens_unprocessed(code):
            out.append(value, self._code_theme.get_style_for_token(token_type))
        if mask is not None:
            self._tint(out, mask, block.body_start, 0, len(code))
        return out

    def _render_prose(self, block: Block, text: str, mask: bytes | None) -> Text:
        out = Text(end="")
        position = block.start
        for line in text[block.start:block.end].splitlines(keepends=True):
            self._render_line(out, text, position, position + len(line.rstrip("\n")), mask)
            if line.endswith("\n") and position + len(line) < block.end:
                out.append("\n")
            position += len(line)
        out.rstrip()
        return out

    def _render_line(self, out: Text, text: str, start: int, end: int, mask: bytes | None) -> None:
        line = text[start:end]
        base: Style | None = None
        if _RULE.match(line):
            out.append("─" * 40, STYLES["marker"])
            return
        if heading := _HEADING.match(line):
            base = STYLES["heading1" if len(heading.group(1)) == 1 else "heading"]
            start += heading.end()
        elif quote := _QUOTE.match(line):
            out.append("▌ ", STYLES["marker"])
            base = STYLES["quote"]
            start += quote.end()
        elif bullet := _BULLET.match(line):
            out.append(bullet.group(1) + "• ", STYLES["marker"])
            start += bullet.end()
        elif numbered := _NUMBERED.match(line):
            out.append(f"{numbered.group(1)}{numbered.group(2)} ", STYLES["bold"])
            start += numbered.end()
        self._render_inline(out, text, start, end, base, mask)

    def _render_inline(self, out: Text, text: str, start: int, end: int,
                       base: Style | None, mask: bytes | None) -> None:
        position = start
        for match in _INLINE.finditer(text, start, end):
            self._append_source(out, text, position, match.start(), base, mask)
            group = next(name for name in _INLINE_STYLE if match.group(name) is not None)
            style = STYLES[_INLINE_STYLE[group]]
            self._append_source(out, text, match.start(group), match.end(group),
                                base + style if base else style, mask)
            position = match.end()
        self._append_source(out, text, position, end, base, mask)

    def _append_source(self, out: Text, text: str, start: int, end: int,
                       style: Style | None, mask: bytes | None) -> None:
        if start >= end:
            return
        offset = len(out)
        out.append(visible_controls(text[start:end]), style)  # one symbol a control: the tint's offsets hold
        if mask is not None:
            self._tint(out, mask, start, offset, end - start)

    def _tint(self, out: Text, mask: bytes, source_start: int, out_start: int, length: int) -> None:
        """Stylize the runs of drafted characters in mask[source_start:+length]."""
        end = min(source_start + length, len(mask))
        position = mask.find(1, source_start, end)
        while position != -1:
            run_end = mask.find(0, position, end)
            if run_end == -1:
                run_end = end
            out.stylize(self._draft_style, out_start + position - source_start,
                        out_start + run_end - source_start)
            position = mask.find(1, run_end, end)
