"""The tiny GGUF fixtures load in real llama.cpp and behave as the other tests assume."""

from pathlib import Path

import jinja2
import llama_cpp
import numpy as np
import pytest

from tinygguf import write_model_family, write_tiny_model

ROUND_TRIP_TEXTS = [
    "hello world",
    "héllo 世界",
    "Hello, the cat sat on the mat.\n\nIt was not . Was it ?",
    "  leading and trailing spaces \t tab ",
    "emoji 🙂 and ünïcödé",
]


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> dict[str, Path]:
    return write_model_family(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(family) -> dict[str, llama_cpp.Llama]:
    loaded = {
        name: llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
        for name, path in family.items()
    }
    yield loaded
    for model in loaded.values():
        model.close()


def _vocabulary(model: llama_cpp.Llama) -> list[bytes]:
    return [model.detokenize([token], special=True) for token in range(model.n_vocab())]


def _last_probabilities(model: llama_cpp.Llama) -> np.ndarray:
    logits = np.asarray(model.scores[model.n_tokens - 1], dtype=np.float64)
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def _greedy(model: llama_cpp.Llama, prompt: list[int], n_tokens: int) -> list[int]:
    model.reset()
    model.eval(prompt)
    generated = []
    for _ in range(n_tokens):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        generated.append(token)
        model.eval([token])
    return generated


@pytest.mark.parametrize("name", ["target", "draft", "mismatch"])
def test_model_loads_and_gives_finite_peaked_logits(models, name):
    model = models[name]
    model.reset()
    model.eval(model.tokenize(b"hello world", add_bos=True))
    probabilities = _last_probabilities(model)
    assert np.all(np.isfinite(model.scores[model.n_tokens - 1]))
    assert probabilities.max() > 5.0 / model.n_vocab()


@pytest.mark.parametrize("name", ["target", "mismatch"])
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_utf8(models, name, text):
    model = models[name]
    tokens = model.tokenize(text.encode("utf-8"), add_bos=False)
    assert model.detokenize(tokens).decode("utf-8") == text


def test_merges_make_whole_word_tokens(models):
    model = models["target"]
    assert len(model.tokenize(b" hello world", add_bos=False)) == 2
    assert len(model.tokenize(" 世".encode("utf-8"), add_bos=False)) == 4


def test_bos_is_added_and_special_tokens_parse_as_one_token(models):
    model = models["target"]
    tokens = model.tokenize(b"<|user|>\nhi<|eos|>", add_bos=True, special=True)
    assert tokens[0] == model.token_bos()
    assert tokens[-1] == model.token_eos()
    assert model.detokenize(tokens[1:2], special=True) == b"<|user|>"
    assert model.detokenize(tokens[1:2], special=False) == b""


def test_target_and_draft_share_the_vocabulary_and_mismatch_does_not(models):
    target_vocab = _vocabulary(models["target"])
    assert _vocabulary(models["draft"]) == target_vocab
    assert _vocabulary(models["mismatch"]) != target_vocab
    assert models["mismatch"].n_vocab() != models["target"].n_vocab()


def test_chat_template_renders_turns_and_generation_prompt(models):
    template = jinja2.Environment().from_string(
        models["target"].metadata["tokenizer.chat_template"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|system|>\nBe brief.<|eos|>\n<|user|>\nhi<|eos|>\n<|assistant|>\n")
    assert template.render(messages=messages, add_generation_prompt=False).endswith("hi<|eos|>\n")


def _bigram_lookup_hit_rate(tokens: list[int], start: int) -> float:
    """How often the token after the latest earlier copy of the last two tokens comes next."""
    hits = 0
    for i in range(start, len(tokens)):
        earlier = [j for j in range(2, i) if tokens[j - 2:j] == tokens[i - 2:i]]
        hits += bool(earlier) and tokens[earlier[-1]] == tokens[i]
    return hits / (len(tokens) - start)


def test_greedy_generation_is_repetitive_and_avoids_control_tokens(models):
    model = models["target"]
    prompt = model.tokenize(b"<|user|>\nWrite a story<|eos|>\n<|assistant|>\n", add_bos=True, special=True)
    generated = _greedy(model, prompt, 128)
    assert _bigram_lookup_hit_rate(prompt + generated, len(prompt)) > 0.4
    control = {token for token in range(model.n_vocab()) if model.detokenize([token]) == b""}
    assert len(control) == 5
    assert not control & set(generated)


def test_draft_predicts_the_target_often_but_not_always(models):
    target, draft = models["target"], models["draft"]
    prompt = target.tokenize(b"hello world", add_bos=True)
    generated = _greedy(target, prompt, 48)
    draft.reset()
    draft.eval(prompt + generated)
    draft_choices = [int(np.argmax(draft.scores[len(prompt) - 1 + i])) for i in range(len(generated))]
    agreement = np.mean([a == b for a, b in zip(draft_choices, generated)])
    assert 0.2 < agreement < 0.95


def test_same_seed_gives_identical_bytes_and_other_seed_does_not(tmp_path, family):
    first = write_tiny_model(tmp_path / "a.gguf", seed=7)
    second = write_tiny_model(tmp_path / "b.gguf", seed=7)
    third = write_tiny_model(tmp_path / "c.gguf", seed=8)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes() != third.read_bytes()
    rewritten = write_model_family(tmp_path / "family")
    for name, path in family.items():
        assert rewritten[name].read_bytes() == path.read_bytes()


def test_unknown_vocab_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown vocab"):
        write_tiny_model(tmp_path / "x.gguf", seed=1, vocab="nope")
