"""The bench's figure against llama.cpp's n-gram peers: per prompt, over the faster peer there."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from edgespec.commands.bench import configs
from edgespec.commands.bench.against_peers import against_ngram_peers, print_against_peers

PLAN = configs.resolve_configs(["baseline", "ngram", "llamacpp-ngram-simple", "llamacpp-ngram-simple-n15",
                                "llamacpp-ngram-mod", "llamacpp-none"], "auto", False, True, has_peer=True)


def _run(config, prompt, tps, repeat=0, suite="code-edit", temperature=0.0, matches=True):
    return {"temperature": temperature, "suite": suite, "prompt_id": prompt, "config": config, "repeat": repeat,
            "decode_tokens_per_second": tps, "matches_baseline": matches}


def _prompt(prompt, ours, simple, n15, mod, none=99.0, suite="code-edit", matches=True):
    """Three repeats of each configuration on one prompt; each configuration's median is the given tok/s."""
    runs = []
    for repeat, wobble in enumerate((-1.0, 0.0, 2.0)):
        for config, tps in (("baseline", 10.0), ("ngram-auto", ours), ("llamacpp-ngram-simple", simple),
                            ("llamacpp-ngram-simple-n15", n15), ("llamacpp-ngram-mod", mod), ("llamacpp-none", none)):
            runs.append(_run(config, prompt, tps + wobble, repeat, suite, matches=matches or config != "ngram-auto"))
    return runs


def test_each_prompt_is_held_to_its_own_fastest_n_gram_peer():
    runs = _prompt("p1", ours=30.0, simple=20.0, n15=25.0, mod=10.0) + \
        _prompt("p2", ours=20.0, simple=25.0, n15=15.0, mod=10.0) + \
        _prompt("p3", ours=24.0, simple=10.0, n15=10.0, mod=20.0)
    [row] = against_ngram_peers(runs, PLAN)
    # llamacpp-none does not speculate: at 99 tok/s it would be every prompt's best peer
    assert {pid: entry["best_peer"] for pid, entry in row["prompts"].items()} == {
        "p1": "llamacpp-ngram-simple-n15", "p2": "llamacpp-ngram-simple", "p3": "llamacpp-ngram-mod"}
    assert [row["prompts"][pid]["ratio"] for pid in ("p1", "p2", "p3")] == pytest.approx([1.2, 0.8, 1.2])
    assert (row["ratio_median"], row["ratio_min"], row["ratio_max"]) == pytest.approx((1.2, 0.8, 1.2))
    assert (row["config"], row["suite"], row["temperature"], row["left_baseline_text"]) == ("ngram-auto", "code-edit", 0.0, [])


def test_prompts_whose_text_left_the_baseline_s_are_named_at_t_0_only():
    runs = _prompt("p1", 30.0, 20.0, 25.0, 10.0, matches=False) + _prompt("p2", 20.0, 25.0, 15.0, 10.0)
    [row] = against_ngram_peers(runs, PLAN)
    assert row["left_baseline_text"] == ["p1"]
    sampled = [dict(run, temperature=0.7) for run in runs]
    [row] = against_ngram_peers(sampled, PLAN)
    assert row["left_baseline_text"] == []


def test_every_suite_gets_a_row_and_all_of_them_one_more():
    runs = _prompt("p1", 30.0, 20.0, 25.0, 10.0) + _prompt("q1", 10.0, 20.0, 5.0, 5.0, suite="explain")
    rows = against_ngram_peers(runs, PLAN)
    assert [(row["suite"], row["ratio_median"]) for row in rows] == pytest.approx(
        [("code-edit", 1.2), ("explain", 0.5), ("all", 0.85)])


def test_without_an_n_gram_peer_there_is_no_row():
    plan = configs.resolve_configs(["baseline", "ngram", "llamacpp-none"], "auto", False, True, has_peer=True)
    runs = [run for run in _prompt("p1", 30.0, 20.0, 25.0, 10.0) if run["config"] in ("baseline", "ngram-auto", "llamacpp-none")]
    assert against_ngram_peers(runs, plan) == []
    # a prompt that only edgespec ran is left out, not divided by nothing
    runs = _prompt("p1", 30.0, 20.0, 25.0, 10.0) + [_run("ngram-auto", "p2", 50.0)]
    [row] = against_ngram_peers(runs, PLAN)
    assert set(row["prompts"]) == {"p1"}


def test_the_line_under_the_tables_says_the_figure_and_which_peer_was_faster():
    runs = _prompt("p1", 30.0, 20.0, 25.0, 10.0, matches=False) + _prompt("p2", 20.0, 25.0, 15.0, 10.0) + \
        _prompt("p3", 26.0, 20.0, 13.0, 10.0)
    out = io.StringIO()
    print_against_peers(against_ngram_peers(runs, PLAN), Console(file=out, width=400))
    assert out.getvalue().strip() == (
        "ngram-auto over the faster llama.cpp n-gram peer on each prompt (T = 0, code-edit): median 1.20x "
        "[0.80-1.30] over 3 prompts; the faster peer: llamacpp-ngram-simple on 2, llamacpp-ngram-simple-n15 on 1; "
        "at a near-tie its text left the baseline's on p1")


def test_the_tables_show_every_configuration_s_whole_name():
    # cut to fit, the two llama.cpp n-gram peers both read "llamacpp-…"
    from edgespec.commands.bench.report import print_tables

    figures = dict.fromkeys(("decode_tps_median", "decode_tps_min", "decode_tps_max", "speedup",
                             "speedup_per_prompt_median", "speedup_paired_median", "acceptance_rate",
                             "target_passes_per_token", "prefill_seconds_median", "end_to_end_seconds_median",
                             "end_to_end_speedup", "end_to_end_bound", "peak_rss_mb", "matches_baseline"), 1.0)
    names = ["baseline", "ngram-auto", "llamacpp-ngram-simple", "llamacpp-ngram-simple-n15"]
    results = {"meta": {"model": "m.gguf", "machine": {"cpu": "CPU", "cores": 2}, "n_threads": 2, "repeats": 1,
                        "seed": 1, "temperatures": [0.0]},
               "summary": [dict(figures, suite="code-edit", config=name, temperature=0.0) for name in names]}
    out = io.StringIO()
    print_tables(results, Console(file=out, width=150))
    # the config column read down the rows, folded lines and all
    column = "".join(line.split("│")[2].strip() for line in out.getvalue().splitlines() if line.startswith("│"))
    assert column == "".join(names)
