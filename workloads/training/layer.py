"""One layer's program, forward and backward: the norms, the QKV, output and MLP (or MoE)
matmuls, rotary, dot or flash attention, activations and residuals, the tensor-parallel and
expert collectives around them, and the HBM the attention's temporaries take. The backward
splits each matmul into its input gradient (on the critical path) and its weight gradient
(which hides the collectives issued before it), as XLA schedules them; FLOP counts follow
`tpu.md` §3-§4.
"""

from __future__ import annotations

from typing import NamedTuple

from workloads.memory import (
    MemoryCategory,
    attention_backward_score_buffers,
    attention_temporaries,
    one_sequence_per_chip,
    score_exp_fused,
)
from workloads.training import xla_rules as xla
from workloads.training.moe_layer import MoeProgram
from workloads.training.program import MTP_PROJ, Q
from workloads.training.quant import RANDOM_BITS_BYTES


class MlpGrads(NamedTuple):
    """What the attention's backward reads of the MLP's (`LayerProgram.mlp_backward`)."""

    norm: int  # the MLP norm's backward: the attention sublayer's output gradient
    dmlp: int  # the MLP's input-gradient matmul
    dact: int  # the activation's backward
    dmlp_w: int  # the MLP's weight-gradient matmul
    mm_deps: list[int]  # the tensor-parallel entry of the MLP's backward (`tp_enter`)
    after: list[int]


class LayerProgram(MoeProgram):
    """The ops of one layer, forward (also as a remat recomputation) and backward."""

    def layer_forward(self, layer, deps, gather, phase="fwd", recompute=False):
        """Ops of one layer's forward; returns the id of its output."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        hd, H, K = m.head_dim, m.num_heads, m.num_kv_heads
        k_loc = max(K / tp, 1.0)
        h_loc = H / tp
        self.cur = gather
        wdeps: list[int] = []  # the matmuls wait for their own matrices' gathers (`mm` keys)
        tag = "re-" if recompute else ""
        # Under a recomputing remat policy the backward reads the recomputed activations, not
        # the layer's output: the layer's last matmul(s) (the MLP's down projection, also the
        # attention output projection of a parallel block) and what follows them (their
        # reduction over `tensor`, the residual adds) are dead code XLA removes (docs/model.md
        # "Remat"; the imported HLO programs of docs/validation.md recompute every matmul but
        # those). Projections the policy brought back from host memory are not recomputed.
        kept = self.cfg.remat_plan.kept_projections if recompute else frozenset()
        x = deps
        r = self.rows()
        if self.is_mtp_layer(layer):
            x = self.mtp_input(layer, x, phase, tag)
        # A norm reads its input twice (statistics, then the normalised rows) and writes once;
        # the forward of a scanned stack also copies the layer input into the saved stack.
        norm = self.vpu(f"{tag}norm_attn", 5 * r * D,
                        (3 + (2 if not recompute else 0)) * r * D * a, x, layer, phase)
        mm_deps, after = self.tp_enter(tag, "attn", norm, layer, phase)
        qkv_w = D * (H + 2 * K) * hd / tp
        if m.is_mla:
            # q, k, v came back from host memory (a dependency of the layer input), or MLA's
            # low-rank projections write them.
            qkv_ids = [norm] if "qkv" in kept else \
                self.mla_projections(layer, norm, wdeps + mm_deps, phase, tag)
            # Rotary on each query head's qk_rope_head_dim and on the one shared rotary key.
            rd = m.qk_rope_head_dim
            rope = self.vpu(f"{tag}rotary", 6 * n * (h_loc + 1) * rd,
                            2 * n * (h_loc + 1) * rd * a, qkv_ids + after, layer, phase)
        else:
            if "qkv" in kept:
                qkv = norm  # q, k, v came back from host memory (a dependency of the input)
            else:
                qkv = self.mm(f"{tag}qkv_proj", 2 * n * D * (h_loc + 2 * k_loc) * hd,
                              qkv_w * self.wc, n * D * a, n * (h_loc + 2 * k_loc) * hd * a,
                              [norm] + wdeps + mm_deps, layer, phase, keys=("wq", "wk", "wv"),
                              acc_bytes=n * (h_loc + 2 * k_loc) * hd * a,
                              q=Q(act=n * D, weight=qkv_w, out=n * (h_loc + 2 * k_loc) * hd,
                                  k=D))
            if m.qk_norm:
                # RMSNorm over head_dim of every query and key head (Gemma 3): a norm fusion of
                # its own, as the pre-norms are (reads twice, writes once).
                qkv = self.vpu(f"{tag}qk_norm", 5 * n * (h_loc + k_loc) * hd,
                               3 * n * (h_loc + k_loc) * hd * a, [qkv], layer, phase)
            rope = self.vpu(f"{tag}rotary", 6 * n * (h_loc + k_loc) * hd,
                            2 * n * (h_loc + k_loc) * hd * a, [qkv] + after, layer, phase)
        if "context" in kept and self.cfg.attention == "flash":
            # The attention output was kept: nothing of the attention is rerun (the flash
            # backward kernel recomputes its scores itself, layer_backward).
            att = rope
        else:
            # A kept attention output spares a dot attention's value matmul only: the
            # backward still reads the probabilities, rebuilt from q and k.
            att = self.attention_forward(layer, rope, phase, tag,
                                         values="context" not in kept)
        if m.parallel_block:
            if recompute:
                # Both branches' last matmuls feed only the (dead) layer output.
                mlp_live = self.mlp_forward(layer, norm, wdeps, phase, tag, after, dead_tail=True)
                self.recompute_leaves.append(att)
                return mlp_live
            out = self.out_proj(layer, att, wdeps, phase, tag)
            mlp_out = self.mlp_forward(layer, norm, wdeps, phase, tag, after)
            summed = self.vpu(f"{tag}block_sum", n * D, 3 * n * D * a, [out, mlp_out], layer,
                              phase)
            exit_deps = self.tp_exit(tag, "block", summed, [out, mlp_out], layer, phase)
            return self.vpu(f"{tag}residual", r * D, 3 * r * D * a, exit_deps + list(x), layer,
                            phase)
        if "out" in kept:
            # The projection's output came back from host memory: the residual needs only it;
            # the recomputed attention output is read by the backward (its weight gradient).
            self.recompute_leaves.append(att)
            exit1 = []
        else:
            out = self.out_proj(layer, att, wdeps, phase, tag)
            exit1 = self.tp_exit(tag, "attn", out, [out], layer, phase)
        if m.post_norms:
            # The sublayer's output is normed before the residual add (Gemma 2 / 3).
            exit1 = [self.vpu(f"{tag}post_norm_attn", 5 * r * D, 3 * r * D * a,
                              exit1 or list(x), layer, phase)]
        res1 = self.vpu(f"{tag}residual_attn", r * D, 3 * r * D * a, exit1 + list(x), layer,
                        phase)
        norm2 = self.vpu(f"{tag}norm_mlp", 5 * r * D, 3 * r * D * a, [res1], layer, phase)
        mm_deps2, after2 = self.tp_enter(tag, "mlp", norm2, layer, phase)
        if recompute:
            return self.mlp_forward(layer, norm2, wdeps + mm_deps2, phase, tag, after2,
                                    dead_tail=True, kept_in="mlp_in" in kept)
        mlp_out = self.mlp_forward(layer, norm2, wdeps + mm_deps2, phase, tag, after2)
        exit2 = self.tp_exit(tag, "mlp", mlp_out, [mlp_out], layer, phase)
        if m.post_norms:
            exit2 = [self.vpu(f"{tag}post_norm_mlp", 5 * r * D, 3 * r * D * a, exit2, layer,
                              phase)]
        return self.vpu(f"{tag}residual_mlp", r * D, 3 * r * D * a, exit2 + [res1], layer,
                        phase)

    def out_proj(self, layer, att, wdeps, phase, tag):
        """The attention's output projection (heads x value head dim -> d_model)."""
        m, d, a = self.m, self.d, self.act
        n, D, tp, hd, H = d.n, m.d_model, d.tp, m.head_dim, m.num_heads
        h_loc = H / tp
        if m.is_mla:
            hd = m.value_head_dim
        return self.mm(f"{tag}out_proj", 2 * n * h_loc * hd * D, H * hd * D / tp * self.wc,
                       n * h_loc * hd * a, n * D * a, [att] + wdeps, layer, phase,
                       keys=("wo",), whole_bytes=n * h_loc * hd * a,
                       q=Q(act=n * h_loc * hd, weight=H * hd * D / tp, out=n * D,
                           k=h_loc * hd))

    def mla_projections(self, layer, norm, deps, phase, tag) -> list[int]:
        """MLA's query, key and value projections (DeepSeek-V2 §2.1, the training form: every
        head's key and value are up-projected from the latent): the query down projection,
        its latent's RMSNorm and up projection (or one full-rank query projection without
        q_lora_rank); the down projection to the key-value latent and the shared rotary key,
        the latent's RMSNorm and its up projection to every head's key (without rotary) and
        value. The down projections are whole on every tensor shard (`MLA_WHOLE_OVER_TENSOR`),
        the rest is split over heads. Returns the ops the rotary waits for (q and kv)."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        H, hd, v = m.num_heads, m.head_dim, m.value_head_dim
        h_loc = H / tp
        kl, rd, ql = m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank
        wc = self.wc
        first = [norm] + list(deps)
        if ql is not None:
            qa = self.mm(f"{tag}q_down", 2 * n * D * ql, D * ql * wc, n * D * a, n * ql * a,
                         first, layer, phase, keys=("wq_a",), acc_bytes=n * ql * a,
                         q=Q(act=n * D, weight=D * ql, out=n * ql, k=D))
            qn = self.vpu(f"{tag}q_norm", 5 * n * ql, 3 * n * ql * a, [qa], layer, phase)
            q = self.mm(f"{tag}q_up", 2 * n * ql * h_loc * hd, ql * H * hd / tp * wc,
                        n * ql * a, n * h_loc * hd * a, [qn], layer, phase, keys=("wq_b",),
                        whole_bytes=n * ql * a,
                        q=Q(act=n * ql, weight=ql * H * hd / tp, out=n * h_loc * hd, k=ql))
        else:
            q = self.mm(f"{tag}q_proj", 2 * n * D * h_loc * hd, D * H * hd / tp * wc, n * D * a,
                        n * h_loc * hd * a, first, layer, phase, keys=("wq",),
                        acc_bytes=n * h_loc * hd * a,
                        q=Q(act=n * D, weight=D * H * hd / tp, out=n * h_loc * hd, k=D))
        kva = self.mm(f"{tag}kv_down", 2 * n * D * (kl + rd), D * (kl + rd) * wc, n * D * a,
                      n * (kl + rd) * a, first, layer, phase, keys=("wkv_a",),
                      acc_bytes=n * (kl + rd) * a,
                      q=Q(act=n * D, weight=D * (kl + rd), out=n * (kl + rd), k=D))
        kvn = self.vpu(f"{tag}kv_norm", 5 * n * kl, 3 * n * kl * a, [kva], layer, phase)
        up = hd - rd + v  # a head's key without rotary, and its value
        kv = self.mm(f"{tag}kv_up", 2 * n * kl * h_loc * up, kl * H * up / tp * wc, n * kl * a,
                     n * h_loc * up * a, [kvn], layer, phase, keys=("wkv_b",),
                     whole_bytes=n * kl * a,
                     q=Q(act=n * kl, weight=kl * H * up / tp, out=n * h_loc * up, k=kl))
        return [q, kv]

    def mtp_input(self, layer, x, phase, tag) -> list[int]:
        """An MTP module's input (DeepSeek-V3 §2.2): the embedding of the tokens one further
        ahead (a lookup of the main model's table), RMSNorm of it and of the hidden state,
        and the projection of their concatenation (2 d_model -> d_model, `mtp_proj`, split
        over `tensor` on its output and all-gathered back). Returns what the layer's norm
        waits for."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        r = self.rows()
        emb = self.vpu(f"{tag}mtp_embed_lookup", 0.0, 2 * r * D * a, list(x), layer, phase)
        norms = self.vpu(f"{tag}mtp_norms", 10 * r * D, 6 * r * D * a, [emb] + list(x), layer,
                         phase)
        proj = self.mm(f"{tag}{MTP_PROJ}", 2 * n * 2 * D * D / tp, 2 * D * D / tp * self.wc,
                       2 * n * D * a, n * D / tp * a, [norms], layer, phase, keys=(MTP_PROJ,),
                       q=Q(act=2 * n * D, weight=2 * D * D / tp, out=n * D / tp, k=2 * D))
        ag = self.coll(f"{tag}tp_allgather_mtp", "all-gather", ("tensor",), n * D * a, [proj],
                       layer, phase)
        return [proj] + ([ag] if ag is not None else [])

    def mtp_backward(self, layer, dep) -> int:
        """The backward of an MTP module's input (`mtp_input`): the projection's input and
        weight gradients and the two norms'."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        r = self.rows()
        w = 2 * D * D / tp * self.wc
        ag = self.coll("tp_reducescatter_mtp_bwd", "reduce-scatter", ("tensor",), n * D * a,
                       [dep], layer, "bwd")
        dx = self.mm(f"{MTP_PROJ}_bwd", 2 * n * 2 * D * D / tp, w, n * D / tp * a + 2 * n * D * a,
                     2 * n * D * a, [dep] + ([ag] if ag is not None else []), layer, "bwd",
                     keys=(MTP_PROJ,),
                     q=Q(sr=n * D / tp, weight=2 * D * D / tp, out=2 * n * D, k=D / tp))
        dw = self.mm(f"{MTP_PROJ}_bwd_weights", 2 * n * 2 * D * D / tp, w,
                     n * D / tp * a + 2 * n * D * a, 0.0, [dx], layer, "bwd", keys=(MTP_PROJ,),
                     q=Q(act=2 * n * D, sr=n * D / tp, out=2 * D * D / tp, k=n))
        return self.vpu("mtp_norms_bwd", 20 * r * D, 8 * r * D * a, [dx, dw], layer, "bwd")

    def attention_forward(self, layer, dep, phase, tag, values=True):
        m, d, a = self.m, self.d, self.act
        n, tp, hd = d.n, d.tp, m.head_dim
        h_loc = m.num_heads / tp
        k_loc = max(m.num_kv_heads / tp, 1.0)
        ctx = d.ctx
        hv = m.value_head_dim  # MLA's value heads may be narrower than its query/key heads
        deps = [dep]
        if d.sp > 1:  # sequence parallelism: gather the other shards' keys and values
            kv = self.coll(f"{tag}sp_kv_allgather", "all-gather", ("sequence",),
                           ctx * (n / (ctx / d.sp)) * k_loc * (hd + hv) * a if m.is_mla else
                           2 * ctx * (n / (ctx / d.sp)) * k_loc * hd * a, [dep], layer, phase)
            deps.append(kv)
        s_loc = n * d.sp / ctx  # local sequences (each attends to its whole context)
        kv_bytes = s_loc * ctx * k_loc * hd * a  # K (or V) of every local sequence
        v_bytes = s_loc * ctx * k_loc * hv * a if m.is_mla else kv_bytes
        if self.cfg.attention == "flash":
            # Flash attention skips fully masked blocks (about half under a causal mask; all
            # but the window's or the chunk's in a local layer) and keeps the score matrix in
            # VMEM: HBM sees only Q, K, V and the output.
            if m.is_mla:
                flops = 2 * n * h_loc * (hd + hv) * m.attended_keys_per_query(ctx, layer)
                nbytes = n * h_loc * (hd + hv) * a + kv_bytes + v_bytes
            else:
                flops = 4 * n * h_loc * hd * m.attended_keys_per_query(ctx, layer)
                nbytes = 2 * n * h_loc * hd * a + 2 * kv_bytes
            return self.mm(f"{tag}flash_attention", flops, 0.0, nbytes, 0.0, deps, layer, phase,
                           narrow_dim=hd, q=Q("attention", act=n * h_loc * hd + 2 * kv_bytes / a,
                                              out=n * h_loc * hd, k=hd))
        # Dot attention materialises every score and masks it afterwards (MaxText's
        # dot-product path: a full q.K^T, then the causal and sliding-window or chunk masks),
        # so a local layer costs what a global one does.
        scores = n * ctx * h_loc
        # Both attention matmuls tile head_dim: q.K^T contracts over it, P.V outputs it, so a
        # head_dim below the MXU width leaves part of the array idle (ChipSpec.mxu_fill).
        qk = self.mm(f"{tag}attn_scores", 2 * n * ctx * h_loc * hd, 0.0,
                     n * h_loc * hd * a + kv_bytes, scores * 4, deps, layer, phase,
                     narrow_dim=hd, q=Q("attention", act=n * h_loc * hd + kv_bytes / a,
                                        out=scores, k=hd))
        sm = self.vpu(f"{tag}softmax", 5 * scores, scores * 4 + scores * a, [qk], layer, phase)
        if not values:
            # A recomputation whose attention output was kept (`context`): the backward reads
            # the recomputed probabilities, not a recomputed output.
            self.mem(qk, MemoryCategory.TEMPORARIES, scores * a)
            self.mem(sm, MemoryCategory.TEMPORARIES, -scores * a)
            return sm
        av = self.mm(f"{tag}attn_values", 2 * n * ctx * h_loc * hv, 0.0,
                     scores * a + v_bytes, n * h_loc * hv * a, [sm], layer, phase,
                     narrow_dim=hv, q=Q("attention", act=scores + v_bytes / a,
                                        out=n * h_loc * hv, k=ctx))
        # The f32 scores (the softmax runs in place over them) and the probabilities the
        # value matmul reads are live together (workloads/memory.py): bf16, or f32 in the
        # forward of a policy that saves named/dot residuals (minimal, offload), where XLA
        # fuses the normalisation into the value matmul, and in a fused forward under full
        # (the value matmul reads the exponentials: nothing saves the probabilities); kept
        # probabilities are counted as saved from the softmax on.
        fused = score_exp_fused(
            chip_fuses=self.cfg.score_exp_fusion,
            sharded_axes=sum(1 for s in (d.dp, d.fs, d.tp, d.ep, d.pp, d.sp) if s > 1),
            score_bytes=4.0 * scores, remat=self.cfg.remat_plan.rule,
            plain_fsdp=bool(self.cur is not None and self.cur.ops
                            and not self.cur.windowed(self.cur.ops)))
        # With one sequence per chip XLA keeps the score matmul's bf16 output and the value
        # matmul's fusion exponentiates it as it reads it: the only score-sized buffer of the
        # forward (workloads/memory.py one_sequence_per_chip).
        bf16_scores = one_sequence_per_chip(sequences_per_chip=s_loc)
        f32_probs = tag == "" and not bf16_scores and (
            self.cfg.remat_plan.rule in ("minimal", "offload")
            or (self.cfg.remat_plan.rule == "full" and fused))
        probs_bytes = 4.0 if f32_probs else a
        temps = attention_temporaries(rows=n, context=ctx, local_heads=h_loc,
                                      probs_bytes=probs_bytes, score_exp_fusion=fused,
                                      bf16_scores=bf16_scores)
        if tag == "re-":
            # A recomputing backward writes the scores in bf16 from the q.K^T matmul (the dP
            # matmul's fusion rebuilds the exponentials from them): no f32 score buffer in the
            # backward of any program of benchmarks/xla_memory.py. They stand for the kept
            # probabilities, counted as recomputed from the softmax on.
            temps = scores * a
        saved = tag == "re-" or self.cfg.remat_plan.rule == "none"  # the probabilities kept
        # Unsaved probabilities live from the softmax to the value matmul; bf16 scores stand
        # for them (the value matmul reads the scores).
        probs = scores * probs_bytes
        if tag == "re-" and self.cfg.bwd_probs_buffer and self.cfg.remat_plan.rule == "full":
            # v5p's full backward writes the bf16 probabilities next to the recomputed scores,
            # read by the value-gradient matmul (freed in layer_backward; memory.py
            # attention_backward_score_buffers).
            self.bwd_probs_bytes = scores * a
            self.mem(sm, MemoryCategory.TEMPORARIES, self.bwd_probs_bytes)
        self.mem(qk, MemoryCategory.TEMPORARIES, temps)
        self.mem(sm, MemoryCategory.TEMPORARIES, -temps + (0.0 if saved else probs))
        self.mem(av, MemoryCategory.TEMPORARIES, 0.0 if saved else -probs)
        return av

    def mlp_forward(self, layer, dep, wdeps, phase, tag, after=(), dead_tail=False,
                    kept_in=False):
        """The MLP (or MoE) sublayer's forward; returns its output op. `dead_tail`: a
        recomputation whose output only the backward reads, so the ops after the last live
        one are left out (a dense MLP's down projection; an MoE layer's weighted combine of
        the experts' outputs, whose inputs the router's gradient still reads)."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        mats = m.mlp.num_matrices
        if self.layer_is_moe(layer):
            return self.moe_forward(layer, dep, wdeps, phase, tag, after, dead_tail,
                                    kept_in)
        F = m.d_ff
        # A recomputation whose MLP input projections were kept (`mlpwi`) reruns only the
        # activation (the MLP norm before it is rerun for the projections' weight gradients).
        h = dep if kept_in else self.mm(
            f"{tag}mlp_in", 2 * n * D * F * (mats - 1) / tp,
            (mats - 1) * D * F / tp * self.wc, n * D * a, n * F * (mats - 1) / tp * a,
            [dep] + wdeps, layer, phase, keys=("w_gate", "w_up"),
            acc_bytes=n * F * (mats - 1) / tp * a,
            q=Q(act=n * D, weight=(mats - 1) * D * F / tp, out=n * F * (mats - 1) / tp, k=D))
        act = self.vpu(f"{tag}mlp_act", 8 * n * F / tp,
                       n * F * (mats - 1) / tp * a + n * F / tp * a, [h, *after], layer, phase)
        if dead_tail:
            return act
        return self.mm(f"{tag}mlp_out", 2 * n * F * D / tp, D * F / tp * self.wc, n * F / tp * a,
                       n * D * a, [act] + wdeps, layer, phase, keys=("w_down",),
                       whole_bytes=n * F / tp * a,
                       q=Q(act=n * F / tp, weight=D * F / tp, out=n * D, k=F / tp))

    def sr_bits_held(self, layer, F, mats) -> dict[str, float]:
        """Bytes of stochastic rounding's random bits a layer's backward holds from its start
        (`quant.SR_HELD_RULE`): the weight gradients' output-gradient noise of the MLP and of
        the attention, and the q, k, v input gradients' (none without stochastic rounding,
        nor where XLA generates each right before its quantization: blocking gathers)."""
        if not self.cfg.stochastic_rounding or not xla.sr_bits_early(self.cfg):
            return {}
        m, d = self.m, self.d
        n, D, tp, hd = d.n, m.d_model, d.tp, m.head_dim
        h_loc, k_loc = m.num_heads / tp, max(m.num_kv_heads / tp, 1.0)
        bits = RANDOM_BITS_BYTES
        return {"mlp_weights": bits * (n * F * (mats - 1) / tp + n * D),
                "attn_weights": bits * (n * (h_loc + 2 * k_loc) * hd + n * D),
                "qkv_inputs": bits * n * (h_loc + 2 * k_loc) * hd}

    def layer_backward(self, layer, deps, gather, grad=None):
        """Backward of one layer: dX and dW matmuls (2x forward), elementwise grads, TP
        all-reduces of the input gradients. Returns the op of the layer input's gradient."""
        self.cur = gather
        return self.attention_backward(layer, self.mlp_backward(layer, deps, grad))

    def mlp_backward(self, layer, deps, grad) -> MlpGrads:
        """The MLP (or MoE) sublayer's backward, through the MLP norm's backward."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        mats = m.mlp.num_matrices
        wd: list[int] = []  # the matmuls wait for their own matrices' gathers (`mm` keys)
        mkeys = self.mlp_keys(layer)
        rt = self.routing
        moe = self.layer_is_moe(layer)
        if moe:
            F = m.expert_d_ff * rt.expert_rows_per_token
            w_mlp = (m.num_experts / d.ep) * mats * D * m.expert_d_ff / tp * self.wc
            if m.num_shared_experts:
                # The shared experts' backward runs with the routed experts' (every token).
                F += m.num_shared_experts * m.expert_d_ff
                w_mlp += m.num_shared_experts * mats * D * m.expert_d_ff / tp * self.wc
        else:
            F = m.d_ff
            w_mlp = mats * D * F / tp * self.wc
        fwd_mlp = 2 * n * D * F * mats / tp
        if m.post_norms and not m.parallel_block:
            # The gradient enters each sublayer through its post-norm's backward.
            r = self.rows()
            post = self.vpu("post_norm_mlp_bwd", 10 * r * D, 4 * r * D * a,
                            [grad] if grad is not None else list(deps), layer, "bwd")
            grad = post
            deps = list(deps) + [post]
        cb = None
        if moe:
            deps, cb = self.moe_output_backward(layer, deps, grad)
        r = self.rows()
        first = deps[-1]
        # The incoming gradient is gathered over `tensor` as soon as it exists (alongside the
        # recomputation, which does not need it); an MoE layer's comes out of the combine.
        mm_deps, after = self.tp_enter("", "mlp_bwd", grad if grad is not None and not moe
                                       else first, layer, "bwd")
        # The backward matmuls are split as XLA schedules them: the input gradients (dX) are on
        # the critical path; the weight gradients (dW) only feed the gradient reduction, so
        # they run after the input gradient's collective is issued and hide it (a
        # tensor-parallel reduction, the MoE dispatch all-to-all).
        # Windowed, the gate and up projections' input gradients read the gradients of their
        # outputs whole on every ring step; the down projection's contracts the sharded d_model
        # and sums its [tokens, d_ff] output over the steps.
        dmlp = self.mm("mlp_bwd", fwd_mlp, w_mlp, 1.5 * n * F * mats / tp * a, n * D * a,
                       list(deps) + wd + mm_deps, layer, "bwd", keys=mkeys,
                       whole_bytes={k: n * F / tp * a for k in mkeys
                                    if k.endswith(("_gate", "_up"))},
                       acc_bytes={k: n * F / tp * a for k in mkeys if k.endswith("_down")},
                       q=Q(sr=n * F * (mats - 1) / tp + n * D, weight=w_mlp / self.wc,
                           out=n * D + n * F / tp, k=F / tp))
        # int8 with stochastic rounding: the random bits of the layer's weight-gradient
        # quantizations (every matrix's output gradient) and of the q, k, v input gradients'
        # are generated as the layer's backward starts (with async gathers) and live until
        # their quantizations (`sr_bits_held`).
        held = self.sr_bits_held(layer, F, mats) if self.quantizes("weight") else {}
        if held:
            self.mem(self.last_quant, MemoryCategory.TEMPORARIES, sum(held.values()))
        self._sr_held = held
        # Reads the gate/up projections and the product's gradient, writes their gradients.
        dact = self.vpu("mlp_act_bwd", 16 * n * F / tp, (2 * (mats - 1) + 1) * n * F / tp * a,
                        [dmlp, *after], layer,
                        "bwd")
        ar1 = None
        if moe and not self.moe_gathered:
            # Transpose of the forward's dispatch all-to-all, after the experts' backward. XLA's
            # all-to-alls are synchronous by default (benchmarks/xla_moe_schedule.py): the
            # weight gradients wait for it rather than hiding it. With libtpu's async
            # all-to-all (`--ep-alltoall async`) they start/done around independent work.
            ar1 = self.coll("ep_dispatch_bwd", "all-to-all", ("expert",),
                            n * rt.expert_rows_per_token * D * a * d.ep, [dact], layer, "bwd")
        sync = self.cfg.ep_alltoall == "sync"
        # A windowed reduce-scatter's ring steps each compute one d_model shard of the gradient:
        # they read the [tokens, d_ff] operands whole (the gate and up outputs' gradients, the
        # down projection's input) and the d_model ones a slice at a time.
        dmlp_w = self.mm("mlp_bwd_weights", fwd_mlp, w_mlp, 1.5 * n * F * mats / tp * a, 0.0,
                         [dact] + ([ar1] if ar1 is not None and sync else []), layer, "bwd",
                         keys=mkeys, whole_bytes={k: n * F / tp * a for k in mkeys
                                                  if k != "router"},
                         q=Q(act=n * D + n * F / tp, sr=n * F * (mats - 1) / tp + n * D,
                             out=w_mlp / self.wc, k=n))
        self.mlp_weights_done = self.last_matmul  # the MLP matrices' last reader
        if not self.mlp_grads_last:
            self.mem(self.last_matmul, MemoryCategory.TEMPORARIES,
                     -self._sr_held.pop("mlp_weights", 0.0))
        dcomb_deps: list[int] = []
        if moe:
            ar1, dcomb_deps = self.moe_router_backward(layer, dmlp_w, dact, cb, ar1, sync)
        if m.parallel_block:
            # Both branches read the same normed input: their input gradients are summed and
            # reduced over `tensor` once, after the attention branch.
            mlp_exit = [dact]
        else:
            mlp_exit = self.tp_exit("", "mlp_bwd", dact, [dmlp], layer, "bwd")
        nrm = self.vpu("norm_mlp_bwd", 10 * r * D, 4 * r * D * a,
                       mlp_exit + [x for x in (ar1,) if x is not None] + dcomb_deps, layer,
                       "bwd")
        return MlpGrads(norm=nrm, dmlp=dmlp, dact=dact, dmlp_w=dmlp_w, mm_deps=mm_deps,
                        after=after)

    def attention_backward(self, layer, mlp: MlpGrads):
        """The attention sublayer's backward, from the MLP norm's backward to the attention
        norm's (the layer input's gradient)."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        hd = m.head_dim
        h_loc = m.num_heads / tp
        k_loc = max(m.num_kv_heads / tp, 1.0)
        wd: list[int] = []  # the matmuls wait for their own matrices' gathers (`mm` keys)
        r = self.rows()
        nrm, dmlp, dact, dmlp_w = mlp.norm, mlp.dmlp, mlp.dact, mlp.dmlp_w
        mm_deps, after = mlp.mm_deps, mlp.after
        keys = m.attended_keys_per_query(d.ctx, layer) if self.cfg.attention == "flash" \
            else d.ctx  # dot attention computes every score (attention_forward)
        att_fwd_flops = 4 * n * h_loc * hd * keys
        att_factor = 2.5 if self.cfg.attention == "flash" else 2.0  # flash recomputes scores
        w_att = m.attention_params_per_layer / tp * self.wc
        proj_flops = 2 * n * D * (2 * h_loc + 2 * k_loc) * hd
        # The projections' operands, their windowed-ring parts and the attention's K and V.
        proj_in = 1.5 * n * (h_loc + 2 * k_loc) * hd * a
        whole = {"wq": n * h_loc * hd * a, "wk": n * k_loc * hd * a, "wv": n * k_loc * hd * a}
        acc = {"wo": n * h_loc * hd * a}
        whole_w = n * (2 * h_loc + 2 * k_loc) * hd * a
        kv_bytes = n * d.sp / d.ctx * d.ctx * k_loc * hd * a  # K or V of the local sequences
        kv2 = 2 * kv_bytes
        # What an int8 backward quantizes (`Q`): the input gradient's and the weight gradient's.
        q_dproj = Q(sr=n * (h_loc + 2 * k_loc) * hd + n * D, weight=w_att / self.wc,
                    out=n * D + n * h_loc * hd, k=D)
        q_dproj_w = Q(act=n * D + n * h_loc * hd, sr=n * (h_loc + 2 * k_loc) * hd + n * D,
                      out=w_att / self.wc, k=n)
        if m.is_mla:
            # MLA (`mla_projections`): every weight is read once per token, so the
            # projections' FLOPs are twice the parameters a tensor shard holds per row.
            hv, rd = m.value_head_dim, m.qk_rope_head_dim
            kl, ql = m.kv_lora_rank, m.q_lora_rank or 0
            up = hd - rd + hv
            shard = sum(p for _, p in self.mla_shard_params())
            att_fwd_flops = 2 * n * h_loc * (hd + hv) * keys
            w_att = shard * self.wc
            proj_flops = 2 * n * shard
            latents = ql + kl + rd
            proj_in = 1.5 * n * (h_loc * hd + h_loc * up + latents) * a
            whole = {"wq_b": n * h_loc * hd * a, "wq": n * h_loc * hd * a,
                     "wkv_b": n * h_loc * up * a, "wq_a": n * ql * a, "wkv_a": n * (kl + rd) * a}
            acc = {"wo": n * h_loc * hv * a}
            whole_w = n * (h_loc * hd + h_loc * up + latents + h_loc * hv) * a
            kv2 = kv_bytes + n * d.sp / d.ctx * d.ctx * k_loc * hv * a
            outs = h_loc * hd + h_loc * up + latents  # the projections' outputs per row
            q_dproj = Q(sr=n * outs + n * D, weight=shard, out=n * D + n * h_loc * hv, k=D)
            q_dproj_w = Q(act=n * D + n * h_loc * hv + n * (ql + kl), sr=n * outs + n * D,
                          out=shard, k=n)
        if m.parallel_block:
            mm_deps2, after2 = mm_deps, after
        else:
            if m.post_norms:
                nrm = self.vpu("post_norm_attn_bwd", 10 * r * D, 4 * r * D * a, [nrm], layer,
                               "bwd")
            mm_deps2, after2 = self.tp_enter("", "attn_bwd", nrm, layer, "bwd")
        # Windowed: the q, k, v input gradients read the projections' output gradients whole
        # on every ring step; the output projection's contracts the sharded d_model and sums
        # its output (the attention output's gradient) over the steps.
        dproj = self.mm("attn_proj_bwd", proj_flops, w_att, proj_in, n * D * a,
                        [nrm] + wd + mm_deps2, layer, "bwd",
                        keys=self.attn_keys() + self.regather_keys(layer),
                        whole_bytes=whole, acc_bytes=acc, q=q_dproj)
        self.attn_early_grads_done = dproj
        self.mem(dproj, MemoryCategory.TEMPORARIES, -self._sr_held.get("qkv_inputs", 0.0))
        # Q and O (MLA: their widths differ), as the attention's backward reads and writes them.
        qo = n * h_loc * (hd + m.value_head_dim) * a if m.is_mla else 2 * n * h_loc * hd * a
        datt, datt_m = self.scores_backward(layer, [dproj, *after2], dproj, qo=qo, kv2=kv2,
                                            kv_bytes=kv_bytes,
                                            fwd_flops=att_factor * att_fwd_flops)
        if m.is_mla:
            rd = m.qk_rope_head_dim
            rope = self.vpu("rotary_bwd", 6 * n * (h_loc + 1) * rd,
                            2 * n * (h_loc + 1) * rd * a, [datt], layer, "bwd")
            lat = m.kv_lora_rank + (m.q_lora_rank or 0)
            rope = self.vpu("mla_norm_bwd", 10 * n * lat, 4 * n * lat * a, [rope], layer, "bwd")
        else:
            rope = self.vpu("rotary_bwd", 6 * n * (h_loc + k_loc) * hd,
                            2 * n * (h_loc + k_loc) * hd * a, [datt], layer, "bwd")
        if m.qk_norm:
            rope = self.vpu("qk_norm_bwd", 10 * n * (h_loc + k_loc) * hd,
                            4 * n * (h_loc + k_loc) * hd * a, [rope], layer, "bwd")
        last = [datt_m if self.cfg.attention != "flash" else datt]
        att_exit = self.tp_exit("", "block_bwd" if m.parallel_block else "attn_bwd", rope,
                                last + ([dmlp] if m.parallel_block else []), layer, "bwd")
        # Windowed: the q, k, v output gradients and the attention output (o's input) are read
        # whole on every ring step; the layer input and o's output gradient a slice at a time.
        dproj_w = self.mm("attn_proj_bwd_weights", proj_flops, w_att,
                          proj_in, 0.0, [rope], layer, "bwd",
                          keys=self.attn_keys(), whole_bytes=whole_w, q=q_dproj_w)
        self.attn_weights_done = dproj_w
        # The MLP's weight-gradient bits too where XLA runs those gradients last.
        self.mem(self.last_matmul, MemoryCategory.TEMPORARIES,
                 -self._sr_held.get("attn_weights", 0.0) - self._sr_held.get("mlp_weights", 0.0))
        out = self.vpu("norm_attn_bwd", 10 * r * D, 4 * r * D * a,
                       att_exit + [dact, dmlp_w, dproj_w], layer, "bwd")
        return self.mtp_backward(layer, out) if self.is_mtp_layer(layer) else out


    def scores_backward(self, layer, deps: list, dproj, *, qo: float, kv2: float,
                        kv_bytes: float, fwd_flops: float):
        """The attention's own backward (flash, or dot with its softmax and the score-sized
        buffers' HBM events) after `deps`, with `fwd_flops` its matmuls' FLOPs: (the op the
        rotary backward waits for, dot attention's matmul or None)."""
        m, d, a = self.m, self.d, self.act
        n, hd = d.n, m.head_dim
        h_loc = m.num_heads / d.tp
        hv = m.value_head_dim
        datt_m = None
        if self.cfg.attention == "flash":
            # Reads Q, O, dO and K, V; writes dQ, dK, dV.
            datt = self.mm("flash_attention_bwd", fwd_flops, 0.0,
                           2 * qo + 2 * kv2, 0.0, deps, layer,
                           "bwd", narrow_dim=hd,
                           q=Q("attention", act=qo / a + kv2 / a, sr=n * h_loc * hv,
                               out=n * h_loc * hd + kv2 / a, k=hd) if m.is_mla else
                           Q("attention", act=2 * n * h_loc * hd + 2 * kv_bytes / a,
                             sr=n * h_loc * hd, out=n * h_loc * hd + 2 * kv_bytes / a, k=hd))
        else:
            scores = n * d.ctx * h_loc
            datt_m = self.mm("attn_bwd", fwd_flops, 0.0,
                             3 * scores * a + kv2,
                             qo + kv2, deps, layer,
                             "bwd", narrow_dim=hd,
                             q=Q("attention", act=scores + qo / a + kv2 / a,
                                 sr=n * h_loc * hv + scores,
                                 out=n * h_loc * hd + kv2 / a + scores, k=hd) if m.is_mla else
                             Q("attention", act=scores + n * h_loc * hd + 2 * kv_bytes / a,
                               sr=n * h_loc * hd + scores,
                               out=n * h_loc * hd + 2 * kv_bytes / a + scores, k=hd))
            datt = self.vpu("softmax_bwd", 6 * scores, 3 * scores * a, [datt_m], layer, "bwd")
            # The bf16 score-sized buffers live at the score gradient, from the probability
            # gradient's matmul until the dQ and dK matmuls have read the score gradient; one
            # of them (the probabilities, or the recomputed scores they stand for) is already
            # counted as saved or recomputed.
            extra = (attention_backward_score_buffers(
                remat=self.cfg.remat_plan.rule, score_grad_fusion=self.cfg.score_grad_fusion,
                bwd_probs_buffer=self.cfg.bwd_probs_buffer,
                int8=self.quantizes("weight")) - 1) * scores * a
            self.mem(dproj, MemoryCategory.TEMPORARIES, extra - self.bwd_probs_bytes)
            self.mem(datt, MemoryCategory.TEMPORARIES, -extra)
            self.bwd_probs_bytes = 0.0
        return datt, datt_m
