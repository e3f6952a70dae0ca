"""`edgespec chat`: the terminal chat app (tui/)."""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError

from .options import add_engine_options, add_sampling_options


def add_chat_parser(subparsers) -> None:
    from tui.settings import FLAG_SETTINGS, ChatConfig

    parser = subparsers.add_parser("chat", help="the terminal chat app")
    # flags the user leaves out fall back to config.toml, and its settings left out to the app's own defaults
    defaults = {name: value for name, value in vars(ChatConfig()).items() if value is not None}
    add_engine_options(parser, config=("config.toml", defaults))
    add_sampling_options(parser, max_tokens=defaults["max_tokens"], per_request=False, config=("config.toml", defaults))
    parser.set_defaults(func=chat, **{name: None for name in FLAG_SETTINGS})


def chat(args: argparse.Namespace) -> int:
    from tui.run import run_chat

    # The app draws a full screen and reads keys: on a pipe or a file it wrote escape codes into the
    # output and, reading no keys, never ended.
    if not all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stdout)):
        raise UsageError("edgespec chat needs a terminal for its input and output, not a pipe or a file; "
                         "to answer a prompt from a pipe, use `edgespec run -`")
    if not (sys.__stderr__ is not None and sys.__stderr__.isatty()):
        # Textual draws on stderr: redirected, the screen went into the file and the keys were read blind;
        # closed, the app hung for good.  Said on the terminal, where this command has no results to keep apart.
        print("edgespec: edgespec chat draws its screen on stderr, which is redirected or closed; run it without "
              "2> (its notices are in the chat)", file=sys.stdout)
        return 2

    return run_chat(args)
