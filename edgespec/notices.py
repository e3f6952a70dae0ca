"""One-line notices to the user: what edgespec decided or does on its own (a download, a measurement, a fallback).

They go to stderr, so `--json` output on stdout stays one clean object.
"""

from __future__ import annotations

import sys


def print_notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
