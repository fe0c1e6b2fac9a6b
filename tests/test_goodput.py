"""Training goodput under failures (sim/reliability, `tpusim goodput`): closed forms with no
failure and with one, the event-skip engine against the SimPy oracle on the same failures,
the interval search against Young-Daly and Daly's exact expectation, the v4 paper's finding
(spare cubes against a static pod), the step model as a library, the exports, sweeps, reruns
and every bad input."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pytest

import sim
from sim.cli import build_parser, main
from sim.cli.common import flag_spelling
from sim.reliability.config import (
    FailureConfig,
    GoodputConfig,
    JobConfig,
    SliceInventory,
)
from sim.reliability.failures import PoissonFailures, TraceFailures, failure_stream
from sim.reliability.history import HistoryBuilder
from sim.reliability.job import (
    LOST_CAUSES,
    daly_expected_wall_s,
    evaluate,
    search,
    timeline,
    young_daly_s,
)
from sim.reliability.reference import simulate as simulate_simpy
from sim.reliability.simulate import simulate_goodput
from sim.reliability.stats import mean_ci, t975
from sim.runs import GoodputRequest, TrainRequest, run
from topologies.errors import TpusimError, render_said

STATIC = SliceInventory(num_chips=128, num_hosts=32, chips_per_host=4)
CUBES = SliceInventory(num_chips=128, num_hosts=32, chips_per_host=4, num_cubes=2, ocs=True,
                       spare_cubes=1)
STEP = ["--chip", "v4", "--shape", "4x4x8"]


def _trace(tmp_path, times, name="f.csv", kinds=None):
    p = tmp_path / name
    if name.endswith(".csv"):
        rows = "".join(f"{t},{(kinds or ['host'] * len(times))[i]}\n"
                       for i, t in enumerate(times))
        p.write_text("time_s,kind\n" + rows)
    else:
        p.write_text("".join(json.dumps({"time_s": t}) + "\n" for t in times))
    return str(p)


def _one(tmp_path, times, job, inv, k, repair_s=3600.0):
    """(event-skip outcome, SimPy outcome) of the job on the failures at `times`."""
    fail = FailureConfig(repair_s=repair_s, trace=_trace(tmp_path, times))
    hist = HistoryBuilder(TraceFailures(fail.trace), job, inv, fail).run()
    fast = evaluate(hist, job, k)
    slow, _ = simulate_simpy(TraceFailures(fail.trace), job, inv, fail, k)
    return fast, slow


def _close(a, b, rel=1e-9):
    assert a.wall_s == pytest.approx(b.wall_s, rel=rel)
    assert a.useful_s == pytest.approx(b.useful_s, rel=rel)
    for c in LOST_CAUSES:
        assert a.lost_s[c] == pytest.approx(b.lost_s[c], rel=rel, abs=1e-6), c
    assert (a.failures, a.swaps, a.checkpoints) == (b.failures, b.swaps, b.checkpoints)


def _identity(o):
    """Wall time is the useful time plus every cause of loss, exactly."""
    assert o.wall_s == pytest.approx(o.useful_s + sum(o.lost_s.values()), rel=1e-12)


# -- closed forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("steps,k", [(100, 10), (100, 7), (100, 100), (1, 1)])
def test_without_failures_the_wall_is_the_steps_plus_every_checkpoint_but_the_last(
        tmp_path, steps, k):
    job = JobConfig(step_time_s=10.0, steps=steps, checkpoint_cost_s=5.0, restart_cost_s=60.0)
    fast, slow = _one(tmp_path, [], job, STATIC, k)
    ckpts = -(-steps // k) - 1
    assert fast.wall_s == pytest.approx(steps * 10.0 + 5.0 * ckpts)
    assert fast.lost_s["checkpoint_writes"] == pytest.approx(5.0 * ckpts)
    assert fast.checkpoints == ckpts and fast.failures == 0
    assert fast.goodput == pytest.approx(steps * 10 / (steps * 10 + 5 * ckpts))
    _close(fast, slow)


def test_one_failure_in_training_loses_the_work_since_the_checkpoint_and_waits_for_repair(
        tmp_path):
    # 100 steps of 10 s, a checkpoint (5 s) every 10 steps: periods of 105 s. A failure at
    # 530 s is 5 s into the sixth period: 50 steps are committed, 5 s of training lost; the
    # static pod waits the repair (3600 s), restarts (60 s), and does the other 50 steps with
    # four checkpoints (520 s).
    job = JobConfig(step_time_s=10.0, steps=100, checkpoint_cost_s=5.0, restart_cost_s=60.0)
    fast, slow = _one(tmp_path, [530.0], job, STATIC, 10)
    assert fast.wall_s == pytest.approx(530 + 3600 + 60 + 520)
    assert fast.lost_s == pytest.approx({"recomputation": 5.0, "checkpoint_writes": 45.0,
                                         "restarts": 60.0, "cube_swaps": 0.0,
                                         "waiting_for_repair": 3600.0,
                                         "waiting_for_spare": 0.0})
    assert (fast.failures, fast.swaps, fast.checkpoints) == (1, 0, 9)
    _identity(fast)
    _close(fast, slow)


def test_one_failure_with_a_spare_cube_costs_a_swap_and_a_restart_not_the_repair(tmp_path):
    job = JobConfig(step_time_s=10.0, steps=100, checkpoint_cost_s=5.0, restart_cost_s=60.0,
                    swap_cost_s=30.0)
    fast, slow = _one(tmp_path, [530.0], job, CUBES, 10)
    assert fast.wall_s == pytest.approx(530 + 30 + 60 + 520)
    assert fast.lost_s["cube_swaps"] == pytest.approx(30.0)
    assert fast.lost_s["waiting_for_repair"] == fast.lost_s["waiting_for_spare"] == 0.0
    assert fast.swaps == 1
    _close(fast, slow)
    # Without the optical switches the same pod waits for the repair.
    static = SliceInventory(num_chips=128, num_hosts=32, chips_per_host=4, num_cubes=2,
                            ocs=False, spare_cubes=1)
    fast, slow = _one(tmp_path, [530.0], job, static, 10)
    assert fast.wall_s == pytest.approx(530 + 3600 + 60 + 520)
    _close(fast, slow)


def test_a_failure_during_a_checkpoint_write_loses_the_segment_and_the_partial_write(
        tmp_path):
    job = JobConfig(step_time_s=10.0, steps=100, checkpoint_cost_s=5.0, restart_cost_s=60.0)
    # 522 s: the fifth checkpoint started at 520 s (4 periods = 420 s, then 100 s of steps).
    fast, slow = _one(tmp_path, [522.0], job, STATIC, 10)
    assert fast.lost_s["recomputation"] == pytest.approx(100.0)
    assert fast.lost_s["checkpoint_writes"] == pytest.approx(4 * 5 + 2 + 5 * 5)
    assert fast.wall_s == pytest.approx(522 + 3660 + 60 * 10 + 5 * 5)
    _close(fast, slow)


def test_failures_during_a_restart_and_during_a_wait_extend_the_downtime(tmp_path):
    job = JobConfig(step_time_s=10.0, steps=100, checkpoint_cost_s=5.0, restart_cost_s=60.0)
    # Failure at 530; the repair ends at 4130 and a second failure at 4150 (inside the
    # restart) needs its own repair: 7750; restart to 7810, then 520 s to finish.
    fast, slow = _one(tmp_path, [530.0, 4150.0], job, STATIC, 10)
    assert fast.wall_s == pytest.approx(7750 + 60 + 520)
    assert fast.lost_s["restarts"] == pytest.approx(20 + 60)
    assert fast.lost_s["waiting_for_repair"] == pytest.approx(3600 + 3600)
    _close(fast, slow)
    # A second failure while waiting (at 1000 s): both repairs must end (4600 s).
    fast, slow = _one(tmp_path, [530.0, 1000.0], job, STATIC, 10)
    assert fast.wall_s == pytest.approx(4600 + 60 + 520)
    assert fast.failures == 2
    _close(fast, slow)


def test_with_no_spare_free_the_job_waits_for_the_first_repaired_cube(tmp_path):
    job = JobConfig(step_time_s=10.0, steps=100, checkpoint_cost_s=5.0, restart_cost_s=60.0)
    # One spare: the first failure (530) takes it; the second (700, in the next window) finds
    # none and waits for the first cube's repair (530 + 3600 = 4130).
    fast, slow = _one(tmp_path, [530.0, 700.0], job, CUBES, 10)
    second_window = 530 + 60
    lost_in_2nd = 700 - second_window - 105  # one period committed after the restart
    assert fast.lost_s["waiting_for_spare"] == pytest.approx(4130 - 700)
    assert fast.lost_s["recomputation"] == pytest.approx(5 + lost_in_2nd)
    assert fast.swaps == 2
    _close(fast, slow)


def test_a_wall_clock_window_counts_the_work_done_by_its_end(tmp_path):
    job = JobConfig(step_time_s=10.0, horizon_s=1000.0, checkpoint_cost_s=5.0,
                    restart_cost_s=60.0)
    fast, slow = _one(tmp_path, [], job, STATIC, 10)
    # 9 periods of 105 s (945 s), then 55 s of training.
    assert fast.wall_s == 1000.0
    assert fast.useful_s == pytest.approx(9 * 100 + 55)
    assert fast.lost_s["checkpoint_writes"] == pytest.approx(45.0)
    _close(fast, slow)
    fast, slow = _one(tmp_path, [530.0], job, STATIC, 10)  # the window ends in the repair
    assert fast.useful_s == pytest.approx(500.0)
    assert fast.lost_s["waiting_for_repair"] == pytest.approx(470.0)
    _identity(fast)
    _close(fast, slow)


# -- the oracle ------------------------------------------------------------------------------------
@pytest.mark.parametrize("inv,horizon", [
    (STATIC, None), (CUBES, None), (CUBES, 40_000.0),
    (SliceInventory(num_chips=256, num_hosts=64, chips_per_host=4, num_cubes=4, ocs=True,
                    spare_cubes=3), None)], ids=["static", "one-spare", "window", "three"])
def test_the_event_skip_engine_equals_the_simpy_oracle_on_the_same_failures(inv, horizon):
    job = JobConfig(step_time_s=7.0, steps=None if horizon else 3000, horizon_s=horizon,
                    checkpoint_cost_s=11.0, restart_cost_s=90.0, swap_cost_s=25.0)
    fail = FailureConfig(repair_s=2000.0, rate_per_s=1 / 1500, chip_share=0.3)
    for seed in range(3):
        for k in (1, 13, 60, 500):
            b = HistoryBuilder(PoissonFailures(fail, inv, seed=seed, index=0), job, inv, fail,
                               log=True)
            hist = b.run() if horizon else None
            if horizon is None:
                out, w = None, 64
                while out is None:
                    hist = b.extend(w)
                    out = evaluate(hist, job, k)
                    w *= 2
            fast = evaluate(hist, job, k)
            slow, slow_events = simulate_simpy(
                PoissonFailures(fail, inv, seed=seed, index=0), job, inv, fail, k, log=True)
            _close(fast, slow)
            _identity(fast)
            assert fast.failures > 0
            # The timeline rebuilt from the history is the oracle's event for event.
            events, coarse = timeline(hist, b.events, job, k, fast)
            assert not coarse
            assert len(events) == len(slow_events)
            for e, s in zip(events, slow_events, strict=True):
                assert e[2:] == s[2:] and e[0] == pytest.approx(s[0], abs=1e-6) \
                    and e[1] == pytest.approx(s[1], abs=1e-6), (e, s)


def test_the_cli_engines_agree_and_the_seed_decides_the_failures(capsys):
    base = ["goodput", *STEP, "--step-time", "30", "--steps", "2000", "--mtbf-hours", "2",
            "--repair-hours", "1", "--checkpoint-cost", "20", "--restart-cost", "120",
            "--spare-cubes", "1", "--seeds", "3", "--json"]
    out = {}
    for extra in ([], ["--engine", "simpy"], ["--seed", "7"], []):
        assert main([*base, *extra]) == 0
        out[tuple(extra) or len(out)] = json.loads(capsys.readouterr().out)
    a, b, c, again = out[0], out[("--engine", "simpy")], out[("--seed", "7")], out[3]
    assert a == again  # deterministic
    for key in ("goodput", "expected_finish_hours", "failures", "checkpoints"):
        assert a[key] == pytest.approx(b[key], rel=1e-9)
    assert a["lost_s_by_cause"] == pytest.approx(b["lost_s_by_cause"], rel=1e-9, abs=1e-6)
    assert a["goodput"] != c["goodput"]


# -- Young-Daly and the search ---------------------------------------------------------------------
def test_the_searched_interval_agrees_with_young_daly_where_its_assumptions_hold():
    # Exponential failures, a checkpoint far cheaper than the MTBF (60 s against 5 h), no wait
    # (ample spares) and a cheap restart: Young's sqrt(2 C M) is the optimum to first order.
    job = JobConfig(step_time_s=5.0, steps=int(2000 * 3600 / 5), checkpoint_cost_s=60.0,
                    restart_cost_s=30.0)
    inv = SliceInventory(num_chips=4096, num_hosts=1024, chips_per_host=4, num_cubes=64,
                         ocs=True, spare_cubes=1000)
    fail = FailureConfig(repair_s=600.0, rate_per_s=1 / (5 * 3600), chip_share=0.5)
    out = simulate_goodput(GoodputConfig(job=job, inventory=inv, failures=fail, seeds=8),
                           log=False)
    s = out.summary
    yd = young_daly_s(60.0, 5 * 3600)
    assert s["young_daly_interval_s"] == pytest.approx(yd) == pytest.approx(1469.7, abs=0.1)
    assert s["failures"] > 300
    assert s["best_checkpoint_interval_s"] == pytest.approx(yd, rel=0.25)
    # The curve is flat at its top: goodput at Young-Daly is within 0.3% of the best.
    at_yd = out.search[round(yd / 5)]
    assert at_yd == pytest.approx(s["best_goodput"], abs=0.003)
    assert s["best_goodput"] >= at_yd
    # Daly's exact expectation (failures in training, checkpoints and restarts alike).
    tau = s["checkpoint_interval_s"]
    want = daly_expected_wall_s(job.steps * 5.0, tau, 60.0, 30.0, 5 * 3600)
    assert s["expected_finish_hours"] * 3600 == pytest.approx(want, rel=0.02)
    lo, hi = s["expected_finish_hours_ci95"]["low"], s["expected_finish_hours_ci95"]["high"]
    assert lo < s["expected_finish_hours"] < hi


def test_the_search_finds_the_best_interval_of_every_whole_step():
    job = JobConfig(step_time_s=10.0, steps=400, checkpoint_cost_s=30.0, restart_cost_s=50.0)
    fail = FailureConfig(repair_s=0.0, rate_per_s=1 / 1200)
    seeds = [HistoryBuilder(PoissonFailures(fail, STATIC, seed=3, index=i), job, STATIC, fail)
             for i in range(4)]

    def mean(k):
        outs = []
        for b in seeds:
            out = evaluate(b.history(), job, k)
            while out is None:
                out = evaluate(b.extend(2 * b.history().size + 64), job, k)
            outs.append(out.goodput)
        return float(np.mean(outs))

    brute = {k: mean(k) for k in range(1, 401)}
    best, seen = search(mean, 400)
    assert len(seen) < 80  # a search, not the brute force
    assert brute[best] >= max(brute.values()) - 0.01
    assert seen[best] == brute[best]


def test_young_daly_and_daly_formulas():
    assert young_daly_s(50.0, 10_000.0) == pytest.approx(1000.0)
    from sim.reliability.job import daly_s

    # Daly's higher order is below Young's for c << M and tends to it.
    assert daly_s(50.0, 10_000.0) == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert daly_s(30_000.0, 10_000.0) == 10_000.0


# -- the v4 paper's finding ------------------------------------------------------------------------
def _goodput_at(availability, spares, ocs=True, seeds=4):
    req = GoodputRequest(chip="v4", shape="12x16x16", step_time=10, hours=720,
                         host_availability=availability, repair_hours=8,
                         checkpoint_cost=30, restart_cost=300, spare_cubes=spares,
                         no_ocs=not ocs, seeds=seeds)
    return run(req).summary


def test_spare_cubes_keep_goodput_where_a_static_pod_needs_three_nines():
    # A 3,072-chip v4 slice (48 cubes of the 64-cube pod), 768 hosts: with 16 spare cubes it
    # keeps most of its goodput at 99.0-99.5% host availability; the static pod needs ~99.9%
    # (TPU v4 paper, docs/reference/twisted.md).
    with_spares = {a: _goodput_at(a, 16)["goodput"] for a in (0.99, 0.995, 0.999)}
    static = {a: _goodput_at(a, 16, ocs=False)["goodput"] for a in (0.99, 0.995, 0.999)}
    assert with_spares[0.99] > 0.6 and with_spares[0.995] > 0.75
    assert static[0.99] < 0.05 and static[0.995] < 0.25
    # The static pod is up only while all 768 hosts are (0.999^768 = 46%): it needs three
    # nines to reach what the spares give at 99%.
    assert static[0.999] > 5 * static[0.995] and static[0.999] > 0.35
    assert with_spares[0.99] > static[0.999]
    for a in with_spares:
        assert with_spares[a] > static[a]


# -- the step model --------------------------------------------------------------------------------
TRAIN = dict(chip="v4", shape="4x4x8", model="llama3-8b", seq_len=256, batch_per_chip=1,
             mesh={"fsdp": 128}, overrides={"model.num_layers": 2})


def test_the_step_time_comes_from_the_step_model_run_as_a_library(monkeypatch):
    import sim.runs as runs

    calls = []
    real = runs.run

    def spy(req, **kw):
        calls.append(type(req).__name__)
        return real(req, **kw)

    monkeypatch.setattr(runs, "run", spy)
    r = sim.goodput(**TRAIN, steps=1000, mtbf_hours=5, repair_hours=2, seeds=2)
    assert calls == ["GoodputRequest", "TrainRequest"] or calls == ["TrainRequest"]
    step = run(TrainRequest(**TRAIN)).summary["step_time_s"]
    assert r.step_time_s == step
    assert r.summary["train"]["model"] == "llama3-8b"
    # Checkpoint costs from the model's bytes: bf16 parameters and two fp32 Adam moments, 10
    # bytes a parameter, over the slice's DCN egress (6.25e9 B/s a chip on v4).
    from workloads.zoo import model_from_dict

    params = model_from_dict(r.inputs["model"]).num_params
    assert r.checkpoint_bytes == pytest.approx(10 * params)
    assert r.storage_bytes_per_s == pytest.approx(128 * 6.25e9 * r.inputs["chip"]
                                                  ["dcn_efficiency"])
    assert r.checkpoint_cost_s == pytest.approx(r.checkpoint_bytes / r.storage_bytes_per_s)
    assert r.restart_cost_s == r.checkpoint_cost_s


def test_a_goodput_result_reruns_to_the_same_result(tmp_path, capsys):
    argv = ["goodput", *STEP, "--model", "llama3-8b", "--seq-len", "256", "--batch-per-chip",
            "1", "--mesh", "fsdp=128", "--set", "model.num_layers=2", "--steps", "500",
            "--mtbf-hours", "3", "--repair-hours", "1", "--seeds", "2", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    path = tmp_path / "r.json"
    path.write_text(first)
    again = sim.rerun(path).to_dict()
    # The Python result names settings by argument; as the CLI writes it, by flag.
    assert again["sources"]["restart_cost_s"].endswith("(give restart_cost to add "
                                                       "rescheduling and compiling)")
    assert render_said(again, flag_spelling(build_parser(), "goodput")) == json.loads(first)
    assert "(give --restart-cost to add" in first


# -- outputs ---------------------------------------------------------------------------------------
def test_plots_perfetto_and_tables_show_the_jobs_life(tmp_path, capsys):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace as PerfettoTrace
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

    pf = tmp_path / "job.pftrace"
    argv = ["goodput", *STEP, "--step-time", "30", "--steps", "3000", "--host-mtbf-hours",
            "200", "--chip-mtbf-hours", "5000", "--repair-hours", "2", "--checkpoint-cost",
            "20", "--restart-cost", "120", "--spare-cubes", "1", "--seeds", "2",
            "--plots", str(tmp_path / "p"), "--perfetto", str(pf), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "wrote" in out
    for name in ("goodput_timeline.png", "goodput_vs_interval.png"):
        assert (tmp_path / "p" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    import pandas as pd

    seeds = pd.read_csv(tmp_path / "o" / "seeds.csv")
    assert seeds.goodput.mean() == pytest.approx(summary["goodput"])
    events = pd.read_csv(tmp_path / "o" / "events.csv")
    # Parse the trace back: one slice per training segment, checkpoint, restart and failure.
    trace = PerfettoTrace.FromString(pf.read_bytes())
    names = {}
    slices = defaultdict(int)
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            names[p.track_descriptor.uuid] = p.track_descriptor.name
        elif p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            slices[names[p.track_event.track_uuid]] += 1
    kinds = events.kind.value_counts().to_dict()
    assert slices["failures"] == kinds["failure"] > 0
    assert slices["training and checkpoints"] == kinds["train"] + kinds["checkpoint"]
    assert slices["recovery"] == sum(kinds.get(k, 0) for k in ("restart", "swap",
                                                                "wait_repair", "wait_spare"))
    assert sum(v for k, v in slices.items() if k.startswith("repairs")) == kinds["repair"]
    # The same job in Chrome JSON.
    js = tmp_path / "job.json"
    assert main([*argv[:-6], "--perfetto", str(js)]) == 0
    data = json.loads(js.read_text())
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) == sum(slices.values())


def test_goodput_is_a_sweep_command():
    df = sim.sweep({"command": "goodput",
                    "base": {"chip": "v4", "shape": "4x4x8", "step-time": 30, "hours": 200,
                             "repair-hours": 4, "checkpoint-cost": 30, "restart-cost": 120,
                             "seeds": 2},
                    "grid": {"host-availability": [0.99, 0.999], "spare-cubes": [0, 2]},
                    "metrics": ["goodput", "best_checkpoint_interval_s"]})
    assert list(df.status) == ["ok"] * 4
    g = df.set_index(["host-availability", "spare-cubes"]).goodput
    assert g[(0.99, 2)] > g[(0.99, 0)]
    assert g[(0.999, 0)] > g[(0.99, 0)]
    assert "recomputation" in df.columns and "goodput_ci95.low" in df.columns


# -- failure streams -------------------------------------------------------------------------------
def test_drawn_failures_are_the_same_however_far_they_are_read():
    fail = FailureConfig(repair_s=1.0, rate_per_s=0.5, chip_share=0.25)
    a = PoissonFailures(fail, STATIC, seed=5, index=2)
    a.ensure(10_000)
    b = PoissonFailures(fail, STATIC, seed=5, index=2)
    b.ensure(5)
    b.ensure(9_000)
    b.ensure(10_000)
    n = min(a.times.size, b.times.size)
    assert np.array_equal(a.times[:n], b.times[:n]) and np.array_equal(a.kinds[:n], b.kinds[:n])
    # Poisson at the slice's rate: the mean gap and the chips' share.
    assert np.diff(a.times).mean() == pytest.approx(2.0, rel=0.05)
    assert (a.kinds == 0).mean() == pytest.approx(0.25, abs=0.02)
    assert a.units[a.kinds == 0].max() < 128 and a.units[a.kinds == 1].max() < 32


def test_a_failure_trace_reads_csv_and_json_lines(tmp_path):
    csv = TraceFailures(_trace(tmp_path, [1.5, 10, 10], kinds=["chip", "host", ""]))
    assert csv.times.tolist() == [1.5, 10.0, 10.0] and csv.kinds.tolist() == [0, 1, 2]
    jl = TraceFailures(_trace(tmp_path, [3, 4], name="f.jsonl"))
    assert jl.times.tolist() == [3.0, 4.0]
    assert failure_stream(FailureConfig(repair_s=0, trace=str(tmp_path / "f.jsonl")), STATIC,
                          seed=0, index=0).time(2) == math.inf


@pytest.mark.parametrize("text,msg", [
    ("time_s\n5\n3\n", "before the previous row"),
    ("time_s\nabc\n", "not a finite number >= 0"),
    ("time_s\n-1\n", "not a finite number >= 0"),
    ("when\n1\n", "lacks time_s"),
    ("time_s,kind\n1,gpu\n", "not chip or host"),
    ("", "is empty"),
])
def test_a_bad_failure_trace_is_one_line_naming_the_row(tmp_path, capsys, text, msg):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    rc = main(["goodput", *STEP, "--step-time", "10", "--steps", "100", "--failure-trace",
               str(p), "--repair-hours", "1", "--checkpoint-cost", "5", "--restart-cost", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1


def test_confidence_intervals_use_students_t():
    assert t975(1) == 12.706 and t975(30) == 2.042
    assert t975(31) == pytest.approx(2.0395, abs=2e-4) and t975(1000) == pytest.approx(1.9623,
                                                                                      abs=2e-4)
    lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert (lo + hi) / 2 == pytest.approx(2.0) and hi - 2 == pytest.approx(4.303 / 3 ** 0.5)
    assert mean_ci([1.0]) == (None, None)


# -- bad input -------------------------------------------------------------------------------------
_OK = ["goodput", *STEP, "--step-time", "10", "--steps", "1000", "--mtbf-hours", "5",
       "--repair-hours", "1", "--checkpoint-cost", "30", "--restart-cost", "60"]


def _swap(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        if value is None:
            del argv[i:i + 2]
        else:
            argv[i + 1] = value
    elif value is not None:
        argv += [flag, value]
    return argv


@pytest.mark.parametrize("flag,value,words", [
    ("--mtbf-hours", "0", ["--mtbf-hours '0'", "breaks the rule", "> 0", "e.g. --mtbf-hours"]),
    ("--mtbf-hours", "-3", ["--mtbf-hours '-3'", "breaks the rule"]),
    ("--host-availability", "1", ["--host-availability '1'", "must be < 1"]),
    ("--checkpoint-interval", "20000", ["--checkpoint-interval 20000 s is longer than the job",
                                        "10,000 s of training", "give at most 10,000"]),
    ("--checkpoint-cost", "-1", ["--checkpoint-cost '-1'", ">= 0", "e.g. --checkpoint-cost"]),
    ("--restart-cost", "-5", ["--restart-cost '-5'", ">= 0"]),
    ("--swap-cost", "-5", ["--swap-cost '-5'", ">= 0"]),
    ("--spare-cubes", "63", ["--spare-cubes 63 is more than the 62 free cubes",
                             "v4 pod has 64 cubes", "give at most 62"]),
    ("--seeds", "0", ["--seeds 0 is out of range"]),
    ("--engine", "fast", ["--engine 'fast' does not exist", "event-skip, simpy"]),
    ("--repair-hours", None, ["give --repair-hours H"]),
    ("--steps", None, ["--steps N", "--hours H"]),
    ("--hours", "10", ["--steps and --hours both"]),
    ("--chip-mtbf-hours", "10", ["--mtbf-hours is the whole slice's MTBF"]),
    ("--model", "llama3-8b", ["--step-time gives the step time", "drop --model"]),
    ("--checkpoint-cost", None, ["--checkpoint-cost is needed with --step-time"]),
    ("--step-time", None, ["needs the job's step"]),
])
def test_bad_input_is_one_line_naming_the_value_the_rule_and_the_fix(capsys, flag, value,
                                                                     words):
    rc = main(_swap(_OK, flag, value))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1
    for w in words:
        assert w in err, err


def test_spares_need_a_pod_of_cubes_and_switches(capsys):
    for pod, words in ((["--chip", "v5e", "--shape", "4x4"], "v5e has no optical circuit"),
                       (["--chip", "v4", "--shape", "2x2x4"], "not made of whole 4x4x4 cubes")):
        rc = main([*_OK[:1], *pod, *_OK[5:], "--spare-cubes", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and err.count("\n") == 1


def test_a_trace_is_one_history_and_replaces_the_mtbf(tmp_path, capsys):
    path = _trace(tmp_path, [100.0])
    rc = main([*_swap(_OK, "--mtbf-hours", None), "--failure-trace", path, "--seeds", "3"])
    assert rc == 2 and "a failure trace is one history" in capsys.readouterr().err
    rc = main([*_OK, "--failure-trace", path])
    assert rc == 2 and "--failure-trace lists the failures" in capsys.readouterr().err
    assert main([*_swap(_OK, "--mtbf-hours", None), "--failure-trace", path, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["failures"] == 1 and r["seeds"] == 1 and r["goodput_ci95"]["low"] is None


def test_runs_too_big_to_simulate_are_refused_before_they_run(capsys):
    base = ["goodput", *STEP, "--step-time", "10", "--repair-hours", "1", "--checkpoint-cost",
            "30", "--restart-cost", "60"]
    # A century of wall clock failing every 6 minutes: 8.8 M failures for one history.
    rc = main([*base, "--hours", "876000", "--mtbf-hours", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and "one history may hold" in err
    # 1,000 seeds of 87,600 failures.
    rc = main([*base, "--hours", "87600", "--mtbf-hours", "1", "--seeds", "1000"])
    err = capsys.readouterr().err
    assert rc == 2 and "over the 10,000,000 one run simulates" in err and "--seeds" in err
    # The oracle takes far fewer events than the event-skip engine.
    rc = main([*base, "--hours", "8760", "--mtbf-hours", "1", "--engine", "simpy",
               "--checkpoint-interval", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and "--engine simpy would simulate" in err and err.count("\n") == 1


def test_a_job_that_cannot_finish_is_refused_not_run_forever(capsys):
    # 768 hosts failing every ~15 min with 4 h repairs on a static pod: the slice is never
    # whole again.
    rc = main(["goodput", "--chip", "v4", "--shape", "12x16x16", "--step-time", "10",
               "--steps", "100000", "--mtbf-hours", "0.25", "--repair-hours", "4",
               "--checkpoint-cost", "30", "--restart-cost", "300"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not finish" in err and err.count("\n") == 1


# -- fuzzing ---------------------------------------------------------------------------------------
_FUZZ_FLAGS = {"--step-time": "float", "--steps": "int", "--hours": "float",
               "--mtbf-hours": "float", "--host-availability": "float",
               "--chip-mtbf-hours": "float", "--repair-hours": "float",
               "--checkpoint-interval": "float", "--checkpoint-cost": "float",
               "--restart-cost": "float", "--swap-cost": "float", "--spare-cubes": "int",
               "--seeds": "int", "--storage-bytes-per-s": "float", "--out": "dir",
               "--perfetto": "file", "--plots": "dir"}
_FUZZ_BASE = ["goodput", *STEP, "--step-time", "10", "--steps", "1000", "--mtbf-hours", "5",
              "--repair-hours", "1", "--checkpoint-cost", "30", "--restart-cost", "60",
              "--seeds", "2"]


@pytest.mark.parametrize("seed", range(16))
def test_odd_and_bad_goodput_flags_give_an_answer_or_a_one_line_error(seed, tmp_path):
    """The fuzz harness's values (tests/fuzz_inputs.py) on goodput's flags: exit 0 with finite
    outputs, or one `tpusim: error:` line that writes nothing, within the time budget."""
    import random

    import fuzz_inputs
    from fuzz_harness import judge, run_in_process

    rng = random.Random(seed)
    argv, bad = list(_FUZZ_BASE), {}
    for _ in range(rng.randint(1, 3)):
        flag = rng.choice(sorted(_FUZZ_FLAGS))
        value, surely = fuzz_inputs._value(rng, _FUZZ_FLAGS[flag])
        if flag in argv:
            argv[argv.index(flag) + 1] = value
            bad[flag] = surely
        else:
            argv += [flag, value]
            bad[flag] = bad.get(flag, False) or surely
    case = {"id": f"goodput-{seed}", "argv": [*argv, "--json"],
            "files": {"fifo": {"fifo": True}},
            "expect": "error" if any(bad.values()) else "any"}
    run = run_in_process(case, tmp_path, timeout_s=30.0)
    assert judge(case, run) == [], (case["argv"], run["stderr"][:500])


def test_a_goodput_request_is_not_a_training_step():
    req = GoodputRequest(chip="v4", shape="4x4x8", step_time=10, steps=100, mtbf_hours=5,
                         repair_hours=1, checkpoint_cost=1, restart_cost=1, seeds=2)
    with pytest.raises(TpusimError, match="got a GoodputRequest"):
        sim.train(req)
    assert sim.goodput(req).to_dict() == run(req).to_dict()


def test_a_goodput_run_reports_its_progress():
    seen = []
    sim.goodput(chip="v4", shape="4x4x8", step_time=10, steps=2000, mtbf_hours=2,
                repair_hours=1, checkpoint_cost=5, restart_cost=30, seeds=3,
                progress=seen.append)
    mine = [u for u in seen if u.task == "goodput"]
    assert mine[0].total == 3 and mine[-1].finished and mine[-1].done == 3
    assert all(u.unit == "history" for u in mine)
