"""Sizes and chip coordinates given as text: `32MiB` -> bytes, `1,2,3` -> coordinates."""

from __future__ import annotations

import re

from topologies.errors import TpusimError
from topologies.validate import MAX_BYTES, short_repr, subject

# Byte suffixes, case-sensitive: `Mb`/`Gib` would be bits, so they are refused, not guessed.
_BYTE_UNITS = {
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1,
}


def parse_bytes(text: str, name: str = "bytes") -> int:
    """`33554432`, `32MiB`, `1GiB`, `4.5e6`, `10MB` -> bytes (at most `MAX_BYTES`); a bad size
    is an error naming the setting `name` (see `topologies.validate.subject`)."""
    flag, params = subject(name)
    t = str(text).strip()
    m = re.fullmatch(r"([0-9.eE+-]+)\s*([A-Za-z]*)", t)
    hint = (f"give bytes such as 33554432, 32MiB or 1GiB (suffixes: "
            f"{', '.join(_BYTE_UNITS)}; case matters, b/Mb/Gib would be bits)")
    if not m or (m.group(2) and m.group(2) not in _BYTE_UNITS):
        raise TpusimError(f"{flag} {short_repr(text)} is not a size; {hint}", *params)
    try:
        value = float(m.group(1)) * _BYTE_UNITS.get(m.group(2), 1)
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)} is not a size; {hint}", *params) from None
    if value < 0:
        raise TpusimError(f"{flag} {short_repr(text)} must be > 0 (a size in bytes)", *params)
    if value > MAX_BYTES:
        raise TpusimError(
            f"{flag} {short_repr(text)} is over the limit of {MAX_BYTES:,} bytes (1 PiB); give a "
            f"smaller size", *params
        )
    if not value.is_integer():
        raise TpusimError(f"{flag} {short_repr(text)} is not a whole number of bytes", *params)
    return int(value)


def parse_coords(text: str, name: str) -> tuple[int, ...]:
    """`"1,2,3"` -> (1, 2, 3); bad coordinates are an error naming the setting `name`."""
    flag, params = subject(name)
    parts = str(text).split(",")
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\s*[0-9]{1,6}\s*", p) for p in parts):
        raise TpusimError(
            f"{flag} {short_repr(text)} is not chip coordinates; give 1 to 3 integers >= 0 like "
            f"0,0 or 1,2,3", *params
        )
    return tuple(int(c) for c in parts)
