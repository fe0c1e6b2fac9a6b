"""What a worker computes for a plan, each a picklable job (a candidate's `TrainRequest` and
what it needs) whose result is a plain object: the bounds of a group of candidates that differ
only in placement (`floor_bounds`, `pipeline_bounds`, `lower_bounds`), the sharper bound of
one candidate with the collective costs it computed (`sharper_bound`), and the candidate's
simulation as `tpusim train` runs it (`simulate`), stopped once its HBM level goes over the
chip's capacity, first on a prefix of the step that may already decide it (`prefix_schedule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sim.engine import costs as engine
from sim.engine.costs import collective_groups, seed_cost_cache
from sim.engine.executors import stop_when_hbm_exceeds
from sim.engine.memory import static_hbm_bytes
from sim.engine.pipeline import check_schedule, simulate_pipeline_chips
from sim.runs.bind import algorithm_of, moe_config, resolve_pod, scenario_of
from sim.runs.requests import TrainRequest
from sim.runs.train import compile_inputs, compile_step, pipeline_base
from sim.studies.plan_bounds import (
    Floors,
    Uncontended,
    compute_floor,
    core_floor_s,
    mesh_groups,
    pipeline_schedule_bound,
    stage_programs,
    stage_schedule,
    step_hbm_lower_bound,
    step_lower_bound,
)
from sim.studies.points import run_point
from topologies.errors import TpusimError
from workloads.training import compile_training_step


def floor_bounds(job: tuple) -> dict[str, Any]:
    """`compute_floor` of one group of candidates that differ only in placement: the cheapest
    first bound of a group (two compiles of a model of 2 and 3 layers per chunk, where a full
    bound compiles every layer); its `pipeline_bounds` or `lower_bounds` follow only when one
    of its candidates reaches the front of the plan's queue. Job: (train request, [axis
    orders]) -> {"lower_bounds_s": [...], "floor_s": the floor} or {"error": ...}."""
    req, orders = job
    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        floor = compute_floor(model, mesh, topo.num_chips, tcfg, chip, topo)
        # Less a relative 1e-9: the same floors summed in another order than the engine's.
        return {"lower_bounds_s": [floor * (1 - 1e-9)] * len(orders), "floor_s": floor}
    except TpusimError as exc:
        return {"error": str(exc)}


def lower_bounds(job: tuple) -> dict[str, Any]:
    """`step_lower_bound` of every placement (axis order) of one group of candidates that differ
    only in placement, for the model, pod and training settings that `tpusim ARGV` resolves
    (the same parser and compile inputs as the simulation; the placements share one compiled
    trace). Job: (train request, [axis orders]) -> {"lower_bounds_s": [...],
    "hbm_lower_bound_bytes": `hbm_peak_lower_bound` of the step (0 for pipelines),
    "hbm_capacity_bytes": the chip's HBM, "core_floor_s": the busiest core's `core_floor_s`
    (what `compute_floor` stands for, checked by `run_plan`)} or {"error": ...}."""
    req, orders = job
    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        # The bounds of a pipeline use its stage programs only, not the whole step's trace
        # (a quarter of the job's time on 405B); an error that compile would raise is then
        # reported by the candidate's simulation.
        floors = Floors(chip, topo, {})
        if mesh.size("pipeline") > 1:
            hbm = step_hbm_lower_bound(model, None, topo.num_chips, tcfg, mesh=mesh)
            core = max(core_floor_s(prog, floors) for prog in
                       stage_programs(model, mesh, topo.num_chips, tcfg).programs)
        else:
            trace = compile_training_step(model, mesh, topo.num_chips, tcfg)
            hbm = step_hbm_lower_bound(model, trace, topo.num_chips, tcfg)
            core = core_floor_s(trace, floors)
        return {"lower_bounds_s": [step_lower_bound(model, o, topo.num_chips, tcfg, chip, topo)
                                   for o in orders],
                "hbm_lower_bound_bytes": hbm, "hbm_capacity_bytes": chip.hbm_bytes,
                "core_floor_s": core}
    except TpusimError as exc:
        return {"error": str(exc)}


def _bound_inputs(req: TrainRequest) -> tuple:
    """(chip, topology, model, mesh, training config) that the candidate's request compiles
    (the same compile inputs as its simulation)."""
    pod = resolve_pod(req)
    _base, model, mesh, tcfg = compile_inputs(
        req, moe_config(req, scenario_of(req, pod.topology)), pod.chip)
    return pod.chip, pod.topology, model, mesh, tcfg


def pipeline_bounds(job: tuple) -> dict[str, Any]:
    """`pipeline_schedule_bound` of every placement (axis order) of one group of pipeline
    candidates that differ only in placement: the cheap first bound of a pipeline group (its
    one-microbatch chunk programs only). `lower_bounds` (the stage programs' schedule and HBM
    peak) follows only for a group that reaches the front of the plan's queue. Job: (train
    request, [axis orders]) -> {"lower_bounds_s": [...]} or {"error": ...}."""
    req, orders = job
    try:
        chip, topo, model, _mesh, tcfg = _bound_inputs(req)
        # Less a relative 1e-12: the same durations summed in another order than the stage
        # programs' schedule (on the 405B plan up to 7e-12 s above it where the two agree).
        return {"lower_bounds_s": [pipeline_schedule_bound(model, o, topo.num_chips, tcfg, chip,
                                                           topo) * (1 - 1e-12)
                                   for o in orders]}
    except TpusimError as exc:
        return {"error": str(exc)}


def sharper_bound(job: tuple) -> dict[str, Any]:
    """The sharper lower bound of one candidate: the uncontended schedule with every collective
    at its exact simulated time alone on the pod (`step_lower_bound(exact_algorithm=...)`), and
    those collectives' costs (`sim.engine.costs.cost_collective`'s cache entries, to seed the
    worker that simulates the candidate). Job: (train request, axis order[, {cost cache key:
    CollectiveCost} computed by other workers, added to this process's cache first]) ->
    {"lower_bound_s": b or None, "costs": {...}}. MoE steps (per-chip expert loads scale their
    collectives) and pipelines keep the plain bound (None), as does a step the compiler
    refuses (its simulation reports the error)."""
    req, order, *known = job
    if known and known[0]:
        engine.seed_cost_cache(known[0])
    keys: list[tuple] = []
    try:
        pod = resolve_pod(req)
        chip, topo = pod.chip, pod.topology
        _trace, _base, model, tcfg = compile_step(
            req, topo.num_chips, moe_config(req, scenario_of(req, topo)), chip=chip)
        if model.is_moe or dict(order).get("pipeline", 1) > 1:
            return {"lower_bound_s": None, "costs": {}}
        # Less a relative 1e-12: sums of the same durations in another order than the
        # engine's may differ in the last bits, and this bound can be that tight.
        bound = step_lower_bound(model, order, topo.num_chips, tcfg, chip, topo,
                                 exact_algorithm=algorithm_of(req), cost_keys=keys) * (1 - 1e-12)
    except Exception:  # noqa: BLE001 - the simulation reports the error (run_point never raises)
        return {"lower_bound_s": None, "costs": {}}
    return {"lower_bound_s": bound, "costs": engine.cached_costs(keys)}


# The horizon of a prefix run is this many times the time its uncontended schedule first goes
# over HBM: the simulated step runs a few percent slower than that schedule, so the 405B plan's
# stopped pipelines go over well within it (at 1.28x their schedule's time). One program runs
# its collectives concurrently, on shared links, far slower than alone: the 405B plan's two
# one-program steps that go over do so at 28x (45 ms against 1.6 ms), so a prefix that reaches
# its horizon undecided is run again with a horizon PREFIX_HORIZON_GROWTH times longer, until
# it decides or would be the whole step (which then runs in full). The prefixes grow about as
# their horizons do, so the undecided ones cost a fraction 1/(growth - 1) of the last one.
PREFIX_HORIZON_FACTOR = 2.0
PREFIX_HORIZON_GROWTH = 8.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _PrefixSchedule:
    """A step's programs in their uncontended schedule, and when its HBM level first goes over
    the capacity there (`over_s`): what `prefix_ops` cuts prefixes from."""

    programs: list
    runs: Uncontended
    sends: list  # per program {send op id: (peer chip, tag)}
    recvs: list  # per program {tag: receive op id}
    over_s: float


def prefix_schedule(req: TrainRequest, capacity: float) -> _PrefixSchedule | None:
    """The uncontended schedule of the candidate's step (a pipeline's stage programs, or the
    one program `train` compiles) and the first time its HBM level (memory events applied at
    its op ends) goes over `capacity`; None where no prefix applies: the level never goes over
    (the step probably fits: it runs in full at once), MoE models (per-chip expert loads) and
    steps with perturbations (a chip faster than the chip spec would break the schedule's
    bound).

    The uncontended schedule (`Uncontended`, the programs as `step_lower_bound` runs them)
    starts every op no later than the simulation does, so an op whose schedule start is at or
    past a horizon H starts at H or later in the simulation too (`prefix_ops`)."""
    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        if model.is_moe or not scenario_of(req, topo).is_healthy:
            return None
        if mesh.size("pipeline") > 1:
            sp = stage_programs(model, mesh, topo.num_chips, tcfg)
            programs, sends, recvs = list(sp.programs), list(sp.sends), list(sp.recvs)
            runs = stage_schedule(sp, Floors(chip, topo, mesh_groups(mesh.axes, topo)))
        else:
            # The program `train` replays (the worker's compile cache then serves the run),
            # its collectives on the engine's own groups.
            trace = compile_training_step(model, mesh, topo.num_chips, tcfg)
            programs, sends, recvs = [trace], [{}], [{}]
            runs = Uncontended(programs, Floors(chip, topo, collective_groups(trace, topo)),
                                {}, {})
            runs.advance(0)
    except TpusimError:
        return None  # the simulation reports it
    if runs is None:
        return None
    over = math.inf
    for k, prog in enumerate(programs):
        level = static_hbm_bytes(prog.meta)
        for t, _i, d in sorted((runs.end[k][int(ev[0])], int(ev[0]), float(ev[2]))
                               for ev in prog.meta.memory_events or ()):
            level += d
            if level > capacity:
                over = min(over, t)
                break
    if not math.isfinite(over) or over <= 0:
        return None  # (at 0 the prefix would be empty: ops of zero length end at 0 too)
    return _PrefixSchedule(programs=programs, runs=runs, sends=sends, recvs=recvs, over_s=over)


def prefix_ops(sched: _PrefixSchedule,
               horizon: float) -> tuple[tuple[frozenset[int], ...], float] | None:
    """(per program, the ids of the ops that may start before `horizon`; the horizon in s),
    for `stop_when_hbm_exceeds(prefix=...)`; None if that is every op (the whole step).

    Each program's set is its ops that start before H in the uncontended schedule, and the
    receives of their sends (a receive completes with its send); every dependency of such an
    op ends before it starts, so before H too: the set holds everything its ops wait for."""
    runs, programs, sends, recvs = sched.runs, sched.programs, sched.sends, sched.recvs
    p = len(programs)
    # A receive completes with its send: in the prefix when the send is.
    recv_ids = [set(recvs[k].values()) for k in range(p)]
    keep = [{i for i, t in enumerate(runs.start[k]) if t < horizon and i not in recv_ids[k]}
            for k in range(p)]
    recv_of = {tag: (k, rid) for k in range(p) for tag, rid in recvs[k].items()}
    for k in range(p):
        for sid, (_ch, tag) in sends[k].items():
            if sid in keep[k] and tag in recv_of:
                j, rid = recv_of[tag]
                keep[j].add(rid)
    if all(len(keep[k]) == len(programs[k].ops) for k in range(p)):
        return None  # the whole step: its full watched run decides at the same cost
    return tuple(frozenset(x) for x in keep), horizon


def hbm_prefix(req: TrainRequest,
               capacity: float) -> tuple[tuple[frozenset[int], ...], float] | None:
    """The first prefix `simulate` runs for a step that may go over `capacity` early:
    `prefix_ops` at H = `PREFIX_HORIZON_FACTOR` times the first time the uncontended
    schedule's HBM level goes over (`prefix_schedule`); None where no prefix applies."""
    sched = prefix_schedule(req, capacity)
    return None if sched is None else prefix_ops(sched, PREFIX_HORIZON_FACTOR * sched.over_s)


def _pipeline_run(req: TrainRequest) -> None:
    """The engine run of the candidate's pipeline step as `sim.runs.train.run_train` makes
    it (the same stage programs, perturbations and algorithm), without compiling the whole
    step's trace, which only its summary needs (dense models: `pipeline_base` takes no expert
    loads from it)."""
    chip, topo, model, mesh, tcfg = _bound_inputs(req)
    check_schedule(tcfg.pipeline_schedule, mesh.size("pipeline"), tcfg.microbatches,
                   tcfg.virtual_stages)
    sp = stage_programs(model, mesh, topo.num_chips, tcfg)
    simulate_pipeline_chips(model, mesh, chip, topo, tcfg,
                            base=pipeline_base(req, sp.programs[0], topo),
                            algorithm=algorithm_of(req))


def simulate(job: tuple) -> dict[str, Any]:
    """`run_point(req)` (the candidate as `tpusim train` runs it), after adding collective
    costs computed by another worker to this process's cache (the same pure function's values,
    so the result is the same). Job: (train request, {cost cache key: CollectiveCost}, HBM
    capacity or None): with a capacity, a step whose HBM level goes over it is stopped there
    (`sim.engine.executors.stop_when_hbm_exceeds`: it is out of memory, as `train` would find) and
    the result is {"out_of_memory": True, "hbm_level_bytes": level}. A step (a pipeline or
    one program) that may go over early (`prefix_schedule`) first runs only the ops that can
    start before a horizon: going over before it is the full run's verdict; reaching it
    undecided, the prefix grows (`PREFIX_HORIZON_GROWTH`) until it decides or would be the
    whole step, which then runs in full."""
    req, costs, capacity = job
    if costs:
        seed_cost_cache(costs)
    if capacity is None:
        return run_point(req)
    sched = prefix_schedule(req, capacity)
    horizon = PREFIX_HORIZON_FACTOR * sched.over_s if sched is not None else 0.0
    while sched is not None and (prefix := prefix_ops(sched, horizon)) is not None:
        with stop_when_hbm_exceeds(capacity, prefix=prefix) as watch:
            try:
                if len(prefix[0]) > 1:  # a pipeline's stage programs
                    _pipeline_run(req)
                else:
                    run_point(req)  # returns the error (over capacity, or no verdict)
            except TpusimError:
                pass  # over capacity, or no verdict (the full run below reports any error)
        if watch.exceeded:
            return {"out_of_memory": True, "hbm_level_bytes": watch.level_bytes,
                    "prefix": True}
        if not watch.reached_horizon:
            break  # the watch does not apply, or another error: the full run reports it
        horizon *= PREFIX_HORIZON_GROWTH
    with stop_when_hbm_exceeds(capacity) as watch:
        out = run_point(req)
    if watch.exceeded:
        return {"out_of_memory": True, "hbm_level_bytes": watch.level_bytes}
    return out


def refine_and_run(job: tuple) -> dict[str, Any]:
    """Simulate one candidate as `tpusim train ARGV` does, unless its sharper lower bound
    (`sharper_bound`; the engine then finds the collective costs in this process's cache)
    proves it cannot enter the top K. Job: (train request, axis order, threshold): a bound >=
    threshold returns {"pruned": True, "lower_bound_s": b}; otherwise `run_point`'s result
    plus "lower_bound_s" (None where there is no sharper bound)."""
    req, order, threshold = job
    bound = sharper_bound((req, order))["lower_bound_s"]
    if bound is not None and bound >= threshold:
        return {"pruned": True, "lower_bound_s": bound}
    out = run_point(req)
    out["lower_bound_s"] = bound
    return out

