"""Tests for topologies/torus.py and topologies/slices.py: tables named by shape (links, the
wraparound rule of each generation, size-1 and size-2 axes), the networkx view against our own
link numbering and dimension-order routes, named slices, --wraparound overrides, multi-slice
pods, and every way a pod description can be wrong (reference/tpu.md §1.3, slices.md).
"""

from __future__ import annotations

import random

import networkx as nx
import numpy as np
import pytest

from sim.chips import get_chip
from sim.collectives.routing import link_model, send_batch
from topologies.errors import TpusimError
from topologies.slices import SLICES, default_wraparound, resolve_topology
from topologies.torus import build_torus, parse_shape, parse_wraparound

T, F = True, False

# name -> (chip, shape, --wraparound, expected wraparound per axis, expected directed ICI links)
# Links: an axis of n > 1 chips contributes 2N links if it wraps, else 2N(n-1)/n (N = chips).
SHAPES = {
    "2x2": ("v5e", "2x2", "auto", (F, F), 8),
    "4x4": ("v5e", "4x4", "auto", (F, F), 48),
    "8x4": ("v5e", "8x4", "auto", (F, F), 56 + 48),
    "8x16": ("v5e", "8x16", "auto", (F, T), 224 + 256),
    "16x16": ("v5e", "16x16", "auto", (T, T), 1024),
    "v6e 16x16": ("v6e", "16x16", "auto", (T, T), 1024),
    "v6e 4x8": ("v6e", "4x8", "auto", (F, F), 48 + 56),
    "16": ("v5e", "16", "auto", (T,), 32),
    "4x4x4": ("v5p", "4x4x4", "auto", (T, T, T), 384),
    "v4 4x4x8": ("v4", "4x4x8", "auto", (T, T, T), 768),
    "2x4x4": ("v5p", "2x4x4", "auto", (F, F, F), 32 + 48 + 48),
    "v4 2x2x4": ("v4", "2x2x4", "auto", (F, F, F), 16 + 16 + 24),
    "16x20x28": ("v5p", "16x20x28", "auto", (T, T, T), 2 * 8960 * 3),
    "8x1": ("v5e", "8x1", "auto", (F, F), 14),
    "8x1 wrapped": ("v5e", "8x1", "all", (T, F), 16),
    "1x8": ("v5e", "1x8", "auto", (F, F), 14),
    "1x8 wrapped": ("v5e", "1x8", "all", (F, T), 16),
    "2x2 wrapped": ("v5e", "2x2", "all", (T, T), 16),
    "4x4x4 none": ("v5p", "4x4x4", "none", (F, F, F), 288),
    "4x4x4 x,z": ("v5p", "4x4x4", "x,z", (T, F, T), 128 + 96 + 128),
    "4x4 y": ("v5e", "4x4", "y", (F, T), 24 + 32),
}


def _build(name: str):
    chip_name, shape, wrap, _, _ = SHAPES[name]
    chip = get_chip(chip_name)
    return resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        shape=shape, wraparound=wrap,
    )


@pytest.mark.parametrize("name", SHAPES)
def test_wraparound_follows_the_generation_rule_or_the_override(name):
    assert _build(name).wraparound == SHAPES[name][3]


@pytest.mark.parametrize("name", SHAPES)
def test_number_of_directed_links(name):
    topology = _build(name)
    expected = SHAPES[name][4]
    assert int(topology.link_mask().sum()) == expected
    n = topology.num_chips
    formula = sum(
        (2 * n if w else 2 * n * (a - 1) // a)
        for a, w in zip(topology.shape, topology.wraparound, strict=True)
        if a > 1
    )
    assert formula == expected


@pytest.mark.parametrize("name", SHAPES)
def test_every_link_joins_neighbours_along_its_own_axis(name):
    topology = _build(name)
    src, dst = topology.link_endpoints()
    ok = np.flatnonzero(src >= 0)
    coords = topology.all_coords()
    ndim = topology.ndim
    axis = (ok % (2 * ndim)) // 2
    step = np.where(ok % 2 == 0, 1, -1)
    a, b = coords[src[ok]], coords[dst[ok]]
    moved = np.arange(ndim)[None, :] == axis[:, None]
    assert np.all(a[~moved] == b[~moved])  # the other coordinates do not change
    size = np.asarray(topology.shape)[axis]
    assert np.all((a[moved] + step) % size == b[moved] % size)
    assert np.all(src[ok] == ok // (2 * ndim))  # a link belongs to its source chip


@pytest.mark.parametrize("name", ["8x1", "8x1 wrapped", "1x8", "1x8 wrapped"])
def test_size_one_axis_has_no_links_and_no_self_loops(name):
    topology = _build(name)
    one = topology.shape.index(1)
    ids = np.arange(topology.num_ici_links)
    on_axis = (ids % (2 * topology.ndim)) // 2 == one
    assert not topology.link_mask()[on_axis].any()
    assert not topology.wraparound[one]  # wraparound on a size-1 axis is dropped
    assert nx.number_of_selfloops(topology.graph()) == 0


def test_wrapped_size_two_axis_has_two_distinct_links_each_way():
    topology = _build("2x2 wrapped")
    g = topology.graph()
    a, b = (0, 0), (1, 0)
    forward = g.get_edge_data(a, b)
    backward = g.get_edge_data(b, a)
    assert len(forward) == 2 and len(backward) == 2
    assert {d["direction"] for d in forward.values()} == {"+", "-"}
    assert len(set(forward) | set(backward)) == 4  # four different link ids


def test_unwrapped_size_two_axis_has_one_link_each_way():
    g = _build("2x2").graph()
    assert len(g.get_edge_data((0, 0), (1, 0))) == 1
    assert len(g.get_edge_data((1, 0), (0, 0))) == 1


@pytest.mark.parametrize("name", SHAPES)
def test_networkx_graph_matches_our_links_and_dimension_order_hops_are_shortest(name):
    # One test per shape so the (cached) graph of the 8960-chip pod is built only once.
    topology = _build(name)
    g = topology.graph()
    assert g.number_of_nodes() == topology.num_chips
    assert g.number_of_edges() == int(topology.link_mask().sum())
    src, dst = topology.link_endpoints()
    for u, v, key in list(g.edges(keys=True))[:200]:
        assert topology.coords(int(src[key])) == u
        assert topology.coords(int(dst[key])) == v
    lm = link_model(get_chip(SHAPES[name][0]), topology, {})
    rng = random.Random(1234)
    pairs = [(0, topology.num_chips - 1)]
    pairs += [tuple(rng.sample(range(topology.num_chips), 2)) for _ in range(12)]
    for s, d in pairs:
        a, b = topology.coords(s), topology.coords(d)
        batch, num_paths, hops = send_batch(topology, lm, a, b, 1024.0)
        expected = nx.shortest_path_length(g, a, b)
        assert hops == expected, (a, b)
        assert set(np.diff(batch.ptr).tolist()) == {expected}  # every path is minimal
        assert num_paths >= 1


# -- named slices ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slice_name, shape, wrap",
    [
        ("v5p-128", (4, 4, 4), (T, T, T)),
        ("v5p-64", (2, 4, 4), (F, F, F)),
        ("v5p-8", (2, 2, 1), (F, F, F)),
        ("v4-8192", (16, 16, 16), (T, T, T)),
        ("v4-384", (4, 4, 12), (T, T, T)),
        ("v5e-256", (16, 16), (T, T)),
        ("v5e-128", (8, 16), (F, T)),
        ("v5e-16", (4, 4), (F, F)),
        ("v5litepod-256", (16, 16), (T, T)),
        ("v6e-256", (16, 16), (T, T)),
        ("v5p-pod", (16, 20, 28), (T, T, T)),
    ],
)
def test_named_slice_resolves_to_its_shape_and_wraparound(slice_name, shape, wrap):
    spec = SLICES.get(slice_name)
    chip = get_chip(spec.chip)
    topology = resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        slice_name=slice_name,
    )
    assert topology.shape == shape
    assert topology.wraparound == wrap
    assert topology.num_chips == int(np.prod(shape))


def test_v5p_128_is_64_chips_and_v5e_256_is_256():
    assert SLICES.get("v5p-128").num_chips == 64
    assert SLICES.get("v5e-256").num_chips == 256


@pytest.mark.parametrize("name", SLICES.names())
def test_slice_names_count_cores_for_v4_v5p_and_chips_for_v5e_v6e(name):
    spec = SLICES.get(name)
    tail = name.rsplit("-", 1)[1]
    if not tail.isdigit():
        return  # v5p-pod, v4-pod
    per_chip = 2 if spec.chip in ("v4", "v5p") else 1
    assert int(tail) == per_chip * spec.num_chips
    chip = get_chip(spec.chip)
    assert len(spec.shape) == chip.num_dims
    assert all(n <= m for n, m in zip(sorted(spec.shape), sorted(chip.max_pod_shape),
                                      strict=True))


@pytest.mark.parametrize(
    "rule, shape, expected",
    [
        ("cube", (4, 4, 4), (T, T, T)),
        ("cube", (4, 4, 8), (T, T, T)),
        ("cube", (16, 20, 28), (T, T, T)),
        ("cube", (2, 2, 2), (F, F, F)),
        ("cube", (2, 4, 4), (F, F, F)),
        ("cube", (4, 4, 6), (F, F, F)),
        ("cube", (4, 4), (F, F)),
        ("full-axis", (16, 16), (T, T)),
        ("full-axis", (8, 16), (F, T)),
        ("full-axis", (4, 4), (F, F)),
        ("full-axis", (16,), (T,)),
    ],
)
def test_default_wraparound_rule(rule, shape, expected):
    assert default_wraparound(rule, shape) == expected


def test_slice_with_explicit_shape_of_the_same_size_is_allowed():
    chip = get_chip("v5p")
    topology = resolve_topology(
        chip_name="v5p", wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        slice_name="v5p-128", shape="2x4x8",
    )
    assert topology.shape == (2, 4, 8)
    assert topology.wraparound == (F, F, F)  # not whole cubes


# -- --wraparound parsing ------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, shape, expected",
    [
        ("auto", (4, 4, 4), None),
        ("none", (4, 4, 4), (F, F, F)),
        ("all", (4, 4), (T, T)),
        ("x,z", (4, 4, 4), (T, F, T)),
        ("xz", (4, 4, 4), (T, F, T)),
        (" Y ", (4, 4), (F, T)),
    ],
)
def test_parse_wraparound(text, shape, expected):
    assert parse_wraparound(text, shape) == expected


@pytest.mark.parametrize("text, shape", [("q", (4, 4)), ("z", (4, 4)), ("", (4, 4)),
                                         ("x,w", (4, 4, 4)), ("x,,y", (4, 4, 4)),
                                         ("x,", (4, 4)), ("xx", (4, 4)), ("x,x", (4, 4)),
                                         ("x,yz", (4, 4, 4))])
def test_bad_wraparound_letters_are_refused(text, shape):
    with pytest.raises(TpusimError, match="^wraparound "):
        parse_wraparound(text, shape)


def test_build_torus_drops_wraparound_on_size_one_axes():
    assert build_torus((1, 8, 1), True).wraparound == (F, T, F)


# -- multi-slice ------------------------------------------------------------------------------
@pytest.mark.parametrize("slices", [2, 3, 4])
def test_multi_slice_counts_chips_and_dcn_links(topo, v5e, slices):
    topology = topo(v5e, "4x4", "all", slices)
    assert topology.num_chips == 16 * slices
    assert topology.chips_per_slice == 16
    assert topology.axis_names == ("x", "y", "dcn")
    assert topology.axis_size("dcn") == slices
    assert topology.num_links == topology.num_ici_links + 2 * topology.num_chips
    assert int(topology.link_mask().sum()) == 64 * slices  # ICI links stay inside slices
    assert topology.name == f"{slices}x(4x4)"


def test_multi_slice_coordinates_round_trip(topo, v5p):
    topology = topo(v5p, "2x2x4", slices=3)
    for chip in range(topology.num_chips):
        c = topology.coords(chip)
        assert len(c) == 4 and c[3] == chip // 16
        assert topology.chip_id(c) == chip


def test_single_slice_has_no_dcn_axis(topo, v5e):
    topology = topo(v5e, "4x4")
    assert topology.axis_names == ("x", "y")
    assert topology.num_links == topology.num_ici_links


# -- errors ---------------------------------------------------------------------------------
def _resolve(chip_name: str, **kw):
    chip = get_chip(chip_name)
    return resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        **kw,
    )


def test_unknown_slice_suggests_the_nearest_names_not_the_whole_list():
    with pytest.raises(TpusimError, match="unknown slice 'v5p-999'.*v5p-512 .*v5p-1024 ") as e:
        _resolve("v5p", slice_name="v5p-999")
    assert "v5p-128" not in str(e.value) and len(str(e.value)) < 250
    with pytest.raises(TpusimError, match="did you mean v5e-256") as e:
        _resolve("v5e", slice_name="v5e256")
    assert len(str(e.value)) < 250 and "\n" not in str(e.value)


def test_slice_named_by_its_chip_count_explains_the_tensorcore_count():
    # The whole v5p pod has 8960 chips = 17920 TensorCores; v5p-N counts TensorCores.
    with pytest.raises(TpusimError) as e:
        _resolve("v5p", slice_name="v5p-8960")
    msg = str(e.value)
    assert "counts TensorCores (2 per chip)" in msg and "v5p-17920" in msg
    assert "v5p-pod" in msg and "chip v5p shape 16x20x28" in msg
    assert len(msg) < 250 and "\n" not in msg
    assert _resolve("v5p", slice_name="v5p-17920").num_chips == 8960


def test_shape_whose_size_does_not_match_the_slice_is_an_error():
    with pytest.raises(TpusimError, match="128 chips but slice v5p-128 has 64"):
        _resolve("v5p", slice_name="v5p-128", shape="4x4x8")


def test_slice_of_another_generation_is_an_error():
    with pytest.raises(TpusimError, match="is a v5e slice"):
        _resolve("v5p", slice_name="v5e-16")


@pytest.mark.parametrize(
    "chip_name, shape, match",
    [
        ("v5e", "32x4", "does not fit"),
        ("v5e", "4x4x4", "has 3 axes"),
        ("v4", "16x20x28", "is 140 cubes .* one v4 pod has 64"),
        ("v5p", "16x20x32", "is 160 cubes .* one v5p pod has 140"),
        ("v5p", "2x2x48", "does not fit .* not made of whole 4x4x4 cubes"),
    ],
)
def test_shape_that_does_not_fit_the_pod_is_an_error(chip_name, shape, match):
    with pytest.raises(TpusimError, match=match):
        _resolve(chip_name, shape=shape)


def test_axes_may_be_permuted_to_fit_the_pod():
    assert _resolve("v5p", shape="28x16x20").shape == (28, 16, 20)


@pytest.mark.parametrize("text", ["2x2x2x2", "0x4", "4xa", "", "-4x4"])
def test_malformed_shape_is_an_error(text):
    with pytest.raises(TpusimError, match="shape"):
        parse_shape(text)


def test_no_slice_and_no_shape_is_an_error():
    with pytest.raises(TpusimError, match="as slice NAME"):
        _resolve("v5e")


@pytest.mark.parametrize("slices", [0, -1])
def test_slices_below_one_is_an_error(slices):
    with pytest.raises(TpusimError, match="^slices "):
        _resolve("v5e", shape="4x4", num_slices=slices)


def test_coordinates_outside_the_torus_are_an_error(topo, v5e):
    topology = topo(v5e, "4x4")
    with pytest.raises(TpusimError, match="outside"):
        topology.chip_id((4, 0))


def test_axis_not_in_the_topology_is_an_error_naming_its_axes(topo, v5e):
    topology = topo(v5e, "4x4")
    with pytest.raises(TpusimError, match="axis 'z'.*x, y"):
        topology.axis_index("z")


def test_too_few_coordinates_are_a_tpusim_error(topo, v5e):
    topology = topo(v5e, "4x4")
    with pytest.raises(TpusimError):
        topology.chip_id((0,))


def test_too_many_coordinates_are_a_tpusim_error(topo, v5e):
    topology = topo(v5e, "4x4")
    with pytest.raises(TpusimError):
        topology.chip_id((3, 3, 0, 1))
