"""The per-chip step engine: every chip of the pod replays the step, so a slow chip, a slow link or
chip-to-chip speed variation shows where (and through which chips and links) it delays the step.

Model (docs/model.md, "Per-chip engine"):

* Every chip runs `sim.engine.replay`'s model of one chip (MXU, VPU and PCIe as SimPy resources,
  the MXU and VPU as immediate grants since only the core uses them; its HBM and its outgoing
  link classes as fluid resources shared by compute and collective DMA), with its own speed
  factor `s` scaling the MXU, VPU and HBM rates.
* A collective is a rendezvous of its replica group: it starts when every member has reached it
  (its dependencies are done on that chip), each member then moves its bytes on its own links
  and HBM, and the collective ends for all members when the last member's part has drained. So
  a late chip delays its group, and the delay travels through later collectives.
* A replica group whose routes use a degraded link gets its own cost from `simulate_collective`
  with that link (link by link); the group's extra time is a fixed latency on top of the
  healthy links' drain (documented approximation under contention).

Equivalence classes: chips whose whole step is identical are simulated once. The partition
starts from what a chip *is* (speed, program, per-op work scales, the cost of each of its
groups) and is refined to a fixed point by the classes present in each of its replica groups
(two chips stay together only if, for every collective, their groups hold the same classes).
Within a class every chip sees the same events at the same times, so one representative
stands for the class. `mode="per-chip"` skips the partition (one actor per chip, each with
its own links): the brute-force oracle the tests compare against. With nothing perturbed there
is exactly one class and the arithmetic is `replay`'s, so the result is the same to the last bit.

Interface for per-chip programs and loads (`PerChipConfig`): `programs` + `program_of_chip` give
chips different programs (pipeline stages); the chips of one replica group must run programs that
agree on that collective's op id, kind, axes and bytes (collectives rendezvous by op id), while
chips that never share a group may run unrelated programs. `p2p` adds point-to-point transfers
between chips (pipeline stage-to-stage sends): a send op runs on its sender's links as soon as its
dependencies are done, and the matching receive op on the peer chip completes when it has
arrived. `op_scale` multiplies the FLOPs and HBM bytes of chosen compute ops per chip (MoE
expert loads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.collective_sim import collective_link_loads
from sim.engine import (
    CHIP_COLUMNS,
    CollectiveCost,
    StepResult,
    _summarize,
    collective_groups,
    cost_pairs,
    op_collective_cost,
    op_group_axes,
    padded_collective_bytes,
    static_hbm_bytes,
)
from sim.hardware import ChipSpec
from sim.network import Batch, SmallFluidNetwork
from sim.routing import link_model
from topologies.errors import TpusimError
from topologies.groups import CLASS_NAMES, NUM_CLASSES, GroupAxis, GroupGeometry
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology
from workloads.trace import OpKind, Trace, Unit

MODES = ("auto", "per-chip")
# Every class replays the whole program with its own SimPy events and arrays (~0.9 KB per op,
# measured on 64 classes of LLaMA-3-70B): refuse runs beyond ~2 GB rather than exhaust a
# shared machine.
MAX_CLASS_OPS = 2_500_000
# From this many classes on (and beyond MAX_CLASS_OPS) `auto` runs vector classes: the same
# result (tests/test_vector_engine.py), ~9x less CPU at 64 classes of LLaMA-3-70B (2.9 s vs
# 26 s), while a few classes replay faster as SimPy actors.
VECTOR_MIN_CLASSES = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class PointToPoint:
    """Point-to-point transfers between chips (pipeline stage-to-stage sends).

    Attributes:
        peer_of_chip: per channel, the chip every chip sends to on that channel (-1: none).
        sends: per program, {send op id: (channel, tag)}: the op (a collective of kind `send`
            in the program, its `bytes` the message) goes to the peer on `channel`.
        recvs: per program, {tag: receive op id}: the op completes when the send with that tag
            from the chip whose peer this chip is has arrived. Receive ops take no resources.
    """

    peer_of_chip: tuple[np.ndarray, ...]
    sends: tuple[Mapping[int, tuple[int, int]], ...]
    recvs: tuple[Mapping[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PerChipConfig:
    """What differs between chips in one step (all optional; the default is the healthy pod).

    Attributes:
        speed: per-chip factor on MXU, VPU and HBM rates (`num_chips` floats > 0; > 1 = faster).
        link_factors: {link id: bandwidth factor > 0} of degraded (or faster) links.
        programs: alternative programs; chip i runs `programs[program_of_chip[i]]` (default: the
            trace given to `simulate_chips` for every chip). They must have the same op ids for
            collectives, over the same mesh axes.
        program_of_chip: index into `programs` per chip.
        op_scale: {op id: per-chip factor} on the FLOPs and HBM bytes of that compute op, or on
            the bytes a chip moves in that collective (MoE all-to-alls: each chip its own
            volume; the collective still ends when its last member has drained).
        dead_links: link ids that carry nothing: collectives over their axis detour around them
            (`simulate_collective`'s rerouting, every group at once).
        mode: `auto` (equivalence classes) or `per-chip` (brute force, one actor per chip).
        p2p: point-to-point transfers between the chips' programs (`PointToPoint`).
        vector: in `auto` mode, True runs the classes as vector classes (`sim.vector_engine`),
            False as one SimPy actor each; None (default) picks vectors from VECTOR_MIN_CLASSES
            classes per program on, or when the classes would replay more than MAX_CLASS_OPS
            ops. Vectors take several programs (pipeline stages) and `p2p` sends when every
            replica group lies within one program and sends go to chips of another program.
    """

    speed: np.ndarray | None = None
    link_factors: Mapping[int, float] = field(default_factory=dict)
    programs: tuple[Trace, ...] = ()
    program_of_chip: np.ndarray | None = None
    op_scale: Mapping[int, np.ndarray] = field(default_factory=dict)
    dead_links: tuple[int, ...] = ()
    mode: str = "auto"
    p2p: PointToPoint | None = None
    vector: bool | None = None


def _coords_text(topology: Topology, chip: int) -> str:
    per = topology.chips_per_slice
    c = [int(v) for v in topology.all_coords()[chip % per]]
    if topology.num_slices > 1:
        c.append(chip // per)
    return ",".join(map(str, c))


def _relabel(cols: list[np.ndarray]) -> np.ndarray:
    """Dense labels of the distinct rows of `cols`, numbered by first chip (deterministic)."""
    stacked = np.stack([np.asarray(c, dtype=float) for c in cols], axis=1)
    _u, inv, = np.unique(stacked, axis=0, return_inverse=True)[:2]
    inv = inv.reshape(-1)
    _, first = np.unique(inv, return_index=True)
    order = np.argsort(first, kind="stable")  # label by the first chip that carries it
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inv]


def _group_signatures(group_of_chip: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per chip: an id of the set of labels present in its group."""
    pairs = np.unique(np.stack([group_of_chip, labels], axis=1), axis=0)
    bounds = np.flatnonzero(np.diff(pairs[:, 0])) + 1
    sig_of_group = np.zeros(int(group_of_chip.max()) + 1, dtype=np.int64)
    ids: dict[tuple, int] = {}
    for chunk in np.split(pairs, bounds):
        key = tuple(chunk[:, 1].tolist())
        sig_of_group[chunk[0, 0]] = ids.setdefault(key, len(ids))
    return sig_of_group[group_of_chip]


def chip_classes(base: list[np.ndarray], geometries: list[np.ndarray],
                 neighbours: list[np.ndarray] = ()) -> np.ndarray:
    """Partition refinement to a fixed point.

    Args:
        base: per-chip features that must be equal within a class (speed, program, costs).
        geometries: per replica-group structure, the group index of every chip.
        neighbours: per point-to-point relation, the chip each chip is paired with (-1: none);
            chips of one class must have neighbours of one class.

    Returns:
        the class of every chip (0 = the class of chip 0, numbered by first chip).
    """
    labels = _relabel(base)
    while True:
        cols = [labels] + [_group_signatures(g, labels) for g in geometries]
        cols += [np.where(nb >= 0, labels[np.maximum(nb, 0)], -1) for nb in neighbours]
        new = _relabel(cols)
        if new.max() == labels.max():  # refinement only splits: same count = fixed point
            return new
        labels = new


def _slow_group_costs(chip, topology, kind, gaxes, nbytes, algorithm, slow, base, geo,
                      dead=()):
    """Cost index of every group and the distinct costs, for a collective with slow or dead
    links on its axes.

    `collective_link_loads` simulates the touched groups link by link (a slow link's group; a
    dead link's group and the groups that carry its detours); the others keep the healthy cost
    (a time within float noise, 1e-12 relative, of the healthy one counts as healthy).
    """
    from topologies.scenario import DeadLink, Scenario, SlowLink

    v = padded_collective_bytes(kind, gaxes, nbytes)
    # The compiler picks the algorithm for the healthy pod (it does not know a link is slow):
    # keep `auto`'s choice and cost it with the degraded link.
    algo = base.algorithm
    if algo.startswith("auto (") and algo.endswith(")"):
        algo = algo[len("auto ("):-1]
    lm = link_model(chip, topology, {})
    drain = float(np.max(base.class_bytes / lm.class_capacity_bytes_per_s, initial=0.0))

    def coords(lk):
        return tuple(int(c) for c in topology.coords(lk // (2 * topology.ndim)))

    scenario = Scenario(
        slow_links=tuple(SlowLink(coords=coords(lk), axisdir=_axisdir(topology, lk), factor=f)
                         for lk, f in sorted(slow.items())),
        dead_links=tuple(DeadLink(coords=coords(lk), axisdir=_axisdir(topology, lk))
                         for lk in dead),
    )
    try:
        loads = collective_link_loads(chip=chip, topology=topology, op=kind, gaxes=gaxes,
                                      nbytes=v, algorithm=algo, scenario=scenario)
        times = loads.time_s_per_group
    except TpusimError:
        if dead:
            raise
        # Too big to route link by link (e.g. all-pairs on thousands of chips): the affected
        # groups drain their busiest link of each degraded class at the degraded rate.
        f = np.ones(NUM_CLASSES)
        for link, x in slow.items():
            c = link % (2 * topology.ndim)
            f[c] = min(f[c], x)
        t = base.latency_s + float(np.max(base.class_bytes / (lm.class_capacity_bytes_per_s * f),
                                          initial=0.0))
        touched = {int(geo.group_of_chip[link // (2 * topology.ndim)]) for link in slow}
        if not geo.disjoint:
            touched = set(range(geo.num_groups))
        times = np.full(geo.num_groups, base.time_s)
        times[sorted(touched)] = t
    costs = [base]
    index = np.zeros(geo.num_groups, dtype=np.int64)
    by_time: dict[float, int] = {}
    for g, t in enumerate(times.tolist()):
        if abs(t - base.time_s) <= 1e-12 * base.time_s:
            continue
        if t not in by_time:
            by_time[t] = len(costs)
            costs.append(CollectiveCost(
                time_s=t, latency_s=max(t - drain, 0.0), class_bytes=base.class_bytes,
                group_size=base.group_size, algorithm=base.algorithm, hbm_bytes=base.hbm_bytes,
            ))
        index[g] = by_time[t]
    return index, costs


def simulate_chips(
    trace: Trace,
    chip: ChipSpec,
    topology: Topology,
    *,
    config: PerChipConfig | None = None,
    algorithm: str = "auto",
    overlap: bool | None = None,
) -> StepResult:
    """Replay `trace` on every chip of `topology` (see the module docstring).

    Returns the `StepResult` of the chip that finishes last (ops, units, links, memory,
    breakdown), with the per-chip table (`result.chips`), `slowest_chip`, `critical_path` and
    `num_chip_classes` filled in.
    """
    cfg = config or PerChipConfig()
    if cfg.mode not in MODES:
        raise TpusimError(f"--mode {cfg.mode!r} must be one of {', '.join(MODES)}")
    nchips = topology.num_chips
    speed = np.ones(nchips) if cfg.speed is None else np.asarray(cfg.speed, dtype=float)
    if speed.shape != (nchips,) or not np.all(np.isfinite(speed)) or np.any(speed <= 0):
        raise TpusimError(
            f"chip speed factors must be {nchips} finite numbers > 0 (one per chip of "
            f"{topology.name}); got shape {speed.shape}, min {float(np.min(speed, initial=0))}"
        )
    programs = cfg.programs or (trace,)
    prog_of = (np.zeros(nchips, dtype=np.int64) if cfg.program_of_chip is None
               else np.asarray(cfg.program_of_chip, dtype=np.int64))
    _check_programs(programs, prog_of, nchips)
    used_programs = sorted(set(prog_of.tolist()))
    p2p = cfg.p2p
    p2p_ops: set[tuple[int, int]] = set()  # (program, op id) of sends and receives
    if p2p is not None:
        _check_p2p(p2p, programs, nchips)
        for pi in used_programs:
            p2p_ops |= {(pi, i) for i in p2p.sends[pi]}
            p2p_ops |= {(pi, i) for i in p2p.recvs[pi].values()}
    slow = {int(k): float(v) for k, v in cfg.link_factors.items() if float(v) != 1.0}
    for link, f in slow.items():
        if not (np.isfinite(f) and f > 0) or not 0 <= link < topology.num_links:
            raise TpusimError(f"link factor {f!r} of link {link} must be a finite number > 0")
    if overlap is None:
        overlap = bool(trace.meta.get("overlap", True))

    # -- collectives: groups, healthy costs, per-group costs under degraded links -----------
    # Keyed by (program, op id): programs of chips that never share a group may differ.
    groups = collective_groups(trace, topology)
    groups_of_mesh: dict[object, dict] = {trace.mesh: groups}
    dev_groups: dict[int, tuple] = {}
    geoms: dict[tuple[GroupAxis, ...], GroupGeometry] = {}
    op_geom: dict[tuple[int, int], tuple[GroupAxis, ...]] = {}
    op_key: dict[tuple[int, int], tuple] = {}
    base_costs: dict[tuple, CollectiveCost] = {}
    group_cost: dict[tuple, tuple[np.ndarray, list[CollectiveCost]]] = {}
    key_geom: dict[tuple, tuple[GroupAxis, ...]] = {}
    # Under `stop_when_hbm_exceeds(prefix=...)` only the prefix's ops run. A collective outside
    # the prefix is not costed and gets no actor, but its geometry and, where degraded links
    # touch it, its per-group costs are found as the full run finds them: they shape the chip
    # classes, which are therefore the full run's, so the watch applies to the prefix exactly
    # when it applies to the full run (a late collective on a slow link splits a program's
    # chips into several classes: the full run is not watched, and neither is its prefix).
    watch = _HBM_WATCH[-1] if _HBM_WATCH else None
    prefix_ops = watch.prefix_ops if watch is not None else None
    for pi in used_programs:
        prog = programs[pi]
        if prog.mesh not in groups_of_mesh:
            groups_of_mesh[prog.mesh] = collective_groups(prog, topology)
        pgroups = groups_of_mesh[prog.mesh]
        # A step repeats each (kind, axes, bytes) many times (every layer, every microbatch of
        # a pipeline stage): its group axes and cost key are found once per program.
        seen: dict[tuple, tuple] = {}
        for op in prog.ops:
            if op.kind != OpKind.COLLECTIVE or (pi, op.id) in p2p_ops:
                continue
            outside = prefix_ops is not None and op.id not in prefix_ops[pi]
            # Explicit device groups (HLO import) may be chip pairs (a permute; its chips
            # rendezvous with the others along the axes it uses, and degraded links do not slow
            # it in this version).
            sk = (op.collective, op.mesh_axes, op.bytes, op.group)
            hit = seen.get(sk)
            if hit is None:
                hit = seen[sk] = op_group_axes(topology, prog, op, pgroups, dev_groups)
            gaxes, key = hit
            pairs = len(key) == 4
            geo_axes = gaxes[:1] if op.collective == "collective-permute" and not pairs else gaxes
            if geo_axes not in geoms:
                geoms[geo_axes] = GroupGeometry(topology, geo_axes)
            key_geom[key] = geo_axes
            if not outside:
                op_geom[(pi, op.id)] = geo_axes
                op_key[(pi, op.id)] = key
            if key in group_cost:
                continue
            names = {g.physical_name for g in geo_axes}
            rel = {lk: f for lk, f in slow.items() if _link_axis(topology, lk) in names}
            rel_dead = tuple(lk for lk in cfg.dead_links if _link_axis(topology, lk) in names)
            if outside and not (rel or rel_dead):
                continue  # one cost for every group: no column of the classes
            if key not in base_costs:
                op_collective_cost(chip, topology, prog, op, pgroups, dev_groups, base_costs,
                                   algorithm)
            if pairs and rel_dead:
                raise TpusimError(
                    f"collective {op.name} is a collective-permute between chip pairs (HLO "
                    f"import); dead links are not supported for it in this version; use "
                    f"--slow-link with a small factor instead"
                )
            if pairs and rel:
                group_cost[key] = (np.zeros(geoms[geo_axes].num_groups, dtype=np.int64),
                                   [cost_pairs(chip, topology, dev_groups[op.group][1],
                                               op.bytes, rel)])
            elif rel or rel_dead:
                group_cost[key] = _slow_group_costs(chip, topology, op.collective, geo_axes,
                                                    op.bytes, algorithm, rel,
                                                    base_costs[key], geoms[geo_axes],
                                                    # detours avoid every dead link
                                                    tuple(cfg.dead_links) if rel_dead
                                                    else ())
            else:
                group_cost[key] = (np.zeros(geoms[geo_axes].num_groups, dtype=np.int64),
                                   [base_costs[key]])
    if len(used_programs) > 1:
        _check_rendezvous(programs, prog_of, op_geom, op_key, geoms)

    # -- point-to-point sends: every chip's message on its own route --------------------------
    send_cost_of: dict[tuple[int, int], np.ndarray] = {}  # (program, op id) -> per chip index
    p2p_costs: list[CollectiveCost] = []
    if p2p is not None:
        send_cost_of, p2p_costs = _p2p_costs(chip, topology, p2p, programs, prog_of,
                                             used_programs, slow, tuple(cfg.dead_links))

    # -- equivalence classes ---------------------------------------------------------------
    geo_list = list(geoms)
    neighbours = [np.asarray(nb, dtype=np.int64) for nb in p2p.peer_of_chip] if p2p else []
    if neighbours:  # the inverse relations too: who sends to each chip
        for nb in list(neighbours):
            inv = np.full(nchips, -1, dtype=np.int64)
            ok = nb >= 0
            inv[nb[ok]] = np.flatnonzero(ok)
            neighbours.append(inv)
    if cfg.mode == "per-chip":
        label = np.arange(nchips)
    else:
        base_cols = [speed, prog_of.astype(float)]
        for op_id in sorted(cfg.op_scale):
            base_cols.append(np.asarray(cfg.op_scale[op_id], dtype=float))
        for key, (index, costs) in group_cost.items():
            if len(costs) > 1:
                base_cols.append(index[geoms[key_geom[key]].group_of_chip].astype(float))
        for sk in sorted(send_cost_of):
            base_cols.append(send_cost_of[sk].astype(float))
        label = chip_classes(base_cols, [geoms[g].group_of_chip for g in geo_list], neighbours)
    ncls = int(label.max()) + 1
    rep = np.zeros(ncls, dtype=np.int64)
    _, first = np.unique(label, return_index=True)
    rep[:] = first
    class_ops = sum(len(programs[int(prog_of[r])].ops) for r in rep.tolist())
    lm = link_model(chip, topology, {})
    vectors_apply = _vectors_apply(p2p, prog_of, used_programs, op_geom, geoms)
    # Vectors pay where many classes share a program: from VECTOR_MIN_CLASSES per program.
    use_vectors = cfg.mode != "per-chip" and vectors_apply and (
        cfg.vector if cfg.vector is not None
        else class_ops > MAX_CLASS_OPS or ncls >= VECTOR_MIN_CLASSES * len(used_programs))
    if use_vectors and prefix_ops is not None:
        watch.prefix_ended = True  # no prefix runs on vector classes
        raise HbmPrefixEnded("the HBM watch's prefix does not apply to vector classes")
    if use_vectors:
        from sim.vector_engine import simulate_vectors

        res, sc_costs, pi = simulate_vectors(
            programs=programs, prog_of=prog_of, speed=speed, op_scale=cfg.op_scale, chip=chip,
            topology=topology, overlap=overlap, op_geom=op_geom, op_key=op_key,
            geoms=geoms, group_cost=group_cost, base_costs=base_costs, lm=lm, label=label,
            slow=slow, dead_links=tuple(cfg.dead_links), p2p=p2p, send_cost_of=send_cost_of,
            p2p_costs=p2p_costs)
        _common_fields(res, topology, {i: op_key[(p, i)][1] for p, i in op_geom if p == pi},
                       sc_costs, lm, slow, cfg.dead_links)
        return res
    if class_ops > MAX_CLASS_OPS:
        how = ("use --mode auto (vector classes, the same result)" if vectors_apply
               else "vector classes do not take replica groups shared by several programs, "
                    "nor sends between chips of one program, in this version, so perturb "
                    "fewer chips (e.g. --slow-chip instead of --chip-variation)")
        raise TpusimError(
            f"the per-chip engine would replay {ncls} chip classes x {class_ops // ncls} ops = "
            f"{class_ops:,} class-ops (limit {MAX_CLASS_OPS:,}, about 0.9 KB each in memory) "
            f"with one SimPy actor per class; {how}, or use a smaller pod"
        )
    count = np.bincount(label, minlength=ncls)
    # Classes present in every group of every geometry (rendezvous partners).
    partners: dict[tuple, list[tuple[int, ...]]] = {}
    for g in geo_list:
        goc = geoms[g].group_of_chip
        pairs = np.unique(np.stack([goc, label], axis=1), axis=0)
        sets: dict[int, list[int]] = {}
        for grp, c in pairs.tolist():
            sets.setdefault(grp, []).append(c)
        partners[g] = [tuple(sets[int(goc[rep[c]])]) for c in range(ncls)]

    # -- cost every op of every class before env.run() --------------------------------------
    hbm_bw0 = chip.hbm_bytes_per_s * chip.hbm_efficiency
    mxu_rate0 = chip.mxu_flops_per_s * chip.mxu_efficiency
    int8_rate0 = chip.mxu_int8_ops_per_s * chip.mxu_efficiency
    vpu_rate0 = chip.vpu_flops_per_s * chip.vpu_efficiency
    hbm_idx = NUM_CLASSES
    env = simpy.Environment()
    classes = []
    batches: dict[int, Batch] = {}
    scaled: dict = {}

    def batch_of(cc: CollectiveCost) -> Batch:
        b = batches.get(id(cc))
        if b is None:  # one Batch per distinct cost, shared by every class and op
            used = np.flatnonzero(cc.class_bytes > 0)
            # A zero-byte hop would still pace the batch at that resource's fair share.
            hbm = [hbm_idx] if cc.hbm_bytes > 0 or len(used) == 0 else []
            b = batches[id(cc)] = Batch(
                res=np.append(used, hbm).astype(np.int64),
                ptr=np.arange(len(used) + len(hbm) + 1, dtype=np.int64),
                bytes_per_transfer=np.append(cc.class_bytes[used], [cc.hbm_bytes] * len(hbm)),
                latency_s=cc.latency_s,
            )
        return b

    for c in range(ncls):
        r = int(rep[c])
        s = float(speed[r])
        pi = int(prog_of[r])
        ops = programs[pi].ops
        scale = {op_id: float(np.asarray(v)[r]) for op_id, v in cfg.op_scale.items()}
        cl = _ClassState(c=c, rep=r, speed=s, ops=ops, n=len(ops))
        cl.prog = pi
        cl.hbm_bw = hbm_bw0 * s
        cl.mxu_rate = mxu_rate0 * s
        cl.vpu_rate = vpu_rate0 * s
        int8_rate = int8_rate0 * s
        sends = p2p.sends[pi] if p2p is not None else {}
        recv_ids = set(p2p.recvs[pi].values()) if p2p is not None else set()
        # Under a prefix only its ops run: the others are not costed (nor given done events
        # of their own below).
        keep = None if prefix_ops is None else prefix_ops[pi]
        for op in (ops if keep is None else [ops[i] for i in sorted(keep)]):
            if op.kind == OpKind.COMPUTE:
                k = scale.get(op.id, 1.0)
                flops = op.flops * k
                hbm_bytes = op.hbm_bytes * k
                rate = (int8_rate if op.dtype == "int8" else cl.mxu_rate) \
                    * chip.mxu_fill(op.narrow_dim) if op.unit == Unit.MXU else cl.vpu_rate
                t_c = flops / rate
                cl.t_compute[op.id] = t_c
                cl.hbm_bytes[op.id] = hbm_bytes
                t_m = hbm_bytes / cl.hbm_bw
                if t_c >= t_m:
                    cl.bound[op.id] = "mxu" if op.unit == Unit.MXU else "vpu"
                else:
                    cl.bound[op.id] = "hbm"
                cl.dur[op.id] = max(t_c, t_m) + chip.op_overhead_s
                if op.unit == Unit.MXU:
                    cl.mxu_busy += flops / (cl.mxu_rate * chip.mxu_fill(op.narrow_dim))
                else:
                    cl.vpu_busy += flops / cl.vpu_rate
            elif op.id in sends:
                cc = p2p_costs[int(send_cost_of[(pi, op.id)][r])]
                cl.send_cost[op.id] = cc
                cl.dur[op.id] = cc.time_s
                cl.bound[op.id] = "ici"
                cl.batch[op.id] = batch_of(cc)
            elif op.id in recv_ids:
                cl.bound[op.id] = "idle"
            elif op.kind == OpKind.COLLECTIVE:
                if (pi, op.id) not in op_geom:
                    continue  # outside the prefix: never runs
                ga = op_geom[(pi, op.id)]
                grp = int(geoms[ga].group_of_chip[r])
                index, costs = group_cost[op_key[(pi, op.id)]]
                cc = scaled_cost(costs[int(index[grp])], scale.get(op.id, 1.0), scaled)
                cl.coll_cost[op.id] = cc
                cl.partners[op.id] = partners[ga][c]
                cl.dur[op.id] = cc.time_s
                cl.bound[op.id] = "ici"
                cl.batch[op.id] = batch_of(cc)
            elif op.kind == OpKind.HOST:
                cl.dur[op.id] = op.bytes / chip.pcie_bytes_per_s
                cl.bound[op.id] = "pcie"
            else:
                cl.dur[op.id] = op.duration_s
                cl.bound[op.id] = "idle"
        cl.net = SmallFluidNetwork(env, np.append(lm.class_capacity_bytes_per_s, cl.hbm_bw))
        cl.pcie = simpy.Resource(env, capacity=1)
        if keep is None:
            cl.done = [env.event() for _ in range(len(ops))]
        else:  # an op outside the prefix never ends: one event, never triggered, for all
            never = env.event()
            cl.done = [env.event() if i in keep else never for i in range(len(ops))]
        classes.append(cl)
    multi = ncls > 1
    if multi:
        for cl in classes:
            cl.arrived = {i: env.event() for i in cl.coll_cost}
            cl.drained = {i: env.event() for i in cl.coll_cost}
    if p2p is not None:  # each send completes one receive op of its peer's class
        for cl in classes:
            for op_id, (ch, tag) in p2p.sends[cl.prog].items():
                peer = int(p2p.peer_of_chip[ch][cl.rep])
                q = classes[int(label[peer])] if peer >= 0 else None
                if q is None or tag not in p2p.recvs[q.prog]:
                    raise no_receiver_error(topology, cl.prog, cl.ops[op_id], cl.rep, tag, ch)
                rid = p2p.recvs[q.prog][tag]
                if rid in q.recv_from:
                    raise two_sends_error(q.prog, q.ops[rid])
                cl.send_to[op_id] = (q.c, rid)
                q.recv_from[rid] = (cl.c, op_id)

    # -- replay -----------------------------------------------------------------------------
    def all_of(evs):
        """`env.all_of(evs)` for events not processed yet, without SimPy's `Condition`: an
        event that succeeds from the callback of the last of them to be processed, the very
        point where the condition would succeed (so the event order is the same), at a
        fraction of the cost (a step waits on ~3k of them)."""
        joined = env.event()
        left = [len(evs)]

        def check(_ev):
            left[0] -= 1
            if not left[0]:
                joined.succeed()

        for ev in evs:
            ev.callbacks.append(check)
        return joined

    def wait_deps(cl, op):
        evs = [cl.done[d] for d in op.deps if not cl.done[d].processed]
        if evs:
            yield all_of(evs)

    def run_collective(cl, op):
        yield from wait_deps(cl, op)
        ps = cl.partners[op.id]
        if multi and len(ps) > 1:
            cl.arrive_t[op.id] = env.now
            cl.arrived[op.id].succeed()
            evs = [classes[p].arrived[op.id] for p in ps if not classes[p].arrived[op.id].processed]
            if evs:
                yield all_of(evs)
            cl.waits.append((cl.arrive_t[op.id], env.now))
        cl.start[op.id] = env.now
        yield cl.net.transfer(cl.batch[op.id])
        if multi and len(ps) > 1:
            t_own = env.now
            cl.drained[op.id].succeed()
            evs = [classes[p].drained[op.id] for p in ps if not classes[p].drained[op.id].processed]
            if evs:
                yield all_of(evs)
            cl.waits.append((t_own, env.now))
            cl.drain_t[op.id] = t_own
        cl.end[op.id] = env.now
        cl.done[op.id].succeed()

    def run_send(cl, op):
        # A point-to-point send: the sender's links and HBM, then the peer's receive completes.
        yield from wait_deps(cl, op)
        cl.start[op.id] = env.now
        yield cl.net.transfer(cl.batch[op.id])
        cl.end[op.id] = env.now
        cl.done[op.id].succeed()
        q, rid = cl.send_to[op.id]
        q = classes[q]
        q.start[rid] = cl.start[op.id]  # the message is on its way from the send's start
        q.end[rid] = env.now
        q.done[rid].succeed()

    def run_async(cl, op, resource):
        yield from wait_deps(cl, op)
        with resource.request() as req:
            yield req
            cl.start[op.id] = env.now
            yield env.timeout(cl.dur[op.id])
        cl.end[op.id] = env.now
        cl.done[op.id].succeed()

    def core(cl):
        for op in cl.ops:
            if op.kind == OpKind.HOST or (op.kind == OpKind.COLLECTIVE and overlap) or \
                    op.id in cl.recv_from:
                continue
            yield from wait_deps(cl, op)
            if op.id in cl.send_to:  # --no-overlap: sends block the core too
                yield env.process(run_send(cl, op))
                continue
            if op.kind == OpKind.COLLECTIVE:  # --no-overlap: collectives block the core
                yield env.process(run_collective(cl, op))
                continue
            if op.kind == OpKind.IDLE:
                cl.start[op.id] = env.now
                yield env.timeout(cl.dur[op.id])
                cl.end[op.id] = env.now
                cl.done[op.id].succeed()
                continue
            # The MXU/VPU: only this core uses them and it runs one op at a time, so a request
            # is always granted at once. An event that has succeeded stands for the grant (it
            # is scheduled and resumes the core exactly as a `simpy.Resource` request would;
            # the release event that follows has no effect on anything, so it is left out).
            yield env.event().succeed()
            cl.start[op.id] = env.now
            hb = cl.hbm_bytes[op.id]
            if hb > 0:
                t_c = cl.t_compute[op.id]
                yield cl.net.transfer_one(hbm_idx, hb, chip.op_overhead_s,
                                          1.0 / t_c if t_c > 0 else float("inf"))
            else:
                yield env.timeout(cl.dur[op.id])
            cl.end[op.id] = env.now
            cl.done[op.id].succeed()

    watching = watch is not None and ncls == len(used_programs)
    if watch is not None and watch.prefix_ops is not None:
        if not watching:  # the watch does not apply: no verdict from a prefix
            watch.prefix_ended = True
            raise HbmPrefixEnded("the HBM watch does not apply to this step")
        # Only the prefix's ops get actors: `stop_when_hbm_exceeds(prefix=...)` guarantees
        # that no other op starts before the horizon (nor is a receive completed before it).
        for cl in classes:
            keep = watch.prefix_ops[cl.prog]
            cl.ops = tuple(op for op in cl.ops if op.id in keep)
    for cl in classes:
        for op in cl.ops:
            if op.id in cl.recv_from:
                continue  # completed by the peer's send
            if op.id in cl.send_to:
                if overlap:
                    env.process(run_send(cl, op))
            elif op.kind == OpKind.COLLECTIVE and overlap:
                env.process(run_collective(cl, op))
            elif op.kind == OpKind.HOST:
                env.process(run_async(cl, op, cl.pcie))
        env.process(core(cl))
    if watching:
        _run_watching_hbm(env, classes, programs, watch)
    else:
        env.run()
    for cl in classes:
        stuck = [cl.ops[i].name for i, e in enumerate(cl.done) if not e.processed]
        if stuck:  # pragma: no cover - guarded by Trace validation and _check_programs
            raise TpusimError(f"internal error: {len(stuck)} ops never ran, e.g. {stuck[:3]}")

    # -- results ----------------------------------------------------------------------------
    finish = np.array([float(cl.end.max(initial=0.0)) for cl in classes])
    slowest = int(np.argmax(finish))  # first class among equals: the one holding chip 0 first
    sc = classes[slowest]
    prog_trace = programs[int(prog_of[sc.rep])]
    res = _summarize(prog_trace, chip, topology, sc.dur, sc.bound, sc.start, sc.end, sc.net,
                     base_costs, lm, sc.mxu_rate, sc.vpu_rate, sc.hbm_bw)
    if sc.rep != 0:
        res._ops = [(sc.rep,) + row[1:] for row in res._ops]
        res._units = [(sc.rep,) + row[1:] for row in res._units]
        res._memory = [(sc.rep,) + row[1:] for row in res._memory]
    if multi:
        res.sim_events = sum(cl.net.num_events for cl in classes) + class_ops
    _common_fields(res, topology, {i: op_key[(p, i)][1] for p, i in op_geom if p == sc.prog},
                   {**sc.coll_cost, **sc.send_cost}, lm, slow, cfg.dead_links)
    res.num_chip_classes = ncls
    res.slowest_chip = _coords_text(topology, sc.rep)
    res._chip_class = label
    res._class_rows = [
        (float(finish[cl.c]), cl.mxu_busy, cl.vpu_busy,
         float(cl.net.bytes[hbm_idx]) / cl.hbm_bw,
         float(sum(cl.dur[o.id] for o in cl.ops if o.kind == OpKind.HOST)),
         float(wait_wall_time(np.array([[w[0] for w in cl.waits]]),
                              np.array([[w[1] for w in cl.waits]]))[0]))
        for cl in classes
    ]
    res._class_reps = rep
    res._class_counts = count
    # Per link: the bytes the class of its source chip put on that link class.
    res._link_bytes = _per_link_bytes(topology, label, classes)
    for lk in cfg.dead_links:  # a dead link carries nothing (its detour's bytes stay elsewhere)
        res._link_bytes[lk] = 0.0
    res.critical_path = _critical_path(classes, slowest, topology, slow, op_key, group_cost,
                                       count, cfg.dead_links)
    res._class_timelines = {cl.c: (cl.start, cl.end) for cl in classes}
    res._mem_trace = prog_trace
    if p2p is not None:
        res._p2p = (p2p, {cl.c: cl.prog for cl in classes})
    if len(used_programs) > 1:  # each class's own program and its collectives' links
        res._class_programs = {cl.c: (programs[cl.prog], cl.bound,
                                      *_coll_labels({**cl.coll_cost, **cl.send_cost}))
                               for cl in classes}
    return res


class HbmOverCapacity(TpusimError):
    """Raised inside `simulate_chips` under `stop_when_hbm_exceeds` (caught by the caller)."""


class HbmPrefixEnded(TpusimError):
    """Raised inside `simulate_chips` under `stop_when_hbm_exceeds(prefix=...)` when the prefix
    reached its horizon (or the watch does not apply) without going over: no verdict, the step
    has to run in full (caught by the caller)."""


@dataclass(kw_only=True)
class HbmWatch:
    """`stop_when_hbm_exceeds`'s verdict: whether the step was stopped, the HBM level (bytes) of
    the chip class that went over and when (s); with a prefix, whether it ended undecided."""

    capacity_bytes: float
    prefix_ops: tuple[frozenset[int], ...] | None = None
    horizon_s: float = math.inf
    exceeded: bool = False
    level_bytes: float = 0.0
    time_s: float = math.nan
    prefix_ended: bool = False
    reached_horizon: bool = False  # the prefix ended at its horizon (a longer one may decide)


_HBM_WATCH: list[HbmWatch] = []


@contextmanager
def stop_when_hbm_exceeds(capacity_bytes: float,
                          prefix: tuple[tuple[frozenset[int], ...], float] | None = None):
    """Within the block, `simulate_chips` stops a step as soon as a chip's HBM level is over
    `capacity_bytes` (a relative 1e-9 over, for summation order) and raises `HbmOverCapacity`
    (the yielded `HbmWatch` says so): the step is out of memory whatever happens later, and
    `plan` does not need its time. The level is `sim.engine.hbm_occupancy`'s: memory events
    applied at their op's end, checked when simulated time moves on (every op that ended at
    that instant applied), which is the level of a row of the step's memory table, so never
    above its peak. Only where every chip class is the one class of its program (a healthy
    step, a pipeline's stages), so that each class's peak is a reported peak; otherwise the
    step runs to the end as usual. Used by one thread at a time (plan's worker processes).

    `prefix=(op ids per program, horizon s)`: the caller guarantees that no other op starts
    (or, a receive, completes) before the horizon (`sim.planner.hbm_prefix`, from the
    uncontended schedule, a lower bound of every op's start). Only those ops are costed and
    given actors (a 405B pipeline stage program holds ~26k ops; those that can start within
    its first 5 s are 6-11% of them); the chip classes are the full run's (the collectives
    outside the prefix are placed, and on degraded links costed per group, for them), so the
    watch applies to the prefix exactly when it applies to the full step, and up to the
    horizon the run is the full step's, event for event: the same ops are active at the same
    times, the others still wait for their dependencies. A level over capacity before the
    horizon is therefore the full run's verdict (the same instant and level); reaching the
    horizon (or the prefix's end, or a step the watch does not apply to) raises
    `HbmPrefixEnded` with `prefix_ended` set: the step has to run in full."""
    watch = HbmWatch(capacity_bytes=float(capacity_bytes))
    if prefix is not None:
        watch.prefix_ops = tuple(frozenset(ids) for ids in prefix[0])
        watch.horizon_s = float(prefix[1])
    _HBM_WATCH.append(watch)
    try:
        yield watch
    finally:
        _HBM_WATCH.pop()


def _run_watching_hbm(env, classes, programs, watch: HbmWatch) -> None:
    """`env.run()`, stopped (HbmOverCapacity) when a class's HBM level goes over capacity.
    Appending a callback to an op's done event changes no event's order or time."""
    levels: list[float] = []
    for cl in classes:
        meta = programs[cl.prog].meta
        levels.append(static_hbm_bytes(meta))
        delta: dict[int, float] = {}
        for ev in meta.get("memory_events") or ():
            delta[int(ev[0])] = delta.get(int(ev[0]), 0.0) + float(ev[2])
        for op_id, d in delta.items():
            if 0 <= op_id < len(cl.done):
                def add(_ev, c=cl.c, d=d):
                    levels[c] += d
                cl.done[op_id].callbacks.append(add)
    limit = watch.capacity_bytes * (1 + 1e-9)
    prefix = watch.prefix_ops is not None
    now = env.now
    while True:
        t = env.peek()
        if t == float("inf") and not prefix:
            return
        if t > now:  # every event at `now` processed: each class's level is a table row
            # (with a prefix, the full step's next event is at the horizon or later)
            if max(levels) > limit:
                watch.exceeded, watch.level_bytes, watch.time_s = True, max(levels), now
                raise HbmOverCapacity(
                    f"HBM level {max(levels) / 1e9:.1f} GB over the capacity "
                    f"{watch.capacity_bytes / 1e9:.1f} GB at {now:.6g} s: out of memory")
            if prefix and t >= watch.horizon_s:
                watch.prefix_ended = watch.reached_horizon = True
                raise HbmPrefixEnded(f"the prefix reached its horizon {watch.horizon_s:.6g} s")
            now = t
        env.step()


def wait_wall_time(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per row, the length of the union of the intervals [lo, hi): a chip's wall time waiting
    in at least one collective (concurrent collectives' waits overlap and count once)."""
    rows = lo.shape[0]
    if lo.shape[1] == 0:
        return np.zeros(rows)
    order = np.argsort(lo, axis=1, kind="stable")
    lo_s = np.take_along_axis(lo, order, axis=1)
    hi_s = np.take_along_axis(hi, order, axis=1)
    covered = np.maximum.accumulate(hi_s, axis=1)
    prev = np.concatenate([np.full((rows, 1), -np.inf), covered[:, :-1]], axis=1)
    return np.maximum(hi_s - np.maximum(lo_s, prev), 0.0).sum(axis=1)


def scaled_cost(cc: CollectiveCost, k: float, memo: dict) -> CollectiveCost:
    """One chip's share of a collective that moves `k` times the compiled bytes (an MoE
    all-to-all of a chip holding a colder expert shard): its links and HBM carry k x the bytes;
    the latency stays. The same object for the same (cost, k) within one `memo` (one run), so
    batches are shared."""
    if k == 1.0:
        return cc
    key = (id(cc), k)
    out = memo.get(key)
    if out is None:
        drain = max(cc.time_s - cc.latency_s, 0.0)
        out = memo[key] = (cc, CollectiveCost(  # holds cc: its id stays unique for the run
            time_s=cc.latency_s + drain * k, latency_s=cc.latency_s,
            class_bytes=cc.class_bytes * k, group_size=cc.group_size, algorithm=cc.algorithm,
            hbm_bytes=cc.hbm_bytes * k))
    return out[1]


def _coll_labels(coll_cost) -> tuple[dict, dict]:
    """({op id: {link class: bytes}}, {op id: algorithm}) of a chip's collectives and sends."""
    return ({i: {CLASS_NAMES[int(j)]: float(cc.class_bytes[j])
                 for j in np.flatnonzero(cc.class_bytes > 0)} for i, cc in coll_cost.items()},
            {i: cc.algorithm for i, cc in coll_cost.items()})


def _common_fields(res, topology, coll_axes, coll_cost, lm, slow, dead) -> None:
    """Result fields both engines fill alike: collective axes, link classes and capacities."""
    res._topology = topology
    res._coll_axes = coll_axes
    res._coll_classes, res._coll_algorithm = _coll_labels(coll_cost)
    res._class_capacity = {CLASS_NAMES[i]: float(lm.class_capacity_bytes_per_s[i])
                           for i in range(NUM_CLASSES)}
    res._link_cap = np.array(np.broadcast_to(lm.capacity_bytes_per_s, (topology.num_links,)),
                             dtype=float)
    for lk, f in slow.items():
        res._link_cap[lk] *= f
    for lk in dead:  # no capacity, as in the collective simulation (the plots mark it dead)
        res._link_cap[lk] = 0.0
    if res._link_bytes is not None:
        for lk in dead:  # a dead link carries nothing (its detour's bytes stay elsewhere)
            res._link_bytes[lk] = 0.0


class _ClassState:
    """One class's representative: costs, SimPy resources, timeline and counters."""

    def __init__(self, *, c: int, rep: int, speed: float, ops, n: int) -> None:
        self.c = c
        self.rep = rep
        self.speed = speed
        self.ops = ops
        self.dur = np.zeros(n)
        self.t_compute = np.zeros(n)
        self.hbm_bytes = np.zeros(n)
        self.bound = [""] * n
        self.start = np.zeros(n)
        self.end = np.zeros(n)
        self.coll_cost: dict[int, CollectiveCost] = {}
        self.partners: dict[int, tuple[int, ...]] = {}
        self.batch: dict[int, Batch] = {}
        self.arrived: dict[int, simpy.Event] = {}
        self.drained: dict[int, simpy.Event] = {}
        self.arrive_t: dict[int, float] = {}
        self.drain_t: dict[int, float] = {}
        self.waits: list[tuple[float, float]] = []  # (from, to) waiting in a rendezvous
        self.prog = 0
        self.send_cost: dict[int, CollectiveCost] = {}
        self.send_to: dict[int, tuple[int, int]] = {}  # send op -> (peer class, receive op)
        self.recv_from: dict[int, tuple[int, int]] = {}  # receive op -> (sender class, send op)
        self.mxu_busy = 0.0
        self.vpu_busy = 0.0


def _vectors_apply(p2p, prog_of, used_programs, op_geom, geoms) -> bool:
    """Whether vector classes can run the step: one program without sends, or several (a
    pipeline's stages) whose replica groups each lie within one program and whose sends go to
    chips of another program (`sim.vector_engine` keys rendezvous by program and op id)."""
    if len(used_programs) == 1 and p2p is None:
        return True
    for ga in set(op_geom.values()):
        goc = geoms[ga].group_of_chip
        pairs = np.unique(np.stack([goc, prog_of], axis=1), axis=0)
        if len(pairs) != len(np.unique(goc)):
            return False
    if p2p is not None:
        for pi in used_programs:
            chips = np.flatnonzero(prog_of == pi)
            for ch in sorted({ch for ch, _tag in p2p.sends[pi].values()}):
                peer = np.asarray(p2p.peer_of_chip[ch], dtype=np.int64)[chips]
                if (prog_of[peer[peer >= 0]] == pi).any():
                    return False
    return True


def no_receiver_error(topology: Topology, prog: int, op, chip: int, tag, channel
                      ) -> TpusimError:
    """A send op with no receive op on its peer (the class and the vector engine alike)."""
    return TpusimError(
        f"send op {op.id} ({op.name}) of program {prog} on chip "
        f"{_coords_text(topology, chip)} has no receiver (tag {tag} on channel {channel}); "
        f"every send needs a matching receive op on its peer")


def two_sends_error(prog: int, op) -> TpusimError:
    """A receive op that two sends complete (the class and the vector engine alike)."""
    return TpusimError(
        f"receive op {op.id} ({op.name}) of program {prog} is the target of two sends; tags "
        f"must be unique per sender and receiver")


def _check_programs(programs, prog_of, nchips) -> None:
    if prog_of.shape != (nchips,) or prog_of.min(initial=0) < 0 or \
            prog_of.max(initial=0) >= len(programs):
        raise TpusimError(
            f"program_of_chip must give every one of the {nchips} chips a program index in "
            f"0..{len(programs) - 1}"
        )


def _check_rendezvous(programs, prog_of, op_geom, op_key, geoms) -> None:
    """Chips of one replica group must run programs that agree on the group's collective (op id,
    kind, axes, bytes): collectives rendezvous by op id."""
    by_geo: dict[tuple, list[tuple[int, int]]] = {}
    for (p, i), g in op_geom.items():
        by_geo.setdefault(g, []).append((p, i))
    for g, keys in by_geo.items():
        goc = geoms[g].group_of_chip
        pairs = np.unique(np.stack([goc, prog_of], axis=1), axis=0)
        mixed: dict[int, list[int]] = {}
        for grp, p in pairs.tolist():
            mixed.setdefault(grp, []).append(p)
        for progs in {tuple(v) for v in mixed.values() if len(v) > 1}:
            for p, i in keys:
                if p not in progs:
                    continue
                for q in progs:
                    if op_key.get((q, i)) != op_key[(p, i)]:
                        raise TpusimError(
                            f"program {q} does not match program {p} at op {i} "
                            f"({programs[p].ops[i].name}), but chips running them share a "
                            f"replica group: per-chip programs need the same op ids for "
                            f"collectives, over the same mesh axes (collectives rendezvous by "
                            f"op id)"
                        )


def _check_p2p(p2p: PointToPoint, programs, nchips: int) -> None:
    if len(p2p.sends) != len(programs) or len(p2p.recvs) != len(programs):
        raise TpusimError(
            f"point-to-point sends and receives must be given for each of the {len(programs)} "
            f"programs"
        )
    for nb in p2p.peer_of_chip:
        nb = np.asarray(nb)
        if nb.shape != (nchips,) or nb.min(initial=0) < -1 or nb.max(initial=0) >= nchips:
            raise TpusimError(
                f"point-to-point peers must name one chip in 0..{nchips - 1} (or -1) per chip"
            )
    for p, prog in enumerate(programs):
        for i, (ch, _tag) in p2p.sends[p].items():
            op = prog.ops[i] if 0 <= i < len(prog.ops) else None
            if op is None or op.kind != OpKind.COLLECTIVE or not 0 <= ch < len(p2p.peer_of_chip):
                raise TpusimError(
                    f"point-to-point send {i} of program {p} must be a collective op of the "
                    f"program on one of the {len(p2p.peer_of_chip)} channels"
                )
        for i in p2p.recvs[p].values():
            if not (0 <= i < len(prog.ops) and prog.ops[i].kind == OpKind.COLLECTIVE):
                raise TpusimError(
                    f"point-to-point receive {i} of program {p} must be a collective op of the "
                    f"program"
                )


def p2p_cost(chip: ChipSpec, topology: Topology, src: int, dst: int, nbytes: float,
             slow: Mapping[int, float], router=None) -> CollectiveCost:
    """One message from chip `src` to chip `dst`: its dimension-order route (`cost_pairs`;
    a slow link on it carries the message at its own speed) or, when that route crosses a dead
    link, the detour ICI rerouting takes (`DetourRouter`), charged to the link classes it uses
    with its own hop latency."""
    import dataclasses

    # The message is charged to links only: in the fluid model's rate-fair sharing a small DMA
    # next to a long HBM-bound op would be stretched to that op's length, which is not how the
    # DMA engines share HBM (docs/model.md "Pipeline schedules").
    if router is None:
        return dataclasses.replace(cost_pairs(chip, topology, [(src, dst)], nbytes, dict(slow)),
                                   hbm_bytes=0.0)
    from topologies.groups import route_pairs_links

    _cls, _hops, per_link = route_pairs_links(topology, [(src, dst)])
    if not any(router.dead_mask[lk] for lk in per_link):
        return dataclasses.replace(cost_pairs(chip, topology, [(src, dst)], nbytes, dict(slow)),
                                   hbm_bytes=0.0)
    from sim.routing import send_batch

    lm = link_model(chip, topology, dict(slow))
    batch, _paths, _hops = send_batch(topology, lm, tuple(topology.coords(src)),
                                      tuple(topology.coords(dst)), nbytes, detour=router)
    per = 2 * topology.ndim
    cls = np.zeros(NUM_CLASSES)
    healthy = link_model(chip, topology, {})
    for lk, b in zip(batch.res.tolist(), np.repeat(batch.bytes_per_transfer,
                                                   np.diff(batch.ptr)).tolist(), strict=True):
        k = lk % per if lk < topology.num_ici_links else (
            NUM_CLASSES - 2 if lk < topology.num_ici_links + topology.num_chips
            else NUM_CLASSES - 1)
        # Equivalent bytes at the class's healthy speed (a slow link carries them slower).
        eq = b * healthy.capacity_bytes_per_s[lk] / lm.capacity_bytes_per_s[lk]
        cls[k] = max(cls[k], eq)
    lat = batch.latency_s
    drain = float(np.max(cls / healthy.class_capacity_bytes_per_s, initial=0.0))
    return CollectiveCost(time_s=lat + drain, latency_s=lat, class_bytes=cls, group_size=2,
                          algorithm="direct (detour)", hbm_bytes=0.0)


def _p2p_costs(chip, topology, p2p: PointToPoint, programs, prog_of, used_programs, slow,
               dead) -> tuple[dict[tuple[int, int], np.ndarray], list[CollectiveCost]]:
    """Every send op's cost on every chip that runs it: (index per chip into the distinct
    costs, keyed by (program, op id)), the distinct costs. Routes are priced once per distinct
    (offset, bytes) on a healthy pod, chip by chip when links are slow or dead."""
    from topologies.groups import DetourRouter

    router = DetourRouter(topology, dead) if dead else None
    coords = np.asarray([topology.coords(i) for i in range(topology.num_chips)])
    costs: list[CollectiveCost] = []
    ids: dict[tuple, int] = {}  # distinct costs (chips with equal costs must share an index)
    pair_ids: dict[tuple, int] = {}
    out: dict[tuple[int, int], np.ndarray] = {}
    # Every send of a program on one channel with the same bytes has the same index (each
    # chip's route to its peer): computed once (a stage sends once per microbatch and pass).
    done: dict[tuple, np.ndarray] = {}
    for pi in used_programs:
        chips = np.flatnonzero(prog_of == pi)
        for op_id, (ch, _tag) in sorted(p2p.sends[pi].items()):
            nbytes = float(programs[pi].ops[op_id].bytes)
            if (pi, ch, nbytes) in done:
                out[(pi, op_id)] = done[(pi, ch, nbytes)]
                continue
            peer = np.asarray(p2p.peer_of_chip[ch], dtype=np.int64)
            index = np.zeros(topology.num_chips, dtype=np.int64)
            for src in chips.tolist():
                dst = int(peer[src])
                if dst < 0:
                    continue
                # On a healthy pod a dimension-order route depends only on the offset; with
                # slow or dead links every pair is priced on its own route.
                key = (src, dst, nbytes) if slow or dead else (
                    tuple((coords[dst] - coords[src]).tolist()), nbytes)
                if key not in pair_ids:
                    cc = p2p_cost(chip, topology, src, dst, nbytes, slow, router)
                    value = (cc.time_s, cc.latency_s, tuple(cc.class_bytes.tolist()),
                             cc.algorithm)
                    if value not in ids:
                        ids[value] = len(costs)
                        costs.append(cc)
                    pair_ids[key] = ids[value]
                index[src] = pair_ids[key]
            out[(pi, op_id)] = done[(pi, ch, nbytes)] = index
    return out, costs


def _axisdir(topology: Topology, link: int) -> str:
    rest = link % (2 * topology.ndim)
    return AXIS_NAMES[rest // 2] + "+-"[rest % 2]


def _link_axis(topology: Topology, link: int) -> str:
    if link >= topology.num_ici_links:
        return DCN_AXIS
    return AXIS_NAMES[(link % (2 * topology.ndim)) // 2]


def _per_link_bytes(topology: Topology, label: np.ndarray, classes) -> np.ndarray:
    """Bytes on every link: each chip's outgoing link classes carry what its class put there."""
    cls_bytes = np.stack([cl.net.bytes[:NUM_CLASSES] for cl in classes])  # [classes, 8]
    return _per_link_bytes_of_chips(topology, cls_bytes[label])


def _per_link_bytes_of_chips(topology: Topology, chip_b: np.ndarray) -> np.ndarray:
    """Bytes on every link from the bytes each chip put on its outgoing link classes."""
    per = 2 * topology.ndim
    out = np.zeros(topology.num_links)
    n_ici = topology.num_ici_links
    out[:n_ici] = chip_b[:, :per].reshape(-1)
    out[:n_ici] *= topology.link_mask()[:n_ici]
    if topology.num_slices > 1:
        nc = topology.num_chips
        out[n_ici:n_ici + nc] = chip_b[:, NUM_CLASSES - 2]
        out[n_ici + nc:] = chip_b[:, NUM_CLASSES - 1]
    return out


def _core_prev(ops) -> dict[int, int]:
    """{core op id: the core op before it} (compute and idle ops run on the core in program
    order), what a critical path steps back along on one chip."""
    prev, m = -1, {}
    for op in ops:
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE):
            if prev >= 0:
                m[op.id] = prev
            prev = op.id
    return m


def _critical_path(classes, last: int, topology, slow, op_key, group_cost, count,
                   dead=()) -> list[dict]:
    """Walk back from the last op of the last chip: each op's start was set by its latest
    dependency (or the op before it on the core), a collective's start by the last member to
    arrive and its end by the last member to drain. Consecutive ops on one chip class form one
    segment: the chip (class representative), the ops, and the links their collectives used."""
    cl = classes[last]
    k = int(np.argmax(cl.end))
    # Times as Python floats (the same values; an array indexed op by op is much slower).
    start_of = [c.start.tolist() for c in classes]
    end_of = [c.end.tolist() for c in classes]
    steps: list[tuple[int, int]] = []
    core_prev = {c.c: _core_prev(c.ops) for c in classes}
    c = cl.c
    seen = 0
    while k >= 0 and seen < 10 * len(cl.ops) + 10:
        seen += 1
        st = classes[c]
        op = st.ops[k]
        if op.kind == OpKind.COLLECTIVE and len(st.partners.get(k, ())) > 1:
            # End set by the member that drained last (ties: stay on this chip).
            q = max(st.partners[k], key=lambda p: (classes[p].drain_t.get(k, 0.0), p == c, -p))
            steps.append((q, k))
            # Start set by the member that arrived last.
            c = max(st.partners[k], key=lambda p: (classes[p].arrive_t.get(k, 0.0), p == c, -p))
        elif k in st.recv_from:
            # A receive ends when its message has arrived: the path continues on the sender.
            steps.append((c, k))
            c, k = st.recv_from[k]
            steps.append((c, k))
        else:
            steps.append((c, k))
        st = classes[c]
        op = st.ops[k]
        cands = list(op.deps)
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE) and k in core_prev[c]:
            cands.append(core_prev[c][k])
        if not cands:
            break
        end = end_of[c]
        k = max(cands, key=lambda d: (end[d], d))
        if end[k] <= 0 and start_of[c][k] <= 0 and not st.ops[k].deps:
            steps.append((c, k))
            break
    steps.reverse()
    segments: list[dict] = []
    for c, k in steps:
        st = classes[c]
        op = st.ops[k]
        if not segments or segments[-1]["_class"] != c:
            segments.append({
                "_class": c, "chip": _coords_text(topology, st.rep),
                "chips_in_class": 0, "first_op": op.name, "last_op": op.name, "num_ops": 0,
                "start_s": start_of[c][k], "end_s": end_of[c][k], "links": [],
            })
        seg = segments[-1]
        seg["last_op"] = op.name
        seg["num_ops"] += 1
        seg["end_s"] = end_of[c][k]
        if k in st.coll_cost:
            _, costs = group_cost[op_key[(st.prog, k)]]
            add_path_links(seg["links"], st.coll_cost[k], costs[0], topology, dead, slow)
    for seg in segments:
        seg["chips_in_class"] = int(count[seg.pop("_class")])
    return segments


def add_path_links(links: list[str], cost, healthy_cost, topology, dead, slow) -> None:
    """Append (once each) to a critical-path segment's `links` the link classes a collective
    loaded and, when its group's cost is not the healthy one, the dead links it detoured around
    and the degraded links it crossed."""
    for j in np.flatnonzero(cost.class_bytes > 0):
        name = CLASS_NAMES[int(j)]
        if name not in links:
            links.append(name)
    if cost is healthy_cost:
        return
    tags = [f"dead {topology.describe_link(lk)} (detour)" for lk in sorted(dead)]
    tags += [f"degraded {topology.describe_link(lk)}" for lk in sorted(slow)]
    for tag in tags:
        if tag not in links:
            links.append(tag)


__all__ = ["CHIP_COLUMNS", "MODES", "PerChipConfig", "PointToPoint", "chip_classes", "p2p_cost",
           "simulate_chips"]
