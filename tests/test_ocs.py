"""Slices made of 4x4x4 cubes joined by optical circuit switches (v4, v5p): which shapes a pod
can build (its cube count, not its box), which links go through a switch, and what a switched
hop's latency adds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.chips import get_chip
from sim.collectives import simulate_collective
from tests.conftest import make_topology
from topologies.errors import TpusimError


@pytest.mark.parametrize(
    "chip_name, shape, cubes",
    [
        ("v5p", "8x16x48", 96),   # longer than any side of the 16x20x28 box
        ("v5p", "4x4x140", 35),
        ("v5p", "4x4x560", 140),  # the whole pod as one line of cubes
        ("v4", "4x4x256", 64),
        ("v4", "8x8x64", 64),
    ],
)
def test_a_slice_of_whole_cubes_fits_when_its_cube_count_does(chip_name, shape, cubes):
    topo = make_topology(get_chip(chip_name), shape)
    assert topo.num_chips == 64 * cubes
    assert topo.ocs and all(topo.wraparound)


@pytest.mark.parametrize("chip_name, shape, match", [
    ("v5p", "4x4x564", "141 cubes"),            # one cube over the pod's 140
    ("v4", "4x4x260", "65 cubes"),
    ("v5p", "2x4x48", "not made of whole 4x4x4 cubes"),  # sub-cube sides keep the box rule
    ("v5e", "16x32", "does not fit"),            # no switches: the box rule
])
def test_more_cubes_than_the_pod_or_a_sub_cube_slice_over_the_box_is_refused(
        chip_name, shape, match):
    with pytest.raises(TpusimError, match=match):
        make_topology(get_chip(chip_name), shape)


def test_the_pod_box_still_bounds_a_chip_with_a_smaller_max_pod_shape():
    chip = get_chip("v5p").with_overrides(max_pod_shape=(8, 8, 8))  # 8 cubes
    assert make_topology(chip, "4x4x32").num_chips == 512
    with pytest.raises(TpusimError, match="9 cubes .* has 8"):
        make_topology(chip, "4x4x36")


def _ocs_oracle(topo) -> np.ndarray:
    """Brute force: a link goes through a switch iff its two chips sit in different cubes, or
    it is a wraparound link (the switches close the slice's rings, even a one-cube ring)."""
    src, dst = topo.link_endpoints()
    out = np.zeros(len(src), dtype=bool)
    for link in np.flatnonzero(src >= 0):
        a = (int(link) % (2 * topo.ndim)) // 2
        cs, cd = topo.coords(int(src[link])), topo.coords(int(dst[link]))
        wrap = abs(cs[a] - cd[a]) > 1 or (topo.shape[a] == 2 and (link % 2) == 1)
        out[link] = cs[a] // 4 != cd[a] // 4 or wrap
    return out


@pytest.mark.parametrize("shape", ["4x4x4", "4x4x8", "8x8x12"])
def test_switched_links_are_those_leaving_a_cube(shape):
    topo = make_topology(get_chip("v5p"), shape)
    mask = topo.ocs_link_mask()
    assert np.array_equal(mask, _ocs_oracle(topo))
    # Each cube has 6 faces of 16 chips, one outgoing link a face chip: 96 switched links out.
    cubes = topo.num_chips // 64
    assert mask.sum() == 96 * cubes
    via = topo.link_via()
    assert set(via[topo.link_mask()]) == {"cube", "ocs"}


def test_a_sub_cube_slice_and_a_v5e_pod_have_no_switched_links():
    for chip, shape in (("v5p", "2x2x4"), ("v5e", "16x16")):
        topo = make_topology(get_chip(chip), shape)
        assert not topo.ocs and not topo.ocs_link_mask().any()


def test_switched_hop_latency_adds_per_cube_crossed_and_nothing_at_its_default():
    chip = get_chip("v5p")
    topo = make_topology(chip, "4x4x8")
    base = simulate_collective(chip=chip, topology=topo, op="all-gather", axes=("z",),
                               nbytes=8 * 2**20, algorithm="ring")
    slow = chip.with_overrides(ocs_hop_latency_s=5e-6)
    res = simulate_collective(chip=slow, topology=topo, op="all-gather", axes=("z",),
                              nbytes=8 * 2**20, algorithm="ring")
    # A unidirectional ring on z (8 chips): 7 steps of one hop; the worst chip of each step
    # crosses a cube face (ceil(1/4) = 1 switched hop), so each step waits 5 us more.
    assert res.latency_s == pytest.approx(base.latency_s + 7 * 5e-6)
    assert res.time_s > base.time_s
    # A chip without the field set records no such key (results read as before it existed).
    assert "ocs_hop_latency_s" not in chip.to_dict()
    assert slow.to_dict()["ocs_hop_latency_s"] == 5e-6


def test_switched_latency_bound_is_the_worst_chip_of_a_line_of_hops():
    from topologies.groups import GroupAxis, route_latency_s

    g = GroupAxis(name="z", size=16, wraps=True, index=2, phys_size=16)
    for hops in range(1, 9):
        lat = route_latency_s((g,), (hops,), 1e-6, 1e-5, ocs_s=1.0)
        # Brute force over the start coordinate: cube faces crossed by `hops` steps.
        worst = max(sum(1 for k in range(hops) if (c + k) % 4 == 3) for c in range(16))
        assert lat == pytest.approx(hops * 1e-6 + worst)
        assert worst == math.ceil(hops / 4)


def _ocs_marks(fig) -> int:
    return sum(len(c.get_offsets()) for ax in fig.axes for c in ax.collections
               if c.get_gid() == "ocs")


def test_the_torus_plot_marks_every_link_through_a_switch_and_none_inside_a_cube():
    from sim.export.torus_plots import torus_figure

    topo = make_topology(get_chip("v4"), "4x4x8")
    util = np.linspace(0.1, 0.9, topo.num_links)  # links differ: every link drawn
    fig = torus_figure(topo, util, caption="c", what="w")
    assert _ocs_marks(fig) == int(topo.ocs_link_mask().sum()) == 2 * 96
    assert any("optical switch" in t.get_text() for t in fig.legends[0].get_texts())
    flat = make_topology(get_chip("v5e"), "4x4")
    assert _ocs_marks(torus_figure(flat, np.linspace(0.1, 0.9, flat.num_links), caption="c",
                                   what="w")) == 0
    # Drawn once per class (links alike), each class says how many of its links are switched:
    # 32 of the 128 x+ links leave a cube (the x wraparound).
    alike = torus_figure(topo, np.full(topo.num_links, 0.5), caption="c", what="w")
    texts = [t.get_text() for ax in alike.axes for t in ax.texts]
    assert any("128 links, wraps, 32 through optical switches" in t for t in texts)


def test_a_steps_link_table_counts_each_classs_links_through_the_switches():
    import sim

    def links(chip, shape, mesh):
        return sim.run(sim.TrainRequest(chip=chip, shape=shape, model="llama3-8b", seq_len=256,
                                        batch_per_chip=1, mesh=mesh,
                                        overrides={"model.num_layers": "1"})).result.links

    lk = links("v4", "4x4x8", "fsdp=128")
    topo = make_topology(get_chip("v4"), "4x4x8")
    mask = topo.ocs_link_mask()
    want = {f"{'xyz'[c // 2]}{'+-'[c % 2]}": int(mask[c::6].sum()) for c in range(6)}
    assert dict(zip(lk["link_class"], lk["ocs_links"], strict=True)) == want
    assert want == {"x+": 32, "x-": 32, "y+": 32, "y-": 32, "z+": 32, "z-": 32}
    assert "ocs_links" not in links("v5e", "2x2", "fsdp=4").columns  # no switches
