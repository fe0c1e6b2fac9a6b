"""docs/validation.md rendered: the prose of templates/validation.md with its tables and
numbers filled in (`render_doc`), and the sections from the XLA cross-checks' cached results
(`write_collectives_section` replaces the collective-bytes one in place).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from sim.chips import get_chip
from validation import energy, maxtext_unfitted, template, xla_crosscheck_doc, xla_moe_pair
from validation.maxtext_effects import effects
from validation.maxtext_fit import (
    DCN_FIT_OBJECTIVES,
    SCAN_GRID,
    FitResult,
    objective,
    subset_cases,
)
from validation.maxtext_predict import (
    DOC_FILE,
    TARGET_MEDIAN,
    TARGET_WORST,
    Prediction,
    pct,
    util_range,
)
from validation.maxtext_runs import (
    FSDP_GRAD,
    GENERATIONS,
    NAMED,
    ROOT,
    RUNS_FILE,
    Case,
    Skip,
)
from validation.maxtext_tables import case_set, explain, fits_rows, md_table, shipped_factors

# The fit behind the document (`--write` writes it, `--reuse-fits` and validation.check read
# it): a full fit costs 840-1080 CPU-s (validation/README.md), rendering from it a few minutes.
FITS_FILE = ROOT / "validation" / "results" / "maxtext_fits.json"
# Where the section the maxtext document ends before begins (validation.hlo_import's).
TAIL_MARKER = "<!-- hlo-import -->"


def fits_text(fits: list[FitResult]) -> str:
    """The fits file's text (deterministic: the fit's results only)."""
    return json.dumps([dataclasses.asdict(f) for f in fits], indent=1, sort_keys=True) + "\n"


def load_fits(path: Path = FITS_FILE) -> list[FitResult]:
    """The fit results a `fits_text` file (or a `--save-fits` one) holds."""
    return [FitResult(**{k: (list(map(tuple, v)) if k.endswith("_scan")
                             else tuple(v) if k == "dcn_pairs" else v)
                         for k, v in d.items()})
            for d in json.loads(path.read_text())]


def stale_fits(fits: list[FitResult], cases: list[Case], preds: list[Prediction]) -> list[str]:
    """Where the saved fit no longer describes the code: each generation's and half's fitted
    objective recomputed at the fit's own factors (the fit half's from `preds` where the
    shipped preset is that point), `STALE ...` where it moved in the 4 decimals the document
    prints, a note where it moved less. Cheap (one evaluation per half, not the search): it
    finds a changed objective, not a moved optimum."""
    by_id = {p.case.id: p for p in preds}
    out = []
    for f in fits:
        if f.custom_remat != NAMED:
            continue
        chosen = subset_cases(cases, f.generation, f.subset)
        point = get_chip(f.generation).with_overrides(
            mxu_efficiency=f.mxu, hbm_efficiency=1.0, ici_efficiency=1.0, vpu_efficiency=1.0,
            dcn_efficiency=1.0, op_overhead_s=0.0, dcn_message_overhead_s=f.dcn_message)
        if point == get_chip(f.generation) and all(c.id in by_id for c in chosen):
            now = round(statistics.fmean(abs(by_id[c.id].log_error) for c in chosen), 9)
        else:
            now = objective(chosen, point)
        if f"{now:.4f}" != f"{f.objective:.4f}":
            out.append(f"STALE {f.generation} {f.subset} half: objective {now:.9f} at the saved "
                       f"fit's mxu_efficiency {f.mxu:.2f}, saved {f.objective:.9f}")
        elif now != f.objective:
            out.append(f"{f.generation} {f.subset} half: objective {now:.9f} at the saved fit's "
                       f"mxu_efficiency {f.mxu:.2f}, saved {f.objective:.9f}: below the 4 "
                       "decimals the document shows (the search itself was not re-run)")
    return out


def updated(doc: str, cases: list[Case], skips: list[Skip], preds: list[Prediction],
            stats: dict[str, dict[str, float]], fits: list[FitResult]) -> str:
    """`doc` (docs/validation.md's text) with the maxtext document regenerated (everything
    before TAIL_MARKER; the sections from it on kept as they are)."""
    tail = "\n" + doc[doc.index(TAIL_MARKER):] if TAIL_MARKER in doc else ""
    return render_doc(cases, skips, preds, stats, fits) + tail


def _split_note(cases: list[Case]) -> str:
    """How the fit / check split moved when the sliding-window runs became usable (the rule,
    file order within a generation, is unchanged)."""
    new = [c for c in cases if c.model.attention_window is not None and not c.low_quality]
    if not new:
        return ""
    moved = []
    for g in GENERATIONS:
        old = [c for c in cases if c.chip == g and not c.low_quality and c not in new]
        moved += [c.id for i, c in enumerate(old) if i % 2 != c.index % 2]
    return (f" The {len(new)} Gemma-3 runs, usable since sliding-window attention was modelled, "
            f"took their places in that numbering ("
            + "; ".join(f"{c.id}: {'odd, fit' if c.fit_subset else 'even, held out'}"
                        for c in new)
            + "); the rule was kept, so the runs after them in file order changed halves"
            + (f" ({', '.join(moved)})" if moved else " (none)") + ".")


def render_doc(cases: list[Case], skips: list[Skip], preds: list[Prediction],
               stats: dict[str, dict[str, float]], fits: list[FitResult]) -> str:
    """docs/validation.md: the prose of templates/validation.md with its tables and numbers
    filled in (deterministic: depends only on the data, the code and the presets)."""
    shipped = shipped_factors()
    by_gen = {f.generation: f for f in fits if f.subset == "odd" and f.custom_remat == NAMED}
    other = {f.generation: f for f in fits if f.subset == "even" and f.custom_remat == NAMED}
    good = [p for p in preds if not p.case.low_quality]
    low = [p for p in preds if p.case.low_quality]
    n_runs = len(json.loads(RUNS_FILE.read_text())) if RUNS_FILE.is_file() else len(cases)
    worst = sorted(good, key=lambda p: (-abs(p.error), p.case.id))[:8]
    pair = moe_pair_section()
    xla = xla_collectives_section()
    return template.render("validation.md", {
        "n_runs": str(n_runs), "n_cases": str(len(cases)), "n_good": str(len(good)),
        "n_low": str(len(low)), "n_skips": str(len(skips)),
        "summary_table": _summary_table(stats),
        "target_median": f"{100 * TARGET_MEDIAN:.0f}%",
        "median_verdict": "met" if stats["all"]["median_abs"] <= TARGET_MEDIAN else "NOT met",
        "median_abs": f"{100 * stats['all']['median_abs']:.1f}%",
        "target_worst": f"{100 * TARGET_WORST:.0f}%",
        "worst_verdict": "met" if stats["all"]["max_abs"] <= TARGET_WORST else "NOT met",
        "max_abs": f"{100 * stats['all']['max_abs']:.1f}%",
        "shipped_factors": _shipped_table(shipped, by_gen),
        "fsdp_grad_flags": ", ".join(f"{g} `--fsdp-grad {FSDP_GRAD[g]}`" for g in GENERATIONS),
        "n_f32": str(sum(c.param_dtype == "fp32" for c in cases)),
        "bf16_ids": ", ".join(c.id for c in cases if c.param_dtype == "bf16") or "none",
        "scan_grid": ", ".join(f"{v:.1f}" for v in SCAN_GRID),
        "split_note": _split_note(cases),
        "fits_table": md_table(("chip", "subset", "n", "best mxu_efficiency", "objective",
                                 "median abs error", "best hbm_efficiency (scan)",
                                 "best ici_efficiency (scan)"), fits_rows(fits), 2),
        "fit_scans": _scan_lines(fits, by_gen, other),
        "dcn_fit": _dcn_fit_lines(by_gen, other),
        "remat_check": _remat_check_lines(fits, by_gen, stats),
        **_fitted_values(shipped, by_gen, other, good),
        "runs_table": _runs_table(good),
        "low_table": _low_table(low),
        "worst_table": md_table(("id", "error", "likely cause"),
                                 [(p.case.id, pct(p.error), explain(p)) for p in worst], 99),
        "effects": "\n".join(effects(good, fits, low)),
        "moe_pair": (f"## The MoE matched pair against XLA's cost model\n\n{pair}\n"
                     if pair else ""),
        "skipped_table": md_table(("id", "chip", "quality", "reason"),
                                   [(s.id, s.chip, s.quality, s.reason) for s in skips], 99),
        "xla_collectives": f"\n{xla}\n" if xla else "",
        "energy_calibration": energy.section(),
        "unfitted_summary": maxtext_unfitted.summary_block(),
    })


def _summary_table(stats: dict[str, dict[str, float]]) -> str:
    labels = {"all": "all usable (medium/high)", "fit subset": "fit subset (odd-indexed)",
              "held out": "held out (even-indexed)", "low quality": "low quality (separate)",
              "all incl. low": "all incl. low quality"}
    rows = [(labels.get(k, k), str(v["n"]), f"{100 * v['median_abs']:.1f}%",
             f"{100 * v['max_abs']:.1f}%", pct(v["mean_signed"])) for k, v in stats.items()]
    return md_table(("cases", "n", "median abs error", "max abs error", "mean signed error"),
                     rows, 1)


def _shipped_table(shipped: dict[str, dict[str, float]], by_gen: dict[str, FitResult]) -> str:
    """The shipped factors, and a warning under them for each one the fit disagrees with."""
    keys = ("mxu_efficiency", "hbm_efficiency", "ici_efficiency", "vpu_efficiency",
            "dcn_efficiency", "op_overhead_s", "dcn_message_overhead_s")
    out = [md_table(("chip", *keys), [(g, *(f"{shipped[g][k]:g}" for k in keys))
                                       for g in GENERATIONS], 1)]
    for g in GENERATIONS:
        f = by_gen.get(g)
        if f and abs(f.mxu - shipped[g]["mxu_efficiency"]) > 1e-9:
            out.append(f"\n**Warning:** {g} ships mxu_efficiency="
                       f"{shipped[g]['mxu_efficiency']:g} but the fit below gives {f.mxu:.2f}.")
        if f and abs(f.dcn_message - shipped[g]["dcn_message_overhead_s"]) > 1e-12:
            out.append(f"\n**Warning:** {g} ships dcn_message_overhead_s="
                       f"{shipped[g]['dcn_message_overhead_s']:g} but the fit below gives "
                       f"{f.dcn_message:g}.")
    return "\n".join(out)


def _lines(*parts: str) -> str:
    """Document lines as a block for a placeholder that may be empty: each line and its
    newline (the template puts the next text right after the placeholder)."""
    return "".join(p + "\n" for p in parts)


def _scan_lines(fits: list[FitResult], by_gen: dict[str, FitResult],
                other: dict[str, FitResult]) -> str:
    """Each generation's identifiability scans, and what they say (or that they were not run)."""
    def objectives(scan) -> str:
        return ", ".join(f"{o:.4f}" for _, _, o in scan)

    grid = ", ".join(f"{v:.1f}" for v in SCAN_GRID)
    out = []
    for g in GENERATIONS:
        f, e = by_gen.get(g), other.get(g)
        if not f or not f.hbm_scan:
            continue
        out.append(f"* **{g}**: hbm scan objective {objectives(f.hbm_scan)} (odd) / "
                   f"{objectives(e.hbm_scan) if e else '-'} (even); ici scan "
                   f"{objectives(f.ici_scan)} (odd) / {objectives(e.ici_scan) if e else '-'} "
                   f"(even), for {grid}.")
    out.append("")
    scan_fits = [f for f in fits if f.custom_remat == NAMED and f.hbm_scan]
    if not scan_fits:
        alt = [f for f in fits if f.custom_remat != NAMED]
        out.append(template.render("validation/scans_not_run.md", {
            "remat_clause": "" if alt else " and the remat mapping check"}))
        return _lines(*out)
    h_range = max(max(o for _, _, o in f.hbm_scan) - min(o for _, _, o in f.hbm_scan)
                  for f in scan_fits)
    h_best = ", ".join(f"{f.generation} {f.subset} {min(f.hbm_scan, key=lambda t: t[2])[0]:.1f}"
                       for f in scan_fits)
    i_worse = [f for f in scan_fits if min(f.ici_scan, key=lambda t: t[2])[0] == 1.0]
    i_better = [f for f in scan_fits if f not in i_worse]
    i_gain = max((f.ici_scan[0][2] - min(o for _, _, o in f.ici_scan) for f in i_better),
                 default=0.0)
    better = (f" and improves it by at most {100 * i_gain:.2f} points on "
              f"{', '.join(f'{f.generation} {f.subset}' for f in i_better)}" if i_better else "")
    out.append(template.render("validation/scans.md", {
        "h_range": f"{100 * h_range:.2f}", "h_best": h_best, "n_worse": str(len(i_worse)),
        "n_halves": str(len(scan_fits)), "ici_better": better}))
    return _lines(*out)


def _dcn_fit_lines(by_gen: dict[str, FitResult], other: dict[str, FitResult]) -> str:
    """The DCN per-message overhead fits: the objectives at each value, per generation and
    half ("" without them)."""
    dfits = [f for f in (by_gen.get(g) for g in GENERATIONS) if f and f.dcn_scan] + \
        [f for f in (other.get(g) for g in GENERATIONS) if f and f.dcn_scan]
    if not dfits:
        return ""
    rows = []
    for f in dfits:
        if f.dcn_objective == "slowdown":
            steps = dict(f.dcn_step_scan)
            rows.append((f.generation, f.subset, "slowdown / step objective at mxu "
                         f"{f.dcn_scan[0][1]:.2f}: " + ", ".join(
                             f"{1e3 * v:g} ms -> {o:.4f} / {steps[v]:.4f}"
                             for v, _, o in f.dcn_scan)))
        else:
            slow = dict(f.dcn_slowdown_scan)
            rows.append((f.generation, f.subset, "best mxu_efficiency, objective "
                         + ("(slowdown objective)" if slow else "") + ": " + ", ".join(
                             f"{1e3 * v:g} ms -> {m:.2f}, {o:.4f}"
                             + (f" ({slow[v]:.4f})" if v in slow else "")
                             for v, m, o in f.dcn_scan)))
    out = [template.render("validation/dcn.md", {"objectives": ", ".join(
        f"{g}: {DCN_FIT_OBJECTIVES[g]}" for g in GENERATIONS if g in DCN_FIT_OBJECTIVES)}),
        md_table(("chip", "subset", "dcn_message_overhead_s -> fit"), rows, 9), ""]
    cross = [f for f in dfits if f.dcn_objective == "step" and f.dcn_slowdown_scan]
    if cross:
        out.append(template.render("validation/dcn_cross.md", {"lowest": "; ".join(
            f"{1e3 * min(f.dcn_slowdown_scan, key=lambda t: t[1])[0]:g} ms on {f.generation}"
            f" {f.subset} ({len(f.dcn_pairs)} pairs; the step fit: "
            f"{1e3 * f.dcn_message:g} ms)" for f in cross)}))
    return _lines(*out)


def _remat_check_lines(fits: list[FitResult], by_gen: dict[str, FitResult],
                       stats: dict[str, dict[str, float]]) -> str:
    """The remat mapping check: the v6e fit with every custom policy mapped to one tpusim
    policy ("" if it was not run)."""
    alt = [f for f in fits if f.custom_remat != NAMED]
    if not alt:
        return ""
    rows = []
    f = by_gen.get("v6e")
    if f:
        rows.append(("by name (shipped)", f"{f.mxu:.2f}", f"{f.objective:.4f}",
                     f"{100 * f.median_abs:.1f}%", f"{100 * stats['v6e']['median_abs']:.1f}%"))
    for a in alt:
        rows.append((a.custom_remat, f"{a.mxu:.2f}", f"{a.objective:.4f}",
                     f"{100 * a.median_abs:.1f}%", f"{100 * a.all_median_abs:.1f}%"))
    out = [template.render("validation/remat.md", {}),
           md_table(("custom -> tpusim remat", "best mxu_efficiency", "objective (odd half)",
                      "median abs (odd half)", "median abs (all v6e)"), rows, 1), ""]
    best_alt = min(alt, key=lambda a: a.objective)
    if f and best_alt.objective < f.objective:
        out.append(template.render("validation/remat_better.md", {
            "policy": best_alt.custom_remat, "objective": f"{best_alt.objective:.4f}",
            "shipped_objective": f"{f.objective:.4f}"}))
    return _lines(*out)


def _fitted_values(shipped: dict[str, dict[str, float]], by_gen: dict[str, FitResult],
                   other: dict[str, FitResult], good: list[Prediction]) -> dict[str, str]:
    """The numbers of "What the fitted values mean": both halves' fits of both generations."""
    missing = [f"{g} {half}" for g in GENERATIONS for half, fs in (("odd", by_gen),
                                                                   ("even", other))
               if g not in fs]
    if missing:
        raise ValueError(f"the fit results lack {', '.join(missing)}: run the whole fit "
                         f"(--write without --reuse-fits, or --reuse-fits of a --save-fits file)")
    ratio = shipped["v6e"]["dcn_message_overhead_s"] / shipped["v5e"]["dcn_message_overhead_s"]
    return {
        "v5e_mxu": f"{shipped['v5e']['mxu_efficiency']:g}",
        "v5e_mxu_busy": util_range(good, "v5e"),
        "v5e_even_mxu": f"{other['v5e'].mxu:.2f}",
        "v5e_even_dcn_ms": f"{1e3 * other['v5e'].dcn_message:g}",
        "v5e_odd_dcn_ms": f"{1e3 * by_gen['v5e'].dcn_message:g}",
        "v6e_mxu": f"{shipped['v6e']['mxu_efficiency']:g}",
        "v6e_dense_busy": util_range(good, "v6e", moe=False),
        "v6e_moe_busy": util_range(good, "v6e", moe=True),
        "v6e_even_mxu": f"{other['v6e'].mxu:.2f}",
        "v6e_dcn_ms": f"{1e3 * shipped['v6e']['dcn_message_overhead_s']:g}",
        "v6e_even_dcn_ms": f"{1e3 * other['v6e'].dcn_message:g}",
        "v6e_dcn_ratio": f"{ratio:.1f}",
    }


def _runs_table(good: list[Prediction]) -> str:
    rows = []
    for p in good:
        c = p.case
        rows.append((c.id, c.chip, c.model_label, c.mesh_label,
                     f"{c.maxtext_remat} -> {c.remat}", case_set(c),
                     f"{c.measured_step_s:.3f}" + ("*" if c.step_source == "derived" else ""),
                     f"{p.step_s:.3f}", pct(p.error), f"{c.measured_tokens_s:.0f}",
                     f"{p.tokens_s:.0f}", f"{p.hbm_peak_gb:.1f}"))
    return md_table(("id", "chip", "model", "mesh", "remat (MaxText -> tpusim)", "set",
                      "measured step s", "predicted step s", "error", "measured tok/s/chip",
                      "predicted tok/s/chip", "sim HBM peak GB"), rows, 6)


def _low_table(low: list[Prediction]) -> str:
    rows = []
    for p in low:
        c = p.case
        rows.append((c.id, c.chip, c.model_label, c.mesh_label, f"{c.measured_step_s:.3f}"
                     + ("*" if c.step_source == "derived" else ""), f"{p.step_s:.3f}",
                     pct(p.error), "; ".join(c.notes) or "-"))
    return md_table(("id", "chip", "model", "mesh", "measured step s", "predicted step s",
                      "error", "notes"), rows, 4)


def moe_pair_section() -> str:
    """The doc's section on the matched pair ("" without the cache)."""
    if not xla_moe_pair.CACHE.is_file():
        return ""
    return xla_moe_pair.render_section(json.loads(xla_moe_pair.CACHE.read_text()))


def xla_collectives_section() -> str:
    """Collective bytes by kind and axis against XLA's compiled programs, from the cached XLA
    side (validation/results/xla_collectives.json); empty without that file."""
    if not xla_crosscheck_doc.RESULTS_FILE.is_file():
        return ""
    results = json.loads(xla_crosscheck_doc.RESULTS_FILE.read_text())
    return (xla_crosscheck_doc.render_collectives_section(results) + "\n\n"
            + xla_crosscheck_doc.render_op_costs_section(results))


def write_collectives_section() -> int:
    """Replace the XLA collective-bytes section of the doc in place (up to the next section
    written by another script, or the end)."""
    head = "## Collective bytes against XLA's compiled programs"
    doc = DOC_FILE.read_text()
    if head not in doc:
        print(f"{DOC_FILE.relative_to(ROOT)} has no '{head}' section; run --write first",
              file=sys.stderr)
        return 2
    start = doc.index(head)
    end = doc.find("<!-- hlo-import -->", start)
    end = len(doc) if end < 0 else end
    DOC_FILE.write_text(doc[:start] + xla_collectives_section().rstrip("\n") + "\n\n\n"
                        + doc[end:])
    print(f"wrote the collective-bytes section of {DOC_FILE.relative_to(ROOT)}")
    return 0


