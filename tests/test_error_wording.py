"""An error names what its reader can change, in the reader's own words.

A library user reads the Python parameter (`raise n_ctx`, `draft='ngram'`);
the command line and the chat app their flags (`--n-ctx`, `--draft ngram`),
worded as before; a server's client the request or the server's flags.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import edgespec
from edgespec.commands import main as cli_main
from edgespec.commands.batch.requests import failure_text
from edgespec.errors import ChatTemplateError, ContextOverflowError, EdgespecError, Setting, as_flag
from edgespec.server.protocol import worded_for_requests

TOO_LONG = "word " * 600  # more tokens than a 256-token context holds


def overflow() -> ContextOverflowError:
    return ContextOverflowError("too long (raise ", Setting("n_ctx"), " or use ", Setting("draft", "ngram"), ")")


def test_str_names_the_parameter_and_the_command_line_its_flag():
    assert str(overflow()) == "too long (raise n_ctx or use draft='ngram')"
    assert overflow().worded(as_flag) == "too long (raise --n-ctx or use --draft ngram)"
    flags = [as_flag(Setting(name)) for name in ("n_threads", "n_gpu_layers", "kv_type", "memory_budget")]
    assert flags == ["--threads", "--gpu-layers", "--kv-type", "--memory-budget"]
    assert as_flag(Setting("flash_attn", True)) == "--flash-attn"
    assert as_flag(Setting("flash_attn", "off")) == "--flash-attn off"


def test_a_request_reads_the_server_flag_and_a_raw_prompt_as_a_completions_request():
    template = ChatTemplateError("the template failed (use ", Setting("raw", True), " to send the prompt as is)")
    assert worded_for_requests(template) == 'the template failed (use a "/v1/completions" request to send the prompt as is)'
    assert worded_for_requests(overflow()) == "too long (raise the server's --n-ctx or use the server's --draft ngram)"
    assert failure_text(overflow()) == "too long (raise --n-ctx or use --draft ngram)"  # a batch's own flags
    assert failure_text("bad sampling setting: top_p ...") == "bad sampling setting: top_p ..."


@pytest.fixture(scope="module")
def engine(tiny_models):
    with edgespec.load(str(tiny_models["target"]), "ngram", pull=False, n_ctx=256, n_threads=1,
                       cost_curve=(1.0, 1.2, 1.4, 1.6)) as engine:
        yield engine


def test_the_library_names_parameters_not_flags(engine, tiny_models):
    with pytest.raises(ContextOverflowError) as too_long:
        engine.generate(TOO_LONG, max_tokens=4, raw=True)
    assert "(raise n_ctx or shorten the prompt)" in str(too_long.value) and "--" not in str(too_long.value)
    with pytest.raises(EdgespecError) as unavailable:
        engine.configure(mode="draft-model")
    assert str(unavailable.value).endswith("draft-model needs a draft model: give its GGUF file as draft)")
    target = str(tiny_models["target"])
    with pytest.raises(EdgespecError, match=r"^flash_attn='on' and bit_exact=True cannot go together"):
        edgespec.load(target, "ngram", pull=False, flash_attn=True, bit_exact=True)
    with pytest.raises(EdgespecError, match=r"^draft_kv_type must be one of f16, q8_0, q4_0, not 'q5_0'"):
        edgespec.load(target, "ngram", pull=False, draft_kv_type="q5_0")


def cli_error(argv: list[str]) -> str:
    """The last line the command wrote on stderr (its error, after any notices)."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli_main(argv) != 0
    return err.getvalue().splitlines()[-1]


def test_the_command_line_still_names_its_flags(tiny_models, tmp_path):
    model = ["--model", str(tiny_models["target"]), "--draft", "none", "--threads", "1", "--n-ctx", "256"]
    line = cli_error(["run", TOO_LONG, "--raw", "--max-tokens", "4", *model])
    assert line.startswith("edgespec: the prompt is too long: it has ") and line.endswith("(raise --n-ctx or shorten the prompt)")
    assert cli_error(
        ["run", "x", *model, "--flash-attn", "--bit-exact"]).startswith("edgespec: --flash-attn on and --bit-exact cannot go")

    batch_in, batch_out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_in.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": TOO_LONG, "max_tokens": 4}}) + "\n")
    cli_error(["batch", str(batch_in), "-o", str(batch_out), *model, "--no-prompt-cache"])
    message = json.loads(batch_out.read_text())["error"]["message"]
    assert message.startswith("line 1: ") and "(raise --n-ctx or shorten the prompt)" in message
