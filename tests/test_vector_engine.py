"""Vector classes (`sim/engine/vector_engine.py`): chips that differ only in speed advanced as one
numpy vector, split where their event orders differ and merged where they meet again, must give
the brute-force per-chip oracle's step (one SimPy actor per chip) and the class engine's, under
chip variation, a slow chip and a slow link together, on every small pod shape."""

from __future__ import annotations

import numpy as np
import pytest

from sim.chips import get_chip
from sim.engine.executors import simulate_chips
from sim.engine.perchip import PerChipConfig
from sim.engine.replay import replay
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny1", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}
PODS = {  # chip, shape, mesh, wraparound, slices, dcn mesh
    "2x2": ("v5e", "2x2", "fsdp=2,tensor=2", "auto", 1, None),
    "4x4 line": ("v5e", "4x4", "fsdp=4,tensor=4", "none", 1, None),
    "4x4 wrapped": ("v5e", "4x4", "fsdp=4,tensor=4", "all", 1, None),
    "4x4x4": ("v5p", "4x4x4", "fsdp=16,tensor=4", "auto", 1, None),
    "2 slices of 2x2": ("v5e", "2x2", "fsdp=4", "auto", 2, "data=2"),
}


def _setup(pod: str, layers: int = 2, **train):
    chip_name, shape, mesh, wrap, slices, dcn = PODS[pod]
    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape, wraparound=wrap,
                            num_slices=slices)
    model = model_from_dict({**TINY, "num_layers": layers})
    trace = compile_training_step(model, parse_mesh(mesh, dcn), topo.num_chips,
                                  TrainingConfig(seq_len=128, batch_per_chip=2, **train))
    return chip, topo, trace


def _perturbed(topo, *, slow_chip: bool, slow_link: bool, sigma: float = 0.05):
    speed = np.random.default_rng(7).lognormal(0.0, sigma, topo.num_chips)
    if slow_chip:
        speed[topo.num_chips // 2 + 1] = 0.7
    links = {topo.ici_link_id(0, 0, 1): 0.5} if slow_link else {}
    return speed, links


def _run(trace, chip, topo, speed, links, **kw):
    return simulate_chips(trace, chip, topo, config=PerChipConfig(
        speed=speed, link_factors=links, **kw))


def _assert_same(a, b, rel=1e-9):
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=rel)
    np.testing.assert_allclose(a.chips.finish_s, b.chips.finish_s, rtol=rel)
    np.testing.assert_allclose(a.chips.collective_wait_s, b.chips.collective_wait_s, rtol=rel,
                               atol=1e-15)
    np.testing.assert_allclose(a.chips.hbm_busy_s, b.chips.hbm_busy_s, rtol=rel)
    assert a.slowest_chip == b.slowest_chip
    assert a.num_chip_classes == b.num_chip_classes


# Chip variation alone on the smaller pods; with a slow chip and a slow link on every pod.
@pytest.mark.parametrize("pod,slow_chip,slow_link", [
    ("2x2", False, False), ("4x4 line", False, False),
    *((pod, True, True) for pod in PODS),
])
def test_vector_classes_equal_the_brute_force_oracle_and_the_class_engine(pod, slow_chip,
                                                                          slow_link):
    chip, topo, trace = _setup(pod, layers=1)
    speed, links = _perturbed(topo, slow_chip=slow_chip, slow_link=slow_link)
    vec = _run(trace, chip, topo, speed, links, vector=True)
    cls = _run(trace, chip, topo, speed, links, vector=False)
    brute = _run(trace, chip, topo, speed, links, mode="per-chip")
    assert vec.num_chip_classes == topo.num_chips  # every chip differs
    _assert_same(vec, brute)
    _assert_same(vec, cls)
    # The same events in the same order: the vector engine counts what the class engine does.
    assert vec.sim_events == cls.sim_events
    assert vec.vector_stats["vectors_peak"] <= topo.num_chips
    assert vec.step_time_s > replay(trace, chip, topo).step_time_s * (0.9 if not slow_chip
                                                                        else 1.0)


def test_vector_classes_without_overlap_and_with_host_offload_equal_the_class_engine():
    chip, topo, trace = _setup("4x4 wrapped", overlap=False, remat=Remat.OFFLOAD)
    speed, links = _perturbed(topo, slow_chip=True, slow_link=True)
    vec = _run(trace, chip, topo, speed, links, vector=True)
    cls = _run(trace, chip, topo, speed, links, vector=False)
    _assert_same(vec, cls)
    assert vec.chips.pcie_busy_s.min() > 0


def test_vector_classes_stay_few_when_chips_differ_only_slightly():
    # 64 chips, each its own class: the vectors split only where event orders differ and merge
    # where they meet again, so far fewer than 64 are ever alive at once.
    chip, topo, trace = _setup("4x4x4")
    speed = np.random.default_rng(1).lognormal(0.0, 0.02, topo.num_chips)
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, vector=True))
    assert r.num_chip_classes == 64
    assert r.vector_stats["vectors_peak"] < 32


def test_unperturbed_vector_run_equals_replay():
    chip, topo, trace = _setup("4x4x4")
    r = simulate_chips(trace, chip, topo, config=PerChipConfig(vector=True))
    h = replay(trace, chip, topo)
    assert r.step_time_s == pytest.approx(h.step_time_s, rel=1e-12)
    assert r.num_chip_classes == 1 and r.vector_stats["vectors_peak"] == 1


def test_collective_wait_is_wall_time_when_collectives_overlap():
    # Two all-gathers start together after one matmul; chip 3 runs at half speed, so the other
    # chips wait F/rate for it, in both collectives at once: that is F/rate of wall time, not
    # twice it. (The links, not HBM, pace the gathers, so all chips drain together.)
    from workloads.trace import Op, OpKind, Trace, Unit

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2", wraparound="auto",
                            num_slices=1)
    flops, nbytes = 4e12, 2.0**28
    ops = (
        Op(id=0, name="work", unit=Unit.MXU, flops=flops),
        Op(id=1, name="gather_a", kind=OpKind.COLLECTIVE, collective="all-gather",
           mesh_axes=("fsdp",), bytes=nbytes, deps=(0,)),
        Op(id=2, name="gather_b", kind=OpKind.COLLECTIVE, collective="all-gather",
           mesh_axes=("fsdp",), bytes=nbytes, deps=(0,)),
        Op(id=3, name="after", unit=Unit.VPU, flops=1e6, deps=(1, 2)),
    )
    trace = Trace(mesh=parse_mesh("fsdp=4"), ops=ops, meta={"overlap": True})
    speed = np.ones(4)
    speed[3] = 0.5
    lag = flops / (chip.mxu_flops_per_s * chip.mxu_efficiency)
    for kw in ({"vector": True}, {"vector": False}, {"mode": "per-chip"}):
        r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, **kw))
        wait = r.chips.collective_wait_s.to_numpy()
        assert wait[:3] == pytest.approx([lag] * 3, rel=1e-9), kw
        assert wait[3] == 0.0
        assert (wait <= r.chips.finish_s.to_numpy()).all()


def test_vector_classes_with_a_dead_link_equal_the_class_engine():
    chip, topo, trace = _setup("4x4 wrapped", layers=1)
    speed, _ = _perturbed(topo, slow_chip=False, slow_link=False)
    dead = (topo.ici_link_id(0, 0, 1),)
    vec = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, dead_links=dead,
                                                                 vector=True))
    cls = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, dead_links=dead,
                                                                 vector=False))
    _assert_same(vec, cls)
    assert vec.sim_events == cls.sim_events
    assert any("dead" in link for seg in vec.critical_path for link in seg["links"]) == \
        any("dead" in link for seg in cls.critical_path for link in seg["links"])


def test_a_compute_op_beside_a_link_bound_gather_runs_at_its_mxu_time_on_every_engine():
    # A 1 GiB all-gather over 4 chips is paced by its links (~9 ms) and draws ~22% of HBM; a
    # matmul of 1 ms of FLOPs beside it streams 0.5 ms worth of HBM bytes (it needs 50%). With
    # max-min sharing the gather leaves the HBM it cannot use, so the matmul takes exactly its
    # MXU time, 1 ms / speed, on each chip (chip 3 at 0.6: 60% of the FLOP rate and of HBM).
    # Shared in proportion to bytes in flight it would take (all HBM bytes) / HBM bandwidth.
    from workloads.trace import Op, OpKind, Trace, Unit

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2", wraparound="auto",
                            num_slices=1)
    t_c = 1e-3
    hbm = chip.hbm_bytes_per_s * chip.hbm_efficiency
    ops = (
        Op(id=0, name="gather", kind=OpKind.COLLECTIVE, collective="all-gather",
           mesh_axes=("fsdp",), bytes=2.0**30),
        Op(id=1, name="matmul", unit=Unit.MXU, flops=t_c * chip.mxu_flops_per_s
           * chip.mxu_efficiency, hbm_bytes=0.5 * t_c * hbm),
        Op(id=2, name="after", unit=Unit.VPU, flops=1e6, deps=(0, 1)),
    )
    trace = Trace(mesh=parse_mesh("fsdp=4"), ops=ops, meta={"overlap": True})
    speed = np.ones(4)
    speed[3] = 0.6
    h = replay(trace, chip, topo)
    row = h.ops[h.ops.name == "matmul"].iloc[0]
    assert row.end_s - row.start_s == pytest.approx(t_c + chip.op_overhead_s, rel=1e-12)
    for kw in ({"vector": True}, {"vector": False}, {"mode": "per-chip"}):
        r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, **kw))
        cls = r.chips.chip_class.to_numpy()
        for c in range(4):
            mm = r.for_class(int(cls[c])).ops.set_index("name").loc["matmul"]
            assert mm.end_s - mm.start_s == pytest.approx(
                t_c / speed[c] + chip.op_overhead_s, rel=1e-12), (kw, c)
        # HBM stays busy (the gather's traffic) for over twice the matmul's time: sharing it in
        # proportion to bytes in flight would have held the matmul back that long.
        assert (r.chips.hbm_busy_s.to_numpy() > 2 * t_c / speed).all()


def test_kept_collective_candidate_rows_equal_recomputed_ones_and_give_the_same_step(
        monkeypatch):
    # Each vector keeps its candidate row of every collective in flight (its start or end time
    # per chip) until a rendezvous of it resolves or the vector's phase there changes, instead
    # of recomputing every row at every event. On 64 chips, each its own speed, with one
    # gather and one reduction per weight matrix in flight: every kept row, whenever it is
    # used, equals a fresh one ("check" raises otherwise), and the step is bit for bit the one
    # that recomputes them all, with far fewer rows computed.
    import sim.engine.vector_run as ve

    chip, topo, trace = _setup("4x4x4")
    speed = np.random.default_rng(3).lognormal(0.0, 0.02, topo.num_chips)
    built = {"n": 0}
    fresh_row = ve.VectorRun._coll_row

    def counted(self, v, j, ph):
        built["n"] += 1
        return fresh_row(self, v, j, ph)

    monkeypatch.setattr(ve.VectorRun, "_coll_row", counted)
    runs = {}
    for mode in ("recompute", "check", "keep"):
        built["n"] = 0
        r = simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed, vector=True,
                                                                   vector_rows=mode))
        runs[mode] = (r, built["n"])
    (ref, n_ref), (chk, _), (kept, n_kept) = runs["recompute"], runs["check"], runs["keep"]
    for r in (chk, kept):
        assert r.step_time_s == ref.step_time_s
        np.testing.assert_array_equal(r.chips.finish_s, ref.chips.finish_s)
        np.testing.assert_array_equal(r.chips.collective_wait_s, ref.chips.collective_wait_s)
        assert r.sim_events == ref.sim_events
        assert r.vector_stats == ref.vector_stats
    assert n_kept < n_ref / 2


def test_vector_classes_under_a_skewed_moe_router_and_a_dead_link_equal_the_class_engine():
    # A skewed router gives each expert shard its own expert-op and all-to-all volume
    # (`op_scale`), so the vectors carry several kinds of chip; with chip variation and a dead
    # link on top, every kept candidate row still equals a fresh one ("check" raises
    # otherwise), the step is the recomputing engine's bit for bit, and the class engine's.
    from workloads.moe import MoeConfig, expert_op_scales

    chip, topo, _ = _setup("4x4 wrapped")
    moe = model_from_dict({**TINY, "num_layers": 1, "num_experts": 8, "experts_per_token": 2})
    trace = compile_training_step(moe, parse_mesh("expert=4,fsdp=4"), topo.num_chips,
                                  TrainingConfig(seq_len=128, batch_per_chip=2,
                                                 moe=MoeConfig(expert_skew=1.5)))
    scale = expert_op_scales(trace, topo)
    assert scale and all(np.ptp(x) > 0.5 for x in scale.values())  # the shards differ
    speed, _ = _perturbed(topo, slow_chip=False, slow_link=False)
    cfg = dict(speed=speed, op_scale=scale, dead_links=(topo.ici_link_id(1, 1, 0),))
    runs = {}
    for mode in ("recompute", "check"):
        runs[mode] = simulate_chips(trace, chip, topo,
                                    config=PerChipConfig(vector=True, vector_rows=mode, **cfg))
    ref, chk = runs["recompute"], runs["check"]
    assert chk.step_time_s == ref.step_time_s and chk.sim_events == ref.sim_events
    np.testing.assert_array_equal(chk.chips.finish_s, ref.chips.finish_s)
    np.testing.assert_array_equal(chk.chips.collective_wait_s, ref.chips.collective_wait_s)
    cls = simulate_chips(trace, chip, topo, config=PerChipConfig(vector=False, **cfg))
    _assert_same(chk, cls)
    assert chk.sim_events == cls.sim_events
