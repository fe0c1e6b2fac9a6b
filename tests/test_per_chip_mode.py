"""Tests for `--mode per-chip` collectives (sim/collectives/): every chip of every group
and every link simulated must agree with the fast modes (one representative chip on link
classes, or one representative group link by link) wherever they apply."""

from __future__ import annotations

import numpy as np
import pytest

from sim.chips import get_chip
from sim.collectives import CollectiveKind, algorithm_names, simulate_collective
from topologies.errors import TpusimError
from topologies.slices import resolve_topology

REL = 1e-9
PODS = {  # name: (chip, shape, wraparound, slices, axes to try)
    "2x2 wrapped": ("v5e", "2x2", "all", 1, ("x", "x,y")),
    "4x4 wrapped": ("v5e", "4x4", "all", 1, ("y", "x,y")),
    "4x4 unwrapped": ("v5e", "4x4", "none", 1, ("x", "x,y")),
    "4x4x4 wrapped": ("v5p", "4x4x4", "all", 1, ("z", "x,y,z")),
    "4x4x4 unwrapped": ("v5p", "4x4x4", "none", 1, ("x,y,z",)),
    "2 slices of 2x2": ("v5e", "2x2", "all", 2, ("x", "x,dcn")),
}
KINDS = [k for k in CollectiveKind if k != CollectiveKind.SEND]


def _topo(chip: str, shape: str, wrap: str, slices: int):
    c = get_chip(chip)
    return resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape, shape=shape, wraparound=wrap,
                            num_slices=slices)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pod", PODS)
def test_per_chip_mode_agrees_with_the_fast_modes(pod, kind):
    chip_name, shape, wrap, slices, axes_list = PODS[pod]
    chip = get_chip(chip_name)
    topology = _topo(chip_name, shape, wrap, slices)
    compared = 0
    for axes in axes_list:
        group = int(np.prod([topology.axis_size(a) for a in axes.split(",")]))
        for alg in algorithm_names(kind):
            kw = dict(chip=chip, topology=topology, op=kind, axes=axes,
                      nbytes=group * group * 4096, algorithm=alg)
            try:
                fast = simulate_collective(**kw)
            except TpusimError as exc:
                with pytest.raises(TpusimError, match=str(exc)[:30].replace("(", ".")):
                    simulate_collective(mode="per-chip", **kw)
                continue
            brute = simulate_collective(mode="per-chip", **kw)
            assert brute.mode == "per-chip" and fast.mode in ("symmetric", "full")
            assert brute.time_s == pytest.approx(fast.time_s, rel=REL), (axes, alg)
            np.testing.assert_allclose(brute.link_bytes, fast.link_bytes, rtol=REL, atol=0)
            assert brute.hbm_bytes_per_chip == pytest.approx(fast.hbm_bytes_per_chip, rel=REL)
            assert brute.max_link_utilization == pytest.approx(fast.max_link_utilization,
                                                               rel=REL)
            compared += 1
    # A shift needs a ring: collective-permute does not apply to a pod without wraparound.
    assert compared > 0 or (kind == CollectiveKind.PERMUTE and wrap == "none")


def test_per_chip_mode_simulates_every_group_for_itself():
    topology = _topo("v5e", "4x4", "none", 1)
    r = simulate_collective(chip=get_chip("v5e"), topology=topology, op="all-gather", axes="x",
                            nbytes=4 * 1024, algorithm="line", mode="per-chip")
    # Every one of the 4 row groups has its own timeline, standing for its own 4 chips.
    assert set(r.timeline.group) == {0, 1, 2, 3}
    assert set(r.timeline.chips_represented) == {4}
    # Every one of the 4 rows' 3+3 line links carried bytes.
    assert len(r.links) == 4 * 6
