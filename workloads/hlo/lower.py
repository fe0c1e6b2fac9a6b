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
  collective ops over explicit device groups (`meta.device_groups`); bytes follow the
  textbook's V convention. An async start's consumers do not wait for the transfer, its done's
  consumers do: that is the overlap.
* `while` loops are unrolled by their trip count (`known_trip_count`, else the induction variable
  compared against a constant), `conditional` takes its most expensive branch, `call` is inlined.
* Scalars, tuples, bitcasts and XLA's memory-space moves (`copy-start`/`slice-start` between HBM
  and on-chip memory) cost nothing here: the compute op that reads the data pays its HBM bytes.

Only topology is needed (to check that replica groups fit the pod and to map partitions to
chips); `sim/` is never imported.
"""


from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from topologies.errors import TpusimError
from topologies.groups import factor_device_groups, route_pairs
from topologies.mesh import job_mesh
from topologies.progress import NO_TASK, task
from topologies.torus import AXIS_NAMES, Topology
from topologies.validate import MAX_TRACE_OPS
from workloads.hlo.costs import MAX_CALL_DEPTH, ModuleCosts, whole
from workloads.hlo.files import entry_ops_lower_bound, read_partition_coords
from workloads.hlo.memory import hlo_memory
from workloads.hlo.opcodes import (
    ALIASES,
    COLLECTIVES,
    DONES,
    ELEMENTWISE,
    FREE,
    FREE_CUSTOM_CALLS,
    MOVEMENT,
    MXU_OPS,
    SKIPPED,
)
from workloads.hlo.parser import (
    Computation,
    HloModule,
    Instruction,
    backend_config,
    int_list,
    parse_hlo,
    replica_groups,
    source_target_pairs,
)
from workloads.trace import OpKind, Trace, TraceBuilder, Unit
from workloads.trace_meta import TraceKind, TraceMeta

# Unrolled trace ops: the most a program may hold, as for a trace file (a 2 MB 8-layer train
# step unrolls to ~20k). It was 2,000,000: a 16-instruction loop of trip count 1.9 M unrolled
# in ~35 CPU-s to a program that would take ~3 GB to replay, and `import-hlo -o` wrote traces
# over the limit that `replay` then refused.
MAX_OPS = MAX_TRACE_OPS
# Instructions the lowering may visit (each while body once per trip): a loop whose body
# emits no op never reached MAX_OPS, so `known_trip_count` 10^12 over an empty body looped
# forever. Real modules visit a few times their unrolled op count (the 8-layer train step:
# ~60k visits for ~20k ops); a visit is ~5 us, so this bounds the walk to seconds.
MAX_VISITS = 4 * MAX_OPS

Value = Any  # frozenset[int] (trace ops this value waits for) or a tuple of Values


@dataclass(kw_only=True)
class HloImport:
    """A lowered module: the trace, its inventory and the warnings (things skipped or
    approximated)."""

    trace: Trace
    inventory: dict[str, Any]
    warnings: list[str] = field(default_factory=list)



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




def _flatten(v: Value) -> frozenset[int]:
    if isinstance(v, frozenset):
        return v
    out: set[int] = set()
    for e in v:
        out |= _flatten(e)
    return frozenset(out)


def _num_devices(module: HloModule) -> int:
    return module.num_partitions * module.replica_count


class _Lowerer(ModuleCosts):
    """The walk of one module: each instruction, in program order, becomes trace ops (its
    costs are `ModuleCosts`'), loops unrolled, calls inlined."""

    def __init__(self, module: HloModule, topology: Topology, source: str,
                 partition_coords: list[tuple[int, ...]] | None) -> None:
        super().__init__(module, source)
        self.topo = topology
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
        self.n_dev = _num_devices(module)
        if self.n_dev > topology.num_chips:
            raise TpusimError(
                f"{source} was compiled for {self.n_dev} devices but the {topology.name} pod has "
                f"{topology.num_chips} chips; give the pod it was compiled for ({{shape}})",
                "shape")
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
                return ("index", whole(i.attrs.get("index", "-1"), i))
            if i.opcode == "parameter" and outer is not None:
                k = whole(i.literal or 0, i)
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
        mesh = job_mesh(self.topo)
        meta = TraceMeta.of(
            kind=TraceKind.HLO, source=self.source, module=self.m.name,
            num_chips=self.topo.num_chips, device_groups=self.device_groups,
        )
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
            # Peak HBM per chip from the buffers' live ranges in XLA's schedule
            # (workloads/hlo/memory.py): the program's own, not the replay's.
            "hbm_peak": hlo_memory(self.m).to_dict(),
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
        """The value of one instruction (the trace ops it waits for), emitting its ops."""
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
            k = whole(ins.literal or 0, ins)
            return args[k] if args is not None and k < len(args) else frozenset()
        if op in FREE:
            return frozenset()
        if op == "get-tuple-element":
            v = vals[0]
            k = whole(ins.attrs.get("index", "0"), ins)
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
            return self.async_start(ins, vals, deps, pending, depth)
        if op == "while":
            return self.while_loop(comp, ins, vals, depth)
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
        return self.compute_instruction(comp, ins, deps)

    def async_start(self, ins: Instruction, vals: list[Value], deps: frozenset[int],
                    pending: dict[str, int], depth: int) -> Value:
        """An `async-start` wrapper: the collective it wraps starts (its done waits for it);
        any other wrapped computation runs inline."""
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

    def while_loop(self, comp: Computation, ins: Instruction, vals: list[Value],
                   depth: int) -> Value:
        """A `while` unrolled by its trip count (once when it is unknown, with a warning)."""
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

    def compute_instruction(self, comp: Computation, ins: Instruction,
                            deps: frozenset[int]) -> Value:
        """A matmul, element-wise, data-movement, custom-call or unknown instruction: one
        compute op (none for scalar bookkeeping, free custom calls and skipped I/O)."""
        op, ops = ins.opcode, ins.operands
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


__all__ = ["HloImport", "collective_axes_label", "import_hlo", "lower_module"]


