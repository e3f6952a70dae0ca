"""The `edgespec` command line: run, chat, batch, serve, bench, plan, models; one module per command.

`main` is the one place a user error becomes an exit code: an EdgespecError
prints "edgespec: <message>" on stderr, the settings it names worded as
flags, and exits with the error's exit_code (1 unless its class says
otherwise, e.g. a refused batch exits 2); Ctrl-C exits 130. Usage errors exit 2 on every command: argparse's own, a bad value
the flags' types refuse, and a UsageError (flags that cannot go together).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import EdgespecError, as_flag


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument gets one line, not the usage text and then the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        from .options import joined_negative_sizes

        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(joined_negative_sizes(args), namespace)


def build_parser() -> argparse.ArgumentParser:
    from .batch import add_batch_parser
    from .bench import add_bench_parser
    from .chat import add_chat_parser
    from .heads import add_heads_parser
    from .models import add_models_parser
    from .plan import add_plan_parser
    from .run import add_run_parser
    from .serve import add_serve_parser

    parser = _Parser(prog="edgespec", description="Exact speculative decoding for local GGUF models.")
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_run_parser(subparsers)
    add_chat_parser(subparsers)
    add_batch_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_plan_parser(subparsers)
    add_models_parser(subparsers)
    add_heads_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        # building the parser imports every command (numpy, the engine): Ctrl+C may come that early
        args = build_parser().parse_args(argv)
        return args.func(args)
    except EdgespecError as error:
        print(f"edgespec: {error.worded(as_flag)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`edgespec run ... | head`): stop quietly, and keep
        # Python from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as error:  # a file or stream edgespec was given cannot be read or written
        problem = error.strerror or str(error)
        print(f"edgespec: {error.filename}: {problem}" if error.filename else f"edgespec: {problem}", file=sys.stderr)
        return 1
