"""Lower bounds of a plan candidate, in closed form or from a schedule without contention,
none of which a simulation of the candidate can come in under: per-op floors (`Floors`: the
engine's costing with nothing shared), the uncontended schedule of a step's program or of a
pipeline's stage programs (`Uncontended`; every start in the simulation is a max of earlier
ends, and sharing only delays), the same composed pass by pass from the one-microbatch chunk
programs (`pipeline_schedule_bound`), an HBM peak no schedule avoids
(`hbm_peak_lower_bound`), and a compute floor extended from models of 2 and 3 layers per chunk
(`compute_floor`, exact for models whose layers are all alike).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from sim.engine.costs import (
    compute_op_times,
    cost_cache_key,
    cost_collective,
    merge_axis_factors,
    padded_collective_bytes,
)
from sim.engine.memory import static_hbm_bytes
from sim.engine.pipeline import build_stage_programs, check_schedule, chunk_program, stage_order
from topologies.groups import axis_factor
from topologies.mesh import LogicalMesh, place_mesh
from workloads.memory import MEMORY_CATEGORIES
from workloads.trace import OpKind
from workloads.training import WEIGHT_CAST, compile_training_step


def collective_floor_s(chip, topology, kind: str, gaxes, nbytes: float) -> float:
    """A time no simulated collective of this kind, group and size can beat, in closed form:
    the bytes one chip must receive (all-gather, all-reduce) or send (reduce-scatter) at the
    least, (N-1)/N of V ((N-1)/N^2 of V for all-to-all, V for a permute), through at most two
    links (one per direction) of every physical axis the group spans, and at least one hop of
    latency. 0 when it cannot say (DCN groups, unknown kinds)."""
    n = math.prod(g.size for g in gaxes) if gaxes else 1
    if n <= 1 or nbytes <= 0 or any(g.index < 0 for g in gaxes):
        return 0.0
    v = float(padded_collective_bytes(kind, gaxes, nbytes))
    links = 2 * len({g.index for g in gaxes})
    if kind in ("all-gather", "reduce-scatter", "all-reduce"):
        per_chip = v * (n - 1) / n
    elif kind == "all-to-all":
        per_chip = v * (n - 1) / n**2
    elif kind == "collective-permute":
        per_chip, links = v, 2
    else:
        return 0.0
    bw = chip.eff_ici_link_bytes_per_s
    return max(per_chip / (links * bw), chip.ici_hop_latency_s)


def mesh_groups(axes, topology) -> dict[str, tuple]:
    """Physical group axes of every logical axis of the ICI mesh `axes`, as the engine places
    them (`sim.engine.costs.collective_groups`)."""
    return {name: tuple(axis_factor(topology, a, size, stride) for a, size, stride in pl.factors)
            for name, pl in place_mesh(LogicalMesh(axes=tuple(axes)), topology).items()}


class Floors:
    """Per-op durations no simulation can beat (sim/engine/costs.py's costing without contention):
    compute `overhead + max(flops / rate, bytes / HBM bandwidth)`, collectives their
    `collective_floor_s` on the mesh's groups, point-to-point sends one message through all of
    a chip's links with one hop of latency, host transfers bytes / PCIe, idle their length."""

    def __init__(self, chip, topology, groups, exact_algorithm: str | None = None):
        self.chip, self.topology, self.groups = chip, topology, groups
        # Set: collectives also cost their exact uncontended time (`engine.cost_collective`, as
        # the engine costs them; a batch alone on its links takes at least that long).
        self.exact_algorithm = exact_algorithm
        self.cost_keys: list[tuple] = []  # `engine.cost_collective` cache keys of exact costs
        self.memo: dict[tuple, float] = {}
        # A compute op alone on the chip, costed as `replay` costs it (its HBM stream does not
        # share with collective DMA, so this is its time in the replay too).
        self.op_times = compute_op_times

    def compute(self, op) -> float:
        return self.chip.op_overhead_s + max(self.op_times(self.chip, op))

    def send(self, nbytes: float) -> float:
        if self.topology.num_slices > 1:
            return 0.0  # may cross DCN: no floor here
        bw = self.chip.eff_ici_link_bytes_per_s
        return max(nbytes / (2 * self.topology.ndim * bw), self.chip.ici_hop_latency_s)

    def collective(self, op) -> float:
        key = (op.collective, op.mesh_axes, op.bytes, op.group)
        if key not in self.memo:
            if op.group >= 0:  # explicit device groups (HLO import): no closed form here
                self.memo[key] = 0.0
            else:
                factors: list = []
                for a in op.mesh_axes:
                    factors += list(self.groups.get(a, ()))
                gaxes = merge_axis_factors(self.topology, factors) if factors else ()
                floor = collective_floor_s(self.chip, self.topology, op.collective,
                                           gaxes[:1] if op.collective == "collective-permute"
                                           else gaxes, op.bytes)
                if self.exact_algorithm is not None and gaxes:
                    floor = max(floor, cost_collective(self.chip, self.topology, op.collective,
                                                       gaxes, op.bytes,
                                                       self.exact_algorithm).time_s)
                    self.cost_keys.append(cost_cache_key(self.chip, self.topology,
                                                         op.collective, gaxes, op.bytes,
                                                         self.exact_algorithm))
                self.memo[key] = floor
        return self.memo[key]


def uncontended_ends(trace, chip, topology, groups) -> tuple[list[float], list[float]]:
    """(start, end) of every op when nothing contends: the engine's schedule (compute and idle
    ops in trace order on the core, each after its dependencies; collectives and host
    transfers as soon as their dependencies are done) at `Floors` durations. Shared links,
    HBM and PCIe only delay ops, and every start is a max of earlier ends, so each op ends no
    earlier in the simulation than here."""
    floors = Floors(chip, topology, groups)
    runs = Uncontended([trace], floors, {}, {})
    runs.advance(0)
    return runs.start[0], runs.end[0]


def hbm_peak_lower_bound(trace, off_core: Iterable[int] = ()) -> float:
    """An HBM peak that `sim.engine.memory.hbm_occupancy` cannot come in under, whatever the
    schedule.

    The engine applies a trace's memory events (meta `memory_events`) at their op's end, in
    (end, op id) order, and records the level after each op. The core runs its ops (compute and
    idle; collectives too without overlap) one after another in trace order, and an op ends
    after its dependencies, which are earlier ops (lower ids). So when core op X's events have
    been applied, every earlier core op and every ancestor of those has ended and was applied
    first; anything else applied by then is an op off the core (a collective or a host
    transfer) that X does not wait for. Such an op with a net positive delta only adds memory;
    one with a net negative delta (a free at a collective, e.g. the embedding gradient's
    reduce-scatter over tensor) is counted as if it had ended before every op, so the level
    after X is at least static + every off-core op's net negative delta + the deltas of X, the
    earlier core ops and all their ancestors (the off-core negatives once): the largest of
    these over X is the bound. 0 when the trace has no events (no bound).
    `off_core`: ops the core skips although of a core kind (a pipeline stage's receives,
    completed by the peer's send)."""
    meta = trace.meta
    raw = meta.memory_events
    if not raw:
        return 0.0
    ops = trace.ops
    delta = [0.0] * len(ops)
    for ev in raw:
        i = int(ev[0])
        if not 0 <= i < len(ops) or str(ev[1]) not in MEMORY_CATEGORIES:
            return 0.0  # the simulation reports the bad event
        delta[i] += float(ev[2])
    overlap = meta.overlap is not False
    skipped = set(off_core)

    def on_core(o) -> bool:
        return o.id not in skipped and (o.kind in (OpKind.COMPUTE, OpKind.IDLE) or
                                        (o.kind == OpKind.COLLECTIVE and not overlap))

    level = static_hbm_bytes(meta)
    for o in ops:
        if delta[o.id] < 0 and not on_core(o):
            level += delta[o.id]  # freed as early as it could be
            delta[o.id] = 0.0
    peak = level
    ended = [False] * len(ops)
    for x in ops:
        if not on_core(x):
            continue
        stack = [x.id]
        while stack:  # X and its ancestors not counted yet
            i = stack.pop()
            if ended[i]:
                continue
            ended[i] = True
            level += delta[i]
            stack.extend(d for d in ops[i].deps if not ended[d])
        if level > peak:
            peak = level
    return peak


class Uncontended:
    """The uncontended schedule of several programs whose point-to-point receives complete when
    the matching send of another program does (pipeline stages): `advance(k)` runs program k's
    ops in order until a receive waits for a send not yet timed."""

    def __init__(self, programs, floors: Floors, sends, recvs):
        self.programs, self.floors = programs, floors
        self.sends = sends  # program -> {send op id: tag}
        self.recv_tag = {k: {rid: tag for tag, rid in r.items()} for k, r in recvs.items()}
        self.sent: dict[int, float] = {}  # tag -> when its send completes
        self.start = [[0.0] * len(t.ops) for t in programs]
        self.end = [[0.0] * len(t.ops) for t in programs]
        self.pos = [0] * len(programs)
        self.core = [0.0] * len(programs)
        self.overlap = [t.meta.overlap is not False for t in programs]

    def advance(self, k: int) -> bool:
        ops, start, end, fl = self.programs[k].ops, self.start[k], self.end[k], self.floors
        sends, recv_tag = self.sends.get(k, {}), self.recv_tag.get(k, {})
        moved = False
        while self.pos[k] < len(ops):
            op = ops[self.pos[k]]
            ready = max((end[d] for d in op.deps), default=0.0)
            core = self.core[k]
            if op.id in recv_tag:  # completed by the peer's send
                tag = recv_tag[op.id]
                if tag not in self.sent:
                    return moved
                start[op.id], end[op.id] = ready, max(ready, self.sent[tag])
            elif op.kind == OpKind.COMPUTE or op.kind == OpKind.IDLE:
                t0 = max(core, ready)
                dur = fl.compute(op) if op.kind == OpKind.COMPUTE else op.duration_s
                start[op.id], end[op.id] = t0, t0 + dur
                self.core[k] = end[op.id]
            elif op.kind == OpKind.COLLECTIVE:
                dur = fl.send(op.bytes) if op.id in sends else fl.collective(op)
                t0 = ready if self.overlap[k] else max(core, ready)
                start[op.id], end[op.id] = t0, t0 + dur
                if not self.overlap[k]:
                    self.core[k] = end[op.id]
                if op.id in sends:
                    self.sent[sends[op.id]] = end[op.id]
            else:  # host transfer, on its own DMA queue
                dur = op.bytes / fl.chip.pcie_bytes_per_s
                start[op.id], end[op.id] = ready, ready + dur
            self.pos[k] += 1
            moved = True
        return moved


def step_lower_bound(model, axes, num_chips: int, tcfg, chip, topology,
                     exact_algorithm: str | None = None,
                     cost_keys: list[tuple] | None = None) -> float:
    """A step time that `tpusim train` with this mesh (in this order, i.e. this placement) and
    these settings cannot beat: the end of the uncontended schedule (`uncontended_ends`); with
    pipeline stages, of every stage's program as sim/engine/pipeline.py composes it, each receive
    completing when its send does (so the bound holds the bubble). With `exact_algorithm`
    (single-program steps only), collectives take their simulated uncontended time (and
    `cost_keys`, if given, receives the cost-cache keys of those collectives)."""
    mesh = LogicalMesh(axes=tuple(axes))
    groups = mesh_groups(axes, topology)
    pipelined = mesh.size("pipeline") > 1
    floors = Floors(chip, topology, groups, None if pipelined else exact_algorithm)
    if not pipelined:
        trace = compile_training_step(model, mesh, num_chips, tcfg)
        runs = Uncontended([trace], floors, {}, {})
        runs.advance(0)
        if cost_keys is not None:
            cost_keys += floors.cost_keys
        return max(runs.end[0], default=0.0)
    runs = stage_schedule(stage_programs(model, mesh, num_chips, tcfg), floors)
    if runs is None:
        return 0.0  # a receive no send completes: bound nothing (the engine refuses it)
    return max(max(e, default=0.0) for e in runs.end)


def stage_schedule(sp, floors: Floors) -> Uncontended | None:
    """The uncontended schedule of a pipeline's stage programs (`stage_programs`), each
    receive completing when its send does; None if some receive is never sent."""
    p = len(sp.programs)
    runs = Uncontended(list(sp.programs), floors,
                        {k: {sid: tag for sid, (_ch, tag) in sp.sends[k].items()}
                         for k in range(p)},
                        {k: dict(sp.recvs[k]) for k in range(p)})
    while any(runs.pos[k] < len(sp.programs[k].ops) for k in range(p)):
        if not any([runs.advance(k) for k in range(p)]):
            return None
    return runs


def _pass_terms(tr, ids: list[int], entry_waits: bool, fwd: bool, floors: Floors,
                overlap: bool) -> tuple[float, float, float, float]:
    """One pass of a stage program (`sim.engine.pipeline.build_stage_programs` copies chunk trace
    `tr`'s ops `ids` once per microbatch) as max-plus terms of its two inputs: the end G of
    the previous pass's last compute op on the stage (its gate: the core is busy until then,
    and every op of the pass that depends on no other op of the pass waits for it) and the end
    R of the pass's receive (its entry op `stage_input` / `stage_grad_input` waits for it when
    `entry_waits`). Returns (a, b, ga, gb): in the uncontended schedule (`Uncontended`, the
    same per-op durations) the pass's last compute op ends no earlier than max(G + a, R + b)
    and its gradient collectives (which the stage's optimizer update waits for) no earlier than
    max(G + ga, R + gb); -inf where a term is absent. Dependencies on ops outside the pass (a
    backward pass's own forward activations) are left out, which only lowers these ends, as
    does starting the core at G."""
    neg = -math.inf
    ends: dict[int, tuple[float, float]] = {}
    core = (0.0, neg)
    last = (neg, neg)
    grad = (neg, neg)
    ops = tr.ops
    for old in ids:
        op = ops[old]
        ra = rb = neg
        inside = False
        for d in op.deps:
            e = ends.get(d)
            if e is not None:
                inside = True
                if e[0] > ra:
                    ra = e[0]
                if e[1] > rb:
                    rb = e[1]
        if not inside:
            ra = max(ra, 0.0)  # the gate
        if entry_waits and op.name in ("stage_input", "stage_grad_input"):
            rb = max(rb, 0.0)  # the receive
        kind = op.kind
        if kind == OpKind.COMPUTE or kind == OpKind.IDLE:
            dur = floors.compute(op) if kind == OpKind.COMPUTE else op.duration_s
            e = (max(core[0], ra) + dur, max(core[1], rb) + dur)
            core = e
            if kind == OpKind.COMPUTE:
                last = e
        elif kind == OpKind.COLLECTIVE:
            dur = floors.collective(op)
            if overlap:
                e = (ra + dur, rb + dur)
            else:
                e = (max(core[0], ra) + dur, max(core[1], rb) + dur)
                core = e
            if not fwd and "grad" in op.name:
                grad = (max(grad[0], e[0]), max(grad[1], e[1]))
        else:  # host transfer, on its own DMA queue
            dur = op.bytes / floors.chip.pcie_bytes_per_s
            e = (ra + dur, rb + dur)
        ends[old] = e
    return last[0], last[1], grad[0], grad[1]


def pipeline_schedule_bound(model, axes, num_chips: int, tcfg, chip, topology) -> float:
    """A step time that `tpusim train` with pipeline stages on this mesh (in this order) cannot
    beat, from the one-microbatch chunk programs alone (no stage programs are built): each
    pass's `_pass_terms` on this placement's collective floors, composed in every stage's
    schedule order (`sim.engine.pipeline.stage_order`) as `step_lower_bound` composes the stage
    programs' ops: a pass's receive ends when the previous stage's send does (its last compute
    op's end plus one message's floor), and the stage's optimizer update (the first chunk's
    optimizer ops, one after another on the core) starts after the last pass and every
    gradient collective. Every term is a max and a sum of ends and durations that the
    uncontended schedule of the stage programs holds too (less some of its constraints), so
    this is never above `step_lower_bound` of the same step, and so never above the simulated
    step; on the 405B plan's pipelines it is within a few microseconds of it, at a fraction of
    the cost (the stage programs hold M copies of every pass). 0 for a schedule whose receives
    no send completes."""
    mesh = LogicalMesh(axes=tuple(axes))
    p, v, m = mesh.size("pipeline"), tcfg.virtual_stages, tcfg.microbatches
    check_schedule(tcfg.pipeline_schedule, p, m, v)
    chunks = p * v
    floors = Floors(chip, topology, mesh_groups(axes, topology))

    # The chunk programs depend on the axis sizes, not their order: a group's placements, and
    # its stage programs if it reaches the front, share them (`chunk_program`'s cache).
    def chunk_trace(c: int):
        return chunk_program(model, mesh, num_chips, tcfg, c)

    send = floors.send(float(chunk_trace(0).meta.pipeline_send_bytes))
    terms: dict[tuple, tuple[float, float, float, float]] = {}

    def pass_terms(c: int, fwd: bool, last_mb: bool):
        key = (c == 0, c == chunks - 1, fwd, last_mb or fwd)
        if key not in terms:
            tr = chunk_trace(c)
            phases = ("fwd", "loss") if fwd else ("bwd",)
            ids = [o.id for o in tr.ops if o.phase in phases and not (
                not fwd and not last_mb and o.name.startswith("dp_grad_allreduce"))]
            entry = (fwd and c > 0) or (not fwd and c < chunks - 1)
            terms[key] = _pass_terms(tr, ids, entry, fwd, floors,
                                     tr.meta.overlap is not False)
        return terms[key]

    orders = [stage_order(tcfg.pipeline_schedule, p, s, m, v) for s in range(p)]
    pos = [0] * p
    # A stage's weight cast (--gather-dtype) runs before its first pass (sim/engine/pipeline.py).
    gate = [sum(floors.compute(op) for op in chunk_trace(s).ops if op.name == WEIGHT_CAST)
            for s in range(p)]
    grad = [-math.inf] * p
    sent: dict[tuple[str, int, int], float] = {}  # (kind, chunk received, microbatch) -> end
    ends = [0.0]
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                ps = orders[s][pos[s]]
                c, i, fwd = ps.chunk, ps.microbatch, ps.kind == "F"
                has_recv = (fwd and c > 0) or (not fwd and c < chunks - 1)
                recv = -math.inf
                if has_recv:
                    if (ps.kind, c, i) not in sent:
                        break
                    recv = sent[(ps.kind, c, i)]
                a, b, ga, gb = pass_terms(c, fwd, i == m - 1)
                g0 = gate[s]
                gate[s] = max(g0 + a, recv + b)
                grad[s] = max(grad[s], g0 + ga, recv + gb)
                if fwd and c < chunks - 1:
                    sent[("F", c + 1, i)] = gate[s] + send
                    ends.append(sent[("F", c + 1, i)])
                elif not fwd and c > 0:
                    sent[("B", c - 1, i)] = gate[s] + send
                    ends.append(sent[("B", c - 1, i)])
                pos[s] += 1
                moved = True
        if not moved:
            return 0.0
    for s in range(p):
        t = max(gate[s], grad[s])
        for op in chunk_trace(s).ops:
            if op.phase == "optimizer" and op.kind == OpKind.COMPUTE and op.name != WEIGHT_CAST:
                t += floors.compute(op)
        ends.append(t)
    return max(ends)


def stage_programs(model, mesh, num_chips: int, tcfg):
    """`sim.engine.pipeline.build_stage_programs` (cached per worker: every placement of a group
    shares one composition; the bounds take the collectives' groups from the placement)."""
    return build_stage_programs(model, mesh, num_chips, tcfg)


def step_hbm_lower_bound(model, trace, num_chips: int, tcfg, mesh=None) -> float:
    """`hbm_peak_lower_bound` of a compiled training step as `tpusim train` simulates it: the
    step's program, or with pipeline stages the largest of the stage programs' (the engine
    reports the fullest stage), their receives off the core. The same for every placement of
    the mesh (the ops and memory events do not depend on the axis order). `mesh`: the
    step's mesh, for a pipeline given without its trace (None)."""
    mesh = mesh if mesh is not None else trace.mesh
    if mesh.size("pipeline") <= 1:
        return hbm_peak_lower_bound(trace)
    sp = stage_programs(model, mesh, num_chips, tcfg)
    return max(hbm_peak_lower_bound(prog, off_core=sp.recvs[k].values())
               for k, prog in enumerate(sp.programs))


def core_floor_s(trace, floors: Floors) -> float:
    """The time a chip's core is busy with `trace`'s compute and idle ops at their floors
    (`Floors.compute`, the durations alone): the core runs them one at a time, so no step
    of this program is shorter."""
    t = 0.0
    for op in trace.ops:
        if op.kind == OpKind.COMPUTE:
            t += floors.compute(op)
        elif op.kind == OpKind.IDLE:
            t += op.duration_s
    return t


def stage_core_floors_s(model, mesh, num_chips: int, tcfg, floors: Floors) -> list[float]:
    """`core_floor_s` of every pipeline stage's program as
    `sim.engine.pipeline.build_stage_programs` composes it, from the one-microbatch chunk
    programs alone: the stage's weight cast, each pass of its schedule (a chunk's forward or
    backward ops, copied per microbatch) and its first chunk's optimizer update."""
    p, v, m = mesh.size("pipeline"), tcfg.virtual_stages, tcfg.microbatches
    sums: dict[int, dict[str, float]] = {}

    def phase_sums(c: int) -> dict[str, float]:
        if c not in sums:
            d = {"F": 0.0, "B": 0.0, "cast": 0.0, "opt": 0.0}
            for op in chunk_program(model, mesh, num_chips, tcfg, c).ops:
                if op.kind == OpKind.COMPUTE:
                    t = floors.compute(op)
                elif op.kind == OpKind.IDLE:
                    t = op.duration_s
                else:
                    continue
                if op.name == WEIGHT_CAST:
                    d["cast"] += t
                elif op.phase in ("fwd", "loss"):
                    d["F"] += t
                elif op.phase == "bwd":
                    d["B"] += t
                elif op.phase == "optimizer":
                    d["opt"] += t
            sums[c] = d
        return sums[c]

    out = []
    for s in range(p):
        first = phase_sums(s)
        t = first["cast"] + first["opt"]
        for ps in stage_order(tcfg.pipeline_schedule, p, s, m, v):
            t += phase_sums(ps.chunk)["F" if ps.kind == "F" else "B"]
        out.append(t)
    return out


# A group's compute floor is extrapolated from models of 2 and 3 layers per pipeline chunk,
# for models of at least this many layers per chunk (fewer: the group is bounded in full).
FLOOR_MIN_LAYERS_PER_CHUNK = 4


def floor_applies(model, mesh_sizes: Mapping[str, int], tcfg_virtual_stages: int = 1) -> bool:
    """Whether `compute_floor` holds for a model: dense, every layer alike (no experts, no
    local/global or chunked attention pattern, no MTP modules), with enough layers per
    pipeline chunk."""
    p = mesh_sizes.get("pipeline", 1)
    v = tcfg_virtual_stages if p > 1 else 1
    alike = not model.is_moe and not model.num_mtp_modules and all(
        model.layer_attention_window(layer) is None and model.layer_attention_chunk(layer) is None
        for layer in range(model.num_layers))
    return (alike and model.num_layers % (p * v) == 0
            and model.num_layers // (p * v) >= FLOOR_MIN_LAYERS_PER_CHUNK)


def compute_floor(model, mesh, num_chips: int, tcfg, chip, topology) -> float:
    """A step time no simulation of this step (any placement of its mesh) can beat, without
    compiling the step: the busiest core's compute and idle ops at their floors (`core_floor_s`;
    with pipeline stages the busiest stage's, `stage_core_floors_s`), for a model whose layers
    are all alike (`floor_applies`), from the same step of the model with 2 and 3 layers per
    chunk, extended linearly to its layer count.

    Why that is exact (or below): every layer's ops are the same whatever the layer count (the
    compiler's layer loop makes one layer's ops at a time from the layer's own sizes), and the
    ops outside the layers (embedding, head, loss, the optimizer update over all parameters)
    have flops and bytes affine in it; each op's floor `overhead + max(flops / rate, bytes /
    bandwidth)` is then convex in the layer count, and so is their sum, which therefore lies
    on or above the line through its values at 2 and 3 layers per chunk at every count past 3.
    Tested equal to the compiled step's `core_floor_s` (to 1e-9) on dense zoo models, remat
    policies, microbatches, tensor and sequence axes and pipelines; `run_plan` checks it again
    on every group it bounds in full."""
    floors = Floors(chip, topology, {})
    p = mesh.size("pipeline")
    v = tcfg.virtual_stages if p > 1 else 1
    per_chunk = model.num_layers // (p * v)

    def floor_at(k: int) -> list[float]:
        small = dataclasses.replace(model, num_layers=k * p * v)
        if p > 1:
            return stage_core_floors_s(small, mesh, num_chips, tcfg, floors)
        return [core_floor_s(compile_training_step(small, mesh, num_chips, tcfg), floors)]

    f2, f3 = floor_at(2), floor_at(3)
    return max(a + (per_chunk - 2) * (b - a) for a, b in zip(f2, f3, strict=True))

