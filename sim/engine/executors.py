"""Which executor times a step, in one table (`choose_executor`), and the entry points that use
it (`simulate_chips`, `simulate_step`).

The executors share one step model (docs/model.md): a chip's core replays its compute ops in
order (each streaming HBM at its own pace), its HBM and outgoing link classes are fluid
resources shared by collective DMA, a collective is a rendezvous of its replica group. They
differ in how many chips they follow:

* `representative` (`sim.engine.replay`): one chip stands for every chip (SPMD symmetry);
  exact on a healthy pod, no per-chip table.
* `class` (`sim.engine.class_engine.run_classes`): chips whose whole step is identical form a class
  (`sim.engine.perchip.prepare_step`), each class one set of SimPy actors. The reference model.
* `vector` (`sim.engine.vector_engine.run_vectors`): the same classes advanced as numpy vectors over
  their chips by one heap of events; the fast path where many classes share a program.
* `per-chip`: the class executor with one class per chip, every chip's links its own (the
  brute-force oracle the tests compare the others with).

`auto` is the class executor with a few classes per program, vectors from
`VECTOR_MIN_CLASSES` classes per program on or beyond `MAX_CLASS_OPS` class-ops (the same
result, tests/test_vector_engine.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from enum import StrEnum

from sim.engine.class_engine import run_classes
from sim.engine.perchip import (
    HbmPrefixEnded,
    HbmWatch,
    PerChipConfig,
    PreparedStep,
    prepare_step,
)
from sim.engine.replay import replay
from sim.engine.result import StepResult
from sim.engine.vector_engine import run_vectors
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.torus import Topology
from workloads.trace import Trace

# Every class replays the whole program with its own SimPy events and arrays (~0.9 KB per op,
# measured on 64 classes of LLaMA-3-70B): refuse runs beyond ~2 GB rather than exhaust a
# shared machine.
MAX_CLASS_OPS = 2_500_000
# From this many classes on (and beyond MAX_CLASS_OPS) `auto` runs vector classes: the same
# result (tests/test_vector_engine.py), ~9x less CPU at 64 classes of LLaMA-3-70B (2.9 s vs
# 26 s), while a few classes replay faster as SimPy actors.
VECTOR_MIN_CLASSES = 32


class Executor(StrEnum):
    """How a step is timed (see the module docstring)."""

    AUTO = "auto"
    REPRESENTATIVE = "representative"
    CLASS = "class"
    VECTOR = "vector"
    PER_CHIP = "per-chip"


def requested_executor(config: PerChipConfig) -> Executor:
    """The executor a `PerChipConfig` asks for: `mode="per-chip"` the oracle; in `auto` mode
    `vector=True` vectors, `vector=False` SimPy classes, None the table's choice."""
    if config.mode == "per-chip":
        return Executor.PER_CHIP
    if config.vector is None:
        return Executor.AUTO
    return Executor.VECTOR if config.vector else Executor.CLASS


def choose_executor(requested: Executor | str = Executor.AUTO, *,
                    prepared: PreparedStep | None = None) -> Executor:
    """The one table of which executor runs a step.

    | requested      | the step                                                | runs           |
    |----------------|---------------------------------------------------------|----------------|
    | representative | any                                                     | representative |
    | any other      | not prepared yet (chip classes unknown)                 | as requested   |
    | vector, auto   | vectors apply; for auto also > MAX_CLASS_OPS class-ops  | vector         |
    |                | or >= VECTOR_MIN_CLASSES classes per program            |                |
    | per-chip       | otherwise (beyond MAX_CLASS_OPS: refused)               | per-chip       |
    | class, auto,   | otherwise (beyond MAX_CLASS_OPS: refused)               | class          |
    | vector         |                                                         |                |

    Vectors apply to one program without sends, or to several (a pipeline's stages) whose
    replica groups each lie within one program and whose sends go to chips of another program
    (`sim.engine.perchip.vectors_apply`); elsewhere a vector request runs SimPy classes."""
    requested = Executor(requested)
    if requested == Executor.REPRESENTATIVE or prepared is None:
        return requested
    if prepared.vectors_apply and requested in (Executor.AUTO, Executor.VECTOR) and (
            requested == Executor.VECTOR or prepared.class_ops > MAX_CLASS_OPS
            or prepared.num_classes >= VECTOR_MIN_CLASSES * len(prepared.used_programs)):
        return Executor.VECTOR
    if prepared.class_ops > MAX_CLASS_OPS:
        ncls, class_ops = prepared.num_classes, prepared.class_ops
        how = ("use {mode} auto (vector classes, the same result)" if prepared.vectors_apply
               else "vector classes do not take replica groups shared by several programs, "
                    "nor sends between chips of one program, in this version, so perturb "
                    "fewer chips (e.g. {slow_chip} instead of {chip_variation})")
        names = ("mode",) if prepared.vectors_apply else ("slow_chip", "chip_variation")
        raise TpusimError(
            f"the per-chip engine would replay {ncls} chip classes x {class_ops // ncls} ops = "
            f"{class_ops:,} class-ops (limit {MAX_CLASS_OPS:,}, about 0.9 KB each in memory) "
            f"with one SimPy actor per class; {how}, or use a smaller pod", *names
        )
    return Executor.PER_CHIP if requested == Executor.PER_CHIP else Executor.CLASS


def simulate_chips(
    trace: Trace,
    chip: ChipSpec,
    topology: Topology,
    *,
    config: PerChipConfig | None = None,
    algorithm: str = "auto",
    overlap: bool | None = None,
    hbm_watch: HbmWatch | None = None,
) -> StepResult:
    """Replay `trace` on every chip of `topology` (`sim.engine.perchip` prepares the step, the table
    of `choose_executor` picks the class or the vector executor).

    Returns the `StepResult` of the chip that finishes last (ops, units, links, memory,
    breakdown), with the per-chip table (`result.chips`), `slowest_chip`, `critical_path` and
    `num_chip_classes` filled in. `hbm_watch` (`HbmWatch.over`) stops the step as soon as a
    chip's HBM level is over its capacity (`HbmOverCapacity`); with a prefix, only the
    prefix's ops run and reaching its horizon undecided raises `HbmPrefixEnded`.
    """
    cfg = config or PerChipConfig()
    watch = hbm_watch if hbm_watch is not None else _ENCLOSING_WATCH.get()
    prep = prepare_step(trace, chip, topology, cfg, algorithm=algorithm, overlap=overlap,
                        watch=watch)
    executor = choose_executor(requested_executor(cfg), prepared=prep)
    if executor == Executor.VECTOR:
        if prep.prefix_ops is not None:
            watch.prefix_ended = True  # no prefix runs on vector classes
            raise HbmPrefixEnded("the HBM watch's prefix does not apply to vector classes")
        return run_vectors(prep)
    return run_classes(prep, watch)


def simulate_step(trace: Trace, chip: ChipSpec, topology: Topology, *,
                  executor: Executor | str = Executor.AUTO, config: PerChipConfig | None = None,
                  algorithm: str = "auto", overlap: bool | None = None,
                  hbm_watch: HbmWatch | None = None) -> StepResult:
    """Time one step on the executor `choose_executor` picks for `executor`: the
    representative replay, or the per-chip engine (`simulate_chips`) with `config`'s
    perturbations (`executor="per-chip"` forces the brute-force mode)."""
    if not trace.ops:
        # A program of no ops times nothing (trace files and HLO imports refuse it earlier,
        # with their own words); never a division by an empty step.
        raise TpusimError("the program has no ops: nothing runs on the chips, so there is no "
                          "step to time; give a program that computes or communicates")
    executor = choose_executor(executor)
    if executor == Executor.REPRESENTATIVE:
        if config is not None or hbm_watch is not None:
            raise TpusimError("the representative replay takes no per-chip config or HBM watch")
        return replay(trace, chip, topology, algorithm=algorithm, overlap=overlap)
    cfg = config or PerChipConfig()
    if executor != Executor.AUTO:
        cfg = _with_executor(cfg, executor)
    return simulate_chips(trace, chip, topology, config=cfg, algorithm=algorithm,
                          overlap=overlap, hbm_watch=hbm_watch)


def _with_executor(cfg: PerChipConfig, executor: Executor) -> PerChipConfig:
    """`cfg` asking for `executor` (the per-chip engine's `mode` and `vector` fields)."""
    if executor == Executor.PER_CHIP:
        return dataclasses.replace(cfg, mode="per-chip")
    return dataclasses.replace(cfg, mode="auto", vector=executor == Executor.VECTOR)


# The watch of an enclosing `stop_when_hbm_exceeds` block, for runs started below a caller that
# cannot pass `hbm_watch` (plan's workers run a candidate as `tpusim train` runs it). A context
# variable: each thread (and each asyncio task) sees only its own block's watch.
_ENCLOSING_WATCH: ContextVar[HbmWatch | None] = ContextVar("hbm_watch", default=None)


@contextmanager
def stop_when_hbm_exceeds(capacity_bytes: float,
                          prefix: tuple[tuple[frozenset[int], ...], float] | None = None
                          ) -> Iterator[HbmWatch]:
    """Within the block, `simulate_chips` stops a step as soon as a chip's HBM level is over
    `capacity_bytes` (a relative 1e-9 over, for summation order) and raises `HbmOverCapacity`
    (the yielded `HbmWatch` says so): the step is out of memory whatever happens later, and
    `plan` does not need its time. The level is `sim.engine.memory.hbm_occupancy`'s: memory events
    applied at their op's end, checked when simulated time moves on (every op that ended at
    that instant applied), which is the level of a row of the step's memory table, so never
    above its peak. Only where every chip class is the one class of its program (a healthy
    step, a pipeline's stages), so that each class's peak is a reported peak; otherwise the
    step runs to the end as usual. The block's watch is its own thread's.

    `prefix=(op ids per program, horizon s)`: the caller guarantees that no other op starts
    (or, a receive, completes) before the horizon (`sim.studies.plan_jobs.hbm_prefix`, from the
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
    watch = HbmWatch.over(capacity_bytes, prefix)
    token = _ENCLOSING_WATCH.set(watch)
    try:
        yield watch
    finally:
        _ENCLOSING_WATCH.reset(token)


__all__ = ["MAX_CLASS_OPS", "VECTOR_MIN_CLASSES", "Executor", "choose_executor",
           "simulate_chips", "simulate_step",
           "stop_when_hbm_exceeds"]
