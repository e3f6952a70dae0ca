"""Reading IN: one request per line, OpenAI Batch or plain prompts, each with the fingerprint resuming checks.

A bad line is an InvalidRequest (it gets an error record); only duplicate
custom_ids or an unreadable file refuse the whole batch.  A body that a local
engine is to run is checked by edgespec serve's own check (for_the_engine).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ...chat_template import MAX_RENDER_CHARS
from ...errors import EdgespecError
from ...units import format_size
from ...server.protocol import ApiError, check_body, worded_for_requests

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EXIT_REFUSED = 2
# What a batch reads of IN at most: past OpenAI's Batch API's own limit, 200 MB, and what it parses fits in memory
MAX_INPUT_BYTES = 256 << 20


def failure_text(reason: object) -> str:
    """What a request's error record says of why it failed: an engine error's settings worded for a batch
    (its flags; a "/v1/completions" request for a prompt sent as is)."""
    return worded_for_requests(reason, operator="") if isinstance(reason, EdgespecError) else str(reason)


class BatchError(EdgespecError):
    """The batch cannot run: unreadable input, duplicate ids, corrupt or unwritable output."""

    exit_code = EXIT_REFUSED


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    line: int
    url: str  # CHAT_URL or COMPLETIONS_URL
    messages: tuple[dict, ...] = ()  # chat requests (from a body: once for_the_engine checked it)
    prompt: str = ""  # completion requests (likewise)
    overrides: tuple[tuple[str, object], ...] = ()  # SamplingParams fields set by the body (likewise)
    prediction: str = ""  # the body's predicted output (OpenAI's Predicted Outputs): a draft source (likewise)
    fingerprint: str = dataclasses.field(default="", compare=False)  # see request_fingerprint
    body: dict | None = dataclasses.field(default=None, compare=False)  # IN's body as it is; None for a plain line
    # The sampling settings this run gives the request, which its answer's record keeps (see
    # output.is_done); None where they could not be worked out (a bad value: its error record says so).
    sampling: dict | None = dataclasses.field(default=None, compare=False)


@dataclass(frozen=True)
class InvalidRequest:
    custom_id: str
    line: int
    code: str
    message: str
    fingerprint: str = dataclasses.field(default="", compare=False)


class _LineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def read_requests(path: Path) -> list[BatchRequest | InvalidRequest]:
    """Parse every non-blank line; bad lines become InvalidRequest entries."""
    entries = []
    for line_no, raw in enumerate(_read_input(path).split(b"\n"), start=1):
        if raw.strip():
            entries.append(parse_line(raw, line_no))
    return entries


def _read_input(path: Path) -> bytes:
    """IN's bytes, a UTF-8 byte-order mark left out; BatchError for what is no batch input.

    Read in a bounded way (a file, or a pipe such as bash's <(...)): /dev/zero took all the machine's memory
    until the process was killed, and a model file given as IN became 464,000 error records."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            data = head.removeprefix(codecs.BOM_UTF8)  # Windows editors start UTF-8 files with one
            # PowerShell's Out-File writes UTF-16: read as UTF-8, every line was an error record of its own
            for encoding, marks in (("UTF-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
                                    ("UTF-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))):
                if data.startswith(marks):
                    raise BatchError(f"batch input {path} is {encoding} text (it starts with a {encoding} byte-order "
                                     f"mark), and a batch reads UTF-8; convert it first, e.g. with iconv -f {encoding} "
                                     "-t UTF-8")
            if b"\0" in head:  # JSON text never holds a NUL byte: a model, an archive, /dev/zero
                raise BatchError(f"batch input {path} is binary, not JSONL text (it holds NUL bytes); give a file of "
                                 "one JSON request per line (is IN a model file?)")
            data += f.read(max(0, MAX_INPUT_BYTES + 1 - len(head)))
    except OSError as err:
        raise BatchError(f"cannot read batch input {path}: {err.strerror}; check the path") from None
    if len(data) > MAX_INPUT_BYTES:
        raise BatchError(f"batch input {path} is larger than {format_size(MAX_INPUT_BYTES)}; split it into smaller "
                         "files and run each")
    return data


def parse_line(raw: bytes, line_no: int) -> BatchRequest | InvalidRequest:
    fallback_id = f"line-{line_no}"
    try:
        value = json.loads(raw.decode("utf-8"))
        fingerprint = request_fingerprint(value)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, too deep, a 5000-digit number
        message = f"line {line_no} is not valid JSON: {err}"
        return InvalidRequest(fallback_id, line_no, "invalid_json", message, _sha256(raw.strip()))
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        custom_id = fallback_id
    try:
        if isinstance(value, dict) and "custom_id" in value and custom_id == fallback_id:
            # a 5 or "" given as the id was answered under line-N, where the user would never look for it
            raise _LineError("invalid_field", f'"custom_id" must be a non-empty string, not '
                             f'{json.dumps(value["custom_id"])[:40]}; write it in quotes, e.g. "5"')
        request = _parse_value(value, custom_id, line_no)
    except _LineError as err:
        return InvalidRequest(custom_id, line_no, err.code, f"line {line_no}: {err.message}", fingerprint)
    return dataclasses.replace(request, fingerprint=fingerprint)


def request_fingerprint(value: object) -> str:
    """A short hash of the request as the line states it, custom_id left out.

    Canonical JSON, so reformatting a line (key order, spacing) keeps its
    fingerprint while any change to method, url, body or prompt changes it.
    """
    if isinstance(value, dict):
        value = {key: item for key, item in value.items() if key != "custom_id"}
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return _sha256(canonical.encode("utf-8", "surrogatepass"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]  # 64 bits: plenty to tell a changed request


def _parse_value(value: object, custom_id: str, line_no: int) -> BatchRequest:
    if isinstance(value, str):
        return _plain_request(value, custom_id, line_no)
    if not isinstance(value, dict):
        raise _LineError("invalid_request", "expected a JSON object or a JSON string")
    if "prompt" in value and "body" not in value and "url" not in value:
        return _plain_object_request(value, custom_id, line_no)
    return _openai_request(value, custom_id, line_no)


def _plain_object_request(value: dict, custom_id: str, line_no: int) -> BatchRequest:
    """A {"prompt": ...} line: a user turn, and any settings beside it (max_tokens, temperature...) are its
    chat body's, checked like a Batch line's body (for_the_engine), never dropped."""
    prompt = _expect_string(value, "prompt")
    settings = {field: item for field, item in value.items() if field not in ("prompt", "custom_id")}
    if not settings:
        return _plain_request(prompt, custom_id, line_no)
    if "messages" in settings:
        raise _LineError("invalid_field", 'a plain line holds "prompt" or "messages", not both; for a whole chat, '
                         f'write the OpenAI Batch form: {{"custom_id": ..., "method": "POST", "url": "{CHAT_URL}", '
                         '"body": {"messages": [...]}}')
    turn = {"role": "user", "content": prompt}
    _fitting_chat((turn,))
    return BatchRequest(custom_id, line_no, CHAT_URL, body={"messages": [turn], **settings})


def _plain_request(prompt: str, custom_id: str, line_no: int) -> BatchRequest:
    return BatchRequest(custom_id, line_no, CHAT_URL, messages=_fitting_chat(({"role": "user", "content": prompt},)))


def _fitting_chat(messages: tuple[dict, ...]) -> tuple[dict, ...]:
    """The messages, unless they hold more text than a chat template may render (so no context holds)."""
    size = sum(len(m["content"]) for m in messages)
    if size >= MAX_RENDER_CHARS:
        raise _LineError("context_length_exceeded", f"the messages hold {size:,} characters, more than a chat "
                         f"prompt may ({MAX_RENDER_CHARS:,}); shorten them (a \"{COMPLETIONS_URL}\" request sends "
                         "its prompt as is, without the chat template)")
    return messages


def _openai_request(value: dict, custom_id: str, line_no: int) -> BatchRequest:
    """The line's form only: its body is checked by for_the_engine, or by the server it goes to (--endpoint)."""
    for field in ("custom_id", "method", "url", "body"):
        if field not in value:
            raise _LineError("missing_field", f'missing field "{field}"; an OpenAI Batch line is {{"custom_id": ..., '
                             f'"method": "POST", "url": "{CHAT_URL}", "body": {{"messages": [...]}}}}, '
                             'and a plain one {"prompt": ...}')
    _expect_string(value, "custom_id")
    if value["method"] != "POST":
        raise _LineError("invalid_field", f'"method" must be "POST", not {value["method"]!r}')
    url, body = value["url"], value["body"]
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _LineError("unknown_url", f'unknown url {url!r}; use "{CHAT_URL}" or "{COMPLETIONS_URL}"')
    if not isinstance(body, dict):
        raise _LineError("invalid_field", '"body" must be a JSON object')
    if url == CHAT_URL and isinstance(body.get("messages"), list):  # the rest of its shape is for_the_engine's
        _fitting_chat(tuple(m for m in body["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)))
    return BatchRequest(custom_id, line_no, url, body=body)


def _expect_string(obj: dict, field: str) -> str:
    text = obj[field]
    if not isinstance(text, str):
        raise _LineError("invalid_field", f'"{field}" must be a string')
    return text


def for_the_engine(entry: BatchRequest | InvalidRequest) -> BatchRequest | InvalidRequest:
    """The entry as a local engine runs it: its body checked by edgespec serve's own check, or an error record's entry.

    So a local batch refuses what the server answers 400 for (n > 1, logprobs, tools, unknown fields...),
    naming the parameter; an --endpoint batch sends the body as it is, for that server to judge.
    """
    if not isinstance(entry, BatchRequest) or entry.body is None:
        return entry  # a bad line, or a plain one: a user turn and nothing else
    try:
        checked = check_body(entry.body, chat=entry.url == CHAT_URL)
    except ApiError as err:
        return InvalidRequest(entry.custom_id, entry.line, err.code or "invalid_request",
                              f"line {entry.line}: {err.message}", entry.fingerprint)
    if checked.chat and checked.messages[-1]["role"] != "user":  # a chat session answers a user's turn
        return InvalidRequest(entry.custom_id, entry.line, "invalid_value",
                              f'line {entry.line}: the last message must have role "user"', entry.fingerprint)
    return dataclasses.replace(entry, messages=checked.messages, prompt=checked.prompt, overrides=checked.sampling,
                               prediction=checked.prediction)


def check_unique_ids(entries: list[BatchRequest | InvalidRequest]) -> None:
    first_line: dict[str, int] = {}
    clashes = []
    for entry in entries:
        if entry.custom_id in first_line:
            clashes.append(f"{entry.custom_id!r} (lines {first_line[entry.custom_id]} and {entry.line})")
        else:
            first_line[entry.custom_id] = entry.line
    if clashes:
        shown = ", ".join(clashes[:5]) + (f" and {len(clashes) - 5} more" if len(clashes) > 5 else "")
        raise BatchError(f"duplicate custom_id {shown}; give every request its own custom_id")
