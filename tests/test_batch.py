"""`edgespec batch`: input parsing, OpenAI Batch output, durability and resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgespec.commands import batch, main
from edgespec.commands.batch import output as batch_output
from edgespec.commands.batch import requests as batch_requests
from tinygguf import write_model_family

SYSTEM = "You are a terse assistant."


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return write_model_family(tmp_path_factory.mktemp("models"))


def chat_line(custom_id: str, text: str, **body) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": messages, **body}})


def completion_line(custom_id: str, prompt: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": prompt, **body}})


def twenty_requests() -> list[str]:
    lines = [chat_line(f"chat-{i:02d}", f"Hello the cat {i}", max_tokens=8) for i in range(14)]
    lines += [completion_line(f"text-{i:02d}", f"The cat sat on {i}", max_tokens=6, stop=["\n\n"])
              for i in range(6)]
    return lines


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run_cli(argv: list[str]) -> int:
    return main(argv)


def batch_argv(models, source: Path, out: Path, *extra: str) -> list[str]:
    return ["batch", str(source), "-o", str(out), "--model", str(models["target"]),
            "--draft", str(models["draft"]), "--draft-tokens", "4", "--temperature", "0", "--max-tokens", "8",
            # one request at a time, in input order (test_batch_parallel.py runs several)
            "--parallel", "1",
            # One thread: a tiny model gains nothing from more, and spinning threads crawl on a busy machine.
            "--threads", "1", *extra]


def assert_openai_success(record: dict, custom_id: str) -> None:
    assert set(record) - {"supersedes"} == {"id", "custom_id", "response", "error", "fingerprint", "sampling"}
    assert record["custom_id"] == custom_id and record["error"] is None
    assert set(record["sampling"]) == {"temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "stop"}
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    if body["object"] == "chat.completion":
        assert body["id"].startswith("chatcmpl-")
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    else:
        assert body["object"] == "text_completion" and isinstance(choice["text"], str)
    stats = body["stats"]
    assert stats["mode"] == "combined"  # a loaded draft model drafts with n-grams too
    assert stats["tokens_generated"] == usage["completion_tokens"]


# ---------------------------------------------------------------- parsing, no model


def parse(value) -> batch_requests.BatchRequest | batch_requests.InvalidRequest:
    """The line as a local engine runs it: read, then its body checked."""
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return batch_requests.for_the_engine(batch_requests.parse_line(raw, 7))


def test_openai_chat_request_keeps_messages_and_sampling_fields():
    request = parse({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                              "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x"}})
    assert request == batch_requests.BatchRequest(
        "a", 7, batch_requests.CHAT_URL,
        messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}),
        overrides=(("max_tokens", 5), ("temperature", 0.0), ("top_p", 0.5), ("seed", 3), ("stop", ("x",))))


def test_plain_forms_get_ids_from_line_numbers_and_become_chat_turns():
    for value in ("Hello", {"prompt": "Hello"}):
        request = parse(value)
        assert request.custom_id == "line-7" and request.url == batch_requests.CHAT_URL
        assert request.messages == ({"role": "user", "content": "Hello"},)
    assert parse({"prompt": "Hello", "custom_id": "mine"}).custom_id == "mine"


@pytest.mark.parametrize("value, code", [
    (b"{not json", "invalid_json"),
    (b"\xff\xfe", "invalid_json"),
    (12, "invalid_request"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}, "missing_field"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "unknown_url"),
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_field"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}, "invalid_value"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions",
      "body": {"prompt": "x", "max_tokens": 0}}, "invalid_value"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions",
      "body": {"prompt": "x", "temperature": "hot"}}, "invalid_value"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user"}]}}, "invalid_value"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}},
     "invalid_value"),
])
def test_bad_lines_become_invalid_requests(value, code):
    entry = parse(value)
    assert isinstance(entry, batch_requests.InvalidRequest)
    assert entry.code == code and "line 7" in entry.message
    expected_id = value["custom_id"] if isinstance(value, dict) else "line-7"
    assert entry.custom_id == expected_id


def test_a_batch_line_missing_a_field_is_told_the_whole_form_to_write():
    # {"custom_id", "body"} without "method" and "url" was refused as 'missing field "method"', which names
    # the problem and not the fix.
    entry = parse({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}})
    assert entry.code == "missing_field" and 'missing field "method"' in entry.message
    assert '"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}' in entry.message
    assert '{"prompt": ...}' in entry.message


# What edgespec serve answers 400 for, with the parameter it names.
REFUSED_BODIES = [
    ({"n": 3}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"mirostat": 2}, "mirostat"), ({"temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize("extra, param", REFUSED_BODIES)
def test_a_body_the_server_refuses_is_refused_by_name_with_the_servers_check(extra, param):
    from edgespec.sampling import SamplingParams
    from edgespec.server.protocol import ApiError, parse_request

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **extra}
    with pytest.raises(ApiError) as served:
        parse_request(body, chat=True, defaults=SamplingParams())
    entry = parse({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    assert isinstance(entry, batch_requests.InvalidRequest) and served.value.param == param
    assert (entry.code, entry.message) == (served.value.code, f"line 7: {served.value.message}")


@pytest.mark.parametrize("extra, param", [({"n": True}, "n"), ({"logprobs": 0.0}, "logprobs")])
def test_a_boolean_for_a_count_or_a_number_for_a_boolean_is_refused_in_a_batch_body(extra, param):
    entry = parse({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": [{"role": "user", "content": "Hi"}], **extra}})
    assert isinstance(entry, batch_requests.InvalidRequest) and entry.code == "invalid_value"
    assert entry.message.startswith(f"line 7: {param} must be ")


def test_what_the_server_accepts_unused_a_local_batch_accepts_too():
    body = {"model": "gpt-4o", "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "n": 1, "logprobs": False, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Hi", "name": "alice"}]}
    entry = parse({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    assert entry.messages == ({"role": "user", "content": "Hi"},) and entry.overrides == ()


def test_an_endpoint_batch_leaves_the_body_to_its_server():
    # vLLM honours n > 1: only a local engine's batch applies edgespec's check
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "n": 3}}
    read = batch_requests.parse_line(json.dumps(line).encode(), 7)
    assert isinstance(read, batch_requests.BatchRequest) and read.body == line["body"]


def test_duplicate_custom_ids_are_refused_before_the_run(tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [chat_line("a", "x"), completion_line("b", "y"),
                                                 '"plain"', chat_line("a", "z"), completion_line("line-3", "w")])
    with pytest.raises(batch_requests.BatchError) as caught:
        batch_requests.check_unique_ids(batch_requests.read_requests(source))
    assert "'a' (lines 1 and 4)" in str(caught.value) and "'line-3' (lines 3 and 5)" in str(caught.value)


def test_duplicate_custom_ids_exit_before_loading_a_model(tmp_path, capsys):
    source = write_lines(tmp_path / "in.jsonl", [chat_line("a", "x"), chat_line("a", "y")])
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(source), "-o", str(out), "--model", str(tmp_path / "no-such-model.gguf")]
    assert run_cli(argv) == batch.EXIT_REFUSED
    assert "duplicate custom_id 'a'" in capsys.readouterr().err
    assert not out.exists()


def load_finished(out: Path) -> tuple[dict, bool]:
    writer = batch_output.RecordWriter(out)
    try:
        return writer.load_finished()
    finally:
        writer.close()


def test_load_finished_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [json.dumps(batch_output.error_record(f"r{i}", "x", "y")) for i in range(2)]
    out.write_bytes(("\n".join(good) + "\n").encode() + b'{"id": "batch_req_1", "custom_id": "r2", "resp')
    finished, torn = load_finished(out)
    assert torn and set(finished) == {"r0", "r1"}
    assert out.read_text() == "\n".join(good) + "\n"
    assert load_finished(out) == (finished, False)


def test_load_finished_refuses_a_bad_line_before_good_records(tmp_path):
    out = tmp_path / "out.jsonl"
    good = json.dumps(batch_output.error_record("r0", "x", "y"))
    out.write_text(f"{good}\nnot a record\n{good}\n")
    with pytest.raises(batch_requests.BatchError, match="line 2"):
        load_finished(out)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_is_a_clear_error():
    writer = batch_output.RecordWriter(Path("/dev/full"))
    try:
        with pytest.raises(batch_requests.BatchError, match="No space left on device.*rerun to resume"):
            writer.append(batch_output.error_record("r0", "x", "y"))
    finally:
        writer.close()


# ---------------------------------------------------------------- runs on a tiny model


def test_twenty_requests_give_openai_batch_output(models, tmp_path, capsys):
    lines = twenty_requests()
    source = write_lines(tmp_path / "in.jsonl", lines)
    out, summary_path = tmp_path / "out.jsonl", tmp_path / "summary.json"
    assert run_cli(batch_argv(models, source, out, "--summary", str(summary_path))) == batch.EXIT_OK
    records = read_records(out)
    assert [r["custom_id"] for r in records] == [json.loads(line)["custom_id"] for line in lines]
    for record in records:
        assert_openai_success(record, record["custom_id"])
        assert record["response"]["body"]["usage"]["completion_tokens"] <= 8
    assert {r["response"]["body"]["object"] for r in records} == {"chat.completion", "text_completion"}
    assert {r["response"]["body"]["model"] for r in records} == {models["target"].stem}  # as the server names it
    summary = json.loads(summary_path.read_text())
    assert summary["requests_ok"] == 20 and summary["requests_failed"] == 0
    assert summary["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records)
    assert 0 <= summary["mean_acceptance_rate"] <= 1 and summary["target_passes_per_token"] > 0
    err = capsys.readouterr().err
    assert "batch: 20 ok, 0 failed of 20" in err


def test_torn_last_line_is_repaired_and_its_request_redone(models, tmp_path, capsys):
    lines = twenty_requests()[:5]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(models, source, out)) == batch.EXIT_OK
    complete = out.read_text().splitlines(keepends=True)
    out.write_text("".join(complete[:3]) + complete[3][: len(complete[3]) // 2])
    capsys.readouterr()

    assert run_cli(batch_argv(models, source, out)) == batch.EXIT_OK
    assert "torn last record" in capsys.readouterr().err
    repaired = out.read_text().splitlines(keepends=True)
    assert repaired[:3] == complete[:3]
    records = [json.loads(line) for line in repaired]
    assert [r["custom_id"] for r in records] == [json.loads(line)["custom_id"] for line in lines]
    for record in records:
        assert_openai_success(record, record["custom_id"])


def test_bad_lines_get_error_records_and_the_rest_succeed(models, tmp_path, capsys):
    too_long = "the cat sat " * 200
    lines = [
        chat_line("ok-1", "Hello the cat", max_tokens=4),
        "{this is not json",
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}),
        json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        completion_line("too-long", too_long),
        chat_line("chat-too-long", too_long),
        '"a plain prompt"',
        json.dumps({"prompt": "another plain prompt"}),
        completion_line("ok-2", "The cat", max_tokens=4),
    ]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    summary_path = tmp_path / "summary.json"
    argv = batch_argv(models, source, out, "--n-ctx", "256", "--summary", str(summary_path))
    assert run_cli(argv) == batch.EXIT_REQUESTS_FAILED
    by_id = {r["custom_id"]: r for r in read_records(out)}
    assert list(by_id) == ["ok-1", "line-2", "no-body", "embed", "too-long", "chat-too-long",
                           "line-7", "line-8", "ok-2"]
    expected_errors = {"line-2": "invalid_json", "no-body": "missing_field", "embed": "unknown_url",
                       "too-long": "context_length_exceeded", "chat-too-long": "context_length_exceeded"}
    for custom_id, record in by_id.items():
        if custom_id in expected_errors:
            assert record["response"] is None
            assert record["error"]["code"] == expected_errors[custom_id] and record["error"]["message"]
        else:
            assert_openai_success(record, custom_id)
    assert "(raise --n-ctx or shorten the prompt)" in by_id["too-long"]["error"]["message"]  # batch's own flag
    summary = json.loads(summary_path.read_text())
    assert (summary["requests_ok"], summary["requests_failed"]) == (4, 5)
    assert "4 ok, 5 failed of 9" in capsys.readouterr().err

    # Finished error records count as done: a rerun redoes nothing and still reports the failures.
    before = out.read_text()
    assert run_cli(argv) == batch.EXIT_REQUESTS_FAILED
    assert out.read_text() == before

    # ... but a prompt too long for the context is redone with the larger --n-ctx its message asks for; it
    # was kept as failed, however large the context of the rerun
    assert by_id["too-long"]["n_ctx"] == by_id["chat-too-long"]["n_ctx"] == 256
    capsys.readouterr()
    assert run_cli([*argv, "--n-ctx", "4096"]) == batch.EXIT_REQUESTS_FAILED
    assert "redoing 2 requests whose record" in capsys.readouterr().err
    redone = {r["custom_id"]: r for r in read_records(out)[len(by_id):]}
    assert set(redone) == {"too-long", "chat-too-long"}
    for custom_id, record in redone.items():
        assert_openai_success(record, custom_id)


def test_a_local_batch_refuses_each_body_the_server_refuses_and_runs_the_rest(models, tmp_path):
    lines = [chat_line(f"refused-{param}", "Hello", **extra) for extra, param in REFUSED_BODIES if "messages" not in extra]
    lines.append(chat_line("unused-fields", "Hello the cat", user="u", metadata={"k": "v"}, store=True, n=1))
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(models, source, out)) == batch.EXIT_REQUESTS_FAILED
    by_id = {r["custom_id"]: r for r in read_records(out)}
    assert len(by_id) == len(lines)
    assert_openai_success(by_id.pop("unused-fields"), "unused-fields")
    for custom_id, record in by_id.items():
        param = custom_id.removeprefix("refused-")
        assert record["response"] is None and param in record["error"]["message"]
        assert record["error"]["code"] == ("invalid_value" if param in ("temperature", "stop") else "unsupported_parameter")


def test_requests_sharing_a_system_prompt_reuse_the_kv_cache(models, tmp_path):
    lines = [chat_line(f"c{i}", f"Hello the cat {i}", max_tokens=2) for i in range(3)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(models, source, out)) == batch.EXIT_OK
    stats = [r["response"]["body"]["stats"] for r in read_records(out)]
    assert stats[0]["prompt_tokens_reused"] == 0
    assert all(s["prompt_tokens_reused"] > 0 for s in stats[1:])


# ---------------------------------------------------------------- the real command


def edgespec_command() -> list[str]:
    script = Path(sys.executable).parent / "edgespec"
    return [str(script)] if script.exists() else [sys.executable, "-m", "edgespec"]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_records(process: subprocess.Popen, out: Path, count: int) -> None:
    deadline = time.monotonic() + 120
    while line_count(out) < count:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_interrupted_run_resumes_without_redoing_finished_work(models, tmp_path):
    lines = twenty_requests()
    # The 8th request generates until the 1024-token context is full (the tiny models
    # never stop by themselves), so it is still in flight when the 7th record is on disk.
    lines[7] = completion_line("text-long", "The cat sat on", max_tokens=4000)
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = edgespec_command() + batch_argv(models, source, out, "--n-ctx", "1024")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(process, out, 7)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == batch.EXIT_INTERRUPTED, stderr
    assert "rerun the same command to resume" in stderr
    first_run = out.read_text().splitlines()
    assert len(first_run) == 7

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == batch.EXIT_OK, rerun.stderr
    assert "(7 already done)" in rerun.stderr
    after = out.read_text().splitlines()
    assert after[:7] == first_run  # byte-identical: finished records were not redone
    ids = [json.loads(line)["custom_id"] for line in after]
    assert ids == [json.loads(line)["custom_id"] for line in lines]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_cli_stopped_mid_run_then_rerun_completes(models, tmp_path, sig):
    # Plain prompts, 80 tokens each: the batch runs long enough (about half a
    # second on an idle machine) to be stopped from outside once two results are on disk.
    lines = [json.dumps(f"Hello the cat {i}") for i in range(12)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = edgespec_command() + batch_argv(models, source, out)
    command[command.index("--max-tokens") + 1] = "80"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(process, out, 2)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert process.returncode == batch.EXIT_INTERRUPTED, stderr
        assert "rerun the same command to resume" in stderr and "Traceback" not in stderr
    else:
        assert process.returncode == -signal.SIGKILL
    stopped = out.read_text().splitlines()
    assert 2 <= len(stopped) < 12

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == batch.EXIT_OK, rerun.stderr
    assert f"12 ok, 0 failed of 12 ({len(stopped)} already done)" in rerun.stderr
    final = out.read_text().splitlines()
    assert final[: len(stopped)] == stopped
    assert [json.loads(line)["custom_id"] for line in final] == [f"line-{i}" for i in range(1, 13)]
    for line in final:
        assert_openai_success(json.loads(line), json.loads(line)["custom_id"])
