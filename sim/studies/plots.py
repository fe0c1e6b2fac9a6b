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
from sim.export.plots import agg_pyplot
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
    knee = plot_serving_knee(study, df, out_dir)
    if not study.plots:
        return knee
    plt = agg_pyplot()  # matplotlib, loaded on the first plot
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
    return knee + paths


# A serving sweep over `rate` draws its knee: tail latency against the throughput delivered.
KNEE_FILE = "latency_throughput.png"
_KNEE_Y = (("ttft_s.p99", "p99 TTFT (s)"), ("tpot_s.p99", "p99 TPOT (s)"))
_KNEE_X = "throughput_tokens_per_s"


def knee_lines(study: StudySpec, df) -> list[tuple[str | None, Any, Any, Any]]:
    """The knee plot's lines: (label, its points by rate, those not saturated (the line),
    the saturated ones) per value of the varied keys other than `rate`; empty when the study
    is no serving rate sweep."""
    if study.command != "serve" or "rate" not in study.varied:
        return []
    ran = df[df[ERROR_COLUMN].isna()]
    if not len(ran) or any(c not in ran.columns for c in (_KNEE_X, "saturated",
                                                         *(y for y, _ in _KNEE_Y))):
        return []
    others = [k for k in study.varied if k != "rate"]
    keyed = ran.groupby(others, sort=False, dropna=False) if others else [((), ran)]
    out = []
    for key, g in keyed:
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{k}={v}" for k, v in zip(others, key, strict=True)) or None
        g = g.sort_values("rate")
        sat = g["saturated"].astype(bool)
        out.append((label, g, g[~sat], g[sat]))
    return out


def plot_serving_knee(study: StudySpec, df, out_dir: str | Path) -> list[Path]:
    """`latency_throughput.png` of a `serve` study that varies `rate`: p99 TTFT and p99 TPOT
    against output tokens per second, a line per value of the other varied keys, each point
    labelled with its rate; saturated points (the queue grows without bound) are hollow red
    markers, left out of the lines. Nothing for other studies."""
    lines = knee_lines(study, df)
    if not lines:
        return []
    plt = agg_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, g, ok, sat in lines:
        for ax, (y, _name) in zip(axes, _KNEE_Y, strict=True):
            line = ax.plot(ok[_KNEE_X], ok[y], marker="o", label=label)[0]
            if len(sat):
                ax.scatter(sat[_KNEE_X], sat[y], facecolors="none", edgecolors="#c44e52",
                           linewidths=1.2, zorder=3)
            for x, v, r in zip(g[_KNEE_X], g[y], g["rate"], strict=True):
                ax.annotate(f"{r:g}/s", (x, v), textcoords="offset points", xytext=(3, 3),
                            fontsize=6, color=line.get_color())
    for ax, (_y, name) in zip(axes, _KNEE_Y, strict=True):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if lines[0][0] is not None:
        axes[0].legend(fontsize=7)
    fig.suptitle("tpusim serve: tail latency against throughput across rates "
                 "(hollow red: saturated)", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / KNEE_FILE
    out = atomic_write(path, lambda q: fig.savefig(q, dpi=110, format="png"))
    plt.close(fig)
    return [out]


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
    plt = agg_pyplot()  # matplotlib, loaded on the first plot
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
    plt = agg_pyplot()  # matplotlib, loaded on the first plot
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
           "knee_lines", "plot_frontier", "plot_serving_knee",
           "plot_study"]
