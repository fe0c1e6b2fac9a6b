"""The logits path's dtype (`logits_dtype`, MaxText's `logits_dot_in_fp32`): under fp32 the
output projection's weight gradient is f32 (written, held and reduced over fsdp in f32) while
its gather, the logits and the logit gradients are as under bf16 and the dot's FLOPs and MXU
rate are bf16's (one pass at jax's default precision); bf16 (the default) is the model as
before. Closed forms on a tiny model."""

from __future__ import annotations

import json

import pytest

from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.trace import OpKind, Unit
from workloads.training import TrainingConfig, compile_training_step
from workloads.training.config import training_config_to_dict
from workloads.zoo import model_from_dict

# d_model 256, 8 heads of 32 (4 KV heads), d_ff 1024, 2 layers, vocab 512, untied.
MODEL = {"name": "logits-tiny", "num_layers": 2, "d_model": 256, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
         "tied_embeddings": False}
D, V = 256, 512
SEQ, BATCH = 512, 2
N = SEQ * BATCH  # tokens per chip


def _trace(logits_dtype="bf16", mesh="fsdp=2", chips=2, **kw):
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, logits_dtype=logits_dtype, **kw)
    return compile_training_step(model_from_dict(MODEL), parse_mesh(mesh), chips, cfg)


def _op(trace, name):
    (op,) = [o for o in trace.ops if o.name == name]
    return op


@pytest.mark.parametrize("form,hg", [("bf16", 2), ("fp32", 4)])
def test_the_output_projection_dot_and_its_backward_in_closed_form(form, hg):
    t = _trace(form)
    fwd, bwd = _op(t, "logits"), _op(t, "logits_bwd")
    # The same FLOPs at the same (bf16) MXU rate in either form.
    assert (fwd.flops, bwd.flops) == (2 * N * D * V, 4 * N * D * V)
    assert fwd.dtype == bwd.dtype == "bf16"
    w = V * D * 2  # the gathered projection, bf16 in either form (XLA rounds the operands)
    # Forward: the weight, the bf16 final-norm output, the f32 logits.
    assert fwd.hbm_bytes == w + N * D * 2 + N * V * 4
    # Backward: the weight twice, the bf16 logit gradients, the bf16 input gradient and the
    # weight gradient in the dot's result type (f32 under fp32).
    assert bwd.hbm_bytes == 2 * w + N * V * 2 + N * D * 2 + V * D * hg
    # The loss holds the f32 logits and bf16 logit gradients in either form.
    ev = {t.ops[i].name: delta for i, cat, delta in t.meta.memory_events if cat == "logits"}
    assert ev["logits"] == N * V * 6


@pytest.mark.parametrize("form,hg", [("bf16", 2), ("fp32", 4)])
def test_the_projection_gradient_is_reduced_in_f32_and_held_until_then(form, hg):
    t = _trace(form)
    # fsdp=2: the gather carries the whole [vocab, d_model] matrix in bf16 either way, the
    # reduce-scatter the whole gradient in the dot's result type.
    assert _op(t, "fsdp_allgather_embed").bytes == V * D * 2
    rs = _op(t, "fsdp_grad_reducescatter_embed")
    assert rs.bytes == V * D * hg
    # The f32 gradient's extra 2 bytes an element live from the backward dot to the
    # reduce-scatter (no windowed ring here: the whole matrix).
    grads = [(t.ops[i].name, d) for i, cat, d in t.meta.memory_events if cat == "gradients"
             and t.ops[i].name in ("logits_bwd", rs.name) and abs(d) == V * D * 2]
    assert grads == ([("logits_bwd", V * D * 2), (rs.name, -V * D * 2)]
                     if form == "fp32" else [])


def test_fp32_changes_only_the_projection_gradient():
    bf, f = _trace("bf16"), _trace("fp32")
    for a, b in zip(bf.ops, f.ops, strict=True):
        assert a.name == b.name
        if a.name not in ("logits_bwd", "fsdp_grad_reducescatter_embed"):
            assert (a.flops, a.hbm_bytes, a.bytes) == (b.flops, b.hbm_bytes, b.bytes), a.name
    mxu = [sum(o.flops for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
           for t in (bf, f)]
    assert mxu[0] == mxu[1]


def test_a_windowed_head_ring_holds_two_f32_accumulator_shards():
    # fsdp=4 with windowed gathers: the projection's gradient is reduce-scattered by a
    # windowed ring whose accumulators (two [d_model / 4, vocab] shards) are f32 under fp32,
    # as are its accumulator traffic and the ring's bytes.
    kw = dict(mesh="fsdp=4", chips=4, fsdp_gather="windowed")
    bf, f = _trace("bf16", **kw), _trace("fp32", **kw)
    acc = [_op(t, "logits_bwd_weights_accum").hbm_bytes for t in (bf, f)]
    assert acc == [4 * V * D * 2, 4 * V * D * 4]
    extra = [d for i, cat, d in f.meta.memory_events if cat == "gradients"
             and f.ops[i].name == "logits_bwd"]
    assert extra == [2 * (V * D / 4) * 2]
    assert _op(f, "fsdp_grad_reducescatter_embed").bytes == \
        2 * _op(bf, "fsdp_grad_reducescatter_embed").bytes


def test_the_default_is_bf16_and_is_not_recorded():
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH)
    assert cfg.logits_dtype == "bf16"
    assert "logits_dtype" not in training_config_to_dict(cfg)
    f = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, logits_dtype="F32")
    assert f.logits_dtype == "fp32" and training_config_to_dict(f)["logits_dtype"] == "fp32"


def test_bad_logits_dtypes_are_one_line_errors():
    with pytest.raises(TpusimError, match=r"logits_dtype.*'int8'.*bf16.*fp32"):
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, logits_dtype="int8")
    with pytest.raises(TpusimError, match=r"quantize_logits.*logits_dtype.*fp32"):
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, logits_dtype="fp32",
                       matmul_dtype="int8", quantize_logits=True)


def test_train_takes_the_flag_and_records_it_only_when_set(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text(json.dumps(MODEL))
    base = ["train", "--chip", "v5e", "--shape", "2x1", "--mesh", "fsdp=2", "--model",
            str(model), "--seq-len", str(SEQ), "--batch-per-chip", str(BATCH), "--json"]
    out = {}
    for form in ("bf16", "fp32"):
        assert main(base + (["--logits-dtype", form] if form == "fp32" else [])) == 0
        out[form] = json.loads(capsys.readouterr().out)
    assert "logits-dtype" not in out["bf16"]["inputs"]["flags"]
    assert out["fp32"]["inputs"]["flags"]["logits-dtype"] == "fp32"
    assert out["fp32"]["hbm_peak_bytes"] >= out["bf16"]["hbm_peak_bytes"]


def test_under_tensor_the_input_gradient_is_f32_until_its_tensor_reduction():
    kw = dict(mesh="fsdp=2,tensor=2", chips=4, tp_activations="replicated")
    bf, f = _trace("bf16", **kw), _trace("fp32", **kw)
    name = "tp_allreduce_logits_bwd"
    nd2 = _op(bf, name).bytes  # the bf16 [tokens, d_model] input gradient
    assert _op(f, name).bytes == 2 * nd2
    # The backward dot writes it in f32 (2 more bytes an element) and the projection's
    # [d_model, vocab / 2] gradient in f32 (2 more bytes an element).
    assert _op(f, "logits_bwd").hbm_bytes - _op(bf, "logits_bwd").hbm_bytes == \
        nd2 + V * D / 2 * 2
    temps = [(f.ops[i].name, d) for i, cat, d in f.meta.memory_events
             if cat == "temporaries" and abs(d) == nd2]
    assert temps == [("logits_bwd", nd2), (name, -nd2)]
    at = [sum(d for i, cat, d in t.meta.memory_events
              if cat == "temporaries" and t.ops[i].name == name) for t in (bf, f)]
    assert at[1] - at[0] == -nd2
