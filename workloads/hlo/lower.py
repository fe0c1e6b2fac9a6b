"""Lowering a parsed `HloModule` to a tpusim `Trace` (one SPMD program, per-chip quantities) and
an inventory of what it executes.

What becomes what (docs/hlo.md has the full table and the reasons):
* `fusion`, `dot`, `convolution`, custom calls and elementwise/data-movement instructions become
  compute ops. MXU FLOPs are 2*M*N*K per batch from the dot dimension numbers (a convolution:
  2 x output elements x kernel elements per output feature; XLA's TPU backend writes most
  matmuls as convolutions). VPU FLOPs count one per output element of each elementwise
  instruction (and one per input element of a reduce). HBM bytes: a fusion reads its parameters
  and writes its result once; a parameter only sliced inside the fusion is read as the slice,
  and an in-place dynamic-update-slice writes only the update.
* Collectives (`all-gather`, `reduce-scatter`, `all-reduce`, `all-to-all`, `collective-permute`,
  their `-start`/`-done` pairs, `async-start` wrappers and TPU async collective fusions) become
  collective ops over explicit device groups (`meta["device_groups"]`); bytes follow the
  textbook's V convention. An async start's consumers do not wait for the transfer, its done's
  consumers do: that is the overlap.
* `while` loops are unrolled by their trip count (`known_trip_count`, else the induction variable
  compared against a constant), `conditional` takes its most expensive branch, `call` is inlined.
* Scalars, tuples, bitcasts and XLA's memory-space moves (`copy-start`/`slice-start` between HBM
  and on-chip memory) cost nothing here: the compute op that reads the data pays its HBM bytes.

Only topology is needed (to check that replica groups fit the pod and to map partitions to
chips); `sim/` is never imported.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from topologies.errors import TpusimError
from topologies.groups import factor_device_groups, route_pairs
from topologies.mesh import LogicalMesh
from topologies.progress import NO_TASK, task
from topologies.torus import AXIS_NAMES, Topology
from topologies.validate import MAX_TRACE_OPS
from workloads.hlo.parser import (
    Computation,
    HloModule,
    Instruction,
    Shape,
    backend_config,
    dot_dims,
    int_list,
    parse_hlo,
    replica_groups,
    source_target_pairs,
)
from workloads.trace import OpKind, Trace, TraceBuilder, Unit

# Unrolled trace ops: the most a program may hold, as for a trace file (a 2 MB 8-layer train
# step unrolls to ~20k). It was 2,000,000: a 16-instruction loop of trip count 1.9 M unrolled
# in ~35 CPU-s to a program that would take ~3 GB to replay, and `import-hlo -o` wrote traces
# over the limit that `replay` then refused.
MAX_OPS = MAX_TRACE_OPS
MAX_CALL_DEPTH = 64
# Instructions the lowering may visit (each while body once per trip): a loop whose body
# emits no op never reached MAX_OPS, so `known_trip_count` 10^12 over an empty body looped
# forever. Real modules visit a few times their unrolled op count (the 8-layer train step:
# ~60k visits for ~20k ops); a visit is ~5 us, so this bounds the walk to seconds.
MAX_VISITS = 4 * MAX_OPS

COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "all-gather",
}
DONES = {"all-gather-done", "all-reduce-done", "collective-permute-done", "async-done"}
# Values flow through these unchanged and they cost nothing (see module docstring).
ALIASES = {
    "bitcast", "copy-start", "copy-done", "slice-start", "slice-done", "opt-barrier",
    "add-dependency", "domain", "get-dimension-size", "set-dimension-size", "async-update",
    "optimization-barrier", "reshape-mover",
}
FREE = {"constant", "iota", "partition-id", "replica-id", "after-all", "rng-get-and-update-state"}
ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder", "atan2",
    "and", "or", "xor", "not", "negate", "abs", "sign", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "exponential", "exponential-minus-one", "log", "log-plus-one",
    "logistic", "tanh", "tan", "sine", "cosine", "sqrt", "rsqrt", "cbrt", "erf", "is-finite",
    "compare", "select", "clamp", "convert", "bitcast-convert", "reduce-precision",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "popcnt",
    "count-leading-zeros", "clz", "real", "imag", "complex", "stochastic-convert", "map",
}
MOVEMENT = {
    "broadcast", "reshape", "transpose", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "copy", "gather", "scatter", "reverse", "sort", "reduce",
    "reduce-window", "select-and-scatter", "rng", "rng-bit-generator", "fft", "cholesky",
    "triangular-solve", "batch-norm-training", "batch-norm-inference", "batch-norm-grad", "topk",
}
MXU_OPS = {"dot", "convolution"}
# A dot or convolution whose two operands are both of these element types runs at the MXU's
# int8 (or fp8) rate (`Op.dtype`; AQT's int8 training compiles its weight matmuls to
# s8 x s8 -> s32 dots: validation/xla_int8.py); any other pair at the bf16 rate.
_INT8_TYPES = frozenset({"s8", "u8"})
_FP8_TYPES = frozenset({"f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3b11fnuz", "f8e4m3fnuz",
                        "f8e5m2fnuz", "f8e3m4"})
# Custom calls that only annotate or reinterpret buffers.
FREE_CUSTOM_CALLS = {
    "AllocateBuffer", "AssumeGatherIndicesInBound", "Sharding", "SPMDFullToShardShape",
    "SPMDShardToFullShape", "ConcatBitcast", "GatherScatterIndicesBitpacked",
    "AsyncCollectiveStart", "AsyncCollectiveDone", "MoveToHost", "MoveToDevice",
    "annotate_device_placement", "LayoutConstraint",
}
SKIPPED = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}

# The whole line after `=`: a comment whose coordinates do not parse (`1,-1`) used to be
# ignored, replaying the module on the default assignment instead of the one it names.
_PARTITION_COORDS_RE = re.compile(r"^// tpusim: partition_coords=(.*)$", re.M)

Value = Any  # frozenset[int] (trace ops this value waits for) or a tuple of Values


@dataclass(kw_only=True)
class HloImport:
    """A lowered module: the trace, its inventory and the warnings (things skipped or
    approximated)."""

    trace: Trace
    inventory: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def read_partition_coords(text: str) -> list[tuple[int, ...]] | None:
    """The `// tpusim: partition_coords=...` comment that benchmarks/make_hlo_fixtures.py
    writes (XLA's device assignment, which `compiled.as_text()` does not print)."""
    m = _PARTITION_COORDS_RE.search(text[:1 << 16])
    if not m:
        return None
    text = m.group(1).strip()
    if not re.fullmatch(r"-?\d{1,9}(?:,-?\d{1,9})*(?: +-?\d{1,9}(?:,-?\d{1,9})*)*", text):
        raise TpusimError(
            f"the `// tpusim: partition_coords=` comment {text[:60]!r} is not a list of "
            f"chip coordinates such as 0,0 1,0; fix or delete that line")
    try:
        return [tuple(int(v) for v in c.split(",")) for c in text.split()]
    except ValueError:
        raise TpusimError(
            f"the `// tpusim: partition_coords=` comment {m.group(1)[:60]!r} is not a list of "
            f"chip coordinates such as 0,0 1,0; fix or delete that line"
        ) from None


_ENTRY_RE = re.compile(r"(?m)^ENTRY\b[^\n]*\{[ \t]*$")
_ENTRY_INS_RE = re.compile(
    r"(?m)^[ \t]*(?:ROOT[ \t]+)?%?[\w.\-]+[ \t]*=[ \t]*[a-z0-9]+\[([\d,]*)\]\S*[ \t]+"
    r"([a-z][\w\-]*)\(")


def entry_ops_lower_bound(text: str) -> int:
    """Trace ops the ENTRY computation's text alone is sure to lower to: its array-valued
    (more than one element) element-wise, data-movement and matmul instructions, each of which
    runs once and becomes one compute op. Read with two regular expressions before the parse,
    so a module too large to simulate is refused in well under a second (parsing 300,000
    instructions takes ~18 CPU-s, and lowering them ran to the op cap before refusing)."""
    m = _ENTRY_RE.search(text)
    if not m:
        return 0
    end = text.find("\n}", m.end())
    body = text[m.end():end if end >= 0 else len(text)]
    emitting = ELEMENTWISE | MOVEMENT | MXU_OPS
    n = 0
    for dims, opcode in _ENTRY_INS_RE.findall(body):
        if opcode in emitting and any(d.strip() not in ("", "0", "1") for d in
                                      dims.split(",")):
            n += 1
    return n


def import_hlo(text: str, *, topology: Topology, source: str = "HLO module") -> HloImport:
    """Parse and lower HLO text for `topology` (see the module docstring)."""
    sure = entry_ops_lower_bound(text)
    if sure > MAX_OPS:
        raise TpusimError(
            f"{source}: its ENTRY computation alone lowers to at least {sure:,} trace ops, over "
            f"the limit of {MAX_OPS:,} tpusim simulates in one program; simulate fewer layers "
            f"or steps (or a scanned model)")
    module = parse_hlo(text, source=source)
    return lower_module(module, topology=topology, source=source,
                        partition_coords=read_partition_coords(text))


def lower_module(module: HloModule, *, topology: Topology, source: str = "HLO module",
                 partition_coords: list[tuple[int, ...]] | None = None) -> HloImport:
    return _Lowerer(module, topology, source, partition_coords).run()


def _window(text: str, n: int) -> dict[str, list]:
    """`{size=4x2 stride=3x1 pad=0_0x1_1 lhs_dilate=4x1}` -> per-spatial-dim lists."""
    out: dict[str, list] = {"size": [1] * n, "stride": [1] * n, "pad": [(0, 0)] * n,
                            "lhs_dilate": [1] * n, "rhs_dilate": [1] * n}
    for key, val in re.findall(r"(\w+)=([\w\-]+)", text):
        parts = val.split("x")
        if len(parts) != n:
            continue
        if key == "pad":
            out["pad"] = [tuple(int(v) for v in p.split("_")) for p in parts]
        elif key in out:
            out[key] = [int(v) for v in parts]
    return out


def conv_flops(lhs: Shape, rhs: Shape, out: Shape, dim_labels: str, window: str) -> float:
    """2 x batch x output features x input features per group x, per spatial dimension, the
    (output, kernel) position pairs that land on a real input element (not padding, not a hole
    of lhs dilation). XLA's TPU backend writes matmuls and attention einsums as convolutions,
    some with dilated windows that select one tap per output: counting window taps instead
    would overstate them several times."""
    m = re.fullmatch(r"([^_]+)_([^-]+)->(.+)", dim_labels.strip())
    if not m or lhs.is_tuple or rhs.is_tuple or out.is_tuple:
        return 2.0 * out.num_elements * (rhs.num_elements / max(rhs.dims[-1], 1)
                                         if rhs.dims else 1)
    ll, rl, ol = m.groups()
    if len(ll) != len(lhs.dims) or len(rl) != len(rhs.dims) or len(ol) != len(out.dims):
        return 2.0 * out.num_elements
    spatial = sorted(c for c in rl if c.isdigit())
    w = _window(window.strip("{}"), len(spatial))
    total = 2.0 * out.dims[ol.index("b")] * out.dims[ol.index("f")] * rhs.dims[rl.index("i")]
    for k, c in enumerate(spatial):
        n_in = lhs.dims[ll.index(c)]
        n_k = rhs.dims[rl.index(c)]
        n_out = out.dims[ol.index(c)]
        stride, (pad_lo, _pad_hi) = w["stride"][k], w["pad"][k]
        ld, rd = w["lhs_dilate"][k], w["rhs_dilate"][k]
        span = (n_in - 1) * ld + 1
        valid = 0
        for o in range(n_out):
            for t in range(n_k):
                p = o * stride + t * rd - pad_lo
                if 0 <= p < span and p % ld == 0:
                    valid += 1
        total *= valid
    return total


def _whole(text: Any, ins: Instruction) -> int:
    """A parameter number or tuple index of `ins` as an int (one-line error if the text was
    edited into something else)."""
    t = str(text).strip()
    if not (t.lstrip("-").isdigit() and t.isascii() and len(t) <= 18):
        raise TpusimError(
            f"HLO instruction %{ins.name} ({ins.opcode}) has the index {t[:40]!r}, not a whole "
            f"number; give unedited compiled.as_text() output"
        )
    return int(t)


def _flatten(v: Value) -> frozenset[int]:
    if isinstance(v, frozenset):
        return v
    out: set[int] = set()
    for e in v:
        out |= _flatten(e)
    return frozenset(out)


def _num_devices(module: HloModule) -> int:
    return module.num_partitions * module.replica_count


class _Lowerer:
    def __init__(self, module: HloModule, topology: Topology, source: str,
                 partition_coords: list[tuple[int, ...]] | None) -> None:
        self.m = module
        self.topo = topology
        self.source = source
        self.b = TraceBuilder(max_ops=MAX_OPS)  # checked with its own message below
        self.task = NO_TASK  # the progress of `run()`
        self.is_coll: list[bool] = []
        self.warnings: list[str] = []
        self.unknown: Counter = Counter()
        self.device_groups: list[dict] = []
        self._group_index: dict[tuple, int] = {}
        self._group_axes: dict[int, tuple[str, bool]] = {}
        self.open_channels: dict[str, int] = {}
        self.loops: list[dict] = []
        self._loop_seen: set[str] = set()
        self._comp_flops: dict[str, tuple[float, float]] = {}
        self._comp_dtype: dict[str, str] = {}
        self._comp_colls: dict[str, list[Instruction]] = {}
        self.n_dev = _num_devices(module)
        if self.n_dev > topology.num_chips:
            raise TpusimError(
                f"{source} was compiled for {self.n_dev} devices but the {topology.name} pod has "
                f"{topology.num_chips} chips; give the pod it was compiled for (--shape)")
        if self.n_dev < topology.num_chips:
            raise TpusimError(
                f"{source} was compiled for {self.n_dev} devices but the {topology.name} pod has "
                f"{topology.num_chips} chips; replay it on a {self.n_dev}-chip pod")
        self.chip_of = self._assignment(partition_coords)

    # -- device assignment ------------------------------------------------------------------
    def _assignment(self, coords: list[tuple[int, ...]] | None) -> list[int]:
        topo = self.topo
        if coords is None:
            # XLA's default device assignment with jax's TPU device ids: id = x + X*(y + Y*z).
            out = []
            for d in range(self.n_dev):
                c, rest = [], d
                for n in topo.shape:
                    c.append(rest % n)
                    rest //= n
                out.append(topo.chip_id(tuple(c)))
            return out
        if len(coords) != self.n_dev:
            raise TpusimError(
                f"{self.source}: its partition_coords comment lists {len(coords)} chips but the "
                f"module has {self.n_dev} devices; regenerate it")
        out = []
        for c in coords:
            if len(c) != topo.ndim or any(not 0 <= v < n for v, n in zip(c, topo.shape,
                                                                          strict=False)):
                raise TpusimError(
                    f"{self.source} places a partition at chip {','.join(map(str, c))}, which "
                    f"is outside the {topo.name} pod; give the topology it was compiled for")
            out.append(topo.chip_id(tuple(c)))
        if len(set(out)) != len(out):
            raise TpusimError(f"{self.source}: partition_coords lists a chip twice")
        return out

    # -- ops --------------------------------------------------------------------------------
    def _add(self, name: str, deps: frozenset[int], **kw: Any) -> int:
        if len(self.b.ops) >= MAX_OPS:
            raise TpusimError(
                f"{self.source} unrolls to more than {MAX_OPS:,} trace ops (while loops x trip "
                f"counts), the most tpusim simulates in one program; simulate fewer layers or "
                f"steps")
        coll = kw.get("kind") == OpKind.COLLECTIVE
        # Compute ops run in program order on the core, so waiting for the latest one implies
        # the earlier ones: keep only it, plus every collective.
        comp = [d for d in deps if not self.is_coll[d]]
        keep = [d for d in deps if self.is_coll[d]] + ([max(comp)] if comp else [])
        i = self.b.add(name, deps=keep, **kw)
        self.is_coll.append(coll)
        return i

    def compute(self, name: str, deps: frozenset[int], *, mxu: float, vpu: float,
                nbytes: float, dtype: str = "bf16") -> Value:
        if mxu <= 0 and vpu <= 0 and nbytes <= 0:
            return deps
        unit = Unit.MXU if mxu > 0 else Unit.VPU
        i = self._add(name, deps, kind=OpKind.COMPUTE, unit=unit,
                      flops=float(mxu if mxu > 0 else vpu), hbm_bytes=float(nbytes),
                      **({"dtype": dtype} if mxu > 0 and dtype != "bf16" else {}))
        self.flops["mxu"] += mxu
        self.flops["vpu"] += vpu if mxu <= 0 else 0.0
        self.flops["hbm"] += nbytes
        return frozenset({i})

    # -- shapes and costs -------------------------------------------------------------------
    def shape_of(self, comp: Computation, name: str) -> Shape:
        ins = comp.by_name.get(name)
        if ins is not None:
            return ins.shape
        s = self.m.shapes.get(name)
        if s is None:
            raise TpusimError(f"{self.source}: operand %{name} is not defined (truncated file?)")
        return s

    def mxu_dtype(self, comp: Computation, ins: Instruction) -> str:
        """The MXU format of a dot or convolution: int8 or fp8 when both operands are, else
        bf16 (`_INT8_TYPES`)."""
        types = {self.shape_of(comp, o).dtype for o in ins.operands[:2]}
        if len(ins.operands) >= 2 and types <= _INT8_TYPES:
            return "int8"
        if len(ins.operands) >= 2 and types <= _FP8_TYPES:
            return "fp8"
        return "bf16"

    def comp_dtype(self, comp: Computation) -> str:
        """The MXU format of a fused computation's first dot or convolution (nested fusions
        included; bf16 without one)."""
        if comp.name in self._comp_dtype:
            return self._comp_dtype[comp.name]
        out = "bf16"
        for ins in comp.instructions:
            if ins.opcode in MXU_OPS:
                out = self.mxu_dtype(comp, ins)
                break
            if ins.opcode in ("fusion", "call"):
                inner = [self.comp_dtype(self.m.computations[c]) for c in ins.called()]
                if any(d != "bf16" for d in inner):
                    out = next(d for d in inner if d != "bf16")
                    break
        self._comp_dtype[comp.name] = out
        return out

    def mxu_flops(self, comp: Computation, ins: Instruction) -> float:
        out = ins.shape.num_elements
        if ins.opcode == "dot":
            dd = dot_dims(ins)
            lhs = self.shape_of(comp, ins.operands[0])
            self.check_dot(comp, ins, dd, lhs)
            k = 1
            for d in dd["lhs_contracting_dims"]:
                k *= lhs.dims[d]
            return 2.0 * out * k
        if len(ins.operands) < 2:
            return 0.0
        return conv_flops(self.shape_of(comp, ins.operands[0]),
                          self.shape_of(comp, ins.operands[1]), ins.shape,
                          ins.attrs.get("dim_labels", ""), ins.attrs.get("window", ""))

    def check_dot(self, comp: Computation, ins: Instruction, dd: dict, lhs: Shape) -> None:
        """A dot's batch and contracting dimensions as XLA's verifier checks them: each within
        its operand's rank, as many on either side, of equal sizes (a dimension past the rank
        used to be skipped, costing the dot as if it contracted nothing)."""
        if len(ins.operands) < 2:
            raise TpusimError(f"{self.source}: line {ins.line}: {ins.name} is a dot with "
                              f"{len(ins.operands)} operand(s); a dot takes two")
        rhs = self.shape_of(comp, ins.operands[1])
        for kind in ("batch", "contracting"):
            ld, rd = dd[f"lhs_{kind}_dims"], dd[f"rhs_{kind}_dims"]
            for side, dims, shape in (("lhs", ld, lhs), ("rhs", rd, rhs)):
                bad = [d for d in dims if not 0 <= d < len(shape.dims)]
                if bad or len(set(dims)) != len(dims):
                    raise TpusimError(
                        f"{self.source}: line {ins.line}: {ins.name} has {side}_{kind}_dims "
                        f"{{{','.join(map(str, dims))}}}, but its {side} {shape} has rank "
                        f"{len(shape.dims)} (dimensions 0..{len(shape.dims) - 1}, each once); "
                        f"XLA rejects this module")
            if len(ld) != len(rd) or any(lhs.dims[a] != rhs.dims[b]
                                         for a, b in zip(ld, rd, strict=False)):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name}'s {kind} dimensions do not "
                    f"match ({lhs} lhs {{{','.join(map(str, ld))}}}, {rhs} rhs "
                    f"{{{','.join(map(str, rd))}}}); XLA rejects this module")

    def check_gather(self, comp: Computation, ins: Instruction) -> None:
        """A gather's dimension numbers within the ranks, as XLA's verifier checks them."""
        if len(ins.operands) < 2:
            raise TpusimError(f"{self.source}: line {ins.line}: {ins.name} is a gather with "
                              f"{len(ins.operands)} operand(s); a gather takes two")
        operand = self.shape_of(comp, ins.operands[0])
        indices = self.shape_of(comp, ins.operands[1])
        rank, out_rank = len(operand.dims), len(ins.shape.dims)
        for attr, limit, what in (("collapsed_slice_dims", rank, "operand"),
                                  ("start_index_map", rank, "operand"),
                                  ("operand_batching_dims", rank, "operand"),
                                  ("offset_dims", out_rank, "output"),
                                  ("start_indices_batching_dims", len(indices.dims),
                                   "indices")):
            if attr not in ins.attrs:
                continue
            dims = int_list(ins.attrs[attr])
            bad = [d for d in dims if not 0 <= d < limit]
            if bad:
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has {attr}="
                    f"{{{','.join(map(str, dims))}}}, but its {what} has rank {limit} "
                    f"(dimensions 0..{limit - 1}); XLA rejects this module")
        if "index_vector_dim" in ins.attrs:
            ivd = _whole(ins.attrs["index_vector_dim"], ins)
            if not 0 <= ivd <= len(indices.dims):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has index_vector_dim={ivd}, "
                    f"but its indices {indices} have rank {len(indices.dims)} (0..."
                    f"{len(indices.dims)}); XLA rejects this module")
        if "slice_sizes" in ins.attrs:
            sizes = int_list(ins.attrs["slice_sizes"])
            if len(sizes) != rank or any(not 0 <= z <= n for z, n in zip(sizes, operand.dims,
                                                                          strict=False)):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has slice_sizes="
                    f"{{{','.join(map(str, sizes))}}} for an operand {operand}: one size per "
                    f"dimension, each at most the dimension; XLA rejects this module")

    def comp_flops(self, comp: Computation) -> tuple[float, float]:
        """(MXU, VPU) FLOPs of a fused computation, nested fusions included."""
        if comp.name in self._comp_flops:
            return self._comp_flops[comp.name]
        mxu = vpu = 0.0
        for ins in comp.instructions:
            op = ins.opcode
            if op == "gather":
                self.check_gather(comp, ins)
            if op in MXU_OPS:
                mxu += self.mxu_flops(comp, ins)
            elif op in ELEMENTWISE:
                vpu += ins.shape.num_elements
            elif op == "reduce" and ins.operands:
                vpu += self.shape_of(comp, ins.operands[0]).num_elements
            elif op in ("fusion", "call"):
                for c in ins.called():
                    a, v = self.comp_flops(self.m.computations[c])
                    mxu += a
                    vpu += v
        self._comp_flops[comp.name] = (mxu, vpu)
        return mxu, vpu

    def fusion_bytes(self, comp: Computation, ins: Instruction, fused: Computation) -> float:
        """HBM bytes of one fusion: parameters read once (a parameter used only through
        slices reads the slices), the result written once (an in-place dynamic-update-slice
        root writes only its update)."""
        params = {p.name: _whole(p.literal or 0, p) for p in fused.instructions
                  if p.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for f in fused.instructions:
            for o in f.operands:
                users.setdefault(o, []).append(f)
        root = fused.root
        dus_roots = [root] if root.opcode == "dynamic-update-slice" else [
            fused.by_name[o] for o in root.operands
            if o in fused.by_name and fused.by_name[o].opcode == "dynamic-update-slice"
        ] if root.opcode == "tuple" else []
        in_place = {r.operands[0] for r in dus_roots}
        total = 0.0
        for pname, idx in params.items():
            if idx >= len(ins.operands):
                continue
            full = self.shape_of(comp, ins.operands[idx]).nbytes
            us = users.get(pname, [])
            if pname in in_place:
                continue
            if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and
                          u.operands[0] == pname for u in us):
                total += min(full, sum(u.shape.nbytes for u in us))
            else:
                total += full
        out = ins.shape.nbytes
        if dus_roots:
            upd = sum(self.shape_of(fused, r.operands[1]).nbytes for r in dus_roots)
            out = out - sum(r.shape.nbytes for r in dus_roots) + upd
        return total + max(out, 0)

    def operand_bytes(self, comp: Computation, ins: Instruction) -> float:
        return float(sum(self.shape_of(comp, o).nbytes for o in ins.operands))

    def collectives_in(self, comp: Computation) -> list[Instruction]:
        if comp.name not in self._comp_colls:
            found = []
            for ins in comp.instructions:
                if ins.opcode in COLLECTIVES:
                    found.append(ins)
                elif ins.opcode in ("fusion", "call"):
                    for c in ins.called():
                        found += self.collectives_in(self.m.computations[c])
            self._comp_colls[comp.name] = found
        return self._comp_colls[comp.name]

    # -- collectives ------------------------------------------------------------------------
    def _group_id(self, spec: tuple) -> int:
        gid = self._group_index.get(spec)
        if gid is None:
            gid = len(self.device_groups)
            self._group_index[spec] = gid
            kind, data = spec
            if kind == "groups":
                self.device_groups.append({"groups": [list(g) for g in data]})
                gaxes, exact = factor_device_groups(self.topo, [list(g) for g in data])
                label = ",".join(g.name for g in gaxes) or "-"
            else:
                self.device_groups.append({"pairs": [list(p) for p in data]})
                cls, _hops = route_pairs(self.topo, list(data))
                axes = sorted({AXIS_NAMES[k // 2] if k < 6 else "dcn"
                               for k in range(len(cls)) if cls[k] > 0})
                label = "pairs:" + (",".join(axes) or "-")
                exact = True
            self._group_axes[gid] = (label, exact)
        return gid

    def groups_of(self, ins: Instruction) -> list[list[int]]:
        """The device groups of a collective's `replica_groups` (errors name the file and the
        instruction)."""
        try:
            return replica_groups(ins.attrs.get("replica_groups", "{}"), self.n_dev)
        except TpusimError as exc:
            raise TpusimError(f"{self.source}: {ins.name}: {exc}; recompile the program or "
                              f"restore the file") from None

    def collective(self, comp: Computation, ins: Instruction, deps: frozenset[int],
                   name: str | None = None, kind: str | None = None) -> int | None:
        """Emit a collective op for `ins` (as `kind` if given); None if it moves nothing
        (groups of one chip)."""
        kind = kind or COLLECTIVES[ins.opcode]
        n = self.n_dev
        op_leaves = [self.shape_of(comp, o) for o in ins.operands]
        in_bytes = sum(s.nbytes for s in op_leaves)
        if kind == "collective-permute":
            pairs = source_target_pairs(ins.attrs.get("source_target_pairs", ""))
            for s, t in pairs:
                if not (0 <= s < n and 0 <= t < n):
                    raise TpusimError(
                        f"{self.source}: {ins.name} sends between devices {s} and {t}, but "
                        f"the module has devices 0..{n - 1}")
            for role, ids in (("source", [p[0] for p in pairs]),
                              ("target", [p[1] for p in pairs])):
                twice = sorted({d for d in ids if ids.count(d) > 1}) if len(set(ids)) \
                    != len(ids) else []
                if twice:
                    # XLA's verifier: each device sends at most once and receives at most once.
                    raise TpusimError(
                        f"{self.source}: {ins.name} lists device {twice[0]} as a {role} twice "
                        f"in source_target_pairs; each device is a {role} at most once (XLA "
                        f"rejects this module)")
            chip_pairs = tuple(sorted((self.chip_of[s], self.chip_of[t]) for s, t in pairs
                                      if s != t))
            if not chip_pairs:
                return None
            gid = self._group_id(("pairs", chip_pairs))
            nbytes = float(in_bytes)
            size = 2
        else:
            groups = self.groups_of(ins)
            sizes = {len(g) for g in groups}
            flat = [d for g in groups for d in g]
            bad = [d for d in flat if not 0 <= d < n]
            if bad or len(set(flat)) != len(flat) or len(sizes) != 1:
                why = (f"device {bad[0]} is outside 0..{n - 1}" if bad else
                       "a device appears twice" if len(set(flat)) != len(flat) else
                       "its groups differ in size")
                raise TpusimError(
                    f"{self.source}: the replica groups of {ins.name} do not fit the "
                    f"{n}-device pod ({why}); recompile the program for this pod")
            size = sizes.pop()
            if size == 1:
                return None
            chips = tuple(tuple(sorted(self.chip_of[d] for d in g)) for g in groups)
            if len(flat) != n:
                covered = set(flat)
                rest = [d for d in range(n) if d not in covered]
                # Devices left out run the same collective with each other in SPMD programs
                # (XLA prints only the groups that involve... all of them in practice).
                chips += tuple(tuple(sorted(self.chip_of[d] for d in rest[i:i + size]))
                               for i in range(0, len(rest), size))
            gid = self._group_id(("groups", tuple(sorted(chips))))
            out_leaves = ins.shape.leaves()
            if ins.opcode.endswith("-start") and ins.shape.is_tuple:
                # all-gather-start returns (operands..., results...).
                out_leaves = out_leaves[len(out_leaves) // 2:] if kind == "all-gather" \
                    else out_leaves
            if kind == "all-gather":
                nbytes = float(sum(s.nbytes for s in out_leaves))
            elif kind == "all-to-all":
                nbytes = float(in_bytes * size)
            else:
                nbytes = float(in_bytes)
        label, exact = self._group_axes[gid]
        if not exact:
            self.warnings.append(
                f"{ins.name}: its replica groups are not a product of torus axis factors; "
                f"costed as a collective over whole axes {label}")
            self._group_axes[gid] = (label, True)  # warn once per group set
        i = self._add(name or ins.name, deps, kind=OpKind.COLLECTIVE, collective=kind,
                      bytes=nbytes, group=gid)
        key = (kind, label)
        rec = self.coll_stats.setdefault(key, {"kind": kind, "axes": label, "executions": 0,
                                               "bytes": 0.0, "group_size": size})
        rec["executions"] += 1
        rec["bytes"] += nbytes
        return i

    # -- control flow -----------------------------------------------------------------------
    def trip_count(self, comp: Computation, ins: Instruction) -> tuple[int, str]:
        bc = backend_config(ins)
        ktc = bc.get("known_trip_count")
        if isinstance(ktc, dict) and str(ktc.get("n", "")).isdigit():
            return int(ktc["n"]), "known_trip_count"
        cond = self.m.computations[ins.attrs["condition"].lstrip("%")]
        body = self.m.computations[ins.attrs["body"].lstrip("%")]
        root = cond.root
        cmp_ins, cmp_comp = root, cond
        if root.opcode == "fusion":
            cmp_comp = self.m.computations[root.called()[0]]
            cmp_ins = cmp_comp.root
        if cmp_ins.opcode != "compare" or len(cmp_ins.operands) != 2:
            return 1, "unknown"
        direction = cmp_ins.attrs.get("direction", "")

        def resolve(c: Computation, name: str, outer: Instruction | None):
            """('const', v) / ('index', k) for a compare operand."""
            i = c.by_name.get(name)
            if i is None:
                return None
            if i.opcode == "constant":
                v = int_list(i.literal)
                return ("const", v[0]) if len(v) == 1 else None
            if i.opcode == "get-tuple-element":
                return ("index", _whole(i.attrs.get("index", "-1"), i))
            if i.opcode == "parameter" and outer is not None:
                k = _whole(i.literal or 0, i)
                return resolve(cond, outer.operands[k], None) if k < len(outer.operands) \
                    else None
            if i.opcode in ("convert", "bitcast", "copy") and i.operands:
                return resolve(c, i.operands[0], outer)
            return None

        outer = root if root.opcode == "fusion" else None
        a = resolve(cmp_comp, cmp_ins.operands[0], outer)
        b = resolve(cmp_comp, cmp_ins.operands[1], outer)
        if a is None or b is None:
            return 1, "unknown"
        if a[0] == "const" and b[0] == "index":
            a, b = b, a
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction,
                                                                                direction)
        if a[0] != "index" or b[0] != "const":
            return 1, "unknown"
        k, bound = a[1], b[1]
        # Initial value: element k of the loop's operand tuple, if it is a constant.
        init = 0
        src = comp.by_name.get(ins.operands[0])
        if src is not None and src.opcode == "tuple" and k < len(src.operands):
            e = comp.by_name.get(src.operands[k])
            if e is not None and e.opcode == "constant":
                v = int_list(e.literal)
                init = v[0] if len(v) == 1 else 0
        # Step: the body's root tuple element k = add(gte(param, k), constant).
        step = None
        broot = body.root
        if broot.opcode == "tuple" and k < len(broot.operands):
            upd = body.by_name.get(broot.operands[k])
            if upd is not None and upd.opcode in ("add", "subtract"):
                consts = [body.by_name[o] for o in upd.operands if o in body.by_name
                          and body.by_name[o].opcode == "constant"]
                if len(consts) == 1:
                    v = int_list(consts[0].literal)
                    if len(v) == 1:
                        step = v[0] if upd.opcode == "add" else -v[0]
        if not step:
            return 1, "unknown"
        span = {"LT": bound - init, "LE": bound - init + 1, "GT": init - bound,
                "GE": init - bound + 1, "NE": bound - init}.get(direction)
        if span is None:
            return 1, "unknown"
        mag = abs(step)
        if direction in ("GT", "GE"):
            n = -(-span // mag) if step < 0 else 0
        else:
            n = -(-span // mag) if step > 0 else 0
        return max(int(n), 0), "induction variable"

    def static_cost(self, comp: Computation, depth: int = 0) -> float:
        """Rough size of a computation (FLOPs + bytes, loops once) to pick a conditional's
        branch."""
        if depth > MAX_CALL_DEPTH:
            return 0.0
        total = 0.0
        for ins in comp.instructions:
            if ins.opcode in ("fusion",):
                a, v = self.comp_flops(self.m.computations[ins.called()[0]])
                total += a + v + ins.shape.nbytes
            elif ins.opcode in MXU_OPS:
                total += self.mxu_flops(comp, ins) + ins.shape.nbytes
            elif ins.opcode in ("call", "while", "conditional"):
                total += sum(self.static_cost(self.m.computations[c], depth + 1)
                             for c in ins.called())
            elif ins.opcode in COLLECTIVES:
                total += ins.shape.nbytes
            else:
                total += ins.shape.nbytes
        return total

    # -- the walk ---------------------------------------------------------------------------
    def run(self) -> HloImport:
        self.visits = 0
        self.flops = {"mxu": 0.0, "vpu": 0.0, "hbm": 0.0}
        self.coll_stats: dict[tuple, dict] = {}
        entry = self.m.entry_computation
        # Progress: instructions visited (each while body once per trip), no total known.
        with task("HLO lower", unit="instruction") as self.task:
            self.run_comp(entry, None, 0)
            self.task.update(self.visits, detail=f"{len(self.b.ops):,} trace ops")
        if self.unknown:
            self.warnings.append(
                "unknown opcodes costed from their shapes (HBM bytes, no FLOPs): " + ", ".join(
                    f"{k} x{v}" for k, v in sorted(self.unknown.items())))
        mesh = LogicalMesh(axes=(("data", self.topo.chips_per_slice),),
                           dcn_axes=(("data", self.topo.num_slices),)
                           if self.topo.num_slices > 1 else ())
        meta = {
            "kind": "hlo", "source": self.source, "module": self.m.name,
            "num_chips": self.topo.num_chips, "device_groups": self.device_groups,
        }
        trace = Trace(mesh=mesh, ops=tuple(self.b.ops), meta=meta)
        by_kind = Counter(i.opcode for c in self.m.computations.values()
                          for i in c.instructions)
        colls = sorted(self.coll_stats.values(), key=lambda r: (r["kind"], r["axes"]))
        inv = {
            "module": self.m.name,
            "num_devices": self.n_dev,
            "num_computations": len(self.m.computations),
            "num_instructions": self.m.num_instructions,
            "instructions_by_kind": dict(sorted(by_kind.items(), key=lambda kv: (-kv[1],
                                                                                  kv[0]))),
            "num_trace_ops": len(trace.ops),
            "dot_flops_per_chip": self.flops["mxu"],
            "vpu_flops_per_chip": self.flops["vpu"],
            "hbm_bytes_per_chip": self.flops["hbm"],
            "collectives": colls,
            "collective_bytes_per_chip": float(sum(r["bytes"] for r in colls)),
            "num_collectives": int(sum(r["executions"] for r in colls)),
            "while_loops": self.loops,
            "warnings": self.warnings,
        }
        return HloImport(trace=trace, inventory=inv, warnings=self.warnings)

    def _check_loop(self, ins: Instruction, trip: int, ops_per_trip: int,
                    visits_per_trip: int) -> None:
        ops = len(self.b.ops) + (trip - 1) * ops_per_trip
        visits = self.visits + (trip - 1) * visits_per_trip
        if ops > MAX_OPS:
            raise TpusimError(
                f"{self.source} unrolls to more than {MAX_OPS:,} trace ops (while loop "
                f"{ins.name}: {trip:,} trips of {ops_per_trip:,} ops), the most tpusim simulates "
                f"in one program; simulate fewer layers or steps")
        if visits > MAX_VISITS:
            raise TpusimError(
                f"{self.source}: lowering visits more than {MAX_VISITS:,} instructions (while "
                f"loop {ins.name}: {trip:,} trips of {visits_per_trip:,}), more than a program "
                f"tpusim can simulate holds; simulate fewer layers or steps")

    def run_comp(self, comp: Computation, args: list[Value] | None, depth: int) -> Value:
        if depth > MAX_CALL_DEPTH:
            raise TpusimError(
                f"{self.source}: computations call each other more than {MAX_CALL_DEPTH} "
                f"levels deep (at {comp.name}); this is not a program XLA writes")
        env: dict[str, Value] = {}
        pending: dict[str, int] = {}
        self.visits += len(comp.instructions)
        if self.task.active and self.task.due():
            self.task.update(self.visits, detail=f"{len(self.b.ops):,} trace ops")
        if self.visits > MAX_VISITS:
            raise TpusimError(
                f"{self.source}: lowering visits more than {MAX_VISITS:,} instructions (while "
                f"loops x trip counts, at {comp.name}), more than a program tpusim can simulate "
                f"holds; simulate fewer layers or steps")
        for ins in comp.instructions:
            env[ins.name] = self.lower(comp, ins, env, pending, args, depth)
        return env[comp.root.name]

    def lower(self, comp: Computation, ins: Instruction, env: dict[str, Value],
              pending: dict[str, int], args: list[Value] | None, depth: int) -> Value:
        op = ins.opcode
        ops = ins.operands
        try:
            vals = [env[o] for o in ops]
        except KeyError as exc:
            raise TpusimError(
                f"{self.source}: line {ins.line}: {ins.name} uses %{exc.args[0]} before it is "
                f"defined in {comp.name}") from None
        deps = frozenset().union(*(_flatten(v) for v in vals)) if vals else frozenset()
        cp = ins.attrs.get("control-predecessors")
        if cp:
            for p in cp.strip("{}").split(","):
                p = p.strip().lstrip("%")
                if p in env:
                    deps |= _flatten(env[p])
        if op == "parameter":
            k = _whole(ins.literal or 0, ins)
            return args[k] if args is not None and k < len(args) else frozenset()
        if op in FREE:
            return frozenset()
        if op == "get-tuple-element":
            v = vals[0]
            k = _whole(ins.attrs.get("index", "0"), ins)
            return v[k] if isinstance(v, tuple) and k < len(v) else _flatten(v)
        if op == "tuple":
            return tuple(vals)
        if op in ALIASES:
            if op == "async-update" and ops and ops[0] in pending:
                pending[ins.name] = pending[ops[0]]
            return vals[0] if len(vals) == 1 else deps
        if op in COLLECTIVES:
            i = self.collective(comp, ins, deps)
            if i is None:
                return deps
            if op.endswith("-start"):
                pending[ins.name] = i
                return deps
            return frozenset({i})
        if op in DONES:
            i = pending.get(ops[0]) if ops else None
            return deps | ({i} if i is not None else set())
        if op == "async-start":
            called = [self.m.computations[c] for c in ins.called()]
            colls = [c for comp_ in called for c in self.collectives_in(comp_)]
            if colls:
                inner = called[0]
                i = self.collective(inner, colls[0], deps, name=ins.name)
                if i is not None:
                    pending[ins.name] = i
                return deps
            out = deps
            for c in called:
                out = _flatten(self.run_comp(c, vals, depth + 1))
            return out
        if op == "while":
            trip, how = self.trip_count(comp, ins)
            if ins.name not in self._loop_seen:
                self._loop_seen.add(ins.name)
                self.loops.append({"name": ins.name, "trip_count": trip, "from": how})
                if how == "unknown":
                    self.warnings.append(
                        f"while loop {ins.name}: trip count unknown (no known_trip_count and "
                        f"no induction variable against a constant); ran once")
                    trip = 1
            elif how == "unknown":
                trip = 1
            body = self.m.computations[ins.attrs["body"].lstrip("%")]
            v = vals[0] if vals else frozenset()
            for k in range(trip):
                before, visits = len(self.b.ops), self.visits
                nxt = self.run_comp(body, [v], depth + 1)
                if nxt == v and len(self.b.ops) == before:
                    # A trip that emits no op and hands the next trip the same value is the
                    # same trip every time (the walk is a pure function of the value): the
                    # loop's remaining trips add nothing (an empty body, scalar bookkeeping).
                    break
                if k == 0:
                    # Every trip walks the same instructions and emits the same ops (costs and
                    # groups do not depend on the values), so the first trip tells whether the
                    # whole loop fits: refused now, not after 250,000 ops or 10^6 visits.
                    self._check_loop(ins, trip, len(self.b.ops) - before,
                                     self.visits - visits)
                v = nxt
            return v
        if op == "conditional":
            branches = [self.m.computations[c] for c in ins.called()]
            costs = [self.static_cost(b) for b in branches]
            k = max(range(len(branches)), key=lambda j: (costs[j], -j))
            arg = [vals[k + 1]] if k + 1 < len(vals) else []
            return self.run_comp(branches[k], arg, depth + 1)
        if op == "call":
            return self.run_comp(self.m.computations[ins.called()[0]], vals, depth + 1)
        if op == "fusion":
            return self.fusion(comp, ins, deps)
        if op == "gather":
            self.check_gather(comp, ins)
        scalar = ins.shape.num_elements <= 1 and all(
            self.shape_of(comp, o).num_elements <= 1 for o in ops)
        if op in MXU_OPS:
            return self.compute(ins.name, deps, mxu=self.mxu_flops(comp, ins), vpu=0.0,
                                nbytes=self.operand_bytes(comp, ins) + ins.shape.nbytes,
                                dtype=self.mxu_dtype(comp, ins))
        if scalar and (op in ELEMENTWISE or op in MOVEMENT):
            return deps  # scalar bookkeeping (loop counters, offsets): the scalar unit
        if op in ELEMENTWISE:
            return self.compute(ins.name, deps, mxu=0.0, vpu=float(ins.shape.num_elements),
                                nbytes=self.operand_bytes(comp, ins) + ins.shape.nbytes)
        if op in MOVEMENT:
            if op == "dynamic-slice" or op == "slice":
                nbytes = 2.0 * ins.shape.nbytes
            elif op == "dynamic-update-slice":
                nbytes = 2.0 * self.shape_of(comp, ops[1]).nbytes
            else:
                nbytes = self.operand_bytes(comp, ins) + ins.shape.nbytes
            vpu = float(self.shape_of(comp, ops[0]).num_elements) if op == "reduce" else 0.0
            return self.compute(ins.name, deps, mxu=0.0, vpu=vpu, nbytes=nbytes)
        if op == "custom-call":
            target = ins.attrs.get("custom_call_target", "").strip('"')
            if target in FREE_CUSTOM_CALLS:
                return deps
            return self.compute(ins.name, deps, mxu=0.0, vpu=0.0,
                                nbytes=self.operand_bytes(comp, ins) + ins.shape.nbytes)
        if op in SKIPPED:
            self.unknown[op] += 0
            self.warnings.append(f"{ins.name}: {op} (host/peer I/O) is not simulated")
            return deps
        self.unknown[op] += 1
        return self.compute(ins.name, deps, mxu=0.0, vpu=0.0,
                            nbytes=self.operand_bytes(comp, ins) + ins.shape.nbytes)

    def fusion(self, comp: Computation, ins: Instruction, deps: frozenset[int]) -> Value:
        fused = self.m.computations[ins.called()[0]]
        colls = self.collectives_in(fused)
        mxu, vpu = self.comp_flops(fused)
        if not colls:
            return self.compute(ins.name, deps, mxu=mxu, vpu=vpu,
                                nbytes=self.fusion_bytes(comp, ins, fused),
                                dtype=self.comp_dtype(fused))
        # TPU async collective fusion: a start fusion (root custom-call AsyncCollectiveStart)
        # launches the collective, continuation fusions (same channel_id) overlap compute with
        # it, the done fusion (AsyncCollectiveDone) waits for it.
        root = fused.root
        target = root.attrs.get("custom_call_target", "").strip('"') \
            if root.opcode == "custom-call" else ""
        c = colls[0]
        ch = c.attrs.get("channel_id", c.name)
        out: frozenset[int] = deps
        # Compute inside (continuations hold the matmul that overlaps the transfer): the
        # matmuls' operands and results stream through HBM.
        if mxu > 0 or vpu > 0:
            nbytes = 0.0
            for f in fused.instructions:
                if f.opcode in MXU_OPS:
                    nbytes += self.operand_bytes(fused, f) + f.shape.nbytes
            out = _flatten(self.compute(ins.name, deps, mxu=mxu, vpu=vpu, nbytes=nbytes,
                                        dtype=self.comp_dtype(fused)))
        if target == "AsyncCollectiveStart":
            i = self.collective(fused, c, deps, name=ins.name)
            if i is not None:
                self.open_channels[ch] = i
            return out
        if target == "AsyncCollectiveDone":
            i = self.open_channels.pop(ch, None)
            return out | ({i} if i is not None else set())
        if ch in self.open_channels:
            return out
        # A synchronous collective fusion. TPU's all-reduce-scatter fusion
        # (`SingleInputAllReduceScatterFusion`) all-reduces and only dynamic-slices the result:
        # it runs as one ring reduce-scatter of the same operand.
        scatter = (c.opcode == "all-reduce" and root.opcode == "dynamic-slice"
                   and root.operands[:1] == (c.name,))
        if scatter:
            # It is a reduce-scatter only if the slice keeps one group member's share: 1/N of
            # the all-reduced elements. Any other slice is an all-reduce whose result is then
            # cut (costed as the all-reduce it runs).
            groups = self.groups_of(c)
            size = len(groups[0]) if groups else 1
            kept, total = root.shape.num_elements, c.shape.num_elements
            scatter = not root.shape.is_tuple and not c.shape.is_tuple and kept * size == total
            if not scatter:
                self.warnings.append(
                    f"{ins.name}: its all-reduce-scatter keeps {kept:,} of {total:,} elements, "
                    f"not 1/{size} (one member's share of the groups of {size}); costed as an "
                    f"all-reduce")
        i = self.collective(fused, c, deps, name=ins.name,
                            kind="reduce-scatter" if scatter else None)
        return out | ({i} if i is not None else set())


def collective_axes_label(meta_groups: list[dict], gid: int, topology: Topology) -> str:
    spec = meta_groups[gid]
    if "pairs" in spec:
        cls, _ = route_pairs(topology, [tuple(p) for p in spec["pairs"]])
        axes = sorted({AXIS_NAMES[k // 2] if k < 6 else "dcn" for k in range(len(cls))
                       if cls[k] > 0})
        return "pairs:" + ",".join(axes)
    gaxes, _ = factor_device_groups(topology, spec["groups"])
    return ",".join(g.name for g in gaxes)


def is_hlo_text(head: str) -> bool:
    """Whether a file's first bytes look like HLO module text (rather than a trace)."""
    for line in head.splitlines():
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        return s.startswith("HloModule")
    return False


__all__ = ["HloImport", "import_hlo", "is_hlo_text", "lower_module", "read_partition_coords"]


def read_hlo_file(path: str) -> str:
    """The text of an HLO file (`.gz` too), refusing files over the parser's size limit before
    reading them whole."""
    import gzip
    import os

    from workloads.hlo.parser import MAX_TEXT_BYTES

    if os.path.isdir(path):
        raise TpusimError(f"HLO file {path!r} is a directory; give one module's .txt file (an "
                          f"--xla_dump_to directory holds one per compiled program)")
    if not os.path.exists(path):
        raise TpusimError(f"HLO file {path!r} does not exist")
    if not os.path.isfile(path):
        raise TpusimError(f"HLO file {path!r} is not a regular file (a pipe or device); save the "
                          f"HLO text to a file first")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_TEXT_BYTES + 1)
        else:
            size = os.path.getsize(path)
            if size > MAX_TEXT_BYTES:
                raise TpusimError(
                    f"{path} is {size / 2**20:.0f} MiB of HLO text; tpusim reads modules of at "
                    f"most {MAX_TEXT_BYTES >> 20} MiB (compile fewer layers or use a scanned "
                    f"model)")
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise TpusimError(f"HLO file {path!r} cannot be read: {exc}") from None
    if len(data) > MAX_TEXT_BYTES:
        raise TpusimError(
            f"{path} decompresses to more than {MAX_TEXT_BYTES >> 20} MiB of HLO text; tpusim "
            f"reads modules of at most {MAX_TEXT_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TpusimError(f"{path} is not HLO text (not UTF-8); give the text of "
                          f"compiled.as_text()") from None
