"""The chat app in a real terminal: `edgespec chat` on SmolLM2-135M under tmux."""

from __future__ import annotations

import re
import shlex
import shutil
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


def _smollm2() -> Path:
    try:
        return resolve_model("smollm2-135m-instruct", pull=False)
    except EdgespecError as error:
        pytest.skip(f"SmolLM2-135M is not downloaded ({error})")


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                          capture_output=True, text=True, check=True).stdout


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
    session = f"edgespec-test-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{name}={shlex.quote(str(tmp_path / name.lower()))}"
                   for name in ("EDGESPEC_DATA_DIR", "EDGESPEC_CONFIG_DIR", "EDGESPEC_CACHE_DIR"))
    # pytest exports COLUMNS and LINES, which would override the pane's real size.
    command = (f"unset COLUMNS LINES; {env} {shlex.quote(str(EDGESPEC))} chat --model {shlex.quote(str(model))} --draft ngram "
               f"--draft-tokens 4 --temperature 0 --max-tokens 80; echo EXITED $?; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command], check=True)
    try:
        _wait_for(session, r"ctx 0/", timeout=60)  # the stats bar appears once the model is loaded
        prompt = "Write a Python function that reverses a string."
        subprocess.run(["tmux", "send-keys", "-t", session, prompt, "Enter"], check=True)
        screen = _wait_for(session, FOOTER, timeout=120)
        assert prompt in screen
        assert "def reverse_string(input_str):" in screen, screen
        assert "```" not in screen, "the code block is rendered, not shown as Markdown source"
        assert re.search(r"n-gram\s+smollm2-135m-instruct", screen)
        assert re.search(r"[\d.]+ tok/s\s+│\s+accept", screen), "the stats bar shows the reply's numbers"
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        _wait_for(session, r"EXITED 0", timeout=30)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
