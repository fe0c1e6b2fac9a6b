"""Vector classes: the per-chip engine's path for pods where (nearly) every chip differs, e.g.
`--chip-variation` on 8960 chips (docs/model.md, "Per-chip engine", "Vector classes").

Chips that run the same program with the same op scales and the same collective costs, and that
differ only in speed, form a *vector class*: its state is advanced as a whole, with every time an
array over its chips (numpy), as long as every chip of the vector sees the same sequence of
events. The model is exactly `sim.engine.class_engine`'s (each chip: a core replaying compute ops in
order; its HBM and outgoing link classes as fluid resources shared by collective DMA, with
`sim.engine.network.FluidNetwork`'s arithmetic, while compute streams HBM at its own pace; a
collective starts when its whole replica group has arrived and ends when its last member has
drained):

* Lazy splitting. Before each event, every chip of the vector computes its next event (the
  earliest of its pending core, fluid and collective events) and, for a fluid event, which
  batches finish. Where these choices differ, the vector splits into vectors that agree, and
  each part goes on alone. Vectors that reach the same discrete state again (same ops done, same
  ops in flight, same queues) merge back, so the number of vectors stays near the number of
  distinct event orders, not the number of chips.
* Rendezvous by group index arrays: a collective's start is the maximum arrival over its group
  (`np.maximum.at` over the chips' group indices), its end the maximum drain.
* Conservative ordering. Each chip has its own clock, so a chip may process its next event only
  if no collective it waits on can start (or end) before that event: the engine always advances
  the vector holding the earliest pending event of the whole pod (nothing can happen before it),
  and a chip's event at time t is processed early only if t is below a lower bound of every
  unresolved rendezvous it takes part in (the latest arrival so far, and for members still on
  their way, their clock plus the least time their remaining compute can take). Chips for which
  this cannot be shown wait (the vector splits; it merges back once they catch up).

* Several programs (pipeline stages): a vector's chips run one program; rendezvous are keyed
  by (program, op id), with their arrival and drain arrays over that program's chips. A
  point-to-point send is a rendezvous of its sender alone (its own route's cost); its end
  completes the receive op on the peer chip, which waits for it (with the send's arrival, or
  the sender's arrival bound, plus the send's least time as its lower bound) from the step's
  start or, when only core ops depend on it, from when the core reaches the first of them.

So every chip's events are processed in the order the SimPy model processes them, and every
time is computed with the same formula: the result equals `mode="per-chip"` (one SimPy actor per
chip) up to float rounding of sums taken in another order (tested to 1e-9 relative).

Cost. The work per event is a fixed number of numpy calls wherever that can be had with the same
bits: a vector keeps each in-flight collective's candidate row (`VectorRun._coll_row`) until one
of its groups resolves or its phase there changes (with XLA's per-matrix weight collectives a
vector has ~12 in flight); its batches in flight are columns of [chip, batch] arrays; the
rendezvous bounds of all its unresolved groups are read at once from flat arrays; max-min
filling sums loads with `np.add.accumulate` (the same additions in the same order as a loop).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from sim.engine.perchip import (
    PreparedStep,
    add_path_links,
    coll_labels,
    common_parts,
    coords_text,
    core_predecessors,
    no_receiver_error,
    per_link_bytes_of_chips,
    relabel,
    scaled_cost,
    two_sends_error,
    wait_wall_time,
)
from sim.engine.result import ChipClasses, ClassProgram, StepResult
from sim.engine.summary import _summarize
from topologies.errors import TpusimError
from topologies.groups import NUM_CLASSES
from topologies.progress import task
from workloads.trace import OpKind, Unit

HBM = NUM_CLASSES  # the HBM resource follows the link classes, as in the class engine
NRES = NUM_CLASSES + 1
# Core phases.
C_WAIT, C_TIMEOUT, C_COLL, C_DONE = range(4)
# Collective phases (an op id absent from `coll` is not started or done); K_RCV: a receive op
# waiting for its send to end.
K_ARR, K_FLU, K_DRN, K_RCV = range(1, 5)
# Event labels.
E_CORE, E_FLUID, E_CADM, E_CEND, E_PCIE, E_RCV = range(6)
_LABEL = {K_ARR: E_CADM, K_DRN: E_CEND, K_RCV: E_RCV}
# Seed of each run's op hashes (a vector's `dh`: the sum of its done ops' hashes, part of the
# discrete state vectors merge on): every run draws the same hashes, whatever ran before it.
HASH_SEED = 12345
# A run that reports its progress asks whether an update is due every this many vector steps
# (tens of microseconds of numpy work each): the check costs well under 0.1% of the run.
PROGRESS_EVERY_STEPS = 256
# Collective candidate rows (`VectorRun._coll_row`): "keep" them until they change; "check"
# also compares every kept row with a fresh one; "recompute" them all at every event (the
# engine before rows were kept). The last two are for tests (`PerChipConfig.vector_rows`).
ROW_MODES = ("keep", "check", "recompute")


def _sliced_row(row, idx):
    """A kept candidate row (`VectorRun._coll_row`) restricted to the chips `idx`."""
    t, bad, at = row
    if bad is None:
        return t[idx], None, None
    b = bad[idx]
    if not b.any():
        return t[idx], None, None
    if t is None or b.all():
        return None, b, at[idx]
    return t[idx], b, at[idx]


def _merged_row(r0, r1, k0, k1):
    """Two kept candidate rows of the same collective (of `k0` and `k1` chips) side by side,
    for two vectors merged into one."""
    (t0, b0, g0), (t1, b1, g1) = r0, r1
    if b0 is None and b1 is None:
        return np.concatenate([t0, t1]), None, None
    bad = np.concatenate([np.zeros(k0, dtype=bool) if b0 is None else b0,
                          np.zeros(k1, dtype=bool) if b1 is None else b1])
    at = np.concatenate([np.zeros(k0, dtype=np.int64) if g0 is None else g0,  # never read
                         np.zeros(k1, dtype=np.int64) if g1 is None else g1])
    if t0 is None and t1 is None:
        return None, bad, at
    t = np.concatenate([np.full(k0, np.inf) if t0 is None else t0,
                        np.full(k1, np.inf) if t1 is None else t1])
    return t, bad, at


def _check_row(kept, fresh, j) -> None:
    def full(row):
        t, bad, at = row
        n = len(t) if t is not None else len(bad)
        return (np.full(n, np.inf) if t is None else t,
                np.zeros(n, dtype=bool) if bad is None else bad,
                np.full(n, -1) if at is None else np.where(bad, at, -1))

    (t0, b0, g0), (t1, b1, g1) = full(kept), full(fresh)
    if not (np.array_equal(t0, t1) and np.array_equal(b0, b1) and np.array_equal(g0, g1)):
        raise RuntimeError(f"invariant violated: the kept candidate row of collective {j} is "
                           "stale")


class _Kind:
    """What the chips of a vector share: program, op scales and the cost of each collective
    (point-to-point sends included), and for each receive op the send that completes it.

    `prog` is the program's index, `base` the offset of its op ids in the run's collective
    keys (collective op j of this kind is rendezvous key base + j); `recv` maps each receive
    op to the key of the send that completes it (a send is a rendezvous of its sender alone,
    its group the sender's rank in its program)."""

    def __init__(self, kid, ops, scale, coll_cost, overlap, chip, rates0, cap_links, prog=0,
                 base=0, recv=None, sends=()):
        self.id = kid
        self.ops = ops
        self.cc = coll_cost  # {op id: its CollectiveCost}, sends included
        n = len(ops)
        self.prog = prog
        self.base = base
        self.recv = dict(recv or {})
        self.rsend = set(sends)
        # The rendezvous key of each op: its own (base + id), a receive's its send's.
        self.gk = [base + i for i in range(n)]
        for rid, key in self.recv.items():
            self.gk[rid] = key
        self.rid_of = {key: rid for rid, key in self.recv.items()}
        mxu0, int80, vpu0, hbm0 = rates0
        self.ovh = float(chip.op_overhead_s)
        self.flops = np.zeros(n)
        self.hbm = np.zeros(n)
        self.rate0 = np.ones(n)
        self.idle = np.zeros(n)
        self.core = []
        for op in ops:
            if op.kind == OpKind.COMPUTE:
                k = scale.get(op.id, 1.0)
                self.flops[op.id] = op.flops * k
                self.hbm[op.id] = op.hbm_bytes * k
                self.rate0[op.id] = chip.unit_rate(op)
                self.core.append(op.id)
            elif op.kind == OpKind.IDLE:
                self.idle[op.id] = op.duration_s
                self.core.append(op.id)
            elif op.kind == OpKind.COLLECTIVE and not overlap and op.id not in self.recv:
                # (a receive takes no resources and is completed by its send, as in the
                # class engine)
                self.core.append(op.id)
        self.hbm0 = hbm0
        # MXU work at the full rate (a narrow op's FLOPs count as the array time they take).
        self.mxu_flops = float(sum(self.flops[o.id] / chip.mxu_fill(o.narrow_dim) for o in ops
                                   if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU))
        self.vpu_flops = float(sum(self.flops[o.id] for o in ops
                                   if o.kind == OpKind.COMPUTE and o.unit == Unit.VPU))
        self.mxu0, self.vpu0 = mxu0, vpu0
        self.host_dur = np.array([op.bytes / chip.pcie_bytes_per_s if op.kind == OpKind.HOST
                                  else 0.0 for op in ops])
        self.core_pos = {o: i for i, o in enumerate(self.core)}
        # Least time the core needs for its ops (speed 1, without overhead; HBM alone): the
        # lower bound of a chip's arrival at a collective (sum / speed + overheads).
        base = np.array([max(self.flops[o] / self.rate0[o], self.hbm[o] / hbm0)
                         if ops[o].kind == OpKind.COMPUTE else 0.0 for o in self.core])
        self.csum = np.concatenate([[0.0], np.cumsum(base)])
        self.cnt = np.concatenate([[0], np.cumsum([ops[o].kind == OpKind.COMPUTE
                                                   for o in self.core])]).astype(float)
        self.fix = np.concatenate([[0.0], np.cumsum([self.idle[o] for o in self.core])])
        self.deps_left = np.array([len(op.deps) for op in ops], dtype=np.int64)
        self.dependents = [[] for _ in range(n)]
        for op in ops:
            for d in op.deps:
                self.dependents[d].append(op.id)
        # Last core op among each collective's dependencies (-1: none).
        self.pdep = {op.id: max((self.core_pos[d] for d in op.deps if d in self.core_pos),
                                default=-1)
                     for op in ops if op.kind == OpKind.COLLECTIVE}
        self.coll = {}
        self.coll_cap = {}  # each collective's speed cap (`CollectiveCost.max_speed`)
        for op_id, cc in coll_cost.items():
            used = np.flatnonzero(cc.class_bytes > 0)
            # As the class engine's batches: no zero-byte HBM hop (it would still pace).
            hbm = [HBM] if cc.hbm_bytes > 0 or len(used) == 0 else []
            res = np.append(used, hbm).astype(np.int64)
            w = np.append(cc.class_bytes[used], [cc.hbm_bytes] * len(hbm))
            empty = len(res) == 0 or float(np.max(w, initial=0.0)) <= 0
            self.coll_cap[op_id] = float(cc.max_speed)
            self.coll[op_id] = (res, w, float(cc.latency_s), empty,
                                np.bincount(res, weights=w, minlength=NRES))
        self.comp_w = {}
        # Least time of a collective: its latency plus its busiest link class at full rate.
        cap = np.asarray(cap_links, dtype=float)

        def least(j):
            cc = coll_cost[j]
            return float(cc.latency_s) + max(float(np.max(cc.class_bytes / cap, initial=0.0)),
                                             1.0 / cc.max_speed)

        # Collectives between two consecutive core ops (after op i-1, before op i) lengthen
        # that path; on the core (--no-overlap) a collective takes at least its least time.
        gap = np.zeros(len(self.core))
        for i, o in enumerate(self.core):
            if ops[o].kind == OpKind.COLLECTIVE:
                gap[i] = least(o)
                continue
            for d in ops[o].deps:
                if ops[d].kind == OpKind.COLLECTIVE and d in coll_cost and overlap and \
                        self.pdep.get(d, -2) == i - 1:
                    gap[i] = max(gap[i], least(d))
        self.gsum = np.concatenate([[0.0], np.cumsum(gap)])
        # A send's least time: its end is at least its arrival plus this (a receive's bound).
        self.least = {j: least(j) for j in coll_cost if j in self.rsend}
        # A receive whose dependents are all core ops changes nothing on its chip before the
        # core reaches the first of them: it is waited for ("activated") from then on only,
        # and completes no earlier than that (`lazy_at`: that core op -> its receives). The
        # others are waited for from the start (`eager`).
        self.lazy_at: dict[int, list[int]] = {}
        self.eager = []
        for rid in sorted(self.recv):
            deps = self.dependents[rid]
            if deps and all(d in self.core_pos for d in deps):
                first = min(deps, key=lambda d: self.core_pos[d])
                self.lazy_at.setdefault(first, []).append(rid)
            else:
                self.eager.append(rid)

    def lb_arrival(self, j, c0, running, now, s):
        """Lower bound of the arrival at collective `j` of chips whose first unstarted core op
        is `c0` (index into `core`; `running`: the op before it has not ended), clock `now`,
        speed `s`: the core ops up to `j`'s last core dependency at their least time, and the
        collectives chained between them."""
        p = self.pdep[j] + 1
        if p <= c0:
            return now
        g0 = c0 if running else c0 + 1
        gaps = self.gsum[p] - self.gsum[g0] if p > g0 else 0.0
        return now + (self.csum[p] - self.csum[c0]) / s + self.ovh * (self.cnt[p] - self.cnt[c0]) \
            + (self.fix[p] - self.fix[c0]) + gaps


class _Vec:
    __slots__ = ("kind", "a", "core_i", "core_phase", "coll", "fluid", "left", "dh", "pq",
                 "pcur", "key", "dead", "id", "skey", "cand", "blocked", "crow", "act")

    def copy_state(self, other):
        self.kind = other.kind
        self.core_i = other.core_i
        self.act = other.act
        self.core_phase = other.core_phase
        self.coll = dict(other.coll)
        self.fluid = list(other.fluid)
        self.left = other.left.copy()
        self.dh = other.dh
        self.pq = list(other.pq)
        self.pcur = other.pcur


class VectorRun:
    """One run of the vector engine (see the module docstring)."""

    def __init__(self, *, progs, nchips, speed, kinds_of_chip, kinds, coll_geo, cap_links,
                 overlap, sends=(), recv_rank=None, rows="keep"):
        """`progs`: per program index, (its chips, its number of ops), or None where no chip
        runs it; `coll_geo`: per rendezvous key, (program, each of the program's chips' group
        index (by rank: the chip's position in the program's chips), group size); `rows`: one
        of ROW_MODES."""
        if rows not in ROW_MODES:
            raise TpusimError(f"vector rows {rows!r} must be one of {', '.join(ROW_MODES)}")
        self.rows = rows
        self.N = nchips
        self.overlap = overlap
        self.cap = np.asarray(cap_links, dtype=float)  # link classes (HBM per chip)
        self.speed = speed
        self.kinds = kinds
        self.kind_of = kinds_of_chip
        self.progs = progs
        # Per program, [rank, op] timelines and [collective, rank] arrival and drain times:
        # a pipeline's stages hold their own ops and collectives, on their own chips.
        self.start = [None if pr is None else np.zeros((len(pr[0]), pr[1])) for pr in progs]
        self.end = [None if pr is None else np.zeros((len(pr[0]), pr[1])) for pr in progs]
        colls = sorted(coll_geo)
        self.cprog = {j: coll_geo[j][0] for j in colls}
        rows: dict[int, int] = {}
        self.cidx = {}
        for j in colls:
            p = self.cprog[j]
            self.cidx[j] = rows[p] = rows.get(p, -1) + 1
        self.arr = [None if pr is None else np.full((rows.get(p, -1) + 1, len(pr[0])), np.nan)
                    for p, pr in enumerate(progs)]
        self.drn = [None if pr is None else np.full((rows.get(p, -1) + 1, len(pr[0])), np.nan)
                    for p, pr in enumerate(progs)]
        self.goc = {j: coll_geo[j][1] for j in colls}
        self.gsize = {j: coll_geo[j][2] for j in colls}
        # Members of each key: every chip of its program.
        self.expect = {j: len(progs[self.cprog[j]][0]) for j in colls}
        ng = {j: int(self.goc[j].max(initial=0)) + 1 for j in colls}
        self.acnt = {j: np.zeros(ng[j], dtype=np.int64) for j in colls}
        self.dcnt = {j: np.zeros(ng[j], dtype=np.int64) for j in colls}
        # Each group's latest arrival (amax) and latest drain (dmax), and the arrival lower
        # bound of its members still on their way (alb), as views into two flat arrays: `lo`
        # holds every collective's amax, then every dmax; `lb` the alb, then -inf beside the
        # dmax. A chip waiting on group index i of `lo` cannot see the rendezvous resolve
        # before max(lo[i], lb[i]) (`_step` takes it for all its unresolved groups at once).
        off = np.concatenate([[0], np.cumsum([ng[j] for j in colls], dtype=np.int64)])
        tot = int(off[-1])
        self.goff = {j: int(off[i]) for i, j in enumerate(colls)}
        self.doff = tot
        # After them, per send, the lower bound of its end: its arrival plus its least time
        # (lo), or its arrival bound plus it while the sender is on its way (lb). A waiting
        # receive reads it at the sender's rank.
        self.sends = sorted(sends)
        eo = np.concatenate([[0], np.cumsum([ng[j] for j in self.sends], dtype=np.int64)])
        self.eoff = {j: 2 * tot + int(eo[i]) for i, j in enumerate(self.sends)}
        self.lo = np.full(2 * tot + int(eo[-1]), -np.inf)
        self.lb = np.full(2 * tot + int(eo[-1]), -np.inf)
        self.elo = {j: self.lo[o:o + ng[j]] for j, o in self.eoff.items()}
        self.elb = {j: self.lb[o:o + ng[j]] for j, o in self.eoff.items()}
        # Per (program, receive op): the rank of each of its chips' sender.
        self.recv_rank = recv_rank or {}
        self.amax = {j: self.lo[o:o + ng[j]] for j, o in self.goff.items()}
        self.dmax = {j: self.lo[tot + o:tot + o + ng[j]] for j, o in self.goff.items()}
        self.alb = {j: self.lb[o:o + ng[j]] for j, o in self.goff.items()}
        # Per program, the collectives with some but not all members arrived (and its sends
        # not all arrived: their receivers wait on them from the start).
        self.open: list[set[int]] = [set() for _ in progs]
        self.atot: dict[int, int] = {}
        n = max(pr[1] for pr in progs if pr is not None)
        rng = np.random.default_rng(HASH_SEED)
        self.hash = [int(x) for x in rng.integers(1, 2**62, size=n)]
        self.waiters: dict[int, set[int]] = {}
        self.vecs: dict[int, _Vec] = {}
        self.by_state: dict[tuple, int] = {}
        self._fluid_memo: dict[tuple, tuple] = {}
        self.heap: list = []  # (key, vector id) of vectors ready to step
        self.bheap: list = []  # (key, vector id) of blocked vectors
        self._seq = 0
        self.final: list[_Vec] = []
        self.max_vectors = 0
        self.steps = 0

    # -- vector bookkeeping -----------------------------------------------------------------
    def _new(self, state_from, a) -> _Vec:
        v = _Vec()
        v.copy_state(state_from)
        v.a = a
        v.key = math.inf
        v.dead = False
        v.skey = None
        v.cand = None
        v.blocked = False
        v.crow = {}
        v.id = self._seq
        self._seq += 1
        self.vecs[v.id] = v
        gk = v.kind.gk
        for j in v.coll:
            self.waiters.setdefault(gk[j], set()).add(v.id)
        self.max_vectors = max(self.max_vectors, len(self.vecs))
        return v

    def _kill(self, v: _Vec) -> None:
        v.dead = True
        self.vecs.pop(v.id, None)
        gk = v.kind.gk
        for j in v.coll:
            self.waiters.get(gk[j], set()).discard(v.id)
        if v.skey is not None and self.by_state.get(v.skey) == v.id:
            del self.by_state[v.skey]

    def _split(self, v: _Vec, codes: np.ndarray) -> list[tuple[int, _Vec, object]]:
        """Sub-vectors of `v` by equal `codes`, with the indices of their chips in `v` (v itself
        is retired when it splits)."""
        c0 = codes[0]
        if (codes == c0).all():
            return [(int(c0), v, slice(None))]
        vals = np.unique(codes)
        self._kill(v)
        out = []
        for c in vals.tolist():
            idx = np.flatnonzero(codes == c)
            p = self._new(v, {k: x[idx] for k, x in v.a.items()})
            # A collective's row is elementwise in the chips: the part's rows are the parent's.
            p.crow = {j: _sliced_row(row, idx) for j, row in v.crow.items()}
            out.append((c, p, idx))
        return out

    def _state_key(self, v: _Vec) -> tuple:
        return (v.kind.id, v.core_i, v.core_phase, tuple(sorted(v.coll.items())),
                tuple(v.fluid), v.dh, tuple(v.pq), v.pcur, v.act)

    def _settle(self, v: _Vec) -> None:
        """After a step: merge with a vector in the same discrete state, re-key, re-queue."""
        if v.skey is not None and self.by_state.get(v.skey) == v.id:
            del self.by_state[v.skey]
        sk = self._state_key(v)
        other = self.by_state.get(sk)
        if other is not None and other != v.id and other in self.vecs:
            w = self.vecs[other]
            self._kill(w)
            self._kill(v)
            m = self._new(v, {k: np.concatenate([w.a[k], x]) for k, x in v.a.items()})
            kw, kv = len(w.a["now"]), len(v.a["now"])
            m.crow = {j: _merged_row(w.crow[j], row, kw, kv) for j, row in v.crow.items()
                      if j in w.crow}
            v = m
        v.skey = sk
        self.by_state[sk] = v.id
        self._push(v)

    def _push(self, v: _Vec) -> None:
        # The candidates stay valid until the vector's next event or a rendezvous of one of
        # its collectives resolves (`_wake` pushes it again).
        v.cand = cand = self._candidates(v)
        key = cand[4]
        v.key = key
        v.blocked = False
        if key < math.inf:
            heapq.heappush(self.heap, (key, v.id))
        elif not v.coll and v.core_phase == C_DONE and not v.pq and v.pcur < 0:
            self._kill(v)
            self.final.append(v)

    # -- candidates -------------------------------------------------------------------------
    def _candidates(self, v: _Vec):
        """(earliest known event time per chip, labels, time matrix, unresolved items)."""
        a = v.a
        k = len(a["now"])
        labels, rows, unres = [], [], []
        if v.core_phase == C_TIMEOUT:
            labels.append((E_CORE, -1))
            rows.append(a["core_t"])
        if v.fluid:
            labels.append((E_FLUID, -1))
            rows.append(a["ft"])
        if v.pcur >= 0:
            labels.append((E_PCIE, v.pcur))
            rows.append(a["pcie_t"])
        crow = v.crow
        for j, ph in v.coll.items():
            if ph == K_FLU:
                continue
            row = crow.get(j)
            if row is None:
                row = self._coll_row(v, j, ph)
                if self.rows != "recompute":
                    crow[j] = row
            elif self.rows == "check":
                _check_row(row, self._coll_row(v, j, ph), j)
            t, bad, at = row
            if t is not None:
                labels.append((_LABEL[ph], j))
                rows.append(t)
            if bad is not None:
                unres.append((bad, at))
        if not rows:
            return np.full(k, np.inf), labels, None, unres, math.inf
        m = np.array(rows) if len(rows) > 1 else rows[0][None, :]
        tmin = m.min(axis=0) if len(rows) > 1 else rows[0]
        key = float(tmin.min())
        if key != key:  # pragma: no cover - NaN
            raise RuntimeError("invariant violated: a NaN event time")
        return tmin, labels, m, unres, key

    def _coll_row(self, v: _Vec, j: int, ph: int):
        """Collective `j`'s candidate row for `v` in phase `ph`: (each chip's start (K_ARR) or
        end (K_DRN) time, inf where its group's rendezvous is unresolved; None if unresolved
        for every chip), the unresolved chips' mask and each chip's group index in `self.lo`
        (both None if none is unresolved). A resolved group's time
        is final (all its members are in), so the row changes only when one of the vector's
        groups resolves (`_wake` drops it) or the vector's phase at `j` changes: it is kept in
        `v.crow` until then instead of being recomputed at every event."""
        g = v.a[f"g{j}"]
        k = v.kind.gk[j]
        if ph == K_ARR:
            ok = self.acnt[k][g] == self.gsize[k]
            if ok.all():
                return self.amax[k][g] + v.kind.coll[j][2], None, None
            at = g + self.goff[k]
            if not ok.any():
                return None, ~ok, at
            return np.where(ok, self.amax[k][g] + v.kind.coll[j][2], np.inf), ~ok, at
        ok = self.dcnt[k][g] == self.gsize[k]
        if ph == K_RCV:
            # A receive completes when its send ends, and not before it was activated (the
            # core reached its first dependent; 0 for one waited for from the start). Not
            # resolved: its bound is the send's arrival plus its least time (or the sender's
            # arrival bound plus it).
            end = np.maximum(self.dmax[k][g], v.a[f"w{j}"])
            if ok.all():
                return end, None, None
            at = g + self.eoff[k]
            if not ok.any():
                return None, ~ok, at
            return np.where(ok, end, np.inf), ~ok, at
        if ok.all():
            return self.dmax[k][g], None, None
        at = g + (self.doff + self.goff[k])
        if not ok.any():
            return None, ~ok, at
        return np.where(ok, self.dmax[k][g], np.inf), ~ok, at

    # -- main loop --------------------------------------------------------------------------
    def run(self, init: list[_Vec]) -> None:
        """Run to the end from the vectors `init` (time 0). The point-to-point sends are open
        rendezvous from the start: their receivers may wait on them before any has arrived."""
        for v in init:  # time 0: ops without dependencies start (collectives in op order)
            t0 = v.a["now"]
            recv = v.kind.recv
            for op in v.kind.ops:
                if v.left[op.id] == 0 and op.kind == OpKind.COLLECTIVE and self.overlap and \
                        op.id not in recv:
                    self._arrive(v, op.id, t0)
                elif v.left[op.id] == 0 and op.kind == OpKind.HOST:
                    v.pq.append(op.id)
            self._pcie_next(v, t0)
            self._start_core(v, t0)
        for k in self.sends:
            p = self.cprog[k]
            if self.atot.get(k, 0) < self.expect[k] and k not in self.open[p]:
                self.open[p].add(k)
                self._init_bound(k)
        for v in init:
            self._settle(v)
        ncore = max(len(K.core) for K in self.kinds)
        with task("vector classes", total=ncore, unit="op", detail=f"{self.N:,} chips") as t:
            self._loop(t, ncore)
            if not self.vecs:
                t.update(ncore)
        if self.vecs:
            left = next(iter(self.vecs.values()))
            raise TpusimError(
                f"internal error: the vector engine stalled with {len(self.vecs)} vectors "
                f"waiting (core at op {left.core_i}, collectives {sorted(left.coll)[:3]})"
            )

    def _loop(self, t, ncore: int) -> None:
        """Step the ready vector with the earliest event until none is left (`t`: the progress
        task, asked every PROGRESS_EVERY_STEPS steps: the slowest vector's core position)."""
        check = PROGRESS_EVERY_STEPS if t.active else math.inf
        while True:
            if not self.heap:
                # Every vector left waits on a rendezvous its bounds could not place: release
                # them all (the earliest event of the pod is always safe, so this progresses).
                for _key, vid in self.bheap:
                    w = self.vecs.get(vid)
                    if w is not None and w.blocked:
                        self._push(w)
                self.bheap = []
                if not self.heap:
                    break
                continue
            key, vid = heapq.heappop(self.heap)
            v = self.vecs.get(vid)
            if v is None or v.blocked or key != v.key:
                continue
            self.steps += 1
            if self.steps >= check:
                check = self.steps + PROGRESS_EVERY_STEPS
                if t.due():
                    slowest = min((w.core_i / len(w.kind.core) for w in self.vecs.values()
                                   if w.kind.core), default=1.0)
                    t.update(int(slowest * ncore),
                             detail=f"{self.N:,} chips in {len(self.vecs):,} vectors")
            self._step(v, min(key, self._blocked_min()))

    def _block(self, v: _Vec) -> None:
        """`v` waits until a rendezvous of one of its collectives resolves (`_wake`)."""
        cand = v.cand
        if cand is None:
            v.cand = cand = self._candidates(v)
        v.key = cand[4]
        v.blocked = True
        if v.key < math.inf:
            heapq.heappush(self.bheap, (v.key, v.id))

    def _blocked_min(self) -> float:
        """Earliest pending event of a blocked vector (with the ready vectors' earliest, a
        lower bound of every event still to come)."""
        h = self.bheap
        while h:
            key, vid = h[0]
            w = self.vecs.get(vid)
            if w is not None and w.blocked and w.key == key:
                return key
            heapq.heappop(h)
        return math.inf

    def _step(self, v: _Vec, T: float) -> None:
        cand, v.cand = v.cand, None
        tmin, labels, m, unres, _key = cand if cand is not None else self._candidates(v)
        safe = np.isfinite(tmin)
        if len(unres) == 1:
            bad, at = unres[0]
            safe &= ~bad | (tmin <= np.maximum(np.maximum(self.lo[at], self.lb[at]), T))
        elif unres:
            # A chip's event is safe if it comes no later than the lower bound of every
            # rendezvous it waits on: the latest arrival (drain) so far, the arrival bound of
            # the members on their way, and T.
            bad = np.array([u[0] for u in unres])
            at = np.array([u[1] for u in unres])
            lb = np.maximum(np.maximum(self.lo[at], self.lb[at]), T)
            safe &= (~bad | (tmin <= lb)).all(axis=0)
        if not safe.all():
            # Chips whose next event may come after a rendezvous they wait on wait for it to
            # resolve; the others go on.
            if not safe.any():
                v.cand = cand
                self._block(v)
                return
            for c, p, _idx in self._split(v, safe.astype(np.int64)):
                if c == 0:
                    self._block(p)
                else:
                    self._step(p, T)
            return
        choice = m.argmin(axis=0)
        for c, p, idx in self._split(v, choice):
            self._event(p, labels[c], m[c][idx])

    # -- events -----------------------------------------------------------------------------
    def _event(self, v: _Vec, label, t: np.ndarray) -> None:
        kind, j = label
        fluid_event = kind == E_FLUID or (kind == E_CADM and not v.kind.coll[j][3])
        if fluid_event and v.fluid:
            # The fluid state at the event, and which batches finish there, per chip (split
            # where they differ).
            rem = self._advanced(v, t, snap=kind == E_FLUID)
            fin = rem <= 1e-12
            if fin.all() or not fin.any():
                codes = None
            elif len(v.fluid) == 1:
                codes = fin[:, 0].astype(np.int64)
            else:  # bit i: batch i finishes
                codes = (fin.astype(np.int64) << np.arange(len(v.fluid))).sum(axis=1)
            parts = self._split(v, codes) if codes is not None else [(0, v, slice(None))]
            for _c, p, idx in parts:
                self._event_uniform(p, label, t[idx], rem[idx])
            return
        self._event_uniform(v, label, t, None)

    def _advanced(self, v, t, snap):
        """Remaining fraction of every batch at `t`, [chip, batch] (FluidNetwork._advance,
        then the timer's snap of what is left only by rounding)."""
        a = v.a
        d = t - a["fl_last"]
        d = np.where(d > 0, d, 0.0)
        sp = a["V"]
        r = a["R"] - sp * d[:, None]
        if snap:
            tol = (1e-12 * np.maximum(t, 1e-9))[:, None]
            r = np.where((r <= 1e-9) | ((sp > 0) & (r / np.where(sp > 0, sp, 1.0) <= tol)),
                         0.0, r)
        return r

    def _event_uniform(self, v: _Vec, label, t: np.ndarray, rem) -> None:
        kind, j = label
        a = v.a
        a["now"] = t
        done_now: list[int] = []
        if kind == E_FLUID:
            self._advance(v, t, rem)
            done_now = self._resched(v, t)
        elif kind == E_CORE:
            self._core_done(v, v.kind.core[v.core_i], t)  # its timeout
        elif kind == E_PCIE:
            op = v.pcur
            v.pcur = -1
            self._op_done(v, op, t)
            self._pcie_next(v, t)
        elif kind == E_CADM:
            res, w, lat, empty, wb = v.kind.coll[j]
            if v.coll[j] == K_ARR:
                st = self.amax[v.kind.gk[j]][a[f"g{j}"]]
                self.start[v.kind.prog][a["pr"], j] = st
                a["bytes"] = a["bytes"] + wb
            if empty:
                self._drained(v, j, t)
            else:
                self._advance(v, t, rem)
                self._admit(v, j, np.full(len(t), v.kind.coll_cap[j]))
                v.coll[j] = K_FLU
                v.crow.pop(j, None)
                done_now = self._resched(v, t)
        elif kind == E_RCV:
            # The send has ended: the receive completes (it started with the send, as in the
            # class engine).
            k = v.kind.gk[j]
            g = a.pop(f"g{j}")
            del a[f"w{j}"]
            del v.coll[j]
            v.crow.pop(j, None)
            self.waiters.get(k, set()).discard(v.id)
            self._op_done(v, j, t)
            # Its own times are the send's (`t` may be later: when it was activated).
            self.start[v.kind.prog][a["pr"], j] = self.amax[k][g]
            self.end[v.kind.prog][a["pr"], j] = self.dmax[k][g]
        elif kind == E_CEND:
            del v.coll[j]
            del a[f"g{j}"]
            v.crow.pop(j, None)
            self.waiters.get(v.kind.gk[j], set()).discard(v.id)
            if not self.overlap:
                v.core_phase = C_WAIT
                self._op_done(v, j, t)
                self._core_next(v, t)
            else:
                self._op_done(v, j, t)
        for b in done_now:  # only collectives (and sends) are fluid batches
            self._drained(v, b, t)
        self._settle(v)

    # -- fluid (FluidNetwork's arithmetic, per chip) ----------------------------------------
    # A vector's batches in flight are columns, in admission order (`v.fluid`), of three
    # [chip, batch] arrays: R the fraction left, V the speed (fractions per second), M the
    # speed cap (inf unless the collective is paced elsewhere).
    def _admit(self, v: _Vec, b: int, cap: np.ndarray) -> None:
        """Batch `b` enters the fluid network (whole, not moving yet, capped at `cap`)."""
        a = v.a
        k = len(cap)
        a["R"] = np.concatenate([a["R"], np.ones((k, 1))], axis=1)
        a["V"] = np.concatenate([a["V"], np.zeros((k, 1))], axis=1)
        a["M"] = np.concatenate([a["M"], cap[:, None]], axis=1)
        v.fluid.append(b)

    def _advance(self, v: _Vec, t, rem) -> None:
        """FluidNetwork._advance to `t` with the remaining fractions `rem` from `_advanced`."""
        a = v.a
        if v.fluid:
            d = t - a["fl_last"]
            d = np.where(d > 0, d, 0.0)
            a["R"] = rem
            a["busy"] = a["busy"] + np.outer(d, self._fluid_set(v)[1])
        a["fl_last"] = t

    def _fluid_set(self, v: _Vec):
        """Memo per (kind, active batches in admission order): the load of every resource
        (summed in FluidNetwork's bincount order), which resources are in use, the loaded
        resources' indices, every batch's bytes on each of those ([batch, resource]), and the
        same arranged for `_max_min_speeds`."""
        key = (v.kind.id, tuple(v.fluid))
        m = self._fluid_memo.get(key)
        if m is not None:
            return m
        res_all = [v.kind.coll[b][0] for b in v.fluid]
        w_all = [v.kind.coll[b][1] for b in v.fluid]
        load = np.bincount(np.concatenate(res_all), weights=np.concatenate(w_all),
                           minlength=NRES)
        pos = load > 0
        used = np.flatnonzero(pos)
        w = np.stack([np.bincount(r, weights=x, minlength=NRES)[used]
                      for r, x in zip(res_all, w_all, strict=True)])
        caps = np.array([self.cap[r] if r != HBM else 0.0 for r in used])[:, None]
        m = self._fluid_memo[key] = (load, pos, used, w,
                                     # for _max_min_speeds: the loads as a column, the bytes
                                     # as [batch, resource, 1], the link capacities as a
                                     # column and whether HBM (the last) is in use
                                     load[used][:, None], w[:, :, None], (w > 0)[:, :, None],
                                     caps, bool(len(used)) and int(used[-1]) == HBM)
        return m

    def _resched(self, v: _Vec, t) -> list[int]:
        a = v.a
        a["nev"] = a["nev"] + 1
        done = a["R"][0] <= 1e-12  # uniform over the chips (see _event)
        fin = []
        if done.any():
            fin = [b for b, x in zip(v.fluid, done.tolist(), strict=True) if x]
            v.fluid = [b for b, x in zip(v.fluid, done.tolist(), strict=True) if not x]
            keep = ~done
            a["R"], a["V"], a["M"] = a["R"][:, keep], a["V"][:, keep], a["M"][:, keep]
        if not v.fluid:
            a["ft"] = np.full(len(t), np.inf)
            return fin
        speed = self._max_min_speeds(v, len(t)).T
        a["V"] = speed
        nxt = (a["R"] / speed).min(axis=1)
        if np.isnan(nxt).any():
            raise RuntimeError("invariant violated: a fluid step of NaN seconds")
        tiny = t + nxt <= t
        if tiny.any():
            nxt = np.where(tiny, 4 * np.spacing(t), nxt)
        a["ft"] = t + np.maximum(nxt, 0.0)
        return fin

    def _max_min_speeds(self, v: _Vec, nc: int) -> np.ndarray:
        """`FluidNetwork._max_min_speeds` (progressive filling) for every chip of the vector at
        once: [batch, chip] speeds. Chips freeze their batches in their own order (their HBM
        and their compute ops' caps scale with their speed); every chip gets the same sums,
        divisions and minima as its own `SmallFluidNetwork` would do."""
        a = v.a
        _l, _p, used, _w, load, w3, wpos3, caps, hbm = self._fluid_set(v)
        nb = len(v.fluid)
        cap_left = np.empty((len(used), nc))
        cap_left[:] = caps
        if hbm:  # `used` is sorted; HBM is the last resource
            cap_left[-1] = v.kind.hbm0 * a["s"]
        cap_max = a["M"].T
        if nb == 1:
            # One batch: it loads every resource in use, so it freezes in the first round, at
            # the least of its fill levels and its cap (the loop below, once).
            return np.maximum(np.minimum((cap_left / load).min(axis=0), cap_max[0]), 0.0)[None]
        speed = np.zeros((nb, nc))
        unfrozen = np.ones((nb, nc), dtype=bool)
        level = np.zeros(nc)
        # Every batch unfrozen: each resource's load is the set's (np.bincount's sum, a column).
        while True:
            loaded = load > 0
            fill = np.divide(cap_left, load, out=np.full(cap_left.shape, np.inf), where=loaded)
            lam = np.maximum(np.minimum(fill.min(axis=0),
                                        np.where(unfrozen, cap_max, np.inf).min(axis=0)), level)
            full = loaded & (fill <= lam)
            now = unfrozen & ((cap_max <= lam) | (wpos3 & full[None]).any(axis=1))
            speed = np.where(now, lam, speed)
            unfrozen &= ~now
            if not unfrozen.any():
                return speed
            # Sums over the batches in np.bincount's order (0.0 plus each batch's bytes in
            # turn): add.accumulate adds them one after the other, so the bits are the same.
            took = np.add.accumulate(np.where(now[:, None, :], w3, 0.0), axis=0)[-1]
            # A chip whose batches all froze at an infinite speed is done: nothing to take.
            finite = np.isfinite(lam)
            cap_left = cap_left - took * np.where(finite, lam, 0.0)
            level = np.where(finite, lam, level)
            load = np.add.accumulate(np.where(unfrozen[:, None, :], w3, 0.0), axis=0)[-1]

    # -- ops --------------------------------------------------------------------------------
    def _core_done(self, v: _Vec, op: int, t) -> None:
        self._op_done(v, op, t)
        self._core_next(v, t)

    def _core_next(self, v: _Vec, t) -> None:
        v.core_i += 1
        v.core_phase = C_WAIT
        self._start_core(v, t)

    def _start_core(self, v: _Vec, t) -> None:
        K = v.kind
        if v.core_i >= len(K.core):
            v.core_phase = C_DONE
            return
        op = K.core[v.core_i]
        if v.act < v.core_i:
            v.act = v.core_i
            lazy = K.lazy_at.get(op)
            if lazy:
                self._activate(v, lazy, t)
        if v.left[op] > 0:
            v.core_phase = C_WAIT
            return
        a = v.a
        self.start[K.prog][a["pr"], op] = t
        if self.open[K.prog]:
            self._update_open_bounds(v)
        o = K.ops[op]
        if o.kind == OpKind.COLLECTIVE:  # --no-overlap: the core runs the collective
            v.core_phase = C_COLL
            self._arrive(v, op, t)
        elif o.kind == OpKind.IDLE:
            v.core_phase = C_TIMEOUT
            a["core_t"] = t + K.idle[op]
        else:
            # A compute op takes max(FLOP time, HBM time) + overhead at the chip's speed: its
            # HBM stream runs at its own pace, beside the collectives' DMA (as the class
            # engine; docs/model/training.md, "HBM"), and its bytes count in HBM's traffic.
            v.core_phase = C_TIMEOUT
            tc = K.flops[op] / (K.rate0[op] * a["s"])
            if K.hbm[op] > 0:
                tc = np.maximum(tc, K.hbm[op] / (K.hbm0 * a["s"]))
                w = K.comp_w.get(op)
                if w is None:
                    w = K.comp_w[op] = np.zeros(NRES)
                    w[HBM] = K.hbm[op]
                a["bytes"] = a["bytes"] + w
            a["core_t"] = t + (np.maximum(tc, 0.0) + K.ovh)

    def _activate(self, v: _Vec, rids, t) -> None:
        """The core reached the first dependent of the receives `rids` at `t`: wait for them
        from now on (each completes at max(its send's end, t))."""
        a = v.a
        K = v.kind
        for rid in rids:
            k = K.gk[rid]
            v.coll[rid] = K_RCV
            a[f"g{rid}"] = self.recv_rank[(K.prog, rid)][a["pr"]]
            a[f"w{rid}"] = np.array(np.broadcast_to(t, a["pr"].shape), dtype=float)
            v.crow.pop(rid, None)
            self.waiters.setdefault(k, set()).add(v.id)

    def _op_done(self, v: _Vec, op: int, t) -> None:
        a = v.a
        K = v.kind
        self.end[K.prog][a["pr"], op] = t
        v.dh = (v.dh + self.hash[op]) & ((1 << 63) - 1)
        ops = K.ops
        for o in K.dependents[op]:
            v.left[o] -= 1
            if v.left[o] == 0:
                kind = ops[o].kind
                if kind == OpKind.COLLECTIVE and self.overlap:
                    self._arrive(v, o, t)
                elif kind == OpKind.HOST:
                    v.pq.append(o)
                    if v.pcur < 0:
                        self._pcie_next(v, t)
                elif v.core_phase == C_WAIT and v.core_i < len(K.core) and K.core[v.core_i] == o:
                    self._start_core(v, t)

    def _pcie_next(self, v: _Vec, t) -> None:
        if v.pcur >= 0 or not v.pq:
            return
        op = v.pq.pop(0)
        v.pcur = op
        self.start[v.kind.prog][v.a["pr"], op] = t
        v.a["pcie_t"] = t + v.kind.host_dur[op]

    def _arrive(self, v: _Vec, j: int, t) -> None:
        a = v.a
        pr = a["pr"]
        k = v.kind.gk[j]
        p = v.kind.prog
        self.arr[p][self.cidx[k], pr] = t
        g = a[f"g{j}"] = self.goc[k][pr]
        np.add.at(self.acnt[k], g, 1)
        np.maximum.at(self.amax[k], g, t)
        v.coll[j] = K_ARR
        v.crow.pop(j, None)
        self.waiters.setdefault(k, set()).add(v.id)
        self.atot[k] = self.atot.get(k, 0) + len(pr)
        if self.atot[k] >= self.expect[k]:
            self.open[p].discard(k)
        elif k not in self.open[p]:
            self.open[p].add(k)
            self._init_bound(k)
        least = v.kind.least.get(j)
        if least is not None:  # a send: its end's lower bound (less a rounding margin)
            e = t + least
            self.elo[k][g] = e - 1e-12 * e
        full = self.acnt[k][g] == self.gsize[k]
        if full.any():
            self._wake(k, v, K_ARR, g[full])

    def _drained(self, v: _Vec, j: int, t) -> None:
        a = v.a
        k = v.kind.gk[j]
        self.drn[v.kind.prog][self.cidx[k], a["pr"]] = t
        g = a[f"g{j}"]
        np.add.at(self.dcnt[k], g, 1)
        np.maximum.at(self.dmax[k], g, t)
        v.coll[j] = K_DRN
        v.crow.pop(j, None)
        full = self.dcnt[k][g] == self.gsize[k]
        if full.any():
            self._wake(k, v, K_DRN, g[full])

    def _wake(self, k: int, skip: _Vec, phase: int, groups: np.ndarray) -> None:
        """Re-key the vectors waiting in `phase` of rendezvous `k` on one of `groups` (whose
        rendezvous just resolved); a send's end (K_DRN) also wakes its receivers."""
        mask = np.zeros(len(self.acnt[k]), dtype=bool)
        mask[groups] = True
        p = self.cprog[k]
        for vid in list(self.waiters.get(k, ())):
            w = self.vecs.get(vid)
            if w is None or w is skip or w.dead:
                continue
            K = w.kind
            if K.prog == p:
                j = k - K.base
                if w.coll.get(j) != phase:
                    continue
            else:  # a receiver (another program)
                j = K.rid_of.get(k, -1)
                if phase != K_DRN or w.coll.get(j) != K_RCV:
                    continue
            if mask[w.a[f"g{j}"]].any():
                w.crow.pop(j, None)
                self._push(w)

    # -- lower bounds of arrivals at open rendezvous ----------------------------------------
    def _init_bound(self, k: int) -> None:
        """Arrival lower bound of every member not yet arrived at `k`, per group."""
        ci = self.cidx[k]
        p = self.cprog[k]
        arr = self.arr[p]
        for w in list(self.vecs.values()):
            if w.kind.prog == p and np.isnan(arr[ci, w.a["pr"][0]]):
                self._bound_into(w, k - w.kind.base)

    def _bound_into(self, w: _Vec, j: int, at_start: bool = False) -> None:
        a = w.a
        running = not at_start and w.core_phase not in (C_WAIT, C_DONE)
        c0 = w.core_i + (1 if running else 0)
        lb = w.kind.lb_arrival(j, c0, running, a["now"], a["s"])
        k = w.kind.gk[j]
        least = w.kind.least.get(j)
        if least is not None:  # a send: a bound of its end, read by its receivers
            e = lb + least
            np.maximum.at(self.elb[k], self.goc[k][a["pr"]], e - 1e-12 * e)
        else:
            np.maximum.at(self.alb[k], self.goc[k][a["pr"]], lb)

    def _update_open_bounds(self, v: _Vec) -> None:
        """At the start of a core op: tighten the arrival bounds of the open rendezvous this
        vector has not reached yet (the op and the rest of the path to each still ahead)."""
        K = v.kind
        pr0 = v.a["pr"][0]
        arr = self.arr[K.prog]
        for k in self.open[K.prog]:
            if np.isnan(arr[self.cidx[k], pr0]):
                self._bound_into(v, k - K.base, at_start=True)


class _Net:
    """The fluid counters `_summarize` reads, for one chip."""

    def __init__(self, nbytes, busy, events):
        self.bytes = nbytes
        self.busy_s = busy
        self.num_events = events


def _p2p_pairs(p2p, programs, prog_of, used, chips_of, base, topology):
    """Each receive op of each chip: the rendezvous key of the send that completes it and the
    chip that sends it ({(program, receive op): per chip key / sender, -1 where none}), with
    the class engine's errors for a send without a receiver or a receive with two sends."""
    nchips = len(prog_of)
    recv_key: dict[tuple[int, int], np.ndarray] = {}
    recv_from: dict[tuple[int, int], np.ndarray] = {}
    for p in used:
        chips = chips_of[p]
        for j, (ch, tag) in sorted(p2p.sends[p].items()):
            peer = np.asarray(p2p.peer_of_chip[ch], dtype=np.int64)[chips]
            q_of = np.where(peer >= 0, prog_of[np.maximum(peer, 0)], -1)
            for q in np.unique(q_of).tolist():
                sel = np.flatnonzero(q_of == q)
                rid = p2p.recvs[q].get(tag) if q >= 0 else None
                if rid is None:
                    raise no_receiver_error(topology, p, programs[p].ops[j], int(chips[sel[0]]),
                                            tag, ch)
                key = recv_key.setdefault((q, rid), np.full(nchips, -1, dtype=np.int64))
                frm = recv_from.setdefault((q, rid), np.full(nchips, -1, dtype=np.int64))
                r = peer[sel]
                if (key[r] >= 0).any() or len(np.unique(r)) < len(r):
                    raise two_sends_error(q, programs[q].ops[rid])
                key[r] = base[p] + j
                frm[r] = chips[sel]
    for q in used:
        for rid in sorted(p2p.recvs[q].values()):
            key = recv_key.get((q, rid))
            if key is None or (key[chips_of[q]] < 0).any():
                # pragma: no cover - the class engine leaves such an op never run, too
                raise TpusimError(
                    f"internal error: receive op {rid} ({programs[q].ops[rid].name}) of program "
                    f"{q} has no send on some chip; every receive needs a send from its peer")
    return recv_key, recv_from


def run_vectors(prep: PreparedStep) -> StepResult:
    """The per-chip engine's result computed with vector classes (see the module docstring);
    the same fields as `sim.engine.class_engine.run_classes`'s."""
    cfg = prep.config
    programs, prog_of, speed, op_scale = prep.programs, prep.prog_of, prep.speed, cfg.op_scale
    chip, topology, overlap = prep.chip, prep.topology, prep.overlap
    op_geom, op_key, geoms = prep.op_geom, prep.op_key, prep.geoms
    group_cost, base_costs, lm, label = prep.group_cost, prep.base_costs, prep.lm, prep.label
    slow, dead_links, p2p = prep.slow, tuple(cfg.dead_links), cfg.p2p
    send_cost_of, p2p_costs = prep.send_cost_of, prep.p2p_costs
    nchips = topology.num_chips
    prog_of = np.asarray(prog_of, dtype=np.int64)
    used = sorted(set(prog_of.tolist()))
    rank = np.zeros(nchips, dtype=np.int64)  # a chip's position among its program's chips
    progs: list = [None] * len(programs)
    chips_of: dict[int, np.ndarray] = {}
    base: dict[int, int] = {}
    off = 0
    for p in used:
        chips_of[p] = ch = np.flatnonzero(prog_of == p)
        rank[ch] = np.arange(len(ch))
        progs[p] = (ch, len(programs[p].ops))
        base[p] = off
        off += len(programs[p].ops)
    sends = {p: (p2p.sends[p] if p2p is not None else {}) for p in used}
    send_cost_of = send_cost_of or {}
    recv_key, recv_from = (_p2p_pairs(p2p, programs, prog_of, used, chips_of, base, topology)
                           if p2p is not None else ({}, {}))
    hbm0 = chip.eff_hbm_bytes_per_s
    rates0 = (chip.eff_mxu_flops_per_s, chip.eff_mxu_int8_ops_per_s, chip.eff_vpu_flops_per_s,
              hbm0)
    # Kinds: chips alike in all but speed (program, op scales, collective and send costs, and
    # which send completes each receive).
    cols = [prog_of.astype(float)]
    for op_id in sorted(op_scale):
        cols.append(np.asarray(op_scale[op_id], dtype=float))
    for key, (index, costs) in group_cost.items():
        if len(costs) > 1:
            ga = next(op_geom[i] for i, k in op_key.items() if k == key)
            cols.append(index[geoms[ga].group_of_chip].astype(float))
    seen_cols: set[int] = set()
    for sk in sorted(send_cost_of):
        col = send_cost_of[sk]
        if id(col) not in seen_cols and col.max(initial=0) > 0:
            seen_cols.add(id(col))
            cols.append(col.astype(float))
    for rk in sorted(recv_key):
        col = recv_key[rk][chips_of[rk[0]]]
        if col.min(initial=0) != col.max(initial=0):
            cols.append(recv_key[rk].astype(float))
    kind_of = relabel(cols)
    kinds = []
    scaled: dict = {}
    for kid in range(int(kind_of.max()) + 1):
        r = int(np.flatnonzero(kind_of == kid)[0])
        p = int(prog_of[r])
        ops = programs[p].ops
        scale = {op_id: float(np.asarray(v)[r]) for op_id, v in op_scale.items()}
        cc = {}
        for op in ops:
            if op.kind != OpKind.COLLECTIVE:
                continue
            j = op.id
            if (p, j) in op_key:
                index, costs = group_cost[op_key[(p, j)]]
                cc[j] = scaled_cost(costs[int(index[int(geoms[op_geom[(p, j)]].group_of_chip[r])])],
                                    scale.get(j, 1.0), scaled)
            elif j in sends[p]:
                cc[j] = p2p_costs[int(send_cost_of[(p, j)][r])]
        recv = {rid: int(recv_key[(p, rid)][r]) for rid in sorted(p2p.recvs[p].values())} \
            if p2p is not None else {}
        kinds.append(_Kind(kid, ops, scale, cc, overlap, chip, rates0,
                           lm.class_capacity_bytes_per_s, prog=p, base=base[p], recv=recv,
                           sends=sends[p]))
    # Rendezvous keys: every collective and send of every program (a send: its sender alone).
    coll_geo = {}
    sub: dict[tuple, np.ndarray] = {}
    for p in used:
        ch = chips_of[p]
        for op in programs[p].ops:
            if op.kind != OpKind.COLLECTIVE:
                continue
            if (p, op.id) in op_geom:
                ga = op_geom[(p, op.id)]
                goc = sub.get((p, ga))
                if goc is None:
                    goc = sub[(p, ga)] = geoms[ga].group_of_chip[ch]
                coll_geo[base[p] + op.id] = (p, goc, geoms[ga].group_size)
            elif op.id in sends[p]:
                goc = sub.get((p, None))
                if goc is None:
                    goc = sub[(p, None)] = np.arange(len(ch))
                coll_geo[base[p] + op.id] = (p, goc, 1)
    recv_rank = {(q, rid): rank[frm[chips_of[q]]] for (q, rid), frm in recv_from.items()}
    run = VectorRun(progs=progs, nchips=nchips, speed=speed, kinds_of_chip=kind_of, kinds=kinds,
                    coll_geo=coll_geo, cap_links=lm.class_capacity_bytes_per_s, overlap=overlap,
                    sends=[base[p] + j for p in used for j in sends[p]], recv_rank=recv_rank,
                    rows=cfg.vector_rows)
    init = []
    for K in kinds:
        chips = np.flatnonzero(kind_of == K.id)
        k = len(chips)
        proto = _Vec()
        proto.kind = K
        proto.core_i = 0
        proto.core_phase = C_WAIT
        proto.act = -1
        proto.coll = {rid: K_RCV for rid in K.eager}  # waited for from the start
        proto.fluid = []
        proto.left = K.deps_left.copy()
        proto.dh = 0
        proto.pq = []
        proto.pcur = -1
        a = {
            "chips": chips, "pr": rank[chips], "s": speed[chips].astype(float),
            "now": np.zeros(k), "core_t": np.zeros(k), "fl_last": np.zeros(k),
            "ft": np.full(k, np.inf), "pcie_t": np.zeros(k), "busy": np.zeros((k, NRES)),
            "bytes": np.zeros((k, NRES)), "R": np.zeros((k, 0)), "V": np.zeros((k, 0)),
            "M": np.zeros((k, 0)), "nev": np.zeros(k, dtype=np.int64),
        }
        for rid in K.eager:  # the group of a receive: its sender's rank
            a[f"g{rid}"] = rank[recv_from[(K.prog, rid)][chips]]
            a[f"w{rid}"] = np.zeros(k)
        init.append(run._new(proto, a))
    run.run(init)

    # -- per-chip results -------------------------------------------------------------------
    busy = np.zeros((nchips, NRES))
    nbytes = np.zeros((nchips, NRES))
    wait = np.zeros(nchips)
    nev = np.zeros(nchips, dtype=np.int64)
    for v in run.final:
        c = v.a["chips"]
        busy[c] = v.a["busy"]
        nbytes[c] = v.a["bytes"]
        nev[c] = v.a["nev"]
    finish = np.zeros(nchips)
    for p in used:
        ch = chips_of[p]
        start, end = run.start[p], run.end[p]
        finish[ch] = end.max(axis=1, initial=0.0)
        # Wall time each chip waits in at least one rendezvous (arrival to start, own drain
        # to end), over chunks of chips to bound the temporaries.
        cols = [op.id for op in programs[p].ops
                if (p, op.id) in op_geom and run.gsize[base[p] + op.id] > 1]
        ci = [run.cidx[base[p] + j] for j in cols]
        for c0 in range(0, len(ch), 512):
            sl = slice(c0, min(c0 + 512, len(ch)))
            lo = np.concatenate([run.arr[p][ci, sl].T, run.drn[p][ci, sl].T], axis=1)
            hi = np.concatenate([start[sl][:, cols], end[sl][:, cols]], axis=1)
            wait[ch[sl]] = wait_wall_time(lo, hi)
    ncls = int(label.max()) + 1
    _, rep = np.unique(label, return_index=True)
    count = np.bincount(label, minlength=ncls)
    slowest = int(rep[int(np.argmax(finish[rep]))])
    K = kinds[int(kind_of[slowest])]
    p = K.prog
    s = float(speed[slowest])
    dur, bound = _dur_bound(K, chip, s, rates0)
    sc_costs = dict(K.cc)
    prog_trace = programs[p]
    row_of = int(rank[slowest])
    s_all = np.asarray(speed, dtype=float)
    kf = np.array([K.mxu_flops for K in kinds])[kind_of]
    vf = np.array([K.vpu_flops for K in kinds])[kind_of]
    pcie = np.array([float(K.host_dur.sum()) for K in kinds])[kind_of]
    rows = np.column_stack([finish, kf / (rates0[0] * s_all), vf / (rates0[2] * s_all),
                            nbytes[:, HBM] / (hbm0 * s_all), pcie, wait])
    progs_of_class: dict[int, ClassProgram] = {}
    if len(used) > 1:
        # Each class's program, its ops' bound units and its collectives' and sends' links,
        # shared by the classes of one kind (a compute op's bound is the same at every speed:
        # both its times scale with 1 / speed).
        per_kind: dict[int, ClassProgram] = {}
        for c, r in enumerate(rep.tolist()):
            kid = int(kind_of[r])
            if kid not in per_kind:
                Kc = kinds[kid]
                per_kind[kid] = ClassProgram(programs[Kc.prog],
                                             _dur_bound(Kc, chip, float(speed[r]), rates0)[1],
                                             *coll_labels(Kc.cc))
            progs_of_class[c] = per_kind[kid]
    chip_classes = ChipClasses(
        of_chip=label, reps=rep, counts=count,
        rows=[tuple(float(x) for x in rows[r]) for r in rep],
        timelines={c: (run.start[int(prog_of[r])][int(rank[r])],
                       run.end[int(prog_of[r])][int(rank[r])])
                   for c, r in enumerate(rep.tolist())},
        program=prog_trace, programs=progs_of_class,
        p2p=((p2p, {c: int(prog_of[r]) for c, r in enumerate(rep.tolist())})
             if p2p is not None else None))
    return _summarize(
        prog_trace, chip, topology, dur, bound, run.start[p][row_of], run.end[p][row_of],
        _Net(nbytes[slowest], busy[slowest], int(nev[slowest])), base_costs, lm,
        rates0[0] * s, rates0[2] * s, hbm0 * s, reported_chip=slowest,
        sim_events=int(nev[rep].sum()) + sum(progs[int(prog_of[r])][1] for r in rep.tolist()),
        **common_parts(topology, {i: op_key[(q, i)][1] for q, i in op_geom if q == p},
                       sc_costs, lm, slow, dead_links,
                       per_link_bytes_of_chips(topology, nbytes[:, :NUM_CLASSES])),
        num_chip_classes=ncls, slowest_chip=coords_text(topology, slowest),
        critical_path=_critical_path_chips(run, slowest, topology, slow, dead_links, label,
                                           count, kinds, kind_of, op_key, group_cost, rank,
                                           recv_from),
        classes=chip_classes,
        vector_stats={"vectors_peak": run.max_vectors, "vector_steps": run.steps})


def _dur_bound(K: _Kind, chip, s: float, rates0) -> tuple[np.ndarray, list[str]]:
    """Each op's duration and bound unit on a chip of kind `K` at speed `s`, as the class
    engine costs them (a collective's or send's duration is its cost's time, set by the
    caller; a receive takes no time)."""
    hbm_bw = rates0[3] * s
    n = len(K.ops)
    dur = np.zeros(n)
    bound = [""] * n
    for op in K.ops:
        if op.kind == OpKind.COMPUTE:
            rate = K.rate0[op.id] * s
            t_c = K.flops[op.id] / rate
            t_m = K.hbm[op.id] / hbm_bw
            bound[op.id] = ("mxu" if op.unit == Unit.MXU else "vpu") if t_c >= t_m else "hbm"
            dur[op.id] = max(t_c, t_m) + chip.op_overhead_s
        elif op.kind == OpKind.COLLECTIVE:
            bound[op.id] = "idle" if op.id in K.recv else "ici"
            cc = K.cc.get(op.id)
            if cc is not None:
                dur[op.id] = cc.time_s
        elif op.kind == OpKind.HOST:
            dur[op.id] = K.host_dur[op.id]
            bound[op.id] = "pcie"
        else:
            dur[op.id] = op.duration_s
            bound[op.id] = "idle"
    return dur, bound


def _critical_path_chips(run, last, topology, slow, dead, label, count, kinds, kind_of, op_key,
                         group_cost, rank, recv_from) -> list[dict]:
    """`sim.engine.class_engine._critical_path` on chips: each op's start was set by its latest
    dependency (or the core op before it), a collective's start by the member that arrived last
    and its end by the member that drained last, a receive's end by its send (on the sender)."""
    members: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def kind(c):
        return kinds[int(kind_of[c])]

    def times(c):
        p = kind(c).prog
        return run.start[p][int(rank[c])], run.end[p][int(rank[c])]

    def group_members(key, c):
        goc = run.goc[key]
        if id(goc) not in members:
            order = np.argsort(goc, kind="stable")
            members[id(goc)] = (order, np.searchsorted(goc[order], np.arange(goc.max() + 2)))
        order, bounds = members[id(goc)]
        g = int(goc[rank[c]])
        return run.progs[run.cprog[key]][0][order[bounds[g]:bounds[g + 1]]]

    def pick(vals, ps, c):
        best = vals.max()
        cands = ps[vals == best]
        return c if c in cands else int(cands.min())

    c = last
    ops = kind(c).ops
    k = int(np.argmax(times(c)[1]))
    core_prev: dict[int, dict[int, int]] = {}

    def prev_of(K):
        if K.id not in core_prev:
            core_prev[K.id] = core_predecessors(K.ops)
        return core_prev[K.id]

    steps: list[tuple[int, int]] = []
    seen = 0
    while k >= 0 and seen < 10 * len(ops) + 10:
        seen += 1
        K = kind(c)
        op = K.ops[k]
        key = K.gk[k]
        if op.kind == OpKind.COLLECTIVE and k not in K.recv and run.gsize[key] > 1:
            ps = group_members(key, c)
            ci = run.cidx[key]
            steps.append((pick(run.drn[K.prog][ci, rank[ps]], ps, c), k))
            c = pick(run.arr[K.prog][ci, rank[ps]], ps, c)
        elif k in K.recv:
            # A receive ends when its message has arrived: the path continues on the sender.
            steps.append((c, k))
            c = int(recv_from[(K.prog, k)][c])
            k = key - kind(c).base
            steps.append((c, k))
        else:
            steps.append((c, k))
        K = kind(c)
        op = K.ops[k]
        cands = list(op.deps)
        prev = prev_of(K)
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE) and k in prev:
            cands.append(prev[k])
        if not cands:
            break
        start, end = times(c)
        k = max(cands, key=lambda d: (end[d], d))
        if end[k] <= 0 and start[k] <= 0 and not K.ops[k].deps:
            steps.append((c, k))
            break
    steps.reverse()
    segments: list[dict] = []
    for c, k in steps:
        K = kind(c)
        op = K.ops[k]
        start, end = times(c)
        if not segments or segments[-1]["_chip"] != c:
            segments.append({
                "_chip": c, "chip": coords_text(topology, c),
                "chips_in_class": int(count[label[c]]), "first_op": op.name,
                "last_op": op.name, "num_ops": 0, "start_s": float(start[k]),
                "end_s": float(end[k]), "links": [],
            })
        seg = segments[-1]
        seg["last_op"] = op.name
        seg["num_ops"] += 1
        seg["end_s"] = float(end[k])
        if (K.prog, k) in op_key:
            index, costs = group_cost[op_key[(K.prog, k)]]
            cc = costs[int(index[int(run.goc[K.gk[k]][rank[c]])])]
            add_path_links(seg["links"], cc, costs[0], topology, dead, slow)
    for seg in segments:
        seg.pop("_chip")
    return segments
