"""The fit of the chip presets' factors to the measured MaxText runs (`--fit`, `--write`): per
generation, `mxu_efficiency` on a grid on the odd-indexed half (the even one held out), the
DCN overhead per message (on step times or on slice-count slowdowns), the hbm / ici scans
that test whether the data identify them, and the same fit with MaxText's other remat
mappings. `run_fits` runs the jobs in worker processes; the results do not depend on how
many.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from sim.chips import get_chip
from sim.hardware import ChipSpec
from validation.maxtext_predict import median_abs, predict
from validation.maxtext_runs import (
    GENERATIONS,
    NAMED,
    Case,
    load_cases,
)
from workloads.training import Remat

# ---- fitting ----------------------------------------------------------------------------------

# The knobs' search grids (achievable fractions of a peak, kept within a plausible 0.5-1.0).
MXU_GRID = tuple(round(0.50 + 0.01 * i, 2) for i in range(51))  # 0.50 .. 1.00
SCAN_GRID = (1.0, 0.9, 0.8, 0.7)  # hbm / ici values scanned for identifiability
# dcn_message_overhead_s values (seconds per DCN message) fitted per generation, and how:
# "step": jointly with the MXU factor on the step times (v5e: four model families, each over
# 1-32 data-parallel slices, so their per-family offsets average out); "slowdown": on each
# multi-slice run's step relative to the same run on one slice (v6e: one such family, the
# Gemma-3 runs, whose common offset at one slice a step-time fit would make the overhead
# absorb; the ratio leaves it out, and the overhead moves only the multi-slice steps). The v6e
# grid reaches past the step-time objective's minimum so that the table shows where that fit
# would land.
# Seconds per message of each generation's cross-slice all-reduces (`DP_GRAD_SPLIT`): v5e's one
# a layer, v6e's one per weight matrix and one for the norm scales (8 a layer).
DCN_GRIDS = {
    "v5e": (0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1.0e-3, 1.5e-3),
    "v6e": tuple(ms * 1e-3 for ms in (0, 0.1, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.8,
                                      1.0, 1.25, 1.5)),
}
DCN_FIT_OBJECTIVES = {"v5e": "step", "v6e": "slowdown"}


def objective(cases: list[Case], chip: ChipSpec) -> float:
    """Mean |log(predicted / measured)| of the step time over `cases` (robust, symmetric)."""
    return round(statistics.fmean(abs(predict(c, chip).log_error) for c in cases), 9)


def single_slice_twin(case: Case, cases: list[Case]) -> Case | None:
    """The usable run that is `case` on one slice (same chip, slice, model, ICI mesh, batch,
    remat and settings; only the slice count and the DCN axes differ), if one was measured."""
    if case.num_slices == 1:
        return None
    same = ("chip", "slice_name", "model", "mesh", "axis_map", "remat", "seq_len",
            "batch_per_chip", "capacity_factor", "vocab_tiling", "optimizer", "param_dtype")
    for c in cases:
        if (c.num_slices == 1 and not c.low_quality
                and all(getattr(c, k) == getattr(case, k) for k in same)):
            return c
    return None


def slowdown_pairs(chosen: list[Case], cases: list[Case]) -> list[tuple[Case, Case]]:
    """(multi-slice run, its one-slice twin) for the runs of `chosen` that have a twin."""
    pairs = [(c, single_slice_twin(c, cases)) for c in chosen if c.num_slices > 1]
    return [(c, t) for c, t in pairs if t is not None]


def slowdown_error(run: Case, twin: Case, chip: ChipSpec) -> float:
    """log(predicted slowdown / measured slowdown), the slowdown being the multi-slice run's step
    over its one-slice twin's: what the slice count adds, without the pair's common offset."""
    return math.log(predict(run, chip).step_s / predict(twin, chip).step_s
                    / (run.measured_step_s / twin.measured_step_s))


def slowdown_objective(pairs: list[tuple[Case, Case]], chip: ChipSpec) -> float:
    """Mean |slowdown_error| over (multi-slice run, one-slice twin) pairs."""
    return round(statistics.fmean(abs(slowdown_error(c, t, chip)) for c, t in pairs), 9)


def best_mxu(
    cases: list[Case], chip: ChipSpec, start: float = 0.80, strides: tuple[int, ...] = (5, 1)
) -> tuple[float, float, int]:
    """The MXU efficiency on the 0.01 grid minimising `objective`, by descent from `start`.

    The objective is unimodal in the MXU efficiency (it scales every matmul's duration), so a
    0.05 coarse descent followed by a 0.01 one finds the grid minimum. Ties keep the value met
    first. Returns (mxu, objective, evaluations).
    """
    memo: dict[float, float] = {}

    def f(i: int) -> float:
        m = MXU_GRID[i]
        if m not in memo:
            memo[m] = objective(cases, chip.with_overrides(mxu_efficiency=m))
        return memo[m]

    i = MXU_GRID.index(round(start, 2))
    for stride in strides:
        for step in (-stride, stride):
            while 0 <= i + step < len(MXU_GRID) and f(i + step) < f(i):
                i += step
    return MXU_GRID[i], f(i), len(memo)


@dataclass(kw_only=True)
class FitResult:
    generation: str
    subset: str  # "odd" (the fit) or "even" (the same fit on the other half, for stability)
    custom_remat: str
    n: int
    mxu: float
    objective: float
    median_abs: float
    evaluations: int
    hbm_scan: list[tuple[float, float, float]] = field(default_factory=list)  # (hbm, mxu, obj)
    ici_scan: list[tuple[float, float, float]] = field(default_factory=list)  # (ici, mxu, obj)
    dcn_message: float = 0.0  # fitted dcn_message_overhead_s (the shipped one where not fitted)
    dcn_objective: str = ""  # how it was fitted (DCN_FIT_OBJECTIVES; "" = not fitted)
    # (dcn, mxu, objective): "step" fits re-optimise the MXU factor at every value; "slowdown"
    # fits hold it at its fit without the overhead and give the slowdown objective.
    dcn_scan: list[tuple[float, float, float]] = field(default_factory=list)
    # "slowdown" fits: the step-time objective at every value too (same MXU factor), the fit
    # the slowdown replaces.
    dcn_step_scan: list[tuple[float, float]] = field(default_factory=list)
    # "step" fits: the slowdown objective at every value too (its MXU factor), the other
    # method's view of the same runs.
    dcn_slowdown_scan: list[tuple[float, float]] = field(default_factory=list)
    dcn_pairs: tuple[str, ...] = ()  # the subset's multi-slice runs with a one-slice twin
    all_median_abs: float = float("nan")  # median over every usable case of the generation


def subset_cases(cases: list[Case], generation: str, subset: str) -> list[Case]:
    odd = subset == "odd"
    return [c for c in cases if c.chip == generation and not c.low_quality
            and (c.index % 2 == 1) == odd]


def fit_job(job: tuple[str, str, str, bool, str]) -> FitResult:
    """One fit: (generation, subset, custom-remat mapping, scan hbm/ici?, runs file).

    Top-level so that it can run in a worker process; it rebuilds its cases from the file.
    """
    generation, subset, custom_remat, scan, runs = job
    cases, _ = load_cases(Path(runs), custom_remat=None if custom_remat == NAMED
                          else Remat(custom_remat))
    chosen = subset_cases(cases, generation, subset)
    roof = get_chip(generation).with_overrides(
        mxu_efficiency=1.0, hbm_efficiency=1.0, ici_efficiency=1.0, vpu_efficiency=1.0,
        dcn_efficiency=1.0, op_overhead_s=0.0)
    dcn_scan, step_scan, slow_scan = [], [], []
    pairs: list[tuple[Case, Case]] = []
    evals = 0
    how = DCN_FIT_OBJECTIVES.get(generation, "") if custom_remat == NAMED else ""
    final_start = 0.80
    if how == "step":
        # The per-message DCN overhead and the MXU factor, jointly: the MXU factor re-optimised
        # at every grid value, the pair with the lowest objective kept.
        start = 0.80
        pairs = slowdown_pairs(chosen, cases)
        for value in DCN_GRIDS[generation]:
            m, o, e = best_mxu(chosen, roof.with_overrides(dcn_message_overhead_s=value),
                               start=start)
            evals += e
            dcn_scan.append((value, m, o))
            if pairs:
                slow_scan.append((value, slowdown_objective(pairs, roof.with_overrides(
                    dcn_message_overhead_s=value, mxu_efficiency=m))))
            start = m
        dcn_msg = min(dcn_scan, key=lambda t: t[2])[0]
    elif how == "slowdown":
        # The overhead on the slice-count slowdowns, at the MXU factor fitted without it (a
        # step ratio hardly depends on it); then the MXU factor refitted with the overhead.
        pairs = slowdown_pairs(chosen, cases)
        if not pairs:
            raise ValueError(f"{generation} {subset}: no multi-slice run with a one-slice twin "
                             "to fit dcn_message_overhead_s on")
        m0, _, e = best_mxu(chosen, roof.with_overrides(dcn_message_overhead_s=0.0))
        evals += e
        final_start = m0
        # A one-slice run sends nothing over DCN: its step does not depend on the overhead.
        one = roof.with_overrides(mxu_efficiency=m0)
        fixed = sum(abs(predict(c, one).log_error) for c in chosen if c.num_slices == 1)
        for value in DCN_GRIDS[generation]:
            chip = one.with_overrides(dcn_message_overhead_s=value)
            dcn_scan.append((value, m0, slowdown_objective(pairs, chip)))
            moving = sum(abs(predict(c, chip).log_error) for c in chosen if c.num_slices > 1)
            step_scan.append((value, round((fixed + moving) / len(chosen), 9)))
        dcn_msg = min(dcn_scan, key=lambda t: t[2])[0]
    else:
        # Not fitted here: the generation's shipped overhead (0 where none is fitted).
        dcn_msg = get_chip(generation).dcn_message_overhead_s
    roof = roof.with_overrides(dcn_message_overhead_s=dcn_msg)
    mxu, obj, e = best_mxu(chosen, roof, start=final_start)
    evals += e
    preds = [predict(c, roof.with_overrides(mxu_efficiency=mxu)) for c in chosen]
    res = FitResult(generation=generation, subset=subset, custom_remat=custom_remat,
                    n=len(chosen), mxu=mxu, objective=obj, median_abs=median_abs(preds),
                    evaluations=evals, dcn_message=dcn_msg, dcn_objective=how,
                    dcn_scan=dcn_scan, dcn_step_scan=step_scan, dcn_slowdown_scan=slow_scan,
                    dcn_pairs=tuple(c.id for c, _ in pairs))
    if scan:
        for knob, out in (("hbm_efficiency", res.hbm_scan), ("ici_efficiency", res.ici_scan)):
            for value in SCAN_GRID:
                if value == 1.0:
                    out.append((value, mxu, obj))
                    continue
                m, o, e = best_mxu(chosen, roof.with_overrides(**{knob: value}), start=mxu,
                                   strides=(1,))
                res.evaluations += e
                out.append((value, m, o))
    if subset == "odd" and custom_remat != NAMED:
        every = [c for c in cases if c.chip == generation and not c.low_quality]
        res.all_median_abs = median_abs(
            [predict(c, roof.with_overrides(mxu_efficiency=mxu)) for c in every])
    return res


def run_fits(runs: Path, jobs: int) -> list[FitResult]:
    """The fits behind the shipped factors, their other-half twins, and the remat check."""
    todo = []
    for g in GENERATIONS:
        for subset in ("odd", "even"):
            todo.append((g, subset, NAMED, True, str(runs)))
    for alt in (Remat.FULL, Remat.OFFLOAD, Remat.MINIMAL):
        todo.append(("v6e", "odd", str(alt), False, str(runs)))
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            return pool.map(fit_job, todo, chunksize=1)
    return [fit_job(j) for j in todo]


