"""int8 (AQT) training: which matmuls run at the int8 rate, the quantization's VPU work and
bytes in closed form, int8 gathers, the memory of the int8 copies, the step faster than bf16
where the MXU bounds it, FLOP counts unchanged, and the bad-input errors."""

from __future__ import annotations

import json

import pytest

from sim.chips import get_chip
from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.memory import attention_backward_score_buffers, deferred_head_gradient_bytes
from workloads.trace import OpKind, Unit
from workloads.training import TrainingConfig, compile_training_step
from workloads.training.quant import (
    DEQUANT_FLOPS_PER_ELEMENT,
    QUANT_FLOPS_PER_ELEMENT,
    QUANT_READS,
    SCALE_BYTES,
    SR_BITS_BYTES,
    SR_FLOPS_PER_ELEMENT,
    quantize_cost,
)
from workloads.zoo import model_from_dict

# A GeLU layer (two MLP matrices): d_model 256, 8 heads of 32 (4 KV heads), d_ff 1024, 2
# layers, vocab 512.
MODEL = {"name": "int8-tiny", "num_layers": 2, "d_model": 256, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "d_ff": 1024, "mlp": "gelu", "vocab_size": 512}
D, H, K, HD, F = 256, 8, 4, 32, 1024
SEQ, BATCH = 512, 2
N = SEQ * BATCH  # tokens per chip


def _trace(mesh="data=1", chips=1, **kw):
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, **kw)
    return compile_training_step(model_from_dict(MODEL), parse_mesh(mesh), chips, cfg)


def _ops(trace, name, layer=0):
    return [o for o in trace.ops if o.name == name and o.layer == layer]


def test_weight_matmuls_run_int8_and_attention_and_logits_stay_bf16_by_default():
    t = _trace(matmul_dtype="int8")
    mxu = {o.name: o.dtype for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU}
    for name in ("qkv_proj", "out_proj", "mlp_in", "mlp_out", "mlp_bwd", "mlp_bwd_weights",
                 "attn_proj_bwd", "attn_proj_bwd_weights", "re-qkv_proj", "re-mlp_in"):
        assert mxu[name] == "int8", name
    for name in ("flash_attention", "flash_attention_bwd", "logits", "logits_bwd"):
        assert mxu[name] == "bf16", name
    both = _trace(matmul_dtype="int8", quantize_attention=True, quantize_logits=True)
    mxu = {o.name: o.dtype for o in both.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU}
    for name in ("flash_attention", "flash_attention_bwd", "logits", "logits_bwd"):
        assert mxu[name] == "int8", name


def test_total_flops_by_unit_are_unchanged_by_int8_but_for_the_quantization():
    bf, q = _trace(), _trace(matmul_dtype="int8")
    mxu = [sum(o.flops for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)
           for t in (bf, q)]
    assert mxu[0] == mxu[1]
    quant = sum(o.flops for o in q.ops if o.name.endswith("_quant"))
    vpu = [sum(o.flops for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.VPU)
           for t in (bf, q)]
    assert quant > 0 and vpu[1] == pytest.approx(vpu[0] + quant, rel=1e-12)
    assert bf.meta.model_flops_per_chip == q.meta.model_flops_per_chip


def test_forward_mlp_quantization_in_closed_form():
    """mlp_in quantizes X[N, D] per row and the local W[D, F] per column; its output N x F is
    dequantized (one chip: no gather, so the matmul quantizes the weight itself)."""
    t = _trace(matmul_dtype="int8")
    (op,) = _ops(t, "mlp_in_quant")
    x, w, out = N * D, D * F, N * F
    scales = (x + w) / D
    assert op.flops == pytest.approx(QUANT_FLOPS_PER_ELEMENT * (x + w)
                                     + DEQUANT_FLOPS_PER_ELEMENT * out)
    assert op.hbm_bytes == pytest.approx((x + w) * (QUANT_READS * 2 + 1)
                                         + 2 * SCALE_BYTES * scales)
    # The matmul reads its operands as int8 (half the bf16 activation bytes, 1 byte a weight).
    (mm,) = _ops(t, "mlp_in")
    (mm_bf,) = _ops(_trace(), "mlp_in")
    assert mm_bf.hbm_bytes - mm.hbm_bytes == pytest.approx(N * D + D * F)


def test_backward_gradients_are_stochastically_rounded_with_random_bits():
    """mlp_bwd_weights (dW = X^T dY) quantizes X[N, D] and the down projection's input
    X2[N, F], and with stochastic rounding the gradients dY[N, F] (of mlp_in) and dY2[N, D]:
    each gradient element costs the noise's FLOPs and its 32 random bits written and read."""
    on = _ops(_trace(matmul_dtype="int8"), "mlp_bwd_weights_quant")[0]
    off = _ops(_trace(matmul_dtype="int8", stochastic_rounding=False),
               "mlp_bwd_weights_quant")[0]
    grads = N * F + N * D
    assert on.flops - off.flops == pytest.approx(SR_FLOPS_PER_ELEMENT * grads)
    assert on.hbm_bytes - off.hbm_bytes == pytest.approx(SR_BITS_BYTES * grads)


def _events(t, layer=0):
    """Memory events of one layer, summed per (op name, category)."""
    ev: dict[tuple[str, str], float] = {}
    for i, cat, d in t.meta.memory_events:
        if t.ops[i].layer == layer:
            ev[(t.ops[i].name, cat)] = ev.get((t.ops[i].name, cat), 0.0) + d
    return ev


def test_random_bits_are_held_from_the_layer_backward_only_with_async_gathers():
    """`quant.SR_HELD_RULE`: with async plain gathers (v5e's compiles) the random bits of the
    layer's weight gradients (every matrix's output gradient) and of the q, k, v input
    gradients are allocated at the MLP's input-gradient quantization; the q, k, v ones die
    with their matmul, the weight gradients' with the attention's weight gradients (XLA runs
    the MLP's last in int8). With blocking gathers (v5p's) none are held."""
    mlp = 4 * (N * F + N * D)  # gelu: one up projection's output gradient, the down's
    attn = 4 * (N * (H + 2 * K) * HD + N * D)
    qkv = 4 * N * (H + 2 * K) * HD
    ev = {g: _events(_trace(matmul_dtype="int8", remat="full", fsdp_gather=g))
          for g in ("async", "blocking")}
    held = {k: ev["async"].get(k, 0.0) - ev["blocking"].get(k, 0.0)
            for k in set(ev["async"]) | set(ev["blocking"])}
    assert held[("mlp_bwd_quant", "temporaries")] == pytest.approx(mlp + attn + qkv)
    assert held[("attn_proj_bwd", "temporaries")] == pytest.approx(-qkv)
    assert held[("attn_proj_bwd_weights", "temporaries")] == pytest.approx(-(mlp + attn))
    assert sum(abs(v) for v in held.values()) == pytest.approx(2 * (mlp + attn + qkv))
    no_sr = _events(_trace(matmul_dtype="int8", remat="full", stochastic_rounding=False))
    assert no_sr == _events(_trace(matmul_dtype="int8", remat="full", fsdp_gather="blocking",
                                   stochastic_rounding=False))


def test_int8_keeps_the_mlp_side_tensors_to_the_end_of_the_layer_backward():
    """int8: XLA runs the MLP's weight gradients after the attention's backward (every int8
    compile of validation/xla_int8.py), so the MLP's recomputed tensors live through it; the
    bf16 step frees them with the MLP's weight-gradient matmul (on a chip without
    `mlp_grad_after_attention`)."""
    i8 = _events(_trace(matmul_dtype="int8", remat="full"))
    bf = _events(_trace(remat="full"))
    assert bf[("mlp_bwd_weights", "saved_activations")] < 0
    assert ("mlp_bwd_weights", "saved_activations") not in i8


def test_int8_memory_rules_of_the_score_gradient_and_the_head():
    """v5p's compiler holds the probabilities at the score gradient under int8 `full` too
    (4 buffers, as under `minimal`), and an int8 program defers the head's weight gradient
    past the backward loop only with async gathers (v5e; v5p's blocking ones do not)."""
    assert attention_backward_score_buffers(remat="full", bwd_probs_buffer=True) == 3
    assert attention_backward_score_buffers(remat="full", bwd_probs_buffer=True,
                                            int8=True) == 4
    assert attention_backward_score_buffers(remat="full", score_grad_fusion=True,
                                            int8=True) == 2
    kw = dict(rows=100, d_model=32, local_vocab=50, tensor=2, fsdp=2,
              tp_activations="replicated", remat="full")
    assert deferred_head_gradient_bytes(**kw) > 0
    assert deferred_head_gradient_bytes(**kw, int8=True) == deferred_head_gradient_bytes(**kw)
    assert deferred_head_gradient_bytes(**kw, int8=True, gather="blocking") == 0
    assert deferred_head_gradient_bytes(**kw, gather="blocking") > 0


def test_per_tensor_scales_take_one_scale_per_operand():
    pc = _ops(_trace(matmul_dtype="int8"), "mlp_in_quant")[0]
    pt = _ops(_trace(matmul_dtype="int8", quant_scales="per-tensor"), "mlp_in_quant")[0]
    scales = (N * D + D * F) / D
    assert pc.hbm_bytes - pt.hbm_bytes == pytest.approx(2 * SCALE_BYTES * (scales - 2))
    assert quantize_cost(0.0, 0.0, sr=True, act_bytes=2).hbm_bytes == 0.0


def test_fsdp_gathers_carry_int8_weights_quantized_before_the_gather():
    """fsdp=4: each layer pass quantizes the chip's quarter of the layer's weights once, and
    every gather carries 1 byte a weight; --quant-gather bf16 gathers bf16 and quantizes the
    gathered matrix in each matmul."""
    fs = 4
    layer_w = D * (H + 2 * K) * HD + H * HD * D + 2 * D * F
    i8 = _trace("fsdp=4", fs, matmul_dtype="int8", fsdp_gather="blocking")
    bf = _trace("fsdp=4", fs, fsdp_gather="blocking")
    gath = [sum(o.bytes for o in t.ops if o.collective == "all-gather"
                and o.name.startswith("fsdp_allgather_fwd_") and o.layer == 0)
            for t in (i8, bf)]
    assert gath == [pytest.approx(layer_w), pytest.approx(2 * layer_w)]
    (wq,) = [o for o in i8.ops if o.name == "weight_quant_fwd" and o.layer == 0]
    assert wq.flops == pytest.approx(QUANT_FLOPS_PER_ELEMENT * layer_w / fs)
    assert wq.hbm_bytes == pytest.approx(layer_w / fs * (QUANT_READS * 2 + 1))
    after = _trace("fsdp=4", fs, matmul_dtype="int8", fsdp_gather="blocking",
                   quant_gather="bf16")
    assert not [o for o in after.ops if o.name.startswith("weight_quant_")]
    assert sum(o.bytes for o in after.ops if o.collective == "all-gather"
               and o.name.startswith("fsdp_allgather_fwd_") and o.layer == 0) == \
        pytest.approx(2 * layer_w)


def test_int8_copies_are_temporaries_freed_by_their_matmul():
    t = _trace(matmul_dtype="int8")
    ev = {(t.ops[i].name, cat): d for i, cat, d in t.meta.memory_events
          if t.ops[i].layer == 0}
    copy = N * D + D * F  # mlp_in's int8 X and W
    assert ev[("mlp_in_quant", "temporaries")] == pytest.approx(copy)
    assert ev[("mlp_in", "temporaries")] == pytest.approx(-copy)


def test_int8_is_faster_than_bf16_on_an_mxu_bound_step(capsys):
    """A wide model on one chip: the step is MXU-bound, and its weight matmuls at the int8
    peak (twice bf16 on v6e) outweigh the quantization's VPU and HBM work."""
    flags = ["train", "--model", "llama3-8b", "--set", "model.num_layers=4", "--set",
             "model.vocab_size=8192", "--chip", "v6e", "--shape", "1x1", "--mesh", "data=1",
             "--seq-len", "2048", "--batch-per-chip", "4", "--json"]
    steps = []
    for extra in ([], ["--matmul-dtype", "int8"]):
        assert main(flags + extra) == 0
        doc = json.loads(capsys.readouterr().out)
        steps.append(doc)
    bf, i8 = steps
    assert bf["fits_in_hbm"] and i8["fits_in_hbm"]
    assert bf["breakdown"]["mxu_compute_s"] > 0.75 * bf["step_time_s"]
    # The weight matmuls (most of the MXU time) at twice the rate; the quantization is
    # HBM-bound work the bf16 step does not have.
    assert i8["breakdown"]["mxu_compute_s"] < 0.6 * bf["breakdown"]["mxu_compute_s"]
    assert i8["breakdown"]["hbm_bound_s"] > bf["breakdown"]["hbm_bound_s"]
    assert i8["step_time_s"] < bf["step_time_s"]
    assert i8["model_flops_per_chip"] == bf["model_flops_per_chip"]
    assert i8["inputs"]["flags"]["matmul-dtype"] == "int8"
    assert "matmul-dtype" not in bf["inputs"]["flags"]
    assert "matmul_dtype" not in bf["inputs"]["training"]


@pytest.mark.parametrize("kw, match", [
    ({"matmul_dtype": "int4"}, "matmul_dtype 'int4' is not a training matmul format"),
    ({"quant_scales": "per-row", "matmul_dtype": "int8"}, "quant_scales 'per-row' must be"),
    ({"quant_gather": "fp32", "matmul_dtype": "int8"}, "quant_gather 'fp32' must be"),
    ({"quantize_attention": True}, "quantize_attention quantizes matmuls, and "
                                   "matmul_dtype is bf16"),
    ({"stochastic_rounding": False}, "no_stochastic_rounding quantizes matmuls"),
])
def test_bad_quantization_settings_are_one_line_errors(kw, match):
    with pytest.raises(TpusimError, match=match):
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, **kw)


def test_fp8_is_refused_on_a_chip_without_an_fp8_rate(capsys):
    rc = main(["train", "--model", "llama3-8b", "--set", "model.num_layers=1", "--chip", "v5p",
               "--shape", "2x2x1", "--mesh", "fsdp=4", "--seq-len", "512",
               "--batch-per-chip", "1", "--matmul-dtype", "fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "--matmul-dtype fp8: chip 'v5p' has no fp8 MXU rate" in err[0]
    with pytest.raises(TpusimError, match="no fp8 MXU rate"):
        get_chip("tpu7x").check_matmul_dtype("fp8")
    get_chip("tpu7x").with_overrides(mxu_fp8_ops_per_s=4.6e15).check_matmul_dtype("fp8")


def test_fp8_runs_at_the_chips_fp8_rate_when_it_has_one():
    chip = get_chip("v5e").with_overrides(mxu_fp8_ops_per_s=3.94e14 * 2)
    t = _trace(matmul_dtype="fp8")
    (op,) = _ops(t, "mlp_in")
    assert op.dtype == "fp8"
    assert chip.unit_rate(op) == pytest.approx(2 * 3.94e14 * chip.mxu_efficiency)
    assert "mxu_fp8_ops_per_s" not in get_chip("v5e").to_dict()


def test_int8_against_the_saved_xla_compiles(tmp_path, capsys):
    """validation/results/xla_int8.json (AQT's int8 compiles, no jax needed): dot FLOPs per
    chip by type exact, HBM peak within 10%."""
    from validation import xla_compile, xla_int8

    cache = xla_compile.load_cache(xla_int8.CACHE)
    model = tmp_path / "model.yaml"
    model.write_text(xla_compile.tpusim_model_yaml(
        xla_compile.tpusim_model_dict(xla_compile.SMALL, xla_int8.LAYERS, "xla-int8")))
    names = [k.split("/")[0] for k in cache if k.endswith("/int8")]
    assert "v5e_fsdp_full" in names
    for name in names:
        x = cache[f"{name}/int8"]
        assert main(["train", "--model", str(model), "--json",
                     *xla_int8.tpusim_flags(name, "int8")]) == 0
        doc = json.loads(capsys.readouterr().out)
        cfg = xla_int8.CONFIGS[name]
        # Held out or not (docs/validation.md says which compiles the rules were read off).
        assert abs(doc["hbm_peak_bytes"] / x["hbm_peak_bytes"] - 1) < 0.10, name
        mesh = ",".join(f"{k}={v}" for k, v in xla_int8.MESHES[cfg["mesh"]].items())
        t = compile_training_step(
            model_from_dict(xla_compile.tpusim_model_dict(xla_compile.SMALL, xla_int8.LAYERS,
                                                          "xla-int8")),
            parse_mesh(mesh), x["num_chips"],
            TrainingConfig(seq_len=xla_int8.SEQ, batch_per_chip=xla_int8.BATCH_PER_CHIP,
                           remat=cfg["remat"], attention="dot", tp_activations="replicated",
                           fsdp_gather="mixed-async" if cfg["chip"] == "v5e"
                           else "mixed-blocking", matmul_dtype="int8"))
        flops: dict[str, float] = {}
        for o in t.ops:
            if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU:
                flops[o.dtype] = flops.get(o.dtype, 0.0) + o.flops
        assert flops == pytest.approx(x["dot_flops"], rel=1e-9), name


def test_gpt3_175b_int8_on_a_6144_chip_v5p_slice_runs_and_fits(capsys):
    """The issue's run: 175B GPT, int8, save_dot_except_mlpwi, v5p 8x16x48 (96 cubes); about
    1.6 CPU-s (representative replay)."""
    assert main(["train", "--model", "gpt3-175b", "--chip", "v5p", "--shape", "8x16x48",
                 "--mesh", "fsdp=768,tensor=8", "--seq-len", "2048", "--batch-per-chip", "1",
                 "--matmul-dtype", "int8", "--remat", "save_dot_except_mlpwi", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_chips"] == 6144 and doc["fits_in_hbm"]
    assert doc["inputs"]["training"]["matmul_dtype"] == "int8"


def test_a_compiled_int8_step_replays_at_the_int8_steps_time(tmp_path, capsys):
    """`replay` takes int8 through the trace: `compile --matmul-dtype int8` writes each
    matmul's format with its quantize ops and scales, and the replay runs them as `train`
    does (a replay cannot re-quantize a bf16 trace: the quantization is part of the program)."""
    flags = ["--model", "llama3-8b", "--set", "model.num_layers=2", "--set",
             "model.vocab_size=8192", "--chip", "v6e", "--shape", "2x2", "--mesh", "fsdp=4",
             "--seq-len", "1024", "--batch-per-chip", "1", "--matmul-dtype", "int8"]
    out = tmp_path / "int8.trace"
    assert main(["compile", *flags, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", *flags, "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert main(["replay", str(out), "--chip", "v6e", "--shape", "2x2", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["step_time_s"] == trained["step_time_s"]
    ops = json.loads(out.read_text())
    assert any("int8" in json.dumps(row) for row in ops["ops"])
