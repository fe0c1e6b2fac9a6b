"""The stage-level pipeline model, a reference the per-chip pipeline
(`sim.engine.pipeline.simulate_pipeline_chips`) is tested against: each pass of a one-microbatch
chunk program timed once by `replay` in isolation, each stage-to-stage send a collective-permute
over the pipeline axis, and the schedule run stage by stage (every chip of a stage identical). On a
healthy pod with one hop between stages the two agree to 1e-9 (tests/test_pipeline.py)."""

from __future__ import annotations

from sim.engine.costs import collective_groups, cost_collective, merge_axis_factors
from sim.engine.pipeline import PipelineResult, check_schedule, chunk_program, stage_order
from sim.engine.replay import replay
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.torus import Topology
from workloads.models import TransformerSpec
from workloads.trace import OpKind, Trace
from workloads.training import WEIGHT_CAST, TrainingConfig


def _pass_times(trace: Trace, chip: ChipSpec, topology: Topology, algorithm: str
                ) -> tuple[float, float, float, float]:
    """(forward, backward, tail, weight cast) seconds of a one-microbatch chunk program. The
    cast (--gather-dtype) runs last in the chunk, alone; a stage runs it before its passes."""
    res = replay(trace, chip, topology, algorithm=algorithm)
    ops = trace.ops
    comp = [o for o in ops if o.kind == OpKind.COMPUTE]
    end = {row[1]: row[9] for row in res.op_rows}
    cast = sum(row[9] - row[8] for row in res.op_rows if row[2] == WEIGHT_CAST)
    f_end = max(end[o.id] for o in comp if o.phase in ("fwd", "loss"))
    b_end = max(end[o.id] for o in comp if o.phase == "bwd")
    step = float(max(end.values()))
    return f_end, b_end - f_end, step - b_end - cast, cast


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
    cast = [0.0] * p  # the stage's weight cast, before its first pass
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
            tr = chunk_program(model, mesh, topology.num_chips, config, c)
            cache[key] = (tr, _pass_times(tr, chip, topology, algorithm))
        tr, (tf, tb, tt, tc) = cache[key]
        fwd[s][vv], bwd[s][vv] = tf, tb
        if vv == 0:
            tail[s], cast[s] = tt, tc
            static[s] = float(tr.meta.static_hbm_bytes)
            static_parts[s] = dict(tr.meta.static_composition or {"other": static[s]})
        act[s] = float(tr.meta.activation_bytes_estimate)
        if key[1]:
            logits[s] = float(tr.meta.logits_bytes or 0.0)
        send_bytes = float(tr.meta.pipeline_send_bytes or send_bytes)
    # Stage-to-stage sends: a collective-permute over the pipeline axis, as placed on the pod.
    groups = collective_groups(tr, topology)
    gaxes = merge_axis_factors(topology, list(groups["pipeline"]))
    send = cost_collective(chip, topology, "collective-permute", gaxes, max(send_bytes, 1.0),
                           algorithm).time_s

    orders = [stage_order(sched, p, s, m, v) for s in range(p)]
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    free = list(cast)
    nxt = [0] * p
    busy = list(cast)
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
