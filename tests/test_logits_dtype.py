"""The logits path's dtype (`logits_dtype`, MaxText's `logits_dot_in_fp32`): under fp32 the
output projection is gathered and read in f32, the logit gradients and the projection's
weight gradient are f32, the dot's FLOPs and MXU rate are bf16's (one pass at jax's default
precision); bf16 (the default) is the model as before. Closed forms on a tiny model."""

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


@pytest.mark.parametrize("form,lb", [("bf16", 2), ("fp32", 4)])
def test_the_output_projection_dot_and_its_backward_in_closed_form(form, lb):
    t = _trace(form)
    fwd, bwd = _op(t, "logits"), _op(t, "logits_bwd")
    # The same FLOPs at the same (bf16) MXU rate in either form.
    assert (fwd.flops, bwd.flops) == (2 * N * D * V, 4 * N * D * V)
    assert fwd.dtype == bwd.dtype == "bf16"
    w = V * D * lb  # the gathered projection as the dot reads it (bf16 params)
    # Forward: the weight, the bf16 final-norm output, the f32 logits.
    assert fwd.hbm_bytes == w + N * D * 2 + N * V * 4
    # Backward: the weight twice, the logit gradients (f32 under fp32), the bf16 input
    # gradient and the weight gradient in the dot's dtype.
    assert bwd.hbm_bytes == 2 * w + N * V * lb + N * D * 2 + w
    # The loss holds the f32 logits and the logit gradients from the dot to its backward.
    ev = {t.ops[i].name: delta for i, cat, delta in t.meta.memory_events if cat == "logits"}
    assert ev["logits"] == N * V * (4 + lb)


@pytest.mark.parametrize("form,lb", [("bf16", 2), ("fp32", 4)])
def test_the_projection_is_gathered_and_its_gradient_reduce_scattered_in_the_dot_dtype(
        form, lb):
    t = _trace(form)
    # fsdp=2: each chip holds half the [vocab, d_model] matrix; the gather carries the
    # whole of it (the collective's bytes), the reduce-scatter the whole gradient.
    assert _op(t, "fsdp_allgather_embed").bytes == V * D * lb
    assert _op(t, "fsdp_grad_reducescatter_embed").bytes == V * D * lb
    # HBM holds the gathered matrix in the same dtype (from the gather or, when XLA holds it
    # late, from the last layer's forward) until the backward dot.
    held = [d for i, cat, d in t.meta.memory_events if cat == "gathered_weights"
            and t.ops[i].layer == -1 or cat == "gathered_weights" and d == V * D * lb]
    assert V * D * lb in held and -V * D * lb in held


def test_fp32_changes_only_the_logits_path():
    bf, f = _trace("bf16"), _trace("fp32")
    head = {"logits", "logits_bwd", "dlogits", "fsdp_allgather_embed",
            "fsdp_grad_reducescatter_embed"}
    for a, b in zip(bf.ops, f.ops, strict=True):
        assert a.name == b.name
        if a.name not in head:
            assert (a.flops, a.hbm_bytes, a.bytes) == (b.flops, b.hbm_bytes, b.bytes), a.name
    mxu = [sum(o.flops for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
           for t in (bf, f)]
    assert mxu[0] == mxu[1]
    # The dlogits fusion writes f32 gradients: its traffic grows by 2 bytes a logit where it
    # is not fused away.
    d0, d1 = _op(bf, "dlogits").hbm_bytes, _op(f, "dlogits").hbm_bytes
    assert d1 - d0 in (0.0, 2 * N * V) and (d0 == 0) == (d1 == 0)


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
