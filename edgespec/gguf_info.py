"""Read a GGUF file's header: metadata and tensor sizes, never the weights.

gguf.GGUFReader builds a numpy object for every one of the ~300k strings in a
Qwen2.5 vocabulary and merge list, which takes seconds.  The header layout is
simple, so this module walks it over an mmap, skipping string arrays by their
length prefixes, and uses the gguf package for the type tables and key names.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
)

from edgespec.errors import ModelFileError

# What an architecture name can hold (llama.cpp's: qwen2, llama, gemma3, t5encoder, ...): a header's
# string goes into model lists as it is, so one holding escape sequences is refused, not printed.
_ARCHITECTURE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# Bounds on header values that size what this module and the planner build.  llama.cpp loads from 1 to 512
# blocks (LLAMA_MAX_LAYERS) and aborts the whole process on any other count, so this module refuses them
# first; the largest released models have about 130.
_MAX_BLOCKS = 512
# Far more tensors and metadata keys than any model has (a large MoE has a few thousand tensors): a header
# claiming millions took seconds and hundreds of MB to walk before anything could be said about it.
_MAX_TENSORS = 65_536
_MAX_KEYS = 65_536
# Arrays up to this long are read (per-layer head counts); longer ones (a vocabulary's scores and token
# types) are skipped by their length, as string arrays are, so a header's arrays cost no memory.
_MAX_ARRAY_READ = _MAX_BLOCKS
_MAX_UINT32 = 2**32 - 1  # llama.cpp reads the other architecture values into 32-bit fields
_MAX_UINT64 = 2**64 - 1
_MAX_ARRAY_DEPTH = 16  # llama.cpp refuses arrays of arrays outright; the gguf package reads them, so allow a few
_MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS: more dimensions than ggml has

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


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
class _Tensor:
    name: str
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the data section
    quant_type: GGMLQuantizationType = GGMLQuantizationType.F32
    dims: tuple[int, ...] = ()  # ggml's order: dims[0] is the length of a row


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's data lies in a GGUF file, for reading some of its rows (drafting heads)."""

    quant_type: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml's order: dims[0] is the length of a row
    offset: int  # from the start of the file
    n_bytes: int


class _Truncated(Exception):
    pass


class _Malformed(Exception):
    """A header value no GGUF writer produces; the message says which, worded to follow "model file X"."""


class _HeaderWalker:
    """Sequential reads over a buffer; running past its end means a truncated file."""

    def __init__(self, buffer, byte_order: str):
        self.buffer = buffer
        self.byte_order = byte_order
        self.offset = 0

    def many(self, count: int, fmt: str) -> tuple:
        layout = f"{self.byte_order}{count}{fmt}"
        try:
            values = struct.unpack_from(layout, self.buffer, self.offset)
        except struct.error as error:
            raise _Truncated from error
        self.offset += struct.calcsize(layout)
        return values

    def unpack(self, fmt: str):
        return self.many(1, fmt)[0]

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise _Truncated
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip(self, count: int, item_bytes: int) -> None:
        """Step over count items of item_bytes each (at least that many, for items of their own length)."""
        end = self.offset + count * item_bytes
        if end > len(self.buffer):
            raise _Truncated
        self.offset = end

    def skip_strings(self, count: int) -> None:
        unpack_length = struct.Struct(self.byte_order + "Q").unpack_from
        offset, size = self.offset, len(self.buffer)
        if count * 8 > size - offset:  # each string has its 8-byte length: a count of 2**60 ends here
            raise _Truncated
        try:
            for _ in range(count):
                offset += 8 + unpack_length(self.buffer, offset)[0]
                if offset > size:  # before a length near 2**64 reaches unpack_from as an offset
                    raise _Truncated
        except struct.error as error:
            raise _Truncated from error
        self.offset = offset

    def value(self, value_type: int, depth: int = 0):
        """One metadata value; string arrays come back as their length only."""
        value_type = GGUFValueType(value_type)
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.unpack("I"))
            count = self.unpack("Q")
            if item_type == GGUFValueType.STRING:
                self.skip_strings(count)
                return _UnreadArray(count)
            if item_type == GGUFValueType.ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:  # thousands deep would exhaust Python's stack
                    raise _Malformed(f"nests arrays more than {_MAX_ARRAY_DEPTH} deep in its metadata")
                if count * 12 > len(self.buffer) - self.offset:  # each array has a type and a count
                    raise _Truncated
                return tuple(self.value(item_type, depth + 1) for _ in range(count))
            item_format = _SCALAR_FORMATS[item_type]
            if count > _MAX_ARRAY_READ:
                self.skip(count, struct.calcsize(item_format))
                return _UnreadArray(count)
            return self.many(count, item_format)
        return self.unpack(_SCALAR_FORMATS[value_type])


@dataclass(frozen=True)
class _UnreadArray:
    """A metadata array stepped over, not read: strings, or more items than any value this module uses."""

    length: int


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
                except _Truncated:
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


def _read_header(buffer, path: Path) -> tuple[dict, list[_Tensor], int]:
    if len(buffer) < 4 or struct.unpack_from("<I", buffer, 0)[0] != GGUF_MAGIC:
        raise ModelFileError(_problem(path, "is not a GGUF file (wrong magic bytes)"))
    if len(buffer) < 24:  # the magic, then less than the version and the two counts
        raise _Truncated
    byte_order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine
        byte_order = ">"
        version = struct.unpack_from(">I", buffer, 4)[0]
    if version not in (2, 3):
        raise ModelFileError(_problem(path, f"uses GGUF version {version}; only versions 2 and 3 are supported"))
    walker = _HeaderWalker(buffer, byte_order)
    walker.offset = 8
    tensor_count, kv_count = walker.many(2, "Q")
    if tensor_count > _MAX_TENSORS or kv_count > _MAX_KEYS:
        raise ModelFileError(_problem(path, f"claims {tensor_count:,} tensors and {kv_count:,} metadata keys, more "
                                            f"than the {_MAX_TENSORS:,} of each any model comes near"))
    fields = {}
    try:
        for _ in range(kv_count):
            key = walker.string()
            fields[key] = walker.value(walker.unpack("I"))
        tensors = [_read_tensor_info(walker) for _ in range(tensor_count)]
    except (ValueError, KeyError) as error:  # unknown value or tensor type codes
        raise ModelFileError(
            f"model file {path} has a header this gguf package cannot parse ({error}); "
            "upgrade it with `pip install -U gguf` or pick another file"
        ) from None
    except _Malformed as error:
        raise ModelFileError(_problem(path, str(error))) from None
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    # gguf.cpp refuses an alignment that is not a power of two; 0 would divide by zero below
    if not _is_whole(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(_problem(path, f"gives general.alignment as {_shown(alignment)}, not a power of two"))
    data_offset = -(-walker.offset // alignment) * alignment
    return fields, tensors, data_offset


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


def _read_tensor_info(walker: _HeaderWalker) -> _Tensor:
    name = walker.string()
    n_dims = walker.unpack("I")
    if n_dims > _MAX_TENSOR_DIMS:  # a million dimensions would take minutes to multiply out
        raise _Malformed(f"gives tensor {name[:40]!r} {n_dims} dimensions; ggml has at most {_MAX_TENSOR_DIMS}")
    dims = walker.many(n_dims, "Q")
    quant_type = GGMLQuantizationType(walker.unpack("I"))
    offset = walker.unpack("Q")
    n_elements = 1
    for dim in dims:
        n_elements *= dim
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    return _Tensor(name, n_elements, n_elements * type_size // block_size, offset, quant_type, tuple(dims))


def read_tensor_locations(path: str | os.PathLike) -> dict[str, TensorLocation]:
    """Every tensor of the GGUF file at path, by name: its type, shape and where its data lies."""
    path = Path(path)
    read_gguf_info(path)  # one clear line for a missing, truncated or foreign file
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        _, tensors, data_offset = _read_header(buffer, path)
    return {t.name: TensorLocation(t.quant_type, t.dims, data_offset + t.offset, t.n_bytes) for t in tensors}


def _build_info(path: Path, file_size: int, fields: dict, tensors: list[_Tensor], data_offset: int) -> GGUFInfo:
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
    vocab_size = arch_int("vocab_size", tokens.length if isinstance(tokens, _UnreadArray) else 0)
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
        metadata={k: v for k, v in fields.items() if not isinstance(v, (tuple, _UnreadArray))},
        array_lengths={k: (v.length if isinstance(v, _UnreadArray) else len(v))
                       for k, v in fields.items() if isinstance(v, (tuple, _UnreadArray))},
        data_offset=data_offset,
        tensor_spans=tuple((data_offset + t.offset, t.n_bytes) for t in tensors),
    )


def _bytes_by_layer(tensors: list[_Tensor], n_layer: int) -> tuple[list[int], int]:
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
