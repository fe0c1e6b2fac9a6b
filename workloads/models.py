"""Decoder-only Transformer descriptions: `TransformerSpec` and its parameter / FLOP / KV-cache
arithmetic (reference/tpu.md §3, reference/maxtext.md §1). The rules its fields follow are
`workloads/model_checks.py`; the zoo of public architectures and models read from YAML
(`MODELS`, `load_model`, `model_from_dict`) are `workloads/zoo.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass
from typing import Any

from topologies.errors import TpusimError
from workloads.model_checks import check_fields, check_name_and_sizes, fail


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
        check_name_and_sizes(self)
        if not isinstance(self.mlp, MlpKind):
            try:
                # Frozen dataclass: coerce the YAML string to the enum in place, once.
                object.__setattr__(self, "mlp", MlpKind(self.mlp))
            except (ValueError, TypeError):
                fail(self, "mlp", self.mlp, "is not a known MLP kind",
                     f"use one of: {', '.join(MlpKind)}")
        check_fields(self)

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
    # numbers.Real also admits numpy scalars; bool is excluded (as by model_checks.is_int).
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
        raise TpusimError(f"{what}={value!r} must be a positive number; give a value > 0")


MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TransformerSpec))
# The fields `TransformerSpec.to_dict` writes only when they differ from their defaults.
OPTIONAL_FIELDS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                             "moe_layer_period", "attention_chunk_size", "num_mtp_modules"})
