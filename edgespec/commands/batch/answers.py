"""What counts as an answer in OUT: a chat.completion or text_completion whose choices carry text.

A server reached with --endpoint is data from outside. A 200 from it may be a
proxy's HTML page, an `{"error": ...}` object, an empty or cut body, an event
stream, or JSON of any other shape; none of them is an answer, and none may be
saved as a success. This check is the one line between the two: remote.py
applies it to every 200 before writing it, and output.py to every 200 record
it reads back, so a record that an older edgespec saved from such a body is
redone on resume.
"""

from __future__ import annotations

from ...text import json_kind
from .requests import CHAT_URL, COMPLETIONS_URL

CHAT_OBJECT = "chat.completion"
COMPLETION_OBJECT = "text_completion"
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def answer_object(url: str) -> str:
    """The "object" of an answer to a request for url."""
    return CHAT_OBJECT if url == CHAT_URL else COMPLETION_OBJECT


def answer_problem(url: str, body: object) -> str | None:
    """What keeps body from being an answer to a request for url, or None when it is one."""
    if not isinstance(body, dict):
        return f"it is a JSON {json_kind(body)}, not an object"
    if body.get("error") is not None:
        return f"it holds an error: {_error_text(body['error'])}"
    expected = answer_object(url)
    if body.get("object") != expected:
        return f'its "object" is {_shown(body.get("object"))}, not "{expected}"'
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return '"choices" is missing or empty'
    for index, choice in enumerate(choices):
        problem = _chat_choice_problem(choice) if url == CHAT_URL else _completion_choice_problem(choice)
        if problem is not None:
            return f"choices[{index}] {problem}"
    return _usage_problem(body.get("usage"))


def is_answer(body: object) -> bool:
    """Whether body is an answer of either kind (a record does not say which url it answered)."""
    return any(answer_problem(url, body) is None for url in (CHAT_URL, COMPLETIONS_URL))


def _chat_choice_problem(choice: object) -> str | None:
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        return 'has no "message" object'
    content = message.get("content")
    if isinstance(content, str):
        return None
    # A reply that calls tools (a body with "tools") or refuses has no text, and is still an answer.
    if content is None and (_non_empty_list(message.get("tool_calls")) or isinstance(message.get("refusal"), str)):
        return None
    return 'has a "message" without text "content"'


def _completion_choice_problem(choice: object) -> str | None:
    if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
        return 'has no "text" string'
    return None


def _usage_problem(usage: object) -> str | None:
    if usage is None:
        return None  # a server need not report usage; the summary then counts no tokens for it
    if not isinstance(usage, dict):
        return '"usage" is not an object'
    for field in USAGE_COUNTS:
        value = usage.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f'"usage.{field}" is {_shown(value)}, not a token count'
    return None


def _non_empty_list(value: object) -> bool:
    return isinstance(value, list) and bool(value)


def _error_text(error: object) -> str:
    message = error.get("message") if isinstance(error, dict) else error
    return _shown(message)


def _shown(value: object, limit: int = 120) -> str:
    """A server's value, quoted for a message: one printable line, cut to limit characters."""
    text = repr(value)
    printable = "".join(ch if ch.isprintable() else " " for ch in text)
    return printable if len(printable) <= limit else printable[: limit - 1] + "…"
