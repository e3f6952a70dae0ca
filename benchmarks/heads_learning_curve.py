"""How well heads guess the target's next tokens, against training tokens and training minutes.

Collects teacher data once (the built-in training prompts answered by the
target, plus any text files given; the held-out set is the target's greedy
replies to the built-in held-out prompts, never trained on), then trains one
set of heads per (form, vocabulary size, data size) and scores head
accuracy per position, top-1 and top-3, on the held-out replies every
--every minutes of training.  Also prints how much of the target's own
predictions each reduced vocabulary covers (the ceiling of top-1).

The collected data is kept in --work, so a second run with other forms or
sizes skips the collection.

Run on an idle machine (Qwen2.5-Coder-1.5B, about 40 minutes of collection and
30 of training per configuration):
  .venv/bin/python benchmarks/heads_learning_curve.py --collect-minutes 40 --train-minutes 30 \
      --forms hydra,medusa --vocabs 8192,16384 --json benchmarks/results/heads_learning_curve.json
Check the script quickly:
  .venv/bin/python benchmarks/heads_learning_curve.py --model smollm2-135m-instruct --collect-minutes 0.5 \
      --train-minutes 0.2 --every 0.1 --vocabs 512 --work /tmp/heads-curve
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
from edgespec.heads.network import Adam, Heads
from edgespec.heads.projection import LmHead
from edgespec.heads.prompts import HELDOUT_PROMPTS, TRAINING_PROMPTS
from edgespec.heads.teacher import ChatTokens, TeacherData, answer_prompts, label_texts
from edgespec.heads.training import Trainer, TrainingPlan, reduced_vocabulary


def collect(model, args) -> tuple[TeacherData, TeacherData]:
    """Held-out replies first (a quarter of the time), then text files and the training prompts' replies."""
    path = args.work / f"{Path(args.model_path).stem}-data.npz"
    if path.exists():
        with np.load(path) as archive:
            arrays = dict(archive)
        print(f"reusing the data collected in {path}", file=sys.stderr)
        return TeacherData.from_arrays(arrays, "data_", {}), TeacherData.from_arrays(arrays, "heldout_", {})
    start, seconds = time.monotonic(), args.collect_minutes * 60
    heldout, data = TeacherData.empty(model.n_embd), TeacherData.empty(model.n_embd)
    chat = ChatTokens(model)
    prompts = {name: [chat([{"role": "user", "content": p}], True) for p in texts]
               for name, texts in (("heldout", HELDOUT_PROMPTS), ("training", TRAINING_PROMPTS))}
    shown = lambda phase: (lambda n: print(f"  {phase}: {n} tokens", file=sys.stderr))  # noqa: E731
    answer_prompts(model, prompts["heldout"], heldout, "heldout", args.max_reply,
                   start + seconds / 4, shown("held-out"))
    texts = [("files", model.tokenize(p.read_text(encoding="utf-8", errors="replace"), add_special=True))
             for p in args.text]
    label_texts(model, texts, data, start + seconds, args.max_tokens, shown("text"))
    answer_prompts(model, prompts["training"], data, "built-in", args.max_reply,
                   start + seconds, shown("replies"))
    args.work.mkdir(parents=True, exist_ok=True)
    np.savez(path, **data.arrays("data_"), **heldout.arrays("heldout_"))
    return data.join(), heldout.join()


def subset(data: TeacherData, n_tokens: int) -> TeacherData:
    """The texts of data that fit in its first n_tokens positions."""
    n_texts = max(int(np.searchsorted(data.ends, n_tokens, side="right")), 1)
    end = int(data.ends[n_texts - 1])
    return TeacherData(data.tokens[:end], data.hidden[:end], data.top[:end], data.ends[:n_texts])


def curve(data, heldout, lm_head, n_vocab, form, vocab_size, args) -> list[dict]:
    plan = TrainingPlan(form=form, n_heads=args.n_heads, vocab_size=vocab_size, max_epochs=1e9)
    vocab = reduced_vocabulary(data.top, vocab_size)
    trainer = Trainer(Heads.fresh(form, args.n_heads, vocab, lm_head.rows(vocab)), Adam(plan.rate), data, heldout,
                      lm_head, n_vocab, plan)
    points = []
    for checkpoint in np.arange(args.every, args.train_minutes + 1e-9, args.every):
        trainer.run(time.monotonic() + checkpoint * 60 - trainer.seconds_spent, lambda t: None)
        top1, top3, counted = trainer.heldout_accuracy()
        points.append({"minutes": round(trainer.seconds_spent / 60, 2), "examples_seen": trainer.examples_seen,
                       "epochs": round(trainer.epochs, 2), "top1": [round(x, 4) for x in top1],
                       "top3": [round(x, 4) for x in top3], "heldout_positions": counted})
        print(f"  {form} V={vocab_size} data={len(data)}: {points[-1]}", file=sys.stderr)
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--text", type=Path, action="append", default=[], help="a text file to train on too")
    parser.add_argument("--collect-minutes", type=float, default=40.0)
    parser.add_argument("--train-minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=5.0, help="minutes of training between scores")
    parser.add_argument("--forms", default="hydra,medusa")
    parser.add_argument("--vocabs", default="8192")
    parser.add_argument("--data-tokens", default="", help="comma-separated training data sizes (default: all collected)")
    parser.add_argument("--n-heads", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200_000)
    parser.add_argument("--max-reply", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgespec-heads-curve"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.model_path = resolve_model(args.model, pull=False)
    model = HiddenStateModel(args.model_path, n_ctx=2048, n_threads=args.threads)
    data, heldout = collect(model, args)
    lm_head = LmHead(args.model_path)
    results = {"model": args.model_path.name, "training_positions": len(data), "heldout_positions": len(heldout),
               "coverage": {}, "curves": []}
    for vocab_size in (int(v) for v in args.vocabs.split(",")):
        covered = np.isin(data.top, reduced_vocabulary(data.top, vocab_size)).mean()
        results["coverage"][vocab_size] = round(float(covered), 4)
        print(f"vocabulary {vocab_size}: covers {covered:.1%} of the target's predictions", file=sys.stderr)
    sizes = [int(n) for n in args.data_tokens.split(",") if n] or [len(data)]
    for n_tokens in sizes:
        for form in args.forms.split(","):
            for vocab_size in (int(v) for v in args.vocabs.split(",")):
                part = subset(data, n_tokens)
                results["curves"].append({"form": form, "vocab": vocab_size, "data_tokens": len(part),
                                          "points": curve(part, heldout, lm_head, model.n_vocab, form, vocab_size, args)})
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
