"""`edgespec plan`: how the models would be placed in memory, and which drafting mode, without loading them."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..errors import flag_worded
from ..heads.attach import trained_heads
from ..loading import plan_load
from ..notices import print_notice
from .options import add_engine_options, add_prompt_cache_ram_option, refuse_engine_flags_that_cannot_go_together, setting


def add_plan_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="show how the models would be placed in memory, and which drafting mode")
    add_engine_options(parser)
    parser.add_argument("--ctx", dest="n_ctx", type=setting("n_ctx"), help="alias of --n-ctx")
    parser.add_argument("--parallel", type=setting("parallel"), default=1, metavar="N",
                        help="count a target KV cache for each of N sequences decoded together, as "
                             "`edgespec batch --parallel N` has (default: %(default)s)")
    add_prompt_cache_ram_option(parser, "0", "count the RAM that `edgespec serve --prompt-cache-ram SIZE` keeps "
                                "for prompt snapshots (default: %(default)s; serve's default is 512MiB)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=plan)


def plan(args: argparse.Namespace) -> int:
    from .console import ResultsConsole

    from ..plan_table import format_plan_table

    refuse_engine_flags_that_cannot_go_together(args)  # a plan shows a setup run, batch and serve can load
    loading = plan_load(args.model, args.draft, n_ctx=args.n_ctx, n_gpu_layers=args.gpu_layers,
                        draft_gpu_layers=args.draft_gpu_layers, memory_budget=args.memory_budget,
                        kv_type=args.kv_type, draft_kv_type=args.draft_kv_type, flash_attn=args.flash_attn,
                        parallel=args.parallel, prompt_cache_ram=args.prompt_cache_ram, notice=print_notice,
                        progress=True, n_threads=args.threads, bit_exact=args.bit_exact, measure_first=True)
    memory_plan = loading.plan
    if args.draft == "heads" and trained_heads(loading.target_path) is None:  # what a run would refuse for
        target = loading.target_path
        memory_plan = dataclasses.replace(memory_plan, warnings=(
            *memory_plan.warnings,
            f"no heads are trained for {target.name}; train them with `edgespec heads train --model {target}`"))
    if args.json:
        worded = {"budget_source": flag_worded(memory_plan.budget_source),
                  "warnings": [flag_worded(warning) for warning in memory_plan.warnings]}
        print(json.dumps(memory_plan.to_dict() | worded, indent=2))
    else:
        table, console = format_plan_table(memory_plan), ResultsConsole()
        if not console.is_terminal:  # a file or a pipe: no model's name cut to "qwen2.5-coder-1.5b-inst…"
            widest = console.measure(table, options=console.options.update_width(1000)).maximum
            console = ResultsConsole(width=max(console.width, widest))
        console.print(table)
    return 0
