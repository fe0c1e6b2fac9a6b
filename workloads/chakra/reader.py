"""Reading a set of per-rank Chakra files (`PREFIX.<rank>.et`, a directory of them, or one
`.et`/`.et.gz` file), checked node by node, and the set's inventory (`tpusim import-chakra`).

Every limit is checked before the memory it guards is taken: a file's stored size, its
decompressed size (read in bounded chunks, so a gzip bomb stops at the limit), the nodes per
rank and in the whole set, every count a node carries. A rank whose node records are the same
bytes as an earlier rank's (an SPMD program written per rank) is decoded once and shared.
Dependencies are resolved by id, in both lists (ASTRA-sim's current reader honours `ctrl_deps`
and `data_deps` alike); they may point forward, so each rank is ordered topologically (ready
nodes smallest id first, as Chakra's feeder issues them) and a cycle is refused. A dependency
on an id that is not in the file is dropped and counted, as the reader that runs these traces
does (it becomes a vertex with no node behind it).
"""

from __future__ import annotations

import hashlib
import heapq
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.validate import MAX_BYTES, MAX_TRACE_OPS
from workloads.chakra.wire import (
    ChakraFormatError,
    CommType,
    GlobalMetadata,
    Member,
    Node,
    NodeType,
    decode_metadata,
    decode_node,
    records,
)

# A file's bytes once decompressed (Chakra's PyTorch converter writes ~800 bytes per node, so
# this holds ~300k of them), the ranks of one set, and the nodes decoded in all (each distinct
# rank's; identical ranks share theirs): ~500 bytes of Python objects each.
MAX_FILE_BYTES = 256 << 20
MAX_RANKS = 65_536
MAX_SET_NODES = 2_000_000
# Counts above these are not a real program: a collective's bytes (1 PiB, as `tpusim
# collective --bytes`), a compute node's operations or tensor bytes, a duration (a day).
MAX_NUM_OPS = 1e24
MAX_DURATION_MICROS = 86_400 * 10**6
COMM_NODE_TYPES = (NodeType.COMM_COLL_NODE, NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)
_RANK_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<rank>0|[1-9][0-9]{0,8})\.et(?P<gz>\.gz)?$")
FIX = "regenerate the trace with Chakra's converter or tpusim's exporter"


@dataclass(slots=True, kw_only=True)
class RankProgram:
    """One rank's file: its metadata, its nodes in dependency order, and what was dropped."""

    path: str
    metadata: GlobalMetadata
    nodes: list[Node]  # topologically ordered (ready nodes smallest id first)
    missing_dep_ids: int = 0  # dependencies on ids not in the file, dropped
    forward_deps: int = 0  # data dependencies on a larger id (ordered, not refused)
    self_deps: int = 0  # a node listed as its own dependency, dropped
    ctrl_cycle_deps: int = 0  # control dependencies that closed a cycle, dropped
    digest: str = ""  # SHA-256 of the node records: equal digests are the same program


@dataclass(slots=True, kw_only=True)
class ChakraSet:
    """A per-rank file set: `ranks[r]` is rank r's program (identical ranks share one)."""

    source: str
    ranks: list[RankProgram] = field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)


def _err(path: str, where: str, rule: str, fix: str = FIX) -> TpusimError:
    return TpusimError(f"chakra file {path!r}: {where}: {rule}; {fix}")


def rank_files(spec: str) -> tuple[str, list[Path]]:
    """(description, files in rank order) of PREFIX, a directory or one file. Ranks must be
    0, 1, ..., R-1 with no gaps and one file each (`.et` or `.et.gz`)."""
    p = Path(spec)
    if p.is_file():
        if not (p.name.endswith(".et") or p.name.endswith(".et.gz")):
            raise TpusimError(f"chakra file {spec!r} does not end in .et or .et.gz; give a "
                              f"Chakra file, a PREFIX of PREFIX.<rank>.et files or a directory")
        return spec, [p]
    if p.is_dir():
        found: dict[str, dict[int, Path]] = {}
        for f in sorted(p.iterdir()):
            m = _RANK_FILE.match(f.name)
            if m and f.is_file():
                found.setdefault(m["prefix"], {})
                if int(m["rank"]) in found[m["prefix"]]:
                    raise TpusimError(f"chakra directory {spec!r} holds rank {m['rank']} of "
                                      f"{m['prefix']!r} twice (.et and .et.gz); keep one")
                found[m["prefix"]][int(m["rank"])] = f
            if sum(len(v) for v in found.values()) > MAX_RANKS:
                break
        if not found:
            raise TpusimError(f"chakra directory {spec!r} holds no PREFIX.<rank>.et(.gz) files; "
                              f"give the directory of a per-rank Chakra trace")
        if len(found) > 1:
            raise TpusimError(f"chakra directory {spec!r} holds several traces ("
                              f"{', '.join(sorted(found)[:4])}); give one as its PREFIX")
        prefix, by_rank = next(iter(found.items()))
        return _contiguous(str(p / prefix), by_rank)
    parent = p.parent if str(p.parent) else Path(".")
    by_rank = {}
    if parent.is_dir():
        for f in sorted(parent.iterdir()):
            m = _RANK_FILE.match(f.name)
            if m and m["prefix"] == p.name and f.is_file():
                if int(m["rank"]) in by_rank:
                    raise TpusimError(f"chakra trace {spec!r} has rank {m['rank']} twice (.et "
                                      f"and .et.gz); keep one")
                by_rank[int(m["rank"])] = f
                if len(by_rank) > MAX_RANKS:
                    break
    if not by_rank:
        raise TpusimError(f"chakra trace {spec!r}: no file, directory or {spec}.<rank>.et files "
                          f"exist; give a Chakra file, a directory or a PREFIX")
    return _contiguous(spec, by_rank)


def _contiguous(prefix: str, by_rank: dict[int, Path]) -> tuple[str, list[Path]]:
    if len(by_rank) > MAX_RANKS:
        raise TpusimError(f"chakra trace {prefix!r} has more than {MAX_RANKS:,} rank files, "
                          f"more than tpusim replays in one run")
    missing = [r for r in range(len(by_rank)) if r not in by_rank]
    if missing:
        raise TpusimError(f"chakra trace {prefix!r} has {len(by_rank)} rank files but no rank "
                          f"{missing[0]} (ranks must be 0..{len(by_rank) - 1}); give every "
                          f"rank's file")
    return prefix, [by_rank[r] for r in range(len(by_rank))]


def read_bytes(path: Path) -> bytes:
    """A file's bytes, gunzipped when it starts with gzip's magic, never more than
    `MAX_FILE_BYTES` in memory (read and inflated in bounded chunks)."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head != b"\x1f\x8b":
                data = f.read(MAX_FILE_BYTES + 1)
                if len(data) > MAX_FILE_BYTES:
                    raise _err(name, "the file", f"it is over {MAX_FILE_BYTES >> 20} MiB, the "
                                                 f"most tpusim reads of one rank",
                               "split the trace or replay fewer iterations")
                return data
            out = bytearray()
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while True:
                chunk = inflater.unconsumed_tail or f.read(1 << 16)
                if not chunk:
                    break
                out += inflater.decompress(chunk, MAX_FILE_BYTES + 1 - len(out))
                if len(out) > MAX_FILE_BYTES:
                    raise _err(name, "the gzip stream",
                               f"it inflates to over {MAX_FILE_BYTES >> 20} MiB, the most tpusim "
                               f"reads of one rank (a gzip bomb, or a trace too large)",
                               "split the trace or replay fewer iterations")
                if inflater.eof:
                    break
            if not inflater.eof:
                raise _err(name, "the gzip stream", "it ends before its end marker (truncated)",
                           "copy the file again")
            return bytes(out)
    except zlib.error as exc:
        raise _err(name, "the gzip stream", f"it is corrupt ({exc})", "copy the file again") \
            from None
    except OSError as exc:
        raise TpusimError(f"chakra file {name!r} cannot be read: {exc.strerror or exc}") from None


def _where(i: int, node: Node | None) -> str:
    if node is None:
        return f"record {i + 1}"
    return f"node {node.id} ({node.name[:60]!r}, record {i + 1})"


def _check_node(path: str, i: int, n: Node) -> None:
    """The rules a node must satisfy to be replayed (its type, its comm attributes, its
    counts)."""
    try:
        t = NodeType(n.type)
    except ValueError:
        raise _err(path, _where(i, n), f"unknown node type {n.type} (Chakra's NodeType is "
                                       f"0..7)") from None
    if n.duration_micros > MAX_DURATION_MICROS:
        raise _err(path, _where(i, n), f"duration_micros {n.duration_micros:,} is over a day")
    for key in ("num_ops", "tensor_size"):
        v = n.attr(key)
        if v is not None and (isinstance(v, (tuple, str, bytes)) or not 0 <= v <= MAX_NUM_OPS):
            raise _err(path, _where(i, n), f"{key} = {str(v)[:40]} must be a number in "
                                           f"[0, {MAX_NUM_OPS:g}]")
    if t not in COMM_NODE_TYPES:
        return
    cpu = bool(n.attr("is_cpu_op", False))
    ct = n.attr("comm_type")
    if t == NodeType.COMM_COLL_NODE and cpu and ct is None:
        return  # a host-side c10d bookkeeping op (PyTorch traces): replayed at its duration
    size = n.attr("comm_size")
    if size is None:
        raise _err(path, _where(i, n), f"a {t.name} has no comm_size (ASTRA-sim requires it: "
                                       f"the bytes it moves)")
    if isinstance(size, (tuple, str, bytes)) or not 0 <= size <= MAX_BYTES:
        raise _err(path, _where(i, n), f"comm_size = {str(size)[:40]} must be bytes in "
                                       f"[0, {MAX_BYTES:,}] (1 PiB)")
    if t == NodeType.COMM_COLL_NODE:
        try:
            CommType(ct) if isinstance(ct, int) and not isinstance(ct, bool) else CommType(-1)
        except ValueError:
            raise _err(path, _where(i, n), f"comm_type = {str(ct)[:40]} is not a Chakra "
                                           f"CollectiveCommType (0..9)") from None
        dims = n.attrs.get("involved_dim")
        if dims is not None and not (dims.is_list and dims.member == Member.BOOL):
            # ASTRA-sim's Workload.cc reads only a bool_list here and exits on anything else.
            raise _err(path, _where(i, n), "involved_dim must be a bool_list (one flag per "
                                           "network dimension)")
    else:
        peer = "comm_dst" if t == NodeType.COMM_SEND_NODE else "comm_src"
        if not isinstance(n.attr(peer), int):
            raise _err(path, _where(i, n), f"a {t.name} has no {peer} (the peer rank)")


@dataclass(frozen=True, slots=True)
class Order:
    """A rank's nodes in dependency order and what ordering them dropped."""

    nodes: list[Node]
    missing_dep_ids: int  # dependencies on ids not in the file
    forward_deps: int  # data dependencies on a larger id (kept: they only reorder)
    self_deps: int  # a node named as its own dependency
    ctrl_cycle_deps: int  # control dependencies that closed a cycle, dropped


def order_nodes(path: str, nodes: list[Node]) -> Order:
    """Kahn's algorithm over both dependency lists, ready nodes smallest id first.

    A data-dependency cycle is refused, naming a node on it. Control dependencies (in PyTorch
    traces, the caller in the host call stack) can name each other in a circle (Chakra's own
    test trace has a kernel and its launching op do so): when nothing is ready, the smallest-id
    node waiting only on control parents is released and those edges are dropped and counted.
    """
    index = {n.id: k for k, n in enumerate(nodes)}
    missing = forward = selfdeps = dropped = 0
    children: list[list[tuple[int, bool]]] = [[] for _ in nodes]
    n_data = [0] * len(nodes)
    n_ctrl = [0] * len(nodes)
    for k, n in enumerate(nodes):
        seen: set[int] = set()
        for is_data, deps in ((True, n.data_deps), (False, n.ctrl_deps)):
            for d in deps:
                j = index.get(d)
                if j is None:
                    missing += 1
                    continue
                if j == k:
                    # PyTorch-derived traces list a node as its own control parent (383 times
                    # in Chakra's test trace): no order can honour that, and it says nothing.
                    selfdeps += 1
                    continue
                if j in seen:
                    continue
                seen.add(j)
                if is_data and d > n.id:
                    forward += 1
                children[j].append((k, is_data))
                if is_data:
                    n_data[k] += 1
                else:
                    n_ctrl[k] += 1
    ready = [(n.id, k) for k, n in enumerate(nodes) if n_data[k] == 0 and n_ctrl[k] == 0]
    ctrl_only = [(n.id, k) for k, n in enumerate(nodes) if n_data[k] == 0 and n_ctrl[k] > 0]
    heapq.heapify(ready)
    heapq.heapify(ctrl_only)
    done = [False] * len(nodes)
    out: list[Node] = []
    while len(out) < len(nodes):
        if not ready:
            while ctrl_only and done[ctrl_only[0][1]]:
                heapq.heappop(ctrl_only)
            if not ctrl_only:
                break
            _, k = heapq.heappop(ctrl_only)
            dropped += n_ctrl[k]
            n_ctrl[k] = 0
        else:
            _, k = heapq.heappop(ready)
        done[k] = True
        out.append(nodes[k])
        for c, is_data in children[k]:
            if done[c]:
                continue  # released past a control cycle: the edge was dropped
            if is_data:
                n_data[c] -= 1
            else:
                n_ctrl[c] -= 1
            if n_data[c] == 0:
                if n_ctrl[c] == 0:
                    heapq.heappush(ready, (nodes[c].id, c))
                elif is_data:
                    heapq.heappush(ctrl_only, (nodes[c].id, c))
    if len(out) < len(nodes):
        k = min((k for k in range(len(nodes)) if not done[k]), key=lambda k: nodes[k].id)
        # Record k + 2: the GlobalMetadata is record 1.
        raise _err(path, _where(k + 1, nodes[k]), "its data dependencies form a cycle (no order "
                                                  "of the nodes satisfies them)")
    return Order(nodes=out, missing_dep_ids=missing, forward_deps=forward, self_deps=selfdeps,
                 ctrl_cycle_deps=dropped)


def read_rank(path: Path, data: bytes | None = None) -> tuple[GlobalMetadata, list[Node], bytes]:
    """(metadata, nodes in file order, the raw node records) of one rank's file."""
    name = str(path)
    buf = read_bytes(path) if data is None else data
    nodes: list[Node] = []
    gm = None
    i = body = 0
    try:
        for a, b in records(buf):
            if i == 0:
                gm = decode_metadata(buf, a, b)
                body = b
                i += 1
                continue
            if i > MAX_TRACE_OPS:
                raise _err(name, f"record {i + 1}", f"the file holds more than "
                                                    f"{MAX_TRACE_OPS:,} nodes, the most tpusim "
                                                    f"replays per rank",
                           "split the trace or replay fewer iterations")
            n = decode_node(buf, a, b)
            _check_node(name, i, n)
            nodes.append(n)
            i += 1
    except ChakraFormatError as exc:
        raise _err(name, f"record {i + 1}", str(exc)) from None
    if gm is None:
        raise _err(name, "the file", "it is empty (no GlobalMetadata record)")
    if not nodes:
        raise _err(name, "the file", "it holds no nodes (only the GlobalMetadata record)")
    ids = Counter(n.id for n in nodes)
    dup = next((k for k, c in ids.items() if c > 1), None)
    if dup is not None:
        k = next(k for k, n in enumerate(nodes) if n.id == dup)
        raise _err(name, _where(k + 1, nodes[k]), f"node id {dup} appears {ids[dup]} times "
                                                  f"(ids are unique within a file)")
    return gm, nodes, buf[body:]


def read_set(spec: str) -> ChakraSet:
    """Read and check every rank of PREFIX, a directory or one file."""
    source, files = rank_files(spec)
    out = ChakraSet(source=source)
    by_digest: dict[str, RankProgram] = {}
    total = 0
    for f in files:
        data = read_bytes(f)
        # The node records only (the metadata may name the rank): ranks with the same records
        # run the same program, decoded and ordered once.
        gm_end = _metadata_end(str(f), data)
        digest = hashlib.sha256(data[gm_end:]).hexdigest()
        hit = by_digest.get(digest)
        if hit is not None:
            gm = decode_metadata(data, *_first_record(data))
            out.ranks.append(RankProgram(path=str(f), metadata=gm, nodes=hit.nodes,
                                         missing_dep_ids=hit.missing_dep_ids,
                                         forward_deps=hit.forward_deps,
                                         self_deps=hit.self_deps,
                                         ctrl_cycle_deps=hit.ctrl_cycle_deps, digest=digest))
            continue
        gm, nodes, _ = read_rank(f, data)
        total += len(nodes)
        if total > MAX_SET_NODES:
            raise TpusimError(f"chakra trace {source!r} holds more than {MAX_SET_NODES:,} nodes "
                              f"in ranks that differ (by rank {len(out.ranks)}); tpusim replays "
                              f"at most that many; replay fewer iterations or ranks")
        o = order_nodes(str(f), nodes)
        rp = RankProgram(path=str(f), metadata=gm, nodes=o.nodes,
                         missing_dep_ids=o.missing_dep_ids, forward_deps=o.forward_deps,
                         self_deps=o.self_deps, ctrl_cycle_deps=o.ctrl_cycle_deps,
                         digest=digest)
        by_digest[digest] = rp
        out.ranks.append(rp)
    return out


def _first_record(data: bytes) -> tuple[int, int]:
    for span in records(data):
        return span
    return 0, 0


def _metadata_end(name: str, data: bytes) -> int:
    try:
        return _first_record(data)[1]
    except ChakraFormatError as exc:
        raise _err(name, "record 1", str(exc)) from None


# -- the inventory ---------------------------------------------------------------------------
def comm_bytes_of(n: Node) -> int:
    """A comm node's comm_size (0 when it carries none: a host-side bookkeeping op)."""
    v = n.attr("comm_size")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def inventory(cset: ChakraSet, approximations: list[str] | None = None) -> dict[str, Any]:
    """What the set holds, summed over ranks (the JSON of `tpusim import-chakra`): nodes by type,
    collectives by kind with their bytes (comm_size summed, as the manifest counts them), and
    per rank the same for rank 0 and any rank that differs."""
    by_type: Counter = Counter()
    by_kind: Counter = Counter()
    bytes_by_kind: Counter = Counter()
    comm = 0
    missing = forward = selfdeps = cyc = 0
    duration = 0
    distinct = {rp.digest for rp in cset.ranks}
    for rp in cset.ranks:
        missing += rp.missing_dep_ids
        forward += rp.forward_deps
        selfdeps += rp.self_deps
        cyc += rp.ctrl_cycle_deps
        for n in rp.nodes:
            t = NodeType(n.type)
            by_type[t.name] += 1
            duration += n.duration_micros
            if t in COMM_NODE_TYPES:
                comm += comm_bytes_of(n)
            if t == NodeType.COMM_COLL_NODE and n.attr("comm_type") is not None:
                k = CommType(n.attr("comm_type")).name
                by_kind[k] += 1
                bytes_by_kind[k] += comm_bytes_of(n)
            elif t in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE):
                by_kind[t.name.removeprefix("COMM_").removesuffix("_NODE")] += 1
                bytes_by_kind[t.name.removeprefix("COMM_").removesuffix("_NODE")] += \
                    comm_bytes_of(n)
    rank0 = cset.ranks[0]
    return {
        "source": cset.source,
        "num_ranks": cset.num_ranks,
        "num_distinct_programs": len(distinct),
        "num_nodes": int(sum(by_type.values())),
        "nodes_by_type": dict(sorted(by_type.items())),
        "collectives_by_kind": {k: {"count": by_kind[k], "comm_bytes": bytes_by_kind[k]}
                                for k in sorted(by_kind)},
        "comm_bytes": comm,
        "duration_micros": duration,
        "deps_to_missing_ids": missing,
        "forward_data_deps": forward,
        "self_deps_dropped": selfdeps,
        "ctrl_cycle_deps_dropped": cyc,
        "metadata": {"version": rank0.metadata.version,
                     "attrs": {k: (a.value if not isinstance(a.value, bytes) else
                                   a.value.hex()[:64])
                               for k, a in rank0.metadata.attrs.items()
                               if not isinstance(a.value, tuple)}},
        "approximations": list(approximations or []),
    }
