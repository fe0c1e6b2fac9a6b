"""The plan's report: one row per candidate (its settings, simulated numbers, lower bound and
status: ranked, out of memory, failed, or skipped by its bound), ranked by the objective into
the plan's table, the counts of what the search did, and one line on why the winner wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from sim.studies.plan_objectives import objective_value
from sim.studies.plan_space import Candidate, PodVariant
from sim.studies.results import STATUS_DOES_NOT_FIT, STATUS_ERROR, STATUS_OK
from topologies.errors import python_name, render_said

PLAN_COLUMNS = (
    "rank", "mesh", "placement", "remat", "microbatches", "param_dtype", "grad_dtype",
    "optimizer_dtype", "optimizer", "gather_dtype", "step_time_s", "mfu",
    "tokens_per_s_per_chip", "energy_j", "energy_per_token_j", "cost_per_million_tokens_usd",
    "hbm_peak_bytes",
    "hbm_estimate_bytes", "lower_bound_s", "bound", "fits_in_hbm", "status", "error",
)
# A candidate's `status`, as `tpusim sweep` names them (`sim.studies.results.STATUSES`), plus
# the ones the search never simulated because a cheaper candidate's bound ruled them out.
PLAN_STATUS_SKIPPED = "skipped: lower bound above the top K"

_BOUNDS = {  # breakdown component -> what bounds a step whose critical path it dominates
    "mxu_compute_s": "compute (MXU)",
    "vpu_s": "vector units (VPU)",
    "hbm_bound_s": "HBM bandwidth",
    "exposed_comm_s": "communication",
    "pipeline_bubble_s": "pipeline bubble",
}


@dataclass(kw_only=True)
class PlanResult:
    """Every candidate considered, the simulated ones ranked, and the winner explained."""

    table: Any  # pandas DataFrame, PLAN_COLUMNS, ranked rows first
    explanation: str
    counts: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    model: str = ""
    pod: str = ""
    hbm_capacity_bytes: float = math.nan  # the chip's usable HBM, as the simulations saw it
    objective: str = "time"  # what ranked them (OBJECTIVES)

    @property
    def best(self) -> dict[str, Any] | None:
        ok = self.table[self.table["status"] == "ok"]
        return ok.iloc[0].to_dict() if len(ok) else None

    def top(self, k: int):
        return self.table[self.table["status"] == "ok"].head(k)


def _bound(row: dict[str, Any]) -> str:
    comps = {k: row.get(k) for k in _BOUNDS if isinstance(row.get(k), (int, float))}
    if not comps:
        return ""
    k = max(comps, key=lambda c: (comps[c], -list(_BOUNDS).index(c)))
    share = comps[k] / row["step_time_s"] if row.get("step_time_s") else 0.0
    return f"{_BOUNDS[k]} {share:.0%}"


def candidate_rows(cands: list[Candidate], results: Mapping[int, dict[str, Any]],
                   lb: list[float], refused: set[int], stopped: set[int],
                   objective: str) -> list[dict[str, Any]]:
    """One row per candidate (its settings, its simulated numbers if it ran, its lower bound,
    what bounds its step, its status), with the private keys the ranking and the explanation
    read (`_order`, `_breakdown`, `_value`, `_capacity`). `refused`, `stopped`: out of memory
    by their HBM bound or when their simulation went over; a candidate without a result was
    skipped by its bound."""
    rows = []
    for i, c in enumerate(cands):
        o = results.get(i)
        r = (o or {}).get("result") or {}
        flat = {**r, **(r.get("breakdown") or {})}
        error = pd.NA
        if i in refused or i in stopped:
            status, fits = STATUS_DOES_NOT_FIT, False
        elif o is None:
            status, fits = PLAN_STATUS_SKIPPED, pd.NA
        elif "result" not in o:
            status, fits, error = STATUS_ERROR, pd.NA, o.get("error")  # a Said
        else:
            fits = bool(r.get("fits_in_hbm"))
            status = STATUS_OK if fits else STATUS_DOES_NOT_FIT
        rows.append({
            "shape": c.shape, "twist": c.twist,
            "mesh": c.mesh_text, "placement": c.placement, "remat": c.remat,
            "microbatches": c.microbatches, "param_dtype": c.param_dtype,
            "grad_dtype": c.grad_dtype, "optimizer_dtype": c.optimizer_dtype,
            # The update rule and the dtype weights are gathered and multiplied in (the params'
            # own unless --gather-dtype casts them): what the row's train command ran.
            "optimizer": c.optimizer, "gather_dtype": c.gather_dtype or c.param_dtype,
            "step_time_s": r.get("step_time_s", math.nan), "mfu": r.get("mfu", math.nan),
            "tokens_per_s_per_chip": r.get("tokens_per_s_per_chip", math.nan),
            "energy_j": (r.get("energy") or {}).get("step_j", math.nan),
            "energy_per_token_j": (r.get("energy") or {}).get("j_per_token", math.nan),
            "cost_per_million_tokens_usd": _nan((r.get("cost") or {}).get(
                "usd_per_million_tokens")),
            "hbm_peak_bytes": r.get("hbm_peak_bytes", math.nan),
            "hbm_estimate_bytes": c.hbm_estimate_bytes, "lower_bound_s": lb[i],
            "bound": _bound(flat) if r else "", "fits_in_hbm": fits, "status": status,
            "error": error,
            "_order": i, "_breakdown": r.get("breakdown"),
            "_value": objective_value(r, objective) if r else math.nan,
            "_capacity": r.get("hbm_capacity_bytes"),
        })
    return rows


def ranked(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the rows that fit, best first by the objective, then the step time, then the order
    they were generated in, each given its `rank`; the others, by their lower bound)."""
    ok = sorted((x for x in rows if x["status"] == "ok"),
                key=lambda x: (x["_value"], x["step_time_s"], x["_order"]))
    rest = sorted((x for x in rows if x["status"] != "ok"),
                  key=lambda x: (x["lower_bound_s"], x["_order"]))
    for k, x in enumerate(ok, 1):
        x["rank"] = k
    for x in rest:
        x["rank"] = pd.NA
    return ok, rest


def plan_table(ok: list[dict[str, Any]], rest: list[dict[str, Any]], searched_pods: bool,
               spell: Callable[[str], str] = python_name):
    """The ranked rows as the plan's DataFrame (`PLAN_COLUMNS`, ranked rows first); a failed
    candidate's error (a `Said`) names its settings as `spell` writes them (by Python name, or
    a front end's way: the CLI's flags)."""
    # The slice of each candidate, when slices were searched (`--shapes`, or a shape that
    # can twist): a `shape` and a `twist` column after the rank; a plan of one pod has none.
    columns = list(PLAN_COLUMNS)
    if searched_pods:
        columns[1:1] = ["shape", "twist"]
    table = pd.DataFrame([{**{c: x[c] for c in columns}, "error": render_said(x["error"], spell)}
                          for x in ok + rest], columns=columns)
    table["rank"] = table["rank"].astype("Int64")
    table["fits_in_hbm"] = table["fits_in_hbm"].astype("boolean")
    table["error"] = table["error"].astype("string")
    return table


def pod_label(variants: list[PodVariant], topology, chip) -> str:
    """`4x4x8 v4`; with slices searched, how many (`4 slices of 256 chips v4`)."""
    if not any(v.shape is not None for v in variants):
        name = "x".join(map(str, topology.shape)) + (" twisted" if topology.twisted else "")
        return f"{name} {chip.name}"
    shapes = dict.fromkeys(v.shape for v in variants)
    if len(shapes) == 1:
        return f"{next(iter(shapes))} plain and twisted {chip.name}"
    return (f"{len(shapes)} shapes of {topology.num_chips} chips "
            f"({len(variants)} slices with their wirings) {chip.name}")


def _nan(v: Any) -> float:
    return math.nan if v is None else v


_GAIN_WORDS = {"time": ("faster", "as fast as"), "cost": ("cheaper", "as cheap as"),
               "energy": ("less energy", "as little energy as")}


def explain(ranked: list[dict[str, Any]], objective: str = "time") -> str:
    """One line on why the winner wins: where its axes sit, what bounds it, its memory
    headroom, and how much it beats the runner-up by (in the objective's terms)."""
    if not ranked:
        return "no candidate fits in HBM; allow more remat, microbatches or sharding"
    w = ranked[0]
    pod = (f"{w['shape']}{' twisted' if w['twist'] else ''}: " if w.get("shape") else "")
    text = f"{pod}{w['placement']}, remat {w['remat']}"
    if w["microbatches"] > 1:
        text += f", {w['microbatches']} microbatches"
    cap = w.get("_capacity") or 0
    if cap:
        text += (f": fits in {w['hbm_peak_bytes'] / 1e9:.1f} of {cap / 1e9:.0f} GB")
    bd = w.get("_breakdown") or {}
    comm = bd.get("exposed_comm_s", 0.0) / w["step_time_s"] if w["step_time_s"] else 0.0
    text += f"; bound by {w['bound']}, {comm:.0%} of the step exposed communication"
    if len(ranked) > 1:
        r = ranked[1]
        key = "_value" if "_value" in w else "step_time_s"
        gain = r[key] / w[key] - 1 if w[key] else 0.0
        better, tie = _GAIN_WORDS[objective]
        what = [f"{r['shape']}{' twisted' if r['twist'] else ''}"
                if (r.get("shape"), r.get("twist")) != (w.get("shape"), w.get("twist")) else "",
                f"{r['mesh']}" if r["mesh"] != w["mesh"] else "",
                f"placement {r['placement']}" if r["mesh"] == w["mesh"]
                and r["placement"] != w["placement"] else "",
                f"remat {r['remat']}" if r["remat"] != w["remat"] else "",
                f"{r['microbatches']} microbatches" if r["microbatches"] != w["microbatches"]
                else ""]
        what = ", ".join(x for x in what if x) or "the same layout with other dtypes"
        # Equal layouts placed differently often tie: "0.0% faster" would read as a margin.
        text += (f"; {gain:.1%} {better} than the runner-up ({what})"
                 if f"{gain:.1%}" != "0.0%"
                 else f"; {tie} the runner-up to within 0.05% ({what})")
    return text


def plan_summary(res: PlanResult, top: int) -> dict:
    """The plan's summary: what the CLI prints as JSON and `summary.json` holds."""
    def clean(rec):
        return {k: (None if isinstance(v, float) and math.isnan(v) else
                    (None if v is None or str(v) == "<NA>" else v)) for k, v in rec.items()}

    return {
        "model": res.model, "pod": res.pod, "objective": res.objective,
        "best": clean(res.best) if res.best else None,
        "explanation": res.explanation,
        "top": [clean(r) for r in res.top(top).to_dict("records")],
        "searched": res.counts,
        "wall_s": res.wall_s,
    }

