"""The per-chip step before it runs, shared by its two executors (`sim.engine.class_engine`: chip
classes as SimPy actors; `sim.engine.vector_engine`: vector classes): what differs between chips
(`PerChipConfig`), every collective's group geometry and cost per group (degraded links priced
link by link), point-to-point sends' routes, and the partition of the chips into equivalence
classes (`chip_classes`); plus the helpers both executors' results are built with (per-link
bytes, critical-path links, rendezvous waits, the HBM watch's types).

A chip class is a set of chips whose whole step is identical: the partition starts from what a
chip *is* (speed, program, per-op work scales, the cost of each of its groups and sends) and is
refined to a fixed point by the classes present in each of its replica groups (and its
point-to-point peers). `sim.engine.executors` chooses the executor from the result.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from sim.collectives.routing import LinkModel, link_model, send_batch
from sim.collectives.simulate import collective_link_loads
from sim.engine.costs import (
    CollectiveCost,
    collective_groups,
    cost_pairs,
    op_collective_cost,
    op_group_axes,
    padded_collective_bytes,
)
from sim.engine.result import CollectiveLabels
from sim.engine.summary import class_capacity
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import (
    CLASS_NAMES,
    NUM_CLASSES,
    DetourRouter,
    GroupAxis,
    GroupGeometry,
    route_pairs_links,
)
from topologies.scenario import DeadLink, Scenario, SlowLink
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology
from workloads.trace import OpKind, Trace

MODES = ("auto", "per-chip")

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
        op_scale: {op id: per-chip factor} on the FLOPs and HBM bytes of that compute op, on
            the bytes a chip moves in that collective (MoE all-to-alls: each chip its own
            volume; the collective still ends when its last member has drained), or on the
            duration of that idle op (a Chakra rank's own recorded duration).
        dead_links: link ids that carry nothing: collectives over their axis detour around them
            (`simulate_collective`'s rerouting, every group at once).
        mode: `auto` (equivalence classes) or `per-chip` (brute force, one actor per chip).
        p2p: point-to-point transfers between the chips' programs (`PointToPoint`).
        vector: in `auto` mode, True runs the classes as vector classes
        (`sim.engine.vector_engine`), False as one SimPy actor each; None (default) picks vectors
        from VECTOR_MIN_CLASSES classes per program on, or when the classes would replay more than
        MAX_CLASS_OPS ops. Vectors take several programs (pipeline stages) and `p2p` sends when
        every replica group lies within one program and sends go to chips of another program.
        vector_rows: how vector classes keep collective candidate rows (`keep`; `check` compares
        each kept row with a fresh one, `recompute` keeps none: for tests).
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
    vector_rows: str = "keep"


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

    @classmethod
    def over(cls, capacity_bytes: float,
             prefix: tuple[tuple[frozenset[int], ...], float] | None = None) -> HbmWatch:
        """A watch for one run: stop it as soon as a chip's HBM level is over
        `capacity_bytes`; `prefix=(op ids per program, horizon s)` runs only those ops
        (`sim.engine.executors.stop_when_hbm_exceeds` says what the caller guarantees)."""
        watch = cls(capacity_bytes=float(capacity_bytes))
        if prefix is not None:
            watch.prefix_ops = tuple(frozenset(ids) for ids in prefix[0])
            watch.horizon_s = float(prefix[1])
        return watch


@dataclass(frozen=True, kw_only=True)
class PreparedStep:
    """A per-chip step costed and partitioned, ready for an executor.

    Collectives are keyed by (program, op id): `op_geom` their group axes, `op_key` their cost
    key; `group_cost[key]` is (cost index of every group, the distinct costs; index 0 the
    healthy one); `send_cost_of[(program, send op)]` the index per chip into `p2p_costs`.
    `label` is every chip's class, `rep` each class's first chip, `class_ops` the ops the
    classes would replay as actors; `prefix_ops` the HBM watch's prefix (None: every op)."""

    config: PerChipConfig
    trace: Trace
    chip: ChipSpec
    topology: Topology
    overlap: bool
    speed: np.ndarray
    programs: tuple[Trace, ...]
    prog_of: np.ndarray
    used_programs: list[int]
    slow: dict[int, float]
    op_geom: dict[tuple[int, int], tuple[GroupAxis, ...]]
    op_key: dict[tuple[int, int], tuple]
    geoms: dict[tuple[GroupAxis, ...], GroupGeometry]
    base_costs: dict[tuple, CollectiveCost]
    group_cost: dict[tuple, tuple[np.ndarray, list[CollectiveCost]]]
    send_cost_of: dict[tuple[int, int], np.ndarray]
    p2p_costs: list[CollectiveCost]
    label: np.ndarray
    rep: np.ndarray
    class_ops: int
    lm: LinkModel
    vectors_apply: bool
    prefix_ops: tuple[frozenset[int], ...] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.rep)


def prepare_step(trace: Trace, chip: ChipSpec, topology: Topology, cfg: PerChipConfig, *,
                 algorithm: str = "auto", overlap: bool | None = None,
                 watch: HbmWatch | None = None) -> PreparedStep:
    """Validate `cfg`, cost every collective and send, and partition the chips into classes
    (see the module docstring)."""
    if cfg.mode not in MODES:
        raise TpusimError(f"{{mode}} {cfg.mode!r} must be one of {', '.join(MODES)}", "mode")
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
        overlap = trace.meta.overlap is not False

    # -- collectives: groups, healthy costs, per-group costs under degraded links -----------
    # Keyed by (program, op id): programs of chips that never share a group may differ.
    prefix_ops = watch.prefix_ops if watch is not None else None
    c = _cost_collectives(trace, chip, topology, cfg, programs, used_programs, p2p_ops, slow,
                          algorithm, prefix_ops)
    op_geom, op_key, geoms, base_costs, group_cost, key_geom = c
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
    return PreparedStep(
        config=cfg, trace=trace, chip=chip, topology=topology, overlap=overlap,
        speed=speed, programs=programs, prog_of=prog_of, used_programs=used_programs,
        slow=slow, op_geom=op_geom, op_key=op_key, geoms=geoms, base_costs=base_costs,
        group_cost=group_cost, send_cost_of=send_cost_of, p2p_costs=p2p_costs, label=label,
        rep=rep, class_ops=class_ops, lm=link_model(chip, topology, {}),
        vectors_apply=vectors_apply(p2p, prog_of, used_programs, op_geom, geoms),
        prefix_ops=prefix_ops)


def _cost_collectives(trace: Trace, chip: ChipSpec, topology: Topology, cfg: PerChipConfig,
                      programs, used_programs, p2p_ops, slow, algorithm, prefix_ops) -> tuple:
    """Every collective of the used programs (`prepare_step`): its group geometry, its cost
    key, its healthy cost and, where slow or dead links touch its groups, its cost per group.
    Returns (op_geom, op_key, geoms, base_costs, group_cost, key_geom)."""
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
                    f"{{slow_link}} with a small factor instead", "slow_link"
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
    return op_geom, op_key, geoms, base_costs, group_cost, key_geom


def relabel(cols: list[np.ndarray]) -> np.ndarray:
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
    labels = relabel(base)
    while True:
        cols = [labels] + [_group_signatures(g, labels) for g in geometries]
        cols += [np.where(nb >= 0, labels[np.maximum(nb, 0)], -1) for nb in neighbours]
        new = relabel(cols)
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
            # The degraded drain paces the whole batch (`CollectiveCost.max_speed`): a
            # slow group draws its links and HBM at the rate its slow link allows, so it never
            # takes more of them than a healthy one would.
            slow_drain = t - base.latency_s
            paced = slow_drain > drain
            costs.append(CollectiveCost(
                time_s=t, latency_s=base.latency_s if paced else max(t - drain, 0.0),
                class_bytes=base.class_bytes, group_size=base.group_size,
                algorithm=base.algorithm, hbm_bytes=base.hbm_bytes,
                max_speed=1.0 / slow_drain if paced else float("inf"),
            ))
        index[g] = by_time[t]
    return index, costs


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
            hbm_bytes=cc.hbm_bytes * k, max_speed=cc.max_speed / k))
    return out[1]


def coll_labels(coll_cost) -> tuple[dict, dict]:
    """({op id: {link class: bytes}}, {op id: algorithm}) of a chip's collectives and sends."""
    return ({i: {CLASS_NAMES[int(j)]: float(cc.class_bytes[j])
                 for j in np.flatnonzero(cc.class_bytes > 0)} for i, cc in coll_cost.items()},
            {i: cc.algorithm for i, cc in coll_cost.items()})


def common_parts(topology, coll_axes, coll_cost, lm, slow, dead, link_bytes) -> dict:
    """The `StepResult` parts both per-chip executors fill alike: the pod, the reported chip's
    collectives' labels, and every link's capacity and bytes (`link_bytes`, changed in place: a
    dead link has no capacity and carries nothing, its detour's bytes stay elsewhere; the plots
    mark it dead)."""
    link_classes, algorithms = coll_labels(coll_cost)
    cap = np.array(np.broadcast_to(lm.capacity_bytes_per_s, (topology.num_links,)), dtype=float)
    for lk, f in slow.items():
        cap[lk] *= f
    for lk in dead:
        cap[lk] = 0.0
        link_bytes[lk] = 0.0
    return {"pod": topology, "link_bytes": link_bytes, "link_capacity": cap,
            "collectives": CollectiveLabels(axes=coll_axes, link_classes=link_classes,
                                            algorithms=algorithms,
                                            class_capacity=class_capacity(lm))}


def vectors_apply(p2p, prog_of, used_programs, op_geom, geoms) -> bool:
    """Whether vector classes can run the step: one program without sends, or several (a
    pipeline's stages) whose replica groups each lie within one program and whose sends go to
    chips of another program (`sim.engine.vector_engine` keys rendezvous by program and op id)."""
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
        f"{topology.coords_text(chip)} has no receiver (tag {tag} on channel {channel}); "
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
    # The message is charged to links only: in the fluid model's rate-fair sharing a small DMA
    # next to a long HBM-bound op would be stretched to that op's length, which is not how the
    # DMA engines share HBM (docs/model.md "Pipeline schedules").
    if router is None:
        return dataclasses.replace(cost_pairs(chip, topology, [(src, dst)], nbytes, dict(slow)),
                                   hbm_bytes=0.0)
    _cls, _hops, per_link = route_pairs_links(topology, [(src, dst)])
    if not any(router.dead_mask[lk] for lk in per_link):
        return dataclasses.replace(cost_pairs(chip, topology, [(src, dst)], nbytes, dict(slow)),
                                   hbm_bytes=0.0)
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



def per_link_bytes_of_chips(topology: Topology, chip_b: np.ndarray) -> np.ndarray:
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


def core_predecessors(ops) -> dict[int, int]:
    """{core op id: the core op before it} (compute and idle ops run on the core in program
    order), what a critical path steps back along on one chip."""
    prev, m = -1, {}
    for op in ops:
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE):
            if prev >= 0:
                m[op.id] = prev
            prev = op.id
    return m



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

