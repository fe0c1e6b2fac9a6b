"""Replaying an SPMD `Trace` on a pod: MXU/VPU as SimPy resources, HBM bandwidth and the ICI/DCN
link classes as fluid resources shared by collectives (compute streams HBM at its own pace),
host transfers over PCIe.

Every op is costed before `env.run()`:
* compute: `max(flops / (peak * eff), hbm_bytes / (hbm_bw * eff)) + op_overhead_s`, bound by
  whichever term is larger (MXU, VPU or HBM); an MXU op with a narrow operand dimension runs at
  `ChipSpec.mxu_fill(op.narrow_dim)` of the MXU peak;
* collective: simulated once per distinct (kind, replica group, bytes) with `simulate_collective`
  on the real topology, then replayed as one fluid batch whose per-link-class loads are the
  busiest link of each class, so that concurrent collectives on the same links share bandwidth;
  its DMA traffic (send and receive buffers) also loads HBM, shared with the other collectives'
  DMA but not with compute (docs/model/training.md, "HBM": a shared port would let a faster
  link slow the step);
* host transfer: bytes / PCIe bandwidth (one DMA queue per chip).

SPMD symmetry: every chip runs the same program and the mesh tiles the torus, so one
representative chip is replayed (exact for uniform links; documented in docs/model.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import simpy

from sim.collectives.routing import link_model, link_numbers
from sim.collectives.simulate import simulate_collective
from sim.engine.network import Batch, SmallFluidNetwork
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import (
    CLASS_NAMES,
    DCN_IN_CLASS,
    DCN_OUT_CLASS,
    NUM_CLASSES,
    GroupAxis,
    axis_factor,
    factor_device_groups,
    route_pairs,
    route_pairs_links,
)
from topologies.mesh import place_mesh
from topologies.torus import AXIS_NAMES, Topology
from workloads.memory import MEMORY_CATEGORIES
from workloads.trace import OpKind, Trace, Unit

OP_COLUMNS = [
    "chip", "op_id", "name", "kind", "unit", "bound", "layer", "phase", "start_s", "end_s",
    "flops", "bytes", "collective", "mesh_axes",
]
UNIT_COLUMNS = ["chip", "unit", "busy_s", "utilization"]
LINK_CLASS_COLUMNS = ["link_class", "bytes_per_link", "busy_s", "utilization"]
# The memory table: HBM occupancy after every change, in total and by category.
MEMORY_COLUMNS = ["chip", "time_s", "hbm_bytes", *MEMORY_CATEGORIES]
CHIP_COLUMNS = [
    "chip", "coords", "chip_class", "finish_s", "mxu_busy_s", "vpu_busy_s", "hbm_busy_s",
    "pcie_busy_s", "collective_wait_s",
]
BREAKDOWN_KEYS = ("mxu_compute_s", "vpu_s", "hbm_bound_s", "exposed_comm_s", "pipeline_bubble_s")
# The breakdown in words, for text reports and plots (the JSON keeps the field names).
BREAKDOWN_LABELS = {"mxu_compute_s": "MXU compute", "vpu_s": "VPU compute",
                    "hbm_bound_s": "HBM-bound ops", "exposed_comm_s": "exposed communication",
                    "pipeline_bubble_s": "pipeline bubble"}


def breakdown_label(key: str) -> str:
    """The words for a breakdown field (`exposed_comm_s` -> "exposed communication")."""
    return BREAKDOWN_LABELS.get(key, key.removesuffix("_s").replace("_", " "))


@dataclass(kw_only=True)
class CollectiveCost:
    time_s: float
    latency_s: float
    class_bytes: np.ndarray  # bytes on the busiest link of each class
    group_size: int
    algorithm: str
    hbm_bytes: float = 0.0  # DMA reads and writes of one chip
    # Cap on the fraction of its bytes drained per second: a group whose route crosses a slow
    # or dead link is paced by that link for its whole drain (it keeps its links and HBM the
    # while, at the lower rate), rather than waiting and then draining at the healthy rate.
    max_speed: float = float("inf")


class ClassProgram(NamedTuple):
    """A chip class's own program (pipeline stages run different ones): the program, its ops'
    bound units, and per collective or send op its link classes (bytes per link of that
    class) and algorithm."""

    trace: Trace
    bound: list[str]
    link_classes: dict[int, dict[str, float]]
    algorithms: dict[int, str]


@dataclass(frozen=True, kw_only=True)
class CollectiveLabels:
    """The reported chip's collectives, for the exporters: per collective (or send) op id its
    physical group axes, the link classes it loads with its bytes per link of that class, and
    its algorithm; and every link class's capacity (bytes/s per link)."""

    axes: dict[int, tuple[GroupAxis, ...]] = field(default_factory=dict)
    link_classes: dict[int, dict[str, float]] = field(default_factory=dict)
    algorithms: dict[int, str] = field(default_factory=dict)
    class_capacity: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ChipClasses:
    """The per-chip engine's chip classes (`sim.engine.perchip.chip_classes`).

    Attributes:
        of_chip: every chip's class.
        reps: each class's representative (its first chip); counts: its number of chips.
        rows: per class (finish s, MXU, VPU, HBM and PCIe busy s, collective wait s).
        timelines: per class, its ops' (start, end) arrays.
        program: the reported (slowest) chip's program, whose HBM events the memory table has.
        programs: per class its own program where classes run several (pipeline stages).
        titles: per class a title (its pipeline stage), for the Perfetto processes.
        p2p: the point-to-point sends (`PointToPoint`) and the program of each class, or None.
    """

    of_chip: np.ndarray
    reps: np.ndarray
    counts: np.ndarray
    rows: list[tuple]
    timelines: dict[int, tuple[np.ndarray, np.ndarray]]
    program: Trace | None = None
    programs: dict[int, ClassProgram] = field(default_factory=dict)
    titles: dict[int, str] = field(default_factory=dict)
    p2p: tuple | None = None


@dataclass(kw_only=True)
class StepResult:
    """A replayed step: scalars plus pandas tables built on demand.

    The parts the exporters read: the tables' rows (`op_rows`, `unit_rows`, `link_class_rows`,
    `memory_rows`), the pod (`pod`), the collectives' labels (`collectives`), on the per-chip
    engine the bytes and capacity of every link (`link_bytes`, `link_capacity`, by link id)
    and the chip classes (`classes`); `vector_stats` when vector classes ran."""

    step_time_s: float
    breakdown: dict[str, float]
    hbm_peak_bytes: float
    hbm_capacity_bytes: float
    hbm_peak_breakdown: dict[str, float]
    fits_in_hbm: bool
    num_ops: int
    sim_events: int
    chip: str
    topology: str
    num_chips: int
    collective_costs: dict[str, Any] = field(default_factory=dict)
    op_rows: list[tuple] = field(default_factory=list, repr=False)
    unit_rows: list[tuple] = field(default_factory=list, repr=False)
    link_class_rows: list[tuple] = field(default_factory=list, repr=False)
    memory_rows: list[tuple] = field(default_factory=list, repr=False)
    pod: Topology | None = field(default=None, repr=False)
    collectives: CollectiveLabels = field(default_factory=CollectiveLabels, repr=False)
    # Per-chip engine (`sim.engine.executors.simulate_chips`); the representative replay leaves the
    # defaults (one class, every chip like chip 0).
    num_chip_classes: int = 1
    slowest_chip: str = ""
    critical_path: list[dict[str, Any]] = field(default_factory=list)
    classes: ChipClasses | None = field(default=None, repr=False)
    link_bytes: np.ndarray | None = field(default=None, repr=False)  # per link id
    link_capacity: np.ndarray | None = field(default=None, repr=False)
    vector_stats: dict[str, int] | None = field(default=None, repr=False)

    @property
    def ops(self):
        import pandas as pd

        return pd.DataFrame(self.op_rows, columns=OP_COLUMNS)

    @property
    def units(self):
        import pandas as pd

        return pd.DataFrame(self.unit_rows, columns=UNIT_COLUMNS)

    @property
    def links(self):
        """One row per link class (`LINK_CLASS_COLUMNS`); on a slice of 4x4x4 cubes joined by
        optical switches (v4, v5p) also `ocs_links`, how many of the class's links go through
        a switch (between cubes) rather than stay inside a cube."""
        import pandas as pd

        df = pd.DataFrame(self.link_class_rows, columns=LINK_CLASS_COLUMNS)
        pod = self.pod
        if pod is not None and getattr(pod, "ocs", False):
            nl = 2 * pod.ndim
            mask = pod.ocs_link_mask()[: pod.num_ici_links]
            per = np.bincount(np.flatnonzero(mask) % nl, minlength=nl)
            names = {"xyz"[c // 2] + "+-"[c % 2]: int(per[c]) for c in range(nl)}
            df["ocs_links"] = [names.get(str(c), 0) for c in df["link_class"]]
        return df

    @property
    def memory(self):
        import pandas as pd

        return pd.DataFrame(self.memory_rows, columns=MEMORY_COLUMNS)

    def for_class(self, k: int, static_hbm_bytes: float = 0.0) -> StepResult:
        """This result as seen by chip class `k` (per-chip engine): its op timeline (same program
        as the class that finished last) and its HBM occupancy; scalars stay the step's."""
        cls = self.classes
        if cls is None or k not in cls.timelines:
            return self
        start, end = cls.timelines[k]
        rep = int(cls.reps[k])
        mem_trace = cls.program
        own = cls.programs.get(k)
        labels = {}
        if own is not None and own.trace is not cls.program:  # another program (stage)
            mem_trace = own.trace
            ops = [(rep,) + r[1:] for r in _op_rows(own.trace, own.bound, start, end)]
            labels = {"collectives": dataclasses.replace(
                self.collectives, link_classes=own.link_classes, algorithms=own.algorithms)}
        else:
            ops = [(rep,) + r[1:8] + (float(start[r[1]]), float(end[r[1]])) + r[10:]
                   for r in self.op_rows]
        if mem_trace is None:
            mem = [(rep, 0.0, static_hbm_bytes, *(0.0 for _ in MEMORY_CATEGORIES))]
        else:
            _, _, rows = hbm_occupancy(mem_trace, end, 1)
            mem = [(rep,) + r[1:] for r in rows]
        return dataclasses.replace(self, op_rows=ops, memory_rows=mem, **labels)

    @property
    def chips(self):
        """One row per chip (CHIP_COLUMNS): its class, finish time, busy time per unit and time
        spent waiting for the other members of its collectives. Needs the per-chip engine."""
        import pandas as pd

        if self.classes is None or self.pod is None:
            raise TpusimError("the per-chip table needs the per-chip engine (simulate_chips)")
        topo = self.pod
        label = self.classes.of_chip
        rows = np.asarray(self.classes.rows, dtype=float)[label]
        coords = topo.all_coords()[np.arange(topo.num_chips) % topo.chips_per_slice]
        text = [",".join(map(str, r)) for r in coords.tolist()]
        if topo.num_slices > 1:
            text = [f"{t},{i // topo.chips_per_slice}" for i, t in enumerate(text)]
        return pd.DataFrame({
            "chip": np.arange(topo.num_chips), "coords": text, "chip_class": label,
            "finish_s": rows[:, 0], "mxu_busy_s": rows[:, 1], "vpu_busy_s": rows[:, 2],
            "hbm_busy_s": rows[:, 3], "pcie_busy_s": rows[:, 4],
            "collective_wait_s": rows[:, 5],
        }, columns=CHIP_COLUMNS)


def static_hbm_bytes(meta: Mapping) -> float:
    """A trace's static HBM state in bytes, resident from the start of the step: the sum of meta
    `static_composition`, or `static_hbm_bytes` when the trace has no composition."""
    comp = meta.get("static_composition")
    if comp:
        return sum(float(v) for v in comp.values())
    return float(meta.get("static_hbm_bytes", 0.0))


def hbm_occupancy(trace: Trace, end, pp: int) -> tuple[float, dict[str, float], list[tuple]]:
    """HBM over the step: (peak bytes, its composition by category, the memory table rows).

    The static state (meta `static_composition`, or `static_hbm_bytes` as `other`) is resident
    from the start; categorised events (meta `memory_events`: [op id, category, bytes]) apply when
    their op ends, all of one op's events at once. Traces without events (decode) use the ops'
    `alloc_bytes - free_bytes` as `other` plus the meta `logits_bytes` as a transient at the peak.
    A pipeline stage's in-flight microbatches' activations (meta `activation_bytes_estimate`)
    bound the peak from below.
    """
    meta = trace.meta
    static = float(meta.get("static_hbm_bytes", 0.0))
    level = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    comp = meta.get("static_composition")
    if comp:
        for k, v in comp.items():
            level[k] += float(v)
    else:
        level["other"] += static
    raw = meta.get("memory_events")
    end = _floats(end)
    if raw is not None:
        events = []
        for ev in raw:
            op_id, cat, delta = int(ev[0]), str(ev[1]), float(ev[2])
            if not 0 <= op_id < len(trace.ops) or cat not in level:
                raise TpusimError(
                    f"trace memory event {ev!r} names op {op_id} or category {cat!r}, which the "
                    f"trace lacks (categories: {', '.join(MEMORY_CATEGORIES)}); recompile it"
                )
            events.append((end[op_id], op_id, cat, delta))
    else:
        events = [(end[o.id], o.id, "other", o.alloc_bytes - o.free_bytes)
                  for o in trace.ops if o.alloc_bytes or o.free_bytes]
    events.sort(key=lambda e: (e[0], e[1]))

    def row(t):
        return (0, t, sum(level.values()), *level.values())

    mem = [row(0.0)]
    peak_parts = dict(level)
    peak = sum(level.values())
    i = 0
    while i < len(events):
        t, op_id = events[i][0], events[i][1]
        while i < len(events) and events[i][0] == t and events[i][1] == op_id:
            level[events[i][2]] += events[i][3]
            i += 1
        mem.append(row(t))
        total = sum(level.values())
        if total > peak:
            peak, peak_parts = total, dict(level)
    if raw is None and meta.get("logits_bytes"):
        peak_parts["logits"] += float(meta["logits_bytes"])  # transient during the loss
        peak += float(meta["logits_bytes"])
    pp_act = float(meta.get("activation_bytes_estimate", 0.0))
    if pp > 1 and static + pp_act > peak:
        peak = static + pp_act
        peak_parts = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
        for k, v in (comp or {"other": static}).items():
            peak_parts[k] += float(v)
        peak_parts["saved_activations"] += pp_act
    return peak, {k: v for k, v in peak_parts.items() if v}, mem


def collective_groups(trace: Trace, topology: Topology) -> dict[str, tuple[GroupAxis, ...]]:
    """Physical group axes (factors) of every logical mesh axis."""
    placements = place_mesh(trace.mesh, topology)
    out = {}
    for name, pl in placements.items():
        out[name] = tuple(axis_factor(topology, a, size, stride) for a, size, stride in pl.factors)
    return out


def ops_name(trace: Trace, i: int) -> str:
    return trace.ops[i].name


def _merge(topology: Topology, factors: list[GroupAxis]) -> tuple[GroupAxis, ...]:
    """Merge contiguous factors of one physical axis (tensor x[4@1] + fsdp x[4@4] = x)."""
    by_axis: dict[str, list[GroupAxis]] = {}
    for f in factors:
        by_axis.setdefault(f.physical_name, []).append(f)
    merged = []
    for axis, fs in by_axis.items():
        fs = sorted(fs, key=lambda g: g.stride)
        cur = fs[0]
        for g in fs[1:]:
            if g.stride == cur.stride * cur.size:
                cur = axis_factor(topology, axis, cur.size * g.size, cur.stride)
            else:
                merged.append(cur)
                cur = g
        merged.append(cur)
    order = {"x": 0, "y": 1, "z": 2, "dcn": 3}
    return tuple(sorted(merged, key=lambda g: (order[g.physical_name], g.stride)))


def padded_collective_bytes(kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float) -> int:
    """V as simulated: XLA pads an array to a multiple of the group (permutes move as is)."""
    if kind == "collective-permute":
        return int(np.ceil(nbytes))
    group = int(np.prod([g.size for g in gaxes]))
    return int(np.ceil(max(nbytes, 1.0) / group)) * group


# Costs of healthy collectives by (the chip's link numbers, torus, kind, group axes, bytes,
# algorithm): a pure function of those (`routing.LINK_FIELDS`: the chip fields a collective
# reads), and the most expensive part of costing a step on a large pod, shared by the
# steps a worker process simulates one after another (a study's points that vary only what the
# collectives do not see, `plan`'s candidates that share groups). Bounded; cleared when full.
COST_CACHE_SIZE = 4096
_COST_CACHE: dict[tuple, CollectiveCost] = {}


def cost_cache_key(chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...],
                   nbytes: float, algorithm: str) -> tuple:
    return (link_numbers(chip), topology.shape, topology.wraparound, topology.num_slices,
            topology.twisted, kind, gaxes, float(nbytes), algorithm)


def seed_cost_cache(entries: dict[tuple, CollectiveCost]) -> None:
    """Add costs computed elsewhere (another worker of the same study) to this process's cache."""
    if len(_COST_CACHE) + len(entries) > COST_CACHE_SIZE:
        _COST_CACHE.clear()
    _COST_CACHE.update(entries)


def cost_collective(
    chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float,
    algorithm: str = "auto",
) -> CollectiveCost:
    """A healthy collective's cost on `topology` (memoised per process; see `_COST_CACHE`)."""
    key = cost_cache_key(chip, topology, kind, gaxes, nbytes, algorithm)
    hit = _COST_CACHE.get(key)
    if hit is None:
        hit = _cost_collective(chip, topology, kind, gaxes, nbytes, algorithm)
        if len(_COST_CACHE) >= COST_CACHE_SIZE:
            _COST_CACHE.clear()
        _COST_CACHE[key] = hit
    return hit


def _cost_collective(
    chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float,
    algorithm: str,
) -> CollectiveCost:
    group = int(np.prod([g.size for g in gaxes]))
    v = padded_collective_bytes(kind, gaxes, nbytes)
    algo = algorithm if kind in ("all-gather", "reduce-scatter", "all-reduce") else "auto"
    if kind == "collective-permute":
        # Pipeline stage-to-stage sends: shift by one along the (single) group axis.
        if len(gaxes) != 1:
            gaxes = gaxes[:1]
    res = simulate_collective(
        chip=chip, topology=topology, op=kind, axes=gaxes, nbytes=v, algorithm=algo
    )
    lb = res.link_bytes
    cls = np.zeros(NUM_CLASSES)
    ndim = topology.ndim
    n_ici = topology.num_ici_links
    ici = lb[:n_ici].reshape(-1, 2 * ndim)
    cls[: 2 * ndim] = ici.max(axis=0)
    if topology.num_slices > 1:
        nc = topology.num_chips
        cls[DCN_OUT_CLASS] = lb[n_ici : n_ici + nc].max(initial=0.0)
        cls[DCN_IN_CLASS] = lb[n_ici + nc :].max(initial=0.0)
    lm = link_model(chip, topology, {})
    drain = float(np.max(cls / lm.class_capacity_bytes_per_s, initial=0.0))
    return CollectiveCost(
        time_s=res.time_s, latency_s=max(res.time_s - drain, 0.0), class_bytes=cls,
        group_size=group, algorithm=res.algorithm, hbm_bytes=res.hbm_bytes_per_chip,
    )


def device_group_axes(trace: Trace, topology: Topology, op, cache: dict[int, tuple]):
    """(group axes, cost key) of a collective over explicit device groups (HLO import)."""
    if op.group not in cache:
        spec = trace.meta["device_groups"][op.group]
        members = spec.get("groups", spec.get("pairs", []))
        bad = [c for g in members for c in g if not 0 <= int(c) < topology.num_chips]
        if bad:
            raise TpusimError(
                f"collective {op.name} names chip {bad[0]}, but the {topology.name} pod has "
                f"chips 0..{topology.num_chips - 1}; replay it on the pod it was compiled for"
            )
        if "pairs" in spec:
            pairs = [(int(a), int(b)) for a, b in spec["pairs"]]
            cls, _hops = route_pairs(topology, pairs)
            axes = tuple(axis_factor(topology, AXIS_NAMES[k // 2], topology.shape[k // 2], 1)
                         for k in range(0, 2 * topology.ndim, 2) if cls[k] or cls[k + 1])
            cache[op.group] = (axes, pairs)
        else:
            gaxes, _exact = factor_device_groups(topology, [list(map(int, g))
                                                            for g in spec["groups"]])
            cache[op.group] = (gaxes, None)
    gaxes, pairs = cache[op.group]
    if pairs is not None:
        return gaxes, ("collective-permute", gaxes, round(op.bytes), op.group)
    return gaxes, (op.collective, gaxes, round(op.bytes))


def cost_pairs(chip: ChipSpec, topology: Topology, pairs: list[tuple[int, int]],
               nbytes: float, slow: dict[int, float] | None = None) -> CollectiveCost:
    """A collective-permute between explicit chips: every message on its dimension-order
    route at once; the busiest link carries its messages back to back and the longest route
    pays the per-hop latency (exact for the contention-free rings XLA's windowed einsums
    use). A slow link (`slow`: link id -> bandwidth factor) carries its messages at its own
    speed; it is charged to its link class as the equivalent bytes at full speed, so the whole
    permute (a lock-step ring step) waits for it."""
    cls_msgs, hops, per_link = route_pairs_links(topology, pairs)
    lm = link_model(chip, topology, {})
    cls = cls_msgs * float(nbytes)
    for link, f in (slow or {}).items():
        if link in per_link:
            k = link % (2 * topology.ndim)
            cls[k] = max(cls[k], per_link[link] * float(nbytes) / f)
    lat = hops * lm.ici_latency_s + (lm.dcn_latency_s if cls[DCN_OUT_CLASS] > 0 else 0.0)
    drain = float(np.max(cls / lm.class_capacity_bytes_per_s, initial=0.0))
    return CollectiveCost(time_s=lat + drain, latency_s=lat, class_bytes=cls, group_size=2,
                          algorithm="direct", hbm_bytes=2.0 * float(nbytes))


def op_collective_cost(
    chip: ChipSpec, topology: Topology, trace: Trace, op, groups, dev_groups: dict, costs: dict,
    algorithm: str,
) -> tuple[tuple[GroupAxis, ...], tuple]:
    """A collective op's group axes and cost key, costing it into `costs` on first sight.

    Ops with explicit device groups (HLO import) are keyed by their group (a 4-tuple key means
    chip pairs, costed link by link); the others by (kind, merged mesh-axis factors, bytes).
    """
    gaxes, key = op_group_axes(topology, trace, op, groups, dev_groups)
    if key not in costs:
        costs[key] = (
            cost_pairs(chip, topology, dev_groups[op.group][1], op.bytes) if len(key) == 4
            else cost_collective(chip, topology, op.collective, gaxes, op.bytes, algorithm))
    return gaxes, key


def op_group_axes(topology: Topology, trace: Trace, op, groups,
                  dev_groups: dict) -> tuple[tuple[GroupAxis, ...], tuple]:
    """A collective op's group axes and cost key (`op_collective_cost` without the cost)."""
    if op.group >= 0:
        return device_group_axes(trace, topology, op, dev_groups)
    factors: list[GroupAxis] = []
    for a in op.mesh_axes:
        factors += list(groups[a])
    gaxes = _merge(topology, factors)
    return gaxes, (op.collective, gaxes, round(op.bytes))


def compute_op_times(chip: ChipSpec, op) -> tuple[float, float]:
    """A compute op's (FLOP time, HBM time) alone on its chip: its FLOPs at its unit's rate
    (int8 or bf16 MXU times the fill of a narrow dimension, or the VPU) and its bytes at the HBM
    rate. `replay` costs the op `max` of the two plus the per-op overhead before the run, and
    that is its time in the replay (its HBM stream does not share with collective DMA)."""
    return op.flops / chip.unit_rate(op), op.hbm_bytes / chip.eff_hbm_bytes_per_s


# A run that reports its progress asks whether an update is due every this many SimPy events
# (a few microseconds of engine work each): the check costs under 0.1% of the run.
PROGRESS_EVERY_EVENTS = 2048


def run_env(env: simpy.Environment, task, done) -> None:
    """`env.run()`, and while it runs `task.update(done())` whenever an update is due (asked
    every `PROGRESS_EVERY_EVENTS` events); the same events in the same order as `env.run()`.
    An inactive task (nobody watching) runs `env.run()` itself."""
    if not task.active:
        env.run()
        return
    step = env.step
    every = range(PROGRESS_EVERY_EVENTS)
    try:
        while True:
            for _ in every:
                step()
            if task.due():
                task.update(done())
    except simpy.core.EmptySchedule:
        task.update(task.total if task.total is not None else done())


def replay(
    trace: Trace,
    chip: ChipSpec,
    topology: Topology,
    *,
    algorithm: str = "auto",
    overlap: bool | None = None,
) -> StepResult:
    """Replay `trace` on `topology` of `chip`s (one representative chip; see module docstring).

    Args:
        overlap: None follows the trace; False forces every collective to block compute.
    """
    groups = collective_groups(trace, topology)
    lm = link_model(chip, topology, {})
    hbm_bw = chip.eff_hbm_bytes_per_s
    mxu_rate = chip.eff_mxu_flops_per_s
    vpu_rate = chip.eff_vpu_flops_per_s
    if overlap is None:
        overlap = bool(trace.meta.get("overlap", True))

    # -- cost everything before env.run() ---------------------------------------------------
    costs: dict[tuple, CollectiveCost] = {}
    dev_groups: dict[int, tuple] = {}  # device group id -> (gaxes, pairs)
    n = len(trace.ops)
    dur = np.zeros(n)
    bound = [""] * n
    coll_batch: dict[int, Batch] = {}
    coll_axes: dict[int, tuple[GroupAxis, ...]] = {}
    coll_classes: dict[int, dict[str, float]] = {}
    coll_algo: dict[int, str] = {}
    hbm_idx = NUM_CLASSES  # HBM bandwidth is one more fluid resource, after the link classes
    for op in trace.ops:
        if op.kind == OpKind.COMPUTE:
            t_c, t_m = compute_op_times(chip, op)
            if t_c >= t_m:
                bound[op.id] = "mxu" if op.unit == Unit.MXU else "vpu"
            else:
                bound[op.id] = "hbm"
            dur[op.id] = max(t_c, t_m) + chip.op_overhead_s
        elif op.kind == OpKind.COLLECTIVE:
            gaxes, key = op_collective_cost(chip, topology, trace, op, groups, dev_groups, costs,
                                            algorithm)
            c = costs[key]
            coll_axes[op.id] = gaxes
            coll_algo[op.id] = c.algorithm
            coll_classes[op.id] = {CLASS_NAMES[int(i)]: float(c.class_bytes[i])
                                   for i in np.flatnonzero(c.class_bytes > 0)}
            dur[op.id] = c.time_s
            bound[op.id] = "ici"
            used = np.flatnonzero(c.class_bytes > 0)
            # DMA reads the send buffer and writes the receive buffer in HBM, so a collective
            # also draws on the chip's HBM bandwidth (shared with the other collectives' DMA).
            coll_batch[op.id] = Batch(
                res=np.append(used, hbm_idx).astype(np.int64),
                ptr=np.arange(len(used) + 2, dtype=np.int64),
                bytes_per_transfer=np.append(c.class_bytes[used], c.hbm_bytes),
                latency_s=c.latency_s,
            )
        elif op.kind == OpKind.HOST:
            dur[op.id] = op.bytes / chip.pcie_bytes_per_s
            bound[op.id] = "pcie"
        else:
            dur[op.id] = op.duration_s
            bound[op.id] = "idle"

    # Invariant: every cost is a finite, non-negative time (inputs are validated, so a failure
    # here is a bug and surfaces as an `internal error`).
    if not np.all(np.isfinite(dur)) or np.any(dur < 0):
        bad = int(np.flatnonzero(~np.isfinite(dur) | (dur < 0))[0])
        raise RuntimeError(f"invariant violated: op {bad} ({ops_name(trace, bad)}) costs "
                           f"{dur[bad]} s")

    # -- replay -----------------------------------------------------------------------------
    env = simpy.Environment()
    net = SmallFluidNetwork(env, np.append(lm.class_capacity_bytes_per_s, hbm_bw))
    mxu = simpy.Resource(env, capacity=1)
    vpu = simpy.Resource(env, capacity=1)
    pcie = simpy.Resource(env, capacity=1)
    done = [env.event() for _ in range(n)]
    start = np.zeros(n)
    end = np.zeros(n)
    ops = trace.ops

    def wait_deps(op):
        evs = [done[d] for d in op.deps if not done[d].processed]
        if evs:
            yield env.all_of(evs)

    def run_collective(op):
        yield from wait_deps(op)
        start[op.id] = env.now
        yield net.transfer(coll_batch[op.id])
        end[op.id] = env.now
        done[op.id].succeed()

    def run_async(op, resource):
        yield from wait_deps(op)
        with resource.request() as req:
            yield req
            start[op.id] = env.now
            yield env.timeout(dur[op.id])
        end[op.id] = env.now
        done[op.id].succeed()

    def core():
        for op in ops:
            if op.kind == OpKind.HOST or (op.kind == OpKind.COLLECTIVE and overlap):
                continue
            yield from wait_deps(op)
            if op.kind == OpKind.COLLECTIVE:  # --no-overlap: collectives block the core
                yield env.process(run_collective(op))
                continue
            if op.kind == OpKind.IDLE:
                start[op.id] = env.now
                yield env.timeout(dur[op.id])
                end[op.id] = env.now
                done[op.id].succeed()
                continue
            unit = mxu if op.unit == Unit.MXU else vpu
            with unit.request() as req:
                yield req
                start[op.id] = env.now
                if op.hbm_bytes > 0:
                    # The op streams its bytes through HBM at its own pace (compute and DMA
                    # do not contend for HBM: docs/model/training.md, "HBM"); the bytes count
                    # in HBM's traffic all the same.
                    net.count_bytes(hbm_idx, op.hbm_bytes)
                yield env.timeout(dur[op.id])
            end[op.id] = env.now
            done[op.id].succeed()

    for op in ops:
        if op.kind == OpKind.COLLECTIVE and overlap:
            env.process(run_collective(op))
        elif op.kind == OpKind.HOST:
            env.process(run_async(op, pcie))
    env.process(core())
    env.run()
    stuck = [ops[i].name for i, e in enumerate(done) if not e.processed]
    if stuck:  # pragma: no cover - guarded by Trace validation
        raise TpusimError(f"internal error: {len(stuck)} ops never ran, e.g. {stuck[:3]}")

    return _summarize(trace, chip, topology, dur, bound, start, end, net, costs, lm,
                      mxu_rate, vpu_rate, hbm_bw, pod=topology, collectives=CollectiveLabels(
                          axes=coll_axes, link_classes=coll_classes, algorithms=coll_algo,
                          class_capacity=class_capacity(lm)))


def _op_rows(trace, bound, start, end) -> list[tuple]:
    """The ops table's rows (OP_COLUMNS; chip 0) of one chip's timeline."""
    start, end = _floats(start), _floats(end)
    return [(
        0, o.id, o.name, str(o.kind), str(o.unit) if o.kind == OpKind.COMPUTE else bound[o.id],
        bound[o.id], o.layer, o.phase, start[o.id], end[o.id], float(o.flops),
        float(o.hbm_bytes if o.kind == OpKind.COMPUTE else o.bytes), o.collective,
        ",".join(o.mesh_axes),
    ) for o in trace.ops]


def _floats(a) -> list[float]:
    """An array of times as Python floats (the same values; indexing a list element by element
    is several times faster than an array's)."""
    return a.tolist() if isinstance(a, np.ndarray) else [float(x) for x in a]


def class_capacity(lm) -> dict[str, float]:
    """Every link class's capacity (bytes/s per link) of a `LinkModel`."""
    return {CLASS_NAMES[i]: float(lm.class_capacity_bytes_per_s[i]) for i in range(NUM_CLASSES)}


def _summarize(trace, chip, topology, dur, bound, start, end, net, costs, lm, mxu_rate,
               vpu_rate, hbm_bw, *, reported_chip: int = 0, **parts) -> StepResult:
    """The step's result from one chip's timeline (`reported_chip`: the chip its table rows
    name); `parts` are the `StepResult` parts the caller has (pod, collectives, classes...)."""
    ops = trace.ops
    step = float(end.max(initial=0.0))
    end_a = end
    start, end = _floats(start), _floats(end)
    # Pipeline bubble: the (p-1) idle stage slots of GPipe/1F1B, each as long as one
    # microbatch's forward+backward on a stage (the standard bubble, tpu.md §4 pipeline row).
    pp = int(trace.meta.get("pipeline_stages", 1))
    mbs = int(trace.meta.get("microbatches", 1))
    bubble = 0.0
    if pp > 1:
        # One microbatch's forward+backward: the time before the optimizer update starts.
        opt = [start[o.id] for o in ops if o.phase == "optimizer"]
        work = min(opt) if opt else step
        bubble = (pp - 1) * work / mbs
    total = step + bubble
    # Critical-path breakdown along the core's timeline: compute ops by their bound unit, and
    # the gaps in between (waiting for collectives or host transfers) as exposed communication.
    core_ops = sorted(
        (o for o in ops if o.kind == OpKind.COMPUTE or o.kind == OpKind.IDLE),
        key=lambda o: (start[o.id], o.id),
    )
    bd = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    t = 0.0
    for o in core_ops:
        gap = start[o.id] - t
        if gap > 0:
            bd["exposed_comm_s"] += gap
        length = end[o.id] - start[o.id]
        b = bound[o.id]
        if o.kind == OpKind.IDLE:
            bd["pipeline_bubble_s"] += length
        elif b == "mxu":
            bd["mxu_compute_s"] += length
        elif b == "vpu":
            bd["vpu_s"] += length
        else:
            bd["hbm_bound_s"] += length
        t = max(t, end[o.id])
    if step > t:
        bd["exposed_comm_s"] += step - t
    bd["pipeline_bubble_s"] += bubble

    op_rows = _op_rows(trace, bound, start, end)
    mxu_busy = sum(o.flops / (mxu_rate * chip.mxu_fill(o.narrow_dim)) for o in ops
                   if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
    vpu_busy = sum(o.flops / vpu_rate for o in ops
                   if o.kind == OpKind.COMPUTE and o.unit == Unit.VPU)
    hbm_busy = float(net.bytes[NUM_CLASSES]) / hbm_bw  # compute and collective DMA traffic
    pcie_busy = sum(dur[o.id] for o in ops if o.kind == OpKind.HOST)
    units = [
        (0, "mxu", mxu_busy, mxu_busy / total if total else 0.0),
        (0, "vpu", vpu_busy, vpu_busy / total if total else 0.0),
        (0, "hbm", hbm_busy, hbm_busy / total if total else 0.0),
        (0, "pcie", pcie_busy, pcie_busy / total if total else 0.0),
    ]
    links = []
    net_bytes, net_busy = net.bytes, net.busy_s
    for c in range(NUM_CLASSES):  # the HBM resource (index NUM_CLASSES) is reported in units
        if net_bytes[c] <= 0:
            continue
        cap = lm.class_capacity_bytes_per_s[c]
        links.append((CLASS_NAMES[c], float(net_bytes[c]), float(net_busy[c]),
                      float(net_bytes[c] / (cap * total)) if total else 0.0))

    peak, peak_parts, mem = hbm_occupancy(trace, end_a, pp)
    cap = chip.hbm_bytes
    coll_summary = {
        f"{k[0]} {'/'.join(g.name for g in k[1])} {k[2]}B"
        + (f" pairs#{k[3]}" if len(k) > 3 else ""): {
            "time_s": v.time_s, "group_size": v.group_size, "algorithm": v.algorithm,
        }
        for k, v in costs.items()
    }
    if reported_chip:
        op_rows = [(reported_chip,) + row[1:] for row in op_rows]
        units = [(reported_chip,) + row[1:] for row in units]
        mem = [(reported_chip,) + row[1:] for row in mem]
    return StepResult(
        step_time_s=total, breakdown=bd, hbm_peak_bytes=peak, hbm_capacity_bytes=cap,
        hbm_peak_breakdown=peak_parts, fits_in_hbm=peak <= cap, num_ops=len(ops),
        sim_events=parts.pop("sim_events", net.num_events + len(ops)),
        chip=chip.name, topology=topology.name, num_chips=topology.num_chips,
        collective_costs=coll_summary, op_rows=op_rows, unit_rows=units, link_class_rows=links,
        memory_rows=mem, **parts,
    )
