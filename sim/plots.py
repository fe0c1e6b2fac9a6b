"""Matplotlib figures of a simulated step: chip timeline, critical-path breakdown, unit and
link-class utilization. Written as PNG files (Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

from sim.output import atomic_write

_COLORS = {"mxu": "#4C72B0", "vpu": "#55A868", "hbm": "#C44E52", "ici": "#8172B2",
           "pcie": "#CCB974", "idle": "#999999"}


def _fig():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_step(result, summary: dict, out_dir: str | Path) -> list[Path]:
    """Timeline, breakdown and utilization PNGs of a replayed step; returns the paths."""
    plt = _fig()
    out = Path(out_dir)
    paths = []
    ops = result.ops
    # 1. Timeline of the representative chip.
    fig, ax = plt.subplots(figsize=(12, 3.2))
    lanes = {"mxu": 3, "vpu": 2, "hbm": 2, "ici": 1, "pcie": 0, "idle": 0}
    for r in ops.itertuples(index=False):
        if r.end_s <= r.start_s:
            continue
        key = r.bound if r.kind == "compute" else ("ici" if r.kind == "collective" else r.bound)
        y = {"compute": 3 if r.unit == "mxu" else 2, "collective": 1}.get(r.kind, 0)
        ax.broken_barh([(r.start_s, r.end_s - r.start_s)], (y - 0.4, 0.8),
                       facecolors=_COLORS.get(key, "#333333"), linewidth=0)
    del lanes
    ax.set_yticks([0, 1, 2, 3], ["PCIe / idle", "ICI collectives", "VPU", "MXU"])
    ax.set_xlabel("time (s)")
    ax.set_title(f"{summary.get('model', '')} step on {result.topology} {result.chip}: chip 0 "
                 f"timeline (colour = bound unit)")
    ax.set_xlim(0, max(result.step_time_s, 1e-12))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", ncol=6, fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "timeline.png"))
    plt.close(fig)
    # 2. Critical-path breakdown.
    fig, ax = plt.subplots(figsize=(7, 3))
    bd = result.breakdown
    names = list(bd)
    ax.barh(names, [bd[k] for k in names], color=["#4C72B0", "#55A868", "#C44E52", "#8172B2",
                                                   "#999999"])
    for i, k in enumerate(names):
        share = bd[k] / result.step_time_s if result.step_time_s else 0
        ax.text(bd[k], i, f" {share:.1%}", va="center", fontsize=8)
    ax.set_xlabel("seconds on the critical path")
    ax.set_title(f"step time {result.step_time_s:.4g} s: breakdown")
    fig.tight_layout()
    paths.append(_save(fig, out / "breakdown.png"))
    plt.close(fig)
    # 3. Utilization per unit and per link class.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
    u = result.units
    a1.bar(u.unit, u.utilization, color=[_COLORS.get(x, "#333") for x in u.unit])
    a1.set_ylim(0, 1.05)
    a1.set_title("unit utilization (busy / step)")
    lk = result.links
    if len(lk):
        a2.bar(lk.link_class, lk.utilization, color="#8172B2")
    a2.set_ylim(0, 1.05)
    a2.set_title("ICI/DCN link utilization per link class")
    fig.tight_layout()
    paths.append(_save(fig, out / "utilization.png"))
    plt.close(fig)
    return paths


def _save(fig, path: Path) -> Path:
    return atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
