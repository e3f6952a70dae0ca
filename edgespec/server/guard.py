"""What may reach the routes at all: requests for this server's own name, from no web page but those allowed.

A server on 127.0.0.1 without a key trusts whoever can reach it, and any web
page the user opens can reach it:
- DNS rebinding points the page's own host name at 127.0.0.1, so the browser
  lets the page read the answers.  Its requests still carry that name in
  `Host`, which a server bound to a loopback address refuses (421).  The port
  in `Host` is not checked: a page cannot choose it apart from its name, and a
  local port forward (`ssh -L`, an editor's) sends its own.  Bound to any other
  address the server needs an API key, which no page has, and the names the
  network gives the machine are not known here: Host is not checked.
- A browser puts an `Origin` header on every request a page makes to another
  site, and on every POST.  One that --allow-origin (or EDGESPEC_ORIGINS) does
  not allow gets 403 before any route runs, its CORS preflight included.  An
  allowed one gets CORS answers (starlette's CORSMiddleware, behind this).
- A page can also POST a text/plain body without a preflight: the routes take
  application/json only (app.py), which a page can only send after one.
Clients that are not browsers send no Origin and are not affected.
"""

from __future__ import annotations

import ipaddress
import re

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from ..errors import UsageError
from .protocol import ApiError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
ORIGINS_ENV = "EDGESPEC_ORIGINS"
_HOST_HEADER = re.compile(r"(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?")
# What a `*` in an allowed origin stands for: part of a host name, or after its `:` a port; never a scheme, a
# path or an `@`.
_HOST_WILDCARD = "[a-z0-9.-]*"
_PORT_WILDCARD = "[0-9]+"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on this machine
        return False


def url_host(host: str) -> str:
    """The host as a URL (and a Host header) writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def allowed_host_names(bound_host: str) -> tuple[str, ...] | None:
    """The names a request's Host may carry, the one bound first (see the module docstring); None: any."""
    if not is_loopback(bound_host):
        return None
    return tuple(dict.fromkeys((url_host(bound_host).lower(), *LOOPBACK_NAMES)))


def origin_regex(patterns: list[str]) -> str | None:
    """One regular expression for the origins allowed (None: none), `*` as a wildcard; a bad one is refused."""
    parts = []
    for pattern in patterns:
        if pattern == "*":
            return ".*"
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s@]+", pattern, re.IGNORECASE):
            raise UsageError(f"--allow-origin {pattern!r} (or in ${ORIGINS_ENV}) is not an origin: give scheme://host"
                                "[:port] without a path, e.g. http://localhost:3000, http://localhost:* or *")
        pieces = pattern.lower().split("*")
        parts.append("".join(re.escape(piece) + (_PORT_WILDCARD if piece.endswith(":") else _HOST_WILDCARD)
                             for piece in pieces[:-1]) + re.escape(pieces[-1]))
    return "(?i)(?:" + "|".join(parts) + ")" if parts else None


def origins_from_env(environ: dict) -> list[str]:
    """The origins EDGESPEC_ORIGINS allows: a comma-separated list, as Ollama's OLLAMA_ORIGINS."""
    return [origin.strip() for origin in environ.get(ORIGINS_ENV, "").split(",") if origin.strip()]


class RequestGuard:
    """ASGI middleware: refuse a foreign Host (421) or a web page's Origin not allowed (403), in JSON."""

    def __init__(self, app, host_names: tuple[str, ...] | None, port: int, origins: str | None):
        self.app, self.host_names, self.port = app, host_names, port  # the port only to name the server's URL
        self.origins = re.compile(origins) if origins else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(Headers(scope=scope))
        if refusal is None:
            return await self.app(scope, receive, send)
        await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)

    def _refusal(self, headers: Headers) -> ApiError | None:
        host = headers.get("host")
        if host is not None and not self._is_own(host):
            own = f"{self.host_names[0]}:{self.port}"
            return ApiError(421, f"this server answers for {own}, not for the host {host[:100]!r} (a web page "
                                 f"reaching it through DNS rebinding would send that); connect to http://{own}",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not (self.origins and self.origins.fullmatch(origin)):
            return ApiError(403, f"requests from the web page at {origin[:100]!r} are refused: a page the user opens "
                                 "must not drive this server; to allow it, start the server with --allow-origin "
                                 f"ORIGIN (or set ${ORIGINS_ENV})", code="origin_not_allowed")
        return None

    def _is_own(self, host: str) -> bool:
        if self.host_names is None:
            return True
        found = _HOST_HEADER.fullmatch(host.lower())
        return bool(found) and found[1] in self.host_names
