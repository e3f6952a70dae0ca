"""`edgespec run`: generate a reply to one prompt, streaming it to stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import EdgespecError
from ..stats import Stats
from .options import add_engine_options, add_sampling_options, engine_from_args, sampling_params


def add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="generate a reply to one prompt, streaming it to stdout")
    parser.add_argument("prompt", help="the prompt, or - to read it from stdin")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, stats} instead of streaming")
    add_engine_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine import Done

    prompt = read_prompt(args.prompt)
    params = sampling_params(args)
    engine = engine_from_args(args)
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
        print(generation_summary_line(result.stats), file=sys.stderr)
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


def generation_summary_line(stats: Stats) -> str:
    """The one line `edgespec run` prints on stderr after the reply."""
    return (
        f"[{stats.mode}] {stats.tokens_generated} tokens, "
        f"{stats.decode_tokens_per_second:.1f} tok/s decode, "
        f"acceptance {stats.acceptance_rate:.0%} ({stats.draft_tokens_accepted}/{stats.draft_tokens_proposed}), "
        f"{stats.target_passes_per_token:.2f} target passes/token, "
        f"prefill {stats.prefill_seconds:.2f}s, stop: {stats.finish_reason}"
    )
