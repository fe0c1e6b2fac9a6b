"""`plan`: search the ways to run one training step on a pod and rank them by simulated step
time (or cost, or energy).

The space (`sim.studies.plan_space`) is enumerated and pruned by memory; every group of
candidates that differ only in placement is bounded from below (`sim.studies.plan_jobs`: a
compute floor first where it holds, a pipeline's pass-level bound, then the full bound of
step time and HBM peak; a candidate whose HBM bound is over capacity is out of memory, as
`tpusim train` would find, without simulating it); the others are taken best first (lowest
bound), each candidate's bound sharpened before it is simulated as `tpusim train` would, on
the sweep's workers, until the next bound is no better than the K-th best simulated step:
those left cannot enter the top K, which is therefore exact, the best of the whole space and
not a heuristic's guess.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.export.output import check_output_dir, write_json, write_tables
from sim.hardware import ChipSpec
from sim.runs.bind import resolve_model, resolve_pod
from sim.runs.requests import EXHAUSTIVE_MAX_SIMULATIONS, PlanRequest, TrainRequest
from sim.studies.backends import JobPool, check_dask, check_workers, num_workers
from sim.studies.plan_bounds import floor_applies
from sim.studies.plan_jobs import (
    floor_bounds,
    lower_bounds,
    pipeline_bounds,
    sharper_bound,
    simulate,
)
from sim.studies.plan_objectives import objective_floor, objective_per_second, objective_value
from sim.studies.plan_report import (
    PlanResult,
    candidate_rows,
    explain,
    plan_summary,
    plan_table,
    pod_label,
    ranked,
)
from sim.studies.plan_space import (
    Candidate,
    PlanConfig,
    PodVariant,
    check_space_size,
    enumerate_candidates,
    plan_config,
    pod_variants,
)
from sim.studies.plots import plot_cost_frontier, plot_frontier
from sim.studies.results import STATUS_DOES_NOT_FIT, STATUS_ERROR
from topologies.errors import TpusimError, python_name
from topologies.progress import NO_TASK, ProgressCallback, reporting, task
from topologies.validate import api_call, short_repr
from workloads.models import TransformerSpec


def run_plan(base: TrainRequest, model, topology, chip, cfg: PlanConfig, *,
             workers: int = 0, dask: Any = None, quiet: bool = False,
             prune_by_bound: bool = True, refuse_by_hbm_bound: bool = True,
             stop_out_of_memory: bool = True,
             max_simulations: int | None = None,
             variants: list[PodVariant] | None = None,
             spell: Callable[[str], str] = python_name) -> PlanResult:
    """Enumerate and prune by memory; bound every candidate from below (one compile per mesh
    sizes and settings, shared by its placements): its step time, and its HBM peak (a
    candidate whose peak bound is over HBM is out of memory, as `tpusim train` would find,
    without simulating it); take the others best first (lowest bound), sharpening each
    candidate's bound before simulating it (as `tpusim train`, on the sweep's workers), until
    the next bound is no better than the K-th best simulated step: those left cannot enter the
    top K, which is therefore exact. A simulation whose HBM goes over capacity stops there (out
    of memory; its time is not needed). `prune_by_bound=False`, `refuse_by_hbm_bound=False` and
    `stop_out_of_memory=False` turn the shortcuts off (the brute-force oracle).
    `max_simulations`: with `prune_by_bound=False` (every candidate simulated), refuse a space
    of more candidates than that before anything runs (the `exhaustive` plan's guard).
    `variants`: the slices searched (shapes and wirings of the same chip count, `pod_variants`);
    every candidate of every slice is one more candidate of the same search, its bounds and
    pruning unchanged (default: `topology` alone). `spell`: how the table writes the settings
    a failed candidate's error names (the Python name; the CLI: its flags)."""
    t0 = time.perf_counter()
    if cfg.objective == "cost" and chip.usd_per_chip_hour is None:
        raise TpusimError(
            f"plan {{objective}} cost: {chip.name} has no list price; give one with {{set}} "
            f"usd_per_chip_hour=PRICE (dollars per chip-hour)", "objective", "set")
    variants = variants or [PodVariant(topology=topology)]
    searched_pods = any(v.shape is not None for v in variants)
    if len(variants) > 1:
        check_space_size(model, topology.num_chips, cfg, len(variants))
    cands, counts = _enumerate(model, chip, cfg, variants, searched_pods)
    if not prune_by_bound and max_simulations is not None and len(cands) > max_simulations:
        raise TpusimError(
            f"plan {{exhaustive}} would simulate {len(cands):,} candidates to the end, over the "
            f"limit of {max_simulations:,} (each is a whole `tpusim train` run); give "
            f"{{max_simulations}} {len(cands)} to run them all, narrow the space ({{axes}}, "
            f"{{max_*}}, {{remat}}, {{microbatches}}, {{default_placement}}), or drop "
            f"{{exhaustive}} (the default search gives the same top K)",
            # `max_*`: every max_<axis> setting at once
            "exhaustive", "max_simulations", "axes", "max_*", "remat", "microbatches",
            "default_placement"
        )
    reqs = _candidate_requests(base, cfg, cands, variants, topology.num_chips)
    check_workers(workers)
    check_dask(dask)
    n = num_workers(workers)
    groups = _group(cands, reqs)
    level = _first_levels(model, cands, groups) if prune_by_bound else {}
    pool = JobPool(min(n, max(len(groups.jobs), 1)), dask)
    search = _Search(cands, reqs, groups, level, pool, model=model, chip=chip, cfg=cfg,
                     n_chips=topology.num_chips, prune_by_bound=prune_by_bound,
                     refuse_by_hbm_bound=refuse_by_hbm_bound,
                     stop_out_of_memory=stop_out_of_memory, quiet=quiet)
    try:
        search.bound_groups()
        search.best_first()
    finally:
        search.bar.close()
        pool.close()
    rows = candidate_rows(cands, search.results, search.lb, search.refused, search.stopped,
                          cfg.objective)
    ok, rest = ranked(rows)
    counts.update(search.counts(ok, rest))
    caps = [x["_capacity"] for x in rows if x["_capacity"]]
    return PlanResult(table=plan_table(ok, rest, searched_pods, spell),
                      explanation=explain(ok, cfg.objective), counts=counts,
                      objective=cfg.objective,
                      hbm_capacity_bytes=caps[0] if caps else math.nan,
                      wall_s=time.perf_counter() - t0, model=model.name,
                      pod=pod_label(variants, topology, chip))


def _enumerate(model, chip, cfg: PlanConfig, variants: list[PodVariant],
               searched_pods: bool) -> tuple[list[Candidate], dict[str, int]]:
    """Every slice's candidates, one search space, and the counts summed over the slices
    (with `slices` when slices were searched)."""
    cands: list[Candidate] = []
    counts: dict[str, int] = {}
    for v in variants:
        vc, vn = enumerate_candidates(model, v.topology, chip, cfg, v if searched_pods else None)
        cands += vc
        counts = {k: counts.get(k, 0) + n for k, n in vn.items()}
    if searched_pods:
        counts["slices"] = len(variants)  # listed only when slices were searched
    return cands, counts


def _candidate_requests(base: TrainRequest, cfg: PlanConfig, cands: list[Candidate],
                        variants: list[PodVariant], n_chips: int) -> list[TrainRequest]:
    """Every candidate is `base` (the pod, model and overrides) with its own settings and
    slice: a request, as `tpusim train` would build it."""
    changes = {(v.shape, v.twist): v.request_changes() for v in variants}
    batch_per_chip = repr(cfg.global_batch / n_chips)
    return [base.replace(seq_len=cfg.seq_len, batch_per_chip=batch_per_chip,
                         **changes[(c.shape, c.twist)], **c.train_settings()) for c in cands]


@dataclass(frozen=True, slots=True)
class _Groups:
    """The candidates grouped by everything but their placement: one bound job per group,
    (the first member's request, every member's axis order), its placements sharing the
    compiled trace; `piped`: the groups with pipeline stages."""

    jobs: list[tuple]
    members_of: list[list[int]]
    group_of: dict[int, int]
    piped: set[int]


def _group(cands: list[Candidate], reqs: list[TrainRequest]) -> _Groups:
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cands):
        key = (c.shape, c.twist, tuple(sorted(c.mesh)), c.remat, c.microbatches,
               c.param_dtype, c.grad_dtype, c.optimizer_dtype)
        groups.setdefault(key, []).append(i)
    members_of = list(groups.values())
    return _Groups(
        jobs=[(reqs[members[0]], [cands[i].mesh for i in members]) for members in members_of],
        members_of=members_of,
        group_of={i: k for k, members in enumerate(members_of) for i in members},
        piped={k for k, members in enumerate(members_of)
               if dict(cands[members[0]].mesh).get("pipeline", 1) > 1})


def _first_levels(model, cands: list[Candidate], groups: _Groups) -> dict[int, str]:
    """The first bound of each group that does not get its full bound at once: `floor` (the
    compute floor, `floor_bounds`) or `pipeline` (`pipeline_bounds`).

    A pipeline group's first bound is `pipeline_bounds` (its chunk programs only); the stage
    programs' bounds (`lower_bounds`: a few seconds each on 405B, most of them building M
    copies of every pass) follow only when one of its candidates reaches the front of the
    queue, i.e. could still enter the top K. Cheaper still, and first where it applies (dense
    models whose layers are all alike): the group's compute floor (from models of 2 and 3
    layers per chunk, without compiling the step); its pipeline or full bound follows only
    when one of its candidates reaches the front. On LLaMA-3-70B on a v5p-128 the floors of
    every full-remat group (26.7 s or more) are above the best steps (22.2-23.0 s): those
    groups are never compiled. The brute-force oracle bounds every group in full from the
    start (no levels)."""
    level: dict[int, str] = {}
    for k, members in enumerate(groups.members_of):
        sizes = dict(cands[members[0]].mesh)
        if floor_applies(model, sizes):  # (plan's candidates have one virtual stage)
            level[k] = "floor"
        elif k in groups.piped:
            level[k] = "pipeline"
    return level


# A group's first bound by its level (without one: `lower_bounds`, the full bound).
_FIRST_BOUND = {"floor": floor_bounds, "pipeline": pipeline_bounds}


class _Search:
    """One plan search while its jobs run: every candidate's lower bound (`lb`) and what became
    of it (simulated: `results`; out of memory by its HBM bound: `refused`, or when its
    simulation went over: `stopped`; left in line: `skipped`), the groups' bound levels, the
    K best objective values so far, and the progress bar (one tick per bound job and per
    candidate decided)."""

    def __init__(self, cands: list[Candidate], reqs: list[TrainRequest], groups: _Groups,
                 level: dict[int, str], pool: JobPool, *, model, chip, cfg: PlanConfig,
                 n_chips: int, prune_by_bound: bool, refuse_by_hbm_bound: bool,
                 stop_out_of_memory: bool, quiet: bool):
        self.cands, self.reqs, self.groups, self.level, self.pool = cands, reqs, groups, level, pool
        self.model, self.chip, self.cfg, self.n_chips = model, chip, cfg, n_chips
        self.prune = prune_by_bound
        self.refuse_by_hbm_bound = refuse_by_hbm_bound
        self.stop_out_of_memory = stop_out_of_memory
        # group -> its compute floor, checked by its full bound
        self.floor_of: dict[int, float] = {}
        self.floor_violated = False
        self.results: dict[int, dict[str, Any]] = {}
        self.lb: list[float] = [0.0] * len(cands)
        self.refused: set[int] = set()  # out of memory by their HBM peak bound: never simulated
        self.stopped: set[int] = set()  # out of memory: simulation stopped when HBM went over
        self.capacity: dict[int, float] = {}
        self.bound_violated = False
        self.skipped: list[int] = []
        self.pruned: list[int] = []  # skipped by their sharper bound
        self.sharp: set[int] = set()  # candidates with a sharper bound
        self.refined = 0
        self.prefix_stopped = 0  # of `stopped`: steps stopped within a prefix run
        # Pipeline groups bounded in full at once, and groups bounded in full (so far).
        self.full_pipeline_bounds = len(groups.piped - set(level))
        self.full_bounds = len(groups.jobs) - len(level)
        # One tick per bound job and per candidate (simulated, refused or skipped); the detail
        # line: groups bounded, candidates simulated and left, the best step so far.
        self.bar = NO_TASK if quiet else task("plan (exhaustive)" if not prune_by_bound
                                              else "plan",
                                              total=len(groups.jobs) + len(cands), unit="job")
        self.bounded_jobs = 0
        self.best_step = math.inf
        # The best-first phase: objective values (step-time units) of those that fit, sorted;
        # the line of (bound, candidate); the jobs running.
        self.best: list[float] = []
        self.per_s = 1.0
        self.heap: list[tuple[float, int]] = []
        self.sharpened: set[int] = set()  # sharper bound asked for (it may not exist: None)
        self.costs_of: dict[int, dict] = {}
        # Every collective cost a sharper bound returned, handed to the next sharper bounds
        # (candidates share many collectives, and a cost is the same pure function's value on
        # any worker: computed once per plan instead of once per worker).
        self.known: dict[tuple, Any] = {}
        self.inflight: dict[Any, tuple[str, int]] = {}
        self.waiting: dict[int, list[int]] = {}  # group -> members popped while its bound runs

    def tick(self, n: int = 1) -> None:
        if not self.bar.active:
            return
        decided = len(self.refused) + len(self.results) + len(self.stopped) + len(self.skipped)
        best = f", best {self.best_step:.4g} s" if self.best_step < math.inf else ""
        self.bar.update(self.bar.done + n,
                        detail=f"bounded {self.bounded_jobs}/{len(self.groups.jobs)}, "
                               f"simulated {len(self.results) + len(self.stopped)}, left "
                               f"{len(self.cands) - decided}{best}")

    def take_bounds(self, k: int, b: dict[str, Any]) -> list[int]:
        """Group k's bounds into `lb`, `capacity` and `refused`; the members newly refused."""
        members = self.groups.members_of[k]
        if "floor_s" in b:
            self.floor_of[k] = b["floor_s"]
        if "core_floor_s" in b and k in self.floor_of \
                and self.floor_of[k] * (1 - 1e-9) > b["core_floor_s"]:
            # The compiled step's core is less busy than its floor said: the floor does not
            # hold for this model, so no floor may rule a candidate out (every group gets its
            # full bound before the search stops).
            self.floor_violated = self.bound_violated = True
        # A group the bound cannot handle is simulated like any other (bound 0).
        for i, v in zip(members, b.get("lower_bounds_s") or [0.0] * len(members), strict=True):
            self.lb[i] = max(self.lb[i], v)
            if self.stop_out_of_memory and "hbm_capacity_bytes" in b:
                self.capacity[i] = b["hbm_capacity_bytes"]
        # Less a relative 1e-9: the engine sums the same deltas in another order.
        if self.refuse_by_hbm_bound and b.get("hbm_lower_bound_bytes", 0.0) * (1 - 1e-9) \
                > b.get("hbm_capacity_bytes", math.inf):
            new = [i for i in members if i not in self.refused]
            self.refused.update(new)
            return new
        return []

    def bound_groups(self) -> None:
        """Every group's first bound (its full bound where it has no level), largest groups
        first so that the pool stays busy to the end."""
        jobs, members_of, level = self.groups.jobs, self.groups.members_of, self.level
        order_jobs = sorted(range(len(jobs)), key=lambda k: (-len(members_of[k]), k))
        futs = {self.pool.submit(_FIRST_BOUND[level[k]] if k in level else lower_bounds,
                                 jobs[k], f"bound-{k}"): k for k in order_jobs}
        while futs:
            for f in self.pool.wait_any(futs):
                k = futs.pop(f)
                b = f.result()
                if level.get(k) == "pipeline" and "error" in b:
                    del level[k]  # the full bound reports nothing more: bound 0
                self.take_bounds(k, b)
                self.bounded_jobs += 1
                self.tick()

    def best_first(self) -> None:
        """The candidates best first: the one with the lowest bound is next. Without its
        sharper bound yet, a worker computes that (a fraction of a simulation; the collective
        costs it computes go with the candidate to the worker that simulates it) and the
        candidate goes back in line with it; with it, it is simulated. A candidate whose group
        has only its first bound waits for the group's next bound (which may raise every
        member's bound or refuse them by HBM) and goes back in line. Stop when the next bound
        is no better than the K-th best simulated step that fits (it only decreases): every
        candidate left cannot enter the top K. The sharper bounds are within a few percent of
        the step, so the fast candidates are simulated first and most slow ones never."""
        order = sorted((i for i in range(len(self.cands)) if i not in self.refused),
                       key=lambda i: (self.lb[i], i))
        self.tick(len(self.refused))
        self.per_s = objective_per_second(self.chip, self.n_chips, self.cfg.objective)
        if self.per_s <= 0:
            self.prune = False  # nothing bounds the objective (a free or idle-less chip)
        self.heap = [(self.lb[i], i) for i in order]
        heapq.heapify(self.heap)
        while self.heap or self.inflight:
            self._submit_ready()
            if not self.inflight:
                break
            for f in self.pool.wait_any(self.inflight):
                kind, i = self.inflight.pop(f)
                o = f.result()
                if kind == "bound":
                    self._take_group_bound(i, o)
                elif kind == "refine":
                    self._take_sharper_bound(i, o)
                else:
                    self._take_simulation(i, o)
        # Left in line (an entry per time a candidate went back in line: once each here).
        self.skipped = sorted({i for _b, i in self.heap} - self.refused - set(self.results)
                              - self.stopped)
        self.pruned = [i for i in self.skipped if i in self.sharp]
        self.tick(len(self.skipped))

    def _refinable(self, i: int) -> bool:
        return (self.prune and i not in self.sharpened and not self.model.is_moe
                and dict(self.cands[i].mesh).get("pipeline", 1) <= 1)

    def _submit_ready(self) -> None:
        """Submit the next candidates in line while a worker is free: each its group's next
        bound, its sharper bound or its simulation; none once the next bound cannot beat the
        K-th best (a running job may still lower it)."""
        heap, lb, pool, top = self.heap, self.lb, self.pool, self.cfg.top
        while heap and len(self.inflight) < pool.n:
            b, i = heap[0]
            if (self.prune and not self.bound_violated and len(self.best) >= top
                    and b >= self.best[top - 1]):
                break  # the rest wait: a running job may still lower the K-th best
            heapq.heappop(heap)
            if i in self.refused:
                continue
            if b < lb[i]:  # its group's full bound raised it since: back in line
                heapq.heappush(heap, (lb[i], i))
                continue
            k = self.groups.group_of[i]
            if k in self.waiting:
                self.waiting[k].append(i)
            elif k in self.level:
                self._submit_next_bound(k, i)
            elif self._refinable(i):
                self.sharpened.add(i)
                job = (self.reqs[i], self.cands[i].mesh, dict(self.known) if pool.n > 1 else {})
                self.inflight[pool.submit(sharper_bound, job, f"refine-{i}")] = ("refine", i)
            else:
                job = (self.reqs[i], self.costs_of.pop(i, {}), self.capacity.get(i))
                self.inflight[pool.submit(simulate, job, f"plan-{i}")] = ("simulate", i)

    def _submit_next_bound(self, k: int, i: int) -> None:
        """Group k's next bound, asked for by its member i: a pipeline's pass-level bound
        after its floor, else the full one; the group's members wait for it."""
        level = self.level
        nxt = "pipeline" if level[k] == "floor" and k in self.groups.piped else "full"
        self.waiting[k] = [i]
        if nxt == "pipeline":
            level[k] = nxt
            fn = pipeline_bounds
        else:
            del level[k]
            self.full_bounds += 1
            self.full_pipeline_bounds += k in self.groups.piped
            fn = lower_bounds
        self.inflight[self.pool.submit(fn, self.groups.jobs[k], f"bound-{nxt}-{k}")] = \
            ("bound", k)

    def _take_group_bound(self, k: int, o: dict[str, Any]) -> None:
        if self.level.get(k) == "pipeline" and "error" in o:
            del self.level[k]  # bound 0 and nothing more to learn: simulate them
        newly = self.take_bounds(k, o)
        self.tick(len(newly))
        for j in self.waiting.pop(k):
            if j not in self.refused:
                heapq.heappush(self.heap, (self.lb[j], j))

    def _take_sharper_bound(self, i: int, o: dict[str, Any]) -> None:
        if o.get("lower_bound_s") is not None:
            self.refined += 1
            self.sharp.add(i)
            self.lb[i] = max(self.lb[i], o["lower_bound_s"])
        self.costs_of[i] = o.get("costs") or {}
        self.known.update(self.costs_of[i])
        heapq.heappush(self.heap, (self.lb[i], i))

    def _take_simulation(self, i: int, o: dict[str, Any]) -> None:
        if o.get("out_of_memory"):
            self.stopped.add(i)
            self.prefix_stopped += bool(o.get("prefix"))
            self.tick()
            return
        self.results[i] = o
        r = o.get("result") or {}
        if r.get("fits_in_hbm") and self.per_s > 0:
            # In step-time units: the objective less its floor, over its least growth per
            # second, is at least the step time; a candidate whose step-time bound is above
            # the K-th best of these cannot enter the top K.
            objective = self.cfg.objective
            v = objective_value(r, objective) - objective_floor(r, self.chip, self.n_chips,
                                                                objective)
            self.best = sorted([*self.best, v / self.per_s])
        if r and r["step_time_s"] < self.lb[i] * (1 - 1e-9):
            self.bound_violated = True  # the engine changed under the bound: stop pruning
        if r.get("fits_in_hbm"):
            self.best_step = min(self.best_step, float(r["step_time_s"]))
        self.tick()

    def counts(self, ok: list[dict[str, Any]], rest: list[dict[str, Any]]) -> dict[str, int]:
        """What the search did, for `PlanResult.counts` (after the enumeration's counts)."""
        jobs = self.groups.jobs
        return {
            "candidates": len(self.cands),
            "bounded": len(jobs),
            "bounded_by_compute_floor": sum(1 for k in range(len(jobs)) if k in self.floor_of),
            "bounded_in_full": self.full_bounds,
            "pipeline_groups_bounded_in_full": self.full_pipeline_bounds,
            "simulated": len(self.results) + len(self.stopped),
            "skipped_by_bound": len(self.skipped),
            "sharper_bounds": self.refined,
            "skipped_by_sharper_bound": len(self.pruned),
            "out_of_memory_by_hbm_bound": len(self.refused),
            "out_of_memory_stopped_early": len(self.stopped),
            "out_of_memory_stopped_in_prefix": self.prefix_stopped,
            "fit": len(ok),
            "out_of_memory": sum(1 for x in rest if x["status"] == STATUS_DOES_NOT_FIT),
            "failed": sum(1 for x in rest if x["status"] == STATUS_ERROR),
            "bound_violated": int(self.bound_violated),
            "compute_floor_violated": int(self.floor_violated),
        }


def search(req: PlanRequest, *, quiet: bool = False,
           spell: Callable[[str], str] = python_name) -> tuple[PlanResult, PlanConfig]:
    """(PlanResult, PlanConfig) of a plan request: the CLI's `plan` and `sim.plan` both
    (`spell`: how the table's errors write settings, `run_plan`'s)."""
    check_workers(req.workers)
    limit = req.max_simulations
    if limit is not None and not req.exhaustive:
        raise TpusimError(
            f"{{max_simulations}} {limit} limits {{exhaustive}} only (the default search simulates "
            f"just the candidates its bounds cannot rule out); add {{exhaustive}} or drop "
            f"{{max_simulations}}", "max_simulations", "exhaustive"
        )
    if limit is not None and limit < 1:
        raise TpusimError(f"{{max_simulations}} {limit} must be a positive integer (the most "
                          f"candidates {{exhaustive}} may simulate), e.g. 500",
                          "max_simulations", "exhaustive")
    limit = EXHAUSTIVE_MAX_SIMULATIONS if limit is None else limit
    cfg = plan_config(req)
    if req.slices != 1:
        raise TpusimError(f"{{slices}} {req.slices}: plan searches one slice; drop {{slices}}",
                          "slices")
    # Every candidate is this request's pod, model and overrides with its own settings.
    base = TrainRequest(chip=req.chip, slice=req.slice, shape=req.shape,
                        wraparound=req.wraparound, twist=req.twist, overrides=req.overrides,
                        model=req.model, chip_spec=req.chip_spec, model_spec=req.model_spec)
    pod = resolve_pod(base)
    model = resolve_model(base)[1]
    variants = pod_variants(req, pod)
    fast = not req.exhaustive
    res = run_plan(base, model, pod.topology, pod.chip, cfg, workers=req.workers,
                   dask=req.dask, quiet=quiet, prune_by_bound=fast, refuse_by_hbm_bound=fast,
                   stop_out_of_memory=fast, max_simulations=None if fast else limit,
                   variants=variants, spell=spell)
    return res, cfg


@api_call("sim.plan")
def plan(*, model: Any, seq_len: int, global_batch: int, chip: Any = None,
         slice: str | None = None, shape: str | None = None,  # noqa: A002 - the CLI's name
         wraparound: str | None = None, overrides: dict[str, Any] | None = None, top: int = 5,
         workers: int = 1, dask: Any = None, out: str | None = None, quiet: bool = False,
         progress: ProgressCallback | None = None, **space: Any) -> PlanResult:
    """`tpusim plan` from Python: the same search, the same result (`PlanResult`: `.table`
    ranked, `.best`, `.top(k)`, `.explanation`, `.counts`).

    Args:
        model: zoo name, model YAML path or `TransformerSpec`.
        chip, slice, shape, wraparound: the pod, as on the CLI (chip: name, YAML or `ChipSpec`).
        overrides: `{"ici_link_bytes_per_s": "x2", ...}`, as the CLI's set overrides.
        workers, dask: where candidates run (dask: "local", an address or a `distributed.Client`).
        out: also write candidates.csv/parquet, summary.json and frontier.png there.
        progress: called with a `ProgressUpdate` as groups are bounded and candidates decided
            (task `plan`: the groups bounded, candidates simulated and left, the best step so
            far); `quiet` reports nothing even to an enclosing `reporting` block's callback.
        space: the search-space settings by their Python names, e.g. `axes=("fsdp", "tensor")`,
            `remat=("full",)`, `microbatches=(1, 2)`, `max_tensor=4`, `default_placement=True`.
    """
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TpusimError(
            f"sim.plan(overrides={short_repr(overrides)}): give a dict such as "
            f"{{'ici_link_bytes_per_s': 'x2'}}, not {type(overrides).__name__}")
    if out is not None:
        if not isinstance(out, (str, os.PathLike)):
            raise TpusimError(f"sim.plan(out={short_repr(out)}): give a directory path or None, "
                              f"not {type(out).__name__}")
        if out:
            check_output_dir(out)  # before the search, as `tpusim plan --out` does
    check_dask(dask)  # the dask argument's check, before the search
    settings: dict[str, Any] = {"model": model, "seq_len": seq_len,
                                "global_batch": global_batch, "top": top, "workers": workers,
                                "chip": chip, "slice": slice, "shape": shape,
                                "wraparound": wraparound, "overrides": dict(overrides or {})}
    for k, v in space.items():
        settings[k] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
    objects = {}
    if isinstance(model, TransformerSpec):
        objects["model_spec"], settings["model"] = model, model.name
    if isinstance(chip, ChipSpec):
        objects["chip_spec"], settings["chip"] = chip, chip.name
    req = PlanRequest.from_flags({k: v for k, v in settings.items() if v is not None},
                                 caller="sim.plan", **objects)
    if dask is not None:
        req = req.replace(dask=dask)
    if progress is None:
        res, cfg = search(req, quiet=quiet)
    else:
        with reporting(progress):
            res, cfg = search(req, quiet=quiet)
    if out:
        summary = plan_summary(res, cfg.top)
        write_tables(out, {"candidates": res.table}, summary)
        plot_frontier(res, Path(out) / "frontier.png")
        plot_cost_frontier(res, Path(out) / "frontier_cost.png")
        write_json(Path(out) / "summary.json", summary)
    return res



__all__ = ["plan", "run_plan", "search"]
