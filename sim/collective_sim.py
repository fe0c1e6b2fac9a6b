"""Simulating one collective on a pod: `simulate_collective` and its `CollectiveResult`.

The collective's schedule is routed before `env.run()`; SimPy then replays its streams of steps
against the fluid link network. One representative chip stands for all when the setup is
translation-symmetric (every collective axis wraps, no degraded link); otherwise whole replica
groups are simulated link by link (a representative group, plus every group that contains a
degraded link). Interleaved (strided) groups on a healthy pod are simulated on the representatives
of the pod's translation symmetry, link ids folded onto their orbits (`orbit_periods`, mode
`orbit`); `--mode full` simulates every group (the oracle).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from sim.collectives import (
    CollectiveKind,
    Schedule,
    build_schedule,
    parse_kind,
    step_bytes_per_chip,
)
from sim.hardware import ChipSpec
from sim.network import FluidNetwork
from sim.routing import (
    check_full_size,
    full_batch,
    link_model,
    max_route_latency_s,
    send_batch,
    symmetric_batch,
)
from topologies.errors import TpusimError
from topologies.groups import (
    CLASS_NAMES,
    NUM_CLASSES,
    DetourRouter,
    GroupAxis,
    GroupGeometry,
    group_axes,
    with_twist,
)
from topologies.scenario import Scenario, parse_slow_link
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
        import pandas as pd

        return pd.DataFrame(self.timeline_rows, columns=TIMELINE_COLUMNS)


def _coord_strings(topology: Topology, chips: np.ndarray) -> list[str]:
    per = topology.chips_per_slice
    local = topology.all_coords()[chips % per]
    if topology.num_slices > 1:
        local = np.column_stack([local, chips // per])
    return ["(" + ", ".join(map(str, row)) + ")" for row in local.tolist()]


def link_table(topology: Topology, link_bytes, link_busy, link_cap, time_s: float):
    """Per-link DataFrame (LINK_COLUMNS) of the links that carried bytes."""
    import pandas as pd

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


MODES = ("auto", "symmetric", "full", "per-chip")


def check_links_only(scenario: Scenario) -> None:
    """Refuse the perturbations a collective cannot take: it runs on links, not chips."""
    if scenario.perturbs_chips or scenario.expert_skew or scenario.capacity_factor:
        raise TpusimError(
            "a collective is simulated on links only: --slow-chip, --chip-variation, "
            "--expert-skew and --capacity-factor do not apply to it; use them with train, "
            "decode, prefill or replay"
        )


def _slow_links(
    topology: Topology, slow_links: tuple[str, ...] | dict[int, float], scenario: Scenario | None
) -> dict[int, float]:
    """{link id: bandwidth factor} of the `slow_links` argument plus the scenario's."""
    if isinstance(slow_links, dict):
        slow = dict(slow_links)
    else:
        extra = Scenario(slow_links=tuple(parse_slow_link(s) for s in slow_links))
        slow = extra.slow_link_factors_for(topology)
    if scenario is not None:
        check_links_only(scenario)
        for link, f in scenario.slow_link_factors_for(topology).items():
            slow[link] = slow.get(link, 1.0) * f
    return slow


def check_bytes(nbytes: Any, kind: CollectiveKind, group_size: int) -> int:
    """`nbytes` as a whole number of bytes > 0 that splits evenly over `group_size` chips
    (send and permute move it whole)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        if isinstance(nbytes, float) and nbytes.is_integer():
            nbytes = int(nbytes)
        else:
            raise TpusimError(f"--bytes {nbytes!r} must be a whole number of bytes")
    if nbytes <= 0:
        raise TpusimError(f"--bytes {nbytes} must be > 0 (V is the size of the whole array)")
    if kind in (CollectiveKind.SEND, CollectiveKind.PERMUTE):
        return int(nbytes)
    if nbytes % group_size:
        raise TpusimError(
            f"--bytes {nbytes} is not divisible by the group size {group_size}: each chip holds "
            f"V/{group_size}; use a multiple of {group_size} (e.g. "
            f"{math.ceil(nbytes / group_size) * group_size})"
        )
    return int(nbytes)


def simulate_collective(
    *,
    chip: ChipSpec,
    topology: Topology,
    op: str | CollectiveKind,
    axes: tuple[str, ...] | str = (),
    nbytes: int,
    algorithm: str = "auto",
    shift: int = 1,
    src: tuple[int, ...] | None = None,
    dst: tuple[int, ...] | None = None,
    slow_links: tuple[str, ...] | dict[int, float] = (),
    mode: str = "auto",
    chunks: int = 1,
    scenario: Scenario | None = None,
    dead_links: tuple[int, ...] = (),
) -> CollectiveResult:
    """Simulate one collective on `topology` made of `chip`s.

    With dead links in the `scenario`, routes that need one take the shortest live detour, and
    the result's `detour` reports its cost against the same collective on the healthy pod.

    Args:
        op: all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute or send.
        axes: the physical axes of the replica group (`("y",)`, `"x,y"`, `dcn`).
        nbytes: V, the textbook's convention (see README): the gathered output for all-gather,
            the full unreduced buffer for reduce-scatter/all-reduce, the whole array for
            all-to-all, the per-chip message for collective-permute and send.
        algorithm: a name from `collectives.ALGORITHMS` (`auto` = what a TPU does).
        shift: chips to shift by, for collective-permute.
        src, dst: chip coordinates for send.
        slow_links: degraded links, as `"x,y[,z]:x+:factor"` strings or {link id: factor}.
        scenario: perturbations (its slow links add to `slow_links`); a collective runs on
            links only, so chip perturbations in it are an error.
        dead_links: ICI link ids that carry nothing (added to the scenario's dead links).
        mode: `auto` (symmetric where exact), `symmetric` (error if not exact), `full` (a
            representative group plus the perturbed ones, link by link) or `per-chip` (every
            chip of every group and every link, all groups' transfers of a step in one batch).
        chunks: pipeline each stream's data in this many pieces (phases then overlap; every
            piece pays the per-hop latency).
    """
    kw = dict(chip=chip, topology=topology, op=op, axes=axes, nbytes=nbytes,
              algorithm=algorithm, shift=shift, src=src, dst=dst, slow_links=slow_links,
              mode=mode, chunks=chunks, scenario=scenario, dead_links=tuple(dead_links))
    res = _simulate_collective(**kw)
    if res.detour is not None:
        healthy = scenario_without_dead_links(scenario)
        base = _simulate_collective(**{**kw, "scenario": healthy, "mode": "auto",
                                       "dead_links": ()})
        res.detour["healthy_time_s"] = base.time_s
        res.detour["extra_time_s"] = res.time_s - base.time_s
    return res


def scenario_without_dead_links(scenario: Scenario | None) -> Scenario | None:
    if scenario is None:
        return None
    return dataclasses.replace(scenario, dead_links=(), failed_chips=())


def _simulate_collective(
    *,
    chip: ChipSpec,
    topology: Topology,
    op: str | CollectiveKind,
    axes: tuple[str, ...] | str = (),
    nbytes: int,
    algorithm: str = "auto",
    shift: int = 1,
    src: tuple[int, ...] | None = None,
    dst: tuple[int, ...] | None = None,
    slow_links: tuple[str, ...] | dict[int, float] = (),
    mode: str = "auto",
    chunks: int = 1,
    scenario: Scenario | None = None,
    dead_links: tuple[int, ...] = (),
) -> CollectiveResult:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= 1024:
        raise TpusimError(f"--chunks {chunks!r} must be an integer from 1 to 1024")
    if algorithm == "auto" and str(op) in AUTO_CANDIDATES:
        return _auto_best(chip=chip, topology=topology, op=op, axes=axes, nbytes=nbytes,
                          shift=shift, src=src, dst=dst, slow_links=slow_links, mode=mode,
                          chunks=chunks, scenario=scenario, dead_links=dead_links)
    kind = parse_kind(op)
    if mode not in MODES:
        raise TpusimError(f"mode {mode!r} must be one of {', '.join(MODES)}")
    slow = _slow_links(topology, slow_links, scenario)
    dead = tuple(sorted(
        {int(d) for d in dead_links}
        | set(scenario.dead_link_ids_for(topology) if scenario is not None else ())
    ))
    if any(not 0 <= d < topology.num_ici_links or not topology.link_mask()[d] for d in dead):
        raise TpusimError(f"dead link ids {dead} must be ICI links of the {topology.name} pod")
    router = DetourRouter(topology, dead) if dead else None
    lm = link_model(chip, topology, {**slow, **{d: 0.0 for d in dead}})
    env = simpy.Environment()
    timeline: list[tuple] = []

    if kind == CollectiveKind.SEND:
        if src is None or dst is None:
            raise TpusimError("--op send needs --src and --dst chip coordinates, e.g. 0,0 and 3,3")
        from sim.collectives import ALGORITHMS, applicable_algorithms

        if ALGORITHMS.get(algorithm).name not in ("auto", "direct"):
            raise TpusimError(
                f"algorithm {algorithm!r} does not implement send; for send use one of: "
                f"{applicable_algorithms(kind)}"
            )
        nbytes = check_bytes(nbytes, kind, 1)
        batch, npaths, _hops = send_batch(topology, lm, tuple(src), tuple(dst), nbytes,
                                          detour=router)
        net = FluidNetwork(env, lm.capacity_bytes_per_s)

        def proc():
            t0 = env.now
            yield net.transfer(batch)
            timeline.append((0, topology.chip_id(tuple(src)), 1, 0, 0, f"send over {npaths} "
                             f"path(s)", t0, env.now, float(nbytes)))

        env.process(proc())
        env.run()
        return _result(
            kind=kind, algorithm="direct", requested=algorithm, chip=chip, topology=topology,
            axes=(), nbytes=nbytes, group_size=2, num_groups=1, time_s=env.now,
            net=net, link_bytes=net.bytes, link_busy=net.busy_s, lm=lm,
            hbm=2.0 * nbytes, mode="full", steps=1, timeline=timeline, router=router,
            latency_s=batch.latency_s, step_links=_step_links({0: [[batch]]}, topology.num_links),
        )

    if isinstance(axes, str):
        axes = tuple(a.strip() for a in axes.split(",") if a.strip())
    if axes and all(isinstance(a, GroupAxis) for a in axes):
        gaxes = tuple(axes)  # factors of physical axes, from a logical mesh
    else:
        gaxes = group_axes(topology, tuple(axes))
    gaxes = with_twist(topology, gaxes)
    geo = GroupGeometry(topology, gaxes)
    nbytes = check_bytes(nbytes, kind, geo.group_size)
    schedule = build_schedule(kind, gaxes, float(nbytes), algorithm, shift=shift)
    # The axes the schedule runs on (ring algorithms make a twisted ring a line).
    gaxes = schedule.gaxes

    # Which mode: symmetric is exact when the schedule is translation-invariant and no link
    # in the group's axes is degraded.
    relevant_slow = {
        link: f
        for link, f in slow.items()
        if _link_axis(topology, link) in {g.physical_name for g in gaxes}
    }
    # Dimension-order routes only use links of the group's axes, so a dead link elsewhere is
    # never on a route and changes nothing.
    group_axes_names = {g.physical_name for g in gaxes}
    relevant_dead = tuple(d for d in dead if _link_axis(topology, d) in group_axes_names)
    # Detours avoid every dead link, whatever its axis (a sideways step may need one).
    router = DetourRouter(topology, dead) if relevant_dead else None
    symmetric_ok = schedule.translation_invariant and not relevant_slow and not relevant_dead
    if mode == "symmetric" and not symmetric_ok:
        raise TpusimError(
            "--mode symmetric is not exact here (an axis without wraparound, an edge-dependent "
            "algorithm, or a degraded or dead link); use --mode auto, full or per-chip"
        )
    use_sym = symmetric_ok and mode not in ("full", "per-chip")
    steps_total = sum(len(s) for s in schedule.streams)
    # HBM traffic of one chip's DMA: it reads what it sends and writes what it receives, and in
    # reduce-scatter steps also reads its own partial sum to add the received one to it.
    # Symmetric: every chip sends and receives the same bytes.
    sent = schedule.bytes_sent_per_chip()
    sent_rs = sum(step_bytes_per_chip(st) * st.repeat for s_ in schedule.streams for st in s_
                  if _is_rs(st))
    hbm = 2.0 * sent + sent_rs

    if use_sym:
        net = FluidNetwork(env, lm.class_capacity_bytes_per_s)
        batches = [[symmetric_batch(st, gaxes, lm) for st in s] for s in schedule.streams]
        _launch(env, net, batches, schedule, 0, 0, topology.num_chips, timeline, chunks)
        env.run()
        link_bytes, link_busy = _expand_classes(topology, gaxes, net.bytes, net.busy_s)
        return _result(
            kind=kind, algorithm=schedule.algorithm, requested=algorithm, chip=chip,
            topology=topology, axes=tuple(g.name for g in gaxes), nbytes=nbytes,
            group_size=geo.group_size, num_groups=geo.num_groups, time_s=env.now, net=net,
            link_bytes=link_bytes, link_busy=link_busy, lm=lm, hbm=hbm, mode="symmetric",
            steps=steps_total, timeline=timeline,
            latency_s=latency_path_s(schedule, [[b.latency_s for b in s_] for s_ in batches],
                                     chunks),
            schedule=schedule,
        )

    if mode == "auto" and not relevant_slow and not relevant_dead:
        # Interleaved groups would all be simulated, disjoint ones one of them: the orbits'
        # representatives instead when they are fewer chips.
        orbits = orbit_periods(topology, gaxes, schedule)
        if orbits is not None and (not geo.disjoint or math.prod(orbits) < geo.group_size):
            return _simulate_orbits(
                kind=kind, requested=algorithm, chip=chip, topology=topology, geo=geo,
                schedule=schedule, lm=lm, periods=orbits, nbytes=nbytes, chunks=chunks,
                steps_total=steps_total)

    if router is not None:
        router.context = f" (a {kind} over {','.join(g.name for g in gaxes)} needs it)"
    touched: set[int] = set()
    if mode == "per-chip" or not geo.disjoint:
        groups = list(range(geo.num_groups))  # strided groups share links: simulate them all
    else:
        # The groups owning a degraded or dead link, and those whose links carry a detour,
        # are simulated; one untouched group stands for all the others (a route stays on its
        # group's links, so untouched groups share none with touched ones).
        touched = {int(geo.group_of_chip[_link_src(topology, lk)])
                   for lk in (*relevant_slow, *relevant_dead)}
        if relevant_dead:
            touched |= _detour_groups(topology, geo, schedule, gaxes, sorted(touched), lm,
                                      dead)
        rest = [g for g in range(geo.num_groups) if g not in touched]
        groups = sorted(touched | set(rest[:1]))
    check_full_size(schedule, geo.group_size, len(groups))
    rep = None
    if mode != "per-chip" and geo.disjoint:
        rep = next((g for g in groups if g not in touched), None)
    represented = {g: geo.group_size for g in groups}
    if rep is not None:
        represented[rep] = geo.group_size * (geo.num_groups - len(groups) + 1)
    net = FluidNetwork(env, lm.capacity_bytes_per_s, coalesce=True)
    batches_of = _group_batches(topology, geo, schedule, gaxes, groups, lm, router)
    for g in groups:
        _launch(env, net, batches_of[g], schedule, g, int(geo.group_chips(g)[0]),
                represented[g], timeline, chunks)
    env.run()
    if rep is not None:
        link_bytes, link_busy = _replicate_group(topology, geo, groups, rep, net)
    else:
        link_bytes, link_busy = net.bytes.copy(), net.busy_s.copy()
    hbm = _full_hbm_bytes(list(batches_of.values()), schedule, topology.num_chips)
    return _result(
        kind=kind, algorithm=schedule.algorithm, requested=algorithm, chip=chip,
        topology=topology, axes=tuple(g.name for g in gaxes), nbytes=nbytes,
        group_size=geo.group_size, num_groups=geo.num_groups, time_s=env.now, net=net,
        link_bytes=link_bytes, link_busy=link_busy, lm=lm, hbm=hbm,
        mode="per-chip" if mode == "per-chip" else "full", steps=steps_total,
        timeline=timeline, router=router,
        touched=tuple(g for g in groups if g != rep) if rep is not None else tuple(groups),
        latency_s=max(latency_path_s(schedule, lats, chunks) for lats in {
            tuple(tuple(b.latency_s for b in s_) for s_ in batches_of[g]) for g in groups}),
        schedule=schedule, step_links=_step_links(batches_of, topology.num_links),
    )


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
    carry and every group finishes with its orbit's representative (see `_simulate_orbits`).
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


def _simulate_orbits(*, kind, requested, chip, topology, geo, schedule, lm, periods, nbytes,
                     chunks, steps_total) -> CollectiveResult:
    """Full detail on the representatives of the pod's translation symmetry (`orbit_periods`).

    The representative chips are those whose coordinates lie below the periods; their
    transfers are routed link by link, grouped by replica group, and every link id is replaced
    by its representative, so each representative link carries the bytes of every transfer in
    its orbit, exactly what each of its links carries in the whole pod. Each group holding
    representative chips stands for its orbit of groups. Exact against `--mode full` (the
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
            for g, part in _split_by_group(b, geo, groups).items():
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
        _launch(env, net, folded[g], schedule, g, first[g], represented, timeline, chunks)
    env.run()
    group_rep = np.zeros(geo.num_groups, dtype=np.int64)
    group_rep[geo.group_of_chip] = geo.group_of_chip[canon_chip]
    return _result(
        kind=kind, algorithm=schedule.algorithm, requested=requested, chip=chip,
        topology=topology, axes=tuple(g.name for g in gaxes), nbytes=nbytes,
        group_size=geo.group_size, num_groups=geo.num_groups, time_s=env.now, net=net,
        link_bytes=net.bytes[canon_link], link_busy=net.busy_s[canon_link], lm=lm,
        hbm=_full_hbm_bytes(list(folded.values()), schedule, n), mode="orbit",
        steps=steps_total, timeline=timeline, touched=tuple(groups),
        latency_s=max(latency_path_s(schedule, lats, chunks) for lats in {
            tuple(tuple(b.latency_s for b in s_) for s_ in folded[g]) for g in groups}),
        schedule=schedule, step_links=_step_links(routed, topology.num_links),
        group_rep=group_rep, orbit_periods=tuple(int(p) for p in periods),
    )


def _group_batches(topology, geo, schedule, gaxes, groups, lm, router):
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
            for g, part in _split_by_group(b, geo, groups).items():
                if lat_of.get(g, 0.0) > part.latency_s:
                    part = dataclasses.replace(part, latency_s=lat_of[g])
                out[g][si].append(part)
    return out


def _split_by_group(b, geo, groups) -> dict[int, Any]:
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


def _detour_groups(topology, geo, schedule, gaxes, groups, lm, dead) -> set[int]:
    """Groups owning a link that `groups`' routes use once they detour around `dead`."""
    batches = _group_batches(topology, geo, schedule, gaxes, groups, lm,
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


@dataclass(frozen=True, kw_only=True)
class GroupCollectiveLoads:
    """One collective on every replica group of the pod under a scenario's slow/dead links.

    Attributes:
        time_s_per_group: when each group finishes (seconds from the start; `num_groups`).
        link_bytes: bytes every link id carries, all groups together (`num_links`).
        link_busy_s: seconds each link id is busy.
        result: the full `CollectiveResult` (timeline, detour cost, ...).
    """

    time_s_per_group: np.ndarray
    link_bytes: np.ndarray
    link_busy_s: np.ndarray
    result: CollectiveResult


def collective_link_loads(
    *,
    chip: ChipSpec,
    topology: Topology,
    op: str | CollectiveKind,
    gaxes: tuple[GroupAxis, ...] | str,
    nbytes: int,
    algorithm: str = "auto",
    scenario: Scenario | None = None,
    mode: str = "auto",
) -> GroupCollectiveLoads:
    """Per-group finish times and per-link loads of one collective, for the step engine.

    Groups that no slow or dead link touches keep the healthy time; the others (a dead link's
    group, and the groups whose links carry its detours) are simulated link by link.
    `mode="per-chip"` simulates every group (the oracle)."""
    res = simulate_collective(chip=chip, topology=topology, op=op, axes=gaxes, nbytes=nbytes,
                              algorithm=algorithm, scenario=scenario, mode=mode)
    geo = GroupGeometry(topology, tuple(gaxes) if not isinstance(gaxes, str) else
                        group_axes(topology, tuple(a.strip() for a in gaxes.split(","))))
    times = np.full(geo.num_groups, res.time_s)
    if res.mode != "symmetric":
        ends: dict[int, float] = {}
        rep_time = None
        for row in res.timeline_rows:
            g, end = int(row[0]), float(row[7])
            ends[g] = max(ends.get(g, 0.0), end)
        for row in res.timeline_rows:
            if row[2] > geo.group_size:  # the group that stands for the unsimulated ones
                rep_time = ends[int(row[0])]
        if res.group_rep is not None:  # orbit mode: each group finishes with its orbit's
            times = np.asarray([ends[int(r)] for r in res.group_rep.tolist()])
        else:
            if rep_time is not None:
                times[:] = rep_time
            for g, t in ends.items():
                times[g] = t
    return GroupCollectiveLoads(time_s_per_group=times, link_bytes=res.link_bytes,
                                link_busy_s=res.link_busy_s, result=res)


# `auto` simulates every algorithm that applies to the op and keeps the fastest: the compiler
# picks by cost, and the latency term (hops x per-hop latency, per step) decides small
# collectives while the bandwidth term decides large ones. Candidates are in tie-break order
# (earlier wins a tie); an algorithm that refuses the group (one-axis algorithm on several axes,
# ring without wraparound, too large to route link by link) is no candidate.
AUTO_CANDIDATES = {
    "all-gather": ("multi-axis", "bidi-ring", "split-bidi-ring", "hierarchical", "direct",
                   "line", "per-axis-ring", "ring", "halving-doubling"),
    "all-to-all": ("direct", "bidi-ring", "ring"),
}
AUTO_CANDIDATES["reduce-scatter"] = AUTO_CANDIDATES["all-gather"]
AUTO_CANDIDATES["all-reduce"] = AUTO_CANDIDATES["all-gather"]
# Across slices (a group spanning only `dcn`) the collective runs as a ring or direct exchange
# of 2(N-1) messages per chip over N slices, never by recursive halving/doubling (2 log2 N):
# the measured MaxText slowdown with slice count grows linearly in N (docs/validation.md,
# v5e 1-32 slices), and with a per-message DCN cost halving-doubling would make it grow as
# log N. `--algorithm halving-doubling` still simulates it on request.
DCN_EXCLUDED = frozenset({"halving-doubling"})


def _dcn_only(axes) -> bool:
    """Whether a collective's axes (names, "a,b" text or `GroupAxis`es) are all `dcn`."""
    if isinstance(axes, str):
        axes = tuple(a.strip() for a in axes.split(",") if a.strip())
    return bool(axes) and all(
        (a.is_dcn if isinstance(a, GroupAxis) else a == DCN_AXIS) for a in axes)


def _auto_best(**kw) -> CollectiveResult:
    best: CollectiveResult | None = None
    first_error: TpusimError | None = None
    seen: list[dict[str, Any]] = []
    bound = _bound_context(kw)
    dcn_only = _dcn_only(kw["axes"])
    for cand in AUTO_CANDIDATES[str(kw["op"])]:
        if dcn_only and cand in DCN_EXCLUDED:
            seen.append({"algorithm": cand, "time_s": None,
                         "reason": "not a candidate across slices: cross-slice "
                                   "collectives are modelled as 2(N-1) messages per chip "
                                   "(ring or direct; docs/model.md)"})
            continue
        if best is not None and bound is not None:
            # A candidate whose lower bound is no better than the best so far cannot win
            # (ties go to the earlier candidate): skip its simulation.
            lb = _candidate_lower_bound(cand, kw, bound)
            if lb is not None and lb >= best.time_s * (1 - 1e-12):
                seen.append({"algorithm": cand, "time_s": None, "lower_bound_s": lb,
                             "reason": "not simulated: its lower bound is no better than "
                                       "the best candidate's time"})
                continue
        try:
            r = _simulate_collective(algorithm=cand, **kw)
        except TpusimError as exc:
            if first_error is None:
                first_error = exc
            seen.append({"algorithm": cand, "time_s": None, "reason": str(exc)})
            continue
        seen.append({"algorithm": cand, "time_s": r.time_s, "latency_s": r.latency_s,
                     "bandwidth_s": r.bandwidth_s})
        if best is None or r.time_s < best.time_s * (1 - 1e-12):
            best = r
    if best is None:
        assert first_error is not None
        raise first_error
    best.algorithm = f"auto ({best.algorithm})"
    best.algorithm_requested = "auto"
    best.auto_candidates = seen
    return best


def _bound_context(kw) -> tuple | None:
    """(kind, group axes, ICI links per physical axis, fastest ICI link, num groups) for
    `_candidate_lower_bound`, or None when no bound is used (chunks overlap steps)."""
    if kw.get("chunks", 1) != 1:
        return None
    try:
        topology = kw["topology"]
        kind = CollectiveKind(kw["op"])
        axes = kw["axes"]
        if isinstance(axes, str):
            axes = tuple(a.strip() for a in axes.split(",") if a.strip())
        if axes and all(isinstance(a, GroupAxis) for a in axes):
            gaxes = tuple(axes)
        else:
            gaxes = group_axes(topology, tuple(axes))
        gaxes = with_twist(topology, gaxes)
        geo = GroupGeometry(topology, gaxes)
        slow = _slow_links(topology, kw.get("slow_links", ()), kw.get("scenario"))
    except (TpusimError, ValueError):
        return None
    chip = kw["chip"]
    fastest = chip.eff_ici_link_bytes_per_s * max([1.0, *slow.values()])
    per = 2 * topology.ndim
    mask = topology.link_mask().reshape(-1, per)
    links = {i: int(mask[:, 2 * i:2 * i + 2].sum()) for i in range(topology.ndim)}
    return kind, gaxes, links, fastest, geo.num_groups


def _candidate_lower_bound(cand: str, kw, ctx) -> float | None:
    """A time the candidate cannot beat, from its schedule alone (no routing, no simulation).

    Every stream runs its steps one after another, and a step lasts at least its latency plus
    the time to drain the bytes it puts on the links of each physical axis spread evenly over
    all of them (at the fastest link's rate): the busiest link carries at least the average.
    Dead and slow links only make the true time longer."""
    kind, gaxes, links, fastest, num_groups = ctx
    try:
        schedule = build_schedule(kind, gaxes, float(kw["nbytes"]), cand,
                                  shift=kw.get("shift", 1))
    except (TpusimError, ValueError, TypeError):
        return None
    gaxes = schedule.gaxes  # ring algorithms run a twisted ring as a line
    chip = kw["chip"]
    k = len(gaxes)
    size = np.array([g.size for g in gaxes], dtype=np.int64)
    wraps = np.array([g.wraps for g in gaxes])
    dcn = np.array([g.is_dcn for g in gaxes])
    hop_len = np.array([0 if g.is_dcn else g.stride for g in gaxes], dtype=float)
    hop_lat = np.array([chip.dcn_latency_s if g.is_dcn else chip.ici_hop_latency_s * g.stride
                        for g in gaxes])
    axis_index = [g.index for g in gaxes]
    best = 0.0
    for stream in schedule.streams:
        t = 0.0
        for st in stream:
            if not st.moves:
                continue
            # Every move at once (a step of `direct` has one per destination).
            off = np.array([m.offset for m in st.moves], dtype=np.int64).reshape(-1, k)
            nbytes = np.array([m.bytes for m in st.moves], dtype=float)
            if any(m.src_bit is not None for m in st.moves):
                n_src = np.array([_num_sources(m, gaxes) for m in st.moves], dtype=float)
            else:
                lo = np.zeros_like(off)
                hi = np.broadcast_to(size - 1, off.shape).copy()
                for i, m in enumerate(st.moves):
                    if m.src_lo is not None:
                        lo[i] = np.maximum(lo[i], m.src_lo)
                        hi[i] = np.minimum(hi[i], m.src_hi)
                line = (off != 0) & ~wraps
                lo = np.where(line, np.maximum(lo, -off), lo)
                hi = np.where(line, np.minimum(hi, size - 1 - off), hi)
                n_src = np.prod(np.clip(hi - lo + 1, 0, None), axis=1).astype(float)
            live = (nbytes > 0) & (n_src > 0) & (off != 0).any(axis=1)
            if not live.any():
                continue
            # route_latency_s: per-hop latency on ICI, the DCN latency once per DCN crossing.
            steps = np.where(dcn, off[live] != 0, np.abs(off[live]))
            lat = float((steps * hop_lat).sum(axis=1).max())
            load = (nbytes * n_src)[live, None] * np.abs(off[live]) * hop_len  # per group axis
            axis_bytes: dict[int, float] = {}
            for j, a in enumerate(axis_index):
                if not dcn[j]:
                    axis_bytes[a] = axis_bytes.get(a, 0.0) + float(load[:, j].sum())
            drain = max((b * num_groups / (links[a] * fastest)
                         for a, b in axis_bytes.items() if links[a]), default=0.0)
            t += st.repeat * (lat + drain)
        best = max(best, t)
    return best


def _num_sources(m, gaxes) -> int:
    """How many chips of a group perform move `m` (its source range, bit condition and, on
    axes without wraparound, a destination that stays on the line)."""
    n = 1
    for i, (g, o) in enumerate(zip(gaxes, m.offset, strict=True)):
        lo, hi = 0, g.size - 1
        if m.src_lo is not None:
            lo, hi = max(lo, m.src_lo[i]), min(hi, m.src_hi[i])
        if o and not g.wraps:
            lo, hi = max(lo, -o), min(hi, g.size - 1 - o)
        if hi < lo:
            return 0
        if m.src_bit is not None and m.src_bit[0] == i:
            _axis, bit, value = m.src_bit
            count = sum(1 for x in range(lo, hi + 1) if (x >> bit) & 1 == value)
        else:
            count = hi - lo + 1
        n *= count
    return n


def latency_path_s(schedule: Schedule, lat: list[list[float]], chunks: int = 1) -> float:
    """The latency term: how long the schedule takes if links were infinitely fast.

    `lat[s][k]` is step k of stream s's latency (all its repetitions). Chunks and phase barriers
    follow `_launch`: chunk c starts step k after its step k-1 and chunk c-1's step k; with
    `sync_phases` a stream's first step of phase p waits until every stream has finished its
    steps of phases < p (for that chunk). time - latency is the bandwidth term."""
    streams = schedule.streams
    num_phases = 1 + max((st.phase for s_ in streams for st in s_), default=0)
    prev_chunk = [[0.0] * len(s_) for s_ in streams]
    end = 0.0
    for _c in range(chunks):
        fin = [[0.0] * len(s_) for s_ in streams]
        last = [0.0] * len(streams)  # finish of the stream's latest step so far
        pos = [0] * len(streams)
        for p in range(num_phases if schedule.sync_phases else 1):
            barrier = max(last) if p > 0 else 0.0
            for si, s_ in enumerate(streams):
                first = True
                while pos[si] < len(s_) and (not schedule.sync_phases or s_[pos[si]].phase == p):
                    k = pos[si]
                    start = max(last[si], prev_chunk[si][k])
                    if first and p > 0:
                        start = max(start, barrier)
                    first = False
                    fin[si][k] = start + lat[si][k]
                    last[si] = fin[si][k]
                    pos[si] += 1
        prev_chunk = fin
        end = max([end, *last])
    return end


MAX_STEP_LINK_ENTRIES = 2_000_000  # (step, link) pairs kept for the trace's link tracks


def _step_links(batches_of, num_links: int):
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


def _is_rs(step) -> bool:
    return "RS" in step.label.split()


def _full_hbm_bytes(all_batches, schedule: Schedule, num_chips: int) -> float:
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
                traffic += recv * (2.0 if _is_rs(st) else 1.0)
    return float(traffic.max(initial=0.0))


def _link_axis(topology: Topology, link: int) -> str:
    if link >= topology.num_ici_links:
        return DCN_AXIS
    return AXIS_NAMES[(link % (2 * topology.ndim)) // 2]


def _link_src(topology: Topology, link: int) -> int:
    return link // (2 * topology.ndim)


def _launch(env, net, batches, schedule, group, chip, represented, timeline, chunks=1) -> None:
    """One SimPy process per (stream, chunk).

    With C chunks each stream's data is cut into C pieces that flow through its steps like a
    pipeline: chunk c runs step k once it has finished step k-1 and chunk c-1 has finished step
    k, so later phases overlap earlier ones. With `sync_phases`, a chunk starts phase p of any
    stream only when that chunk has finished phase p-1 in every stream (lock-step parts).
    """
    num_phases = 1 + max((st.phase for s in schedule.streams for st in s), default=0)
    phase_done: dict[tuple[int, int, int], simpy.Event] = {}
    if schedule.sync_phases:
        for c in range(chunks):
            for si in range(len(batches)):
                for p in range(num_phases):
                    phase_done[(c, si, p)] = env.event()
    for si, stream in enumerate(batches):
        steps = schedule.streams[si]
        if chunks > 1:
            stream = [dataclasses.replace(b, bytes_per_transfer=b.bytes_per_transfer / chunks)
                      for b in stream]
        finished = [[env.event() for _ in stream] for _ in range(chunks)]

        def proc(stream=stream, steps=steps, si=si, c=0, finished=finished):
            cur_phase = -1
            for k, (b, st) in enumerate(zip(stream, steps, strict=True)):
                if phase_done and st.phase != cur_phase:
                    for p in range(max(cur_phase, 0), st.phase):
                        ev = phase_done[(c, si, p)]
                        if not ev.triggered:
                            ev.succeed()
                    if st.phase > 0:
                        others = [phase_done[(c, sj, st.phase - 1)] for sj in range(len(batches))]
                        yield env.all_of(others)
                    cur_phase = st.phase
                if c > 0 and not finished[c - 1][k].processed:
                    yield finished[c - 1][k]
                t0 = env.now
                yield net.transfer(b)
                finished[c][k].succeed()
                per_chip = step_bytes_per_chip(st) * st.repeat / chunks
                timeline.append((group, chip, represented, si, k, st.label, t0, env.now,
                                 per_chip))
            for p in range(max(cur_phase, 0), num_phases):
                if phase_done and not phase_done[(c, si, p)].triggered:
                    phase_done[(c, si, p)].succeed()

        for c in range(chunks):
            env.process(proc(c=c))


def _expand_classes(topology: Topology, gaxes, cls_bytes, cls_busy):
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


def _replicate_group(topology: Topology, geo: GroupGeometry, groups, rep: int, net):
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


def _result(*, kind, algorithm, requested, chip, topology, axes, nbytes, group_size, num_groups,
            time_s, net, link_bytes, link_busy, lm, hbm, mode, steps, timeline, router=None,
            touched=None, latency_s=0.0, schedule=None, step_links=None, group_rep=None,
            orbit_periods=None):
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


__all__ = ["CLASS_NAMES", "CollectiveResult", "GroupCollectiveLoads", "check_bytes",
           "check_links_only", "collective_link_loads", "simulate_collective"]
