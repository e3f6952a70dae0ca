"""The Python API as the README shows it: edgespec.load, generate, stream and chat."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import edgespec
from edgespec.chat_template import ChatTemplate
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("\n## Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_and_prints_only_its_own_output(smollm2_path, monkeypatch, capsys):
    code = readme_example()
    code = code.replace('MODEL = "qwen2.5-coder-1.5b-instruct"', f"MODEL = {str(smollm2_path)!r}")
    load = edgespec.load
    # the test machine downloads nothing: n-grams instead of the catalog's draft model
    monkeypatch.setattr(edgespec, "load", lambda model, draft: load(model, "ngram", pull=False, n_ctx=1024))
    exec(compile(code, "README.md", "exec"), {})
    out, err = capsys.readouterr()
    assert "tok/s" in out and "tokens)" in out
    assert err == ""  # library use prints nothing on stderr


@pytest.fixture(scope="module")
def engine(tiny_models):
    with edgespec.load(str(tiny_models["target"]), "ngram", pull=False, n_ctx=512, n_threads=1,
                       cost_curve=(1.0, 1.2, 1.4, 1.6)) as engine:
        yield engine


def test_a_model_file_whose_name_is_not_utf8_loads(tiny_models, tmp_path):
    # its path went to llama.cpp encoded as UTF-8, which a Latin-1 name (surrogates to Python) cannot be: a traceback
    import os
    import shutil

    latin1 = Path(os.fsdecode(bytes(tmp_path) + b"/sm\xf6l.gguf"))
    shutil.copyfile(tiny_models["target"], latin1)
    with edgespec.load(str(latin1), "none", pull=False, n_ctx=256, n_threads=1, cost_curve=(1.0, 1.2)) as engine:
        assert engine.generate("one two", max_tokens=2, raw=True).stats.tokens_generated >= 1


def test_keyword_sampling_is_the_same_as_sampling_params(engine):
    by_keywords = engine.generate("one two three", max_tokens=8, temperature=0.7, seed=3, raw=True)
    by_params = engine.generate("one two three", SamplingParams(max_tokens=8, temperature=0.7, seed=3), raw=True)
    changed = engine.generate("one two three", SamplingParams(max_tokens=99, temperature=0.7, seed=3), raw=True,
                              max_tokens=8)
    assert by_keywords.token_ids == by_params.token_ids == changed.token_ids
    assert by_keywords.stats.tokens_generated <= 8


def test_stream_chunks_add_up_to_the_result(engine):
    chunks = list(engine.stream("one two three", max_tokens=10, temperature=0, raw=True))
    assert "".join(chunk.text for chunk in chunks) == chunks[-1].result.text
    assert chunks[-1].stats == chunks[-1].result.stats


def test_a_bad_sampling_argument_names_the_parameter(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("x", temperature=-1)
    with pytest.raises(TypeError, match="tempreature"):
        engine.generate("x", tempreature=0)


@pytest.mark.parametrize("options, named", [
    ({"n_ctx": "4096"}, "n_ctx must be a whole number from 256"),
    ({"n_ctx": 10}, "n_ctx must be a whole number from 256"),
    ({"parallel": 0}, "parallel must be a whole number from 1"),
    ({"n_gpu_layers": -2}, "gpu_layers must be a whole number from -1"),
])
def test_a_size_the_command_line_refuses_is_refused_before_loading(tiny_models, options, named):
    # a string met a comparison's TypeError deep in the planner; a tiny context llama.cpp's own failure
    with pytest.raises(EdgespecError, match=named):
        edgespec.load(str(tiny_models["target"]), "none", pull=False, n_threads=1, **options)


def test_a_model_that_is_no_path_is_named_as_such():
    with pytest.raises(TypeError, match="catalog name or a GGUF path, not NoneType"):
        edgespec.load(None)


@pytest.mark.parametrize("options, error, named", [
    ({"draft": 5}, TypeError, "draft must be "),
    ({"notice": 5}, TypeError, "notice must be a function"),
    ({"pull": "no"}, EdgespecError, "pull must be True or False, not 'no'"),
    ({"progress": 1}, EdgespecError, "progress must be True or False"),
    ({"n_threads": 0}, EdgespecError, "n_threads must be a whole number"),
])
def test_a_load_argument_of_the_wrong_kind_is_named_before_loading(tiny_models, options, error, named):
    # draft=5 failed deep in pathlib, notice=5 at the first notice, pull="no" was read as True, and n_threads was
    # called threads
    arguments = {"draft": "none", "pull": False, "n_threads": 1, **options}
    with pytest.raises(error, match=named):
        edgespec.load(str(tiny_models["target"]), **arguments)


def test_loading_prints_nothing_and_tells_the_logger(tiny_models, caplog):
    stderr = io.StringIO()
    with caplog.at_level("INFO", logger="edgespec"), contextlib.redirect_stderr(stderr):
        edgespec.load(str(tiny_models["target"]), "ngram", pull=False, n_ctx=512, n_threads=1).close()
    assert stderr.getvalue() == ""
    assert any("measuring this model's speed" in record.message for record in caplog.records)


@pytest.mark.parametrize("messages, named", [
    ([{"role": "user", "content": None}], "messages[0].content must be a string or a list of text parts, not NoneType"),
    ([{"role": "user", "content": "Hi"}, "Hello"], "messages[1] must be a dict with a string role and content"),
    ([{"content": "Hi"}], "messages[0] must be a dict with a string role and content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content must be"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}],
     "messages[1].content holds a lone UTF-16 surrogate ('\\ud800' at character 1)"),
    ([{"role": "us\udfffer", "content": "ok"}], "messages[0].role holds a lone UTF-16 surrogate"),
])
def test_a_malformed_message_is_named_before_the_template_runs(messages, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ChatTemplate(None, bos_token="", eos_token="").render(messages)


@pytest.mark.parametrize("call, named", [
    (lambda engine: engine.generate("a\ud800", max_tokens=1), "the prompt holds a lone UTF-16 surrogate"),
    (lambda engine: engine.generate("a\ud800", max_tokens=1, raw=True), "the prompt holds a lone UTF-16 surrogate"),
    (lambda engine: engine.generate("hi", max_tokens=1, prediction={"type": "content", "content": "\udfff"}),
     "the prediction holds a lone UTF-16 surrogate"),
])
def test_a_lone_surrogate_is_named_not_met_as_the_encoders_error(engine, call, named):
    # UnicodeEncodeError from deep in the tokenizer, with a position in the rendered template's text
    with pytest.raises(ValueError, match=named) as caught:
        call(engine)
    assert not isinstance(caught.value, UnicodeError)


def test_text_parts_are_joined_as_the_server_joins_them():
    template = ChatTemplate(None, bos_token="", eos_token="")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert template.render(parts) == template.render([{"role": "user", "content": "Hello"}])
