"""Non-matmul work costed from bytes and dtypes (docs/model.md "Training steps"): the MLP
activation and norms as fusions of their own, the scanned stack's copy of each layer input, dot
attention's f32 scores, a windowed einsum's per-step operand reads and the accumulators of a
windowed gradient reduce-scatter."""

from __future__ import annotations

import pytest

from topologies.mesh import parse_mesh
from workloads.models import model_from_dict
from workloads.training import Remat, TrainingConfig, compile_training_step

TINY = {"name": "tiny", "num_layers": 2, "d_model": 64, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "d_ff": 128, "mlp": "swiglu", "vocab_size": 256}
A = 2  # bf16


def _ops(mesh="fsdp=1", chips=1, remat=Remat.FULL, gather="async", attention="dot"):
    cfg = TrainingConfig(seq_len=128, batch_per_chip=2, remat=remat, attention=attention,
                         fsdp_gather=gather)
    trace = compile_training_step(model_from_dict(TINY), parse_mesh(mesh), chips, cfg)
    return {(o.name, o.layer, o.phase): o for o in trace.ops}


def test_the_swiglu_product_streams_through_hbm_forward_and_backward():
    ops = _ops()
    n, F = 2 * 128, 128
    # Forward reads gate and up and writes the product; backward reads both and the product's
    # gradient and writes their gradients.
    assert ops[("mlp_act", 0, "fwd")].hbm_bytes == 3 * n * F * A
    assert ops[("mlp_act_bwd", 0, "bwd")].hbm_bytes == 5 * n * F * A


def test_a_norm_reads_its_input_twice_and_the_stack_copies_the_layer_input():
    ops = _ops()
    r, D = 2 * 128, 64
    assert ops[("norm_mlp", 0, "fwd")].hbm_bytes == 3 * r * D * A
    assert ops[("norm_attn", 0, "fwd")].hbm_bytes == (3 + 2) * r * D * A
    assert ops[("re-norm_attn", 0, "bwd")].hbm_bytes == 3 * r * D * A  # nothing to stack


def test_dot_attention_writes_f32_scores():
    ops = _ops()
    n, ctx, heads, hd = 2 * 128, 128, 4, 16
    q, kv = n * heads * hd * A, n * 2 * hd * A  # the local sequences' K
    assert ops[("attn_scores", 0, "fwd")].hbm_bytes == q + kv + 4 * n * ctx * heads


def test_dot_attention_backward_recomputes_f32_scores_and_moves_12_bytes_per_score():
    ops = _ops()  # remat full: the backward recomputes the scores
    n, ctx, heads, hd = 2 * 128, 128, 4, 16
    scores = n * ctx * heads
    q, kv = n * heads * hd * A, n * 2 * hd * A
    assert ops[("re-attn_scores", 0, "bwd")].hbm_bytes == q + kv + 4 * scores
    # dP = dO V^T and the softmax backward read the probabilities, dP and write dS (bf16).
    dp = ops[("attn_bwd", 0, "bwd")].hbm_bytes - (2 * kv + 2 * q + 2 * kv)
    assert dp + ops[("softmax_bwd", 0, "bwd")].hbm_bytes == 12 * scores


@pytest.mark.parametrize("name,phase,operand", [
    ("qkv_proj", "fwd", 2 * 128 * 64 * A),  # the normed input
    ("mlp_out", "fwd", 2 * 128 * 128 * A),  # the gated product
    # dX and dW each read 1.5 d_ff-wide operands per matrix
    ("mlp_bwd", "bwd", 1.5 * 2 * 128 * 128 * 3 * A),
    ("mlp_bwd_weights", "bwd", 1.5 * 2 * 128 * 128 * 3 * A),
])
def test_a_windowed_einsum_rereads_its_operand_every_ring_step(name, phase, operand):
    # fsdp=4 on 4 chips: each chip holds 2 sequences (256 tokens); the ring has 4 steps.
    plain = _ops("fsdp=4", 4)[(name, 0, phase)].hbm_bytes
    windowed = _ops("fsdp=4", 4, gather="windowed")[(name, 0, phase)].hbm_bytes
    assert windowed - plain == pytest.approx(3 * operand, rel=1e-12)  # N - 1 more reads


@pytest.mark.parametrize("gather", ["windowed", "mixed-async", "mixed-blocking"])
def test_a_windowed_gradient_reduce_scatter_moves_four_times_its_matrices_through_accumulators(
        gather):
    # XLA's windowed_dot_general_body_rs loop: per ring step an add reads the arriving partial
    # sum and the step's partial product and writes the sum (3 shards), and a select zeroing
    # the two accumulators reads and writes each once per two steps (1 shard): 4 |W| in the
    # gradient dtype, a fusion of its own after the dW matmul, which the gradient waits for.
    D, F, V, Q, KV = 64, 128, 256, 4 * 16, 2 * 16
    ops = _ops("fsdp=4", 4, gather=gather)
    by_id = {o.id: o for o in ops.values()}
    for name, w in (("mlp_bwd_weights", 3 * D * F * A),
                    ("attn_proj_bwd_weights", (2 * D * Q + 2 * D * KV) * A)):
        acc = ops[(f"{name}_accum", 0, "bwd")]
        assert acc.unit == "vpu" and acc.hbm_bytes == 4 * w and acc.flops == w / A
        assert [by_id[i].name for i in acc.deps] == [name]
        nrm = ops[("norm_attn_bwd", 0, "bwd")]
        assert acc.id in nrm.deps
    head = ops[("logits_bwd_weights_accum", -1, "bwd")]
    assert head.hbm_bytes == 4 * V * D * A
    rs = ops[("fsdp_grad_reducescatter_embed", -1, "bwd")]
    assert head.id in rs.deps
    # Plain gradient reduce-scatters (async gathers) have no ring accumulators.
    assert not [k for k in _ops("fsdp=4", 4) if k[0].endswith("_accum")]
    # fp32 gradients: f32 accumulators, twice the bytes.
    cfg = TrainingConfig(seq_len=128, batch_per_chip=2, fsdp_gather=gather, grad_dtype="fp32")
    t32 = compile_training_step(model_from_dict(TINY), parse_mesh("fsdp=4"), 4, cfg)
    (h32,) = [o for o in t32.ops if o.name == "logits_bwd_weights_accum"]
    assert h32.hbm_bytes == 8 * V * D * A
