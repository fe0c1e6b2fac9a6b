"""Compile inference steps into SPMD `Trace`s: one decode (generate) step of a batch of sequences
with a KV cache, and the prefill of their prompts (optionally chunked); plus the HBM plan that
gives the largest batch that fits. Formulas follow `reference/tpu.md` §3 and §5.

Two shardings: 1D (Megatron: `tensor` splits heads, d_ff and vocab) and, when the mesh has an
`fsdp` axis, 2D weight-stationary (tpu.md §5): `fsdp=X` splits the weights' d_model dimension,
`tensor=YZ` their heads/d_ff/vocab dimension, and the activations move instead of the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh, dcn_hint
from topologies.validate import MAX_BATCH, MAX_CHUNKS, MAX_TOKENS, one_of, short_repr
from workloads.dtypes import (
    KV_CACHE_DTYPES,
    MATMUL_DTYPES,
    WEIGHT_STORAGE_DTYPES,
    Dtype,
    storage_bytes,
)
from workloads.models import TransformerSpec, causal_chunk_pairs, causal_window_pairs
from workloads.moe import MoeConfig, dispatch_flops, expert_shares, plan_routing
from workloads.trace import OpKind, Trace, TraceBuilder, Unit

_ACT_BYTES = float(Dtype.BF16.nbytes)  # activations in bf16
_DECODE_AXES = ("data", "fsdp", "tensor", "expert")
_SAMPLE_TOP_K = 64  # candidates kept by top-k sampling
# MLA's down projections are whole on every tensor shard (as in training: program.py).
_MLA_WHOLE = frozenset({"wq_a", "wkv_a"})
# How the next token is chosen from the logits: "top-k" (a draw among the _SAMPLE_TOP_K
# largest) or "greedy" (their argmax). Their collectives over a vocabulary split over `tensor`
# are XLA's (`_InferenceCompiler.sample`).
SAMPLING_MODES = ("top-k", "greedy")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeConfig:
    """Run settings of one decode step or one prefill (see `tpusim decode --help`).

    Attributes:
        batch: sequences decoded together (global, over all chips).
        context_len: tokens in each sequence's KV cache that a decode step attends to.
        weight_dtype: storage format of the weights (bytes only, unless matmul_dtype is int8).
        kv_dtype: storage format of the KV cache.
        matmul_dtype: MXU format of the weight matmuls (int8 runs at the int8 peak).
        prompt_len: prefill only: prompt tokens per sequence.
        prefill_chunk: prefill only: tokens per chunk (None = the whole prompt at once).
        moe: router skew and capacity factor (workloads/moe.py).
        sampling: "top-k" (a draw among the 64 largest logits) or "greedy" (their argmax).
    """

    batch: int
    context_len: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    matmul_dtype: str = "bf16"
    prompt_len: int | None = None
    prefill_chunk: int | None = None
    moe: MoeConfig = field(default_factory=MoeConfig)
    sampling: str = "top-k"

    def __post_init__(self) -> None:
        def _pos_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not _pos_int(self.batch):
            raise TpusimError(f"--batch {self.batch!r} must be an integer >= 1 (sequences)")
        if not _pos_int(self.context_len):
            raise TpusimError(f"--context-len {self.context_len!r} must be an integer >= 1 "
                              f"(tokens in the KV cache)")
        storage_bytes(WEIGHT_STORAGE_DTYPES, self.weight_dtype, "--weight-dtype")
        storage_bytes(KV_CACHE_DTYPES, self.kv_dtype, "--kv-dtype")
        # Any case, as the storage dtypes (`storage_bytes`) and the training dtypes take them.
        if not isinstance(self.matmul_dtype, str) or self.matmul_dtype.lower() not in \
                MATMUL_DTYPES:
            raise TpusimError(f"--matmul-dtype {short_repr(self.matmul_dtype)} is not "
                              f"supported; {one_of(self.matmul_dtype, MATMUL_DTYPES)}")
        if self.sampling not in SAMPLING_MODES:
            raise TpusimError(f"--sampling {short_repr(self.sampling)} is not supported; "
                              f"{one_of(self.sampling, SAMPLING_MODES)}")
        if self.prompt_len is not None and not _pos_int(self.prompt_len):
            raise TpusimError(f"--prompt-len {self.prompt_len!r} must be an integer >= 1")
        if self.prefill_chunk is not None and not _pos_int(self.prefill_chunk):
            raise TpusimError(f"--prefill-chunk {self.prefill_chunk!r} must be an integer >= 1")
        for flag, v, hi in (("--batch", self.batch, MAX_BATCH),
                            ("--context-len", self.context_len, MAX_TOKENS),
                            ("--prompt-len", self.prompt_len, MAX_TOKENS)):
            if v is not None and v > hi:
                raise TpusimError(f"{flag} {v:,} is over the limit of {hi:,}; give a smaller "
                                  f"value")
        if self.prompt_len is not None and self.prefill_chunk is not None:
            n = -(-self.prompt_len // self.prefill_chunk)
            if n > MAX_CHUNKS:
                raise TpusimError(
                    f"--prompt-len {self.prompt_len:,} in --prefill-chunk {self.prefill_chunk:,}"
                    f"-token chunks is {n:,} chunks, over the limit of {MAX_CHUNKS:,}; give "
                    f"chunks of at least {-(-self.prompt_len // MAX_CHUNKS):,} tokens"
                )

    @property
    def weight_bytes_per_param(self) -> float:
        return storage_bytes(WEIGHT_STORAGE_DTYPES, self.weight_dtype, "--weight-dtype")

    @property
    def kv_bytes_per_elem(self) -> float:
        return storage_bytes(KV_CACHE_DTYPES, self.kv_dtype, "--kv-dtype")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Layout:
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


def _layout(model: TransformerSpec, mesh: LogicalMesh, num_chips: int, batch: int) -> _Layout:
    if mesh.num_ici_devices * mesh.num_slices != num_chips:
        raise TpusimError(
            f"mesh {mesh.describe()} covers {mesh.num_ici_devices * mesh.num_slices} chips but "
            f"the pod has {num_chips}; make the mesh axes multiply to {num_chips}"
            + dcn_hint(mesh, num_chips)
        )
    other = sorted({n for n, _ in mesh.axes + mesh.dcn_axes} - set(_DECODE_AXES))
    if other:
        raise TpusimError(f"mesh axis {other[0]} is not modelled for inference; use "
                          f"{', '.join(_DECODE_AXES)}")
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
        return _Layout(tp=tp, dp=dp, ep=ep, fs=fs, batch_shards=shards, local_batch=local,
                       att_batch=att, kv_split=1, kv_batch=att, kv_heads=1.0,
                       proj_kv_heads=1.0)
    # tpu.md §5 "KV sharding": heads over tensor, then the rest of tensor over batch.
    split = tp // K if tp > K else 1
    return _Layout(tp=tp, dp=dp, ep=ep, fs=fs, batch_shards=shards, local_batch=local,
                   att_batch=att, kv_split=split, kv_batch=math.ceil(att / split),
                   kv_heads=K / tp if tp <= K else 1.0, proj_kv_heads=max(K / tp, 1.0))


def _weight_params_per_chip(model: TransformerSpec, lay: _Layout) -> tuple[float, float]:
    """(matmul weights, bf16 norm scales) per chip, in parameters."""
    m, tp = model, lay.tp
    D, hd, H = m.d_model, m.head_dim, m.num_heads
    att = D * (H / tp + 2 * lay.proj_kv_heads) * hd + H / tp * hd * D
    if m.is_mla:
        att = sum(p / (1 if k in _MLA_WHOLE else tp) for k, p in m.mla_matrices())
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


def _activation_bytes(model: TransformerSpec, lay: _Layout, tokens: float,
                      logit_rows: float) -> float:
    """Working set of one layer's activations for `tokens` rows per chip (bf16), plus the fp32
    logits of `logit_rows` rows (the last token of each local sequence)."""
    m, a, tp = model, _ACT_BYTES, lay.tp
    F = m.expert_d_ff * m.experts_per_token if m.is_moe else m.d_ff
    widest = max(4 * m.d_model / lay.fs, 2 * m.mlp.num_matrices * F / tp,
                 (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / tp * 2)
    return tokens * widest * a + logit_rows * math.ceil(m.vocab_size / tp) * 4


def memory_plan(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                cfg: DecodeConfig) -> dict[str, float]:
    """Per-chip HBM of a decode step: weights, KV cache and activations (bytes)."""
    lay = _layout(model, mesh, num_chips, cfg.batch)
    w_params, norms = _weight_params_per_chip(model, lay)
    weights = w_params * cfg.weight_bytes_per_param + norms * _ACT_BYTES
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
    act = _activation_bytes(model, lay, rows, lay.local_batch)
    return {"weights_bytes": weights, "kv_cache_bytes": kv, "activation_bytes": act,
            "total_bytes": weights + kv + act}


def max_batch_that_fits(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                        cfg: DecodeConfig, hbm_bytes: float, limit: int = 1 << 24) -> int:
    """Largest global batch whose weights + KV cache + activations fit in `hbm_bytes` per chip.

    Returns 0 if not even one sequence fits. The plan is monotone in the batch, so this is a
    binary search over `memory_plan` (no replay). With fsdp (2D weight-stationary) the batch
    must be a multiple of data x fsdp, so the search runs over those multiples.
    """
    import dataclasses

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


class _InferenceCompiler:
    def __init__(self, model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                 cfg: DecodeConfig, lay: _Layout):
        self.m, self.mesh, self.num_chips, self.cfg, self.lay = model, mesh, num_chips, cfg, lay
        chunks = (-(-cfg.prompt_len // cfg.prefill_chunk)
                  if cfg.prompt_len is not None and cfg.prefill_chunk else 1)
        self.b = TraceBuilder(fix=(
            f"--prompt-len {cfg.prompt_len:,} in {chunks:,} chunks of --prefill-chunk "
            f"{cfg.prefill_chunk:,} x {model.num_layers} layers build it: use a larger "
            f"--prefill-chunk" if chunks > 1 else
            f"{model.num_layers} layers build it: use a model with fewer layers"))
        self.wb = cfg.weight_bytes_per_param
        self.kvb = cfg.kv_bytes_per_elem
        self.mm_dtype = cfg.matmul_dtype.lower()
        self.routing = None  # the last MoE layer's routing (for the meta)

    # -- helpers (same conventions as workloads/training.py) ---------------------------------
    def mm(self, name, flops, w_bytes, io_bytes, deps, layer, phase, weights=True, **kw):
        return self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.MXU, flops=flops,
                          hbm_bytes=w_bytes + io_bytes,
                          dtype=self.mm_dtype if weights else "bf16", deps=deps, layer=layer,
                          phase=phase, **kw)

    def vpu(self, name, flops, nbytes, deps, layer, phase, **kw):
        return self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.VPU, flops=flops,
                          hbm_bytes=nbytes, deps=deps, layer=layer, phase=phase, **kw)

    def coll(self, name, kind, axes, nbytes, deps, layer, phase):
        axes = tuple(a for a in axes if self.mesh.size(a) > 1)
        if not axes or nbytes <= 0:
            return None
        return self.b.add(name, kind=OpKind.COLLECTIVE, collective=kind, mesh_axes=axes,
                          bytes=nbytes, deps=deps, layer=layer, phase=phase)

    @staticmethod
    def _deps(*xs):
        return [x for x in xs if x is not None]

    # -- one layer ---------------------------------------------------------------------------
    def layer(self, layer: int, dep: int, t: int, prev_ctx: int, phase: str) -> int:
        """One Transformer layer for `t` new tokens per sequence that attend to `prev_ctx`
        cached tokens plus (causally) themselves."""
        if self.lay.fs > 1:
            return self.layer_2d(layer, dep, t, prev_ctx, phase)
        m, lay, a, wb = self.m, self.lay, _ACT_BYTES, self.wb
        D, hd, H = m.d_model, m.head_dim, m.num_heads
        tp = lay.tp
        n = lay.local_batch * t  # token rows per chip
        h_loc = H / tp
        kp = lay.proj_kv_heads
        norm = self.vpu("norm_attn", 5 * n * D, 2 * n * D * a, [dep], layer, phase)
        if m.is_mla:
            att = self.mla_attention(layer, norm, t, prev_ctx, phase)
            hd = m.value_head_dim  # the output projection reads the value heads
        else:
            qkv = self.mm("qkv_proj", 2 * n * D * (h_loc + 2 * kp) * hd,
                          D * (h_loc + 2 * kp) * hd * wb,
                          n * D * a + n * (h_loc + 2 * kp) * hd * a, [norm], layer, phase)
            qkv = self.qk_norm(layer, qkv, n * (h_loc + kp) * hd, phase)
            rope = self.vpu("rotary", 6 * n * (h_loc + kp) * hd, 2 * n * (h_loc + kp) * hd * a,
                            [qkv], layer, phase)
            att_in = [rope]
            if lay.kv_split > 1:
                # KV cache sharded over batch within the tensor group (tpu.md §5 "KV
                # sharding"): queries move to the chips holding their sequences' cache, and
                # the outputs back.
                q2a = self.coll("kv_batch_alltoall_q", "all-to-all", ("tensor",),
                                n * H * hd * a, [rope], layer, phase)
                att_in = self._deps(rope, q2a)
            att = self.attention(layer, att_in, t, prev_ctx, phase)
            if lay.kv_split > 1:
                o2a = self.coll("kv_batch_alltoall_out", "all-to-all", ("tensor",),
                                n * H * hd * a, [att], layer, phase)
                att = o2a if o2a is not None else att
        out = self.mm("out_proj", 2 * n * h_loc * hd * D, h_loc * hd * D * wb,
                      n * h_loc * hd * a + n * D * a, [att], layer, phase)
        ar1 = self.coll("tp_allreduce_attn", "all-reduce", ("tensor",), n * D * a, [out], layer,
                        phase)
        post = self.post_norm("post_norm_attn", layer, self._deps(out, ar1), n * D, phase)
        res1 = self.vpu("residual_attn", n * D, 3 * n * D * a, post, layer, phase)
        norm2 = self.vpu("norm_mlp", 5 * n * D, 2 * n * D * a, [res1], layer, phase)
        mlp = self.mlp(layer, norm2, n, phase, t)
        ar2 = self.coll("tp_allreduce_mlp", "all-reduce", ("tensor",), n * D * a, [mlp], layer,
                        phase)
        deps = self._deps(mlp, res1, ar2)
        if m.post_norms:
            deps = self.post_norm("post_norm_mlp", layer, self._deps(mlp, ar2), n * D, phase)
            deps.append(res1)
        return self.vpu("residual_mlp", n * D, 3 * n * D * a, deps, layer, phase)

    def qk_norm(self, layer: int, qkv: int, elems: float, phase: str) -> int:
        """Gemma 3's RMSNorm of the query and key heads (`elems` of them per chip), or `qkv`
        itself for a model without it."""
        if not self.m.qk_norm:
            return qkv
        return self.vpu("qk_norm", 5 * elems, 2 * elems * _ACT_BYTES, [qkv], layer, phase)

    def post_norm(self, name: str, layer: int, deps: list[int], elems: float,
                  phase: str) -> list[int]:
        """A sublayer output's norm before the residual add (Gemma 2 / 3's post-norms), costed
        like the pre-norms; `deps` unchanged for a model without them."""
        if not self.m.post_norms:
            return deps
        return [self.vpu(name, 5 * elems, 2 * elems * _ACT_BYTES, deps, layer, phase)]

    def layer_2d(self, layer: int, dep: int, t: int, prev_ctx: int, phase: str) -> int:
        """One layer with 2D weight-stationary sharding (tpu.md §5), X = fsdp, YZ = tensor.

        Weights: W_qkv[D_X, heads_YZ], W_o[heads_YZ, D_X], W_in[D_X, F_YZ], W_out[F_YZ, D_X].
        The residual stream lives as x[B, D_XYZ]. Per block:
          x[B, D_X]          = AllGather_YZ(x[B, D_XYZ])           V = B·D/X·2
          t[B, F_YZ]{U_X}    = x[B, D_X] ·_D W_in[D_X, F_YZ]
          t[B_X, F_YZ]       = ReduceScatter_X(t)                   V = B·F/YZ·2 (per input matrix)
          t[B, F_YZ]         = AllGather_X(act(t))                  V = B·F/YZ·2
          o[B, D_X]{U_YZ}    = t ·_F W_out[F_YZ, D_X]
          o[B, D_XYZ]        = ReduceScatter_YZ(o)                  V = B·D/X·2
        With YZ over two torus axes (2W) and X over one (W) this is the book's
        2BD/(X·W) + 4BF/(YZ·W). Attention takes the same path with QKV in place of W_in: the
        reduce-scatter over X splits the batch, so each chip attends for B/X sequences of its
        tensor heads and holds only their KV cache.
        """
        m, lay, a, wb = self.m, self.lay, _ACT_BYTES, self.wb
        D, hd, H = m.d_model, m.head_dim, m.num_heads
        tp, fs = lay.tp, lay.fs
        n = lay.local_batch * t  # token rows every chip of the group multiplies
        n_att = lay.att_batch * t  # rows per chip after the batch reduce-scatter over fsdp
        dx = D / fs  # the d_model slice of this chip's weights
        dres = dx / tp  # the residual slice this chip owns
        h_loc, kp = H / tp, lay.proj_kv_heads
        qkv_w = (h_loc + 2 * kp) * hd
        d = self._deps
        # -- attention block --------------------------------------------------------------
        norm = self.vpu("norm_attn", 5 * n * dres, 2 * n * dres * a, [dep], layer, phase)
        ag1 = self.coll("ws_allgather_x_attn", "all-gather", ("tensor",), n * dx * a, [norm],
                        layer, phase)
        qkv = self.mm("qkv_proj", 2 * n * dx * qkv_w, dx * qkv_w * wb,
                      n * dx * a + n * qkv_w * a, d(norm, ag1), layer, phase)
        rs_qkv = self.coll("ws_reducescatter_qkv", "reduce-scatter", ("fsdp",), n * qkv_w * a,
                           [qkv], layer, phase)
        rope_deps = d(qkv, rs_qkv)
        if m.qk_norm:
            rope_deps = [self.qk_norm(layer, rope_deps[-1], n_att * (h_loc + kp) * hd, phase)]
        rope = self.vpu("rotary", 6 * n_att * (h_loc + kp) * hd, 2 * n_att * (h_loc + kp) * hd * a,
                        rope_deps, layer, phase)
        att_in = [rope]
        if lay.kv_split > 1:
            q2a = self.coll("kv_batch_alltoall_q", "all-to-all", ("tensor",),
                            n_att * H * hd * a, [rope], layer, phase)
            att_in = d(rope, q2a)
        att = self.attention(layer, att_in, t, prev_ctx, phase)
        if lay.kv_split > 1:
            o2a = self.coll("kv_batch_alltoall_out", "all-to-all", ("tensor",),
                            n_att * H * hd * a, [att], layer, phase)
            att = o2a if o2a is not None else att
        ag_o = self.coll("ws_allgather_attn_out", "all-gather", ("fsdp",), n * h_loc * hd * a,
                         [att], layer, phase)
        out = self.mm("out_proj", 2 * n * h_loc * hd * dx, h_loc * hd * dx * wb,
                      n * h_loc * hd * a + n * dx * a, d(att, ag_o), layer, phase)
        rs1 = self.coll("ws_reducescatter_x_attn", "reduce-scatter", ("tensor",), n * dx * a,
                        [out], layer, phase)
        post = self.post_norm("post_norm_attn", layer, d(out, rs1), n * dres, phase)
        res1 = self.vpu("residual_attn", n * dres, 3 * n * dres * a, post, layer, phase)
        # -- MLP block ----------------------------------------------------------------------
        F, mats = m.d_ff, m.mlp.num_matrices
        f_loc = F / tp
        norm2 = self.vpu("norm_mlp", 5 * n * dres, 2 * n * dres * a, [res1], layer, phase)
        ag2 = self.coll("ws_allgather_x_mlp", "all-gather", ("tensor",), n * dx * a, [norm2],
                        layer, phase)
        h = self.mm("mlp_in", 2 * n * dx * f_loc * (mats - 1), (mats - 1) * dx * f_loc * wb,
                    n * dx * a + n * f_loc * (mats - 1) * a, d(norm2, ag2), layer, phase)
        # Gated MLPs reduce both the gate and the up projection before the nonlinearity.
        rs_h = self.coll("ws_reducescatter_h", "reduce-scatter", ("fsdp",),
                         n * f_loc * (mats - 1) * a, [h], layer, phase)
        act = self.vpu("mlp_act", 8 * n_att * f_loc, n_att * f_loc * mats * a, d(h, rs_h),
                       layer, phase)
        ag_h = self.coll("ws_allgather_h", "all-gather", ("fsdp",), n * f_loc * a, [act], layer,
                         phase)
        o = self.mm("mlp_out", 2 * n * f_loc * dx, f_loc * dx * wb, n * f_loc * a + n * dx * a,
                    d(act, ag_h), layer, phase)
        rs2 = self.coll("ws_reducescatter_x_mlp", "reduce-scatter", ("tensor",), n * dx * a,
                        [o], layer, phase)
        deps = d(o, res1, rs2)
        if m.post_norms:
            deps = self.post_norm("post_norm_mlp", layer, d(o, rs2), n * dres, phase) + [res1]
        return self.vpu("residual_mlp", n * dres, 3 * n * dres * a, deps, layer, phase)

    def attended(self, layer: int, t: int, prev_ctx: int) -> tuple[float, int]:
        """(keys each of the `t` new tokens attends to on average, cached positions a step
        reads) in layer `layer` after `prev_ctx` cached tokens."""
        m = self.m
        keys = prev_ctx + (t + 1) / 2 if t > 1 else prev_ctx  # causal average within the chunk
        cached = prev_ctx
        window = m.layer_attention_window(layer)
        chunk = m.layer_attention_chunk(layer)
        if window is not None:
            # A local layer's query at position p (from 1) attends to min(window, p) keys, and
            # its cache holds (and a step reads) at most the last `window` positions.
            cached = min(prev_ctx, window)
            keys = (causal_window_pairs(prev_ctx + t, window)
                    - causal_window_pairs(prev_ctx, window)) / t if t > 1 else cached
        elif chunk is not None:
            # A chunked layer's query attends to its own chunk up to itself: a step reads the
            # cached part of the current chunk (prev_ctx mod chunk positions; the cache holds
            # at most a chunk, `kv_cache_entries`).
            cached = prev_ctx % chunk
            keys = (causal_chunk_pairs(prev_ctx + t, chunk)
                    - causal_chunk_pairs(prev_ctx, chunk)) / t if t > 1 else cached
        return keys, cached

    def mla_attention(self, layer: int, norm: int, t: int, prev_ctx: int, phase: str) -> int:
        """MLA's projections and attention (DeepSeek-V2 §2.1.3; docs/model/moe.md): the query
        (down, norm, up; or one full-rank projection), the latent and the shared rotary key
        (written to the cache: kv_lora_rank + qk_rope_head_dim elements a position), then

        * decode (one new token): the absorbed-weight form, as DeepSeek serves it: each head's
          non-rotary query is multiplied by its key up-projection W_UK (kv_lora x nope), so
          the scores are taken against the cached latents directly (a multi-query attention
          of one cache head of kv_lora + rope for the keys and kv_lora for the values), and
          the latent-space output is multiplied by W_UV (kv_lora x v) per head;
        * prefill (several tokens): the up-projected form, as in training: the latents of
          every position the tokens attend to (cached and new) are up-projected to each
          head's key and value, then an ordinary attention of head_dim / v_head_dim.

        Returns the op whose output the output projection reads."""
        m, lay, a, wb, kvb = self.m, self.lay, _ACT_BYTES, self.wb, self.kvb
        D, H, hd, v = m.d_model, m.num_heads, m.head_dim, m.value_head_dim
        kl, rd, ql = m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank
        nope = hd - rd
        tp = lay.tp
        h_loc = H / tp
        n = lay.local_batch * t
        bk = lay.kv_batch
        if ql is not None:
            qa = self.mm("q_down", 2 * n * D * ql, D * ql * wb, n * D * a + n * ql * a, [norm],
                         layer, phase)
            qn = self.vpu("q_norm", 5 * n * ql, 2 * n * ql * a, [qa], layer, phase)
            q = self.mm("q_up", 2 * n * ql * h_loc * hd, ql * h_loc * hd * wb,
                        n * ql * a + n * h_loc * hd * a, [qn], layer, phase)
        else:
            q = self.mm("q_proj", 2 * n * D * h_loc * hd, D * h_loc * hd * wb,
                        n * D * a + n * h_loc * hd * a, [norm], layer, phase)
        kva = self.mm("kv_down", 2 * n * D * (kl + rd), D * (kl + rd) * wb,
                      n * D * a + n * (kl + rd) * a, [norm], layer, phase)
        kvn = self.vpu("kv_norm", 5 * n * kl, 2 * n * kl * a, [kva], layer, phase)
        rope = self.vpu("rotary", 6 * n * (h_loc + 1) * rd, 2 * n * (h_loc + 1) * rd * a,
                        [q, kvn], layer, phase)
        keys, cached = self.attended(layer, t, prev_ctx)
        latent = kl + rd
        kv_write = bk * t * latent * kvb
        if t == 1:
            # Absorbed: q_nope W_UK per head, MQA over the latents, then W_UV per head.
            qab = self.mm("mla_absorb_q", 2 * n * h_loc * nope * kl, h_loc * nope * kl * wb,
                          n * h_loc * (nope + kl) * a, [rope], layer, phase)
            att = self.mm("attention", 2 * bk * t * keys * h_loc * (latent + kl), 0.0,
                          bk * cached * latent * kvb + kv_write
                          + bk * t * h_loc * (latent + kl) * a, [qab], layer, phase,
                          weights=False, narrow_dim=kl)
            return self.mm("mla_absorb_out", 2 * n * h_loc * kl * v, h_loc * kl * v * wb,
                           n * h_loc * (kl + v) * a, [att], layer, phase)
        # Up-projected: every attended position's latent to each head's key and value.
        rows = bk * (cached + t)
        up = self.mm("kv_up", 2 * rows * kl * h_loc * (nope + v), kl * h_loc * (nope + v) * wb,
                     rows * kl * a + rows * h_loc * (nope + v) * a,
                     [rope], layer, phase)
        return self.mm("attention", 2 * bk * t * keys * h_loc * (hd + v), 0.0,
                       bk * cached * latent * kvb + kv_write + rows * h_loc * (hd + v) * a
                       + bk * t * h_loc * (hd + v) * a, [up], layer, phase, weights=False,
                       narrow_dim=hd)

    def attention(self, layer: int, deps: list[int], t: int, prev_ctx: int, phase: str) -> int:
        """Scores and values over the KV cache: HBM-bound in decode (intensity ~1, tpu.md §5)."""
        m, lay, a, kvb = self.m, self.lay, _ACT_BYTES, self.kvb
        hd = m.head_dim
        bk, kh = lay.kv_batch, lay.kv_heads
        q_heads = kh * m.num_heads / m.num_kv_heads  # query heads served by the local cache
        keys, cached = self.attended(layer, t, prev_ctx)
        flops = 4 * bk * t * keys * q_heads * hd
        kv_read = bk * cached * kh * hd * 2 * kvb
        kv_write = bk * t * kh * hd * 2 * kvb
        chunk_kv = bk * t * kh * hd * 2 * a if t > 1 else 0.0  # this chunk's own keys/values
        qo = 2 * bk * t * q_heads * hd * a
        # Both attention matmuls tile head_dim (q.K^T contracts over it, P.V outputs it).
        return self.mm("attention", flops, 0.0, kv_read + kv_write + chunk_kv + qo, deps, layer,
                       phase, weights=False, narrow_dim=hd)

    def mlp(self, layer: int, dep: int, n: float, phase: str, t: int) -> int:
        m, lay, a, wb = self.m, self.lay, _ACT_BYTES, self.wb
        D, tp, mats = m.d_model, lay.tp, m.mlp.num_matrices
        if m.layer_is_moe(layer):
            E, k, F = m.num_experts, m.experts_per_token, m.expert_d_ff
            # A routing group is one sequence's `t` new tokens (workloads/moe.py).
            rt = plan_routing(m, lay.ep, t, self.cfg.moe)
            self.routing = rt
            rows = rt.expert_rows_per_token  # rows per local token on the busiest chip
            router = self.mm("router", 2 * n * D * E, D * E * wb, n * D * a + n * E * 4, [dep],
                             layer, phase)
            topk = self.vpu("topk_route", 4 * n * E, n * E * 4, [router], layer, phase)
            pre = topk
            e_loc = E / lay.ep
            if rt.dense_dispatch:
                # MaxText's dropping path: one-hot [tokens, experts, capacity] masks and the
                # dispatch einsum; every expert computes its whole (padded) capacity, so all
                # local expert weights are read.
                mask = n * E * rt.capacity * a
                masks = self.vpu("moe_masks", 2 * n * E * rt.capacity, 2 * mask, [topk], layer,
                                 phase)
                pre = self.mm("moe_dispatch", dispatch_flops(n, E, rt.capacity, D), 0.0,
                              mask + n * D * a + n * rows * D * a, [masks], layer, phase,
                              weights=False)
                touched = e_loc
            else:
                # Only experts that receive a token are read from HBM. An expert with share q
                # of the routing assignments is picked by a token with probability k q, so it
                # is idle with probability (1 - k q)^(n ep) over the group's n ep tokens; at
                # uniform routing (q = 1/E) this gives the book's E/k weight-load factor at
                # small batch (tpu.md §3 "MoE"). The busiest chip holds the hottest block.
                q = expert_shares(E, k, self.cfg.moe.expert_skew)[: int(e_loc)]
                if self.cfg.moe.expert_skew == 0:
                    touched = e_loc * (1 - (1 - k / E) ** (n * lay.ep))
                else:
                    touched = sum(1 - (1 - k * qe) ** (n * lay.ep) for qe in q)
            disp = self.coll("ep_dispatch", "all-to-all", ("expert",),
                             n * rows * D * a * lay.ep, [pre], layer, phase)
            w_exp = mats * D * F / tp * wb
            h = self.mm("expert_in", 2 * n * rows * D * F * (mats - 1) / tp,
                        touched * w_exp * (mats - 1) / mats,
                        n * rows * D * a + n * rows * F * (mats - 1) / tp * a,
                        self._deps(pre, disp), layer, phase)
            act = self.vpu("expert_act", 8 * n * rows * F / tp, n * rows * F * mats / tp * a,
                           [h], layer, phase)
            o = self.mm("expert_out", 2 * n * rows * F * D / tp, touched * w_exp / mats,
                        n * rows * F / tp * a + n * rows * D * a, [act], layer, phase)
            comb = self.coll("ep_combine", "all-to-all", ("expert",),
                             n * rows * D * a * lay.ep, [o], layer, phase)
            outs = self._deps(o, comb)
            if m.num_shared_experts:
                sF = m.num_shared_experts * F
                outs.append(self.mm("shared_expert", 2 * n * D * sF * mats / tp,
                                    mats * D * sF / tp * wb, 2 * n * D * a, [dep], layer, phase))
            if rt.dense_dispatch:
                return self.mm("moe_combine", dispatch_flops(n, E, rt.capacity, D), 0.0,
                               n * E * rt.capacity * a + n * rows * D * a + 2 * n * D * a, outs,
                               layer, phase, weights=False)
            return self.vpu("expert_combine", 2 * n * k * D, (k + 1) * n * D * a, outs, layer,
                            phase)
        F = m.d_ff
        h = self.mm("mlp_in", 2 * n * D * F * (mats - 1) / tp, (mats - 1) * D * F / tp * wb,
                    n * D * a + n * F * (mats - 1) / tp * a, [dep], layer, phase)
        act = self.vpu("mlp_act", 8 * n * F / tp, n * F * mats / tp * a, [h], layer, phase)
        return self.mm("mlp_out", 2 * n * F * D / tp, D * F / tp * wb, n * F / tp * a + n * D * a,
                       [act], layer, phase)

    # -- embedding and the output projection -----------------------------------------------
    def embed(self, dep: int | None, n: float, phase: str, alloc: float) -> int:
        # 2D weight-stationary keeps the residual as x[B, D_XYZ]: each chip looks up its slice.
        lay = self.lay
        D = self.m.d_model / (lay.fs * lay.tp) if lay.fs > 1 else self.m.d_model
        look = self.vpu("embed_lookup", 0.0, n * D * (self.wb + _ACT_BYTES),
                        [dep] if dep is not None else [], -1, phase, alloc_bytes=alloc)
        # The table's vocabulary is split over `tensor`: each shard looks up the rows it holds
        # (zeros elsewhere) and the partial embeddings are summed over `tensor` (XLA's decode
        # program, tensor=8: one all-reduce of the [batch, d_model] bf16 embeddings). In 2D
        # weight-stationary each chip holds [V_YZ, D_X]: the partial [n, D_X] rows are summed
        # and split into the D_XYZ residual slices, a reduce-scatter over `tensor`.
        if lay.fs > 1:
            red = self.coll("tp_embed_reducescatter", "reduce-scatter", ("tensor",),
                            n * self.m.d_model / lay.fs * _ACT_BYTES, [look], -1, phase)
        else:
            red = self.coll("tp_embed_allreduce", "all-reduce", ("tensor",),
                            n * self.m.d_model * _ACT_BYTES, [look], -1, phase)
        return red if red is not None else look

    def head(self, dep: int, phase: str, free: float) -> int:
        """Final norm, logits for the last token of each sequence, and sampling."""
        m, lay, a = self.m, self.lay, _ACT_BYTES
        n, D, tp = lay.local_batch, m.d_model, lay.tp
        v_loc = math.ceil(m.vocab_size / tp)
        if lay.fs > 1:
            # 2D weight-stationary: W_unembed[D_X, V_YZ]. Gather x[B, D_X] over tensor, then
            # reduce-scatter the partial fp32 logits over fsdp (batch split); each chip samples
            # B/X sequences. Broadcasting the sampled token ids back is a few bytes, neglected.
            dx = D / lay.fs
            norm = self.vpu("final_norm", 5 * n * dx / tp, 2 * n * dx / tp * a, [dep], -1, phase)
            ag = self.coll("ws_allgather_x_head", "all-gather", ("tensor",), n * dx * a, [norm],
                           -1, phase)
            logits = self.mm("logits", 2 * n * dx * v_loc, v_loc * dx * self.wb,
                             n * dx * a + n * v_loc * 4, self._deps(norm, ag), -1, phase)
            rs = self.coll("ws_reducescatter_logits", "reduce-scatter", ("fsdp",),
                           n * v_loc * 4, [logits], -1, phase)
            logit_deps = self._deps(logits, rs)
            n = lay.att_batch
        else:
            norm = self.vpu("final_norm", 5 * n * D, 2 * n * D * a, [dep], -1, phase)
            logits = self.mm("logits", 2 * n * D * v_loc, v_loc * D * self.wb,
                             n * D * a + n * v_loc * 4, [norm], -1, phase)
            logit_deps = [logits]
        return self.sample(logit_deps, n, v_loc, phase, free)

    def sample(self, logit_deps: list[int], n: float, v_loc: int, phase: str,
               free: float) -> int:
        """The next token of each of the chip's n rows from its [n, v_loc] f32 logits (the
        vocabulary split over `tensor`), with the collectives XLA's SPMD partitioner emits for
        it (docs/model.md "Collectives as XLA emits them"; the v5e tensor=8 decode programs of
        benchmarks/xla_crosscheck.py, n = 8):

        * greedy: each shard's row maxima and their indices (f32, int32) are all-gathered over
          `tensor` and every chip takes the argmax of the tp candidates;
        * top-k: XLA sorts along the vocabulary, so it first moves whole rows onto one chip
          each: the logits and their int32 indices are all-to-all'ed over `tensor` (each chip's
          [n, v_loc] buffers), sorted, and all-to-all'ed back into the vocabulary split; the
          k largest then sit on the first shard, which sends each other shard its 1/tp of them
          (values and indices: collective-permutes); the draw among the k (an argmax of
          perturbed values) all-gathers each shard's best value and index and all-reduces the
          chosen token id."""
        tp, k = self.lay.tp, _SAMPLE_TOP_K
        if self.cfg.sampling == "greedy":
            local = self.vpu("sample_local_argmax", 2 * n * v_loc, n * v_loc * 4, logit_deps,
                             -1, phase)
            ag = self.coll("tp_sample_argmax_allgather", "all-gather", ("tensor",),
                           tp * n * 8, [local], -1, phase)
            return self.vpu("sample", 2 * n * tp, n * tp * 8, self._deps(local, ag), -1,
                            phase, free_bytes=free)
        to_rows = self.coll("tp_sample_sort_alltoall", "all-to-all", ("tensor",),
                            tp * n * v_loc * 8, logit_deps, -1, phase)
        local = self.vpu("sample_local_topk", 5 * n * v_loc, n * v_loc * 4,
                         self._deps(*logit_deps, to_rows), -1, phase)
        back = self.coll("tp_sample_sorted_alltoall", "all-to-all", ("tensor",),
                         tp * n * v_loc * 8, [local], -1, phase)
        spread = self.coll("tp_sample_topk_permute", "collective-permute", ("tensor",),
                           2 * (tp - 1) * n * math.ceil(k / tp) * 4, self._deps(local, back),
                           -1, phase)
        deps = self._deps(local, back, spread)
        ag = self.coll("tp_sample_choice_allgather", "all-gather", ("tensor",), tp * n * 8,
                       deps, -1, phase)
        ar = self.coll("tp_sample_token_allreduce", "all-reduce", ("tensor",), n * 4,
                       self._deps(*deps, ag), -1, phase)
        return self.vpu("sample", 2 * n * k, n * k * 8, self._deps(*deps, ag, ar), -1, phase,
                        free_bytes=free)

    def meta(self, kind: str, plan: dict[str, float]) -> dict:
        m, cfg, lay = self.m, self.cfg, self.lay
        return {
            "kind": kind,
            "model": m.name,
            "num_chips": self.num_chips,
            "batch": cfg.batch,
            "context_len": cfg.context_len,
            "prompt_len": cfg.prompt_len,
            "prefill_chunk": cfg.prefill_chunk,
            "weight_dtype": cfg.weight_dtype,
            "kv_dtype": cfg.kv_dtype,
            "matmul_dtype": cfg.matmul_dtype,
            "local_batch": lay.local_batch,
            # "2d-weight-stationary" when the mesh has fsdp (tpu.md §5), else "1d".
            "sharding": "2d-weight-stationary" if lay.fs > 1 else "1d",
            "kv_batch_split": lay.kv_split,
            # Per chip (the busiest chip when the batch does not divide evenly).
            "weights_bytes": plan["weights_bytes"],
            "kv_cache_bytes": plan["kv_cache_bytes"],
            "activation_bytes": plan["activation_bytes"],
            "static_hbm_bytes": plan["weights_bytes"] + plan["kv_cache_bytes"],
            # Whole model / whole batch (tpu.md §3: KV = 2·S·L·K·H·bytes per sequence).
            "weights_bytes_total": m.num_params * cfg.weight_bytes_per_param,
            "kv_cache_bytes_total": cfg.batch * m.kv_cache_bytes(
                cfg.context_len if kind == "decode" else cfg.prompt_len, cfg.kv_bytes_per_elem),
            "overlap": True,
            **({"moe": self.routing.summary(cfg.moe), "moe_scenario_applied": True}
               if self.routing is not None else {}),
        }


def _check_sampling(model: TransformerSpec, cfg: DecodeConfig) -> None:
    """Top-k sampling needs at least k logits to choose among."""
    if cfg.sampling == "top-k" and model.vocab_size < _SAMPLE_TOP_K:
        raise TpusimError(
            f"--sampling top-k draws among the {_SAMPLE_TOP_K} largest logits, but model "
            f"{model.name!r} has vocab_size={model.vocab_size}, fewer than {_SAMPLE_TOP_K}; "
            f"use --sampling greedy, or a vocabulary of at least {_SAMPLE_TOP_K} tokens"
        )


def compile_decode_step(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                        cfg: DecodeConfig) -> Trace:
    """The SPMD program of one decode step: every sequence of the batch emits one token.

    Args:
        model: the Transformer.
        mesh: logical mesh over `data`, `tensor` (heads, d_ff, vocab, KV heads), `expert`, and
            `fsdp` (2D weight-stationary: splits the weights' d_model; see `layer_2d`).
        num_chips: chips in the pod (must equal the mesh size).
        cfg: batch, context length and dtypes.
    """
    cfg.moe.check_model(model)
    _check_sampling(model, cfg)
    lay = _layout(model, mesh, num_chips, cfg.batch)
    plan = memory_plan(model, mesh, num_chips, cfg)
    c = _InferenceCompiler(model, mesh, num_chips, cfg, lay)
    x = c.embed(None, lay.local_batch, "decode", plan["activation_bytes"])
    for layer in range(model.num_layers):
        x = c.layer(layer, x, 1, cfg.context_len, "decode")
    c.head(x, "decode", plan["activation_bytes"])
    return Trace(mesh=mesh, ops=tuple(c.b.ops), meta=c.meta("decode", plan))


def _check_prefill_size(b: TraceBuilder, model: TransformerSpec, cfg: DecodeConfig, start: int,
                        per_chunk: int) -> None:
    """Every chunk adds the same ops as the first (tests/test_decode.py checks it), so a prompt
    whose chunks cannot fit one program is refused once the first is built, not after building
    the limit's ops (LLaMA-3-405B, 65,536 tokens in 256 chunks: 250,000 ops, 1.6 CPU-s)."""
    chunks = -(-cfg.prompt_len // cfg.prefill_chunk)
    least = start + chunks * per_chunk
    if least <= b.max_ops:
        return
    # The head after the last chunk needs room too (a few ops, under one chunk's).
    fit = max((b.max_ops - start) // per_chunk - 1, 1)
    raise TpusimError(
        f"--prompt-len {cfg.prompt_len:,} in {chunks:,} chunks of --prefill-chunk "
        f"{cfg.prefill_chunk:,} x {model.num_layers} layers compiles to at least {least:,} ops "
        f"({per_chunk:,} per chunk, counted on the first), over the {b.max_ops:,} tpusim "
        f"simulates in one program; use a --prefill-chunk of at least "
        f"{-(-cfg.prompt_len // fit):,} tokens "
        + (f"(at most {fit:,} chunks)" if fit > 1 else "(the whole prompt in one chunk)"))


def compile_prefill(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                    cfg: DecodeConfig, *, cached_len: int = 0) -> Trace:
    """The SPMD program of prefilling `cfg.prompt_len` tokens of every sequence.

    With `prefill_chunk`, the prompt is processed in chunks; each chunk attends causally to
    itself and to the cache written by the earlier chunks, and re-reads the weights.
    `cached_len` tokens before them are already in the KV cache (the earlier chunks of a
    prompt prefilled one chunk per serving iteration, sim/serving): every token attends to them
    too. `cfg.context_len` should then cover `cached_len + prompt_len` (the cache it holds).
    """
    if isinstance(cached_len, bool) or not isinstance(cached_len, int) or cached_len < 0:
        raise TpusimError(f"cached_len {cached_len!r} must be a whole number >= 0 (tokens "
                          f"already in the KV cache)")
    if cfg.prompt_len is None:
        raise TpusimError("prefill needs --prompt-len (prompt tokens per sequence)")
    cfg.moe.check_model(model)
    _check_sampling(model, cfg)
    lay = _layout(model, mesh, num_chips, cfg.batch)
    plan = memory_plan(model, mesh, num_chips, cfg)
    c = _InferenceCompiler(model, mesh, num_chips, cfg, lay)
    P = cfg.prompt_len
    chunk = min(cfg.prefill_chunk or P, P)
    x = None
    start = 0
    first = len(c.b.ops)
    while start < P:
        if start == chunk:  # the first chunk is built: refuse now a prompt that cannot fit
            _check_prefill_size(c.b, model, cfg, first, len(c.b.ops) - first)
        t = min(chunk, P - start)
        x = c.embed(x, lay.local_batch * t, "prefill",
                    plan["activation_bytes"] if start == 0 else 0.0)
        for layer in range(model.num_layers):
            x = c.layer(layer, x, t, cached_len + start, "prefill")
        start += t
    c.head(x, "prefill", plan["activation_bytes"])
    meta = c.meta("prefill", plan)
    meta["num_chunks"] = math.ceil(P / chunk)
    if cached_len:
        meta["cached_len"] = cached_len
    return Trace(mesh=mesh, ops=tuple(c.b.ops), meta=meta)


def decode_roofline_s(model: TransformerSpec, num_chips: int, cfg: DecodeConfig,
                      hbm_bytes_per_s: float, flops_per_s: float) -> float:
    """tpu.md §5 lower bound of a decode step on `num_chips` chips (whole-pod rates):
    `B·KV/W_total + max(2·B·P/C_total, P_bytes/W_total)` with P = active parameters."""
    kv = cfg.batch * model.kv_cache_bytes(cfg.context_len, cfg.kv_bytes_per_elem)
    p = model.num_active_params
    w_tot, c_tot = hbm_bytes_per_s * num_chips, flops_per_s * num_chips
    return kv / w_tot + max(2 * cfg.batch * p / c_tot, p * cfg.weight_bytes_per_param / w_tot)


__all__ = [
    "SAMPLING_MODES",
    "DecodeConfig",
    "compile_decode_step",
    "compile_prefill",
    "decode_roofline_s",
    "max_batch_that_fits",
    "memory_plan",
]
