"""The plan's search space: every factorization of the slice into the logical axes (`data`,
`fsdp`, `pipeline`, `expert`, `sequence`, `tensor`, within the size caps of `PlanConfig`),
every distinct placement of those axes on the torus (jax's default order, and each axis moved
innermost, as far as `place_mesh` lays them out differently), every allowed remat policy and
dtype, and every allowed microbatch count whose compiler memory estimate (params, grads,
optimizer state and saved activations: a lower bound of the simulated HBM peak) fits; with
`shapes`, every slice shape of the pod's chip count, plain and twisted (`PodVariant`).
Candidates the compiler rejects or the torus cannot hold are dropped, those whose estimate
exceeds HBM are pruned without simulation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.runs.requests import PlanRequest
from sim.studies.plan_objectives import OBJECTIVES
from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh, place_mesh
from topologies.slices import CUBE_SIDE, can_twist, check_shape_fits, resolve_topology
from topologies.torus import parse_shape
from topologies.validate import (
    MAX_BATCH,
    MAX_CHIPS,
    MAX_PLAN_COMBINATIONS,
    MAX_TOKENS,
    one_of,
    short_repr,
    split_list,
)
from workloads.training import (
    TrainingConfig,
    check_stateless_optimizer,
    dtype_bytes,
    estimate_training_memory,
    parse_optimizer,
    parse_remat,
)

PLAN_AXES = ("data", "fsdp", "pipeline", "expert", "sequence", "tensor")


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
        for name in ("seq_len", "global_batch", "top", "max_tensor", "max_data", "max_sequence",
                     "max_pipeline", "max_expert"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise TpusimError(f"{{{name}}} {v!r} must be a positive integer", name)
        if self.objective not in OBJECTIVES:
            raise TpusimError(f"{{objective}} {short_repr(self.objective)} is not one of "
                              f"{', '.join(OBJECTIVES)}; give e.g. {{objective}} energy",
                              "objective")
        bad = [a for a in self.axes if a not in PLAN_AXES]
        if bad:
            raise TpusimError(
                f"{{axes}}: {short_repr(bad[0])} is not a mesh axis; {one_of(bad[0], PLAN_AXES)}",
                "axes"
            )
        if "fsdp" not in self.axes and "data" not in self.axes:
            raise TpusimError("{axes} must include fsdp or data (the batch has to be split)",
                              "axes")
        parse_optimizer(self.optimizer)
        if self.gather_dtype is not None:
            dtype_bytes(self.gather_dtype, "gather_dtype")

        if not self.remat:
            raise TpusimError("{remat} lists no policy; give e.g. full,minimal", "remat")
        for r in self.remat:
            if parse_remat(r) == "custom":
                raise TpusimError("{remat} custom names its tensors with {remat_save} and "
                                  "{remat_offload}, which plan does not take; list named "
                                  "policies (e.g. save_dot_except_mlpwi) or run train",
                                  "remat", "remat_save", "remat_offload")
        if not self.microbatches or any(not isinstance(m, int) or m < 1
                                        for m in self.microbatches):
            raise TpusimError(
                f"{{microbatches}} {self.microbatches!r} must list positive integers, e.g. 1,2,4",
                "microbatches"
            )
        for name, vals in (("param_dtype", self.param_dtypes),
                           ("grad_dtype", self.grad_dtypes),
                           ("optimizer_dtype", self.optimizer_dtypes)):
            if not vals:
                raise TpusimError(f"{{{name}}} lists no dtype; give e.g. bf16", name)
            for v in vals:
                dtype_bytes(v, name)
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
    twisted (`wiring` auto; `plain` or `twisted` alone; the pod's `twist` is `twisted`).
    A single plain or twisted pod as given is the plan's own (no pod column)."""
    chip, topo = pod.chip, pod.topology
    wiring = req.wiring
    if wiring not in WIRINGS:
        raise TpusimError(f"{{wiring}} {short_repr(wiring)} is not one of {', '.join(WIRINGS)}; "
                          f"give e.g. {{wiring}} auto", "wiring")
    if req.twist:
        if wiring == "plain":
            raise TpusimError("{twist} asks for the twisted wiring and {wiring} plain for the "
                              "plain one; drop one of them", "twist", "wiring")
        wiring = "twisted"
    if req.shapes is None:
        shapes, searched = [topo.shape], False
    elif str(req.shapes).strip().lower() == "all":
        shapes, searched = slice_shapes(chip, topo.num_chips), True
        if not shapes:
            raise TpusimError(
                f"{{shapes}} all: a {chip.name} pod builds no slice of {topo.num_chips:,} chips "
                f"(whole 4x4x4 cubes, or a shape inside one cube); give a chip count it can "
                f"build, e.g. 64 or 128, or drop {{shapes}}", "shapes")
    else:
        shapes = [parse_shape(x) for x in split_list(req.shapes, "shapes",
                                                     example="4x4x16,4x8x8")]
        shapes, searched = list(dict.fromkeys(shapes)), True
        for sh in shapes:
            if math.prod(sh) != topo.num_chips:
                raise TpusimError(
                    f"{{shapes}}: {'x'.join(map(str, sh))} has {math.prod(sh):,} chips, not the "
                    f"pod's {topo.num_chips:,}; list shapes of {topo.num_chips:,} chips (or "
                    f"{{shapes}} all)", "shapes")
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
            f"{{wiring}} twisted: no shape of {topo.num_chips:,} chips can twist (k x k x 2k or "
            f"k x 2k x 2k, each side a multiple of 4); drop {{wiring}}/{{twist}} or give a chip "
            f"count such as 128 (4x4x8)", "wiring", "twist")
    if not searched and len(out) == 1:
        return [PodVariant(topology=out[0].topology)]  # the pod as given: no pod column
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def size_options(model, num_chips: int, cfg: PlanConfig) -> dict[str, list[int]]:
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


def check_space_size(model, num_chips: int, cfg: PlanConfig, n_slices: int) -> None:
    """Refuse a search over `n_slices` slices whose combinations of slices, axis sizes and
    settings are over MAX_PLAN_COMBINATIONS, before any slice is enumerated."""
    opts = size_options(model, num_chips, cfg)
    combos = math.prod(len(v) for v in opts.values()) * len(cfg.remat) \
        * len(cfg.param_dtypes) * len(cfg.grad_dtypes) * len(cfg.optimizer_dtypes) \
        * n_slices
    if combos > MAX_PLAN_COMBINATIONS:
        raise TpusimError(
            f"plan would consider {combos:,} combinations of slices, axis sizes and "
            f"settings ({n_slices} slices), over the limit of "
            f"{MAX_PLAN_COMBINATIONS:,}; list fewer {{shapes}}, give {{wiring}} plain, lower "
            f"the {{max_*}} limits or allow fewer {{remat}} and dtype values",
            "shapes", "wiring", "max_*", "remat")  # max_*: every max_<axis> setting


def enumerate_candidates(model, topology, chip, cfg: PlanConfig,
                         variant: PodVariant | None = None) -> tuple[list[Candidate],
                                                                     dict[str, int]]:
    """Every valid candidate of the search space whose memory estimate fits in HBM, in a
    deterministic order; and how many were generated, invalid and pruned by memory.
    `variant`: the searched slice the candidates run on (tagged with its shape and wiring)."""
    n = topology.num_chips
    if topology.num_slices != 1:
        raise TpusimError("plan searches one slice; drop {slices} (multi-slice is not searched)",
                          "slices")
    opts = size_options(model, n, cfg)
    combos = math.prod(len(v) for v in opts.values()) * len(cfg.remat) * len(cfg.param_dtypes) \
        * len(cfg.grad_dtypes) * len(cfg.optimizer_dtypes)
    if combos > MAX_PLAN_COMBINATIONS:
        raise TpusimError(
            f"plan would consider {combos:,} combinations of axis sizes and settings, over the "
            f"limit of {MAX_PLAN_COMBINATIONS:,}; lower {{max_data}}/{{max_tensor}}/"
            f"{{max_pipeline}}/{{max_expert}} or allow fewer {{remat}} and dtype values",
            "max_data", "max_tensor", "max_pipeline", "max_expert", "remat"
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


def _list(text: str, name: str, cast=str) -> tuple:
    """A comma list of the search space (`full,minimal`) given as setting `name` (its Python
    name), each item once, in order."""
    flag = "{" + name + "}"
    if cast is int and not all(x.strip().isascii() for x in str(text).split(",")):
        raise TpusimError(f"{flag} {short_repr(text)} must list integers in ASCII digits, e.g. "
                          f"1,2,4", name)
    if not str(text).replace(",", "").strip():
        raise TpusimError(f"{flag} {short_repr(text)} lists nothing; give comma-separated values",
                          name)
    items = split_list(text, name, example="1,2,4" if cast is int else "")
    try:
        return tuple(dict.fromkeys(cast(x) for x in items))
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)} must list integers, e.g. 1,2,4",
                          name) from None


def plan_config(req: PlanRequest) -> PlanConfig:
    """The search space of a plan request (its upper limits checked first: a 400-digit
    max_data is a typo, and an oversized global batch would otherwise be refused later under
    the name of the per-chip batch it implies)."""
    for name, v, hi, what in (
            ("seq_len", req.seq_len, MAX_TOKENS, "tokens per sequence"),
            ("global_batch", req.global_batch, MAX_BATCH, "sequences per step"),
            *((f"max_{a}", getattr(req, f"max_{a}"), MAX_CHIPS, "chips, more than any pod")
              for a in ("tensor", "data", "sequence", "pipeline", "expert"))):
        if v > hi:
            raise TpusimError(f"{{{name}}} {short_repr(v)} is over the limit of {hi:,} "
                              f"({what}); give a smaller value", name)
    return PlanConfig(
        seq_len=req.seq_len, global_batch=req.global_batch, top=req.top,
        axes=_list(req.axes, "axes"), remat=_list(req.remat, "remat"),
        microbatches=_list(req.microbatches, "microbatches", int),
        param_dtypes=_list(req.param_dtype, "param_dtype"),
        grad_dtypes=_list(req.grad_dtype, "grad_dtype"),
        optimizer_dtypes=_list(req.optimizer_dtype, "optimizer_dtype"),
        optimizer=req.optimizer, gather_dtype=req.gather_dtype,
        max_tensor=req.max_tensor, max_data=req.max_data, max_sequence=req.max_sequence,
        max_pipeline=req.max_pipeline, max_expert=req.max_expert,
        placements=not req.default_placement, objective=req.objective,
    )

