"""Write small but real GGUF files with gguf.GGUFWriter for the model tests."""

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType

TOKENS = ["<s>", "</s>", "a", "b", "ab", "é"]


def write_tiny_gguf(path: Path, *, n_layer: int = 2, n_embd: int = 8, n_head: int = 2,
                    n_head_kv: int = 1, key_length: int | None = None) -> Path:
    """A two-block llama-shaped file: enough header and tensors for gguf_info."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_block_count(n_layer)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.random((len(TOKENS), n_embd), dtype=np.float32))
    for block in range(n_layer):
        writer.add_tensor(f"blk.{block}.attn_q.weight", rng.random((n_embd, n_embd), dtype=np.float32))
        writer.add_tensor(f"blk.{block}.attn_norm.weight", rng.random(n_embd, dtype=np.float32))
    writer.add_tensor("output_norm.weight", rng.random(n_embd, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
