"""`edgespec chat`: the terminal chat app (tui/)."""

from __future__ import annotations

import argparse

from .options import add_engine_options, add_sampling_options


def add_chat_parser(subparsers) -> None:
    from tui.settings import FLAG_SETTINGS

    parser = subparsers.add_parser("chat", help="the terminal chat app")
    add_engine_options(parser)
    add_sampling_options(parser, max_tokens=1024, per_request=False)
    # flags the user leaves out fall back to config.toml, whose own defaults match the ones above
    parser.set_defaults(func=chat, **{name: None for name in FLAG_SETTINGS})


def chat(args: argparse.Namespace) -> int:
    from tui.app import run_chat

    return run_chat(args)
