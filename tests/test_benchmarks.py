"""Every script in benchmarks/ still runs: it parses its arguments (--help), or its shell syntax checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_each_python_benchmark_answers_help(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.sh")), ids=lambda path: path.name)
def test_each_shell_benchmark_parses(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
