"""Running a batch's requests several at a time through one engine (see edgespec.scheduler).

The records are the sequential runner's: each finished request is appended
(and fsynced) as soon as it ends, in the order requests finish; a request in
flight when the batch is interrupted or killed is not written, so a rerun
redoes it, and no custom_id is written twice.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from pathlib import Path
from typing import Callable, Iterator

from ...engine import Step
from ...errors import ContextOverflowError, EdgespecError
from ...scheduler import Failed, Job, Scheduler
from ...stats import Stats
from .output import RecordWriter, error_record, is_done, success_record
from .requests import COMPLETIONS_URL, BatchRequest, InvalidRequest
from .runner import Interrupt, RunTally, chat_session

# What the progress bar reads of the requests in flight, summed over them.
_InFlight = namedtuple("_InFlight", "tokens_generated draft_tokens_proposed draft_tokens_accepted")


def run_batch_parallel(
    engine,
    entries: list[BatchRequest | InvalidRequest],
    writer: RecordWriter,
    base_params,
    finished: dict[str, dict],
    interrupt: Interrupt,
    parallel: int,
    on_progress: Callable[[RunTally, Stats | None], None] = lambda tally, live: None,
) -> RunTally:
    """run_batch's contract, with up to `parallel` requests decoded together."""
    tally = RunTally()
    model_name = Path(engine.target_path).name
    in_flight: dict[str, Stats] = {}

    def write(entry, record: dict) -> None:
        writer.append(record)
        finished[entry.custom_id] = record
        tally.written += 1
        on_progress(tally, _summed(in_flight))

    jobs = _jobs(engine, entries, base_params, finished, interrupt, write)
    by_id = {entry.custom_id: entry for entry in entries}
    events = Scheduler(engine, parallel).run(lambda wait: next(jobs, None), cancel=interrupt.requested)
    for custom_id, event in events:
        entry = by_id[custom_id]
        if isinstance(event, Step):
            in_flight[entry.custom_id] = event.stats
            on_progress(tally, _summed(in_flight))
            continue
        in_flight.pop(entry.custom_id, None)
        if isinstance(event, Failed):
            code = "context_length_exceeded" if isinstance(event.error, ContextOverflowError) else "generation_failed"
            write(entry, error_record(entry.custom_id, code, f"line {entry.line}: {event.error}", entry.fingerprint))
        elif event.result.finish_reason != "cancelled":
            tally.add(event.result.stats)
            write(entry, success_record(entry, event.result, model_name))
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


def _jobs(engine, entries, base_params, finished, interrupt, write) -> Iterator[Job]:
    """A job per request still to do; a request that cannot become one gets its error record at once."""
    for entry in entries:
        if interrupt.requested.is_set():
            return
        if is_done(entry, finished):
            continue
        if isinstance(entry, InvalidRequest):
            write(entry, error_record(entry.custom_id, entry.code, entry.message, entry.fingerprint))
            continue
        job_or_error = _job(engine, entry, base_params)
        if isinstance(job_or_error, Job):
            yield job_or_error
        else:
            write(entry, job_or_error)


def _job(engine, request: BatchRequest, base_params) -> Job | dict:
    """The request's job: its prompt tokens and sampling; or its error record."""
    def failed(code: str, reason: object) -> dict:
        return error_record(request.custom_id, code, f"line {request.line}: {reason}", request.fingerprint)

    try:
        params = dataclasses.replace(base_params, **dict(request.overrides))
    except (EdgespecError, ValueError) as err:
        return failed("invalid_field", f"bad sampling setting: {err}")
    try:
        if request.url == COMPLETIONS_URL:
            ids = engine.prompt_tokens(request.prompt, raw=True)
        else:
            ids = chat_session(engine, request.messages, with_last=True).reply_prompt(params)
    except ContextOverflowError as err:
        return failed("context_length_exceeded", err)
    except (EdgespecError, ValueError) as err:
        return failed("generation_failed", err)
    return Job(request.custom_id, ids, params, prediction=engine.prediction_tokens(request.prediction))


def _summed(in_flight: dict[str, Stats]) -> _InFlight | None:
    if not in_flight:
        return None
    stats = in_flight.values()
    return _InFlight(sum(s.tokens_generated for s in stats), sum(s.draft_tokens_proposed for s in stats),
                     sum(s.draft_tokens_accepted for s in stats))
