"""Links on the torus and maps of the chips (`links_on_torus.png`, `chip_*.png`).

The torus plot draws every link (z links as diagonal stubs in a panel per z slice, wraparound
links as dashed stubs at the border, dead links crossed out, slow links marked) only when links
of a class differ; when every link of each class is alike it says so and draws the link classes
once, around one chip. The chip maps colour each chip by what differs between chips on the
per-chip engine (compute, collective wait, slowdown against the median chip). Built as
`sim/export/plots.py` says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from sim.export.plots import (
    DPI,
    MAX_PANELS,
    add_footnote,
    add_legend,
    legend_height,
    new_figure,
    save,
    styled,
    time_label,
    time_unit,
    wrap_text,
)


def _panels(topo, per_chip_values, max_panels: int) -> tuple[list[tuple[int, int]], str]:
    """(slice, z) panels to draw: every z of slice 0 and of every slice whose values differ
    from slice 0's; at most `max_panels` (evenly sampled). Returns the panels and a note on
    what is not drawn."""

    nz = topo.shape[2] if topo.ndim == 3 else 1
    per = topo.chips_per_slice
    slices = [0]
    alike = []
    for s in range(1, topo.num_slices):
        if np.array_equal(per_chip_values[s * per:(s + 1) * per], per_chip_values[:per]):
            alike.append(s)
        else:
            slices.append(s)
    panels = [(s, z) for s in slices for z in range(nz)]
    notes = []
    if alike:
        notes.append(f"slice(s) {_ranges(alike)} are like slice 0: not drawn")
    if len(panels) > max_panels:
        keep = sorted({round(i * (len(panels) - 1) / (max_panels - 1))
                       for i in range(max_panels)})
        notes.append(f"{len(panels) - len(keep)} of {len(panels)} z slices not drawn")
        panels = [panels[i] for i in keep]
    return panels, "; ".join(notes)


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _grid(n: int, panel_w: float, panel_h: float, max_w: float = 16.0,
          max_h: float = 20.0) -> tuple[int, int, float, float]:
    """Columns, rows and panel size (inches) for n panels: the arrangement that keeps panels
    largest within a max_w x max_h figure, shrinking them (not below 1.6 inches) when a pod
    has many z slices."""
    best = (1, n, 0.0)
    for cols in range(1, n + 1):
        rows = math.ceil(n / cols)
        scale = min(1.0, max_w / (cols * panel_w), max_h / (rows * panel_h))
        if scale >= best[2] - 1e-9:  # ties: the wider arrangement
            best = (cols, rows, scale)
    cols, rows, scale = best
    return cols, rows, max(panel_w * scale, 1.6), max(panel_h * scale, 1.6)


def _panel_axes(ax, topo, nx: int, ny: int, ndim: int, z: int, s: int, *,
                left: bool = True, bottom: bool = True) -> None:
    """Integer chip ticks, axis names and the panel's title (its z slice, or the pod's name, and
    its slice on a multi-slice pod) of one torus or chip-map panel. On a grid of panels only
    the left column has y ticks and the bottom panel of each column x ticks (`left`,
    `bottom`: the panels are alike, so those name every row and column; ticks and their text
    are most of a panel's cost on a pod of 28 z slices)."""
    if bottom:
        _ticks(ax, nx, "x")
        ax.set_xlabel("x")
    else:
        ax.set_xticks([])
    if ndim > 1 and left:
        _ticks(ax, ny, "y")
        ax.set_ylabel("y")
    else:
        ax.set_yticks([])
    title = f"z = {z}" if ndim == 3 else topo.name
    ax.set_title(title + (f", slice {s}" if topo.num_slices > 1 else ""))


def _ticks(ax, n: int, axis: str) -> None:
    step = max(1, math.ceil(n / 8))
    ticks = list(range(0, n, step))
    (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, [str(t) for t in ticks])


def links_alike(topo, util, capacity=None, rel_tol: float = 1e-9) -> bool:
    """True when every existing ICI link of each class (axis and direction) has the same value
    and none is dead or slower than its class (then drawing each link shows nothing more)."""

    n = topo.num_ici_links
    src, _ = topo.link_endpoints()
    exists = src[:n] >= 0
    cls = np.arange(n) % (2 * topo.ndim)
    u = np.asarray(util[:n], dtype=float)
    for c in range(2 * topo.ndim):
        sel = exists & (cls == c)
        if not sel.any():
            continue
        v = u[sel]
        if v.max() - v.min() > rel_tol * max(abs(v.max()), 1e-300):
            return False
        if capacity is not None:
            cap = np.asarray(capacity[:n], dtype=float)[sel]
            if cap.max() - cap.min() > rel_tol * cap.max():
                return False
    return True


def plot_torus(topo, util, path: Path, **kw) -> Path:
    """Write `torus_figure(topo, util, **kw)` to path."""
    return save(torus_figure(topo, util, **kw), path)


def draw_torus(topo, util, title: str, path: Path, *, capacity=None,
               caption: str | None = None) -> Path:
    """Link utilization (per link id) on the torus, written to `path`; `title` heads the plot,
    `caption` (default: the pod) goes under it. Pass `capacity` to mark dead and slow links."""
    return plot_torus(topo, util, Path(path), what=title, capacity=capacity,
                      caption=caption or f"{topo.name} ({topo.num_chips} chips)")


def draw_chip_map(topo, values, title: str, path: Path, *, label: str = "value",
                  caption: str | None = None) -> Path:
    """A per-chip value as a heat map (one panel per z slice), written to `path`."""
    return save(chip_map_figure(topo, values, what=title, label=label,
                                caption=caption or f"{topo.name} ({topo.num_chips} chips)"),
                Path(path))


@styled
def torus_figure(topo, util, *, caption: str, what: str, capacity=None, per_class: bool = False,
                 alike_because: str | None = None, max_panels: int = MAX_PANELS):
    """ICI link utilization: per link when links of a class differ (or a link is dead or slow),
    otherwise once per link class with a note that every link of a class is alike. `util` is
    per link id (ICI ids, then DCN egress and ingress); `per_class=True` says the values are
    per class by construction (the representative replay); `alike_because` is the note's
    reason when links are drawn per class."""

    util = np.asarray(util, dtype=float)
    if per_class or links_alike(topo, util, capacity):
        return _torus_per_class(topo, util, caption=caption, what=what,
                                because=alike_because or "every link of a class is alike")
    return _torus_per_link(topo, util, caption=caption, what=what, capacity=capacity,
                           max_panels=max_panels)


def _norm_cmap(util_ici):
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    top = float(np.max(util_ici, initial=0.0)) if len(util_ici) else 0.0
    return Normalize(0, top if top > 0 else 1.0), colormaps["viridis"]


def _dcn_words(topo, util) -> str:
    if topo.num_slices == 1:
        return ""
    n, nc = topo.num_ici_links, topo.num_chips
    return (f"DCN links (not drawn): busiest egress {util[n:n + nc].max(initial=0):.0%}, "
            f"ingress {util[n + nc:].max(initial=0):.0%}")


def _wrap_words(topo) -> str:
    names = "xyz"[: topo.ndim]
    wrapped = [a for a, w, s in zip(names, topo.wraparound, topo.shape, strict=True)
               if w and s > 1]
    if topo.twisted:  # the stubs are drawn at the border; say where the short axes land
        short = [a for i, a in enumerate(names) if topo.twist_of(i)]
        longs = [names[j] for j, _ in topo.twist_of(names.index(short[0]))]
        return (f"twisted: the {','.join(short)} wraparound lands {min(topo.shape)} along "
                f"{','.join(longs)}")
    return f"wraparound on {','.join(wrapped)}" if wrapped else "no wraparound"


def _torus_per_class(topo, util, *, caption: str, what: str, because: str):
    """One chip and its link classes (and DCN ports on a multi-slice pod), each an arrow
    coloured and labelled with its utilization."""
    from matplotlib.cm import ScalarMappable

    n, nc = topo.num_ici_links, topo.num_chips
    src, _ = topo.link_endpoints()
    exists = src[:n] >= 0
    cls = np.arange(n) % (2 * topo.ndim)
    ocs = np.asarray(topo.ocs_link_mask()[:n], dtype=bool) & exists
    # (name, value, count, wraps-or-note, direction of the arrow, arrow points out of the chip)
    arrows = []
    for c in range(2 * topo.ndim):
        a, d = divmod(c, 2)
        sel = exists & (cls == c)
        sign = 1 if d == 0 else -1
        vx, vy = ((1.0, 0.0), (0.0, 1.0), (0.72, 0.72))[a]
        wraps = "wraps" if topo.wraparound[a] and topo.shape[a] > 1 else "no wraparound"
        k_ocs = int((sel & ocs).sum())
        if k_ocs:  # the class's links between cubes, through the optical switches
            wraps += f", {k_ocs} through optical switches"
        arrows.append(("xyz"[a] + "+-"[d], float(util[:n][sel].max(initial=0.0)),
                       int(sel.sum()), f"links, {wraps}", (sign * vx, sign * vy), True))
    if topo.num_slices > 1:  # DCN: every chip's port out of and into its slice
        arrows.append(("DCN out", float(util[n:n + nc].max(initial=0.0)), nc,
                       "ports, to other slices", (0.72, -0.72), True))
        arrows.append(("DCN in", float(util[n + nc:].max(initial=0.0)), nc,
                       "ports, from other slices", (-0.72, 0.72), False))
    norm, cmap = _norm_cmap(np.array([v for _n, v, k, *_ in arrows if k]))
    width = 7.5
    note, note_h = add_footnote(width, f"{because}: drawn once per class, around one chip "
                                    f"({topo.name}, {_wrap_words(topo)})")
    fig = new_figure(width, 4.6, wrap_text(width, what, caption), left=0.2, right=0.2,
                  bottom=note_h + 0.1)
    fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=8)
    ax = fig.add_subplot()
    ax.scatter([0], [0], s=500, marker="s", color="black", zorder=3)
    ax.text(0, 0, "chip", color="white", ha="center", va="center", fontsize=7, zorder=4)
    for name, v, count, words, (vx, vy), out in arrows:
        x1, y1 = vx * 1.6, vy * 1.6
        if count == 0:
            ax.plot([0, x1], [0, y1], color="#CCCCCC", linestyle=":", linewidth=1.5)
            ax.text(x1 * 1.1, y1 * 1.1, f"{name}: no link", ha="center", va="center",
                    fontsize=8, color="#888888")
            continue
        tail, head = ((vx * 0.25, vy * 0.25), (x1, y1)) if out else \
            ((x1, y1), (vx * 0.3, vy * 0.3))
        ax.annotate("", head, tail, arrowprops=dict(
            arrowstyle="-|>", color=cmap(norm(v)), linewidth=4, mutation_scale=18,
            linestyle="-" if name[0] in "xyz" else (0, (3, 1.5))))
        # The label sits beyond the arrow's outer end, on its side of the chip.
        ha = "center" if vx == 0 else ("left" if vx > 0 else "right")
        va = "center" if vy == 0 else ("bottom" if vy > 0 else "top")
        ax.text(x1 + 0.08 * np.sign(vx), y1 + 0.08 * np.sign(vy),
                f"{name}  {v:.1%}\n{count} {words}", ha=ha, va=va, fontsize=8)
    ax.set_xlim(-3.2, 3.2)
    ax.set_ylim(-2.3, 2.3)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="link utilization",
                 shrink=0.8)
    return fig


_BIG_LINKS = 8192  # links above which the torus is drawn in `_LEVELS` colours
_LEVELS = 64


def _draw_segments(ax, seg, colors, lw: float, style, big: bool) -> None:
    """Line segments in their colours: a LineCollection of a path per segment, or on a large
    pod of one path per colour, its segments separated by NaNs (a path per link is most of the
    drawing time at 50,000 links)."""
    from matplotlib.collections import LineCollection

    if not len(seg):
        return
    if big:
        keys, inv = np.unique(np.round(colors, 6), axis=0, return_inverse=True)
        inv = inv.ravel()
        paths = []
        for k in range(len(keys)):
            s = seg[inv == k]
            gap = np.full((len(s), 1, 2), np.nan)
            paths.append(np.concatenate([s, gap], axis=1).reshape(-1, 2)[:-1])
        seg, colors = paths, keys
    ax.add_collection(LineCollection(seg, colors=colors, linewidths=lw, linestyles=style))


def _link_legend(topo, *, ocs: bool, dead: bool, slow: bool) -> list:
    """The per-link torus plot's legend handles: what each line style and mark means."""
    from matplotlib.lines import Line2D

    ndim = topo.ndim
    handles = [Line2D([], [], color="#555555", lw=2, label="link (+ above / left of -)")]
    if any(w and k > 1 for w, k in zip(topo.wraparound, topo.shape, strict=True)):
        handles.append(Line2D([], [], color="#555555", lw=2, linestyle=(0, (2, 1.2)),
                              label="wraparound link (dashed stub at the border)"))
    if ndim == 3:
        handles.append(Line2D([], [], color="#555555", lw=2,
                              label="diagonal stub: z link (z+ up-right, z- down-left)"))
    if ocs:
        handles.append(Line2D([], [], color="#333333", marker="d", linestyle="",
                              markersize=5, label="link through an optical switch (between cubes)"))
    if dead:
        handles.append(Line2D([], [], color="#D62728", marker="x", linestyle="",
                              label="dead link (no capacity: idle)"))
    if slow:
        handles.append(Line2D([], [], color="#FF7F0E", marker="o", linestyle="",
                              markerfacecolor="none", markeredgewidth=1.5,
                              label="slow link (less capacity), circled"))
    return handles


def _torus_per_link(topo, util, *, caption: str, what: str, capacity, max_panels: int):
    """Every ICI link as a segment coloured by its utilization, one panel per (slice, z)."""
    from matplotlib.cm import ScalarMappable

    ndim = topo.ndim
    n = topo.num_ici_links
    nl = 2 * ndim
    src, _dst = topo.link_endpoints()
    exists = src[:n] >= 0
    shape3 = tuple(topo.shape) + (1,) * (3 - ndim)
    nx, ny, nz = shape3
    per = topo.chips_per_slice
    coords = np.zeros((per, 3), dtype=int)
    coords[:, :ndim] = topo.all_coords()
    cap = None if capacity is None else np.asarray(capacity[:n], dtype=float)
    dead = np.zeros(n, bool) if cap is None else exists & (cap <= 0)
    slow = np.zeros(n, bool)
    if cap is not None:
        cls = np.arange(n) % nl
        for c in range(nl):
            sel = exists & (cls == c)
            if sel.any():
                slow |= sel & (cap > 0) & (cap < cap[sel].max() * (1 - 1e-9))
    alive = exists & ~dead
    # Links through the optical switches (between 4x4x4 cubes of a v4/v5p slice) are a class of
    # their own: marked at their middle.
    ocs = np.asarray(topo.ocs_link_mask()[:n], dtype=bool) & exists
    norm, cmap = _norm_cmap(util[:n][alive])
    # A large pod's links are drawn in `_LEVELS` colours, one path per colour (a path per link
    # is most of the time at 50,000 links); its colour bar has the same levels.
    big = int(exists.sum()) > _BIG_LINKS
    if big:
        cmap = cmap.resampled(_LEVELS)
    per_chip = util[:n].reshape(-1, nl)  # rows = chips
    panels, omitted = _panels(topo, per_chip, max_panels)
    off, shorten = 0.1, 0.16  # + and - links side by side; ends kept off the chip dots
    pw = min(max(0.6 * nx + 1.0, 3.4), 7.0)
    ph = min(max(0.6 * ny + 1.0, 3.4), 7.0) if ndim > 1 else 1.4
    cols, rows, pw, ph = _grid(len(panels), pw, ph)
    width = max(cols * pw + 1.6, 8.0)
    handles = _link_legend(topo, ocs=ocs.any(), dead=dead.any(), slow=slow.any())
    ncol = 3 if width >= 10 else 2
    notes = [f"links of a class differ: every link drawn ({topo.name}, {_wrap_words(topo)})",
             omitted, _dcn_words(topo, util)]
    title = wrap_text(width, what, caption, "; ".join(x for x in notes if x))
    fig = new_figure(width, rows * ph, title, left=0.6, right=0.8,
                  bottom=0.45 + legend_height(len(handles), ncol), axes_titles=True,
                  wspace=0.3, hspace=0.45)
    axes = fig.subplots(rows, cols, squeeze=False)
    px = min(pw / (nx + 0.5), ph / (ny + 0.5) if ndim > 1 else 1.0) * DPI  # pixels per chip
    lw = min(max(0.09 * px, 0.6), 2.6)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for i, (ax, (s, z)) in enumerate(zip(axes.flat, panels, strict=False)):
        local = np.flatnonzero(coords[:, 2] == z)
        chips = s * per + local
        ids = (chips[:, None] * nl + np.arange(nl)[None, :]).ravel()
        ids = ids[exists[ids]]
        a, d = (ids % nl) // 2, ids % 2
        p0 = coords[src[ids] - s * per].astype(float)
        sk = np.where(d == 0, 1.0, -1.0)
        a_coord = p0[np.arange(len(ids)), a]
        wrap = (a_coord + sk < 0) | (a_coord + sk >= np.array(shape3)[a])
        # x links horizontal, y vertical, z a short diagonal stub (z+ up-right, z- down-left);
        # the + link of a pair runs left of its direction of travel (x+ above x-); a wraparound
        # link is a stub out of the border.
        u = np.column_stack([(a != 1).astype(float), (a != 0).astype(float)])
        o = np.column_stack([np.where(a == 1, -off * sk, 0.0), np.where(a == 0, off * sk, 0.0)])
        s0 = np.where(a == 2, 0.07, shorten)
        ln = np.where(a == 2, 0.23, np.where(wrap, 0.42, 1.0 - 2 * shorten))
        p_start = p0[:, :2] + u * (sk * s0)[:, None] + o
        seg = np.stack([p_start, p_start + u * (sk * ln)[:, None]], axis=1)
        level = np.clip(norm(util[ids]), 0.0, 1.0)
        if big:
            level = np.round(level * (_LEVELS - 1)) / (_LEVELS - 1)
        colors = cmap(level)
        colors[dead[ids]] = (0.75, 0.75, 0.75, 1.0)
        solid = ~wrap
        _draw_segments(ax, seg[solid], colors[solid], lw, "-", big)
        if wrap.any():
            _draw_segments(ax, seg[wrap], colors[wrap], lw, (0, (2, 1.2)), big)
        mid = seg.mean(axis=1)
        if ocs[ids].any():
            m = mid[ocs[ids]]
            ax.scatter(m[:, 0], m[:, 1], marker="d", color="#111111", s=min(max(lw * 12, 8), 30),
                       zorder=4, linewidths=0, gid="ocs")
        if dead[ids].any():
            m = mid[dead[ids]]
            ax.scatter(m[:, 0], m[:, 1], marker="x", color="#D62728", s=40, zorder=4,
                       linewidths=1.5)
        if slow[ids].any():
            m = mid[slow[ids]]
            ax.scatter(m[:, 0], m[:, 1], marker="o", s=160, zorder=4, facecolors="none",
                       edgecolors="#FF7F0E", linewidths=1.5)
        ax.scatter(coords[local, 0], coords[local, 1], s=min(max((0.1 * px) ** 2, 2.0), 30.0),
                   color="black", zorder=3)
        ax.set_xlim(-0.75, nx - 0.25)
        ax.set_ylim(-0.75, ny - 0.25)
        ax.set_aspect("equal")
        _panel_axes(ax, topo, nx, ny, ndim, z, s, left=i % cols == 0,
                    bottom=i + cols >= len(panels))
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes.ravel().tolist(),
                 label="link utilization", shrink=min(0.9, 5.0 / (rows * ph)),
                 fraction=0.3 / width, pad=0.25 / width)
    add_legend(fig, handles, ncol)
    return fig


CHIP_MAPS = ("chip_compute.png", "chip_collective_wait.png", "chip_slowdown.png")


def chip_map_values(result) -> dict[str, np.ndarray]:
    """Per chip (per-chip engine): `compute_s` (MXU and VPU busy), `wait_s` (time waiting in
    collectives for the other members), `own_s` (the finish time less that wait: the chip's
    own work, its collectives' transfers included) and `slowdown` (own time against the median
    chip's, as a fraction: 0.25 is 25% slower)."""
    rows = np.asarray(result.classes.rows, dtype=float)[result.classes.of_chip]
    own = rows[:, 0] - rows[:, 5]
    med = float(np.median(own)) if len(own) else 0.0
    slowdown = own / med - 1.0 if med > 0 else np.zeros_like(own)
    return {"compute_s": rows[:, 1] + rows[:, 2], "wait_s": rows[:, 5], "own_s": own,
            "slowdown": slowdown}


def chip_maps(result, caption: str) -> dict[str, Any]:
    """The per-chip engine's maps of what differs between chips: compute time, time waiting in
    collectives, and slowdown against the median chip. Finish times hide a straggler (the
    step's last collective makes every chip finish together); these do not: the slow chip has
    the most compute and the largest slowdown, and waits least (the others wait for it)."""
    v = chip_map_values(result)
    topo = result.pod
    worst = int(np.argmax(v["slowdown"]))
    where = _chip_words(topo, worst)
    slow = float(v["slowdown"][worst])
    tail = f"; the slowest chip is {where}, {slow:+.1%} against the median" if slow > 1e-9 \
        else ""
    return {
        "chip_compute.png": chip_map_figure(
            topo, v["compute_s"], caption=caption, label="compute (MXU + VPU busy)",
            time_values=True, what="compute time per chip" + tail),
        "chip_collective_wait.png": chip_map_figure(
            topo, v["wait_s"], caption=caption, label="waiting in collectives",
            time_values=True, cmap="magma_r",
            what="time each chip waits in collectives for the others (a straggler waits "
                 "least: the others wait for it)" + tail),
        "chip_slowdown.png": chip_map_figure(
            topo, v["slowdown"], caption=caption, label="slowdown against the median chip",
            percent=True, what="each chip's own time (finish less waiting) against the median "
                               "chip's" + tail),
    }


def _chip_words(topo, chip: int) -> str:
    per = topo.chips_per_slice
    coords = ",".join(map(str, topo.all_coords()[chip % per].tolist()))
    return f"({coords})" + (f" of slice {chip // per}" if topo.num_slices > 1 else "")


@styled
def chip_map_figure(topo, values, *, caption: str, what: str, label: str,
                    time_values: bool = False, percent: bool = False, cmap: str = "magma",
                    max_panels: int = MAX_PANELS):
    """A per-chip value as a heat map on the x-y grid, one panel per (slice, z); times (s) are
    shown in s, ms or us, fractions as percentages (`percent`). The colour bar sits in a right
    margin of its own, so its label is never clipped at any pod size."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    ndim = topo.ndim
    shape3 = tuple(topo.shape) + (1,) * (3 - ndim)
    nx, ny, _nz = shape3
    per = topo.chips_per_slice
    vals = np.asarray(values, dtype=float)
    coords = np.zeros((per, 3), dtype=int)
    coords[:, :ndim] = topo.all_coords()
    panels, omitted = _panels(topo, vals[:, None], max_panels)
    lo, hi = (float(vals.min()), float(vals.max())) if len(vals) else (0.0, 0.0)
    scale, unit = time_unit(max(abs(lo), abs(hi))) if time_values else (1.0, "")
    if percent:
        scale, unit = 100.0, "%"
    if hi - lo <= 1e-9 * max(abs(hi), abs(lo), 1e-300):
        # Alike to rounding: one colour, and the plot says so (no colour bar of noise).
        shown = time_label(hi) if time_values else f"{hi * 100:+.3g}%" if percent else f"{hi:.4g}"
        what = f"{what}; every chip alike: {shown}"
        pad = abs(hi) * 0.01 + 1e-12
        lo, hi = hi - pad, hi + pad
    vals = vals * scale
    lo, hi = lo * scale, hi * scale
    label = f"{label} ({unit})" if unit else label
    norm = Normalize(lo, hi)
    pw = min(max(0.45 * nx + 1.0, 3.0), 6.0)
    ph = min(max(0.45 * ny + 1.0, 3.0), 6.0) if ndim > 1 else 1.4
    cols, rows, pw, ph = _grid(len(panels), pw, ph)
    right = 1.5  # inches for the colour bar, its tick labels and its label
    width = max(cols * pw + 0.6 + right, 7.0)
    fig = new_figure(width, rows * ph, wrap_text(width, what, caption, omitted), left=0.6,
                     right=right, bottom=0.5, axes_titles=True, wspace=0.3, hspace=0.45)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for i, (ax, (s, z)) in enumerate(zip(axes.flat, panels, strict=False)):
        grid = np.full((ny, nx), np.nan)
        sel = np.flatnonzero(coords[:, 2] == z)
        grid[coords[sel, 1], coords[sel, 0]] = vals[s * per + sel]
        ax.imshow(grid, origin="lower", cmap=cmap, norm=norm)
        _panel_axes(ax, topo, nx, ny, ndim, z, s, left=i % cols == 0,
                    bottom=i + cols >= len(panels))
    # The colour bar in the right margin (inches from the figure's right edge), as tall as the
    # panels (at most 5 inches), centred on them.
    W, H = fig.get_figwidth(), fig.get_figheight()
    sp = fig.subplotpars
    body = (sp.top - sp.bottom) * H
    bar_h = min(body, 5.0)
    y0 = sp.bottom * H + (body - bar_h) / 2
    cax = fig.add_axes([1 - (right - 0.25) / W, y0 / H, 0.16 / W, bar_h / H])
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax)
    cb.set_label(label, fontsize=8)
    cb.formatter.set_useOffset(False)
    cb.ax.tick_params(labelsize=8)
    return fig


