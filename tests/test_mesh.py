"""Tests for topologies/mesh.py: parsing `--mesh`/`--dcn`, and placing logical axes on the torus
the way jax's device meshes are laid out (last mesh axis on x first, factors of physical axes).
"""

from __future__ import annotations

import itertools
import math

import pytest

from sim.chips import get_chip
from topologies.errors import TpusimError
from topologies.mesh import LOGICAL_AXES, LogicalMesh, parse_mesh, place_mesh
from topologies.slices import resolve_topology
from topologies.torus import Topology


def _pod(chip_name: str, shape: str, slices: int = 1) -> Topology:
    chip = get_chip(chip_name)
    return resolve_topology(
        chip_name=chip.name,
        wrap_rule=chip.generation_rule,
        max_pod_shape=chip.max_pod_shape,
        shape=shape,
        num_slices=slices,
    )


def _assert_tiles_torus(mesh: LogicalMesh, topology: Topology, placements: dict) -> None:
    """Every physical axis is cut into factors (size, stride) that tile it exactly once, and
    every logical axis gets factors multiplying to its size: a bijection chips <-> mesh points."""
    for name, size in mesh.axes:
        ici = [f for f in placements[name].factors if f[0] != "dcn"]
        assert math.prod(f[1] for f in ici) == size, (name, placements[name])
    for axis, length in zip("xyz", topology.shape, strict=False):
        cuts = sorted(
            (stride, size)
            for pl in placements.values()
            for a, size, stride in pl.factors
            if a == axis
        )
        expect_stride = 1
        for stride, size in cuts:
            assert stride == expect_stride, (axis, cuts)
            expect_stride *= size
        assert expect_stride == length, (axis, cuts)


# -- placement like jax ------------------------------------------------------------------------


def test_v5p_4x4x4_fsdp16_tensor4_puts_tensor_on_x_and_fsdp_on_y_and_z():
    # xla.md: on a 4x4x4 v5p, make_mesh((fsdp=16, tensor=4)) runs the tensor axis along x.
    mesh = parse_mesh("fsdp=16,tensor=4")
    topo = _pod("v5p", "4x4x4")
    pl = place_mesh(mesh, topo)
    assert pl["tensor"].factors == (("x", 4, 1),)
    assert pl["fsdp"].factors == (("y", 4, 1), ("z", 4, 1))
    _assert_tiles_torus(mesh, topo, pl)


def test_full_v5p_pod_tensor4_takes_inner_factor_of_x_and_fsdp2240_takes_the_rest():
    mesh = parse_mesh("fsdp=2240,tensor=4")
    topo = _pod("v5p", "16x20x28")
    pl = place_mesh(mesh, topo)
    # tensor: 4 neighbouring chips of x (stride 1); fsdp: the outer factor 4 of x (stride 4),
    # then all of y and z.
    assert pl["tensor"].factors == (("x", 4, 1),)
    assert pl["fsdp"].factors == (("x", 4, 4), ("y", 20, 1), ("z", 28, 1))
    _assert_tiles_torus(mesh, topo, pl)


def test_last_mesh_axis_is_placed_first_whatever_its_name():
    # Order of the mesh string decides placement, not the axis names: fsdp last -> fsdp on x.
    pl = place_mesh(parse_mesh("tensor=2,fsdp=2"), _pod("v5e", "2x2"))
    assert pl["fsdp"].factors == (("x", 2, 1),)
    assert pl["tensor"].factors == (("y", 2, 1),)


def test_axis_spanning_part_of_two_physical_axes_v5e_16x16():
    mesh = parse_mesh("data=2,fsdp=32,tensor=4")
    topo = _pod("v5e", "16x16")
    pl = place_mesh(mesh, topo)
    assert pl["tensor"].factors == (("x", 4, 1),)
    assert pl["fsdp"].factors == (("x", 4, 4), ("y", 8, 1))
    assert pl["data"].factors == (("y", 2, 8),)
    _assert_tiles_torus(mesh, topo, pl)


def test_size_one_axes_get_no_factors():
    pl = place_mesh(parse_mesh("fsdp=1"), _pod("v5e", "1x1"))
    assert pl["fsdp"].factors == ()
    pl = place_mesh(parse_mesh("sequence=1,fsdp=6,tensor=4"), _pod("v5e", "4x6"))
    assert pl["sequence"].factors == ()
    assert pl["tensor"].factors == (("x", 4, 1),)
    assert pl["fsdp"].factors == (("y", 6, 1),)


def _factorizations(n: int, k: int):
    """All ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d, *rest)


@pytest.mark.parametrize("chip,shape", [("v5e", "4x6"), ("v5p", "2x3x4"), ("v5e", "8x10")])
def test_every_mesh_with_the_right_chip_count_tiles_the_torus(chip, shape):
    topo = _pod(chip, shape)
    names = ("data", "fsdp", "tensor")
    count = 0
    for sizes in _factorizations(topo.num_chips, 3):
        mesh = LogicalMesh(axes=tuple(zip(names, sizes, strict=True)))
        _assert_tiles_torus(mesh, topo, place_mesh(mesh, topo))
        count += 1
    assert count > 10


# -- DCN axes ----------------------------------------------------------------------------------


def test_dcn_axis_spans_the_slices():
    mesh = parse_mesh("fsdp=16", "data=2")
    assert mesh.size("data") == 2 and mesh.ici_size("data") == 1 and mesh.dcn_size("data") == 2
    pl = place_mesh(mesh, _pod("v5e", "4x4", slices=2))
    assert pl["data"].factors == (("dcn", 2, 1),)
    assert pl["fsdp"].factors == (("x", 4, 1), ("y", 4, 1))


def test_two_dcn_axes_are_factors_of_the_slice_index_last_one_innermost():
    pl = place_mesh(parse_mesh("fsdp=16", "data=2,pipeline=2"), _pod("v5e", "4x4", slices=4))
    assert pl["pipeline"].factors == (("dcn", 2, 1),)
    assert pl["data"].factors == (("dcn", 2, 2),)


def test_axis_on_both_ici_and_dcn_gets_both_factors():
    mesh = parse_mesh("fsdp=16", "fsdp=2")
    assert mesh.size("fsdp") == 32
    pl = place_mesh(mesh, _pod("v5e", "4x4", slices=2))
    assert pl["fsdp"].factors == (("x", 4, 1), ("y", 4, 1), ("dcn", 2, 1))


@pytest.mark.parametrize(
    "ici,dcn,slices,match",
    [
        ("fsdp=16", "data=2", 1, r"^dcn axes multiply to 2 but there are 1 slice"),
        ("fsdp=16", None, 2, r"multiply to 1 but there are 2 slice"),
        ("fsdp=16", "data=3", 2, r"^dcn axes multiply to 3"),
    ],
)
def test_dcn_axes_must_match_the_slice_count(ici, dcn, slices, match):
    with pytest.raises(TpusimError, match=match):
        place_mesh(parse_mesh(ici, dcn), _pod("v5e", "4x4", slices=slices))


# -- errors ------------------------------------------------------------------------------------


def test_mesh_product_must_equal_the_chip_count():
    with pytest.raises(TpusimError) as err:
        place_mesh(parse_mesh("fsdp=8,tensor=4"), _pod("v5p", "4x4x4"))
    msg = str(err.value)
    assert "32" in msg and "64" in msg and "4x4x4" in msg


def test_size_with_a_prime_the_torus_lacks_is_refused():
    # tensor=3 cannot be factored onto a 4x4 torus: no mesh containing it reaches 16 chips.
    with pytest.raises(TpusimError, match=r"fsdp=5,tensor=3 has 15 devices .* 16 chips"):
        place_mesh(parse_mesh("fsdp=5,tensor=3"), _pod("v5e", "4x4"))


@pytest.mark.parametrize("bad", ["tenser=4", "model=4", "FSDP=4"])
def test_unknown_axis_name_lists_the_known_axes(bad):
    with pytest.raises(TpusimError) as err:
        parse_mesh(f"fsdp=4,{bad}")
    msg = str(err.value)
    assert repr(bad.split("=")[0]) in msg
    named = [n for n in LOGICAL_AXES if n in msg.replace(",", " ").replace("?", " ").split()]
    assert 1 <= len(named) <= 5
    near = {"tenser=4": "tensor", "FSDP=4": "fsdp"}.get(bad)
    if near:
        assert msg.split("; ", 1)[1].startswith(f"did you mean {near}")


def test_unknown_dcn_axis_name_is_refused():
    with pytest.raises(TpusimError, match=r"mesh axis 'slice' is unknown"):
        parse_mesh("fsdp=4", "slice=2")


@pytest.mark.parametrize(
    "text,match",
    [
        ("fsdp16", r"'fsdp16' is not name=size; write e.g. fsdp=16,tensor=4"),
        ("fsdp=16,tensor", r"'tensor' is not name=size"),
        ("fsdp=x", r"size 'x' of fsdp is not an integer"),
        ("fsdp=1.5", r"size '1.5' of fsdp is not an integer"),
        ("fsdp=0", r"fsdp=0 must be >= 1"),
        ("fsdp=-4", r"fsdp=-4 must be >= 1"),
        ("fsdp=4,fsdp=4", r"names an axis twice"),
    ],
)
def test_bad_mesh_syntax_is_a_one_line_error(text, match):
    with pytest.raises(TpusimError, match=match) as err:
        parse_mesh(text)
    assert "\n" not in str(err.value)


def test_whitespace_and_empty_parts_are_tolerated():
    assert parse_mesh(" fsdp=2 , tensor=2 ,").axes == (("fsdp", 2), ("tensor", 2))


def test_logical_mesh_rejects_non_integer_sizes_built_in_code():
    with pytest.raises(TpusimError, match=r"must be a positive integer"):
        LogicalMesh(axes=(("fsdp", 2.0),))


def test_mesh_describe_and_to_dict_round_trip_through_parse():
    mesh = parse_mesh("data=2,fsdp=8,tensor=4", "data=2")
    d = mesh.to_dict()
    assert d == {"ici": {"data": 2, "fsdp": 8, "tensor": 4}, "dcn": {"data": 2}}
    again = parse_mesh(
        ",".join(f"{k}={v}" for k, v in d["ici"].items()),
        ",".join(f"{k}={v}" for k, v in d["dcn"].items()),
    )
    assert again == mesh
    assert mesh.num_ici_devices == 64 and mesh.num_slices == 2 and mesh.size("data") == 4


def test_all_permutations_of_a_3_axis_mesh_place_on_4x4x4():
    topo = _pod("v5p", "4x4x4")
    for order in itertools.permutations([("data", 4), ("fsdp", 4), ("tensor", 4)]):
        mesh = LogicalMesh(axes=order)
        pl = place_mesh(mesh, topo)
        # Last axis -> x, middle -> y, first -> z (whole axes, stride 1).
        assert [pl[n].factors for n, _ in order] == [
            (("z", 4, 1),), (("y", 4, 1),), (("x", 4, 1),)
        ]


# -- explicit placement (--axis-map) ---------------------------------------------------------


def _v5p_444():
    from topologies.torus import build_torus

    return build_torus((4, 4, 4), True)


def test_axis_map_places_axes_where_told():
    from topologies.mesh import parse_mesh, place_mesh

    pl = place_mesh(parse_mesh("fsdp=16,tensor=4", axis_map="tensor=y,fsdp=x+z"), _v5p_444())
    assert pl["tensor"].factors == (("y", 4, 1),)
    assert pl["fsdp"].factors == (("x", 4, 1), ("z", 4, 1))


def test_axis_map_factors_of_one_axis_are_laid_out_inner_first():
    from topologies.mesh import parse_mesh, place_mesh

    pl = place_mesh(parse_mesh("fsdp=16,tensor=4", axis_map="tensor=x:2+y:2,fsdp=x+y+z"),
                    _v5p_444())
    assert pl["tensor"].factors == (("x", 2, 1), ("y", 2, 1))
    assert pl["fsdp"].factors == (("x", 2, 2), ("y", 2, 2), ("z", 4, 1))


def test_axis_map_survives_a_trace_round_trip():
    from topologies.mesh import parse_mesh
    from workloads.trace import Op, Trace

    mesh = parse_mesh("fsdp=16,tensor=4", axis_map="tensor=y,fsdp=x+z")
    t = Trace(mesh=mesh, ops=(Op(id=0, name="a"),))
    assert Trace.from_json(t.to_json()).mesh == mesh


@pytest.mark.parametrize("axis_map, match", [
    ("tensor=x", "fsdp unplaced"),
    ("tensor=x:2,fsdp=y+z", "gives tensor 2 chips"),
    ("tensor=x:3,fsdp=y+z", "use a divisor"),
    ("tensor=x,fsdp=y:2+z:2", "gives fsdp 4 chips"),
    ("tensor=q,fsdp=y+z", "not a physical axis"),
    ("tensor=x,fsdp=y+z,data=x", "does not define"),
    ("tensorx", "not name=axes"),
])
def test_bad_axis_maps_are_one_line_errors(axis_map, match):
    from topologies.errors import TpusimError
    from topologies.mesh import parse_mesh, place_mesh

    with pytest.raises(TpusimError, match=match):
        place_mesh(parse_mesh("fsdp=16,tensor=4", axis_map=axis_map), _v5p_444())
