"""The `edgespec` command line: run, chat, batch, serve, bench, plan, models; one module per command.

`main` is the one place a user error becomes an exit code: an EdgespecError
prints "edgespec: <message>" on stderr, the settings it names worded as
flags, and exits with the error's exit_code (1 unless its class says
otherwise, e.g. a refused batch exits 2); Ctrl-C exits 130. Usage errors exit 2 on every command: argparse's own, a bad value
the flags' types refuse, and a UsageError (flags that cannot go together).
For the process's own command line, a Ctrl-C before the exit code is settled
exits 130 wherever it lands, and later ones change nothing (see main).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys

from .. import __version__
from ..control_chars import terminal_text
from ..errors import EdgespecError, as_flag

# Commands whose results go to files, clients or the screen, so that they run with stdout closed (`serve >&- &`):
# every other one prints its results on stdout, and with it closed print() dropped them without a word.
NO_RESULTS_ON_STDOUT = frozenset({"batch", "serve", "chat"})


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument gets one line, not the usage text and then the error, and a flag
    is written whole: argparse takes a flag's first letters for the flag, so `--mode X` ran with --model X
    and `--k 4` set the KV type, without a word."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.subcommands: tuple[str | None, dict[str, _Parser]] | None = None  # (dest, parser by name) of its commands

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        self.subcommands = (kwargs.get("dest"), action.choices)  # filled as each command's parser is added
        return action

    def error(self, message: str):
        if "ignored explicit argument" in message:  # `run "-hi there"`: the prompt read as -h with "i there"
            message += "; text that starts with - goes after --, e.g. edgespec run -- \"-hi there\""
        # argparse quotes the arguments it refuses: escape sequences in them are drawn, not obeyed
        self.exit(2, f"{self.prog}: {terminal_text(message)} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no flag takes are refused by the command they were given to, which
        names its own --help and the flag meant where one is close."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.command_parser(parsed).refuse_unknown(unknown)
        return parsed

    def command_parser(self, parsed: argparse.Namespace) -> "_Parser":
        """The parser of the innermost command parsed names ("heads train": train's)."""
        dest, parsers = self.subcommands or (None, {})
        chosen = parsers.get(getattr(parsed, dest, None)) if dest else None
        return chosen.command_parser(parsed) if chosen is not None else self

    def refuse_unknown(self, unknown: list[str]):
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", self.format_usage()))
        first_flag = next((arg.split("=")[0] for arg in unknown if arg.startswith("-")), "")
        # the flags a first few letters begin (what argparse took them for) or that end in the word typed
        # (`--k` for --top-k as well as --kv-type), else the nearest spelling
        word = first_flag[2:] if first_flag.startswith("--") else ""
        close = sorted(flag for flag in flags if word and (flag.startswith(first_flag) or flag.endswith("-" + word)))
        close = close or difflib.get_close_matches(first_flag, flags, n=1)
        meant = f"; did you mean {' or '.join(close)}?" if close else ""
        if first_flag in flags:  # a flag of this command, left over: it came after --, which makes it text
            meant = f"; {first_flag} after -- is text, not a flag: put the flags before --"
        self.error(f"unrecognized arguments: {' '.join(unknown)}{meant}")

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
    """The command argv (None: the process's own command line, as the edgespec script and `python -m
    edgespec` run it) and its exit code.

    For the process's own command line, a Ctrl-C while the command runs always ends in "edgespec:
    interrupted" and exit 130, with what the command wrote kept.  Left to Python, one that landed as the
    command ended escaped this function (a traceback), and one in Python's teardown, which restores
    SIGINT's default action partway, killed the process (exit -2, stdout's buffer unwritten): a second
    Ctrl-C landed there every time.  So the first Ctrl-C interrupts the command and later ones are
    ignored (batch and serve, which stop politely first, still see a second), and so is any once the exit
    code is settled.  A caller's own argv (tests, scripts) keeps its own Ctrl-C handling.
    """
    if argv is not None:
        return _run_command(argv)
    _hold_closed_standard_streams()
    _escape_what_the_streams_cannot_encode()
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        try:
            return _run_command(None)
        finally:
            # signal.signal first runs a handler already due: its KeyboardInterrupt is caught below
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:  # a Ctrl-C that landed as the command ended, outside its own handling
        print("edgespec: interrupted", file=sys.stderr)
        return 130


def _hold_closed_standard_streams() -> None:
    """Hold a standard stream the process was started without (`2>&-`) open on /dev/null.

    Else the next file opened takes that number, and what llama.cpp writes to the stream lands in it; and
    with no stderr, print(file=sys.stderr) prints on stdout, so notices and errors were mixed into the
    results (`plan --json 2>&-` printed a notice above its JSON).  A closed stdout stays None to Python,
    for the commands that print results there to refuse it (_run_command).
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one, or a lower one also closed
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")


def _escape_what_the_streams_cannot_encode() -> None:
    """Under a locale whose encoding is not UTF-8 (LC_ALL=en_US.ISO-8859-1, PYTHONIOENCODING=ascii), an emoji in a
    reply or a path ended the command in a UnicodeEncodeError halfway through its output: such a character is
    written as its escape (\\U0001f600) instead, as Python writes it on stderr anyway."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _one_line(message: str) -> str:
    """An error's message as the one line edgespec prints for it (terminal_text, newlines drawn too)."""
    return terminal_text(message).replace("\n", "\u2424")


def _interrupt_once(signum, frame) -> None:
    """SIGINT's handler while the process's own command runs: a KeyboardInterrupt, as Python's own handler
    raises, once; a second Ctrl-C would only cut short the cleanup and the message on the way out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _run_command(argv: list[str] | None) -> int:
    try:
        # llama.cpp's libraries before numpy's: on an H200's CUDA image, numpy loaded first made llama.cpp's
        # model loader segfault (plain llama-cpp-python too), and every command needs the backend anyway
        from .. import backend  # noqa: F401

        # building the parser imports every command (numpy, the engine): Ctrl+C may come that early
        args = build_parser().parse_args(argv)
        if sys.stdout is None and args.command not in NO_RESULTS_ON_STDOUT:  # started with fd 1 closed
            raise EdgespecError(f"stdout is closed, and edgespec {args.command} prints its results there; "
                                "send them somewhere, e.g. > /dev/null to drop them")
        return args.func(args)
    except EdgespecError as error:
        # A message may quote what the user gave (a path, a name): escape sequences in it are drawn, not obeyed,
        # and a newline in a file name does not split the one line
        print(f"edgespec: {_one_line(error.worded(as_flag))}", file=sys.stderr)
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
        line = f"{error.filename}: {problem}" if error.filename else problem
        print(f"edgespec: {_one_line(line)}", file=sys.stderr)
        return 1
