"""Collective algorithms: each turns a collective into concurrent streams of link-level steps.

An algorithm produces a `Schedule`: one or more *streams* that run concurrently (e.g. the k parts
of a multi-axis all-gather), each a sequence of `Step`s. A step is a set of `Move`s that every chip
of the replica group performs at once: "send `bytes` to the chip at `offset`" (offsets are per
group axis; on a ring the sign picks the direction). Moves may be restricted to a range of source
coordinates (the ends of a line). Identical consecutive steps are folded into one `repeat`.

`routing` turns steps into `network.Batch`es, either on link classes (symmetric mode, exact under
translation symmetry) or on individual links (full detail). The registry names below are part of
the CLI interface: ring, bidi-ring, split-bidi-ring, line, multi-axis, per-axis-ring,
hierarchical, halving-doubling, direct, auto.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from topologies.errors import TpusimError
from topologies.groups import GroupAxis, as_lines, lattice_offsets
from topologies.registry import Registry
from topologies.validate import one_of, short_repr


class CollectiveKind(enum.StrEnum):
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    ALL_TO_ALL = "all-to-all"
    PERMUTE = "collective-permute"
    SEND = "send"


def parse_kind(op: object) -> CollectiveKind:
    """`op`'s text as a CollectiveKind, or a one-line error naming the kinds."""
    try:
        return CollectiveKind(op)
    except ValueError:
        raise TpusimError(f"unknown {{op}} {short_repr(op)}; "
                          f"{one_of(op, [k.value for k in CollectiveKind])}", "op") from None


@dataclass(frozen=True, slots=True)
class Move:
    """Every chip of the group sends `bytes` to the chip at `offset` (per group axis).

    `src_lo`/`src_hi` (per group axis, inclusive) restrict which chips send; None = all.
    """

    offset: tuple[int, ...]
    bytes: float
    src_lo: tuple[int, ...] | None = None
    src_hi: tuple[int, ...] | None = None
    src_bit: tuple[int, int, int] | None = None  # (group axis, bit, value) the source must have


@dataclass(frozen=True, slots=True)
class Step:
    moves: tuple[Move, ...]
    repeat: int = 1
    label: str = ""
    phase: int = 0  # index of the per-axis phase this step belongs to (for phase barriers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """An algorithm's plan for one collective on one replica group."""

    kind: CollectiveKind
    algorithm: str
    gaxes: tuple[GroupAxis, ...]
    streams: tuple[tuple[Step, ...], ...]
    reduces: bool  # received data is summed into a local buffer (reduce-scatter phases)
    sync_phases: bool = False  # streams start phase p together, after all finished phase p-1

    @property
    def translation_invariant(self) -> bool:
        """True if every chip does exactly the same moves on rings (symmetric mode is exact)."""
        if not all(g.wraps or g.size == 1 for g in self.gaxes):
            return False
        return all(m.src_lo is None and m.src_bit is None
                   for s in self.streams for st in s for m in st.moves)

    def bytes_sent_per_chip(self) -> float:
        """Bytes one chip injects (for a chip that performs every move it is eligible for)."""
        return sum(step_bytes_per_chip(st) * st.repeat for s in self.streams for st in s)


def step_bytes_per_chip(step: Step) -> float:
    """Bytes one chip sends in one repetition of a step. Moves conditioned on a coordinate bit
    come in complementary sets (bit clear / bit set): a chip performs only one set."""
    plain = sum(m.bytes for m in step.moves if m.src_bit is None)
    by_bit: dict[tuple[int, int], dict[int, float]] = {}
    for m in step.moves:
        if m.src_bit is not None:
            axis, bit, value = m.src_bit
            side = by_bit.setdefault((axis, bit), {})
            side[value] = side.get(value, 0.0) + m.bytes
    return plain + sum(max(side.values()) for side in by_bit.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmInfo:
    name: str
    description: str
    build: Callable[..., Schedule]


ALGORITHMS: Registry[AlgorithmInfo] = Registry("collective algorithm",
                                               listing="docs/cli.md lists them")


# -- single-axis building blocks ----------------------------------------------------------
def _unit(k: int, ai: int, v: int) -> tuple[int, ...]:
    o = [0] * k
    o[ai] = v
    return tuple(o)


def _rng(k: int, ai: int, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Source range restricting axis ai to [lo, hi], other axes unrestricted."""
    los = [0] * k
    his = [1 << 30] * k
    los[ai], his[ai] = lo, hi
    return tuple(los), tuple(his)


def _ring_phase(k: int, ai: int, n: int, msg: float, wraps: bool, label: str) -> list[Step]:
    """Unidirectional ring: n-1 steps, each chip sends `msg` to its + neighbour."""
    if n <= 1:
        return []
    if wraps:
        return [Step((Move(_unit(k, ai, 1), msg),), repeat=n - 1, label=label)]
    # No wraparound link: the ring closes by routing the last chip's message back along the
    # line (n-1 hops on the - links), which the simulation charges honestly.
    lo, hi = _rng(k, ai, 0, n - 2)
    lo2, hi2 = _rng(k, ai, n - 1, n - 1)
    moves = (Move(_unit(k, ai, 1), msg, lo, hi), Move(_unit(k, ai, -(n - 1)), msg, lo2, hi2))
    return [Step(moves, repeat=n - 1, label=label)]


def _bidi_phase(
    k: int, ai: int, n: int, msg: float, label: str, *, transpose: bool = False
) -> list[Step]:
    """Textbook bidirectional ring: msg both ways each hop, floor(n/2) hops.

    For even n the all-gather's last hop brings the antipode's shard from both sides (the
    textbook's V/W_ici counts it twice); a reduce-scatter must not sum that partial twice, so
    its last hop sends half of it each way."""
    if n <= 1:
        return []
    both = (Move(_unit(k, ai, 1), msg), Move(_unit(k, ai, -1), msg))
    if not transpose or n % 2:
        return [Step(both, repeat=n // 2, label=label)]
    halves = (Move(_unit(k, ai, 1), msg / 2), Move(_unit(k, ai, -1), msg / 2))
    steps = [Step(both, repeat=n // 2 - 1, label=label)] if n > 2 else []
    return steps + [Step(halves, label=label)]


def _split_phase(k: int, ai: int, n: int, msg: float, label: str) -> list[Step]:
    """Split bidirectional ring: half of each shard each way, n-1 hops."""
    if n <= 1:
        return []
    moves = (Move(_unit(k, ai, 1), msg / 2), Move(_unit(k, ai, -1), msg / 2))
    return [Step(moves, repeat=n - 1, label=label)]


def _line_phase(k: int, ai: int, n: int, msg: float, label: str, *, transpose: bool) -> list[Step]:
    """Bidirectional line: n-1 steps; link i->i+1 carries exactly the shards that must cross it.

    All-gather: at step s the + link out of chip i is busy iff i >= s-1 (it forwards the shard of
    chip i-s+1). Reduce-scatter is the transpose (time reversed).
    """
    steps = []
    for s in range(1, n):
        if not transpose:
            plus, minus = (s - 1, n - 2), (1, n - s)
        else:
            plus, minus = (0, n - 1 - s), (s, n - 1)
        moves = (
            Move(_unit(k, ai, 1), msg, *_rng(k, ai, *plus)),
            Move(_unit(k, ai, -1), msg, *_rng(k, ai, *minus)),
        )
        steps.append(Step(moves, label=label))
    return steps


def _axis_phase(
    style: str, k: int, ai: int, g: GroupAxis, msg: float, label: str, *, transpose: bool
) -> list[Step]:
    if style == "ring":
        return _ring_phase(k, ai, g.size, msg, g.wraps, label)
    if style == "bidi":
        return _bidi_phase(k, ai, g.size, msg, label, transpose=transpose)
    if style == "split":
        return _split_phase(k, ai, g.size, msg, label)
    if style == "line":
        return _line_phase(k, ai, g.size, msg, label, transpose=transpose)
    raise AssertionError(style)


def _best_style(g: GroupAxis) -> str:
    """What a TPU does on one axis: a split bidirectional ring if it wraps, else a line.

    Over DCN each chip has one NIC, so both directions share it: a unidirectional ring.
    """
    if g.is_dcn:
        return "ring"
    return "split" if g.wraps else "line"


def _phases(
    kind: CollectiveKind, gaxes, order: list[int], styles: dict[int, str], v: float, tag: str
) -> list[Step]:
    """Chained per-axis phases for one stream carrying `v` bytes (the stream's share of V).

    All-gather walks `order` growing the shard; reduce-scatter walks it shrinking the buffer;
    all-reduce = reduce-scatter over `order` then all-gather over reversed(order).
    """
    k = len(gaxes)
    n_total = int(np.prod([gaxes[i].size for i in order])) if order else 1
    steps: list[Step] = []
    phase = [0]

    def emit(new: list[Step]) -> None:
        steps.extend(dataclasses.replace(st, phase=phase[0]) for st in new)
        phase[0] += 1

    def ag(seq: list[int], shard: float) -> None:
        for ai in seq:
            g = gaxes[ai]
            emit(_axis_phase(styles[ai], k, ai, g, shard, f"{tag}AG {g.name}", transpose=False))
            shard *= g.size

    def rs(seq: list[int], buf: float) -> float:
        for ai in seq:
            g = gaxes[ai]
            buf /= g.size
            emit(_axis_phase(styles[ai], k, ai, g, buf, f"{tag}RS {g.name}", transpose=True))
        return buf

    if kind == CollectiveKind.ALL_GATHER:
        ag(order, v / n_total)
    elif kind == CollectiveKind.REDUCE_SCATTER:
        rs(order, v)
    elif kind == CollectiveKind.ALL_REDUCE:
        shard = rs(order, v)
        ag(list(reversed(order)), shard)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return steps


def _nontrivial(gaxes) -> list[int]:
    return [i for i, g in enumerate(gaxes) if g.size > 1]


def _require_one_axis(name: str, gaxes) -> int:
    nt = _nontrivial(gaxes)
    if len(nt) > 1:
        axes = ",".join(gaxes[i].name for i in nt)
        raise TpusimError(
            f"algorithm {name!r} runs on one axis but {{axes}} {axes} has {len(nt)} axes of "
            f"size > 1; use multi-axis or per-axis-ring for several axes, or collective over one "
            f"axis", "axes")
    return nt[0] if nt else 0


def _require_wrap(name: str, g: GroupAxis) -> None:
    if g.size > 1 and not g.wraps and g.wrap_leaves:
        raise _twisted_line_error(name, g, "line or auto")
    if g.size > 1 and not g.wraps:
        raise TpusimError(
            f"algorithm {name!r} needs a ring, but axis {g.name} (size {g.size}) has no "
            f"wraparound; use line or auto, or give {{wraparound}} all (or include {g.name})",
            "wraparound")


def _twisted_line_error(name: str, g: GroupAxis, use: str) -> TpusimError:
    return TpusimError(
        f"algorithm {name!r} needs a ring, but on a twisted torus axis {g.name}'s wraparound "
        f"link lands half the long side away, outside this group, so {g.name} is a line here; "
        f"use {use}, or drop {{twist}}", "twist")


_REDUCING = (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE)
_GATHERLIKE = (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE)


def _not_for(name: str, kind: CollectiveKind, ok: str) -> TpusimError:
    return TpusimError(
        f"algorithm {name!r} does not implement {kind}; for {kind} use one of: {ok}"
    )


# -- registered algorithms ----------------------------------------------------------------
def _single_axis_algo(name: str, style: str, need_wrap: bool):
    def build(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
        if kind == CollectiveKind.ALL_TO_ALL and style in ("ring", "bidi"):
            return _alltoall_relay(name, gaxes, v, bidi=(style == "bidi"))
        if kind not in _GATHERLIKE:
            raise _not_for(name, kind, applicable_algorithms(kind))
        ai = _require_one_axis(name, gaxes)
        g = gaxes[ai]
        if need_wrap:
            _require_wrap(name, g)
        if style == "line" and g.is_dcn:
            raise TpusimError(
                "algorithm 'line' is for an ICI axis; over dcn use ring or auto"
            )
        steps = _phases(kind, gaxes, [ai], {ai: style}, v, "")
        return Schedule(
            kind=kind, algorithm=name, gaxes=gaxes, streams=(tuple(steps),),
            reduces=kind in _REDUCING,
        )

    return build


def _phase_loads(steps: list[Step], gaxes, num_phases: int) -> np.ndarray:
    """Bytes per link (busiest link) that a stream puts on the network in each phase."""
    load = np.zeros(num_phases)
    for st in steps:
        per = 0.0
        for m in st.moves:
            for g, o in zip(gaxes, m.offset, strict=True):
                if o:
                    per = max(per, m.bytes * abs(o) * g.stride)
        load[st.phase] += per * st.repeat
    return load


def _share_grid(k: int) -> np.ndarray:
    """The simplex grid `_balanced_shares` searches for k parts (rows sum to 1), built once
    per k: it depends on k alone, and building it is most of the cost of a 3-axis schedule."""
    hit = _SHARE_GRIDS.get(k)
    if hit is None:
        res = 240 if k == 2 else 120
        parts = np.array([p for p in itertools.product(range(res + 1), repeat=k - 1)
                          if sum(p) <= res], dtype=float).reshape(-1, k - 1) / res
        # The last share closes each row to 1 (a row sum over k - 1 <= 2 entries adds them in
        # order, as a per-row loop did: the same floats).
        hit = _SHARE_GRIDS[k] = np.column_stack([parts, 1.0 - parts.sum(axis=1)])
        hit.flags.writeable = False
    return hit


_SHARE_GRIDS: dict[int, np.ndarray] = {}


def _balanced_shares(c: np.ndarray) -> np.ndarray:
    """Shares w (sum 1) of the parts minimising sum_p max_j w_j c[j, p].

    The parts run their phases in lock step (phase p starts when every part finished p-1) and
    in each phase they use different axes, so a phase lasts as long as its slowest part. With
    equal axis lengths the rotation is symmetric and equal shares are optimal; with unequal
    lengths equal shares leave axes idle, so the shares are rebalanced (a fine simplex grid,
    deterministic; equal shares win ties)."""
    k = c.shape[0]
    equal = np.full(k, 1.0 / k)
    if k == 1:
        return equal
    cands = _share_grid(k)
    cost = (cands[:, :, None] * c[None, :, :]).max(axis=1).sum(axis=1)
    best = cands[int(np.argmin(cost))].copy()
    eq_cost = float((equal[:, None] * c).max(axis=0).sum())
    if eq_cost <= float(cost.min()) * (1 + 1e-9):
        return equal
    return best


def _multi_axis(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
    """All ICI axes at once: k streams, stream j visits the axes rotated by j.

    The textbook credits k axes with k times the bandwidth, V/(k W). The parts advance through
    their phases in lock step, each phase on a different axis, so they never contend. With equal
    axis lengths they carry V/k each; with unequal lengths the shares are rebalanced so that the
    parts' phases take about equally long (`_balanced_shares`).
    DCN (if present) is done hierarchically: for all-gather first (smallest shards), for
    reduce-scatter last, for all-reduce in the middle, so DCN carries the least data.
    """
    if kind not in _GATHERLIKE:
        raise _not_for("multi-axis", kind, applicable_algorithms(kind))
    ici = [i for i in _nontrivial(gaxes) if not gaxes[i].is_dcn]
    dcn = [i for i in _nontrivial(gaxes) if gaxes[i].is_dcn]
    styles = {i: _best_style(gaxes[i]) for i in range(len(gaxes))}
    k = max(len(ici), 1)
    orders = []
    for j in range(k):
        rot = ici[j:] + ici[:j]
        if kind == CollectiveKind.ALL_GATHER:
            orders.append(dcn + rot)
        else:  # reduce-scatter: ICI then DCN; all-reduce: RS that way, AG back (DCN first)
            orders.append(rot + dcn)
    unit = [_phases(kind, gaxes, order, styles, 1.0, "") for order in orders]
    num_phases = 1 + max((st.phase for u in unit for st in u), default=0)
    c = np.array([_phase_loads(u, gaxes, num_phases) for u in unit])
    shares = _balanced_shares(c)
    streams = []
    for j, order in enumerate(orders):
        if shares[j] <= 0:
            continue
        streams.append(tuple(_phases(kind, gaxes, order, styles, v * shares[j], f"part{j} ")))
    return Schedule(
        kind=kind, algorithm="multi-axis", gaxes=gaxes, streams=tuple(streams),
        reduces=kind in _REDUCING, sync_phases=len(streams) > 1,
    )


def _per_axis_ring(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
    """One unidirectional ring per axis, axes one after another (hierarchical simulators)."""
    if kind not in _GATHERLIKE:
        raise _not_for("per-axis-ring", kind, applicable_algorithms(kind))
    order = _nontrivial(gaxes)
    styles = {i: "ring" for i in range(len(gaxes))}
    steps = _phases(kind, gaxes, order, styles, v, "")
    return Schedule(
        kind=kind, algorithm="per-axis-ring", gaxes=gaxes, streams=(tuple(steps),),
        reduces=kind in _REDUCING,
    )


def _shortest_offsets(g: GroupAxis) -> list[tuple[int, float]]:
    """(offset, weight) for every destination along one axis, shortest way round on a ring.

    Ties (distance exactly n/2 on a ring) split evenly between the two directions. On a line
    every signed offset is listed; chips whose destination falls off the line skip it.
    """
    n = g.size
    if n == 1:
        return [(0, 1.0)]
    if g.is_dcn:
        return [(0, 1.0)] + [(t, 1.0) for t in range(1, n)]
    if not g.wraps:
        return [(o, 1.0) for o in range(-(n - 1), n)]
    out = [(0, 1.0)]
    for t in range(1, n):
        if t < n - t:
            out.append((t, 1.0))
        elif t > n - t:
            out.append((-(n - t), 1.0))
        else:
            out += [(t, 0.5), (-t, 0.5)]
    return out


# The (offset, weight, source range) of every direct move, per group: thousands of moves on a
# large group, the same for every byte count (a step's collectives differ only in bytes).
_DIRECT_SKELETONS: dict[tuple[GroupAxis, ...], tuple[tuple, ...]] = {}


def _direct_moves(gaxes, per_pair_bytes: float) -> tuple[Move, ...]:
    skel = _DIRECT_SKELETONS.get(gaxes)
    if skel is None:
        skel = _direct_skeleton(gaxes)
        if len(_DIRECT_SKELETONS) >= 256:
            _DIRECT_SKELETONS.clear()
        _DIRECT_SKELETONS[gaxes] = skel
    return tuple(Move(off, per_pair_bytes * w, lo, hi) for off, w, lo, hi in skel)


def _direct_skeleton(gaxes) -> tuple[tuple, ...]:
    if any(g.twist for g in gaxes):
        return _twisted_skeleton(gaxes)
    per_axis = [_shortest_offsets(g) for g in gaxes]
    moves = []
    for combo in itertools.product(*per_axis):
        off = tuple(o for o, _ in combo)
        if all(o == 0 for o in off):
            continue
        w = math.prod(wt for _, wt in combo)  # powers of 1/2: exact in any order
        moves.append((off, w, *_on_the_line(gaxes, off, range(len(gaxes)))))
    return tuple(moves)


def _on_the_line(gaxes, off: tuple[int, ...], lines) -> tuple[tuple | None, tuple | None]:
    """(src_lo, src_hi) of a direct move by `off`: if it moves along an axis without wraparound
    (among the group axes `lines`), only chips whose destination stays on every line send it;
    otherwise (None, None), every chip sends."""
    if not any(not gaxes[i].wraps and gaxes[i].size > 1 and off[i] for i in lines):
        return None, None
    los, his = [], []
    for g, o in zip(gaxes, off, strict=True):
        if g.wraps or g.size == 1:
            los.append(0)
            his.append(1 << 30)
        else:
            los.append(max(0, -o))
            his.append(min(g.size - 1, g.size - 1 - o))
    return tuple(los), tuple(his)


def _twisted_skeleton(gaxes) -> tuple[tuple, ...]:
    """`direct`'s moves on a group holding a twisted ring: the twisted rings and the long axes
    they shift along form one lattice, whose destinations each take all their shortest hop
    vectors with equal shares (`lattice_offsets`, ties split as on a ring); the group's other
    axes (lines, plain rings, DCN) combine with them as before."""
    lat = [i for i, g in enumerate(gaxes)
           if g.twist or any(j == g.index for h in gaxes for j, _ in h.twist)]
    rest = [i for i in range(len(gaxes)) if i not in lat]
    table = lattice_offsets(tuple(gaxes[i] for i in lat))
    lattice = [(vecs, 1.0 / len(vecs)) for vecs in table.values()]
    per_rest = [_shortest_offsets(gaxes[i]) for i in rest]
    moves = []
    for (vecs, w_lat), combo in itertools.product(lattice, itertools.product(*per_rest)):
        for vec in vecs:
            off = [0] * len(gaxes)
            for i, o in zip(lat, vec, strict=True):
                off[i] = o
            w = w_lat
            for i, (o, wt) in zip(rest, combo, strict=True):
                off[i] = o
                w *= wt
            off_t = tuple(off)
            if not any(off_t):
                continue
            moves.append((off_t, w, *_on_the_line(gaxes, off_t, rest)))
    return tuple(moves)


def _direct(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
    """Every pair over its own dimension-order route, all at once."""
    n = int(np.prod([g.size for g in gaxes]))
    if kind == CollectiveKind.ALL_GATHER:
        streams = ((Step(_direct_moves(gaxes, v / n), label="AG direct"),),)
    elif kind == CollectiveKind.REDUCE_SCATTER:
        streams = ((Step(_direct_moves(gaxes, v / n), label="RS direct"),),)
    elif kind == CollectiveKind.ALL_REDUCE:
        streams = (
            (
                Step(_direct_moves(gaxes, v / n), label="RS direct"),
                Step(_direct_moves(gaxes, v / n), label="AG direct"),
            ),
        )
    elif kind == CollectiveKind.ALL_TO_ALL:
        streams = ((Step(_direct_moves(gaxes, v / (n * n)), label="A2A direct"),),)
    else:
        raise _not_for("direct", kind, applicable_algorithms(kind))
    return Schedule(
        kind=kind, algorithm="direct", gaxes=gaxes, streams=streams, reduces=kind in _REDUCING
    )


def _alltoall_relay(name: str, gaxes, v: float, *, bidi: bool) -> Schedule:
    """All-to-all by relaying along a ring: step s carries the chunks still travelling."""
    ai = _require_one_axis(name, gaxes)
    g = gaxes[ai]
    if bidi:
        _require_wrap(name, g)
    n = g.size
    k = len(gaxes)
    chunk = v / (n * n)
    steps: list[Step] = []
    if n > 1 and not bidi:
        if not g.wraps and g.wrap_leaves:
            raise _twisted_line_error(name, g, "direct or auto")
        if not g.wraps:
            raise TpusimError(
                f"algorithm {name!r} for all-to-all needs a ring, but axis {g.name} has no "
                f"wraparound; use direct or auto"
            )
        for s in range(1, n):
            steps.append(Step((Move(_unit(k, ai, 1), (n - s) * chunk),), label="A2A ring"))
    elif n > 1:
        half = (n - 1) // 2  # distances that go one way in full
        for s in range(1, n // 2 + 1):
            c = max(0, half - s + 1) + (0.5 if n % 2 == 0 else 0.0)
            moves = (Move(_unit(k, ai, 1), c * chunk), Move(_unit(k, ai, -1), c * chunk))
            steps.append(Step(moves, label="A2A bidi"))
    return Schedule(
        kind=CollectiveKind.ALL_TO_ALL, algorithm=name, gaxes=gaxes, streams=(tuple(steps),),
        reduces=False,
    )


def _halving_doubling(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
    """Recursive halving (reduce-scatter) and doubling (all-gather) on one axis of 2^m chips.

    At each step a chip exchanges with the partner whose index differs in one bit: the chip
    with that bit clear sends forward, the other backward, over d = 2^bit hops. Few steps (log2
    X) but long routes: on a torus d chips' messages share every link of a segment, so this is
    the algorithm for switched networks, shown here for comparison.
    """
    if kind not in _GATHERLIKE:
        raise _not_for("halving-doubling", kind, applicable_algorithms(kind))
    ai = _require_one_axis("halving-doubling", gaxes)
    g = gaxes[ai]
    n = g.size
    if n & (n - 1):
        raise TpusimError(
            f"algorithm 'halving-doubling' needs a power-of-two group, but axis {g.name} has "
            f"{n} chips; use ring, multi-axis or auto"
        )
    k = len(gaxes)
    m = n.bit_length() - 1

    def exchange(bit: int, nbytes: float, label: str) -> Step:
        d = 1 << bit
        return Step((Move(_unit(k, ai, d), nbytes, src_bit=(ai, bit, 0)),
                     Move(_unit(k, ai, -d), nbytes, src_bit=(ai, bit, 1))), label=label)

    rs = [exchange(m - 1 - i, v / (2 << i), f"RS halving d={1 << (m - 1 - i)}")
          for i in range(m)]
    ag = [exchange(i, v / n * (1 << i), f"AG doubling d={1 << i}") for i in range(m)]
    if kind == CollectiveKind.REDUCE_SCATTER:
        steps = rs
    elif kind == CollectiveKind.ALL_GATHER:
        steps = ag
    else:
        steps = rs + ag
    return Schedule(kind=kind, algorithm="halving-doubling", gaxes=gaxes,
                    streams=(tuple(steps),), reduces=kind in _REDUCING)


def _fewest_hops_style(g: GroupAxis) -> str:
    """The single-axis schedule with the fewest steps: a bidirectional ring (X/2 hops) where
    the axis wraps, a line (X-1) where it does not; over DCN a ring (one NIC per chip)."""
    if g.is_dcn:
        return "ring"
    return "bidi" if g.wraps else "line"


def _hierarchical(kind: CollectiveKind, gaxes, v: float, **_) -> Schedule:
    """One axis after another, each with its fewest-hop schedule (`_fewest_hops_style`).

    Latency-optimal among the per-axis schedules: a pass over axes of X_i chips takes
    sum(X_i/2) hops on a wrapped torus, as many as direct's longest route, but each link carries
    only the shards of its own ring. DCN goes first for all-gather (smallest shards) and last
    for reduce-scatter, as in multi-axis."""
    if kind not in _GATHERLIKE:
        raise _not_for("hierarchical", kind, applicable_algorithms(kind))
    ici = [i for i in _nontrivial(gaxes) if not gaxes[i].is_dcn]
    dcn = [i for i in _nontrivial(gaxes) if gaxes[i].is_dcn]
    order = dcn + ici if kind == CollectiveKind.ALL_GATHER else ici + dcn
    styles = {i: _fewest_hops_style(gaxes[i]) for i in range(len(gaxes))}
    steps = _phases(kind, gaxes, order, styles, v, "")
    return Schedule(
        kind=kind, algorithm="hierarchical", gaxes=gaxes, streams=(tuple(steps),),
        reduces=kind in _REDUCING,
    )


def _auto(kind: CollectiveKind, gaxes, v: float, **kw) -> Schedule:
    """auto as a bare schedule, without simulating: multi-axis for gathers/reductions, direct
    otherwise. `simulate_collective` resolves `auto` itself: it simulates every applicable
    candidate and keeps the fastest (`auto.AUTO_CANDIDATES`)."""
    if kind in _GATHERLIKE:
        s = _multi_axis(kind, as_lines(gaxes), v)
    else:
        s = ALGORITHMS.get("direct").build(kind, gaxes, v, **kw)
    return dataclasses.replace(s, algorithm=f"auto ({s.algorithm})")


def _permute(kind: CollectiveKind, gaxes, v: float, *, shift: int = 1, **_) -> Schedule:
    """Shift by `shift` along one axis: every chip sends V to the chip `shift` ahead."""
    ai = _require_one_axis("collective-permute", gaxes)
    g = gaxes[ai]
    k = len(gaxes)
    if g.size == 1:
        return Schedule(kind=kind, algorithm="direct", gaxes=gaxes, streams=((),), reduces=False)
    if g.wraps:
        t = shift % g.size
        if t == 0:
            moves: tuple[Move, ...] = ()
        elif 2 * t < g.size or g.is_dcn:
            moves = (Move(_unit(k, ai, t), v),)
        elif 2 * t > g.size:
            moves = (Move(_unit(k, ai, -(g.size - t)), v),)
        else:  # exactly half way round: both directions carry half
            moves = (Move(_unit(k, ai, t), v / 2), Move(_unit(k, ai, -t), v / 2))
    else:
        if abs(shift) >= g.size:
            raise TpusimError(
                f"{{shift}} {shift} moves every chip off the {g.size}-chip line {g.name} (no "
                f"wraparound); use |shift| < {g.size}", "shift")
        lo, hi = _rng(k, ai, max(0, -shift), min(g.size - 1, g.size - 1 - shift))
        moves = (Move(_unit(k, ai, shift), v, lo, hi),) if shift else ()
    steps = (Step(moves, label=f"permute {g.name}{shift:+d}"),) if moves else ()
    return Schedule(kind=kind, algorithm="direct", gaxes=gaxes, streams=(steps,), reduces=False)


def _direct_or_special(kind: CollectiveKind, gaxes, v: float, **kw) -> Schedule:
    if kind == CollectiveKind.PERMUTE:
        return _permute(kind, gaxes, v, **kw)
    return _direct(kind, gaxes, v, **kw)


ALGORITHMS.add("auto", AlgorithmInfo(
    name="auto", build=_auto,
    description="the fastest applicable algorithm, latency and bandwidth both simulated "
                "(simulate.py); as a bare schedule, multi-axis or direct"))
ALGORITHMS.add("ring", AlgorithmInfo(
    name="ring", build=_single_axis_algo("ring", "ring", need_wrap=False),
    description="unidirectional ring on one axis: (X-1) hops of V/X"))
ALGORITHMS.add("bidi-ring", AlgorithmInfo(
    name="bidi-ring", build=_single_axis_algo("bidi-ring", "bidi", need_wrap=True),
    description="textbook bidirectional ring: every shard both ways, floor(X/2) hops"))
ALGORITHMS.add("split-bidi-ring", AlgorithmInfo(
    name="split-bidi-ring", build=_single_axis_algo("split-bidi-ring", "split", need_wrap=True),
    description="half of every shard each way round the ring, X-1 hops"))
ALGORITHMS.add("line", AlgorithmInfo(
    name="line", build=_single_axis_algo("line", "line", need_wrap=False),
    description="bidirectional line (no wraparound links used): X-1 hops"))
ALGORITHMS.add("multi-axis", AlgorithmInfo(
    name="multi-axis", build=_multi_axis,
    description="all given axes at once, k parts on rotated axis orders: V/(k W)"))
ALGORITHMS.add("per-axis-ring", AlgorithmInfo(
    name="per-axis-ring", build=_per_axis_ring,
    description="one unidirectional ring per axis, axes in turn (hierarchical simulators)"))
ALGORITHMS.add("hierarchical", AlgorithmInfo(
    name="hierarchical", build=_hierarchical,
    description="one axis after another, each with its fewest-hop ring (bidirectional X/2 "
                "hops where it wraps, a line where not)"))
ALGORITHMS.add("halving-doubling", AlgorithmInfo(
    name="halving-doubling", build=_halving_doubling,
    description="recursive halving/doubling: log2(X) steps to partners 2^i away"))
ALGORITHMS.add("direct", AlgorithmInfo(
    name="direct", build=_direct_or_special,
    description="every pair over its own dimension-order route, all at once"))

_APPLICABLE = {
    CollectiveKind.ALL_GATHER: [
        "auto", "ring", "bidi-ring", "split-bidi-ring", "line", "multi-axis", "per-axis-ring",
        "hierarchical", "halving-doubling", "direct",
    ],
    CollectiveKind.ALL_TO_ALL: ["auto", "direct", "ring", "bidi-ring"],
    CollectiveKind.PERMUTE: ["auto", "direct"],
    CollectiveKind.SEND: ["auto", "direct"],
}
_APPLICABLE[CollectiveKind.REDUCE_SCATTER] = _APPLICABLE[CollectiveKind.ALL_GATHER]
_APPLICABLE[CollectiveKind.ALL_REDUCE] = _APPLICABLE[CollectiveKind.ALL_GATHER]


def applicable_algorithms(kind: CollectiveKind) -> str:
    return ", ".join(_APPLICABLE[kind])


def algorithm_names(kind: CollectiveKind) -> list[str]:
    return list(_APPLICABLE[kind])


# Schedules by (kind, group axes, V, algorithm, shift): a pure function of those (frozen
# values, shared safely), built again and again otherwise: `auto` builds every candidate's to
# bound and simulate it, and a study's points that change only link numbers (or `plan`'s
# candidates that share groups) cost the same collectives again. Bounded; cleared when full.
SCHEDULE_CACHE_SIZE = 2048
_SCHEDULE_CACHE: dict[tuple, Schedule] = {}


def build_schedule(
    kind: CollectiveKind, gaxes: tuple[GroupAxis, ...], v: float, algorithm: str = "auto",
    *, shift: int = 1,
) -> Schedule:
    """The algorithm's schedule for one collective of V bytes on one replica group (memoised
    per process; an algorithm that refuses the group raises every time)."""
    key = (kind, type(kind), gaxes, v, type(v), algorithm, shift)  # 1000 == 1000.0: types too
    hit = _SCHEDULE_CACHE.get(key)
    if hit is None:
        hit = _build_schedule(kind, gaxes, v, algorithm, shift=shift)
        if len(_SCHEDULE_CACHE) >= SCHEDULE_CACHE_SIZE:
            _SCHEDULE_CACHE.clear()
        _SCHEDULE_CACHE[key] = hit
    return hit


def _build_schedule(
    kind: CollectiveKind, gaxes: tuple[GroupAxis, ...], v: float, algorithm: str = "auto",
    *, shift: int = 1,
) -> Schedule:
    """The algorithm's schedule for one collective of V bytes on one replica group."""
    info = ALGORITHMS.get(algorithm)
    if info.name not in _APPLICABLE[kind]:
        raise _not_for(info.name, kind, applicable_algorithms(kind))
    if kind == CollectiveKind.PERMUTE:
        ai = _require_one_axis("collective-permute", gaxes)
        del ai
        return _permute(kind, gaxes, v, shift=shift)
    if info.name not in ("direct", "auto"):
        # Ring algorithms run a twisted ring as a line (`as_lines`, docs/model/pods.md); direct
        # routes every pair over its shortest hop vectors through the twist.
        gaxes = as_lines(gaxes)
    return info.build(kind, gaxes, v, shift=shift)
