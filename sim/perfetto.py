"""Perfetto export: native protobuf (`.pftrace`, via the `perfetto` package's trace protos) or
Chrome Trace Event JSON (`.json`).

Layout: one process per simulated chip (the representative chip stands for every chip of the
pod, which the process name says), with a track per unit (MXU, VPU), one per concurrent lane of
collectives, one for PCIe host transfers, and a counter track for HBM occupancy. Slices carry
args (op name, FLOPs, bytes, collective, mesh axes). Slices on one track never overlap, as
Perfetto requires (reference/perfetto.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from sim.output import atomic_write

_NS = 1e9


def _lanes(rows):
    """Greedy lane assignment so that overlapping intervals go on different tracks."""
    ends: list[float] = []
    out = []
    for r in rows:
        start, end = r[0], r[1]
        for i, e in enumerate(ends):
            if e <= start + 1e-15:
                ends[i] = end
                out.append(i)
                break
        else:
            ends.append(end)
            out.append(len(ends) - 1)
    return out


def step_tracks(result) -> tuple[dict[str, list[tuple]], list[tuple[float, float]], str]:
    """Track name -> [(start_s, end_s, name, args)], HBM counter samples, process name."""
    ops = result.ops
    tracks: dict[str, list[tuple]] = {}
    coll = []
    for r in ops.itertuples(index=False):
        if r.end_s <= r.start_s:
            continue  # zero-length ops (no FLOPs, no bytes) would not nest; they are in --out
        args = {"op_id": int(r.op_id), "layer": int(r.layer), "phase": r.phase,
                "bound": r.bound, "flops": float(r.flops), "bytes": float(r.bytes)}
        if r.kind == "compute":
            tracks.setdefault(r.unit.upper(), []).append((r.start_s, r.end_s, r.name, args))
        elif r.kind == "collective":
            args.update(collective=r.collective, mesh_axes=r.mesh_axes)
            coll.append((r.start_s, r.end_s, r.name, args))
        elif r.kind == "host":
            tracks.setdefault("PCIe", []).append((r.start_s, r.end_s, r.name, args))
        else:
            tracks.setdefault("idle", []).append((r.start_s, r.end_s, r.name, args))
    coll.sort(key=lambda x: (x[0], x[1]))
    for lane, row in zip(_lanes(coll), coll, strict=True):
        tracks.setdefault(f"ICI collectives {lane}", []).append(row)
    mem = [(float(t), float(b)) for t, b in zip(result.memory.time_s, result.memory.hbm_bytes,
                                                strict=True)]
    pname = f"chip 0 (representative of {result.num_chips} chips, {result.topology} " \
            f"{result.chip})"
    return tracks, mem, pname


def collective_tracks(res) -> tuple[dict[str, list[tuple]], list, str]:
    tl = res.timeline
    tracks: dict[str, list[tuple]] = {}
    for r in tl.itertuples(index=False):
        name = f"stream {r.stream}" + (f" group {r.group}" if r.group else "")
        tracks.setdefault(name, []).append(
            (r.start_s, r.end_s, r.label or f"step {r.step}",
             {"bytes_per_chip": float(r.bytes_per_chip), "algorithm": res.algorithm,
              "chips_represented": int(r.chips_represented)})
        )
    pname = f"{res.op} {res.algorithm} on {res.topology} {res.chip} (chip 0 represents " \
            f"{res.num_chips} chips)"
    return tracks, [], pname


def write_trace(path: str | Path, tracks, mem, pname: str) -> Path:
    path = Path(path)
    if path.suffix.lower() == ".json":
        return atomic_write(path, lambda p: p.write_text(_chrome_json(tracks, mem, pname)))
    data = _protobuf(tracks, mem, pname)
    return atomic_write(path, lambda p: p.write_bytes(data))


def export_step(result, path: str | Path) -> Path:
    return write_trace(path, *step_tracks(result))


def export_collective(res, path: str | Path) -> Path:
    return write_trace(path, *collective_tracks(res))


def _chrome_json(tracks, mem, pname: str) -> str:
    events = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": pname}}]
    for tid, (tname, rows) in enumerate(sorted(tracks.items()), start=1):
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name",
                       "args": {"name": tname}})
        for start, end, name, args in sorted(rows, key=lambda x: (x[0], x[1])):
            events.append({"ph": "X", "pid": 0, "tid": tid, "name": name,
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args})
    for t, b in mem:
        events.append({"ph": "C", "pid": 0, "tid": 0, "name": "HBM occupancy",
                       "ts": t * 1e6, "args": {"bytes": b}})
    return json.dumps({"traceEvents": events}, separators=(",", ":"))


def _protobuf(tracks, mem, pname: str) -> bytes:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    b = TraceProtoBuilder()
    seq = 1
    first = True

    def packet():
        nonlocal first
        p = b.add_packet()
        p.trusted_packet_sequence_id = seq
        if first:
            p.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            first = False
        return p

    proc_uuid = 1
    p = packet()
    p.track_descriptor.uuid = proc_uuid
    p.track_descriptor.process.pid = 1
    p.track_descriptor.process.process_name = pname
    uuid = 10
    events = []
    for tname, rows in sorted(tracks.items()):
        uuid += 1
        p = packet()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.parent_uuid = proc_uuid
        p.track_descriptor.name = tname
        for start, end, name, args in rows:
            b_ns, e_ns = round(start * _NS), round(end * _NS)
            if e_ns <= b_ns:
                continue  # shorter than 1 ns once rounded: it would not nest (kept in --out)
            events.append((b_ns, 0, uuid, name, args))
            events.append((e_ns, 1, uuid, name, None))
    mem_uuid = None
    if mem:
        mem_uuid = uuid + 1
        p = packet()
        p.track_descriptor.uuid = mem_uuid
        p.track_descriptor.parent_uuid = proc_uuid
        p.track_descriptor.name = "HBM occupancy (bytes)"
        p.track_descriptor.counter.unit_name = "bytes"
        for t, v in mem:
            events.append((round(t * _NS), 2, mem_uuid, "", v))
    # Ends sort before begins at the same timestamp so back-to-back slices do not nest.
    events.sort(key=lambda e: (e[0], 0 if e[1] == 1 else 1, e[2]))
    for ts, kind, track, name, payload in events:
        p = packet()
        p.timestamp = ts
        ev = p.track_event
        ev.track_uuid = track
        if kind == 0:
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
        elif kind == 1:
            ev.type = TrackEvent.TYPE_SLICE_END
        else:
            ev.type = TrackEvent.TYPE_COUNTER
            ev.double_counter_value = float(payload)
    return b.serialize()
