"""What the chat app costs decoding: the same T = 0 reply through the app and through the bare engine.

    .venv/bin/python benchmarks/chat_vs_run.py [--repeats 3] [--draft ngram] [--max-tokens 128]

One process, one loaded engine. Each repeat streams the code-edit prompt as a new chat through the
app (under Textual's pilot, 140x45: the markdown rendering, the draft marks and the stats bar all
run) and then through `engine.generate`, which is what `edgespec run` does, on a worker thread
while the app sits idle. Prints both decode rates per repeat and the ratio of the medians. A
benchmark, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def measure(args) -> dict:
    from edgespec import SamplingParams
    from tui.app import ChatApp
    from tui.history import ChatStore
    from tui.settings import ChatConfig

    prompt = json.loads((ROOT / "benchmarks/workloads/code-edit.jsonl").read_text().splitlines()[0])["prompt"]
    config = ChatConfig(model=args.model, draft=args.draft, temperature=0.0, max_tokens=args.max_tokens)
    app = ChatApp(config, ChatStore())
    chat_rates, run_rates, same_text = [], [], True
    async with app.run_test(size=(140, 45)) as pilot:
        await until(lambda: app.chat.session is not None, 600)
        engine = app.chat.engine
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for _ in range(args.repeats):
            app.action_new_chat()
            await pilot.pause()
            app.prompt_input.text = prompt
            await pilot.press("enter")
            await until(lambda: app.generation is None and app.chat.session.turn_stats, 600)
            chat_stats = app.chat.session.turn_stats[-1]
            chat_rates.append(chat_stats["decode_tokens_per_second"])
            result = await asyncio.to_thread(
                lambda: engine.generate(prompt, params))  # as `edgespec run PROMPT` does
            run_rates.append(result.stats.decode_tokens_per_second)
            same_text &= result.text == app.chat.last_reply_text()
    chat, run = statistics.median(chat_rates), statistics.median(run_rates)
    return {"chat_tok_s": [round(r, 2) for r in chat_rates], "run_tok_s": [round(r, 2) for r in run_rates],
            "chat_median": round(chat, 2), "run_median": round(run, 2), "chat_over_run": round(chat / run, 3),
            "same_text": same_text, "draft": args.draft, "max_tokens": args.max_tokens}


async def until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the chat app")
        await asyncio.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:  # the chats it saves are not the user's
        os.environ["EDGESPEC_DATA_DIR"] = os.path.join(home, "data")
        os.environ["EDGESPEC_CONFIG_DIR"] = os.path.join(home, "config")
        print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
