"""The tables of `validation.maxtext`: the predictions and the fits as printed, the shipped
factors, a prediction's likely cause in words, and markdown tables for the document.
"""

from __future__ import annotations

import math
import sys

from sim.chips import get_chip
from validation.maxtext_fit import FitResult
from validation.maxtext_predict import Prediction, hw_utilization, pct
from validation.maxtext_runs import (
    GENERATIONS,
    NAMED,
    Case,
    case_trace,
)


def case_set(c: Case) -> str:
    return "low" if c.low_quality else ("fit" if c.fit_subset else "held")


HEADER = ("id", "chip", "model", "mesh", "remat", "set", "meas step s", "pred step s", "error",
          "meas tok/s/chip", "pred tok/s/chip")


def table_rows(preds: list[Prediction]) -> list[tuple[str, ...]]:
    rows = []
    for p in preds:
        c = p.case
        rows.append((
            c.id, c.chip, c.model_label, c.mesh_label, str(c.remat), case_set(c),
            f"{c.measured_step_s:.3f}", f"{p.step_s:.3f}", pct(p.error),
            f"{c.measured_tokens_s:.0f}", f"{p.tokens_s:.0f}",
        ))
    return rows


def print_table(preds: list[Prediction], out=sys.stdout) -> None:
    rows = [HEADER] + table_rows(preds)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for j, r in enumerate(rows):
        print("  ".join(v.ljust(w) if i < 6 else v.rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths, strict=True))), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def print_summary(stats: dict[str, dict[str, float]], out=sys.stdout) -> None:
    print("\nmedian |error| of the step time (shipped presets):", file=out)
    for k, v in stats.items():
        print(f"  {k:<14} n={v['n']:<3d} median {100 * v['median_abs']:5.1f}%   "
              f"max {100 * v['max_abs']:5.1f}%   mean signed {pct(v['mean_signed'])}", file=out)


def print_fits(fits: list[FitResult], out=sys.stdout) -> None:
    print("\nfit (mean |log error| on the subset, MXU efficiency on a 0.01 grid):", file=out)
    for f in fits:
        line = (f"  {f.generation} {f.subset:<4} custom->{f.custom_remat:<7} n={f.n:<3d} "
                f"mxu_efficiency={f.mxu:.2f}  objective {f.objective:.4f}  "
                f"median {100 * f.median_abs:.1f}%")
        if not math.isnan(f.all_median_abs):
            line += f"  (all {f.generation} cases: median {100 * f.all_median_abs:.1f}%)"
        print(line, file=out)
        for name, scan in (("hbm", f.hbm_scan), ("ici", f.ici_scan)):
            if scan:
                print(f"      {name}_efficiency scan: " + ", ".join(
                    f"{v:.1f}->mxu {m:.2f} obj {o:.4f}" for v, m, o in scan), file=out)
        if f.dcn_scan and f.dcn_objective == "slowdown":
            steps = dict(f.dcn_step_scan)
            print(f"      dcn_message_overhead_s fit on the slowdowns of {', '.join(f.dcn_pairs)}"
                  f" (mxu {f.dcn_scan[0][1]:.2f}; -> {f.dcn_message:g}): " + ", ".join(
                      f"{1e3 * v:g} ms->slowdown obj {o:.4f} step obj {steps[v]:.4f}"
                      for v, _, o in f.dcn_scan), file=out)
        elif f.dcn_scan:
            print(f"      dcn_message_overhead_s fit (-> {f.dcn_message:g}): " + ", ".join(
                f"{1e3 * v:g} ms->mxu {m:.2f} obj {o:.4f}" for v, m, o in f.dcn_scan), file=out)


def shipped_factors() -> dict[str, dict[str, float]]:
    return {g: {k: getattr(get_chip(g), k) for k in (
        "mxu_efficiency", "vpu_efficiency", "hbm_efficiency", "ici_efficiency",
        "dcn_efficiency", "op_overhead_s", "dcn_message_overhead_s")} for g in GENERATIONS}


def explain(p: Prediction) -> str:
    """Why a case is off, from its structure (used for the worst cases in the doc)."""
    c = p.case
    why = []
    exposed = p.breakdown.get("exposed_comm_s", 0.0)
    if "tensor" in c.mesh and exposed > 0.05 * p.step_s and p.error > 0:
        why.append(f"tensor-parallel all-reduces exposed on the critical path "
                   f"({exposed:.1f} s of {p.step_s:.1f} s; effect 1)")
    elif exposed > 0.05 * p.step_s:
        synced = any(o.name.startswith("fsdp_grad_allreduce_") for o in case_trace(c)[0].ops)
        why.append(f"exposed communication {exposed:.1f} s of {p.step_s:.1f} s"
                   + (", the synchronous gradient all-reduces among it (effect 7)"
                      if synced else ""))
    if c.num_slices > 1 and "data" in c.dcn and p.error < -0.05:
        why.append(f"slowdown with {c.num_slices} slices under-predicted (effect "
                   f"{6 if c.model.attention_window is not None else 2})")
    if c.model.is_moe:
        cf = [n.split(",")[0] for n in c.notes if n.startswith("MoE capacity")]
        why.append((cf[0] + " (simulated): " if cf else "") + "the measured step implies "
                   f"{100 * hw_utilization(p):.0f}% MXU utilization, above the dense runs' "
                   "(effect 3)")
    if not why:
        mxu = p.breakdown.get("mxu_compute_s", 0.0)
        why.append(f"{100 * mxu / p.step_s:.0f}% MXU time: the measured step implies "
                   f"{100 * hw_utilization(p):.0f}% MXU utilization; this model's MXU fraction "
                   f"differs from the per-chip factor (effect 4)")
    return "; ".join(why)


def md_table(header: tuple[str, ...], rows: list[tuple[str, ...]], right_from: int) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i >= right_from else "---" for i in range(len(header)))
             + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def fits_rows(fits: list[FitResult]) -> list[tuple[str, ...]]:
    rows = []
    for f in fits:
        if f.custom_remat != NAMED:
            continue
        def best(scan):
            if not scan:
                return "not scanned"
            b = min(scan, key=lambda t: t[2])
            return f"{b[0]:.1f} (mxu {b[1]:.2f}, obj {b[2]:.4f})"

        rows.append((
            f.generation, "odd (fit)" if f.subset == "odd" else "even (check)", str(f.n),
            f"{f.mxu:.2f}", f"{f.objective:.4f}", f"{100 * f.median_abs:.1f}%",
            best(f.hbm_scan), best(f.ici_scan),
        ))
    return rows


