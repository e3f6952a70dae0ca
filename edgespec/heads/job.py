"""One `edgespec heads train` run: collect teacher data, train within the time budget, score, save.

The budget is wall time for the whole run.  The held-out replies come first,
then the training texts in the order the user would want them used (their
own files, their own usage, the built-in prompts answered 16 at a time)
until the time left is what training a few passes over them takes, then
training until the budget or the epoch limit, then the held-out score.
Collecting is what limits accuracy (a 15-minute run on a 2-core CPU
collects tens of thousands of tokens), so it gets all the time that
training does not need.

Ctrl+C at any point keeps what was done in a resume file (written
atomically, like the heads file itself): the same command run again picks it
up and trains on.  Nothing half-written is ever left under either name.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EdgespecError
from ..files import atomic_write, parse_json, read_arrays
from ..model_identity import loaded_model_identity
from .network import Adam, Heads
from .store import HeadsRecord, save_heads
from .teacher import Answering, TeacherData, answer_prompts, label_texts
from .training import Trainer, TrainingPlan, reduced_vocabulary, seconds_per_example


class TrainingInterrupted(EdgespecError):
    """Ctrl+C during training: what was done is kept in the resume file."""

    exit_code = 130


# Heads that saw less of their data than one pass are not kept as trained: collecting can run to the end of the
# budget (a machine slower than its timing promised), and heads trained for no time replaced better ones.
MIN_EPOCHS_KEPT = 1.0


@dataclass(frozen=True)
class Budget:
    seconds: float = 15 * 60.0
    max_tokens: int = 100_000  # training positions kept: 3 KB of hidden state each at Qwen2.5-1.5B's 1536
    heldout_share: float = 0.15  # at most; six replies take far less
    # Collecting stops when training this many passes over the data takes the time left.  On Qwen's replies
    # at a rate of 1e-3, head 1 peaked after 6 passes over 6,349 positions (30.7%) but after 4 over 13,313
    # (34.3%, 33.4% after 6): more data needs fewer, and a 15-minute run collects more than that.
    epochs: float = 4.0
    max_reply: int = 256  # tokens of a training reply: a longer reply costs fewer prompt prefills per token
    heldout_reply: int = 160  # tokens of a held-out reply, as in the figures measured so far
    sequences: int = 16  # prompts answered together, a sequence each


@dataclass
class Sources:
    """Token ids to train on, in the order to use them."""

    texts: list = field(default_factory=list)  # (kind, token ids): the user's files, then their usage
    prompts: list = field(default_factory=list)  # built-in prompts (token ids) the target answers itself
    heldout_prompts: list = field(default_factory=list)
    usage: TeacherData | None = None  # kept while heads drafted (heads.usage): labelled already, used first


Progress = Callable[[str, int, "float | None", float], None]  # phase, tokens, accuracy so far, seconds left


def resume_path_for(heads_path: Path) -> Path:
    return heads_path.with_name(heads_path.name.removesuffix(".npz") + ".resume.npz")


def train_heads(model, lm_head, sources: Sources, plan: TrainingPlan, budget: Budget, heads_path: Path,
                progress: Progress) -> HeadsRecord:
    """Train heads for model (a HiddenStateModel) and save them at heads_path; returns what the file records."""
    resume_path = resume_path_for(heads_path)
    started = time.monotonic()
    trainer = _resumed(resume_path, lm_head, model.n_vocab)
    if trainer is not None and _shape(trainer.plan) != _shape(plan):
        raise EdgespecError(f"the stopped run kept in {resume_path} trains {_shape(trainer.plan)}, not "
                            f"{_shape(plan)}; give its --form, --n-heads and --vocab to go on with it, or add "
                            "--restart to start afresh with these")
    end = started + budget.seconds - (trainer.seconds_spent if trainer else 0.0)
    data = heldout = None
    try:
        if trainer is None:
            heldout, data = TeacherData.empty(model.n_embd), TeacherData.empty(model.n_embd)
            _collect(model, lm_head, sources, plan, budget, started, heldout, data, progress)
            trainer = _new_trainer(plan, data, heldout, lm_head, model.n_vocab)
        _train(trainer, end, progress)
        if trainer.epochs < min(MIN_EPOCHS_KEPT, trainer.plan.max_epochs):
            _save_resume(resume_path, trainer)
            raise EdgespecError(f"the time ran out with {trainer.epochs:.0%} of one pass over the data trained, so "
                                f"no heads were saved; what was done is kept in {resume_path} (run the same command "
                                "again, with more --minutes, to train on from there)")
    except KeyboardInterrupt:
        if trainer is None and data is not None and len(data) and len(heldout):
            trainer = _new_trainer(plan, data, heldout, lm_head, model.n_vocab)
        if trainer is not None:
            _save_resume(resume_path, trainer)
            raise TrainingInterrupted(f"stopped; what was done is kept in {resume_path} "
                                      "(run the same command again to train on from there)") from None
        raise
    return _finish(model, trainer, heads_path, resume_path, progress)


def _shape(plan: TrainingPlan) -> str:
    """What a plan's heads are, as the flags that set it give them."""
    return f"{plan.n_heads} {plan.form} heads over {plan.vocab_size} tokens"


def _collect(model, lm_head, sources: Sources, plan: TrainingPlan, budget: Budget, started: float,
             heldout: TeacherData, data: TeacherData, progress: Progress) -> None:
    """Held-out replies, then training data until what is left of the budget is what training
    budget.epochs passes over it takes (measured here: a GPU collects far faster than numpy trains)."""
    end = started + budget.seconds

    def report(phase: str) -> Callable[[int], None]:
        return lambda tokens: progress(phase, tokens, None, end - time.monotonic())

    heldout_end = started + budget.seconds * budget.heldout_share
    answer_prompts(model, sources.heldout_prompts, heldout, "heldout", budget.heldout_reply, heldout_end,
                   report("held-out replies"), budget.sequences)
    if not len(heldout):
        raise EdgespecError("the time budget ran out before the target answered one held-out prompt "
                            "(give more --minutes)")
    training_time = _TrainingTime(plan, heldout.join(), lm_head, model.n_vocab)
    answering = Answering(model, sources.prompts, data, "built-in prompts", budget.max_reply, budget.sequences)

    def enough() -> bool:
        training = budget.epochs * (len(data) + answering.in_flight) * training_time.per_example(data)
        return end - time.monotonic() <= training

    if sources.usage is not None:
        data.extend(sources.usage, "usage", budget.max_tokens)
    label_texts(model, sources.texts, data, end, budget.max_tokens, report("labelling text"), enough)
    if len(data) < budget.max_tokens:
        answering.run(end, report("answering prompts"), enough)
        answering.keep_unfinished(report("answering prompts"))
    if len(data) < 2:
        raise EdgespecError("no training text was labelled within the time budget (give more --minutes or some text)")


class _TrainingTime:
    """What training costs here per example, for the data collected so far: its cost grows with the reduced
    vocabulary, which is all the distinct tokens the data has (up to the plan's size), so it is timed at two
    sizes and the data's distinct tokens, counted now and then, pick the cost between them."""

    SMALL_VOCAB = 256
    RECOUNT_SECONDS = 15.0

    def __init__(self, plan: TrainingPlan, heldout: TeacherData, lm_head, n_vocab: int):
        self._plan = plan
        self._small = seconds_per_example(replace(plan, vocab_size=self.SMALL_VOCAB), heldout, lm_head, n_vocab)
        self._large = seconds_per_example(plan, heldout, lm_head, n_vocab)
        self._counted_at, self._estimate = -float("inf"), self._large

    def per_example(self, data: TeacherData) -> float:
        if time.monotonic() - self._counted_at > self.RECOUNT_SECONDS:
            distinct = len(np.unique(data.join().top)) if len(data) else 0
            size, small = self._plan.vocab_size, self.SMALL_VOCAB
            share = min(max(distinct - small, 0) / max(size - small, 1), 1.0)
            self._estimate = max(self._small + share * (self._large - self._small), 1e-9)
            self._counted_at = time.monotonic()
        return self._estimate


def _new_trainer(plan: TrainingPlan, data: TeacherData, heldout: TeacherData, lm_head, n_vocab: int) -> Trainer:
    vocab = reduced_vocabulary(data.join().top, plan.vocab_size)
    heads = Heads.fresh(plan.form, plan.n_heads, vocab, lm_head.rows(vocab))
    return Trainer(heads, Adam(plan.rate), data, heldout, lm_head, n_vocab, plan)


def _train(trainer: Trainer, end: float, progress: Progress) -> None:
    last_check, heldout_top1 = 0.0, None

    def report(t: Trainer) -> None:
        nonlocal last_check, heldout_top1
        if time.monotonic() - last_check > 30.0:  # a held-out score of 256 positions: about a second
            heldout_top1 = t.heldout_accuracy(limit=256)[0][0]
            last_check = time.monotonic()
        shown = heldout_top1 if heldout_top1 is not None else t.recent_top1
        left = min(end - time.monotonic(), t.seconds_spent / max(t.epochs, 1e-9) * (t.plan.max_epochs - t.epochs))
        progress("training", t.examples_seen, shown, left)

    trainer.run(end, report)


def _finish(model, trainer: Trainer, heads_path: Path, resume_path: Path, progress: Progress) -> HeadsRecord:
    progress("scoring", trainer.examples_seen, None, 0.0)
    top1, top3, counted = trainer.heldout_accuracy()
    heads = trainer.heads
    record = HeadsRecord(
        model_identity=loaded_model_identity(model), model_name=model.path.name, form=heads.form,
        n_heads=heads.n_heads, training_tokens=len(trainer.data), training_seconds=round(trainer.seconds_spent, 1),
        heldout_tokens=counted, heldout_top1=tuple(round(x, 4) for x in top1),
        heldout_top3=tuple(round(x, 4) for x in top3), sources=dict(trainer.data.sources))
    save_heads(heads_path, heads, record)
    resume_path.unlink(missing_ok=True)
    return record


def _save_resume(path: Path, trainer: Trainer) -> None:
    meta = {"plan": asdict(trainer.plan), "sources": {"data": trainer.data.sources,
                                                     "heldout": trainer.heldout.sources}}
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **trainer.state())
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buffer.getvalue())


def _resumed(path: Path, lm_head, n_vocab: int) -> Trainer | None:
    """The trainer an interrupted run left in path, or None (no file, or one that cannot be read: start afresh)."""
    try:
        arrays = read_arrays(path)
        meta = parse_json(arrays.pop("meta").tobytes().decode())  # ValueError, not RecursionError, if 100k deep
        return Trainer.resumed(arrays, TrainingPlan(**meta["plan"]), lm_head, n_vocab, meta["sources"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a directory in its place: the run starts afresh all the same
        return None
