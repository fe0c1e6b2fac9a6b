"""PNG figures of a serving run (its `plots` directory): `latency_cdf.png` (the
distribution of TTFT, TPOT, end-to-end latency and queueing delay over the requests) and
`kv_queue.png` (KV blocks in use per replica and the number of requests waiting, against
time). Built as in `sim/export/plots.py`: bare Agg figures under its fixed style, no pyplot,
no PNG software stamp, so the same run gives the same bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.export.plots import new_figure, save, styled

PLOT_FILES = ("latency_cdf.png", "kv_queue.png")
COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#8C8C8C")
# At most this many points a line: a long run's iterations are thinned for drawing (every
# k-th point, so the figure stays a function of the run alone).
_MAX_POINTS = 20_000


def _thin(x: np.ndarray) -> np.ndarray:
    k = max(1, -(-x.size // _MAX_POINTS))
    return x[::k]


@styled
def serving_figures(summary: dict, result) -> dict[str, object]:
    """{file name: Figure} of a `serve` run (`result` its `ServeResult`)."""
    title = (f"{summary['model']} on {summary['num_replicas']} replica(s), {summary['chip']}, "
             f"{summary['scheduler']} batching: {summary['num_requests']:,} requests")
    req = result.requests
    lat = {"TTFT": req["ttft_s"], "TPOT": req["tpot_s"], "end to end": req["e2e_s"],
           "queueing": req["queue_s"]}
    fig = new_figure(8.0, 3.2, title, axes_titles=True, wspace=0.3)
    axes = fig.subplots(1, 4)
    for ax, (name, x), color in zip(axes, lat.items(), COLORS, strict=False):
        x = np.sort(x[np.isfinite(x)])
        ax.set_title(name)
        ax.set_xlabel("seconds")
        if x.size:
            y = np.arange(1, x.size + 1) / x.size
            ax.step(_thin(x), _thin(y), where="post", color=color)
            for q in (0.5, 0.99):
                ax.axhline(q, color="#999999", lw=0.5, ls=":")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests")
    out = {"latency_cdf.png": fig}
    its = result.iterations_frame()
    fig2 = new_figure(8.0, 4.0, title, axes_titles=True, hspace=0.45)
    a1, a2 = fig2.subplots(2, 1, sharex=True)
    blocks = {p["role"]: p["kv_blocks"] for p in summary["pools"]}
    for i, (rep, g) in enumerate(its.groupby("replica", sort=True)):
        if i >= len(COLORS):
            break
        t = g.start_s.to_numpy() + g.duration_s.to_numpy()
        share = g.kv_blocks_used.to_numpy() / max(blocks[g.role.iloc[0]], 1)
        a1.plot(_thin(t), _thin(share), lw=0.8, color=COLORS[i], label=f"replica {rep}")
    a1.set_title("KV blocks in use (share of the replica's)")
    a1.set_ylim(0, 1.02)
    a1.grid(alpha=0.3)
    if its.replica.nunique() <= 8:
        a1.legend(fontsize=7, loc="upper right")
    t = its.start_s.to_numpy() + its.duration_s.to_numpy()
    order = np.argsort(t, kind="stable")
    a2.step(_thin(t[order]), _thin(its.queue_length.to_numpy()[order]), where="post",
            color="#C44E52", lw=0.8)
    a2.set_title("requests waiting (all replicas)")
    a2.set_xlabel("simulated time (s)")
    a2.grid(alpha=0.3)
    out["kv_queue.png"] = fig2
    return out


def plot_serving(summary: dict, result, out_dir: str | Path) -> list[Path]:
    """Write the serving figures into `out_dir`; the paths written."""
    out = Path(out_dir)
    return [save(fig, out / name) for name, fig in serving_figures(summary, result).items()]
