"""The HTTP side of `edgespec serve`: OpenAI-compatible routes on a Starlette app.

Every failure becomes an OpenAI-style error body with a 4xx status (5xx only
for a bug; error_answers.py); nothing a client sends can stop the server.  Which requests may
reach the routes at all (no web page's, unless allowed) is guard.py's to say.
Requests go to the one engine through EngineWorker's bounded FIFO queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Done, Engine, Step
from ..monitor import AcceptanceMonitor
from ..sampling import SamplingParams
from .deadlines import BODY_SECONDS
from .error_answers import AnswerErrorsInJson, api_error, http_error
from .guard import RequestGuard
from .metrics import ServerMetrics
from .protocol import ApiError, parse_request
from .responses import ResponseWriter
from .worker import EngineWorker, Job, QueueFull, shutting_down

log = logging.getLogger("edgespec.serve")

DISCONNECT_POLL_SECONDS = 0.1  # how often a waiting request checks that its client is still there


@dataclass
class ServerConfig:
    model_name: str
    defaults: SamplingParams
    api_key: str | None = None
    queue_size: int = 8
    request_timeout: float = 300.0
    max_body_bytes: int = 2 * 1024 * 1024
    parallel: int = 1  # requests decoded together (see worker.py)
    port: int = 0  # the port bound, which a request's Host must name (see guard.py)
    host_names: tuple[str, ...] | None = None  # the names a request's Host may carry; None: any
    origins: str | None = None  # a regular expression for the web pages' origins allowed; None: none


class _ClientGone(Exception):
    pass


class _Server:
    def __init__(self, engine: Engine, config: ServerConfig, monitor: AcceptanceMonitor):
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics(monitor)
        self.metrics.start_mode(engine.mode)
        self.worker = EngineWorker(engine, config.queue_size, lambda job, result: self.metrics.record_generation(result.stats),
                                   config.parallel)
        self.metrics.queue_depth.set_function(lambda: self.worker.depth)
        self.stopping = asyncio.Event()  # set when the server goes down: a body still arriving is not waited for

    def stop_all(self) -> None:
        """The server is going down: every job ends with a 503, and so does every request still sending its body."""
        self.stopping.set()
        self.worker.stop_all()

    # -- routes ----------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["name"]
        if not name:  # /v1/models/, which the {name:path} route takes: the list, as /v1/models
            return await self.models(request)
        if name != self.config.model_name:
            raise ApiError(404, f"the model {name[:100]!r} does not exist: this server serves one model, "
                                f"{self.config.model_name!r} (which answers a request naming any model)",
                           param="model", code="model_not_found")
        return JSONResponse(self._model())

    def _model(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "edgespec"}

    async def health(self, request: Request) -> Response:
        mode = self.engine.mode
        monitor = self.metrics.monitor
        draft = "off" if mode == "none" else ("degraded" if monitor.is_degraded(mode) else "ok")
        return JSONResponse({
            "status": "ok", "model": self.config.model_name, "mode": mode, "draft": draft,
            "rolling_acceptance": monitor.acceptance(mode), "alert_acceptance": monitor.threshold,
            "queue_depth": self.worker.depth, "busy": self.worker.busy,
        })

    async def prometheus(self, request: Request) -> Response:
        self._authorize(request)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- completions -------------------------------------------------------------

    async def _complete(self, request: Request, chat: bool) -> Response:
        self._authorize(request)
        try:
            body = await self._json_body(request)
        except _ClientGone:
            return Response(status_code=499)
        parsed = parse_request(body, chat, self.config.defaults)
        job = Job(parsed, asyncio.get_running_loop(), self.config.request_timeout,
                  client=request.headers.get("authorization", ""))
        try:
            self.worker.submit(job)
        except QueueFull:
            raise ApiError(429, f"the server is busy: {self.worker.depth} requests are already waiting; retry shortly",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        writer = ResponseWriter(parsed, self.config.model_name)
        streaming = False
        try:
            first = await self._next_event(request, job)
            if isinstance(first, ApiError):
                raise first
            if parsed.stream:
                streaming = True  # from here the response owns the job
                return _JobStream(self._sse(job, writer, first), on_close=lambda: self.worker.withdraw(job))
            return JSONResponse(await self._whole(request, job, writer, first))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the status shows in the metrics
        except (ApiError, HTTPException):
            raise
        except Exception as error:  # a bug must cost one request, never the server
            log.error("request failed: %s: %s", type(error).__name__, error)
            raise ApiError(500, f"internal error: {type(error).__name__}", type="server_error") from None
        finally:
            if not streaming:
                self.worker.withdraw(job)

    async def _whole(self, request: Request, job: Job, writer: ResponseWriter, event) -> dict:
        while not isinstance(event, Done):
            event = await self._next_event(request, job)
            if isinstance(event, ApiError):
                raise event
        if job.stopped_by is not None:
            raise job.stopped_by
        result = event.result
        return writer.whole(result.text, result.finish_reason, result.stats)

    async def _next_event(self, request: Request, job: Job):
        """The job's next event, giving up when the client leaves or the time limit passes.

        The client is looked for every DISCONNECT_POLL_SECONDS, also while events come faster than that:
        looked for only when none came for that long, a non-streamed request whose client had left went on
        generating to its end (a minute on SmolLM2, whose steps never paused that long), and the queue with it.
        """
        loop = asyncio.get_running_loop()
        state = request.state  # one request's own, kept from one event to the next
        if not hasattr(state, "client_checked_at"):
            state.client_checked_at = loop.time()
        while True:
            left = state.client_checked_at + DISCONNECT_POLL_SECONDS - loop.time()
            if left > 0:
                try:
                    return await asyncio.wait_for(job.events.get(), left)
                except asyncio.TimeoutError:
                    pass
            state.client_checked_at = loop.time()
            if await request.is_disconnected():
                self.worker.withdraw(job)
                raise _ClientGone()
            job.check_deadline()  # still waiting in the queue, or a step that never ends
            if job.stopped_by is not None:
                self.worker.withdraw(job)
                raise job.stopped_by

    async def _sse(self, job: Job, writer: ResponseWriter, event):
        """The SSE body of one generation, from its first event on."""
        if job.request.chat:
            yield _sse(writer.chunk(first=True))
        while True:
            if isinstance(event, ApiError):  # headers are sent: the error goes in the stream
                yield _sse(event.body())
                return
            if isinstance(event, Step):
                text = "".join(token.text for token in event.tokens)
                if text:
                    yield _sse(writer.chunk(text))
            elif isinstance(event, Done):
                if job.stopped_by is not None:
                    yield _sse(job.stopped_by.body())
                    return
                if event.text:
                    yield _sse(writer.chunk(event.text))
                yield _sse(writer.chunk(engine_reason=event.result.finish_reason))
                if job.request.include_usage:
                    yield _sse(writer.usage_chunk(event.result.stats))
                yield b"data: [DONE]\n\n"
                return
            event = await job.events.get()

    # -- request checks --------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # RFC 7235: the scheme is case-insensitive; some clients send "bearer"
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip(" ").encode(), key.encode())):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    async def _json_body(self, request: Request):
        if not _is_json(request.headers.get("content-type", "")):
            # a web page can send text/plain or a form to any site without asking first; JSON only after a preflight
            raise ApiError(415, "send the body as JSON, with the header 'Content-Type: application/json' "
                                "(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # the body would be read as JSON text and fail as "not UTF-8"
            raise ApiError(415, f"the request body is compressed (Content-Encoding: {encoding[:40]}), which the "
                                "server does not read; send it uncompressed", code="unsupported_media_type")
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes; send a shorter prompt "
                                  "or start the server with a larger --max-body-bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 15 or int(declared) > limit):
            raise too_large
        seconds = min(BODY_SECONDS, self.config.request_timeout)
        reading = asyncio.ensure_future(_read_body(request, limit, too_large))
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            # a body declared and never sent held its connection for good, and a shutdown waited on it
            done, _ = await asyncio.wait((reading, stopping), timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            reading.cancel()  # nothing, when it is done
        if reading in done:
            return _json_value(reading.result())
        if stopping in done:
            raise shutting_down()
        raise ApiError(408, f"the request body did not arrive whole within {seconds:g} s; send all of it "
                            "(as many bytes as Content-Length says)", type="timeout", code="request_timeout")


async def _read_body(request: Request, limit: int, too_large: ApiError) -> bytes:
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise _ClientGone() from None
    return bytes(body)


def _is_json(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _json_value(body: bytes):
    """The body's JSON value; every way it can fail is the client's 400."""
    if not body.strip():  # curl -X POST without -d
        raise ApiError(400, 'the request body is empty; send a JSON object, e.g. {"messages": [{"role": "user", '
                            '"content": "Hello"}]}', code="invalid_json")
    try:
        return json.loads(body)
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8 text (byte {body[error.start]:#04x} at {error.start}); "
                            "send the JSON encoded as UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}; send one JSON object (strings in "
                            "double quotes, no trailing commas)", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to read; send a flatter JSON object",
                       code="invalid_json") from None
    except ValueError:  # Python reads integers of at most 4300 digits
        raise ApiError(400, "the request body holds a number too long to read (over 4300 digits)",
                       code="invalid_json") from None


class _JobStream(StreamingResponse):
    """An SSE response that lets go of its job however it ends: finished, or the client gone.

    Starlette stops the body on a disconnect, possibly before it started, so
    the job is withdrawn here rather than in the body's own cleanup.
    """

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class _CountResponses:
    """ASGI middleware: count every response by endpoint and status, errors included."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.endpoints else "/v1/models/{name}" if path.startswith("/v1/models/") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, config: ServerConfig, monitor: AcceptanceMonitor) -> Starlette:
    server = _Server(engine, config, monitor)
    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.close()

    middleware = [  # outermost first
        Middleware(_CountResponses, metrics=server.metrics, endpoints={r.path for r in routes}),
        Middleware(AnswerErrorsInJson),
        Middleware(RequestGuard, host_names=config.host_names, port=config.port, origins=config.origins),
    ]
    if config.origins:  # the web pages allowed get CORS answers, their preflights included
        middleware.append(Middleware(CORSMiddleware, allow_origin_regex=config.origins, allow_methods=["GET", "POST"],
                                     allow_headers=["*"], expose_headers=["Retry-After", "x-should-retry"],
                                     max_age=600,
                                     allow_private_network=True))  # Chrome asks a public page's preflight to a loopback server
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={ApiError: api_error, HTTPException: http_error})
    # A path with a trailing slash is a 404 naming the path without it, not Starlette's 307 to it: a client
    # that does not follow a redirect for a POST (httpx, which openai-python uses, does not) saw only the 307.
    app.router.redirect_slashes = False
    app.state.stop_generating = server.stop_all  # for the HTTP server's shutdown, before it drains
    return app
