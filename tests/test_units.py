"""Byte sizes from the user, and sizes shown to the user."""

from __future__ import annotations

import pytest

from edgespec.errors import EdgespecError
from edgespec.units import format_size, parse_size

MiB = 1024**2
GiB = 1024**3


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * GiB),
    ("6 GiB", 6 * GiB),
    ("1.5G", int(1.5 * GiB)),
    ("1.5g", int(1.5 * GiB)),
    ("512MiB", 512 * MiB),
    ("512M", 512 * MiB),
    ("512MB", 512_000_000),
    ("6gb", 6_000_000_000),
    ("64KiB", 65536),
    ("1T", 1024**4),
    ("1024T", 1024**5),
    ("4194304", 4 * MiB),
    ("100B", 100),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


# 310 nines read as float infinity: an OverflowError traceback; 99999999999T a plan of 30 billion GiB
@pytest.mark.parametrize("text", ["", "GiB", "six GiB", "-1G", "6 GiBs", "6ib", "0", "0.0G", "1,5G", "5", "2048",
                                  "9" * 310 + "GiB", "99999999999T", "1025T"])
def test_parse_size_refuses_with_a_user_error(text):
    with pytest.raises(EdgespecError) as caught:
        parse_size(text)
    message = str(caught.value)
    assert "\n" not in message and "GiB" in message  # names the fix: an example of a valid size
    assert isinstance(caught.value, ValueError)  # so argparse's type= reports it as a bad value


@pytest.mark.parametrize("n_bytes,shown", [(1_117_320_768, "1.04 GiB"), (98 * MiB, "98.0 MiB"), (2048, "2.0 KiB")])
def test_format_size_uses_binary_units(n_bytes, shown):
    assert format_size(n_bytes) == shown


@pytest.mark.parametrize("text", ["-5GiB", " -1G", "-0.5G", "-2048", "-0"])
def test_a_negative_size_is_called_negative(text):
    # it was "not understood; write a number with a unit", which a number with a unit already was
    with pytest.raises(EdgespecError, match="is negative; give a positive size like 6GiB"):
        parse_size(text)
