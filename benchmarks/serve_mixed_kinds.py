"""Never slower in a long-lived server: many kinds of request in turn, each against plain decoding.

    .venv/bin/python benchmarks/serve_mixed_kinds.py [--model qwen2.5-coder-1.5b-instruct] [--rounds 3]
        [--workloads benchmarks/workloads-heldout] [--temperature 0] [--cold] [--json FILE]

`edgespec bench` starts every run's drafters cold.  A server does not: its controllers carry what they
learned from one request into the next (a code edit's long copies into an explanation that has none),
and it starts from the learned priors of this model's earlier runs.  This starts two servers at once,
`--draft ngram` and `--draft none`, and sends each the same requests in one order that cycles through
the kinds (the first prompt of every kind, then the second, ...), `--rounds` times, the two servers
taking turns first.  Each request's decode rate is the server's own (usage.speculative), so prefill
and HTTP do not enter it; the paired figure is the median of each request's ratio to its plain twin.

--cold gives both servers a fresh cache dir with only this machine's calibration in it, so they start
from the built-in priors; without it they read this machine's learned priors (the output says which).
At T = 0 it also checks that both servers wrote the same text.

A benchmark, not a test: run it on an idle machine (ggml's threads spin; the two servers never decode at
once, and a short pause between requests lets the idle one's threads go to sleep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgespec.calibration import cache_dir  # noqa: E402
from serve_figures import start_server  # noqa: E402  (this script's folder is on sys.path)

KINDS = ("explain", "extract", "code-edit", "refactor", "summary-quote", "chat", "story")
PAUSE_SECONDS = 0.5


def requests_in_turn(workloads: Path, kinds: list[str]) -> list[dict]:
    """Every kind's first prompt, then every kind's second, ...: each request follows one of another kind."""
    by_kind = {kind: [json.loads(line) for line in (workloads / f"{kind}.jsonl").read_text().splitlines() if line]
               for kind in kinds}
    longest = max(len(prompts) for prompts in by_kind.values())
    return [{"kind": kind, **by_kind[kind][i]} for i in range(longest) for kind in kinds if i < len(by_kind[kind])]


def ask(client: openai.OpenAI, request: dict, temperature: float, seed: int) -> dict:
    reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": request["prompt"]}],
                                           max_tokens=request.get("max_tokens", 200), temperature=temperature,
                                           seed=seed)
    figures = reply.usage.model_extra["speculative"]
    return {"text": reply.choices[0].message.content, "completion_tokens": reply.usage.completion_tokens,
            "decode_tokens_per_second": figures["decode_tokens_per_second"],
            "draft_tokens": figures["draft_tokens"], "draft_tokens_accepted": figures["draft_tokens_accepted"],
            "target_passes_per_token": figures["target_passes_per_token"]}


def summary(pairs: list[dict], kinds: list[str]) -> dict:
    by_kind = {}
    for kind in kinds + ["all"]:
        chosen = [p for p in pairs if kind in ("all", p["kind"])]
        ratios = [p["ngram"]["decode_tokens_per_second"] / p["none"]["decode_tokens_per_second"] for p in chosen]
        drafted = sum(p["ngram"]["draft_tokens"] for p in chosen)
        kept = sum(p["ngram"]["draft_tokens_accepted"] for p in chosen)
        by_kind[kind] = {"pairs": len(ratios), "paired": round(statistics.median(ratios), 3),
                         "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                         "drafted": drafted, "accepted": kept}
    return by_kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--workloads", type=Path, default=ROOT / "benchmarks/workloads-heldout")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated workload files (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1234, help="round r sends seed + r")
    parser.add_argument("--cold", action="store_true", help="start both servers from the built-in priors")
    parser.add_argument("--json", type=Path, help="also write the figures and every request's here")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    requests = requests_in_turn(args.workloads, kinds)
    env = dict(os.environ)
    scratch = tempfile.TemporaryDirectory() if args.cold else None
    if scratch:
        calibration = cache_dir() / "calibration.json"
        if calibration.is_file():
            shutil.copy(calibration, Path(scratch.name) / "calibration.json")
        env["EDGESPEC_CACHE_DIR"] = scratch.name
    servers = {draft: start_server(args.model, draft, args.temperature, env) for draft in ("ngram", "none")}
    clients = {draft: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
               for draft, (_, url) in servers.items()}
    pairs = []
    try:
        for round_no in range(args.rounds):
            order = ("ngram", "none") if round_no % 2 == 0 else ("none", "ngram")
            for request in requests:
                pair = {"round": round_no, "kind": request["kind"], "id": request.get("id")}
                for draft in order:
                    time.sleep(PAUSE_SECONDS)
                    pair[draft] = ask(clients[draft], request, args.temperature, args.seed + round_no)
                ratio = pair["ngram"]["decode_tokens_per_second"] / pair["none"]["decode_tokens_per_second"]
                print(f"round {round_no + 1} {pair['id']}: {ratio:.3f} x plain, "
                      f"{pair['ngram']['draft_tokens_accepted']}/{pair['ngram']['draft_tokens']} kept",
                      file=sys.stderr, flush=True)
                pairs.append(pair)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
        if scratch:
            scratch.cleanup()
    result = {"model": args.model, "priors": "built-in (cold)" if args.cold else "this machine's learned priors",
              "temperature": args.temperature, "rounds": args.rounds, "order": [r["id"] for r in requests],
              "kinds": summary(pairs, kinds)}
    if args.temperature == 0:
        result["same_text"] = sum(p["ngram"]["text"] == p["none"]["text"] for p in pairs)
        result["requests"] = len(pairs)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**result, "pairs": pairs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
