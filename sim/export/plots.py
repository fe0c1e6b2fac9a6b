"""Matplotlib figures of a simulated step: chip timeline, critical-path breakdown, unit and
link-class utilization. Written as PNG files (Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

from sim.export.output import atomic_write

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
    for r in ops.itertuples(index=False):
        if r.end_s <= r.start_s:
            continue
        y = {"compute": 3 if r.unit == "mxu" else 2, "collective": 1}.get(r.kind, 0)
        ax.broken_barh([(r.start_s, r.end_s - r.start_s)], (y - 0.4, 0.8),
                       facecolors=_COLORS.get(r.bound, "#333333"), linewidth=0)
    ax.set_yticks([0, 1, 2, 3], ["PCIe / idle", "collectives (DMA)", "VPU", "MXU"])
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
    topo = getattr(result, "_topology", None)
    if topo is not None and result.num_chip_classes > 1 and result._link_bytes is not None:
        # Per-chip engine: every link carries what its source chip's class put on it.
        import numpy as np

        total = result.step_time_s
        util = np.divide(result._link_bytes, result._link_cap * total,
                         out=np.zeros(topo.num_links), where=result._link_cap * total > 0)
        paths.append(draw_torus(topo, util, f"{summary.get('model', '')} step on "
                                f"{result.topology} {result.chip}: ICI link utilization per link "
                                f"({result.num_chip_classes} chip classes)",
                                out / "links_on_torus.png"))
        paths.append(draw_chip_map(topo, result.chips.finish_s.to_numpy(),
                                   f"finish time per chip (s); slowest chip "
                                   f"{result.slowest_chip}", out / "chip_finish_times.png"))
    elif topo is not None and len(lk):
        # The step's links table is per link class (the busiest link of each class), so every
        # link is drawn at its class's value; per-link detail is in `tpusim collective --plots`.
        import numpy as np

        per_class = dict(zip(lk.link_class, lk.utilization, strict=True))
        util = np.zeros(topo.num_links)
        ids = np.arange(topo.num_ici_links)
        cls = ids % (2 * topo.ndim)
        for c in range(2 * topo.ndim):
            name = "xyz"[c // 2] + "+-"[c % 2]
            util[ids[cls == c]] = per_class.get(name, 0.0)
        paths.append(draw_torus(topo, util, f"{summary.get('model', '')} step on "
                                f"{result.topology} {result.chip}: ICI link utilization per "
                                f"link class (busiest link of each class)",
                                out / "links_on_torus.png"))
    return paths


def draw_chip_map(topo, values, title: str, path: Path, *, max_slices: int = 4,
                  label: str = "finish time (s)") -> Path:
    """A per-chip value (slice 0) as a heat map on the x-y grid, one panel per z slice."""
    plt = _fig()
    import numpy as np

    shape = topo.shape + (1,) * (3 - topo.ndim)
    nz = shape[2]
    zs = list(range(nz)) if nz <= max_slices else [round(i * (nz - 1) / (max_slices - 1))
                                                   for i in range(max_slices)]
    vals = np.asarray(values, dtype=float)[: topo.chips_per_slice]
    coords = topo.all_coords()
    pad = np.zeros((len(coords), 3), dtype=int)
    pad[:, : topo.ndim] = coords
    lo, hi = (float(vals.min()), float(vals.max())) if len(vals) else (0.0, 0.0)
    fig, axes = plt.subplots(1, len(zs), figsize=(4.2 * len(zs) + 0.8, 4.2), squeeze=False)
    im = None
    for ax, z in zip(axes[0], zs, strict=True):
        grid = np.full((shape[1], shape[0]), np.nan)
        sel = pad[:, 2] == z
        grid[pad[sel, 1], pad[sel, 0]] = vals[sel]
        im = ax.imshow(grid, origin="lower", cmap="magma", vmin=lo, vmax=hi if hi > lo else
                       lo + 1e-12)
        ax.set_title(f"z = {z}" if nz > 1 else topo.name)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
    fig.colorbar(im, ax=axes[0].tolist(), label=label)
    fig.suptitle(title, fontsize=9)
    path = _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path: Path) -> Path:
    return atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))


def draw_torus(topo, util, title: str, path: Path, *, max_slices: int = 4) -> Path:
    """Each ICI link of slice 0 as a short segment coloured by its utilization; + and -
    directions side by side, wraparound links as dotted stubs; one panel per z slice."""
    plt = _fig()
    import numpy as np
    from matplotlib import cm
    from matplotlib.colors import Normalize

    shape = topo.shape + (1,) * (3 - topo.ndim)
    nz = shape[2]
    zs = list(range(nz)) if nz <= max_slices else [round(i * (nz - 1) / (max_slices - 1))
                                                   for i in range(max_slices)]
    src, dst = topo.link_endpoints()
    norm = Normalize(0, max(float(util[: topo.num_ici_links].max(initial=0)), 1e-12))
    cmap = cm.viridis
    fig, axes = plt.subplots(1, len(zs), figsize=(4.2 * len(zs) + 0.8, 4.2), squeeze=False)
    ndim = topo.ndim
    coords = topo.all_coords()
    for ax, z in zip(axes[0], zs, strict=True):
        for link in np.flatnonzero(src[: topo.num_ici_links] >= 0):
            s_chip, d_chip = int(src[link]), int(dst[link])
            if s_chip >= topo.chips_per_slice:
                continue  # draw slice 0 only
            cs = list(coords[s_chip]) + [0] * (3 - ndim)
            cd = list(coords[d_chip]) + [0] * (3 - ndim)
            if cs[2] != z or cd[2] != z:
                continue  # z links are not drawn in a z slice
            axis = (link % (2 * ndim)) // 2
            d = link % 2
            off = 0.12 if d == 0 else -0.12
            x0, y0, x1, y1 = cs[0], cs[1], cd[0], cd[1]
            wrap = abs(x1 - x0) > 1 or abs(y1 - y0) > 1
            if wrap:  # wraparound link: a short stub out of the grid edge
                x1 = x0 + (0.45 if (axis == 0 and d == 0) else -0.45 if axis == 0 else 0)
                y1 = y0 + (0.45 if (axis == 1 and d == 0) else -0.45 if axis == 1 else 0)
            dx, dy = (0, off) if axis == 0 else (off, 0)
            ax.plot([x0 + dx, x1 + dx], [y0 + dy, y1 + dy], color=cmap(norm(util[link])),
                    linewidth=2.2, linestyle=":" if wrap else "-")
        ax.scatter(coords[:, 0], coords[:, 1] if ndim > 1 else np.zeros(len(coords)), s=6,
                   color="black")
        ax.set_title(f"z = {z}" if nz > 1 else topo.name)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.set_aspect("equal")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[0].tolist(),
                 label="link utilization")
    fig.suptitle(title, fontsize=9)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_collective(res, out_dir: str | Path, *, max_slices: int = 4) -> list[Path]:
    """Link utilization of a collective drawn on the torus (one panel per z slice in 3D), and
    the per-step timeline of its streams."""
    plt = _fig()
    import numpy as np

    out = Path(out_dir)
    denom = res._link_cap * res.time_s
    # A dead link has no capacity (and carries nothing): drawn as idle.
    util = np.divide(res._link_bytes, denom, out=np.zeros_like(res._link_bytes, dtype=float),
                     where=denom > 0)
    title = (f"{res.op} over {','.join(res.axes)} ({res.algorithm}) on {res.topology} "
             f"{res.chip}: {res.time_s * 1e6:.1f} us")
    paths = [draw_torus(res._topology, util, title, out / "links_on_torus.png",
                        max_slices=max_slices)]
    tl = res.timeline
    fig, ax = plt.subplots(figsize=(10, 2.5 + 0.2 * tl.stream.nunique()))
    for r in tl.itertuples(index=False):
        ax.broken_barh([(r.start_s * 1e6, (r.end_s - r.start_s) * 1e6)],
                       (r.stream - 0.4, 0.8), facecolors="#8172B2", edgecolor="white")
    ax.set_xlabel("time (us)")
    ax.set_ylabel("stream")
    ax.set_title("collective steps per stream")
    fig.tight_layout()
    paths.append(_save(fig, out / "collective_timeline.png"))
    plt.close(fig)
    return paths
