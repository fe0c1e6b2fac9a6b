"""The PNG plots of studies and plans: a study's y against x, a line per value of the other
varied keys; a plan's tokens/s/chip against peak HBM with its Pareto frontier. Points that do
not fit in HBM are hollow grey markers off the lines (their numbers describe a run that cannot
happen), unless a study asks to draw them like the others.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.export.output import atomic_write
from sim.export.plots import _fig
from sim.studies.results import ERROR_COLUMN, STATUS_COLUMN, STATUS_DOES_NOT_FIT, STATUS_OK
from sim.studies.spec import StudySpec

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


__all__ = ["UNFIT_LABEL", "UNFIT_STYLE", "plot_study"]
