"""Heads' forms, vocabularies and learning rates compared on teacher data collected once: accuracy per example.

Reads the data file that benchmarks/heads_learning_curve.py writes (the
target's hidden states and top tokens on its own replies, and the held-out
replies), trains one set of heads per configuration on the first
--data-tokens positions, and scores held-out top-1/top-3 per head every
--every examples.  Nothing here runs the model or looks at the clock, so it
may run on a busy machine (one thread is plenty: OPENBLAS_NUM_THREADS=1);
what a configuration costs in minutes is measured by the learning curve.

  OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/heads_forms.py \\
      --data /tmp/edgespec-heads-curve/qwen2.5-coder-1.5b-instruct-data.npz \\
      --configs hydra:8192:3e-4,hydra:8192:1e-3,hydra:16384:3e-4,medusa:8192:3e-4 \\
      --data-tokens 20000 --examples 80000 --every 20000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from edgespec.fetch import resolve_model
from edgespec.heads.network import Adam, Heads
from edgespec.heads.projection import LmHead
from edgespec.heads.teacher import TeacherData
from edgespec.heads.training import Trainer, TrainingPlan, reduced_vocabulary


def load(path: Path) -> tuple[TeacherData, TeacherData]:
    with np.load(path) as archive:
        arrays = dict(archive)
    return TeacherData.from_arrays(arrays, "data_", {}), TeacherData.from_arrays(arrays, "heldout_", {})


def subset(data: TeacherData, n_tokens: int) -> TeacherData:
    """The texts of data that fit in its first n_tokens positions."""
    n_texts = max(int(np.searchsorted(data.ends, n_tokens, side="right")), 1)
    end = int(data.ends[n_texts - 1])
    return TeacherData(data.tokens[:end], data.hidden[:end], data.top[:end], data.ends[:n_texts])


def curve(data, heldout, lm_head, n_vocab, config: str, args) -> list[dict]:
    form, vocab_size, rate, *options = config.split(":")
    decay, fill = "decay" in options, "fill" in options
    plan = TrainingPlan(form=form, n_heads=args.n_heads, vocab_size=int(vocab_size), rate=float(rate),
                        batch=args.batch, max_epochs=1e9)
    vocab = reduced_vocabulary(data.top, plan.vocab_size, fill)
    heads = Heads.fresh(form, plan.n_heads, vocab, lm_head.rows(vocab))
    trainer = Trainer(heads, Adam(plan.rate), data, heldout, lm_head, n_vocab, plan)
    points = []
    for checkpoint in range(args.every, args.examples + 1, args.every):
        while trainer.examples_seen < checkpoint:
            if decay:  # linearly down to a tenth over the examples
                trainer.adam.rate = plan.rate * max(0.1, 1 - trainer.examples_seen / args.examples)
            trainer.step()
        top1, top3, counted = trainer.heldout_accuracy()
        points.append({"examples_seen": trainer.examples_seen, "epochs": round(trainer.epochs, 2),
                       "top1": [round(x, 4) for x in top1], "top3": [round(x, 4) for x in top3]})
        print(f"  {config} data={len(data)}: {points[-1]}", file=sys.stderr, flush=True)
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data file of heads_learning_curve.py")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the model the data is of")
    parser.add_argument("--configs", default="hydra:8192:3e-4,medusa:8192:3e-4", help="form:vocabulary:rate[:decay][:fill],...")
    parser.add_argument("--data-tokens", default="", help="comma-separated training data sizes (default: all)")
    parser.add_argument("--examples", type=int, default=80_000, help="examples (head-1 positions) to train on")
    parser.add_argument("--every", type=int, default=20_000, help="examples between held-out scores")
    parser.add_argument("--n-heads", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    data, heldout = load(args.data)
    lm_head = LmHead(resolve_model(args.model, pull=False))
    results = {"data": str(args.data), "training_positions": len(data), "heldout_positions": len(heldout),
               "coverage": {}, "curves": []}
    for vocab_size in sorted({int(c.split(":")[1]) for c in args.configs.split(",")}):
        covered = float(np.isin(heldout.top, reduced_vocabulary(data.top, vocab_size)).mean())
        results["coverage"][vocab_size] = round(covered, 4)
        print(f"vocabulary {vocab_size}: covers {covered:.1%} of the target's held-out predictions", file=sys.stderr)
    for n_tokens in [int(n) for n in args.data_tokens.split(",") if n] or [len(data)]:
        part = subset(data, n_tokens)
        for config in args.configs.split(","):
            results["curves"].append({"config": config, "data_tokens": len(part),
                                      "points": curve(part, heldout, lm_head, lm_head.n_vocab, config, args)})
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
