"""Quantities as a caller writes them."""

from __future__ import annotations

import re

from corral.errors import InvalidArgument


def parse_size(v: int | str | None, what: str) -> int:
    """Bytes, from a number or a size as the CLI takes it (``512m``, ``2g``)."""
    if v is None:
        return 0
    if isinstance(v, bool):
        raise InvalidArgument(f"{what}: {v!r} is not a size")
    if isinstance(v, int):
        if v < 0:
            raise InvalidArgument(f"{what}: {v} is negative")
        return v
    if not isinstance(v, str):
        raise InvalidArgument(f"{what}: {v!r} is not a size (bytes as an int, or e.g. '512m')")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?\s*", v.lower())
    if not m:
        raise InvalidArgument(f"{what}: {v!r} is not a size (e.g. 512m, 2g)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
    return int(float(m.group(1)) * scale[m.group(2)])
