"""Running the requests of a batch through one engine, one or several at a time, one record each, and the summary."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import threading
import time
from collections import namedtuple
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from ...errors import ContextOverflowError, EdgespecError
from ...generation import Failed, Step
from ...files import write_named_output
from ...monitor import AcceptanceMonitor
from ...scheduler import Job
from ...session import ChatSession
from ...stats import Stats
from .output import CONTEXT_TOO_LONG, RecordWriter, error_record, is_done, is_success, success_record
from .requests import COMPLETIONS_URL, BatchError, BatchRequest, InvalidRequest, failure_text

if TYPE_CHECKING:
    from ...sampling import SamplingParams


# What the progress bar reads of the requests in flight, summed over them.
_InFlight = namedtuple("_InFlight", "tokens_generated draft_tokens_proposed draft_tokens_accepted")


# Ctrl-C, and the SIGTERM of kill, timeout and docker stop, which otherwise ended the batch at once: no
# message, and OUT's lock holder file left behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """Ctrl-C (or SIGTERM) turns into a polite stop: the request in flight is cancelled and not written."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    @contextmanager
    def catching_stop_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

        def on_signal(signum, frame):
            self.requested.set()
            # A second one falls back to the usual immediate stop.
            signal.signal(signum, previous[signum])

        for signum in STOP_SIGNALS:
            signal.signal(signum, on_signal)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@dataclass
class RunTally:
    """What this run did, for the progress bar and the summary."""

    written: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    interrupted: bool = False
    unanswered: int = 0  # --endpoint requests left unwritten after every attempt failed

    @property
    def seconds(self) -> float:
        """Time since the run started (after the model was loaded)."""
        return time.monotonic() - self.started

    def add(self, stats: Stats) -> None:
        self.tokens += stats.tokens_generated
        self.proposed += stats.draft_tokens_proposed
        self.accepted += stats.draft_tokens_accepted

    def add_answer(self, record: dict) -> None:
        """A server's answer (--endpoint), with whatever figures it reports."""
        figures = record_figures(record)
        if figures is not None:
            self.tokens += figures["tokens"]
            self.proposed += figures["proposed"]
            self.accepted += figures["accepted"]


def record_figures(record: dict) -> dict | None:
    """Tokens, drafting and time of a successful record, or None for a failed one.

    A local record carries edgespec's "stats"; an answer of edgespec serve carries them in
    usage.speculative; other servers (vLLM, llama-server) report tokens only. A server's answer
    is data from outside: a figure that is not a number counts as 0.
    """
    if not is_success(record):
        return None
    body = record["response"]["body"]
    usage = _mapping(body, "usage")
    stats = _mapping(body, "stats")
    if stats:
        return {"tokens": _count(stats, "tokens_generated"), "decode_seconds": _count(stats, "decode_seconds"),
                "proposed": _count(stats, "draft_tokens_proposed"), "accepted": _count(stats, "draft_tokens_accepted"),
                "passes": _count(stats, "target_forward_passes"), "mode": _name(stats.get("mode"))}
    speculative = _mapping(usage, "speculative")
    tokens, speed = _count(usage, "completion_tokens"), _count(speculative, "decode_tokens_per_second")
    return {"tokens": tokens, "decode_seconds": tokens / speed if speed > 0 else 0.0,
            "proposed": _count(speculative, "draft_tokens"), "accepted": _count(speculative, "draft_tokens_accepted"),
            "passes": _count(speculative, "target_forward_passes"), "mode": _name(speculative.get("mode"))}


def _mapping(obj: object, key: str) -> dict:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else {}


# No real count comes near this, the largest whole number a float holds exactly; a far bigger int (a server's
# 4000-digit "prompt_tokens") made the summary raise OverflowError, on every rerun too.
MAX_FIGURE = 2**53


def _count(obj: dict, key: str) -> float:
    value = obj.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_FIGURE
    return value if ok else 0


def _name(value: object) -> str | None:
    # a drafting mode's name ends up in the summary line: nothing a terminal would act on
    return value if isinstance(value, str) and re.fullmatch(r"[a-z][a-z0-9-]{0,31}", value) else None


def run_batch(
    engine,
    entries: list[BatchRequest | InvalidRequest],
    writer: RecordWriter,
    base_params,
    finished: dict[str, dict],
    interrupt: Interrupt,
    parallel: int = 1,
    on_progress: Callable[[RunTally, _InFlight | None], None] = lambda tally, live: None,
) -> RunTally:
    """Run every entry not yet done (see is_done), up to `parallel` at a time (edgespec.scheduler).

    Each finished request's record is appended (and fsynced) as soon as it
    ends, in the order requests finish, and added to `finished`; a request in
    flight when the batch is interrupted (interrupt.requested) or killed is not
    written, so a rerun redoes it, and no custom_id is written twice.
    Requests sharing a long prefix (a system prompt, a document) run one after
    another, so it is prefilled once (the Batch format leaves the output order
    free); the rest keep their order.
    """
    tally = RunTally()
    model_name = Path(engine.target_path).stem  # as `edgespec serve` names it: "qwen2.5-coder-1.5b-instruct"
    in_flight: dict[str, Stats] = {}

    def write(entry, record: dict) -> None:
        writer.append(record)
        finished[entry.custom_id] = record
        tally.written += 1
        on_progress(tally, _summed(in_flight))

    jobs = _jobs(engine, _grouped_by_shared_prefix(entries), base_params, finished, interrupt, write)
    by_id = {entry.custom_id: entry for entry in entries}
    events = engine.scheduler(parallel).run(lambda wait: next(jobs, None), cancel=interrupt.requested)
    for custom_id, event in events:
        entry = by_id[custom_id]
        if isinstance(event, Step):
            in_flight[entry.custom_id] = event.stats
            on_progress(tally, _summed(in_flight))
            continue
        in_flight.pop(entry.custom_id, None)
        if isinstance(event, Failed):
            too_long = isinstance(event.error, ContextOverflowError)
            write(entry, error_record(entry.custom_id, CONTEXT_TOO_LONG if too_long else "generation_failed",
                                      f"line {entry.line}: {failure_text(event.error)}", entry.fingerprint,
                                      n_ctx=engine.n_ctx if too_long else None))
        elif event.result.finish_reason != "cancelled":
            tally.add(event.result.stats)
            write(entry, success_record(entry, event.result, model_name))
    tally.interrupted = interrupt.requested.is_set() and not all(is_done(e, finished) for e in entries)
    return tally


# About 256 tokens of prose or code: the shortest prefix the prompt cache keeps a snapshot of.
SHARED_PREFIX_CHARS = 1000


def _grouped_by_shared_prefix(entries: list[BatchRequest | InvalidRequest]) -> list[BatchRequest | InvalidRequest]:
    """The entries in input order, except that those starting with the same SHARED_PREFIX_CHARS characters
    (a system prompt, a document) run right after the first of them, so its prefill is paid once."""
    groups: dict[object, list] = {}
    for position, entry in enumerate(entries):
        text = _prompt_text(entry)
        groups.setdefault(text[:SHARED_PREFIX_CHARS] if len(text) >= SHARED_PREFIX_CHARS else position, []).append(entry)
    return [entry for group in groups.values() for entry in group]


def _prompt_text(entry: BatchRequest | InvalidRequest) -> str:
    if isinstance(entry, InvalidRequest):
        return ""
    if entry.url == COMPLETIONS_URL:
        return entry.prompt
    return "\x00".join(f"{m['role']}\x01{m['content']}" for m in entry.messages)


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


def request_params(request: BatchRequest, base_params: SamplingParams) -> SamplingParams:
    """What the request samples with: the command line's values, and the body's own where it sets them."""
    return dataclasses.replace(base_params, **dict(request.overrides))


def sampling_settings(params: SamplingParams) -> dict:
    """params as a record keeps them (JSON's types: the stop strings a list)."""
    return {**dataclasses.asdict(params), "stop": list(params.stop)}


def _job(engine, request: BatchRequest, base_params) -> Job | dict:
    """The request's job: its prompt tokens and sampling; or its error record.

    Whatever one request gets wrong (a sampling value SamplingParams or numpy
    refuses, a chat template that fails to render, a prompt too long) is that
    request's error record, never the end of the batch.
    """
    def failed(code: str, reason: object) -> dict:
        return error_record(request.custom_id, code, f"line {request.line}: {failure_text(reason)}",
                            request.fingerprint, n_ctx=engine.n_ctx if code == CONTEXT_TOO_LONG else None)

    try:
        params = request_params(request, base_params)
    except (EdgespecError, ValueError) as err:
        return failed("invalid_field", f"bad sampling setting: {err}")
    try:
        if request.url == COMPLETIONS_URL:
            ids = engine.prompt_tokens(request.prompt, raw=True)
        else:
            ids = chat_session(engine, request.messages).reply_prompt(params)
    except ContextOverflowError as err:
        return failed(CONTEXT_TOO_LONG, err)
    except (EdgespecError, ValueError) as err:
        return failed("generation_failed", err)
    return Job(request.custom_id, ids, params, prediction=engine.prediction_tokens(request.prediction))


def _summed(in_flight: dict[str, Stats]) -> _InFlight | None:
    """What the progress bar reads of the requests in flight, summed over them."""
    if not in_flight:
        return None
    stats = in_flight.values()
    return _InFlight(sum(s.tokens_generated for s in stats), sum(s.draft_tokens_proposed for s in stats),
                     sum(s.draft_tokens_accepted for s in stats))


def chat_session(engine, messages: tuple[dict, ...]) -> ChatSession:
    """A session holding the request's conversation, ready to reply to its last (user) message.

    A conversation too long for the context is an error, never silently cut.
    """
    has_system = messages[0]["role"] == "system"
    session = ChatSession(engine, messages[0]["content"] if has_system else None, context_policy="error")
    session.messages = [dict(m) for m in messages[1 if has_system else 0 :]]
    return session


def summarize(entries, finished: dict[str, dict], tally: RunTally, resumed: int, wall_seconds: float) -> dict:
    """Figures for the whole batch as it now stands in OUT (earlier runs included)."""
    records = [finished[e.custom_id] for e in entries if is_done(e, finished)]
    ok = [r for r in records if is_success(r)]
    usage = [_mapping(r["response"]["body"], "usage") for r in ok]
    figures = [f for f in map(record_figures, ok) if f is not None]
    generated = sum(f["tokens"] for f in figures)
    decode_seconds = sum(f["decode_seconds"] for f in figures)
    proposed = sum(f["proposed"] for f in figures)
    accepted = sum(f["accepted"] for f in figures)
    target_passes = sum(f["passes"] for f in figures)
    return {
        "requests_total": len(entries),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "requests_pending": len(entries) - len(records),
        "requests_resumed": resumed,
        "requests_unanswered": tally.unanswered,
        "interrupted": tally.interrupted,
        "prompt_tokens": int(sum(_count(u, "prompt_tokens") for u in usage)),
        "completion_tokens": int(sum(_count(u, "completion_tokens") for u in usage)),
        "total_tokens": int(sum(_count(u, "total_tokens") for u in usage)),
        "wall_seconds": round(wall_seconds, 3),  # this run only, model loading included
        "decode_tokens_per_second": round(generated / decode_seconds, 2) if decode_seconds else None,
        # this run's generated tokens over its time after loading: what several requests at once speed up
        "throughput_tokens_per_second": round(tally.tokens / tally.seconds, 2) if tally.tokens and tally.seconds else None,
        # Token-weighted: all accepted draft tokens over all proposed ones.
        "mean_acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "target_passes_per_token": round(target_passes / generated, 4) if generated and target_passes else None,
        "modes": sorted({f["mode"] for f in figures if f["mode"]}),
        "draft_alerts": _draft_alerts(figures),
    }


def _draft_alerts(figures: list[dict]) -> list[str]:
    """The rolling acceptance check of edgespec serve, run over the records in input order: every
    change it reports (a draft that went stale, and its recovery)."""
    monitor = AcceptanceMonitor()
    changes = (monitor.observe(str(f["mode"]), f["proposed"], f["accepted"]) for f in figures if f["mode"])
    return [change.message for change in changes if change is not None]


def batch_summary_line(summary: dict) -> str:
    """The one line a batch prints on stderr at its end."""
    def show(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    return (
        f"batch: {summary['requests_ok']} ok, {summary['requests_failed']} failed"
        f" of {summary['requests_total']} ({summary['requests_resumed']} already done)"
        f" | {summary['total_tokens']} tokens ({summary['completion_tokens']} generated)"
        f" | wall {summary['wall_seconds']:.1f} s"
        f" | decode {show(summary['decode_tokens_per_second'], '.1f')} tok/s per request"
        f" | throughput {show(summary['throughput_tokens_per_second'], '.1f')} tok/s"
        f" | acceptance {show(summary['mean_acceptance_rate'], '.1%')}"
        f" | {show(summary['target_passes_per_token'], '.3f')} target passes/token"
        + "".join(f"\nbatch: warning: {alert}" for alert in summary["draft_alerts"])
    )


def write_summary(path: Path, summary: dict) -> None:
    try:
        write_named_output(path, json.dumps(summary, indent=2) + "\n")  # a fresh temporary name: never OUT
    except OSError as err:
        raise BatchError(f"cannot write summary {path}: {err.strerror}; check the path") from None
