"""`edgespec batch`: run a JSONL file of prompts through one engine, resumably.

Input is the OpenAI Batch request format (one request per line: custom_id,
method "POST", url "/v1/chat/completions" or "/v1/completions", body), or a
plain form: one prompt per line as {"prompt": "..."} or a bare JSON string,
answered as a chat turn, with custom_ids made from line numbers ("line-7").

Output is the OpenAI Batch output format, one record per request, appended
and fsynced as soon as it is done, so finished work survives Ctrl-C, kill -9
and power loss; rerunning the same command skips the custom_ids already in the
output. A failed request, a bad line or a bad sampling value in one body
included, gets an error record and the batch goes on. Each response body
carries edgespec's figures in an extra "stats" field, and each record an
extra "fingerprint": a hash of its request as IN states it (custom_id left
out).

OUT is only ever appended to, with one exception: a last line without its
newline that starts like a record this module writes (every record begins
with RECORD_PREFIX) is a write cut short by a kill or power loss, and is cut
off so its request is redone. Any other content that is not a batch output
record (a notes file, the input file) makes the batch refuse and leave OUT
untouched. While a batch runs it holds an exclusive flock on OUT; a second
batch on the same file is refused, naming the holder's pid, which the holder
keeps in OUT's ".edgespec-lock" file next to it.

On resume, a request whose fingerprint differs from the one stored with its
record (the request changed since OUT was written) is redone and its new
record appended: the last record for a custom_id is the one that counts.
Records written before fingerprints existed are kept as they are, with a note.

Exit codes (see EXIT_* below): 0 every request succeeded, 1 some requests
got error records, 2 the batch was refused before it started (duplicate
custom_ids, unreadable files, OUT not batch output or in use, model failed
to load) or OUT became unwritable, 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import signal
import stat
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from edgespec.cli import add_engine_options, add_sampling_options, load_engine, sampling_params
from edgespec.engine import Done, Step
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.session import ChatSession
from edgespec.stats import Stats

EXIT_OK = 0
EXIT_REQUESTS_FAILED = 1
EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
CHAT_ROLES = {"system", "developer", "user", "assistant"}

# How every output record's line begins: "id" is its first field and every id
# starts "batch_req_". Only a tail that starts so may be cut off as torn.
RECORD_PREFIX = '{"id": "batch_req_'
RECORD_FIELDS = {"id", "custom_id", "response", "error"}
FINGERPRINT_FIELD = "fingerprint"
HOLDER_SUFFIX = ".edgespec-lock"


class BatchError(EdgespecError):
    """The batch cannot run: unreadable input, duplicate ids, corrupt or unwritable output."""


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    line: int
    url: str  # CHAT_URL or COMPLETIONS_URL
    messages: tuple[dict, ...] = ()  # chat requests
    prompt: str = ""  # completion requests
    overrides: tuple[tuple[str, object], ...] = ()  # SamplingParams fields set by the body
    fingerprint: str = dataclasses.field(default="", compare=False)  # see request_fingerprint


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


# ---------------------------------------------------------------- input


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
    if url == CHAT_URL:
        return BatchRequest(custom_id, line_no, url, messages=_parse_messages(body), overrides=overrides)
    return BatchRequest(custom_id, line_no, url, prompt=_parse_prompt(body), overrides=overrides)


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


# ---------------------------------------------------------------- output file


class RecordWriter:
    """OUT, locked for this process: the records it holds, and appends that are on disk before append() returns.

    The lock is an exclusive flock on OUT itself, so it holds for every path to
    the file (symlinks and hardlinks too); it is released when the process
    ends, however it ends.
    """

    def __init__(self, path: Path):
        self._path = path
        self._created = not path.exists()
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise BatchError(f"cannot write batch output {path}: {err.strerror}; check the path") from None
        try:
            _lock(self._fd, path)
        except BatchError:
            os.close(self._fd)
            raise
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        # No pid note next to a device or a pipe: /dev is nobody's place for it.
        self._holder = _write_holder(path) if self._regular else None
        if self._created:
            _fsync_dir(path.parent)

    def load_finished(self) -> tuple[dict[str, dict], bool]:
        """Records already in OUT by custom_id (the last one per id), and whether a torn tail was cut off.

        A run killed mid-write leaves a last line without its newline, maybe
        followed by zero bytes after a power loss: when that line starts like a
        record, it is truncated away so its request is redone. Anything else
        that is not a record is refused, and OUT is left as it is.
        """
        if not self._regular:
            raise BatchError(f"batch output {self._path} is not a regular file; give -o a file path")
        data = _read_all(self._fd)
        end = data.rfind(b"\n") + 1  # where the last complete line ends
        finished: dict[str, dict] = {}
        for line_no, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
            record = parse_record(raw)
            if record is None:
                raise _not_a_record(self._path, line_no)
            finished[record["custom_id"]] = record
        tail = data[end:]
        if not tail:
            return finished, False
        if not _is_torn_record(tail, after_records=bool(finished)):
            raise _not_a_record(self._path, data[:end].count(b"\n") + 1)
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        return finished, True

    def append(self, record: dict) -> None:
        data = encode_record(record)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
            os.fsync(self._fd)
        except OSError as err:
            # A part-written line is a torn tail, which the rerun cuts off.
            raise BatchError(
                f"cannot write batch output {self._path}: {err.strerror}; fix that, then rerun to resume"
            ) from None

    def close(self) -> None:
        """Release OUT; a file this run created and never wrote to is removed again."""
        if self._created and os.fstat(self._fd).st_size == 0 and _is_open_file(self._path, self._fd):
            os.unlink(self._path)
        if self._holder is not None:
            self._holder.unlink(missing_ok=True)
        os.close(self._fd)  # releases the lock; after the holder file is gone, so a new holder's stays


def _not_a_record(path: Path, line_no: int) -> BatchError:
    return BatchError(
        f"{path} line {line_no} is not an edgespec batch output record; left the file as it is: "
        "give -o a new path (or remove that line to resume)"
    )


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise BatchError(f"cannot lock batch output {path}: {err.strerror}; give -o a file on a local disk") from None
        raise BatchError(
            f"{path} is in use by another edgespec batch ({_holder_of(path)}); "
            "wait for it to finish, or give -o another path"
        ) from None


def _holder_file(path: Path) -> Path:
    # Next to the real file, so every symlink to OUT finds the same one.
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + HOLDER_SUFFIX)


def _write_holder(path: Path) -> Path | None:
    """Note this process's pid for a batch refused the lock; only ever a convenience."""
    holder = _holder_file(path)
    try:
        holder.write_text(f"{os.getpid()}\n", encoding="ascii")
    except OSError:
        return None
    return holder


def _holder_of(path: Path) -> str:
    try:
        pid = int(_holder_file(path).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return "pid unknown"
    return f"pid {pid}"


def _is_open_file(path: Path, fd: int) -> bool:
    try:
        on_disk, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def parse_record(raw: bytes) -> dict | None:
    """The record on one complete line of OUT, or None when the line is not one edgespec writes."""
    if not raw.startswith(RECORD_PREFIX.encode()):
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not RECORD_FIELDS <= set(record) <= RECORD_FIELDS | {FINGERPRINT_FIELD}:
        return None
    if not isinstance(record["custom_id"], str):
        return None
    return record


def _is_torn_record(tail: bytes, after_records: bool) -> bool:
    """Whether a last line without newline is a record cut short.

    Each record is appended and fsynced before the next, so only the last
    can be torn: a prefix of a record line, possibly followed by the zero
    bytes a power loss leaves where the rest never reached the disk.
    """
    text = tail.rstrip(b"\0")
    prefix = RECORD_PREFIX.encode()
    if text.startswith(prefix):
        return True
    # Shorter than the prefix, or zero bytes alone: could be anyone's, so only after records.
    return after_records and prefix.startswith(text)


def encode_record(record: dict) -> bytes:
    line = json.dumps(record, ensure_ascii=False)
    # The torn-tail repair relies on every line starting so; see parse_record.
    if not line.startswith(RECORD_PREFIX):
        raise ValueError(f"not a batch output record: {line[:60]}")
    return (line + "\n").encode("utf-8")


def _fsync_dir(directory: Path) -> None:
    # Makes the new file's directory entry survive a power loss too.
    fd = os.open(directory or Path("."), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode (hardlinks, symlinks), or one path not yet created."""
    try:
        a_stat, b_stat = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
    return (a_stat.st_dev, a_stat.st_ino) == (b_stat.st_dev, b_stat.st_ino)


# ---------------------------------------------------------------- records


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def success_record(request: BatchRequest, result, model_name: str) -> dict:
    stats = result.stats.as_dict()
    prompt_tokens = result.stats.prompt_tokens
    completion_tokens = len(result.token_ids)
    # OpenAI knows only "stop" and "length"; running out of context is a length stop.
    finish_reason = "stop" if result.finish_reason == "stop" else "length"
    body = {
        "id": _new_id("chatcmpl-" if request.url == CHAT_URL else "cmpl-"),
        "object": "chat.completion" if request.url == CHAT_URL else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [_choice(request, result.text, finish_reason)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "stats": stats,
    }
    response = {"status_code": 200, "request_id": _new_id("req_"), "body": body}
    return _record(request.custom_id, response, None, request.fingerprint)


def _choice(request: BatchRequest, text: str, finish_reason: str) -> dict:
    if request.url == CHAT_URL:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def error_record(custom_id: str, code: str, message: str, fingerprint: str = "") -> dict:
    return _record(custom_id, None, {"code": code, "message": message}, fingerprint)


def _record(custom_id: str, response: dict | None, error: dict | None, fingerprint: str) -> dict:
    # "id" first: every line then starts with RECORD_PREFIX.
    record = {"id": _new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}
    if fingerprint:
        record[FINGERPRINT_FIELD] = fingerprint
    return record


def is_done(entry: BatchRequest | InvalidRequest, finished: dict[str, dict]) -> bool:
    """Whether OUT holds this very request's record: same custom_id and, where stored, same fingerprint."""
    record = finished.get(entry.custom_id)
    if record is None:
        return False
    stored = record.get(FINGERPRINT_FIELD)
    return stored is None or stored == entry.fingerprint  # no fingerprint: written before they existed


def is_success(record: dict) -> bool:
    response = record.get("response")
    return record.get("error") is None and isinstance(response, dict) and response.get("status_code") == 200


# ---------------------------------------------------------------- running


class Interrupt:
    """Ctrl-C turns into a polite stop: the request in flight is cancelled and not written."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    @contextmanager
    def catching_sigint(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            self.requested.set()
            # A second Ctrl-C falls back to the usual immediate stop.
            signal.signal(signal.SIGINT, previous)

        signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@dataclass
class RunTally:
    """What this run did, for the progress bar and the summary."""

    written: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    interrupted: bool = False

    def add(self, stats: Stats) -> None:
        self.tokens += stats.tokens_generated
        self.proposed += stats.draft_tokens_proposed
        self.accepted += stats.draft_tokens_accepted


def run_batch(
    engine,
    entries: list[BatchRequest | InvalidRequest],
    writer: RecordWriter,
    base_params,
    finished: dict[str, dict],
    interrupt: Interrupt,
    on_progress: Callable[[RunTally, Stats | None], None] = lambda tally, live: None,
) -> RunTally:
    """Run every entry not yet done (see is_done), appending each record as it is done.

    Adds the new records to `finished`. Stops early, writing nothing partial,
    once `interrupt.requested` is set.
    """
    tally = RunTally()
    model_name = Path(engine.target_path).name
    for entry in entries:
        if is_done(entry, finished):
            continue
        if interrupt.requested.is_set():
            break
        if isinstance(entry, InvalidRequest):
            record = error_record(entry.custom_id, entry.code, entry.message, entry.fingerprint)
        else:
            record = _run_request(engine, entry, base_params, model_name, interrupt, tally, on_progress)
            if record is None:
                break
        writer.append(record)
        finished[entry.custom_id] = record
        tally.written += 1
        on_progress(tally, None)
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


def _run_request(engine, request, base_params, model_name, interrupt, tally, on_progress):
    """The request's record, or None when it was interrupted.

    Whatever one request gets wrong (a sampling value SamplingParams or numpy
    refuses, a chat template that fails to render, a prompt too long) is that
    request's error record, never the end of the batch.
    """
    def failed(code: str, reason: object) -> dict:
        return error_record(request.custom_id, code, f"line {request.line}: {reason}", request.fingerprint)

    try:
        params = dataclasses.replace(base_params, **dict(request.overrides))
    except (EdgespecError, ValueError) as err:
        return failed("invalid_field", f"bad sampling setting: {err}")
    result = None
    try:
        for event in _events(engine, request, params, interrupt):
            if isinstance(event, Done):
                result = event.result
            elif isinstance(event, Step):
                on_progress(tally, event.stats)
    except ContextOverflowError as err:
        return failed("context_length_exceeded", err)
    except (EdgespecError, ValueError) as err:
        return failed("generation_failed", err)
    if result is None or result.finish_reason == "cancelled":
        return None
    tally.add(result.stats)
    return success_record(request, result, model_name)


def _events(engine, request: BatchRequest, params, interrupt: Interrupt) -> Iterator:
    """The generation's events; once interrupted it stops after the current step."""
    if request.url == COMPLETIONS_URL:
        yield from engine.stream(request.prompt, params, raw=True, cancel=interrupt.requested)
        return
    session = _chat_session(engine, request.messages)
    for event in session.stream(request.messages[-1]["content"], params):
        if interrupt.requested.is_set():
            session.cancel()
        yield event


def _chat_session(engine, messages: tuple[dict, ...]) -> ChatSession:
    """A session holding the request's conversation up to its last user message.

    Every request gets a fresh session; requests that share a system prompt
    still share KV cache, as the engine keeps the longest common token prefix.
    A conversation too long for the context is an error, never silently cut.
    """
    has_system = messages[0]["role"] == "system"
    session = ChatSession(engine, messages[0]["content"] if has_system else None, context_policy="error")
    session.messages = [dict(m) for m in messages[1 if has_system else 0 : -1]]
    return session


# ---------------------------------------------------------------- summary


def summarize(entries, finished: dict[str, dict], tally: RunTally, resumed: int, wall_seconds: float) -> dict:
    """Figures for the whole batch as it now stands in OUT (earlier runs included)."""
    records = [finished[e.custom_id] for e in entries if is_done(e, finished)]
    ok = [r for r in records if is_success(r)]
    usage = [r["response"]["body"].get("usage", {}) for r in ok]
    stats = [r["response"]["body"].get("stats", {}) for r in ok]
    generated = sum(int(s.get("tokens_generated", 0)) for s in stats)
    decode_seconds = sum(float(s.get("decode_seconds", 0.0)) for s in stats)
    proposed = sum(int(s.get("draft_tokens_proposed", 0)) for s in stats)
    accepted = sum(int(s.get("draft_tokens_accepted", 0)) for s in stats)
    target_passes = sum(int(s.get("target_forward_passes", 0)) for s in stats)
    return {
        "requests_total": len(entries),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "requests_pending": len(entries) - len(records),
        "requests_resumed": resumed,
        "interrupted": tally.interrupted,
        "prompt_tokens": sum(int(u.get("prompt_tokens", 0)) for u in usage),
        "completion_tokens": sum(int(u.get("completion_tokens", 0)) for u in usage),
        "total_tokens": sum(int(u.get("total_tokens", 0)) for u in usage),
        "wall_seconds": round(wall_seconds, 3),  # this run only, model loading included
        "decode_tokens_per_second": round(generated / decode_seconds, 2) if decode_seconds else None,
        # Token-weighted: all accepted draft tokens over all proposed ones.
        "mean_acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "target_passes_per_token": round(target_passes / generated, 4) if generated else None,
        "modes": sorted({str(s.get("mode")) for s in stats if s.get("mode")}),
    }


def summary_line(summary: dict) -> str:
    def show(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    return (
        f"batch: {summary['requests_ok']} ok, {summary['requests_failed']} failed"
        f" of {summary['requests_total']} ({summary['requests_resumed']} already done)"
        f" | {summary['total_tokens']} tokens ({summary['completion_tokens']} generated)"
        f" | wall {summary['wall_seconds']:.1f} s"
        f" | decode {show(summary['decode_tokens_per_second'], '.1f')} tok/s"
        f" | acceptance {show(summary['mean_acceptance_rate'], '.1%')}"
        f" | {show(summary['target_passes_per_token'], '.3f')} target passes/token"
    )


def write_summary(path: Path, summary: dict) -> None:
    tmp = None
    try:
        # A fresh temporary name: a fixed one could be somebody's file, even OUT.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise BatchError(f"cannot write summary {path}: {err.strerror}; check the path") from None


# ---------------------------------------------------------------- command line


def add_batch_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="run a JSONL file of prompts (OpenAI Batch format), resumably",
        description=(
            "Run every request of IN (OpenAI Batch JSONL, or one prompt per line as "
            '{"prompt": ...} or a JSON string) and append OpenAI Batch output records to OUT. '
            "Rerun the same command to resume: custom_ids already in OUT are skipped. "
            "Exit codes: 0 all requests succeeded, 1 some requests failed (error records in OUT), "
            "2 refused before starting, 130 interrupted."
        ),
    )
    parser.add_argument("input", type=Path, metavar="IN", help="batch input, JSONL")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT", help="batch output, JSONL (appended)")
    parser.add_argument("--summary", type=Path, metavar="FILE", help="also write the summary as JSON to FILE")
    add_engine_options(parser)
    add_sampling_options(parser, max_tokens=256)
    parser.set_defaults(func=handle_batch)


def handle_batch(args) -> int:
    try:
        return _batch_command(args)
    except EdgespecError as err:
        print(f"edgespec batch: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print(f"edgespec batch: interrupted; {_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _resume_hint(args) -> str:
    return f"finished results are saved in {args.output}; rerun the same command to resume"


def _batch_command(args) -> int:
    started = time.monotonic()
    check_paths(args.input, args.output, args.summary)
    entries = read_requests(args.input)
    if not entries:
        raise BatchError(f"{args.input} holds no requests; put one request per line")
    check_unique_ids(entries)
    writer = RecordWriter(args.output)  # locked before anything reads or repairs OUT
    try:
        finished, torn = writer.load_finished()
        if torn:
            print(f"edgespec batch: cut off a torn last record in {args.output}; that request is redone", file=sys.stderr)
        _warn_changed_requests(entries, finished, args.output)
        resumed = sum(1 for e in entries if is_done(e, finished))
        tally = RunTally()
        if resumed < len(entries):
            tally = _run_with_engine(args, entries, writer, finished, resumed)
    finally:
        writer.close()
    summary = summarize(entries, finished, tally, resumed, time.monotonic() - started)
    print(summary_line(summary), file=sys.stderr)
    if args.summary:
        write_summary(args.summary, summary)
    if tally.interrupted:
        done = len(entries) - summary["requests_pending"]
        print(f"edgespec batch: interrupted after {done} of {len(entries)} requests; {_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if summary["requests_failed"] == 0 else EXIT_REQUESTS_FAILED


def check_paths(input_path: Path, output_path: Path, summary_path: Path | None) -> None:
    """Refuse an OUT or a summary that is IN, or a summary that is OUT, under any name."""
    if same_file(output_path, input_path):
        raise BatchError(f"the output file is the input file ({input_path}); give -o a new path")
    for other, what in ((input_path, "the input file"), (output_path, "the output file")):
        if summary_path is not None and same_file(summary_path, other):
            raise BatchError(f"--summary {summary_path} is {what} ({other}); give --summary another path")


def _warn_changed_requests(entries, finished: dict[str, dict], out_path: Path) -> None:
    ids = {e.custom_id for e in entries}
    foreign = sum(1 for custom_id in finished if custom_id not in ids)
    if foreign:
        print(f"edgespec batch: note: {out_path} has {foreign} records whose custom_id is not in this input", file=sys.stderr)
    known = [e for e in entries if e.custom_id in finished]
    changed = [e for e in known if not is_done(e, finished)]
    if changed:
        print(
            f"edgespec batch: {_requests(len(changed))} changed since {out_path} was written"
            f" (first: {changed[0].custom_id!r}, line {changed[0].line}); they are redone and their new records"
            " appended (the last record for a custom_id counts)",
            file=sys.stderr,
        )
    unmarked = sum(1 for e in known if FINGERPRINT_FIELD not in finished[e.custom_id])
    if unmarked:
        print(
            f"edgespec batch: note: {unmarked} records in {out_path} come from an older edgespec that stored no"
            " request fingerprint; they are kept unchecked (give -o a new path to redo them)",
            file=sys.stderr,
        )


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _run_with_engine(args, entries, writer, finished, resumed) -> RunTally:
    params = sampling_params(args)
    engine = load_engine(args)
    interrupt = Interrupt()
    try:
        with _progress_bar(len(entries), resumed) as on_progress, interrupt.catching_sigint():
            return run_batch(engine, entries, writer, params, finished, interrupt, on_progress)
    finally:
        engine.close()


@contextmanager
def _progress_bar(total: int, done: int) -> Iterator[Callable[[RunTally, Stats | None], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("batch"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[speed]}"),
        TextColumn("{task.fields[acceptance]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task("batch", total=total, completed=done, speed="- tok/s", acceptance="acceptance -")

    def on_progress(tally: RunTally, live: Stats | None) -> None:
        tokens = tally.tokens + (live.tokens_generated if live else 0)
        proposed = tally.proposed + (live.draft_tokens_proposed if live else 0)
        accepted = tally.accepted + (live.draft_tokens_accepted if live else 0)
        elapsed = time.monotonic() - tally.started
        progress.update(
            task,
            completed=done + tally.written,
            speed=f"{tokens / elapsed:.1f} tok/s" if elapsed > 0 else "- tok/s",
            acceptance=f"acceptance {accepted / proposed:.0%}" if proposed else "acceptance -",
        )

    with progress:
        yield on_progress
