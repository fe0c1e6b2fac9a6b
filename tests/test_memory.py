"""HBM occupancy of training steps: saved activations per remat policy, tensor by tensor, the
loss's temporaries, gradients as backward temporaries, and the peak's composition."""

from __future__ import annotations

import json

import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.engine.replay import replay
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.memory import (
    LayerShapeSpec,
    attention_backward_score_buffers,
    attention_temporaries,
    deferred_head_gradient_bytes,
    loss_tensors,
    loss_value_logits_bytes,
    offloaded_tensors,
    one_sequence_per_chip,
    saved_tensors,
    windowed_head_gradient_bytes,
)
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

# One SwiGLU layer's per-chip widths: 100 tokens, context 50, d_model 8, 2 local heads of 4
# (q width 8), one KV head of 4, d_ff 16.
SHAPE = LayerShapeSpec(rows=100, residual_rows=100, context=50, d_model=8, q_width=8,
                       kv_width=4, local_heads=2, ff_width=16, mlp_matrices=3,
                       parallel_block=False)


def _bytes(tensors) -> float:
    return sum(t.num_bytes for t in tensors)


def test_full_remat_keeps_only_the_bf16_layer_input():
    (t,) = saved_tensors(SHAPE, remat="full", attention="dot")
    assert (t.name, t.num_bytes) == ("layer_input", 2 * 100 * 8)


def test_minimal_remat_keeps_the_weight_matmul_outputs_the_backward_reads():
    got = saved_tensors(SHAPE, remat="minimal", attention="dot")
    # layer input 8 + q 8 + k 4 + v 4 + attention out-projection 8 + gate and up 2 x 16 = 64
    # bf16 values per token; no attention probabilities (a dot with batch dims) and no MLP
    # output projection (only the layer output reads it).
    assert _bytes(got) == 2 * 100 * 64
    assert [t.name for t in got] == ["layer_input", "q", "k", "v", "attn_out_proj",
                                     "mlp_hidden"]


def test_a_parallel_blocks_minimal_set_has_no_output_projection():
    par = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                            "parallel_block": True})
    # No mid residual to rebuild: the attention's projection feeds only the layer output.
    assert _bytes(saved_tensors(par, remat="minimal", attention="dot")) == 2 * 100 * (64 - 8)


@pytest.mark.parametrize("attention", ["dot", "flash"])
def test_a_fused_backward_reads_the_bf16_set(attention):
    got = {t.name: t for t in saved_tensors(SHAPE, remat="none", attention=attention,
                                            stacked=False)}
    # bf16 per token: input 8, normed 8, q 8, k 4, v 4, context 8, mid residual 8, normed 8,
    # gate and up 32, activation output 16 = 104; f32 norm statistics 2 per token.
    common = 2 * 100 * 104 + 4 * 100 * 2
    if attention == "dot":
        # bf16 probabilities: 100 queries x 50 keys x 2 heads.
        assert got["attn_probs"].num_bytes == 2 * 100 * 50 * 2
        assert _bytes(got.values()) == common + 2 * 100 * 50 * 2
    else:
        # flash keeps an f32 log-sum-exp per query and head instead.
        assert got["attn_logsumexp"].num_bytes == 4 * 100 * 2
        assert _bytes(got.values()) == common + 4 * 100 * 2


@pytest.mark.parametrize("attention", ["dot", "flash"])
def test_a_scanned_stack_also_keeps_f32_softmax_norm_rows_and_activation_terms(attention):
    fused = _bytes(saved_tensors(SHAPE, remat="none", attention=attention, stacked=False))
    got = {t.name: t.num_bytes for t in saved_tensors(SHAPE, remat="none",
                                                      attention=attention)}
    # Per norm: its f32 input and f32 normalised rows (2 x 100 rows x 8 x 4 bytes); SwiGLU:
    # two derivative terms and the gated product (3 x 100 x 16 bf16); dot attention: the f32
    # softmax output (100 x 50 x 2 heads x 4 bytes).
    assert got["norm_attn_f32"] == got["norm_mlp_f32"] == 2 * 100 * 8 * 4
    assert got["mlp_act_terms"] + got["mlp_gated_product"] == 3 * 100 * 16 * 2
    extra = 2 * (2 * 100 * 8 * 4) + 3 * 100 * 16 * 2
    if attention == "dot":
        assert got["attn_probs_f32"] == 4 * 100 * 50 * 2
        extra += 4 * 100 * 50 * 2
    assert sum(got.values()) == fused + extra


def test_parallel_block_has_no_mid_residual_or_second_norm():
    par = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                            "parallel_block": True})
    names = {t.name for t in saved_tensors(par, remat="none", attention="flash")}
    assert not names & {"residual_mid", "norm_mlp_out", "norm_mlp_stats"}


def test_sharded_activations_divide_only_the_residual_stream_by_tensor():
    sharded = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                                "residual_rows": 25})
    full = {t.name: t.num_bytes for t in saved_tensors(SHAPE, remat="none", attention="dot")}
    part = {t.name: t.num_bytes for t in saved_tensors(sharded, remat="none", attention="dot")}
    for name in ("layer_input", "residual_mid", "norm_attn_stats", "norm_mlp_stats",
                 "norm_attn_f32", "norm_mlp_f32"):
        assert part[name] == full[name] / 4
    for name in ("norm_attn_out", "q", "attn_probs", "mlp_hidden"):  # gathered matmul inputs
        assert part[name] == full[name]


def test_minimal_keeps_the_output_projection_as_the_residual_stream_holds_it():
    # Sharded over `tensor` (residual rows 25 of 100): the attention's output projection is
    # kept after its reduce-scatter, [tokens / tensor, d_model], like the layer input;
    # replicated (Megatron) it is whole.
    sharded = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                                "residual_rows": 25})
    got = {t.name: t.num_bytes for t in saved_tensors(sharded, remat="minimal",
                                                      attention="dot")}
    assert got["attn_out_proj"] == got["layer_input"] == 2 * 25 * 8
    assert {t.name: t.num_bytes for t in saved_tensors(SHAPE, remat="minimal",
                                                       attention="dot")}["attn_out_proj"] \
        == 2 * 100 * 8


# A GPT-3-shaped layer small enough to compile in a blink: d_model 1024, 16 heads of 64 (MHA),
# GeLU d_ff 4096, 2 layers.
TP_MODEL = {"name": "tp-saved", "num_layers": 2, "d_model": 1024, "num_heads": 16,
            "num_kv_heads": 16, "head_dim": 64, "d_ff": 4096, "mlp": "gelu",
            "vocab_size": 4096}


@pytest.mark.parametrize("mesh,chips", [("fsdp=2,tensor=8", 16), ("fsdp=4,tensor=4", 16),
                                        ("sequence=2,tensor=8", 16), ("tensor=4", 4)])
def test_saved_minimal_activations_are_divided_by_every_axis_that_shards_them(mesh, chips):
    # MaxText's sharding of the saved tensors (activation_embed, heads and mlp on `tensor`,
    # the batch on data x fsdp, the length on `sequence`): per chip and layer, with T the
    # tokens of a data shard (batch/chip x chips / (data x fsdp) x seq / sequence):
    # layer input T/tp x D, q, k, v T x 3 H/tp x hd, attention output projection T/tp x D,
    # GeLU hidden T x F/tp, all bf16. The activation peak is the layers' sum.
    axes = dict(kv.split("=") for kv in mesh.split(","))
    tp, sp = int(axes.get("tensor", 1)), int(axes.get("sequence", 1))
    fs = int(axes.get("fsdp", 1))
    seq, batch = 1024, 2
    T = batch * chips / fs * seq / sp
    D, H, hd, F = 1024, 16, 64, 4096
    per_layer = 2 * (T / tp * D + T * 3 * H / tp * hd + T / tp * D + T * F / tp)
    from workloads.training import estimate_training_memory
    got = estimate_training_memory(model_from_dict(TP_MODEL), parse_mesh(mesh), chips,
                                   TrainingConfig(seq_len=seq, batch_per_chip=batch,
                                                  remat=Remat.MINIMAL, attention="flash"))
    assert got["activations_bytes"] == pytest.approx(2 * per_layer, rel=1e-12)


def test_offload_sends_the_minimal_set_except_the_layer_input_to_the_host():
    host = offloaded_tensors(SHAPE, attention="dot")
    assert _bytes(host) == _bytes(saved_tensors(SHAPE, remat="minimal", attention="dot")) \
        - 2 * 100 * 8


def test_loss_holds_f32_logits_and_bf16_gradients():
    assert _bytes(loss_tensors(rows=10, local_vocab=32)) == 10 * 32 * (4 + 2)


# -- whole steps -------------------------------------------------------------------------------

HEAVY_HEAD = {"name": "heavy-head", "num_layers": 3, "d_model": 128, "num_heads": 2,
              "num_kv_heads": 2, "head_dim": 64, "d_ff": 256, "mlp": "swiglu",
              "vocab_size": 32768}


def _run(remat, mesh="fsdp=1", shape="1x1"):
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    model = model_from_dict(HEAVY_HEAD)
    cfg = TrainingConfig(seq_len=128, batch_per_chip=2, remat=remat, attention="dot")
    trace = compile_training_step(model, parse_mesh(mesh), topo.num_chips, cfg)
    return trace, replay(trace, chip, topo)


def test_a_big_vocabulary_puts_the_peak_at_the_loss_with_every_layer_input_saved():
    trace, res = _run(Remat.FULL)
    n, D, V, L = 2 * 128, 128, 32768, 3
    sb = trace.meta.static_breakdown
    assert res.hbm_peak_breakdown == pytest.approx({
        "params": sb["params"], "optimizer": sb["optimizer"],
        "saved_activations": L * 2 * n * D,
        "logits": n * V * (4 + 2),
    }, rel=1e-12)
    assert res.hbm_peak_bytes == pytest.approx(sum(res.hbm_peak_breakdown.values()), rel=1e-12)


def test_gradients_are_temporaries_that_all_exist_at_the_update_and_then_die():
    trace, res = _run(Remat.FULL)
    grads = res.memory.gradients
    assert grads.iloc[0] == 0 and grads.iloc[-1] == pytest.approx(0, abs=1e-6)
    assert grads.max() == pytest.approx(trace.meta.static_breakdown["grads"], rel=1e-12)
    assert res.memory.hbm_bytes.iloc[-1] == pytest.approx(trace.meta.static_hbm_bytes)


def test_fsdp_holds_the_gathered_output_projection_at_the_loss():
    _, res = _run(Remat.FULL, mesh="fsdp=4", shape="2x2")
    # The bf16 [d_model, vocab] output projection gathered over fsdp (tensor = 1).
    assert res.hbm_peak_breakdown["gathered_weights"] >= 2 * 128 * 32768


def test_train_json_reports_the_peak_breakdown(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(HEAVY_HEAD))
    rc = main(["train", "--chip", "v5e", "--shape", "1x1", "--model", str(path), "--seq-len",
               "128", "--batch-per-chip", "2", "--mesh", "fsdp=1", "--attention", "dot",
               "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert sum(s["hbm_peak_breakdown"].values()) == pytest.approx(s["hbm_peak_bytes"], rel=1e-12)
    assert set(s["hbm_peak_breakdown"]) == {"params", "optimizer", "saved_activations", "logits"}
    assert s["memory"]["saved_activations_per_layer"] == {"layer_input": 2 * 256 * 128}


# -- dot attention's working buffers and when saved tensors appear ------------------------------

LONG_CONTEXT = {"name": "long-ctx", "num_layers": 2, "d_model": 64, "num_heads": 4,
                "num_kv_heads": 2, "head_dim": 16, "d_ff": 128, "mlp": "swiglu",
                "vocab_size": 256}


def _long(remat, mesh="fsdp=1", shape="1x1", gather="windowed", fused=False,
          tp_act="sharded", chip="v5e", batch=2, loss_after_backward=False,
          mlp_grad_after_attention=False, fsdp_grad="reduce-scatter"):
    chip = get_chip(chip)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    cfg = TrainingConfig(seq_len=1024, batch_per_chip=batch, remat=remat, attention="dot",
                         fsdp_gather=gather, score_exp_fusion=fused, tp_activations=tp_act,
                         score_grad_fusion=chip.score_grad_fusion,
                         bwd_probs_buffer=chip.bwd_probs_buffer,
                         loss_after_backward=loss_after_backward,
                         mlp_grad_after_attention=mlp_grad_after_attention,
                         fsdp_grad=fsdp_grad)
    trace = compile_training_step(model_from_dict(LONG_CONTEXT), parse_mesh(mesh),
                                  topo.num_chips, cfg)
    return trace, replay(trace, chip, topo)


def test_dot_attention_holds_f32_scores_and_bf16_probabilities():
    # 2 sequences x 1024 queries x 1024 keys x 3 local heads: 4 + 2 bytes per score.
    assert attention_temporaries(rows=2048, context=1024, local_heads=3) == \
        6 * 2048 * 1024 * 3
    # f32 probabilities (the forward of minimal / offload): 4 + 4 bytes.
    assert attention_temporaries(rows=2048, context=1024, local_heads=3, probs_bytes=4) == \
        8 * 2048 * 1024 * 3


def test_a_score_matmul_fused_with_the_exponentials_writes_no_f32_scores():
    # v6e: the f32 exponentials are the only f32 buffer; the value matmul reads them under
    # minimal / offload (4 bytes per score), bf16 probabilities are still written from them
    # under none / full (4 + 2, as unfused).
    kw = dict(rows=2048, context=1024, local_heads=3, score_exp_fusion=True)
    assert attention_temporaries(**kw, probs_bytes=4) == 4 * 2048 * 1024 * 3
    assert attention_temporaries(**kw, probs_bytes=2) == 6 * 2048 * 1024 * 3


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("remat,fwd_bytes", [(Remat.MINIMAL, 8), (Remat.OFFLOAD, 8),
                                             (Remat.FULL, 4), (Remat.NONE, 6)])
def test_the_forward_softmax_writes_f32_probabilities_under_minimal_and_offload(remat,
                                                                               fwd_bytes,
                                                                               fused):
    # One chip, 32 MiB of f32 scores: under full the forward fuses the score matmul with the
    # exponentials whatever the chip (fsdp=16 full programs of v5e and v5p) and the value
    # matmul reads them (nothing saves the probabilities): 4 bytes per score.
    trace, _ = _long(remat, fused=fused)
    if fused and fwd_bytes == 8:
        fwd_bytes = 4  # the exponentials the fused score matmul writes are the probabilities
    scores = 2048 * 1024 * 4  # tokens x context x heads
    got = {(trace.ops[i].phase, trace.ops[i].name): delta
           for i, cat, delta in trace.meta.memory_events
           if cat == "temporaries" and trace.ops[i].name.endswith("attn_scores")
           and trace.ops[i].layer == 0}
    assert got[("fwd", "attn_scores")] == fwd_bytes * scores
    if remat == Remat.FULL:  # the recomputation writes bf16 scores, no f32 buffer
        assert got[("bwd", "re-attn_scores")] == 2 * scores


@pytest.mark.parametrize("mesh,shape,tokens,heads", [("fsdp=1", "1x1", 2048, 4),
                                                     ("fsdp=2,tensor=2", "2x2", 4096, 2)])
def test_full_remat_peaks_at_the_first_layers_score_gradient(mesh, shape, tokens, heads):
    # v5e (the XLA programs' peak under full: the attention backward's probability gradient).
    trace, res = _long(Remat.FULL, mesh, shape)
    sb = trace.meta.static_breakdown
    D, q, kv = 64, heads * 16, max(2 / (4 // heads), 1) * 16
    # Both layer inputs (the residual stream: rows / tensor when sharded), plus what the
    # recomputation wrote that the attention's backward still reads: the normed input (all
    # rows, gathered), its f32 statistics, q, k, v, the bf16 scores and the context (the
    # MLP's recomputed tensors died with its weight gradient).
    rows = tokens / (4 // heads)
    scores = tokens * 1024 * heads
    saved = 2 * 2 * rows * D + 2 * tokens * D + 4 * rows + 2 * tokens * (q + 2 * kv)
    saved += 2 * scores + 2 * tokens * q
    saved += 2 * rows * D  # the backward's copy of layer 0's input out of the stack
    # v5e's second score-sized buffer (the probability gradient), next to the layer's three
    # activation gradients.
    temps = 2 * scores + 2 * (rows + 2 * tokens) * D
    assert res.hbm_peak_breakdown["temporaries"] == temps
    assert res.hbm_peak_breakdown["saved_activations"] == pytest.approx(saved, rel=1e-12)
    # The stack holds both layer inputs to the end, so the last backward (layer 0's) peaks
    # highest: next to layer 1's gradient shard.
    grad1 = sum(delta for i, cat, delta in trace.meta.memory_events
                if cat == "gradients" and trace.ops[i].layer == 1)
    assert res.hbm_peak_breakdown["gradients"] == grad1 > 0
    # With fsdp, layer 0's attention matrices gathered whole for its backward (split over
    # tensor; the MLP's died with its weight gradient).
    tp = 4 // heads
    gathered = 0 if mesh == "fsdp=1" else 2 * (2 * 64 * 64 + 2 * 64 * 32) / tp
    assert res.hbm_peak_breakdown.get("gathered_weights", 0) == gathered
    # fsdp x tensor with sharded activations: the bf16 logits (tokens x vocab / tensor) and
    # the final norm's output (rows / tensor) held for the deferred output-projection gradient.
    logits = 0 if mesh == "fsdp=1" else 2 * (tokens * 256 / tp + rows * D)
    assert res.hbm_peak_breakdown.get("logits", 0) == logits
    assert res.hbm_peak_bytes == pytest.approx(
        sb["params"] + sb["optimizer"] + saved + temps + grad1 + gathered + logits, rel=1e-12)


def test_the_attention_backward_holds_two_to_four_score_sized_buffers_by_chip_and_policy():
    # none: the probabilities from the stack, their gradient and the score gradient.
    for flags in ({}, {"score_grad_fusion": True}, {"bwd_probs_buffer": True}):
        assert attention_backward_score_buffers(remat="none", **flags) == 3
    for remat in ("full", "minimal", "offload"):
        # Recomputed scores and the probability gradient (v5e: the score gradient is fused
        # into the dQ and dK matmuls), plus the score gradient (v6e).
        assert attention_backward_score_buffers(remat=remat, score_grad_fusion=True) == 2
        assert attention_backward_score_buffers(remat=remat) == 3
    # v5p: plus the probabilities when the policy keeps the projections.
    assert attention_backward_score_buffers(remat="full", bwd_probs_buffer=True) == 3
    for remat in ("minimal", "offload"):
        assert attention_backward_score_buffers(remat=remat, bwd_probs_buffer=True) == 4


@pytest.mark.parametrize("chip,remat,buffers", [
    ("v5e", Remat.FULL, 2), ("v6e", Remat.FULL, 3), ("v5p", Remat.FULL, 3),
    ("v5p", Remat.MINIMAL, 4), ("v5p", Remat.OFFLOAD, 4), ("v5e", Remat.NONE, 3)])
def test_each_chips_attention_backward_adds_its_score_buffers_at_the_probability_gradient(
        chip, remat, buffers):
    trace, _ = _long(remat, chip=chip)
    scores = 2048 * 1024 * 4  # tokens x context x heads, bf16
    got = [(trace.ops[i].name, delta) for i, cat, delta in trace.meta.memory_events
           if cat == "temporaries" and trace.ops[i].layer == 0
           and trace.ops[i].name in ("attn_proj_bwd", "softmax_bwd")]
    # One buffer (the recomputed or saved probabilities) is counted with the layer's
    # activations; the others live from the dP matmul to the score gradient's readers.
    # v5p under full also wrote the probabilities in its recomputation (from the softmax);
    # they die at the probability-gradient matmul, before the score gradient.
    probs = 2 * scores if (chip, remat) == ("v5p", Remat.FULL) else 0
    assert got == [("attn_proj_bwd", (buffers - 1) * 2 * scores - probs),
                   ("softmax_bwd", -(buffers - 1) * 2 * scores)]
    held = [delta for i, cat, delta in trace.meta.memory_events
            if cat == "temporaries" and trace.ops[i].layer == 0
            and trace.ops[i].name == "re-softmax"]
    assert sum(held) == (probs - 2 * scores if remat == Remat.FULL else 0)


def _mlp_side_freed_at_its_weight_gradient(trace, remat) -> tuple[float, float]:
    """(bytes layer 0's MLP weight-gradient matmul frees, the MLP's recomputed tensors) of a
    `_long` step: 2048 tokens per chip, d_model 64, d_ff 128 (whole on the chip). The mid
    residual, the MLP norm's bf16 output and f32 statistics, the gate/up outputs and the
    activation's output; under minimal the gate/up outputs and the attention output projection
    are the copies of the stack entries."""
    rows, D, F = 2048, 64, 128
    got = sum(delta for i, cat, delta in trace.meta.memory_events
              if cat == "saved_activations" and trace.ops[i].layer == 0
              and trace.ops[i].name == "mlp_bwd_weights")
    side = 2 * rows * D + 4 * rows + 2 * rows * D + 2 * 2 * rows * F + 2 * rows * F
    if remat == Remat.MINIMAL:
        side += 2 * rows * D
    return got, side


@pytest.mark.parametrize("remat", [Remat.FULL, Remat.MINIMAL, Remat.OFFLOAD])
def test_the_mlps_recomputed_tensors_die_with_its_weight_gradient_under_full_and_minimal(remat):
    trace, _ = _long(remat)
    got, side = _mlp_side_freed_at_its_weight_gradient(trace, remat)
    assert got == (0.0 if remat == Remat.OFFLOAD else -side)  # under offload they live on


def test_a_scanned_stack_holds_every_layers_saved_set_from_the_first_forward_to_the_last_backward():
    trace, res = _long(Remat.NONE)
    ops = trace.ops
    saved = [(ops[i], delta) for i, cat, delta in trace.meta.memory_events
             if cat == "saved_activations"]
    stack = 2 * sum(t.num_bytes for t in _none_set())  # two layers
    # One allocation before the first layer's forward, one free after layer 0's backward.
    assert [(op.layer, op.phase, delta) for op, delta in saved] == [
        (-1, "fwd", stack), (0, "bwd", -stack)]
    # The first layer's attention already sees both layers' stacks.
    level = res.memory.saved_activations
    assert level.max() == pytest.approx(stack, rel=1e-12)


def test_a_recomputed_layer_frees_only_what_it_recomputed():
    trace, _ = _long(Remat.MINIMAL)
    events = [(trace.ops[i], delta) for i, cat, delta in trace.meta.memory_events
              if cat == "saved_activations"]
    kept = 2 * sum(t.num_bytes for t in _minimal_set())  # both layers' minimal sets
    # The stack is allocated once before the forward and freed once after the last backward;
    # in between each layer's backward allocates its recomputation and its copy of the
    # layer's stack entries and frees exactly that: the copy is allocated as the layer above's
    # backward (the loss's, for the last layer) ends.
    assert events[0][1] == kept and events[-1][1] == -kept
    per_layer: dict[int, float] = {}
    for op, delta in events[1:-1]:
        assert op.phase == "bwd"
        per_layer[op.layer] = per_layer.get(op.layer, 0.0) + delta
    copy = kept / 2
    assert per_layer == {-1: copy, 1: 0.0, 0: -copy}


LONG_SHAPE = LayerShapeSpec(rows=2048, residual_rows=2048, context=1024, d_model=64,
                            q_width=64, kv_width=32, local_heads=4, ff_width=128,
                            mlp_matrices=3, parallel_block=False)


def _none_set():
    return saved_tensors(LONG_SHAPE, remat="none", attention="dot")


def _minimal_set():
    return saved_tensors(LONG_SHAPE, remat="minimal", attention="dot")


def test_windowed_gathers_hold_whole_layer_weights_only_in_the_backward():
    trace, windowed = _long(Remat.FULL, "fsdp=4", "2x2", gather="windowed")
    _, prefetched = _long(Remat.FULL, "fsdp=4", "2x2", gather="async")
    # The forward gathers only the output projection whole (bf16 [d_model, vocab]) for the
    # logits; the backward gathers a layer's bf16 matrices whole: q, o 64 x 64, k, v 64 x 32,
    # gate, up, down 64 x 128.
    layer = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    by_phase: dict[str, list[float]] = {}
    bwd_by_layer: dict[int, float] = {}  # one gather per matrix: summed per layer
    for i, cat, delta in trace.meta.memory_events:
        if cat == "gathered_weights":
            by_phase.setdefault(trace.ops[i].phase, []).append(delta)
            if trace.ops[i].phase == "bwd" and delta > 0:
                bwd_by_layer[trace.ops[i].layer] = bwd_by_layer.get(trace.ops[i].layer, 0) + delta
    assert by_phase["fwd"] == [2 * 64 * 256]
    assert list(bwd_by_layer.values()) == [layer, layer]
    assert sum(by_phase["fwd"]) + sum(by_phase["bwd"]) == 0
    assert windowed.memory.gathered_weights.max() < prefetched.memory.gathered_weights.max()


def test_a_layers_backward_holds_three_activation_gradients():
    # fsdp=2 x tensor=2, sharded activations: 4 sequences x 1024 tokens per chip; the residual
    # stream's gradient has half of the rows (rows / tensor).
    trace, _ = _long(Remat.FULL, "fsdp=2,tensor=2", "2x2")
    n, D = 4096, 64
    got = [delta for op_id, cat, delta in trace.meta.memory_events
           if cat == "temporaries" and trace.ops[op_id].phase == "bwd"
           and not trace.ops[op_id].name.endswith(("attn_scores", "softmax", "attn_values",
                                                   "attn_proj_bwd", "softmax_bwd"))]
    assert got[0] == 2 * (n / 2 + 2 * n) * D
    assert sum(got) == 0 and len(got) == 2 * 2  # allocated and freed once per layer


def test_a_deferred_head_gradient_holds_bf16_logits_and_the_final_norm_output():
    # 100 tokens, d_model 8, 32 local logits: (32 + 8) x 2 bytes per token.
    kw = dict(rows=100, d_model=8, local_vocab=32)
    rep = dict(tp_activations="replicated")
    for remat in ("full", "minimal"):
        assert deferred_head_gradient_bytes(**kw, **rep, tensor=2, fsdp=2, remat=remat) == \
            100 * (32 + 8) * 2
    # Only split over tensor and sharded over fsdp; with replicated activations a policy that
    # recomputes without offloading (v5p's `none` and `offload` programs free them first).
    assert deferred_head_gradient_bytes(**kw, **rep, tensor=2, fsdp=2, remat="offload") == 0
    assert deferred_head_gradient_bytes(**kw, **rep, tensor=1, fsdp=2, remat="full") == 0
    assert deferred_head_gradient_bytes(**kw, **rep, tensor=2, fsdp=1, remat="full") == 0
    assert deferred_head_gradient_bytes(**kw, **rep, tensor=2, fsdp=2, remat="none") == 0
    # With activations sharded over tensor under none too (v5e fsdp x tensor none and full);
    # the final norm's output has the residual stream's rows (50 here).
    sh = dict(tp_activations="sharded", tensor=2, fsdp=2, residual_rows=50)
    for remat in ("none", "full", "minimal"):
        assert deferred_head_gradient_bytes(**kw, **sh, remat=remat) == (100 * 32 + 50 * 8) * 2
    assert deferred_head_gradient_bytes(**kw, **sh, remat="offload") == 0


def test_flash_attention_defers_the_logits_path_only_with_async_or_windowed_gathers():
    # The splash programs on fsdp x tensor: v6e and v5p (blocking gathers) free the bf16
    # logits before the backward loop, v5e (async) keeps them; dot attention keeps them with
    # either form.
    kw = dict(rows=100, d_model=8, local_vocab=32, tensor=2, fsdp=2, remat="full")
    kept = 100 * (32 + 8) * 2
    rep = dict(tp_activations="replicated")
    assert deferred_head_gradient_bytes(**kw, **rep, attention="flash", gather="blocking") == 0
    for gather in ("async", "windowed"):
        assert deferred_head_gradient_bytes(**kw, **rep, attention="flash",
                                            gather=gather) == kept
    assert deferred_head_gradient_bytes(**kw, **rep, attention="dot", gather="blocking") == kept
    # Sharded activations: no flash program compiled, deferred as with dot attention.
    assert deferred_head_gradient_bytes(**kw, tp_activations="sharded", attention="flash",
                                        gather="blocking", residual_rows=50) == \
        (100 * 32 + 50 * 8) * 2


@pytest.mark.parametrize("gather", ["blocking", "async"])
@pytest.mark.parametrize("tp_act", ["replicated", "sharded"])
def test_fsdp_x_tensor_keeps_the_logits_path_through_the_backward(
        gather, tp_act):
    trace, res = _long(Remat.FULL, "fsdp=2,tensor=2", "2x2", gather=gather, tp_act=tp_act)
    n, D, V = 4096, 64, 256  # tokens per chip (tensor shards see all), d_model, vocab
    ops = trace.ops
    logits = [(ops[i], delta) for i, cat, delta in trace.meta.memory_events
              if cat == "logits"]
    # The gather form does not decide it (v5p blocking, v5e async programs both keep it);
    # with sharded activations the final norm's output has rows / tensor.
    held = n * (V / 2 + D) * 2 if tp_act == "replicated" else (n * V / 2 + n / 2 * D) * 2
    # f32 logits and bf16 gradients at the loss; `held` of it outlives the logits' backward
    # matmul until the last layer's backward has ended.
    assert [(op.name, delta) for op, delta in logits][:2] == [
        ("logits", n * V / 2 * 6), ("logits_bwd", -n * V / 2 * 6 + held)]
    assert sum(delta for _, delta in logits) == 0
    if held:
        assert logits[-1][0].layer == 0 and logits[-1][0].phase == "bwd"
    assert res.memory.logits.max() == n * V / 2 * 6


def test_a_cast_weights_windowed_head_gradient_holds_the_logit_gradients_and_norm_output():
    # 100 tokens, d_model 8, 32 local logits: (32 + 8) x 2 bytes per token.
    kw = dict(rows=100, d_model=8, local_vocab=32, tensor=1, fsdp=4)
    on = dict(windowed=True, cast_weights=True, chip_defers=True)
    assert windowed_head_gradient_bytes(**kw, **on) == 100 * (32 + 8) * 2
    assert windowed_head_gradient_bytes(**kw, **on, residual_rows=50) == (100 * 32 + 50 * 8) * 2
    # Each condition is needed: the chip's rule (v6e), a windowed ring, weights cast before
    # their gathers (bf16 weights: the ring runs before the loop), fsdp without tensor (with
    # tensor deferred_head_gradient_bytes decides), no vocab tiling.
    for off in ("windowed", "cast_weights", "chip_defers"):
        assert windowed_head_gradient_bytes(**kw, **{**on, off: False}) == 0
    assert windowed_head_gradient_bytes(**{**kw, "tensor": 2}, **on) == 0
    assert windowed_head_gradient_bytes(**{**kw, "fsdp": 1}, **on) == 0
    assert windowed_head_gradient_bytes(**kw, **on, vocab_tiling=4) == 0
    # With bf16 weights an offloading remat policy defers the ring too (v6e's `offload`
    # programs), still only on the chip whose compiler does so.
    bf16 = {**on, "cast_weights": False}
    assert windowed_head_gradient_bytes(**kw, **bf16, offload=True) == 100 * (32 + 8) * 2
    assert windowed_head_gradient_bytes(**kw, **{**bf16, "chip_defers": False},
                                        offload=True) == 0


def test_flash_attention_with_one_sequence_on_v5e_defers_the_windowed_head_gradient():
    # The splash programs on v5e fsdp=16 with one sequence per chip keep the bf16 logit
    # gradients through the backward loop with bf16 weights (their dot twin does not):
    # `flash_one_sequence` stands for the chip's own v6e rule there.
    kw = dict(rows=100, d_model=8, local_vocab=32, tensor=1, fsdp=4, cast_weights=False,
              chip_defers=False)
    assert windowed_head_gradient_bytes(**kw, windowed=True, flash_one_sequence=True) == \
        100 * (32 + 8) * 2
    assert windowed_head_gradient_bytes(**kw, windowed=True) == 0
    # Still a windowed ring over fsdp alone, without vocab tiling.
    assert windowed_head_gradient_bytes(**kw, windowed=False, flash_one_sequence=True) == 0
    assert windowed_head_gradient_bytes(**{**kw, "tensor": 2}, windowed=True,
                                        flash_one_sequence=True) == 0
    assert windowed_head_gradient_bytes(**kw, windowed=True, flash_one_sequence=True,
                                        vocab_tiling=2) == 0


@pytest.mark.parametrize("chip,params,kept", [("v6e", "fp32", True), ("v6e", "bf16", False),
                                              ("v5e", "fp32", False)])
def test_v6e_keeps_the_logit_gradients_through_the_backward_with_cast_weights(
        tmp_path, chip, params, kept):
    from sim import api

    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(LONG_CONTEXT))
    run = api.train(chip=chip, shape="2x2", model=str(path), seq_len=1024, batch_per_chip=2,
                    mesh="fsdp=4", remat="full", attention="dot", fsdp_gather="windowed",
                    param_dtype=params, gather_dtype="bf16")
    assert run.inputs["training"]["head_grad_after_backward"] is (chip == "v6e")
    n, D, V = 2048, 64, 256  # tokens per chip, d_model, vocab (whole: no tensor axis)
    ops = run.trace.ops
    logits = [(ops[i], d) for i, cat, d in run.trace.meta.memory_events if cat == "logits"]
    held = n * (V + D) * 2 if kept else 0.0  # bf16 logit gradients + final norm output
    # f32 logits and bf16 gradients at the loss; `held` of them until the last layer's
    # backward has ended.
    assert [(op.name, d) for op, d in logits][:2] == [("logits", n * V * 6),
                                                       ("logits_bwd", -n * V * 6 + held)]
    assert sum(d for _, d in logits) == 0
    if kept:
        assert logits[-1][0].layer == 0 and logits[-1][0].phase == "bwd"


@pytest.mark.parametrize("gather", ["windowed", "async"])
def test_windowed_mlp_outputs_are_allocated_at_the_start_of_the_layer(gather):
    trace, _ = _long(Remat.FULL, "fsdp=4", "2x2", gather=gather)
    ops = trace.ops
    got = [(ops[i].name, delta) for i, cat, delta in trace.meta.memory_events
           if cat == "temporaries" and ops[i].phase == "fwd" and ops[i].layer == 0
           and not ops[i].name.startswith(("attn_", "softmax"))]
    # 2 sequences x 1024 tokens per chip x d_ff 128, gate and up in bf16: from the layer's
    # first op (its norm, before the attention) to the activation that reads them.
    buf = 2 * 2048 * 128 * 2
    assert got == ([("norm_attn", buf), ("mlp_act", -buf)] if gather == "windowed" else [])


def test_the_chip_sets_whether_the_trace_fuses_scores_with_exponentials(tmp_path):
    from sim import api

    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(LONG_CONTEXT))
    # Windowed gathers: with plain ones v5e fuses on one fsdp axis too.
    flags = dict(shape="2x2", model=str(path), seq_len=1024, batch_per_chip=2,
                 mesh="fsdp=4", remat="minimal", attention="dot", fsdp_gather="windowed")
    scores = 2048 * 1024 * 4  # tokens x context x heads per chip

    def fwd_scores(run):
        return [d for i, cat, d in run.trace.meta.memory_events
                if cat == "temporaries" and run.trace.ops[i].name == "attn_scores"]

    v5e, v6e = api.train(chip="v5e", **flags), api.train(chip="v6e", **flags)
    what_if = api.train(chip="v5e", set={"score_exp_fusion": "true"}, **flags)
    assert (v5e.inputs["training"]["score_exp_fusion"],
            v6e.inputs["training"]["score_exp_fusion"]) == (False, True)
    assert fwd_scores(v5e) == [8 * scores] * 2
    assert fwd_scores(v6e) == fwd_scores(what_if) == [4 * scores] * 2


def test_v5e_and_v5p_fuse_scores_with_exponentials_only_on_a_mesh_of_two_sharded_axes():
    from workloads.memory import score_exp_fused

    mib = 2**20
    assert [score_exp_fused(chip_fuses=False, sharded_axes=k, score_bytes=512 * mib)
            for k in (0, 1, 2, 3)] == [False, False, True, True]
    # Not with more than 512 MiB of f32 scores per chip (v5p fsdp x tensor at seq 4096).
    assert not score_exp_fused(chip_fuses=False, sharded_axes=2, score_bytes=1024 * mib)
    assert all(score_exp_fused(chip_fuses=True, sharded_axes=k, score_bytes=1024 * mib)
               for k in (0, 1, 2))
    # fsdp=2 x tensor=2: 4 sequences x 1024 tokens x 1024 keys x 2 local heads per chip; the
    # forward of minimal holds only the f32 exponentials.
    trace, _ = _long(Remat.MINIMAL, "fsdp=2,tensor=2", "2x2")
    got = [d for i, cat, d in trace.meta.memory_events
           if cat == "temporaries" and trace.ops[i].name == "attn_scores"]
    assert got == [4 * 4096 * 1024 * 2] * 2


def test_one_fsdp_axis_fuses_scores_with_exponentials_when_no_gather_is_windowed():
    from workloads.memory import score_exp_fused

    # One sharded axis: fused when the forward's weight gathers are plain (XLA's fsdp=64
    # programs on v5e and v5p), not when they are windowed einsums (its fsdp=16 programs).
    assert score_exp_fused(chip_fuses=False, sharded_axes=1, score_bytes=512 * 2**20,
                           remat="minimal", plain_fsdp=True)
    assert not score_exp_fused(chip_fuses=False, sharded_axes=1, score_bytes=512 * 2**20,
                               remat="minimal")
    # 2 sequences x 1024 queries x 1024 keys x 4 heads per chip, v5e, minimal: the forward
    # writes only the f32 exponentials (4 bytes a score) when XLA's mixed mode gathers plainly
    # (over 64 chips), the f32 scores and exponentials (8) when it windows (over 16).
    scores = 2048 * 1024 * 4
    for mesh, shape, per_score in (("fsdp=64", "8x8", 4), ("fsdp=16", "4x4", 8),
                                   ("fsdp=1", "1x1", 8)):
        trace, _ = _long(Remat.MINIMAL, mesh, shape, gather="mixed-async")
        (got,) = [d for i, cat, d in trace.meta.memory_events
                  if cat == "temporaries" and trace.ops[i].name == "attn_scores"
                  and trace.ops[i].layer == 0]
        assert got == per_score * scores


def test_score_exp_fusion_is_true_or_false_in_a_chip_file(tmp_path):
    from sim.chips import chip_from_dict

    assert chip_from_dict({"base": "v5e", "score_exp_fusion": True}).score_exp_fusion is True
    with pytest.raises(TpusimError, match="score_exp_fusion = 'yes' must be true or false"):
        chip_from_dict({"base": "v5e", "score_exp_fusion": "yes"})
    with pytest.raises(TpusimError, match="score_exp_fusion 'yes' must be true or false"):
        TrainingConfig(seq_len=128, batch_per_chip=1, score_exp_fusion="yes")
    with pytest.raises(TpusimError, match="^set score_exp_fusion=maybe: write true or false"):
        from sim.overrides import parse_overrides

        parse_overrides(["score_exp_fusion=maybe"])


def test_offloaded_tensors_stay_on_device_through_the_next_layers_forward():
    trace, _ = _long(Remat.OFFLOAD)
    ops = trace.ops
    fwd: dict[int, list[float]] = {}
    for i, cat, delta in trace.meta.memory_events:
        if cat == "saved_activations" and ops[i].phase == "fwd":
            fwd.setdefault(ops[i].layer, []).append(delta)
    inputs = 2 * 2 * 2048 * 64  # both layers' bf16 inputs, the stack offload keeps in HBM
    sent = sum(t.num_bytes for t in offloaded_tensors(LONG_SHAPE, attention="dot"))
    # q, k, v, the attention output projection and the gate/up outputs, each from its matmul;
    # layer 0's die as layer 1 ends, layer 1's as the loop ends (with its last op). After the
    # final norm the top layer's set is back (the backward's first fetch, program order).
    assert fwd[-1] == [inputs, sent]
    assert sum(d for d in fwd[0] if d > 0) == sum(d for d in fwd[1] if d > 0) == sent
    assert sum(fwd[0]) == sent and sum(fwd[1]) == -sent
    # At layer 1's scores: the stack, layer 0's whole set and layer 1's q, k, v.
    at = [i for i, op in enumerate(ops) if op.name == "attn_scores" and op.layer == 1][0]
    live = sum(delta for i, cat, delta in trace.meta.memory_events
               if cat == "saved_activations" and i <= at)
    assert live == inputs + sent + 2 * 2048 * (64 + 2 * 32)


def test_fetched_activations_are_allocated_in_program_order_not_when_the_pcie_copy_lands():
    import dataclasses

    trace, res = _long(Remat.OFFLOAD)
    ops = trace.ops
    sent = sum(t.num_bytes for t in offloaded_tensors(LONG_SHAPE, attention="dot"))
    # 2048 tokens x (q 64 + k 32 + v 32 + output projection 64 + gate/up 2 x 128) in bf16.
    assert sent == 2 * 2048 * (64 + 2 * 32 + 64 + 2 * 128)
    fetched = [(ops[i], d) for i, cat, d in trace.meta.memory_events
               if cat == "saved_activations" and d == sent
               and not (ops[i].phase == "fwd" and ops[i].layer >= 0)]
    # One set per layer, none on a PCIe op: the top layer's (1) as the final norm ends (XLA
    # copies it back into the buffers its forward's copy to host released), layer 0's as the
    # backward of the layer above ends, on the op that frees that layer's own fetched set.
    assert [(op.name, op.layer) for op, _ in fetched] == [("final_norm", -1),
                                                          (fetched[1][0].name, 1)]
    end_of_1 = fetched[1][0].id
    assert any(i == end_of_1 and cat == "saved_activations" and d < 0
               for i, cat, d in trace.meta.memory_events)
    assert all(op.kind.value != "host" for op, _ in fetched)
    # So the peak does not depend on when the PCIe transfers land: 1000x slower or faster
    # host links move the step time, not the peak.
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="1x1")
    peaks, steps = set(), set()
    for scale in (0.01, 1.0, 100.0):
        r = replay(trace, dataclasses.replace(chip, pcie_bytes_per_s=chip.pcie_bytes_per_s
                                              * scale), topo)
        peaks.add(r.hbm_peak_bytes)
        steps.add(r.step_time_s)
    assert peaks == {res.hbm_peak_bytes} and len(steps) == 3


@pytest.mark.parametrize("remat", [Remat.MINIMAL, Remat.FULL, Remat.OFFLOAD, Remat.NONE])
def test_a_recomputing_backward_copies_its_layers_stack_entries(remat):
    trace, _ = _long(remat)
    ops = trace.ops
    # The last layer's copy of its stack entries (its whole saved set: the minimal set, or the
    # layer input under full and offload) appears as the loss's backward ends; `none` reads
    # its stack in place.
    copy = 0.0 if remat == Remat.NONE else sum(
        t.num_bytes for t in saved_tensors(LONG_SHAPE, remat=str(remat), attention="dot"))
    loss_bwd = [i for i, op in enumerate(ops) if op.name == "logits_bwd"][0]
    got = sum(d for i, cat, d in trace.meta.memory_events
              if cat == "saved_activations" and i == loss_bwd)
    assert got == copy
    assert copy == {"minimal": 2 * 2048 * (64 + 64 + 2 * 32 + 64 + 2 * 128),
                    "full": 2 * 2048 * 64, "offload": 2 * 2048 * 64, "none": 0}[str(remat)]


def test_the_mlps_gathered_matrices_die_with_their_weight_gradient_matmul():
    trace, _ = _long(Remat.FULL, "fsdp=4", "2x2", gather="async")
    ops = trace.ops
    frees = {ops[i].name: -d for i, cat, d in trace.meta.memory_events
             if cat == "gathered_weights" and d < 0 and ops[i].phase == "bwd"
             and ops[i].layer == 0}
    # gate, up, down 64 x 128 bf16 at the MLP's weight gradient; q, o 64 x 64 and k, v 64 x 32
    # with the layer's end.
    assert frees == {"mlp_bwd_weights": 2 * 3 * 64 * 128,
                     "norm_attn_bwd": 2 * (2 * 64 * 64 + 2 * 64 * 32)}


# -- whole gradients under synchronous all-reduces ----------------------------------------------

# LONG_CONTEXT's weight matrices in bf16: q and o 64 x 64, k and v 64 x 32, gate, up and down
# 64 x 128 (one layer: 2 x (2 x 4096 + 2 x 2048 + 3 x 8192) = 73,728 bytes).
_WHOLE = {"wq": 2 * 64 * 64, "wo": 2 * 64 * 64, "wk": 2 * 64 * 32, "wv": 2 * 64 * 32,
          "w_gate": 2 * 64 * 128, "w_up": 2 * 64 * 128, "w_down": 2 * 64 * 128}


def test_a_gradient_all_reduced_whole_lives_from_its_weight_gradient_matmul_to_its_all_reduce():
    # fsdp=64: longer than XLA's windowed rings, so the mixed mode all-reduces every gradient
    # whole (the v5p fsdp=64 and v6e fsdp=256 programs of validation/xla_memory.py).
    trace, _ = _long(Remat.FULL, "fsdp=64", "8x8", gather="mixed-blocking")
    ops = trace.ops
    allocs: dict[str, float] = {}
    frees: dict[str, tuple[str, float]] = {}
    for i, cat, delta in trace.meta.memory_events:
        if cat != "whole_gradients" or ops[i].layer != 0:
            continue
        if delta > 0:
            allocs[ops[i].name] = allocs.get(ops[i].name, 0.0) + delta
        else:
            frees[ops[i].name] = (ops[i].collective, -delta)
    # The MLP's three at its weight-gradient matmul; o and v before the score gradient (their
    # weight gradients need none); q and k after it.
    assert allocs == {"mlp_bwd_weights": 3 * 2 * 64 * 128,
                      "attn_proj_bwd": _WHOLE["wo"] + _WHOLE["wv"],
                      "attn_proj_bwd_weights": _WHOLE["wq"] + _WHOLE["wk"]}
    # Each dies when its own all-reduce (of V = the whole gradient) has read it.
    assert frees == {f"fsdp_grad_allreduce_{k}": ("all-reduce", v) for k, v in _WHOLE.items()}
    assert all(ops[i].bytes == _WHOLE[ops[i].name.removeprefix("fsdp_grad_allreduce_")]
               for i, cat, d in trace.meta.memory_events
               if cat == "whole_gradients" and d < 0)


def test_a_gradient_of_64_mib_or_more_is_all_reduced_alone_and_not_held():
    # d_model 2048, d_ff 16384: each MLP matrix's bf16 gradient is 64 MiB, all-reduced alone
    # right after its matmul (XLA's 128 and 448 MiB ones at LLaMA-3-70B widths), while q, o
    # (8 MiB) and k, v (4 MiB) wait for the layer's combined all-reduce (its 32 MiB ones at
    # d_model 2048, d_ff 8192).
    wide = model_from_dict({**LONG_CONTEXT, "d_model": 2048, "num_heads": 16,
                            "num_kv_heads": 8, "head_dim": 128, "d_ff": 16384,
                            "vocab_size": 4096})
    trace = compile_training_step(wide, parse_mesh("fsdp=64"), 64,
                                  TrainingConfig(seq_len=128, batch_per_chip=1,
                                                 fsdp_gather="mixed-blocking"))
    ops = trace.ops
    held = {}
    for i, cat, d in trace.meta.memory_events:
        if cat == "whole_gradients" and d > 0 and ops[i].layer == 0:
            held[ops[i].name] = held.get(ops[i].name, 0) + d
    assert held == {"attn_proj_bwd": 2 * (2048 * 2048 + 2048 * 1024),
                    "attn_proj_bwd_weights": 2 * (2048 * 2048 + 2048 * 1024)}
    # ... though every matrix's gradient is still all-reduced whole.
    assert {o.name for o in ops if o.layer == 0 and o.name.startswith("fsdp_grad_")} == {
        f"fsdp_grad_allreduce_{k}" for k in _WHOLE}


@pytest.mark.parametrize("gather,grad", [("blocking", "all-reduce"), ("blocking", "auto"),
                                         ("mixed-blocking", "reduce-scatter")])
def test_the_peak_grows_by_the_whole_gradients_live_at_the_score_gradient(gather, grad):
    # Under full remat the step peaks at layer 0's score gradient: the MLP's three whole
    # gradients and the o and v projections' are live there (XLA's v5p fsdp=64 and v6e
    # fsdp=256 `full` programs hold exactly those: 96 + 8 + 4 MiB at d_model 2048, d_ff
    # 8192), q's and k's not yet.
    _, rs = _long(Remat.FULL, "fsdp=64", "8x8", gather="blocking")
    _, ar = _long(Remat.FULL, "fsdp=64", "8x8", gather=gather, fsdp_grad=grad)
    whole = sum(_WHOLE[k] for k in ("w_gate", "w_up", "w_down", "wo", "wv"))
    assert "whole_gradients" not in rs.hbm_peak_breakdown
    assert ar.hbm_peak_breakdown["whole_gradients"] == whole
    # The mixed mode also gathers q and k again for their input gradients (as XLA does).
    regathered = _WHOLE["wq"] + _WHOLE["wk"] if gather.startswith("mixed") else 0
    assert ar.hbm_peak_bytes - rs.hbm_peak_bytes == pytest.approx(whole + regathered,
                                                                  rel=1e-12)
    assert {k: v for k, v in ar.hbm_peak_breakdown.items()
            if k not in ("whole_gradients", "gathered_weights")} == \
        {k: v for k, v in rs.hbm_peak_breakdown.items() if k != "gathered_weights"}
    # Reduce-scattered gradients are never whole (a windowed ring over 16 chips, or a plain
    # reduce-scatter).
    for trace, _ in (_long(Remat.FULL, "fsdp=16", "4x4", gather="mixed-blocking"),
                     _long(Remat.FULL, "fsdp=64", "8x8", gather="blocking")):
        assert not any(c == "whole_gradients" for _, c, _ in trace.meta.memory_events)


@pytest.mark.parametrize("mesh,shape,gather,at", [
    ("fsdp=64", "8x8", "mixed-async", "residual_mlp"),  # plain gathers: before the logits
    ("fsdp=16", "4x4", "mixed-async", "fsdp_allgather_embed"),  # windowed: from the gather
    ("fsdp=4", "2x2", "async", "residual_mlp")])
def test_the_gathered_output_projection_is_held_from_the_forwards_end_unless_windowed(
        mesh, shape, gather, at):
    trace, _ = _long(Remat.FULL, mesh, shape, gather=gather)
    ops = trace.ops
    head = 2 * 64 * 256  # the bf16 [d_model, vocab] output projection, gathered whole
    (got,) = [(ops[i].name, ops[i].layer) for i, cat, d in trace.meta.memory_events
              if cat == "gathered_weights" and d == head]
    # The last layer's output (layer 1 of 2), or the gather at the step's start.
    assert got == (at, 1 if at == "residual_mlp" else -1)


def test_an_moe_layer_holds_whole_only_the_gradients_split_over_more_than_a_ring():
    # fsdp=16 x expert=4: attention and router split 64 ways (all-reduced whole), the routed
    # experts over fsdp=16 (reduced in windowed rings), as in the 750B MoE compile.
    moe = model_from_dict({**LONG_CONTEXT, "num_experts": 4, "experts_per_token": 2})
    trace = compile_training_step(moe, parse_mesh("fsdp=16,expert=4"), 64,
                                  TrainingConfig(seq_len=256, batch_per_chip=1,
                                                 fsdp_gather="mixed-blocking"))
    ops = trace.ops
    held = {ops[i].name: d for i, cat, d in trace.meta.memory_events
            if cat == "whole_gradients" and d < 0 and ops[i].layer == 0}
    router = 2 * 64 * 4  # d_model x experts, bf16
    assert held == {**{f"fsdp_grad_allreduce_{k}": -_WHOLE[k] for k in ("wq", "wk", "wv", "wo")},
                    "fsdp_grad_allreduce_router": -router}
    (alloc,) = [ops[i].name for i, cat, d in trace.meta.memory_events
                if cat == "whole_gradients" and d == router and ops[i].layer == 0]
    assert alloc == "router_bwd"


# -- one sequence per chip ---------------------------------------------------------------------

def test_one_sequence_per_chip_keeps_bf16_scores_and_on_v5e_the_f32_logits():
    assert [one_sequence_per_chip(sequences_per_chip=s) for s in (1, 2, 0.5, 4)] == \
        [True, False, False, False]
    # 1024 queries x 1024 keys x 3 local heads: the bf16 scores only, whatever the policy's
    # probabilities or the chip's fusion.
    for probs_bytes in (2.0, 4.0):
        for fused in (False, True):
            assert attention_temporaries(rows=1024, context=1024, local_heads=3,
                                         probs_bytes=probs_bytes, score_exp_fusion=fused,
                                         bf16_scores=True) == \
                (2 if probs_bytes == 2 else 4) * 1024 * 1024 * 3
    # 100 tokens x 32 local logits in f32, only when the chip defers the loss value, the chip
    # holds one sequence and the vocabulary is not tiled.
    kw = dict(rows=100, local_vocab=32)
    assert loss_value_logits_bytes(**kw, sequences_per_chip=1, chip_defers=True) == \
        4 * 100 * 32
    assert loss_value_logits_bytes(**kw, sequences_per_chip=2, chip_defers=True) == 0
    assert loss_value_logits_bytes(**kw, sequences_per_chip=1, chip_defers=False) == 0
    assert loss_value_logits_bytes(**kw, sequences_per_chip=1, chip_defers=True,
                                   vocab_tiling=2) == 0
    # A vocabulary split over tensor all-reduces the target logits at the loss.
    assert loss_value_logits_bytes(**kw, sequences_per_chip=1, chip_defers=True,
                                   tensor=2) == 0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("remat", [Remat.NONE, Remat.FULL, Remat.MINIMAL, Remat.OFFLOAD])
def test_a_forward_with_one_sequence_per_chip_holds_only_the_bf16_scores(remat, fused):
    # One chip, one sequence of 1024 tokens, 4 heads: 2 bytes per score at the score matmul
    # (the value matmul reads them), against 4 to 8 with two sequences.
    trace, _ = _long(remat, fused=fused, batch=1)
    scores = 1024 * 1024 * 4
    got = [(trace.ops[i].name, delta) for i, cat, delta in trace.meta.memory_events
           if cat == "temporaries" and trace.ops[i].phase == "fwd" and trace.ops[i].layer == 0
           and trace.ops[i].name in ("attn_scores", "softmax", "attn_values")]
    if remat == Remat.NONE:  # the probabilities are saved from the softmax on
        assert got == [("attn_scores", 2 * scores), ("softmax", -2 * scores)]
    else:
        assert got == [("attn_scores", 2 * scores), ("attn_values", -2 * scores)]


@pytest.mark.parametrize("batch,defers,held", [(1, True, True), (1, False, False),
                                               (2, True, False)])
def test_v5e_keeps_the_f32_logits_of_one_sequence_per_chip_to_the_end_of_the_backward(
        batch, defers, held):
    trace, res = _long(Remat.FULL, batch=batch, loss_after_backward=defers)
    n, V = 1024 * batch, 256
    ops = trace.ops
    logits = [(ops[i], delta) for i, cat, delta in trace.meta.memory_events
              if cat == "logits"]
    kept = 4 * n * V if held else 0
    # 6 bytes per logit at the loss; the f32 4 of them outlive the logits' backward matmul
    # until the last layer's backward (layer 0) has ended.
    assert [(op.name, delta) for op, delta in logits][:2] == [
        ("logits", 6 * n * V), ("logits_bwd", -6 * n * V + kept)]
    assert sum(delta for _, delta in logits) == 0
    if held:
        assert logits[-1][0].layer == 0 and logits[-1][0].phase == "bwd"
        assert logits[-1][1] == -kept
        # The first layer's backward (layer 1) sees them.
        assert res.memory.logits.iloc[-1] == 0 and res.memory.logits.max() == 6 * n * V


@pytest.mark.parametrize("gather,dies", [("windowed", False), ("async", True)])
@pytest.mark.parametrize("remat", [Remat.FULL, Remat.MINIMAL])
def test_v5e_keeps_a_windowed_mlps_recomputed_tensors_through_the_attention_backward(
        remat, gather, dies):
    trace, _ = _long(remat, "fsdp=4", "2x2", gather=gather, mlp_grad_after_attention=True)
    got, side = _mlp_side_freed_at_its_weight_gradient(trace, remat)  # fsdp: whole widths
    assert got == (-side if dies else 0.0)


def test_the_chip_sets_the_one_sequence_logits_and_the_windowed_mlp_rules(tmp_path):
    from sim import api

    assert [(get_chip(c).loss_after_backward, get_chip(c).mlp_grad_after_attention)
            for c in ("v5e", "v5p", "v6e")] == [(True, True), (False, False), (False, False)]
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(LONG_CONTEXT))
    flags = dict(shape="2x2", model=str(path), seq_len=1024, batch_per_chip=1,
                 mesh="fsdp=4", remat="full", attention="dot")
    v5e, v6e = api.train(chip="v5e", **flags), api.train(chip="v6e", **flags)
    what_if = api.train(chip="v5e", set={"loss_after_backward": "false"}, **flags)
    for run, kept in ((v5e, True), (v6e, False), (what_if, False)):
        training = run.inputs["training"]
        assert training["loss_after_backward"] is kept
        assert training["mlp_grad_after_attention"] is (run is not v6e)
        # 1024 tokens x 256 logits in f32 held by the logits' backward matmul, or none.
        got = [d for i, cat, d in run.trace.meta.memory_events
               if cat == "logits" and run.trace.ops[i].name == "logits_bwd"]
        assert got == [-6 * 1024 * 256 + (4 * 1024 * 256 if kept else 0)]


# -- rules pinned on their own (docs/model.md "Memory") -----------------------------------------

def _compile(remat, *, model=LONG_CONTEXT, mesh="fsdp=1", chips=1, **cfg):
    """A LONG_CONTEXT-style step compiled (not replayed): 2 sequences of 1024 tokens per chip."""
    config = {"seq_len": 1024, "batch_per_chip": 2, "remat": remat, "attention": "dot", **cfg}
    return compile_training_step(model_from_dict(model), parse_mesh(mesh), chips,
                                 TrainingConfig(**config))


@pytest.mark.parametrize("remat", [Remat.NONE, Remat.MINIMAL, Remat.FULL])
def test_flash_attention_holds_no_score_sized_temporaries(remat):
    # Flash keeps its scores in VMEM: the only working buffers of the step are each layer's
    # three [tokens, d_model] bf16 activation gradients (2048 tokens, d_model 64, one chip).
    trace = _compile(remat, attention="flash")
    ops = trace.ops
    temps = [(ops[i].name, ops[i].layer, d) for i, cat, d in trace.meta.memory_events
             if cat == "temporaries"]
    grads = 3 * 2048 * 64 * 2
    assert sorted(d for _, _, d in temps) == [-grads, -grads, grads, grads]
    assert all(not name.startswith(("attn_", "softmax", "flash")) for name, _, _ in temps)
    # Dot attention on the same step adds its score buffers (4 heads x 2048 x 1024 scores).
    dot = _compile(remat)
    assert max(d for _, cat, d in dot.meta.memory_events if cat == "temporaries") \
        >= 2 * 2048 * 1024 * 4


@pytest.mark.parametrize("mlp,extra", [
    # ReLU: a one-byte mask of the activation's input (JAX's relu JVP selects on x > 0), no
    # gated product; GELU: its two bf16 derivative terms, no gated product; SwiGLU: the two
    # terms and the gated product the down projection reads.
    ("relu", {"mlp_act_mask": 1 * 100 * 16}),
    ("gelu", {"mlp_act_terms": 2 * 2 * 100 * 16}),
    ("swiglu", {"mlp_act_terms": 2 * 2 * 100 * 16, "mlp_gated_product": 2 * 100 * 16}),
])
def test_a_scanned_stack_keeps_the_activations_derivative_terms_by_mlp_kind(mlp, extra):
    matrices = 3 if mlp == "swiglu" else 2
    shape = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                              "mlp_kind": mlp, "mlp_matrices": matrices})
    stacked = {t.name: t.num_bytes for t in saved_tensors(shape, remat="none", attention="dot")}
    fused = {t.name: t.num_bytes for t in saved_tensors(shape, remat="none", attention="dot",
                                                        stacked=False)}
    mlp_terms = {k: v for k, v in stacked.items() if k.startswith("mlp_act_") and k not in fused}
    mlp_terms.update({k: v for k, v in stacked.items() if k == "mlp_gated_product"})
    assert mlp_terms == extra
    # The hidden output: gate and up (2 x 100 x 16 bf16) when gated, the up projection alone
    # otherwise.
    assert stacked["mlp_hidden"] == 2 * (matrices - 1) * 100 * 16


def test_an_moe_layer_keeps_its_router_logits_in_f32_unless_it_recomputes_the_layer():
    # 100 tokens x 4 routed experts, f32 (the router matmul writes f32 logits that the top-k
    # softmax's backward reads): kept by none and minimal (a dot without batch dimensions),
    # not by full.
    moe = LayerShapeSpec(**{**{f: getattr(SHAPE, f) for f in SHAPE.__slots__},
                            "num_experts": 4})
    for remat in ("none", "minimal"):
        got = {t.name: t for t in saved_tensors(moe, remat=remat, attention="dot")}
        assert got["router_logits"].num_bytes == 4 * 100 * 4
        assert got["router_logits"].producer == "router"
        dense = saved_tensors(SHAPE, remat=remat, attention="dot")
        assert _bytes(got.values()) - _bytes(dense) == 4 * 100 * 4
    assert {t.name for t in saved_tensors(moe, remat="full", attention="dot")} == {"layer_input"}


@pytest.mark.parametrize("variant,freed", [("dense", True), ("parallel", False), ("moe", False)])
def test_only_a_dense_sequential_layer_frees_its_mlp_tensors_at_the_mlp_weight_gradient(
        variant, freed):
    # Under full remat a dense sequential layer's MLP-side tensors die with the MLP's
    # weight-gradient matmul (XLA's v6e programs); MoE layers and parallel blocks keep theirs
    # to the end of the layer's backward (not compiled; tpusim keeps them).
    model = {**LONG_CONTEXT, **({"parallel_block": True} if variant == "parallel" else {}),
             **({"num_experts": 4, "experts_per_token": 2} if variant == "moe" else {})}
    trace = _compile(Remat.FULL, model=model)
    ops = trace.ops
    at_dw = sum(d for i, cat, d in trace.meta.memory_events
                if cat == "saved_activations" and ops[i].layer == 0
                and ops[i].name == "mlp_bwd_weights")
    if freed:
        # mid residual, MLP norm output (bf16) and statistics (f32), gate/up and activation
        # outputs: 2048 tokens, d_model 64, d_ff 128.
        assert at_dw == -(2 * 2048 * 64 * 2 + 4 * 2048 + 2 * 2048 * 128 * 3)
    else:
        assert at_dw == 0


def test_the_embeddings_all_reduced_gradient_holds_no_whole_gradient_buffer():
    # fsdp=64 (mixed mode: every gradient all-reduced whole, the output projection's too):
    # only the layers' weight gradients are held whole; the embedding's reduction is one
    # collective at the end of the step and holds none.
    trace = _compile(Remat.FULL, mesh="fsdp=64", chips=64, fsdp_gather="mixed-blocking")
    ops = trace.ops
    (embed,) = [o for o in ops if o.name == "fsdp_grad_allreduce_embed"]
    assert embed.collective == "all-reduce" and embed.bytes == 2 * 64 * 256
    whole = [(ops[i].layer, d) for i, cat, d in trace.meta.memory_events
             if cat == "whole_gradients"]
    assert whole and all(layer >= 0 for layer, _ in whole)
    assert sum(d for _, d in whole) == 0
    assert sum(d for _, d in whole if d > 0) == 2 * sum(_WHOLE.values())  # two layers


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_local_gradient_shards_are_allocated_once_at_their_reduce_scatters(microbatches):
    # fsdp=4: each layer's gradient shard (its seven matrices / 4, bf16) appears when the
    # layer's last reduce-scatter ends, in the first microbatch only; the embedding and norm
    # gradients (the rest of the local shard) with the embedding's; all die at the update.
    trace = _compile(Remat.FULL, mesh="fsdp=4", chips=4, microbatches=microbatches)
    ops = trace.ops
    allocs = [(ops[i].name, d) for i, cat, d in trace.meta.memory_events
              if cat == "gradients" and d > 0]
    layer = sum(_WHOLE.values()) / 4
    assert [name for name, _ in allocs] == ["fsdp_grad_reducescatter_w_down"] * 2 + [
        "fsdp_grad_reducescatter_embed"]
    assert [d for _, d in allocs[:2]] == [layer, layer]
    p = trace.meta.params_per_chip
    assert sum(d for _, d in allocs) == pytest.approx(2 * p, rel=1e-12)
    frees = [(ops[i].name, d) for i, cat, d in trace.meta.memory_events
             if cat == "gradients" and d < 0]
    assert frees == [("adam_update", pytest.approx(-2 * p, rel=1e-12))]


@pytest.mark.parametrize("gather,layers_held", [("async", 2), ("blocking", 1)])
def test_prefetched_gathers_hold_two_layers_of_weights_in_the_forward_blocking_ones_one(
        gather, layers_held):
    # 4 layers, fsdp=4: an async gather of layer L + 1 is issued as layer L starts and lands
    # while it runs (its weights and layer L's are live until layer L ends); a blocking one
    # waits for layer L's end, when layer L's gathered weights die.
    model = {**LONG_CONTEXT, "num_layers": 4}
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2")
    trace = _compile(Remat.FULL, model=model, mesh="fsdp=4", chips=4, fsdp_gather=gather)
    res = replay(trace, chip, topo)
    ops = res.ops
    (logits_start,) = ops[ops.name == "logits"].start_s
    fwd = res.memory[res.memory.time_s < logits_start]
    assert fwd.gathered_weights.max() == layers_held * sum(_WHOLE.values())


@pytest.mark.parametrize("remat,names", [
    (Remat.QKV_OFFLOAD, ("layer_input", "q", "k", "v")),
    (Remat.QKVO_OFFLOAD, ("layer_input", "q", "k", "v", "attn_out_proj"))])
def test_the_custom_offload_policies_fetch_their_sets_in_program_order_too(remat, names):
    # Nothing stays in HBM between a layer's forward and its backward; the fetched set (the
    # layer input and q, k, v, plus the output projection under qkvo: 2048 tokens, bf16) is
    # allocated as the final norm ends (top layer) and as the layer above's backward ends,
    # never on a PCIe op, as under `offload`.
    trace = _compile(remat)
    ops = trace.ops
    widths = {"layer_input": 64, "q": 64, "k": 32, "v": 32, "attn_out_proj": 64}
    sent = 2 * 2048 * sum(widths[k] for k in names)
    assert sent == sum(t.num_bytes for t in offloaded_tensors(LONG_SHAPE, attention="dot",
                                                             remat=str(remat)))
    # (The recomputation's own allocations, at its `re-` ops, are left out: the MLP's hidden
    # output happens to be the qkvo set's size here.)
    fetched = [(ops[i].name, ops[i].layer) for i, cat, d in trace.meta.memory_events
               if cat == "saved_activations" and d == sent
               and not ops[i].name.startswith("re-")]
    assert fetched == [("final_norm", -1), ("norm_attn_bwd", 1)]
    assert all(ops[i].phase != "fwd" or ops[i].layer < 0
               for i, cat, _ in trace.meta.memory_events if cat == "saved_activations")
    assert sum(d for _, cat, d in trace.meta.memory_events if cat == "saved_activations") == 0


def test_every_fusing_condition_stops_at_512_mib_of_f32_scores():
    from workloads.memory import score_exp_fused

    mib = 2**20
    for kw in ({"sharded_axes": 2}, {"sharded_axes": 1, "remat": "full"},
               {"sharded_axes": 1, "plain_fsdp": True}):
        assert score_exp_fused(chip_fuses=False, score_bytes=512 * mib, **kw)
        assert not score_exp_fused(chip_fuses=False, score_bytes=512 * mib + 1, **kw)
    # v6e's compiler fuses whatever the size (never compiled above 512 MiB).
    assert score_exp_fused(chip_fuses=True, sharded_axes=1, score_bytes=4096 * mib)


@pytest.mark.parametrize("chip,kept", [("v6e", True), ("v5e", False)])
def test_v6e_keeps_the_logit_gradients_through_an_offloading_backward_with_bf16_weights(
        tmp_path, chip, kept):
    # The offload path of windowed_head_gradient_bytes, wired into the step: v6e's `offload`
    # programs (bf16 weights) run the output projection's gradient ring after the backward
    # loop; 2048 tokens x (256 logits + 64 final-norm columns) in bf16 stay until then.
    from sim import api

    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(LONG_CONTEXT))
    run = api.train(chip=chip, shape="2x2", model=str(path), seq_len=1024, batch_per_chip=2,
                    mesh="fsdp=4", remat="offload", attention="dot", fsdp_gather="windowed")
    ops = run.trace.ops
    logits = [(ops[i], d) for i, cat, d in run.trace.meta.memory_events if cat == "logits"]
    held = 2048 * (256 + 64) * 2 if kept else 0.0
    assert [(op.name, d) for op, d in logits][:2] == [("logits", 2048 * 256 * 6),
                                                       ("logits_bwd", -2048 * 256 * 6 + held)]
    assert sum(d for _, d in logits) == 0
