"""A notice names a setting in its reader's words, as an error does, and library use prints nothing.

Library use logs notices to the "edgespec" logger, naming Python parameters (`draft='ngram'`,
`bit_exact=True`); the command line prints the same notices on stderr, naming its flags
(`--draft ngram`, `--bit-exact`), as it always did.
"""

from __future__ import annotations

import json
import logging

import edgespec
from edgespec.commands import main as cli_main
from edgespec.costs import CostModel
from edgespec.errors import Setting, Wording, flag_worded
from edgespec.loading import plan_load
from edgespec.notices import log_notice, print_notice

FIXED_COST = (1.0, 1.2, 1.4, 1.6)  # given: nothing is timed, so what loading says does not depend on the machine


def test_a_wording_is_the_library_text_and_the_command_line_words_its_settings_as_flags(capsys, caplog):
    why = Wording("wider passes are not bit-identical (", Setting("bit_exact", True), ")")
    notice = Wording("drafting at most 3 tokens per step: ", why, "; ", Setting("draft", "ngram"), " may be faster")
    assert notice == "drafting at most 3 tokens per step: wider passes are not bit-identical (bit_exact=True); " \
                     "draft='ngram' may be faster"
    assert flag_worded(notice) == "drafting at most 3 tokens per step: wider passes are not bit-identical " \
                                  "(--bit-exact); --draft ngram may be faster"
    assert flag_worded("no setting named") == "no setting named"

    with caplog.at_level(logging.INFO, logger="edgespec"):
        log_notice(notice)
    assert capsys.readouterr() == ("", "")
    assert caplog.records[-1].name == "edgespec" and caplog.records[-1].getMessage() == notice
    print_notice(notice)
    assert capsys.readouterr() == ("", flag_worded(notice) + "\n")


def library_load(capfd, caplog, target, draft, **options) -> list[str]:
    """Load, generate and close as a library user does: what was logged; nothing may reach stdout or stderr."""
    with caplog.at_level(logging.INFO, logger="edgespec"):
        with edgespec.load(str(target), draft, pull=False, n_ctx=256, n_threads=1, **options) as engine:
            assert engine.generate("one two three", max_tokens=4, temperature=0, raw=True).token_ids
    assert capfd.readouterr() == ("", "")  # not a byte printed, by Python or by llama.cpp
    return [record.msg for record in caplog.records if record.name == "edgespec"]  # each notice as given


def test_library_use_logs_the_draft_model_notice_naming_the_parameter(tiny_models, capfd, caplog):
    # a draft token as dear as a target step: the draft model cannot pay, but it was asked for by name
    notices = library_load(capfd, caplog, tiny_models["target"], tiny_models["draft"],
                           cost_curve=CostModel(FIXED_COST, draft_seconds_per_token=1.0))
    kept = [notice for notice in notices if notice.startswith("drafting with n-grams and draft.gguf as asked")]
    assert len(kept) == 1 and kept[0].endswith("; draft='ngram' may be faster"), notices
    assert flag_worded(kept[0]).endswith("; --draft ngram may be faster")


def test_the_keys_only_notice_names_bit_exact_in_each_reader_s_words(tiny_models, capfd, caplog):
    notices = library_load(capfd, caplog, tiny_models["target"], "none", cost_curve=FIXED_COST, kv_type="q8_0",
                           bit_exact=True, flash_attn="auto")  # as the commands load
    assert [n for n in notices if "keys only" in n] == [
        "the KV cache types apply to the keys only: llama.cpp quantises values only with flash attention, which "
        "bit_exact=True keeps off"]

    code = cli_main(["run", "one two three", "--raw", "--max-tokens", "2", "--model", str(tiny_models["target"]),
                     "--draft", "none", "--kv-type", "q8_0", "--bit-exact", "--threads", "1", "--n-ctx", "256"])
    out, err = capfd.readouterr()
    assert code == 0 and out, err
    assert "values only with flash attention, which --bit-exact keeps off\n" in err
    assert "bit_exact" not in err


def test_the_plan_names_a_given_budget_as_the_parameter_and_the_command_line_as_its_flag(tiny_models, capsys):
    plan = plan_load(tiny_models["target"], "none", n_ctx=256, memory_budget="64MiB", pull=False).plan
    assert plan.budget_source == "memory_budget" and flag_worded(plan.budget_source) == "--memory-budget"
    assert cli_main(["plan", "--model", str(tiny_models["target"]), "--draft", "none", "--n-ctx", "256",
                     "--memory-budget", "64MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_source"] == "--memory-budget"


def test_ignored_gpu_layers_are_named_as_each_reader_gives_them(tiny_models, monkeypatch, capsys, caplog):
    monkeypatch.setattr("edgespec.loading.supports_gpu_offload", lambda: False)  # a CPU-only build, on any machine
    with caplog.at_level(logging.INFO, logger="edgespec"):
        plan_load(tiny_models["target"], "none", n_ctx=256, n_gpu_layers=2, memory_budget="64MiB", pull=False)
    assert capsys.readouterr() == ("", "")
    assert "no GPU offload here, so n_gpu_layers and draft_gpu_layers are ignored" in caplog.messages

    assert cli_main(["plan", "--model", str(tiny_models["target"]), "--draft", "none", "--n-ctx", "256",
                     "--gpu-layers", "2", "--memory-budget", "64MiB", "--json"]) == 0
    ignored = "no GPU offload here, so --gpu-layers and --draft-gpu-layers are ignored"
    out, err = capsys.readouterr()
    assert ignored + "\n" in err and json.loads(out)["warnings"] == [ignored]

def test_a_server_logs_its_notices_for_its_operator_naming_flags(tiny_models, tmp_path):
    from test_serve import ServerProcess, server_env

    server = ServerProcess(["--model", str(tiny_models["target"]), "--draft", "none", "--kv-type", "q8_0",
                            "--flash-attn", "off", "--threads", "1", "--n-ctx", "256"], server_env(tmp_path))
    server.stop()
    notice = [line for line in server.lines if "keys only" in line]
    assert len(notice) == 1 and notice[0].startswith("edgespec: the KV cache types apply"), server.lines  # its log
    assert notice[0].endswith("which --flash-attn off keeps off")
