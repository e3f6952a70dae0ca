"""How the chat app ends, and what it keeps: ChatApp's ending.

A mixin of ChatApp (tui/app.py), kept apart so the app module shows how a
reply runs and this one what an ending saves.  Ctrl+Q, a closed terminal
(SIGHUP) and `kill` (SIGTERM) end the app alike: the reply being written is
stopped and saved as it stands, and the message being typed is kept for the
next start.  AppEnding declares below what it uses of the app, and uses
nothing else of it (beside textual.App's call_next and action_quit).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from tui.chat import ChatController
from tui.conversation import Generation
from tui.engine_host import EngineHost
from tui.history import ChatStore
from tui.widgets import PromptInput

# What ends the app as Ctrl+Q does, so that the reply being written is kept: a closed terminal and `kill`
STOP_SIGNALS = tuple(name for name in ("SIGHUP", "SIGTERM") if hasattr(signal, name))  # neither on Windows
NO_SIGNALS_HERE = (NotImplementedError, RuntimeError, ValueError)  # a loop or thread that cannot take them
REPLY_STOP_SECONDS = 30.0  # the most a stopped reply is waited for (it ends within a step)


class AppEnding:
    # -- what the ending uses of ChatApp: its state
    store: ChatStore
    chat: ChatController  # the conversation: engine, session, settings
    host: EngineHost  # loads models on worker threads
    prompt_input: PromptInput
    generation: Generation | None  # the reply being generated, if one is
    stop_signal: int | None  # the STOP_SIGNALS number that ended the app, if one did
    kept_at: float | None  # when keep_what_was_written was done (time.monotonic)
    unsent_kept: bool  # the typed message is kept already (once: a second row would bring it back twice)

    def _exit_on_stop_signals(self) -> None:
        """STOP_SIGNALS end the app as Ctrl+Q does, stopping the reply being written and keeping it (close_engine
        saves it); by default they end the process, and a reply on screen with it, unsaved."""
        loop = asyncio.get_running_loop()
        for name in STOP_SIGNALS:
            with contextlib.suppress(*NO_SIGNALS_HERE):
                loop.add_signal_handler(getattr(signal, name), self._end_on_signal, getattr(signal, name))

    def _end_on_signal(self, number: int) -> None:
        self.stop_signal = number  # `edgespec chat` exits with 128 + number, as a process the signal ended would
        self.call_next(self.action_quit)

    def on_unmount(self) -> None:
        self._keep_unsent()  # however the app ends
        loop = asyncio.get_running_loop()
        for name in STOP_SIGNALS:
            with contextlib.suppress(*NO_SIGNALS_HERE):
                loop.remove_signal_handler(getattr(signal, name))

    async def keep_what_was_written(self) -> None:
        """Before the app ends: stop the reply being written and save it, and keep the message being written for
        the next start.  Done before Textual's shutdown, which after a closed terminal could hang for good
        writing to it (1 in 4 tries), and with it a save made after the app had ended."""
        if self.generation is not None and self.chat.session is not None:
            self.chat.stop_reply(self.generation.stream)
            await asyncio.to_thread(self.generation.stream.finished.wait, REPLY_STOP_SECONDS)
        self._save_stopped_reply()
        self._keep_unsent()
        self.kept_at = time.monotonic()

    def _save_stopped_reply(self) -> None:
        # The session holds the reply so far, as cancelled (or, stopped before its first word, the message
        # unanswered); the save its end would make in the app (on_conversation_view_ended) comes too late once
        # the app is ending.
        stream = self.generation.stream if self.generation is not None else None
        if stream is not None and stream.finished.is_set() and stream.result is not None:
            self.chat.save()

    def _keep_unsent(self) -> None:
        if self.unsent_kept:  # once: a second row would bring the message back twice
            return
        self.unsent_kept = True
        self.store.keep_unsent(self.prompt_input.text)  # a history that cannot be written says so

    def close_engine(self) -> None:
        """Stop a running reply, keeping what it wrote, and free the models (call after the app has exited)."""
        if self.generation is not None and self.chat.session is not None:
            self.chat.stop_reply(self.generation.stream)
            self.generation.stream.finished.wait(timeout=REPLY_STOP_SECONDS)
        self._save_stopped_reply()
        self.host.wait_idle(timeout=30)
        self.chat.close()
