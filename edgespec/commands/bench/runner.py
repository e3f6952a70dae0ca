"""Running the bench: every prompt through every configuration on one loaded target, the order rotated.

The target is loaded once; every edgespec configuration runs on that same
model, with drafting switched between runs (``Engine.configure``).  llama.cpp's
own speculation runs as a process per run (peers.py), on the same prompts
rendered with the same chat template, rotated with the rest.  Every run
starts with a cold KV cache, so prefill is always paid in full and measured.
"""

from __future__ import annotations

import resource
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from ...sampling import SamplingParams
from ...backend import default_threads, plain_logits
from ...limits import SettingError, checked_flash_attn, flash_attention_on
from ...loading import load_engine, use_learning
from ...notices import print_notice
from .against_peers import against_ngram_peers
from .configs import DEFAULT_CONFIGS, PEER_SPEC_TYPES, BenchConfig, is_bit_exact, resolve_configs, rotated
from .exactness import check_exactness, mark_same_seed_matches
from .microbench import DEFAULT_N_CTX, load_average, machine_description, package_version
from .peers import LlamaCppPeer, find_binary
from .report import summarize, summarize_overhead
from .workloads import WORKLOADS_DIR, BenchError, BenchPrompt, load_workloads

DEFAULT_TEMPERATURES = (0.0, 0.7)
DEFAULT_REPEATS = 3
DEFAULT_SEED = 1234


def run_bench(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    suites: Iterable[str] | None = None,
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
    llama_cpp_bin: str | Path | None = None,
    kv_type: str = "f16",
    flash_attn: bool | str = "auto",
    learned_priors: bool = False,
) -> dict:
    """Run the bench and return everything as one JSON-ready dict (meta, configs, runs, summary).

    With overhead=True every edgespec run also records where its decode time
    went, per phase of the decoder's step (edgespec.phases.PhaseClock), and the
    result gains an "overhead" summary.  llama_cpp_bin (a folder holding
    llama-speculative-simple) adds llama.cpp's own speculation as peers.
    Raises ExactnessError at the first temperature-0 mismatch of an edgespec
    mode with the baseline.
    kv_type is the models' KV cache type (keys only without flash attention).  flash_attn is "auto" (on, as
    the other commands and llama.cpp's peers run, unless an -exact configuration is asked for: bit-exact
    verification needs it off, and every configuration runs in one process), "on" (True; refused with
    -exact configurations) or "off" (False).
    learned_priors: runs start from this model's learned priors (read only), not cold.
    """
    if repeats < 1:
        raise BenchError("--repeats must be at least 1")
    temperatures = tuple(temperatures)
    prompts = [p if max_tokens is None else BenchPrompt(p.suite, p.id, p.prompt, max_tokens)
               for p in load_workloads(suites, prompts_per_suite, workloads_dir)]
    n_threads = n_threads or default_threads()
    _check_before_loading(configs, llama_cpp_bin, flash_attn)
    started, load_at_start = time.time(), load_average()
    engine = _bench_engine(model, draft, n_ctx, n_threads, kv_type, _runs_flash_attention(configs, flash_attn),
                           learned_priors)
    try:
        plan = _configs_for(engine, configs, llama_cpp_bin)
        peer = _peer(engine, llama_cpp_bin, n_threads) if any(c.is_peer for c in plan) else None
        runner = _Runner(engine, peer, overhead)
        runner.warm_up(prompts[0], plan)
        runs, cut_short_of = _measure(runner, plan, prompts, temperatures, repeats, seed, on_run)
    finally:
        engine.close()
    meta = _meta(engine.target_path, engine.draft_path, prompts, repeats, temperatures, seed, n_ctx, n_threads, started,
                 runner.rss_scope, peer)
    # other work on the machine distorts every figure; a quiet machine shows ~0 next to its core count
    meta.update(kv_type=kv_type, flash_attn=engine.flash_attn, priors=_priors(engine, learned_priors),
                load_average_start=load_at_start, load_average_end=load_average(), **_kernel_facts(engine))
    return _results(meta, engine, plan, runs, runner, overhead, cut_short_of)


def _results(meta: dict, engine, plan, runs: list[dict], runner, overhead: bool, cut_short_of: int | None) -> dict:
    """The bench's JSON: what ran where, every run, and the summaries; cut_short_of: the runs planned, where
    Ctrl+C stopped the bench (the runs measured until then are kept, which an hour's bench would otherwise lose)."""
    if cut_short_of is not None:
        meta.update(interrupted=True, runs_planned=cut_short_of)
    results = {
        "meta": meta,
        "configs": [_config_row(config) for config in plan],
        "runs": runs,
        "near_ties": runner.near_ties,
        "summary": summarize(runs, plan),
        "against_peers": against_ngram_peers(runs, plan),
    }
    if overhead:
        results["overhead"] = summarize_overhead(runs, plan, engine.plain_step_seconds)
    return results


def _priors(engine, learned_priors: bool) -> str:
    """Which priors the runs started from, as the results say it: "learned" only where this model had some
    stored (else they start from the same built-in ones as a cold bench)."""
    if not learned_priors:
        return "cold"
    stored = any(engine.planner.learned.prior(drafter) is not None for drafter in ("ngram", "draft-model", "heads"))
    return "learned" if stored else "learned asked, none stored: built-in"


def _bench_engine(model, draft, n_ctx: int, n_threads: int, kv_type: str, flash_attn: tuple[bool, str | None],
                  learned_priors: bool):
    """The engine every configuration runs on: cold unless learned_priors (then read, never added to), and
    without the cross-request pool, so that no run drafts from another's text.  flash_attn: whether it runs
    flash attention, and the notice saying why not where auto left it off (_runs_flash_attention)."""
    runs_flash_attn, why_off = flash_attn
    engine = load_engine(model, draft if draft else "ngram", n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_type,
                         flash_attn=runs_flash_attn, notice=print_notice, progress=True)
    if why_off:
        print_notice(why_off)
    use_learning(engine, "read" if learned_priors else "cold", pool=False)
    return engine


def _config_row(config) -> dict:
    return {"name": config.name, "drafter": config.drafter, "draft_tokens": config.draft_tokens,
            "bit_exact": config.bit_exact}
def _configs_for(engine, configs: Iterable[str] | None, llama_cpp_bin) -> list:
    """The configurations to run, with the draft length and the drafters of the loaded engine."""
    return resolve_configs(configs or DEFAULT_CONFIGS, engine.draft_tokens, engine.draft_model is not None,
                           configs is not None, has_peer=llama_cpp_bin is not None, has_heads="heads" in engine.modes)


def _check_before_loading(configs: Iterable[str] | None, llama_cpp_bin, flash_attn: bool | str) -> None:
    """Refuse unknown configurations, missing peer binaries and bit-exact runs with flash attention asked for
    before the model loads (draft lengths need it)."""
    names = tuple(configs or DEFAULT_CONFIGS)
    resolve_configs(names, "auto", True, configs is not None, has_peer=llama_cpp_bin is not None, has_heads=True)
    exact = [name for name in names if is_bit_exact(name)]
    try:
        choice = checked_flash_attn(flash_attn)
    except SettingError as error:
        raise BenchError(f"--flash-attn: {error}") from None
    if choice == "on" and exact:
        raise BenchError(f"--flash-attn cannot go with {', '.join(exact)}: bit-exact verification needs flash "
                         "attention off (leave them out with --configs, or drop --flash-attn)")
    if llama_cpp_bin is not None:
        find_binary(llama_cpp_bin)


def _runs_flash_attention(configs: Iterable[str] | None, flash_attn: bool | str) -> tuple[bool, str | None]:
    """Whether edgespec's configurations run with flash attention (auto: unless one is bit-exact), and when
    auto leaves it off, a notice saying why: the other commands run it."""
    exact = [name for name in (configs or DEFAULT_CONFIGS) if is_bit_exact(name)]
    runs = flash_attention_on(flash_attn, bit_exact=bool(exact))
    if runs or checked_flash_attn(flash_attn) != "auto":
        return runs, None
    return False, (f"flash attention off, as {', '.join(exact)} needs it off; the other commands run it "
                   "(leave the -exact configurations out with --configs to time it)")


def _peer(engine, llama_cpp_bin, n_threads: int) -> LlamaCppPeer:
    return LlamaCppPeer(llama_cpp_bin, engine.target_path, draft=engine.draft_path, n_ctx=engine.n_ctx,
                        n_threads=n_threads, n_gpu_layers=max(engine.target.n_gpu_layers, 0))


def _measure(runner, plan, prompts, temperatures, repeats, seed, on_run) -> tuple[list[dict], int | None]:
    """Every prompt x repeat x configuration, the order rotated per prompt and repeat; and, where Ctrl+C cut
    it short, how many runs there were to be (the runs done are kept, those of a prompt it cut into unchecked
    for exactness)."""
    runs: list[dict] = []
    total = len(temperatures) * len(prompts) * repeats * len(plan)
    for temperature in temperatures:
        for index, prompt in enumerate(prompts):
            prompt_runs = []
            try:
                for repeat in range(repeats):
                    for config in rotated(plan, index + repeat):
                        prompt_runs.append(runner.run(prompt, config, temperature, repeat, seed + repeat))
                        if on_run:
                            on_run(prompt_runs[-1], len(runs) + len(prompt_runs), total)
            except KeyboardInterrupt:
                return runs + prompt_runs, total
            if temperature == 0:
                for tie in check_exactness(prompt_runs, partial(plain_logits, runner.engine.target), runner.engine.drift_bound()):
                    runner.near_ties.append(tie)
                    if on_run:
                        print(f"near-tie, not a bug: {tie['config']} on {tie['prompt_id']} differs at token "
                              f"{tie['position']}, where the target's two best logits are {tie['logit_gap']:.2f} apart",
                              file=sys.stderr)
            else:
                mark_same_seed_matches(prompt_runs)
            runs.extend(prompt_runs)
    return runs, None


class _Runner:
    def __init__(self, engine, peer: LlamaCppPeer | None, overhead: bool = False):
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
        if config.is_peer:
            figures = self._run_peer(prompt.prompt, params, config)
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
            "peak_rss_mb": _peak_rss_mb(children=config.is_peer),
            "matches_baseline": None,  # set by check_exactness at temperature 0, by mark_same_seed_matches at T > 0
        }

    def _run_edgespec(self, ids: list[int], params: SamplingParams, config: BenchConfig) -> dict:
        from ...engine import Done
        from ...phases import PhaseClock

        engine = self.engine
        engine.configure(mode="none" if config.drafter == "baseline" else config.drafter,
                         draft_tokens=config.draft_tokens, bit_exact=config.bit_exact)
        engine.forget_cache()  # a bench run must pay (and time) its prefill in full
        engine.forget_learning()  # and start from the priors, as `edgespec run` and llama.cpp's peers do
        clock = engine.phase_clock = PhaseClock(engine.target, engine.draft_model) if self.overhead else None
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
            **stats.as_dict(),
            "acceptance_rate": stats.acceptance_rate if config.drafter != "baseline" else None,
            "token_ids": list(result.token_ids),
            "text": result.text,
        }

    def _run_peer(self, prompt: str, params: SamplingParams, config: BenchConfig) -> dict:
        """llama.cpp's figures for the prompt as the chat template renders it, fed raw."""
        rendered = self.engine.render_chat([{"role": "user", "content": prompt}])
        run = self.peer.run(rendered, spec_type=PEER_SPEC_TYPES[config.drafter], draft_max=config.draft_tokens,
                            max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed)
        proposed, accepted = run.draft_tokens_proposed, run.draft_tokens_accepted
        return {
            "prompt_tokens": run.prompt_tokens,
            "prompt_tokens_evaluated": run.prompt_tokens,
            "tokens_generated": run.tokens_generated,
            # the binary stops once it has more than -n tokens, or at an end-of-generation token
            "finish_reason": "length" if run.tokens_generated >= params.max_tokens else "stop",
            "prefill_seconds": run.prefill_seconds,
            "decode_seconds": run.decode_seconds,
            "decode_tokens_per_second": run.tokens_generated / run.decode_seconds if run.decode_seconds > 0 else 0.0,
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            # each target pass emits exactly one token that was not a draft's, so the passes follow
            "target_forward_passes": run.tokens_generated - accepted,
            "target_passes_per_token": (run.tokens_generated - accepted) / run.tokens_generated if run.tokens_generated else None,
            "mean_draft_tokens": None,  # the binary does not report these
            "k0_steps": None,
            "steps": None,
            "token_ids": None,  # the binary prints text only
            "text": run.text,
            "bit_exact": None,
            "widest_pass": None,
            "accepted_by_drafter": None,
            "pass_widths": None,
            "draft_forward_passes": None,
        }


def _reset_peak_rss() -> bool:
    """Restart the process's peak-RSS counter (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(children: bool = False) -> float:
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    peak = resource.getrusage(who).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


def _kernel_facts(engine) -> dict:
    """What llama.cpp's kernels do to logits across pass widths, and what a pass costs: as the engine plans
    (cost_curve_relative: calibration's curve at the prices passes were paid at in generation here) and as
    calibration measured it (measured_curve_relative; none for a given curve)."""
    measured = engine.profile.measured_curve
    return {"exact_width": engine.exact_width, "kernel_drift": engine.kernel_drift,
            "drift_bound": engine.drift_bound(), "cost_curve_relative": list(engine.cost.relative()),
            "measured_curve_relative": [s / measured[0] for s in measured] if measured else None}


def _meta(model, draft, prompts, repeats, temperatures, seed, n_ctx, n_threads, started, rss_scope, peer) -> dict:
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
        "versions": {name: package_version(name) for name in ("edgespec", "llama-cpp-python")},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_seconds": time.time() - started,
        "peak_rss_scope": (
            "per run (the process's peak RSS counter is reset before each run; it still counts every loaded model)"
            if rss_scope == "run"
            else "process-wide peak since start (this kernel does not allow resetting it)"
        ) + ("; llama.cpp peers: the largest llama.cpp process so far" if peer else ""),
        "decode_definition": (
            "edgespec: tokens generated / time after prefill; llama.cpp peers: the tokens and seconds its binary "
            "reports as decoded"
        ),
        "llama_cpp_bin": str(peer.binary.parent) if peer else None,
    }
