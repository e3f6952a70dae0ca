"""The decoding loop: jobs start in free sequences of the target's context, one shared pass per step.

One pass over n rows costs about T(n) whoever the rows belong to (the profile
measures what spreading them over sequences adds), and on a CPU T(n) grows far
slower than n.  The scheduler keeps up to `parallel` generations in the
target's context (one shared KV buffer) and runs one decoder step per pass
over every active sequence's last token and draft; a finished sequence's
place goes to the next job at once (continuous batching), and the new job's
prompt is fed in chunks inside the passes that decode the others, sized on
the cost curve, rather than in passes of its own while they wait.

Each sequence has its own drafting (n-gram index, draft-length controllers),
its own random stream, and verifies its own rows by rejection sampling, so
every output is exact in distribution as in a lone generation.  Only the
draft lengths are chosen together (edgespec.drafting.joint_draft_lengths).

With parallel = 1 the loop runs one generation at a time, each a batch of
one: it drafts with the engine's own drafting (the draft model included, its
controllers learning across generations) and may shift a chat's dropped turn
out of its cache.  The draft model drafts one sequence at a time (its cache
holds one), so sequences decoded together draft with n-grams.  --bit-exact
never decodes together: a row in a shared pass is computed by the kernels for
that pass's width, as a lone wide pass's rows are, so the batch command runs
one sequence at a time under it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .costs import CostModel
from .decoder import Decoder
from .drafting import DrafterSet
from .errors import EdgespecError
from .generation import Done, Failed, Generation, Step
from .limits import checked_setting
from .ngram_pool import NgramPool
from .sampling import SamplingParams


@dataclass(frozen=True)
class Job:
    key: object  # the caller's name for it, given back with every event
    prompt_ids: list[int]
    params: SamplingParams
    cancel: threading.Event | None = None  # set: the job ends after its current step
    shift_dropped_span: bool = False  # a chat that dropped its oldest turn accepts it shifted out (parallel = 1)
    prediction: Sequence[int] | None = None  # tokens the output is expected to mostly repeat (a draft source)
    pool: NgramPool | None = None  # the pool of other texts its drafts may come from (None: the decoder's)
    cache_scope: str = ""  # whose prompt it is: its cache is shared only with this scope's (SequenceCache.claim)

    def __post_init__(self):
        # a library caller's cancel=True would otherwise fail in the middle of the generation
        if self.cancel is not None and not isinstance(self.cancel, threading.Event):
            raise TypeError(f"cancel must be a threading.Event (set it to stop), not {type(self.cancel).__name__}")


def best_parallel(cost: CostModel, limit: int) -> int:
    """The number of sequences, 1..limit, that gives the most tokens per second over all of them, each
    bringing the one row every step has (its own token), in passes priced over that many sequences.

    Drafted rows are not counted: they join a step only where they pay for their width at the step's
    acceptance (joint_draft_lengths), which no curve knows beforehand.
    """
    rates = [n / cost.pass_seconds(n, n) for n in range(1, limit + 1)]
    return int(np.argmax(rates)) + 1


class Scheduler:
    """Runs jobs `parallel` at a time through the decoder, one target pass per step."""

    def __init__(self, decoder: Decoder, parallel: int):
        checked_setting("parallel", parallel)
        self.decoder = decoder
        self.parallel = parallel
        if parallel > 1:
            decoder.target.reserve_sequences(parallel)

    def run(self, next_job: Callable[[bool], Job | None],
            cancel: threading.Event | None = None) -> Iterator[tuple[object, Step | Done | Failed]]:
        """Every job's events, as they happen: Steps, then a Done (or a Failed).

        next_job(wait) gives the next job, or None when there is none yet; with
        wait (nothing is running) it may block until one comes, and None then
        ends the run.  Once cancel is set no job starts and each one in flight
        ends with a Done whose finish_reason is "cancelled"; a job's own cancel
        does so for that job alone.
        """
        active: dict[int, tuple[Generation, Job]] = {}  # by sequence
        free = list(range(self.parallel - 1, -1, -1))
        while True:
            while free and not (cancel is not None and cancel.is_set()):
                job = next_job(not active)
                if job is None:
                    break
                seq = self.decoder.cache.place(job.prompt_ids, free, job.cache_scope)
                free.remove(seq)
                started = self._start(job, seq)
                if isinstance(started, Failed):
                    free.append(seq)
                    yield job.key, started
                else:
                    active[seq] = started, job
            if not active:
                return
            for generation, job in active.values():
                if (cancel is not None and cancel.is_set()) or (job.cancel is not None and job.cancel.is_set()):
                    generation.finish("cancelled")
            generations = [generation for generation, _ in active.values()]
            for generation, event in self.decoder.step(generations, together=self.parallel > 1):
                key = active[generation.seq][1].key
                if isinstance(event, (Done, Failed)):
                    del active[generation.seq]
                    free.append(generation.seq)
                yield key, event
                if isinstance(event, Done):
                    self.decoder.remember(generation)

    def _start(self, job: Job, seq: int) -> Generation | Failed:
        """The job's generation, its prompt in sequence seq's cache; Failed when the prompt cannot run."""
        decoder = self.decoder
        try:
            return decoder.start(job.prompt_ids, job.params, self._drafter_set(seq), seq,
                                 shift=job.shift_dropped_span and self.parallel == 1, prediction=job.prediction,
                                 pool=job.pool, chunked=self.parallel > 1, stop=job.cancel, scope=job.cache_scope)
        except EdgespecError as err:
            return Failed(err)

    def _drafter_set(self, seq: int) -> DrafterSet:
        """A lone generation drafts with the planner's own drafting; each of several decoded together with
        n-grams (and heads, when loaded) of its own."""
        planner = self.decoder.planner
        if self.parallel == 1:
            return planner.own
        return planner.sequence_drafter_set(seq)
