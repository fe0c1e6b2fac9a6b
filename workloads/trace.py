"""The SPMD op/collective trace: one program that every chip of a mesh runs, and its file format.

An `Op` is either compute (FLOPs on the MXU or VPU plus HBM bytes, per chip), a collective over
logical mesh axes or over explicit device groups (V bytes per replica group, the textbook's
convention; `group` indexes `meta["device_groups"]`, each `{"groups": [[chip, ...], ...]}` or
`{"pairs": [[src, dst], ...]}` in the pod's chip ids, as HLO import writes), a host transfer over
PCIe, or an idle interval (a pipeline bubble). Ops name their dependencies explicitly; compute ops
run in program order on the chip's core, collectives and host transfers run asynchronously as
soon as their dependencies are done. `alloc_bytes`/`free_bytes` describe HBM occupancy.

File format (`.trace`, JSON): {"format": "tpusim-trace", "version": 2, "mesh": {...},
"meta": {...}, "columns": [...], "ops": [[...], ...]} — one row per op, columns named once.
Version 2 added the `group` column; version 1 files (no such column) still load.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import astuple, dataclass, field, fields
from typing import Any

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh

TRACE_FORMAT = "tpusim-trace"
TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)


class OpKind(enum.StrEnum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    HOST = "host"  # PCIe transfer between HBM and host memory
    IDLE = "idle"  # time the chip waits by construction (pipeline bubble)


class Unit(enum.StrEnum):
    MXU = "mxu"
    VPU = "vpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One op of the SPMD program (per-chip quantities)."""

    id: int
    name: str
    kind: OpKind = OpKind.COMPUTE
    unit: Unit = Unit.VPU
    flops: float = 0.0
    hbm_bytes: float = 0.0
    dtype: str = "bf16"
    collective: str = ""
    mesh_axes: tuple[str, ...] = ()
    bytes: float = 0.0  # collectives: V per replica group; host: PCIe bytes; idle: 0
    duration_s: float = 0.0  # idle ops only
    deps: tuple[int, ...] = ()
    layer: int = -1
    phase: str = ""
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    group: int = -1  # collectives: index into meta["device_groups"] (-1: use mesh_axes)


OP_COLUMNS = tuple(f.name for f in fields(Op))


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A validated SPMD program. Checks ids, backward dependencies and mesh axes on creation."""

    mesh: LogicalMesh
    ops: tuple[Op, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = {n for n, _ in self.mesh.axes} | {n for n, _ in self.mesh.dcn_axes}
        n_groups = len(self.meta.get("device_groups", ()))
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise TpusimError(
                    f"trace op #{i} has id {op.id}; ids must be 0, 1, 2, ... in order"
                )
            for d in op.deps:
                if not 0 <= d < i:
                    raise TpusimError(
                        f"trace op {i} ({op.name}) depends on {d}, which is not an earlier op; "
                        f"dependencies must point backwards"
                    )
            for fname in ("flops", "hbm_bytes", "bytes", "duration_s", "alloc_bytes",
                          "free_bytes"):
                v = getattr(op, fname)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or v < 0:
                    kind = "negative size" if isinstance(v, (int, float)) and v < 0 else \
                        "non-finite or non-numeric size"
                    raise TpusimError(
                        f"trace op {i} ({op.name}) has a {kind}: {fname} = {v!r}; sizes must be "
                        f"finite numbers >= 0"
                    )
            if op.kind == OpKind.COLLECTIVE and op.group >= 0:
                if op.group >= n_groups:
                    raise TpusimError(
                        f"trace op {i} ({op.name}) uses device group {op.group}, but meta lists "
                        f"{n_groups} device group(s)"
                    )
            elif op.kind == OpKind.COLLECTIVE:
                bad = [a for a in op.mesh_axes if a not in names]
                if bad or not op.mesh_axes:
                    raise TpusimError(
                        f"trace op {i} ({op.name}) is a collective over {op.mesh_axes}, but the "
                        f"mesh has axes {sorted(names)}"
                    )

    # -- file format ------------------------------------------------------------------------
    def to_json(self) -> str:
        rows = []
        for op in self.ops:
            row = list(astuple(op))
            rows.append([list(v) if isinstance(v, tuple) else v for v in row])
        doc = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "mesh": self.mesh.to_dict(),
            "meta": self.meta,
            "columns": list(OP_COLUMNS),
            "ops": rows,
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=False)

    @staticmethod
    def from_json(text: str, *, source: str = "trace") -> Trace:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TpusimError(
                f"{source} is not a tpusim trace: invalid JSON at line {exc.lineno} column "
                f"{exc.colno} (truncated or corrupted file?); recompile it with `tpusim compile`"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
            raise TpusimError(
                f"{source} is not a tpusim trace (missing \"format\": \"{TRACE_FORMAT}\"); "
                f"write one with `tpusim compile ... -o FILE`"
            )
        if doc.get("version") not in READABLE_VERSIONS:
            raise TpusimError(
                f"{source} is trace format version {doc.get('version')!r}; this tpusim reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}; recompile it"
            )
        try:
            cols = doc["columns"]
            mesh_d = doc["mesh"]
            mesh = LogicalMesh(
                axes=tuple((str(k), int(v)) for k, v in mesh_d["ici"].items()),
                dcn_axes=tuple((str(k), int(v)) for k, v in mesh_d["dcn"].items()),
                placement=tuple(
                    (str(n), tuple((str(a), int(k)) for a, k in fs))
                    for n, fs in mesh_d.get("placement", {}).items()
                ),
            )
            ops = []
            for r in doc["ops"]:
                if not set(cols) <= set(OP_COLUMNS) or "id" not in cols:
                    raise TpusimError(
                        f"{source} is a malformed tpusim trace (unknown op columns "
                        f"{sorted(set(cols) - set(OP_COLUMNS))}); recompile it"
                    )
                if len(r) != len(cols):
                    raise TpusimError(
                        f"{source}: op row {len(ops)} has {len(r)} fields, expected {len(cols)}"
                    )
                d = dict(zip(cols, r, strict=True))
                d["kind"] = OpKind(d["kind"])
                d["unit"] = Unit(d["unit"])
                d["mesh_axes"] = tuple(d["mesh_axes"])
                d["deps"] = tuple(int(x) for x in d["deps"])
                for fname in ("flops", "hbm_bytes", "bytes", "duration_s", "alloc_bytes",
                              "free_bytes"):
                    d[fname] = float(d[fname])
                for fname in ("id", "layer", "group"):
                    d[fname] = int(d.get(fname, -1))
                ops.append(Op(**d))
            meta = doc.get("meta", {})
            if not isinstance(meta, dict):
                raise TpusimError(f"{source}: \"meta\" must be a JSON object")
            _check_meta(meta, source)
        except TpusimError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TpusimError(
                f"{source} is a malformed tpusim trace ({type(exc).__name__}: {exc}); recompile "
                f"it with `tpusim compile`"
            ) from None
        stages = meta.get("pipeline_stages")
        if stages is not None and stages != mesh.size("pipeline"):
            raise TpusimError(
                f"{source}: meta says {stages} pipeline stages but the mesh has pipeline="
                f"{mesh.size('pipeline')}; recompile the trace with `tpusim compile`"
            )
        return Trace(mesh=mesh, ops=tuple(ops), meta=dict(meta))


# Numeric meta fields the engine and the CLI read; integers where they count things.
_META_INTS = ("pipeline_stages", "microbatches", "num_chips", "global_sequences", "seq_len",
              "batch", "context_len")
_META_NUMBERS = ("static_hbm_bytes", "model_flops_per_chip", "maxtext_flops_per_chip",
                 "tokens_per_step", "activation_bytes_estimate", "logits_bytes",
                 "params_per_chip", "batch_per_chip", "weights_bytes", "kv_cache_bytes")


_TRAINING_REQUIRED = ("model", "tokens_per_step", "num_chips", "model_flops_per_chip",
                      "maxtext_flops_per_chip", "static_hbm_bytes", "static_breakdown",
                      "activation_bytes_estimate")


def _check_meta(meta: dict, source: str) -> None:
    if meta.get("kind") == "training":
        missing = [k for k in _TRAINING_REQUIRED if k not in meta]
        if missing:
            raise TpusimError(
                f"{source}: a training trace's meta lacks {', '.join(missing)}; recompile the "
                f"trace with `tpusim compile`"
            )
        sb = meta["static_breakdown"]
        if not isinstance(sb, dict) or not {"params", "grads", "optimizer"} <= set(sb):
            raise TpusimError(
                f"{source}: meta field 'static_breakdown' must give params, grads and optimizer"
            )
    for key in _META_INTS + _META_NUMBERS:
        if key not in meta:
            continue
        v = meta[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and v >= 0
        if ok and key in _META_INTS:
            ok = float(v).is_integer() and (v >= 1 or key == "batch")
        if not ok:
            raise TpusimError(
                f"{source}: meta field {key!r} = {v!r} is not a valid "
                f"{'count' if key in _META_INTS else 'number'}; recompile the trace with "
                f"`tpusim compile`"
            )
    dg = meta.get("device_groups")
    if dg is not None:
        def ints(xs) -> bool:
            return isinstance(xs, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)

        ok = isinstance(dg, list) and all(
            isinstance(g, dict) and len(g) == 1 and (
                ("groups" in g and isinstance(g["groups"], list) and g["groups"]
                 and all(ints(m) and m for m in g["groups"]))
                or ("pairs" in g and isinstance(g["pairs"], list)
                    and all(ints(p) and len(p) == 2 for p in g["pairs"])))
            for g in dg)
        if not ok:
            raise TpusimError(
                f"{source}: meta field 'device_groups' must be a list of {{\"groups\": [[chip, "
                f"...], ...]}} or {{\"pairs\": [[src, dst], ...]}}; re-import the program with "
                f"`tpusim import-hlo -o`"
            )
    sb = meta.get("static_breakdown")
    if sb is not None and (not isinstance(sb, dict) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x >= 0 for x in sb.values())):
        raise TpusimError(
            f"{source}: meta field 'static_breakdown' must map names to finite numbers >= 0"
        )


class TraceBuilder:
    """Appends ops with automatic ids; `add` returns the new op's id."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def add(self, name: str, **kw: Any) -> int:
        deps = tuple(sorted({d for d in kw.pop("deps", ()) if d is not None and d >= 0}))
        op = Op(id=len(self.ops), name=name, deps=deps, **kw)
        self.ops.append(op)
        return op.id
