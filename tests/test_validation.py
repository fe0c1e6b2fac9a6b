"""Validation against measured MaxText runs (docs/validation.md, validation/maxtext*.py).

A fast subset of the full validation: six representative runs (v5e FSDP on one slice, v5e over
DCN, v5e tensor parallelism, v6e on a small slice with the custom remat policy, v6e full remat
on a full pod, v6e expert parallelism) must have a median absolute step-time error <= 5% under
the shipped chip presets (issue 11's target for all runs), none worse than 20% (the MoE run with
expert parallelism is the worst, docs/validation.md effect 3). The reference data are copied into
docs/reference/.
"""

from __future__ import annotations

import math
import statistics

import pytest

from tests.conftest import REFERENCE_DIR
from validation import maxtext_fit as fit
from validation import (
    maxtext_predict,
    template,
    xla_dcn_schedule,
    xla_moe_pair,
    xla_moe_schedule,
)
from validation import maxtext_runs as runs
from workloads.training import Remat

RUNS_FILE = REFERENCE_DIR / "maxtext_runs.json"

REPRESENTATIVE = (
    "maxtext-v5e-16b-1x-v5e-256",  # v5e, 2023 default decoder, FSDP 256, one slice
    "maxtext-v5e-64b-8x-v5e-256",  # v5e, 8 slices, DCN data parallelism
    "maxtext-v5e-128b-1x-v5e-256",  # v5e, fsdp16 x tensor16 (the simulator's weakest spot)
    "tpu-recipes-v6e-llama3.1-8b-v6e-8",  # v6e-8 (2x4), custom remat policy
    "tpu-recipes-v6e-llama2-70b-v6e-256-oct2024",  # v6e-256, full remat
    "tpu-recipes-v6e-mixtral-8x22b-v6e-256",  # v6e MoE, fsdp64 x expert4
)


@pytest.fixture(scope="module")
def vm():
    """The MaxText validation's predictions (validation/maxtext_predict.py)."""
    return maxtext_predict


@pytest.fixture(scope="module")
def loaded(vm):
    return runs.load_cases(RUNS_FILE)


def test_representative_cases_median_error_within_five_percent(vm, loaded):
    cases, _ = loaded
    by_id = {c.id: c for c in cases}
    missing = [i for i in REPRESENTATIVE if i not in by_id]
    assert not missing, f"representative cases not usable any more: {missing}"
    preds = [vm.predict(by_id[i]) for i in REPRESENTATIVE]  # shipped presets
    errors = {p.case.id: p.error for p in preds}
    median = statistics.median(abs(e) for e in errors.values())
    detail = ", ".join(f"{k}: {100 * v:+.1f}%" for k, v in errors.items())
    assert median <= 0.05, f"median |error| {100 * median:.1f}% > 5% ({detail})"
    # No representative case may be far off either (the worst, MoE with expert parallelism on
    # v6e, is about +15%).
    assert max(abs(e) for e in errors.values()) <= 0.20, detail


def test_cases_are_built_from_the_reference_as_documented(vm, loaded):
    cases, skips = loaded
    by_id = {c.id: c for c in cases}
    # fsdp_transpose -> fsdp; the recipes' remat policies by what they offload
    # (docs/validation.md, "Remat").
    c = by_id["tpu-recipes-v6e-llama2-70b-v6e-256"]
    assert (c.mesh, c.dcn, c.remat) == ("fsdp=256", "", Remat.QKV_OFFLOAD)
    assert by_id["tpu-recipes-v6e-llama3.1-70b-v6e-32"].remat == Remat.QKV_OFFLOAD
    assert by_id["tpu-recipes-v6e-llama3.1-8b-v6e-8"].remat == Remat.QKVO_OFFLOAD
    assert by_id["tpu-recipes-v6e-llama3.1-405b-2x-v6e-256"].remat == Remat.FULL  # input only
    assert by_id["tpu-recipes-v6e-llama2-70b-v6e-256-oct2024"].remat == Remat.FULL
    assert c.model.num_kv_heads == 8 and c.model.mlp == "swiglu" and not c.model.tied_embeddings
    # dcn_fsdp -> --dcn fsdp=N, with tensor parallelism inside the slice.
    c = by_id["tpu-recipes-v6e-llama3.1-405b-2x-v6e-256-fsdp-dcn-feb2025"]
    assert (c.mesh, c.dcn, c.num_slices) == ("fsdp=64,tensor=4", "fsdp=2", 2)
    # The 2023 v5e table: parallel-block ReLU decoder, tied, step time derived from MFU.
    c = by_id["maxtext-v5e-128b-4x-v5e-256"]
    assert c.model.parallel_block and c.model.tied_embeddings and c.model.mlp == "relu"
    assert (c.mesh, c.dcn, c.step_source) == ("fsdp=16,tensor=16", "data=4", "derived")
    assert c.measured_step_s == pytest.approx(15.157, abs=1e-3)
    # MoE with expert parallelism, on MaxText's hybrid_ring_64x4 device order: each group of
    # the size-4 axis is a 2x2 block of chips, the size-64 axis the 8x8 grid of blocks.
    c = by_id["tpu-recipes-v6e-mixtral-8x22b-v6e-256"]
    assert c.mesh == "fsdp=64,expert=4" and c.model.num_experts == 8
    assert c.axis_map == "expert=x:2+y:2,fsdp=x:8+y:8"
    assert by_id["maxtext-custom-moe-750b-final-cf1.5-v6e-256"].axis_map == ""
    # Gemma 3: 5 local layers (window 1024) per global one, post-norms and QK-norm.
    c = by_id["tpu-recipes-v6e-gemma3-12b-2x-v6e-256"]
    assert (c.model.attention_window, c.model.global_layer_period) == (1024, 6)
    assert c.model.post_norms and c.model.qk_norm and c.model.mlp == "geglu"
    assert (c.mesh, c.dcn, c.remat) == ("fsdp=256", "data=2", Remat.FULL)
    # Every skip says why; MFU-only entries are skipped.
    reasons = {s.id: s.reason for s in skips}
    assert all(reasons.values())
    assert "batch" in reasons["maxtext-custom-moe-10t-1x-v6e-256"]
    # Low-quality runs are kept but never in the fit subset.
    assert all(not c.fit_subset for c in cases if c.low_quality)
    assert {c.chip for c in cases} == {"v5e", "v6e"}


def test_each_run_keeps_its_params_dtype_and_computes_in_bf16(vm, loaded):
    cases, _ = loaded
    by_id = {c.id: c for c in cases}
    # `dtype.params`: flax's / base.yml's float32 default on the 2023 v5e table and most recipes;
    # bf16 where the recipe sets it; the 750B's `other_settings.weight_dtype`.
    assert by_id["maxtext-v5e-64b-8x-v5e-256"].param_dtype == "fp32"
    assert by_id["tpu-recipes-v6e-llama3.1-8b-v6e-8"].param_dtype == "fp32"
    assert by_id["tpu-recipes-v6e-llama3.1-70b-v6e-32"].param_dtype == "bf16"
    assert by_id["tpu-recipes-v6e-mixtral-8x22b-v6e-256"].param_dtype == "bf16"
    assert by_id["maxtext-custom-moe-750b-final-cf1.5-v6e-256"].param_dtype == "bf16"
    assert sum(c.param_dtype == "fp32" for c in cases) == len(cases) - 5
    cfg = runs.trace_config(by_id["tpu-recipes-v6e-llama3.1-8b-v6e-8"])
    assert (cfg.param_dtype, cfg.weight_gather_dtype, cfg.grad_dtype) == ("fp32", "bf16", "bf16")
    # Only the `defaults_used` entry left: its weight_dtype= default; none at all: float32.
    assert runs.params_dtype_for({"id": "x", "defaults_used": ["weight_dtype=bfloat16"]}) == "bf16"
    assert runs.params_dtype_for({"id": "x"}) == "fp32"


def test_v6e_runs_reduce_gradients_as_xla_chooses_and_v5e_runs_reduce_scatter(vm, loaded):
    # The current-compiler (v6e) runs are rebuilt with XLA's choice per matrix (--fsdp-grad
    # auto), the 2023 v5e runs with async reduce-scatters (effect 7); the what-ifs rebuild a
    # run with every gradient all-reduced (--fsdp-grad all-reduce).
    cases, _ = loaded
    case = next(c for c in cases if c.id == "tpu-recipes-v6e-llama2-70b-v6e-256")
    for gen, rule in (("v5e", "reduce-scatter"), ("v6e", "auto")):
        assert {runs.trace_config(c).fsdp_grad for c in cases if c.chip == gen} == {rule}
    # Across slices: per weight matrix on v6e (today's XLA), one a layer on the 2023 v5e runs.
    for gen, split in (("v5e", "per-layer"), ("v6e", "per-matrix")):
        assert {runs.trace_config(c).dp_grad_split for c in cases if c.chip == gen} == {split}
    what_if = runs.with_changes(case, fsdp_grad="all-reduce")
    assert runs.trace_config(what_if).fsdp_grad == "all-reduce"


def test_fit_split_alternates_within_each_generation(vm, loaded):
    cases, _ = loaded
    for gen in ("v5e", "v6e"):
        good = [c for c in cases if c.chip == gen and not c.low_quality]
        assert [c.index for c in good] == list(range(len(good)))
        fit = [c for c in good if c.fit_subset]
        assert len(good) // 2 <= len(fit) <= (len(good) + 1) // 2


def test_hybrid_ring_places_each_expert_group_on_a_2x2_block(vm, loaded):
    from topologies.mesh import parse_mesh, place_mesh
    from topologies.slices import SLICES

    cases, _ = loaded
    c = {c.id: c for c in cases}["tpu-recipes-v6e-mixtral-8x22b-v6e-256"]
    _, topo = runs.case_trace(c)
    assert tuple(SLICES.get(c.slice_name).shape) == (16, 16)
    pl = place_mesh(parse_mesh(c.mesh, None, c.axis_map), topo)
    # Expert: 2 chips of x and 2 of y, both innermost (stride 1); fsdp: the rest, stride 2.
    assert sorted(pl["expert"].factors) == [("x", 2, 1), ("y", 2, 1)]
    assert sorted(pl["fsdp"].factors) == [("x", 8, 2), ("y", 8, 2)]


def test_custom_mesh_that_does_not_fit_the_axes_is_a_reason_not_a_crash(vm):
    assert runs.custom_mesh_axis_map("hybrid_ring_64x4", {"fsdp": 256}).startswith("!")
    assert runs.custom_mesh_axis_map("hybrid_ring_9x9", {"fsdp": 64, "expert": 4}).startswith("!")
    assert runs.custom_mesh_axis_map("hybrid_ring_32x8", {"fsdp": 32, "tensor": 8}) == \
        "tensor=x:4+y:2,fsdp=x:4+y:8"


def test_moe_schedule_reader_tells_sync_from_async_all_to_alls_and_their_loop():
    mod = xla_moe_schedule
    hlo = "\n".join([
        '  %all-to-all.1 = bf16[2,640,1024]{2,1,0} all-to-all(%x), metadata={op_name='
        '"jit(step)/jvp()/while/body/closed_call/bsm,bsec->ebcm/dot_general"}',
        '  %all-to-all-start.2 = ((f32[4,8,16]{2,1,0}), f32[4,8,16]{2,1,0}, u32[]{:S(2)}) '
        'all-to-all-start(%y), metadata={op_name='
        '"jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/broadcast_in_dim"}',
        '  %all-to-all-done.2 = f32[4,8,16]{2,1,0} all-to-all-done(%all-to-all-start.2), '
        'metadata={op_name='
        '"jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/broadcast_in_dim"}',
    ])
    a = mod.read_schedule(hlo)["all_to_all"]
    assert [(x["loop"], x["form"], x["bytes"], x["einsum"]) for x in a] == [
        ("forward", "sync", 2 * 640 * 1024 * 2, "bsm,bsec->ebcm"),
        ("backward", "async", 4 * 8 * 16 * 4, "broadcast_in_dim"),
    ]


def test_moe_schedule_750b_sizes_are_the_measured_750b_runs_per_chip(vm, loaded):
    # xla_moe_schedule.py --size 750b compiles the 750B MoE's layer as it runs per chip: its
    # widths, routing, one 8192-token sequence per chip and fsdp=16 x expert=16 on a 16x16.
    mod = xla_moe_schedule
    topo, fs, ep, d, f, e, k, cf, seq, _h, hd, _layers, v = mod.SIZES["750b"]
    cases, _ = loaded
    c = {c.id: c for c in cases}["maxtext-custom-moe-750b-final-cf1.5-v6e-256"]
    m = c.model
    assert (d, f, e, k, hd, v) == (m.d_model, m.expert_d_ff, m.num_experts,
                                   m.experts_per_token, m.head_dim, m.vocab_size)
    assert (cf, seq, c.batch_per_chip) == (c.capacity_factor, c.seq_len, 1)
    assert c.mesh == f"fsdp={fs},expert={ep}" and topo == "v6e:16x16"


def test_moe_schedule_8x22b_sizes_and_placement_are_the_measured_8x22b_runs(vm, loaded):
    # --size mixtral-8x22b: the 8x22B's widths and routing on a 16x16 with fsdp=64 x expert=4,
    # its chips placed as MaxText's hybrid_ring_64x4 places them (the run's custom mesh).
    mod = xla_moe_schedule
    topo, fs, ep, d, f, e, k, cf, seq, h, hd, _layers, v = mod.SIZES["mixtral-8x22b"]
    cases, _ = loaded
    c = {c.id: c for c in cases}["tpu-recipes-v6e-mixtral-8x22b-v6e-256"]
    m = c.model
    assert (d, f, e, k, h, hd, v) == (m.d_model, m.expert_d_ff, m.num_experts,
                                      m.experts_per_token, m.num_heads, m.head_dim, m.vocab_size)
    assert (cf, seq) == (c.capacity_factor, c.seq_len)
    assert c.mesh == f"fsdp={fs},expert={ep}" and topo == "v6e:16x16"
    assert mod.PLACEMENT["mixtral-8x22b"] == "hybrid_ring_64x4"
    assert c.axis_map == "expert=x:2+y:2,fsdp=x:8+y:8"


def test_hybrid_ring_64x4_compile_placement_puts_each_expert_ring_on_a_2x2_block():
    import types

    from workloads.hlo import jaxgen as xla  # the placement's home since make-hlo-fixture

    chips = [types.SimpleNamespace(coords=(x, y, 0)) for y in range(16) for x in range(16)]
    grid = xla._hybrid_ring_64x4(chips, (64, 4))
    assert len({id(d) for d in grid.flat}) == 256
    for i in range(64):
        ring = [d.coords[:2] for d in grid[i]]
        bx, by = ring[0][0] // 2, ring[0][1] // 2
        assert {(x // 2, y // 2) for x, y in ring} == {(bx, by)}  # one 2x2 block
        # A ring of neighbours: each chip one hop from the next, the last from the first.
        for (x0, y0), (x1, y1) in zip(ring, ring[1:] + ring[:1], strict=True):
            assert abs(x0 - x1) + abs(y0 - y1) == 1
    # The 64-way axis is the 8x8 grid of blocks: the same chip of each block, stride 2.
    assert sorted(d.coords[:2] for d in grid[:, 0]) == \
        sorted((2 * bx, 2 * by) for bx in range(8) for by in range(8))
    with pytest.raises(ValueError, match="64 and 4"):
        xla._hybrid_ring_64x4(chips, (16, 16))


def test_moe_schedule_reader_lists_every_collective_once_with_its_form_and_loop():
    mod = xla_moe_schedule
    fwd = 'metadata={op_name="jit(step)/jvp()/while/body/closed_call/dot_general"}'
    bwd = 'metadata={op_name="jit(step)/transpose(jvp())/while/body/closed_call/dot_general"}'
    hlo = "\n".join([
        "%all-reduce-scatter.clone (input.8: bf16[2,64,128]) -> bf16[2,1,128] {",
        "  %all-reduce.33 = bf16[2,64,128]{2,1,0} all-reduce(%input.8), channel_id=43",
        "}",
        "ENTRY %main (p: bf16[8]) -> bf16[8] {",
        f"  %all-gather.1 = bf16[64,128]{{1,0}} all-gather(%w), dimensions={{0}}, {fwd}",
        "  %collective-permute-start.1 = (bf16[1,512]{1,0:T(8,128)(2,1)}, bf16[1,512]{1,0}, "
        f"u32[]{{:S(2)}}) collective-permute-start(%a), {fwd}",
        f"  %collective-permute-done.1 = bf16[1,512]{{1,0}} collective-permute-done(%b), {fwd}",
        f"  %g = bf16[2,64,128]{{2,1,0}} fusion(%x), kind=kLoop, calls=%f, {bwd}",
        f"  %fusion.604 = bf16[2,1,128]{{2,1,0}} fusion(%g), kind=kCustom, "
        f"calls=%all-reduce-scatter.clone, {bwd}",
        f"  %all-reduce-start.2 = f32[16]{{0}} all-reduce-start(%y), {bwd}",
        f"  %all-reduce-done.2 = f32[16]{{0}} all-reduce-done(%all-reduce-start.2), {bwd}",
        "  %all-reduce.9 = f32[]{:T(128)} all-reduce(%loss)",
        "}",
        # An async collective fusion: the same chained all-gather in each fusion carrying it.
        "%fused_computation.738 (param_0.2492: bf16[64,4096]) -> bf16[64,4096] {",
        f"  %all-gather.208 = bf16[1024,4096]{{1,0}} all-gather(%p), channel_id=127, "
        f'frontend_attributes={{chain_id="10"}}, {bwd}',
        "}",
        "%async_collective_fusion.1121 (param_0.2495: bf16[64,4096]) -> bf16[64,4096] {",
        f"  %all-gather.210 = bf16[1024,4096]{{1,0}} all-gather(%p), channel_id=127, "
        f'frontend_attributes={{chain_id="10"}}, {bwd}',
        "}",
    ])
    got = [(c["loop"], c["kind"], c["form"], c["bytes"])
           for c in mod.read_schedule(hlo)["collectives"]]
    assert got == [("forward", "all-gather", "sync", 64 * 128 * 2),
                   ("forward", "collective-permute", "async", 512 * 2),
                   ("backward", "all-reduce", "sync", 2 * 64 * 128 * 2),  # the whole gradient
                   ("backward", "all-reduce", "async", 16 * 4),
                   ("outside", "all-reduce", "sync", 4),
                   ("backward", "all-gather", "async", 1024 * 4096 * 2)]
    assert mod.collective_summary(mod.read_schedule(hlo)["collectives"])[1] == \
        ("backward", "all-reduce", "async", 1, 64 / 2**20)


def test_capacity_line_passes_through_both_750b_runs(vm, loaded):
    # Effect 3's straight line in the capacity factor through the 750B's cf-1.0 and cf-1.5
    # runs: it reproduces both measured steps, and steps proportional to the factor give a line
    # through the origin.
    cases, _ = loaded
    by = {c.id: c for c in cases}
    lo, hi = (vm.Prediction(case=by[f"maxtext-custom-moe-750b-{n}-v6e-256"], step_s=1.0,
                            fits_in_hbm=True, hbm_peak_gb=0.0, breakdown={})
              for n in ("experimental-cf1.0", "final-cf1.5"))
    at0, per = vm.capacity_line(lo, hi)
    assert at0 + per * 1.0 == pytest.approx(lo.case.measured_step_s)
    assert at0 + per * 1.5 == pytest.approx(hi.case.measured_step_s)
    assert vm.capacity_line(lo, hi, (10.0, 15.0)) == pytest.approx((0.0, 10.0))


def test_implied_expert_efficiency_is_the_shipped_factor_when_the_step_is_predicted(vm, loaded):
    # A run measured at exactly its predicted step needs the experts at the shipped factor;
    # measured at the step with the experts' FLOPs doubled, at half of it. Two of the run's 32
    # layers: the bisection replays the step a dozen times per reading (8 s with all 32).
    import dataclasses

    cases, _ = loaded
    c = {c.id: c for c in cases}["tpu-recipes-v6e-mixtral-8x7b-v6e-256"]
    c = runs.with_changes(c, id=f"{c.id}#2-layers",
                          model=dataclasses.replace(c.model, num_layers=2))
    eff = vm.get_chip("v6e").mxu_efficiency
    p = vm.predict(c)
    exact = dataclasses.replace(p, case=runs.with_changes(c, measured_step_s=p.step_s))
    assert vm.implied_expert_efficiency(exact) == pytest.approx(eff, rel=2e-3)
    from sim.engine.replay import replay
    from workloads.trace import OpKind, Trace, Unit

    trace, topo = runs.case_trace(c)
    doubled = Trace(mesh=trace.mesh, meta=trace.meta, ops=tuple(
        dataclasses.replace(o, flops=2 * o.flops) if o.kind == OpKind.COMPUTE
        and o.unit == Unit.MXU and o.name.removeprefix("re-").startswith(("expert_", "mlp_bwd"))
        else o
        for o in trace.ops))
    slow = float(replay(doubled, vm.get_chip("v6e"), topo).step_time_s)
    assert slow > p.step_s * 1.3  # the experts are most of the step
    half = dataclasses.replace(p, case=runs.with_changes(c, measured_step_s=slow))
    assert vm.implied_expert_efficiency(half) == pytest.approx(eff / 2, rel=2e-3)


def test_gemma3_runs_rebuild_with_their_vocab_tiling_and_maxtexts_flop_count(vm, loaded):
    cases, _ = loaded
    c = {c.id: c for c in cases}["tpu-recipes-v6e-gemma3-12b-1x-v6e-256"]
    assert c.vocab_tiling == 16
    trace, _ = runs.case_trace(c)
    # The log line's TFLOPs per device and step (MaxText's windowed causal count) come out of
    # the rebuilt model and batch.
    assert trace.meta.maxtext_flops_per_chip / 1e12 == pytest.approx(2557.19, abs=0.01)
    # 16 chunks of 2048 tokens: one chunk's f32 logits and bf16 gradients, 6 bytes a logit.
    assert trace.meta.logits_bytes == 2048 * 262144 * 6
    assert vm.predict(c).fits_in_hbm


def test_each_multi_slice_run_is_paired_with_the_same_run_on_one_slice(vm, loaded):
    cases, _ = loaded
    by_id = {c.id: c for c in cases}

    def twin(i):
        t = fit.single_slice_twin(by_id[i], cases)
        return t.id if t is not None else None

    gemma = "tpu-recipes-v6e-gemma3-12b-{}x-v6e-256"
    assert twin(gemma.format(2)) == twin(gemma.format(4)) == gemma.format(1)
    assert twin(gemma.format(1)) is None  # a one-slice run is nobody's slowdown
    assert twin("maxtext-v5e-128b-32x-v5e-256") == "maxtext-v5e-128b-1x-v5e-256"
    # The 4-slice 750B MoE is the capacity-factor-1.5 run on 4 slices, not the cf-1.0 one.
    assert (twin("maxtext-custom-moe-750b-final-cf1.5-4x-v6e-256")
            == "maxtext-custom-moe-750b-final-cf1.5-v6e-256")
    # No 405B run was measured on one slice: its DCN-fsdp runs have no slowdown to fit.
    assert twin("tpu-recipes-v6e-llama3.1-405b-2x-v6e-256") is None
    odd = fit.subset_cases(cases, "v6e", "odd")
    assert [c.id for c, _ in fit.slowdown_pairs(odd, cases)] == [gemma.format(2)]


def test_slowdown_error_is_the_log_of_predicted_over_measured_step_ratio(vm, loaded,
                                                                         monkeypatch):
    cases, _ = loaded
    by_id = {c.id: c for c in cases}
    run = by_id["tpu-recipes-v6e-gemma3-12b-2x-v6e-256"]
    base = by_id["tpu-recipes-v6e-gemma3-12b-1x-v6e-256"]
    steps = {run.id: 7.0, base.id: 6.5}
    monkeypatch.setattr(fit, "predict", lambda c, chip=None: vm.Prediction(
        case=c, step_s=steps[c.id], fits_in_hbm=True, hbm_peak_gb=0.0))
    expected = math.log((7.0 / 6.5) / (7.793 / 7.318))  # the logged steps (maxtext.md)
    assert fit.slowdown_error(run, base, None) == pytest.approx(expected, rel=1e-12)
    assert fit.slowdown_objective([(run, base)] * 2, None) == pytest.approx(abs(expected),
                                                                          abs=1e-9)


def test_dcn_schedule_reader_tells_carried_from_blocking_cross_slice_all_reduces():
    mod = xla_dcn_schedule
    attrs = ('is_host_transfer=true, frontend_attributes={_xla_megascale_reduce_operation="SUM",'
             '_xla_megascale_transfer_type="ALL_REDUCE"}')
    hlo = "\n".join([
        "%body (p: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {",
        "  %p = (s32[], bf16[8,128]{1,0}) parameter(0)",
        "  %g = bf16[8,128]{1,0} get-tuple-element(%p), index=1",
        "  %c = bf16[8,128]{1,0} copy(%g)",
        "  %t = token[] after-all()",
        f"  %send.1 = (bf16[8,128]{{1,0}}, u32[], token[]) send(%c, %t), {attrs}",
        "  %f = bf16[4,256]{1,0} fusion(%g), kind=kOutput, calls=%fc",
        "  %ar = bf16[4,256]{1,0} all-reduce(%f), replica_groups={{0,1}}, to_apply=%add",
        "  %b = bf16[4,256]{1,0} bitcast(%ar)",
        f"  %send.2 = (bf16[4,256]{{1,0}}, u32[], token[]) send(%b, %t), {attrs}",
        "  %ag = bf16[16,128]{1,0} all-gather-start(%g), dimensions={0}",
        "}",
        "ENTRY %main (a: f32[2,64]) -> f32[2,64] {",
        "  %a = f32[2,64]{1,0} parameter(0)",
        "  %t = token[] after-all()",
        f"  %send.3 = (f32[2,64]{{1,0}}, u32[], token[]) send(%a, %t), {attrs}",
        "}",
    ])
    s = mod.read_dcn(hlo)
    assert [(d["name"], d["waits"], d["bytes"]) for d in s["dcn_all_reduces"]] == [
        ("send.1", "next", 8 * 128 * 2),  # the previous iteration's gradient, carried
        ("send.2", "same", 4 * 256 * 2),  # this iteration's, reduced within the slice first
        ("send.3", "entry", 2 * 64 * 4),
    ]
    assert s["ici"] == {("all-reduce", "sync"): 1, ("all-gather", "async"): 1}


def test_moe_pair_programs_are_the_matched_runs_widths_layers_batches_and_mesh(vm, loaded):
    # xla_moe_pair.py compiles the dense / MoE matched pair (effect 3) at each run's widths,
    # routing and sequences per chip, on the runs' v6e 16x16 with fsdp=256.
    mod = xla_moe_pair
    cases, _ = loaded
    by_id = {c.id: c for c in cases}
    assert mod.TOPOLOGY == "v6e:16x16" and mod.MESH == {"fsdp": 256, "expert": 1}
    for p in mod.PAIR.values():
        c = by_id[p["run"]]
        m = c.model
        assert (p["d_model"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                p["vocab_size"]) == (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim,
                                     m.vocab_size)
        assert p["num_experts"] == m.num_experts
        if m.num_experts:
            assert (p["d_ff"], p["top_k"], p["capacity_factor"]) == (
                m.expert_d_ff, m.experts_per_token, c.capacity_factor)
        else:
            assert p["d_ff"] == m.d_ff and c.capacity_factor is None
        assert (p["run_layers"], p["run_batch"], mod.SEQ) == (m.num_layers, c.batch_per_chip,
                                                               c.seq_len)
        assert c.mesh == "fsdp=256" and c.maxtext_remat == "full"


def test_the_validation_document_templates_name_exactly_the_values_they_get(tmp_path,
                                                                          monkeypatch):
    # docs/validation.md is templates/validation.md filled in: a placeholder without a value,
    # or a value without a placeholder, is an error rather than a gap in the document.
    (tmp_path / "t.md").write_text("a {{x}} b {{y}}\n")
    monkeypatch.setattr(template, "TEMPLATES", tmp_path)
    assert template.render("t.md", {"x": "1", "y": "{{x}}"}) == "a 1 b {{x}}"
    with pytest.raises(ValueError, match=r"no value for \['y'\], no placeholder for \[\]"):
        template.render("t.md", {"x": "1"})
    with pytest.raises(ValueError, match=r"no placeholder for \['z'\]"):
        template.render("t.md", {"x": "1", "y": "2", "z": "3"})
    # The shipped template keeps the computed tables out of its prose.
    monkeypatch.undo()
    names = set(template.PLACEHOLDER.findall(
        (template.TEMPLATES / "validation.md").read_text()))
    assert {"summary_table", "runs_table", "effects", "fits_table", "xla_collectives"} <= names
