"""`edgespec serve`: a real server process on 127.0.0.1, driven by the official openai client.

Each server runs a tiny GGUF model on one thread.  Every wait below is
bounded in count and time, and every server process is killed at the end of
its fixture whatever the tests did.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
STARTUP_SECONDS = 120
WAIT_SECONDS = 60
# Long enough that nothing finishes on its own while a test holds it open: a
# sampled (so n-gram drafting mostly misses) reply of up to 16000 tokens.
LONG_REQUEST = {"max_tokens": 16000, "temperature": 1.5, "seed": 7}


class ServerProcess:
    """`edgespec serve --port 0`, with its stderr collected line by line."""

    def __init__(self, argv: list[str], env: dict):
        script = Path(sys.executable).parent / "edgespec"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "edgespec"]
        self.process = subprocess.Popen(command + ["serve", "--port", "0", *argv], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_for_address()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1$", line)
                if found:
                    return found.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise AssertionError("edgespec serve did not start:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self._reader.join(timeout=5)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=WAIT_SECONDS)

    def request(self, path: str, body: bytes | None = None, key: str | None = None, headers: dict | None = None,
                method: str | None = None) -> "Reply":
        """A plain HTTP request (GET, or a JSON POST with a body), for what the openai client does not do.

        headers adds to or replaces the usual ones (Content-Type, Authorization, and urllib's Host)."""
        sent = {"Content-Type": "application/json"} if body is not None else {}
        if key:
            sent["Authorization"] = f"Bearer {key}"
        sent.update(headers or {})
        request = urllib.request.Request(self.url + path, data=body, headers=sent, method=method)
        try:
            with urllib.request.urlopen(request, timeout=WAIT_SECONDS) as response:
                return Reply(response.status, response.read(), response.headers)
        except urllib.error.HTTPError as error:
            return Reply(error.code, error.read(), error.headers)

    def health(self) -> dict:
        return self.request("/health").json()

    def metrics(self) -> dict:
        """Every sample as {(name, sorted labels): value}."""
        text = self.request("/metrics", key=API_KEY).content.decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


class Reply:
    def __init__(self, status: int, content: bytes, headers=None):
        self.status_code, self.content, self.headers = status, content, headers or {}

    def json(self):
        return json.loads(self.content)


def server_env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EDGESPEC_API_KEY"}
    for name in ("CACHE", "DATA", "CONFIG"):
        env[f"EDGESPEC_{name}_DIR"] = str(root / name.lower())
    return env


@pytest.fixture(scope="module")
def start_server(tiny_models, tmp_path_factory):
    servers = []

    def start(*extra: str, env: dict | None = None) -> ServerProcess:
        argv = ["--model", str(tiny_models["target"]), "--draft", "ngram", "--threads", "1", *extra]
        servers.append(ServerProcess(argv, {**server_env(tmp_path_factory.mktemp("serve")), **(env or {})}))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--api-key", API_KEY, "--queue-size", "1", "--n-ctx", "16384", "--max-body-bytes", "65536")


def wait_until(condition, what: str):
    deadline = time.monotonic() + WAIT_SECONDS
    for _ in range(10_000):
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def speculative(usage) -> dict:
    return usage.model_extra["speculative"]


USER = [{"role": "user", "content": "Hello the cat sat on the"}]


# -- completions ----------------------------------------------------------------------


def test_chat_completion_whole_and_streamed_agree(server):
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == "target"
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    usage = whole.usage
    assert usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24
    figures = speculative(usage)
    assert figures["mode"] == "ngram" and 0 <= figures["draft_tokens_accepted"] <= figures["draft_tokens"]
    assert figures["target_forward_passes"] <= 24 and figures["target_passes_per_token"] <= 1.0

    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same reply, token for token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24
    assert speculative(chunks[-1].usage)["mode"] == "ngram"


def test_completion_honours_stop(server):
    client = server.client()
    free = client.completions.create(model="tiny", prompt="The world is", max_tokens=30, temperature=0)
    text = free.choices[0].text
    assert free.object == "text_completion" and free.choices[0].finish_reason == "length" and len(text) > 8
    stop = text[5:8]
    stopped = client.completions.create(model="tiny", prompt="The world is", max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model="tiny", prompt="The world is", max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_text_held_for_a_stop_that_never_came_is_streamed_at_the_end(server):
    client = server.client()
    asked = dict(model="tiny", prompt="The world is", max_tokens=30, temperature=0)
    text = client.completions.create(**asked).choices[0].text
    # it starts with the answer's last three characters and goes on with one the answer lacks
    never = text[-3:] + next(c for c in "~@#\u2603" if c not in text)
    assert client.completions.create(**asked, stop=[never]).choices[0].text == text
    chunks = list(client.completions.create(**asked, stop=[never], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    chat = dict(model="tiny", messages=USER, max_tokens=24, temperature=0)
    reply = client.chat.completions.create(**chat).choices[0].message.content
    never = reply[-3:] + next(c for c in "~@#\u2603" if c not in reply)
    chunks = list(client.chat.completions.create(**chat, stop=[never], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply


def test_second_turn_evaluates_only_the_new_suffix(server):
    client = server.client()
    system = {"role": "system", "content": "You are a terse assistant that answers about cats and the world. " * 4}
    first_messages = [system, {"role": "user", "content": "Hello the cat"}]
    first = client.chat.completions.create(model="tiny", messages=first_messages, max_tokens=12, temperature=0)
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    second_messages = [*first_messages, reply, {"role": "user", "content": "And the world?"}]
    second = client.chat.completions.create(model="tiny", messages=second_messages, max_tokens=12, temperature=0)

    turn1, turn2 = speculative(first.usage), speculative(second.usage)
    assert turn2["prompt_tokens_reused"] >= first.usage.prompt_tokens  # the whole first prompt came from the cache
    assert turn2["prompt_tokens_evaluated"] == second.usage.prompt_tokens - turn2["prompt_tokens_reused"]
    assert turn2["prompt_tokens_evaluated"] < second.usage.prompt_tokens - first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == turn2["prompt_tokens_reused"]
    assert turn1["prompt_tokens_evaluated"] > turn2["prompt_tokens_evaluated"]


# -- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"mirostat": 2}}, "mirostat"),
])
def test_unsupported_parameters_get_400_naming_them(server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model="tiny", messages=USER, max_tokens=4, **extra)
    error = caught.value
    assert error.status_code == 400 and error.param == param
    assert error.body["type"] == "invalid_request_error" and param in error.body["message"]


def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    for path in ("/v1/models", "/metrics"):
        response = server.request(path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert server.request("/health").status_code == 200  # liveness probes need no key
    assert [m.id for m in server.client().models.list()] == ["target"]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    post = lambda body: server.request("/v1/chat/completions", body, key=API_KEY)
    assert post(b"{not json").status_code == 400
    assert post(b"[" * 30_000 + b"]" * 30_000).json()["error"]["code"] == "invalid_json"  # under the body limit
    too_big = post(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]}).encode())
    assert too_big.status_code == 413 and "--max-body-bytes" in too_big.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # ~20000 byte tokens: more than the 16384-token context
        server.client().completions.create(model="tiny", prompt="q" * 20_000, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    assert "(raise the server's --n-ctx or shorten the prompt)" in caught.value.message  # the client's words
    # what litellm (so aider) and LangChain tell a context overflow by: OpenAI's words
    assert "this model's maximum context length is 16384 tokens" in caught.value.message
    assert "prompt is too long" in caught.value.message
    assert server.client().completions.create(model="tiny", prompt="Hello", max_tokens=3).usage.completion_tokens == 3


def test_what_cannot_change_the_output_is_accepted_from_the_openai_client(server):
    client = server.client()
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    named = client.chat.completions.create(
        model="gpt-4o", messages=[{**USER[0], "name": "alice"}], max_tokens=6, temperature=0, n=1, user="u-1",
        metadata={"run": "7"}, store=False, service_tier="auto")
    assert named.choices[0].message.content == plain.choices[0].message.content
    assert named.usage.prompt_tokens == plain.usage.prompt_tokens  # the name is not in the prompt
    with pytest.raises(openai.BadRequestError) as caught:  # what would change the output is still refused
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, n=3)
    assert caught.value.param == "n"


# What langchain-openai, litellm and aider send (their own payloads, sent as they send them).
CLIENT_BODIES = {
    "langchain-openai": {"model": "tiny", "stream": True, "n": 1, "temperature": 0.7, "max_tokens": 4,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello the cat", "name": "bob"}]},
    "litellm": {"model": "tiny", "messages": USER, "max_tokens": 4, "temperature": 0, "user": "litellm-user",
                "stream": False},
    "aider": {"model": "openai/tiny", "messages": [{"role": "system", "content": "Act as an expert."}, *USER],
              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4},
}


@pytest.mark.parametrize("client_name", list(CLIENT_BODIES))
def test_requests_shaped_like_mainstream_clients_are_answered(server, client_name):
    body = CLIENT_BODIES[client_name]
    reply = server.request("/v1/chat/completions", json.dumps(body).encode(), key=API_KEY,
                           headers={"User-Agent": f"{client_name}-test", "Accept": "application/json"})
    assert reply.status_code == 200, reply.content
    if body["stream"]:
        events = [line.removeprefix(b"data: ") for line in reply.content.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 4
    else:
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_model_is_retrieved_by_its_id(server):
    client = server.client()
    model = client.models.retrieve("target")
    assert (model.id, model.object) == ("target", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found" and "'target'" in caught.value.message
    assert server.request("/v1/models/target").status_code == 401  # the key is wanted here too


@pytest.mark.parametrize("header, status", [
    (f"Bearer {API_KEY}", 200), (f"bearer {API_KEY}", 200), (f"BEARER  {API_KEY}", 200),
    (f"Basic {API_KEY}", 401), (f"bearer {API_KEY}x", 401), ("bearer", 401), (API_KEY, 401),
])
def test_the_bearer_scheme_is_case_insensitive(server, header, status):
    reply = server.request("/v1/models", headers={"Authorization": header})
    assert reply.status_code == status
    if status == 401:
        assert reply.json()["error"]["code"] == "invalid_api_key"


def test_an_exception_no_route_answered_is_still_an_openai_style_500(caplog):
    # The server's own middleware, in front of a route with a bug: the client gets JSON, the log one line.
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from edgespec.server.error_answers import AnswerErrorsInJson

    async def broken(request):
        raise KeyError("a bug")

    app = Starlette(routes=[Route("/v1/x", broken)], middleware=[Middleware(AnswerErrorsInJson)])
    with TestClient(app, raise_server_exceptions=True) as client:
        reply = client.get("/v1/x")
    assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
    assert reply.json()["error"] == {"message": "internal error: KeyError", "type": "server_error", "param": None,
                                     "code": None}
    assert [r.getMessage() for r in caplog.records] == ["GET /v1/x failed: KeyError: 'a bug'"]


# -- one engine: queue, disconnects ----------------------------------------------------------


def test_full_queue_gets_429_and_a_disconnect_frees_the_engine(server):
    client = server.client()
    before = server.metrics()
    running = client.chat.completions.create(model="tiny", messages=USER, stream=True, **LONG_REQUEST)
    next(iter(running))  # the engine is generating it
    waiting_result = {}
    waiting = threading.Thread(target=lambda: waiting_result.update(
        reply=client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0)))
    waiting.start()
    try:
        wait_until(lambda: server.health()["queue_depth"] == 1, "the second request to queue")
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=5)
        assert caught.value.response.headers["Retry-After"] == "1"
        assert caught.value.code == "queue_full"
    finally:
        running.close()  # the client goes away mid-stream
        waiting.join(timeout=WAIT_SECONDS)
    assert waiting_result["reply"].usage.completion_tokens == 5  # it got the engine once the stream was dropped
    after = server.metrics()
    cancelled = ("edgespec_generations_total", (("finish_reason", "cancelled"), ("mode", "ngram")))
    assert after[cancelled] == before.get(cancelled, 0) + 1
    rejected = ("edgespec_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "429")))
    assert after[rejected] == before.get(rejected, 0) + 1


def assert_one_long_generation_cancelled(server, before: dict) -> None:
    """Once the engine is idle: since the metrics `before`, one generation was cancelled, short of LONG_REQUEST."""
    wait_until(lambda: not server.health()["busy"], "the engine to drop the generation")
    after = server.metrics()
    cancelled = ("edgespec_generations_total", (("finish_reason", "cancelled"), ("mode", "ngram")))
    assert after[cancelled] == before.get(cancelled, 0) + 1
    generated = ("edgespec_tokens_generated_total", (("mode", "ngram"),))
    assert after[generated] - before[generated] < LONG_REQUEST["max_tokens"]


def test_disconnect_mid_stream_cancels_the_generation(server):
    client = server.client()
    before = server.metrics()
    stream = client.completions.create(model="tiny", prompt="The cat", stream=True, **LONG_REQUEST)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    assert_one_long_generation_cancelled(server, before)
    reply = client.completions.create(model="tiny", prompt="The cat", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


@contextlib.contextmanager
def chat_request_on_a_socket(server, body: dict):
    """Send a chat completion request on a raw connection, which is closed (the client gone) on leaving."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_SECONDS) as raw:
        raw.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
                    + b"Content-Type: application/json\r\n"
                    + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        yield


def test_a_client_gone_mid_answer_without_a_stream_cancels_the_generation(server):
    # Its client was looked for only when the engine paused for 0.1 s: a small model's steps never did, and the
    # generation ran to its end with nobody to read it.
    wait_until(lambda: not server.health()["busy"], "the engine to finish what earlier tests left")
    before = server.metrics()
    with chat_request_on_a_socket(server, {"model": "tiny", "messages": USER, **LONG_REQUEST}):
        wait_until(lambda: server.health()["busy"], "the engine to generate the answer")
    assert_one_long_generation_cancelled(server, before)


def test_a_client_gone_while_queued_leaves_the_queue(server):
    client = server.client()
    gone = ("edgespec_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "499")))
    before = server.metrics().get(gone, 0)
    running = client.chat.completions.create(model="tiny", messages=USER, stream=True, **LONG_REQUEST)
    next(iter(running))
    try:
        with chat_request_on_a_socket(server, {"model": "tiny", "messages": USER, "max_tokens": 5}):
            wait_until(lambda: server.health()["queue_depth"] == 1, "the raw request to queue")
        wait_until(lambda: server.health()["queue_depth"] == 0, "the queue to drop the request whose client left")
        assert server.health()["busy"]  # the long stream still has the engine
    finally:
        running.close()
    wait_until(lambda: server.metrics().get(gone) == before + 1, "the abandoned request to be counted")
    # the long stream's generation ends a step after its client leaves: on a busy machine that is after this line
    wait_until(lambda: not server.health()["busy"], "the engine to drop the long stream")


# -- metrics --------------------------------------------------------------------------


def test_metrics_move_with_each_request(server):
    wait_until(lambda: not server.health()["busy"], "the engine to finish what earlier tests left")  # else it counts here
    before = server.metrics()
    reply = server.client().chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0)
    after = server.metrics()
    figures = speculative(reply.usage)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert delta("edgespec_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("edgespec_tokens_generated_total", mode="ngram") == 20
    assert delta("edgespec_draft_tokens_total", mode="ngram") == figures["draft_tokens"]
    assert delta("edgespec_draft_tokens_accepted_total", mode="ngram") == figures["draft_tokens_accepted"]
    assert delta("edgespec_target_passes_per_token_count", mode="ngram") == 1
    assert delta("edgespec_target_passes_per_token_sum", mode="ngram") == pytest.approx(figures["target_passes_per_token"])
    assert delta("edgespec_prompt_tokens_total", kind="evaluated") == figures["prompt_tokens_evaluated"]
    assert after[("edgespec_decode_tokens_per_second", (("mode", "ngram"),))] > 0
    assert after[("edgespec_queue_depth", ())] == 0
    assert after[("edgespec_draft_degraded", (("mode", "ngram"),))] == 0


# -- limits and refusals of the command itself ------------------------------------------------


def test_a_request_without_max_tokens_runs_until_the_context_is_full(start_server):
    # as OpenAI's API and llama-server answer: aider sends none, and a whole-file edit cut at a fixed
    # default (1024 tokens, once) read to it as the model's failure
    server = start_server("--n-ctx", "2048")
    reply = server.client().completions.create(model="tiny", prompt="The world is", temperature=0)
    used = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason == "stop" or (reply.choices[0].finish_reason, used) == ("length", 2048)


def test_time_limit_gets_408_and_the_server_goes_on(start_server):
    # 60000 sampled tokens take far longer than half a second on any machine
    server = start_server("--request-timeout", "0.5", "--n-ctx", "65536")
    # the client's default retries: a 408 is one it retries, unless the server says not to
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=WAIT_SECONDS)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="tiny", messages=USER, **{**LONG_REQUEST, "max_tokens": 60000})
    assert caught.value.status_code == 408 and "--request-timeout" in caught.value.message
    assert server.metrics()[("edgespec_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "408")))] == 1
    wait_until(lambda: not server.health()["busy"], "the engine to stop the timed-out generation")
    generated = server.metrics()[("edgespec_tokens_generated_total", (("mode", "ngram"),))]
    assert generated < 60000
    assert server.health()["status"] == "ok"


def assert_ended_cleanly(server: ServerProcess) -> None:
    """The server, sent SIGTERM, ended without a traceback or a logged exception."""
    # uvicorn, once it has shut down, dies of the signal it caught, as servers do
    assert server.process.wait(timeout=WAIT_SECONDS) in (0, -signal.SIGTERM)
    server.stop()
    assert not any("Traceback" in line or "Exception" in line for line in server.lines), server.lines


def raw_connection(server: ServerProcess) -> socket.socket:
    """A TCP connection to the server, for requests no HTTP client would send."""
    port = int(server.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_SECONDS)


def test_stopping_the_server_ends_open_streams_cleanly(start_server):
    server = start_server()
    stream = server.client().completions.create(model="tiny", prompt="The cat", stream=True, **LONG_REQUEST)
    chunks = iter(stream)
    next(chunks)
    server.process.terminate()
    with pytest.raises(openai.APIError) as caught:
        for _ in range(LONG_REQUEST["max_tokens"]):
            next(chunks)
    assert "shutting down" in str(caught.value)
    assert_ended_cleanly(server)


def test_stopping_the_server_answers_a_request_still_sending_its_body(start_server):
    # it waited out uvicorn's 5 s of grace for the body, then logged the request's cancellation as a traceback
    server = start_server()
    with raw_connection(server) as sending:
        sending.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{")
        assert server.health()["status"] == "ok"  # a later request answered: this one's head was read first
        server.process.terminate()
        answer = sending.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, answer
    assert_ended_cleanly(server)


def test_a_websocket_upgrade_from_a_page_is_answered_over_http_without_a_word_in_the_log(start_server):
    # every new WebSocket("ws://127.0.0.1:PORT/") logged two warnings, one advising to pip install a library
    server = start_server()
    with raw_connection(server) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                           b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
    assert server.health()["status"] == "ok"  # answered after the upgrade's request: its warnings would be out
    assert not any("upgrade" in line.lower() or "WebSocket" in line for line in server.lines), server.lines


def test_other_addresses_need_an_api_key(tiny_models, tmp_path):
    script = Path(sys.executable).parent / "edgespec"
    result = subprocess.run([str(script), "serve", "--host", "0.0.0.0", "--model", str(tiny_models["target"])],
                            capture_output=True, text=True, timeout=WAIT_SECONDS, env=server_env(tmp_path))
    assert result.returncode == 2, "a usage error, like every other bad flag"
    assert result.stderr.count("\n") == 1 and "--api-key" in result.stderr and "Traceback" not in result.stderr


def test_an_ipv6_host_in_brackets_is_its_address(tiny_models, tmp_path):
    # --host [::1], as a URL writes it, was taken for a host name: refused as not this machine's without a key.
    script = Path(sys.executable).parent / "edgespec"
    result = subprocess.run([str(script), "serve", "--host", "[::1]", "--port", "70000", "--model",
                             str(tiny_models["target"])],
                            capture_output=True, text=True, timeout=WAIT_SECONDS, env=server_env(tmp_path))
    assert result.returncode == 2 and "--port 70000 is not a port number" in result.stderr, result.stderr


# -- the stale-draft alert -----------------------------------------------------------------


def test_degraded_draft_alert_trips_and_reaches_health_and_metrics(start_server):
    # The alert's own logic (trip, hysteresis, recovery) is tested on scripted acceptance in test_monitor.py;
    # this checks that the server feeds it and shows it.  A fixed draft length keeps the n-gram drafter
    # proposing on every match, and at temperature 1.5 the target never accepts 99% of ~100 drafted tokens,
    # whatever text the tiny model happens to produce: with a window of one request the alert trips.
    server = start_server("--draft-tokens", "4", "--alert-window", "1", "--alert-acceptance", "0.99")
    client = server.client()
    degraded = ("edgespec_draft_degraded", (("mode", "ngram"),))
    assert server.health()["draft"] == "ok"
    reply = client.completions.create(model="tiny", prompt="The cat", max_tokens=120, temperature=1.5, seed=1)
    figures = speculative(reply.usage)
    assert figures["draft_tokens"] > 0 and figures["draft_tokens_accepted"] < 0.99 * figures["draft_tokens"]
    assert server.health()["draft"] == "degraded"
    assert server.metrics()[degraded] == 1
    warnings = [line for line in server.lines if "fell to" in line]
    assert len(warnings) == 1 and "--draft" in warnings[0]


@pytest.mark.parametrize("argv, env, expected", [
    (["--host", "0.0.0.0", "--api-key", " "], {}, "is blank"),
    (["--host", "0.0.0.0"], {"EDGESPEC_API_KEY": " \t "}, "is blank"),
    (["--api-key", ""], {}, "is blank"),
    (["--host", "0.0.0.0", "--api-key", "two words"], {}, "printable ASCII"),
    (["--allow-origin", "http://localhost:3000/"], {}, "is not an origin"),
    ([], {"EDGESPEC_ORIGINS": "localhost"}, "is not an origin"),
])
def test_a_key_or_origin_that_cannot_work_is_one_clear_line(tiny_models, tmp_path, argv, env, expected):
    script = Path(sys.executable).parent / "edgespec"
    result = subprocess.run([str(script), "serve", *argv, "--model", str(tiny_models["target"])],
                            capture_output=True, text=True, timeout=WAIT_SECONDS, env={**server_env(tmp_path), **env})
    assert result.returncode == 2  # a usage error, as every bad flag
    assert result.stderr.count("\n") == 1 and expected in result.stderr and "Traceback" not in result.stderr


def test_a_taken_port_is_one_clear_line(tiny_models, tmp_path):
    script = Path(sys.executable).parent / "edgespec"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([str(script), "serve", "--port", str(port), "--model", str(tiny_models["target"])],
                                capture_output=True, text=True, timeout=WAIT_SECONDS, env=server_env(tmp_path))
    assert result.returncode == 1
    assert result.stderr == f"edgespec: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --host or --port\n"


def test_concurrent_clients_decode_together_with_the_same_replies(start_server, server):
    together = start_server("--api-key", API_KEY, "--parallel", "3", "--queue-size", "4")
    prompts = [[{"role": "user", "content": f"Hello the cat {i} sat on the"}] for i in range(5)]

    def ask(target, messages):
        reply = target.client().chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        return reply.choices[0].message.content, speculative(reply.usage)["target_forward_passes"]

    alone = [ask(server, messages)[0] for messages in prompts]  # one at a time
    replies: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, ask(together, prompts[i]))) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_SECONDS)
    assert [replies[i][0] for i in range(5)] == alone
    assert together.health()["busy"] is False


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(WAIT_SECONDS)  # a guard for a hang, far past the deadlines under test
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_connection_whose_request_head_never_comes_is_closed(start_server):
    # uvicorn waited for a head for ever: 1,100 idle connections used up the file descriptors, and the
    # server answered nobody
    server = start_server("--request-timeout", "1")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as idle, socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\n")
        assert _read_until_closed(idle) == b"" and _read_until_closed(slow) == b""
    assert server.health()["status"] == "ok"


def test_a_body_that_never_comes_whole_gets_408(start_server):
    server = start_server("--request-timeout", "1")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"messages": [')
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive whole" in answer, answer[:300]
    assert server.health()["status"] == "ok"


def test_a_conversation_no_context_could_hold_is_refused_before_it_is_rendered(start_server):
    # 70,000 empty messages (2 MB) were rendered and tokenized on the engine's thread for 5 s, and each
    # request queued behind them waited
    server = start_server("--n-ctx", "256")
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": ""}] * 5000)
    assert refused.value.code == "context_length_exceeded" and "5,000 messages" in refused.value.message


def test_two_quick_ctrl_cs_end_the_server_with_one_line(start_server):
    # uvicorn's force quit skipped the app's shutdown, whose task, cancelled at the exit, logged a traceback
    server = start_server()
    server.process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=WAIT_SECONDS) == 130
    server.stop()
    assert not any("Traceback" in line for line in server.lines), "\n".join(server.lines)
    assert server.lines[-1] == "edgespec: interrupted"
