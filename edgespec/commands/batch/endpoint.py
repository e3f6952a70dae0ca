"""An OpenAI-compatible server as `edgespec batch --endpoint` talks to it: its address, its model list, and a
request's final answer told from what is worth asking again (remote.py decides what to do with each).

What a server answers is data from outside: a 2xx is an answer only when its body is one (answers.py),
an HTML page (a proxy's, in front of a restarting server) and 429 or 5xx are worth retrying, a redirect
is never followed (transport.py), and every part of an answer quoted in a message is one printable line
without a user name or password.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass

from .answers import answer_object, answer_problem
from .requests import BatchError
from .transport import Reply, Unanswered, call

EXAMPLE_URL = "http://127.0.0.1:8080"
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
REQUEST_TIMEOUT_SECONDS = 600.0  # for the whole answer, from the request to the body's last byte
MODELS_TIMEOUT_SECONDS = 60.0  # for /v1/models, which a server answers from what it has loaded, at once
MAX_ANSWER_BYTES = 32 << 20  # far above any completion's JSON, logprobs included; a bigger body is no answer


class NotAnAnswer(Exception):
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
            reply = self._call("GET", "/v1/models", None, MODELS_TIMEOUT_SECONDS)
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

        Raises Unanswered for what is worth retrying, NotAnAnswer for a 2xx that is no answer.
        """
        reply = self._call("POST", path, json.dumps(body).encode(), REQUEST_TIMEOUT_SECONDS)
        if reply.status in RETRIED_STATUSES:
            raise Unanswered(f"HTTP {reply.status}", reply.retry_after, reply.status)
        if 200 <= reply.status < 300:
            return reply.status, _answer_body(path, reply)
        refusal = _json_body(reply.raw)
        return reply.status, refusal if isinstance(refusal, dict) else {"error": {"message": _excerpt(reply.raw)}}

    def _call(self, method: str, path: str, data: bytes | None, seconds: float) -> Reply:
        """The server's reply, whatever its status; raises Unanswered when none came whole within seconds, and
        BatchError for a redirect."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        reply = call(request, seconds, MAX_ANSWER_BYTES)
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
        raise NotAnAnswer(f"HTTP {reply.status} where a 200 with the answer was due")
    if reply.content_type == "text/event-stream" or text.startswith((b"data:", b"event:")):
        raise NotAnAnswer("an event stream, though the batch asked for one JSON answer")
    if not text:
        raise NotAnAnswer("an empty body")
    if len(reply.raw) > MAX_ANSWER_BYTES:
        raise NotAnAnswer(f"a body over {MAX_ANSWER_BYTES:,} bytes")
    if reply.content_type == "text/html" or text.startswith(b"<"):
        raise Unanswered(f"an HTML page instead of an answer (from a proxy?): {_excerpt(text)!r}")
    body = _json_body(text)
    if body is None:
        raise NotAnAnswer(f"a body that is not JSON: {_excerpt(text)!r}")
    problem = answer_problem(url, body)
    if problem is not None:
        raise NotAnAnswer(f"a body that is not a {answer_object(url)}: {problem}")
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
