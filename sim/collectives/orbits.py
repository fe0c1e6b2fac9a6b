"""Orbit mode: interleaved (strided) groups on a healthy pod simulated on the representatives
of the pod's translation symmetry, link ids folded onto their orbits (`orbit_periods`); exact
against simulating every group (`mode="full"`, the oracle)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import simpy

from sim.collectives.algorithms import Schedule
from sim.collectives.full_detail import full_hbm_bytes, split_by_group
from sim.collectives.result import CollectiveResult, collective_result, step_link_loads
from sim.collectives.routing import check_full_size, full_batch
from sim.collectives.streams import latency_path_s, launch_streams
from sim.engine.network import FluidNetwork
from topologies.groups import GroupAxis
from topologies.torus import Topology


def orbit_periods(topology: Topology, gaxes: tuple[GroupAxis, ...],
                  schedule: Schedule) -> tuple[int, ...] | None:
    """Per physical dimension (x, y, z, then the slice index with several slices), the period
    of the translations that leave the whole collective unchanged, or None if there are none.

    Along a dimension the group does not span, every translation only permutes groups (routes
    never move along it): period 1. Where its factors span a block of `B` < `L` chips (every
    factor is a segment or a strided piece inside the block), routes stay inside their block
    and shifting by whole blocks permutes groups: period `B`. Where the outermost factor spans
    the whole wrapped axis as a ring with stride `s`, and no move of the schedule depends on
    that factor's coordinate (no source range or bit on it), shifting by `s` moves every chip
    to the next chip of its own ring, doing the same moves: period `s`. Otherwise `L` (no
    symmetry). A translation by the periods maps every transfer to a transfer and every link
    to a link of the same bandwidth (no slow or dead link may be on the group's axes), and
    acts freely on chips and links, so each link carries what its orbit's representatives
    carry and every group finishes with its orbit's representative (see `simulate_orbits`).
    """
    ndim = topology.ndim
    dims = list(topology.shape) + ([topology.num_slices] if topology.num_slices > 1 else [])
    periods = []
    for c, n in enumerate(dims):
        fs = [(i, g) for i, g in enumerate(gaxes) if (ndim if g.is_dcn else g.index) == c]
        if not fs:
            periods.append(1)
            continue
        i, outer = max(fs, key=lambda f: f[1].stride * f[1].size)
        span = outer.stride * outer.size
        if span < n:
            periods.append(span)
        elif (outer.wraps and outer.size > 1
              and all(outer.stride % (g.stride * g.size) == 0 for j, g in fs if j != i)
              and _moves_ignore_axis(schedule, i, outer.size)):
            periods.append(outer.stride)
        else:
            periods.append(n)
    if math.prod(periods) >= topology.num_chips:
        return None
    if topology.twisted:
        # A shift along a short axis that crosses its twisted wraparound also moves the chip
        # k along the long axes: a symmetry only if that move is one too.
        for a in range(ndim):
            for j, shift in topology.twist_of(a):
                if periods[a] < dims[a] and shift % periods[j]:
                    return None
    return tuple(periods)


def _moves_ignore_axis(schedule: Schedule, i: int, size: int) -> bool:
    """No move of the schedule restricts its sources by their coordinate on group axis i."""
    for stream in schedule.streams:
        for st in stream:
            for m in st.moves:
                if m.src_bit is not None and m.src_bit[0] == i:
                    return False
                if m.src_lo is not None and (m.src_lo[i] > 0 or m.src_hi[i] < size - 1):
                    return False
    return True


def canonical_chips(topology: Topology, periods: tuple[int, ...]) -> np.ndarray:
    """Every chip's representative under translations by `periods`: its coordinates modulo
    the periods (slice index last)."""
    ndim = topology.ndim
    coords = topology.all_coords() % np.asarray(periods[:ndim])
    local = np.ravel_multi_index(tuple(coords.T), topology.shape)
    if topology.num_slices == 1:
        return local.astype(np.int64)
    slices = np.arange(topology.num_slices) % periods[ndim]
    return np.add.outer(slices * topology.chips_per_slice, local).reshape(-1).astype(np.int64)


def canonical_links(topology: Topology, canon_chip: np.ndarray) -> np.ndarray:
    """Every link id's representative: the same link class out of the source chip's
    representative (ICI), the representative chip's DCN egress/ingress (DCN)."""
    per = 2 * topology.ndim
    parts = [(canon_chip[:, None] * per + np.arange(per)).reshape(-1)]
    if topology.num_slices > 1:
        n_ici = topology.num_ici_links
        parts += [n_ici + canon_chip, n_ici + topology.num_chips + canon_chip]
    return np.concatenate(parts).astype(np.int64)


def simulate_orbits(*, kind, requested, chip, topology, geo, schedule, lm, periods, nbytes,
                     chunks, steps_total) -> CollectiveResult:
    """Full detail on the representatives of the pod's translation symmetry (`orbit_periods`).

    The representative chips are those whose coordinates lie below the periods; their
    transfers are routed link by link, grouped by replica group, and every link id is replaced
    by its representative, so each representative link carries the bytes of every transfer in
    its orbit, exactly what each of its links carries in the whole pod. Each group holding
    representative chips stands for its orbit of groups. Exact against mode `full` (the
    whole pod), at a fraction of its transfers: e.g. `data=2` strided over x of a 16x20x28 pod
    routes 4 chips' transfers instead of 8960."""
    gaxes = geo.gaxes
    env = simpy.Environment()
    timeline: list[tuple] = []
    n = topology.num_chips
    canon_chip = canonical_chips(topology, periods)
    reps_chips = np.flatnonzero(canon_chip == np.arange(n))
    check_full_size(schedule, len(reps_chips), 1)
    owner = geo.group_of_chip[reps_chips]
    chips = reps_chips[np.lexsort((geo.local_of_chip[reps_chips], owner))]
    groups = np.unique(owner).tolist()
    local = np.stack(np.unravel_index(geo.local_of_chip[chips], geo.sizes), axis=1)
    canon_link = canonical_links(topology, canon_chip)
    routed: dict[int, list] = {g: [[] for _ in schedule.streams] for g in groups}
    folded: dict[int, list] = {g: [[] for _ in schedule.streams] for g in groups}
    for si, stream in enumerate(schedule.streams):
        for st in stream:
            b = full_batch(st, gaxes, topology, chips, local, lm)
            for g, part in split_by_group(b, geo, groups).items():
                routed[g][si].append(part)
                if part.num_transfers:
                    part = dataclasses.replace(part, res=canon_link[part.res],
                                               dst=canon_chip[part.dst])
                folded[g][si].append(part)
    represented = geo.group_size * geo.num_groups // len(groups)
    owner_sorted = geo.group_of_chip[chips]
    first = {g: int(chips[np.searchsorted(owner_sorted, g)]) for g in groups}
    net = FluidNetwork(env, lm.capacity_bytes_per_s, coalesce=True)
    for g in groups:
        launch_streams(env, net, folded[g], schedule, g, first[g], represented, timeline, chunks)
    env.run()
    group_rep = np.zeros(geo.num_groups, dtype=np.int64)
    group_rep[geo.group_of_chip] = geo.group_of_chip[canon_chip]
    return collective_result(
        kind=kind, algorithm=schedule.algorithm, requested=requested, chip=chip,
        topology=topology, axes=tuple(g.name for g in gaxes), nbytes=nbytes,
        group_size=geo.group_size, num_groups=geo.num_groups, time_s=env.now, net=net,
        link_bytes=net.bytes[canon_link], link_busy=net.busy_s[canon_link], lm=lm,
        hbm=full_hbm_bytes(list(folded.values()), schedule, n), mode="orbit",
        steps=steps_total, timeline=timeline, touched=tuple(groups),
        latency_s=max(latency_path_s(schedule, lats, chunks) for lats in {
            tuple(tuple(b.latency_s for b in s_) for s_ in folded[g]) for g in groups}),
        schedule=schedule, step_links=step_link_loads(routed, topology.num_links),
        group_rep=group_rep, orbit_periods=tuple(int(p) for p in periods),
    )
