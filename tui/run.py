"""`edgespec chat`'s process: the app run with its config, history and thread count, and its exit code."""

from __future__ import annotations

import os
import sys
import threading
import time

from tui.app import ChatApp
from tui.config import check_settings_go_together, load_config
from tui.engine_host import default_chat_threads
from tui.history import ChatStore
from tui.paste import guard_terminal_pastes
from tui.settings import FLAG_SETTINGS

# How long a shutdown may take after a stop signal, once what was written is saved: Textual's own takes
# well under a second.
HUNG_SHUTDOWN_SECONDS = 10.0


def run_chat(args=None, **overrides) -> int:
    """Run the chat app; returns the exit code.

    `args` is an argparse namespace (or None), `overrides` keyword arguments;
    both may give model, draft, draft_tokens, n_ctx, gpu_layers,
    draft_gpu_layers, memory_budget, bit_exact, kv_type, draft_kv_type,
    flash_attn, temperature, top_p, top_k, min_p,
    max_tokens, system and threads.  A value of None leaves the setting to
    config.toml (threads: to default_chat_threads).  Raises EdgespecError for a bad config file or
    history database.
    """
    values = dict(vars(args)) if args is not None else {}
    values.update(overrides)
    config = load_config().with_overrides(
        system_prompt=values.get("system"), **{name: values.get(name) for name in FLAG_SETTINGS})
    check_settings_go_together(config)
    store = ChatStore()
    threads = values.get("threads")
    app = ChatApp(config, store, n_threads=default_chat_threads() if threads is None else threads)
    guard_terminal_pastes()
    ended = threading.Event()
    threading.Thread(target=_end_a_hung_shutdown, args=(app, ended), name="chat-exit-guard", daemon=True).start()
    try:
        app.run()
    finally:
        ended.set()
        # what the history says from here on (a last save that cannot be written) has no chat to show it in
        store.on_notice = lambda text: print(f"edgespec: {text}", file=sys.stderr)
        app.close_engine()
        store.close()
    return 128 + app.stop_signal if app.stop_signal else app.return_code or 0


def _end_a_hung_shutdown(app: ChatApp, ended: threading.Event) -> None:
    """End the process if the app has not ended HUNG_SHUTDOWN_SECONDS after a stop signal's save.

    Closing the terminal mid-reply (tmux kill-session) hung Textual's shutdown for good in 3 of 11 tries: its
    main thread waited on a full output queue that the writer thread, writing to the closed terminal, never
    emptied.  What was written is saved before that shutdown (ChatApp.keep_what_was_written), so nothing is
    lost by not waiting for it.
    """
    while not ended.wait(0.2):
        if app.stop_signal and app.kept_at is not None and time.monotonic() - app.kept_at > HUNG_SHUTDOWN_SECONDS:
            os._exit(128 + app.stop_signal)
