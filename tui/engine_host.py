"""Loading models and re-measuring their speed, on worker threads, for the chat app.

Neither may block the screen: loading takes seconds (the first time also a
speed measurement, whose notice shows while it runs), and a stale cost curve
is measured again between replies.  The host runs both as Textual thread
workers of the app and reports through messages posted to it: Status (what
loading is doing now), Loaded or LoadFailed, and Measuring (a re-measurement
started or ended).

The chat's default llama.cpp thread count is chosen here too
(`default_chat_threads`): on a small machine the app itself needs a core.
"""

from __future__ import annotations

import os
import threading
import traceback

from textual.app import App
from textual.message import Message

from edgespec import EdgespecError, Engine
from edgespec.errors import as_flag, flag_worded
from edgespec.catalog import default_pair
from edgespec.loading import load_engine, use_learning, use_prompt_cache
from tui.config import ChatConfig

# Up to this many usable cores, the chat leaves one of them to the app (see default_chat_threads).
SMALL_MACHINE_CORES = 4


def default_chat_threads(cores: int | None = None) -> int | None:
    """llama.cpp threads for the chat when --threads is not given; None: the engine's default.

    ggml's threads spin while they wait for each other at every operation, so a
    thread that loses its core to another process stalls all of them.  The chat's
    own event loop (rendering, the stats bar) is such a process: on 2 cores with
    SmolLM2, plain decoding, `edgespec run` made 125 tok/s, the chat 32-50 with
    2 threads and 94 with 1.  So up to SMALL_MACHINE_CORES usable cores the chat
    uses one thread fewer than there are cores; above that, the engine's default.
    `benchmarks/chat_vs_run.py --threads 1,2,...` measures what this rule should say.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1) if cores <= SMALL_MACHINE_CORES else None


class EngineHost:
    """Loads engines and re-measures their speed on the app's worker threads."""

    class Status(Message):
        """A notice while loading (e.g. "measuring this model's speed"), shown as it happens."""

        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class Loaded(Message):
        def __init__(self, engine: Engine, notices: list[str]):
            super().__init__()
            self.engine, self.notices = engine, notices

    class LoadFailed(Message):
        def __init__(self, error: str, notices: list[str]):
            super().__init__()
            self.error, self.notices = error, notices

    class Measuring(Message):
        """A re-measurement of the engine's speed started (True) or ended (False)."""

        def __init__(self, active: bool):
            super().__init__()
            self.active = active

    def __init__(self, app: App, config: ChatConfig, *, n_threads: int | None = None,
                 cost_curve: tuple[float, ...] | None = None):
        """cost_curve fixes the engines' cost curve (see Engine.calibrate) instead of measuring it."""
        self.app = app
        self.config = config
        self.n_threads = n_threads
        self.cost_curve = cost_curve
        self._idle = threading.Event()  # cleared while an engine re-measures its speed
        self._idle.set()

    @property
    def measuring(self) -> bool:
        return not self._idle.is_set()

    def load(self, model: str, draft: str, *, draft_tokens: int | str, bit_exact: bool) -> None:
        """Load model (a catalog name or path; "" for the default) with draft, in the background."""
        self.app.run_worker(lambda: self._load_engine(model, draft, draft_tokens, bit_exact),
                            thread=True, exclusive=True, group="load")

    def _load_engine(self, model: str, draft: str, draft_tokens: int | str, bit_exact: bool) -> None:
        notices: list[str] = []  # what loading said (naming flags): shown as it happens, and kept once it ends

        def notice(text: str) -> None:
            text = flag_worded(text)
            notices.append(text)
            self.app.post_message(self.Status(text))

        self._idle.wait()  # the old engine may still be measuring; it is closed after this
        config = self.config
        try:
            # A stale speed measurement is re-measured after loading, between replies, not here.
            engine = load_engine(
                model or default_pair()[0], draft, pull=False, n_ctx=config.n_ctx,
                n_gpu_layers=config.gpu_layers, draft_gpu_layers=config.draft_gpu_layers,
                draft_tokens=draft_tokens, bit_exact=bit_exact, kv_type=config.kv_type,
                draft_kv_type=config.draft_kv_type, flash_attn=config.flash_attn, n_threads=self.n_threads,
                memory_budget=config.memory_budget, notice=notice, cost_curve=self.cost_curve,
                measure_stale_curve=False)
            # as run, batch and serve do: start from what this model's drafts did here before, add each
            # finished reply to it, and draft from the other chats' text too
            use_learning(engine, notice=notice)
            if config.prompt_cache:  # a reopened chat restores its history instead of prefilling it
                use_prompt_cache(engine, config.prompt_cache_size, notice, keep_every_prompt=True)
        except EdgespecError as error:
            self.app.post_message(self.LoadFailed(error.worded(as_flag), notices))
        except Exception as error:  # a bug must not end the app with a traceback
            self.app.log.error(traceback.format_exc())
            self.app.post_message(self.LoadFailed(f"loading failed: {type(error).__name__}: {error}", notices))
        else:
            self.app.post_message(self.Loaded(engine, notices))

    def recalibrate(self, engine: Engine) -> bool:
        """Re-measure a stale cost curve in the background; False when none is due or one runs already.

        The chat goes on with the old curve meanwhile; a reply sent during the few seconds it
        takes waits for it (Engine.recalibrate takes the engine's lock)."""
        if not engine.calibration_due or self.measuring:
            return False
        self._idle.clear()
        self.app.post_message(self.Measuring(True))
        self.app.run_worker(lambda: self._recalibrate(engine), thread=True, group="calibrate")
        return True

    def _recalibrate(self, engine: Engine) -> None:
        try:
            engine.recalibrate()
        except Exception:  # the old curve stays; a failed measurement must not end the app
            self.app.log.error(traceback.format_exc())
        finally:
            self._idle.set()
            self.app.post_message(self.Measuring(False))

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait for a re-measurement to end (before closing its engine)."""
        self._idle.wait(timeout)
