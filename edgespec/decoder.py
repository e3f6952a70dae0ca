"""One decoding step for one generation or many: draft -> one target pass -> verify -> roll back -> emit.

A step plans the drafts of the active generations, runs the target once over
every one's [last token, d1..dk] (asking llama.cpp for exactly those rows of
logits, never logits_all), then concludes each generation's step on its own
rows: rejection sampling accepts a prefix of its draft and appends one more
token from the target, and its sequence's KV cache keeps the accepted part
only.  With k = 0 a step is plain decoding, so every mode (and the baseline)
runs through this same step.

A lone generation (Engine.generate, a chat, batch and serve at --parallel 1)
is a batch of one: its draft length is its own controller's choice, and it
may draft with the draft model and shift a dropped chat turn out of its
cache.  Generations decoded together (the Scheduler at --parallel N) draft
with n-grams or heads, their lengths chosen together for the shared pass.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

import numpy as np

from .backend import LlamaModel
from .calibration import StepTimeWatch
from .costs import prefill_rows
from .drafting import Draft, DraftChoice, DraftPlanner
from .drafters import NgramDrafter
from .errors import CorruptModelError, EdgespecError
from .generation import Done, DrafterSet, Failed, Generation, PlainPace, Step, Token
from .limits import MAX_OUTPUT_ROWS
from .ngram_pool import NgramPool, TokenIndex
from .prompts import check_prompt_ids
from .sampling import SamplingParams, SparseProbs, to_probs
from .sequence_cache import SequenceCache
from .stats import Counters
from .text import TextAssembler
from .verify import Verdict, verify

DRAFT_MODEL_MODES = ("draft-model", "combined")


class Decoder:
    """Starts generations in the target's sequences and takes their steps, one target pass per step."""

    def __init__(self, planner: DraftPlanner, cache: SequenceCache, draft_cache: SequenceCache | None = None):
        self.planner = planner
        self.cache = cache  # the target's sequences
        self.draft_cache = draft_cache  # the draft model's one sequence, when a draft model is loaded
        self.target = cache.model
        self.step_watch: StepTimeWatch | None = None  # flags a cost curve that no longer matches one-sequence passes
        self.plan_reason: str | None = None  # why the memory plan chose the drafter, for the stats
        self.plain_step_seconds: float | None = None  # measured one-token target pass; None for a given curve
        self.pool: NgramPool | None = None  # earlier texts for n-gram drafts, unless a generation brings its own

    @property
    def draft_model(self) -> LlamaModel | None:
        return self.draft_cache.model if self.draft_cache is not None else None

    # -- starting a generation -----------------------------------------------

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, drafter_set: DrafterSet, seq: int = 0,
              shift: bool = False, prediction: Sequence[int] | None = None, pool: NgramPool | None = None,
              chunked: bool = False, stop: threading.Event | None = None, scope: str = "") -> Generation:
        """A generation after prompt_ids, its prompt in sequence seq's cache (all but the last token).

        shift: the caller accepts a cache with a dropped span shifted out
        (SequenceCache.shift_out_dropped_span) for one recomputed; never under
        bit_exact.  prediction: tokens the output is expected to mostly repeat,
        a draft source (every token is verified); pool: the pool of other texts
        its n-gram drafts may come from (None: the decoder's).  chunked: what
        no cache holds of the prompt is fed by the next steps, in chunks inside
        their passes (the scheduler's generations decoded together, which draft
        with n-grams or heads, never the draft model).  stop: once set, the
        prefill ends after its current chunk and the generation is cancelled
        (a job's cancel).  scope: whose prompt it is (SequenceCache.claim), ""
        for the user's own.  Raises EdgespecError for a prompt that cannot run.
        """
        check_prompt_ids(prompt_ids, self.target.n_vocab, self.n_ctx)
        planner = self.planner
        counters = Counters(drafter_set.mode or planner.mode, self.plan_reason, prompt_tokens=len(prompt_ids),
                            bit_exact=planner.bit_exact, flash_attn=self.target.flash_attn,
                            plain_step_seconds=self.plain_step_seconds or 0.0)
        pool = pool if pool is not None else self.pool
        ngram = drafter_set.drafters.get("ngram")
        if isinstance(ngram, NgramDrafter):
            ngram.use_sources(TokenIndex(prediction) if prediction else None, pool)
        if pool is not None:
            pool.add(prompt_ids)
        generation = Generation(list(prompt_ids), params, drafter_set, counters, np.random.default_rng(params.seed),
                                TextAssembler(params.stop), seq, pool=pool, prediction=prediction or (),
                                pace=PlainPace(planner.cost.relative() if planner.cost is not None else ()))
        started = time.perf_counter()
        self.cache.claim(seq, scope)
        if seq == 0 and self.draft_cache is not None:
            self.draft_cache.claim(0, scope)
        try:
            if chunked:  # a lone generation's cache is its own (and may be shifted first)
                self.cache.share_prefix(list(prompt_ids), seq, among=self.target.n_seq)
                counters.prompt_tokens_reused = self.cache.prepare(generation.context, seq)
                generation.prefilling = counters.prompt_tokens_reused < len(prompt_ids) - 1
                generation.prefill_start = started
            else:
                counters.prompt_tokens_reused = self._prefill(generation, shift and self.shifts_context, stop)
                if stop is not None and stop.is_set():  # the cache may hold only part of the prompt: no step
                    generation.finish("cancelled")
        except EdgespecError:
            self.target.rewind(0, seq)
            raise
        counters.prefill_seconds = time.perf_counter() - started
        generation.draft_passes_at_start = self.draft_model.forward_passes if self.draft_model is not None else 0
        generation.decode_start = time.perf_counter()
        return generation

    def _prefill(self, generation: Generation, shift: bool, stop: threading.Event | None) -> int:
        """Put all but the last prompt token in the target's cache (and the draft's, when it drafts);
        return how many the target had cached already.  Once stop is set, the prefill ends early (and start
        ends the generation)."""
        context, seq = generation.context, generation.seq
        reused = self.cache.prefill(context, seq, shift=shift and seq == 0, stop=stop)
        # A draft model its controller does not expect to draft with (one asked for on a machine where its
        # tokens cost too much to pay) is not fed the prompt: on a CPU that would cost about as much as the
        # target's own prefill.  Should it draft after all, its first proposal catches its cache up.
        if not (stop is not None and stop.is_set()) and (self._drafts_with_draft_model(generation)
                and self.planner.may_draft("draft-model", generation.drafter_set)):
            self.draft_cache.prepare(context, 0, shift=shift)
            generation.drafter_set.drafters["draft-model"].prefill(context)
        return reused

    def _drafts_with_draft_model(self, generation: Generation) -> bool:
        return (self.draft_cache is not None and generation.counters.mode in DRAFT_MODEL_MODES
                and "draft-model" in generation.drafter_set.drafters)

    def _draft_model_holds_prompt(self, generation: Generation) -> bool:
        """Whether the draft model's cache starts with this generation's prompt (it was fed the prompt, or
        caught up when it drafted), so that a snapshot of it is one of this prompt."""
        prompt = generation.context[: generation.counters.prompt_tokens - 1]
        return self.draft_model.cached[: len(prompt)] == prompt

    @property
    def shifts_context(self) -> bool:
        """Whether a dropped turn is shifted out of the caches, when the caller allows it, rather than the rest recomputed."""
        return not self.planner.bit_exact and self.target.can_shift

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    # -- one step --------------------------------------------------------------

    def step(self, generations: Sequence[Generation], together: bool = False
             ) -> Iterator[tuple[Generation, Step | Done | Failed]]:
        """One target pass over every unfinished generation: each one's Step, and a Done for each that ended.

        together: the drafts' lengths are chosen together for the shared
        pass; otherwise (one generation) by its own controller.  A finished
        generation (cancelled by the caller, or out of context) gets its Done
        without a pass.  A generation whose prompt is still being fed gets a
        chunk of it into the pass (SequenceCache.prompt_chunks, sized on the
        cost curve), and its first step in the pass that feeds the last chunk.
        """
        running, rooms, filling = [], [], []
        for generation in generations:
            room = self.n_ctx - len(generation.context)
            if room <= 0 and not generation.finished:
                generation.finish("context")
            if generation.finished:
                yield generation, self.end(generation)
            elif generation.prefilling:
                filling.append(generation)
            else:
                running.append(generation)
                rooms.append(room)
        feeds = self.prompt_chunks(filling, len(running)) if filling else {}
        fed = [generation for generation in filling if generation.seq in feeds]
        feeding = []  # those whose prompt is not whole after this pass
        for generation in fed:
            if len(self.target.cached_of(generation.seq)) + len(feeds[generation.seq]) < len(generation.context) - 1:
                feeding.append(generation)
            else:  # its prompt is whole after this pass: it takes its first step in it
                running.append(generation)
                rooms.append(self.n_ctx - len(generation.context))
        if not running and not feeding:
            return
        prompt_rows = sum(len(chunk) for chunk in feeds.values())
        choices, lengths = self.choose_lengths(running, rooms, together, prompt_rows, len(feeding))
        drafts = [self.propose(generation, choice, k) for generation, choice, k in zip(running, choices, lengths)]
        self.planner.keep_hidden_rows(running, drafts, together)
        passed_at = time.perf_counter()
        try:
            rows = self.run_pass(running, drafts, observe=not together, feeds=feeds)
        except EdgespecError as err:  # the pass failed for all of them
            for generation in running + feeding:
                self.target.rewind(0, generation.seq)
                yield generation, Failed(err)
            return
        for generation in fed:
            self.fed(generation, feeds[generation.seq], passed_at)
        for generation, draft, logits in zip(running, drafts, rows):
            try:
                yield generation, self.conclude(generation, draft, logits)
            except NonFiniteLogits:
                self.target.rewind(0, generation.seq)
                yield generation, Failed(self.corrupt_model_error())
                continue
            if generation.finished:
                yield generation, self.end(generation)

    def prompt_chunks(self, filling: Sequence[Generation], decode_rows: int) -> dict[int, list[int]]:
        """The chunk of each waiting prompt that goes into the next pass, by sequence: as many prompt tokens in
        all as the cost curve says a pass over decode_rows other rows should carry (costs.prefill_rows)."""
        budget = prefill_rows(self.planner.cost, decode_rows, decode_rows, self.target.n_batch - MAX_OUTPUT_ROWS)
        return self.cache.prompt_chunks([(g.seq, g.context) for g in filling], budget)

    def fed(self, generation: Generation, chunk: list[int], passed_at: float) -> None:
        """Count a chunk of the prompt as fed in the pass begun at passed_at; when it was the last, the
        prompt's figures are final and decoding began with that pass."""
        generation.prompt_evaluated += len(chunk)
        if len(self.target.cached_of(generation.seq)) >= len(generation.context) - 1:
            generation.prefilling = False
            counters = generation.counters
            counters.prompt_tokens_reused = len(generation.context) - 1 - generation.prompt_evaluated
            counters.prefill_seconds = passed_at - generation.prefill_start
            generation.decode_start = passed_at

    def choose_lengths(self, generations: Sequence[Generation], rooms: Sequence[int], together: bool,
                       prompt_rows: int = 0, prompt_sequences: int = 0) -> tuple[list[DraftChoice], list[int]]:
        """Each generation's drafter and draft length for the next pass, which also carries prompt_rows rows
        of prompt_sequences other sequences' prompts."""
        return self.planner.choose(generations, rooms, together, prompt_rows, prompt_sequences)

    def propose(self, generation: Generation, choice: DraftChoice, k: int) -> Draft:
        return self.planner.propose(generation, choice, k)

    def run_pass(self, generations: Sequence[Generation], drafts: Sequence[Draft], observe: bool,
                 feeds: dict[int, list[int]] | None = None) -> list[np.ndarray]:
        """One target pass over each generation's [last token, *draft], after its prompt chunk if feeds has
        one, and over the other chunks of feeds: each generation's rows of logits, read-only views of
        llama.cpp's buffer, valid until the next pass.  observe: time it for the step watch."""
        target = self.target
        for generation in generations:  # each cache holds context[:-1] (a fed one, all but its chunk)
            target.rewind(len(generation.context) - 1, generation.seq)
            # untimed unless timed below: a given cost curve, or a pass several sequences share, prices it
            generation.pass_seconds = None
        if len(generations) > 1 or feeds:
            for generation in generations:  # its own prompt's chunk is its time alone
                generation.shared_a_pass |= len(generations) > 1 or any(seq != generation.seq for seq in feeds or {})
            feeds = dict(feeds or {})
            parts = [(g.seq, [*feeds.pop(g.seq, []), g.context[-1], *d.tokens], len(d.tokens) + 1)
                     for g, d in zip(generations, drafts)]
            return target.decode_sequences(parts + [(seq, chunk, 0) for seq, chunk in feeds.items()])[: len(parts)]
        (generation,), (draft,) = generations, drafts
        started = time.perf_counter()
        logits = target.decode([generation.context[-1], *draft.tokens], n_logits=len(draft.tokens) + 1,
                               copy=False, seq=generation.seq)
        if observe and self.step_watch is not None:
            generation.pass_seconds = time.perf_counter() - started
            self.step_watch.observe(len(draft.tokens) + 1, generation.pass_seconds)
        return [logits]

    def conclude(self, generation: Generation, draft: Draft, logits: np.ndarray) -> Step:
        """Verify the draft against the target's logits rows for [last token, *draft], keep the accepted part
        in the generation's cache, and emit the step's tokens."""
        verdict = self.verify(generation, draft, logits)
        accepted = draft.tokens[: verdict.n_accepted]
        self.keep_accepted(generation, len(accepted))
        self.learn(draft, len(accepted), generation.pass_seconds)
        if self.draft_model is not None:
            generation.counters.draft_forward_passes = self.draft_model.forward_passes - generation.draft_passes_at_start
        return self.emit(generation, [*accepted, verdict.next_token], draft)

    @staticmethod
    def verify(generation: Generation, draft: Draft, logits: np.ndarray) -> Verdict:
        return verify(_LazyRows(logits, generation.params), draft.tokens, draft.probs, generation.rng)

    def keep_accepted(self, generation: Generation, n_accepted: int) -> None:
        """Cut the sequence's cache back to the context and the accepted draft tokens."""
        self.target.rewind(len(generation.context) + n_accepted, generation.seq)

    @staticmethod
    def learn(draft: Draft, n_accepted: int, seconds: float | None) -> None:
        """Tell the draft's controller how it went, and what the pass took (None: untimed)."""
        controller = draft.choice.controller
        if controller is not None:
            controller.update(len(draft.tokens), n_accepted, draft.choice.hint.signal, seconds)

    def emit(self, generation: Generation, new_tokens: list[int], draft: Draft) -> Step:
        """The step's tokens as text, up to the first stop (end of generation, stop string, max_tokens)."""
        n_accepted = len(new_tokens) - 1  # the last is the target's own token
        counters, text, generated = generation.counters, generation.text, generation.generated
        _count_step(counters, draft, n_accepted)
        tokens, sampled_end_token = [], False
        for i, token in enumerate(new_tokens):
            if self.target.is_end_of_generation(token):
                generation.finish("stop")
                sampled_end_token = True
                break
            generated.append(token)
            piece = text.feed(self.target.token_bytes(token))
            tokens.append(Token(token, piece, draft.choice.drafter.name if i < n_accepted else None))
            if text.stopped:
                generation.finish("stop")
                break
            if len(generated) >= generation.params.max_tokens:
                generation.finish("length")
                break
        generation.context.extend(new_tokens)
        counters.tokens_generated = len(generated)
        decode_seconds = time.perf_counter() - generation.decode_start
        step_seconds, counters.decode_seconds = decode_seconds - counters.decode_seconds, decode_seconds
        if generation.pass_seconds is not None:  # a lone pass, timed: the step's whole time paces plain decoding
            generation.pace_step(len(draft.tokens) + 1, step_seconds, sampled_end_token)
        return Step(tokens, counters.snapshot(), len(draft.tokens), n_accepted)

    def end(self, generation: Generation) -> Done:
        """The generation's Done, after offering its caches to the prompt cache."""
        self.cache.offer(generation.seq)
        if (generation.seq == 0 and self._drafts_with_draft_model(generation)
                and self._draft_model_holds_prompt(generation)):
            self.draft_cache.offer(0)
        return generation.done()

    def remember(self, generation: Generation) -> None:
        """After a generation's Done: what its passes cost goes to the calibration cache, what its controllers
        learned to the learned priors, its output to its pool (the caller has its answer while this bookkeeping
        runs)."""
        if self.step_watch is not None:
            self.step_watch.remember()
        learned = self.planner.learned
        if learned is not None:
            for (name, _), controller in generation.drafter_set.controllers.items():
                learned.learn(name, controller.estimate.export())
        if generation.pool is not None:
            generation.pool.add(generation.generated)

    def corrupt_model_error(self) -> CorruptModelError:
        """What a generation that met NaN or infinite logits ends with."""
        path = self.target.path
        return CorruptModelError(f"{path.name} computed NaN or infinite logits, so the model file {path} is likely "
                                 "corrupt (download it again, or convert it afresh)")


def _count_step(counters: Counters, draft: Draft, n_accepted: int) -> None:
    width = len(draft.tokens) + 1
    counters.steps += 1
    counters.target_forward_passes += 1
    counters.draft_tokens_proposed += len(draft.tokens)
    counters.draft_tokens_accepted += n_accepted
    counters.k0_steps += not draft.tokens
    counters.widest_pass = max(counters.widest_pass, width)
    counters.pass_widths[width] = counters.pass_widths.get(width, 0) + 1
    name = draft.choice.drafter.name
    if n_accepted:
        counters.accepted_by_drafter[name] = counters.accepted_by_drafter.get(name, 0) + n_accepted
    if draft.tokens:
        _count_positions(counters.drafted_by_position.setdefault(name, []), len(draft.tokens))
        _count_positions(counters.accepted_by_position.setdefault(name, []), n_accepted)


def _count_positions(counts: list[int], n: int) -> None:
    """One more at each of the first n draft positions."""
    counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


class _LazyRows:
    """Target probability rows, computed only for the positions the verifier reaches.

    The logits are read where llama.cpp wrote them (no copy), and a row
    becomes a SparseProbs only when the verifier asks for it.
    """

    def __init__(self, logits: np.ndarray, params: SamplingParams):
        self._logits, self._params = logits, params
        self._rows: dict[int, SparseProbs] = {}

    def __len__(self) -> int:
        return len(self._logits)

    def __getitem__(self, i: int) -> SparseProbs:
        row = self._rows.get(i)
        if row is None:
            if not np.isfinite(self._logits[i].max()):  # max is NaN if any logit is
                raise NonFiniteLogits
            row = self._rows[i] = to_probs(self._logits[i], self._params)
        return row


class NonFiniteLogits(Exception):
    """A logits row the verifier reads holds NaN or inf: the decoder names the model."""
