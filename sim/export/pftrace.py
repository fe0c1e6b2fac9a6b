"""Streaming writer of Perfetto's native trace format (`.pftrace`), with bounded memory.

A `.pftrace` file is a `Trace` protobuf: a run of length-delimited `TracePacket`s (field 1), so
packets can be appended one by one to an open file. This module encodes the few packet kinds
tpusim writes (process and track descriptors, slice begin/end and counter events with debug
annotations and flow ids) straight to protobuf wire format, without building message objects.

The unit of reuse is a `TrackSet`: the tracks of one timeline (e.g. one chip class's step), each
a list of slices `(start_s, end_s, name, args, op_id)` plus counter tracks of `(t_s, value)`
samples. `PftraceWriter.encode` turns a TrackSet into a `Template` once: the packets' bytes with
the fields that differ between copies (track uuids, the packet sequence id, flow ids) written at
a fixed width, so that each further process showing the same timeline (every chip of a class)
costs a copy of the bytes and a few numpy scatters instead of re-encoding every event. Uuids and
sequence ids are varints whose values are kept in a range of constant encoded length; flow ids
are fixed64 in the schema.

Usage (see `sim/export/perfetto.py` for the step and collective exports):

    with open(path, "wb") as f:
        w = PftraceWriter(f)
        top = w.process(pid=1, name="chip 0 (0, 0)")      # or w.group(parent, name)
        tmpl = w.encode(tracks, counters)                    # once per distinct timeline
        w.emit(tmpl, top)                                    # once per process showing it

Each `process`/`group` call starts a new packet sequence (its first packet clears incremental
state); the events of one `emit` are sorted by time (ends before begins at equal timestamps, so
back-to-back slices do not nest). Identical calls give identical bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from topologies.errors import TpusimError

_NS = 1e9
# Fixed-width varint ranges: every value in [2^(7(k-1)), 2^(7k)) encodes in exactly k bytes.
_UUID_WIDTH = 6
_UUID_BASE = 1 << 35
TRACKS_PER_PROCESS = 1 << 16  # uuid stride between processes
MAX_PROCESSES = ((1 << 42) - _UUID_BASE) // TRACKS_PER_PROCESS
_SEQ_WIDTH = 4
_SEQ_BASE = 1 << 21

SEQ_INCREMENTAL_STATE_CLEARED = 1
_SLICE_BEGIN, _SLICE_END, _COUNTER = 1, 2, 4  # TrackEvent.Type


_SMALL = [bytes((v,)) for v in range(128)]


def _varint(v: int) -> bytes:
    if 0 <= v < 128:
        return _SMALL[v]
    if 0 < v < 16384:
        return bytes(((v & 0x7F) | 0x80, v >> 7))
    if v < 0:
        v += 1 << 64  # int64 two's complement: ten bytes
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _fixed_varint(v: int, width: int) -> bytes:
    out = bytearray()
    for j in range(width):
        out.append(((v >> (7 * j)) & 0x7F) | (0x80 if j < width - 1 else 0))
    return bytes(out)


def _fixed_varints(values: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8: each value as a `width`-byte varint (values must fit that width)."""
    shifts = 7 * np.arange(width, dtype=np.int64)
    out = ((values[:, None] >> shifts) & 0x7F).astype(np.uint8)
    out[:, :-1] |= 0x80
    return out


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _key(field, 2) + _varint(len(payload)) + payload


def _str(field: int, s: str) -> bytes:
    return _ld(field, s.encode("utf-8"))


def _annotation(name: str, v: Any) -> bytes:
    body = _str(10, name)
    if isinstance(v, bool):
        body += _key(4, 0) + _varint(int(v))
    elif isinstance(v, (int, np.integer)):
        body += _key(4, 0) + _varint(int(v))
    elif isinstance(v, (float, np.floating)):
        body += _key(5, 1) + struct.pack("<d", float(v))
    else:
        body += _str(6, str(v))
    return _ld(4, body)


_K_UUID_TE = _key(11, 0)  # TrackEvent.track_uuid
_K_SEQ = _key(10, 0)  # TracePacket.trusted_packet_sequence_id
_K_TS = _key(8, 0)
_K_FLOW = _key(47, 1)
_K_TFLOW = _key(48, 1)
_K_DOUBLE_COUNTER = _key(44, 1)
_SEQ_FIELD_PAD = _K_SEQ + bytes(_SEQ_WIDTH)
_UUID_FIELD_PAD = _K_UUID_TE + bytes(_UUID_WIDTH)
_K_TRACK_EVENT = _key(11, 2)
_K_PACKET = _key(1, 2)
_TE_LEN = len(_K_UUID_TE) + _UUID_WIDTH
_SEQ_FIELD = len(_K_SEQ) + _SEQ_WIDTH
assert len(_K_SEQ) == 1 and len(_K_UUID_TE) == 1  # raw_event's offsets rely on it


def _ns(t: float) -> int:
    return round(t * _NS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    """Encoded packets of one TrackSet, with the positions of the per-copy fields.

    Attributes:
        data: the packets (each already framed as a `Trace.packet` field).
        uuid_pos, uuid_local: byte offset of every track-uuid varint and the track's index
            within the set (0 = the process/group track the set hangs under).
        seq_pos: byte offsets of every sequence-id varint.
        flow_pos, flow_op, flow_in: offsets of fixed64 flow ids, their op id and whether the
            flow ends there (True) or starts there (False).
        num_tracks: tracks declared by the set (for the uuid stride check).
        num_events: slice begin/end and counter events.
    """

    data: bytes
    uuid_pos: np.ndarray
    uuid_local: np.ndarray
    seq_pos: np.ndarray
    flow_pos: np.ndarray
    flow_op: np.ndarray
    flow_in: np.ndarray
    num_tracks: int
    num_events: int
    # `uuid_index`'s arrays once computed (the template's own cache: a template is written
    # once per copy of its track set).
    _uuid_cache: list = field(default_factory=list, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def uuid_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat byte positions of the uuid varints and the bytes of their local parts (the
        low 16 bits; continuation bits set except on each varint's last byte). Cached."""
        if not self._uuid_cache:
            idx = (self.uuid_pos[:, None] + np.arange(_UUID_WIDTH)).ravel()
            low = _fixed_varints(self.uuid_local, _UUID_WIDTH)
            low[:, -1] &= 0x7F
            self._uuid_cache.extend((idx, low))
        return self._uuid_cache[0], self._uuid_cache[1]


class _Builder:
    """Accumulates packets and the positions of their per-copy fields."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.uuid_pos: list[int] = []
        self.uuid_local: list[int] = []
        self.seq_pos: list[int] = []
        self.flow_pos: list[int] = []
        self.flow_op: list[int] = []
        self.flow_in: list[bool] = []

    def packet(self, pieces: list[bytes | tuple]) -> None:
        """Append one TracePacket made of `pieces`: bytes, ("uuid", local), ("seq",) or
        ("flow", op_id, ends_here); nested messages are given as ("msg", field, pieces)."""
        body, marks = self._flatten(pieces)
        head = _key(1, 2) + _varint(len(body))
        base = self.size + len(head)
        for kind, off, *rest in marks:
            if kind == "uuid":
                self.uuid_pos.append(base + off)
                self.uuid_local.append(rest[0])
            elif kind == "seq":
                self.seq_pos.append(base + off)
            else:
                self.flow_pos.append(base + off)
                self.flow_op.append(rest[0])
                self.flow_in.append(rest[1])
        self.parts.append(head)
        self.parts.append(body)
        self.size += len(head) + len(body)

    def raw_event(self, ts_field: bytes, track: int, rest: bytes,
                  flows: list[tuple[int, int, bool]]) -> None:
        """Append a TrackEvent packet: `ts_field`, the sequence id, then the event: the track
        uuid and `rest` (flow ids at the given offsets of `rest`)."""
        te_len = _TE_LEN + len(rest)
        head_te = _K_TRACK_EVENT + _varint(te_len)
        n_ts = len(ts_field)
        body_len = n_ts + _SEQ_FIELD + len(head_te) + te_len
        head = _K_PACKET + _varint(body_len)
        seq_at = self.size + len(head) + n_ts + 1  # after the one-byte sequence-id key
        uuid_at = seq_at + _SEQ_WIDTH + len(head_te) + 1  # after the one-byte track_uuid key
        self.seq_pos.append(seq_at)
        self.uuid_pos.append(uuid_at)
        self.uuid_local.append(track)
        if flows:
            rest_at = uuid_at + _UUID_WIDTH
            for off, op, ends in flows:
                self.flow_pos.append(rest_at + off)
                self.flow_op.append(op)
                self.flow_in.append(ends)
        self.parts += (head, ts_field, _SEQ_FIELD_PAD, head_te, _UUID_FIELD_PAD, rest)
        self.size += len(head) + body_len

    def _flatten(self, pieces) -> tuple[bytes, list[tuple]]:
        out = bytearray()
        marks: list[tuple] = []
        for p in pieces:
            if isinstance(p, bytes):
                out += p
            elif p[0] == "uuid":
                marks.append(("uuid", len(out), p[1]))
                out += bytes(_UUID_WIDTH)
            elif p[0] == "seq":
                marks.append(("seq", len(out)))
                out += bytes(_SEQ_WIDTH)
            elif p[0] == "flow":
                marks.append(("flow", len(out), p[1], p[2]))
                out += bytes(8)
            else:  # ("msg", field, pieces)
                inner, inner_marks = self._flatten(p[2])
                head = _key(p[1], 2) + _varint(len(inner))
                base = len(out) + len(head)
                marks += [(m[0], base + m[1], *m[2:]) for m in inner_marks]
                out += head + inner
        return bytes(out), marks

    def template(self, num_tracks: int, num_events: int) -> Template:
        return Template(
            data=b"".join(self.parts),
            uuid_pos=np.asarray(self.uuid_pos, dtype=np.int64),
            uuid_local=np.asarray(self.uuid_local, dtype=np.int64),
            seq_pos=np.asarray(self.seq_pos, dtype=np.int64),
            flow_pos=np.asarray(self.flow_pos, dtype=np.int64),
            flow_op=np.asarray(self.flow_op, dtype=np.int64),
            flow_in=np.asarray(self.flow_in, dtype=bool),
            num_tracks=num_tracks, num_events=num_events,
        )


def _counter_unit(name: str) -> str:
    if "bytes" in name:
        return "bytes"
    return "count" if name.endswith(("cubes free", "steps committed", "blocks used",
                                     "queue length")) else "fraction"


def encode_tracks(
    tracks: dict[str, list[tuple]],
    counters: dict[str, list[tuple[float, float]]],
    *,
    flows_out: frozenset[int] = frozenset(),
    flows_in: frozenset[int] = frozenset(),
    flow_tracks: tuple[str, ...] = (),
) -> Template:
    """Encode one timeline: a child track per entry of `tracks` and `counters` (sorted by
    name), then every event sorted by (time, end before begin before counter, track).

    Slices on tracks whose name starts with one of `flow_tracks` carry a flow out (if their
    op id is in `flows_out`) and a terminating flow in (`flows_in`); the flow ids are filled in
    per copy. Slices shorter than 1 ns once rounded are left out (they would not nest).
    """
    b = _Builder()
    local = 0
    events: list[tuple] = []
    for tname, rows in sorted(tracks.items()):
        local += 1
        b.packet([_K_SEQ, ("seq",), ("msg", 60, [
            _key(1, 0), ("uuid", local), _str(2, tname), _key(5, 0), ("uuid", 0)])])
        flowing = tname.startswith(flow_tracks) if flow_tracks else False
        for start, end, name, args, op in rows:
            b_ns, e_ns = _ns(start), _ns(end)
            if e_ns <= b_ns:
                continue  # shorter than 1 ns once rounded: it would not nest (kept in --out)
            fo = flowing and op in flows_out
            fi = flowing and op in flows_in
            events.append((b_ns, 1, local, len(events), name, args, op if fo else None,
                           op if fi else None))
            events.append((e_ns, 0, local, len(events), None, None, None, None))
    for cname, samples in sorted(counters.items()):
        local += 1
        b.packet([_K_SEQ, ("seq",), ("msg", 60, [
            _key(1, 0), ("uuid", local), _str(2, cname), _key(5, 0), ("uuid", 0),
            _ld(8, _str(6, _counter_unit(cname)))])])
        for t, v in samples:
            events.append((_ns(t), 2, local, len(events), None, float(v), None, None))
    if local >= TRACKS_PER_PROCESS:
        raise TpusimError(
            f"a Perfetto process would have {local:,} tracks, over the {TRACKS_PER_PROCESS:,} "
            f"this exporter supports; export fewer chips or a shorter program"
        )
    events.sort()  # (time, end < begin < counter, track, then order of creation): no ties
    names: dict[str, bytes] = {}
    arg_cache: dict[tuple, bytes] = {}
    for ts, kind, track, _n, name, payload, fo, fi in events:
        # Packet = ts, sequence id (fixed width), track_event {track_uuid (fixed width), type,
        # name, annotations, flow ids}: laid out by hand, the hot loop of a big export.
        flows: list[tuple[int, int, bool]] = []  # (offset in `rest`, op id, ends here)
        if kind == 1:
            enc = names.get(name)
            if enc is None:
                enc = names[name] = _str(23, name)
            parts = [b"\x48\x01", enc]  # type = SLICE_BEGIN
            for k, v in payload.items():
                ck = (k, type(v), v)
                a = arg_cache.get(ck)
                if a is None:
                    a = _annotation(k, v)
                    if len(arg_cache) < 100_000:
                        arg_cache[ck] = a
                parts.append(a)
            rest = b"".join(parts)
            if fo is not None:
                flows.append((len(rest) + len(_K_FLOW), fo, False))
                rest += _K_FLOW + bytes(8)
            if fi is not None:
                flows.append((len(rest) + len(_K_TFLOW), fi, True))
                rest += _K_TFLOW + bytes(8)
        elif kind == 0:
            rest = b"\x48\x02"  # type = SLICE_END
        else:
            rest = b"\x48\x04" + _K_DOUBLE_COUNTER + struct.pack("<d", payload)  # COUNTER
        b.raw_event(_K_TS + _varint(ts), track, rest, flows)
    return b.template(local + 1, len(events))


class PftraceWriter:
    """Appends TracePackets to a binary file object (see the module docstring)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.bytes_written = 0
        self.packets_written = 0
        self._next_slot = 0

    def _slot(self) -> int:
        s = self._next_slot
        if s >= MAX_PROCESSES:
            raise TpusimError(f"a Perfetto trace holds at most {MAX_PROCESSES:,} processes here")
        self._next_slot += 1
        return s

    def _write(self, data: bytes, packets: int) -> None:
        self.f.write(data)
        self.bytes_written += len(data)
        self.packets_written += packets

    def _top(self, slot: int, descriptor: list) -> int:
        uuid = _UUID_BASE + slot * TRACKS_PER_PROCESS
        seq = _SEQ_BASE + slot
        b = _Builder()
        b.packet([_K_SEQ + _fixed_varint(seq, _SEQ_WIDTH),
                  _key(13, 0) + _varint(SEQ_INCREMENTAL_STATE_CLEARED),
                  ("msg", 60, [_key(1, 0) + _fixed_varint(uuid, _UUID_WIDTH), *descriptor])])
        self._write(b.template(1, 0).data, 1)
        return slot

    def process(self, *, pid: int, name: str) -> int:
        """Declare a process track; returns its handle for `emit` and `group`."""
        return self._top(self._slot(), [_ld(3, _key(1, 0) + _varint(pid) + _str(6, name))])

    def group(self, parent: int, name: str) -> int:
        """Declare a named track group under the process or group `parent` (e.g. a chip under
        its host process); returns its handle."""
        puuid = _UUID_BASE + parent * TRACKS_PER_PROCESS
        return self._top(self._slot(), [_str(2, name),
                                        _key(5, 0) + _fixed_varint(puuid, _UUID_WIDTH)])

    def emit(self, tmpl: Template, handle: int, *, flow_out_ids: np.ndarray | None = None,
             flow_in_ids: np.ndarray | None = None) -> None:
        """Write one copy of `tmpl` under the process/group `handle`.

        Flow ids come from lookup tables by op id: a slice's flow out gets
        `flow_out_ids[op]`, its terminating flow `flow_in_ids[op]` (the other end of each flow
        must get the same id in its own copy)."""
        buf = np.frombuffer(tmpl.data, dtype=np.uint8).copy()
        if len(tmpl.uuid_pos):
            # uuid = high part (this process) + local index < 2^16: disjoint bits, so each
            # varint byte is the OR of the two parts' bytes (continuation bits included).
            high = _fixed_varints(np.array([_UUID_BASE + handle * TRACKS_PER_PROCESS]),
                                  _UUID_WIDTH)
            idx, low = tmpl.uuid_index()
            buf[idx] = (low | high).ravel()
        if len(tmpl.seq_pos):
            seq = np.frombuffer(_fixed_varint(_SEQ_BASE + handle, _SEQ_WIDTH), dtype=np.uint8)
            buf[tmpl.seq_pos[:, None] + np.arange(_SEQ_WIDTH)] = seq
        if len(tmpl.flow_pos):
            assert flow_out_ids is not None and flow_in_ids is not None
            ids = np.where(tmpl.flow_in, flow_in_ids[tmpl.flow_op],
                           flow_out_ids[tmpl.flow_op]).astype("<u8")
            buf[tmpl.flow_pos[:, None] + np.arange(8)] = ids.view(np.uint8).reshape(-1, 8)
        self._write(buf.tobytes(), tmpl.num_events + tmpl.num_tracks - 1)
