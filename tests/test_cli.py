"""`edgespec run` as a user runs it: streamed text, --json, stdin, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

EDGESPEC = [sys.executable, "-m", "edgespec"]


def run_cli(*args, stdin=None):
    return subprocess.run([*EDGESPEC, *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_run_json_is_one_object_and_modes_agree(tiny_models):
    outputs = {}
    for draft in ("none", "ngram", str(tiny_models["draft"])):
        done = run_cli("run", "the cat sat on the mat", "--raw", "--json", "--model", str(tiny_models["target"]),
                       "--draft", draft, "--temperature", "0", "--max-tokens", "32", "--threads", "1", "--n-ctx", "512")
        assert done.returncode == 0, done.stderr
        outputs[draft] = json.loads(done.stdout)
    assert {o["stats"]["mode"] for o in outputs.values()} == {"none", "ngram", "combined"}  # a loaded draft model drafts with n-grams too
    ids = [o["token_ids"] for o in outputs.values()]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 32


def test_run_streams_text_and_reads_the_prompt_from_stdin(tiny_models):
    done = run_cli("run", "-", "--raw", "--model", str(tiny_models["target"]), "--draft", "ngram",
                   "--temperature", "0", "--max-tokens", "16", "--threads", "1", "--n-ctx", "512",
                   stdin="hello world, hello world")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "tokens" in done.stderr and "acceptance" in done.stderr and "target passes/token" in done.stderr


def test_run_prints_the_text_held_for_a_stop_that_never_came(tiny_models):
    args = ["run", "the cat sat on the mat", "--raw", "--model", str(tiny_models["target"]), "--temperature", "0",
            "--max-tokens", "32", "--threads", "1", "--n-ctx", "512"]
    text = json.loads(run_cli(*args, "--json").stdout)["text"]
    never = text[-3:] + next(c for c in "~@#\u2603" if c not in text)
    # bytes: text mode would read a generated "\r" as "\n"
    done = subprocess.run([*EDGESPEC, *args, "--stop", never], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == text + "\n"


def test_an_error_quoting_a_path_draws_its_escape_sequences(tmp_path):
    # a path from a script or a config that retitles the terminal, or hides the line, when printed as it is
    done = run_cli("run", "hi", "--model", str(tmp_path / "x\x1b]0;pwned\x07y.gguf"))
    assert done.returncode == 1 and "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert "x\u241b]0;pwned\u2407y.gguf" in done.stderr
    refused = run_cli("chat", "--bogus", "a\x1b]0;pwned\x07b")  # argparse's own errors quote what they refuse
    assert refused.returncode == 2 and "\x1b" not in refused.stderr and "a\u241b]0;pwned\u2407b" in refused.stderr


@pytest.mark.parametrize("make_bad, expected", [
    (lambda tmp, models: ["--model", str(tmp / "missing.gguf")], "does not exist"),
    (lambda tmp, models: ["--model", str(_write(tmp / "notes.gguf", b"hello"))], "GGUF"),
    (lambda tmp, models: ["--model", str(models["target"]), "--draft", str(models["mismatch"])], "cannot draft for"),
    (lambda tmp, models: ["--model", str(models["target"]), "--n-ctx", "256"], "context"),
])
def test_bad_input_gets_one_line_and_no_traceback(tmp_path, tiny_models, make_bad, expected):
    prompt = "word " * 400 if expected == "context" else "hello"
    done = run_cli("run", prompt, "--raw", "--draft", "none", "--threads", "1", *make_bad(tmp_path, tiny_models))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("edgespec:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("budget, mode", [("4MiB", "ngram"), ("8MiB", "combined")])
def test_a_draft_that_does_not_fit_the_budget_falls_back_to_ngram(tiny_models, budget, mode):
    done = run_cli("run", "the cat sat", "--raw", "--json", "--model", str(tiny_models["target"]),
                   "--draft", str(tiny_models["draft"]), "--memory-budget", budget, "--n-ctx", "512",
                   "--temperature", "0", "--max-tokens", "8", "--threads", "1")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["mode"] == mode and stats["plan_reason"]
    assert ("not loading draft draft.gguf" in done.stderr) == (mode == "ngram")


def test_plan_json(tiny_models):
    done = run_cli("plan", "--model", str(tiny_models["target"]), "--draft", str(tiny_models["draft"]),
                   "--ctx", "512", "--memory-budget", "4MiB", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["mode"] == "ngram" and plan["budget_bytes"] == 4 * 2**20 and plan["fits"]


def test_plan_shows_the_kv_cache_types(tiny_models):
    done = run_cli("plan", "--model", str(tiny_models["target"]), "--draft", str(tiny_models["draft"]),
                   "--ctx", "512", "--memory-budget", "64MiB", "--kv-type", "q8_0", "--draft-kv-type", "q4_0", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert (plan["kv_type"], plan["draft_kv_type"], plan["flash_attn"]) == ("q8_0", "q4_0", True)  # auto
    assert plan["kv_cache_types"] == {"target": "K q8_0, V q8_0", "draft": "K q4_0, V q4_0"}
    for off in (["--flash-attn", "off"], ["--bit-exact"]):
        table = run_cli("plan", "--model", str(tiny_models["target"]), "--ctx", "512", "--memory-budget", "64MiB",
                        "--kv-type", "q4_0", *off)
        assert table.returncode == 0 and "K q4_0, V f16" in table.stdout, table.stderr
        assert re.search(r"flash attention\W+off\b", table.stdout), table.stdout


def test_a_plan_written_to_a_pipe_keeps_the_model_names_whole(tiny_models, tmp_path):
    # at the 80 columns a pipe gets, the names read "qwen2.5-coder-1.5b-inst…"
    long_name = tmp_path / ("a-model-file-name-longer-than-any-column-of-eighty-" * 2 + "wide.gguf")
    long_name.symlink_to(tiny_models["target"])
    done = subprocess.run([*EDGESPEC, "plan", "--model", str(long_name), "--draft", "none", "--ctx", "512"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "40"})
    assert done.returncode == 0, done.stderr
    assert long_name.name in done.stdout and "…" not in done.stdout


@pytest.mark.parametrize("flag", [["--seed", "3"], ["--stop", "END"]])
def test_chat_refuses_the_per_reply_flags_it_would_ignore(flag):
    # The chat app samples every reply afresh and stops at the end of a turn; it used to accept
    # --seed and --stop and silently do nothing with them.
    done = run_cli("chat", *flag)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and flag[0] in done.stderr
