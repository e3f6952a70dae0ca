"""Running the app: uvicorn on the socket `edgespec serve` bound, until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import socket

import uvicorn
from starlette.applications import Starlette

from .deadlines import http_protocol

_UPGRADE_WARNINGS = ("Unsupported upgrade request", "No supported WebSocket library")


class _HttpServer(uvicorn.Server):
    """uvicorn, stopping every generation before it waits for open responses to finish."""

    async def shutdown(self, sockets=None):
        self.config.app.state.stop_generating()
        await super().shutdown(sockets)
        if self.force_exit:  # a second Ctrl-C: uvicorn skips the app's shutdown, whose task, cancelled at the
            await self.lifespan.shutdown()  # exit, then logged a traceback; it only lets go of the engine


def run_app(app: Starlette, sock: socket.socket, request_timeout: float) -> None:
    """Serve on a bound, listening socket until SIGINT or SIGTERM; a request's head must come within
    request_timeout (at most deadlines.HEAD_SECONDS)."""
    # Any web page can send an Upgrade header (new WebSocket(...)); uvicorn answered each with two warnings, one
    # advising to install a WebSocket library. The request is answered over HTTP, and nothing is worth logging.
    logging.getLogger("uvicorn.error").addFilter(lambda record: not record.getMessage().startswith(_UPGRADE_WARNINGS))
    config = uvicorn.Config(app, log_config=None, log_level="warning", timeout_graceful_shutdown=5,
                            http=http_protocol(request_timeout), ws="none")
    _HttpServer(config).run(sockets=[sock])
