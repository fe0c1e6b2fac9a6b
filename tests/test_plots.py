"""The `--plots` figures (`sim/export/*plots.py`), checked through their artists, not pixels:
every plot kind on 1D, 2D, 3D and multi-slice pods; the torus drawn per link only when links of a
class differ (every existing link a segment) and otherwise once per class with a note; words, not
field names; the model, pod and mesh in every title; legends off the lanes; byte-identical
files for identical inputs; and the text reports' breakdown in words."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.text import Text

import sim
from sim.engine.result import BREAKDOWN_KEYS, BREAKDOWN_LABELS
from sim.export.collective_plots import collective_figures, plot_collective, step_words
from sim.export.step_plots import plot_step, step_figures
from sim.export.torus_plots import links_alike

TINY = {"name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 4,
        "head_dim": 64, "d_ff": 1024, "mlp": "relu", "vocab_size": 512}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def _title(fig) -> str:
    return fig._suptitle.get_text().replace("\n", " ")


def _segments(fig) -> int:
    return sum(len(c.get_segments()) for c in fig.findobj(LineCollection))


def _no_field_names(fig) -> None:
    for t in _texts(fig):
        assert not any(k in t for k in BREAKDOWN_KEYS), t


# -- collectives: 1D, 2D, 3D, multi-slice; per link vs per class --------------------------------
@pytest.mark.parametrize(("flags", "pod", "panels"), [
    # An all-gather on a line of 8 (no wraparound): links of a class carry different amounts.
    (dict(chip="v5e", shape="8", axes="x", op="all-gather"), "v5e 8 (8 chips)", 1),
    # A dead link makes links of one class differ on a 2D torus -> per link.
    (dict(chip="v5e", shape="4x4", wraparound="all", axes="x", dead_link=["1,0:x+"]),
     "v5e 4x4 (16 chips)", 1),
    # A slow z link on a 3D torus -> per link, one panel per z slice.
    (dict(chip="v5p", shape="4x4x4", axes="x,z", slow_link=["1,1,1:z+:0.5"]),
     "v5p 4x4x4 (64 chips)", 4),
])
def test_collective_torus_is_drawn_per_link_when_links_of_a_class_differ(flags, pod, panels):
    r = sim.collective(**{"op": "all-reduce", "bytes": "1MiB", **flags}).result
    topo = r.pod
    figs = collective_figures(r)
    fig = figs["links_on_torus.png"]
    title = _title(fig)
    assert "links of a class differ: every link drawn" in title
    assert pod in title and "one collective (no model)" in title and "replica group" in title
    # Every existing ICI link is one segment (z links too, as diagonal stubs in their z slice).
    assert _segments(fig) == int(topo.link_mask().sum())
    panel_titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(panel_titles) == panels
    if topo.ndim == 3:
        assert panel_titles == [f"z = {z}" for z in range(4)]
    # Integer chip ticks.
    for ax in fig.axes[:panels]:
        assert all(t.get_text().isdigit() for t in ax.get_xticklabels())
    legend = " ".join(_texts(fig))
    assert ("dead link" in legend) == ("dead_link" in flags)
    assert ("slow link" in legend) == ("slow_link" in flags)
    assert ("wraparound link" in legend) == any(topo.wraparound)
    assert ("z link" in legend) == (topo.ndim == 3)


def test_multi_slice_torus_draws_the_slices_that_differ_and_names_the_alike_ones():
    # A dead link in slice 1: both slices drawn, every ICI link of both a segment.
    r = sim.collective(chip="v5e", shape="4x4", slices=2, op="all-reduce", axes="x",
                       bytes="1MiB", dead_link=["1,0,1:x+"]).result
    fig = collective_figures(r)["links_on_torus.png"]
    assert [ax.get_title() for ax in fig.axes[:2]] == ["2x(4x4), slice 0", "2x(4x4), slice 1"]
    assert _segments(fig) == int(r.pod.link_mask().sum())
    # Three slices alike (an all-gather over x and dcn): slice 0 drawn, the others named.
    r = sim.collective(chip="v5e", shape="4x4", slices=3, op="all-gather", axes="x,dcn",
                       bytes="3MiB").result
    fig = collective_figures(r)["links_on_torus.png"]
    title = _title(fig)
    assert "slice(s) 1-2 are like slice 0: not drawn" in title and "DCN links" in title
    assert _segments(fig) == int(r.pod.link_mask().sum()) // 3


@pytest.mark.parametrize(("flags", "classes"), [
    (dict(chip="v5e", shape="16x16", axes="x,y"), ["x+", "x-", "y+", "y-"]),
    (dict(chip="v5p", shape="4x4x4", axes="z"), ["x+", "x-", "y+", "y-", "z+", "z-"]),
    (dict(chip="v5e", shape="2x2", slices=2, axes="dcn"),
     ["x+", "x-", "y+", "y-", "DCN out", "DCN in"]),
])
def test_collective_torus_with_alike_links_says_so_and_draws_each_class_once(flags, classes):
    r = sim.collective(op="all-reduce", bytes="1MiB", **flags).result
    util = r.link_bytes / (r.link_capacity * r.time_s)
    assert links_alike(r.pod, util, r.link_capacity)
    fig = collective_figures(r)["links_on_torus.png"]
    texts = _texts(fig)
    assert any("every link of a class is alike: drawn once per class" in t for t in texts)
    assert _segments(fig) == 0  # no per-link drawing
    labels = [t.split("  ")[0] for t in texts if "  " in t and "%" in t]
    assert labels == classes
    # The class labels carry their utilization: the busiest class is the data's maximum.
    top = max(float(t.split("  ")[1].split("%")[0]) for t in texts if "  " in t and "%" in t)
    assert top == pytest.approx(100 * util.max(), abs=0.051)


def test_links_alike_rule_on_closed_form_arrays(v5e, topo):
    t = topo(v5e, "4x4", wrap="all")
    util = np.zeros(t.num_links)
    assert links_alike(t, util)
    util[np.arange(t.num_ici_links) % 4 == 0] = 0.5  # every x+ link alike
    assert links_alike(t, util)
    util[t.ici_link_id(5, 0, 1)] = 0.6  # one x+ link differs
    assert not links_alike(t, util)
    cap = np.full(t.num_links, 1.0)
    util[t.ici_link_id(5, 0, 1)] = 0.5
    cap[t.ici_link_id(3, 1, -1)] = 0.0  # a dead y- link, even if idle like its class
    assert not links_alike(t, util, cap)


def test_collective_timeline_shows_each_step_of_each_stream_with_words():
    r = sim.collective(chip="v5e", shape="16x16", op="all-reduce", axes="x,y",
                       bytes="1MiB", algorithm="multi-axis").result  # (auto: hierarchical)
    fig = collective_figures(r)["collective_timeline.png"]
    ax = fig.axes[0]
    tl = r.timeline
    bars = sum(len(c.get_paths()) for c in ax.findobj(PolyCollection))
    assert bars == len(tl) == 8  # two streams of RS, RS, AG, AG
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stream 0", "stream 1"]
    texts = _texts(fig)
    assert "0: reduce-scatter over x" in texts and "3: all-gather over y" in texts
    assert fig.legends and ax.get_legend() is None
    assert "v5e 16x16 (256 chips)" in _title(fig)
    # With --chunks C each piece gets its own lane: C lanes of the same steps.
    r = sim.collective(chip="v5e", shape="4x4", op="all-gather", axes="x", bytes="1MiB",
                       algorithm="ring", chunks=3).result
    ax = collective_figures(r)["collective_timeline.png"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"stream 0, chunk {c}" for c in range(3)]
    assert sum(len(c.get_paths()) for c in ax.findobj(PolyCollection)) == len(r.timeline)
    assert step_words("part1 RS x") == "reduce-scatter over x"
    assert step_words("A2A ring") == "all-to-all ring"
    assert step_words("permute x+1") == "permute x+1"


# -- steps: 2D, 3D, multi-slice; words and captions ---------------------------------------------
@pytest.mark.parametrize(("flags", "pod", "mesh"), [
    (dict(chip="v5e", shape="4", mesh="fsdp=4"), "v5e 4 (4 chips)", "mesh fsdp=4 on x"),
    (dict(chip="v5e", shape="2x2", mesh="fsdp=2,tensor=2"), "v5e 2x2 (4 chips)",
     "mesh fsdp=2 on y, tensor=2 on x"),
    (dict(chip="v5p", shape="2x2x2", mesh="fsdp=8"), "v5p 2x2x2 (8 chips)", "mesh fsdp=8 on"),
    (dict(chip="v5e", shape="2x2", slices=2, dcn="data=2", mesh="fsdp=4"),
     "v5e 2x(2x2) (8 chips)", "DCN data=2"),
])
def test_step_plots_name_model_pod_and_mesh_and_use_words(tiny, flags, pod, mesh):
    run = sim.train(model=tiny, seq_len=128, batch_per_chip=1, **flags)
    figs = step_figures(run.result, run.to_dict())
    assert sorted(figs) == ["breakdown.png", "links_on_torus.png", "timeline.png",
                            "utilization.png"]
    for name, fig in figs.items():
        title = _title(fig)
        assert "tiny on " in title and pod in title and mesh in title, (name, title)
        _no_field_names(fig)
    bd = figs["breakdown.png"].axes[0]
    assert [t.get_text() for t in bd.get_yticklabels()] == [
        BREAKDOWN_LABELS[k] for k in run.result.breakdown]
    # The step is simulated per link class: on a line of 4 (no wraparound) the links of a
    # class still differ (drawn per link); on axes of 2 they are alike, drawn once, said so.
    torus = figs["links_on_torus.png"]
    if flags["shape"] == "4":
        assert "links of a class differ: every link drawn" in _title(torus)
    else:
        assert any("the step is simulated per link class" in t for t in _texts(torus))


def test_step_timeline_marks_phases_and_keeps_its_legend_off_the_lanes(tiny):
    run = sim.train(chip="v5e", shape="2x2", model=tiny, seq_len=128, batch_per_chip=1,
                    mesh="fsdp=4")
    fig = step_figures(run.result, run.to_dict())["timeline.png"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "phase"
    legend = fig.legends[0]
    names = [t.get_text() for t in legend.get_texts()]
    assert {"forward", "backward", "optimizer", "VPU-bound", "ICI-bound"} <= set(names)
    assert "forward" in _texts(ax) and "backward" in _texts(ax)
    # The phase lane's bands cover the ops of each phase: forward ends where backward starts.
    ops = run.result.ops
    fwd_end = ops[(ops.phase == "fwd") & (ops.kind == "compute")].end_s.max()
    assert ops[(ops.phase == "bwd") & (ops.kind == "compute")].start_s.min() >= fwd_end - 1e-12
    # The legend sits below the axes, not on the lanes.
    renderer = FigureCanvasAgg(fig).get_renderer()
    assert ax.get_legend() is None
    assert legend.get_window_extent(renderer).y1 < ax.get_window_extent(renderer).y0


def _plotted(fig, topo, chip: int) -> tuple[float, list[float]]:
    """The value drawn for `chip` in a chip map and every value drawn, read back from the
    panels' images (one per z slice, in z order)."""
    images = [ax.images[0] for ax in fig.axes if ax.images]
    x, y, *z = topo.coords(chip)
    grid = np.asarray(images[z[0] if z else 0].get_array(), dtype=float)
    every = [float(v) for im in images for v in np.asarray(im.get_array(), dtype=float).ravel()
             if np.isfinite(v)]
    return float(grid[y, x]), every


def test_per_chip_maps_give_the_straggler_the_extreme_colour(tiny):
    """The slow chip has the most compute and the largest slowdown against the median, and
    waits least in collectives (the others wait for it): the map's extreme value and colour;
    finish times, which the last all-reduce makes equal, are not what is mapped."""
    run = sim.train(chip="v5p", shape="2x2x2", model=tiny, seq_len=128, batch_per_chip=1,
                    mesh="fsdp=8", slow_chip=["1,0,1:0.5"])
    topo = run.result.pod
    slow = topo.chip_id((1, 0, 1))
    figs = step_figures(run.result, run.to_dict())
    assert "chip_finish_times.png" not in figs
    for name, extreme in (("chip_compute.png", max), ("chip_slowdown.png", max),
                          ("chip_collective_wait.png", min)):
        fig = figs[name]
        mine, every = _plotted(fig, topo, slow)
        assert mine == extreme(every) and mine != (min if extreme is max else max)(every), name
        # The extreme value takes the colour map's end.
        image = next(ax.images[0] for ax in fig.axes if ax.images)
        lo, hi = image.norm.vmin, image.norm.vmax
        assert mine == pytest.approx(hi if extreme is max else lo)
        assert "slowest chip is (1,0,1)" in _title(fig) and "v5p 2x2x2 (8 chips)" in _title(fig)
        assert [ax.get_title() for ax in fig.axes[:2]] == ["z = 0", "z = 1"]
    # The slowdown of a chip at half speed, against the median: the map says how much.
    mine, every = _plotted(figs["chip_slowdown.png"], topo, slow)
    assert mine > 1.0 and sorted(every)[len(every) // 2] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("shape", ["2x2", "16x16", "4x4x4", "16x20x28"])
def test_chip_map_labels_fit_the_figure_at_every_pod_size(shape):
    """The colour bar's label and ticks, the panels' titles and tick labels lie inside the
    figure on pods of 4 to 8,960 chips (the colour bar label was clipped)."""
    from sim.chips import get_chip
    from sim.export.torus_plots import chip_map_figure
    from topologies.slices import resolve_topology

    chip = get_chip("v5p" if shape.count("x") == 2 else "v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    vals = np.linspace(0.1, 0.2, topo.num_chips)
    fig = chip_map_figure(topo, vals, caption="synthetic", what="compute time per chip",
                          label="compute (MXU + VPU busy)", time_values=True)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # labels are placed when drawn
    renderer = canvas.get_renderer()
    box = fig.bbox
    cbar = fig.axes[-1]
    texts = [cbar.yaxis.label, *cbar.get_yticklabels()]
    for ax in fig.axes[:-1]:
        if ax.images:
            texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(),
                      *ax.get_yticklabels()]
    assert cbar.yaxis.label.get_text() == "compute (MXU + VPU busy) (ms)"
    for t in texts:
        if t.get_text() and t.get_visible():
            e = t.get_window_extent(renderer)
            assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, \
                (shape, t.get_text())
            assert t.get_fontsize() >= 7


def test_step_on_a_pod_without_wraparound_draws_every_link(tiny):
    """A 4x4 v5e slice has no wraparound: the links of a class carry different loads (a
    line's end links less, tensor=4's x lines end at the border), so every link is drawn, each
    at its share of its collectives' bytes, never as "every link of a class is alike"."""
    run = sim.train(chip="v5e", shape="4x4", model=tiny, seq_len=128, batch_per_chip=1,
                    mesh="fsdp=4,tensor=4")
    topo = run.result.pod
    assert not any(topo.wraparound)
    fig = step_figures(run.result, run.to_dict())["links_on_torus.png"]
    assert "links of a class differ: every link drawn" in _title(fig)
    assert "alike" not in " ".join(_texts(fig))
    assert _segments(fig) == int(topo.link_mask().sum())
    # The drawn values differ within a class (x+ links).
    colours = {tuple(np.round(c, 4)) for coll in fig.findobj(LineCollection)
               for c in coll.get_colors()}
    assert len(colours) > 2


def test_step_on_whole_wrapped_axes_draws_each_link_class_once_and_says_why(tiny):
    run = sim.train(chip="v5e", shape="16x16", model=tiny, seq_len=128, batch_per_chip=1,
                    mesh="fsdp=256")
    fig = step_figures(run.result, run.to_dict())["links_on_torus.png"]
    assert "every link of a class is alike" in " ".join(_texts(fig))


def test_collective_links_timeline_draws_the_detour_around_a_dead_link():
    """Per step and per link: the links a dead link's transfers are rerouted over carry bars
    and are labelled as the detour; the dead link has a lane of its own with no bar."""

    r = sim.collective(chip="v5e", shape="4x4", wraparound="all", op="all-gather", axes="x",
                       bytes="1MiB", dead_link=["1,0:x+"]).result
    assert r.detour_links  # the router recorded its replacement paths
    fig = collective_figures(r)["collective_links.png"]
    assert fig is not None
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    lanes_with_bars = set()
    for coll in ax.findobj(PolyCollection):
        for path in coll.get_paths():
            lanes_with_bars.add(round(float(path.vertices[:, 1].mean())))
    detour = [i for i, lab in enumerate(labels) if lab.endswith(" detour")]
    dead = [i for i, lab in enumerate(labels) if lab.endswith("(dead)")]
    assert detour and set(detour) <= lanes_with_bars
    assert labels[dead[0]] == "(1,0) x+ (dead)" and dead[0] not in lanes_with_bars
    # Every detour lane is a link the router sent rerouted bytes over.
    topo = r.pod
    names = {i: labels[i].removesuffix(" detour") for i in detour}
    routed = {f"({','.join(map(str, topo.coords(k // 4)))}) {'xy'[(k % 4) // 2]}{'+-'[k % 2]}"
              for k in r.detour_links}
    assert set(names.values()) <= routed
    assert "carry the detours around 1 dead link" in _title(fig)


def test_a_healthy_symmetric_collective_writes_no_per_link_timeline():
    r = sim.collective(chip="v5e", shape="16x16", op="all-gather", axes="x",
                       bytes="1MiB").result
    assert r.mode == "symmetric" and "collective_links.png" not in collective_figures(r)


def test_step_with_a_dead_link_draws_every_link_and_marks_the_dead_one(tiny):
    run = sim.train(chip="v5e", shape="4x4", wraparound="all", model=tiny, seq_len=128,
                    batch_per_chip=1, mesh="fsdp=4,tensor=4", dead_link=["1,1:y+"])
    topo = run.result.pod
    dead = topo.ici_link_id(topo.chip_id((1, 1)), 1, 1)
    assert run.result.link_capacity[dead] == 0.0 and run.result.link_bytes[dead] == 0.0
    fig = step_figures(run.result, run.to_dict())["links_on_torus.png"]
    assert _segments(fig) == int(topo.link_mask().sum())
    assert "dead link (no capacity: idle)" in [t.get_text() for t in fig.legends[0].get_texts()]


# -- files: determinism, speed-independent ------------------------------------------------------
def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_every_plot_kind_is_byte_identical_for_identical_inputs(tiny, tmp_path):
    """The step plots (a slow chip and link: the finish map and the per-link torus) and the
    collective plots (per-link torus with a dead link, timeline), drawn and written twice (the
    runs' own determinism is tests/test_fuzz.py's)."""
    step = sim.train(chip="v5e", shape="2x2", model=tiny, seq_len=128, batch_per_chip=1,
                     mesh="fsdp=4", slow_chip=["1,1:0.5"], slow_link=["0,0:x+:0.5"])
    coll = sim.collective(chip="v5e", shape="4x4", wraparound="all", op="all-reduce", axes="x",
                          bytes="1MiB", dead_link=["1,0:x+"])
    out = []
    for run_dir in ("a", "b"):
        d = tmp_path / run_dir
        plot_step(step.result, step.to_dict(), d / "step")
        plot_collective(coll.result, d / "coll")
        out.append((_digests(d / "step"), _digests(d / "coll")))
    assert out[0] == out[1]
    assert sorted(out[0][0]) == ["breakdown.png", "chip_collective_wait.png", "chip_compute.png",
                                 "chip_slowdown.png", "links_on_torus.png", "timeline.png",
                                 "utilization.png"]
    assert sorted(out[0][1]) == ["collective_links.png", "collective_timeline.png",
                                 "links_on_torus.png"]


def test_serve_sweep_pareto_plot_is_byte_identical_and_names_model_pod_and_mesh(tiny, tmp_path,
                                                                               capsys):
    from sim.cli import main

    digests = []
    for d in ("a", "b"):
        assert main(["serve-sweep", "--chip", "v5e", "--shape", "2x2", "--model", tiny,
                     "--context-len", "256", "--mesh", "tensor=4", "--batches", "1,4",
                     "--out", str(tmp_path / d)]) == 0
        digests.append(hashlib.sha256((tmp_path / d / "serve_sweep_pareto.png").read_bytes())
                       .hexdigest())
    title = capsys.readouterr().out.splitlines()[0]
    assert digests[0] == digests[1]
    assert "tiny decode" in title and "v5e" in title and "2x2" in title and "tensor=4" in title


# -- text reports -------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "prefill"])
def test_text_reports_print_the_breakdown_in_words(tiny, capsys, command):
    from sim.cli import main

    extra = (["--seq-len", "128", "--batch-per-chip", "1"] if command == "train"
             else ["--batch", "4", "--prompt-len", "128"])
    assert main([command, "--chip", "v5e", "--shape", "2x2", "--model", tiny, "--mesh",
                 "fsdp=4" if command == "train" else "tensor=4", *extra]) == 0
    out = capsys.readouterr().out
    assert "exposed communication" in out and "MXU compute" in out
    assert not any(k in out for k in BREAKDOWN_KEYS)


def test_phase_lane_has_no_gap_where_a_trailing_dcn_all_reduce_runs(tiny):
    # Two slices: the data-parallel gradient all-reduce over DCN runs after the last backward
    # compute op and before the optimizer. Its time belongs to the backward band; the bands
    # tile the step from 0 to its end with no hole.
    from sim.engine.result import OP_COLUMNS
    from sim.export.plots import draw_table
    from sim.export.step_plots import _phase_spans

    run = sim.train(chip="v5e", shape="2x2", slices=2, model=tiny, seq_len=128,
                    batch_per_chip=1, mesh="fsdp=4", dcn="data=2")
    res = run.result
    ops = draw_table(res.op_rows, OP_COLUMNS,
                     ("kind", "unit", "bound", "phase", "start_s", "end_s"))
    spans = _phase_spans(ops)
    compute = (ops["kind"] == "compute") & (ops["phase"] == "bwd")
    last_bwd_compute = ops["end_s"][compute].max()
    dcn = [e for k, p, e in zip(ops["kind"], ops["phase"], ops["end_s"], strict=True)
           if k == "collective" and p == "bwd" and e > last_bwd_compute]
    assert dcn, "the setup must have a collective after the last backward compute op"
    assert spans[0][1] == 0.0
    assert spans[-1][2] == pytest.approx(res.step_time_s, abs=1e-12)
    for (_p, _s, e), (_q, s, _e) in zip(spans, spans[1:], strict=False):
        assert s == pytest.approx(e, abs=1e-12)
    bwd = [x for x in spans if x[0] == "bwd"]
    assert bwd[-1][2] >= max(dcn) - 1e-12
