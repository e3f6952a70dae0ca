"""The flags every model-loading command shares, what they turn into, and the one place commands load models."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Callable

from ..errors import EdgespecError, UsageError
from ..notices import print_notice
from ..limits import (KV_TYPES, MAX_DRAFT_TOKENS, MIN_N_CTX, SettingError, checked_flash_attn, checked_kv_type,
                      checked_setting, checked_threads)

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
# The flags whose value is a byte size (their type is _size_text or _size_or_zero), for joined_negative_sizes.
SIZE_FLAGS = frozenset({"--memory-budget", "--prompt-cache-size", "--prompt-cache-ram"})
_NEGATIVE_NUMBER_START = re.compile(r"-\.?\d")


def add_engine_options(parser: argparse.ArgumentParser, config: tuple[str, dict] | None = None) -> None:
    """Model and drafting flags shared by every command that loads models.  config: (a file whose settings the
    flags left out take, the defaults it falls back to by setting), which their help names (chat's config.toml)."""
    group = parser.add_argument_group("models")
    shown = _default_shown(config)
    group.add_argument("--model", "-m", type=model_text, default=DEFAULT_MODEL,
                       help=f"target GGUF: a path or a catalog name (default: {shown('model', DEFAULT_MODEL)})")
    group.add_argument("--draft", type=model_text, default="auto",
                       help="draft GGUF path or catalog name, 'ngram', 'heads' (trained with `edgespec heads train`), "
                            "'none', or 'auto' (default: the catalog draft if it fits, else ngram; with trained "
                            "heads, those too)")
    group.add_argument("--draft-tokens", type=setting("draft_tokens"), default="auto",
                       help=f"tokens drafted per step: 0 to {MAX_DRAFT_TOKENS}, or 'auto' to follow measured costs (default)")
    group.add_argument("--n-ctx", type=setting("n_ctx"), default=4096,
                       help=f"context window in tokens, from {MIN_N_CTX}; llama.cpp rounds it up to a multiple of 256 "
                            f"(default: {shown('n_ctx', 4096)})")
    group.add_argument("--gpu-layers", type=setting("gpu_layers"), default=None,
                       help="target layers to offload (-1: all; default: from the memory plan)")
    group.add_argument("--draft-gpu-layers", type=setting("draft_gpu_layers"), default=None,
                       help="draft layers to offload (-1: all; default: from the memory plan)")
    group.add_argument("--memory-budget", type=_size_text, default=None,
                       help="memory to plan for, e.g. 6GiB (default: detected)")
    group.add_argument("--threads", type=parse_threads, default=None,
                       help="CPU threads, at most the cores here (default: all cores, up to 8; "
                            "chat leaves one core to the app on 4 cores or fewer)")
    group.add_argument("--bit-exact", action="store_true",
                       help="verify only in passes llama.cpp computes bit-identically to one token at a time, so greedy "
                            "output is plain decoding's token for token (default: passes as wide as pay, exact in "
                            "distribution up to llama.cpp's rounding)")
    group.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                       help="neither restore nor save KV snapshots of long prompts in the cache dir (default: both, so "
                            "prompts sharing a long document or history prefill it once)")
    group.add_argument("--prompt-cache-size", type=_size_text, default=None,
                       help="disk space for prompt snapshots, e.g. 2GiB (default: EDGESPEC_PROMPT_CACHE_SIZE, else 2GiB)")
    add_kv_cache_options(group)


def _default_shown(config: tuple[str, dict] | None):
    """How a flag's help shows the default of a setting: the value, or the config file the flags left out take
    theirs from, and its own default (chat's parser sets every default to None, which its help showed as
    "default: None")."""
    if config is None:
        return lambda name, value: value
    file, defaults = config
    return lambda name, value: f"{file}'s, else {defaults.get(name, value)}"


def add_kv_cache_options(group) -> None:
    """--kv-type, --draft-kv-type and --flash-attn: what the KV caches hold, and what that trades away."""
    choices = "|".join(KV_TYPES)
    group.add_argument("--kv-type", type=parse_kv_type, default="f16",
                       help=f"the target's KV cache type, {choices} (default: f16); quantised, it takes less "
                            "memory, but only the keys are quantised without flash attention")
    group.add_argument("--draft-kv-type", type=parse_kv_type, default=None,
                       help=f"the draft model's KV cache type, {choices} (default: the --kv-type)")
    group.add_argument("--flash-attn", nargs="?", const="on", default="auto", type=parse_flash_attn,
                       metavar="auto|on|off",
                       help="flash attention, which llama.cpp's kernels run faster on most machines and which lets "
                            "the values be quantised too; a token's logits then depend on its pass's width, so "
                            "auto (the default) turns it on unless --bit-exact, and on cannot go with --bit-exact "
                            "(--flash-attn alone: on)")


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int | None = 256, per_request: bool = True,
                         config: tuple[str, dict] | None = None) -> None:
    """The sampling flags; per_request=False leaves out --seed and --stop, which only make sense for one
    reply or a batch of them (the chat app samples each reply afresh and stops at the end of a turn).
    max_tokens None: a reply runs until its end or a full context unless the flag is given.  config: as
    add_engine_options takes it."""
    group = parser.add_argument_group("sampling")
    shown = _default_shown(config)
    until = shown('max_tokens', max_tokens) if max_tokens is not None else "until the reply ends or the context is full"
    group.add_argument("--max-tokens", type=sampling_value("max_tokens", int), default=max_tokens,
                       help=f"the most tokens a reply may have (default: {until})")
    group.add_argument("--temperature", "--temp", "-t", type=sampling_value("temperature", float), default=0.8,
                       help=f"0 means greedy (default: {shown('temperature', 0.8)})")
    group.add_argument("--top-k", type=sampling_value("top_k", int), default=40,
                       help=f"0 switches it off (default: {shown('top_k', 40)})")
    group.add_argument("--top-p", type=sampling_value("top_p", float), default=0.95,
                       help=f"1.0 switches it off (default: {shown('top_p', 0.95)})")
    group.add_argument("--min-p", type=sampling_value("min_p", float), default=0.05,
                       help=f"0.0 switches it off (default: {shown('min_p', 0.05)})")
    if per_request:
        group.add_argument("--seed", type=sampling_value("seed", int), default=None)
        group.add_argument("--stop", action="append", default=[], type=_stop_text, help="stop string (repeatable)")


def _stop_text(text: str) -> str:
    """An argparse type for --stop: UTF-8 text, as a reply is.  Python keeps an argument's bytes that are not
    UTF-8 as lone surrogates, which no reply can hold: such a stop string was taken and never matched."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(f"byte 0x{ord(text[error.start]) - 0xDC00:02x} at offset {error.start} is "
                                         "not UTF-8; give the stop string as UTF-8 text") from None
    return text


def model_text(text: str) -> str:
    """An argparse type for --model and --draft: a path or a name, which an empty string is not (as a path it
    was ".", and the error named a directory nobody typed)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a GGUF path or a catalog name, not an empty string")
    return text


def file_path(text: str) -> Path:
    """An argparse type for a file's or a folder's path: an empty one is refused, where Path("") is "." and the
    command went on to name a directory nobody typed (or to read the current one)."""
    if not text:
        raise argparse.ArgumentTypeError("a path cannot be empty")
    return Path(text)


def setting(name: str):
    """An argparse type for the engine setting `name`, refusing what edgespec.limits does."""

    def parse(text: str):
        try:
            return checked_setting(name, text if text == "auto" else int(text))
        except SettingError as error:  # a ValueError too: first
            raise argparse.ArgumentTypeError(str(error)) from None
        except ValueError:
            wanted = "a whole number or 'auto'" if name == "draft_tokens" else "a whole number"
            raise argparse.ArgumentTypeError(f"expected {wanted}, not {text!r}") from None

    return parse


def sampling_value(name: str, kind: type):
    """An argparse type for the sampling flag of SamplingParams field `name`: a bad value is a usage
    error (exit 2) like any other bad flag, with SamplingParams' own message."""

    def parse(text: str):
        from ..sampling import SamplingParams

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, not {text!r}") from None
        try:
            SamplingParams(**{name: value})
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    return parse


def parse_kv_type(text: str) -> str:
    """An argparse type for --kv-type and its kin: one of edgespec.limits.KV_TYPES."""
    try:
        return checked_kv_type(text)
    except SettingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_flash_attn(text: str) -> str:
    """An argparse type for --flash-attn: one of edgespec.limits.FLASH_ATTN_CHOICES."""
    try:
        return checked_flash_attn(text)
    except SettingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_threads(text: str) -> int:
    """An argparse type for --threads: at most the cores edgespec may use here."""
    try:
        return checked_threads(int(text))
    except SettingError as error:  # a ValueError too: first
        raise argparse.ArgumentTypeError(str(error)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None


def add_prompt_cache_ram_option(group, default: str, help_text: str) -> None:
    """--prompt-cache-ram SIZE, in bytes (0 for none): the RAM for a server's recent prompt snapshots,
    which the memory plan counts."""
    group.add_argument("--prompt-cache-ram", type=_size_or_zero, default=default, metavar="SIZE", help=help_text)


def _size_or_zero(text: str) -> int:
    from ..units import parse_size

    return 0 if text.strip() == "0" else parse_size(_size_text(text))


def whole_number(low: int):
    """An argparse type for a count that must be at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def joined_negative_sizes(args: list[str]) -> list[str]:
    """args with each size flag joined to a negative value after it ("--memory-budget", "-5GiB" ->
    "--memory-budget=-5GiB").  argparse takes "-5GiB" for an unknown flag and answers only that
    --memory-budget "expected one argument"; joined, the value reaches the size check, which names the
    problem.  (argparse has no public way to let one option take a value that starts with "-".)"""
    joined, i = [], 0
    while i < len(args):
        if args[i] == "--":  # what follows is positional text, e.g. a prompt
            return joined + args[i:]
        if args[i] in SIZE_FLAGS and i + 1 < len(args) and _NEGATIVE_NUMBER_START.match(args[i + 1]):
            joined.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            joined.append(args[i])
            i += 1
    return joined


def _size_text(text: str) -> str:
    """A byte size as the user wrote it (the chat keeps it so in its config), once it is known to parse."""
    from ..units import InvalidSizeError, parse_size

    try:
        parse_size(text)
    except InvalidSizeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def sampling_params(args: argparse.Namespace):
    from ..sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
        )
    except ValueError as error:
        raise UsageError(f"bad sampling setting: {error}") from None


def refuse_engine_flags_that_cannot_go_together(args: argparse.Namespace) -> None:
    """UsageError, before anything loads, for cache flags no load could keep (--flash-attn on --bit-exact)."""
    from ..exactness import kv_cache_notice

    try:
        kv_cache_notice(args.kv_type, args.draft_kv_type or args.kv_type, args.flash_attn, args.bit_exact)
    except EdgespecError as error:
        raise UsageError(*error.message) from None


def engine_from_args(args: argparse.Namespace, notice: Callable[[str], None] = print_notice, **overrides):
    """The Engine the flags of add_engine_options describe; what loading and the prompt cache say goes to notice
    (by default printed on stderr, naming flags), and a download shows its progress.  overrides: load_engine's
    other keywords."""
    from ..loading import load_engine, use_learning, use_prompt_cache

    refuse_engine_flags_that_cannot_go_together(args)
    engine = load_engine(
        args.model, args.draft, n_ctx=args.n_ctx, n_gpu_layers=args.gpu_layers,
        draft_gpu_layers=args.draft_gpu_layers, draft_tokens=args.draft_tokens,
        n_threads=args.threads, memory_budget=args.memory_budget, bit_exact=args.bit_exact,
        kv_type=args.kv_type, draft_kv_type=args.draft_kv_type, flash_attn=args.flash_attn, notice=notice,
        progress=True, **overrides,
    )
    use_learning(engine, notice=notice)  # run, chat, batch and serve learn from, and add to, what came before
    if getattr(args, "prompt_cache", False):  # commands without the flag keep no snapshots
        use_prompt_cache(engine, args.prompt_cache_size, notice)
    return engine
