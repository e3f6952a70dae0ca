"""Drafters: cheap guesses of the next tokens, verified later by the target.

Every drafter answers two questions about a context (the prompt plus every
accepted token, ending with the token the target has not seen yet):

- ``peek(context)``: how good a guess it could make now (a signal, such as an
  n-gram match length) and how many tokens it could offer at most;
- ``propose(context, k, params, rng, stop_below=())``: up to k draft tokens,
  with the draft's probability rows q when it has them (None means a
  deterministic proposal); a drafter that knows its own confidence stops
  before position i when it is below stop_below[i - 1] (llama.cpp's p_min).

Drafters keep their own state in step with the context by themselves, so the
engine never has to tell them what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .backend import LlamaModel, common_prefix_length
from .errors import Setting, VocabMismatchError
from .copy_cursor import TAKEOVER_MATCH, CopyCursor
from .ngram_pool import NgramPool, TokenIndex
from .renames import RenameTable
from .limits import MAX_DRAFT_TOKENS, MAX_VOCAB_SIZE_DIFFERENCE
from .sampling import SamplingParams, sample, to_probs


@dataclass(frozen=True)
class Hint:
    signal: int = 0  # the drafter's class of its guess, e.g. where an n-gram matched and how long (ngram_signal)
    available: int | None = None  # the most tokens it can propose now (None: no limit)
    # which copy the guess continues: how far back from the context's end its source stands, the same at every
    # step of one copy of a text (None: not known), so that the steps of one copy count as one copy (hindsight.py)
    copy: int | None = None


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: list[np.ndarray] | None = None  # q rows, one per token; None for one-hot proposals
    source: str = ""  # where the tokens were found, for drafters with several sources ("context", "prediction", "pool")


NO_PROPOSAL = Proposal([])


def up_to_an_end(tokens: list[int], end_tokens: frozenset[int]) -> list[int]:
    """The draft up to and with its first end-of-generation token: the target stops there if it keeps it,
    so nothing after it could be kept."""
    for i, token in enumerate(tokens):
        if token in end_tokens:
            return tokens[: i + 1]
    return tokens


class Drafter(Protocol):
    name: str

    @property
    def forward_passes(self) -> int:
        """Model passes the drafter has run (0 for drafters without a model)."""

    def peek(self, context: list[int]) -> Hint: ...

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                stop_below: Sequence[float] = ()) -> Proposal: ...


class NoDrafter:
    """Plain decoding through the same loop: the fair baseline."""

    name = "none"
    forward_passes = 0

    def peek(self, context: list[int]) -> Hint:
        return Hint(0, 0)

    def propose(self, context, k, params, rng, stop_below=()) -> Proposal:
        return NO_PROPOSAL


# An n-gram drafter's signal says where its match was found and how many tokens it matched: the length
# of the copy in progress, counted up to MAX_COPY_LENGTH (beyond the index's longest n-gram, by comparing
# the context with the text before the match).  The controller's hindsight learner keeps an acceptance
# estimate per source and copy length (hindsight.py); 0 means no match.  A match in the context is
# "prompt" when it lies in what the generation was given and "context" when it lies in what the generation
# wrote itself: a copy of a document breaks where the document is edited, a repeat of the reply's own
# text where the reply moves on, and one hazard for both fitted neither (benchmarks/ngram_sim.py).
SOURCES = ("context", "prediction", "pool", "prompt")
MAX_COPY_LENGTH = 64
_SIGNAL_STRIDE = MAX_COPY_LENGTH + 1


def ngram_signal(source: str, match_length: int) -> int:
    """The signal of a match of this length in this source (0: no match)."""
    if match_length <= 0:
        return 0
    return SOURCES.index(source) * _SIGNAL_STRIDE + min(int(match_length), MAX_COPY_LENGTH)


def copy_signal_parts(signal: int) -> tuple[int, int]:
    """(the source's index in SOURCES, the copy length) of an n-gram signal; length 0 for no match."""
    return divmod(int(signal), _SIGNAL_STRIDE)


class NgramDrafter:
    """Prompt lookup: continue the most recent earlier occurrence of the context's tail.

    The index maps every n-gram (n_min..n_max) to the position right after its
    most recent occurrence.  It grows with the context, one position per
    accepted token, and is rebuilt only when the context is rewritten (a new
    conversation, an edited turn) or a rename is learned.  A context list it
    has not seen before is a new generation's, and what that list holds then
    is its prompt: a match there is signalled as the prompt's, a match after
    it as the context's (the generation's own text).  The index reads the
    context with the renames the text has made undone, and drafts write them
    (renames.py), so a copy goes on across a renamed name.  It follows the copy
    in progress in its source (copy_cursor.py), so that after an edit the copy
    goes on where it stood, not wherever a token or two of tail last occurred.

    A generation may give it two more sources (ngram_pool.py): a prediction of
    the output, looked up like the context, and a pool of other texts of this
    process, looked up when neither has a match of the pool's shortest indexed
    length.  The prediction is taken only for a longer match than the
    context's: a client sends the file it edits as the prediction and in the
    messages too, and taken on a tie it split the copies' learned hazards
    over two sources and fed the rename table two lookups a step, so a
    prediction that repeated the prompt made single code edits and
    refactors 4-20% slower than none (benchmarks/prediction_sim.py).

    A copy that reaches a token ending generation (the end of a prompt's turn,
    an earlier reply's end) is drafted up to that token and no further: the
    target stops there when it agrees, and when it does not, nothing after it
    could be kept. Without the cut, a quote of the prompt's last lines drafted
    the chat template's next turn into a wide pass.
    """

    name = "ngram"
    forward_passes = 0

    def __init__(self, n_max: int = 16, n_min: int = 1, end_tokens: frozenset[int] = frozenset()):
        self.n_max, self.n_min = n_max, n_min
        self.end_tokens = end_tokens  # the target's end-of-generation tokens
        self._indexed: list[int] = []  # the context list last indexed (the caller's own object)
        self._n_indexed = 0  # how many of its tokens the index covers
        self._next_after: dict[tuple[int, ...], int] = {}
        self._canonical: list[int] = []  # the indexed tokens as the source spells them (renames undone)
        self._prompt_end = 0  # how many tokens the context list held when first seen: its generation's prompt
        self._renames = RenameTable()
        self._cursor = CopyCursor()  # where the copy in progress stands in the context
        self.prediction: TokenIndex | None = None
        self.pool: NgramPool | None = None

    def use_sources(self, prediction: TokenIndex | None = None, pool: NgramPool | None = None) -> None:
        """Look up these beyond the context from now on (None: not at all), e.g. for one generation."""
        self.prediction, self.pool = prediction, pool

    def for_sequence(self, seq: int) -> "NgramDrafter":
        """A drafter of its own for sequence seq, decoded alongside (as HeadsDrafter.for_sequence): an index
        of that sequence's own text, which is all an n-gram drafter reads."""
        return NgramDrafter(self.n_max, self.n_min, self.end_tokens)

    def peek(self, context: list[int]) -> Hint:
        match = self._lookup(context, MAX_DRAFT_TOKENS)
        if match is None:
            return Hint(0, 0)
        source, n, tokens, copy = match
        # a copy cut at an end token, or the end of a prediction or a pooled text, offers no more than that
        return Hint(ngram_signal(source, n), len(tokens) if len(tokens) < MAX_DRAFT_TOKENS else None, copy)

    def _copy_length(self, n: int, start: int) -> int:
        """How many tokens before the context's end match those before start: the match of n, extended
        past the index's longest n-gram up to MAX_COPY_LENGTH."""
        canonical, length = self._canonical, n
        while length < MAX_COPY_LENGTH and length < start and canonical[start - 1 - length] == canonical[-1 - length]:
            length += 1
        return length

    def propose(self, context, k, params=None, rng=None, stop_below=()) -> Proposal:
        match = self._lookup(context, k) if k > 0 else None
        if match is None:
            return NO_PROPOSAL
        source, _, tokens, _ = match
        return Proposal(tokens, None, source)

    def _lookup(self, context: list[int], k: int) -> tuple[str, int, list[int], int | None] | None:
        """(source, match length, the tokens it proposes: k, or fewer where an end token or its source ends them,
        the copy it continues: Hint.copy) of the best match, or None."""
        best = None
        found = self._copy_match(context)
        if found is not None:
            n, start = found
            period = len(context) - start
            canonical, written = self._canonical, self._renames.written
            self._renames.watch(len(context), canonical, start)
            # Past the end of the context, assume the text keeps repeating with the
            # period the match implies: that is what a loop or a copy looks like.
            source = "prompt" if start < self._prompt_end else "context"
            best = (source, n, lambda: [written(canonical[start + i % period]) for i in range(k)], period)
        # a predicted output is the text before the edit: looked up and written with the renames made since
        found = self.prediction.lookup(self._canonical) if self.prediction is not None else None
        if found is not None and (best is None or found[0] > best[1]):
            n, start = found
            predicted, written = self.prediction.tokens, self._renames.written
            self._renames.watch(len(context), predicted, start)
            best = ("prediction", n, lambda: [written(token) for token in predicted[start: start + k]],
                    len(context) - start)
        if self.pool is not None and (best is None or best[1] < min(self.pool.lengths)):
            pooled = self.pool.lookup(context, max(k, 1))
            if pooled is not None and pooled[1] and (best is None or pooled[0] > best[1]):
                best = ("pool", pooled[0], lambda: pooled[1][:k], None)  # the pool does not say where it matched
        if best is None:
            return None
        source, n, tokens, copy = best
        return source, n, up_to_an_end(tokens(), self.end_tokens), copy

    def _copy_match(self, context: list[int]) -> tuple[int, int] | None:
        """(copy length, where its next token is) of the copy to continue in the context: the copy the
        cursor follows where it is no shorter than the lookup's match, else the match (followed from now on,
        unless the cursor still follows a copy and the match is shorter than TAKEOVER_MATCH)."""
        found = self._context_match(context)
        if found is not None:
            n, start = found
            found = (self._copy_length(n, start) if n == self.n_max else n, start)
        cursor = self._cursor.position
        if cursor is not None:
            n = self._copy_length(0, cursor)
            if n and (found is None or n >= found[0]):
                return n, cursor
        if found is not None and (cursor is None or found[0] >= TAKEOVER_MATCH):
            self._cursor.move_to(found[1])
        return found

    def _context_match(self, context: list[int]) -> tuple[int, int] | None:
        self._sync(context)
        canonical = self._canonical
        for n in range(min(self.n_max, len(context) - 1), self.n_min - 1, -1):
            start = self._next_after.get(tuple(canonical[-n:]))
            if start is not None:
                return n, start
        return None

    def _sync(self, context: list[int]) -> None:
        # The engine only ever appends to the context list of a generation, so
        # the same list as last time needs no comparison: each step costs
        # O(new tokens), not O(context).  (A stale index could only cost
        # acceptance: every draft is verified.)  A new list, a new turn, is
        # compared once with the old one.
        if context is self._indexed and len(context) >= self._n_indexed:
            n_common = self._n_indexed
        else:
            if context is not self._indexed:
                self._prompt_end = len(context)
            self._cursor.forget()  # a copy of the text before belongs to it
            n_common = common_prefix_length(self._indexed[: self._n_indexed], context)
            if n_common < self._n_indexed:
                self._next_after, self._renames = {}, RenameTable()
                n_common = 0
        canonical = self._canonical
        del canonical[n_common:]
        canonical.extend(self._renames.canonical(token) for token in context[n_common:])
        for index in range(n_common, len(context)):
            self._cursor.follow(canonical, index)
        if self._renames.settle(canonical, context):  # read the whole context again with the renames now known
            self._next_after, n_common = {}, 0
            canonical[:] = [self._renames.canonical(token) for token in context]
        # index the n-grams that end before the last token: those have a known successor
        for end in range(max(n_common - 1, 0), len(context) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._next_after[tuple(canonical[end - n + 1 : end + 1])] = end + 1
        self._indexed, self._n_indexed = context, len(context)


class DraftModelDrafter:
    """A smaller model with the target's vocabulary, sampling k tokens one at a time.

    Its KV cache follows the context by common prefix: after a verification
    the rejected tail is dropped and only the newly accepted tokens are
    decoded on the next call.
    """

    name = "draft-model"

    def __init__(self, model: LlamaModel, n_vocab: int):
        self.model = model
        self.n_vocab = n_vocab  # the target's: q rows must line up with p rows
        # The context list of the last call and how long a prefix of it the
        # draft's cache was known to hold: the engine only appends to a
        # generation's context, so only the new tail needs comparing.
        self._context: list[int] = []
        self._n_known = 0

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def peek(self, context: list[int]) -> Hint:
        return Hint(0, None)

    def prefill(self, context: list[int]) -> None:
        """Put all but the last token of context in the draft's cache, in one batched pass.

        After steps drafted by someone else (n-grams) this catches the draft
        up on every accepted token at once, rather than token by token.
        """
        n_keep = min(self._cached_prefix(context), len(context) - 1)
        self.model.rewind(n_keep)
        self.model.decode(context[n_keep:-1], n_logits=0)
        self._context, self._n_known = context, len(context) - 1

    def propose(self, context, k, params: SamplingParams, rng: np.random.Generator,
                stop_below: Sequence[float] = ()) -> Proposal:
        if k <= 0:
            return NO_PROPOSAL
        n_keep = min(self._cached_prefix(context), len(context) - 1)
        self.model.rewind(n_keep)
        # views into llama.cpp's buffer: each row is read before the next decode
        logits = self.model.decode(context[n_keep:], 1, copy=False)[0]
        tokens, rows = [], []
        for i in range(k):
            logits = self._fit_vocab(logits)
            if i < len(stop_below) and stop_below[i] > 0.0 and _top_probability(logits) < stop_below[i]:
                break
            q = to_probs(logits, params)
            token = sample(q, rng)
            tokens.append(token)
            rows.append(q)
            if self.model.is_end_of_generation(token):
                break  # the target stops there if it keeps it; nothing after it could be kept
            if i + 1 < k:
                logits = self.model.decode([token], 1, copy=False)[0]
        self._context, self._n_known = context, len(context)
        return Proposal(tokens, rows)

    def _cached_prefix(self, context: list[int]) -> int:
        """How many leading tokens of context the draft's cache holds."""
        cached = self.model.cached
        # rewinds since then (a forgotten cache) only shorten what is known
        known = min(self._n_known, len(cached)) if context is self._context else 0
        return known + common_prefix_length(cached[known:], context[known:])

    def _fit_vocab(self, logits: np.ndarray) -> np.ndarray:
        # A draft whose vocabulary is a little shorter or longer than the target's
        # (padding rows) must never propose an id the target cannot emit.
        if logits.size == self.n_vocab:
            return logits
        fitted = np.full(self.n_vocab, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.size)
        fitted[:n] = logits[:n]
        return fitted


def _top_probability(logits: np.ndarray) -> float:
    return float(1.0 / np.exp(logits - logits.max()).sum())


def check_vocab_compatible(target: LlamaModel, draft: LlamaModel) -> None:
    """Raise VocabMismatchError, naming both files and the difference, unless the draft can draft for the target."""
    def mismatch(what: str) -> VocabMismatchError:
        return VocabMismatchError(
            f"draft {draft.path.name} cannot draft for target {target.path.name}: {what} (use a draft from the "
            "target's model family, or ", Setting("draft", "ngram"), ")"
        )

    if abs(target.n_vocab - draft.n_vocab) > MAX_VOCAB_SIZE_DIFFERENCE:
        raise mismatch(f"vocabulary sizes differ ({target.n_vocab} vs {draft.n_vocab})")
    if (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        raise mismatch(f"BOS/EOS ids differ ({target.bos_id}/{target.eos_id} vs {draft.bos_id}/{draft.eos_id})")
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if target.token_text(token) != draft.token_text(token):
            raise mismatch(
                f"token {token} is {target.token_text(token)!r} in the target but {draft.token_text(token)!r} in the draft"
            )
