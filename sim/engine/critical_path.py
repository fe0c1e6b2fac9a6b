"""The critical path of a per-chip step, one routine for both executors (`sim.engine.class_engine`
walks chip classes, `sim.engine.vector_engine` chips of vector classes).

Model (docs/model.md, "Per-chip engine"): walk back from the last op to end on the chip (or
class) that finishes last. Each op's start was set by its latest dependency, or by the op before
it on the core (compute and idle ops run on the core in program order); a collective's start was
set by the member of its replica group that arrived last and its end by the member that drained
last (ties: stay on the chip the walk is on, else the lowest-numbered member); a receive ends when
its message has arrived, so the path continues on the sender at its send. Consecutive ops on one
chip (class) form one segment: the chip, how many chips its class holds, the first and last op,
their number, start and end, and the links its collectives used.

An executor describes its state through a `PathView`; the walk and the segments are here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sim.engine.perchip import add_path_links
from topologies.torus import Topology
from workloads.trace import OpKind


class PathView(Protocol):
    """One executor's finished step as the critical-path walk reads it. A *node* `c` is what
    the executor simulates as one: a chip class (class executor) or a chip (vector executor)."""

    def ops(self, c: int) -> Sequence:
        """The ops of node `c`'s program (indexed by op id)."""

    def times(self, c: int) -> tuple[Sequence[float], Sequence[float]]:
        """Every op's start and end time on node `c`."""

    def core_prev(self, c: int) -> dict[int, int]:
        """{core op: the core op before it} on node `c` (`perchip.core_predecessors`)."""

    def rendezvous(self, c: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """For collective `k` of node `c` met by more than one node: (the nodes of its group,
        each one's arrival time, each one's own drain time); None when `c` meets no one."""

    def sender(self, c: int, k: int) -> tuple[int, int] | None:
        """For a receive op `k` of node `c`: (the sending node, its send op); else None."""

    def chip(self, c: int) -> int:
        """The chip reported for node `c` (a class's representative, or the chip itself)."""

    def class_size(self, c: int) -> int:
        """How many chips the class of node `c` holds."""

    def path_cost(self, c: int, k: int) -> tuple[object, object] | None:
        """For collective `k` of node `c`: (the cost of its group, the healthy group's cost),
        whose links a segment lists; None for every other op."""


def _pick(members: np.ndarray, vals: np.ndarray, c: int) -> int:
    """The member with the latest time: `c` if it is among the latest, else the lowest."""
    cands = members[vals == vals.max()]
    return c if c in cands else int(cands.min())


def critical_path(view: PathView, last: int, topology: Topology, slow, dead=()) -> list[dict]:
    """The critical path (see the module docstring) that ends at the last op to end on node
    `last`, as segments: [{"chip", "chips_in_class", "first_op", "last_op", "num_ops", "start_s",
    "end_s", "links"}] in time order."""
    c = last
    k = int(np.argmax(view.times(c)[1]))
    limit = 10 * len(view.ops(c)) + 10
    steps: list[tuple[int, int]] = []
    seen = 0
    while k >= 0 and seen < limit:
        seen += 1
        op = view.ops(c)[k]
        meet = view.rendezvous(c, k) if op.kind == OpKind.COLLECTIVE else None
        send = view.sender(c, k) if meet is None else None
        if meet is not None:
            members, arrived, drained = meet
            steps.append((_pick(members, drained, c), k))  # the end: the last to drain
            c = _pick(members, arrived, c)  # the start: the last to arrive
        elif send is not None:
            # A receive ends when its message has arrived: the path continues on the sender.
            steps.append((c, k))
            c, k = send
            steps.append((c, k))
        else:
            steps.append((c, k))
        ops = view.ops(c)
        op = ops[k]
        cands = list(op.deps)
        prev = view.core_prev(c)
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE) and k in prev:
            cands.append(prev[k])
        if not cands:
            break
        start, end = view.times(c)
        k = max(cands, key=lambda d: (end[d], d))
        if end[k] <= 0 and start[k] <= 0 and not ops[k].deps:
            steps.append((c, k))
            break
    steps.reverse()
    return _segments(view, steps, topology, slow, dead)


def _segments(view: PathView, steps: list[tuple[int, int]], topology: Topology, slow,
              dead) -> list[dict]:
    """Consecutive steps on one node as one segment each."""
    segments: list[dict] = []
    node = None
    for c, k in steps:
        op = view.ops(c)[k]
        start, end = view.times(c)
        if node != c:
            node = c
            segments.append({
                "chip": topology.coords_text(view.chip(c)),
                "chips_in_class": int(view.class_size(c)), "first_op": op.name,
                "last_op": op.name, "num_ops": 0, "start_s": float(start[k]),
                "end_s": float(end[k]), "links": [],
            })
        seg = segments[-1]
        seg["last_op"] = op.name
        seg["num_ops"] += 1
        seg["end_s"] = float(end[k])
        cost = view.path_cost(c, k)
        if cost is not None:
            add_path_links(seg["links"], cost[0], cost[1], topology, dead, slow)
    return segments


__all__ = ["PathView", "critical_path"]
