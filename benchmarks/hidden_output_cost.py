"""What loading heads costs a plain decoding step: the target's hidden-state output, on and off, against a plain model.

Heads need the target made as a HiddenStateModel, whose every-row passes
(plain steps and verification passes) also return the final-normed hidden
state (llama.cpp's embeddings output).  This times the same passes, fed the
same tokens at the same depths, on three contexts of the same weights, in
interleaved rounds:

- plain: a LlamaModel, as every target without heads is made;
- hidden-on: a HiddenStateModel's own decode (the output on, the rows copied);
- hidden-off: a HiddenStateModel's context with the output switched off.

Each round feeds `--steps` passes of `--width` tokens (width 1: plain steps;
wider: verification passes, every row's logits read) after the prompt, and
rewinds.  The figure per variant is the median over rounds of the mean
seconds per pass; the ratios are the medians of the per-round ratios.

Run on an idle machine (Qwen2.5-Coder-1.5B; about a minute per width):
  .venv/bin/python benchmarks/hidden_output_cost.py --json benchmarks/results/hidden_output_cost.json
Check the script quickly:
  .venv/bin/python benchmarks/hidden_output_cost.py --model smollm2-135m-instruct --rounds 2 --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from edgespec.backend import LlamaModel
from edgespec.backend.hidden import HiddenStateModel
from edgespec.fetch import resolve_model

PROMPT = ("Explain, in a few paragraphs, how a hash map handles collisions, and when open addressing "
          "beats separate chaining. ")


def greedy_tokens(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """The plain model's own greedy continuation: the tokens every variant is fed."""
    logits = model.decode(prompt, 1)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.decode(out[-1:], 1)
    model.rewind(0)
    return out


def timed_round(decode, rewind, prompt: list[int], fed: list[int], width: int, steps: int) -> float:
    """Mean seconds per pass of `width` tokens, every row's logits asked for, over `steps` passes."""
    decode(prompt, 1)
    spent = 0.0
    for i in range(steps):
        tokens = fed[i * width:(i + 1) * width]
        started = time.perf_counter()
        decode(tokens, width)
        spent += time.perf_counter() - started
    rewind(0)
    return spent / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=48, help="passes per round")
    parser.add_argument("--widths", default="1,4", help="pass widths to time, comma-separated")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    path = resolve_model(args.model)
    options = {"n_ctx": 2048, "n_threads": args.threads}
    plain = LlamaModel(path, **options)
    hidden_on = HiddenStateModel(path, **options)
    hidden_off = HiddenStateModel(path, **options)
    hidden_off.context.output_hidden_states(False)
    variants = {
        "plain": (plain.decode, plain.rewind),
        "hidden-on": (hidden_on.decode, hidden_on.rewind),
        "hidden-off": (hidden_off.context.decode, hidden_off.context.rewind),
    }
    prompt = plain.tokenize(PROMPT * 4, add_special=True)
    widths = [int(w) for w in args.widths.split(",")]
    fed = greedy_tokens(plain, prompt, args.steps * max(widths))

    results = {"model": path.name, "prompt_tokens": len(prompt), "rounds": args.rounds, "steps": args.steps, "widths": {}}
    for width in widths:
        seconds = {name: [] for name in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))  # no variant always goes first
            for name in order:
                decode, rewind = variants[name]
                seconds[name].append(timed_round(decode, rewind, prompt, fed, width, args.steps))
        figures = {name: round(statistics.median(s) * 1000, 3) for name, s in seconds.items()}
        ratios = {name: round(statistics.median(a / b for a, b in zip(s, seconds["plain"])), 4)
                  for name, s in seconds.items() if name != "plain"}
        results["widths"][width] = {"ms_per_pass_median": figures, "over_plain_median": ratios}
        print(f"width {width}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in figures.items())
              + " | over plain: " + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items()), file=sys.stderr)
    for model in (plain, hidden_on, hidden_off):
        model.close()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    else:
        json.dump(results, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
