"""A simulated step as Chakra execution traces (the CLI's `chakra` directory): one file per
chip class (the default: every chip of a class runs the same program, and the class and its
chips are in the file's metadata) or per chip (`chakra_every_chip`), `DIR/tpusim.<rank>.et`,
which ASTRA-sim's reader accepts.

Every op becomes one node with the id of the op, its dependencies as `data_deps`, and as
`ctrl_deps` the op before it on the chip's core (compute runs in program order there, as
tpusim scheduled it): compute ops COMP_NODEs with `num_ops` (FLOPs), `tensor_size` (HBM
bytes) and their simulated `duration_micros`; collectives COMM_COLL_NODEs with their kind,
`comm_size` in ASTRA-sim's meaning (the rank's buffer: V for all-reduce and reduce-scatter,
V / group for all-gather and all-to-all), `pg_name` naming the chip's replica group, defined
by a `process_group:init` METADATA_NODE as PyTorch's converter writes it, and `involved_dim`
flagging the pod dimensions (x, y[, z], then DCN) the group's chips differ on; host transfers
MEM_STORE_NODEs; idle time COMP_NODEs of its duration. What Chakra cannot say is written in its
nearest form and listed in the metadata (`tpusim_approximations`): a collective-permute is a
COMM_SEND_NODE to the next chip of its group and a COMM_RECV_NODE from the previous one, XLA's
async start/done pairs are one node each (the dependencies keep the overlap), and replica
groups are explicit rank lists. Each node also carries the op itself (`tpusim_op`, ignored by
other readers), so `tpusim replay DIR` runs exactly the program that was exported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.engine.costs import collective_groups, op_group_axes
from sim.engine.result import StepResult
from sim.export.output import write_bytes
from topologies.errors import TpusimError
from topologies.groups import GroupGeometry
from topologies.progress import tracked
from workloads.chakra.convert import PodDims
from workloads.chakra.convert_fields import OP_FIELDS
from workloads.chakra.wire import (
    Attr,
    CommType,
    GlobalMetadata,
    IOInfo,
    Member,
    Node,
    NodeType,
    bool_attr,
    bool_list_attr,
    encode_file,
    int32_attr,
    int64_attr,
    string_attr,
    uint64_attr,
)
from workloads.trace import OpKind, Trace

PREFIX = "tpusim"
TPUSIM_FORMAT = "tpusim-chakra 1"
_COMM = {"all-reduce": (CommType.ALL_REDUCE, False), "reduce-scatter": (CommType.REDUCE_SCATTER,
                                                                         False),
         "all-gather": (CommType.ALL_GATHER, True), "all-to-all": (CommType.ALL_TO_ALL, True)}
APPROXIMATIONS = (
    "collective-permute: a COMM_SEND_NODE to the next rank of its group (by chip id) and a "
    "COMM_RECV_NODE from the previous one; dependents wait on the send",
    "XLA's async collective start/done pairs: one node per collective, its dependents as "
    "tpusim scheduled them",
    "replica groups: explicit rank lists (pg_name and a process_group:init METADATA_NODE), "
    "not mesh axes",
    "durations: whole microseconds in duration_micros (the exact seconds are in tpusim_op)",
)


@dataclass(frozen=True, slots=True)
class ChakraPlan:
    """The encoded files of an export (validated and built before anything is written)."""

    files: tuple[tuple[str, bytes], ...]

    def write(self, directory: str | Path) -> list[Path]:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        return [write_bytes(d / name, data) for name, data in self.files]


def _durations(result: StepResult, trace: Trace, k: int) -> np.ndarray:
    """Each op's simulated duration on chip class `k` (the representative chip's)."""
    cls = result.classes
    if cls is not None and k in cls.timelines:
        start, end = cls.timelines[k]
        return np.asarray(end, dtype=float) - np.asarray(start, dtype=float)
    dur = np.zeros(len(trace.ops))
    for row in result.op_rows:
        if row[0] == (int(cls.reps[k]) if cls is not None else row[0]):
            dur[row[1]] = row[9] - row[8]
    return dur


def _members(topology, gaxes) -> tuple[np.ndarray, dict[int, list[int]]]:
    geo = GroupGeometry(topology, gaxes)
    of = np.asarray(geo.group_of_chip)
    groups: dict[int, list[int]] = {}
    for c, g in enumerate(of.tolist()):
        groups.setdefault(g, []).append(c)
    return of, groups


@dataclass(slots=True)
class _Program:
    """What every rank file of one program shares: per collective its group size and replica
    groups (`pg_of`), each op's `tpusim_op` text, the op before each compute op on the core,
    and the program's point-to-point sends {op: (channel, tag)} and receives {op: tag}."""

    trace: Trace
    pg_of: dict
    op_text: list[str]
    core_prev: list[int | None]
    sends: dict[int, tuple[int, int]]
    recvs: dict[int, int]


def _program(trace: Trace, topo, specs: dict, geo: dict, sends=None, recvs=None) -> _Program:
    groups = collective_groups(trace, topo)
    dev: dict = {}
    sends = dict(sends or {})
    recv_of = {int(op): int(tag) for tag, op in (recvs or {}).items()}
    # Per collective op: its group size and, per chip, its replica group (a pg id) and members.
    pg_of: dict[int, tuple] = {}
    for op in trace.ops:
        if op.kind != OpKind.COLLECTIVE or op.id in sends or op.id in recv_of:
            continue
        gaxes, key = op_group_axes(topo, trace, op, groups, dev)
        skey = (tuple(gaxes), op.group if len(key) == 4 else -1)
        if skey not in specs:
            specs[skey] = len(specs)
        if len(key) == 4:  # explicit [src, dst] pairs (HLO import)
            pairs = dev[op.group][1]
            pg_of[op.id] = (None, {"pairs": pairs}, 2, specs[skey])
        else:
            if skey not in geo:
                geo[skey] = _members(topo, tuple(gaxes))
            of, members = geo[skey]
            size = int(np.prod([g.size for g in gaxes])) if gaxes else 1
            pg_of[op.id] = (of, members, size, specs[skey])
    op_text = [json.dumps([_field(op, f) for f in OP_FIELDS], separators=(",", ":"))
               for op in trace.ops]
    core_prev: list[int | None] = []
    last = None
    for op in trace.ops:
        core_prev.append(last if op.kind in (OpKind.COMPUTE, OpKind.IDLE) else None)
        if op.kind in (OpKind.COMPUTE, OpKind.IDLE):
            last = op.id
    return _Program(trace=trace, pg_of=pg_of, op_text=op_text, core_prev=core_prev,
                    sends=sends, recvs=recv_of)


def _p2p_of(cls) -> tuple | None:
    """(the `PointToPoint` of a step whose chips send to each other, {class: program index},
    per channel the chip that sends to each chip (-1: none), {tag: channel}) or None."""
    if cls is None or cls.p2p is None:
        return None
    p2p, prog_of_class = cls.p2p
    peers = [np.asarray(nb, dtype=np.int64) for nb in p2p.peer_of_chip]
    senders = []
    for nb in peers:
        inv = np.full(len(nb), -1, dtype=np.int64)
        ok = nb >= 0
        inv[nb[ok]] = np.flatnonzero(ok)
        senders.append(inv)
    channel_of_tag = {int(tag): int(ch) for sends in p2p.sends for ch, tag in sends.values()}
    return p2p, prog_of_class, senders, channel_of_tag


def plan_chakra(trace: Trace, result: StepResult, *, every_chip: bool = False) -> ChakraPlan:
    """Encode `trace` as simulated in `result` (see the module docstring): a step whose chips
    run several programs (pipeline stages) writes each class's (or rank's) own program."""
    topo = result.pod
    if topo is None:
        raise TpusimError("internal error: the result has no pod to export to Chakra")
    cls = result.classes
    n = topo.num_chips
    if cls is None:
        of_chip, reps = np.zeros(n, dtype=int), np.array([0])
    else:
        of_chip, reps = np.asarray(cls.of_chip), np.asarray(cls.reps)
    ranks = list(range(n)) if every_chip else [int(r) for r in reps]
    p2p = _p2p_of(cls)
    # An uneven MoE router's per-chip loads: each file writes its rank's own sizes.
    op_scale = {int(i): np.asarray(col, dtype=float)
                for i, col in (cls.op_scale.items() if cls is not None else ())}
    specs: dict[tuple, int] = {}
    geo: dict[tuple, tuple] = {}  # per group geometry: a step has a handful, used by many ops
    programs: dict[int, _Program] = {}  # by program index (0: `trace`)

    def program_of(k: int) -> tuple[int, _Program]:
        if p2p is None and not (cls is not None and cls.programs):
            pi, tr = 0, trace
        elif p2p is not None:
            pi = int(p2p[1][k])
            tr = cls.programs[k].trace if cls.programs else trace
        else:
            raise TpusimError(
                "{chakra}: this step runs several programs without point-to-point sends, which "
                "tpusim does not export to Chakra; export a step of one program", "chakra")
        if pi not in programs:
            programs[pi] = _program(tr, topo, specs, geo,
                                    p2p[0].sends[pi] if p2p else None,
                                    p2p[0].recvs[pi] if p2p else None)
        return pi, programs[pi]

    mesh_json = json.dumps(trace.mesh.to_dict(), separators=(",", ":"))
    groups_json = json.dumps(trace.meta.device_groups or [], separators=(",", ":"))
    base_meta = {
        "tpusim_format": string_attr(TPUSIM_FORMAT),
        "tpusim_num_chips": int64_attr(n),
        "tpusim_mesh": string_attr(mesh_json),
        "tpusim_device_groups": string_attr(groups_json),
        "tpusim_kind": string_attr(str(trace.meta.kind or "")),
        "tpusim_approximations": Attr(Member.STRING, APPROXIMATIONS, True),
    }
    if p2p is not None:
        base_meta["tpusim_p2p_peers"] = string_attr(json.dumps(
            [np.asarray(nb).tolist() for nb in p2p[0].peer_of_chip], separators=(",", ":")))
    files = []
    durs: dict[int, np.ndarray] = {}
    dims: dict = {"pod": PodDims.of(topo)}  # involved_dim per group, by _involved
    for rank in tracked(ranks, "Chakra export", unit="rank file" if every_chip else "class file"):
        k = int(of_chip[rank])
        pi, prog = program_of(k)
        if k not in durs:
            durs[k] = _durations(result, prog.trace, k)
        scale = {op_id: float(col[rank]) for op_id, col in op_scale.items()
                 if op_id < len(prog.trace.ops) and float(col[rank]) != 1.0}
        nodes, pgs = _rank_nodes(prog, rank, durs[k], n, p2p, dims, scale)
        attrs = dict(base_meta)
        if not every_chip:
            chips = np.flatnonzero(of_chip == k).tolist()
            attrs["tpusim_chip_class"] = int64_attr(k)
            attrs["tpusim_class_chips"] = Attr(Member.INT64, tuple(chips), True)
        attrs["tpusim_rank"] = int64_attr(rank)
        if p2p is not None:
            attrs["tpusim_program"] = int64_attr(pi)
            attrs["tpusim_p2p"] = string_attr(json.dumps(
                {"sends": sorted([op, ch, tag] for op, (ch, tag) in prog.sends.items()),
                 "recvs": sorted([op, tag] for op, tag in prog.recvs.items())},
                separators=(",", ":")))
        if pgs:
            init = json.dumps([{"pg_name": name, "ranks": members, "pg_desc": ""}
                               for name, members in sorted(pgs.items(), key=lambda kv: int(
                                   kv[0]))], separators=(",", ":"))
            nodes.append(Node(id=len(prog.trace.ops) * 2 + 1, name="process_group:init",
                              type=NodeType.METADATA_NODE,
                              inputs=IOInfo(values=f"[[{init}]]", shapes="[[]]",
                                            types="['String']")))
        name = f"{PREFIX}.{rank if every_chip else k}.et"
        files.append((name, encode_file(GlobalMetadata(version="0.0.4", attrs=attrs), nodes)))
    return ChakraPlan(files=tuple(files))


def _field(op, f: str):
    v = getattr(op, f)
    return list(v) if isinstance(v, tuple) else (str(v) if hasattr(v, "value") else v)


def _involved(dims: dict, mem: list[int]) -> Attr:
    """involved_dim of a collective over `mem`: per pod dimension (x, y[, z], then DCN),
    whether its members' coordinates differ there (`dims` caches them by group)."""
    key = (mem[0], len(mem), mem[-1])
    got = dims.get(key)
    if got is None or got[0] != mem:
        coords = dims["pod"].coords[mem]
        got = dims[key] = (mem, bool_list_attr((coords != coords[0]).any(axis=0).tolist()))
    return got[1]


def _rank_nodes(prog: _Program, rank: int, dur, n: int, p2p, dims: dict,
                scale: dict[int, float]):
    trace, pg_of, op_text, core_prev = prog.trace, prog.pg_of, prog.op_text, prog.core_prev
    nodes: list[Node] = []
    pgs: dict[str, list[int]] = {}
    extra = len(trace.ops)
    for op in trace.ops:
        deps = tuple(op.deps)
        ctrl = () if core_prev[op.id] is None else (core_prev[op.id],)
        attrs = {"is_cpu_op": bool_attr(False)}
        d = float(dur[op.id]) if op.id < len(dur) else 0.0
        micros = int(round(d * 1e6))
        f = scale.get(op.id, 1.0)
        if f != 1.0:
            attrs["tpusim_scale"] = Attr(Member.DOUBLE, f)
        if op.kind == OpKind.COMPUTE:
            attrs["num_ops"] = int64_attr(int(round(op.flops * f)))
            attrs["tensor_size"] = uint64_attr(int(round(op.hbm_bytes * f)))
            t = NodeType.COMP_NODE
        elif op.kind == OpKind.IDLE:
            t = NodeType.COMP_NODE
        elif op.kind == OpKind.HOST:
            attrs["tensor_size"] = uint64_attr(int(round(op.bytes)))
            t = NodeType.MEM_STORE_NODE
        elif op.id in prog.sends:  # a stage-to-stage send: to this chip's peer on its channel
            ch, tag = prog.sends[op.id]
            dst = int(p2p[0].peer_of_chip[ch][rank])
            t = NodeType.COMM_SEND_NODE
            attrs.update(comm_src=int32_attr(rank), comm_dst=int32_attr(dst),
                         comm_tag=int32_attr(tag), comm_size=int64_attr(int(round(op.bytes))))
        elif op.id in prog.recvs:  # done when the send of its tag from the chip feeding it is
            tag = prog.recvs[op.id]
            src = int(p2p[2][p2p[3][tag]][rank])
            t = NodeType.COMM_RECV_NODE
            attrs.update(comm_src=int32_attr(src), comm_dst=int32_attr(rank),
                         comm_tag=int32_attr(tag), comm_size=int64_attr(int(round(op.bytes))))
        else:
            of, members, size, spec = pg_of[op.id]
            if op.collective in _COMM:
                ct, per_rank = _COMM[op.collective]
                attrs["comm_type"] = int64_attr(int(ct))
                size_b = (op.bytes / size if per_rank else op.bytes) * f
                attrs["comm_size"] = int64_attr(int(round(size_b)))
                g = int(of[rank])
                mem = members[g]
                name = "0" if len(mem) == n else str(1 + spec * n + g)
                if name != "0":
                    pgs.setdefault(name, mem)
                attrs["pg_name"] = string_attr(name)
                attrs["involved_dim"] = _involved(dims, mem)
                t = NodeType.COMM_COLL_NODE
            else:  # collective-permute / send: to the next chip of the group, by chip id
                if of is None:
                    pairs = members["pairs"]
                    dst = next((b for a, b in pairs if a == rank), None)
                    src = next((a for a, b in pairs if b == rank), None)
                else:
                    mem = members[int(of[rank])]
                    i = mem.index(rank)
                    dst, src = mem[(i + 1) % len(mem)], mem[(i - 1) % len(mem)]
                    if dst == rank:
                        dst = src = None
                if dst is None:
                    t = NodeType.COMP_NODE  # this chip sends nothing in the permute
                else:
                    t = NodeType.COMM_SEND_NODE
                    attrs.update(comm_src=int32_attr(rank), comm_dst=int32_attr(dst),
                                 comm_tag=int32_attr(op.id),
                                 comm_size=int64_attr(int(round(op.bytes))))
                if src is not None:
                    nodes.append(Node(
                        id=extra + op.id, name=f"{op.name[:190]}/recv",
                        type=NodeType.COMM_RECV_NODE, data_deps=deps,
                        attrs={"is_cpu_op": bool_attr(False), "comm_src": int32_attr(src),
                               "comm_dst": int32_attr(rank), "comm_tag": int32_attr(op.id),
                               "comm_size": int64_attr(int(round(op.bytes))),
                               "tpusim_skip": bool_attr(True)}))
        attrs["tpusim_op"] = string_attr(op_text[op.id])
        nodes.append(Node(id=op.id, name=op.name, type=t, data_deps=deps, ctrl_deps=ctrl,
                          duration_micros=micros, attrs=attrs))
    return nodes, pgs
