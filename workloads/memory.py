"""HBM occupancy of a training step: the tensors one layer saves for its backward pass, per remat
policy, with their dtypes and sharding, and the categories the peak is reported in.

The saved set follows the layer's real dataflow (the tensors its backward reads) as XLA keeps
them in a compiled program (docs/model.md "Memory"; checked against XLA's buffer assignment by
`benchmarks/xla_crosscheck.py`), instead of the textbook's rule of thumb of 20 (none), 7
(minimal) or 1 (full) bf16 tensors of [tokens, d_model] per layer (tpu.md §3 "Remat").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemoryCategory(enum.StrEnum):
    """What an HBM byte at the peak is (the keys of `hbm_peak_breakdown`)."""

    PARAMS = "params"
    OPTIMIZER = "optimizer"
    GRADIENTS = "gradients"
    # Unsharded weight gradients that XLA reduces by a synchronous all-reduce of the whole
    # gradient (FSDP groups over `XLA_MAX_WINDOWED_RING` chips, `--fsdp-grad all-reduce`):
    # from the weight-gradient matmul that writes one to the all-reduce that reads it; only
    # those under `XLA_ALLREDUCE_ALONE_BYTES`, which wait for a combined all-reduce.
    WHOLE_GRADIENTS = "whole_gradients"
    SAVED_ACTIVATIONS = "saved_activations"
    GATHERED_WEIGHTS = "gathered_weights"
    LOGITS = "logits"
    # Working buffers of the op in flight (dot attention's f32 scores and softmax, the backward's
    # f32 score gradients): born and dead inside one sublayer.
    TEMPORARIES = "temporaries"
    OTHER = "other"


MEMORY_CATEGORIES = tuple(c.value for c in MemoryCategory)


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedTensor:
    """One tensor a layer keeps from its forward for its backward (per chip)."""

    name: str
    num_elements: float
    dtype_bytes: float
    # The forward op that writes it (training.py's op name without a `re-` prefix): HBM holds the
    # tensor from that op's end on.
    producer: str = ""

    @property
    def num_bytes(self) -> float:
        return self.num_elements * self.dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShapeSpec:
    """Per-chip widths of one layer's activations (one microbatch).

    `rows` are the tokens of the matmuls (a tensor shard sees all of them); `residual_rows` the
    rows of the residual stream each chip holds (rows / tensor when activations are sharded over
    `tensor`, rows when replicated). Widths are the local shard: heads, KV heads and d_ff divided
    by `tensor`.
    """

    rows: float
    residual_rows: float
    context: int
    d_model: int
    q_width: float  # local heads x head_dim
    kv_width: float  # local KV heads x head_dim
    local_heads: float
    ff_width: float  # local d_ff (x experts_per_token for MoE layers)
    mlp_matrices: int
    parallel_block: bool
    num_experts: int = 0  # routed experts of an MoE layer (router logits are kept in f32)
    mlp_kind: str = "swiglu"  # the MLP's activation (workloads.models.MlpKind value)
    # MLA (multi-head latent attention): the value heads' width when it is not kv_width's, the
    # attention output's when it is not q_width's, the low-rank latents a layer writes (query
    # and key-value latents and the shared rotary key) and the ops that write q and k, v.
    v_width: float | None = None
    context_width: float | None = None
    latent_width: float = 0.0
    q_producer: str = "qkv_proj"
    kv_producer: str = "qkv_proj"
    # Bytes per element of the MLP activation's intermediates a scanned layer stack keeps
    # without remat (the activation's output and its derivative terms): 4 under
    # `mlp_act_dtype` fp32 (MaxText's activations_in_float32), else the activations' own (0).
    mlp_act_bytes: float = 0.0

    @property
    def value_width(self) -> float:
        return self.kv_width if self.v_width is None else self.v_width

    @property
    def attn_context_width(self) -> float:
        return self.q_width if self.context_width is None else self.context_width


def saved_tensors(shape: LayerShapeSpec, *, remat: str, attention: str,
                  act_bytes: float = 2.0, stacked: bool = True) -> tuple[SavedTensor, ...]:
    """The tensors one layer keeps in HBM between its forward and its backward.

    Args:
        shape: the layer's per-chip activation widths.
        remat: `none` (keep what the backward reads), `minimal` (keep the outputs of the weight
            matmuls, MaxText's `checkpoint_dots_with_no_batch_dims`; norms, attention and
            activations are recomputed), `full` (keep the layer input only), `offload` (the
            layer input stays in HBM, the minimal set goes to host memory) or `qkv-offload` /
            `qkvo-offload` (nothing stays: the layer input and the projections go to host).
        attention: `dot` materialises the score matrix; `flash` keeps only its output and the
            f32 log-sum-exp per row and head.
        act_bytes: bytes per activation element (bf16 = 2).
        stacked: under `none`, the residuals a scanned layer stack (MaxText's scan_layers)
            writes out of its forward loop for the backward loop, which are JAX's autodiff
            residuals as they are: besides the bf16 tensors, the f32 softmax output of dot
            attention, each norm's f32 input and f32 normalised rows, and the SwiGLU's
            derivative terms. `False` is the set a backward fused with its forward reads
            (a recomputed layer, an unrolled program): XLA recomputes the f32 and elementwise
            terms inside its fusions instead of keeping them.

    Every tensor takes the dtype its producer writes: matmul outputs and activations in bf16,
    norm statistics (one rsqrt per row) and router logits in f32. Sources: the live ranges of
    the `benchmarks/xla_memory.py` programs (scanned: stacked [layers, ...] buffers written by
    dynamic-update-slice fusions; fused: one bf16 [heads, q, k] buffer per layer, not the f32
    softmax).
    """
    s, a = shape, act_bytes
    n, r, D = s.rows, s.residual_rows, s.d_model
    layer_input = SavedTensor(name="layer_input", num_elements=r * D, dtype_bytes=a,
                               producer="norm_attn")
    if remat in ("full", "offload"):
        return (layer_input,)
    if remat in ("qkv-offload", "qkvo-offload"):
        return ()  # the layer input and the projections live in host memory (offloaded_tensors)
    qkv = (
        SavedTensor(name="q", num_elements=n * s.q_width, dtype_bytes=a,
                    producer=s.q_producer),
        SavedTensor(name="k", num_elements=n * s.kv_width, dtype_bytes=a,
                    producer=s.kv_producer),
        SavedTensor(name="v", num_elements=n * s.value_width, dtype_bytes=a,
                    producer=s.kv_producer),
    )
    if s.latent_width:
        # MLA's latents: matmul outputs the up projections' weight gradients read.
        qkv += (SavedTensor(name="mla_latents", num_elements=n * s.latent_width,
                            dtype_bytes=a, producer="kv_down"),)
    hidden = SavedTensor(name="mlp_hidden", num_elements=(s.mlp_matrices - 1) * n * s.ff_width,
                         dtype_bytes=a, producer="mlp_in")
    router = (SavedTensor(name="router_logits", num_elements=n * s.num_experts, dtype_bytes=4.0,
                           producer="router"),
              ) if s.num_experts else ()
    if remat == "minimal":
        # Only the matmul outputs the backward reads are residuals: the MLP's output projection
        # (and, in a parallel block, the attention's) only feeds the layer output, which no
        # backward reads; a sequential block's attention projection rebuilds the mid residual
        # the MLP norm's backward reads. It is kept as the residual stream holds it: after
        # the reduction over `tensor`, [tokens / tensor, d_model] when the activations are
        # sharded over `tensor` (MaxText's activation_embed on `tensor`), whole when they are
        # replicated (Megatron). Counting the unreduced [tokens, d_model] here made a
        # tensor=8 GPT-3 175B run look 8x heavier in this tensor than it is (issue 29).
        proj = () if s.parallel_block else (
            SavedTensor(name="attn_out_proj", num_elements=r * D, dtype_bytes=a,
                        producer="out_proj"),)
        return (layer_input, *qkv, *proj, hidden, *router)
    if remat != "none":
        raise ValueError(f"unknown remat policy {remat!r}")
    return _residuals(shape, layer_input, qkv, hidden, router, attention=attention,
                      act_bytes=act_bytes, stacked=stacked)


def _residuals(shape: LayerShapeSpec, layer_input: SavedTensor, qkv: tuple[SavedTensor, ...],
               hidden: SavedTensor, router: tuple[SavedTensor, ...], *, attention: str,
               act_bytes: float, stacked: bool) -> tuple[SavedTensor, ...]:
    """What `saved_tensors` keeps without remat: every tensor the backward reads (with
    `stacked`, as a scanned layer stack's forward loop writes them out)."""
    s, a = shape, act_bytes
    n, r, D = s.rows, s.residual_rows, s.d_model
    out: list[SavedTensor] = [
        layer_input,
        SavedTensor(name="norm_attn_stats", num_elements=r, dtype_bytes=4.0,
                    producer="norm_attn"),
        SavedTensor(name="norm_attn_out", num_elements=n * D, dtype_bytes=a,
                    producer="norm_attn"),
        *qkv,
    ]
    if stacked:
        out.insert(2, SavedTensor(name="norm_attn_f32", num_elements=2 * r * D, dtype_bytes=4.0,
                                  producer="norm_attn"))
    if attention == "dot":
        out.append(SavedTensor(name="attn_probs", num_elements=n * s.context * s.local_heads,
                               dtype_bytes=a, producer="softmax"))
        if stacked:
            out.append(SavedTensor(name="attn_probs_f32",
                                   num_elements=n * s.context * s.local_heads, dtype_bytes=4.0,
                                   producer="softmax"))
    else:
        out.append(SavedTensor(name="attn_logsumexp", num_elements=n * s.local_heads,
                               dtype_bytes=4.0, producer="flash_attention"))
    out.append(SavedTensor(name="attn_context", num_elements=n * s.attn_context_width,
                           dtype_bytes=a,
                           producer="attn_values" if attention == "dot" else "flash_attention"))
    if not s.parallel_block:
        out += [
            SavedTensor(name="residual_mid", num_elements=r * D, dtype_bytes=a,
                        producer="residual_attn"),
            SavedTensor(name="norm_mlp_stats", num_elements=r, dtype_bytes=4.0,
                        producer="norm_mlp"),
            SavedTensor(name="norm_mlp_out", num_elements=n * D, dtype_bytes=a,
                        producer="norm_mlp"),
        ]
        if stacked:
            out.append(SavedTensor(name="norm_mlp_f32", num_elements=2 * r * D,
                                   dtype_bytes=4.0, producer="norm_mlp"))
    # Under `mlp_act_dtype` fp32 the stack keeps the f32 values JAX's autodiff saves: the gate
    # and up outputs as cast to f32, the activation's output and its derivative terms; only
    # the gated product, cast back to bf16 for the down projection, stays bf16 (the v5e
    # fsdp=16 `none` compiles of validation/xla_progflags.py: 5 f32 and 1 bf16 [layers,
    # tokens, d_ff] stacked buffers, against 6 bf16 ones).
    ab = s.mlp_act_bytes if stacked and s.mlp_act_bytes else a
    if ab != a:
        hidden = SavedTensor(name=hidden.name, num_elements=hidden.num_elements,
                             dtype_bytes=ab, producer=hidden.producer)
    out += [*router, hidden,
            SavedTensor(name="mlp_act_out", num_elements=n * s.ff_width, dtype_bytes=ab,
                        producer="mlp_act")]
    if stacked:
        # The activation's derivative terms: ReLU's one-byte mask, or two bf16 terms for the
        # smooth activations (SiLU's sigmoid products, GELU's); a gated MLP also keeps the
        # gated product the down projection reads.
        if s.mlp_kind == "relu":
            out.append(SavedTensor(name="mlp_act_mask", num_elements=n * s.ff_width,
                                   dtype_bytes=1.0, producer="mlp_act"))
        else:
            out.append(SavedTensor(name="mlp_act_terms", num_elements=2 * n * s.ff_width,
                                   dtype_bytes=ab, producer="mlp_act"))
        if s.mlp_matrices > 2:
            out.append(SavedTensor(name="mlp_gated_product", num_elements=n * s.ff_width,
                                   dtype_bytes=a, producer="mlp_act"))
    return tuple(out)


def named_tensors(shape: LayerShapeSpec, names, *, act_bytes: float = 2.0,
                  attention: str = "flash") -> tuple[SavedTensor, ...]:
    """The per-layer tensors a named remat policy keeps or offloads (`names`, tpusim's tensor
    names: workloads/training/remat.py), as `saved_tensors` sizes them: the layer input and
    the attention's output projection as the residual stream holds them, q, k, v, the
    attention output (`attn_context`, [tokens, local heads x head_dim]) and the MLP input
    projections as the weights shard them. A parallel block has no output projection to keep
    (no mid residual reads it)."""
    s, a = shape, act_bytes
    n, r, D = s.rows, s.residual_rows, s.d_model
    every = [
        SavedTensor(name="layer_input", num_elements=r * D, dtype_bytes=a, producer="norm_attn"),
        SavedTensor(name="q", num_elements=n * s.q_width, dtype_bytes=a, producer=s.q_producer),
        SavedTensor(name="k", num_elements=n * s.kv_width, dtype_bytes=a,
                    producer=s.kv_producer),
        SavedTensor(name="v", num_elements=n * s.value_width, dtype_bytes=a,
                    producer=s.kv_producer),
        SavedTensor(name="attn_context", num_elements=n * s.attn_context_width, dtype_bytes=a,
                    producer="attn_values" if attention == "dot" else "flash_attention"),
    ]
    if not s.parallel_block:
        every.append(SavedTensor(name="attn_out_proj", num_elements=r * D, dtype_bytes=a,
                                 producer="out_proj"))
    every.append(SavedTensor(name="mlp_hidden",
                             num_elements=(s.mlp_matrices - 1) * n * s.ff_width,
                             dtype_bytes=a, producer="mlp_in"))
    if s.num_experts:
        every.append(SavedTensor(name="router_logits", num_elements=n * s.num_experts,
                                 dtype_bytes=4.0, producer="router"))
    names = set(names)
    return tuple(t for t in every if t.name in names)


def one_sequence_per_chip(*, sequences_per_chip: float) -> bool:
    """Whether XLA keeps the bf16 outputs of the score and logits matmuls as they are (instead
    of fusing their f32 conversion into the matmuls), which it does when each chip's
    activations hold one sequence (`sequences_per_chip`: the matmul rows over the context, the
    activations' local batch dimension).

    With a batch dimension of 1 the score matmul writes bf16 scores and the value matmul's
    fusion converts and exponentiates them as it reads them (`attention_temporaries` with
    `bf16_scores`: 2 bytes per score in the forward), and the logits matmul writes bf16 logits
    whose f32 copy, written by a separate fusion, feeds only the target-logit gather of the
    loss value, which XLA schedules after the backward loop (`loss_value_logits_bytes`). With
    two or more sequences the matmul fusions write f32 scores and f32 logits (plus bf16 ones)
    and the gather follows at once.

    Source: the v5e fsdp=16 `minimal` programs of `benchmarks/xla_memory.py`, one sequence
    (seq 2048 and 4096: bf16 [heads, seq, seq] scores only, the f32 [1, seq, vocab] logits
    live from the loss to after the backward loop) against two (seq 2048 and 4096: f32 scores
    and exponentials, f32 logits dead at the loss): the size of the scores does not decide
    it (two sequences at seq 4096 write 2 GiB of f32 scores). Checked on v5e's `none` and
    `full` programs at seq 4096 (one sequence).
    """
    return sequences_per_chip == 1


def loss_value_logits_bytes(*, rows: float, local_vocab: float, sequences_per_chip: float,
                            chip_defers: bool, tensor: int = 1, vocab_tiling: int = 1) -> float:
    """Bytes of f32 logits (4 per local logit) that stay live from the loss to the end of the
    backward layer loop (per chip): 4 x rows x local vocab when the chip's compiler defers the
    loss value (`chip_defers`, `ChipSpec.loss_after_backward`), each chip holds one sequence
    (`one_sequence_per_chip`) and the vocabulary is whole on the chip (`tensor` 1); 0
    otherwise, and under vocab tiling (MaxText's custom VJP keeps no logits).

    With one sequence the f32 copy of the logits is a buffer of its own whose only reader is
    the gather of each token's target logit, and the sum of the loss value that reads the
    gather is a fusion of its own (with two or more sequences it shares a multi-output fusion
    with the logit gradients' row terms, so it runs at the loss). XLA combines that sum's
    all-reduce with the all-reduce of the final norm's scale gradient, computed after the
    backward loop; v5e's compiler schedules the sum and the gather next to it, keeping the f32
    logits through the loop, v5p's and v6e's run the gather at the loss. With the vocabulary
    split over `tensor` each shard's target logits are all-reduced over `tensor` together with
    the log-sum-exp terms the logit gradients need, so the gather runs at the loss on every
    chip (v5e fsdp=4 x tensor=4 `minimal` with one sequence per chip, compiled after this
    rule was written without that condition).

    Source: the programs of `benchmarks/xla_memory.py` with one sequence per chip: v5e fsdp=16
    `minimal` at seq 2048 (256 MiB kept) and `none`, `full`, `minimal`, `offload` at seq 4096
    and data=2 x fsdp=8 `minimal` at seq 4096 (512 MiB kept); v5p and v6e fsdp=16 `minimal`
    at seq 2048 (freed at the loss); two sequences per chip free them at the loss on every
    chip.
    """
    if vocab_tiling > 1 or not chip_defers or tensor > 1 \
            or not one_sequence_per_chip(sequences_per_chip=sequences_per_chip):
        return 0.0
    return 4.0 * rows * local_vocab


def attention_temporaries(*, rows: float, context: float, local_heads: float,
                          probs_bytes: float = 2.0, score_exp_fusion: bool = False,
                          bf16_scores: bool = False) -> float:
    """Peak working bytes of a dot attention's forward (per chip): the f32 scores
    [rows, context, heads] (4 x b x s x context x heads / shards; the softmax overwrites them in
    place) and the probabilities written from them, live together: bf16 (`probs_bytes` 2), or
    f32 (4) in the forward of `minimal` / `offload` (and of a fused `full`: the value matmul
    reads the exponentials). With `score_exp_fusion` (the chip's
    compiler fuses the score matmul with the exponentials: v6e) the f32 exponentials are the
    first buffer the forward writes; f32 probabilities are those exponentials (4 bytes per
    score), bf16 ones are written from them as before (4 + 2).

    Source: XLA's live ranges at the peak of the scanned `benchmarks/xla_memory.py` programs.
    Under `none` and `full` the f32 score buffer is reused by the softmax's subtract-exp
    fusion, which also writes the bf16 probabilities the value matmul reads. Under `minimal`
    (v5e fsdp=16) the score matmul writes f32 scores, a separate subtract-exp fusion writes
    f32 exponentials and the value matmul normalises and converts them as it reads: 8 bytes
    per score at the softmax, XLA's peak in that program (and in v5e's `offload` program).
    v6e's programs fuse the score matmul, mask, max, subtract, exponential and row sum into
    one output fusion that writes the f32 exponentials (`fused_computation` returning
    `(f32[b,k,g,s], f32[b,k,g,s,t])` in its `none`, `full`, `minimal` and `offload`
    programs); under `minimal` the value matmul reads them (4 bytes per score, the v6e
    `minimal` peak), under `none` / `full` a divide-convert fusion writes the bf16
    probabilities from them (4 + 2, as unfused). v5e's and v5p's forward writes the f32
    scores in the matmul's own fusion and the exponentials in the next.

    With `bf16_scores` (one sequence per chip, `one_sequence_per_chip`) the score matmul
    writes its output as it is, in the activations' dtype (`probs_bytes`: 2 for bf16), the
    only score-sized buffer of the forward whatever the policy: the value matmul's fusion
    converts and exponentiates the scores as it reads them (the v5e fsdp=16 programs with one
    sequence per chip).
    """
    if bf16_scores:
        return probs_bytes * rows * context * local_heads
    if score_exp_fusion and probs_bytes == 4.0:
        return 4.0 * rows * context * local_heads
    return (4.0 + probs_bytes) * rows * context * local_heads


def attention_backward_score_buffers(*, remat: str, score_grad_fusion: bool = False,
                                     bwd_probs_buffer: bool = False,
                                     int8: bool = False) -> int:
    """How many bf16 buffers of the score matrix's size ([rows, context, local heads]) a dot
    attention's backward holds at its score gradient, the peak of the layer's backward.

    Without recompute (`none`) the probabilities come from the saved stack and XLA writes the
    probability gradient (the dP matmul's output) and the score gradient: 3 on every chip
    (v5e, v5p, v6e fsdp=16 and data x fsdp `none`). A recomputing backward (`full`,
    `minimal`, `offload`) recomputes the scores in bf16 (the q.K^T matmul's output, which
    the dP matmul's fusion reads to rebuild the exponentials) and writes the probability
    gradient: 2, plus the score gradient unless the chip fuses it into the dQ and dK matmuls
    that read it (`score_grad_fusion`, v5e: 2 in every v5e `full`, `minimal` and `offload`
    program; 3 on v6e in all of them), plus the probabilities when the chip writes them as a
    buffer of their own (`bwd_probs_buffer`, v5p) in the dP matmul's fusion, which it does
    when the policy keeps the layer's projections (`minimal`, `offload`: 4 in v5p fsdp=16
    `minimal`, fsdp=4 x tensor=4 `offload` and `minimal` at seq 4096); under `full` v5p
    writes them earlier and the value-gradient matmul has read them by then (3 in its fsdp,
    fsdp x tensor and data x fsdp `full` programs), except with int8 weight matmuls (`int8`):
    its AQT `full` programs hold the probabilities to the score gradient too (4 in v5p
    fsdp=16 and fsdp=4 x tensor=4, `validation/xla_int8.py`; v5e's int8 programs keep 2).

    Source: the live ranges of the `benchmarks/xla_memory.py` programs
    (`benchmarks/xla_live_ranges.py`), at the fusion that writes the bf16 score gradient.
    """
    if remat == "none":
        return 3
    buffers = 2 + (0 if score_grad_fusion else 1)
    if bwd_probs_buffer and (remat in ("minimal", "offload") or int8):
        buffers += 1
    return buffers


def score_exp_fused(*, chip_fuses: bool, sharded_axes: int, score_bytes: float,
                    remat: str = "none", plain_fsdp: bool = False) -> bool:
    """Whether XLA fuses a dot attention's score matmul with the softmax's exponentials (the
    f32 scores are then never a buffer of their own; `attention_temporaries`).

    `chip_fuses`: the chip's compiler always does (`ChipSpec.score_exp_fusion`: v6e, every
    program of `benchmarks/xla_memory.py`, all with at most 512 MiB of f32 scores per chip).
    Otherwise (v5e, v5p) it depends on the mesh and the size, as read off their compiled
    programs: the programs whose mesh has one sharded axis (fsdp=16: v5e `none`, `minimal`,
    `offload`, v5p `none`, `minimal`) write the f32 scores in the matmul's fusion and the
    exponentials in the next; those with two (v5e data=2 x fsdp=8 and fsdp=4 x tensor=4
    `minimal`, v5p fsdp=4 x tensor=4 `none`, `full`, `offload`, each with `score_bytes` = 512
    MiB of f32 scores per chip) fuse them, but not with 1 GiB (v5p fsdp=4 x tensor=4 `full`
    and `minimal` at seq 4096). Which XLA heuristic decides this was not found (in the v5e
    fsdp=16 programs the score matmul shares an async-collective fusion with the output
    projection's gather); `sharded_axes` is the mesh's number of axes of size > 1 (one or none,
    a single chip, counts as unfused) and the size limit is the largest fused size seen.
    Under `remat` `full` the forward fuses them on one axis too (one f32 buffer in the v5e
    and v5p fsdp=16 `full` programs; the forward saves nothing the softmax writes), within
    the same size limit (v5p fsdp=4 x tensor=4 `full` at seq 4096 writes both). So does a
    forward whose FSDP weight gathers are plain, no windowed-einsum loop (`plain_fsdp`): every
    one-axis program that wrote both buffers windows its forward gathers (fsdp=16), while the
    fsdp=64 ones, which XLA gathers plainly (more chips than it windows), fuse under every
    policy (v5e 8x8 `minimal`, read off it, and `full`; v5p 4x4x4 `none` and `minimal`).
    """
    return chip_fuses or ((sharded_axes >= 2 or remat == "full" or plain_fsdp)
                          and score_bytes <= 512 * 2**20)


def loss_tensors(*, rows: float, local_vocab: float, act_bytes: float = 2.0,
                 ) -> tuple[SavedTensor, ...]:
    """What the loss holds at its peak (per chip): the logits in f32 (the output projection's
    matmul fusion writes them in f32 for the softmax cross-entropy) and a bf16 buffer of the
    same shape (the logit gradients the backward matmul reads), 6 bytes per logit.

    Source: XLA's live ranges at the loss of the `benchmarks/xla_memory.py` programs (one
    multi-output fusion writes an f32 and a bf16 [tokens, vocab] buffer; no separate bf16 copy
    of the matmul output survives).
    """
    n = rows * local_vocab
    return (SavedTensor(name="logits_f32", num_elements=n, dtype_bytes=4.0, producer="logits"),
            SavedTensor(name="dlogits", num_elements=n, dtype_bytes=act_bytes,
                        producer="logits"))


def deferred_head_gradient_bytes(*, rows: float, d_model: int, local_vocab: float,
                                 tensor: int, fsdp: int, tp_activations: str, remat: str,
                                 act_bytes: float = 2.0,
                                 residual_rows: float | None = None,
                                 attention: str = "dot", gather: str = "async",
                                 int8: bool = False) -> float:
    """Bytes of the logits path that stay live through the whole backward layer loop (per
    chip): 0, or, when XLA defers the output projection's weight gradient past the loop, the
    bf16 logits it recomputes the logit gradients from (2 bytes per local logit) and the final
    norm's output (`residual_rows` x d_model bf16, default `rows`) that gradient reads.

    XLA defers it when the output projection is split over `tensor` and sharded over `fsdp`:
    the logit gradients are never materialised, each consumer (the input-gradient matmul,
    every ring step of the weight gradient's windowed reduce-scatter) recomputes them from the
    bf16 logits, and that reduce-scatter is scheduled after the backward loop. With the
    activations replicated over `tensor` (the logits matmul reads the whole final norm
    output) it does so when the remat policy recomputes without offloading (`full`,
    `minimal`): the v5p fsdp=4 x tensor=4 `full` program (blocking gathers; the bf16 [tokens,
    vocab / 4] logits and a [tokens, d_model] copy of the final norm's output are live at its
    peak, inside the backward loop), checked on v6e's `full`, v5p's `full` and `minimal` at
    seq 4096 and v5e's `minimal` program of that mesh (async gathers: the gather form does not
    decide it); the logits die before the backward loop in v5p's `none` and `offload`
    programs of that mesh. With the activations sharded over `tensor` (each chip's logits are
    its tokens / tensor rows over the whole vocab, as many as tokens x vocab / tensor) it
    does so under `none` and `full` too (v5e fsdp=4 x tensor=4 `none` and `full`: the bf16
    [tokens / 4, vocab] logits live from the loss to after the backward loop; `minimal`
    assumed alike, `offload` not compiled: not deferred). Without a tensor axis they die at
    the logits' backward.

    With flash attention (`attention`) and activations replicated over `tensor`, only
    programs whose FSDP gathers are async (`gather`, the gather form of the weights: "async",
    "blocking" or "windowed") defer it: the splash-kernel programs of `xla_memory.py` on
    fsdp=4 x tensor=4 free the bf16 logits before the backward loop on v6e and v5p, whose
    gathers are blocking (`full`, +14.2% with the deferral, -5.0% without; held out on v6e
    `minimal`, compiled after the rule was read off `full` with tpusim's peak written down
    first: +8.0% with it, -3.5% without), and keep them through it on v5e, whose gathers are
    async
    (`full`). Why the scheduler differs with the kernel is not known (the dot-attention
    programs defer with either form); windowed gathers and sharded activations are assumed
    to defer as with dot attention (no flash program of that kind was compiled).

    With int8 weight matmuls (`int8`) the gather form decides, as with flash attention: in
    the AQT programs of `validation/xla_int8.py` on fsdp=4 x tensor=4 `full` the bf16 logits
    die before the backward loop on v5p (blocking gathers; its bf16 twin keeps them through
    it) and live through it on v5e (async gathers, compiled after the v5p program with the
    prediction that they die there too: -14.8% with that rule, -2.8% with this one).
    """
    if tensor <= 1 or fsdp <= 1 or (int8 and gather != "async"):
        return 0.0
    if attention == "flash" and tp_activations == "replicated" and gather == "blocking":
        return 0.0
    deferring = ("full", "minimal") if tp_activations == "replicated" else \
        ("none", "full", "minimal")
    if remat not in deferring:
        return 0.0
    res = rows if residual_rows is None else residual_rows
    return (rows * local_vocab + res * d_model) * act_bytes


def windowed_head_gradient_bytes(*, rows: float, d_model: int, local_vocab: float,
                                 tensor: int, fsdp: int, windowed: bool, cast_weights: bool,
                                 chip_defers: bool, offload: bool = False,
                                 act_bytes: float = 2.0,
                                 vocab_tiling: int = 1,
                                 residual_rows: float | None = None,
                                 flash_one_sequence: bool = False) -> float:
    """Bytes of the logits path that stay live through the whole backward layer loop when the
    output projection's weight gradient is a windowed reduce-scatter ring over `fsdp` (per
    chip): 0, or, when the chip's compiler schedules that ring after the loop
    (`chip_defers`, `ChipSpec.head_grad_after_backward`) because the weights are cast before
    their gathers (`cast_weights`: f32 params gathered in bf16) or the layers offload their
    activations to host memory (`offload`: a remat policy that offloads), the bf16 logit
    gradients the
    ring reads (2 bytes per local logit) and the final norm's output (`residual_rows` x
    d_model bf16, default `rows`).

    Without a tensor axis the logit gradients are a bf16 buffer written at the loss; the
    input-gradient matmul reads it at once and the weight gradient's ring reads it with the
    final norm's output. The ring's last step (a collective-permute) is overlapped with the
    optimizer update after the backward loop; with bf16 weights v6e's compiler runs the ring
    itself before the loop, with f32 weights cast to bf16 (whose f32 update follows the
    loop) after it. Not with vocab tiling (MaxText's custom VJP keeps no logit gradients),
    nor with a tensor axis (`deferred_head_gradient_bytes`).

    Source: the windowed fsdp=16 programs of `benchmarks/xla_memory.py`: v6e `full` with f32
    params (the bf16 [tokens, vocab] logit gradients, 256 MiB, live from the loss to after
    the backward loop; -18.5% without this) against v6e `none`, `full` and `minimal` with bf16
    params (dead before the loop); held out on v6e `minimal` with f32 params (compiled after
    the rule: kept; -12.1% without it). v5e's `full` with f32 params frees them before the
    loop. v6e's `offload` programs with bf16 params (two and one sequences per chip) keep them
    too (256 and 128 MiB, from the loss to after the backward loop), modelled together with
    the program-order fetch of the offloaded activations (docs/model.md "Memory"). Not
    modelled: v6e's one-sequence `minimal` program with bf16 params keeps them as well (its
    `full` twin does not).

    `flash_one_sequence`: flash attention with one sequence per chip on a chip that keeps the
    f32 logits for the loss value past the loop (v5e, `loss_after_backward`): v5e's compiler
    then runs the ring after the loop too, with bf16 weights (the splash-kernel programs of
    `xla_memory.py`, fsdp=16 `full`: the bf16 [tokens, vocab] logit gradients live from the
    loss to after the loop at seq 4096, read off it, and at seq 2048, compiled after that
    reading: -21.0% and -15.1% without this), where its dot-attention twin (seq 4096 `full`)
    frees them before the loop.
    """
    if not (windowed and (flash_one_sequence or (chip_defers and (cast_weights or offload)))) \
            or tensor > 1 or fsdp <= 1 or vocab_tiling > 1:
        return 0.0
    res = rows if residual_rows is None else residual_rows
    return (rows * local_vocab + res * d_model) * act_bytes


def offloaded_tensors(shape: LayerShapeSpec, *, attention: str, act_bytes: float = 2.0,
                      remat: str = "offload") -> tuple[SavedTensor, ...]:
    """What a remat policy sends to host memory per layer: under `offload` the minimal set minus
    the layer input; under `qkv-offload` / `qkvo-offload` (the tpu-recipes' MaxText `custom`
    policies) the decoder-layer input and the q, k, v projections (and the attention output
    projection)."""
    minimal = saved_tensors(shape, remat="minimal", attention=attention, act_bytes=act_bytes)
    if remat == "offload":
        return tuple(t for t in minimal if t.name != "layer_input")
    names = {"qkv-offload": ("layer_input", "q", "k", "v"),
             "qkvo-offload": ("layer_input", "q", "k", "v", "attn_out_proj")}.get(remat)
    if names is None:
        return ()
    return tuple(t for t in minimal if t.name in names)


__all__ = [
    "MEMORY_CATEGORIES",
    "LayerShapeSpec",
    "MemoryCategory",
    "SavedTensor",
    "attention_backward_score_buffers",
    "attention_temporaries",
    "deferred_head_gradient_bytes",
    "windowed_head_gradient_bytes",
    "loss_tensors",
    "loss_value_logits_bytes",
    "named_tensors",
    "offloaded_tensors",
    "one_sequence_per_chip",
    "saved_tensors",
    "score_exp_fused",
]
