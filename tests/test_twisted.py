"""Twisted tori (v4, v5p): the wiring (every chip keeps its six links, the short axes'
wraparound lands half the long side along it), hop counts and bisection against hand
computation, routes and collectives on the real graph, the 4x4x8 all-to-all against the TPU v4
paper, and the one-line refusals."""

from __future__ import annotations

import json

import networkx as nx
import numpy as np
import pytest

from sim.chips import get_chip
from sim.cli import main as cli_main
from sim.collectives import simulate_collective
from topologies.errors import TpusimError
from topologies.groups import lattice_offsets, route_pairs_links, slice_axes
from topologies.metrics import (
    all_to_all_link_load,
    bfs_hops,
    spectral_bisection_bound,
    topology_metrics,
)
from topologies.scenario import Scenario, parse_dead_link
from topologies.slices import resolve_topology
from topologies.torus import build_torus


def _twisted(shape, chip="v4"):
    c = get_chip(chip)
    return resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape, shape=shape, twist=True)


# -- the wiring ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 4, 8), (4, 8, 8), (8, 4, 4), (2, 2, 4)])
def test_every_chip_of_a_twisted_torus_keeps_six_links_out_and_six_in(shape):
    t = build_torus(shape, True, twisted=True)
    src, dst = t.link_endpoints()
    assert (src >= 0).all() and len(src) == 6 * t.num_chips
    assert set(np.bincount(src, minlength=t.num_chips)) == {6}
    assert set(np.bincount(dst, minlength=t.num_chips)) == {6}
    # Every link has its reverse: the + link out of a chip is the - link into it.
    pairs = {(int(a), int(b), link % 6 // 2)
             for link, (a, b) in enumerate(zip(src, dst, strict=True))}
    assert all((b, a, ax) in pairs for a, b, ax in pairs)


def test_only_the_short_axes_wraparound_links_move_by_half_the_long_side():
    plain, twisted = build_torus((4, 4, 8), True), build_torus((4, 4, 8), True, twisted=True)
    ps, pd = plain.link_endpoints()
    ts, td = twisted.link_endpoints()
    moved = np.flatnonzero(pd != td)
    assert (ps == ts).all()
    # 4x8 x+ and x- wraparound links, as many for y: 4 * 4 * 8 = 128 of 768.
    assert len(moved) == 128
    for link in moved.tolist():
        axis = link % 6 // 2
        cs, cp, ct = (np.asarray(t.coords(int(v))) for t, v in
                      ((plain, ps[link]), (plain, pd[link]), (twisted, td[link])))
        assert axis in (0, 1) and cs[axis] in (0, 3)
        assert (ct - cp).tolist() == [0, 0, 4] or (cp - ct).tolist() == [0, 0, 4]
    d = twisted.describe_link(twisted.ici_link_id(twisted.chip_id((3, 1, 2)), 0, 1))
    assert d == "(3,1,2)->(0,1,6) x+"


def test_a_k_by_2k_by_2k_slice_twists_its_short_axis_along_both_long_ones():
    t = build_torus((4, 8, 8), True, twisted=True)
    _src, dst = t.link_endpoints()
    link = t.ici_link_id(t.chip_id((3, 1, 2)), 0, 1)
    assert t.coords(int(dst[link])) == (0, 5, 6)
    link = t.ici_link_id(t.chip_id((0, 7, 2)), 1, 1)  # a long axis wraps straight
    assert t.coords(int(dst[link])) == (0, 0, 2)


# -- hop counts and bisection by hand ---------------------------------------------------------
def test_hop_counts_of_the_4x4x8_twisted_and_plain_tori():
    """By hand. Plain 4x4x8: distances add per ring (4, 4, 8: mean 1, 1, 2 over all chips,
    self included), so the mean over the 127 others is 4 x 128 / 127, the diameter 2 + 2 + 4.
    Twisted: within 3 hops a chip sees the infinite cubic lattice's shells, 4r^2 + 2 = 6, 18,
    38 chips (no two of them coincide: the shortest twist vector, (4, 0, 4), is 8 hops), and
    the farthest chips are 6 hops away."""
    plain = topology_metrics(build_torus((4, 4, 8), True))
    assert plain.diameter_hops == 8
    assert plain.average_hops == pytest.approx(4 * 128 / 127)
    d = bfs_hops(build_torus((4, 4, 8), True, twisted=True))
    shells = np.bincount(d)
    assert shells[1:4].tolist() == [4 * r * r + 2 for r in (1, 2, 3)]
    assert len(shells) == 7 and shells.sum() == 128
    twisted = topology_metrics(build_torus((4, 4, 8), True, twisted=True))
    assert twisted.diameter_hops == 6
    assert twisted.average_hops == pytest.approx(440 / 127) == pytest.approx(d.sum() / 127)


@pytest.mark.parametrize("shape", [(4, 4, 8), (4, 8, 8), (2, 2, 4)])
def test_shortest_hop_vectors_are_as_long_as_the_breadth_first_distances(shape):
    t = build_torus(shape, True, twisted=True)
    table = lattice_offsets(slice_axes(t))
    src, dst = t.link_endpoints()
    g = nx.DiGraph()
    g.add_edges_from(zip(src.tolist(), dst.tolist(), strict=True))
    dist = nx.single_source_shortest_path_length(g, 0)
    assert len(table) == t.num_chips
    for chip, hops in dist.items():
        vecs = table[tuple(t.coords(chip))]
        assert {sum(abs(v) for v in vec) for vec in vecs} == {hops}


def test_bisection_of_the_4x4x8_plain_and_twisted_tori():
    """Plain: the slab z < 4 cuts the 16 z links from z=3 and the 16 wraparound links from
    z=0, 32 one way. Twisted: that slab also cuts all 32 x and 32 y wraparound links (each
    lands 4 along z, in the other half), 96; the slab x < 2 cuts the 32 links from x=1 and
    the 32 wraparound links from x=3, 64, the best; and no balanced cut is below the
    spectral bound 57 (lambda_2 = 3 (2 - sqrt 2), the character (1/8, 1/8, 1/8) of this FCC
    lattice, times 128 / 4)."""
    plain = topology_metrics(build_torus((4, 4, 8), True))
    assert (plain.bisection_links, plain.bisection_cut) == (32, "z < 4")
    t = build_torus((4, 4, 8), True, twisted=True)
    m = topology_metrics(t)
    assert (m.bisection_links, m.bisection_cut) == (64, "x < 2")
    assert m.bisection_lower_bound_links == 57 == int(np.ceil(3 * (2 - np.sqrt(2)) * 32))
    src, dst = t.link_endpoints()
    half = t.all_coords()[:, 2] < 4
    assert int(np.count_nonzero(half[src] & ~half[dst])) == 96


def test_the_spectral_bound_meets_the_slab_on_the_2x2x4_twisted_torus():
    """2x2x4 twisted: 16 chips; the slab x < 1 cuts 8 + 8 links and lambda_2 = 4 makes 16 a
    lower bound too: its bisection is exactly 16, twice the plain 2x2x4's 8."""
    t = build_torus((2, 2, 4), True, twisted=True)
    m = topology_metrics(t)
    assert m.bisection_links == 16 == spectral_bisection_bound(t)
    assert topology_metrics(build_torus((2, 2, 4), True)).bisection_links == 8


def test_spectral_bound_of_a_plain_torus_is_its_longest_rings():
    # lambda_2 = 2 - 2 cos(2 pi / 8) on a ring of 8; x 128 / 4 = 18.7 -> 19.
    assert spectral_bisection_bound(build_torus((4, 4, 8), True)) == 19
    # A line of 8 (no wraparound): 2 - 2 cos(pi / 8); x 64 / 4 = 2.4 -> 3.
    assert spectral_bisection_bound(build_torus((8, 8), False)) == 3


def test_all_to_all_link_load_by_hand():
    """Plain 4x4x8: one chip's z hops to the 127 others are 16 x (0+1+2+3+4+3+2+1) = 256,
    half each way: 128 on every z link, the busiest. Twisted: every class carries a sixth of
    the 440 hops (the lattice is symmetric in its three axes): 440 / 6."""
    assert all_to_all_link_load(build_torus((4, 4, 8), True)) == pytest.approx(128)
    assert all_to_all_link_load(build_torus((4, 4, 8), True, twisted=True)) == \
        pytest.approx(440 / 6)
    assert all_to_all_link_load(build_torus((8, 8), False)) is None


# -- collectives on the twisted graph ---------------------------------------------------------
def test_a_4x4x8_all_to_all_runs_within_ten_percent_of_the_papers_1_63x_twisted():
    """TPU v4 paper §2.8 (docs/reference/twisted.md): a large all-to-all on a 4x4x8 is about
    1.63x faster twisted. tpusim: 128 / (440 / 6) = 1.745 in the bandwidth limit (+7%)."""
    chip = get_chip("v4")
    v = 128 * 128 * 8 * 2**20  # 8 MiB to every chip from every chip: latency negligible
    t = {}
    for twist in (False, True):
        c = get_chip("v4")
        topo = resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                                max_pod_shape=c.max_pod_shape, shape="4x4x8", twist=twist)
        t[twist] = simulate_collective(chip=chip, topology=topo, op="all-to-all",
                                       axes="x,y,z", nbytes=v).time_s
    ratio = t[False] / t[True]
    assert ratio == pytest.approx(128 / (440 / 6), rel=1e-3)
    assert abs(ratio / 1.63 - 1) < 0.10


@pytest.mark.parametrize("op, axes, algorithm", [
    ("all-to-all", "x,y,z", "direct"),
    ("all-gather", "x,y,z", "multi-axis"),   # rings: the short axes as lines
    ("all-to-all", "x,z", "direct"),         # a 4x8 twisted plane
    ("reduce-scatter", "x", "ring"),         # a line whose wraparound leaves the group
])
def test_symmetric_and_orbit_modes_match_every_chip_simulated_on_the_twisted_graph(
        op, axes, algorithm):
    chip = get_chip("v4")
    t = _twisted("4x4x8")
    v = 128 * 4096
    fast = simulate_collective(chip=chip, topology=t, op=op, axes=axes, nbytes=v,
                               algorithm=algorithm)
    slow = simulate_collective(chip=chip, topology=t, op=op, axes=axes, nbytes=v,
                               algorithm=algorithm, mode="per-chip")
    assert fast.time_s == pytest.approx(slow.time_s, rel=1e-12)
    assert np.allclose(fast.link_bytes, slow.link_bytes)


def test_a_whole_slice_all_to_all_on_the_twisted_torus_uses_the_twisted_links():
    chip = get_chip("v4")
    t = _twisted("4x4x8")
    r = simulate_collective(chip=chip, topology=t, op="all-to-all", axes="x,y,z",
                            nbytes=128 * 4096, mode="per-chip")
    src, _ = t.link_endpoints()
    coords = t.all_coords()[src]
    wrap_x = (np.arange(len(src)) % 6 == 0) & (coords[:, 0] == 3)
    assert (r.link_bytes[: t.num_ici_links][wrap_x] > 0).all()
    # Every link carries the same bytes: the lattice is symmetric in x, y and z.
    lb = r.link_bytes[: t.num_ici_links]
    assert lb.max() == pytest.approx(lb.min())


def test_ring_algorithms_on_a_twisted_short_axis_alone_are_refused_or_run_as_a_line():
    chip = get_chip("v4")
    t = _twisted("4x4x8")
    with pytest.raises(TpusimError, match="twisted torus axis x's wraparound link lands"):
        simulate_collective(chip=chip, topology=t, op="all-gather", axes="x", nbytes=4096,
                            algorithm="bidi-ring")
    with pytest.raises(TpusimError, match="twisted torus"):
        simulate_collective(chip=chip, topology=t, op="all-to-all", axes="x", nbytes=4096,
                            algorithm="ring")
    plain = build_torus((4, 4, 8), (False, True, True), ocs=True)
    line = simulate_collective(chip=chip, topology=plain, op="all-gather", axes="x",
                               nbytes=4096 * 4, algorithm="line")
    tw = simulate_collective(chip=chip, topology=t, op="all-gather", axes="x", nbytes=4096 * 4,
                             algorithm="line")
    assert tw.time_s == pytest.approx(line.time_s)


def test_a_dead_link_on_the_twisted_torus_is_routed_around_over_the_real_graph():
    chip = get_chip("v4")
    t = _twisted("4x4x8")
    dead = Scenario(dead_links=(parse_dead_link("3,0,0:x+"),))
    r = simulate_collective(chip=chip, topology=t, op="send", src=(3, 0, 0), dst=(0, 0, 4),
                            nbytes=2**20, scenario=dead)
    assert r.detour["dead_links"] == ["(3,0,0)->(0,0,4) x+"]
    assert r.detour["longest_detour_hops"] == 3  # (3,0,0) y+ (3,1,0) x+ (0,1,4) y- (0,0,4)
    assert r.time_s > r.detour["healthy_time_s"]


def test_point_to_point_routes_on_the_twisted_torus_take_the_twisted_link():
    t = build_torus((4, 4, 8), True, twisted=True)
    cls, hops, count = route_pairs_links(t, [(t.chip_id((3, 0, 0)), t.chip_id((0, 0, 4)))])
    assert hops == 1 and list(count) == [t.ici_link_id(t.chip_id((3, 0, 0)), 0, 1)]


# -- the command line --------------------------------------------------------------------------
def _run(capsys, *argv):
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_topology_command_prints_plain_against_twisted(capsys):
    rc, out, _ = _run(capsys, "topology", "--shape", "4x4x8", "--twist")  # a v4 by default
    assert rc == 0 and out.startswith("topology 4x4x8 of v4")
    assert "twisted/plain" in out and "2.000x" in out and "1.745x" in out
    rc, out, _ = _run(capsys, "topology", "--slice", "v4-256-twisted", "--json")
    d = json.loads(out)
    assert d["plain"]["bisection_links"] == 32 and d["twisted"]["bisection_links"] == 64
    assert d["twisted"]["bisection_bytes_per_s"] == 64 * 45e9
    assert d["twisted_over_plain"]["diameter_hops"] == 0.75


def test_the_v4_pods_bisection_is_googles_24_tb_s_within_5_percent(capsys):
    """Cloud TPU's v4 page: 24 TB/s bisection bandwidth per 4096-chip pod; 16x16x16 cut in
    half crosses 2 x 256 links of 45 GB/s one way: 23.04 TB/s."""
    rc, out, _ = _run(capsys, "topology", "--slice", "v4-pod", "--json")
    assert abs(json.loads(out)["plain"]["bisection_bytes_per_s"] / 24e12 - 1) < 0.05


@pytest.mark.parametrize("argv, match", [
    (["--chip", "v4", "--shape", "4x4x4", "--twist"], "cannot twist: every side"),
    (["--chip", "v4", "--shape", "4x8x16", "--twist"], "cannot twist"),
    (["--chip", "v4", "--shape", "2x2x4", "--twist"], "not made of whole 4x4x4 cubes"),
    (["--chip", "v5e", "--shape", "4x8", "--twist"], "no optical circuit switches"),
    (["--chip", "v4", "--shape", "4x4x8", "--twist", "--wraparound", "x,y"],
     "wraps on every axis"),
    (["--slice", "v5e-16-twisted"], "no optical circuit switches"),
    (["--twist"], "give the slice as --shape"),
])
def test_a_twist_the_pod_cannot_build_is_a_one_line_error(capsys, argv, match):
    rc, out, err = _run(capsys, "topology", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and match in err


def test_results_record_the_twist_only_when_given(capsys):
    common = ["collective", "--chip", "v4", "--shape", "4x4x8", "--op", "all-to-all", "--axes",
              "x,y,z", "--bytes", "1MiB", "--json"]
    _rc, out, _ = _run(capsys, *common)
    plain = json.loads(out)["inputs"]
    _rc, out, _ = _run(capsys, *common, "--twist")
    tw = json.loads(out)["inputs"]
    assert "twist" not in plain["flags"] and "twisted" not in plain["topology"]
    assert tw["flags"]["twist"] is True and tw["topology"]["twisted"] is True
    assert tw["topology"]["name"] == "4x4x8-twisted"


def test_a_study_varies_the_twist_like_any_switch(tmp_path, capsys):
    study = tmp_path / "study.yaml"
    study.write_text("command: collective\n"
                     "base: {chip: v4, shape: 4x4x8, op: all-to-all, axes: 'x,y,z', "
                     "bytes: 64MiB}\n"
                     "grid:\n  twist: [false, true]\nmetrics: [time_s]\n")
    rc, out, err = _run(capsys, "sweep", str(study), "--workers", "1", "--out",
                        str(tmp_path / "s"))
    assert rc == 0, err
    import pandas as pd

    df = pd.read_csv(tmp_path / "s" / "results.csv")
    t = dict(zip(df["twist"], df["time_s"], strict=True))
    assert t[False] / t[True] > 1.5


def test_the_torus_plot_of_a_twisted_slice_says_where_its_wraparound_lands(tmp_path, capsys):
    rc, _out, err = _run(capsys, "collective", "--chip", "v4", "--shape", "4x4x8", "--twist",
                         "--op", "all-gather", "--axes", "x", "--bytes", "1MiB", "--plots",
                         str(tmp_path))
    assert rc == 0, err
    from sim.export.torus_plots import _wrap_words

    t = build_torus((4, 4, 8), True, twisted=True)
    assert _wrap_words(t) == "twisted: the x,y wraparound lands 4 along z"
