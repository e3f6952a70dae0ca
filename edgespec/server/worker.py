"""One engine, fed by a bounded FIFO queue: a worker thread runs its generations, one or several at a time.

The HTTP side submits a Job and reads its events from an asyncio queue; the
worker thread tokenizes the prompt, runs the engine's scheduler and hands
every Step and the final Done back through the event loop.  A job's cancel
event (a client that went away, the time limit) stops its generation within
one step; a job cancelled while it waits is simply skipped.

With parallel > 1 up to that many decode together, one shared pass per step,
each new job joining as soon as a place is free (edgespec.scheduler); a new
prompt reuses what any sequence's cache shares with it (a chat's earlier
turns, when they are still there).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import threading
import time
from typing import Callable

from ..engine import Engine
from ..errors import ContextOverflowError, EdgespecError
from ..generation import Done, Failed, GenerationResult
from ..ngram_pool import NgramPool
from ..prompts import check_chat_fits
from ..scheduler import Job as ScheduledJob
from .protocol import ApiError, CompletionRequest, worded_for_requests

# Clients (API keys) whose recent texts the server keeps for n-gram drafts, each in a pool of its own.
MAX_CLIENT_POOLS = 8

log = logging.getLogger("edgespec.serve")


class QueueFull(Exception):
    pass


class Job:
    """One request's generation; its events arrive on `events` in the event loop's thread."""

    def __init__(self, request: CompletionRequest, loop: asyncio.AbstractEventLoop, time_limit: float,
                 client: str = ""):
        self.request = request
        self.client_id = client_id(client)
        self.cancel = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.deadline = time.monotonic() + time_limit
        self.time_limit = time_limit
        self.stopped_by: ApiError | None = None  # why the server stopped it: time limit, shutdown
        self._loop = loop

    def deliver(self, event) -> None:
        """Pass a Step, Done or ApiError to the waiting request (from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: the server is shutting down
            self.cancel.set()

    def stop(self, error: ApiError) -> None:
        """Stop the job for a reason its client gets told (the generation ends within one step)."""
        if self.stopped_by is None:
            self.stopped_by = error
        self.cancel.set()

    def check_deadline(self) -> None:
        if time.monotonic() >= self.deadline and not self.cancel.is_set():
            self.stop(ApiError(408, f"the request ran past the {self.time_limit:g} s time limit; ask for fewer "
                                    "tokens (max_tokens) or start the server with a larger --request-timeout",
                               type="timeout", code="request_timeout",
                               # a 408 is one openai-python retries, twice by default: each retry would
                               # hold the engine for the whole limit again, and end the same way
                               headers={"x-should-retry": "false"}))


def client_id(authorization: str) -> str:
    """A request's client, by the credentials it came with (its Authorization header), as the caches it shares
    with that client's other requests know it: its n-gram pool, its KV cells and snapshots.  Never another
    client's, whose texts its drafts or the tokens it finds cached would tell; and never the scope of the
    user's own prompts ("", run's and the chat's), which a request sending no key would read alike.  A hash,
    which a snapshot's file may keep; the bearer token as the server checks it, however the header spells it."""
    scheme, _, token = authorization.partition(" ")
    credentials = token.strip(" ") if scheme.lower() == "bearer" else authorization
    return "serve-" + hashlib.sha256(credentials.encode("utf-8", "replace")).hexdigest()


def shutting_down() -> ApiError:
    """The answer to a request the server can no longer serve: it is going down."""
    return ApiError(503, "the server is shutting down; retry when it is back", type="server_error", code="shutting_down")


class EngineWorker:
    def __init__(self, engine: Engine, queue_size: int, on_finished: Callable[[Job, GenerationResult], None],
                 parallel: int = 1):
        self.engine = engine
        self.queue_size = queue_size
        self.parallel = parallel
        self._on_finished = on_finished
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="edgespec-engine", daemon=True)
        self._pools: dict[str, NgramPool] = {}  # per client, least recently used first

    def start(self) -> None:
        self._thread.start()

    def stop_all(self) -> None:
        """The server is going down: every job, waiting or running, ends now with a 503."""
        error = shutting_down()
        with self._wake:
            self._closed = True
            for job in [*self._waiting, *self._running]:
                job.stop(error)
                job.deliver(error)  # a waiting job gets no other event
            self._waiting.clear()
            self._wake.notify_all()

    def close(self) -> None:
        """Stop every job and wait for the thread to let go of the engine."""
        self.stop_all()
        self._thread.join()

    @property
    def depth(self) -> int:
        """Requests waiting for the engine (not counting those it is generating)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._closed:
                raise shutting_down()
            if len(self._waiting) + len(self._running) > self.queue_size + self.parallel - 1:
                raise QueueFull()
            self._waiting.append(job)
            self._wake.notify()

    def withdraw(self, job: Job) -> None:
        """Forget a job whose client went away; a running one stops after its current step."""
        job.cancel.set()
        with self._wake:
            if job in self._waiting:
                self._waiting.remove(job)

    def _serve(self) -> None:
        """Run jobs through the scheduler until the worker closes; a bug ends the jobs in flight, not the thread."""
        while not self._closed:
            try:
                for job, event in self.engine.scheduler(self.parallel).run(self._next_job):
                    if isinstance(event, (Done, Failed)):
                        with self._wake:
                            self._running.discard(job)
                    if isinstance(event, Failed):
                        job.deliver(self._api_error(job, event.error))
                        continue
                    if isinstance(event, Done):
                        self._on_finished(job, event.result)
                    job.deliver(event)
                    job.check_deadline()
            except Exception as error:  # a bug must cost the requests in flight, never the server
                with self._wake:
                    running, self._running = list(self._running), set()
                for job in running:
                    job.stop(self._api_error(job, error))
                    job.deliver(job.stopped_by)

    def _next_job(self, wait: bool) -> ScheduledJob | None:
        """The next waiting job, ready for the scheduler (None: none waiting; with wait, until one comes or the
        worker closes); one that timed out, was withdrawn, or whose prompt cannot be made is answered here."""
        while True:
            with self._wake:
                while wait and not self._waiting and not self._closed:
                    self._wake.wait()
                if self._closed or not self._waiting:
                    return None
                job = self._waiting.popleft()
                self._running.add(job)
            job.check_deadline()
            try:
                if not job.cancel.is_set():
                    prediction = self.engine.prediction_tokens(job.request.prediction)
                    return ScheduledJob(job, self._prompt_ids(job.request), job.request.params, job.cancel,
                                        prediction=prediction, pool=self.pool_for(job), cache_scope=job.client_id)
                if job.stopped_by is not None:
                    job.deliver(job.stopped_by)
            except Exception as error:
                job.deliver(self._api_error(job, error))
            with self._wake:
                self._running.discard(job)

    @staticmethod
    def _api_error(job: Job, error: Exception) -> ApiError:
        if isinstance(error, ContextOverflowError):
            return ApiError(400, worded_for_requests(error), param="messages" if job.request.chat else "prompt",
                            code="context_length_exceeded")
        if isinstance(error, EdgespecError):
            return ApiError(400, worded_for_requests(error))
        log.error("request failed inside the engine: %s: %s", type(error).__name__, error)
        return ApiError(500, f"internal error: {type(error).__name__}", type="server_error")

    def pool_for(self, job: Job) -> NgramPool | None:
        """The pool of earlier requests' texts for this job's client (API key): never shared between
        clients; the least recently used is dropped past MAX_CLIENT_POOLS.  None when the engine keeps no pool."""
        if self.engine.pool is None:
            return None
        with self._wake:
            pool = self._pools.pop(job.client_id, None) or NgramPool()
            self._pools[job.client_id] = pool
            while len(self._pools) > MAX_CLIENT_POOLS:
                del self._pools[next(iter(self._pools))]
        return pool

    def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        if request.chat:
            check_chat_fits(request.messages, self.engine.n_ctx)  # before seconds of the engine's thread go on it
            return self.engine.chat_tokens(list(request.messages))
        return self.engine.prompt_tokens(request.prompt, raw=True)
