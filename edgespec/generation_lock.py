"""Who may use an engine's models now: one generation at a time, and nobody once they are freed.

A stream holds the lock from its first step until it ends or is closed,
including while it is suspended between steps in the caller's loop.  Another
thread that asks for it waits its turn.  The holding thread itself asking for
it is a program that started a second generation while a stream of its own
is still open (two generators advanced alternately, or one kept after a
`break`): a plain lock would wait for itself forever, so this refuses it.

Once the models are freed, every use raises: llama.cpp would read freed
memory, and abort the process.
"""

from __future__ import annotations

import threading
from typing import Callable

from .errors import EdgespecError

SECOND_STREAM = ("this thread still holds an unfinished stream of this engine (a generator neither run to its end "
                 "nor closed, such as one a caught exception's traceback keeps alive), which has the engine's models "
                 "until it ends: finish that stream or call its close() first, or iterate it in "
                 "`with contextlib.closing(engine.stream(...))` (or load a second engine to run two generations at once)")
CLOSED = "this engine is closed (its models were freed); load the model again with edgespec.load to generate"


class GenerationLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # the holding thread itself, not its ident: Python gives an ended thread's ident to the next thread
        # made, which was then refused as if it held the stream the ended one left
        self._holder: threading.Thread | None = None
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise EdgespecError(CLOSED)

    def close(self, free: Callable[[], None]) -> None:
        """Run free (the models') once.  A generation running in another thread finishes first; a stream
        this thread holds is suspended between steps, so it is not waited for (it would wait for itself):
        it raises when resumed."""
        if self._holder is threading.current_thread():
            self._free_once(free)
        else:
            with self._lock:
                self._free_once(free)

    def _free_once(self, free: Callable[[], None]) -> None:
        if not self.closed:
            self.closed = True
            free()

    def __enter__(self) -> GenerationLock:
        if self._holder is threading.current_thread():
            raise EdgespecError(SECOND_STREAM)
        self._lock.acquire()
        self._holder = threading.current_thread()
        if self.closed:  # closed by another thread while this one waited
            self.__exit__()
            raise EdgespecError(CLOSED)
        return self

    def __exit__(self, *exc_info) -> None:
        self._holder = None
        self._lock.release()
