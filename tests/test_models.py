"""Tests for workloads/models.py, model_checks.py and zoo.py: parameter and FLOP arithmetic
against the textbook's worked numbers (reference/book_cases.json) and MaxText's FLOP eras
(reference/maxtext_runs.json), the model zoo, and the YAML boundary.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from topologies.errors import TpusimError
from workloads.models import (
    MODEL_FIELDS,
    OPTIONAL_FIELDS,
    MaxTextFlopEra,
    MlpKind,
    TransformerSpec,
    causal_window_pairs,
)
from workloads.zoo import MODELS, load_model, model_from_dict

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def _reference_json(name: str) -> list[dict]:
    path = REFERENCE / name
    return json.loads(path.read_text(encoding="utf-8"))


def _book_case(case_id: str) -> dict:
    for case in _reference_json("book_cases.json"):
        if case["id"] == case_id:
            return case
    raise AssertionError(f"book case {case_id!r} not found in book_cases.json")


def _recomputed(case: dict) -> float:
    """The exact recomputation quoted in the case's tolerance_note ("Recomputed by us: X")."""
    match = re.search(r"Recomputed by us: ([0-9.e+]+)", case["tolerance_note"])
    assert match, f"{case['id']}: tolerance_note has no recomputation"
    return float(match.group(1))


def _spec(**overrides: object) -> TransformerSpec:
    """A small valid dense model; tests override what they need."""
    fields: dict[str, object] = {
        "name": "tiny", "num_layers": 2, "d_model": 64, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "d_ff": 256, "mlp": MlpKind.SWIGLU, "vocab_size": 1000,
    }
    fields.update(overrides)
    return TransformerSpec(**fields)


def _non_norm_params(spec: TransformerSpec) -> int:
    """Attention + MLP + embeddings: what the book's and MaxText's counts include."""
    return spec.num_params - spec.num_norm_params


# ---- textbook worked numbers (book_cases.json, kind "transformer_count") -----------------------

BOOK_CASES_TESTED = {
    "transformers-q1-params",
    "transformers-attention-dominance",
    "transformers-q5-attn-eq-qkvo",
    "training-q1-llama2-13b-params",
    "applied-training-llama3-70b-params",
    "applied-training-llama3-70b-flops-total",
    "inference-q1-params",
    "inference-q5-moe-total-params",
    "inference-q5-moe-active-params",
}


def test_every_book_transformer_count_case_has_a_test() -> None:
    ids = {c["id"] for c in _reference_json("book_cases.json") if c["kind"] == "transformer_count"}
    assert ids == BOOK_CASES_TESTED


def test_book_transformers_q1_params_match_exact_recomputation_not_the_slipped_16e9() -> None:
    # tpu.md §7 item 1: the book's 16e9 comes from rounding D and F; exact arithmetic is 17.44e9.
    case = _book_case("transformers-q1-params")
    d, f, v, layers = (case["inputs"][k] for k in ("D", "F", "V", "L"))
    spec = _spec(num_layers=layers, d_model=d, num_heads=32, num_kv_heads=32, head_dim=d // 32,
                 d_ff=f, vocab_size=v)
    # Book formula L*(3DF + 4DNH + D) + 2DV counts one norm per layer and no final norm.
    assert _non_norm_params(spec) == layers * (3 * d * f + 4 * d * d) + 2 * d * v
    assert spec.num_params == pytest.approx(_recomputed(case), rel=1e-3)
    assert spec.num_params == pytest.approx(17.44e9, rel=1e-3)
    assert abs(spec.num_params - case["expected"]) / spec.num_params > 0.05


def test_book_attention_flops_equal_matmul_flops_at_8d_tokens() -> None:
    # Attention / matmul FLOPs = T/(8D) when F = 4D, D = NH and N = K (gated MLP, full mask).
    case = _book_case("transformers-attention-dominance")
    d = case["inputs"]["D"]
    spec = _spec(num_layers=1, d_model=d, num_heads=64, num_kv_heads=64, head_dim=d // 64,
                 d_ff=4 * d)
    layer_matmul = 2 * (spec.attention_params_per_layer + spec.dense_mlp_params_per_layer)
    crossover = 8 * d
    assert crossover == case["expected"] == pytest.approx(_recomputed(case), rel=1e-3)
    assert spec.attention_flops_per_token(crossover, causal=False) == layer_matmul
    assert spec.attention_flops_per_token(1024, causal=False) / layer_matmul == 1024 / (8 * d)


def test_book_attention_flops_equal_qkvo_flops_at_2d_tokens() -> None:
    # Training FLOPs per layer: QKVO 24BTDNH (MHA, NH = D) vs dot-product attention 12BT^2NH.
    case = _book_case("transformers-q5-attn-eq-qkvo")
    d = case["inputs"]["D"]
    spec = _spec(num_layers=1, d_model=d, num_heads=32, num_kv_heads=32, head_dim=d // 32)
    seq = int(_recomputed(case))
    assert seq == 2 * d == case["expected"]
    qkvo_training = 3 * 2 * spec.attention_params_per_layer
    assert 3 * spec.attention_flops_per_token(seq, causal=False) == qkvo_training


def test_book_training_q1_llama2_13b_params() -> None:
    case = _book_case("training-q1-llama2-13b-params")
    i = case["inputs"]
    spec = _spec(num_layers=i["L"], d_model=i["D"], num_heads=i["N"], num_kv_heads=i["K"],
                 head_dim=i["H"], d_ff=i["F"], vocab_size=i["V"])
    assert spec == dataclasses.replace(MODELS.get("llama2-13b"), name="tiny")
    assert spec.num_params == pytest.approx(_recomputed(case), rel=1e-3)
    assert spec.num_params == pytest.approx(case["expected"], rel=0.01)


def test_book_llama3_70b_params_equal_the_zoo_model() -> None:
    # The book sums rounded parts (70.4e9); the exact sum, norms ignored, is 70.55e9.
    case = _book_case("applied-training-llama3-70b-params")
    i = case["inputs"]
    zoo = MODELS.get("llama3-70b")
    zoo_dims = (zoo.num_layers, zoo.d_model, zoo.d_ff, zoo.num_heads, zoo.num_kv_heads,
                zoo.head_dim, zoo.vocab_size)
    assert zoo_dims == tuple(i[k] for k in ("L", "D", "F", "N", "K", "H", "V"))
    d, f, layers, v = i["D"], i["F"], i["L"], i["V"]
    attn = layers * (2 * d * i["N"] * i["H"] + 2 * d * i["K"] * i["H"])
    assert _non_norm_params(zoo) == 3 * layers * d * f + 2 * v * d + attn
    assert _non_norm_params(zoo) == pytest.approx(_recomputed(case), rel=1e-3)


def test_book_llama3_70b_training_flops_are_6_params_tokens() -> None:
    case = _book_case("applied-training-llama3-70b-flops-total")
    params, tokens = case["inputs"]["params"], case["inputs"]["tokens"]
    assert 6 * params * tokens == pytest.approx(_recomputed(case), rel=1e-9)
    # The zoo model's matmul FLOPs (3 x forward, no attention) give the book's 4.2e11 per token.
    zoo = MODELS.get("llama3-70b")
    assert 3 * zoo.forward_matmul_flops_per_token == pytest.approx(4.2e11, rel=0.01)
    assert 3 * zoo.forward_matmul_flops_per_token * tokens == pytest.approx(
        case["expected"], rel=0.01
    )


def _inference_q_spec(inputs: dict, **moe: object) -> TransformerSpec:
    return _spec(num_layers=inputs["L"], d_model=inputs["D"], num_heads=inputs["N"],
                 num_kv_heads=inputs["K"], head_dim=inputs["H"], d_ff=inputs["F"],
                 vocab_size=inputs["V"], tied_embeddings=True, **moe)


def test_book_inference_q1_params_with_shared_embedding() -> None:
    case = _book_case("inference-q1-params")
    i = case["inputs"]
    spec = _inference_q_spec(i)
    assert _non_norm_params(spec) == (
        i["L"] * i["D"] * (3 * i["F"] + 2 * i["H"] * (i["N"] + i["K"])) + i["D"] * i["V"]
    )
    assert spec.num_params == pytest.approx(_recomputed(case), rel=1e-3)


def test_book_inference_q5_moe_total_and_active_params() -> None:
    total_case = _book_case("inference-q5-moe-total-params")
    active_case = _book_case("inference-q5-moe-active-params")
    i = total_case["inputs"]
    assert active_case["inputs"] == i
    spec = _inference_q_spec(i, num_experts=i["E"], experts_per_token=i["k"])
    layers, d = i["L"], i["D"]
    attn = 2 * i["H"] * (i["N"] + i["K"])
    # The book leaves out the router (d_model x E per layer); we count it.
    router = layers * d * i["E"]
    assert _non_norm_params(spec) - router == layers * d * (3 * i["E"] * i["F"] + attn) + d * i["V"]
    active_no_norms = spec.num_active_params - spec.num_norm_params - router
    assert active_no_norms == layers * d * (3 * i["k"] * i["F"] + attn) + d * i["V"]
    assert spec.num_params == pytest.approx(_recomputed(total_case), rel=1e-3)
    assert spec.num_active_params == pytest.approx(_recomputed(active_case), rel=1e-3)


# ---- zoo -------------------------------------------------------------------------------------


def test_llama3_70b_and_405b_params_match_their_model_cards() -> None:
    llama70 = MODELS.get("llama3-70b")
    llama405 = MODELS.get("llama3-405b")
    # Exact matmul + embedding counts (maxtext_runs.json params_total_computed).
    assert _non_norm_params(llama70) == 70_552_387_584
    assert _non_norm_params(llama405) == 405_849_243_648
    assert llama70.num_params == pytest.approx(70.6e9, rel=1e-3)
    assert llama405.num_params == pytest.approx(405.8e9, rel=1e-3)


def test_mixtral_8x7b_total_and_active_params() -> None:
    mixtral = MODELS.get("mixtral-8x7b")
    assert _non_norm_params(mixtral) == 46_702_526_464
    assert mixtral.num_active_params - mixtral.num_norm_params == 12_879_659_008
    assert mixtral.num_params == pytest.approx(46.7e9, rel=1e-3)
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=2e-3)


@pytest.mark.parametrize(
    ("name", "published_params"),
    [
        ("llama2-7b", 6.74e9),
        ("llama2-13b", 13.0e9),
        ("llama2-70b", 69.0e9),
        ("llama3-8b", 8.03e9),
        ("mistral-7b", 7.24e9),
        ("mixtral-8x22b", 141e9),
        ("gemma2-9b", 9.24e9),
        ("gemma2-27b", 27.2e9),
        ("gpt3-175b", 175e9),
    ],
)
def test_zoo_model_params_match_published_size(name: str, published_params: float) -> None:
    assert MODELS.get(name).num_params == pytest.approx(published_params, rel=0.005)


def test_mixtral_8x22b_active_params_match_39b() -> None:
    assert MODELS.get("mixtral-8x22b").num_active_params == pytest.approx(39e9, rel=0.01)


def test_llama31_aliases_have_llama3_shapes_under_their_own_names() -> None:
    for size in ("8b", "70b", "405b"):
        alias = MODELS.get(f"llama3.1-{size}")
        assert alias.name == f"llama3.1-{size}"
        assert dataclasses.replace(alias, name=f"llama3-{size}") == MODELS.get(f"llama3-{size}")


# maxtext.md §2 table: (L, E, H, F, params with tied embedding, matmul + embedding only).
MAXTEXT_FAMILY = {
    "maxtext-16b": (32, 5120, 32, 32768, 16.27e9),
    "maxtext-32b": (32, 10240, 32, 32768, 32.55e9),
    "maxtext-64b": (64, 10240, 32, 32768, 64.76e9),
    "maxtext-128b": (64, 10240, 64, 65536, 129.18e9),
    "maxtext-256b": (64, 20480, 64, 65536, 258.37e9),
    "maxtext-512b": (128, 20480, 64, 65536, 516.07e9),
    "maxtext-1024b": (128, 20480, 128, 131072, 1031.46e9),
    "maxtext-22b": (48, 6144, 24, 24576, 21.94e9),
    "maxtext-52b": (32, 12288, 32, 49152, 51.94e9),
}


@pytest.mark.parametrize("name", list(MAXTEXT_FAMILY))
def test_maxtext_2023_family_reproduces_the_params_table(name: str) -> None:
    layers, d, heads, d_ff, params = MAXTEXT_FAMILY[name]
    spec = MODELS.get(name)
    assert (spec.num_layers, spec.d_model, spec.num_heads, spec.num_kv_heads, spec.d_ff) == (
        layers, d, heads, heads, d_ff
    )
    assert (spec.head_dim, spec.mlp, spec.vocab_size) == (256, MlpKind.RELU, 32768)
    assert spec.tied_embeddings and spec.parallel_block
    assert spec.num_params == pytest.approx(params, rel=0.005)
    assert _non_norm_params(spec) == pytest.approx(params, rel=5e-4)


def test_every_zoo_model_is_valid_and_named_as_registered() -> None:
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.num_active_params <= spec.num_params


# ---- FLOPs and memory ------------------------------------------------------------------------


def test_mlp_kinds_have_two_or_three_matrices() -> None:
    assert [k.num_matrices for k in MlpKind] == [2, 2, 3, 3]
    assert MlpKind("swiglu") == "swiglu"


def test_forward_matmul_flops_count_output_projection_once_and_skip_lookup() -> None:
    untied = _spec()
    tied = _spec(tied_embeddings=True)
    assert untied.forward_matmul_flops_per_token == tied.forward_matmul_flops_per_token
    assert untied.forward_matmul_flops_per_token == 2 * (
        untied.num_params - untied.num_norm_params - untied.d_model * untied.vocab_size
    )


def test_moe_forward_flops_use_router_and_active_experts_only() -> None:
    moe = _spec(num_layers=4, num_experts=8, experts_per_token=2, moe_d_ff=64,
                num_shared_experts=1, first_dense_layers=1)
    dense_layer = moe.attention_params_per_layer + moe.dense_mlp_params_per_layer
    moe_layer = moe.attention_params_per_layer + (2 + 1) * 3 * 64 * 64 + 64 * 8
    assert moe.num_moe_layers == 3 and moe.num_dense_layers == 1
    assert moe.forward_matmul_flops_per_token == 2 * (dense_layer + 3 * moe_layer + 64 * 1000)
    assert moe.moe_mlp_params_per_layer == (8 + 1) * 3 * 64 * 64 + 64 * 8


def test_causal_attention_is_half_of_full_attention() -> None:
    spec = _spec()
    full = spec.attention_flops_per_token(2048, causal=False)
    assert full == 4 * 2048 * 4 * 16 * 2
    assert spec.attention_flops_per_token(2048) == full // 2


# ---- sliding-window (local / global) attention -----------------------------------------------


def test_causal_window_pairs_count_min_window_position_keys_per_query() -> None:
    # seq 8, window 3: the queries at positions 1..8 attend to 1, 2, 3, 3, 3, 3, 3, 3 keys.
    assert causal_window_pairs(8, 3) == 1 + 2 + 3 + 3 * 5 == 21
    # A window of the whole sequence (or more) is the causal triangle, diagonal included.
    assert causal_window_pairs(8, 8) == causal_window_pairs(8, 100) == 8 * 9 // 2
    assert causal_window_pairs(8, 1) == 8


def test_local_global_pattern_makes_the_last_layer_of_each_period_global() -> None:
    spec = _spec(num_layers=12, attention_window=3, global_layer_period=6)
    windows = [spec.layer_attention_window(i) for i in range(12)]
    assert windows == [3, 3, 3, 3, 3, None] * 2
    assert (spec.num_local_layers, spec.num_global_layers) == (10, 2)
    # Period 0: every layer local; no window: every layer global.
    all_local = _spec(num_layers=5, attention_window=3)
    assert all_local.num_local_layers == 5 and all_local.layer_attention_window(4) == 3
    assert _spec(num_layers=5).num_global_layers == 5
    # A layer count that is not a multiple of the period ends on local layers (Gemma 3 4B: 34).
    assert _spec(num_layers=8, attention_window=3, global_layer_period=6).num_global_layers == 1


def test_windowed_attention_flops_count_the_window_pairs_by_hand() -> None:
    # 2 layers (one local with window 3, one global), seq 8, 4 heads of 16: a (query, key) pair
    # costs 4 x heads x head_dim FLOPs forward (q.k and p.v, 2 FLOPs per multiply-add each).
    spec = _spec(num_layers=2, attention_window=3, global_layer_period=2)
    per_pair = 4 * 4 * 16
    local_pairs, global_pairs = 21, 8 * 8 / 2  # global: the causal half (tpu.md §3)
    assert spec.attention_flops_per_token(8) * 8 == per_pair * (local_pairs + global_pairs)
    assert spec.attended_keys_per_query(8, 0) == 21 / 8
    assert spec.attended_keys_per_query(8, 1) == 4.0
    # Non-causal: every query sees min(window, seq) keys in a local layer, seq in a global one.
    assert spec.attention_flops_per_token(8, causal=False) == per_pair * (3 + 8)
    # A window as long as the sequence costs what full attention does, never more.
    assert _spec(attention_window=8, global_layer_period=2).attention_flops_per_token(8) == \
        _spec().attention_flops_per_token(8)
    assert _spec(attention_window=7).attended_keys_per_query(8, 0) == 4.0


def test_local_layer_kv_cache_holds_at_most_its_window() -> None:
    spec = _spec(num_layers=6, attention_window=3, global_layer_period=3)  # 4 local, 2 global
    assert spec.kv_cache_entries(2) == 6 * 2  # shorter than the window: every position
    assert spec.kv_cache_entries(10) == 4 * 3 + 2 * 10
    # 2 (K and V) x 2 KV heads x head_dim 16 x 2 bytes per cached position.
    assert spec.kv_cache_bytes(10) == 2 * 2 * 16 * 2 * (4 * 3 + 2 * 10)
    full = _spec(num_layers=6)
    assert full.kv_cache_bytes(10) == 10 * full.kv_cache_bytes_per_token()


def test_gemma3_12b_preset_matches_the_paper_and_maxtexts_flop_count() -> None:
    spec = MODELS.get("gemma3-12b")
    # Gemma 3 report Table 1: 10,759M non-embedding parameters (the norms are 0.5M of them).
    non_embedding = spec.num_params - spec.num_embedding_params
    assert non_embedding == pytest.approx(10_759e6, rel=1e-4)
    assert spec.norm_params_per_layer == 4 * 3840 + 2 * 256  # pre, post norms; q, k norms
    assert (spec.num_local_layers, spec.num_global_layers) == (40, 8)
    # The run record's MaxText FLOPs (both eras), from the preset alone.
    assert spec.maxtext_flops_per_device(1, 32768, "matmul_causal") / 1e12 == \
        pytest.approx(2557.189, abs=1e-3)
    assert spec.maxtext_flops_per_device(1, 32768, "matmul_noncausal") / 1e12 == \
        pytest.approx(2801.281, abs=1e-3)


def test_training_flops_are_three_forward_passes() -> None:
    spec = MODELS.get("llama3-8b")
    tokens, seq = 4 * 8192, 8192
    forward = spec.forward_flops_per_token(seq, causal=True)
    assert spec.training_flops(tokens, seq) == 3 * tokens * forward
    extra = spec.training_flops(tokens, seq, causal=False) - spec.training_flops(tokens, seq)
    assert extra == 3 * tokens * spec.attention_flops_per_token(seq, causal=True)


def test_kv_cache_bytes_per_token_match_the_book() -> None:
    # tpu.md §7 item 6: LLaMA-3-70B int8 KV cache is exactly 163,840 bytes per token.
    assert MODELS.get("llama3-70b").kv_cache_bytes_per_token(1) == 163_840
    assert MODELS.get("llama2-13b").kv_cache_bytes_per_token(2) == 2 * 40 * 40 * 128 * 2


def _mlp_kind(activations: list[str]) -> MlpKind:
    return {
        ("relu",): MlpKind.RELU,
        ("gelu",): MlpKind.GELU,
        ("silu", "linear"): MlpKind.SWIGLU,
        ("gelu", "linear"): MlpKind.GEGLU,
    }[tuple(activations)]


def _spec_from_run(model: dict) -> TransformerSpec:
    return TransformerSpec(
        name=model["name"], num_layers=model["num_layers"], d_model=model["emb_dim"],
        num_heads=model["num_query_heads"], num_kv_heads=model["num_kv_heads"],
        head_dim=model["head_dim"], d_ff=model["mlp_dim"],
        mlp=_mlp_kind(model["mlp_activations"]), vocab_size=model["vocab_size"],
        tied_embeddings=model["tied_embeddings"],
        parallel_block=model.get("parallel_attn_mlp_block", False),
        num_experts=model.get("num_experts", 0),
        experts_per_token=model.get("num_experts_per_tok", 0),
        attention_window=model.get("sliding_window_size"),
        global_layer_period=(model.get("attention_pattern") or {}).get("period", 0),
    )


def test_maxtext_flops_reproduce_every_stored_era_value() -> None:
    checked: dict[str, int] = {}
    for run in _reference_json("maxtext_runs.json"):
        accounting = run.get("maxtext_flop_accounting") or {}
        model = run["model"]
        stored = accounting.get("model_tflops_per_device_per_step")
        if stored is None:
            continue
        spec = _spec_from_run(model)
        assert spec.mlp.num_matrices == model["num_mlp_matrices"], run["id"]
        assert _non_norm_params(spec) == model["params_total_computed"], run["id"]
        batch = run["batch"]
        eras = {accounting["formula_era"]: stored,
                **accounting["same_run_under_other_formula_eras"]}
        for era, tflops in eras.items():
            got = spec.maxtext_flops_per_device(batch["per_device_batch_size"], batch["seq_len"],
                                                era)
            assert got / 1e12 == pytest.approx(tflops, rel=1e-3), (run["id"], era)
            checked[era] = checked.get(era, 0) + 1
    assert set(checked) == set(MaxTextFlopEra), checked
    assert sum(checked.values()) >= 86  # the three Gemma-3 runs' two eras included


def test_maxtext_matmul_era_counts_tied_output_projection_once() -> None:
    spec = MODELS.get("maxtext-16b")
    noncausal = spec.maxtext_flops_per_device(6, 2048, "matmul_noncausal")
    assert noncausal == 3 * 6 * 2048 * spec.forward_flops_per_token(2048, causal=False)
    six_p = spec.maxtext_flops_per_device(6, 2048, MaxTextFlopEra.SIX_P)
    assert six_p == 6 * spec.num_params * 6 * 2048


def test_unknown_maxtext_era_is_refused_with_the_known_eras() -> None:
    with pytest.raises(TpusimError, match="6P\\+attn12.*matmul_causal"):
        _spec().maxtext_flops_per_device(1, 128, "7P")


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda s: s.attention_flops_per_token(0), "seq_len=0"),
        (lambda s: s.training_flops(-5, 128), "tokens=-5"),
        (lambda s: s.kv_cache_bytes_per_token(0), "bytes_per_elem=0"),
        (lambda s: s.maxtext_flops_per_device(0, 128, "6P"), "per_device_batch=0"),
    ],
)
def test_non_positive_flop_arguments_are_refused(call, pattern: str) -> None:
    with pytest.raises(TpusimError, match=pattern):
        call(_spec())


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"num_layers": 0}, r"num_layers=0 must be a positive integer"),
        ({"d_model": -64}, r"d_model=-64 must be a positive integer"),
        ({"head_dim": 16.0}, r"head_dim=16\.0 must be a positive integer"),
        ({"vocab_size": "1000"}, r"vocab_size='1000' must be a positive integer"),
        ({"num_heads": True}, r"num_heads=True must be a positive integer"),
        ({"mlp": "swish"}, r"mlp='swish' is not a known MLP kind; use one of: relu, gelu"),
        ({"tied_embeddings": "yes"}, r"tied_embeddings='yes' must be a boolean"),
        ({"num_heads": 6, "num_kv_heads": 4}, r"num_kv_heads=4 does not divide num_heads=6"),
        ({"name": ""}, r"model name '' is not a non-empty string"),
        ({"experts_per_token": 2}, r"experts_per_token=2 is set but num_experts=0"),
        ({"moe_d_ff": 64}, r"moe_d_ff=64 is set but num_experts=0"),
        ({"num_experts": -1}, r"num_experts=-1 must be a non-negative integer"),
        ({"num_experts": 4, "experts_per_token": 5}, r"experts_per_token=5 must be between 1"),
        ({"num_experts": 4, "experts_per_token": 0}, r"experts_per_token=0 must be between 1"),
        ({"num_experts": 4, "experts_per_token": 1, "moe_d_ff": 0}, r"moe_d_ff=0 must be"),
        ({"num_experts": 4, "experts_per_token": 1, "first_dense_layers": 2},
         r"first_dense_layers=2 leaves no MoE layer"),
        ({"attention_window": 0}, r"attention_window=0 must be a whole number of tokens"),
        ({"attention_window": -4}, r"attention_window=-4 must be a whole number of tokens"),
        ({"attention_window": 2.5}, r"attention_window=2\.5 must be a whole number"),
        ({"attention_window": 4, "global_layer_period": -1},
         r"global_layer_period=-1 must be a whole number"),
        ({"global_layer_period": 2}, r"global_layer_period=2 is set but attention_window is "
                                     r"null"),
        ({"attention_window": 4, "global_layer_period": 1},
         r"global_layer_period=1 makes every layer global"),
        ({"attention_window": 4, "global_layer_period": 3},
         r"global_layer_period=3 does not fit num_layers=2"),
        ({"post_norms": True, "parallel_block": True}, r"post_norms=True is modelled for "
                                                       r"sequential blocks only"),
        ({"qk_norm": 1}, r"qk_norm=1 must be a boolean"),
    ],
)
def test_invalid_field_is_refused_naming_field_value_and_fix(
    overrides: dict, pattern: str
) -> None:
    with pytest.raises(TpusimError, match=pattern) as info:
        _spec(**overrides)
    message = str(info.value)
    assert "\n" not in message
    assert ";" in message  # the rule is followed by what to change


def test_mlp_string_is_coerced_to_the_enum() -> None:
    assert _spec(mlp="gelu").mlp is MlpKind.GELU


# ---- YAML / dict boundary --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3-70b", "mixtral-8x7b", "maxtext-16b", "gemma2-9b"])
def test_yaml_round_trip_gives_an_equal_spec(tmp_path: Path, name: str) -> None:
    spec = MODELS.get(name)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()), encoding="utf-8")
    assert load_model(str(path)) == spec
    # The fields of the newer families are written only when they are set.
    assert set(spec.to_dict()) == set(MODEL_FIELDS) - OPTIONAL_FIELDS


def test_moe_yaml_round_trip_keeps_deepseek_style_fields(tmp_path: Path) -> None:
    spec = _spec(num_layers=4, num_experts=8, experts_per_token=2, moe_d_ff=64,
                 num_shared_experts=2, first_dense_layers=1)
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()), encoding="utf-8")
    assert load_model(str(path)) == spec


def test_load_model_by_zoo_name_is_case_insensitive() -> None:
    assert load_model("LLaMA3-8B") is MODELS.get("llama3-8b")


def test_yaml_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    data = _spec().to_dict()
    del data["name"]
    path = tmp_path / "my-model.yml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert load_model(str(path)).name == "my-model"


def test_yaml_base_starts_from_a_zoo_model_and_overrides_fields(tmp_path: Path) -> None:
    path = tmp_path / "short-llama.yaml"
    path.write_text("base: llama3-8b\nnum_layers: 2\n", encoding="utf-8")
    spec = load_model(str(path))
    assert spec.name == "short-llama"
    assert spec.num_layers == 2
    expected = dataclasses.replace(MODELS.get("llama3-8b"), name="short-llama", num_layers=2)
    assert spec == expected


def test_model_from_dict_needs_no_disk_and_keeps_base_name_without_default() -> None:
    assert model_from_dict({"base": "mistral-7b"}) == MODELS.get("mistral-7b")
    assert model_from_dict(_spec().to_dict()) == _spec()


def _write(tmp_path: Path, text: str, name: str = "bad.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("base: llama3-8b\nlayers: 2\n", r"unknown key\(s\) layers; did you mean num_layers\?"),
        ("name: x\nnum_layers: 2\n", r"missing required key\(s\) d_model, num_heads"),
        ("base: llama3-8b\nnum_layers: two\n", r"num_layers = 'two': not a number"),
        ("base: llama3-8b\nmlp: SwiGLU\n", r"mlp='SwiGLU' is not a known MLP kind"),
        ("base: lama3-8b\n", r"base 'lama3-8b' is not a zoo model; did you mean llama3-8b, "),
        ("base: [llama3-8b]\n", r"base=\['llama3-8b'\] is not a model name"),
        ("num_layers: [1, 2\n", r"is not valid YAML at line"),
        ("- 1\n- 2\n", r"must hold a mapping"),
        ("", r"must hold a mapping"),
    ],
)
def test_bad_model_file_gives_one_line_error(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(TpusimError, match=pattern) as info:
        load_model(_write(tmp_path, text))
    assert "\n" not in str(info.value)
    assert "bad.yaml" in str(info.value)


def test_missing_model_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(TpusimError, match=r"does not exist"):
        load_model(str(tmp_path / "absent.yaml"))


def test_unknown_model_name_lists_the_zoo() -> None:
    with pytest.raises(TpusimError, match=r"unknown model 'llama9'.*llama3-70b.*\.yaml file"):
        load_model("llama9")


def test_model_from_dict_refuses_non_mappings() -> None:
    with pytest.raises(TpusimError, match=r"expected a mapping .* got list"):
        model_from_dict([1, 2])  # type: ignore[arg-type]
