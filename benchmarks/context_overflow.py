"""What a context overflow costs the next reply: the chat's oldest turn shifted out of the KV cache, or the rest recomputed.

A chat of about --chat-tokens tokens (edgespec's own source, asked about turn
by turn, with short canned replies) fills a --n-ctx context; the next message
no longer fits, so the session drops the oldest turn.  Reported per way of
making room, for that reply: its prefill time, the prompt tokens it evaluated
and reused, and for scale the cold prefill of the whole chat just before.
"shift" is edgespec's default; "recompute" is what it did before (and still
does under --bit-exact): reuse the common prefix and evaluate the rest.

Run (Qwen2.5-Coder-1.5B, a 3,000-token chat at --n-ctx 3072):
  .venv/bin/python benchmarks/context_overflow.py --json benchmarks/results/context_overflow.json
Check the script quickly:
  .venv/bin/python benchmarks/context_overflow.py --model smollm2-135m-instruct --n-ctx 1024 --chat-tokens 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from edgespec import ChatSession, Done, Notice, SamplingParams
from edgespec.loading import load_engine

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FILES = ("edgespec/engine.py", "edgespec/session.py", "edgespec/drafters.py")
REPLY = "It defines the functions above; each one does what its docstring says, and the module's docstring explains why."
TURN_CHARS = 800  # about 200-250 tokens of code per user message


def user_turns() -> list[str]:
    source = "\n\n".join((ROOT / name).read_text(encoding="utf-8") for name in SOURCE_FILES)
    chunks = [source[i : i + TURN_CHARS] for i in range(0, len(source), TURN_CHARS)]
    return [f"What does this part of the code do?\n\n{chunk}" for chunk in chunks]


def fill_chat(session: ChatSession, chat_tokens: int, turns: list[str]) -> list[str]:
    """Give the session canned turns until its prompt holds about chat_tokens (the last turn cut to fit);
    return the turns left."""
    while turns:
        turn, turns = turns[0], turns[1:]
        session.messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": REPLY}]
        if prompt_length(session) > chat_tokens:
            cut_last_turn(session, turn, chat_tokens)
            break
    return turns


def prompt_length(session: ChatSession) -> int:
    return len(session.engine.chat_tokens(session.visible_messages()))


def cut_last_turn(session: ChatSession, turn: str, chat_tokens: int) -> None:
    """Shorten the last user message to the longest prefix that keeps the prompt within chat_tokens."""
    low, high = 0, len(turn)  # a prefix of `low` characters fits, one of `high` does not
    while high - low > 1:
        middle = (low + high) // 2
        session.messages[-2]["content"] = turn[:middle]
        low, high = (middle, high) if prompt_length(session) <= chat_tokens else (low, middle)
    session.messages[-2]["content"] = turn[:low]


def one_run(engine, args, shift: bool) -> dict:
    engine.forget_cache()
    session = ChatSession(engine, system_prompt="You are a concise assistant for programmers.")
    session.shift_dropped_turns = shift
    turns = fill_chat(session, args.chat_tokens, user_turns())
    session.messages.pop()  # the last canned reply: the session replies to that turn itself
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    whole = final(session.stream_reply(params))[0].stats  # a cold prefill of the whole chat fills the cache
    result, notices = final(session.stream(turns[0], params))
    stats = result.stats
    if not notices:
        raise SystemExit("the chat did not overflow: raise --chat-tokens closer to --n-ctx")
    return {"shift": shift, "chat_tokens": whole.prompt_tokens, "whole_chat_prefill_seconds": whole.prefill_seconds,
            "prompt_tokens": stats.prompt_tokens, "reused": stats.prompt_tokens_reused,
            "evaluated": stats.prompt_tokens_evaluated, "prefill_seconds": stats.prefill_seconds, "notice": notices[0]}


def final(events) -> tuple:
    """The result a reply's events end with, and the notices among them."""
    result, notices = None, []
    for event in events:
        if isinstance(event, Notice):
            notices.append(event.text)
        elif isinstance(event, Done):
            result = event.result
    return result, notices


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--n-ctx", type=int, default=3072)
    parser.add_argument("--chat-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=32, help="each reply's length; it is also the room a turn keeps")
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine(args.model, "ngram", n_ctx=args.n_ctx, n_threads=args.threads, kv_type=args.kv_type,
                         notice=lambda text: print(f"  {text}", file=sys.stderr))
    runs = []
    try:
        for repeat in range(args.repeats):
            for shift in (True, False) if repeat % 2 == 0 else (False, True):
                runs.append(one_run(engine, args, shift))
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in runs[-1].items()}, file=sys.stderr)
    finally:
        engine.close()
    print(f"a {runs[0]['chat_tokens']}-token chat at n_ctx {args.n_ctx}; the next message drops the oldest turn")
    print(f"{'making room by':<16}{'prefill s':>11}{'evaluated':>11}{'reused':>9}{'whole chat, cold s':>20}")
    for shift in (True, False):
        mine = [r for r in runs if r["shift"] is shift]
        print(f"{'shift' if shift else 'recompute':<16}{statistics.median(r['prefill_seconds'] for r in mine):>11.2f}"
              f"{mine[0]['evaluated']:>11}{mine[0]['reused']:>9}"
              f"{statistics.median(r['whole_chat_prefill_seconds'] for r in mine):>20.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
