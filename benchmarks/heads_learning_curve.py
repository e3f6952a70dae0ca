"""How well heads guess the target's next tokens, against training tokens and training minutes, in one run.

What `edgespec heads train` does, in rounds, with a held-out score after
each: the target first answers the held-out prompts (never trained on), then
every round it answers built-in training prompts for --round-minutes (16 at
a time, as heads train does) and trains the same heads on everything
collected so far up to --epochs passes over it (heads train's share of
collecting and training).  Each checkpoint records the minutes spent
(collecting and training; scoring is left out), the training tokens
collected, the examples trained on, and held-out top-1 / top-3 per head.
A checkpoint at minute M approximates `heads train --minutes M` (which
collects first, then trains).

The collected data is saved in --work at the end, for benchmarks/heads_forms.py
to compare forms, vocabularies and learning rates on it offline.

Run on an idle machine (Qwen2.5-Coder-1.5B; about 38 minutes in all):
  .venv/bin/python benchmarks/heads_learning_curve.py --minutes 35 --json benchmarks/results/heads_learning_curve.json
Check the script quickly:
  .venv/bin/python benchmarks/heads_learning_curve.py --model smollm2-135m-instruct --minutes 1 \\
      --round-minutes 0.2 --heldout-reply 32 --max-reply 32 --vocab 512 --work /tmp/heads-curve-check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.backend.hidden import HiddenStateModel
from edgespec.fetch import resolve_model
from edgespec.heads.job import Budget
from edgespec.heads.network import Adam, Heads
from edgespec.heads.projection import LmHead
from edgespec.heads.prompts import HELDOUT_PROMPTS, TRAINING_PROMPTS
from edgespec.heads.teacher import Answering, TeacherData, answer_prompts
from edgespec.heads.training import Trainer, TrainingPlan, reduced_vocabulary
from edgespec.prompts import PromptBuilder


class Clock:
    """Minutes spent collecting and training, scoring left out."""

    def __init__(self):
        self.spent = {"collect": 0.0, "train": 0.0}

    def until(self, phase: str, seconds: float, work) -> None:
        started = time.monotonic()
        work(started + seconds)
        self.spent[phase] += time.monotonic() - started

    @property
    def minutes(self) -> float:
        return sum(self.spent.values()) / 60


def train_round(trainer, data, heldout, lm_head, model, args) -> Trainer:
    """The trainer to carry on with now that data has grown (a new one the first time)."""
    if trainer is not None:
        return trainer.grown(data, lm_head)
    plan = TrainingPlan(form=args.form, n_heads=args.n_heads, vocab_size=args.vocab, rate=args.rate, max_epochs=1e9)
    vocab = reduced_vocabulary(data.join().top, plan.vocab_size)
    heads = Heads.fresh(plan.form, plan.n_heads, vocab, lm_head.rows(vocab))
    return Trainer(heads, Adam(plan.rate), data, heldout, lm_head, model.n_vocab, plan)


def checkpoint(clock: Clock, data: TeacherData, trainer: Trainer) -> dict:
    top1, top3, counted = trainer.heldout_accuracy()
    point = {"minutes": round(clock.minutes, 2), "collect_minutes": round(clock.spent["collect"] / 60, 2),
             "train_minutes": round(clock.spent["train"] / 60, 2), "training_tokens": len(data),
             "examples_seen": trainer.examples_seen, "epochs": round(trainer.epochs, 2),
             "top1": [round(x, 4) for x in top1], "top3": [round(x, 4) for x in top3], "heldout_positions": counted}
    print(f"  {point}", file=sys.stderr, flush=True)
    return point


def save(args, data: TeacherData, heldout: TeacherData) -> Path:
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / f"{Path(args.model_path).stem}-data.npz"
    np.savez(path, **data.arrays("data_"), **heldout.arrays("heldout_"))
    return path


def run(args) -> dict:
    model = HiddenStateModel(args.model_path, n_ctx=1024, n_threads=args.threads)
    lm_head, chat, clock = LmHead(args.model_path), PromptBuilder(model).chat_tokens, Clock()
    heldout, data = TeacherData.empty(model.n_embd), TeacherData.empty(model.n_embd)
    quiet = lambda n: None  # noqa: E731
    clock.until("collect", float("inf"), lambda end: answer_prompts(
        model, [chat([{"role": "user", "content": p}], True) for p in HELDOUT_PROMPTS], heldout, "heldout",
        args.heldout_reply, end, quiet, args.sequences))
    print(f"held-out replies: {len(heldout)} positions in {clock.minutes:.1f} min", file=sys.stderr, flush=True)
    answering = Answering(model, [chat([{"role": "user", "content": p}], True) for p in TRAINING_PROMPTS], data,
                          "built-in prompts", args.max_reply, args.sequences)
    trainer, points, end = None, [], args.minutes * 60

    def train(deadline: float) -> None:  # up to args.epochs passes over the data, or on when nothing is left to collect
        target = args.epochs * len(data) if not answering.finished else float("inf")
        while trainer.examples_seen < target and time.monotonic() < deadline:
            trainer.step()

    while clock.minutes < args.minutes - 1e-9:
        if not answering.finished:
            clock.until("collect", min(args.round_minutes * 60, end - clock.minutes * 60),
                        lambda deadline: answering.run(deadline, quiet))
        if len(data.join()) < 2:
            continue
        trainer = train_round(trainer, data, heldout.join(), lm_head, model, args)
        clock.until("train", min(args.round_minutes * 60, end - clock.minutes * 60), train)
        points.append(checkpoint(clock, data, trainer))
        save(args, data, heldout)  # after every round: a run stopped early still leaves its data
    answering.keep_unfinished(quiet)  # for heads_forms.py: the replies cut short count there too
    model.close()
    print(f"the collected data is in {save(args, data, heldout)}", file=sys.stderr)
    return {"model": args.model_path.name, "form": args.form, "vocab": args.vocab, "rate": args.rate,
            "epochs": args.epochs, "sequences": args.sequences, "heldout_positions": len(heldout),
            "prompts_left": not answering.finished, "points": points}


def main() -> int:
    budget = Budget()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--minutes", type=float, default=35.0, help="collecting and training, in all")
    parser.add_argument("--round-minutes", type=float, default=1.5, help="minutes of collecting per round")
    parser.add_argument("--epochs", type=float, default=budget.epochs,
                        help="passes over the data collected so far that each round trains up to (default: heads train's)")
    parser.add_argument("--form", default=TrainingPlan.form)
    parser.add_argument("--vocab", type=int, default=TrainingPlan.vocab_size)
    parser.add_argument("--rate", type=float, default=TrainingPlan.rate)
    parser.add_argument("--n-heads", type=int, default=TrainingPlan.n_heads)
    parser.add_argument("--sequences", type=int, default=budget.sequences, help="prompts answered together")
    parser.add_argument("--max-reply", type=int, default=budget.max_reply)
    parser.add_argument("--heldout-reply", type=int, default=budget.heldout_reply)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgespec-heads-curve"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.model_path = resolve_model(args.model, pull=False)
    text = json.dumps(run(args), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
