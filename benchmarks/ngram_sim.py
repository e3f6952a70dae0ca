"""Predict n-gram drafting's speed against plain decoding without timing anything.

At T = 0 a drafted step's outcome is fixed by the reply plain decoding gives: the draft is kept up to
its first token that differs from the reply, and the target adds the next one.  At T > 0 the same rule
on a sampled reply (record_replies.py --temperature) is exact in distribution: an n-gram draft is a point
proposal, which rejection sampling keeps with the target's probability of it, the chance that the
sampled reply has that token there, and on a rejection the target samples from what is left.  So a
recorded reply (benchmarks/record_replies.py) can be replayed through the real NgramDrafter and draft-length
controller, step by step as the engine drives them, with each pass priced by a fixed cost curve; the
predicted speedup is plain decoding's time (one T(1) per token) over the replay's.

Run:
    .venv/bin/python benchmarks/ngram_sim.py benchmarks/workloads-heldout/replies-*.jsonl
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --split tune    # prompts 1-2 of each kind
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --split check   # prompts 3-4
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --learned       # each prompt starts from the
                                                                     # learned prior of all others
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --learned in-turn --shuffle 1
                                         # each prompt starts from the store the prompts before it left, in a
                                         # shuffled order (without --shuffle: the files' order, kind after kind)
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --policy llamacpp-simple   # llama.cpp's ngram-simple
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --curve issue   # the issue's 16-width curve
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --curve benchmarks/results/avx512-output-rows-cost-1-34.json
                                         # every width 1-34 as timed (the calibration times 11 of them)
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --curve TRUE --plan-curve CACHED
                                         # plans made on one curve, passes paid at another
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --curve TRUE --plan-curve CACHED --learned-prices
                                         # ... on the cached curve at the prices the other prompts paid
    .venv/bin/python benchmarks/ngram_sim.py REPLIES --seconds-noise 0.11 --noise-rho 0.7 --noise-seeds 5
                                         # the controller told each pass's time with the noise pass_noise.py
                                         # measures (passes still paid at the curve): what reacting to it costs
The default curve is the one the engine calibrated for Qwen2.5-Coder-1.5B on the idle AVX-512 EPYC of
benchmarks/results/heldout-t0.json (33 widths, so drafts of up to 32 tokens); `--curve issue` is the one
the issue quotes (16 widths), `--curve FILE` another bench JSON's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgespec.pass_prices import generation_prices, merge_prices, priced_curve  # noqa: E402
from edgespec.controller import controller_for  # noqa: E402
from edgespec.costs import CostModel  # noqa: E402
from edgespec.drafters import NgramDrafter  # noqa: E402
from edgespec.learned import add_generation, prior_counts  # noqa: E402

# T(n) / T(1) at the widths the issue quotes; the widths between are interpolated linearly.
EPYC_CURVE_POINTS = {1: 1.0, 2: 1.58, 3: 2.23, 4: 2.67, 8: 4.4, 16: 5.2}
# The bench run whose calibrated curve is the default: what the engine planned with when it was timed.
BENCH_CURVE = Path(__file__).parent / "results" / "heldout-t0.json"
END = -1  # the end of a reply recorded without its model's end token: no n-gram ever proposes it


def interpolated_curve(points: dict[int, float] = EPYC_CURVE_POINTS) -> list[float]:
    widths = sorted(points)
    return [float(np.interp(n, widths, [points[w] for w in widths])) for n in range(1, widths[-1] + 1)]


def curve_named(name: str) -> list[float]:
    """'issue': the issue's curve; 'bench' or a bench JSON's path: the curve that run calibrated; an
    output_rows_cost.py JSON's path: the passes it timed with every row's logits, as verification asks for them
    (widths it did not time interpolated)."""
    if name == "issue":
        return interpolated_curve()
    figures = json.loads(Path(BENCH_CURVE if name == "bench" else name).read_text())
    if "relative" in figures:
        return interpolated_curve({int(width): t for width, t in figures["relative"]["every row"].items()})
    return [float(t) for t in figures["meta"]["cost_curve_relative"]]


@dataclass
class Replay:
    """One reply replayed: its plain time, its drafted time (both in T(1) units) and what the steps did."""

    plain: float = 0.0
    drafted: float = 0.0
    proposed: int = 0
    accepted: int = 0
    widths: dict[int, int] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.plain / self.drafted if self.drafted else 1.0

    @staticmethod
    def verify(tokens: list[int], truth: list[int], position: int) -> int:
        """How many of a draft's tokens the recorded reply keeps (T = 0: the longest agreeing prefix)."""
        accepted = 0
        while accepted < len(tokens) and position + accepted < len(truth) and tokens[accepted] == truth[position + accepted]:
            accepted += 1
        return accepted

    def count_step(self, tokens: list[int], accepted: int, truth: list[int], position: int, context: list[int],
                   cost: CostModel) -> int:
        """Price and count one step's pass, append what it emitted to context, and return the new position."""
        self.drafted += cost.target(len(tokens) + 1)
        self.proposed += len(tokens)
        self.accepted += accepted
        self.widths[len(tokens) + 1] = self.widths.get(len(tokens) + 1, 0) + 1
        emitted = truth[position: position + accepted + 1]
        context.extend(emitted)
        return position + len(emitted)


class PassNoise:
    """Each timed pass's seconds over what the curve says: a log deviation of spread `sd` that carries over from
    one pass to the next with correlation `rho` (a slow spell lasts), as benchmarks/pass_noise.py measures them."""

    def __init__(self, sd: float, rho: float, seed: int) -> None:
        self.sd, self.rho = sd, rho
        self.rng = np.random.default_rng(seed)
        self.log = self.rng.normal(0.0, sd)

    def __call__(self) -> float:
        self.log = self.rho * self.log + math.sqrt(1.0 - self.rho ** 2) * self.rng.normal(0.0, self.sd)
        return math.exp(self.log)


def decoded(row: dict) -> list[int]:
    """The tokens a row's steps decode: its recorded reply, and the model's end token where the reply stopped
    there (the step that wrote it is paid for too)."""
    return list(row["reply_ids"]) + ([row.get("end_token", END)] if row["finish_reason"] == "stop" else [])


def draft_step(drafter: NgramDrafter, controller, context: list[int], room: int) -> tuple[int, int, list[int]]:
    """One step's draft as the engine makes it, with room tokens left to generate after the step's own: (the
    drafter's signal, the most it could draft, the tokens drafted)."""
    k_max = controller.k_max
    hint = drafter.peek(context)
    limit = min(room, k_max)
    cap = limit if hint.available is None else min(limit, hint.available)
    foreseen = (lambda: drafter.propose(context, k_max).tokens) if hint.available != 0 else list
    # a drafter from before copies were told apart (ngram_sim_before.py) hints no copy
    controller.watch(context, hint.signal, foreseen, getattr(hint, "copy", None))
    k = controller.choose(hint.signal, cap) if cap > 0 else 0
    return hint.signal, cap, drafter.propose(context, k).tokens if k > 0 else []


def replay(prompt_ids: list[int], truth: list[int], cost: CostModel, controller, drafter: NgramDrafter,
           max_tokens: int, noise: PassNoise | None = None) -> Replay:
    """Decode the recorded reply (truth: decoded(row)) again as the engine would, with drafts checked against it;
    noise: what the controller is told each pass took is that far off the curve (the pass is still paid at it)."""
    context, position, result = list(prompt_ids), 0, Replay()
    while position < len(truth):
        signal, cap, tokens = draft_step(drafter, controller, context, max_tokens - position - 1)
        accepted = result.verify(tokens, truth, position)
        if cap > 0:  # the pass's price on the curve it is paid at, as the engine reports a timed pass
            seconds = cost.target(len(tokens) + 1) * (noise() if noise is not None else 1.0)
            controller.update(len(tokens), accepted, signal, seconds)
        position = result.count_step(tokens, accepted, truth, position, context, cost)
    result.plain = len(truth) * cost.target(1)
    return result


def drafter_for(row: dict) -> NgramDrafter:
    """The engine's n-gram drafter for the row's model: it drafts up to the model's end tokens (record_replies.py
    keeps them as end_tokens; files recorded before that replay a drafter that knows none)."""
    return NgramDrafter(end_tokens=frozenset(row.get("end_tokens", ())))


# llama.cpp's ngram-simple (common/ngram-map.cpp, common_ngram_simple_draft): the last `key` tokens
# (--spec-ngram-simple-size-n, default 12) must occur earlier; the most recent occurrence's next tokens are
# drafted, at most `draft_max` (--spec-ngram-simple-size-m, default 48) and never fewer than `key`.
# --spec-draft-n-max does not bound it.
LLAMACPP_KEY = 12
LLAMACPP_DRAFT_MAX = 48


def llamacpp_simple_draft(context: list[int], key: int = LLAMACPP_KEY, draft_max: int = LLAMACPP_DRAFT_MAX) -> list[int]:
    """What llama.cpp's ngram-simple drafts after context (which ends with the token just sampled)."""
    history, tail = context[:-1], context[-key:]
    if len(history) <= key + draft_max + 1:  # it needs this much history before it looks
        return []
    for start in range(len(history) - key, 0, -1):  # position 0 never counts as a match
        if history[start: start + key] == tail:
            draft = history[start + key: start + key + draft_max]
            return draft if len(draft) >= key else []
    return []


def replay_llamacpp_simple(prompt_ids: list[int], truth: list[int], cost: CostModel, max_tokens: int,
                           key: int = LLAMACPP_KEY, draft_max: int = LLAMACPP_DRAFT_MAX) -> Replay:
    """The reply decoded as llama-speculative-simple --spec-type ngram-simple would, priced on the same curve
    (widths past the curve's are priced at its widest's cost per token, as CostModel does)."""
    context, position, result = list(prompt_ids), 0, Replay()
    while position < len(truth):
        tokens = llamacpp_simple_draft(context, key, draft_max)[: max(0, max_tokens - position - 1)]
        accepted = result.verify(tokens, truth, position)
        position = result.count_step(tokens, accepted, truth, position, context, cost)
    result.plain = len(truth) * cost.target(1)
    return result


def replay_oracle(prompt_ids: list[int], truth: list[int], cost: CostModel, k_max: int, max_tokens: int,
                  drafter: NgramDrafter | None = None) -> Replay:
    """The fastest any draft-length choice could decode the reply with NgramDrafter's proposals: at T = 0 the
    context at each position is known (the prompt and the reply so far), so the best k per position follows
    by dynamic programming from the end.  An upper bound for the controller, not something it could reach."""
    n, drafter = len(truth), drafter or NgramDrafter()
    kept = []  # per position: for each k, how many of a k-token draft would be kept
    for position in range(n):
        context = list(prompt_ids) + truth[:position]
        tokens = drafter.propose(context, min(k_max, max(0, max_tokens - position - 1))).tokens
        run = 0
        while run < len(tokens) and position + run < n and tokens[run] == truth[position + run]:
            run += 1
        kept.append((len(tokens), run))
    best, choice = [0.0] * (n + 1), [0] * n
    for position in range(n - 1, -1, -1):
        offered, run = kept[position]
        options = [(cost.target(k + 1) + best[min(n, position + min(k, run) + 1)], k) for k in range(offered + 1)]
        best[position], choice[position] = min(options)
    result, position = Replay(plain=n * cost.target(1), drafted=best[0]), 0
    while position < n:
        k, run = choice[position], kept[position][1]
        result.proposed += k
        result.accepted += min(k, run)
        result.widths[k + 1] = result.widths.get(k + 1, 0) + 1
        position += min(k, run) + 1
    return result


def simulate(rows: list[dict], cost: CostModel, learned=None, max_tokens: int = 200,
             plan_cost: CostModel | None = None, plan_cost_for=None,
             noise: tuple[float, float, int] | None = None) -> dict[str, Replay]:
    """Each row replayed by a fresh drafter and controller (a new process), starting from learned or neutral priors;
    plan_cost: the curve the controller plans with, where it is not the one the passes cost (a stale calibration);
    plan_cost_for: a row's own plan curve instead (prices_from_others); noise: (sd, rho, seeds), each row replayed
    once per seed with PassNoise(sd, rho) on the times the controller is told, and the replays added up."""
    results = {}
    plan_cost = plan_cost or cost
    sd, rho, seeds = noise if noise is not None else (0.0, 0.0, 1)
    for index, row in enumerate(rows):
        row_plan = plan_cost_for(row) if plan_cost_for else plan_cost
        total = Replay()
        for seed in range(seeds):
            controller = controller_for("ngram", row_plan, len(row_plan.forward_seconds) - 1,
                                        learned=learned(row) if learned else None)
            one = replay(row["prompt_ids"], decoded(row), cost, controller, drafter_for(row), max_tokens,
                         PassNoise(sd, rho, 1000 * index + seed) if noise else None)
            total.plain, total.drafted = total.plain + one.plain, total.drafted + one.drafted
            total.proposed, total.accepted = total.proposed + one.proposed, total.accepted + one.accepted
            for width, count in one.widths.items():
                total.widths[width] = total.widths.get(width, 0) + count
        results[row["id"]] = total
    return results


def prices_from_others(rows: list[dict], cost: CostModel, plan_cost: CostModel):
    """For each row, the plan curve a new process would load after a machine ran every other row before it:
    plan_cost at the pass prices (calibration.py) the others' replays paid at cost, each replayed cold on plan_cost
    and added in turn, as finished generations are."""
    paid = {}
    for row in rows:
        controller = controller_for("ngram", plan_cost, len(plan_cost.forward_seconds) - 1)
        replayed = replay(row["prompt_ids"], decoded(row), cost, controller, drafter_for(row), 200)
        passes = [(width, cost.target(width) / plan_cost.target(width))
                  for width, count in replayed.widths.items() for _ in range(count)]
        paid[row["id"]] = generation_prices(passes)

    def plan_cost_for(row):
        prices = {}
        for other, seen in paid.items():
            if other != row["id"] and seen:
                prices = merge_prices(prices, seen)
        return CostModel(priced_curve(plan_cost.forward_seconds, prices))
    return plan_cost_for


def learned_from_others(rows: list[dict], cost: CostModel, same_kind: bool = False):
    """For each row, the learned prior that every other row's replay leaves behind (what a machine
    that ran the other prompts before would start this one from); same_kind: only the other prompts
    of its own kind (suite)."""
    exported = {}
    for row in rows:
        controller = controller_for("ngram", cost, len(cost.forward_seconds) - 1)
        replay(row["prompt_ids"], decoded(row), cost, controller, drafter_for(row), 200)
        exported[row["id"]] = controller.estimate.export()

    def learned(row):
        stored = {}
        for other, counts in exported.items():
            if other != row["id"] and (not same_kind or other.rsplit("-", 1)[0] == row["id"].rsplit("-", 1)[0]):
                stored = add_generation(stored, counts)
        return prior_counts(stored)
    return learned


def simulate_in_turn(rows: list[dict], cost: CostModel, max_tokens: int = 200) -> dict[str, Replay]:
    """Each row replayed in turn by a new process that starts from the learned priors the rows before it left
    (learned.py's store, which every finished `edgespec run` adds to), as a user's runs follow each other."""
    results, stored = {}, {}
    for row in rows:
        controller = controller_for("ngram", cost, len(cost.forward_seconds) - 1, learned=prior_counts(stored) or None)
        results[row["id"]] = replay(row["prompt_ids"], decoded(row), cost, controller, drafter_for(row), max_tokens)
        stored = add_generation(stored, controller.estimate.export())
    return results


def report(rows: list[dict], results: dict[str, Replay], per_prompt: bool = False) -> dict:
    by_suite = defaultdict(list)
    for row in rows:
        by_suite[row["suite"]].append(results[row["id"]])
        if per_prompt:
            r = results[row["id"]]
            print(f"  {row['id']:18s} {r.speedup:5.3f}x  accepted {r.accepted}/{r.proposed}  widths {dict(sorted(r.widths.items()))}")
    summary = {}
    for suite, replays in by_suite.items():
        plain, drafted = sum(r.plain for r in replays), sum(r.drafted for r in replays)
        proposed, accepted = sum(r.proposed for r in replays), sum(r.accepted for r in replays)
        summary[suite] = {"speedup": plain / drafted, "worst_prompt": min(r.speedup for r in replays),
                          "acceptance": accepted / proposed if proposed else 0.0, "prompts": len(replays)}
        print(f"{suite:14s} {plain / drafted:5.3f}x  worst prompt {summary[suite]['worst_prompt']:5.3f}x  "
              f"acceptance {summary[suite]['acceptance']:4.0%} of {proposed}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path, nargs="+", help="JSONL files from record_replies.py")
    parser.add_argument("--split", choices=("all", "tune", "check"), default="all",
                        help="tune: the first two prompts of each kind; check: the others")
    parser.add_argument("--learned", choices=("mixed", "kind", "in-turn"), nargs="?", const="mixed",
                        help="start each prompt from the learned prior of the other prompts (kind: of its own kind "
                             "only; in-turn: of the prompts before it, as the store holds them after those runs)")
    parser.add_argument("--shuffle", type=int, metavar="SEED",
                        help="with --learned in-turn: replay the prompts in an order shuffled by SEED")
    parser.add_argument("--curve", default="bench",
                        help="cost curve: bench (the calibrated one of results/heldout-t0.json), issue, or a bench JSON")
    parser.add_argument("--plan-curve",
                        help="the curve the controller plans with (as --curve), where --curve is what passes cost "
                             "(the edgespec policy; the others do not plan on a curve)")
    parser.add_argument("--learned-prices", action="store_true",
                        help="plan each prompt on --plan-curve at the pass prices the other prompts paid at --curve "
                             "(what a new process loads after they ran: calibration.priced_curve)")
    parser.add_argument("--policy", choices=("edgespec", "llamacpp-simple", "oracle"), default="edgespec",
                        help="llamacpp-simple: replay llama.cpp's ngram-simple instead; oracle: the best draft "
                             "lengths for edgespec's drafter, chosen knowing the reply (an upper bound)")
    parser.add_argument("--llamacpp-key", type=int, default=LLAMACPP_KEY,
                        help="llamacpp-simple's lookup length (its --spec-ngram-simple-size-n)")
    parser.add_argument("--llamacpp-draft-max", type=int, default=LLAMACPP_DRAFT_MAX,
                        help="llamacpp-simple's draft length (its --spec-ngram-simple-size-m)")
    parser.add_argument("--seconds-noise", type=float, default=0.0, metavar="SD",
                        help="tell the controller each pass's time with log noise of this spread (0: the curve's)")
    parser.add_argument("--noise-rho", type=float, default=0.7, help="how much of one pass's noise carries to the next")
    parser.add_argument("--noise-seeds", type=int, default=5, help="replays per prompt with --seconds-noise")
    parser.add_argument("--json", type=Path, help="write the per-kind figures here")
    parser.add_argument("--per-prompt", action="store_true", help="also show each prompt's figures")
    args = parser.parse_args()
    if args.shuffle is not None and args.learned != "in-turn":
        parser.error("--shuffle orders the prompts of --learned in-turn; add that, or drop --shuffle")
    if args.learned == "in-turn" and (args.plan_curve or args.learned_prices or args.seconds_noise):
        parser.error("--learned in-turn replays at one curve without noise; drop --plan-curve, --learned-prices "
                     "and --seconds-noise")
    rows = [json.loads(line) for path in args.replies for line in path.read_text().splitlines() if line.strip()]
    if args.split != "all":
        rows = [row for row in rows if (int(row["id"].split("@")[0].rsplit("-", 1)[1]) <= 2) == (args.split == "tune")]
    cost = CostModel(curve_named(args.curve))
    if args.policy == "llamacpp-simple":
        results = {row["id"]: replay_llamacpp_simple(row["prompt_ids"], decoded(row), cost, 200,
                                                     args.llamacpp_key, args.llamacpp_draft_max) for row in rows}
    elif args.policy == "oracle":
        results = {row["id"]: replay_oracle(row["prompt_ids"], decoded(row), cost, len(cost.forward_seconds) - 1, 200,
                                            drafter_for(row)) for row in rows}
    elif args.learned == "in-turn":
        if args.shuffle is not None:
            random.Random(args.shuffle).shuffle(rows)
        results = simulate_in_turn(rows, cost)
    else:
        plan_cost = CostModel(curve_named(args.plan_curve)) if args.plan_curve else cost
        results = simulate(rows, cost, learned_from_others(rows, cost, args.learned == "kind") if args.learned else None,
                           plan_cost=plan_cost,
                           plan_cost_for=prices_from_others(rows, cost, plan_cost) if args.learned_prices else None,
                           noise=(args.seconds_noise, args.noise_rho, args.noise_seeds) if args.seconds_noise else None)
    summary = report(rows, results, args.per_prompt)
    if args.json:
        args.json.write_text(json.dumps({"curve": cost.forward_seconds, "split": args.split,
                                         "learned": args.learned, "kinds": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
