"""Perfetto export: native protobuf (`.pftrace`, built with the `perfetto` package's trace protos)
or Chrome Trace Event JSON (`.json`, for older viewers).

Layout of a step: one process per exported chip (or per host, chips as track groups, when more
than `MAX_CHIP_PROCESSES` chips are exported), each with a track per unit (MXU, VPU), lanes of
HBM DMA work (the collectives, which DMA engines move between HBM and the links), one lane set
per outgoing ICI link direction (the collectives using that direction), PCIe host transfers,
pipeline idle time, and counter tracks for HBM occupancy and for each link direction's
utilization. Slices carry args (op id, name, FLOPs, bytes, bound unit, collective, mesh axes,
algorithm). Flows join each collective
slice to the same collective on the next chip of its replica group, and each pipeline send to
the receive it completes on the next (or previous) stage, when both are exported (`.pftrace`
only).

Per-chip engine: when chips differ (a slow chip, a slow link, chip variation), each chip class
(chips whose whole step is identical) is one process named with the chips it stands for, and
every chip of `chips=` is added with its class's timeline. Pipeline runs have a class per stage
at least, each with its own program (the stage's passes, sends and receives); its process name
starts with its stage (`StepResult._class_titles`).

Big pods: tpusim replays one representative chip (every chip runs the same SPMD program), so by
default the trace holds chip 0 only; `chips=` (`--trace-chips 0-15`) shows more, each identical
in time by symmetry, and the first process's name says how many chips were left out. Slices on one
track never overlap, and slices shorter than 1 ns are left out (they would not nest once
rounded; they are in the `--out` tables).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from sim.export.output import atomic_write
from topologies.errors import TpusimError
from topologies.validate import short_repr

_NS = 1e9
MAX_CHIP_PROCESSES = 64


def parse_chip_list(spec: str | None, num_chips: int) -> list[int]:
    """`"0-15"`, `"0,4,8"`, `"0-3,12"`, `"all"` -> sorted chip ids; None -> [0].

    Every item is range-checked before any set is built, so `0-999999999` costs nothing.
    """
    if spec is None:
        return [0]
    text = str(spec).strip()
    if text.lower() == "all":
        return list(range(num_chips))
    hint = "write e.g. 0-15, 0,4,8 or all"
    if not text:
        raise TpusimError(f"--trace-chips is empty; {hint}")
    ranges = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d{1,9})(?:\s*-\s*(\d{1,9}))?", part)
        if not m:
            raise TpusimError(f"--trace-chips {short_repr(spec)} is not a chip list; {hint}")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise TpusimError(
                f"--trace-chips {short_repr(spec)}: range {a}-{b} runs backwards; write {b}-{a}"
            )
        if b >= num_chips:
            raise TpusimError(
                f"--trace-chips {short_repr(spec)} names chip {b}, but the pod has chips 0.."
                f"{num_chips - 1}; pick chips in that range (or all)"
            )
        ranges.append((a, b))
    chips: set[int] = set()
    for a, b in ranges:
        chips.update(range(a, b + 1))
    return sorted(chips)


def _lanes(rows):
    """Greedy lane assignment so that overlapping intervals go on different tracks."""
    ends: list[float] = []
    out = []
    for r in rows:
        start, end = r[0], r[1]
        for i, e in enumerate(ends):
            if e <= start:
                ends[i] = end
                out.append(i)
                break
        else:
            ends.append(end)
            out.append(len(ends) - 1)
    return out


class _Chip:
    """Tracks of one chip: name -> [(start_s, end_s, name, args, op_id)], counters."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tracks: dict[str, list[tuple]] = {}
        self.counters: dict[str, list[tuple[float, float]]] = {}


def _step_tracks(result) -> tuple[dict[str, list[tuple]], dict[str, list[tuple[float, float]]]]:
    """The representative chip's tracks and counters (shared by every exported chip)."""
    ops = result.ops
    tracks: dict[str, list[tuple]] = {}
    coll = []
    for r in ops.itertuples(index=False):
        if r.end_s <= r.start_s:
            continue
        args = {"op_id": int(r.op_id), "layer": int(r.layer), "phase": r.phase,
                "bound": r.bound, "flops": float(r.flops), "bytes": float(r.bytes)}
        row = (float(r.start_s), float(r.end_s), r.name, args, int(r.op_id))
        if r.kind == "compute":
            tracks.setdefault(r.unit.upper(), []).append(row)
        elif r.kind == "collective":
            args.update(collective=r.collective, mesh_axes=r.mesh_axes,
                        algorithm=result._coll_algorithm.get(int(r.op_id), ""))
            classes = result._coll_classes.get(int(r.op_id), {})
            args["link_classes"] = ",".join(classes)
            coll.append(row)
        elif r.kind == "host":
            tracks.setdefault("PCIe", []).append(row)
        else:
            tracks.setdefault("idle", []).append(row)
    coll.sort(key=lambda x: (x[0], x[1], x[4]))
    for lane, row in zip(_lanes(coll), coll, strict=True):
        tracks.setdefault(f"HBM DMA collectives {lane}", []).append(row)
    # One lane set per link direction: the collectives that load it.
    by_class: dict[str, list[tuple]] = {}
    for row in coll:
        for cls, nbytes in result._coll_classes.get(row[4], {}).items():
            a = dict(row[3])
            a["bytes_per_link"] = nbytes
            by_class.setdefault(cls, []).append((row[0], row[1], row[2], a, row[4]))
    counters: dict[str, list[tuple[float, float]]] = {}
    for cls, rows in sorted(by_class.items()):
        for lane, row in zip(_lanes(rows), rows, strict=True):
            tracks.setdefault(f"ICI {cls} link {lane}", []).append(row)
        counters[f"ICI {cls} utilization"] = _utilization(rows, result._class_capacity[cls])
    counters["HBM occupancy (bytes)"] = [
        (float(t), float(b)) for t, b in zip(result.memory.time_s, result.memory.hbm_bytes,
                                             strict=True)
    ]
    return tracks, counters


def _utilization(rows, capacity: float) -> list[tuple[float, float]]:
    """Piecewise-constant link utilization: each collective's average rate on the link."""
    deltas: dict[float, float] = {}
    for start, end, _name, args, _op in rows:
        rate = args["bytes_per_link"] / (end - start) / capacity
        deltas[start] = deltas.get(start, 0.0) + rate
        deltas[end] = deltas.get(end, 0.0) - rate
    level = 0.0
    out = []
    for t in sorted(deltas):
        level += deltas[t]
        out.append((t, max(level, 0.0) if abs(level) > 1e-12 else 0.0))
    return out


def _neighbour(topology, chip: int, gaxes) -> int | None:
    """The next chip of `chip`'s replica group along its first group axis."""
    if not gaxes:
        return None
    g = gaxes[0]
    coords = list(topology.coords(chip))
    col = topology.ndim if g.is_dcn else g.index
    c = coords[col]
    digit = (c // g.stride) % g.size
    coords[col] = c + (((digit + 1) % g.size) - digit) * g.stride
    if topology.num_slices == 1:
        coords = coords[: topology.ndim]
    return topology.chip_id(tuple(coords))


# Perfetto timestamps are int64 nanoseconds; 1e9 s (31 years) keeps every one far from overflow.
MAX_TRACE_SPAN_S = 1e9


def check_span(seconds: float, what: str = "the step") -> None:
    """Refuse a timeline that Perfetto's nanosecond clock cannot hold (before writing)."""
    if not 0 <= seconds <= MAX_TRACE_SPAN_S:
        raise TpusimError(
            f"{what} lasts {seconds:.3g} s, over the {MAX_TRACE_SPAN_S:.0e} s a Perfetto trace's "
            f"nanosecond clock can hold; drop --perfetto or simulate a shorter program"
        )


def export_step(result, path: str | Path, *, chips: list[int] | None = None) -> Path:
    """Write a replayed step as a Perfetto trace (`.pftrace`) or Chrome JSON (`.json`).

    With several chip classes (per-chip engine), one process per class (its representative,
    named with the chips it stands for; at most `MAX_CHIP_PROCESSES` classes, the slowest
    first) plus every chip in `chips`, each with its own class's timeline.
    """
    check_span(result.step_time_s)
    topo = result._topology
    per_class: dict[int, tuple] = {}
    if result.num_chip_classes > 1 and result._chip_class is not None:
        return _export_classes(result, path, chips or [])
    chips = chips or [0]
    tracks, counters = _step_tracks(result)
    left_out = result.num_chips - len(chips)
    procs = []
    for c in chips:
        coords = topo.coords(c) if topo is not None else (c,)
        name = f"chip {c} {tuple(coords)}"
        if c == chips[0]:
            name += (f" [tpusim: {result.num_chips} chips of {result.topology} {result.chip} "
                     f"replayed as one representative; {left_out} identical chips not shown]")
        procs.append((c, name))
    return _write_step(result, path, topo, chips, procs, tracks, counters, per_class)


def _export_classes(result, path, extra: list[int]) -> Path:
    import numpy as np

    topo = result._topology
    label = result._chip_class
    reps = [int(r) for r in result._class_reps]
    finish = [row[0] for row in result._class_rows]
    shown = sorted(range(len(reps)), key=lambda k: (-finish[k], k))[:MAX_CHIP_PROCESSES]
    procs = []
    per_class: dict[int, tuple] = {}
    chips = sorted(set([reps[k] for k in shown]) | set(extra))
    for c in chips:
        k = int(label[c])
        if k not in per_class:
            per_class[k] = _step_tracks(result.for_class(k))
        members = np.flatnonzero(label == k)
        coords = [topo.coords(int(m)) for m in members[:8]]
        more = f" +{len(members) - 8} more" if len(members) > 8 else ""
        title = result._class_titles.get(k)
        if c == reps[k]:
            name = (f"{title + ', ' if title else ''}chip class {k}: {len(members)} chip(s) "
                    f"{' '.join(str(tuple(x)) for x in coords)}{more}")
        else:
            name = f"chip {c} {tuple(topo.coords(c))} (class {k}{', ' + title if title else ''})"
        procs.append((c, name))
    if len(shown) < len(reps):
        procs[0] = (procs[0][0], procs[0][1] + f" [tpusim: {len(reps)} chip classes, the "
                    f"{len(shown)} slowest shown]")
    tracks = {c: per_class[int(label[c])] for c in chips}
    return _write_step(result, path, topo, chips, procs, None, None, tracks)


def _same_program_chips(result, chips: list[int]) -> list[int]:
    """The chips that run the reported chip's program (collective flows join op ids of one
    program; pipeline stages run different programs)."""
    progs = result._class_programs
    if not progs or result._chip_class is None:
        return list(chips)
    return [c for c in chips
            if progs.get(int(result._chip_class[c]), (None,))[0] is result._mem_trace]


def _send_flows(result, chips: list[int], flows_out, flows_in) -> None:
    """Point-to-point sends (pipeline stages): a flow from each send on an exported chip to the
    receive it completes on its peer, when the peer is exported too."""
    if result._p2p is None or result._chip_class is None:
        return
    p2p, prog_of_class = result._p2p
    label = result._chip_class
    shown = set(chips)
    longest = max((len(v[0].ops) for v in result._class_programs.values()),
                  default=result.num_ops)
    base = (longest + 1) * result.num_chips  # above every collective flow id
    for c in chips:
        prog = prog_of_class[int(label[c])]
        for send_id, (ch, tag) in sorted(p2p.sends[prog].items()):
            peer = int(p2p.peer_of_chip[ch][c])
            if peer not in shown:
                continue
            recv_id = p2p.recvs[prog_of_class[int(label[peer])]].get(tag)
            if recv_id is None:
                continue
            fid = base + send_id * result.num_chips + c + 1
            flows_out.setdefault((c, send_id), []).append(fid)
            flows_in.setdefault((peer, recv_id), []).append(fid)


def _write_step(result, path, topo, chips, procs, tracks, counters, per_chip) -> Path:
    # Flows: collective op on chip c -> same op on its group neighbour, if exported.
    flows_out: dict[tuple[int, int], list[int]] = {}
    flows_in: dict[tuple[int, int], list[int]] = {}
    shown = set(chips)
    if topo is not None and len(chips) > 1:
        same = _same_program_chips(result, chips)
        for op_id, gaxes in sorted(result._coll_axes.items()):
            for c in same:
                nb = _neighbour(topo, c, gaxes)
                if nb is None or nb == c or nb not in shown:
                    continue
                fid = op_id * result.num_chips + c + 1
                flows_out.setdefault((c, op_id), []).append(fid)
                flows_in.setdefault((nb, op_id), []).append(fid)
        _send_flows(result, chips, flows_out, flows_in)
    path = Path(path)
    per_host = len(chips) > MAX_CHIP_PROCESSES
    if path.suffix.lower() == ".json":
        text = _chrome_json(procs, tracks, counters, flows_out, flows_in, per_host, per_chip)
        return atomic_write(path, lambda p: p.write_text(text))
    data = _protobuf(procs, tracks, counters, flows_out, flows_in, per_host, per_chip)
    return atomic_write(path, lambda p: p.write_bytes(data))


def export_collective(res, path: str | Path) -> Path:
    """A collective's steps per stream (chip 0 of each simulated group) as a trace."""
    return export_collectives([res], path)


def export_collectives(results, path: str | Path) -> Path:
    """Several collectives (e.g. one per algorithm) as one trace, a process each."""
    for res in results:
        check_span(res.time_s, "the collective")
    procs, tracks_by_proc = [], []
    for i, res in enumerate(results):
        tracks = _collective_tracks(res)
        pname = (f"{res.op} {res.algorithm} on {res.topology} {res.chip} (chip 0 of each "
                 f"simulated group represents {res.num_chips} chips)")
        procs.append((i, pname))
        tracks_by_proc.append(tracks)
    path = Path(path)
    if path.suffix.lower() == ".json":
        text = _chrome_json_multi(procs, tracks_by_proc)
        return atomic_write(path, lambda p: p.write_text(text))
    data = _protobuf_multi(procs, tracks_by_proc)
    return atomic_write(path, lambda p: p.write_bytes(data))


def _chrome_json_multi(procs, tracks_by_proc) -> str:
    docs = [json.loads(_chrome_json([(0, pname)], tracks, {}, {}, {}, False))["traceEvents"]
            for (_i, pname), tracks in zip(procs, tracks_by_proc, strict=True)]
    events = []
    for pid, evs in enumerate(docs, start=1):
        for e in evs:
            e["pid"] = pid
            events.append(e)
    return json.dumps({"traceEvents": events}, separators=(",", ":"))


def _protobuf_multi(procs, tracks_by_proc) -> bytes:
    # One builder: the per-process track trees are independent, so merge them by offsetting
    # the uuids of each process's descriptors.
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace as _Trace

    merged = _Trace()
    offset = 0
    for pid, ((_i, pname), tracks) in enumerate(zip(procs, tracks_by_proc, strict=True),
                                                 start=1):
        part = _Trace.FromString(_protobuf([(0, pname)], tracks, {}, {}, {}, False))
        top = 0
        for pk in part.packet:
            if pk.HasField("track_descriptor"):
                td = pk.track_descriptor
                td.uuid += offset
                top = max(top, td.uuid)
                if td.HasField("parent_uuid"):
                    td.parent_uuid += offset
                if td.HasField("process"):
                    td.process.pid = pid
            if pk.HasField("track_event"):
                pk.track_event.track_uuid += offset
            if merged.packet:
                pk.ClearField("sequence_flags")
            merged.packet.append(pk)
        offset = top
    return merged.SerializeToString()


def _collective_tracks(res) -> dict[str, list[tuple]]:
    tl = res.timeline
    tracks: dict[str, list[tuple]] = {}
    for i, r in enumerate(tl.itertuples(index=False)):
        name = f"stream {r.stream}" + (f" group {r.group}" if r.group else "")
        tracks.setdefault(name, []).append(
            (float(r.start_s), float(r.end_s), r.label or f"step {r.step}",
             {"bytes_per_chip": float(r.bytes_per_chip), "algorithm": res.algorithm,
              "chips_represented": int(r.chips_represented), "step": int(r.step)}, i)
        )
    # Chunked schedules can overlap within a stream: spread them over lanes.
    laned: dict[str, list[tuple]] = {}
    for name, rows in tracks.items():
        rows.sort(key=lambda x: (x[0], x[1], x[4]))
        for lane, row in zip(_lanes(rows), rows, strict=True):
            laned.setdefault(name if lane == 0 else f"{name} lane {lane}", []).append(row)
    return laned


def _ns(t: float) -> int:
    return round(t * _NS)


def _chrome_json(procs, tracks, counters, flows_out, flows_in, per_host, per_chip=None) -> str:
    events = []
    shared = (tracks, counters)
    for pid, (chip, pname) in enumerate(procs, start=1):
        tracks, counters = per_chip[chip] if per_chip else shared
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                       "args": {"name": pname}})
        for tid, (tname, rows) in enumerate(sorted(tracks.items()), start=1):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": tname}})
            for start, end, name, args, _op in sorted(rows, key=lambda x: (x[0], x[1])):
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": name,
                               "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6,
                               "args": args})
        for cname, samples in sorted(counters.items()):
            for t, v in samples:
                events.append({"ph": "C", "pid": pid, "tid": 0, "name": cname,
                               "ts": t * 1e6, "args": {"value": v}})
    # Flows are written to .pftrace only: JSON flow v2 binds one id per event, and a ring
    # collective slice is both the end of one flow and the start of the next.
    del per_host, flows_out, flows_in
    return json.dumps({"traceEvents": events}, separators=(",", ":"))


def _protobuf(procs, tracks, counters, flows_out, flows_in, per_host, per_chip=None) -> bytes:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    b = TraceProtoBuilder()
    first = True

    def packet():
        nonlocal first
        p = b.add_packet()
        p.trusted_packet_sequence_id = 1
        if first:
            p.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            first = False
        return p

    def descriptor(uuid: int, *, parent: int | None = None, name: str | None = None,
                   pid: int | None = None, process_name: str | None = None):
        """Declare a track (a child track, or a process when `pid` is given)."""
        td = packet().track_descriptor
        td.uuid = uuid
        if parent is not None:
            td.parent_uuid = parent
        if name is not None:
            td.name = name
        if pid is not None:
            td.process.pid = pid
            td.process.process_name = process_name
        return td

    uuid = 0
    events = []
    host_uuid: dict[int, int] = {}
    shared = (tracks, counters)
    for pid, (chip, pname) in enumerate(procs, start=1):
        tracks, counters = per_chip[chip] if per_chip else shared
        if per_host:
            host = chip // 8
            if host not in host_uuid:
                uuid += 1
                host_uuid[host] = uuid
                descriptor(uuid, pid=host + 1,
                           process_name=f"host {host} (chips {host * 8}-{host * 8 + 7})")
            uuid += 1
            chip_uuid = uuid
            descriptor(chip_uuid, parent=host_uuid[host], name=pname)
        else:
            uuid += 1
            chip_uuid = uuid
            descriptor(chip_uuid, pid=pid, process_name=pname)
        for tname, rows in sorted(tracks.items()):
            uuid += 1
            descriptor(uuid, parent=chip_uuid, name=tname)
            is_coll = tname.startswith("HBM DMA collectives")
            for start, end, name, args, op in rows:
                b_ns, e_ns = _ns(start), _ns(end)
                if e_ns <= b_ns:
                    continue  # shorter than 1 ns once rounded: it would not nest (kept in --out)
                fo = flows_out.get((chip, op), []) if is_coll else []
                fi = flows_in.get((chip, op), []) if is_coll else []
                events.append((b_ns, 1, uuid, name, args, fo, fi))
                events.append((e_ns, 0, uuid, name, None, [], []))
        for cname, samples in sorted(counters.items()):
            uuid += 1
            td = descriptor(uuid, parent=chip_uuid, name=cname)
            td.counter.unit_name = "bytes" if "bytes" in cname else "fraction"
            for t, v in samples:
                events.append((_ns(t), 2, uuid, "", v, [], []))
    # At equal timestamps: ends first (back-to-back slices must not nest), then begins, then
    # counters; ties broken by track for determinism.
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    for ts, kind, track, name, payload, fo, fi in events:
        p = packet()
        p.timestamp = ts
        ev = p.track_event
        ev.track_uuid = track
        if kind == 1:
            ev.type = TrackEvent.TYPE_SLICE_BEGIN
            ev.name = name
            for k, v in payload.items():
                a = ev.debug_annotations.add()
                a.name = k
                if isinstance(v, float):
                    a.double_value = v
                elif isinstance(v, int):
                    a.int_value = v
                else:
                    a.string_value = str(v)
            ev.flow_ids.extend(fo)
            ev.terminating_flow_ids.extend(fi)
        elif kind == 0:
            ev.type = TrackEvent.TYPE_SLICE_END
        else:
            ev.type = TrackEvent.TYPE_COUNTER
            ev.double_counter_value = float(payload)
    return b.serialize()
