"""Where a copy stands in its source, so that it goes on from there after an edit.

A code edit copies its source with changes: a type hint inserted after each parameter, a word
replaced, a line dropped.  The n-gram lookup continues the most recent earlier occurrence of the
text's tail, and right after an edit that tail is a token or two (the "," after an inserted ": str")
whose most recent occurrence can be anywhere: often in the line the reply has just written, which
is not the line the source goes on with.  A cursor keeps the source position the copy had reached
and follows the text token by token.  When the text writes a token that the source has a little
further on, the copy is taken up there: the source tokens passed over were the edit's.  The drafter
prefers the cursor's copy to another match no longer than it (drafters.NgramDrafter).
"""

from __future__ import annotations

from typing import Sequence

# How far past the cursor the text's next token is looked for in the source (the tokens passed over
# are ones the edit replaced or removed), and how many tokens the text may write that the source does
# not have there before the copy counts as over (an inserted line, or the reply has moved on).
RESYNC_WINDOW = 8
MAX_INSERTED = 12
# The shortest match elsewhere that takes the cursor away from a copy it still follows.  Inside an
# edit the text's tail is the edit's own tokens, and one of them often occurs elsewhere by itself (the
# " List" of `: List[float]` ends the import line): moved there, the cursor followed that line instead of
# the one the edit interrupts, and the copy had to be found afresh, from a short match, once the source
# went on (code-edit-05 of the twelve; 1-1.4% on the twelve replayed at three curves, the other kinds level).
TAKEOVER_MATCH = 2


class CopyCursor:
    """The position in a text of the token its copy in progress expects next (None: no copy)."""

    def __init__(self) -> None:
        self.position: int | None = None
        self._inserted = 0  # tokens written since the copy was last in step

    def move_to(self, position: int) -> None:
        """A copy from this position on is the one to follow."""
        self.position, self._inserted = position, 0

    def forget(self) -> None:
        self.position = None

    def follow(self, text: Sequence[int], index: int) -> None:
        """The text has gained text[index]: step past it in the source, take the copy up after it a little
        further on, or count it as inserted.  The source is the text before index."""
        if self.position is None:
            return
        token, position = text[index], self.position
        for found in range(position, min(position + RESYNC_WINDOW, index)):
            if text[found] == token:
                self.position, self._inserted = found + 1, 0
                return
        self._inserted += 1
        if self._inserted > MAX_INSERTED:
            self.position = None
