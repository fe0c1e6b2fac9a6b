"""A chip's HBM occupancy over the step: the static bytes (weights, optimizer state, the
resident cache) plus every memory event's bytes while it is live, its peak and the peak's parts
(docs/model/training.md, "Memory")."""

from __future__ import annotations

import numpy as np

from topologies.errors import TpusimError
from workloads.memory import MEMORY_CATEGORIES
from workloads.trace import Trace
from workloads.trace_meta import TraceMeta


def static_hbm_bytes(meta: TraceMeta) -> float:
    """A trace's static HBM state in bytes, resident from the start of the step: the sum of meta
    `static_composition`, or `static_hbm_bytes` when the trace has no composition."""
    comp = meta.static_composition
    if comp:
        return sum(float(v) for v in comp.values())
    return float(meta.static_hbm_bytes or 0.0)


def hbm_occupancy(trace: Trace, end, pp: int) -> tuple[float, dict[str, float], list[tuple]]:
    """HBM over the step: (peak bytes, its composition by category, the memory table rows).

    The static state (meta `static_composition`, or `static_hbm_bytes` as `other`) is resident
    from the start; categorised events (meta `memory_events`: [op id, category, bytes]) apply when
    their op ends, all of one op's events at once. Traces without events (decode) use the ops'
    `alloc_bytes - free_bytes` as `other` plus the meta `logits_bytes` as a transient at the peak.
    A pipeline stage's in-flight microbatches' activations (meta `activation_bytes_estimate`)
    bound the peak from below.
    """
    meta = trace.meta
    static = float(meta.static_hbm_bytes or 0.0)
    level = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    comp = meta.static_composition
    if comp:
        for k, v in comp.items():
            level[k] += float(v)
    else:
        level["other"] += static
    raw = meta.memory_events
    end = as_floats(end)
    if raw is not None:
        events = []
        for ev in raw:
            op_id, cat, delta = int(ev[0]), str(ev[1]), float(ev[2])
            if not 0 <= op_id < len(trace.ops) or cat not in level:
                raise TpusimError(
                    f"trace memory event {ev!r} names op {op_id} or category {cat!r}, which the "
                    f"trace lacks (categories: {', '.join(MEMORY_CATEGORIES)}); recompile it"
                )
            events.append((end[op_id], op_id, cat, delta))
    else:
        events = [(end[o.id], o.id, "other", o.alloc_bytes - o.free_bytes)
                  for o in trace.ops if o.alloc_bytes or o.free_bytes]
    events.sort(key=lambda e: (e[0], e[1]))

    def row(t):
        return (0, t, sum(level.values()), *level.values())

    mem = [row(0.0)]
    peak_parts = dict(level)
    peak = sum(level.values())
    i = 0
    while i < len(events):
        t, op_id = events[i][0], events[i][1]
        while i < len(events) and events[i][0] == t and events[i][1] == op_id:
            level[events[i][2]] += events[i][3]
            i += 1
        mem.append(row(t))
        total = sum(level.values())
        if total > peak:
            peak, peak_parts = total, dict(level)
    if raw is None and meta.logits_bytes:
        peak_parts["logits"] += float(meta.logits_bytes)  # transient during the loss
        peak += float(meta.logits_bytes)
    pp_act = float(meta.activation_bytes_estimate or 0.0)
    if pp > 1 and static + pp_act > peak:
        peak = static + pp_act
        peak_parts = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
        for k, v in (comp or {"other": static}).items():
            peak_parts[k] += float(v)
        peak_parts["saved_activations"] += pp_act
    return peak, {k: v for k, v in peak_parts.items() if v}, mem


def as_floats(a) -> list[float]:
    """An array of times as Python floats (the same values; indexing a list element by element
    is several times faster than an array's)."""
    return a.tolist() if isinstance(a, np.ndarray) else [float(x) for x in a]
