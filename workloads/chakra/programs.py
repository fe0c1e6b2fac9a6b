"""A Chakra set whose ranks run different programs (a pipeline's stages: each stage's ranks
their own nodes, sends and receives between the stages) as per-chip programs for the per-chip
engine.

Ranks whose nodes convert to the same ops (up to the groups their collectives name, the peers
their sends and receives name, and the sizes that scale per chip) share a program. A
collective is a rendezvous of the ranks of its process group at the same place in their
programs (ops are numbered in each rank's dependency order): every member must run the same
kind of collective over the same group there, or the set is refused naming both nodes; its
members may move different sizes. A COMM_SEND_NODE is a point-to-point transfer of comm_size
bytes to comm_dst on its route; a COMM_RECV_NODE is done when the send of the same comm_tag
from its comm_src has landed. Sends are matched to receives by (source, destination, tag), as
ASTRA-sim matches them: each send needs its receive in the destination's file and each receive
its send in the source's, and a program receives each tag once. Each send of a program goes
out on a channel of the engine's `PointToPoint` (every chip's peer on that channel): the
fewest channels on which every rank's destinations fit.

Ranks whose programs differ only in their ops' sizes (an uneven MoE router: each rank its own
expert FLOPs, bytes and all-to-all volume, and its own recorded durations) are one program at
the largest rank's sizes, with each rank's share as a per-chip factor (`scaled_program`: the
engine's `op_scale`). So are the ranks of one program in a set of several (a pipeline stage's
ranks under an uneven router, `sized_programs`), where a collective that members of several
programs run is at the largest member's size in each of them. Sizes the engine takes from the
program alone (a send's bytes, a host transfer's) are part of what a program is: ranks that
differ there run programs of their own (`scaled_fields` says which fields scale).
"""

from __future__ import annotations

import json
import math
from collections import Counter

from topologies.errors import TpusimError
from topologies.groups import factor_device_groups, tile_device_groups
from topologies.mesh import job_mesh
from topologies.torus import Topology
from workloads.chakra.reader import ChakraSet
from workloads.trace import Op, OpKind, Trace
from workloads.trace_meta import TraceKind, TraceMeta

MULTI_NOTE = ("ranks running different programs replayed each on its own chip; sends and "
              "receives between them matched by (comm_src, comm_dst, comm_tag)")



NOT_BLOCK = ("collectives whose process groups are not blocks of the torus run over the whole "
             "dimensions their ranks span (an upper bound)")


def count_not_block(topology: Topology, spec: dict, gid: int, seen: dict[int, bool],
                    notes: dict) -> None:
    """Count in `notes` a collective over device-group spec `gid` whose groups are not blocks
    of the torus (`factor_device_groups` is not exact: the engine runs it over the whole axes
    they span); `seen` caches each spec's verdict."""
    if gid not in seen:
        seen[gid] = "groups" in spec and not factor_device_groups(topology, spec["groups"])[1]
    if seen[gid]:
        notes[NOT_BLOCK] += 1


def intern_group(spec: dict, index: dict[str, int], groups: list[dict]) -> int:
    """The id of device-group `spec` in `groups` (meta `device_groups`), appended once: equal
    specs share an id (`index` maps each spec's JSON to it)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in index:
        index[key] = len(groups)
        groups.append(spec)
    return index[key]

def _p2p(part) -> str | None:
    """"send" or "recv" for the part of a send or receive between programs, else None."""
    return part[0] if isinstance(part, tuple) and part and part[0] in ("send", "recv") else None


def scaled_fields(fields: dict, part) -> tuple[str, ...]:
    """The fields of an op that may differ between the ranks of one program, each rank at its
    own share of the largest (the per-chip engine's `op_scale` multiplies them): a compute op's
    FLOPs and HBM bytes, an idle op's duration, a collective's bytes, and a receive's (it takes
    no resources). A send's bytes between programs and a host transfer's are the program's
    (the engine reads them from the op)."""
    kind = fields.get("kind")
    if kind == OpKind.COMPUTE:
        return ("flops", "hbm_bytes")
    if kind == OpKind.IDLE:
        return ("duration_s",)
    if kind == OpKind.COLLECTIVE and _p2p(part) != "send":
        return ("bytes",)
    return ()


# A compute op's FLOPs to HBM bytes ratio, in bins of 0.1% (`_shape`).
RATIO_BIN = math.log(1.001)


def _shape(fields: dict) -> tuple:
    """What the ranks of one program share of a compute op's sizes: the ratio of its FLOPs to
    its HBM bytes, to 0.1% (a bin of its logarithm; a Chakra file's counts are whole numbers,
    so ranks scaled alike differ in the ratio by their rounding), since one factor per chip
    scales both. Ranks whose FLOPs and bytes differ by different factors run programs of their
    own, each at its exact sizes; within a bin a rank takes the larger of its two shares (its
    time is at most 0.1% long)."""
    if fields.get("kind") != OpKind.COMPUTE:
        return ()
    f, h = fields["flops"], fields["hbm_bytes"]
    if f <= 0 or h <= 0:
        return (f > 0, h > 0)
    return (round(math.log(f / h) / RATIO_BIN),)


def _key(prog: list) -> tuple:
    """What ranks of one program share: every op's fields but the sizes that scale per chip
    (a compute op's FLOPs to bytes ratio still), and where its parts are (a send's and a
    receive's tag too: the program's receives are keyed by it)."""
    out = []
    for fields, part in prog:
        kind = _p2p(part)
        tag = part[2] if kind else None
        skip = scaled_fields(fields, part)
        out.append((tuple(sorted((k, v) for k, v in fields.items() if k not in skip)),
                    _shape(fields), part is not None, tag))
    return tuple(out)


def _where(cset: ChakraSet, rank: int, k: int) -> str:
    n = cset.ranks[rank].nodes[k]
    return f"chakra file {cset.ranks[rank].path!r}: node {n.id} ({n.name[:60]!r})"


def program_of_ranks(per_rank: list[list]) -> tuple[list[int], list[list[int]]]:
    """(every rank's program, each program's ranks) of a set of several programs: ranks whose
    ops are the same up to their scaled sizes (`_key`) run one program."""
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
    return prog_of, ranks_of


def programs_trace(cset: ChakraSet, per_rank: list[list], topology: Topology, compute,
                   notes: dict) -> tuple[tuple[Trace, ...], tuple[int, ...], dict, tuple,
                                         dict[int, tuple[float, ...]]]:
    """(each program, every chip's program, the point-to-point sends as `ChakraImport.p2p`,
    the approximations, every chip's factors on its program's sizes as `ChakraImport.op_scale`)
    of a set whose ranks run different programs (the module docstring): `per_rank[r]` is rank
    r's (op fields, part) list from `convert._program(spmd=False)`."""
    n = topology.num_chips
    r = len(per_rank)
    prog_of, ranks_of = program_of_ranks(per_rank)
    shared = rendezvous(per_rank, prog_of, cset)
    sends, recvs, peers = _point_to_point(cset, per_rank, prog_of, ranks_of, n)
    sized, op_scale = sized_programs(per_rank, ranks_of, shared, notes)
    device_groups: list[dict] = []
    group_index: dict[str, int] = {}
    tiles: dict[tuple, list] = {}
    not_block: dict[int, bool] = {}
    programs = []
    for ranks, prog in zip(ranks_of, sized, strict=True):
        ops = []
        for k, (fields, part) in enumerate(prog):
            gid = -1
            if part is not None and not _p2p(part):
                groups = [list(g) for g in sorted({per_rank[q][k][1] for q in ranks})]
                # The program's ranks are part of the pod: its groups as blocks of a tiling of
                # the pod (the other blocks are other programs' ranks), so they are exact
                # groups of the torus rather than the whole axes they span.
                key = tuple(map(tuple, groups))
                if key not in tiles:
                    tiles[key] = tile_device_groups(topology, groups) or groups
                spec = {"groups": tiles[key]}
                gid = intern_group(spec, group_index, device_groups)
                count_not_block(topology, spec, gid, not_block, notes)
            ops.append(Op(id=k, group=gid, **fields))
        programs.append(ops)
    mesh = job_mesh(topology)
    notes[MULTI_NOTE] += 1
    approx = tuple(f"{text} ({count})" for text, count in sorted(notes.items()))
    meta = TraceMeta.of(kind=TraceKind.CHAKRA, source=cset.source, num_chips=n,
                        device_groups=device_groups, chakra_ranks=r,
                        chakra_compute=str(compute), approximations=list(approx))
    traces = tuple(Trace(mesh=mesh, ops=tuple(ops), meta=meta) for ops in programs)
    p2p = {"peers": peers, "sends": sends, "recvs": recvs}
    return traces, tuple(prog_of), p2p, approx, op_scale


def rendezvous(per_rank: list[list], prog_of: list[int],
               cset: ChakraSet | None = None) -> dict[int, list[list[int]]]:
    """{op: the sets of programs whose ranks run that collective together} (only sets of more
    than one program). With `cset`, every member of a rank's collective must run the same kind
    of collective over the same ranks at the same place, or the set is refused naming both
    nodes (without it, the members that do not are skipped: `replay_notes`)."""
    parent: dict[int, dict[int, int]] = {}  # per op, a union-find forest over programs

    def root(uf: dict[int, int], p: int) -> int:
        while uf.get(p, p) != p:
            p = uf[p]
        return p

    for rank, prog in enumerate(per_rank):
        for k, (fields, part) in enumerate(prog):
            if part is None or _p2p(part):
                continue
            for m in part:
                other = per_rank[m][k] if k < len(per_rank[m]) else (None, None)
                if other[1] != part or other[0].get("collective") != fields.get("collective"):
                    if cset is None:
                        continue
                    raise TpusimError(
                        f"{_where(cset, rank, k)} is a collective over ranks "
                        f"{', '.join(map(str, part[:8]))}{', ...' if len(part) > 8 else ''}, "
                        f"but rank {m}'s node at the same place in its dependency order is not "
                        f"the same collective over the same ranks; the ranks of a process group "
                        f"must issue its collectives in one order, each of one kind (their "
                        f"sizes may differ)")
                if prog_of[m] != prog_of[rank]:
                    uf = parent.setdefault(k, {})
                    a, b = root(uf, prog_of[m]), root(uf, prog_of[rank])
                    uf.setdefault(a, a)
                    uf.setdefault(b, b)
                    if a != b:
                        uf[max(a, b)] = min(a, b)
    out: dict[int, list[list[int]]] = {}
    for k, uf in parent.items():
        sets: dict[int, list[int]] = {}
        for p in sorted(uf):
            sets.setdefault(root(uf, p), []).append(p)
        out[k] = [s for s in sets.values() if len(s) > 1]
    return out


SIZES_NOTE = ("ops whose sizes differ between ranks replayed at each rank's own sizes (per-chip "
              "factors on the largest rank's)")


def sized_programs(per_rank: list[list], ranks_of: list[list[int]],
                   shared: dict[int, list[list[int]]], notes: dict) \
        -> tuple[list[list], dict[int, tuple[float, ...]]]:
    """(each program's (op fields, part) list at its largest rank's sizes, {op: every chip's
    factor on them}) of a set of several programs: `ranks_of[p]` are program p's ranks, whose
    ops differ at most in their `scaled_fields`. A collective that ranks of several programs
    run together (`shared`, from `rendezvous`) is at its largest member's bytes in each of
    them, so the programs agree where they meet. A compute op's FLOPs and bytes scale by one
    factor on each rank (its program's ranks share their ratio to 0.1%: `_shape`)."""
    n = len(per_rank)
    joint: dict[tuple[int, int], float] = {}  # (program, op) -> the bytes its members share
    for k, sets in shared.items():
        for progs in sets:
            top = max(per_rank[q][k][0]["bytes"] for p in progs for q in ranks_of[p])
            for p in progs:
                joint[(p, k)] = top
    scale: dict[int, list[float]] = {}
    out = []
    for p, ranks in enumerate(ranks_of):
        rows = [per_rank[q] for q in ranks]
        prog = []
        for k, (fields, part) in enumerate(rows[0]):
            sizes = [f for f in scaled_fields(fields, part) if f in fields]
            top = {f: max(row[k][0][f] for row in rows) for f in sizes}
            if (p, k) in joint:
                top["bytes"] = joint[(p, k)]
            prog.append(({**fields, **top}, part))
            if not sizes or _p2p(part) == "recv":
                continue
            for q, row in zip(ranks, rows, strict=True):
                fl = row[k][0]
                # (a compute op's two shares are equal to 0.1%: the larger is taken)
                shares = [fl[f] / top[f] for f in sizes if top[f] > 0]
                if not shares or min(shares) == max(shares) == 1.0:
                    continue
                scale.setdefault(k, [1.0] * n)[q] = max(max(shares), 1e-9)
        out.append(prog)
    if scale:
        notes[SIZES_NOTE] += len(scale)
    return out, {k: tuple(col) for k, col in sorted(scale.items())}


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


def scaled_program(per_rank: list[list], notes: dict) \
        -> tuple[list, dict[int, tuple[float, ...]]] | None:
    """(the program at the largest rank's sizes, {op: each rank's factor on them}) when the
    ranks' programs differ only in their `scaled_fields` (compute ops' FLOPs and HBM bytes by
    one factor, collectives' bytes, recorded durations) and in the groups and peers they name,
    else None (`sized_programs` on one program of every rank)."""
    ref = per_rank[0]
    if any(len(p) != len(ref) for p in per_rank):
        return None
    for k, (fields, part) in enumerate(ref):
        skip = scaled_fields(fields, part)
        base = {f: v for f, v in fields.items() if f not in skip}
        shape = _shape(fields)
        for p in per_rank:
            fl, pt = p[k]
            if fl is not fields and ((pt is None) != (part is None) or _shape(fl) != shape or
                                     {f: v for f, v in fl.items() if f not in skip} != base):
                return None
    probe: Counter = Counter()
    (out,), scale = sized_programs(per_rank, [list(range(len(per_rank)))], {}, probe)
    if not scale:
        return None
    for text, count in probe.items():
        notes[text] = notes.get(text, 0) + count
    return out, scale
