"""MaxText's remat policies by their MaxText names: what each keeps on device, offloads and
recomputes per layer (closed-form memory and FLOPs), the `custom` form and its errors."""

from __future__ import annotations

import json

import pytest

from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.trace import Unit
from workloads.training import (
    Remat,
    TrainingConfig,
    compile_training_step,
    estimate_training_memory,
)
from workloads.training.remat import MAXTEXT_POLICIES, remat_plan
from workloads.zoo import model_from_dict

# A GeLU layer (two MLP matrices) small enough to compile in a blink: d_model 256, 8 heads of
# 32 (4 KV heads), d_ff 1024, 2 layers, vocab 512.
MODEL = {"name": "remat-policies", "num_layers": 2, "d_model": 256, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "d_ff": 1024, "mlp": "gelu", "vocab_size": 512}
D, H, K, HD, F, L = 256, 8, 4, 32, 1024, 2
SEQ, BATCH = 512, 2

# Per policy: the tensors kept on device and offloaded (tpusim's names), and the forward
# matmuls the backward reruns (docs/reference/maxtext_remat.md: what a policy does not save is
# recomputed; `mlp_out` is never rerun, only the layer output reads it).
POLICIES = {
    "full": ({"layer_input"}, set(), {"qkv", "attn", "out", "mlp_in"}),
    "minimal": ({"layer_input", "q", "k", "v", "attn_out_proj", "mlp_hidden"}, set(), set()),
    "minimal_with_context": ({"layer_input", "q", "k", "v", "attn_context", "attn_out_proj",
                              "mlp_hidden", "router_logits"}, set(), set()),
    "minimal_flash": ({"layer_input", "q", "k", "v", "attn_context", "attn_out_proj",
                       "mlp_hidden", "router_logits"}, set(), set()),
    "save_dot_with_context_except_mlp": (
        {"layer_input", "q", "k", "v", "attn_context", "attn_out_proj"}, set(), {"mlp_in"}),
    "save_dot_except_mlpwi": ({"layer_input", "q", "k", "v", "attn_out_proj"}, set(),
                              {"attn", "mlp_in"}),
    "save_dot_except_mlp": ({"layer_input", "q", "k", "v", "attn_out_proj"}, set(),
                            {"attn", "mlp_in"}),
    "save_qkv_proj": ({"layer_input", "q", "k", "v"}, set(), {"attn", "out", "mlp_in"}),
    "save_out_proj": ({"layer_input", "attn_out_proj"}, set(), {"qkv", "attn", "mlp_in"}),
    "qkv_proj_offloaded": ({"layer_input"}, {"q", "k", "v"}, {"attn", "out", "mlp_in"}),
    "minimal_offloaded": ({"layer_input"}, {"q", "k", "v", "attn_out_proj", "mlp_hidden"},
                          set()),
}


def _widths(tp: int = 1) -> dict[str, float]:
    """Bytes per token of each per-layer tensor (bf16), per chip: the residual stream's and
    the output projection's [tokens / tensor, d_model] (sharded activations), the heads' and
    the MLP's widths over `tensor`."""
    return {"layer_input": 2 * D / tp, "q": 2 * H * HD / tp, "k": 2 * K * HD / tp,
            "v": 2 * K * HD / tp, "attn_context": 2 * H * HD / tp,
            "attn_out_proj": 2 * D / tp, "mlp_hidden": 2 * F / tp, "router_logits": 0.0}


def _flops(n: float) -> dict[str, float]:
    """Forward FLOPs of one layer's matmuls over `n` tokens (one chip, flash attention over
    the causal half of the keys)."""
    return {"qkv": 2 * n * D * (H + 2 * K) * HD, "attn": 4 * n * H * HD * SEQ / 2,
            "out": 2 * n * H * HD * D, "mlp_in": 2 * n * D * F}


def _config(remat: str, **kw) -> TrainingConfig:
    return TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, remat=remat, attention="flash",
                          **kw)


def _mxu_flops(trace) -> float:
    return sum(op.flops for op in trace.ops if op.unit == Unit.MXU)


def test_every_maxtext_policy_name_is_a_remat_mode():
    names = {"full", "minimal", "minimal_with_context", "minimal_flash",
             "save_dot_with_context_except_mlp", "save_dot_except_mlpwi", "save_dot_except_mlp",
             "save_qkv_proj", "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded",
             "custom"}
    assert names <= {m.value for m in Remat}
    assert set(MAXTEXT_POLICIES) | {Remat(n) for n in ("full", "minimal", "minimal_with_context",
                                                         "minimal_flash", "minimal_offloaded",
                                                         "custom")} == {Remat(n) for n in names}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policy_keeps_offloads_and_recomputes_its_documented_tensors(policy):
    device, host, _ = POLICIES[policy]
    plan = remat_plan(Remat(policy))
    assert set(plan.device) == device
    assert set(plan.host) == host


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mesh,chips,tp", [("fsdp=1", 1, 1), ("fsdp=2,tensor=4", 8, 4)])
def test_each_policys_saved_activations_are_its_kept_tensors_summed(policy, mesh, chips, tp):
    # Per chip: the data shard's tokens x the kept tensors' bytes per token, every layer.
    device, _, _ = POLICIES[policy]
    fs = chips // tp
    tokens = BATCH * chips / fs * SEQ
    per_token = sum(_widths(tp)[t] for t in device)
    got = estimate_training_memory(model_from_dict(MODEL), parse_mesh(mesh), chips,
                                   _config(policy))
    assert got["activations_bytes"] == pytest.approx(L * tokens * per_token, rel=1e-12)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policy_reruns_exactly_the_matmuls_it_does_not_keep(policy):
    # The MXU FLOPs of a step under a policy less those under `minimal` (which reruns no
    # matmul) are the forward FLOPs of the rerun matmuls, every layer.
    _, _, rerun = POLICIES[policy]
    model = model_from_dict(MODEL)
    base = _mxu_flops(compile_training_step(model, parse_mesh("fsdp=1"), 1, _config("minimal")))
    got = _mxu_flops(compile_training_step(model, parse_mesh("fsdp=1"), 1, _config(policy)))
    f = _flops(BATCH * SEQ)
    assert got - base == pytest.approx(L * sum(f[m] for m in rerun), rel=1e-12)


def test_a_kept_context_spares_a_dot_attentions_value_matmul_only():
    # Dot attention: the backward still reads the probabilities, rebuilt from the kept q and
    # k (the score matmul reruns), but not the attention output (no value matmul).
    model = model_from_dict(MODEL)

    def names(remat):
        trace = compile_training_step(model, parse_mesh("fsdp=1"), 1,
                                      TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH,
                                                     remat=remat, attention="dot"))
        return {op.name for op in trace.ops if op.name.startswith("re-") and op.layer == 0}

    with_context = names("save_dot_with_context_except_mlp")
    assert "re-attn_scores" in with_context and "re-attn_values" not in with_context
    assert "re-qkv_proj" not in with_context and "re-out_proj" not in with_context
    assert {"re-attn_scores", "re-attn_values"} <= names("save_dot_except_mlp")


@pytest.mark.parametrize("save,offload,same", [
    ("query_proj,key_proj,value_proj,out_proj", "", "save_dot_except_mlp"),
    ("qkv_proj,out_proj,mlpwo", "", "save_dot_except_mlpwi"),
    ("query_proj,key_proj,value_proj,out_proj,mlpwi", "", "minimal"),
    ("", "query_proj,key_proj,value_proj", "qkv_proj_offloaded"),
    ("", "", "full"),
])
def test_custom_with_a_named_policys_tensors_is_that_policy(save, offload, same):
    model, mesh = model_from_dict(MODEL), parse_mesh("fsdp=1")
    custom = _config("custom", remat_save=save, remat_offload=offload)
    a = compile_training_step(model, mesh, 1, custom)
    b = compile_training_step(model, mesh, 1, _config(same))
    assert _mxu_flops(a) == pytest.approx(_mxu_flops(b), rel=1e-12)
    assert a.meta.activation_bytes_estimate == pytest.approx(
        b.meta.activation_bytes_estimate, rel=1e-12)


def test_custom_offloading_the_layer_input_and_qkv_is_tpusims_qkv_offload():
    model, mesh = model_from_dict(MODEL), parse_mesh("fsdp=1")
    custom = compile_training_step(model, mesh, 1, _config(
        "custom", remat_offload="decoder_layer_input,query_proj,key_proj,value_proj"))
    legacy = compile_training_step(model, mesh, 1, _config("qkv-offload"))
    sent = [sum(op.bytes for op in t.ops if op.name == "offload_activations")
            for t in (custom, legacy)]
    # 2 layers x 1024 tokens x (input 256 + q 256 + k 128 + v 128) bf16.
    assert sent[0] == sent[1] == L * BATCH * SEQ * 2 * (D + H * HD + 2 * K * HD)
    assert _mxu_flops(custom) == pytest.approx(_mxu_flops(legacy), rel=1e-12)


@pytest.mark.parametrize("kw,message", [
    ({"remat": "minimal", "remat_save": "query_proj"}, "use remat custom"),
    ({"remat": "custom", "remat_save": "q_proj"}, "not one of MaxText's tensor names"),
    ({"remat": "custom", "remat_save": "out_proj", "remat_offload": "out_proj"},
     "both in remat_save and remat_offload"),
    ({"remat": "custom", "remat_save": "mlpwi_0"}, "name both"),
])
def test_bad_custom_policies_are_one_line_errors(kw, message):
    with pytest.raises(TpusimError, match=message):
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, **kw)


def test_the_cli_runs_a_maxtext_policy_and_a_custom_one(capsys, tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("".join(f"{k}: {v}\n" for k, v in MODEL.items()))
    base = ["train", "--chip", "v5e", "--shape", "2x2", "--model", str(model), "--seq-len",
            str(SEQ), "--batch-per-chip", "1", "--mesh", "fsdp=4", "--json", "--quiet"]
    assert main([*base, "--remat", "save_dot_except_mlpwi"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert main([*base, "--remat", "custom", "--remat-save",
                 "query_proj,key_proj,value_proj,out_proj,mlpwo"]) == 0
    custom = json.loads(capsys.readouterr().out)
    assert custom["hbm_peak_bytes"] == named["hbm_peak_bytes"]
    assert custom["step_time_s"] == named["step_time_s"]
    assert main([*base, "--remat", "minimal", "--remat-save", "out_proj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--remat custom" in err[0]


@pytest.mark.parametrize("policy", sorted(POLICIES) + ["custom"])
@pytest.mark.parametrize("attention", ["dot", "flash"])
def test_every_policys_activation_events_balance_over_the_step(policy, attention):
    # What a layer keeps, fetches or recomputes is freed by the end of its backward: the
    # saved-activation and temporary events of a step sum to zero and never go negative.
    kw = {"remat_offload": "decoder_layer_input,out_proj", "remat_save": "qkv_proj"} \
        if policy == "custom" else {}
    trace = compile_training_step(model_from_dict(MODEL), parse_mesh("fsdp=2,tensor=4"), 8,
                                  TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH,
                                                 remat=policy, attention=attention, **kw))
    for cat in ("saved_activations", "temporaries"):
        events = sorted((i, d) for i, c, d in trace.meta.memory_events if c == cat)
        level = 0.0
        for _, d in events:
            level += d
            assert level >= -1e-6
        assert level == pytest.approx(0.0, abs=1e-6)
