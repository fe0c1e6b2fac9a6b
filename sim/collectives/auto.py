"""What `auto` considers: the candidate algorithms per op (in tie-break order), the ones left
out across slices, and a lower bound from a candidate's schedule alone that lets the search
skip simulating a candidate that cannot win; `HeldAlgorithms`, `auto` with some collectives'
algorithms held fixed (a what-if's step on the unperturbed pod's picks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.collectives.algorithms import CollectiveKind, build_schedule
from sim.collectives.inputs import group_axes_of, slow_link_factors
from topologies.errors import TpusimError
from topologies.groups import GroupAxis, GroupGeometry
from topologies.torus import DCN_AXIS

# `auto` simulates every algorithm that applies to the op and keeps the fastest: the compiler
# picks by cost, and the latency term (hops x per-hop latency, per step) decides small
# collectives while the bandwidth term decides large ones. Candidates are in tie-break order
# (earlier wins a tie); an algorithm that refuses the group (one-axis algorithm on several axes,
# ring without wraparound, too large to route link by link) is no candidate.
AUTO_CANDIDATES = {
    "all-gather": ("multi-axis", "bidi-ring", "split-bidi-ring", "hierarchical", "direct",
                   "line", "per-axis-ring", "ring", "halving-doubling"),
    "all-to-all": ("direct", "bidi-ring", "ring"),
}
AUTO_CANDIDATES["reduce-scatter"] = AUTO_CANDIDATES["all-gather"]
AUTO_CANDIDATES["all-reduce"] = AUTO_CANDIDATES["all-gather"]
# Across slices (a group spanning only `dcn`) the collective runs as a ring or direct exchange
# of 2(N-1) messages per chip over N slices, never by recursive halving/doubling (2 log2 N):
# the measured MaxText slowdown with slice count grows linearly in N (docs/validation.md,
# v5e 1-32 slices), and with a per-message DCN cost halving-doubling would make it grow as
# log N. `--algorithm halving-doubling` still simulates it on request.
DCN_EXCLUDED = frozenset({"halving-doubling"})


def dcn_only(axes) -> bool:
    """Whether a collective's axes (names, "a,b" text or `GroupAxis`es) are all `dcn`."""
    if isinstance(axes, str):
        axes = tuple(a.strip() for a in axes.split(",") if a.strip())
    return bool(axes) and all(
        (a.is_dcn if isinstance(a, GroupAxis) else a == DCN_AXIS) for a in axes)


def bound_context(kw) -> tuple | None:
    """(kind, group axes, ICI links per physical axis, fastest ICI link, num groups) for
    `candidate_lower_bound`, or None when no bound is used (chunks overlap steps)."""
    if kw.get("chunks", 1) != 1:
        return None
    try:
        topology = kw["topology"]
        kind = CollectiveKind(kw["op"])
        gaxes = group_axes_of(topology, kw["axes"])
        geo = GroupGeometry(topology, gaxes)
        slow = slow_link_factors(topology, kw.get("slow_links", ()), kw.get("scenario"))
    except (TpusimError, ValueError):
        return None
    chip = kw["chip"]
    fastest = chip.eff_ici_link_bytes_per_s * max([1.0, *slow.values()])
    per = 2 * topology.ndim
    mask = topology.link_mask().reshape(-1, per)
    links = {i: int(mask[:, 2 * i:2 * i + 2].sum()) for i in range(topology.ndim)}
    return kind, gaxes, links, fastest, geo.num_groups


def candidate_lower_bound(cand: str, kw, ctx) -> float | None:
    """A time the candidate cannot beat, from its schedule alone (no routing, no simulation).

    Every stream runs its steps one after another, and a step lasts at least its latency plus
    the time to drain the bytes it puts on the links of each physical axis spread evenly over
    all of them (at the fastest link's rate): the busiest link carries at least the average.
    Dead and slow links only make the true time longer."""
    kind, gaxes, links, fastest, num_groups = ctx
    try:
        schedule = build_schedule(kind, gaxes, float(kw["nbytes"]), cand,
                                  shift=kw.get("shift", 1))
    except (TpusimError, ValueError, TypeError):
        return None
    gaxes = schedule.gaxes  # ring algorithms run a twisted ring as a line
    chip = kw["chip"]
    k = len(gaxes)
    size = np.array([g.size for g in gaxes], dtype=np.int64)
    wraps = np.array([g.wraps for g in gaxes])
    dcn = np.array([g.is_dcn for g in gaxes])
    hop_len = np.array([0 if g.is_dcn else g.stride for g in gaxes], dtype=float)
    hop_lat = np.array([chip.dcn_latency_s if g.is_dcn else chip.ici_hop_latency_s * g.stride
                        for g in gaxes])
    axis_index = [g.index for g in gaxes]
    best = 0.0
    for stream in schedule.streams:
        t = 0.0
        for st in stream:
            if not st.moves:
                continue
            # Every move at once (a step of `direct` has one per destination).
            off = np.array([m.offset for m in st.moves], dtype=np.int64).reshape(-1, k)
            nbytes = np.array([m.bytes for m in st.moves], dtype=float)
            if any(m.src_bit is not None for m in st.moves):
                n_src = np.array([_num_sources(m, gaxes) for m in st.moves], dtype=float)
            else:
                lo = np.zeros_like(off)
                hi = np.broadcast_to(size - 1, off.shape).copy()
                for i, m in enumerate(st.moves):
                    if m.src_lo is not None:
                        lo[i] = np.maximum(lo[i], m.src_lo)
                        hi[i] = np.minimum(hi[i], m.src_hi)
                line = (off != 0) & ~wraps
                lo = np.where(line, np.maximum(lo, -off), lo)
                hi = np.where(line, np.minimum(hi, size - 1 - off), hi)
                n_src = np.prod(np.clip(hi - lo + 1, 0, None), axis=1).astype(float)
            live = (nbytes > 0) & (n_src > 0) & (off != 0).any(axis=1)
            if not live.any():
                continue
            # route_latency_s: per-hop latency on ICI, the DCN latency once per DCN crossing.
            steps = np.where(dcn, off[live] != 0, np.abs(off[live]))
            lat = float((steps * hop_lat).sum(axis=1).max())
            load = (nbytes * n_src)[live, None] * np.abs(off[live]) * hop_len  # per group axis
            axis_bytes: dict[int, float] = {}
            for j, a in enumerate(axis_index):
                if not dcn[j]:
                    axis_bytes[a] = axis_bytes.get(a, 0.0) + float(load[:, j].sum())
            drain = max((b * num_groups / (links[a] * fastest)
                         for a, b in axis_bytes.items() if links[a]), default=0.0)
            t += st.repeat * (lat + drain)
        best = max(best, t)
    return best


def _num_sources(m, gaxes) -> int:
    """How many chips of a group perform move `m` (its source range, bit condition and, on
    axes without wraparound, a destination that stays on the line)."""
    n = 1
    for i, (g, o) in enumerate(zip(gaxes, m.offset, strict=True)):
        lo, hi = 0, g.size - 1
        if m.src_lo is not None:
            lo, hi = max(lo, m.src_lo[i]), min(hi, m.src_hi[i])
        if o and not g.wraps:
            lo, hi = max(lo, -o), min(hi, g.size - 1 - o)
        if hi < lo:
            return 0
        if m.src_bit is not None and m.src_bit[0] == i:
            _axis, bit, value = m.src_bit
            count = sum(1 for x in range(lo, hi + 1) if (x >> bit) & 1 == value)
        else:
            count = hi - lo + 1
        n *= count
    return n


@dataclass(frozen=True)
class HeldAlgorithms:
    """`auto` with some collectives' algorithms held fixed, given as `algorithm` to
    `simulate_collective` or to a step executor (which hands it to every collective it costs):
    a collective that `picks` names, by (op, group axes, bytes V), runs the algorithm held for
    it; any other is `auto`'s. A what-if re-runs a step so on the algorithms `auto` picked on
    the unperturbed pod, to tell the algorithm switch from the change itself."""

    picks: tuple[tuple[tuple[str, tuple[GroupAxis, ...], int], str], ...]

    @staticmethod
    def key(op, axes: tuple[GroupAxis, ...], nbytes) -> tuple[str, tuple[GroupAxis, ...], int]:
        return str(op), tuple(axes), int(nbytes)

    def algorithm_for(self, op, axes, nbytes) -> str:
        """The algorithm held for this collective, else `auto`."""
        if isinstance(axes, str):
            return "auto"
        return dict(self.picks).get(self.key(op, axes, nbytes), "auto")


def picked_algorithm(label: str) -> str:
    """The algorithm of a result's `algorithm` label: `auto (multi-axis)` -> `multi-axis`."""
    if label.startswith("auto (") and label.endswith(")"):
        return label[len("auto ("):-1]
    return label
