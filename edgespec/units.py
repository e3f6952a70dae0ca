"""Byte sizes: read from the user (--memory-budget, config.toml) and written for the user, in binary units."""

from __future__ import annotations

import re

from .errors import EdgespecError

GiB = 1024**3
MiB = 1024**2
# More memory than any one machine has: a size above it is a typo (and 310 nines were float infinity,
# an OverflowError traceback).
MAX_SIZE = 1024**5

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|(b?))\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


class InvalidSizeError(EdgespecError, ValueError):
    """A memory size such as --memory-budget could not be read."""


def parse_size(text: str) -> int:
    """Bytes in "6GiB", "512MB", "1.5G", "4194304": MB/GB are decimal, MiB/GiB and a bare M/G binary.  A bare
    number is bytes, and under a MiB is refused as a size written without its unit."""
    signless = str(text).strip().removeprefix("-")
    if signless != str(text).strip() and _SIZE_PATTERN.match(signless):  # a size, but for its sign
        raise InvalidSizeError(f"memory size {text!r} is negative; give a positive size like 6GiB")
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise InvalidSizeError(
            f"memory size {text!r} is not understood; write a number with a unit, like 6GiB, 512MB or 1.5G"
        )
    number, prefix, binary, byte_suffix, _ = match.groups()
    prefix = (prefix or "").lower()
    decimal = bool(prefix) and bool(byte_suffix) and not binary
    size = float(number) * (1000 if decimal else 1024) ** _POWERS[prefix]
    if size < 1:
        raise InvalidSizeError(f"memory size {text!r} is zero; give a positive size like 6GiB")
    if size > MAX_SIZE:
        raise InvalidSizeError(f"memory size {_cut(text)!r} is more than 1 PiB, more than any machine has; give a "
                               "size like 6GiB")
    if not (prefix or byte_suffix or match.group(5)) and size < MiB:
        # `--memory-budget 5` meant 5 GiB, not a budget of 5 bytes that only a warning questioned
        raise InvalidSizeError(f"memory size {text!r} without a unit is {int(size)} bytes; write its unit, like "
                               f"{number}GiB or {number}MiB (or {number}B if bytes are meant)")
    return int(size)


def _cut(text: str) -> str:
    text = str(text)
    return text if len(text) <= 40 else text[:37] + "..."


def format_size(n_bytes: int) -> str:
    """n_bytes in binary units: "1.04 GiB", "93.5 MiB", "2.0 KiB"."""
    if abs(n_bytes) >= GiB:
        return f"{n_bytes / GiB:.2f} GiB"
    if abs(n_bytes) >= MiB:
        return f"{n_bytes / MiB:.1f} MiB"
    return f"{n_bytes / 1024:.1f} KiB"
