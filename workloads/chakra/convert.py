"""A Chakra per-rank set as a tpusim trace (what `tpusim replay` runs).

Rank r is chip r of the pod (its chip id order). One file alone is the program every chip runs
(its whole-job collectives span the pod); a set of R > 1 files needs a pod of R chips. Each
rank's nodes, in the order `reader.order_nodes` gives, become ops one for one, so the trace has
the same dependency graph; when every rank's program is the same (SPMD: same ops, sizes and
dependencies up to node ids) the set is one `Trace` whose collectives run over the groups the
ranks name, and every executor, what-if and exporter of a trace replay applies unchanged.

What becomes what (docs/howto/chakra.md has the table and the reasons):
* COMP_NODE on the device: `chakra_compute` roofline (default; ASTRA-sim's roofline mode)
  costs it as an MXU op of `num_ops` FLOPs reading `tensor_size` HBM bytes on the chip model;
  a node that carries neither, every host op (`is_cpu_op`), and every node under
  `chakra_compute` recorded, takes its recorded `duration_micros` (an idle op: the core is
  busy for that long).
* COMM_COLL_NODE: a collective on the torus with tpusim's algorithms. `comm_size` is the
  rank's buffer as ASTRA-sim reads it; tpusim's V is the group's: all-reduce and
  reduce-scatter V = comm_size, all-gather and all-to-all V = comm_size x group size. A
  whole-job collective's group is the chips that share the rank's coordinates on the pod
  dimensions (x, y[, z], then DCN: `PodDims`) its `involved_dim` leaves out; a named process
  group is its ranks (its involved_dim is not read, as ASTRA-sim reads a group's own).
  BROADCAST is replayed at its recorded duration (as ASTRA-sim does); the kinds ASTRA-sim
  refuses map to the nearest tpusim collective (REDUCE -> all-reduce, GATHER and SCATTER ->
  all-gather, REDUCE_SCATTER_BLOCK -> reduce-scatter, BARRIER -> a 1-byte-per-rank
  all-reduce), each listed in the approximations.
* COMM_SEND_NODE: a point-to-point transfer of comm_size bytes to comm_dst (a
  collective-permute over the [src, dst] pairs of all ranks); COMM_RECV_NODE: done when the
  rank's own send with the same comm_tag is (by SPMD symmetry, its peer's send lands then).
* MEM_LOAD/MEM_STORE_NODE: a host transfer of tensor_size bytes over PCIe.
* METADATA_NODE, INVALID_NODE, host-side c10d ops with no comm_type: zero-length ops that keep
  the dependencies through them.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import numpy as np

from topologies.errors import TpusimError
from topologies.mesh import job_mesh
from topologies.torus import Topology
from workloads.chakra.comm_group import check_ranks
from workloads.chakra.convert_fields import OP_FIELDS
from workloads.chakra.programs import (
    MULTI_NOTE,
    count_not_block,
    intern_group,
    program_of_ranks,
    programs_trace,
    rendezvous,
    scaled_program,
    sized_programs,
)
from workloads.chakra.reader import ChakraSet, RankProgram, comm_bytes_of
from workloads.chakra.wire import CommType, Node, NodeType
from workloads.trace import Op, OpKind, Trace, Unit
from workloads.trace_meta import TraceKind, TraceMeta


class ChakraCompute(enum.StrEnum):
    """How a Chakra compute node is costed at replay."""

    ROOFLINE = "roofline"  # FLOPs (num_ops) and bytes (tensor_size) on the chip model
    RECORDED = "recorded"  # its duration_micros as written


# Chakra's collective kinds as tpusim collectives: (tpusim kind, V = comm_size x group size?).
_KINDS = {
    CommType.ALL_REDUCE: ("all-reduce", False),
    CommType.ALL_GATHER: ("all-gather", True),
    CommType.REDUCE_SCATTER: ("reduce-scatter", False),
    CommType.ALL_TO_ALL: ("all-to-all", True),
    CommType.REDUCE_SCATTER_BLOCK: ("reduce-scatter", False),
    CommType.REDUCE: ("all-reduce", False),
    CommType.GATHER: ("all-gather", True),
    CommType.SCATTER: ("all-gather", False),
    CommType.BARRIER: ("all-reduce", False),
}
_NEAREST = {
    CommType.REDUCE_SCATTER_BLOCK: "REDUCE_SCATTER_BLOCK replayed as a reduce-scatter",
    CommType.REDUCE: "REDUCE replayed as an all-reduce of the same buffer (an upper bound: "
                     "the result lands on every rank, not only the root)",
    CommType.GATHER: "GATHER replayed as an all-gather (an upper bound: every rank receives)",
    CommType.SCATTER: "SCATTER replayed as an all-gather of comm_size in all",
    CommType.BARRIER: "BARRIER replayed as an all-reduce of 1 byte per rank",
    CommType.BROADCAST: "BROADCAST replayed at its recorded duration (as ASTRA-sim does)",
}
NAME_CHARS = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class ChakraImport:
    """The trace of a Chakra set and what its conversion approximated."""

    trace: Trace
    num_ranks: int
    approximations: tuple[str, ...]
    # A set whose chips run several programs (pipeline stages): each program, every chip's
    # program, and the point-to-point sends between them ({"peers": per channel the chip each
    # chip sends to, "sends": per program {op: (channel, tag)}, "recvs": per program {tag: op}},
    # the per-chip engine's PointToPoint); empty for one program.
    programs: tuple[Trace, ...] = ()
    program_of_chip: tuple[int, ...] = ()
    p2p: dict | None = None
    # Per-chip factors on ops' sizes ({op id: one factor per chip}): each rank's own sizes of
    # an op whose size differs between ranks (an uneven MoE router's expert loads), as the
    # per-chip engine's `op_scale` takes them; empty when every rank has the same sizes.
    op_scale: dict[int, tuple[float, ...]] = field(default_factory=dict)


def process_groups(rp: RankProgram, num_ranks: int) -> dict[str, tuple[int, ...]]:
    """{pg_name: member ranks} from a rank's METADATA_NODEs (PyTorch's `process_group:init`:
    its inputs.values, less 2 characters at each end, is a JSON list of {"pg_name", "ranks"};
    empty ranks means every rank)."""
    out: dict[str, tuple[int, ...]] = {}
    for n in rp.nodes:
        if n.type != NodeType.METADATA_NODE or n.inputs is None or len(n.inputs.values) < 4:
            continue
        try:
            doc = json.loads(n.inputs.values[2:-2])
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, list):
            continue
        for g in doc:
            if not isinstance(g, dict) or not isinstance(g.get("pg_name"), str):
                continue
            ranks = g.get("ranks") or list(range(num_ranks))
            if not isinstance(ranks, list) or not all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < num_ranks
                    for r in ranks):
                raise TpusimError(
                    f"chakra file {rp.path!r}: node {n.id}: process group "
                    f"{g['pg_name'][:20]!r} lists ranks outside 0..{num_ranks - 1}; give every "
                    f"rank's file")
            out[g["pg_name"]] = tuple(sorted(set(ranks)))
    return out


@dataclass(frozen=True, slots=True)
class PodDims:
    """The pod's network dimensions as Chakra's `involved_dim` counts them (ASTRA-sim: one flag
    per network dimension): x, y[, z] of the torus, then the slices over DCN; `coords[c]` is
    chip c's coordinate on each."""

    sizes: tuple[int, ...]
    coords: np.ndarray  # [chips, dims]

    @staticmethod
    def of(topology: Topology) -> PodDims:
        n = topology.num_chips
        chips = np.arange(n)
        cols = list(np.unravel_index(chips % topology.chips_per_slice, topology.shape))
        sizes = tuple(int(v) for v in topology.shape)
        if topology.num_slices > 1:
            cols.append(chips // topology.chips_per_slice)
            sizes += (topology.num_slices,)
        return PodDims(sizes=sizes, coords=np.stack(cols, axis=1))

    def flags(self, raw: tuple) -> tuple[bool, ...] | None:
        """The pod dimensions a collective spans by its involved_dim flags, or None for all of
        them: flags past the pod's dimensions are ignored, dimensions past the flags are
        involved (a one-flag list, as PyTorch's converter writes for a one-dimension network,
        spans the whole pod)."""
        out = tuple(bool(raw[d]) if d < len(raw) else True for d in range(len(self.sizes)))
        return None if all(f or s == 1 for f, s in zip(out, self.sizes, strict=True)) else out

    def block(self, chip: int, flags: tuple[bool, ...]) -> tuple[int, ...]:
        """The chips that share `chip`'s coordinates on the dimensions `flags` leave out."""
        fixed = [d for d, f in enumerate(flags) if not f]
        same = np.all(self.coords[:, fixed] == self.coords[chip, fixed], axis=1)
        return tuple(int(c) for c in np.flatnonzero(same))

    def blocks(self, flags: tuple[bool, ...]) -> list[list[int]]:
        """Every chip's block (`block`), each once, by their first chip."""
        fixed = [d for d, f in enumerate(flags) if not f]
        _, inv = np.unique(self.coords[:, fixed], axis=0, return_inverse=True)
        out: dict[int, list[int]] = {}
        for c, g in enumerate(np.asarray(inv).reshape(-1).tolist()):
            out.setdefault(g, []).append(c)
        return sorted(out.values())


SHORT_DIMS = ("involved_dim with fewer flags than the pod has dimensions: the dimensions past "
              "them are involved")
NAMED_DIMS = ("involved_dim not read on collectives of a named process group (the group's "
              "members are its ranks, as ASTRA-sim takes them)")


def _raw_dims(n: Node) -> tuple | None:
    a = n.attrs.get("involved_dim")
    return None if a is None else tuple(a.value)


COMM_GROUP_WINS = ("process groups defined by the comm-group file and by a METADATA_NODE "
                   "differently: the file's ranks")


def _groups(rp: RankProgram, num_ranks: int, comm_groups: dict | None,
            notes: dict | None = None) -> dict[str, tuple[int, ...]]:
    """A rank's process groups: its METADATA_NODEs', then the comm-group file's over them."""
    groups = process_groups(rp, num_ranks)
    for key, ranks in (comm_groups or {}).items():
        if notes is not None and groups.get(key, ranks) != ranks:
            notes[COMM_GROUP_WINS] += 1
        groups[key] = ranks
    return groups


def _whole_job(n: Node, groups: dict) -> bool:
    pg = n.attr("pg_name", "")
    pg = pg if isinstance(pg, str) else str(pg)
    return pg in ("", "0") and pg not in groups


def whole_job_flags(n: Node, groups: dict, dims: PodDims | None) -> tuple[bool, ...] | None:
    """The dimensions a whole-job collective spans by its involved_dim, or None: all of them
    (no flags, flags that leave out no dimension, a named process group, or no pod)."""
    raw = _raw_dims(n)
    if raw is None or dims is None or not _whole_job(n, groups):
        return None
    return dims.flags(raw)


def _group_of(rp: RankProgram, n: Node, rank: int, groups: dict, num_ranks: int,
              dims: PodDims | None = None, notes: dict | None = None) -> tuple[int, ...]:
    """The ranks of `rank`'s collective `n`: its named process group, or the whole job on the
    dimensions its involved_dim names (rank r is chip r; `dims` None: every dimension)."""
    raw = _raw_dims(n)
    if _whole_job(n, groups):
        if raw is None or dims is None:
            return tuple(range(num_ranks))
        if notes is not None and len(raw) < len(dims.sizes) and any(
                s > 1 for s in dims.sizes[len(raw):]):
            notes[SHORT_DIMS] += 1
        flags = dims.flags(raw)
        return tuple(range(num_ranks)) if flags is None else dims.block(rank, flags)
    pg = n.attr("pg_name", "")
    pg = pg if isinstance(pg, str) else str(pg)
    members = groups.get(pg)
    if members is None:
        raise TpusimError(
            f"chakra file {rp.path!r}: node {n.id} ({n.name[:60]!r}) names process group "
            f"{pg[:20]!r}, which no METADATA_NODE of the file defines; give the trace with its "
            f"process_group:init node")
    if rank not in members:
        raise TpusimError(
            f"chakra file {rp.path!r}: node {n.id} ({n.name[:60]!r}) is a collective of process "
            f"group {pg[:20]!r} ({len(members)} ranks), which does not hold rank {rank}")
    if notes is not None and raw is not None and not all(raw):
        notes[NAMED_DIMS] += 1
    return members


def _op_of(n: Node, k: int, deps: tuple[int, ...], compute: ChakraCompute, notes: dict,
           group: tuple[int, ...] | None) -> tuple[dict, object]:
    """(Op fields but the id and group, the part of the rank's collective that differs between
    ranks: its group, or its send pair) of one node."""
    t = NodeType(n.type)
    name = n.name[:NAME_CHARS]
    dur = n.duration_micros * 1e-6
    cpu = bool(n.attr("is_cpu_op", False))
    idle = {"name": name, "kind": OpKind.IDLE, "duration_s": dur, "deps": deps}
    if t == NodeType.COMP_NODE:
        flops = n.attr("num_ops")
        nbytes = n.attr("tensor_size")
        if cpu:
            notes["host-side ops (is_cpu_op) replayed at their recorded duration, on the chip's "
                  "core in dependency order"] += 1
            return idle, None
        if compute == ChakraCompute.RECORDED:
            return idle, None
        if flops is None and nbytes is None:
            notes["compute nodes with no num_ops or tensor_size replayed at their recorded "
                  "duration"] += 1
            return idle, None
        return {"name": name, "kind": OpKind.COMPUTE, "unit": Unit.MXU,
                "flops": float(flops or 0), "hbm_bytes": float(nbytes or 0), "deps": deps}, None
    if t in (NodeType.MEM_LOAD_NODE, NodeType.MEM_STORE_NODE):
        notes["memory load/store nodes replayed as host (PCIe) transfers of tensor_size"] += 1
        return {"name": name, "kind": OpKind.HOST, "bytes": float(n.attr("tensor_size", 0) or 0),
                "deps": deps}, None
    if t == NodeType.COMM_COLL_NODE:
        ct = n.attr("comm_type")
        if ct is None:  # host-side c10d bookkeeping (checked by the reader)
            notes["host-side collective calls without comm_type replayed at their recorded "
                  "duration"] += 1
            return idle, None
        ct = CommType(ct)
        if cpu:
            notes["collectives marked is_cpu_op run on the torus (ASTRA-sim refuses them)"] += 1
        if ct in _NEAREST:
            notes[_NEAREST[ct]] += 1
        if ct == CommType.BROADCAST:
            return idle, None
        assert group is not None
        if len(group) == 1:
            notes["collectives over one rank cost nothing"] += 1
            return {**idle, "duration_s": 0.0}, None
        kind, times_group = _KINDS[ct]
        size = float(comm_bytes_of(n))
        if ct == CommType.BARRIER:
            size = 1.0
        v = size * len(group) if times_group or ct == CommType.BARRIER else size
        return {"name": name, "kind": OpKind.COLLECTIVE, "collective": kind, "bytes": v,
                "deps": deps}, group
    if t == NodeType.COMM_SEND_NODE:
        return {"name": name, "kind": OpKind.COLLECTIVE, "collective": "collective-permute",
                "bytes": float(comm_bytes_of(n)), "deps": deps}, int(n.attr("comm_dst"))
    return {**idle, "duration_s": 0.0}, None  # RECV, METADATA, INVALID


def _program(rp: RankProgram, rank: int, num_ranks: int, compute: ChakraCompute,
             notes: dict, *, spmd: bool = True, dims: PodDims | None = None,
             comm_groups: dict | None = None) -> list[tuple[dict, object]]:
    """Each node's (op fields, the part that differs between ranks). `spmd=False` (ranks that
    run different programs): a send's part is ("send", comm_dst, comm_tag), and a receive is a
    point-to-point receive op whose part is ("recv", comm_src, comm_tag), done when that
    send lands (`workloads.chakra.programs`)."""
    groups = _groups(rp, num_ranks, comm_groups, notes)
    index = {n.id: k for k, n in enumerate(rp.nodes)}
    send_of_tag: dict[int, int] = {}
    out = []
    late_recvs = 0
    for k, n in enumerate(rp.nodes):
        deps = {index[d] for d in n.data_deps + n.ctrl_deps if d in index}
        # Edges the reader dropped (self edges, control cycles) point at or past k.
        deps = {d for d in deps if d < k}
        t = n.type
        if not spmd and t in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE):
            out.append(_p2p_op(n, tuple(sorted(deps))))
            continue
        if t == NodeType.COMM_SEND_NODE:
            send_of_tag.setdefault(int(n.attr("comm_tag", 0) or 0), k)
        elif t == NodeType.COMM_RECV_NODE:
            s = send_of_tag.get(int(n.attr("comm_tag", 0) or 0))
            if s is not None:
                deps.add(s)
            else:
                late_recvs += 1
        group = None
        if t == NodeType.COMM_COLL_NODE and n.attr("comm_type") is not None:
            group = _group_of(rp, n, rank, groups, num_ranks, dims, notes)
        out.append(_op_of(n, k, tuple(sorted(deps)), compute, notes, group))
    if late_recvs:
        notes["receives ordered before their rank's send of the same comm_tag: their "
              "dependents do not wait for the transfer"] += late_recvs
    return out


def _p2p_op(n: Node, deps: tuple[int, ...]) -> tuple[dict, tuple]:
    """A send or receive between ranks of different programs: a point-to-point op of
    comm_size bytes (the per-chip engine's `PointToPoint`: a receive takes no resources)."""
    send = n.type == NodeType.COMM_SEND_NODE
    peer = int(n.attr("comm_dst" if send else "comm_src"))
    return ({"name": n.name[:NAME_CHARS], "kind": OpKind.COLLECTIVE, "collective": "send",
             "mesh_axes": ("data",), "bytes": float(comm_bytes_of(n)), "deps": deps},
            ("send" if send else "recv", peer, int(n.attr("comm_tag", 0) or 0)))


def chakra_trace(cset: ChakraSet, topology: Topology,
                 compute: ChakraCompute | str = ChakraCompute.ROOFLINE, *,
                 tpusim_ops: bool = True, comm_groups: dict | None = None) -> ChakraImport:
    """The SPMD trace of a Chakra set on `topology` (see the module docstring). A set tpusim
    exported is replayed from the ops its nodes carry unless `tpusim_ops` is False (then it is
    read as any other reader reads it: the tests check that the Chakra fields alone say the
    same). `comm_groups`: the communicator groups of a comm-group file
    (`workloads.chakra.comm_group`), over the trace's own of the same ids."""
    compute = ChakraCompute(compute)
    n_chips = topology.num_chips
    r = cset.num_ranks
    if tpusim_ops and all("tpusim_format" in rp.metadata.attrs for rp in cset.ranks):
        return _tpusim_trace(cset, topology)
    if r > 1 and r != n_chips:
        raise TpusimError(
            f"chakra trace {cset.source!r} has {r} ranks but the {topology.name} pod has "
            f"{n_chips} chips; replay it on a pod of {r} chips (rank r runs on chip r), e.g. "
            f"{{shape}} with {r} chips", "shape")
    if comm_groups:
        check_ranks(comm_groups, r if r > 1 else n_chips, cset.source)
    notes: dict[str, int] = _Counter()
    dims = PodDims.of(topology)
    # Each distinct program is converted once (ranks whose node records are the same bytes
    # share it); one file alone runs on every chip.
    programs: dict[str, list] = {}
    per_rank = []
    several = _lengths_differ(cset)
    for rank, rp in enumerate(cset.ranks if not several else ()):
        if rp.digest not in programs:
            programs[rp.digest] = _program(rp, rank, r if r > 1 else n_chips, compute, notes,
                                           dims=dims, comm_groups=comm_groups)
        per_rank.append(programs[rp.digest])
    op_scale: dict[int, tuple[float, ...]] = {}
    ref = per_rank[0] if per_rank else []
    if r > 1 and not several and not _one_program(per_rank):
        sized = scaled_program(per_rank, notes)
        if sized is not None:  # one program, each rank at its own sizes (uneven MoE loads)
            ref, op_scale = sized
    if several or (r > 1 and not op_scale and not _one_program(per_rank)):
        # Ranks that run different programs (pipeline stages): each chip its own program.
        notes = _Counter()
        multi = [_program(rp, rank, r, compute, notes, spmd=False, dims=dims,
                          comm_groups=comm_groups) for rank, rp in enumerate(cset.ranks)]
        traces, prog_of, p2p, approx, scale = programs_trace(cset, multi, topology, compute,
                                                             notes)
        return ChakraImport(trace=traces[prog_of[0]], num_ranks=r, approximations=approx,
                            programs=traces, program_of_chip=prog_of, p2p=p2p, op_scale=scale)
    ops: list[Op] = []
    device_groups: list[dict] = []
    group_index: dict[str, int] = {}
    not_block: dict[int, bool] = {}
    groups0 = _groups(cset.ranks[0], r if r > 1 else n_chips, comm_groups)
    for k, (fields, part) in enumerate(ref):
        gid = -1
        if part is not None:
            flags = None
            if fields["collective"] != "collective-permute":
                flags = whole_job_flags(cset.ranks[0].nodes[k], groups0, dims)
            if flags is not None:
                # A whole-job collective on some dimensions: every chip's block of them (its
                # ranks' programs are the same, so rank 0's flags are every rank's).
                spec = {"groups": dims.blocks(flags)}
            elif fields["collective"] == "collective-permute":
                if r == 1:
                    raise TpusimError(
                        f"chakra trace {cset.source!r}: node {cset.ranks[0].nodes[k].id} is a "
                        f"send, but the trace has one rank, so it has no peer; give every "
                        f"rank's file")
                pairs = [[src, int(prog[k][1])] for src, prog in enumerate(per_rank)]
                for src, dst in pairs:
                    if not 0 <= dst < n_chips or dst == src:
                        raise TpusimError(
                            f"chakra trace {cset.source!r}: rank {src}'s send "
                            f"{fields['name'][:60]!r} goes to rank {dst}, which is not another "
                            f"rank of 0..{n_chips - 1}; give every rank's file")
                spec = {"pairs": pairs}
            elif r == 1:
                spec = {"groups": [list(range(n_chips))]}
            else:
                spec = {"groups": [list(g) for g in sorted({prog[k][1] for prog in per_rank})]}
                seen: dict[int, int] = {}
                for g in spec["groups"]:
                    for c in g:
                        if c in seen:
                            raise TpusimError(
                                f"chakra trace {cset.source!r}: collective "
                                f"{fields['name'][:60]!r} (node {k + 1} in dependency order) "
                                f"runs over groups that overlap at rank {c}; tpusim needs the "
                                f"groups of one collective to be disjoint")
                        seen[c] = 1
            gid = intern_group(spec, group_index, device_groups)
            count_not_block(topology, spec, gid, not_block, notes)
        ops.append(Op(id=k, group=gid, **fields))
    mesh = job_mesh(topology)
    approx = tuple(f"{text} ({count})" for text, count in sorted(notes.items()))
    meta = TraceMeta.of(kind=TraceKind.CHAKRA, source=cset.source, num_chips=n_chips,
                        device_groups=device_groups, chakra_ranks=r,
                        chakra_compute=str(compute), approximations=list(approx))
    trace = Trace(mesh=mesh, ops=tuple(ops), meta=meta)
    return ChakraImport(trace=trace, num_ranks=r, approximations=approx, op_scale=op_scale)


TPUSIM_NOTE = ("written by tpusim: replayed op for op from each node's tpusim_op (the program "
               "as exported; the compute costing asked for does not apply)")


def _tpusim_trace(cset: ChakraSet, topology: Topology) -> ChakraImport:
    """A set tpusim exported (a run's `chakra` output): the program exactly as it was
    simulated, from the op each node carries (checked as a trace file is), on a pod of the
    chips it was written for; per-class files are expanded to the chips their metadata
    lists."""
    first = cset.ranks[0]
    src = f"chakra trace {cset.source!r}"
    n = first.metadata.attrs["tpusim_num_chips"].value
    if not isinstance(n, int) or n != topology.num_chips:
        raise TpusimError(f"{src} was exported from a {n}-chip pod but the {topology.name} pod "
                          f"has {topology.num_chips} chips; replay it on a pod of {n} chips")
    classes = [rp.metadata.attrs.get("tpusim_class_chips") for rp in cset.ranks]
    if all(c is not None for c in classes):
        chips = sorted(int(c) for a in classes for c in (a.value if a.is_list else ()))
        if chips != list(range(n)):
            raise TpusimError(f"{src}: its chip-class files list chips that are not 0..{n - 1} "
                              f"once each; give every class's file")
    elif cset.num_ranks != n:
        raise TpusimError(f"{src} has {cset.num_ranks} rank files for {n} chips; give every "
                          f"chip's file (or the per-class files)")
    rows_of: dict[str, list] = {}
    scale: dict[int, list[float]] = {}
    for rp in cset.ranks:
        if rp.digest not in rows_of:
            rows_of[rp.digest] = _tpusim_rows(rp)
        _tpusim_scales(rp, n, scale)
    # Files whose ops are the same (a program's classes differ in durations) share a program.
    index: dict[str, int] = {}
    prog_rows: list[list] = []
    prog_of_file: list[int] = []
    key_of: dict[str, str] = {}
    for rp in cset.ranks:
        if rp.digest not in key_of:
            key_of[rp.digest] = json.dumps(rows_of[rp.digest], separators=(",", ":"))
        key = key_of[rp.digest]
        if key not in index:
            index[key] = len(prog_rows)
            prog_rows.append(rows_of[rp.digest])
        prog_of_file.append(index[key])
    try:
        mesh = json.loads(first.metadata.attrs["tpusim_mesh"].value)
        groups = json.loads(first.metadata.attrs["tpusim_device_groups"].value)
    except (KeyError, ValueError, RecursionError, AttributeError, TypeError):
        raise TpusimError(f"{src}: its metadata lacks a readable tpusim_mesh or "
                          f"tpusim_device_groups; re-export the step with {{chakra}}",
                          "chakra") from None
    p2p = None
    if len(prog_rows) > 1:
        p2p = _tpusim_p2p(cset, prog_of_file, len(prog_rows), n, src)
    traces = []
    for pi, rows in enumerate(prog_rows):
        doc = {"format": "tpusim-trace", "version": 3, "mesh": mesh,
               "meta": {"num_chips": n, "device_groups": groups} if groups else {"num_chips": n},
               "columns": ["id", *OP_FIELDS, "deps"], "ops": rows}
        peered = frozenset() if p2p is None else frozenset(
            [*p2p["sends"][pi], *p2p["recvs"][pi].values()])
        try:
            tr = Trace.from_json(json.dumps(doc), source=src, peered_sends=peered)
        except TpusimError as exc:  # the trace's own rules (ids, backward deps): name the set
            if src in exc.template:
                raise
            raise TpusimError(f"{src}: {exc.template}", *exc.params) from None
        meta = tr.meta.with_(kind=TraceKind.CHAKRA, source=cset.source,
                             chakra_ranks=cset.num_ranks, chakra_compute="tpusim_op",
                             approximations=[TPUSIM_NOTE])
        traces.append(Trace(mesh=tr.mesh, ops=tr.ops, meta=meta))
    op_scale = {i: tuple(col) for i, col in sorted(scale.items())}
    if len(traces) == 1:
        return ChakraImport(trace=traces[0], num_ranks=cset.num_ranks,
                            approximations=(TPUSIM_NOTE,), op_scale=op_scale)
    prog_of_chip = [0] * n
    for rp, pi in zip(cset.ranks, prog_of_file, strict=True):
        chips = rp.metadata.attrs.get("tpusim_class_chips")
        for c in (chips.value if chips is not None else (rp.metadata.attrs["tpusim_rank"].value,)):
            prog_of_chip[int(c)] = pi
    return ChakraImport(trace=traces[prog_of_chip[0]], num_ranks=cset.num_ranks,
                        approximations=(TPUSIM_NOTE,), programs=tuple(traces),
                        program_of_chip=tuple(prog_of_chip), p2p=p2p, op_scale=op_scale)


def _tpusim_scales(rp: RankProgram, n: int, scale: dict[int, list[float]]) -> None:
    """Add a tpusim-written file's per-op factors (`tpusim_scale`: its rank's share of an
    uneven op) to `scale` ({op id: per chip}), for the chips the file stands for."""
    attrs = rp.metadata.attrs
    chips = attrs.get("tpusim_class_chips")
    chips = chips.value if chips is not None else (attrs["tpusim_rank"].value,)
    for nd in rp.nodes:
        f = nd.attr("tpusim_scale")
        if f is None:
            continue
        if not isinstance(f, float) or not 0.0 < f <= 1e6:
            raise TpusimError(f"chakra file {rp.path!r}: node {nd.id}: tpusim_scale = "
                              f"{str(f)[:40]} must be a factor in (0, 1e6]; re-export the step "
                              f"with {{chakra}}", "chakra")
        col = scale.setdefault(int(nd.id), [1.0] * n)
        for c in chips:
            if 0 <= int(c) < n:
                col[int(c)] = f


def _tpusim_rows(rp: RankProgram) -> list:
    """The trace-file rows (id, op fields, deps) of a tpusim-written file's nodes."""
    rows = []
    for nd in rp.nodes:
        text = nd.attr("tpusim_op")
        if text is None:
            continue
        try:
            if not isinstance(text, str):  # an attribute of another member (edited by hand)
                raise ValueError(text)
            fields = json.loads(text)
        except (ValueError, RecursionError):
            raise TpusimError(f"chakra file {rp.path!r}: node {nd.id}: tpusim_op is not "
                              f"JSON; re-export the step with {{chakra}}", "chakra") from None
        if not isinstance(fields, list):
            raise TpusimError(f"chakra file {rp.path!r}: node {nd.id}: tpusim_op is not a "
                              f"list of op fields; re-export the step with {{chakra}}", "chakra")
        rows.append([nd.id, *fields, list(nd.data_deps)])
    return rows


def _tpusim_p2p(cset: ChakraSet, prog_of_file: list[int], num_programs: int, n: int,
                src: str) -> dict:
    """The point-to-point sends of a tpusim-written set of several programs, from the files'
    `tpusim_p2p` (per program) and `tpusim_p2p_peers` (per channel, every chip's peer)."""
    fix = ("its chips run several programs, so every file needs the tpusim_p2p and "
           "tpusim_p2p_peers metadata tpusim writes; re-export the step with {chakra}")
    sends: list = [None] * num_programs
    recvs: list = [None] * num_programs
    try:
        peers = json.loads(cset.ranks[0].metadata.attrs["tpusim_p2p_peers"].value)
        for rp, pi in zip(cset.ranks, prog_of_file, strict=True):
            if sends[pi] is None:
                doc = json.loads(rp.metadata.attrs["tpusim_p2p"].value)
                sends[pi] = {int(op): (int(ch), int(tag)) for op, ch, tag in doc["sends"]}
                recvs[pi] = {int(tag): int(op) for op, tag in doc["recvs"]}
        peers = [[int(c) for c in nb] for nb in peers]
    except (KeyError, ValueError, RecursionError, AttributeError, TypeError):
        raise TpusimError(f"{src}: {fix}", "chakra") from None
    if not all(len(nb) == n and all(-1 <= c < n for c in nb) for nb in peers):
        raise TpusimError(f"{src}: its tpusim_p2p_peers do not name a chip of 0..{n - 1} (or "
                          f"-1) for each of the {n} chips; re-export the step with {{chakra}}",
                          "chakra")
    return {"peers": peers, "sends": sends, "recvs": recvs}


def replay_notes(cset: ChakraSet, compute: ChakraCompute | str = ChakraCompute.ROOFLINE,
                 comm_groups: dict | None = None) -> tuple[str, ...]:
    """What replaying `cset` approximates (the conversion's notes, without a pod)."""
    compute = ChakraCompute(compute)
    if all("tpusim_format" in rp.metadata.attrs for rp in cset.ranks):
        return (TPUSIM_NOTE,)
    notes: dict[str, int] = _Counter()
    done: dict[str, list] = {}
    per_rank = []
    several = _lengths_differ(cset)
    for rank, rp in enumerate(cset.ranks if not several else ()):
        if rp.digest not in done:
            # One file runs on every chip of the pod, so its whole-job groups are never one rank.
            done[rp.digest] = _program(rp, rank, max(cset.num_ranks, 2), compute, notes,
                                       comm_groups=comm_groups)
        per_rank.append(done[rp.digest])
    if several or (cset.num_ranks > 1 and not _one_program(per_rank)
                   and scaled_program(per_rank, notes) is None):
        # Ranks that run different programs: the notes of that conversion (chakra_trace's).
        notes = _Counter()
        multi = [_program(rp, rank, cset.num_ranks, compute, notes, spmd=False,
                          comm_groups=comm_groups) for rank, rp in enumerate(cset.ranks)]
        prog_of, ranks_of = program_of_ranks(multi)
        sized_programs(multi, ranks_of, rendezvous(multi, prog_of), notes)
        notes[MULTI_NOTE] += 1
    return tuple(f"{text} ({count})" for text, count in sorted(notes.items()))


class _Counter(dict):
    def __missing__(self, key):
        return 0


def _lengths_differ(cset: ChakraSet) -> bool:
    """Whether ranks hold different numbers of nodes: then they run different programs (a node
    is one op), and the conversion as one program is skipped."""
    return len({len(rp.nodes) for rp in cset.ranks}) > 1


def _one_program(per_rank: list) -> bool:
    """Whether every rank runs rank 0's program (the same op fields, and collectives at the
    same places), so the set is one SPMD trace."""
    ref = per_rank[0]
    ref_parts = None
    for prog in per_rank:
        if prog is ref:
            continue
        if len(prog) != len(ref) or any(f1 != f2 for (f1, _p1), (f2, _p2) in
                                        zip(ref, prog, strict=True)):
            return False
        if ref_parts is None:
            ref_parts = [k for k, (_f, p) in enumerate(ref) if p is not None]
        if ref_parts != [k for k, (_f, p) in enumerate(prog) if p is not None]:
            return False
    return True
