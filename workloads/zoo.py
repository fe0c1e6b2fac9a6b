"""The zoo of public architectures (`MODELS`, each entry with its published source) and
models by name or from a file: `load_model` (a zoo name or a YAML file) and `model_from_dict`
(`base: <zoo name>` and overrides, numbers as the `model.*` keys of the `set` overrides read
them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.quantities import parse_quantity
from topologies.registry import Registry
from topologies.validate import one_of, short_repr
from workloads.model_checks import MOE_COUNT_FIELDS, SIZE_FIELDS, is_int
from workloads.models import MODEL_FIELDS, MlpKind, TransformerSpec

_REQUIRED_FIELDS = tuple(
    f.name for f in dataclasses.fields(TransformerSpec)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
_ALLOWED_KEYS = ("base", *MODEL_FIELDS)


# ---- the zoo ---------------------------------------------------------------------------------

# Where every zoo name is listed (the unknown-name messages point there).
_ZOO_LISTING = "docs/howto/custom.md lists the zoo"
MODELS: Registry[TransformerSpec] = Registry("model", listing=_ZOO_LISTING)
# Each zoo model's published source (by its own name) and its other names, for
# docs/presets.md; the comment at each entry says which numbers come from where.
MODEL_SOURCES: dict[str, str] = {}
MODEL_ALIASES: dict[str, tuple[str, ...]] = {}


def _add(spec: TransformerSpec, *aliases: str, source: str) -> None:
    MODELS.add(spec.name, spec)
    MODEL_SOURCES[spec.name] = source
    MODEL_ALIASES[spec.name] = aliases
    for alias in aliases:
        MODELS.add(alias, dataclasses.replace(spec, name=alias))


_LLAMA_SOURCES = {
    "llama2": "Touvron et al. 2023, arXiv:2307.09288 Table 1; meta-llama/Llama-2-*-hf config.json",
    "llama3": "Dubey et al. 2024, arXiv:2407.21783 Table 3; meta-llama/Meta-Llama-3-* and "
              "Llama-3.1-405B config.json",
    "mistral": "Jiang et al. 2023, arXiv:2310.06825 Table 1; mistralai/Mistral-7B-v0.1 "
               "config.json",
}


def _llama(name: str, layers: int, d: int, heads: int, kv: int, d_ff: int, vocab: int,
           *aliases: str) -> None:
    # LLaMA / Mistral layout: SwiGLU, head_dim 128, untied embeddings, sequential block.
    _add(TransformerSpec(name=name, num_layers=layers, d_model=d, num_heads=heads,
                         num_kv_heads=kv, head_dim=128, d_ff=d_ff, mlp=MlpKind.SWIGLU,
                         vocab_size=vocab), *aliases,
         source=_LLAMA_SOURCES[name.split("-")[0]])


# LLaMA-2: Touvron et al. 2023 (arXiv:2307.09288) Table 1 and the meta-llama/Llama-2-{7b,13b,70b}-hf
# config.json files (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# intermediate_size, vocab_size 32000, tie_word_embeddings false).
_llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000)
_llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000)
_llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000)
# LLaMA-3 / 3.1: meta-llama/Meta-Llama-3-{8B,70B} and Llama-3.1-405B config.json; Dubey et al.
# 2024 "The Llama 3 Herd of Models" (arXiv:2407.21783) Table 3 (405B: 126 layers, 16384 wide,
# FFN 53248, 128 heads, 8 KV heads). 3.1 keeps the 3.0 shapes (only RoPE scaling changes).
_llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, "llama3.1-8b")
_llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, "llama3.1-70b")
_llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, "llama3.1-405b")
# Mistral 7B: Jiang et al. 2023 (arXiv:2310.06825) Table 1 and mistralai/Mistral-7B-v0.1
# config.json. Full attention, as MaxText's mistral-7b runs it (reference/maxtext_runs.json);
# the paper's 4096-token window in every layer is `attention_window: 4096` (period 0).
_llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000)

# Mixtral 8x7B: Jiang et al. 2024 (arXiv:2401.04088) Table 1 and mistralai/Mixtral-8x7B-v0.1
# config.json: Mistral-7B shapes with 8 experts, top-2, in every layer (46.7B total / 12.9B active).
_add(TransformerSpec(name="mixtral-8x7b", num_layers=32, d_model=4096, num_heads=32,
                     num_kv_heads=8, head_dim=128, d_ff=14336, mlp=MlpKind.SWIGLU,
                     vocab_size=32000, num_experts=8, experts_per_token=2),
     source="Jiang et al. 2024, arXiv:2401.04088 Table 1; mistralai/Mixtral-8x7B-v0.1 "
            "config.json")
# Mixtral 8x22B: mistralai/Mixtral-8x22B-v0.1 config.json (56 layers, 6144 wide, 48 heads, 8 KV
# heads, 16384 expert FFN, 8 experts top-2); Mistral's announcement gives 141B total / 39B
# active. Vocab 32768 as in MaxText's mixtral-8x22b.yml (reference/maxtext_runs.json); 32000 vs
# 32768 moves the total by < 0.01%.
_add(TransformerSpec(name="mixtral-8x22b", num_layers=56, d_model=6144, num_heads=48,
                     num_kv_heads=8, head_dim=128, d_ff=16384, mlp=MlpKind.SWIGLU,
                     vocab_size=32768, num_experts=8, experts_per_token=2),
     source="mistralai/Mixtral-8x22B-v0.1 config.json; MaxText mixtral-8x22b.yml (vocab)")

# Gemma 2: Gemma Team 2024 (arXiv:2408.00118) Table 1 and google/gemma-2-{9b,27b} config.json
# (the paper's "feedforward dim" 28672 / 73728 counts gate + up, i.e. 2 x intermediate_size).
# GeGLU, tied embeddings, vocab 256000. §2 of the paper: local sliding-window attention (4096
# tokens) alternating with global attention in every other layer (local first: config.json
# `sliding_window` 4096, HF's `is_sliding = not layer_idx % 2`), and RMSNorm on the input and
# the output of every sub-layer (`post_norms`). Not modelled: logit soft-capping.
_add(TransformerSpec(name="gemma2-9b", num_layers=42, d_model=3584, num_heads=16,
                     num_kv_heads=8, head_dim=256, d_ff=14336, mlp=MlpKind.GEGLU,
                     vocab_size=256000, tied_embeddings=True, attention_window=4096,
                     global_layer_period=2, post_norms=True),
     source="Gemma Team 2024, arXiv:2408.00118 Table 1 and §2; google/gemma-2-9b config.json")
_add(TransformerSpec(name="gemma2-27b", num_layers=46, d_model=4608, num_heads=32,
                     num_kv_heads=16, head_dim=128, d_ff=36864, mlp=MlpKind.GEGLU,
                     vocab_size=256000, tied_embeddings=True, attention_window=4096,
                     global_layer_period=2, post_norms=True),
     source="Gemma Team 2024, arXiv:2408.00118 Table 1 and §2; google/gemma-2-27b config.json")
# Gemma 3 12B: Gemma Team 2025, "Gemma 3 Technical Report" (arXiv:2503.19786) §2: 5 local
# layers per global one (`global_layer_period` 6, the 6th, 12th, ... layer global), local
# layers span 1024 tokens, GQA with pre- and post-norm RMSNorm, QK-norm in place of Gemma 2's
# soft-capping, the Gemini 2.0 tokenizer of 262k entries; Table 1: 10,759M non-embedding
# parameters for the 12B (this spec: 10,758,389,760 plus 0.5M norm scales). Shapes as MaxText
# runs it (reference/maxtext_runs.json, the v6e gemma3-12b recipes, from MaxText's
# gemma3-12b.yml): 48 layers, d_model 3840, 16 query heads and 8 KV heads of 256, mlp_dim
# 15360 with GeLU-gated (`gelu`, `linear`) MLPs, vocab 262144, tied embeddings, sliding
# window 1024 with a pattern period of 6.
_add(TransformerSpec(name="gemma3-12b", num_layers=48, d_model=3840, num_heads=16,
                     num_kv_heads=8, head_dim=256, d_ff=15360, mlp=MlpKind.GEGLU,
                     vocab_size=262144, tied_embeddings=True, attention_window=1024,
                     global_layer_period=6, post_norms=True, qk_norm=True),
     source="Gemma Team 2025, arXiv:2503.19786 §2 and Table 1; MaxText gemma3-12b.yml")

# GPT-3 175B: Brown et al. 2020 (arXiv:2005.14165) Table 2.1 (96 layers, d_model 12288, 96 heads
# of 128) and §2.1 (d_ff = 4 d_model, GPT-2 architecture: GELU MLP, tied embeddings, the
# 50257-token GPT-2 BPE vocabulary). Biases and learned position embeddings are not counted.
_add(TransformerSpec(name="gpt3-175b", num_layers=96, d_model=12288, num_heads=96,
                     num_kv_heads=96, head_dim=128, d_ff=49152, mlp=MlpKind.GELU,
                     vocab_size=50257, tied_embeddings=True),
     source="Brown et al. 2020, arXiv:2005.14165 Table 2.1 and §2.1")

# DeepSeek-V3: the config.json of deepseek-ai/DeepSeek-V3 on Hugging Face (hidden_size 7168,
# num_hidden_layers 61, num_attention_heads 128 = num_key_value_heads, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
# n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8, moe_intermediate_size
# 2048, intermediate_size 18432 for the first_k_dense_replace = 3 dense layers, moe_layer_freq
# 1, vocab_size 129280, tie_word_embeddings false, num_nextn_predict_layers 1) and DeepSeek-AI
# 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437) §2.1-2.2 and §4.2: MLA, SwiGLU
# experts, one MTP module. The repository's README_WEIGHTS.md gives 671B main-model
# parameters (36.7B activated) and 11.5B unique MTP parameters. Not modelled: the routers'
# node-limited group top-k (n_group 8, topk_group 4: a routing restriction, not a cost
# here), the bias-based load balancing, YaRN.
_add(TransformerSpec(name="deepseek-v3-671b", num_layers=61, d_model=7168, num_heads=128,
                     num_kv_heads=128, head_dim=192, d_ff=18432, mlp=MlpKind.SWIGLU,
                     vocab_size=129280, num_experts=256, experts_per_token=8, moe_d_ff=2048,
                     num_shared_experts=1, first_dense_layers=3, kv_lora_rank=512,
                     q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                     num_mtp_modules=1), "deepseek-v3",
     source="deepseek-ai/DeepSeek-V3 config.json and README_WEIGHTS.md; DeepSeek-AI 2024, "
            "arXiv:2412.19437 §2")
# DeepSeek-V2-Lite: the config.json of deepseek-ai/DeepSeek-V2-Lite on Hugging Face
# (hidden_size 2048, 27 layers, 16 heads, q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim
# 128, qk_rope_head_dim 64, v_head_dim 128, 64 routed and 2 shared experts, top-6,
# moe_intermediate_size 1408, intermediate_size 10944, first_k_dense_replace 1, moe_layer_freq
# 1, vocab_size 102400, untied) and DeepSeek-AI 2024, "DeepSeek-V2" (arXiv:2405.04434)
# Appendix B: 15.7B parameters, 2.4B activated per token.
_add(TransformerSpec(name="deepseek-v2-lite-16b", num_layers=27, d_model=2048, num_heads=16,
                     num_kv_heads=16, head_dim=192, d_ff=10944, mlp=MlpKind.SWIGLU,
                     vocab_size=102400, num_experts=64, experts_per_token=6, moe_d_ff=1408,
                     num_shared_experts=2, first_dense_layers=1, kv_lora_rank=512,
                     qk_rope_head_dim=64, v_head_dim=128), "deepseek-v2-lite",
     source="deepseek-ai/DeepSeek-V2-Lite config.json; DeepSeek-AI 2024, arXiv:2405.04434 "
            "Appendix B")


def _llama4(name: str, hf: str, experts: int, moe_period: int, *aliases: str) -> None:
    # Llama 4 text model: the config.json (text_config) of meta-llama/Llama-4-Scout-17B-16E and
    # meta-llama/Llama-4-Maverick-17B-128E on Hugging Face: hidden_size 5120, 48 layers, 40
    # query heads and 8 KV heads of head_dim 128, routed experts of intermediate_size 8192
    # (top-1, num_experts_per_tok 1) with one shared expert of the same width in every MoE
    # layer (HF Llama4TextMoe), dense layers of intermediate_size_mlp 16384, MoE layers every
    # interleave_moe_layer_step layers (Scout 1, Maverick 2: layers 1, 3, 5, ...), chunked
    # attention of attention_chunk_size 8192 in three layers of four with every fourth
    # layer global (no_rope_layers: the NoPE layers), vocab_size 202048, untied. Meta's
    # model cards: 17B active parameters of 109B (Scout) and 400B (Maverick) in all, counting
    # the vision encoder this spec leaves out. Not modelled: the parameter-free L2 norm of
    # the queries and keys (use_qk_norm), the attention temperature tuning.
    _add(TransformerSpec(name=name, num_layers=48, d_model=5120, num_heads=40, num_kv_heads=8,
                         head_dim=128, d_ff=16384, mlp=MlpKind.SWIGLU, vocab_size=202048,
                         num_experts=experts, experts_per_token=1, moe_d_ff=8192,
                         num_shared_experts=1, moe_layer_period=moe_period,
                         attention_chunk_size=8192, global_layer_period=4), *aliases,
         source=f"meta-llama/{hf} config.json (text_config) and model card")


_llama4("llama4-scout-17b-16e", "Llama-4-Scout-17B-16E", 16, 1, "llama4-scout")
_llama4("llama4-maverick-17b-128e", "Llama-4-Maverick-17B-128E", 128, 2, "llama4-maverick")


def _maxtext_default(name: str, layers: int, d: int, heads: int, d_ff: int) -> None:
    # MaxText's 2023 default decoder (maxtext.md §2): parallel block, 2-matrix ReLU MLP, MHA with
    # head_dim 256 (so heads x head_dim != d_model in general), tied embeddings, vocab 32768.
    _add(TransformerSpec(name=name, num_layers=layers, d_model=d, num_heads=heads,
                         num_kv_heads=heads, head_dim=256, d_ff=d_ff, mlp=MlpKind.RELU,
                         vocab_size=32768, tied_embeddings=True, parallel_block=True),
         source="MaxText base.yml (Sep 2023) scaled by global_parameter_scale "
                "(reference/maxtext.md §2)")


# Sizes from maxtext.md §2: MaxText base.yml (Sep 2023: base_emb_dim 2560, base_num_heads 8,
# base_mlp_dim 8192, base_num_decoder_layers 16) scaled by global_parameter_scale; these are the
# models behind the 2023 v4 / v5e / v5p README tables, not today's Llama-style base.yml.
_maxtext_default("maxtext-16b", 32, 5120, 32, 32768)
_maxtext_default("maxtext-32b", 32, 10240, 32, 32768)
_maxtext_default("maxtext-64b", 64, 10240, 32, 32768)
_maxtext_default("maxtext-128b", 64, 10240, 64, 65536)
_maxtext_default("maxtext-256b", 64, 20480, 64, 65536)
_maxtext_default("maxtext-512b", 128, 20480, 64, 65536)
_maxtext_default("maxtext-1024b", 128, 20480, 128, 131072)
# The Apr-2023 v4 table's models (maxtext.md §2, `scale=3` and `scale=4`).
_maxtext_default("maxtext-22b", 48, 6144, 24, 24576)
_maxtext_default("maxtext-52b", 32, 12288, 32, 49152)


# ---- config boundary -------------------------------------------------------------------------


def model_from_dict(
    data: Mapping[str, Any], *, default_name: str | None = None, source: str = "model config"
) -> TransformerSpec:
    """Build a `TransformerSpec` from a mapping of its field names (no disk I/O).

    `base: <zoo name>` starts from a zoo model and overrides the given fields. Without `base`,
    every field without a default is required.

    Args:
        data: field name -> value, as parsed from YAML.
        default_name: name to use when `data` has no `name` (e.g. the file stem).
        source: where `data` came from, for error messages.

    Raises:
        TpusimError: unknown keys (the message lists the allowed ones), missing required keys,
            an unknown base, or any field that fails `TransformerSpec` validation.
    """
    if not isinstance(data, Mapping):
        raise TpusimError(
            f"{source}: expected a mapping of TransformerSpec fields, got {type(data).__name__}; "
            f"write `key: value` lines such as `num_layers: 32`"
        )
    unknown = sorted(key[:40] if isinstance(key, str) else short_repr(key, 40) for key in data
                     if not isinstance(key, str) or key not in _ALLOWED_KEYS)[:5]
    if unknown:
        raise TpusimError(
            f"{source}: unknown key(s) {', '.join(unknown)}; "
            f"{one_of(unknown[0], _ALLOWED_KEYS, listing='docs/howto/custom.md lists them')}"
        )
    fields = {key: value for key, value in data.items() if key != "base"}
    base_name = data.get("base")
    if base_name is not None:
        if not isinstance(base_name, str):
            raise TpusimError(
                f"{source}: base={short_repr(base_name)} is not a model name; give a zoo name "
                f"such as `base: llama3-8b` ({_ZOO_LISTING})"
            )
        if base_name not in MODELS:
            raise TpusimError(
                f"{source}: base {short_repr(base_name)} is not a zoo model; "
                f"{one_of(base_name, MODELS.names(), listing=_ZOO_LISTING)}"
            )
        base = MODELS.get(base_name)
        fields = {**base.to_dict(), "name": default_name or base.name,
                  **_quantities(fields, base, source)}
    elif "name" not in fields and default_name is not None:
        fields["name"] = default_name
    else:
        fields = _quantities(fields, None, source)
    missing = [key for key in _REQUIRED_FIELDS if key not in fields]
    if missing:
        raise TpusimError(
            f"{source}: missing required key(s) {', '.join(missing)}; add them, or start from a "
            f"zoo model with `base: <name>` ({_ZOO_LISTING})"
        )
    return TransformerSpec(**fields)


# The numeric fields (all whole counts), and those whose null means "not set".
_NUMERIC_FIELDS = (*SIZE_FIELDS, *MOE_COUNT_FIELDS, "moe_d_ff", "attention_window",
                   "global_layer_period")
_NULLABLE_FIELDS = ("moe_d_ff", "attention_window")


def _quantities(fields: dict[str, Any], base: TransformerSpec | None,
                source: str) -> dict[str, Any]:
    """`fields` with each numeric field given as text read as a `model.*` override reads it
    (`topologies.quantities`): a number (`1e3`, `'4096'`), or `xF` of the `base:` model's value
    (`d_ff: x2`); a whole result becomes an int, anything else is left for the spec's check."""
    out = dict(fields)
    for key in _NUMERIC_FIELDS:
        text = out.get(key)
        if not isinstance(text, str):
            continue
        if key in _NULLABLE_FIELDS and text.strip().lower() in ("none", "null"):
            out[key] = None
            continue
        what = f"{source}: {key} = {short_repr(text)}"
        q = parse_quantity(what, key, text, base_word="the base model")
        if q.multiplier is not None:
            base_value = None if base is None else getattr(base, key)
            if not is_int(base_value):
                raise TpusimError(
                    f"{what}: a multiplier needs a base model with a numeric {key}"
                    + ("; add `base: llama3-8b` (or another zoo model) or give a whole number"
                       if base is None else f" ({base.name}'s is {base_value!r}); give a whole "
                                            f"number"))
        v = q.resolve(None if base is None else getattr(base, key))
        if q.multiplier is not None and not float(v).is_integer():
            raise TpusimError(f"{what}: {getattr(base, key)} x {q.multiplier:g} = {v:g} is not "
                              f"a whole number; {key} counts whole units")
        out[key] = int(v) if math.isfinite(v) and float(v).is_integer() else v
    return out


def load_model(name_or_path: str) -> TransformerSpec:
    """A zoo model by name, or a YAML file of `TransformerSpec` fields.

    The file's keys are the field names (see `model_from_dict`); `name` defaults to the file
    stem and `base: <zoo name>` starts from a zoo model.

    Raises:
        TpusimError: an unknown name, a missing / unreadable / malformed file, or a bad field.
    """
    if name_or_path in MODELS:
        return MODELS.get(name_or_path)
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json") and not path.exists():
        raise TpusimError(
            f"unknown model {short_repr(name_or_path)}: it is neither a zoo model nor an existing "
            f"file; {one_of(name_or_path, MODELS.names(), listing=_ZOO_LISTING)}, or give a path "
            f"to a .yaml file"
        )
    # Imported here: only this loader touches the disk (building specs never does).
    from topologies.yamlio import read_yaml_mapping

    data = read_yaml_mapping(path, what="model")
    source = f"model file {str(path)!r}"
    try:
        return model_from_dict(data, default_name=path.stem, source=source)
    except TpusimError as exc:
        if str(exc).startswith(source):
            raise
        raise TpusimError(f"{source}: {exc}") from None
