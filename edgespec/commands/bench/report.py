"""The bench's results: summary rows, the overhead summary, the tables and the plots."""

from __future__ import annotations

import statistics
from pathlib import Path

from .against_peers import print_against_peers
from .configs import BenchConfig
from .workloads import BenchError


def summarize(runs: list[dict], plan: list[BenchConfig]) -> list[dict]:
    """One row per temperature, suite ("all" included) and configuration."""
    rows = []
    temperatures = sorted({r["temperature"] for r in runs})
    suites = list(dict.fromkeys(r["suite"] for r in runs)) + ["all"]
    for temperature in temperatures:
        for suite in suites:
            chosen = [r for r in runs if r["temperature"] == temperature and suite in ("all", r["suite"])]
            baseline = [r for r in chosen if r["config"] == "baseline"]
            for config in plan:
                mine = [r for r in chosen if r["config"] == config.name]
                if mine:
                    rows.append(summary_row(temperature, suite, config, mine, baseline))
    return rows


def summary_row(temperature: float, suite: str, config: BenchConfig, runs: list[dict], baseline: list[dict]) -> dict:
    tps = [r["decode_tokens_per_second"] for r in runs]
    base_tps = statistics.median(r["decode_tokens_per_second"] for r in baseline)
    speedup = statistics.median(tps) / base_tps if base_tps else None
    per_prompt = _per_prompt_speedups(runs, baseline)
    paired = paired_speedups(runs, baseline)
    prefill_share = _prefill_share(baseline)
    e2e = statistics.median(r["end_to_end_seconds"] for r in runs)
    base_e2e = statistics.median(r["end_to_end_seconds"] for r in baseline)
    matches = [r["matches_baseline"] for r in runs if r.get("matches_baseline") is not None]
    return {
        "temperature": temperature,
        "suite": suite,
        "config": config.name,
        "drafter": config.drafter,
        "draft_tokens": config.draft_tokens,
        "runs": len(runs),
        "prompts": len({r["prompt_id"] for r in runs}),
        "decode_tps_median": statistics.median(tps),
        "decode_tps_min": min(tps),
        "decode_tps_max": max(tps),
        "speedup": speedup,
        "speedup_per_prompt_median": statistics.median(per_prompt) if per_prompt else None,
        "speedup_per_prompt_q1": _quantile(per_prompt, 0.25),
        "speedup_per_prompt_q3": _quantile(per_prompt, 0.75),
        "speedup_paired_median": statistics.median(paired) if paired else None,
        "speedup_paired_q1": _quantile(paired, 0.25),
        "speedup_paired_q3": _quantile(paired, 0.75),
        "paired_runs": len(paired),
        "acceptance_rate": _pooled(runs, "draft_tokens_accepted", "draft_tokens_proposed"),
        "target_passes_per_token": _pooled(runs, "target_forward_passes", "tokens_generated"),
        "mean_draft_tokens": _pooled(runs, "draft_tokens_proposed", "steps"),
        "prefill_seconds_median": statistics.median(r["prefill_seconds"] for r in runs),
        "decode_seconds_median": statistics.median(r["decode_seconds"] for r in runs),
        "end_to_end_seconds_median": e2e,
        "end_to_end_speedup": base_e2e / e2e if e2e else None,
        "baseline_prefill_share": prefill_share,
        "end_to_end_bound": end_to_end_bound(prefill_share, speedup) if speedup else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "matches_baseline": (sum(matches) / len(matches)) if matches else None,
    }


def end_to_end_bound(prefill_share: float, decode_speedup: float) -> float:
    """Amdahl: the overall speedup when only the decode share (1 - f) gets faster by s."""
    return 1.0 / (prefill_share + (1.0 - prefill_share) / decode_speedup)


def _per_prompt_speedups(runs: list[dict], baseline: list[dict]) -> list[float]:
    ratios = []
    for prompt_id in dict.fromkeys(r["prompt_id"] for r in runs):
        mine = [r["decode_tokens_per_second"] for r in runs if r["prompt_id"] == prompt_id]
        base = [r["decode_tokens_per_second"] for r in baseline if r["prompt_id"] == prompt_id]
        if mine and base and statistics.median(base) > 0:
            ratios.append(statistics.median(mine) / statistics.median(base))
    return ratios


def paired_speedups(runs: list[dict], baseline: list[dict]) -> list[float]:
    """Each run's decode tok/s over the baseline run of the same prompt, temperature and repeat.

    The bench interleaves its configurations, so a repeat's baseline run is the plain run nearest in
    time: a machine whose speed drifts between repeats (other work, clocks, heat) moves both runs of a
    pair alike, and the median of these ratios is not swayed by which repeats ran fast, as a ratio of
    medians over all repeats is.  Runs without a partner are left out.
    """
    plain = {(r["temperature"], r["prompt_id"], r["repeat"]): r["decode_tokens_per_second"] for r in baseline}
    ratios = []
    for r in runs:
        base = plain.get((r["temperature"], r["prompt_id"], r["repeat"]))
        if base:
            ratios.append(r["decode_tokens_per_second"] / base)
    return ratios


def _prefill_share(baseline: list[dict]) -> float:
    total = sum(r["end_to_end_seconds"] for r in baseline)
    return sum(r["prefill_seconds"] for r in baseline) / total if total else 0.0


def _pooled(runs: list[dict], numerator: str, denominator: str) -> float | None:
    if any(r[numerator] is None or r[denominator] is None for r in runs):
        return None
    den = sum(r[denominator] for r in runs)
    return sum(r[numerator] for r in runs) / den if den else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=4, method="inclusive")[round(q * 4) - 1]


# ----------------------------------------------------------------- overhead

# PhaseClock's phases that are llama.cpp's own work; every other phase is the loop's overhead.
DECODE_PHASES = ("target_decode", "draft_decode")


def summarize_overhead(runs: list[dict], plan: list[BenchConfig], plain_step_seconds: float | None) -> list[dict]:
    """Per temperature, suite ("all" included) and configuration: milliseconds per step in each phase.

    overhead_ms is everything outside llama_decode; overhead_of_t1 divides it
    by T(1), the target's calibrated one-token pass.
    """
    rows = []
    timed = [r for r in runs if "phase_ns" in r]
    suites = list(dict.fromkeys(r["suite"] for r in timed)) + ["all"]
    for temperature in sorted({r["temperature"] for r in timed}):
        for suite in suites:
            for config in plan:
                mine = [r for r in timed if r["config"] == config.name and r["temperature"] == temperature
                        and suite in ("all", r["suite"])]
                steps = sum(r["phase_steps"] for r in mine)
                if not steps:
                    continue
                per_step = {phase: sum(r["phase_ns"][phase] for r in mine) / steps / 1e6 for phase in mine[0]["phase_ns"]}
                overhead = sum(ms for phase, ms in per_step.items() if phase not in DECODE_PHASES)
                rows.append({
                    "temperature": temperature, "suite": suite, "config": config.name, "steps": steps,
                    "phase_ms_per_step": per_step, "overhead_ms_per_step": overhead,
                    "t1_ms": plain_step_seconds * 1e3 if plain_step_seconds else None,
                    "overhead_of_t1": overhead / (plain_step_seconds * 1e3) if plain_step_seconds else None,
                })
    return rows


# ------------------------------------------------------------------- output


def _stdout_console():
    from ..console import ResultsConsole

    console = ResultsConsole()
    # A pipe or a file gets the whole table rather than 80 columns of ellipses.
    return console if console.is_terminal else ResultsConsole(width=170)


# A configuration's name is folded onto more lines rather than cut: "llamacpp-…" twice named neither peer.
# Names may fold onto more lines; a figure is never cut to "100.3-100…"
_COLUMN_STYLE = {"suite": {"justify": "left", "overflow": "fold"}, "config": {"justify": "left", "overflow": "fold"},
                 "min-max": {"justify": "right", "no_wrap": True}}


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_tables(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    meta = results["meta"]
    console.print(
        f"[bold]{Path(meta['model']).name}[/bold] on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['n_threads']} threads), {meta['repeats']} repeat{'' if meta['repeats'] == 1 else 's'}, "
        f"seed {meta['seed']}, priors {meta.get('priors', 'cold')}"
    )
    for temperature in meta["temperatures"]:
        table = Table(title=f"T = {temperature:g}" + (" (token ids checked against baseline)" if temperature == 0
                                                       else " (same as base: the baseline's tokens for the same seed, not enforced)"))
        for column in ("suite", "config", "decode tok/s", "min-max", "speedup", "per-prompt", "paired", "accept", "passes/tok",
                       "prefill s", "e2e s", "e2e speedup", "bound", "peak RSS MB", "same as base"):
            table.add_column(column, **_COLUMN_STYLE.get(column, {"justify": "right"}))
        previous_suite = None
        for row in (r for r in results["summary"] if r["temperature"] == temperature):
            if previous_suite is not None and row["suite"] != previous_suite:
                table.add_section()
            previous_suite = row["suite"]
            table.add_row(
                row["suite"],
                row["config"],
                f"{row['decode_tps_median']:.1f}",
                f"{row['decode_tps_min']:.1f}-{row['decode_tps_max']:.1f}",
                _fmt(row["speedup"], ".2f", "x"),
                _fmt(row["speedup_per_prompt_median"], ".2f", "x"),
                _fmt(row["speedup_paired_median"], ".2f", "x"),
                _fmt(row["acceptance_rate"], ".0%"),
                _fmt(row["target_passes_per_token"], ".2f"),
                _fmt(row["prefill_seconds_median"], ".2f"),
                _fmt(row["end_to_end_seconds_median"], ".2f"),
                _fmt(row["end_to_end_speedup"], ".2f", "x"),
                _fmt(row["end_to_end_bound"], ".2f", "x"),
                _fmt(row["peak_rss_mb"], ".0f"),
                _fmt(row["matches_baseline"], ".0%"),
            )
        console.print(table)
    console.print(
        "speedup: ratio of median decode tok/s to baseline's; per-prompt: median of per-prompt ratios; "
        "paired: median of each run's ratio to the baseline run of its own repeat (quartiles in the JSON), "
        "which a drift of the machine's speed between repeats does not sway; "
        "bound: 1 / (f + (1 - f) / speedup) with f the baseline's prefill share of end-to-end time"
    )
    if meta.get("llama_cpp_bin"):
        console.print(f"llamacpp-*: llama.cpp's own speculation ({meta['llama_cpp_bin']}), on the same rendered prompts; "
                      "same as base: its text is the baseline's (it may run a few tokens past max tokens), not enforced")
    ties = results.get("near_ties") or []
    if ties:
        console.print(
            f"{len(ties)} T=0 run(s) left the baseline at a near-tie of the target's two best tokens "
            f"(closer than {ties[0]['drift_bound']:.2f} logits, twice the drift measured between pass widths); "
            "every other run matched it token for token"
        )
    print_against_peers(results.get("against_peers") or [], console)


def print_overhead(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    phases = [p for p in results["overhead"][0]["phase_ms_per_step"] if p not in DECODE_PHASES] if results["overhead"] else []
    for temperature in results["meta"]["temperatures"]:
        table = Table(title=f"T = {temperature:g}: milliseconds per step outside llama_decode")
        for column in ("suite", "config", "steps", "llama_decode", *phases, "overhead", "of T(1)"):
            table.add_column(column, **_COLUMN_STYLE.get(column, {"justify": "right"}))
        for row in (r for r in results["overhead"] if r["temperature"] == temperature):
            ms = row["phase_ms_per_step"]
            table.add_row(row["suite"], row["config"], str(row["steps"]),
                          f"{sum(ms[p] for p in DECODE_PHASES):.2f}", *(f"{ms[p]:.3f}" for p in phases),
                          f"{row['overhead_ms_per_step']:.3f}", _fmt(row["overhead_of_t1"], ".1%"))
        console.print(table)
    console.print("llama_decode: target and draft passes; logits: filling the batch and mapping the output rows; "
                  "verify: to_probs and rejection sampling; of T(1): overhead over the calibrated one-token pass")


def print_sampling(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    table = Table(title=f"sampling one row of a {results['n_vocab']:,}-token vocabulary (best of {results['repeats']} "
                        f"passes over {results['rows']} rows)")
    table.add_column("case")
    table.add_column("ms per row", justify="right")
    for name, ms in results["ms_per_row"].items():
        table.add_row(name, f"{ms:.3f}")
    console.print(table)


def print_cost_curve(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    meta = results["meta"]
    table = Table(title=f"target forward pass cost, {Path(meta['model']).name}, after {meta['context_tokens']} tokens of context")
    for column in ("tokens", "median ms", "min-max ms", "T(n)/T(1)", "ms per token"):
        table.add_column(column, justify="right")
    for p in results["cost_curve"]:
        table.add_row(str(p["tokens"]), f"{p['median_ms']:.1f}", f"{p['min_ms']:.1f}-{p['max_ms']:.1f}",
                      f"{p['relative_to_one']:.2f}", f"{p['ms_per_token']:.2f}")
    console.print(table)


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BenchError("--plot needs matplotlib (install it with: pip install 'edgespec[bench]')") from err
    return plt


def plot_speedups(results: dict, path: Path) -> None:
    """Per-prompt median speedup per suite and configuration; error bars span the per-prompt quartiles."""
    plt = pyplot()
    temperatures = results["meta"]["temperatures"]
    configs = [c["name"] for c in results["configs"] if c["name"] != "baseline"]
    suites = list(dict.fromkeys(r["suite"] for r in results["summary"]))
    fig, axes = plt.subplots(len(temperatures), 1, figsize=(max(8, 1.6 * len(suites) * max(1, len(configs)) / 3), 4 * len(temperatures)), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for ax, temperature in zip(axes[:, 0], temperatures):
        rows = {(r["suite"], r["config"]): r for r in results["summary"] if r["temperature"] == temperature}
        for i, config in enumerate(configs):
            xs, ys, low, high = [], [], [], []
            for j, suite in enumerate(suites):
                row = rows.get((suite, config))
                if row is None or row["speedup_per_prompt_median"] is None:
                    continue
                xs.append(j + (i - (len(configs) - 1) / 2) * width)
                ys.append(row["speedup_per_prompt_median"])
                low.append(row["speedup_per_prompt_median"] - row["speedup_per_prompt_q1"])
                high.append(row["speedup_per_prompt_q3"] - row["speedup_per_prompt_median"])
            ax.bar(xs, ys, width, yerr=[low, high], capsize=2, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(suites)), suites)
        ax.set_ylabel("decode speedup vs baseline")
        ax.set_title(f"{Path(results['meta']['model']).name}, T = {temperature:g}")
        if configs:  # with the baseline alone there is no bar to name (matplotlib refused ncol=0)
            ax.legend(fontsize="small", ncol=min(4, len(configs)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost_curve(results: dict, path: Path) -> None:
    plt = pyplot()
    points = results["cost_curve"]
    ns = [p["tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [p["relative_to_one"] for p in points], marker="o", label="measured T(n) / T(1)")
    ax.plot(ns, ns, linestyle="--", color="grey", label="no batching gain (n single passes)")
    ax.axhline(1.0, linestyle=":", color="grey", label="free verification")
    ax.set_xlabel("tokens in one target forward pass (k drafts + 1)")
    ax.set_ylabel("cost in single-token passes")
    ax.set_title(f"{Path(results['meta']['model']).name}: forward pass cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
