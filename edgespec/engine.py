"""The speculative decoding loop: prefill -> draft -> verify -> roll back -> emit.

One step drafts k tokens after the context, runs the target once over
[last token, d1..dk], accepts a prefix by rejection sampling and appends one
more token from the target.  The target's KV cache then keeps the accepted
part only.  With k = 0 a step is plain decoding, so every mode (and the
baseline) runs through this same loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from .backend import RUNTIME, LlamaModel, common_prefix_length, dropped_span, load_state, state_bytes
from .calibration import PLANNED_WIDTHS, WIDTH_PROBE_BUDGET_SECONDS, CalibrationCache, CalibrationKey, StepTimeWatch, measure_curve
from .controller import HINDSIGHT_DECAY, NGRAM_PRIOR_BY_BUCKET, DraftLengthController
from .costs import CostModel, best_speedup
from .chat_template import ChatTemplate
from .drafters import DraftModelDrafter, Drafter, Hint, NgramDrafter, NoDrafter
from .limits import MAX_DRAFT_TOKENS
from .errors import ContextOverflowError, CorruptModelError, EdgespecError
from .notices import print_notice
from .sampling import SamplingParams, SparseProbs, to_probs
from .phases import PhaseClock
from .prefix_cache import PrefixStore, SnapshotKey
from .stats import Stats
from .text import TextAssembler
from .verify import verify

# Restoring a snapshot reads and checks its whole file; for a handful of tokens prefill is cheaper.
MIN_RESTORE_GAIN = 32

if TYPE_CHECKING:  # the engine only keeps the plan it was loaded with, for its reason and for display
    from .planner import Plan



@dataclass(frozen=True)
class Token:
    id: int
    text: str  # may be "" while a UTF-8 character or a possible stop string is incomplete
    drafter: str | None = None  # the drafter that proposed it ("ngram", "draft-model"); None: sampled from the target

    @property
    def drafted(self) -> bool:
        """Proposed by a drafter and accepted, rather than sampled from the target."""
        return self.drafter is not None


@dataclass(frozen=True)
class Step:
    tokens: list[Token]
    stats: Stats  # the whole generation's figures so far
    drafted: int = 0  # tokens the drafter proposed in this step
    accepted: int = 0  # of those, accepted by the verifier


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "context" | "cancelled"
    stats: Stats


@dataclass(frozen=True)
class Done:
    result: GenerationResult


@dataclass
class _Counters:
    mode: str
    plan_reason: str | None = None
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0
    tokens_generated: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    steps: int = 0
    k0_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str | None = None
    bit_exact: bool = False
    widest_pass: int = 0
    accepted_by_drafter: dict = field(default_factory=dict)  # accepted draft tokens per drafter name
    drafted_by_position: dict = field(default_factory=dict)  # per drafter: tokens proposed at draft position 1, 2, ...
    accepted_by_position: dict = field(default_factory=dict)  # per drafter: of those, accepted
    pass_widths: dict = field(default_factory=dict)  # verification passes per width

    def snapshot(self) -> Stats:
        return Stats.from_counts(**dataclasses.asdict(self))


@dataclass
class Lane:
    """What one sequence drafts with: its drafters and their draft-length controllers (by drafter and fixed k).

    The engine's own lane serves its one-at-a-time generations and keeps what
    its controllers learn across them; the scheduler gives each sequence it
    decodes in parallel a lane of its own, as an n-gram index and acceptance
    estimates belong to one text.
    """

    drafters: dict[str, Drafter]
    controllers: dict[tuple[str, int | None], DraftLengthController] = field(default_factory=dict)
    mode: str | None = None  # the drafting mode, when not the engine's


@dataclass
class Generation:
    """One generation in progress: its sequence in the target's cache, its context, sampling and figures."""

    context: list[int]
    params: SamplingParams
    lane: Lane
    counters: _Counters
    rng: np.random.Generator
    text: TextAssembler
    seq: int = 0
    generated: list[int] = field(default_factory=list)
    decode_start: float = 0.0

    @property
    def finished(self) -> bool:
        return self.counters.finish_reason is not None

    def done(self) -> Done:
        self.counters.decode_seconds = time.perf_counter() - self.decode_start
        return Done(GenerationResult(self.text.text, self.generated, self.counters.finish_reason,
                                     self.counters.snapshot()))


@dataclass(frozen=True)
class DraftChoice:
    """The drafter of a step, what it hinted, the most tokens it may draft, and its controller (None: no drafting)."""

    drafter: Drafter
    hint: Hint
    cap: int
    controller: DraftLengthController | None


@dataclass(frozen=True)
class Draft:
    """A step's draft, made before its verification pass: what was proposed, and by whose choice."""

    choice: DraftChoice
    tokens: list[int]
    probs: object = None  # the draft model's distributions, for rejection sampling; None for n-grams




class Engine:
    def __init__(self, target: LlamaModel, draft: LlamaModel | None, mode: str, draft_tokens: int | str,
                 plan: Plan | None = None, bit_exact: bool = False, heads: Drafter | None = None):
        self.target = target
        self.draft = draft
        self.plan = plan
        self._draft_tokens = draft_tokens
        self._drafter_costs: dict[str, CostModel] = {}  # filled by calibrate()
        self.cost: CostModel | None = None  # the cost curve the controllers use, once calibrated
        self.plain_step_seconds: float | None = None  # measured one-token target pass; None for a given curve
        self.bit_exact = bit_exact  # verify only in passes as wide as llama.cpp computes bit-identically
        self.exact_width = 1  # the widest bit-identical pass, once calibrated
        self.kernel_drift: dict[int, float] = {}  # per checked width: largest logit difference from one-token passes
        self._widest = 1  # the widest pass the cost curve covers, once calibrated
        self._step_watch: StepTimeWatch | None = None
        self._calibration: tuple[CalibrationCache, CalibrationKey] | None = None  # None: the curve was given
        self._stale_curve = False  # a stale cached curve is in use until recalibrate()
        self.phase_clock: PhaseClock | None = None  # set by `bench --overhead`
        self.prefix_caches: list[PrefixStore] = []  # where KV snapshots of long prompts are kept and restored from
        self._shift_allowed = False  # this generation's caller accepts a shifted cache (stream_tokens)
        self._shifted_at: dict[LlamaModel, int] = {}  # where a model's cache holds shifted keys and values
        self._drafters = {"none": NoDrafter(), "ngram": NgramDrafter()}
        if draft is not None:
            self._drafters["draft-model"] = DraftModelDrafter(draft, target.n_vocab)
            self._drafters["combined"] = self._drafters["draft-model"]  # picks per step between it and n-grams
        if heads is not None:  # a HeadsDrafter over this target, a HiddenStateModel
            self._drafters["heads"] = heads
            self._drafters.setdefault("combined", heads)
        self._lane = Lane(self._drafters)
        self.configure(mode=mode, bit_exact=bit_exact)  # refuses bit_exact over flash attention
        self.chat_template = ChatTemplate(
            target.metadata("tokenizer.chat_template"),
            bos_token=target.token_bytes(target.bos_id).decode("utf-8", "replace") if target.bos_id >= 0 else "",
            eos_token=target.token_bytes(target.eos_id).decode("utf-8", "replace") if target.eos_id >= 0 else "",
        )
        self._lock = threading.Lock()

    def close(self) -> None:
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def calibrate(
        self,
        cache: CalibrationCache | None = None,
        *,
        cost_curve: Sequence[float] | CostModel | None = None,
        notice: Callable[[str], None] | None = None,
        measure_stale_curve: bool = True,
    ) -> None:
        """Measure (or load) what each verification width costs and how far its logits drift.

        Verification passes may be as wide as the cost curve pays for, up to
        MAX_DRAFT_TOKENS + 1 tokens; acceptance is exact rejection sampling
        over the logits llama.cpp computes for that pass.  Those logits can
        differ slightly from a one-token pass (the kernels change with the
        number of rows), so the probe also finds the widest pass that is
        bit-identical (the cap under bit_exact) and the largest logit drift of
        each checked width (kernel_drift).  The first load of a model on a
        machine measures all of it (within the budgets in calibration.py) and
        says so through notice; later loads read the cache.

        cost_curve fixes the curve instead: seconds (or any one unit) per
        target pass over 1, 2, ... tokens; a CostModel also fixes the draft
        model's cost per drafted token, else it is 0.  Then nothing is timed
        or cached, the controllers' choices do not depend on the machine's
        speed or load, and drafts are at most len(cost_curve) - 1 tokens: the
        width probe (which compares logits, not times) checks only those
        widths, all of them.

        A cached curve that is stale (marked so by StepTimeWatch, or old) is
        measured again here, unless measure_stale_curve is False: then it is
        used as it is, calibration_due says so, and recalibrate() measures it
        when the caller is idle (the chat app does so between replies).
        """
        if cost_curve is not None:
            cost = cost_curve if isinstance(cost_curve, CostModel) else CostModel(cost_curve)
            widest = min(len(cost.forward_seconds), MAX_DRAFT_TOKENS + 1)
            probe = self.target.probe_pass_widths(self._probe_tokens(), widest, PLANNED_WIDTHS)
            self._calibration, self._stale_curve, self._step_watch = None, False, None
            self._use_cost(probe.exact_width, probe.drift, cost, plain_step_seconds=None, widest=widest)
            return
        cache = cache or CalibrationCache()
        key = CalibrationKey.for_model(self.target.path, self.target.n_gpu_layers, self.target.n_threads, RUNTIME,
                                       kv_cache=self.target.kv_cache_label)
        cached = cache.read(key)
        self._calibration = cache, key
        self._stale_curve = False
        if cached is None:
            (notice or print_notice)("measuring this model's speed, once (a few seconds; later runs reuse it) ...")
            probe = self.target.probe_pass_widths(
                self._probe_tokens(), MAX_DRAFT_TOKENS + 1, PLANNED_WIDTHS, WIDTH_PROBE_BUDGET_SECONDS)
            width, drift = probe.exact_width, probe.drift
            curve = self._measure_and_store(width, drift)
        elif cached.stale and measure_stale_curve:
            (notice or print_notice)("measuring this model's speed again: the last measurement no longer "
                                      "matches this machine (a few seconds) ...")
            width, drift = cached.max_width, cached.drift
            curve = self._measure_and_store(width, drift)
        else:
            width, drift, curve = cached.max_width, cached.drift, cached.forward_seconds
            self._stale_curve = cached.stale
        self._use_measured(width, drift, curve)

    def recalibrate(self) -> None:
        """Measure the cost curve again and use it from the next generation on.

        Takes the generation lock, so it never runs inside a generation: a
        running one finishes first, and the next one waits (a few seconds at
        most, CURVE_BUDGET_SECONDS).  Does nothing when the curve was given.
        """
        with self._lock:
            if self._calibration is None:
                return
            self._stale_curve = False
            curve = self._measure_and_store(self.exact_width, self.kernel_drift)
            self._use_measured(self.exact_width, self.kernel_drift, curve)

    @property
    def calibration_due(self) -> bool:
        """The cost curve in use no longer matches this machine: call recalibrate() when idle."""
        watch = self._step_watch
        return self._calibration is not None and (self._stale_curve or (watch is not None and watch.drifted))

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft a step may verify: the widest bit-exact pass under bit_exact, else the curve's."""
        return (min(self.exact_width, self._widest) if self.bit_exact else self._widest) - 1

    def drift_bound(self) -> float:
        """Twice the largest logit drift measured between wide and one-token passes.

        At temperature 0 a divergence from plain decoding where the target's
        two best logits are further apart than this cannot come from kernel
        rounding: it is a bug.  0.0 when every checked width is bit-identical.
        """
        return 2.0 * max(self.kernel_drift.values(), default=0.0)

    def _measure_and_store(self, width: int, drift: dict[int, float]) -> tuple[float, ...]:
        cache, key = self._calibration
        filler = max(self.target.bos_id, 0)
        curve = measure_curve(lambda n: self.target.time_forward(n, filler), MAX_DRAFT_TOKENS + 1)
        cache.store(key, width, curve, drift=drift)
        return curve

    def _use_measured(self, width: int, drift: dict[int, float], curve: tuple[float, ...]) -> None:
        cache, key = self._calibration
        self._step_watch = StepTimeWatch(cache, key, curve)
        draft_seconds = 0.0
        if self.draft is not None:
            draft_seconds = min(self.draft.time_forward(1, max(self.target.bos_id, 0)) for _ in range(5))
        heads = self._drafters.get("heads")
        heads_seconds = heads.seconds_per_token() if heads is not None else 0.0
        self._use_cost(width, drift, CostModel(curve, draft_seconds, heads_seconds), curve[0],
                       widest=MAX_DRAFT_TOKENS + 1)

    def _use_cost(self, width: int, drift: dict[int, float], cost: CostModel, plain_step_seconds: float | None,
                  widest: int) -> None:
        self.cost = cost
        self.plain_step_seconds = plain_step_seconds
        self.exact_width, self.kernel_drift = width, dict(drift)
        if widest != self._widest:
            self._lane.controllers = {}  # a re-measured curve keeps the acceptance learned so far
        self._widest = widest
        # only the draft model charges time per drafted token
        self._drafter_costs = {"ngram": CostModel(cost.forward_seconds)} if widest > 1 else {}
        if widest > 1 and "draft-model" in self._drafters:
            self._drafter_costs["draft-model"] = cost
        if widest > 1 and "heads" in self._drafters:
            self._drafter_costs["heads"] = CostModel(cost.forward_seconds, cost.heads_seconds_per_token)
        for (name, _), controller in self._lane.controllers.items():
            controller.set_cost(self._drafter_costs[name])

    def _controller(self, name: str, lane: Lane | None = None) -> DraftLengthController | None:
        """The draft-length controller of one drafter of a lane (the engine's own by default) under the
        current draft-tokens setting."""
        cost = self._drafter_costs.get(name)
        if cost is None:
            return None  # plain decoding, or a curve with no pass wider than one token
        fixed = None if self._draft_tokens == "auto" else min(int(self._draft_tokens), self._widest - 1)
        controllers = (lane or self._lane).controllers
        controller = controllers.get((name, fixed))
        if controller is None:
            # n-gram proposals are free to make, so their controller learns from every step in hindsight
            learning = ({"hindsight": True, "decay": HINDSIGHT_DECAY, "prior_by_bucket": NGRAM_PRIOR_BY_BUCKET}
                        if name == "ngram" else {})
            if name == "heads":  # the heads file's held-out accuracy, not a draft model's typical one
                learning["prior_acceptance"] = (lane or self._lane).drafters["heads"].acceptance_prior
            controller = controllers[(name, fixed)] = DraftLengthController(
                cost, self._widest - 1, fixed, **learning)
        return controller

    def draft_model_gain(self, acceptance: float) -> float:
        """The speedup over plain decoding the draft model would give at this acceptance, from the
        measured costs of both models (the best draft length; 1.0 when no draft length pays)."""
        cost = self._drafter_costs.get("draft-model")
        if cost is None:
            return 1.0
        return best_speedup(cost, acceptance, self.max_draft_tokens)[1]

    def draft_choice_notice(self) -> str:
        """One line on how this engine drafts with its draft model, from the measured costs."""
        name = self.draft.path.name
        if self.cost is None:
            return f"drafting with n-grams and {name}, chosen per step by expected speed"
        return (f"drafting with n-grams and {name}, chosen per step by expected speed "
                f"(a draft token costs {self.draft_token_share():.0%} of a target step here)")

    def drop_draft(self, reason: str) -> None:
        """Close the draft model and draft with n-grams alone from now on; reason says why (the plan shows it)."""
        self.draft.close()
        self.draft = None
        for name in ("draft-model", "combined"):
            self._drafters.pop(name)
        if "heads" in self._drafters:
            self._drafters["combined"] = self._drafters["heads"]  # n-grams and heads, chosen per step
        self._drafter_costs.pop("draft-model", None)
        self._lane.controllers = {key: c for key, c in self._lane.controllers.items() if key[0] != "draft-model"}
        if self.plan is not None:
            self.plan = dataclasses.replace(self.plan, mode="ngram", reason=reason)
        self.configure(mode="combined" if "combined" in self._drafters else "ngram")

    def draft_token_share(self) -> float:
        """The draft model's time per token as a fraction of a one-token target pass."""
        return self.cost.draft_seconds_per_token / self.cost.target(1)

    def _probe_tokens(self) -> list[int]:
        text = "The quick brown fox jumps over the lazy dog; def area(w, h): return w * h. " * 8
        return self.target.tokenize(text, add_special=True)

    def forget_cache(self) -> None:
        """Empty the KV caches, so the next prompt is evaluated in full."""
        self.target.rewind(0)
        if self.draft is not None:
            self.draft.rewind(0)

    def forget_learning(self) -> None:
        """Start the draft-length controllers afresh, from their priors, as a new process would.

        Within one engine they keep what they learned across generations (a chat's second reply
        drafts better than its first); a benchmark's runs must not learn from each other.
        """
        self._lane.controllers = {}

    def plain_logits(self, ids: list[int]) -> np.ndarray:
        """The target's logits after ids as plain decoding computes them: the last token in a pass of its own."""
        self.forget_cache()
        self.target.decode(ids[:-1], n_logits=0)
        logits = self.target.decode(ids[-1:], n_logits=1)[0]
        self.forget_cache()
        return logits

    # -- settings ------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def modes(self) -> tuple[str, ...]:
        """The drafting modes this engine can run (combined and draft-model need a draft model or heads)."""
        return tuple(self._drafters)

    @property
    def draft_tokens(self) -> int | str:
        """The draft length: a fixed k, or "auto" to follow the cost curve."""
        return self._draft_tokens

    def configure(self, *, mode: str | None = None, draft_tokens: int | str | None = None,
                  bit_exact: bool | None = None) -> None:
        """Switch the drafting mode, the draft length and/or the exactness guarantee; what is left None stays."""
        if mode is not None and mode not in self._drafters:
            have = ", ".join(self._drafters)
            raise EdgespecError(f"drafting mode {mode!r} is not available (available: {have}; draft-model needs --draft FILE)")
        if bit_exact and self.target.flash_attn:
            raise EdgespecError("bit-exact verification needs flash attention off; load the model without --flash-attn")
        if draft_tokens is not None and draft_tokens != "auto" and not (
                isinstance(draft_tokens, int) and 0 <= draft_tokens <= MAX_DRAFT_TOKENS):
            raise EdgespecError(f"draft tokens must be 'auto' or a whole number from 0 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}")
        if mode is not None:
            self._mode = mode
        if draft_tokens is not None:
            self._draft_tokens = draft_tokens
        if bit_exact is not None:
            self.bit_exact = bool(bit_exact)

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    @property
    def target_path(self) -> Path:
        return self.target.path

    @property
    def draft_path(self) -> Path | None:
        return self.draft.path if self.draft is not None else None

    # -- text <-> tokens -----------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Text with its control-token spellings parsed, like --raw input: never for user text in a chat."""
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt).text

    def prompt_tokens(self, prompt: str, raw: bool = False) -> list[int]:
        if raw:  # the user writes the control tokens on purpose
            return self.target.tokenize(prompt, add_special=True, parse_special=True)
        return self.chat_tokens([{"role": "user", "content": prompt}])

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as the model's template writes it; message contents never become control tokens."""
        rendered = self.chat_template.render(messages, add_generation_prompt)
        bos, spans = self.chat_template.bos_token, rendered.content_spans
        # a template that writes the BOS token itself must not get a second one; a message that does, must
        template_wrote_bos = bool(bos) and rendered.text.startswith(bos) and all(a >= len(bos) or a == b for a, b in spans)
        return self.target.tokenize(rendered.text, add_special=not template_wrote_bos, parse_special=True, plain_spans=spans)

    # -- generation ----------------------------------------------------------

    def generate(self, prompt: str, params: SamplingParams, raw: bool = False, cancel=None) -> GenerationResult:
        return result_of(self.stream(prompt, params, raw=raw, cancel=cancel))

    def stream(self, prompt: str, params: SamplingParams, raw: bool = False, cancel=None) -> Iterator[Step | Done]:
        return self.stream_tokens(self.prompt_tokens(prompt, raw), params, cancel=cancel)

    def stream_tokens(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None = None,
        shift_dropped_span: bool = False,
    ) -> Iterator[Step | Done]:
        """Generate after prompt_ids; yields one Step per verification and a final Done.

        shift_dropped_span: the caller (a chat that dropped its oldest turn)
        accepts a cache with that turn shifted out for one recomputed, see
        _shift_out_dropped_span.  Other callers get a cache as a fresh prefill
        would make it, so a prompt's output never depends on the one before.
        """
        if not prompt_ids:
            raise EdgespecError("the prompt is empty (give some text to continue)")
        if len(prompt_ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.n_ctx} (raise --n-ctx or shorten the prompt)"
            )
        with self._lock:
            self._shift_allowed = shift_dropped_span
            try:
                yield from self._generate(list(prompt_ids), params, cancel)
            except NonFiniteLogits:
                raise self.corrupt_model_error() from None

    def corrupt_model_error(self) -> CorruptModelError:
        """What a generation that met NaN or infinite logits ends with."""
        path = self.target.path
        return CorruptModelError(f"{path.name} computed NaN or infinite logits, so the model file {path} is likely "
                                 "corrupt (download it again, or convert it afresh)")

    def _generate(self, context: list[int], params: SamplingParams, cancel) -> Iterator[Step | Done]:
        generation = self.begin(context, params, self._lane)
        start = time.perf_counter()
        generation.counters.prompt_tokens_reused = self._prefill(context)
        generation.counters.prefill_seconds = time.perf_counter() - start
        draft_passes_before = self.draft.forward_passes if self.draft is not None else 0
        generation.decode_start = time.perf_counter()
        clock = self.phase_clock

        while True:
            if clock:
                clock.start()
            if cancel is not None and cancel.is_set():
                generation.counters.finish_reason = "cancelled"
            room = self.room(generation)
            if generation.finished:
                break
            draft = self.plan_draft(generation, room)
            # The cache holds context[:-1]; one pass scores the last token and every draft.
            self.target.rewind(len(context) - 1)
            if clock:
                clock.lap("rewind")
            started = time.perf_counter()
            # a view of llama.cpp's rows, read by the verifier before the next pass
            logits = self.target.decode([context[-1], *draft.tokens], n_logits=len(draft.tokens) + 1, copy=False)
            if clock:
                clock.lap("logits")
            if self._step_watch is not None:
                self._step_watch.observe(len(draft.tokens) + 1, time.perf_counter() - started)
            if clock:
                clock.lap("controller")
            if self.draft is not None:
                generation.counters.draft_forward_passes = self.draft.forward_passes - draft_passes_before
            step = self.conclude_step(generation, draft, logits)
            if clock:
                clock.lap("stats")
                clock.steps += 1
            yield step
        self.save_prefixes()
        yield generation.done()

    def begin(self, context: list[int], params: SamplingParams, lane: Lane, seq: int = 0) -> Generation:
        """A generation after context (whose cache the caller fills), drafting with lane's drafters, in sequence seq."""
        if self.cost is None:
            self.calibrate()
        counters = _Counters(self.mode, self.plan.reason if self.plan else None, prompt_tokens=len(context),
                             bit_exact=self.bit_exact)
        return Generation(context, params, lane, counters, np.random.default_rng(params.seed),
                          TextAssembler(params.stop), seq)

    def room(self, generation: Generation) -> int:
        """Tokens the generation's context has left; ends the generation ("context") when none."""
        room = self.n_ctx - len(generation.context)
        if room <= 0 and not generation.finished:
            generation.counters.finish_reason = "context"
        return room

    def plan_draft(self, generation: Generation, room: int) -> Draft:
        """The draft of the generation's next step, its length chosen by the drafter's controller."""
        choice = self.draft_choice(generation, room)
        k = choice.controller.choose(choice.hint.signal, choice.cap) if choice.controller is not None else 0
        if self.phase_clock:
            self.phase_clock.lap("controller")
        return self.propose(generation, choice, k)

    def propose(self, generation: Generation, choice: DraftChoice, k: int) -> Draft:
        """k tokens (at most; the drafter may stop early) from the chosen drafter."""
        stop_below = choice.controller.stop_thresholds() if choice.controller is not None else ()
        proposal = (choice.drafter.propose(generation.context, k, generation.params, generation.rng, stop_below)
                    if k > 0 else None)
        if self.phase_clock:
            self.phase_clock.lap("propose")
        return Draft(choice, proposal.tokens if proposal else [], proposal.probs if proposal else None)

    def conclude_step(self, generation: Generation, draft: Draft, logits: np.ndarray) -> Step:
        """Verify the draft against the target's logits rows for [last token, *draft], keep the accepted part
        in the generation's cache, and emit the step's tokens."""
        clock = self.phase_clock
        verdict = verify(_LazyRows(logits, generation.params), draft.tokens, draft.probs, generation.rng)
        accepted = draft.tokens[: verdict.n_accepted]
        if clock:
            clock.lap("verify")
        context = generation.context
        self.target.rewind(len(context) + len(accepted), generation.seq)
        if clock:
            clock.lap("rewind")
        controller = draft.choice.controller
        if controller is not None and not controller.hindsight:
            controller.update(len(draft.tokens), len(accepted), draft.choice.hint.signal)
        if clock:
            clock.lap("controller")
        self._count_step(generation.counters, draft, len(accepted))
        return self._emit(generation, [*accepted, verdict.next_token], len(accepted), draft)

    @staticmethod
    def _count_step(counters: _Counters, draft: Draft, n_accepted: int) -> None:
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

    def _emit(self, generation: Generation, new_tokens: list[int], n_drafted: int, draft: Draft) -> Step:
        """The step's tokens as text, up to the first stop (end of generation, stop string, max_tokens)."""
        counters, text, generated = generation.counters, generation.text, generation.generated
        tokens = []
        for i, token in enumerate(new_tokens):
            if self.target.is_end_of_generation(token):
                counters.finish_reason = "stop"
                break
            generated.append(token)
            piece = text.feed(self.target.token_bytes(token))
            tokens.append(Token(token, piece, draft.choice.drafter.name if i < n_drafted else None))
            if text.stopped:
                counters.finish_reason = "stop"
                break
            if len(generated) >= generation.params.max_tokens:
                counters.finish_reason = "length"
                break
        if counters.finish_reason is not None:
            tail = text.flush()
            if tail and tokens:
                tokens[-1] = Token(tokens[-1].id, tokens[-1].text + tail, tokens[-1].drafter)
        if self.phase_clock:
            self.phase_clock.lap("text")
        generation.context.extend(new_tokens)
        counters.tokens_generated = len(generated)
        counters.decode_seconds = time.perf_counter() - generation.decode_start
        return Step(tokens, counters.snapshot(), len(draft.tokens), n_drafted)

    def _prefill(self, context: list[int]) -> int:
        """Put all but the last prompt token in the target's cache (and the draft's, when it drafts);
        return how many the target had cached already."""
        self._shift_out_dropped_span(self.target, context)
        reused = self.restore_prefix(self.target, context)
        self.target.rewind(reused)
        self.target.decode(context[reused:-1], n_logits=0)
        if self.draft is not None and self.mode in ("draft-model", "combined"):
            self._shift_out_dropped_span(self.draft, context)
            self.restore_prefix(self.draft, context)
            self._drafters["draft-model"].prefill(context)
        return reused

    def restore_prefix(self, model: LlamaModel, context: list[int], seq: int = 0) -> int:
        """How many leading tokens of context[:-1] sequence seq's cache holds, after restoring a kept
        snapshot when one shares clearly more of them than the cache does now."""
        reused = min(common_prefix_length(model.cached_of(seq), context), len(context) - 1)
        if seq == 0 and self._shifted_at.get(model, reused) >= reused:
            self._shifted_at.pop(model, None)  # the shifted part is rewound: what follows is computed afresh
        if not self.prefix_caches:
            return reused
        key = _snapshot_key(model)
        found = [(snapshot, store) for store in self.prefix_caches
                 if (snapshot := store.longest_prefix(key, context[:-1], model.n_ctx)) is not None]
        if not found:
            return reused
        snapshot, store = max(found, key=lambda pair: pair[0].n_common)
        if snapshot.n_common < reused + MIN_RESTORE_GAIN:
            return reused
        data = store.read(key, snapshot)
        if data is None:
            return reused
        if seq == 0:
            self._shifted_at.pop(model, None)  # the cache is replaced, or emptied if refused
        if not load_state(model, data, snapshot.tokens, seq):
            store.discard(snapshot, "llama.cpp refused its state")
            return 0
        model.rewind(snapshot.n_common, seq)
        return snapshot.n_common

    def save_prefixes(self, seq: int = 0) -> None:
        """Offer sequence seq's KV cache (and the draft model's, when it drafts), exactly the tokens in it,
        to the prefix stores; they keep what pays."""
        models = [self.target] + ([self.draft] if seq == 0 and self.draft is not None and self.mode in ("draft-model", "combined") else [])
        for model in models if self.prefix_caches else ():
            if seq == 0 and model in self._shifted_at:
                continue  # shifted keys and values are not what a prefill computes: a restore must give its logits
            key = _snapshot_key(model)
            for store in self.prefix_caches:
                store.save(key, model.cached_of(seq), lambda: state_bytes(model, seq))

    @property
    def shifts_context(self) -> bool:
        """Whether a dropped turn is shifted out of the caches, when the caller allows it, rather than the rest recomputed."""
        return not self.bit_exact and self.target.can_shift

    def _shift_out_dropped_span(self, model: LlamaModel, context: list[int]) -> None:
        """When context is model's cache with one span left out (a chat dropped its oldest turn), drop
        that span from the cache and move what follows back, as llama.cpp's context shift does, so the
        prefill computes only what is new.

        The moved keys and values still carry what they attended to in the
        dropped span, so this is not the cache a fresh prefill would compute,
        nor bit-identical to it: under bit_exact the rest is computed again.
        """
        if self._shift_allowed and self.shifts_context and model.can_shift:
            span = dropped_span(model.cached, context[:-1])
            if span is not None:
                model.drop_span(*span)
                self._shifted_at[model] = min(span[0], self._shifted_at.get(model, span[0]))

    def draft_choice(self, generation: Generation, room: int) -> DraftChoice:
        """Which of the lane's drafters proposes the generation's next step, what it hinted, and how many
        tokens it may draft at most.

        In combined mode each drafter's controller names its best draft
        length and the tokens per second that is expected to give (the
        n-gram lookup costs nothing; the draft model costs its passes); the
        faster one drafts.  When neither pays, the controller of the one that
        could propose something (n-grams first, being free) decides whether
        to probe.
        """
        context, lane, counters = generation.context, generation.lane, generation.counters
        limit = min(generation.params.max_tokens - counters.tokens_generated - 1, room - 1, self.max_draft_tokens)
        mode = lane.mode or self.mode
        names = (tuple(n for n in ("ngram", "heads", "draft-model") if n in lane.drafters) if mode == "combined"
                 else (mode,))
        options = []
        for name in names:
            drafter = lane.drafters[name]
            hint = drafter.peek(context)
            cap = limit if hint.available is None else min(limit, hint.available)
            controller = self._controller(name, lane)
            if controller is not None and controller.hindsight:
                controller.settle(context)
                foreseen = (drafter.propose(context, controller.k_max, generation.params, generation.rng).tokens
                            if hint.available != 0 else [])
                controller.foresee(context, foreseen, hint.signal)
            if controller is not None and cap > 0:
                options.append((drafter, hint, cap, controller))
        if not options:
            return DraftChoice(lane.drafters["none"], Hint(0, 0), 0, None)
        if len(options) > 1:
            rated = [(option[3].best(option[1].signal, option[2]), option) for option in options]
            paying = [(rate, option) for (k, rate), option in rated if k > 0]
            if paying:
                options = [max(paying, key=lambda pair: pair[0])[1]]
        return DraftChoice(*options[0])


def _count_positions(counts: list[int], n: int) -> None:
    """One more at each of the first n draft positions."""
    counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


def _snapshot_key(model: LlamaModel) -> SnapshotKey:
    """What a snapshot of model's KV cache is valid for; its KV setup (K and V types, flash attention) by label."""
    return SnapshotKey.for_model(model.path, model.kv_cache_label or "f16", model.n_seq, RUNTIME)


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
    """A logits row the verifier reads holds NaN or inf: the engine names the model."""


def result_of(events: Iterator) -> GenerationResult:
    """Run a stream of events to its end and return the result it finished with."""
    result = None
    for event in events:
        if isinstance(event, Done):
            result = event.result
    return result
