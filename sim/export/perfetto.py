"""Perfetto export: native protobuf (`.pftrace`, encoded by `sim/export/pftrace.py` in the
`perfetto` package's trace schema) or Chrome Trace Event JSON (`.json`, for older viewers).

Both are streamed with bounded memory. An export is a `TracePlan`: a list of processes, each
showing one of a few distinct timelines (a chip class's step, a collective's group), every
timeline encoded once. `plan_step_trace` / `plan_collective_trace` build it (checking the span
and sizing the file before anything is written: `TracePlan.check_size` warns above
`WARN_TRACE_BYTES` and refuses over `MAX_TRACE_BYTES`), and `TracePlan.write()` streams it to a
temporary file renamed over the target (`output.atomic_write`). `export_step` and
`export_collective(s)` do both. A new kind of process (e.g. one per pipeline stage) is a
`TraceProcess` whose `key` names its timeline plus an `encode(key, as_json)` that returns
`encode_tracks(tracks, counters)` (or `chrome_events(...)` for JSON) for that key, where
`tracks` maps a track name to `(start_s, end_s, name, args, op_id)` slices.

Layout of a step: one process per exported chip (or per host, chips as track groups, when more
than `MAX_CHIP_PROCESSES` chips are exported), each with a track per unit (MXU, VPU), lanes of
HBM DMA work (the collectives, which DMA engines move between HBM and the links), one lane set
per outgoing ICI link direction (the collectives using that direction), PCIe host transfers,
pipeline idle time, and counter tracks for HBM occupancy and for each link direction's
utilization. Slices carry args (op id, name, FLOPs, bytes, bound unit, collective, mesh axes,
algorithm). Flows join each collective
slice to the same collective on the next chip of its replica group, and each pipeline send to
the receive it completes on the next (or previous) stage, when both are exported (in `.json`
as flow events `s`/`f` bound to the enclosing slices).

Per-chip engine: when chips differ (a slow chip, a slow link, chip variation), each chip class
(chips whose whole step is identical) is one process named with the chips it stands for, and
every chip of `chips=` is added with its class's timeline. Pipeline runs have a class per stage
at least, each with its own program (the stage's passes, sends and receives); its process name
starts with its stage (`StepResult.classes.titles`).

Big pods: tpusim replays one representative chip (every chip runs the same SPMD program), so by
default the trace holds chip 0 only; `chips=` (`trace_chips="0-15"`) shows more, each identical
in time by symmetry, and the first process's name says how many chips were left out. Slices on one
track never overlap, and slices shorter than 1 ns are left out (they would not nest once
rounded; they are in the op tables, `sim.export.output`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.collectives.algorithms import step_bytes_per_chip
from sim.collectives.orbits import canonical_chips, canonical_links
from sim.engine.result import MEMORY_COLUMNS, OP_COLUMNS
from sim.export.output import atomic_write
from sim.export.pftrace import PftraceWriter, encode_tracks
from topologies.errors import TpusimError, python_name
from topologies.groups import CLASS_NAMES, GroupGeometry, route_class_hops
from topologies.progress import tracked
from topologies.validate import short_repr

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
        raise TpusimError(f"{{trace_chips}} is empty; {hint}", "trace_chips")
    ranges = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"([0-9]{1,9})(?:\s*-\s*([0-9]{1,9}))?", part)
        if not m:
            raise TpusimError(f"{{trace_chips}} {short_repr(spec)} is not a chip list; {hint}",
                              "trace_chips")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise TpusimError(
                f"{{trace_chips}} {short_repr(spec)}: range {a}-{b} runs backwards; write {b}-{a}",
                "trace_chips"
            )
        if b >= num_chips:
            raise TpusimError(
                f"{{trace_chips}} {short_repr(spec)} names chip {b}, but the pod has chips 0.."
                f"{num_chips - 1}; pick chips in that range (or all)", "trace_chips"
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


POWER_COUNTER = "power (W)"


def _step_tracks(result) -> tuple[dict[str, list[tuple]], dict[str, list[tuple[float, float]]]]:
    """The representative chip's tracks and counters (shared by every exported chip)."""

    # The raw rows of `result.ops` (no DataFrame: pandas costs seconds to import).
    col = {c: i for i, c in enumerate(OP_COLUMNS)}
    i_op, i_name, i_kind, i_unit, i_bound = (col[c] for c in ("op_id", "name", "kind", "unit",
                                                                "bound"))
    i_layer, i_phase, i_start, i_end = (col[c] for c in ("layer", "phase", "start_s", "end_s"))
    i_flops, i_bytes, i_coll, i_axes = (col[c] for c in ("flops", "bytes", "collective",
                                                          "mesh_axes"))
    tracks: dict[str, list[tuple]] = {}
    coll = []
    for r in result.op_rows:
        start, end = float(r[i_start]), float(r[i_end])
        if end <= start:
            continue
        op_id = int(r[i_op])
        args = {"op_id": op_id, "layer": int(r[i_layer]), "phase": r[i_phase],
                "bound": r[i_bound], "flops": float(r[i_flops]), "bytes": float(r[i_bytes])}
        row = (start, end, r[i_name], args, op_id)
        kind = r[i_kind]
        if kind == "compute":
            tracks.setdefault(r[i_unit].upper(), []).append(row)
        elif kind == "collective":
            args.update(collective=r[i_coll], mesh_axes=r[i_axes],
                        algorithm=result.collectives.algorithms.get(op_id, ""))
            classes = result.collectives.link_classes.get(op_id, {})
            args["link_classes"] = ",".join(classes)
            coll.append(row)
        elif kind == "host":
            tracks.setdefault("PCIe", []).append(row)
        else:
            tracks.setdefault("idle", []).append(row)
    coll.sort(key=lambda x: (x[0], x[1], x[4]))
    for lane, row in zip(_lanes(coll), coll, strict=True):
        tracks.setdefault(f"HBM DMA collectives {lane}", []).append(row)
    # One lane set per link direction: the collectives that load it.
    by_class: dict[str, list[tuple]] = {}
    for row in coll:
        for cls, nbytes in result.collectives.link_classes.get(row[4], {}).items():
            a = dict(row[3])
            a["bytes_per_link"] = nbytes
            by_class.setdefault(cls, []).append((row[0], row[1], row[2], a, row[4]))
    counters: dict[str, list[tuple[float, float]]] = {}
    for cls, rows in sorted(by_class.items()):
        for lane, row in zip(_lanes(rows), rows, strict=True):
            tracks.setdefault(f"ICI {cls} link {lane}", []).append(row)
        counters[f"ICI {cls} utilization"] = _utilization(
            rows, result.collectives.class_capacity[cls])

    i_t, i_b = MEMORY_COLUMNS.index("time_s"), MEMORY_COLUMNS.index("hbm_bytes")
    counters["HBM occupancy (bytes)"] = [(float(m[i_t]), float(m[i_b])) for m in result.memory_rows]
    return tracks, counters


def _utilization(rows, capacity: float) -> list[tuple[float, float]]:
    """Piecewise-constant link utilization: each collective's average rate on the link.

    Concurrent collectives share a link unevenly over their lifetimes, so the sum of their
    average rates can exceed the link's capacity where they overlap; it is capped at 1."""
    deltas: dict[float, float] = {}
    for start, end, _name, args, _op in rows:
        rate = args["bytes_per_link"] / (end - start) / capacity
        deltas[start] = deltas.get(start, 0.0) + rate
        deltas[end] = deltas.get(end, 0.0) - rate
    level = 0.0
    out = []
    for t in sorted(deltas):
        level += deltas[t]
        out.append((t, min(max(level, 0.0), 1.0) if abs(level) > 1e-12 else 0.0))
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
            f"nanosecond clock can hold; drop {{perfetto}} or simulate a shorter program",
            "perfetto"
        )


# Above this estimate a trace gets a one-line warning; above the cap it is refused before any
# output is written (the file would be too big for the Perfetto UI, which loads the whole trace
# into the browser's memory, and slow to write).
WARN_TRACE_BYTES = 256 << 20
MAX_TRACE_BYTES = 4 << 30


def _mb(nbytes: float) -> str:
    if nbytes < 1e8:
        return f"{nbytes / 1e6:,.2f} MB"
    return f"{nbytes / 1e6:,.0f} MB" if nbytes < 1e10 else f"{nbytes / 1e9:,.1f} GB"


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceProcess:
    """One chip's process (or track group, under its host process when `host` is set)."""

    chip: int
    name: str
    key: Any  # which encoded timeline it shows
    host: int | None = None


class TracePlan:
    """A trace ready to stream: the processes, each timeline encoded once, and the file size.

    Built by `plan_step_trace` / `plan_collective_trace` (which check the span and the size
    before anything is written); `write()` streams it to the path (atomically, as the
    table exports do). The encoded timelines are the only large thing held in memory: one per
    chip class and flow pattern, however many chips show it.
    """

    def __init__(self, path: Path, procs: list[TraceProcess], encode, *, flows=None,
                 what: str = "the trace") -> None:
        self.path = path
        self.procs = procs
        self.json = path.suffix.lower() == ".json"
        self._flows = flows  # proc -> (flow-out ids, flow-in ids) by op id
        self._templates: dict[Any, Any] = {}
        self._encode = encode
        for p in procs:
            if p.key not in self._templates:
                self._templates[p.key] = encode(p.key, self.json)
        per_proc = 64 + max((len(p.name) for p in procs), default=0)
        if self.json:
            self.estimated_bytes = sum(len(self._templates[p.key]) + per_proc for p in procs)
        else:
            self.estimated_bytes = sum(self._templates[p.key].nbytes + per_proc for p in procs)
        self.what = what

    @property
    def num_processes(self) -> int:
        return len(self.procs)

    def check_size(self, *, warn=None, spell: Callable[[str], str] = python_name) -> None:
        """Refuse a trace over `MAX_TRACE_BYTES`; warn (one line on stderr, or via `warn`)
        above `WARN_TRACE_BYTES`, naming the setting that narrows it as `spell` writes it
        (the Python name; the CLI: its flag)."""
        n = len(self.procs)
        if self.estimated_bytes > MAX_TRACE_BYTES:
            raise TpusimError(
                f"the Perfetto trace of {self.what} would take about "
                f"{_mb(self.estimated_bytes)}, over the {_mb(MAX_TRACE_BYTES)} cap; narrow "
                f"{{trace_chips}} (e.g. {{trace_chips}} 0-{max(n // 8, 1) - 1})", "trace_chips"
            )
        if self.estimated_bytes > WARN_TRACE_BYTES:
            msg = TpusimError(f"tpusim: warning: the Perfetto trace of {self.what} will take "
                              f"about {_mb(self.estimated_bytes)}; narrow {{trace_chips}} for a "
                              f"smaller file\n", "trace_chips").render(spell)
            if warn is not None:
                warn(msg)
            else:
                import sys

                sys.stderr.write(msg)

    def write(self) -> Path:
        if self.json:
            return atomic_write(self.path, self._write_json)
        return atomic_write(self.path, self._write_pftrace)

    def _write_pftrace(self, target: Path) -> None:
        with open(target, "wb", buffering=1 << 20) as f:
            w = PftraceWriter(f)
            hosts: dict[int, int] = {}
            for pid, p in enumerate(tracked(self.procs, "Perfetto export", unit="chip"),
                                    start=1):
                if p.host is not None:
                    if p.host not in hosts:
                        h = p.host
                        hosts[h] = w.process(pid=h + 1, name=f"host {h} (chips {h * 8}-"
                                                              f"{h * 8 + 7})")
                    top = w.group(hosts[p.host], p.name)
                else:
                    top = w.process(pid=pid, name=p.name)
                kw = {}
                if self._flows is not None:
                    out_ids, in_ids = self._flows(p)
                    kw = {"flow_out_ids": out_ids, "flow_in_ids": in_ids}
                w.emit(self._templates[p.key], top, **kw)
            self.packets_written = w.packets_written

    def _write_json(self, target: Path) -> None:
        with open(target, "w", encoding="utf-8", buffering=1 << 20) as f:
            f.write('{"traceEvents":[')
            first = True
            for pid, p in enumerate(tracked(self.procs, "Perfetto export", unit="chip"),
                                    start=1):
                head = json.dumps({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                                   "args": {"name": p.name}}, separators=(",", ":"))
                body = self._templates[p.key]
                f.write(("" if first else ",") + head)
                first = False
                if body:
                    body = body.replace(_PID_MARK, f'"pid":{pid},')
                    if self._flows is not None and _FLOW_MARK in body:
                        body = _fill_flow_ids(body, *self._flows(p))
                    f.write("," + body)
            f.write("]}")


_PID_PLACEHOLDER = 987654321987654321  # replaced by each process's pid in the JSON template
_PID_MARK = f'"pid":{_PID_PLACEHOLDER},'


def chrome_events(tracks, counters, *, flows_out: frozenset[int] = frozenset(),
                   flows_in: frozenset[int] = frozenset(),
                   flow_tracks: tuple[str, ...] = ()) -> str:
    """One process's Chrome JSON events (after its process_name), pid and flow ids left as
    placeholders (`TracePlan._write_json` fills them in per process).

    Flows use the Trace Event format's flow events (`ph` `s` / `f`, bound to the enclosing
    slice): a ring collective's slice ends one flow and starts the next, which JSON's per-event
    flow ids (flow v2) cannot say. Slices on tracks named with one of `flow_tracks` start a flow
    when their op id is in `flows_out` and end one when it is in `flows_in`, as in `.pftrace`."""
    pid = _PID_PLACEHOLDER
    events = []
    for tid, (tname, rows) in enumerate(sorted(tracks.items()), start=1):
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                       "args": {"name": tname}})
        flowing = tname.startswith(flow_tracks) if flow_tracks else False
        for start, end, name, args, op in sorted(rows, key=lambda x: (x[0], x[1])):
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name,
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6,
                           "args": args})
            if flowing and op in flows_in:
                events.append({"ph": "f", "bp": "e", "pid": pid, "tid": tid, "name": "flow",
                               "cat": "tpusim", "id": f"{_FLOW_MARK}i{op}",
                               "ts": start * 1e6})
            if flowing and op in flows_out:
                events.append({"ph": "s", "pid": pid, "tid": tid, "name": "flow",
                               "cat": "tpusim", "id": f"{_FLOW_MARK}o{op}",
                               "ts": start * 1e6})
    for cname, samples in sorted(counters.items()):
        for t, v in samples:
            events.append({"ph": "C", "pid": pid, "tid": 0, "name": cname,
                           "ts": t * 1e6, "args": {"value": v}})
    return ",".join(json.dumps(e, separators=(",", ":")) for e in events)


_FLOW_MARK = "@tpusim-flow:"  # '"id":"@tpusim-flow:o12"' -> the flow id of op 12 leaving
_FLOW_ID = re.compile(r'"id":"' + re.escape(_FLOW_MARK) + r'([oi])(\d+)"')


def _fill_flow_ids(body: str, out_ids, in_ids) -> str:
    """A JSON template's flow id placeholders replaced by this process's flow ids."""
    def sub(m: re.Match) -> str:
        ids = out_ids if m.group(1) == "o" else in_ids
        return f'"id":{int(ids[int(m.group(2))])}'

    return _FLOW_ID.sub(sub, body)


_COLL_TRACK = "HBM DMA collectives"


def plan_step_trace(result, path: str | Path, *, chips: list[int] | None = None,
                    energy=None) -> TracePlan:
    """Everything `export_step` writes, encoded and sized but not yet written.

    One process per chip of `chips` (default chip 0); with several chip classes (per-chip
    engine), one process per class (its representative, named with the chips it stands for; at
    most `MAX_CHIP_PROCESSES` classes, the slowest first) plus every chip in `chips`, each with
    its own class's timeline. Over `MAX_CHIP_PROCESSES` chips, chips become track groups under
    a process per host of 8 chips. Flows join each collective slice to the same collective on
    the next chip of its replica group, when both are exported. Given the step's `Energy`
    (`sim.energy`), each chip carries a `power (W)` counter: its class's power over the
    step.
    """
    check_span(result.step_time_s)
    power = {c.chip_class: list(c.power_w) for c in energy.classes} if energy is not None \
        else {}
    path = Path(path)
    topo = result.pod
    if result.num_chip_classes > 1 and result.classes is not None:
        chips, names, class_of = _class_procs(result, chips or [])
    else:
        chips = chips or [0]
        left_out = result.num_chips - len(chips)
        names = []
        for c in chips:
            coords = topo.coords(c) if topo is not None else (c,)
            name = f"chip {c} {tuple(coords)}"
            if c == chips[0]:
                name += (f" [tpusim: {result.num_chips} chips of {result.topology} "
                         f"{result.chip} replayed as one representative; {left_out} identical "
                         f"chips not shown]")
            names.append(name)
        class_of = {c: 0 for c in chips}
    # Flows: collective op on chip c -> the same op on its group neighbour, if exported.
    # Ops with the same group axes share the neighbour map; a chip's flow pattern (which of
    # those maps have its out / in end exported) picks its encoded timeline.
    shown = set(chips)
    by_axes: dict[tuple, list[int]] = {}
    if topo is not None and len(chips) > 1:
        for op_id, gaxes in sorted(result.collectives.axes.items()):
            if gaxes:
                by_axes.setdefault(tuple(gaxes), []).append(int(op_id))
    keys = list(by_axes)
    outs: list[dict[int, int]] = []  # per axes key: chip -> its neighbour (when shown)
    preds: list[dict[int, int]] = []  # per axes key: chip -> the chip whose flow ends there
    same = _same_program_chips(result, chips) if keys else []
    for gaxes in keys:
        o: dict[int, int] = {}
        pr: dict[int, int] = {}
        for c in same:
            nb = _neighbour(topo, c, gaxes)
            if nb is not None and nb != c and nb in shown:
                o[c] = nb
                pr[nb] = c
        outs.append(o)
        preds.append(pr)
    # Pipeline sends: a flow from each send to the receive it completes on the peer stage.
    send_out, send_in = _send_flows(result, chips) if len(chips) > 1 else ({}, {})
    max_op = max([0, *(op for ops in by_axes.values() for op in ops),
                  *(op for d in (*send_out.values(), *send_in.values()) for op in d)])
    per_host = len(chips) > MAX_CHIP_PROCESSES
    procs = []
    for c, name in zip(chips, names, strict=True):
        pattern = (tuple((c in outs[i], c in preds[i]) for i in range(len(keys))),
                   frozenset(send_out.get(c, ())), frozenset(send_in.get(c, ())))
        procs.append(TraceProcess(chip=c, name=name, key=(class_of[c], pattern),
                           host=c // 8 if per_host else None))
    track_cache: dict[int, tuple] = {}

    def tracks_of(k: int):
        if k not in track_cache:
            track_cache.clear()  # one class's Python rows at a time (templates are kept)
            track_cache[k] = _step_tracks(result if result.num_chip_classes <= 1
                                          or result.classes is None
                                          else result.for_class(k))
        return track_cache[k]

    def encode(key, as_json: bool):
        k, (coll, s_out, s_in) = key
        tracks, counters = tracks_of(k)
        if k in power:
            counters = {**counters, POWER_COUNTER: power[k]}
        fo = frozenset(op for i, g in enumerate(keys) if coll[i][0] for op in by_axes[g]) | s_out
        fi = frozenset(op for i, g in enumerate(keys) if coll[i][1] for op in by_axes[g]) | s_in
        if as_json:
            return chrome_events(tracks, counters, flows_out=fo, flows_in=fi,
                                  flow_tracks=(_COLL_TRACK,))
        return encode_tracks(tracks, counters, flows_out=fo, flows_in=fi,
                             flow_tracks=(_COLL_TRACK,))

    def flows(p: TraceProcess):
        """Flow id lookup tables (by op id) for the flows leaving and ending on chip p."""
        import numpy as np

        n = result.num_chips
        out_ids = np.zeros(max_op + 1, dtype=np.int64)
        in_ids = np.zeros(max_op + 1, dtype=np.int64)
        for i, g in enumerate(keys):
            ops = np.asarray(by_axes[g], dtype=np.int64)
            out_ids[ops] = ops * n + p.chip + 1
            src = preds[i].get(p.chip)
            if src is not None:
                in_ids[ops] = ops * n + src + 1
        for op, fid in send_out.get(p.chip, {}).items():
            out_ids[op] = fid
        for op, fid in send_in.get(p.chip, {}).items():
            in_ids[op] = fid
        return out_ids, in_ids

    what = f"{len(chips)} chip(s)" if len(chips) != 1 else "1 chip"
    return TracePlan(path, procs, encode, flows=flows if (keys or send_out) else None,
                     what=what)


def _send_flows(result, chips: list[int]) -> tuple[dict[int, dict[int, int]],
                                                   dict[int, dict[int, int]]]:
    """Point-to-point sends (pipeline stages): a flow from each send on an exported chip to the
    receive it completes on its peer, when the peer is exported too. Returns {chip: {send op
    id: flow id}} and {chip: {receive op id: flow id}}."""
    out: dict[int, dict[int, int]] = {}
    into: dict[int, dict[int, int]] = {}
    if result.classes is None or result.classes.p2p is None:
        return out, into
    p2p, prog_of_class = result.classes.p2p
    label = result.classes.of_chip
    shown = set(chips)
    longest = max((len(v.trace.ops) for v in result.classes.programs.values()),
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
            out.setdefault(c, {})[int(send_id)] = fid
            into.setdefault(peer, {})[int(recv_id)] = fid
    return out, into


def _class_procs(result, extra: list[int]):
    import numpy as np

    topo = result.pod
    label = result.classes.of_chip
    reps = [int(r) for r in result.classes.reps]
    finish = [row[0] for row in result.classes.rows]
    shown = sorted(range(len(reps)), key=lambda k: (-finish[k], k))[:MAX_CHIP_PROCESSES]
    chips = sorted(set([reps[k] for k in shown]) | set(extra))
    names = []
    for c in chips:
        k = int(label[c])
        title = result.classes.titles.get(k)
        if c == reps[k]:
            members = np.flatnonzero(label == k)
            coords = [topo.coords(int(m)) for m in members[:8]]
            more = f" +{len(members) - 8} more" if len(members) > 8 else ""
            name = (f"{title + ', ' if title else ''}chip class {k}: {len(members)} chip(s) "
                    f"{' '.join(str(tuple(x)) for x in coords)}{more}")
        else:
            name = f"chip {c} {tuple(topo.coords(c))} (class {k}{', ' + title if title else ''})"
        names.append(name)
    if len(shown) < len(reps):
        names[0] += (f" [tpusim: {len(reps)} chip classes, the {len(shown)} slowest "
                     f"shown]")
    return chips, names, {c: int(label[c]) for c in chips}


def _same_program_chips(result, chips: list[int]) -> list[int]:
    """The chips that run the reported chip's program (collective flows join op ids of one
    program; pipeline stages run different programs)."""
    progs = result.classes.programs if result.classes is not None else {}
    if not progs:
        return list(chips)
    return [c for c in chips
            if getattr(progs.get(int(result.classes.of_chip[c])), "trace", None)
            is result.classes.program]


def export_step(result, path: str | Path, *, chips: list[int] | None = None) -> Path:
    """Write a replayed step as a Perfetto trace (`.pftrace`) or Chrome JSON (`.json`),
    streamed (see `plan_step_trace` for the layout). Warns above `WARN_TRACE_BYTES`."""
    plan = plan_step_trace(result, path, chips=chips)
    plan.check_size()
    return plan.write()


def plan_collective_trace(results, path: str | Path) -> TracePlan:
    """Several collectives (e.g. one per algorithm) as one trace (see `_collective_processes`
    for what each shows)."""
    for res in results:
        check_span(res.time_s, "the collective")
    procs = []
    parts = []
    for i, res in enumerate(results):
        for name, tracks in _collective_processes(res):
            procs.append(TraceProcess(chip=len(parts), name=name, key=len(parts)))
            parts.append((i, tracks))

    def encode(key, as_json: bool):
        tracks = parts[key][1]
        return chrome_events(tracks, {}) if as_json else encode_tracks(tracks, {})

    return TracePlan(Path(path), procs, encode, what=f"{len(results)} collective(s)")


MAX_LINK_TRACKS = 512  # link tracks per simulated group (the busiest links when there are more)


def _collective_processes(res) -> list[tuple[str, dict[str, list[tuple]]]]:
    """The processes of one collective: (name, tracks) each.

    Symmetric mode: one process for the representative chip, named as standing for every chip
    (by translation symmetry every chip does the same moves). Full, orbit and per-chip modes:
    one process per simulated replica group (at most `MAX_CHIP_PROCESSES`), named with its chips
    and with what it stands for (itself, the identical groups no perturbation touches, or its
    orbit under the pod's translations).

    Tracks: `DMA stream S` has one slice per step (the schedule's label, `xR` when R identical
    hops are folded into it); `DMA stream S x+` (one per link direction the stream uses)
    repeats the step with the bytes a chip puts on links of that direction; in full and
    per-chip modes `ICI link (0,0)->(1,0) x+` (one per link the group's routes loaded; the busiest
    `MAX_LINK_TRACKS` when more) shows each step that carried bytes over that link, and how
    many. Chunked schedules overlap within a stream: slices are spread over lanes.
    """

    sched = res.schedule
    topo = res.pod
    gaxes = sched.gaxes if sched is not None else ()
    head = f"{res.op} {res.algorithm} on {res.topology} {res.chip}"
    rows_of: dict[int, list[tuple]] = {}
    for r in res.timeline_rows:
        rows_of.setdefault(int(r[0]), []).append(r)
    geo = GroupGeometry(topo, gaxes) if gaxes and res.mode != "symmetric" else None
    class_bytes: dict[tuple[int, int], dict[str, float]] = {}
    if sched is not None:
        for si, stream in enumerate(sched.streams):
            for k, st in enumerate(stream):
                per: dict[str, float] = {}
                for m in st.moves:
                    for c in route_class_hops(gaxes, m.offset):
                        per[CLASS_NAMES[c]] = per.get(CLASS_NAMES[c], 0.0) + m.bytes * st.repeat
                class_bytes[(si, k)] = per
    out = []
    groups = sorted(rows_of)
    for g in groups[:MAX_CHIP_PROCESSES]:
        rows = rows_of[g]
        represented = int(rows[0][2])
        if res.mode == "symmetric":
            name = (f"{head}: chip 0 stands for all {res.num_chips} chips (symmetric: every "
                    f"chip does the same moves; {res.num_groups} group(s) of {res.group_size})")
        elif geo is None:  # send
            name = f"{head}: chip {tuple(topo.coords(int(rows[0][1])))}, simulated link by link"
        else:
            chips = geo.group_chips(g)
            shown = " ".join(str(tuple(topo.coords(int(c)))) for c in chips[:4])
            more = f" +{len(chips) - 4} more" if len(chips) > 4 else ""
            if res.mode == "orbit":
                stands = (f"stands for {represented} chips: the groups it maps to under the "
                          f"pod's translations (orbit mode)")
            elif represented > len(chips):
                stands = (f"stands for {represented} chips: itself and "
                          f"{represented // max(len(chips), 1) - 1} identical group(s) that "
                          f"no perturbation touches")
            else:
                stands = "stands for itself"
            name = (f"{head}: group {g}, {len(chips)} chips {shown}{more}, simulated link by "
                    f"link; {stands}")
        tracks: dict[str, list[tuple]] = {}
        link_rows: dict[int, list[tuple]] = {}
        link_total: dict[int, float] = {}
        for i, (_g, _chip, _rep, si, k, label, t0, t1, per_chip) in enumerate(rows):
            si, k = int(si), int(k)
            st = sched.streams[si][k] if sched is not None else None
            repeat = st.repeat if st is not None else 1
            sname = (label or f"step {k}") + (f" x{repeat}" if repeat > 1 else "")
            args = {"step": k, "repeat": repeat, "bytes_per_chip": float(per_chip),
                    "algorithm": res.algorithm, "chips_represented": represented}
            tracks.setdefault(f"DMA stream {si}", []).append((float(t0), float(t1), sname, args, i))
            # Chunks: each row is one chunk's pass through the step.
            frac = 1.0
            if st is not None and per_chip:
                whole = step_bytes_per_chip(st) * st.repeat
                frac = float(per_chip) / whole if whole else 1.0
            for cls, b in sorted(class_bytes.get((si, k), {}).items()):
                tracks.setdefault(f"DMA stream {si} {cls}", []).append(
                    (float(t0), float(t1), sname,
                     {"step": k, "link_bytes_per_chip": b * frac, "direction": cls}, i))
            if res.step_links is not None and (g, si, k) in res.step_links:
                links, nbytes = res.step_links[(g, si, k)]
                for lk, b in zip(links.tolist(), nbytes.tolist(), strict=True):
                    link_rows.setdefault(lk, []).append(
                        (float(t0), float(t1), sname,
                         {"step": k, "stream": si, "bytes": b * frac}, i))
                    link_total[lk] = link_total.get(lk, 0.0) + b * frac
        whose = "its routes"
        if res.mode == "orbit" and link_total and res.orbit_periods is not None:
            link_rows, link_total = _orbit_link_rows(res, link_rows)
            whose = "the groups of its orbit"
        kept = sorted(link_total, key=lambda lk: (-link_total[lk], lk))[:MAX_LINK_TRACKS]
        for lk in sorted(kept):
            tracks[f"ICI link {topo.describe_link(lk)}"] = link_rows[lk]
        if len(link_total) > len(kept):
            name += (f" (link tracks: the {len(kept)} busiest of the {len(link_total)} links "
                     f"{whose} loaded)")
        elif link_total:
            name += f" (link tracks: the {len(link_total)} links {whose} loaded)"
        elif res.mode != "symmetric" and res.step_links is None:
            name += " (no link tracks: more (step, link) pairs than the trace keeps)"
        out.append((name, _laned(tracks)))
    if len(groups) > MAX_CHIP_PROCESSES:
        first, rest = out[0]
        out[0] = (first + f" [tpusim: {len(groups)} groups simulated, the first "
                  f"{MAX_CHIP_PROCESSES} shown]", rest)
    return out


def _orbit_link_rows(res, link_rows: dict[int, list[tuple]]):
    """Orbit mode: a simulated group's link rows (on the links its representative chips'
    routes loaded) expanded to every link of the pod its orbit of groups loads, exactly.

    A translation by the orbit periods maps each transfer to a transfer of another group of
    the orbit, at the same times with the same bytes (that is what makes orbit mode exact), so
    link L carries, in each timeline row, the bytes of every routed link in L's orbit in that
    row: rows of one timeline row are summed. Returns ({link: rows}, {link: total bytes})
    limited to the links of the best `MAX_LINK_TRACKS` totals (every link of an orbit has the
    same total, so ranking orbits is ranking links), plus the count of all links loaded."""
    import numpy as np

    topo = res.pod
    canon = canonical_links(topo, canonical_chips(topo, res.orbit_periods))
    merged: dict[int, dict[int, tuple]] = {}  # canonical link -> timeline row -> slice
    for lk, rows in link_rows.items():
        by_row = merged.setdefault(int(canon[lk]), {})
        for t0, t1, sname, args, i in rows:
            if i in by_row:
                prev = by_row[i]
                args = {**prev[3], "bytes": prev[3]["bytes"] + args["bytes"]}
            by_row[i] = (t0, t1, sname, args, i)
    orbit_total = {c: sum(r[3]["bytes"] for r in by_row.values()) for c, by_row in merged.items()}
    cs = np.fromiter(orbit_total, dtype=np.int64, count=len(orbit_total))
    members = np.flatnonzero(np.isin(canon, cs))
    totals = np.asarray([orbit_total[int(c)] for c in canon[members]], dtype=float)
    order = np.lexsort((members, -totals))[:MAX_LINK_TRACKS]
    rows_of = {int(members[j]): [merged[int(canon[members[j]])][i]
                                 for i in sorted(merged[int(canon[members[j]])])]
               for j in order}
    total_of = {lk: orbit_total[int(canon[lk])] for lk in rows_of}
    # The links not kept still count in the name's "of N links": give them their totals.
    for j in np.flatnonzero(~np.isin(np.arange(len(members)), order)):
        total_of[int(members[j])] = float(totals[j])
    return rows_of, total_of


def _laned(tracks: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Overlapping slices of a track (chunks, concurrent streams on one link) spread over
    `NAME lane N` tracks so that slices on one track never overlap."""
    laned: dict[str, list[tuple]] = {}
    for name, rows in tracks.items():
        rows.sort(key=lambda x: (x[0], x[1], x[4]))
        for lane, row in zip(_lanes(rows), rows, strict=True):
            laned.setdefault(name if lane == 0 else f"{name} lane {lane}", []).append(row)
    return laned


def export_collective(res, path: str | Path) -> Path:
    """A collective's steps per stream as a trace."""
    return export_collectives([res], path)


def export_collectives(results, path: str | Path) -> Path:
    """Several collectives (e.g. one per algorithm) as one trace, a process each."""
    plan = plan_collective_trace(results, path)
    plan.check_size()
    return plan.write()
