"""The MXU's width: a matmul operand dimension narrower than one systolic array (attention's
head_dim 128 on v6e's 256x256 MXU) leaves part of the array idle (tpu.md §1.2)."""

from __future__ import annotations

import json

import pytest

from sim.chips import get_chip
from sim.engine.replay import replay
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.trace import Trace
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict


@pytest.mark.parametrize(("chip", "dim", "fill"), [
    ("v6e", 128, 0.5), ("v6e", 256, 1.0), ("v6e", 384, 0.75), ("v6e", 0, 1.0),
    ("v5e", 128, 1.0), ("v5e", 64, 0.5), ("v5e", 192, 0.75), ("tpu7x", 128, 0.5),
])
def test_a_narrow_dimension_is_padded_to_the_mxu_width(chip, dim, fill):
    assert get_chip(chip).mxu_fill(dim) == pytest.approx(fill)


def _step(chip: str, head_dim: int):
    model = model_from_dict({"name": "small", "num_layers": 2, "d_model": 512, "num_heads": 4,
                             "num_kv_heads": 2, "head_dim": head_dim, "d_ff": 1024,
                             "vocab_size": 1024, "mlp": "swiglu"})
    c = get_chip(chip)
    topo = resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape, shape=(2, 2))
    trace = compile_training_step(model, parse_mesh("fsdp=4"), 4,
                                  TrainingConfig(seq_len=2048, batch_per_chip=1,
                                                 remat=Remat.NONE, attention="flash"))
    return trace, replay(trace, c, topo)


def test_attention_with_head_dim_128_takes_twice_its_flops_time_on_a_256_wide_mxu():
    trace, res = _step("v6e", 128)
    chip = get_chip("v6e")
    ops = res.ops.set_index("op_id")
    att = [o for o in trace.ops if o.name == "flash_attention"][0]
    assert att.narrow_dim == 128
    rate = chip.mxu_flops_per_s * chip.mxu_efficiency
    dur = float(ops.loc[att.id, "end_s"] - ops.loc[att.id, "start_s"])
    assert ops.loc[att.id, "bound"] == "mxu"
    assert dur == pytest.approx(att.flops / (0.5 * rate), rel=1e-6)
    # The weight matmuls are wide: their time is their FLOPs at the full rate.
    qkv = [o for o in trace.ops if o.name == "qkv_proj"][0]
    assert qkv.narrow_dim == 0


def test_head_dim_256_fills_the_v6e_mxu_and_128_fills_v5e():
    for chip, hd in (("v6e", 256), ("v5e", 128)):
        trace, res = _step(chip, hd)
        c = get_chip(chip)
        rate = c.mxu_flops_per_s * c.mxu_efficiency
        busy = sum(o.flops for o in trace.ops if o.kind == "compute" and o.unit == "mxu") / rate
        assert res.units.set_index("unit").loc["mxu", "busy_s"] == pytest.approx(busy, rel=1e-9)


def test_a_version_2_trace_without_narrow_dim_loads_with_no_padding():
    trace, _ = _step("v6e", 128)
    doc = json.loads(trace.to_json())
    k = doc["columns"].index("narrow_dim")
    doc["version"] = 2
    doc["columns"].pop(k)
    for row in doc["ops"]:
        row.pop(k)
    old = Trace.from_json(json.dumps(doc))
    assert all(o.narrow_dim == 0 for o in old.ops)
    assert [o.flops for o in old.ops] == [o.flops for o in trace.ops]


def test_compute_op_times_are_the_flops_and_bytes_terms_replay_costs_an_op_alone():
    # compute_op_times (the per-op costs docs/validation.md compares with XLA's estimates):
    # FLOPs at the unit's rate, the MXU's with the narrow dimension's fill, and bytes at HBM.
    from sim.engine.costs import compute_op_times

    trace, res = _step("v6e", 128)
    chip = get_chip("v6e")
    ops = res.ops.set_index("op_id")
    att = [o for o in trace.ops if o.name == "flash_attention"][0]
    t_c, t_m = compute_op_times(chip, att)
    assert t_c == att.flops / (chip.mxu_flops_per_s * chip.mxu_efficiency * 0.5)
    assert t_m == att.hbm_bytes / (chip.hbm_bytes_per_s * chip.hbm_efficiency)
    # MXU-bound with HBM to spare, the op takes exactly its cost alone in the replay too.
    dur = float(ops.loc[att.id, "end_s"] - ops.loc[att.id, "start_s"])
    assert dur == pytest.approx(max(t_c, t_m) + chip.op_overhead_s, rel=1e-9)
    norm = [o for o in trace.ops if o.unit == "vpu" and o.flops > 0][0]
    assert compute_op_times(chip, norm)[0] == norm.flops / (
        chip.vpu_flops_per_s * chip.vpu_efficiency)
