"""Several generations in each target pass: continuous batching, with speculation per sequence.

One pass over n rows costs T(n) whoever the rows belong to, and on a CPU T(n)
grows far slower than n.  The scheduler keeps up to `parallel` generations in
the target's context (one shared KV buffer) and runs one pass per step over
every active sequence's last token and draft; a finished sequence's place goes
to the next job at once.

Each sequence has its own lane (n-gram index, draft-length controllers), its
own random stream, and verifies its own rows by rejection sampling, so every
output is exact in distribution as in a lone generation.  Only the draft
lengths are chosen together: the drafted rows that go into the shared pass are
the ones whose expected accepted tokens are worth their marginal cost on the
curve, so a sequence whose drafts keep failing drafts nothing while the others
still do.

The draft model drafts one sequence at a time (its cache holds one), so here
every sequence drafts with n-grams.  --bit-exact never comes here: a row in a
shared pass is computed by the kernels for that pass's width, as a lone wide
pass's rows are, so the batch command runs one sequence at a time under it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .backend import common_prefix_length
from .costs import CostModel
from .drafters import NgramDrafter, NoDrafter
from .engine import Done, DraftChoice, Engine, Generation, Lane, NonFiniteLogits, Step
from .errors import ContextOverflowError, EdgespecError
from .limits import MAX_OUTPUT_ROWS, checked_setting
from .ngram_pool import NgramPool
from .sampling import SamplingParams

# A prompt that shares at least this many more tokens with another sequence's cache than with its
# own shares that sequence's cells (free in llama.cpp's unified KV buffer) instead of evaluating them.
MIN_COPIED_PREFIX = 16



@dataclass(frozen=True)
class Job:
    key: object  # the caller's name for it, given back with every event
    prompt_ids: list[int]
    params: SamplingParams
    cancel: threading.Event | None = None  # set: the job ends after its current step
    prediction: Sequence[int] | None = None  # tokens the output is expected to mostly repeat (a draft source)
    pool: NgramPool | None = None  # the pool of other texts its drafts may come from (None: the engine's)


@dataclass(frozen=True)
class Failed:
    """A job that could not run or finish (its prompt does not fit, the model computed NaN ...)."""

    error: EdgespecError


def best_parallel(cost: CostModel, limit: int) -> int:
    """The number of sequences, 1..limit, whose one-token rows give the most tokens per second on this curve."""
    rates = [n / cost.target(n) for n in range(1, limit + 1)]
    return int(np.argmax(rates)) + 1


def joint_draft_lengths(choices: Sequence[DraftChoice], cost: CostModel, max_rows: int = MAX_OUTPUT_ROWS) -> list[int]:
    """Each sequence's draft length for one shared pass, chosen together for the most expected tokens per second.

    Every sequence's own token is one row.  A drafted token i of sequence s is
    accepted with probability reach = a_1 * ... * a_i (its controller's
    estimates), so adding the rows in order of reach gives, for each pass
    width, the most expected tokens; the width with the best tokens / T(width)
    wins (the narrower one on a tie).  A fixed draft length is kept as given.
    """
    lengths = [0] * len(choices)
    width, tokens, offers = len(choices), float(len(choices)), []
    for i, choice in enumerate(choices):
        controller = choice.controller
        if controller is None or choice.cap == 0:
            continue
        reach = np.cumprod(controller.acceptance(choice.hint.signal)[: choice.cap])
        if controller.fixed_k is not None:
            lengths[i] = min(controller.fixed_k, choice.cap)
            width, tokens = width + lengths[i], tokens + float(reach[: lengths[i]].sum())
        else:
            offers += [(-float(r), i) for r in reach]
    offers.sort()  # highest reach first; a sequence's own offers keep their order
    best_rate, best_n, rate_tokens = tokens / cost.target(width), 0, tokens
    for n, (negative_reach, _) in enumerate(offers[: max(0, max_rows - width)], start=1):
        rate_tokens -= negative_reach
        rate = rate_tokens / cost.target(width + n)
        if rate > best_rate:
            best_rate, best_n = rate, n
    for _, i in offers[:best_n]:
        lengths[i] += 1
    return lengths


class Scheduler:
    """Runs jobs `parallel` at a time in the engine's target, one shared pass per step."""

    def __init__(self, engine: Engine, parallel: int):
        checked_setting("parallel", parallel)
        self.engine = engine
        self.parallel = parallel
        self.mode = "none" if engine.mode == "none" else "ngram"
        engine.target.reserve_sequences(parallel)

    def run(self, next_job: Callable[[bool], Job | None], cancel=None) -> Iterator[tuple[object, Step | Done | Failed]]:
        """Every job's events, as they happen: Steps, then a Done (or a Failed).

        next_job(wait) gives the next job, or None when there is none yet; with
        wait (nothing is running) it may block until one comes, and None then
        ends the run.  Once cancel is set no job starts and each one in flight
        ends with a Done whose finish_reason is "cancelled"; a job's own cancel
        does so for that job alone.
        """
        active: dict[object, tuple[Generation, Job]] = {}
        free = list(range(self.parallel - 1, -1, -1))
        while True:
            while free and not (cancel is not None and cancel.is_set()):
                job = next_job(not active)
                if job is None:
                    break
                seq = self._place_for(job.prompt_ids, free)
                free.remove(seq)
                started = self._start(job, seq)
                if isinstance(started, Failed):
                    free.append(seq)
                    yield job.key, started
                else:
                    active[job.key] = started, job
            if not active:
                return
            for key, event in self._step(active, cancel):
                if isinstance(event, (Done, Failed)):
                    free.append(active.pop(key)[0].seq)
                yield key, event

    def _start(self, job: Job, seq: int) -> Generation | Failed:
        """The job's generation, its prompt in sequence seq's cache; Failed when the prompt cannot run."""
        engine, ids = self.engine, list(job.prompt_ids)
        if not ids:
            return Failed(EdgespecError("the prompt is empty (give some text to continue)"))
        if len(ids) >= engine.n_ctx:
            return Failed(ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {engine.n_ctx} (raise --n-ctx or shorten the prompt)"))
        lane = Lane({"none": NoDrafter(), "ngram": NgramDrafter()}, mode=self.mode)
        generation = engine.begin(ids, job.params, lane, seq, prediction=job.prediction, pool=job.pool)
        generation.counters.mode = self.mode
        started = time.perf_counter()
        self._reuse_prefix(ids, seq)
        reused = generation.counters.prompt_tokens_reused = engine.restore_prefix(engine.target, ids, seq)
        try:
            engine.target.decode(ids[reused:-1], n_logits=0, seq=seq)
        except EdgespecError as err:
            engine.target.rewind(0, seq)
            return Failed(err)
        generation.counters.prefill_seconds = time.perf_counter() - started
        generation.decode_start = time.perf_counter()
        return generation

    def _place_for(self, ids: list[int], free: list[int]) -> int:
        """The free sequence whose cache shares the longest prefix with ids (the lowest on a tie)."""
        return max(sorted(free), key=lambda seq: common_prefix_length(self.engine.target.cached_of(seq), ids))

    def _reuse_prefix(self, ids: list[int], seq: int) -> int:
        """Leave in sequence seq's cache the longest prefix of ids any sequence holds (copied from it if
        that pays); return its length, at most len(ids) - 1 (the last token is evaluated by the first step)."""
        target = self.engine.target
        shared = {other: common_prefix_length(target.cached_of(other), ids) for other in range(self.parallel)}
        best = max(shared, key=lambda other: (shared[other], other == seq))
        keep = min(shared[seq], len(ids) - 1)
        if shared[best] - shared[seq] >= MIN_COPIED_PREFIX:
            keep = min(shared[best], len(ids) - 1)
            target.copy_sequence(best, seq, keep)
        target.rewind(keep, seq)
        return keep

    def _step(self, active: dict, cancel) -> Iterator[tuple[object, Step | Done | Failed]]:
        """One shared pass over every active generation; their steps, and a Done for each that ended."""
        engine, cancelled = self.engine, cancel is not None and cancel.is_set()
        running = []
        for key, (generation, job) in list(active.items()):  # the caller drops each one that ends
            if cancelled or (job.cancel is not None and job.cancel.is_set()):
                generation.counters.finish_reason = "cancelled"
            room = engine.room(generation)
            if generation.finished:
                engine.save_prefixes(generation.seq)
                yield key, generation.done()
                engine.remember(generation)
            else:
                running.append((key, generation, engine.draft_choice(generation, room)))
        if not running:
            return
        lengths = joint_draft_lengths([choice for _, _, choice in running], engine.cost)
        drafts = [engine.propose(g, choice, k) for (_, g, choice), k in zip(running, lengths)]
        parts = []
        for (_, generation, _), draft in zip(running, drafts):
            context = generation.context
            engine.target.rewind(len(context) - 1, generation.seq)
            parts.append((generation.seq, [context[-1], *draft.tokens], len(draft.tokens) + 1))
        try:
            rows = engine.target.decode_sequences(parts)
        except EdgespecError as err:  # the pass failed for all of them
            for key, generation, _ in running:
                engine.target.rewind(0, generation.seq)
                yield key, Failed(err)
            return
        for (key, generation, _), draft, logits in zip(running, drafts, rows):
            try:
                yield key, engine.conclude_step(generation, draft, logits)
            except NonFiniteLogits:
                engine.target.rewind(0, generation.seq)
                yield key, Failed(engine.corrupt_model_error())
                continue
            if generation.finished:
                engine.save_prefixes(generation.seq)
                yield key, generation.done()
                engine.remember(generation)
