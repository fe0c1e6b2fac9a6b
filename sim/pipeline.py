"""Pipeline schedules simulated stage by stage: GPipe, 1F1B and interleaved 1F1B.

Each stage runs its own ordered list of forward (F) and backward (B) passes of one microbatch
through one chunk of layers, in the schedule's order; a pass starts when the stage is free and
its input has arrived from the neighbouring stage (F from the previous chunk, B from the next;
the last chunk's B from its own F through the loss). The passes' durations are `replay`s of the
compiled chunk programs (`workloads.training.compile_pipeline_chunk`: the first stage holds the
embedding, the last the output projection and loss), the stage-to-stage sends are costed as
collective-permutes over the pipeline axis on the real pod (ICI or DCN, as the mesh places it).
The bubble is whatever idle time the schedule leaves, not a formula. Per-stage memory follows
the schedule: the most microbatches whose forward is done and backward is not.

Stage-level model: every chip of a stage runs the same passes (the pipeline axis is the only
thing that differs between chips), and a send occupies its link alone (the forward and
backward sends of a step go opposite ways; two sends in the same direction at once are not
contended). docs/model.md "Pipeline schedules".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.engine import _merge, collective_groups, cost_collective, replay
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.torus import Topology
from workloads.models import TransformerSpec
from workloads.trace import OpKind, Trace
from workloads.training import TrainingConfig, compile_pipeline_chunk


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
        }


def check_schedule(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    """One-line errors for a schedule the mesh cannot run."""
    if stages < 2:
        raise TpusimError(
            f"--pipeline-schedule {schedule} needs a pipeline axis of 2 or more stages, but the "
            f"mesh has none; add pipeline=P to --mesh (or --dcn) or drop --pipeline-schedule"
        )
    if schedule in ("1f1b", "interleaved") and microbatches < stages:
        raise TpusimError(
            f"--pipeline-schedule {schedule} needs at least as many microbatches as stages, but "
            f"--microbatches {microbatches} < pipeline={stages}; raise --microbatches or use "
            f"--pipeline-schedule gpipe"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise TpusimError(
            f"--pipeline-schedule interleaved sends microbatches through the stages in groups "
            f"of pipeline={stages}, but --microbatches {microbatches} is not a multiple; use a "
            f"multiple of {stages}"
        )


def _pass_times(trace: Trace, chip: ChipSpec, topology: Topology, algorithm: str
                ) -> tuple[float, float, float]:
    """(forward, backward, tail) seconds of a one-microbatch chunk program."""
    res = replay(trace, chip, topology, algorithm=algorithm)
    ops = trace.ops
    comp = [o for o in ops if o.kind == OpKind.COMPUTE]
    end = {row[1]: row[9] for row in res._ops}
    f_end = max(end[o.id] for o in comp if o.phase in ("fwd", "loss"))
    b_end = max(end[o.id] for o in comp if o.phase == "bwd")
    step = float(max(end.values()))
    return f_end, b_end - f_end, step - b_end


def simulate_pipeline(
    model: TransformerSpec, mesh, chip: ChipSpec, topology: Topology, config: TrainingConfig,
    *, algorithm: str = "auto",
) -> PipelineResult:
    """Simulate `config.pipeline_schedule` for `model` on `mesh` over `topology`."""
    p = mesh.size("pipeline")
    v = config.virtual_stages
    m = config.microbatches
    sched = config.pipeline_schedule
    check_schedule(sched, p, m, v)
    chunks = p * v
    fwd = [[0.0] * v for _ in range(p)]
    bwd = [[0.0] * v for _ in range(p)]
    tail = [0.0] * p
    act = [0.0] * p  # saved activations of one microbatch through one chunk
    static = [0.0] * p
    static_parts: list[dict] = [{} for _ in range(p)]
    logits = [0.0] * p
    cache: dict[tuple[bool, bool], tuple] = {}
    send_bytes = 0.0
    for c in range(chunks):
        s, vv = c % p, c // p
        key = (c == 0, c == chunks - 1)
        if key not in cache:
            tr = compile_pipeline_chunk(model, mesh, topology.num_chips, config, first=key[0],
                                        last=key[1])
            cache[key] = (tr, _pass_times(tr, chip, topology, algorithm))
        tr, (tf, tb, tt) = cache[key]
        fwd[s][vv], bwd[s][vv] = tf, tb
        if vv == 0:
            tail[s] = tt
            static[s] = float(tr.meta["static_hbm_bytes"])
            static_parts[s] = dict(tr.meta.get("static_composition") or {"other": static[s]})
        act[s] = float(tr.meta["activation_bytes_estimate"])
        if key[1]:
            logits[s] = float(tr.meta.get("logits_bytes", 0.0))
        send_bytes = float(tr.meta.get("pipeline_send_bytes", send_bytes))
    # Stage-to-stage sends: a collective-permute over the pipeline axis, as placed on the pod.
    groups = collective_groups(tr, topology)
    gaxes = _merge(topology, list(groups["pipeline"]))
    send = cost_collective(chip, topology, "collective-permute", gaxes, max(send_bytes, 1.0),
                           algorithm).time_s

    orders = [stage_order(sched, p, s, m, v) for s in range(p)]
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    busy = [0.0] * p
    inflight = [0] * p
    peak = [0] * p
    timeline = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            # Run this stage's passes in order for as long as their inputs have arrived.
            while nxt[s] < len(orders[s]):
                ps = orders[s][nxt[s]]
                c, i = ps.chunk, ps.microbatch
                if ps.kind == "F":
                    if c == 0:
                        ready = 0.0
                    elif (c - 1, i) in done_f:
                        ready = done_f[(c - 1, i)] + send
                    else:
                        break
                    dur = fwd[s][c // p]
                else:
                    if c == chunks - 1:
                        if (c, i) not in done_f:
                            break
                        ready = done_f[(c, i)]
                    elif (c + 1, i) in done_b:
                        ready = done_b[(c + 1, i)] + send
                    else:
                        break
                    dur = bwd[s][c // p]
                start = max(free[s], ready)
                end = start + dur
                (done_f if ps.kind == "F" else done_b)[(c, i)] = end
                inflight[s] += 1 if ps.kind == "F" else -1
                peak[s] = max(peak[s], inflight[s])
                free[s] = end
                busy[s] += dur
                timeline.append((s, ps.kind, c, i, start, end))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules above never deadlock
            raise TpusimError(f"internal error: pipeline schedule {sched} deadlocked")
    span = max(free)
    finish = [free[s] + tail[s] for s in range(p)]
    step = max(finish)
    crit = max(range(p), key=lambda s: busy[s])
    bubble = span - busy[crit]
    hbm = [static[s] + peak[s] * act[s] + logits[s] for s in range(p)]
    parts = [{**static_parts[s], "saved_activations": peak[s] * act[s], "logits": logits[s]}
             for s in range(p)]
    return PipelineResult(
        schedule=sched, stages=p, virtual_stages=v, microbatches=m, step_time_s=step,
        span_s=span, bubble_s=bubble, bubble_fraction=bubble / span if span else 0.0,
        forward_s=fwd, backward_s=bwd, send_s=send, tail_s=tail, stage_finish_s=finish,
        stage_busy_s=busy, peak_inflight=peak, stage_hbm_peak_bytes=hbm, timeline=timeline,
        stage_hbm_peak_breakdown=[{k: v for k, v in d.items() if v} for d in parts],
    )


def apply_pipeline(result, pipe: PipelineResult) -> None:
    """Put the simulated schedule into a step's `StepResult`: step time, the bubble in the
    breakdown (the other parts scaled to the rest of the step), the HBM peak of the fullest
    stage."""
    bd = dict(result.breakdown)
    others = {k: v for k, v in bd.items() if k != "pipeline_bubble_s"}
    total = sum(others.values())
    rest = max(pipe.step_time_s - pipe.bubble_s, 0.0)
    for k, v in others.items():
        bd[k] = v * rest / total if total else 0.0
    bd["pipeline_bubble_s"] = pipe.bubble_s
    result.breakdown = bd
    result.step_time_s = pipe.step_time_s
    result.hbm_peak_bytes = max(pipe.stage_hbm_peak_bytes)
    fullest = pipe.stage_hbm_peak_bytes.index(result.hbm_peak_bytes)
    result.hbm_peak_breakdown = dict(pipe.stage_hbm_peak_breakdown[fullest])
    result.fits_in_hbm = result.hbm_peak_bytes <= result.hbm_capacity_bytes


__all__ = ["Pass", "PipelineResult", "apply_pipeline", "check_schedule", "simulate_pipeline",
           "stage_order"]
