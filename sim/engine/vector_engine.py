"""Vector classes: the per-chip engine's path for pods where (nearly) every chip differs, e.g.
`chip_variation` on 8960 chips (docs/model.md, "Per-chip engine", "Vector classes").

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
filling is `sim.engine.network.max_min_speeds` with the vector's chips as its batch axis (the
same additions in the same order as one chip's network).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.engine.critical_path import critical_path
from sim.engine.perchip import (
    PreparedStep,
    coll_labels,
    common_parts,
    core_predecessors,
    no_receiver_error,
    per_link_bytes_of_chips,
    relabel,
    scaled_cost,
    two_sends_error,
    wait_wall_time,
)
from sim.engine.result import ChipClasses, ClassProgram, StepResult
from sim.engine.summary import summarize
from sim.engine.vector_kinds import C_WAIT, HBM, K_RCV, NRES, ChipCounters, Kind, Vec
from sim.engine.vector_run import VectorRun
from topologies.errors import TpusimError
from topologies.groups import NUM_CLASSES
from workloads.trace import OpKind, Unit


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


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each program's chips and ops sit: `used` programs, a chip's `rank` among its
    program's chips, `chips_of[p]`, `progs[p]` = (chips, number of ops) (None: unused), `base[p]`
    the offset of program p's ops among all rendezvous keys, `sends[p]` its send ops."""

    used: list[int]
    rank: np.ndarray
    progs: list
    chips_of: dict[int, np.ndarray]
    base: dict[int, int]
    sends: dict[int, dict]


def run_vectors(prep: PreparedStep) -> StepResult:
    """The per-chip engine's result computed with vector classes (see the module docstring);
    the same fields as `sim.engine.class_engine.run_classes`'s."""
    lay = _layout(prep)
    p2p = prep.config.p2p
    prog_of = np.asarray(prep.prog_of, dtype=np.int64)
    recv_key, recv_from = (_p2p_pairs(p2p, prep.programs, prog_of, lay.used, lay.chips_of,
                                      lay.base, prep.topology)
                           if p2p is not None else ({}, {}))
    kind_of, kinds = _vector_kinds(prep, lay, recv_key)
    recv_rank = {(q, rid): lay.rank[frm[lay.chips_of[q]]] for (q, rid), frm in recv_from.items()}
    run = VectorRun(progs=lay.progs, nchips=prep.topology.num_chips, speed=prep.speed,
                    kinds_of_chip=kind_of, kinds=kinds, coll_geo=_rendezvous_keys(prep, lay),
                    cap_links=prep.lm.class_capacity_bytes_per_s, overlap=prep.overlap,
                    sends=[lay.base[p] + j for p in lay.used for j in lay.sends[p]],
                    recv_rank=recv_rank, rows=prep.config.vector_rows)
    run.run(_initial_vectors(run, prep.speed, kinds, kind_of, lay.rank, recv_from))
    return _vector_result(prep, lay, run, kinds, kind_of, recv_from)


# -- setup ------------------------------------------------------------------------------------
def _layout(prep: PreparedStep) -> _Layout:
    nchips = prep.topology.num_chips
    prog_of = np.asarray(prep.prog_of, dtype=np.int64)
    p2p = prep.config.p2p
    used = sorted(set(prog_of.tolist()))
    rank = np.zeros(nchips, dtype=np.int64)  # a chip's position among its program's chips
    progs: list = [None] * len(prep.programs)
    chips_of: dict[int, np.ndarray] = {}
    base: dict[int, int] = {}
    off = 0
    for p in used:
        chips_of[p] = ch = np.flatnonzero(prog_of == p)
        rank[ch] = np.arange(len(ch))
        progs[p] = (ch, len(prep.programs[p].ops))
        base[p] = off
        off += len(prep.programs[p].ops)
    sends = {p: (p2p.sends[p] if p2p is not None else {}) for p in used}
    return _Layout(used, rank, progs, chips_of, base, sends)


def _vector_kinds(prep: PreparedStep, lay: _Layout, recv_key) -> tuple[np.ndarray, list[Kind]]:
    """Every chip's kind and the kinds: chips alike in all but speed (program, op scales,
    collective and send costs, and which send completes each receive)."""
    programs, op_scale, chip, p2p = prep.programs, prep.config.op_scale, prep.chip, prep.config.p2p
    op_geom, op_key, geoms, group_cost = prep.op_geom, prep.op_key, prep.geoms, prep.group_cost
    send_cost_of, p2p_costs = prep.send_cost_of or {}, prep.p2p_costs
    prog_of = np.asarray(prep.prog_of, dtype=np.int64)
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
        col = recv_key[rk][lay.chips_of[rk[0]]]
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
            elif j in lay.sends[p]:
                cc[j] = p2p_costs[int(send_cost_of[(p, j)][r])]
        recv = {rid: int(recv_key[(p, rid)][r]) for rid in sorted(p2p.recvs[p].values())} \
            if p2p is not None else {}
        kinds.append(Kind(kid, ops, scale, cc, prep.overlap, chip, _rates0(chip),
                          prep.lm.class_capacity_bytes_per_s, prog=p, base=lay.base[p],
                          recv=recv, sends=lay.sends[p]))
    return kind_of, kinds


def _rates0(chip) -> tuple[float, float, float, float]:
    """A chip's effective MXU, MXU int8, VPU and HBM rates at speed 1."""
    return (chip.eff_mxu_flops_per_s, chip.eff_mxu_int8_ops_per_s, chip.eff_vpu_flops_per_s,
            chip.eff_hbm_bytes_per_s)


def _rendezvous_keys(prep: PreparedStep, lay: _Layout) -> dict:
    """Every collective and send of every program (a send: its sender alone): its program,
    every chip's group index among that program's chips, and the group size."""
    op_geom, geoms = prep.op_geom, prep.geoms
    coll_geo = {}
    sub: dict[tuple, np.ndarray] = {}
    for p in lay.used:
        ch = lay.chips_of[p]
        for op in prep.programs[p].ops:
            if op.kind != OpKind.COLLECTIVE:
                continue
            if (p, op.id) in op_geom:
                ga = op_geom[(p, op.id)]
                goc = sub.get((p, ga))
                if goc is None:
                    goc = sub[(p, ga)] = geoms[ga].group_of_chip[ch]
                coll_geo[lay.base[p] + op.id] = (p, goc, geoms[ga].group_size)
            elif op.id in lay.sends[p]:
                goc = sub.get((p, None))
                if goc is None:
                    goc = sub[(p, None)] = np.arange(len(ch))
                coll_geo[lay.base[p] + op.id] = (p, goc, 1)
    return coll_geo


def _initial_vectors(run: VectorRun, speed, kinds, kind_of, rank, recv_from) -> list:
    """One vector per kind, every chip at the step's start."""
    init = []
    for K in kinds:
        chips = np.flatnonzero(kind_of == K.id)
        k = len(chips)
        proto = Vec()
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
    return init


# -- finish -----------------------------------------------------------------------------------
def _vector_result(prep: PreparedStep, lay: _Layout, run: VectorRun, kinds, kind_of,
                   recv_from) -> StepResult:
    """The `StepResult` of the slowest chip (first among equals), with the per-class table."""
    programs, chip, topology, speed = prep.programs, prep.chip, prep.topology, prep.speed
    op_geom, op_key, label, p2p = prep.op_geom, prep.op_key, prep.label, prep.config.p2p
    prog_of, rank, used = np.asarray(prep.prog_of, dtype=np.int64), lay.rank, lay.used
    nchips = topology.num_chips
    busy = np.zeros((nchips, NRES))
    nbytes = np.zeros((nchips, NRES))
    nev = np.zeros(nchips, dtype=np.int64)
    for v in run.final:
        c = v.a["chips"]
        busy[c] = v.a["busy"]
        nbytes[c] = v.a["bytes"]
        nev[c] = v.a["nev"]
    finish, wait = _finish_and_waits(prep, lay, run)
    ncls = int(label.max()) + 1
    _, rep = np.unique(label, return_index=True)
    count = np.bincount(label, minlength=ncls)
    slowest = int(rep[int(np.argmax(finish[rep]))])
    K = kinds[int(kind_of[slowest])]
    p = K.prog
    s = float(speed[slowest])
    rates0 = _rates0(chip)
    hbm0 = rates0[3]
    dur, bound = _dur_bound(K, chip, s, rates0)
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
        program=programs[p], programs=progs_of_class,
        p2p=((p2p, {c: int(prog_of[r]) for c, r in enumerate(rep.tolist())})
             if p2p is not None else None),
        op_scale=prep.config.op_scale)
    dead_links = tuple(prep.config.dead_links)
    return summarize(
        programs[p], chip, topology, dur, bound, run.start[p][row_of], run.end[p][row_of],
        ChipCounters(nbytes[slowest], busy[slowest], int(nev[slowest])), prep.base_costs, prep.lm,
        rates0[0] * s, rates0[2] * s, hbm0 * s, reported_chip=slowest,
        sim_events=int(nev[rep].sum()) + sum(lay.progs[int(prog_of[r])][1] for r in rep.tolist()),
        **common_parts(topology, {i: op_key[(q, i)][1] for q, i in op_geom if q == p},
                       dict(K.cc), prep.lm, prep.slow, dead_links,
                       per_link_bytes_of_chips(topology, nbytes[:, :NUM_CLASSES])),
        num_chip_classes=ncls, slowest_chip=topology.coords_text(slowest),
        critical_path=critical_path(_ChipPaths(run, prep, kinds, kind_of, rank, count, recv_from),
                                    slowest, topology, prep.slow, dead_links),
        classes=chip_classes,
        vector_stats={"vectors_peak": run.max_vectors, "vector_steps": run.steps})


def _finish_and_waits(prep: PreparedStep, lay: _Layout, run: VectorRun
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Every chip's finish time and the wall time it waits in at least one rendezvous (arrival
    to start, own drain to end), over chunks of chips to bound the temporaries."""
    nchips = prep.topology.num_chips
    finish = np.zeros(nchips)
    wait = np.zeros(nchips)
    for p in lay.used:
        ch = lay.chips_of[p]
        start, end = run.start[p], run.end[p]
        finish[ch] = end.max(axis=1, initial=0.0)
        cols = [op.id for op in prep.programs[p].ops
                if (p, op.id) in prep.op_geom and run.gsize[lay.base[p] + op.id] > 1]
        ci = [run.cidx[lay.base[p] + j] for j in cols]
        for c0 in range(0, len(ch), 512):
            sl = slice(c0, min(c0 + 512, len(ch)))
            lo = np.concatenate([run.arr[p][ci, sl].T, run.drn[p][ci, sl].T], axis=1)
            hi = np.concatenate([start[sl][:, cols], end[sl][:, cols]], axis=1)
            wait[ch[sl]] = wait_wall_time(lo, hi)
    return finish, wait


def _dur_bound(K: Kind, chip, s: float, rates0) -> tuple[np.ndarray, list[str]]:
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
            dur[op.id] = K.idle[op.id]
            bound[op.id] = "idle"
    return dur, bound


class _ChipPaths:
    """The vector executor's chips as `sim.engine.critical_path.PathView` nodes."""

    def __init__(self, run: VectorRun, prep: PreparedStep, kinds, kind_of, rank, count,
                 recv_from) -> None:
        self.run, self.prep, self.kinds, self.kind_of = run, prep, kinds, kind_of
        self.rank, self.count, self.recv_from = rank, count, recv_from
        self._members: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._prev: dict[int, dict[int, int]] = {}

    def _kind(self, c):
        return self.kinds[int(self.kind_of[c])]

    def ops(self, c):
        return self._kind(c).ops

    def times(self, c):
        p = self._kind(c).prog
        r = int(self.rank[c])
        return self.run.start[p][r], self.run.end[p][r]

    def core_prev(self, c):
        K = self._kind(c)
        if K.id not in self._prev:
            self._prev[K.id] = core_predecessors(K.ops)
        return self._prev[K.id]

    def rendezvous(self, c, k):
        K, run = self._kind(c), self.run
        key = K.gk[k]
        if k in K.recv or run.gsize[key] <= 1:
            return None
        goc = run.goc[key]
        if id(goc) not in self._members:
            order = np.argsort(goc, kind="stable")
            self._members[id(goc)] = (order, np.searchsorted(goc[order], np.arange(goc.max() + 2)))
        order, bounds = self._members[id(goc)]
        g = int(goc[self.rank[c]])
        ps = run.progs[run.cprog[key]][0][order[bounds[g]:bounds[g + 1]]]
        ci = run.cidx[key]
        return ps, run.arr[K.prog][ci, self.rank[ps]], run.drn[K.prog][ci, self.rank[ps]]

    def sender(self, c, k):
        K = self._kind(c)
        if k not in K.recv:
            return None
        q = int(self.recv_from[(K.prog, k)][c])
        return q, K.gk[k] - self._kind(q).base

    def chip(self, c):
        return c

    def class_size(self, c):
        return self.count[self.prep.label[c]]

    def path_cost(self, c, k):
        K = self._kind(c)
        key = self.prep.op_key.get((K.prog, k))
        if key is None:
            return None
        index, costs = self.prep.group_cost[key]
        return costs[int(index[int(self.run.goc[K.gk[k]][self.rank[c]])])], costs[0]
