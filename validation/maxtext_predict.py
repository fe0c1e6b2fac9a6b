"""A MaxText run's predicted step (`Prediction`, `predict`), the headline statistics, and
what a prediction implies (MXU utilisation, the MXU or expert efficiency that would make it
exact, the FSDP bytes per second, the MoE-only costs): the numbers `validation.maxtext`
prints and the document's effects read.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from sim.chips import get_chip
from sim.engine.executors import Executor, simulate_step
from sim.hardware import ChipSpec
from topologies.mesh import parse_mesh
from validation.maxtext_runs import (
    GENERATIONS,
    ROOT,
    Case,
    case_trace,
    trace_config,
    with_changes,
)
from workloads.trace import OpKind, Trace, Unit
from workloads.training import compile_training_step

DOC_FILE = ROOT / "docs" / "validation.md"
TARGET_MEDIAN = 0.05  # issue 11: median |error| <= 5% and worst <= 15% over all usable runs
TARGET_WORST = 0.15

@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    case: Case
    step_s: float
    fits_in_hbm: bool
    hbm_peak_gb: float
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_s(self) -> float:
        return self.case.batch_per_chip * self.case.seq_len / self.step_s

    @property
    def error(self) -> float:
        """Signed relative error of the predicted step time."""
        return (self.step_s - self.case.measured_step_s) / self.case.measured_step_s

    @property
    def log_error(self) -> float:
        return math.log(self.step_s / self.case.measured_step_s)

def predict(case: Case, chip: ChipSpec | None = None) -> Prediction:
    """Replay the case on `chip` (default: the shipped preset of its generation)."""
    chip = chip or get_chip(case.chip)
    trace, topo = case_trace(case)
    r = simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE)
    return Prediction(case=case, step_s=float(r.step_time_s), fits_in_hbm=bool(r.fits_in_hbm),
                      hbm_peak_gb=float(r.hbm_peak_bytes) / 1e9,
                      breakdown={k: float(v) for k, v in r.breakdown.items()})


def predict_all(cases: list[Case], overrides: dict[str, dict] | None = None) -> list[Prediction]:
    overrides = overrides or {}
    chips = {g: get_chip(g).with_overrides(**overrides.get(g, {})) for g in GENERATIONS}
    return [predict(c, chips[c.chip]) for c in cases]


# ---- statistics -------------------------------------------------------------------------------


def median_abs(preds: list[Prediction]) -> float:
    return statistics.median(abs(p.error) for p in preds) if preds else float("nan")


def summary(preds: list[Prediction]) -> dict[str, dict[str, float]]:
    """Median absolute error by group: all usable (non-low), per generation, fit/held-out."""
    good = [p for p in preds if not p.case.low_quality]
    groups = {"all": good}
    for g in GENERATIONS:
        groups[g] = [p for p in good if p.case.chip == g]
    groups["fit subset"] = [p for p in good if p.case.fit_subset]
    groups["held out"] = [p for p in good if not p.case.fit_subset]
    for g in GENERATIONS:
        groups[f"{g} held out"] = [p for p in good if p.case.chip == g and not p.case.fit_subset]
    groups["low quality"] = [p for p in preds if p.case.low_quality]
    groups["all incl. low"] = list(preds)
    return {k: {"n": len(v), "median_abs": median_abs(v),
                "max_abs": max((abs(p.error) for p in v), default=float("nan")),
                "mean_signed": statistics.fmean(p.error for p in v) if v else float("nan")}
            for k, v in groups.items()}


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"

def by_id(preds: list[Prediction]) -> dict[str, Prediction]:
    return {p.case.id: p for p in preds}


def hw_utilization(p: Prediction) -> float:
    """tpusim's MXU FLOPs of the run's step (recompute included, dead code not) per measured
    second, as a fraction of the chip's peak: what the measured step implies the MXUs did."""
    trace, _ = case_trace(p.case)
    flops = sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
    return flops / (p.case.measured_step_s * get_chip(p.case.chip).mxu_flops_per_s)


def implied_mxu_efficiency(p: Prediction) -> float:
    """The MXU efficiency the measured step implies if everything but the MXU-bound ops on the
    critical path (exposed communication, HBM- and VPU-bound ops) costs what tpusim says."""
    b = p.breakdown
    rest = b.get("exposed_comm_s", 0.0) + b.get("hbm_bound_s", 0.0) + b.get("vpu_s", 0.0)
    eff = get_chip(p.case.chip).mxu_efficiency
    return eff * b.get("mxu_compute_s", 0.0) / max(p.case.measured_step_s - rest, 1e-9)


def fsdp_bytes_per_s(p: Prediction) -> float:
    """The case's FSDP collective bytes (V of every collective over an fsdp axis) per
    predicted second: how much gathering and reducing runs beside its compute."""
    trace, _ = case_trace(p.case)
    v = sum(o.bytes for o in trace.ops if o.kind == OpKind.COLLECTIVE and "fsdp" in o.mesh_axes)
    return v / p.step_s


def attention_mxu_share(p: Prediction) -> float:
    """The share of the case's MXU time (at the chip's fill) in its attention-core ops."""
    trace, _ = case_trace(p.case)
    chip = get_chip(p.case.chip)
    att = tot = 0.0
    for o in trace.ops:
        if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU:
            dt = o.flops / chip.mxu_fill(o.narrow_dim)
            tot += dt
            att += dt if "attention" in o.name and "proj" not in o.name else 0.0
    return att / tot if tot else 0.0


def util_range(preds: list[Prediction], chip: str, moe: bool | None = None) -> str:
    u = [hw_utilization(p) for p in preds if p.case.chip == chip
         and (moe is None or p.case.model.is_moe == moe)]
    return f"{100 * min(u):.0f}-{100 * max(u):.0f}%" if u else "-"


# The MoE costs XLA's program has and a dense layer has not: the dropping path's one-hot masks
# and dispatch/combine einsums (forward, recomputed and backward), and the collectives over
# `expert` (the token all-to-alls, the combine weights' gradient, the output-gradient gather).
MOE_EINSUM_OPS = ("moe_",)
MOE_COLLECTIVE_OPS = ("ep_",)


def without_moe_costs(p: Prediction, prefixes: tuple[str, ...]) -> float:
    """The case's predicted step with the ops named `prefix...` (recomputations included) made
    free: compute ops cost nothing and collectives move one byte. A diagnostic bound on how much
    of the error those costs could explain, never a prediction."""


    trace, topo = case_trace(p.case)
    ops = []
    for o in trace.ops:
        if o.name.removeprefix("re-").startswith(prefixes):
            o = dataclasses.replace(o, bytes=1.0) if o.kind == OpKind.COLLECTIVE else \
                dataclasses.replace(o, flops=0.0, hbm_bytes=0.0)
        ops.append(o)
    stripped = Trace(mesh=trace.mesh, ops=tuple(ops), meta=trace.meta)
    return float(simulate_step(stripped, get_chip(p.case.chip), topo,
                               executor=Executor.REPRESENTATIVE).step_time_s)


# The routed experts' matmuls in an MoE trace: forward, recomputed and backward.
_EXPERT_MATMULS = ("expert_", "mlp_bwd")


def implied_expert_efficiency(p: Prediction, fsdp_grad: str | None = None) -> float:
    """The MXU efficiency the routed experts' matmuls alone would need for the case's step to
    come out as measured, everything else costed as shipped (their FLOPs rescaled, bisected to
    0.001 of the factor); `fsdp_grad` rebuilds the case with that gradient rule first."""


    case = p.case if fsdp_grad is None else with_changes(
        p.case, id=f"{p.case.id}#fsdp-grad-{fsdp_grad}", fsdp_grad=fsdp_grad)
    trace, topo = case_trace(case)
    chip = get_chip(case.chip)
    expert = [o.kind == OpKind.COMPUTE and o.unit == Unit.MXU
              and o.name.removeprefix("re-").startswith(_EXPERT_MATMULS) for o in trace.ops]

    def step(scale: float) -> float:
        ops = tuple(dataclasses.replace(o, flops=o.flops * scale) if e else o
                    for o, e in zip(trace.ops, expert, strict=True))
        return float(simulate_step(Trace(mesh=trace.mesh, ops=ops, meta=trace.meta), chip,
                                   topo, executor=Executor.REPRESENTATIVE).step_time_s)

    lo, hi = 0.25, 2.0  # FLOP scales: the efficiency chip.mxu_efficiency / scale
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if step(mid) > case.measured_step_s else (mid, hi)
    return chip.mxu_efficiency / ((lo + hi) / 2)


def async_step(p: Prediction) -> float:
    """The case's predicted step with asynchronous MoE all-to-alls (`--ep-alltoall async`)."""
    _, topo = case_trace(p.case)
    cfg = dataclasses.replace(trace_config(p.case), ep_alltoall="async")
    t = compile_training_step(p.case.model, parse_mesh(p.case.mesh, p.case.dcn or None,
                                                       p.case.axis_map or None),
                              topo.num_chips, cfg)
    return float(simulate_step(t, get_chip(p.case.chip), topo,
                               executor=Executor.REPRESENTATIVE).step_time_s)


def non_mxu_share(p: Prediction | None) -> float:
    """The share of a prediction's step in HBM- and VPU-bound ops (0 for none)."""
    if p is None:
        return 0.0
    return (p.breakdown.get("hbm_bound_s", 0.0) + p.breakdown.get("vpu_s", 0.0)) / p.step_s


def capacity_line(lo: Prediction, hi: Prediction, steps: tuple[float, float] | None = None
                  ) -> tuple[float, float]:
    """(seconds at capacity factor 0, seconds per unit of capacity factor): the straight line
    through two runs that differ only in the capacity factor (the 750B's cf 1.0 and cf 1.5),
    of their measured steps (`steps` None) or of the given steps at the two factors."""
    cf0, cf1 = lo.case.capacity_factor, hi.case.capacity_factor
    y0, y1 = steps or (lo.case.measured_step_s, hi.case.measured_step_s)
    slope = (y1 - y0) / (cf1 - cf0)
    return y0 - slope * cf0, slope


def per_sequence(p: Prediction) -> tuple[float, float]:
    """Measured and predicted seconds per sequence of a case."""
    return p.case.measured_step_s / p.case.batch_per_chip, p.step_s / p.case.batch_per_chip


