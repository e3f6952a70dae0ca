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
  retries it. The whole answer must come within REQUEST_TIMEOUT_SECONDS (see
  transport.py): one that trickles in is a failed attempt too;
- a redirect (3xx) is never followed (it would carry the API key and the
  prompts to another host) and never saved: every request would get it, so it
  ends the batch, with what was written kept, naming the URL to give instead.
No other answer, however malformed, ends the batch or its summary.
"""

from __future__ import annotations

import json
import math
import queue
import re
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable

from ...notices import print_notice
from .answers import answer_object, answer_problem
from .output import INVALID_ANSWER, REQUEST_FAILED, RecordWriter, answer_record, error_record, is_done
from .requests import BatchError, BatchRequest, InvalidRequest
from .runner import Interrupt, RunTally
from .transport import Reply, Unanswered, call

EXAMPLE_URL = "http://127.0.0.1:8080"
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_ATTEMPTS = 6
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 600.0  # for the whole answer, from the request to the body's last byte
QUEUE_WAIT_SECONDS = 600.0  # how long one request waits out a full queue (429s) before they count as failures
MAX_CONCURRENCY = 64
MAX_ANSWER_BYTES = 32 << 20  # far above any completion's JSON, logprobs included; a bigger body is no answer
POLL_SECONDS = 0.2  # how soon a Ctrl-C is seen while every request in flight waits on its server


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
        except Unanswered as err:
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

        Raises Unanswered for what is worth retrying, _NotAnAnswer for a 2xx that is no answer.
        """
        reply = self._call("POST", path, json.dumps(body).encode())
        if reply.status in RETRIED_STATUSES:
            raise Unanswered(f"HTTP {reply.status}", reply.retry_after, reply.status)
        if 200 <= reply.status < 300:
            return reply.status, _answer_body(path, reply)
        refusal = _json_body(reply.raw)
        return reply.status, refusal if isinstance(refusal, dict) else {"error": {"message": _excerpt(reply.raw)}}

    def _call(self, method: str, path: str, data: bytes | None) -> Reply:
        """The server's reply, whatever its status; raises Unanswered when none came whole within
        REQUEST_TIMEOUT_SECONDS, and BatchError for a redirect."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        reply = call(request, REQUEST_TIMEOUT_SECONDS, MAX_ANSWER_BYTES)
        if 300 <= reply.status < 400:
            raise self._redirect_refusal(path, reply)
        return reply

    def _redirect_refusal(self, path: str, reply: Reply) -> BatchError:
        """What ends the batch at a redirect: every request would get it, and following one would send the
        API key and the prompts wherever the server says."""
        why = "(edgespec does not follow redirects: they would carry the API key and the prompts elsewhere)"
        if not reply.location:
            return BatchError(f"{self.base_url} answered with a redirect ({reply.status}) without a Location; "
                              f"give the server's own URL as --endpoint {why}")
        target = _shown_header(_joined(self.base_url + path, reply.location))
        base = target[: -len(path)] if target.endswith(path) else target  # what --endpoint takes
        return BatchError(f"{self.base_url} answered with a redirect ({reply.status}) to {target}; "
                          f"give {base} as --endpoint {why}")


def _joined(url: str, location: str) -> str:
    try:
        return urllib.parse.urljoin(url, location.strip())  # a Location may be relative
    except ValueError:  # e.g. "http://[::1": quoted as it came
        return location


def _shown_header(value: str) -> str:
    """A header the server sent, for a message: one printable line, without a user name or password."""
    return shown_url(_excerpt(value.encode("utf-8", "replace")))


def _answer_body(url: str, reply: Reply) -> dict:
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
        raise Unanswered(f"an HTML page instead of an answer (from a proxy?): {_excerpt(text)!r}")
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
    here) is that request's own outcome: the batch goes on with the rest; only
    a redirect (BatchError) ends it. At an interrupt it returns at once: the
    requests in flight are left to their threads, which write nothing.
    """
    model = endpoint.first_model()
    tally = RunTally()
    pending = [e for e in entries if not is_done(e, finished)]

    def keep(entry, outcome: dict | Unanswered | None) -> None:
        if isinstance(outcome, Unanswered):
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
    requests = [e for e in pending if isinstance(e, BatchRequest)]
    stop = threading.Event()  # set as this returns, however: no thread starts another request then
    try:
        results = _send_all(endpoint, requests, defaults, model, interrupt, stop, concurrency)
        for _ in requests:
            request, outcome = _next_result(results, interrupt)
            if request is None:
                break  # interrupted
            if isinstance(outcome, BatchError):
                raise outcome
            keep(request, outcome)
    finally:
        stop.set()
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


def _send_all(endpoint: Endpoint, requests: list[BatchRequest], defaults: dict, model: str, interrupt: Interrupt,
              stop: threading.Event, concurrency: int) -> queue.SimpleQueue:
    """Send the requests, `concurrency` at a time; each (request, outcome) goes on the queue returned as it comes.

    The threads are daemons, not a ThreadPoolExecutor's: leaving an executor, and Python's exit, wait for
    every one of its threads, so a request stuck on its server held up even Ctrl-C for as long as it was.
    """
    todo, results = queue.SimpleQueue(), queue.SimpleQueue()
    for request in requests:
        todo.put(request)

    def send() -> None:
        while not (stop.is_set() or interrupt.requested.is_set()):
            try:
                request = todo.get_nowait()
            except queue.Empty:
                return
            outcome = _outcome(endpoint, request, defaults, model, interrupt)
            if isinstance(outcome, BatchError):
                stop.set()  # a redirect: no request goes to that server again
            results.put((request, outcome))

    for _ in range(min(concurrency, len(requests))):
        threading.Thread(target=send, name="batch-endpoint", daemon=True).start()
    return results


def _next_result(results: queue.SimpleQueue, interrupt: Interrupt) -> tuple[BatchRequest | None, object]:
    """The next (request, outcome); (None, None) once interrupted and no outcome that came before is left."""
    while not interrupt.requested.is_set():
        try:
            return results.get(timeout=POLL_SECONDS)  # Ctrl-C only sets the flag: a wait without end would miss it
        except queue.Empty:
            pass
    try:
        return results.get_nowait()
    except queue.Empty:
        return None, None


def _outcome(endpoint: Endpoint, request: BatchRequest, defaults: dict, model: str,
             interrupt: Interrupt) -> dict | Unanswered | BatchError | None:
    try:
        return _answer(endpoint, request, request_body(request, defaults, model), interrupt)
    except BatchError as err:  # a redirect: the end of the batch, which only the main thread may decide
        return err
    except Exception as err:  # a bug here, not the server's doing: still only this request's outcome
        message = f"line {request.line}: sending it failed ({type(err).__name__}: {err}); rerun the same command to retry it"
        return error_record(request.custom_id, REQUEST_FAILED, message, request.fingerprint)


def _answer(endpoint: Endpoint, request: BatchRequest, body: dict, interrupt: Interrupt) -> dict | Unanswered | None:
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
        except Unanswered as err:
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
