"""Named TPU slices (`v5p-128` -> 4x4x4) and each generation's wraparound rule.

Shapes come from `../shared/reference/slices.md` (public Cloud TPU configuration tables); the
wraparound rules from `tpu.md` §1.3. This module knows chips only by name and rule string, so it
does not depend on `sim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topologies.errors import TpusimError
from topologies.registry import Registry
from topologies.torus import (
    Topology,
    build_torus,
    parse_shape,
    parse_wraparound,
    twist_rule_error,
)
from topologies.validate import MAX_CHIPS, MAX_SLICES, range_text, short_repr


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceSpec:
    """A named slice: its chip generation and physical shape (x, y, z)."""

    name: str
    chip: str
    shape: tuple[int, ...]

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)


# v4-N and v5p-N count TensorCores (2 per chip); v5e-N, v6e-N and v5litepod-N count chips.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1, "v5litepod": 1}


def _unknown_slice(name: str) -> TpusimError:
    """One short line for an unknown slice name: why it is unknown (the TensorCore count, when
    the name counts chips where the registry counts cores) and the nearest names to use."""
    import difflib
    import math
    import re

    head = f"unknown slice {short_repr(name)}"
    m = re.fullmatch(r"\s*([a-z0-9]+)-([0-9]{1,9})\s*", name.lower())
    gen = m.group(1) if m else None
    if gen not in _CORES_PER_CHIP:
        close = difflib.get_close_matches(name.lower(), SLICES.names(), n=5, cutoff=0.6)
        words = ", ".join(close[:-1]) + f" or {close[-1]}" if len(close) > 1 else "".join(close)
        hint = f"did you mean {words}? " if close else ""
        return TpusimError(
            f"{head}: {hint}slice names are GEN-N with GEN one of "
            f"{', '.join(_CORES_PER_CHIP)} (e.g. v5p-128, v5e-256); `tpusim presets` lists "
            f"them all, or give {{chip}} GEN {{shape}} AxB[xC]", "chip", "shape")
    n = int(m.group(2))
    cores = _CORES_PER_CHIP[gen]
    same = [(k, spec) for k, spec in SLICES.items()
            if k.startswith(f"{gen}-") and k[len(gen) + 1:].isdigit()]
    if cores > 1:
        as_chips = f"{gen}-{n * cores}"
        if as_chips in SLICES:
            spec = SLICES.get(as_chips)
            shape = "x".join(map(str, spec.shape))
            also = [k for k, s2 in SLICES.items() if s2 is not spec and s2.shape == spec.shape
                    and s2.chip == spec.chip]
            alias = f" (also {', '.join(also)})" if also else ""
            return TpusimError(
                f"{head}: {gen}-N counts TensorCores ({cores} per chip), so {n} chips is "
                f"{as_chips}{alias}, shape {shape}; use {{slice}} {as_chips} or {{chip}} {gen} "
                f"{{shape}} {shape}", "slice", "chip", "shape")
    near = sorted(same, key=lambda kv: (abs(math.log(_count(kv[0])) - math.log(max(n, 1))),
                                        _count(kv[0])))[:3]
    near = sorted(near, key=lambda kv: _count(kv[0]))
    chip = "v5e" if gen == "v5litepod" else gen
    what = (f"{gen}-N counts TensorCores ({cores} per chip)" if cores > 1
            else f"{gen}-N counts chips")
    names = ", ".join(f"{k} ({'x'.join(map(str, sp.shape))})" for k, sp in near)
    return TpusimError(
        f"{head}: {what}; the nearest named slices are {names}; for another shape give "
        f"{{chip}} {chip} {{shape}} AxB{'xC' if cores > 1 else ''}", "chip", "shape")


def _count(name: str) -> int:
    """The count in a slice name (`v5p-128` -> 128)."""
    return int(name.rsplit("-", 1)[1])


SLICES: Registry[SliceSpec] = Registry("slice", unknown=_unknown_slice)

# slices.md: v4-N and v5p-N count TensorCores (2 per chip); v5e-N and v6e-N count chips.
_CUBE_SHAPES = {
    8: (2, 2, 1),
    16: (2, 2, 2),
    32: (2, 2, 4),
    64: (2, 4, 4),
    128: (4, 4, 4),
    256: (4, 4, 8),
    512: (4, 8, 8),
    1024: (8, 8, 8),
    2048: (8, 8, 16),
    4096: (8, 16, 16),
    8192: (16, 16, 16),
}
for _n, _shape in _CUBE_SHAPES.items():
    SLICES.add(f"v4-{_n}", SliceSpec(name=f"v4-{_n}", chip="v4", shape=_shape))
    SLICES.add(f"v5p-{_n}", SliceSpec(name=f"v5p-{_n}", chip="v5p", shape=_shape))
SLICES.add("v4-384", SliceSpec(name="v4-384", chip="v4", shape=(4, 4, 12)))  # slices.md
SLICES.add("v4-1536", SliceSpec(name="v4-1536", chip="v4", shape=(8, 8, 12)))  # slices.md
SLICES.add("v5p-12288", SliceSpec(name="v5p-12288", chip="v5p", shape=(16, 16, 24)))  # slices.md
# The whole v5p pod, 8960 chips, which the textbook describes as 16x20x28 (tpu.md §1.1).
SLICES.add("v5p-17920", SliceSpec(name="v5p-17920", chip="v5p", shape=(16, 20, 28)))
SLICES.add("v5p-pod", SliceSpec(name="v5p-pod", chip="v5p", shape=(16, 20, 28)))
SLICES.add("v4-pod", SliceSpec(name="v4-pod", chip="v4", shape=(16, 16, 16)))

_2D_SHAPES = {
    1: (1, 1),
    4: (2, 2),
    8: (2, 4),
    16: (4, 4),
    32: (4, 8),
    64: (8, 8),
    128: (8, 16),
    256: (16, 16),
}
for _n, _shape in _2D_SHAPES.items():
    for _gen in ("v5e", "v6e"):
        SLICES.add(f"{_gen}-{_n}", SliceSpec(name=f"{_gen}-{_n}", chip=_gen, shape=_shape))
    # Cloud's name for v5e slices (slices.md).
    SLICES.add(
        f"v5litepod-{_n}", SliceSpec(name=f"v5litepod-{_n}", chip="v5e", shape=_shape)
    )


def default_wraparound(rule: str, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """The generation's wraparound rule (tpu.md §1.3).

    `cube` (v4, v5p): a slice made of whole 4x4x4 cubes (every axis a multiple of 4) wraps on every
    axis; smaller slices have none. `full-axis` (v5e, v6e): an axis wraps only at length 16.
    """
    if rule == "cube":
        full = len(shape) == 3 and all(n % 4 == 0 for n in shape)
        return tuple(full and n > 1 for n in shape)
    if rule == "full-axis":
        return tuple(n == 16 for n in shape)
    raise TpusimError(f"unknown wraparound rule {rule!r}; use cube or full-axis")


# A v4/v5p pod is built of 4x4x4 cubes of chips (one rack each) joined by optical circuit
# switches (TPU v4 paper, Jouppi et al. ISCA 2023 §2; docs/reference/twisted.md).
CUBE_SIDE = 4


def is_cube_slice(rule: str, shape: tuple[int, ...]) -> bool:
    """A slice of whole 4x4x4 cubes on a generation whose cubes are joined by OCS (`cube`)."""
    return rule == "cube" and len(shape) == 3 and all(n % CUBE_SIDE == 0 for n in shape)


def num_cubes(shape: tuple[int, ...]) -> int:
    """4x4x4 cubes in a 3D shape of whole cubes."""
    return math.prod(n // CUBE_SIDE for n in shape)


def check_shape_fits(chip_name: str, max_pod_shape: tuple[int, ...], shape: tuple[int, ...],
                     wrap_rule: str | None = None):
    """Refuse shapes that the chip's pod cannot hold.

    On a generation with optical circuit switches (`cube` rule) a slice of whole 4x4x4 cubes
    may take any free cubes of the pod, wired into its shape by the switches, so it fits when
    its cube count does (v5p 8x16x48 is 96 of the pod's 140 cubes, though 48 is longer than any
    side of the 16x20x28 box). A smaller slice sits inside one cube's box, and a generation
    without switches is a fixed box: both must fit `max_pod_shape` (axes may be permuted).
    """
    if wrap_rule is not None and is_cube_slice(wrap_rule, shape) \
            and len(max_pod_shape) == 3:
        have = num_cubes(tuple((n // CUBE_SIDE) * CUBE_SIDE for n in max_pod_shape))
        need = num_cubes(shape)
        if need <= have:
            return
        raise TpusimError(
            f"shape {'x'.join(map(str, shape))} is {need:,} cubes of 4x4x4 chips but one "
            f"{chip_name} pod has {have} ({'x'.join(map(str, max_pod_shape))}); a slice of "
            f"cubes must fit the pod's cube count: use a smaller shape, or {{slices}} N to join "
            f"slices over DCN", "slices"
        )
    if len(shape) > len(max_pod_shape):
        raise TpusimError(
            f"shape {'x'.join(map(str, shape))} has {len(shape)} axes but {chip_name} pods are "
            f"{len(max_pod_shape)}D ({'x'.join(map(str, max_pod_shape))}); use at most "
            f"{len(max_pod_shape)} axes, or {{slices}} for more chips over DCN", "slices"
        )
    padded = sorted(shape + (1,) * (len(max_pod_shape) - len(shape)))
    if any(a > b for a, b in zip(padded, sorted(max_pod_shape), strict=True)):
        why = (" and is not made of whole 4x4x4 cubes (the optical switches join only whole "
               "cubes)" if wrap_rule == "cube" else "")
        raise TpusimError(
            f"shape {'x'.join(map(str, shape))} does not fit one {chip_name} pod "
            f"(largest ICI slice {'x'.join(map(str, max_pod_shape))}){why}; use a smaller shape, "
            f"or {{slices}} N to join slices over DCN", "slices"
        )


def resolve_topology(
    *,
    chip_name: str,
    wrap_rule: str,
    max_pod_shape: tuple[int, ...],
    slice_name: str | None = None,
    shape: str | tuple[int, ...] | None = None,
    wraparound: str = "auto",
    num_slices: int = 1,
    check_fit: bool = True,
    twist: bool = False,
) -> Topology:
    """Turn a run's pod settings (`slice`, `shape`, `wraparound`, `slices`, `twist`) into a
    `Topology`. A slice name ending in `-twisted` (`v4-256-twisted`) is the named slice with
    `twist`."""
    if slice_name is None and shape is None:
        raise TpusimError("give the pod as {slice} NAME (e.g. v5p-128) or {shape} AxB[xC]",
                          "slice", "shape")
    if slice_name is not None and untwisted_name(slice_name) != str(slice_name):
        slice_name = untwisted_name(slice_name)
        twist = True
    if slice_name is not None:
        spec = SLICES.get(slice_name)
        if spec.chip != chip_name.split("-")[0] and spec.chip != chip_name:
            raise TpusimError(
                f"slice {slice_name!r} is a {spec.chip} slice but the chip is {chip_name!r}; "
                f"drop {{chip}} or pick a {chip_name} slice", "chip"
            )
        sl_shape = spec.shape
        if shape is not None:
            given = parse_shape(shape) if isinstance(shape, str) else tuple(shape)
            if math.prod(given) != spec.num_chips:
                raise TpusimError(
                    f"shape {'x'.join(map(str, given))} has {math.prod(given)} chips but slice "
                    f"{slice_name} has {spec.num_chips} ({'x'.join(map(str, sl_shape))}); "
                    f"give a shape with {spec.num_chips} chips or drop {{shape}}", "shape"
                )
            sl_shape = given
        shape_t = sl_shape
    else:
        shape_t = parse_shape(shape) if isinstance(shape, str) else tuple(shape)
    if check_fit:
        check_shape_fits(chip_name, max_pod_shape, shape_t, wrap_rule)
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) \
            or not 1 <= num_slices <= MAX_SLICES:
        raise TpusimError(
            f"{{slices}} {num_slices!r} must be {range_text(1, MAX_SLICES, integer=True)}", "slices"
        )
    total = math.prod(shape_t) * num_slices
    if total > MAX_CHIPS:
        raise TpusimError(
            f"{{shape}} {'x'.join(map(str, shape_t))} x {{slices}} {num_slices} is {total:,} "
            f"chips, "
            f"over the limit of {MAX_CHIPS:,} chips a pod may have here; a pod this large is "
            f"too large to simulate, give a smaller shape or fewer slices", "shape", "slices"
        )
    wrap = parse_wraparound(wraparound, shape_t)
    if wrap is None:
        wrap = default_wraparound(wrap_rule, shape_t)
    if twist:
        check_twist(chip_name, wrap_rule, shape_t, wrap)
    # Cubes joined by optical circuit switches: the links leaving a cube's faces (the
    # wraparound among them) go through the switches (`Topology.ocs_link_mask`).
    return build_torus(shape_t, wrap, num_slices=num_slices,
                       ocs=is_cube_slice(wrap_rule, shape_t), twisted=bool(twist))


# `--slice v4-256-twisted`: the named slice, twisted (Cloud TPU names the topology
# `4x4x8_twisted`; docs/reference/twisted.md).
TWISTED_SUFFIX = "-twisted"


def untwisted_name(slice_name: str) -> str:
    """A slice name without its `-twisted` suffix (`v4-256-twisted` -> `v4-256`)."""
    text = str(slice_name)
    if text.lower().endswith(TWISTED_SUFFIX) and text.lower() not in SLICES:
        return text[: -len(TWISTED_SUFFIX)]
    return text


def can_twist(wrap_rule: str, shape: tuple[int, ...]) -> bool:
    """Whether a slice of this generation and shape may be a twisted torus."""
    try:
        check_twist("", wrap_rule, tuple(shape), (True,) * len(shape))
    except TpusimError:
        return False
    return True


def check_twist(chip_name: str, wrap_rule: str, shape: tuple[int, ...],
                wrap: tuple[bool, ...]) -> None:
    """Refuse a twist the pod cannot build (docs/reference/twisted.md): only v4/v5p slices of
    whole 4x4x4 cubes, wired by the optical switches (the `cube` rule), twist, and only the
    shapes k x k x 2k and k x 2k x 2k (each side a multiple of 4), wrapped on every axis."""
    text = "x".join(map(str, shape))
    if wrap_rule != "cube":
        raise TpusimError(
            f"{{twist}}: {chip_name or 'this chip'} has no optical circuit switches to twist the "
            f"wraparound (only v4 and v5p slices of whole 4x4x4 cubes twist); drop {{twist}} or "
            f"use {{chip}} v4 or v5p", "twist", "chip")
    why = twist_rule_error(shape)
    if why is not None:
        raise TpusimError(f"{{twist}}: {why}", "twist")
    if any(n % CUBE_SIDE for n in shape):
        raise TpusimError(
            f"{{twist}}: shape {text} is not made of whole 4x4x4 cubes; a twisted slice has every "
            f"side a multiple of 4 (k x k x 2k or k x 2k x 2k, e.g. 4x4x8, 4x8x8, 8x8x16); drop "
            f"{{twist}} or give such a shape", "twist")
    if not all(wrap):
        raise TpusimError(
            f"{{twist}}: a twisted {text} wraps on every axis (the twist moves its wraparound "
            f"links); drop {{wraparound}} or {{twist}}", "twist", "wraparound")
