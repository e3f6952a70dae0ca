"""How far the copy length alone can take n-gram drafting: the best fixed draft length per copy-length class.

The controller chooses each step's draft length from what the drafter's match says (its copy length: how
many tokens before the context's end match those before the source) and what it has learned.  This asks
how much any such choice could win: a table that gives each copy-length class (hindsight.COPY_BUCKETS) one
draft length, fitted by coordinate descent to the replies themselves, so it knows the text's copies the way
no controller can.  Fitted on every reply it shows about how far a policy that reads the copy-length class
alone can go (coordinate descent finds a good table, not provably the best one); fitted on one half of the replies and replayed on the other (--cross-validate), it is what a fixed table
tuned on similar text would read.  Passes are priced as ngram_sim.py prices them; the drafter is the engine's.

Run:
    .venv/bin/python benchmarks/copy_length_table.py benchmarks/workloads-code-edit-12/replies-qwen2.5-coder-1.5b.jsonl \
        --curve benchmarks/results/avx512-output-rows-cost-1-34.json --cross-validate
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ngram_sim import CostModel, Replay, curve_named, decoded, drafter_for  # noqa: E402

from edgespec.hindsight import COPY_BUCKETS  # noqa: E402
from edgespec.drafters import copy_signal_parts  # noqa: E402

DRAFT_LENGTHS = (0, 1, 2, 3, 5, 7, 15, 23, 31, 33)  # those the curve's cheap widths (4, 8, 16, 24, 32) favour


class Steps:
    """What drafting could do at each position of one reply: the copy length there, and how many of the
    drafter's longest proposal the reply keeps.  At T = 0 the context at a position is the prompt and the
    reply before it, whatever was drafted, so this is computed once (as replay_oracle does)."""

    def __init__(self, row: dict, k_max: int, max_tokens: int = 200) -> None:
        self.truth, drafter = decoded(row), drafter_for(row)
        context, self.copy_class, self.offered, self.kept = list(row["prompt_ids"]), [], [], []
        for position in range(len(self.truth)):
            hint = drafter.peek(context)
            length = copy_signal_parts(hint.signal)[1]
            tokens = drafter.propose(context, min(k_max, max(0, max_tokens - position - 1))).tokens
            self.copy_class.append(sum(length >= shortest for shortest in COPY_BUCKETS) - 1)  # -1: no match
            self.offered.append(len(tokens))
            self.kept.append(Replay.verify(tokens, self.truth, position))
            context.append(self.truth[position])

    def replay(self, table: list[int], cost: CostModel) -> Replay:
        result, position, n = Replay(plain=len(self.truth) * cost.target(1)), 0, len(self.truth)
        while position < n:
            copy_class = self.copy_class[position]
            k = min(table[copy_class], self.offered[position]) if copy_class >= 0 else 0
            accepted = min(k, self.kept[position])
            result.drafted += cost.target(k + 1)
            result.proposed, result.accepted = result.proposed + k, result.accepted + accepted
            result.widths[k + 1] = result.widths.get(k + 1, 0) + 1
            position += accepted + 1
        return result


def speedup(steps: list[Steps], table: list[int], cost: CostModel) -> float:
    replays = [s.replay(table, cost) for s in steps]
    return sum(r.plain for r in replays) / sum(r.drafted for r in replays)


def fit(steps: list[Steps], cost: CostModel, k_max: int) -> tuple[list[int], float]:
    """The table with the highest speedup on these replies that coordinate descent finds: from every table of one
    draft length for all classes, class by class until no change pays, keeping the best (one start gets stuck
    where a class pays only together with its neighbours)."""
    lengths = [k for k in DRAFT_LENGTHS if k <= k_max]
    best_table, best = [0] * len(COPY_BUCKETS), 0.0
    for start in lengths:
        table = [start] * len(COPY_BUCKETS)
        score, improved = speedup(steps, table, cost), True
        while improved:
            improved = False
            for copy_class in range(len(COPY_BUCKETS)):
                for k in lengths:
                    trial = table[:copy_class] + [k] + table[copy_class + 1:]
                    trial_score = speedup(steps, trial, cost)
                    if trial_score > score + 1e-9:
                        table, score, improved = trial, trial_score, True
        if score > best:
            best_table, best = table, score
    return best_table, best


def shown(table: list[int]) -> str:
    return " ".join(f"{shortest}+:{k}" for shortest, k in zip(COPY_BUCKETS, table))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path, nargs="+", help="JSONL files from record_replies.py")
    parser.add_argument("--curve", default="bench", help="cost curve, as ngram_sim.py --curve")
    parser.add_argument("--cross-validate", action="store_true",
                        help="fit on the odd-numbered replies and replay the even ones, then the other way round")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.replies for line in path.read_text().splitlines() if line.strip()]
    cost = CostModel(curve_named(args.curve))
    k_max = len(cost.forward_seconds) - 1
    steps = [Steps(row, k_max) for row in rows]
    table, best = fit(steps, cost, k_max)
    print(f"fitted on all {len(steps)} replies: {best:.3f}x  table {shown(table)}")
    if args.cross_validate:
        halves = (steps[0::2], steps[1::2])
        for fitted_on, replayed_on in (halves, halves[::-1]):
            table, best = fit(fitted_on, cost, k_max)
            print(f"fitted on {len(fitted_on)} ({best:.3f}x), replayed on the other {len(replayed_on)}: "
                  f"{speedup(replayed_on, table, cost):.3f}x  table {shown(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
