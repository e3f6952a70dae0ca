"""`edgespec batch --endpoint URL`: the same batch file, sent to any OpenAI-compatible server.

Each pending request's body goes as IN states it to URL + its url
(/v1/chat/completions or /v1/completions), with up to `concurrency` requests
in flight; edgespec serve, vLLM and llama-server all answer it. A plain line
({"prompt": ...}) becomes a chat body. Fields a body leaves out get the
command line's sampling values (max_tokens, temperature, top_p, and seed and
stop when given), and "model" the server's first model.

The records are the local batch's, appended and fsynced one by one as the
answers come back (in any order, which the OpenAI Batch format allows), so
resume after kill -9, one record per custom_id and bad lines as error records
hold as they do locally. A 4xx answer is that request's record (OpenAI's
form: the status and the server's body). 429, 5xx and connections that fail
are retried with exponential backoff, honouring Retry-After (a full queue
for up to QUEUE_WAIT_SECONDS without counting as a failure); a request that
still fails after MAX_ATTEMPTS is left unwritten, so a rerun retries it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from .output import RecordWriter, answer_record, error_record, is_done
from .requests import BatchError, BatchRequest, InvalidRequest
from .runner import Interrupt, RunTally

RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_ATTEMPTS = 6
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 600.0
QUEUE_WAIT_SECONDS = 600.0  # how long one request waits out a full queue (429s) before they count as failures
MAX_CONCURRENCY = 64


class _Unanswered(Exception):
    """No usable answer this attempt: retried, and after the last attempt left for a rerun."""

    def __init__(self, reason: str, retry_after: float | None = None, status: int | None = None):
        super().__init__(reason)
        self.retry_after, self.status = retry_after, status


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its base URL (without /v1) and the key it wants."""

    base_url: str
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None) -> "Endpoint":
        base = url.strip().rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise BatchError(f"--endpoint {url!r} is not an http:// or https:// URL; give e.g. http://127.0.0.1:8080")
        return cls(base[: -len("/v1")] if base.endswith("/v1") else base, api_key or None)

    def first_model(self) -> str:
        """The first model the server lists: checks the URL and the key before any request is sent."""
        try:
            status, body, _ = self._call("GET", "/v1/models", None)
        except _Unanswered as err:
            raise BatchError(f"cannot reach {self.base_url}: {err}; check --endpoint and that the server runs") from None
        if status == 401:
            raise BatchError(f"{self.base_url} refused the API key (401); give the server's key with --api-key")
        models = body.get("data") if status == 200 and isinstance(body, dict) else None
        if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
            raise BatchError(f"{self.base_url}/v1/models answered {status} without a model list; "
                             "is --endpoint an OpenAI-compatible server?")
        return models[0]["id"]

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """The status and JSON body of a final answer; raises _Unanswered for one worth retrying."""
        status, answer, retry_after = self._call("POST", path, json.dumps(body).encode())
        if status in RETRIED_STATUSES:
            raise _Unanswered(f"HTTP {status}", retry_after, status)
        return status, answer

    def _call(self, method: str, path: str, data: bytes | None) -> tuple[int, dict, float | None]:
        """The status, the JSON body, and the seconds the server's Retry-After asks for (None: none given)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
                return response.status, _json_body(response.read()), None
        except urllib.error.HTTPError as error:
            return error.code, _json_body(error.read()), _seconds(error.headers.get("Retry-After"))
        except (urllib.error.URLError, OSError, ValueError) as error:  # refused, reset, timed out, bad answer
            raise _Unanswered(str(getattr(error, "reason", error))) from None


def _json_body(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {"error": {"message": raw[:500].decode("utf-8", "replace")}}
    return value if isinstance(value, dict) else {"error": {"message": str(value)[:500]}}


def _seconds(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None  # an HTTP date: fall back to the backoff


def request_body(request: BatchRequest, defaults: dict, model: str) -> dict:
    """The body to send: IN's own (a chat body for a plain line), filled in from defaults and model."""
    body = dict(request.body) if request.body is not None else {"messages": [dict(m) for m in request.messages]}
    for field, value in defaults.items():
        if field not in body and not (field == "max_tokens" and "max_completion_tokens" in body):
            body[field] = value
    body.setdefault("model", model)
    return body


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
    """Send every entry not yet done, appending each record as its answer comes back."""
    model = endpoint.first_model()
    tally = RunTally()
    pending = [e for e in entries if not is_done(e, finished)]

    def keep(entry, record: dict | None) -> None:
        if record is None:
            tally.unanswered += 1
            return
        writer.append(record)  # only this thread writes OUT
        finished[entry.custom_id] = record
        tally.written += 1
        tally.add_answer(record)
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
                keep(in_flight.pop(future), future.result())
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


def _answer(endpoint: Endpoint, request: BatchRequest, body: dict, interrupt: Interrupt) -> dict | None:
    """The request's record, or None when every attempt went unanswered (or the batch was interrupted).

    A full queue (429) is a server at work, not a failure: it is waited out for up to
    QUEUE_WAIT_SECONDS without using up attempts, so --concurrency may exceed the server's queue.
    """
    delay, failures = FIRST_BACKOFF_SECONDS, 0
    queue_deadline = time.monotonic() + QUEUE_WAIT_SECONDS
    while True:
        try:
            status, answer = endpoint.post(request.url, body)
        except _Unanswered as err:
            busy = err.status == 429 and time.monotonic() < queue_deadline
            failures += not busy
            if failures == MAX_ATTEMPTS:
                return None
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
