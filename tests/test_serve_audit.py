"""What an audit of `edgespec serve` found, as real clients and a hostile user hit it.

No model runs here: bodies go through the request check, and routes through the
app in front of an engine that is never asked to generate.
"""

from __future__ import annotations

import pytest

from edgespec.monitor import AcceptanceMonitor
from edgespec.sampling import SamplingParams
from edgespec.server.protocol import ApiError, check_body

USER = [{"role": "user", "content": "hi"}]


def refusal(body: dict, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_body(body, chat)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("content", ["a\ud800b", [{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_prediction_holding_a_lone_surrogate_is_a_400_not_a_500(content, chat):
    # it reached the tokenizer, whose UnicodeEncodeError came back as "internal error" with status 500
    body = {"messages": USER} if chat else {"prompt": "hi"}
    error = refusal({**body, "prediction": {"type": "content", "content": content}}, chat)
    assert error.param == "prediction.content" and "surrogate" in error.message
    error.message.encode("utf-8")  # the answer itself is text


HUGE = "x" * 100_000


@pytest.mark.parametrize("body", [
    {HUGE: 1},
    {"tools": [{"type": "function", "function": {"name": HUGE}}]},
    {"logit_bias": {str(n): 1 for n in range(20_000)}},
    {"stream": True, "stream_options": {HUGE: True}},
    {"messages": [{"role": HUGE, "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi", HUGE: 1}]},
    {"max_tokens": -10 ** 4000},
], ids=["field name", "tools", "logit_bias", "stream_options key", "role", "message key", "number"])
def test_a_huge_value_is_not_echoed_back_whole(body):
    # a 100 kB field name or value came back in the error's message (and param) in full
    error = refusal({"messages": USER, **body})
    assert len(error.message) < 400 and len(error.param or "") < 200
    assert "\n" not in error.message


# -- routes -------------------------------------------------------------------------------------


class _IdleEngine:
    """Enough of an Engine for the app to be made; nothing here asks it to generate."""

    mode = "none"
    pool = None


@pytest.fixture
def client():
    from starlette.testclient import TestClient

    from edgespec.server.app import ServerConfig, create_app

    app = create_app(_IdleEngine(), ServerConfig("tiny", SamplingParams()), AcceptanceMonitor())
    return TestClient(app)  # not started: no engine thread


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/health", "GET"),
])
def test_a_wrong_method_is_told_the_one_to_use(client, method, path, allowed):
    # a 405 named no method: no Allow header (RFC 9110 wants one) and no fix in the message
    reply = client.request(method, path)
    assert reply.status_code == 405 and allowed in reply.headers["allow"]
    error = reply.json()["error"]
    assert f"use {allowed}" in error["message"] and error["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", ["/chat/completions", "/completions", "/models"])
def test_a_base_url_without_v1_is_told_to_add_it(client, path):
    # openai.OpenAI(base_url="http://127.0.0.1:8080") posts to /chat/completions: the 404 named no fix
    reply = client.post(path, json={})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert f"/v1{path}" in error["message"] and "base URL" in error["message"]
    assert error["type"] == "invalid_request_error"  # as OpenAI types its own 404 for a path it lacks


@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/"),
                                          ("GET", "/health/"), ("GET", "/metrics/")])
def test_a_trailing_slash_is_told_the_path_without_it_not_redirected(client, method, path):
    # Starlette answered 307 to the path without the slash, which httpx (and so openai-python) does not follow
    reply = client.request(method, path, json={}, follow_redirects=False)
    assert reply.status_code == 404 and "location" not in reply.headers
    assert f"did you mean {path.rstrip('/')}?" in reply.json()["error"]["message"]


def test_the_models_list_with_a_trailing_slash_is_the_list(client):
    assert client.get("/v1/models/").json() == client.get("/v1/models").json()


def test_an_unknown_path_is_told_the_paths_there_are(client):
    error = client.get("/v2/anything").json()["error"]
    assert "/v1/chat/completions" in error["message"] and "/health" in error["message"]


@pytest.mark.parametrize("body, chat, hint", [
    ({"prompt": "hi"}, True, "/v1/completions"),
    ({"messages": USER, "prompt": "hi"}, True, "/v1/completions"),
    ({"prompt": "hi", "messages": USER}, False, "/v1/chat/completions"),
], ids=["prompt to chat", "both to chat", "messages to completions"])
def test_a_body_for_the_other_endpoint_is_told_where_it_goes(body, chat, hint):
    # "unrecognized request argument 'prompt'" left a client that posted to the wrong path guessing
    error = refusal(body, chat)
    assert hint in error.message and error.param in ("prompt", "messages")


@pytest.mark.parametrize("part, named", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "text"}, "text"),
    ("plain", '"plain", not a part object'), (7, "7, not a part object"),
])
def test_a_content_part_that_is_not_text_is_named(part, named):
    # "must be a string or a list of text parts" did not say which part, nor that images are not read
    content = [{"type": "text", "text": "What is this?"}, part]
    error = refusal({"messages": [{"role": "user", "content": content}]})
    assert error.param == "messages[0].content" and "messages[0].content[1]" in error.message and named in error.message


@pytest.mark.parametrize("body, quoted", [
    ({"logprobs": True}, "logprobs=true"), ({"tool_choice": {"type": "function"}}, 'tool_choice={"type": "function"}'),
    ({"messages": [{"role": None, "content": "hi"}]}, 'one of ["assistant", "developer", "system", "user"], not null'),
])
def test_a_value_is_quoted_back_as_json_not_python(body, quoted):
    # "logprobs=True", "not None": the client wrote JSON
    assert quoted in refusal({"messages": USER, **body}).message


@pytest.mark.parametrize("body, named", [
    (b"", "empty"), (b"  \n", "empty"), (b'{"messages": "h\xffi"}', "UTF-8"), (b"{'messages': []}", "not valid JSON"),
])
def test_a_body_that_is_no_json_says_what_to_send(client, body, named):
    # curl -X POST with no -d got "Expecting value: line 1 column 1 (char 0)"
    reply = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "invalid_json"
    assert named in error["message"] and "send" in error["message"]


@pytest.mark.parametrize("role", [["user"], {"user": 1}])
def test_a_role_that_is_a_list_or_an_object_is_a_400(role):
    # looked up in a set: TypeError (unhashable), answered as a 500
    error = refusal({"messages": [{"role": role, "content": "hi"}]})
    assert error.param == "messages[0].role"


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_told_to_come_uncompressed(client, encoding):
    # it was read as JSON text and came back as "not UTF-8 text (byte 0x8b at 1)"
    import gzip

    reply = client.post("/v1/chat/completions", content=gzip.compress(b'{"messages": []}'),
                        headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    error = reply.json()["error"]
    assert reply.status_code == 415 and encoding in error["message"] and "uncompressed" in error["message"]


@pytest.mark.parametrize("encoding", ["identity", "Identity", ""])
def test_an_identity_encoded_body_is_read(client, encoding):
    reply = client.post("/v1/chat/completions", content=b'{"messages": []}',
                        headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


def test_a_request_past_the_time_limit_tells_clients_not_to_retry_it():
    # openai-python (and langchain-openai, litellm through it) retries a 408 twice: one call past a 300 s
    # limit held the engine for 900 s.  Its x-should-retry header is how a server says no.
    from edgespec.server.worker import Job

    job = Job(None, None, time_limit=0.0)
    job.check_deadline()
    assert job.stopped_by.status == 408 and job.stopped_by.headers == {"x-should-retry": "false"}


def test_an_allowed_web_page_can_read_the_no_retry_header():
    # the openai JavaScript client reads it too, and a browser hides a header CORS does not expose
    from starlette.testclient import TestClient

    from edgespec.server.app import ServerConfig, create_app

    app = create_app(_IdleEngine(), ServerConfig("tiny", SamplingParams(), origins="http://localhost:3000"),
                     AcceptanceMonitor())
    reply = TestClient(app).get("/v1/nothing", headers={"Origin": "http://localhost:3000"})
    exposed = reply.headers["access-control-expose-headers"].lower()
    assert "x-should-retry" in exposed and "retry-after" in exposed


def test_a_pipelined_request_still_being_answered_is_not_cut_off_by_the_head_deadline():
    # The deadline for the next head was armed after uvicorn had already begun the pipelined request, and took
    # it for the request answered: HEAD_SECONDS later that request's connection was closed with no answer.
    import asyncio
    import socket
    import threading

    import uvicorn

    from edgespec.server.deadlines import http_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(1.0)  # the head deadline, 0.2 s, passes meanwhile
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    listening = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", http=http_protocol(0.2),
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        with socket.create_connection(listening.getsockname(), timeout=30) as connection:
            connection.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while received.count(b"HTTP/1.1 200") < 2 and (chunk := connection.recv(65536)):
                received += chunk
        assert received.count(b"HTTP/1.1 200") == 2, received
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listening.close()
