"""The speculative decoding loop: prefill -> draft -> verify -> roll back -> emit.

One step drafts k tokens after the context, runs the target once over
[last token, d1..dk], accepts a prefix by rejection sampling and appends one
more token from the target.  The target's KV cache then keeps the accepted
part only.  With k = 0 a step is plain decoding, so every mode (and the
baseline) runs through this same loop.
"""

from __future__ import annotations

import codecs
import dataclasses
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from .backend import RUNTIME, LlamaModel, common_prefix_length
from .calibration import WIDTH_PROBE_BUDGET_SECONDS, CalibrationCache, CalibrationKey, StepTimeWatch, measure_curve
from .controller import CostModel, DraftLengthController
from .chat_template import ChatTemplate
from .drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from .errors import ContextOverflowError, CorruptModelError, EdgespecError
from .notices import print_notice
from .sampling import SamplingParams, SparseProbs, to_probs
from .stats import Stats
from .verify import verify

if TYPE_CHECKING:  # the engine only keeps the plan it was loaded with, for its reason and for display
    from .planner import Plan

# The longest draft the adaptive controller may choose; on a 2-core CPU a pass
# over 33 tokens still costs only ~18 single steps, so copying long spans pays.
MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # may be "" while a UTF-8 character or a possible stop string is incomplete
    drafted: bool  # proposed by the drafter and accepted, rather than sampled from the target


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

    def snapshot(self) -> Stats:
        return Stats.from_counts(**dataclasses.asdict(self))


class PhaseClock:
    """Nanoseconds per phase of the decoding loop, summed over steps (for `edgespec bench --overhead`).

    A lap charges the time since the previous lap to a phase, except what the
    models spent inside llama_decode meanwhile, which goes to target_decode or
    draft_decode: the other phases are the loop's own overhead.  The engine
    holds None by default, which costs one test per phase.
    """

    PHASES = ("target_decode", "draft_decode", "propose", "logits", "verify", "rewind", "text", "controller", "stats")

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None):
        self.ns = dict.fromkeys(self.PHASES, 0)
        self.steps = 0
        self._models = {"target_decode": target, "draft_decode": draft} if draft is not None else {"target_decode": target}
        self._last = 0
        self._decode_seen: dict[str, int] = {}

    def start(self) -> None:
        """Begin a step: what happened since the last lap (the caller's own work) is not charged."""
        self._decode_seen = {name: model.decode_ns for name, model in self._models.items()}
        self._last = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        now = time.perf_counter_ns()
        elapsed = now - self._last
        for name, model in self._models.items():
            inside = model.decode_ns - self._decode_seen[name]
            self._decode_seen[name] = model.decode_ns
            self.ns[name] += inside
            elapsed -= inside
        self.ns[phase] += elapsed
        self._last = now


class _TextAssembler:
    """Token bytes -> text that is safe to show now.

    Holds back an incomplete UTF-8 sequence, and any tail that could be the
    start of a stop string, until the next token settles it.
    """

    def __init__(self, stops: Sequence[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped = False

    def feed(self, data: bytes) -> str:
        text = self._held + self._decoder.decode(data)
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut], "")
        hold = max((_overlap(text, s) for s in self._stops), default=0)
        return self._release(text[: len(text) - hold], text[len(text) - hold :])

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._release(self._held + self._decoder.decode(b"", final=True), "")

    def _release(self, out: str, held: str) -> str:
        self._held = held
        self.text += out
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class Engine:
    def __init__(self, target: LlamaModel, draft: LlamaModel | None, mode: str, draft_tokens: int | str, plan: Plan | None = None):
        self.target = target
        self.draft = draft
        self.plan = plan
        self._draft_tokens = draft_tokens
        self._controllers: dict[str, DraftLengthController] = {}  # filled by calibrate()
        self.cost: CostModel | None = None  # the cost curve the controllers use, once calibrated
        self.plain_step_seconds: float | None = None  # measured one-token target pass; None for a given curve
        self.max_draft_tokens = MAX_DRAFT_TOKENS  # narrowed by calibrate() to what verifies exactly
        self._step_watch: StepTimeWatch | None = None
        self._calibration: tuple[CalibrationCache, CalibrationKey] | None = None  # None: the curve was given
        self._stale_curve = False  # a stale cached curve is in use until recalibrate()
        self.phase_clock: PhaseClock | None = None  # set by `bench --overhead`
        self._drafters = {"none": NoDrafter(), "ngram": NgramDrafter()}
        if draft is not None:
            self._drafters["draft-model"] = DraftModelDrafter(draft, target.n_vocab)
        self.configure(mode=mode)
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
        """Measure (or load) how wide a verification pass may be and what each width costs.

        A pass is only as wide as llama.cpp computes bit-identically to one
        token at a time, so speculation never changes greedy output; the cost
        curve over those widths drives the adaptive draft length.  The first
        load of a model on a machine measures both (within the budgets in
        calibration.py) and says so through notice; later loads read the cache.

        cost_curve fixes the curve instead: seconds (or any one unit) per
        target pass over 1, 2, ... tokens; a CostModel also fixes the draft
        model's cost per drafted token, else it is 0.  Then nothing is timed
        or cached, the controllers' choices do not depend on the machine's
        speed or load, and drafts are at most len(cost_curve) - 1 tokens: the
        exact-width probe (which compares logits, not times) checks only those
        widths, all of them.

        A cached curve that is stale (marked so by StepTimeWatch, or old) is
        measured again here, unless measure_stale_curve is False: then it is
        used as it is, calibration_due says so, and recalibrate() measures it
        when the caller is idle (the chat app does so between replies).
        """
        if cost_curve is not None:
            cost = cost_curve if isinstance(cost_curve, CostModel) else CostModel(cost_curve)
            limit = min(len(cost.forward_seconds), MAX_DRAFT_TOKENS + 1)
            width = self.target.exact_pass_width(self._probe_tokens(), limit)
            self._calibration, self._stale_curve, self._step_watch = None, False, None
            self._use_cost(width, cost, plain_step_seconds=None)
            return
        cache = cache or CalibrationCache()
        key = CalibrationKey.for_model(self.target.path, self.target.n_gpu_layers, self.target.n_threads, RUNTIME)
        cached = cache.read(key)
        self._calibration = cache, key
        self._stale_curve = False
        if cached is None:
            (notice or print_notice)("measuring this model's speed, once (a few seconds; later runs reuse it) ...")
            width = self.target.exact_pass_width(self._probe_tokens(), MAX_DRAFT_TOKENS + 1, WIDTH_PROBE_BUDGET_SECONDS)
            curve = self._measure_and_store(width)
        elif cached.stale and measure_stale_curve:
            (notice or print_notice)("measuring this model's speed again: the last measurement no longer "
                                      "matches this machine (a few seconds) ...")
            width, curve = cached.max_width, self._measure_and_store(cached.max_width)
        else:
            width, curve = cached.max_width, cached.forward_seconds
            self._stale_curve = cached.stale
        self._use_measured(width, curve)

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
            self._use_measured(self.max_draft_tokens + 1, self._measure_and_store(self.max_draft_tokens + 1))

    @property
    def calibration_due(self) -> bool:
        """The cost curve in use no longer matches this machine: call recalibrate() when idle."""
        watch = self._step_watch
        return self._calibration is not None and (self._stale_curve or (watch is not None and watch.drifted))

    def _measure_and_store(self, width: int) -> tuple[float, ...]:
        cache, key = self._calibration
        filler = max(self.target.bos_id, 0)
        curve = measure_curve(lambda n: self.target.time_forward(n, filler), width)
        cache.store(key, width, curve)
        return curve

    def _use_measured(self, width: int, curve: tuple[float, ...]) -> None:
        cache, key = self._calibration
        self._step_watch = StepTimeWatch(cache, key, curve)
        draft_seconds = 0.0
        if self.draft is not None and width > 1:
            draft_seconds = min(self.draft.time_forward(1, max(self.target.bos_id, 0)) for _ in range(5))
        self._use_cost(width, CostModel(curve, draft_seconds), plain_step_seconds=curve[0])

    def _use_cost(self, width: int, cost: CostModel, plain_step_seconds: float | None) -> None:
        self.cost = cost
        self.plain_step_seconds = plain_step_seconds
        if width - 1 != self.max_draft_tokens or not self._controllers:
            self._controllers = {}  # new controllers; a re-measured curve keeps the acceptance learned so far
        self.max_draft_tokens = width - 1
        if self.max_draft_tokens == 0:
            return
        # one controller per drafter: only the draft model charges time per drafted token
        costs = {"ngram": CostModel(cost.forward_seconds)}
        if "draft-model" in self._drafters:
            costs["draft-model"] = cost
        for name, drafter_cost in costs.items():
            controller = self._controllers.get(name)
            if controller is None:
                controller = self._controllers[name] = DraftLengthController(drafter_cost, k_max=self.max_draft_tokens)
            controller.set_cost(drafter_cost)
        if "draft-model" in self._controllers:
            self._drafters["draft-model"].stop_threshold = self._controllers["draft-model"].p_min

    def _probe_tokens(self) -> list[int]:
        text = "The quick brown fox jumps over the lazy dog; def area(w, h): return w * h. " * 8
        return self.target.tokenize(text, add_special=True)

    def forget_cache(self) -> None:
        """Empty the KV caches, so the next prompt is evaluated in full."""
        self.target.rewind(0)
        if self.draft is not None:
            self.draft.rewind(0)

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
        return self._drafter.name

    @property
    def draft_tokens(self) -> int | str:
        """The draft length: a fixed k, or "auto" to follow the cost curve."""
        return self._draft_tokens

    def configure(self, *, mode: str | None = None, draft_tokens: int | str | None = None) -> None:
        """Switch the drafting mode and/or the draft length; what is left None stays."""
        if mode is not None and mode not in self._drafters:
            have = ", ".join(self._drafters)
            raise EdgespecError(f"drafting mode {mode!r} is not available (available: {have}; draft-model needs --draft FILE)")
        if draft_tokens is not None and draft_tokens != "auto" and not (
                isinstance(draft_tokens, int) and 0 <= draft_tokens <= MAX_DRAFT_TOKENS):
            raise EdgespecError(f"draft tokens must be 'auto' or a whole number from 0 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}")
        if mode is not None:
            self._drafter = self._drafters[mode]
        if draft_tokens is not None:
            self._draft_tokens = draft_tokens

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
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None = None
    ) -> Iterator[Step | Done]:
        """Generate after prompt_ids; yields one Step per verification and a final Done."""
        if not prompt_ids:
            raise EdgespecError("the prompt is empty (give some text to continue)")
        if len(prompt_ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.n_ctx} (raise --n-ctx or shorten the prompt)"
            )
        with self._lock:
            try:
                yield from self._generate(list(prompt_ids), params, cancel)
            except _NonFiniteLogits:
                path = self.target.path
                raise CorruptModelError(
                    f"{path.name} computed NaN or infinite logits, so the model file {path} is likely corrupt "
                    "(download it again, or convert it afresh)"
                ) from None

    def _generate(self, context: list[int], params: SamplingParams, cancel) -> Iterator[Step | Done]:
        drafter = self._drafter
        counters = _Counters(drafter.name, self.plan.reason if self.plan else None, prompt_tokens=len(context))
        rng = np.random.default_rng(params.seed)
        text = _TextAssembler(params.stop)
        generated: list[int] = []

        start = time.perf_counter()
        counters.prompt_tokens_reused = self._prefill(context)
        counters.prefill_seconds = time.perf_counter() - start
        draft_passes_before = drafter.forward_passes
        decode_start = time.perf_counter()
        clock = self.phase_clock

        while counters.finish_reason is None:
            if clock:
                clock.start()
            if cancel is not None and cancel.is_set():
                counters.finish_reason = "cancelled"
                break
            room = self.n_ctx - len(context)
            if room <= 0:
                counters.finish_reason = "context"
                break
            proposed_before = counters.draft_tokens_proposed
            new_tokens, n_drafted = self._step(drafter, context, params, rng, counters, room)
            tokens = []
            for i, token in enumerate(new_tokens):
                if self.target.is_end_of_generation(token):
                    counters.finish_reason = "stop"
                    break
                generated.append(token)
                piece = text.feed(self.target.token_bytes(token))
                tokens.append(Token(token, piece, i < n_drafted))
                if text.stopped:
                    counters.finish_reason = "stop"
                    break
                if len(generated) >= params.max_tokens:
                    counters.finish_reason = "length"
                    break
            if counters.finish_reason is not None:
                tail = text.flush()
                if tail and tokens:
                    tokens[-1] = Token(tokens[-1].id, tokens[-1].text + tail, tokens[-1].drafted)
            if clock:
                clock.lap("text")
            context.extend(new_tokens)
            counters.tokens_generated = len(generated)
            counters.draft_forward_passes = drafter.forward_passes - draft_passes_before
            counters.decode_seconds = time.perf_counter() - decode_start
            step = Step(tokens, counters.snapshot(), counters.draft_tokens_proposed - proposed_before, n_drafted)
            if clock:
                clock.lap("stats")
                clock.steps += 1
            yield step

        counters.decode_seconds = time.perf_counter() - decode_start
        yield Done(GenerationResult(text.text, generated, counters.finish_reason, counters.snapshot()))

    def _prefill(self, context: list[int]) -> int:
        """Put all but the last prompt token in the target's cache; return how many were cached already."""
        reused = min(common_prefix_length(self.target.cached, context), len(context) - 1)
        self.target.rewind(reused)
        self.target.decode(context[reused:-1], n_logits=0)
        return reused

    def _step(self, drafter, context, params, rng, counters: _Counters, room: int) -> tuple[list[int], int]:
        """One draft/verify step; returns the new tokens and how many of them came from the draft."""
        clock = self.phase_clock
        hint = drafter.peek(context)
        if clock:
            clock.lap("propose")
        limit = min(params.max_tokens - counters.tokens_generated - 1, room - 1)
        if hint.available is not None:
            limit = min(limit, hint.available)
        k = self._draft_length(drafter, hint, limit)
        if clock:
            clock.lap("controller")
        proposal = drafter.propose(context, k, params, rng) if k > 0 else None
        drafts = proposal.tokens if proposal else []
        if clock:
            clock.lap("propose")

        # The cache holds context[:-1]; one pass scores the last token and every draft.
        self.target.rewind(len(context) - 1)
        if clock:
            clock.lap("rewind")
        started = time.perf_counter()
        # a view of llama.cpp's rows, read by the verifier before the next pass
        logits = self.target.decode([context[-1], *drafts], n_logits=len(drafts) + 1, copy=False)
        if clock:
            clock.lap("logits")
        if self._step_watch is not None:
            self._step_watch.observe(len(drafts) + 1, time.perf_counter() - started)
        if clock:
            clock.lap("controller")
        verdict = verify(_LazyRows(logits, params), drafts, proposal.probs if proposal else None, rng)
        accepted = drafts[: verdict.n_accepted]
        if clock:
            clock.lap("verify")
        self.target.rewind(len(context) + len(accepted))
        if clock:
            clock.lap("rewind")
        controller = self._controllers.get(drafter.name)
        if controller is not None:
            controller.update(drafter.name, len(drafts), len(accepted), hint.signal)
        if clock:
            clock.lap("controller")

        counters.steps += 1
        counters.target_forward_passes += 1
        counters.draft_tokens_proposed += len(drafts)
        counters.draft_tokens_accepted += len(accepted)
        counters.k0_steps += not drafts
        return [*accepted, verdict.next_token], len(accepted)

    def _draft_length(self, drafter, hint, limit: int) -> int:
        if limit <= 0:
            return 0
        if self.cost is None:
            self.calibrate()
        limit = min(limit, self.max_draft_tokens)
        controller = self._controllers.get(drafter.name)
        if controller is None or limit <= 0:  # plain decoding, or no pass wider than one is exact
            return 0
        # a fixed k also goes through the controller, which then never cuts a draft short (p_min)
        controller.fixed_k = None if self.draft_tokens == "auto" else int(self.draft_tokens)
        return controller.choose(drafter.name, hint.signal, limit)


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
                raise _NonFiniteLogits
            row = self._rows[i] = to_probs(self._logits[i], self._params)
        return row


class _NonFiniteLogits(Exception):
    """A logits row the verifier reads holds NaN or inf: the engine names the model."""


def result_of(events: Iterator) -> GenerationResult:
    """Run a stream of events to its end and return the result it finished with."""
    result = None
    for event in events:
        if isinstance(event, Done):
            result = event.result
    return result
