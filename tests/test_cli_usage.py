"""The command line under misuse (issue 25, section 5): one exit code for usage errors on every
command, a directory given as a model, and a prompt on stdin that is endless or binary."""

from __future__ import annotations

import argparse
import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edgespec.commands import build_parser, main
from edgespec.commands.options import SIZE_FLAGS, joined_negative_sizes
from edgespec.commands.run import read_text_bytes
from edgespec.prompts import MAX_PROMPT_BYTES_PER_TOKEN
from edgespec.errors import EdgespecError
from edgespec.fetch import ModelUnavailableError, resolve_model

EDGESPEC = [sys.executable, "-m", "edgespec"]
BATCH_LINE = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
              '"body": {"messages": [{"role": "user", "content": "hi"}]}}\n')

# A bad value of every flag that takes one, per command (flag, value, what the error line names).
ENGINE_FLAGS = [
    ("--draft-tokens", "99", "--draft-tokens"), ("--n-ctx", "100", "--n-ctx"), ("--gpu-layers", "-5", "--gpu-layers"),
    ("--draft-gpu-layers", "-2", "--draft-gpu-layers"), ("--memory-budget", "lots", "--memory-budget"),
    ("--threads", "100000", "--threads"), ("--prompt-cache-size", "0", "--prompt-cache-size"),
    ("--kv-type", "q5", "--kv-type"), ("--draft-kv-type", "q5", "--draft-kv-type"),
    ("--flash-attn", "sometimes", "--flash-attn"),
]
SAMPLING_FLAGS = [
    ("--max-tokens", "0", "--max-tokens"), ("--temperature", "-1", "--temperature"), ("-t", "nan", "--temperature"),
    ("--top-k", "-1", "--top-k"), ("--top-p", "-0.5", "--top-p"), ("--top-p", "1.5", "--top-p"),
    ("--min-p", "1", "--min-p"), ("--min-p", "inf", "--min-p"), ("--max-tokens", "x", "--max-tokens"),
]
BAD_FLAGS = {
    "run": ENGINE_FLAGS + SAMPLING_FLAGS + [("--seed", "-1", "--seed"), ("--seed", str(2**64), "--seed")],
    "chat": ENGINE_FLAGS + SAMPLING_FLAGS,
    "batch": ENGINE_FLAGS + SAMPLING_FLAGS + [("--seed", "-1", "--seed"), ("--concurrency", "0", "--concurrency"),
                                              ("--parallel", "0", "--parallel")],
    "serve": ENGINE_FLAGS + SAMPLING_FLAGS + [
        ("--seed", "-1", "--seed"), ("--port", "70000", "--port"), ("--queue-size", "-1", "--queue-size"),
        ("--parallel", "99", "--parallel"), ("--request-timeout", "0", "--request-timeout"),
        ("--request-timeout", "nan", "--request-timeout"),
        ("--max-body-bytes", "10", "--max-body-bytes"), ("--alert-acceptance", "2", "--alert-acceptance"),
        ("--alert-window", "0", "--alert-window"), ("--host", "0.0.0.0", "--api-key"),
        ("--prompt-cache-ram", "lots", "--prompt-cache-ram"), ("--allow-origin", "http://localhost:3000/", "--allow-origin"),
    ],
    "plan": ENGINE_FLAGS + [("--ctx", "100", "--ctx"), ("--parallel", "0", "--parallel"),
                            ("--prompt-cache-ram", "lots", "--prompt-cache-ram")],
    "bench": [
        ("--repeats", "0", "--repeats"), ("--prompts", "0", "--prompts"), ("--temperature", "-1", "--temperature"),
        ("--seed", "-1", "--seed"), ("--max-tokens", "0", "--max-tokens"), ("--n-ctx", "5", "--n-ctx"),
        ("--threads", "100000", "--threads"), ("--kv-type", "q5", "--kv-type"), ("--suites", "bogus", "bogus"),
        ("--configs", "bogus", "bogus"), ("--flash-attn", "sometimes", "--flash-attn"),
    ],
    "heads train": [
        ("--minutes", "0", "--minutes"), ("--n-heads", "9", "--n-heads"), ("--vocab", "1", "--vocab"),
        ("--max-tokens", "0", "--max-tokens"), ("--gpu-layers", "-5", "--gpu-layers"),
        ("--threads", "100000", "--threads"), ("--form", "eagle", "--form"),
    ],
}
# Flags whose value is any text (a name, a path, a URL, a key): nothing to refuse at parse time.
FREE_TEXT = {"--model", "--draft", "--stop", "--host", "--api-key", "--endpoint", "--output", "--summary", "--batch",
             "--llama-cpp-bin", "--workloads", "--json", "--plot", "--name", "--suites", "--configs"}


def value_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long flags that take a value, of one command's parser."""
    return {max(action.option_strings, key=len) for action in parser._actions
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction)}


def subcommand_parsers(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words ("run", "heads train", ...): a group's commands stand for it."""
    parser = parser or build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, sub in subparsers.choices.items():
        nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
        found.update(subcommand_parsers(sub, f"{prefix}{name} ") if nested else {f"{prefix}{name}": sub})
    return found


def test_every_flag_that_takes_a_value_has_a_bad_value_below():
    for command, parser in subcommand_parsers().items():
        if command.startswith("models ") or command == "heads show":
            continue  # their value flags are free text (import --name) or a model
        covered = {named for _, _, named in BAD_FLAGS[command]} | {flag for flag, _, _ in BAD_FLAGS[command]}
        missing = value_flags(parser) - covered - FREE_TEXT
        assert not missing, f"edgespec {command}: add a bad value of {sorted(missing)} to BAD_FLAGS"


def command_line(command: str, flag: str, value: str, tmp_path) -> list[str]:
    """A command line that is fine but for flag=value; a model that does not exist, so that a bad value
    the parser let through ends at once (exit 1, naming the model) instead of loading anything."""
    missing_model = ["--model", str(tmp_path / "missing.gguf")]
    head = {
        "run": ["run", "hello", *missing_model],
        "chat": ["chat", *missing_model],
        "batch": ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *missing_model],
        "serve": ["serve", "--port", "0", *missing_model],
        "plan": ["plan", *missing_model],
        "bench": ["bench", *missing_model, "--prompts", "1"],
        "heads train": ["heads", "train", *missing_model],
    }[command]
    return [*head, flag, value]


def exit_code_and_error(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command, flag, value, named",
                         [(command, *bad) for command, flags in BAD_FLAGS.items() for bad in flags])
def test_a_bad_flag_is_a_usage_error_with_exit_code_2_on_every_command(command, flag, value, named, tmp_path,
                                                                        capsys, monkeypatch):
    import tui.run

    def no_app(*args, **kwargs):
        raise AssertionError("the chat app would start: the bad flag went through")

    monkeypatch.setattr(tui.run, "run_chat", no_app)
    monkeypatch.delenv("EDGESPEC_API_KEY", raising=False)
    (tmp_path / "in.jsonl").write_text(BATCH_LINE)
    code, err = exit_code_and_error(command_line(command, flag, value, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err and named in lines[0], err


SIZE_FLAG_USES = [(command, flag) for command, parser in subcommand_parsers().items()
                  for flag in sorted(value_flags(parser) & SIZE_FLAGS)]


@pytest.mark.parametrize("command, flag", SIZE_FLAG_USES)
@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
def test_a_negative_size_is_one_line_naming_the_problem(command, flag, joined, tmp_path, capsys, monkeypatch):
    # argparse took "-5GiB" for a flag: "--memory-budget: expected one argument", which says nothing of why
    import tui.run

    monkeypatch.setattr(tui.run, "run_chat", lambda *args, **kwargs: pytest.fail("the bad size went through"))
    monkeypatch.delenv("EDGESPEC_API_KEY", raising=False)
    (tmp_path / "in.jsonl").write_text(BATCH_LINE)
    argv = command_line(command, flag, "-5GiB", tmp_path)
    if joined:
        argv[-2:] = [f"{flag}=-5GiB"]
    code, err = exit_code_and_error(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert flag in lines[0] and "'-5GiB' is negative" in lines[0] and "give a positive size like 6GiB" in lines[0]


def test_only_a_negative_number_after_a_size_flag_is_joined_to_it():
    assert joined_negative_sizes(["run", "hi", "--memory-budget", "-.5G"]) == ["run", "hi", "--memory-budget=-.5G"]
    for args in (["run", "hi", "--memory-budget", "--threads", "2"],  # a missing value stays argparse's to name
                 ["run", "--memory-budget", "-x", "hi"], ["run", "--threads", "-5", "hi"],
                 ["run", "--", "--memory-budget", "-5GiB"]):  # after --, a prompt
        assert joined_negative_sizes(args) == args
    assert SIZE_FLAG_USES  # every command that plans memory has them


@pytest.mark.parametrize("argv, named", [
    (["run", "hello", "--flash-attn", "--bit-exact"], "--flash-attn"),
    (["plan", "--flash-attn", "on", "--bit-exact"], "--flash-attn"),  # plan showed a setup nothing could load
    (["serve", "--port", "0", "--parallel", "2", "--bit-exact"], "--parallel"),
])
def test_flags_that_cannot_go_together_exit_2_too(argv, named, tmp_path, capsys):
    code, err = exit_code_and_error([*argv, "--model", str(tmp_path / "missing.gguf")], capsys)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- a directory as a model


@pytest.mark.parametrize("command", ["run", "batch", "serve", "plan", "bench"])
@pytest.mark.parametrize("role", ["--model", "--draft"])
def test_a_directory_given_as_a_model_is_called_a_directory(command, role, tiny_models, tmp_path, capsys):
    folder = tmp_path / "models"
    folder.mkdir()
    models = ["--model", str(folder)] if role == "--model" else ["--model", str(tiny_models["target"]),
                                                                   "--draft", str(folder)]
    head = {
        "run": ["run", "hello"], "plan": ["plan"], "serve": ["serve", "--port", "0"], "bench": ["bench"],
        "batch": ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")],
    }[command]
    (tmp_path / "in.jsonl").write_text(BATCH_LINE)
    code, err = exit_code_and_error([*head, *models, "--threads", "1"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert f"{folder} is a directory, not a model file; pass the .gguf file inside it" in err
    assert "does not exist" not in err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_pipe_or_device_given_as_a_model_is_not_called_missing(kind, tmp_path, capsys):
    # "model file /dev/zero does not exist": it does, and is no model file
    path = tmp_path / "model.gguf" if kind == "fifo" else Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(path)
    code, err = exit_code_and_error(["run", "hello", "--model", str(path)], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert f"{path} is not a regular file, so not a model file; pass a .gguf file" in err
    assert "does not exist" not in err


def test_importing_a_pipe_is_refused_rather_than_waiting_for_a_writer(tmp_path):
    # reading its GGUF header opened the pipe, which waits for a writer for ever
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    env = {**os.environ, "EDGESPEC_MODELS_DIR": str(tmp_path / "store")}
    done = subprocess.run([*EDGESPEC, "models", "import", str(fifo)], capture_output=True, text=True, timeout=60,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"{fifo} is not a regular file" in done.stderr


def test_a_directory_named_like_a_catalog_model_does_not_hide_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "qwen2.5-coder-0.5b-instruct").mkdir()
    with pytest.raises(ModelUnavailableError, match="not downloaded"):
        resolve_model("qwen2.5-coder-0.5b-instruct", pull=False)


def test_a_plain_directory_name_without_a_slash_is_a_directory_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    with pytest.raises(EdgespecError, match="weights is a directory"):
        resolve_model("weights", pull=False)


# ---------------------------------------------------------------- the prompt on stdin


class EndlessText(io.RawIOBase):
    """A stream that never ends (like `yes`), counting what was read from it."""

    def __init__(self, byte=b"y"):
        self.byte, self.served = byte, 0

    def read(self, size=-1):
        assert size is not None and size >= 0, "an unbounded read of an endless stream"
        self.served += size
        return self.byte * size


def test_an_endless_stream_is_read_no_further_than_the_bound():
    stream = EndlessText()
    with pytest.raises(EdgespecError, match=r"longer than 64.0 KiB, more than a 256-token context can hold; "
                                            r"shorten it, or raise --n-ctx"):
        read_text_bytes(stream, 256 * MAX_PROMPT_BYTES_PER_TOKEN, 256)
    assert stream.served == 256 * MAX_PROMPT_BYTES_PER_TOKEN + 1


def test_a_prompt_up_to_the_bound_is_read_whole():
    data = b"word " * 5000
    assert read_text_bytes(io.BytesIO(data), len(data), 256) == data


def test_nul_bytes_stop_the_reading_at_once():
    stream = EndlessText(b"\0")
    with pytest.raises(EdgespecError, match="stdin holds binary data, not text"):
        read_text_bytes(stream, 10**9, 4096)
    assert stream.served <= 64 * 1024, "one chunk told it"


def run_with_stdin_from(shell_source: str, tiny_models, n_ctx: int = 256):
    """`edgespec run -` fed by a shell pipeline, bounded by `head -c` should the reading not stop."""
    command = [*EDGESPEC, "run", "-", "--raw", "--model", str(tiny_models["target"]), "--draft", "none",
               "--n-ctx", str(n_ctx), "--threads", "1", "--max-tokens", "2"]
    feeder = subprocess.Popen(["sh", "-c", shell_source], stdout=subprocess.PIPE)
    try:
        done = subprocess.run(command, stdin=feeder.stdout, capture_output=True, text=True, timeout=120)
    finally:
        feeder.stdout.close()
        feeder.kill()
        feeder.wait()
    return done


@pytest.mark.parametrize("source, expected", [
    ("head -c 100000000 /dev/zero", "stdin holds binary data, not text: "),
    ("yes 'a line of text' | head -c 100000000", "the prompt on stdin is longer than 64.0 KiB, more than a "
                                                 "256-token context can hold"),
    ("printf 'h\\000e\\000l\\000l\\000o\\000 \\000w\\000o\\000r\\000l\\000d\\000'", "UTF-16"),
])
def test_endless_or_binary_stdin_gets_one_line_and_exit_1(source, expected, tiny_models):
    done = run_with_stdin_from(source, tiny_models)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgespec: ") and expected in lines[0], done.stderr
    assert done.stdout == ""


def test_ctrl_c_while_the_commands_are_still_being_imported_is_one_line(monkeypatch, capsys):
    # Ctrl+C in the first half second (build_parser imports every command: numpy, the engine) printed a traceback
    import edgespec.commands as commands

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "build_parser", interrupted)
    assert commands.main(["run", "hello"]) == 130
    assert capsys.readouterr().err == "edgespec: interrupted\n"


def test_ctrl_c_that_lands_in_a_llama_cpp_callback_is_not_lost():
    # Python runs no code of its own while llama.cpp loads a model, but for the log callback, so a Ctrl+C then
    # was raised inside the callback, where ctypes prints it as a traceback and drops it: the load went on.
    script = (
        "import ctypes\n"
        "from edgespec.backend.runtime import raise_kept_interrupt\n"
        "def log():\n"
        "    raise KeyboardInterrupt\n"
        "callback = ctypes.CFUNCTYPE(None)(log)\n"
        "try:\n"
        "    callback()  # through C, as llama.cpp calls its log callback\n"
        "    print('returned')\n"
        "    raise_kept_interrupt()  # as the backend does when llama.cpp returns\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout == "returned\ninterrupted\n" and "Traceback" not in done.stderr, done.stderr


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs a pipe shrunk to one page (Linux)")
def test_ctrl_c_during_a_run_is_exit_130_and_one_line_even_when_pressed_twice(tiny_models):
    # Python's teardown restores SIGINT's default action partway: a second Ctrl+C (or one just as the run
    # ended) landed there and killed the process by the signal, exit -2, whatever it had not yet flushed lost.
    # Timing-free: the run writes at least 8000 bytes (8000 tokens, no stop) into a pipe that holds 4096, so
    # it is still running, or blocked on the full pipe, until the test reads on.
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    command = [*EDGESPEC, "run", "--raw", "The cat sat on", "--model", str(tiny_models["target"]), "--draft", "ngram",
               "--threads", "1", "--n-ctx", "8192", "--max-tokens", "8000", "--temperature", "0"]
    process = subprocess.Popen(command, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    watchdog = threading.Timer(120, process.kill)  # a run that ignored Ctrl+C would hang the test
    watchdog.start()
    try:
        written = [os.read(read_end, 1)]  # it is generating
        process.send_signal(signal.SIGINT)
        stderr = []
        for line in process.stderr:  # the first Ctrl+C handled...
            stderr.append(line)
            if line == "edgespec: interrupted\n":
                break
        process.send_signal(signal.SIGINT)  # ...a second one on the way out
        while chunk := os.read(read_end, 1 << 16):  # to the end: what the run wrote comes through
            written.append(chunk)
        stderr.append(process.stderr.read())
        process.wait()
    finally:
        watchdog.cancel()
        os.close(read_end)
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = "".join(stderr)
    assert process.returncode == 130, stderr
    assert stderr.splitlines()[-1] == "edgespec: interrupted" and stderr.count("edgespec: interrupted") == 1, stderr
    assert "Traceback" not in stderr and "stop: " not in stderr  # no summary: the run did not end by itself
    assert b"".join(written)


def test_the_command_line_loads_llama_cpp_before_numpy():
    # On an H200's CUDA image, numpy's libraries loaded first made llama.cpp's model loader segfault
    # (docs/benchmarks.md, "A GPU check"): every command, as `--help` does, starts the backend first.
    script = (
        "import ctypes, sys\n"
        "numpy_first = []\n"
        "load = ctypes.CDLL.__init__\n"
        "def recording(self, name, *args, **kwargs):\n"
        "    if name and 'llama' in str(name) and not numpy_first:\n"
        "        numpy_first.append('numpy' in sys.modules)\n"
        "    load(self, name, *args, **kwargs)\n"
        "ctypes.CDLL.__init__ = recording\n"
        "sys.argv = ['edgespec', '--help']\n"
        "from edgespec.commands import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(numpy_first, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "[False]", done.stderr


@pytest.mark.parametrize("command", ["run", "chat", "batch", "serve", "plan", "bench", "heads train"])
def test_a_flag_written_short_is_refused_by_its_command_naming_the_flag_it_begins(command, tmp_path, capsys,
                                                                                  monkeypatch):
    # argparse took a flag's first letters for the flag: `--mode bogus` ran with --model bogus without a word
    import tui.run

    monkeypatch.setattr(tui.run, "run_chat", lambda *args, **kwargs: pytest.fail("the short flag went through"))
    (tmp_path / "in.jsonl").write_text(BATCH_LINE)
    argv = command_line(command, "--max-tok", "5", tmp_path)
    if command in ("chat", "plan", "heads train"):  # no --max-tokens there; --model, which every command has
        argv[-2:] = ["--mode", "other"]
    code, err = exit_code_and_error(argv, capsys)
    lines = err.strip().splitlines()
    meant = "--model" if command in ("chat", "plan", "heads train") else "--max-tokens"
    assert code == 2 and len(lines) == 1, err
    assert f"edgespec {command}: unrecognized arguments: {argv[-2]}" in lines[0], err
    assert f"did you mean {meant}?" in lines[0] and f"see edgespec {command} --help" in lines[0], err


def test_an_unknown_flag_is_answered_with_the_nearest_spelling_when_none_begins_with_it(capsys):
    code, err = exit_code_and_error(["serve", "--prot", "8000"], capsys)
    assert code == 2 and "unrecognized arguments: --prot 8000; did you mean --port?" in err, err


def test_temp_is_llama_cpps_spelling_of_temperature_and_whole_flags_still_take_joined_values():
    assert build_parser().parse_args(["run", "--temp", "0.3", "hello"]).temperature == 0.3
    args = build_parser().parse_args(["run", "--max-tokens=3", "-t0", "-mtiny", "--", "--mode"])
    assert (args.max_tokens, args.temperature, args.model, args.prompt) == (3, 0.0, "tiny", "--mode")


def test_a_flag_typed_as_the_last_word_of_another_is_suggested_beside_the_flags_it_begins(capsys):
    # `--k` begins --kv-type, but the user as likely meant --top-k
    code, err = exit_code_and_error(["run", "hello", "--k", "4"], capsys)
    assert code == 2 and "unrecognized arguments: --k 4; did you mean --kv-type or --top-k?" in err, err


@pytest.mark.parametrize("argv, told", [
    # argparse read the prompt as -h with "i there", and named nothing of the way around
    (["run", "-hi there"], 'goes after --, e.g. edgespec run -- "-hi there"'),
    # a flag after -- is text: "did you mean --max-tokens?" named the flag that was written
    (["run", "--", "-hi", "--max-tokens", "2"], "--max-tokens after -- is text, not a flag"),
])
def test_a_prompt_that_starts_with_a_dash_is_told_about_double_dash(argv, told, capsys):
    code, err = exit_code_and_error(argv, capsys)
    assert code == 2 and told in err and len(err.strip().splitlines()) == 1, err


def test_chat_s_help_gives_the_defaults_its_flags_fall_back_to(capsys):
    # chat's flags default to None (config.toml's settings then), which its help showed as "(default: None)"
    from tui.settings import ChatConfig

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "default: None" not in shown
    assert f"0 means greedy (default: config.toml's, else {ChatConfig().temperature})" in shown
