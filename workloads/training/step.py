"""The whole training step's program, microbatch by microbatch: the embedding lookup, the
layers' forward (with FSDP weight gathers prefetched a layer ahead and activations offloaded),
the output projection and the loss, the layers' backward in reverse (with the remat policy's
recomputation and the gradient reductions), the embedding's gradient, and the optimizer
update on the local parameter shard; pipeline stages and gradient accumulation are expressed
in the same ops. The trace's metadata records the step's sizes and HBM events.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.memory import (
    MemoryCategory,
    deferred_head_gradient_bytes,
    loss_tensors,
    loss_value_logits_bytes,
    one_sequence_per_chip,
    windowed_head_gradient_bytes,
)
from workloads.trace import OpKind, Trace, Unit
from workloads.trace_meta import TraceKind, TraceMeta
from workloads.training import xla_rules as xla
from workloads.training.gradients import GradientReductions, StepState
from workloads.training.hbm import HbmModel
from workloads.training.layer import LayerProgram
from workloads.training.program import WEIGHT_CAST, Gathered, Q

G = MemoryCategory
# The embedding lookup's all-to-all runs over the table's d_model shards (fsdp, and expert in
# an MoE mesh), each chip sending its [tokens, d_model / shards]-sized pieces (XLA: 16 MiB per
# chip for 2048 tokens of d_model 4096, with or without a tensor axis).
A2A_AXES = ("fsdp", "expert")


@dataclass(slots=True)
class Forward:
    """What a microbatch's forward hands its loss and backward."""

    start: list[int]  # what the microbatch's first ops wait for
    emb_g: int | None  # the embedding table's (output projection's) gather
    stack: float  # the stacked saved activations of every layer
    prev: int  # the forward's last op


@dataclass(slots=True)
class Head:
    """What the output projection and the loss hand the layers' backward."""

    final_norm: int
    prev: int  # the output gradient entering the last layer's backward
    held: float  # logits-path bytes live through the backward loop
    head_accum: int | None  # the output projection's windowed-ring accumulators
    head_grad_extra: float = 0.0  # f32 head-gradient bytes held until its reduction


@dataclass(slots=True)
class BackwardLoop:
    """The backward loop's state carried from one layer to the next (the one below)."""

    fetch_after: list[int]  # what the next fetch of offloaded activations waits for
    fetch_alloc_at: int  # the op at whose end the next fetched set is allocated
    dp_wait: list[int]  # blocking data-parallel reductions the next layer waits for


class StepProgram(LayerProgram, HbmModel, GradientReductions):
    """The ops of one training step (or one pipeline chunk's pass of it)."""

    def build(self) -> Trace:
        """The step's program: every microbatch's forward, loss and backward (the gradient
        reductions after each layer's), then the norm scales' reduction and the update."""
        m, d, cfg = self.m, self.d, self.cfg
        b = self.b
        st = self.step_state()
        first_mb_start = len(b.ops)
        for mb in range(cfg.microbatches):
            if mb == 1:
                self.check_program_size(first_mb_start, len(b.ops) - first_mb_start)
            fwd = self.forward_pass(st, mb)
            head = self.head_pass(st, fwd)
            prev, dp_wait = self.backward_pass(st, mb, head)
            self.mem(prev, G.SAVED_ACTIVATIONS, -fwd.stack)
            self.mem(prev, G.LOGITS, -head.held)  # the deferred head weight gradient is done
            if d.pp > 1 and self.sends_on:
                send = self.coll("pipeline_send_bwd", "collective-permute", ("pipeline",),
                                 self.rows() * m.d_model * self.act, [prev], 0, "bwd")
                prev = send if send is not None else prev
            emb_bwd = self.embedding_backward(st, prev, dp_wait)
            erc = self.embedding_gradient_reductions(st, mb, emb_bwd, head.head_accum)
            self.mem(erc if erc is not None else emb_bwd, G.GRADIENTS, -head.head_grad_extra)
            st.prev_compute = emb_bwd
        self.norm_gradient_reductions(st)
        return self.update(st)

    def step_state(self) -> StepState:
        """The step's shared sizes, and the weight cast that precedes every microbatch."""
        m, d = self.m, self.d
        emb_w = m.vocab_size * m.d_model / d.tp * self.wc  # one vocabulary matrix
        # Weights stored in another dtype than they are gathered in (--gather-dtype): XLA casts
        # each local shard once per step (one convert fusion per matrix, reused by the forward
        # gather and the backward's re-gathers: the v5e fsdp=16 compile of f32 params cast to
        # bf16 in each layer, docs/model.md "Training steps"), before anything is gathered.
        cast = None
        p_cast = self.local_params()
        if self.wc != self.wb and self.cast_per_pass:
            cast = self.vpu(WEIGHT_CAST, p_cast, p_cast * (self.wb + self.wc), [], -1, "fwd")
        form = self.cfg.embed_lookup
        lookup_a2a = self.embed_on and (
            xla.embedding_lookup_alltoall(tied=m.tied_embeddings, shards=self.fsdp_shards)
            if form == "auto" else form == "all-to-all" and self.fsdp_shards > 1)
        return StepState(
            emb_w=emb_w, emb_all=emb_w * (1 if m.tied_embeddings else 2),
            lookup_a2a=lookup_a2a,
            lookup_gathered=(self.embed_on and form == "all-gather"
                             and not m.tied_embeddings and self.fsdp_shards > 1),
            cast=cast, p_cast=p_cast)

    def token_gathers(self, after: list[int], phase: str) -> list[int]:
        """The int32 token ids the lookup (and its gradient's scatter-add) needs from the
        whole group: gathered over fsdp (each chip's share of its tensor group's tokens),
        then over tensor (XLA's two small all-gathers, forward and backward)."""
        d, fse = self.d, self.fsdp_shards
        ids = []
        for axis, axes, nbytes in (("fsdp", A2A_AXES, fse * d.n / d.tp * 4),
                                   ("tensor", ("tensor",), fse * d.n * 4)):
            g = self.coll(f"embed_tokens_allgather_{axis}", "all-gather", axes, nbytes,
                          after, -1, phase)
            if g is not None:
                ids.append(g)
        return ids

    # -- forward ----------------------------------------------------------------------------
    def forward_pass(self, st: StepState, mb: int) -> Forward:
        """A microbatch's embedding lookup and layers' forward (and its send to the next
        pipeline stage)."""
        m, d, a = self.m, self.d, self.act
        D = m.d_model
        start, emb_g, late_head, prev = self.embedding_forward(st)
        # The first layer's prefetched gathers wait for the cast of the shards they send.
        pending = self.fsdp_gather(0, "fwd", [st.cast] if st.cast is not None else [], [prev])
        # A scanned layer stack writes what each layer saves into [layers, ...] buffers that
        # XLA allocates whole before the forward loop and frees after the backward loop
        # (one buffer cannot be freed layer by layer): every layer's saved set is resident
        # from the first layer's forward to the last layer's backward.
        stack = sum(self.saved_bytes(layer) for layer in range(d.layers))
        self.mem(prev, G.SAVED_ACTIVATIONS, stack)
        prev, in_flight = self.forward_layers(st, mb, prev, pending)
        if d.pp > 1 and self.sends_on:
            send = self.coll("pipeline_send_fwd", "collective-permute", ("pipeline",),
                             self.rows() * D * a, [prev], d.layers - 1, "fwd")
            prev = send if send is not None else prev
        # The last layer's device copies complete with the loop (before the final norm).
        self.mem(prev, G.SAVED_ACTIVATIONS, -in_flight)
        if late_head:
            self.mem(prev, G.GATHERED_WEIGHTS, st.emb_w)
        return Forward(start=start, emb_g=emb_g, stack=stack, prev=prev)

    def embedding_forward(self, st: StepState) -> tuple[list[int], int | None, bool, int]:
        """The embedding lookup (stage 0; a later pipeline chunk's input instead): (what the
        microbatch starts after, the table's gather, whether the output projection is held
        only from the logits on, the lookup's last op)."""
        m, d, a = self.m, self.d, self.act
        b, n, D = self.b, d.n, m.d_model
        emb_w = st.emb_w
        start = [st.prev_compute] if st.prev_compute is not None else \
            ([st.cast] if st.cast is not None else [])
        emb_g = self.coll("fsdp_allgather_embed", "all-gather", A2A_AXES, emb_w, start, -1,
                          "fwd") if self.embed_on or self.head_on else None
        # The output projection's gather is issued at the start either way (its time is hidden
        # behind the forward); when XLA holds the gathered matrix is `head_gathered_late`.
        late_head = (emb_g is not None and self.head_on and xla.head_gathered_late(
            lookup_alltoall=st.lookup_a2a, holds_embedding=self.embed_on,
            forward_windowed=self.forward_windowed))
        if not late_head:
            self.mem(emb_g, G.GATHERED_WEIGHTS, emb_w)
        lk = None
        if st.lookup_a2a:
            tok = self.token_gathers(start, "fwd")
            lk = self.coll("embed_lookup_alltoall", "all-to-all", A2A_AXES,
                           self.fsdp_shards * n * D * a, start + tok, -1, "fwd")
        elif st.lookup_gathered:
            # `embed_lookup` all-gather on an untied table: the input table is gathered over
            # its d_model shards (as a tied table is for the logits), held until the lookup.
            lk = self.coll("fsdp_allgather_embed_lookup", "all-gather", A2A_AXES, emb_w,
                           start, -1, "fwd")
            self.mem(lk, G.GATHERED_WEIGHTS, emb_w)
        table = lk if st.lookup_a2a or st.lookup_gathered else \
            (emb_g if self.embed_on else None)
        x = b.add("embed_lookup" if self.embed_on else "stage_input", kind=OpKind.COMPUTE,
                  unit=Unit.VPU, flops=0.0,
                  hbm_bytes=2 * self.rows() * D * a if self.embed_on else 0.0,
                  deps=[st.prev_compute] + ([table] if table is not None else []),
                  layer=-1, phase="fwd")
        if emb_g is not None and not self.head_on:  # no logits here to keep it for
            self.mem(x, G.GATHERED_WEIGHTS, -emb_w)
        if st.lookup_gathered:
            self.mem(x, G.GATHERED_WEIGHTS, -emb_w)
        prev = x
        if self.embed_on and d.tp > 1:
            # The table's vocabulary is split over `tensor`: each shard looks up the rows it
            # holds (zeros elsewhere) and the partial embeddings are summed over `tensor`,
            # all-reduced to the replicated residual or reduce-scattered to the sharded one
            # (XLA, docs/model.md "Collectives as XLA emits them").
            red = self.coll("tp_embed_allreduce" if not self.tp_sharded
                            else "tp_embed_reducescatter",
                            "reduce-scatter" if self.tp_sharded else "all-reduce",
                            ("tensor",), n * D * a, [x], -1, "fwd")
            prev = red if red is not None else x
        return start, emb_g, late_head, prev

    def forward_layers(self, st: StepState, mb: int, prev: int, pending: Gathered | None
                       ) -> tuple[int, float]:
        """The layers' forward from `prev`, the first layer's gathers `pending`: (the last
        layer's output, the bytes of its offloaded copies still in flight)."""
        cfg, d, b = self.cfg, self.d, self.b
        # Under `offload` a layer's offloaded set is written to HBM by its matmuls and
        # copied to host asynchronously; the device copies live until the copies complete,
        # through the next layer's forward (workloads/memory.py offload_in_flight).
        in_flight = 0.0
        for layer in range(d.layers):
            g = pending
            inp = prev
            first_op = len(b.ops)
            out = self.layer_forward(layer, [prev], g)
            self.cur = None
            if g is not None and g.windowed(("w_gate", "w_up")):
                self.mem_windowed_mlp_outputs(layer, first_op)
            # The gathered weights are freed once the layer is done.
            self.end_layer(out, g)
            if cfg.remat_plan.offloads:
                b.add("offload_activations", kind=OpKind.HOST,
                      bytes=self.offload_bytes(layer), deps=[out], layer=layer, phase="fwd")
            if cfg.remat_plan.rule == "offload":
                self.mem_saved(self.offloaded(layer), first_op, out)
                self.mem(out, G.SAVED_ACTIVATIONS, -in_flight)
                in_flight = self.offload_bytes(layer)
            if layer + 1 < d.layers:
                # Prefetch the next layer's weights as this layer starts (XLA's async
                # all-gather, two layers of weights in flight); without overlap the gather
                # waits for this layer to finish and blocks the next.
                after = (g.ids() if g is not None else []) + [inp]
                pending = self.fsdp_gather(layer + 1, "fwd", after, [out])
            st.layer_outputs[(mb, layer)] = out
            prev = out
        return prev, in_flight

    # -- output projection and loss ---------------------------------------------------------
    def head_pass(self, st: StepState, fwd: Forward) -> Head:
        """The final norm, the output projection, the loss and their backward (a pipeline chunk
        before the last: the output gradient arriving from the next)."""
        m, d, cfg, a = self.m, self.d, self.cfg, self.act
        b, n, D, V = self.b, d.n, m.d_model, m.vocab_size
        emb_w, emb_g, prev = st.emb_w, fwd.emb_g, fwd.prev
        if not self.head_on:
            # A pipeline chunk before the last: its output gradient arrives from the next.
            final_norm = prev = b.add("stage_grad_input", kind=OpKind.COMPUTE,
                                      unit=Unit.VPU, flops=0.0, hbm_bytes=0.0, deps=[prev],
                                      layer=-1, phase="bwd")
            return Head(final_norm=final_norm, prev=prev, held=0.0, head_accum=None)
        head_accum = None
        r = self.rows()
        self.mtp_heads(prev, emb_g)
        final_norm = self.vpu("final_norm", 5 * r * D, 3 * r * D * a, [prev], -1, "fwd")
        # Sharded activations are gathered over `tensor` before the vocab-split logits.
        lg_deps, lg_after = self.tp_enter("", "logits", final_norm, -1, "fwd")
        # Vocab tiling runs the projection chunk by chunk: each chunk reads the whole
        # (gathered) matrix, and only one chunk's logits exist at a time.
        tiles = cfg.vocab_tiling
        logits = self.mm("logits", 2 * n * D * V / d.tp, emb_w * tiles, n * D * a,
                         n * V / d.tp * 4,
                         [final_norm] + ([emb_g] if emb_g is not None else []) + lg_deps,
                         -1, "fwd", q=Q("logits", act=n * D, weight=emb_w / self.wc,
                                        out=n * V / d.tp, k=D))
        # The loss over vocabulary shards: the row maxima (bf16, before the f32 convert)
        # and then the f32 sum of exponentials and the target logit are all-reduced
        # over tensor; the target ids reach the shards through one collective-permute
        # of each chip's n int32 ids over fsdp x tensor (XLA).
        mx = self.coll("tp_logits_max_allreduce", "all-reduce", ("tensor",), n * a,
                       [logits], -1, "loss")
        tg = self.coll("loss_targets_permute", "collective-permute", ("fsdp", "tensor"),
                       n * 4, fwd.start, -1, "loss") if d.fs > 1 and d.tp > 1 else None
        loss = self.vpu("softmax_xent", 6 * n * V / d.tp, 2 * n * V / d.tp * 4,
                        [logits, *lg_after] + [x for x in (mx, tg) if x is not None],
                        -1, "loss")
        lse = self.coll("tp_logsumexp_allreduce", "all-reduce", ("tensor",),
                        n * 4 * 2, [loss], -1, "loss")
        dlog_deps = [loss] + ([lse] if lse is not None else [])
        if tiles > 1:
            # MaxText's vocab tiling keeps no logits for the backward (a custom VJP):
            # the backward recomputes each chunk's logits and its softmax.
            rl = self.mm("logits_recompute", 2 * n * D * V / d.tp, emb_w * tiles,
                         n * D * a, n * V / d.tp * 4, dlog_deps, -1, "bwd",
                         q=Q("logits", act=n * D, weight=emb_w / self.wc, out=n * V / d.tp,
                             k=D))
            dlog_deps = [self.vpu("softmax_xent_recompute", 6 * n * V / d.tp,
                                  2 * n * V / d.tp * 4, [rl], -1, "bwd")]
        dlog = self.vpu("dlogits", 4 * n * V / d.tp, 2 * n * V / d.tp * a, dlog_deps,
                        -1, "bwd")
        # `logits_dtype` fp32 (docs/model/training.md "The logits path's dtype"): XLA rounds a
        # default-precision f32 dot's operands to bf16, so the gathered projection, the final
        # norm's output and the logit gradients stay bf16 and only the weight gradient, the
        # f32 dot's result, is f32 (`head_gb`) until its fsdp reduction.
        # With the vocabulary split over `tensor` the input gradient is f32 too until its
        # reduction over `tensor` (XLA's all-reduce reads the f32 sum and writes bf16: the
        # v5p fsdp=4 x tensor=4 compile); without it the convert is fused into the dot.
        dxb = 4.0 if cfg.logits_dtype == "fp32" and d.tp > 1 else a
        dx = self.mm("logits_bwd", 4 * n * D * V / d.tp, 2 * emb_w * tiles,
                     n * V / d.tp * a, n * D * dxb + emb_w / self.wc * self.head_gb, [dlog],
                     -1, "bwd",
                     q=Q("logits", act=n * D, sr=2 * n * V / d.tp, weight=emb_w / self.wc,
                         out=n * D + emb_w / self.wc, k=V / d.tp))
        if self.rs_windowed and self.fsdp_shards > 1:
            # The output projection's gradient is reduce-scattered by a windowed ring
            # too (XLA's largest one: [d_model / N, vocab] accumulators).
            head_accum = self.ring_accumulators("logits_bwd_weights", dx, emb_w, -1,
                                                "bwd", grad_bytes=self.head_gb)
        held = self.head_held_bytes()
        # The f32 weight gradient's extra bytes over the gradients' dtype (`logits_dtype`
        # fp32), held from the backward dot until its fsdp reduction after the backward loop:
        # the two [d_model / N, vocab] accumulators of a windowed ring, else the whole matrix
        # (v5e fsdp=16: XLA's peak +16.8 MB, the two f32 accumulators).
        extra = (self.head_gb - self.gb) * emb_w / self.wc * (
            2 / self.fsdp_shards if self.rs_windowed and self.fsdp_shards > 1 else 1.0)
        self.mem(dx, G.GRADIENTS, extra)
        # At the loss XLA holds the logits in f32 and a bf16 buffer for their
        # gradients (workloads/memory.py), plus the gathered output projection; all die
        # with the logits' backward matmul. Vocab tiling holds one chunk's at a time.
        lt = loss_tensors(rows=n / tiles, local_vocab=V / d.tp, act_bytes=a)
        self.mem(logits, G.LOGITS, sum(t.num_bytes for t in lt))
        self.mem(dx, G.LOGITS, -sum(t.num_bytes for t in lt) + held)
        self.mem(dx, G.GATHERED_WEIGHTS, -emb_w if emb_g is not None else 0.0)
        # The input gradient is summed over the vocab shards (reduce-scattered when the
        # activations are sharded, all-reduced when they are replicated).
        dar_deps = self.tp_exit("", "logits_bwd", dx, [dx], -1, "bwd", elem_bytes=dxb)
        if dxb != a:  # the f32 input gradient's extra bytes, until its reduction
            self.mem(dx, G.TEMPORARIES, n * D * (dxb - a))
            self.mem(dar_deps[-1], G.TEMPORARIES, -n * D * (dxb - a))
        return Head(final_norm=final_norm, prev=dar_deps[-1], held=held,
                    head_accum=head_accum, head_grad_extra=extra)

    def mtp_heads(self, prev: int, emb_g: int | None) -> None:
        """Each MTP module's loss (DeepSeek-V3 §2.2: the module's own final norm, then the
        shared output projection and a cross-entropy over the tokens it predicts), forward
        and backward, from the top layer's output `prev` (the last MTP module's block: the
        modules run as layers after the main ones). Emitted before the main loss, while the
        gathered output projection is held; its logits live from its logits matmul to its
        backward, as the main loss's do."""
        m, d, a = self.m, self.d, self.act
        n, D, V, tp = d.n, m.d_model, m.vocab_size, d.tp
        emb_w = m.vocab_size * m.d_model / tp * self.wc
        r = self.rows()
        lt = sum(t.num_bytes for t in loss_tensors(rows=n, local_vocab=V / tp, act_bytes=a))
        for _ in range(m.num_mtp_modules):
            norm = self.vpu("mtp_final_norm", 5 * r * D, 3 * r * D * a, [prev], -1, "fwd")
            lg_deps, lg_after = self.tp_enter("", "mtp_logits", norm, -1, "fwd")
            logits = self.mm("mtp_logits", 2 * n * D * V / tp, emb_w, n * D * a, n * V / tp * 4,
                             [norm] + ([emb_g] if emb_g is not None else []) + lg_deps, -1,
                             "fwd")
            mx = self.coll("tp_mtp_logits_max_allreduce", "all-reduce", ("tensor",), n * a,
                           [logits], -1, "loss")
            loss = self.vpu("mtp_softmax_xent", 6 * n * V / tp, 2 * n * V / tp * 4,
                            [logits, *lg_after] + ([mx] if mx is not None else []), -1, "loss")
            lse = self.coll("tp_mtp_logsumexp_allreduce", "all-reduce", ("tensor",), n * 4 * 2,
                            [loss], -1, "loss")
            dlog = self.vpu("mtp_dlogits", 4 * n * V / tp, 2 * n * V / tp * a,
                            [loss] + ([lse] if lse is not None else []), -1, "bwd")
            dx = self.mm("mtp_logits_bwd", 4 * n * D * V / tp, 2 * emb_w, n * V / tp * a,
                         n * D * a + emb_w, [dlog], -1, "bwd")
            self.mem(logits, G.LOGITS, lt)
            self.mem(dx, G.LOGITS, -lt)
            self.tp_exit("", "mtp_logits_bwd", dx, [dx], -1, "bwd")

    def head_held_bytes(self) -> float:
        """Logits-path bytes the chip's compiler keeps through the backward loop (the
        deferred head weight gradient, the f32 logits of a loss value scheduled after it)."""
        m, d, cfg, a = self.m, self.d, self.cfg, self.act
        n, D, V, tiles = d.n, m.d_model, m.vocab_size, cfg.vocab_tiling
        held = deferred_head_gradient_bytes(
            rows=n, d_model=D, local_vocab=V / d.tp, act_bytes=a, tensor=d.tp,
            fsdp=d.fs, tp_activations=cfg.tp_activations, remat=cfg.remat_plan.rule,
            residual_rows=self.rows(), attention=cfg.attention,
            gather=self.plain_gather_form, int8=self.quantizes("weight"))
        held += windowed_head_gradient_bytes(
            rows=n, d_model=D, local_vocab=V / d.tp, act_bytes=a, tensor=d.tp,
            fsdp=self.fsdp_shards, windowed=self.rs_windowed, cast_weights=self.wb != self.wc,
            offload=cfg.remat_plan.offloads, chip_defers=cfg.head_grad_after_backward,
            vocab_tiling=tiles, residual_rows=self.rows(),
            flash_one_sequence=cfg.attention == "flash" and cfg.loss_after_backward
            and one_sequence_per_chip(sequences_per_chip=n * d.sp / d.ctx))
        # With one sequence per chip v5e's compiler keeps the f32 logits for the
        # loss value's target-logit gather, scheduled after the backward loop.
        held += loss_value_logits_bytes(rows=n, local_vocab=V / d.tp,
                                        sequences_per_chip=n * d.sp / d.ctx,
                                        vocab_tiling=tiles, tensor=d.tp,
                                        chip_defers=cfg.loss_after_backward)
        return held

    # -- backward ---------------------------------------------------------------------------
    def backward_pass(self, st: StepState, mb: int, head: Head) -> tuple[int, list[int]]:
        """Backward through the layers in reverse, each followed by its gradient reductions:
        (the first layer's input gradient, the reductions the next op waits for)."""
        d = self.d
        prev = head.prev
        # The last layer's weights are gathered again while the loss is computed.
        pending = self.fsdp_gather(d.layers - 1, "bwd", [head.final_norm], [prev])
        # Under an offloading policy the backward loop carries one HBM buffer per offloaded
        # tensor: a layer's fetch writes into the buffers the layer above read, and its
        # copies complete as the loop body (the backward of the layer above) ends. So the
        # fetched set is allocated in program order, at the end of the layer above's
        # backward (the top layer's after the final norm: XLA copies it back into the
        # buffers its forward copy to host has just released), whenever the PCIe transfer
        # lands (docs/model.md "Memory").
        loop = BackwardLoop(fetch_after=[head.final_norm], fetch_alloc_at=head.final_norm,
                            dp_wait=[])
        for layer in reversed(range(d.layers)):
            g = pending
            inp = prev
            out = self.backward_layer(st, mb, layer, g, prev, loop)
            if layer > 0:
                after = (g.ids() if g is not None else []) + [inp]
                pending = self.fsdp_gather(layer - 1, "bwd", after, [out])
            loop.dp_wait = self.reduce_layer_gradients(st, mb, layer, out)
            prev = out
        return prev, loop.dp_wait

    def backward_layer(self, st: StepState, mb: int, layer: int, g: Gathered | None,
                       prev: int, loop: BackwardLoop) -> int:
        """One layer's backward from the output gradient `prev`: the fetch of its offloaded
        activations, the remat policy's recomputation, the layer's backward ops and the HBM
        its temporaries, copies and recomputed tensors take. Returns its last op."""
        cfg, d, b, a = self.cfg, self.d, self.b, self.act
        D = self.m.d_model
        deps = [prev] + loop.dp_wait
        loop.dp_wait = []  # this layer sets its own
        # Activation gradients in flight through a layer's backward: the residual
        # stream's gradient and a sublayer's input gradient before and after its
        # reduction over `tensor` (XLA's live ranges: three [tokens, d_model] bf16
        # gradient buffers in the backward loop body).
        grad_tmp = (self.rows() + 2 * d.n) * D * a
        self.mem(prev, G.TEMPORARIES, grad_tmp)
        # A recomputing policy's backward loop body reads the layer's entries of the
        # stacked saved buffers through copies (dynamic-slice fusions) that live for
        # the layer's backward (docs/model.md "Memory"); `none` reads them in place.
        plan = cfg.remat_plan
        copies = self.saved_bytes(layer) if plan.rule in ("minimal", "full", "offload") \
            or not plan.legacy else 0.0
        self.mem(prev, G.SAVED_ACTIVATIONS, copies)
        if plan.offloads:
            # Fetched one layer ahead: when the backward of the layer above starts.
            fetch = b.add("fetch_activations", kind=OpKind.HOST,
                          bytes=self.offload_bytes(layer),
                          deps=[st.layer_outputs[(mb, layer)], *loop.fetch_after],
                          layer=layer, phase="bwd")
            loop.fetch_after = [prev]
            deps.append(fetch)
            self.mem(loop.fetch_alloc_at, G.SAVED_ACTIVATIONS, self.offload_bytes(layer))
        deps, recomputed = self.recompute_layer(layer, deps, g)
        self.mem(deps[0] if plan.rule != "none" else None, G.SAVED_ACTIVATIONS,
                 recomputed)
        out = self.layer_backward(layer, deps, g, grad=prev)
        self.cur = None
        if g is not None:
            # The MLP's gathered matrices die with their weight-gradient matmul, before
            # the attention's backward (XLA frees a buffer after its last reader).
            self.mem(self.mlp_weights_done, G.GATHERED_WEIGHTS,
                     -g.release(self.mlp_keys(layer)))
        # Under `full` and `minimal` the MLP's recomputed tensors and its copies of
        # the stack entries die with the MLP's weight-gradient matmul, before the
        # attention's backward (docs/model.md "Memory").
        mlp_copies, mlp_recomputed = self.mlp_side_bytes(layer)
        self.mem(self.mlp_weights_done, G.SAVED_ACTIVATIONS,
                 -(mlp_copies + mlp_recomputed))
        self.mem(out, G.TEMPORARIES, -grad_tmp)
        self.mem(out, G.SAVED_ACTIVATIONS, -(copies - mlp_copies))
        self.end_layer(out, g)
        loop.fetch_alloc_at = out
        # What the layer recomputed or fetched dies with its backward (what it kept
        # stays in the stack until the loop ends).
        if not plan.legacy:
            self.mem(out, G.SAVED_ACTIVATIONS, -(self.named_backward_bytes(layer)
                                                 - mlp_recomputed))
            return out
        fetched_extra = sum(
            t.num_bytes for t in self.offloaded(layer)
            if t.name not in {r.name for r in self.recomputed_set(layer)}
        ) if plan.kept_projections else 0.0
        self.mem(out, G.SAVED_ACTIVATIONS, 0.0 if plan.rule == "none" else
                 -(sum(t.num_bytes for t in self.recomputed_set(layer))
                   - self.saved_bytes(layer) + fetched_extra - mlp_recomputed))
        return out

    def named_backward_bytes(self, layer: int) -> float:
        """What a named policy's layer backward allocated besides the copies of its kept
        entries, freed as the backward ends: the fetched set and what it recomputed (a rerun
        forward: every tensor of the recomputed set it neither kept nor fetched; the
        elementwise recompute of a policy that keeps every projection: the recomputed set
        less the kept one, the fetched part counted at the fetch)."""
        plan = self.cfg.remat_plan
        rec = self.recomputed_set(layer)
        if not plan.recomputes_layer:
            return sum(t.num_bytes for t in rec) - self.saved_bytes(layer)
        kept = plan.device | plan.host
        return self.offload_bytes(layer) + sum(t.num_bytes for t in rec if t.name not in kept)

    def recompute_layer(self, layer: int, deps: list[int], g: Gathered | None
                        ) -> tuple[list[int], float]:
        """The remat policy's recomputation before a layer's backward: (what the backward
        reads, the recomputed bytes still to allocate at its first dep)."""
        cfg = self.cfg
        # What the remat policy recomputes lives from the recomputation until the end
        # of the layer's backward, next to what it kept.
        plan = cfg.remat_plan
        recomputed = sum(t.num_bytes for t in self.recomputed_set(layer)) - \
            self.saved_bytes(layer) - (
            self.offload_bytes(layer) if plan.rule == "offload"
            or (not plan.legacy and plan.offloads) else 0.0)
        if plan.recomputes_layer:
            first_op = len(self.b.ops)
            self.recompute_leaves = []
            inp = self.layer_forward(layer, deps, g, phase="bwd", recompute=True)
            self.cur = None
            self.regather(layer, g, [inp])
            # The backward reads every live end of the recomputation (the last matmul
            # of the layer and what follows it are dead code, see layer_forward).
            deps = [inp] + self.recompute_leaves
            # The recomputed tensors live from the recomputing op on; what came back
            # from host memory lives from its fetch.
            kept = {t.name for t in self.saved(layer)} | {
                t.name for t in self.offloaded(layer) if plan.rule != "offload"}
            self.mem_saved([t for t in self.recomputed_set(layer)
                            if t.name not in kept], first_op, inp)
            recomputed = 0.0
        elif plan.rule != "none":
            # Recompute the cheap elementwise ops (norms, activations, rotary).
            rr = self.rows()
            re = self.vpu("re-elementwise", 20 * rr * self.m.d_model, 8 * rr * self.m.d_model
                          * self.act, deps, layer, "bwd")
            deps = [re]
        return deps, recomputed

    # -- embedding's gradient and the update ------------------------------------------------
    def embedding_backward(self, st: StepState, prev: int, dp_wait: list[int]) -> int:
        """The input table's gradient (a later pipeline chunk sends its input gradient back
        instead); returns its last op."""
        m, d, a = self.m, self.d, self.act
        n, D = d.n, m.d_model
        if not self.embed_on:
            return prev
        if self.tp_sharded:
            # Every vocabulary shard scatters the gradients of all its tokens' rows:
            # the sharded input gradient is gathered over `tensor` first.
            eg = self.coll("tp_embed_grad_allgather", "all-gather", ("tensor",),
                           n * D * a, [prev], -1, "bwd")
            prev = eg if eg is not None else prev
        emb_bwd = self.vpu("embed_grad", n * D, 3 * n * D * a, [prev] + dp_wait, -1,
                           "bwd")
        rows_v = d.dp * self.fsdp_shards * n * D * a  # every chip's gradient rows
        table_v = st.emb_w / self.wc * self.gb  # the chip's whole table gradient
        auto = self.cfg.embed_lookup == "auto"
        if st.lookup_gathered:
            # The gathered table's gradient: every chip scatter-adds its own rows into a zero
            # table of the whole width, summed by a plain collective of its own (not the
            # output projection's windowed ring): `xla.gathered_table_grad_kind`. The table
            # is held from the first microbatch's scatter-add to the update (freed at a compute
            # op; a free at the collective would weaken the planner's HBM bound, which counts
            # such a free from the step's start: `plan_bounds.hbm_peak_lower_bound`).
            emb_bwd = self.vpu("embed_grad_scatter_add", n * D,
                               3 * n * D * a + 2 * table_v, [emb_bwd], -1, "bwd")
            if not st.gathered_grad_held:
                self.mem(emb_bwd, G.GRADIENTS, table_v)
                st.gathered_grad_held = table_v
            if xla.gathered_table_grad_kind(tensor=d.tp) == "all-reduce":
                # All-reduced whole over data x fsdp, each chip keeping its shard (the
                # data-parallel sum included, as `embed_grad_table_allreduce` above).
                rs = self.coll("embed_grad_table_allreduce", "all-reduce",
                               ("data",) + A2A_AXES, table_v, [emb_bwd], -1, "bwd")
                st.table_reduced = True
            else:
                rs = self.coll("fsdp_grad_reducescatter_embed_lookup", "reduce-scatter",
                               A2A_AXES, table_v, [emb_bwd], -1, "bwd")
            if rs is not None:
                st.last_grad_ops.append(rs)
                emb_bwd = rs
        elif st.lookup_a2a and d.dp > 1 and auto and xla.embedding_grad_rows_gathered(
                rows_bytes=rows_v, table_bytes=table_v):
            # The rows replicated: every chip's [n, d_model] input gradient is all-gathered
            # over data x fsdp (x expert), each chip keeps its fsdp group's rows and its
            # d_model slice for the scatter-add, and the table's gradient is then summed over
            # data (`dp_grad_allreduce_embed`).
            tok = self.token_gathers([prev], "bwd")
            ga = self.coll("embed_grad_allgather", "all-gather",
                           ("data",) + A2A_AXES, rows_v, [emb_bwd] + tok, -1, "bwd")
            emb_bwd = self.vpu("embed_grad_scatter_add", n * D, 3 * n * D * a,
                               [emb_bwd] + ([ga] if ga is not None else []), -1, "bwd")
        elif st.lookup_a2a and d.dp > 1 and auto:
            # ... and here the table: each chip scatter-adds its own rows into a zero
            # table of the whole width and the table is all-reduced over data x fsdp
            # (x expert), already summed over data.
            emb_bwd = self.vpu("embed_grad_scatter_add", n * D,
                               3 * n * D * a + 2 * table_v, [emb_bwd], -1, "bwd")
            tr = self.coll("embed_grad_table_allreduce", "all-reduce",
                           ("data",) + A2A_AXES, table_v, [emb_bwd], -1, "bwd")
            st.table_reduced = True
            emb_bwd = tr if tr is not None else emb_bwd
        elif st.lookup_a2a:
            # (Forced by `embed_lookup` all-to-all with a data axis too: the rows go back to
            # their fsdp group's shards and the shard is summed over data with the other
            # embedding gradients, `dp_grad_allreduce_embed`.)
            tok = self.token_gathers([prev], "bwd")
            ga = self.coll("embed_grad_alltoall", "all-to-all", A2A_AXES,
                           self.fsdp_shards * n * D * a, [emb_bwd] + tok, -1, "bwd")
            # With the vocabulary split over `tensor`, when such a table is smaller than the
            # chip's gradient rows, the rows are scatter-added into a table of the whole
            # vocabulary on every tensor shard, summed over `tensor` and sliced to the chip's
            # shard (`xla.embedding_grad_whole_vocab`); else each shard scatters the rows it
            # holds. The table is not held in the memory model: in the compiles' live ranges it
            # is a VMEM buffer on v5e and, on v5p, an HBM one live only from the scatter-add to
            # this collective, long after the step's peak (docs/model/training.md).
            whole = m.vocab_size * D / self.fsdp_shards * a
            if not xla.embedding_grad_whole_vocab(tensor=d.tp, rows_bytes=n * D * a,
                                                  table_bytes=whole):
                whole = 0.0
            emb_bwd = self.vpu("embed_grad_scatter_add", n * D, 3 * n * D * a + 2 * whole,
                               [emb_bwd] + ([ga] if ga is not None else []), -1, "bwd")
            if whole:
                rs = self.coll("tp_embed_grad_reducescatter", "reduce-scatter", ("tensor",),
                               whole, [emb_bwd], -1, "bwd")
                emb_bwd = rs if rs is not None else emb_bwd
        return emb_bwd

    def embedding_gradient_reductions(self, st: StepState, mb: int, emb_bwd: int,
                                      head_accum: int | None) -> int | None:
        """The embedding tables' gradients summed over fsdp (and, on the last microbatch,
        over the data-parallel axes), and the HBM of the rest of the local gradient shard."""
        cfg, fse = self.cfg, self.fsdp_shards
        emb_w = st.emb_w
        erc = None
        if self.embed_on or self.head_on:
            erc = self.coll(f"fsdp_grad_{self.grad_kind.replace('-', '')}_embed",
                            self.grad_kind, A2A_AXES,
                            emb_w / self.wc * (self.head_gb if self.head_on else self.gb)
                            * (self.ring(fse, "reduce-scatter") if self.rs_windowed else 1.0),
                            [emb_bwd] + ([head_accum] if head_accum is not None else []),
                            -1, "bwd")
            if erc is not None:
                st.last_grad_ops.append(erc)
            if mb == cfg.microbatches - 1:
                ear = self.coll("dp_grad_allreduce_embed", "all-reduce", ("data", "sequence"),
                                (st.emb_all - (emb_w if st.table_reduced else 0.0))
                                / self.wc * self.gb / fse
                                + (0.0 if fse > 1 or self.dp_split_per_matrix
                                   else self.norm_grad_bytes()),
                                [erc if erc is not None else emb_bwd], -1, "bwd")
                if ear is not None:
                    st.last_grad_ops.append(ear)
        if mb == 0:  # embedding and norm gradients: the rest of the local shard
            self.mem(erc if erc is not None else emb_bwd, G.GRADIENTS,
                     max(self.local_params() * self.gh - st.grads_allocated, 0.0))
        return erc

    def update(self, st: StepState) -> Trace:
        """The optimizer update on the local parameter shard, and the trace of the step."""
        # The update on the local parameter shard: reads the weights, the gradients and the
        # state, writes the weights and the state (Adam: tpu.md §4, bf16 params + fp32 moments).
        p_local = self.local_params()
        upd = self.vpu(f"{self.opt.value}_update", self.opt.update_flops_per_param * p_local,
                       p_local * (2 * self.wb + self.gb + 2 * self.state_bytes_per_param),
                       [st.prev_compute] + st.last_grad_ops, -1, "optimizer")
        self.mem(upd, G.GRADIENTS, -max(p_local * self.gh, st.grads_allocated)
                 - st.gathered_grad_held)
        if self.wc != self.wb and not self.cast_per_pass:
            # A pipeline chunk's cast, last and alone (so its passes hold none): the stage
            # composition, the pass-level schedule and the plan's bound run it once, before
            # the stage's first pass (sim/engine/pipeline.py).
            self.vpu(WEIGHT_CAST, st.p_cast, st.p_cast * (self.wb + self.wc), [upd], -1,
                     "optimizer")
        # Parameters and optimizer state are the program's (donated) arguments, resident for the
        # whole step; gradients are temporaries of the backward pass, as in XLA's program.
        static = p_local * (self.wb + self.state_bytes_per_param)
        meta = self.meta(p_local, static)
        return Trace(mesh=self.mesh, ops=tuple(self.b.ops), meta=meta)

    def meta(self, p_local: float, static: float) -> TraceMeta:
        m, d, cfg = self.m, self.d, self.cfg
        tokens_global = self.global_seqs * cfg.seq_len
        model_flops = m.training_flops(tokens_global, cfg.seq_len, causal=True)
        mt = m.maxtext_flops_per_device(cfg.batch_per_chip, cfg.seq_len, "matmul_causal")
        act_peak = self.activation_peak()
        return TraceMeta.of(
            kind=TraceKind.TRAINING,
            model=m.name,
            seq_len=cfg.seq_len,
            batch_per_chip=cfg.batch_per_chip,
            global_sequences=self.global_seqs,
            num_chips=self.num_chips,
            tokens_per_step=tokens_global,
            model_flops_per_chip=model_flops / self.num_chips,
            maxtext_flops_per_chip=mt,
            remat=str(cfg.remat),
            attention=str(cfg.attention),
            microbatches=cfg.microbatches,
            pipeline_stages=d.pp,
            pipeline_schedule=str(cfg.pipeline_schedule),
            virtual_stages=cfg.virtual_stages,
            # Activations one stage sends the next per microbatch (and gradients back).
            pipeline_send_bytes=self.rows() * m.d_model * self.act,
            **({"moe": self.routing.summary(cfg.moe), "moe_scenario_applied": True}
               if self.routing is not None else {}),
            overlap=cfg.overlap,
            fsdp_gather=str(cfg.fsdp_gather),
            fsdp_grad=str(cfg.fsdp_grad),
            dp_grad_split=str(cfg.dp_grad_split),
            optimizer=str(self.opt),
            fuse_elementwise=cfg.fuse_elementwise,
            tp_activations=str(cfg.tp_activations),
            tp_comm=str(cfg.tp_comm),
            params_per_chip=p_local,
            static_hbm_bytes=static,
            static_composition={"params": p_local * self.wb,
                                "optimizer": p_local * self.state_bytes_per_param},
            static_breakdown={
                "params": p_local * self.wb,
                "grads": p_local * self.gh,
                "optimizer": p_local * self.state_bytes_per_param,
            },
            activation_bytes_estimate=act_peak,
            # The tensors the first layer keeps for its backward (per chip, one microbatch).
            saved_activations_per_layer={
                t.name: t.num_bytes for t in self.saved(0)},
            memory_events=self.mem_events,
            # The loss's temporaries (pipeline stages add them to the last stage's peak).
            logits_bytes=sum(t.num_bytes for t in loss_tensors(
                rows=d.n / cfg.vocab_tiling, local_vocab=m.vocab_size / d.tp,
                act_bytes=self.act))
            if self.head_on else 0.0,
        )
