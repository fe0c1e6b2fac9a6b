"""The executor table (`sim/engine/executors.py`): which executor times a step, decided in one
place, and the same step on each of them; the vector engine's runs independent of what ran
before."""

from __future__ import annotations

import numpy as np
import pytest

import sim.engine.executors as ex
from sim.chips import get_chip
from sim.engine.executors import Executor, choose_executor, simulate_chips, simulate_step
from sim.engine.perchip import PerChipConfig, prepare_step
from sim.engine.replay import replay
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.training import TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny1", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}


def _setup(chip_name="v5e", shape="2x2", mesh="fsdp=2,tensor=2"):
    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    trace = compile_training_step(model_from_dict(TINY), parse_mesh(mesh), topo.num_chips,
                                  TrainingConfig(seq_len=128, batch_per_chip=2))
    return chip, topo, trace


def test_the_table_picks_each_executor():
    chip, topo, trace = _setup()
    speed = np.array([1.0, 0.9, 0.8, 0.7])
    healthy = prepare_step(trace, chip, topo, PerChipConfig())
    varied = prepare_step(trace, chip, topo, PerChipConfig(speed=speed))
    assert healthy.num_classes == 1 and varied.num_classes == 4
    assert choose_executor("representative", prepared=varied) == Executor.REPRESENTATIVE
    for name in ("auto", "class", "vector", "per-chip"):  # before the classes are known
        assert choose_executor(name) == Executor(name)
    assert choose_executor(prepared=healthy) == Executor.CLASS
    assert choose_executor(prepared=varied) == Executor.CLASS  # few classes: SimPy actors
    assert choose_executor("vector", prepared=varied) == Executor.VECTOR
    assert choose_executor("class", prepared=varied) == Executor.CLASS
    assert choose_executor("per-chip", prepared=varied) == Executor.PER_CHIP
    with pytest.raises(ValueError):
        choose_executor("simpy-ish")


def test_auto_takes_vectors_from_enough_classes_or_beyond_the_class_limit(monkeypatch):
    chip, topo, trace = _setup()
    varied = prepare_step(trace, chip, topo, PerChipConfig(speed=np.array([1.0, 0.9, 0.8, 0.7])))
    monkeypatch.setattr(ex, "VECTOR_MIN_CLASSES", 4)
    assert choose_executor(prepared=varied) == Executor.VECTOR
    monkeypatch.setattr(ex, "VECTOR_MIN_CLASSES", 5)
    monkeypatch.setattr(ex, "MAX_CLASS_OPS", varied.class_ops - 1)
    assert choose_executor(prepared=varied) == Executor.VECTOR
    with pytest.raises(TpusimError, match="class-ops"):
        choose_executor("class", prepared=varied)
    with pytest.raises(TpusimError, match="class-ops"):
        choose_executor("per-chip", prepared=varied)


def test_every_executor_times_the_same_healthy_step():
    chip, topo, trace = _setup()
    ref = replay(trace, chip, topo)
    for name in Executor:
        got = simulate_step(trace, chip, topo, executor=name)
        assert got.step_time_s == ref.step_time_s, name
        assert got.breakdown == ref.breakdown, name


def test_the_representative_replay_takes_no_per_chip_config():
    chip, topo, trace = _setup()
    with pytest.raises(TpusimError, match="representative"):
        simulate_step(trace, chip, topo, executor="representative", config=PerChipConfig())


def test_a_vector_run_is_the_same_whatever_ran_before_it():
    # The merge hashes come from a generator seeded per run: a run after other vector runs in
    # the same process is the first run's, counters included.
    chip, topo, trace = _setup("v5p", "4x4x4", "fsdp=16,tensor=4")
    speed = np.random.default_rng(5).lognormal(0.0, 0.03, topo.num_chips)
    cfg = PerChipConfig(speed=speed, vector=True)
    first = simulate_chips(trace, chip, topo, config=cfg)
    simulate_chips(trace, chip, topo, config=PerChipConfig(speed=speed[::-1].copy(),
                                                           vector=True))
    again = simulate_chips(trace, chip, topo, config=cfg)
    assert again.step_time_s == first.step_time_s
    assert again.vector_stats == first.vector_stats
    np.testing.assert_array_equal(again.chips.finish_s, first.chips.finish_s)


def test_the_op_cost_kernel_is_the_rate_times_efficiency_of_every_site_bit_for_bit():
    chip, _topo, trace = _setup()
    for op in trace.ops:
        if op.kind != "compute":
            continue
        for s in (1.0, 0.7):
            if op.unit == "mxu":
                peak = chip.mxu_int8_ops_per_s if op.dtype == "int8" else chip.mxu_flops_per_s
                want = peak * chip.mxu_efficiency * s * chip.mxu_fill(op.narrow_dim)
            else:
                want = chip.vpu_flops_per_s * chip.vpu_efficiency * s
            assert chip.unit_rate(op, s) == want
    assert chip.eff_hbm_bytes_per_s == chip.hbm_bytes_per_s * chip.hbm_efficiency
    assert chip.eff_ici_link_bytes_per_s == chip.ici_link_bytes_per_s * chip.ici_efficiency
