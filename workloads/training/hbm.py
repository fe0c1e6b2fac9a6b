"""The step's HBM model: what each layer saves for its backward (by remat policy, tensor by
tensor from `workloads/memory.py`), recomputes, offloads to host memory and fetches back, and
the allocation events of those tensors at the ops that produce and last read them. Whole-step
quantities (the saved activations' peak) are what `estimate_training_memory` reports without
building the program.
"""

from __future__ import annotations

from workloads.memory import (
    LayerShapeSpec,
    MemoryCategory,
    named_tensors,
    offloaded_tensors,
    saved_tensors,
)
from workloads.training.modes import Remat
from workloads.training.program import ProgramBuilder
from workloads.training.remat import remat_plan


class HbmModel(ProgramBuilder):
    """Saved, recomputed and offloaded activations of the step's layers, and their events."""

    def _per_kind(self, key: tuple, make):
        """`make()` once per layer kind: a layer's tensors depend on it only through whether it
        is an MoE layer (`layer_shape`), and a step asks for them about ten times a layer
        (78,000 times in the v5e 4x4 LLaMA-3-8B plan's builds). Kept with the `Dims` they
        were sized for (a pipeline chunk's compiler replaces its `d` before building)."""
        memo = self.__dict__.get("_kind_memo")
        if memo is None or memo[0] is not self.d:
            memo = self._kind_memo = (self.d, {})
        hit = memo[1].get(key)
        if hit is None:
            hit = memo[1][key] = make()
        return hit

    def layer_shape(self, layer: int) -> LayerShapeSpec:
        moe = self.layer_is_moe(layer)
        return self._per_kind(("shape", moe), lambda: self._layer_shape(moe))

    def _layer_shape(self, moe: bool) -> LayerShapeSpec:
        m, d = self.m, self.d
        # An MoE layer's hidden: its top-k routed experts' and its shared experts'.
        ff = m.expert_d_ff * (m.experts_per_token + m.num_shared_experts) if moe else m.d_ff
        mla = {}
        if m.is_mla:
            # MLA's q and k are head_dim wide per head, its v and the attention output
            # v_head_dim; its latents are d_model -> q_lora + kv_lora + rope (whole on every
            # tensor shard: `MLA_WHOLE_OVER_TENSOR`).
            h_loc = m.num_heads / d.tp
            mla = dict(v_width=h_loc * m.value_head_dim, context_width=h_loc * m.value_head_dim,
                       latent_width=m.kv_lora_rank + (m.q_lora_rank or 0) + m.qk_rope_head_dim,
                       q_producer="q_up" if m.q_lora_rank is not None else "q_proj",
                       kv_producer="kv_up")
        return LayerShapeSpec(
            rows=d.n, residual_rows=self.rows(), context=d.ctx, d_model=m.d_model,
            q_width=m.num_heads / d.tp * m.head_dim,
            kv_width=max(m.num_kv_heads / d.tp, 1.0) * m.head_dim,
            local_heads=m.num_heads / d.tp, ff_width=ff / d.tp,
            mlp_matrices=m.mlp.num_matrices, mlp_kind=str(m.mlp), parallel_block=m.parallel_block,
            num_experts=m.num_experts if moe else 0,
            mlp_act_bytes=4.0 if self.cfg.mlp_act_dtype == "fp32" else 0.0, **mla)

    def saved(self, layer: int, remat: Remat | None = None):
        return self._per_kind(("saved", self.layer_is_moe(layer), remat),
                              lambda: self._saved(layer, remat))

    def _saved(self, layer: int, remat: Remat | None):
        plan = self.cfg.remat_plan if remat is None else remat_plan(remat)
        if not plan.legacy:
            return named_tensors(self.layer_shape(layer), plan.device, act_bytes=self.act,
                                 attention=self.cfg.attention)
        return saved_tensors(self.layer_shape(layer), remat=plan.rule,
                             attention=self.cfg.attention, act_bytes=self.act)

    def mem_saved(self, tensors, first_op: int, fallback: int) -> None:
        """Allocate `tensors` as saved activations, each when its producer (among the ops from
        `first_op` on; `fallback` if the layer has no such op) ends."""
        by_name = {o.name.removeprefix("re-"): o.id for o in self.b.ops[first_op:]}
        for t in tensors:
            self.mem(by_name.get(t.producer, fallback), MemoryCategory.SAVED_ACTIVATIONS,
                     t.num_bytes)

    def mem_windowed_mlp_outputs(self, layer: int, first_op: int) -> None:
        """A windowed (collective-matmul) MLP input projection writes into output buffers XLA
        allocates at the start of the layer's forward, before the attention, and frees once
        the activation has read them: the gate/up outputs are live through the attention's
        peak. Source: the `AllocateBuffer` pair of `[tokens, d_ff]` buffers in every windowed
        program of `benchmarks/xla_memory.py` (v5e, v6e and v5p fsdp=16 under full, minimal and
        offload), live from before the score matmul to the activation."""
        if self.layer_is_moe(layer):
            return
        m, d = self.m, self.d
        by_name = {o.name: o.id for o in self.b.ops[first_op:]}
        end = by_name.get("mlp_act", by_name.get("mlp_in"))
        if end is None:
            return
        nbytes = (m.mlp.num_matrices - 1) * d.n * m.d_ff / d.tp * self.act
        self.mem(first_op, MemoryCategory.TEMPORARIES, nbytes)
        self.mem(end, MemoryCategory.TEMPORARIES, -nbytes)

    def recomputed_set(self, layer: int):
        """What a layer's backward holds after recomputing its forward (the set a backward
        fused with its forward reads: no stacked f32 residuals)."""
        return self._per_kind(("recomputed", self.layer_is_moe(layer)), lambda: saved_tensors(
            self.layer_shape(layer), remat="none", attention=self.cfg.attention,
            act_bytes=self.act, stacked=False))

    def mlp_side_bytes(self, layer: int) -> tuple[float, float]:
        """(copies of stack entries, recomputed tensors) of a dense layer's backward whose last
        reader is the MLP's backward (the mid residual, the MLP norm's output and statistics,
        the MLP's hidden and activation outputs, the attention's output projection the mid
        residual is rebuilt from): what dies with the MLP's weight-gradient matmul under
        `full` and `minimal`. Source: XLA's live ranges at the score gradient of the
        `benchmarks/xla_memory.py` programs (v6e fsdp=16 `full` and `minimal`, the data x
        fsdp programs): no tensor of the MLP's width is live there. Under `offload` (v5e and
        v6e fsdp=16) XLA schedules the MLP's weight-gradient matmuls after the attention's
        backward and they live through it, and so does v5e's compiler under `full` and
        `minimal` with windowed gathers (`mlp_grad_after_attention`: the gate, up and gated
        product, 3 x tokens x d_ff bf16, at the score gradient of the seven windowed v5e
        `full` and `minimal` programs, one or two sequences per chip; read off six, the
        seventh compiled after), and every compiler with int8 weight matmuls (the gate and up
        outputs and their gradients at the score gradient of every `validation/xla_int8.py`
        compile, `xla_rules.mlp_grads_after_attention`); MoE layers keep theirs too (not
        measured)."""
        if self.cfg.remat_plan.rule not in ("full", "minimal") or self.layer_is_moe(layer) \
                or self.m.parallel_block or self.mlp_grads_last:
            return 0.0, 0.0
        side = {"residual_mid", "norm_mlp_stats", "norm_mlp_out", "mlp_hidden", "mlp_act_out",
                "attn_out_proj"}
        saved = {t.name: t.num_bytes for t in self.saved(layer)}
        copies = sum(b for name, b in saved.items() if name in side)
        recomputed = sum(t.num_bytes for t in self.recomputed_set(layer)
                         if t.name in side and t.name not in saved)
        return copies, recomputed

    def saved_bytes(self, layer: int, remat: Remat | None = None) -> float:
        """HBM one layer's saved activations take between its forward and its backward (with
        `remat`, those of that policy instead of the run's)."""
        return sum(t.num_bytes for t in self.saved(layer, remat))

    def offloaded(self, layer: int):
        """The tensors the remat policy moves to host memory per layer (and fetches back)."""
        return self._per_kind(("offloaded", self.layer_is_moe(layer)),
                              lambda: self._offloaded(layer))

    def _offloaded(self, layer: int):
        plan = self.cfg.remat_plan
        if not plan.legacy:
            return named_tensors(self.layer_shape(layer), plan.host, act_bytes=self.act,
                                 attention=self.cfg.attention)
        return offloaded_tensors(self.layer_shape(layer), attention=self.cfg.attention,
                                 act_bytes=self.act, remat=plan.rule)

    def offload_bytes(self, layer: int) -> float:
        """Bytes the remat policy moves to host memory per layer (and fetches back)."""
        return sum(t.num_bytes for t in self.offloaded(layer)) if self.cfg.remat_plan.offloads \
            else 0.0

    def activation_peak(self) -> float:
        """Saved activations at their peak: every layer of the stage, times the microbatches
        in flight on a pipeline stage."""
        cfg, d = self.cfg, self.d
        inflight = min(cfg.microbatches, d.pp) if cfg.pipeline_schedule != "gpipe" else \
            cfg.microbatches
        saved_stage = sum(self.saved_bytes(layer) for layer in range(d.layers))
        return saved_stage * (inflight if d.pp > 1 else 1)
