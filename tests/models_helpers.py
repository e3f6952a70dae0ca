"""Local stand-ins for the outside world in the model tests: real wheels, a Hub-shaped HTTP server."""

from __future__ import annotations

import base64
import hashlib
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A py3-none-any wheel holding ``files``, with METADATA, WHEEL and RECORD as pip expects."""
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    contents[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: edgespec-tests\n"
                                 b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
    return wheel


def closed_port() -> int:
    """A local TCP port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class HubServer:
    """Serves files like huggingface.co's /{repo}/resolve/{revision}/{file} endpoint.

    With ``cut_after`` set, the first GET sends the full Content-Length header
    but only that many bytes before closing the connection, and every retry
    gets 503, like a server that went away mid-download.
    """

    def __init__(self, files: dict[str, bytes], cut_after: int | None = None):
        self.files = files  # "repo/name/file" -> bytes
        self.cut_after = cut_after
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(with_body=False)

            def do_GET(self):
                self._answer(with_body=True)

            def _answer(self, with_body: bool):
                server.requests.append((self.command, self.path))
                data = server.files.get(self.path.lstrip("/").replace("/resolve/main/", "/", 1))
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                gets = sum(method == "GET" for method, _ in server.requests)
                if with_body and server.cut_after is not None and gets > 1:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not with_body:
                    return
                if server.cut_after is None:
                    self.wfile.write(data)
                else:
                    self.wfile.write(data[:server.cut_after])
                    self.wfile.flush()
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run_in_terminal(argv: list[str], columns: int, env: dict[str, str]) -> tuple[int, str]:
    """Run argv with a pseudo-terminal `columns` wide as stdin, stdout and stderr: what a user sees, as
    plain text (colours and cursor codes left out)."""
    import os
    import pty
    import re
    import subprocess

    from pty_output import read_until_closed

    master, slave = pty.openpty()
    env = {**env, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color"}
    process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    output = read_until_closed(master)
    os.close(master)
    code = process.wait(timeout=60)
    text = output.decode("utf-8", "replace").replace("\r\n", "\n")
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
