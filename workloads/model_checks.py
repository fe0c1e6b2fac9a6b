"""The rules a `TransformerSpec` (workloads/models.py) must follow: every field's type and range
and the combinations that make sense (MoE counts, local/global attention patterns, multi-head
latent attention, multi-token prediction). Each broken rule is a one-line `TpusimError` naming
the field, its value, the rule and the fix; `TransformerSpec.__post_init__` runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from topologies.errors import TpusimError
from topologies.validate import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_MODEL_DIM,
    MAX_TOKENS,
    interval_text,
    range_text,
    short_repr,
)

if TYPE_CHECKING:
    from workloads.models import TransformerSpec

# Fields that must be integers >= 1, and MoE counts that must be integers >= 0.
SIZE_FIELDS = (
    "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size",
)
MOE_COUNT_FIELDS = ("num_experts", "experts_per_token", "num_shared_experts", "first_dense_layers")
BOOL_FIELDS = ("tied_embeddings", "parallel_block", "post_norms", "qk_norm")


def is_int(value: object) -> bool:
    # bool is an int subclass, but `num_layers: true` in a YAML file is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_name_and_sizes(spec: TransformerSpec) -> None:
    """The name and the sizes (checked before the MLP kind is read)."""
    if not isinstance(spec.name, str) or not spec.name.strip() or len(spec.name) > 128 \
            or not spec.name.isprintable():
        raise TpusimError(
            f"model name {short_repr(spec.name)} is not a non-empty string of at most 128 "
            f"printable characters; give `name: <text>` (quote numbers)"
        )
    for field in SIZE_FIELDS:
        value = getattr(spec, field)
        if not is_int(value) or value < 1:
            fail(spec, field, value, "must be a positive integer", "give a whole number >= 1")
        limit = MAX_LAYERS if field == "num_layers" else MAX_MODEL_DIM
        if value > limit:
            fail(spec, field, value, f"is over the limit of {limit:,}",
                 "a model this large is too large to simulate; give a smaller value")


def check_fields(spec: TransformerSpec) -> None:
    """Every other field and combination, after the MLP kind."""
    for field in BOOL_FIELDS:
        value = getattr(spec, field)
        if not isinstance(value, bool):
            fail(spec, field, value, "must be a boolean", "write true or false")
    if spec.post_norms and spec.parallel_block:
        fail(spec, "post_norms", True, "is modelled for sequential blocks only (Gemma 2 / "
             "3), and parallel_block is true", "set one of them to false")
    if spec.num_heads % spec.num_kv_heads:
        fail(
            spec, "num_kv_heads", spec.num_kv_heads,
            f"does not divide num_heads={spec.num_heads} (each KV head serves a whole group "
            f"of query heads)",
            "set num_kv_heads to a divisor of num_heads (num_heads itself for MHA)",
        )
    _check_moe(spec)
    _check_attention_pattern(spec)
    _check_mla(spec)
    _check_mtp(spec)


def fail(spec: TransformerSpec, field: str, value: object, rule: str, fix: str) -> None:
    """Raise the one-line error of a field that breaks a rule."""
    raise TpusimError(f"model {spec.name!r}: {field}={short_repr(value)} {rule}; {fix}")


def _check_moe(spec: TransformerSpec) -> None:
    for field in MOE_COUNT_FIELDS:
        value = getattr(spec, field)
        if not is_int(value) or value < 0:
            fail(spec, field, value, "must be a non-negative integer",
                 "give a whole number >= 0")
        limit = MAX_LAYERS if field == "first_dense_layers" else MAX_EXPERTS
        if value > limit:
            fail(spec, field, value, f"is over the limit of {limit:,}",
                 "a model this large is too large to simulate; give a smaller value")
    if spec.moe_d_ff is not None and (not is_int(spec.moe_d_ff) or not
                                      1 <= spec.moe_d_ff <= MAX_MODEL_DIM):
        fail(spec, "moe_d_ff", spec.moe_d_ff,
             f"must be a positive integer up to {MAX_MODEL_DIM:,} or null",
             "give the expert hidden width, or null to use d_ff")
    period = spec.moe_layer_period
    if not is_int(period) or not 1 <= period <= MAX_LAYERS:
        fail(spec, "moe_layer_period", period,
             f"must be {range_text(1, MAX_LAYERS, integer=True)}",
             "give the spacing of the MoE layers (2: every other layer), or 1 for "
             "every layer after first_dense_layers")
    if spec.num_experts == 0:
        # MoE knobs on a dense model are almost always a forgotten num_experts.
        for field in ("experts_per_token", "num_shared_experts", "first_dense_layers"):
            value = getattr(spec, field)
            if value:
                fail(spec, field, value, "is set but num_experts=0 (a dense model)",
                     f"set num_experts > 0 for an MoE model, or set {field} to 0")
        if period != 1:
            fail(spec, "moe_layer_period", period, "is set but num_experts=0 (a dense model)",
                 "set num_experts > 0 for an MoE model, or set moe_layer_period to 1")
        if spec.moe_d_ff is not None:
            fail(spec, "moe_d_ff", spec.moe_d_ff, "is set but num_experts=0 (a dense model)",
                 "set num_experts > 0 for an MoE model, or remove moe_d_ff")
        return
    if not 1 <= spec.experts_per_token <= spec.num_experts:
        fail(
            spec, "experts_per_token", spec.experts_per_token,
            f"must be between 1 and num_experts={spec.num_experts}",
            "set the top-k routing count to at least 1 and at most num_experts",
        )
    if spec.first_dense_layers >= spec.num_layers:
        fail(
            spec, "first_dense_layers", spec.first_dense_layers,
            f"leaves no MoE layer out of num_layers={spec.num_layers}",
            "make it smaller than num_layers, or set num_experts to 0 for a dense model",
        )
    if spec.num_moe_layers == 0:
        fail(
            spec, "moe_layer_period", period,
            f"leaves no MoE layer among the {spec.num_layers - spec.first_dense_layers} "
            f"layers after first_dense_layers={spec.first_dense_layers} (the MoE layers are "
            f"the last of every {period})",
            f"make it at most {spec.num_layers - spec.first_dense_layers}",
        )


def _check_attention_pattern(spec: TransformerSpec) -> None:
    w, period = spec.attention_window, spec.global_layer_period
    c = spec.attention_chunk_size
    if w is not None and (not is_int(w) or not 1 <= w <= MAX_TOKENS):
        fail(spec, "attention_window", w,
             f"must be a whole number of tokens in {interval_text(1, MAX_TOKENS)} "
             "or null",
             "give the local layers' sliding-window length, or null for full "
             "attention in every layer")
    if c is not None and (not is_int(c) or not 1 <= c <= MAX_TOKENS):
        fail(spec, "attention_chunk_size", c,
             f"must be a whole number of tokens in {interval_text(1, MAX_TOKENS)} "
             "or null",
             "give the chunked layers' chunk length, or null for no chunked "
             "attention")
    if w is not None and c is not None:
        fail(spec, "attention_chunk_size", c,
             f"is set together with attention_window={w}; a local layer is either a "
             "sliding window or a chunk",
             "remove one of them")
    if not is_int(period) or not 0 <= period <= MAX_LAYERS:
        fail(spec, "global_layer_period", period,
             f"must be {range_text(0, MAX_LAYERS, integer=True)}",
             "give the period of the local/global pattern (6: five local layers per "
             "global one), or 0 for every layer local")
    local = "attention_window" if c is None else "attention_chunk_size"
    size = w if c is None else c
    if size is None:
        if period:
            fail(spec, "global_layer_period", period,
                 "is set but attention_window is null (every layer is global)",
                 "set attention_window to the local layers' window (or "
                 "attention_chunk_size to their chunk), or set global_layer_period "
                 "to 0")
        return
    if period == 1:
        fail(spec, "global_layer_period", period,
             f"makes every layer global, so {local}={size} is unused",
             f"set it to 0 (every layer local) or >= 2, or remove {local}")
    if period > spec.num_layers:
        fail(spec, "global_layer_period", period,
             f"does not fit num_layers={spec.num_layers}: the pattern's global layer "
             f"(the last of each period) is never reached",
             f"make it at most {spec.num_layers}, or 0 for every layer local")


def _check_mla(spec: TransformerSpec) -> None:
    kv, q = spec.kv_lora_rank, spec.q_lora_rank
    rope, v = spec.qk_rope_head_dim, spec.v_head_dim
    for field, value in (("kv_lora_rank", kv), ("q_lora_rank", q), ("v_head_dim", v)):
        if value is not None and (not is_int(value) or not 1 <= value <= MAX_MODEL_DIM):
            fail(spec, field, value, f"must be a positive integer up to {MAX_MODEL_DIM:,} "
                 "or null", "give the width, or null to leave it out")
    if not is_int(rope) or not 0 <= rope <= MAX_MODEL_DIM:
        fail(spec, "qk_rope_head_dim", rope,
             f"must be {range_text(0, MAX_MODEL_DIM, integer=True)}",
             "give the decoupled rotary dimensions of a head (DeepSeek: 64), or 0")
    if kv is None:
        # The other MLA knobs without the latent are a forgotten kv_lora_rank.
        for field, value in (("q_lora_rank", q), ("v_head_dim", v)):
            if value is not None:
                fail(spec, field, value, "is set but kv_lora_rank is null (no multi-head "
                     "latent attention)", f"set kv_lora_rank for MLA, or remove "
                     f"{field}")
        if rope:
            fail(spec, "qk_rope_head_dim", rope, "is set but kv_lora_rank is null (no "
                 "multi-head latent attention)",
                 "set kv_lora_rank for MLA, or set qk_rope_head_dim to 0")
        return
    if spec.num_kv_heads != spec.num_heads:
        fail(spec, "num_kv_heads", spec.num_kv_heads,
             f"differs from num_heads={spec.num_heads}, but multi-head latent "
             "attention up-projects a key and a value for every query head",
             f"set num_kv_heads to {spec.num_heads}")
    if rope >= spec.head_dim:
        fail(spec, "qk_rope_head_dim", rope,
             f"leaves no non-rotary dimension of head_dim={spec.head_dim} (with MLA "
             "head_dim = qk_nope_head_dim + qk_rope_head_dim)",
             "make it smaller than head_dim, or give head_dim as the sum (DeepSeek: "
             "128 + 64 = 192)")
    if spec.qk_norm:
        fail(spec, "qk_norm", True, "is not modelled with multi-head latent attention "
             "(MLA normalises its latents instead)", "set qk_norm to false")


def _check_mtp(spec: TransformerSpec) -> None:
    n = spec.num_mtp_modules
    if not is_int(n) or not 0 <= n <= MAX_LAYERS:
        fail(spec, "num_mtp_modules", n, f"must be {range_text(0, MAX_LAYERS, integer=True)}",
             "give the number of multi-token prediction modules (DeepSeek-V3: 1), "
             "or 0")
    if n and spec.num_layers + n > MAX_LAYERS:
        fail(spec, "num_mtp_modules", n, f"with num_layers={spec.num_layers} is over the "
             f"limit of {MAX_LAYERS:,} layers", "give fewer modules or layers")
