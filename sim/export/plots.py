"""Matplotlib figures of simulated runs, written as PNG files (`--plots DIR`, the demo).

* `plot_step` (train, replay/export, decode, prefill, demo): `timeline.png` (chip 0's ops on one
  lane per unit, coloured by the unit that bounds them, under a lane of forward / backward /
  optimizer phases), `breakdown.png` (the critical path in words), `utilization.png` (per unit
  and per link class), `links_on_torus.png` and, on the per-chip engine with more than one chip
  class, the maps of what differs between chips: `chip_compute.png` (MXU and VPU busy),
  `chip_collective_wait.png` (time waiting in collectives for the others) and
  `chip_slowdown.png` (each chip's own time against the median chip's), where a straggler has
  the extreme colour (finish times do not show it: the step's last collective makes them
  equal).
* `plot_collective` (`tpusim collective`): `links_on_torus.png`, `collective_timeline.png`
  (the steps of each stream against time, labelled) and, in full and per-chip mode,
  `collective_links.png` (the steps per link of the last group to finish: a dead link's
  detour shows as the lanes of the links its transfers are rerouted over).

The torus plot draws every link (z links as diagonal stubs in a panel per z slice, wraparound
links as dashed stubs at the border, dead links crossed out, slow links marked) only when links
of a class differ; when every link of each class is alike it says so and draws the link classes
once, around one chip. A step simulated per link class spreads each class over its links by
their share of the step's collectives' bytes (`step_link_shares`): alike on whole wrapped
axes, different on a line or a factor of an axis. Every figure names the model, the pod and the
mesh; colour bars sit in a right margin of their own, so their labels are never clipped.

Figures are `matplotlib.figure.Figure` objects on the Agg canvas, without pyplot: no global
backend switch (a notebook keeps its own), and no figure manager to tear down. They are drawn
with one collection per colour or line style instead of one artist per op or link (a 70B step
has thousands of ops, a pod thousands of links), under a fixed font and without the PNG
`Software` stamp, so identical inputs give byte-identical files. `*_figures` build the figures
(tests inspect their artists); `plot_*` write them.
"""

from __future__ import annotations

import functools
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from sim.engine import breakdown_label
from sim.export.output import atomic_write
from topologies.errors import TpusimError

DPI = 100
# Bound units (op colours) and the words for them.
_COLORS = {"mxu": "#4C72B0", "vpu": "#55A868", "hbm": "#C44E52", "ici": "#8172B2",
           "dcn": "#64B5CD", "pcie": "#CCB974", "idle": "#999999"}
UNIT_WORDS = {"mxu": "MXU", "vpu": "VPU", "hbm": "HBM", "ici": "ICI", "dcn": "DCN",
              "pcie": "PCIe", "idle": "idle"}
_BOUND_WORDS = {"idle": "idle (waiting)"}
PHASE_WORDS = {"fwd": "forward", "bwd": "backward", "loss": "loss", "optimizer": "optimizer",
               "": "no phase recorded"}
_PHASE_COLORS = {"fwd": "#9ECAE1", "bwd": "#FDAE6B", "loss": "#D9D9D9", "optimizer": "#A1D99B"}
_OTHER_PHASE_COLORS = ("#DADAEB", "#FDD0A2", "#C7E9C0", "#FCBBA1", "#D9D9D9")
_STEP_COLORS = ("#8172B2", "#4C72B0", "#55A868", "#C44E52", "#CCB974", "#64B5CD", "#8C8C8C")
# Fixed style: text in the font matplotlib ships (never a system font that differs between
# machines), so the same inputs give the same bytes.
_RC = {"font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 9,
       "figure.titlesize": 10, "path.simplify": True}
_SAVE_META = {"Software": None}
MAX_PANELS = 32  # z slices (x slices) drawn per link; more are sampled, and the plot says so


def _fig():
    """pyplot on the Agg backend (kept for the study and plan plots, which use pyplot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styled(fn):
    """Run a figure builder under the fixed style (fonts are resolved when artists are made)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(_RC):
            return fn(*args, **kwargs)

    return wrapper


def _wrap(width_in: float, *lines: str, size: float = _RC["figure.titlesize"]) -> str:
    """Lines of text wrapped to the figure's width (a title that fits)."""
    chars = max(int(width_in * 72 / (0.6 * size)), 30)
    return "\n".join(textwrap.fill(s, chars) for s in lines if s)


def _figure(width_in: float, body_in: float, title: str, *, left: float = 0.9,
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


def _legend(fig, handles, ncol: int, y_in: float = 0.0, **kw) -> None:
    """A legend under the axes (never on the lanes), in the figure's bottom margin."""
    y = y_in / fig.get_figheight()
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, y), ncol=ncol,
               fontsize=8, frameon=False, **kw)


def _legend_height(n: int, ncol: int, titled: bool = False) -> float:
    return 0.1 + 0.2 * math.ceil(n / max(ncol, 1)) + (0.2 if titled else 0.0)


def _footnote(width_in: float, text: str) -> tuple[str, float]:
    """A note for the bottom of a figure, wrapped; and the inches it takes."""
    if not text:
        return "", 0.0
    t = _wrap(width_in, text, size=8)
    return t, 0.08 + 0.16 * (t.count("\n") + 1)


def save(fig, path: Path) -> Path:
    return atomic_write(path, lambda p: fig.savefig(p, dpi=DPI, format="png",
                                                    metadata=_SAVE_META))


def _table(rows: list[tuple], columns: list[str], wanted: tuple[str, ...]) -> dict[str, Any]:
    """Columns `wanted` of a result's rows as numpy arrays (plots need no pandas, whose import
    alone takes a good part of a second)."""
    idx = [columns.index(c) for c in wanted]
    return {c: np.asarray([r[i] for r in rows]) for c, i in zip(wanted, idx, strict=True)}


def _time_unit(t: float) -> tuple[float, str]:
    if t >= 1:
        return 1.0, "s"
    if t >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _fmt_time(t: float) -> str:
    scale, unit = _time_unit(t)
    return f"{t * scale:.4g} {unit}"


def _fmt_bytes(b: float) -> str:
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


# -- a training / inference step ---------------------------------------------------------------
def plot_step(result, summary: dict, out_dir: str | Path) -> list[Path]:
    """Write the step's PNGs (timeline, breakdown, utilization, links on the torus, and the
    per-chip finish times on the per-chip engine); returns their paths."""
    out = Path(out_dir)
    return [save(fig, out / name) for name, fig in step_figures(result, summary).items()]


@_styled
def step_figures(result, summary: dict) -> dict[str, Any]:
    """The step's figures by file name."""
    caption = step_caption(result, summary)
    figs = {"timeline.png": _timeline(result, caption),
            "breakdown.png": _breakdown(result, caption),
            "utilization.png": _utilization(result, caption)}
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
        from sim.engine import LINK_CLASS_COLUMNS

        lk = _table(result.link_class_rows, LINK_CLASS_COLUMNS, ("link_class", "utilization"))
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
    from sim.chips import get_chip
    from sim.collective_sim import simulate_collective
    from sim.engine import OP_COLUMNS

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

    from sim.engine import OP_COLUMNS

    ops = _table(result.op_rows, OP_COLUMNS,
                 ("kind", "unit", "bound", "phase", "start_s", "end_s"))
    step = max(result.step_time_s, 1e-12)
    scale, unit = _time_unit(step)
    lanes = ["PCIe / host / idle", "collectives (ICI/DCN)", "VPU", "MXU", "phase"]
    start = ops["start_s"].astype(float)
    end = ops["end_s"].astype(float)
    kind = ops["kind"]
    live = end > start
    lane = np.where(kind == "collective", 1, 0)
    lane = np.where(kind == "compute", np.where(ops["unit"] == "mxu", 3, 2), lane)
    bound = ops["bound"]
    present = [b for b in _COLORS if ((bound == b) & live).any()]
    present += sorted(set(bound[live].tolist()) - set(present))
    spans = _phase_spans(ops)
    phases = list(dict.fromkeys(p for p, _s, _e in spans))
    pcolor = {p: _PHASE_COLORS.get(p, _OTHER_PHASE_COLORS[i % len(_OTHER_PHASE_COLORS)])
              for i, p in enumerate(phases)}
    handles = [Patch(color=_COLORS.get(b, "#333333"),
                     label=_BOUND_WORDS.get(b, f"{UNIT_WORDS.get(b, b)}-bound"))
               for b in present]
    handles += [Patch(color=pcolor[p], label=_phase_word(p)) for p in phases]
    width, ncol = 12.0, 8
    title = _wrap(width, f"chip 0 timeline of one step ({_fmt_time(result.step_time_s)}): "
                         f"ops per unit, coloured by the unit that bounds them; phases on top",
                  caption)
    leg = _legend_height(len(handles), ncol)
    fig = _figure(width, 3.0, title, left=1.75, bottom=0.5 + leg)
    ax = fig.add_subplot()
    # One collection per lane and colour: thousands of ops, a few dozen artists.
    for y in range(4):
        for b in present:
            sel = live & (lane == y) & (bound == b)
            if sel.any():
                ax.broken_barh(np.column_stack([start[sel] * scale, (end - start)[sel] * scale]),
                               (y - 0.4, 0.8), facecolors=_COLORS.get(b, "#333333"),
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
    _legend(fig, handles, ncol)
    return fig


def _breakdown(result, caption: str):
    bd = result.breakdown
    keys = list(bd)
    labels = [breakdown_label(k) for k in keys]
    vals = [float(bd[k]) for k in keys]
    step = result.step_time_s
    width = 8.0
    title = _wrap(width, f"where the step time ({_fmt_time(step)}) goes: the critical path",
                  caption)
    fig = _figure(width, 0.4 + 0.36 * len(keys), title, left=1.8)
    ax = fig.add_subplot()
    ys = list(range(len(keys)))[::-1]  # first key on top
    palette = ["#4C72B0", "#55A868", "#C44E52", "#8172B2", "#999999"]
    ax.barh(ys, vals, color=[palette[i % len(palette)] for i in range(len(keys))])
    ax.set_yticks(ys, labels)
    top = max(vals, default=0.0) or 1.0
    for y, v in zip(ys, vals, strict=True):
        share = v / step if step else 0.0
        ax.text(v + 0.01 * top, y, f"{_fmt_time(v)} ({share:.1%})", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("time on the critical path (s)")
    return fig


def _utilization(result, caption: str):
    width = 10.0
    title = _wrap(width, "utilization over the step", caption)
    fig = _figure(width, 2.6, title, left=0.75, axes_titles=True, wspace=0.25)
    a1, a2 = fig.subplots(1, 2)
    from sim.engine import LINK_CLASS_COLUMNS, UNIT_COLUMNS

    u = _table(result.unit_rows, UNIT_COLUMNS, ("unit", "utilization"))
    units = u["unit"].tolist()
    a1.bar([UNIT_WORDS.get(x, x) for x in units], u["utilization"],
           color=[_COLORS.get(x, "#333") for x in units])
    for i, v in enumerate(u["utilization"].tolist()):
        a1.text(i, v + 0.02, f"{v:.0%}", ha="center", fontsize=8)
    a1.set_ylim(0, 1.12)
    a1.set_ylabel("busy time / step time")
    a1.set_title("chip 0's units")
    lk = _table(result.link_class_rows, LINK_CLASS_COLUMNS, ("link_class", "utilization"))
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


# -- the torus ---------------------------------------------------------------------------------
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


@_styled
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
    # (name, value, count, wraps-or-note, direction of the arrow, arrow points out of the chip)
    arrows = []
    for c in range(2 * topo.ndim):
        a, d = divmod(c, 2)
        sel = exists & (cls == c)
        sign = 1 if d == 0 else -1
        vx, vy = ((1.0, 0.0), (0.0, 1.0), (0.72, 0.72))[a]
        wraps = "wraps" if topo.wraparound[a] and topo.shape[a] > 1 else "no wraparound"
        arrows.append(("xyz"[a] + "+-"[d], float(util[:n][sel].max(initial=0.0)),
                       int(sel.sum()), f"links, {wraps}", (sign * vx, sign * vy), True))
    if topo.num_slices > 1:  # DCN: every chip's port out of and into its slice
        arrows.append(("DCN out", float(util[n:n + nc].max(initial=0.0)), nc,
                       "ports, to other slices", (0.72, -0.72), True))
        arrows.append(("DCN in", float(util[n + nc:].max(initial=0.0)), nc,
                       "ports, from other slices", (-0.72, 0.72), False))
    norm, cmap = _norm_cmap(np.array([v for _n, v, k, *_ in arrows if k]))
    width = 7.5
    note, note_h = _footnote(width, f"{because}: drawn once per class, around one chip "
                                    f"({topo.name}, {_wrap_words(topo)})")
    fig = _figure(width, 4.6, _wrap(width, what, caption), left=0.2, right=0.2,
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


def _torus_per_link(topo, util, *, caption: str, what: str, capacity, max_panels: int):
    """Every ICI link as a segment coloured by its utilization, one panel per (slice, z)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.lines import Line2D

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
    handles = [Line2D([], [], color="#555555", lw=2, label="link (+ above / left of -)")]
    if any(w and k > 1 for w, k in zip(topo.wraparound, topo.shape, strict=True)):
        handles.append(Line2D([], [], color="#555555", lw=2, linestyle=(0, (2, 1.2)),
                              label="wraparound link (dashed stub at the border)"))
    if ndim == 3:
        handles.append(Line2D([], [], color="#555555", lw=2,
                              label="diagonal stub: z link (z+ up-right, z- down-left)"))
    if dead.any():
        handles.append(Line2D([], [], color="#D62728", marker="x", linestyle="",
                              label="dead link (no capacity: idle)"))
    if slow.any():
        handles.append(Line2D([], [], color="#FF7F0E", marker="o", linestyle="",
                              markerfacecolor="none", markeredgewidth=1.5,
                              label="slow link (less capacity), circled"))
    ncol = 3 if width >= 10 else 2
    notes = [f"links of a class differ: every link drawn ({topo.name}, {_wrap_words(topo)})",
             omitted, _dcn_words(topo, util)]
    title = _wrap(width, what, caption, "; ".join(x for x in notes if x))
    fig = _figure(width, rows * ph, title, left=0.6, right=0.8,
                  bottom=0.45 + _legend_height(len(handles), ncol), axes_titles=True,
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
    _legend(fig, handles, ncol)
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


@_styled
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
    scale, unit = _time_unit(max(abs(lo), abs(hi))) if time_values else (1.0, "")
    if percent:
        scale, unit = 100.0, "%"
    if hi - lo <= 1e-9 * max(abs(hi), abs(lo), 1e-300):
        # Alike to rounding: one colour, and the plot says so (no colour bar of noise).
        shown = _fmt_time(hi) if time_values else f"{hi * 100:+.3g}%" if percent else f"{hi:.4g}"
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
    fig = _figure(width, rows * ph, _wrap(width, what, caption, omitted), left=0.6, right=right,
                  bottom=0.5, axes_titles=True, wspace=0.3, hspace=0.45)
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


# -- a collective ------------------------------------------------------------------------------
def plot_collective(res, out_dir: str | Path, *, max_panels: int = MAX_PANELS) -> list[Path]:
    """Write the collective's link utilization on the torus and its steps per stream."""
    out = Path(out_dir)
    return [save(fig, out / name)
            for name, fig in collective_figures(res, max_panels=max_panels).items()]


@_styled
def collective_figures(res, *, max_panels: int = MAX_PANELS) -> dict[str, Any]:
    """The collective's figures by file name."""
    denom = res.link_capacity * res.time_s
    # A dead link has no capacity (and carries nothing): drawn as idle.
    util = np.divide(res.link_bytes, denom, out=np.zeros_like(res.link_bytes, dtype=float),
                     where=denom > 0)
    caption = collective_caption(res)
    over = f" over {','.join(res.axes)}" if res.axes else ""
    what = (f"{res.op} of {_fmt_bytes(res.bytes)}{over} ({res.algorithm}): "
            f"{_fmt_time(res.time_s)}; link utilization")
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
    from sim.collective_sim import TIMELINE_COLUMNS

    if not res.timeline_rows:
        return 0
    g, end = TIMELINE_COLUMNS.index("group"), TIMELINE_COLUMNS.index("end_s")
    return int(max(res.timeline_rows, key=lambda r: (r[end], -r[g]))[g])


@_styled
def collective_links_figure(res, caption: str):
    """The collective's steps per link: one lane per link the last replica group to finish
    loads (its busiest `MAX_LINK_LANES`), a bar per step on each link it loads, from the step's
    start to its end, coloured by the link's utilization in that step (its bytes over its
    capacity times the step's duration). Links off the collective's axes carry detours around
    a dead link: their lanes are marked, and a dead link of the group has a lane of its own,
    crossed out. Needs the per-step links of full or per-chip mode (`res.step_links`)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    from sim.collective_sim import TIMELINE_COLUMNS

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
    scale, unit = _time_unit(t_end)
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
    title = _wrap(width, f"{res.op} ({res.algorithm}): the links of replica group {g} per step "
                         f"(a bar per step on each link it loads); {_fmt_time(res.time_s)} in "
                         f"all", caption, "; ".join(x for x in notes if x))
    right = 1.4
    fig = _figure(width, 0.5 + 0.2 * max(len(links), 1), title, left=1.9, right=right,
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

    from sim.collective_sim import TIMELINE_COLUMNS

    tl = _table(res.timeline_rows, TIMELINE_COLUMNS,
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
    scale, unit = _time_unit(t_end)
    kinds = [step_words(lab) for lab in rows["label"]]
    names = list(dict.fromkeys(kinds))
    color = {k: _STEP_COLORS[i % len(_STEP_COLORS)] for i, k in enumerate(names)}
    handles = [Patch(color=color[k], label=k) for k in names]
    ncol = 4
    title = _wrap(width, f"{res.op} ({res.algorithm}): steps per stream of {who}; "
                         f"{_fmt_time(res.time_s)} in all", caption)
    fig = _figure(width, 0.5 + 0.34 * max(len(streams), 1), title, left=1.4 if chunked else 0.9,
                  bottom=0.5 + _legend_height(len(handles), ncol, titled=True))
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
        _legend(fig, handles, ncol, title="what each step does (bars: step number: step)",
                title_fontsize=8)
    return fig
