"""Teacher data for heads: the target's hidden state at every position of some text, and its own top token there.

The labels are the target's predictions, read from batched every-row passes
(far faster than generating): heads learn to guess what the target would
say, which is what verification accepts.  Text comes as token lists (the
caller tokenizes files, chats and prompts); the target also answers prompts
itself (greedy), which gives text in its own voice, and the held-out set is
made of such replies only, as that is what drafting meets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

WINDOW = 1024  # tokens of one text labelled in one cache: long enough for context, short enough to stop on time


@dataclass
class TeacherData:
    """Positions of several texts, concatenated: token, hidden state after it, the target's top token after it."""

    tokens: np.ndarray  # (N,) int32
    hidden: np.ndarray  # (N, d) float16
    top: np.ndarray  # (N,) int32: the target's argmax after tokens[i], its guess of tokens[i + 1]
    ends: np.ndarray  # (S,) int64: where each text ends (exclusive), ascending
    sources: dict = field(default_factory=dict)  # positions per kind of data

    @classmethod
    def empty(cls, n_embd: int) -> TeacherData:
        return cls(np.zeros(0, np.int32), np.zeros((0, n_embd), np.float16), np.zeros(0, np.int32),
                   np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def add(self, tokens: Sequence[int], hidden: np.ndarray, top: np.ndarray, source: str) -> None:
        """Append one text.  Pieces are joined when a reader asks (join), not once per text."""
        if not hasattr(self, "_pieces"):
            self._pieces = [[self.tokens], [self.hidden], [self.top]]
        for pieces, array in zip(self._pieces, (np.asarray(tokens, np.int32), hidden.astype(np.float16),
                                                 top.astype(np.int32))):
            pieces.append(array)
        self.ends = np.append(self.ends, len(self) + len(tokens))
        self.sources[source] = self.sources.get(source, 0) + len(tokens)

    def extend(self, other: TeacherData, source: str, max_tokens: int) -> None:
        """Append other's texts, whole, while the positions stay within max_tokens."""
        other.join()
        starts = np.concatenate([[0], other.ends[:-1]]).astype(np.int64)
        for start, end in zip(starts, other.ends):
            if len(self) + end - start > max_tokens:
                return
            self.add(other.tokens[start:end], other.hidden[start:end], other.top[start:end], source)

    def join(self) -> TeacherData:
        """Make tokens, hidden and top hold every text added; returns self."""
        pieces = self.__dict__.pop("_pieces", None)
        if pieces is not None:
            self.tokens, self.hidden, self.top = (np.concatenate(p) for p in pieces)
        return self

    def positions(self, head: int) -> np.ndarray:
        """Positions t where head (1-based) has a label: t + head still inside t's text."""
        starts = np.concatenate([[0], self.ends[:-1]])
        spans = [np.arange(s, e - head) for s, e in zip(starts, self.ends) if e - head > s]
        return np.concatenate(spans) if spans else np.zeros(0, np.int64)

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        self.join()
        return {f"{prefix}{name}": getattr(self, name) for name in ("tokens", "hidden", "top", "ends")}

    @classmethod
    def from_arrays(cls, arrays: dict, prefix: str, sources: dict) -> TeacherData:
        return cls(*(arrays[f"{prefix}{name}"] for name in ("tokens", "hidden", "top", "ends")), dict(sources))


def label_texts(model, texts: Iterable[tuple[str, list[int]]], data: TeacherData, deadline: float,
                max_tokens: int, progress: Callable[[int], None], enough: Callable[[], bool] = lambda: False) -> None:
    """Add (source, tokens) texts to data through teacher passes, in windows of WINDOW tokens, until the
    deadline (time.monotonic), max_tokens positions or enough()."""
    window = min(WINDOW, model.n_ctx - 1)
    for source, tokens in texts:
        for start in range(0, len(tokens), window):
            if time.monotonic() > deadline or len(data) >= max_tokens or enough():
                return
            piece = tokens[start:start + min(window, max_tokens - len(data))]
            if len(piece) < 2:
                break
            model.rewind(0)
            hidden, top = model.teacher_pass(piece)
            data.add(piece, hidden, top, source)
            progress(len(data))


def answer_prompts(model, prompts: Iterable[list[int]], data: TeacherData, source: str, max_reply: int,
                   deadline: float, progress: Callable[[int], None], together: int = 16,
                   enough: Callable[[], bool] = lambda: False) -> None:
    """Let the target answer each prompt (token ids) greedily until the deadline (time.monotonic) or enough(),
    adding [last prompt token, *reply] of each to data; replies cut short count too."""
    answering = Answering(model, prompts, data, source, max_reply, together)
    answering.run(deadline, progress, enough)
    answering.keep_unfinished(progress)


class Answering:
    """Prompts the target is answering greedily, several at once, over as many calls of run as it takes.

    Each reply adds [last prompt token, *reply] to data: the positions whose
    next token is the reply's, with the hidden states the replying passes
    computed.  Up to `together` prompts are answered in one pass (a sequence
    each): on a CPU a pass over 16 rows costs about 4 single-row passes (the
    measured cost curve), so this is several times plain decoding's throughput.
    """

    def __init__(self, model, prompts: Iterable[list[int]], data: TeacherData, source: str, max_reply: int,
                 together: int = 16):
        self.model, self.data, self.source, self.max_reply = model, data, source, max_reply
        self._queue = list(prompts)
        self._together = max(1, min(together, len(self._queue)))
        self._replies: dict[int, _Reply] = {}
        model.reserve_sequences(self._together)

    @property
    def finished(self) -> bool:
        return not (self._queue or self._replies)

    @property
    def in_flight(self) -> int:
        """Positions of the replies being written: data gets them when a reply ends (or keep_unfinished)."""
        return sum(len(reply.top) for reply in self._replies.values())

    def run(self, deadline: float, progress: Callable[[int], None], enough: Callable[[], bool] = lambda: False) -> bool:
        """Answer until every prompt is answered (returns True), the deadline (time.monotonic) passes or enough()."""
        model, replies = self.model, self._replies
        while not self.finished and time.monotonic() < deadline and not enough():
            for seq in set(range(self._together)) - replies.keys():
                if self._queue:
                    replies[seq] = _Reply.start(model, self._queue.pop(0), seq)
            parts = [(seq, [reply.tokens[-1]], 1) for seq, reply in replies.items()]
            for (seq, _, _), logits in zip(parts, model.decode_sequences(parts)):
                replies[seq].add(model.last_hidden(seq)[0], int(np.argmax(logits[0])))
                if replies[seq].finished(model, self.max_reply):
                    replies.pop(seq).keep(self.data, self.source, progress)
        return self.finished

    def keep_unfinished(self, progress: Callable[[int], None]) -> None:
        """Add the replies still being written as they are (what was answered counts), and drop them."""
        for reply in self._replies.values():
            reply.keep(self.data, self.source, progress)
        self._replies.clear()


@dataclass
class _Reply:
    """A prompt being answered: [its last token, the reply so far], and the passes' rows after each of them."""

    tokens: list[int]
    room: int  # tokens the sequence's context has left
    hidden: list = field(default_factory=list)
    top: list = field(default_factory=list)

    @classmethod
    def start(cls, model, prompt: list[int], seq: int) -> _Reply:
        model.rewind(0, seq)
        prompt = prompt[-(model.n_ctx // 2):]  # a prompt longer than half the context leaves too little room
        model.decode(prompt[:-1], n_logits=0, seq=seq)
        return cls([prompt[-1]], model.n_ctx - len(prompt))

    def add(self, hidden: np.ndarray, top: int) -> None:
        self.hidden.append(hidden.astype(np.float16))
        self.top.append(top)
        self.tokens.append(top)

    def keep(self, data: TeacherData, source: str, progress: Callable[[int], None]) -> None:
        if len(self.tokens) > 2:
            data.add(self.tokens[:-1], np.stack(self.hidden), np.array(self.top), source)
            progress(len(data))

    def finished(self, model, max_reply: int) -> bool:
        return (model.is_end_of_generation(self.tokens[-1]) or len(self.tokens) > max_reply
                or len(self.tokens) >= self.room)
