"""`edgespec bench`: edgespec's drafting modes against plain decoding and a peer, in one process.

The target is loaded once; every configuration runs on that same model, with
drafting switched between runs (``Engine.configure``).
The only exception is the peer, llama-cpp-python's own prompt lookup, which
needs its own ``llama_cpp.Llama`` (``backend.PromptLookupPeer``), loaded once too.
For each prompt the configuration order is rotated, so drift (thermal, page
cache, other load) hits every configuration alike.  Every run starts with a
cold KV cache, so prefill is always paid in full and measured.

At temperature 0 each edgespec mode must produce exactly the baseline's token
ids for the same prompt; a mismatch stops the bench with ExactnessError,
unless the target's own logits show a near-tie there (see KERNEL_DRIFT_LOGITS),
which is reported instead.

Decode speed is tokens generated / decode time.  The end-to-end speedup is
bounded by the prefill share f of the baseline: 1 / (f + (1 - f) / s) for a
decode speedup s; the summary reports that bound next to the measured figure.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

from .errors import EdgespecError
from .sampling import SamplingParams

WORKLOADS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads"
SUITES = ("code-edit", "summarize", "qa-context", "chat", "creative")
DEFAULT_TEMPERATURES = (0.0, 0.7)
DEFAULT_REPEATS = 3
DEFAULT_SEED = 1234
DEFAULT_N_CTX = 2048
DRAFTERS = ("baseline", "ngram", "draft-model", "peer")
# "ngram" and "draft-model" alone mean the engine's default draft length.
DEFAULT_CONFIGS = ("baseline", "ngram", "ngram-k2", "ngram-k4", "ngram-k8", "draft-model", "peer")
PEER_DEFAULT_DRAFT_TOKENS = 4
COST_CURVE_MAX_TOKENS = 16
EXIT_OK = 0
EXIT_EXACTNESS_FAILED = 1
EXIT_REFUSED = 2


class BenchError(EdgespecError):
    """The bench cannot run as asked: unknown suite or configuration, bad workload file."""


class ExactnessError(EdgespecError):
    """At temperature 0 a speculative mode produced tokens different from plain decoding."""


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    id: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class BenchConfig:
    name: str  # as shown in tables: baseline, ngram-k4, ngram-auto, draft-model-k4, peer-k4
    drafter: str  # one of DRAFTERS
    draft_tokens: int | str | None  # None for baseline; "auto" where the engine chooses

    @property
    def must_match_baseline(self) -> bool:
        return self.drafter in ("ngram", "draft-model")


# ------------------------------------------------------------------ workloads


def load_workloads(
    suites: Iterable[str] = SUITES, per_suite: int | None = None, directory: Path = WORKLOADS_DIR
) -> list[BenchPrompt]:
    prompts = []
    for suite in suites:
        path = Path(directory) / f"{suite}.jsonl"
        if not path.is_file():
            raise BenchError(f"no workload file for suite {suite!r} at {path} (suites: {', '.join(SUITES)})")
        prompts.extend(_read_suite(suite, path)[:per_suite])
    return prompts


def _read_suite(suite: str, path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(BenchPrompt(suite, str(row["id"]), str(row["prompt"]), int(row.get("max_tokens", 128))))
        except (ValueError, KeyError, TypeError) as err:
            raise BenchError(f"{path}:{number} is not a workload line ({err}); expected {{\"id\", \"prompt\", \"max_tokens\"}}") from err
    return prompts


# ------------------------------------------------------------ configurations


def parse_config(name: str) -> tuple[str, int | str | None]:
    """'ngram-k4' -> ('ngram', 4); 'ngram-auto' -> ('ngram', 'auto'); 'ngram' -> ('ngram', None)."""
    for drafter in DRAFTERS:
        if name == drafter:
            return drafter, None
        suffix = name[len(drafter) + 1 :] if name.startswith(drafter + "-") else None
        if drafter == "baseline" or suffix is None:
            continue
        if suffix == "auto" and drafter != "peer":
            return drafter, "auto"
        if suffix.startswith("k") and suffix[1:].isdigit() and int(suffix[1:]) >= 1:
            return drafter, int(suffix[1:])
    raise BenchError(
        f"unknown configuration {name!r} (use baseline, ngram, draft-model or peer, optionally with -kN, or -auto for ngram/draft-model)"
    )


def resolve_configs(names: Iterable[str], default_draft_tokens: int | str, has_draft: bool, explicit: bool) -> list[BenchConfig]:
    """Configurations with their draft lengths settled; duplicates dropped, keeping the first.

    Without --configs, draft-model is skipped when no draft model is given;
    asked for explicitly, it is an error.
    """
    configs: dict[tuple, BenchConfig] = {}
    for name in names:
        drafter, k = parse_config(name)
        if drafter == "draft-model" and not has_draft:
            if explicit:
                raise BenchError(
                    f"configuration {name!r} needs a draft model and none is loaded (pass --draft FILE, or drop {name})"
                )
            continue
        if drafter == "baseline":
            config = BenchConfig("baseline", "baseline", None)
        else:
            k = k if k is not None else (PEER_DEFAULT_DRAFT_TOKENS if drafter == "peer" else default_draft_tokens)
            label = f"{drafter}-auto" if k == "auto" else f"{drafter}-k{k}"
            config = BenchConfig(label, drafter, k)
        configs.setdefault((config.drafter, config.draft_tokens), config)
    if not any(c.drafter == "baseline" for c in configs.values()):
        configs[("baseline", None)] = BenchConfig("baseline", "baseline", None)  # speedups need it
    return list(configs.values())


def rotated(configs: list[BenchConfig], by: int) -> list[BenchConfig]:
    shift = by % len(configs)
    return configs[shift:] + configs[:shift]


# ---------------------------------------------------------------- measuring


def run_bench(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    suites: Iterable[str] = SUITES,
    configs: Iterable[str] | None = None,
    repeats: int = DEFAULT_REPEATS,
    prompts_per_suite: int | None = None,
    temperatures: Iterable[float] = DEFAULT_TEMPERATURES,
    seed: int = DEFAULT_SEED,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    max_tokens: int | None = None,
    workloads_dir: Path = WORKLOADS_DIR,
    on_run: Callable[[dict, int, int], None] | None = None,
    overhead: bool = False,
) -> dict:
    """Run the bench and return everything as one JSON-ready dict (meta, configs, runs, summary).

    With overhead=True every edgespec run also records where its decode time
    went, per phase of the loop (engine.PhaseClock), and the result gains an
    "overhead" summary.  Raises ExactnessError at the first temperature-0
    mismatch with the baseline.
    """
    from .backend import default_threads
    from .engine import Engine

    if repeats < 1:
        raise BenchError("--repeats must be at least 1")
    temperatures = tuple(temperatures)
    prompts = load_workloads(suites, prompts_per_suite, workloads_dir)
    if max_tokens is not None:
        prompts = [BenchPrompt(p.suite, p.id, p.prompt, max_tokens) for p in prompts]
    n_threads = n_threads or default_threads()
    started = time.time()
    load_at_start = _load_average()
    engine = Engine.load(model, draft if draft else "ngram", n_ctx=n_ctx, n_threads=n_threads)
    peer = None
    try:
        plan = resolve_configs(configs or DEFAULT_CONFIGS, engine.draft_tokens, engine.draft is not None, configs is not None)
        if any(c.drafter == "peer" for c in plan):
            from .backend import PromptLookupPeer

            peer = PromptLookupPeer(
                engine.target_path, n_ctx=engine.n_ctx, n_threads=n_threads, n_gpu_layers=engine.target.n_gpu_layers
            )
        runner = _Runner(engine, peer, overhead)
        runner.warm_up(prompts[0], plan)
        runs = _measure(runner, plan, prompts, temperatures, repeats, seed, on_run)
    finally:
        if peer is not None:
            peer.close()
        engine.close()
    results = {
        "meta": {
            **_meta(engine.target_path, engine.draft_path, prompts, repeats, temperatures, seed, n_ctx, n_threads, started,
                    runner.rss_scope, peer is not None),
            # other work on the machine distorts every figure; a quiet machine shows ~0 next to its core count
            "load_average_start": load_at_start,
            "load_average_end": _load_average(),
        },
        "configs": [{"name": c.name, "drafter": c.drafter, "draft_tokens": c.draft_tokens} for c in plan],
        "runs": runs,
        "near_ties": runner.near_ties,
        "summary": summarize(runs, plan),
    }
    if overhead:
        results["overhead"] = summarize_overhead(runs, plan, engine.plain_step_seconds)
    return results


def _measure(runner, plan, prompts, temperatures, repeats, seed, on_run) -> list[dict]:
    """Every prompt x repeat x configuration, the order rotated per prompt and repeat."""
    runs: list[dict] = []
    total = len(temperatures) * len(prompts) * repeats * len(plan)
    for temperature in temperatures:
        for index, prompt in enumerate(prompts):
            prompt_runs = []
            for repeat in range(repeats):
                for config in rotated(plan, index + repeat):
                    prompt_runs.append(runner.run(prompt, config, temperature, repeat, seed + repeat))
                    if on_run:
                        on_run(prompt_runs[-1], len(runs) + len(prompt_runs), total)
            if temperature == 0:
                for tie in check_exactness(prompt_runs, runner.engine.plain_logits):
                    runner.near_ties.append(tie)
                    if on_run:
                        print(f"near-tie, not a bug: {tie['config']} on {tie['prompt_id']} differs at token "
                              f"{tie['position']}, where the target's two best logits are {tie['logit_gap']:.2f} apart",
                              file=sys.stderr)
            runs.extend(prompt_runs)
    return runs


class _Runner:
    def __init__(self, engine, peer, overhead: bool = False):
        self.engine = engine
        self.peer = peer
        self.overhead = overhead
        self._prompt_ids: dict[str, list[int]] = {}
        self.near_ties: list[dict] = []
        self.rss_scope = "run" if _reset_peak_rss() else "process"

    def warm_up(self, prompt: BenchPrompt, plan: list[BenchConfig]) -> None:
        """Touch the model's pages and code paths once before anything is timed."""
        short = BenchPrompt(prompt.suite, prompt.id, prompt.prompt, 8)
        for config in plan:
            self.run(short, config, 0.0, 0, 0)

    def run(self, prompt: BenchPrompt, config: BenchConfig, temperature: float, repeat: int, seed: int) -> dict:
        ids = self._prompt_ids.get(prompt.id)
        if ids is None:
            ids = self._prompt_ids[prompt.id] = self.engine.prompt_tokens(prompt.prompt)
        params = SamplingParams(temperature=temperature, max_tokens=prompt.max_tokens, seed=seed)
        _reset_peak_rss()
        if config.drafter == "peer":
            figures = self._run_peer(ids, params, config)
        else:
            figures = self._run_edgespec(ids, params, config)
        return {
            "suite": prompt.suite,
            "prompt_id": prompt.id,
            "config": config.name,
            "temperature": temperature,
            "repeat": repeat,
            "seed": seed,
            "prompt_ids": ids,
            **figures,
            "end_to_end_seconds": figures["prefill_seconds"] + figures["decode_seconds"],
            "peak_rss_mb": _peak_rss_mb(),
            "matches_baseline": None,  # set by check_exactness at temperature 0
        }

    def _run_edgespec(self, ids: list[int], params: SamplingParams, config: BenchConfig) -> dict:
        from .engine import Done, PhaseClock

        engine = self.engine
        engine.configure(mode="none" if config.drafter == "baseline" else config.drafter)
        if config.draft_tokens is not None:
            engine.configure(draft_tokens=config.draft_tokens)
        engine.forget_cache()  # a bench run must pay (and time) its prefill in full
        clock = engine.phase_clock = PhaseClock(engine.target, engine.draft) if self.overhead else None
        result = None
        try:
            for event in engine.stream_tokens(ids, params):
                if isinstance(event, Done):
                    result = event.result
        finally:
            engine.phase_clock = None
        stats = result.stats
        return {
            **({"phase_ns": dict(clock.ns), "phase_steps": clock.steps} if clock else {}),
            "prompt_tokens": stats.prompt_tokens,
            "prompt_tokens_evaluated": stats.prompt_tokens_evaluated,
            "tokens_generated": stats.tokens_generated,
            "finish_reason": result.finish_reason,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "decode_tokens_per_second": stats.decode_tokens_per_second,
            "draft_tokens_proposed": stats.draft_tokens_proposed,
            "draft_tokens_accepted": stats.draft_tokens_accepted,
            "acceptance_rate": stats.acceptance_rate if config.drafter != "baseline" else None,
            "target_forward_passes": stats.target_forward_passes,
            "target_passes_per_token": stats.target_passes_per_token,
            "mean_draft_tokens": stats.mean_draft_tokens,
            "k0_steps": stats.k0_steps,
            "steps": stats.steps,
            "token_ids": list(result.token_ids),
            "text": result.text,
        }

    def _run_peer(self, ids: list[int], params: SamplingParams, config: BenchConfig) -> dict:
        self.peer.set_draft_tokens(config.draft_tokens)
        result = self.peer.generate(ids, params)
        # The first token arrives with the prefill, so the decode phase covers the rest.
        decode_tokens = max(result.tokens_generated - 1, 0)
        return {
            "prompt_tokens": len(ids),
            "prompt_tokens_evaluated": len(ids),
            "tokens_generated": result.tokens_generated,
            "finish_reason": result.finish_reason,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "decode_tokens_per_second": decode_tokens / result.decode_seconds if result.decode_seconds > 0 else 0.0,
            "draft_tokens_proposed": None,
            "draft_tokens_accepted": None,
            "acceptance_rate": None,
            "target_forward_passes": None,
            "target_passes_per_token": None,
            "mean_draft_tokens": None,
            "k0_steps": None,
            "steps": None,
            "token_ids": None,  # llama-cpp-python's stream gives text only
            "text": result.text,
        }


# llama.cpp's CPU kernels do not give a token bit-identical logits in a pass of
# one token and in a wider verification pass on every model: on
# Qwen2.5-Coder-1.5B Q4_K_M the two differ by up to 0.47 in a logit (0.0 on
# SmolLM2 and the tests' tiny models).  Where the target's two best tokens are
# closer than this, plain and speculative greedy decoding may each pick one.
KERNEL_DRIFT_LOGITS = 0.75


def check_exactness(prompt_runs: list[dict], plain_logits=None) -> list[dict]:
    """Every temperature-0 run of an edgespec mode must equal the first baseline run, token for token.

    A mismatch raises ExactnessError, unless plain_logits(ids) shows that the
    target itself nearly ties the two tokens there (within KERNEL_DRIFT_LOGITS):
    such near-ties are returned, so the report can count them.
    """
    reference = next(r for r in prompt_runs if r["config"] == "baseline")
    near_ties = []
    for run in prompt_runs:
        if run["token_ids"] is None:
            run["matches_baseline"] = run["text"] == reference["text"]  # the peer: reported, not enforced
            continue
        position = _first_difference(reference["token_ids"], run["token_ids"])
        run["matches_baseline"] = position is None
        if position is None:
            continue
        gap = _logit_gap(plain_logits, reference, run, position)
        if gap is not None and gap < KERNEL_DRIFT_LOGITS:
            near_ties.append({"config": run["config"], "prompt_id": run["prompt_id"], "repeat": run["repeat"],
                              "position": position, "logit_gap": gap})
            continue
        raise ExactnessError(
            f"exactness check failed: {run['config']} on {run['prompt_id']} (T=0, repeat {run['repeat']}) "
            f"differs from baseline at generated token {position} "
            f"({_token_at(run['token_ids'], position)} vs baseline {_token_at(reference['token_ids'], position)}"
            + (f", {gap:.2f} logits apart" if gap is not None else "")
            + "); speculative decoding must reproduce plain greedy decoding, so this is a bug in edgespec"
        )
    return near_ties


def _logit_gap(plain_logits, reference: dict, run: dict, position: int) -> float | None:
    """How far apart the target puts the two differing tokens, or None when it cannot be told.

    A run that ended there chose an end-of-generation token, which token_ids
    leave out; the target's own best token stands in for it.
    """
    if plain_logits is None:
        return None
    logits = plain_logits(reference["prompt_ids"] + reference["token_ids"][:position])

    def logit_of(ids):
        return logits[ids[position]] if position < len(ids) else logits.max()

    return float(abs(logit_of(reference["token_ids"]) - logit_of(run["token_ids"])))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_at(ids: list[int], i: int) -> str:
    return f"token {ids[i]}" if i < len(ids) else "end of output"


# ------------------------------------------------------------------- memory


def _reset_peak_rss() -> bool:
    """Restart the process's peak-RSS counter (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


# ------------------------------------------------------------------ summary


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
                    rows.append(_summary_row(temperature, suite, config, mine, baseline))
    return rows


def _summary_row(temperature: float, suite: str, config: BenchConfig, runs: list[dict], baseline: list[dict]) -> dict:
    tps = [r["decode_tokens_per_second"] for r in runs]
    base_tps = statistics.median(r["decode_tokens_per_second"] for r in baseline)
    speedup = statistics.median(tps) / base_tps if base_tps else None
    per_prompt = _per_prompt_speedups(runs, baseline)
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


def _prefill_share(baseline: list[dict]) -> float:
    total = sum(r["end_to_end_seconds"] for r in baseline)
    return sum(r["prefill_seconds"] for r in baseline) / total if total else 0.0


def _pooled(runs: list[dict], numerator: str, denominator: str) -> float | None:
    if any(r[numerator] is None for r in runs):
        return None
    den = sum(r[denominator] for r in runs)
    return sum(r[numerator] for r in runs) / den if den else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=4, method="inclusive")[round(q * 4) - 1]


def _meta(model, draft, prompts, repeats, temperatures, seed, n_ctx, n_threads, started, rss_scope, with_peer) -> dict:
    if with_peer:
        from .backend import PEER_WORKAROUND
    return {
        "model": str(model),
        "draft": str(draft) if draft else None,
        "suites": {suite: sum(p.suite == suite for p in prompts) for suite in dict.fromkeys(p.suite for p in prompts)},
        "repeats": repeats,
        "temperatures": list(temperatures),
        "seed": seed,
        "n_ctx": n_ctx,
        "n_threads": n_threads,
        "machine": machine_description(),
        "versions": {name: _version(name) for name in ("edgespec", "llama-cpp-python")},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_seconds": time.time() - started,
        "peak_rss_scope": (
            "per run (the process's peak RSS counter is reset before each run; it still counts every loaded model)"
            if rss_scope == "run"
            else "process-wide peak since start (this kernel does not allow resetting it)"
        ),
        "decode_definition": (
            "edgespec: tokens generated / time after prefill; peer: (tokens - 1) / time after its first streamed token"
        ),
        "peer_workaround": PEER_WORKAROUND if with_peer else None,
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


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


SAMPLING_VOCAB = 151_936  # Qwen2.5's


def run_sampling_microbench(n_vocab: int = SAMPLING_VOCAB, rows: int = 200, repeats: int = 3, seed: int = 0) -> dict:
    """Milliseconds per row for to_probs + sample over realistic logits (normal * 3 plus a few peaks).

    Each case draws `rows` different rows and reports the best of `repeats`
    passes over them; also the cost of copying one row, which the engine no
    longer pays (it reads llama.cpp's buffer in place).
    """
    import numpy as np

    from .sampling import sample, to_probs

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, n_vocab)) * 3.0).astype(np.float32)
    for row in logits:
        row[rng.integers(0, n_vocab, 4)] += rng.uniform(8.0, 14.0, 4).astype(np.float32)
    cases = {
        "T=0.8 (top-k 40, top-p 0.95, min-p 0.05)": SamplingParams(temperature=0.8),
        "T=0.8, top-k off": SamplingParams(temperature=0.8, top_k=0),
        "T=0": SamplingParams(temperature=0.0),
    }

    def per_row_ms(work) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for row in logits:
                work(row)
            best = min(best, (time.perf_counter_ns() - start) / rows / 1e6)
        return best

    results = {name: per_row_ms(lambda row, p=params: sample(to_probs(row, p), rng)) for name, params in cases.items()}
    results["copy of one logits row"] = per_row_ms(np.copy)
    return {"n_vocab": n_vocab, "rows": rows, "repeats": repeats, "ms_per_row": results,
            "machine": machine_description(), "load_average": _load_average()}


# --------------------------------------------------------------- cost curve


def run_cost_curve(
    model: str | Path,
    *,
    max_tokens: int = COST_CURVE_MAX_TOKENS,
    repeats: int = 5,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    workloads_dir: Path = WORKLOADS_DIR,
) -> dict:
    """Time one target forward pass over n = 1..max_tokens tokens, after a real prompt.

    T(n) / T(1) is what a verification of n - 1 drafts costs in single-token
    passes: drafting k tokens can only pay if more than T(k + 1) / T(1)
    tokens come out of a step on average.
    """
    from .backend import default_threads
    from .engine import Engine

    n_threads = n_threads or default_threads()
    prompt = load_workloads(["code-edit"], 1, workloads_dir)[0]
    engine = Engine.load(model, "none", n_ctx=n_ctx, n_threads=n_threads, draft_tokens=0)  # no calibration needed
    try:
        ids = engine.prompt_tokens(prompt.prompt)
        # A realistic KV length: attention cost grows with it.
        engine.generate(prompt.prompt, SamplingParams(temperature=0.0, max_tokens=1))
        widths = list(range(1, max_tokens + 1))
        seconds: dict[int, list[float]] = {n: [] for n in widths}
        engine.target.time_forward(max_tokens, ids[-1])  # warm-up
        for round_ in range(repeats):
            for n in rotated(widths, round_):
                seconds[n].append(engine.target.time_forward(n, ids[-1]))
        context_tokens = len(engine.target.cached)
    finally:
        engine.close()
    single = statistics.median(seconds[1])
    points = [
        {
            "tokens": n,
            "median_ms": statistics.median(seconds[n]) * 1e3,
            "min_ms": min(seconds[n]) * 1e3,
            "max_ms": max(seconds[n]) * 1e3,
            "relative_to_one": statistics.median(seconds[n]) / single,
            "ms_per_token": statistics.median(seconds[n]) * 1e3 / n,
        }
        for n in widths
    ]
    return {
        "meta": {
            "model": str(model),
            "context_tokens": context_tokens,
            "repeats": repeats,
            "n_threads": n_threads,
            "machine": machine_description(),
            "versions": {name: _version(name) for name in ("edgespec", "llama-cpp-python")},
        },
        "cost_curve": points,
    }


# ------------------------------------------------------------------- output


def _stdout_console():
    from rich.console import Console

    console = Console()
    # A pipe or a file gets the whole table rather than 80 columns of ellipses.
    return console if console.is_terminal else Console(width=170)


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_tables(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    meta = results["meta"]
    console.print(
        f"[bold]{Path(meta['model']).name}[/bold] on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['n_threads']} threads), {meta['repeats']} repeats, seed {meta['seed']}"
    )
    for temperature in meta["temperatures"]:
        table = Table(title=f"T = {temperature:g}" + (" (token ids checked against baseline)" if temperature == 0 else ""))
        for column in ("suite", "config", "decode tok/s", "min-max", "speedup", "per-prompt", "accept", "passes/tok",
                       "prefill s", "e2e s", "e2e speedup", "bound", "peak RSS MB", "same as base"):
            table.add_column(column, justify="left" if column in ("suite", "config") else "right")
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
        "bound: 1 / (f + (1 - f) / speedup) with f the baseline's prefill share of end-to-end time"
    )
    if meta.get("peer_workaround"):
        console.print(f"peer: {meta['peer_workaround']}")
    ties = results.get("near_ties") or []
    if ties:
        console.print(
            f"{len(ties)} T=0 run(s) left the baseline at a near-tie of the target's two best tokens "
            f"(closer than the {KERNEL_DRIFT_LOGITS} logits llama.cpp's kernels drift between pass widths); "
            "every other run matched it token for token"
        )


def print_overhead(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _stdout_console()
    phases = [p for p in results["overhead"][0]["phase_ms_per_step"] if p not in DECODE_PHASES] if results["overhead"] else []
    for temperature in results["meta"]["temperatures"]:
        table = Table(title=f"T = {temperature:g}: milliseconds per step outside llama_decode")
        for column in ("suite", "config", "steps", "llama_decode", *phases, "overhead", "of T(1)"):
            table.add_column(column, justify="left" if column in ("suite", "config") else "right")
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


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BenchError("--plot needs matplotlib (install it with: pip install 'edgespec[bench]')") from err
    return plt


def plot_speedups(results: dict, path: Path) -> None:
    """Per-prompt median speedup per suite and configuration; error bars span the per-prompt quartiles."""
    plt = _pyplot()
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
        ax.legend(fontsize="small", ncol=min(4, len(configs)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost_curve(results: dict, path: Path) -> None:
    plt = _pyplot()
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


# ------------------------------------------------------------- command line


def add_bench_parser(subparsers) -> None:
    from .cli import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "bench",
        help="measure edgespec's drafting modes against plain decoding and llama-cpp-python's prompt lookup",
        description=(
            "Run workload suites through every configuration on one loaded model, with the order rotated per "
            "prompt, and report decode speed, speedup, acceptance and latency. At temperature 0 every edgespec "
            "mode must reproduce the baseline's tokens, or the bench fails; a difference where the target's two "
            "best tokens nearly tie (closer than llama.cpp's kernels drift between pass widths) is reported instead. "
            "Exit codes: 0 done, 1 exactness check failed, 2 refused (bad options, model failed to load)."
        ),
    )
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL, help="target GGUF: a path or a catalog name (default: %(default)s)")
    parser.add_argument("--draft", default=None, help="draft GGUF (path or catalog name) for the draft-model configurations")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated suites (default: {','.join(SUITES)})")
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated configurations: baseline, ngram, draft-model, peer, each optionally -kN (fixed draft "
        f"length) or -auto (default: {','.join(DEFAULT_CONFIGS)}; draft-model only with --draft)",
    )
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help=f"runs per prompt and configuration (default: {DEFAULT_REPEATS})")
    parser.add_argument("--prompts", type=int, default=None, metavar="N", help="use the first N prompts of each suite")
    parser.add_argument("--temperature", type=float, action="append", default=None,
                        help="sampling temperature; repeat the flag for several (default: 0 and 0.7)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of the first repeat; repeat i uses seed+i (default: {DEFAULT_SEED})")
    parser.add_argument("--max-tokens", type=int, default=None, help="override every prompt's max_tokens")
    parser.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX, help=f"context length (default: {DEFAULT_N_CTX})")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for every configuration (default: as the engine)")
    parser.add_argument("--workloads", type=Path, default=WORKLOADS_DIR, help="folder of <suite>.jsonl files")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every run and the summary as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="plot speedups (or the cost curve); needs edgespec[bench]")
    parser.add_argument("--cost-curve", action="store_true",
                        help=f"only measure the target's time per forward pass over 1..{COST_CURVE_MAX_TOKENS} tokens")
    parser.add_argument("--overhead", action="store_true",
                        help="also report the milliseconds per step spent outside llama_decode, per phase of the loop, "
                             "and the sampling microbenchmark")
    parser.add_argument("--sampling", action="store_true",
                        help=f"only time to_probs + sample per row over a {SAMPLING_VOCAB:,}-token vocabulary (no model)")
    parser.set_defaults(func=handle_bench)


def handle_bench(args) -> int:
    try:
        if args.plot:
            _pyplot()  # fail before the long part, not after it
        if args.sampling:
            results = {"meta": {}, "sampling": run_sampling_microbench()}
            print_sampling(results["sampling"])
        elif args.cost_curve:
            results = run_cost_curve(args.model, repeats=args.repeats, n_ctx=args.n_ctx, n_threads=args.threads,
                                     workloads_dir=args.workloads)
            print_cost_curve(results)
        else:
            results = run_bench(
                args.model,
                args.draft,
                suites=_split(args.suites),
                configs=_split(args.configs) if args.configs else None,
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
            )
            print_tables(results)
            if args.overhead:
                print_overhead(results)
                results["sampling"] = run_sampling_microbench()
                print_sampling(results["sampling"])
        results["meta"]["command"] = shlex.join(["edgespec", *sys.argv[1:]])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        if args.plot and not args.sampling:
            (plot_cost_curve if args.cost_curve else plot_speedups)(results, args.plot)
        return EXIT_OK
    except ExactnessError as err:
        print(f"edgespec bench: FAILED: {err}", file=sys.stderr)
        return EXIT_EXACTNESS_FAILED
    except EdgespecError as err:
        print(f"edgespec bench: {err}", file=sys.stderr)
        return EXIT_REFUSED


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _progress_line(run: dict, done: int, total: int) -> str:
    return (
        f"[{done}/{total}] T={run['temperature']:g} {run['prompt_id']} {run['config']}: "
        f"{run['decode_tokens_per_second']:.1f} tok/s, {run['tokens_generated']} tokens"
    )
