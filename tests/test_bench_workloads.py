"""Hostile workload files for `edgespec bench --workloads`: one line naming the file, the line and the problem."""

from __future__ import annotations

import re

import pytest

from edgespec.commands import main
from edgespec.commands.bench import workloads


@pytest.mark.parametrize("line, reason", [
    # json recursed once per bracket and ended in a RecursionError traceback
    ("[" * 100_000, "its JSON nests too deeply"),
    # a lone surrogate reached the tokenizer after the model had loaded: a ValueError traceback from edgespec.text
    (r'{"id": "a", "prompt": "\ud800 hi"}', "the prompt holds a lone UTF-16 surrogate ('\\ud800' at character 0)"),
    (r'{"id": "\udfff", "prompt": "hi"}', "the id holds a lone UTF-16 surrogate ('\\udfff' at character 0)"),
], ids=["deep", "surrogate-in-prompt", "surrogate-in-id"])
def test_a_hostile_workload_line_is_refused_in_one_line(tmp_path, line, reason):
    (tmp_path / "deep.jsonl").write_text('{"id": "ok", "prompt": "hi"}\n' + line + "\n")
    expected = re.escape(f"deep.jsonl:2 is not a workload line ({reason}")
    with pytest.raises(workloads.BenchError, match=expected) as caught:
        workloads.load_workloads(["deep"], directory=tmp_path)
    assert "\n" not in str(caught.value)


def test_two_prompts_under_one_id_are_refused(tmp_path):
    # runs are told apart by the id: the second prompt was never run, the first run twice in its place
    (tmp_path / "dup.jsonl").write_text('{"id": "d", "prompt": "Say hi."}\n{"id": "e", "prompt": "x"}\n'
                                        '{"id": "d", "prompt": "Repeat: apple"}\n')
    with pytest.raises(workloads.BenchError, match=re.escape("dup.jsonl:3 has the id 'd' of line 1")):
        workloads.load_workloads(["dup"], directory=tmp_path)


@pytest.mark.parametrize("name", ["speedup.txt", "speedup"])
def test_a_plot_file_of_no_image_type_is_refused_before_the_bench_runs(tmp_path, capsys, name):
    # every run was measured first, then matplotlib's ValueError ended the bench in a traceback with exit 1
    pytest.importorskip("matplotlib")
    assert main(["bench", "--plot", str(tmp_path / name), "--suites", "chat", "--configs", "baseline",
                 "--model", str(tmp_path / "not-loaded.gguf")]) == workloads.BenchError.exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give a file name ending in an image type" in err


def test_the_command_refuses_a_too_deep_line_before_loading_a_model(tmp_path, capsys):
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    assert main(["bench", "--workloads", str(tmp_path), "--suites", "deep", "--configs", "baseline",
                 "--model", str(tmp_path / "not-loaded.gguf")]) == workloads.BenchError.exit_code
    assert "deep.jsonl:1 is not a workload line (its JSON nests too deeply)" in capsys.readouterr().err


def test_a_folder_whose_first_line_nests_too_deeply_offers_no_suite_from_it(tmp_path):
    # Without --suites the folder's files are sniffed by their first line, which recursed the same way
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    (tmp_path / "chat.jsonl").write_text('{"id": "chat-01", "prompt": "hi"}\n')
    assert workloads.suites_in(tmp_path) == ["chat"]
