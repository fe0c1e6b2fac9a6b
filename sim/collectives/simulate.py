"""Simulating one collective on a pod: `simulate_collective`.

The collective's schedule is routed before `env.run()`; SimPy then replays its streams of steps
against the fluid link network. One representative chip stands for all when the setup is
translation-symmetric (every collective axis wraps, no degraded link); otherwise whole replica
groups are simulated link by link (a representative group, plus every group that contains a
degraded link; `full_detail`). Interleaved (strided) groups on a healthy pod are simulated on the
representatives of the pod's translation symmetry, link ids folded onto their orbits (`orbits`,
mode `orbit`); mode `full` simulates every group (the oracle). `auto` simulates every candidate
algorithm (`auto.AUTO_CANDIDATES`) and keeps the fastest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from sim.collectives.algorithms import (
    ALGORITHMS,
    CollectiveKind,
    Schedule,
    applicable_algorithms,
    build_schedule,
    parse_kind,
    step_bytes_per_chip,
)
from sim.collectives.auto import (
    AUTO_CANDIDATES,
    DCN_EXCLUDED,
    HeldAlgorithms,
    bound_context,
    candidate_lower_bound,
    dcn_only,
)
from sim.collectives.full_detail import (
    detour_groups,
    full_hbm_bytes,
    group_batches,
    replicate_group,
)
from sim.collectives.inputs import (
    MODES,
    check_bytes,
    dead_link_ids,
    group_axes_of,
    link_axis,
    link_src,
    scenario_without_dead_links,
    slow_link_factors,
)
from sim.collectives.orbits import orbit_periods, simulate_orbits
from sim.collectives.result import (
    CollectiveResult,
    collective_result,
    expand_classes,
    step_link_loads,
)
from sim.collectives.routing import (
    LinkModel,
    check_full_size,
    link_model,
    send_batch,
    symmetric_batch,
)
from sim.collectives.streams import is_reduce_scatter, latency_path_s, launch_streams
from sim.engine.network import FluidNetwork
from sim.hardware import ChipSpec
from topologies.errors import Said, TpusimError
from topologies.groups import DetourRouter, GroupAxis, GroupGeometry, group_axes
from topologies.scenario import Scenario
from topologies.torus import Topology


def simulate_collective(
    *,
    chip: ChipSpec,
    topology: Topology,
    op: str | CollectiveKind,
    axes: tuple[str, ...] | str = (),
    nbytes: int,
    algorithm: str | HeldAlgorithms = "auto",
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
        algorithm: a name from `collectives.ALGORITHMS` (`auto` = what a TPU does), or a
            `HeldAlgorithms` (`auto` with some collectives' algorithms held fixed).
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
    if isinstance(algorithm, HeldAlgorithms):
        algorithm = algorithm.algorithm_for(op, axes, nbytes)
    kw = dict(chip=chip, topology=topology, op=op, axes=axes, nbytes=nbytes,
              algorithm=algorithm, shift=shift, src=src, dst=dst, slow_links=slow_links,
              mode=mode, chunks=chunks, scenario=scenario, dead_links=tuple(dead_links))
    res = _simulate(**kw)
    if res.detour is not None:
        healthy = scenario_without_dead_links(scenario)
        base = _simulate(**{**kw, "scenario": healthy, "mode": "auto",
                                       "dead_links": ()})
        res.detour["healthy_time_s"] = base.time_s
        res.detour["extra_time_s"] = res.time_s - base.time_s
    return res



def _simulate(**kw) -> CollectiveResult:
    """One collective: `auto` searches its candidates, any other algorithm is simulated."""
    chunks = kw["chunks"]
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= 1024:
        raise TpusimError(f"{{chunks}} {chunks!r} must be an integer from 1 to 1024", "chunks")
    if kw["algorithm"] == "auto" and str(kw["op"]) in AUTO_CANDIDATES:
        return _auto_best(**{k: v for k, v in kw.items() if k != "algorithm"})
    return _simulate_algorithm(**kw)


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """One collective of one algorithm, resolved: what every mode's simulation starts from."""

    kind: CollectiveKind
    requested: str
    chip: ChipSpec
    topology: Topology
    geo: GroupGeometry
    schedule: Schedule
    gaxes: tuple[GroupAxis, ...]  # the axes the schedule runs on (a twisted ring as a line)
    lm: LinkModel
    nbytes: int
    chunks: int
    dead: tuple[int, ...]
    relevant_slow: dict[int, float]  # slow links on the group's axes
    relevant_dead: tuple[int, ...]  # dead links on the group's axes

    @property
    def steps_total(self) -> int:
        return sum(len(s) for s in self.schedule.streams)

    def result(self, **kw) -> CollectiveResult:
        return collective_result(
            kind=self.kind, algorithm=self.schedule.algorithm, requested=self.requested,
            chip=self.chip, topology=self.topology, axes=tuple(g.name for g in self.gaxes),
            nbytes=self.nbytes, group_size=self.geo.group_size, num_groups=self.geo.num_groups,
            lm=self.lm, steps=self.steps_total, schedule=self.schedule, **kw)


def _simulate_algorithm(
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
    """One collective with one named algorithm, in the mode that is exact for it."""
    kind = parse_kind(op)
    if mode not in MODES:
        raise TpusimError(f"mode {mode!r} must be one of {', '.join(MODES)}")
    slow = slow_link_factors(topology, slow_links, scenario)
    dead = dead_link_ids(topology, dead_links, scenario)
    lm = link_model(chip, topology, {**slow, **{d: 0.0 for d in dead}})
    if kind == CollectiveKind.SEND:
        return _simulate_send(chip=chip, topology=topology, lm=lm, src=src, dst=dst,
                              nbytes=nbytes, algorithm=algorithm, dead=dead)
    setup = _resolve(kind=kind, chip=chip, topology=topology, axes=axes, nbytes=nbytes,
                     algorithm=algorithm, shift=shift, lm=lm, chunks=chunks, slow=slow,
                     dead=dead)
    symmetric_ok = (setup.schedule.translation_invariant and not setup.relevant_slow
                    and not setup.relevant_dead)
    if mode == "symmetric" and not symmetric_ok:
        raise TpusimError(
            "{mode} symmetric is not exact here (an axis without wraparound, an edge-dependent "
            "algorithm, or a degraded or dead link); use {mode} auto, full or per-chip", "mode")
    if symmetric_ok and mode not in ("full", "per-chip"):
        return _simulate_symmetric(setup)
    if mode == "auto" and not setup.relevant_slow and not setup.relevant_dead:
        # Interleaved groups would all be simulated, disjoint ones one of them: the orbits'
        # representatives instead when they are fewer chips.
        geo = setup.geo
        orbits = orbit_periods(topology, setup.gaxes, setup.schedule)
        if orbits is not None and (not geo.disjoint or math.prod(orbits) < geo.group_size):
            return simulate_orbits(
                kind=kind, requested=algorithm, chip=chip, topology=topology, geo=geo,
                schedule=setup.schedule, lm=lm, periods=orbits, nbytes=setup.nbytes,
                chunks=chunks, steps_total=setup.steps_total)
    return _simulate_groups(setup, per_chip=mode == "per-chip")


def _simulate_send(*, chip, topology, lm, src, dst, nbytes, algorithm, dead) -> CollectiveResult:
    """Point to point: the message split over its minimal paths (`send_batch`)."""
    kind = CollectiveKind.SEND
    router = DetourRouter(topology, dead) if dead else None
    if src is None or dst is None:
        raise TpusimError("{op} send needs {src} and {dst} chip coordinates, e.g. 0,0 and 3,3",
                          "op", "src", "dst")
    if ALGORITHMS.get(algorithm).name not in ("auto", "direct"):
        raise TpusimError(
            f"algorithm {algorithm!r} does not implement send; for send use one of: "
            f"{applicable_algorithms(kind)}"
        )
    nbytes = check_bytes(nbytes, kind, 1)
    batch, npaths, _hops = send_batch(topology, lm, tuple(src), tuple(dst), nbytes,
                                      detour=router)
    env = simpy.Environment()
    timeline: list[tuple] = []
    net = FluidNetwork(env, lm.capacity_bytes_per_s)

    def proc():
        t0 = env.now
        yield net.transfer(batch)
        timeline.append((0, topology.chip_id(tuple(src)), 1, 0, 0, f"send over {npaths} "
                         f"path(s)", t0, env.now, float(nbytes)))

    env.process(proc())
    env.run()
    return collective_result(
        kind=kind, algorithm="direct", requested=algorithm, chip=chip, topology=topology,
        axes=(), nbytes=nbytes, group_size=2, num_groups=1, time_s=env.now,
        net=net, link_bytes=net.bytes, link_busy=net.busy_s, lm=lm,
        hbm=2.0 * nbytes, mode="full", steps=1, timeline=timeline, router=router,
        latency_s=batch.latency_s, step_links=step_link_loads({0: [[batch]]}, topology.num_links),
    )


def _resolve(*, kind, chip, topology, axes, nbytes, algorithm, shift, lm, chunks, slow,
             dead) -> _Setup:
    """The group, its bytes, the algorithm's schedule and the degraded links on its axes."""
    geo = GroupGeometry(topology, group_axes_of(topology, axes))
    nbytes = check_bytes(nbytes, kind, geo.group_size)
    schedule = build_schedule(kind, geo.gaxes, float(nbytes), algorithm, shift=shift)
    # The axes the schedule runs on (ring algorithms make a twisted ring a line).
    gaxes = schedule.gaxes
    # Symmetric mode is exact when the schedule is translation-invariant and no link in the
    # group's axes is degraded. Dimension-order routes only use links of the group's axes, so
    # a dead link elsewhere is never on a route and changes nothing.
    names = {g.physical_name for g in gaxes}
    return _Setup(
        kind=kind, requested=algorithm, chip=chip, topology=topology, geo=geo,
        schedule=schedule, gaxes=gaxes, lm=lm, nbytes=nbytes, chunks=chunks, dead=dead,
        relevant_slow={link: f for link, f in slow.items()
                       if link_axis(topology, link) in names},
        relevant_dead=tuple(d for d in dead if link_axis(topology, d) in names),
    )


def _simulate_symmetric(setup: _Setup) -> CollectiveResult:
    """One representative chip's moves on link classes (exact under translation symmetry)."""
    schedule, topology, lm = setup.schedule, setup.topology, setup.lm
    env = simpy.Environment()
    timeline: list[tuple] = []
    # HBM traffic of one chip's DMA: it reads what it sends and writes what it receives, and in
    # reduce-scatter steps also reads its own partial sum to add the received one to it.
    # Symmetric: every chip sends and receives the same bytes.
    sent = schedule.bytes_sent_per_chip()
    sent_rs = sum(step_bytes_per_chip(st) * st.repeat for s_ in schedule.streams for st in s_
                  if is_reduce_scatter(st))
    net = FluidNetwork(env, lm.class_capacity_bytes_per_s)
    batches = [[symmetric_batch(st, setup.gaxes, lm) for st in s] for s in schedule.streams]
    launch_streams(env, net, batches, schedule, 0, 0, topology.num_chips, timeline,
                   setup.chunks)
    env.run()
    link_bytes, link_busy = expand_classes(topology, setup.gaxes, net.bytes, net.busy_s)
    return setup.result(
        time_s=env.now, net=net, link_bytes=link_bytes, link_busy=link_busy,
        hbm=2.0 * sent + sent_rs, mode="symmetric", timeline=timeline,
        latency_s=latency_path_s(schedule, [[b.latency_s for b in s_] for s_ in batches],
                                 setup.chunks),
    )


def _simulate_groups(setup: _Setup, *, per_chip: bool) -> CollectiveResult:
    """Whole replica groups link by link: every group (per-chip mode, or strided groups that
    share links), or the groups a degraded or dead link touches plus one that stands for the
    untouched rest (`full_detail`)."""
    topology, geo, schedule, lm = setup.topology, setup.geo, setup.schedule, setup.lm
    gaxes, chunks = setup.gaxes, setup.chunks
    # Detours avoid every dead link, whatever its axis (a sideways step may need one).
    router = DetourRouter(topology, setup.dead) if setup.relevant_dead else None
    if router is not None:
        router.context = f" (a {setup.kind} over {','.join(g.name for g in gaxes)} needs it)"
    touched: set[int] = set()
    if per_chip or not geo.disjoint:
        groups = list(range(geo.num_groups))  # strided groups share links: simulate them all
    else:
        # The groups owning a degraded or dead link, and those whose links carry a detour,
        # are simulated; one untouched group stands for all the others (a route stays on its
        # group's links, so untouched groups share none with touched ones).
        touched = {int(geo.group_of_chip[link_src(topology, lk)])
                   for lk in (*setup.relevant_slow, *setup.relevant_dead)}
        if setup.relevant_dead:
            touched |= detour_groups(topology, geo, schedule, gaxes, sorted(touched), lm,
                                     setup.dead)
        rest = [g for g in range(geo.num_groups) if g not in touched]
        groups = sorted(touched | set(rest[:1]))
    check_full_size(schedule, geo.group_size, len(groups))
    rep = None
    if not per_chip and geo.disjoint:
        rep = next((g for g in groups if g not in touched), None)
    represented = {g: geo.group_size for g in groups}
    if rep is not None:
        represented[rep] = geo.group_size * (geo.num_groups - len(groups) + 1)
    env = simpy.Environment()
    timeline: list[tuple] = []
    net = FluidNetwork(env, lm.capacity_bytes_per_s, coalesce=True)
    batches_of = group_batches(topology, geo, schedule, gaxes, groups, lm, router)
    for g in groups:
        launch_streams(env, net, batches_of[g], schedule, g, int(geo.group_chips(g)[0]),
                       represented[g], timeline, chunks)
    env.run()
    if rep is not None:
        link_bytes, link_busy = replicate_group(topology, geo, groups, rep, net)
    else:
        link_bytes, link_busy = net.bytes.copy(), net.busy_s.copy()
    return setup.result(
        time_s=env.now, net=net, link_bytes=link_bytes, link_busy=link_busy,
        hbm=full_hbm_bytes(list(batches_of.values()), schedule, topology.num_chips),
        mode="per-chip" if per_chip else "full", timeline=timeline, router=router,
        touched=tuple(g for g in groups if g != rep) if rep is not None else tuple(groups),
        latency_s=max(latency_path_s(schedule, lats, chunks) for lats in {
            tuple(tuple(b.latency_s for b in s_) for s_ in batches_of[g]) for g in groups}),
        step_links=step_link_loads(batches_of, topology.num_links),
    )


def _auto_best(**kw) -> CollectiveResult:
    """`auto`: every candidate simulated (unless its lower bound cannot win), the fastest kept;
    the result lists them all (`auto_candidates`)."""
    best: CollectiveResult | None = None
    first_error: TpusimError | None = None
    seen: list[dict[str, Any]] = []
    bound = bound_context(kw)
    across_slices = dcn_only(kw["axes"])
    for cand in AUTO_CANDIDATES[str(kw["op"])]:
        if across_slices and cand in DCN_EXCLUDED:
            seen.append({"algorithm": cand, "time_s": None,
                         "reason": "not a candidate across slices: cross-slice "
                                   "collectives are modelled as 2(N-1) messages per chip "
                                   "(ring or direct; docs/model.md)"})
            continue
        if best is not None and bound is not None:
            # A candidate whose lower bound is no better than the best so far cannot win
            # (ties go to the earlier candidate): skip its simulation.
            lb = candidate_lower_bound(cand, kw, bound)
            if lb is not None and lb >= best.time_s * (1 - 1e-12):
                seen.append({"algorithm": cand, "time_s": None, "lower_bound_s": lb,
                             "reason": "not simulated: its lower bound is no better than "
                                       "the best candidate's time"})
                continue
        try:
            r = _simulate_algorithm(**{**kw, "algorithm": cand})
        except TpusimError as exc:
            if first_error is None:
                first_error = exc
            # The refusal as data: Python names here, the CLI's flags where it prints it.
            seen.append({"algorithm": cand, "time_s": None, "reason": Said(exc)})
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

