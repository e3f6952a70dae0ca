"""Tiny, real GGUF models for fast and deterministic tests.

The files are genuine llama-architecture GGUF models with a small byte-level
BPE tokenizer and a chat template, so llama.cpp loads and runs them exactly
like a downloaded model, in milliseconds.  Weights are random but shaped so
that generation behaves like a (very dumb) language model:

* the residual stream is dominated by the current token's embedding, so greedy
  generation soon falls into short repetitive loops (good for n-gram drafting);
* the output matrix is scaled so a few tokens are clearly likely at each step;
* control tokens get zero output rows, so random generation never emits EOS or
  a role marker by accident; tests that need a stop use `stop` or max_tokens;
* non-ASCII byte tokens get small output rows, so generated text is mostly
  readable ASCII.

All models written with the same `vocab` share one tokenizer.  A model's
weights are drawn in a fixed order from `numpy.random.default_rng(seed)`:
embeddings and output first, then layer by layer, so a model with fewer
layers and the same seed is exactly the leading part of a deeper one.  That
is how `write_model_family` makes a draft that agrees with its target often,
but not always.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType

ROLES = ("system", "user", "assistant")

# Words whose BPE merges each vocabulary adds on top of the 256 byte tokens.
# The two lists differ so that "other" tokenizes text differently from "base".
_BASE_WORDS = (
    " the", " and", " to", " of", " a", " in", " is", " it", " that", " you",
    " for", " on", " with", "ing", "er", "ed", " hello", " world", "Hello",
    " The", "\n\n", " I", " be", " this", " was", " not", " cat", " sat",
)
_OTHER_WORDS = (" der", " die", " und", " ist", "ung", "en", " ein", "sch")

_VOCABS = {
    # name: (bos text, eos text, specials first?, byte order reversed?, words)
    "base": ("<|bos|>", "<|eos|>", True, False, _BASE_WORDS),
    "other": ("<s>", "</s>", False, True, _OTHER_WORDS),
}

_OUTPUT_SCALE = 0.5          # logit std ~ 0.5 * sqrt(n_embd): a few likely tokens
_LAYER_OUTPUT_SCALE = 0.25   # layers nudge, but do not drown, the token embedding
_RARE_BYTE_SCALE = 0.25      # non-ASCII byte tokens: possible but uncommon


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


_BYTE_CHARS = _bytes_to_unicode()


def _encode_bytes(text: str) -> str:
    return "".join(_BYTE_CHARS[b] for b in text.encode("utf-8"))


def _word_merges(words) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word, so every merge result is a token."""
    merges: list[tuple[str, str]] = []
    for word in words:
        chars = _encode_bytes(word)
        for end in range(2, len(chars) + 1):
            pair = (chars[: end - 1], chars[end - 1])
            if pair not in merges:
                merges.append(pair)
    return merges


def _chat_template(eos_text: str) -> str:
    turn = "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '" + eos_text + "\\n' }}"
    return (
        "{%- for message in messages -%}" + turn + "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
    )


class _Tokenizer:
    def __init__(self, vocab: str):
        if vocab not in _VOCABS:
            raise ValueError(f"unknown vocab {vocab!r}; choose one of {sorted(_VOCABS)}")
        bos, eos, specials_first, reverse_bytes, words = _VOCABS[vocab]
        specials = [bos, eos] + [f"<|{role}|>" for role in ROLES]
        byte_order = sorted(_BYTE_CHARS, reverse=reverse_bytes)
        byte_tokens = [_BYTE_CHARS[b] for b in byte_order]
        self.merges = _word_merges(words)
        merged = [left + right for left, right in self.merges]
        normal = byte_tokens + merged
        self.tokens = specials + normal if specials_first else normal + specials
        self.types = [
            TokenType.CONTROL if token in specials else TokenType.NORMAL for token in self.tokens
        ]
        self.bos_id = self.tokens.index(bos)
        self.eos_id = self.tokens.index(eos)
        self.chat_template = _chat_template(eos)
        assert len(set(self.tokens)) == len(self.tokens)

    def output_row_scales(self) -> np.ndarray:
        ascii_chars = {_BYTE_CHARS[b] for b in range(0x20, 0x7F)} | {_BYTE_CHARS[ord("\n")]}
        scales = np.ones(len(self.tokens), dtype=np.float32)
        for token_id, (token, kind) in enumerate(zip(self.tokens, self.types)):
            if kind == TokenType.CONTROL:
                scales[token_id] = 0.0
            elif len(token) == 1 and token not in ascii_chars:
                scales[token_id] = _RARE_BYTE_SCALE
        return scales


def _normal(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std))


def _tensors(rng, tokenizer, *, n_layer, n_embd, n_head, n_head_kv, n_ff):
    """Weights in numpy order (rows = ggml ne[1]), drawn in a fixed sequence."""
    n_vocab = len(tokenizer.tokens)
    n_embd_kv = n_embd // n_head * n_head_kv
    ones = np.ones(n_embd, dtype=np.float32)
    tensors = {"token_embd.weight": _normal(rng, n_vocab, n_embd, 1.0)}
    output = _normal(rng, n_vocab, n_embd, _OUTPUT_SCALE)
    tensors["output.weight"] = output * tokenizer.output_row_scales()[:, None]
    tensors["output_norm.weight"] = ones
    in_std = 1.0 / np.sqrt(n_embd)
    for layer in range(n_layer):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = ones
        tensors[prefix + "attn_q.weight"] = _normal(rng, n_embd, n_embd, in_std)
        tensors[prefix + "attn_k.weight"] = _normal(rng, n_embd_kv, n_embd, in_std)
        tensors[prefix + "attn_v.weight"] = _normal(rng, n_embd_kv, n_embd, in_std)
        tensors[prefix + "attn_output.weight"] = _normal(
            rng, n_embd, n_embd, _LAYER_OUTPUT_SCALE / np.sqrt(n_embd))
        tensors[prefix + "ffn_norm.weight"] = ones
        tensors[prefix + "ffn_gate.weight"] = _normal(rng, n_ff, n_embd, in_std)
        tensors[prefix + "ffn_up.weight"] = _normal(rng, n_ff, n_embd, in_std)
        tensors[prefix + "ffn_down.weight"] = _normal(
            rng, n_embd, n_ff, _LAYER_OUTPUT_SCALE / np.sqrt(n_ff))
    return tensors


def write_tiny_model(
    path,
    *,
    seed: int,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    vocab: str = "base",
    n_ctx_train: int = 4096,
    chat_template: str | None = None,
    key_length: int | None = None,
) -> Path:
    """Write a tiny llama GGUF model with F32 random weights; return its path.

    chat_template replaces the vocabulary's own template (a hostile one, say);
    key_length writes an explicit attention key length (for header readers only).
    """
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    path = Path(path)
    tokenizer = _Tokenizer(vocab)
    rng = np.random.default_rng(seed)
    tensors = _tensors(rng, tokenizer, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                       n_head_kv=n_head_kv, n_ff=n_ff)

    writer = GGUFWriter(path, "llama")
    writer.add_name(f"tiny-llama-{vocab}-L{n_layer}-s{seed}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokenizer.tokens))
    writer.add_tokenizer_model("gpt2")
    # "qwen2" is a byte-level BPE pre-tokenizer that llama.cpp runs without
    # clean-up of spaces before punctuation, so detokenize(tokenize(s)) == s.
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.types)
    writer.add_token_merges([f"{left} {right}" for left, right in tokenizer.merges])
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template if chat_template is not None else tokenizer.chat_template)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def vocab_size(vocab: str = "base") -> int:
    return len(_Tokenizer(vocab).tokens)


def bos_eos_ids(vocab: str = "base") -> tuple[int, int]:
    tokenizer = _Tokenizer(vocab)
    return tokenizer.bos_id, tokenizer.eos_id


TARGET_SEED = 1234
TARGET_LAYERS = 4
DRAFT_LAYERS = 2


def write_model_family(directory) -> dict[str, Path]:
    """Write target.gguf, draft.gguf (same tokenizer) and mismatch.gguf (other tokenizer).

    The draft is the target's own first layers (same seed, fewer layers), so
    it predicts the target's next token often but not always.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "target": write_tiny_model(directory / "target.gguf", seed=TARGET_SEED, n_layer=TARGET_LAYERS),
        "draft": write_tiny_model(directory / "draft.gguf", seed=TARGET_SEED, n_layer=DRAFT_LAYERS),
        "mismatch": write_tiny_model(directory / "mismatch.gguf", seed=TARGET_SEED + 1, vocab="other"),
    }
