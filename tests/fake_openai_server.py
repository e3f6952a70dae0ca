"""A scripted OpenAI-compatible server on 127.0.0.1, for what no real server does on purpose.

Each request's prompt (a chat's last message, or a completion's prompt) names
a script: the replies to its first, second, ... attempt, the last one
repeating. A reply writes the raw bytes of its HTTP answer to the socket, so it
can be anything: a valid answer, a proxy's page, a body cut off mid-stream, a
reset connection.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Reply = Callable[[BaseHTTPRequestHandler, str], None]  # (handler, the request's url) -> writes the answer


def chat_completion(text: str = "Hi there") -> dict:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def text_completion(text: str = " there") -> dict:
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def answer(handler: BaseHTTPRequestHandler, url: str) -> None:
    """The valid answer to the request's url."""
    json_reply(chat_completion() if url == "/v1/chat/completions" else text_completion())(handler, url)


def json_reply(body: object, status: int = 200, headers: dict | None = None) -> Reply:
    return raw_reply(json.dumps(body).encode(), status, "application/json", headers)


def raw_reply(data: bytes, status: int = 200, content_type: str = "application/json",
              headers: dict | None = None) -> Reply:
    def reply(handler: BaseHTTPRequestHandler, url: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    return reply


def cut_reply(declared: int = 500, sent: int = 20) -> Reply:
    """A 200 that promises `declared` bytes and closes the connection after `sent` of them."""
    def reply(handler: BaseHTTPRequestHandler, url: str) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        handler.wfile.write(head.encode() + json.dumps(chat_completion()).encode()[:sent])
        handler.wfile.flush()
        handler.close_connection = True

    return reply


def reset_reply(handler: BaseHTTPRequestHandler, url: str) -> None:
    """No answer: the connection is reset (RST) as soon as the request is read."""
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.close_connection = True


class FakeServer:
    """The server, in a thread: `scripts` maps a prompt to its replies; `attempts` counts requests per prompt."""

    def __init__(self, scripts: dict[str, list[Reply]], models: Reply | None = None):
        self.scripts = scripts
        self.models = models or json_reply({"object": "list", "data": [{"id": "fake", "object": "model"}]})
        self.attempts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def reply_for(self, prompt: str) -> Reply:
        with self._lock:
            self.attempts[prompt] += 1
            script = self.scripts[prompt]
            return script[min(self.attempts[prompt], len(script)) - 1]

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server.models(self, self.path)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
                server.reply_for(prompt)(self, self.path)

        return Handler
