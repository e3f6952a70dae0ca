"""`edgespec batch --endpoint`: what a server answers is data, and no answer ends the batch.

A scripted server on 127.0.0.1 (fake_openai_server.py) sends what real servers
and proxies do by accident: cut bodies, resets, HTML pages, error objects with
status 200, event streams, JSON of every other shape. None of it may be saved
as a success; what may pass is retried, the rest gets an error record that a
rerun retries; the summary always comes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edgespec.commands import batch, main
from edgespec.commands.batch import endpoint, remote
from edgespec.commands.batch.answers import answer_problem, is_answer
from edgespec.commands.batch.output import RecordWriter
from edgespec.commands.batch.requests import CHAT_URL, COMPLETIONS_URL, BatchRequest
from fake_openai_server import (FakeServer, answer, chat_completion, cut_reply, json_reply, raw_reply,
                                reset_reply, text_completion)
from test_batch import completion_line, edgespec_command, write_lines

SSE = b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": []}\n\ndata: [DONE]\n\n'
HTML = b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>"

# Prompt -> the server's replies to its attempts (the last repeats), and what OUT must end up holding.
NOT_ANSWERS = {
    "invalid-json": raw_reply(b'{"id": "chatcmpl-1", "choices": [tr'),
    "empty-body": raw_reply(b""),
    "foo": json_reply({"foo": 1}),
    "no-choices": json_reply({**chat_completion(), "choices": []}),
    "error-body": json_reply({"error": {"message": "model overloaded", "type": "server_error"}}),
    "event-stream": raw_reply(SSE, content_type="text/event-stream"),
    "a-list": json_reply([chat_completion()]),
    "no-content": json_reply({**chat_completion(), "choices": [{"index": 0, "message": {"role": "assistant"}}]}),
    "bad-usage": json_reply({**chat_completion(), "usage": {"prompt_tokens": -1, "completion_tokens": "2"}}),
    "text-for-chat": json_reply(text_completion()),
    "nan": raw_reply(json.dumps({**chat_completion(), "usage": {"prompt_tokens": float("nan")}}).encode()),
    "created-201": json_reply(chat_completion(), status=201),
}
PASSING_FAILURES = {  # retried, then answered
    "ok": [answer],
    "cut-once": [cut_reply(500, 20), answer],
    "reset-once": [reset_reply, answer],
    "503-once": [json_reply({"error": {"message": "busy"}}, 503, {"Retry-After": "0"}), answer],
    "html-once": [raw_reply(HTML, content_type="text/html"), answer],
}


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    # The backoff's schedule is not under test here; what each failure leads to is.
    monkeypatch.setattr(remote, "FIRST_BACKOFF_SECONDS", 0.0)


def plain_lines(prompts) -> list[str]:
    return [json.dumps({"custom_id": prompt, "prompt": prompt}) for prompt in prompts]


def run_batch(server: FakeServer, source: Path, out: Path, *extra: str) -> int:
    return main(["batch", str(source), "-o", str(out), "--endpoint", server.url, "--max-tokens", "8", *extra])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def last_by_id(out: Path) -> dict[str, dict]:
    return {record["custom_id"]: record for record in records(out)}


def test_no_body_that_is_not_an_answer_is_saved_as_one(fake_server, tmp_path, capsys):
    scripts = {**{name: [reply] for name, reply in NOT_ANSWERS.items()}, **PASSING_FAILURES}
    server = fake_server(scripts)
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(scripts)), tmp_path / "out.jsonl"
    assert run_batch(server, source, out, "--concurrency", "4") == batch.EXIT_REQUESTS_FAILED
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"batch: {len(PASSING_FAILURES)} ok, {len(NOT_ANSWERS)} failed" in err

    by_id = last_by_id(out)
    assert sorted(by_id) == sorted(scripts) and len(records(out)) == len(scripts)
    for name in PASSING_FAILURES:
        assert by_id[name]["error"] is None and by_id[name]["response"]["body"] == chat_completion(), name
        assert server.attempts[name] == len(PASSING_FAILURES[name])
    for name in NOT_ANSWERS:
        record = by_id[name]
        assert record["response"] is None and record["error"]["code"] == "invalid_response", name
        assert record["error"]["message"].startswith(f"line {list(scripts).index(name) + 1}: the server answered ")
        assert "rerun the same command to retry it" in record["error"]["message"]
        assert server.attempts[name] == 1  # asking again at once would not make it an answer
    messages = {name: by_id[name]["error"]["message"] for name in NOT_ANSWERS}
    assert "not JSON" in messages["invalid-json"] and "an empty body" in messages["empty-body"]
    assert '"choices" is missing or empty' in messages["no-choices"] and "model overloaded" in messages["error-body"]
    assert "an event stream" in messages["event-stream"] and "HTTP 201" in messages["created-201"]


def test_a_streaming_body_is_sent_asking_for_the_whole_answer():
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 4}
    sent = remote.request_body(BatchRequest("a", 1, CHAT_URL, body=body), {"max_tokens": 8, "temperature": 0}, "fake")
    assert sent == {"messages": body["messages"], "max_tokens": 4, "temperature": 0, "model": "fake"}
    assert body["stream"] is True  # IN's body itself is left as it is (its fingerprint is a rerun's check)
    odd = remote.request_body(BatchRequest("b", 2, COMPLETIONS_URL, body={"prompt": "Hi", "stream": "yes"}), {}, "fake")
    assert odd["stream"] == "yes"  # not a stream asked for: the server judges it, as a local batch does


def test_a_body_cut_every_time_is_left_for_a_rerun_and_the_summary_still_comes(fake_server, tmp_path, capsys):
    server = fake_server({"cut": [cut_reply(500, 20)], "ok": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["cut", "ok"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    err = capsys.readouterr().err
    assert server.attempts["cut"] == remote.MAX_ATTEMPTS and "Traceback" not in err
    assert f"no answer for 'cut' (line 1) after {remote.MAX_ATTEMPTS} attempts" in err
    assert "the answer was cut off after 20 of its 500 bytes" in err
    assert "batch: 1 ok, 0 failed of 2" in err and "1 request got no answer" in err
    assert list(last_by_id(out)) == ["ok"]  # nothing written for it: a rerun retries it

    server.scripts["cut"] = [answer]
    assert run_batch(server, source, out) == batch.EXIT_OK
    assert "(1 already done)" in capsys.readouterr().err
    assert last_by_id(out)["cut"]["response"]["status_code"] == 200


def test_the_cut_body_of_the_issue_through_the_real_command(fake_server, tmp_path):
    # The reproduction of issue 25: Content-Length 500, 20 bytes sent, once; as a user runs it.
    server = fake_server({"cut": [cut_reply(500, 20), answer], "foo": [json_reply({"foo": 1})]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["cut", "foo"])), tmp_path / "out.jsonl"
    run = subprocess.run(edgespec_command() + ["batch", str(source), "-o", str(out), "--endpoint", server.url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == batch.EXIT_REQUESTS_FAILED, run.stderr
    assert "Traceback" not in run.stderr and "batch: 1 ok, 1 failed of 2" in run.stderr
    by_id = last_by_id(out)
    assert by_id["cut"]["response"]["body"] == chat_completion() and by_id["foo"]["error"]["code"] == "invalid_response"


def test_a_rerun_redoes_the_error_records_of_non_answers_and_supersedes_them(fake_server, tmp_path, capsys):
    server = fake_server({"ok": [answer], "foo": [json_reply({"foo": 1})], "html": [raw_reply(HTML, 200, "text/html")]})
    lines = plain_lines(["ok", "foo"]) + [completion_line("text", "html")]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    first = records(out)
    assert [r["custom_id"] for r in first] == ["ok", "foo"]  # the HTML was retried, then left unwritten
    capsys.readouterr()

    server.scripts.update({"foo": [answer], "html": [answer]})
    assert run_batch(server, source, out) == batch.EXIT_OK
    err = capsys.readouterr().err
    assert f"redoing 1 request whose record in {out} is an error worth retrying (first: 'foo')" in err
    assert "(1 already done)" in err
    after = records(out)
    assert after[:2] == first  # OUT is only appended to
    redone = {r["custom_id"]: r for r in after[2:]}
    assert sorted(redone) == ["foo", "text"]
    assert redone["foo"]["supersedes"] == first[1]["id"] and "supersedes" not in redone["text"]
    assert redone["text"]["response"]["body"]["object"] == "text_completion"
    assert server.attempts["ok"] == 1

    assert run_batch(server, source, out) == batch.EXIT_OK  # the last record per custom_id counts
    assert "(3 already done)" in capsys.readouterr().err and records(out) == after


def test_a_refusal_is_the_request_s_record_and_a_rerun_keeps_it(fake_server, tmp_path, capsys):
    refusal = {"error": {"message": "n must be 1", "type": "invalid_request_error"}}
    server = fake_server({"refused": [json_reply(refusal, 400)],
                          "forbidden": [raw_reply(b"<html>\n<h1>Forbidden</h1></html>", 403, "text/html")]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["refused", "forbidden"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    by_id = last_by_id(out)
    assert by_id["refused"]["response"] == {**by_id["refused"]["response"], "status_code": 400, "body": refusal}
    forbidden = by_id["forbidden"]["response"]
    assert forbidden["status_code"] == 403 and forbidden["body"] == {"error": {"message": "<html> <h1>Forbidden</h1></html>"}}
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    assert "(2 already done)" in capsys.readouterr().err and server.attempts == {"refused": 1, "forbidden": 1}


def test_a_garbage_success_that_an_older_edgespec_saved_is_redone(fake_server, tmp_path, capsys):
    server = fake_server({"a": [answer], "b": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["a", "b"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_OK
    old = records(out)
    old[0]["response"]["body"] = {"foo": 1}  # what the batch wrote as a success before it checked
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    capsys.readouterr()
    assert run_batch(server, source, out) == batch.EXIT_OK
    assert "(1 already done)" in capsys.readouterr().err
    assert server.attempts == {"a": 2, "b": 1}
    assert last_by_id(out)["a"]["supersedes"] == old[0]["id"]


def test_a_changed_line_gets_a_record_that_supersedes_the_old_one(fake_server, tmp_path, capsys):
    server = fake_server({"first": [answer], "second": [answer], "other": [answer]})
    lines = [json.dumps({"custom_id": "q", "prompt": "first"}), json.dumps({"custom_id": "r", "prompt": "other"})]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_OK
    lines[0] = json.dumps({"custom_id": "q", "prompt": "second"})
    write_lines(source, lines)
    capsys.readouterr()
    assert run_batch(server, source, out) == batch.EXIT_OK
    assert "1 request changed since" in capsys.readouterr().err
    old, other, new = records(out)
    assert (old["custom_id"], other["custom_id"], new["custom_id"]) == ("q", "r", "q")
    assert new["supersedes"] == old["id"] and new["fingerprint"] != old["fingerprint"]
    assert "supersedes" not in old and "supersedes" not in other


def test_an_answer_made_with_other_sampling_flags_is_redone_unless_its_body_set_them(fake_server, tmp_path, capsys):
    # A rerun with another --max-tokens kept the first run's answers as done: resume matched the line only.
    server = fake_server({"first": [answer, answer], "other": [answer]})
    own = {"custom_id": "r", "method": "POST", "url": CHAT_URL,
           "body": {"messages": [{"role": "user", "content": "other"}], "max_tokens": 5}}
    source = write_lines(tmp_path / "in.jsonl", [json.dumps({"custom_id": "q", "prompt": "first"}), json.dumps(own)])
    out = tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_OK
    capsys.readouterr()
    assert run_batch(server, source, out, "--max-tokens", "9") == batch.EXIT_OK
    err = capsys.readouterr().err
    assert "1 request in" in err and "other sampling settings" in err and "'q', max_tokens 8, now 9" in err, err
    old, kept, new = records(out)
    assert (old["custom_id"], kept["custom_id"], new["custom_id"]) == ("q", "r", "q")
    assert new["supersedes"] == old["id"] and new["fingerprint"] == old["fingerprint"]
    assert (old["sampling"]["max_tokens"], new["sampling"]["max_tokens"]) == (8, 9)
    assert "max_tokens" not in kept["sampling"], "the body set its own: the flag never reached it"
    assert run_batch(server, source, out, "--max-tokens", "9") == batch.EXIT_OK
    assert len(records(out)) == 3 and "other sampling settings" not in capsys.readouterr().err


def test_a_bug_while_sending_one_request_is_its_own_error_record(fake_server, tmp_path, capsys, monkeypatch):
    server = fake_server({"a": [answer], "b": [answer]})
    real_body = remote.request_body

    def body_that_cannot_be_sent(request, defaults, model):
        body = real_body(request, defaults, model)
        return {**body, "bad": object()} if request.custom_id == "a" else body  # json.dumps raises TypeError

    monkeypatch.setattr(remote, "request_body", body_that_cannot_be_sent)
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["a", "b"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    assert "batch: 1 ok, 1 failed of 2" in capsys.readouterr().err
    by_id = last_by_id(out)
    assert by_id["a"]["error"]["code"] == "request_failed" and "TypeError" in by_id["a"]["error"]["message"]
    monkeypatch.setattr(remote, "request_body", real_body)
    assert run_batch(server, source, out) == batch.EXIT_OK  # a rerun retries it


def test_a_body_over_the_size_limit_is_no_answer(fake_server, tmp_path, monkeypatch):
    monkeypatch.setattr(endpoint, "MAX_ANSWER_BYTES", 1000)
    server = fake_server({"big": [json_reply(chat_completion("x" * 2000))], "small": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["big", "small"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REQUESTS_FAILED
    by_id = last_by_id(out)
    assert "a body over 1,000 bytes" in by_id["big"]["error"]["message"] and by_id["small"]["error"] is None


def test_a_lone_surrogate_in_an_answer_is_kept_and_out_stays_utf8(fake_server, tmp_path):
    body = json.dumps(chat_completion("half \ud83d of an emoji")).encode()  # json.dumps escapes it: \ud83d
    server = fake_server({"a": [raw_reply(body)]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["a"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_OK
    out.read_bytes().decode("utf-8")  # valid UTF-8
    content = records(out)[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert content == "half \ud83d of an emoji"
    assert run_batch(server, source, out) == batch.EXIT_OK  # and it reads back on resume


@pytest.mark.parametrize("models, expected", [
    (json_reply({"data": {"id": "x"}}), "answered 200 without a model list"),
    (raw_reply(b"<html>login</html>", 200, "text/html"), "answered 200 without a model list"),
    (cut_reply(500, 20), "cannot reach"),
    (reset_reply, "cannot reach"),
])
def test_a_server_whose_model_list_is_broken_is_one_clear_line(fake_server, tmp_path, capsys, models, expected):
    server = fake_server({}, models=models)
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["a"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "\nedgespec: " in err and server.url in err and expected in err and "Traceback" not in err


# ------------------------------------------------------------------ the answer check itself


@pytest.mark.parametrize("body", [
    chat_completion(),
    chat_completion(""),  # an empty reply is still a reply
    {**chat_completion(), "usage": None},
    {k: v for k, v in chat_completion().items() if k != "usage"},
    {**chat_completion(), "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}}]},
])
def test_what_counts_as_a_chat_answer(body):
    assert answer_problem(CHAT_URL, body) is None and is_answer(body)


@pytest.mark.parametrize("body, problem", [
    ({"foo": 1}, '"object" is None'),
    ([], "a JSON array, not an object"),
    ("text", "a JSON string"),
    ({**chat_completion(), "choices": [None]}, 'choices[0] has no "message"'),
    ({**chat_completion(), "choices": "x"}, '"choices" is missing or empty'),
    ({**chat_completion(), "error": "boom"}, "it holds an error: 'boom'"),
    ({**chat_completion(), "usage": {"total_tokens": True}}, '"usage.total_tokens" is True'),
    ({**chat_completion(), "usage": [1]}, '"usage" is not an object'),
])
def test_what_does_not(body, problem):
    assert problem in answer_problem(CHAT_URL, body) and not is_answer(body)


def test_a_completion_answer_needs_text_choices():
    assert answer_problem(COMPLETIONS_URL, text_completion()) is None
    assert "not \"text_completion\"" in answer_problem(COMPLETIONS_URL, chat_completion())
    no_text = {**text_completion(), "choices": [{"index": 0, "text": None}]}
    assert 'choices[0] has no "text" string' in answer_problem(COMPLETIONS_URL, no_text)


def test_a_record_of_a_retried_error_is_left_out_of_the_finished_ones(tmp_path):
    from edgespec.commands.batch.output import error_record

    out = tmp_path / "out.jsonl"
    writer = RecordWriter(out)
    writer.load_finished()
    for record in (error_record("a", "invalid_response", "x"), error_record("b", "invalid_json", "y"),
                   error_record("c", "request_failed", "z")):
        writer.append(record)
    writer.close()
    writer = RecordWriter(out)
    finished, torn = writer.load_finished()
    writer.close()
    assert list(finished) == ["b"] and writer.retried == ["a", "c"] and not torn
