"""`edgespec batch --endpoint URL`: the same batch file, sent to a real `edgespec serve` on 127.0.0.1.

The server runs the tiny test model on one thread (see test_serve.py); the batch runs as its
own process, so kill -9 hits it as it would hit a user's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from edgespec.commands import batch, main
from edgespec.commands.batch.runner import RunTally, summarize
from test_batch import chat_line, completion_line, edgespec_command, line_count, write_lines
from test_serve import API_KEY, ServerProcess, server_env


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    process = ServerProcess(["--model", str(tiny_models["target"]), "--draft", "ngram", "--threads", "1",
                             "--api-key", API_KEY, "--queue-size", "1", "--n-ctx", "4096"],
                            server_env(tmp_path_factory.mktemp("serve")))
    yield process
    process.stop()


def endpoint_argv(server, source: Path, out: Path, *extra: str) -> list[str]:
    return edgespec_command() + ["batch", str(source), "-o", str(out), "--endpoint", server.url,
                                 "--api-key", API_KEY, "--max-tokens", "16", "--temperature", "0", *extra]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_batch_file_runs_on_the_server_with_every_record_in_place(server, tmp_path):
    lines = [
        json.dumps("Hello the cat sat on the"),  # a plain line: sent as a chat body
        chat_line("chat-own-length", "The dog ran to the", max_tokens=5),
        completion_line("text-1", "The cat sat on"),
        "{not json",
        chat_line("asks-for-two", "Hello", n=2),  # the server refuses n > 1: its 400 is the record
    ]
    source, out, summary = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", tmp_path / "s.json"
    run = subprocess.run(endpoint_argv(server, source, out, "--concurrency", "2", "--summary", str(summary)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == batch.EXIT_REQUESTS_FAILED, run.stderr
    assert "Traceback" not in run.stderr
    by_id = {r["custom_id"]: r for r in records(out)}
    assert sorted(by_id) == ["asks-for-two", "chat-own-length", "line-1", "line-4", "text-1"]
    plain = by_id["line-1"]["response"]
    assert plain["status_code"] == 200 and plain["body"]["object"] == "chat.completion"
    assert plain["body"]["usage"]["completion_tokens"] == 16  # the command line's --max-tokens
    assert plain["body"]["usage"]["speculative"]["mode"] == "ngram"
    assert by_id["chat-own-length"]["response"]["body"]["usage"]["completion_tokens"] == 5  # the body's own
    assert by_id["text-1"]["response"]["body"]["object"] == "text_completion"
    assert by_id["line-4"]["error"]["code"] == "invalid_json" and by_id["line-4"]["response"] is None
    refused = by_id["asks-for-two"]["response"]
    assert refused["status_code"] == 400 and "n" in refused["body"]["error"]["message"]
    figures = json.loads(summary.read_text())
    assert (figures["requests_ok"], figures["requests_failed"], figures["requests_unanswered"]) == (3, 2, 0)
    assert figures["completion_tokens"] == 16 + 5 + 16 and figures["modes"] == ["ngram"]
    assert figures["target_passes_per_token"] is not None and figures["decode_tokens_per_second"] > 0


def test_kill_9_mid_run_then_rerun_writes_every_id_once(server, tmp_path):
    lines = [json.dumps(f"Hello the cat {i}") for i in range(10)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = endpoint_argv(server, source, out, "--concurrency", "3")
    command[command.index("--max-tokens") + 1] = "48"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while line_count(out) < 2:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    stopped = out.read_text().splitlines()
    assert 2 <= len(stopped) < 10

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == batch.EXIT_OK, rerun.stderr
    final = out.read_text().splitlines()
    assert final[: len(stopped)] == stopped  # finished records were not redone
    ids = [json.loads(line)["custom_id"] for line in final]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(1, 11)) and len(ids) == 10


def test_a_full_queue_is_retried_after_retry_after(server, tmp_path):
    # Queue size 1: with four in flight, two are answered 429 at first, and retried until they run.
    lines = [json.dumps(f"The dog ran {i}") for i in range(4)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = endpoint_argv(server, source, out, "--concurrency", "4")
    command[command.index("--max-tokens") + 1] = "64"
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == batch.EXIT_OK, run.stderr
    assert all(r["response"]["status_code"] == 200 for r in records(out)) and len(records(out)) == 4


@pytest.mark.parametrize("extra, expected", [
    (["--api-key", "wrong"], "refused the API key (401)"),
    (["--endpoint", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    (["--endpoint", "ftp://example.org"], "is not an http:// or https:// URL"),
    (["--concurrency", "0"], "must be a whole number from 1 to 64"),
])
def test_a_batch_that_cannot_start_says_why_in_one_line(server, tmp_path, extra, expected):
    source, out = write_lines(tmp_path / "in.jsonl", [json.dumps("Hello")]), tmp_path / "out.jsonl"
    run = subprocess.run(endpoint_argv(server, source, out, *extra), capture_output=True, text=True, timeout=120)
    assert run.returncode == batch.EXIT_REFUSED, run.stderr
    assert expected in run.stderr and "Traceback" not in run.stderr
    assert not out.exists() or out.read_text() == ""


def test_a_streaming_body_is_answered_whole_as_a_local_batch_answers_it(server, tiny_models, tmp_path):
    # A record holds a whole answer. A local batch gives one for "stream": true; sent as it was, the server
    # streamed it and the line became an invalid_response error record.
    lines = [chat_line("chat", "Hello the cat", stream=True, stream_options={"include_usage": True}),
             completion_line("text", "The cat sat on", stream=True)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    remote_out, local_out = tmp_path / "remote.jsonl", tmp_path / "local.jsonl"
    run = subprocess.run(endpoint_argv(server, source, remote_out), capture_output=True, text=True, timeout=300)
    assert run.returncode == batch.EXIT_OK, run.stderr
    assert "stream" not in run.stderr  # nothing to tell: the answer is what was asked for
    local = main(["batch", str(source), "-o", str(local_out), "--model", str(tiny_models["target"]), "--draft", "ngram",
                  "--threads", "1", "--parallel", "1", "--max-tokens", "16", "--temperature", "0"])
    assert local == batch.EXIT_OK
    for out in (remote_out, local_out):
        by_id = {r["custom_id"]: r for r in records(out)}
        assert [by_id[i]["response"]["status_code"] for i in ("chat", "text")] == [200, 200], out
        assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
        assert by_id["text"]["response"]["body"]["object"] == "text_completion"
        assert by_id["chat"]["response"]["body"]["usage"]["completion_tokens"] == 16


def test_the_summary_reports_a_draft_that_went_stale():
    # The records' own figures, in input order, through the server's rolling acceptance check.
    def answer(custom_id: str, drafted: int, accepted: int) -> dict:
        usage = {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25,
                 "speculative": {"mode": "ngram", "draft_tokens": drafted, "draft_tokens_accepted": accepted,
                                 "target_forward_passes": 18, "decode_tokens_per_second": 10.0}}
        return {"custom_id": custom_id, "error": None,
                "response": {"status_code": 200, "body": {"usage": usage}}}

    from edgespec.commands.batch.requests import BatchRequest

    entries = [BatchRequest(f"r{i}", i, "/v1/chat/completions") for i in range(30)]
    finished = {f"r{i}": answer(f"r{i}", 20, 18 if i < 10 else 1) for i in range(30)}
    summary = summarize(entries, finished, RunTally(), 0, 1.0)
    assert summary["mean_acceptance_rate"] == pytest.approx((10 * 18 + 20 * 1) / 600, abs=1e-4)
    assert len(summary["draft_alerts"]) == 1 and "fell to" in summary["draft_alerts"][0]
    assert summary["target_passes_per_token"] == pytest.approx(18 / 20)
