"""SIGTERM as a Ctrl-C, for the commands whose long work keeps what it did when stopped (bench, heads train)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """kill, timeout and docker stop send SIGTERM, whose default ends the process at once, with nothing
    written: inside this block it raises KeyboardInterrupt, so the command stops as Ctrl-C stops it, keeping
    what it did.  A second SIGTERM is ignored, which would cut short the writing of it."""
    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
