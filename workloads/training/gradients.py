"""The step's gradient reductions: each layer's weight gradients summed over their FSDP groups
(reduce-scatters, windowed rings or whole-gradient all-reduces, as `xla_rules` decides), then
over the data-parallel axes (one all-reduce per layer, or per matrix across slices), the HBM
the local gradient shards and the whole gradients take, and the final all-reduce of the
replicated norm scales' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workloads.memory import MemoryCategory
from workloads.training import xla_rules as xla
from workloads.training.program import MTP_PROJ, ProgramBuilder


@dataclass(slots=True)
class StepState:
    """What the step's microbatches share: the embedding's sizes and lookup form, the weight
    cast, and what each microbatch leaves for the next and for the update."""

    emb_w: float  # one vocabulary matrix (the output projection) at the gather dtype
    emb_all: float  # every embedding parameter at the gather dtype
    # The input table is read by an all-to-all of the activations instead of being gathered
    # (`xla_rules.embedding_lookup_alltoall`; never in a later pipeline chunk, whose input
    # activations arrive from the previous one).
    lookup_a2a: bool
    cast: int | None  # the weight cast to --gather-dtype (None: no cast, or after the update)
    p_cast: float  # parameters the cast converts
    prev_compute: int | None = None  # the previous microbatch's last compute op
    last_grad_ops: list[int] = field(default_factory=list)  # what the update waits for
    grads_allocated: float = 0.0  # local gradient shards allocated so far
    # Norm-scale gradient bytes already summed over the data-parallel axes per layer
    # (`dp_split_per_matrix`); the rest goes with the final norm reduction.
    layer_norms_reduced: float = 0.0
    layer_outputs: dict[tuple[int, int], int] = field(default_factory=dict)  # (mb, layer)
    table_reduced: bool = False  # the input table's gradient all-reduced whole (data axis)
    # An untied input table gathered over its FSDP shards for the lookup (`embed_lookup`
    # all-gather): its gradient is computed whole and reduce-scattered over them.
    lookup_gathered: bool = False
    gathered_grad_held: float = 0.0  # that table's whole gradient, held until the update


class GradientReductions(ProgramBuilder):
    """The collectives that sum the step's gradients, and the HBM their buffers take."""

    def reduce_layer_gradients(self, st: StepState, mb: int, layer: int, out: int
                               ) -> list[int]:
        """Gradient reduce-scatters over each matrix's FSDP group (one per matrix; a windowed
        one is a ring of N + 1 messages), then all-reduce over data (async), after the layer's
        backward `out`. Returns the reductions the next layer's backward waits for."""
        cfg, d = self.cfg, self.d
        dp_wait: list[int] = []
        fse = self.fsdp_shards
        grad_bytes = self.layer_weight_bytes(self.layer_is_moe(layer), layer) / self.wc * self.gb
        expert_b = self.layer_expert_weight_bytes(layer) / self.wc * self.gb
        rs_ops, rs_of, sync_ops = self.fsdp_gradient_reductions(layer, out)
        rs = rs_ops[-1] if rs_ops else None
        local_grad = ((grad_bytes - expert_b) / fse + expert_b / d.fs) \
            / self.gb * self.gh
        if mb == 0:  # the local gradient shard lives from here until the update
            self.mem(rs if rs is not None else out, MemoryCategory.GRADIENTS, local_grad)
            st.grads_allocated += local_grad
        if mb == cfg.microbatches - 1:
            # Weights are replicated over data and sequence: their gradient shards are
            # summed over those axes too.
            dps = self.dp_gradient_reductions(st, layer, out, rs_ops, rs_of, grad_bytes,
                                              expert_b)
            st.last_grad_ops += rs_ops + dps
            if cfg.dp_allreduce == "blocking" and d.dp > 1:
                # Without XLA's data-parallel all-reduce overlap the layer's gradient
                # reduction (over fsdp, then data) finishes before the next layer's
                # backward starts (only with a data axis: the data-parallel overlap
                # flags concern the data-parallel reduction).
                dp_wait = dps
        else:
            st.last_grad_ops += rs_ops
        # XLA's synchronous all-reduces: the core runs them right after the layer's
        # weight-gradient matmuls, before the next layer's backward (with --fsdp-grad
        # all-reduce, and in the mixed modes over more than XLA_MAX_WINDOWED_RING
        # chips: the v6e and v5e fsdp=64 and v6e fsdp=256 FORM_PROBES have top-level
        # synchronous all-reduces, no -start).
        return dp_wait + sync_ops

    def fsdp_gradient_reductions(self, layer: int, out: int
                                 ) -> tuple[list[int], dict[str, int], list[int]]:
        """One reduction per weight matrix of the layer over its FSDP group, after the layer's
        backward `out`: (the ops, matrix -> its op, the synchronous all-reduces among them)."""
        G = MemoryCategory
        rs_ops: list[int] = []
        rs_of: dict[str, int] = {}  # matrix -> its reduction over fsdp
        sync_ops: list[int] = []  # the synchronous all-reduces among them
        # A gradient XLA all-reduces whole is written whole by its weight-gradient
        # matmul and lives until the all-reduce has read it (the update slices the
        # chip's shard out): the MLP's from the MLP's weight-gradient matmul, the
        # output and value projections' from before the attention's score gradient,
        # the query and key projections' from after it, to the layer's combined
        # all-reduce; one of XLA_ALLREDUCE_ALONE_BYTES or more is all-reduced alone
        # right after its matmul, and is not held (docs/model.md "Memory").
        whole_from = {"wo": self.attn_early_grads_done, "wv": self.attn_early_grads_done,
                      "wq": self.attn_weights_done, "wk": self.attn_weights_done,
                      "router": self.router_grad_done,
                      **{k: self.attn_weights_done for k in ("wq_a", "wq_b", "wkv_a", "wkv_b",
                                                             MTP_PROJ)}}
        for key, nbytes in self.layer_matrices(layer) if self.fsdp_shards > 1 else []:
            axes, group = self.fsdp_group(key)
            kind = self.grad_kind_for(group)
            op = self.coll(f"fsdp_grad_{kind.replace('-', '')}_{key}", kind, axes,
                           nbytes / self.wc * self.gb
                           * (self.ring(group, "reduce-scatter", key)
                              if self.rs_windowed_for(group) else 1.0),
                           [out], layer, "bwd")
            if op is not None:
                rs_ops.append(op)
                rs_of[key] = op
                if kind == "all-reduce":
                    sync_ops.append(op)
                    whole = nbytes / self.wc * self.gb
                    if not xla.allreduced_alone(whole):
                        self.mem(whole_from.get(key, self.mlp_weights_done),
                                 G.WHOLE_GRADIENTS, whole)
                        self.mem(op, G.WHOLE_GRADIENTS, -whole)
        return rs_ops, rs_of, sync_ops

    def dp_gradient_reductions(self, st: StepState, layer: int, out: int, rs_ops: list[int],
                               rs_of: dict[str, int], grad_bytes: float,
                               expert_b: float) -> list[int]:
        """The layer's gradient shards summed over the data-parallel axes (data, sequence),
        after their reductions over fsdp; returns the all-reduces."""
        d = self.d
        after = rs_ops or [out]
        if self.dp_split_per_matrix:
            # Across slices XLA sends one all-reduce per weight matrix (its gradient
            # shard, after that matrix's reduction over fsdp) and one for the
            # layer's norm scales (f32), never combined; the chip's DCN endpoint
            # handles their messages one after another, so each waits for the one
            # before (benchmarks/xla_dcn_schedule.py, docs/model.md).
            dps: list[int] = []
            for key, nbytes in self.layer_matrices(layer):
                dep = [rs_of[key]] if key in rs_of else [out]
                op = self.coll(f"dp_grad_allreduce_{key}", "all-reduce",
                               ("data", "sequence"),
                               nbytes / self.wc * self.gb / self.fsdp_group(key)[1],
                               dep + dps[-1:], layer, "bwd")
                if op is not None:
                    dps.append(op)
            op = self.coll("dp_grad_allreduce_norms", "all-reduce",
                           ("data", "sequence"), self.layer_norm_grad_bytes(),
                           [out] + dps[-1:], layer, "bwd")
            if op is not None:
                dps.append(op)
                st.layer_norms_reduced += self.layer_norm_grad_bytes()
            return dps
        fse = self.fsdp_shards
        return [o for o in (
            self.coll("dp_grad_allreduce", "all-reduce", ("data", "sequence"),
                      (grad_bytes - expert_b) / fse, after, layer, "bwd"),
            self.coll("dp_grad_allreduce_experts", "all-reduce",
                      ("data", "sequence"), expert_b / d.fs, after, layer,
                      "bwd")) if o is not None]

    def norm_gradient_reductions(self, st: StepState) -> None:
        """The norm scales are replicated: their gradients are summed over fsdp and expert (and
        tensor, if the activations are sharded over it; replicated ones give equal gradients
        on every tensor shard) in one all-reduce (XLA combines them; f32), over the
        data-parallel axes too when there is an FSDP axis (the v6e data x fsdp program: one
        all-reduce over data x fsdp), else with the embedding's gradients
        (`dp_grad_allreduce_embed`)."""
        nrm_axes = ("fsdp", "expert", "tensor") if self.tp_sharded else ("fsdp", "expert")
        if self.dp_split_per_matrix:
            # Across slices the layers' norm scales went over the data-parallel axes with their
            # layer (`dp_grad_allreduce_norms`); the rest (the final norm's) goes here, after
            # the reduction over fsdp and expert of them all.
            nrm = self.coll("norm_grad_allreduce", "all-reduce", nrm_axes,
                            self.norm_grad_bytes(), [st.prev_compute], -1, "bwd")
            rest = self.coll("dp_grad_allreduce_norms", "all-reduce", ("data", "sequence"),
                             self.norm_grad_bytes() - st.layer_norms_reduced,
                             [nrm if nrm is not None else st.prev_compute], -1, "bwd")
            st.last_grad_ops += [o for o in (nrm, rest) if o is not None]
        else:
            nrm = self.coll("norm_grad_allreduce", "all-reduce",
                            ("data", "sequence", *nrm_axes) if self.fsdp_shards > 1
                            else nrm_axes,
                            self.norm_grad_bytes(), [st.prev_compute], -1, "bwd")
            if nrm is not None:
                st.last_grad_ops.append(nrm)
