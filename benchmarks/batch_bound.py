"""The most a batch's requests could gain from being decoded together, on this machine's cost curve.

`edgespec batch` with `--parallel N` runs one pass per step over every active sequence's row.  However
the passes are scheduled, plain decoding of a batch needs, for each request, its prompt's evaluation and
one row in each of as many passes as its reply has tokens.  The cheapest such schedule keeps N requests
decoding (prompts evaluated apart, shared prefixes once): a request that ends hands its place to the next
at once, and once none is left the passes cover fewer and fewer requests as the shorter replies end.
Pricing those passes on the calibrated cost curve of passes over several sequences gives a bound that no
schedule taking the requests in the file's order beats without drafting (with all requests decoding at
once, as in a batch of at most N, the order does not matter):

    sequential = sum of each request's prefill + its tokens x T(1)      (as `--parallel 1` decodes)
    together   = the prompts' evaluation + sum over passes of T(requests decoding in it)

Both sides take their prefill time and T(1) from the sequential run's own records (prefill seconds per
evaluated prompt token, decode seconds per token), and the together side evaluates what the parallel
run's records say it evaluated (prefixes shared between the requests' prompts count once).  So the bound
reads the shape of the machine's curve, not the speed of the moment the runs were timed.

Run (after the batch rounds of `git show 40d86cd:docs/benchmarks.md`, with the records they wrote):
    .venv/bin/python benchmarks/batch_bound.py --sequential none-p1.records.jsonl \
        --together none-pdefault.records.jsonl --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgespec.costs import CostModel  # noqa: E402
from edgespec.limits import MAX_PARALLEL  # noqa: E402


def request_stats(records: Path) -> dict[str, dict]:
    """Each answered request's stats (prompt tokens evaluated, tokens generated, seconds), by custom_id."""
    stats = {}
    for line in records.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        body = (record.get("response") or {}).get("body") or {}
        if "stats" in body:
            stats[record["custom_id"]] = body["stats"]
    return stats


def bound(sequential: dict[str, dict], together: dict[str, dict], cost: CostModel, parallel: int) -> dict:
    """The sequential run's time and the best schedule's, in seconds of the sequential run's speed.

    The best schedule keeps `parallel` requests decoding, in the file's order: a request whose reply ends
    hands its place to the next one at the next pass (continuous batching), and every pass costs what
    the profile says a pass over that many sequences, one row each, costs."""
    ids = [i for i in sequential if i in together]
    if not ids:
        raise SystemExit("the two records files answer no request in common")
    evaluated = sum(sequential[i]["prompt_tokens_evaluated"] for i in ids)
    prefill_per_token = sum(sequential[i]["prefill_seconds"] for i in ids) / evaluated
    lengths = [sequential[i]["tokens_generated"] for i in ids]
    step = sum(sequential[i]["decode_seconds"] for i in ids) / sum(lengths)
    sequential_seconds = evaluated * prefill_per_token + sum(lengths) * step
    passes = decoding_passes(lengths, parallel, cost)
    together_evaluated = sum(together[i]["prompt_tokens_evaluated"] for i in ids)
    together_seconds = together_evaluated * prefill_per_token + passes * step
    return {
        "requests": len(ids), "parallel": parallel, "tokens": sum(lengths),
        "prompt_tokens_evaluated": {"sequential": evaluated, "together": together_evaluated},
        "prefill_seconds_per_token": prefill_per_token, "plain_step_seconds": step,
        "sequential_seconds": sequential_seconds, "together_seconds": together_seconds,
        "passes_in_plain_steps": passes, "bound_x_sequential": sequential_seconds / together_seconds,
        "decode_bound_x_sequential": sum(lengths) / passes,
    }


def decoding_passes(lengths: list[int], parallel: int, cost: CostModel) -> float:
    """The passes that decode replies of these lengths, `parallel` at a time in order, in plain steps."""
    waiting, left, total = list(lengths), [], 0.0
    while waiting or left:
        while waiting and len(left) < parallel:
            left.append(waiting.pop(0))
        total += cost.pass_seconds(len(left), len(left)) / cost.target(1)
        left = [n - 1 for n in left if n > 1]
    return total


def engine_cost(model: str, measure: bool) -> CostModel:
    """The cost profile the engine plans with for model: its cached calibration (measured if there is none),
    or with measure, one measured now (and cached), for the machine as it is at the time of the runs."""
    from edgespec.loading import load_engine

    engine = load_engine(model, "none", notice=lambda *_: None)
    try:
        if measure:
            engine.recalibrate()
        return engine.decoder.planner.cost
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", type=Path, required=True, help="records of the --parallel 1 plain run")
    parser.add_argument("--together", type=Path, required=True, help="records of a run decoding requests together")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose calibrated curve prices the passes")
    parser.add_argument("--parallel", type=int, help=f"requests decoded together (default: all, at most {MAX_PARALLEL})")
    parser.add_argument("--measure", action="store_true",
                        help="measure the curve now instead of using the cached one (run it beside the batch runs)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    cost = engine_cost(args.model, args.measure)
    sequential, together = request_stats(args.sequential), request_stats(args.together)
    figures = bound(sequential, together, cost, args.parallel or min(len(sequential), MAX_PARALLEL))
    figures["curve"] = {"relative": [round(t, 3) for t in cost.relative()],
                        "sequences": [list(s) for s in cost.sequences]}
    print(f"{figures['requests']} requests, {figures['tokens']} tokens, {figures['parallel']} at a time: "
          f"at best {figures['bound_x_sequential']:.2f}x "
          f"sequential plain ({figures['together_seconds']:.1f} s against {figures['sequential_seconds']:.1f} s; "
          f"decoding alone {figures['decode_bound_x_sequential']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
