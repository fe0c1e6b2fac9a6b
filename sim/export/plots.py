"""What every plot of a run shares: the fixed style, the figure and legend layout, the
formats of times and bytes, and the words that name the model, the pod and the mesh.

The figures are `sim/export/step_plots.py` (a training or inference step),
`sim/export/torus_plots.py` (links on the torus, per-chip maps), `sim/export/collective_plots.py`
(one collective), `goodput_plots.py` and `serving_plots.py`.

Figures are `matplotlib.figure.Figure` objects on the Agg canvas, without pyplot: no global
backend switch (a notebook keeps its own), and no figure manager to tear down. They are drawn
with one collection per colour or line style instead of one artist per op or link (a 70B step
has thousands of ops, a pod thousands of links), under a fixed font and without the PNG
`Software` stamp, so identical inputs give byte-identical files. Every figure names the model,
the pod and the mesh; colour bars sit in a right margin of their own, so their labels are
never clipped. `*_figures` build the figures (tests inspect their artists); `plot_*` write them.
"""

from __future__ import annotations

import functools
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from sim.export.output import atomic_write

DPI = 100
# Bound units (op colours) and the words for them.
COLORS = {"mxu": "#4C72B0", "vpu": "#55A868", "hbm": "#C44E52", "ici": "#8172B2",
           "dcn": "#64B5CD", "pcie": "#CCB974", "idle": "#999999"}
UNIT_WORDS = {"mxu": "MXU", "vpu": "VPU", "hbm": "HBM", "ici": "ICI", "dcn": "DCN",
              "pcie": "PCIe", "idle": "idle"}
BOUND_WORDS = {"idle": "idle (waiting)"}
PHASE_WORDS = {"fwd": "forward", "bwd": "backward", "loss": "loss", "optimizer": "optimizer",
               "": "no phase recorded"}
PHASE_COLORS = {"fwd": "#9ECAE1", "bwd": "#FDAE6B", "loss": "#D9D9D9", "optimizer": "#A1D99B"}
OTHER_PHASE_COLORS = ("#DADAEB", "#FDD0A2", "#C7E9C0", "#FCBBA1", "#D9D9D9")
STEP_COLORS = ("#8172B2", "#4C72B0", "#55A868", "#C44E52", "#CCB974", "#64B5CD", "#8C8C8C")
# Fixed style: text in the font matplotlib ships (never a system font that differs between
# machines), so the same inputs give the same bytes.
_RC = {"font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 9,
       "figure.titlesize": 10, "path.simplify": True}
_SAVE_META = {"Software": None}
MAX_PANELS = 32  # z slices (x slices) drawn per link; more are sampled, and the plot says so


def agg_pyplot():
    """pyplot on the Agg backend (kept for the study and plan plots, which use pyplot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def styled(fn):
    """Run a figure builder under the fixed style (fonts are resolved when artists are made)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(_RC):
            return fn(*args, **kwargs)

    return wrapper


def wrap_text(width_in: float, *lines: str, size: float = _RC["figure.titlesize"]) -> str:
    """Lines of text wrapped to the figure's width (a title that fits)."""
    chars = max(int(width_in * 72 / (0.6 * size)), 30)
    return "\n".join(textwrap.fill(s, chars) for s in lines if s)


def new_figure(width_in: float, body_in: float, title: str, *, left: float = 0.9,
            right: float = 0.3, bottom: float = 0.55, axes_titles: bool = False,
            wspace: float | None = None, hspace: float | None = None):
    """A figure `body_in` inches tall for the axes plus room for the title above and `bottom`
    inches below (tick labels, legends, notes). Margins are set here, in inches, rather than by
    a layout engine: constrained layout measures every text artist and took as long as drawing."""
    from matplotlib.figure import Figure

    top = 0.2 + 0.2 * (title.count("\n") + 1) + (0.25 if axes_titles else 0.0)
    height = top + body_in + bottom
    fig = Figure(figsize=(width_in, height), dpi=DPI)
    fig.suptitle(title, y=1 - 0.1 / height, va="top")
    fig.subplots_adjust(left=left / width_in, right=1 - right / width_in, top=1 - top / height,
                        bottom=bottom / height, wspace=wspace, hspace=hspace)
    return fig


def add_legend(fig, handles, ncol: int, y_in: float = 0.0, **kw) -> None:
    """A legend under the axes (never on the lanes), in the figure's bottom margin."""
    y = y_in / fig.get_figheight()
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, y), ncol=ncol,
               fontsize=8, frameon=False, **kw)


def legend_height(n: int, ncol: int, titled: bool = False) -> float:
    return 0.1 + 0.2 * math.ceil(n / max(ncol, 1)) + (0.2 if titled else 0.0)


def add_footnote(width_in: float, text: str) -> tuple[str, float]:
    """A note for the bottom of a figure, wrapped; and the inches it takes."""
    if not text:
        return "", 0.0
    t = wrap_text(width_in, text, size=8)
    return t, 0.08 + 0.16 * (t.count("\n") + 1)


def save(fig, path: Path) -> Path:
    return atomic_write(path, lambda p: fig.savefig(p, dpi=DPI, format="png",
                                                    metadata=_SAVE_META))


def draw_table(rows: list[tuple], columns: list[str], wanted: tuple[str, ...]) -> dict[str, Any]:
    """Columns `wanted` of a result's rows as numpy arrays (plots need no pandas, whose import
    alone takes a good part of a second)."""
    idx = [columns.index(c) for c in wanted]
    return {c: np.asarray([r[i] for r in rows]) for c, i in zip(wanted, idx, strict=True)}


def time_unit(t: float) -> tuple[float, str]:
    if t >= 1:
        return 1.0, "s"
    if t >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def time_label(t: float) -> str:
    scale, unit = time_unit(t)
    return f"{t * scale:.4g} {unit}"


def bytes_label(b: float) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:.3g} {unit}"
    return f"{b:.0f} B"


# -- what every figure names: the model, the pod and the mesh -----------------------------------
def mesh_words(mesh: dict[str, Any] | None) -> str:
    """`inputs.mesh` of a run (`{"ici": ..., "dcn": ..., "placement": ...}`) in words:
    "mesh tensor=4 on x, fsdp=4 on y; DCN data=2"."""
    if not mesh:
        return "mesh not recorded"
    place = mesh.get("placement") or {}

    def where(name: str) -> str:
        fs = place.get(name)
        if not fs:
            return ""
        return " on " + "+".join(f"{f[0]}" if len(fs) == 1 else f"{f[0]}:{f[1]}" for f in fs)

    ici = ", ".join(f"{n}={v}{where(n)}" for n, v in (mesh.get("ici") or {}).items())
    dcn = ", ".join(f"{n}={v}" for n, v in (mesh.get("dcn") or {}).items())
    text = f"mesh {ici or '(none)'}"
    return text + (f"; DCN {dcn}" if dcn else "")


def pod_words(chip: str, topology: str, num_chips: int) -> str:
    return f"{chip} {topology} ({num_chips} chips)"


def step_caption(result, summary: dict[str, Any]) -> str:
    """"<model> on <chip> <shape> (<n> chips), mesh ..." for a step's figures."""
    inputs = summary.get("inputs") or {}
    model = (summary.get("model") or (inputs.get("trace") or {}).get("model")
             or (f"HLO module {summary['module']}" if summary.get("module") else None)
             or "model not recorded")
    return (f"{model} on {pod_words(result.chip, result.topology, result.num_chips)}, "
            f"{mesh_words(inputs.get('mesh'))}")


def collective_caption(res) -> str:
    """A collective has no model and no mesh: its replica groups stand for the mesh."""
    over = f" over {','.join(res.axes)}" if res.axes else ""
    return (f"one collective (no model) on {pod_words(res.chip, res.topology, res.num_chips)}, "
            f"{res.num_groups} replica group(s) of {res.group_size} chips{over}")


