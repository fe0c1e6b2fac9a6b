"""The energy figure of a step (`energy.png`, part of `plot_step`): on the left the step's joules
per chip by unit (MXU, VPU, HBM, ICI, DCN, PCIe, static, host, data-centre overhead: the
`energy.step_j_by_unit` of the result divided by the chips), on the right each chip class's own
power over the step (`sim.energy.power_steps`: its ops' dynamic energy spread over their
intervals, on top of idle power), with the peak window's mean and the power cap when one is
set. Built as `sim/export/plots.py` says.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.energy import UNITS, Energy
from sim.export.plots import (
    COLORS,
    UNIT_WORDS,
    add_legend,
    legend_height,
    new_figure,
    styled,
    time_unit,
    wrap_text,
)

# Energy units' colours: the chip units as everywhere, then static, host and overhead in greys.
ENERGY_COLORS = {**COLORS, "static": "#999999", "host": "#BBBBBB", "overhead": "#DDDDDD"}
ENERGY_WORDS = {**UNIT_WORDS, "static": "static (idle power)", "host": "host share",
                "overhead": "data-centre overhead (PUE)"}
# Chip classes drawn on the power panel: the ones with the highest peak first; the caption says
# how many are left out.
MAX_POWER_CLASSES = 6
_CLASS_COLORS = ("#4C72B0", "#C44E52", "#55A868", "#8172B2", "#CCB974", "#64B5CD")


@styled
def energy_figure(energy: Energy, caption: str, *, cap_w: float | None = None):
    """The step's energy figure (see the module docstring)."""
    width = 10.0
    per_chip = {u: energy.step_j_by_unit[u] / energy.num_chips for u in UNITS}
    total = sum(per_chip.values())
    title = wrap_text(width, f"energy of the step: {total:.4g} J per chip "
                         f"({energy.step_j:.4g} J for the {energy.num_chips} chips), "
                         f"chip power mean {energy.chip_power_w_mean:.1f} W, peak "
                         f"{energy.chip_power_w_peak:.1f} W over "
                         f"{energy.power_window_s * 1e3:g} ms", caption)
    classes = sorted(energy.classes, key=lambda c: (-c.chip_power_w_peak, c.chip_class))
    shown = classes[:MAX_POWER_CLASSES]
    fig = new_figure(width, 2.8, title, left=1.9, axes_titles=True, wspace=0.35,
                  bottom=0.55 + legend_height(len(shown) + (cap_w is not None), 3))
    a1, a2 = fig.subplots(1, 2)
    units = [u for u in UNITS if per_chip[u] > 0] or list(UNITS)
    ys = np.arange(len(units))[::-1]
    vals = [per_chip[u] for u in units]
    a1.barh(ys, vals, color=[ENERGY_COLORS.get(u, "#333") for u in units])
    a1.set_yticks(ys, [ENERGY_WORDS.get(u, u) for u in units])
    top = max(vals, default=0.0) or 1.0
    for y, v in zip(ys, vals, strict=True):
        a1.text(v + 0.01 * top, y, f"{v:.3g} J ({v / total:.0%})" if total else "0 J",
                va="center", fontsize=8)
    a1.set_xlim(0, top * 1.45)
    a1.set_xlabel("joules per chip")
    a1.set_title("where the joules go")
    scale, unit = time_unit(energy.time_s)
    handles = []
    for i, c in enumerate(shown):
        pts = np.asarray(c.power_w, dtype=float).reshape(-1, 2)
        if not len(pts):
            continue
        (line,) = a2.step(pts[:, 0] * scale, pts[:, 1], where="post",
                          color=_CLASS_COLORS[i % len(_CLASS_COLORS)], linewidth=0.9)
        who = f"chip {c.chip}" + (f" (+{c.num_chips - 1} alike)" if c.num_chips > 1 else "")
        line.set_label(f"{who}: mean {c.chip_power_w_mean:.0f} W")
        handles.append(line)
    if cap_w is not None:
        handles.append(a2.axhline(cap_w, color="#333", linestyle="--", linewidth=0.8,
                                  label=f"power cap {cap_w:g} W"))
    a2.set_xlim(0, energy.time_s * scale or 1.0)
    a2.set_ylim(0, None)
    a2.set_xlabel(f"time in the step ({unit})")
    a2.set_ylabel("chip power (W)")
    left_out = len(classes) - len(shown)
    a2.set_title("chip power over the step" + (f" ({left_out} more chip classes not drawn)"
                                                if left_out else ""))
    if handles:
        add_legend(fig, handles, ncol=3)
    return fig


def energy_figures(energy: Energy | None, summary: dict[str, Any],
                   caption: str) -> dict[str, Any]:
    """{"energy.png": figure} for a step with its energy, else {}."""
    if energy is None or not energy.classes:
        return {}
    cap = (summary.get("power_cap") or {}).get("cap_w")
    return {"energy.png": energy_figure(energy, caption, cap_w=cap)}
