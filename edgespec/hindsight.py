"""How often n-gram copies go on, learned in hindsight from every step: what the controller plans n-gram drafts with.

The n-gram drafter's proposals cost nothing, so `HindsightAcceptance` is shown each step's whole
proposal (`watch`), scored token by token against the text that follows, also at steps where
nothing was drafted.  Every scored token says how often a copy of about that length goes on (one
estimate per source and copy length, whatever the depth).  A copy of the prompt that has gone on
longer is taken to go on at least as often as a shorter one of this text has shown (LENDING_SOURCES).

It also keeps a record per token pair (the token before a drafted token, and that token): how often
a draft of that pair was kept inside a copy.  The step's own proposal is planned with it, depth by
depth, so a copy is drafted up to the spot where this text's copies broke before (an inserted line,
a renamed name) and past the spots where they went on.

A plan is made on a cautious estimate: the mean less `caution` standard errors of the counts behind
it, so a wide pass, whose price is paid whether its tail is kept or not, is chosen only on evidence
that copies this long go on.  For copies of the text's own writing, the evidence behind a copy length
is the copies that reached it, not their tokens (OBSERVATIONS_PER_COPY).  Its counts go to the learned
prior store as acceptance.py's do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from .acceptance import LEARNED_WEIGHT_MAX, PRIOR_WEIGHT, DecayedCounts
from .drafters import SOURCES, copy_signal_parts

# Standard errors taken off a mean before the controller plans with it (hindsight learners).
CAUTION = 0.75
# The most times one text position counts for one copy class.  Every step foresees the copy ahead, so
# with one-token steps each token of a long copy was scored by up to k_max proposals, all at the same
# copy length: one copy read as dozens of observations, caution all but vanished, and a 16-wide pass
# was planned on a single earlier copy (a CSV extraction kept none of 15 tokens, in 3 of 6 runs).
# Once per position would be the count of distinct evidence, but CAUTION and the priors were chosen
# on the repeated counts; 3 kept the copies' wins and lifted the worst prompts of the five reply sets
# (benchmarks/ngram_sim.py; stop 60 in `git show 2740b8b:docs/benchmarks.md`).
MAX_COUNTS_PER_POSITION = 3
# A hindsight learner observes every step, so it can afford a shorter memory than one that learns
# from verification only: it notices within a few dozen tokens that copies have become longer or shorter.
HINDSIGHT_DECAY = 0.97
# The copy lengths a hindsight learner keeps one hazard for (each bucket from its length to the next),
# and its guess before any evidence: a copy that has matched m tokens goes on with m / (m + shift),
# so longer matches are trusted more (what every n-gram drafter assumes, llama.cpp's 12-token key too).
COPY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
COPY_PRIOR_SHIFT = 2.0
# The token-pair record (PairRecord): how many observations of a pair outweigh the copy-length estimate
# it refines, and the shortest copy whose drafted tokens it learns from: a draft of a shorter match
# fails for the match's sake more than the pair's (the copy-length estimate says so already).  Chosen
# with benchmarks/ngram_sim.py on the held-out replies' prompts 1-2 (benchmarks/results/ngram-sim.txt).
PAIR_WEIGHT = 4.0
PAIR_MIN_COPY = 4
# A copy of a document (the prompt, a predicted output) that has gone on longer is taken to go on at
# least as often as this text's shorter copies of it have shown: each of those copy classes starts from
# the cautious estimate of the shorter ones where that is above its own guess.  Without it, a function
# copied whole was drafted four tokens at a time for its first 32 tokens, each longer class starting
# from its guess as the copy reached it, where one 32-token pass costs less than two 4-token ones (1.73
# and 6.44 plain steps on the Xeon of stop 67).  Only copies of LENDING_COPY tokens or more lend: two-token
# phrases go on often in any prose, and lending from them made stories at T = 0.7 slower.  Copies of the
# text's own writing and of the pool do not: they are records and repeats that break at one spot
# however long they ran (a JSON record's next value), and lending made extractions 3% slower on the
# issue's curve (benchmarks/ngram_sim.py).  A class's own counts outweigh what it was lent as they do
# its guess, so the first long draft that breaks costs its class at once.
LENDING_COPY = 4
LENDING_SOURCES = ("prompt", "prediction")
# How many observations one copy of the text's own writing is worth, at most, to the certainty of each
# copy length it reached; the mean still counts every token (and so does the certainty of a pooled copy,
# which the pool does not tell apart).  A reply that repeats one sentence with a word changed reads as a
# copy that goes on for 20 tokens: counted token by token, that one copy made copies of 7-15 tokens sure
# at 0.93-0.98, and the reply's next copies of its own phrasing were drafted 15 deep and broke within two
# tokens (an explanation 2-4% under plain decoding on the Zen 5 EPYC of stop 83).  A copy is told apart
# by where its source stands (Hint.copy).  Replayed on the recorded replies at six curves of four CPUs,
# each curve's kinds read 0.999-1.003 of before; that explanation went 0.975 -> 1.016 of plain decoding at
# stop 83's curve (but 1.018 -> 0.991 at another Zen 5 curve, where another copy is drafted deep), and
# 0.96 -> 0.98 in turns on the Zen 5 (benchmarks/ngram_sim.py, benchmarks/ab_commits.py; stop 84 in
# docs/benchmarks.md).  The lending sources keep counting tokens: a quote of the prompt is one copy
# however long, and counted per copy the summaries that quote it were up to 5% slower.
OBSERVATIONS_PER_COPY = 4


@dataclass
class _Foreseen:
    """A foreseen proposal: tokens guessed for context[start:] and the copy class of each, checked up to `checked`."""

    start: int
    tokens: list[int]
    classes: list[int]
    pairs: list[tuple[int, int]]  # each token with the one before it (the context's last, for the first)
    copy: int | None  # the copy it continues (Hint.copy)
    checked: int = 0

    def settle(self, context: list[int], observe: Callable[[int, tuple[int, int], int, int | None, bool], None]) -> bool:
        """Count the newly known positions; True while some are still unknown."""
        while self.checked < len(self.tokens) and self.start + self.checked < len(context):
            accepted = context[self.start + self.checked] == self.tokens[self.checked]
            observe(self.classes[self.checked], self.pairs[self.checked], self.start + self.checked, self.copy, accepted)
            self.checked += 1
            if not accepted:
                return False  # later positions would never have been reached
        return self.checked < len(self.tokens)


def token_pairs(context: Sequence[int], tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Each proposed token with the token before it: the context's last for the first (-1 for none)."""
    return list(zip([context[-1] if context else -1, *tokens[:-1]], tokens))


class PairRecord:
    """How often a drafted token was kept after the token before it, inside copies of this text.

    A text's copies break where the copied text was edited: a line inserted after every `def` line, a
    renamed name, a changed indent.  The pair at such a spot is drafted and rejected in every copy that
    reaches it, while the pairs of text copied unchanged are kept, so the record tells a proposal's
    depths apart where the copy-length estimate cannot.  Each text position counts once per pair,
    however many overlapping proposals foresaw it; nothing decays, as a spot edited once tends to be
    edited again in this text (the record belongs to one text, like the foreseen proposals).
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], list[float]] = {}  # pair -> [kept, drafted]

    def observe(self, pair: tuple[int, int], accepted: bool) -> None:
        counts = self._counts.setdefault(pair, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += 1.0

    def refine(self, pairs: Sequence[tuple[int, int]], rates: np.ndarray, evidence: np.ndarray) -> None:
        """Lean each depth's (rate, evidence) on its pair's record, in place: PAIR_WEIGHT observations
        of the pair outweigh the estimate given."""
        for depth, pair in enumerate(pairs[: len(rates)]):
            counts = self._counts.get(pair)
            if counts is not None:
                kept, drafted = counts
                rates[depth] = (kept + PAIR_WEIGHT * rates[depth]) / (drafted + PAIR_WEIGHT)
                evidence[depth] = drafted + min(evidence[depth], PAIR_WEIGHT)


class HindsightAcceptance:
    """Learns from every step's foreseen proposal: for the n-gram drafter, whose proposals cost nothing.

    Its signal is the drafter's copy signal (drafters.ngram_signal): where the match was found and how
    many tokens it has matched, m.  A drafted token at depth i continues a copy that has matched m + i
    tokens when it is reached, so every depth of every proposal is an observation of one hazard: how
    often a copy that has gone on for about that many tokens goes on for one more (COPY_BUCKETS, per
    source).  All depths learn together, so a wide pass is planned from what the copies of this text did
    at that length, whichever step saw them, not from the few steps that foresaw that exact depth.
    Before any evidence a copy of m tokens goes on with probability m / (m + COPY_PRIOR_SHIFT).
    """

    learns_without_drafting = True

    def __init__(self, k_max: int, *, decay: float = HINDSIGHT_DECAY, caution: float = CAUTION,
                 learned: Mapping[int, tuple[Sequence[float], Sequence[float]]] | None = None):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if caution < 0.0:
            raise ValueError(f"caution must be >= 0, got {caution}")
        self.k_max, self.decay, self.caution = k_max, decay, caution
        classes = len(SOURCES) * len(COPY_BUCKETS)
        self._hits, self._tries = np.zeros(classes), np.zeros(classes)
        # the copies that reached each class, decayed as the counts are: the evidence of the classes of the
        # sources that are not lent from (OBSERVATIONS_PER_COPY)
        self._copies = np.zeros(classes)
        self._counts_copies = np.repeat([source not in LENDING_SOURCES for source in SOURCES], len(COPY_BUCKETS))
        self._counted_copies: set[tuple[int, int]] = set()  # (copy, class) of this text's copies counted so far
        self._session = DecayedCounts(classes)  # undecayed, since the last export()
        lengths = np.tile(np.array(COPY_BUCKETS, float), len(SOURCES))  # each class's shortest copy
        self._prior = lengths / (lengths + COPY_PRIOR_SHIFT)
        for copy_class, (hits, tries) in (learned or {}).items():
            copy_class = int(copy_class)
            if 0 <= copy_class < classes and len(tries) and float(tries[0]) > 0:
                scale = min(1.0, LEARNED_WEIGHT_MAX / float(tries[0]))  # worth at most LEARNED_WEIGHT_MAX observations
                self._hits[copy_class], self._tries[copy_class] = float(hits[0]) * scale, float(tries[0]) * scale
                self._copies[copy_class] = self._tries[copy_class] / OBSERVATIONS_PER_COPY  # all of it evidence
        self._foreseen: list[_Foreseen] = []  # proposals waiting to be checked against the text
        self._context: list[int] | None = None  # the context they were made on
        self._pairs = PairRecord()  # the context's token pairs, as drafts inside its copies fared
        self._proposal: tuple[int, list[tuple[int, int]]] | None = None  # this step's signal and proposal's pairs
        self._pair_min_class = np.searchsorted(COPY_BUCKETS, PAIR_MIN_COPY, side="right") - 1

    # -- estimates --------------------------------------------------------------------------

    def _classes(self, signal: int) -> np.ndarray:
        """The copy class of each draft depth 0..k_max-1 for this signal (-1: no copy, nothing to draft)."""
        source, length = copy_signal_parts(signal)
        if length <= 0:
            return np.full(self.k_max, -1)
        lengths = np.minimum(length + np.arange(self.k_max), COPY_BUCKETS[-1])
        return source * len(COPY_BUCKETS) + np.searchsorted(COPY_BUCKETS, lengths, side="right") - 1

    def _rates(self, signal: int) -> tuple[np.ndarray, np.ndarray]:
        classes = self._classes(signal)
        if classes[0] < 0:
            return np.zeros(self.k_max), np.zeros(self.k_max)
        first = classes[0] - classes[0] % len(COPY_BUCKETS)  # the shortest copy class of the signal's source
        rates, evidence = self._source_rates(first)[classes - first], self._evidence(classes) + PRIOR_WEIGHT
        if self._proposal is not None and self._proposal[0] == signal:  # the proposal this step foresaw
            self._pairs.refine(self._proposal[1], rates, evidence)
        return rates, evidence

    def _source_rates(self, first: int) -> np.ndarray:
        """The estimate of each copy class of one source, shortest first: its counts on a prior of its guess
        or what the shorter classes lend (LENDING_SOURCES), whichever is higher."""
        rates, lent = np.empty(len(COPY_BUCKETS)), 0.0
        lends = SOURCES[first // len(COPY_BUCKETS)] in LENDING_SOURCES
        for bucket, length in enumerate(COPY_BUCKETS):
            hits, tries = self._hits[first + bucket], self._tries[first + bucket]
            prior = max(self._prior[first + bucket], lent)
            rates[bucket] = (hits + PRIOR_WEIGHT * prior) / (tries + PRIOR_WEIGHT)
            if lends and length >= LENDING_COPY:
                lent = max(lent, float(self._cautious(rates[bucket], tries + PRIOR_WEIGHT)))
        return rates

    def _evidence(self, classes: np.ndarray) -> np.ndarray:
        """The observations behind each class's estimate: its counts, and for the sources that are not lent
        from, no more than OBSERVATIONS_PER_COPY for each copy that reached it."""
        tries = self._tries[classes]
        per_copy = np.minimum(tries, OBSERVATIONS_PER_COPY * self._copies[classes])
        return np.where(self._counts_copies[classes], per_copy, tries)

    def _cautious(self, rates: np.ndarray | float, evidence: np.ndarray | float) -> np.ndarray:
        """The mean less `caution` standard errors of the evidence behind it."""
        return np.clip(rates - self.caution * np.sqrt(rates * (1.0 - rates) / (evidence + 1.0)), 0.0, 1.0)

    def mean(self, signal: int = 0) -> np.ndarray:
        """Estimated acceptance a_1..a_k_max of a draft made on this signal (this step's proposal, when
        it was foreseen on this signal)."""
        return self._rates(signal)[0]

    def planning(self, signal: int = 0) -> np.ndarray:
        """What the controller plans with: the mean less `caution` standard errors, per depth."""
        return self._cautious(*self._rates(signal))

    def export(self) -> dict[int, tuple[list[float], list[float]]]:
        """Per copy class, ([hits], [tries]) observed since the last export; then forget them."""
        session, self._session = self._session, DecayedCounts(len(self._tries))
        return {int(c): ([float(session.hits[c])], [float(session.tries[c])]) for c in np.flatnonzero(session.tries)}

    # -- learning ---------------------------------------------------------------------------

    def _observe(self, copy_class: int, accepted: bool) -> None:
        for hits, tries in ((self._hits, self._tries), (self._session.hits, self._session.tries)):
            tries[copy_class] += 1.0
            hits[copy_class] += accepted

    def _observer(self) -> Callable[[int, tuple[int, int], int, int | None, bool], None]:
        """What one settle() counts a scored token with: its copy class up to MAX_COUNTS_PER_POSITION times
        per text position, the copy it belongs to once per class (a copy not told apart, once per count),
        its pair once per position and inside copies only (all the proposals that foresaw a position are
        settled together)."""
        class_counts: Counter[tuple[int, int]] = Counter()
        counted_pairs: set[tuple[int, tuple[int, int]]] = set()

        def observe(copy_class: int, pair: tuple[int, int], position: int, copy: int | None, accepted: bool) -> None:
            class_counts[position, copy_class] += 1
            if class_counts[position, copy_class] <= MAX_COUNTS_PER_POSITION:
                self._observe(copy_class, accepted)
                if copy is None or (copy, copy_class) not in self._counted_copies:
                    if copy is not None:
                        self._counted_copies.add((copy, copy_class))
                    self._copies[copy_class] += 1.0
            if copy_class % len(COPY_BUCKETS) >= self._pair_min_class and (position, pair) not in counted_pairs:
                counted_pairs.add((position, pair))
                self._pairs.observe(pair, accepted)
        return observe

    def watch(self, context: list[int], signal: int, proposal: Callable[[], Sequence[int]],
              copy: int | None = None) -> None:
        """Score the earlier proposals against what context has gained since, then record what the
        drafter would propose now (as many tokens as it can, whatever k is chosen) and the copy it
        continues (Hint.copy).

        The check is fair at any temperature: the tokens that follow are sampled from the target's
        distribution, so a foreseen token matches the next one with the probability that
        verification would have accepted it.
        """
        self.settle(context)
        self.foresee(context, proposal(), signal, copy)

    def settle(self, context: list[int]) -> None:
        """Score the recorded proposals against the tokens context has gained since, depth by depth."""
        if context is not self._context:
            self._start_text(context)  # a new text: old proposals say nothing
            return
        observe = self._observer()
        self._foreseen = [entry for entry in self._foreseen if entry.settle(context, observe)]

    def _start_text(self, context: list[int]) -> None:
        """Forget what belongs to the previous text: its unsettled proposals, its pairs' record and its copies."""
        self._foreseen, self._context, self._pairs, self._proposal = [], context, PairRecord(), None
        self._counted_copies = set()

    def foresee(self, context: list[int], tokens: Sequence[int], signal: int = 0, copy: int | None = None) -> None:
        """Record a proposal made after context, continuing copy (Hint.copy), to be scored by settle() as the
        text goes on."""
        if context is not self._context:
            self._start_text(context)
        self._proposal = None
        classes = self._classes(signal)
        if not tokens or classes[0] < 0:
            return
        self._hits *= self.decay  # once per proposal: the hazards follow this text as it goes on
        self._tries *= self.decay
        self._copies *= self.decay
        tokens = list(tokens[: self.k_max])
        pairs = token_pairs(context, tokens)
        self._proposal = (signal, pairs)
        self._foreseen.append(_Foreseen(len(context), tokens, classes.tolist(), pairs, copy))

    def record(self, proposed: int, accepted: int, signal: int = 0) -> None:
        """Nothing more to learn from verification: the draft was this step's foreseen proposal, and the
        next step's watch() settles it before that step chooses, so a rejected long draft costs its copy
        class at once.  (Counting the miss again here cost refactors 3% in benchmarks/ngram_sim.py.)"""
