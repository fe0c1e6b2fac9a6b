"""The class executor of the per-chip step: every chip of the pod replays the step, so a slow
chip, a slow link or chip-to-chip speed variation shows where (and through which chips and links)
it delays the step. Each chip class (`sim.engine.perchip.prepare_step`) is one set of SimPy
actors: the reference model the vector executor (`sim.engine.vector_engine`) is tested against.

Model (docs/model.md, "Per-chip engine"):

* Every chip runs `sim.engine.replay`'s model of one chip (MXU, VPU and PCIe as SimPy resources,
  the MXU and VPU as immediate grants since only the core uses them; its HBM and its outgoing
  link classes as fluid resources shared by collective DMA, while compute streams HBM at its
  own pace), with its own speed factor `s` scaling the MXU, VPU and HBM rates.
* A collective is a rendezvous of its replica group: it starts when every member has reached it
  (its dependencies are done on that chip), each member then moves its bytes on its own links
  and HBM, and the collective ends for all members when the last member's part has drained. So
  a late chip delays its group, and the delay travels through later collectives.
* A replica group whose routes use a degraded link gets its own cost from `simulate_collective`
  with that link (link by link); the group's extra time is a fixed latency on top of the
  healthy links' drain (documented approximation under contention).

Equivalence classes: chips whose whole step is identical are simulated once. The partition
starts from what a chip *is* (speed, program, per-op work scales, the cost of each of its
groups) and is refined to a fixed point by the classes present in each of its replica groups
(two chips stay together only if, for every collective, their groups hold the same classes).
Within a class every chip sees the same events at the same times, so one representative
stands for the class. `mode="per-chip"` skips the partition (one actor per chip, each with
its own links): the brute-force oracle the tests compare against. With nothing perturbed there
is exactly one class and the arithmetic is `replay`'s, so the result is the same to the last bit.

Interface for per-chip programs and loads (`PerChipConfig`): `programs` + `program_of_chip` give
chips different programs (pipeline stages); the chips of one replica group must run programs that
agree on that collective's op id, kind, axes and bytes (collectives rendezvous by op id), while
chips that never share a group may run unrelated programs. `p2p` adds point-to-point transfers
between chips (pipeline stage-to-stage sends): a send op runs on its sender's links as soon as its
dependencies are done, and the matching receive op on the peer chip completes when it has
arrived. `op_scale` multiplies the FLOPs and HBM bytes of chosen compute ops per chip (MoE
expert loads).
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.engine.costs import CollectiveCost
from sim.engine.critical_path import critical_path
from sim.engine.memory import static_hbm_bytes
from sim.engine.network import Batch, SmallFluidNetwork
from sim.engine.perchip import (
    HbmOverCapacity,
    HbmPrefixEnded,
    HbmWatch,
    PreparedStep,
    coll_labels,
    common_parts,
    core_predecessors,
    no_receiver_error,
    per_link_bytes_of_chips,
    scaled_cost,
    two_sends_error,
    wait_wall_time,
)
from sim.engine.replay import run_env
from sim.engine.result import ChipClasses, ClassProgram, StepResult
from sim.engine.summary import summarize
from topologies.errors import TpusimError
from topologies.groups import NUM_CLASSES
from topologies.progress import task
from topologies.torus import Topology
from workloads.trace import OpKind, Unit

HBM_INDEX = NUM_CLASSES  # a class's fluid resources: its link classes, then its HBM


def run_classes(prep: PreparedStep, watch: HbmWatch | None = None) -> StepResult:
    """Replay a prepared step with one SimPy actor per chip class (see the module docstring):
    the `StepResult` of the chip that finishes last, with the per-chip table, `slowest_chip`,
    `critical_path` and `num_chip_classes` filled in. Under `watch` (`HbmWatch`) the run stops
    when a class's HBM level goes over its capacity (`HbmOverCapacity`)."""
    env = simpy.Environment()
    classes = _class_states(prep, env)
    if prep.config.p2p is not None:
        _pair_sends(prep, classes)
    _replay(prep, env, classes, watch)
    return _class_result(prep, classes)


# -- setup: cost every op of every class before env.run() -------------------------------------
def _partners(prep: PreparedStep) -> dict[tuple, list[tuple[int, ...]]]:
    """Per geometry, per class: the classes present in its replica group (rendezvous partners)."""
    label, rep, geoms = prep.label, prep.rep, prep.geoms
    partners: dict[tuple, list[tuple[int, ...]]] = {}
    for g in list(geoms):
        goc = geoms[g].group_of_chip
        pairs = np.unique(np.stack([goc, label], axis=1), axis=0)
        sets: dict[int, list[int]] = {}
        for grp, c in pairs.tolist():
            sets.setdefault(grp, []).append(c)
        partners[g] = [tuple(sets[int(goc[rep[c]])]) for c in range(prep.num_classes)]
    return partners


def _batch_maker(batches: dict[int, Batch]):
    """`batch_of(cost)`: one `Batch` per distinct collective cost, shared by every class and op."""
    def batch_of(cc: CollectiveCost) -> Batch:
        b = batches.get(id(cc))
        if b is None:
            used = np.flatnonzero(cc.class_bytes > 0)
            # A zero-byte hop would still pace the batch at that resource's fair share.
            hbm = [HBM_INDEX] if cc.hbm_bytes > 0 or len(used) == 0 else []
            b = batches[id(cc)] = Batch(
                res=np.append(used, hbm).astype(np.int64),
                ptr=np.arange(len(used) + len(hbm) + 1, dtype=np.int64),
                bytes_per_transfer=np.append(cc.class_bytes[used], [cc.hbm_bytes] * len(hbm)),
                latency_s=cc.latency_s, max_speed=cc.max_speed,
            )
        return b
    return batch_of


def _class_states(prep: PreparedStep, env: simpy.Environment) -> list[_ClassState]:
    """Every class's representative with every op costed, its fluid network and PCIe resource
    and one done event per op (an op outside a prefix shares one that never fires)."""
    partners = _partners(prep)
    batch_of = _batch_maker({})
    scaled: dict = {}
    classes = []
    for c in range(prep.num_classes):
        r = int(prep.rep[c])
        s = float(prep.speed[r])
        pi = int(prep.prog_of[r])
        ops = prep.programs[pi].ops
        cl = _ClassState(c=c, rep=r, speed=s, ops=ops, n=len(ops))
        cl.prog = pi
        cl.hbm_bw = prep.chip.eff_hbm_bytes_per_s * s
        cl.mxu_rate = prep.chip.eff_mxu_flops_per_s * s
        cl.vpu_rate = prep.chip.eff_vpu_flops_per_s * s
        # Under a prefix only its ops run: the others are not costed (nor given done events
        # of their own below).
        keep = None if prep.prefix_ops is None else prep.prefix_ops[pi]
        _cost_ops(prep, cl, keep, partners, batch_of, scaled)
        cl.net = SmallFluidNetwork(env, np.append(prep.lm.class_capacity_bytes_per_s, cl.hbm_bw))
        cl.pcie = simpy.Resource(env, capacity=1)
        if keep is None:
            cl.done = [env.event() for _ in range(len(ops))]
        else:  # an op outside the prefix never ends: one event, never triggered, for all
            never = env.event()
            cl.done = [env.event() if i in keep else never for i in range(len(ops))]
        classes.append(cl)
    if len(classes) > 1:
        for cl in classes:
            cl.arrived = {i: env.event() for i in cl.coll_cost}
            cl.drained = {i: env.event() for i in cl.coll_cost}
    return classes


def _cost_ops(prep: PreparedStep, cl: _ClassState, keep, partners, batch_of, scaled) -> None:
    """Each op's duration and bound unit on class `cl`'s representative (and a collective's or
    send's cost, batch and rendezvous partners); a compute op's busy time counts in the
    representative's MXU or VPU total."""
    chip, p2p, r, s, pi, c = prep.chip, prep.config.p2p, cl.rep, cl.speed, cl.prog, cl.c
    op_geom, geoms = prep.op_geom, prep.geoms
    scale = {op_id: float(np.asarray(v)[r]) for op_id, v in prep.config.op_scale.items()}
    sends = p2p.sends[pi] if p2p is not None else {}
    recv_ids = set(p2p.recvs[pi].values()) if p2p is not None else set()
    for op in (cl.ops if keep is None else [cl.ops[i] for i in sorted(keep)]):
        if op.kind == OpKind.COMPUTE:
            k = scale.get(op.id, 1.0)
            flops = op.flops * k
            hbm_bytes = op.hbm_bytes * k
            t_c = flops / chip.unit_rate(op, s)
            cl.hbm_bytes[op.id] = hbm_bytes
            t_m = hbm_bytes / cl.hbm_bw
            if t_c >= t_m:
                cl.bound[op.id] = "mxu" if op.unit == Unit.MXU else "vpu"
            else:
                cl.bound[op.id] = "hbm"
            cl.dur[op.id] = max(t_c, t_m) + chip.op_overhead_s
            if op.unit == Unit.MXU:
                cl.mxu_busy += flops / (cl.mxu_rate * chip.mxu_fill(op.narrow_dim))
            else:
                cl.vpu_busy += flops / cl.vpu_rate
        elif op.id in sends:
            cc = prep.p2p_costs[int(prep.send_cost_of[(pi, op.id)][r])]
            cl.send_cost[op.id] = cc
            cl.dur[op.id] = cc.time_s
            cl.bound[op.id] = "ici"
            cl.batch[op.id] = batch_of(cc)
        elif op.id in recv_ids:
            cl.bound[op.id] = "idle"
        elif op.kind == OpKind.COLLECTIVE:
            if (pi, op.id) not in op_geom:
                continue  # outside the prefix: never runs
            ga = op_geom[(pi, op.id)]
            grp = int(geoms[ga].group_of_chip[r])
            index, costs = prep.group_cost[prep.op_key[(pi, op.id)]]
            cc = scaled_cost(costs[int(index[grp])], scale.get(op.id, 1.0), scaled)
            cl.coll_cost[op.id] = cc
            cl.partners[op.id] = partners[ga][c]
            cl.dur[op.id] = cc.time_s
            cl.bound[op.id] = "ici"
            cl.batch[op.id] = batch_of(cc)
        elif op.kind == OpKind.HOST:
            cl.dur[op.id] = op.bytes / chip.pcie_bytes_per_s
            cl.bound[op.id] = "pcie"
        else:
            cl.dur[op.id] = op.duration_s * scale.get(op.id, 1.0)
            cl.bound[op.id] = "idle"


def _pair_sends(prep: PreparedStep, classes: list[_ClassState]) -> None:
    """Each send completes one receive op of its peer's class."""
    p2p, label = prep.config.p2p, prep.label
    for cl in classes:
        for op_id, (ch, tag) in p2p.sends[cl.prog].items():
            peer = int(p2p.peer_of_chip[ch][cl.rep])
            q = classes[int(label[peer])] if peer >= 0 else None
            if q is None or tag not in p2p.recvs[q.prog]:
                raise no_receiver_error(prep.topology, cl.prog, cl.ops[op_id], cl.rep, tag, ch)
            rid = p2p.recvs[q.prog][tag]
            if rid in q.recv_from:
                raise two_sends_error(q.prog, q.ops[rid])
            cl.send_to[op_id] = (q.c, rid)
            q.recv_from[rid] = (cl.c, op_id)


# -- the replay: SimPy processes ----------------------------------------------------------------
def _all_of(env: simpy.Environment, evs: list) -> simpy.Event:
    """`env.all_of(evs)` for events not processed yet, without SimPy's `Condition`: an
    event that succeeds from the callback of the last of them to be processed, the very
    point where the condition would succeed (so the event order is the same), at a
    fraction of the cost (a step waits on ~3k of them)."""
    joined = env.event()
    left = [len(evs)]

    def check(_ev):
        left[0] -= 1
        if not left[0]:
            joined.succeed()

    for ev in evs:
        ev.callbacks.append(check)
    return joined


def _wait_deps(env, cl, op):
    evs = [cl.done[d] for d in op.deps if not cl.done[d].processed]
    if evs:
        yield _all_of(env, evs)


def _run_collective(env, classes, cl, op):
    yield from _wait_deps(env, cl, op)
    ps = cl.partners[op.id]
    rendezvous = len(classes) > 1 and len(ps) > 1
    if rendezvous:
        cl.arrive_t[op.id] = env.now
        cl.arrived[op.id].succeed()
        evs = [classes[p].arrived[op.id] for p in ps if not classes[p].arrived[op.id].processed]
        if evs:
            yield _all_of(env, evs)
        cl.waits.append((cl.arrive_t[op.id], env.now))
    cl.start[op.id] = env.now
    yield cl.net.transfer(cl.batch[op.id])
    if rendezvous:
        t_own = env.now
        cl.drained[op.id].succeed()
        evs = [classes[p].drained[op.id] for p in ps if not classes[p].drained[op.id].processed]
        if evs:
            yield _all_of(env, evs)
        cl.waits.append((t_own, env.now))
        cl.drain_t[op.id] = t_own
    cl.end[op.id] = env.now
    cl.done[op.id].succeed()


def _run_send(env, classes, cl, op):
    # A point-to-point send: the sender's links and HBM, then the peer's receive completes.
    yield from _wait_deps(env, cl, op)
    cl.start[op.id] = env.now
    yield cl.net.transfer(cl.batch[op.id])
    cl.end[op.id] = env.now
    cl.done[op.id].succeed()
    q, rid = cl.send_to[op.id]
    q = classes[q]
    q.start[rid] = cl.start[op.id]  # the message is on its way from the send's start
    q.end[rid] = env.now
    q.done[rid].succeed()


def _run_async(env, cl, op, resource):
    yield from _wait_deps(env, cl, op)
    with resource.request() as req:
        yield req
        cl.start[op.id] = env.now
        yield env.timeout(cl.dur[op.id])
    cl.end[op.id] = env.now
    cl.done[op.id].succeed()


def _core(env, classes, overlap, cl):
    for pos, op in enumerate(cl.ops):
        cl.pos = pos  # how far its core is, for the progress report
        if op.kind == OpKind.HOST or (op.kind == OpKind.COLLECTIVE and overlap) or \
                op.id in cl.recv_from:
            continue
        yield from _wait_deps(env, cl, op)
        if op.id in cl.send_to:  # --no-overlap: sends block the core too
            yield env.process(_run_send(env, classes, cl, op))
            continue
        if op.kind == OpKind.COLLECTIVE:  # --no-overlap: collectives block the core
            yield env.process(_run_collective(env, classes, cl, op))
            continue
        if op.kind == OpKind.IDLE:
            cl.start[op.id] = env.now
            yield env.timeout(cl.dur[op.id])
            cl.end[op.id] = env.now
            cl.done[op.id].succeed()
            continue
        # The MXU/VPU: only this core uses them and it runs one op at a time, so a request
        # is always granted at once. An event that has succeeded stands for the grant (it
        # is scheduled and resumes the core exactly as a `simpy.Resource` request would;
        # the release event that follows has no effect on anything, so it is left out).
        yield env.event().succeed()
        cl.start[op.id] = env.now
        hb = cl.hbm_bytes[op.id]
        if hb > 0:
            # Its HBM stream runs at the op's own pace, beside the collectives' DMA
            # (docs/model/training.md, "HBM"); the bytes count in HBM's traffic.
            cl.net.count_bytes(HBM_INDEX, hb)
        yield env.timeout(cl.dur[op.id])
        cl.end[op.id] = env.now
        cl.done[op.id].succeed()


def _replay(prep: PreparedStep, env: simpy.Environment, classes: list[_ClassState],
            watch: HbmWatch | None) -> None:
    """Start every class's processes and run the environment to its end (or, under `watch`,
    until HBM goes over capacity or the prefix reaches its horizon)."""
    overlap, ncls = prep.overlap, len(classes)
    watching = watch is not None and ncls == len(prep.used_programs)
    if watch is not None and watch.prefix_ops is not None:
        if not watching:  # the watch does not apply: no verdict from a prefix
            watch.prefix_ended = True
            raise HbmPrefixEnded("the HBM watch does not apply to this step")
        # Only the prefix's ops get actors: `stop_when_hbm_exceeds(prefix=...)` guarantees
        # that no other op starts before the horizon (nor is a receive completed before it).
        for cl in classes:
            keep = watch.prefix_ops[cl.prog]
            cl.ops = tuple(op for op in cl.ops if op.id in keep)
    for cl in classes:
        for op in cl.ops:
            if op.id in cl.recv_from:
                continue  # completed by the peer's send
            if op.id in cl.send_to:
                if overlap:
                    env.process(_run_send(env, classes, cl, op))
            elif op.kind == OpKind.COLLECTIVE and overlap:
                env.process(_run_collective(env, classes, cl, op))
            elif op.kind == OpKind.HOST:
                env.process(_run_async(env, cl, op, cl.pcie))
        env.process(_core(env, classes, overlap, cl))
    if watching:
        _run_watching_hbm(env, classes, prep.programs, watch)
    else:
        topology = prep.topology
        total = sum(len(cl.ops) for cl in classes)
        with task("chip classes" if ncls > 1 else "step", total=total, unit="op",
                  detail=f"{ncls:,} classes of {topology.num_chips:,} chips" if ncls > 1
                  else f"{topology.num_chips:,} chips alike") as t:
            run_env(env, t, lambda: sum(cl.pos for cl in classes))
    for cl in classes:
        stuck = [cl.ops[i].name for i, e in enumerate(cl.done) if not e.processed]
        if stuck:  # pragma: no cover - guarded by Trace validation and _check_programs
            raise TpusimError(f"internal error: {len(stuck)} ops never ran, e.g. {stuck[:3]}")


# -- finish: the result of the class that ends last ------------------------------------------
def _class_result(prep: PreparedStep, classes: list[_ClassState]) -> StepResult:
    """The `StepResult` of the slowest class's representative, with the per-class table, the
    per-link bytes of every chip and the critical path."""
    cfg, chip, topology, programs = prep.config, prep.chip, prep.topology, prep.programs
    op_geom, op_key, label, ncls = prep.op_geom, prep.op_key, prep.label, prep.num_classes
    p2p = cfg.p2p
    count = np.bincount(label, minlength=ncls)
    finish = np.array([float(cl.end.max(initial=0.0)) for cl in classes])
    slowest = int(np.argmax(finish))  # first class among equals: the one holding chip 0 first
    sc = classes[slowest]
    prog_trace = programs[int(prep.prog_of[sc.rep])]
    rows = [
        (float(finish[cl.c]), cl.mxu_busy, cl.vpu_busy,
         float(cl.net.bytes[HBM_INDEX]) / cl.hbm_bw,
         float(sum(cl.dur[o.id] for o in cl.ops if o.kind == OpKind.HOST)),
         float(wait_wall_time(np.array([[w[0] for w in cl.waits]]),
                              np.array([[w[1] for w in cl.waits]]))[0]))
        for cl in classes
    ]
    own_programs = {}
    if len(prep.used_programs) > 1:  # each class's own program and its collectives' links
        own_programs = {cl.c: ClassProgram(programs[cl.prog], cl.bound,
                                           *coll_labels({**cl.coll_cost, **cl.send_cost}))
                        for cl in classes}
    chip_classes = ChipClasses(
        of_chip=label, reps=prep.rep, counts=count, rows=rows,
        timelines={cl.c: (cl.start, cl.end) for cl in classes}, program=prog_trace,
        programs=own_programs,
        p2p=(p2p, {cl.c: cl.prog for cl in classes}) if p2p is not None else None,
        op_scale=prep.config.op_scale)
    events = {"sim_events": sum(cl.net.num_events for cl in classes) + prep.class_ops} \
        if ncls > 1 else {}
    # Per link: the bytes the class of its source chip put on that link class.
    return summarize(
        prog_trace, chip, topology, sc.dur, sc.bound, sc.start, sc.end, sc.net, prep.base_costs,
        prep.lm, sc.mxu_rate, sc.vpu_rate, sc.hbm_bw, reported_chip=sc.rep, **events,
        **common_parts(topology, {i: op_key[(p, i)][1] for p, i in op_geom if p == sc.prog},
                       {**sc.coll_cost, **sc.send_cost}, prep.lm, prep.slow, cfg.dead_links,
                       _per_link_bytes(topology, label, classes)),
        num_chip_classes=ncls, slowest_chip=topology.coords_text(sc.rep),
        critical_path=critical_path(_ClassPaths(classes, prep, count), slowest, topology,
                                    prep.slow, cfg.dead_links),
        classes=chip_classes)


def _run_watching_hbm(env, classes, programs, watch: HbmWatch) -> None:
    """`env.run()`, stopped (HbmOverCapacity) when a class's HBM level goes over capacity.
    Appending a callback to an op's done event changes no event's order or time."""
    levels: list[float] = []
    for cl in classes:
        meta = programs[cl.prog].meta
        levels.append(static_hbm_bytes(meta))
        delta: dict[int, float] = {}
        for ev in meta.memory_events or ():
            delta[int(ev[0])] = delta.get(int(ev[0]), 0.0) + float(ev[2])
        for op_id, d in delta.items():
            if 0 <= op_id < len(cl.done):
                def add(_ev, c=cl.c, d=d):
                    levels[c] += d
                cl.done[op_id].callbacks.append(add)
    limit = watch.capacity_bytes * (1 + 1e-9)
    prefix = watch.prefix_ops is not None
    now = env.now
    while True:
        t = env.peek()
        if t == float("inf") and not prefix:
            return
        if t > now:  # every event at `now` processed: each class's level is a table row
            # (with a prefix, the full step's next event is at the horizon or later)
            if max(levels) > limit:
                watch.exceeded, watch.level_bytes, watch.time_s = True, max(levels), now
                raise HbmOverCapacity(
                    f"HBM level {max(levels) / 1e9:.1f} GB over the capacity "
                    f"{watch.capacity_bytes / 1e9:.1f} GB at {now:.6g} s: out of memory")
            if prefix and t >= watch.horizon_s:
                watch.prefix_ended = watch.reached_horizon = True
                raise HbmPrefixEnded(f"the prefix reached its horizon {watch.horizon_s:.6g} s")
            now = t
        env.step()



class _ClassState:
    """One class's representative: costs, SimPy resources, timeline and counters."""

    def __init__(self, *, c: int, rep: int, speed: float, ops, n: int) -> None:
        self.c = c
        self.rep = rep
        self.speed = speed
        self.ops = ops
        self.dur = np.zeros(n)
        self.hbm_bytes = np.zeros(n)
        self.bound = [""] * n
        self.start = np.zeros(n)
        self.end = np.zeros(n)
        self.coll_cost: dict[int, CollectiveCost] = {}
        self.partners: dict[int, tuple[int, ...]] = {}
        self.batch: dict[int, Batch] = {}
        self.arrived: dict[int, simpy.Event] = {}
        self.drained: dict[int, simpy.Event] = {}
        self.arrive_t: dict[int, float] = {}
        self.drain_t: dict[int, float] = {}
        self.waits: list[tuple[float, float]] = []  # (from, to) waiting in a rendezvous
        self.prog = 0
        self.send_cost: dict[int, CollectiveCost] = {}
        self.send_to: dict[int, tuple[int, int]] = {}  # send op -> (peer class, receive op)
        self.recv_from: dict[int, tuple[int, int]] = {}  # receive op -> (sender class, send op)
        self.mxu_busy = 0.0
        self.vpu_busy = 0.0
        self.pos = 0  # the op its core is at



def _per_link_bytes(topology: Topology, label: np.ndarray, classes) -> np.ndarray:
    """Bytes on every link: each chip's outgoing link classes carry what its class put there."""
    cls_bytes = np.stack([cl.net.bytes[:NUM_CLASSES] for cl in classes])  # [classes, 8]
    return per_link_bytes_of_chips(topology, cls_bytes[label])




class _ClassPaths:
    """The class executor's classes as `sim.engine.critical_path.PathView` nodes."""

    def __init__(self, classes: list[_ClassState], prep: PreparedStep, count: np.ndarray) -> None:
        self.classes, self.prep, self.count = classes, prep, count
        # Times as Python floats (the same values; an array indexed op by op is much slower).
        self._times = [(cl.start.tolist(), cl.end.tolist()) for cl in classes]
        self._prev = [core_predecessors(cl.ops) for cl in classes]

    def ops(self, c):
        return self.classes[c].ops

    def times(self, c):
        return self._times[c]

    def core_prev(self, c):
        return self._prev[c]

    def rendezvous(self, c, k):
        ps = self.classes[c].partners.get(k, ())
        if len(ps) <= 1:
            return None
        cls = self.classes
        return (np.array(ps), np.array([cls[p].arrive_t.get(k, 0.0) for p in ps]),
                np.array([cls[p].drain_t.get(k, 0.0) for p in ps]))

    def sender(self, c, k):
        return self.classes[c].recv_from.get(k)

    def chip(self, c):
        return self.classes[c].rep

    def class_size(self, c):
        return self.count[c]

    def path_cost(self, c, k):
        st = self.classes[c]
        if k not in st.coll_cost:
            return None
        _, costs = self.prep.group_cost[self.prep.op_key[(st.prog, k)]]
        return st.coll_cost[k], costs[0]


__all__ = ["run_classes"]
