"""Replaying an SPMD `Trace` on a pod: MXU/VPU as SimPy resources, HBM bandwidth and the ICI/DCN
link classes as fluid resources shared by collectives (compute streams HBM at its own pace),
host transfers over PCIe.

Every op is costed before `env.run()` by the op-cost kernel (`sim.engine.costs`): compute at
its bound unit's rate, each collective simulated once per distinct (kind, replica group, bytes)
and replayed as one fluid batch whose per-link-class loads are the busiest link of each class, so
that concurrent collectives on the same links share bandwidth; its DMA traffic (send and receive
buffers) also loads HBM, shared with the other collectives' DMA but not with compute
(docs/model/training.md, "HBM": a shared port would let a faster link slow the step); host
transfers at the PCIe bandwidth (one DMA queue per chip). The result is summarised by
`sim.engine.summary`.

SPMD symmetry: every chip runs the same program and the mesh tiles the torus, so one
representative chip is replayed (exact for uniform links; documented in docs/model.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import simpy

from sim.collectives.routing import link_model
from sim.engine.costs import (
    CollectiveCost,
    collective_groups,
    compute_op_times,
    op_collective_cost,
    ops_name,
)
from sim.engine.network import Batch, SmallFluidNetwork
from sim.engine.result import CollectiveLabels, StepResult
from sim.engine.summary import class_capacity, summarize
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import (
    CLASS_NAMES,
    NUM_CLASSES,
    GroupAxis,
)
from topologies.torus import Topology
from workloads.trace import OpKind, Trace, Unit

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
    lm = link_model(chip, topology, {})
    hbm_bw = chip.eff_hbm_bytes_per_s
    if overlap is None:
        overlap = trace.meta.overlap is not False
    c = _cost_ops(trace, chip, topology, algorithm)
    net, start, end = _run(trace, c.dur, c.coll_batch, overlap,
                           np.append(lm.class_capacity_bytes_per_s, hbm_bw))
    return summarize(trace, chip, topology, c.dur, c.bound, start, end, net, c.costs, lm,
                     chip.eff_mxu_flops_per_s, chip.eff_vpu_flops_per_s, hbm_bw, pod=topology,
                     collectives=CollectiveLabels(
                         axes=c.coll_axes, link_classes=c.coll_classes, algorithms=c.coll_algo,
                         class_capacity=class_capacity(lm)))


class _OpCosts(NamedTuple):
    """Every op's cost on the representative chip, before `env.run()`: durations and bound
    units, the collectives' fluid batches (link classes plus HBM), group axes, link classes and
    algorithms, and the distinct collective costs."""

    dur: np.ndarray
    bound: list[str]
    coll_batch: dict[int, Batch]
    coll_axes: dict[int, tuple[GroupAxis, ...]]
    coll_classes: dict[int, dict[str, float]]
    coll_algo: dict[int, str]
    costs: dict[tuple, CollectiveCost]


def _cost_ops(trace: Trace, chip: ChipSpec, topology: Topology, algorithm: str) -> _OpCosts:
    """Cost every op of `trace` (the module docstring's rules), checking that each cost is a
    finite time >= 0."""
    groups = collective_groups(trace, topology)
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
    return _OpCosts(dur, bound, coll_batch, coll_axes, coll_classes, coll_algo, costs)


def _run(trace: Trace, dur: np.ndarray, coll_batch: dict[int, Batch], overlap: bool,
         capacity: np.ndarray) -> tuple[SmallFluidNetwork, np.ndarray, np.ndarray]:
    """Run the costed ops in SimPy: the core's compute and idle ops in program order on the MXU
    and VPU, collectives on the fluid network (`capacity`: the link classes, then HBM) beside
    the core unless `overlap` is False, host transfers on one PCIe queue. Returns the network
    and every op's start and end times."""
    n = len(trace.ops)
    hbm_idx = NUM_CLASSES
    env = simpy.Environment()
    net = SmallFluidNetwork(env, capacity)
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
    return net, start, end
