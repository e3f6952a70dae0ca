"""Learned priors on a new kind of prompt: the first and the tenth `edgespec run` of that kind.

For each kind, a fresh cache dir (EDGESPEC_CACHE_DIR, with this machine's calibration copied in so that
no run measures the cost curve again) starts with no learned priors.  Then `edgespec run --draft ngram`
runs RUNS times on the kind's prompts in turn (run i takes prompt i mod the kind's count), each run
learning into that dir as every `edgespec run` does; next to each, in alternating order, a plain run
(`--draft none`) of the same prompt.  A run's figure is its decode tok/s over its plain partner's: the
machine's drift between runs moves both alike.  T = 0: a pair whose tokens differ is flagged (a near-tie
of the target's two best tokens, where pass widths' kernels drift; not an error).

Run on an idle machine (about 2 x RUNS x 10 s per kind for Qwen2.5-Coder-1.5B on 2 cores):
    .venv/bin/python benchmarks/learned_first_tenth.py --json benchmarks/results/learned-first-tenth.json
Smoke test (tiny):
    .venv/bin/python benchmarks/learned_first_tenth.py --model smollm2-135m-instruct --kinds extract --runs 2 --max-tokens 16
What it should show: each prompt's later runs at least its first (the priors learned this kind's
acceptance; `by_prompt` in the summary, as run 1 and run 10 are different prompts), and never below 0.98.

--held-out N --repeats R compares the same prompts as the first and the tenth run: the kind's last N
prompts are kept out of the RUNS learning runs (RUNS 9 makes the next run the tenth), then each is run
R times in rotation as plain decoding, as the kind's first run (no learned priors) and as its next run
(the priors the learning runs left), every one in a copy of its cache dir so that none of them learns.
Each reports the median of its rounds' ratios to plain, and the passes per token, acceptance and drafted
tokens its rounds gave (at T = 0 these still move a little between rounds: the step-time guard reads wall
time, and near-ties of the target's two best tokens resolve by pass width):
    .venv/bin/python benchmarks/learned_first_tenth.py --workloads benchmarks/workloads-code-edit-12 \
        --kinds code-edit --runs 9 --held-out 3 --repeats 5

--keep-learned DIR keeps the cache dir the learning runs left, so that another command can start from it:
the held-out code edits against llama.cpp's peers with learned priors (a fold of the twelve's last six):
    mkdir -p /tmp/ce-last6 && tail -n 6 benchmarks/workloads-code-edit-12/code-edit.jsonl > /tmp/ce-last6/code-edit.jsonl
    .venv/bin/python benchmarks/learned_first_tenth.py --workloads benchmarks/workloads-code-edit-12 \
        --kinds code-edit --runs 6 --held-out 6 --repeats 3 --keep-learned /tmp/ce-learned
    EDGESPEC_CACHE_DIR=/tmp/ce-learned/code-edit .venv/bin/edgespec bench --learned-priors --workloads /tmp/ce-last6 \
        --suites code-edit --configs baseline,ngram,llamacpp-ngram-simple,llamacpp-ngram-simple-n15,llamacpp-ngram-mod \
        --llama-cpp-bin "$(benchmarks/build_llama_cpp_peer.sh)" --repeats 3 --temperature 0 --max-tokens 200

--learn-on KIND makes the learning runs another kind's, so the next run is a kind's first after a user's
runs of another (learned priors are per model, not per kind): whether what one kind taught costs the next.
    .venv/bin/python benchmarks/learned_first_tenth.py --kinds extract,explain --held-out 2 --runs 9 \
        --learn-on code-edit --learn-workloads benchmarks/workloads-code-edit-12 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgespec.calibration import cache_dir
from edgespec.commands.bench.workloads import load_workloads

HELDOUT = Path(__file__).parent / "workloads-heldout"
KINDS = ("extract", "refactor", "code-edit", "summary-quote", "chat")
EDGESPEC = Path(sys.executable).with_name("edgespec")


def run_once(prompt: str, draft: str, cache: Path, args) -> dict:
    """One `edgespec run --json` in the given cache dir: its stats and token ids."""
    command = [str(EDGESPEC), "run", "--model", args.model, "--draft", draft, "--temperature", "0",
               "--max-tokens", str(args.max_tokens), "--no-prompt-cache", "--json", prompt]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "EDGESPEC_CACHE_DIR": str(cache)},
                          timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"edgespec run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def new_cache(directory: Path) -> Path:
    """An empty cache dir with this machine's calibration in it: no run in it measures the curve again."""
    directory.mkdir()
    calibration = cache_dir() / "calibration.json"
    if calibration.is_file():
        shutil.copy(calibration, directory / "calibration.json")
    return directory


def one_kind(kind: str, args) -> tuple[list[dict], list[dict]]:
    """RUNS drafted runs of this kind (or of --learn-on's) from no learned priors, each with its plain partner;
    then, with --held-out, the held-out prompts as the kind's first run and as its next one (held_out_rounds)."""
    prompts = load_workloads([kind], directory=args.workloads)
    learning, held_out = (prompts[: -args.held_out], prompts[-args.held_out:]) if args.held_out else (prompts, [])
    if args.learn_on:
        learning = load_workloads([args.learn_on], directory=args.learn_workloads or args.workloads)
    if not learning:
        raise SystemExit(f"--held-out {args.held_out} leaves none of the {len(prompts)} {kind} prompts to learn from")
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgespec-first-tenth-") as directory:
        cache = new_cache(Path(directory) / "learned")
        cold = new_cache(Path(directory) / "cold")
        for i in range(args.runs):
            prompt = learning[i % len(learning)]
            order = ("ngram", "none") if i % 2 == 0 else ("none", "ngram")
            result = {draft: run_once(prompt.prompt, draft, cache, args) for draft in order}
            drafted, plain = result["ngram"], result["none"]
            tps, base = drafted["stats"]["decode_tokens_per_second"], plain["stats"]["decode_tokens_per_second"]
            rows.append({"kind": kind, "run": i + 1, "prompt_id": prompt.id, "tok_s": tps, "plain_tok_s": base,
                         "ratio": tps / base if base else None, "acceptance": drafted["stats"]["acceptance_rate"],
                         "passes_per_token": drafted["stats"]["target_passes_per_token"],
                         "same_tokens": drafted["token_ids"] == plain["token_ids"]})
            print(f"{kind} run {i + 1} ({prompt.id}): {tps:.1f} tok/s, plain {base:.1f}, "
                  f"x{rows[-1]['ratio']:.2f}", file=sys.stderr)
        checks = [held_out_rounds(kind, prompt, cold, cache, args) for prompt in held_out]
        if args.keep_learned:
            shutil.copytree(cache, args.keep_learned / kind)
    return rows, checks


RUN_KINDS = ("plain", "first", "next")  # plain decoding; the kind's first run (no learned priors); the next


def held_out_rounds(kind: str, prompt, cold: Path, learned: Path, args) -> dict:
    """One held-out prompt, REPEATS rounds of a plain run, a first run (cold's dir) and a next run (learned's),
    in rotating order, each in a throwaway copy of its dir; the rounds' figures and what they share."""
    runs = {name: [] for name in RUN_KINDS}
    for round_ in range(args.repeats):
        for name in RUN_KINDS[round_ % 3:] + RUN_KINDS[: round_ % 3]:
            with tempfile.TemporaryDirectory(prefix="edgespec-held-out-") as directory:
                copy = Path(directory) / "cache"
                shutil.copytree(learned if name == "next" else cold, copy)
                runs[name].append(run_once(prompt.prompt, "none" if name == "plain" else "ngram", copy, args))
    plain_tps = [run["stats"]["decode_tokens_per_second"] for run in runs["plain"]]
    check = {"kind": kind, "prompt_id": prompt.id, "rounds": args.repeats, "plain_tok_s": plain_tps,
             "same_tokens": all(run["token_ids"] == runs["plain"][0]["token_ids"] for name in RUN_KINDS
                                for run in runs[name])}
    for name in ("first", "next"):
        stats = [run["stats"] for run in runs[name]]
        ratios = [s["decode_tokens_per_second"] / base for s, base in zip(stats, plain_tps)]
        check[name] = {"tok_s": [s["decode_tokens_per_second"] for s in stats], "ratio_median": statistics.median(ratios),
                       "ratios": ratios, "passes_per_token": sorted({s["target_passes_per_token"] for s in stats}),
                       "acceptance": sorted({s["acceptance_rate"] for s in stats}),
                       "drafted": sorted({s["draft_tokens_proposed"] for s in stats})}
        print(f"{prompt.id} {name}: x{check[name]['ratio_median']:.2f} of plain, passes/token "
              f"{check[name]['passes_per_token']}, acceptance {check[name]['acceptance']}", file=sys.stderr)
    return check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated held-out kinds")
    parser.add_argument("--workloads", type=Path, default=HELDOUT)
    parser.add_argument("--runs", type=int, default=10, help="drafted runs per kind (each with a plain partner)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--held-out", type=int, default=0, metavar="N",
                        help="keep each kind's last N prompts out of the learning runs and time them as its first "
                             "and its next run (see above)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per held-out prompt")
    parser.add_argument("--learn-on", metavar="KIND",
                        help="learn on this other kind's prompts instead, so the held-out prompts' next run is their "
                             "kind's first after RUNS runs of another kind (a user who switches kinds)")
    parser.add_argument("--learn-workloads", type=Path, help="the workloads dir of --learn-on (default: --workloads)")
    parser.add_argument("--keep-learned", type=Path, metavar="DIR",
                        help="keep each kind's cache dir as the learning runs left it, in DIR/KIND: point "
                             "EDGESPEC_CACHE_DIR there to time other runs (a bench with --learned-priors) from it")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.keep_learned and args.keep_learned.exists():
        parser.error(f"--keep-learned {args.keep_learned} exists: name a new directory")
    if args.runs < 1 or args.held_out < 0 or args.repeats < 1:
        parser.error("--runs and --repeats must be at least 1, --held-out at least 0")
    if args.learn_on and not args.held_out:
        parser.error("--learn-on times held-out prompts after another kind's runs: add --held-out N")
    by_kind = [one_kind(kind, args) for kind in args.kinds.split(",")]
    rows = [row for kind_rows, _ in by_kind for row in kind_rows]
    held_out = [check for _, checks in by_kind for check in checks]
    summary = {}
    for kind in dict.fromkeys(row["kind"] for row in rows):
        mine = [row for row in rows if row["kind"] == kind]
        # Runs cycle through the kind's prompts, so run 1 and run 10 are different prompts: each prompt's
        # own runs, in order, are what says whether the priors helped it.
        prompt_ids = dict.fromkeys(r["prompt_id"] for r in mine)
        by_prompt = {pid: [r["ratio"] for r in mine if r["prompt_id"] == pid] for pid in prompt_ids}
        summary[kind] = {"first": mine[0]["ratio"], "last": mine[-1]["ratio"], "runs": len(mine),
                         "median_after_first": statistics.median(r["ratio"] for r in mine[1:]) if len(mine) > 1 else None,
                         "by_prompt": by_prompt}
        print(f"{kind:14s} first x{mine[0]['ratio']:.2f}  run {len(mine)} x{mine[-1]['ratio']:.2f}", file=sys.stderr)
        for pid, ratios in by_prompt.items():
            print(f"  {pid:14s} " + ", ".join(f"x{r:.2f}" for r in ratios), file=sys.stderr)
    exact = all(row["same_tokens"] for row in rows + held_out)
    print(json.dumps({"summary": summary, "same_tokens": exact}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "same_tokens": exact, "runs": rows,
                                         "held_out": held_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
