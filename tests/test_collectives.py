"""Tests for sim/collectives/ (algorithms, routing, simulate) and sim/engine/network.py:
every collective kind x algorithm on 1D/2D/3D tori against closed-form oracles, the textbook's
worked collective cases (reference/book_cases.json), symmetric vs full-detail agreement, link
invariants, degraded links, and full pods.

The physics (reference/tpu.md §2, restated in docs): every directed ICI link carries
W1 = chip.ici_link_bytes_per_s (the book's one-way figure; W_ici = 2*W1) and adds L = 1 µs per
hop. A step in which every chip sends b bytes over one uncontended hop costs exactly L + b/W1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pytest

from sim.chips import get_chip
from sim.collectives import (
    AUTO_CANDIDATES,
    CollectiveKind,
    algorithm_names,
    build_schedule,
    simulate_collective,
)
from sim.collectives.algorithms import _build_schedule
from sim.collectives.auto import bound_context, candidate_lower_bound
from topologies.errors import Said, TpusimError
from topologies.slices import resolve_topology

L = 1e-6  # tpu.md §1.1 per-hop ICI latency
GATHERLIKE = ("all-gather", "reduce-scatter", "all-reduce")
SINGLE_AXIS = ("ring", "bidi-ring", "split-bidi-ring", "line", "halving-doubling")
REL = 1e-9


def _topo(chip_name: str, shape: str, wrap: str = "auto", slices: int = 1):
    chip = get_chip(chip_name)
    return resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        shape=shape, wraparound=wrap, num_slices=slices,
    )


def _sim(chip_name: str, topology, **kw):
    return simulate_collective(chip=get_chip(chip_name), topology=topology, **kw)


# -- closed-form oracles --------------------------------------------------------------------
def _ring_load(n: int) -> float:
    """+ hops summed over every destination on a ring of n, shortest way (ties split)."""
    return sum(t for t in range(1, n) if 2 * t < n) + (n / 4 if n % 2 == 0 else 0.0)


def _line_load(n: int) -> int:
    """Source-destination pairs crossing the middle link of a line of n chips (one way)."""
    return (n // 2) * ((n + 1) // 2)


def single_axis_time(op: str, alg: str, n: int, wraps: bool, v: float, w1: float,
                     shift: int = 1) -> float:
    """Exact time of one collective on one axis of n chips."""
    if n == 1:
        return 0.0
    if op in GATHERLIKE:
        if alg in ("auto", "multi-axis"):
            alg = "split-bidi-ring" if wraps else "line"
        if alg == "per-axis-ring":
            alg = "ring"
        if alg == "hierarchical":
            alg = "bidi-ring" if wraps else "line"
        shard = v / n
        if alg == "ring":  # without wraparound the closing message walks back n-1 hops
            t = (n - 1) * ((1 if wraps else n - 1) * L + shard / w1)
        elif alg == "bidi-ring":
            t = (n // 2) * (L + shard / w1)
            if n % 2 == 0 and op != "all-gather":
                # The reduce-scatter's last hop sends half the antipode's partial each way.
                rs = (n // 2) * L + (n // 2 - 0.5) * shard / w1
                return rs if op == "reduce-scatter" else rs + t
        elif alg == "split-bidi-ring":
            t = (n - 1) * (L + shard / 2 / w1)
        elif alg == "line":
            t = (n - 1) * (L + shard / w1)
        elif alg == "direct":
            t = ((n // 2) * L + _ring_load(n) * shard / w1 if wraps
                 else (n - 1) * L + _line_load(n) * shard / w1)
        elif alg == "halving-doubling":
            # log2(n) exchanges with partners d = 2^i away; d messages share the busiest link.
            m = n.bit_length() - 1
            t = sum((1 << i) * (L + (v / n) * (1 << i) / w1) for i in range(m))
        else:
            raise AssertionError(alg)
        return 2 * t if op == "all-reduce" else t
    if op == "all-to-all":
        chunk = v / n**2
        if alg == "ring":
            return (n - 1) * L + (n - 1) * n / 2 * chunk / w1
        if wraps:
            return (n // 2) * L + _ring_load(n) * chunk / w1
        return (n - 1) * L + _line_load(n) * chunk / w1
    if op == "collective-permute":
        if wraps:
            t = shift % n
            if t == 0:
                return 0.0
            d = min(t, n - t)
            return d * L + d * (v / 2 if 2 * t == n else v) / w1
        k = abs(shift)
        return k * L + min(k, n - k) * v / w1
    raise AssertionError(op)


def multi_axis_equal_time(op: str, n: int, k: int, wraps: bool, v: float, w1: float) -> float:
    """k concurrent parts of V/k, each visiting the k axes (n chips each) in rotated order: the
    parts sit on different axes in every phase, so phase i costs (n-1)(L + shard_i/(c W1)),
    c = 2 for a split bidirectional ring, 1 for a line."""
    c = 2 if wraps else 1
    part = v / k
    t = sum((n - 1) * (L + part / n ** (k - i) / c / w1) for i in range(k))
    return 2 * t if op == "all-reduce" else t


def per_axis_ring_time(op: str, axes: Sequence[tuple[int, bool]], v: float, w1: float) -> float:
    """Unidirectional rings over the axes in x, y, z order (reduce-scatter shrinking the buffer),
    all-gather growing the shard; all-reduce = reduce-scatter then all-gather in reverse."""
    axes = [(n, w) for n, w in axes if n > 1]
    total = math.prod(n for n, _ in axes)

    def hops(n: int, w: bool) -> int:
        return 1 if w else n - 1

    def rs() -> float:
        t, buf = 0.0, v
        for n, w in axes:
            buf /= n
            t += (n - 1) * (hops(n, w) * L + buf / w1)
        return t

    def ag(order) -> float:
        t, shard = 0.0, v / total
        for n, w in order:
            t += (n - 1) * (hops(n, w) * L + shard / w1)
            shard *= n
        return t

    if op == "all-gather":
        return ag(axes)
    if op == "reduce-scatter":
        return rs()
    return rs() + ag(list(reversed(axes)))


def hierarchical_time(op: str, axes: Sequence[tuple[int, bool]], v: float, w1: float) -> float:
    """The axes in x, y, z order, each with its fewest-hop ring: bidirectional (every shard both
    ways, n/2 hops; the reduce-scatter's last hop sends half the antipode's partial each way)
    where it wraps, a line (n-1 hops) where not."""
    axes = [(n, w) for n, w in axes if n > 1]
    total = math.prod(n for n, _ in axes)

    def rs() -> float:
        t, buf = 0.0, v
        for n, w in axes:
            buf /= n
            if not w:
                t += (n - 1) * (L + buf / w1)
            elif n % 2:
                t += (n // 2) * (L + buf / w1)
            else:
                t += (n // 2) * L + (n // 2 - 0.5) * buf / w1
        return t

    def ag(order) -> float:
        t, shard = 0.0, v / total
        for n, w in order:
            t += (n // 2 if w else n - 1) * (L + shard / w1)
            shard *= n
        return t

    if op == "all-gather":
        return ag(axes)
    if op == "reduce-scatter":
        return rs()
    return rs() + ag(list(reversed(axes)))


def direct_wrapped_time(op: str, sizes: Sequence[int], v: float, w1: float) -> float:
    """Every pair at once over its dimension-order route on a fully wrapped torus: the step
    drains at the pace of its busiest link class, after the longest route's latency."""
    sizes = [n for n in sizes if n > 1]
    total = math.prod(sizes)
    lat = sum(n // 2 for n in sizes) * L
    frac = max(_ring_load(n) / n for n in sizes)  # bytes on a link class per byte of V
    if op == "all-to-all":
        return lat + frac * v / total / w1
    t = lat + frac * v / w1
    return 2 * t if op == "all-reduce" else t


def oracle(op: str, alg: str, axes: Sequence[tuple[int, bool]], v: float, w1: float):
    """The closed-form time of a collective where one is known, else None."""
    nt = [(n, w) for n, w in axes if n > 1]
    if op == "send" or not nt:
        return None
    if alg == "auto" and op in AUTO_CANDIDATES:
        # auto = the fastest applicable candidate.
        times = []
        for cand in AUTO_CANDIDATES[op]:
            if expected_error(op, cand, axes) is not None:
                continue
            t = oracle(op, cand, axes, v, w1)
            if t is None:
                return None
            times.append(t)
        return min(times)
    if len(nt) == 1:
        return single_axis_time(op, alg, nt[0][0], nt[0][1], v, w1)
    all_wrap = all(w for _, w in nt)
    if op in GATHERLIKE:
        if alg == "per-axis-ring":
            return per_axis_ring_time(op, nt, v, w1)
        if alg == "hierarchical":
            return hierarchical_time(op, nt, v, w1)
        if (alg in ("auto", "multi-axis") and len({n for n, _ in nt}) == 1
                and len({w for _, w in nt}) == 1):
            return multi_axis_equal_time(op, nt[0][0], len(nt), nt[0][1], v, w1)
    if alg == "direct" or (op == "all-to-all" and alg == "auto"):
        if all_wrap and op != "collective-permute":
            return direct_wrapped_time(op, [n for n, _ in nt], v, w1)
    return None


def expected_error(op: str, alg: str, axes: Sequence[tuple[int, bool]]) -> str | None:
    """The TpusimError an algorithm must raise on these group axes, or None."""
    nt = [(n, w) for n, w in axes if n > 1]
    if op == "send":
        return None
    if op == "collective-permute":
        return "runs on one axis" if len(nt) > 1 else None
    if op == "all-to-all":
        if alg in ("ring", "bidi-ring"):
            if len(nt) > 1:
                return "runs on one axis"
            if nt and not nt[0][1]:
                return "needs a ring"
        return None
    if alg in SINGLE_AXIS and len(nt) > 1:
        return "runs on one axis"
    if alg == "halving-doubling" and nt and nt[0][0] & (nt[0][0] - 1):
        return "power-of-two"
    if alg in ("bidi-ring", "split-bidi-ring") and nt and not nt[0][1]:
        return "needs a ring"
    return None


# -- (a) every kind x every algorithm ----------------------------------------------------------
# (chip, shape, --wraparound, group axes)
SWEEP_SHAPES = [
    ("v5e", "8", "all", "x"),  # 1D ring
    ("v5e", "8", "none", "x"),  # 1D line
    ("v5e", "5", "all", "x"),  # odd ring
    ("v5e", "1x8", "all", "y"),  # a size-1 axis beside the group
    ("v5e", "1x8", "all", "x,y"),  # a size-1 axis inside the group
    ("v5e", "1x8", "auto", "x"),  # a group of one chip
    ("v5e", "2x4", "all", "x"),  # wrapped size-2 axis: two links each way
    ("v5e", "2x4", "none", "x"),  # unwrapped size-2 axis
    ("v5e", "2x4", "all", "x,y"),
    ("v5e", "4x4", "all", "y"),
    ("v5e", "4x4", "all", "x,y"),
    ("v5e", "4x4", "none", "x,y"),
    ("v5e", "8x4", "auto", "y"),  # the book's v5e 8x4 (no wraparound)
    ("v5e", "3x5", "all", "x,y"),
    ("v5p", "4x4x4", "auto", "x,y,z"),
    ("v5p", "4x4x4", "auto", "x,z"),
    ("v5p", "4x4x4", "x,z", "x,y"),  # one axis wraps, the other does not
    ("v5p", "2x4x4", "all", "y"),
    ("v5p", "2x2x4", "auto", "x,y,z"),  # below a full cube: no wraparound
]
KINDS = [k.value for k in CollectiveKind]


def _sweep_cases():
    for chip, shape, wrap, axes in SWEEP_SHAPES:
        for op in KINDS:
            for alg in algorithm_names(CollectiveKind(op)):
                yield pytest.param(chip, shape, wrap, axes, op, alg,
                                   id=f"{chip}-{shape}-{wrap}-[{axes}]-{op}-{alg}")


@pytest.mark.parametrize("chip_name, shape, wrap, axes, op, alg", list(_sweep_cases()))
def test_every_kind_and_algorithm_succeeds_exactly_or_fails_cleanly(
    chip_name, shape, wrap, axes, op, alg
):
    topology = _topo(chip_name, shape, wrap)
    chip = get_chip(chip_name)
    w1 = chip.ici_link_bytes_per_s
    names = axes.split(",")
    info = [(topology.axis_size(a), topology.wraps(a)) for a in names]
    group = math.prod(n for n, _ in info)
    v = group * group * 4096
    kw = {}
    if op == "send":
        kw = {"src": (0,) * topology.ndim, "dst": tuple(n - 1 for n in topology.shape)}
        if sum(topology.shape) == topology.ndim:
            pytest.skip("a one-chip pod has no second chip to send to")
    must_fail = expected_error(op, alg, info)
    try:
        r = simulate_collective(chip=chip, topology=topology, op=op, axes=axes, nbytes=v,
                                algorithm=alg, **kw)
    except TpusimError as exc:
        assert must_fail is not None, f"unexpected refusal: {exc}"
        assert must_fail in str(exc)
        assert "\n" not in str(exc)
        return
    assert must_fail is None, f"should have refused ({must_fail}) but took {r.time_s}"
    if op != "send" and group == 1:
        assert r.time_s == 0.0 and r.bytes_on_busiest_link == 0.0
        return
    assert r.time_s > 0
    assert r.max_link_utilization <= 1 + 1e-9
    assert r.time_s * w1 >= r.bytes_on_busiest_link * (1 - 1e-9)  # no link above capacity
    assert r.time_s >= L * (1 - 1e-12)  # at least one hop
    k = sum(1 for n, _ in info if n > 1)
    ingress = 2 * k * w1  # at most two incoming links per group axis
    if op in ("all-gather", "reduce-scatter"):
        assert r.time_s >= v * (group - 1) / group / ingress * (1 - 1e-9)
    elif op == "all-reduce":
        assert r.time_s >= 2 * v * (group - 1) / group / ingress * (1 - 1e-9)
    elif op == "all-to-all":
        assert r.time_s >= v * (group - 1) / group**2 / ingress * (1 - 1e-9)
    expected = oracle(op, alg, info, v, w1)
    if expected is not None:
        assert r.time_s == pytest.approx(expected, rel=REL)


def test_sweep_has_closed_forms_for_most_cases():
    # Guard against the oracle silently returning None everywhere.
    covered = 0
    total = 0
    for chip, shape, wrap, axes in SWEEP_SHAPES:
        topology = _topo(chip, shape, wrap)
        info = [(topology.axis_size(a), topology.wraps(a)) for a in axes.split(",")]
        for op in KINDS:
            for alg in algorithm_names(CollectiveKind(op)):
                if expected_error(op, alg, info) or op == "send":
                    continue
                total += 1
                covered += oracle(op, alg, info, 1e6, 4.5e10) is not None
    assert covered / total > 0.8


@pytest.mark.parametrize("alg", ["multi-axis", "per-axis-ring", "split-bidi-ring", "line"])
def test_gather_only_algorithms_refuse_all_to_all(alg):
    with pytest.raises(TpusimError, match="does not implement all-to-all"):
        _sim("v5e", _topo("v5e", "8", "all"), op="all-to-all", axes="x", nbytes=64 * 64,
             algorithm=alg)


@pytest.mark.parametrize("alg", ["ring", "multi-axis", "per-axis-ring"])
def test_collective_permute_refuses_collective_algorithms(alg):
    with pytest.raises(TpusimError, match="does not implement collective-permute"):
        _sim("v5e", _topo("v5e", "8", "all"), op="collective-permute", axes="x", nbytes=1024,
             algorithm=alg)


@pytest.mark.parametrize("alg", ["ring", "multi-axis", "no-such-algorithm"])
def test_send_refuses_algorithms_it_does_not_implement(alg):
    try:
        r = _sim("v5e", _topo("v5e", "8", "all"), op="send", src=(0,), dst=(3,), nbytes=1024,
                 algorithm=alg)
    except TpusimError as exc:
        assert alg in str(exc)
        return
    raise AssertionError(f"send ran with --algorithm {alg} as {r.algorithm}")


def test_unknown_algorithm_and_op_are_errors_listing_the_choices():
    topology = _topo("v5e", "8", "all")
    with pytest.raises(TpusimError, match="unknown collective algorithm 'warp'.*bidi-ring"):
        _sim("v5e", topology, op="all-gather", axes="x", nbytes=1024, algorithm="warp")
    with pytest.raises(TpusimError, match="unknown op 'gather'.*all-gather"):
        _sim("v5e", topology, op="gather", axes="x", nbytes=1024)


def test_line_is_refused_over_dcn():
    with pytest.raises(TpusimError, match="ICI axis"):
        _sim("v5e", _topo("v5e", "4x4", "all", 2), op="all-gather", axes="dcn", nbytes=1024,
             algorithm="line")


@pytest.mark.parametrize("nbytes, match", [(0, "> 0"), (-64, "> 0"), (1023, "divisible"),
                                           (1.5, "whole number"), (True, "whole number")])
def test_bad_byte_counts_are_errors(nbytes, match):
    with pytest.raises(TpusimError, match=match):
        _sim("v5e", _topo("v5e", "8", "all"), op="all-gather", axes="x", nbytes=nbytes)


@pytest.mark.parametrize("axes, match", [("z", "not in the"), ("", "at least one axis"),
                                         ("x,x", "twice"), ("dcn", "several slices")])
def test_bad_axes_are_errors(axes, match):
    with pytest.raises(TpusimError, match=match):
        _sim("v5e", _topo("v5e", "4x4", "all"), op="all-gather", axes=axes, nbytes=1024)


# -- point-to-point closed forms --------------------------------------------------------------
@pytest.mark.parametrize(
    "chip_name, shape, wrap, src, dst, hops, first_links",
    [
        ("v5e", "4x4", "auto", (0, 0), (3, 3), 6, 2),  # tpus Q5: 3+3 hops, 2 dimension orders
        ("v5e", "8x1", "auto", (0, 0), (7, 0), 7, 1),
        ("v5e", "8", "all", (0,), (4,), 4, 2),  # half way round: both directions
        ("v5e", "8", "all", (0,), (7,), 1, 1),  # the short way round
        ("v5e", "4x4", "all", (0, 0), (2, 2), 4, 4),  # half way on both axes: 8 paths, 4 links
        ("v5p", "4x4x4", "auto", (0, 0, 0), (1, 1, 1), 3, 3),  # 6 orders over 3 first links
    ],
)
def test_send_time_is_hops_latency_plus_bytes_over_the_used_first_links(
    chip_name, shape, wrap, src, dst, hops, first_links
):
    v = 1 << 22
    chip = get_chip(chip_name)
    r = _sim(chip_name, _topo(chip_name, shape, wrap), op="send", src=src, dst=dst, nbytes=v)
    expected = hops * L + v / (first_links * chip.ici_link_bytes_per_s)
    assert r.time_s == pytest.approx(expected, rel=REL)
    assert r.group_size == 2


def test_send_between_slices_adds_dcn_latency_and_bandwidth():
    chip = get_chip("v5e")
    v = 1 << 20
    r = _sim("v5e", _topo("v5e", "4x4", "all", 2), op="send", src=(0, 0, 0), dst=(1, 1, 1),
             nbytes=v)
    # Two ICI hops and one DCN hop of latency; the bytes drain at the pace of the busiest
    # resource on the routes, the one NIC that carries all of them.
    expected = 2 * L + chip.dcn_latency_s + v / chip.dcn_bytes_per_s
    assert r.time_s == pytest.approx(expected, rel=REL)
    dcn = r.links[r.links.axis == "dcn"]
    assert set(dcn.direction) == {"out", "in"}
    assert dcn[dcn.direction == "out"].bytes.sum() == dcn[dcn.direction == "in"].bytes.sum() == v


def test_send_needs_two_distinct_chips():
    topology = _topo("v5e", "4x4")
    with pytest.raises(TpusimError, match="same chip"):
        _sim("v5e", topology, op="send", src=(1, 1), dst=(1, 1), nbytes=64)
    with pytest.raises(TpusimError, match="op send needs src and dst") as exc:
        _sim("v5e", topology, op="send", nbytes=64)
    assert exc.value.params == ("op", "src", "dst")


@pytest.mark.parametrize("src, dst", [((0,), (3, 3)), ((0, 0), (3, 3, 0, 1)), ((0, 0), (3, 3, 1))])
def test_send_with_the_wrong_number_of_coordinates_is_a_tpusim_error(src, dst):
    with pytest.raises(TpusimError, match="coordinates"):
        _sim("v5e", _topo("v5e", "4x4"), op="send", src=src, dst=dst, nbytes=64)


@pytest.mark.parametrize("shift", [1, 2, 3, 7, 8, 9, 15, -1, -2, 16])
def test_collective_permute_on_a_wrapped_ring(shift):
    # tpu.md-style: shift k < X/2 puts k messages on every + link: k*L + k*V/W1.
    chip = get_chip("v5e")
    v = 1 << 20
    r = _sim("v5e", _topo("v5e", "16x16"), op="collective-permute", axes="x", nbytes=v,
             shift=shift)
    expected = single_axis_time("collective-permute", "direct", 16, True, v,
                                chip.ici_link_bytes_per_s, shift)
    assert r.time_s == pytest.approx(expected, rel=REL)
    if shift in (2, 7):
        assert r.time_s == pytest.approx(shift * L + shift * v / chip.ici_link_bytes_per_s,
                                         rel=REL)


@pytest.mark.parametrize("shift", [1, 2, 5, 7, -3])
def test_collective_permute_on_a_line(shift):
    chip = get_chip("v5e")
    v = 1 << 20
    r = _sim("v5e", _topo("v5e", "8x4"), op="collective-permute", axes="x", nbytes=v,
             shift=shift)
    k = abs(shift)
    assert r.time_s == pytest.approx(k * L + min(k, 8 - k) * v / chip.ici_link_bytes_per_s,
                                     rel=REL)


def test_collective_permute_off_the_end_of_a_line_is_an_error():
    with pytest.raises(TpusimError, match="^shift 8 moves"):
        _sim("v5e", _topo("v5e", "8x4"), op="collective-permute", axes="x", nbytes=64, shift=8)


# -- all-to-all vs the textbook (tpu.md §2) ---------------------------------------------------
@pytest.mark.parametrize(
    "chip_name, shape, axes",
    [
        ("v5e", "8", "x"),
        ("v5e", "16x16", "y"),
        ("v5e", "16x16", "x,y"),
        ("v5p", "4x4x4", "x,y,z"),
        ("v5p", "4x4x8", "x,y,z"),
        ("v5p", "4x4x4", "y,z"),
    ],
)
def test_all_to_all_direct_matches_the_textbook_torus_formula(chip_name, shape, axes):
    wrap = "all"
    topology = _topo(chip_name, shape, wrap)
    chip = get_chip(chip_name)
    dims = [topology.axis_size(a) for a in axes.split(",")]
    n = math.prod(dims)
    v = n * n * 1024
    r = _sim(chip_name, topology, op="all-to-all", axes=axes, nbytes=v, algorithm="direct")
    latency = sum(d // 2 for d in dims) * L
    textbook = v * max(dims) / (4 * n * chip.ici_bidi_bytes_per_s)  # tpu.md §2, N-D torus
    assert r.time_s - latency == pytest.approx(textbook, rel=1e-7)
    if len(dims) == 1:  # 1D bidirectional ring: V / (4 W_ici)
        assert r.time_s - latency == pytest.approx(v / (4 * chip.ici_bidi_bytes_per_s), rel=1e-7)


def test_all_to_all_on_a_unidirectional_ring_costs_half_an_all_gather():
    # tpu.md §2: "On a unidirectional ring it costs 1/2 an AllGather".
    topology = _topo("v5e", "16x16")
    v = 256 * 4096
    a2a = _sim("v5e", topology, op="all-to-all", axes="x", nbytes=v, algorithm="ring")
    ag = _sim("v5e", topology, op="all-gather", axes="x", nbytes=v, algorithm="ring")
    assert a2a.time_s - 15 * L == pytest.approx((ag.time_s - 15 * L) / 2, rel=REL)


# -- (b) the textbook's worked collective cases ----------------------------------------------
def _book_case(reference_dir, case_id: str) -> dict:
    cases = json.loads((reference_dir / "book_cases.json").read_text(encoding="utf-8"))
    for case in cases:
        if case["id"] == case_id:
            assert case["kind"] == "collective"
            return case
    raise AssertionError(f"book case {case_id} not found")


def _us(seconds: float) -> float:
    return seconds * 1e6


def test_book_allgather_on_v5e_8x4_axis_without_wraparound_is_560us(reference_dir):
    case = _book_case(reference_dir, "sharding-pq2-ag-v5e-y4-nowrap")
    v = case["inputs"]["total_bytes"]
    topology = _topo("v5e", "8x4")
    assert topology.wraps("y") is case["inputs"]["wraparound_on_Y"]
    r = _sim("v5e", topology, op="all-gather", axes="y", nbytes=v)
    w1 = case["inputs"]["W_ici_oneway"]
    # Line: hops of V/X one way = 559.24 us, plus 3 hops of latency.
    assert r.time_s == pytest.approx(3 * (L + v / 4 / w1), rel=REL)
    assert _us(r.time_s - 3 * L) == pytest.approx(559.24, abs=0.01)
    assert _us(r.time_s) == pytest.approx(case["expected"], rel=0.20)  # the note's ~20%
    assert r.bytes_on_busiest_link == 3 * v / 4  # the middle link carries 3 shards each way
    assert r.algorithm == "auto (multi-axis)"


def test_book_measured_680us_is_reached_with_realistic_link_efficiency(reference_dir):
    case = _book_case(reference_dir, "sharding-pq2-ag-v5e-y4-measured")
    chip = get_chip("v5e").with_overrides(ici_efficiency=0.8)
    r = simulate_collective(chip=chip, topology=_topo("v5e", "8x4"), op="all-gather", axes="y",
                            nbytes=case["inputs"]["total_bytes"])
    assert _us(r.time_s) == pytest.approx(case["expected"], rel=0.20)
    ideal = _sim("v5e", _topo("v5e", "8x4"), op="all-gather", axes="y",
                 nbytes=case["inputs"]["total_bytes"])
    assert r.time_s - 3 * L == pytest.approx((ideal.time_s - 3 * L) / 0.8, rel=REL)


@pytest.mark.parametrize("shape, axis_len", [("8x4", 4), ("16x16", 16)])
def test_book_ideal_bidirectional_ring_is_377us(reference_dir, shape, axis_len):
    case = _book_case(reference_dir, "sharding-pq2-ag-v5e-y4-idealring")
    v = case["inputs"]["total_bytes"]
    r = _sim("v5e", _topo("v5e", shape, "all"), op="all-gather", axes="y", nbytes=v,
             algorithm="bidi-ring")
    latency = (axis_len // 2) * L
    assert r.time_s - latency == pytest.approx(v / case["inputs"]["W_ici_bidi"], rel=REL)
    assert _us(r.time_s) == pytest.approx(case["expected"], rel=0.02)  # book rounds V to 34e6


def test_book_small_allgather_is_latency_bound_between_3us_and_8us(reference_dir):
    case = _book_case(reference_dir, "sharding-pq2-ag-v5e-small-latency")
    per_device = case["inputs"]["bytes_per_device"]
    hops = case["inputs"]["hops"]
    r = _sim("v5e", _topo("v5e", "8x4"), op="all-gather", axes="y", nbytes=4 * per_device)
    assert hops * case["inputs"]["per_hop_latency_s"] <= r.time_s <= 8e-6  # book: ~8us measured
    assert _us(r.time_s) >= case["expected"]
    # Each hop's chunk (32 kB) is below the 45 kB threshold: latency is most of the time.
    assert hops * L > (r.time_s - hops * L)


def test_book_applied_inference_4x8_activation_gather_is_11us(reference_dir):
    case = _book_case(reference_dir, "applied-inference-ici-4x8-b64")
    inputs = case["inputs"]
    v = 2 * inputs["B"] * inputs["D"]  # bf16 activations [B, D]
    r = _sim("v5e", _topo("v5e", "4x8", "all"), op="all-gather", axes="y", nbytes=v,
             algorithm="bidi-ring")
    bandwidth = r.time_s - 4 * L
    assert bandwidth == pytest.approx(v / inputs["W_ici_bidi"], rel=REL)  # exactly 11.65 us
    assert _us(bandwidth) == pytest.approx(case["expected"], rel=0.06)  # book rounds down
    # The real v5e 4x8 has no wraparound: a line, "about 2x" as long (tpu.md §1.3).
    line = _sim("v5e", _topo("v5e", "4x8"), op="all-gather", axes="y", nbytes=v)
    ratio = (line.time_s - 7 * L) / bandwidth
    assert 1.0 < ratio <= 2.0


def test_book_latency_threshold_is_45kB_per_hop_on_v5e(reference_dir):
    case = _book_case(reference_dir, "sharding-latency-threshold-v5e")
    chip = get_chip("v5e")
    assert chip.ici_link_bytes_per_s * chip.ici_hop_latency_s == pytest.approx(case["expected"])
    # A ring step whose chunk is exactly the threshold spends as long on bytes as on latency.
    v = 8 * int(case["expected"])
    r = _sim("v5e", _topo("v5e", "8", "all"), op="all-gather", axes="x", nbytes=v,
             algorithm="ring")
    assert r.time_s == pytest.approx(7 * 2 * L, rel=REL)


def test_book_8_way_gather_below_360kB_is_latency_bound(reference_dir):
    case = _book_case(reference_dir, "inference-appc-latency-threshold-8way")
    threshold = int(case["expected"])
    topology = _topo("v5e", "8", "all")
    below = _sim("v5e", topology, op="all-gather", axes="x", nbytes=threshold - 8,
                 algorithm="ring")
    above = _sim("v5e", topology, op="all-gather", axes="x", nbytes=threshold + 8,
                 algorithm="ring")
    latency = 7 * L
    assert below.time_s - latency < latency < above.time_s - latency


def test_book_measured_95_percent_efficiency_scales_the_bandwidth_term(reference_dir):
    case = _book_case(reference_dir, "sharding-empirical-ag-v5e-8x16")
    v = int(case["inputs"]["saturating_array_bytes"])
    topology = _topo("v5e", "8x16")
    assert topology.wraps("y")
    slow = simulate_collective(chip=get_chip("v5e").with_overrides(ici_efficiency=0.95),
                               topology=topology, op="all-gather", axes="y", nbytes=v,
                               algorithm="split-bidi-ring")
    ideal = _sim("v5e", topology, op="all-gather", axes="y", nbytes=v,
                 algorithm="split-bidi-ring")
    assert slow.time_s - 15 * L == pytest.approx((ideal.time_s - 15 * L) / case["expected"],
                                                 rel=REL)


# -- (c) per-axis-ring vs the chained formula ----------------------------------------------
@pytest.mark.parametrize("op", GATHERLIKE)
@pytest.mark.parametrize("chip_name, shape, axes", [("v5p", "4x4x4", "x,y,z"),
                                                    ("v5e", "16x16", "x,y"),
                                                    ("v5p", "2x4x8", "x,y,z")])
def test_per_axis_ring_equals_the_chained_formula_exactly(op, chip_name, shape, axes):
    topology = _topo(chip_name, shape, "all")
    chip = get_chip(chip_name)
    dims = [topology.axis_size(a) for a in axes.split(",")]
    v = math.prod(dims) * 8192
    r = _sim(chip_name, topology, op=op, axes=axes, nbytes=v, algorithm="per-axis-ring")
    expected = per_axis_ring_time(op, [(n, True) for n in dims], v, chip.ici_link_bytes_per_s)
    assert r.time_s == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("op", GATHERLIKE)
@pytest.mark.parametrize("chip_name, shape, axes", [("v5p", "4x4x4", "x,y,z"),
                                                    ("v5e", "16x16", "x,y"),
                                                    ("v4", "8x8x8", "x,y,z")])
def test_multi_axis_on_equal_wrapped_axes_is_the_sum_of_split_phases(op, chip_name, shape, axes):
    topology = _topo(chip_name, shape, "all")
    chip = get_chip(chip_name)
    dims = [topology.axis_size(a) for a in axes.split(",")]
    n, k = dims[0], len(dims)
    v = math.prod(dims) * 3 * 4096
    w_ici = chip.ici_bidi_bytes_per_s
    for alg in ("multi-axis",):
        r = _sim(chip_name, topology, op=op, axes=axes, nbytes=v, algorithm=alg)
        auto = _sim(chip_name, topology, op=op, axes=axes, nbytes=v, algorithm="auto")
        assert auto.time_s <= r.time_s * (1 + 1e-12)
        expected = multi_axis_equal_time(op, n, k, True, v, chip.ici_link_bytes_per_s)
        assert r.time_s == pytest.approx(expected, rel=REL)
        mult = 2 if op == "all-reduce" else 1
        latency = mult * k * (n - 1) * L
        textbook = mult * v / (k * w_ici)  # tpu.md §2 "AllGather over k mesh axes"
        assert textbook * (n**k - 1) / n**k * (1 - 1e-9) <= r.time_s - latency
        assert r.time_s - latency <= textbook * (1 + 1e-9)


@pytest.mark.parametrize(
    "chip_name, shape, wrap, max_excess",
    [("v5e", "2x16", "all", 0.30), ("v5p", "4x8x8", "auto", 0.12),
     ("v5p", "16x20x28", "auto", 0.05)],
)
def test_multi_axis_all_gather_on_unequal_axes_is_near_the_textbook_bandwidth_term(
    chip_name, shape, wrap, max_excess
):
    """The parts run their phases in lock step (each phase pays its longest axis's hops) with
    shares rebalanced for unequal axes. The textbook's V/(k W_ici) assumes every axis busy all
    the time; on 2x16 the 2-chip axis cannot carry a quarter of the data, so the best this
    algorithm family reaches is about 0.316 V/W1 instead of 0.25 V/W1 (docs/model.md)."""
    topology = _topo(chip_name, shape, wrap)
    chip = get_chip(chip_name)
    dims = list(topology.shape)
    assert all(topology.wraparound)
    k = len(dims)
    v = math.prod(dims) * (1 << 20)
    r = _sim(chip_name, topology, op="all-gather", axes=",".join("xyz"[:k]), nbytes=v)
    latency = k * (max(dims) - 1) * L  # k lock-step phases, each as long as the longest ring
    textbook = v / (k * chip.ici_bidi_bytes_per_s)
    assert r.time_s - latency <= textbook * (1 + max_excess)
    assert r.time_s >= textbook * (math.prod(dims) - 1) / math.prod(dims) * (1 - 1e-9)


def test_multi_axis_reduce_scatter_costs_the_same_as_all_gather_on_unequal_lines():
    topology = _topo("v5e", "4x8")
    v = 2 * 64 * 8192
    ag = _sim("v5e", topology, op="all-gather", axes="x,y", nbytes=v)
    rs = _sim("v5e", topology, op="reduce-scatter", axes="x,y", nbytes=v)
    assert rs.time_s == pytest.approx(ag.time_s, rel=1e-6)


def test_balanced_shares_beat_equal_shares_on_unequal_axes():
    from sim.collectives.algorithms import _balanced_shares

    c = np.array([[0.015625, 0.46875], [0.25, 0.234375]])  # 2x16 all-gather, per unit share
    w = _balanced_shares(c)
    cost = lambda s: float((s[:, None] * c).max(axis=0).sum())  # noqa: E731
    assert w.sum() == pytest.approx(1.0)
    assert cost(w) < cost(np.array([0.5, 0.5])) * 0.95


@pytest.mark.parametrize("op", GATHERLIKE)
@pytest.mark.parametrize("chip_name, shape, axes", [("v5e", "16x16", "y"), ("v5p", "4x4x4", "x"),
                                                    ("v5e", "4x4", "x,y")])
def test_reduce_scatter_costs_the_same_as_all_gather_on_symmetric_setups(
    op, chip_name, shape, axes
):
    topology = _topo(chip_name, shape)
    v = 256 * 4096
    ag = _sim(chip_name, topology, op="all-gather", axes=axes, nbytes=v,
              algorithm="multi-axis")
    r = _sim(chip_name, topology, op=op, axes=axes, nbytes=v, algorithm="multi-axis")
    assert r.time_s == pytest.approx((2 if op == "all-reduce" else 1) * ag.time_s, rel=REL)


def test_bidi_ring_reduce_scatter_does_not_sum_the_antipode_twice():
    """The all-gather's last hop brings the antipode's shard from both sides (the textbook's
    V/W_ici); the reduce-scatter's last hop carries half of that partial each way."""
    topology = _topo("v5e", "16x16")
    v = 16 * 65536
    ag = _sim("v5e", topology, op="all-gather", axes="x", nbytes=v, algorithm="bidi-ring")
    rs = _sim("v5e", topology, op="reduce-scatter", axes="x", nbytes=v, algorithm="bidi-ring")
    assert ag.bytes_on_busiest_link == pytest.approx(8 * v / 16)
    assert rs.bytes_on_busiest_link == pytest.approx(7.5 * v / 16)


# -- DCN (multi-slice) ---------------------------------------------------------------------
@pytest.mark.parametrize("slices", [2, 3, 4])
@pytest.mark.parametrize("alg", ["multi-axis", "ring", "split-bidi-ring"])
def test_all_gather_over_dcn_is_a_ring_through_each_chips_nic(slices, alg):
    chip = get_chip("v5e")
    v = slices * (1 << 20)
    r = _sim("v5e", _topo("v5e", "4x4", "all", slices), op="all-gather", axes="dcn", nbytes=v,
             algorithm=alg)
    # Each ring step: the DCN latency, each message's overhead (the split ring sends half the
    # shard each way: two messages), the shard through the NIC.
    msgs = 2 if alg == "split-bidi-ring" else 1
    expected = (slices - 1) * (chip.dcn_latency_s + msgs * chip.dcn_message_overhead_s
                               + v / slices / chip.dcn_bytes_per_s)
    assert r.time_s == pytest.approx(expected, rel=REL)
    assert r.group_size == slices and r.num_groups == 16


def test_hierarchical_all_gather_over_x_and_dcn_does_dcn_first():
    chip = get_chip("v5e")
    v = 8 * (1 << 18)
    r = _sim("v5e", _topo("v5e", "4x4", "all", 2), op="all-gather", axes="x,dcn", nbytes=v)
    dcn = chip.dcn_latency_s + chip.dcn_message_overhead_s + (v / 8) / chip.dcn_bytes_per_s
    ici = 3 * (L + (v / 4) / 2 / chip.ici_link_bytes_per_s)
    assert r.time_s == pytest.approx(dcn + ici, rel=REL)
    labels = list(r.timeline.label)
    assert labels == ["part0 AG dcn", "part0 AG x"]


# -- (d) symmetric vs full detail ------------------------------------------------------------
SYM_SHAPES = [
    ("v5e", "4x4", "all", 1, "x,y"),
    ("v5e", "4x4", "all", 1, "y"),
    ("v5e", "2x4", "all", 1, "x,y"),
    ("v5e", "3x5", "all", 1, "x,y"),
    ("v5p", "4x4x4", "auto", 1, "x,y,z"),
    ("v5p", "4x4x4", "auto", 1, "y,z"),
    ("v5p", "4x4x4", "auto", 1, "z"),
    ("v5e", "4x4", "all", 2, "dcn"),
    ("v5e", "4x4", "all", 2, "x,dcn"),
    ("v5e", "2x2", "all", 3, "x,y,dcn"),
    ("v5e", "4x4", "none", 2, "dcn"),  # ICI lines elsewhere do not break DCN symmetry
]


def _sym_cases():
    for chip, shape, wrap, slices, axes in SYM_SHAPES:
        for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                   "collective-permute"):
            for alg in algorithm_names(CollectiveKind(op)):
                if alg in ("line", "halving-doubling"):
                    continue  # edge- or bit-dependent moves: no symmetric mode
                for shift in ((1, 2) if op == "collective-permute" else (1,)):
                    yield pytest.param(chip, shape, wrap, slices, axes, op, alg, shift,
                                       id=f"{chip}-{slices}x{shape}-[{axes}]-{op}-{alg}-{shift}")


@pytest.mark.parametrize("chip_name, shape, wrap, slices, axes, op, alg, shift",
                         list(_sym_cases()))
def test_symmetric_and_full_detail_agree(chip_name, shape, wrap, slices, axes, op, alg, shift):
    topology = _topo(chip_name, shape, wrap, slices)
    group = math.prod(topology.axis_size(a) for a in axes.split(","))
    v = group * group * 2048
    kw = dict(op=op, axes=axes, nbytes=v, algorithm=alg, shift=shift)
    try:
        sym = _sim(chip_name, topology, mode="symmetric", **kw)
    except TpusimError as exc:
        # Only algorithms that refuse these axes outright may fail, and then in both modes.
        with pytest.raises(TpusimError) as full_exc:
            _sim(chip_name, topology, mode="full", **kw)
        assert str(full_exc.value) == str(exc)
        assert "symmetric" not in str(exc)
        return
    full = _sim(chip_name, topology, mode="full", **kw)
    assert sym.mode == "symmetric" and full.mode == "full"
    assert full.time_s == pytest.approx(sym.time_s, rel=REL)
    assert full.bytes_on_busiest_link == pytest.approx(sym.bytes_on_busiest_link, rel=REL)
    assert full.max_link_utilization == pytest.approx(sym.max_link_utilization, rel=REL)
    a = sym.links.set_index("link").bytes.sort_index()
    b = full.links.set_index("link").bytes.sort_index()
    assert list(a.index) == list(b.index)
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=REL)
    auto = _sim(chip_name, topology, **kw)
    assert auto.mode == "symmetric"  # auto picks the representative chip where it is exact


@pytest.mark.parametrize("shape, wrap, axes", [("4x4", "all", "x"), ("4x4", "none", "x,y"),
                                               ("8x4", "auto", "y")])
def test_symmetric_mode_is_refused_where_it_would_not_be_exact(shape, wrap, axes):
    topology = _topo("v5e", shape, wrap)
    alg = "line" if wrap == "all" else "auto"
    with pytest.raises(TpusimError, match="^mode symmetric is not exact"):
        _sim("v5e", topology, op="all-gather", axes=axes, nbytes=1024, algorithm=alg,
             mode="symmetric")
    assert _sim("v5e", topology, op="all-gather", axes=axes, nbytes=1024, algorithm=alg).mode \
        == "full"


def test_bad_mode_is_an_error():
    with pytest.raises(TpusimError, match="mode"):
        _sim("v5e", _topo("v5e", "8", "all"), op="all-gather", axes="x", nbytes=64, mode="fast")


# -- (e) invariants ---------------------------------------------------------------------------
ONE_HOP = [
    ("v5e", "8", "all", "x", "ring"),
    ("v5e", "8", "all", "x", "split-bidi-ring"),
    ("v5e", "8x4", "auto", "y", "line"),
    ("v5e", "4x4", "all", "x,y", "multi-axis"),
    ("v5e", "4x4", "none", "x,y", "multi-axis"),
    ("v5p", "4x4x4", "auto", "x,y,z", "per-axis-ring"),
    ("v5p", "4x4x4", "auto", "x,y,z", "multi-axis"),
    ("v5e", "2x4", "all", "x,y", "multi-axis"),
]


@pytest.mark.parametrize("chip_name, shape, wrap, axes, alg", ONE_HOP)
def test_all_gather_delivers_every_other_shard_exactly_once(chip_name, shape, wrap, axes, alg):
    topology = _topo(chip_name, shape, wrap)
    group = math.prod(topology.axis_size(a) for a in axes.split(","))
    v = group * 4096
    r = _sim(chip_name, topology, op="all-gather", axes=axes, nbytes=v, algorithm=alg)
    # Nearest-neighbour algorithms: link bytes = bytes received = (N-1)/N V per chip.
    assert r.links.bytes.sum() == pytest.approx(topology.num_chips * v * (group - 1) / group,
                                                rel=REL)


@pytest.mark.parametrize("chip_name, shape, wrap, axes, alg", ONE_HOP)
@pytest.mark.parametrize("op", GATHERLIKE)
def test_link_bytes_equal_bytes_sent_per_chip_times_chips(chip_name, shape, wrap, axes, alg, op):
    topology = _topo(chip_name, shape, wrap)
    group = math.prod(topology.axis_size(a) for a in axes.split(","))
    v = group * 4096
    r = _sim(chip_name, topology, op=op, axes=axes, nbytes=v, algorithm=alg)
    links = r.links
    if r.mode == "symmetric":
        # Every chip sends what the representative sends, one hop per move.
        sent = r.timeline.bytes_per_chip.sum()
        assert links.bytes.sum() == pytest.approx(sent * topology.num_chips, rel=REL)
        # Translation symmetry: each chip sends as much as it receives.
        out = links.groupby("src").bytes.sum().sort_index()
        inn = links.groupby("dst").bytes.sum().sort_index()
        assert list(out.index) == list(inn.index)
        np.testing.assert_allclose(out.to_numpy(), inn.to_numpy(), rtol=REL)
    assert (links.utilization <= 1 + 1e-9).all()
    assert r.hbm_bytes_per_chip >= 2 * links.bytes.sum() / topology.num_chips * (1 - 1e-9)


def test_reductions_touch_more_hbm_than_gathers():
    topology = _topo("v5e", "16x16")
    v = 16 * 4096
    ag = _sim("v5e", topology, op="all-gather", axes="x", nbytes=v, algorithm="ring")
    rs = _sim("v5e", topology, op="reduce-scatter", axes="x", nbytes=v, algorithm="ring")
    ar = _sim("v5e", topology, op="all-reduce", axes="x", nbytes=v, algorithm="ring")
    assert ag.hbm_bytes_per_chip == pytest.approx(2 * v * 15 / 16, rel=REL)  # read + write
    assert ag.hbm_bytes_per_chip < rs.hbm_bytes_per_chip < ar.hbm_bytes_per_chip


def test_dcn_bytes_sent_equal_bytes_received():
    r = _sim("v5e", _topo("v5e", "4x4", "all", 3), op="all-reduce", axes="x,y,dcn",
             nbytes=48 * 4096)
    dcn = r.links[r.links.axis == "dcn"]
    out = dcn[dcn.direction == "out"].bytes.sum()
    assert out > 0
    assert out == pytest.approx(dcn[dcn.direction == "in"].bytes.sum(), rel=REL)


@pytest.mark.parametrize(
    "chip_name, shape, wrap, axes, op, alg, slow",
    [
        ("v5e", "8x4", "all", "x", "all-reduce", "auto", ()),
        ("v5e", "8x4", "auto", "x,y", "all-gather", "auto", ("2,1:x+:0.5",)),
        ("v5p", "4x4x4", "auto", "x,y,z", "all-to-all", "direct", ()),
        ("v5e", "4x4", "all", "x,dcn", "all-reduce", "auto", ()),
    ],
)
def test_same_input_gives_the_same_output(chip_name, shape, wrap, axes, op, alg, slow):
    slices = 2 if "dcn" in axes else 1
    topology = _topo(chip_name, shape, wrap, slices)
    group = math.prod(topology.axis_size(a) for a in axes.split(","))
    kw = dict(op=op, axes=axes, nbytes=group * group * 512, algorithm=alg, slow_links=slow)
    a = _sim(chip_name, topology, **kw)
    b = _sim(chip_name, topology, **kw)
    assert a.to_dict() == b.to_dict()
    pd.testing.assert_frame_equal(a.links, b.links)
    pd.testing.assert_frame_equal(a.timeline, b.timeline)


@pytest.mark.parametrize("alg", algorithm_names(CollectiveKind.ALL_GATHER))
@pytest.mark.parametrize("link", ["0:x+", "3:x-", "5:x+"])
def test_a_slow_ring_link_never_makes_the_collective_faster(alg, link):
    topology = _topo("v5e", "8", "all")
    v = 8 * (1 << 16)
    base = _sim("v5e", topology, op="all-gather", axes="x", nbytes=v, algorithm=alg)
    used = base.links.set_index("link").bytes
    times = []
    for factor in (1.0, 0.75, 0.5, 0.25):
        r = _sim("v5e", topology, op="all-gather", axes="x", nbytes=v, algorithm=alg,
                 slow_links=(f"{link}:{factor}",))
        times.append(r.time_s)
        assert r.mode == "full"
        assert r.max_link_utilization <= 1 + 1e-9
    assert times[0] == pytest.approx(base.time_s, rel=REL)
    assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:], strict=False))
    chip_idx, ad = link.split(":")
    link_id = int(chip_idx) * 2 + (0 if ad == "x+" else 1)
    if used.get(link_id, 0) > 0:
        assert times[2] > base.time_s  # a link the algorithm uses at half speed costs time
    else:
        assert times[2] == pytest.approx(base.time_s, rel=REL)


def test_a_slow_link_halves_the_bandwidth_of_every_step_that_uses_it():
    chip = get_chip("v5e")
    v = 8 * (1 << 20)
    r = _sim("v5e", _topo("v5e", "8", "all"), op="all-gather", axes="x", nbytes=v,
             algorithm="ring", slow_links=("0:x+:0.5",))
    assert r.time_s == pytest.approx(7 * (L + 2 * (v / 8) / chip.ici_link_bytes_per_s), rel=REL)


@pytest.mark.parametrize("alg", ["auto", "ring", "direct"])
def test_a_slow_link_on_an_axis_outside_the_group_changes_nothing(alg):
    topology = _topo("v5e", "8x4", "all")
    kw = dict(op="all-reduce", axes="x", nbytes=8 * 4096, algorithm=alg)
    base = _sim("v5e", topology, **kw)
    r = _sim("v5e", topology, slow_links=("0,0:y+:0.5", "3,2:y-:0.25"), **kw)
    assert r.mode == "symmetric"
    assert r.to_dict() == base.to_dict()


def test_the_position_of_one_slow_link_does_not_matter_on_a_torus():
    topology = _topo("v5e", "8x4", "all")
    kw = dict(op="all-gather", axes="x", nbytes=8 * 4096)
    times = {s: _sim("v5e", topology, slow_links=(s,), **kw).time_s
             for s in ("0,0:x+:0.5", "5,3:x+:0.5", "2,2:x-:0.5")}
    assert len({round(t, 15) for t in times.values()}) == 1
    r = _sim("v5e", topology, slow_links=("5,3:x+:0.5",), **kw)
    groups = set(r.timeline.group)
    assert groups == {0, 3}  # the representative and the group holding the slow link
    assert r.timeline.chips_represented.sum() == topology.num_chips


# -- (f) full pods --------------------------------------------------------------------------
V5P_POD_BYTES = 8960 * 119837


def test_full_v5p_pod_all_reduce_is_at_least_the_textbook_bound():
    chip = get_chip("v5p")
    topology = _topo("v5p", "16x20x28")
    assert topology.wraparound == (True, True, True) and topology.num_chips == 8960
    r = _sim("v5p", topology, op="all-reduce", axes="x,y,z", nbytes=V5P_POD_BYTES)
    textbook = 2 * V5P_POD_BYTES / (3 * chip.ici_bidi_bytes_per_s)  # tpu.md §2: 2V/(k W_ici)
    assert r.time_s >= textbook * (8960 - 1) / 8960
    assert r.time_s * chip.ici_link_bytes_per_s >= r.bytes_on_busiest_link
    assert r.mode == "symmetric" and r.algorithm == "auto (multi-axis)"
    assert r.group_size == 8960 and r.num_groups == 1


def test_full_v5p_pod_all_reduce_is_within_textbook_plus_latency():
    chip = get_chip("v5p")
    r = _sim("v5p", _topo("v5p", "16x20x28"), op="all-reduce", axes="x,y,z",
             nbytes=V5P_POD_BYTES)
    latency = 2 * 3 * 27 * L  # 6 lock-step phases, each as long as the 28-chip ring's hops
    textbook = 2 * V5P_POD_BYTES / (3 * chip.ici_bidi_bytes_per_s)
    assert r.time_s <= textbook * 1.02 + latency


def test_full_v4_pod_all_gather_along_x_is_a_split_bidirectional_ring():
    chip = get_chip("v4")
    topology = _topo("v4", "16x16x16")
    assert all(topology.wraparound)
    v = 1 << 30
    r = _sim("v4", topology, op="all-gather", axes="x", nbytes=v)
    w1 = chip.ici_link_bytes_per_s
    assert r.time_s == pytest.approx(15 * (L + v / 32 / w1), rel=REL)
    textbook = v / chip.ici_bidi_bytes_per_s  # tpu.md §2: V / W_ici, independent of X
    assert textbook * 15 / 16 <= r.time_s - 15 * L <= textbook
    assert r.group_size == 16 and r.num_groups == 256



AUTO_GRID_PODS = [  # (chip, shape, --wraparound, axes)
    ("v5e", "4x4", "all", "x,y"), ("v5e", "4x4", "none", "x,y"), ("v5e", "4x4", "all", "x,dcn"),
    ("v5p", "2x4x4", "all", "x,y,z"), ("v5p", "2x4x4", "all", "x,z"),
]


@pytest.mark.parametrize("chip_name, shape, wrap, axes", AUTO_GRID_PODS)
def test_auto_time_is_the_minimum_over_every_applicable_algorithm(chip_name, shape, wrap, axes):
    """For every op auto picks from and sizes from 1 KiB (latency bound) to 1 GiB (bandwidth
    bound), auto's time is the minimum over all algorithms that apply, each simulated on its
    own; small sizes pick a few-step algorithm, large ones a bandwidth-optimal one."""
    slices = 2 if "dcn" in axes else 1
    topology = _topo(chip_name, shape, wrap, slices)
    picks = {}
    for op in AUTO_CANDIDATES:
        names = [a for a in algorithm_names(CollectiveKind(op)) if a != "auto"]
        assert set(names) == set(AUTO_CANDIDATES[op])  # every algorithm is a candidate
        for nbytes in (1 << 10, 1 << 20, 1 << 30):
            times = {}
            for alg in names:
                try:
                    times[alg] = _sim(chip_name, topology, op=op, axes=axes, nbytes=nbytes,
                                      algorithm=alg).time_s
                except TpusimError:
                    continue
            auto = _sim(chip_name, topology, op=op, axes=axes, nbytes=nbytes)
            assert auto.time_s == min(times.values()), (op, nbytes, times, auto.algorithm)
            # auto skips simulating a candidate whose lower bound cannot beat the best so far:
            # the bound must hold for every algorithm.
            kw = {"chip": get_chip(chip_name), "topology": topology, "op": op, "axes": axes,
                  "nbytes": nbytes}
            ctx = bound_context(kw)
            for alg, t in times.items():
                assert candidate_lower_bound(alg, kw, ctx) <= t * (1 + 1e-12), (alg, op)
            picked = auto.algorithm[len("auto ("):-1]
            assert times[picked] == auto.time_s
            assert auto.latency_s <= auto.time_s
            picks[op, nbytes] = picked
    # On wrapped axes, the bandwidth-optimal pick for big all-reduces, a fewer-hop one (X/2
    # hops per axis, not multi-axis's X-1) for tiny ones. (On lines every algorithm takes X-1.)
    if "," in axes and "dcn" not in axes and wrap != "none":
        assert picks["all-reduce", 1 << 30] == "multi-axis"
        assert picks["all-reduce", 1 << 10] != "multi-axis"


@pytest.mark.parametrize("nbytes", [16 * 1024, 1 << 20, 64 << 20])
def test_auto_is_the_fastest_of_its_candidates_and_latency_aware(nbytes):
    """Small collectives are latency bound (tpu.md §2): auto then takes the X/2-hop
    bidirectional ring; large ones take the split ring's (X-1)/X bandwidth."""
    topology = _topo("v5e", "16x16")
    auto = _sim("v5e", topology, op="all-gather", axes="x", nbytes=nbytes)
    times = {alg: _sim("v5e", topology, op="all-gather", axes="x", nbytes=nbytes,
                       algorithm=alg).time_s
             for alg in ("multi-axis", "bidi-ring", "split-bidi-ring", "direct", "ring")}
    assert auto.time_s == pytest.approx(min(times.values()), rel=1e-12)
    assert auto.algorithm.startswith("auto (")
    if nbytes == 16 * 1024:
        assert auto.algorithm == "auto (bidi-ring)"
        assert auto.time_s <= 8 * L + nbytes / 9e10 * 1.01  # T_min * X/2 + V/W_ici
    if nbytes == 64 << 20:
        assert auto.algorithm in ("auto (multi-axis)", "auto (split-bidi-ring)")


def test_schedules_are_memoised_and_equal_to_a_fresh_build():
    """`build_schedule` returns the same frozen schedule for the same input (the study and plan
    speed-up) and equals one built afresh; an algorithm that refuses the group still raises."""
    from topologies.groups import group_axes

    topo = _topo("v5p", "4x4x8")
    gaxes = group_axes(topo, ("x", "y", "z"))
    kind = CollectiveKind.ALL_REDUCE
    a = build_schedule(kind, gaxes, 1024.0 * 64, "multi-axis")
    assert build_schedule(kind, gaxes, 1024.0 * 64, "multi-axis") is a
    assert a == _build_schedule(kind, gaxes, 1024.0 * 64, "multi-axis")
    # Unequal axes (4, 4, 8): the rebalanced shares are not equal thirds.
    assert len({round(st[0].moves[0].bytes, 6) for st in a.streams}) > 1
    assert build_schedule(kind, gaxes, 64, "multi-axis") is not a  # int V is its own entry
    for _ in range(2):
        with pytest.raises(TpusimError):
            build_schedule(CollectiveKind.ALL_TO_ALL, gaxes, 1024.0, "multi-axis")


@pytest.mark.parametrize("slices", [4, 8])
def test_auto_across_slices_exchanges_two_n_minus_one_messages_not_log_n(slices):
    """Over `dcn` alone, `auto` never takes halving-doubling (docs/model.md "DCN"): with a
    per-message cost o, a direct all-reduce over N slices pays exactly 2(N-1) o more."""
    topo = _topo("v5e", "4x4", slices=slices)
    base = get_chip("v5e").with_overrides(dcn_message_overhead_s=0.0)
    o = 1e-3
    kw = dict(topology=topo, op="all-reduce", axes=("dcn",), nbytes=1 << 20)
    r0 = simulate_collective(chip=base, **kw)
    r1 = simulate_collective(chip=base.with_overrides(dcn_message_overhead_s=o), **kw)
    assert r1.algorithm == "auto (direct)"
    assert r1.time_s - r0.time_s == pytest.approx(2 * (slices - 1) * o, rel=1e-9)
    hd = [c for c in r1.auto_candidates if c["algorithm"] == "halving-doubling"]
    assert hd[0]["time_s"] is None and "across slices" in hd[0]["reason"]
    # Asked for by name, halving-doubling still runs.
    r = simulate_collective(chip=base.with_overrides(dcn_message_overhead_s=o),
                            algorithm="halving-doubling", **kw)
    assert r.algorithm == "halving-doubling"


def test_a_collective_cost_depends_on_the_chip_only_through_its_link_fields():
    """The cost cache keys on `routing.LINK_FIELDS`: changing any other chip field leaves every
    collective's cost as it was (computed afresh, no cache), and each link field is in the key."""
    import dataclasses

    from sim.collectives.routing import LINK_FIELDS
    from sim.engine.costs import _cost_collective, cost_cache_key
    from topologies.groups import group_axes

    chip = get_chip("v5p")
    topo = _topo("v5p", "4x4x4", slices=2)
    cases = [("all-gather", ("x", "y")), ("all-reduce", ("z", "dcn")),
             ("all-to-all", ("x",)), ("reduce-scatter", ("x", "y", "z"))]
    costs = {}
    for kind, axes in cases:
        gaxes = group_axes(topo, axes)
        costs[kind] = (gaxes, _cost_collective(chip, topo, kind, gaxes, 2**24, "auto"))
    for f in dataclasses.fields(chip):
        v = getattr(chip, f.name)
        if f.name in LINK_FIELDS or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        try:
            other = dataclasses.replace(chip, **{f.name: v * 2 if isinstance(v, int) else v * 0.5})
        except TpusimError:  # a field whose range halving leaves (pue >= 1): double it
            other = dataclasses.replace(chip, **{f.name: v * 2})
        for kind, (gaxes, base) in costs.items():
            assert cost_cache_key(other, topo, kind, gaxes, 2**24, "auto") == \
                cost_cache_key(chip, topo, kind, gaxes, 2**24, "auto")
            c = _cost_collective(other, topo, kind, gaxes, 2**24, "auto")
            assert (c.time_s, c.latency_s, c.algorithm, c.hbm_bytes, c.group_size) == \
                (base.time_s, base.latency_s, base.algorithm, base.hbm_bytes, base.group_size), \
                f.name
            assert np.array_equal(c.class_bytes, base.class_bytes)
    gaxes = costs["all-reduce"][0]
    for name in LINK_FIELDS:
        other = dataclasses.replace(chip, **{name: getattr(chip, name) * 0.5 + 1e-9})
        assert cost_cache_key(other, topo, "all-reduce", gaxes, 2**24, "auto") != \
            cost_cache_key(chip, topo, "all-reduce", gaxes, 2**24, "auto")
        # and it changes the cost (the DCN all-reduce crosses both kinds of links)
        c = _cost_collective(other, topo, "all-reduce", gaxes, 2**24, "auto")
        assert c.time_s != costs["all-reduce"][1].time_s, name


def test_a_refused_candidates_reason_names_the_python_argument_and_the_cli_the_flag(capsys):
    """auto's and compare-collectives' refusals are kept as data: the library's say `axes`, as
    a Python caller passed it; the command line's say `--axes`, as its user typed it."""
    import pickle

    from sim.cli import main

    topology = _topo("v5e", "4x4")
    r = _sim("v5e", topology, op="all-reduce", axes="x,y", nbytes=1 << 20)
    ring = next(c for c in r.auto_candidates if c["algorithm"] == "ring")
    assert isinstance(ring["reason"], Said)
    assert "but axes x,y has 2 axes" in ring["reason"] and "--axes" not in ring["reason"]
    assert pickle.loads(pickle.dumps(ring["reason"])).params == ("axes",)  # sweeps ship it
    argv = ["--chip", "v5e", "--shape", "4x4", "--op", "all-reduce", "--axes", "x,y",
            "--bytes", "1MiB", "--json"]
    assert main(["collective", *argv]) == 0
    cli = json.loads(capsys.readouterr().out)
    ring_cli = next(c for c in cli["auto_candidates"] if c["algorithm"] == "ring")
    assert ring_cli["reason"] == ring["reason"].replace("but axes", "but --axes")
    assert main(["compare-collectives", *argv]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert next(x for x in rows if x["algorithm"] == "ring")["reason"] == ring_cli["reason"]


def test_the_share_grid_is_the_simplex_grid_row_by_row():
    """The vectorised grid of shares equals, bit for bit, the per-row construction: every
    point of the simplex at its resolution, the last share closing the row to 1."""
    import itertools

    from sim.collectives import algorithms

    for k, res in ((2, 240), (3, 120)):
        rows = [np.array(p, dtype=float) / res
                for p in itertools.product(range(res + 1), repeat=k - 1) if sum(p) <= res]
        oracle = np.array([np.append(p, 1.0 - p.sum()) for p in rows])
        grid = algorithms._share_grid(k)
        assert grid.shape == oracle.shape and grid.tobytes() == oracle.tobytes()
        assert not grid.flags.writeable
