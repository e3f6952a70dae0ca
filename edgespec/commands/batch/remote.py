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
  retries it. The whole answer must come within REQUEST_TIMEOUT_SECONDS
  (endpoint.py, transport.py): one that does not (a server stuck, or one
  trickling its answer in) is left for a rerun at once, since each attempt
  more would hold its place in the batch as long again (six attempts held one
  for an hour). The model list must come within MODELS_TIMEOUT_SECONDS, and a
  stop signal ends the wait for it;
- a redirect (3xx) is never followed (it would carry the API key and the
  prompts to another host) and never saved: every request would get it, so it
  ends the batch, with what was written kept, naming the URL to give instead.
No other answer, however malformed, ends the batch or its summary.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from ...notices import print_notice
from .endpoint import Endpoint, NotAnAnswer
from .output import INVALID_ANSWER, REQUEST_FAILED, RecordWriter, answer_record, error_record, is_done
from .requests import BatchError, BatchRequest, InvalidRequest
from .runner import Interrupt, RunTally
from .transport import Unanswered

MAX_ATTEMPTS = 6
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
QUEUE_WAIT_SECONDS = 600.0  # how long one request waits out a full queue (429s) before they count as failures
MAX_CONCURRENCY = 64
POLL_SECONDS = 0.2  # how soon a Ctrl-C is seen while every request in flight waits on its server


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
    tally = RunTally()
    model = _first_model(endpoint, interrupt)
    if model is None:
        tally.interrupted = True
        return tally
    pending = [e for e in entries if not is_done(e, finished)]

    def keep(entry, outcome: dict | Unanswered | None) -> None:
        if isinstance(outcome, Unanswered):
            tally.unanswered += 1
            tries = "" if outcome.timed_out else f" after {MAX_ATTEMPTS} attempts, the last"
            print_notice(f"edgespec batch: no answer for {entry.custom_id!r} (line {entry.line}){tries}: {outcome}; "
                         "left for a rerun")
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


def _first_model(endpoint: Endpoint, interrupt: Interrupt) -> str | None:
    """endpoint.first_model(), or None once a stop signal comes first: the call runs on a thread of its own,
    since the signal only sets a flag, which a call blocked on its server would see only at its deadline."""
    outcome = queue.SimpleQueue()

    def ask() -> None:
        try:
            outcome.put(endpoint.first_model())
        except BaseException as error:  # handed to the main thread, which raises it
            outcome.put(error)

    threading.Thread(target=ask, name="batch-endpoint-models", daemon=True).start()
    while not interrupt.requested.is_set():
        try:
            answer = outcome.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        if isinstance(answer, BaseException):
            raise answer
        return answer
    return None


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
        except NotAnAnswer as err:
            message = (f"line {request.line}: the server answered {err}; not saved as an answer, "
                       "rerun the same command to retry it")
            return error_record(request.custom_id, INVALID_ANSWER, message, request.fingerprint)
        except Unanswered as err:
            busy = err.status == 429 and time.monotonic() < queue_deadline
            failures += not busy
            if failures == MAX_ATTEMPTS or err.timed_out:
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
