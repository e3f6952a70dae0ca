"""The engine: a target model and its drafter, loaded and calibrated, that generates text.

Engine is the facade the commands, the chat app and library users hold: it
owns the models (and closes them), the generation lock, the settings
(configure) and the calibration of the cost curve; it builds prompts with
edgespec.prompts.  generate/stream run the decoding loop
(edgespec.scheduler) with one job: a lone generation is a batch of one of
the same decoder step that batch and serve run several at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .backend import LlamaModel
from .calibration import CalibrationCache
from .cost_profile import Calibrator, CostProfile, given_profile
from .costs import CostModel
from .decoder import Decoder
from .drafters import DraftModelDrafter, Drafter, NgramDrafter, NoDrafter
from .drafting import DraftPlanner
from .generation import Done, Failed, GenerationResult, Step, Token, result_of
from .generation_lock import GenerationLock
from .limits import checked_switch
from .ngram_pool import NgramPool
from .errors import EdgespecError, Setting
from .notices import log_notice
from .phases import PhaseClock
from .prefix_cache import PrefixStore
from .prompts import PromptBuilder
from .sampling import SamplingParams, sampling_params
from .scheduler import Job, Scheduler
from .sequence_cache import SequenceCache
from .text import check_text

__all__ = ["Engine", "Done", "GenerationResult", "Step", "Token", "result_of"]


class Engine:
    def __init__(self, target: LlamaModel, draft: LlamaModel | None, mode: str, draft_tokens: int | str,
                 plan=None, bit_exact: bool = False, heads: Drafter | None = None):
        self.target = target
        self.draft_model = draft
        self.plan = plan  # the memory plan it was loaded with (edgespec.planner.Plan), for its reason and display
        self.profile: CostProfile | None = None  # what passes cost here, once calibrated; replaced, never changed
        self._calibrator: Calibrator | None = None  # None: the curve was given
        self._phase_clock: PhaseClock | None = None
        self.prefix_caches: list[PrefixStore] = []  # where KV snapshots of long prompts are kept and restored from
        drafters = {"none": NoDrafter(), "ngram": NgramDrafter(end_tokens=target.end_of_generation_ids)}
        if draft is not None:
            drafters["draft-model"] = DraftModelDrafter(draft, target.n_vocab)
            drafters["combined"] = drafters["draft-model"]  # picks per step between it and n-grams
        if heads is not None:  # a HeadsDrafter over this target, a HiddenStateModel
            drafters["heads"] = heads
            drafters.setdefault("combined", heads)
        self._check_bit_exact(bit_exact)
        self.planner = DraftPlanner(drafters, mode, draft_tokens, bit_exact)
        self.decoder = Decoder(self.planner, SequenceCache(target, self.prefix_caches),
                               SequenceCache(draft, self.prefix_caches) if draft is not None else None)
        self.decoder.plan_reason = plan.reason if plan else None
        self.prompts = PromptBuilder(target)
        self._lock = GenerationLock()  # also refuses every use once closed

    def close(self) -> None:
        """Free the models (see GenerationLock.close); closing again does nothing, using the engine raises."""
        self._lock.close(self._free)

    def _free(self) -> None:
        self.target.close()
        if self.draft_model is not None:
            self.draft_model.close()

    def __enter__(self) -> Engine:
        self._lock.check_open()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def calibrate(
        self,
        cache: CalibrationCache | None = None,
        *,
        cost_curve: Sequence[float] | CostModel | None = None,
        notice: Callable[[str], None] | None = None,
        measure_stale_curve: bool = True,
    ) -> None:
        """Measure (or load) what each verification width costs and how far its logits drift: the profile.

        Verification passes may be as wide as the cost curve pays for, up to
        MAX_DRAFT_TOKENS + 1 tokens; acceptance is exact rejection sampling
        over the logits llama.cpp computes for that pass.  Those logits can
        differ slightly from a one-token pass (the kernels change with the
        number of rows), so the probe also finds the widest pass that is
        bit-identical (the cap under bit_exact) and the largest logit drift of
        each checked width (kernel_drift).  The first load of a model on a
        machine measures all of it (cost_profile.Calibrator, within the budgets
        in cost_profile.py and curve_timing.py) and says so through notice; later loads read the cache.

        cost_curve fixes the curve instead: seconds (or any one unit) per
        target pass over 1, 2, ... tokens; a CostModel also fixes the draft
        model's cost per drafted token (else 0) and what passes over several
        sequences cost (else as one sequence's).  Then nothing is timed or
        cached, the controllers' choices do not depend on the machine's speed
        or load, and drafts are at most len(cost_curve) - 1 tokens: the width
        probe (which compares logits, not times) checks only those widths.

        A cached curve that is stale (marked so by StepTimeWatch, or old) is
        measured again here, unless measure_stale_curve is False: then it is
        used as it is, calibration_due says so, and recalibrate() measures it
        when the caller is idle (the chat app does so between replies).
        """
        if cost_curve is not None:
            self._calibrator = None
            self._use(given_profile(self.target, cost_curve if isinstance(cost_curve, CostModel)
                                    else CostModel(cost_curve)))
            return
        self._calibrator = Calibrator(self.target, cache or CalibrationCache(), notice or log_notice)
        self._use(self._calibrator.load(self.draft_model, self._heads_seconds(), measure_stale_curve))

    def recalibrate(self) -> None:
        """Measure the cost curve again and use the new profile from the next generation on.

        Takes the generation lock, so it never runs inside a generation: a
        running one finishes first, and the next one waits (a few seconds at
        most: curve_timing's budgets).  Does nothing when the curve was given.
        """
        with self._lock:
            if self._calibrator is not None:
                self._use(self._calibrator.measure_again(self.profile, self.draft_model, self._heads_seconds()))

    def measure_sequences(self) -> None:
        """Make sure the profile prices passes over several sequences (measured once per model and machine,
        then cached); a given curve prices them as it says."""
        if self.profile is None:
            self.calibrate()
        with self._lock:
            if self._calibrator is not None:
                self._use(self._calibrator.with_sequences(self.profile))

    @property
    def calibration_due(self) -> bool:
        """The cost curve in use no longer matches this machine: call recalibrate() when idle."""
        watch = self.decoder.step_watch
        return self._calibrator is not None and (self.profile.stale or (watch is not None and watch.drifted))

    @property
    def kernel_drift(self) -> dict[int, float]:
        """Per checked width: the largest logit difference from one-token passes (empty before calibration)."""
        return self.profile.kernel_drift if self.profile is not None else {}

    def drift_bound(self) -> float:
        """Twice the largest logit drift measured between wide and one-token passes.

        At temperature 0 a divergence from plain decoding where the target's
        two best logits are further apart than this cannot come from kernel
        rounding: it is a bug.  0.0 when every checked width is bit-identical.
        """
        return 2.0 * max(self.kernel_drift.values(), default=0.0)

    def _heads_seconds(self) -> float:
        heads = self.planner.drafters.get("heads")
        return heads.seconds_per_token() if heads is not None else 0.0

    def _use(self, profile: CostProfile) -> None:
        """Plan every pass on this profile from now on."""
        if profile is self.profile:
            return
        self.profile = profile
        self.decoder.step_watch = self._calibrator.watch(profile) if self._calibrator is not None else None
        self.decoder.plain_step_seconds = profile.plain_step_seconds
        self.planner.use_cost(profile.cost, profile.widest, profile.exact_width)

    def drop_draft_model(self, reason: str) -> None:
        """Draft with n-grams alone from now on, closing any draft model loaded; reason says why (the plan shows it)."""
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None
            self.decoder.draft_cache = None
            self.planner.drop_draft_model()
        if self.plan is not None:  # heads trained for the target still draft: its reason keeps saying so
            self.plan = dataclasses.replace(self.plan, mode="ngram", reason=reason).with_heads(self.plan.heads)
            self.decoder.plan_reason = self.plan.reason

    def forget_cache(self) -> None:
        """Empty the KV caches, so the next prompt is evaluated in full (after a running generation)."""
        with self._lock:  # emptied under an open stream, its next steps would follow no context at all
            self.target.rewind(0)
            if self.draft_model is not None:
                self.draft_model.rewind(0)

    def forget_learning(self) -> None:
        """Start the draft-length controllers afresh, from their priors, as a new process would.

        Within one engine they keep what they learned across generations (a chat's second reply
        drafts better than its first); a benchmark's runs must not learn from each other.
        """
        self.planner.forget_learning()

    # -- settings ------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.planner.mode

    @property
    def modes(self) -> tuple[str, ...]:
        """The drafting modes this engine can run (combined needs a draft model or heads, draft-model a draft model)."""
        return tuple(self.planner.drafters)

    @property
    def draft_tokens(self) -> int | str:
        """The draft length: a fixed k, or "auto" to follow the cost curve."""
        return self.planner.draft_tokens

    @property
    def bit_exact(self) -> bool:
        """Verify only in passes as wide as llama.cpp computes bit-identically."""
        return self.planner.bit_exact

    @property
    def cost(self) -> CostModel | None:
        """The cost curve the controllers use, once calibrated."""
        return self.planner.cost

    @property
    def flash_attn(self) -> bool:
        """Whether the target runs flash attention, which bit_exact cannot go with."""
        return self.target.flash_attn

    @property
    def exact_width(self) -> int:
        """The widest bit-identical pass, once calibrated."""
        return self.planner.exact_width

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft a step may verify: the widest bit-exact pass under bit_exact, else the curve's."""
        return self.planner.max_draft_tokens

    def configure(self, *, mode: str | None = None, draft_tokens: int | str | None = None,
                  bit_exact: bool | None = None) -> None:
        """Switch the drafting mode, the draft length and/or the exactness guarantee; what is left None stays."""
        self._check_bit_exact(bit_exact)
        self._lock.check_open()  # a closed engine's every use raises
        self.planner.configure(mode=mode, draft_tokens=draft_tokens, bit_exact=bit_exact)

    def _check_bit_exact(self, bit_exact: bool | None) -> None:
        """Refuse a bit_exact that is not a switch, or that this context's flash attention cannot give."""
        if bit_exact is not None:
            checked_switch("bit_exact", bit_exact)
        if bit_exact and self.flash_attn:
            raise EdgespecError("bit-exact verification needs flash attention off: load the model with ",
                                Setting("flash_attn", "off"))

    @property
    def phase_clock(self) -> PhaseClock | None:
        """Times each phase of the decoder's steps while set (`bench --overhead`); None by default."""
        return self._phase_clock

    @phase_clock.setter
    def phase_clock(self, clock: PhaseClock | None) -> None:
        if self._phase_clock is not None:
            self._phase_clock.detach(self.decoder)
        self._phase_clock = clock
        if clock is not None:
            clock.attach(self.decoder)

    @property
    def plain_step_seconds(self) -> float | None:
        """The measured one-token target pass; None for a given curve."""
        return self.decoder.plain_step_seconds

    @property
    def pool(self) -> NgramPool | None:
        """Earlier prompts and outputs that n-gram drafts may come from (loading.use_learning); None: none."""
        return self.decoder.pool

    @property
    def n_ctx(self) -> int:
        self._lock.check_open()  # a closed engine has no target: its error, not an AttributeError
        return self.target.n_ctx

    @property
    def target_path(self) -> Path:
        return self.target.path

    @property
    def draft_path(self) -> Path | None:
        return self.draft_model.path if self.draft_model is not None else None

    @property
    def shifts_context(self) -> bool:
        """Whether a dropped turn is shifted out of the caches, when the caller allows it, rather than the rest recomputed."""
        return self.decoder.shifts_context

    # -- text <-> tokens -----------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Text with its control-token spellings parsed, like --raw input: never for user text in a chat."""
        check_text(text, "the text")
        self._lock.check_open()
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        self._lock.check_open()
        return self.prompts.render(messages, add_generation_prompt)

    def prompt_tokens(self, prompt: str, raw: bool = False) -> list[int]:
        """prompt as a user message in the chat template (raw: as written, control tokens included)."""
        self._lock.check_open()
        checked_switch("raw", raw)
        return self.prompts.user_prompt_tokens(prompt, raw)

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as the model's template writes it; message contents never become control tokens."""
        self._lock.check_open()
        return self.prompts.chat_tokens(messages, add_generation_prompt)

    def prediction_tokens(self, prediction: str | dict | None) -> list[int] | None:
        """A predicted output as tokens (PromptBuilder.prediction_tokens); None for none."""
        self._lock.check_open()
        return self.prompts.prediction_tokens(prediction)

    # -- generation ----------------------------------------------------------

    def generate(self, prompt: str, params: SamplingParams | None = None, raw: bool = False,
                 cancel: threading.Event | None = None, prediction: str | dict | None = None,
                 **sampling) -> GenerationResult:
        """The reply to prompt, a user message in the model's chat template (raw: the prompt as written,
        control tokens included): its .text, .token_ids, .finish_reason and .stats.

        Sampling is params (a SamplingParams), keyword arguments (temperature=0, max_tokens=200, top_k,
        top_p, min_p, seed, stop), or both: the keywords change params.  prediction: text the output is
        expected to mostly repeat (OpenAI's Predicted Outputs), e.g. the file being edited: a draft
        source, every token of it verified.
        """
        return result_of(self.stream(prompt, params, raw, cancel, prediction, **sampling))

    def stream(self, prompt: str, params: SamplingParams | None = None, raw: bool = False,
               cancel: threading.Event | None = None, prediction: str | dict | None = None,
               **sampling) -> Iterator[Step | Done]:
        """generate, step by step: each Step's .text is what it added and .stats the figures so far;
        the final Done carries the result."""
        return self.stream_tokens(self.prompt_tokens(prompt, raw), sampling_params(params, sampling), cancel=cancel,
                                  prediction=self.prediction_tokens(prediction))

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             cancel: threading.Event | None = None, prediction: str | dict | None = None,
             **sampling) -> GenerationResult:
        """The assistant's reply to a conversation: messages as {"role": ..., "content": ...} dicts.
        prediction: as for generate."""
        return result_of(self.stream_chat(messages, params, cancel, prediction, **sampling))

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None,
                    cancel: threading.Event | None = None, prediction: str | dict | None = None,
                    **sampling) -> Iterator[Step | Done]:
        """chat, step by step (see stream)."""
        return self.stream_tokens(self.chat_tokens(messages), sampling_params(params, sampling), cancel=cancel,
                                  prediction=self.prediction_tokens(prediction))

    def stream_tokens(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None = None,
        shift_dropped_span: bool = False, prediction: Sequence[int] | None = None, pool: NgramPool | None = None,
    ) -> Iterator[Step | Done]:
        """Generate after prompt_ids; yields one Step per verification and a final Done.

        shift_dropped_span: the caller (a chat that dropped its oldest turn)
        accepts a cache with that turn shifted out for one recomputed, see
        SequenceCache.shift_out_dropped_span.  Other callers get a cache as a
        fresh prefill would make it, so a prompt's output never depends on the
        one before.  A prompt that cannot run, or a generation that fails,
        raises its EdgespecError.
        """
        # made here so that a wrong argument is refused at the call, not at the first next()
        jobs = iter([Job(None, list(prompt_ids), sampling_params(params, {}), cancel, shift_dropped_span, prediction,
                         pool)])
        return self._run_alone(jobs)

    def _run_alone(self, jobs: Iterator[Job]) -> Iterator[Step | Done]:
        with self._lock:
            for _, event in self.scheduler(1).run(lambda wait: next(jobs, None)):
                if isinstance(event, Failed):
                    raise event.error
                yield event
                if not isinstance(event, Done):
                    self._lock.check_open()  # closed by the caller between steps

    def scheduler(self, parallel: int) -> Scheduler:
        """The decoding loop over this engine's decoder, `parallel` generations at a time (calibrated first,
        with the cost of passes over several sequences when parallel > 1)."""
        if self.profile is None:
            self.calibrate()
        if parallel > 1:
            self.measure_sequences()
        return Scheduler(self.decoder, parallel)
