"""Tests for sim/export/perfetto.py (protobuf `.pftrace` and Chrome `.json` exports of a step),
checked independently by parsing the files back, and for the `--perfetto/--out/--plots` outputs
of `tpusim train` (reference/perfetto.md: "it opens" proves nothing, compare the contents).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
import yaml
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace as PerfettoTrace
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

from sim.chips import get_chip
from sim.cli import main
from sim.engine.replay import replay
from sim.engine.result import StepResult
from sim.export.perfetto import export_step
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.trace import Op, Trace, Unit
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 4,
    "head_dim": 64, "d_ff": 1024, "mlp": "relu", "vocab_size": 512,
}
NS = 1e9


def _result(mesh: str = "fsdp=2,tensor=2", shape: str = "2x2", **cfg) -> StepResult:
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    config = {"seq_len": 128, "batch_per_chip": 2, **cfg}
    trace = compile_training_step(model_from_dict(TINY), parse_mesh(mesh), topo.num_chips,
                                  TrainingConfig(**config))
    return replay(trace, chip, topo)


# Configurations that between them put slices on MXU, VPU, several collective lanes and PCIe.
RESULTS = {
    "fsdp-tensor-offload": {"remat": Remat.OFFLOAD},
    "fsdp-dot-no-remat": {"mesh": "fsdp=4", "remat": Remat.NONE, "attention": "dot"},
    "one-chip": {"mesh": "fsdp=1", "shape": "1x1"},
}


def _is_link_track(track_name: str) -> bool:
    """`ICI x+ link 0`: the collectives that load one link direction (one slice per use)."""
    return track_name.startswith("ICI ") and " link " in track_name


def _category(track_name: str) -> tuple[str, str]:
    """(kind, unit) of the ops-table rows a track shows, from the track's name."""
    if track_name in ("MXU", "VPU"):
        return "compute", track_name.lower()
    if track_name.startswith("HBM DMA collectives"):
        return "collective", "ici"
    if track_name == "PCIe":
        return "host", "pcie"
    if track_name == "idle":
        return "idle", "idle"
    raise AssertionError(f"unexpected track {track_name!r}")


def _nonzero_rows(res: StepResult, *, whole_ns: bool = False) -> pd.DataFrame:
    """Rows with a positive duration; `whole_ns`: at least 1 ns once rounded to nanoseconds
    (the protobuf exporter drops shorter slices, which could not nest; they stay in --out)."""
    ops = res.ops
    if whole_ns:
        return ops[(ops.end_s * NS).round() > (ops.start_s * NS).round()]
    return ops[ops.end_s > ops.start_s]


def _parse_pftrace(path: Path) -> PerfettoTrace:
    trace = PerfettoTrace.FromString(path.read_bytes())
    assert len(trace.packet) > 0
    return trace


def _check_pftrace(trace: PerfettoTrace, res: StepResult) -> None:
    packets = list(trace.packet)
    assert packets, "empty trace"
    # Sequence bookkeeping.
    for p in packets:
        assert p.HasField("trusted_packet_sequence_id") and p.trusted_packet_sequence_id > 0
    assert packets[0].sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    # Tracks: declared before use; counters only on counter tracks.
    declared: dict[int, object] = {}
    slices: dict[int, list[tuple[int, int, str, dict]]] = defaultdict(list)
    open_slice: dict[int, tuple[int, str, dict]] = {}
    last_ts: dict[int, int] = {}
    counters: list[tuple[int, int, float]] = []
    for p in packets:
        if p.HasField("track_descriptor"):
            td = p.track_descriptor
            assert td.uuid not in declared, f"track {td.uuid} declared twice"
            if td.HasField("parent_uuid"):
                assert td.parent_uuid in declared
            declared[td.uuid] = td
            continue
        assert p.HasField("track_event"), p
        ev = p.track_event
        uuid = ev.track_uuid
        assert uuid in declared, f"track {uuid} used before its TrackDescriptor"
        assert p.HasField("timestamp")
        ts = p.timestamp
        assert ts >= last_ts.get(uuid, 0), f"time goes backwards on track {uuid}"
        last_ts[uuid] = ts
        if ev.type == TrackEvent.TYPE_COUNTER:
            assert declared[uuid].HasField("counter")
            counters.append((uuid, ts, ev.double_counter_value))
        elif ev.type == TrackEvent.TYPE_SLICE_BEGIN:
            assert not declared[uuid].HasField("counter")
            assert uuid not in open_slice, f"BEGIN inside an open slice on track {uuid}"
            args = {}
            for a in ev.debug_annotations:
                args[a.name] = (a.int_value if a.HasField("int_value") else
                                a.double_value if a.HasField("double_value") else a.string_value)
            open_slice[uuid] = (ts, ev.name, args)
        elif ev.type == TrackEvent.TYPE_SLICE_END:
            assert uuid in open_slice, f"END without BEGIN on track {uuid}"
            begin, name, args = open_slice.pop(uuid)
            assert ts >= begin
            slices[uuid].append((begin, ts, name, args))
        else:
            raise AssertionError(f"unexpected event type {ev.type}")
    assert not open_slice, f"slices never closed: {open_slice}"
    # One process per exported chip; the first names the representative and what is left out.
    procs = [td for td in declared.values() if td.HasField("process")]
    assert procs and f"{res.num_chips} chips" in procs[0].process.process_name
    assert f"{res.num_chips - len(procs)} identical chips not shown" in \
        procs[0].process.process_name
    by_proc: dict[int, list[int]] = defaultdict(list)
    for uuid, td in declared.items():
        if td.HasField("parent_uuid"):
            by_proc[td.parent_uuid].append(uuid)
    rows = _nonzero_rows(res, whole_ns=True).set_index("op_id")
    expected = rows.assign(cat=[
        (k, u if k == "compute" else b) for k, u, b in zip(rows.kind, rows.unit, rows.bound,
                                                            strict=True)
    ]).groupby("cat").size().to_dict()
    for proc in procs:
        per_category: dict[tuple[str, str], int] = defaultdict(int)
        seen = set()
        link_uses: dict[str, int] = defaultdict(int)
        counter_names = []
        for uuid in by_proc[proc.uuid]:
            td = declared[uuid]
            if td.HasField("counter"):
                counter_names.append(td.name)
                continue
            if _is_link_track(td.name):
                cls = td.name.split()[1]
                for _b, _e, _n, args in slices[uuid]:
                    assert cls in args["link_classes"].split(",")
                    link_uses[cls] += 1
                continue
            cat = _category(td.name)
            per_category[cat] += len(slices[uuid])
            for begin, end, name, args in slices[uuid]:
                op_id = args["op_id"]
                assert op_id not in seen
                seen.add(op_id)
                row = rows.loc[op_id]
                assert (row.kind, row.unit if row.kind == "compute" else row.bound) == cat
                assert name == row["name"]
                assert begin == pytest.approx(row.start_s * NS, abs=1)
                assert abs((end - begin) - (row.end_s - row.start_s) * NS) <= 1.0
        assert dict(per_category) == expected
        assert seen == set(rows.index)
        # Every collective appears once on each link direction it loads.
        want: dict[str, int] = defaultdict(int)
        for op_id in rows.index[rows.kind == "collective"]:
            for cls in res.collectives.link_classes.get(int(op_id), {}):
                want[cls] += 1
        assert dict(link_uses) == dict(want)
        assert "HBM occupancy (bytes)" in counter_names
        assert {f"ICI {c} utilization" for c in want} <= set(counter_names)
    # HBM counter samples: the memory table, in order (first process).
    mem = res.memory
    hbm_uuid = next(u for u in by_proc[procs[0].uuid]
                    if declared[u].name == "HBM occupancy (bytes)")
    samples = [(ts, v) for u, ts, v in counters if u == hbm_uuid]
    assert len(samples) == len(mem)
    for (ts, value), t, b in zip(samples, mem.time_s, mem.hbm_bytes, strict=True):
        assert value == b
        assert abs(ts - t * NS) <= 0.5
    for u, _ts, v in counters:
        if declared[u].name.endswith("utilization"):
            assert -1e-9 <= v <= 1 + 1e-6


@pytest.mark.parametrize("case", sorted(RESULTS))
def test_pftrace_parses_back_and_matches_the_step_tables(case, tmp_path):
    res = _result(**RESULTS[case])
    path = export_step(res, tmp_path / "step.pftrace")
    assert path == tmp_path / "step.pftrace"
    _check_pftrace(_parse_pftrace(path), res)


def test_pftrace_has_the_expected_tracks_for_offload_with_tensor_parallelism(tmp_path):
    res = _result(**RESULTS["fsdp-tensor-offload"])
    trace = _parse_pftrace(export_step(res, tmp_path / "s.pftrace"))
    names = {p.track_descriptor.name for p in trace.packet if p.HasField("track_descriptor")}
    assert {"MXU", "VPU", "PCIe", "HBM occupancy (bytes)"} <= names
    assert any(n.startswith("HBM DMA collectives") for n in names)


def test_sub_nanosecond_ops_keep_pftrace_slices_nested(tmp_path):
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="1x1")
    trace = Trace(mesh=parse_mesh("fsdp=1"), ops=(
        Op(id=0, name="big", unit=Unit.VPU, flops=6e6),
        Op(id=1, name="tiny", unit=Unit.VPU, flops=1.0, deps=(0,)),  # 0.16 ns on a v5e VPU
        Op(id=2, name="big2", unit=Unit.VPU, flops=6e6, deps=(1,)),
    ))
    res = replay(trace, chip, topo)
    assert len(_nonzero_rows(res)) == 3 and len(_nonzero_rows(res, whole_ns=True)) == 2
    pf = _parse_pftrace(export_step(res, tmp_path / "t.pftrace"))
    _check_pftrace(pf, res)  # BEGIN/END still alternate: the 0.16 ns op is left out
    names = [p.track_event.name for p in pf.packet if p.HasField("track_event")
             and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN]
    assert names == ["big", "big2"]  # (no collectives, so no link tracks)
    # The Chrome export keeps it (microsecond floats): 3 X events that do not overlap.
    _check_chrome(json.loads(export_step(res, tmp_path / "t.json").read_text()), res)


# -- Chrome JSON -------------------------------------------------------------------------------


def _check_chrome(doc: dict, res: StepResult) -> None:
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    events = doc["traceEvents"]
    thread_names: dict[tuple[int, int], str] = {}
    by_tid: dict[tuple[int, int], list[dict]] = defaultdict(list)
    counters = []
    for ev in events:
        for key in ("ph", "pid", "tid", "name"):
            assert key in ev, (key, ev)
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        ph = ev["ph"]
        if ph == "M":
            assert ev["name"] in ("process_name", "thread_name") and "name" in ev["args"]
            if ev["name"] == "thread_name":
                thread_names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        elif ph == "X":
            assert isinstance(ev["ts"], int | float) and isinstance(ev["dur"], int | float)
            assert ev["ts"] >= 0 and ev["dur"] >= 0
            by_tid[(ev["pid"], ev["tid"])].append(ev)
        elif ph == "C":
            assert isinstance(ev["ts"], int | float)
            counters.append(ev)
        else:
            raise AssertionError(f"unexpected phase {ph!r}")
    rows = _nonzero_rows(res).set_index("op_id")
    per_category: dict[tuple[str, str], int] = defaultdict(int)
    seen = set()
    for key, evs in by_tid.items():
        if _is_link_track(thread_names[key]):
            continue
        cat = _category(thread_names[key])
        per_category[cat] += len(evs)
        evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # end times of enclosing slices, microseconds
        for ev in evs:
            while stack and stack[-1] <= ev["ts"] + 1e-9:
                stack.pop()
            if stack:  # inside another slice: must end within it (no partial overlap)
                assert ev["ts"] + ev["dur"] <= stack[-1] + 1e-9, (thread_names[key], ev)
            stack.append(ev["ts"] + ev["dur"])
            row = rows.loc[ev["args"]["op_id"]]
            seen.add(ev["args"]["op_id"])
            # Microseconds.
            assert ev["ts"] == pytest.approx(row.start_s * 1e6, rel=1e-12, abs=1e-9)
            assert ev["dur"] == pytest.approx((row.end_s - row.start_s) * 1e6, rel=1e-9,
                                              abs=1e-9)
    expected = defaultdict(int)
    for k, u, b in zip(rows.kind, rows.unit, rows.bound, strict=True):
        expected[(k, u if k == "compute" else b)] += 1
    assert dict(per_category) == dict(expected)
    assert seen == set(rows.index)
    mem = res.memory
    hbm = [c for c in counters if c["name"] == "HBM occupancy (bytes)"]
    assert [c["args"]["value"] for c in hbm] == list(mem.hbm_bytes)
    assert [c["ts"] for c in hbm] == pytest.approx(list(mem.time_s * 1e6))


@pytest.mark.parametrize("case", sorted(RESULTS))
def test_chrome_json_is_strict_trace_event_format(case, tmp_path):
    res = _result(**RESULTS[case])
    path = export_step(res, tmp_path / "step.json")
    _check_chrome(json.loads(path.read_text()), res)


def test_both_formats_carry_the_same_slices(tmp_path):
    res = _result(**RESULTS["fsdp-tensor-offload"])
    pf = _parse_pftrace(export_step(res, tmp_path / "a.pftrace"))
    js = json.loads(export_step(res, tmp_path / "a.json").read_text())
    names = {p.track_descriptor.uuid: p.track_descriptor.name for p in pf.packet
             if p.HasField("track_descriptor")}
    n_pf = sum(1 for p in pf.packet
               if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN
               and not _is_link_track(names[p.track_event.track_uuid]))
    tnames = {(e["pid"], e["tid"]): e["args"]["name"] for e in js["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    n_js = sum(1 for e in js["traceEvents"]
               if e["ph"] == "X" and not _is_link_track(tnames[(e["pid"], e["tid"])]))
    assert n_pf == len(_nonzero_rows(res, whole_ns=True))
    assert n_js == len(_nonzero_rows(res))
    assert n_pf == n_js  # no sub-nanosecond ops in a real step


# -- CLI outputs -------------------------------------------------------------------------------

DOCUMENTED_COLUMNS = {
    "ops": ["chip", "op_id", "name", "kind", "unit", "bound", "layer", "phase", "start_s",
            "end_s", "flops", "bytes", "collective", "mesh_axes"],
    "units": ["chip", "unit", "busy_s", "utilization"],
    "links": ["link_class", "bytes_per_link", "busy_s", "utilization"],
    "memory": ["chip", "time_s", "hbm_bytes", "params", "optimizer", "gradients",
               "whole_gradients", "saved_activations", "gathered_weights", "logits",
               "temporaries", "other"],
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def _train(tiny_yaml: Path, tmp_path: Path, mesh: str, *extra: str) -> list[str]:
    return ["train", "--chip", "v5e", "--shape", "2x2", "--model", str(tiny_yaml),
            "--seq-len", "128", "--batch-per-chip", "2", "--mesh", mesh,
            "--perfetto", str(tmp_path / "f.pftrace"), "--out", str(tmp_path / "d"),
            "--plots", str(tmp_path / "p"), *extra]


def test_train_writes_perfetto_tables_and_plots(tiny_yaml, tmp_path, capsys):
    rc = main(_train(tiny_yaml, tmp_path, "fsdp=2,tensor=2", "--json"))
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    summary = json.loads(out)
    # Perfetto: parses and has one slice per non-zero-length op.
    pf = _parse_pftrace(tmp_path / "f.pftrace")
    ops = pd.read_parquet(tmp_path / "d" / "ops.parquet")
    names = {p.track_descriptor.uuid: p.track_descriptor.name for p in pf.packet
             if p.HasField("track_descriptor")}
    n_begin = sum(1 for p in pf.packet if p.HasField("track_event")
                  and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN
                  and not _is_link_track(names[p.track_event.track_uuid]))
    assert n_begin == int((ops.end_s > ops.start_s).sum())
    # Tables: CSV and Parquet with the documented columns and the same contents.
    for name, cols in DOCUMENTED_COLUMNS.items():
        csv = pd.read_csv(tmp_path / "d" / f"{name}.csv")
        pq = pd.read_parquet(tmp_path / "d" / f"{name}.parquet")
        assert list(csv.columns) == cols, name
        assert list(pq.columns) == cols, name
        assert len(csv) == len(pq) > 0, name
        for c in cols:
            if pd.api.types.is_numeric_dtype(pq[c]):
                assert csv[c].to_numpy() == pytest.approx(pq[c].to_numpy(), rel=1e-12), (name, c)
    assert json.loads((tmp_path / "d" / "summary.json").read_text()) == summary
    assert ops.end_s.max() == pytest.approx(summary["step_time_s"])
    # Plots: real PNG files.
    pngs = sorted((tmp_path / "p").glob("*.png"))
    assert [p.name for p in pngs] == ["breakdown.png", "energy.png", "links_on_torus.png",
                                      "timeline.png", "utilization.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
    # No temporary files left behind by the atomic writers.
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]


def test_train_error_leaves_no_output_files(tiny_yaml, tmp_path, capsys):
    before = set(tmp_path.rglob("*"))
    rc = main(_train(tiny_yaml, tmp_path, "fsdp=3"))
    _out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "fsdp=3" in err
    assert set(tmp_path.rglob("*")) == before
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()
    assert not (tmp_path / "f.pftrace").exists()


def test_perfetto_path_that_is_a_directory_is_refused_before_writing_anything(
        tiny_yaml, tmp_path, capsys):
    (tmp_path / "f.pftrace").mkdir()
    rc = main(_train(tiny_yaml, tmp_path, "fsdp=4"))
    _out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "is a directory" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("flag", ["--out", "--plots"])
def test_output_directory_that_is_an_existing_file_is_refused_before_writing(
        tiny_yaml, tmp_path, capsys, flag):
    argv = _train(tiny_yaml, tmp_path, "fsdp=4")
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me")
    argv[argv.index(flag) + 1] = str(blocker)
    rc = main(argv)
    _out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "existing file" in err
    assert blocker.read_text() == "keep me"
    assert not (tmp_path / "f.pftrace").exists()
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


def test_pftrace_for_several_chips_has_a_process_each_and_flows_between_group_neighbours(
    tmp_path,
):
    res = _result(**RESULTS["fsdp-tensor-offload"])
    path = export_step(res, tmp_path / "m.pftrace", chips=[0, 1, 2, 3])
    pf = _parse_pftrace(path)
    _check_pftrace(pf, res)
    procs = [p.track_descriptor for p in pf.packet
             if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")]
    assert len(procs) == 4
    assert "0 identical chips not shown" in procs[0].process.process_name
    parent = {p.track_descriptor.uuid: p.track_descriptor.parent_uuid for p in pf.packet
              if p.HasField("track_descriptor") and p.track_descriptor.HasField("parent_uuid")}
    starts: dict[int, list] = defaultdict(list)
    ends: dict[int, list] = defaultdict(list)
    for p in pf.packet:
        if not p.HasField("track_event"):
            continue
        ev = p.track_event
        if ev.type != TrackEvent.TYPE_SLICE_BEGIN:
            continue
        op = next(a.int_value for a in ev.debug_annotations if a.name == "op_id")
        for f in ev.flow_ids:
            starts[f].append((parent[ev.track_uuid], op, p.timestamp))
        for f in ev.terminating_flow_ids:
            ends[f].append((parent[ev.track_uuid], op, p.timestamp))
    assert starts and set(starts) == set(ends)
    n_coll = int((_nonzero_rows(res, whole_ns=True).kind == "collective").sum())
    for f in starts:
        assert len(starts[f]) == 1 and len(ends[f]) == 1  # flow ids are unique
        (src_proc, src_op, t0), (dst_proc, dst_op, t1) = starts[f][0], ends[f][0]
        assert src_proc != dst_proc and src_op == dst_op and t0 == t1  # SPMD: same time
    assert len(starts) <= 4 * n_coll


def _train_pod(tiny_yaml: Path, out: Path, shape: str, mesh: str, *extra: str) -> list[str]:
    return ["train", "--chip", "v5e", "--shape", shape, "--model", str(tiny_yaml),
            "--seq-len", "128", "--batch-per-chip", "1", "--mesh", mesh, "--quiet",
            "--perfetto", str(out), *extra]


@pytest.mark.parametrize("shape, mesh, chips", [
    ("4x4", "fsdp=8,tensor=2", "all"),  # a process per chip
    ("8x16", "fsdp=128", "0-79,100,127"),  # over 64 chips: chips as track groups under hosts
])
def test_streamed_multi_chip_trace_decodes_with_every_chip_its_tracks_and_flows(
        tiny_yaml, tmp_path, capsys, shape, mesh, chips):
    """The streamed writer encodes a chip class's timeline once and re-stamps track uuids,
    sequence ids and flow ids per chip: decode the file and check that every chip of
    --trace-chips has its process (or chip track group), the same tracks and slices as every
    other, flows that pair up between group neighbours, and that a rerun is byte-identical."""
    from sim.export.perfetto import MAX_CHIP_PROCESSES, parse_chip_list

    out = tmp_path / "s.pftrace"
    rc = main(_train_pod(tiny_yaml, out, shape, mesh, "--trace-chips", chips))
    assert rc == 0, capsys.readouterr().err
    data = out.read_bytes()
    pf = _parse_pftrace(out)
    num_chips = int(shape.split("x")[0]) * int(shape.split("x")[1])
    want = parse_chip_list(chips, num_chips)
    tds = {p.track_descriptor.uuid: p.track_descriptor for p in pf.packet
           if p.HasField("track_descriptor")}
    chip_tracks = {u: td for u, td in tds.items()
                   if (td.process.process_name if td.HasField("process") else td.name)
                   .startswith("chip ")}
    names = {u: (td.process.process_name if td.HasField("process") else td.name)
             for u, td in chip_tracks.items()}
    shown = sorted(int(n.split()[1]) for n in names.values())
    assert shown == want  # every chip has its process or group, once
    hosts = [td for td in tds.values() if td.HasField("process")
             and td.process.process_name.startswith("host ")]
    if len(want) > MAX_CHIP_PROCESSES:
        assert {td.parent_uuid for td in chip_tracks.values()} == {h.uuid for h in hosts}
        assert len(hosts) == len({c // 8 for c in want})
    else:
        assert not hosts and all(td.HasField("process") for td in chip_tracks.values())
        assert len({td.process.pid for td in chip_tracks.values()}) == len(want)
    # The same child tracks and the same number of slices under every chip.
    children: dict[int, list[str]] = defaultdict(list)
    for td in tds.values():
        if td.HasField("parent_uuid") and td.parent_uuid in chip_tracks:
            children[td.parent_uuid].append(td.name)
    assert len({tuple(sorted(v)) for v in children.values()}) == 1
    parent = {u: td.parent_uuid for u, td in tds.items() if td.HasField("parent_uuid")}
    begins: dict[int, int] = defaultdict(int)
    starts: dict[int, list[int]] = defaultdict(list)
    ends: dict[int, list[int]] = defaultdict(list)
    seq_first: dict[int, bool] = {}
    for p in pf.packet:
        seq = p.trusted_packet_sequence_id
        if seq not in seq_first:  # every sequence starts by clearing incremental state
            seq_first[seq] = bool(p.sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED)
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            proc = parent[p.track_event.track_uuid]
            begins[proc] += 1
            for f in p.track_event.flow_ids:
                starts[f].append(proc)
            for f in p.track_event.terminating_flow_ids:
                ends[f].append(proc)
    assert all(seq_first.values())
    assert len(set(begins.values())) == 1 and set(begins) == set(chip_tracks)
    # Flows: every id starts once and ends once, on two different chips.
    assert starts and set(starts) == set(ends)
    assert all(len(v) == 1 for v in starts.values()) and all(len(v) == 1 for v in ends.values())
    assert all(starts[f] != ends[f] for f in starts)
    # Decoded with the same checks as a one-chip trace: tracks declared before use, slices
    # nest, counters on counter tracks.
    packets = list(pf.packet)
    assert sum(p.HasField("track_event") for p in packets) > len(want) * 10
    rc = main(_train_pod(tiny_yaml, out, shape, mesh, "--trace-chips", chips))
    assert rc == 0 and out.read_bytes() == data  # byte-identical rerun


def test_streamed_chrome_json_has_a_process_per_chip(tiny_yaml, tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = main(_train_pod(tiny_yaml, out, "4x4", "fsdp=16", "--trace-chips", "all"))
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(int(n.split()[1]) for n in procs.values()) == list(range(16))
    per_pid: dict[int, int] = defaultdict(int)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            per_pid[e["pid"]] += 1
    assert set(per_pid) == set(procs) and len(set(per_pid.values())) == 1


def test_large_trace_warns_with_its_size_and_over_the_cap_is_refused_before_any_output(
        tiny_yaml, tmp_path, capsys, monkeypatch):
    import sim.export.perfetto as pft

    argv = _train_pod(tiny_yaml, tmp_path / "t.pftrace", "4x4", "fsdp=16", "--trace-chips",
                      "all", "--out", str(tmp_path / "d"))
    monkeypatch.setattr(pft, "WARN_TRACE_BYTES", 1000)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0
    size = (tmp_path / "t.pftrace").stat().st_size
    assert err.count("\n") == 1 and err.startswith("tpusim: warning: the Perfetto trace of 16 "
                                                   "chip(s) will take about ")
    assert "; narrow --trace-chips for a smaller file" in err  # the CLI spells the setting
    mb = float(err.split("about ")[1].split(" MB")[0].replace(",", ""))
    assert mb == pytest.approx(size / 1e6, rel=0.05, abs=0.01)  # the estimate is close
    (tmp_path / "t.pftrace").unlink()
    import shutil

    shutil.rmtree(tmp_path / "d")
    monkeypatch.setattr(pft, "MAX_TRACE_BYTES", 1000)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert "cap" in err and "narrow --trace-chips" in err
    assert not (tmp_path / "t.pftrace").exists() and not (tmp_path / "d").exists()


def test_trace_chips_outside_the_pod_is_a_one_line_error(tiny_yaml, tmp_path, capsys):
    rc = main(_train(tiny_yaml, tmp_path, "fsdp=2,tensor=2", "--trace-chips", "0-9"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--trace-chips" in err


@pytest.mark.parametrize("chunks", [1, 4])
def test_collective_pftrace_has_one_slice_per_timeline_step(tmp_path, chunks):
    from sim.collectives import simulate_collective
    from sim.export.perfetto import export_collective

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x8")
    res = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x,y",
                              nbytes=32 << 20, algorithm="multi-axis", chunks=chunks)
    pf = _parse_pftrace(export_collective(res, tmp_path / "c.pftrace"))
    begins, ends = {}, []
    open_at: dict[int, int] = {}
    names = {p.track_descriptor.uuid: p.track_descriptor.name for p in pf.packet
             if p.HasField("track_descriptor")}
    for p in pf.packet:
        if not p.HasField("track_event"):
            continue
        ev = p.track_event
        if not re.fullmatch(r"DMA stream \d+( lane \d+)?", names[ev.track_uuid]):
            continue  # the per-direction and per-link tracks repeat the steps
        if ev.type == TrackEvent.TYPE_SLICE_BEGIN:
            assert ev.track_uuid not in open_at  # slices on a track never overlap
            open_at[ev.track_uuid] = p.timestamp
            begins[len(ends)] = p.timestamp
        elif ev.type == TrackEvent.TYPE_SLICE_END:
            ends.append(p.timestamp - open_at.pop(ev.track_uuid))
    tl = res.timeline
    rows = tl[(tl.end_s * NS).round() > (tl.start_s * NS).round()]
    assert len(ends) == len(rows) and not open_at
    assert sorted(ends) == pytest.approx(sorted(((rows.end_s - rows.start_s) * NS).tolist()),
                                         abs=1.0)


def test_compare_collectives_perfetto_has_a_process_per_applicable_algorithm(tmp_path, capsys):
    out = tmp_path / "cmp.pftrace"
    rc = main(["compare-collectives", "--chip", "v5e", "--shape", "8x4", "--op", "all-gather",
               "--axes", "y", "--bytes", "1MiB", "--json", "--perfetto", str(out)])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    applicable = [r for r in doc["results"] if r["applicable"]]
    pf = _parse_pftrace(out)
    procs = {p.track_descriptor.uuid: p.track_descriptor.process.process_name for p in pf.packet
             if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")}
    assert len(procs) == len(applicable)
    parent = {p.track_descriptor.uuid: p.track_descriptor.parent_uuid for p in pf.packet
              if p.HasField("track_descriptor") and p.track_descriptor.HasField("parent_uuid")}
    tnames = {p.track_descriptor.uuid: p.track_descriptor.name for p in pf.packet
              if p.HasField("track_descriptor")}
    per_proc: dict[int, int] = defaultdict(int)
    for p in pf.packet:
        if (p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN
                and re.fullmatch(r"DMA stream \d+", tnames[p.track_event.track_uuid])):
            per_proc[parent[p.track_event.track_uuid]] += 1
    by_name = {procs[u].split(" on ")[0].removeprefix("all-gather "): n
               for u, n in per_proc.items()}
    for r in applicable:
        assert by_name[r["algorithm"]] == r["num_steps"]  # one slice per step (no chunks)


def _collective_trace(pf: PerfettoTrace):
    """{process name: {track name: [(begin_ns, end_ns, name, args)]}} of a collective trace."""
    tds = {p.track_descriptor.uuid: p.track_descriptor for p in pf.packet
           if p.HasField("track_descriptor")}
    out: dict[str, dict[str, list]] = {}
    open_at: dict[int, tuple] = {}
    for p in pf.packet:
        if not p.HasField("track_event"):
            continue
        ev = p.track_event
        if ev.type == TrackEvent.TYPE_SLICE_BEGIN:
            args = {a.name: (a.int_value if a.HasField("int_value") else
                             a.double_value if a.HasField("double_value") else a.string_value)
                    for a in ev.debug_annotations}
            open_at[ev.track_uuid] = (p.timestamp, ev.name, args)
        elif ev.type == TrackEvent.TYPE_SLICE_END:
            t0, name, args = open_at.pop(ev.track_uuid)
            td = tds[ev.track_uuid]
            proc = tds[td.parent_uuid].process.process_name
            out.setdefault(proc, {}).setdefault(td.name, []).append((t0, p.timestamp, name, args))
    return out


def test_symmetric_collective_trace_shows_steps_per_stream_and_direction(tmp_path):
    """A multi-axis all-reduce on a wrapped 8x8: one process, truthfully named as standing for
    all 64 chips; per part a `DMA stream` track with the schedule's steps (RS x, RS y, AG y,
    AG x, 7 folded hops each) and a track per link direction with the bytes a chip puts on it:
    a split ring sends half of each shard each way (k = 2 parts of V/2)."""
    from sim.collectives import simulate_collective
    from sim.export.perfetto import export_collective

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="8x8", wraparound="all")
    v = 64 << 20
    res = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x,y", nbytes=v,
                              algorithm="multi-axis")
    procs = _collective_trace(_parse_pftrace(export_collective(res, tmp_path / "c.pftrace")))
    (name, tracks), = procs.items()
    assert "stands for all 64 chips" in name and "symmetric" in name
    assert [s[2] for s in tracks["DMA stream 0"]] == [
        "part0 RS x x7", "part0 RS y x7", "part0 AG y x7", "part0 AG x x7"]
    assert [s[2] for s in tracks["DMA stream 1"]] == [
        "part1 RS y x7", "part1 RS x x7", "part1 AG x x7", "part1 AG y x7"]
    assert set(tracks) == {f"DMA stream {s}{d}" for s in (0, 1)
                           for d in ("", " x+", " x-", " y+", " y-")}
    part = v / 2
    # Part 0 reduce-scatters x first (buffer part/8 per hop), then y (part/64), and gathers
    # back y (shard part/64) then x (part/8); each hop sends half of it each way.
    x_plus = [s[3]["link_bytes_per_chip"] for s in tracks["DMA stream 0 x+"]]
    y_plus = [s[3]["link_bytes_per_chip"] for s in tracks["DMA stream 0 y+"]]
    assert x_plus == pytest.approx([7 * part / 8 / 2] * 2)  # RS x, AG x
    assert y_plus == pytest.approx([7 * part / 64 / 2] * 2)  # RS y, AG y
    for s0, s1 in zip(tracks["DMA stream 0"], tracks["DMA stream 0 x+"][:1], strict=False):
        assert (s0[0], s0[1]) == (s1[0], s1[1])  # the direction slice spans its step


def test_full_mode_collective_trace_shows_each_group_and_the_links_that_carried_each_step(
        tmp_path):
    """With a slow link, the x rings of a wrapped 4x4 are simulated link by link: the slow
    link's group and one group standing for the two untouched ones, each its own process
    named with its chips; each process has a track per link of its ring, and the bytes its
    slices carry add up to what the simulation put on that link."""
    from sim.collectives import simulate_collective
    from sim.export.perfetto import export_collective

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x4", wraparound="all")
    res = simulate_collective(chip=chip, topology=topo, op="all-gather", axes="x",
                              nbytes=4 << 20, algorithm="split-bidi-ring",
                              slow_links=("0,1:x+:0.5",))
    assert res.mode == "full"
    procs = _collective_trace(_parse_pftrace(export_collective(res, tmp_path / "c.pftrace")))
    assert len(procs) == 2
    names = sorted(procs)
    assert sum("stands for itself" in n for n in names) == 1
    assert sum("stands for 12 chips: itself and 2 identical group(s)" in n for n in names) == 1
    for name, tracks in procs.items():
        group = int(name.split("group ")[1].split(",")[0])
        links = {t: rows for t, rows in tracks.items() if t.startswith("ICI link ")}
        assert len(links) == 8  # a 4-chip ring, both directions
        for t, rows in links.items():
            lk = next(i for i in range(topo.num_ici_links)
                      if f"ICI link {topo.describe_link(i)}" == t)
            assert topo.coords(lk // 4)[1] == group  # the x ring at y = group
            assert sum(r[3]["bytes"] for r in rows) == pytest.approx(res.link_bytes[lk])
            assert {r[2] for r in rows} == {"AG x x3"}


def test_json_trace_for_several_chips_pairs_flow_events_between_group_neighbours(tmp_path):
    # The Chrome JSON export carries the same flows as .pftrace, as flow events: each id has one
    # `s` (start) and one `f` (finish, bound to the enclosing slice), on the collective lanes of
    # two different chips, at the start of a slice of the same op (SPMD: the same time).
    import json

    res = _result(**RESULTS["fsdp-tensor-offload"])
    path = export_step(res, tmp_path / "m.json", chips=[0, 1, 2, 3])
    events = json.loads(path.read_text())["traceEvents"]
    slices: dict[tuple, list] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append(e)

    def enclosing(e):
        hits = [s for s in slices[(e["pid"], e["tid"])]
                if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        assert hits, e
        return hits[0]

    starts = defaultdict(list)
    ends = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "f"):
            assert isinstance(e["id"], int) and e["cat"] == "tpusim"
            (starts if e["ph"] == "s" else ends)[e["id"]].append(e)
    assert starts and set(starts) == set(ends)
    for fid, (s,) in starts.items():
        (f,) = ends[fid]
        assert f["bp"] == "e" and s["pid"] != f["pid"] and s["ts"] == f["ts"]
        a, b = enclosing(s), enclosing(f)
        assert a["args"]["op_id"] == b["args"]["op_id"] and a["name"] == b["name"]
    # The same flows as the .pftrace export of the same chips.
    pf = _parse_pftrace(export_step(res, tmp_path / "m.pftrace", chips=[0, 1, 2, 3]))
    pf_ids = {f for p in pf.packet if p.HasField("track_event")
              for f in p.track_event.flow_ids}
    assert set(starts) == pf_ids


def test_writing_to_a_fifo_with_no_reader_says_so_in_one_line_then_writes_when_one_comes(
        tmp_path, capsys):
    import os
    import threading
    import time

    from sim.export.output import write_bytes

    fifo = tmp_path / "out.pipe"
    os.mkfifo(fifo)
    done = threading.Event()
    t = threading.Thread(target=lambda: (write_bytes(fifo, b"x" * 100_000), done.set()),
                         daemon=True)
    t.start()
    err = ""
    for _ in range(500):  # the note comes before the writer blocks for a reader
        err += capsys.readouterr().err
        if err:
            break
        time.sleep(0.01)
    assert err == (f"tpusim: note: {str(fifo)!r} is a FIFO with no reader yet; waiting for one "
                   f"to open it (Ctrl-C to stop)\n")
    with open(fifo, "rb") as f:
        got = f.read()
    t.join(10)
    assert done.is_set() and got == b"x" * 100_000
    # With a reader already there: no note, and the reader sees the whole output (the probe's
    # write end is held until the writer is done, so it never sees an early end-of-file).
    out: list[bytes] = []
    r = threading.Thread(target=lambda: out.append(open(fifo, "rb").read()), daemon=True)
    r.start()
    time.sleep(0.2)
    write_bytes(fifo, b"y" * 10)
    r.join(10)
    assert out == [b"y" * 10] and capsys.readouterr().err == ""
