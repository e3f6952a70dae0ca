"""Read a GGUF file's header: metadata and tensor sizes, never the weights.

gguf_header.py walks the header's bytes; this module opens the file, checks
what the values mean (counts that size lists and sums, types, names shown to
the user) and sums the tensors' bytes per layer for the memory planner.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, LlamaFileType

from edgespec.errors import ModelFileError
from edgespec.gguf_header import (HeaderMalformed, HeaderTruncated, HeaderUnknownType, Tensor, UnreadArray,
                                  read_header)

# What an architecture name can hold (llama.cpp's: qwen2, llama, gemma3, t5encoder, ...): a header's
# string goes into model lists as it is, so one holding escape sequences is refused, not printed.
_ARCHITECTURE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# Bounds on header values that size what this module and the planner build.  llama.cpp loads from 1 to 512
# blocks (LLAMA_MAX_LAYERS) and aborts the whole process on any other count, so this module refuses them
# first; the largest released models have about 130.
_MAX_BLOCKS = 512
_MAX_UINT32 = 2**32 - 1  # llama.cpp reads the other architecture values into 32-bit fields
_MAX_UINT64 = 2**64 - 1


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str | None
    parameter_count: int
    file_type: int | None
    quantization: str  # e.g. "Q4_K_M"; "F16"; "unknown" when the file does not say
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    context_length: int
    vocab_size: int
    tokenizer_model: str | None
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    file_size: int
    tensor_bytes: int
    layer_tensor_bytes: tuple[int, ...]  # index i: bytes of all blk.i.* tensors
    other_tensor_bytes: int  # embeddings, output head, final norm
    # Scalar and string metadata by key; arrays are left out (see array_lengths).
    metadata: dict = field(default_factory=dict, compare=False, repr=False)
    array_lengths: dict = field(default_factory=dict, compare=False, repr=False)
    # Where the header ends and each tensor's data lies, in bytes from the file's start: (start, length)
    data_offset: int = field(default=0, compare=False, repr=False)
    tensor_spans: tuple = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's data lies in a GGUF file, for reading some of its rows (drafting heads)."""

    quant_type: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml's order: dims[0] is the length of a row
    offset: int  # from the start of the file
    n_bytes: int


def read_gguf_info(path: str | os.PathLike) -> GGUFInfo:
    """Metadata and per-layer tensor sizes of the GGUF file at ``path``."""
    path = Path(path)
    try:
        status = path.stat()
        if not (stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode)):  # a pipe waits for a writer
            raise ModelFileError(f"{path} is not a regular file, so not a model file; pass a .gguf file")
        file_size = status.st_size
        with open(path, "rb") as handle:
            if file_size == 0:
                raise ModelFileError(_problem(path, "is empty, not a GGUF model"))
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                try:
                    fields, tensors, data_offset = _read_header(buffer, path)
                except HeaderTruncated:
                    raise ModelFileError(_problem(path, "is truncated: its GGUF header ends early")) from None
    except FileNotFoundError:
        raise ModelFileError(f"model file {path} does not exist; check the path or run `edgespec models list`") from None
    except IsADirectoryError:
        raise ModelFileError(f"model file {path} is a directory; pass the .gguf file inside it") from None
    except PermissionError:
        raise ModelFileError(f"model file {path} is not readable; fix its permissions") from None
    data_end = data_offset + max((t.offset + t.n_bytes for t in tensors), default=0)
    if data_end > file_size:
        raise ModelFileError(
            _problem(path, f"is truncated: {file_size} bytes but its tensors need {data_end}")
        )
    return _build_info(path, file_size, fields, tensors, data_offset)


def _problem(path: Path, what: str) -> str:
    return f"model file {path} {what}; download it again (`edgespec models pull NAME`) or pick another file"


def _read_header(buffer, path: Path) -> tuple[dict, list[Tensor], int]:
    """gguf_header's read, its refusals worded as this file's, and the data section's offset."""
    try:
        fields, tensors, header_end = read_header(buffer)
    except HeaderMalformed as error:
        raise ModelFileError(_problem(path, str(error))) from None
    except HeaderUnknownType as error:
        raise ModelFileError(f"model file {path} has a header this gguf package cannot parse ({error}); "
                             "upgrade it with `pip install -U gguf` or pick another file") from None
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    # gguf.cpp refuses an alignment that is not a power of two; 0 would divide by zero below
    if not _is_whole(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(_problem(path, f"gives general.alignment as {_shown(alignment)}, not a power of two"))
    return fields, tensors, -(-header_end // alignment) * alignment


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # a GGUF bool reads as a Python bool


def _shown(value) -> str:
    """A header value for an error message: repr escapes control characters, and a long string is cut."""
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, (int, float)):
        return repr(value)
    return "an array"


def _whole(path: Path, key: str, value, limit: int) -> int:
    """value, if it is a whole number from 0 to limit: a header's counts size lists and sums."""
    if not _is_whole(value) or value < 0:
        raise ModelFileError(_problem(path, f"gives {key} as {_shown(value)}, not a whole number from 0 up"))
    if value > limit:
        raise ModelFileError(_problem(path, f"gives {key} as {value}, more than the {limit:,} any model comes near"))
    return value


def _optional(path: Path, fields: dict, key: str, kind: type):
    """The value of key if the file gives one of this kind (str or int), or None if it gives none."""
    value = fields.get(key)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    wanted = "text" if kind is str else "a whole number"
    raise ModelFileError(_problem(path, f"gives {key} as {_shown(value)}, not {wanted}"))


def read_tensor_locations(path: str | os.PathLike) -> dict[str, TensorLocation]:
    """Every tensor of the GGUF file at path, by name: its type, shape and where its data lies."""
    path = Path(path)
    read_gguf_info(path)  # one clear line for a missing, truncated or foreign file
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        _, tensors, data_offset = _read_header(buffer, path)
    return {t.name: TensorLocation(t.quant_type, t.dims, data_offset + t.offset, t.n_bytes) for t in tensors}


def _build_info(path: Path, file_size: int, fields: dict, tensors: list[Tensor], data_offset: int) -> GGUFInfo:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(_problem(path, "has no general.architecture key, so it is not a model"))
    if not _ARCHITECTURE_NAME.fullmatch(arch):
        raise ModelFileError(_problem(path, f"names its architecture {arch[:40]!r}, which no model is"))

    def arch_int(key: str, default: int = 0, limit: int = _MAX_UINT32) -> int:
        key = f"{arch}.{key}"
        value = fields.get(key, default)
        # Some architectures give per-layer head counts; the largest bounds memory.
        if isinstance(value, tuple):
            return max((_whole(path, key, each, limit) for each in value), default=default)
        return _whole(path, key, value, limit)

    n_embd = arch_int("embedding_length")
    n_head = arch_int("attention.head_count")
    n_layer = arch_int("block_count", limit=_MAX_BLOCKS)
    if n_layer == 0:
        raise ModelFileError(_problem(path, f"gives no {arch}.block_count, or 0: a model has at least one block"))
    arch_int("feed_forward_length")  # only checked: the planner sizes buffers with it
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab_size = arch_int("vocab_size", tokens.length if isinstance(tokens, UnreadArray) else 0)
    layer_bytes, other_bytes = _bytes_by_layer(tensors, n_layer)
    file_type = _optional(path, fields, "general.file_type", int)
    parameter_count = fields.get("general.parameter_count", sum(t.n_elements for t in tensors))
    return GGUFInfo(
        path=path,
        architecture=arch,
        name=_optional(path, fields, "general.name", str),
        parameter_count=_whole(path, "general.parameter_count", parameter_count, _MAX_UINT64),
        file_type=file_type,
        quantization=_quantization_name(file_type),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=arch_int("attention.head_count_kv", n_head),
        head_dim=arch_int("attention.key_length", n_embd // n_head if n_head else 0),
        context_length=arch_int("context_length"),
        vocab_size=vocab_size,
        tokenizer_model=_optional(path, fields, "tokenizer.ggml.model", str),
        bos_id=_optional(path, fields, "tokenizer.ggml.bos_token_id", int),
        eos_id=_optional(path, fields, "tokenizer.ggml.eos_token_id", int),
        chat_template=_optional(path, fields, "tokenizer.chat_template", str),
        file_size=file_size,
        tensor_bytes=sum(t.n_bytes for t in tensors),
        layer_tensor_bytes=tuple(layer_bytes),
        other_tensor_bytes=other_bytes,
        metadata={k: v for k, v in fields.items() if not isinstance(v, (tuple, UnreadArray))},
        array_lengths={k: (v.length if isinstance(v, UnreadArray) else len(v))
                       for k, v in fields.items() if isinstance(v, (tuple, UnreadArray))},
        data_offset=data_offset,
        tensor_spans=tuple((data_offset + t.offset, t.n_bytes) for t in tensors),
    )


def _bytes_by_layer(tensors: list[Tensor], n_layer: int) -> tuple[list[int], int]:
    """Bytes of each block's tensors, and of the rest (embeddings, output head, final norm)."""
    layer_bytes = [0] * n_layer
    other_bytes = 0
    for tensor in tensors:
        block = _block_index(tensor.name)
        if block is not None and block < n_layer:
            layer_bytes[block] += tensor.n_bytes
        else:
            other_bytes += tensor.n_bytes
    return layer_bytes, other_bytes


def _block_index(tensor_name: str) -> int | None:
    parts = tensor_name.split(".", 2)
    # str.isdigit also takes "²", and int() refuses more than 4300 digits: only a short ASCII number is a block
    if len(parts) >= 2 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() and len(parts[1]) < 10:
        return int(parts[1])
    return None


def _quantization_name(file_type: int | None) -> str:
    if file_type is None:
        return "unknown"
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"type {file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
