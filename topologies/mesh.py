"""Logical meshes (`data`, `fsdp`, `tensor`, `sequence`, `expert`, `pipeline`) and their placement
on the physical torus, in the spirit of `jax.experimental.mesh_utils`.

A logical axis takes *factors* of physical axes: whole axes where it can, otherwise an inner
factor of one (e.g. `tensor=4` on a 16-chip x axis takes 4 neighbouring chips, and `fsdp` then
takes the remaining factor of x with stride 4, plus y and z). Axes are placed from the last mesh
axis to the first, starting at x: the last mesh axis (usually `tensor`, the most
bandwidth-hungry) gets the fastest-varying physical axis, as jax's device meshes do (xla.md: on a
4x4x4 v5p, mesh (fsdp=16, tensor=4) puts tensor along x). DCN axes span slices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topologies.errors import TpusimError
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology
from topologies.validate import MAX_CHIPS, ascii_int, one_of, short_repr

LOGICAL_AXES = ("data", "fsdp", "pipeline", "expert", "sequence", "tensor")


@dataclass(frozen=True, slots=True, kw_only=True)
class LogicalMesh:
    """Named logical axes with sizes, in placement order (ICI) plus DCN axes across slices."""

    axes: tuple[tuple[str, int], ...]
    dcn_axes: tuple[tuple[str, int], ...] = ()
    # Explicit placement (`--axis-map`): per logical axis, (physical axis, chips) factors in the
    # order they are laid out; empty = automatic placement.
    placement: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes] + [n for n, _ in self.dcn_axes]
        for name, size in self.axes + self.dcn_axes:
            if not isinstance(name, str) or name not in LOGICAL_AXES:
                raise TpusimError(
                    f"mesh axis {short_repr(name)} is unknown; {one_of(name, LOGICAL_AXES)}"
                )
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_CHIPS:
                raise TpusimError(f"mesh axis {name}={short_repr(size)} must be a positive "
                                  f"integer of at most {MAX_CHIPS:,}")
        ici_names = [n for n, _ in self.axes]
        if len(set(ici_names)) != len(ici_names):
            raise TpusimError(f"mesh {self.describe()} names an axis twice; list each once")
        del names

    def size(self, name: str) -> int:
        """ICI size times DCN size of a logical axis (1 if absent)."""
        s = 1
        for n, v in self.axes + self.dcn_axes:
            if n == name:
                s *= v
        return s

    def ici_size(self, name: str) -> int:
        return dict(self.axes).get(name, 1)

    def dcn_size(self, name: str) -> int:
        return dict(self.dcn_axes).get(name, 1)

    @property
    def num_ici_devices(self) -> int:
        n = 1
        for _, v in self.axes:
            n *= v
        return n

    @property
    def num_slices(self) -> int:
        n = 1
        for _, v in self.dcn_axes:
            n *= v
        return n

    def describe(self) -> str:
        s = ",".join(f"{n}={v}" for n, v in self.axes) or "(none)"
        if self.dcn_axes:
            s += " dcn " + ",".join(f"{n}={v}" for n, v in self.dcn_axes)
        return s

    def to_dict(self) -> dict:
        d: dict = {"ici": dict(self.axes), "dcn": dict(self.dcn_axes)}
        if self.placement:
            d["placement"] = {n: [[a, k] for a, k in fs] for n, fs in self.placement}
        return d


def job_mesh(topology: Topology) -> LogicalMesh:
    """The mesh of a program whose collectives name their device groups (an imported HLO module
    or Chakra set): the whole pod as one `data` axis per slice, `data` across slices."""
    dcn = (("data", topology.num_slices),) if topology.num_slices > 1 else ()
    return LogicalMesh(axes=(("data", topology.chips_per_slice),), dcn_axes=dcn)


def parse_axis_map(text: str | None) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """`"tensor=x,fsdp=y+z"` or `"tensor=x:4,fsdp=x:4+y+z"` -> explicit placement.

    Each logical axis lists the physical axes it takes, joined by `+`; `x:4` takes 4 chips of x
    (factors of one physical axis are laid out in the order written: the first is innermost).
    A bare axis letter takes whatever is left of that axis."""
    if not text:
        return ()
    if not text.replace(",", "").strip():
        raise TpusimError(
            f"{{axis_map}} {short_repr(text)} places no axis; write e.g. tensor=x,fsdp=y+z, or "
            f"leave {{axis_map}} out for the automatic placement", "axis_map"
        )
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise TpusimError(
                f"{{axis_map}} {short_repr(text)}: {short_repr(part)} is not name=axes; write "
                f"e.g. tensor=x,fsdp=y+z", "axis_map"
            )
        name, spec = (p.strip() for p in part.split("=", 1))
        if not name:
            raise TpusimError(
                f"{{axis_map}} {short_repr(text)}: {short_repr(part)} names no mesh axis; write "
                f"e.g. tensor=x,fsdp=y+z", "axis_map"
            )
        if name in (n for n, _ in out):
            raise TpusimError(
                f"{{axis_map}} {short_repr(text)} places {short_repr(name)} twice; give each mesh "
                f"axis once, joining its physical axes with + (e.g. fsdp=x+y)", "axis_map"
            )
        factors = []
        for f in spec.split("+"):
            f = f.strip()
            axis, _, size = f.partition(":")
            if axis not in AXIS_NAMES:
                raise TpusimError(
                    f"{{axis_map}} {short_repr(text)}: {short_repr(f)} is not a physical axis; "
                    f"use x, y or z "
                    f"(optionally x:4 for 4 chips of x)", "axis_map"
                )
            # ASCII digits only (int() also reads a full-width "１"), at most 9 of them (a
            # torus axis has at most 4,096 chips).
            if size and not (size.isascii() and size.isdigit() and len(size) <= 9) \
                    and not (size.startswith("-") and size[1:].isascii() and size[1:].isdigit()):
                raise TpusimError(f"{{axis_map}} {short_repr(text)}: {short_repr(f)} has a size "
                                  f"that is not a whole number of at most 9 ASCII digits; write "
                                  f"e.g. x:4", "axis_map")
            k = int(size) if size else 0
            if size and k < 1:
                raise TpusimError(f"{{axis_map}} {short_repr(text)}: {short_repr(f)} must take "
                                  f"at least 1 chip", "axis_map")
            factors.append((axis, k))
        out.append((name, tuple(factors)))
    return tuple(out)


def dcn_hint(mesh: LogicalMesh, num_chips: int) -> str:
    """` ({dcn} data=2 spans 2 slices but the pod is one slice: add {slices} 2)` when that is
    the likely fix, else "": a template naming `dcn` and `slices`, for the caller's error."""
    if mesh.num_slices > 1 and mesh.num_ici_devices == num_chips:
        dcn = ",".join(f"{n}={v}" for n, v in mesh.dcn_axes)
        return (f" ({{dcn}} {dcn} spans {mesh.num_slices} slices but the pod is one slice: add "
                f"{{slices}} {mesh.num_slices})")
    return ""


def parse_mesh(
    text: str | None, dcn_text: str | None = None, axis_map: str | None = None
) -> LogicalMesh:
    """`"fsdp=16,tensor=4"` (and `dcn_text` `data=2`, `axis_map` `tensor=x,fsdp=y+z`) -> mesh."""

    def parse(t: str | None, name: str) -> tuple[tuple[str, int], ...]:
        if not t:
            return ()
        out = []
        # Whitespace and empty parts (a trailing comma) are tolerated here: a dropped empty
        # part cannot change the mesh silently, since the sizes must multiply to the chips.
        for part in t.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise TpusimError(
                    f"{name} {t!r}: {part!r} is not name=size; write e.g. fsdp=16,tensor=4",
                    "mesh", "dcn")
            k, v = part.split("=", 1)
            try:
                size = ascii_int(v, max_digits=9)
            except ValueError:
                raise TpusimError(f"{name} {short_repr(t)}: size {short_repr(v)} of {k} is not "
                                  f"an integer (of at most 9 ASCII digits)", "mesh",
                                  "dcn") from None
            if size < 1:
                raise TpusimError(f"{name} {t!r}: {k}={size} must be >= 1", "mesh", "dcn")
            out.append((k.strip(), size))
        return tuple(out)

    return LogicalMesh(axes=parse(text, "{mesh}"), dcn_axes=parse(dcn_text, "{dcn}"),
                       placement=parse_axis_map(axis_map))


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisPlacement:
    """Where one logical axis lives: (physical axis, size, stride) factors; `dcn` for slices."""

    name: str
    factors: tuple[tuple[str, int, int], ...]


def place_mesh(mesh: LogicalMesh, topology: Topology) -> dict[str, AxisPlacement]:
    """Assign logical axes to factors of the physical axes (see module docstring).

    Raises a TpusimError if the mesh does not multiply to the chip count or cannot be factored
    onto the torus.
    """
    n_ici = topology.chips_per_slice
    if mesh.num_ici_devices != n_ici:
        raise TpusimError(
            f"mesh {mesh.describe()} has {mesh.num_ici_devices} devices per slice but the "
            f"{'x'.join(map(str, topology.shape))} slice has {n_ici} chips; make the ICI mesh "
            f"axes multiply to {n_ici}"
        )
    if mesh.num_slices != topology.num_slices:
        raise TpusimError(
            f"{{dcn}} axes multiply to {mesh.num_slices} but there are {topology.num_slices} "
            f"slice(s); make them equal (e.g. {{slices}} {mesh.num_slices})", "dcn", "slices"
        )
    placements: dict[str, AxisPlacement] = {}
    if mesh.placement:
        placements = _explicit(mesh, topology)
    # Remaining capacity of each physical axis: (axis, next stride, remaining chips).
    remaining = [[AXIS_NAMES[i], 1, n] for i, n in enumerate(topology.shape)]
    for name, size in () if mesh.placement else reversed(mesh.axes):
        need = size
        factors = []
        for slot in remaining:
            if need == 1:
                break
            axis, stride, left = slot
            if left == 1:
                continue
            if need % left == 0:
                take = left
            else:
                take = math.gcd(need, left)
                if take == 1:
                    continue
            factors.append((axis, take, stride))
            slot[1] = stride * take
            slot[2] = left // take
            need //= take
        if need != 1:
            raise TpusimError(
                f"mesh axis {name}={size} cannot be laid on the "
                f"{'x'.join(map(str, topology.shape))} torus with the other axes; choose sizes "
                f"whose factors match the physical axes"
            )
        placements[name] = AxisPlacement(name=name, factors=tuple(factors))
    # DCN axes: factors of the slice index (outermost first in the order given).
    stride = 1
    for name, size in reversed(mesh.dcn_axes):
        prev = placements.get(name)
        f = ((DCN_AXIS, size, stride),)
        placements[name] = AxisPlacement(
            name=name, factors=(prev.factors if prev else ()) + f
        )
        stride *= size
    return placements


def _explicit(mesh: LogicalMesh, topology: Topology) -> dict[str, AxisPlacement]:
    sizes = dict(mesh.axes)
    mapped = {n for n, _ in mesh.placement}
    shape = dict(zip(AXIS_NAMES, topology.shape, strict=False))
    unknown = sorted(mapped - set(sizes))
    if unknown:
        raise TpusimError(
            f"{{axis_map}} places {', '.join(unknown)}, which {{mesh}} does not define; map only "
            f"the mesh's axes ({', '.join(sizes)})", "axis_map", "mesh"
        )
    missing = sorted(n for n, v in sizes.items() if v > 1 and n not in mapped)
    if missing:
        raise TpusimError(
            f"{{axis_map}} leaves mesh axis {', '.join(missing)} unplaced; give every mesh axis "
            f"of size > 1 its physical axes", "axis_map"
        )
    used = {a: 1 for a in shape}
    out: dict[str, AxisPlacement] = {}
    for name, factors in mesh.placement:
        got = []
        for axis, k in factors:
            if axis not in shape:
                raise TpusimError(
                    f"{{axis_map}} puts {name} on axis {axis}, which the "
                    f"{'x'.join(map(str, topology.shape))} torus does not have", "axis_map"
                )
            left = shape[axis] // used[axis]
            if not k and left == 1 and shape[axis] > 1:
                # A bare letter takes what is left of the axis; nothing left is a typo
                # (`fsdp=x+x`), not a factor of one chip.
                raise TpusimError(
                    f"{{axis_map}} puts {name} on axis {axis}, but all {shape[axis]} chips of "
                    f"{axis} are already placed (a bare letter takes what is left of its "
                    f"axis); drop it there, or split the axis with sizes, e.g. "
                    f"tensor=x:2,fsdp=x:2+y", "axis_map"
                )
            take = k or left
            if take > left or left % take:
                raise TpusimError(
                    f"{{axis_map}}: {name} asks for {take} chips of {axis}, but {left} of its "
                    f"{shape[axis]} are left; use a divisor of {left}", "axis_map"
                )
            got.append((axis, take, used[axis]))
            used[axis] *= take
        product = 1
        for _a, k, _s in got:
            product *= k
        if product != sizes[name]:
            raise TpusimError(
                f"{{axis_map}} gives {name} {product} chips but {{mesh}} says "
                f"{name}={sizes[name]}; "
                f"make them equal", "axis_map", "mesh"
            )
        out[name] = AxisPlacement(name=name, factors=tuple(got))
    short = [a for a in shape if used[a] != shape[a]]
    if short:
        raise TpusimError(
            f"{{axis_map}} leaves part of axis {', '.join(short)} unused; every physical axis must "
            f"be covered by the mesh", "axis_map"
        )
    return out
