"""Full detail: whole replica groups routed link by link (a representative group plus every
group a degraded or dead link touches, or every group), split by group, and the untouched
groups' links filled in from the representative's."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sim.collectives.algorithms import Schedule
from sim.collectives.routing import full_batch, max_route_latency_s
from sim.collectives.streams import is_reduce_scatter
from topologies.groups import DetourRouter, GroupGeometry
from topologies.torus import Topology


def group_batches(topology, geo, schedule, gaxes, groups, lm, router):
    """{group: its streams of batches}: every step routed for all `groups` in one numpy batch
    (detours included), then split by the group of each transfer's source chip. A group's
    step waits the latency of its own longest route (a detour only delays its own group)."""
    chips = np.concatenate([geo.group_chips(g) for g in groups])
    local = np.tile(geo.local_coords(), (len(groups), 1))
    out: dict[int, list] = {g: [[] for _ in schedule.streams] for g in groups}
    for si, stream in enumerate(schedule.streams):
        for st in stream:
            b = full_batch(st, gaxes, topology, chips, local, lm)
            lat_of = {}
            if router is not None and router.dead_links and b.num_transfers:
                res, ptr, moved = router.reroute(b.res, b.ptr, b.bytes_per_transfer, st.repeat)
                b = dataclasses.replace(b, res=res, ptr=ptr)
                for t in moved.tolist():
                    g = int(geo.group_of_chip[b.src[t]])
                    lat = max_route_latency_s(topology, res, ptr, [t], lm) * st.repeat
                    lat_of[g] = max(lat_of.get(g, 0.0), lat)
            for g, part in split_by_group(b, geo, groups).items():
                if lat_of.get(g, 0.0) > part.latency_s:
                    part = dataclasses.replace(part, latency_s=lat_of[g])
                out[g][si].append(part)
    return out


def split_by_group(b, geo, groups) -> dict[int, Any]:
    if len(groups) == 1:
        return {groups[0]: b}
    if b.num_transfers == 0:
        return {g: b for g in groups}  # a step with nothing to send still waits its latency
    owner = geo.group_of_chip[b.src]
    order = np.argsort(owner, kind="stable")
    counts = np.diff(b.ptr)
    sorted_owner = owner[order]
    starts = np.searchsorted(sorted_owner, groups, side="left")
    ends = np.searchsorted(sorted_owner, groups, side="right")
    # Hop entries in group order: every transfer's hops, transfers sorted by group.
    c_sorted = counts[order]
    new_ptr = np.concatenate([[0], np.cumsum(c_sorted)]).astype(np.int64)
    hop_src = np.repeat(b.ptr[:-1][order] - new_ptr[:-1], c_sorted) + np.arange(new_ptr[-1])
    res_sorted = b.res[hop_src]
    out = {}
    for g, lo, hi in zip(groups, starts.tolist(), ends.tolist(), strict=True):
        idx = order[lo:hi]
        out[g] = dataclasses.replace(
            b, res=res_sorted[new_ptr[lo]:new_ptr[hi]],
            ptr=new_ptr[lo:hi + 1] - new_ptr[lo],
            bytes_per_transfer=b.bytes_per_transfer[idx], src=b.src[idx], dst=b.dst[idx],
        )
    return out


def detour_groups(topology, geo, schedule, gaxes, groups, lm, dead) -> set[int]:
    """Groups owning a link that `groups`' routes use once they detour around `dead`."""
    batches = group_batches(topology, geo, schedule, gaxes, groups, lm,
                             DetourRouter(topology, dead))
    n_ici = topology.num_ici_links
    per = 2 * topology.ndim
    out: set[int] = set()
    for g in groups:
        for stream in batches[g]:
            for b in stream:
                r = b.res[b.res < n_ici]
                out |= set(np.unique(geo.group_of_chip[r // per]).tolist())
    return out



def full_hbm_bytes(all_batches, schedule: Schedule, num_chips: int) -> float:
    """The busiest chip's DMA bytes from the routed transfers (ends of a line do less)."""
    traffic = np.zeros(num_chips)
    for batches in all_batches:
        for si, stream in enumerate(batches):
            for b, st in zip(stream, schedule.streams[si], strict=True):
                if b.src is None or b.num_transfers == 0:
                    continue
                w = b.bytes_per_transfer * b.repeat
                traffic += np.bincount(b.src, weights=w, minlength=num_chips)
                recv = np.bincount(b.dst, weights=w, minlength=num_chips)
                traffic += recv * (2.0 if is_reduce_scatter(st) else 1.0)
    return float(traffic.max(initial=0.0))



def replicate_group(topology: Topology, geo: GroupGeometry, groups, rep: int, net):
    """Full mode: groups that were not simulated behave exactly like the untouched `rep`."""
    lb = net.bytes.copy()
    busy = net.busy_s.copy()
    simulated = set(groups)
    if geo.num_groups == len(simulated):
        return lb, busy
    ndim = topology.ndim
    n_ici = topology.num_ici_links
    g0 = geo.group_chips(rep)
    per = 2 * ndim
    # ICI links: link id = chip * per + class; translate the pattern of `rep` by local index.
    g0_ici = np.stack([lb[g0 * per + c] for c in range(per)], axis=1)
    g0_busy = np.stack([busy[g0 * per + c] for c in range(per)], axis=1)
    others = ~np.isin(geo.group_of_chip, list(simulated))
    chips = np.flatnonzero(others)
    loc = geo.local_of_chip[chips]
    for c in range(per):
        lb[chips * per + c] = g0_ici[loc, c]
        busy[chips * per + c] = g0_busy[loc, c]
    if topology.num_slices > 1:
        nc = topology.num_chips
        lb[n_ici + chips] = lb[n_ici + g0[loc]]
        lb[n_ici + nc + chips] = lb[n_ici + nc + g0[loc]]
        busy[n_ici + chips] = busy[n_ici + g0[loc]]
        busy[n_ici + nc + chips] = busy[n_ici + nc + g0[loc]]
    return lb, busy
