"""Names a text renames while it copies: learned from the n-gram drafter's own lookups, applied to its drafts.

A rename refactor ("rename userData to profile everywhere") copies its source with one name replaced.
Every copy of the source then breaks at each occurrence of the name: the draft has the old name's token
where the text has the new one, and the lookup that follows finds nothing, since the text's tail (with the
new name) occurs nowhere in the source.  Both are mended by one table of token renames:

- a lookup is made on the text's tokens with each new token read as the old one (canonical tokens), so the
  tail goes on matching the source across a renamed token;
- a drafted token is written with the rename applied, so the draft holds the new name.

A rename is learned when a lookup's prediction and the text part at one token and agree again on the next
two: one token replaced, the copy otherwise intact.  It is forgotten when the text keeps the old token
where the rename predicted the new one, and taken again only when seen twice more (a re-indented block
whose lines keep their indent now and then), so each change of the table, which has the drafter read its
context again, follows at least two sightings.  A rename whose old or new token is one end of another is
not taken, so each token has one reading.  Drafts are verified as any others, so a wrong rename costs only
acceptance.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

# How far past a lookup its prediction is compared with the text, and how many lookups are kept for it.
WATCHED_TOKENS = 16
WATCHED_LOOKUPS = 4
# Tokens after the replaced one that must agree again before a replacement counts as seen, and how many
# times it must be seen to be a rename: a template copied with one slot varied (a docstring's " Args" then
# " Returns", a list's "2" then "3") replaces a token once, a renamed name at each of its occurrences.
REALIGNED_TOKENS = 2
SIGHTINGS = 2


class RenameTable:
    """The token renames of one text: old -> new, and each new token's old one."""

    def __init__(self) -> None:
        self.new_of: dict[int, int] = {}
        self.old_of: dict[int, int] = {}
        # (position, the source's canonical tokens, where the prediction starts in them)
        self._lookups: deque[tuple[int, Sequence[int], int]] = deque(maxlen=WATCHED_LOOKUPS)
        self._sighted: dict[tuple[int, int], set[int]] = {}  # (old, new) -> the text positions it was seen at

    def canonical(self, token: int) -> int:
        """The token as the source spells it: a renamed name's new token reads as its old one."""
        return self.old_of.get(token, token)

    def written(self, token: int) -> int:
        """A canonical token as the text now writes it: a renamed name's old token becomes its new one."""
        return self.new_of.get(token, token)

    def watch(self, position: int, source: Sequence[int], start: int) -> None:
        """A lookup at this position of the text predicted it from source's tokens (canonical: the text's own
        canonical reading, or another text that never renamed anything, such as a predicted output) from
        start on."""
        last = self._lookups[-1] if self._lookups else None
        if last is None or last[0] != position or last[1] is not source or last[2] != start:
            self._lookups.append((position, source, start))

    def settle(self, canonical: list[int], tokens: list[int]) -> bool:
        """Compare the watched lookups' predictions with the text now known (its canonical reading and its
        tokens); True when a rename was learned or forgotten (the caller reads the text again)."""
        changed, unsettled = False, deque(maxlen=WATCHED_LOOKUPS)
        for position, source, start in self._lookups:
            verdict = self._judge(canonical, tokens, position, source, start)
            if verdict is None:
                unsettled.append((position, source, start))
            else:
                changed |= verdict
        self._lookups = unsettled
        return changed

    def _judge(self, canonical: list[int], tokens: list[int], position: int, source: Sequence[int],
               start: int) -> bool | None:
        """None while the lookup's first disagreement (and the tokens after it) are not known yet; else
        whether it changed the table."""
        # a prediction from the text itself must not run into the tokens it predicts
        end = position if source is canonical else len(source)
        for i in range(WATCHED_TOKENS):
            if position + i >= len(tokens):
                return None
            if start + i + REALIGNED_TOKENS >= end:
                return False
            predicted, actual = source[start + i], tokens[position + i]
            if self.written(predicted) == actual:
                continue
            if predicted in self.new_of and actual == predicted:  # the text kept the old name
                new = self.new_of.pop(predicted)
                del self.old_of[new]
                del self._sighted[predicted, new]  # taken again only on fresh sightings
                return True
            after = position + i + 1
            if after + REALIGNED_TOKENS > len(tokens):
                return None
            resumed = start + i + 1
            realigned = canonical[after: after + REALIGNED_TOKENS] == list(source[resumed: resumed + REALIGNED_TOKENS])
            return realigned and self._sight(predicted, actual, position + i)
        return False

    def _sight(self, old: int, new: int, position: int) -> bool:
        """Count one replacement of old by new (each text position once); True when it became a rename."""
        if old == new or old in self.old_of or new in self.new_of or new in self.old_of or old in self.new_of:
            return False
        seen = self._sighted.setdefault((old, new), set())
        seen.add(position)
        if len(seen) < SIGHTINGS:
            return False
        self.new_of[old], self.old_of[new] = new, old
        return True
