"""Prompts as the model reads them: a template's bos_token and eos_token are the model's own tokens, the BOS
token comes once whoever writes it, and message contents stay text.  The engine and `edgespec heads train`
both build their prompts here."""

from __future__ import annotations

import pytest

from edgespec.backend import LlamaModel
from edgespec.errors import ContextOverflowError
from edgespec.prompts import MAX_PROMPT_BYTES_PER_TOKEN, PromptBuilder
from tinygguf import bos_eos_ids, write_tiny_model

BOS, EOS = bos_eos_ids()
CONVERSATION = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                {"role": "user", "content": "and now?"}]

# the tiny vocabulary's own template spells its turn ends out; these say the same through the variables
TURNS_END_WITH_EOS_TOKEN = ("{%- for m in messages -%}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
                            "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}")
WRITES_BOS_TOKEN = "{{ bos_token }}" + TURNS_END_WITH_EOS_TOKEN
CONTENT_FIRST = "{%- for m in messages -%}{{ m['content'] + '\\n' }}{%- endfor -%}"


@pytest.fixture(scope="module")
def builders(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prompts")
    templates = {"own": None, "eos_token": TURNS_END_WITH_EOS_TOKEN, "bos_token": WRITES_BOS_TOKEN,
                 "content first": CONTENT_FIRST}
    models = {name: LlamaModel(write_tiny_model(directory / f"{name.replace(' ', '-')}.gguf", seed=5,
                                                chat_template=source), n_ctx=256, n_threads=1)
              for name, source in templates.items()}
    yield {name: PromptBuilder(model) for name, model in models.items()}
    for model in models.values():
        model.close()


def test_a_template_that_ends_turns_with_eos_token_gets_the_models_end_token(builders):
    through_variable = builders["eos_token"].chat_tokens(CONVERSATION)
    assert through_variable.count(EOS) == 3  # each turn's end, a control token, not nothing
    assert through_variable == builders["own"].chat_tokens(CONVERSATION)


def test_a_template_that_writes_the_bos_token_gets_no_second_one(builders):
    written = builders["bos_token"].chat_tokens(CONVERSATION)
    assert written[0] == BOS and written.count(BOS) == 1
    assert written == builders["own"].chat_tokens(CONVERSATION)  # where the tokenizer adds it


def test_a_message_that_spells_the_bos_token_stays_text_and_the_real_one_is_added(builders):
    builder = builders["content first"]
    tokens = builder.chat_tokens([{"role": "user", "content": "<|bos|>hello"}], add_generation_prompt=False)
    assert tokens[0] == BOS and tokens.count(BOS) == 1
    assert tokens[1:] == builder.model.tokenize("<|bos|>hello\n", add_special=False)


@pytest.mark.parametrize("raw", [True, False])
def test_a_prompt_no_context_could_hold_is_refused_before_the_tokenizer_reads_it(builders, raw, monkeypatch):
    # a 30 MB /v1/completions prompt in a batch was tokenized whole (17 s, 1.3 GB) before the context refused it
    builder = builders["own"]
    monkeypatch.setattr(builder.model, "tokenize", lambda *args, **kwargs: pytest.fail("tokenized"))
    with pytest.raises(ContextOverflowError, match="maximum context length is 256 tokens"):
        builder.user_prompt_tokens("x" * (256 * MAX_PROMPT_BYTES_PER_TOKEN + 1), raw=raw)
