"""How long a client may take to send a request: its head, then its body.

uvicorn waits for a request's head for ever: a connection that sends nothing, or a head a byte at a time,
held a file descriptor until the client left, and 1,100 of them (no API key needed, nothing is checked
before the head is whole) used up the usual 1,024, after which the server answered nobody and logged the
failed accept without end.  A head must now arrive within HEAD_SECONDS of the connection (or of the last
answer on it, which uvicorn's keep-alive timer closes sooner when nothing at all comes); the body must
come whole within BODY_SECONDS of its head, or the app answers 408 (app.py, where it reads the body).
"""

from __future__ import annotations

import functools

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_SECONDS = 30.0
BODY_SECONDS = 60.0


class _HeadDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request head has not come within
    head_seconds.  A head that has come makes a new request cycle, which the deadline checks for."""

    def __init__(self, *args, head_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_seconds = head_seconds

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._wait_for_a_head(answered=None)

    def on_response_complete(self) -> None:
        # Taken before uvicorn's own, which begins a pipelined request already received: the deadline is for
        # the head after the one just answered, not after the request now being worked on.
        answered = self.cycle
        super().on_response_complete()
        self._wait_for_a_head(answered)

    def _wait_for_a_head(self, answered) -> None:
        """Close the connection head_seconds from now unless a request cycle other than `answered` began."""
        def close_if_none_came() -> None:
            if self.cycle is answered and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.head_seconds, close_if_none_came)


def http_protocol(request_timeout: float):
    """The protocol factory for uvicorn.Config(http=...): a head has HEAD_SECONDS, or the whole request's time
    limit when that is shorter."""
    return functools.partial(_HeadDeadlineProtocol, head_seconds=min(HEAD_SECONDS, request_timeout))
