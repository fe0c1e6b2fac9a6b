"""The document's numbered list of unmodelled effects (docs/validation.md), every number in
it computed from the predictions, the fits and the cached XLA compiles (the MoE matched pair).
"""

from __future__ import annotations

import dataclasses
import json

from sim.chips import get_chip
from validation import xla_moe_pair
from validation.maxtext_fit import FitResult, best_mxu, objective, single_slice_twin
from validation.maxtext_predict import (
    MOE_COLLECTIVE_OPS,
    MOE_EINSUM_OPS,
    Prediction,
    async_step,
    attention_mxu_share,
    by_id,
    capacity_line,
    fsdp_bytes_per_s,
    implied_expert_efficiency,
    implied_mxu_efficiency,
    non_mxu_share,
    pct,
    per_sequence,
    predict,
    util_range,
    without_moe_costs,
)
from validation.maxtext_runs import (
    NAMED,
    Case,
    case_trace,
    with_changes,
)


def effects(good: list[Prediction], fits: list[FitResult] = (),
            low: list[Prediction] = ()) -> list[str]:
    """The numbered list of unmodelled effects, with numbers computed from the predictions."""
    ids = by_id(good)
    return (_tensor_effect(good, ids) + _slices_effect(ids, fits) + _moe_effect(good, ids)
            + _shapes_effect(good) + _memory_effect(good)
            + _gemma_effect(ids, fits, by_id(list(low))) + _dense_v6e_effect(good))


def _tensor_effect(good: list[Prediction], ids: dict[str, Prediction]) -> list[str]:
    """Effect 1: the tensor-parallel collectives."""
    out = []
    tp = [p for p in good if "tensor" in p.case.mesh]
    tp_txt = ", ".join(f"{p.case.model_label} on {p.case.chip} ({p.case.mesh_label}): "
                       f"{p.breakdown.get('exposed_comm_s', 0.0):.1f} s of {p.step_s:.1f} s"
                       for p in tp if p.case.num_slices <= 2 and p.case.id.endswith(
                           ("-1x-v5e-256", "feb2025")))
    f405, t405 = (ids.get("tpu-recipes-v6e-llama3.1-405b-2x-v6e-256"),
                  ids.get("tpu-recipes-v6e-llama3.1-405b-2x-v6e-256-fsdp-dcn-feb2025"))
    cmp405 = ""
    if f405 and t405:
        cmp405 = (f"; the tensor=4 405B run is "
                  f"{pct(t405.case.measured_step_s / f405.case.measured_step_s - 1)} slower "
                  f"than the FSDP-only one, predicted {pct(t405.step_s / f405.step_s - 1)}")
    out.append(
        "1. **Tensor-parallel collectives** (exposed communication: "
        f"{tp_txt or '-'}). The 128B v5e runs (fsdp16 x tensor16) reached 56% MFU against 60% "
        f"for the FSDP-only 64B of the same d_model{cmp405}. In tpusim the backward reductions "
        "over `tensor` overlap the weight-gradient matmuls (dX and dW are separate ops, as XLA "
        "schedules them), the incoming gradient's all-gather overlaps the recomputation and "
        "the recomputed layer's output reduction is dead code (not recomputed); the forward "
        "and the other recomputed all-gathers / reduce-scatters block the next matmul. XLA's "
        "async collective fusion (the recipes' `CF_FOR_ALL_GATHER` flags) may hide part of "
        "those; `--tp-comm collective-matmul` hides all of them.")
    return out


def _slices_effect(ids: dict[str, Prediction], fits: list[FitResult]) -> list[str]:
    """Effect 2: the slice-count slowdown on v5e (modelled)."""
    out = []
    rows = []
    for size in ("16b", "32b", "64b", "128b"):
        one = ids.get(f"maxtext-v5e-{size}-1x-v5e-256")
        many = ids.get(f"maxtext-v5e-{size}-32x-v5e-256")
        if one and many:
            meas = many.case.measured_step_s / one.case.measured_step_s - 1
            rows.append(f"{size.upper()} {pct(meas)} measured / "
                        f"{pct(many.step_s / one.step_s - 1)} predicted")
    dcn_txt = ""
    p64 = ids.get("maxtext-v5e-64b-32x-v5e-256")
    if p64:
        slow = predict(p64.case, get_chip("v5e").with_overrides(dcn_efficiency=0.05))
        dcn_txt = (f" It is not a bandwidth effect: `dcn_efficiency=0.05` moves the 32-slice 64B "
                   f"step by {pct(slow.step_s / p64.step_s - 1)}.")
        one64 = ids.get("maxtext-v5e-64b-1x-v5e-256")
        if one64:
            over = _variant(p64, "dp-async", dp_allreduce="async")
            dcn_txt += (
                " These runs' `LIBTPU_INIT_ARGS` (maxtext.md) do carry "
                "`--xla_tpu_enable_data_parallel_all_reduce_opt`, the flag of the recipes' "
                "`DATA_PARALLEL_OVERLAP`; what it does to these programs' schedule is not known "
                "here (no 2023 program was compiled). Read as an overlapped all-reduce "
                f"(`--dp-allreduce async`), the 32-slice 64B step is predicted "
                f"{pct(over.step_s / one64.step_s - 1)} over its 1-slice run (measured "
                f"{pct(p64.case.measured_step_s / one64.case.measured_step_s - 1)}): the "
                "blocking form is what reproduces the slowdown, and it is kept.")
    if rows:
        out.append(
            "2. **Slice-count slowdown on v5e (modelled).** From 1 to 32 slices: "
            + "; ".join(rows) + ". The measured slowdown is about 1 ms per layer per slice, "
            "nearly the same for the 16B and the 32B (same layer count, twice the gradient "
            "bytes): a per-message cost, not bandwidth." + dcn_txt + " tpusim reproduces it "
            "with the data-parallel gradient all-reduce blocking the next layer's backward "
            "(`--dp-allreduce blocking`; see below) and a per-message DCN overhead "
            "(`dcn_message_overhead_s`, fitted with the MXU factor on the odd half: 2(N-1) "
            "messages per all-reduce over N slices). Across slices `auto` takes only the ring "
            "and direct forms (2(N-1) messages), never halving-doubling (2 log2 N): the measured "
            "slowdown grows linearly in N, not as log N (docs/model.md), and with that rule the "
            "fitted overhead lies inside its grid (table above). The residual per-model offsets "
            "are effect 4." + _dcn_split_note(fits))
    return out


def _moe_effect(good: list[Prediction], ids: dict[str, Prediction]) -> list[str]:
    """Effect 3: the MoE runs are predicted slow, and everything checked about them."""
    moe = [p for p in good if p.case.model.is_moe]
    if not moe:
        return []
    c10 = ids.get("maxtext-custom-moe-750b-experimental-cf1.0-v6e-256")
    c15 = ids.get("maxtext-custom-moe-750b-final-cf1.5-v6e-256")
    return (_moe_checked(moe, c10, c15) + _moe_not_the_cause(good, moe) + _moe_at_size(c15)
            + _moe_pair() + _moe_runs_disagree(ids) + _moe_capacity(c10, c15)
            + _moe_experts(moe) + _moe_cost_bounds(good, moe))


def _moe_checked(moe: list[Prediction], c10: Prediction | None,
                 c15: Prediction | None) -> list[str]:
    """The MoE effect and what was checked and found as modelled."""
    out = []
    ratio = (f" (predicted {c15.step_s / c10.step_s:.2f})" if c10 and c15 else "")
    out.append(
        "3. **MoE runs are predicted slow.** " + ", ".join(
            f"{p.case.id.replace('tpu-recipes-v6e-', '').replace('maxtext-custom-', '')} "
            f"{pct(p.error)}" for p in moe)
        + ". The Mixtral runs use capacity factor 1.25 with dense one-hot einsum dispatch "
        "(`sparse_matmul=False`), the 750B runs capacity factor 1.0 / 1.5. tpusim simulates "
        "that path (`--capacity-factor`, docs/model.md \"MoE routing\"): experts padded to "
        "capacity, the dispatch/combine einsums against the [tokens, experts, capacity] "
        "mask, the padded all-to-alls; the 750B's measured cf-1.5 / cf-1.0 step ratio (1.31) "
        f"is reproduced{ratio}. What was checked, and found to be as modelled:"
    )
    out.append(
        "    * *The measured side.* MaxText's FLOP formula of the era (`matmul_noncausal`, in "
        "force until 2025-07-22; all five runs are older) counts the router and the top-k "
        "experts of `mlp_dim` per token, not the capacity padding, the dispatch/combine "
        "einsums or the recomputation (maxtext.md §1). The Mixtral log lines reproduce with "
        "it (computed / reported TFLOP 1.000), and the 750B's step times are its MFU read "
        "back through the same formula (7,494 TFLOP per chip and step, 6,017 of them weight "
        "matmuls). The 750B's MFU drop from 49.8% (cf 1.0) to 38.1% (cf 1.5) at one FLOP "
        "count is the padded work that formula leaves out; had it counted padding, the cf "
        "1.5 step would be 1.7x the cf 1.0 one. The reference is read right.")
    out.append(
        "    * *FLOPs against XLA.* A deviceless v6e compile of MaxText's dropping layer "
        "(`validation/xla_moe_schedule.py`: fsdp=4 x expert=4, two scanned layers, remat "
        "full) has, per layer, exactly tpusim's matmuls: 6 einsums of the dispatch's size "
        "(forward dispatch and combine, the recomputed dispatch, two for the combine's "
        "backward, one for the dispatch's) and 12 expert matmuls (forward, recomputation "
        "including the output projection, whose result the router's gradient reads, and "
        "the input and weight gradients). XLA's cost model prices the dispatch convolution "
        "at the cycles per FLOP of the layer's weight matmuls; the activation "
        "`silu(gate) x up` is a fusion of its own (as in tpusim).")
    out.append(
        "    * *Sharding and collectives.* Weights are now sharded as MaxText's rules shard "
        "them (every weight but the routed experts over fsdp x expert; checked on the same "
        "compile) and the collectives over `expert` are XLA's: six synchronous all-to-alls "
        "per layer, including the gradient of the combine weights in place of a "
        "recomputed combine all-to-all, and an all-gather of the output gradient "
        "(docs/model.md \"MoE routing\"). The same compile with MaxText's own mask "
        "construction, and again at the 750B's per-chip sizes on a v6e 16x16 (`--size "
        "750b`), has the same six all-to-alls (384 MiB per chip each at the 750B's sizes), "
        "but the combine weights' gradient in bf16, as MaxText builds the combine mask "
        "(it was modelled in f32, as the first cross-check program built it, at twice the "
        "bytes; the fix moved the 750B cf-1.5 step by -0.5 s). Each all-to-all costs its "
        "link-load bound on the expert ring, the textbook's `V / (4 W_ici)` (tpu.md §2; "
        "8.96 ms for the 750B's 6.44 GB): jax's device mesh, which MaxText's non-custom "
        "mesh is, puts the 16-way expert axis on one wrapped 16-chip ring (x = 0..15 in the "
        "750B-size compile), and `hybrid_ring_64x4` the 8x22B's 4-way axis on a 2x2 block, "
        "a 4-chip ring, where the bound is the same formula; exposed: "
        + ", ".join(f"{p.case.model_label} {p.case.mesh}: "
                    f"{p.breakdown.get('exposed_comm_s', 0.0):.1f} s of {p.step_s:.1f} s"
                    for p in moe if "expert" in p.case.mesh and p.case.capacity_factor
                    and p.case.capacity_factor < 1.5)
        + ". The sharding and the collectives over `expert` made the MoE predictions "
        "slower, not faster (the bf16 gradient made them 0.5 s faster again).")
    return out


def _moe_not_the_cause(good: list[Prediction], moe: list[Prediction]) -> list[str]:
    """What was checked and is not the cause."""
    out = []
    v6 = [p for p in good if p.case.chip == "v6e"]
    rate = {p.case.id: fsdp_bytes_per_s(p) for p in v6}
    lo = min(rate[p.case.id] for p in moe)
    hi = max(rate[p.case.id] for p in moe)
    near = [p for p in v6 if not p.case.model.is_moe and lo <= rate[p.case.id] <= hi]
    eff_moe = [implied_mxu_efficiency(p) for p in moe]
    eff_near = [implied_mxu_efficiency(p) for p in near]
    dense6 = [p for p in v6 if not p.case.model.is_moe]
    eff_dense = [implied_mxu_efficiency(p) for p in dense6]
    att_dense = [attention_mxu_share(p) for p in dense6]
    att_moe = [attention_mxu_share(p) for p in moe]
    out.append(
        "    * *Also checked, and not the cause.* The recomputed dispatch all-to-all is "
        "real: XLA re-runs it under remat (`rematted_computation` in both compiles; "
        "MaxText's custom policy saves only the tensors it names, the offloaded "
        "projections and the layer input, so the dispatch is recomputed as under full "
        "remat). The one-hot dispatch is no cheaper than a weight matmul in XLA's cost "
        "model at the 750B's sizes either (1.25x the query projection's cycles per FLOP, "
        "the combine 0.93x). The 750B's flash attention (blocks of 2048 at seq 8192) "
        "computes its diagonal blocks whole, 10 of 16 blocks where tpusim counts exactly "
        "half of the scores: counted so, its steps would be 0.49 s slower, not faster. "
        "Nor does communication per unit of compute separate them: the dense v6e runs "
        f"whose FSDP collectives move as many bytes per predicted second as the MoE runs' "
        f"({lo / 1e9:.0f}-{hi / 1e9:.0f} GB/s; {len(near)} runs) imply an MXU efficiency "
        f"of {min(eff_near):.2f}-{max(eff_near):.2f} (everything else as modelled), the "
        f"MoE runs {min(eff_moe):.2f}-{max(eff_moe):.2f}; nor does the attention's share "
        f"of the MXU time (the dense v6e runs imply {min(eff_dense):.2f}-"
        f"{max(eff_dense):.2f} with {100 * min(att_dense):.0f}% to "
        f"{100 * max(att_dense):.0f}% of it in attention, the MoE runs "
        f"{100 * min(att_moe):.0f}% to {100 * max(att_moe):.0f}%).")
    return out


def _moe_at_size(c15: Prediction | None) -> list[str]:
    """What XLA compiles at the runs' own sizes."""
    out = []
    out.append(
        "    * *What XLA compiles at the runs' own sizes (2026-12-01, jax/libtpu 0.10.2).* "
        "`xla_moe_schedule.py --size mixtral-8x22b` (the 8x22B's widths, fsdp=64 x "
        "expert=4 placed as its `hybrid_ring_64x4`, no flags, as its recipe lists none) and "
        "the `--size 750b` program, read with the script's table of collectives: every "
        "collective in both is synchronous but the permutes of the 750B's windowed "
        "einsums (its forward expert matmuls, over the 16-chip fsdp ring); the weights are "
        "gathered before their matmuls and again in the backward (the 750B's experts by "
        "three synchronous 512 MiB all-gathers per layer, where tpusim overlaps its "
        "gathers), and the 8x22B reduces every weight gradient by a synchronous all-reduce "
        "of the whole gradient (the experts' over their 64-chip fsdp group), as "
        "`--fsdp-grad auto` does over more than 32 chips. XLA's cost model gives the "
        "expert matmuls 1.13x (750B) and 1.17-1.29x (8x22B) the cycles per FLOP of the "
        "query projection, and the 750B's windowed forward experts 4.5x (each step adds a "
        "512-wide slice of the contraction into the whole output). What is not a "
        "matmul (masks, the activation, norms, softmax) is about 6% of the 750B-size "
        "layer's estimated cycles (windowed loops counted at their 8 trips), against "
        f"{100 * non_mxu_share(c15):.1f}% of tpusim's cf-1.5 step in HBM- and VPU-bound "
        "ops: tpusim charges nothing that XLA fuses away. Nothing in either "
        "program is cheaper than in tpusim's step: priced as XLA compiles and estimates "
        "them, the MoE steps would be slower still. With the recipes' async collective "
        "fusion flags (`CF_FOR_ALL_GATHER`: the Mixtral-8x7B widths at fsdp=256 with the "
        "March 2025 recipe's flags, and the 8x22B and the 750B as what-ifs, their runs "
        "recording no flags) the weight gathers become "
        "async fusions (all the 8x7B's expert gathers, all but one of the 8x22B's per "
        "pass, the 750B's three 512 MiB expert gathers of the backward among 11 of its 12 "
        "backward gathers), as tpusim overlaps them, while the all-to-alls and the "
        "whole-gradient all-reduces (2.9 GiB per 8x7B layer, 532 MiB per 750B layer) stay "
        "synchronous, as in `--fsdp-grad auto`. "
        "*SparseCore.* libtpu 0.10.2 has flags "
        "that offload collectives and gathers to v6e's SparseCores; compiled with them "
        "(the small program; the 8x22B's and the 750B's sizes): "
        "`--xla_tpu_enable_sparse_core_collective_offload_dense_all_to_all` (with or "
        "without `--xla_tpu_enable_sparse_core_async_all_to_all`) fails in the SparseCore "
        "all-to-all emitter (a `RET_CHECK` on `num_blocks_per_replica % kGroupSize`) for "
        "these all-to-alls, so they cannot be offloaded there as compiled; "
        "`--xla_tpu_enable_offloading_gather_to_sparsecore` moves only the routing's "
        "index gathers (u32[4096]) to the SparseCore, and "
        "`--xla_tpu_offload_convolution_to_sparsecore` leaves the program unchanged (the "
        "dispatch and combine einsums stay TensorCore convolutions). Without flags nothing "
        "runs on the SparseCores. No recipe of these runs lists any of these flags.")
    return out


def _moe_pair() -> list[str]:
    """XLA's cost model on the matched pair."""
    out = []
    pair = moe_pair()
    if pair:
        d, m = pair["llama2-70b"], pair["mixtral-8x7b"]

        def meas(o, side):
            return o[f"{side}_layers_noattn_s"] / o["measured_layers_noattn_s"]

        out.append(
            "    * *XLA's cost model on a matched pair (2026-12-01, jax/libtpu 0.10.2).* "
            "The Oct 2024 LLaMA-2-70B and Mixtral-8x7B recipes share the mesh (fsdp=256), "
            "remat (`full`), sequence and libtpu; compiled at their own widths and batches "
            "by the same decoder code (`xla_moe_pair.py`; \"The MoE matched pair against "
            "XLA's cost model\" below), XLA's `estimated_cycles` for the layers' compute "
            "but attention come to "
            f"{meas(d, 'xla'):.3f}x (LLaMA) and {meas(m, 'xla'):.3f}x (Mixtral) of the "
            "measured steps less what tpusim predicts besides (tpusim: "
            f"{meas(d, 'tpusim'):.3f}x and {meas(m, 'tpusim'):.3f}x)"
            + "".join(
                f"; with the recipes' scoped-VMEM limit (`{flag}`) XLA's estimates of "
                "the two fall alike (layer compute but attention x"
                + " and x".join(f"{rows[n]['layer but attention']:.3f}"
                                for n in ("llama2-70b", "mixtral-8x7b")) + "), so the "
                "comparison holds whether or not the runs set it"
                for flag, rows in moe_pair_variants() if len(rows) == 2)
            + ". XLA's static model "
            "gives the Mixtral's expert matmuls and dispatch no better cycles per FLOP "
            "than the LLaMA's weight matmuls, so it puts the MoE further above its "
            "measurement than tpusim does (with its estimates in tpusim's place, scaled "
            f"so the LLaMA stays exact: {pct(m['step_xla_noattn_s'] / m['measured_s'] - 1)}"
            "): no class of the MoE layer is costed by tpusim above what the compiler's own "
            "model gives it, and the compiled remat-full program computes per class the "
            "FLOPs tpusim's does, forward, recomputed and backward. The measured MoE layers "
            "ran faster than either static model of the compiled program says.")
    return out


def _moe_runs_disagree(ids: dict[str, Prediction]) -> list[str]:
    """The two Mixtral-8x7B runs against each other."""
    out = []
    pair_moe = (ids.get("tpu-recipes-v6e-mixtral-8x7b-v6e-256-oct2024"),
                ids.get("tpu-recipes-v6e-mixtral-8x7b-v6e-256"))
    pair_dense = (ids.get("tpu-recipes-v6e-llama2-70b-v6e-256-oct2024"),
                  ids.get("tpu-recipes-v6e-llama2-70b-v6e-256"))
    if all(pair_moe) and all(pair_dense):
        (mf, pf), (mc, pc) = (per_sequence(p) for p in pair_moe)
        (mfd, pfd), (mcd, pcd) = (per_sequence(p) for p in pair_dense)
        out.append(
            "    * *The two Mixtral-8x7B runs disagree with each other.* Per sequence the "
            f"full-remat run (Oct 2024, batch 8) took {mf:.3f} s and the offloading one "
            f"(Mar 2025, batch 12) {mc:.3f} s, {mf / mc:.3f}x; tpusim predicts {pf:.3f} s "
            f"and {pc:.3f} s ({pf / pc:.3f}x: full remat recomputes the attention "
            "projections too). The same two recipes' Llama2-70B runs (Oct 2024 full remat, "
            f"later qkv offload) agree with tpusim: measured {mfd / mcd:.3f}x, predicted "
            f"{pfd / pcd:.3f}x. The Mixtral pair's {100 * abs(mf / mc * pc / pf - 1):.0f}% "
            "disagreement lies between two MaxText / libtpu versions of the same MoE "
            "layer, not in the remat modelling, and no single MoE cost can fit both.")
    return out


def _moe_capacity(c10: Prediction | None, c15: Prediction | None) -> list[str]:
    """What grows with the capacity factor."""
    out = []
    if c10 and c15:
        m0, mk = capacity_line(c10, c15)
        p0, pk = capacity_line(c10, c15, (c10.step_s, c15.step_s))
        free = MOE_EINSUM_OPS + MOE_COLLECTIVE_OPS
        f0, fk = capacity_line(c10, c15, (without_moe_costs(c10, free),
                                          without_moe_costs(c15, free)))
        a0, ak = capacity_line(c10, c15, tuple(
            _variant(p, "fsdp-grad-rs", fsdp_grad="reduce-scatter").step_s
            for p in (c10, c15)))
        out.append(
            "    * *What grows with the capacity.* The two 750B runs differ only in the "
            "capacity factor (1.0 and 1.5; the cf-1.0 run's other settings are the "
            "reference's assumption, its doc says \"without updating sharding "
            "strategies\"). Read as a straight line in it, the measured "
            f"step is {m0:.2f} s at capacity 0 plus {mk:.2f} s per unit of capacity "
            f"factor, the predicted one {p0:.2f} s plus {pk:.2f} s: tpusim prices the work "
            "that grows with the capacity (the expert matmuls over the padded slots, the "
            "masks, the dispatch/combine einsums and the all-to-alls) "
            f"{pct(pk / mk - 1)} over the measurement and the rest (attention, router, "
            f"the weights' collectives) {pct(p0 / m0 - 1)}. The runs are rebuilt with the "
            "gradient collectives XLA compiles for the 750B (`--fsdp-grad auto`: attention "
            "and router gradients all-reduced whole over 256 chips, effect 7); with the "
            "async reduce-scatters they were rebuilt with before, the line would be "
            f"{a0:.2f} s plus {ak:.2f} s ({pct(a0 / m0 - 1)} on what does not grow "
            f"with the capacity, {pct(ak / mk - 1)} on what does). With the masks, "
            "dispatch/combine "
            "einsums and collectives over `expert` all made free the line is "
            f"{f0:.2f} s plus {fk:.2f} s per unit: the expert matmuls and their activation "
            "alone, at the shipped MXU factor, cost more per unit of capacity than the "
            "measured step grows; the measured slope implies that the MXUs ran them at no "
            "less than "
            f"{get_chip('v6e').mxu_efficiency * fk / mk:.2f} of peak even if everything "
            "else that grows with the capacity were free.")
    return out


def _moe_experts(moe: list[Prediction]) -> list[str]:
    """The experts' matmul efficiency each run would need."""
    out = []
    eff = [(p, implied_expert_efficiency(p), implied_expert_efficiency(p, "auto"))
           for p in moe]
    out.append(
        "    * *Could the experts' matmuls alone run faster?* The MXU efficiency the routed "
        "experts' matmuls (forward, recomputed and backward) would need, everything else "
        "as shipped, for each run's step to come out as measured: " + ", ".join(
            f"{p.case.id.replace('tpu-recipes-v6e-', '').replace('maxtext-custom-', '')} "
            f"{e:.2f}" for p, e, _ in eff)
        + f" ({min(a for *_, a in eff):.2f}-{max(a for *_, a in eff):.2f} with "
        "`--fsdp-grad auto`, the gradient collectives XLA compiles): no one value fits "
        "them all, and under XLA's gradient rule the highest would be "
        f"{max(a for *_, a in eff):.2f} of peak. A faster expert matmul could be part of "
        "the cause, not all of it.")
    return out


def _moe_cost_bounds(good: list[Prediction], moe: list[Prediction]) -> list[str]:
    """What the MoE-only costs weigh (a bound on what they could explain)."""
    out = []
    rows, both = [], []
    for p in moe:
        m = p.case.measured_step_s
        no_e = without_moe_costs(p, MOE_EINSUM_OPS)
        no_c = without_moe_costs(p, MOE_COLLECTIVE_OPS)
        no_b = without_moe_costs(p, MOE_EINSUM_OPS + MOE_COLLECTIVE_OPS)
        both.append(abs(no_b / m - 1))
        rows.append(f"{p.case.model_label} {p.case.mesh}"
                    + (f" cf {p.case.capacity_factor:g}" if p.case.capacity_factor else "")
                    + f" {p.case.maxtext_remat}: {pct(no_e / m - 1)} / {pct(no_c / m - 1)}"
                    f" / {pct(no_b / m - 1)}")
    out.append(
        "    * *What the MoE-only costs weigh.* The predicted error with the masks and "
        "dispatch/combine einsums made free / the collectives over `expert` made free / "
        "both (a bound on what they could explain, not a model): " + "; ".join(rows)
        + ". Asynchronous all-to-alls (`--ep-alltoall async`, libtpu's "
        "`--xla_tpu_enable_async_all_to_all`: compiled with it, XLA overlaps the backward "
        "transposes with the experts' input-gradient matmuls) move the expert-parallel "
        "runs by about a point: " + ", ".join(
            f"{p.case.model_label} {p.case.mesh}"
            + (f" cf {p.case.capacity_factor:g}" if p.case.capacity_factor else "")
            + f" {pct(async_step(p) / p.case.measured_step_s - 1)}"
            for p in moe if "expert" in p.case.mesh)
        + " (every all-to-all but the combine weights' gradient feeds the next matmul)."
        + f" With both gone every MoE run is within {100 * max(both):.1f}% of its "
        "measurement, as if the real steps paid almost none of the costs XLA's program "
        "has; no public fact "
        "found supports dropping them (the recipes' flags name no asynchronous all-to-all; "
        "the compiled dispatch is a full-price convolution). The measured MoE steps imply "
        f"that the MXUs ran tpusim's MoE matmuls (padding and dispatch included) at "
        f"{util_range(moe, 'v6e', moe=True)} of peak, the dense v6e runs at "
        f"{util_range(good, 'v6e', moe=False)}, before any exposed communication. One MXU "
        "factor per chip cannot be both; the cause is not found and no MoE-specific factor "
        "is added.")
    return out


def _shapes_effect(good: list[Prediction]) -> list[str]:
    """Effect 4: the MXU fraction depends on matmul shapes."""
    out = []
    e16 = [p.error for p in good if p.case.model_label == "maxtext-16b"]
    e32 = [p.error for p in good if p.case.model_label == "maxtext-32b"]
    if e16 and e32:
        out.append(
            "4. **The MXU fraction depends on matmul shapes.** One factor per chip cannot "
            "express that MaxText's 32B (d_model 10240) reached 67% MFU and the 16B (d_model "
            f"5120) 61%: the 32B runs are predicted {pct(min(e32))} to {pct(max(e32))}, the "
            f"16B ones {pct(min(e16))} to {pct(max(e16))}.")
    return out


def _memory_effect(good: list[Prediction]) -> list[str]:
    """Effect 5: memory (no effect on step times)."""
    out = []
    big = [p for p in good if not p.fits_in_hbm]
    seen: dict[str, Prediction] = {}
    for p in big:
        seen.setdefault(p.case.model_label, p)
    out.append(
        f"5. **Memory (no effect on step times).** {len(big)} usable runs exceed HBM in the "
        "simulator although they ran (" + ", ".join(
            f"{m}: {p.hbm_peak_gb:.0f} GB" for m, p in seen.items()) + "). With tensor "
        "parallelism the saved layer inputs are not divided over `tensor` (the 405B with "
        "tensor=4); the FSDP-only runs' peaks are their saved activations and logits at the "
        "recipes' batch sizes (not investigated further here; the XLA programs' peaks are "
        "checked in \"Peak HBM against XLA's compiled programs\" below). The 750B MoE ran "
        "plain SGD with bf16 weights and is simulated so (`--optimizer sgd`: no optimizer "
        "state): its 2.95B parameters per chip (every weight sharded over fsdp16 x expert16, "
        "as MaxText's rules shard them) take 5.9 GB of static state, where Adam's fp32 moments "
        "would add 23.6 GB.")
    return out




def _refit(cases: list[Case], gen: str, **changes) -> tuple[float, float, float, dict]:
    """The cases of generation `gen` rebuilt with `changes`, the MXU factor refitted on their odd
    half (every other factor shipped): (mxu, odd objective, even objective, {id: error})."""
    chip = get_chip(gen)
    mine = [with_changes(c, id=f"{c.id}#{'-'.join(map(str, changes.values()))}", **changes)
            for c in cases if c.chip == gen]
    m, obj_odd, _ = best_mxu([c for c in mine if c.fit_subset], chip, start=chip.mxu_efficiency)
    at = chip.with_overrides(mxu_efficiency=m)
    obj_even = objective([c for c in mine if not c.fit_subset], at)
    return m, obj_odd, obj_even, {c.id.split("#")[0]: predict(c, at).error for c in mine}


# v6e's overhead as fitted when its cross-slice gradient reduction was one all-reduce a layer
# (`--dp-grad-split per-layer`; docs/validation.md before 2026-12-01), ms per message.
PER_LAYER_V6E_MS = 3.5


def _dcn_split_note(fits: list[FitResult]) -> str:
    """Effect 2's closing: why the v5e runs send one cross-slice all-reduce a layer, and whether
    the two generations' per-message overheads come together."""
    odd = {f.generation: f for f in fits if f.subset == "odd" and f.custom_remat == NAMED}
    v5, v6 = get_chip("v5e"), get_chip("v6e")
    slow5 = (f" ({1e3 * min(odd['v5e'].dcn_slowdown_scan, key=lambda t: t[1])[0]:g} ms by "
             "v6e's slowdown method)" if "v5e" in odd and odd["v5e"].dcn_slowdown_scan else "")
    return (
        " The reduction crosses the slices as one all-reduce a layer here (`--dp-grad-split "
        "per-layer`, `DP_GRAD_SPLIT`), although today's XLA (jax/libtpu 0.10.2) sends one per "
        "weight matrix and one for the norm scales on v5e as on v6e "
        "(`python -m validation.xla_dcn_schedule --chip v5e`: 8 a layer, each waiting in its own "
        "backward iteration without the overlap flags). The 2023 programs cannot be compiled; "
        "that their compiler combined a layer's cross-slice reduction is an assumption, taken "
        "for three reasons. (a) Rebuilt per matrix (7 all-reduces a layer on these parallel "
        "blocks, one after another; 2026-12-01) the joint fit moves to 0.1 ms per message and "
        "MXU 0.78 and the held-out half gets worse (objective 0.0323 -> 0.0352; odd half "
        "0.0315 -> 0.0309), and the 32-slice slowdowns are over-predicted further (16B "
        "+17.9%, 32B +17.0%, 64B +34.6%, 128B +22.6%, against the measured ones above). (b) "
        "The same 2023 runs reduce their FSDP gradients as today's XLA does not (effect 7): "
        "their compiler is not today's. (c) With it the two generations' fitted costs per "
        f"DCN message come together: v5e {1e3 * v5.dcn_message_overhead_s:g} ms{slow5}, v6e "
        f"{1e3 * v6.dcn_message_overhead_s:g} ms per message of its per-matrix all-reduces "
        f"(effect 6; {PER_LAYER_V6E_MS:g} ms when v6e's were counted as one a layer, 7x "
        "v5e's), where with both per matrix they stay 5.5x apart (0.1 against 0.55 ms). So "
        "`dcn_message_overhead_s` reads as one per-message cost of the DCN endpoint on both "
        "generations, and the compiler's split is the run's setting (`--dp-grad-split`, "
        "per-matrix by default, as today's XLA compiles it).")


def _dense_v6e_effect(good: list[Prediction]) -> list[str]:
    """Effect 7: the gradient rule of the current-compiler (v6e) runs, XLA's choice per matrix
    (`--fsdp-grad auto`), against the async reduce-scatters it replaced, both refitted here;
    the dense v6e runs' error against their tokens per chip; the same rule on v5e."""
    v6 = [p for p in good if p.case.chip == "v6e"]
    dense = sorted((p for p in v6 if not p.case.model.is_moe),
                   key=lambda p: (p.case.seq_len * p.case.batch_per_chip, p.case.id))
    if not dense:
        return []

    def short(p: Prediction) -> str:
        return p.case.id.replace("tpu-recipes-v6e-", "").replace("maxtext-custom-", "")

    chip = get_chip("v6e")
    cases = [p.case for p in good]
    base_odd = objective([p.case for p in v6 if p.case.fit_subset], chip)
    base_even = objective([p.case for p in v6 if not p.case.fit_subset], chip)
    m_rs, rs_odd, rs_even, rs_err = _refit(cases, "v6e", fsdp_grad="reduce-scatter")
    m_ar, ar_odd, ar_even, ar_err = _refit(cases, "v6e", fsdp_grad="all-reduce")
    over = [p for p in v6 if abs(p.error) > 0.15]
    over_rs = [p for p in v6 if abs(rs_err[p.case.id]) > 0.15]
    all_reduced = [p for p in v6 if any(
        o.name.startswith("fsdp_grad_allreduce_") for o in case_trace(p.case)[0].ops)]
    listed = ", ".join(
        f"{short(p)} {p.case.seq_len * p.case.batch_per_chip:,} {pct(rs_err[p.case.id])} -> "
        f"{pct(p.error)}" for p in dense)
    moe_txt = ", ".join(f"{short(p)} {pct(rs_err[p.case.id])} -> {pct(p.error)}"
                        for p in v6 if p.case.model.is_moe)
    dense_errs = [p.error for p in dense]
    # v5e: the 2023 runs set the same async collective fusion flags (LIBTPU_INIT_ARGS), and
    # XLA's fsdp=64 probes all-reduce there too (docs/model.md); the rule refitted alike (the
    # DCN message overhead kept at its fitted value).
    v5 = [p for p in good if p.case.chip == "v5e"]
    v5_txt = ""
    if v5:
        chip5 = get_chip("v5e")
        b5o = objective([p.case for p in v5 if p.case.fit_subset], chip5)
        b5e = objective([p.case for p in v5 if not p.case.fit_subset], chip5)
        m5, o5, e5, err5 = _refit(cases, "v5e", fsdp_grad="auto")
        v5_txt = (
            "\n    * *v5e keeps its reduce-scatters.* The 2023 runs carry the same async "
            "collective fusion flags in their LIBTPU_INIT_ARGS, and today's XLA all-reduces "
            "at fsdp=64 on v5e too, but rebuilt with `--fsdp-grad auto` (every run but the "
            f"128B, whose FSDP group is 16, all-reduced) the v5e MXU factor refits to {m5:.2f} "
            f"and both halves get worse: odd {b5o:.4f} -> {o5:.4f}, held out {b5e:.4f} -> "
            f"{e5:.4f} (worst {100 * max(map(abs, err5.values())):.1f}%, now "
            f"{100 * max(abs(p.error) for p in v5):.1f}%). Those runs were compiled by the "
            "2023 XLA, whose programs cannot be compiled again; their step times are what says "
            "that it reduced the gradients in the background, and tpusim keeps that for them "
            "(`FSDP_GRAD`).")
    text = (
        "7. **The weight-gradient collectives of the current-compiler runs (modelled).** Every "
        "deviceless compile with jax/libtpu 0.10.2 reduces a weight gradient over an FSDP group "
        "of more than 32 chips by a synchronous all-reduce of the whole gradient (no "
        "reduce-scatter, no start/done pair, so in program order between the compute "
        "fusions; the update reads its shard from the result: twice a reduce-scatter's bytes, "
        "hidden behind nothing), each matrix by its own group: 2 LLaMA-2-70B layers at "
        "fsdp=256 with the llama2-70b recipe's flags, with and without "
        "`DATA_PARALLEL_OVERLAP`; the 750B MoE (attention and router split 256 ways "
        "all-reduced, routed experts split 16 ways reduced in rings; "
        "`python -m validation.xla_moe_schedule --size 750b`); Mixtral-8x7B widths at fsdp=256 "
        "(`--size mixtral-fsdp256`: every weight gradient, the 256-way-split experts' too); "
        "the Mixtral-8x22B's own sizes (`--size mixtral-8x22b`, fsdp=64 x expert=4); the "
        "fsdp=64 probes on v5e and v6e (docs/model.md). The v6e runs (tpu-recipes, "
        "2024-2025) are rebuilt so (`--fsdp-grad auto`, `FSDP_GRAD`): "
        f"{len(all_reduced)} of the {len(v6)} usable ones all-reduce some gradients. Against "
        "the async reduce-scatters they were rebuilt with before (MXU factor refitted on the "
        f"odd half: {m_rs:.2f}), the fit objective goes odd {rs_odd:.4f} -> {base_odd:.4f}, "
        f"held out {rs_even:.4f} -> {base_even:.4f} (shipped factor {chip.mxu_efficiency:.2f}), "
        f"and {len(over)} v6e runs are over 15% ({', '.join(short(p) for p in over) or 'none'}"
        f"; {len(over_rs)} with reduce-scatters). The dense v6e runs against each chip's "
        f"tokens per step (model, tokens, error with reduce-scatters -> with the rule): "
        f"{listed}. FSDP moves the same weight bytes per layer whatever the tokens, so fewer "
        "tokens mean more FSDP traffic per FLOP: with the reduce-scatters hidden the runs at "
        "few tokens per chip were predicted fast, and the synchronous all-reduces are what "
        f"they were missing; the dense runs now lie within {pct(min(dense_errs))} to "
        f"{pct(max(dense_errs))}. **The MoE consequence:** the MoE runs move further out "
        f"({moe_txt}); the rule is what XLA compiles for them too (the MoE compiles "
        "above), so what makes the measured MoE steps faster lies elsewhere (effect 3; one "
        "candidate not compiled: the recipes' `SPARSECORE_OFFLOAD_ALL_REDUCE` flags would run "
        "the all-reduces on v6e's SparseCores beside the TensorCore, and most MoE recipes do "
        "not list them). Every gradient all-reduced whole (`--fsdp-grad all-reduce`, also "
        f"over 16 and 32 chips, which no compile shows) refits to {m_ar:.2f}: odd "
        f"{ar_odd:.4f}, held out {ar_even:.4f}, {abs(base_odd - ar_odd):.4f} and "
        f"{abs(base_even - ar_even):.4f} from `auto`'s: the data cannot tell the two apart, "
        "and the compiles decide for `auto`."
        + v5_txt + "\n"
        "    * *Ruled out before the rule explained the dense runs' fast predictions* (checked "
        "by hand on the runs rebuilt with reduce-scatters; this script does not recompute "
        "these numbers). *HBM traffic of the collectives:* tpusim "
        "charges a collective's DMA to HBM (a chip reads what it sends and writes what it "
        "receives, a reduce-scatter step also reads its partial sum: about 2 V per "
        "all-gather and 3 V per reduce-scatter), shared max-min among the collectives (not "
        "with compute); at the full HBM rate that traffic is 1.3-10% of these steps and the "
        "matmuls, at thousands "
        "of FLOPs per byte, are nowhere near their HBM bound. *The TensorCore driving the "
        "async collective fusions:* XLA's cost model gives the matmul fusions that carry the "
        "recipes' fused all-gathers no extra cycles (a v6e 4x4 fsdp=16 compile of 2 "
        "LLaMA-3-8B layers: 27.09 ms of matmul fusions with the `CF_FOR_ALL_GATHER` flags, "
        "27.18 ms without). *ICI bandwidth:* a layer's weight gather at the textbook's "
        "two-axis rate takes about a quarter of the layer's forward matmuls at 6,144 tokens "
        "per chip (gpt3-175b) and less at more tokens; lowering `ici_efficiency` worsens the "
        "fit (the scan under \"Fitting the efficiency factors\").")
    return text.split("\n")


def _variant(p: Prediction, tag: str, **changes) -> Prediction:
    """The case of `p` rebuilt with `changes` (a what-if, under the shipped preset)."""
    return predict(with_changes(p.case, id=f"{p.case.id}#{tag}", **changes))


def _gemma_effect(ids: dict[str, Prediction], fits: list[FitResult] = (),
                  low: dict[str, Prediction] | None = None) -> list[str]:
    """Effect 6: the Gemma-3 runs (sliding-window attention), with what-ifs computed here."""
    runs = [ids.get(f"tpu-recipes-v6e-gemma3-12b-{k}x-v6e-256") for k in (1, 2, 4)]
    if not all(runs):
        return []
    one = runs[0]
    m = one.case.model
    full = _variant(one, "full-attention", model=dataclasses.replace(
        m, attention_window=None, global_layer_period=0))
    untiled = _variant(one, "untiled", vocab_tiling=1)
    blocks = _variant(one, "window-1536", model=dataclasses.replace(m, attention_window=1536))
    meas = [p.case.measured_step_s / one.case.measured_step_s - 1 for p in runs[1:]]
    pred = [p.step_s / one.step_s - 1 for p in runs[1:]]
    v6e = get_chip("v6e")
    shipped_ms = 1e3 * v6e.dcn_message_overhead_s
    bare = v6e.with_overrides(dcn_message_overhead_s=0.0)
    pred0 = [predict(p.case, bare).step_s / predict(one.case, bare).step_s - 1
             for p in runs[1:]]
    per_layer = [(p.case.measured_step_s - one.case.measured_step_s) / m.num_layers
                 / (p.case.num_slices - 1) for p in runs[1:]]
    v5e_ms = 1e3 * get_chip("v5e").dcn_message_overhead_s
    msgs = sum(1 for o in case_trace(runs[1].case)[0].ops
               if o.layer == 1 and o.name.startswith("dp_grad_allreduce"))
    shard = (m.attention_params_per_layer + m.dense_mlp_params_per_layer) / 256 * 2 / 1e6
    dcn = v6e.dcn_bytes_per_s
    text = (
        "6. **Gemma-3 12B (sliding-window attention, v6e, fsdp=256, seq 32768).** 1 / 2 / 4 "
        "slices: " + " / ".join(pct(p.error) for p in runs) + f". {m.num_local_layers} of the "
        f"{m.num_layers} layers attend to a {m.attention_window}-token window (a local query "
        f"at position p attends to min({m.attention_window}, p) keys; flash attention and the "
        "model FLOPs count those pairs, docs/model.md \"Training steps\"): with full attention "
        "in every layer the "
        f"1-slice step would be predicted at {full.step_s:.2f} s instead of {one.step_s:.2f} s. "
        f"The recipe's vocab tiling ({one.case.vocab_tiling} chunks) is what lets the "
        "[32768, 262144] logits fit: the predicted HBM peak is "
        f"{one.hbm_peak_gb:.1f} GB with it and {untiled.hbm_peak_gb:.1f} GB without, and its "
        f"recomputed logits matmul costs {one.step_s - untiled.step_s:.2f} s. Not modelled: a "
        "splash kernel computes a partly masked block whole; the recipe's block sizes are not "
        "recorded, and blocks of 512 tokens would compute up to 1536 keys per local query (3 "
        "blocks): counted as a 1536-token window, the 1-slice step changes by "
        f"{pct(blocks.step_s / one.step_s - 1)}. **The slowdown with slices (modelled).** "
        "Measured "
        + " and ".join(f"{pct(x)} ({n} slices)" for x, n in zip(meas, (2, 4), strict=True))
        + ", predicted " + " and ".join(pct(x) for x in pred) + ": the gradient all-reduces "
        "over the slices block each layer's backward (no `DATA_PARALLEL_OVERLAP` flags), "
        f"{msgs} of them a layer, one per weight matrix and one for the norm scales, as XLA "
        "compiles them (`--dp-grad-split per-matrix`; below), one after another, and each "
        "of their 2(N-1) DCN messages costs v6e's `dcn_message_overhead_s`, "
        f"{shipped_ms:g} ms. Without that overhead the slowdowns would be "
        + " and ".join(pct(x) for x in pred0) + f": a layer's gradient shard is {shard:.2f} MB "
        f"in bf16 ({2 * shard:.1f} MB in f32), {1e3 * shard * 1e6 / dcn:.2f}-"
        f"{2e3 * shard * 1e6 / dcn:.2f} ms on v6e's {dcn / 1e9:g} GB/s of DCN per chip. The "
        "measured growth is " + " and ".join(f"{1e3 * x:.1f}" for x in per_layer)
        + " ms per layer per added slice, about linear in the slice count like v5e's (effect "
        "2), where it is about 1 ms.")
    odd = next((f for f in fits if f.generation == "v6e" and f.subset == "odd"
                and f.dcn_objective == "slowdown"), None)
    even = next((f for f in fits if f.generation == "v6e" and f.subset == "even"
                 and f.dcn_objective == "slowdown"), None)
    if odd and odd.dcn_step_scan:
        step_best, step_obj = min(odd.dcn_step_scan, key=lambda t: t[1])
        at = v6e.with_overrides(dcn_message_overhead_s=step_best)
        held = [p for p in runs[1:] if not p.case.fit_subset]
        fitted = " and ".join(f"{ids[i].case.num_slices}-slice" for i in odd.dcn_pairs
                              if i in ids)
        which = ("the odd half's only multi-slice run with a 1-slice twin"
                 if len(odd.dcn_pairs) == 1 else
                 f"the odd half's {len(odd.dcn_pairs)} multi-slice runs with a 1-slice twin")
        text += (
            f" The overhead is fitted on the slowdown (the {fitted} step over the 1-slice "
            f"step, {which}), not jointly with the "
            "MXU factor on step times as v5e's: with one family the runs' common offset (the "
            f"1-slice run is {pct(one.error)} with no DCN) would be absorbed by the overhead. "
            f"On step times the odd half's objective falls from {odd.dcn_step_scan[0][1]:.4f} "
            f"at 0 ms to {step_obj:.4f} at {1e3 * step_best:g} ms (table above), where the "
            "held-out " + " and ".join(
                f"{p.case.num_slices}-slice run would be {pct(predict(p.case, at).error)}"
                for p in held) + ".")
        if even:
            text += (f" The even half's own slowdown fit gives {1e3 * even.dcn_message:g} ms "
                     f"(the shipped value: {shipped_ms:g} ms).")
    text += (
        " What a deviceless 2-slice compile of such a step sends over DCN "
        "(`validation/xla_dcn_schedule.py`: Gemma-3 12B widths, 4 scanned layers, fsdp=16 per "
        "slice, jax/libtpu 0.10.2, on v6e and on v5e alike): per layer eight cross-slice "
        "all-reduces, one per weight matrix of its bf16 gradient shard and one for the two "
        "norm scales in f32, never combined; without the overlap flags each waits in its own "
        "layer's backward iteration (with them it is carried into the next layer's), as "
        "`--dp-allreduce blocking` has it. tpusim sends them so (it sent the same bytes as "
        "one all-reduce a layer before 2026-12-01, `--dp-grad-split per-layer`), each waiting "
        "for the one before at the chip's DCN endpoint; the fitted overhead is per message of "
        f"that form, {shipped_ms:g} ms on v6e against v5e's {v5e_ms:g} ms "
        f"({shipped_ms / v5e_ms:.1f}x; effect 2 compares the two). Sharding the MLP weights "
        "on d_ff, as the 2- and 4-slice recipes' `fsdp_transpose` does, changes none of the "
        "cross-slice bytes. Within a slice that program has no windowed-einsum loop: "
        "synchronous weight gathers and all-reduces of whole bf16 weight gradients (at "
        "fsdp=16, where a one-slice program of the same decoder runs collective-permute "
        "rings; tpusim's `auto` rule reduce-scatters there; "
        "the Gemma runs' fsdp=256 is all-reduced either way, effect 7).")
    dcn_runs = [p for p in ids.values() if p.case.chip == "v6e" and p.case.num_slices > 1
                and p.case.model.attention_window is None]
    low_runs = [p for p in (low or {}).values() if p.case.chip == "v6e"
                and p.case.num_slices > 1]
    if dcn_runs or low_runs:
        text += " The other multi-slice v6e runs, with the overhead and without it: " + "; ".join(
            f"{p.case.model_label} {p.case.mesh_label}"
            + (" (low quality)" if p.case.low_quality else "")
            + f" {pct(p.error)} ({pct(predict(p.case, bare).error)})"
            for p in dcn_runs + low_runs) + "."
        for p in low_runs:
            twin = single_slice_twin(p.case, [q.case for q in ids.values()])
            if twin is not None:
                tp = ids[twin.id]
                text += (f" The {p.case.num_slices}-slice {p.case.model_label} slows down by "
                         f"{pct(p.case.measured_step_s / twin.measured_step_s - 1)} against "
                         f"its 1-slice run, predicted {pct(p.step_s / tp.step_s - 1)} "
                         f"({pct(predict(p.case, bare).step_s / tp.step_s - 1)} without the "
                         "overhead; its DCN axis is not stated).")
    return [text]


def moe_pair() -> dict:
    """`xla_moe_pair.pair_rows` of the cached matched-pair compiles ({} without the cache)."""
    if not xla_moe_pair.CACHE.is_file():
        return {}
    out = xla_moe_pair.pair_rows(json.loads(xla_moe_pair.CACHE.read_text()))
    return out if set(out) == set(xla_moe_pair.PAIR) else {}


def moe_pair_variants() -> list[tuple[str, dict]]:
    """(libtpu flags, `xla_moe_pair.variant_rows` per model) of the cached flag variants."""
    if not xla_moe_pair.CACHE.is_file():
        return []
    rows = xla_moe_pair.variant_rows(json.loads(xla_moe_pair.CACHE.read_text()))
    return [(xla_moe_pair.VARIANTS[v], r) for v, r in rows.items()]


