"""The command line as a careless or hostile user meets it: each misuse is one line on stderr naming the problem
and the fix, never a hang, a traceback or a half-made result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EDGESPEC = [sys.executable, "-m", "edgespec"]


@pytest.fixture
def own_dirs(tmp_path, monkeypatch):
    """Config, history, cache and models of this test's own, so nothing here touches the user's."""
    for variable in ("EDGESPEC_CONFIG_DIR", "EDGESPEC_DATA_DIR", "EDGESPEC_CACHE_DIR", "EDGESPEC_MODELS_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    return tmp_path


def test_chat_without_a_terminal_says_so_instead_of_drawing_into_a_pipe(own_dirs):
    # `echo hi | edgespec chat` started the full-screen app on a pipe: it drew escape codes into stdout and
    # never ended (the guard below is for a hang, not a timing)
    done = subprocess.run([*EDGESPEC, "chat"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, env=os.environ)
    assert done.returncode == 2 and done.stdout == "", done.stdout[-300:]
    assert done.stderr.count("\n") == 1 and "terminal" in done.stderr and "edgespec run -" in done.stderr
