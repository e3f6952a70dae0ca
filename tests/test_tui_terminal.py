"""The chat app in a real terminal: `edgespec chat` on SmolLM2-135M under tmux.

What the model writes depends on the CPU's kernels, so the reply is checked against
`edgespec run` on the same machine: at T = 0 with --bit-exact the chat's reply is plain
decoding's, and its first words must be on the screen.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from edgespec.errors import EdgespecError
from edgespec.fetch import resolve_model

EDGESPEC = Path(sys.executable).with_name("edgespec")
FOOTER = re.compile(r"\d+ tokens · [\d.]+ tok/s")
DIRS = ("EDGESPEC_DATA_DIR", "EDGESPEC_CONFIG_DIR", "EDGESPEC_CACHE_DIR")


def _smollm2() -> Path:
    try:
        return resolve_model("smollm2-135m-instruct", pull=False)
    except EdgespecError as error:
        pytest.skip(f"SmolLM2-135M is not downloaded ({error})")


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                          capture_output=True, text=True, check=True).stdout


def _plain_reply(model: Path, prompt: str, env: dict) -> str:
    """What plain decoding answers to prompt at T = 0, here, with the kernels of the chat's --bit-exact (no flash
    attention: with it, the reply parted from the chat's after about 20 tokens on this test's machine)."""
    done = subprocess.run([str(EDGESPEC), "run", "--model", str(model), "--draft", "none", "--bit-exact", "--threads", "1",
                           "--temperature", "0", "--max-tokens", "80", "--json", prompt], capture_output=True,
                          text=True, timeout=600, env=env, check=True)
    return json.loads(done.stdout)["text"]


def _wait_for(session: str, pattern: re.Pattern | str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = _screen(session)
        if re.search(pattern, screen):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"{pattern!r} did not appear; the screen shows:\n{screen}")
        time.sleep(0.25)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
@pytest.mark.skipif(not EDGESPEC.exists(), reason="the edgespec console script is not installed")
def test_edgespec_chat_answers_in_a_real_terminal(tmp_path):
    model = _smollm2()
    prompt = "Write a Python function that reverses a string."
    # first, so that the two never share the CPU; the chat then reuses the speed measurement it made
    plain = _plain_reply(model, prompt, {**os.environ, **{name: str(tmp_path / name.lower()) for name in DIRS}})
    session = f"edgespec-test-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{name}={shlex.quote(str(tmp_path / name.lower()))}" for name in DIRS)
    # pytest exports COLUMNS and LINES, which would override the pane's real size.
    command = (f"unset COLUMNS LINES; {env} {shlex.quote(str(EDGESPEC))} chat --model {shlex.quote(str(model))} --draft ngram "
               f"--draft-tokens 4 --bit-exact --threads 1 --temperature 0 --max-tokens 80; echo EXITED $?; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True)
    try:
        _wait_for(session, r"ctx 0/", timeout=60)  # the stats bar appears once the model is loaded
        subprocess.run(["tmux", "send-keys", "-t", session, prompt, "Enter"], check=True)
        screen = _wait_for(session, FOOTER, timeout=120)
        assert prompt in screen
        first_words = re.findall(r"\w+", plain)[:6]
        assert first_words and re.search(r"\W+".join(first_words), screen), (first_words, screen)
        if "```" in plain:
            assert "```" not in screen, "the code block is rendered, not shown as Markdown source"
        assert re.search(r"n-gram\s+smollm2-135m-instruct", screen)
        assert re.search(r"[\d.]+ tok/s\s+│\s+accept", screen), "the stats bar shows the reply's numbers"
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        _wait_for(session, r"EXITED 0", timeout=30)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
@pytest.mark.skipif(not EDGESPEC.exists(), reason="the edgespec console script is not installed")
def test_edgespec_chat_ended_by_sigterm_exits_with_143_as_a_killed_process_does(tmp_path):
    # A script or a service manager reads the exit code to tell a stop from a quit.
    model = _smollm2()
    session = f"edgespec-test-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{name}={shlex.quote(str(tmp_path / name.lower()))}" for name in DIRS)
    pid_file = tmp_path / "pid"
    chat = (f"{env} exec {shlex.quote(str(EDGESPEC))} chat --model {shlex.quote(str(model))} --draft ngram "
            f"--threads 1 --max-tokens 8")
    command = (f"unset COLUMNS LINES; sh -c {shlex.quote(f'echo $$ > {shlex.quote(str(pid_file))}; {chat}')}; "
               f"echo EXITED $?; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True)
    try:
        _wait_for(session, r"ctx 0/", timeout=60)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        _wait_for(session, r"EXITED 143", timeout=30)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
