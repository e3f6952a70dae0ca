"""Turn 2 of a two-turn chat at T=0: time to first token and decode tok/s, n-grams against plain decoding.

    .venv/bin/python benchmarks/two_turn_chat.py                      # Qwen2.5-Coder-1.5B, 3 interleaved repeats
    .venv/bin/python benchmarks/two_turn_chat.py --model smollm2-135m-instruct --repeats 1

Turn 2 reuses turn 1's KV cache, so its time to first token is the new message's prefill only.
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgespec import ChatSession, Done, SamplingParams, Step
from edgespec.loading import load_engine

TURN_1 = ("Write a Python function `parse_log_line(line)` that parses an nginx access log line "
          "into a dict with ip, time, method, path, status and size, using a regular expression. "
          "Only the code, no explanation.")
TURN_2 = "Change it so that status and size are returned as integers. Show the whole function again."


def second_turn(engine, mode: str) -> dict:
    """One two-turn chat in `mode` from an empty cache: turn 2's figures."""
    engine.configure(mode=mode)
    engine.forget_cache()
    session = ChatSession(engine)
    first = session.send(TURN_1, SamplingParams(temperature=0.0, max_tokens=150))
    start, ttft, result = time.perf_counter(), None, None
    for event in session.stream(TURN_2, SamplingParams(temperature=0.0, max_tokens=250)):
        if isinstance(event, Step) and ttft is None and event.tokens:
            ttft = time.perf_counter() - start
        if isinstance(event, Done):
            result = event.result
    stats = result.stats
    return {"mode": mode, "turn1_tokens": first.stats.tokens_generated, "ttft": ttft,
            "tok_s": stats.decode_tokens_per_second, "acceptance": stats.acceptance_rate,
            "passes_per_token": stats.target_passes_per_token, "reused": stats.prompt_tokens_reused,
            "evaluated": stats.prompt_tokens_evaluated, "tokens": stats.tokens_generated, "ids": result.token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = load_engine(args.model, "ngram", n_ctx=4096)
    rows = []
    for repeat in range(args.repeats):
        for mode in ("none", "ngram") if repeat % 2 == 0 else ("ngram", "none"):
            rows.append(second_turn(engine, mode))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "ids"},
                  flush=True)
    engine.close()
    for mode in ("none", "ngram"):
        mine = [row for row in rows if row["mode"] == mode]
        print(mode, "median TTFT", round(statistics.median(row["ttft"] for row in mine), 3),
              "median tok/s", round(statistics.median(row["tok_s"] for row in mine), 2))
    print("turn-2 ids identical across modes:", len({tuple(row["ids"]) for row in rows}) == 1)


if __name__ == "__main__":
    main()
