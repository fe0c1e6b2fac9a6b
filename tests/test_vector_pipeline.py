"""Vector classes on pipeline steps (`sim/engine/vector_engine.py` with several programs and
point-to-point sends): every stage's chips run their own program, a send drains on its sender's
links from the end of its pass and completes the receive op on the peer chip. The class engine
and `--mode per-chip` (one SimPy actor per chip) are the oracles: the same step, finish times,
schedule, critical path and Perfetto trace, under a slow chip, chip variation, slow and dead
links between stages, without overlap, and with the pipeline over DCN."""

from __future__ import annotations

import json

import numpy as np
import pytest

import sim.engine.executors as ce
from sim.chips import get_chip
from sim.engine.perchip import PerChipConfig
from sim.engine.pipeline import simulate_pipeline_chips, stage_of_chips
from tests.conftest import make_topology
from topologies.mesh import parse_mesh
from workloads.training import TrainingConfig, parse_remat
from workloads.zoo import model_from_dict

# Two layers per stage at most, a tiny vocabulary: a few thousand ops per stage program.
MODEL = {"name": "pp", "num_layers": 4, "d_model": 512, "num_heads": 4, "num_kv_heads": 4,
         "head_dim": 128, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 256}
PODS = {  # shape, mesh, slices, dcn mesh, schedule, virtual stages
    "4x4": ("4x4", "pipeline=4,fsdp=4", 1, None, "1f1b", 1),
    "2 slices, pipeline over DCN": ("2x2", "fsdp=4", 2, "pipeline=2", "interleaved", 2),
}


def _pipeline(pod, base, overlap=None):
    shape, mesh, slices, dcn, schedule, v = PODS[pod]
    chip = get_chip("v5e")
    topo = make_topology(chip, shape, slices=slices)
    cfg = TrainingConfig(seq_len=512, batch_per_chip=4, microbatches=4,
                         pipeline_schedule=schedule, virtual_stages=v,
                         remat=parse_remat("full"))
    return simulate_pipeline_chips(model_from_dict(MODEL), parse_mesh(mesh, dcn), chip, topo,
                                   cfg, base=base, overlap=overlap)


def _topology(pod):
    shape, _mesh, slices, *_ = PODS[pod]
    return make_topology(get_chip("v5e"), shape, slices=slices)


def _variation(topo, sigma=0.05, seed=7):
    return np.random.default_rng(seed).lognormal(0.0, sigma, topo.num_chips)


def _between_stages(pod, topo):
    """A link a stage-0 chip's activations leave by (towards its stage-1 peer)."""
    _shape, mesh, _slices, dcn, *_ = PODS[pod]
    stage, nxt, _ = stage_of_chips(parse_mesh(mesh, dcn), topo)
    c0 = int(np.flatnonzero(stage == 0)[0])
    a = int(np.flatnonzero(np.asarray(topo.coords(c0)) != np.asarray(topo.coords(nxt[c0])))[0])
    return topo.ici_link_id(c0, a, +1)


def _assert_same(vec, cls):
    (rv, pv), (rc, pc) = vec, cls
    assert rv.vector_stats["vector_steps"] > 0 and rc.vector_stats is None
    # Times are computed with the same formulas in the same order: equal to the last bit.
    assert rv.step_time_s == rc.step_time_s
    np.testing.assert_array_equal(rv.chips.finish_s, rc.chips.finish_s)
    assert rv.slowest_chip == rc.slowest_chip
    assert rv.num_chip_classes == rc.num_chip_classes
    assert rv.sim_events == rc.sim_events
    assert rv.critical_path == rc.critical_path
    assert pv.to_dict() == pc.to_dict()  # the schedule: passes, bubble, stage finish and HBM
    assert rv.breakdown == rc.breakdown
    # Busy and wait sums may differ in the last bit (added in another order).
    for col in ("mxu_busy_s", "vpu_busy_s", "hbm_busy_s", "collective_wait_s"):
        np.testing.assert_allclose(rv.chips[col], rc.chips[col], rtol=1e-12, atol=1e-18)
    np.testing.assert_allclose(rv.link_bytes, rc.link_bytes, rtol=1e-12)
    # Every class's own timeline (its stage's program) and HBM table.
    for c in range(rv.num_chip_classes):
        a, b = rv.for_class(c), rc.for_class(c)
        assert a.ops.equals(b.ops) and a.memory.equals(b.memory)


def _engines(pod, base, overlap=None, brute=False):
    import dataclasses

    runs = [_pipeline(pod, dataclasses.replace(base, vector=vector), overlap)
            for vector in (True, False)]
    if brute:
        runs.append(_pipeline(pod, dataclasses.replace(base, mode="per-chip"), overlap))
    return runs


@pytest.mark.parametrize("pod", list(PODS))
def test_pipeline_vectors_equal_the_class_engine_and_brute_force_under_chip_variation(pod):
    topo = _topology(pod)
    vec, cls, brute = _engines(pod, PerChipConfig(speed=_variation(topo)), brute=True)
    assert vec[0].num_chip_classes == topo.num_chips  # every chip differs
    _assert_same(vec, cls)
    assert vec[0].step_time_s == pytest.approx(brute[0].step_time_s, rel=1e-12)
    np.testing.assert_allclose(vec[0].chips.finish_s, brute[0].chips.finish_s, rtol=1e-12)
    healthy = _pipeline(pod, PerChipConfig())[0]
    assert vec[0].step_time_s != healthy.step_time_s


def test_pipeline_vectors_equal_the_class_engine_healthy_and_with_a_slow_chip():
    topo = _topology("4x4")
    vec, cls = _engines("4x4", PerChipConfig())
    _assert_same(vec, cls)
    assert vec[0].num_chip_classes == 4  # one class per stage
    speed = np.ones(topo.num_chips)
    speed[5] = 0.7
    vec_s, cls_s = _engines("4x4", PerChipConfig(speed=speed))
    _assert_same(vec_s, cls_s)
    assert vec_s[0].step_time_s > vec[0].step_time_s


def test_pipeline_vectors_with_a_slow_and_a_dead_link_between_stages_equal_the_class_engine():
    pod = "4x4"
    topo = _topology(pod)
    link = _between_stages(pod, topo)
    speed = _variation(topo, seed=3)
    vec, cls = _engines(pod, PerChipConfig(speed=speed, link_factors={link: 0.05}))
    _assert_same(vec, cls)
    vec_d, cls_d = _engines(pod, PerChipConfig(speed=speed, dead_links=(link,)))
    _assert_same(vec_d, cls_d)
    # Both slow the stage's sends, so the step.
    plain = _pipeline(pod, PerChipConfig(speed=speed))[0]
    assert vec[0].step_time_s > plain.step_time_s and vec_d[0].step_time_s > plain.step_time_s


def test_pipeline_vectors_without_overlap_equal_the_class_engine():
    # --no-overlap: collectives and sends run on the core; receives still complete by their
    # sends.
    topo = _topology("4x4")
    vec, cls = _engines("4x4", PerChipConfig(speed=_variation(topo, seed=5)), overlap=False)
    _assert_same(vec, cls)


def test_pipeline_vectors_keep_candidate_rows_equal_to_fresh_ones():
    # A receive's row (its send's end per chip) is kept until the send ends on one of its
    # senders ("check" compares every kept row with a fresh one and raises if stale).
    topo = _topology("4x4")
    runs = {}
    for mode in ("recompute", "check"):
        base = PerChipConfig(speed=_variation(topo, seed=11), vector=True, vector_rows=mode)
        runs[mode] = _pipeline("4x4", base)[0]
    assert runs["check"].step_time_s == runs["recompute"].step_time_s
    np.testing.assert_array_equal(runs["check"].chips.finish_s, runs["recompute"].chips.finish_s)


def test_auto_runs_pipelines_on_vectors_from_enough_classes_per_stage(monkeypatch):
    topo = _topology("4x4")
    speed = _variation(topo)
    # 16 classes over 4 stage programs: vectors from VECTOR_MIN_CLASSES classes per program.
    monkeypatch.setattr(ce, "VECTOR_MIN_CLASSES", 4)
    assert _pipeline("4x4", PerChipConfig(speed=speed))[0].vector_stats is not None
    monkeypatch.setattr(ce, "VECTOR_MIN_CLASSES", 5)
    assert _pipeline("4x4", PerChipConfig(speed=speed))[0].vector_stats is None


def test_perfetto_trace_of_a_vector_pipeline_equals_the_class_engines(tmp_path):
    from sim.export.perfetto import export_step

    topo = _topology("4x4")
    vec, cls = _engines("4x4", PerChipConfig(speed=_variation(topo, seed=2)))
    a = json.loads(export_step(vec[0], tmp_path / "v.json").read_text())
    b = json.loads(export_step(cls[0], tmp_path / "c.json").read_text())
    assert a == b
    assert any(e.get("name") == "pipeline_recv_fwd" for e in a["traceEvents"])


def _two_programs():
    """Stage 0 computes, sends to its stage-1 peer and gathers; stage 1's receive feeds a
    gather (a collective, not a core op: the receive is waited for from the step's start)."""
    from sim.engine.perchip import PointToPoint
    from workloads.trace import Op, OpKind, Trace, Unit

    chip = get_chip("v5e")
    topo = make_topology(chip, "4x2")
    mesh = parse_mesh("pipeline=2,fsdp=4")
    stage, nxt, prv = stage_of_chips(mesh, topo)
    flops, msg, shard = 2e12, 2.0**26, 2.0**27

    def send(i, name, deps=()):
        return Op(id=i, name=name, kind=OpKind.COLLECTIVE, collective="send",
                  mesh_axes=("pipeline",), bytes=msg, deps=deps)

    def gather(i, deps):
        return Op(id=i, name="gather", kind=OpKind.COLLECTIVE, collective="all-gather",
                  mesh_axes=("fsdp",), bytes=shard, deps=deps)

    first = (Op(id=0, name="work", unit=Unit.MXU, flops=flops, hbm_bytes=1e9),
             send(1, "send", (0,)), gather(2, (0,)),
             Op(id=3, name="after", unit=Unit.VPU, flops=1e9, deps=(2,)))
    second = (send(0, "recv"), gather(1, (0,)),
              Op(id=2, name="early", unit=Unit.MXU, flops=flops / 2, hbm_bytes=1e9),
              Op(id=3, name="use", unit=Unit.MXU, flops=flops, hbm_bytes=1e9, deps=(1, 2)))
    progs = tuple(Trace(mesh=mesh, ops=ops, meta={"overlap": True}) for ops in (first, second))
    p2p = PointToPoint(peer_of_chip=(nxt, prv), sends=({1: (0, 7)}, {}), recvs=({}, {7: 0}))
    return chip, topo, progs, stage, p2p


def test_a_receive_feeding_a_collective_equals_the_class_engine_and_brute_force():
    chip, topo, progs, stage, p2p = _two_programs()
    speed = np.random.default_rng(4).lognormal(0.0, 0.1, topo.num_chips)
    runs = [ce.simulate_chips(progs[0], chip, topo, config=PerChipConfig(
        speed=speed, programs=progs, program_of_chip=stage, p2p=p2p, **kw))
        for kw in ({"vector": True}, {"vector": False}, {"mode": "per-chip"})]
    vec, cls, brute = runs
    for other in (cls, brute):
        assert vec.step_time_s == other.step_time_s
        np.testing.assert_array_equal(vec.chips.finish_s, other.chips.finish_s)
        assert vec.critical_path == other.critical_path
    # Stage 1's gather waits for the message: it starts after the send has ended.
    t = vec.for_class(int(vec.classes.of_chip[int(np.flatnonzero(stage == 1)[0])])).ops
    recv, gath = (t[t.name == n].iloc[0] for n in ("recv", "gather"))
    assert gath.start_s >= recv.end_s > recv.start_s > 0


def test_a_send_without_a_receiver_is_the_class_engines_error_on_vectors():
    import dataclasses

    from topologies.errors import TpusimError

    chip, topo, progs, stage, p2p = _two_programs()
    bad = dataclasses.replace(p2p, recvs=({}, {8: 0}))
    errors = []
    for vector in (True, False):
        with pytest.raises(TpusimError, match="has no receiver") as err:
            ce.simulate_chips(progs[0], chip, topo, config=PerChipConfig(
                programs=progs, program_of_chip=stage, p2p=bad, vector=vector))
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_pipeline_vectors_under_an_uneven_moe_router_equal_the_class_engine():
    # Each stage's expert shards carry their own loads (per-stage op scales, merged by op id
    # across the stage programs): vector kinds split by them, with chip variation on top.
    from workloads.moe import MoeConfig

    moe = {**MODEL, "name": "moe-pp", "num_layers": 2, "num_experts": 8,
           "experts_per_token": 2}
    chip = get_chip("v5e")
    topo = make_topology(chip, "4x2")
    cfg = TrainingConfig(seq_len=512, batch_per_chip=2, microbatches=2,
                         moe=MoeConfig(expert_skew=2.0, seed=1))
    speed = _variation(topo, seed=2)
    vec, cls = (simulate_pipeline_chips(model_from_dict(moe), parse_mesh(
        "pipeline=2,expert=2,fsdp=2"), chip, topo, cfg, base=PerChipConfig(speed=speed,
                                                                             vector=vector))
        for vector in (True, False))
    _assert_same(vec, cls)


def test_programs_sharing_a_replica_group_or_sending_within_one_program_run_as_classes():
    # Vector rendezvous are keyed by (program, op id): a group over chips of two programs, or
    # a send to a chip of the sender's own program (a ring), runs on the class engine even
    # when vectors are asked for (the same result as brute force).
    from sim.engine.perchip import PointToPoint
    from workloads.trace import Op, OpKind, Trace, Unit

    chip = get_chip("v5e")
    topo = make_topology(chip, "4x2")
    n = topo.num_chips

    def prog(flops):
        return Trace(mesh=parse_mesh("fsdp=8"), ops=(
            Op(id=0, name="work", unit=Unit.MXU, flops=flops),
            Op(id=1, name="gather", kind=OpKind.COLLECTIVE, collective="all-gather",
               mesh_axes=("fsdp",), bytes=2.0**26, deps=(0,))), meta={"overlap": True})

    msg = {"kind": OpKind.COLLECTIVE, "collective": "send", "mesh_axes": ("pipeline",),
           "bytes": 2.0**26}
    ring = Trace(mesh=parse_mesh("pipeline=2,fsdp=4"), ops=(
        Op(id=0, name="recv", **msg),
        Op(id=1, name="work", unit=Unit.MXU, flops=1e12),
        Op(id=2, name="send", deps=(1,), **msg),
        Op(id=3, name="use", unit=Unit.VPU, flops=1e9, deps=(0, 1))), meta={"overlap": True})
    cases = [
        {"programs": (prog(1e12), prog(2e12)), "program_of_chip": np.arange(n) % 2},
        {"programs": (ring,), "program_of_chip": np.zeros(n, dtype=np.int64),
         "p2p": PointToPoint(peer_of_chip=(np.roll(np.arange(n), 1),), sends=({2: (0, 7)},),
                             recvs=({7: 0},))},
    ]
    for case in cases:
        runs = [ce.simulate_chips(case["programs"][0], chip, topo, config=PerChipConfig(
            speed=_variation(topo), **case, **kw)) for kw in ({"vector": True},
                                                               {"mode": "per-chip"})]
        assert runs[0].vector_stats is None
        assert runs[0].step_time_s == runs[1].step_time_s
