"""The cross-request n-gram pool on a batch of similar requests: with it, and with in-context lookup only.

Each run decodes the whole batch in order on one engine, from a fresh pool (or none) and cold priors,
so a request can draft from the earlier requests' prompts and outputs only with the pool.  Runs
alternate between the two settings; each request's figures are kept, and the medians compared.  At
T = 0 the two settings write the same replies but where a wider pass tips a near-tie of the target's two
best tokens (the engine is not bit-exact, as by default): the summary counts the requests whose replies
differ between runs (`requests_with_other_replies`), as their pairs compare other texts.

Run on an idle machine (about 10 minutes for Qwen2.5-Coder-1.5B on 2 cores):
    .venv/bin/python benchmarks/pool_batch.py --repeats 5 --json benchmarks/results/pool-batch.json
Smoke test (tiny): .venv/bin/python benchmarks/pool_batch.py --model smollm2-135m-instruct --requests 2 --repeats 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from edgespec.commands.batch.runner import chat_session
from edgespec.commands.batch.requests import BatchRequest, for_the_engine, read_requests
from edgespec.engine import result_of
from edgespec.loading import load_engine
from edgespec.ngram_pool import NgramPool
from edgespec.sampling import SamplingParams

BATCH = Path(__file__).parent / "workloads-similar" / "similar-requests.jsonl"


def run_once(engine, requests: list[BatchRequest], with_pool: bool, max_tokens: int) -> list[dict]:
    """Every request once, in order, drafting from a fresh pool of this run's texts or from the context alone."""
    pool = NgramPool() if with_pool else None
    engine.decoder.pool = pool
    rows = []
    for request in requests:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        ids = chat_session(engine, request.messages).reply_prompt(params)
        engine.forget_cache()
        engine.forget_learning()
        result = result_of(engine.stream_tokens(ids, params))
        stats = result.stats
        rows.append({"id": request.custom_id, "pool": with_pool, "token_ids": result.token_ids,
                     "tokens": stats.tokens_generated, "tok_s": stats.decode_tokens_per_second,
                     "acceptance": stats.acceptance_rate, "drafted": stats.draft_tokens_proposed,
                     "accepted": stats.draft_tokens_accepted, "passes_per_token": stats.target_passes_per_token})
        print(f"{'pool' if with_pool else 'context'} {request.custom_id}: {stats.decode_tokens_per_second:.1f} tok/s, "
              f"accepted {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed}", file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> dict:
    by_setting = {}
    for with_pool in (False, True):
        mine = [row for row in rows if row["pool"] is with_pool]
        drafted = sum(row["drafted"] for row in mine)
        by_setting["pool" if with_pool else "context only"] = {
            "median_tok_s": statistics.median(row["tok_s"] for row in mine),
            "acceptance": sum(row["accepted"] for row in mine) / drafted if drafted else 0.0,
            "accepted_tokens": sum(row["accepted"] for row in mine),
            "passes_per_token": statistics.median(row["passes_per_token"] for row in mine),
        }
    outputs = {}
    for row in rows:
        outputs.setdefault(row["id"], set()).add(tuple(row["token_ids"]))
    by_setting["identical_outputs"] = all(len(variants) == 1 for variants in outputs.values())
    by_setting["requests_with_other_replies"] = sum(len(variants) > 1 for variants in outputs.values())
    return by_setting


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--batch", type=Path, default=BATCH, help="batch JSONL of similar chat requests")
    parser.add_argument("--requests", type=int, default=None, help="use the first N requests")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    requests = [r for r in map(for_the_engine, read_requests(args.batch)) if isinstance(r, BatchRequest)][: args.requests]
    engine = load_engine(args.model, "ngram", n_threads=args.threads, pull=False)  # cold: no learned priors
    rows = []
    try:
        for repeat in range(args.repeats):
            for with_pool in ((False, True) if repeat % 2 == 0 else (True, False)):
                rows += [dict(row, repeat=repeat) for row in run_once(engine, requests, with_pool, args.max_tokens)]
    finally:
        engine.close()
    result = summary(rows)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": result, "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
