"""Non-matmul work costed from bytes and dtypes (docs/model.md "Training steps"): the MLP
activation and norms as fusions of their own, the scanned stack's copy of each layer input, dot
attention's f32 scores, a windowed einsum's per-step operand reads and partial sums, and the
accumulators of a windowed gradient reduce-scatter."""

from __future__ import annotations

import pytest

from topologies.mesh import parse_mesh
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

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


N_TOK, D, F, HD = 2 * 128, 64, 128, 16  # tokens per chip (2 sequences of 128), TINY's widths
Q, KV = 4 * HD, 2 * HD  # query and key/value widths (4 heads, 2 KV heads)


@pytest.mark.parametrize("chips", [4, 256])
def test_a_contracted_windowed_einsum_reads_its_input_once_and_moves_its_output_every_step(
        chips):
    # q, k, v and gate, up contract the FSDP-sharded d_model: each pair of ring steps reads
    # its two slices of the normed input (once in all) and the partial sum moves one output's
    # worth of HBM traffic per step (XLA's loop in HBM: a pair's product written, read back
    # with the partial sum, their sum written): W + input + N x output.
    win = _ops(f"fsdp={chips}", chips, gather="windowed")
    qkv_out = N_TOK * (Q + 2 * KV) * A
    assert win[("qkv_proj", 0, "fwd")].hbm_bytes == \
        D * (Q + 2 * KV) * A + N_TOK * D * A + chips * qkv_out
    assert win[("mlp_in", 0, "fwd")].hbm_bytes == \
        2 * D * F * A + N_TOK * D * A + chips * 2 * N_TOK * F * A
    # Plain (prefetched) gathers: the matmul reads and writes each once.
    plain = _ops(f"fsdp={chips}", chips)
    assert plain[("qkv_proj", 0, "fwd")].hbm_bytes == \
        D * (Q + 2 * KV) * A + N_TOK * D * A + qkv_out


@pytest.mark.parametrize("chips", [4, 256])
def test_an_output_gathered_windowed_einsum_reads_its_input_whole_for_every_pair_of_steps(
        chips):
    # o and down gather the output's d_model: each matmul of the bidirectional ring computes
    # the two shards that arrived from either side from the whole input (N / 2 reads) and
    # writes their slices in place (the output once).
    win = _ops(f"fsdp={chips}", chips, gather="windowed")
    assert win[("mlp_out", 0, "fwd")].hbm_bytes == \
        F * D * A + chips // 2 * N_TOK * F * A + N_TOK * D * A
    assert win[("out_proj", 0, "fwd")].hbm_bytes == \
        Q * D * A + chips // 2 * N_TOK * Q * A + N_TOK * D * A


@pytest.mark.parametrize("chips", [4, 256])
def test_windowed_backward_matmuls_read_the_unsharded_operands_for_every_pair_of_steps(chips):
    # Input gradients: gate, up (q, k, v) read their outputs' gradients whole per pair of steps;
    # down (o) contracts d_model and moves its output per step. Weight gradients (a windowed
    # reduce-scatter): every [tokens, d_ff] ([tokens, heads]) operand whole per pair of steps.
    plain, win = _ops(f"fsdp={chips}", chips), _ops(f"fsdp={chips}", chips, gather="windowed")
    pairs, steps = chips // 2 - 1, chips - 1  # extra reads and output moves over plain
    extra = {"mlp_bwd": pairs * 2 * N_TOK * F * A + steps * N_TOK * F * A,
             "mlp_bwd_weights": pairs * 3 * N_TOK * F * A,
             "attn_proj_bwd": pairs * N_TOK * (Q + 2 * KV) * A + steps * N_TOK * Q * A,
             "attn_proj_bwd_weights": pairs * N_TOK * (2 * Q + 2 * KV) * A}
    for name, more in extra.items():
        key = (name, 0, "bwd")
        assert win[key].hbm_bytes - plain[key].hbm_bytes == pytest.approx(more, rel=1e-12)


def test_a_merged_backward_matmul_counts_only_its_windowed_matrices():
    # mixed-blocking under remat full: in the backward only the down projection's gather is
    # windowed (its recomputation is dead), so the merged MLP input-gradient matmul moves the
    # down projection's summed output per step and reads gate's and up's gradients once; the
    # attention's gathers are plain; every gradient reduce-scatter is a windowed ring.
    plain, mixed = _ops("fsdp=4", 4), _ops("fsdp=4", 4, gather="mixed-blocking")
    diff = {k[0]: mixed[k].hbm_bytes - plain[k].hbm_bytes for k in plain if k[1] == 0}
    assert diff["mlp_bwd"] == 3 * N_TOK * F * A
    assert diff["attn_proj_bwd"] == 0
    assert diff["mlp_bwd_weights"] == 1 * 3 * N_TOK * F * A


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
