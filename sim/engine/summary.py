"""One chip's timeline summarised into a `StepResult`: the critical-path breakdown along the
core's ops, the unit and link-class busy times, the HBM occupancy and the ops table."""

from __future__ import annotations

from sim.engine.memory import as_floats, hbm_occupancy
from sim.engine.result import BREAKDOWN_KEYS, StepResult, op_rows
from topologies.groups import (
    CLASS_NAMES,
    NUM_CLASSES,
)
from workloads.trace import OpKind, Unit


def class_capacity(lm) -> dict[str, float]:
    """Every link class's capacity (bytes/s per link) of a `LinkModel`."""
    return {CLASS_NAMES[i]: float(lm.class_capacity_bytes_per_s[i]) for i in range(NUM_CLASSES)}


def summarize(trace, chip, topology, dur, bound, start, end, net, costs, lm, mxu_rate,
              vpu_rate, hbm_bw, *, reported_chip: int = 0, **parts) -> StepResult:
    """The step's result from one chip's timeline (`reported_chip`: the chip its table rows
    name); `parts` are the `StepResult` parts the caller has (pod, collectives, classes...)."""
    ops = trace.ops
    step = float(end.max(initial=0.0))
    end_a = end
    start, end = as_floats(start), as_floats(end)
    # Pipeline bubble: the (p-1) idle stage slots of GPipe/1F1B, each as long as one
    # microbatch's forward+backward on a stage (the standard bubble, tpu.md §4 pipeline row).
    pp = int(trace.meta.pipeline_stages or 1)
    mbs = int(trace.meta.microbatches or 1)
    bubble = 0.0
    if pp > 1:
        # One microbatch's forward+backward: the time before the optimizer update starts.
        opt = [start[o.id] for o in ops if o.phase == "optimizer"]
        work = min(opt) if opt else step
        bubble = (pp - 1) * work / mbs
    total = step + bubble
    # Critical-path breakdown along the core's timeline: compute ops by their bound unit, and
    # the gaps in between (waiting for collectives or host transfers) as exposed communication.
    core_ops = sorted(
        (o for o in ops if o.kind == OpKind.COMPUTE or o.kind == OpKind.IDLE),
        key=lambda o: (start[o.id], o.id),
    )
    bd = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    t = 0.0
    for o in core_ops:
        gap = start[o.id] - t
        if gap > 0:
            bd["exposed_comm_s"] += gap
        length = end[o.id] - start[o.id]
        b = bound[o.id]
        if o.kind == OpKind.IDLE:
            bd["pipeline_bubble_s"] += length
        elif b == "mxu":
            bd["mxu_compute_s"] += length
        elif b == "vpu":
            bd["vpu_s"] += length
        else:
            bd["hbm_bound_s"] += length
        t = max(t, end[o.id])
    if step > t:
        bd["exposed_comm_s"] += step - t
    bd["pipeline_bubble_s"] += bubble

    rows = op_rows(trace, bound, start, end)
    mxu_busy = sum(o.flops / (mxu_rate * chip.mxu_fill(o.narrow_dim)) for o in ops
                   if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
    vpu_busy = sum(o.flops / vpu_rate for o in ops
                   if o.kind == OpKind.COMPUTE and o.unit == Unit.VPU)
    hbm_busy = float(net.bytes[NUM_CLASSES]) / hbm_bw  # compute and collective DMA traffic
    pcie_busy = sum(dur[o.id] for o in ops if o.kind == OpKind.HOST)
    units = [
        (0, "mxu", mxu_busy, mxu_busy / total if total else 0.0),
        (0, "vpu", vpu_busy, vpu_busy / total if total else 0.0),
        (0, "hbm", hbm_busy, hbm_busy / total if total else 0.0),
        (0, "pcie", pcie_busy, pcie_busy / total if total else 0.0),
    ]
    links = []
    net_bytes, net_busy = net.bytes, net.busy_s
    for c in range(NUM_CLASSES):  # the HBM resource (index NUM_CLASSES) is reported in units
        if net_bytes[c] <= 0:
            continue
        cap = lm.class_capacity_bytes_per_s[c]
        links.append((CLASS_NAMES[c], float(net_bytes[c]), float(net_busy[c]),
                      float(net_bytes[c] / (cap * total)) if total else 0.0))

    peak, peak_parts, mem = hbm_occupancy(trace, end_a, pp)
    cap = chip.hbm_bytes
    coll_summary = {
        f"{k[0]} {'/'.join(g.name for g in k[1])} {k[2]}B"
        + (f" pairs#{k[3]}" if len(k) > 3 else ""): {
            "time_s": v.time_s, "group_size": v.group_size, "algorithm": v.algorithm,
        }
        for k, v in costs.items()
    }
    if reported_chip:
        rows = [(reported_chip,) + row[1:] for row in rows]
        units = [(reported_chip,) + row[1:] for row in units]
        mem = [(reported_chip,) + row[1:] for row in mem]
    return StepResult(
        step_time_s=total, breakdown=bd, hbm_peak_bytes=peak, hbm_capacity_bytes=cap,
        hbm_peak_breakdown=peak_parts, fits_in_hbm=peak <= cap, num_ops=len(ops),
        sim_events=parts.pop("sim_events", net.num_events + len(ops)),
        chip=chip.name, topology=topology.name, num_chips=topology.num_chips,
        collective_costs=coll_summary, op_rows=rows, unit_rows=units, link_class_rows=links,
        memory_rows=mem, **parts,
    )
