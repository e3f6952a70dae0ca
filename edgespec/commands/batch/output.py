"""OUT: the records it holds, the lock that keeps a second batch off it, and appends that survive a crash.

Every record line starts with RECORD_PREFIX, so a last line cut short by a
kill or power loss can be told from somebody else's file (see the package
docstring).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
import uuid
from pathlib import Path

from .answers import is_answer
from .requests import CHAT_URL, BatchError, BatchRequest, InvalidRequest

# How every output record's line begins: "id" is its first field and every id
# starts "batch_req_". Only a tail that starts so may be cut off as torn.
RECORD_PREFIX = '{"id": "batch_req_'
RECORD_FIELDS = {"id", "custom_id", "response", "error"}
FINGERPRINT_FIELD = "fingerprint"
SAMPLING_FIELD = "sampling"
SUPERSEDES_FIELD = "supersedes"  # on a record that replaces an earlier one for its custom_id: that one's "id"
# A prompt too long for the context: its record keeps the context it failed in (CONTEXT_FIELD), and a run
# with a larger --n-ctx, what the message tells the user to give, redoes it.
CONTEXT_TOO_LONG = "context_length_exceeded"
CONTEXT_FIELD = "n_ctx"
OPTIONAL_FIELDS = {FINGERPRINT_FIELD, SUPERSEDES_FIELD, SAMPLING_FIELD, CONTEXT_FIELD}
# Error records of failures that may pass (a server's answer that was not one, see answers.py):
# a resume redoes their requests, where other error records stand (a bad line; a prompt too long, until the
# context grows: CONTEXT_FIELD).
INVALID_ANSWER = "invalid_response"
REQUEST_FAILED = "request_failed"
RETRIED_ERROR_CODES = frozenset({INVALID_ANSWER, REQUEST_FAILED})
HOLDER_SUFFIX = ".edgespec-lock"


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
        self._last_record_ids: dict[str, str] = {}  # custom_id -> "id" of its last record in OUT
        self._retried: dict[str, None] = {}  # custom_ids whose last record a resume redoes, in OUT's order
        if self._created:
            _fsync_dir(path.parent)

    def load_finished(self, n_ctx: int | None = None) -> tuple[dict[str, dict], bool]:
        """Records already in OUT by custom_id (the last one per id), and whether a torn tail was cut off;
        n_ctx: this run's context, which redoes the prompts a smaller one was too short for.

        A run killed mid-write leaves a last line without its newline, maybe
        followed by zero bytes after a power loss: when that line starts like a
        record but is not a whole one, it is truncated away so its request is
        redone. A whole record missing only its newline is kept. Anything else
        that is not a record is refused, and OUT is left as it is.

        A custom_id whose last record is one a resume redoes (see
        redone_on_resume) is left out, and listed in self.retried.
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
            self._keep_loaded(record, finished, n_ctx)
        tail = data[end:]
        if not tail:
            return finished, False
        last_line = tail.rstrip(b"\0")
        if (record := parse_record(last_line)) is not None:
            # A whole record that lost only its newline (an editor that drops the last one): an answer
            # already written, kept, its newline restored (OUT is opened to append), never redone.
            self._keep_loaded(record, finished, n_ctx)
            os.ftruncate(self._fd, end + len(last_line))
            os.write(self._fd, b"\n")
            os.fsync(self._fd)
            return finished, False
        if not _is_torn_record(tail, after_records=end > 0):
            raise _not_a_record(self._path, data[:end].count(b"\n") + 1)
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        return finished, True

    def _keep_loaded(self, record: dict, finished: dict[str, dict], n_ctx: int | None) -> None:
        custom_id = record["custom_id"]
        self._last_record_ids[custom_id] = record["id"]
        self._retried.pop(custom_id, None)
        if redone_on_resume(record, n_ctx):
            finished.pop(custom_id, None)
            self._retried[custom_id] = None
        else:
            finished[custom_id] = record

    @property
    def retried(self) -> list[str]:
        """The custom_ids load_finished left out because a resume redoes their last record."""
        return list(self._retried)

    def append(self, record: dict) -> None:
        """Append record and fsync it; one that replaces a record in OUT gets SUPERSEDES_FIELD first."""
        custom_id = record["custom_id"]
        if custom_id in self._last_record_ids:
            record[SUPERSEDES_FIELD] = self._last_record_ids[custom_id]
        data = encode_record(record)
        self._last_record_ids[custom_id] = record["id"]
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
            os.unlink(os.path.realpath(self._path))  # the file made, not a dangling symlink -o named it by
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
    if not isinstance(record, dict) or not RECORD_FIELDS <= set(record) <= RECORD_FIELDS | OPTIONAL_FIELDS:
        return None
    if not isinstance(record["custom_id"], str) or not isinstance(record["id"], str):
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
    try:
        return (line + "\n").encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (a server's answer may hold one) has no UTF-8 form: kept as its \u escape.
        return (json.dumps(record) + "\n").encode("ascii")


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
            "completion_tokens_details": {"accepted_prediction_tokens": result.stats.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": result.stats.rejected_prediction_tokens},
        },
        "stats": stats,
    }
    response = {"status_code": 200, "request_id": _new_id("req_"), "body": body}
    return _record(request.custom_id, response, None, request.fingerprint, request.sampling)


def answer_record(request: BatchRequest, status: int, body: dict) -> dict:
    """The record of a server's answer (edgespec batch --endpoint): its status and body as they came."""
    response = {"status_code": status, "request_id": _new_id("req_"), "body": body}
    return _record(request.custom_id, response, None, request.fingerprint, request.sampling)


def _choice(request: BatchRequest, text: str, finish_reason: str) -> dict:
    if request.url == CHAT_URL:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def error_record(custom_id: str, code: str, message: str, fingerprint: str = "", n_ctx: int | None = None) -> dict:
    """A request's failure; n_ctx, for a prompt too long, the context it did not fit (CONTEXT_FIELD)."""
    record = _record(custom_id, None, {"code": code, "message": message}, fingerprint)
    if n_ctx is not None:
        record[CONTEXT_FIELD] = n_ctx
    return record


def _record(custom_id: str, response: dict | None, error: dict | None, fingerprint: str,
            sampling: dict | None = None) -> dict:
    # "id" first: every line then starts with RECORD_PREFIX.
    record = {"id": _new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}
    if fingerprint:
        record[FINGERPRINT_FIELD] = fingerprint
    if sampling is not None:
        record[SAMPLING_FIELD] = sampling
    return record


def is_done(entry: BatchRequest | InvalidRequest, finished: dict[str, dict]) -> bool:
    """Whether OUT holds this very request's record: same custom_id and, where stored, same fingerprint and
    the sampling settings this run gives it (a rerun with another --max-tokens or --temperature redoes
    the answers the old ones made)."""
    record = finished.get(entry.custom_id)
    if record is None:
        return False
    stored = record.get(FINGERPRINT_FIELD)
    if stored is not None and stored != entry.fingerprint:  # no fingerprint: written before they existed
        return False
    return changed_sampling(entry, record) is None


def changed_sampling(entry: BatchRequest | InvalidRequest, record: dict) -> str | None:
    """The first sampling setting the record's answer was made with that this run gives the request
    otherwise, as "max_tokens 256, now 500"; None when none differs, or when either side has no settings
    (an error record, a record from before they were kept, a request with a bad value)."""
    stored, current = record.get(SAMPLING_FIELD), getattr(entry, "sampling", None)
    if not isinstance(stored, dict) or current is None:
        return None
    for name in sorted(stored.keys() | current.keys()):
        before, now = stored.get(name), current.get(name)
        if before != now:
            return f"{name} {_setting_text(before)}, now {_setting_text(now)}"
    return None


def _setting_text(value) -> str:
    return "unset" if value is None else json.dumps(value, ensure_ascii=True)[:40]


def redone_on_resume(record: dict, n_ctx: int | None = None) -> bool:
    """Whether a resume redoes this record's request: an error that may pass (a prompt too long for a smaller
    context than n_ctx, this run's), or a 200 that is no answer.

    The second is what an older edgespec saved from a server's bad body (see answers.py).
    """
    error = record.get("error")
    if isinstance(error, dict):
        failed_in = record.get(CONTEXT_FIELD)
        if error.get("code") == CONTEXT_TOO_LONG and isinstance(failed_in, int) and n_ctx is not None:
            return n_ctx > failed_in
        return error.get("code") in RETRIED_ERROR_CODES
    response = record.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200 and not is_answer(response.get("body"))


def is_success(record: dict) -> bool:
    response = record.get("response")
    return record.get("error") is None and isinstance(response, dict) and response.get("status_code") == 200
