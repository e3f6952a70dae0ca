"""The command line as a careless or hostile user meets it: each misuse is one line on stderr naming the problem
and the fix, never a hang, a traceback or a half-made result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EDGESPEC = [sys.executable, "-m", "edgespec"]


@pytest.fixture(autouse=True)
def own_dirs(tmp_path, monkeypatch):
    """Config, history, cache and models of this test's own, so nothing here touches the user's (conftest
    leaves the models' store, where imports are registered, to each test)."""
    for variable in ("EDGESPEC_CONFIG_DIR", "EDGESPEC_DATA_DIR", "EDGESPEC_CACHE_DIR", "EDGESPEC_MODELS_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    return tmp_path


def test_chat_without_a_terminal_says_so_instead_of_drawing_into_a_pipe():
    # `echo hi | edgespec chat` started the full-screen app on a pipe: it drew escape codes into stdout and
    # never ended (the guard below is for a hang, not a timing)
    done = subprocess.run([*EDGESPEC, "chat"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, env=os.environ)
    assert done.returncode == 2 and done.stdout == "", done.stdout[-300:]
    assert done.stderr.count("\n") == 1 and "terminal" in done.stderr and "edgespec run -" in done.stderr


@pytest.mark.parametrize("name", ["two\nlines", "tab\there", "   ", "", "../up", "sub/name", "name.gguf", "esc\x1b[31m"])
def test_models_import_refuses_a_name_no_command_could_use(name, tiny_models, capsys):
    # a newline or a tab broke `models list`'s one model a line, a blank name listed as nothing, and a
    # name with a slash or ending in .gguf was registered though `-m NAME` reads it as a file path
    from edgespec.catalog import load_catalog
    from edgespec.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["models", "import", str(tiny_models["target"]), "--name", name])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--name" in err and "Traceback" not in err, err
    assert name not in load_catalog().models and not any(model.imported for model in load_catalog().models.values())


def test_models_import_takes_a_plain_name(tiny_models, capsys):
    from edgespec.catalog import load_catalog
    from edgespec.commands import main

    assert main(["models", "import", str(tiny_models["target"]), "--name", "my-tiny_1.5b"]) == 0
    assert load_catalog().models["my-tiny_1.5b"].imported


@pytest.mark.parametrize("argv", [["run", "hello", "--model", "missing.gguf"], ["plan", "--model", "missing.gguf"],
                                  ["models", "list"], ["models", "path", "smollm2-135m-instruct"]])
def test_a_command_whose_results_go_to_a_closed_stdout_says_so(argv):
    # `edgespec run hi >&-` ended in a traceback (sys.stdout is None), and plan and models printed nothing and
    # exited 0: their results were lost without a word
    done = subprocess.run([*EDGESPEC, *argv], preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "stdout is closed" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, code", [(["plan", "--json", "--gpu-layers", "2"], 0),
                                        (["run", "hi", "--model", "missing.gguf"], 1)])
def test_with_stderr_closed_notices_and_errors_stay_out_of_stdout(argv, code, tiny_models):
    # with fd 2 closed, print(file=sys.stderr) printed on stdout: `plan --json 2>&-` put its no-GPU notice
    # above the JSON, and an error read as a result
    argv = [*argv, "--model", str(tiny_models["target"])] if "--model" not in argv else argv
    done = subprocess.run([*EDGESPEC, *argv], preexec_fn=lambda: os.close(2), stdout=subprocess.PIPE, text=True,
                          timeout=120)
    assert done.returncode == code
    if code == 0:
        assert json.loads(done.stdout)["device"] == "cpu"  # the JSON alone
    else:
        assert done.stdout == ""


@pytest.mark.parametrize("argv", [["batch", "missing.jsonl", "-o", "out.jsonl"], ["--version"]])
def test_a_command_that_prints_no_results_runs_with_stdout_closed(argv, tmp_path):
    done = subprocess.run([*EDGESPEC, *argv], preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True,
                          timeout=120, cwd=tmp_path)
    assert "stdout is closed" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv", [["batch", "", "-o", "out.jsonl"], ["batch", "in.jsonl", "-o", ""],
                                  ["batch", "in.jsonl", "-o", "out.jsonl", "--summary", ""]])
def test_an_empty_batch_path_is_named_as_empty(argv, tmp_path, capsys, monkeypatch):
    # "" became Path("."), and the batch said "cannot write batch output .: Is a directory", a path nobody typed
    from edgespec.commands import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('"hello"\n')
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "empty" in err and " . " not in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("command, flag", [
    *((command, flag) for command in (["run", "hello"], ["plan"], ["chat"], ["batch", "in.jsonl", "-o", "out.jsonl"])
      for flag in ("--model", "--draft")),
    (["heads", "train"], "--model"), (["heads", "show"], "--model"),  # heads take no draft
])
def test_an_empty_model_or_draft_is_named_as_empty(command, flag, capsys, tmp_path, monkeypatch):
    # "" became Path("."): "edgespec: . is a directory, not a model file", a path nobody typed
    import tui.run
    from edgespec.commands import main

    monkeypatch.setattr(tui.run, "run_chat", lambda *args, **kwargs: pytest.fail("the empty name went through"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('"hello"\n')
    with pytest.raises(SystemExit) as exit_:
        main([*command, flag, ""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and flag in err and "empty" in err, err


def test_an_empty_model_in_the_chat_config_is_named(tmp_path):
    from tui.config import ConfigError, load_config

    path = tmp_path / "config.toml"
    for setting in ("model", "draft"):
        path.write_text(f'{setting} = ""\n')
        with pytest.raises(ConfigError, match=f"{setting} cannot be empty"):
            load_config(path)


def test_a_batch_resumed_with_another_model_says_whose_answers_it_keeps(tiny_models, tmp_path, capsys):
    # rerun with another --model, the batch counted the first model's answers as done without a word
    from edgespec.commands import main

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('"hello"\n"world"\n')
    common = ["--draft", "none", "--temperature", "0", "--max-tokens", "2", "--no-prompt-cache"]
    assert main(["batch", str(source), "-o", str(out), "--model", str(tiny_models["target"]), *common]) == 0
    written = out.read_bytes()
    capsys.readouterr()
    assert main(["batch", str(source), "-o", str(out), "--model", str(tiny_models["draft"]), *common]) == 0
    err = capsys.readouterr().err
    assert out.read_bytes() == written, "the records are kept"
    notes = [line for line in err.splitlines() if "answered by" in line]
    # records name the model as the server does: by the file's stem
    assert len(notes) == 1 and "by target" in notes[0] and "than draft" in notes[0] and "-o" in notes[0], err
    assert main(["batch", str(source), "-o", str(out), "--model", str(tiny_models["target"]), *common]) == 0
    assert "answered by" not in capsys.readouterr().err
    # records written before named the file; they are the same model's
    out.write_text(out.read_text().replace('"model": "target"', '"model": "target.gguf"'))
    assert '"target.gguf"' in out.read_text()
    assert main(["batch", str(source), "-o", str(out), "--model", str(tiny_models["target"]), *common]) == 0
    assert "answered by" not in capsys.readouterr().err


def test_a_batch_rerun_with_other_sampling_flags_redoes_the_answers_they_made(tiny_models, tmp_path, capsys):
    # It kept the first run's answers as done: resume matched a request's line, not the flags.
    from edgespec.commands import main

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    own = {"custom_id": "own", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    source.write_text('"hello"\n' + json.dumps(own) + "\n")
    common = ["--model", str(tiny_models["target"]), "--draft", "none", "--temperature", "0", "--no-prompt-cache"]
    assert main(["batch", str(source), "-o", str(out), *common, "--max-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["batch", str(source), "-o", str(out), *common, "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "1 request in" in err and "'line-1', max_tokens 2, now 3" in err, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["line-1", "own", "line-1"]
    assert records[2]["supersedes"] == records[0]["id"]
    assert [r["sampling"]["max_tokens"] for r in records] == [2, 2, 3]
    assert main(["batch", str(source), "-o", str(out), *common, "--max-tokens", "3"]) == 0
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("argv, flag", [
    (["heads", "train", "--output", ""], "--output"),  # a traceback: PosixPath('.') has an empty name
    (["heads", "train", "--batch", ""], "--batch"),  # ".: Is a directory"
    (["heads", "train", ""], "paths"),  # trained on the current folder, "." , without a word
    (["heads", "show", "--heads", ""], "--heads"),  # "heads file . is damaged"
    (["heads", "train", "--minutes", "1e308"], "--minutes"),  # a traceback: cannot convert float infinity to integer
])
def test_heads_refuses_an_empty_path_or_an_endless_time_in_one_line(argv, flag, capsys):
    from edgespec.commands import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--model", "missing.gguf"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, flag", [
    (["heads", "train", "no-such-folder"], "paths"),
    (["heads", "train", "--batch", "no-such-batch.jsonl"], "--batch"),
])
def test_heads_train_refuses_a_path_that_is_not_there_before_the_model_loads(argv, flag, capsys):
    # found out with exit 1 after the model had loaded, --batch's without naming the flag
    from edgespec.commands import main

    assert main([*argv, "--model", "missing.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "does not exist" in err and "missing.gguf" not in err, err


def test_heads_train_refuses_a_folder_as_its_output_before_it_trains(tmp_path, capsys):
    # it trained for all its --minutes, then said "edgespec: /tmp/.audit.cdog5lei.partial: Is a directory"
    from edgespec.commands import main

    code = main(["heads", "train", "--output", str(tmp_path), "--model", "missing.gguf"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--output" in err and "is a directory" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["", "http://[::1", "http://127.0.0.1:99999", "http://:8080/v1", "ftp://x"])
def test_a_batch_endpoint_that_is_no_url_is_one_usage_line(url, tmp_path, capsys):
    # "" ran the requests on the local default model instead, and "http://[::1" was a traceback
    from edgespec.commands import main

    (tmp_path / "in.jsonl").write_text('"hello"\n')
    with pytest.raises(SystemExit) as exit_:
        main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--endpoint", url,
              "--model", "missing.gguf"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--endpoint" in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_batch_endpoint_with_a_password_is_refused_without_quoting_it(tmp_path, capsys):
    # urllib never sent it, and "cannot reach http://user:s3cret@..." printed it back
    from edgespec.commands import main

    (tmp_path / "in.jsonl").write_text('"hello"\n')
    with pytest.raises(SystemExit) as exit_:
        main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
              "--endpoint", "http://user:s3cret@127.0.0.1:1/v1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--api-key" in err, err
    assert "s3cret" not in err and "http://127.0.0.1:1/v1" in err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_batch_input_in_utf16_is_refused_before_anything_runs(encoding, tmp_path, capsys):
    # PowerShell's Out-File writes UTF-16: every line became an invalid_json error record in OUT
    from edgespec.commands import main

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text = '"hello"\r\n"world"\r\n'
    source.write_bytes(text.encode(encoding) if encoding != "utf-16-be" else b"\xfe\xff" + text.encode(encoding))
    code = main(["batch", str(source), "-o", str(out), "--model", "missing.gguf"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and encoding[:6].upper() in err and "iconv" in err, err
    assert not out.exists()


@pytest.mark.parametrize("tty", [True, False])
def test_run_draws_a_replys_escapes_on_a_terminal_and_pipes_them_as_they_are(tty, tiny_models, monkeypatch):
    # A model copying "ESC]2;...BEL" from a pasted prompt retitled the terminal `edgespec run` wrote to,
    # and a carriage return let the rest of a line hide what was shown before it.
    import pty

    import edgespec.commands.run as run_command
    from edgespec.commands import main
    from pty_output import read_until_closed
    from scripted_reply import ScriptedReply, use_script

    reply = "ok \x1b]2;pwned\x07 rm -rf ~\rls \x9b31m"
    real_engine_from_args = run_command.engine_from_args

    def engine_with_scripted_reply(args, notice):
        engine = real_engine_from_args(args, notice=notice)
        use_script(engine, ScriptedReply(reply))
        return engine

    monkeypatch.setattr(run_command, "engine_from_args", engine_with_scripted_reply)
    reader, writer = pty.openpty() if tty else os.pipe()
    with open(writer, "w", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["run", "hi", "--model", str(tiny_models["target"]), "--draft", "none"]) == 0
    shown = read_until_closed(reader).decode("utf-8")
    os.close(reader)
    if tty:
        assert not set(shown) & {"\x1b", "\x9b", "\x07"}, repr(shown)
        # the terminal's own line discipline ends the line with \r\n
        assert shown == "ok \u241b]2;pwned\u2407 rm -rf ~\u240dls \ufffd31m\r\n", repr(shown)
    else:
        assert shown == reply + "\n"


def test_a_notice_at_a_replys_end_starts_a_line_of_its_own_on_a_terminal(tiny_models, monkeypatch):
    # "The quick brown foxcannot save a prefix snapshot in ...": the notice went on the reply's last line
    import pty

    import edgespec.commands.run as run_command
    from edgespec.commands import main
    from edgespec.engine import Done
    from pty_output import read_until_closed
    from scripted_reply import ScriptedReply, use_script

    real_engine_from_args = run_command.engine_from_args

    def engine_with_a_notice_at_the_end(args, notice):
        engine = real_engine_from_args(args, notice=notice)
        use_script(engine, ScriptedReply("The quick brown fox"))
        stream = engine.stream

        def stream_then_notice(*arguments, **keywords):
            for event in stream(*arguments, **keywords):
                if isinstance(event, Done):  # as a prompt snapshot that could not be saved says so
                    notice("cannot save a prefix snapshot")
                yield event

        monkeypatch.setattr(engine, "stream", stream_then_notice)
        return engine

    monkeypatch.setattr(run_command, "engine_from_args", engine_with_a_notice_at_the_end)
    reader, writer = pty.openpty()
    with open(writer, "w", encoding="utf-8") as terminal:
        monkeypatch.setattr(sys, "stdout", terminal)
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["run", "hi", "--model", str(tiny_models["target"]), "--draft", "none"]) == 0
    shown = read_until_closed(reader).decode("utf-8")
    os.close(reader)
    assert "The quick brown fox\r\ncannot save a prefix snapshot\r\n" in shown, repr(shown)


@pytest.mark.parametrize("stderr", ["file", "closed"])
def test_chat_with_its_stderr_redirected_says_so_on_the_terminal(stderr, tmp_path):
    # Textual draws on stderr: `edgespec chat 2>log` drew the screen into the file and read keys blind, and
    # `2>&-` hung for good (only kill -9 ended it). The guard below is for a hang, not a timing.
    import pty

    from pty_output import read_until_closed

    reader, terminal = pty.openpty()
    log = open(tmp_path / "log", "w")

    def redirect_stderr():
        if stderr == "closed":
            os.close(2)
        else:
            os.dup2(log.fileno(), 2)

    done = subprocess.run([*EDGESPEC, "chat"], stdin=terminal, stdout=terminal, preexec_fn=redirect_stderr,
                          timeout=120, env={**os.environ, "EDGESPEC_DATA_DIR": str(tmp_path / "data")})
    os.close(terminal)
    shown = read_until_closed(reader).decode("utf-8", "replace")
    os.close(reader)
    log.close()
    assert done.returncode == 2 and "draws its screen on stderr" in shown and "\x1b[" not in shown, shown[-300:]
