"""`edgespec batch` never destroys or mixes up data, and one bad line never stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from edgespec.commands import batch
from edgespec.commands.batch import output as batch_output
from edgespec.commands.batch import requests as batch_requests
from test_batch import (
    assert_openai_success,
    batch_argv,
    chat_line,
    completion_line,
    edgespec_command,
    read_records,
    run_cli,
    wait_for_records,
    write_lines,
)


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("edgespec:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def three_requests() -> list[str]:
    return [chat_line("a", "Hello the cat", max_tokens=4), completion_line("b", "The cat sat", max_tokens=4),
            chat_line("c", "Hello world", max_tokens=4)]


def finished_run(tiny_models, tmp_path, lines=None):
    """IN and OUT after a complete run."""
    source = write_lines(tmp_path / "in.jsonl", lines or three_requests())
    out = tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_OK
    return source, out


# ---------------------------------------------------------------- OUT that is not batch output


@pytest.mark.parametrize("content", [
    b"my notes\nbuy milk\n",
    b"my notes\nbuy milk",  # no final newline: the old code took it for a torn record
    b"{\n",
    b"{",
    b'{"custom_id": "a", "note": "looks like a record"}\n',
])
def test_an_out_file_that_is_not_batch_output_is_refused_and_left_untouched(tiny_models, tmp_path, capsys, content):
    source = write_lines(tmp_path / "in.jsonl", three_requests())
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    assert run_cli(batch_argv(tiny_models, source, notes)) == batch.EXIT_REFUSED
    assert "is not an edgespec batch output record" in one_line_error(capsys.readouterr().err)
    assert notes.read_bytes() == content
    assert not (tmp_path / ("notes.txt" + batch_output.HOLDER_SUFFIX)).exists()


@pytest.mark.parametrize("kind", ["openai", "plain"])
def test_swapped_in_and_out_are_refused_and_both_left_untouched(tiny_models, tmp_path, capsys, kind):
    lines = three_requests() if kind == "openai" else [json.dumps(f"Hello the cat {i}") for i in range(3)]
    source, out = finished_run(tiny_models, tmp_path, lines)
    before = source.read_bytes(), out.read_bytes()
    capsys.readouterr()
    assert run_cli(batch_argv(tiny_models, out, source)) == batch.EXIT_REFUSED
    assert "line 1 is not an edgespec batch output record" in one_line_error(capsys.readouterr().err)
    assert (source.read_bytes(), out.read_bytes()) == before


def out_with_tail(tmp_path, tail: bytes):
    out = tmp_path / "out.jsonl"
    good = b"".join(batch_output.encode_record(batch_output.error_record(f"r{i}", "x", "y", "f")) for i in range(2))
    out.write_bytes(good + tail)
    return out, good


@pytest.mark.parametrize("tail", [b'{"id": "batch_req_12', b'{"id"', b'{"id": "batch_req_1", "cus\0\0\0', b"\0" * 4096])
def test_only_a_torn_edgespec_record_is_cut_off(tmp_path, tail):
    out, good = out_with_tail(tmp_path, tail)
    writer = batch_output.RecordWriter(out)
    try:
        finished, torn = writer.load_finished()
    finally:
        writer.close()
    assert torn and set(finished) == {"r0", "r1"} and out.read_bytes() == good


@pytest.mark.parametrize("zeros", [b"", b"\0" * 512], ids=["newline-lost", "then-zero-bytes"])
def test_a_whole_last_record_without_its_newline_is_kept_not_redone(tmp_path, zeros):
    # an editor that drops the last newline must not cost an answer already written (the old code cut it off)
    last = batch_output.encode_record(batch_output.error_record("r2", "x", "y", "f"))
    out, good = out_with_tail(tmp_path, last.rstrip(b"\n") + zeros)
    writer = batch_output.RecordWriter(out)
    try:
        finished, torn = writer.load_finished()
    finally:
        writer.close()
    assert not torn and set(finished) == {"r0", "r1", "r2"} and out.read_bytes() == good + last


@pytest.mark.parametrize("tail", [b"a note", b'{"custom_id": "r9"}', b"not a record\n", b'{"id": "batch_req_9"}\n'])
def test_any_other_last_line_is_refused_untouched(tmp_path, tail):
    out, good = out_with_tail(tmp_path, tail)
    writer = batch_output.RecordWriter(out)
    try:
        with pytest.raises(batch_requests.BatchError, match="line 3 is not an edgespec batch output record"):
            writer.load_finished()
    finally:
        writer.close()
    assert out.read_bytes() == good + tail


def test_every_record_line_starts_with_the_prefix_the_repair_relies_on(tiny_models, tmp_path):
    _, out = finished_run(tiny_models, tmp_path)
    assert all(line.startswith(batch_output.RECORD_PREFIX) for line in out.read_text().splitlines())
    with pytest.raises(ValueError):
        batch_output.encode_record({"custom_id": "a", "id": "batch_req_1", "response": None, "error": None})


# ---------------------------------------------------------------- --summary and OUT against IN


def link(kind: str, target, path):
    (os.link if kind == "hardlink" else os.symlink)(target, path)
    return path


@pytest.mark.parametrize("case", ["summary-is-out", "summary-is-in", "summary-hardlink-to-out",
                                  "summary-symlink-to-out", "summary-symlink-to-in", "summary-hardlink-to-in",
                                  "out-hardlink-to-in"])
def test_summary_or_out_that_is_another_of_the_files_is_refused(tiny_models, tmp_path, capsys, case):
    source, out = finished_run(tiny_models, tmp_path)
    before = source.read_bytes(), out.read_bytes()
    summary = {
        "summary-is-out": out, "summary-is-in": source,
        "summary-hardlink-to-out": tmp_path / "s-hard", "summary-symlink-to-out": tmp_path / "s-sym",
        "summary-symlink-to-in": tmp_path / "s-sym", "summary-hardlink-to-in": tmp_path / "s-hard",
        "out-hardlink-to-in": tmp_path / "summary.json",
    }[case]
    if case.startswith("summary-") and ("link" in case):
        link(case.split("-")[1], out if case.endswith("out") else source, summary)
    if case == "out-hardlink-to-in":
        out = link("hardlink", source, tmp_path / "out-alias.jsonl")
    capsys.readouterr()
    assert run_cli(batch_argv(tiny_models, source, out, "--summary", str(summary))) == batch.EXIT_REFUSED
    message = one_line_error(capsys.readouterr().err)
    assert ("output file is the input file" if case.startswith("out-") else "give --summary another path") in message
    assert (source.read_bytes(), (tmp_path / "out.jsonl").read_bytes()) == before


def test_a_summary_symlinked_to_an_out_not_yet_written_is_refused(tiny_models, tmp_path, capsys):
    source = write_lines(tmp_path / "in.jsonl", three_requests())
    out, summary = tmp_path / "out.jsonl", link("symlink", tmp_path / "out.jsonl", tmp_path / "summary.json")
    assert run_cli(batch_argv(tiny_models, source, out, "--summary", str(summary))) == batch.EXIT_REFUSED
    assert "is the output file" in one_line_error(capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("where", ["missing-dir", "a-dir", "under-a-file"])
def test_a_summary_that_cannot_be_written_is_refused_before_any_request_runs(tiny_models, tmp_path, capsys, where):
    # it was found out after the whole batch had run: exit 2, "refused", for a batch that was done
    source = write_lines(tmp_path / "in.jsonl", three_requests())
    out = tmp_path / "out.jsonl"
    summary = {"missing-dir": tmp_path / "no-such-dir" / "summary.json", "a-dir": tmp_path,
               "under-a-file": source / "summary.json"}[where]
    assert run_cli(batch_argv(tiny_models, source, out, "--summary", str(summary))) == batch.EXIT_REFUSED
    message = one_line_error(capsys.readouterr().err)
    assert message.startswith(f"edgespec: cannot write --summary {summary}") and "check the path" in message
    assert not out.exists()


# ---------------------------------------------------------------- one batch per OUT


def test_a_second_batch_on_the_same_out_is_refused_naming_the_holder(tiny_models, tmp_path, capsys):
    lines = [chat_line("first", "Hello the cat", max_tokens=2),
             completion_line("long", "The cat sat on", max_tokens=4000),  # in flight while we look
             chat_line("last", "Hello world", max_tokens=2)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = edgespec_command() + batch_argv(tiny_models, source, out)
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_records(holder, out, 1)
        for alias in (out, link("symlink", out, tmp_path / "alias.jsonl")):
            assert run_cli(batch_argv(tiny_models, source, alias)) == batch.EXIT_REFUSED
            message = one_line_error(capsys.readouterr().err)
            assert f"is in use by another edgespec batch (pid {holder.pid})" in message
        hardlink = link("hardlink", out, tmp_path / "hard.jsonl")
        assert run_cli(batch_argv(tiny_models, source, hardlink)) == batch.EXIT_REFUSED
        assert "in use by another edgespec batch" in one_line_error(capsys.readouterr().err)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    ids = [r["custom_id"] for r in read_records(out)]
    assert ids == ["first"]  # nobody else computed or wrote anything

    # The holder was killed: the kernel dropped its lock, and its stale pid note does not block a rerun.
    write_lines(source, [lines[0], lines[2]])
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_OK
    assert [r["custom_id"] for r in read_records(out)] == ["first", "last"]
    assert not (tmp_path / ("out.jsonl" + batch_output.HOLDER_SUFFIX)).exists()


def test_the_lock_comes_before_any_repair(tiny_models, tmp_path, capsys):
    out, good = out_with_tail(tmp_path, b'{"id": "batch_req_12')
    source = write_lines(tmp_path / "in.jsonl", three_requests())
    holder = batch_output.RecordWriter(out)  # another batch holds OUT, its last record half written
    try:
        assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_REFUSED
        assert f"pid {os.getpid()}" in one_line_error(capsys.readouterr().err)
        assert out.read_bytes() == good + b'{"id": "batch_req_12'
    finally:
        holder.close()


# ---------------------------------------------------------------- changed input


def test_a_changed_request_is_redone_and_appended(tiny_models, tmp_path, capsys):
    lines = three_requests() + ["{not json"]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_REQUESTS_FAILED
    first = out.read_text().splitlines(keepends=True)
    capsys.readouterr()

    # Same custom_ids, other requests: b's prompt changed, and the bad line 4 was fixed.
    lines[1] = completion_line("b", "Hello hello hello", max_tokens=4)
    lines[3] = json.dumps("Hello the world")
    write_lines(source, lines)
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_OK
    err = capsys.readouterr().err
    assert "2 requests changed since" in err and "(first: 'b', line 2)" in err
    assert "(2 already done)" in err
    after = out.read_text().splitlines(keepends=True)
    assert after[:4] == first  # nothing was cut or rewritten
    new = [json.loads(line) for line in after[4:]]
    assert [r["custom_id"] for r in new] == ["b", "line-4"]
    for record in new:
        assert_openai_success(record, record["custom_id"])
    assert new[0]["fingerprint"] != json.loads(first[1])["fingerprint"]
    # Each new record names the one it supersedes; the old ones stay as they were.
    assert [r["supersedes"] for r in new] == [json.loads(first[i])["id"] for i in (1, 3)]

    # The last record per custom_id counts: a third run has nothing to do.
    capsys.readouterr()
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_OK
    assert "(4 already done)" in capsys.readouterr().err and out.read_text().splitlines(keepends=True) == after


def test_reformatting_a_line_keeps_its_fingerprint():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 3}}
    spaced = json.dumps(line, indent=None, separators=(" , ", " : "))
    reordered = json.dumps(dict(reversed(list(line.items()))))
    fingerprints = {batch_requests.parse_line(text.encode(), 1).fingerprint for text in (json.dumps(line), spaced, reordered)}
    assert len(fingerprints) == 1
    changed = json.dumps({**line, "body": {"prompt": "x", "max_tokens": 4}})
    assert batch_requests.parse_line(changed.encode(), 1).fingerprint not in fingerprints


def test_records_without_a_fingerprint_are_kept_with_a_note(tiny_models, tmp_path, capsys):
    source, out = finished_run(tiny_models, tmp_path)
    old_style = [json.loads(line) for line in out.read_text().splitlines()]
    for record in old_style:
        del record["fingerprint"]  # as edgespec wrote them before fingerprints
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in old_style))
    before = out.read_bytes()
    capsys.readouterr()
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_OK
    err = capsys.readouterr().err
    assert "3 records in" in err and "no request fingerprint" in err and "(3 already done)" in err
    assert out.read_bytes() == before


# ---------------------------------------------------------------- bad lines and exit codes


def test_bad_sampling_values_become_error_records_and_the_rest_succeed(tiny_models, tmp_path, capsys):
    lines = [
        chat_line("ok-1", "Hello the cat", max_tokens=4),
        chat_line("top-p-negative", "Hello", top_p=-0.5),
        chat_line("seed-minus-1", "Hello", seed=-1, temperature=0.8),
        chat_line("nan-temperature", "Hello", temperature=float("nan")),
        completion_line("inf-top-p", "The cat", top_p=float("inf")),
        completion_line("huge-temperature", "The cat", temperature=10**400),
        '{"custom_id": "deep", "body": ' + "[" * 100000 + "]" * 100000 + "}",
        completion_line("ok-2", "The cat", max_tokens=4),
    ]
    assert "NaN" in lines[3] and "Infinity" in lines[4]  # what Python's json writes and reads back
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, source, out)) == batch.EXIT_REQUESTS_FAILED
    by_id = {r["custom_id"]: r for r in read_records(out)}
    assert list(by_id) == ["ok-1", "top-p-negative", "seed-minus-1", "nan-temperature", "inf-top-p",
                           "huge-temperature", "line-7", "ok-2"]
    for custom_id in ("ok-1", "ok-2"):
        assert_openai_success(by_id[custom_id], custom_id)
    for custom_id, line_no in (("top-p-negative", 2), ("seed-minus-1", 3), ("nan-temperature", 4),
                               ("inf-top-p", 5), ("huge-temperature", 6), ("line-7", 7)):
        record = by_id[custom_id]
        assert record["response"] is None and f"line {line_no}" in record["error"]["message"]
        # the body check of edgespec serve refuses what no setting is; SamplingParams what it takes no value of
        expected = {"line-7": "invalid_json", "seed-minus-1": "invalid_field"}
        assert record["error"]["code"] == expected.get(custom_id, "invalid_value")
    assert "top_p" in by_id["top-p-negative"]["error"]["message"]
    assert "2 ok, 6 failed of 8" in capsys.readouterr().err


def test_exit_codes_of_the_real_command(tiny_models, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", three_requests())
    command = edgespec_command() + batch_argv(tiny_models, source, tmp_path / "out.jsonl")
    assert subprocess.run(command, capture_output=True, timeout=120).returncode == batch.EXIT_OK
    write_lines(source, three_requests() + [chat_line("bad", "Hello", top_p=-0.5)])
    failed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert failed.returncode == batch.EXIT_REQUESTS_FAILED and "Traceback" not in failed.stderr
    missing_model = command[:]
    missing_model[missing_model.index("--model") + 1] = str(tmp_path / "no-such-model.gguf")
    missing_model[missing_model.index("-o") + 1] = str(tmp_path / "new.jsonl")
    refused = subprocess.run(missing_model, capture_output=True, text=True, timeout=120)
    assert refused.returncode == batch.EXIT_REFUSED and "Traceback" not in refused.stderr
    assert not (tmp_path / "new.jsonl").exists()  # a refused run leaves no empty OUT behind


def test_an_output_named_by_a_dangling_symlink_keeps_the_symlink_when_nothing_was_written(tmp_path):
    # an interrupted batch that wrote no record removed the user's symlink and left the empty file it made
    link, target = tmp_path / "results.jsonl", tmp_path / "store" / "results.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    writer = batch_output.RecordWriter(link)
    assert target.exists()
    writer.close()
    assert link.is_symlink() and not target.exists()


def test_concurrency_without_an_endpoint_is_refused_not_ignored(tiny_models, tmp_path, capsys):
    source, out = write_lines(tmp_path / "in.jsonl", [json.dumps("Hello")]), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(tiny_models, source, out, "--concurrency", "4")) == batch.EXIT_REFUSED
    assert "a local batch decodes requests together with --parallel N" in capsys.readouterr().err
    assert not out.exists()
