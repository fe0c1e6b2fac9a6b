"""An MoE layer's program (the parts of `layer.LayerProgram` that only MoE layers have): the
router, the dispatch over `expert` in its all-to-all or all-gather form
(`xla_rules.moe_dispatch_form`, docs/model/moe.md), the routed and shared experts, the combine,
and their backward up to and after the experts' (the experts' own backward is the MLP's,
`LayerProgram.mlp_backward`).
"""

from __future__ import annotations

from workloads.memory import MemoryCategory
from workloads.moe import dispatch_flops
from workloads.training import xla_rules as xla
from workloads.training.program import ProgramBuilder, Q


class MoeProgram(ProgramBuilder):
    """The MoE sublayer's ops, forward and backward."""

    @property
    def moe_gathered(self) -> bool:
        """The MoE layers dispatch in the all-gather form (`xla_rules.moe_dispatch_form`) over
        an expert axis."""
        return self.d.ep > 1 and xla.moe_dispatch_form(self.cfg) == "all-gather"

    def moe_combine_reduce(self, tag, dep, layer, phase) -> int:
        """The dropless all-gather form's combine (MaxText's ring of experts): every chip's
        partial sums for the expert group's tokens reduce-scattered over `expert` back to the
        tokens' chips (the op itself when the layer dispatches by all-to-alls)."""
        if not self.moe_gathered:
            return dep
        d = self.d
        red = self.coll(f"{tag}ep_combine_reducescatter", "reduce-scatter", ("expert",),
                        d.ep * d.n * self.m.d_model * self.act, [dep], layer, phase)
        return red if red is not None else dep

    # The all-gather form's gathered buffers of the recomputation held to the MoE backward
    # ([op id, bytes] each; `hold_gathered`, `release_gathered`).
    _moe_held: tuple = ()

    def hold_gathered(self, tok, tok_bytes, mag, mask_bytes) -> None:
        """The all-gather form on the dense dispatch path under remat (docs/model/moe.md "The
        dispatch form"): the recomputation's gathered tokens (`ep n D`, bf16) and gathered
        masks (`ep n E cap`, bf16) are held from their gathers to the end of the layer's MoE
        backward, which reads them (the experts' and the dispatch's backward). Source: XLA's
        live ranges in the v6e fsdp=4 x expert=4 compile of `validation/xla_moe_dispatch.py`
        (workloads/hlo/memory.py on the kept module): at its peak, the experts' backward in the
        layer loop, the recomputation's gathered masks (80 MiB) and tokens (16 MiB) are live,
        the masks from their gather to the experts' backward, the tokens to the dispatch's;
        the same module's output gradient gathered over `expert` (16 MiB) is live there too
        (`moe_output_backward`)."""
        held = tuple((op, b) for op, b in ((tok, tok_bytes), (mag, mask_bytes))
                     if op is not None)
        for op, b in held:
            self.mem(op, MemoryCategory.TEMPORARIES, b)
        self._moe_held = self._moe_held + held

    def release_gathered(self, op) -> None:
        """Free what `hold_gathered` (and the output gradient's gather) hold, when `op` ends."""
        total = sum(b for _o, b in self._moe_held)
        self._moe_held = ()
        self.mem(op, MemoryCategory.TEMPORARIES, -total)

    def moe_route(self, layer, dep, phase, tag) -> list[int]:
        """An MoE layer's router and dispatch, up to the experts' input: the ops the expert
        matmuls wait for (the dispatch and, as the form has it, its collective)."""
        m, d, a = self.m, self.d, self.act
        n, D = d.n, m.d_model
        E = m.num_experts
        rt = self.routing
        rows = rt.expert_rows_per_token
        # The all-gather form (`moe_gathered`, docs/model/moe.md "The dispatch form"):
        # the expert group's tokens are gathered and each chip runs its own experts on
        # all of them. On the dense dispatch path the masks are built from the chip's own
        # tokens and gathered too, forward and in the recomputation, whose router runs on
        # the gathered tokens (the compiled program's dot FLOPs: (ep - 1) x 3 router
        # matmuls' more per layer than the all-to-all form's, recomputation and backward).
        # Dropless (MaxText's ring of experts) the router's logits are gathered with the
        # tokens.
        gathered = self.moe_gathered
        ng = n * d.ep if gathered else n
        on_group = gathered and rt.dense_dispatch and tag == "re-"
        nr = ng if on_group else n  # the tokens the router runs on
        tok = None
        if gathered:
            tok = self.coll(f"{tag}ep_token_allgather", "all-gather", ("expert",),
                            ng * D * a, [dep], layer, phase)
        router = self.mm(f"{tag}router", 2 * nr * D * E, D * E * self.wc, nr * D * a,
                         nr * E * 4, [tok if on_group and tok is not None else dep],
                         layer, phase, keys=("router",), acc_bytes=nr * E * 4)
        topk = self.vpu(f"{tag}topk_route", 4 * nr * E, nr * E * 4, [router], layer, phase)
        pre = topk
        tok_deps = [tok] if tok is not None else []
        if rt.dense_dispatch:
            # MaxText's dropping path: one-hot dispatch and combine masks [tokens, experts,
            # capacity] (bf16), then the dispatch einsum BSM,BSEC->EBCM on the MXU.
            mask = n * E * rt.capacity * a
            masks = self.vpu(f"{tag}moe_masks", 2 * n * E * rt.capacity, 2 * mask, [topk],
                             layer, phase)
            mdeps = [masks]
            if gathered:
                mag = self.coll(f"{tag}ep_mask_allgather", "all-gather", ("expert",),
                                d.ep * n * E * rt.capacity * a, [masks], layer, phase)
                mdeps += [mag] if mag is not None else []
                if tag == "re-":
                    self.hold_gathered(tok, d.ep * n * D * a, mag, d.ep * n * E * rt.capacity * a)
            # Gathered, a chip's experts read their slots of every gathered token's mask.
            pre = self.mm(f"{tag}moe_dispatch", dispatch_flops(n, E, rt.capacity, D), 0.0,
                          n * E * rt.capacity * a + ng * D * a, n * rows * D * a,
                          mdeps + tok_deps, layer, phase)
        elif gathered:
            lag = self.coll(f"{tag}ep_logits_allgather", "all-gather", ("expert",),
                            ng * E * 4, [topk], layer, phase)
            pre = lag if lag is not None else topk
        disp = None if gathered else self.coll(f"{tag}ep_dispatch", "all-to-all",
                                                ("expert",), n * rows * D * a * d.ep, [pre],
                                                layer, phase)
        if gathered and not rt.dense_dispatch:
            disp = tok
        return [pre] + ([disp] if disp is not None else [])

    def moe_forward(self, layer, dep, wdeps, phase, tag, after=(), dead_tail=False,
                    kept_in=False):
        """An MoE sublayer's forward (`LayerProgram.mlp_forward`): the router, the dispatch
        (all-to-all or all-gather form), the routed and shared experts and the combine."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        mats = m.mlp.num_matrices
        E, k, F = m.num_experts, m.experts_per_token, m.expert_d_ff
        rt = self.routing
        # Rows the (busiest) chip's experts process per local token: k when routing is
        # uniform and dropless, k x the hottest shard's load factor under skew, E x
        # capacity / group tokens on the dense dropping path (padded to capacity).
        rows = rt.expert_rows_per_token
        x = self.moe_route(layer, dep, phase, tag)
        gathered = self.moe_gathered
        ng = n * d.ep if gathered else n
        w_bytes = (E / d.ep) * mats * D * F / tp * self.wc
        # A recomputation whose experts' hidden outputs were kept (`mlpwi`) reruns only
        # their activation.
        h = x[-1] if kept_in else self.mm(
            f"{tag}expert_in", 2 * n * rows * D * F * (mats - 1) / tp,
            w_bytes * (mats - 1) / mats, n * rows * D * a,
            n * rows * F * (mats - 1) / tp * a, x + wdeps, layer, phase,
            keys=("expert_gate", "expert_up"),
            acc_bytes=n * rows * F * (mats - 1) / tp * a,
            q=Q(act=n * rows * D, weight=w_bytes * (mats - 1) / mats / self.wc,
                out=n * rows * F * (mats - 1) / tp, k=D))
        act = self.vpu(f"{tag}expert_act", 8 * n * rows * F / tp,
                       n * rows * F * (mats - 1) / tp * a + n * rows * F / tp * a,
                       [h, *after], layer, phase)
        o = self.mm(f"{tag}expert_out", 2 * n * rows * F * D / tp, w_bytes / mats,
                    n * rows * F / tp * a, n * rows * D * a, [act] + wdeps, layer, phase,
                    keys=("expert_down",), whole_bytes=n * rows * F / tp * a,
                    q=Q(act=n * rows * F / tp, weight=w_bytes / mats / self.wc,
                        out=n * rows * D, k=F / tp))
        # A recomputation on the dense dropping path does not send the experts' outputs
        # back: XLA computes the combine weights' gradient where they live (expert-sharded)
        # and sends that gradient instead (`layer_backward`; the compiled program of
        # benchmarks/xla_moe_schedule.py).
        # Gathered on the dense dispatch path XLA still sends the experts' outputs back by an
        # all-to-all for the combine (cheaper than reducing the group's partial sums).
        comb = None if (dead_tail and rt.dense_dispatch) or \
            (gathered and not rt.dense_dispatch) else \
            self.coll(f"{tag}ep_combine", "all-to-all", ("expert",),
                      n * rows * D * a * d.ep, [o], layer, phase)
        out_deps = [o] + ([comb] if comb is not None else [])
        if m.num_shared_experts:
            sF = m.num_shared_experts * F
            live = (mats - 1) / mats if dead_tail else 1.0  # its down projection is dead
            sh = self.mm(f"{tag}shared_expert", 2 * n * D * sF * mats / tp * live,
                         mats * D * sF / tp * self.wc * live, n * D * a,
                         n * D * a if not dead_tail else n * sF * (mats - 1) / tp * a,
                         [dep] + wdeps, layer, phase,
                         keys=("shared_gate", "shared_up") + (() if dead_tail
                                                               else ("shared_down",)),
                         acc_bytes=n * sF * (mats - 1) / tp * a,
                         whole_bytes=0.0 if dead_tail else n * sF / tp * a,
                         q=Q(act=n * D + (0.0 if dead_tail else n * sF / tp),
                             weight=mats * D * sF / tp * live,
                             out=n * sF * (mats - 1) / tp + (0.0 if dead_tail else n * D),
                             k=D))
            out_deps.append(sh)
        if dead_tail:
            # The experts' outputs (back at their tokens) are read by the backward of the
            # combine weights (the router's gradient); the weighted sum itself is dead.
            self.recompute_leaves.extend(out_deps[:-1])
            return out_deps[-1]
        if rt.dense_dispatch:
            # The combine einsum EBCM,BSEC->BSM weights and sums the experts' outputs.
            cmb = self.mm(f"{tag}moe_combine", dispatch_flops(n, E, rt.capacity, D), 0.0,
                          n * E * rt.capacity * a + n * rows * D * a, n * D * a, out_deps,
                          layer, phase)
            if not m.num_shared_experts:
                return cmb
            return self.vpu(f"{tag}expert_combine", n * D, 3 * n * D * a, [cmb, sh], layer,
                            phase)
        if gathered:
            # Each chip sums its own experts' outputs for every gathered token (MaxText's
            # ring of experts: `use_ring_of_experts`), then the partial sums are
            # reduce-scattered over `expert`.
            part = self.vpu(f"{tag}expert_combine", 2 * n * rows * D, n * rows * D * a
                            + ng * D * a, out_deps[:1], layer, phase)
            red = self.moe_combine_reduce(tag, part, layer, phase)
            if not m.num_shared_experts:
                return red
            return self.vpu(f"{tag}expert_shared_add", n * D, 3 * n * D * a, [red, sh],
                            layer, phase)
        return self.vpu(f"{tag}expert_combine", 2 * n * k * D, (k + 1) * n * D * a,
                        out_deps, layer, phase)

    def moe_output_backward(self, layer, deps, grad) -> tuple[list[int], int | None]:
        """An MoE layer's backward up to its experts': the combine einsum's (dense dispatch)
        and the combine all-to-all's transpose. Returns (deps of the experts' backward, the
        combine einsum's backward op or None)."""
        m, d, a = self.m, self.d, self.act
        n, D = d.n, m.d_model
        rt = self.routing
        cb = None
        gathered = self.moe_gathered
        if gathered and not rt.dense_dispatch:
            # The all-gather form: the output gradient gathered over `expert` (the transpose
            # of the combine's reduce-scatter) for every chip's experts; no all-to-all.
            gout = self.coll("ep_grad_allgather", "all-gather", ("expert",), d.ep * n * D * a,
                             [grad] if grad is not None else list(deps), layer, "bwd")
            return list(deps) + ([gout] if gout is not None else []), None
        if rt.dense_dispatch:
            # Combine einsum backward: gradients of the expert outputs and of the combine
            # weights (the router's gradient), two einsums of the forward's size. XLA computes
            # the combine weights' gradient where the experts' outputs live (sharded over
            # expert): the output gradient is first gathered over `expert` (every chip of an
            # expert group needs its fsdp group's sequences; async under the recipes'
            # collective-fusion flags), and the result goes back to the tokens' chips with an
            # all-to-all at the end of the MoE backward (`ep_combine_weights_grad`).
            gout = self.coll("ep_grad_allgather", "all-gather", ("expert",), d.ep * n * D * a,
                             [grad] if grad is not None else list(deps), layer, "bwd")
            mask = n * m.num_experts * rt.capacity * a
            cb = self.mm("moe_combine_bwd", 2 * dispatch_flops(n, m.num_experts, rt.capacity, D),
                         0.0, mask + n * D * a + n * rt.expert_rows_per_token * D * a,
                         n * rt.expert_rows_per_token * D * a + mask,
                         list(deps) + ([gout] if gout is not None else []), layer, "bwd")
            deps = [cb]
            if gathered:
                if self._moe_held and gout is not None:
                    # The gathered output gradient is held with the recomputation's gathered
                    # buffers (`hold_gathered`): read again by the dispatch's backward.
                    self.mem(gout, MemoryCategory.TEMPORARIES, d.ep * n * D * a)
                    self._moe_held = self._moe_held + ((gout, d.ep * n * D * a),)
                return deps, cb
        # Transpose of the forward's combine all-to-all, before the experts' backward.
        comb = self.coll("ep_combine_bwd", "all-to-all", ("expert",),
                         n * rt.expert_rows_per_token * D * a * d.ep, deps, layer, "bwd")
        if comb is not None:
            deps = list(deps) + [comb]
        return deps, cb

    def moe_router_backward(self, layer, dmlp_w, dact, cb, ar1, sync
                            ) -> tuple[int | None, list[int]]:
        """An MoE layer's backward after its experts' weight gradients: the combine weights'
        gradient sent back (dense dispatch), the dispatch einsum's backward and the router's.
        Returns (the dispatch's backward op or None, deps of the MLP norm's backward)."""
        m, d, a = self.m, self.d, self.act
        n, D = d.n, m.d_model
        rt = self.routing
        dcomb_deps: list[int] = []
        gathered = self.moe_gathered
        ng = n * d.ep if gathered else n
        # The router's backward runs on the expert group's tokens on the dense dispatch path
        # of the all-gather form (as its recomputation), on the chip's own elsewhere.
        nr = ng if gathered and rt.dense_dispatch else n
        if rt.dense_dispatch and gathered:
            # The all-gather form: each chip has the combine weights' gradient of its own
            # experts for every gathered token; the top-k weights' gradient is summed over
            # `expert` ([tokens, k], bf16) for the router's backward, which runs there; the
            # dispatch's input gradient is each chip's experts' share of the gathered tokens'.
            tg = self.coll("ep_topk_grad_allreduce", "all-reduce", ("expert",),
                           ng * m.experts_per_token * a, [cb], layer, "bwd")
            dcomb_deps = [tg] if tg is not None else []
            ar1 = self.mm("moe_dispatch_bwd", dispatch_flops(n, m.num_experts, rt.capacity, D),
                          0.0, n * m.num_experts * rt.capacity * a
                          + n * rt.expert_rows_per_token * D * a, ng * D * a,
                          [dact] + ([ar1] if ar1 is not None else []), layer, "bwd")
        elif gathered:
            # Dropless (ring of experts): the gathered logits' gradient back to their chips.
            lg = self.coll("ep_logits_grad_reducescatter", "reduce-scatter", ("expert",),
                           ng * m.num_experts * 4, [dact], layer, "bwd")
            dcomb_deps = [lg] if lg is not None else []
        elif rt.dense_dispatch:
            # The combine weights' gradient back to the tokens' chips (synchronous: after the
            # experts' weight gradients, as XLA schedules it; async: as soon as it is
            # computed); the router's backward, and so the layer's input gradient, reads it.
            # MaxText builds the combine mask in the activation dtype (`generate_masks`: the
            # bf16 top-k weights times an int32 one-hot of the capacity slot, cut from cap + 1
            # slots to cap), so its gradient is bf16 and XLA sends it before the cut:
            # [tokens, E, cap + 1] (benchmarks/xla_moe_schedule.py, MaxText's router, at the
            # 750B's per-chip sizes and at the cross-check's).
            dc = self.coll("ep_combine_weights_grad", "all-to-all", ("expert",),
                           d.ep * n * m.num_experts * (rt.capacity + 1) * a,
                           [dmlp_w] if sync else [cb], layer, "bwd")
            dcomb_deps = [dc] if dc is not None else []
            # Dispatch einsum backward: the input gradient only (the one-hot mask has none).
            ar1 = self.mm("moe_dispatch_bwd", dispatch_flops(n, m.num_experts, rt.capacity, D),
                          0.0, n * m.num_experts * rt.capacity * a
                          + n * rt.expert_rows_per_token * D * a, n * D * a,
                          [dact] + ([ar1] if ar1 is not None else []), layer, "bwd")
        # The router's backward: the combine weights' gradient through the top-k softmax
        # into the router logits, then the router matmul's input and weight gradients,
        # twice its forward FLOPs (the compiled MoE step's dot FLOPs: without them tpusim
        # had 4 n D E per layer fewer). Issued after the dispatch's backward, which does
        # not wait for the combine weights' gradient (a chip runs its ops in order).
        E = m.num_experts
        rb = self.mm("router_bwd", 4 * nr * D * E, D * E * self.wc,
                     nr * D * a + nr * E * 4, nr * D * a, dcomb_deps or [dact], layer, "bwd",
                     keys=("router",), whole_bytes=nr * E * 4)
        self.router_grad_done = rb
        if gathered:
            # The gathered tokens' input gradient, partial sums of each chip's experts (and
            # router), reduce-scattered over `expert` back to the tokens' chips: the
            # transpose of the token gather.
            rs = self.coll("ep_token_grad_reducescatter", "reduce-scatter", ("expert",),
                           ng * D * a, [rb] + ([ar1] if ar1 is not None else [dact]), layer,
                           "bwd")
            if self._moe_held:
                self.release_gathered(ar1 if ar1 is not None else rb)
            return None, [rs if rs is not None else rb]
        return ar1, [rb]
