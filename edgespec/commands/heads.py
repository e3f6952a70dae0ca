"""`edgespec heads train|show`: drafting heads for a target, trained on this machine from text the user chooses.

Training data, in the order it is used: text files and folders named on the
command line; the user's own usage where they allow it (--history: the chat
app's saved chats; --batch FILE: batch input and output files); then built-in
prompts the target answers itself.  The server keeps no record of the
requests it answers: run them through `edgespec batch` to keep them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import shlex
import sys
import time
from pathlib import Path

from ..errors import EdgespecError, UsageError
from ..files import parse_json
from .options import DEFAULT_MODEL, file_path, model_text, parse_threads, setting, whole_number
from .stop_signals import sigterm_as_ctrl_c

MIN_MAX_TOKENS = 100  # the least --max-tokens taken

# Per sequence (prompts are answered 16 at a time): a prompt of up to 512 tokens and its reply fit, and
# text is labelled in windows of 1023 tokens.
TRAINING_N_CTX = 1024
MAX_TEXT_FILE_BYTES = 2 << 20  # bigger files are data, not text to learn from
MAX_MINUTES = 7 * 24 * 60
_SKIPPED_FOLDERS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".tox", "dist", "build"}


def add_heads_parser(subparsers) -> None:
    parser = subparsers.add_parser("heads", help="train drafting heads that read the target's own hidden state")
    commands = parser.add_subparsers(dest="heads_command", metavar="ACTION", required=True)
    train = commands.add_parser("train", help="train heads for a target model on this machine")
    train.add_argument("paths", nargs="*", type=file_path,
                       help="text files or folders to train on (your code, your documents)")
    train.add_argument("--model", "-m", type=model_text, default=DEFAULT_MODEL,
                       help="target GGUF: a path or a catalog name (default: %(default)s)")
    train.add_argument("--minutes", type=_positive_minutes, default=15.0,
                       help="wall time for the whole run (default: %(default)s)")
    train.add_argument("--history", action="store_true", help="also train on the chat app's saved chats")
    train.add_argument("--batch", action="append", default=[], type=file_path, metavar="FILE",
                       help="also train on a batch input or output file (repeatable)")
    train.add_argument("--no-builtin", dest="builtin", action="store_false",
                       help="leave out the built-in prompts the target answers itself")
    train.add_argument("--form", choices=("hydra", "medusa"), default="hydra",
                       help="hydra: each head also sees the token chosen before it (default); medusa: the hidden state only")
    train.add_argument("--n-heads", type=int, choices=range(1, 5), default=3, metavar="N",
                       help="heads, 1 to 4 (default: %(default)s)")
    train.add_argument("--vocab", type=whole_number(2), default=8192,
                       help="reduced vocabulary the heads rank (default: %(default)s)")
    train.add_argument("--max-tokens", type=whole_number(MIN_MAX_TOKENS), default=100_000,
                       help="training positions kept in memory (default: %(default)s)")
    train.add_argument("--output", type=file_path, default=None,
                       help="heads file (default: next to the calibration cache)")
    train.add_argument("--restart", action="store_true", help="discard what an interrupted run left and start afresh")
    train.add_argument("--gpu-layers", type=setting("gpu_layers"), default=None,
                       help="target layers to offload (-1: all; default: from the memory plan)")
    train.add_argument("--threads", type=parse_threads, default=None, help="CPU threads (default: all cores, up to 8)")
    train.set_defaults(func=train_command)
    show = commands.add_parser("show", help="what the heads file of a model says about itself")
    show.add_argument("--model", "-m", type=model_text, default=DEFAULT_MODEL)
    show.add_argument("--heads", type=file_path, default=None, help="heads file (default: the model's own)")
    show.set_defaults(func=show_command)


def _positive_minutes(text: str) -> float:
    """An argparse type: a wall time in minutes, above 0 (so a usage error, exit 2, names the flag)."""
    try:
        minutes = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, not {text!r}") from None
    if not 0 < minutes <= MAX_MINUTES:  # an endless one overflowed the progress line's countdown
        raise argparse.ArgumentTypeError(f"must be a number of minutes above 0 and at most {MAX_MINUTES} (a week), "
                                         f"not {text}")
    return minutes


def train_command(args: argparse.Namespace) -> int:
    from ..heads.store import default_heads_path
    from ..loading import plan_load
    from ..notices import print_notice

    if args.output is not None and args.output.is_dir():  # else found out when writing, after all the training
        raise UsageError(f"--output {args.output} is a directory; give a file path, e.g. {args.output / 'heads.npz'}")
    # else found out after the model loaded; not in the flags' types, where a positional path checked first
    # would hide a misspelt flag before it ("--mode other": "other does not exist")
    for where, given in [("paths", path) for path in args.paths] + [("--batch", path) for path in args.batch]:
        if not given.exists():
            raise UsageError(f"{where}: {given} does not exist")
    path, _, memory_plan, _ = plan_load(args.model, "none", n_ctx=TRAINING_N_CTX, n_gpu_layers=args.gpu_layers, pull=False,
                                 notice=print_notice)
    _check_max_tokens_fit(args.max_tokens, path, memory_plan)
    heads_path = args.output or default_heads_path(path)
    _check_writable(heads_path)
    if args.output is not None:  # refused before a lock file is made beside the user's file
        _heads_it_replaces(heads_path, named=True)
    with _the_only_training_of(heads_path):
        return _train(args, path, memory_plan, heads_path)


def _check_max_tokens_fit(max_tokens: int, path: Path, memory_plan) -> None:
    """UsageError now, not a process killed for memory after its labelling, when RAM cannot hold
    --max-tokens positions: each keeps the hidden state in float16, and joining the pieces copies them once."""
    from ..gguf_info import read_gguf_info
    from ..memory import ram_budget
    from ..units import format_size

    per_position = 2 * 2 * read_gguf_info(path).n_embd
    room = ram_budget().available_bytes - (memory_plan.total_bytes if memory_plan.device == "cpu" else 0)
    if max_tokens * per_position > room:
        fit = room // per_position
        fix = f"give --max-tokens {fit} or less" if fit >= MIN_MAX_TOKENS else "free some memory first"
        raise UsageError(f"--max-tokens {max_tokens} keeps {format_size(max_tokens * per_position)} of hidden states, "
                         f"and RAM has {format_size(max(room, 0))} free beside the model: {fix}")


def _train(args: argparse.Namespace, path: Path, memory_plan, heads_path: Path) -> int:
    """train_command's run once its flags are checked and no other training writes heads_path."""
    from ..backend.hidden import HiddenStateModel
    from ..heads.job import Budget, resume_path_for, train_heads
    from ..heads.projection import LmHead
    from ..heads.training import TrainingPlan

    earlier = _heads_it_replaces(heads_path, named=args.output is not None)
    if args.restart:
        resume_path_for(heads_path).unlink(missing_ok=True)
    elif resume_path_for(heads_path).exists():
        print(f"resuming the run that was stopped ({resume_path_for(heads_path)})", file=sys.stderr)
    model = HiddenStateModel(path, n_ctx=TRAINING_N_CTX, n_gpu_layers=memory_plan.target_gpu_layers,
                             n_threads=args.threads)
    copy = None
    try:
        copy = _copy_aside(heads_path) if earlier is not None else None
        sources = _sources(model, args)
        plan = TrainingPlan(form=args.form, n_heads=args.n_heads, vocab_size=args.vocab)
        budget = Budget(seconds=args.minutes * 60.0, max_tokens=args.max_tokens)
        progress = ProgressLine()
        with sigterm_as_ctrl_c():
            record = train_heads(model, LmHead(path), sources, plan, budget, heads_path, progress)
        progress.done()
    except BaseException:
        if copy is not None:  # nothing was replaced: the copy is not of the previous heads
            copy.unlink(missing_ok=True)
        raise
    finally:
        model.close()
    print(f"heads for {path.name}: {heads_path}")
    print(_summary(record))
    if earlier is not None:
        kept_at = _previous_path(heads_path)
        os.replace(copy, kept_at)
        print(f"the heads this run replaced are kept at {kept_at}: {_summary(earlier)}", file=sys.stderr)
        if earlier.heldout_top1[:1] > record.heldout_top1[:1]:
            print(f"they scored better on head 1; to use them again: mv {kept_at} {heads_path}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _the_only_training_of(heads_path: Path):
    """Held while a training may write heads_path and its resume file: two trainings of one model at once took
    turns overwriting both, and the last to save won.  The lock file stays; the lock goes with the process."""
    lock_path = heads_path.with_name(heads_path.name + ".training.lock")
    try:
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # a lock file of another user's: the lock is a guard, never what stops a training
        descriptor = None
    try:
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise EdgespecError(f"another `edgespec heads train` is writing {heads_path}; wait for it to end, or "
                            "give --output another path") from None
    except OSError:  # a file system without flock
        pass
    try:
        yield
    finally:
        if descriptor is not None:
            os.close(descriptor)  # which releases the lock


def _check_writable(heads_path: Path) -> None:
    """EdgespecError now, not after the whole training, when the heads could not be written at heads_path."""
    import tempfile

    if heads_path.is_dir():
        raise EdgespecError(f"{heads_path} is a directory, where the heads file goes; move it away, or give "
                            "--output another path")
    try:
        heads_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=heads_path.parent, prefix=f".{heads_path.name}.", suffix=".check"):
            pass
    except (FileExistsError, NotADirectoryError):
        raise EdgespecError(f"cannot write the heads at {heads_path}: a file stands where a folder of that path "
                            "goes; give --output another path") from None
    except OSError as error:
        raise EdgespecError(f"cannot write the heads at {heads_path}: {error.strerror or error}; make "
                            f"{heads_path.parent} writable, or give --output another path") from None


def _heads_it_replaces(heads_path: Path, named: bool):
    """The record of the heads file a run will write over, or None.  A file named by --output that is not heads
    is refused now, before the model loads, not found out by writing over it."""
    from ..heads.store import HeadsFileError, read_heads

    if not heads_path.exists():
        return None
    try:
        return read_heads(heads_path)[0]
    except HeadsFileError:
        if not named:  # the model's own heads file, damaged: what training again is for
            return None
        raise UsageError(f"--output {heads_path} is there and is not a heads file; give another path, "
                         "or move that file away") from None


def _previous_path(heads_path: Path) -> Path:
    """Where a run keeps the heads it replaced."""
    return heads_path.with_name(heads_path.name.removesuffix(".npz") + ".previous.npz")


def _copy_aside(heads_path: Path) -> Path:
    """A copy of the heads a run will replace, made before the training so that a disk with no room for it is
    found then, and put in place (at _previous_path) only once new heads are saved, so that a run that saves
    nothing leaves the heads an earlier run kept as they are."""
    import shutil

    kept_at = _previous_path(heads_path)
    copy = kept_at.with_name(kept_at.name + ".partial")
    try:
        shutil.copyfile(heads_path, copy)
    except OSError as error:
        fix = "free some space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "make that folder writable"
        raise EdgespecError(f"cannot keep a copy of the heads this run would replace at {kept_at}: "
                            f"{error.strerror}; {fix}, or give --output another path") from None
    return copy


def show_command(args: argparse.Namespace) -> int:
    from ..fetch import resolve_model
    from ..heads.store import HeadsFileError, default_heads_path, read_heads
    from ..model_identity import model_identity

    path = resolve_model(args.model, pull=False)
    heads_path = args.heads or default_heads_path(path)
    record, _ = read_heads(heads_path)
    if record.model_identity != model_identity(path):
        raise HeadsFileError(f"heads file {heads_path.name} was trained for {record.model_name}, not {path.name} "
                             f"(train heads for it with `edgespec heads train --model {shlex.quote(args.model)}`)")
    print(heads_path)
    print(_summary(record))
    return 0


def _summary(record) -> str:
    heads = ", ".join(f"head {i + 1} {a:.1%} (top-3 {b:.1%})"
                      for i, (a, b) in enumerate(zip(record.heldout_top1, record.heldout_top3)))
    took = f"{record.training_seconds / 60:.1f} min" if record.training_seconds >= 60 else f"{record.training_seconds:.0f} s"
    return (f"{record.form} heads trained on {record.training_tokens:,} tokens in {took}; "
            f"held-out accuracy on {record.heldout_tokens} tokens: {heads}")


def _sources(model, args: argparse.Namespace):
    from ..heads.job import Sources
    from ..heads.prompts import HELDOUT_PROMPTS, TRAINING_PROMPTS
    from ..heads.store import default_heads_path
    from ..heads.usage import read_usage, usage_dir
    from ..prompts import PromptBuilder

    chat_ids = PromptBuilder(model).chat_tokens  # as the engine builds the prompts the heads will draft for

    texts = [("files", model.tokenize(text, add_special=True)) for text in _text_files(args.paths)]
    if args.history:
        texts += [("history", chat_ids(messages, False)) for messages in _history_chats()]
    for batch_file in args.batch:
        texts += [("batch", chat_ids(messages, False)) for messages in _batch_conversations(batch_file)]
    prompts = [chat_ids([{"role": "user", "content": p}], True) for p in TRAINING_PROMPTS] if args.builtin else []
    heldout = [chat_ids([{"role": "user", "content": p}], True) for p in HELDOUT_PROMPTS]
    usage = read_usage(usage_dir(default_heads_path(model.path)), model.n_embd, args.max_tokens)
    return Sources(texts, prompts, heldout, usage)


def _text_files(paths: list[Path]):
    """The text of every file under paths that reads as UTF-8 text (hidden and build folders left out)."""
    for root in paths:
        if not root.exists():
            raise EdgespecError(f"{root} does not exist (name text files or folders to train on)")
        if not (root.is_file() or root.is_dir()):  # a device or a FIFO: no text to learn, or no end to it
            raise EdgespecError(f"{root} is not a file or a folder (name text files or folders to train on)")
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and not (set(p.relative_to(root).parts[:-1]) & _SKIPPED_FOLDERS)
            and not any(part.startswith(".") for part in p.relative_to(root).parts))
        for file in files:
            if file.stat().st_size > MAX_TEXT_FILE_BYTES:
                continue
            data = file.read_bytes()
            if b"\0" in data[:4096]:
                continue
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError:
                continue


def _history_chats():
    from tui.history import ChatStore, HistoryError

    store = ChatStore()
    try:
        for summary in store.list_chats():
            try:
                messages = store.load_chat(summary.id).session.get("messages", [])
            except HistoryError:
                continue  # a damaged chat is skipped: the chat app names it when it is opened
            messages = [m for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)] \
                if isinstance(messages, list) else []
            if any(m.get("role") == "assistant" for m in messages):
                yield messages
    finally:
        store.close()


def _batch_conversations(path: Path):
    """Conversations in a batch input file (requests), output file (answers) or both, matched by custom_id."""
    requests, answers = {}, {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, messages, answer = _batch_record(line)
        if key is None:
            continue
        if messages is not None:
            requests[key] = messages
        if answer is not None:
            answers[key] = answer
    for key in requests.keys() | answers.keys():
        answer = [{"role": "assistant", "content": answers[key]}] if key in answers else []
        if requests.get(key, []) + answer:
            yield requests.get(key, [{"role": "user", "content": ""}]) + answer


def _batch_record(line: str) -> tuple[str | None, list | None, str | None]:
    """(custom_id, request messages, answer text) of one batch line; parts it lacks, or a line that is not a
    record (not JSON, nested 100k deep, an id that is not a string, a body that is not an object), are None."""
    try:
        record = parse_json(line)
    except ValueError:
        return None, None, None
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
        return None, None, None
    body = record.get("body")
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list):
        messages = [m for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
    else:
        messages = None
    try:
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        answer = None
    return record["custom_id"], messages, answer if isinstance(answer, str) else None


class ProgressLine:
    """One line on stderr, redrawn in place on a terminal (else a line every 15 s): phase, tokens, accuracy, time left."""

    def __init__(self, stream=None):
        self._stream = stream or sys.stderr  # looked up now: tests and the chat app replace sys.stderr
        self._tty = self._stream.isatty()
        self._last = 0.0
        self._width = 0

    def __call__(self, phase: str, tokens: int, accuracy: float | None, seconds_left: float) -> None:
        now = time.monotonic()
        if now - self._last < (0.2 if self._tty else 15.0):
            return
        self._last = now
        shown = f"  head-1 {accuracy:.1%}" if accuracy is not None else ""
        left = max(int(seconds_left), 0)
        line = f"heads: {phase}  {tokens:,} tokens{shown}  ETA {left // 60}:{left % 60:02d}"
        if self._tty:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def done(self) -> None:
        if self._tty and self._width:
            self._stream.write("\n")
            self._stream.flush()
