"""Crafted .npy members, for tests of what edgespec refuses to read from an archive of arrays."""

from __future__ import annotations

import io

import numpy as np


def npy_member(shape: tuple[int, ...], payload: bytes = b"", descr: str = "<f4") -> bytes:
    """A .npy member whose header declares shape, followed by payload (not necessarily that much data)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    return header.getvalue() + payload
