"""How `edgespec serve` answers what no route answered well: OpenAI-style error bodies for its own ApiErrors,
for Starlette's 404s and 405s (each naming the fix: the path meant, the method to use), and for a bug (a
500 that costs one request, never the server)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .protocol import ApiError

log = logging.getLogger("edgespec.serve")


def api_error(request: Request, error: ApiError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def http_error(request: Request, error: HTTPException) -> Response:
    message, code = f"{request.method} {request.url.path}: {error.detail}", None
    allowed = (error.headers or {}).get("Allow", "")
    if error.status_code == 405 and allowed:  # each route takes one method (a GET route HEAD too, which nobody means)
        method = next(m.strip() for m in allowed.split(",") if m.strip() != "HEAD")
        message, code = f"{message}; use {method}", "method_not_allowed"
    elif error.status_code == 404:
        message += "; " + _where_the_routes_are(request)
    # OpenAI's own 404 for a path it does not have is an invalid_request_error, which clients map by status
    return api_error(request, ApiError(error.status_code, message, code=code, headers=error.headers))


def _where_the_routes_are(request: Request) -> str:
    """A 404's fix: most often a client's base URL without its /v1, else the paths there are."""
    paths = [route.path for route in request.app.routes if "{" not in route.path]
    path = request.url.path
    if "/v1" + path in paths:
        return f"did you mean /v1{path}? (a client's base URL ends in /v1: http://HOST:PORT/v1)"
    if path.rstrip("/") in paths:
        return f"did you mean {path.rstrip('/')}? (without the last /)"
    return "this server answers " + ", ".join(paths)


class AnswerErrorsInJson:
    """ASGI middleware: an exception no route answered (a bug) still gets an OpenAI-style 500, and one log line.

    Without it starlette answers a plain-text 500 and uvicorn logs a traceback.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:  # a bug must cost one request, never the server
            log.error("%s %s failed: %s: %s", scope.get("method"), scope.get("path"), type(error).__name__, error)
            if not started:  # else the client gets a cut response: too late for a status
                failure = ApiError(500, f"internal error: {type(error).__name__}", type="server_error")
                await api_error(Request(scope), failure)(scope, receive, send)
