"""The SPMD op/collective trace: one program that every chip of a mesh runs, and its file format.

An `Op` is either compute (FLOPs on the MXU or VPU plus HBM bytes, per chip), a collective over
logical mesh axes or over explicit device groups (V bytes per replica group, the textbook's
convention; `group` indexes `meta.device_groups`, each `{"groups": [[chip, ...], ...]}` or
`{"pairs": [[src, dst], ...]}` in the pod's chip ids, as HLO import writes), a host transfer over
PCIe, or an idle interval (a pipeline bubble). Ops name their dependencies explicitly; compute ops
run in program order on the chip's core, collectives and host transfers run asynchronously as
soon as their dependencies are done. `alloc_bytes`/`free_bytes` describe HBM occupancy.

File format (`.trace`, JSON): {"format": "tpusim-trace", "version": 3, "mesh": {...},
"meta": {...}, "columns": [...], "ops": [[...], ...]} — one row per op, columns named once.
Version 2 added the `group` column, version 3 `narrow_dim`; older files (without those
columns) still load, with the columns' defaults; any other column left out is an error.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import astuple, dataclass, field, fields
from typing import Any

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh
from topologies.validate import (
    MAX_TRACE_FILE_BYTES,
    MAX_TRACE_OPS,
    interval_text,
    one_of,
    range_text,
    short_repr,
)
from workloads.memory import MEMORY_CATEGORIES
from workloads.trace_meta import TraceKind, TraceMeta

# The collective kinds a trace may name (the values of `sim.collectives.CollectiveKind`; a test
# keeps the two equal, since workloads never import sim).
COLLECTIVE_NAMES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute", "send")
TRACE_FORMAT = "tpusim-trace"
TRACE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
# The op columns each format version added: a file of an older version lacks them (and they
# take their defaults); every other column must be there, as a column left out of a file of
# its own version is a damaged file (it replayed with zeros in it).
COLUMNS_ADDED_IN = {2: ("group",), 3: ("narrow_dim",)}


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
    group: int = -1  # collectives: index into meta.device_groups (-1: use mesh_axes)
    # MXU ops: the width of an operand dimension the MXU tiles (contraction or output) that can
    # be narrower than one systolic array, e.g. attention's head_dim; 0 = every dimension is
    # wide. The engine runs the op at `ChipSpec.mxu_fill(narrow_dim)` of the MXU peak.
    narrow_dim: int = 0


OP_COLUMNS = tuple(f.name for f in fields(Op))
_OP_SLOT_ACCESS = tuple((Op.__dict__[n].__get__, Op.__dict__[n].__set__) for n in OP_COLUMNS)
_OP_SLOT_SET = {n: Op.__dict__[n].__set__ for n in OP_COLUMNS}


def replace_op(op: Op, **changes: Any) -> Op:
    """`dataclasses.replace(op, **changes)` at a third of its cost (the builders replace an op
    each time they add to its memory events: 150,000 times in a 4,096-layer step); the same
    `Op`, field for field. Unknown field names raise TypeError, as `replace` does."""
    new = object.__new__(Op)
    for get, put in _OP_SLOT_ACCESS:
        put(new, get(op))
    for name, value in changes.items():
        put = _OP_SLOT_SET.get(name)
        if put is None:
            raise TypeError(f"Op has no field {name!r}")
        put(new, value)
    return new


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A validated SPMD program. Checks ids, backward dependencies and mesh axes on creation."""

    mesh: LogicalMesh
    ops: tuple[Op, ...]
    meta: TraceMeta = field(default_factory=TraceMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, TraceMeta):
            # A plain mapping (tests, hand-built programs) reads as a trace file's "meta" does.
            object.__setattr__(self, "meta", TraceMeta.from_dict(self.meta))
        names = {n for n, _ in self.mesh.axes} | {n for n, _ in self.mesh.dcn_axes}
        n_groups = len(self.meta.device_groups or ())
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
            "meta": self.meta.to_dict(),
            "columns": list(OP_COLUMNS),
            "ops": rows,
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=False)

    @staticmethod
    def from_json(text: str, *, source: str = "trace",
                  peered_sends: frozenset[int] = frozenset()) -> Trace:
        """Parse and validate a trace file's text (see the module docstring for the format).

        Every field is type- and range-checked (finite numbers, at most `MAX_TRACE_OPS` ops,
        bounded nesting and integers), so a corrupted or hostile file is one `TpusimError`.
        `peered_sends`: ids of sends whose peers the caller gives the engine (a Chakra set's
        pipeline sends and receives), which need no device group.
        """
        # deferred: start-up (topologies.yamlio loads PyYAML, which `tpusim collective`,
        # a trace's user that reads no file, never needs)
        from topologies.yamlio import RefusedInput, parse_json

        if len(text) > MAX_TRACE_FILE_BYTES:
            raise TpusimError(f"{source} is {len(text):,} characters, over the limit of "
                              f"{MAX_TRACE_FILE_BYTES:,}; a trace this large is too large to "
                              f"simulate")
        fix = "recompile it with `tpusim compile`"
        try:
            doc = parse_json(text)
        except json.JSONDecodeError as exc:
            raise TpusimError(
                f"{source} is not a tpusim trace: invalid JSON at line {exc.lineno} column "
                f"{exc.colno} (truncated or corrupted file?); {fix}"
            ) from None
        except RefusedInput as exc:
            raise TpusimError(f"{source} is not a valid tpusim trace: it holds {exc}; {fix}") \
                from None
        if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
            raise TpusimError(
                f"{source} is not a tpusim trace (missing \"format\": \"{TRACE_FORMAT}\"); "
                f"write one with `tpusim compile ... -o FILE`"
            )
        version = doc.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise TpusimError(
                f"{source} is trace format version {short_repr(version)}; this tpusim reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}; recompile it"
            )
        mesh = _mesh_from_doc(doc.get("mesh"), source)
        cols = doc.get("columns")
        # Columns come in any order; a column left out takes its default (version 1 files
        # have no `group`), but `id` and every name must be known and appear once.
        if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols) \
                or len(set(cols)) != len(cols) or not set(cols) <= set(OP_COLUMNS) \
                or "id" not in cols:
            unknown = sorted(str(c)[:40] for c in cols if c not in OP_COLUMNS) \
                if isinstance(cols, list) else []
            raise TpusimError(
                f"{source}: \"columns\" must name op columns from {', '.join(OP_COLUMNS)} once "
                f"each, including id"
                + (f" (unknown op columns {unknown[:5]})" if unknown else "") + f"; {fix}"
            )
        optional = {c for v, added in COLUMNS_ADDED_IN.items() if v > version for c in added}
        missing = [c for c in OP_COLUMNS if c not in cols and c not in optional]
        if missing:
            raise TpusimError(
                f"{source}: \"columns\" leaves out {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + f", which every version-{version} trace has (only columns a later version "
                f"added may be missing); the file is damaged: {fix}")
        rows = doc.get("ops")
        if not isinstance(rows, list) or not rows:
            raise TpusimError(f"{source}: \"ops\" must be a non-empty list of op rows; {fix}")
        if len(rows) > MAX_TRACE_OPS:
            raise TpusimError(f"{source} has {len(rows):,} ops, over the limit of "
                              f"{MAX_TRACE_OPS:,}; a program this large is too large to simulate")
        ops = [_op_from_row(i, r, cols, source) for i, r in enumerate(rows)]
        for op in ops:
            if op.kind == OpKind.COLLECTIVE and op.collective == "send" and op.group < 0 \
                    and op.id not in peered_sends:
                # A send needs its peer: the [src, dst] pairs of a device group (import-hlo),
                # or a pipeline schedule's stage programs (composed in memory, never written).
                # Without one it reached `tpusim collective`'s "--op send needs --src".
                raise TpusimError(
                    f"{source}: op {op.id} ({short_repr(op.name)}) is a send without a device "
                    f"group of [src, dst] pairs, so it has no peer; give it one (meta "
                    f"device_groups, as import-hlo writes) or recompile the trace")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise TpusimError(f"{source}: \"meta\" must be a JSON object")
        _check_meta(meta, source)
        stages = meta.get("pipeline_stages")
        if stages is not None and stages != mesh.size("pipeline"):
            raise TpusimError(
                f"{source}: meta says {stages} pipeline stages but the mesh has pipeline="
                f"{mesh.size('pipeline')}; recompile the trace with `tpusim compile`"
            )
        return Trace(mesh=mesh, ops=tuple(ops), meta=TraceMeta.from_dict(meta))


def _mesh_from_doc(mesh_d: Any, source: str) -> LogicalMesh:
    bad = TpusimError(
        f"{source}: \"mesh\" must be {{\"ici\": {{axis: size}}, \"dcn\": {{axis: size}}}} with "
        f"whole-number sizes; recompile it with `tpusim compile`"
    )
    if not isinstance(mesh_d, dict) or not isinstance(mesh_d.get("ici"), dict) \
            or not isinstance(mesh_d.get("dcn", {}), dict) \
            or not isinstance(mesh_d.get("placement", {}), dict):
        raise bad

    def sizes(d: dict) -> tuple[tuple[str, int], ...]:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in d.values()):
            raise bad
        return tuple(d.items())

    placement = []
    for n, fs in mesh_d.get("placement", {}).items():
        if not isinstance(fs, list) or not all(
                isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                and isinstance(f[1], int) and not isinstance(f[1], bool) for f in fs):
            raise bad
        placement.append((n, tuple((a, k) for a, k in fs)))
    return LogicalMesh(axes=sizes(mesh_d["ici"]), dcn_axes=sizes(mesh_d.get("dcn", {})),
                       placement=tuple(placement))


# A column a file leaves out takes the Op default (as JSON values, checked like given ones).
_COLUMN_DEFAULTS = {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
                    for f in fields(Op) if f.default is not dataclasses.MISSING}
# Type and range of every op column in a trace file: (types, low, high).
_STR_COLS = {"name": 200, "dtype": 16, "collective": 32, "phase": 32}
_NUM_COLS = ("flops", "hbm_bytes", "bytes", "duration_s", "alloc_bytes", "free_bytes")
# Per-op sizes above 1e24 (FLOPs or bytes) or durations above a day are not a real program;
# the bounds keep every simulated time finite and within the Perfetto clock.
_NUM_MAX = {"duration_s": 86400.0}
_NUM_MAX_DEFAULT = 1e24


def _op_from_row(i: int, r: Any, cols: list[str], source: str) -> Op:
    def fail(what: str) -> TpusimError:
        return TpusimError(f"{source}: op row {i} {what}; recompile the trace with "
                           f"`tpusim compile`")

    if not isinstance(r, list):
        raise fail(f"must be a list of {len(cols)} fields")
    if len(r) != len(cols):
        raise fail(f"has {len(r)} fields, expected {len(cols)}")
    d = {**_COLUMN_DEFAULTS, **dict(zip(cols, r, strict=True))}
    for col, limit in _STR_COLS.items():
        v = d[col]
        if not isinstance(v, str) or len(v) > limit:
            raise fail(f"has {col} = {short_repr(v)}; it must be text of at most {limit} "
                       f"characters")
    for col, enum_t in (("kind", OpKind), ("unit", Unit)):
        try:
            d[col] = enum_t(d[col]) if isinstance(d[col], str) else None
        except ValueError:
            d[col] = None
        if d[col] is None:
            given = r[cols.index(col)] if col in cols else None
            raise fail(f"has {col} = {short_repr(given)}; {one_of(given, list(enum_t))}")
    for col in ("id", "layer", "group"):
        v = d[col]
        if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v <= MAX_TRACE_OPS \
                * 1000:
            raise fail(f"has {col} = {short_repr(v)}; it must be a whole number")
    v = d["narrow_dim"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1_000_000:
        raise fail(f"has narrow_dim = {short_repr(v)}; it must be "
                   f"{range_text(0, 1_000_000, integer=True)} (0: no narrow matmul dimension)")
    for col in _NUM_COLS:
        v = d[col]
        hi = _NUM_MAX.get(col, _NUM_MAX_DEFAULT)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= hi:
            raise fail(f"has {col} = {short_repr(v)}; it must be {range_text(0, hi)}")
        d[col] = float(v)
    for col, what in (("mesh_axes", str), ("deps", int)):
        v = d[col]
        if not isinstance(v, list) or len(v) > 64 and col == "mesh_axes" or not all(
                isinstance(x, what) and not isinstance(x, bool) for x in v) or (
                col == "mesh_axes" and len(set(v)) < len(v)):
            # An axis named twice ("fsdp", "fsdp") was an internal error when the collective's
            # groups were built (overlapping axis factors).
            raise fail(f"has {col} = {short_repr(v)}; it must be a list of "
                       f"{'axis names, each once' if what is str else 'op ids'}")
        d[col] = tuple(v)
    if d["kind"] == OpKind.COLLECTIVE:
        if d["collective"] not in COLLECTIVE_NAMES:
            raise fail(f"is a collective of kind {short_repr(d['collective'])}; "
                       f"{one_of(d['collective'], COLLECTIVE_NAMES)}")
    return Op(**d)


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
    for key in ("kind", "model", "sharding"):
        if key in meta and (not isinstance(meta[key], str) or len(meta[key]) > 200):
            raise TpusimError(f"{source}: meta field {key!r} = {short_repr(meta[key])} must be "
                              f"text; recompile the trace with `tpusim compile`")
    for key in ("overlap", "fuse_elementwise", "moe_scenario_applied"):
        # Read as flags (a null "overlap" used to read as no overlap, and a missing one as
        # overlap).
        if key in meta and not isinstance(meta[key], bool):
            raise TpusimError(f"{source}: meta field {key!r} = {short_repr(meta[key])} must be "
                              f"true or false; recompile the trace with `tpusim compile`")
    if "kind" in meta and meta["kind"] not in list(TraceKind):
        raise TpusimError(f"{source}: meta field 'kind' = {short_repr(meta['kind'])}: "
                          f"{one_of(meta['kind'], list(TraceKind))}; recompile the trace with "
                          f"`tpusim compile`")
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
            and 0 <= v <= _NUM_MAX_DEFAULT
        if ok and key in _META_INTS:
            ok = float(v).is_integer() and (v >= 1 or key == "batch")
        if not ok:
            lo = 1 if key in _META_INTS and key != "batch" else 0
            raise TpusimError(
                f"{source}: meta field {key!r} = {short_repr(v)} is not a valid "
                f"{'count' if key in _META_INTS else 'number'} (give "
                f"{range_text(lo, _NUM_MAX_DEFAULT, integer=key in _META_INTS)}); recompile "
                f"the trace with `tpusim compile`"
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
    ev = meta.get("memory_events")
    if ev is not None and not (isinstance(ev, list) and all(
            isinstance(e, list) and len(e) == 3
            and isinstance(e[0], int) and not isinstance(e[0], bool) and e[0] >= 0
            and isinstance(e[1], str) and len(e[1]) <= 64
            and isinstance(e[2], (int, float)) and not isinstance(e[2], bool)
            and math.isfinite(e[2]) and abs(e[2]) <= _NUM_MAX_DEFAULT for e in ev)):
        # The engine reads each event as (op id, category, bytes); anything else used to be an
        # internal TypeError in sim/engine/replay.py.
        raise TpusimError(
            f"{source}: meta field 'memory_events' must be a list of [op id, category, bytes] "
            f"with bytes in {interval_text(-_NUM_MAX_DEFAULT, _NUM_MAX_DEFAULT)} (got "
            f"{short_repr(ev)}); recompile the trace with `tpusim compile`"
        )
    sc = meta.get("static_composition")
    if sc is not None:
        # The engine adds each part to its category's level (an int or an unknown category
        # here was an internal AttributeError / KeyError in sim/engine/replay.py).
        if not isinstance(sc, dict) or not all(
                k in MEMORY_CATEGORIES and isinstance(x, (int, float))
                and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= _NUM_MAX_DEFAULT
                for k, x in sc.items()):
            raise TpusimError(
                f"{source}: meta field 'static_composition' must map memory categories "
                f"({', '.join(MEMORY_CATEGORIES)}) to byte counts in "
                f"{interval_text(0, _NUM_MAX_DEFAULT)} (got "
                f"{short_repr(sc)}); recompile the trace with `tpusim compile`"
            )
    sb = meta.get("static_breakdown")
    if sb is not None and (not isinstance(sb, dict) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and 0 <= x <= _NUM_MAX_DEFAULT for x in sb.values())):
        raise TpusimError(
            f"{source}: meta field 'static_breakdown' must map names to numbers in "
            f"{interval_text(0, _NUM_MAX_DEFAULT)}"
        )


class TraceBuilder:
    """Appends ops with automatic ids; `add` returns the new op's id. Past `max_ops` ops (the
    most a program may hold, `MAX_TRACE_OPS`) it raises the one-line error that ends with
    `fix`, so no input builds an unbounded program before it is refused."""

    def __init__(self, *, max_ops: int = MAX_TRACE_OPS,
                 fix: str = "compile a smaller program",
                 fix_params: tuple[str, ...] = ()) -> None:
        self.ops: list[Op] = []
        self.max_ops = max_ops
        self.fix = fix
        self.fix_params = fix_params  # the settings `fix` names (TpusimError's placeholders)

    def add(self, name: str, **kw: Any) -> int:
        if len(self.ops) >= self.max_ops:
            raise TpusimError(f"the program compiles to more than {self.max_ops:,} ops, the most "
                              f"tpusim simulates in one program; {self.fix}",
                              *self.fix_params)
        deps = tuple(sorted({d for d in kw.pop("deps", ()) if d is not None and d >= 0}))
        op = Op(id=len(self.ops), name=name, deps=deps, **kw)
        self.ops.append(op)
        return op.id
