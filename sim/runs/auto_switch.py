"""When a what-if makes `auto` switch a collective's algorithm, and that switch is what makes the
step slower.

`auto` picks each collective's algorithm by its time alone on the pod's links. A what-if that
changes what the links are (`set` overrides of the chip's link numbers: ICI bandwidth, hop
latency, DCN) can make it pick another algorithm for some collectives, one faster alone but
slower inside the step (more bytes through HBM or on links that compute and other collectives
share). Slow and dead links never switch a step's algorithm (the compiler picks for the healthy
pod: `sim.engine.perchip` keeps `auto`'s healthy choice), nor do overrides the collectives do
not read (`LINK_FIELDS`).

`auto_switch_report` finds the collectives (a pipelined step's: those of its stages' programs)
whose pick on the what-if's chip differs from the pick on the chip without the overrides (the
unperturbed pod), and only then simulates the step once
more with those collectives held at the unperturbed pod's algorithms (`HeldAlgorithms`). When
that step is faster, the result's `auto_switch` section says so: the switches, both algorithms,
and the step time with the baseline's algorithms held fixed. Costs: one `auto` search per
distinct collective on the unperturbed chip (memoised like every collective cost), and one more
step only where a pick differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.collectives.auto import HeldAlgorithms, picked_algorithm
from sim.collectives.routing import link_numbers
from sim.engine.costs import (
    collective_groups,
    cost_collective,
    op_group_axes,
    padded_collective_bytes,
)
from sim.hardware import ChipSpec
from topologies.torus import Topology
from workloads.trace import OpKind, Trace

# The kinds `auto` chooses an algorithm for (collective-permutes are point-to-point sends).
_HELD_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def auto_switches(traces: Trace | Sequence[Trace], chip: ChipSpec, base_chip: ChipSpec,
                  topology: Topology) -> list[dict[str, Any]]:
    """The step's distinct collectives whose `auto` pick on `chip` differs from the pick on
    `base_chip`: {collective, op, axes, bytes, baseline, what_if}, in program order. `traces`
    is the step's program, or every program of a step whose chips run different ones (a
    pipeline's stages, in stage order), or a callable giving them (called only where the
    what-if changes the link numbers the collectives read)."""
    if link_numbers(chip) == link_numbers(base_chip):
        return []  # the collectives read the same link numbers: the same picks
    if callable(traces):
        traces = traces()
    seen: set[tuple] = set()
    out = []
    for trace in [traces] if isinstance(traces, Trace) else traces:
        out += _switches_of(trace, chip, base_chip, topology, seen)
    return out


def _switches_of(trace: Trace, chip: ChipSpec, base_chip: ChipSpec, topology: Topology,
                 seen: set[tuple]) -> list[dict[str, Any]]:
    groups = collective_groups(trace, topology)
    dev_groups: dict[int, tuple] = {}
    out = []
    for op in trace.ops:
        if op.kind != OpKind.COLLECTIVE or op.collective not in _HELD_KINDS:
            continue
        gaxes, key = op_group_axes(topology, trace, op, groups, dev_groups)
        if len(key) == 4 or key in seen:  # explicit chip pairs run `direct`, no choice
            continue
        seen.add(key)
        now = cost_collective(chip, topology, op.collective, gaxes, op.bytes, "auto").algorithm
        base = cost_collective(base_chip, topology, op.collective, gaxes, op.bytes,
                               "auto").algorithm
        if picked_algorithm(now) != picked_algorithm(base):
            out.append({
                "collective": f"{op.collective} {'/'.join(g.name for g in gaxes)} "
                              f"{round(op.bytes)}B",
                "op": op.collective, "axes": gaxes,
                "bytes": padded_collective_bytes(op.collective, gaxes, op.bytes),
                "baseline": picked_algorithm(base), "what_if": picked_algorithm(now),
            })
    return out


def held_algorithms(switches: list[dict[str, Any]]) -> HeldAlgorithms:
    """`auto`, with every switched collective held at its baseline algorithm."""
    return HeldAlgorithms(tuple(
        (HeldAlgorithms.key(s["op"], s["axes"], s["bytes"]), s["baseline"]) for s in switches))


def auto_switch_report(traces, chip: ChipSpec, base_chip: ChipSpec, topology: Topology,
                       step_time_s: float, simulate_held) -> dict[str, Any] | None:
    """The result's `auto_switch` section, or None: where `auto` picked other algorithms on
    `chip` than on `base_chip` (the chip without the what-if's overrides) and the step with the
    baseline's picks held fixed (`simulate_held(HeldAlgorithms)` -> its step time) is faster
    than `step_time_s`. `traces`: the step's program(s), as `auto_switches` takes them."""
    switches = auto_switches(traces, chip, base_chip, topology)
    if not switches:
        return None
    held_s = float(simulate_held(held_algorithms(switches)))
    if not held_s < step_time_s:
        return None
    first = switches[0]
    more = f" (and {len(switches) - 1} more collective(s))" if len(switches) > 1 else ""
    note = (f"auto switched {first['collective']} from {first['baseline']} (its pick on the "
            f"unperturbed pod) to {first['what_if']} (faster alone){more}; with the baseline's "
            f"algorithms held fixed the step takes {held_s:.6g} s instead of {step_time_s:.6g} s")
    return {
        "note": note,
        "held_step_time_s": held_s,
        "switches": [{k: s[k] for k in ("collective", "baseline", "what_if")} for s in switches],
    }
