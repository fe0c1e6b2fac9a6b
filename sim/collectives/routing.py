"""Turning collective schedules into network batches, in symmetric or full-detail mode.

Symmetric mode routes one representative chip's moves onto link classes; full-detail mode routes
every chip of the chosen replica groups onto individual link ids. Both produce `network.Batch`es
for the same fluid engine, so their results agree exactly wherever both apply.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from sim.collectives.algorithms import Schedule, Step
from sim.engine.network import Batch
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import (
    DCN_IN_CLASS,
    DCN_OUT_CLASS,
    NUM_CLASSES,
    DetourRouter,
    GroupAxis,
    route_class_hops,
    route_latency_s,
    route_links,
    shortest_vectors,
    slice_axes,
)
from topologies.torus import AXIS_NAMES, Topology

# Full detail routes one transfer per chip per move; beyond this many we refuse rather than
# exhaust memory (only `direct` on a huge group without symmetry can get there).
MAX_FULL_TRANSFERS = 20_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """Per-resource bandwidth for one topology, with optional degraded links."""

    capacity_bytes_per_s: np.ndarray  # full detail: per link id
    class_capacity_bytes_per_s: np.ndarray  # symmetric: per link class
    ici_latency_s: float
    dcn_latency_s: float
    dcn_message_s: float = 0.0  # per DCN message a chip sends in one step, serialized
    ocs_latency_s: float = 0.0  # added per hop through an optical switch (0: no switches)


def _dcn_moves(gaxes, moves) -> int:
    """Moves of one step that cross DCN (each a message the chip's DCN endpoint handles)."""
    return sum(1 for m in moves if m.bytes > 0
               and any(o and g.is_dcn for g, o in zip(gaxes, m.offset, strict=True)))


# The chip fields a collective's simulation reads (`link_model` below and `auto`'s lower bounds
# in sim/collectives/auto.py): chips that agree on these give every collective the same cost, so
# the engine's cost cache keys on them, not on the whole chip (a study varying HBM or MXU
# numbers reuses its collectives' costs). tests/test_collectives.py checks that no other field
# changes a cost.
LINK_FIELDS = ("ici_link_bytes_per_s", "ici_efficiency", "ici_hop_latency_s", "dcn_bytes_per_s",
               "dcn_efficiency", "dcn_latency_s", "dcn_message_overhead_s",
               "ocs_hop_latency_s")


def link_numbers(chip: ChipSpec) -> tuple[float, ...]:
    """The chip's `LINK_FIELDS`, in that order."""
    return tuple(getattr(chip, f) for f in LINK_FIELDS)


def link_model(chip: ChipSpec, topology: Topology, slow_links: dict[int, float]) -> LinkModel:
    ici = chip.eff_ici_link_bytes_per_s
    dcn = chip.eff_dcn_bytes_per_s
    cap = np.full(topology.num_links, ici)
    cap[topology.num_ici_links :] = dcn
    for link, factor in slow_links.items():
        cap[link] *= factor
    cls = np.full(NUM_CLASSES, ici)
    cls[DCN_OUT_CLASS] = cls[DCN_IN_CLASS] = dcn
    return LinkModel(
        capacity_bytes_per_s=cap,
        class_capacity_bytes_per_s=cls,
        ici_latency_s=chip.ici_hop_latency_s,
        dcn_latency_s=chip.dcn_latency_s,
        dcn_message_s=chip.dcn_message_overhead_s,
        ocs_latency_s=chip.ocs_hop_latency_s if topology.ocs else 0.0,
    )


def symmetric_batch(step: Step, gaxes: tuple[GroupAxis, ...], lm: LinkModel) -> Batch:
    """One representative chip's moves, routed on link classes."""
    res: list[int] = []
    ptr = [0]
    nbytes = []
    lat = 0.0
    for m in step.moves:
        hops = route_class_hops(gaxes, m.offset)
        if not hops or m.bytes <= 0:
            continue
        res += hops
        ptr.append(len(res))
        nbytes.append(m.bytes)
        lat = max(lat, route_latency_s(gaxes, m.offset, lm.ici_latency_s, lm.dcn_latency_s,
                                       lm.ocs_latency_s))
    lat += _dcn_moves(gaxes, step.moves) * lm.dcn_message_s
    return Batch(
        res=np.asarray(res, dtype=np.int64),
        ptr=np.asarray(ptr, dtype=np.int64),
        bytes_per_transfer=np.asarray(nbytes, dtype=float),
        latency_s=lat * step.repeat,
        repeat=step.repeat,
    )


def _valid_sources(m, gaxes, local: np.ndarray) -> np.ndarray:
    ok = np.ones(len(local), dtype=bool)
    if m.src_lo is not None:
        ok &= np.all(local >= np.asarray(m.src_lo), axis=1)
        ok &= np.all(local <= np.asarray(m.src_hi), axis=1)
    if m.src_bit is not None:
        axis, bit, value = m.src_bit
        ok &= ((local[:, axis] >> bit) & 1) == value
    for i, (g, o) in enumerate(zip(gaxes, m.offset, strict=True)):
        if o and not g.wraps:
            d = local[:, i] + o
            ok &= (d >= 0) & (d < g.size)
    return ok


def full_batch(
    step: Step,
    gaxes: tuple[GroupAxis, ...],
    topology: Topology,
    chips: np.ndarray,
    local: np.ndarray,
    lm: LinkModel,
    detour: DetourRouter | None = None,
) -> Batch:
    """Every chip of one replica group (`chips`, local coords `local`), on individual links.

    `chips`/`local` may hold several groups back to back (per-chip mode routes them all in one
    batch). With a `detour` router, routes that cross a dead link take its detour instead, and
    the batch's latency covers the longest detour."""
    res_parts, counts, nbytes, srcs, dsts = [], [], [], [], []
    lat = 0.0
    for m in step.moves:
        if m.bytes <= 0 or not any(m.offset):
            continue
        ok = _valid_sources(m, gaxes, local)
        src = chips[ok]
        if len(src) == 0:
            continue
        r, p, dst = route_links(topology, gaxes, src, m.offset)
        h = int(p[1] - p[0]) if len(p) > 1 else 0
        srcs.append(src)
        dsts.append(dst)
        res_parts.append(r)
        counts.append(np.full(len(src), h, dtype=np.int64))
        nbytes.append(np.full(len(src), m.bytes))
        lat = max(lat, route_latency_s(gaxes, m.offset, lm.ici_latency_s, lm.dcn_latency_s,
                                       lm.ocs_latency_s))
    lat += _dcn_moves(gaxes, step.moves) * lm.dcn_message_s
    if not res_parts:
        z = np.zeros(0, dtype=np.int64)
        return Batch(res=z, ptr=np.zeros(1, dtype=np.int64), bytes_per_transfer=np.zeros(0),
                     latency_s=0.0, repeat=step.repeat)
    c = np.concatenate(counts)
    res = np.concatenate(res_parts)
    ptr = np.concatenate([[0], np.cumsum(c)]).astype(np.int64)
    per_transfer = np.concatenate(nbytes)
    if detour is not None and detour.dead_links:
        res, ptr, moved = detour.reroute(res, ptr, per_transfer, step.repeat)
        if len(moved):
            lat = max(lat, max_route_latency_s(topology, res, ptr, moved, lm))
    return Batch(
        res=res,
        ptr=ptr,
        bytes_per_transfer=per_transfer,
        latency_s=lat * step.repeat,
        repeat=step.repeat,
        src=np.concatenate(srcs),
        dst=np.concatenate(dsts),
    )


def max_route_latency_s(topology: Topology, res, ptr, transfers, lm: LinkModel) -> float:
    """Longest latency among the given transfers' routes: ICI hops x per-hop latency, plus the
    DCN latency once per DCN crossing (an egress and an ingress id)."""
    n_ici = topology.num_ici_links
    ocs = topology.ocs_link_mask() if lm.ocs_latency_s else None
    worst = 0.0
    for t in np.asarray(transfers).tolist():
        r = res[ptr[t] : ptr[t + 1]]
        ici = int(np.count_nonzero(r < n_ici))
        dcn = (len(r) - ici) // 2
        lat = ici * lm.ici_latency_s + dcn * lm.dcn_latency_s
        if ocs is not None:  # the switched hops this route takes, counted exactly
            lat += int(np.count_nonzero(ocs[r[r < n_ici]])) * lm.ocs_latency_s
        worst = max(worst, lat)
    return worst


def check_full_size(schedule: Schedule, group_size: int, num_groups: int) -> None:
    moves = max((len(st.moves) for s in schedule.streams for st in s), default=0)
    if moves * group_size * num_groups > MAX_FULL_TRANSFERS:
        raise TpusimError(
            f"full-detail simulation of {schedule.algorithm} would route "
            f"{moves * group_size * num_groups:,} transfers in one step (limit "
            f"{MAX_FULL_TRANSFERS:,}); use a symmetric setup (no {{slow_link}}, wraparound on "
            f"the collective's axes) or a ring-based algorithm", "slow_link")


def send_batch(
    topology: Topology,
    lm: LinkModel,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    nbytes: float,
    detour: DetourRouter | None = None,
) -> tuple[Batch, int, int]:
    """Point-to-point: split evenly over the distinct minimal paths (all dimension orders and,
    on a ring, both directions when the destination is exactly half way round). Paths through a
    dead link are dropped; if none is left, the message takes the `detour` router's path.

    Returns (batch, number of paths, hops)."""
    s_chip = topology.chip_id(src)
    d_chip = topology.chip_id(dst)
    if s_chip == d_chip:
        raise TpusimError(f"{{src}} {src} and {{dst}} {dst} are the same chip; pick two chips",
                          "src", "dst")
    if topology.twisted:
        return _twisted_send_batch(topology, lm, s_chip, d_chip, nbytes, detour)
    gaxes_all = [
        GroupAxis(name=a, size=topology.shape[i], wraps=topology.wraparound[i], index=i,
                  phys_size=topology.shape[i])
        for i, a in enumerate(AXIS_NAMES[: topology.ndim])
    ]
    choices: list[list[int]] = []
    for i, g in enumerate(gaxes_all):
        d = dst[i] - src[i]
        if d == 0:
            choices.append([0])
        elif not g.wraps:
            choices.append([d])
        else:
            t = d % g.size
            if 2 * t < g.size:
                choices.append([t])
            elif 2 * t > g.size:
                choices.append([t - g.size])
            else:
                choices.append([t, -t])
    if topology.num_slices > 1:
        s_sl = src[topology.ndim] if len(src) > topology.ndim else 0
        d_sl = dst[topology.ndim] if len(dst) > topology.ndim else 0
        gaxes_all.append(GroupAxis(name="dcn", size=topology.num_slices, wraps=True, index=-1))
        choices.append([d_sl - s_sl])
    paths: dict[tuple[int, ...], float] = {}
    lat = 0.0
    for offs in itertools.product(*choices):
        used = [i for i, o in enumerate(offs) if o != 0]
        ici_used = [i for i in used if not gaxes_all[i].is_dcn]
        dcn_used = [i for i in used if gaxes_all[i].is_dcn]
        for perm in itertools.permutations(ici_used):
            order = list(perm) + dcn_used
            ga = tuple(gaxes_all[i] for i in order)
            off = tuple(offs[i] for i in order)
            r, _p, _ = route_links(topology, ga, np.array([s_chip]), off)
            paths.setdefault(tuple(int(x) for x in r), 0.0)
            lat = max(lat, route_latency_s(ga, off, lm.ici_latency_s, lm.dcn_latency_s,
                                           lm.ocs_latency_s))
    batch = _split_over_paths(topology, lm, sorted(paths), lat, nbytes, detour)
    ici_hops = sum(
        abs(offs) for offs, g in zip([c[0] for c in choices], gaxes_all, strict=True)
        if not g.is_dcn
    )
    return batch, batch.num_transfers, ici_hops


def _split_over_paths(topology: Topology, lm: LinkModel, keys: list[tuple[int, ...]], lat: float,
                      nbytes: float, detour: DetourRouter | None) -> Batch:
    """A message split evenly over the paths `keys` (link ids each, sorted), whose longest
    latency is `lat`. Paths through a dead link are dropped; if none is left, the message takes
    the `detour` router's path around the first, with that route's latency."""
    if detour is not None and detour.dead_links:
        alive = [k for k in keys if not any(detour.dead_mask[h] for h in k)]
        if not alive:
            r0 = np.asarray(keys[0], dtype=np.int64)
            p0 = np.array([0, len(r0)], dtype=np.int64)
            r1, p1, _ = detour.reroute(r0, p0, np.array([float(nbytes)]), 1)
            alive = [tuple(int(x) for x in r1)]
            lat = max_route_latency_s(topology, r1, p1, [0], lm)
        keys = alive
    res = np.concatenate([np.asarray(k, dtype=np.int64) for k in keys])
    ptr = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)
    return Batch(res=res, ptr=ptr, bytes_per_transfer=np.full(len(keys), nbytes / len(keys)),
                 latency_s=lat)


def _twisted_send_batch(topology: Topology, lm: LinkModel, s_chip: int, d_chip: int,
                        nbytes: float, detour: DetourRouter | None) -> tuple[Batch, int, int]:
    """`send_batch` on a twisted torus: the message is split evenly over the distinct paths of
    its shortest hop vectors (`shortest_vectors`, through the twist), each in every order of
    its axes; across slices the DCN hop comes last."""
    ici = slice_axes(topology)
    per = topology.chips_per_slice
    local_dst = s_chip // per * per + d_chip % per
    vecs = shortest_vectors(topology, s_chip, local_dst)
    dcn = None
    if d_chip // per != s_chip // per:
        dcn = GroupAxis(name="dcn", size=topology.num_slices, wraps=True, index=-1)
    paths: dict[tuple[int, ...], None] = {}
    lat = 0.0
    for vec in vecs:
        used = [i for i, o in enumerate(vec) if o]
        for perm in itertools.permutations(used):
            ga = [ici[i] for i in perm]
            off = [vec[i] for i in perm]
            if dcn is not None:
                ga.append(dcn)
                off.append(d_chip // per - s_chip // per)
            r, _p, _ = route_links(topology, tuple(ga), np.array([s_chip]), tuple(off))
            paths.setdefault(tuple(int(x) for x in r), None)
            lat = max(lat, route_latency_s(tuple(ga), tuple(off), lm.ici_latency_s,
                                           lm.dcn_latency_s, lm.ocs_latency_s))
    batch = _split_over_paths(topology, lm, sorted(paths), lat, nbytes, detour)
    return batch, batch.num_transfers, sum(abs(o) for o in vecs[0])
