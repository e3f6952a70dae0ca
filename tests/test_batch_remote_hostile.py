"""`edgespec batch --endpoint`: a server that means harm, or acts as if it did, never holds the batch.

A scripted server on 127.0.0.1 (fake_openai_server.py) trickles its answer one
byte at a time, redirects to another host, or reports absurd token counts.
Each is one failed attempt, one clear line, or a figure left out; never a
hang, a traceback, a record that is no answer, or a request sent elsewhere.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from edgespec.commands import batch
from edgespec.commands.batch import endpoint, remote
from fake_openai_server import answer, chat_completion, json_reply, raw_reply
from test_batch import edgespec_command, line_count, write_lines
from test_batch_remote_answers import last_by_id, plain_lines, records, run_batch

TRICKLE_GAP_SECONDS = 0.1  # far below any socket timeout: each byte restarts it
TRICKLE_LIMIT_SECONDS = 60.0  # the server gives up at last, so that no test can hang for ever
WITHIN_SECONDS = 30.0  # generous: what is checked takes a few seconds, the trickle 10000 s


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "FIRST_BACKOFF_SECONDS", 0.0)


def trickle(where: str):
    """A 200 that never ends: after its head, one byte at a time of its body, or of its headers."""
    head = {"body": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
            "headers": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: "}[where]

    def reply(handler, url: str) -> None:
        handler.close_connection = True
        give_up = time.monotonic() + TRICKLE_LIMIT_SECONDS
        try:
            handler.wfile.write(head.encode())
            while time.monotonic() < give_up:
                handler.wfile.write(b" ")
                time.sleep(TRICKLE_GAP_SECONDS)
        except OSError:
            pass  # the client cut the connection

    return reply


@pytest.mark.parametrize("where", ["body", "headers"])
def test_an_answer_that_trickles_in_is_left_for_a_rerun_at_the_deadline(fake_server, tmp_path, capsys, monkeypatch,
                                                                       where):
    # The socket's timeout restarted with each byte: one byte every 2 s held the batch for ever.  Then each of
    # six attempts waited out the deadline: a stuck server held a request's place for an hour.
    monkeypatch.setattr(endpoint, "REQUEST_TIMEOUT_SECONDS", 1.0)
    server = fake_server({"slow": [trickle(where)], "slow-once": [trickle(where), answer], "ok": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["slow", "slow-once", "ok"])), tmp_path / "out.jsonl"
    started = time.monotonic()
    assert run_batch(server, source, out, "--concurrency", "3") == batch.EXIT_REQUESTS_FAILED
    assert time.monotonic() - started < WITHIN_SECONDS
    err = capsys.readouterr().err
    assert "no answer for 'slow' (line 1): no whole answer within 1 s; left for a rerun" in err
    assert "Traceback" not in err and "batch: 1 ok, 0 failed of 3" in err
    assert list(last_by_id(out)) == ["ok"] and server.attempts == {"slow": 1, "slow-once": 1, "ok": 1}
    run_batch(server, source, out, "--concurrency", "3")  # the rerun retries what was left
    by_id = last_by_id(out)
    assert sorted(by_id) == ["ok", "slow-once"] and by_id["slow-once"]["response"]["body"] == chat_completion()


def test_a_model_list_that_never_comes_is_one_line_at_its_deadline(fake_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(endpoint, "MODELS_TIMEOUT_SECONDS", 1.0)
    server = fake_server({"ok": [answer]}, models=trickle("body"))
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["ok"])), tmp_path / "out.jsonl"
    started = time.monotonic()
    assert run_batch(server, source, out) != 0
    assert time.monotonic() - started < WITHIN_SECONDS
    err = capsys.readouterr().err
    assert f"cannot reach {server.url}: no whole answer within 1 s" in err and "Traceback" not in err


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_the_first_stop_signal_ends_a_batch_stuck_on_a_trickle_at_once(fake_server, tmp_path, stop_signal):
    # Ctrl-C, even three times, waited on the stuck request; SIGTERM ended it without a word, its lock left.
    server = fake_server({"ok": [answer], "slow": [trickle("body")]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["ok", "slow"])), tmp_path / "out.jsonl"
    command = edgespec_command() + ["batch", str(source), "-o", str(out), "--endpoint", server.url,
                                    "--concurrency", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while line_count(out) < 1 or server.attempts["slow"] < 1:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        process.send_signal(stop_signal)
        _, err = process.communicate(timeout=WITHIN_SECONDS)
    finally:
        process.kill()
    assert process.returncode == batch.EXIT_INTERRUPTED, err
    assert f"finished results are saved in {out}; rerun the same command to resume" in err
    assert "Traceback" not in err and list(last_by_id(out)) == ["ok"]
    assert not Path(f"{out}.edgespec-lock").exists()


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_the_first_stop_signal_ends_a_batch_waiting_on_the_model_list_at_once(fake_server, tmp_path, stop_signal):
    # The list was asked for on the main thread, where the signal only set a flag: the first Ctrl-C waited on it.
    asked = threading.Event()
    slow = trickle("body")
    server = fake_server({"ok": [answer]}, models=lambda handler, url: (asked.set(), slow(handler, url)))
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["ok"])), tmp_path / "out.jsonl"
    command = edgespec_command() + ["batch", str(source), "-o", str(out), "--endpoint", server.url]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert asked.wait(120), process.stderr.read() if process.poll() is not None else "no /v1/models call"
        process.send_signal(stop_signal)
        _, err = process.communicate(timeout=WITHIN_SECONDS)
    finally:
        process.kill()
    assert process.returncode == batch.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and not Path(f"{out}.edgespec-lock").exists()
    # nothing had finished: the hint named OUT as holding "finished results"
    assert f"no result was written to {out} yet; rerun the same command to start again" in err


def other_host(fake_server):
    """A server that must never hear from the batch, and what it heard: (server, GET paths)."""
    gets = []
    listed = json_reply({"object": "list", "data": [{"id": "fake"}]})
    other = fake_server(defaultdict(lambda: [answer]), models=lambda handler, url: (gets.append(url), listed(handler, url)))
    return other, gets


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_followed_nor_saved_and_ends_the_batch(fake_server, tmp_path, capsys, status):
    # A 302 sent the API key to the other host, and its reply was saved as the answer; a 307 became a record.
    other, gets = other_host(fake_server)
    moved = raw_reply(b"", status, headers={"Location": f"{other.url}/v1/chat/completions"})
    server = fake_server({"ok": [answer], "moved": [moved], "after": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["ok", "moved", "after"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out, "--api-key", "SECRET") == batch.EXIT_REFUSED
    err = capsys.readouterr().err
    assert (f"edgespec: {server.url} answered with a redirect ({status}) to {other.url}/v1/chat/completions; "
            f"give {other.url} as --endpoint (edgespec does not follow redirects") in err
    assert "Traceback" not in err and not other.attempts and not gets
    assert [r["custom_id"] for r in records(out)] == ["ok"]  # kept; nothing for the redirect
    assert server.attempts == {"ok": 1, "moved": 1}  # no request went out after it
    assert not Path(f"{out}.edgespec-lock").exists()


def test_a_redirected_model_list_is_not_followed_either(fake_server, tmp_path, capsys):
    other, gets = other_host(fake_server)
    server = fake_server({}, models=raw_reply(b"", 302, headers={"Location": "/elsewhere"}))
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["a"])), tmp_path / "out.jsonl"
    assert run_batch(server, source, out) == batch.EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"answered with a redirect (302) to {server.url}/elsewhere; give {server.url}/elsewhere as --endpoint" in err
    assert "Traceback" not in err and not other.attempts and not gets


def test_absurd_token_counts_are_left_out_of_the_summary_on_every_run(fake_server, tmp_path, capsys):
    # A 4000-digit prompt_tokens was saved with the answer, then the summary raised OverflowError, every rerun too.
    huge = "9" * 4000
    body = json.dumps(chat_completion("kept"))[:-1] + (
        f', "usage": {{"prompt_tokens": {huge}, "completion_tokens": 2, "total_tokens": 1{"0" * 30},'
        f' "speculative": {{"mode": "ngram", "draft_tokens": {huge}, "draft_tokens_accepted": 1}}}}}}')
    server = fake_server({"big": [raw_reply(body.encode())], "ok": [answer]})
    source, out = write_lines(tmp_path / "in.jsonl", plain_lines(["big", "ok"])), tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    for already_done in (0, 2):
        assert run_batch(server, source, out, "--summary", str(summary)) == batch.EXIT_OK
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"batch: 2 ok, 0 failed of 2 ({already_done} already done)" in err
        figures = json.loads(summary.read_text())
        assert (figures["prompt_tokens"], figures["completion_tokens"], figures["total_tokens"]) == (3, 4, 5)
    content = last_by_id(out)["big"]["response"]["body"]["choices"][0]["message"]["content"]
    assert content == "kept" and server.attempts == {"big": 1, "ok": 1}


@pytest.mark.parametrize("header, asked", [("0", None), ("-5", None), ("nan", None),
                                           ("Wed, 21 Oct 2099 07:28:00 GMT", None), ("2.5", 2.5)])
def test_only_a_retry_after_that_asks_for_a_wait_replaces_the_backoff(fake_server, header, asked):
    # "0" and "-5" from a struggling server had every attempt of a request spent within a second
    server = fake_server({"Hello": [json_reply({"error": {"message": "busy"}}, 503, {"Retry-After": header})]})
    with pytest.raises(endpoint.Unanswered) as unanswered:
        endpoint.Endpoint.parse(server.url, None).post("/v1/chat/completions",
                                                        {"messages": [{"role": "user", "content": "Hello"}]})
    assert unanswered.value.status == 503 and unanswered.value.retry_after == asked
