"""Public measured TPU training runs that no rule or fit of tpusim used, rebuilt and predicted
under the shipped presets: the out-of-sample check of docs/validation.md ("Runs no rule or fit
used").

Reads `docs/reference/maxtext_runs_unfitted.json` (the MaxText README tables of TPU v5p and v4
and tpu-recipes log lines on v5p; its README section says what it holds), rebuilds each run the
way `validation.maxtext` rebuilds the fitted ones (`validation.maxtext_runs`: the same model,
mesh, dtype and remat mapping) and compares the predicted step time with the measured one:

    .venv/bin/python -m validation.maxtext_unfitted           # rebuild, predict, print
    .venv/bin/python -m validation.maxtext_unfitted --write   # also the cache and doc section
    .venv/bin/python -m validation.maxtext_unfitted --cached  # print the cache, rebuild nothing

The predictions are cached in `validation/results/maxtext_unfitted.json` (with the SHA-256 of
the runs file they came from); `--write` splices the section between its markers at the end of
docs/validation.md and the one-line pointer in its summary. Nothing here is fitted, and no
preset or factor is changed: v5p and v4 carry v5e's fitted MXU fraction (`sim/chips.py`,
"carried over"), which was not fitted on these runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from sim.chips import get_chip
from sim.engine.executors import Executor, simulate_step
from topologies.mesh import parse_mesh
from topologies.slices import SLICES, resolve_topology
from validation.maxtext_runs import (
    GENERATIONS,
    REFERENCE_DIR,
    ROOT,
    Case,
    Skip,
    mesh_for,
    model_for,
    params_dtype_for,
    remat_for,
    trace_config,
)
from validation.template import splice
from workloads.training import Remat, compile_training_step
from workloads.training.config import Attention

UNFITTED_FILE = REFERENCE_DIR / "maxtext_runs_unfitted.json"
CACHE_FILE = ROOT / "validation" / "results" / "maxtext_unfitted.json"
DOC_FILE = ROOT / "docs" / "validation.md"
BEGIN, END = "<!-- unfitted -->", "<!-- /unfitted -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- unfitted-summary -->", "<!-- /unfitted-summary -->"
COMMAND = "python -m validation.maxtext_unfitted --write"

# The compiler rules of each era, as `validation.maxtext_runs` sets them per generation: the 2023
# README tables (MaxText's 2023 default decoder) take the 2023 v5e table's (async
# reduce-scatters of the FSDP gradients, one cross-slice all-reduce a layer), the tpu-recipes
# runs (2024-2025) the v6e runs' (XLA's choice per matrix, per-matrix cross-slice all-reduces).
ERA_RULES = {"2023": {"fsdp_grad": "reduce-scatter", "dp_grad_split": "per-layer"},
             "current": {"fsdp_grad": "auto", "dp_grad_split": "per-matrix"}}


@dataclass(frozen=True, slots=True, kw_only=True)
class UnfittedRun:
    """One unfitted run: the `Case` `validation.maxtext` would build, and what it lacks."""

    case: Case
    era: str  # ERA_RULES key
    attention: Attention = Attention.FLASH
    matmul_dtype: str = "bf16"
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    source: str = ""
    # The same run with the settings of a later version of its script (`config_later`): a
    # sensitivity check of the uncertain configuration, never the headline.
    later: UnfittedRun | None = None


def era_of(raw: dict) -> str:
    return "2023" if raw["model"].get("family") == "maxtext-default-2023" else "current"


def load_runs(path: Path = UNFITTED_FILE) -> tuple[list[UnfittedRun], list[Skip]]:
    """Every run of the file as an `UnfittedRun`, or a `Skip` with the reason."""
    runs: list[UnfittedRun] = []
    skips: list[Skip] = []
    for raw in json.loads(path.read_text()):
        run = _run_for(raw)
        if isinstance(run, Skip):
            skips.append(run)
            continue
        later = raw.get("config_later")
        if later:
            alt = _run_for(_with_later(raw, later))
            if isinstance(alt, Skip):
                raise ValueError(f"{raw['id']}: config_later does not rebuild: {alt.reason}")
            run = dataclasses.replace(run, later=alt)
        runs.append(run)
    return runs, skips


def _with_later(raw: dict, later: dict) -> dict:
    """The record with its later script's batch and parallelism; a derived step scales with the
    per-device batch (the era's FLOP formula is linear in the tokens)."""
    out = json.loads(json.dumps(raw))
    scale = later["per_device_batch_size"] / raw["batch"]["per_device_batch_size"]
    out["id"] = raw["id"] + "#later"
    out["batch"]["per_device_batch_size"] = later["per_device_batch_size"]
    for key, value in later.items():
        if key.startswith("ici_"):
            out["parallelism"][key] = value
    acct = out.get("maxtext_flop_accounting")
    if acct and acct.get("implied_step_time_s"):
        acct["implied_step_time_s"] = acct["implied_step_time_s"] * scale
    if (out.get("measured") or {}).get("step_time_s"):
        raise ValueError(f"{raw['id']}: config_later on a logged step has no derived step to scale")
    return out


def _run_for(raw: dict) -> UnfittedRun | Skip:
    """One record as an `UnfittedRun` (the `Case` `validation.maxtext_runs` would build, with
    the era's compiler rules and the settings the fitted runs do not need), or a `Skip`."""
    chip, cid, quality = raw["hardware"]["tpu"], raw["id"], raw.get("quality", "")
    model = model_for(raw)
    mesh = mesh_for(raw)
    reason = model if isinstance(model, str) else mesh if isinstance(mesh, str) else ""
    batch = raw.get("batch") or {}
    meas = raw.get("measured") or {}
    step = meas.get("step_time_s")
    source = "log"
    if not step:
        step = (raw.get("maxtext_flop_accounting") or {}).get("implied_step_time_s")
        source = "derived"
    if not reason and not step:
        reason = "no step time (logged or derivable)"
    if reason:
        return Skip(id=cid, chip=chip, quality=quality, reason=reason)
    era = era_of(raw)
    other = raw.get("other_settings") or {}
    tensors = raw.get("remat_tensors") or {}
    rem_text = raw.get("remat") or ""
    custom = bool(tensors)
    notes = []
    if source == "derived":
        notes.append("step time derived from MFU with the era's FLOP formula")
    if raw["model"].get("learned_position_embedding_size"):
        notes.append("learned position embedding and biases not modelled")
    flags = str(other.get("xla_flags", ""))
    seq, pdbs = int(batch["seq_len"]), batch["per_device_batch_size"]
    case = Case(
        id=cid, index=0, chip=chip, slice_name=raw["hardware"]["slice"],
        num_slices=int(raw.get("slices") or 1), model=model, mesh=mesh[0], dcn=mesh[1],
        axis_map=mesh[2], remat=Remat.CUSTOM if custom else remat_for(rem_text),
        maxtext_remat=rem_text.split(" ")[0], seq_len=seq, batch_per_chip=int(pdbs),
        measured_step_s=float(step), measured_tokens_s=pdbs * seq / float(step),
        step_source=source, quality=quality, notes=tuple(notes),
        dp_allreduce="async" if "DATA_PARALLEL_OVERLAP" in flags else "blocking",
        vocab_tiling=int(other.get("num_vocab_tiling") or 1),
        param_dtype=params_dtype_for(raw), **ERA_RULES[era])
    return UnfittedRun(
        case=case, era=era,
        attention=Attention.DOT if str(other.get("attention", "")).startswith("dot")
        else Attention.FLASH,
        matmul_dtype="int8" if other.get("quantization") == "int8" else "bf16",
        remat_save=tuple(tensors.get("device", ())),
        remat_offload=tuple(tensors.get("offload", ())),
        source=f"{raw['source_repo']} {raw['source_path']}")


def build(run: UnfittedRun):
    """(compiled trace, topology, chip preset) of the run, as `tpusim train --chip` builds them."""
    c = run.case
    chip = get_chip(c.chip)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape,
                            shape=tuple(SLICES.get(c.slice_name).shape),
                            num_slices=c.num_slices)
    cfg = dataclasses.replace(trace_config(c), attention=run.attention,
                              matmul_dtype=run.matmul_dtype, remat_save=run.remat_save,
                              remat_offload=run.remat_offload)
    trace = compile_training_step(c.model, parse_mesh(c.mesh, c.dcn or None,
                                                      c.axis_map or None),
                                  topo.num_chips, cfg)
    return trace, topo, chip


def predict(run: UnfittedRun) -> dict:
    """The run's predicted step under the shipped preset of its chip, as a cache row."""
    c = run.case
    trace, topo, chip = build(run)
    r = simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE)
    step = float(r.step_time_s)
    return {"id": c.id, "chip": c.chip, "slice": c.slice_name, "slices": c.num_slices,
            "model": c.model.name, "mesh": c.mesh_label, "remat": str(c.remat),
            "matmul_dtype": run.matmul_dtype, "batch_per_chip": c.batch_per_chip,
            "seq_len": c.seq_len, "quality": c.quality, "step_source": c.step_source,
            "measured_step_s": round(c.measured_step_s, 6), "predicted_step_s": round(step, 6),
            "error": round((step - c.measured_step_s) / c.measured_step_s, 6),
            "fits_in_hbm": bool(r.fits_in_hbm),
            "hbm_peak_gb": round(float(r.hbm_peak_bytes) / 1e9, 3),
            "breakdown": {k: round(float(v), 6) for k, v in sorted(r.breakdown.items())}}


def file_digest(path: Path = UNFITTED_FILE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def predict_with_later(run: UnfittedRun) -> dict:
    """`predict`'s row, with the error under the later script's settings where there are any."""
    row = predict(run)
    if run.later is not None:
        alt = predict(run.later)
        row["later"] = {k: alt[k] for k in ("mesh", "batch_per_chip", "measured_step_s",
                                            "predicted_step_s", "error", "fits_in_hbm")}
    return row


def build_cache(path: Path = UNFITTED_FILE) -> dict:
    runs, skips = load_runs(path)
    return {"runs_file": path.name, "runs_file_sha256": file_digest(path),
            "rows": [predict_with_later(r) for r in runs],
            "skipped": [{"id": s.id, "chip": s.chip, "reason": s.reason} for s in skips]}


def read_cache(path: Path = CACHE_FILE) -> dict:
    return json.loads(path.read_text())


# ---- statistics and tables ---------------------------------------------------------------------


def stats(rows: list[dict]) -> dict[str, float]:
    errs = [abs(r["error"]) for r in rows]
    return {"n": len(rows), "median_abs": statistics.median(errs) if errs else float("nan"),
            "max_abs": max(errs, default=float("nan")),
            "mean_signed": statistics.fmean(r["error"] for r in rows) if rows else float("nan")}


def groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    out = [("all", rows)]
    for chip in sorted({r["chip"] for r in rows}):
        out.append((chip, [r for r in rows if r["chip"] == chip]))
    out.append(("one slice", [r for r in rows if r["slices"] == 1]))
    out.append(("several slices", [r for r in rows if r["slices"] > 1]))
    out.append(("logged step", [r for r in rows if r["step_source"] == "log"]))
    return [(k, v) for k, v in out if v]


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def worst(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (abs(r["error"]), r["id"]))


def summary_line(cache: dict, *, link: bool = True) -> str:
    """The line docs/validation.md's summary carries (between SUMMARY_BEGIN and SUMMARY_END);
    `link` False: the same without the link to the section (the section's own headline)."""
    rows = cache["rows"]
    s, w = stats(rows), worst(rows)
    where = "[below](#runs-no-rule-or-fit-used-tpu-v5p-v4)" if link else "this section"
    chips = " and ".join(sorted({r["chip"] for r in rows}))
    return (f"**Runs no rule or fit used** ({where}: {s['n']} public {chips} runs): median "
            f"|error| {100 * s['median_abs']:.1f}%, worst {100 * s['max_abs']:.1f}% "
            f"({w['id']}, {_pct(w['error'])}).")


def table_md(rows: list[dict]) -> str:
    head = ("id", "chip", "model", "mesh", "remat", "batch x seq", "step", "meas step s",
            "pred step s", "error", "fits HBM", "later script: mesh, batch, error")
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if i >= 6 else "---" for i in range(len(head))) + "|"]
    for r in rows:
        remat = r["remat"] + (f", {r['matmul_dtype']} matmuls" if r["matmul_dtype"] != "bf16"
                              else "")
        lines.append("| " + " | ".join((
            r["id"], r["chip"], r["model"], r["mesh"], remat,
            f"{r['batch_per_chip']}x{r['seq_len']}", r["step_source"],
            f"{r['measured_step_s']:.3f}", f"{r['predicted_step_s']:.3f}", _pct(r["error"]),
            "yes" if r["fits_in_hbm"] else f"no ({r['hbm_peak_gb']:.0f} GB)",
            _later_cell(r.get("later")))) + " |")
    return "\n".join(lines)


def _later_cell(later: dict | None) -> str:
    if later is None:
        return "-"
    return (f"{later['mesh']}, {later['batch_per_chip']}, {_pct(later['error'])}"
            + ("" if later["fits_in_hbm"] else " (does not fit)"))


def stats_md(rows: list[dict]) -> str:
    lines = ["| runs | n | median abs error | max abs error | mean signed error |",
             "|---|---:|---:|---:|---:|"]
    for name, sub in groups(rows):
        s = stats(sub)
        lines.append(f"| {name} | {s['n']} | {100 * s['median_abs']:.1f}% | "
                     f"{100 * s['max_abs']:.1f}% | {_pct(s['mean_signed'])} |")
    return "\n".join(lines)


def implied_mxu_efficiency(row: dict) -> float:
    """The MXU efficiency that would make the row's step exact if everything but the MXU-bound
    time on the critical path (exposed communication, HBM- and VPU-bound ops) costs what
    tpusim says (`validation.maxtext_predict.implied_mxu_efficiency` on a cache row)."""
    b = row["breakdown"]
    rest = b.get("exposed_comm_s", 0.0) + b.get("hbm_bound_s", 0.0) + b.get("vpu_s", 0.0)
    eff = get_chip(row["chip"]).mxu_efficiency
    return eff * b.get("mxu_compute_s", 0.0) / max(row["measured_step_s"] - rest, 1e-9)


WORST_SHOWN = 8


def worst_md(rows: list[dict]) -> str:
    """Where the predicted step of the runs furthest off goes, and the MXU efficiency their
    measured step implies (the `WORST_SHOWN` largest |errors|)."""
    lines = ["| run | error | MXU-bound s | exposed communication s | HBM- and VPU-bound s | "
             "implied mxu_efficiency |", "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (-abs(r["error"]), r["id"]))[:WORST_SHOWN]:
        b = r["breakdown"]
        lines.append(
            f"| {r['id']} | {_pct(r['error'])} | {b.get('mxu_compute_s', 0.0):.2f} | "
            f"{b.get('exposed_comm_s', 0.0):.2f} | "
            f"{b.get('hbm_bound_s', 0.0) + b.get('vpu_s', 0.0):.2f} | "
            f"{implied_mxu_efficiency(r):.2f} |")
    return "\n".join(lines)


def twins(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(one-slice run, multi-slice run) pairs that differ only in the slice count (their ids
    differ only in the `-Nx-` part)."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for r in rows:
        if r["slices"] > 1:
            one = by_id.get(r["id"].replace(f"-{r['slices']}x-", "-1x-"))
            if one is not None:
                out.append((one, r))
    return out


def slowdown_md(rows: list[dict]) -> str:
    lines = ["| run | slices | measured slowdown | predicted slowdown |", "|---|---:|---:|---:|"]
    for one, many in twins(rows):
        meas = many["measured_step_s"] / one["measured_step_s"] - 1
        pred = many["predicted_step_s"] / one["predicted_step_s"] - 1
        lines.append(f"| {many['id']} | {many['slices']} | {_pct(meas)} | {_pct(pred)} |")
    return "\n".join(lines)


def section(cache: dict) -> str:
    # deferred: the template module is only needed to write the document
    from validation import template

    rows = cache["rows"]
    skipped = "".join(f"\n* {s['id']} ({s['chip']}): {s['reason']}" for s in cache["skipped"])
    return template.render("validation/unfitted.md", {
        "begin": BEGIN, "end": END, "command": COMMAND, "n": str(len(rows)),
        "stats_table": stats_md(rows), "runs_table": table_md(rows),
        "slowdown_table": slowdown_md(rows), "worst_table": worst_md(rows),
        "n_worst": str(min(WORST_SHOWN, len(rows))),
        "fitted_factors": ", ".join(f"{g} {get_chip(g).mxu_efficiency:g}"
                                    for g in GENERATIONS),
        "summary": summary_line(cache, link=False),
        "skipped": skipped or " none.",
        "v5p_factor": f"{get_chip('v5p').mxu_efficiency:g}",
        "v4_factor": f"{get_chip('v4').mxu_efficiency:g}",
    })


def updated(doc: str, cache: dict) -> str:
    """`doc` (docs/validation.md's text) with this section and the summary's line rendered
    from `cache` (`build_cache`'s), nothing else changed."""
    doc = splice(doc, BEGIN, END, section(cache))
    if SUMMARY_BEGIN not in doc:
        raise ValueError(f"{DOC_FILE.name} has no {SUMMARY_BEGIN} marker in its summary; "
                         f"regenerate it with `python -m validation.maxtext --write`")
    return splice(doc, SUMMARY_BEGIN, SUMMARY_END,
                  f"{SUMMARY_BEGIN}{summary_line(cache)}{SUMMARY_END}")


def cache_text(cache: dict) -> str:
    """The cache file's text."""
    return json.dumps(cache, indent=1, sort_keys=True) + "\n"


def write_doc(cache: dict, doc_file: Path = DOC_FILE) -> None:
    doc_file.write_text(updated(doc_file.read_text(), cache))


def summary_block(cache_file: Path = CACHE_FILE) -> str:
    """The marked summary line for `validation.maxtext --write` (empty without a cache)."""
    if not cache_file.is_file():
        return f"{SUMMARY_BEGIN}{SUMMARY_END}"
    return f"{SUMMARY_BEGIN}{summary_line(read_cache(cache_file))}{SUMMARY_END}"


def print_table(cache: dict, out=sys.stdout) -> None:
    rows = cache["rows"]
    print(table_md(rows), file=out)
    print("", file=out)
    print(stats_md(rows), file=out)
    for s in cache["skipped"]:
        print(f"skipped {s['id']} ({s['chip']}): {s['reason']}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=UNFITTED_FILE, help="the runs file to read")
    ap.add_argument("--write", action="store_true",
                    help=f"also write {CACHE_FILE.relative_to(ROOT)} and the section of "
                         f"{DOC_FILE.relative_to(ROOT)}")
    ap.add_argument("--cached", action="store_true",
                    help=f"print from {CACHE_FILE.relative_to(ROOT)} without rebuilding")
    args = ap.parse_args(argv)
    if args.cached:
        cache = read_cache()
        if cache["runs_file_sha256"] != file_digest(args.runs):
            print(f"{CACHE_FILE.relative_to(ROOT)} is stale: {args.runs.name} changed; run "
                  f"`{COMMAND}`", file=sys.stderr)
            return 1
    else:
        cache = build_cache(args.runs)
    print_table(cache)
    if args.write:
        CACHE_FILE.write_text(cache_text(cache))
        write_doc(cache)
        print(f"\nwrote {CACHE_FILE.relative_to(ROOT)} and the unfitted-runs section of "
              f"{DOC_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
