"""The op-cost kernel shared by every executor (docs/model/training.md):

* compute: `max(flops / (peak * eff), hbm_bytes / (hbm_bw * eff)) + op_overhead_s`, bound by
  whichever term is larger (MXU, VPU or HBM); an MXU op with a narrow operand dimension runs at
  `ChipSpec.mxu_fill(op.narrow_dim)` of the MXU peak (`compute_op_times`);
* collective: simulated once per distinct (kind, replica group, bytes) with
  `simulate_collective` on the real topology (`cost_collective`, memoised in a bounded cache a
  sweep worker can seed), as the busiest link of each link class and the DMA bytes in HBM;
  explicit chip pairs (point-to-point sends) by `cost_pairs`;
* the physical group axes of a collective's logical mesh axes (`collective_groups`,
  `op_group_axes`, `device_group_axes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.collectives.auto import HeldAlgorithms
from sim.collectives.routing import link_model, link_numbers
from sim.collectives.simulate import simulate_collective
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import (
    DCN_IN_CLASS,
    DCN_OUT_CLASS,
    NUM_CLASSES,
    GroupAxis,
    axis_factor,
    factor_device_groups,
    route_pairs,
    route_pairs_links,
)
from topologies.mesh import place_mesh
from topologies.torus import AXIS_NAMES, Topology
from workloads.trace import Trace


@dataclass(kw_only=True)
class CollectiveCost:
    time_s: float
    latency_s: float
    class_bytes: np.ndarray  # bytes on the busiest link of each class
    group_size: int
    algorithm: str
    hbm_bytes: float = 0.0  # DMA reads and writes of one chip
    # Cap on the fraction of its bytes drained per second: a group whose route crosses a slow
    # or dead link is paced by that link for its whole drain (it keeps its links and HBM the
    # while, at the lower rate), rather than waiting and then draining at the healthy rate.
    max_speed: float = float("inf")


def collective_groups(trace: Trace, topology: Topology) -> dict[str, tuple[GroupAxis, ...]]:
    """Physical group axes (factors) of every logical mesh axis."""
    placements = place_mesh(trace.mesh, topology)
    out = {}
    for name, pl in placements.items():
        out[name] = tuple(axis_factor(topology, a, size, stride) for a, size, stride in pl.factors)
    return out


def ops_name(trace: Trace, i: int) -> str:
    return trace.ops[i].name


def merge_axis_factors(topology: Topology, factors: list[GroupAxis]) -> tuple[GroupAxis, ...]:
    """Merge contiguous factors of one physical axis (tensor x[4@1] + fsdp x[4@4] = x)."""
    by_axis: dict[str, list[GroupAxis]] = {}
    for f in factors:
        by_axis.setdefault(f.physical_name, []).append(f)
    merged = []
    for axis, fs in by_axis.items():
        fs = sorted(fs, key=lambda g: g.stride)
        cur = fs[0]
        for g in fs[1:]:
            if g.stride == cur.stride * cur.size:
                cur = axis_factor(topology, axis, cur.size * g.size, cur.stride)
            else:
                merged.append(cur)
                cur = g
        merged.append(cur)
    order = {"x": 0, "y": 1, "z": 2, "dcn": 3}
    return tuple(sorted(merged, key=lambda g: (order[g.physical_name], g.stride)))


def padded_collective_bytes(kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float) -> int:
    """V as simulated: XLA pads an array to a multiple of the group (permutes move as is)."""
    if kind == "collective-permute":
        return int(np.ceil(nbytes))
    group = int(np.prod([g.size for g in gaxes]))
    return int(np.ceil(max(nbytes, 1.0) / group)) * group


# Costs of healthy collectives by (the chip's link numbers, torus, kind, group axes, bytes,
# algorithm): a pure function of those (`routing.LINK_FIELDS`: the chip fields a collective
# reads), and the most expensive part of costing a step on a large pod, shared by the
# steps a worker process simulates one after another (a study's points that vary only what the
# collectives do not see, `plan`'s candidates that share groups). Bounded; cleared when full.
COST_CACHE_SIZE = 4096
_COST_CACHE: dict[tuple, CollectiveCost] = {}


def cost_cache_key(chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...],
                   nbytes: float, algorithm: str) -> tuple:
    return (link_numbers(chip), topology.shape, topology.wraparound, topology.num_slices,
            topology.twisted, kind, gaxes, float(nbytes), algorithm)


def cached_costs(keys) -> dict[tuple, CollectiveCost]:
    """The costs of `keys` this process has cached (to ship to other workers of a study)."""
    return {k: _COST_CACHE[k] for k in keys if k in _COST_CACHE}


def seed_cost_cache(entries: dict[tuple, CollectiveCost]) -> None:
    """Add costs computed elsewhere (another worker of the same study) to this process's cache."""
    if len(_COST_CACHE) + len(entries) > COST_CACHE_SIZE:
        _COST_CACHE.clear()
    _COST_CACHE.update(entries)


def cost_collective(
    chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float,
    algorithm: str = "auto",
) -> CollectiveCost:
    """A healthy collective's cost on `topology` (memoised per process; see `_COST_CACHE`)."""
    key = cost_cache_key(chip, topology, kind, gaxes, nbytes, algorithm)
    hit = _COST_CACHE.get(key)
    if hit is None:
        hit = _cost_collective(chip, topology, kind, gaxes, nbytes, algorithm)
        if len(_COST_CACHE) >= COST_CACHE_SIZE:
            _COST_CACHE.clear()
        _COST_CACHE[key] = hit
    return hit


def _cost_collective(
    chip: ChipSpec, topology: Topology, kind: str, gaxes: tuple[GroupAxis, ...], nbytes: float,
    algorithm: str,
) -> CollectiveCost:
    group = int(np.prod([g.size for g in gaxes]))
    v = padded_collective_bytes(kind, gaxes, nbytes)
    # A string algorithm names a gather or reduction algorithm; all-to-alls keep `auto` then.
    # Held algorithms (a what-if re-run on the unperturbed pod's picks) hold every kind.
    algo = (algorithm if kind in ("all-gather", "reduce-scatter", "all-reduce")
            or isinstance(algorithm, HeldAlgorithms) else "auto")
    if kind == "collective-permute":
        # Pipeline stage-to-stage sends: shift by one along the (single) group axis.
        if len(gaxes) != 1:
            gaxes = gaxes[:1]
    res = simulate_collective(
        chip=chip, topology=topology, op=kind, axes=gaxes, nbytes=v, algorithm=algo
    )
    lb = res.link_bytes
    cls = np.zeros(NUM_CLASSES)
    ndim = topology.ndim
    n_ici = topology.num_ici_links
    ici = lb[:n_ici].reshape(-1, 2 * ndim)
    cls[: 2 * ndim] = ici.max(axis=0)
    if topology.num_slices > 1:
        nc = topology.num_chips
        cls[DCN_OUT_CLASS] = lb[n_ici : n_ici + nc].max(initial=0.0)
        cls[DCN_IN_CLASS] = lb[n_ici + nc :].max(initial=0.0)
    lm = link_model(chip, topology, {})
    drain = float(np.max(cls / lm.class_capacity_bytes_per_s, initial=0.0))
    return CollectiveCost(
        time_s=res.time_s, latency_s=max(res.time_s - drain, 0.0), class_bytes=cls,
        group_size=group, algorithm=res.algorithm, hbm_bytes=res.hbm_bytes_per_chip,
    )


def device_group_axes(trace: Trace, topology: Topology, op, cache: dict[int, tuple]):
    """(group axes, cost key) of a collective over explicit device groups (HLO import)."""
    if op.group not in cache:
        spec = trace.meta.device_groups[op.group]
        members = spec.get("groups", spec.get("pairs", []))
        bad = [c for g in members for c in g if not 0 <= int(c) < topology.num_chips]
        if bad:
            raise TpusimError(
                f"collective {op.name} names chip {bad[0]}, but the {topology.name} pod has "
                f"chips 0..{topology.num_chips - 1}; replay it on the pod it was compiled for"
            )
        if "pairs" in spec:
            pairs = [(int(a), int(b)) for a, b in spec["pairs"]]
            cls, _hops = route_pairs(topology, pairs)
            axes = tuple(axis_factor(topology, AXIS_NAMES[k // 2], topology.shape[k // 2], 1)
                         for k in range(0, 2 * topology.ndim, 2) if cls[k] or cls[k + 1])
            cache[op.group] = (axes, pairs)
        else:
            gaxes, _exact = factor_device_groups(topology, [list(map(int, g))
                                                            for g in spec["groups"]])
            cache[op.group] = (gaxes, None)
    gaxes, pairs = cache[op.group]
    if pairs is not None:
        return gaxes, ("collective-permute", gaxes, round(op.bytes), op.group)
    return gaxes, (op.collective, gaxes, round(op.bytes))


def cost_pairs(chip: ChipSpec, topology: Topology, pairs: list[tuple[int, int]],
               nbytes: float, slow: dict[int, float] | None = None) -> CollectiveCost:
    """A collective-permute between explicit chips: every message on its dimension-order
    route at once; the busiest link carries its messages back to back and the longest route
    pays the per-hop latency (exact for the contention-free rings XLA's windowed einsums
    use). A slow link (`slow`: link id -> bandwidth factor) carries its messages at its own
    speed; it is charged to its link class as the equivalent bytes at full speed, so the whole
    permute (a lock-step ring step) waits for it."""
    cls_msgs, hops, per_link = route_pairs_links(topology, pairs)
    lm = link_model(chip, topology, {})
    cls = cls_msgs * float(nbytes)
    for link, f in (slow or {}).items():
        if link in per_link:
            k = link % (2 * topology.ndim)
            cls[k] = max(cls[k], per_link[link] * float(nbytes) / f)
    lat = hops * lm.ici_latency_s + (lm.dcn_latency_s if cls[DCN_OUT_CLASS] > 0 else 0.0)
    drain = float(np.max(cls / lm.class_capacity_bytes_per_s, initial=0.0))
    return CollectiveCost(time_s=lat + drain, latency_s=lat, class_bytes=cls, group_size=2,
                          algorithm="direct", hbm_bytes=2.0 * float(nbytes))


def op_collective_cost(
    chip: ChipSpec, topology: Topology, trace: Trace, op, groups, dev_groups: dict, costs: dict,
    algorithm: str,
) -> tuple[tuple[GroupAxis, ...], tuple]:
    """A collective op's group axes and cost key, costing it into `costs` on first sight.

    Ops with explicit device groups (HLO import) are keyed by their group (a 4-tuple key means
    chip pairs, costed link by link); the others by (kind, merged mesh-axis factors, bytes).
    """
    gaxes, key = op_group_axes(topology, trace, op, groups, dev_groups)
    if key not in costs:
        costs[key] = (
            cost_pairs(chip, topology, dev_groups[op.group][1], op.bytes) if len(key) == 4
            else cost_collective(chip, topology, op.collective, gaxes, op.bytes, algorithm))
    return gaxes, key


def op_group_axes(topology: Topology, trace: Trace, op, groups,
                  dev_groups: dict) -> tuple[tuple[GroupAxis, ...], tuple]:
    """A collective op's group axes and cost key (`op_collective_cost` without the cost)."""
    if op.group >= 0:
        return device_group_axes(trace, topology, op, dev_groups)
    factors: list[GroupAxis] = []
    for a in op.mesh_axes:
        factors += list(groups[a])
    gaxes = merge_axis_factors(topology, factors)
    return gaxes, (op.collective, gaxes, round(op.bytes))


def compute_op_times(chip: ChipSpec, op) -> tuple[float, float]:
    """A compute op's (FLOP time, HBM time) alone on its chip: its FLOPs at its unit's rate
    (int8 or bf16 MXU times the fill of a narrow dimension, or the VPU) and its bytes at the HBM
    rate. `replay` costs the op `max` of the two plus the per-op overhead before the run, and
    that is its time in the replay (its HBM stream does not share with collective DMA)."""
    return op.flops / chip.unit_rate(op), op.hbm_bytes / chip.eff_hbm_bytes_per_s


# A run that reports its progress asks whether an update is due every this many SimPy events
# (a few microseconds of engine work each): the check costs under 0.1% of the run.
