"""A saved chat as a Markdown file, with the text the draft guessed optionally marked.

Marks are <mark>…</mark> around drafted runs of prose.  Code (fenced blocks
and `inline spans`) is left exactly as the model wrote it, so that it can be
copied from the file: a mark inside it would be read as code.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.control_chars import plain_text
from tui.history import StoredChat, content_key
from tui.render import split_blocks

_INLINE_CODE = re.compile(r"(`+)[^`\n]+?\1")


class ExportError(EdgespecError):
    """The chat cannot be written where asked."""


def chat_markdown(chat: StoredChat, mark_drafts: bool) -> str:
    """The chat as Markdown: its title, system prompt and messages, replies marked if asked.

    Plain text (edgespec.control_chars): an escape sequence that a paste or a model put in a
    message would act on the terminal or editor that shows the file."""
    return plain_text(_markdown(chat, mark_drafts))


def _markdown(chat: StoredChat, mark_drafts: bool) -> str:
    drafted = chat.extras.get("drafted", {}) if mark_drafts else {}
    lines = [f"# {chat.title}", ""]
    if mark_drafts:
        lines += ["Text that a drafter proposed and the model accepted is <mark>marked</mark> "
                  "(outside code, which is left as written).", ""]
    if chat.session.get("system_prompt"):
        lines += ["**System prompt:** " + chat.session["system_prompt"], ""]
    endings = _unfinished_endings(chat.session)
    for index, message in enumerate(chat.session.get("messages", [])):
        content = message["content"]
        if message["role"] == "user":
            lines += ["## You", "", content, ""]
            continue
        ranges = drafted.get(content_key(content), [])
        lines += ["## Assistant", "", _marked(content, ranges) if ranges else content, ""]
        if message.get("cancelled") or index in endings:  # the app says so under the reply; so does the file
            lines += [f"*({endings.get(index, 'stopped')})*", ""]
    return "\n".join(lines)


# A reply's finish reason, as the chat footer says it (tui/stats.py), where the reply may be unfinished.
_UNFINISHED = {"cancelled": "stopped", "length": "cut at max tokens", "context": "cut where the context was full"}


def _unfinished_endings(session: dict) -> dict[int, str]:
    """By message index, how each reply that may be unfinished ended: a stopped reply read as a whole answer."""
    endings = {}
    for turn in session.get("turn_stats", []):
        index, ending = turn.get("message_index"), _UNFINISHED.get(turn.get("finish_reason"))
        if isinstance(index, int) and ending is not None:
            endings[index] = ending
    return endings


def _marked(text: str, ranges: list) -> str:
    """text with <mark> around the drafted runs that lie in prose outside inline code."""
    markable = bytearray(len(text))
    for block in split_blocks(text):
        if block.kind == "prose":
            markable[block.start:block.end] = b"\x01" * (block.end - block.start)
    for span in _INLINE_CODE.finditer(text):
        markable[span.start():span.end()] = bytes(span.end() - span.start())
    drafted = bytearray(len(text))
    for start, end in ranges:
        start, end = max(0, start), min(end, len(text))
        drafted[start:end] = b"\x01" * max(0, end - start)
    out, inside = [], False
    for index, char in enumerate(text):
        wanted = bool(drafted[index] and markable[index]) and char != "\n"
        if wanted != inside:
            out.append("<mark>" if wanted else "</mark>")
            inside = wanted
        out.append(char)
    if inside:
        out.append("</mark>")
    return "".join(out)


def write_new_file(path: Path, text: str) -> Path:
    """Write text to path, which must not exist yet, in one step: never over a file already there."""
    # what the user typed may be no path the system takes: each is said in the dialog, not a crash of the app
    if "\0" in str(path):
        raise ExportError("a file name cannot hold a NUL character; type another name")
    try:
        path = path.expanduser()
    except RuntimeError:  # ~name for a user this system does not have
        raise ExportError(f"{path}: there is no such user's home folder; write the folder out in full") from None
    try:
        exists, in_a_folder = path.exists(), path.parent.is_dir()
    except OSError as error:  # e.g. a name longer than the file system allows
        raise ExportError(f"cannot write {path}: {error.strerror or error}; choose another name") from None
    if exists:
        raise ExportError(f"{path} already exists; choose another name (nothing is overwritten)")
    if not in_a_folder:
        raise ExportError(f"{path.parent} is not a folder; choose a path in an existing folder")
    try:
        descriptor, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    except OSError as error:
        raise ExportError(f"cannot write in {path.parent}: {error.strerror or error}") from None
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp makes it private; an export need not be
        os.link(temp, path)  # unlike a rename, fails if path appeared meanwhile
    except FileExistsError:
        raise ExportError(f"{path} already exists; choose another name (nothing is overwritten)") from None
    except OSError as error:
        raise ExportError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        Path(temp).unlink(missing_ok=True)
    return path


def default_export_path(folder: Path, title: str) -> Path:
    """A path in folder for a chat's export, named from its title (letters, digits and dashes), that no file
    has yet: a second export of a chat proposed the first's name, which the export refuses to write over."""
    slug = re.sub(r"[^\w]+", "-", title.lower(), flags=re.ASCII).strip("-")[:40] or "chat"
    path, n = folder / f"{slug}.md", 1
    while path.exists():
        n += 1
        path = folder / f"{slug}-{n}.md"
    return path
