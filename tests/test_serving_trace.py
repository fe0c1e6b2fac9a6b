"""`tpusim serve --perfetto`: a process per replica with its iterations, its requests' phases
joined by flows across replicas, and KV-block and queue counters (sim/export/serving_trace.py);
every expected value is read off the run's own request and iteration tables."""

from __future__ import annotations

import json

import pytest

from sim.export.serving_trace import export_serving
from sim.runs import ServeRequest, run
from workloads.models import MlpKind, TransformerSpec

TINY = TransformerSpec(name="serve-tiny", num_layers=2, d_model=1024, num_heads=8,
                       num_kv_heads=8, head_dim=128, d_ff=4096, mlp=MlpKind.SWIGLU,
                       vocab_size=8192)
POD = {"model": TINY, "chip": "v5e", "shape": "2x2", "mesh": "tensor=4"}


def _trace_file(tmp_path, rows):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n"
                 + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    return str(p)


def _read(path):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace

    t = Trace.FromString(path.read_bytes())
    names, parent, procs = {}, {}, {}
    for p in t.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            names[d.uuid] = d.name
            parent[d.uuid] = d.parent_uuid
            if d.HasField("process"):
                procs[d.uuid] = d.process.process_name
    slices, counters = [], {}
    for p in t.packet:
        if p.HasField("track_event") and p.track_event.type == 1:
            e = p.track_event
            args = {a.name: (a.int_value if a.HasField("int_value") else a.string_value)
                    for a in e.debug_annotations}
            slices.append({"t": p.timestamp, "track": names[e.track_uuid],
                           "proc": procs[parent[e.track_uuid]], "name": e.name, "args": args,
                           "out": list(e.flow_ids), "in": list(e.terminating_flow_ids)})
        elif p.HasField("track_event") and p.track_event.type == 4:
            e = p.track_event
            key = (procs[parent[e.track_uuid]], names[e.track_uuid])
            counters.setdefault(key, []).append((p.timestamp, e.double_counter_value))
    return procs, slices, counters


def test_disaggregated_trace_has_a_process_per_replica_and_each_request_flows_across(tmp_path):
    rows = [(0.0, 16, 3), (0.001, 300, 4), (0.002, 64, 5)]
    r = run(ServeRequest(**POD, arrival="trace", trace=_trace_file(tmp_path, rows),
                         prefill_replicas=1, decode_replicas=1, exact_costs=True))
    path = export_serving(r.summary, r.result, tmp_path / "s.pftrace")
    procs, slices, counters = _read(path)
    assert sorted(procs.values())[0].startswith("decode replica 1")
    assert sorted(procs.values())[1].startswith("prefill replica 0")
    its = [s for s in slices if s["track"] == "iterations"]
    assert len(its) == len(r.result.iterations)
    req = r.result.requests_frame()
    for rid in range(3):
        mine = sorted((s for s in slices if s["args"].get("request") == rid),
                      key=lambda s: s["t"])
        want = ["prefill", "KV transfer", "decode"] if req.queue_s[rid] == 0 else \
            ["queued", "prefill", "KV transfer", "decode"]
        assert [s["name"] for s in mine] == want
        # The phases start at the request's own timestamps.
        starts = {"queued": req.arrival_s[rid], "prefill": req.scheduled_s[rid],
                  "KV transfer": req.first_token_s[rid], "decode": req.kv_transferred_s[rid]}
        assert [s["t"] for s in mine] == [round(starts[s["name"]] * 1e9) for s in mine]
        assert mine[-1]["proc"].startswith("decode") and mine[0]["proc"].startswith("prefill")
        # One chain of flows: each phase ends the flow the one before started.
        for a, b in zip(mine, mine[1:], strict=False):
            assert len(a["out"]) == 1 and b["in"] == a["out"]
        assert mine[0]["in"] == [] and mine[-1]["out"] == []
    # KV blocks counter: every iteration's blocks in use at its start.
    kv = counters[(sorted(procs.values())[1], "KV blocks used")]
    want = [(round(row[2] * 1e9), float(row[9])) for row in r.result.iterations
            if row[0] == 0]
    assert kv == want
    # Queue length: back to 0 once every request is scheduled, never negative.
    q = [v for _t, v in counters[(sorted(procs.values())[1], "queue length")]]
    assert q[-1] == 0.0 and min(q) == 0.0 and max(q) >= 1.0


def test_iteration_slices_carry_their_batch_composition_and_the_trace_is_deterministic(
        tmp_path):
    kw = dict(**POD, rate=200.0, requests=40, prompt_tokens="uniform:16,200",
              output_tokens="uniform:2,12", seed=3, replicas=2, prefill_chunk=64)
    r = run(ServeRequest(**kw))
    a = export_serving(r.summary, r.result, tmp_path / "a.pftrace")
    _procs, slices, _c = _read(a)
    its = [s for s in slices if s["track"] == "iterations"]
    rows = sorted(r.result.iterations, key=lambda x: (x[0], x[2]))
    got = sorted((s["proc"], s["t"], s["args"]["decode_batch"], s["args"]["prefill_tokens"])
                  for s in its)
    assert [(g[2], g[3]) for g in got] == [(x[4], x[7]) for x in sorted(
        rows, key=lambda x: (f"replica {x[0]}", round(x[2] * 1e9)))]
    r2 = run(ServeRequest(**kw))
    b = export_serving(r2.summary, r2.result, tmp_path / "b.pftrace")
    assert a.read_bytes() == b.read_bytes()
    # Chrome JSON: the same slices, and flows as s/f pairs with matching ids.
    j = json.loads(export_serving(r.summary, r.result, tmp_path / "c.json").read_text())
    ev = j["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == len(slices)
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    ends = {e["id"] for e in ev if e["ph"] == "f"}
    assert starts == ends and len(starts) > 0


def test_cli_writes_the_serving_trace(tmp_path, capsys):
    from sim.cli import main

    out = tmp_path / "t.pftrace"
    code = main(["serve", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--mesh",
                 "tensor=4", "--rate", "5", "--requests", "3", "--prompt-tokens", "fixed:32",
                 "--output-tokens", "fixed:2", "--perfetto", str(out)])
    assert code == 0 and out.stat().st_size > 0
    assert "wrote" in capsys.readouterr().out.splitlines()[-1]


def test_the_iteration_log_packs_full_chunks_and_gives_the_rows_back_in_order():
    from sim.serving.simulate import ITERATION_COLUMNS, IterationLog

    class Small(IterationLog):
        CHUNK = 3

    rows = [(i % 2, "both" if i % 3 else "prefill", i * 0.5, 0.25 + i, i, 10 * i, i % 4, 7 * i,
             i // 2, 100 + i, 0) for i in range(10)]
    log = Small()
    for r in rows:
        log.append(r)
    assert len(log._packed) == 3 and len(log._tail) == 1  # 3 chunks of 3 packed, 1 row left
    assert len(log) == 10 and list(log) == rows and log == rows
    cols = log.columns()
    assert list(cols) == list(ITERATION_COLUMNS)
    assert cols["start_s"].tolist() == [r[2] for r in rows]
    assert cols["role"].tolist() == [r[1] for r in rows]
    assert cols["kv_blocks_used"].tolist() == [r[9] for r in rows]


def _power_integral_j(samples):
    """The integral of a step counter [(t ns, watts), ...] (each value held to the next)."""
    return sum((b[0] - a[0]) * 1e-9 * a[1] for a, b in zip(samples, samples[1:], strict=False))


def test_each_replica_has_a_power_counter_whose_integral_is_its_iterations_joules(tmp_path):
    # Two replicas, interpolated costs: the iterations' dynamic joules (interpolated on the
    # grid's node joules with the same weights as their times) sum to the energy section's
    # dynamic units; the counter of each replica integrates to one chip's idle power over the
    # span plus its iterations' joules over its chips.
    r = run(ServeRequest(**POD, replicas=2, rate=200.0, requests=60,
                         prompt_tokens="uniform:16,256", output_tokens="uniform:4,32", seed=3))
    res, e = r.result, r.summary["energy"]["energy_j_by_unit"]
    dyn = res.iteration_dynamic_j
    assert len(dyn) == len(res.iterations) and (dyn > 0).all()
    assert dyn.sum() == pytest.approx(sum(e[u] for u in ("mxu", "vpu", "hbm", "ici", "dcn",
                                                         "pcie")), rel=1e-9)
    path = export_serving(r.summary, res, tmp_path / "p.pftrace")
    _procs, _slices, counters = _read(path)
    reps = res.iterations.column("replica")
    for k in (0, 1):
        samples = counters[(next(p for p, n in counters if p.startswith(f"replica {k}")),
                            "power (W)")]
        chips, idle = res.replica_power[k]
        assert (chips, idle) == (4, pytest.approx(64.4727, rel=1e-4))
        end = samples[-1][0] * 1e-9
        assert samples[-1][1] == idle and min(w for _t, w in samples) == idle
        want = idle * end + dyn[reps == k].sum() / chips
        assert _power_integral_j(samples) == pytest.approx(want, rel=1e-6)
