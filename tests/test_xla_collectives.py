"""Collectives as XLA emits them (docs/model.md "Collectives as XLA emits them"), each rule on a
small closed-form case."""

from __future__ import annotations

import pytest

from topologies.mesh import parse_mesh
from workloads.models import model_from_dict
from workloads.training import Remat, TrainingConfig, compile_training_step

SMALL = {"name": "small", "num_layers": 2, "d_model": 512, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 128, "d_ff": 1024, "vocab_size": 1024, "mlp": "swiglu"}
SEQ = 256


def _trace(mesh: str, chips: int, **cfg):
    model = model_from_dict(SMALL)
    return compile_training_step(model, parse_mesh(mesh), chips,
                                 TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                remat=Remat.FULL, **cfg))


def _ops(trace, name):
    return [o for o in trace.ops if o.name == name]


@pytest.mark.parametrize(("tp_activations", "fwd", "kind", "bwd"), [
    ("replicated", "tp_embed_allreduce", "all-reduce", None),
    ("sharded", "tp_embed_reducescatter", "reduce-scatter", "tp_embed_grad_allgather"),
])
def test_the_embedding_lookup_sums_its_vocabulary_shards_over_tensor(tp_activations, fwd, kind,
                                                                     bwd):
    # 8 chips, fsdp=2 x tensor=4: 8 sequences, 4 per fsdp shard, n = 4 x 256 tokens per chip's
    # tensor group; each vocabulary shard's partial lookup is [n, d_model] bf16.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations=tp_activations)
    n = 4 * SEQ
    (red,) = _ops(trace, fwd)
    assert red.collective == kind and red.mesh_axes == ("tensor",)
    assert red.bytes == n * 512 * 2
    lookup = _ops(trace, "embed_lookup")[0]
    assert lookup.id in red.deps
    first = min(o.id for o in trace.ops if o.layer == 0)
    assert red.id < first
    if bwd is None:
        assert not [o for o in trace.ops if "embed_grad_allgather" in o.name]
    else:
        (g,) = _ops(trace, bwd)
        assert g.collective == "all-gather" and g.bytes == n * 512 * 2
        assert g.id in _ops(trace, "embed_grad")[0].deps


def test_no_tensor_axis_means_no_embedding_reduction():
    trace = _trace("fsdp=8", 8)
    assert not [o for o in trace.ops if o.name.startswith("tp_embed")]


def test_backward_matmuls_split_into_input_and_weight_gradients():
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations="replicated")
    n, D, F, tp = 4 * SEQ, 512, 1024, 4
    (dx,) = [o for o in trace.ops if o.name == "mlp_bwd" and o.layer == 1]
    (dw,) = [o for o in trace.ops if o.name == "mlp_bwd_weights" and o.layer == 1]
    # SwiGLU: 3 matrices; forward 2 n D F x 3 / tp; backward 2x that, half dX and half dW.
    assert dx.flops == dw.flops == 2 * n * D * F * 3 / tp
    # The input gradient's all-reduce over tensor waits for dX only; dW runs while it is in
    # flight (later in program order, not depending on it).
    (ar,) = [o for o in trace.ops if o.name == "tp_allreduce_mlp_bwd" and o.layer == 1]
    assert dx.id < dw.id and ar.id not in dw.deps
    nrm = [o for o in trace.ops if o.name == "norm_mlp_bwd" and o.layer == 1][0]
    assert ar.id in nrm.deps and dw.id < nrm.id
    # Replayed, the all-reduce is in flight while the dW matmul runs.
    from sim.engine import replay
    from sim.hardware import get_chip
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=(2, 4))
    ops = replay(trace, chip, topo).ops.set_index("op_id")
    assert ops.loc[ar.id, "start_s"] < ops.loc[dw.id, "end_s"]
    assert ops.loc[dw.id, "start_s"] < ops.loc[ar.id, "end_s"]
    (pw,) = [o for o in trace.ops if o.name == "attn_proj_bwd_weights" and o.layer == 1]
    (px,) = [o for o in trace.ops if o.name == "attn_proj_bwd" and o.layer == 1]
    assert pw.flops == px.flops
    end = [o for o in trace.ops if o.name == "norm_attn_bwd" and o.layer == 1][0]
    assert {dw.id, pw.id} <= set(end.deps)


def test_blocking_data_parallel_all_reduce_holds_the_next_layer():
    chips = 8
    model = model_from_dict(SMALL)
    for mode in ("async", "blocking"):
        trace = compile_training_step(model, parse_mesh("fsdp=4", "data=2"), chips,
                                      TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                     remat=Remat.FULL, dp_allreduce=mode))
        (ar,) = [o for o in trace.ops if o.name == "dp_grad_allreduce" and o.layer == 1]
        nxt = [o for o in trace.ops if o.layer == 0 and ar.id in o.deps
               and o.kind != "collective"]
        assert bool(nxt) == (mode == "blocking")


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_each_dcn_message_costs_its_overhead_once_per_step(algorithm):
    from sim.engine import collective_groups, cost_collective
    from sim.hardware import get_chip
    from topologies.slices import resolve_topology
    from workloads.trace import Op, OpKind, Trace

    slices = 4
    base = get_chip("v5e").with_overrides(dcn_message_overhead_s=0.0)
    topo = resolve_topology(chip_name="v5e", wrap_rule=base.generation_rule,
                            max_pod_shape=base.max_pod_shape, shape=(2, 2), num_slices=slices)
    mesh = parse_mesh("fsdp=4", f"data={slices}")
    tr = Trace(mesh=mesh, ops=(Op(id=0, name="x", kind=OpKind.COLLECTIVE,
                                  collective="all-reduce", mesh_axes=("data",), bytes=4e6),))
    g = collective_groups(tr, topo)["data"]
    o = 1e-3
    t0 = cost_collective(base, topo, "all-reduce", g, 4e6, algorithm).time_s
    t1 = cost_collective(base.with_overrides(dcn_message_overhead_s=o), topo, "all-reduce", g,
                         4e6, algorithm).time_s
    # A ring all-reduce: 2 (N - 1) steps of one message; direct: 2 steps of N - 1 messages.
    assert t1 - t0 == pytest.approx(2 * (slices - 1) * o, rel=1e-9)
