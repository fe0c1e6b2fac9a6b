"""Quantities as a user writes them, one parser for every place that takes one: an override
`KEY=VALUE` (`sim/overrides.py`), chip YAML (`sim/hardware.chip_from_dict`) and model YAML
(`workloads/models.model_from_dict`).

A value is a plain number (`1.8e11`), a number with a unit suited to the field (`180GB/s`,
`32GiB`, `2us`, `918T`), or `xF`, a multiplier of the base value (the preset's for an override,
the `base:` chip's or model's in a file): `x2`, `x0.5`. Which units fit is read off the field's
name, as the fields are named by their unit: `*bytes*` takes bytes (`B`, `KB`..`TB`, `KiB`..
`TiB`; `/s` after a rate), `*flops_per_s` / `*ops_per_s` an SI prefix (`K`, `M`, `G`, `T`, `P`,
optionally `FLOP/s`), `*_s` a time (`s`, `ms`, `us`, `ns`); any other field (counts, fractions)
takes no unit. Digits are ASCII only (Python's `float()` would also read a full-width `１`).
The range of each field is its owner's check; this module only reads the text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from topologies.errors import TpusimError
from topologies.validate import ascii_float, short_repr

BYTE_UNITS = {
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
SI_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
# ASCII digits only (re.ASCII): Python's float() would also read a full-width "１".
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|[+-]?nan|[+-]?inf)\s*(.*?)\s*$",
                     re.IGNORECASE | re.ASCII)


@dataclass(frozen=True, slots=True)
class Quantity:
    """A parsed value: an absolute number, or a multiplier of the base value (`xF`)."""

    value: float | None = None
    multiplier: float | None = None

    def resolve(self, base: Any) -> Any:
        """The number this stands for when the base value is `base` (a multiplier needs one)."""
        return self.value if self.multiplier is None else base * self.multiplier


def unit_scale(field: str, unit: str) -> float | None:
    """How much one `unit` is in `field`'s own unit; None if the unit does not fit the field."""
    u = unit.strip().lower().replace(" ", "")
    if u == "":
        return 1.0
    if "bytes" in field:
        if field.endswith("_per_s"):
            u = u.removesuffix("/s")
        return BYTE_UNITS.get(u)
    if field.endswith("flops_per_s") or field.endswith("ops_per_s"):
        for tail in ("flop/s", "flops", "op/s", "ops"):
            if u.endswith(tail):
                u = u.removesuffix(tail)
                break
        return SI_PREFIXES.get(u)
    if field.endswith("_s"):
        return TIME_UNITS.get(u)
    return None


def unit_hint(field: str) -> str:
    """The units `field` takes, in words for an error message ("" for a field without units)."""
    if "bytes" in field:
        return " (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB" + \
            (", optionally /s)" if field.endswith("_per_s") else ")")
    if field.endswith("ops_per_s"):
        return " (units: K, M, G, T, P, optionally FLOP/s)"
    if field.endswith("_s"):
        return " (units: s, ms, us, ns)"
    return ""


# The setting an error's `what` may name (`{set} KEY=VALUE`, TpusimError's placeholders).
_WHAT = ("set",)


def multiplier(what: str, value: Any) -> float | None:
    """`x2` / `X0.5` -> 2.0 / 0.5; None if `value` is not a multiplier. `what` starts the
    error ("{set} hbm_bytes=x0", "chip file c.yaml: hbm_bytes = 'x0'"), and may name the
    overrides as `{set}` (`_WHAT`)."""
    if not isinstance(value, str) or not value.strip().lower().startswith("x"):
        return None
    body = value.strip()[1:]
    try:
        m = ascii_float(body)
    except ValueError:
        raise TpusimError(
            f"{what}: {short_repr(body)} is not a number; write a multiplier such as x2 or x0.5",
            *_WHAT) from None
    if not math.isfinite(m) or m <= 0:
        raise TpusimError(f"{what}: the multiplier must be a positive finite number, e.g. x2",
                          *_WHAT)
    return m


def number_with_unit(what: str, field: str, value: Any, *, base_word: str = "the preset") -> float:
    """A plain number or a number with a unit that fits `field`, in the field's unit (NaN and
    infinities are returned for the caller's range check to name)."""
    if isinstance(value, bool):
        raise TpusimError(f"{what} must be a number", *_WHAT)
    if isinstance(value, (int, float)):
        return float(value)
    m = _NUMBER.match(str(value))
    scale = unit_scale(field, m.group(2)) if m else None
    if m is None or scale is None:
        raise TpusimError(
            f"{what}: not a number{unit_hint(field)}; give a plain number, a number with a unit "
            f"or a multiplier of {base_word} such as x2", *_WHAT
        )
    return float(m.group(1)) * scale


def parse_quantity(what: str, field: str, value: Any, *,
                   base_word: str = "the preset") -> Quantity:
    """`value` (text or a number) as a `Quantity` for `field`: `xF`, a number with a unit, or a
    plain number. `base_word` names what a multiplier multiplies, for the error message."""
    m = multiplier(what, value)
    if m is not None:
        return Quantity(multiplier=m)
    return Quantity(value=number_with_unit(what, field, value, base_word=base_word))
