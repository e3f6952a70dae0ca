"""`edgespec batch --endpoint URL`: the same batch file, sent to any OpenAI-compatible server.

Each pending request's body goes as IN states it to URL + its url
(/v1/chat/completions or /v1/completions), with up to `concurrency` requests
in flight; edgespec serve, vLLM and llama-server all answer it. A plain line
({"prompt": ...}) becomes a chat body. Fields a body leaves out get the
command line's sampling values (max_tokens, temperature, top_p, and seed and
stop when given), and "model" the server's first model. A body's
"stream": true (and its stream_options) is left out: a record is a whole
answer, as a local batch gives it.

The records are the local batch's, appended and fsynced one by one as the
answers come back (in any order, which the OpenAI Batch format allows), so
resume after kill -9, superseding records and bad lines as error records
hold as they do locally. What a server answers is data from outside:
- a 200 is saved only when its body is an answer (answers.py); any other 2xx
  body (not JSON, an error object, an event stream, an empty one) gets an
  "invalid_response" error record, which a rerun retries;
- a 4xx answer is that request's record (OpenAI's form: the status and the
  server's body);
- 429, 5xx, a proxy's HTML page, and connections that fail or close
  mid-answer are retried with exponential backoff, honouring Retry-After (a
  full queue for up to QUEUE_WAIT_SECONDS without counting as a failure); a
  request that still fails after MAX_ATTEMPTS is left unwritten, so a rerun
  retries it.
No answer, however malformed, ends the batch or its summary.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import re
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from ...notices import print_notice
from .answers import answer_object, answer_problem
from .output import INVALID_ANSWER, REQUEST_FAILED, RecordWriter, answer_record, error_record, is_done
from .requests import BatchError, BatchRequest, InvalidRequest
from .runner import Interrupt, RunTally

EXAMPLE_URL = "http://127.0.0.1:8080"
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_ATTEMPTS = 6
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 600.0
QUEUE_WAIT_SECONDS = 600.0  # how long one request waits out a full queue (429s) before they count as failures
MAX_CONCURRENCY = 64
MAX_ANSWER_BYTES = 32 << 20  # far above any completion's JSON, logprobs included; a bigger body is no answer
READ_CHUNK_BYTES = 1 << 16


class _Unanswered(Exception):
    """No usable answer this attempt: retried, and after the last attempt left for a rerun."""

    def __init__(self, reason: str, retry_after: float | None = None, status: int | None = None):
        super().__init__(reason)
        self.retry_after, self.status = retry_after, status


class _NotAnAnswer(Exception):
    """A 2xx whose body is no answer (see answers.py): an error record, which a rerun retries."""


def url_problem(url: str) -> str | None:
    """What keeps url from being a server's address, worded to follow it, or None when it is one."""
    if not url.startswith(("http://", "https://")):
        return "is not an http:// or https:// URL"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- a port out of range raises ValueError here
    except ValueError as error:  # e.g. "http://[::1": Invalid IPv6 URL
        return f"is not a URL ({error})"
    if not parts.hostname:
        return "names no host"
    if parts.username is not None or parts.password is not None:  # urllib would not send them: a key goes in a header
        return "holds a user name or password, which edgespec does not send; give the server's key with --api-key"
    return None


def shown_url(url: str) -> str:
    """url as an error may quote it: without a user name or password it holds."""
    return re.sub(r"^(https?://)[^/@]*@", r"\1", url.strip())


@dataclass(frozen=True)
class _Reply:
    status: int
    content_type: str
    raw: bytes  # at most MAX_ANSWER_BYTES + 1: more is never an answer
    retry_after: float | None  # the seconds the server's Retry-After asks for (None: none given)


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its base URL (without /v1) and the key it wants."""

    base_url: str
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None) -> "Endpoint":
        base = url.strip().rstrip("/")
        problem = url_problem(base)
        if problem is not None:
            raise BatchError(f"--endpoint {shown_url(url)!r} {problem}; give e.g. {EXAMPLE_URL}")
        return cls(base[: -len("/v1")] if base.endswith("/v1") else base, api_key or None)

    def first_model(self) -> str:
        """The first model the server lists: checks the URL and the key before any request is sent."""
        try:
            reply = self._call("GET", "/v1/models", None)
        except _Unanswered as err:
            raise BatchError(f"cannot reach {self.base_url}: {err}; check --endpoint and that the server runs") from None
        if reply.status == 401:
            raise BatchError(f"{self.base_url} refused the API key (401); give the server's key with --api-key")
        body = _json_body(reply.raw) if reply.status == 200 else None
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict) \
                or not isinstance(models[0].get("id"), str):
            raise BatchError(f"{self.base_url}/v1/models answered {reply.status} without a model list; "
                             "is --endpoint an OpenAI-compatible server?")
        return models[0]["id"]

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """The status and body of a final answer: an answer (200) or the server's refusal (4xx).

        Raises _Unanswered for what is worth retrying, _NotAnAnswer for a 2xx that is no answer.
        """
        reply = self._call("POST", path, json.dumps(body).encode())
        if reply.status in RETRIED_STATUSES:
            raise _Unanswered(f"HTTP {reply.status}", reply.retry_after, reply.status)
        if 200 <= reply.status < 300:
            return reply.status, _answer_body(path, reply)
        refusal = _json_body(reply.raw)
        return reply.status, refusal if isinstance(refusal, dict) else {"error": {"message": _excerpt(reply.raw)}}

    def _call(self, method: str, path: str, data: bytes | None) -> _Reply:
        """The server's reply, whatever its status; raises _Unanswered when none came whole."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            try:
                response = urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS)
            except urllib.error.HTTPError as error:
                response = error  # a 4xx or 5xx: the error is the response, body and headers
            with response:
                headers = response.headers
                return _Reply(response.status, headers.get_content_type(), _read_body(response, headers),
                              _seconds(headers.get("Retry-After")))
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
            # refused, reset, timed out, closed mid-answer, a malformed status line or header
            raise _Unanswered(_failure_reason(error)) from None


def _read_body(response, headers) -> bytes:
    """The body, up to MAX_ANSWER_BYTES + 1 bytes; raises _Unanswered when it ends before its Content-Length."""
    chunks, size = [], 0
    while size <= MAX_ANSWER_BYTES and (chunk := response.read(READ_CHUNK_BYTES)):
        chunks.append(chunk)
        size += len(chunk)
    raw = b"".join(chunks)
    declared = headers.get("Content-Length", "")
    if declared.isdigit() and len(raw) < int(declared) and size <= MAX_ANSWER_BYTES:
        # A read with a size returns what came before the close, without complaint: compare.
        raise _Unanswered(f"the answer was cut off after {len(raw)} of its {int(declared)} bytes")
    return raw


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, http.client.IncompleteRead):
        return f"the answer was cut off after {len(error.partial)} bytes"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    reason = getattr(error, "reason", None) or error
    return str(reason) or type(reason).__name__


def _answer_body(url: str, reply: _Reply) -> dict:
    """A 2xx's body when it is an answer to a request for url; else raises what it is instead.

    An HTML page is what a proxy in front of a restarting server sends, so it
    is retried; any other body that is no answer will not become one by asking
    again at once, and gets an error record (a rerun retries it).
    """
    text = reply.raw.strip()
    if reply.status != 200:
        raise _NotAnAnswer(f"HTTP {reply.status} where a 200 with the answer was due")
    if reply.content_type == "text/event-stream" or text.startswith((b"data:", b"event:")):
        raise _NotAnAnswer("an event stream, though the batch asked for one JSON answer")
    if not text:
        raise _NotAnAnswer("an empty body")
    if len(reply.raw) > MAX_ANSWER_BYTES:
        raise _NotAnAnswer(f"a body over {MAX_ANSWER_BYTES:,} bytes")
    if reply.content_type == "text/html" or text.startswith(b"<"):
        raise _Unanswered(f"an HTML page instead of an answer (from a proxy?): {_excerpt(text)!r}")
    body = _json_body(text)
    if body is None:
        raise _NotAnAnswer(f"a body that is not JSON: {_excerpt(text)!r}")
    problem = answer_problem(url, body)
    if problem is not None:
        raise _NotAnAnswer(f"a body that is not a {answer_object(url)}: {problem}")
    return body


def _json_body(raw: bytes) -> object | None:
    """The JSON value raw holds (strict: no NaN or Infinity), or None when it holds none."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, too deep, a 5000-digit number
        return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: no figure a server means
        raise ValueError(f"{text} is out of range")
    return value


def _excerpt(raw: bytes, limit: int = 200) -> str:
    """The start of a server's body, for a message: one printable line."""
    text = raw[: 4 * limit].decode("utf-8", "replace")
    line = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _seconds(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None  # an HTTP date: fall back to the backoff


def request_body(request: BatchRequest, defaults: dict, model: str) -> dict:
    """The body to send: IN's own (a chat body for a plain line), filled in from defaults and model, and
    asking for the answer whole."""
    body = dict(request.body) if request.body is not None else {"messages": [dict(m) for m in request.messages]}
    if body.get("stream") is True:
        # A record holds a whole answer, which is what a local batch gives such a body too: an event stream
        # could only become an error record. (Any other value goes as it is, for the server to judge.)
        del body["stream"]
        body.pop("stream_options", None)
    body.update(filled_in(request, defaults))
    body.setdefault("model", model)
    return body


def filled_in(request: BatchRequest, defaults: dict) -> dict:
    """The defaults (the command line's sampling values) that the request's body leaves out, which the
    client adds to it: all of them for a plain line."""
    body = request.body or {}
    return {field: value for field, value in defaults.items()
            if field not in body and not (field == "max_tokens" and "max_completion_tokens" in body)}


def run_remote_batch(
    endpoint: Endpoint,
    entries: list[BatchRequest | InvalidRequest],
    writer: RecordWriter,
    defaults: dict,
    finished: dict[str, dict],
    interrupt: Interrupt,
    concurrency: int = 1,
    on_progress: Callable[[RunTally, None], None] = lambda tally, live: None,
) -> RunTally:
    """Send every entry not yet done, appending each record as its answer comes back.

    Whatever becomes of one request (no answer, a body that is none, a bug
    here) is that request's own outcome: the batch goes on with the rest.
    """
    model = endpoint.first_model()
    tally = RunTally()
    pending = [e for e in entries if not is_done(e, finished)]

    def keep(entry, outcome: dict | _Unanswered | None) -> None:
        if isinstance(outcome, _Unanswered):
            tally.unanswered += 1
            print_notice(f"edgespec batch: no answer for {entry.custom_id!r} (line {entry.line}) after "
                         f"{MAX_ATTEMPTS} attempts, the last: {outcome}; left for a rerun")
            return
        if outcome is None:
            return  # interrupted: left for a rerun
        writer.append(outcome)  # only this thread writes OUT
        finished[entry.custom_id] = outcome
        tally.written += 1
        tally.add_answer(outcome)
        on_progress(tally, None)

    for entry in pending:
        if isinstance(entry, InvalidRequest):
            keep(entry, error_record(entry.custom_id, entry.code, entry.message, entry.fingerprint))
    requests = iter(e for e in pending if isinstance(e, BatchRequest))
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="batch-endpoint") as pool:
        in_flight: dict[Future, BatchRequest] = {}
        while True:
            while len(in_flight) < concurrency and not interrupt.requested.is_set():
                request = next(requests, None)
                if request is None:
                    break
                body = request_body(request, defaults, model)
                in_flight[pool.submit(_answer, endpoint, request, body, interrupt)] = request
            if not in_flight:
                break
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                request = in_flight.pop(future)
                keep(request, _outcome(future, request))
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


def _outcome(future: Future, request: BatchRequest) -> dict | _Unanswered | None:
    try:
        return future.result()
    except Exception as err:  # a bug here, not the server's doing: still only this request's outcome
        message = f"line {request.line}: sending it failed ({type(err).__name__}: {err}); rerun the same command to retry it"
        return error_record(request.custom_id, REQUEST_FAILED, message, request.fingerprint)


def _answer(endpoint: Endpoint, request: BatchRequest, body: dict, interrupt: Interrupt) -> dict | _Unanswered | None:
    """The request's record; the last failure when every attempt went unanswered; None when interrupted.

    A full queue (429) is a server at work, not a failure: it is waited out for up to
    QUEUE_WAIT_SECONDS without using up attempts, so --concurrency may exceed the server's queue.
    """
    delay, failures = FIRST_BACKOFF_SECONDS, 0
    queue_deadline = time.monotonic() + QUEUE_WAIT_SECONDS
    while True:
        try:
            status, answer = endpoint.post(request.url, body)
        except _NotAnAnswer as err:
            message = (f"line {request.line}: the server answered {err}; not saved as an answer, "
                       "rerun the same command to retry it")
            return error_record(request.custom_id, INVALID_ANSWER, message, request.fingerprint)
        except _Unanswered as err:
            busy = err.status == 429 and time.monotonic() < queue_deadline
            failures += not busy
            if failures == MAX_ATTEMPTS:
                return err
            wait_seconds = err.retry_after if err.retry_after is not None else delay
            if interrupt.requested.wait(min(wait_seconds, MAX_BACKOFF_SECONDS)):
                return None
            delay = min(2 * delay, MAX_BACKOFF_SECONDS)
            continue
        return answer_record(request, status, answer)


def default_fields(args) -> dict:
    """The command line's sampling values, in OpenAI's names, for bodies that leave them out."""
    fields = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        fields["seed"] = args.seed
    if args.stop:
        fields["stop"] = list(args.stop)
    return fields
