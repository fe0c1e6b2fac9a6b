"""Pipeline schedules: GPipe, 1F1B and interleaved 1F1B, simulated on the per-chip engine.

`simulate_pipeline_chips` (what `train`, `replay` and `export` run): every stage's chips run
their stage's program (`build_stage_programs`: the one-microbatch chunk programs of
`workloads.training.compile_pipeline_chunk` copied pass by pass in the schedule's order,
`stage_order`; the first chunk holds the embedding, the last the output projection and the
loss), stage-to-stage activation and gradient sends are point-to-point transfers on the routes
between neighbouring stages' chips (ICI, or DCN when the pipeline axis spans slices), and
in-stage collectives are rendezvous of their groups. So slow chips and links, dead links, chip
variation and the brute-force mode apply, and the bubble is whatever idle time the schedule
leaves, not a formula. Per-stage memory follows the schedule through the copied HBM events.

The earlier stage-level model (each pass timed once by `replay` in isolation, each send a
collective-permute over the pipeline axis, the schedule run stage by stage) is kept as a test
reference in tests/pipeline_reference.py: on a healthy pod with one hop between stages the two
agree to 1e-9; docs/model.md "Pipeline schedules" says where they differ.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.engine.costs import collective_groups, merge_axis_factors
from sim.engine.executors import simulate_chips
from sim.engine.memory import hbm_occupancy
from sim.engine.perchip import PerChipConfig, PointToPoint
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import GroupGeometry
from topologies.torus import Topology
from topologies.validate import MAX_TRACE_OPS
from workloads.memory import MEMORY_CATEGORIES
from workloads.models import TransformerSpec
from workloads.moe import expert_op_scales
from workloads.trace import Op, OpKind, Trace
from workloads.trace_meta import TraceMeta
from workloads.training import WEIGHT_CAST, TrainingConfig, compile_pipeline_chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class Pass:
    kind: str  # "F" or "B"
    chunk: int  # model chunk 0 .. p*V-1 (chunk c runs on stage c % p)
    microbatch: int


def stage_order(schedule: str, stages: int, stage: int, microbatches: int,
                virtual: int = 1) -> list[Pass]:
    """The passes of `stage` in execution order.

    * gpipe: every forward, then every backward (microbatches in order);
    * 1f1b (PipeDream-flush, as Megatron-LM): `p - s - 1` warm-up forwards, then one forward
      and one backward alternately, then the remaining backwards;
    * interleaved (Megatron-LM's interleaved 1F1B): the stage holds chunks s, s+p, ...,
      s+(V-1)p; forwards go through them in groups of p microbatches, with
      `2(p - s - 1) + (V - 1)p` warm-up forwards.
    """
    p, s, m, v = stages, stage, microbatches, virtual
    if schedule == "gpipe":
        return [Pass(kind="F", chunk=s, microbatch=i) for i in range(m)] + \
            [Pass(kind="B", chunk=s, microbatch=i) for i in range(m)]
    if schedule == "1f1b":
        fwd = [Pass(kind="F", chunk=s, microbatch=i) for i in range(m)]
        bwd = [Pass(kind="B", chunk=s, microbatch=i) for i in range(m)]
        warm = min(p - s - 1, m)
    elif schedule == "interleaved":
        total = m * v

        def fwd_pass(k: int) -> Pass:
            group, pos = divmod(k, p * v)
            return Pass(kind="F", chunk=((pos // p) % v) * p + s,
                        microbatch=group * p + pos % p)

        def bwd_pass(k: int) -> Pass:
            group, pos = divmod(k, p * v)
            return Pass(kind="B", chunk=(v - 1 - (pos // p) % v) * p + s,
                        microbatch=group * p + pos % p)

        fwd = [fwd_pass(k) for k in range(total)]
        bwd = [bwd_pass(k) for k in range(total)]
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
    else:  # pragma: no cover - TrainingConfig validates the name
        raise TpusimError(f"unknown pipeline schedule {schedule!r}")
    order = fwd[:warm]
    rest_f, rest_b = fwd[warm:], list(bwd)
    while rest_f:
        order.append(rest_f.pop(0))
        order.append(rest_b.pop(0))
    return order + rest_b


@dataclass(kw_only=True)
class PipelineResult:
    """The simulated schedule (seconds; per-stage lists indexed by stage)."""

    schedule: str
    stages: int
    virtual_stages: int
    microbatches: int
    step_time_s: float
    span_s: float  # first pass start to last pass end
    bubble_s: float  # idle time of the busiest stage within the span
    bubble_fraction: float
    forward_s: list[list[float]]  # [stage][virtual chunk]
    backward_s: list[list[float]]
    send_s: float
    tail_s: list[float]  # after the last backward: gradient reductions and the update
    stage_finish_s: list[float]
    stage_busy_s: list[float]
    peak_inflight: list[int]  # microbatch-chunks with forward done and backward not
    stage_hbm_peak_bytes: list[float]
    stage_hbm_peak_breakdown: list[dict[str, float]]
    timeline: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)
    # Most saved activations a stage holds at once (per-chip engine; from its HBM events).
    stage_saved_activations_peak_bytes: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "stages": self.stages,
            "virtual_stages": self.virtual_stages, "microbatches": self.microbatches,
            "span_s": self.span_s, "bubble_s": self.bubble_s,
            "bubble_fraction": self.bubble_fraction,
            "forward_s": self.forward_s, "backward_s": self.backward_s, "send_s": self.send_s,
            "tail_s": self.tail_s, "stage_finish_s": self.stage_finish_s,
            "stage_busy_s": self.stage_busy_s, "peak_inflight_microbatches": self.peak_inflight,
            "stage_hbm_peak_bytes": self.stage_hbm_peak_bytes,
            "stage_hbm_peak_breakdown": self.stage_hbm_peak_breakdown,
            **({"stage_saved_activations_peak_bytes": self.stage_saved_activations_peak_bytes}
               if self.stage_saved_activations_peak_bytes else {}),
        }


def check_schedule(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    """One-line errors for a schedule the mesh cannot run."""
    if stages < 2:
        raise TpusimError(
            f"{{pipeline_schedule}} {schedule} needs a pipeline axis of 2 or more stages, but "
            f"the mesh has none; add pipeline=P to {{mesh}} (or {{dcn}}) or drop "
            f"{{pipeline_schedule}}", "pipeline_schedule", "mesh", "dcn"
        )
    if schedule in ("1f1b", "interleaved") and microbatches < stages:
        raise TpusimError(
            f"{{pipeline_schedule}} {schedule} needs at least as many microbatches as stages, "
            f"but {{microbatches}} {microbatches} < pipeline={stages}; raise {{microbatches}} or "
            f"use {{pipeline_schedule}} gpipe", "pipeline_schedule", "microbatches"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise TpusimError(
            f"{{pipeline_schedule}} interleaved sends microbatches through the stages in "
            f"groups of pipeline={stages}, but {{microbatches}} {microbatches} is not a "
            f"multiple; use a multiple of {stages}", "pipeline_schedule", "microbatches"
        )


# -- the schedule on the per-chip engine ------------------------------------------------------
# Channels of the stage-to-stage sends: activations go to the next stage, gradients back.
FWD_CHANNEL, BWD_CHANNEL = 0, 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePrograms:
    """Each stage's program: its passes in schedule order, with the sends and receives between
    stages (the per-chip engine's `PointToPoint` ops).

    Attributes:
        programs: one `Trace` per stage.
        passes: per stage, (pass, receive op id or -1, first core op id, last core op id).
        sends: per stage, {send op id: (channel, tag of the receiving pass)}.
        recvs: per stage, {tag: receive op id}.
        forward_ops / backward_ops: compute ops of one pass of each chunk (its F and B).
    """

    programs: tuple[Trace, ...]
    passes: tuple[tuple[tuple[Pass, int, int, int], ...], ...]
    sends: tuple[dict[int, tuple[int, int]], ...]
    recvs: tuple[dict[int, int], ...]
    peak_inflight: tuple[int, ...]


def _tag(kind: str, chunk: int, microbatch: int, chunks: int, m: int) -> int:
    return ((kind == "B") * chunks + chunk) * m + microbatch


def build_stage_programs(model: TransformerSpec, mesh, num_chips: int,
                         config: TrainingConfig) -> StagePrograms:
    """Compose every stage's program from one-microbatch chunk programs
    (`compile_pipeline_chunk`) in the order `stage_order` gives.

    A forward pass is the chunk's forward ops (phase fwd/loss), a backward pass its backward
    ops (phase bwd), each copied per microbatch. A pass's ops that depend on nothing inside the
    pass wait for the previous pass's last compute op on the stage (a pass's weight gathers are
    issued when the stage reaches it); its entry op (`stage_input` / `stage_grad_input`) also
    waits for its receive. After a pass that feeds another stage comes a send of the
    microbatch's activations (forward) or input gradients (backward). Data-parallel gradient
    all-reduces run once per chunk, after its last microbatch's backward; gradients are
    allocated at microbatch 0's backward; the stage's optimizer update (of its first chunk's
    program, which counts the whole stage's parameters) comes last, after every gradient
    reduction. Memory events follow the copies, so saved activations live from a pass's
    forward to its backward, as the schedule orders them.
    """
    p, v, m = mesh.size("pipeline"), config.virtual_stages, config.microbatches
    sched = config.pipeline_schedule
    check_schedule(sched, p, m, v)
    # The programs depend on the axis sizes, not their order or placement (which only the
    # engine's collective groups see, from the programs' mesh): a plan's placements and a
    # sweep's hardware points share one composition, on the mesh each asks for.
    key = _sizes_key(model, mesh, num_chips, config)
    with _STAGE_LOCK:
        hit = _STAGE_CACHE.get(key)
        if hit is not None:
            _STAGE_CACHE.move_to_end(key)
    if hit is not None:
        return dataclasses.replace(hit, programs=tuple(
            _trusted_trace(mesh, prog.ops, prog.meta) for prog in hit.programs))
    chunks = p * v

    def chunk_trace(c: int) -> Trace:
        return chunk_program(model, mesh, num_chips, config, c)

    send_bytes = float(chunk_trace(0).meta.pipeline_send_bytes)
    templates: dict[tuple, _PassTemplate] = {}

    def template(c: int, fwd: bool, last_mb: bool) -> _PassTemplate:
        key = (c == 0, c == chunks - 1, fwd, last_mb or fwd)
        if key not in templates:
            templates[key] = _pass_template(chunk_trace(c), fwd, last_mb, v)
        return templates[key]

    programs, passes, sends, recvs, inflight = [], [], [], [], []
    for s in range(p):
        prog, stage_passes, stage_sends, stage_recvs, peak = _compose_stage(
            s, config, chunks, chunk_trace, template, send_bytes)
        programs.append(prog)
        passes.append(stage_passes)
        sends.append(stage_sends)
        recvs.append(stage_recvs)
        inflight.append(peak)
    out = StagePrograms(programs=tuple(programs), passes=tuple(passes), sends=tuple(sends),
                        recvs=tuple(recvs), peak_inflight=tuple(inflight))
    with _STAGE_LOCK:
        _STAGE_CACHE[key] = out
        while len(_STAGE_CACHE) > STAGE_CACHE_SIZE:
            _STAGE_CACHE.popitem(last=False)
    return out



def _compose_stage(s: int, config: TrainingConfig, chunks: int, chunk_trace, template,
                   send_bytes: float) -> tuple[Trace, tuple, dict, dict, int]:
    """Stage `s`'s program (`build_stage_programs`' rules): its weight cast, every pass of its
    schedule copied from the pass templates with its receives and sends, and its optimizer
    update. Returns the program, its passes (schedule pass, receive op, first and last core
    op), its sends (op id -> (channel, tag)), its receives (tag -> op id) and the most
    microbatches in flight."""
    p, v, m = chunks // config.virtual_stages, config.virtual_stages, config.microbatches
    sched = config.pipeline_schedule
    ops: list = []
    events: list[list] = []
    stage_passes = []
    stage_sends: dict[int, tuple[int, int]] = {}
    stage_recvs: dict[int, int] = {}
    fstart: dict[tuple[int, int], int] = {}  # a forward pass's first op id
    grad_colls: list[int] = []
    gate: int | None = None
    live = peak = 0

    def add(op, deps, _ops=ops, _s=s):
        if len(_ops) >= MAX_TRACE_OPS:  # the compiler refuses most such counts first
            raise TpusimError(
                f"pipeline stage {_s}'s program composes to more than {MAX_TRACE_OPS:,} ops, "
                f"the most tpusim simulates in one program; use fewer {{microbatches}}",
                "microbatches")
        new = _copy_op(op, len(_ops), tuple(sorted(set(deps))))
        _ops.append(new)
        return new.id

    def p2p_op(name: str, phase: str, deps=(), _add=add) -> int:
        return _add(Op(id=0, name=name, kind=OpKind.COLLECTIVE, collective="send",
                      mesh_axes=("pipeline",), bytes=send_bytes, phase=phase), deps)

    for op in chunk_trace(s).ops:
        if op.name == WEIGHT_CAST:
            # The stage's weights cast once, before its first pass (a whole step's program
            # casts before its first forward; the chunk holds it after its update).
            gate = add(dataclasses.replace(op, phase="fwd"), [])
    for ps in stage_order(sched, p, s, m, v):
        c, i, fwd = ps.chunk, ps.microbatch, ps.kind == "F"
        t = template(c, fwd, i == m - 1)
        has_recv = (fwd and c > 0) or (not fwd and c < chunks - 1)
        recv = -1
        if has_recv:
            recv = p2p_op("pipeline_recv_" + ("fwd" if fwd else "bwd"),
                          "fwd" if fwd else "bwd")
            stage_recvs[_tag(ps.kind, c, i, chunks, m)] = recv
        start = len(ops)
        outer = -1 if fwd else fstart.pop((c, i))
        for fields_, inner, outer_pos, entry in t.ops:
            deps = [start + k for k in inner]
            if outer_pos:
                deps += [outer + k for k in outer_pos]
            if not inner and gate is not None:
                deps.append(gate)
            if entry and recv >= 0:
                deps.append(recv)
            new = object.__new__(Op)
            for setter, value in fields_:
                setter(new, value)
            _SET_ID(new, len(ops))
            _SET_DEPS(new, tuple(sorted(set(deps))))
            ops.append(new)
        grad_colls += [start + k for k in t.grad_colls]
        for k, cat, delta, grads in t.events:
            if grads and i > 0:
                continue
            events.append([start + k, cat, delta])
        if not t.core:
            raise ValueError("min() arg is an empty sequence")  # as min(core) would
        stage_passes.append((ps, recv, start + t.core[0], start + t.core[-1]))
        gate = start + t.core[-1]
        if fwd:
            fstart[(c, i)] = start
            live += 1
            peak = max(peak, live)
        else:
            live -= 1
        if fwd and c < chunks - 1:
            sid = p2p_op("pipeline_send_fwd", "fwd", [gate])
            stage_sends[sid] = (FWD_CHANNEL, _tag("F", c + 1, i, chunks, m))
        elif not fwd and c > 0:
            sid = p2p_op("pipeline_send_bwd", "bwd", [gate])
            stage_sends[sid] = (BWD_CHANNEL, _tag("B", c - 1, i, chunks, m))
    first = chunk_trace(s)
    for op in first.ops:
        if op.phase == "optimizer" and op.name != WEIGHT_CAST:
            upd = add(op, [gate] + grad_colls)
            for op_id, cat, delta in first.meta.memory_events or ():
                if op_id == op.id:
                    events.append([upd, cat, delta])
    kept = ("kind", "model", "overlap", "static_hbm_bytes", "static_composition", "num_chips",
            "moe")
    meta = TraceMeta.of(**{k: getattr(first.meta, k) for k in kept
                           if k in first.meta.key_order},
                        memory_events=events, pipeline_stage=s, microbatches=m)
    return (_trusted_trace(first.mesh, tuple(ops), meta), tuple(stage_passes), stage_sends,
            stage_recvs, peak)

# The last few compositions, most recently used last (a 405B stage program with 8
# microbatches is ~50k ops, tens of MB).
STAGE_CACHE_SIZE = 2
_STAGE_CACHE: OrderedDict[tuple, StagePrograms] = OrderedDict()
_STAGE_LOCK = threading.Lock()
# The last STAGE_CACHE_SIZE meshes' chunk programs, by (first, last) chunk.
_CHUNK_CACHE: OrderedDict[tuple, dict[tuple[bool, bool], Trace]] = OrderedDict()


def _sizes_key(model: TransformerSpec, mesh, num_chips: int, config: TrainingConfig) -> tuple:
    """What a pipeline's chunk and stage programs depend on: the axis sizes, not their order."""
    return (model, tuple(sorted(mesh.axes)), tuple(sorted(mesh.dcn_axes)), num_chips, config)


def chunk_program(model: TransformerSpec, mesh, num_chips: int, config: TrainingConfig,
                  chunk: int) -> Trace:
    """Chunk `chunk`'s one-microbatch program (`compile_pipeline_chunk`). Chunks differ only in
    holding the embedding (the first) or the loss (the last), so a mesh has at most four; the
    last STAGE_CACHE_SIZE meshes' are kept per process (their ops and meta do not depend on the
    axis order; a program compiled on another order comes back on `mesh`), shared by
    `simulate_pipeline`, the stage programs' composition and the plan's pass-level bound
    (`sim.studies.plan_bounds.pipeline_schedule_bound`)."""
    chunks = mesh.size("pipeline") * config.virtual_stages
    which = (chunk == 0, chunk == chunks - 1)
    key = _sizes_key(model, mesh, num_chips, config)
    with _STAGE_LOCK:
        programs = _CHUNK_CACHE.get(key)
        if programs is None:
            programs = _CHUNK_CACHE[key] = {}
            while len(_CHUNK_CACHE) > STAGE_CACHE_SIZE:
                _CHUNK_CACHE.popitem(last=False)
        else:
            _CHUNK_CACHE.move_to_end(key)
        hit = programs.get(which)
    if hit is None:
        hit = compile_pipeline_chunk(model, mesh, num_chips, config, first=which[0],
                                     last=which[1])
        with _STAGE_LOCK:
            hit = programs.setdefault(which, hit)
    # On the caller's mesh: the engine takes the collective groups from the program's mesh.
    return hit if hit.mesh == mesh else _trusted_trace(mesh, hit.ops, hit.meta)


# Composing a 405B stage program copies ~50k ops (8 microbatches x 2 passes x ~3k ops): an op
# is copied by setting its slots directly (`dataclasses.replace` costs twice as much), and
# each pass's copy follows a template computed once per chunk program and pass kind.
_OP_SLOTS = tuple(f.name for f in dataclasses.fields(Op))
_SET_ID, _SET_DEPS = Op.id.__set__, Op.deps.__set__


def _copy_op(op: Op, new_id: int, deps: tuple[int, ...]) -> Op:
    """`dataclasses.replace(op, id=new_id, deps=deps)`, without its per-call overhead."""
    new = object.__new__(Op)
    for name in _OP_SLOTS:
        object.__setattr__(new, name, getattr(op, name))
    _SET_ID(new, new_id)
    _SET_DEPS(new, deps)
    return new


@dataclass(frozen=True, slots=True, kw_only=True)
class _PassTemplate:
    """One pass of a chunk program as `build_stage_programs` copies it per microbatch, in
    positions within the pass (the copy's op ids are its first id plus these).

    ops: per op, (its other fields as (slot setter, value) pairs, positions of its
        dependencies inside the pass, positions in its forward pass of its dependencies
        there (backward passes), whether it is the pass's entry op that waits for the
        receive); an op with no dependency inside the pass waits for the previous pass.
    core: positions of its compute ops. grad_colls: positions of its gradient collectives.
    events: its memory events as (position, category, bytes, whether a gradient allocation,
        which only microbatch 0's pass makes; its bytes / virtual stages).
    """

    ops: tuple
    core: tuple[int, ...]
    grad_colls: tuple[int, ...]
    events: tuple


def _pass_template(tr: Trace, fwd: bool, last_mb: bool, v: int) -> _PassTemplate:
    phases = ("fwd", "loss") if fwd else ("bwd",)
    ids = [o.id for o in tr.ops if o.phase in phases and not (
        not fwd and not last_mb and o.name.startswith("dp_grad_allreduce"))]
    pos = {old: k for k, old in enumerate(ids)}
    fwd_pos = {} if fwd else {o.id: k for k, o in enumerate(
        o for o in tr.ops if o.phase in ("fwd", "loss"))}
    setters = [(Op.__dict__[name].__set__, name) for name in _OP_SLOTS
               if name not in ("id", "deps")]
    ops, core, grad = [], [], []
    for k, old in enumerate(ids):
        op = tr.ops[old]
        inner = tuple(pos[d] for d in op.deps if d in pos)
        outer = tuple(fwd_pos[d] for d in op.deps if d not in pos and d in fwd_pos)
        entry = op.name in ("stage_input", "stage_grad_input")
        ops.append((tuple((st, getattr(op, name)) for st, name in setters), inner, outer,
                    entry))
        if op.kind == OpKind.COMPUTE:
            core.append(k)
        if not fwd and op.kind == OpKind.COLLECTIVE and "grad" in op.name:
            grad.append(k)
    events = []
    for op_id, cat, delta in tr.meta.memory_events or ():
        if op_id not in pos:
            continue
        grads = cat == "gradients"
        events.append((pos[op_id], cat, delta / v if grads else delta, grads))
    return _PassTemplate(ops=tuple(ops), core=tuple(core), grad_colls=tuple(grad),
                         events=tuple(events))


def _trusted_trace(mesh, ops: tuple, meta: TraceMeta) -> Trace:
    """A `Trace` of ops composed from validated chunk programs, without `Trace.__post_init__`'s
    pass over every op: ids are 0, 1, 2, ... by construction, every dependency is an op
    added earlier, sizes are the chunk programs' (and the sends' bytes, from their meta), and
    collectives use the chunk programs' mesh axes or `pipeline` (tested against the
    validating constructor)."""
    out = object.__new__(Trace)
    for name, value in (("mesh", mesh), ("ops", ops), ("meta", meta)):
        object.__setattr__(out, name, value)
    return out


def stage_of_chips(mesh, topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage of every chip, the chip each chip sends activations to (next stage, stage p-1 to
    stage 0 for interleaved chunks), the chip it sends gradients to (previous stage)): the
    chip's position along the pipeline axis as the mesh places it on the pod."""

    probe = Trace(mesh=mesh, ops=())
    gaxes = merge_axis_factors(topology, list(collective_groups(probe, topology)["pipeline"]))
    geo = GroupGeometry(topology, gaxes)
    p = geo.group_size
    stage = np.asarray(geo.local_of_chip, dtype=np.int64)
    at = np.empty((geo.num_groups, p), dtype=np.int64)
    at[geo.group_of_chip, stage] = np.arange(topology.num_chips)
    nxt = at[geo.group_of_chip, (stage + 1) % p]
    prv = at[geo.group_of_chip, (stage - 1) % p]
    return stage, nxt, prv


def simulate_pipeline_chips(
    model: TransformerSpec, mesh, chip: ChipSpec, topology: Topology, config: TrainingConfig,
    *, base=None, algorithm: str = "auto", overlap: bool | None = None,
):
    """Run the schedule on the per-chip engine: every stage's chips run their stage's program
    (`build_stage_programs`), sends are point-to-point transfers between neighbouring stages'
    chips on their routes (ICI, or DCN when the pipeline axis spans slices), and in-stage
    collectives are rendezvous of their groups. `base` (a `PerChipConfig`) carries the
    perturbations (slow chips and links, dead links, chip variation, `mode`); an uneven MoE
    router's per-chip expert loads are derived here from the stage programs
    (`workloads.moe.expert_op_scales` per stage), so `base.op_scale` must be empty.

    Returns (the slowest chip's `StepResult` with the bubble in its breakdown and the fullest
    stage's HBM peak, the `PipelineResult` of the schedule as it ran)."""
    base = base or PerChipConfig()
    if base.op_scale:
        raise TpusimError(
            "internal error: per-op scales of a pipeline run refer to the stage programs and "
            "are derived from them; pass a PerChipConfig without op_scale"
        )
    sp = build_stage_programs(model, mesh, topology.num_chips, config)
    stage, nxt, prv = stage_of_chips(mesh, topology)
    # Expert loads per stage program: op ids differ between stages, so each chip takes the
    # factors of its own stage's ops (1 where another stage's op shares the id).
    op_scale: dict[int, np.ndarray] = {}
    for s, prog in enumerate(sp.programs):
        mask = stage == s
        for op_id, factor in expert_op_scales(prog, topology).items():
            col = op_scale.setdefault(op_id, np.ones(topology.num_chips))
            col[mask] = np.asarray(factor, dtype=float)[mask]
    cfg = dataclasses.replace(
        base, programs=sp.programs, program_of_chip=stage, op_scale=op_scale,
        p2p=PointToPoint(peer_of_chip=(nxt, prv), sends=sp.sends, recvs=sp.recvs))
    res = simulate_chips(sp.programs[0], chip, topology, config=cfg, algorithm=algorithm,
                         overlap=overlap)
    pipe, memory_rows = _schedule_result(res, sp, stage, config, hbm_occupancy)
    # Perfetto names each class's process after its stage (and the chunks it holds).
    titles = {int(c): _stage_title(int(stage[int(r)]), len(sp.programs), config.virtual_stages)
              for c, r in enumerate(res.classes.reps)}
    res = dataclasses.replace(res, memory_rows=memory_rows,
                              classes=dataclasses.replace(res.classes, titles=titles),
                              **_scheduled_parts(res, pipe, sp, stage))
    return res, pipe


def _stage_title(s: int, p: int, v: int) -> str:
    chunks = [vv * p + s for vv in range(v)]
    extra = ["embedding"] if s == 0 else []
    extra += ["loss"] if s == p - 1 else []
    held = f"chunk{'s' if v > 1 else ''} {','.join(map(str, chunks))}" if v > 1 else ""
    what = ", ".join(([held] if held else []) + extra)
    return f"pipeline stage {s}/{p}" + (f" ({what})" if what else "")


def _stage_class(res, stage: np.ndarray, s: int) -> int:
    """The class of the chip of stage `s` that finishes last (its first chip among equals)."""
    label = res.classes.of_chip
    finish = np.asarray([row[0] for row in res.classes.rows])
    chips = np.flatnonzero(stage == s)
    return int(label[chips[int(np.argmax(finish[label[chips]]))]])


def _pass_spans(sp: StagePrograms, s: int, start, end):
    """Per pass of stage s: (ready, end) where ready = when its input had arrived and the
    stage was free (the bubble is the time between the previous pass's end and ready)."""
    out = []
    prev = 0.0
    for _ps, recv, _first, last in sp.passes[s]:
        arrived = float(end[recv]) if recv >= 0 else 0.0
        ready = max(prev, arrived)
        out.append((ready, float(end[last]), max(arrived - prev, 0.0) if recv >= 0 else 0.0))
        prev = float(end[last])
    return out


def _schedule_result(res, sp: StagePrograms, stage, config, hbm_occupancy
                     ) -> tuple[PipelineResult, list[tuple]]:
    """The schedule as it ran, and the memory table: every stage's HBM over the step (its
    slowest chip's, by chip id)."""
    p = len(sp.programs)
    v, m = config.virtual_stages, config.microbatches
    fwd = [[0.0] * v for _ in range(p)]
    bwd = [[0.0] * v for _ in range(p)]
    busy, finish, tail, last_end, hbm, parts, saved = [], [], [], [], [], [], []
    memory_rows = []
    send_s = 0.0
    timeline = []
    for s in range(p):
        c = _stage_class(res, stage, s)
        start, end = res.classes.timelines[c]
        times = _pass_spans(sp, s, start, end)
        busy.append(sum(e - r for r, e, _w in times))
        last_end.append(max(e for _r, e, _w in times))
        finish.append(float(res.classes.rows[c][0]))
        tail.append(finish[-1] - last_end[-1])
        seen: set[tuple[str, int]] = set()
        for (ps, _recv, first, last), (r, e, _w) in zip(sp.passes[s], times, strict=True):
            timeline.append((s, ps.kind, ps.chunk, ps.microbatch, r, e))
            if (ps.kind, ps.chunk) not in seen:  # the chunk's first pass (microbatch 0)
                seen.add((ps.kind, ps.chunk))
                (fwd if ps.kind == "F" else bwd)[s][ps.chunk // p] = float(end[last] -
                                                                            start[first])
        if s == 0 and sp.sends[0]:
            sid = min(sp.sends[0])
            send_s = float(end[sid] - start[sid])
        pk, pp_parts, rows = hbm_occupancy(sp.programs[s], end, 1)
        rep = int(res.classes.reps[c])
        memory_rows += [(rep,) + r[1:] for r in rows]
        hbm.append(pk)
        parts.append(pp_parts)
        col = 3 + list(MEMORY_CATEGORIES).index("saved_activations")
        saved.append(max(float(r[col]) for r in rows))
    span = max(last_end)
    bubble = span - max(busy)
    return PipelineResult(
        schedule=config.pipeline_schedule, stages=p, virtual_stages=v, microbatches=m,
        step_time_s=res.step_time_s, span_s=span, bubble_s=bubble,
        bubble_fraction=bubble / span if span else 0.0, forward_s=fwd, backward_s=bwd,
        send_s=send_s, tail_s=tail, stage_finish_s=finish, stage_busy_s=busy,
        peak_inflight=list(sp.peak_inflight), stage_hbm_peak_bytes=hbm,
        stage_hbm_peak_breakdown=parts, timeline=timeline, stage_saved_activations_peak_bytes=saved,
    ), memory_rows


def _scheduled_parts(res, pipe: PipelineResult, sp: StagePrograms, stage) -> dict:
    """The slowest chip's breakdown: its waits for a neighbouring stage are the bubble (they
    were gaps on its core, counted as exposed communication); the HBM peak of the fullest
    stage. The `StepResult` fields that change, by name."""
    rows = res.classes.rows
    slow_class = int(np.argmax([row[0] for row in rows]))
    s = int(stage[int(res.classes.reps[slow_class])])
    start, end = res.classes.timelines[slow_class]
    waits = sum(w for _r, _e, w in _pass_spans(sp, s, start, end))
    bd = dict(res.breakdown)
    moved = min(waits, bd.get("exposed_comm_s", 0.0))
    bd["exposed_comm_s"] = bd.get("exposed_comm_s", 0.0) - moved
    bd["pipeline_bubble_s"] = bd.get("pipeline_bubble_s", 0.0) + moved
    peak = max(pipe.stage_hbm_peak_bytes)
    fullest = pipe.stage_hbm_peak_bytes.index(peak)
    return {"breakdown": bd, "hbm_peak_bytes": peak,
            "hbm_peak_breakdown": dict(pipe.stage_hbm_peak_breakdown[fullest]),
            "fits_in_hbm": peak <= res.hbm_capacity_bytes}


__all__ = ["Pass", "PipelineResult", "StagePrograms", "build_stage_programs",
           "check_schedule", "simulate_pipeline_chips", "stage_of_chips",
           "stage_order"]
