"""Several requests decoded together: `edgespec batch --parallel N` and the scheduler under it."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from edgespec.commands import batch
from edgespec.commands.batch.parallel import parallel_for
from edgespec.controller import DraftLengthController
from edgespec.costs import CostModel
from edgespec.drafters import Hint, NgramDrafter
from edgespec.drafting import DraftChoice, joint_draft_lengths
from edgespec.generation import Done, Failed, Step
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams
from edgespec.scheduler import Job, best_parallel
from edgespec.sequence_cache import MIN_COPIED_PREFIX
from test_batch import (batch_argv, chat_line, completion_line, edgespec_command, models, read_records,  # noqa: F401
                        run_cli, twenty_requests, wait_for_records, write_lines)

# A CPU-like curve: a pass over n tokens costs about what 1 + (n - 1) / 3 single ones do.
FIXED_CURVE = tuple(1.0 + (n - 1) / 3 for n in range(1, 34))


def outputs(path) -> dict[str, str]:
    """custom_id -> the generated text, for every record (each custom_id must appear once)."""
    records = read_records(path)
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a custom_id was written twice"
    texts = {}
    for r in records:
        body = r["response"]["body"]
        choice = body["choices"][0]
        texts[r["custom_id"]] = choice["message"]["content"] if "message" in choice else choice["text"]
    return texts


def test_parallel_outputs_equal_one_at_a_time_at_temperature_0(models, tmp_path, capsys):
    source = write_lines(tmp_path / "in.jsonl", twenty_requests())
    runs = {}
    for n in ("1", "4"):
        out = tmp_path / f"out{n}.jsonl"
        assert run_cli(batch_argv(models, source, out, "--parallel", n)) == batch.EXIT_OK
        runs[n] = outputs(out)
    assert runs["4"] == runs["1"]
    assert len(runs["4"]) == 20
    assert "throughput" in capsys.readouterr().err


def test_bit_exact_decodes_one_request_at_a_time_and_matches_plain_decoding(models, tmp_path, capsys):
    source = write_lines(tmp_path / "in.jsonl", twenty_requests()[:8])
    exact, plain = tmp_path / "exact.jsonl", tmp_path / "plain.jsonl"
    assert run_cli(batch_argv(models, source, exact, "--parallel", "4", "--bit-exact")) == batch.EXIT_OK
    assert "running one request at a time, not 4" in capsys.readouterr().err
    argv = batch_argv(models, source, plain, "--parallel", "1")
    argv[argv.index("--draft") + 1] = "none"
    assert run_cli(argv) == batch.EXIT_OK
    assert outputs(exact) == outputs(plain)
    assert [r["custom_id"] for r in read_records(exact)] == [f"chat-{i:02d}" for i in range(8)]


def test_killed_parallel_run_resumes_with_every_id_exactly_once(models, tmp_path):
    lines = [json.dumps(f"Hello the cat {i}") for i in range(12)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = edgespec_command() + batch_argv(models, source, out, "--parallel", "3")
    command[command.index("--max-tokens") + 1] = "80"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(process, out, 2)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    stopped = out.read_text().splitlines()
    assert 2 <= len(stopped) < 12

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == batch.EXIT_OK, rerun.stderr
    assert f"12 ok, 0 failed of 12 ({len(stopped)} already done)" in rerun.stderr
    final = out.read_text().splitlines()
    assert final[: len(stopped)] == stopped  # finished records are kept, byte for byte
    assert sorted(json.loads(line)["custom_id"] for line in final) == sorted(f"line-{i}" for i in range(1, 13))


def test_a_request_that_fails_gets_its_error_record_while_the_others_run(models, tmp_path):
    lines = twenty_requests()[:6]
    lines[2] = chat_line("too-long", "the cat " * 600)
    lines[4] = chat_line("bad-value", "Hello", temperature=-1)
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_cli(batch_argv(models, source, out, "--parallel", "3", "--n-ctx", "512")) == batch.EXIT_REQUESTS_FAILED
    records = {r["custom_id"]: r for r in read_records(out)}
    assert records["too-long"]["error"]["code"] == "context_length_exceeded"
    assert records["bad-value"]["error"]["code"] == "invalid_value"  # edgespec serve's body check refused it
    assert sum(r["error"] is None for r in records.values()) == 4


@pytest.fixture(scope="module")
def engine(models):
    engine = load_engine(models["target"], "ngram", n_ctx=256, draft_tokens=3, cost_curve=FIXED_CURVE[:8],
                         n_threads=1, pull=False)
    yield engine
    engine.close()


def run_jobs(engine, jobs, parallel):
    pending = iter(jobs)
    results, steps = {}, {}
    for key, event in engine.scheduler(parallel).run(lambda wait: next(pending, None)):
        if isinstance(event, Step):
            steps[key] = steps.get(key, 0) + 1
        else:
            assert key not in results
            results[key] = event.result if isinstance(event, Done) else event
    return results, steps


def test_sequences_that_stop_or_fill_their_context_end_while_the_others_go_on(engine):
    prompt = engine.prompt_tokens("The cat sat on", raw=True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    alone = engine.generate("The cat sat on", params, raw=True).text
    stop_at = alone[len(alone) // 2 :][:3]
    jobs = [
        Job("short", prompt, params),
        Job("stops", prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=(stop_at,))),
        Job("fills", engine.prompt_tokens("the cat " * 100, raw=True), SamplingParams(temperature=0.0, max_tokens=4000)),
        Job("later", prompt, params),  # starts when one of the first three ends
        Job("empty", [], params),
    ]
    results, steps = run_jobs(engine, jobs, parallel=3)
    assert isinstance(results["empty"], Failed)
    assert results["short"].finish_reason == "length" and results["short"].text == alone
    assert results["stops"].finish_reason == "stop" and results["stops"].text == alone[: alone.index(stop_at)]
    assert results["fills"].finish_reason == "context"
    assert len(engine.prompt_tokens("the cat " * 100, raw=True)) + len(results["fills"].token_ids) >= engine.n_ctx
    assert results["later"].text == alone
    assert steps["fills"] > steps["short"]  # it went on after the others ended


def test_a_prompt_sharing_a_long_prefix_with_another_sequence_copies_its_cache(engine):
    document = "The cat sat on the mat and the dog sat on the log. " * 7
    prompts = [engine.prompt_tokens(document + question, raw=True) for question in ("Who sat?", "Where?", "Why?")]
    shared = min(len(p) for p in prompts) - 4
    assert shared >= MIN_COPIED_PREFIX
    params = SamplingParams(temperature=0.0, max_tokens=10)
    alone = [engine.generate(document + q, params, raw=True).text for q in ("Who sat?", "Where?", "Why?")]
    results, _ = run_jobs(engine, [Job(i, p, params) for i, p in enumerate(prompts)], parallel=2)
    assert [results[i].text for i in range(3)] == alone
    assert results[0].stats.prompt_tokens_reused == 0
    assert results[1].stats.prompt_tokens_reused >= shared  # copied from sequence 0 while it ran
    assert results[2].stats.prompt_tokens_reused >= shared


def test_cancel_ends_every_sequence_in_flight(engine):
    import threading

    cancel = threading.Event()
    prompt = engine.prompt_tokens("The cat sat on", raw=True)
    jobs = iter([Job(i, prompt, SamplingParams(temperature=0.0, max_tokens=200)) for i in range(4)])
    reasons = {}
    for key, event in engine.scheduler(2).run(lambda wait: next(jobs, None), cancel=cancel):
        cancel.set()
        if isinstance(event, Done):
            reasons[key] = event.result.finish_reason
    assert reasons == {0: "cancelled", 1: "cancelled"}  # the other two never started


# ---------------------------------------------------------------- choosing draft lengths together


def trained_choice(acceptance: float, cap: int = 8) -> DraftChoice:
    controller = DraftLengthController(CostModel(FIXED_CURVE), 16)
    for _ in range(200):
        accepted = 0
        while accepted < 8 and (accepted + 1) / 9 <= acceptance:
            accepted += 1
        controller.update(8, accepted)
    return DraftChoice(NgramDrafter(), Hint(cap, 0), cap, controller)


def test_a_sequence_whose_drafts_fail_drafts_nothing_while_the_others_draft():
    good, bad = trained_choice(0.95), trained_choice(0.0)
    lengths = joint_draft_lengths([good, bad, good], CostModel(FIXED_CURVE))
    assert lengths[1] == 0
    assert lengths[0] > 0 and lengths[2] > 0


def test_drafted_rows_are_added_only_while_they_pay_for_their_width():
    # every extra row costs as much as a whole single step: no draft is worth it
    flat = CostModel(tuple(float(n) for n in range(1, 34)))
    assert joint_draft_lengths([trained_choice(0.9)] * 3, flat) == [0, 0, 0]
    # a fixed draft length is kept whatever it costs, and does not make failing drafts worth a row
    fixed = DraftChoice(NgramDrafter(), Hint(8, 0), 8, DraftLengthController(flat, 16, fixed_k=2))
    assert joint_draft_lengths([fixed, trained_choice(0.0)], flat) == [2, 0]
    # where rows are cheap, every sequence that is often right drafts
    assert all(k > 0 for k in joint_draft_lengths([trained_choice(0.9)] * 3, CostModel(FIXED_CURVE)))


def test_the_default_number_of_sequences_is_the_best_tokens_per_second_on_the_curve():
    curve = CostModel((1.0, 1.5, 1.8, 2.0, 3.0, 4.0))  # 4 sequences: 2.0 tokens per unit; 5: 1.67
    assert best_parallel(curve, 6) == 4
    assert best_parallel(curve, 3) == 3
    assert best_parallel(CostModel(tuple(float(n) for n in range(1, 9))), 8) == 1


def test_batch_picks_the_number_of_sequences_from_the_curve_and_the_requests_left(engine):
    assert parallel_for(engine, None, pending=100) == 8  # the fixed curve gains up to its widest pass
    assert parallel_for(engine, None, pending=3) == 3
    assert parallel_for(engine, 5, pending=100) == 5
    engine.configure(bit_exact=True)
    try:
        assert parallel_for(engine, None, pending=100) == 1
    finally:
        engine.configure(bit_exact=False)
