"""The physical ICI torus: chips, coordinates, directed links and their ids, and a networkx view.

A `Topology` is a 1D/2D/3D grid of chips (axes `x`, `y`, `z` in shape order: `8x4` is x=8, y=4)
with per-axis wraparound, optionally replicated into several slices joined over DCN (axis `dcn`).

Links are numbered, not stored as Python objects, so that routing and load accounting are numpy
array operations. Each chip owns one outgoing link per (axis, direction):
`link_id = chip * 2 * ndim + 2 * axis + (0 for +, 1 for -)`, which exists if the axis has size > 1
and either the step does not cross the edge or the axis wraps. This handles the two traps that
networkx's `grid_graph` falls into: a size-1 axis has no links (no self-loops), and a wrapped
size-2 axis has *two* distinct links in each direction between its two chips (the `+` port and
the wraparound `-` port), not one merged edge.

DCN links come after the ICI ids: chip c's egress is `num_ici_links + c` and its ingress is
`num_ici_links + num_chips + c` (each slice's host NICs, modelled per chip as the book does).

A v4/v5p slice of whole 4x4x4 cubes (`ocs=True`) is wired by optical circuit switches: the links
inside a cube are the rack's own, every link leaving a cube's face (the wraparound among them)
goes through a switch (TPU v4 paper §2). The two are distinct link kinds (`link_via`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from topologies.errors import TpusimError
from topologies.validate import ascii_int, short_repr

AXIS_NAMES = ("x", "y", "z")
DCN_AXIS = "dcn"


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A torus (or several over DCN). Build it with `build_torus`.

    Attributes:
        shape: chips per ICI axis, in x, y, z order.
        wraparound: per ICI axis, whether it closes into a ring.
        num_slices: slices joined over DCN (1 = a single ICI slice).
    """

    shape: tuple[int, ...]
    wraparound: tuple[bool, ...]
    num_slices: int = 1
    ocs: bool = False  # built of 4x4x4 cubes joined by optical circuit switches

    # -- sizes -------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def chips_per_slice(self) -> int:
        return int(np.prod(self.shape))

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def axis_names(self) -> tuple[str, ...]:
        names = AXIS_NAMES[: self.ndim]
        return names + ((DCN_AXIS,) if self.num_slices > 1 else ())

    @property
    def name(self) -> str:
        base = "x".join(str(n) for n in self.shape)
        return base if self.num_slices == 1 else f"{self.num_slices}x({base})"

    @property
    def num_ici_links(self) -> int:
        return self.num_chips * 2 * self.ndim

    @property
    def num_links(self) -> int:
        """All link ids: ICI ids first, then DCN egress, then DCN ingress."""
        return self.num_ici_links + (2 * self.num_chips if self.num_slices > 1 else 0)

    def axis_size(self, axis: str) -> int:
        if axis == DCN_AXIS and self.num_slices > 1:
            return self.num_slices
        return self.shape[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        """Index of an ICI axis name; a clear error for an axis the topology lacks."""
        if axis in AXIS_NAMES[: self.ndim]:
            return AXIS_NAMES.index(axis)
        raise TpusimError(
            f"axis {axis!r} is not in the {self.name} topology; its axes are "
            f"{', '.join(self.axis_names)}"
        )

    def wraps(self, axis: str) -> bool:
        if axis == DCN_AXIS:
            return False
        return self.wraparound[self.axis_index(axis)]

    # -- coordinates -----------------------------------------------------------------------
    def coords(self, chip: int) -> tuple[int, ...]:
        """(x, y, z...) of a chip inside its slice, plus the slice index last if multi-slice."""
        s, local = divmod(int(chip), self.chips_per_slice)
        c = tuple(int(v) for v in np.unravel_index(local, self.shape))
        return c + ((s,) if self.num_slices > 1 else ())

    def chip_id(self, coords: tuple[int, ...]) -> int:
        n_ok = (self.ndim, self.ndim + 1) if self.num_slices > 1 else (self.ndim,)
        if len(coords) not in n_ok:
            raise TpusimError(
                f"chip coordinates {tuple(coords)} have {len(coords)} value(s) but the "
                f"{self.name} topology needs {' or '.join(map(str, n_ok))} (x, y[, z]"
                f"{', slice' if self.num_slices > 1 else ''})"
            )
        ici = tuple(coords[: self.ndim])
        s = coords[self.ndim] if len(coords) > self.ndim else 0
        for n, c in zip(self.shape, ici, strict=True):
            if not 0 <= c < n:
                raise TpusimError(
                    f"chip coordinates {coords} are outside the {self.name} topology; "
                    f"each coordinate must be in 0..size-1"
                )
        if not 0 <= s < self.num_slices:
            raise TpusimError(f"slice index {s} is outside 0..{self.num_slices - 1}")
        return int(s * self.chips_per_slice + np.ravel_multi_index(ici, self.shape))

    def all_coords(self) -> np.ndarray:
        """[num_chips_per_slice, ndim] array of coordinates, row = local chip id."""
        return _all_coords(self.shape)

    # -- links -----------------------------------------------------------------------------
    def ici_link_id(self, chip: int, axis: int, direction: int) -> int:
        return chip * 2 * self.ndim + 2 * axis + (0 if direction > 0 else 1)

    def link_mask(self) -> np.ndarray:
        """Boolean array over ICI link ids: which exist."""
        return _link_mask(self.shape, self.wraparound, self.num_slices)

    def link_endpoints(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) chip arrays over ICI link ids; -1 where the link does not exist."""
        return _link_endpoints(self.shape, self.wraparound, self.num_slices)

    def ocs_link_mask(self) -> np.ndarray:
        """Boolean array over ICI link ids: the links that go through an optical circuit switch
        (they leave a 4x4x4 cube through its face), all False on a pod without switches."""
        return _ocs_mask(self.shape, self.wraparound, self.num_slices, self.ocs)

    def link_via(self) -> np.ndarray:
        """Per ICI link id: `cube` (inside a cube, or any link of a pod without switches) or
        `ocs` (through a switch); `none` where the link does not exist."""
        out = np.where(self.ocs_link_mask(), "ocs", "cube").astype(object)
        out[~self.link_mask()] = "none"
        return out

    def describe_link(self, link: int) -> str:
        """Human name of a link id, e.g. `(0,1)->(1,1) x+` or `dcn-out 3`."""
        if link < self.num_ici_links:
            chip, rest = divmod(link, 2 * self.ndim)
            axis, d = divmod(rest, 2)
            src, dst = self.link_endpoints()
            return (
                f"{_fmt(self.coords(chip))}->{_fmt(self.coords(int(dst[link])))} "
                f"{AXIS_NAMES[axis]}{'+-'[d]}"
            )
        k = link - self.num_ici_links
        if k < self.num_chips:
            return f"dcn-out {_fmt(self.coords(k))}"
        return f"dcn-in {_fmt(self.coords(k - self.num_chips))}"

    def graph(self):
        """The ICI network as a `networkx.MultiDiGraph` (built on demand, cached).

        Nodes are coordinate tuples (plus the slice index when multi-slice); each edge's key is
        its link id and carries `axis` and `direction`. DCN is not drawn as edges.
        """
        return _graph(self.shape, self.wraparound, self.num_slices)


def _fmt(c: tuple[int, ...]) -> str:
    return "(" + ",".join(str(v) for v in c) + ")"


@functools.lru_cache(maxsize=32)
def _all_coords(shape: tuple[int, ...]) -> np.ndarray:
    grids = np.indices(shape).reshape(len(shape), -1).T
    grids.setflags(write=False)
    return grids


@functools.lru_cache(maxsize=32)
def _link_endpoints(
    shape: tuple[int, ...], wrap: tuple[bool, ...], num_slices: int
) -> tuple[np.ndarray, np.ndarray]:
    ndim = len(shape)
    per_slice = int(np.prod(shape))
    n = per_slice * num_slices
    coords = _all_coords(shape)
    strides = np.array([int(np.prod(shape[i + 1 :])) for i in range(ndim)], dtype=np.int64)
    src = np.full(n * 2 * ndim, -1, dtype=np.int64)
    dst = np.full(n * 2 * ndim, -1, dtype=np.int64)
    local = np.arange(per_slice, dtype=np.int64)
    for s in range(num_slices):
        base = s * per_slice
        for a in range(ndim):
            size = shape[a]
            if size == 1:
                continue
            for d, step in ((0, 1), (1, -1)):
                nxt = coords[:, a] + step
                if wrap[a]:
                    ok = np.ones(per_slice, dtype=bool)
                    nxt = nxt % size
                else:
                    ok = (nxt >= 0) & (nxt < size)
                nbr = local + (nxt - coords[:, a]) * strides[a]
                ids = (base + local) * 2 * ndim + 2 * a + d
                src[ids[ok]] = base + local[ok]
                dst[ids[ok]] = base + nbr[ok]
    src.setflags(write=False)
    dst.setflags(write=False)
    return src, dst


@functools.lru_cache(maxsize=32)
def _link_mask(shape: tuple[int, ...], wrap: tuple[bool, ...], num_slices: int) -> np.ndarray:
    return _link_endpoints(shape, wrap, num_slices)[0] >= 0


# The side of the cube a v4/v5p pod is built of (topologies/slices.py holds the rule).
_CUBE_SIDE = 4


@functools.lru_cache(maxsize=32)
def _ocs_mask(shape: tuple[int, ...], wrap: tuple[bool, ...], num_slices: int,
              ocs: bool) -> np.ndarray:
    ndim = len(shape)
    exists = _link_mask(shape, wrap, num_slices)
    mask = np.zeros(len(exists), dtype=bool)
    if ocs:
        coords = np.tile(_all_coords(shape), (num_slices, 1))
        for a in range(ndim):
            # A + link leaves the cube from its last layer, a - link from its first.
            c = coords[:, a] % _CUBE_SIDE
            mask[2 * a::2 * ndim] = c == _CUBE_SIDE - 1
            mask[2 * a + 1::2 * ndim] = c == 0
        mask &= exists
    mask.setflags(write=False)
    return mask


@functools.lru_cache(maxsize=8)
def _graph(shape: tuple[int, ...], wrap: tuple[bool, ...], num_slices: int):
    import networkx as nx

    topo = Topology(shape=shape, wraparound=wrap, num_slices=num_slices)
    g = nx.MultiDiGraph()
    for chip in range(topo.num_chips):
        g.add_node(topo.coords(chip))
    src, dst = topo.link_endpoints()
    ndim = len(shape)
    for link in np.flatnonzero(src >= 0):
        rest = int(link) % (2 * ndim)
        g.add_edge(
            topo.coords(int(src[link])),
            topo.coords(int(dst[link])),
            key=int(link),
            axis=AXIS_NAMES[rest // 2],
            direction="+-"[rest % 2],
        )
    return g


def parse_shape(text: str) -> tuple[int, ...]:
    """`"8x16"` -> (8, 16). One to three positive axes."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        shape = tuple(ascii_int(p, max_digits=9) for p in parts)
    except ValueError:
        raise TpusimError(
            f"shape {short_repr(text)} is not like 8x16 or 4x4x4: give 1 to 3 positive integers in "
            f"ASCII digits joined by x"
        ) from None
    if not 1 <= len(shape) <= 3 or any(n < 1 for n in shape):
        raise TpusimError(
            f"shape {str(text)[:40]!r} must have 1 to 3 axes, each >= 1 (e.g. 8x16 or 4x4x4)"
        )
    return shape


def parse_wraparound(text: str, shape: tuple[int, ...]) -> tuple[bool, ...] | None:
    """`auto` -> None (apply the chip's rule); `none`, `all`, or axis letters like `x,z`/`xz`."""
    t = str(text).strip().lower()
    ndim = len(shape)
    if t == "auto":
        return None
    if t == "none":
        return (False,) * ndim
    if t == "all":
        return (True,) * ndim
    # Either comma-separated axis letters (`x,z`) or letters written together (`xz`); an empty
    # item (`x,,z`) or a repeated axis (`x,x`) is a typo, not a different topology.
    letters = [c.strip() for c in t.split(",")] if "," in t else list(t.replace(" ", ""))
    allowed = AXIS_NAMES[:ndim]
    bad = [c for c in letters if c not in allowed]
    if bad or not letters or len(set(letters)) != len(letters):
        from topologies.validate import short_repr

        raise TpusimError(
            f"--wraparound {short_repr(text)} is not valid for a {ndim}D shape: each item must be "
            f"one axis letter, given once; use auto, none, all, or axis letters from "
            f"{','.join(allowed)} (e.g. {','.join(allowed[::2])})"
        )
    return tuple(a in letters for a in allowed)


def build_torus(
    shape: tuple[int, ...], wraparound: tuple[bool, ...] | bool, *, num_slices: int = 1,
    ocs: bool = False,
) -> Topology:
    """A torus of `shape` with per-axis wraparound (a bool applies to every axis).

    Wraparound on a size-1 axis is meaningless and is dropped; on a size-2 axis it adds the
    second (wraparound) link between the two chips. `ocs`: the slice is made of 4x4x4 cubes
    joined by optical circuit switches (every axis a multiple of 4).
    """
    shape = tuple(int(n) for n in shape)
    if not 1 <= len(shape) <= 3 or any(n < 1 for n in shape):
        raise TpusimError(f"shape {shape} must have 1 to 3 axes, each >= 1")
    if isinstance(wraparound, bool):
        wraparound = (wraparound,) * len(shape)
    if len(wraparound) != len(shape):
        raise TpusimError(
            f"wraparound {wraparound} has {len(wraparound)} entries for a {len(shape)}D shape"
        )
    if num_slices < 1:
        raise TpusimError(f"--slices {num_slices} must be >= 1")
    wrap = tuple(bool(w) and n > 1 for w, n in zip(wraparound, shape, strict=True))
    if ocs and (len(shape) != 3 or any(n % _CUBE_SIDE for n in shape)):
        raise TpusimError(
            f"shape {'x'.join(map(str, shape))} is not made of whole 4x4x4 cubes, so optical "
            f"switches cannot build it; give every axis a multiple of 4"
        )
    return Topology(shape=shape, wraparound=wrap, num_slices=int(num_slices), ocs=bool(ocs))
