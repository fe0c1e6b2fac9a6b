"""The vector executor's event loop (`sim.engine.vector_engine`): `VectorRun` advances the
vectors of chips (`sim.engine.vector_kinds`) one event at a time, the earliest of the whole pod
first, splitting a vector where its chips' next events differ and merging vectors that reach the
same discrete state; collectives rendezvous by group index arrays, the fluid resources share
bandwidth max-min (the arithmetic of `sim.engine.network.FluidNetwork`). The model and its
guarantees are in `sim.engine.vector_engine`'s docstring."""

from __future__ import annotations

import heapq
import math

import numpy as np

from sim.engine.network import max_min_speeds
from sim.engine.vector_kinds import (
    C_COLL,
    C_DONE,
    C_TIMEOUT,
    C_WAIT,
    E_CADM,
    E_CEND,
    E_CORE,
    E_FLUID,
    E_PCIE,
    E_RCV,
    HASH_SEED,
    HBM,
    K_ARR,
    K_DRN,
    K_FLU,
    K_RCV,
    NRES,
    PHASE_EVENT,
    PROGRESS_EVERY_STEPS,
    ROW_MODES,
    Vec,
    check_row,
    merged_row,
    sliced_row,
)
from topologies.errors import TpusimError
from topologies.progress import task
from workloads.trace import OpKind


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
        self.vecs: dict[int, Vec] = {}
        self.by_state: dict[tuple, int] = {}
        self._fluid_memo: dict[tuple, tuple] = {}
        self.heap: list = []  # (key, vector id) of vectors ready to step
        self.bheap: list = []  # (key, vector id) of blocked vectors
        self._seq = 0
        self.final: list[Vec] = []
        self.max_vectors = 0
        self.steps = 0

    # -- vector bookkeeping -----------------------------------------------------------------
    def _new(self, state_from, a) -> Vec:
        v = Vec()
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

    def _kill(self, v: Vec) -> None:
        v.dead = True
        self.vecs.pop(v.id, None)
        gk = v.kind.gk
        for j in v.coll:
            self.waiters.get(gk[j], set()).discard(v.id)
        if v.skey is not None and self.by_state.get(v.skey) == v.id:
            del self.by_state[v.skey]

    def _split(self, v: Vec, codes: np.ndarray) -> list[tuple[int, Vec, object]]:
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
            p.crow = {j: sliced_row(row, idx) for j, row in v.crow.items()}
            out.append((c, p, idx))
        return out

    def _state_key(self, v: Vec) -> tuple:
        return (v.kind.id, v.core_i, v.core_phase, tuple(sorted(v.coll.items())),
                tuple(v.fluid), v.dh, tuple(v.pq), v.pcur, v.act)

    def _settle(self, v: Vec) -> None:
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
            m.crow = {j: merged_row(w.crow[j], row, kw, kv) for j, row in v.crow.items()
                      if j in w.crow}
            v = m
        v.skey = sk
        self.by_state[sk] = v.id
        self._push(v)

    def _push(self, v: Vec) -> None:
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
    def _candidates(self, v: Vec):
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
                check_row(row, self._coll_row(v, j, ph), j)
            t, bad, at = row
            if t is not None:
                labels.append((PHASE_EVENT[ph], j))
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

    def _coll_row(self, v: Vec, j: int, ph: int):
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
    def run(self, init: list[Vec]) -> None:
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

    def _block(self, v: Vec) -> None:
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

    def _step(self, v: Vec, T: float) -> None:
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
    def _event(self, v: Vec, label, t: np.ndarray) -> None:
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

    def _event_uniform(self, v: Vec, label, t: np.ndarray, rem) -> None:
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
    def _admit(self, v: Vec, b: int, cap: np.ndarray) -> None:
        """Batch `b` enters the fluid network (whole, not moving yet, capped at `cap`)."""
        a = v.a
        k = len(cap)
        a["R"] = np.concatenate([a["R"], np.ones((k, 1))], axis=1)
        a["V"] = np.concatenate([a["V"], np.zeros((k, 1))], axis=1)
        a["M"] = np.concatenate([a["M"], cap[:, None]], axis=1)
        v.fluid.append(b)

    def _advance(self, v: Vec, t, rem) -> None:
        """FluidNetwork._advance to `t` with the remaining fractions `rem` from `_advanced`."""
        a = v.a
        if v.fluid:
            d = t - a["fl_last"]
            d = np.where(d > 0, d, 0.0)
            a["R"] = rem
            a["busy"] = a["busy"] + np.outer(d, self._fluid_set(v)[1])
        a["fl_last"] = t

    def _fluid_set(self, v: Vec):
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
        # For max_min_speeds: the hops (batch, loaded resource) with bytes, batch by batch,
        # the loads as a column, the link capacities as a column and whether HBM (the last)
        # is in use.
        owner, res = np.nonzero(w)
        caps = np.array([self.cap[r] if r != HBM else 0.0 for r in used])[:, None]
        m = self._fluid_memo[key] = (load, pos, used, w, load[used][:, None], res, w[owner, res],
                                     owner, caps, bool(len(used)) and int(used[-1]) == HBM)
        return m

    def _resched(self, v: Vec, t) -> list[int]:
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

    def _max_min_speeds(self, v: Vec, nc: int) -> np.ndarray:
        """`sim.engine.network.max_min_speeds` (progressive filling) with every chip of the
        vector as one network of the batch axis: [batch, chip] speeds. Chips freeze their
        batches in their own order (their HBM and their compute ops' caps scale with their
        speed); every chip gets the same sums, divisions and minima as its own
        `SmallFluidNetwork` would do."""
        a = v.a
        _l, _p, used, _w, load, res, weight, owner, caps, hbm = self._fluid_set(v)
        cap_left = np.empty((len(used), nc))
        cap_left[:] = caps
        if hbm:  # `used` is sorted; HBM is the last resource
            cap_left[-1] = v.kind.hbm0 * a["s"]
        return max_min_speeds(res, weight, owner, cap_left, a["M"].T, load=load)[0]

    # -- ops --------------------------------------------------------------------------------
    def _core_done(self, v: Vec, op: int, t) -> None:
        self._op_done(v, op, t)
        self._core_next(v, t)

    def _core_next(self, v: Vec, t) -> None:
        v.core_i += 1
        v.core_phase = C_WAIT
        self._start_core(v, t)

    def _start_core(self, v: Vec, t) -> None:
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

    def _activate(self, v: Vec, rids, t) -> None:
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

    def _op_done(self, v: Vec, op: int, t) -> None:
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

    def _pcie_next(self, v: Vec, t) -> None:
        if v.pcur >= 0 or not v.pq:
            return
        op = v.pq.pop(0)
        v.pcur = op
        self.start[v.kind.prog][v.a["pr"], op] = t
        v.a["pcie_t"] = t + v.kind.host_dur[op]

    def _arrive(self, v: Vec, j: int, t) -> None:
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

    def _drained(self, v: Vec, j: int, t) -> None:
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

    def _wake(self, k: int, skip: Vec, phase: int, groups: np.ndarray) -> None:
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

    def _bound_into(self, w: Vec, j: int, at_start: bool = False) -> None:
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

    def _update_open_bounds(self, v: Vec) -> None:
        """At the start of a core op: tighten the arrival bounds of the open rendezvous this
        vector has not reached yet (the op and the rest of the path to each still ahead)."""
        K = v.kind
        pr0 = v.a["pr"][0]
        arr = self.arr[K.prog]
        for k in self.open[K.prog]:
            if np.isnan(arr[self.cidx[k], pr0]):
                self._bound_into(v, k - K.base, at_start=True)
