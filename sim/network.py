"""ICI/DCN links as a fluid network inside SimPy, and dimension-order routing.

Resources are either individual directed links (full detail) or link *classes* (axis, direction)
when every chip does the same thing on a uniform torus (symmetric mode). Under translation
symmetry each link of a class carries exactly the traffic that one representative chip puts on
that class, so simulating the representative's transfers against class resources is exact
(see docs/model.md). Both modes share one fluid engine:

* A *batch* is one step of a collective: a set of transfers (bytes, path) that start together.
  It first waits its latency (hops x per-hop latency, the pipeline fill of a cut-through
  transfer), then its bytes drain. Transfers that share a link share its bandwidth in
  proportion to their bytes (so they drain together); a batch progresses at the pace of its most
  loaded link and holds its links until it completes.
* Rates are recomputed only when a batch starts draining or completes, so the cost is per step,
  not per byte or per packet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import simpy

from topologies.errors import TpusimError
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology

NUM_CLASSES = 8  # x+, x-, y+, y-, z+, z-, dcn-out, dcn-in
DCN_OUT_CLASS = 6
DCN_IN_CLASS = 7
CLASS_NAMES = ("x+", "x-", "y+", "y-", "z+", "z-", "dcn-out", "dcn-in")


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """One collective step, routed onto resources (links or link classes).

    Attributes:
        res: resource index of every hop of every transfer, transfer by transfer.
        ptr: CSR offsets into `res` (len = num transfers + 1); every transfer has >= 1 hop.
        bytes_per_transfer: payload of each transfer, per repetition.
        latency_s: latency before the bytes drain (all repetitions).
        repeat: identical back-to-back repetitions folded into this batch.
    """

    res: np.ndarray
    ptr: np.ndarray
    bytes_per_transfer: np.ndarray
    latency_s: float
    repeat: int = 1
    max_speed: float = float("inf")  # cap on the fraction completed per second (compute-bound)
    src: np.ndarray | None = None  # full detail: source chip of each transfer
    dst: np.ndarray | None = None  # full detail: destination chip of each transfer

    @property
    def num_transfers(self) -> int:
        return len(self.ptr) - 1

    @property
    def hop_weights(self) -> np.ndarray:
        """Bytes (all repetitions) of the transfer that owns each entry of `res`."""
        return np.repeat(self.bytes_per_transfer * self.repeat, np.diff(self.ptr))

    def resource_bytes(self, num_resources: int) -> np.ndarray:
        """Bytes carried per resource by this batch (all repetitions)."""
        counts = np.diff(self.ptr)
        w = np.repeat(self.bytes_per_transfer, counts) * self.repeat
        return np.bincount(self.res, weights=w, minlength=num_resources)


class FluidNetwork:
    """Bandwidth shared by concurrent batches, advanced by SimPy events.

    Args:
        env: the SimPy environment.
        capacity_bytes_per_s: bandwidth of each resource.
    """

    def __init__(self, env: simpy.Environment, capacity_bytes_per_s: np.ndarray) -> None:
        self.env = env
        self.capacity = np.asarray(capacity_bytes_per_s, dtype=float)
        self.num_resources = len(self.capacity)
        self.bytes = np.zeros(self.num_resources)
        self.busy_s = np.zeros(self.num_resources)
        self._active: dict[int, list] = {}  # id -> [batch, remaining fraction, speed, event]
        self._next_id = 0
        self._last_t = 0.0
        self._version = 0
        self._in_use = np.zeros(self.num_resources, dtype=bool)
        self.num_events = 0

    def transfer(self, batch: Batch) -> simpy.Event:
        """Start a batch now; the returned event fires when its last byte has arrived."""
        done = self.env.event()
        self.bytes += batch.resource_bytes(self.num_resources)
        if batch.num_transfers == 0 or float(np.max(batch.bytes_per_transfer, initial=0)) <= 0:
            t = self.env.timeout(batch.latency_s)
            t.callbacks.append(lambda _ev: done.succeed())
            return done
        if batch.latency_s > 0:
            t = self.env.timeout(batch.latency_s)
            t.callbacks.append(lambda _ev: self._admit(batch, done))
        else:
            self._admit(batch, done)
        return done

    # -- fluid bookkeeping ------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_t
        if dt > 0 and self._active:
            for entry in self._active.values():
                entry[1] -= entry[2] * dt
            self.busy_s[self._in_use] += dt
        self._last_t = now

    def _admit(self, batch: Batch, done: simpy.Event) -> None:
        self._advance()
        bid = self._next_id
        self._next_id += 1
        self._active[bid] = [batch, 1.0, 0.0, done]
        self._reschedule()

    def _reschedule(self) -> None:
        self.num_events += 1
        # Complete batches whose remaining work has drained (tolerate float dust).
        finished = [bid for bid, e in self._active.items() if e[1] <= 1e-12]
        for bid in finished:
            self._active.pop(bid)[3].succeed()
        self._in_use[:] = False
        if not self._active:
            return
        entries = list(self._active.values())
        # Weighted fair sharing: a link's bandwidth is split in proportion to the bytes each
        # transfer puts on it, so every transfer on a link drains at the same fraction per
        # second, and a batch finishes when its most loaded link has drained.
        res_all = np.concatenate([e[0].res for e in entries])
        w_all = np.concatenate([e[0].hop_weights for e in entries])
        load = np.bincount(res_all, weights=w_all, minlength=self.num_resources)
        self._in_use = load > 0
        pace = np.divide(
            self.capacity, load, out=np.full(self.num_resources, np.inf), where=load > 0
        )  # fraction of every transfer's bytes per second on each link
        next_dt = np.inf
        for e in entries:
            speed = min(float(np.min(pace[e[0].res])), e[0].max_speed)
            e[2] = speed
            next_dt = min(next_dt, e[1] / speed)
        self._version += 1
        version = self._version
        now = self.env.now
        if now + next_dt <= now:
            # The remaining work is below the float resolution of the clock: step by a few ulps
            # so that time always advances (the snap in _on_timer then completes the batch).
            next_dt = 4 * math.ulp(now)
        timer = self.env.timeout(max(next_dt, 0.0))
        timer.callbacks.append(lambda _ev: self._on_timer(version))

    def _on_timer(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later reschedule
        self._advance()
        # The batch that set the timer is done; snap to zero whatever is left only by rounding
        # (a tiny fraction, or work that would finish within a few ulps of the clock).
        tol_s = 1e-12 * max(self.env.now, 1e-9)
        for e in self._active.values():
            if e[1] <= 1e-9 or (e[2] > 0 and e[1] / e[2] <= tol_s):
                e[1] = 0.0
        self._reschedule()


# -- groups and routing ------------------------------------------------------------------
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
    return GroupAxis(
        name=label, size=size, wraps=topology.wraparound[idx] and whole and size > 1,
        index=idx, stride=stride, phys_size=n,
    )


def group_axes(topology: Topology, axes: tuple[str, ...]) -> tuple[GroupAxis, ...]:
    """Validate collective axes against the topology; ICI axes in x, y, z order, DCN last."""
    if not axes:
        raise TpusimError("a collective needs at least one axis, e.g. --axes x or --axes x,y")
    seen: list[GroupAxis] = []
    for a in axes:
        if a == DCN_AXIS:
            if topology.num_slices == 1:
                raise TpusimError(
                    "axis 'dcn' needs several slices; add --slices N (N >= 2) or drop dcn"
                )
            ga = axis_factor(topology, DCN_AXIS, topology.num_slices, 1)
        else:
            topology.axis_index(a)
            ga = axis_factor(topology, a, topology.axis_size(a), 1)
        if any(g.name == ga.name for g in seen):
            raise TpusimError(f"axis {a!r} is given twice in --axes; list each axis once")
        seen.append(ga)
    order = {n: i for i, n in enumerate(AXIS_NAMES + (DCN_AXIS,))}
    return tuple(sorted(seen, key=lambda g: (order[g.physical_name], g.stride)))


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


def route_latency_s(gaxes, offset, ici_hop_s: float, dcn_s: float) -> float:
    lat = 0.0
    for g, o in zip(gaxes, offset, strict=True):
        if o:
            lat += dcn_s if g.is_dcn else ici_hop_s * abs(o) * g.stride
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
