"""Training heads on teacher data, within a time budget, in numpy.

Minibatch Adam on each head's cross-entropy against the target's own top
token, restricted to a reduced vocabulary: the tokens the target predicts
most often in the training data.  The projection onto that vocabulary stays
the target's lm_head (frozen), so what the heads learn is a correction in
hidden space (d x d per matrix), not a new output layer.

A Trainer's whole state (heads, Adam's moments, the data, the time spent)
goes into a resume file on request, so an interrupted run continues where
it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .network import Adam, Heads, top_k_hits, train_step
from .teacher import TeacherData

EVAL_BATCH = 512


# Measured with benchmarks/heads_forms.py on 13,313 positions of Qwen2.5-Coder-1.5B's own replies, scored on
# 954 held-out ones: Hydra 32.4% head-1 top-1 after 4 epochs, Medusa 32.1% (heads 2 and 3: 14.6/7.1% against
# 12.9/5.8%); on half the data a rate of 1e-3 beat 3e-4 at every epoch (27.3% against 22.2% after 2, 30.6%
# against 27.0% after 5), and filling the vocabulary up with unseen tokens lost top-1 (26.7% against 27.7%).
# At 1e-3 on all 13,313: 34.3% after 4 epochs (heads 2 and 3: 16.7/10.0%); a rate decaying linearly to a tenth
# did not help (32.2%).  Data counts most: at 3e-4, 6,349 positions level off near 27.5%, 13,313 near 32.5%.
@dataclass(frozen=True)
class TrainingPlan:
    form: str = "hydra"
    n_heads: int = 3
    vocab_size: int = 8192  # a 15-minute run's data has fewer distinct top tokens, so more would rank the same set
    batch: int = 256
    rate: float = 1e-3
    max_epochs: float = 8.0  # passes over the data after which more steps would only fit it by heart


def reduced_vocabulary(top: np.ndarray, size: int, fill: bool = False) -> np.ndarray:
    """The size tokens the target predicts most often in top, most frequent first (ties by id); with fill,
    a top with fewer distinct tokens is filled up with the lowest ids it lacks (a BPE vocabulary lists its
    tokens roughly by how common they were when it was made)."""
    ids, counts = np.unique(top, return_counts=True)
    order = np.lexsort((ids, -counts))[:size]
    vocab = ids[order].astype(np.int32)
    if fill and len(vocab) < size:
        lacking = np.setdiff1d(np.arange(2 * size, dtype=np.int32), vocab)[:size - len(vocab)]
        vocab = np.concatenate([vocab, lacking])
    return vocab


def seconds_per_example(plan: TrainingPlan, data: TeacherData, lm_head, n_vocab: int, steps: int = 3) -> float:
    """What training costs here per example (a head-1 position, every head trained on it): the quickest of a
    few minibatch steps on data, with a vocabulary of the plan's size.  Heads made for this are thrown away."""
    vocab = np.arange(min(plan.vocab_size, n_vocab), dtype=np.int32)
    heads = Heads.fresh(plan.form, plan.n_heads, vocab, lm_head.rows(vocab))
    trainer = Trainer(heads, Adam(plan.rate), data, data, lm_head, n_vocab, plan)
    best = float("inf")
    for _ in range(steps):
        started, seen = time.perf_counter(), trainer.examples_seen
        trainer.step()
        best = min(best, (time.perf_counter() - started) / max(trainer.examples_seen - seen, 1))
    return best


class TokenRows:
    """The lm_head rows of every token a TeacherData holds, gathered once (what Hydra-style heads see)."""

    def __init__(self, lm_head, tokens: np.ndarray):
        self.ids, self.index = np.unique(tokens, return_inverse=True)
        self.rows = lm_head.rows(self.ids).astype(np.float16) if len(self.ids) else np.zeros((0, lm_head.n_embd))

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.rows[self.index[positions]].astype(np.float32)


class Trainer:
    """Heads, their optimizer and their data: steps until a deadline, and held-out accuracy."""

    def __init__(self, heads: Heads, adam: Adam, data: TeacherData, heldout: TeacherData, lm_head, n_vocab: int,
                 plan: TrainingPlan, seconds_spent: float = 0.0, examples_seen: int = 0):
        self.heads, self.adam, self.plan, self.n_vocab = heads, adam, plan, n_vocab
        self.data, self.heldout = data.join(), heldout.join()
        self.adam.start(heads)
        self._index_of = np.full(n_vocab, -1, dtype=np.int32)
        self._index_of[heads.vocab] = np.arange(len(heads.vocab), dtype=np.int32)
        self._positions = [data.positions(j + 1) for j in range(heads.n_heads)]
        self._rows = {"train": TokenRows(lm_head, self.data.tokens), "heldout": TokenRows(lm_head, self.heldout.tokens)}
        self.seconds_spent, self.examples_seen = seconds_spent, examples_seen
        self.recent_top1 = 0.0  # head 1's accuracy on its latest minibatches (decayed mean)
        self._rng = np.random.default_rng(examples_seen)

    @property
    def epochs(self) -> float:
        return self.examples_seen / max(len(self._positions[0]), 1)

    def inputs(self, which: str, j: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Head j's (0-based) inputs at positions t: h_t, the row of token t + j + 1, and the reduced label."""
        data = self.data if which == "train" else self.heldout
        rows = self._rows[which].at(positions + j + 1) if self.heads.sees_token else None
        return data.hidden[positions].astype(np.float32), rows, self._index_of[data.top[positions + j + 1]]

    def step(self) -> None:
        """One minibatch for every head."""
        for j, positions in enumerate(self._positions):
            if not len(positions):
                continue
            chosen = self._rng.choice(positions, size=min(self.plan.batch, len(positions)), replace=False)
            _, right, n = train_step(self.heads, self.adam, j, *self.inputs("train", j, chosen))
            if j == 0:
                self.examples_seen += n
                self.recent_top1 = 0.9 * self.recent_top1 + 0.1 * right / n if self.examples_seen > n else right / n

    def run(self, deadline: float, progress: Callable[[Trainer], None]) -> None:
        """Steps until the deadline (time.monotonic) or plan.max_epochs, reporting after each."""
        while time.monotonic() < deadline and self.epochs < self.plan.max_epochs and len(self._positions[0]):
            started = time.monotonic()
            self.step()
            self.seconds_spent += time.monotonic() - started
            progress(self)

    def heldout_accuracy(self, limit: int | None = None) -> tuple[list[float], list[float], int]:
        """Top-1 and top-3 accuracy per head on the held-out replies (up to limit positions), and how many
        positions head 1 was scored on."""
        top1, top3, counted = [], [], 0
        for j in range(self.heads.n_heads):
            positions = self.heldout.positions(j + 1)[:limit]
            hits1 = hits3 = 0
            for start in range(0, len(positions), EVAL_BATCH):
                a, b = top_k_hits(self.heads, j, *self.inputs("heldout", j, positions[start:start + EVAL_BATCH]))
                hits1, hits3 = hits1 + a, hits3 + b
            top1.append(hits1 / max(len(positions), 1))
            top3.append(hits3 / max(len(positions), 1))
            counted = counted or len(positions)
        return top1, top3, counted

    def grown(self, data: TeacherData, lm_head) -> Trainer:
        """This trainer, its heads and optimizer carried on, training on data (more of it) from now on.

        The reduced vocabulary is chosen again from the larger data; the heads'
        trained part lives in hidden space, so it does not depend on it.
        """
        vocab = reduced_vocabulary(data.join().top, self.plan.vocab_size)
        heads = Heads(self.heads.form, vocab, lm_head.rows(vocab), self.heads.a, self.heads.b, self.heads.bias)
        return Trainer(heads, self.adam, data, self.heldout, lm_head, self.n_vocab, self.plan, self.seconds_spent,
                       self.examples_seen)

    def state(self) -> dict[str, np.ndarray]:
        """Everything a resumed run needs, as arrays (the resume file)."""
        moments = {f"adam_{name}": array for name, array in self.adam.moments.items()}
        return {**self.heads.arrays(), **moments, "adam_steps": self.adam.steps,
                **self.data.arrays("data_"), **self.heldout.arrays("heldout_"),
                "progress": np.array([self.seconds_spent, self.examples_seen], dtype=np.float64)}

    @classmethod
    def resumed(cls, arrays: dict, plan: TrainingPlan, lm_head, n_vocab: int, sources: dict) -> Trainer:
        vocab = arrays["vocab"]
        heads = Heads(plan.form, vocab, lm_head.rows(vocab), arrays["a"], arrays["b"], arrays["bias"])
        adam = Adam(plan.rate, steps=arrays["adam_steps"],
                    moments={name[5:]: arrays[name] for name in arrays if name.startswith("adam_") and name != "adam_steps"})
        data = TeacherData.from_arrays(arrays, "data_", sources.get("data", {}))
        heldout = TeacherData.from_arrays(arrays, "heldout_", sources.get("heldout", {}))
        seconds, examples = arrays["progress"]
        return cls(heads, adam, data, heldout, lm_head, n_vocab, plan, float(seconds), int(examples))
