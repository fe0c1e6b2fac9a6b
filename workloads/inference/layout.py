"""How a model and a batch are split over the mesh for inference (`Layout`: per-chip heads,
sequences and KV shards, 1D Megatron or 2D weight-stationary), and the HBM plan it gives:
weights, KV cache and activations per chip (`memory_plan`), and the largest batch that fits
(`max_batch_that_fits`). Formulas follow `reference/tpu.md` §3 and §5."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh, dcn_hint
from workloads.dtypes import Dtype
from workloads.inference.config import DecodeConfig
from workloads.models import TransformerSpec

ACT_BYTES = float(Dtype.BF16.nbytes)  # activations in bf16
DECODE_AXES = ("data", "fsdp", "tensor", "expert")
# MLA's down projections are whole on every tensor shard (as in workloads/training/program.py).
MLA_WHOLE = frozenset({"wq_a", "wkv_a"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How the model and the batch are split over the mesh (per-chip quantities)."""

    tp: int
    dp: int
    ep: int
    fs: int  # fsdp = X of 2D weight-stationary (1: 1D sharding)
    batch_shards: int  # data x expert
    local_batch: int  # sequences per chip for the projections (padded to the shards)
    att_batch: int  # sequences per chip for attention (local_batch / fsdp)
    kv_split: int  # extra batch split of the KV cache when tensor > num_kv_heads
    kv_batch: int  # sequences whose KV cache one chip holds
    kv_heads: float  # KV heads in one chip's cache
    proj_kv_heads: float  # KV heads one chip projects (K/tp, at least 1: replicated)


def layout(model: TransformerSpec, mesh: LogicalMesh, num_chips: int, batch: int) -> Layout:
    if mesh.num_ici_devices * mesh.num_slices != num_chips:
        raise TpusimError(
            f"mesh {mesh.describe()} covers {mesh.num_ici_devices * mesh.num_slices} chips but "
            f"the pod has {num_chips}; make the mesh axes multiply to {num_chips}"
            + dcn_hint(mesh, num_chips), "dcn", "slices"
        )
    other = sorted({n for n, _ in mesh.axes + mesh.dcn_axes} - set(DECODE_AXES))
    if other:
        raise TpusimError(f"mesh axis {other[0]} is not modelled for inference; use "
                          f"{', '.join(DECODE_AXES)}")
    tp, dp, ep = mesh.size("tensor"), mesh.size("data"), mesh.size("expert")
    fs = mesh.size("fsdp")
    if model.num_heads % tp:
        raise TpusimError(f"mesh axis tensor={tp} does not divide num_heads = {model.num_heads}; "
                          f"pick a tensor size that divides the head count")
    if model.d_ff % tp:
        raise TpusimError(f"mesh axis tensor={tp} does not divide d_ff = {model.d_ff}; pick a "
                          f"tensor size that divides d_ff")
    K = model.num_kv_heads
    if K % tp and tp % K:
        raise TpusimError(f"mesh axis tensor={tp} neither divides nor is a multiple of "
                          f"num_kv_heads = {K}; pick a tensor size compatible with the KV heads")
    if ep > 1:
        if not model.is_moe:
            raise TpusimError(f"mesh axis expert={ep} needs an MoE model, but {model.name} is "
                              f"dense; drop expert")
        if model.num_experts % ep:
            raise TpusimError(f"mesh axis expert={ep} does not divide num_experts = "
                              f"{model.num_experts}; pick a divisor")
    if fs > 1:
        # 2D weight-stationary (tpu.md §5): fsdp=X splits d_model of every weight matrix.
        if model.is_mla:
            raise TpusimError(f"mesh axis fsdp={fs} (2D weight-stationary) is modelled for "
                              f"ordinary attention only, but {model.name} has multi-head latent "
                              f"attention; drop fsdp")
        if model.is_moe:
            raise TpusimError(f"mesh axis fsdp={fs} (2D weight-stationary) is modelled for dense "
                              f"models only, but {model.name} is MoE; drop fsdp")
        if model.d_model % fs:
            raise TpusimError(f"mesh axis fsdp={fs} does not divide d_model = {model.d_model}; "
                              f"pick an fsdp size that divides d_model")
        if batch % (dp * fs):
            raise TpusimError(f"batch {batch} cannot be split over data x fsdp = {dp * fs} (2D "
                              f"weight-stationary reduce-scatters the batch over fsdp for "
                              f"attention); use a batch that is a multiple of {dp * fs} or a "
                              f"smaller fsdp")
    shards = dp * ep
    # SPMD pads the batch to a multiple of the shards: the busiest chip sets the step time.
    local = math.ceil(batch / shards)
    # 2D weight-stationary: every chip of an fsdp x tensor group multiplies all `local` rows (its
    # weights hold a d_model slice), but attention runs on local/fsdp sequences per chip, after
    # the QKV projection's reduce-scatter over fsdp splits the batch.
    att = local // fs
    if model.is_mla:
        # MLA caches one latent per position, shared by every head: each tensor shard holds
        # the latents of its sequences whole (replicated over tensor) and attends for its
        # heads (docs/model/moe.md).
        return Layout(tp=tp, dp=dp, ep=ep, fs=fs, batch_shards=shards, local_batch=local,
                       att_batch=att, kv_split=1, kv_batch=att, kv_heads=1.0,
                       proj_kv_heads=1.0)
    # tpu.md §5 "KV sharding": heads over tensor, then the rest of tensor over batch.
    split = tp // K if tp > K else 1
    return Layout(tp=tp, dp=dp, ep=ep, fs=fs, batch_shards=shards, local_batch=local,
                   att_batch=att, kv_split=split, kv_batch=math.ceil(att / split),
                   kv_heads=K / tp if tp <= K else 1.0, proj_kv_heads=max(K / tp, 1.0))


def weight_params_per_chip(model: TransformerSpec, lay: Layout) -> tuple[float, float]:
    """(matmul weights, bf16 norm scales) per chip, in parameters."""
    m, tp = model, lay.tp
    D, hd, H = m.d_model, m.head_dim, m.num_heads
    att = D * (H / tp + 2 * lay.proj_kv_heads) * hd + H / tp * hd * D
    if m.is_mla:
        att = sum(p / (1 if k in MLA_WHOLE else tp) for k, p in m.mla_matrices())
    mats = m.mlp.num_matrices
    dense = mats * D * m.d_ff / tp
    moe = 0.0
    if m.is_moe:
        moe = ((m.num_experts / lay.ep + m.num_shared_experts) * mats * D * m.expert_d_ff / tp
               + D * m.num_experts)
    emb = m.num_embedding_params / tp
    weights = m.num_layers * att + m.num_dense_layers * dense + m.num_moe_layers * moe + emb
    # 2D weight-stationary: fsdp splits d_model of every matrix (embeddings as [V_YZ, D_X]);
    # norm scales stay replicated.
    return weights / lay.fs, float(m.num_norm_params)


def activation_bytes(model: TransformerSpec, lay: Layout, tokens: float,
                      logit_rows: float) -> float:
    """Working set of one layer's activations for `tokens` rows per chip (bf16), plus the fp32
    logits of `logit_rows` rows (the last token of each local sequence)."""
    m, a, tp = model, ACT_BYTES, lay.tp
    F = m.expert_d_ff * m.experts_per_token if m.is_moe else m.d_ff
    widest = max(4 * m.d_model / lay.fs, 2 * m.mlp.num_matrices * F / tp,
                 (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / tp * 2)
    return tokens * widest * a + logit_rows * math.ceil(m.vocab_size / tp) * 4


def memory_plan(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                cfg: DecodeConfig) -> dict[str, float]:
    """Per-chip HBM of a decode step: weights, KV cache and activations (bytes)."""
    lay = layout(model, mesh, num_chips, cfg.batch)
    w_params, norms = weight_params_per_chip(model, lay)
    weights = w_params * cfg.weight_bytes_per_param + norms * ACT_BYTES
    ctx = cfg.context_len if cfg.prompt_len is None else max(cfg.context_len, cfg.prompt_len)
    # A local layer's cache holds at most its window or chunk (TransformerSpec.kv_cache_entries).
    kv = (2 * model.kv_cache_entries(ctx) * lay.kv_batch * lay.kv_heads * model.head_dim
          * cfg.kv_bytes_per_elem)
    if model.is_mla:
        # The latent and the shared rotary key per position (kv_cache_elements_per_position).
        kv = (model.kv_cache_entries(ctx) * lay.kv_batch * model.kv_cache_elements_per_position
              * cfg.kv_bytes_per_elem)
    rows = lay.local_batch
    if cfg.prompt_len is not None:
        rows *= cfg.prefill_chunk or cfg.prompt_len
    act = activation_bytes(model, lay, rows, lay.local_batch)
    return {"weights_bytes": weights, "kv_cache_bytes": kv, "activation_bytes": act,
            "total_bytes": weights + kv + act}


def max_batch_that_fits(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                        cfg: DecodeConfig, hbm_bytes: float, limit: int = 1 << 24) -> int:
    """Largest global batch whose weights + KV cache + activations fit in `hbm_bytes` per chip.

    Returns 0 if not even one sequence fits. The plan is monotone in the batch, so this is a
    binary search over `memory_plan` (no replay). With fsdp (2D weight-stationary) the batch
    must be a multiple of data x fsdp, so the search runs over those multiples.
    """
    fs = mesh.size("fsdp")
    step = mesh.size("data") * fs if fs > 1 else 1

    def fits(k: int) -> bool:
        plan = memory_plan(model, mesh, num_chips, dataclasses.replace(cfg, batch=k * step))
        return plan["total_bytes"] <= hbm_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step

