"""Tests for dead links (topologies/groups.py `DetourRouter`, sim/collectives/): routes that
need a dead link take the shortest live detour, and the collective's time, link loads and
reported detour cost match hand-computed closed forms on 1D, 2D and 3D pods."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.collectives import collective_link_loads, simulate_collective
from topologies.errors import TpusimError
from topologies.groups import DetourRouter
from topologies.scenario import scenario_from_flags
from topologies.slices import resolve_topology
from topologies.torus import build_torus

REL = 1e-9
CHIP = get_chip("v5e")
L = CHIP.ici_hop_latency_s
W = CHIP.ici_link_bytes_per_s * CHIP.ici_efficiency


def _topo(shape: str, wrap: str):
    return resolve_topology(chip_name=CHIP.name, wrap_rule=CHIP.generation_rule,
                            max_pod_shape=CHIP.max_pod_shape, shape=shape, wraparound=wrap)


# A hop latency far below the drain time (1 fs): every group starts its step together, so
# contention is the only thing a closed form has to count (latency shifts results by ~1e-11).
NO_LATENCY = dataclasses.replace(CHIP, ici_hop_latency_s=1e-15)


def _sim(topology, dead=(), chip=CHIP, **kw):
    return simulate_collective(chip=chip, topology=topology,
                               scenario=scenario_from_flags(dead_link=list(dead)), **kw)


def test_a_dead_ring_link_sends_its_hop_the_other_way_round_in_1d():
    # Unidirectional ring all-gather on 8 chips: 7 steps of one V/8 shard per link. With 0->1
    # dead, that hop goes 7 hops the other way (x- links are otherwise idle): 7L + m/W a step.
    topo = _topo("8", "all")
    v = 8 * (1 << 20)
    m = v / 8
    r = _sim(topo, ["0:x+"], op="all-gather", axes="x", nbytes=v, algorithm="ring")
    assert r.mode == "full"
    assert r.time_s == pytest.approx(7 * (7 * L + m / W), rel=REL)
    d = r.detour
    assert d["healthy_time_s"] == pytest.approx(7 * (L + m / W), rel=REL)
    assert d["extra_time_s"] == pytest.approx(7 * 6 * L, rel=REL)
    assert d["rerouted_transfers"] == 7 and d["extra_hops"] == 7 * 6
    assert d["extra_link_bytes"] == pytest.approx(7 * 6 * m, rel=REL)
    assert d["longest_detour_hops"] == 7
    links = r.links.set_index("link").bytes
    assert 0 * 2 + 0 not in links.index  # the dead link carried nothing
    # The detour 0 -> 7 -> ... -> 1 uses the x- links leaving chips 0 and 7..2.
    assert all(links[c * 2 + 1] == pytest.approx(7 * m) for c in (0, 2, 3, 4, 5, 6, 7))
    assert 1 * 2 + 1 not in links.index


def test_a_dead_link_on_a_2d_torus_detours_sideways_and_shares_the_next_rows_link():
    # Ring all-gather over x on an 8x8 torus; (0,0)->(1,0) dead. The shortest detour is 3 hops
    # (y+, x+, y-; y- first is as short, the lower class wins), its x+ hop shares row 1's
    # (0,1)->(1,1) link with row 1's own ring. Without hop latency rows 0 and 1 drain that
    # link together: every step takes 2m/W. (With latency, row 1 would start 2 hops earlier.)
    topo = _topo("8x8", "all")
    v = 8 * (1 << 20)
    m = v / 8
    r = _sim(topo, ["0,0:x+"], op="all-gather", axes="x", nbytes=v, algorithm="ring",
             chip=NO_LATENCY)
    assert r.time_s == pytest.approx(7 * 2 * m / W, rel=REL)
    assert r.detour["healthy_time_s"] == pytest.approx(7 * m / W, rel=REL)
    assert r.detour["extra_hops"] == 7 * 2 and r.detour["longest_detour_hops"] == 3
    assert sorted(set(r.timeline.group)) == [0, 1, 2]  # rows 0 and 1, and one for the rest
    router = DetourRouter(topo, (topo.ici_link_id(0, 0, +1),))
    path = router.path(topo.chip_id((0, 0)), topo.chip_id((1, 0)), [0])
    assert [topo.describe_link(x) for x in path] == [
        "(0,0)->(0,1) y+", "(0,1)->(1,1) x+", "(1,1)->(1,0) y-"]
    assert r.links.set_index("link").bytes[topo.ici_link_id(topo.chip_id((0, 1)), 0, +1)] == (
        pytest.approx(2 * 7 * m))


def test_a_dead_link_on_a_3d_torus_detours_through_the_neighbouring_column():
    # Ring all-gather over z on a 4x4x4 torus with (0,0,0)->(0,0,1) dead: x+, z+, x- (3 hops);
    # column (1,0)'s z+ link then carries two shards: 3 steps of 3L + 2m/W.
    topo = build_torus((4, 4, 4), (True, True, True))  # v5e link constants, a 3D torus
    v = 4 * (1 << 20)
    m = v / 4
    r = _sim(topo, ["0,0,0:z+"], op="all-gather", axes="z", nbytes=v, algorithm="ring",
             chip=NO_LATENCY)
    assert r.time_s == pytest.approx(3 * 2 * m / W, rel=REL)
    assert r.detour["healthy_time_s"] == pytest.approx(3 * m / W, rel=REL)
    assert r.detour["extra_link_bytes"] == pytest.approx(3 * 2 * m, rel=REL)


DEAD_CASES = {
    "1D ring": ("8", (True,), "x", "ring", ["0:x+"]),
    "1D ring, bidi": ("8", (True,), "x", "bidi-ring", ["3:x-"]),
    "2D torus": ("8x8", (True, True), "x", "ring", ["0,0:x+"]),
    "2D torus, two axes": ("4x4", (True, True), "x,y", "multi-axis", ["1,1:x+", "2,3:y-"]),
    "2D mesh, line": ("4x4", (False, False), "x", "line", ["1,0:x+"]),
    "3D torus": ("4x4x4", (True, True, True), "z", "per-axis-ring", ["0,0,0:z+"]),
}


@pytest.mark.parametrize("case", DEAD_CASES)
def test_with_dead_links_full_mode_agrees_with_per_chip_mode(case):
    shape, wrap, axes, alg, dead = DEAD_CASES[case]
    topo = build_torus(tuple(int(n) for n in shape.split("x")), wrap)
    group = int(np.prod([topo.axis_size(a) for a in axes.split(",")]))
    kw = dict(op="all-reduce", axes=axes, nbytes=group * 8192, algorithm=alg)
    fast = _sim(topo, dead, **kw)
    brute = _sim(topo, dead, mode="per-chip", **kw)
    assert fast.mode == "full" and brute.mode == "per-chip"
    assert brute.time_s == pytest.approx(fast.time_s, rel=REL)
    np.testing.assert_allclose(brute.link_bytes, fast.link_bytes, rtol=REL, atol=0)
    assert brute.detour["extra_hops"] == fast.detour["extra_hops"] > 0
    assert fast.time_s > fast.detour["healthy_time_s"]


def test_a_long_route_takes_the_shorter_way_round_not_a_local_patch():
    # On a 1D ring of 8, 0 -> 3 with 0->1 dead: 5 hops the other way, not 7 + 2.
    topo = build_torus((8,), (True,))
    router = DetourRouter(topo, (topo.ici_link_id(0, 0, +1),))
    assert len(router.path(0, 3, [0])) == 5
    res = np.array([0, 2, 4], dtype=np.int64)  # 0->1->2->3 on x+
    new_res, new_ptr, moved = router.reroute(res, np.array([0, 3]), np.array([1.0]), repeat=2)
    assert list(moved) == [0] and new_ptr[-1] == 5
    assert router.extra_hops == 2 * 2 and router.rerouted_transfers == 2


def test_a_send_avoids_the_dead_one_of_its_two_minimal_paths():
    topo = _topo("4x4", "all")
    v = 1 << 20
    healthy = _sim(topo, op="send", src=(0, 0), dst=(1, 1), nbytes=v)
    dead = _sim(topo, ["0,0:x+"], op="send", src=(0, 0), dst=(1, 1), nbytes=v)
    assert healthy.time_s == pytest.approx(2 * L + v / (2 * W), rel=REL)  # split over 2 paths
    assert dead.time_s == pytest.approx(2 * L + v / W, rel=REL)  # only y-then-x is left
    assert dead.detour["extra_time_s"] == pytest.approx(v / (2 * W), rel=REL)


def test_a_dead_link_outside_the_groups_axes_changes_nothing():
    topo = _topo("8x4", "all")
    kw = dict(op="all-reduce", axes="x", nbytes=8 * 4096, algorithm="bidi-ring")
    base = simulate_collective(chip=CHIP, topology=topo, **kw)
    r = _sim(topo, ["0,0:y+", "3,2:y-"], **kw)
    assert r.mode == "symmetric" and r.time_s == base.time_s and r.detour is None


def test_dead_links_that_cut_a_line_are_a_disconnection_error():
    topo = _topo("8", "none")
    with pytest.raises(TpusimError, match=r"disconnect chip \(3\) from \(4\).*remove a"):
        _sim(topo, ["3:x+"], op="all-gather", axes="x", nbytes=8 * 1024, algorithm="line")


def test_disconnection_is_one_cli_line_exit_2(capsys):
    rc = main(["collective", "--chip", "v5e", "--shape", "4x4", "--wraparound", "none",
               "--op", "all-gather", "--axes", "x,y", "--bytes", "16KiB",
               "--dead-link", "0,0:x+", "--dead-link", "0,0:y+"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: dead links ") and err.count("\n") == 1


def test_dead_link_cost_is_in_the_cli_json(capsys):
    rc = main(["collective", "--chip", "v5e", "--shape", "8", "--wraparound", "all", "--op",
               "all-gather", "--axes", "x", "--bytes", "8MiB", "--algorithm", "ring",
               "--dead-link", "0:x+", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    d = json.loads(out)["detour"]
    assert d["dead_links"] == ["(0)->(1) x+"]
    assert d["extra_time_s"] == pytest.approx(42 * L, rel=REL)


def test_engine_gets_per_group_times_and_link_loads_under_a_dead_link():
    topo = _topo("8x8", "all")
    v = 8 * (1 << 20)
    sc = scenario_from_flags(dead_link=["0,0:x+"])
    kw = dict(chip=CHIP, topology=topo, op="all-gather", gaxes="x", nbytes=v, algorithm="ring",
              scenario=sc)
    fast = collective_link_loads(**kw)
    brute = collective_link_loads(mode="per-chip", **kw)
    healthy = simulate_collective(chip=CHIP, topology=topo, op="all-gather", axes="x",
                                  nbytes=v, algorithm="ring").time_s
    np.testing.assert_allclose(fast.time_s_per_group, brute.time_s_per_group, rtol=REL)
    np.testing.assert_allclose(fast.link_bytes, brute.link_bytes, rtol=REL, atol=0)
    # Row 0 detours, row 1 carries the detour; rows 2..7 run as on the healthy pod.
    assert np.all(fast.time_s_per_group[:2] > healthy)
    assert fast.time_s_per_group[2:] == pytest.approx(np.full(6, healthy), rel=REL)
    assert fast.time_s_per_group.max() == fast.result.time_s


def test_a_detour_avoids_dead_links_on_other_axes_too():
    # x+ and y+ out of (0,0) dead on an 8x8 torus: the x ring's hop (0,0)->(1,0) detours
    # through y- (the other sideways direction; 3 hops against 7 the other way round), and
    # nothing crosses the dead y+ link.
    topo = _topo("8x8", "all")
    r = _sim(topo, ["0,0:x+", "0,0:y+"], op="all-gather", axes="x", nbytes=8 * 4096,
             algorithm="ring")
    links = r.links.set_index("link").bytes
    assert topo.ici_link_id(0, 0, +1) not in links.index
    assert topo.ici_link_id(0, 1, +1) not in links.index
    assert links[topo.ici_link_id(0, 1, -1)] > 0  # (0,0) -> (0,3) y-
    assert r.detour["longest_detour_hops"] == 3


def test_outputs_of_a_collective_with_a_dead_link_are_written_without_nan(capsys, tmp_path):
    import warnings

    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no 0/0 on the dead link's capacity
        rc = main(["collective", "--chip", "v5e", "--shape", "4x4", "--wraparound", "all",
                   "--op", "all-gather", "--axes", "x", "--bytes", "64KiB", "--algorithm",
                   "ring", "--dead-link", "0,0:x+", "--out", str(tmp_path / "o"), "--plots",
                   str(tmp_path / "p")])
    capsys.readouterr()
    assert rc == 0
    links = pd.read_csv(tmp_path / "o" / "links.csv")
    assert links.utilization.notna().all() and (links.utilization <= 1 + 1e-9).all()
    assert "(0, 0)" not in set(links[(links.axis == "x") & (links.direction == "+")].src)
    assert (tmp_path / "p" / "links_on_torus.png").is_file()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["detour"]["rerouted_transfers"] == 3
