"""Tests for workloads/training.py compiled and replayed by sim/engine/replay.py, and the `tpusim
train / compile / replay` commands: FLOP counts against the textbook (tpu.md §3), roofline timing on
one chip, FSDP communication and overlap, the critical-path breakdown, memory, determinism, what-if
hardware, errors, trace files, pipeline and MoE.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sim.chips import get_chip
from sim.cli import main
from sim.engine.replay import replay
from sim.engine.result import BREAKDOWN_KEYS, StepResult
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from topologies.torus import Topology
from workloads.memory import MEMORY_CATEGORIES
from workloads.models import TransformerSpec
from workloads.trace import OpKind, Trace, Unit
from workloads.training import Optimizer, Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

# L=2, D=256, N=4 query heads, K=2 KV heads of H=64, F=1024 SwiGLU, V=512, untied.
TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}
# Wide enough that the big matmuls are MXU-bound on a v5e (tokens per chip >> 240).
MID = {
    "name": "mid", "num_layers": 2, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
    "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 1024,
}
TINY_MOE = {
    "name": "tiny-moe", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 4,
    "head_dim": 64, "d_ff": 512, "mlp": "swiglu", "vocab_size": 512, "num_experts": 4,
    "experts_per_token": 2,
}
# One layer of 3.2e9 parameters: 12 bytes/param of static state alone is ~39 GB > 16 GB (v5e).
BIG = {
    "name": "big", "num_layers": 1, "d_model": 16384, "num_heads": 128, "num_kv_heads": 8,
    "head_dim": 128, "d_ff": 65536, "mlp": "swiglu", "vocab_size": 1024,
}


def _pod(chip: ChipSpec, shape: str, slices: int = 1) -> Topology:
    return resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape, num_slices=slices)


def _step(mesh: str, shape: str, *, model: dict = TINY, chip: ChipSpec | None = None,
          dcn: str | None = None, slices: int = 1, **cfg) -> tuple[Trace, StepResult]:
    chip = chip or get_chip("v5e")
    topo = _pod(chip, shape, slices)
    config = {"seq_len": 128, "batch_per_chip": 2, **cfg}
    trace = compile_training_step(model_from_dict(model), parse_mesh(mesh, dcn), topo.num_chips,
                                  TrainingConfig(**config))
    return trace, replay(trace, chip, topo)


def _mxu_flops(trace: Trace) -> float:
    return sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.MXU)


def _textbook_training_flops(m: TransformerSpec, tokens: float, seq_len: int) -> float:
    """tpu.md §3: 6 x (matmul params) x tokens + dot attention 12·B·T²·N·H per layer.

    Matmul params: per layer QKVO 2D(N+K)H + gated MLP 3DF, plus the D x V output projection
    (the embedding lookup is a gather, not a matmul). Attention is non-causal for `dot`.
    """
    per_layer = 2 * m.d_model * (m.num_heads + m.num_kv_heads) * m.head_dim
    per_layer += 3 * m.d_model * m.d_ff
    params = m.num_layers * per_layer + m.d_model * m.vocab_size
    attention = 12 * tokens * seq_len * m.num_heads * m.head_dim * m.num_layers
    return 6 * params * tokens + attention


def _layer_forward_flops(m: TransformerSpec, tokens: float, seq_len: int) -> float:
    """One forward pass through the decoder layers (no output projection), dot attention."""
    per_layer = 2 * m.d_model * (m.num_heads + m.num_kv_heads) * m.head_dim
    per_layer += 3 * m.d_model * m.d_ff
    return (2 * per_layer * tokens
            + 4 * tokens * seq_len * m.num_heads * m.head_dim) * m.num_layers


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _train_args(model: str, *extra: str, shape: str = "2x2", mesh: str = "fsdp=4") -> list[str]:
    return ["train", "--chip", "v5e", "--shape", shape, "--model", model, "--seq-len", "128",
            "--batch-per-chip", "2", "--mesh", mesh, *extra]


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


# -- (a) FLOPs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh,shape",
    [("fsdp=1", "1x1"), ("fsdp=4", "2x2"), ("fsdp=2,tensor=2", "2x2"),
     ("data=2,tensor=2", "2x2"), ("fsdp=2,sequence=2", "2x2")],
)
def test_mxu_flops_per_chip_equal_textbook_training_flops_over_chips(mesh, shape):
    trace, _ = _step(mesh, shape, remat=Remat.NONE, attention="dot")
    m = model_from_dict(TINY)
    chips = trace.meta.num_chips
    tokens = trace.meta.global_sequences * 128
    expected = _textbook_training_flops(m, tokens, 128) / chips
    # Exact: the compiler counts exactly these matmuls (K/tp heads are whole here).
    assert _mxu_flops(trace) == pytest.approx(expected, rel=1e-9)


def test_remat_full_adds_one_forward_of_the_layers_but_their_dead_down_projections():
    none, _ = _step("fsdp=4", "2x2", remat=Remat.NONE, attention="dot")
    full, _ = _step("fsdp=4", "2x2", remat=Remat.FULL, attention="dot")
    m = model_from_dict(TINY)
    tokens_per_chip = 2 * 128
    # The recomputed MLP down projection feeds only the layer output, which the backward does
    # not read: XLA drops it as dead code (docs/validation.md, imported HLO programs).
    dead = 2 * tokens_per_chip * m.d_ff * m.d_model * m.num_layers
    extra = _layer_forward_flops(m, tokens_per_chip, 128) - dead
    assert _mxu_flops(full) - _mxu_flops(none) == pytest.approx(extra, rel=1e-9)
    # tpu.md §3: block remat raises 6·P·T to "about 8·P·T"; without the dead down projection
    # (a third of this model's MLP) the recompute is less than a full forward.
    assert 7 / 6 < _mxu_flops(full) / _mxu_flops(none) < 8 / 6
    assert not any(o.name in ("re-mlp_out", "re-residual_mlp") for o in full.ops)


def test_qkv_offload_policies_recompute_all_but_the_offloaded_projections():
    m = model_from_dict(TINY)
    n = 2 * 128  # tokens per chip
    full, _ = _step("fsdp=4", "2x2", remat=Remat.FULL)
    qkv, _ = _step("fsdp=4", "2x2", remat=Remat.QKV_OFFLOAD)
    qkvo, _ = _step("fsdp=4", "2x2", remat=Remat.QKVO_OFFLOAD)
    qkv_flops = 2 * n * m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    out_flops = 2 * n * m.num_heads * m.head_dim * m.d_model
    L = m.num_layers
    assert _mxu_flops(full) - _mxu_flops(qkv) == pytest.approx(L * qkv_flops, rel=1e-9)
    assert _mxu_flops(qkv) - _mxu_flops(qkvo) == pytest.approx(L * out_flops, rel=1e-9)
    # Per layer the layer input (bf16 [n, D]) and q, k, v (and the output projection) go to
    # host memory in the forward and come back in the backward.
    a = 2
    qkv_bytes = n * (m.d_model + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim) * a
    for trace, expected in ((qkv, qkv_bytes), (qkvo, qkv_bytes + n * m.d_model * a)):
        host = [o for o in trace.ops if o.kind == OpKind.HOST]
        assert sorted({o.name for o in host}) == ["fetch_activations", "offload_activations"]
        assert sum(o.bytes for o in host) == pytest.approx(2 * L * expected, rel=1e-12)
        # Nothing stays in HBM between a layer's forward and its backward.
        assert trace.meta.activation_bytes_estimate == 0


@pytest.mark.parametrize("remat", [Remat.FULL, Remat.QKV_OFFLOAD, Remat.QKVO_OFFLOAD])
def test_recomputing_policies_free_every_activation_they_allocate(remat):
    trace, res = _step("fsdp=4", "2x2", remat=remat)
    saved = sum(d for _, cat, d in trace.meta.memory_events if cat == "saved_activations")
    assert saved == pytest.approx(0.0, abs=1.0)
    assert res.hbm_peak_bytes > 0


def test_parallel_block_recompute_drops_both_branch_outputs():
    par = {**TINY, "name": "tiny-par", "parallel_block": True}
    none, _ = _step("fsdp=4", "2x2", model=par, remat=Remat.NONE, attention="dot")
    full, _ = _step("fsdp=4", "2x2", model=par, remat=Remat.FULL, attention="dot")
    m = model_from_dict(par)
    n = 2 * 128
    dead = 2 * n * (m.d_ff + m.num_heads * m.head_dim) * m.d_model * m.num_layers
    extra = _layer_forward_flops(m, n, 128) - dead
    assert _mxu_flops(full) - _mxu_flops(none) == pytest.approx(extra, rel=1e-9)


def test_recompute_under_tensor_parallelism_drops_the_dead_output_reduction():
    full, _ = _step("tensor=4", "2x2", remat=Remat.FULL)
    re_tp = sorted(o.name for o in full.ops if o.kind == OpKind.COLLECTIVE
                   and o.name.startswith("re-") and o.layer == 0)
    # The attention output's reduction feeds the recomputed MLP; the MLP output's is dead.
    assert re_tp == ["re-tp_allgather_attn", "re-tp_allgather_mlp",
                     "re-tp_reducescatter_attn"]


def test_moe_recompute_keeps_the_experts_outputs_but_drops_the_weighted_combine():
    from workloads.moe import MoeConfig

    none, _ = _step("fsdp=2,expert=2", "2x2", model=TINY_MOE, remat=Remat.NONE,
                    moe=MoeConfig(capacity_factor=1.0))
    full, _ = _step("fsdp=2,expert=2", "2x2", model=TINY_MOE, remat=Remat.FULL,
                    moe=MoeConfig(capacity_factor=1.0))
    re = {o.name for o in full.ops if o.name.startswith("re-")}
    # The router's gradient reads the experts' outputs (where they live, sharded over expert:
    # they are not sent back); the combine einsum itself is dead.
    assert {"re-expert_out", "re-ep_dispatch", "re-moe_dispatch"} <= re
    assert not re & {"re-moe_combine", "re-expert_combine", "re-residual_mlp", "re-ep_combine"}
    mxu = lambda o: o.kind == OpKind.COMPUTE and o.unit == Unit.MXU  # noqa: E731
    recomputed = sum(o.flops for o in full.ops if o.name.startswith("re-") and mxu(o))
    layers_fwd = sum(o.flops for o in none.ops if o.phase == "fwd" and o.layer >= 0 and mxu(o)
                     and o.name != "moe_combine")
    assert recomputed == pytest.approx(layers_fwd, rel=1e-9)


def test_moe_backward_sends_the_combine_weights_gradient_as_xla_does():
    # XLA's program (validation/xla_moe_schedule.py): six synchronous all-to-alls per layer
    # (forward dispatch and combine; backward the recomputed dispatch, the combine's and the
    # dispatch's transposes, and the combine-weight gradient) and an all-gather of the output
    # gradient over expert. MaxText's combine mask is bf16 (the bf16 top-k weights times an
    # int32 one-hot over cap + 1 slots, the first cut off), and XLA sends its gradient before
    # the cut: bf16 [tokens, E, cap + 1], as large as the token buffer, not twice it in f32.
    from workloads.moe import MoeConfig

    trace, _ = _step("fsdp=2,expert=2", "2x2", model=TINY_MOE, remat=Remat.FULL,
                     moe=MoeConfig(capacity_factor=1.0))
    spec = model_from_dict(TINY_MOE)
    n, D, E, ep = 2 * 128, spec.d_model, spec.num_experts, 2  # tokens per chip, ...
    cap = math.ceil(128 * spec.experts_per_token / E) * 1.0  # per sequence (MaxText)
    a2a = [o for o in trace.ops if o.collective == "all-to-all" and o.layer == 0]
    assert sorted(o.name for o in a2a) == sorted([
        "ep_dispatch", "ep_combine", "re-ep_dispatch", "ep_combine_bwd", "ep_dispatch_bwd",
        "ep_combine_weights_grad"])
    tokens_v = ep * n * (E * cap / 128) * D * 2  # the padded bf16 token buffer, all chips
    assert {o.name: o.bytes for o in a2a if o.name != "ep_combine_weights_grad"} == \
        dict.fromkeys(["ep_dispatch", "ep_combine", "re-ep_dispatch", "ep_combine_bwd",
                       "ep_dispatch_bwd"], pytest.approx(tokens_v, rel=1e-12))
    dc = next(o for o in a2a if o.name == "ep_combine_weights_grad")
    assert dc.bytes == pytest.approx(ep * n * E * (cap + 1) * 2, rel=1e-12)
    ag = [o for o in trace.ops if o.name == "ep_grad_allgather"]
    assert len(ag) == spec.num_layers and ag[0].mesh_axes == ("expert",)
    assert ag[0].bytes == pytest.approx(ep * n * D * 2, rel=1e-12)
    # Synchronous: the weight gradients wait for the dispatch transpose, the combine-weight
    # gradient for them, and the layer's input gradient for it.
    by = {o.id: o for o in trace.ops}
    dw = next(o for o in trace.ops if o.name == "mlp_bwd_weights" and o.layer == 0)
    assert "ep_dispatch_bwd" in {by[i].name for i in dw.deps}
    assert dw.id in dc.deps
    nrm = next(o for o in trace.ops if o.name == "norm_mlp_bwd" and o.layer == 0)
    # ... through the router's backward (its input and weight gradients: 4 n D E FLOPs).
    rb = next(o for o in trace.ops if o.name == "router_bwd" and o.layer == 0)
    assert dc.id in rb.deps and rb.id in nrm.deps
    assert rb.flops == 4 * n * D * E


def test_async_ep_alltoall_lets_the_backward_overlap_the_expert_collectives():
    from workloads.moe import MoeConfig

    def step(mode):
        return _step("fsdp=2,expert=2", "2x2", model=TINY_MOE, remat=Remat.FULL,
                     moe=MoeConfig(capacity_factor=1.0), ep_alltoall=mode)

    (sync, rs), (asyn, ra) = step("sync"), step("async")
    # Same program (ops, FLOPs, bytes), fewer orderings.
    assert [(o.name, o.flops, o.bytes) for o in sync.ops] == \
        [(o.name, o.flops, o.bytes) for o in asyn.ops]
    by = {o.id: o for o in asyn.ops}
    dw = next(o for o in asyn.ops if o.name == "mlp_bwd_weights" and o.layer == 0)
    assert "ep_dispatch_bwd" not in {by[i].name for i in dw.deps}
    dc = next(o for o in asyn.ops if o.name == "ep_combine_weights_grad" and o.layer == 0)
    assert [by[i].name for i in dc.deps] == ["moe_combine_bwd"]
    assert ra.step_time_s <= rs.step_time_s
    with pytest.raises(TpusimError, match="ep_alltoall 'overlap' must be sync"):
        TrainingConfig(seq_len=128, batch_per_chip=1, ep_alltoall="overlap")


def test_remat_minimal_recomputes_only_vpu_work():
    none, _ = _step("fsdp=4", "2x2", remat=Remat.NONE)
    minimal, _ = _step("fsdp=4", "2x2", remat=Remat.MINIMAL)
    assert _mxu_flops(minimal) == _mxu_flops(none)
    vpu = lambda t: sum(o.flops for o in t.ops if o.kind == OpKind.COMPUTE and o.unit == Unit.VPU)
    assert vpu(minimal) > vpu(none)


def test_flash_attention_counts_the_causal_half_forward_and_2_5x_backward():
    dot, _ = _step("fsdp=1", "1x1", remat=Remat.NONE, attention="dot")
    flash, _ = _step("fsdp=1", "1x1", remat=Remat.NONE, attention="flash")
    m = model_from_dict(TINY)
    unit = 256 * 128 * m.num_heads * m.head_dim * m.num_layers  # tokens·T·N·H·L
    # dot: 4 (fwd) + 8 (bwd) units; flash: 2 (causal fwd) + 2.5 x 2 (bwd recomputes scores).
    assert _mxu_flops(dot) - _mxu_flops(flash) == pytest.approx((12 - 7) * unit, rel=1e-9)


def test_model_flops_in_the_summary_are_six_p_t_plus_causal_attention(tiny_yaml, capsys):
    rc, out, _ = _cli(capsys, *_train_args(tiny_yaml, "--json"))
    assert rc == 0
    s = json.loads(out)
    m = model_from_dict(TINY)
    tokens = 2 * 4 * 128
    dot = _textbook_training_flops(m, tokens, 128)
    causal = dot - 6 * tokens * 128 * m.num_heads * m.head_dim * m.num_layers
    assert s["model_flops_per_chip"] == pytest.approx(causal / 4, rel=1e-9)
    assert s["mfu"] == pytest.approx(
        s["model_flops_per_chip"] / (s["step_time_s"] * get_chip("v5e").mxu_flops_per_s)
    )


@pytest.mark.parametrize("attention,names", [("flash", ("flash_attention",)),
                                             ("dot", ("attn_scores", "attn_values"))])
def test_attention_hbm_bytes_scale_with_the_sequences_per_chip(attention, names):
    def bytes_of(bpc):
        trace, _ = _step("fsdp=1", "1x1", batch_per_chip=bpc, attention=attention,
                         remat=Remat.NONE)
        return {o.name: o.hbm_bytes for o in trace.ops
                if o.layer == 0 and o.phase == "fwd" and o.name in names}

    one, four = bytes_of(1), bytes_of(4)
    assert set(one) == set(names)
    m = model_from_dict(TINY)
    if attention == "flash":  # Q and O, plus K and V, of 4 x 128 tokens, bf16
        tokens = 4 * 128
        qo = 2 * tokens * m.num_heads * m.head_dim * 2
        kv = 2 * tokens * m.num_kv_heads * m.head_dim * 2
        assert four["flash_attention"] == qo + kv
    for name in names:  # everything an attention op touches is per sequence
        assert four[name] == 4 * one[name], name


# -- (b) one chip, compute only ----------------------------------------------------------------


@pytest.mark.parametrize(
    "remat,overrides",
    [(Remat.NONE, {}), (Remat.FULL, {}), (Remat.NONE, {"op_overhead_s": 1e-6}),
     (Remat.FULL, {"mxu_efficiency": 0.5, "vpu_efficiency": 0.7, "hbm_efficiency": 0.8})],
)
def test_single_chip_step_is_the_roofline_sum_and_at_least_mxu_flops_over_peak(remat, overrides):
    chip = get_chip("v5e").with_overrides(**overrides)
    trace, res = _step("fsdp=1", "1x1", model=MID, chip=chip, seq_len=512, batch_per_chip=4,
                       remat=remat)
    assert not any(o.kind == OpKind.COLLECTIVE for o in trace.ops)
    mxu = _mxu_flops(trace)
    assert res.step_time_s >= mxu / chip.mxu_flops_per_s
    roofline = 0.0
    for o in trace.ops:
        assert o.kind == OpKind.COMPUTE
        peak = chip.mxu_flops_per_s * chip.mxu_efficiency if o.unit == Unit.MXU \
            else chip.vpu_flops_per_s * chip.vpu_efficiency
        roofline += max(o.flops / peak, o.hbm_bytes / (chip.hbm_bytes_per_s
                                                      * chip.hbm_efficiency))
        roofline += chip.op_overhead_s
    # One core, ops in program order, nothing to wait for: the step is the sum of op rooflines.
    assert res.step_time_s == pytest.approx(roofline, rel=1e-9)
    assert res.breakdown["exposed_comm_s"] == 0.0
    assert res.breakdown["mxu_compute_s"] > 0.4 * res.step_time_s  # MXU-bound model


def test_single_chip_ops_run_back_to_back_in_program_order():
    _, res = _step("fsdp=1", "1x1")
    ops = res.ops
    assert (ops.start_s.iloc[1:].to_numpy() == ops.end_s.iloc[:-1].to_numpy()).all()
    assert ops.start_s.iloc[0] == 0.0
    assert ops.end_s.iloc[-1] == pytest.approx(res.step_time_s, rel=1e-12)


# -- (c) FSDP and overlap ----------------------------------------------------------------------


def test_fsdp_with_more_chips_and_same_per_chip_batch_adds_gathers():
    one, r1 = _step("fsdp=1", "1x1")
    four, r4 = _step("fsdp=4", "2x2")
    sixteen, r16 = _step("fsdp=16", "4x4")
    gathers = lambda t: [o for o in t.ops if o.collective == "all-gather"]
    assert gathers(one) == []
    assert len(gathers(four)) > 0 and len(gathers(sixteen)) == len(gathers(four))
    assert all(o.mesh_axes == ("fsdp",) for o in gathers(four))
    # Same per-chip batch -> the same matmul work on every chip.
    assert _mxu_flops(one) == _mxu_flops(four) == _mxu_flops(sixteen)
    assert r1.breakdown["exposed_comm_s"] == 0.0
    assert r4.breakdown["exposed_comm_s"] > 0.0
    assert r4.step_time_s > r1.step_time_s


OVERLAP_CASES = [
    ("fsdp=4", "2x2", {}),
    ("fsdp=16", "4x4", {"batch_per_chip": 1}),
    ("fsdp=4,tensor=4", "4x4", {"remat": Remat.NONE}),
    ("data=2,fsdp=2", "2x2", {"remat": Remat.MINIMAL}),
    ("fsdp=4", "2x2", {"model": MID, "batch_per_chip": 1, "attention": "dot"}),
]


@pytest.mark.parametrize("mesh,shape,kw", OVERLAP_CASES)
def test_no_overlap_is_never_faster_and_exposes_more_communication(mesh, shape, kw):
    _, ov = _step(mesh, shape, overlap=True, **kw)
    _, blocking = _step(mesh, shape, overlap=False, **kw)
    assert blocking.step_time_s >= ov.step_time_s
    assert blocking.breakdown["exposed_comm_s"] > ov.breakdown["exposed_comm_s"]


def test_no_overlap_is_never_faster_for_an_hbm_bound_fsdp_step():
    model = {**TINY, "num_layers": 4, "num_kv_heads": 4, "mlp": "relu"}
    kw = {"model": model, "seq_len": 256, "batch_per_chip": 8, "remat": Remat.NONE}
    _, ov = _step("fsdp=4", "2x2", overlap=True, **kw)
    _, blocking = _step("fsdp=4", "2x2", overlap=False, **kw)
    # Regression: HBM used to stay throttled for a whole op after a collective ended.
    assert blocking.step_time_s >= ov.step_time_s


def test_backward_weight_gather_is_prefetched_at_most_one_layer_ahead():
    model = {**TINY, "num_layers": 4}
    trace, res = _step("fsdp=4", "2x2", model=model)
    ops = res.ops
    first_bwd_gather = ops[ops.name.str.startswith("fsdp_allgather_bwd_")].iloc[0]
    assert first_bwd_gather.layer == 3
    fwd_of_last_layer = ops[(ops.layer == 3) & (ops.phase == "fwd") & (ops.kind == "compute")]
    assert first_bwd_gather.start_s >= fwd_of_last_layer.start_s.min()


def test_cli_no_overlap_flag_is_never_faster(tiny_yaml, capsys):
    rc, out, _ = _cli(capsys, *_train_args(tiny_yaml, "--json"))
    rc2, out2, _ = _cli(capsys, *_train_args(tiny_yaml, "--json", "--no-overlap"))
    assert rc == rc2 == 0
    a, b = json.loads(out), json.loads(out2)
    assert b["step_time_s"] >= a["step_time_s"]
    assert b["breakdown"]["exposed_comm_s"] > a["breakdown"]["exposed_comm_s"]


# -- (d) breakdown -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh,shape,kw",
    [
        ("fsdp=1", "1x1", {}),
        ("fsdp=4", "2x2", {"overlap": False}),
        ("fsdp=2,tensor=2", "2x2", {"remat": Remat.OFFLOAD}),
        ("pipeline=2,fsdp=2", "2x2", {"microbatches": 2}),
        ("fsdp=4", "2x2", {"model": MID, "remat": Remat.NONE, "attention": "dot"}),
    ],
)
def test_breakdown_components_sum_to_the_step_time(mesh, shape, kw):
    _, res = _step(mesh, shape, **kw)
    assert tuple(res.breakdown) == BREAKDOWN_KEYS
    assert all(v >= 0 for v in res.breakdown.values())
    assert sum(res.breakdown.values()) == pytest.approx(res.step_time_s, rel=1e-9)


# -- (e) memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh,shape,shards", [("fsdp=1", "1x1", 1), ("fsdp=4", "2x2", 4),
                                               ("fsdp=2,tensor=2", "2x2", 4)])
def test_static_bytes_are_params_and_adam_state_of_the_local_shard(mesh, shape, shards):
    trace, _ = _step(mesh, shape)
    m = model_from_dict(TINY)
    sharded = m.num_attention_params + m.num_mlp_params + m.num_embedding_params
    local = sharded / shards + m.num_norm_params  # norm scales are tiny and replicated
    # bf16 params (2) + two fp32 Adam moments (8) = 10 bytes per parameter (tpu.md §4) are the
    # step's arguments, resident throughout; the bf16 gradients (2) are backward temporaries.
    assert trace.meta.static_hbm_bytes == pytest.approx(10 * local, rel=1e-3)
    parts = trace.meta.static_breakdown
    assert parts["params"] + parts["optimizer"] == pytest.approx(
        trace.meta.static_hbm_bytes, rel=1e-12)
    assert parts["grads"] == pytest.approx(parts["params"], rel=1e-12)
    assert parts["optimizer"] == pytest.approx(4 * parts["params"], rel=1e-12)


def test_static_bytes_follow_the_dtype_flags():
    base, _ = _step("fsdp=4", "2x2")
    wide, _ = _step("fsdp=4", "2x2", param_dtype="fp32", grad_dtype="fp32")
    p = base.meta.params_per_chip
    assert wide.meta.static_hbm_bytes - base.meta.static_hbm_bytes == pytest.approx(2 * p)
    assert wide.meta.static_breakdown["grads"] == pytest.approx(4 * p)


def test_f32_params_gathered_in_bf16_move_bf16_bytes_and_keep_f32_master_weights():
    # flax's param_dtype=float32 with dtype=bfloat16 (MaxText's default): XLA casts each f32
    # shard to bf16 once and gathers, multiplies and reduce-scatters in bf16 (the v5e and v6e
    # fsdp=16 compiles: every collective's bytes equal the bf16-param program's).
    base, base_res = _step("fsdp=4", "2x2")
    f32, f32_res = _step("fsdp=4", "2x2", param_dtype="fp32", gather_dtype="bf16")
    p = f32.meta.params_per_chip

    def colls(t):
        return [(o.name, o.bytes) for o in t.ops if o.kind == OpKind.COLLECTIVE]

    def matmuls(t):
        return [(o.name, o.flops, o.hbm_bytes) for o in t.ops if o.unit == Unit.MXU]

    assert colls(f32) == colls(base) and colls(base)
    assert matmuls(f32) == matmuls(base)
    assert f32.meta.static_hbm_bytes - base.meta.static_hbm_bytes == pytest.approx(2 * p)
    # The scanned backward keeps the local gradient shards in the params' dtype (XLA's stacked
    # f32 gradient): 4 bytes per parameter allocated, against bf16's 2.

    def grads_held(t):
        return sum(d for _, cat, d in t.meta.memory_events if cat == "gradients" and d > 0)

    assert grads_held(base) == pytest.approx(2 * p)
    assert grads_held(f32) == pytest.approx(4 * p)
    assert 2 * p <= f32_res.hbm_peak_bytes - base_res.hbm_peak_bytes <= 4 * p + 1e-6
    # One cast of the local shard per step: read 4 bytes, write 2 per parameter.
    (cast,) = [o for o in f32.ops if o.name == "weight_cast"]
    assert (cast.unit, cast.flops, cast.hbm_bytes) == (Unit.VPU, pytest.approx(p),
                                                       pytest.approx(6 * p))
    assert not [o for o in base.ops if o.name == "weight_cast"]
    # Nothing is gathered before its shard is cast: the embedding's and the first layer's
    # prefetched gathers wait for the cast.
    first = [o for o in f32.ops if o.kind == OpKind.COLLECTIVE and o.phase == "fwd"
             and o.name.startswith("fsdp_allgather") and o.layer <= 0]
    assert len(first) > 1 and all(cast.id in o.deps for o in first)
    # Adam reads and writes the f32 weights: 2 x 2 bytes per parameter more than bf16's.
    (upd,) = [o for o in f32.ops if o.name == "adam_update"]
    (bupd,) = [o for o in base.ops if o.name == "adam_update"]
    assert upd.hbm_bytes - bupd.hbm_bytes == pytest.approx(4 * p)


def test_gather_dtype_defaults_to_the_param_dtype():
    same, _ = _step("fsdp=4", "2x2", param_dtype="fp32")
    explicit, _ = _step("fsdp=4", "2x2", param_dtype="fp32", gather_dtype="fp32")
    base, _ = _step("fsdp=4", "2x2")
    assert same.ops == explicit.ops
    assert not [o for o in same.ops if o.name == "weight_cast"]
    gathers = [o for o in base.ops if o.name.startswith("fsdp_allgather")]
    assert gathers
    wide = {o.name: o.bytes for o in same.ops if o.kind == OpKind.COLLECTIVE}
    for g in gathers:  # f32 weights gathered in f32: twice the bytes
        assert wide[g.name] == pytest.approx(2 * g.bytes)


def test_an_unknown_gather_dtype_is_refused_naming_the_flag():
    with pytest.raises(TpusimError, match=r"gather_dtype 'fp9' is not a known dtype"):
        TrainingConfig(seq_len=128, batch_per_chip=1, gather_dtype="fp9")
    with pytest.raises(TpusimError, match=r"gather_dtype 2 must be a dtype name"):
        TrainingConfig(seq_len=128, batch_per_chip=1, gather_dtype=2)


@pytest.mark.parametrize("field", ["param_dtype", "grad_dtype", "optimizer_dtype"])
def test_a_dtype_that_is_not_text_is_refused_naming_the_flag(field):
    # Python callers can pass anything (an int was an AttributeError from str.lower).
    with pytest.raises(TpusimError, match=f"{field} 2 must be a dtype name; the nearest are "):
        TrainingConfig(seq_len=128, batch_per_chip=1, **{field: 2})


def test_an_optimizer_dtype_with_sgd_is_refused_as_changing_nothing(tiny_yaml, capsys):
    with pytest.raises(TpusimError, match=r"optimizer_dtype 'bf16' with optimizer sgd: it "
                                          r"keeps no optimizer state"):
        TrainingConfig(seq_len=128, batch_per_chip=1, optimizer="sgd", optimizer_dtype="bf16")
    # The default (fp32, however spelled) is no choice: accepted, as Adam's bf16 moments.
    for kw in ({"optimizer": "sgd", "optimizer_dtype": "F32"},
               {"optimizer": "adam", "optimizer_dtype": "bf16"}):
        TrainingConfig(seq_len=128, batch_per_chip=1, **kw)
    _assert_one_line_error(capsys, [*_train_args(tiny_yaml, mesh="fsdp=4"), "--optimizer", "sgd",
                                    "--optimizer-dtype", "bf16"],
                           "drop --optimizer-dtype or use --optimizer adam")


def test_sgd_keeps_no_optimizer_state_and_its_update_moves_weights_and_gradients_only():
    adam, _ = _step("fsdp=4", "2x2")
    sgd, res = _step("fsdp=4", "2x2", optimizer="sgd")
    p = sgd.meta.params_per_chip
    assert sgd.meta.optimizer == "sgd" and adam.meta.optimizer == "adam"
    # Adam's two fp32 moments (8 bytes per parameter) are gone; the bf16 params remain.
    assert adam.meta.static_hbm_bytes - sgd.meta.static_hbm_bytes == pytest.approx(8 * p)
    assert sgd.meta.static_breakdown["optimizer"] == 0
    (upd,) = [o for o in sgd.ops if o.phase == "optimizer" and o.kind == OpKind.COMPUTE]
    (aupd,) = [o for o in adam.ops if o.phase == "optimizer" and o.kind == OpKind.COMPUTE]
    # w -= lr * g: read w and g, write w (2 + 2 + 2 bytes, 2 FLOPs) per parameter; Adam also
    # reads and writes both moments (+16 bytes).
    assert (upd.name, upd.flops, upd.hbm_bytes) == ("sgd_update", pytest.approx(2 * p),
                                                    pytest.approx(6 * p))
    assert aupd.hbm_bytes - upd.hbm_bytes == pytest.approx(16 * p)
    assert res.hbm_peak_bytes < _step("fsdp=4", "2x2")[1].hbm_peak_bytes


@pytest.mark.parametrize("params,bytes_per_param", [("bf16", 22), ("fp32", 26)])
def test_the_adam_update_reads_and_writes_the_shard_its_gradient_and_both_moments(
        params, bytes_per_param):
    # Per local parameter: 12 FLOPs; reads w, g, m, v and writes w, m, v: bf16 weights
    # 2 + 2 + 8 + 2 + 8 = 22 bytes (tpu.md §4's fp32 moments), f32 weights cast to bf16 for
    # their gathers 26 (the v6e / v5e fsdp=16 f32 programs: XLA's estimate 1.17-1.18x).
    trace, _ = _step("fsdp=4", "2x2", param_dtype=params, gather_dtype="bf16")
    p = trace.meta.params_per_chip
    (upd,) = [o for o in trace.ops if o.phase == "optimizer" and o.kind == OpKind.COMPUTE]
    assert (upd.name, upd.unit) == ("adam_update", Unit.VPU)
    assert upd.flops == pytest.approx(12 * p, rel=1e-12)
    assert upd.hbm_bytes == pytest.approx(bytes_per_param * p, rel=1e-12)


def test_an_unknown_optimizer_is_refused_with_the_known_ones():
    with pytest.raises(TpusimError, match="optimizer 'lion' is not an optimizer; use one "
                                          "of: adam, sgd"):
        TrainingConfig(seq_len=128, batch_per_chip=1, optimizer="lion")


def test_a_remat_policy_given_as_text_is_parsed_or_refused_in_one_line():
    # The Python API may pass the policy as text: it compiles as the enum does, and a bad one
    # is refused when the config is made (it was an AttributeError inside the compiler).
    assert TrainingConfig(seq_len=128, batch_per_chip=1, remat="offload").remat is Remat.OFFLOAD
    text, _ = _step("fsdp=4", "2x2", remat="minimal")
    enum, _ = _step("fsdp=4", "2x2", remat=Remat.MINIMAL)
    assert text.ops == enum.ops
    for bad in ("bogus", 3, None):
        with pytest.raises(TpusimError,
                           match=r"^remat .* is not a remat policy; (the nearest|did you mean) "):
            TrainingConfig(seq_len=128, batch_per_chip=1, remat=bad)


def test_remat_and_optimizer_parsers_share_one_wording_and_cut_long_values():
    from workloads.training import parse_optimizer, parse_remat

    for parse, flag, what, known in ((parse_remat, "remat", "a remat policy", Remat),
                                     (parse_optimizer, "optimizer", "an optimizer",
                                      Optimizer)):
        assert [parse(k.value) for k in known] == list(known)
        for bad in ("bogus", "x" * 5000, 7, None):
            with pytest.raises(TpusimError) as exc:
                parse(bad)
            msg = str(exc.value)
            assert msg.startswith(f"{flag} ") and f" is not {what}; " in msg
            # At most five names, each a real choice (all of them when there are five or fewer).
            tail = msg.split(f" is not {what}; ", 1)[1]
            names = [k.value for k in known if k.value in re.findall(r"[\w.-]+", tail)]
            assert 1 <= len(names) <= 5 and (len(known) > 5 or len(names) == len(known))
            # One line, the bad value cut short (the list of 16 remat policies is ~270 chars).
            assert "\n" not in msg and len(msg) < 400


def test_memory_table_starts_at_the_static_bytes_and_peak_covers_it():
    trace, res = _step("fsdp=4", "2x2")
    mem = res.memory
    assert list(mem.columns) == ["chip", "time_s", "hbm_bytes", *MEMORY_CATEGORIES]
    assert mem.hbm_bytes.iloc[0] == trace.meta.static_hbm_bytes
    assert mem.time_s.is_monotonic_increasing
    # Every row's categories add up to its total, and the peak is the table's maximum.
    assert mem[list(MEMORY_CATEGORIES)].sum(axis=1).to_numpy() == pytest.approx(
        mem.hbm_bytes.to_numpy(), rel=1e-12)
    assert res.hbm_peak_bytes == pytest.approx(mem.hbm_bytes.max(), rel=1e-12)
    assert sum(res.hbm_peak_breakdown.values()) == pytest.approx(res.hbm_peak_bytes, rel=1e-12)
    assert res.fits_in_hbm and res.hbm_capacity_bytes == get_chip("v5e").hbm_bytes


@pytest.mark.parametrize("attention", ["dot", "flash"])
def test_remat_none_peaks_above_minimal_above_full(attention):
    # Enough tokens per chip (1024) that saved activations, not gathered weights, set the peak.
    peak = {}
    for r in (Remat.NONE, Remat.MINIMAL, Remat.FULL, Remat.OFFLOAD):
        _, res = _step("fsdp=4", "2x2", remat=r, attention=attention, batch_per_chip=8)
        peak[r] = res.hbm_peak_bytes
    # Offload keeps less than minimal on device but is not bounded by full: its backward keeps
    # the MLP's tensors through the attention's backward, which full frees before it (XLA's
    # v5e and v6e fsdp=16 programs peak higher under offload than under full).
    assert peak[Remat.NONE] > peak[Remat.MINIMAL] > peak[Remat.FULL]
    assert peak[Remat.MINIMAL] > peak[Remat.OFFLOAD]


def test_memory_returns_to_the_static_state_after_the_step():
    trace, res = _step("fsdp=4", "2x2", remat=Remat.NONE)
    assert res.memory.hbm_bytes.iloc[-1] == pytest.approx(trace.meta.static_hbm_bytes)


def test_big_model_on_one_chip_reports_overflow_instead_of_crashing(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(BIG))
    rc, out, err = _cli(capsys, "train", "--chip", "v5e", "--shape", "1x1", "--model",
                        str(path), "--seq-len", "128", "--batch-per-chip", "1",
                        "--mesh", "fsdp=1", "--json")
    assert rc == 0 and err == ""
    s = json.loads(out)
    assert s["fits_in_hbm"] is False
    assert s["memory"]["overflow_bytes"] > 0
    assert s["memory"]["overflow_bytes"] == pytest.approx(
        s["hbm_peak_bytes"] - s["hbm_capacity_bytes"])
    assert s["memory"]["static_bytes"] > s["hbm_capacity_bytes"]


# -- (f) determinism ---------------------------------------------------------------------------


def test_two_replays_give_identical_tables():
    chip = get_chip("v5e")
    topo = _pod(chip, "2x2")
    trace = compile_training_step(model_from_dict(TINY), parse_mesh("fsdp=2,tensor=2"), 4,
                                  TrainingConfig(seq_len=128, batch_per_chip=2))
    a, b = replay(trace, chip, topo), replay(trace, chip, topo)
    assert a.ops.equals(b.ops)
    assert a.memory.equals(b.memory) and a.units.equals(b.units) and a.links.equals(b.links)
    assert a.step_time_s == b.step_time_s and a.breakdown == b.breakdown


def test_cli_train_json_is_byte_identical_twice(tiny_yaml, capsys):
    args = _train_args(tiny_yaml, "--json", mesh="fsdp=2,tensor=2")
    rc1, out1, _ = _cli(capsys, *args)
    rc2, out2, _ = _cli(capsys, *args)
    assert rc1 == rc2 == 0
    assert out1.encode() == out2.encode()


# -- (g) what-if hardware ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh,shape,kw",
    [("fsdp=16", "4x4", {"batch_per_chip": 1}), ("fsdp=4,tensor=4", "4x4", {"overlap": False}),
     ("fsdp=4", "2x2", {"model": MID, "batch_per_chip": 1}), ("fsdp=1", "1x1", {})],
)
def test_faster_ici_never_slows_a_step(mesh, shape, kw):
    chip = get_chip("v5e")
    fast = chip.with_overrides(ici_link_bytes_per_s=2 * chip.ici_link_bytes_per_s)
    _, base = _step(mesh, shape, chip=chip, **kw)
    _, quick = _step(mesh, shape, chip=fast, **kw)
    assert quick.step_time_s <= base.step_time_s


def test_faster_ici_speeds_up_a_comm_bound_step():
    chip = get_chip("v5e")
    fast = chip.with_overrides(ici_link_bytes_per_s=2 * chip.ici_link_bytes_per_s)
    _, base = _step("fsdp=16", "4x4", chip=chip, batch_per_chip=1, model=MID)
    assert base.breakdown["exposed_comm_s"] > 0.3 * base.step_time_s  # comm-bound
    _, quick = _step("fsdp=16", "4x4", chip=fast, batch_per_chip=1, model=MID)
    assert quick.step_time_s < 0.9 * base.step_time_s
    assert quick.breakdown["exposed_comm_s"] < base.breakdown["exposed_comm_s"]


def test_double_hbm_bandwidth_speeds_up_an_hbm_bound_step():
    # The MXU at its peak (the roofline), so that even with twice the bandwidth no op of the
    # tiny model turns MXU-bound. Without fusion every op streams through HBM (HBM-bound).
    chip = get_chip("v5e").with_overrides(mxu_efficiency=1.0)
    _, base = _step("fsdp=1", "1x1", chip=chip, fuse_elementwise=False)
    assert base.breakdown["hbm_bound_s"] == pytest.approx(base.step_time_s)
    _, quick = _step("fsdp=1", "1x1", fuse_elementwise=False,
                     chip=chip.with_overrides(hbm_bytes_per_s=2 * chip.hbm_bytes_per_s))
    assert quick.step_time_s == pytest.approx(base.step_time_s / 2, rel=0.05)


# -- (h) errors --------------------------------------------------------------------------------


def _assert_one_line_error(capsys, argv, *needles):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2, (argv, out, err)
    assert out == ""
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)


def test_cli_mesh_product_not_chip_count(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, mesh="fsdp=2"), "fsdp=2", "4")


def test_cli_ep_alltoall_must_be_sync_or_async(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--ep-alltoall", "overlap"),
                           "--ep-alltoall 'overlap'", "sync", "async")


def test_cli_fsdp_grad_must_be_reduce_scatter_all_reduce_or_auto(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--fsdp-grad", "ring"),
                           "--fsdp-grad 'ring'", "reduce-scatter", "all-reduce", "auto")


def test_cli_dp_grad_split_must_be_per_matrix_or_per_layer(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--dp-grad-split", "per-step"),
                           "--dp-grad-split 'per-step'", "per-matrix", "per-layer")


def test_cli_fsdp_grad_auto_refuses_windowed_gathers(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--fsdp-grad", "auto",
                                               "--fsdp-gather", "windowed"),
                           "--fsdp-grad auto with --fsdp-gather windowed", "mixed-async")


def test_cli_fsdp_grad_auto_runs_with_a_mixed_mode(tiny_yaml, capsys):
    rc, out, err = _cli(capsys, *_train_args(tiny_yaml, "--fsdp-grad", "auto",
                                             "--fsdp-gather", "mixed-blocking", "--json"))
    assert rc == 0, err
    assert json.loads(out)["inputs"]["flags"]["fsdp-grad"] == "auto"


def test_cli_fsdp_grad_all_reduce_refuses_collective_matmuls(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--fsdp-grad", "all-reduce",
                                               "--fsdp-gather", "windowed"),
                           "--fsdp-gather windowed", "async or blocking")


def test_cli_fsdp_grad_all_reduce_with_a_mixed_mode_says_the_mode_chooses(tiny_yaml, capsys):
    _assert_one_line_error(capsys, _train_args(tiny_yaml, "--fsdp-grad", "all-reduce",
                                               "--fsdp-gather", "mixed-async"),
                           "--fsdp-gather mixed-async", "choose each gradient's collective",
                           "drop --fsdp-grad")


def test_cli_tensor_must_divide_heads(tmp_path, capsys):
    path = tmp_path / "six.yaml"
    path.write_text(yaml.safe_dump({**TINY, "num_heads": 6, "num_kv_heads": 6}))
    _assert_one_line_error(capsys, _train_args(str(path), mesh="tensor=4"),
                           "tensor=4", "num_heads = 6")


def test_cli_tensor_must_divide_d_ff(tmp_path, capsys):
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump({**TINY, "num_kv_heads": 4, "d_ff": 1022}))
    _assert_one_line_error(capsys, _train_args(str(path), mesh="tensor=4"),
                           "tensor=4", "d_ff = 1022")


def test_cli_batch_must_divide_by_data_times_fsdp(tiny_yaml, capsys):
    argv = _train_args(tiny_yaml, mesh="data=2,fsdp=2")
    argv[argv.index("--batch-per-chip") + 1] = "0.5"
    _assert_one_line_error(capsys, argv, "2 sequences", "data x fsdp")


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--remat", "sometimes", "--remat 'sometimes'"),
        ("--seq-len", "0", "--seq-len 0"),
        ("--seq-len", "-128", "--seq-len -128"),
        ("--batch-per-chip", "0", "--batch-per-chip 0"),
        ("--batch-per-chip", "-2", "--batch-per-chip -2"),
        ("--model", "llama9-1t", "unknown model 'llama9-1t'"),
        ("--attention", "sparse", "--attention 'sparse'"),
        ("--microbatches", "0", "--microbatches 0"),
    ],
)
def test_cli_bad_training_flags_are_one_line_errors(tiny_yaml, capsys, flag, value, needle):
    argv = _train_args(tiny_yaml)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    _assert_one_line_error(capsys, argv, needle)


def test_cli_infinite_batch_is_a_one_line_error(tiny_yaml, capsys):
    argv = _train_args(tiny_yaml)
    argv[argv.index("--batch-per-chip") + 1] = "inf"
    _assert_one_line_error(capsys, argv, "--batch-per-chip")


def test_cli_model_yaml_with_unknown_key(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({**TINY, "num_layer": 2}))
    _assert_one_line_error(capsys, _train_args(str(path)), "unknown key(s) num_layer",
                           "did you mean num_layers")


def test_python_dash_m_sim_cli_knows_the_train_command():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "train", "--help"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--batch-per-chip" in proc.stdout


def test_compile_errors_are_tpusim_errors_in_code():
    m = model_from_dict(TINY)
    cfg = TrainingConfig(seq_len=128, batch_per_chip=2)
    with pytest.raises(TpusimError, match=r"covers 2 chips but the pod has 4"):
        compile_training_step(m, parse_mesh("fsdp=2"), 4, cfg)
    with pytest.raises(TpusimError, match=r"needs an MoE model"):
        compile_training_step(m, parse_mesh("expert=4"), 4, cfg)
    with pytest.raises(TpusimError, match=r"pipeline=4 does not divide num_layers = 2"):
        compile_training_step(m, parse_mesh("pipeline=4"), 4, cfg)


# -- (i) trace files ---------------------------------------------------------------------------


def test_compile_then_replay_gives_the_train_step_time(tiny_yaml, tmp_path, capsys):
    pod = ["--chip", "v5e", "--shape", "2x2"]
    common = ["--model", tiny_yaml, "--seq-len", "128", "--batch-per-chip", "2",
              "--mesh", "fsdp=2,tensor=2", "--remat", "minimal"]
    rc, out, _ = _cli(capsys, "train", *pod, *common, "--json")
    assert rc == 0
    trained = json.loads(out)
    path = tmp_path / "f.trace"
    rc, out, _ = _cli(capsys, "compile", *pod, *common, "-o", str(path))
    assert rc == 0 and path.is_file()
    rc, out, _ = _cli(capsys, "replay", str(path), *pod, "--json")
    assert rc == 0
    replayed = json.loads(out)
    assert replayed["step_time_s"] == trained["step_time_s"]
    assert replayed["breakdown"] == trained["breakdown"]
    assert replayed["hbm_peak_bytes"] == trained["hbm_peak_bytes"]


def test_replay_on_a_pod_with_another_chip_count_is_an_error(tiny_yaml, tmp_path, capsys):
    path = tmp_path / "f.trace"
    rc, _, _ = _cli(capsys, "compile", "--chips", "4", "--model", tiny_yaml, "--seq-len", "128",
                    "--batch-per-chip", "2", "--mesh", "fsdp=4", "-o", str(path))
    assert rc == 0
    _assert_one_line_error(capsys, ["replay", str(path), "--chip", "v5e", "--shape", "4x4"],
                           "compiled for 4 chips", "16")
    # Same chip count, other hardware: allowed.
    rc, out, _ = _cli(capsys, "replay", str(path), "--chip", "v5p", "--shape", "2x2", "--json")
    assert rc == 0 and json.loads(out)["chip"] == "v5p"


def test_compile_refuses_chips_together_with_a_pod(tiny_yaml, tmp_path, capsys):
    # --chip would be ignored (the program compiled without the chip's memory rules).
    path = tmp_path / "f.trace"
    for pod in (["--chip", "v5e"], ["--shape", "2x2"], ["--slice", "v5e-4"], ["--slices", "2"],
                ["--wraparound", "none"]):
        _assert_one_line_error(capsys, ["compile", "--chips", "4", *pod, "--model", tiny_yaml,
                                        "--seq-len", "128", "--batch-per-chip", "2", "--mesh",
                                        "fsdp=4", "-o", str(path)],
                               f"--chips 4 and {' '.join(pod)}: give one")
        assert not path.exists()


# -- (j) pipeline and MoE ----------------------------------------------------------------------


def test_pipeline_bubble_is_reported_and_shrinks_with_more_microbatches():
    fractions = []
    for mb in (1, 2, 4):
        trace, res = _step("pipeline=2,fsdp=2", "2x2", batch_per_chip=4, microbatches=mb)
        assert any(o.collective == "collective-permute" and o.mesh_axes == ("pipeline",)
                   for o in trace.ops)
        bubble = res.breakdown["pipeline_bubble_s"]
        assert bubble > 0
        fractions.append(bubble / res.step_time_s)
        # GPipe/1F1B: (p - 1) idle slots of one microbatch's forward+backward, i.e. of the work
        # before the optimizer update; without the optimizer that is (p-1)/(m+p-1) of the step.
        ops = res.ops
        work = ops[ops.phase == "optimizer"].start_s.min()
        assert bubble == pytest.approx((2 - 1) * work / mb, rel=1e-9)
        assert bubble / (work + bubble) == pytest.approx(1 / (mb + 1), rel=1e-9)
    assert fractions[0] > fractions[1] > fractions[2]
    _, flat = _step("fsdp=4", "2x2", batch_per_chip=4)
    assert flat.breakdown["pipeline_bubble_s"] == 0.0


def test_moe_backward_has_two_all_to_alls_per_layer_like_the_forward():
    trace, _ = _step("expert=2,fsdp=2", "2x2", model=TINY_MOE, remat=Remat.NONE)
    for layer in range(TINY_MOE["num_layers"]):
        per_phase = {
            phase: [o.name for o in trace.ops if o.collective == "all-to-all"
                    and o.layer == layer and o.phase == phase]
            for phase in ("fwd", "bwd")
        }
        assert len(per_phase["fwd"]) == 2, per_phase
        assert len(per_phase["bwd"]) == 2, per_phase


def test_moe_with_expert_parallelism_emits_all_to_alls():
    trace, res = _step("expert=2,fsdp=2", "2x2", model=TINY_MOE)
    # (The untied embedding's lookup all-to-alls run over fsdp; the experts' over expert.)
    a2a = [o for o in trace.ops if o.collective == "all-to-all"
           and not o.name.startswith("embed_")]
    assert a2a and all(o.mesh_axes == ("expert",) for o in a2a)
    names = {o.name for o in a2a}
    assert {"ep_dispatch", "ep_combine"} <= names
    ops = res.ops
    ran = ops[(ops.collective == "all-to-all") & ~ops.name.str.startswith("embed_")]
    assert len(ran) == len(a2a) and (ran.end_s > ran.start_s).all()
    dense_trace, _ = _step("fsdp=4", "2x2", model=TINY_MOE)
    assert not any(o.collective == "all-to-all" and o.mesh_axes == ("expert",)
                   for o in dense_trace.ops)


def test_untied_embedding_is_looked_up_by_all_to_all_not_gathered():
    trace, _ = _step("fsdp=4", "2x2")  # TINY is untied
    spec = model_from_dict(TINY)
    gather = next(o for o in trace.ops if o.name == "fsdp_allgather_embed")
    assert gather.bytes == spec.vocab_size * spec.d_model * 2  # the output projection only
    names = {o.name for o in trace.ops}
    assert {"embed_lookup_alltoall", "embed_grad_alltoall"} <= names
    tied, _ = _step("fsdp=4", "2x2", model={**TINY, "tied_embeddings": True})
    assert not any(o.name.startswith("embed_") and o.kind == OpKind.COLLECTIVE
                   for o in tied.ops)


def test_fused_elementwise_ops_carry_no_hbm_bytes_but_keep_their_flops():
    fused, _ = _step("fsdp=1", "1x1")
    unfused, _ = _step("fsdp=1", "1x1", fuse_elementwise=False)
    by_name = {o.name: o for o in fused.ops}
    raw = {o.name: o for o in unfused.ops}
    for name in ("rotary", "residual_attn", "residual_mlp"):
        assert by_name[name].hbm_bytes == 0 and raw[name].hbm_bytes > 0
        assert by_name[name].flops == raw[name].flops > 0
    for name in ("norm_attn", "mlp_act"):  # fusions of their own in XLA's programs
        assert by_name[name].hbm_bytes == raw[name].hbm_bytes > 0


# -- tensor-parallel activation layouts -----------------------------------------------------


def _tp_ops(trace):
    return [o for o in trace.ops if o.kind == OpKind.COLLECTIVE and o.mesh_axes == ("tensor",)]


def test_sharded_tp_activations_move_the_same_bytes_as_replicated_all_reduces():
    sharded, _ = _step("fsdp=2,tensor=2", "2x2", tp_activations="sharded")
    replicated, _ = _step("fsdp=2,tensor=2", "2x2", tp_activations="replicated")
    s_kinds = {o.collective for o in _tp_ops(sharded) if o.layer >= 0}
    r_kinds = {o.collective for o in _tp_ops(replicated) if o.layer >= 0}
    assert s_kinds == {"all-gather", "reduce-scatter"} and r_kinds == {"all-reduce"}
    # An all-reduce is a reduce-scatter plus an all-gather of the same V (forward and backward;
    # the recomputation leaves out the dead reduction of the layer output in both cases).
    s_bytes = sum(o.bytes for o in _tp_ops(sharded) if o.layer >= 0
                  and not o.name.startswith("re-"))
    r_bytes = sum(o.bytes for o in _tp_ops(replicated) if o.layer >= 0
                  and not o.name.startswith("re-"))
    assert s_bytes == pytest.approx(2 * r_bytes)


def test_sharded_tp_activations_divide_saved_activations_by_tensor():
    sharded, _ = _step("fsdp=1,tensor=4", "2x2", tp_activations="sharded")
    replicated, _ = _step("fsdp=1,tensor=4", "2x2", tp_activations="replicated")
    assert sharded.meta.activation_bytes_estimate == pytest.approx(
        replicated.meta.activation_bytes_estimate / 4)


def test_collective_matmul_overlaps_tp_collectives_and_is_never_slower():
    trace, blocking = _step("fsdp=1,tensor=4", "2x2", model=MID, batch_per_chip=4)
    tr2, overlapped = _step("fsdp=1,tensor=4", "2x2", model=MID, batch_per_chip=4,
                            tp_comm="collective-matmul")
    assert overlapped.step_time_s <= blocking.step_time_s
    assert overlapped.breakdown["exposed_comm_s"] < blocking.breakdown["exposed_comm_s"]
    ops = overlapped.ops.set_index("op_id")
    by_id = {o.id: o for o in tr2.ops}
    rs = next(o for o in tr2.ops if o.name == "tp_reducescatter_attn")
    out = next(o for o in tr2.ops if o.name == "out_proj" and o.layer == rs.layer)
    # The reduce-scatter starts with the out-projection, not after it.
    assert ops.loc[rs.id, "start_s"] < ops.loc[out.id, "end_s"]
    assert by_id[rs.id].deps != (out.id,)


# -- gradient reductions cover every axis a weight is replicated on -----------------------


def _reduced_bytes(trace, axis: str) -> float:
    return sum(o.bytes for o in trace.ops
               if o.kind == OpKind.COLLECTIVE and o.collective == "all-reduce"
               and axis in o.mesh_axes and o.phase == "bwd" and o.name.startswith("dp_grad"))


@pytest.mark.parametrize("axis", ["data", "sequence"])
def test_every_weight_gradient_is_all_reduced_over_replicating_axes(axis):
    spec = model_from_dict(TINY)
    trace, _ = _step(f"{axis}=4", "2x2")
    matmul_params = spec.num_params - spec.num_norm_params
    # bf16 matmul weights; the norm scales' gradients in f32 (with the embedding's).
    assert _reduced_bytes(trace, axis) == pytest.approx(
        2 * matmul_params + 4 * spec.num_norm_params, rel=1e-9)


def test_with_fsdp_the_data_all_reduce_carries_the_fsdp_shard():
    spec = model_from_dict(TINY)
    trace, _ = _step("data=2,fsdp=2", "2x2")
    matmul_params = spec.num_params - spec.num_norm_params
    # The replicated norm scales' f32 gradients: one all-reduce over data x fsdp (XLA's v6e
    # data x fsdp program), none of them in the embedding's data all-reduce. The input table
    # (smaller here than all chips' gradient rows) is all-reduced whole over data x fsdp
    # instead of its fsdp shard over data.
    table = spec.vocab_size * spec.d_model * 2
    (tr,) = [o for o in trace.ops if o.name == "embed_grad_table_allreduce"]
    assert tr.bytes == table and tr.mesh_axes == ("data", "fsdp")
    assert _reduced_bytes(trace, "data") == pytest.approx(
        (2 * matmul_params - table) / 2, rel=1e-9)
    (norm,) = [o for o in trace.ops if o.name == "norm_grad_allreduce"]
    assert norm.mesh_axes == ("data", "fsdp")
    assert norm.bytes == 4 * spec.num_norm_params


def test_expert_parallel_shards_non_expert_weights_over_fsdp_and_expert():
    # MaxText's logical-axis rules: `embed` -> (fsdp, expert) for every weight but the routed
    # experts (`embed_no_exp` -> fsdp; their `exp` dimension takes the expert axis).
    spec = model_from_dict(TINY_MOE)
    trace, _ = _step("expert=2,fsdp=2", "2x2", model=TINY_MOE, remat=Remat.NONE)
    L, D = spec.num_layers, spec.d_model
    routed = spec.num_experts * spec.mlp.num_matrices * D * spec.expert_d_ff
    attention = D * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim \
        + spec.num_heads * spec.head_dim * D
    router = D * spec.num_experts

    def layer_collectives(kind, axes):
        return [o for o in trace.ops if o.kind == OpKind.COLLECTIVE and o.collective == kind
                and o.layer >= 0 and o.mesh_axes == axes and o.name.startswith("fsdp_")]

    # bf16 gradients, V = the whole matrix, one reduce-scatter per matrix and layer.
    assert sum(o.bytes for o in layer_collectives("reduce-scatter", ("fsdp", "expert"))) \
        == pytest.approx(2 * L * (attention + router), rel=1e-12)
    # Each expert-axis shard reduces its own experts (E / 2 of them) over fsdp.
    assert sum(o.bytes for o in layer_collectives("reduce-scatter", ("fsdp",))) \
        == pytest.approx(2 * L * routed / 2, rel=1e-12)
    # The forward gathers the same matrices over the same groups (bf16 weights).
    assert sum(o.bytes for o in layer_collectives("all-gather", ("fsdp", "expert"))
               if o.phase == "fwd") == pytest.approx(2 * L * (attention + router), rel=1e-12)
    # Nothing is replicated over expert but the norm scales (their f32 gradients).
    assert _reduced_bytes(trace, "expert") == 0
    norm = [o for o in trace.ops if o.name == "norm_grad_allreduce"]
    assert [o.mesh_axes for o in norm] == [("fsdp", "expert")]
    assert norm[0].bytes == pytest.approx(4 * spec.num_norm_params, rel=1e-12)
    # Every matmul weight is split four ways; the norm scales are replicated.
    p_local = (spec.num_params - spec.num_norm_params) / 4 + spec.num_norm_params
    assert trace.meta.static_hbm_bytes == pytest.approx(p_local * (2 + 2 * 4), rel=1e-12)


def test_within_a_slice_the_data_all_reduce_sends_the_experts_shard_apart():
    # data=2 x fsdp=2 x expert=2, one slice (per-layer form): per layer one all-reduce over
    # data of the non-expert weights' bf16 gradient shard (split over fsdp x expert: / 4) and
    # one of the routed experts' (each expert-axis shard's experts, split over fsdp: / 2).
    spec = model_from_dict(TINY_MOE)
    trace, _ = _step("data=2,fsdp=2,expert=2", "2x4", model=TINY_MOE, remat=Remat.NONE)
    D = spec.d_model
    routed = spec.num_experts * spec.mlp.num_matrices * D * spec.expert_d_ff
    attention = D * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim \
        + spec.num_heads * spec.head_dim * D
    router = D * spec.num_experts
    for layer in range(spec.num_layers):
        got = {o.name: (o.mesh_axes, o.bytes) for o in trace.ops
               if o.layer == layer and o.name.startswith("dp_grad_")}
        assert got == {"dp_grad_allreduce": (("data",), 2 * (attention + router) / 4),
                       "dp_grad_allreduce_experts": (("data",), 2 * routed / 2 / 2)}


# -- sliding-window (local / global) attention ----------------------------------------------------
# TINY with its first layer local (window 32 of the 128-token sequence), the second global.
TINY_LOCAL = {**TINY, "attention_window": 32, "global_layer_period": 2}


def test_flash_attention_of_a_local_layer_counts_its_causal_window_pairs():
    full, _ = _step("fsdp=1", "1x1", remat=Remat.NONE, attention="flash")
    local, _ = _step("fsdp=1", "1x1", model=TINY_LOCAL, remat=Remat.NONE, attention="flash")
    m = model_from_dict(TINY)
    seqs, seq, w = 2, 128, 32
    per_pair = 4 * m.num_heads * m.head_dim  # forward FLOPs of one (query, key) pair
    # Per sequence the global layer does the causal half, 128^2 / 2 pairs; the local one
    # w (w + 1) / 2 + (seq - w) w = 528 + 3072 = 3600 pairs (a query at position p attends
    # to min(32, p) keys). Forward 1 + backward 2.5 (the flash backward recomputes the scores).
    saved_pairs = seq * seq / 2 - (w * (w + 1) // 2 + (seq - w) * w)
    assert saved_pairs == 8192 - 3600
    assert _mxu_flops(full) - _mxu_flops(local) == pytest.approx(
        3.5 * seqs * saved_pairs * per_pair, rel=1e-12)
    # The summary's model FLOPs count the window too (3 passes: forward + 2x backward).
    assert full.meta.model_flops_per_chip - local.meta.model_flops_per_chip == \
        pytest.approx(3 * seqs * saved_pairs * per_pair, rel=1e-12)


def test_dot_attention_of_a_local_layer_computes_and_masks_every_score():
    # MaxText's dot-product path computes the whole q.K^T and masks it: no saving in the
    # program's FLOPs or its score buffers, only in the model FLOPs of the summary.
    full, _ = _step("fsdp=1", "1x1", remat=Remat.NONE, attention="dot")
    local, _ = _step("fsdp=1", "1x1", model=TINY_LOCAL, remat=Remat.NONE, attention="dot")
    assert _mxu_flops(full) == _mxu_flops(local)
    assert full.meta.activation_bytes_estimate == local.meta.activation_bytes_estimate
    assert local.meta.model_flops_per_chip < full.meta.model_flops_per_chip


def test_post_norms_and_qk_norm_add_their_norm_ops_forward_and_backward():
    plain, _ = _step("fsdp=1", "1x1", remat=Remat.FULL, attention="flash")
    normed, r = _step("fsdp=1", "1x1", model={**TINY, "post_norms": True, "qk_norm": True},
                      remat=Remat.FULL, attention="flash")
    names = [o.name for o in normed.ops if o.layer == 0]
    # Forward: both post-norms; recomputation: the attention's only (the MLP's output is
    # dead in a recomputed layer); backward: both.
    for name, count in (("post_norm_attn", 1), ("post_norm_mlp", 1), ("re-post_norm_attn", 1),
                        ("re-post_norm_mlp", 0), ("post_norm_attn_bwd", 1),
                        ("post_norm_mlp_bwd", 1), ("qk_norm", 1), ("re-qk_norm", 1),
                        ("qk_norm_bwd", 1)):
        assert names.count(name) == count, name
    assert not {o.name for o in plain.ops} & {"qk_norm", "post_norm_attn"}
    # A post-norm streams [tokens, d_model] bf16 like a pre-norm (read twice, written once).
    op = next(o for o in normed.ops if o.name == "post_norm_mlp")
    assert op.hbm_bytes == 3 * 256 * 256 * 2
    assert r.step_time_s > _step("fsdp=1", "1x1", remat=Remat.FULL)[1].step_time_s


def test_pipeline_chunks_must_hold_whole_periods_of_the_local_global_pattern():
    model = {**TINY, "num_layers": 4, "attention_window": 32, "global_layer_period": 4}
    with pytest.raises(TpusimError, match=r"pipeline=2 gives each pipeline chunk 2 layers.*"
                                          r"global_layer_period=4"):
        _step("pipeline=2", "1x2", model=model)
    _step("pipeline=2", "1x2", model={**model, "global_layer_period": 2})


def test_vocab_tiling_recomputes_the_logits_and_holds_one_chunk_of_them():
    plain, _ = _step("fsdp=4", "2x2", remat=Remat.FULL)
    tiled, _ = _step("fsdp=4", "2x2", remat=Remat.FULL, vocab_tiling=4)
    m = model_from_dict(TINY)
    n = 2 * 128  # tokens per chip
    # The backward recomputes the logits once: 2 x tokens x d_model x vocab more MXU FLOPs.
    assert _mxu_flops(tiled) - _mxu_flops(plain) == 2 * n * m.d_model * m.vocab_size
    # f32 logits + bf16 logit gradients (6 bytes a logit) of one chunk of 64 tokens at a time.
    assert plain.meta.logits_bytes == n * m.vocab_size * 6
    assert tiled.meta.logits_bytes == plain.meta.logits_bytes / 4
    # Each chunk reads the whole gathered output projection.
    logits = {t: next(o for o in tr.ops if o.name == "logits") for t, tr in ((1, plain),
                                                                               (4, tiled))}
    emb_w = m.vocab_size * m.d_model * 2
    assert logits[4].hbm_bytes - logits[1].hbm_bytes == 3 * emb_w
    with pytest.raises(TpusimError, match=r"vocab_tiling 3 does not divide the 256 tokens"):
        _step("fsdp=4", "2x2", vocab_tiling=3)
    with pytest.raises(TpusimError, match=r"vocab_tiling 0 must be a whole number"):
        TrainingConfig(seq_len=128, batch_per_chip=1, vocab_tiling=0)


def test_cli_vocab_tiling_reaches_the_trace(tiny_yaml, capsys):
    rc, out, _ = _cli(capsys, *_train_args(tiny_yaml, "--vocab-tiling", "2", "--json"))
    assert rc == 0
    rc, out1, _ = _cli(capsys, *_train_args(tiny_yaml, "--json"))
    tiled, plain = json.loads(out), json.loads(out1)
    # Two logits chunks (one more op forward, one more backward), each reading the gathered
    # output projection: more ops and more HBM-bound time. (The step itself need not grow: on
    # this pod the extra time hides behind the collectives the core waits for anyway.)
    assert tiled["num_ops"] == plain["num_ops"] + 2
    assert tiled["breakdown"]["hbm_bound_s"] > plain["breakdown"]["hbm_bound_s"]
    assert tiled["step_time_s"] >= plain["step_time_s"]


# -- the size of a program (fuzz8) ----------------------------------------------------------
def test_every_microbatch_adds_at_least_min_ops_per_layer_to_the_program():
    # The oracle of MIN_OPS_PER_LAYER, the bound the compiler refuses huge steps by before
    # building them: the ops one more microbatch adds, per layer, over meshes, remat policies
    # and attention forms (21.75 to 71.75 when measured).
    import itertools

    from workloads.training import MIN_OPS_PER_LAYER, parse_remat

    model = model_from_dict({**TINY, "num_layers": 4})
    least = math.inf
    for mesh, remat, attn in itertools.product(
            ["data=4", "fsdp=4", "tensor=4", "fsdp=2,tensor=2"],
            ["none", "minimal", "full", "offload"], ["flash", "dot"]):
        n = [len(compile_training_step(model, parse_mesh(mesh), 4, TrainingConfig(
            seq_len=128, batch_per_chip=4, microbatches=mb, remat=parse_remat(remat),
            attention=attn)).ops) for mb in (2, 4)]
        least = min(least, (n[1] - n[0]) / 2 / model.num_layers)
    assert least >= 2 * MIN_OPS_PER_LAYER


def test_a_step_too_large_for_one_program_is_refused_before_it_is_built():
    # LLaMA-3-405B at microbatches 4096 would have compiled ~26 M ops (64 built 404,098 in
    # 17 CPU-s): microbatches x layers x MIN_OPS_PER_LAYER over MAX_TRACE_OPS is refused at
    # once, naming the largest microbatch count that could fit.
    from topologies.validate import MAX_TRACE_OPS
    from workloads.training import MIN_OPS_PER_LAYER

    model = model_from_dict({**TINY, "num_layers": 64})
    cfg = TrainingConfig(seq_len=128, batch_per_chip=1024, microbatches=1024)
    assert 1024 * 64 * MIN_OPS_PER_LAYER > MAX_TRACE_OPS
    with pytest.raises(TpusimError, match=r"^microbatches 1024 x 64 layers compiles to at "
                                          r"least 524,288 ops .* use at most 488 microbatches"):
        compile_training_step(model, parse_mesh("tensor=4"), 4, cfg)
    # Per pipeline stage: its layers only.
    with pytest.raises(TpusimError, match=r"x 32 layers per pipeline stage compiles to at least "
                                          r"262,144 ops"):
        compile_training_step(model, parse_mesh("pipeline=2,tensor=2"), 4, cfg)


def _first_microbatch_counts(monkeypatch, model, mesh, cfg):
    """(ops before the first microbatch, ops it added, ops of the whole program) of an uncached
    build, as the compiler's size check sees them."""
    import workloads.training as training

    seen = []
    check = training._Compiler.check_program_size
    monkeypatch.setattr(training._Compiler, "check_program_size",
                        lambda self, start, per: (seen.append((start, per)),
                                                  check(self, start, per))[1])
    program = training.program_compiler(model_from_dict(model), parse_mesh(mesh), 4, cfg)
    total = len(program.build().ops)
    monkeypatch.undo()
    (start, per), = seen
    return start, per, total


@pytest.mark.parametrize("model, mesh, cfg", [
    (TINY, "fsdp=4", {}),
    (TINY, "data=4", {"dp_grad_split": "per-layer", "overlap": False}),
    (TINY, "fsdp=2,tensor=2", {"remat": Remat.NONE, "attention": "dot"}),
    (TINY, "fsdp=4", {"fsdp_gather": "windowed", "remat": Remat.OFFLOAD,
                      "gather_dtype": "bf16", "param_dtype": "fp32"}),
    (TINY, "pipeline=2,data=2", {}),
    (TINY_MOE, "expert=2,fsdp=2", {"vocab_tiling": 2}),
    (TINY_LOCAL, "tensor=4", {"remat": Remat.MINIMAL}),
])
def test_the_first_microbatch_bounds_the_program_from_below_within_one_microbatch(
        monkeypatch, model, mesh, cfg):
    # The oracle of the size check: every later microbatch adds at least the first one's ops
    # (the middle ones exactly as many, the last its gradient reductions more), so
    # start + microbatches x first is a lower bound of the program, short of it by less than
    # one microbatch.
    for mb in (2, 4):
        start, per, total = _first_microbatch_counts(monkeypatch, model, mesh, TrainingConfig(
            seq_len=128, batch_per_chip=4, microbatches=mb, **cfg))
        assert 0 <= total - (start + mb * per) < per, (mb, start, per, total)


def test_a_step_over_the_op_limit_is_refused_once_its_first_microbatch_is_built(monkeypatch):
    # A step inside MIN_OPS_PER_LAYER's estimate but over the limit used to build up to the
    # limit before the builder refused it (LLaMA-3-405B at microbatches 248: 250,000 ops,
    # 3.8 CPU-s): now the first microbatch's count refuses it, naming a count that fits.
    import functools

    import workloads.training as training
    from workloads.trace import TraceBuilder

    cfg = {"seq_len": 128, "batch_per_chip": 8}
    start, per, _ = _first_microbatch_counts(monkeypatch, TINY, "fsdp=4", TrainingConfig(
        microbatches=2, **cfg))
    limit = start + 5 * per  # room for five microbatches' ops, so the builder never trips
    built = []

    class Counting(TraceBuilder):
        def add(self, name, **kw):
            built.append(name)
            return super().add(name, **kw)

    monkeypatch.setattr(training.program, "TraceBuilder",
                        functools.partial(Counting, max_ops=limit))
    with pytest.raises(TpusimError, match=(
            rf"^microbatches 8 x 2 layers compiles to at least {start + 8 * per:,} ops "
            rf"\({per:,} per microbatch, counted on the first\), over the {limit:,} tpusim "
            rf"simulates in one program; use at most 4 microbatches$")):
        training.program_compiler(model_from_dict(TINY), parse_mesh("fsdp=4"), 4,
                           TrainingConfig(microbatches=8, **cfg)).build()
    assert len(built) == start + per  # one microbatch built, not the limit's ops
    # The count it names fits under the same limit.
    fits = training.program_compiler(model_from_dict(TINY), parse_mesh("fsdp=4"), 4,
                              TrainingConfig(microbatches=4, **cfg)).build()
    assert len(fits.ops) <= limit
    # Room for one microbatch only: it names that count (not "at most 1 microbatches").
    monkeypatch.setattr(training.program, "TraceBuilder",
                        functools.partial(TraceBuilder, max_ops=start + 2 * per - 1))
    with pytest.raises(TpusimError, match=r"over the [\d,]+ tpusim simulates in one program; "
                                          r"use microbatches 1$"):
        training.program_compiler(model_from_dict(TINY), parse_mesh("fsdp=4"), 4,
                           TrainingConfig(microbatches=2, **cfg)).build()
    one = training.program_compiler(model_from_dict(TINY), parse_mesh("fsdp=4"), 4,
                             TrainingConfig(microbatches=1, **cfg)).build()
    assert len(one.ops) <= start + 2 * per - 1


def test_a_program_builder_stops_at_its_op_limit_with_the_fix(monkeypatch):
    # The hard limit behind the estimate: the builder refuses its op past the limit, and the
    # training compiler's refusal names the microbatches and layers that built it.
    import functools

    import workloads.training as training
    from workloads.trace import TraceBuilder

    b = TraceBuilder(max_ops=3, fix="give fewer")
    for _ in range(3):
        b.add("x", kind=OpKind.IDLE, duration_s=0.0)
    with pytest.raises(TpusimError, match=r"more than 3 ops, the most tpusim simulates in one "
                                          r"program; give fewer$"):
        b.add("x", kind=OpKind.IDLE, duration_s=0.0)
    monkeypatch.setattr(training.program, "TraceBuilder",
                        functools.partial(TraceBuilder, max_ops=50))
    with pytest.raises(TpusimError, match=r"more than 50 ops.* microbatches 2 x 2 layers build "
                                          r"it: use fewer microbatches or layers"):
        compile_training_step(model_from_dict(TINY), parse_mesh("fsdp=4"), 4,
                              TrainingConfig(seq_len=128, batch_per_chip=2, microbatches=2))
