"""`edgespec run`: generate a reply to one prompt, streaming it to stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..control_chars import terminal_text
from ..errors import EdgespecError
from ..notices import print_notice
from ..prompts import MAX_PROMPT_BYTES_PER_TOKEN
from ..stats import MIN_REPLY_TOKENS, Stats, plausible_speedup
from ..units import format_size
from .options import add_engine_options, add_sampling_options, engine_from_args, sampling_params

STDIN_CHUNK_BYTES = 64 * 1024
# A stray NUL is a byte like any other to the tokenizer, and stays text; this many, and this big a
# share of what was read, is binary data or UTF-16/32 text.
BINARY_MIN_NULS = 8
BINARY_NUL_SHARE = 0.01


def add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="generate a reply to one prompt, streaming it to stdout")
    parser.add_argument("prompt", help="the prompt, or - to read it from stdin")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object {text, token_ids, stats} instead of streaming")
    add_engine_options(parser)
    add_sampling_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine import Done

    prompt = read_prompt(args.prompt, args.n_ctx)
    params = sampling_params(args)
    to_terminal = sys.stdout.isatty()
    line_open = False  # part of a reply's line is on the terminal

    def notice(message: str) -> None:
        nonlocal line_open
        if line_open:  # a notice at a reply's end (a prompt snapshot not saved) was drawn on its last line
            sys.stdout.write("\n")
            sys.stdout.flush()
            line_open = False
        print_notice(message)

    engine = engine_from_args(args, notice=notice)
    result = None
    # A reply is untrusted text: a terminal would obey the escape sequences a model copies from a
    # prompt (retitle the window, hide a line), so they are drawn there. A pipe gets the text as is.
    shown = terminal_text if to_terminal else str
    try:
        for event in engine.stream(prompt, params, raw=args.raw):
            if isinstance(event, Done):
                result = event.result
            if not args.json and event.text:
                sys.stdout.write(shown(event.text))
                sys.stdout.flush()
                line_open = to_terminal and not event.text.endswith("\n")
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
    else:
        print(flush=True)
        print(generation_summary_line(result.stats), file=sys.stderr)
    return 0


def read_prompt(source: str, n_ctx: int) -> str:
    """The prompt given on the command line, or read from stdin for "-", checked to be UTF-8 text that
    an n_ctx-token context could hold."""
    if source != "-":
        # Python keeps bytes of the arguments that are not UTF-8 as lone surrogates; get them back.
        return utf8_text(os.fsencode(source), "the prompt")
    if sys.stdin is None:
        raise EdgespecError("stdin is closed; pipe the prompt in, or give it as an argument instead of -")
    try:
        # reading stops where no context could hold more, instead of filling memory (1 MiB for 4096 tokens)
        data = read_text_bytes(sys.stdin.buffer, n_ctx * MAX_PROMPT_BYTES_PER_TOKEN, n_ctx)
    except OSError as error:
        raise EdgespecError(f"cannot read the prompt from stdin: {error.strerror or error}") from None
    return utf8_text(data, "stdin")


def read_text_bytes(stream, limit: int, n_ctx: int) -> bytes:
    """At most `limit` bytes of text from stream, read in chunks; EdgespecError as soon as there is
    more (an endless `yes |` or a huge file) or the bytes read so far look binary (`< /dev/zero`)."""
    chunks, size, nuls = [], 0, 0
    while chunk := stream.read(min(STDIN_CHUNK_BYTES, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        nuls += chunk.count(0)
        if nuls >= BINARY_MIN_NULS and nuls >= BINARY_NUL_SHARE * size:
            raise EdgespecError(
                f"stdin holds binary data, not text: {nuls} NUL bytes in its first {size} bytes; give a text "
                f"prompt (UTF-16 text: convert it first, e.g. with iconv -f UTF-16 -t UTF-8)")
        if size > limit:
            raise EdgespecError(
                f"the prompt on stdin is longer than {format_size(limit)}, more than a {n_ctx}-token context "
                f"can hold; shorten it, or raise --n-ctx")
    return b"".join(chunks)


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
    """The one line `edgespec run` prints on stderr after the reply (acceptance "-" where nothing was drafted,
    as in the chat app and batch's summary: 0% would read as every draft rejected)."""
    acceptance = (f"{stats.acceptance_rate:.0%} ({stats.draft_tokens_accepted}/{stats.draft_tokens_proposed})"
                  if stats.draft_tokens_proposed else "- (nothing drafted)")
    return (
        f"[{stats.mode}] {stats.tokens_generated} tokens, "
        f"{stats.decode_tokens_per_second:.1f} tok/s decode{_speedup(stats)}, "
        f"acceptance {acceptance}, "
        f"{stats.target_passes_per_token:.2f} target passes/token, "
        f"prefill {stats.prefill_seconds:.2f}s, stop: {stats.finish_reason}"
    )


def _speedup(stats: Stats) -> str:
    """Against the reply's own plain pace, as in its stats JSON and the chat footer, where it can be told."""
    if stats.mode == "none":
        return ""  # it is the pace
    if not stats.plain_step_seconds > 0:
        return " (speedup n/a: no plain pace with a given cost curve)"
    if stats.tokens_generated < MIN_REPLY_TOKENS:
        return " (speedup n/a: too few tokens to tell)"
    ratio = plausible_speedup(stats, 1.0 / stats.plain_step_seconds)
    if ratio is None:
        return " (speedup n/a: the plain pace measured does not fit this reply)"
    return f" ({ratio:.2f}x plain decoding, {stats.end_to_end_speedup:.2f}x end to end)"
