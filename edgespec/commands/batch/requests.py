"""Reading IN: one request per line, OpenAI Batch or plain prompts, each with the fingerprint resuming checks.

A bad line is an InvalidRequest (it gets an error record); only duplicate
custom_ids or an unreadable file refuse the whole batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ...errors import EdgespecError
from ...prediction import prediction_text

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
CHAT_ROLES = {"system", "developer", "user", "assistant"}
EXIT_REFUSED = 2


class BatchError(EdgespecError):
    """The batch cannot run: unreadable input, duplicate ids, corrupt or unwritable output."""

    exit_code = EXIT_REFUSED


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    line: int
    url: str  # CHAT_URL or COMPLETIONS_URL
    messages: tuple[dict, ...] = ()  # chat requests
    prompt: str = ""  # completion requests
    overrides: tuple[tuple[str, object], ...] = ()  # SamplingParams fields set by the body
    prediction: str = ""  # the body's predicted output (OpenAI's Predicted Outputs): a draft source
    fingerprint: str = dataclasses.field(default="", compare=False)  # see request_fingerprint
    body: dict | None = dataclasses.field(default=None, compare=False)  # IN's body as it is; None for a plain line


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
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BatchError(f"cannot read batch input {path}: {err.strerror}; check the path") from None
    entries = []
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            entries.append(parse_line(raw, line_no))
    return entries


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
        return _plain_request(_expect_string(value, "prompt"), custom_id, line_no)
    return _openai_request(value, custom_id, line_no)


def _plain_request(prompt: str, custom_id: str, line_no: int) -> BatchRequest:
    return BatchRequest(custom_id, line_no, CHAT_URL, messages=({"role": "user", "content": prompt},))


def _openai_request(value: dict, custom_id: str, line_no: int) -> BatchRequest:
    for field in ("custom_id", "method", "url", "body"):
        if field not in value:
            raise _LineError("missing_field", f'missing field "{field}"')
    _expect_string(value, "custom_id")
    if value["method"] != "POST":
        raise _LineError("invalid_field", f'"method" must be "POST", not {value["method"]!r}')
    url, body = value["url"], value["body"]
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _LineError("unknown_url", f'unknown url {url!r}; use "{CHAT_URL}" or "{COMPLETIONS_URL}"')
    if not isinstance(body, dict):
        raise _LineError("invalid_field", '"body" must be a JSON object')
    overrides = tuple(_sampling_overrides(body).items())
    try:
        prediction = prediction_text(body.get("prediction"))
    except ValueError as error:
        raise _LineError("invalid_field", f"body.{error}") from None
    if url == CHAT_URL:
        return BatchRequest(custom_id, line_no, url, messages=_parse_messages(body), overrides=overrides, body=body,
                            prediction=prediction)
    return BatchRequest(custom_id, line_no, url, prompt=_parse_prompt(body), overrides=overrides, body=body,
                        prediction=prediction)


def _expect_string(obj: dict, field: str) -> str:
    text = obj[field]
    if not isinstance(text, str):
        raise _LineError("invalid_field", f'"{field}" must be a string')
    return text


def _parse_messages(body: dict) -> tuple[dict, ...]:
    if "messages" not in body:
        raise _LineError("missing_field", 'missing field "body.messages"')
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise _LineError("invalid_field", '"body.messages" must be a non-empty list')
    parsed = tuple(_parse_message(m, i) for i, m in enumerate(messages))
    if parsed[-1]["role"] != "user":
        raise _LineError("invalid_field", "the last message must have role \"user\"")
    return parsed


def _parse_message(message: object, index: int) -> dict:
    where = f"body.messages[{index}]"
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise _LineError("missing_field", f'{where} needs "role" and "content"')
    role = message["role"]
    if role not in CHAT_ROLES:
        raise _LineError("invalid_field", f"{where}.role {role!r} is not one of {sorted(CHAT_ROLES)}")
    role = "system" if role == "developer" else role
    return {"role": role, "content": _message_text(message["content"], where)}


def _message_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts; only text parts make sense for a text model.
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _LineError("invalid_field", f"{where}.content must be a string or a list of text parts")


def _parse_prompt(body: dict) -> str:
    if "prompt" not in body:
        raise _LineError("missing_field", 'missing field "body.prompt"')
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise _LineError("invalid_field", '"body.prompt" must be one string (one prompt per request)')
    return prompt


def _sampling_overrides(body: dict) -> dict:
    """Map the OpenAI body fields edgespec honours onto SamplingParams fields."""
    overrides: dict[str, object] = {}
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None:
        overrides["max_tokens"] = _number(max_tokens, "max_tokens", integer=True, low=1)
    if body.get("temperature") is not None:
        overrides["temperature"] = _number(body["temperature"], "temperature", low=0)
    if body.get("top_p") is not None:
        overrides["top_p"] = _number(body["top_p"], "top_p", low=0, high=1)
    if body.get("seed") is not None:
        overrides["seed"] = _number(body["seed"], "seed", integer=True, low=0)
    if body.get("stop") is not None:
        overrides["stop"] = _stop_strings(body["stop"])
    return overrides


def _number(value: object, field: str, integer: bool = False, low: float | None = None, high: float | None = None):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _LineError("invalid_field", f'"body.{field}" must be {"an integer" if integer else "a number"}')
    if not integer:
        # Python's json reads NaN, Infinity and 1e999; none of them is a setting.
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise _LineError("invalid_field", f'"body.{field}" must be a finite number, not {value}')
    if (low is not None and value < low) or (high is not None and value > high):
        raise _LineError("invalid_field", f'"body.{field}" = {value} is out of range')
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise _LineError("invalid_field", '"body.stop" must be a string or a list of strings')


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
