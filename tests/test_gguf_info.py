import os
import struct
from unittest import mock

import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.gguf_info import read_gguf_info
from tinygguf import bos_eos_ids, vocab_size, write_tiny_model

TEMPLATE = "{{ messages[0]['content'] }}"
N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 8, 2, 1, 16


def write_tiny_gguf(path, **overrides):
    """A two-block file with a 256-token context: small enough to check every size by hand."""
    return write_tiny_model(path, seed=0, n_layer=2, n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=N_HEAD_KV, n_ff=N_FF,
                            n_ctx_train=256, chat_template=TEMPLATE, **overrides)


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_reads_metadata_of_a_written_file(tiny):
    info = read_gguf_info(tiny)
    assert info.path == tiny
    assert info.architecture == "llama"
    assert info.name == "tiny-llama-base-L2-s0"
    assert info.quantization == "F32"
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == (2, 8, 2, 1)
    assert info.head_dim == 4
    assert info.context_length == 256
    assert info.vocab_size == vocab_size()
    assert info.tokenizer_model == "gpt2"
    assert (info.bos_id, info.eos_id) == bos_eos_ids()
    assert info.chat_template == TEMPLATE
    assert info.file_size == os.path.getsize(tiny)
    assert info.array_lengths["tokenizer.ggml.tokens"] == vocab_size()


def test_tensor_sizes_agree_with_gguf_reader(tiny):
    info = read_gguf_info(tiny)
    reference = GGUFReader(tiny)
    assert info.tensor_bytes == sum(int(t.n_bytes) for t in reference.tensors)
    assert info.parameter_count == sum(int(t.n_elements) for t in reference.tensors)
    kv = N_EMBD // N_HEAD * N_HEAD_KV
    # two norms, q and output, k and v, gate, up and down: F32 each
    per_block = (2 * N_EMBD + 2 * N_EMBD * N_EMBD + 2 * kv * N_EMBD + 3 * N_FF * N_EMBD) * 4
    assert info.layer_tensor_bytes == (per_block, per_block)
    assert info.other_tensor_bytes == (2 * vocab_size() * N_EMBD + N_EMBD) * 4  # embeddings, output, output norm
    last = max(reference.tensors, key=lambda t: t.data_offset)
    assert info.file_size >= last.data_offset + last.n_bytes


def test_key_length_overrides_head_dim(tmp_path):
    info = read_gguf_info(write_tiny_gguf(tmp_path / "k.gguf", key_length=16))
    assert info.head_dim == 16


def test_missing_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="nope.gguf does not exist"):
        read_gguf_info(missing)


def test_non_gguf_file_is_rejected(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model at all, just some text\n" * 4)
    with pytest.raises(ModelFileError, match="notes.gguf is not a GGUF file") as caught:
        read_gguf_info(text)
    assert isinstance(caught.value, EdgespecError)
    assert "\n" not in str(caught.value)


def test_empty_file_is_rejected(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty.gguf is empty"):
        read_gguf_info(empty)


@pytest.mark.parametrize("keep", [16, 30, 200, -4])  # 16: it was "not a GGUF file (wrong magic bytes)"
def test_truncated_file_is_rejected(tiny, tmp_path, keep):
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])  # inside the counts, the KV block, the tensor infos, the weights
    with pytest.raises(ModelFileError, match="cut.gguf is truncated"):
        read_gguf_info(cut)


def test_an_architecture_name_holding_escapes_is_refused_not_shown(tmp_path):
    # `models import` and `models list` printed the header's string as it was: an ESC]2 in it retitled the terminal
    from gguf import GGUFWriter

    path = tmp_path / "hostile.gguf"
    writer = GGUFWriter(str(path), "llama\x1b]2;pwned\x07")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="names its architecture") as caught:
        read_gguf_info(path)
    assert "\x1b" not in str(caught.value) and "\\x1b" in str(caught.value)


def _text(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, value_type: GGUFValueType, fmt: str, value) -> bytes:
    payload = _text(value) if value_type == GGUFValueType.STRING else struct.pack("<" + fmt, value)
    return _text(key) + struct.pack("<I", value_type) + payload


def _tensor(name: str, dims: tuple[int, ...]) -> bytes:
    """An F32 tensor's info at data offset 0."""
    return _text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGMLQuantizationType.F32, 0)


def write_header(path, *kvs: bytes, tensors: tuple[bytes, ...] = ()):
    """A llama header as a hostile file could give it: GGUFWriter would not write most of these values.  It has
    one block unless kvs say otherwise (a later key wins, as in llama.cpp)."""
    kvs = (_kv("general.architecture", GGUFValueType.STRING, "", "llama"), _kv("llama.block_count", *_U32, 1), *kvs)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(header + bytes(64))  # the 32-byte alignment and one small tensor's data
    return path


_U32, _U64, _I32, _F32, _F64, _STR = (
    (GGUFValueType.UINT32, "I"), (GGUFValueType.UINT64, "Q"), (GGUFValueType.INT32, "i"),
    (GGUFValueType.FLOAT32, "f"), (GGUFValueType.FLOAT64, "d"), (GGUFValueType.STRING, ""),
)
# One level of a metadata value that is an array holding one array: thousands of these recursed until Python gave up
_ARRAY_OF_ONE_ARRAY = struct.pack("<IQ", GGUFValueType.ARRAY, 1)
_DEEP_ARRAYS = (_text("deep") + struct.pack("<I", GGUFValueType.ARRAY) + _ARRAY_OF_ONE_ARRAY * 5000
                + struct.pack("<IQ", GGUFValueType.UINT32, 0))


@pytest.mark.parametrize("kvs, tensors, problem", [
    ([_kv("general.alignment", *_U32, 0)], (), "gives general.alignment as 0, not a power of two"),  # ZeroDivisionError
    ([_kv("general.alignment", *_U32, 24)], (), "gives general.alignment as 24, not a power of two"),
    ([_kv("general.alignment", *_STR, "x")], (), "gives general.alignment as 'x', not a power of two"),  # TypeError
    ([_kv("llama.block_count", *_STR, "abc")], (), "gives llama.block_count as 'abc', not a whole number"),
    ([_kv("llama.block_count", *_I32, -1)], (), "gives llama.block_count as -1, not a whole number from 0 up"),
    # a list of 2**40 byte counts: MemoryError, and near 2**31 some 16 GB allocated first
    ([_kv("llama.block_count", *_U64, 2**40)], (), "gives llama.block_count as 1099511627776, more than the 512"),
    # llama.cpp aborts the process (GGML_ASSERT, exit 134) outside 1..512 blocks
    ([_kv("llama.block_count", *_U32, 513)], (), "gives llama.block_count as 513, more than the 512"),
    ([_kv("llama.block_count", *_U32, 0)], (), "gives no llama.block_count, or 0: a model has at least one block"),
    # the planner sized its buffers with it unchecked: a traceback, or a negative size that "fits"
    ([_kv("llama.feed_forward_length", *_STR, "big")], (), "gives llama.feed_forward_length as 'big', not a whole"),
    ([_kv("llama.feed_forward_length", *_I32, -5)], (), "gives llama.feed_forward_length as -5, not a whole"),
    ([_kv("llama.embedding_length", *_F64, float("nan"))], (), "gives llama.embedding_length as nan, not a whole"),
    ([_kv("llama.context_length", *_U64, 2**40)], (), "gives llama.context_length as 1099511627776, more than"),
    ([_kv("general.parameter_count", *_STR, "many")], (), "gives general.parameter_count as 'many', not a whole"),
    ([_kv("tokenizer.ggml.bos_token_id", *_F32, 1.5)], (), "gives tokenizer.ggml.bos_token_id as 1.5, not a whole"),
    ([_kv("general.file_type", *_STR, "\x1b]2;x\x07")], (), r"gives general.file_type as '\x1b]2;x\x07', not a whole"),
    ([_kv("general.name", *_U32, 7)], (), "gives general.name as 7, not text"),
    ([_DEEP_ARRAYS], (), "nests arrays more than 16 deep in its metadata"),  # RecursionError
    ([], (_tensor("blk.0.x", (1,) * 9),), "gives tensor 'blk.0.x' 9 dimensions; ggml has at most 4"),
])
def test_a_hostile_header_value_is_refused_in_one_line(tmp_path, kvs, tensors, problem):
    path = write_header(tmp_path / "hostile.gguf", *kvs, tensors=tensors)
    with pytest.raises(ModelFileError) as caught:
        read_gguf_info(path)
    message = str(caught.value)
    assert message.startswith(f"model file {path} {problem}") and "download it again" in message, message
    assert "\n" not in message and "\x1b" not in message


def _array(key: str, item_type: GGUFValueType, count: int, items: bytes = b"") -> bytes:
    return _text(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, item_type, count) + items


@pytest.mark.parametrize("kv", [
    # an OverflowError traceback: the next length was read at an offset past 2**63
    _array("huge", GGUFValueType.STRING, 3, _text("a") + struct.pack("<Q", 2**64 - 9)),
    _array("huge", GGUFValueType.STRING, 2**60),
    _array("huge", GGUFValueType.ARRAY, 2**60),
    _array("huge", GGUFValueType.FLOAT32, 2**60),
], ids=["string length near 2**64", "2**60 strings", "2**60 arrays", "2**60 floats"])
def test_a_header_claiming_more_than_the_file_holds_is_truncated(tmp_path, kv):
    path = write_header(tmp_path / "huge.gguf", kv)
    with pytest.raises(ModelFileError, match="is truncated: its GGUF header ends early"):
        read_gguf_info(path)


def test_a_long_metadata_array_is_stepped_over_not_read(tmp_path):
    # 5e7 floats took 2.2 GB and 16 s as a tuple of Python floats, only for their count to be kept
    floats = 3_000_000
    path = write_header(tmp_path / "scores.gguf", _array("tokenizer.ggml.scores", GGUFValueType.FLOAT32, floats,
                                                         bytes(4 * floats)))
    with mock.patch.object(struct, "unpack_from", wraps=struct.unpack_from) as unpack_from:
        info = read_gguf_info(path)
    assert info.array_lengths["tokenizer.ggml.scores"] == floats
    assert all(f"{floats}" not in str(call.args[0]) for call in unpack_from.call_args_list), "the floats were read"


def test_a_header_claiming_millions_of_tensors_is_refused_before_walking_them(tmp_path):
    header = b"GGUF" + struct.pack("<IQQ", 3, 2_000_000, 1) + _kv("general.architecture", *_STR, "llama")
    path = tmp_path / "many.gguf"
    path.write_bytes(header + _tensor("t", (1,)) * 1000)
    with pytest.raises(ModelFileError, match="claims 2,000,000 tensors and 1 metadata keys, more than the 65,536"):
        read_gguf_info(path)


def test_block_numbers_are_ascii_digits_only(tmp_path):
    # "²" is a digit to str.isdigit, but int() refuses it: a ValueError traceback
    odd_names = ("blk.².x", "blk." + "9" * 5000 + ".x")
    path = write_header(tmp_path / "odd.gguf", _kv("llama.block_count", *_U32, 2),
                        tensors=tuple(_tensor(name, (1,)) for name in ("blk.1.x", *odd_names)))
    info = read_gguf_info(path)
    assert info.layer_tensor_bytes == (0, 4) and info.other_tensor_bytes == 8


def test_header_sizes_no_context_could_hold_blame_the_file_not_the_context(tmp_path):
    # "a context of 512 tokens needs 70041.60 GiB ...: lower --n-ctx", which cannot go below 256
    from edgespec.loading import plan_load

    path = write_header(tmp_path / "wide.gguf", _kv("llama.embedding_length", *_U32, 2**32 - 1),
                        _kv("llama.attention.head_count", *_U32, 1), _kv("llama.context_length", *_U32, 4096))
    with pytest.raises(ModelFileError, match=f"model file {path} gives sizes whose KV cache outgrows this machine's"):
        plan_load(path, "none", n_ctx=256, pull=False)
