"""A Chakra set whose ranks run different programs (a pipeline's stages: each stage's ranks
their own nodes, sends and receives between the stages) as per-chip programs for the per-chip
engine.

Ranks whose nodes convert to the same ops (up to the groups their collectives name and the
peers their sends and receives name) share a program. A collective is a rendezvous of the
ranks of its process group at the same place in their programs (ops are numbered in each
rank's dependency order): every member must run the same collective there (kind and size), or
the set is refused naming both nodes. A COMM_SEND_NODE is a point-to-point transfer of
comm_size bytes to comm_dst on its route; a COMM_RECV_NODE is done when the send of the same
comm_tag from its comm_src has landed. Sends are matched to receives by (source, destination,
tag), as ASTRA-sim matches them: each send needs its receive in the destination's file and
each receive its send in the source's, and a program receives each tag once. Each send of a
program goes out on a channel of the engine's `PointToPoint` (every chip's peer on that
channel): the fewest channels on which every rank's destinations fit.

Ranks whose programs differ only in their ops' sizes (an uneven MoE router: each rank its own
expert FLOPs, bytes and all-to-all volume, and its own recorded durations) are one program at
the largest rank's sizes, with each rank's share as a per-chip factor (`scaled_program`: the
engine's `op_scale`).
"""

from __future__ import annotations

import json

from topologies.errors import TpusimError
from topologies.mesh import job_mesh
from topologies.torus import Topology
from workloads.chakra.reader import ChakraSet
from workloads.trace import Op, Trace
from workloads.trace_meta import TraceKind, TraceMeta

MULTI_NOTE = ("ranks running different programs replayed each on its own chip; sends and "
              "receives between them matched by (comm_src, comm_dst, comm_tag)")



def intern_group(spec: dict, index: dict[str, int], groups: list[dict]) -> int:
    """The id of device-group `spec` in `groups` (meta `device_groups`), appended once: equal
    specs share an id (`index` maps each spec's JSON to it)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in index:
        index[key] = len(groups)
        groups.append(spec)
    return index[key]

def _key(prog: list) -> tuple:
    """What ranks of one program share: every op's fields, and where its parts are (a send's
    and a receive's tag too: the program's receives are keyed by it)."""
    out = []
    for fields, part in prog:
        tag = part[2] if isinstance(part, tuple) and part and part[0] in ("send", "recv") \
            else None
        out.append((tuple(sorted((k, v) for k, v in fields.items())), part is not None, tag))
    return tuple(out)


def _where(cset: ChakraSet, rank: int, k: int) -> str:
    n = cset.ranks[rank].nodes[k]
    return f"chakra file {cset.ranks[rank].path!r}: node {n.id} ({n.name[:60]!r})"


def programs_trace(cset: ChakraSet, per_rank: list[list], topology: Topology, compute,
                   notes: dict) -> tuple[tuple[Trace, ...], tuple[int, ...], dict, tuple]:
    """(each program, every chip's program, the point-to-point sends as `ChakraImport.p2p`,
    the approximations) of a set whose ranks run different programs (the module docstring):
    `per_rank[r]` is rank r's (op fields, part) list from `convert._program(spmd=False)`."""
    n = topology.num_chips
    r = len(per_rank)
    index: dict[tuple, int] = {}
    by_id: dict[int, int] = {}
    prog_of: list[int] = []
    ranks_of: list[list[int]] = []
    for rank, prog in enumerate(per_rank):
        pi = by_id.get(id(prog))
        if pi is None:
            pi = index.setdefault(_key(prog), len(index))
            by_id[id(prog)] = pi
        if pi == len(ranks_of):
            ranks_of.append([])
        ranks_of[pi].append(rank)
        prog_of.append(pi)
    _check_groups(cset, per_rank)
    sends, recvs, peers = _point_to_point(cset, per_rank, prog_of, ranks_of, n)
    device_groups: list[dict] = []
    group_index: dict[str, int] = {}
    programs = []
    for ranks in ranks_of:
        ops = []
        for k, (fields, part) in enumerate(per_rank[ranks[0]]):
            gid = -1
            if part is not None and not (isinstance(part, tuple) and part[0] in ("send",
                                                                                 "recv")):
                spec = {"groups": [list(g) for g in sorted({per_rank[q][k][1] for q in ranks})]}
                gid = intern_group(spec, group_index, device_groups)
            ops.append(Op(id=k, group=gid, **fields))
        programs.append(ops)
    mesh = job_mesh(topology)
    notes[MULTI_NOTE] += 1
    approx = tuple(f"{text} ({count})" for text, count in sorted(notes.items()))
    meta = TraceMeta.of(kind=TraceKind.CHAKRA, source=cset.source, num_chips=n,
                        device_groups=device_groups, chakra_ranks=r,
                        chakra_compute=str(compute), approximations=list(approx))
    traces = tuple(Trace(mesh=mesh, ops=tuple(ops), meta=meta) for ops in programs)
    return traces, tuple(prog_of), {"peers": peers, "sends": sends, "recvs": recvs}, approx


def _check_groups(cset: ChakraSet, per_rank: list[list]) -> None:
    """Every member of a rank's collective runs the same collective at the same place."""
    for rank, prog in enumerate(per_rank):
        for k, (fields, part) in enumerate(prog):
            if part is None or (isinstance(part, tuple) and part[0] in ("send", "recv")):
                continue
            for m in part:
                other = per_rank[m][k] if k < len(per_rank[m]) else (None, None)
                if other[1] != part or any(other[0].get(f) != fields.get(f)
                                           for f in ("collective", "bytes")):
                    raise TpusimError(
                        f"{_where(cset, rank, k)} is a collective over ranks "
                        f"{', '.join(map(str, part[:8]))}{', ...' if len(part) > 8 else ''}, "
                        f"but rank {m}'s node at the same place in its dependency order is not "
                        f"the same collective over the same ranks; the ranks of a process group "
                        f"must issue its collectives in one order with one kind and size")


def _point_to_point(cset: ChakraSet, per_rank: list[list], prog_of: list[int],
                    ranks_of: list[list[int]], n: int) -> tuple[list, list, list]:
    """(per program {send op: (channel, tag)}, per program {tag: receive op}, per channel
    every chip's peer) of the sets' sends and receives, each send matched to its receive."""
    recv_at: dict[tuple[int, int, int], int] = {}  # (src, dst, tag) -> the receiving rank's op
    recvs: list[dict[int, int]] = [{} for _ in ranks_of]
    for pi, ranks in enumerate(ranks_of):
        for k, (_f, part) in enumerate(per_rank[ranks[0]]):
            if isinstance(part, tuple) and part and part[0] == "recv":
                if part[2] in recvs[pi]:
                    raise TpusimError(
                        f"{_where(cset, ranks[0], k)} receives comm_tag {part[2]}, which the "
                        f"rank already receives at node "
                        f"{cset.ranks[ranks[0]].nodes[recvs[pi][part[2]]].id}; tpusim needs a "
                        f"rank's receives to have distinct tags")
                recvs[pi][part[2]] = k
        for rank in ranks:
            for k in recvs[pi].values():
                _kind, src, tag = per_rank[rank][k][1]
                recv_at[(src, rank, tag)] = k
    sends: list[dict[int, tuple[int, int]]] = [{} for _ in ranks_of]
    peers: list[list[int]] = []
    matched = 0
    for pi, ranks in enumerate(ranks_of):
        for k, (_f, part) in enumerate(per_rank[ranks[0]]):
            if not (isinstance(part, tuple) and part and part[0] == "send"):
                continue
            dst_of = {q: per_rank[q][k][1][1] for q in ranks}
            for q, dst in dst_of.items():
                if not 0 <= dst < n or dst == q or (q, dst, part[2]) not in recv_at:
                    raise TpusimError(
                        f"{_where(cset, q, k)} sends comm_tag {part[2]} to rank {dst}, which "
                        f"has no COMM_RECV_NODE of that tag from rank {q}; give every rank's "
                        f"file, each send with its receive")
            ch = next((c for c, nb in enumerate(peers)
                       if all(nb[q] in (-1, d) for q, d in dst_of.items())), len(peers))
            if ch == len(peers):
                peers.append([-1] * n)
            for q, d in dst_of.items():
                peers[ch][q] = d
            sends[pi][k] = (ch, part[2])
            matched += len(dst_of)
    if matched != len(recv_at):
        sent = {(q, per_rank[q][k][1][1], tag) for pi, ranks in enumerate(ranks_of)
                for k, (_ch, tag) in sends[pi].items() for q in ranks}
        src, dst, tag = next(key for key in sorted(recv_at) if key not in sent)
        raise TpusimError(
            f"{_where(cset, dst, recv_at[(src, dst, tag)])} receives comm_tag {tag} from rank "
            f"{src}, which has no COMM_SEND_NODE of that tag to rank {dst}; give every rank's "
            f"file, each receive with its send")
    return sends, recvs, peers


SIZES = ("flops", "hbm_bytes", "bytes", "duration_s")


def scaled_program(per_rank: list[list], notes: dict) \
        -> tuple[list, dict[int, tuple[float, ...]]] | None:
    """(the program at the largest rank's sizes, {op: each rank's factor on them}) when the
    ranks' programs differ only in compute ops' FLOPs and HBM bytes, collectives' bytes and
    recorded durations (and in the groups and peers they name), else None. A compute op whose
    FLOPs and bytes scale by different factors on a rank takes the larger (its time is an upper
    bound; counted)."""
    ref = per_rank[0]
    if any(len(p) != len(ref) for p in per_rank):
        return None
    out, scale = [], {}
    uneven = 0
    for k, (fields, part) in enumerate(ref):
        rows = [p[k] for p in per_rank]
        base = {f: v for f, v in fields.items() if f not in SIZES}
        for fl, pt in rows:
            if (pt is None) != (part is None) or \
                    {f: v for f, v in fl.items() if f not in SIZES} != base:
                return None
        top = {f: max(fl[f] for fl, _p in rows) for f in SIZES if f in fields}
        out.append(({**fields, **top}, part))
        if all(fl is fields for fl, _p in rows) or all(
                all(fl[f] == top[f] for f in top) for fl, _p in rows):
            continue
        col = []
        for fl, _p in rows:
            shares = [fl[f] / top[f] for f in top if top[f] > 0]
            share = max(shares, default=1.0)
            if shares and max(shares) - min(shares) > 1e-3:
                uneven += 1
            col.append(max(share, 1e-9))
        scale[k] = tuple(col)
    if not scale:
        return None
    notes["ops whose sizes differ between ranks replayed at each rank's own sizes (per-chip "
          "factors on the largest rank's)"] += len(scale)
    if uneven:
        notes["compute ops whose FLOPs and bytes differ between ranks by different factors "
              "costed at the larger share"] += uneven
    return out, scale
