"""One --endpoint call: the server's reply, with no redirect followed and the whole answer within a deadline.

urllib's defaults do neither. A redirect is followed with the same headers,
so the API key (and, for a 307 or 308, the prompt) would go to whatever host
the server names, and that host's reply would stand for the answer. And a
socket's timeout bounds each read, not the answer: it restarts with every
byte, so a server that sends one byte now and then (in its headers or its
body) holds the call, and the thread making it, for as long as it likes.
Here a 3xx is returned as it is (an HTTPError, as urllib gives a 4xx), and
each call's connection is shut down when its deadline passes, which ends a
read blocked on it at once.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

READ_CHUNK_BYTES = 1 << 16


class Unanswered(Exception):
    """No usable answer this attempt: retried, and after the last attempt left for a rerun; timed_out: none came
    whole within the deadline."""

    def __init__(self, reason: str, retry_after: float | None = None, status: int | None = None,
                 timed_out: bool = False):
        super().__init__(reason)
        self.retry_after, self.status, self.timed_out = retry_after, status, timed_out


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    raw: bytes  # at most max_bytes + 1 (see call): more is never an answer
    retry_after: float | None  # the seconds the server's Retry-After asks for (None: none given)
    location: str | None  # a redirect's Location


def call(request: urllib.request.Request, seconds: float, max_bytes: int) -> Reply:
    """The server's reply to request, whatever its status (a 3xx included), its body cut after max_bytes + 1
    bytes; raises Unanswered when none came whole within seconds."""
    with Deadline(seconds) as deadline:
        try:
            try:
                response = deadline.open(request)
            except urllib.error.HTTPError as error:
                response = error  # a 3xx, 4xx or 5xx: the error is the response, body and headers
            with response:
                headers = response.headers
                reply = Reply(response.status, headers.get_content_type(), _read_body(response, headers, max_bytes),
                              _seconds(headers.get("Retry-After")), headers.get("Location"))
        except Unanswered:  # the body ended early
            if not deadline.passed:
                raise
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
            # refused, reset, timed out, closed mid-answer, a malformed status line or header
            if not deadline.passed:
                raise Unanswered(_failure_reason(error)) from None
        if deadline.passed:  # cut off: whatever came before is no whole answer, however it ended
            raise Unanswered(f"no whole answer within {seconds:g} s", timed_out=True)
    return reply


def _read_body(response, headers, max_bytes: int) -> bytes:
    """The body, up to max_bytes + 1 bytes; raises Unanswered when it ends before its Content-Length."""
    chunks, size = [], 0
    while size <= max_bytes and (chunk := response.read(READ_CHUNK_BYTES)):
        chunks.append(chunk)
        size += len(chunk)
    raw = b"".join(chunks)
    declared = headers.get("Content-Length", "")
    if declared.isdigit() and len(raw) < int(declared) and size <= max_bytes:
        # A read with a size returns what came before the close, without complaint: compare.
        raise Unanswered(f"the answer was cut off after {len(raw)} of its {int(declared)} bytes")
    return raw


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, http.client.IncompleteRead):
        return f"the answer was cut off after {len(error.partial)} bytes"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    reason = getattr(error, "reason", None) or error
    return str(reason) or type(reason).__name__


def _seconds(header: str | None) -> float | None:
    """A Retry-After's seconds; None (the backoff decides) for none, an HTTP date, or a wait that is no wait:
    "0" or "-5" from a struggling server had every attempt spent within a second (as openai-python, which
    honours only a positive one)."""
    try:
        seconds = float(header) if header else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds > 0 else None  # NaN is not > 0


class Deadline:
    """One call's time limit, from __enter__: when it passes, the call's connection is cut (`passed` tells)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.passed = False
        self._connections: list[_Cuttable] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True  # never what keeps the process from exiting

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._timer.cancel()

    def open(self, request: urllib.request.Request):
        """The server's response to request (a 3xx, 4xx or 5xx raised as urllib.error.HTTPError, which holds it)."""
        opener = urllib.request.build_opener(_NoRedirects, _CutHTTPHandler(self), _CutHTTPSHandler(self))
        return opener.open(request, timeout=self.seconds)

    def connections(self, cuttable_class: type[_Cuttable]):
        """A maker of cuttable_class connections that this deadline cuts, for urllib's do_open."""
        def connection(*args, **kwargs) -> _Cuttable:
            made = cuttable_class(*args, **kwargs)
            with self._lock:
                self._connections.append(made)
                if self.passed:
                    made.cut()
            return made

        return connection

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            for connection in self._connections:
                connection.cut()


class _Cuttable:
    """A connection that another thread can cut: shutting its socket down ends a read blocked on it at once."""

    sock: socket.socket | None
    _cut_off = False
    _connected: socket.socket | None = None  # kept: urllib drops self.sock once the headers are in

    def connect(self) -> None:
        super().connect()
        self._connected = self.sock
        if self._cut_off:  # cut while connecting, before there was a socket to shut
            self._shut()

    def cut(self) -> None:
        self._cut_off = True
        self._shut()

    def _shut(self) -> None:
        for sock in {self.sock, self._connected} - {None}:  # while connecting, self.sock is all there is
            try:
                # The plain socket's shutdown even for TLS: ssl's own drops its state under the thread reading it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: nothing left to cut


class _CutHTTPConnection(_Cuttable, http.client.HTTPConnection):
    pass


class _CutHTTPSConnection(_Cuttable, http.client.HTTPSConnection):
    pass


_CUTTABLE = {http.client.HTTPConnection: _CutHTTPConnection, http.client.HTTPSConnection: _CutHTTPSConnection}


class _CutConnections:
    """A handler whose connections its Deadline can cut (urllib's own, for http:// and https:// and proxies)."""

    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class, req, **http_conn_args):
        return super().do_open(self._deadline.connections(_CUTTABLE[http_class]), req, **http_conn_args)


class _CutHTTPHandler(_CutConnections, urllib.request.HTTPHandler):
    pass


class _CutHTTPSHandler(_CutConnections, urllib.request.HTTPSHandler):
    pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def http_error_302(self, req, fp, code, msg, headers):
        return None  # not handled: urllib's error handling raises the 3xx as an HTTPError, as it is

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302
