"""The byte layout of a GGUF file's header: its key/value pairs and tensor infos, walked over a buffer.

gguf.GGUFReader builds a numpy object for every one of the ~300k strings in a
Qwen2.5 vocabulary and merge list, which takes seconds.  The header layout is
simple, so this module walks it over an mmap, skipping string arrays by their
length prefixes (and long arrays of numbers by their size), and uses the gguf
package for the type tables.  What the values mean is gguf_info.py's.  The
header is untrusted: every count is checked against what the buffer holds
before anything is built for it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Far more tensors and metadata keys than any model has (a large MoE has a few thousand tensors): a header
# claiming millions took seconds and hundreds of MB to walk before anything could be said about it.
MAX_TENSORS = 65_536
MAX_KEYS = 65_536
# Arrays up to this long are read (per-layer head counts, one per block: llama.cpp loads at most 512);
# longer ones (a vocabulary's scores and token types) are stepped over by their length, as string arrays
# are, so a header's arrays cost no memory.
_MAX_ARRAY_READ = 512
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


class HeaderTruncated(Exception):
    """The header runs past the end of the file."""


class HeaderMalformed(Exception):
    """A header value no GGUF writer produces; the message says which, worded to follow "model file X"."""


class HeaderUnknownType(Exception):
    """A value or tensor type code this gguf package does not know (a newer GGUF, or a damaged one)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the data section
    quant_type: GGMLQuantizationType = GGMLQuantizationType.F32
    dims: tuple[int, ...] = ()  # ggml's order: dims[0] is the length of a row


@dataclass(frozen=True)
class UnreadArray:
    """A metadata array stepped over, not read: strings, or more items than any value gguf_info uses."""

    length: int


def read_header(buffer) -> tuple[dict, list[Tensor], int]:
    """The header's metadata by key (string arrays and long arrays as UnreadArray), its tensor infos, and
    the offset where it ends (before the data section's alignment)."""
    if len(buffer) < 4 or struct.unpack_from("<I", buffer, 0)[0] != GGUF_MAGIC:
        raise HeaderMalformed("is not a GGUF file (wrong magic bytes)")
    if len(buffer) < 24:  # the magic, then less than the version and the two counts
        raise HeaderTruncated
    byte_order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine
        byte_order = ">"
        version = struct.unpack_from(">I", buffer, 4)[0]
    if version not in (2, 3):
        raise HeaderMalformed(f"uses GGUF version {version}; only versions 2 and 3 are supported")
    walker = _HeaderWalker(buffer, byte_order)
    walker.offset = 8
    tensor_count, kv_count = walker.many(2, "Q")
    if tensor_count > MAX_TENSORS or kv_count > MAX_KEYS:
        raise HeaderMalformed(f"claims {tensor_count:,} tensors and {kv_count:,} metadata keys, more than the "
                              f"{MAX_TENSORS:,} of each any model comes near")
    fields = {}
    try:
        for _ in range(kv_count):
            key = walker.string()
            fields[key] = walker.value(walker.unpack("I"))
        tensors = [_read_tensor_info(walker) for _ in range(tensor_count)]
    except (ValueError, KeyError) as error:  # unknown value or tensor type codes
        raise HeaderUnknownType(str(error)) from None
    return fields, tensors, walker.offset


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
            raise HeaderTruncated from error
        self.offset += struct.calcsize(layout)
        return values

    def unpack(self, fmt: str):
        return self.many(1, fmt)[0]

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise HeaderTruncated
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip(self, count: int, item_bytes: int) -> None:
        """Step over count items of item_bytes each (at least that many, for items of their own length)."""
        end = self.offset + count * item_bytes
        if end > len(self.buffer):
            raise HeaderTruncated
        self.offset = end

    def skip_strings(self, count: int) -> None:
        unpack_length = struct.Struct(self.byte_order + "Q").unpack_from
        offset, size = self.offset, len(self.buffer)
        if count * 8 > size - offset:  # each string has its 8-byte length: a count of 2**60 ends here
            raise HeaderTruncated
        try:
            for _ in range(count):
                offset += 8 + unpack_length(self.buffer, offset)[0]
                if offset > size:  # before a length near 2**64 reaches unpack_from as an offset
                    raise HeaderTruncated
        except struct.error as error:
            raise HeaderTruncated from error
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
                return UnreadArray(count)
            if item_type == GGUFValueType.ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:  # thousands deep would exhaust Python's stack
                    raise HeaderMalformed(f"nests arrays more than {_MAX_ARRAY_DEPTH} deep in its metadata")
                if count * 12 > len(self.buffer) - self.offset:  # each array has a type and a count
                    raise HeaderTruncated
                return tuple(self.value(item_type, depth + 1) for _ in range(count))
            item_format = _SCALAR_FORMATS[item_type]
            if count > _MAX_ARRAY_READ:
                self.skip(count, struct.calcsize(item_format))
                return UnreadArray(count)
            return self.many(count, item_format)
        return self.unpack(_SCALAR_FORMATS[value_type])


def _read_tensor_info(walker: _HeaderWalker) -> Tensor:
    name = walker.string()
    n_dims = walker.unpack("I")
    if n_dims > _MAX_TENSOR_DIMS:  # a million dimensions would take minutes to multiply out
        raise HeaderMalformed(f"gives tensor {name[:40]!r} {n_dims} dimensions; ggml has at most {_MAX_TENSOR_DIMS}")
    dims = walker.many(n_dims, "Q")
    quant_type = GGMLQuantizationType(walker.unpack("I"))
    offset = walker.unpack("Q")
    n_elements = 1
    for dim in dims:
        n_elements *= dim
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    return Tensor(name, n_elements, n_elements * type_size // block_size, offset, quant_type, tuple(dims))
