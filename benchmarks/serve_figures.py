"""The server's figures on a real model, through the official openai client (not a test: it times).

    .venv/bin/python benchmarks/serve_figures.py [--model qwen2.5-coder-1.5b-instruct] [--repeats 3]

For each of `--draft ngram` and `--draft none` it starts `edgespec serve` on 127.0.0.1, sends the
first code-edit prompt at T = 0 and reads the reply's `speculative` usage; then it times the time
to first token of a second turn (the conversation resent, as clients do) against the same request
sent cold, after an unrelated prompt has replaced the KV cache. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 128


def start_server(model: str, draft: str, temperature: float = 0.0,
                 env: dict | None = None) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([str(ROOT / ".venv/bin/edgespec"), "serve", "--port", "0", "--model", model,
                                "--draft", draft, "--temperature", str(temperature)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in process.stderr], daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in list(lines):
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1$", line.strip())
            if found:
                return process, found.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    sys.exit("edgespec serve did not start:\n" + "".join(lines))


def first_token_seconds(client: openai.OpenAI, messages: list[dict]) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - started
            stream.close()
            return elapsed
    return time.perf_counter() - started


def measure(model: str, draft: str, prompt: str, repeats: int) -> dict:
    process, url = start_server(model, draft)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        user = [{"role": "user", "content": prompt}]
        replies = []
        for _ in range(repeats):
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
            reply = client.chat.completions.create(model="any", messages=user, max_tokens=MAX_TOKENS, temperature=0)
            replies.append(reply)
        figures = [r.usage.model_extra["speculative"] for r in replies]
        second_turn = user + [{"role": "assistant", "content": replies[-1].choices[0].message.content},
                              {"role": "user", "content": "Now add a one-line docstring to it."}]
        warm, cold = [], []
        for _ in range(repeats):
            client.chat.completions.create(model="any", messages=user, max_tokens=MAX_TOKENS, temperature=0)
            warm.append(first_token_seconds(client, second_turn))  # the cache holds turn 1 and its reply
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
            cold.append(first_token_seconds(client, second_turn))  # the cache holds an unrelated prompt
        return {
            "draft": draft,
            "decode_tokens_per_second": statistics.median(f["decode_tokens_per_second"] for f in figures),
            "acceptance_rate": statistics.median(f["acceptance_rate"] for f in figures),
            "target_passes_per_token": statistics.median(f["target_passes_per_token"] for f in figures),
            "draft_tokens": figures[-1]["draft_tokens"], "draft_tokens_accepted": figures[-1]["draft_tokens_accepted"],
            "completion_tokens": replies[-1].usage.completion_tokens,
            "second_turn_ttft_seconds": statistics.median(warm), "cold_ttft_seconds": statistics.median(cold),
            "same_text_every_repeat": len({r.choices[0].message.content for r in replies}) == 1,
            "text": replies[-1].choices[0].message.content,
        }
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt = json.loads((ROOT / "benchmarks/workloads/code-edit.jsonl").read_text().splitlines()[0])["prompt"]
    results = [measure(args.model, draft, prompt, args.repeats) for draft in ("ngram", "none")]
    texts = {r.pop("text") for r in results}
    print(json.dumps({"results": results, "same_text_in_both_modes": len(texts) == 1}, indent=2))


if __name__ == "__main__":
    main()
