"""One-line notices to the user: what edgespec decided or does on its own (a download, a measurement, a fallback).

Whoever loads models says where notices go, as a `notice` callable taking one line.  A notice that names
a setting is an errors.Wording, worded for its reader as errors are:
- library use (the default): the "edgespec" logger at INFO level, naming Python parameters
  (``draft='ngram'``); nothing is printed;
- the command line: stderr, naming flags (``--draft ngram``), so `--json` output on stdout stays one
  clean object.  The chat app shows them, and a server logs them for its operator, with flags too
  (errors.flag_worded).
"""

from __future__ import annotations

import logging
import sys

from .control_chars import terminal_text
from .errors import flag_worded

logger = logging.getLogger("edgespec")


def log_notice(message: str) -> None:
    """Library use: log the notice, its settings as Python parameters."""
    logger.info(message)


def print_notice(message: str) -> None:
    """The command line: print the notice on stderr, its settings as flags, and the control characters of a
    file name it quotes drawn as symbols."""
    print(terminal_text(flag_worded(message)), file=sys.stderr, flush=True)
