"""Non-matmul work costed from bytes and dtypes (docs/model.md "Training steps"): the MLP
activation and norms as fusions of their own, the scanned stack's copy of each layer input, dot
attention's f32 scores, and a windowed einsum's per-step operand reads and accumulator adds."""

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


@pytest.mark.parametrize("name,phase,operand,weights", [
    ("qkv_proj", "fwd", 2 * 128 * 64 * A, None),  # the normed input
    ("mlp_out", "fwd", 2 * 128 * 128 * A, None),  # the gated product
    # dX and dW each read 1.5 d_ff-wide operands per matrix; dW also reduce-scatters |W|
    ("mlp_bwd", "bwd", 1.5 * 2 * 128 * 128 * 3 * A, None),
    ("mlp_bwd_weights", "bwd", 1.5 * 2 * 128 * 128 * 3 * A, 3 * 64 * 128 * A),
])
def test_a_windowed_einsum_rereads_its_operand_every_ring_step(name, phase, operand, weights):
    # fsdp=4 on 4 chips: each chip holds 2 sequences (256 tokens); the ring has 4 steps.
    plain = _ops("fsdp=4", 4)[(name, 0, phase)].hbm_bytes
    windowed = _ops("fsdp=4", 4, gather="windowed")[(name, 0, phase)].hbm_bytes
    extra = 3 * operand  # N - 1 more reads of the activation operand
    if weights is not None:  # the gradient's reduce-scatter adds partial sums: 3 |W| (N-1)/N
        extra += 3 * weights * 3 / 4
    assert windowed - plain == pytest.approx(extra, rel=1e-12)
