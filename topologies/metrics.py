"""Graph metrics of one slice's ICI network: diameter, average hop count, bisection and the
all-to-all bound, on the real wiring (plain or twisted; `tpusim topology` prints them).

* Hops are shortest paths over the directed links (`Topology.link_endpoints`). A torus that
  wraps on every axis, twisted or not, is vertex-transitive (translations are automorphisms),
  so one breadth-first search from chip 0 gives every chip's distances; a slice with an axis
  that does not wrap is a product of lines and rings, and its distances add up per axis.
* Bisection: the fewest links one direction crossing a cut into two halves of equal chip
  count, taken over the slab cuts (half of one axis against the other half: for a plain torus
  the slab across its longest axis is the minimum, 2N/n_max links when it wraps), and bounded
  below over *every* balanced cut by the spectral bound lambda_2 N / 4 (lambda_2 the second
  smallest eigenvalue of the network's Laplacian, each bidirectional link an edge; Fiedler).
  The bisection bandwidth is those links times one link's one-way bandwidth.
* All-to-all bound: when every chip sends the same bytes b to every other chip over its
  shortest hop vectors, ties split evenly (tpusim's `direct` all-to-all), the busiest link
  carries `all_to_all_link_load` x b; no all-to-all finishes faster than that load over one
  link's bandwidth.

Pure topology (numpy only); `sim` turns the link counts into bandwidths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from topologies.groups import lattice_offsets, slice_axes
from topologies.torus import Topology

# The slab cuts and breadth-first searches are vectorised; past this many chips the all-pairs
# fallback of a slice without wraparound would be slow, and the closed form is used instead.
_MAX_BFS_CHIPS = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyMetrics:
    """What `topology_metrics` measures on one slice (every count is of directed links)."""

    name: str
    num_chips: int
    num_links: int
    twisted: bool
    diameter_hops: int
    average_hops: float
    bisection_links: int
    bisection_cut: str
    bisection_lower_bound_links: int
    all_to_all_link_load: float | None

    def to_dict(self) -> dict:
        return {
            "name": self.name, "num_chips": self.num_chips, "num_links": self.num_links,
            "twisted": self.twisted, "diameter_hops": self.diameter_hops,
            "average_hops": self.average_hops, "bisection_links": self.bisection_links,
            "bisection_cut": self.bisection_cut,
            "bisection_lower_bound_links": self.bisection_lower_bound_links,
            "all_to_all_link_load": self.all_to_all_link_load,
        }


def topology_metrics(topology: Topology) -> TopologyMetrics:
    """Diameter, average hops, bisection and all-to-all bound of one slice of `topology`."""
    one = Topology(shape=topology.shape, wraparound=topology.wraparound, ocs=topology.ocs,
                   twisted=topology.twisted)
    n = one.num_chips
    diameter, average = _hops(one)
    cut, where = _slab_bisection(one)
    return TopologyMetrics(
        name=one.name, num_chips=n, num_links=int(one.link_mask().sum()), twisted=one.twisted,
        diameter_hops=diameter, average_hops=average, bisection_links=cut, bisection_cut=where,
        bisection_lower_bound_links=spectral_bisection_bound(one),
        all_to_all_link_load=all_to_all_link_load(one),
    )


def _symmetric(topology: Topology) -> bool:
    return all(w or n == 1 for w, n in zip(topology.wraparound, topology.shape, strict=True))


def bfs_hops(topology: Topology, start: int = 0) -> np.ndarray:
    """Hops from chip `start` to every chip of its slice over the directed links."""
    src, dst = topology.link_endpoints()
    live = src >= 0
    ls, ld = src[live], dst[live]
    dist = np.full(topology.num_chips, -1, dtype=np.int64)
    dist[start] = 0
    k = 0
    while True:
        step = (dist[ls] == k) & (dist[ld] < 0)
        if not step.any():
            return dist
        dist[ld[step]] = k + 1
        k += 1


def _hops(topology: Topology) -> tuple[int, float]:
    """(diameter, mean hops over ordered pairs of distinct chips)."""
    n = topology.num_chips
    if n == 1:
        return 0, 0.0
    if _symmetric(topology):
        d = bfs_hops(topology)
        return int(d.max()), float(d.sum() / (n - 1))
    # A product of lines and rings: hop counts add up per axis.
    diameter, mean = 0, 0.0
    for size, wraps in zip(topology.shape, topology.wraparound, strict=True):
        i = np.arange(size)
        gap = np.abs(i[:, None] - i[None, :])
        if wraps:
            gap = np.minimum(gap, size - gap)
        diameter += int(gap.max())
        mean += float(gap.mean())  # over all ordered pairs, a chip with itself included
    return diameter, mean * n / (n - 1)


def _slab_bisection(topology: Topology) -> tuple[int, str]:
    """The fewest links (one direction) across a slab cut: chips whose coordinate along one
    axis is below half its length against the rest. Axes of odd length are skipped (no slab
    halves the chips); a slice with no even axis reports 0."""
    src, dst = topology.link_endpoints()
    live = src >= 0
    coords = topology.all_coords()
    best, where = None, "none"
    for a, size in enumerate(topology.shape):
        if size < 2 or size % 2:
            continue
        side = coords[:, a] < size // 2
        cut = int(np.count_nonzero(side[src[live]] & ~side[dst[live]]))
        if best is None or cut < best:
            best, where = cut, f"{'xyz'[a]} < {size // 2}"
    return (0, where) if best is None else (best, where)


def spectral_bisection_bound(topology: Topology) -> int:
    """A lower bound on the links (one direction) crossing any balanced cut: lambda_2 N / 4
    rounded up (0 for an odd chip count). lambda_2 comes in closed form: a torus is a Cayley
    graph of an abelian group, whose Laplacian eigenvalues are sum_i (2 - 2 cos(2 pi xi_i))
    over the group's characters xi (the dual of its lattice); a line of n has
    2 - 2 cos(pi j / n), and a product's lambda_2 is its factors' smallest."""
    n = topology.num_chips
    if n < 2 or n % 2:
        return 0
    if _symmetric(topology) and topology.twisted:
        lam = _twisted_lambda2(topology)
    else:
        lam = min(
            (2 - 2 * math.cos((2 if wraps and size > 2 else 1) * math.pi / size))
            * (2 if wraps and size == 2 else 1)
            for size, wraps in zip(topology.shape, topology.wraparound, strict=True)
            if size > 1)
    return max(0, math.ceil(lam * n / 4 - 1e-9))


def _twisted_lambda2(topology: Topology) -> float:
    """lambda_2 of a twisted torus from its characters: xi in (1/2k) Z^3 with xi . v an
    integer for every generator v of its lattice (k e_short + k e_long..., 2k e_long)."""
    shape = topology.shape
    k = min(shape)
    m = np.stack(np.meshgrid(*[np.arange(2 * k)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    ok = np.ones(len(m), dtype=bool)
    for a in range(3):
        v = np.zeros(3, dtype=np.int64)
        v[a] = shape[a]
        for j, shift in topology.twist_of(a):
            v[j] = shift
        ok &= (m * v).sum(axis=1) % (2 * k) == 0  # integers: exact
    xi = m[ok] / (2 * k)
    lam = (2 - 2 * np.cos(2 * np.pi * xi)).sum(axis=1)
    return float(np.sort(lam)[1])


def all_to_all_link_load(topology: Topology) -> float | None:
    """The busiest link's bytes per byte of every ordered pair in an all-to-all over the whole
    slice: each chip sends to every other over its shortest hop vectors, ties split evenly.
    On a vertex-transitive torus every link of a class carries the same load, the class's
    hops summed over one chip's destinations. None for a slice that does not wrap on every
    axis (its loads are not uniform)."""
    if topology.num_chips == 1:
        return 0.0
    if not _symmetric(topology):
        return None
    gaxes = slice_axes(topology)
    load = np.zeros(2 * topology.ndim)
    for vecs in lattice_offsets(gaxes).values():
        w = 1.0 / len(vecs)
        for vec in vecs:
            for g, o in zip(gaxes, vec, strict=True):
                if o:
                    load[2 * g.index + (0 if o > 0 else 1)] += w * abs(o)
    return float(load.max())


def compare_report(plain: Topology, twisted: Topology | None,
                   link_bytes_per_s: float) -> dict:
    """`tpusim topology`'s report: the plain slice's metrics (and the twisted one's with the
    ratios twisted/plain), with bisection and all-to-all bandwidths at `link_bytes_per_s`
    (one link, one direction)."""

    def one(t: Topology) -> dict:
        m = topology_metrics(t).to_dict()
        m["bisection_bytes_per_s"] = m["bisection_links"] * link_bytes_per_s
        load = m["all_to_all_link_load"]
        m["all_to_all_bytes_per_s_per_chip"] = (
            None if not load else (m["num_chips"] - 1) * link_bytes_per_s / load)
        return m

    out = {"link_bytes_per_s": link_bytes_per_s, "plain": one(plain),
           "twisted": None if twisted is None else one(twisted)}
    if twisted is not None:
        p, t = out["plain"], out["twisted"]
        out["twisted_over_plain"] = {
            key: (t[key] / p[key] if p[key] else None)
            for key in ("diameter_hops", "average_hops", "bisection_links",
                        "bisection_bytes_per_s", "all_to_all_bytes_per_s_per_chip")
            if t[key] is not None and p[key] is not None}
    return out
