"""edgespec's n-gram drafting against llama.cpp's n-gram peers, prompt by prompt.

The comparison users make is "faster than llama.cpp's own speculation at its best setting": for each
prompt, the faster of the llamacpp-ngram-simple and llamacpp-ngram-mod configurations that ran (their
defaults and any -nN), and edgespec's median tok/s on that prompt over that peer's.  The median of those
ratios is the figure; per prompt, because which peer setting is best changes from prompt to prompt, and a
ratio of medians over all prompts would let the long copies outweigh the rest.

At T = 0 a drafted run may leave the baseline's text where the target's two best tokens nearly tie
(exactness.py).  It then wrote another reply than plain decoding, which the peers may well have followed,
so its prompt's ratio can compare two texts: those prompts are named beside the figure.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .configs import BenchConfig

NGRAM_PEERS = ("llamacpp-ngram-simple", "llamacpp-ngram-mod")


def against_ngram_peers(runs: list[dict], plan: list[BenchConfig]) -> list[dict]:
    """One row per temperature, suite ("all" too, with more than one) and edgespec n-gram configuration,
    when at least one n-gram peer ran; none otherwise."""
    peers = [config.name for config in plan if config.drafter in NGRAM_PEERS]
    ours = [config.name for config in plan if config.drafter == "ngram"]
    suites = list(dict.fromkeys(run["suite"] for run in runs))
    rows = []
    for temperature in sorted({run["temperature"] for run in runs}):
        for suite in suites + (["all"] if len(suites) > 1 else []):
            chosen = [run for run in runs if run["temperature"] == temperature and suite in ("all", run["suite"])]
            for config in ours:
                row = _against(config, peers, chosen)
                if row:
                    rows.append({"temperature": temperature, "suite": suite, "config": config, **row})
    return rows


def _against(config: str, peers: list[str], runs: list[dict]) -> dict | None:
    """config's median tok/s over the best peer's, on each prompt both ran; None if there is no such prompt."""
    by_prompt = defaultdict(lambda: defaultdict(list))  # prompt -> configuration -> tok/s of its runs
    for run in runs:
        by_prompt[run["prompt_id"]][run["config"]].append(run["decode_tokens_per_second"])
    prompts = {}
    for prompt_id, by_config in by_prompt.items():
        peer_tps = {peer: statistics.median(by_config[peer]) for peer in peers if by_config.get(peer)}
        if not by_config.get(config) or not peer_tps:
            continue
        best = max(peer_tps, key=peer_tps.get)
        if peer_tps[best] > 0:
            prompts[prompt_id] = {"ratio": statistics.median(by_config[config]) / peer_tps[best], "best_peer": best}
    if not prompts:
        return None
    ratios = [entry["ratio"] for entry in prompts.values()]
    # matches_baseline is False only where a T = 0 run left the baseline's tokens; at T > 0 each seed
    # writes its own text, so another text than the baseline's says nothing about the peers'.
    left = sorted({run["prompt_id"] for run in runs if run["config"] == config and run["temperature"] == 0
                   and run.get("matches_baseline") is False and run["prompt_id"] in prompts})
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "prompts": prompts, "left_baseline_text": left}


def print_against_peers(rows: list[dict], console) -> None:
    """One line a row, under the bench's tables."""
    for row in rows:
        best = defaultdict(int)
        for entry in row["prompts"].values():
            best[entry["best_peer"]] += 1
        which = ", ".join(f"{peer} on {count}" for peer, count in sorted(best.items(), key=lambda item: -item[1]))
        left = (f"; at a near-tie its text left the baseline's on {', '.join(row['left_baseline_text'])}"
                if row["left_baseline_text"] else "")
        console.print(
            f"{row['config']} over the faster llama.cpp n-gram peer on each prompt (T = {row['temperature']:g}, "
            f"{row['suite']}): median {row['ratio_median']:.2f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}] "
            f"over {len(row['prompts'])} prompts; the faster peer: {which}{left}",
            highlight=False,
        )
