"""Today's MoE families (issue 29): multi-head latent attention, shared and fine-grained routed
experts, dense first layers and interleaved MoE layers, chunked local attention and
multi-token prediction, as `TransformerSpec` fields; the DeepSeek and Llama 4 presets against
their published parameter counts; the training and inference programs against closed forms
written out here from the dimensions (not from the spec's own arithmetic)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from sim.chips import get_chip
from sim.cli import main
from sim.overrides import parse_overrides
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.inference import DecodeConfig, compile_decode_step, compile_prefill, memory_plan
from workloads.models import TransformerSpec, causal_chunk_pairs
from workloads.trace import OpKind, Unit
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import MODELS, load_model, model_from_dict

# A tiny MLA model: L=2, D=256, N=4 heads of 96 (64 without rotary + 32 rotary), values of
# 64, query latent 128, key-value latent 64, SwiGLU d_ff 512, vocab 512.
MLA = dict(name="tiny-mla", num_layers=2, d_model=256, num_heads=4, num_kv_heads=4,
           head_dim=96, d_ff=512, mlp="swiglu", vocab_size=512, q_lora_rank=128,
           kv_lora_rank=64, qk_rope_head_dim=32, v_head_dim=64)
D, N, HD, NOPE, R, V, QL, KL, F, VOC = 256, 4, 96, 64, 32, 64, 128, 64, 512, 512
# Its attention matrices (DeepSeek-V2 §2.1), in parameters.
MLA_DOWN = D * QL + D * (KL + R)  # wq_a, wkv_a
MLA_UP = QL * N * HD + KL * N * (NOPE + V) + N * V * D  # wq_b, wkv_b, wo
MLP = 3 * D * F
SEQ = 128


def _trace(model: dict, mesh: str = "fsdp=4", shape: str = "2x2", **cfg):
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    config = {"seq_len": SEQ, "batch_per_chip": 2, "remat": Remat.NONE, "attention": "dot",
              **cfg}
    return compile_training_step(model_from_dict(model), parse_mesh(mesh), topo.num_chips,
                                 TrainingConfig(**config))


def _mxu(trace) -> float:
    return sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)


def _tokens_per_chip(trace) -> float:
    return trace.meta.global_sequences * SEQ / trace.meta.num_chips


# ---- presets against their published counts --------------------------------------------------


def test_deepseek_v3_main_model_mtp_and_active_counts_match_its_model_card():
    m = MODELS.get("deepseek-v3-671b")
    # README_WEIGHTS.md: 671B main-model parameters, 11.5B unique MTP parameters; 36.6B
    # activated including the 0.9B output head (37B in the report): the input table is a
    # lookup, not counted.
    assert (m.num_params - m.num_mtp_params) / 1e9 == pytest.approx(671, rel=0.005)
    assert m.num_mtp_params / 1e9 == pytest.approx(11.5, rel=0.02)
    lookup = m.vocab_size * m.d_model
    assert (m.num_active_params - lookup) / 1e9 == pytest.approx(36.6, rel=0.01)
    assert (m.num_active_params - lookup) / 1e9 == pytest.approx(37, rel=0.02)
    assert m.num_moe_layers == 58 and m.num_dense_layers == 3
    assert [m.layer_is_moe(x) for x in (0, 2, 3, 60, 61)] == [False, False, True, True, True]


def test_deepseek_v3_mla_matrices_and_latent_cache_follow_the_config():
    m = MODELS.get("deepseek-v3-671b")
    assert m.mla_matrices() == [
        ("wq_a", 7168 * 1536), ("wq_b", 1536 * 128 * 192), ("wkv_a", 7168 * (512 + 64)),
        ("wkv_b", 512 * 128 * (128 + 128)), ("wo", 128 * 128 * 7168)]
    # The absorbed form caches the latent and the shared rotary key: (512 + 64) per layer.
    assert m.kv_cache_bytes_per_token(2) == 61 * (512 + 64) * 2
    assert m.kv_cache_bytes(1000, 1) == 61 * 576 * 1000


def test_deepseek_v2_lite_counts_match_the_paper():
    m = MODELS.get("deepseek-v2-lite")
    # DeepSeek-V2 Appendix B: 15.7B parameters, 2.4B activated (the lookup not counted).
    assert m.num_params / 1e9 == pytest.approx(15.7, rel=0.005)
    assert (m.num_active_params - m.vocab_size * m.d_model) / 1e9 == pytest.approx(2.4, rel=0.03)
    assert m.mla_matrices()[0] == ("wq", 2048 * 16 * 192)  # q_lora_rank null: full rank


def test_llama4_counts_match_the_model_cards():
    scout, maverick = MODELS.get("llama4-scout"), MODELS.get("llama4-maverick")
    # 400B in all for Maverick; Scout's 109B counts the vision encoder this spec leaves out
    # (its text model is 107.8B).
    assert maverick.num_params / 1e9 == pytest.approx(400, rel=0.005)
    assert scout.num_params / 1e9 == pytest.approx(109, rel=0.02)
    assert scout.num_params < 109e9
    for m in (scout, maverick):
        assert m.num_active_params / 1e9 == pytest.approx(17, rel=0.015)
    assert scout.num_moe_layers == 48
    # interleave_moe_layer_step 2: layers 1, 3, ..., 47 are MoE, the others dense.
    assert maverick.num_moe_layers == 24
    assert [x for x in range(48) if maverick.layer_is_moe(x)] == list(range(1, 48, 2))


def test_llama4_attends_in_chunks_three_layers_of_four():
    m = MODELS.get("llama4-maverick")
    assert [m.layer_attention_chunk(x) for x in range(4)] == [8192, 8192, 8192, None]
    assert m.num_local_layers == 36 and m.num_global_layers == 12
    # A 16,384-token sequence: two whole chunks, 8192 x 8193 / 2 pairs each.
    assert m.attended_keys_per_query(16384, 0) == 2 * 8192 * 8193 / 2 / 16384
    assert m.attended_keys_per_query(16384, 3) == 16384 / 2
    # The cache holds at most a chunk in a chunked layer.
    assert m.kv_cache_entries(20000) == 12 * 20000 + 36 * 8192


def test_causal_chunk_pairs_count_each_chunk_triangle():
    assert causal_chunk_pairs(10, 4) == 10 + 10 + 3  # chunks of 4, 4 and 2
    assert causal_chunk_pairs(8, 8) == 36
    assert causal_chunk_pairs(5, 100) == 15


@pytest.mark.parametrize("name", ["deepseek-v3-671b", "deepseek-v2-lite-16b",
                                  "llama4-scout-17b-16e", "llama4-maverick-17b-128e"])
def test_presets_round_trip_through_yaml(tmp_path: Path, name: str):
    spec = MODELS.get(name)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()), encoding="utf-8")
    assert load_model(str(path)) == spec


def test_models_without_the_new_features_write_no_new_keys():
    data = MODELS.get("llama3-8b").to_dict()
    assert "kv_lora_rank" not in data and "num_mtp_modules" not in data
    assert MODELS.get("deepseek-v3").to_dict()["num_mtp_modules"] == 1


@pytest.mark.parametrize(
    "changes,pattern",
    [
        ({"num_kv_heads": 2}, r"num_kv_heads=2 differs from num_heads=4.*set num_kv_heads to 4"),
        ({"kv_lora_rank": None}, r"q_lora_rank=128 is set but kv_lora_rank is null"),
        ({"qk_rope_head_dim": 96}, r"qk_rope_head_dim=96 leaves no non-rotary dimension"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank=0 must be a positive integer"),
        ({"attention_window": 64, "attention_chunk_size": 64},
         r"attention_chunk_size=64 is set together with attention_window=64"),
        ({"moe_layer_period": 2}, r"moe_layer_period=2 is set but num_experts=0"),
        ({"num_mtp_modules": -1}, r"num_mtp_modules=-1 must be"),
    ],
)
def test_bad_feature_fields_are_refused_naming_value_rule_and_fix(changes, pattern):
    with pytest.raises(TpusimError, match=pattern):
        model_from_dict({**MLA, **changes})


def test_moe_layer_period_that_leaves_no_moe_layer_is_refused():
    with pytest.raises(TpusimError, match=r"moe_layer_period=3 leaves no MoE layer"):
        model_from_dict(dict(MLA, num_layers=3, num_experts=4, experts_per_token=1,
                             first_dense_layers=1, moe_layer_period=3))


def test_set_overrides_reach_the_new_fields():
    ov = parse_overrides(["model.kv_lora_rank=32", "model.num_mtp_modules=1",
                          "model.attention_chunk_size=null"], scope=("model",))
    m = ov.apply_model(model_from_dict(MLA))
    assert (m.kv_lora_rank, m.num_mtp_modules, m.attention_chunk_size) == (32, 1, None)


# ---- training: FLOPs per chip in closed form --------------------------------------------------


def _dense_mla_flops(n: float, tp: int = 1, layers: int = 2) -> float:
    """Forward + backward (x3) of the weight matmuls and the dot attention (every score), and
    the output projection, for n tokens on a chip; MLA's down projections whole per shard."""
    weights = layers * (MLA_DOWN + (MLA_UP + MLP) / tp) + D * VOC / tp
    attention = layers * (2 * SEQ * N * HD + 2 * SEQ * N * V) / tp
    return 3 * n * (2 * weights + attention)


@pytest.mark.parametrize("mesh", ["fsdp=4", "fsdp=2,tensor=2"])
def test_mla_training_mxu_flops_match_the_closed_form(mesh):
    trace = _trace(MLA, mesh)
    tp = 2 if "tensor" in mesh else 1
    n = _tokens_per_chip(trace) * tp  # a tensor shard computes all its group's tokens
    assert _mxu(trace) == pytest.approx(_dense_mla_flops(n, tp), rel=1e-12)


def test_mtp_module_adds_a_layer_its_projection_and_a_second_output_projection():
    base, mtp = _trace(MLA), _trace(dict(MLA, num_mtp_modules=1))
    n = _tokens_per_chip(base)
    layer = MLA_DOWN + MLA_UP + MLP
    attention = 2 * SEQ * N * HD + 2 * SEQ * N * V
    extra = 3 * n * (2 * (layer + 2 * D * D + D * VOC) + attention)
    assert _mxu(mtp) - _mxu(base) == pytest.approx(extra, rel=1e-12)
    assert {"mtp_proj", "mtp_logits", "mtp_logits_bwd"} <= {o.name for o in mtp.ops}
    # Its parameters are trained: the optimizer state grows by the module's share.
    m = model_from_dict(dict(MLA, num_mtp_modules=1))
    assert mtp.meta.params_per_chip - base.meta.params_per_chip == pytest.approx(
        (m.num_mtp_params - 3 * D - m.norm_params_per_layer) / 4
        + 3 * D + m.norm_params_per_layer)


def test_interleaved_moe_layers_with_shared_experts_cost_their_routed_and_shared_experts():
    moe = dict(MLA, num_layers=4, num_experts=8, experts_per_token=2, moe_d_ff=128,
               num_shared_experts=1, moe_layer_period=2)
    trace = _trace(moe)
    n = _tokens_per_chip(trace)
    dense_mlp = 2 * MLP
    moe_mlp = (2 + 1) * 3 * D * 128 + D * 8  # top-2 and the shared expert, and the router
    weights = 4 * (MLA_DOWN + MLA_UP) + dense_mlp + 2 * moe_mlp + D * VOC
    attention = 4 * (2 * SEQ * N * HD + 2 * SEQ * N * V)
    assert _mxu(trace) == pytest.approx(3 * n * (2 * weights + attention), rel=1e-12)
    names = [(o.layer, o.name) for o in trace.ops if o.phase == "fwd"]
    assert (1, "router") in names and (3, "router") in names
    assert (0, "router") not in names and (2, "mlp_in") in names


def test_chunked_layers_under_flash_attention_cost_their_chunks_pairs():
    dense = dict(name="tiny-chunked", num_layers=4, d_model=256, num_heads=4, num_kv_heads=2,
                 head_dim=64, d_ff=512, mlp="swiglu", vocab_size=512)
    full = _trace(dense, attention="flash")
    chunked = _trace(dict(dense, attention_chunk_size=32, global_layer_period=4),
                     attention="flash")
    n = _tokens_per_chip(full)
    # Flash: 4 n N H x keys per query forward, 2.5x that backward; three layers of four
    # attend to 32-token chunks instead of half the sequence.
    per_key = 3.5 * 4 * n * 4 * 64
    saved = 3 * per_key * (SEQ / 2 - causal_chunk_pairs(SEQ, 32) / SEQ)
    assert _mxu(full) - _mxu(chunked) == pytest.approx(saved, rel=1e-12)


def test_mla_saved_activations_have_value_heads_and_latents():
    trace = _trace(MLA)
    saved = trace.meta.saved_activations_per_layer
    n = _tokens_per_chip(trace)
    assert saved["q"] == saved["k"] == n * N * HD * 2
    assert saved["v"] == saved["attn_context"] == n * N * V * 2
    assert saved["mla_latents"] == n * (QL + KL + R) * 2


def test_pipeline_refuses_first_dense_layers_and_mtp():
    with pytest.raises(TpusimError, match=r"first_dense_layers=1 .* not modelled with a "
                                          r"pipeline axis"):
        _trace(dict(MLA, num_layers=4, num_experts=4, experts_per_token=1,
                    first_dense_layers=1), mesh="pipeline=2,fsdp=2")


# ---- decode and prefill -----------------------------------------------------------------------


def _decode(model: dict, mesh: str = "tensor=2", batch: int = 4, ctx: int = 1000,
            chips: int = 2):
    spec = model_from_dict(model)
    cfg = DecodeConfig(batch=batch, context_len=ctx, sampling="greedy")
    return spec, cfg, compile_decode_step(spec, parse_mesh(mesh), chips, cfg)


def test_mla_decode_attends_to_the_cached_latents_in_absorbed_form():
    spec, cfg, trace = _decode(MLA)
    att = [o for o in trace.ops if o.name == "attention"]
    assert len(att) == 2
    # Each tensor shard: 2 of the 4 heads, the 4 sequences' latents whole (replicated).
    b, h = 4, 2
    assert att[0].flops == 2 * b * 1000 * h * ((KL + R) + KL)
    absorb = [o for o in trace.ops if o.name == "mla_absorb_q"][0]
    assert absorb.flops == 2 * b * h * NOPE * KL
    plan = memory_plan(spec, parse_mesh("tensor=2"), 2, cfg)
    assert plan["kv_cache_bytes"] == 2 * 1000 * b * (KL + R) * 2
    assert trace.meta.kv_cache_bytes_total == b * 2 * 1000 * (KL + R) * 2


def test_mla_prefill_up_projects_the_latents_of_the_prompt():
    spec = model_from_dict(MLA)
    cfg = DecodeConfig(batch=2, context_len=256, prompt_len=256, sampling="greedy")
    trace = compile_prefill(spec, parse_mesh("tensor=2"), 2, cfg)
    up = [o for o in trace.ops if o.name == "kv_up"][0]
    assert up.flops == 2 * (2 * 256) * KL * 2 * (NOPE + V)
    att = [o for o in trace.ops if o.name == "attention"][0]
    assert att.flops == 2 * 2 * 256 * (256 + 1) / 2 * 2 * (HD + V)


def test_chunked_decode_reads_the_current_chunk_only():
    dense = dict(name="tiny-chunked", num_layers=4, d_model=256, num_heads=4, num_kv_heads=4,
                 head_dim=64, d_ff=512, mlp="swiglu", vocab_size=512,
                 attention_chunk_size=300, global_layer_period=4)
    _, _, trace = _decode(dense, mesh="tensor=1", batch=1, ctx=1000, chips=1)
    flops = [o.flops for o in trace.ops if o.name == "attention"]
    # Layers 0-2 read the 1000 mod 300 = 100 cached positions of their chunk, layer 3 all.
    assert flops == [4 * 100 * 4 * 64] * 3 + [4 * 1000 * 4 * 64]


def test_decode_leaves_the_mtp_modules_out():
    spec = model_from_dict(dict(MLA, num_mtp_modules=1))
    base = model_from_dict(MLA)
    cfg = DecodeConfig(batch=2, context_len=64, sampling="greedy")
    one = memory_plan(spec, parse_mesh("tensor=2"), 2, cfg)
    two = memory_plan(base, parse_mesh("tensor=2"), 2, cfg)
    assert one["weights_bytes"] == two["weights_bytes"]


# ---- the command line ---------------------------------------------------------------------------


def test_train_and_decode_run_a_shrunk_deepseek_v3_from_its_preset(tmp_path: Path, capsys):
    path = tmp_path / "ds.yaml"
    path.write_text(yaml.safe_dump({
        "base": "deepseek-v3-671b", "num_layers": 4, "d_model": 256, "num_heads": 4,
        "num_kv_heads": 4, "head_dim": 96, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "q_lora_rank": 64, "kv_lora_rank": 32, "d_ff": 512, "moe_d_ff": 64, "num_experts": 8,
        "experts_per_token": 2, "first_dense_layers": 1, "vocab_size": 512}))
    assert main(["train", "--chip", "v5e", "--shape", "2x2", "--model", str(path),
                 "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "fsdp=2,expert=2"]) == 0
    assert main(["decode", "--chip", "v5e", "--shape", "2x2", "--model", str(path),
                 "--batch", "8", "--context-len", "256", "--mesh", "tensor=2,expert=2"]) == 0
    out = capsys.readouterr().out
    assert "training step" in out and "decode step" in out


def test_set_that_breaks_mla_is_a_one_line_error(capsys):
    rc = main(["train", "--chip", "v5e", "--shape", "2x2", "--model", "deepseek-v2-lite",
               "--set", "model.num_kv_heads=4", "--seq-len", "128", "--batch-per-chip", "1",
               "--mesh", "fsdp=4"])
    err = capsys.readouterr().err
    assert rc == 2 and "num_kv_heads=4 differs from num_heads=16" in err
    assert len(err.strip().splitlines()) == 1


def test_spec_fields_are_frozen_dataclass_fields():
    names = {f.name for f in dataclasses.fields(TransformerSpec)}
    assert {"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "moe_layer_period",
            "attention_chunk_size", "num_mtp_modules"} <= names
