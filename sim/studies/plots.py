"""The PNG plots of studies and plans: a study's y against x, a line per value of the other
varied keys; a plan's tokens/s/chip against peak HBM with its Pareto frontier. Points that do
not fit in HBM are hollow grey markers off the lines (their numbers describe a run that cannot
happen), unless a study asks to draw them like the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.export.output import atomic_write
from sim.export.plots import _fig
from sim.studies.results import ERROR_COLUMN, STATUS_COLUMN, STATUS_DOES_NOT_FIT, STATUS_OK
from sim.studies.spec import StudySpec

if TYPE_CHECKING:
    from sim.studies.plan_report import PlanResult

# How a point that does not fit in HBM is drawn in a study plot: a hollow grey marker, off the
# lines (a line through it would present a run that cannot happen as a trend to follow).
UNFIT_STYLE = {"marker": "o", "facecolors": "none", "edgecolors": "#9a9a9a", "linewidths": 1.2}
UNFIT_LABEL = "does not fit in HBM"


def plot_study(study: StudySpec, df, out_dir: str | Path, *, allow_oom: bool = False) \
        -> list[Path]:
    """One PNG per `plot` entry: y against x, a line per hue value (and per value of every other
    varied key, so that no line mixes points); failed points are left out, points that do not
    fit in HBM are hollow grey markers off the lines (`allow_oom`: drawn like the others)."""
    if not study.plots:
        return []
    plt = _fig()  # matplotlib, loaded on the first plot
    ran = df[df[ERROR_COLUMN].isna()]
    if STATUS_COLUMN in ran.columns and not allow_oom:
        ok = ran[ran[STATUS_COLUMN] == STATUS_OK]
        unfit = ran[ran[STATUS_COLUMN] == STATUS_DOES_NOT_FIT]
    else:
        ok, unfit = ran, ran.iloc[0:0]
    paths = []
    for spec in study.plots:
        p = dict(spec)
        x, y, hue = p["x"], p["y"], p.get("hue")
        if y not in ran.columns:
            continue
        others = [k for k in study.varied if k not in (x, hue)]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs_all = _ordered_values(study, x)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs_all)
        pos = {(v if numeric else str(v)): (v if numeric else k) for k, v in enumerate(xs_all)}

        def at(g, x=x, numeric=numeric, pos=pos):
            return [pos.get(v if numeric else str(v), math.nan) for v in g[x]]

        groups = [hue] if hue else []
        groups += others
        keyed = ok.groupby(groups, sort=False, dropna=False) if groups else [((), ok)]
        for key, g in keyed:
            key = key if isinstance(key, tuple) else (key,)
            label = ", ".join(f"{k}={v}" for k, v in zip(groups, key, strict=True))
            g = g.assign(_x=at(g))
            g = g.sort_values("_x")
            ax.plot(g["_x"], g[y], marker="o", label=label or None)
        if len(unfit):
            ax.scatter(at(unfit), unfit[y], label=UNFIT_LABEL, zorder=3, **UNFIT_STYLE)
        if not numeric:
            ax.set_xticks(range(len(xs_all)), [str(v) for v in xs_all])
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"tpusim {study.command}: {y} vs {x}")
        if groups or len(unfit):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / f"plot_{_safe(y)}_vs_{_safe(x)}.png"
        paths.append(atomic_write(path, lambda q, fig=fig: fig.savefig(q, dpi=110, format="png")))
        plt.close(fig)
    return paths


def _ordered_values(study: StudySpec, key: str) -> list[Any]:
    for k, v in study.grid + study.zip:
        if k == key:
            return list(dict.fromkeys(v))
    return []


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


# -- a plan ------------------------------------------------------------------------------
def plot_frontier(result: PlanResult, path) -> Any:
    """Tokens/s/chip against peak HBM for every simulated candidate that fits, the Pareto
    frontier (nothing else is both faster and smaller) drawn through them, the winner marked;
    candidates simulated to the end that do not fit are hollow grey markers, on neither the
    frontier nor the winner (their numbers describe a run that cannot happen)."""
    plt = _fig()  # matplotlib, loaded on the first plot
    t = result.table
    ok = t[t["status"] == STATUS_OK]
    unfit = t[(t["status"] == STATUS_DOES_NOT_FIT) & t["tokens_per_s_per_chip"].notna()]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if len(unfit):
        ax.scatter(unfit["hbm_peak_bytes"] / 1e9, unfit["tokens_per_s_per_chip"], s=14,
                   label=UNFIT_LABEL, **UNFIT_STYLE)
    if len(ok) or len(unfit):
        ax.axvline(_capacity_gb(result), color="#9a9a9a", lw=0.8, ls="--")
    if len(ok):
        gb = ok["hbm_peak_bytes"] / 1e9
        front = _pareto(list(zip(gb, ok["tokens_per_s_per_chip"], strict=True)))
        b = ok.iloc[0]
        _draw_candidates(ax, gb, ok["tokens_per_s_per_chip"], front,
                         "frontier (fastest for its memory)",
                         (gb.iloc[0], b["tokens_per_s_per_chip"]),
                         f"best: {b['mesh']} {b['remat']}")
    if len(ok) or len(unfit):
        ax.legend(fontsize=7)
    return _finish(plt, fig, ax, path, "peak HBM per chip (GB; dashed: the chip's capacity)",
                   "tokens/s/chip", f"plan: {result.model} on {result.pod}")


def plot_cost_frontier(result: PlanResult, path) -> Any | None:
    """Dollars per million tokens against step time for every simulated candidate that fits
    and has a price, the frontier of those no other candidate beats on both (faster and
    cheaper) drawn through them, and the plan's winner (by its `objective`) marked; None (no
    file) when no candidate has a price (a chip without a list price)."""
    t = result.table
    ok = t[(t["status"] == STATUS_OK) & t["cost_per_million_tokens_usd"].notna()
           & t["step_time_s"].notna()]
    if not len(ok):
        return None
    plt = _fig()  # matplotlib, loaded on the first plot
    fig, ax = plt.subplots(figsize=(7, 4.2))
    cost = ok["cost_per_million_tokens_usd"]
    b = ok.iloc[0]
    _draw_candidates(ax, ok["step_time_s"], cost,
                     cost_time_frontier(zip(ok["step_time_s"], cost, strict=True)),
                     "frontier (cheapest for its time)", (b["step_time_s"], cost.iloc[0]),
                     f"best by {result.objective}: {b['mesh']} {b['remat']}")
    ax.legend(fontsize=7)
    return _finish(plt, fig, ax, path, "step time (s)", "$ per million tokens",
                   f"plan: {result.model} on {result.pod}, cost against time")


def cost_time_frontier(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (time, cost) points no other point beats on both (lower time and lower cost), by
    time: `_pareto`'s frontier of (time, -cost)."""
    return [(x, -y) for x, y in _pareto([(x, -y) for x, y in points])]


def _draw_candidates(ax, xs, ys, front, front_label: str, best, best_label: str) -> None:
    """A plan figure's candidates, their frontier and the winner's star."""
    ax.scatter(xs, ys, s=14, color="#8da0cb", label="candidates")
    ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color="#e78ac3", ms=4,
            label=front_label)
    ax.scatter([best[0]], [best[1]], marker="*", s=160, color="#d62728", zorder=5,
               label=best_label)


def _finish(plt, fig, ax, path, xlabel: str, ylabel: str, title: str):
    """Label a plan figure, write it as PNG and close it; returns the path written."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = atomic_write(path, lambda q: fig.savefig(q, dpi=110, format="png"))
    plt.close(fig)
    return out


def _capacity_gb(result: PlanResult) -> float:
    return result.hbm_capacity_bytes / 1e9


def _pareto(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


__all__ = ["UNFIT_LABEL", "UNFIT_STYLE", "cost_time_frontier", "plot_cost_frontier",
           "plot_frontier", "plot_study"]
