"""Replica-group geometry on a torus: group axes (whole axes, factors of axes, DCN), the groups a
collective's axes cut the pod into, link classes, and dimension-order routes.

This is pure topology (no simulation): the algorithm schedules in `sim/collectives/` are built
on `GroupAxis`, routes here turn them into links, and the engines in `sim/` load those links.

On a twisted torus (`Topology.twisted`) a short axis's wraparound link lands k chips along the
long axes. A group that holds every long axis whole keeps that link inside it: the short axis
is a twisted ring (`GroupAxis.twist`), and a move's offset is a vector of hops per axis whose
walk crosses the twist (`lattice_offsets` lists the shortest ones). A group without the long
axes does not: its short axis is a line (`GroupAxis.wrap_leaves`), whose wraparound link leads
out of the group, as on a torus without wraparound.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from topologies.errors import TpusimError
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology

# Link classes: every directed ICI link belongs to (axis, direction); DCN egress/ingress per chip.
NUM_CLASSES = 8  # x+, x-, y+, y-, z+, z-, dcn-out, dcn-in
DCN_OUT_CLASS = 6
DCN_IN_CLASS = 7
CLASS_NAMES = ("x+", "x-", "y+", "y-", "z+", "z-", "dcn-out", "dcn-in")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupAxis:
    """One axis of a replica group: a physical ICI axis, a factor of one, or the DCN axis.

    A factor of a physical axis of `phys_size` chips takes `size` chips `stride` apart
    (coordinate digit `(c // stride) % size`): `tensor=4` on a 16-chip x axis is the inner factor
    (stride 1, a 4-chip line segment); the remaining factor has stride 4 and, if x wraps, is a
    4-chip ring whose neighbours are 4 hops apart.
    """

    name: str
    size: int
    wraps: bool  # a ring (whole wrapped axis, or its outermost factor), or DCN
    index: int  # ICI axis index in the topology (-1 for DCN)
    stride: int = 1
    phys_size: int = 0  # chips on the physical axis (0: same as size)
    # Twisted torus: (physical axis, shift) pairs a wraparound hop of this (short, whole) axis
    # moves by, the long axes being whole axes of the same group (`with_twist`).
    twist: tuple[tuple[int, int], ...] = ()
    # Twisted torus: the axis's wraparound link exists but leads out of the group (a short
    # axis of a group without the long axes), so the axis is a line here.
    wrap_leaves: bool = False

    @property
    def is_dcn(self) -> bool:
        return self.name == DCN_AXIS

    @property
    def physical_name(self) -> str:
        return DCN_AXIS if self.is_dcn else AXIS_NAMES[self.index]

    @property
    def axis_len(self) -> int:
        return self.phys_size or self.size


def axis_factor(topology: Topology, axis: str, size: int, stride: int) -> GroupAxis:
    """A factor of a physical axis (or of DCN): `size` chips, `stride` apart."""
    n = topology.axis_size(axis)
    if size < 1 or stride < 1 or n % (size * stride):
        raise TpusimError(
            f"axis {axis} has {n} chips and cannot hold a factor of {size} with stride {stride}; "
            f"use sizes that divide {n}"
        )
    if axis == DCN_AXIS:
        return GroupAxis(name=DCN_AXIS, size=size, wraps=True, index=-1, stride=stride,
                         phys_size=n)
    idx = topology.axis_index(axis)
    whole = size * stride == n
    label = axis if size == n else f"{axis}[{size}@{stride}]"
    # A twisted short axis closes its ring only through the long axes (`with_twist`): on its
    # own, or as a factor, it is a line whose wraparound link leaves the group.
    leaves = bool(topology.twist_of(idx)) and whole and size > 1
    return GroupAxis(
        name=label, size=size, wraps=topology.wraparound[idx] and whole and size > 1
        and not leaves, index=idx, stride=stride, phys_size=n, wrap_leaves=leaves,
    )


def with_twist(topology: Topology, gaxes: tuple[GroupAxis, ...]) -> tuple[GroupAxis, ...]:
    """The group axes on a twisted torus: a whole short axis in a group that holds every long
    axis whole is a twisted ring (its wraparound hop moves k along them, inside the group);
    otherwise it is a line (`wrap_leaves`). Unchanged on a plain torus; idempotent."""
    if not topology.twisted:
        return gaxes
    whole = {g.index for g in gaxes if not g.is_dcn and g.stride == 1 and g.size == g.axis_len}
    out = []
    for g in gaxes:
        tw = () if g.is_dcn else topology.twist_of(g.index)
        if tw and g.index in whole and g.size > 1 and all(j in whole for j, _ in tw):
            g = dataclasses.replace(g, wraps=True, twist=tw, wrap_leaves=False)
        elif tw and g.twist:
            g = dataclasses.replace(g, wraps=False, twist=(), wrap_leaves=True)
        out.append(g)
    return tuple(out)


def as_lines(gaxes: tuple[GroupAxis, ...]) -> tuple[GroupAxis, ...]:
    """The group axes with every twisted ring made a line: what the ring algorithms run on,
    since a ring along a twisted axis would step into another of its rings at the wraparound
    (docs/model/pods.md)."""
    if not any(g.twist for g in gaxes):
        return gaxes
    return tuple(dataclasses.replace(g, wraps=False, twist=(), wrap_leaves=True) if g.twist
                 else g for g in gaxes)


def lattice_digits(gaxes: tuple[GroupAxis, ...], vec: np.ndarray) -> np.ndarray:
    """Hop vectors ([n, k] signed hops per group axis) -> the local digits they lead to from
    digit 0 (or, for a coordinate difference d - s, the offset of d from s): each axis's
    wraps taken mod its size, a twisted axis's wraps adding its shift to the long axes."""
    digit = np.array(vec, dtype=np.int64, copy=True).reshape(-1, len(gaxes))
    pos = {g.index: i for i, g in enumerate(gaxes) if not g.is_dcn}
    for i, g in enumerate(gaxes):
        q = np.floor_divide(digit[:, i], g.size)
        digit[:, i] -= q * g.size
        for j, shift in g.twist:
            digit[:, pos[j]] += q * shift
    return digit % np.asarray([g.size for g in gaxes], dtype=np.int64)


@functools.lru_cache(maxsize=64)
def lattice_offsets(gaxes: tuple[GroupAxis, ...]) -> dict[tuple[int, ...], tuple[tuple[int, ...],
                                                                                  ...]]:
    """Shortest hop vectors of a group whose axes are rings (some twisted): for every
    destination's local offset (digits, mod each axis's size), the vectors of signed hops per
    group axis with the fewest hops in all that reach it, in a fixed order.

    A vector `a` walks a_i hops along axis i, in axis order; crossing a twisted axis's
    wraparound adds its shift to the long axes' digits, so the vector (n_x, 0, 0) reaches the
    chip k along z. Searched over |a_i| <= n_i (numpy, exact: every shortest path's hop count
    equals the breadth-first distance, tests/test_twisted.py)."""
    sizes = [g.size for g in gaxes]
    grids = np.meshgrid(*[np.arange(-n, n + 1) for n in sizes], indexing="ij")
    vec = np.stack([gr.reshape(-1) for gr in grids], axis=1).astype(np.int64)
    key = np.ravel_multi_index(tuple(lattice_digits(gaxes, vec).T), sizes)
    hops = np.abs(vec).sum(axis=1)
    order = np.lexsort((*[vec[:, i] for i in reversed(range(len(sizes)))], hops, key))
    key, hops, vec = key[order], hops[order], vec[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    best = np.repeat(hops[first], np.diff(np.r_[first, len(key)]))
    keep = hops == best
    out: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for k, v in zip(key[keep].tolist(), vec[keep].tolist(), strict=True):
        d = tuple(int(x) for x in np.unravel_index(k, sizes))
        out.setdefault(d, []).append(tuple(v))
    return {d: tuple(vs) for d, vs in out.items()}


def group_axes(topology: Topology, axes: tuple[str, ...]) -> tuple[GroupAxis, ...]:
    """Validate collective axes against the topology; ICI axes in x, y, z order, DCN last
    (twisted rings where the group holds a twisted torus's long axes: `with_twist`)."""
    if not axes:
        raise TpusimError("a collective needs at least one axis, e.g. {axes} x or {axes} x,y",
        "axes")
    seen: list[GroupAxis] = []
    for a in axes:
        if a == DCN_AXIS:
            if topology.num_slices == 1:
                raise TpusimError(
                    "axis 'dcn' needs several slices; add {slices} N (N >= 2) or drop dcn", "slices"
                )
            ga = axis_factor(topology, DCN_AXIS, topology.num_slices, 1)
        else:
            topology.axis_index(a)
            ga = axis_factor(topology, a, topology.axis_size(a), 1)
        if any(g.name == ga.name for g in seen):
            raise TpusimError(f"axis {a!r} is given twice in {{axes}}; list each axis once", "axes")
        seen.append(ga)
    order = {n: i for i, n in enumerate(AXIS_NAMES + (DCN_AXIS,))}
    return with_twist(topology, tuple(sorted(seen, key=lambda g: (order[g.physical_name],
                                                                  g.stride))))


class GroupGeometry:
    """The replica groups of a collective: chips that differ only in the group's digits."""

    def __init__(self, topology: Topology, gaxes: tuple[GroupAxis, ...]) -> None:
        self.topology = topology
        self.gaxes = gaxes
        self.sizes = tuple(g.size for g in gaxes)
        self.group_size = int(np.prod(self.sizes))
        self.num_groups = topology.num_chips // self.group_size
        ici = topology.all_coords()
        if topology.num_slices > 1:
            s = np.repeat(np.arange(topology.num_slices), topology.chips_per_slice)
            full = np.column_stack([np.tile(ici, (topology.num_slices, 1)), s])
        else:
            full = np.asarray(ici)
        ndim = topology.ndim
        dims = list(topology.shape) + ([topology.num_slices] if topology.num_slices > 1 else [])
        col_of = [g.index if not g.is_dcn else ndim for g in gaxes]
        group_digits = [(full[:, c] // g.stride) % g.size for g, c in zip(gaxes, col_of,
                                                                          strict=True)]
        other_digits, other_sizes = [], []
        for c, n in enumerate(dims):
            factors = sorted((g.stride, g.size) for g, cc in zip(gaxes, col_of, strict=True)
                             if cc == c)
            pos = 1
            for stride, size in factors:
                if stride < pos:
                    raise TpusimError("internal error: overlapping axis factors")
                if stride > pos:
                    other_digits.append((full[:, c] // pos) % (stride // pos))
                    other_sizes.append(stride // pos)
                pos = stride * size
            if pos < n:
                other_digits.append(full[:, c] // pos)
                other_sizes.append(n // pos)
        if other_digits:
            self.group_of_chip = np.ravel_multi_index(tuple(other_digits), other_sizes)
        else:
            self.group_of_chip = np.zeros(topology.num_chips, dtype=np.int64)
        self.local_of_chip = np.ravel_multi_index(tuple(group_digits), self.sizes)
        # Groups interleave (share links) when a factor is strided.
        self.disjoint = all(g.stride == 1 for g in gaxes)

    def group_chips(self, g: int) -> np.ndarray:
        """Global chip ids of group g, ordered by local index (C order over the group axes)."""
        chips = np.flatnonzero(self.group_of_chip == g)
        order = np.argsort(self.local_of_chip[chips], kind="stable")
        return chips[order]

    def local_coords(self) -> np.ndarray:
        """[group_size, k] coordinates along the group axes."""
        return np.indices(self.sizes).reshape(len(self.sizes), -1).T


def route_class_hops(gaxes: tuple[GroupAxis, ...], offset: tuple[int, ...]) -> list[int]:
    """Class resources (with multiplicity) of a dimension-order route for a translation move."""
    res: list[int] = []
    for g, o in zip(gaxes, offset, strict=True):
        if o == 0:
            continue
        if g.is_dcn:
            res += [DCN_OUT_CLASS, DCN_IN_CLASS]
        else:
            res += [2 * g.index + (0 if o > 0 else 1)] * (abs(o) * g.stride)
    return res


def route_latency_s(gaxes, offset, ici_hop_s: float, dcn_s: float, ocs_s: float = 0.0) -> float:
    """Latency of a dimension-order route: every ICI hop's, a DCN crossing's, and, on a pod of
    cubes joined by optical switches, `ocs_s` for every switched hop the route may take (a run of
    h hops along an axis leaves at most ceil(h/4) cubes of side 4: the worst chip's count, which
    sets a synchronous step's latency)."""
    lat = 0.0
    for g, o in zip(gaxes, offset, strict=True):
        if o:
            lat += dcn_s if g.is_dcn else ici_hop_s * abs(o) * g.stride
            if ocs_s and not g.is_dcn:
                lat += ocs_s * -(-abs(o) * g.stride // 4)
    return lat


def route_links(
    topology: Topology,
    gaxes: tuple[GroupAxis, ...],
    src_chips: np.ndarray,
    offset: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Link ids of dimension-order routes from `src_chips` by `offset` (full detail).

    Returns (res, ptr, dst_chips) in CSR form, one transfer per source chip. The caller has
    already dropped sources whose destination falls off a non-wrapping axis.
    """
    src_arr, dst_arr = topology.link_endpoints()
    ndim = topology.ndim
    n_ici = topology.num_ici_links
    n = len(src_chips)
    hops_cols: list[np.ndarray] = []
    cur = np.asarray(src_chips, dtype=np.int64).copy()
    for g, o in zip(gaxes, offset, strict=True):
        if o == 0:
            continue
        if g.is_dcn:
            # Jump |o| slices in the slice index (any-to-any switched network).
            s_cur = cur // topology.chips_per_slice
            local = cur % topology.chips_per_slice
            s_new = (s_cur + o * g.stride) % topology.num_slices
            nxt = s_new * topology.chips_per_slice + local
            hops_cols.append(n_ici + cur)
            hops_cols.append(n_ici + topology.num_chips + nxt)
            cur = nxt
            continue
        d = 0 if o > 0 else 1
        for _ in range(abs(o) * g.stride):
            link = cur * 2 * ndim + 2 * g.index + d
            if np.any(src_arr[link] < 0):
                raise TpusimError(  # pragma: no cover - algorithms never route off a line
                    f"internal routing error: a route leaves the {topology.name} torus on axis "
                    f"{g.name}"
                )
            hops_cols.append(link)
            cur = dst_arr[link]
    h = len(hops_cols)
    res = np.stack(hops_cols, axis=1).reshape(-1) if h else np.zeros(0, dtype=np.int64)
    ptr = np.arange(0, n * h + 1, h, dtype=np.int64) if h else np.zeros(n + 1, dtype=np.int64)
    return res, ptr, cur


class DetourRouter:
    """Reroutes transfers around dead ICI links: the shortest live path, as ICI rerouting does.

    A route (a run of ICI hops, possibly followed by DCN hops) that crosses a dead link has each
    ICI run holding a dead link replaced by a shortest path between the run's ends over the live
    links (either direction round a ring, or sideways through a neighbouring row). Among equally
    short paths the walk prefers, at every chip, the link classes of the original run in the
    order they appear, then the lowest class id (x+, x-, y+, ...): deterministic, and as close
    to dimension order as the detour allows. Distances come from a reverse breadth-first search
    over the live links (numpy, one per distinct run end, cached).

    The router also accumulates what the detours cost (`rerouted_transfers`, `extra_hops`,
    `extra_link_bytes`, repetitions included).
    """

    def __init__(self, topology: Topology, dead_links: tuple[int, ...]) -> None:
        self.topology = topology
        self.dead_links = tuple(sorted(int(d) for d in dead_links))
        n_ici = topology.num_ici_links
        self.dead_mask = np.zeros(topology.num_links, dtype=bool)
        self.dead_mask[list(self.dead_links)] = True
        src, dst = topology.link_endpoints()
        live = topology.link_mask() & ~self.dead_mask[:n_ici]
        self._live = live
        self._ls = src[live]
        self._ld = dst[live]
        self._dst = dst
        self._dist: dict[int, np.ndarray] = {}
        self.rerouted_transfers = 0
        self.extra_hops = 0
        self.extra_link_bytes = 0.0
        self.max_route_hops = 0
        # Bytes each link carries on the detours (the replacement paths), for the plots.
        self.detour_link_bytes: dict[int, float] = {}
        self.context = ""  # appended to the disconnection error (which collective needs it)

    def _dist_to(self, end: int) -> np.ndarray:
        d = self._dist.get(end)
        if d is not None:
            return d
        dist = np.full(self.topology.num_chips, -1, dtype=np.int64)
        dist[end] = 0
        k = 0
        while True:
            step = (dist[self._ld] == k) & (dist[self._ls] < 0)
            if not step.any():
                break
            dist[self._ls[step]] = k + 1
            k += 1
        self._dist[end] = dist
        return dist

    def path(self, start: int, end: int, prefer: list[int], what: str = "") -> list[int]:
        """Link ids of a shortest live path from chip `start` to chip `end`."""
        dist = self._dist_to(end)
        if dist[start] < 0:
            t = self.topology
            per = 2 * t.ndim
            _src, dst = t.link_endpoints()
            for chip in (start, end):  # a chip all of whose links are dead (a failed chip)
                if not self._live[chip * per:(chip + 1) * per].any() \
                        and not self._live[dst == chip].any():
                    raise TpusimError(
                        f"chip {_fmt(t.coords(chip))} has no live link{what}, and a transfer "
                        f"starts or ends there: no route reaches it; remove a {{dead_link}}",
                        "dead_link")
            dead = ", ".join(t.describe_link(d) for d in self.dead_links)
            raise TpusimError(
                f"dead links {dead} disconnect chip {_fmt(t.coords(start))} from "
                f"{_fmt(t.coords(end))}{what}: no live path joins them; remove a {{dead_link}} "
                f"(or give the pod wraparound)", "dead_link"
            )
        per = 2 * self.topology.ndim
        order = list(dict.fromkeys(prefer)) + [c for c in range(per) if c not in prefer]
        out: list[int] = []
        cur = start
        while cur != end:
            want = dist[cur] - 1
            for c in order:
                link = cur * per + c
                if self._live[link] and dist[self._dst[link]] == want:
                    out.append(link)
                    cur = int(self._dst[link])
                    break
            else:  # pragma: no cover - a BFS distance always has a predecessor
                raise TpusimError("internal routing error: broken detour distance")
        return out

    def reroute(
        self, res: np.ndarray, ptr: np.ndarray, bytes_per_transfer: np.ndarray, repeat: int,
        what: str = "",
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Replace the routes (CSR `res`/`ptr`) that cross a dead link.

        Returns (res, ptr, rerouted transfer indices). Updates the cost counters."""
        hit = np.flatnonzero(self.dead_mask[res])
        if len(hit) == 0:
            return res, ptr, np.zeros(0, dtype=np.int64)
        n_ici = self.topology.num_ici_links
        src_arr, _ = self.topology.link_endpoints()
        per = 2 * self.topology.ndim
        affected = np.unique(np.searchsorted(ptr, hit, side="right") - 1)
        new_routes: dict[int, np.ndarray] = {}
        for t in affected.tolist():
            route = res[ptr[t] : ptr[t + 1]].tolist()
            out: list[int] = []
            i = 0
            while i < len(route):
                if route[i] >= n_ici:
                    out.append(route[i])
                    i += 1
                    continue
                j = i
                while j < len(route) and route[j] < n_ici:
                    j += 1
                run = route[i:j]
                if any(self.dead_mask[h] for h in run):
                    start = int(src_arr[run[0]])
                    end = int(self._dst[run[-1]])
                    detour = self.path(start, end, [h % per for h in run],
                                       what or self.context)
                    moved = float(bytes_per_transfer[t]) * repeat
                    for h in detour:
                        self.detour_link_bytes[h] = self.detour_link_bytes.get(h, 0.0) + moved
                    out += detour
                else:
                    out += run
                i = j
            new_routes[t] = np.asarray(out, dtype=np.int64)
            extra = len(out) - len(route)
            self.rerouted_transfers += repeat
            self.extra_hops += extra * repeat
            self.extra_link_bytes += extra * float(bytes_per_transfer[t]) * repeat
            self.max_route_hops = max(self.max_route_hops, len(out))
        counts = np.diff(ptr)
        new_counts = counts.copy()
        for t, r in new_routes.items():
            new_counts[t] = len(r)
        new_ptr = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64)
        new_res = np.empty(int(new_ptr[-1]), dtype=np.int64)
        keep = np.ones(len(counts), dtype=bool)
        keep[affected] = False
        owner = np.repeat(np.arange(len(counts)), counts)
        kept = keep[owner]
        pos = np.arange(len(res)) - ptr[owner] + new_ptr[owner]
        new_res[pos[kept]] = res[kept]
        for t, r in new_routes.items():
            new_res[new_ptr[t] : new_ptr[t + 1]] = r
        return new_res, new_ptr, affected


def _fmt(c: tuple[int, ...]) -> str:
    return "(" + ",".join(str(v) for v in c) + ")"


def slice_axes(topology: Topology) -> tuple[GroupAxis, ...]:
    """The whole slice's ICI axes as one group (twisted rings on a twisted torus)."""
    return group_axes(topology, AXIS_NAMES[: topology.ndim])


def shortest_vectors(topology: Topology, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
    """The shortest hop vectors (signed hops per ICI axis) from chip `src` to chip `dst` of the
    same slice, on the real wiring (twisted or not; ties all listed, in a fixed order)."""
    gaxes = slice_axes(topology)
    cs = np.asarray(topology.coords(src)[: topology.ndim])
    cd = np.asarray(topology.coords(dst)[: topology.ndim])
    if not all(g.wraps for g in gaxes):
        return (tuple(int(v) for v in cd - cs),)  # lines: the one straight vector
    d = tuple(int(v) for v in lattice_digits(gaxes, (cd - cs)[None, :])[0])
    return lattice_offsets(gaxes)[d] if any(d) else ((0,) * topology.ndim,)


def _twisted_pairs_links(topology: Topology, pairs) -> tuple[np.ndarray, int, dict[int, int]]:
    count: dict[int, int] = {}
    dcn_out: dict[int, int] = {}
    dcn_in: dict[int, int] = {}
    max_hops = 0
    ndim = topology.ndim
    per = topology.chips_per_slice
    _src, dst_arr = topology.link_endpoints()
    for src, dst in pairs:
        src, dst = int(src), int(dst)
        if src // per != dst // per:
            dcn_out[src] = dcn_out.get(src, 0) + 1
            dcn_in[dst] = dcn_in.get(dst, 0) + 1
        vec = shortest_vectors(topology, src, dst - (dst // per - src // per) * per)[0]
        cur = src
        for a, o in enumerate(vec):
            for _ in range(abs(o)):
                link = topology.ici_link_id(cur, a, 1 if o > 0 else -1)
                count[link] = count.get(link, 0) + 1
                cur = int(dst_arr[link])
        max_hops = max(max_hops, sum(abs(o) for o in vec))
    cls = np.zeros(NUM_CLASSES)
    for link, c in count.items():
        k = link % (2 * ndim)
        cls[k] = max(cls[k], c)
    if dcn_out:
        cls[DCN_OUT_CLASS] = max(dcn_out.values())
        cls[DCN_IN_CLASS] = max(dcn_in.values())
    return cls, max_hops, count


def _digit_factors(values: list[int]) -> list[tuple[int, int]] | None:
    """Sorted distinct coordinates along one axis -> (size, stride) digit factors whose digits
    enumerate exactly these values from an aligned base, or None."""
    if len(values) == 1:
        return []
    vs = set(values)
    base = values[0]
    step = values[1] - values[0]
    run = 1
    while base + run * step in vs:
        run += 1
    if len(values) % run:
        return None
    rest = [v for v in values if ((v - base) // step) % run == 0 and (v - base) % step == 0]
    if len(rest) * run != len(values):
        return None
    if (base // step) % run:  # the digit must start at 0 for the block to be a factor
        return None
    inner = _digit_factors(rest)
    if inner is None or any(s <= step * (run - 1) for _, s in inner):
        return None
    return [(run, step)] + inner


def _block_factors(topology: Topology, groups: list[list[int]]):
    """(the axis factors of the first group, their geometry or None for one chip, the geometry's
    groups the given ones are) when every group is a digit-aligned block of those factors and
    no two are one geometry group, else None."""
    coords = np.asarray([topology.coords(c) for c in range(topology.num_chips)])
    names = list(AXIS_NAMES[: topology.ndim]) + ([DCN_AXIS] if topology.num_slices > 1 else [])
    g0 = np.asarray(groups[0])
    factors: list[GroupAxis] = []
    for col, axis in enumerate(names):
        vals = sorted({int(v) for v in coords[g0, col]})
        fs = _digit_factors(vals)
        if fs is None:
            return None
        for size, stride in fs:
            if topology.axis_size(axis) % (size * stride):
                return None  # e.g. chips 0 and 3 of a 4-ring: no digit of the axis
            factors.append(axis_factor(topology, axis, size, stride))
    if int(np.prod([f.size for f in factors] or [1])) != len(groups[0]):
        return None
    if not factors:
        return (), None, set()
    geo = GroupGeometry(topology, tuple(factors))
    seen: set[int] = set()
    for g in groups:
        ids = {int(geo.group_of_chip[c]) for c in g}
        if len(ids) != 1 or len(g) != geo.group_size or ids & seen:
            return None
        seen |= ids
    return tuple(factors), geo, seen


def factor_device_groups(
    topology: Topology, groups: list[list[int]]
) -> tuple[tuple[GroupAxis, ...], bool]:
    """Replica groups given as chip ids -> the group axes (factors of physical axes) whose
    replica groups they are, and whether that is exact.

    Exact when every group is a digit-aligned block of factors and the groups are exactly the
    ones `GroupGeometry` cuts the pod into. Otherwise the whole physical axes along which some
    group varies are returned with `False` (the caller says so in a warning)."""
    found = _block_factors(topology, groups)
    if found is not None and (found[1] is None or len(found[2]) == found[1].num_groups):
        order = {n: i for i, n in enumerate(AXIS_NAMES + (DCN_AXIS,))}
        return tuple(sorted(found[0], key=lambda g: (order[g.physical_name], g.stride))), True
    coords = np.asarray([topology.coords(c) for c in range(topology.num_chips)])
    names = list(AXIS_NAMES[: topology.ndim]) + ([DCN_AXIS] if topology.num_slices > 1 else [])
    spanned = [a for col, a in enumerate(names)
               if any(len({int(v) for v in coords[np.asarray(g), col]}) > 1 for g in groups)]
    return tuple(axis_factor(topology, a, topology.axis_size(a), 1) for a in spanned), False


def tile_device_groups(topology: Topology, groups: list[list[int]]) -> list[list[int]] | None:
    """Every group of the pod cut into blocks of the shape `groups` share (each a digit-aligned
    block of the same axis factors, as `factor_device_groups` finds them), the given ones among
    them, or None when they are not such blocks. Groups that cover part of the pod (the ranks of
    one pipeline stage) are exact on this tiling, where `factor_device_groups` of them alone
    would span whole axes."""
    found = _block_factors(topology, groups)
    if found is None or found[1] is None:
        return None
    label = found[1].group_of_chip
    return sorted(np.flatnonzero(label == g).tolist() for g in range(found[1].num_groups))


def route_pairs(topology: Topology, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Dimension-order shortest routes (x, then y, then z; the shorter way round where an axis
    wraps, ties going +) of point-to-point messages between chips.

    Returns (messages on the busiest link of each link class, most ICI hops of any route)."""
    cls, hops, _count = route_pairs_links(topology, pairs)
    return cls, hops


def route_pairs_links(topology: Topology, pairs: list[tuple[int, int]]
                      ) -> tuple[np.ndarray, int, dict[int, int]]:
    """`route_pairs` plus the number of messages on every ICI link id the routes use.

    On a twisted torus each message takes the first of its shortest hop vectors
    (`lattice_offsets` over the whole slice), walked in x, y, z order over the real links."""
    if topology.twisted:
        return _twisted_pairs_links(topology, pairs)
    count: dict[int, int] = {}
    dcn_out: dict[int, int] = {}
    dcn_in: dict[int, int] = {}
    max_hops = 0
    ndim = topology.ndim
    for src, dst in pairs:
        cs, cd = topology.coords(src), topology.coords(dst)
        if topology.num_slices > 1 and cs[ndim] != cd[ndim]:
            dcn_out[src] = dcn_out.get(src, 0) + 1
            dcn_in[dst] = dcn_in.get(dst, 0) + 1
        cur = list(cs[:ndim])
        hops = 0
        for a in range(ndim):
            n = topology.shape[a]
            delta = (cd[a] - cur[a]) % n
            if topology.wraparound[a]:
                d = 1 if delta <= n - delta else -1
                k = delta if d > 0 else n - delta
            else:
                d = 1 if cd[a] >= cur[a] else -1
                k = abs(cd[a] - cur[a])
            for _ in range(k):
                chip = int(np.ravel_multi_index(tuple(cur), topology.shape))
                link = topology.ici_link_id(chip, a, d)
                count[link] = count.get(link, 0) + 1
                cur[a] = (cur[a] + d) % n
                hops += 1
        max_hops = max(max_hops, hops)
    cls = np.zeros(NUM_CLASSES)
    for link, c in count.items():
        k = link % (2 * ndim)
        cls[k] = max(cls[k], c)
    if dcn_out:
        cls[DCN_OUT_CLASS] = max(dcn_out.values())
        cls[DCN_IN_CLASS] = max(dcn_in.values())
    return cls, max_hops, count
