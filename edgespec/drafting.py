"""What each generation drafts with, and how many tokens its next draft has.

A generation drafts with a `DrafterSet`: its drafters (an n-gram index and a
draft model's cache follow one text) and their draft-length controllers
(acceptance estimates belong to one text too).  The `DraftPlanner` holds the
engine's settings (mode, draft tokens, bit-exactness) and the measured costs,
and plans each step's drafts:

- one generation at a time: its drafter's controller chooses the length
  that gives the most expected tokens per second on the cost curve;
- several in one pass: the drafted rows that go into the
  shared pass are the ones whose expected accepted tokens are worth their
  marginal cost on the curve (joint_draft_lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .controller import DraftLengthController, controller_for
from .costs import CostModel
from .drafters import Drafter, Hint, NoDrafter
from .errors import EdgespecError, Setting
from .generation import DrafterSet, Generation
from .learned import LearnedAcceptance
from .limits import MAX_DRAFT_TOKENS, MAX_OUTPUT_ROWS


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


def joint_draft_lengths(choices: Sequence[DraftChoice], cost: CostModel, max_rows: int = MAX_OUTPUT_ROWS,
                        prompt_rows: int = 0, prompt_sequences: int = 0) -> list[int]:
    """Each sequence's draft length for one shared pass, chosen together for the most expected tokens per second.

    Every sequence's own token is one row.  A drafted token i of sequence s is
    accepted with probability reach = a_1 * ... * a_i (its controller's
    estimates), so adding the rows in order of reach gives, for each pass
    width, the most expected tokens; the width with the best tokens / T(width)
    wins (the narrower one on a tie), T priced over the pass's sequences
    (CostModel.pass_seconds), including prompt_rows rows of the prompts of
    prompt_sequences more sequences that the pass also feeds.  A fixed draft
    length is kept as given.
    """
    n_sequences = len(choices) + prompt_sequences

    def seconds(width: int) -> float:
        return cost.pass_seconds(n_sequences, width + prompt_rows)

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
    best_rate, best_n, rate_tokens = tokens / seconds(width), 0, tokens
    for n, (negative_reach, _) in enumerate(offers[: max(0, max_rows - width)], start=1):
        rate_tokens -= negative_reach
        rate = rate_tokens / seconds(width + n)
        if rate > best_rate:
            best_rate, best_n = rate, n
    for _, i in offers[:best_n]:
        lengths[i] += 1
    return lengths


class DraftPlanner:
    """The drafting settings and measured costs, and each step's draft under them."""

    def __init__(self, drafters: dict[str, Drafter], mode: str, draft_tokens: int | str, bit_exact: bool):
        # by mode name: "combined" is the draft model (else the heads), picking per step against n-grams
        self.drafters = drafters
        self.own = DrafterSet(drafters)
        self.cost: CostModel | None = None  # the cost curve the controllers use, once calibrated
        self.exact_width = 1  # the widest bit-identical pass, once calibrated
        self._widest = 1  # the widest pass the cost curve covers, once calibrated
        self._drafter_costs: dict[str, CostModel] = {}
        self.mode, self.draft_tokens, self.bit_exact = mode, draft_tokens, bit_exact
        self.learned: LearnedAcceptance | None = None  # where controllers start from and learn into; None: cold
        self.configure(mode=mode, draft_tokens=draft_tokens)

    # -- settings and costs --------------------------------------------------

    def configure(self, *, mode: str | None = None, draft_tokens: int | str | None = None,
                  bit_exact: bool | None = None) -> None:
        """Switch the drafting mode, the draft length and/or bit-exactness; what is left None stays."""
        if mode is not None and mode not in self.drafters:
            have = ", ".join(self.drafters)
            raise EdgespecError(f"drafting mode {mode!r} is not available (available: {have}; draft-model needs a "
                                "draft model: give its GGUF file as ", Setting("draft"), ")")
        if draft_tokens is not None and draft_tokens != "auto" and not (
                isinstance(draft_tokens, int) and 0 <= draft_tokens <= MAX_DRAFT_TOKENS):
            raise EdgespecError(f"draft tokens must be 'auto' or a whole number from 0 to {MAX_DRAFT_TOKENS}, not {draft_tokens!r}")
        if mode is not None:
            self.mode = mode
        if draft_tokens is not None:
            self.draft_tokens = draft_tokens
        if bit_exact is not None:
            self.bit_exact = bool(bit_exact)

    def use_cost(self, cost: CostModel, widest: int, exact_width: int) -> None:
        """Plan on this cost curve (passes up to widest tokens) and bit-exact width from now on."""
        self.cost, self.exact_width = cost, exact_width
        if widest != self._widest:
            # controllers choose lengths up to the widest pass: made anew for another width (a curve of the
            # same width keeps what they learned)
            self.own.controllers = {}
        self._widest = widest
        # only the draft model charges time per drafted token
        self._drafter_costs = {"ngram": CostModel(cost.forward_seconds)} if widest > 1 else {}
        if widest > 1 and "draft-model" in self.drafters:
            self._drafter_costs["draft-model"] = cost
        if widest > 1 and "heads" in self.drafters:
            self._drafter_costs["heads"] = CostModel(cost.forward_seconds, cost.heads_seconds_per_token)
        for (name, _), controller in self.own.controllers.items():
            controller.set_cost(self._drafter_costs[name])

    def may_draft(self, name: str, drafter_set: DrafterSet) -> bool:
        """Whether drafting with `name` is expected at all under this drafting (DraftLengthController.may_draft)."""
        controller = self.controller(name, drafter_set)
        return controller is not None and controller.may_draft

    @property
    def widest(self) -> int:
        """The widest pass the cost curve covers."""
        return self._widest

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft a step may verify: the widest bit-exact pass under bit_exact, else the curve's."""
        return (min(self.exact_width, self._widest) if self.bit_exact else self._widest) - 1

    def drop_draft_model(self) -> None:
        """Draft with n-grams alone from now on (the caller closes the model)."""
        for name in ("draft-model", "combined"):
            self.drafters.pop(name)
        if "heads" in self.drafters:
            self.drafters["combined"] = self.drafters["heads"]  # n-grams and heads, chosen per step
        self._drafter_costs.pop("draft-model", None)
        self.own.controllers = {key: c for key, c in self.own.controllers.items() if key[0] != "draft-model"}
        self.configure(mode="combined" if "combined" in self.drafters else "ngram")

    def forget_learning(self) -> None:
        """Start the own drafting's controllers afresh, from their priors."""
        self.own.controllers = {}

    def sequence_drafter_set(self, seq: int) -> DrafterSet:
        """A drafting of its own for sequence seq decoded together with others: n-grams and, when loaded,
        heads (reading that sequence's hidden states), picked per step; or none."""
        drafters = {"none": NoDrafter(), "ngram": self.drafters["ngram"].for_sequence(seq)}
        if "heads" in self.drafters:
            drafters["heads"] = drafters["combined"] = self.drafters["heads"].for_sequence(seq)
        mode = self.mode if self.mode in ("none", "heads") else "combined" if "combined" in drafters else "ngram"
        return DrafterSet(drafters, mode=mode)

    # -- each step's draft ---------------------------------------------------

    def controller(self, name: str, drafter_set: DrafterSet) -> DraftLengthController | None:
        """The draft-length controller of one drafter of a drafting under the current draft-tokens setting."""
        cost = self._drafter_costs.get(name)
        if cost is None:
            return None  # plain decoding, or a curve with no pass wider than one token
        fixed = None if self.draft_tokens == "auto" else min(int(self.draft_tokens), self._widest - 1)
        controllers = drafter_set.controllers
        controller = controllers.get((name, fixed))
        if controller is None:
            learned = self.learned.prior(name) if self.learned is not None else None
            # the heads file's held-out accuracy, not a draft model's typical one
            prior = drafter_set.drafters["heads"].acceptance_prior if name == "heads" else None
            controller = controllers[(name, fixed)] = controller_for(name, cost, self._widest - 1, fixed, learned,
                                                                     prior_acceptance=prior)
        return controller

    def choose(self, generations: Sequence[Generation], rooms: Sequence[int], together: bool,
               prompt_rows: int = 0, prompt_sequences: int = 0) -> tuple[list[DraftChoice], list[int]]:
        """Each generation's drafter for the next pass and how many tokens it drafts.

        A lone generation's length is its drafter's controller's choice; the
        lengths of generations that share the pass are chosen together, priced
        with the prompt rows the pass also carries (joint_draft_lengths).
        """
        choices = [self.choice(generation, room) for generation, room in zip(generations, rooms)]
        if together:
            return choices, joint_draft_lengths(choices, self.cost, prompt_rows=prompt_rows,
                                                prompt_sequences=prompt_sequences)
        return choices, [c.controller.choose(c.hint.signal, c.cap) if c.controller is not None else 0 for c in choices]

    @staticmethod
    def propose(generation: Generation, choice: DraftChoice, k: int) -> Draft:
        """k tokens (at most; the drafter may stop early) from the chosen drafter."""
        stop_below = choice.controller.stop_thresholds() if choice.controller is not None else ()
        proposal = (choice.drafter.propose(generation.context, k, generation.params, generation.rng, stop_below)
                    if k > 0 else None)
        if proposal is None:
            return Draft(choice, [])
        return Draft(choice, proposal.tokens, proposal.probs)

    def keep_hidden_rows(self, generations: Sequence[Generation], drafts: Sequence[Draft], together: bool) -> None:
        """Before a pass: have it keep each generation's hidden states only where heads may draft from them at
        its next step; elsewhere the target's passes cost what a model without heads would (backend.hidden)."""
        for generation, draft in zip(generations, drafts):
            heads = generation.drafter_set.drafters.get("heads")
            if heads is not None:
                heads.want_rows(self._heads_may_draft_next(generation, draft, together))

    def _heads_may_draft_next(self, generation: Generation, draft: Draft, together: bool) -> bool:
        """Heads drafted this step (and may again), their plan drafts, or nobody drafted and a probe of heads
        is due (probes are made for a lone generation only)."""
        drafter_set = generation.drafter_set
        if (drafter_set.mode or self.mode) not in ("heads", "combined"):
            return False
        controller = self.controller("heads", drafter_set)
        if controller is None:
            return False
        if draft.tokens:
            return draft.choice.drafter is drafter_set.drafters["heads"] or controller.best(0)[0] > 0
        return controller.best(0)[0] > 0 or (not together and controller.probe_due(0))

    def choice(self, generation: Generation, room: int) -> DraftChoice:
        """Which of the drafting's drafters proposes the generation's next step, what it hinted, and how many
        tokens it may draft at most.

        In combined mode each drafter's controller names its best draft
        length and the tokens per second that is expected to give (the
        n-gram lookup costs nothing; the draft model costs its passes); the
        faster one drafts.  When neither pays, the controller of the one that
        could propose something (n-grams first, being free) decides whether
        to probe.
        """
        context, drafter_set, counters = generation.context, generation.drafter_set, generation.counters
        limit = min(generation.params.max_tokens - counters.tokens_generated - 1, room - 1, self.max_draft_tokens)
        mode = drafter_set.mode or self.mode
        names = (tuple(n for n in ("ngram", "heads", "draft-model") if n in drafter_set.drafters) if mode == "combined"
                 else (mode,))
        options = []
        for name in names:
            drafter = drafter_set.drafters[name]
            hint = drafter.peek(context)
            cap = limit if hint.available is None else min(limit, hint.available)
            controller = self.controller(name, drafter_set)
            if controller is not None:
                controller.watch(context, hint.signal, lambda: (
                    drafter.propose(context, controller.k_max, generation.params, generation.rng).tokens
                    if hint.available != 0 else []), hint.copy)
            if controller is not None and cap > 0:
                options.append((drafter, hint, cap, controller))
        if not options:
            return DraftChoice(drafter_set.drafters["none"], Hint(0, 0), 0, None)
        if len(options) > 1:
            rated = [(option[3].best(option[1].signal, option[2]), option) for option in options]
            paying = [(rate, option) for (k, rate), option in rated if k > 0]
            if paying:
                options = [max(paying, key=lambda pair: pair[0])[1]]
        return DraftChoice(*options[0])
