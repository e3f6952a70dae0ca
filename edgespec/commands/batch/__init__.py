"""`edgespec batch`: run a JSONL file of prompts through one engine, resumably.

Input is the OpenAI Batch request format (one request per line: custom_id,
method "POST", url "/v1/chat/completions" or "/v1/completions", body), or a
plain form: one prompt per line as {"prompt": "..."} or a bare JSON string,
answered as a chat turn, with custom_ids made from line numbers ("line-7").

Output is the OpenAI Batch output format, one record per request, appended
and fsynced as soon as it is done, so finished work survives Ctrl-C, kill -9
and power loss; rerunning the same command skips the custom_ids already in the
output. A failed request, a bad line or a bad sampling value in one body
included, gets an error record and the batch goes on. Each response body
carries edgespec's figures in an extra "stats" field, and each record an
extra "fingerprint": a hash of its request as IN states it (custom_id left
out); an answer's record also keeps the "sampling" settings it was made with
(those the command line filled in, with --endpoint).

OUT is only ever appended to, with one exception: a last line without its
newline that starts like a record this module writes (every record begins
with RECORD_PREFIX) is a write cut short by a kill or power loss, and is cut
off so its request is redone. Any other content that is not a batch output
record (a notes file, the input file) makes the batch refuse and leave OUT
untouched. While a batch runs it holds an exclusive flock on OUT; a second
batch on the same file is refused, naming the holder's pid, which the holder
keeps in OUT's ".edgespec-lock" file next to it.

On resume, a request whose fingerprint differs from the one stored with its
record (the request changed since OUT was written) is redone, and so is one
whose answer was made with other sampling settings than this run gives it
(another --max-tokens or --temperature), and one whose record is an error
that may pass (a server's answer that was none, see
output.RETRIED_ERROR_CODES). Its new record is appended with a "supersedes"
field holding the old record's "id": OUT is never rewritten, and the last
record for a custom_id is the one that counts. Records written before
fingerprints existed are kept as they are, with a note.

With --endpoint URL the requests go to an OpenAI-compatible server instead
of a local engine, up to --concurrency at a time (see remote.py); OUT, resume
and the summary work the same way.

Exit codes (see EXIT_* below): 0 every request succeeded, 1 some requests
got error records (or, with --endpoint, no answer after every retry), 2 the batch was refused before it started (duplicate
custom_ids, unreadable files, OUT not batch output or in use, model failed
to load) or OUT became unwritable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ...errors import EdgespecError
from ...limits import MAX_PARALLEL
from ...stats import Stats
from ..options import add_engine_options, add_sampling_options, engine_from_args, file_path, sampling_params, setting
from ..serve import API_KEY_ENV
from .parallel import parallel_for
from .output import FINGERPRINT_FIELD, RecordWriter, changed_sampling, is_done, same_file
from .endpoint import EXAMPLE_URL, Endpoint, shown_url, url_problem
from .remote import MAX_ATTEMPTS, MAX_CONCURRENCY, default_fields, filled_in, run_remote_batch
from .requests import BatchError, BatchRequest, check_unique_ids, for_the_engine, read_requests
from .runner import (Interrupt, RunTally, batch_summary_line, request_params, run_batch, sampling_settings, summarize,
                     write_summary)

EXIT_OK = 0
EXIT_REQUESTS_FAILED = 1
EXIT_REFUSED = BatchError.exit_code
EXIT_INTERRUPTED = 130


class BatchInterrupted(EdgespecError):
    """Ctrl-C before the batch got going; what is in OUT stays and a rerun resumes."""

    exit_code = EXIT_INTERRUPTED


def add_batch_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="run a JSONL file of prompts (OpenAI Batch format), resumably",
        description=(
            "Run every request of IN (OpenAI Batch JSONL, or one prompt per line as "
            '{"prompt": ...} or a JSON string) and append OpenAI Batch output records to OUT. '
            "Rerun the same command to resume: requests already done in OUT are skipped; a changed line, an "
            "answer made with other sampling flags, or a server's answer that was none, is redone and its new "
            "record appended. "
            "Exit codes: 0 all requests succeeded, 1 some requests failed (error records in OUT), "
            "2 refused before starting, 130 interrupted."
        ),
    )
    parser.add_argument("input", type=file_path, metavar="IN", help="batch input, JSONL")
    parser.add_argument("-o", "--output", type=file_path, required=True, metavar="OUT",
                        help="batch output, JSONL (appended)")
    parser.add_argument("--summary", type=file_path, metavar="FILE", help="also write the summary as JSON to FILE")
    remote = parser.add_argument_group("server (instead of a local engine)")
    remote.add_argument("--endpoint", type=_endpoint_url, metavar="URL",
                        help="send the requests to this OpenAI-compatible server (edgespec serve, vLLM, "
                             "llama-server), e.g. http://127.0.0.1:8080; the model options are then unused")
    remote.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help=f"the server's API key (default: ${API_KEY_ENV})")
    remote.add_argument("--concurrency", type=_concurrency, default=1, metavar="N",
                        help=f"requests in flight at once, 1..{MAX_CONCURRENCY} (default: %(default)s)")
    local = parser.add_argument_group("local engine")
    local.add_argument("--parallel", type=setting("parallel"), default=None, metavar="N",
                       help=f"requests decoded together in each forward pass, 1..{MAX_PARALLEL} (default: the number "
                            "that gives the most tokens per second on this machine's measured cost curve, within the "
                            "memory budget; 1 with --bit-exact)")
    add_engine_options(parser)
    add_sampling_options(parser, max_tokens=256)
    parser.set_defaults(func=handle_batch)


def handle_batch(args) -> int:
    """The batch's exit code; an error ends it with its own (see the module docstring)."""
    try:
        return _batch_command(args)
    except BatchError:
        raise
    except EdgespecError as err:  # e.g. the model failed to load: the batch is refused
        raise BatchError(*err.message) from None
    except KeyboardInterrupt:
        raise BatchInterrupted(f"interrupted; {_resume_hint(args)}") from None


def _resume_hint(args) -> str:
    """What a rerun does: OUT is named as holding results only when it holds some."""
    try:
        holds_results = args.output.stat().st_size > 0
    except OSError:
        holds_results = False
    if holds_results:
        return f"finished results are saved in {args.output}; rerun the same command to resume"
    return f"no result was written to {args.output} yet; rerun the same command to start again"


def _batch_command(args) -> int:
    started = time.monotonic()
    if args.concurrency != 1 and not args.endpoint:  # else left unused without a word
        raise BatchError("--concurrency is how many requests go to --endpoint's server at once; a local batch "
                         "decodes requests together with --parallel N")
    check_paths(args.input, args.output, args.summary)
    entries = read_requests(args.input)
    if not entries:
        raise BatchError(f"{args.input} holds no requests; put one request per line")
    check_unique_ids(entries)
    if not args.endpoint:
        entries = [for_the_engine(entry) for entry in entries]
    entries = _with_sampling(entries, args)
    writer = RecordWriter(args.output)  # locked before anything reads or repairs OUT
    try:
        finished, torn = writer.load_finished(n_ctx=None if args.endpoint else args.n_ctx)
        if torn:
            print(f"edgespec batch: cut off a torn last record in {args.output}; that request is redone", file=sys.stderr)
        _note_retried_records(entries, writer.retried, args.output)
        _warn_changed_requests(entries, finished, args.output)
        if not args.endpoint:
            _note_other_models(entries, finished, args.model, args.output)
        resumed = sum(1 for e in entries if is_done(e, finished))
        tally = RunTally()
        if resumed < len(entries):
            run = _run_on_endpoint if args.endpoint else _run_with_engine
            tally = run(args, entries, writer, finished, resumed)
    finally:
        writer.close()
    summary = summarize(entries, finished, tally, resumed, time.monotonic() - started)
    print(batch_summary_line(summary), file=sys.stderr)
    if args.summary:
        write_summary(args.summary, summary)
    if tally.interrupted:
        done = len(entries) - summary["requests_pending"]
        print(f"edgespec batch: interrupted after {done} of {len(entries)} requests; {_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if tally.unanswered:
        print(f"edgespec batch: {_requests(tally.unanswered)} got no answer from {args.endpoint} after "
              f"{MAX_ATTEMPTS} attempts and were not written; rerun the same command to retry them", file=sys.stderr)
    ok = summary["requests_failed"] == 0 and not tally.unanswered
    return EXIT_OK if ok else EXIT_REQUESTS_FAILED


def check_paths(input_path: Path, output_path: Path, summary_path: Path | None) -> None:
    """Refuse an OUT or a summary that is IN, or a summary that is OUT, under any name."""
    if same_file(output_path, input_path):
        raise BatchError(f"the output file is the input file ({input_path}); give -o a new path")
    for other, what in ((input_path, "the input file"), (output_path, "the output file")):
        if summary_path is not None and same_file(summary_path, other):
            raise BatchError(f"--summary {summary_path} is {what} ({other}); give --summary another path")
    if summary_path is not None:  # written last: found out only then, the whole batch would have run first
        why = _unwritable(summary_path)
        if why:
            raise BatchError(f"cannot write --summary {summary_path}: {why}; check the path")


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be created at path, or None."""
    folder = path.parent
    if path.is_dir():
        return "it is a directory"
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def _with_sampling(entries, args) -> list:
    """Each request with the sampling settings this run gives it (see BatchRequest.sampling): with
    --endpoint, the command line's values that its body leaves out; for the engine, all it samples with."""
    if args.endpoint:
        defaults = default_fields(args)
        return [dataclasses.replace(e, sampling=filled_in(e, defaults)) if isinstance(e, BatchRequest) else e
                for e in entries]
    base = sampling_params(args)
    return [dataclasses.replace(e, sampling=_engine_sampling(e, base)) if isinstance(e, BatchRequest) else e
            for e in entries]


def _engine_sampling(request: BatchRequest, base) -> dict | None:
    try:
        return sampling_settings(request_params(request, base))
    except (EdgespecError, ValueError):
        return None  # a bad value in the body: its error record says which


def _note_retried_records(entries, retried: list[str], out_path: Path) -> None:
    ids = {e.custom_id for e in entries}
    redone = [custom_id for custom_id in retried if custom_id in ids]
    if redone:
        print(f"edgespec batch: redoing {_requests(len(redone))} whose record in {out_path} is an error worth"
              f" retrying (first: {redone[0]!r})", file=sys.stderr)


def _warn_changed_requests(entries, finished: dict[str, dict], out_path: Path) -> None:
    ids = {e.custom_id for e in entries}
    foreign = sum(1 for custom_id in finished if custom_id not in ids)
    if foreign:
        print(f"edgespec batch: note: {out_path} has {foreign} records whose custom_id is not in this input", file=sys.stderr)
    known = [e for e in entries if e.custom_id in finished]
    redone = [e for e in known if not is_done(e, finished)]
    resampled = [e for e in redone if changed_sampling(e, finished[e.custom_id])]
    changed = [e for e in redone if not changed_sampling(e, finished[e.custom_id])]
    superseding = ("they are redone and their new records appended, each naming the record it supersedes"
                   " (the last record for a custom_id counts)")
    if changed:
        print(f"edgespec batch: {_requests(len(changed))} changed since {out_path} was written"
              f" (first: {changed[0].custom_id!r}, line {changed[0].line}); {superseding}", file=sys.stderr)
    if resampled:
        first = resampled[0]
        were = "was" if len(resampled) == 1 else "were"
        print(f"edgespec batch: {_requests(len(resampled))} in {out_path} {were} answered with other sampling settings"
              f" than this run's (first: {first.custom_id!r}, {changed_sampling(first, finished[first.custom_id])});"
              f" {superseding}", file=sys.stderr)
    unmarked = sum(1 for e in known if FINGERPRINT_FIELD not in finished[e.custom_id])
    if unmarked:
        print(
            f"edgespec batch: note: {unmarked} records in {out_path} come from an older edgespec that stored no"
            " request fingerprint; they are kept unchecked (give -o a new path to redo them)",
            file=sys.stderr,
        )


def _note_other_models(entries, finished: dict[str, dict], model: str, out_path: Path) -> None:
    """Say so when records this run keeps as done were answered by another model than --model: resume matches
    a request's line and sampling, not the model, so a rerun with another model kept the first one's answers."""
    from ...fetch import resolve_model

    try:
        path = resolve_model(model, pull=False)
    except EdgespecError:
        return  # not here yet: loading it says so, and then there is nothing to compare
    asked = path.stem  # as success_record names it; records written before named the file, path.name
    others: dict[str, int] = {}
    for entry in entries:
        record = finished.get(entry.custom_id) if is_done(entry, finished) else None
        response = record.get("response") if record else None
        body = response.get("body") if isinstance(response, dict) else None
        answered_by = body.get("model") if isinstance(body, dict) else None
        if isinstance(answered_by, str) and answered_by not in (asked, path.name):
            others[answered_by] = others.get(answered_by, 0) + 1
    if others:
        kept = ", ".join(f"{_requests(count)} by {name}" for name, count in others.items())
        print(f"edgespec batch: note: {out_path} holds answers kept as done that were answered by another model "
              f"than {asked} ({kept}); give -o a new path for {asked}'s own answers", file=sys.stderr)


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _run_with_engine(args, entries, writer, finished, resumed) -> RunTally:
    params = sampling_params(args)
    engine = engine_from_args(args, parallel=args.parallel or 1)
    interrupt = Interrupt()
    try:
        parallel = parallel_for(engine, args.parallel, len(entries) - resumed)
        with _progress_bar(len(entries), resumed) as on_progress, interrupt.catching_stop_signals():
            return run_batch(engine, entries, writer, params, finished, interrupt, parallel, on_progress)
    finally:
        engine.close()


def _run_on_endpoint(args, entries, writer, finished, resumed) -> RunTally:
    endpoint = Endpoint.parse(args.endpoint, args.api_key)
    interrupt = Interrupt()
    with _progress_bar(len(entries), resumed) as on_progress, interrupt.catching_stop_signals():
        return run_remote_batch(endpoint, entries, writer, default_fields(args), finished, interrupt,
                                args.concurrency, on_progress)


def _endpoint_url(text: str) -> str:
    """An argparse type for --endpoint: a server's URL.  An empty one ran the batch on the local default model
    instead, and a malformed one was a traceback once the first request went out."""
    problem = url_problem(text.strip().rstrip("/"))
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{shown_url(text)!r} {problem}; give e.g. {EXAMPLE_URL}")
    return text


def _concurrency(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_CONCURRENCY}, not {text!r}")
    return value


@contextmanager
def _progress_bar(total: int, done: int) -> Iterator[Callable[[RunTally, Stats | None], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("batch"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[speed]}"),
        TextColumn("{task.fields[acceptance]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task("batch", total=total, completed=done, speed="- tok/s", acceptance="acceptance -")

    def on_progress(tally: RunTally, live: Stats | None) -> None:
        tokens = tally.tokens + (live.tokens_generated if live else 0)
        proposed = tally.proposed + (live.draft_tokens_proposed if live else 0)
        accepted = tally.accepted + (live.draft_tokens_accepted if live else 0)
        elapsed = time.monotonic() - tally.started
        progress.update(
            task,
            completed=done + tally.written,
            speed=f"{tokens / elapsed:.1f} tok/s" if elapsed > 0 else "- tok/s",
            acceptance=f"acceptance {accepted / proposed:.0%}" if proposed else "acceptance -",
        )

    with progress:
        yield on_progress
