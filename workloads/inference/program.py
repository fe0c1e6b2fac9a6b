"""The inference program builder (`InferenceCompiler`): one layer's ops for new tokens
attending to a KV cache (1D Megatron or 2D weight-stationary, MLA, local attention, MoE), the
embedding, the output head and the sampling of the next token, with XLA's collectives.
Formulas follow `reference/tpu.md` §3 and §5; the entry points are `steps.py`."""

from __future__ import annotations

import math

from topologies.mesh import LogicalMesh
from workloads.inference.config import SAMPLE_TOP_K, DecodeConfig
from workloads.inference.layout import ACT_BYTES, Layout
from workloads.models import TransformerSpec, causal_chunk_pairs, causal_window_pairs
from workloads.moe import dispatch_flops, expert_shares, plan_routing
from workloads.trace import OpKind, TraceBuilder, Unit
from workloads.trace_meta import TraceMeta


def moe_dispatch_form(tokens_per_sequence: int) -> str:
    """How an MoE layer's tokens cross the expert axis in an inference step (docs/model/moe.md
    "The dispatch form"): "all-gather" for a decode step (one new token per sequence), as XLA
    compiles it; "all-to-all" for a prefill (not compiled).

    Read off deviceless compiles (jax/libtpu 0.10.2, `validation/xla_moe_decode.py`) of a small
    MoE decoder's decode step on v5e 2x4 with its batch and KV cache split over expert=8 (the
    layout of `layout.py`): with MaxText's dropping masks (capacity factor 1.25, one token's
    capacity) at 8, 64 and 512 sequences per chip, and dropless (MaxText's `dense_matmul`
    without capacity) at 8, XLA gathers the expert group's tokens over `expert` for the
    dispatch (V = ep n D, bf16) and reduce-scatters the combine's partial sums back (bf16 on
    the dropping path, f32 dropless), with no all-to-all of tokens; the dropping path's masks
    cross by two small all-to-alls ([tokens, experts, capacity] bf16, dispatch and combine).
    Training programs with the batch split over expert move the tokens by all-to-alls
    (`workloads.training.xla_rules.moe_dispatch_form`)."""
    return "all-gather" if tokens_per_sequence == 1 else "all-to-all"


class InferenceCompiler:
    """The ops of one inference program, added layer by layer (`steps.py` drives it)."""

    def __init__(self, model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                 cfg: DecodeConfig, lay: Layout):
        self.m, self.mesh, self.num_chips, self.cfg, self.lay = model, mesh, num_chips, cfg, lay
        chunks = (-(-cfg.prompt_len // cfg.prefill_chunk)
                  if cfg.prompt_len is not None and cfg.prefill_chunk else 1)
        self.b = TraceBuilder(fix=(
            f"{{prompt_len}} {cfg.prompt_len:,} in {chunks:,} chunks of {{prefill_chunk}} "
            f"{cfg.prefill_chunk:,} x {model.num_layers} layers build it: use a larger "
            f"{{prefill_chunk}}" if chunks > 1 else
            f"{model.num_layers} layers build it: use a model with fewer layers"),
            fix_params=("prompt_len", "prefill_chunk") if chunks > 1 else ())
        self.wb = cfg.weight_bytes_per_param
        self.kvb = cfg.kv_bytes_per_elem
        self.mm_dtype = cfg.matmul_dtype.lower()
        self.routing = None  # the last MoE layer's routing (for the meta)

    # -- helpers (same conventions as workloads/training/program.py) -------------------------
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
        m, lay, a, wb = self.m, self.lay, ACT_BYTES, self.wb
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
        return self.vpu("qk_norm", 5 * elems, 2 * elems * ACT_BYTES, [qkv], layer, phase)

    def post_norm(self, name: str, layer: int, deps: list[int], elems: float,
                  phase: str) -> list[int]:
        """A sublayer output's norm before the residual add (Gemma 2 / 3's post-norms), costed
        like the pre-norms; `deps` unchanged for a model without them."""
        if not self.m.post_norms:
            return deps
        return [self.vpu(name, 5 * elems, 2 * elems * ACT_BYTES, deps, layer, phase)]

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
        m, lay, a, wb = self.m, self.lay, ACT_BYTES, self.wb
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
        m, lay, a, wb, kvb = self.m, self.lay, ACT_BYTES, self.wb, self.kvb
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
        m, lay, a, kvb = self.m, self.lay, ACT_BYTES, self.kvb
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

    def gathered_combine(self, layer, phase, n, rt, o, mask_a2a, shared) -> int:
        """The all-gather form's combine: each chip weights and sums its own experts' outputs
        for every gathered token (the combine einsum on the dropping path, after the combine
        mask's all-to-all; the top-k weighted sum dropless), and the partial sums are
        reduce-scattered over `expert` back to the tokens' chips (bf16 on the dropping path;
        f32 dropless, as MaxText's `dense_matmul` sums in f32: `moe_dispatch_form`)."""
        m, lay, a = self.m, self.lay, ACT_BYTES
        D, E, k = m.d_model, m.num_experts, m.experts_per_token
        ng = n * lay.ep
        rows = rt.expert_rows_per_token
        if rt.dense_dispatch:
            mask = n * E * rt.capacity * a
            mask_c = self.coll("ep_mask_alltoall", "all-to-all", ("expert",), mask * lay.ep,
                               [mask_a2a] if mask_a2a is not None else [o], layer, phase)
            part = self.mm("moe_combine", dispatch_flops(n, E, rt.capacity, D), 0.0,
                           mask + n * rows * D * a + ng * D * a,
                           self._deps(o, mask_c), layer, phase, weights=False)
            red_bytes = ng * D * a
        else:
            part = self.vpu("expert_combine", 2 * n * k * D, n * rows * D * a + ng * D * 4,
                            [o], layer, phase)
            red_bytes = ng * D * 4.0
        red = self.coll("ep_combine_reducescatter", "reduce-scatter", ("expert",), red_bytes,
                        [part], layer, phase)
        out = red if red is not None else part
        if shared is None:
            return out
        return self.vpu("expert_shared_add", n * D, 3 * n * D * a, [out, shared], layer, phase)

    def mlp(self, layer: int, dep: int, n: float, phase: str, t: int) -> int:
        m, lay, a, wb = self.m, self.lay, ACT_BYTES, self.wb
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
            # The dispatch form (`moe_dispatch_form`): a decode step gathers the expert
            # group's tokens and reduce-scatters the combine; a prefill sends them by
            # all-to-alls.
            gathered = moe_dispatch_form(t) == "all-gather" and lay.ep > 1
            ng = n * lay.ep if gathered else n
            tok = self.coll("ep_token_allgather", "all-gather", ("expert",), ng * D * a, [dep],
                            layer, phase) if gathered else None
            mask_a2a = None
            if rt.dense_dispatch:
                # MaxText's dropping path: one-hot [tokens, experts, capacity] masks and the
                # dispatch einsum; every expert computes its whole (padded) capacity, so all
                # local expert weights are read.
                mask = n * E * rt.capacity * a
                masks = self.vpu("moe_masks", 2 * n * E * rt.capacity, 2 * mask, [topk], layer,
                                 phase)
                mdeps = [masks]
                if gathered:
                    # The masks' expert dimension to the experts' chips (XLA's small
                    # all-to-all of the [tokens, experts, capacity] mask, once for the
                    # dispatch and once for the combine).
                    mask_a2a = self.coll("ep_mask_alltoall", "all-to-all", ("expert",),
                                         mask * lay.ep, [masks], layer, phase)
                    mdeps += [x for x in (tok, mask_a2a) if x is not None]
                pre = self.mm("moe_dispatch", dispatch_flops(n, E, rt.capacity, D), 0.0,
                              mask + ng * D * a + n * rows * D * a, mdeps, layer, phase,
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
            if gathered and not rt.dense_dispatch:
                pre = tok if tok is not None else pre
            disp = None if gathered else self.coll(
                "ep_dispatch", "all-to-all", ("expert",), n * rows * D * a * lay.ep, [pre],
                layer, phase)
            w_exp = mats * D * F / tp * wb
            h = self.mm("expert_in", 2 * n * rows * D * F * (mats - 1) / tp,
                        touched * w_exp * (mats - 1) / mats,
                        n * rows * D * a + n * rows * F * (mats - 1) / tp * a,
                        self._deps(pre, disp), layer, phase)
            act = self.vpu("expert_act", 8 * n * rows * F / tp, n * rows * F * mats / tp * a,
                           [h], layer, phase)
            o = self.mm("expert_out", 2 * n * rows * F * D / tp, touched * w_exp / mats,
                        n * rows * F / tp * a + n * rows * D * a, [act], layer, phase)
            comb = None if gathered else self.coll(
                "ep_combine", "all-to-all", ("expert",), n * rows * D * a * lay.ep, [o], layer,
                phase)
            outs = self._deps(o, comb)
            shared = None
            if m.num_shared_experts:
                sF = m.num_shared_experts * F
                shared = self.mm("shared_expert", 2 * n * D * sF * mats / tp,
                                 mats * D * sF / tp * wb, 2 * n * D * a, [dep], layer, phase)
                outs.append(shared)
            if gathered:
                return self.gathered_combine(layer, phase, n, rt, o, mask_a2a, shared)
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
        look = self.vpu("embed_lookup", 0.0, n * D * (self.wb + ACT_BYTES),
                        [dep] if dep is not None else [], -1, phase, alloc_bytes=alloc)
        # The table's vocabulary is split over `tensor`: each shard looks up the rows it holds
        # (zeros elsewhere) and the partial embeddings are summed over `tensor` (XLA's decode
        # program, tensor=8: one all-reduce of the [batch, d_model] bf16 embeddings). In 2D
        # weight-stationary each chip holds [V_YZ, D_X]: the partial [n, D_X] rows are summed
        # and split into the D_XYZ residual slices, a reduce-scatter over `tensor`.
        if lay.fs > 1:
            red = self.coll("tp_embed_reducescatter", "reduce-scatter", ("tensor",),
                            n * self.m.d_model / lay.fs * ACT_BYTES, [look], -1, phase)
        else:
            red = self.coll("tp_embed_allreduce", "all-reduce", ("tensor",),
                            n * self.m.d_model * ACT_BYTES, [look], -1, phase)
        return red if red is not None else look

    def head(self, dep: int, phase: str, free: float) -> int:
        """Final norm, logits for the last token of each sequence, and sampling."""
        m, lay, a = self.m, self.lay, ACT_BYTES
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
        tp, k = self.lay.tp, SAMPLE_TOP_K
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

    def meta(self, kind: str, plan: dict[str, float]) -> TraceMeta:
        m, cfg, lay = self.m, self.cfg, self.lay
        return TraceMeta.of(
            kind=kind,
            model=m.name,
            num_chips=self.num_chips,
            batch=cfg.batch,
            context_len=cfg.context_len,
            prompt_len=cfg.prompt_len,
            prefill_chunk=cfg.prefill_chunk,
            weight_dtype=cfg.weight_dtype,
            kv_dtype=cfg.kv_dtype,
            matmul_dtype=cfg.matmul_dtype,
            local_batch=lay.local_batch,
            # "2d-weight-stationary" when the mesh has fsdp (tpu.md §5), else "1d".
            sharding="2d-weight-stationary" if lay.fs > 1 else "1d",
            kv_batch_split=lay.kv_split,
            # Per chip (the busiest chip when the batch does not divide evenly).
            weights_bytes=plan["weights_bytes"],
            kv_cache_bytes=plan["kv_cache_bytes"],
            activation_bytes=plan["activation_bytes"],
            static_hbm_bytes=plan["weights_bytes"] + plan["kv_cache_bytes"],
            # Whole model / whole batch (tpu.md §3: KV = 2·S·L·K·H·bytes per sequence).
            weights_bytes_total=m.num_params * cfg.weight_bytes_per_param,
            kv_cache_bytes_total=cfg.batch * m.kv_cache_bytes(
                cfg.context_len if kind == "decode" else cfg.prompt_len, cfg.kv_bytes_per_elem),
            overlap=True,
            **({"moe": self.routing.summary(cfg.moe), "moe_scenario_applied": True}
               if self.routing is not None else {}),
        )

