"""The `edgespec` command line: run, chat, batch, bench, plan, models."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .errors import EdgespecError
from .limits import MIN_N_CTX, SettingError, checked_setting, checked_threads
from .stats import Stats

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Model and drafting flags shared by every command that loads models."""
    group = parser.add_argument_group("models")
    group.add_argument("--model", "-m", default=DEFAULT_MODEL, help="target GGUF: a path or a catalog name (default: %(default)s)")
    group.add_argument("--draft", default="auto", help="draft GGUF path or catalog name, 'ngram', 'none', or 'auto' (default: the catalog draft if it fits, else ngram)")
    group.add_argument("--draft-tokens", type=_setting("draft_tokens"), default="auto", help="tokens drafted per step: 0 to 32, or 'auto' to follow measured costs (default)")
    group.add_argument("--n-ctx", type=_setting("n_ctx"), default=4096, help=f"context window in tokens, from {MIN_N_CTX}; llama.cpp rounds it up to a multiple of 256 (default: %(default)s)")
    group.add_argument("--gpu-layers", type=_setting("gpu_layers"), default=None, help="target layers to offload (-1: all; default: from the memory plan)")
    group.add_argument("--draft-gpu-layers", type=_setting("draft_gpu_layers"), default=None, help="draft layers to offload (-1: all; default: from the memory plan)")
    group.add_argument("--memory-budget", default=None, help="memory to plan for, e.g. 6GiB (default: detected)")
    group.add_argument("--threads", type=_threads, default=None, help="CPU threads, at most the cores here (default: all cores, up to 8)")


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", "-t", type=float, default=0.8, help="0 means greedy (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=40, help="0 switches it off (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=0.95, help="1.0 switches it off (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.05, help="0.0 switches it off (default: %(default)s)")
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _setting(name: str):
    """An argparse type for the engine setting `name`, refusing what edgespec.limits does."""

    def parse(text: str):
        try:
            return checked_setting(name, text if text == "auto" else int(text))
        except ValueError:
            wanted = "a whole number or 'auto'" if name == "draft_tokens" else "a whole number"
            raise argparse.ArgumentTypeError(f"expected {wanted}, not {text!r}") from None
        except SettingError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _threads(text: str) -> int:
    try:
        return checked_threads(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    except SettingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
        )
    except ValueError as error:
        raise EdgespecError(f"bad sampling setting: {error}") from None


def load_engine(args: argparse.Namespace, notice=None):
    """The Engine the flags of add_engine_options describe."""
    from .engine import Engine

    extra = {"notice": notice} if notice is not None else {}
    return Engine.load(
        args.model, args.draft, n_ctx=args.n_ctx, n_gpu_layers=args.gpu_layers,
        draft_gpu_layers=args.draft_gpu_layers, draft_tokens=args.draft_tokens,
        n_threads=args.threads, memory_budget=args.memory_budget, **extra,
    )


# -- edgespec run -----------------------------------------------------------------


def _add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="generate a reply to one prompt, streaming it to stdout")
    parser.add_argument("prompt", help="the prompt, or - to read it from stdin")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, stats} instead of streaming")
    add_engine_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .engine import Done

    prompt = read_prompt(args.prompt)
    params = sampling_params(args)
    engine = load_engine(args)
    result = None
    try:
        for event in engine.stream(prompt, params, raw=args.raw):
            if isinstance(event, Done):
                result = event.result
            elif not args.json:
                sys.stdout.write("".join(token.text for token in event.tokens))
                sys.stdout.flush()
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
    else:
        print(flush=True)
        print(summary_line(result.stats), file=sys.stderr)
    return 0


def read_prompt(source: str) -> str:
    """The prompt given on the command line, or read from stdin for "-", checked to be UTF-8."""
    if source != "-":
        # Python keeps bytes of the arguments that are not UTF-8 as lone surrogates; get them back.
        return utf8_text(os.fsencode(source), "the prompt")
    if sys.stdin is None:
        raise EdgespecError("stdin is closed; pipe the prompt in, or give it as an argument instead of -")
    try:
        data = sys.stdin.buffer.read()
    except OSError as error:
        raise EdgespecError(f"cannot read the prompt from stdin: {error.strerror or error}") from None
    return utf8_text(data, "stdin")


def utf8_text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        hint = " (it starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise EdgespecError(
            f"{where} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} is not valid "
            f"UTF-8{hint}; convert it first, e.g. with iconv -t UTF-8"
        ) from None


def summary_line(stats: Stats) -> str:
    return (
        f"[{stats.mode}] {stats.tokens_generated} tokens, "
        f"{stats.decode_tokens_per_second:.1f} tok/s decode, "
        f"acceptance {stats.acceptance_rate:.0%} ({stats.draft_tokens_accepted}/{stats.draft_tokens_proposed}), "
        f"{stats.target_passes_per_token:.2f} target passes/token, "
        f"prefill {stats.prefill_seconds:.2f}s, stop: {stats.finish_reason}"
    )


# -- edgespec plan ----------------------------------------------------------------


def _add_plan_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="show how the models would be placed in memory, and which drafting mode")
    add_engine_options(parser)
    parser.add_argument("--ctx", dest="n_ctx", type=_setting("n_ctx"), help="alias of --n-ctx")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .engine import plan_load

    _, _, plan = plan_load(args.model, args.draft, n_ctx=args.n_ctx, n_gpu_layers=args.gpu_layers,
                           draft_gpu_layers=args.draft_gpu_layers, memory_budget=args.memory_budget)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        from .planner import format_plan_table

        Console().print(format_plan_table(plan))
    return 0


# -- edgespec chat ----------------------------------------------------------------


def _add_chat_parser(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="the terminal chat app")
    add_engine_options(parser)
    add_sampling_options(parser, max_tokens=1024)
    # flags the user leaves out fall back to config.toml, whose own defaults match the ones above
    parser.set_defaults(func=_chat, model=None, draft=None, draft_tokens=None, n_ctx=None, temperature=None,
                        top_k=None, top_p=None, min_p=None, max_tokens=None)


def _chat(args: argparse.Namespace) -> int:
    from tui.app import run_chat

    return run_chat(args)


# -- main -------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument gets one line, not the usage text and then the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .batch import add_batch_parser
    from .bench import add_bench_parser
    from .models_cli import add_models_parser
    from .serve import add_serve_parser

    parser = _Parser(prog="edgespec", description="Exact speculative decoding for local GGUF models.")
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run_parser(subparsers)
    _add_chat_parser(subparsers)
    add_batch_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    _add_plan_parser(subparsers)
    add_models_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgespecError as error:
        print(f"edgespec: {error}", file=sys.stderr)
        return 1
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


if __name__ == "__main__":
    sys.exit(main())
