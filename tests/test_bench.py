"""`edgespec bench` on tiny models: the JSON it writes, its exactness check, its command line."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import edgespec.decoder
from edgespec.commands import bench, main
from edgespec.commands.bench import configs, exactness, microbench, report, runner, workloads

CONFIGS = ["baseline", "ngram-k2", "ngram-k4", "draft-model-k3"]
RUN_FIELDS = {
    "suite", "prompt_id", "config", "temperature", "repeat", "seed", "prompt_tokens", "prompt_tokens_evaluated",
    "tokens_generated", "finish_reason", "prefill_seconds", "decode_seconds", "end_to_end_seconds",
    "decode_tokens_per_second", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate",
    "target_forward_passes", "target_passes_per_token", "mean_draft_tokens", "k0_steps", "steps", "token_ids",
    "text", "peak_rss_mb", "matches_baseline", "prompt_ids", "bit_exact", "widest_pass", "accepted_by_drafter", "drafted_by_position",
    "accepted_by_position", "pass_widths",
    "draft_forward_passes",
    "mode", "plan_reason", "prompt_tokens_reused",  # a run carries all of its Stats
    "accepted_prediction_tokens", "rejected_prediction_tokens", "plain_step_seconds", "decode_speedup",
    "end_to_end_speedup", "flash_attn",
}
SUMMARY_FIELDS = {
    "temperature", "suite", "config", "drafter", "draft_tokens", "runs", "prompts", "decode_tps_median",
    "decode_tps_min", "decode_tps_max", "speedup", "speedup_per_prompt_median", "speedup_per_prompt_q1",
    "speedup_per_prompt_q3", "speedup_paired_median", "speedup_paired_q1", "speedup_paired_q3", "paired_runs",
    "acceptance_rate", "target_passes_per_token", "mean_draft_tokens",
    "prefill_seconds_median", "decode_seconds_median", "end_to_end_seconds_median", "end_to_end_speedup",
    "baseline_prefill_share", "end_to_end_bound", "peak_rss_mb", "matches_baseline",
}


@pytest.fixture
def models(tiny_models) -> dict[str, Path]:
    return tiny_models


def quick_bench(models, **overrides) -> dict:
    # flash attention off: without it the tiny models' passes give every row one-token passes' logits, so
    # each configuration's text is the baseline's on every build (flash attention tiles by the pass's width)
    options = dict(
        suites=["code-edit", "chat"], configs=CONFIGS, prompts_per_suite=1, repeats=1,
        temperatures=[0.0], max_tokens=24, n_ctx=2048, n_threads=1, flash_attn="off",
    )
    options.update(overrides)
    return runner.run_bench(models["target"], models["draft"], **options)


def test_quick_bench_reports_every_field_and_passes_the_exactness_check(models):
    results = quick_bench(models)

    assert [c["name"] for c in results["configs"]] == CONFIGS
    runs = results["runs"]
    assert len(runs) == 2 * len(CONFIGS)  # 2 prompts x 1 repeat
    for run in runs:
        assert set(run) == RUN_FIELDS
        assert run["tokens_generated"] == 24 and run["finish_reason"] == "length"
        assert run["prompt_tokens_evaluated"] == run["prompt_tokens"]  # a cold cache every run
        assert run["decode_tokens_per_second"] > 0 and run["peak_rss_mb"] > 0
    for prompt_id in ("code-edit-01", "chat-01"):
        base = next(r for r in runs if r["prompt_id"] == prompt_id and r["config"] == "baseline")
        for run in runs:
            if run["prompt_id"] == prompt_id:
                assert run["matches_baseline"] is True and run["token_ids"] == base["token_ids"]
    assert any(r["draft_tokens_accepted"] for r in runs if r["config"].startswith("ngram"))

    summary = results["summary"]
    assert {(r["suite"], r["config"]) for r in summary} == {
        (suite, config) for suite in ("code-edit", "chat", "all") for config in CONFIGS
    }
    for row in summary:
        assert set(row) == SUMMARY_FIELDS
        assert row["decode_tps_min"] <= row["decode_tps_median"] <= row["decode_tps_max"]
    baseline = next(r for r in summary if r["suite"] == "all" and r["config"] == "baseline")
    assert baseline["speedup"] == pytest.approx(1.0) and baseline["end_to_end_bound"] == pytest.approx(1.0)

    meta = results["meta"]
    assert meta["suites"] == {"code-edit": 1, "chat": 1} and meta["repeats"] == 1
    assert meta["flash_attn"] is False and not any(run["flash_attn"] for run in runs)  # as asked
    assert meta["llama_cpp_bin"] is None  # no peer without --llama-cpp-bin
    assert meta["machine"]["cores"] >= 1
    json.dumps(results)  # everything is JSON-ready


def test_a_quantised_kv_cache_bench_runs_every_mode_on_it_and_says_so(models):
    results = quick_bench(models, suites=["chat"], configs=["baseline", "ngram-k4"], max_tokens=12, kv_type="q8_0")
    assert results["meta"]["kv_type"] == "q8_0"
    assert all(run["matches_baseline"] for run in results["runs"])  # exact against plain decoding on that cache


def install_faulty_verifier(monkeypatch) -> list[int]:
    """Verification that picks the wrong token after every step that had drafts; plain decoding stays right."""
    real_verify = edgespec.decoder.verify
    corrupted: list[int] = []

    def faulty_verify(p, draft_tokens, q, rng):
        verdict = real_verify(p, draft_tokens, q, rng)
        if not draft_tokens:
            return verdict
        corrupted.append(verdict.next_token)
        return replace(verdict, next_token=(verdict.next_token + 1) % len(p[0]))

    monkeypatch.setattr(edgespec.decoder, "verify", faulty_verify)
    return corrupted


def test_a_mode_that_changes_tokens_fails_the_bench_loudly(models, monkeypatch):
    corrupted = install_faulty_verifier(monkeypatch)
    with pytest.raises(bench.ExactnessError, match=r"ngram-k4 on code-edit-01 \(T=0, repeat 0\) differs from baseline at generated token \d+"):
        quick_bench(models, configs=["baseline", "ngram-k4"], suites=["code-edit"])
    assert corrupted


def test_plain_decoding_again_is_an_a_a_pair_with_the_baseline(models):
    results = quick_bench(models, configs=["baseline-again", "ngram-k2"], suites=["chat"], repeats=2, max_tokens=12)

    assert [c["name"] for c in results["configs"]] == ["baseline-again", "ngram-k2", "baseline"]
    again = [r for r in results["runs"] if r["config"] == "baseline-again"]
    plain = {r["repeat"]: r for r in results["runs"] if r["config"] == "baseline"}
    assert len(again) == 2 and all(r["mode"] == "none" and r["draft_tokens_proposed"] == 0 for r in again)
    assert all(r["token_ids"] == plain[r["repeat"]]["token_ids"] and r["matches_baseline"] for r in again)
    row = next(r for r in results["summary"] if r["suite"] == "all" and r["config"] == "baseline-again")
    paired = [r["decode_tokens_per_second"] / plain[r["repeat"]]["decode_tokens_per_second"] for r in again]
    assert row["paired_runs"] == 2 and row["speedup_paired_median"] == pytest.approx(statistics.median(paired))


def test_sampled_runs_are_compared_with_the_baseline_of_their_seed_but_not_held_to_it(models, monkeypatch):
    corrupted = install_faulty_verifier(monkeypatch)
    results = quick_bench(models, configs=["baseline", "ngram-k4"], suites=["code-edit"], temperatures=[0.7], repeats=2)

    assert corrupted
    assert {r["seed"] for r in results["runs"]} == {runner.DEFAULT_SEED, runner.DEFAULT_SEED + 1}
    assert all(r["matches_baseline"] is True for r in results["runs"] if r["config"] == "baseline")
    # the drafted runs took wrong tokens: reported as parted from their seed's baseline, and the bench went on
    drafted = [r["matches_baseline"] for r in results["runs"] if r["config"] == "ngram-k4"]
    assert set(drafted) <= {True, False} and False in drafted


def test_configuration_names():
    assert configs.parse_config("baseline") == ("baseline", None)
    assert configs.parse_config("baseline-again") == ("baseline", None)
    assert configs.parse_config("ngram") == ("ngram", None)
    assert configs.parse_config("ngram-k8") == ("ngram", 8)
    assert configs.parse_config("draft-model-auto") == ("draft-model", "auto")
    assert configs.parse_config("llamacpp-ngram-simple") == ("llamacpp-ngram-simple", None)
    assert configs.parse_config("llamacpp-draft-n3") == ("llamacpp-draft", 3)
    assert configs.parse_config("llamacpp-ngram-mod-n8") == ("llamacpp-ngram-mod", 8)
    for bad in ("peer-k2", "ngram-k0", "baseline-k2", "medusa", "ngram-8", "llamacpp-ngram-simple-k3",
                "llamacpp-none-n2", "llamacpp-draft-auto", "llamacpp-ngram-simple-n0"):
        with pytest.raises(bench.BenchError):
            configs.parse_config(bad)


def test_configurations_resolve_to_distinct_draft_lengths():
    names = [c.name for c in configs.resolve_configs(configs.DEFAULT_CONFIGS, 4, has_draft=False, explicit=False)]
    assert names == ["baseline", "ngram-k4", "ngram-k4-exact", "ngram-k2"]
    names = [c.name for c in configs.resolve_configs(configs.DEFAULT_CONFIGS, "auto", has_draft=True, explicit=False)]
    assert names == ["baseline", "ngram-auto", "ngram-auto-exact", "ngram-k2", "ngram-k4", "draft-model-auto",
                     "combined-auto"]
    names = [c.name for c in configs.resolve_configs(configs.DEFAULT_CONFIGS, 4, has_draft=True, explicit=False,
                                                     has_peer=True)]
    assert names == ["baseline", "ngram-k4", "ngram-k4-exact", "ngram-k2", "draft-model-k4", "combined-k4",
                     "llamacpp-none", "llamacpp-ngram-simple", "llamacpp-ngram-mod", "llamacpp-draft"]
    exact = configs.resolve_configs(["ngram-k2-exact", "ngram-k2"], 4, False, True)
    assert [(c.name, c.bit_exact) for c in exact] == [("ngram-k2-exact", True), ("ngram-k2", False),
                                                      ("baseline", False)]
    peers = configs.resolve_configs(["llamacpp-ngram-simple-n3", "llamacpp-ngram-simple"], 4, False, True, has_peer=True)
    assert [(c.name, c.drafter, c.draft_tokens, c.is_peer) for c in peers] == [
        ("llamacpp-ngram-simple-n3", "llamacpp-ngram-simple", 3, True),
        ("llamacpp-ngram-simple", "llamacpp-ngram-simple", None, True), ("baseline", "baseline", None, False)]
    assert configs.resolve_configs(["ngram-k2"], 4, False, True)[-1].name == "baseline"  # always measured
    again = configs.resolve_configs(["baseline", "baseline-again", "baseline-again"], 4, False, True)
    assert [(c.name, c.drafter) for c in again] == [("baseline", "baseline"), ("baseline-again", "baseline")]
    with pytest.raises(bench.BenchError, match="--draft"):
        configs.resolve_configs(["draft-model"], 4, has_draft=False, explicit=True)
    # heads trained but not loaded (no --draft heads) were told to be trained, then loaded
    with pytest.raises(bench.BenchError, match="needs heads, which --draft heads loads .train them first"):
        configs.resolve_configs(["heads"], 4, has_draft=False, explicit=True)


def test_flash_attention_is_refused_with_bit_exact_configurations_before_loading(tmp_path):
    missing = tmp_path / "no-such-model.gguf"  # never loaded: the refusal comes first
    for names in (["baseline", "ngram-exact"], None):  # None: the defaults, which hold ngram-exact
        with pytest.raises(bench.BenchError, match="--flash-attn cannot go with ngram-exact"):
            runner.run_bench(missing, None, configs=names, flash_attn=True)


def test_flash_attention_s_auto_runs_it_unless_a_configuration_is_bit_exact():
    assert runner._runs_flash_attention(["baseline", "ngram", "llamacpp-ngram-simple"], "auto") == (True, None)
    off, why = runner._runs_flash_attention(None, "auto")  # the defaults hold ngram-exact
    assert not off and why.startswith("flash attention off, as ngram-exact needs it off")
    assert runner._runs_flash_attention(["baseline", "ngram"], "off") == (False, None)
    assert runner._runs_flash_attention(["baseline", "ngram"], True) == (True, None)


def test_rotation_moves_every_configuration_through_every_slot():
    plan = configs.resolve_configs(["baseline", "ngram-k2", "ngram-k4"], 4, False, True)
    orders = [[c.name for c in configs.rotated(plan, i)] for i in range(3)]
    assert [order[0] for order in orders] == ["baseline", "ngram-k2", "ngram-k4"]
    assert all(sorted(order) == sorted(orders[0]) for order in orders)


def test_end_to_end_bound_follows_the_prefill_share():
    assert report.end_to_end_bound(0.2, 2.5) == pytest.approx(1 / (0.2 + 0.8 / 2.5))
    assert report.end_to_end_bound(0.0, 3.0) == pytest.approx(3.0)
    assert report.end_to_end_bound(1.0, 3.0) == pytest.approx(1.0)


def _timed_run(config, repeat, tps, prompt="p1"):
    return {"temperature": 0.0, "suite": "s", "prompt_id": prompt, "config": config, "repeat": repeat,
            "decode_tokens_per_second": tps}


def test_paired_ratios_see_through_a_machine_whose_speed_drifts_between_repeats():
    # plain decoding ran at 34, 23, 30, 22 and 26 tok/s in five repeats; in each repeat drafting was 8-12%
    # faster than the plain run next to it, except the last, where both met a slow spell
    plain = [34.0, 23.0, 30.0, 22.0, 26.0]
    gains = [1.10, 1.12, 1.08, 1.10, 0.90]
    baseline = [_timed_run("baseline", r, tps) for r, tps in enumerate(plain)]
    runs = [_timed_run("ngram", r, tps * gain) for r, (tps, gain) in enumerate(zip(plain, gains))]
    ratios = report.paired_speedups(runs, baseline)
    assert ratios == pytest.approx(gains)
    assert statistics.median(ratios) == pytest.approx(1.10)


def test_a_run_pairs_only_with_the_baseline_of_its_own_prompt_temperature_and_repeat():
    baseline = [_timed_run("baseline", 0, 20.0), _timed_run("baseline", 1, 40.0), _timed_run("baseline", 0, 10.0, "p2")]
    runs = [_timed_run("ngram", 0, 30.0), _timed_run("ngram", 1, 30.0), _timed_run("ngram", 0, 30.0, "p2"),
            _timed_run("ngram", 2, 99.0), dict(_timed_run("ngram", 0, 99.0), temperature=0.7)]
    assert report.paired_speedups(runs, baseline) == pytest.approx([1.5, 0.75, 3.0])


def test_the_summary_row_carries_the_paired_median_and_quartiles():
    config = configs.BenchConfig("ngram-auto", "ngram", "auto")
    base = [dict(_timed_run("baseline", r, tps), end_to_end_seconds=1.0, prefill_seconds=0.1, peak_rss_mb=1.0,
                 matches_baseline=None) for r, tps in enumerate([20.0, 40.0, 30.0, 25.0])]
    mine = [dict(b, config="ngram-auto", decode_tokens_per_second=b["decode_tokens_per_second"] * ratio,
                 draft_tokens_accepted=1, draft_tokens_proposed=2, target_forward_passes=1, tokens_generated=2,
                 steps=1, decode_seconds=1.0) for b, ratio in zip(base, [1.0, 1.2, 1.1, 1.3])]
    for b in base:
        b.update(draft_tokens_accepted=0, draft_tokens_proposed=0, target_forward_passes=2, tokens_generated=2,
                 steps=2, decode_seconds=1.0)
    row = report.summary_row(0.0, "s", config, mine, base)
    assert row["speedup_paired_median"] == pytest.approx(1.15)
    assert row["paired_runs"] == 4
    assert row["speedup_paired_q1"] <= 1.15 <= row["speedup_paired_q3"]


def test_workload_suites_are_complete_and_well_formed():
    prompts = workloads.load_workloads()
    for suite in bench.SUITES:
        mine = [p for p in prompts if p.suite == suite]
        assert len(mine) >= 12, suite
        assert len({p.id for p in mine}) == len(mine)
        assert all(p.id.startswith(suite + "-") and p.max_tokens > 0 and p.prompt.strip() for p in mine)
    for p in prompts:
        if p.suite in ("summarize", "qa-context"):
            passage = max(p.prompt.split("\n\n"), key=len)
            assert 150 <= len(passage.split()) <= 300, p.id
        if p.suite == "code-edit":
            code = p.prompt.split("```")[1]
            assert 10 <= len(code.strip().splitlines()) <= 31, p.id


def test_batch_file_is_thirty_openai_batch_requests():
    lines = (bench.WORKLOADS_DIR.parent / "batch-30.jsonl").read_text(encoding="utf-8").splitlines()
    requests = [json.loads(line) for line in lines]
    assert len(requests) == 30 and len({r["custom_id"] for r in requests}) == 30
    for r in requests:
        assert r["method"] == "POST" and r["url"] == "/v1/chat/completions"
        assert r["body"]["messages"][-1]["role"] == "user" and r["body"]["max_tokens"] > 0


def test_bad_workload_line_names_the_file_and_line(tmp_path):
    (tmp_path / "chat.jsonl").write_text('{"id": "chat-01", "prompt": "hi"}\n{"prompt": "no id"}\n')
    with pytest.raises(bench.BenchError, match=r"chat.jsonl:2"):
        workloads.load_workloads(["chat"], directory=tmp_path)
    with pytest.raises(bench.BenchError, match="no workload file"):
        workloads.load_workloads(["poetry"], directory=tmp_path)


def test_a_missing_suite_names_the_suites_the_folder_has(tmp_path):
    # A folder of one's own prompts without --suites asks for the default suites: say which it holds instead.
    (tmp_path / "story.jsonl").write_text('{"id": "story-01", "prompt": "once"}\n')
    (tmp_path / "explain.jsonl").write_text('{"id": "explain-01", "prompt": "why"}\n')
    (tmp_path / "replies-model.jsonl").write_text('{"id": "story-01", "prompt_ids": [1], "reply_ids": [2]}\n')
    with pytest.raises(bench.BenchError, match=r"name its suites with --suites: explain, story$"):
        workloads.load_workloads(["code-edit"], directory=tmp_path)
    with pytest.raises(bench.BenchError, match="there is no folder"):
        workloads.load_workloads(["code-edit"], directory=tmp_path / "missing")


@pytest.mark.parametrize("line, reason", [
    ('{"id": "a", "prompt": "hi", "max_tokens": -5}', "max_tokens is -5"),
    ('{"id": "a", "prompt": "hi", "max_tokens": "12"}', "max_tokens is '12'"),
    ('{"id": "a", "prompt": ["hi"]}', "the prompt is a JSON array, not text"),
    # Python's words were shown: "list indices must be integers or slices, not str", "'prompt'"
    ('[1, 2]', "it is a JSON array, not an object"),
    ('null', "it is a JSON null, not an object"),
    ('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}', "it has no 'prompt'"),
])
def test_a_bad_workload_line_is_refused_with_its_reason(tmp_path, line, reason):
    # A negative max_tokens ended in a ValueError traceback once the model had loaded.
    (tmp_path / "chat.jsonl").write_text(line + "\n")
    with pytest.raises(bench.BenchError, match=re.escape(f"chat.jsonl:1 is not a workload line ({reason}")):
        workloads.load_workloads(["chat"], directory=tmp_path)


def test_a_workload_file_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "chat.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(bench.BenchError, match="cannot be read as UTF-8 text"):
        workloads.load_workloads(["chat"], directory=tmp_path)


def test_results_into_a_missing_folder_are_refused_before_the_bench_runs(tmp_path, capsys):
    # The model named does not exist: the refusal must come before anything would load it.
    assert bench_cli("--json", tmp_path / "missing" / "out.json", "--suites", "chat", "--configs", "baseline",
                     "--model", tmp_path / "not-loaded.gguf") == bench.EXIT_REFUSED
    assert f"there is no folder {tmp_path / 'missing'}" in capsys.readouterr().err


def test_no_suite_or_no_prompt_is_refused_before_the_model_loads(tmp_path):
    # Both ended in an IndexError traceback once the model had loaded.
    (tmp_path / "chat.jsonl").write_text("\n")
    with pytest.raises(bench.BenchError, match="names no suite"):
        workloads.load_workloads([], directory=tmp_path)
    with pytest.raises(bench.BenchError, match="no prompts to run: chat.jsonl"):
        workloads.load_workloads(["chat"], directory=tmp_path)
    assert bench_cli("--suites", ",", "--workloads", tmp_path, "--configs", "baseline") == bench.EXIT_REFUSED


def test_a_suite_file_with_a_broken_first_line_is_named_not_left_out_silently(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_text('{"id": "good-01", "prompt": "once"}\n')
    (tmp_path / "broken.jsonl").write_text('{"id": "broken-01", "prompt": \n')
    (tmp_path / "replies-model.jsonl").write_text('{"id": "good-01", "prompt_ids": [1], "reply_ids": [2]}\n')
    assert [p.id for p in workloads.load_workloads(directory=tmp_path)] == ["good-01"]
    err = capsys.readouterr().err
    assert "left out broken.jsonl in" in err and "replies-model" not in err


def test_a_suite_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    # it was "holds no <suite>.jsonl files of prompts", where batch reads such files
    (tmp_path / "notes.jsonl").write_bytes('\ufeff{"id": "notes-01", "prompt": "once"}\n'.encode())
    assert [p.prompt for p in workloads.load_workloads(directory=tmp_path)] == ["once"]


def test_without_suites_a_folder_runs_every_suite_it_holds(tmp_path):
    (tmp_path / "story.jsonl").write_text('{"id": "story-01", "prompt": "once"}\n')
    (tmp_path / "chat.jsonl").write_text('{"id": "chat-01", "prompt": "hi"}\n')
    (tmp_path / "replies-model.jsonl").write_text('{"id": "story-01", "prompt_ids": [1], "reply_ids": [2]}\n')
    assert [p.id for p in workloads.load_workloads(directory=tmp_path)] == ["chat-01", "story-01"]
    assert workloads.suites_in(bench.WORKLOADS_DIR) == list(bench.SUITES)
    only_replies = tmp_path / "replies"
    only_replies.mkdir()
    (tmp_path / "replies-model.jsonl").rename(only_replies / "replies-model.jsonl")
    with pytest.raises(bench.BenchError, match="holds no <suite>.jsonl files of prompts"):
        workloads.load_workloads(directory=only_replies)
    # a folder whose only suite's first line is broken said it held no suite files, and not which it left out
    (only_replies / "notes.jsonl").write_text('{"id": "n", "text": "once"}\n')
    with pytest.raises(bench.BenchError, match="the first line of notes.jsonl is not a workload line; name it "
                                               "with --suites notes to see why"):
        workloads.load_workloads(directory=only_replies)


def bench_cli(*argv) -> int:
    return main(["bench", *map(str, argv)])


def test_command_writes_json_and_prints_the_table(models, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = bench_cli("--model", models["target"], "--suites", "creative", "--configs", "baseline,ngram-k2",
                     "--prompts", "1", "--repeats", "1", "--temperature", "0", "--max-tokens", "12",
                     "--threads", "1", "--json", out)
    assert code == bench.EXIT_OK
    results = json.loads(out.read_text())
    assert [c["name"] for c in results["configs"]] == ["baseline", "ngram-k2"]
    captured = capsys.readouterr()
    assert "ngram-k2" in captured.out and "creative" in captured.out
    assert "[2/2]" in captured.err  # progress


def test_the_bench_says_which_priors_its_runs_started_from(models, capsys):
    # "learned" was written where no store existed, the runs starting from the built-in priors; and the
    # tables never said which
    options = dict(suites=["chat"], configs=["baseline", "ngram-k2"], max_tokens=8)
    cold = quick_bench(models, **options)
    learned_none = quick_bench(models, learned_priors=True, **options)
    assert cold["meta"]["priors"] == "cold"
    assert learned_none["meta"]["priors"] == "learned asked, none stored: built-in"
    report.print_tables(cold)
    assert "priors cold" in capsys.readouterr().out


def _fail_on_sigterm(signum, frame):
    pytest.fail("SIGTERM reached the test's own handler: the bench let it end the process")


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stop_mid_bench_keeps_and_reports_the_runs_it_measured(models, tmp_path, monkeypatch, capsys, stop):
    # Ctrl+C printed only "interrupted": nothing on stdout, no --json, an hour's runs lost; then SIGTERM
    # (timeout, kill) still lost them, ending the process with 143 and no word
    out = tmp_path / "results.json"
    shown = bench._progress_line

    def stop_at_the_third_run(run, done, total):
        if done == 3:
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at once, in this thread
        return shown(run, done, total)

    monkeypatch.setattr(bench, "_progress_line", stop_at_the_third_run)
    previous = signal.signal(signal.SIGTERM, _fail_on_sigterm)  # the default would end pytest itself
    try:
        code = bench_cli("--model", models["target"], "--suites", "creative", "--configs", "baseline,ngram-k2",
                         "--prompts", "2", "--repeats", "1", "--temperature", "0", "--max-tokens", "8",
                         "--threads", "1", "--json", out)
    finally:
        assert signal.signal(signal.SIGTERM, previous) is _fail_on_sigterm  # the bench put it back
    assert code == bench.EXIT_INTERRUPTED
    results = json.loads(out.read_text())
    assert results["meta"]["interrupted"] and results["meta"]["runs_planned"] == 4 and len(results["runs"]) == 3
    captured = capsys.readouterr()
    assert "creative" in captured.out and f"interrupted after 3 of 4 runs; the tables above and {out} hold them" \
        in captured.err


def test_results_into_a_folder_or_an_unwritable_file_are_refused_before_the_bench_runs(tmp_path, capsys):
    # found out after the whole bench, as "edgespec: ...: Is a directory", exit 1 (an exactness failure's)
    assert bench_cli("--json", tmp_path, "--suites", "chat", "--configs", "baseline",
                     "--model", tmp_path / "not-loaded.gguf") == bench.EXIT_REFUSED
    assert f"{tmp_path} is a directory; give a file path" in capsys.readouterr().err


def test_command_exits_non_zero_on_an_exactness_failure(models, monkeypatch, capsys):
    install_faulty_verifier(monkeypatch)
    code = bench_cli("--model", models["target"], "--suites", "code-edit", "--configs", "baseline,ngram-k2",
                     "--prompts", "1", "--repeats", "1", "--temperature", "0", "--max-tokens", "24", "--threads", "1")
    assert code == bench.EXIT_EXACTNESS_FAILED
    err = capsys.readouterr().err
    assert "FAILED" in err and "ngram-k2 on code-edit-01" in err and "Traceback" not in err


def test_plot_without_matplotlib_is_refused_before_running(models, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    code = bench_cli("--model", models["target"], "--plot", tmp_path / "speedup.png")
    assert code == bench.EXIT_REFUSED
    assert "pip install 'edgespec[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "speedup.png").exists()


def test_plots_are_written_when_matplotlib_is_installed(models, tmp_path):
    pytest.importorskip("matplotlib")
    results = quick_bench(models, configs=["baseline", "ngram-k2"], suites=["chat"])
    report.plot_speedups(results, tmp_path / "speedup.png")
    report.plot_cost_curve(microbench.run_cost_curve(models["target"], max_tokens=3, repeats=1, n_threads=1), tmp_path / "cost.png")
    for name in ("speedup.png", "cost.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_a_baseline_alone_plots_without_a_legend_to_fill(models, tmp_path):
    pytest.importorskip("matplotlib")
    # matplotlib refused the legend of no bars (ncol=0): a traceback after the whole bench had run
    report.plot_speedups(quick_bench(models, configs=["baseline"], suites=["chat"]), tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").read_bytes().startswith(b"\x89PNG")


def test_a_reader_that_goes_away_ends_the_bench_as_it_ends_every_command(models):
    # rich's own answer to a broken pipe was exit 1 without a word: what bench says of a failed exactness check
    bench_run = subprocess.Popen([sys.executable, "-m", "edgespec", "bench", "--model", str(models["target"]),
                                  "--suites", "chat", "--configs", "baseline", "--prompts", "1", "--repeats", "1",
                                  "--temperature", "0", "--max-tokens", "4", "--threads", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bench_run.stdout.close()  # before the report's first line: `| head -n 0`
    err = bench_run.stderr.read()
    assert bench_run.wait(timeout=300) == 141 and "Traceback" not in err, err


def test_cost_curve_times_every_width(models):
    results = microbench.run_cost_curve(models["target"], max_tokens=6, repeats=2, n_threads=1)
    points = results["cost_curve"]
    assert [p["tokens"] for p in points] == [1, 2, 3, 4, 5, 6]
    assert points[0]["relative_to_one"] == pytest.approx(1.0)
    assert all(p["min_ms"] <= p["median_ms"] <= p["max_ms"] for p in points)
    assert results["meta"]["context_tokens"] > 100


def test_a_near_tie_of_the_target_is_reported_not_failed():
    baseline = {"config": "baseline", "prompt_id": "p", "repeat": 0, "prompt_ids": [1, 2], "token_ids": [5, 6, 7], "text": ""}
    other = {"config": "ngram-k4", "prompt_id": "p", "repeat": 0, "prompt_ids": [1, 2], "token_ids": [5, 8, 7], "text": ""}
    close = lambda ids: [0.0] * 6 + [3.0, 0.0, 2.9]  # tokens 6 and 8 are 0.1 apart after [1, 2, 5]
    far = lambda ids: [0.0] * 6 + [3.0, 0.0, 0.5]
    ties = exactness.check_exactness([baseline, other], close, drift_bound=0.5)
    assert ties == [{"config": "ngram-k4", "prompt_id": "p", "repeat": 0, "position": 1, "logit_gap": pytest.approx(0.1),
                     "drift_bound": 0.5}]
    with pytest.raises(bench.ExactnessError, match="2.50 logits apart"):
        exactness.check_exactness([baseline, other], far, drift_bound=0.5)
    # a bit-exact run, or a model whose kernels never drift, gets no allowance
    with pytest.raises(bench.ExactnessError, match="0.10 logits apart"):
        exactness.check_exactness([baseline, {**other, "bit_exact": True}], close, drift_bound=0.5)
    with pytest.raises(bench.ExactnessError, match="0.10 logits apart"):
        exactness.check_exactness([baseline, other], close, drift_bound=0.0)


@pytest.mark.parametrize("configs", ["", ",,"])
def test_configs_that_name_none_are_refused(tmp_path, capsys, configs):
    # "" ran the whole default set; ",," asked for llama.cpp's binaries, which nobody named
    assert bench_cli("--configs", configs, "--model", tmp_path / "not-loaded.gguf") == bench.EXIT_REFUSED
    assert "--configs names no configuration" in capsys.readouterr().err
