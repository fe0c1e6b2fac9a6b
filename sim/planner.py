"""`plan`: search the ways to run one training step on a pod and rank them by simulated step time.

The search space is every factorization of the slice into the logical axes (`data`, `fsdp`,
`pipeline`, `expert`, `sequence`, `tensor`, within the size caps of `PlanConfig`), every distinct
placement of those axes on the torus (jax's default order, and each axis moved innermost, as far
as `place_mesh` lays them out differently), every allowed remat policy and dtype, and every
allowed microbatch count whose memory estimate (a lower bound of the peak) fits. Candidates the
compiler rejects or the torus cannot hold are dropped; those whose compiler memory estimate
(params, grads, optimizer state and saved activations, a lower bound of the simulated HBM peak)
exceeds HBM are pruned without simulation; every other candidate is simulated as `tpusim train`
would, on the sweep's workers, so the winner is the best of the whole space, not a heuristic's
guess.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.hardware import ChipSpec
from sim.runs.bind import algorithm_of, moe_config, resolve_model, resolve_pod, scenario_of
from sim.runs.requests import EXHAUSTIVE_MAX_SIMULATIONS, PlanRequest, TrainRequest
from sim.runs.train import _pipeline_base, compile_inputs, compile_step
from sim.studies.backends import JobPool, check_dask, check_workers, num_workers
from sim.studies.plots import UNFIT_LABEL, UNFIT_STYLE
from sim.studies.points import run_point
from sim.studies.results import STATUS_DOES_NOT_FIT, STATUS_ERROR, STATUS_OK
from topologies.errors import TpusimError
from topologies.progress import NO_TASK, ProgressCallback, reporting, task
from topologies.validate import (
    MAX_BATCH,
    MAX_CHIPS,
    MAX_PLAN_COMBINATIONS,
    MAX_TOKENS,
    api_call,
    one_of,
    short_repr,
    split_list,
)
from workloads.models import TransformerSpec

PLAN_AXES = ("data", "fsdp", "pipeline", "expert", "sequence", "tensor")
PLAN_COLUMNS = (
    "rank", "mesh", "placement", "remat", "microbatches", "param_dtype", "grad_dtype",
    "optimizer_dtype", "optimizer", "gather_dtype", "step_time_s", "mfu",
    "tokens_per_s_per_chip", "energy_j", "energy_per_token_j", "cost_per_million_tokens_usd",
    "hbm_peak_bytes",
    "hbm_estimate_bytes", "lower_bound_s", "bound", "fits_in_hbm", "status", "error",
)
# A candidate's `status`, as `tpusim sweep` names them (`sim.studies.results.STATUSES`), plus
# the ones the search never simulated because a cheaper candidate's bound ruled them out.
PLAN_STATUS_SKIPPED = "skipped: lower bound above the top K"
# How many candidates `plan --exhaustive` simulates before it asks for --max-simulations: each
# is a whole `tpusim train` run (seconds of CPU on a full pod: 453 of them for the 405B plan
# are most of an hour on 2 cores), where the default search simulates ~20.
_BOUNDS = {  # breakdown component -> what bounds a step whose critical path it dominates
    "mxu_compute_s": "compute (MXU)",
    "vpu_s": "vector units (VPU)",
    "hbm_bound_s": "HBM bandwidth",
    "exposed_comm_s": "communication",
    "pipeline_bubble_s": "pipeline bubble",
}


# What `plan --objective` ranks by: the step time, the dollars per step (chip-hours: the same
# order as the time on one pod, listed for the column it reads) or the joules per step (the
# whole pod's, host and data centre included; `sim/energy.py`).
OBJECTIVES = ("time", "cost", "energy")


def objective_value(result: dict[str, Any], objective: str) -> float:
    """A simulated candidate's value under `objective` (lower is better)."""
    if objective == "energy":
        return float(result["energy"]["step_j"])
    if objective == "cost":
        v = result["cost"]["usd_per_step"]
        return math.nan if v is None else float(v)
    return float(result["step_time_s"])


def objective_per_second(chip, num_chips: int, objective: str) -> float:
    """The least the objective grows per second of step (what turns a step-time lower bound
    into a bound on it): 1 for time; the pod's price per second for cost; the pod's static
    power, host and data centre included, for energy (dynamic energy only adds). 0: no bound."""
    if objective == "cost":
        return (chip.usd_per_chip_hour or 0.0) * num_chips / 3600.0
    if objective == "energy":
        return chip.idle_power_w * num_chips * (1 + chip.host_power_share) * chip.pue
    return 1.0


def objective_floor(result: dict[str, Any], chip, num_chips: int, objective: str) -> float:
    """The part of the objective no candidate can avoid, beyond its growth per second: for
    energy, the model's FLOPs on the MXU at its cheapest energy per operation (remat and the
    rest only add), host and data centre included; 0 otherwise."""
    if objective != "energy":
        return 0.0
    from sim.energy import clock_energy_factor

    j = min(chip.mxu_j_per_flop, chip.mxu_int8_j_per_op) * clock_energy_factor(chip)
    return (num_chips * float(result.get("model_flops_per_chip", 0.0)) * j
            * (1 + chip.host_power_share) * chip.pue)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """What `plan` may consider (the flags of `tpusim plan`)."""

    seq_len: int
    global_batch: int
    top: int = 5
    axes: tuple[str, ...] = PLAN_AXES
    remat: tuple[str, ...] = ("full", "minimal", "none")
    microbatches: tuple[int, ...] = (1, 2, 4)  # with pipeline=P: P times each
    param_dtypes: tuple[str, ...] = ("bf16",)
    grad_dtypes: tuple[str, ...] = ("bf16",)
    optimizer_dtypes: tuple[str, ...] = ("fp32",)
    optimizer: str = "adam"  # the update rule of every candidate (not searched)
    # The dtype every candidate's weights are gathered and multiplied in (not searched); None:
    # each candidate's param dtype (no cast).
    gather_dtype: str | None = None
    max_tensor: int = 8
    max_data: int = 4
    max_sequence: int = 2
    max_pipeline: int = 4
    max_expert: int = 64
    placements: bool = True  # also try other axis orders on the torus
    objective: str = "time"  # what the winner is picked by (OBJECTIVES)

    def __post_init__(self) -> None:
        for flag, v in (("--seq-len", self.seq_len), ("--global-batch", self.global_batch),
                        ("--top", self.top), ("--max-tensor", self.max_tensor),
                        ("--max-data", self.max_data), ("--max-sequence", self.max_sequence),
                        ("--max-pipeline", self.max_pipeline),
                        ("--max-expert", self.max_expert)):
            if not isinstance(v, int) or v < 1:
                raise TpusimError(f"{flag} {v!r} must be a positive integer")
        if self.objective not in OBJECTIVES:
            raise TpusimError(f"--objective {short_repr(self.objective)} is not one of "
                              f"{', '.join(OBJECTIVES)}; give e.g. --objective energy")
        bad = [a for a in self.axes if a not in PLAN_AXES]
        if bad:
            raise TpusimError(
                f"--axes: {short_repr(bad[0])} is not a mesh axis; {one_of(bad[0], PLAN_AXES)}"
            )
        if "fsdp" not in self.axes and "data" not in self.axes:
            raise TpusimError("--axes must include fsdp or data (the batch has to be split)")
        from workloads.training import (
            check_stateless_optimizer,
            dtype_bytes,
            parse_optimizer,
            parse_remat,
        )

        parse_optimizer(self.optimizer)
        if self.gather_dtype is not None:
            dtype_bytes(self.gather_dtype, "--gather-dtype")

        if not self.remat:
            raise TpusimError("--remat lists no policy; give e.g. full,minimal")
        for r in self.remat:
            if parse_remat(r) == "custom":
                raise TpusimError("--remat custom names its tensors with --remat-save and "
                                  "--remat-offload, which plan does not take; list named "
                                  "policies (e.g. save_dot_except_mlpwi) or run train")
        if not self.microbatches or any(not isinstance(m, int) or m < 1
                                        for m in self.microbatches):
            raise TpusimError(
                f"--microbatches {self.microbatches!r} must list positive integers, e.g. 1,2,4"
            )
        for flag, vals in (("--param-dtype", self.param_dtypes),
                           ("--grad-dtype", self.grad_dtypes),
                           ("--optimizer-dtype", self.optimizer_dtypes)):
            if not vals:
                raise TpusimError(f"{flag} lists no dtype; give e.g. bf16")
            for v in vals:
                dtype_bytes(v, flag)
        check_stateless_optimizer(self.optimizer, self.optimizer_dtypes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One way to run the step: an ordered ICI mesh (its order is its placement) and settings."""

    mesh: tuple[tuple[str, int], ...]
    remat: str
    microbatches: int
    param_dtype: str
    grad_dtype: str
    optimizer_dtype: str
    optimizer: str = "adam"
    gather_dtype: str | None = None
    placement: str = ""
    hbm_estimate_bytes: float = 0.0
    # The slice this candidate runs on, when plan searches slices (`PodVariant`): its shape
    # and wiring; None / False: the plan's own pod.
    shape: str | None = None
    twist: bool = False

    @property
    def pod_text(self) -> str:
        """`4x4x8` or `4x4x8 twisted` (empty: the plan's own pod)."""
        if self.shape is None:
            return ""
        return self.shape + (" twisted" if self.twist else "")

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{n}={v}" for n, v in self.mesh)

    def train_settings(self) -> dict[str, Any]:
        """The candidate's training settings, as a `TrainRequest` takes them."""
        return {"mesh": self.mesh_text, "remat": self.remat, "microbatches": self.microbatches,
                "param_dtype": self.param_dtype, "grad_dtype": self.grad_dtype,
                "optimizer_dtype": self.optimizer_dtype, "optimizer": self.optimizer,
                "gather_dtype": self.gather_dtype}


@dataclass(kw_only=True)
class PlanResult:
    """Every candidate considered, the simulated ones ranked, and the winner explained."""

    table: Any  # pandas DataFrame, PLAN_COLUMNS, ranked rows first
    explanation: str
    counts: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    model: str = ""
    pod: str = ""
    hbm_capacity_bytes: float = math.nan  # the chip's usable HBM, as the simulations saw it
    objective: str = "time"  # what ranked them (OBJECTIVES)

    @property
    def best(self) -> dict[str, Any] | None:
        ok = self.table[self.table["status"] == "ok"]
        return ok.iloc[0].to_dict() if len(ok) else None

    def top(self, k: int):
        return self.table[self.table["status"] == "ok"].head(k)


@dataclass(frozen=True, slots=True, kw_only=True)
class PodVariant:
    """One slice `plan` searches: a shape of the pod's chip count and its wiring. `shape` None:
    the request's own pod as given (no pod dimension searched)."""

    topology: Any
    shape: str | None = None
    twist: bool = False

    def request_changes(self) -> dict[str, Any]:
        """What a candidate's `TrainRequest` changes of the plan's pod to run on this slice."""
        if self.shape is None:
            return {}
        return {"slice": None, "shape": self.shape, "twist": self.twist}


# Wirings `plan --wiring` searches: auto = plain, and twisted where the shape can twist.
WIRINGS = ("auto", "plain", "twisted")


def slice_shapes(chip, num_chips: int) -> list[tuple[int, ...]]:
    """Every slice shape of `num_chips` chips the chip's pod can build, sides ascending (x <=
    y <= z: which mesh axis sits on which side is the placements' part of the search): on a
    generation with optical switches (`cube`), the shapes of whole 4x4x4 cubes whose cube count
    fits the pod (any arrangement of cubes is a slice), or, below one cube, the shapes that fit
    inside one; otherwise the shapes that fit the pod's box (`check_shape_fits`)."""
    from topologies.slices import CUBE_SIDE, check_shape_fits

    ndim = len(chip.max_pod_shape)
    cube = chip.generation_rule == "cube" and ndim == 3
    unit = CUBE_SIDE if cube and num_chips % CUBE_SIDE**3 == 0 else 1
    count = num_chips // unit**ndim
    out = []
    for sides in _ascending_factorizations(count, ndim):
        shape = tuple(unit * s for s in sides)
        if cube and unit == 1 and max(shape) > CUBE_SIDE:
            continue  # a sub-cube slice lives inside one cube
        try:
            check_shape_fits(chip.name, chip.max_pod_shape, shape, chip.generation_rule)
        except TpusimError:
            continue
        out.append(shape)
    return out


def _ascending_factorizations(n: int, k: int, lo: int = 1) -> list[tuple[int, ...]]:
    """Tuples of k factors >= lo, ascending, whose product is n."""
    if k == 1:
        return [(n,)] if n >= lo else []
    out = []
    for d in range(lo, n + 1):
        if d ** k > n:
            break
        if n % d == 0:
            out += [(d, *rest) for rest in _ascending_factorizations(n // d, k - 1, d)]
    return out


def pod_variants(req: PlanRequest, pod) -> list[PodVariant]:
    """The slices a plan request searches: the pod's own shape, or with `shapes` every shape
    of its chip count (`all`) or the listed ones; each plain and, where the shape can twist,
    twisted (`wiring` auto; `plain` or `twisted` alone; the pod's `--twist` is `twisted`).
    A single plain or twisted pod as given is the plan's own (no pod column)."""
    from topologies.slices import can_twist, resolve_topology
    from topologies.torus import parse_shape

    chip, topo = pod.chip, pod.topology
    wiring = req.wiring
    if wiring not in WIRINGS:
        raise TpusimError(f"--wiring {short_repr(wiring)} is not one of {', '.join(WIRINGS)}; "
                          f"give e.g. --wiring auto")
    if req.twist:
        if wiring == "plain":
            raise TpusimError("--twist asks for the twisted wiring and --wiring plain for the "
                              "plain one; drop one of them")
        wiring = "twisted"
    if req.shapes is None:
        shapes, searched = [topo.shape], False
    elif str(req.shapes).strip().lower() == "all":
        shapes, searched = slice_shapes(chip, topo.num_chips), True
        if not shapes:
            raise TpusimError(
                f"--shapes all: a {chip.name} pod builds no slice of {topo.num_chips:,} chips "
                f"(whole 4x4x4 cubes, or a shape inside one cube); give a chip count it can "
                f"build, e.g. 64 or 128, or drop --shapes")
    else:
        shapes = [parse_shape(x) for x in split_list(req.shapes, "--shapes",
                                                     example="4x4x16,4x8x8")]
        shapes, searched = list(dict.fromkeys(shapes)), True
        for sh in shapes:
            if math.prod(sh) != topo.num_chips:
                raise TpusimError(
                    f"--shapes: {'x'.join(map(str, sh))} has {math.prod(sh):,} chips, not the "
                    f"pod's {topo.num_chips:,}; list shapes of {topo.num_chips:,} chips (or "
                    f"--shapes all)")
    kw = dict(chip_name=chip.name, wrap_rule=chip.generation_rule,
              max_pod_shape=chip.max_pod_shape)
    out: list[PodVariant] = []
    for sh in shapes:
        text = "x".join(map(str, sh))
        twistable = can_twist(chip.generation_rule, sh)
        wirings = {"auto": (False, True) if twistable else (False,), "plain": (False,),
                   "twisted": (True,)}[wiring]
        if wiring == "twisted" and not twistable:
            if not searched or len(shapes) == 1:
                resolve_topology(**kw, shape=text, twist=True)  # the one-line refusal
            continue
        for tw in wirings:
            t = (topo if sh == topo.shape and tw == topo.twisted and req.wraparound == "auto"
                 else resolve_topology(**kw, shape=text, wraparound=req.wraparound, twist=tw))
            out.append(PodVariant(topology=t, shape=text, twist=tw))
    if not out:
        raise TpusimError(
            f"--wiring twisted: no shape of {topo.num_chips:,} chips can twist (k x k x 2k or "
            f"k x 2k x 2k, each side a multiple of 4); drop --wiring/--twist or give a chip "
            f"count such as 128 (4x4x8)")
    if not searched and len(out) == 1:
        return [PodVariant(topology=out[0].topology)]  # the pod as given: no pod column
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _size_options(model, num_chips: int, cfg: PlanConfig) -> dict[str, list[int]]:
    """The sizes each axis may take, before the combinations are checked by the compiler."""
    divs = _divisors(num_chips)
    allowed = set(cfg.axes)

    def opts(axis: str, cap: int, ok: Callable[[int], bool] = lambda v: True) -> list[int]:
        if axis not in allowed:
            return [1]
        return [v for v in divs if v <= cap and ok(v)]

    kv = model.num_kv_heads
    return {
        "tensor": opts("tensor", cfg.max_tensor,
                       lambda t: model.num_heads % t == 0 and model.d_ff % t == 0
                       and (kv % t == 0 or t % kv == 0)),
        "pipeline": opts("pipeline", cfg.max_pipeline, lambda p: model.num_layers % p == 0),
        "sequence": opts("sequence", cfg.max_sequence, lambda s: cfg.seq_len % s == 0),
        "expert": opts("expert", cfg.max_expert,
                       lambda e: e == 1 or (model.is_moe and model.num_experts % e == 0)),
        "data": opts("data", cfg.max_data),
    }


def enumerate_candidates(model, topology, chip, cfg: PlanConfig,
                         variant: PodVariant | None = None) -> tuple[list[Candidate],
                                                                     dict[str, int]]:
    """Every valid candidate of the search space whose memory estimate fits in HBM, in a
    deterministic order; and how many were generated, invalid and pruned by memory.
    `variant`: the searched slice the candidates run on (tagged with its shape and wiring)."""
    from topologies.mesh import LogicalMesh
    from workloads.training import TrainingConfig, estimate_training_memory, parse_remat

    n = topology.num_chips
    if topology.num_slices != 1:
        raise TpusimError("plan searches one slice; drop --slices (multi-slice is not searched)")
    opts = _size_options(model, n, cfg)
    combos = math.prod(len(v) for v in opts.values()) * len(cfg.remat) * len(cfg.param_dtypes) \
        * len(cfg.grad_dtypes) * len(cfg.optimizer_dtypes)
    if combos > MAX_PLAN_COMBINATIONS:
        raise TpusimError(
            f"plan would consider {combos:,} combinations of axis sizes and settings, over the "
            f"limit of {MAX_PLAN_COMBINATIONS:,}; lower --max-data/--max-tensor/--max-pipeline/"
            f"--max-expert or allow fewer --remat and dtype values"
        )
    counts = {"generated": 0, "invalid": 0, "pruned_by_memory": 0}
    out: list[Candidate] = []
    capacity = chip.hbm_bytes
    for t, p, s, e, d in itertools.product(opts["tensor"], opts["pipeline"], opts["sequence"],
                                           opts["expert"], opts["data"]):
        rest = n // (t * p * s * e * d) if n % (t * p * s * e * d) == 0 else 0
        if rest == 0 or (rest > 1 and "fsdp" not in cfg.axes):
            continue
        sizes = {"data": d, "fsdp": rest, "pipeline": p, "expert": e, "sequence": s,
                 "tensor": t}
        if cfg.global_batch % (d * rest * e):
            continue  # the batch cannot be split over data x fsdp x expert
        local = cfg.global_batch // (d * rest * e)
        base = tuple((a, sizes[a]) for a in PLAN_AXES if sizes[a] > 1) or (("fsdp", 1),)
        placements = _placements(base, topology, cfg.placements)
        mbs = sorted({m * p for m in cfg.microbatches if local % (m * p) == 0})
        for remat, pd_, gd, od in itertools.product(cfg.remat, cfg.param_dtypes,
                                                    cfg.grad_dtypes, cfg.optimizer_dtypes):
            counts["generated"] += 1
            if not placements or not mbs:
                counts["invalid"] += 1
                continue
            # Microbatches trade time for memory (each one gathers the weights again and runs
            # smaller matmuls). The estimate is a lower bound on the simulated peak, so the
            # fewest microbatches whose estimate fits may still run out of memory when
            # simulated: every allowed count whose estimate fits is a candidate (bound order
            # simulates the extra ones only when the fewer ones do not make the top K).
            fitting: list[tuple[int, float]] = []
            estimated = False
            for mb in mbs:
                tc = TrainingConfig(seq_len=cfg.seq_len, batch_per_chip=cfg.global_batch / n,
                                    remat=parse_remat(remat), microbatches=mb,
                                    param_dtype=pd_, grad_dtype=gd, optimizer_dtype=od,
                                    optimizer=cfg.optimizer, gather_dtype=cfg.gather_dtype)
                try:
                    est = estimate_training_memory(model, LogicalMesh(axes=base), n, tc)
                except TpusimError:
                    continue
                estimated = True
                total = est["static_bytes"] + est["activations_bytes"]
                if total <= capacity:
                    fitting.append((mb, total))
            if not estimated:
                counts["invalid"] += 1
                continue
            if not fitting:
                counts["pruned_by_memory"] += 1
                continue
            for mb, total in fitting:
                for order, where in placements:
                    out.append(Candidate(mesh=order, remat=remat, microbatches=mb,
                                         param_dtype=pd_, grad_dtype=gd, optimizer_dtype=od,
                                         optimizer=cfg.optimizer,
                                         gather_dtype=cfg.gather_dtype,
                                         placement=where, hbm_estimate_bytes=total,
                                         shape=variant.shape if variant else None,
                                         twist=variant.twist if variant else False))
    return out, counts


def _placements(base: tuple[tuple[str, int], ...], topology,
                search: bool) -> list[tuple[tuple[tuple[str, int], ...], str]]:
    """Axis orders of `base` that the torus lays out differently, with a description of each
    (`tensor=x:4 fsdp=x:4+y+z`); the default order (jax's) first."""
    from topologies.mesh import LogicalMesh, place_mesh

    # The default order, then each other axis moved innermost (onto x first): which logical
    # axis gets the short, wrapped neighbourhoods is what placement changes for collectives.
    orders = [base]
    if search:
        orders += [tuple(a for a in base if a != ax) + (ax,) for ax in base[:-1]]
    seen: dict[tuple, tuple] = {}
    for order in orders:
        try:
            placed = place_mesh(LogicalMesh(axes=tuple(order)), topology)
        except TpusimError:
            continue
        key = tuple(sorted((n, pl.factors) for n, pl in placed.items()))
        if key not in seen:
            seen[key] = (tuple(order), _describe(placed, topology))
    return list(seen.values())


def _describe(placed, topology) -> str:
    shape = dict(zip("xyz", topology.shape, strict=False))
    parts = []
    for name, pl in sorted(placed.items(), key=lambda kv: PLAN_AXES.index(kv[0])):
        fs = [a if k == shape.get(a) else f"{a}:{k}" for a, k, _stride in pl.factors]
        if fs:
            parts.append(f"{name}={'+'.join(fs)}")
    return " ".join(parts) or "(one chip)"


def _bound(row: dict[str, Any]) -> str:
    comps = {k: row.get(k) for k in _BOUNDS if isinstance(row.get(k), (int, float))}
    if not comps:
        return ""
    k = max(comps, key=lambda c: (comps[c], -list(_BOUNDS).index(c)))
    share = comps[k] / row["step_time_s"] if row.get("step_time_s") else 0.0
    return f"{_BOUNDS[k]} {share:.0%}"


def collective_floor_s(chip, topology, kind: str, gaxes, nbytes: float) -> float:
    """A time no simulated collective of this kind, group and size can beat, in closed form:
    the bytes one chip must receive (all-gather, all-reduce) or send (reduce-scatter) at the
    least, (N-1)/N of V ((N-1)/N^2 of V for all-to-all, V for a permute), through at most two
    links (one per direction) of every physical axis the group spans, and at least one hop of
    latency. 0 when it cannot say (DCN groups, unknown kinds)."""
    from sim.engine import padded_collective_bytes

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


def _mesh_groups(axes, topology) -> dict[str, tuple]:
    """Physical group axes of every logical axis of the ICI mesh `axes`, as the engine places
    them (`sim.engine.collective_groups`)."""
    from topologies.groups import axis_factor
    from topologies.mesh import LogicalMesh, place_mesh

    return {name: tuple(axis_factor(topology, a, size, stride) for a, size, stride in pl.factors)
            for name, pl in place_mesh(LogicalMesh(axes=tuple(axes)), topology).items()}


class _Floors:
    """Per-op durations no simulation can beat (sim/engine.py's costing without contention):
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
        from sim.engine import compute_op_times

        self.op_times = compute_op_times

    def compute(self, op) -> float:
        return self.chip.op_overhead_s + max(self.op_times(self.chip, op))

    def send(self, nbytes: float) -> float:
        if self.topology.num_slices > 1:
            return 0.0  # may cross DCN: no floor here
        bw = self.chip.eff_ici_link_bytes_per_s
        return max(nbytes / (2 * self.topology.ndim * bw), self.chip.ici_hop_latency_s)

    def collective(self, op) -> float:
        from sim.engine import _merge

        key = (op.collective, op.mesh_axes, op.bytes, op.group)
        if key not in self.memo:
            if op.group >= 0:  # explicit device groups (HLO import): no closed form here
                self.memo[key] = 0.0
            else:
                factors: list = []
                for a in op.mesh_axes:
                    factors += list(self.groups.get(a, ()))
                gaxes = _merge(self.topology, factors) if factors else ()
                floor = collective_floor_s(self.chip, self.topology, op.collective,
                                           gaxes[:1] if op.collective == "collective-permute"
                                           else gaxes, op.bytes)
                if self.exact_algorithm is not None and gaxes:
                    from sim.engine import cost_cache_key, cost_collective

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
    transfers as soon as their dependencies are done) at `_Floors` durations. Shared links,
    HBM and PCIe only delay ops, and every start is a max of earlier ends, so each op ends no
    earlier in the simulation than here."""
    floors = _Floors(chip, topology, groups)
    runs = _Uncontended([trace], floors, {}, {})
    runs.advance(0)
    return runs.start[0], runs.end[0]


def hbm_peak_lower_bound(trace, off_core: Iterable[int] = ()) -> float:
    """An HBM peak that `sim.engine.hbm_occupancy` cannot come in under, whatever the schedule.

    The engine applies a trace's memory events (meta `memory_events`) at their op's end, in
    (end, op id) order, and records the level after each op. The core runs its ops (compute and
    idle; collectives too without overlap) one after another in trace order, and an op ends
    after its dependencies, which are earlier ops (lower ids). So when core op X's events have
    been applied, every earlier core op and every ancestor of those has ended and was applied
    first; anything else applied by then is an op off the core (a collective or a host
    transfer) that X does not wait for, and it can only have added memory if no op off the
    core has a net negative delta. Under that condition the level after X is at least static +
    the deltas of X, the earlier core ops and all their ancestors: the largest of these over X
    is the bound. 0 when the condition fails or the trace has no events (no bound).
    `off_core`: ops the core skips although of a core kind (a pipeline stage's receives,
    completed by the peer's send)."""
    from sim.engine import static_hbm_bytes
    from workloads.memory import MEMORY_CATEGORIES
    from workloads.trace import OpKind

    meta = trace.meta
    raw = meta.get("memory_events")
    if not raw:
        return 0.0
    ops = trace.ops
    delta = [0.0] * len(ops)
    for ev in raw:
        i = int(ev[0])
        if not 0 <= i < len(ops) or str(ev[1]) not in MEMORY_CATEGORIES:
            return 0.0  # the simulation reports the bad event
        delta[i] += float(ev[2])
    overlap = bool(meta.get("overlap", True))
    skipped = set(off_core)

    def on_core(o) -> bool:
        return o.id not in skipped and (o.kind in (OpKind.COMPUTE, OpKind.IDLE) or
                                        (o.kind == OpKind.COLLECTIVE and not overlap))

    if any(delta[o.id] < 0 for o in ops if not on_core(o)):
        return 0.0
    level = static_hbm_bytes(meta)
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


class _Uncontended:
    """The uncontended schedule of several programs whose point-to-point receives complete when
    the matching send of another program does (pipeline stages): `advance(k)` runs program k's
    ops in order until a receive waits for a send not yet timed."""

    def __init__(self, programs, floors: _Floors, sends, recvs):
        self.programs, self.floors = programs, floors
        self.sends = sends  # program -> {send op id: tag}
        self.recv_tag = {k: {rid: tag for tag, rid in r.items()} for k, r in recvs.items()}
        self.sent: dict[int, float] = {}  # tag -> when its send completes
        self.start = [[0.0] * len(t.ops) for t in programs]
        self.end = [[0.0] * len(t.ops) for t in programs]
        self.pos = [0] * len(programs)
        self.core = [0.0] * len(programs)
        self.overlap = [bool(t.meta.get("overlap", True)) for t in programs]

    def advance(self, k: int) -> bool:
        from workloads.trace import OpKind

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
    pipeline stages, of every stage's program as sim/pipeline.py composes it, each receive
    completing when its send does (so the bound holds the bubble). With `exact_algorithm`
    (single-program steps only), collectives take their simulated uncontended time (and
    `cost_keys`, if given, receives the cost-cache keys of those collectives)."""
    from topologies.mesh import LogicalMesh
    from workloads.training import compile_training_step

    mesh = LogicalMesh(axes=tuple(axes))
    groups = _mesh_groups(axes, topology)
    pipelined = mesh.size("pipeline") > 1
    floors = _Floors(chip, topology, groups, None if pipelined else exact_algorithm)
    if not pipelined:
        trace = compile_training_step(model, mesh, num_chips, tcfg)
        runs = _Uncontended([trace], floors, {}, {})
        runs.advance(0)
        if cost_keys is not None:
            cost_keys += floors.cost_keys
        return max(runs.end[0], default=0.0)
    runs = _stage_schedule(_stage_programs(model, mesh, num_chips, tcfg), floors)
    if runs is None:
        return 0.0  # a receive no send completes: bound nothing (the engine refuses it)
    return max(max(e, default=0.0) for e in runs.end)


def _stage_schedule(sp, floors: _Floors) -> _Uncontended | None:
    """The uncontended schedule of a pipeline's stage programs (`_stage_programs`), each
    receive completing when its send does; None if some receive is never sent."""
    p = len(sp.programs)
    runs = _Uncontended(list(sp.programs), floors,
                        {k: {sid: tag for sid, (_ch, tag) in sp.sends[k].items()}
                         for k in range(p)},
                        {k: dict(sp.recvs[k]) for k in range(p)})
    while any(runs.pos[k] < len(sp.programs[k].ops) for k in range(p)):
        if not any([runs.advance(k) for k in range(p)]):
            return None
    return runs


def _pass_terms(tr, ids: list[int], entry_waits: bool, fwd: bool, floors: _Floors,
                overlap: bool) -> tuple[float, float, float, float]:
    """One pass of a stage program (`sim.pipeline.build_stage_programs` copies chunk trace
    `tr`'s ops `ids` once per microbatch) as max-plus terms of its two inputs: the end G of
    the previous pass's last compute op on the stage (its gate: the core is busy until then,
    and every op of the pass that depends on no other op of the pass waits for it) and the end
    R of the pass's receive (its entry op `stage_input` / `stage_grad_input` waits for it when
    `entry_waits`). Returns (a, b, ga, gb): in the uncontended schedule (`_Uncontended`, the
    same per-op durations) the pass's last compute op ends no earlier than max(G + a, R + b)
    and its gradient collectives (which the stage's optimizer update waits for) no earlier than
    max(G + ga, R + gb); -inf where a term is absent. Dependencies on ops outside the pass (a
    backward pass's own forward activations) are left out, which only lowers these ends, as
    does starting the core at G."""
    from workloads.trace import OpKind

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
    schedule order (`sim.pipeline.stage_order`) as `step_lower_bound` composes the stage
    programs' ops: a pass's receive ends when the previous stage's send does (its last compute
    op's end plus one message's floor), and the stage's optimizer update (the first chunk's
    optimizer ops, one after another on the core) starts after the last pass and every
    gradient collective. Every term is a max and a sum of ends and durations that the
    uncontended schedule of the stage programs holds too (less some of its constraints), so
    this is never above `step_lower_bound` of the same step, and so never above the simulated
    step; on the 405B plan's pipelines it is within a few microseconds of it, at a fraction of
    the cost (the stage programs hold M copies of every pass). 0 for a schedule whose receives
    no send completes."""
    from sim.pipeline import check_schedule, chunk_program, stage_order
    from topologies.mesh import LogicalMesh
    from workloads.trace import OpKind
    from workloads.training import WEIGHT_CAST

    mesh = LogicalMesh(axes=tuple(axes))
    p, v, m = mesh.size("pipeline"), tcfg.virtual_stages, tcfg.microbatches
    check_schedule(tcfg.pipeline_schedule, p, m, v)
    chunks = p * v
    floors = _Floors(chip, topology, _mesh_groups(axes, topology))

    # The chunk programs depend on the axis sizes, not their order: a group's placements, and
    # its stage programs if it reaches the front, share them (`chunk_program`'s cache).
    def chunk_trace(c: int):
        return chunk_program(model, mesh, num_chips, tcfg, c)

    send = floors.send(float(chunk_trace(0).meta["pipeline_send_bytes"]))
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
                                     bool(tr.meta.get("overlap", True)))
        return terms[key]

    orders = [stage_order(tcfg.pipeline_schedule, p, s, m, v) for s in range(p)]
    pos = [0] * p
    # A stage's weight cast (--gather-dtype) runs before its first pass (sim/pipeline.py).
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


def _stage_programs(model, mesh, num_chips: int, tcfg):
    """`sim.pipeline.build_stage_programs` (cached per worker: every placement of a group
    shares one composition; the bounds take the collectives' groups from the placement)."""
    from sim.pipeline import build_stage_programs

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
    sp = _stage_programs(model, mesh, num_chips, tcfg)
    return max(hbm_peak_lower_bound(prog, off_core=sp.recvs[k].values())
               for k, prog in enumerate(sp.programs))


def core_floor_s(trace, floors: _Floors) -> float:
    """The time a chip's core is busy with `trace`'s compute and idle ops at their floors
    (`_Floors.compute`, the durations alone): the core runs them one at a time, so no step
    of this program is shorter."""
    from workloads.trace import OpKind

    t = 0.0
    for op in trace.ops:
        if op.kind == OpKind.COMPUTE:
            t += floors.compute(op)
        elif op.kind == OpKind.IDLE:
            t += op.duration_s
    return t


def stage_core_floors_s(model, mesh, num_chips: int, tcfg, floors: _Floors) -> list[float]:
    """`core_floor_s` of every pipeline stage's program as `sim.pipeline.build_stage_programs`
    composes it, from the one-microbatch chunk programs alone: the stage's weight cast, each
    pass of its schedule (a chunk's forward or backward ops, copied per microbatch) and its
    first chunk's optimizer update."""
    from sim.pipeline import chunk_program, stage_order
    from workloads.trace import OpKind
    from workloads.training import WEIGHT_CAST

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
    import dataclasses as _dc

    from workloads.training import compile_training_step

    floors = _Floors(chip, topology, {})
    p = mesh.size("pipeline")
    v = tcfg.virtual_stages if p > 1 else 1
    per_chunk = model.num_layers // (p * v)

    def floor_at(k: int) -> list[float]:
        small = _dc.replace(model, num_layers=k * p * v)
        if p > 1:
            return stage_core_floors_s(small, mesh, num_chips, tcfg, floors)
        return [core_floor_s(compile_training_step(small, mesh, num_chips, tcfg), floors)]

    f2, f3 = floor_at(2), floor_at(3)
    return max(a + (per_chunk - 2) * (b - a) for a, b in zip(f2, f3, strict=True))


def floor_bounds(job: tuple) -> dict[str, Any]:
    """`compute_floor` of one group of candidates that differ only in placement: the cheapest
    first bound of a group (two compiles of a model of 2 and 3 layers per chunk, where a full
    bound compiles every layer); its `pipeline_bounds` or `lower_bounds` follow only when one
    of its candidates reaches the front of the plan's queue. Job: (train request, [axis
    orders]) -> {"lower_bounds_s": [...], "floor_s": the floor} or {"error": ...}."""
    req, orders = job
    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        floor = compute_floor(model, mesh, topo.num_chips, tcfg, chip, topo)
        # Less a relative 1e-9: the same floors summed in another order than the engine's.
        return {"lower_bounds_s": [floor * (1 - 1e-9)] * len(orders), "floor_s": floor}
    except TpusimError as exc:
        return {"error": str(exc)}


def lower_bounds(job: tuple) -> dict[str, Any]:
    """`step_lower_bound` of every placement (axis order) of one group of candidates that differ
    only in placement, for the model, pod and training settings that `tpusim ARGV` resolves
    (the same parser and compile inputs as the simulation; the placements share one compiled
    trace). Job: (train request, [axis orders]) -> {"lower_bounds_s": [...],
    "hbm_lower_bound_bytes": `hbm_peak_lower_bound` of the step (0 for pipelines),
    "hbm_capacity_bytes": the chip's HBM, "core_floor_s": the busiest core's `core_floor_s`
    (what `compute_floor` stands for, checked by `run_plan`)} or {"error": ...}."""
    from workloads.training import compile_training_step

    req, orders = job
    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        # The bounds of a pipeline use its stage programs only, not the whole step's trace
        # (a quarter of the job's time on 405B); an error that compile would raise is then
        # reported by the candidate's simulation.
        floors = _Floors(chip, topo, {})
        if mesh.size("pipeline") > 1:
            hbm = step_hbm_lower_bound(model, None, topo.num_chips, tcfg, mesh=mesh)
            core = max(core_floor_s(prog, floors) for prog in
                       _stage_programs(model, mesh, topo.num_chips, tcfg).programs)
        else:
            trace = compile_training_step(model, mesh, topo.num_chips, tcfg)
            hbm = step_hbm_lower_bound(model, trace, topo.num_chips, tcfg)
            core = core_floor_s(trace, floors)
        return {"lower_bounds_s": [step_lower_bound(model, o, topo.num_chips, tcfg, chip, topo)
                                   for o in orders],
                "hbm_lower_bound_bytes": hbm, "hbm_capacity_bytes": chip.hbm_bytes,
                "core_floor_s": core}
    except TpusimError as exc:
        return {"error": str(exc)}


def _bound_inputs(req: TrainRequest) -> tuple:
    """(chip, topology, model, mesh, training config) that the candidate's request compiles
    (the same compile inputs as its simulation)."""
    pod = resolve_pod(req)
    _base, model, mesh, tcfg = compile_inputs(
        req, moe_config(req, scenario_of(req, pod.topology)), pod.chip)
    return pod.chip, pod.topology, model, mesh, tcfg


def pipeline_bounds(job: tuple) -> dict[str, Any]:
    """`pipeline_schedule_bound` of every placement (axis order) of one group of pipeline
    candidates that differ only in placement: the cheap first bound of a pipeline group (its
    one-microbatch chunk programs only). `lower_bounds` (the stage programs' schedule and HBM
    peak) follows only for a group that reaches the front of the plan's queue. Job: (train
    request, [axis orders]) -> {"lower_bounds_s": [...]} or {"error": ...}."""
    req, orders = job
    try:
        chip, topo, model, _mesh, tcfg = _bound_inputs(req)
        # Less a relative 1e-12: the same durations summed in another order than the stage
        # programs' schedule (on the 405B plan up to 7e-12 s above it where the two agree).
        return {"lower_bounds_s": [pipeline_schedule_bound(model, o, topo.num_chips, tcfg, chip,
                                                           topo) * (1 - 1e-12)
                                   for o in orders]}
    except TpusimError as exc:
        return {"error": str(exc)}


def sharper_bound(job: tuple) -> dict[str, Any]:
    """The sharper lower bound of one candidate: the uncontended schedule with every collective
    at its exact simulated time alone on the pod (`step_lower_bound(exact_algorithm=...)`), and
    those collectives' costs (`sim.engine.cost_collective`'s cache entries, to seed the worker
    that simulates the candidate). Job: (train request, axis order[, {cost cache key:
    CollectiveCost} computed by other workers, added to this process's cache first]) ->
    {"lower_bound_s": b or None, "costs": {...}}. MoE steps (per-chip expert loads scale their
    collectives) and pipelines keep the plain bound (None), as does a step the compiler
    refuses (its simulation reports the error)."""
    from sim import engine

    req, order, *known = job
    if known and known[0]:
        engine.seed_cost_cache(known[0])
    keys: list[tuple] = []
    try:
        pod = resolve_pod(req)
        chip, topo = pod.chip, pod.topology
        _trace, _base, model, tcfg = compile_step(
            req, topo.num_chips, moe_config(req, scenario_of(req, topo)), chip=chip)
        if model.is_moe or dict(order).get("pipeline", 1) > 1:
            return {"lower_bound_s": None, "costs": {}}
        # Less a relative 1e-12: sums of the same durations in another order than the
        # engine's may differ in the last bits, and this bound can be that tight.
        bound = step_lower_bound(model, order, topo.num_chips, tcfg, chip, topo,
                                 exact_algorithm=algorithm_of(req), cost_keys=keys) * (1 - 1e-12)
    except Exception:  # noqa: BLE001 - the simulation reports the error (run_point never raises)
        return {"lower_bound_s": None, "costs": {}}
    cache = engine._COST_CACHE
    return {"lower_bound_s": bound, "costs": {k: cache[k] for k in keys if k in cache}}


# The horizon of a prefix run is this many times the time its uncontended schedule first goes
# over HBM: the simulated step runs a few percent slower than that schedule, so the 405B plan's
# stopped pipelines go over well within it (at 1.28x their schedule's time). One program runs
# its collectives concurrently, on shared links, far slower than alone: the 405B plan's two
# one-program steps that go over do so at 28x (45 ms against 1.6 ms), so a prefix that reaches
# its horizon undecided is run again with a horizon PREFIX_HORIZON_GROWTH times longer, until
# it decides or would be the whole step (which then runs in full). The prefixes grow about as
# their horizons do, so the undecided ones cost a fraction 1/(growth - 1) of the last one.
PREFIX_HORIZON_FACTOR = 2.0
PREFIX_HORIZON_GROWTH = 8.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _PrefixSchedule:
    """A step's programs in their uncontended schedule, and when its HBM level first goes over
    the capacity there (`over_s`): what `prefix_ops` cuts prefixes from."""

    programs: list
    runs: _Uncontended
    sends: list  # per program {send op id: (peer chip, tag)}
    recvs: list  # per program {tag: receive op id}
    over_s: float


def prefix_schedule(req: TrainRequest, capacity: float) -> _PrefixSchedule | None:
    """The uncontended schedule of the candidate's step (a pipeline's stage programs, or the
    one program `train` compiles) and the first time its HBM level (memory events applied at
    its op ends) goes over `capacity`; None where no prefix applies: the level never goes over
    (the step probably fits: it runs in full at once), MoE models (per-chip expert loads) and
    steps with perturbations (a chip faster than the chip spec would break the schedule's
    bound).

    The uncontended schedule (`_Uncontended`, the programs as `step_lower_bound` runs them)
    starts every op no later than the simulation does, so an op whose schedule start is at or
    past a horizon H starts at H or later in the simulation too (`prefix_ops`)."""
    from sim.engine import collective_groups, static_hbm_bytes
    from workloads.training import compile_training_step

    try:
        chip, topo, model, mesh, tcfg = _bound_inputs(req)
        if model.is_moe or not scenario_of(req, topo).is_healthy:
            return None
        if mesh.size("pipeline") > 1:
            sp = _stage_programs(model, mesh, topo.num_chips, tcfg)
            programs, sends, recvs = list(sp.programs), list(sp.sends), list(sp.recvs)
            runs = _stage_schedule(sp, _Floors(chip, topo, _mesh_groups(mesh.axes, topo)))
        else:
            # The program `train` replays (the worker's compile cache then serves the run),
            # its collectives on the engine's own groups.
            trace = compile_training_step(model, mesh, topo.num_chips, tcfg)
            programs, sends, recvs = [trace], [{}], [{}]
            runs = _Uncontended(programs, _Floors(chip, topo, collective_groups(trace, topo)),
                                {}, {})
            runs.advance(0)
    except TpusimError:
        return None  # the simulation reports it
    if runs is None:
        return None
    over = math.inf
    for k, prog in enumerate(programs):
        level = static_hbm_bytes(prog.meta)
        for t, _i, d in sorted((runs.end[k][int(ev[0])], int(ev[0]), float(ev[2]))
                               for ev in prog.meta.get("memory_events") or ()):
            level += d
            if level > capacity:
                over = min(over, t)
                break
    if not math.isfinite(over) or over <= 0:
        return None  # (at 0 the prefix would be empty: ops of zero length end at 0 too)
    return _PrefixSchedule(programs=programs, runs=runs, sends=sends, recvs=recvs, over_s=over)


def prefix_ops(sched: _PrefixSchedule,
               horizon: float) -> tuple[tuple[frozenset[int], ...], float] | None:
    """(per program, the ids of the ops that may start before `horizon`; the horizon in s),
    for `stop_when_hbm_exceeds(prefix=...)`; None if that is every op (the whole step).

    Each program's set is its ops that start before H in the uncontended schedule, and the
    receives of their sends (a receive completes with its send); every dependency of such an
    op ends before it starts, so before H too: the set holds everything its ops wait for."""
    runs, programs, sends, recvs = sched.runs, sched.programs, sched.sends, sched.recvs
    p = len(programs)
    # A receive completes with its send: in the prefix when the send is.
    recv_ids = [set(recvs[k].values()) for k in range(p)]
    keep = [{i for i, t in enumerate(runs.start[k]) if t < horizon and i not in recv_ids[k]}
            for k in range(p)]
    recv_of = {tag: (k, rid) for k in range(p) for tag, rid in recvs[k].items()}
    for k in range(p):
        for sid, (_ch, tag) in sends[k].items():
            if sid in keep[k] and tag in recv_of:
                j, rid = recv_of[tag]
                keep[j].add(rid)
    if all(len(keep[k]) == len(programs[k].ops) for k in range(p)):
        return None  # the whole step: its full watched run decides at the same cost
    return tuple(frozenset(x) for x in keep), horizon


def hbm_prefix(req: TrainRequest,
               capacity: float) -> tuple[tuple[frozenset[int], ...], float] | None:
    """The first prefix `simulate` runs for a step that may go over `capacity` early:
    `prefix_ops` at H = `PREFIX_HORIZON_FACTOR` times the first time the uncontended
    schedule's HBM level goes over (`prefix_schedule`); None where no prefix applies."""
    sched = prefix_schedule(req, capacity)
    return None if sched is None else prefix_ops(sched, PREFIX_HORIZON_FACTOR * sched.over_s)


def _pipeline_run(req: TrainRequest) -> None:
    """The engine run of the candidate's pipeline step as `sim.runs.train.run_train` makes
    it (the same stage programs, perturbations and algorithm), without compiling the whole
    step's trace, which only its summary needs (dense models: `_pipeline_base` takes no expert
    loads from it)."""
    from sim.pipeline import check_schedule, simulate_pipeline_chips

    chip, topo, model, mesh, tcfg = _bound_inputs(req)
    check_schedule(tcfg.pipeline_schedule, mesh.size("pipeline"), tcfg.microbatches,
                   tcfg.virtual_stages)
    sp = _stage_programs(model, mesh, topo.num_chips, tcfg)
    simulate_pipeline_chips(model, mesh, chip, topo, tcfg,
                            base=_pipeline_base(req, sp.programs[0], topo),
                            algorithm=algorithm_of(req))


def simulate(job: tuple) -> dict[str, Any]:
    """`run_point(req)` (the candidate as `tpusim train` runs it), after adding collective
    costs computed by another worker to this process's cache (the same pure function's values,
    so the result is the same). Job: (train request, {cost cache key: CollectiveCost}, HBM
    capacity or None): with a capacity, a step whose HBM level goes over it is stopped there
    (`sim.executors.stop_when_hbm_exceeds`: it is out of memory, as `train` would find) and
    the result is {"out_of_memory": True, "hbm_level_bytes": level}. A step (a pipeline or
    one program) that may go over early (`prefix_schedule`) first runs only the ops that can
    start before a horizon: going over before it is the full run's verdict; reaching it
    undecided, the prefix grows (`PREFIX_HORIZON_GROWTH`) until it decides or would be the
    whole step, which then runs in full."""
    from sim.engine import seed_cost_cache
    from sim.executors import stop_when_hbm_exceeds
    req, costs, capacity = job
    if costs:
        seed_cost_cache(costs)
    if capacity is None:
        return run_point(req)
    sched = prefix_schedule(req, capacity)
    horizon = PREFIX_HORIZON_FACTOR * sched.over_s if sched is not None else 0.0
    while sched is not None and (prefix := prefix_ops(sched, horizon)) is not None:
        with stop_when_hbm_exceeds(capacity, prefix=prefix) as watch:
            try:
                if len(prefix[0]) > 1:  # a pipeline's stage programs
                    _pipeline_run(req)
                else:
                    run_point(req)  # returns the error (over capacity, or no verdict)
            except TpusimError:
                pass  # over capacity, or no verdict (the full run below reports any error)
        if watch.exceeded:
            return {"out_of_memory": True, "hbm_level_bytes": watch.level_bytes,
                    "prefix": True}
        if not watch.reached_horizon:
            break  # the watch does not apply, or another error: the full run reports it
        horizon *= PREFIX_HORIZON_GROWTH
    with stop_when_hbm_exceeds(capacity) as watch:
        out = run_point(req)
    if watch.exceeded:
        return {"out_of_memory": True, "hbm_level_bytes": watch.level_bytes}
    return out


def refine_and_run(job: tuple) -> dict[str, Any]:
    """Simulate one candidate as `tpusim train ARGV` does, unless its sharper lower bound
    (`sharper_bound`; the engine then finds the collective costs in this process's cache)
    proves it cannot enter the top K. Job: (train request, axis order, threshold): a bound >=
    threshold returns {"pruned": True, "lower_bound_s": b}; otherwise `run_point`'s result
    plus "lower_bound_s" (None where there is no sharper bound)."""
    req, order, threshold = job
    bound = sharper_bound((req, order))["lower_bound_s"]
    if bound is not None and bound >= threshold:
        return {"pruned": True, "lower_bound_s": bound}
    out = run_point(req)
    out["lower_bound_s"] = bound
    return out


def run_plan(base: TrainRequest, model, topology, chip, cfg: PlanConfig, *,
             workers: int = 0, dask: Any = None, quiet: bool = False,
             prune_by_bound: bool = True, refuse_by_hbm_bound: bool = True,
             stop_out_of_memory: bool = True,
             max_simulations: int | None = None,
             variants: list[PodVariant] | None = None) -> PlanResult:
    """Enumerate and prune by memory; bound every candidate from below (one compile per mesh
    sizes and settings, shared by its placements): its step time, and its HBM peak (a
    candidate whose peak bound is over HBM is out of memory, as `tpusim train` would find,
    without simulating it); take the others best first (lowest bound), sharpening each
    candidate's bound before simulating it (as `tpusim train`, on the sweep's workers), until
    the next bound is no better than the K-th best simulated step: those left cannot enter the
    top K, which is therefore exact. A simulation whose HBM goes over capacity stops there (out
    of memory; its time is not needed). `prune_by_bound=False`, `refuse_by_hbm_bound=False` and
    `stop_out_of_memory=False` turn the shortcuts off (the brute-force oracle).
    `max_simulations`: with `prune_by_bound=False` (every candidate simulated), refuse a space
    of more candidates than that before anything runs (`plan --exhaustive`'s guard).
    `variants`: the slices searched (shapes and wirings of the same chip count, `pod_variants`);
    every candidate of every slice is one more candidate of the same search, its bounds and
    pruning unchanged (default: `topology` alone)."""
    import pandas as pd

    t0 = time.perf_counter()
    if cfg.objective == "cost" and chip.usd_per_chip_hour is None:
        raise TpusimError(
            f"plan --objective cost: {chip.name} has no list price; give one with --set "
            f"usd_per_chip_hour=PRICE (dollars per chip-hour)")
    variants = variants or [PodVariant(topology=topology)]
    searched_pods = any(v.shape is not None for v in variants)
    if len(variants) > 1:
        opts = _size_options(model, topology.num_chips, cfg)
        combos = math.prod(len(v) for v in opts.values()) * len(cfg.remat) \
            * len(cfg.param_dtypes) * len(cfg.grad_dtypes) * len(cfg.optimizer_dtypes) \
            * len(variants)
        if combos > MAX_PLAN_COMBINATIONS:
            raise TpusimError(
                f"plan would consider {combos:,} combinations of slices, axis sizes and "
                f"settings ({len(variants)} slices), over the limit of "
                f"{MAX_PLAN_COMBINATIONS:,}; list fewer --shapes, give --wiring plain, lower "
                f"the --max-* limits or allow fewer --remat and dtype values")
    cands, counts = [], {}
    for v in variants:
        vc, vn = enumerate_candidates(model, v.topology, chip, cfg, v if searched_pods else None)
        cands += vc
        counts = {k: counts.get(k, 0) + n for k, n in vn.items()}
    if searched_pods:
        counts["slices"] = len(variants)  # listed only when slices were searched
    changes = {(v.shape, v.twist): v.request_changes() for v in variants}
    if not prune_by_bound and max_simulations is not None and len(cands) > max_simulations:
        raise TpusimError(
            f"plan --exhaustive would simulate {len(cands):,} candidates to the end, over the "
            f"limit of {max_simulations:,} (each is a whole `tpusim train` run); give "
            f"--max-simulations {len(cands)} to run them all, narrow the space (--axes, --max-*, "
            f"--remat, --microbatches, --default-placement), or drop --exhaustive (the default "
            f"search gives the same top K)"
        )
    n_chips = topology.num_chips
    # Every candidate is `base` (the pod, model and overrides) with its own settings: a
    # request, as `tpusim train` would build it.
    batch_per_chip = repr(cfg.global_batch / n_chips)
    reqs = [base.replace(seq_len=cfg.seq_len, batch_per_chip=batch_per_chip,
                         **changes[(c.shape, c.twist)], **c.train_settings()) for c in cands]
    check_workers(workers)
    check_dask(dask)
    n = num_workers(workers)
    # One bound job per (sizes, settings): its placements share the compiled trace.
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cands):
        key = (c.shape, c.twist, tuple(sorted(c.mesh)), c.remat, c.microbatches,
               c.param_dtype, c.grad_dtype, c.optimizer_dtype)
        groups.setdefault(key, []).append(i)
    jobs = [(reqs[members[0]], [cands[i].mesh for i in members])
            for members in groups.values()]
    members_of = list(groups.values())
    group_of = {i: k for k, members in enumerate(members_of) for i in members}
    # A pipeline group's first bound is `pipeline_bounds` (its chunk programs only); the
    # stage programs' bounds (`lower_bounds`: a few seconds each on 405B, most of them
    # building M copies of every pass) follow only when one of its candidates reaches the
    # front of the queue below, i.e. could still enter the top K. The brute-force oracle
    # bounds every group in full from the start.
    piped = {k for k, members in enumerate(members_of)
             if dict(cands[members[0]].mesh).get("pipeline", 1) > 1}
    # Cheaper still, and first where it applies (dense models whose layers are all alike):
    # the group's compute floor (`floor_bounds`, from models of 2 and 3 layers per chunk,
    # without compiling the step); its pipeline or full bound follows only when one of its
    # candidates reaches the front. On LLaMA-3-70B on a v5p-128 the floors of every full-remat
    # group (26.7 s or more) are above the best steps (22.2-23.0 s): those groups are never
    # compiled. `level`: the bound a group has so far, while it is not its full bound.
    level: dict[int, str] = {}
    if prune_by_bound:
        for k, members in enumerate(members_of):
            sizes = dict(cands[members[0]].mesh)
            if floor_applies(model, sizes):  # (plan's candidates have one virtual stage)
                level[k] = "floor"
            elif k in piped:
                level[k] = "pipeline"
    floor_of: dict[int, float] = {}  # group -> its compute floor, checked by its full bound
    floor_violated = False
    first_bound = {"floor": floor_bounds, "pipeline": pipeline_bounds}
    pool = JobPool(min(n, max(len(jobs), 1)), dask)
    results: dict[int, dict[str, Any]] = {}
    lb: list[float] = [0.0] * len(cands)
    refused: set[int] = set()  # out of memory by their HBM peak bound: never simulated
    stopped: set[int] = set()  # out of memory: simulation stopped when HBM went over
    capacity: dict[int, float] = {}
    bound_violated = False
    skipped: list[int] = []
    pruned: list[int] = []  # skipped by their sharper bound
    sharp: set[int] = set()  # candidates with a sharper bound
    refined = 0
    prefix_stopped = 0  # of `stopped`: steps stopped within a prefix run
    full_pipeline_bounds = len(piped - set(level))  # pipeline groups bounded in full at once
    full_bounds = len(jobs) - len(level)  # groups bounded in full (so far)
    # One tick per bound job and per candidate (simulated, refused or skipped); the detail
    # line: groups bounded, candidates simulated and left, the best step so far.
    bar = NO_TASK if quiet else task("plan --exhaustive" if not prune_by_bound else "plan",
                                     total=len(jobs) + len(cands), unit="job")
    bounded_jobs = 0
    best_step = math.inf

    def tick(n: int = 1) -> None:
        if not bar.active:
            return
        decided = len(refused) + len(results) + len(stopped) + len(skipped)
        best = f", best {best_step:.4g} s" if best_step < math.inf else ""
        bar.update(bar.done + n, detail=f"bounded {bounded_jobs}/{len(jobs)}, simulated "
                                        f"{len(results) + len(stopped)}, left "
                                        f"{len(cands) - decided}{best}")

    def take_bounds(k: int, b: dict[str, Any]) -> list[int]:
        """Group k's bounds into `lb`, `capacity` and `refused`; the members newly refused."""
        nonlocal floor_violated, bound_violated
        if "floor_s" in b:
            floor_of[k] = b["floor_s"]
        if "core_floor_s" in b and k in floor_of \
                and floor_of[k] * (1 - 1e-9) > b["core_floor_s"]:
            # The compiled step's core is less busy than its floor said: the floor does not
            # hold for this model, so no floor may rule a candidate out (every group gets its
            # full bound before the search stops).
            floor_violated = bound_violated = True
        # A group the bound cannot handle is simulated like any other (bound 0).
        for i, v in zip(members_of[k], b.get("lower_bounds_s") or
                        [0.0] * len(members_of[k]), strict=True):
            lb[i] = max(lb[i], v)
            if stop_out_of_memory and "hbm_capacity_bytes" in b:
                capacity[i] = b["hbm_capacity_bytes"]
        # Less a relative 1e-9: the engine sums the same deltas in another order.
        if refuse_by_hbm_bound and b.get("hbm_lower_bound_bytes", 0.0) * (1 - 1e-9) \
                > b.get("hbm_capacity_bytes", math.inf):
            new = [i for i in members_of[k] if i not in refused]
            refused.update(new)
            return new
        return []

    try:
        # Largest groups first: the pool stays busy to the end.
        order_jobs = sorted(range(len(jobs)), key=lambda k: (-len(members_of[k]), k))
        futs = {pool.submit(first_bound[level[k]] if k in level else lower_bounds, jobs[k],
                            f"bound-{k}"): k for k in order_jobs}
        while futs:
            for f in pool.wait_any(futs):
                k = futs.pop(f)
                b = f.result()
                if level.get(k) == "pipeline" and "error" in b:
                    del level[k]  # the full bound reports nothing more: bound 0
                take_bounds(k, b)
                bounded_jobs += 1
                tick()
        order = sorted((i for i in range(len(cands)) if i not in refused),
                       key=lambda i: (lb[i], i))
        tick(len(refused))
        # Best first: the candidate with the lowest bound is next. Without its sharper bound
        # yet, a worker computes that (a fraction of a simulation; the collective costs it
        # computes go with the candidate to the worker that simulates it) and the candidate
        # goes back in line with it; with it, it is simulated. A pipeline candidate whose group
        # has only its first bound waits for the group's full bound (which may raise every
        # member's bound or refuse them by HBM) and goes back in line. Stop when the next bound
        # is no better than the K-th best simulated step that fits (it only decreases): every
        # candidate left cannot enter the top K. The sharper bounds are within a few percent
        # of the step, so the fast candidates are simulated first and most slow ones never.
        best: list[float] = []  # objective values (step-time units) of those that fit, sorted
        per_s = objective_per_second(chip, n_chips, cfg.objective)
        if per_s <= 0:
            prune_by_bound = False  # nothing bounds the objective (a free or idle-less chip)
        heap = [(lb[i], i) for i in order]
        heapq.heapify(heap)
        sharpened: set[int] = set()  # sharper bound asked for (it may not exist: None)
        costs_of: dict[int, dict] = {}
        # Every collective cost a sharper bound returned, handed to the next sharper bounds
        # (candidates share many collectives, and a cost is the same pure function's value on
        # any worker: computed once per plan instead of once per worker).
        known: dict[tuple, Any] = {}
        inflight: dict[Any, tuple[str, int]] = {}
        waiting: dict[int, list[int]] = {}  # group -> members popped while its full bound runs

        def refinable(i: int) -> bool:
            return (prune_by_bound and i not in sharpened and not model.is_moe
                    and dict(cands[i].mesh).get("pipeline", 1) <= 1)

        while heap or inflight:
            while heap and len(inflight) < pool.n:
                b, i = heap[0]
                if (prune_by_bound and not bound_violated and len(best) >= cfg.top
                        and b >= best[cfg.top - 1]):
                    break  # the rest wait: a running job may still lower the K-th best
                heapq.heappop(heap)
                if i in refused:
                    continue
                if b < lb[i]:  # its group's full bound raised it since: back in line
                    heapq.heappush(heap, (lb[i], i))
                    continue
                k = group_of[i]
                if k in waiting:
                    waiting[k].append(i)
                elif k in level:
                    # Its next bound: a pipeline's pass-level bound after its floor, else the
                    # full one.
                    nxt = "pipeline" if level[k] == "floor" and k in piped else "full"
                    waiting[k] = [i]
                    if nxt == "pipeline":
                        level[k] = nxt
                        fn = pipeline_bounds
                    else:
                        del level[k]
                        full_bounds += 1
                        full_pipeline_bounds += k in piped
                        fn = lower_bounds
                    inflight[pool.submit(fn, jobs[k], f"bound-{nxt}-{k}")] = ("bound", k)
                elif refinable(i):
                    sharpened.add(i)
                    inflight[pool.submit(sharper_bound, (reqs[i], cands[i].mesh,
                                                         dict(known) if pool.n > 1 else {}),
                                         f"refine-{i}")] = ("refine", i)
                else:
                    inflight[pool.submit(simulate, (reqs[i], costs_of.pop(i, {}),
                                                    capacity.get(i)),
                                         f"plan-{i}")] = ("simulate", i)
            if not inflight:
                break
            for f in pool.wait_any(inflight):
                kind, i = inflight.pop(f)
                o = f.result()
                if kind == "bound":
                    if level.get(i) == "pipeline" and "error" in o:
                        del level[i]  # bound 0 and nothing more to learn: simulate them
                    newly = take_bounds(i, o)
                    tick(len(newly))
                    for j in waiting.pop(i):
                        if j not in refused:
                            heapq.heappush(heap, (lb[j], j))
                    continue
                if kind == "refine":
                    if o.get("lower_bound_s") is not None:
                        refined += 1
                        sharp.add(i)
                        lb[i] = max(lb[i], o["lower_bound_s"])
                    costs_of[i] = o.get("costs") or {}
                    known.update(costs_of[i])
                    heapq.heappush(heap, (lb[i], i))
                    continue
                if o.get("out_of_memory"):
                    stopped.add(i)
                    prefix_stopped += bool(o.get("prefix"))
                    tick()
                    continue
                results[i] = o
                r = o.get("result") or {}
                if r.get("fits_in_hbm") and per_s > 0:
                    # In step-time units: the objective less its floor, over its least
                    # growth per second, is at least the step time; a candidate whose
                    # step-time bound is above the K-th best of these cannot enter the top K.
                    v = objective_value(r, cfg.objective) - objective_floor(
                        r, chip, n_chips, cfg.objective)
                    best = sorted([*best, v / per_s])
                if r and r["step_time_s"] < lb[i] * (1 - 1e-9):
                    bound_violated = True  # the engine changed under the bound: stop pruning
                if r.get("fits_in_hbm"):
                    best_step = min(best_step, float(r["step_time_s"]))
                tick()
        # Left in line (an entry per time a candidate went back in line: once each here).
        skipped = sorted({i for _b, i in heap} - refused - set(results) - stopped)
        pruned = [i for i in skipped if i in sharp]
        tick(len(skipped))
    finally:
        bar.close()
        pool.close()
    rows = []
    for i, c in enumerate(cands):
        o = results.get(i)
        r = (o or {}).get("result") or {}
        flat = {**r, **(r.get("breakdown") or {})}
        error = pd.NA
        if i in refused or i in stopped:
            status, fits = STATUS_DOES_NOT_FIT, False
        elif o is None:
            status, fits = PLAN_STATUS_SKIPPED, pd.NA
        elif "result" not in o:
            status, fits, error = STATUS_ERROR, pd.NA, str(o.get("error"))
        else:
            fits = bool(r.get("fits_in_hbm"))
            status = STATUS_OK if fits else STATUS_DOES_NOT_FIT
        rows.append({
            "shape": c.shape, "twist": c.twist,
            "mesh": c.mesh_text, "placement": c.placement, "remat": c.remat,
            "microbatches": c.microbatches, "param_dtype": c.param_dtype,
            "grad_dtype": c.grad_dtype, "optimizer_dtype": c.optimizer_dtype,
            # The update rule and the dtype weights are gathered and multiplied in (the params'
            # own unless --gather-dtype casts them): what the row's train command ran.
            "optimizer": c.optimizer, "gather_dtype": c.gather_dtype or c.param_dtype,
            "step_time_s": r.get("step_time_s", math.nan), "mfu": r.get("mfu", math.nan),
            "tokens_per_s_per_chip": r.get("tokens_per_s_per_chip", math.nan),
            "energy_j": (r.get("energy") or {}).get("step_j", math.nan),
            "energy_per_token_j": (r.get("energy") or {}).get("j_per_token", math.nan),
            "cost_per_million_tokens_usd": _nan((r.get("cost") or {}).get(
                "usd_per_million_tokens")),
            "hbm_peak_bytes": r.get("hbm_peak_bytes", math.nan),
            "hbm_estimate_bytes": c.hbm_estimate_bytes, "lower_bound_s": lb[i],
            "bound": _bound(flat) if r else "", "fits_in_hbm": fits, "status": status,
            "error": error,
            "_order": i, "_breakdown": r.get("breakdown"),
            "_value": objective_value(r, cfg.objective) if r else math.nan,
            "_capacity": r.get("hbm_capacity_bytes"),
        })
    ok = sorted((x for x in rows if x["status"] == "ok"),
                key=lambda x: (x["_value"], x["step_time_s"], x["_order"]))
    rest = sorted((x for x in rows if x["status"] != "ok"),
                  key=lambda x: (x["lower_bound_s"], x["_order"]))
    for k, x in enumerate(ok, 1):
        x["rank"] = k
    for x in rest:
        x["rank"] = pd.NA
    # The slice of each candidate, when slices were searched (`--shapes`, or a shape that
    # can twist): a `shape` and a `twist` column after the rank; a plan of one pod has none.
    columns = list(PLAN_COLUMNS)
    if searched_pods:
        columns[1:1] = ["shape", "twist"]
    table = pd.DataFrame([{c: x[c] for c in columns} for x in ok + rest], columns=columns)
    table["rank"] = table["rank"].astype("Int64")
    table["fits_in_hbm"] = table["fits_in_hbm"].astype("boolean")
    table["error"] = table["error"].astype("string")
    counts["candidates"] = len(cands)
    counts["bounded"] = len(jobs)
    counts["bounded_by_compute_floor"] = sum(1 for k in range(len(jobs)) if k in floor_of)
    counts["bounded_in_full"] = full_bounds
    counts["pipeline_groups_bounded_in_full"] = full_pipeline_bounds
    counts["simulated"] = len(results) + len(stopped)
    counts["skipped_by_bound"] = len(skipped)
    counts["sharper_bounds"] = refined
    counts["skipped_by_sharper_bound"] = len(pruned)
    counts["out_of_memory_by_hbm_bound"] = len(refused)
    counts["out_of_memory_stopped_early"] = len(stopped)
    counts["out_of_memory_stopped_in_prefix"] = prefix_stopped
    counts["fit"] = len(ok)
    counts["out_of_memory"] = sum(1 for x in rest if x["status"] == STATUS_DOES_NOT_FIT)
    counts["failed"] = sum(1 for x in rest if x["status"] == STATUS_ERROR)
    counts["bound_violated"] = int(bound_violated)
    counts["compute_floor_violated"] = int(floor_violated)
    caps = [x["_capacity"] for x in rows if x["_capacity"]]
    return PlanResult(table=table, explanation=explain(ok, cfg.objective), counts=counts,
                      objective=cfg.objective,
                      hbm_capacity_bytes=caps[0] if caps else math.nan,
                      wall_s=time.perf_counter() - t0, model=model.name,
                      pod=_pod_label(variants, topology, chip))


def _pod_label(variants: list[PodVariant], topology, chip) -> str:
    """`4x4x8 v4`; with slices searched, how many (`4 slices of 256 chips v4`)."""
    if not any(v.shape is not None for v in variants):
        name = "x".join(map(str, topology.shape)) + (" twisted" if topology.twisted else "")
        return f"{name} {chip.name}"
    shapes = dict.fromkeys(v.shape for v in variants)
    if len(shapes) == 1:
        return f"{next(iter(shapes))} plain and twisted {chip.name}"
    return (f"{len(shapes)} shapes of {topology.num_chips} chips "
            f"({len(variants)} slices with their wirings) {chip.name}")


def _nan(v: Any) -> float:
    return math.nan if v is None else v


_GAIN_WORDS = {"time": ("faster", "as fast as"), "cost": ("cheaper", "as cheap as"),
               "energy": ("less energy", "as little energy as")}


def explain(ranked: list[dict[str, Any]], objective: str = "time") -> str:
    """One line on why the winner wins: where its axes sit, what bounds it, its memory
    headroom, and how much it beats the runner-up by (in the objective's terms)."""
    if not ranked:
        return "no candidate fits in HBM; allow more remat, microbatches or sharding"
    w = ranked[0]
    pod = (f"{w['shape']}{' twisted' if w['twist'] else ''}: " if w.get("shape") else "")
    text = f"{pod}{w['placement']}, remat {w['remat']}"
    if w["microbatches"] > 1:
        text += f", {w['microbatches']} microbatches"
    cap = w.get("_capacity") or 0
    if cap:
        text += (f": fits in {w['hbm_peak_bytes'] / 1e9:.1f} of {cap / 1e9:.0f} GB")
    bd = w.get("_breakdown") or {}
    comm = bd.get("exposed_comm_s", 0.0) / w["step_time_s"] if w["step_time_s"] else 0.0
    text += f"; bound by {w['bound']}, {comm:.0%} of the step exposed communication"
    if len(ranked) > 1:
        r = ranked[1]
        key = "_value" if "_value" in w else "step_time_s"
        gain = r[key] / w[key] - 1 if w[key] else 0.0
        better, tie = _GAIN_WORDS[objective]
        what = [f"{r['shape']}{' twisted' if r['twist'] else ''}"
                if (r.get("shape"), r.get("twist")) != (w.get("shape"), w.get("twist")) else "",
                f"{r['mesh']}" if r["mesh"] != w["mesh"] else "",
                f"placement {r['placement']}" if r["mesh"] == w["mesh"]
                and r["placement"] != w["placement"] else "",
                f"remat {r['remat']}" if r["remat"] != w["remat"] else "",
                f"{r['microbatches']} microbatches" if r["microbatches"] != w["microbatches"]
                else ""]
        what = ", ".join(x for x in what if x) or "the same layout with other dtypes"
        # Equal layouts placed differently often tie: "0.0% faster" would read as a margin.
        text += (f"; {gain:.1%} {better} than the runner-up ({what})"
                 if f"{gain:.1%}" != "0.0%"
                 else f"; {tie} the runner-up to within 0.05% ({what})")
    return text


def plot_frontier(result: PlanResult, path) -> Any:
    """Tokens/s/chip against peak HBM for every simulated candidate that fits, the Pareto
    frontier (nothing else is both faster and smaller) drawn through them, the winner marked;
    candidates simulated to the end that do not fit are hollow grey markers, on neither the
    frontier nor the winner (their numbers describe a run that cannot happen)."""
    from sim.export.output import atomic_write
    from sim.export.plots import _fig

    plt = _fig()
    t = result.table
    ok = t[t["status"] == STATUS_OK]
    unfit = t[(t["status"] == STATUS_DOES_NOT_FIT) & t["tokens_per_s_per_chip"].notna()]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if len(unfit):
        ax.scatter(unfit["hbm_peak_bytes"] / 1e9, unfit["tokens_per_s_per_chip"], s=14,
                   label=UNFIT_LABEL, **UNFIT_STYLE)
    if len(ok) or len(unfit):
        ax.axvline(_capacity_gb(result), color="#9a9a9a", lw=0.8, ls="--")
    if len(ok):
        gb = ok["hbm_peak_bytes"] / 1e9
        ax.scatter(gb, ok["tokens_per_s_per_chip"], s=14, color="#8da0cb", label="candidates")
        front = _pareto(list(zip(gb, ok["tokens_per_s_per_chip"], strict=True)))
        ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color="#e78ac3", ms=4,
                label="frontier (fastest for its memory)")
        b = ok.iloc[0]
        ax.scatter([b["hbm_peak_bytes"] / 1e9], [b["tokens_per_s_per_chip"]], marker="*",
                   s=160, color="#d62728", zorder=5, label=f"best: {b['mesh']} {b['remat']}")
    if len(ok) or len(unfit):
        ax.legend(fontsize=7)
    ax.set_xlabel("peak HBM per chip (GB; dashed: the chip's capacity)")
    ax.set_ylabel("tokens/s/chip")
    ax.set_title(f"plan: {result.model} on {result.pod}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = atomic_write(path, lambda q: fig.savefig(q, dpi=110, format="png"))
    plt.close(fig)
    return out


def _capacity_gb(result: PlanResult) -> float:
    return result.hbm_capacity_bytes / 1e9


def _pareto(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _list(text: str, flag: str, cast=str) -> tuple:
    """A comma list of the search space (`full,minimal`), each item once, in order."""
    if cast is int and not all(x.strip().isascii() for x in str(text).split(",")):
        raise TpusimError(f"{flag} {short_repr(text)} must list integers in ASCII digits, e.g. "
                          f"1,2,4")
    if not str(text).replace(",", "").strip():
        raise TpusimError(f"{flag} {short_repr(text)} lists nothing; give comma-separated values")
    items = split_list(text, flag, example="1,2,4" if cast is int else "")
    try:
        return tuple(dict.fromkeys(cast(x) for x in items))
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)} must list integers, e.g. 1,2,4") from None


def plan_config(req: PlanRequest) -> PlanConfig:
    """The search space of a plan request (its upper limits checked first: a 400-digit
    max_data is a typo, and an oversized global batch would otherwise be refused later under
    the name of the per-chip batch it implies)."""
    for flag, v, hi, what in (
            ("--seq-len", req.seq_len, MAX_TOKENS, "tokens per sequence"),
            ("--global-batch", req.global_batch, MAX_BATCH, "sequences per step"),
            *((f"--max-{a}", getattr(req, f"max_{a}"), MAX_CHIPS, "chips, more than any pod")
              for a in ("tensor", "data", "sequence", "pipeline", "expert"))):
        if v > hi:
            raise TpusimError(f"{flag} {short_repr(v)} is over the limit of {hi:,} ({what}); "
                              f"give a smaller value")
    return PlanConfig(
        seq_len=req.seq_len, global_batch=req.global_batch, top=req.top,
        axes=_list(req.axes, "--axes"), remat=_list(req.remat, "--remat"),
        microbatches=_list(req.microbatches, "--microbatches", int),
        param_dtypes=_list(req.param_dtype, "--param-dtype"),
        grad_dtypes=_list(req.grad_dtype, "--grad-dtype"),
        optimizer_dtypes=_list(req.optimizer_dtype, "--optimizer-dtype"),
        optimizer=req.optimizer, gather_dtype=req.gather_dtype,
        max_tensor=req.max_tensor, max_data=req.max_data, max_sequence=req.max_sequence,
        max_pipeline=req.max_pipeline, max_expert=req.max_expert,
        placements=not req.default_placement, objective=req.objective,
    )


def plan_summary(res: PlanResult, top: int) -> dict:
    """What `plan --json` prints and `summary.json` holds."""
    def clean(rec):
        return {k: (None if isinstance(v, float) and math.isnan(v) else
                    (None if v is None or str(v) == "<NA>" else v)) for k, v in rec.items()}

    return {
        "model": res.model, "pod": res.pod, "objective": res.objective,
        "best": clean(res.best) if res.best else None,
        "explanation": res.explanation,
        "top": [clean(r) for r in res.top(top).to_dict("records")],
        "searched": res.counts,
        "wall_s": res.wall_s,
    }


def search(req: PlanRequest, *, quiet: bool = False) -> tuple[PlanResult, PlanConfig]:
    """(PlanResult, PlanConfig) of a plan request: the CLI's `plan` and `sim.plan` both."""
    check_workers(req.workers)
    limit = req.max_simulations
    if limit is not None and not req.exhaustive:
        raise TpusimError(
            f"--max-simulations {limit} limits --exhaustive only (the default search simulates "
            f"just the candidates its bounds cannot rule out); add --exhaustive or drop "
            f"--max-simulations"
        )
    if limit is not None and limit < 1:
        raise TpusimError(f"--max-simulations {limit} must be a positive integer (the most "
                          f"candidates --exhaustive may simulate), e.g. 500")
    limit = EXHAUSTIVE_MAX_SIMULATIONS if limit is None else limit
    cfg = plan_config(req)
    if req.slices != 1:
        raise TpusimError(f"--slices {req.slices}: plan searches one slice; drop --slices")
    # Every candidate is this request's pod, model and overrides with its own settings.
    base = TrainRequest(chip=req.chip, slice=req.slice, shape=req.shape,
                        wraparound=req.wraparound, twist=req.twist, overrides=req.overrides,
                        model=req.model, chip_spec=req.chip_spec, model_spec=req.model_spec)
    pod = resolve_pod(base)
    model = resolve_model(base)[1]
    variants = pod_variants(req, pod)
    fast = not req.exhaustive
    res = run_plan(base, model, pod.topology, pod.chip, cfg, workers=req.workers,
                   dask=req.dask, quiet=quiet, prune_by_bound=fast, refuse_by_hbm_bound=fast,
                   stop_out_of_memory=fast, max_simulations=None if fast else limit,
                   variants=variants)
    return res, cfg


@api_call("sim.plan")
def plan(*, model: Any, seq_len: int, global_batch: int, chip: Any = None,
         slice: str | None = None, shape: str | None = None,  # noqa: A002 - the CLI's name
         wraparound: str | None = None, overrides: dict[str, Any] | None = None, top: int = 5,
         workers: int = 1, dask: Any = None, out: str | None = None, quiet: bool = False,
         progress: ProgressCallback | None = None, **space: Any) -> PlanResult:
    """`tpusim plan` from Python: the same search, the same result (`PlanResult`: `.table`
    ranked, `.best`, `.top(k)`, `.explanation`, `.counts`).

    Args:
        model: zoo name, model YAML path or `TransformerSpec`.
        chip, slice, shape, wraparound: the pod, as on the CLI (chip: name, YAML or `ChipSpec`).
        overrides: `{"ici_link_bytes_per_s": "x2", ...}`, as `--set`.
        workers, dask: where candidates run (dask: "local", an address or a `distributed.Client`).
        out: also write candidates.csv/parquet, summary.json and frontier.png there.
        progress: called with a `ProgressUpdate` as groups are bounded and candidates decided
            (task `plan`: the groups bounded, candidates simulated and left, the best step so
            far); `quiet` reports nothing even to an enclosing `reporting` block's callback.
        space: the search-space settings by their Python names, e.g. `axes=("fsdp", "tensor")`,
            `remat=("full",)`, `microbatches=(1, 2)`, `max_tensor=4`, `default_placement=True`.
    """
    from sim.export.output import check_output_dir, write_json, write_tables

    if overrides is not None and not isinstance(overrides, Mapping):
        raise TpusimError(
            f"sim.plan(overrides={short_repr(overrides)}): give a dict such as "
            f"{{'ici_link_bytes_per_s': 'x2'}}, not {type(overrides).__name__}")
    if out is not None:
        if not isinstance(out, (str, os.PathLike)):
            raise TpusimError(f"sim.plan(out={short_repr(out)}): give a directory path or None, "
                              f"not {type(out).__name__}")
        if out:
            check_output_dir(out)  # before the search, as `tpusim plan --out` does
    check_dask(dask)  # the dask argument's check, before the search
    settings: dict[str, Any] = {"model": model, "seq_len": seq_len,
                                "global_batch": global_batch, "top": top, "workers": workers,
                                "chip": chip, "slice": slice, "shape": shape,
                                "wraparound": wraparound, "overrides": dict(overrides or {})}
    for k, v in space.items():
        settings[k] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
    objects = {}
    if isinstance(model, TransformerSpec):
        objects["model_spec"], settings["model"] = model, model.name
    if isinstance(chip, ChipSpec):
        objects["chip_spec"], settings["chip"] = chip, chip.name
    req = PlanRequest.from_flags({k: v for k, v in settings.items() if v is not None},
                                 caller="sim.plan", **objects)
    if dask is not None:
        req = req.replace(dask=dask)
    if progress is None:
        res, cfg = search(req, quiet=quiet)
    else:
        with reporting(progress):
            res, cfg = search(req, quiet=quiet)
    if out:
        summary = plan_summary(res, cfg.top)
        write_tables(out, {"candidates": res.table}, summary)
        plot_frontier(res, Path(out) / "frontier.png")
        write_json(Path(out) / "summary.json", summary)
    return res


__all__ = [
    "plan",
    "PLAN_AXES",
    "PLAN_COLUMNS",
    "Candidate",
    "PlanConfig",
    "PlanResult",
    "enumerate_candidates",
    "explain",
    "EXHAUSTIVE_MAX_SIMULATIONS",
    "plot_frontier",
    "run_plan",
]
