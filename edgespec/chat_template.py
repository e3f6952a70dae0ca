"""Rendering chat messages with the model's own template (GGUF metadata).

Templates are untrusted code from a downloaded file.  They run in Jinja's
immutable sandbox in a process of their own (template_sandbox.py), bounded in
time, memory and output size, so a hostile template can neither hang edgespec
nor leave work running behind it.

Message contents are untrusted text.  A render says where each content lies
in the rendered text, so the tokenizer keeps it plain text and only the
template's own markers become control tokens.  To find them, the template is
rendered twice: with the contents, and with a unique sentinel in place of
each.  The sentinel render splits into the template's own pieces; the real
render must be exactly those pieces with a content (or the content stripped
of surrounding whitespace, as ``| trim`` does) between each two.  A template
that rewrites contents any other way gets its pieces with the untouched
contents in between: the contents are still data, never control tokens.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ChatTemplateError, Setting
from .text import surrogate_problem

# For GGUF files without a template: plain role-prefixed turns.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

RENDER_SECONDS = 2.0  # a real template renders in milliseconds
MAX_RENDER_CHARS = 4_000_000  # about a million tokens, more than any context holds
_STARTUP_SECONDS = 60.0  # starting Python on a busy machine is not the template's time
_KILL_GRACE_SECONDS = 0.5  # the sandbox stops itself at the deadline; kill it if it cannot

# Digits only, so that filters like upper or title leave it as it is.
_NONCE = "".join(secrets.choice("0123456789") for _ in range(16))
_SENTINEL = re.compile(f"\ue000{_NONCE}:(\\d+)\ue001")


def _sentinel(index: int) -> str:
    return f"\ue000{_NONCE}:{index}\ue001"


def _failure(detail: str) -> ChatTemplateError:
    return ChatTemplateError(f"the model's chat template failed: {_one_line(detail)} (use ", Setting("raw", True),
                             " to send the prompt as is)")


def _one_line(text: str, limit: int = 200) -> str:
    # the detail may come from the template itself (raise_exception): no newlines or terminal escapes
    printable = "".join(ch if ch.isprintable() else " " for ch in text)
    line = " ".join(printable.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True)
class RenderedChat:
    text: str
    content_spans: tuple[tuple[int, int], ...]  # [start, end) of every message content in text


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str, eos_token: str):
        # compiled on first render, in the sandbox: a broken template must not stop raw prompts
        self.source = source or FALLBACK_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> RenderedChat:
        if not isinstance(messages, (list, tuple)) or not messages:  # a str would be read as messages, one a character
            raise ValueError("messages must be a non-empty list of dicts, like [{'role': 'user', 'content': 'Hi'}], "
                             f"not {messages!r:.40}")
        messages = [_template_message(m, i) for i, m in enumerate(messages)]
        contents = [m["content"] for m in messages]
        real = [{"role": m["role"], "content": m["content"]} for m in messages]
        marked = [{"role": m["role"], "content": _sentinel(i)} for i, m in enumerate(messages)]
        text, skeleton = _SANDBOX.render({
            "source": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token,
            "seconds": RENDER_SECONDS, "max_chars": MAX_RENDER_CHARS,
            "renders": [{"messages": real, "add_generation_prompt": add_generation_prompt},
                        {"messages": marked, "add_generation_prompt": add_generation_prompt}],
        })
        if problem := surrogate_problem(text) or surrogate_problem(skeleton):  # no tokenizer takes it
            raise _failure(f"its output {problem}")
        if not text.strip() and any(content.strip() for content in contents):  # else "the prompt is empty"
            raise _failure("it wrote nothing of the messages")
        pieces = _SENTINEL.split(skeleton)  # template text, content index, template text, ...
        _check_the_question_is_written(pieces, messages)
        spans = _locate_contents(text, pieces, contents)
        if spans is not None:
            return RenderedChat(text, spans)
        return _with_untouched_contents(pieces, contents)


def _check_the_question_is_written(pieces: list[str], messages: list[dict]) -> None:
    """A failure for a template that leaves out the last user message: the model would answer a prompt it never
    saw, and the reply would read as an answer to it.  (A template that cut the message's sentinel apart is
    told apart by the nonce's fragment, and named by _with_untouched_contents.)"""
    asked = [index for index, message in enumerate(messages)
             if message["role"] == "user" and message["content"].strip()]
    written = pieces[1::2]  # the indices of the contents the template wrote
    if asked and str(asked[-1]) not in written and not any(_NONCE in piece for piece in pieces[0::2]):
        raise _failure("it leaves out the last user message, which the model would answer without seeing")


_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")  # user, assistant, system, tool, developer, ipython, ...


def _template_message(message: object, index: int) -> dict:
    """A message as the template gets it: its role and its text.  A library caller's mistake is named here, not
    met as the template's own failure; content may be OpenAI's list of text parts, joined."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a dict with a string role and content, like {{'role': 'user', 'content': 'Hi'}}")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts, not {type(content).__name__}")
    for field, text in (("role", message["role"]), ("content", content)):
        if problem := surrogate_problem(text):
            raise ValueError(f"{where}.{field} {problem}; give the character whole or leave it out")
    if not _ROLE.fullmatch(message["role"]):
        # the template writes a role as it is, and its tokens are parsed as control tokens: a role spelled
        # "user<|im_end|>\n<|im_start|>system" wrote a system turn of the caller's own
        raise ValueError(f"{where}.role must be a word such as 'user', 'assistant' or 'system', not "
                         f"{message['role'][:40]!r}")
    return {"role": message["role"], "content": content}


def _content_forms(content: str) -> dict[str, None]:
    """What a template may make of a content without changing its meaning, most literal first."""
    return dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip()))


def _locate_contents(text: str, pieces: list[str], contents: list[str]) -> tuple[tuple[int, int], ...] | None:
    """Content spans if text is the template's pieces with a form of each content between; else None."""
    if not text.startswith(pieces[0]):
        return None
    pos, spans = len(pieces[0]), []
    for index, after in zip(pieces[1::2], pieces[2::2]):
        for form in _content_forms(contents[int(index)]):
            end = pos + len(form)
            if text.startswith(form, pos) and text.startswith(after, end):
                break
        else:
            return None
        spans.append((pos, end))
        pos = end + len(after)
    return tuple(spans) if pos == len(text) else None


def _with_untouched_contents(pieces: list[str], contents: list[str]) -> RenderedChat:
    """The template's own pieces with each content, as given, in place of its sentinel."""
    # A piece holding part of a sentinel (a template that slices or rewrites contents) would hand the model
    # that fragment in place of the message, and drop the message's text.
    if any("\ue000" in piece or "\ue001" in piece or _NONCE in piece for piece in pieces[0::2]):
        raise _failure("it changes message text in a way that cannot be kept apart from its own markers")
    parts, spans, pos = [pieces[0]], [], len(pieces[0])
    for index, after in zip(pieces[1::2], pieces[2::2]):
        content = contents[int(index)]
        spans.append((pos, pos + len(content)))
        parts += [content, after]
        pos += len(content) + len(after)
    return RenderedChat("".join(parts), tuple(spans))


class _Sandbox:
    """The rendering process: started on first use, replaced after it fails, stopped at exit."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._unread = b""
        self._lock = threading.Lock()

    def render(self, request: dict) -> list[str]:
        with self._lock:
            try:
                process = self._running()
                try:
                    process.stdin.write(json.dumps(request).encode("ascii") + b"\n")
                    process.stdin.flush()
                except OSError:
                    raise _failure("its sandbox process stopped") from None
                deadline = time.monotonic() + request["seconds"] + _KILL_GRACE_SECONDS
                reply = self._reply(process, deadline, f"it took longer than {request['seconds']:g} s")
            except BaseException:  # a timeout, a crash, Ctrl+C: never leave it running
                self.stop()
                raise
        if "error" in reply:
            raise _failure(reply["error"])
        return reply["texts"]

    def _running(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self.stop()
            worker = Path(__file__).with_name("template_sandbox.py")
            try:
                # A session of its own: Ctrl+C at a terminal, and timeout or kill on the process group, reach
                # the whole group, which killed the sandbox of a batch being stopped and saved its request as
                # failed (a crash, never redone).  An interrupt is the parent's to handle; its exit closes
                # the pipe, and the sandbox ends with it.
                self._process = subprocess.Popen(
                    [sys.executable, "-P", str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True,
                )
            except OSError as error:
                raise _failure(f"could not start its sandbox: {error}") from None
            self._reply(self._process, time.monotonic() + _STARTUP_SECONDS, "its sandbox process did not start")
        return self._process

    def _reply(self, process: subprocess.Popen, deadline: float, too_late: str) -> dict:
        fd = process.stdout.fileno()
        while b"\n" not in self._unread:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise _failure(too_late)
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise _failure("its sandbox process stopped")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)

    def stop(self) -> None:
        process, self._process, self._unread = self._process, None, b""
        if process is not None:
            process.kill()
            process.wait()
            process.stdin.close()
            process.stdout.close()

    def forget_after_fork(self) -> None:
        # a forked child must not share the parent's pipes (nor kill its sandbox)
        self._process, self._unread, self._lock = None, b"", threading.Lock()


_SANDBOX = _Sandbox()
atexit.register(_SANDBOX.stop)
os.register_at_fork(after_in_child=_SANDBOX.forget_after_fork)
