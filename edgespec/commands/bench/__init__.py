"""`edgespec bench`: edgespec's drafting modes against plain decoding and llama.cpp's own speculation.

See runner.py for how runs are ordered and timed.  At temperature 0 each
edgespec mode must produce exactly the baseline's token ids for the same
prompt; a mismatch stops the bench with ExactnessError, unless the target's
own logits show a near-tie there, closer than the logit drift measured between
pass widths (Engine.drift_bound), which is reported instead; a -exact
configuration (--bit-exact) gets no such allowance.  llama.cpp's peers are compared by text and only reported.

Decode speed is tokens generated / decode time.  The end-to-end speedup is
bounded by the prefill share f of the baseline: 1 / (f + (1 - f) / s) for a
decode speedup s; the summary reports that bound next to the measured figure.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from ...errors import EdgespecError
from ...files import write_named_output
from ..stop_signals import sigterm_as_ctrl_c
from ..options import DEFAULT_MODEL, parse_flash_attn, parse_kv_type, parse_threads, sampling_value, setting, whole_number
from .configs import DEFAULT_CONFIGS, PEER_SPEC_TYPES, PLAIN_AGAIN
from .exactness import ExactnessError
from .microbench import COST_CURVE_MAX_TOKENS, DEFAULT_N_CTX, SAMPLING_VOCAB, run_cost_curve, run_sampling_microbench
from .report import (pyplot, plot_cost_curve, plot_speedups, print_cost_curve, print_overhead, print_sampling,
                     print_tables)
from .runner import DEFAULT_REPEATS, DEFAULT_SEED, DEFAULT_TEMPERATURES, run_bench
from .workloads import SUITES, WORKLOADS_DIR, BenchError

EXIT_OK = 0
EXIT_EXACTNESS_FAILED = ExactnessError.exit_code
EXIT_REFUSED = BenchError.exit_code
EXIT_INTERRUPTED = 130  # as the other commands end on Ctrl+C


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure edgespec's drafting modes against plain decoding and llama.cpp's own speculation",
        description=(
            "Run workload suites through every configuration on one loaded model, with the order rotated per "
            "prompt, and report decode speed, speedup, acceptance and latency. At temperature 0 every edgespec "
            "mode must reproduce the baseline's tokens, or the bench fails; a difference where the target's two "
            "best tokens nearly tie (closer than llama.cpp's kernels drift between pass widths) is reported instead. "
            "With --llama-cpp-bin, llama.cpp's own speculation runs on the same prompts as peers (llamacpp-*). "
            "Exit codes: 0 done, 1 exactness check failed, 2 refused (bad options, model failed to load), "
            "130 interrupted (the tables and --json hold the runs measured until Ctrl+C or SIGTERM)."
        ),
    )
    _add_prompt_options(parser.add_argument_group("prompts: which, how many times, how sampled"))
    _add_comparison_options(parser.add_argument_group("what is compared"))
    _add_engine_options(parser.add_argument_group("engine"))
    _add_output_options(parser.add_argument_group("output, and measurements instead of the bench"))
    parser.set_defaults(func=handle_bench)


def _add_prompt_options(group) -> None:
    group.add_argument("--workloads", type=Path, default=WORKLOADS_DIR, metavar="DIR",
                       help="folder of <suite>.jsonl files of prompts (default: the built-in workloads)")
    group.add_argument("--suites", default=None,
                       help="comma-separated suites (default: every <suite>.jsonl of prompts in --workloads; the "
                            f"built-in folder holds {','.join(SUITES)})")
    group.add_argument("--prompts", type=whole_number(1), default=None, metavar="N",
                       help="use the first N prompts of each suite")
    group.add_argument("--repeats", type=whole_number(1), default=DEFAULT_REPEATS,
                       help=f"runs per prompt and configuration (default: {DEFAULT_REPEATS})")
    group.add_argument("--temperature", type=sampling_value("temperature", float), action="append", default=None,
                       help="sampling temperature; repeat the flag for several (default: 0 and 0.7)")
    group.add_argument("--seed", type=sampling_value("seed", int), default=DEFAULT_SEED,
                       help=f"seed of the first repeat; repeat i uses seed+i (default: {DEFAULT_SEED})")
    group.add_argument("--max-tokens", type=sampling_value("max_tokens", int), default=None,
                       help="override every prompt's max_tokens")


def _add_comparison_options(group) -> None:
    group.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help="target GGUF: a path or a catalog name (default: %(default)s)")
    group.add_argument("--draft", default=None,
                       help="draft GGUF (path or catalog name) for the draft-model configurations, "
                            "or 'heads' for the heads configurations (heads trained with `edgespec heads train`)")
    group.add_argument(
        "--configs",
        default=None,
        help="comma-separated configurations: baseline, ngram, draft-model, each optionally -kN (fixed draft "
        f"length) or -auto; {PLAIN_AGAIN} (plain decoding again: the same run's A/A noise floor); "
        f"{', '.join(PEER_SPEC_TYPES)}, each optionally -nN (drafts of at most N tokens) "
        f"(default: {','.join(DEFAULT_CONFIGS)}; draft-model and llamacpp-draft only with --draft, "
        "llamacpp-* only with --llama-cpp-bin)",
    )
    group.add_argument("--llama-cpp-bin", type=Path, default=None, metavar="DIR",
                       help="folder with llama.cpp's llama-speculative-simple (benchmarks/build_llama_cpp_peer.sh "
                            "prints it): adds the llamacpp-* configurations")
    group.add_argument("--learned-priors", action="store_true",
                       help="start every run from what this model's drafters learned here before (edgespec models "
                            "forget-learning resets it) instead of the neutral built-in priors; the results say which")


def _add_engine_options(group) -> None:
    group.add_argument("--n-ctx", type=setting("n_ctx"), default=DEFAULT_N_CTX,
                       help=f"context length (default: {DEFAULT_N_CTX})")
    group.add_argument("--threads", type=parse_threads, default=None,
                       help="CPU threads for every configuration (default: as the engine)")
    group.add_argument("--kv-type", type=parse_kv_type, default="f16",
                       help="the KV cache type of the target and the draft, f16|q8_0|q4_0, keys only without flash attention "
                            "(default: f16); llama.cpp's peers keep f16")
    group.add_argument("--flash-attn", nargs="?", const="on", default="auto", type=parse_flash_attn,
                       metavar="auto|on|off",
                       help="flash attention for edgespec's configurations; auto (the default) runs it, as "
                            "the other commands and llama.cpp's peers do, unless an -exact configuration is "
                            "asked for (the defaults hold ngram-exact), which needs it off; on cannot go "
                            "with those (--flash-attn alone: on)")


def _add_output_options(group) -> None:
    group.add_argument("--json", type=Path, default=None, metavar="FILE",
                       help="write every run and the summary as JSON")
    group.add_argument("--plot", type=Path, default=None, metavar="PNG",
                       help="plot speedups (or the cost curve); needs edgespec[bench]")
    group.add_argument("--cost-curve", action="store_true",
                       help=f"only measure the target's time per forward pass over 1..{COST_CURVE_MAX_TOKENS} tokens")
    group.add_argument("--overhead", action="store_true",
                       help="also report the milliseconds per step spent outside llama_decode, per phase of the loop, "
                            "and the sampling microbenchmark")
    group.add_argument("--sampling", action="store_true",
                       help=f"only time to_probs + sample per row over a {SAMPLING_VOCAB:,}-token vocabulary (no model)")


def handle_bench(args) -> int:
    """0 when done, 130 when Ctrl+C cut it short (what it measured is reported); an error ends the bench with its
    exit code (1: exactness failed, 2: refused)."""
    try:
        return _bench_command(args)
    except (ExactnessError, BenchError):
        raise
    except EdgespecError as err:  # e.g. the model failed to load: the bench is refused
        raise BenchError(*err.message) from None


def _bench_command(args) -> int:
    if args.plot:
        plotting = pyplot()  # fail before the long part, not after it
        figure = plotting.figure()
        formats = figure.canvas.get_supported_filetypes()
        plotting.close(figure)
        if args.plot.suffix.lower().lstrip(".") not in formats:  # else a traceback after every run was measured
            raise BenchError(f"--plot {args.plot}: give a file name ending in an image type matplotlib writes, "
                             f"e.g. .png, .svg or .pdf (not {args.plot.suffix or 'no suffix'})")
    for output in filter(None, (args.json, args.plot)):
        _check_writable(output)
    if args.configs is not None and not _split(args.configs):  # "" ran the default set, ",," asked for llama.cpp
        raise BenchError("--configs names no configuration: give one or more, comma-separated, or leave it out "
                         "for the default set")
    if args.sampling:
        results = {"meta": {}, "sampling": run_sampling_microbench()}
        print_sampling(results["sampling"])
    elif args.cost_curve:
        results = run_cost_curve(args.model, repeats=args.repeats, n_ctx=args.n_ctx, n_threads=args.threads,
                                 workloads_dir=args.workloads)
        print_cost_curve(results)
    else:
        with sigterm_as_ctrl_c():  # `timeout` and kill keep the runs measured, as Ctrl+C does
            results = run_bench(
                args.model,
                args.draft,
                suites=_split(args.suites) if args.suites else None,
                configs=_split(args.configs) if args.configs is not None else None,
                repeats=args.repeats,
                prompts_per_suite=args.prompts,
                temperatures=args.temperature or DEFAULT_TEMPERATURES,
                seed=args.seed,
                n_ctx=args.n_ctx,
                n_threads=args.threads,
                max_tokens=args.max_tokens,
                workloads_dir=args.workloads,
                on_run=lambda run, done, total: print(_progress_line(run, done, total), file=sys.stderr, flush=True),
                overhead=args.overhead,
                llama_cpp_bin=args.llama_cpp_bin,
                kv_type=args.kv_type,
                flash_attn=args.flash_attn,
                learned_priors=args.learned_priors,
            )
        print_tables(results)
        if args.overhead:
            print_overhead(results)
            results["sampling"] = run_sampling_microbench()
            print_sampling(results["sampling"])
    results["meta"]["command"] = shlex.join(["edgespec", *sys.argv[1:]])
    if args.json:
        _write_json(args.json, results)
    if args.plot and not args.sampling:
        (plot_cost_curve if args.cost_curve else plot_speedups)(results, args.plot)
    if results["meta"].get("interrupted"):
        print(f"edgespec bench: interrupted after {len(results['runs'])} of {results['meta']['runs_planned']} runs; "
              "the tables above" + (f" and {args.json}" if args.json else "") + " hold them", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _check_writable(output: Path) -> None:
    """BenchError now, not after the whole bench, when output could not be written."""
    if output.is_dir():
        raise BenchError(f"{output} is a directory; give a file path, e.g. {output / 'bench.json'}")
    if not output.parent.is_dir():
        raise BenchError(f"{output}: there is no folder {output.parent}; create it, or write the results elsewhere")
    if not os.access(output.parent, os.W_OK | os.X_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise BenchError(f"cannot write {output}: permission denied; write the results elsewhere")


def _write_json(output: Path, results: dict) -> None:
    """The results, whole or not at all: an earlier file at output stays as it was if the write fails."""
    try:
        write_named_output(output, json.dumps(results, indent=1) + "\n")
    except OSError as error:
        raise BenchError(f"cannot write {output}: {error.strerror or error}; the tables above hold the results") from None


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _progress_line(run: dict, done: int, total: int) -> str:
    return (
        f"[{done}/{total}] T={run['temperature']:g} {run['prompt_id']} {run['config']}: "
        f"{run['decode_tokens_per_second']:.1f} tok/s, {run['tokens_generated']} tokens"
    )
