"""Decoder-only Transformer descriptions: `TransformerSpec`, its parameter / FLOP / KV-cache
arithmetic (reference/tpu.md §3, reference/maxtext.md §1), the `MODELS` zoo of public
architectures, and `load_model` / `model_from_dict` for zoo names and YAML files.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.quantities import parse_quantity
from topologies.registry import Registry
from topologies.validate import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_MODEL_DIM,
    MAX_TOKENS,
    interval_text,
    one_of,
    range_text,
    short_repr,
)


class MlpKind(enum.StrEnum):
    """Feed-forward block type; the YAML text is the enum value."""

    RELU = "relu"
    GELU = "gelu"
    SWIGLU = "swiglu"
    GEGLU = "geglu"

    @property
    def is_gated(self) -> bool:
        """True for GLU variants, which multiply a gate projection into the up projection."""
        return self in (MlpKind.SWIGLU, MlpKind.GEGLU)

    @property
    def num_matrices(self) -> int:
        """d_model x d_ff weight matrices per MLP: gate, up, down (3) or up, down (2)."""
        return 3 if self.is_gated else 2


class MaxTextFlopEra(enum.StrEnum):
    """The five model-FLOP formulas MaxText has used (maxtext.md §1).

    Values are the era names stored in `maxtext_runs.json` (`maxtext_flop_accounting.formula_era`).
    """

    SIX_P = "6P"
    SIX_P_ATTN12 = "6P+attn12"
    SIX_P_ATTN6 = "6P+attn6"
    MATMUL_NONCAUSAL = "matmul_noncausal"
    MATMUL_CAUSAL = "matmul_causal"


# Fields that must be integers >= 1, and MoE counts that must be integers >= 0.
_SIZE_FIELDS = (
    "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size",
)
_MOE_COUNT_FIELDS = ("num_experts", "experts_per_token", "num_shared_experts", "first_dense_layers")
_BOOL_FIELDS = ("tied_embeddings", "parallel_block", "post_norms", "qk_norm")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `num_layers: true` in a YAML file is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """A decoder-only Transformer's shape. Field names are the public YAML keys.

    Counts returned by the properties are numbers of parameters (elements, not bytes); FLOP
    figures count a multiply-add as 2 FLOPs (tpu.md §3: a [B,D]x[D,F] matmul is 2BDF FLOPs).

    Attributes:
        name: registry / report name (`llama3-70b`).
        num_layers: decoder layers (L).
        d_model: residual-stream width (D in the book, E = emb_dim in MaxText).
        num_heads: query heads (N).
        num_kv_heads: key/value heads (K); K = N is MHA, K = 1 is MQA, else GQA.
        head_dim: width of one head (H in the book, D in MaxText); num_heads * head_dim need not
            equal d_model (Gemma, the MaxText 2023 family).
        d_ff: hidden width of a dense MLP (F).
        mlp: MLP kind; gated kinds have 3 matrices, plain ones 2.
        vocab_size: vocabulary rows of the embedding (V).
        tied_embeddings: True if the output projection reuses the input embedding matrix.
        parallel_block: True for PaLM-style blocks where attention and MLP read one shared
            pre-norm and are summed (changes the norm count, not the FLOPs).
        num_experts: routed experts per MoE layer; 0 means a dense model.
        experts_per_token: routed experts each token uses (top-k).
        moe_d_ff: hidden width of one expert (and of one shared expert); None means d_ff
            (Mixtral style, where every layer is MoE).
        num_shared_experts: always-on experts per MoE layer (DeepSeek style).
        first_dense_layers: leading layers that use a dense d_ff MLP instead of experts.
        attention_window: tokens a *local* layer's query attends to: its own position and the
            `attention_window - 1` before it (a causal sliding window); None means every layer
            attends to its whole causal context.
        global_layer_period: the local/global layer pattern when `attention_window` is set:
            the last layer of every period of this many layers is global, the others local
            (Gemma 3: 6, five local layers per global one; Gemma 2: 2, alternating, local
            first); 0 means every layer is local (Mistral 7B's sliding window).
        post_norms: a norm on each sublayer's output before the residual add, besides the
            pre-norm on its input (Gemma 2 / 3's post-attention and post-feed-forward norms).
        qk_norm: a norm over head_dim of every query and key head before the attention
            (Gemma 3, in place of Gemma 2's logit soft-capping).
        kv_lora_rank: multi-head latent attention (MLA, DeepSeek-V2 / V3): the rank of the
            compressed key-value latent c_KV = x W_DKV that every head's key and value are
            up-projected from (and that decode caches); None means ordinary attention. With
            MLA `head_dim` is the query / key head width, qk_nope_head_dim + qk_rope_head_dim
            (192 for DeepSeek-V3), and num_kv_heads must equal num_heads.
        q_lora_rank: MLA's query compression rank (the query is up-projected from a
            q_lora_rank-wide latent); None means a full-rank d_model x heads query projection
            (DeepSeek-V2-Lite).
        qk_rope_head_dim: MLA's decoupled rotary dimensions: each query head carries this many
            rotary dimensions besides its qk_nope_head_dim = head_dim - qk_rope_head_dim
            others, and one rotary key of this width, projected from x alongside the latent,
            is shared by every head (0 without MLA).
        v_head_dim: MLA's value head width; None means head_dim.
        moe_layer_period: MoE layers every this many layers after the first_dense_layers
            (Llama 4 Maverick's interleave_moe_layer_step 2: layers 1, 3, 5, ... are MoE, the
            others dense); 1 means every layer after first_dense_layers.
        attention_chunk_size: chunked local attention (Llama 4): a local layer's query attends
            to the keys of its own chunk of this many tokens, causally (positions
            [C floor(p / C), p]); the local/global pattern is `global_layer_period`'s (Llama 4:
            4, three chunked layers per global one). Exclusive with attention_window.
        num_mtp_modules: multi-token prediction modules (DeepSeek-V3: 1): module k normalises
            the main model's last hidden state and the embedding of the token k ahead,
            projects their concatenation (2 d_model -> d_model), runs one more decoder layer of
            the main layers' kind and predicts through the shared output projection; trained
            with the main model, not used by decode or prefill.
    """

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    mlp: MlpKind
    vocab_size: int
    tied_embeddings: bool = False
    parallel_block: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_d_ff: int | None = None
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    attention_window: int | None = None
    global_layer_period: int = 0
    post_norms: bool = False
    qk_norm: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None
    moe_layer_period: int = 1
    attention_chunk_size: int | None = None
    num_mtp_modules: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 128 \
                or not self.name.isprintable():
            raise TpusimError(
                f"model name {short_repr(self.name)} is not a non-empty string of at most 128 "
                f"printable characters; give `name: <text>` (quote numbers)"
            )
        for field in _SIZE_FIELDS:
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                self._fail(field, value, "must be a positive integer", "give a whole number >= 1")
            limit = MAX_LAYERS if field == "num_layers" else MAX_MODEL_DIM
            if value > limit:
                self._fail(field, value, f"is over the limit of {limit:,}",
                           "a model this large is too large to simulate; give a smaller value")
        if not isinstance(self.mlp, MlpKind):
            try:
                # Frozen dataclass: coerce the YAML string to the enum in place, once.
                object.__setattr__(self, "mlp", MlpKind(self.mlp))
            except (ValueError, TypeError):
                self._fail("mlp", self.mlp, "is not a known MLP kind",
                           f"use one of: {', '.join(MlpKind)}")
        for field in _BOOL_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, bool):
                self._fail(field, value, "must be a boolean", "write true or false")
        if self.post_norms and self.parallel_block:
            self._fail("post_norms", True, "is modelled for sequential blocks only (Gemma 2 / "
                       "3), and parallel_block is true", "set one of them to false")
        if self.num_heads % self.num_kv_heads:
            self._fail(
                "num_kv_heads", self.num_kv_heads,
                f"does not divide num_heads={self.num_heads} (each KV head serves a whole group "
                f"of query heads)",
                "set num_kv_heads to a divisor of num_heads (num_heads itself for MHA)",
            )
        self._check_moe()
        self._check_attention_pattern()
        self._check_mla()
        self._check_mtp()

    def _fail(self, field: str, value: object, rule: str, fix: str) -> None:
        raise TpusimError(f"model {self.name!r}: {field}={short_repr(value)} {rule}; {fix}")

    def _check_moe(self) -> None:
        for field in _MOE_COUNT_FIELDS:
            value = getattr(self, field)
            if not _is_int(value) or value < 0:
                self._fail(field, value, "must be a non-negative integer",
                           "give a whole number >= 0")
            limit = MAX_LAYERS if field == "first_dense_layers" else MAX_EXPERTS
            if value > limit:
                self._fail(field, value, f"is over the limit of {limit:,}",
                           "a model this large is too large to simulate; give a smaller value")
        if self.moe_d_ff is not None and (not _is_int(self.moe_d_ff) or not
                                          1 <= self.moe_d_ff <= MAX_MODEL_DIM):
            self._fail("moe_d_ff", self.moe_d_ff,
                       f"must be a positive integer up to {MAX_MODEL_DIM:,} or null",
                       "give the expert hidden width, or null to use d_ff")
        period = self.moe_layer_period
        if not _is_int(period) or not 1 <= period <= MAX_LAYERS:
            self._fail("moe_layer_period", period,
                       f"must be {range_text(1, MAX_LAYERS, integer=True)}",
                       "give the spacing of the MoE layers (2: every other layer), or 1 for "
                       "every layer after first_dense_layers")
        if self.num_experts == 0:
            # MoE knobs on a dense model are almost always a forgotten num_experts.
            for field in ("experts_per_token", "num_shared_experts", "first_dense_layers"):
                value = getattr(self, field)
                if value:
                    self._fail(field, value, "is set but num_experts=0 (a dense model)",
                               f"set num_experts > 0 for an MoE model, or set {field} to 0")
            if period != 1:
                self._fail("moe_layer_period", period, "is set but num_experts=0 (a dense model)",
                           "set num_experts > 0 for an MoE model, or set moe_layer_period to 1")
            if self.moe_d_ff is not None:
                self._fail("moe_d_ff", self.moe_d_ff, "is set but num_experts=0 (a dense model)",
                           "set num_experts > 0 for an MoE model, or remove moe_d_ff")
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            self._fail(
                "experts_per_token", self.experts_per_token,
                f"must be between 1 and num_experts={self.num_experts}",
                "set the top-k routing count to at least 1 and at most num_experts",
            )
        if self.first_dense_layers >= self.num_layers:
            self._fail(
                "first_dense_layers", self.first_dense_layers,
                f"leaves no MoE layer out of num_layers={self.num_layers}",
                "make it smaller than num_layers, or set num_experts to 0 for a dense model",
            )
        if self.num_moe_layers == 0:
            self._fail(
                "moe_layer_period", period,
                f"leaves no MoE layer among the {self.num_layers - self.first_dense_layers} "
                f"layers after first_dense_layers={self.first_dense_layers} (the MoE layers are "
                f"the last of every {period})",
                f"make it at most {self.num_layers - self.first_dense_layers}",
            )

    def _check_attention_pattern(self) -> None:
        w, period = self.attention_window, self.global_layer_period
        c = self.attention_chunk_size
        if w is not None and (not _is_int(w) or not 1 <= w <= MAX_TOKENS):
            self._fail("attention_window", w,
                       f"must be a whole number of tokens in {interval_text(1, MAX_TOKENS)} "
                       "or null",
                       "give the local layers' sliding-window length, or null for full "
                       "attention in every layer")
        if c is not None and (not _is_int(c) or not 1 <= c <= MAX_TOKENS):
            self._fail("attention_chunk_size", c,
                       f"must be a whole number of tokens in {interval_text(1, MAX_TOKENS)} "
                       "or null",
                       "give the chunked layers' chunk length, or null for no chunked "
                       "attention")
        if w is not None and c is not None:
            self._fail("attention_chunk_size", c,
                       f"is set together with attention_window={w}; a local layer is either a "
                       "sliding window or a chunk",
                       "remove one of them")
        if not _is_int(period) or not 0 <= period <= MAX_LAYERS:
            self._fail("global_layer_period", period,
                       f"must be {range_text(0, MAX_LAYERS, integer=True)}",
                       "give the period of the local/global pattern (6: five local layers per "
                       "global one), or 0 for every layer local")
        local = "attention_window" if c is None else "attention_chunk_size"
        size = w if c is None else c
        if size is None:
            if period:
                self._fail("global_layer_period", period,
                           "is set but attention_window is null (every layer is global)",
                           "set attention_window to the local layers' window (or "
                           "attention_chunk_size to their chunk), or set global_layer_period "
                           "to 0")
            return
        if period == 1:
            self._fail("global_layer_period", period,
                       f"makes every layer global, so {local}={size} is unused",
                       f"set it to 0 (every layer local) or >= 2, or remove {local}")
        if period > self.num_layers:
            self._fail("global_layer_period", period,
                       f"does not fit num_layers={self.num_layers}: the pattern's global layer "
                       f"(the last of each period) is never reached",
                       f"make it at most {self.num_layers}, or 0 for every layer local")

    def _check_mla(self) -> None:
        kv, q = self.kv_lora_rank, self.q_lora_rank
        rope, v = self.qk_rope_head_dim, self.v_head_dim
        for field, value in (("kv_lora_rank", kv), ("q_lora_rank", q), ("v_head_dim", v)):
            if value is not None and (not _is_int(value) or not 1 <= value <= MAX_MODEL_DIM):
                self._fail(field, value, f"must be a positive integer up to {MAX_MODEL_DIM:,} "
                           "or null", "give the width, or null to leave it out")
        if not _is_int(rope) or not 0 <= rope <= MAX_MODEL_DIM:
            self._fail("qk_rope_head_dim", rope,
                       f"must be {range_text(0, MAX_MODEL_DIM, integer=True)}",
                       "give the decoupled rotary dimensions of a head (DeepSeek: 64), or 0")
        if kv is None:
            # The other MLA knobs without the latent are a forgotten kv_lora_rank.
            for field, value in (("q_lora_rank", q), ("v_head_dim", v)):
                if value is not None:
                    self._fail(field, value, "is set but kv_lora_rank is null (no multi-head "
                               "latent attention)", f"set kv_lora_rank for MLA, or remove "
                               f"{field}")
            if rope:
                self._fail("qk_rope_head_dim", rope, "is set but kv_lora_rank is null (no "
                           "multi-head latent attention)",
                           "set kv_lora_rank for MLA, or set qk_rope_head_dim to 0")
            return
        if self.num_kv_heads != self.num_heads:
            self._fail("num_kv_heads", self.num_kv_heads,
                       f"differs from num_heads={self.num_heads}, but multi-head latent "
                       "attention up-projects a key and a value for every query head",
                       f"set num_kv_heads to {self.num_heads}")
        if rope >= self.head_dim:
            self._fail("qk_rope_head_dim", rope,
                       f"leaves no non-rotary dimension of head_dim={self.head_dim} (with MLA "
                       "head_dim = qk_nope_head_dim + qk_rope_head_dim)",
                       "make it smaller than head_dim, or give head_dim as the sum (DeepSeek: "
                       "128 + 64 = 192)")
        if self.qk_norm:
            self._fail("qk_norm", True, "is not modelled with multi-head latent attention "
                       "(MLA normalises its latents instead)", "set qk_norm to false")

    def _check_mtp(self) -> None:
        n = self.num_mtp_modules
        if not _is_int(n) or not 0 <= n <= MAX_LAYERS:
            self._fail("num_mtp_modules", n, f"must be {range_text(0, MAX_LAYERS, integer=True)}",
                       "give the number of multi-token prediction modules (DeepSeek-V3: 1), "
                       "or 0")
        if n and self.num_layers + n > MAX_LAYERS:
            self._fail("num_mtp_modules", n, f"with num_layers={self.num_layers} is over the "
                       f"limit of {MAX_LAYERS:,} layers", "give fewer modules or layers")

    # ---- structure ---------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (a compressed key-value latent)."""
        return self.kv_lora_rank is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the query / key head dimensions without rotary (head_dim - qk_rope_head_dim)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """Width of one value head (and of one head of the attention output)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (0-based; an MTP module's block is layer num_layers + k) has
        a mixture-of-experts MLP: after the first_dense_layers, the last of every
        moe_layer_period layers (Llama 4's `moe_layers`, DeepSeek's `first_k_dense_replace`)."""
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers + 1) % self.moe_layer_period == 0


    @property
    def is_moe(self) -> bool:
        """True if some layers route tokens to experts."""
        return self.num_experts > 0

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of one expert (moe_d_ff, defaulting to d_ff)."""
        return self.d_ff if self.moe_d_ff is None else self.moe_d_ff

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (`layer_is_moe`; MTP modules not counted)."""
        if not self.is_moe:
            return 0
        return (self.num_layers - self.first_dense_layers) // self.moe_layer_period

    @property
    def num_dense_layers(self) -> int:
        """Layers whose MLP is a single dense d_ff MLP."""
        return self.num_layers - self.num_moe_layers

    def _layer_is_local(self, layer: int) -> bool:
        if self.attention_window is None and self.attention_chunk_size is None:
            return False
        period = self.global_layer_period
        return not (period and (layer + 1) % period == 0)

    def layer_attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based), or None if it attends globally (or
        to a chunk)."""
        return self.attention_window if self._layer_is_local(layer) else None

    def layer_attention_chunk(self, layer: int) -> int | None:
        """The attention chunk of layer `layer` (0-based), or None if it is not chunked."""
        return self.attention_chunk_size if self._layer_is_local(layer) else None

    @property
    def local_attention_span(self) -> int | None:
        """The local layers' span: their window or their chunk (None without local layers)."""
        return self.attention_window if self.attention_chunk_size is None \
            else self.attention_chunk_size

    def local_pairs(self, seq_len: int) -> int:
        """(query, key) pairs of one local layer over a `seq_len`-token sequence under its
        causal mask: `causal_window_pairs` or `causal_chunk_pairs`."""
        if self.attention_chunk_size is not None:
            return causal_chunk_pairs(seq_len, self.attention_chunk_size)
        return causal_window_pairs(seq_len, self.attention_window)

    @property
    def num_local_layers(self) -> int:
        """Layers that attend to a sliding window of `attention_window` tokens or to their
        chunk of `attention_chunk_size`."""
        if self.local_attention_span is None:
            return 0
        period = self.global_layer_period
        return self.num_layers - (self.num_layers // period if period else 0)

    @property
    def num_global_layers(self) -> int:
        """Layers that attend to their whole causal context."""
        return self.num_layers - self.num_local_layers

    def attended_keys_per_query(self, seq_len: int, layer: int) -> float:
        """Keys a query of layer `layer` attends to under a causal mask, averaged over a
        `seq_len`-token sequence (the work of an attention that skips masked blocks).

        Global layers: seq_len / 2, the causal half of the score matrix (tpu.md §3). Local
        layers: `local_pairs(seq_len) / seq_len` (a sliding window's query at position p, from
        1, attends to min(window, p) keys; a chunked layer's to the keys of its chunk up to
        itself), capped at the global layer's seq_len / 2 so that a window or chunk of the
        whole sequence costs what full attention does (the two conventions differ by the
        diagonal's half, seq_len / 2 pairs).
        """
        _check_positive("seq_len", seq_len)
        if not self._layer_is_local(layer):
            return seq_len / 2
        return min(self.local_pairs(seq_len), seq_len * seq_len / 2) / seq_len

    def kv_cache_entries(self, context_len: int) -> int:
        """Positions one sequence's KV cache holds, summed over layers: `context_len` per
        global layer, at most `attention_window` per sliding-window layer (a sliding window's
        cache keeps the last `attention_window` keys and values, older ones are never read
        again) and at most `attention_chunk_size` per chunked one (the current chunk's keys,
        which a chunk's last token reads all of)."""
        _check_positive("context_len", context_len)
        local = min(context_len, self.local_attention_span or context_len)
        return self.num_global_layers * context_len + self.num_local_layers * local

    # ---- parameter counts (elements) ---------------------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        """Q, K, V and output projections: D(N+2K)H + NHD, i.e. 2D(N+K)H (tpu.md §3).

        With MLA (DeepSeek-V2 §2.1, with H = qk_nope + qk_rope head dims, R = qk_rope_head_dim,
        V = v_head_dim): the query D x q_lora + q_lora x NH (or D x NH without q_lora_rank),
        the latent and the shared rotary key D x (kv_lora + R), the up-projection of every
        head's key and value kv_lora x N(H - R + V), and the output NV x D."""
        if self.is_mla:
            return sum(size for _, size in self.mla_matrices())
        qkv = self.d_model * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.num_heads * self.head_dim * self.d_model

    def mla_matrices(self) -> list[tuple[str, int]]:
        """MLA's weight matrices (MaxText's names) and their sizes in parameters: the query
        (`wq_a`, `wq_b`; `wq` without q_lora_rank), `wkv_a` (d_model -> kv_lora + rope),
        `wkv_b` (kv_lora -> heads x (nope + v)) and the output projection `wo`."""
        D, N, hd = self.d_model, self.num_heads, self.head_dim
        kl, r, v = self.kv_lora_rank, self.qk_rope_head_dim, self.value_head_dim
        q = ([("wq_a", D * self.q_lora_rank), ("wq_b", self.q_lora_rank * N * hd)]
             if self.q_lora_rank is not None else [("wq", D * N * hd)])
        return q + [("wkv_a", D * (kl + r)), ("wkv_b", kl * N * (hd - r + v)),
                    ("wo", N * v * D)]

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """One dense MLP: 2 or 3 matrices of d_model x d_ff (no biases)."""
        return self.mlp.num_matrices * self.d_model * self.d_ff

    @property
    def _expert_params(self) -> int:
        return self.mlp.num_matrices * self.d_model * self.expert_d_ff

    @property
    def router_params_per_layer(self) -> int:
        """MoE gate: a d_model x num_experts matrix (0 for dense models)."""
        return self.d_model * self.num_experts

    @property
    def moe_mlp_params_per_layer(self) -> int:
        """All routed experts, the router and the shared experts of one MoE layer (0 if dense)."""
        if not self.is_moe:
            return 0
        experts = (self.num_experts + self.num_shared_experts) * self._expert_params
        return experts + self.router_params_per_layer

    @property
    def active_moe_mlp_params_per_layer(self) -> int:
        """MoE-layer weights one token touches: top-k + shared experts, and the router."""
        if not self.is_moe:
            return 0
        active = (self.experts_per_token + self.num_shared_experts) * self._expert_params
        return active + self.router_params_per_layer

    @property
    def norm_params_per_layer(self) -> int:
        """Norm scales per layer: one d_model vector per pre-norm and post-norm, one head_dim
        vector each for the query and key norms.

        A parallel block has a single pre-norm shared by attention and MLP (PaLM, MaxText 2023);
        a sequential block has two, and two more with `post_norms` (Gemma 2 / 3). Norm biases
        are not modelled.
        """
        pre = (1 if self.parallel_block else 2) * self.d_model
        post = 2 * self.d_model if self.post_norms else 0
        # MLA normalises its query and key-value latents (DeepSeek-V2's q_a / kv_a norms).
        latents = (self.kv_lora_rank + (self.q_lora_rank or 0)) if self.is_mla else 0
        return pre + post + (2 * self.head_dim if self.qk_norm else 0) + latents

    @property
    def num_attention_params(self) -> int:
        """Attention projections of all layers."""
        return self.num_layers * self.attention_params_per_layer

    @property
    def num_mlp_params(self) -> int:
        """MLP weights of all layers (every expert, routers, shared experts)."""
        return (self.num_dense_layers * self.dense_mlp_params_per_layer
                + self.num_moe_layers * self.moe_mlp_params_per_layer)

    @property
    def num_active_mlp_params(self) -> int:
        """MLP weights one token touches, summed over layers."""
        return (self.num_dense_layers * self.dense_mlp_params_per_layer
                + self.num_moe_layers * self.active_moe_mlp_params_per_layer)

    @property
    def num_norm_params(self) -> int:
        """Per-layer norm scales plus the final norm (d_model)."""
        return self.num_layers * self.norm_params_per_layer + self.d_model

    @property
    def num_embedding_params(self) -> int:
        """vocab x d_model, twice if the output projection is a separate matrix."""
        return (1 if self.tied_embeddings else 2) * self.vocab_size * self.d_model

    def mlp_params_of_layer(self, layer: int, *, active: bool = False) -> int:
        """MLP weights of layer `layer` (`layer_is_moe`): every expert, or (`active`) the ones
        a token uses."""
        if not self.layer_is_moe(layer):
            return self.dense_mlp_params_per_layer
        return self.active_moe_mlp_params_per_layer if active else self.moe_mlp_params_per_layer

    @property
    def mtp_layers(self) -> range:
        """The layer indices of the MTP modules' blocks (after the main layers)."""
        return range(self.num_layers, self.num_layers + self.num_mtp_modules)

    def mtp_params_of_module(self, layer: int, *, active: bool = False) -> int:
        """One MTP module (DeepSeek-V3 §2.2): its decoder block (layer `layer`), the
        projection of the two normalised inputs (2 d_model x d_model: `eh_proj`) and three
        d_model norms (the hidden state's and the embedding's, `hnorm` / `enorm`, and its
        output head's); the embedding and the output projection are the main model's."""
        D = self.d_model
        return (self.attention_params_per_layer + self.norm_params_per_layer
                + self.mlp_params_of_layer(layer, active=active) + 2 * D * D + 3 * D)

    @property
    def num_mtp_params(self) -> int:
        """Parameters of the MTP modules (0 without them)."""
        return sum(self.mtp_params_of_module(layer) for layer in self.mtp_layers)

    @property
    def num_params(self) -> int:
        """Total parameters: attention + MLP + norms + embeddings, and the MTP modules (which
        the published totals of DeepSeek-V3 leave out: its 671B are `num_params -
        num_mtp_params`)."""
        return (self.num_attention_params + self.num_mlp_params + self.num_norm_params
                + self.num_embedding_params + self.num_mtp_params)

    @property
    def num_active_params(self) -> int:
        """Parameters one generated token uses: like `num_params` but with top-k + shared
        experts only and without the MTP modules (decode runs the main model)."""
        return (self.num_attention_params + self.num_active_mlp_params + self.num_norm_params
                + self.num_embedding_params)

    # ---- FLOPs -------------------------------------------------------------------------------

    @property
    def forward_matmul_flops_per_token(self) -> int:
        """Forward FLOPs per token of all weight matmuls, excluding attention scores.

        2 x (attention projections + active MLP weights incl. router + the d_model x vocab
        output projection). The embedding lookup is a gather, not a matmul, so the output
        projection counts once whether or not it is tied (as MaxText's matmul eras do).
        """
        unembed = self.d_model * self.vocab_size
        flops = 2 * (self.num_attention_params + self.num_active_mlp_params + unembed)
        # Each MTP module: its block, its input projection and the shared output projection.
        return flops + sum(2 * (self.mtp_params_of_module(layer, active=True) - 3 * self.d_model
                                - self.norm_params_per_layer + unembed)
                           for layer in self.mtp_layers)

    def attention_flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Forward attention-score FLOPs (QK^T and AV) per token, summed over layers.

        Non-causal: 4 * seq_len * num_heads * head_dim per layer (2 matmuls of 2*S*N*H each).
        A causal mask halves the useful work on average over the sequence (tpu.md §3). A local
        layer's query attends to `attended_keys_per_query` keys instead of seq_len / 2
        (causal), or to min(attention_window, seq_len) keys (non-causal).

        Args:
            seq_len: tokens per sequence (keys each query attends to, before masking).
            causal: whether the attention mask is causal.
        """
        _check_positive("seq_len", seq_len)
        # q.K^T over head_dim, P.V over the value heads (4 N H per key without MLA).
        per_key = 2 * self.num_heads * (self.head_dim + self.value_head_dim)
        # The MTP modules' blocks attend like the layers they extend the pattern with.
        local = self.num_local_layers + sum(self._layer_is_local(x) for x in self.mtp_layers)
        glob_layers = self.num_layers + self.num_mtp_modules - local
        full = per_key * seq_len * glob_layers
        glob = full // 2 if causal else full
        if not local:
            return glob
        if causal:
            keys = min(self.local_pairs(seq_len), seq_len * seq_len / 2) / seq_len
        else:
            keys = min(self.local_attention_span, seq_len)
        return glob + per_key * keys * local

    def forward_flops_per_token(self, seq_len: int, *, causal: bool = True) -> int:
        """Forward FLOPs per token: weight matmuls plus attention scores."""
        return self.forward_matmul_flops_per_token + self.attention_flops_per_token(
            seq_len, causal=causal
        )

    def training_flops(self, tokens: float, seq_len: int, *, causal: bool = True) -> float:
        """Model FLOPs of a training pass (forward + backward) over `tokens` tokens.

        3 x forward (backward costs 2x forward, tpu.md §3): the textbook's 6 * params * tokens
        plus attention. Remat recomputation is not counted (these are model FLOPs).

        Args:
            tokens: tokens processed (e.g. global batch x seq_len).
            seq_len: tokens per sequence, for the attention-score term.
            causal: whether the attention mask is causal.
        """
        _check_positive("tokens", tokens)
        return 3 * tokens * self.forward_flops_per_token(seq_len, causal=causal)

    def kv_cache_bytes_per_token(self, bytes_per_elem: float = 2) -> float:
        """KV-cache bytes one token occupies in every layer: 2 * L * K * H * bytes (tpu.md §3;
        with local layers, a context's cache is `kv_cache_bytes`, which caps them at the window).

        Args:
            bytes_per_elem: bytes per cached element (2 for bf16, 1 for int8).
        """
        _check_positive("bytes_per_elem", bytes_per_elem)
        return self.num_layers * self.kv_cache_elements_per_position * bytes_per_elem

    @property
    def kv_cache_elements_per_position(self) -> int:
        """Elements one layer caches per position: a key and a value per KV head (2 K H), or
        with MLA, in the absorbed form decode runs, the latent and the shared rotary key
        (kv_lora_rank + qk_rope_head_dim: 576 for DeepSeek-V3, against 2 x 128 x 192 = 49,152
        for its heads' keys and values)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_cache_bytes(self, context_len: int, bytes_per_elem: float = 2) -> float:
        """KV-cache bytes of one sequence of `context_len` tokens: 2 * K * H * bytes per cached
        position, (kv_lora_rank + qk_rope_head_dim) * bytes with MLA (`kv_cache_entries`: a
        local layer caches at most its window or chunk)."""
        _check_positive("bytes_per_elem", bytes_per_elem)
        return (self.kv_cache_elements_per_position * bytes_per_elem
                * self.kv_cache_entries(context_len))

    def maxtext_flops_per_device(
        self, per_device_batch: float, seq_len: int, era: MaxTextFlopEra | str
    ) -> float:
        """Model FLOPs per device per training step, as MaxText counted them in `era`.

        Reproduces maxtext.md §1, with T = per_device_batch * seq_len tokens per device:
        * `6P`: 6 * P * T, P = all parameters (`num_params`, tied embedding once).
        * `6P+attn12` / `6P+attn6`: plus 12 (resp. 6) * N * L * H * S * T (these eras predate
          MaxText's sliding windows: every layer counts the full sequence).
        * `matmul_noncausal` / `matmul_causal`: 3 * T * (weight matmuls + attention scores):
          MoE layers count the router and top-k + shared experts only, the output projection
          counts once, the lookup is free. The attention term is MaxText's, not
          `attention_flops_per_token`'s: a local layer counts 4 * min(S, W) * N * H per token
          (PRs #2009/#2030), and `matmul_causal` halves every layer's term, local ones too
          (maxtext.md §1; a causal window's exact share is about W / (2 S) larger).

        Args:
            per_device_batch: sequences per device per step (MaxText `per_device_batch_size`).
            seq_len: tokens per sequence (MaxText `max_target_length`).
            era: which formula (a `MaxTextFlopEra` or its string value).
        """
        try:
            era = MaxTextFlopEra(era)
        except (ValueError, TypeError):
            raise TpusimError(
                f"maxtext FLOP era {era!r} is not a known formula era; "
                f"use one of: {', '.join(MaxTextFlopEra)}"
            ) from None
        _check_positive("per_device_batch", per_device_batch)
        tokens = per_device_batch * seq_len
        per_key = 2 * self.num_heads * (self.head_dim + self.value_head_dim)
        if era is MaxTextFlopEra.MATMUL_NONCAUSAL or era is MaxTextFlopEra.MATMUL_CAUSAL:
            keys = (self.num_global_layers * seq_len
                    + self.num_local_layers * min(seq_len, self.local_attention_span or seq_len))
            attn = per_key * keys / (2 if era is MaxTextFlopEra.MATMUL_CAUSAL else 1)
            return 3 * tokens * (self.forward_matmul_flops_per_token + attn)
        flops = 6 * self.num_params * tokens
        full = per_key * seq_len * self.num_layers
        if era is MaxTextFlopEra.SIX_P_ATTN12:
            flops += 3 * tokens * full
        elif era is MaxTextFlopEra.SIX_P_ATTN6:
            flops += 3 * tokens * (full // 2)
        return flops

    # ---- serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready mapping of the fields (`model_from_dict` inverts it). The fields of
        MLA, interleaved MoE layers, chunked attention and MTP (`OPTIONAL_FIELDS`) are left out
        at their defaults, so a model without them writes what it did before they existed."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in OPTIONAL_FIELDS or getattr(self, f.name) != f.default}
        data["mlp"] = str(self.mlp)
        return data


def causal_window_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs of a causal sliding window over `seq_len` tokens: the query at
    position p (from 1) attends to min(window, p) keys, so the sum is
    window * (window + 1) / 2 + (seq_len - window) * window for seq_len >= window, and
    seq_len * (seq_len + 1) / 2 (the whole causal triangle, diagonal included) otherwise."""
    w = min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def causal_chunk_pairs(seq_len: int, chunk: int) -> int:
    """(query, key) pairs of causal chunked attention over `seq_len` tokens: the sequence is
    cut into chunks of `chunk` tokens and a query attends to the keys of its chunk up to
    itself, so each whole chunk holds chunk * (chunk + 1) / 2 pairs and the last, partial one
    r * (r + 1) / 2 (r = seq_len mod chunk)."""
    whole, r = divmod(seq_len, chunk)
    return whole * chunk * (chunk + 1) // 2 + r * (r + 1) // 2


def _check_positive(what: str, value: object) -> None:
    # numbers.Real also admits numpy scalars; bool is excluded as in `_is_int`.
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
        raise TpusimError(f"{what}={value!r} must be a positive number; give a value > 0")


MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TransformerSpec))
# The fields `TransformerSpec.to_dict` writes only when they differ from their defaults.
OPTIONAL_FIELDS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                             "moe_layer_period", "attention_chunk_size", "num_mtp_modules"})
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
_NUMERIC_FIELDS = (*_SIZE_FIELDS, *_MOE_COUNT_FIELDS, "moe_d_ff", "attention_window",
                   "global_layer_period")
_NULLABLE_FIELDS = ("moe_d_ff", "attention_window")


def _quantities(fields: dict[str, Any], base: TransformerSpec | None,
                source: str) -> dict[str, Any]:
    """`fields` with each numeric field given as text read as `--set model.*` reads it
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
            if not _is_int(base_value):
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
