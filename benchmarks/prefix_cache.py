"""The prompt cache's two wins: reopening a long chat, and many requests sharing one long document.

chat:  a chat of --chat-tokens tokens gets a reply (which saves its snapshot), then is reopened in a
       fresh engine and sent a new message: time to first token without the prompt cache and with it.
batch: --requests prompts sharing a --doc-tokens document, as that many `edgespec run` processes and
       as one `edgespec batch`, with --no-prompt-cache and with the cache (the batch twice: a cold
       cache, then a warm one, as a second batch over the same document would find it).

Everything runs in a private EDGESPEC_CACHE_DIR (the speed calibration is done once, up front).
Run:  .venv/bin/python benchmarks/prefix_cache.py [--model M] [--draft D] [--json FILE]
Check it quickly: --model smollm2-135m-instruct --chat-tokens 400 --doc-tokens 300 --requests 3 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EDGESPEC = [sys.executable, "-m", "edgespec"]
PARAGRAPH = ("def handle_{n}(request, store):\n    \"\"\"Validate request {n}, load its record and apply the change.\"\"\"\n"
             "    record = store.get(request.key_{n})\n    if record is None:\n        raise KeyError(request.key_{n})\n"
             "    record.update(request.fields)  # step {n}: keep the audit trail in order\n    return record\n\n")
QUESTIONS = ["What does handle_{n} return?", "Which exception can handle_{n} raise, and when?",
             "Summarise what handle_{n} changes.", "Add type hints to handle_{n}.", "Write a test for handle_{n}."]


def text_of_tokens(tokenize, n_tokens: int, start: int = 0) -> str:
    """Synthetic code, just over n_tokens tokens long."""
    text, n = "", start
    while len(tokenize(text)) < n_tokens:
        text += "".join(PARAGRAPH.format(n=i) for i in range(n, n + 5))
        n += 5
    return text


def ttft(session, message: str, params) -> tuple[float, dict, list[int]]:
    from edgespec import Done, Step

    started, first = time.perf_counter(), None
    for event in session.stream(message, params):
        if isinstance(event, Step) and first is None and event.tokens:
            first = time.perf_counter() - started
        if isinstance(event, Done):
            return first if first is not None else time.perf_counter() - started, event.result.stats.as_dict(), \
                event.result.token_ids
    raise RuntimeError("the reply did not finish")


def chat_benchmark(args, cache: Path) -> dict:
    from edgespec import ChatSession, SamplingParams
    from edgespec.loading import load_engine
    from edgespec.prefix_files import DiskPrefixCache  # kept as the chat app keeps it: every chat, from its first reply

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = load_engine(args.model, args.draft, n_ctx=args.n_ctx)
    engine.prefix_caches.append(DiskPrefixCache(cache / "chat-prefix-cache", keep_every_prompt=True))
    session = ChatSession(engine, system_prompt="You are a careful senior software engineer.")
    history = text_of_tokens(lambda text: engine.chat_tokens([{"role": "user", "content": text}]), args.chat_tokens)
    first_ttft, first_stats, _ = ttft(session, history + "\n\nReview this module.", params)  # saves the snapshot
    saved = json.loads(json.dumps(session.to_dict()))
    engine.close()
    rows = {"first_reply": {"ttft_seconds": first_ttft, **_prompt_figures(first_stats)}}
    for name, cached in (("reopened_without_cache", False), ("reopened_with_cache", True)):
        engine = load_engine(args.model, args.draft, n_ctx=args.n_ctx)
        if cached:
            engine.prefix_caches.append(DiskPrefixCache(cache / "chat-prefix-cache", keep_every_prompt=True))
        seconds, stats, ids = ttft(ChatSession.from_dict(engine, saved), "Now add logging to handle_0.", params)
        rows[name] = {"ttft_seconds": seconds, **_prompt_figures(stats), "token_ids": ids}
        engine.close()
    rows["same_reply"] = rows["reopened_without_cache"].pop("token_ids") == rows["reopened_with_cache"].pop("token_ids")
    return rows


def _prompt_figures(stats: dict) -> dict:
    return {k: stats[k] for k in ("prompt_tokens", "prompt_tokens_reused", "prompt_tokens_evaluated", "prefill_seconds")}


def batch_benchmark(args, cache: Path) -> dict:
    from edgespec.backend import LlamaModel
    from edgespec.fetch import resolve_model

    tokenizer = LlamaModel(resolve_model(args.model, pull=False), n_ctx=256, n_threads=1)
    document = text_of_tokens(lambda text: tokenizer.tokenize(text, add_special=False), args.doc_tokens, start=100)
    tokenizer.close()
    prompts = [f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)].format(n=100 + i)}" for i in range(args.requests)]
    flags = ["--model", args.model, "--draft", args.draft, "--n-ctx", str(args.n_ctx), "--temperature", "0",
             "--max-tokens", str(args.max_tokens)]
    rows = {}
    for name, extra in (("run_processes_without_cache", ["--no-prompt-cache"]), ("run_processes_with_cache", [])):
        shutil.rmtree(cache / "prefix-cache", ignore_errors=True)
        started = time.perf_counter()
        for prompt in prompts:
            _edgespec(["run", "-", *flags, *extra], prompt)
        rows[name] = {"wall_seconds": time.perf_counter() - started}
    batch_in = cache / "batch.jsonl"
    batch_in.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                            "body": {"messages": [{"role": "user", "content": p}]}}) + "\n"
                                for i, p in enumerate(prompts)))
    shutil.rmtree(cache / "prefix-cache", ignore_errors=True)
    for name, extra in (("batch_without_cache", ["--no-prompt-cache"]), ("batch_with_cold_cache", []),
                        ("batch_with_warm_cache", [])):
        out = cache / f"{name}.jsonl"
        started = time.perf_counter()
        parallel = ["--parallel", str(args.batch_parallel)] if args.batch_parallel else []
        _edgespec(["batch", str(batch_in), "-o", str(out), *flags, *parallel, *extra])
        rows[name] = {"wall_seconds": time.perf_counter() - started}
    return rows


def _edgespec(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run([*EDGESPEC, *argv], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"edgespec {argv[0]} failed: {done.stderr.strip()[-500:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--chat-tokens", type=int, default=3000)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-parallel", type=int, default=None,
                        help="batch --parallel N (default: the batch's own choice from the cost curve)")
    parser.add_argument("--only", choices=("chat", "batch"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="edgespec-prefix-bench-"))
    os.environ["EDGESPEC_CACHE_DIR"] = str(cache)
    try:
        _edgespec(["run", "hi", "--model", args.model, "--draft", args.draft, "--max-tokens", "1"])  # calibrate once
        figures = {"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens}
        if args.only != "batch":
            figures["chat"] = {"chat_tokens": args.chat_tokens, **chat_benchmark(args, cache)}
            print(json.dumps(figures["chat"], indent=1), flush=True)
        if args.only != "chat":
            figures["batch"] = {"doc_tokens": args.doc_tokens, "requests": args.requests, **batch_benchmark(args, cache)}
            print(json.dumps(figures["batch"], indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
