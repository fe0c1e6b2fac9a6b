"""The vector executor's state (`sim.engine.vector_engine`): the phases and event labels, a
program's ops as arrays (`Kind`: per op its kind, unit, dependencies, collective and scales),
a vector of chips (`Vec`: every time an array over its chips), and the collective candidate
rows a vector keeps (`sliced_row`, `merged_row`, `check_row`; `ROW_MODES`)."""

from __future__ import annotations

import numpy as np

from topologies.groups import NUM_CLASSES
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
PHASE_EVENT = {K_ARR: E_CADM, K_DRN: E_CEND, K_RCV: E_RCV}
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


def sliced_row(row, idx):
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


def merged_row(r0, r1, k0, k1):
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


def check_row(kept, fresh, j) -> None:
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


class Kind:
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
                self.idle[op.id] = op.duration_s * scale.get(op.id, 1.0)
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


class Vec:
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


class ChipCounters:
    """The fluid counters `summarize` reads, for one chip."""

    def __init__(self, nbytes, busy, events):
        self.bytes = nbytes
        self.busy_s = busy
        self.num_events = events
