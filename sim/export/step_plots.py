"""The figures of a training or inference step (`plot_step`: train, replay/export, decode,
prefill, demo): `timeline.png` (chip 0's ops on one lane per unit, coloured by the unit that
bounds them, under a lane of forward / backward / optimizer phases), `breakdown.png` (the
critical path in words), `utilization.png` (per unit and per link class), `links_on_torus.png`
and, on the per-chip engine with more than one chip class, the maps of what differs between
chips (`sim/export/torus_plots.py`): `chip_compute.png` (MXU and VPU busy),
`chip_collective_wait.png` (time waiting in collectives for the others) and
`chip_slowdown.png` (each chip's own time against the median chip's), where a straggler has
the extreme colour, and `energy.png` (joules by unit, each chip class's power over the step:
`sim/export/energy_plots.py`) (finish times do not show it: the step's last collective makes them
equal). A step simulated per link class spreads each class over its links by their share of
the step's collectives' bytes (`step_link_shares`): alike on whole wrapped axes, different on
a line or a factor of an axis. Built as `sim/export/plots.py` says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from sim.chips import get_chip
from sim.collectives.simulate import simulate_collective
from sim.engine.result import LINK_CLASS_COLUMNS, OP_COLUMNS, UNIT_COLUMNS, breakdown_label
from sim.export.energy_plots import energy_figures
from sim.export.plots import (
    BOUND_WORDS,
    COLORS,
    OTHER_PHASE_COLORS,
    PHASE_COLORS,
    PHASE_WORDS,
    UNIT_WORDS,
    add_legend,
    draw_table,
    legend_height,
    new_figure,
    save,
    step_caption,
    styled,
    time_label,
    time_unit,
    wrap_text,
)
from sim.export.torus_plots import chip_maps, torus_figure
from topologies.errors import TpusimError


def plot_step(result, summary: dict, out_dir: str | Path, *, energy=None) -> list[Path]:
    """Write the step's PNGs (timeline, breakdown, utilization, links on the torus, the
    per-chip maps on the per-chip engine, and `energy.png` given the step's `Energy`); returns
    their paths."""
    out = Path(out_dir)
    return [save(fig, out / name)
            for name, fig in step_figures(result, summary, energy=energy).items()]


@styled
def step_figures(result, summary: dict, *, energy=None) -> dict[str, Any]:
    """The step's figures by file name (`energy.png` with the step's `sim.energy.Energy`)."""
    caption = step_caption(result, summary)
    figs = {"timeline.png": _timeline(result, caption),
            "breakdown.png": _breakdown(result, caption),
            "utilization.png": _utilization(result, caption),
            **energy_figures(energy, summary, caption)}
    topo = getattr(result, "pod", None)
    # The step is simulated per link class (per chip class on the per-chip engine): when every
    # link of a class is alike, that is why.
    because = "the step is simulated per link class, so every link of a class is alike"
    if topo is not None and result.link_bytes is not None:
        # Per-chip engine: every link carries what its source chip's class put on it, at its own
        # capacity (a slow or dead link differs from its class).
        denom = result.link_capacity * result.step_time_s
        util = np.divide(result.link_bytes, denom, out=np.zeros(topo.num_links),
                         where=denom > 0)
        k = result.num_chip_classes
        what = f"ICI link utilization over the step ({k} chip class{'es' if k > 1 else ''})"
        if k < result.num_chips:
            # A class's chips are alike, so each link carries its class's busiest link's
            # bytes: scaled by the link's share of its collectives' bytes (a line's end links
            # carry less; `step_link_shares`).
            share, exact = step_link_shares(result)
            util[: topo.num_ici_links] *= share
            what += ("; each link: its chip class's link times its share of its collectives' "
                     "bytes" + ("" if exact else _SPREAD_NOTE))
        figs["links_on_torus.png"] = torus_figure(
            topo, util, capacity=result.link_capacity, caption=caption, alike_because=because,
            what=what)
    if topo is not None and result.classes is not None and result.num_chip_classes > 1:
        figs.update(chip_maps(result, caption))
    if topo is not None and result.link_bytes is None and len(result.link_class_rows):
        # The representative replay simulates one link per class (the busiest); each link is
        # drawn at its share of that (`step_link_utilization`): alike on a whole wrapped axis,
        # not on a line or a factor of an axis.
        from sim.engine.result import LINK_CLASS_COLUMNS

        lk = draw_table(result.link_class_rows, LINK_CLASS_COLUMNS, ("link_class", "utilization"))
        class_util = dict(zip(lk["link_class"].tolist(), lk["utilization"].tolist(),
                              strict=True))
        n, nl = topo.num_ici_links, 2 * topo.ndim
        share, exact = step_link_shares(result)
        util = np.zeros(topo.num_links)
        cls = np.arange(n) % nl
        for c in range(nl):
            util[:n][cls == c] = class_util.get("xyz"[c // 2] + "+-"[c % 2], 0.0)
        util[:n] *= share
        if topo.num_slices > 1:
            nc = topo.num_chips
            util[n: n + nc] = class_util.get("dcn-out", 0.0)
            util[n + nc:] = class_util.get("dcn-in", 0.0)
        what = ("ICI link utilization over the step (each link: its class's busiest-link "
                "utilization times its share of its collectives' bytes)")
        figs["links_on_torus.png"] = torus_figure(
            topo, util, caption=caption, alike_because=because,
            what=what + ("" if exact else _SPREAD_NOTE))
    return figs


_SPREAD_NOTE = "; collectives the per-link routing cannot place are spread evenly over a class"


def step_link_shares(result) -> tuple[np.ndarray, bool]:
    """Per ICI link id, its share of the busiest link of its class (axis and direction) in a
    step simulated per link class (the representative replay, the class engine).

    Such a step carries the busiest link of each class; a link of a class carries its
    collectives' share of that: each distinct collective of the step (kind, group axes,
    algorithm) is routed once link by link (`simulate_collective`, at a nominal size: link
    bytes scale with V and do not depend on the chip's speeds, so any preset serves), and a
    link's share is the bytes-weighted mean, over the collectives loading its class, of its
    bytes over the class's busiest link's. On a whole wrapped axis every link of a class is
    alike (share 1); on a line, or a factor of an axis, the links differ. Returns the shares
    and whether every collective could be routed (one that cannot, such as a permute over
    several axes, is spread evenly over its class: share 1)."""

    topo = result.pod
    n, nl = topo.num_ici_links, 2 * topo.ndim
    names = ["xyz"[c // 2] + "+-"[c % 2] for c in range(nl)]
    src, _ = topo.link_endpoints()
    exists = src[:n] >= 0
    cls = np.arange(n) % nl
    labels = result.collectives
    kind_col, id_col = OP_COLUMNS.index("collective"), OP_COLUMNS.index("op_id")
    kinds = {r[id_col]: r[kind_col] for r in result.op_rows if r[kind_col]}
    # (kind, group axes, algorithm) -> its bytes per link of each class, summed over its ops.
    groups: dict[tuple, dict[str, float]] = {}
    for op, per_class in labels.link_classes.items():
        key = (kinds.get(op), labels.axes.get(op), labels.algorithms.get(op, "auto"))
        acc = groups.setdefault(key, {})
        for c, b in per_class.items():
            acc[c] = acc.get(c, 0.0) + float(b)
    weight = np.zeros(n)  # sum over collectives of class bytes x share, per link
    total = dict.fromkeys(names, 0.0)  # sum of class bytes, per class
    chip, exact = get_chip("v5e"), True
    for (kind, gaxes, algo), per_class in sorted(groups.items(), key=repr):
        share = None
        if kind and gaxes and not any(g.is_dcn for g in gaxes):
            size = int(np.prod([g.size for g in gaxes]))
            algo = str(algo).removeprefix("auto (").rstrip(")")
            try:
                lb = simulate_collective(chip=chip, topology=topo, op=kind, axes=gaxes,
                                         nbytes=size * size * 1024,
                                         algorithm=algo).link_bytes[:n]
                share = np.zeros(n)
                for c in range(nl):
                    sel = exists & (cls == c)
                    top = lb[sel].max(initial=0.0)
                    if top > 0:
                        share[sel] = lb[sel] / top
            except TpusimError:
                share = None
        if share is None:
            exact = False
            share = exists.astype(float)  # spread evenly over the class
        for c, b in per_class.items():
            if c in total:
                sel = cls == names.index(c)
                weight[sel] += b * share[sel]
                total[c] += b
    share = np.ones(n)
    for c in range(nl):
        sel = exists & (cls == c)
        if total[names[c]] > 0:
            share[sel] = weight[sel] / total[names[c]]
    return share, exact


def _phase_word(p: Any) -> str:
    return PHASE_WORDS.get(p, str(p))


def _phase_spans(ops: dict[str, np.ndarray]) -> list[tuple[str, float, float]]:
    """Consecutive runs of one phase among the chip's compute ops (all ops if it has none), in
    time order: (phase, start, end)."""
    live = ops["end_s"] > ops["start_s"]
    sel = live & (ops["kind"] == "compute")
    if not sel.any():
        sel = live
    idx = np.flatnonzero(sel)
    idx = idx[np.lexsort((ops["end_s"][idx], ops["start_s"][idx]))]
    spans: list[list] = []
    for phase, s, e in zip(ops["phase"][idx].tolist(), ops["start_s"][idx].tolist(),
                           ops["end_s"][idx].tolist(), strict=True):
        if spans and spans[-1][0] == phase:
            spans[-1][2] = max(spans[-1][2], e)
        else:
            spans.append([phase, s, e])
    # Collectives and host transfers belong to their phase too: a trailing gradient all-reduce
    # (over DCN, say) extends the backward band up to the next phase instead of leaving a gap,
    # and the first weight gather opens the first band at its start.
    others = np.flatnonzero(live & ~sel)
    for k, span in enumerate(spans):
        nxt = spans[k + 1][1] if k + 1 < len(spans) else math.inf
        prev = spans[k - 1][2] if k else -math.inf
        same = others[(ops["phase"][others] == span[0]) & (ops["start_s"][others] < nxt)
                      & (ops["end_s"][others] > prev)]
        if same.size:
            span[1] = max(min(span[1], float(ops["start_s"][same].min())), prev)
            span[2] = min(max(span[2], float(ops["end_s"][same].max())), nxt)
    return [(p, s, e) for p, s, e in spans]


def _timeline(result, caption: str):
    from matplotlib.patches import Patch

    ops = draw_table(result.op_rows, OP_COLUMNS,
                 ("kind", "unit", "bound", "phase", "start_s", "end_s"))
    step = max(result.step_time_s, 1e-12)
    scale, unit = time_unit(step)
    lanes = ["PCIe / host / idle", "collectives (ICI/DCN)", "VPU", "MXU", "phase"]
    start = ops["start_s"].astype(float)
    end = ops["end_s"].astype(float)
    kind = ops["kind"]
    live = end > start
    lane = np.where(kind == "collective", 1, 0)
    lane = np.where(kind == "compute", np.where(ops["unit"] == "mxu", 3, 2), lane)
    bound = ops["bound"]
    present = [b for b in COLORS if ((bound == b) & live).any()]
    present += sorted(set(bound[live].tolist()) - set(present))
    spans = _phase_spans(ops)
    phases = list(dict.fromkeys(p for p, _s, _e in spans))
    pcolor = {p: PHASE_COLORS.get(p, OTHER_PHASE_COLORS[i % len(OTHER_PHASE_COLORS)])
              for i, p in enumerate(phases)}
    handles = [Patch(color=COLORS.get(b, "#333333"),
                     label=BOUND_WORDS.get(b, f"{UNIT_WORDS.get(b, b)}-bound"))
               for b in present]
    handles += [Patch(color=pcolor[p], label=_phase_word(p)) for p in phases]
    width, ncol = 12.0, 8
    title = wrap_text(width, f"chip 0 timeline of one step ({time_label(result.step_time_s)}): "
                         f"ops per unit, coloured by the unit that bounds them; phases on top",
                  caption)
    leg = legend_height(len(handles), ncol)
    fig = new_figure(width, 3.0, title, left=1.75, bottom=0.5 + leg)
    ax = fig.add_subplot()
    # One collection per lane and colour: thousands of ops, a few dozen artists.
    for y in range(4):
        for b in present:
            sel = live & (lane == y) & (bound == b)
            if sel.any():
                ax.broken_barh(np.column_stack([start[sel] * scale, (end - start)[sel] * scale]),
                               (y - 0.4, 0.8), facecolors=COLORS.get(b, "#333333"),
                               linewidth=0)
    # Phase lane: forward / backward / optimizer bands, labelled where they are wide enough.
    for p in phases:
        ax.broken_barh([(s * scale, (e - s) * scale) for q, s, e in spans if q == p],
                       (3.6, 0.8), facecolors=pcolor[p], edgecolor="white", linewidth=0.5)
    labelled = set()
    for p, s, e in spans:
        word = _phase_word(p)
        if (e - s) / step > 0.0085 * len(word):
            ax.text((s + e) / 2 * scale, 4.0, word, ha="center", va="center", fontsize=8)
            labelled.add(p)
    for p in phases:  # a phase too narrow to hold its name: named beside its widest band
        if p in labelled:
            continue
        _q, s, e = max((x for x in spans if x[0] == p), key=lambda x: x[2] - x[1])
        if (s + e) / 2 > step / 2:
            ax.text(s * scale, 4.0, f"{_phase_word(p)} \u2192 ", ha="right", va="center",
                    fontsize=7)
        else:
            ax.text(e * scale, 4.0, f" \u2190 {_phase_word(p)}", ha="left", va="center",
                    fontsize=7)
    if 1 < len(spans) <= 16:  # phase boundaries across the lanes
        ax.vlines([s * scale for _p, s, _e in spans[1:]], -0.5, 3.5, colors="#999999",
                  linewidth=0.7, linestyles="--")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, 4.6)
    ax.set_xlim(0, step * scale)
    ax.set_xlabel(f"time ({unit})")
    add_legend(fig, handles, ncol)
    return fig


def _breakdown(result, caption: str):
    bd = result.breakdown
    keys = list(bd)
    labels = [breakdown_label(k) for k in keys]
    vals = [float(bd[k]) for k in keys]
    step = result.step_time_s
    width = 8.0
    title = wrap_text(width, f"where the step time ({time_label(step)}) goes: the critical path",
                  caption)
    fig = new_figure(width, 0.4 + 0.36 * len(keys), title, left=1.8)
    ax = fig.add_subplot()
    ys = list(range(len(keys)))[::-1]  # first key on top
    palette = ["#4C72B0", "#55A868", "#C44E52", "#8172B2", "#999999"]
    ax.barh(ys, vals, color=[palette[i % len(palette)] for i in range(len(keys))])
    ax.set_yticks(ys, labels)
    top = max(vals, default=0.0) or 1.0
    for y, v in zip(ys, vals, strict=True):
        share = v / step if step else 0.0
        ax.text(v + 0.01 * top, y, f"{time_label(v)} ({share:.1%})", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("time on the critical path (s)")
    return fig


def _utilization(result, caption: str):
    width = 10.0
    title = wrap_text(width, "utilization over the step", caption)
    fig = new_figure(width, 2.6, title, left=0.75, axes_titles=True, wspace=0.25)
    a1, a2 = fig.subplots(1, 2)

    u = draw_table(result.unit_rows, UNIT_COLUMNS, ("unit", "utilization"))
    units = u["unit"].tolist()
    a1.bar([UNIT_WORDS.get(x, x) for x in units], u["utilization"],
           color=[COLORS.get(x, "#333") for x in units])
    for i, v in enumerate(u["utilization"].tolist()):
        a1.text(i, v + 0.02, f"{v:.0%}", ha="center", fontsize=8)
    a1.set_ylim(0, 1.12)
    a1.set_ylabel("busy time / step time")
    a1.set_title("chip 0's units")
    lk = draw_table(result.link_class_rows, LINK_CLASS_COLUMNS, ("link_class", "utilization"))
    if len(result.link_class_rows):
        names = [c.replace("dcn-out", "DCN out").replace("dcn-in", "DCN in")
                 for c in lk["link_class"].tolist()]
        a2.bar(names, lk["utilization"], color="#8172B2")
        for i, v in enumerate(lk["utilization"].tolist()):
            a2.text(i, v + 0.02, f"{v:.0%}", ha="center", fontsize=8)
    else:
        a2.text(0.5, 0.5, "no links (one chip)", ha="center", va="center",
                transform=a2.transAxes)
    a2.set_ylim(0, 1.12)
    a2.set_title("links, per class (the busiest link of each class)")
    return fig


