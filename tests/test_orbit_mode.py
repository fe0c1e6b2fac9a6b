"""Orbit mode: strided replica groups simulated on the representatives of the pod's translation
symmetry (`sim.collectives.orbits.orbit_periods`) must give exactly what the whole pod gives
link by link (`--mode full`) and what every group gives for itself (`--mode per-chip`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.chips import get_chip
from sim.collectives import build_schedule, collective_link_loads, simulate_collective
from sim.collectives.orbits import orbit_periods
from topologies.errors import TpusimError
from topologies.groups import axis_factor
from topologies.slices import resolve_topology

REL = 1e-9
OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
ALGS = ("auto", "ring", "bidi-ring", "split-bidi-ring", "line", "multi-axis", "per-axis-ring",
        "hierarchical", "halving-doubling", "direct")


def _topo(chip: str, shape: str, wrap: str, slices: int = 1):
    c = get_chip(chip)
    return resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape, shape=shape, wraparound=wrap,
                            num_slices=slices)


def _factors(topology, spec: str):
    """`x:2@2,y:4@1` -> group axes (size@stride per physical axis)."""
    out = []
    for part in spec.split(","):
        axis, rest = part.split(":")
        size, stride = rest.split("@")
        out.append(axis_factor(topology, axis, int(size), int(stride)))
    return tuple(out)


def _rel(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30), initial=0.0))


def _assert_same(chip, topology, op, gaxes, nbytes, algorithm) -> str:
    """Orbit (auto mode) against the whole pod link by link; returns the mode auto used."""
    kw = dict(chip=chip, topology=topology, op=op, axes=gaxes, nbytes=nbytes,
              algorithm=algorithm)
    a = simulate_collective(**kw)
    b = simulate_collective(**kw, mode="full")
    assert a.algorithm == b.algorithm
    for field in ("time_s", "latency_s", "hbm_bytes_per_chip", "bytes_on_busiest_link",
                  "max_link_utilization"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=REL, abs=1e-300), field
    assert _rel(a.link_bytes, b.link_bytes) <= REL
    assert _rel(a.link_busy_s, b.link_busy_s) <= REL
    return a.mode


def test_a_strided_pair_on_a_line_takes_the_closed_form_time_in_orbit_mode():
    """x:2@2 on an 8-chip line: chip 0 sends to 2 and chip 1 to 3 (V/2 each, two hops), so the
    x+ link 1->2 carries both: the step takes 2 hops of latency plus V / link bandwidth."""
    chip = get_chip("v5e")
    topology = _topo("v5e", "8x4", "none")
    gaxes = _factors(topology, "x:2@2")
    v = 2 * 3 * 2**20
    r = simulate_collective(chip=chip, topology=topology, op="all-gather", axes=gaxes,
                            nbytes=v, algorithm="line")
    assert r.mode == "orbit"
    assert len(set(r.timeline.group)) == 2  # (0,0),(2,0) and (1,0),(3,0) stand for all
    assert r.timeline.chips_represented.sum() / r.num_steps == topology.num_chips
    bw = chip.ici_link_bytes_per_s * chip.ici_efficiency
    assert r.time_s == pytest.approx(2 * chip.ici_hop_latency_s + v / bw, rel=REL)
    assert r.bytes_on_busiest_link == pytest.approx(v, rel=REL)
    _assert_same(chip, topology, "all-gather", gaxes, v, "line")


@pytest.mark.parametrize("chip_name,shape,wrap,slices,spec,periods", [
    ("v5e", "8x4", "none", 1, "x:2@2", (4, 1)),  # middle factor: blocks of 4 along x
    ("v5e", "4x4", "all", 1, "x:2@2", (2, 1)),   # outer ring of 2, stride 2: shift by 2
    ("v5e", "4x4", "none", 1, "x:2@2", (4, 1)),  # the whole line along x; y: any shift
    ("v5e", "4x4", "none", 1, "x:2@2,y:4@1", None),  # whole lines both ways: no symmetry
    ("v5e", "8x8", "all", 1, "x:2@2,y:2@1", (4, 2)),
    ("v5e", "8x4", "all", 2, "x:2@2,dcn:2@1", (4, 1, 1)),
])
def test_orbit_periods_follow_the_blocks_and_rings_of_the_group(chip_name, shape, wrap, slices,
                                                                spec, periods):
    topology = _topo(chip_name, shape, wrap, slices)
    gaxes = _factors(topology, spec)
    sched = build_schedule("all-gather", gaxes, float(2**20), "per-axis-ring")
    assert orbit_periods(topology, gaxes, sched) == periods


def test_a_ring_whose_moves_depend_on_the_position_has_no_orbit_along_it():
    """halving-doubling picks moves by a coordinate bit: shifting along the ring changes them."""
    topology = _topo("v5e", "8x4", "all")
    gaxes = _factors(topology, "x:4@2")
    assert orbit_periods(topology, gaxes, build_schedule(
        "all-reduce", gaxes, float(2**20), "ring")) == (2, 1)
    assert orbit_periods(topology, gaxes, build_schedule(
        "all-reduce", gaxes, float(2**20), "halving-doubling")) == (8, 1)


@pytest.mark.parametrize("chip_name,shape,wrap,slices,spec", [
    ("v5e", "8x4", "none", 1, "x:2@2"),
    ("v5e", "4x4", "all", 1, "x:2@2"),
    ("v5e", "8x8", "all", 1, "x:4@2,y:2@1"),
    ("v5e", "8x8", "none", 1, "x:2@4,y:2@2"),
    ("v5p", "4x4x4", "auto", 1, "x:2@2,z:2@1"),
    ("v5e", "4x4", "all", 2, "x:2@2,y:2@1,dcn:2@1"),
    ("v5e", "8x4", "all", 1, "x:8@1,y:2@1"),  # disjoint groups: a ring and a line segment
])
def test_orbit_mode_equals_the_whole_pod_link_by_link_for_every_algorithm(chip_name, shape, wrap,
                                                                         slices, spec):
    chip = get_chip(chip_name)
    topology = _topo(chip_name, shape, wrap, slices)
    gaxes = _factors(topology, spec)
    n = int(np.prod([g.size for g in gaxes]))
    modes = set()
    for op in OPS:
        for alg in ALGS if op != "collective-permute" else ("auto",):
            try:
                modes.add(_assert_same(chip, topology, op, gaxes, n * 3 * 4096, alg))
            except TpusimError:
                continue  # the algorithm refuses this group (both modes alike)
    assert "orbit" in modes


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_strided_placements_agree_with_every_group_simulated(data):
    """Property: any digit-aligned choice of factors, any op, auto: the orbit result equals
    `--mode full`, and every group's finish time equals `--mode per-chip`'s."""
    chip_name, shape, wrap, slices = data.draw(st.sampled_from([
        ("v5e", "4x4", "all", 1), ("v5e", "4x4", "none", 1), ("v5e", "8x4", "all", 1),
        ("v5e", "8x4", "none", 1), ("v5p", "4x4x4", "auto", 1), ("v5e", "4x4", "all", 2)]))
    chip = get_chip(chip_name)
    topology = _topo(chip_name, shape, wrap, slices)
    axes = ["x", "y", "z"][:topology.ndim] + (["dcn"] if slices > 1 else [])
    gaxes = []
    for a in axes:
        n = topology.axis_size(a)
        digits = []  # cut the axis into digits of size 2 or 4, keep a random subset
        pos = 1
        while pos < n:
            k = data.draw(st.sampled_from([k for k in (2, 4) if (n // pos) % k == 0]))
            digits.append((k, pos))
            pos *= k
        for k, stride in digits:
            if data.draw(st.booleans()):
                gaxes.append(axis_factor(topology, a, k, stride))
    if all(g.stride == 1 for g in gaxes):  # make the groups interleave along x
        gaxes = [g for g in gaxes if g.physical_name != "x"] + [axis_factor(topology, "x", 2, 2)]
    op = data.draw(st.sampled_from(OPS))
    if op == "collective-permute":  # a shift along one axis (as the step engine costs it)
        strided = [g for g in gaxes if g.stride > 1]
        gaxes = strided[:1]
    gaxes = tuple(gaxes)
    n = int(np.prod([g.size for g in gaxes]))
    v = n * data.draw(st.integers(1, 64)) * 1024
    _assert_same(chip, topology, op, gaxes, v, "auto")
    a = collective_link_loads(chip=chip, topology=topology, op=op, gaxes=gaxes, nbytes=v)
    b = collective_link_loads(chip=chip, topology=topology, op=op, gaxes=gaxes, nbytes=v,
                              mode="per-chip")
    assert _rel(a.time_s_per_group, b.time_s_per_group) <= REL


def test_a_group_too_large_to_route_whole_is_simulated_on_its_orbit_representatives(monkeypatch):
    """direct all-to-all over x (a ring) + a segment of y: full mode routes one whole group
    (16 chips x 15 moves), orbit mode 2 chips' moves (x shifts leave it unchanged). With the
    routing limit between the two, full mode refuses and auto still gives full mode's answer."""
    import sim.collectives.routing as routing

    chip = get_chip("v5e")
    topology = _topo("v5e", "8x4", "all")
    gaxes = _factors(topology, "x:8@1,y:2@1")
    kw = dict(chip=chip, topology=topology, op="all-to-all", axes=gaxes, nbytes=16 * 16 * 4096,
              algorithm="direct")
    whole = simulate_collective(**kw, mode="full")
    monkeypatch.setattr(routing, "MAX_FULL_TRANSFERS", 100)
    with pytest.raises(TpusimError, match="would route"):
        simulate_collective(**kw, mode="full")
    r = simulate_collective(**kw)
    assert r.mode == "orbit"
    assert r.time_s == pytest.approx(whole.time_s, rel=REL)
    assert _rel(r.link_bytes, whole.link_bytes) <= REL


def _link_slices(res) -> dict[tuple, float]:
    """{(link track, start ps, end ps, stream, step): bytes} over every process of a
    collective's Perfetto trace (lanes folded into their link's track)."""
    from sim.export.perfetto import _collective_processes

    out: dict[tuple, float] = {}
    for _name, tracks in _collective_processes(res):
        for track, rows in tracks.items():
            if track.startswith("ICI link "):
                for t0, t1, _label, args, _i in rows:
                    key = (track.split(" lane ")[0], round(t0 * 1e12), round(t1 * 1e12),
                           args["stream"], args["step"])
                    out[key] = out.get(key, 0.0) + args["bytes"]
    return out


@pytest.mark.parametrize("shape,wrap,slices,spec,op,alg", [
    ("8x4", "none", 1, "x:2@2", "all-gather", "line"),
    ("8x8", "all", 1, "x:4@2,y:2@1", "all-gather", "auto"),
    ("4x4", "all", 2, "x:2@2,y:2@1,dcn:2@1", "all-reduce", "auto"),
])
def test_orbit_mode_perfetto_link_tracks_equal_the_whole_pods_link_by_link(shape, wrap, slices,
                                                                          spec, op, alg):
    """Every link any group of the pod loads has its track, with the same slices (times,
    stream, step) and bytes as `--mode full` summed over the groups: not only the links of the
    representative chips' routes."""
    chip = get_chip("v5e")
    topology = _topo("v5e", shape, wrap, slices)
    gaxes = _factors(topology, spec)
    kw = dict(chip=chip, topology=topology, op=op, axes=gaxes, nbytes=3 * 4096 * 64,
              algorithm=alg)
    orbit, full = simulate_collective(**kw), simulate_collective(**kw, mode="full")
    assert orbit.mode == "orbit"
    got, want = _link_slices(orbit), _link_slices(full)
    assert set(got) == set(want)
    assert all(got[k] == pytest.approx(want[k], rel=REL) for k in want)
    # Every link the pod loads has a track (under the 512-track cap here).
    assert len({k[0] for k in got}) == int(np.count_nonzero(full.link_bytes))
