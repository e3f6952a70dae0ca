"""Two n-gram candidates verified in one target pass (a two-branch tree), replayed at T = 0.

Should the engine verify a second n-gram candidate beside the first, so that where the copy breaks another
may hold?  A pure-Python replay study built on ngram_sim.py (no model is loaded).  Each recorded T = 0
reply is decoded again through the real NgramDrafter and draft-length controller; every pass is priced on a
cost curve (index i = a pass of width i + 1, in units of a 1-token pass).

Candidates
  primary A:   what the engine drafts today: controller.choose(k_A), drafter.propose(context, k_A); the
               controller is updated with the primary's outcome and the primary-only pass price, so it
               behaves as today (the reply's steps land at other positions when the secondary gains tokens).
  secondary B: a lookup of our own over the raw token list (prompt + reply so far):
      "alt"   all earlier occurrences of the context's last n tokens, n = 16 .. 1 (longer matches first),
              most recent first; the first whose next token differs from A's first token is continued
              (past the context's end the text is assumed to repeat with the match's period, as the drafter
              does; cut after an end token).
      "plain" the plain most-recent-occurrence lookup of the longest suffix match; used only where its
              first token differs from A's (it differs where the drafter's copy cursor overrode it).
  Both branches attend to the accepted context, not to each other; the pass has width 1 + k_A + k_B and
  keeps A's run when A's first token is right, else B's run (+1 bonus token either way).
  B is only drafted with a non-empty A (k_A >= 1); widths are capped at the curve's widest (k_A + k_B <= 32)
  unless --no-width-cap.

Rules for k_B (given today's k_A):
  fixed-1/2/4/8   k_B = that many
  fill16          k_B = 15 - k_A when k_A < 15, none otherwise (pass width 16)
  fill16-if8      k_B = 15 - k_A only when 8 <= k_A < 15
  foresight-kB    k_B chosen knowing the reply, per step (greedy: least cost per emitted token this step),
                  k_A as today: what a perfect k_B rule could add to today's controller
  foresight-break exploratory, beyond the root-level idea: the secondary branches off the primary exactly where
                  the primary breaks (depth = its kept run, known only with foresight), "alt" lookup on the
                  context + the kept run excluding the primary's wrong token, k_B greedy with foresight
Upper bounds (dynamic programming over positions, as ngram_sim.replay_oracle: T = 0, the state is the position):
  oracle-1cand    the one-candidate oracle (must reproduce ngram_sim --policy oracle)
  oracle-2cand    at each position any (k_A, k_B), k_A + k_B <= 32, knowing the reply; B = "alt" lookup
                  excluding A's first token, or, where A is empty, the plain lookup alone
  oracle-2cand+break  exploratory: oracle-2cand, plus the option of a branch C hanging beside the primary's
                  first wrong token (the "alt" lookup on the context + A's kept run, excluding that token)
  oracle-anyocc   B = the best continuation of ANY earlier occurrence of any suffix n-gram (n = 1..16) whose
                  first token differs from A's: bounds every secondary lookup rule built on n-gram matches

Run (the default curve is the AVX-512 EPYC's calibration at the prices its generations paid in stop 76,
built with edgespec.pass_prices.priced_curve; about 20 seconds):
  .venv/bin/python benchmarks/two_candidates_sim.py \\
      benchmarks/workloads-code-edit-12/replies-qwen2.5-coder-1.5b.jsonl \\
      benchmarks/workloads-heldout/replies-qwen2.5-coder-1.5b.jsonl
  options: --per-prompt (each code-edit-12 prompt per variant), --no-width-cap, --max-tokens 200
Stop 77's run: results/avx512-two-candidates-sim.txt.  No rule that can be built without knowing the reply
beat drafting one candidate, and the two-candidate oracle is 1-2% over the one-candidate oracle: today's
controller drafts where the copy's first token is almost always right (8 of 799 steps on the twelve had it wrong).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgespec.controller import controller_for  # noqa: E402
from edgespec.costs import CostModel  # noqa: E402
from edgespec.drafters import NgramDrafter, up_to_an_end  # noqa: E402
from ngram_sim import curve_named, decoded, draft_step, drafter_for, replay  # noqa: E402

N_MAX = 16


# ---------------------------------------------------------------------------------------------- lookups

class OccurrenceIndex:
    """Every n-gram (1..16) of a row's whole token sequence (prompt + decoded reply) -> the sorted positions
    right after its occurrences.  At a context of length L only positions <= L - 1 count (the n-gram ends
    before the context's last token, so its next token is known, as the drafter's index)."""

    def __init__(self, sequence: list[int]):
        self.seq = sequence
        self.after: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for end in range(len(sequence)):  # n-gram sequence[end-n+1 .. end], next position end + 1
            for n in range(1, min(N_MAX, end + 1) + 1):
                self.after[tuple(sequence[end - n + 1: end + 1])].append(end + 1)

    def occurrences(self, length: int, n: int) -> list[int]:
        """Next-positions of earlier occurrences of the context's (first `length` tokens) last n tokens,
        most recent first."""
        if n > length - 1:
            return []
        found = self.after.get(tuple(self.seq[length - n: length]), [])
        cut = bisect.bisect_right(found, length - 1)
        return found[:cut][::-1]

    def continuation(self, length: int, start: int, k: int, end_tokens) -> list[int]:
        period = length - start
        return up_to_an_end([self.seq[start + i % period] for i in range(k)], end_tokens)

    def alt(self, length: int, k: int, exclude: int | None, end_tokens) -> list[int]:
        """Longest suffix match first, most recent first: the first continuation whose first token != exclude."""
        for n in range(min(N_MAX, length - 1), 0, -1):
            for start in self.occurrences(length, n):
                if self.seq[start] != exclude:
                    return self.continuation(length, start, k, end_tokens)
        return []

    def plain(self, length: int, k: int, exclude: int | None, end_tokens) -> list[int]:
        """The longest suffix match's most recent occurrence, continued; [] if its first token == exclude."""
        for n in range(min(N_MAX, length - 1), 0, -1):
            found = self.occurrences(length, n)
            if found:
                start = found[0]
                return [] if self.seq[start] == exclude else self.continuation(length, start, k, end_tokens)
        return []

    def best_any(self, length: int, k: int, exclude: int | None, end_tokens, truth: list[int], position: int):
        """Among every earlier occurrence of every suffix n-gram, the continuation the reply keeps longest
        (first token != exclude): (tokens, run)."""
        best, best_run, seen = [], -1, set()
        for n in range(min(N_MAX, length - 1), 0, -1):
            for start in self.occurrences(length, n):
                if start in seen or self.seq[start] == exclude:
                    continue
                seen.add(start)
                tokens = self.continuation(length, start, k, end_tokens)
                run = run_of(tokens, truth, position)
                if run > best_run:
                    best, best_run = tokens, run
        return best


def run_of(tokens: list[int], truth: list[int], position: int) -> int:
    run = 0
    while run < len(tokens) and position + run < len(truth) and tokens[run] == truth[position + run]:
        run += 1
    return run


# ---------------------------------------------------------------------------------------------- replays

@dataclass
class Result:
    plain: float = 0.0
    drafted: float = 0.0
    proposed: int = 0           # A + B tokens sent
    accepted: int = 0           # tokens kept from drafts (A's or B's)
    steps: int = 0
    b_sent: int = 0             # steps that carried a secondary
    b_tokens: int = 0           # secondary tokens sent
    b_kept_steps: int = 0       # steps whose kept run came from the secondary
    b_gained: int = 0           # tokens the secondary's kept runs added
    a_first_wrong: int = 0      # steps with a non-empty primary whose first token was wrong
    widths: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.plain / self.drafted if self.drafted else 1.0

    def add(self, other: "Result") -> None:
        for name in ("plain", "drafted", "proposed", "accepted", "steps", "b_sent", "b_tokens", "b_kept_steps",
                     "b_gained", "a_first_wrong"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for w, c in other.widths.items():
            self.widths[w] = self.widths.get(w, 0) + c


def k_b_rule(rule: str, k_a: int) -> int:
    if rule == "none":  # no secondary: must give ngram_sim.replay's figures exactly (checked in main)
        return 0
    if rule.startswith("fixed-"):
        return int(rule.split("-")[1])
    if rule == "fill16":
        return 15 - k_a if k_a < 15 else 0
    if rule == "fill16-if8":
        return 15 - k_a if 8 <= k_a < 15 else 0
    raise ValueError(rule)


def replay_two(row: dict, cost: CostModel, rule: str, source: str, max_tokens: int, width_cap: bool) -> Result:
    """ngram_sim.replay with a secondary candidate added to each drafted step (see the module docstring)."""
    prompt_ids, truth = row["prompt_ids"], decoded(row)
    end_tokens = frozenset(row.get("end_tokens", ()))
    index = OccurrenceIndex(list(prompt_ids) + truth)
    k_max = len(cost.forward_seconds) - 1
    controller = controller_for("ngram", cost, k_max)
    drafter = drafter_for(row)
    context, position, result = list(prompt_ids), 0, Result()
    while position < len(truth):
        signal, cap, tokens = draft_step(drafter, controller, context, max_tokens - position - 1)
        run_a = run_of(tokens, truth, position)
        if cap > 0:  # the controller sees only the primary, at the primary-only price: it behaves as today
            controller.update(len(tokens), run_a, signal, cost.target(len(tokens) + 1))
        secondary: list[int] = []
        depth = 0  # where the secondary branches off the primary (0: at the root, a different first token)
        if rule == "foresight-break" and tokens and run_a < len(tokens):
            # exploratory bound: branch exactly where the primary breaks (known only with foresight)
            depth = run_a
            room = max(0, max_tokens - position - 1 - depth)
            if width_cap:
                room = min(room, k_max - len(tokens))
            if room > 0:
                secondary = index.alt(len(context) + depth, room, tokens[depth], end_tokens)
            if run_a == 0:
                result.a_first_wrong += 1
        elif tokens and rule != "foresight-break":
            room = max(0, max_tokens - position - 1)
            if width_cap:
                room = min(room, k_max - len(tokens))
            if rule == "foresight-kB":
                want = room
            else:
                want = min(room, k_b_rule(rule, len(tokens)))
            if want > 0:
                lookup = index.alt if source == "alt" else index.plain
                secondary = lookup(len(context), want, tokens[0], end_tokens)
            if run_a == 0:
                result.a_first_wrong += 1
        run_b = run_of(secondary, truth, position + depth) if (run_a == depth and run_a < len(tokens)) else 0
        if rule in ("foresight-kB", "foresight-break") and secondary:
            # knowing the reply: the k_B that gives the least cost per emitted token this step (0: none)
            base = cost.target(1 + len(tokens)) / (1 + run_a)
            best_k, best = 0, base
            for k_b in range(1, run_b + 1):  # more than run_b only adds cost
                per = cost.target(1 + len(tokens) + k_b) / (1 + run_a + k_b)
                if per < best - 1e-12:
                    best_k, best = k_b, per
            secondary = secondary[:best_k]
            run_b = min(run_b, best_k)
        width = 1 + len(tokens) + len(secondary)
        kept = run_a + run_b  # run_b > 0 only where the primary broke at the branch's depth
        result.drafted += cost.target(width)
        result.proposed += len(tokens) + len(secondary)
        result.accepted += kept
        result.steps += 1
        result.widths[width] = result.widths.get(width, 0) + 1
        if secondary:
            result.b_sent += 1
            result.b_tokens += len(secondary)
            if run_b > 0:
                result.b_kept_steps += 1
                result.b_gained += run_b
        emitted = truth[position: position + kept + 1]
        context.extend(emitted)
        position += len(emitted)
    result.plain = len(truth) * cost.target(1)
    return result


def baseline(row: dict, cost: CostModel, max_tokens: int) -> Result:
    k_max = len(cost.forward_seconds) - 1
    r = replay(row["prompt_ids"], decoded(row), cost, controller_for("ngram", cost, k_max), drafter_for(row), max_tokens)
    return Result(plain=r.plain, drafted=r.drafted, proposed=r.proposed, accepted=r.accepted,
                  steps=sum(r.widths.values()), widths=dict(r.widths))


def oracle_two(row: dict, cost: CostModel, max_tokens: int, secondary: str) -> Result:
    """DP over positions (ngram_sim.replay_oracle's method, with its drafter use) with two candidates:
    secondary 'none' (one candidate; reproduces replay_oracle), 'alt' or 'anyocc'."""
    prompt_ids, truth = row["prompt_ids"], decoded(row)
    end_tokens = frozenset(row.get("end_tokens", ()))
    index = OccurrenceIndex(list(prompt_ids) + truth)
    k_max = len(cost.forward_seconds) - 1
    drafter, n = drafter_for(row), len(truth)
    offers = []  # per position: (len A, run A, len B, run B, len C, run C); C: a branch where A breaks ('break')
    for position in range(n):
        context = list(prompt_ids) + truth[:position]  # a new list per position, as replay_oracle
        k = min(k_max, max(0, max_tokens - position - 1))
        a = drafter.propose(context, k).tokens
        run_a = run_of(a, truth, position)
        b: list[int] = []
        c: list[int] = []
        if secondary == "break" and run_a < len(a):
            room = min(k_max - (run_a + 1), max_tokens - position - 1 - run_a)
            if room > 0:
                c = index.alt(len(context) + run_a, room, a[run_a], end_tokens)
        if secondary != "none" and k > 0:
            exclude = a[0] if a else None
            if secondary in ("alt", "break"):
                b = index.alt(len(context), k, exclude, end_tokens) if a else index.plain(len(context), k, None, end_tokens)
            else:
                b = index.best_any(len(context), k, exclude, end_tokens, truth, position)
        offers.append((len(a), run_a, len(b), run_of(b, truth, position), len(c), run_of(c, truth, position + run_a)))
    best, choice = [0.0] * (n + 1), [(0, 0)] * n
    for position in range(n - 1, -1, -1):
        len_a, run_a, len_b, run_b, len_c, run_c = offers[position]
        options = []
        if len_c:  # the branch C hangs beside A's wrong token: A drafted past its break (k_A > run A)
            for k_a in range(run_a + 1, len_a + 1):
                for k_c in range(1, min(len_c, k_max - k_a) + 1):
                    kept = run_a + min(k_c, run_c)
                    options.append((cost.target(1 + k_a + k_c) + best[min(n, position + kept + 1)], k_a, -k_c))
        for k_a in range(len_a + 1):
            for k_b in range(min(len_b, k_max - k_a) + 1):
                kept = min(k_a, run_a) if (k_a and run_a) else min(k_b, run_b)
                options.append((cost.target(1 + k_a + k_b) + best[min(n, position + kept + 1)], k_a, k_b))
        best[position], k_a, k_b = min(options)
        choice[position] = (k_a, k_b)
    result, position = Result(plain=n * cost.target(1), drafted=best[0]), 0
    while position < n:
        (k_a, k_b), (_, run_a, _, run_b, _, run_c) = choice[position], offers[position]
        kept_a = min(k_a, run_a) if k_a else 0
        if k_b < 0:  # the branch where A breaks (negative k_b marks it)
            k_b = -k_b
            kept = run_a + min(k_b, run_c)
            result.proposed += k_a + k_b
            result.accepted += kept
            result.steps += 1
            result.widths[1 + k_a + k_b] = result.widths.get(1 + k_a + k_b, 0) + 1
            result.b_sent += 1
            result.b_tokens += k_b
            if min(k_b, run_c):
                result.b_kept_steps += 1
                result.b_gained += min(k_b, run_c)
            position += kept + 1
            continue
        kept = kept_a if kept_a else min(k_b, run_b)
        result.proposed += k_a + k_b
        result.accepted += kept
        result.steps += 1
        result.widths[1 + k_a + k_b] = result.widths.get(1 + k_a + k_b, 0) + 1
        if k_b:
            result.b_sent += 1
            result.b_tokens += k_b
            if not kept_a and min(k_b, run_b):
                result.b_kept_steps += 1
                result.b_gained += min(k_b, run_b)
        position += kept + 1
    return result


# ---------------------------------------------------------------------------------------------- report

VARIANTS = ([("baseline", None, None)]
            + [(f"{rule} [{src}]", rule, src) for src in ("alt", "plain")
               for rule in ("fixed-1", "fixed-2", "fixed-4", "fixed-8", "fill16", "fill16-if8", "foresight-kB")]
            + [("foresight-break [alt]", "foresight-break", "alt")]
            + [("oracle-1cand", "oracle", "none"), ("oracle-2cand [alt]", "oracle", "alt"),
               ("oracle-anyocc", "oracle", "anyocc"), ("oracle-2cand+break", "oracle", "break")])


def run_variant(row, cost, rule, src, max_tokens, width_cap) -> Result:
    if rule is None:
        return baseline(row, cost, max_tokens)
    if rule == "oracle":
        return oracle_two(row, cost, max_tokens, src)
    return replay_two(row, cost, rule, src, max_tokens, width_cap)


def diagnose(rows: list[dict], cost: CostModel, max_tokens: int) -> str:
    """Where a second candidate could act at all: today's drafted steps by outcome, and every position of the
    replies (the oracle's view) by whether the primary's first token is right and the "alt" secondary's is."""
    from collections import Counter
    steps, where, rescue = Counter(), Counter(), Counter()
    k_max = len(cost.forward_seconds) - 1
    for row in rows:
        prompt_ids, truth = row["prompt_ids"], decoded(row)
        end_tokens = frozenset(row.get("end_tokens", ()))
        controller, drafter = controller_for("ngram", cost, k_max), drafter_for(row)
        context, position = list(prompt_ids), 0
        while position < len(truth):
            signal, cap, tokens = draft_step(drafter, controller, context, max_tokens - position - 1)
            run = run_of(tokens, truth, position)
            if cap > 0:
                controller.update(len(tokens), run, signal, cost.target(len(tokens) + 1))
            steps["no draft (width 1)" if not tokens else "all kept" if run == len(tokens)
                  else "first token wrong" if run == 0 else "broke mid-draft"] += 1
            context.extend(truth[position: position + run + 1])
            position += run + 1
        index, drafter = OccurrenceIndex(list(prompt_ids) + truth), drafter_for(row)
        for position in range(len(truth)):
            context = list(prompt_ids) + truth[:position]
            a = drafter.propose(context, k_max).tokens
            if not a:
                b = index.plain(len(context), k_max, None, end_tokens)
                where["A empty; plain lookup right" if run_of(b, truth, position) else "A empty; nothing right"] += 1
            elif run_of(a, truth, position):
                where["A first token right"] += 1
            else:
                b = index.alt(len(context), k_max, a[0], end_tokens)
                rb = run_of(b, truth, position)
                where["A wrong; alt right" if rb else "A wrong; alt wrong" if b else "A wrong; no alt"] += 1
                if rb:
                    rescue["1" if rb == 1 else "2-3" if rb <= 3 else "4-7" if rb <= 7 else "8-15" if rb <= 15 else "16+"] += 1
    total = sum(where.values())
    return (f"  today's steps: {dict(steps)}\n"
            f"  positions ({total}): " + ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in where.items()) + "\n"
            f"  alt's run where it rescues: {dict(rescue)}")


def line(name: str, rs: list[Result]) -> str:
    """One variant's figures over some prompts (A-first-wrong and the B columns are not counted, "-", for the
    baseline and the oracles' A-first-wrong)."""
    total = Result()
    for r in rs:
        total.add(r)
    speeds = [r.speedup for r in rs]
    acc = total.accepted / total.proposed if total.proposed else 0.0
    return (f"{name:24s} {total.speedup:6.3f}x  min {min(speeds):5.3f} med {statistics.median(speeds):5.3f}  "
            f"acc {acc:4.0%} of {total.proposed:5d}  steps {total.steps:4d}  "
            + ("A-first-wrong    -  " if name == "baseline" or name.startswith("oracle") else
               f"A-first-wrong {total.a_first_wrong:4d}  ")
            + ("B: -" if name == "baseline" else
               f"B sent {total.b_sent:4d} ({total.b_tokens:5d} tok)  B kept {total.b_kept_steps:3d}  B gained {total.b_gained:4d}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path, nargs="+")
    parser.add_argument("--curve", default=str(Path(__file__).parent / "results" / "avx512-paid-prices-curve-stop76.json"),
                        help="a bench JSON whose meta.cost_curve_relative prices the passes (ngram_sim.curve_named)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--no-width-cap", action="store_true")
    parser.add_argument("--per-prompt", action="store_true")
    args = parser.parse_args()
    cost = CostModel(curve_named(args.curve))
    print(f"curve {args.curve}: widths 1-{len(cost.forward_seconds)}; "
          + " ".join(f"T({w})={cost.target(w):.2f}" for w in (2, 4, 8, 9, 16, 32, 33)))
    print("speedup = plain (tokens x T(1)) / replay; min/med = per-prompt; acc = kept draft tokens / sent (A+B)\n")
    table = {}  # (file, suite) -> variant -> (speedup, min, median)
    for path in args.replies:
        rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        print(f"=== {path}  ({len(rows)} replies)")
        suites = sorted({r["suite"] for r in rows}, key=[r["suite"] for r in rows].index)
        per_variant = {}
        for name, rule, src in VARIANTS:
            per_variant[name] = {row["id"] + "@" + row["suite"]: run_variant(row, cost, rule, src, args.max_tokens,
                                                                          not args.no_width_cap) for row in rows}
        for suite in suites:
            keys = [row["id"] + "@" + row["suite"] for row in rows if row["suite"] == suite]
            print(f"--- {suite} ({len(keys)} prompts)")
            for name, _, _ in VARIANTS:
                rs = [per_variant[name][k] for k in keys]
                print(line(name, rs))
                total = Result()
                for r in rs:
                    total.add(r)
                table.setdefault((path.parent.name, suite), {})[name] = (
                    total.speedup, min(r.speedup for r in rs), statistics.median(r.speedup for r in rs))
            check = [per_variant["baseline"][k].drafted for k in keys] == [
                run_variant(row, cost, "none", "alt", args.max_tokens, True).drafted
                for row in rows if row["suite"] == suite]
            print(f"  check: the two-candidate replay with no secondary == ngram_sim.replay on every prompt: {check}")
            print(diagnose([row for row in rows if row["suite"] == suite], cost, args.max_tokens))
            if args.per_prompt and len(keys) > 4:
                print(f"  per prompt ({suite}):")
                print("  " + "variant".ljust(24) + " ".join(k.split("@")[0][-2:].rjust(6) for k in keys))
                for name, _, _ in VARIANTS:
                    print("  " + name.ljust(24) + " ".join(f"{per_variant[name][k].speedup:6.3f}" for k in keys))
            print()
    print("=== summary: speedup over plain (all prompts of the kind together; [min, median] per prompt where >4 prompts)")
    columns = list(table)
    print("variant".ljust(24) + "".join(f"{(f.replace('workloads-', '') + ':' + k)[:22]:>24s}" if len(table[(f, k)]) else ""
                                        for f, k in columns))
    for name, _, _ in VARIANTS:
        cells = []
        for col in columns:
            sp, lo, med = table[col][name]
            cells.append(f"{sp:.3f} [{lo:.3f},{med:.3f}]" if col[0].endswith("code-edit-12") else f"{sp:.3f}")
        print(name.ljust(24) + "".join(c.rjust(24) for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
