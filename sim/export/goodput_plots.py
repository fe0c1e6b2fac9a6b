"""PNG figures of a goodput run (its `plots` directory):

* `goodput_timeline.png`: seed 0's job over wall time: a lane of what it was doing (training
  that was kept, training lost to a failure, checkpoint writes, restarts and cube swaps,
  waiting for a repair or a spare) with the failures as ticks above it; the steps committed
  against the failure-free pace; and, with spare cubes, the spares free.
* `goodput_vs_interval.png`: the mean goodput over the seeds against the checkpoint interval
  (every interval the search evaluated), with the interval used, the best and Young-Daly's
  marked.

Built as in `sim/export/plots.py`: bare Agg figures under its fixed style, one collection per
colour, no pyplot, no PNG software stamp, so the same run gives the same bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.export.plots import new_figure, save, styled, wrap_text

PLOT_FILES = ("goodput_timeline.png", "goodput_vs_interval.png")
# Lanes of the timeline: (label, colour, the event kinds and details drawn in it).
_STATES = (("training (kept)", "#55A868"), ("training (lost)", "#C44E52"),
           ("checkpoint writes", "#4C72B0"), ("restarts and swaps", "#CCB974"),
           ("waiting (repair or spare)", "#8C8C8C"))


def _state(kind: str, detail: dict) -> int | None:
    if kind == "train":
        return 0 if detail.get("kept", True) else 1
    if kind == "checkpoint":
        return 2
    if kind in ("restart", "swap"):
        return 3
    if kind in ("wait_repair", "wait_spare"):
        return 4
    return None


def _title(s: dict) -> str:
    spares = (f"{s['spare_cubes']} spare cubes" if s["swaps_cubes"] else
              "no spares" if s["ocs"] else "static pod")
    return (f"goodput on {s['num_chips']:,} {s['chip']} chips ({s['topology']}), {spares}: "
            f"{s['goodput']:.1%} over {s['seeds']} seed(s), checkpoints every "
            f"{s['checkpoint_interval_s']:,.4g} s")


@styled
def goodput_figures(summary: dict, result) -> dict[str, object]:
    """{file name: Figure} of a `goodput` run (`result` its `GoodputResult`)."""
    events = result.events()
    title = wrap_text(9.0, _title(summary))
    end_h = result.outcome.outcomes[0].wall_s / 3600
    swaps = summary["swaps_cubes"]
    rows = 3 if swaps else 2
    fig = new_figure(9.0, 1.9 * rows + 0.6, title, axes_titles=True, hspace=0.55)
    axes = fig.subplots(rows, 1, sharex=True, gridspec_kw={"height_ratios": [1.2] + [1] *
                                                            (rows - 1)})
    ax = axes[0]
    spans: list[list[tuple[float, float]]] = [[] for _ in _STATES]
    fails = []
    for a, b, kind, detail in events:
        if kind == "failure":
            fails.append(a / 3600)
            continue
        i = _state(kind, detail)
        if i is not None and b > a:
            spans[i].append((a / 3600, (b - a) / 3600))
    for (label, color), sp in zip(_STATES, spans, strict=True):
        ax.broken_barh(sp or [(0, 0)], (0.1, 0.8), facecolors=color, edgecolors="none",
                       label=label)
    if fails:
        ax.vlines(fails, 1.0, 1.35, colors="#C44E52", lw=0.6, label="failures")
    ax.set_ylim(0, 1.45)
    ax.set_yticks([])
    ax.set_title(f"seed 0: what the job was doing ({len(fails):,} failures)")
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              frameon=False)
    # Steps committed against the failure-free pace.
    ax2 = axes[1]
    t, done = [0.0], [0.0]
    for _a, b, kind, detail in events:
        if kind == "checkpoint" and detail.get("committed"):
            t.append(b / 3600)
            done.append(detail["after_step"] + 1)
        elif kind == "train" and "window" in detail:  # a coarse timeline: one slice a window
            t.append(b / 3600)
            done.append(done[-1] + detail["checkpoints"] * result.interval_steps)
    t.append(end_h)
    done.append(result.job.steps if result.job.steps is not None else
                result.outcome.outcomes[0].useful_s / result.job.step_time_s)
    ax2.step(t, done, where="post", color="#55A868", lw=1.0, label="steps committed")
    step_h = result.job.step_time_s / 3600
    ax2.plot([0, end_h], [0, end_h / step_h], color="#999999", lw=0.8, ls="--",
             label="failure-free pace")
    ax2.set_ylim(0, max(done[-1], 1) * 1.08)
    ax2.set_title("steps committed (checkpointed)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, loc="upper left")
    if swaps:
        ax3 = axes[2]
        tt, free = [0.0], [summary["spare_cubes"]]
        changes = []
        for a, b, kind, detail in events:
            if kind == "swap_in":
                changes.append((a, -detail["cubes"]))
            elif kind == "repair":
                changes.append((b, 1))
        changes.sort()
        n = summary["spare_cubes"]
        for when, d in changes:
            if when / 3600 > end_h:
                break
            n += d
            tt.append(when / 3600)
            free.append(n)
        tt.append(end_h)
        free.append(n)
        ax3.step(tt, free, where="post", color="#8172B2", lw=1.0)
        ax3.set_ylim(0, summary["spare_cubes"] + 0.5)
        ax3.set_title("spare cubes free")
        ax3.grid(alpha=0.3)
    axes[-1].set_xlabel("wall-clock hours")
    axes[-1].set_xlim(0, max(end_h, 1e-9))
    out = {"goodput_timeline.png": fig}
    fig2 = new_figure(7.0, 3.4, wrap_text(7.0, _title(summary)), axes_titles=True)
    ax = fig2.subplots(1, 1)
    pts = [(r["checkpoint_interval_s"], r["goodput"]) for r in summary["interval_search"]
           if r["goodput"] is not None]
    if pts:
        x, y = np.array(pts).T
        ax.plot(x, y, marker="o", ms=3, color="#4C72B0", lw=1.0,
                label=f"mean goodput over {summary['seeds']} seed(s)")
    marks = [("used", summary["checkpoint_interval_s"], "#55A868", "-"),
             ("best", summary["best_checkpoint_interval_s"], "#C44E52", ":")]
    if summary["young_daly_interval_s"]:
        marks.append(("Young-Daly", summary["young_daly_interval_s"], "#8C8C8C", "--"))
    for label, v, color, ls in marks:
        ax.axvline(v, color=color, ls=ls, lw=1.0, label=f"{label} {v:,.4g} s")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of training)")
    ax.set_ylabel("goodput")
    ax.set_title("the interval search (common failures for every interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out["goodput_vs_interval.png"] = fig2
    return out


def plot_goodput(summary: dict, result, out_dir: str | Path) -> list[Path]:
    """Write the goodput figures into `out_dir`; the paths written."""
    out = Path(out_dir)
    return [save(fig, out / name) for name, fig in goodput_figures(summary, result).items()]
