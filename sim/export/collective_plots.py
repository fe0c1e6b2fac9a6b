"""The figures of one collective (`plot_collective`, `tpusim collective`): `links_on_torus.png`
(`sim/export/torus_plots.py`), `collective_timeline.png` (the steps of each stream against
time, labelled) and, in full and per-chip mode, `collective_links.png` (the steps per link of
the last group to finish: a dead link's detour shows as the lanes of the links its transfers
are rerouted over). Built as `sim/export/plots.py` says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from sim.collectives.result import TIMELINE_COLUMNS
from sim.export.plots import (
    MAX_PANELS,
    STEP_COLORS,
    add_legend,
    bytes_label,
    collective_caption,
    draw_table,
    legend_height,
    new_figure,
    save,
    styled,
    time_label,
    time_unit,
    wrap_text,
)
from sim.export.torus_plots import torus_figure


def plot_collective(res, out_dir: str | Path, *, max_panels: int = MAX_PANELS) -> list[Path]:
    """Write the collective's link utilization on the torus and its steps per stream."""
    out = Path(out_dir)
    return [save(fig, out / name)
            for name, fig in collective_figures(res, max_panels=max_panels).items()]


@styled
def collective_figures(res, *, max_panels: int = MAX_PANELS) -> dict[str, Any]:
    """The collective's figures by file name."""
    denom = res.link_capacity * res.time_s
    # A dead link has no capacity (and carries nothing): drawn as idle.
    util = np.divide(res.link_bytes, denom, out=np.zeros_like(res.link_bytes, dtype=float),
                     where=denom > 0)
    caption = collective_caption(res)
    over = f" over {','.join(res.axes)}" if res.axes else ""
    what = (f"{res.op} of {bytes_label(res.bytes)}{over} ({res.algorithm}): "
            f"{time_label(res.time_s)}; link utilization")
    figs = {"links_on_torus.png": torus_figure(res.pod, util, capacity=res.link_capacity,
                                               caption=caption, what=what,
                                               max_panels=max_panels),
            "collective_timeline.png": _collective_timeline(res, caption)}
    if res.step_links:
        figs["collective_links.png"] = collective_links_figure(res, caption)
    return figs


MAX_LINK_LANES = 48  # links drawn in the per-link timeline (the busiest; the rest are counted)


def _last_group(res) -> int:
    """The replica group that finishes last (its steps set the collective's time)."""

    if not res.timeline_rows:
        return 0
    g, end = TIMELINE_COLUMNS.index("group"), TIMELINE_COLUMNS.index("end_s")
    return int(max(res.timeline_rows, key=lambda r: (r[end], -r[g]))[g])


@styled
def collective_links_figure(res, caption: str):
    """The collective's steps per link: one lane per link the last replica group to finish
    loads (its busiest `MAX_LINK_LANES`), a bar per step on each link it loads, from the step's
    start to its end, coloured by the link's utilization in that step (its bytes over its
    capacity times the step's duration). Links off the collective's axes carry detours around
    a dead link: their lanes are marked, and a dead link of the group has a lane of its own,
    crossed out. Needs the per-step links of full or per-chip mode (`res.step_links`)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    topo = res.pod
    n, nl = topo.num_ici_links, 2 * topo.ndim
    g = _last_group(res)
    col = {c: TIMELINE_COLUMNS.index(c) for c in ("group", "stream", "step", "start_s",
                                                   "end_s")}
    spans: dict[tuple[int, int], list[float]] = {}
    for r in res.timeline_rows:
        if int(r[col["group"]]) == g:
            key = (int(r[col["stream"]]), int(r[col["step"]]))
            sp = spans.setdefault(key, [math.inf, 0.0])
            sp[0], sp[1] = min(sp[0], r[col["start_s"]]), max(sp[1], r[col["end_s"]])
    steps = {(st, sp): v for (gg, st, sp), v in res.step_links.items() if gg == g}
    per_link: dict[int, float] = {}
    for ids, b in steps.values():
        for link, nb in zip(np.asarray(ids).tolist(), np.asarray(b, dtype=float).tolist(),
                            strict=True):
            per_link[link] = per_link.get(link, 0.0) + nb
    axes_used = {a for a in "".join(res.axes) if a in "xyz"}
    cap = np.asarray(res.link_capacity, dtype=float)
    dead = sorted(i for i in range(n) if cap[i] <= 0 and topo.link_endpoints()[0][i] >= 0
                  and _touches(topo, i, per_link))
    links = sorted(per_link, key=lambda k: -per_link[k])
    hidden = max(len(links) - MAX_LINK_LANES, 0)
    links = sorted(links[:MAX_LINK_LANES]) + dead
    src, dst = topo.link_endpoints()
    per = topo.chips_per_slice
    coord = topo.all_coords()

    def axis_of(link: int) -> str:
        return "dcn" if link >= n else "xyz"[(link % nl) // 2]

    def name(link: int) -> str:
        if link >= n:
            return topo.describe_link(link)
        a = ",".join(map(str, coord[int(src[link]) % per].tolist()))
        return f"({a}) {axis_of(link)}{'+-'[link % 2]}"

    # Detour links: those the rerouted transfers' replacement paths use (recorded by the
    # router), or without that record, links off the collective's axes.
    rerouted = res.detour_links
    detour = [k for k in links if k < n and k not in dead and (
        k in rerouted if rerouted is not None else axis_of(k) not in axes_used)]
    t_end = max([res.time_s] + [sp[1] for sp in spans.values()] + [1e-12])
    scale, unit = time_unit(t_end)
    lanes = {k: i for i, k in enumerate(links)}
    util = []
    bars = []
    for (st, sp), (ids, b) in sorted(steps.items()):
        s0, s1 = spans.get((st, sp), (0.0, 0.0))
        dur = max(s1 - s0, 1e-15)
        for link, nb in zip(np.asarray(ids).tolist(), np.asarray(b, dtype=float).tolist(),
                            strict=True):
            if link in lanes and cap[link] > 0:
                bars.append((lanes[link], s0 * scale, (s1 - s0) * scale))
                util.append(min(nb / (cap[link] * dur), 1.0))
    norm = Normalize(0.0, max(max(util, default=0.0), 1e-12))
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    width = 11.0
    notes = [f"{hidden} less loaded link(s) not drawn" if hidden else "",
             f"{len(detour)} link(s) carry the detours around {len(dead)} dead link(s) "
             f"(lanes marked 'detour', in red)" if detour or dead else ""]
    title = wrap_text(width, f"{res.op} ({res.algorithm}): the links of replica group {g} per step "
                         f"(a bar per step on each link it loads); {time_label(res.time_s)} in "
                         f"all", caption, "; ".join(x for x in notes if x))
    right = 1.4
    fig = new_figure(width, 0.5 + 0.2 * max(len(links), 1), title, left=1.9, right=right,
                  bottom=0.55)
    ax = fig.add_subplot()
    from matplotlib.collections import PolyCollection

    if bars:
        lane = np.array([b[0] for b in bars], dtype=float)
        x0 = np.array([b[1] for b in bars])
        w = np.array([b[2] for b in bars])
        verts = np.stack([np.column_stack([x0, lane - 0.38]), np.column_stack([x0, lane + 0.38]),
                          np.column_stack([x0 + w, lane + 0.38]),
                          np.column_stack([x0 + w, lane - 0.38])], axis=1)
        ax.add_collection(PolyCollection(verts, facecolors=cmap(norm(np.array(util))),
                                         edgecolors="white", linewidths=0.5))
    for k in dead:
        ax.plot([0, t_end * scale], [lanes[k], lanes[k]], color="#D62728", linestyle=":",
                linewidth=1.0)
        ax.scatter([t_end * scale / 2], [lanes[k]], marker="x", color="#D62728", s=40,
                   zorder=4)
    labels = [name(k) + (" (dead)" if k in dead else " detour" if k in detour else "")
              for k in links]
    ax.set_yticks(range(len(links)), labels, fontsize=7 if len(links) > 24 else 8)
    for t, k in zip(ax.get_yticklabels(), links, strict=True):
        if k in dead or k in detour:
            t.set_color("#D62728")
    ax.set_ylim(max(len(links), 1) - 0.4, -0.6)
    ax.set_xlim(0, t_end * scale)
    ax.set_xlabel(f"time ({unit})")
    W, H = fig.get_figwidth(), fig.get_figheight()
    sp = fig.subplotpars
    body = (sp.top - sp.bottom) * H
    bar_h = min(body, 4.0)
    cax = fig.add_axes([1 - (right - 0.25) / W, (sp.bottom * H + (body - bar_h) / 2) / H,
                        0.16 / W, bar_h / H])
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax)
    cb.set_label("link utilization in the step", fontsize=8)
    cb.ax.tick_params(labelsize=8)
    return fig


def _touches(topo, link: int, used: dict[int, float]) -> bool:
    """A dead link next to the group's links (its source chip sends on another link the
    group uses): the one its detours go around."""
    nl = 2 * topo.ndim
    chip = link // nl
    return any(chip * nl <= k < (chip + 1) * nl for k in used)


_STEP_WORDS = {"RS": "reduce-scatter", "AG": "all-gather", "A2A": "all-to-all"}


def step_words(label: str) -> str:
    """A collective step's label in words: "part1 RS x" -> "reduce-scatter over x"."""
    words = label.split()
    if words and words[0].startswith("part") and len(words) > 1:
        words = words[1:]  # the stream is the lane
    if words and words[0] in _STEP_WORDS:
        rest = words[1:]
        over = rest and all(a in ("x", "y", "z", "dcn") for a in rest[0].split(","))
        words = [_STEP_WORDS[words[0]]] + (["over"] if over else []) + rest
    return " ".join(words)


def _collective_timeline(res, caption: str):
    from matplotlib.patches import Patch

    tl = draw_table(res.timeline_rows, TIMELINE_COLUMNS,
                ("group", "chip", "stream", "step", "label", "start_s", "end_s"))
    width = 11.0
    # The group that finishes last sets the time; its first simulated chip stands for it.
    g, groups = 0, 0
    mine = np.zeros(len(res.timeline_rows), dtype=bool)
    if len(res.timeline_rows):
        g = int(tl["group"][int(np.argmax(tl["end_s"]))])
        mine = tl["group"] == g
        mine &= tl["chip"] == tl["chip"][mine].min()
        groups = len(np.unique(tl["group"]))
    rows = {c: v[mine].tolist() for c, v in tl.items()}
    # With --chunks C every step appears once per chunk (in start order): a lane per
    # (stream, chunk) shows the pieces flowing through the steps.
    seen: dict[tuple[int, int], int] = {}
    order = sorted(range(len(rows["step"])), key=lambda i: (rows["start_s"][i], i))
    chunk = [0] * len(order)
    for i in order:
        key = (rows["stream"][i], rows["step"][i])
        chunk[i] = seen.get(key, 0)
        seen[key] = chunk[i] + 1
    chunked = max(chunk, default=0) > 0
    rows["stream"] = [(st, c) for st, c in zip(rows["stream"], chunk, strict=True)]
    if groups > 1:
        who = f"replica group {g}, the last of the {groups} simulated to finish"
    elif res.num_groups > 1:
        who = f"one replica group, standing for all {res.num_groups} (alike)"
    else:
        who = "the one replica group"
    streams = sorted(set(rows["stream"]))
    t_end = max(res.time_s, max(rows["end_s"], default=0.0), 1e-12)
    scale, unit = time_unit(t_end)
    kinds = [step_words(lab) for lab in rows["label"]]
    names = list(dict.fromkeys(kinds))
    color = {k: STEP_COLORS[i % len(STEP_COLORS)] for i, k in enumerate(names)}
    handles = [Patch(color=color[k], label=k) for k in names]
    ncol = 4
    title = wrap_text(width, f"{res.op} ({res.algorithm}): steps per stream of {who}; "
                         f"{time_label(res.time_s)} in all", caption)
    fig = new_figure(width, 0.5 + 0.34 * max(len(streams), 1), title, left=1.4 if chunked else 0.9,
                  bottom=0.5 + legend_height(len(handles), ncol, titled=True))
    ax = fig.add_subplot()
    bars: dict[tuple[tuple[int, int], str], list] = {}
    for stream, kind, s, e in zip(rows["stream"], kinds, rows["start_s"], rows["end_s"],
                                  strict=True):
        bars.setdefault((stream, kind), []).append((s * scale, (e - s) * scale))
    ypos = {st: i for i, st in enumerate(streams)}
    for (stream, kind), xr in sorted(bars.items()):
        ax.broken_barh(xr, (ypos[stream] - 0.38, 0.76), facecolors=color[kind],
                       edgecolor="white", linewidth=0.8)
    # Each step labelled with its number (and what it does, where the bar is wide enough).
    for stream, kind, step, s, e in zip(rows["stream"], kinds, rows["step"], rows["start_s"],
                                        rows["end_s"], strict=True):
        frac = (e - s) / t_end
        text = f"{step}: {kind}" if frac > 0.0075 * (len(kind) + 3) else str(step)
        if frac > 0.0075 * len(text):
            ax.text((s + e) / 2 * scale, ypos[stream], text, ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(len(streams)), [f"stream {s}" + (f", chunk {c}" if chunked else "")
                                        for s, c in streams])
    ax.set_ylim(max(len(streams), 1) - 0.4, -0.6)  # stream 0 on top
    ax.set_xlim(0, t_end * scale)
    ax.set_xlabel(f"time ({unit})")
    if handles:
        add_legend(fig, handles, ncol, title="what each step does (bars: step number: step)",
                title_fontsize=8)
    return fig
