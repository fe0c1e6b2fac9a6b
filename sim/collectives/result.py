"""What one collective did: `CollectiveResult`, its per-link and per-step tables, and the
builder every mode (symmetric, full, per-chip, orbit) finishes with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.collectives.algorithms import Schedule
from topologies.groups import NUM_CLASSES
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology

LINK_COLUMNS = ["link", "src", "dst", "axis", "direction", "bytes", "busy_s", "utilization"]
TIMELINE_COLUMNS = [
    "group", "chip", "chips_represented", "stream", "step", "label", "start_s", "end_s",
    "bytes_per_chip",
]


@dataclass(kw_only=True)
class CollectiveResult:
    """What one collective did. Scalar fields are the CLI's JSON; tables are pandas on demand."""

    op: str
    algorithm: str
    algorithm_requested: str
    chip: str
    topology: str
    axes: tuple[str, ...]
    bytes: int
    num_chips: int
    group_size: int
    num_groups: int
    time_s: float
    bytes_on_busiest_link: float
    max_link_utilization: float
    hbm_bytes_per_chip: float
    mode: str
    num_steps: int
    sim_events: int
    latency_s: float = 0.0
    detour: dict[str, Any] | None = None
    auto_candidates: list[dict[str, Any]] | None = None
    pod: Topology = field(repr=False)
    link_bytes: np.ndarray = field(repr=False)
    link_busy_s: np.ndarray = field(repr=False)
    link_capacity: np.ndarray = field(repr=False)
    timeline_rows: list[tuple] = field(repr=False)
    touched_groups: tuple[int, ...] | None = field(default=None, repr=False)
    # For the Perfetto export: the schedule, and in full/per-chip mode the links each step of
    # each simulated group loaded: {(group, stream, step): (link ids, bytes on each, all
    # repetitions)}; None when too big to keep (see MAX_STEP_LINK_ENTRIES).
    schedule: Schedule | None = field(default=None, repr=False)
    step_links: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] | None = field(
        default=None, repr=False)
    # Orbit mode: for every replica group, the simulated group that stands for it, and the
    # translation periods (`orbit_periods`) that map the simulated links onto the whole pod's.
    group_rep: np.ndarray | None = field(default=None, repr=False)
    orbit_periods: tuple[int, ...] | None = field(default=None, repr=False)
    # With dead links: the bytes each link carries on the detours around them (link id ->
    # bytes, the rerouted transfers' replacement paths), for the per-link timeline plot.
    detour_links: dict[int, float] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "algorithm": self.algorithm,
            "algorithm_requested": self.algorithm_requested,
            "chip": self.chip,
            "topology": self.topology,
            "axes": list(self.axes),
            "bytes": self.bytes,
            "num_chips": self.num_chips,
            "group_size": self.group_size,
            "num_groups": self.num_groups,
            "time_s": self.time_s,
            "bytes_on_busiest_link": self.bytes_on_busiest_link,
            "max_link_utilization": self.max_link_utilization,
            "hbm_bytes_per_chip": self.hbm_bytes_per_chip,
            "mode": self.mode,
            "num_steps": self.num_steps,
            "sim_events": self.sim_events,
            "latency_s": self.latency_s,
            "bandwidth_s": self.bandwidth_s,
            "detour": None if self.detour is None else dict(self.detour),
            "auto_candidates": (None if self.auto_candidates is None
                                else [dict(c) for c in self.auto_candidates]),
        }

    @property
    def bandwidth_s(self) -> float:
        """The time beyond the latency term: bytes draining, contention included."""
        return max(self.time_s - self.latency_s, 0.0)

    @property
    def links(self):
        """Per-link table (every link that carried bytes): LINK_COLUMNS."""
        return link_table(self.pod, self.link_bytes, self.link_busy_s, self.link_capacity,
                          self.time_s)

    @property
    def timeline(self):
        """Per-step table for the simulated chips/groups: TIMELINE_COLUMNS."""
        import pandas as pd  # heavy: loaded only when a table is read

        return pd.DataFrame(self.timeline_rows, columns=TIMELINE_COLUMNS)


def _coord_strings(topology: Topology, chips: np.ndarray) -> list[str]:
    per = topology.chips_per_slice
    local = topology.all_coords()[chips % per]
    if topology.num_slices > 1:
        local = np.column_stack([local, chips // per])
    return ["(" + ", ".join(map(str, row)) + ")" for row in local.tolist()]


def link_table(topology: Topology, link_bytes, link_busy, link_cap, time_s: float):
    """Per-link DataFrame (LINK_COLUMNS) of the links that carried bytes."""
    import pandas as pd  # heavy: loaded only when a table is read

    used = np.flatnonzero(link_bytes > 0)
    n_ici = topology.num_ici_links
    ndim = topology.ndim
    _src, dst = topology.link_endpoints()
    ici = used[used < n_ici]
    dcn = used[used >= n_ici] - n_ici
    ici_src = ici // (2 * ndim)
    rest = ici % (2 * ndim)
    dcn_out = dcn < topology.num_chips
    dcn_chip = np.where(dcn_out, dcn, dcn - topology.num_chips)
    src_chips = np.concatenate([ici_src, dcn_chip])
    dst_chips = np.concatenate([dst[ici], dcn_chip])
    axis = np.concatenate([np.asarray(AXIS_NAMES)[rest // 2], np.full(len(dcn), DCN_AXIS)])
    direction = np.concatenate(
        [np.asarray(["+", "-"])[rest % 2], np.where(dcn_out, "out", "in")]
    )
    b = link_bytes[used]
    util = b / (link_cap[used] * time_s) if time_s > 0 else np.zeros(len(used))
    cols = {
        "link": used,
        "src": _coord_strings(topology, src_chips),
        "dst": _coord_strings(topology, dst_chips),
        "axis": axis,
        "direction": direction,
        "bytes": b,
        "busy_s": link_busy[used],
        "utilization": util,
    }
    if not topology.ocs:
        return pd.DataFrame(cols, columns=LINK_COLUMNS)
    # A pod of cubes joined by optical switches: which links stay inside a cube and which go
    # through a switch (DCN links are neither).
    cols["via"] = np.concatenate([topology.link_via()[ici], np.full(len(dcn), "dcn")])
    return pd.DataFrame(cols, columns=[*LINK_COLUMNS, "via"])



MAX_STEP_LINK_ENTRIES = 2_000_000  # (step, link) pairs kept for the trace's link tracks


def step_link_loads(batches_of, num_links: int):
    """{(group, stream, step): (link ids, bytes)} of every simulated group's routed steps, or
    None if that would hold more than MAX_STEP_LINK_ENTRIES entries."""
    if sum(len(b.res) for streams in batches_of.values() for s_ in streams
           for b in s_) > 4 * MAX_STEP_LINK_ENTRIES:
        return None
    out = {}
    total = 0
    for g, streams in batches_of.items():
        for si, s_ in enumerate(streams):
            for k, b in enumerate(s_):
                if b.num_transfers == 0:
                    out[(g, si, k)] = (np.zeros(0, dtype=np.int64), np.zeros(0))
                    continue
                links, inv = np.unique(b.res, return_inverse=True)
                nbytes = np.bincount(inv, weights=b.hop_weights, minlength=len(links))
                out[(g, si, k)] = (links, nbytes)
                total += len(links)
                if total > MAX_STEP_LINK_ENTRIES:
                    return None
    return out



def expand_classes(topology: Topology, gaxes, cls_bytes, cls_busy):
    """Symmetric mode: every link of a used class carries that class's bytes."""
    n = topology.num_links
    lb = np.zeros(n)
    busy = np.zeros(n)
    mask = topology.link_mask()
    names = {g.physical_name for g in gaxes}
    ndim = topology.ndim
    n_ici = topology.num_ici_links
    ids = np.arange(n_ici)
    cls = ids % (2 * ndim)
    for c in range(2 * ndim):
        if AXIS_NAMES[c // 2] not in names:
            continue
        sel = (cls == c) & mask
        lb[:n_ici][sel] = cls_bytes[c]
        busy[:n_ici][sel] = cls_busy[c]
    if topology.num_slices > 1 and DCN_AXIS in names:
        nc = topology.num_chips
        lb[n_ici : n_ici + nc] = cls_bytes[NUM_CLASSES - 2]
        lb[n_ici + nc :] = cls_bytes[NUM_CLASSES - 1]
        busy[n_ici : n_ici + nc] = cls_busy[NUM_CLASSES - 2]
        busy[n_ici + nc :] = cls_busy[NUM_CLASSES - 1]
    return lb, busy



def collective_result(*, kind, algorithm, requested, chip, topology, axes, nbytes, group_size,
                      num_groups, time_s, net, link_bytes, link_busy, lm, hbm, mode, steps,
                      timeline, router=None, touched=None, latency_s=0.0, schedule=None,
                      step_links=None, group_rep=None, orbit_periods=None):
    """The `CollectiveResult` of a finished simulation: the busiest link, the utilization and
    the dead links' detour cost from the network's counters."""
    cap = lm.capacity_bytes_per_s
    busiest = float(link_bytes.max(initial=0.0))
    per_cap = np.divide(link_bytes, cap, out=np.zeros_like(link_bytes), where=cap > 0)
    util = float(np.max(per_cap, initial=0.0) / time_s) if time_s > 0 else 0.0
    detour = None
    if router is not None:
        detour = {
            "dead_links": [topology.describe_link(d) for d in router.dead_links],
            "rerouted_transfers": int(router.rerouted_transfers),
            "extra_hops": int(router.extra_hops),
            "extra_link_bytes": float(router.extra_link_bytes),
            "longest_detour_hops": int(router.max_route_hops),
        }
    return CollectiveResult(
        op=str(kind), algorithm=algorithm, algorithm_requested=requested, chip=chip.name,
        topology=topology.name, axes=axes, bytes=int(nbytes), num_chips=topology.num_chips,
        group_size=group_size, num_groups=num_groups, time_s=float(time_s),
        bytes_on_busiest_link=busiest, max_link_utilization=util, hbm_bytes_per_chip=float(hbm),
        mode=mode, num_steps=steps, sim_events=net.num_events, latency_s=float(latency_s),
        detour=detour, pod=topology,
        link_bytes=link_bytes, link_busy_s=link_busy, link_capacity=cap,
        timeline_rows=sorted(timeline, key=lambda r: (r[0], r[3], r[4], r[6])),
        touched_groups=touched, schedule=schedule, step_links=step_links,
        group_rep=group_rep, orbit_periods=orbit_periods,
        detour_links=None if router is None else dict(router.detour_link_bytes),
    )
