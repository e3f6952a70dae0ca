"""Reading IN: a byte order mark, and a chat too long for any chat prompt (issue 25's small cases)."""

from __future__ import annotations

import codecs
import json

import pytest

from edgespec.chat_template import MAX_RENDER_CHARS
from edgespec.commands import batch
from edgespec.commands.batch import requests as batch_requests
from test_batch import batch_argv, chat_line, read_records, run_cli, write_lines


def test_a_byte_order_mark_does_not_cost_line_1_its_id(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(codecs.BOM_UTF8 + (chat_line("first", "Hello") + "\n" + json.dumps("Hi") + "\n").encode())
    first, second = batch_requests.read_requests(source)
    assert isinstance(first, batch_requests.BatchRequest) and first.custom_id == "first"
    assert second.custom_id == "line-2"
    # The mark is no part of the request: the same line without it has the same fingerprint.
    assert first.fingerprint == batch_requests.parse_line(chat_line("first", "Hello").encode(), 1).fingerprint


def test_only_a_leading_mark_is_skipped(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes((json.dumps("Hi") + "\n").encode() + codecs.BOM_UTF8 + b'"There"\n')
    first, second = batch_requests.read_requests(source)
    assert isinstance(first, batch_requests.BatchRequest) and isinstance(second, batch_requests.InvalidRequest)


@pytest.mark.parametrize("source", ["model", "/dev/zero", "utf-16 without a mark"])
def test_binary_input_is_refused_in_one_line_before_a_record_is_written(tiny_models, tmp_path, capsys, source):
    # /dev/zero was read until the machine's memory ran out; a model given as IN became 464,000 error records
    path = {"model": tiny_models["target"], "/dev/zero": "/dev/zero"}.get(source, tmp_path / "in.jsonl")
    if source.startswith("utf-16"):
        path.write_bytes('"Hello"\n'.encode("utf-16-le"))
    out = tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, path, out)) == batch.EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is binary, not JSONL text" in err
    assert not out.exists() or out.stat().st_size == 0


def test_input_past_the_size_a_batch_reads_is_refused(tmp_path, monkeypatch):
    source = write_lines(tmp_path / "in.jsonl", [json.dumps("Hello")] * 100)
    monkeypatch.setattr(batch_requests, "MAX_INPUT_BYTES", 500)
    with pytest.raises(batch_requests.BatchError, match="is larger than 0.5 KiB; split it"):
        batch_requests.read_requests(source)


def test_a_chat_longer_than_any_chat_prompt_is_refused_with_a_fix_batch_has(tmp_path):
    text = "word " * (MAX_RENDER_CHARS // 5)
    for value in (text, {"prompt": text}, json.loads(chat_line("c", text))):
        entry = batch_requests.parse_line(json.dumps(value).encode(), 3)
        assert isinstance(entry, batch_requests.InvalidRequest) and entry.code == "context_length_exceeded"
        assert entry.message.startswith("line 3: the messages hold 4,0") and "shorten them" in entry.message
        assert "--raw" not in entry.message and '"/v1/completions" request' in entry.message
    assert isinstance(batch_requests.parse_line(json.dumps(text[:-10]).encode(), 3), batch_requests.BatchRequest)


def test_the_local_batch_records_the_too_long_chat_and_goes_on(tiny_models, tmp_path, capsys):
    lines = [json.dumps("x" * MAX_RENDER_CHARS), chat_line("short", "Hello", max_tokens=2)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_REQUESTS_FAILED
    long_one, short = read_records(out)
    assert long_one["error"]["code"] == "context_length_exceeded" and "--raw" not in long_one["error"]["message"]
    assert short["error"] is None


def test_settings_beside_a_plain_prompt_are_its_body_s_not_dropped():
    # {"prompt": ..., "max_tokens": 2} ran with the batch's own settings: max_tokens was silently dropped
    line = {"prompt": "Hello", "custom_id": "mine", "max_tokens": 2, "temperature": 0}
    entry = batch_requests.for_the_engine(batch_requests.parse_line(json.dumps(line).encode(), 4))
    assert isinstance(entry, batch_requests.BatchRequest) and entry.custom_id == "mine"
    assert entry.url == batch_requests.CHAT_URL
    assert entry.messages == ({"role": "user", "content": "Hello"},)
    assert dict(entry.overrides)["max_tokens"] == 2 and dict(entry.overrides)["temperature"] == 0
    # checked as a body is: a bad value or an unknown field gets the error record a Batch line would
    for field, value, code in (("max_tokens", -1, "invalid_value"), ("n", 2, "unsupported_parameter")):
        entry = batch_requests.for_the_engine(batch_requests.parse_line(json.dumps({"prompt": "Hi", field: value}).encode(), 4))
        assert isinstance(entry, batch_requests.InvalidRequest) and entry.code == code and field in entry.message
    both = batch_requests.parse_line(json.dumps({"prompt": "Hi", "messages": []}).encode(), 4)
    assert isinstance(both, batch_requests.InvalidRequest) and '"prompt" or "messages"' in both.message
    plain = batch_requests.parse_line(json.dumps({"prompt": "Hello", "custom_id": "mine"}).encode(), 4)
    assert isinstance(plain, batch_requests.BatchRequest) and plain.body is None


@pytest.mark.parametrize("line", [{"prompt": "Hello", "custom_id": 5}, {"prompt": "Hello", "custom_id": ""},
                                  {"custom_id": None, "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"messages": [{"role": "user", "content": "Hello"}]}}])
def test_a_custom_id_that_is_not_a_string_is_an_error_record_not_a_line_number(line):
    # the old code answered it under line-4, where nobody would look for the answer to id 5
    entry = batch_requests.parse_line(json.dumps(line).encode(), 4)
    assert isinstance(entry, batch_requests.InvalidRequest) and entry.custom_id == "line-4"
    assert '"custom_id" must be a non-empty string' in entry.message
