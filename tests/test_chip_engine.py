"""The per-chip step engine (`sim/engine/class_engine.py`): identical to the representative replay
when nothing breaks symmetry, equal to the brute-force per-chip oracle under perturbations, and
the physics of stragglers in a synchronous step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sim.chips import get_chip
from sim.engine.executors import simulate_chips
from sim.engine.perchip import PerChipConfig, chip_classes
from sim.engine.replay import replay
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.trace import OpKind
from workloads.training import TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

# One layer keeps the brute-force oracle (one actor per chip) fast on 64 chips.
TINY = {
    "name": "tiny1", "num_layers": 1, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}


def _setup(chip_name: str, shape: str, mesh: str, *, wrap: str = "auto", slices: int = 1,
           dcn: str | None = None, layers: int = 1, seq: int = 128):
    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape, wraparound=wrap,
                            num_slices=slices)
    model = model_from_dict({**TINY, "num_layers": layers})
    trace = compile_training_step(model, parse_mesh(mesh, dcn), topo.num_chips,
                                  TrainingConfig(seq_len=seq, batch_per_chip=2))
    return chip, topo, trace


@pytest.mark.parametrize("chip_name,shape,mesh,wrap,slices,dcn", [
    ("v5e", "2x2", "fsdp=2,tensor=2", "auto", 1, None),
    ("v5e", "4x4", "fsdp=4,tensor=4", "all", 1, None),
    ("v5p", "4x4x4", "fsdp=16,tensor=4", "auto", 1, None),
    ("v5e", "2x2", "fsdp=4", "auto", 2, "data=2"),
])
def test_unperturbed_per_chip_engine_equals_replay_to_the_last_bit(chip_name, shape, mesh, wrap,
                                                                   slices, dcn):
    chip, topo, trace = _setup(chip_name, shape, mesh, wrap=wrap, slices=slices, dcn=dcn,
                               layers=2)
    a = replay(trace, chip, topo)
    b = simulate_chips(trace, chip, topo)
    assert b.num_chip_classes == 1
    assert a.step_time_s == b.step_time_s
    assert a.breakdown == b.breakdown
    assert a.sim_events == b.sim_events
    assert a.hbm_peak_bytes == b.hbm_peak_bytes
    for table in ("ops", "units", "links", "memory"):
        assert getattr(a, table).equals(getattr(b, table)), table
    chips = b.chips
    assert len(chips) == topo.num_chips
    assert (chips.finish_s == a.step_time_s).all()
    assert (chips.collective_wait_s == 0).all()


def _perturbations(topo, kind: str) -> PerChipConfig:
    n = topo.num_chips
    if kind == "slow-chip":
        speed = np.ones(n)
        speed[n // 2 + 1] = 0.7
        return PerChipConfig(speed=speed)
    if kind == "slow-link":
        return PerChipConfig(link_factors={topo.ici_link_id(0, 0, 1): 0.5})
    if kind == "variation":
        return PerChipConfig(speed=np.random.default_rng(3).lognormal(0.0, 0.05, n))
    raise AssertionError(kind)


_PODS = {
    "2x2": ("v5e", "2x2", "fsdp=2,tensor=2", "auto", 1, None),
    "4x4-line": ("v5e", "4x4", "fsdp=4,tensor=4", "none", 1, None),
    "4x4-wrap": ("v5e", "4x4", "fsdp=4,tensor=4", "all", 1, None),
    "4x4x4": ("v5p", "4x4x4", "fsdp=16,tensor=4", "auto", 1, None),
    "2x2x2slices": ("v5e", "2x2", "fsdp=4", "auto", 2, "data=2"),
}
# Chip variation makes every chip its own class, so on 4x4x4 the two modes would run the same
# partition; it is checked on the smaller pods, where it costs less.
_CASES = [(name, kind) for name in _PODS for kind in ("slow-chip", "slow-link", "variation")
          if not (kind == "variation" and name == "4x4x4")]


@pytest.mark.parametrize("pod_name,kind", _CASES)
def test_equivalence_classes_agree_with_brute_force(pod_name, kind):
    chip_name, shape, mesh, wrap, slices, dcn = _PODS[pod_name]
    chip, topo, trace = _setup(chip_name, shape, mesh, wrap=wrap, slices=slices, dcn=dcn)
    cfg = _perturbations(topo, kind)
    fast = simulate_chips(trace, chip, topo, config=cfg)
    brute = simulate_chips(trace, chip, topo, config=PerChipConfig(
        speed=cfg.speed, link_factors=cfg.link_factors, mode="per-chip"))
    assert brute.num_chip_classes == topo.num_chips
    if kind != "variation" and topo.num_chips > 4:
        assert fast.num_chip_classes < topo.num_chips
    assert fast.step_time_s == pytest.approx(brute.step_time_s, rel=1e-9)
    np.testing.assert_allclose(fast.chips.finish_s, brute.chips.finish_s, rtol=1e-9)
    np.testing.assert_allclose(fast.chips.collective_wait_s, brute.chips.collective_wait_s,
                               rtol=1e-9, atol=1e-15)
    assert fast.slowest_chip == brute.slowest_chip
    healthy = replay(trace, chip, topo)
    if kind == "slow-link" and slices > 1:
        # Two slices: the step ends with the data-parallel all-reduces over DCN, which keep the
        # DCN links busy from before the slowed ICI link's collectives end; the slow link can
        # hide behind them. It can even shorten the step a little: the embedding's gradient,
        # reduced later over the slow link, then starts its DCN all-reduce later and shares
        # the DCN links with a different member of the layer's chain of per-matrix
        # all-reduces (a list-scheduling anomaly of shared bandwidth, 12.6 us here), by less
        # than the step's DCN transfers take at the full DCN rate (an all-reduce over 2
        # slices sends its V once).
        dcn_s = sum(o.bytes for o in trace.ops if o.kind == "collective"
                    and "data" in o.mesh_axes) / chip.dcn_bytes_per_s
        assert healthy.step_time_s - dcn_s < fast.step_time_s
    elif kind != "variation":
        assert fast.step_time_s > healthy.step_time_s


def test_slow_chip_in_pure_fsdp_makes_the_step_at_least_its_compute_slowdown_long():
    chip, topo, trace = _setup("v5e", "4x4", "fsdp=16", layers=2, seq=512)
    healthy = simulate_chips(trace, chip, topo)
    compute = float(healthy.chips.mxu_busy_s.iloc[0] + healthy.chips.vpu_busy_s.iloc[0])
    f = 0.5
    speed = np.ones(topo.num_chips)
    speed[5] = f
    slow = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    # The slow chip alone needs compute / f; every collective waits for it, so the whole
    # synchronous step is at least that long, and every chip finishes after it.
    assert slow.step_time_s >= compute / f
    assert slow.step_time_s >= healthy.step_time_s + compute * (1 / f - 1) * 0.999
    assert slow.slowest_chip == slow.chips.coords.iloc[5]
    assert slow.chips.collective_wait_s.iloc[5] < slow.chips.collective_wait_s.drop(5).min()
    assert slow.num_chip_classes == 2  # the slow chip, and everyone else (one FSDP group)


def test_one_fast_chip_changes_nothing_in_a_synchronous_step():
    chip, topo, trace = _setup("v5e", "4x4", "fsdp=4,tensor=4", layers=2)
    healthy = simulate_chips(trace, chip, topo)
    speed = np.ones(topo.num_chips)
    speed[6] = 2.0
    fast = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    others = fast.chips.drop(6)
    assert (others.finish_s == healthy.step_time_s).all()
    assert fast.step_time_s == healthy.step_time_s
    assert fast.chips.collective_wait_s.iloc[6] > 0  # it waits for the others instead


def test_a_slow_link_slows_only_the_groups_that_route_over_it():
    # tensor=4 on x of a 4x4 v5e without wraparound: rows are tensor groups. A slow link in row
    # 0 slows row 0's tensor collectives; the FSDP collectives (columns) then carry the delay to
    # everyone, so all chips finish later, but row 0 waits least.
    chip, topo, trace = _setup("v5e", "4x4", "fsdp=4,tensor=4", wrap="none", layers=2)
    healthy = simulate_chips(trace, chip, topo)
    r = simulate_chips(trace, chip, topo,
                       config=PerChipConfig(link_factors={topo.ici_link_id(0, 0, 1): 0.25}))
    assert r.step_time_s > healthy.step_time_s
    assert r.num_chip_classes >= 2
    assert any("degraded" in link for seg in r.critical_path for link in seg["links"])
    lb = r.link_bytes
    assert lb.max() > 0 and len(np.unique(lb[lb > 0])) >= 1


def test_critical_path_is_ordered_in_time_and_ends_at_the_step_time():
    chip, topo, trace = _setup("v5e", "2x2", "fsdp=2,tensor=2")
    speed = np.ones(4)
    speed[3] = 0.6
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    path = r.critical_path
    assert path and path[-1]["end_s"] == r.step_time_s
    assert all(a["end_s"] <= b["start_s"] + 1e-15 for a, b in itertools.pairwise(path))
    assert sum(seg["num_ops"] for seg in path) >= 2
    assert r.slowest_chip == r.chips.coords.iloc[3]


def test_partition_refinement_splits_only_what_a_perturbation_touches():
    # Four chips in two groups {0,1},{2,3} on one geometry and {0,2},{1,3} on another.
    g1 = np.array([0, 0, 1, 1])
    g2 = np.array([0, 1, 0, 1])
    speed = np.array([0.5, 1.0, 1.0, 1.0])
    assert chip_classes([speed], [g1]).tolist() == [0, 1, 2, 2]
    assert chip_classes([speed], [g1, g2]).tolist() == [0, 1, 2, 3]
    assert chip_classes([np.ones(4)], [g1, g2]).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("speed", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_speed_factors_are_one_line_errors(speed):
    chip, topo, trace = _setup("v5e", "2x2", "fsdp=4")
    s = np.ones(4)
    s[1] = speed
    with pytest.raises(TpusimError, match="finite numbers > 0") as exc:
        simulate_chips(trace, chip, topo, config=PerChipConfig(speed=s))
    assert "\n" not in str(exc.value)


def test_per_chip_op_scales_slow_only_the_scaled_chip():
    chip, topo, trace = _setup("v5e", "2x2", "fsdp=4")
    mxu_ops = [o.id for o in trace.ops if o.kind == OpKind.COMPUTE and o.flops > 0]
    scale = np.ones(4)
    scale[2] = 3.0
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(op_scale={mxu_ops[0]: scale}))
    busy = r.chips.mxu_busy_s + r.chips.vpu_busy_s
    assert busy.iloc[2] > busy.iloc[0] and busy.iloc[0] == busy.iloc[1] == busy.iloc[3]
    assert r.num_chip_classes == 2


# -- CLI: the perturbation flags on step commands ----------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from sim.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tiny_yaml(tmp_path) -> str:
    import yaml

    path = tmp_path / "tiny1.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _train(model: str, *extra: str) -> list[str]:
    return ["train", "--chip", "v5e", "--shape", "2x2", "--model", model, "--seq-len", "128",
            "--batch-per-chip", "2", "--mesh", "fsdp=2,tensor=2", *extra]


def test_cli_train_slow_chip_json_and_per_chip_table(tiny_yaml, capsys, tmp_path):
    import json

    import pandas as pd

    rc, out, _ = _cli(capsys, *_train(tiny_yaml, "--json"))
    healthy = json.loads(out)
    assert rc == 0 and healthy["num_chip_classes"] == 1 and healthy["slowest_chip"] == "0,0"
    argv = _train(tiny_yaml, "--json", "--slow-chip", "1,1:0.5", "--out", str(tmp_path / "o"))
    rc, out, _ = _cli(capsys, *argv)
    slow = json.loads(out)
    assert rc == 0 and slow["slowest_chip"] == "1,1" and slow["num_chip_classes"] == 4
    assert slow["step_time_s"] > healthy["step_time_s"]
    assert slow["critical_path"][-1]["end_s"] == slow["step_time_s"]
    chips = pd.read_csv(tmp_path / "o" / "chips.csv")
    assert len(chips) == 4 and chips.finish_s.max() == pytest.approx(slow["step_time_s"])
    assert (tmp_path / "o" / "chips.parquet").is_file()
    rc, out, _ = _cli(capsys, *_train(tiny_yaml, "--json", "--slow-chip", "1,1:0.5",
                                     "--mode", "per-chip"))
    brute = json.loads(out)
    assert brute["num_chip_classes"] == 4 and brute["step_time_s"] == slow["step_time_s"]


@pytest.mark.parametrize("flag,value,needle", [
    ("--slow-chip", "5,0:0.5", "outside"),
    ("--slow-chip", "0,0:0", "> 0"),
    ("--slow-chip", "0,0:nan", "> 0"),
    ("--slow-chip", "0,0:inf", "> 0"),
    ("--slow-chip", "0,0,0:0.5", "coordinates"),
    ("--slow-link", "0,0:z+:0.5", "no z axis"),
    ("--slow-link", "1,0:x+:-1", "> 0"),
    ("--chip-variation", "-0.1", "--chip-variation"),
    ("--mode", "full", "--mode"),
])
def test_cli_bad_perturbations_on_train_are_one_line_errors(tiny_yaml, capsys, flag, value,
                                                            needle, tmp_path):
    out_dir = tmp_path / "never"
    rc, out, err = _cli(capsys, *_train(tiny_yaml, flag, value, "--out", str(out_dir)))
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert not out_dir.exists()


def test_cli_decode_prefill_and_replay_take_the_perturbation_flags(tiny_yaml, capsys, tmp_path):
    import json

    pod = ["--chip", "v5e", "--shape", "2x2"]
    for cmd in (["decode", *pod, "--model", tiny_yaml, "--batch", "4", "--context-len", "128",
                 "--mesh", "tensor=4"],
                ["prefill", *pod, "--model", tiny_yaml, "--batch", "1", "--prompt-len", "128",
                 "--mesh", "tensor=4"]):
        rc, out, _ = _cli(capsys, *cmd, "--json")
        healthy = json.loads(out)
        rc2, out2, _ = _cli(capsys, *cmd, "--json", "--slow-chip", "0,1:0.5")
        slow = json.loads(out2)
        key = "step_time_s" if cmd[0] == "decode" else "time_s"
        assert rc == rc2 == 0 and slow[key] > healthy[key], cmd[0]
        assert slow["slowest_chip"] == "0,1"
    trace = tmp_path / "t.trace"
    rc, _, _ = _cli(capsys, "compile", *pod, "--model", tiny_yaml, "--seq-len", "128",
                    "--batch-per-chip", "2", "--mesh", "fsdp=4", "-o", str(trace))
    rc, out, _ = _cli(capsys, "replay", str(trace), *pod, "--json", "--slow-chip", "1,0:2.0")
    fast_chip = json.loads(out)
    rc, out, _ = _cli(capsys, "replay", str(trace), *pod, "--json")
    # A faster chip leaves the step to the others (the class engine sums in another order than
    # the replay: equal to rounding).
    assert fast_chip["step_time_s"] == pytest.approx(json.loads(out)["step_time_s"], rel=1e-12)


def test_perfetto_has_a_process_per_chip_class_plus_the_traced_chips(tmp_path):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace as PerfettoTrace
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

    from sim.export.perfetto import export_step

    chip, topo, trace = _setup("v5e", "2x2", "fsdp=2,tensor=2")
    speed = np.ones(4)
    speed[3] = 0.5
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    path = export_step(r, tmp_path / "t.pftrace", chips=[1])
    pf = PerfettoTrace.FromString(path.read_bytes())
    procs = {p.track_descriptor.uuid: p.track_descriptor.process.process_name for p in pf.packet
             if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")}
    names = sorted(procs.values())
    assert len(names) == r.num_chip_classes == 4  # chip 1 is a class representative already
    assert all(n.startswith("chip class ") and "1 chip(s)" in n for n in names)
    # Each class's process carries its own timeline: the slow chip's MXU ends last.
    parent = {p.track_descriptor.uuid: p.track_descriptor.parent_uuid for p in pf.packet
              if p.HasField("track_descriptor") and p.track_descriptor.HasField("parent_uuid")}
    last_begin: dict[str, int] = {}
    for p in pf.packet:
        if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            name = procs[parent[p.track_event.track_uuid]]
            last_begin[name] = max(last_begin.get(name, 0), p.timestamp)
    slow = next(n for n in names if "(1, 1)" in n)
    assert last_begin[slow] == max(last_begin.values())
    # A healthy step keeps the one-representative trace.
    h = simulate_chips(trace, chip, topo)
    pf = PerfettoTrace.FromString(export_step(h, tmp_path / "h.pftrace").read_bytes())
    procs = [p.track_descriptor.process.process_name for p in pf.packet
             if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")]
    assert len(procs) == 1 and "3 identical chips not shown" in procs[0]


def test_plots_draw_per_link_utilization_and_the_per_chip_maps(tmp_path):
    from sim.export.step_plots import plot_step

    chip, topo, trace = _setup("v5e", "4x4", "fsdp=4,tensor=4", wrap="all")
    r = simulate_chips(trace, chip, topo,
                       config=PerChipConfig(link_factors={topo.ici_link_id(0, 0, 1): 0.5}))
    paths = plot_step(r, {"model": "tiny1"}, tmp_path)
    names = {p.name for p in paths}
    assert {"links_on_torus.png", "chip_slowdown.png"} <= names
    util = r.link_bytes / (r.link_capacity * r.step_time_s)
    slow = topo.ici_link_id(0, 0, 1)
    # The slow link carries its class's bytes at half the bandwidth: twice the utilization of
    # the same link class on chips of the same class.
    same = topo.ici_link_id(int(np.flatnonzero(r.classes.of_chip == r.classes.of_chip[0])[1]), 0, 1)
    assert util[slow] == pytest.approx(2 * util[same])


def test_dead_link_in_a_step_detours_and_slows_the_collectives_over_its_axis():
    chip, topo, trace = _setup("v5e", "4x4", "fsdp=4,tensor=4", wrap="all")
    dead = (topo.ici_link_id(0, 0, 1),)
    healthy = simulate_chips(trace, chip, topo)
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(dead_links=dead))
    brute = simulate_chips(trace, chip, topo, config=PerChipConfig(dead_links=dead,
                                                                   mode="per-chip"))
    assert r.step_time_s > healthy.step_time_s
    assert r.step_time_s == pytest.approx(brute.step_time_s, rel=1e-9)
    assert any("dead" in link for seg in r.critical_path for link in seg["links"])


def test_cli_train_takes_dead_links(tiny_yaml, capsys):
    import json

    rc, out, _ = _cli(capsys, *_train(tiny_yaml, "--json", "--dead-link", "0,0:x+"))
    dead = json.loads(out)
    rc2, out, _ = _cli(capsys, *_train(tiny_yaml, "--json"))
    assert rc == rc2 == 0 and dead["step_time_s"] > json.loads(out)["step_time_s"]


def test_beyond_the_class_limit_vector_classes_run_and_brute_force_is_refused(monkeypatch):
    import sim.engine.executors as ce

    chip, topo, trace = _setup("v5e", "2x2", "fsdp=4")
    speed = np.array([1.0, 0.9, 0.8, 0.7])
    small = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    monkeypatch.setattr(ce, "MAX_CLASS_OPS", 3 * len(trace.ops))
    big = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed))
    assert big.vector_stats["vectors_peak"] >= 1  # the vector engine ran
    assert big.step_time_s == pytest.approx(small.step_time_s, rel=1e-9)
    with pytest.raises(TpusimError, match="4 chip classes") as exc:
        simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, mode="per-chip"))
    # The library names the Python argument; the CLI spells it as the flag.
    assert "\n" not in str(exc.value) and "use mode auto" in str(exc.value)
    assert exc.value.params == ("mode",) and "use --mode auto" in exc.value.render(
        lambda name: "--" + name.replace("_", "-"))


def test_per_chip_programs_equal_the_same_work_given_as_op_scales():
    import dataclasses

    from workloads.trace import Trace

    chip, topo, trace = _setup("v5e", "2x2", "fsdp=2,tensor=2")
    heavy = Trace(mesh=trace.mesh, meta=trace.meta, ops=tuple(
        dataclasses.replace(o, flops=o.flops * 2.0, hbm_bytes=o.hbm_bytes * 2.0)
        if o.kind == OpKind.COMPUTE else o for o in trace.ops))
    which = np.array([0, 0, 1, 0])
    by_program = simulate_chips(trace, chip, topo, config=PerChipConfig(
        programs=(trace, heavy), program_of_chip=which))
    scale = {o.id: np.where(which == 1, 2.0, 1.0) for o in trace.ops if o.kind == OpKind.COMPUTE}
    by_scale = simulate_chips(trace, chip, topo, config=PerChipConfig(op_scale=scale))
    assert by_program.step_time_s == by_scale.step_time_s > simulate_chips(
        trace, chip, topo).step_time_s
    assert by_program.chips.finish_s.tolist() == by_scale.chips.finish_s.tolist()
    assert by_program.slowest_chip == by_scale.slowest_chip == by_scale.chips.coords.iloc[2]
    # Programs must agree on their collectives (they rendezvous by op id).
    other = _setup("v5e", "2x2", "fsdp=4")[2]
    with pytest.raises(TpusimError, match="rendezvous by op id"):
        simulate_chips(trace, chip, topo, config=PerChipConfig(programs=(trace, other),
                                                               program_of_chip=which))
