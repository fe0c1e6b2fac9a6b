"""Collectives as XLA emits them (docs/model.md "Collectives as XLA emits them"), each rule on a
small closed-form case."""

from __future__ import annotations

import pytest

from topologies.mesh import parse_mesh
from validation import xla_crosscheck_doc as xdoc
from validation import xla_hlo_read as hread
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

SMALL = {"name": "small", "num_layers": 2, "d_model": 512, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 128, "d_ff": 1024, "vocab_size": 1024, "mlp": "swiglu"}
SEQ = 256


def _trace(mesh: str, chips: int, remat: Remat = Remat.FULL, **cfg):
    model = model_from_dict(SMALL)
    return compile_training_step(model, parse_mesh(mesh), chips,
                                 TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                remat=remat, **cfg))


def _ops(trace, name):
    return [o for o in trace.ops if o.name == name]


@pytest.mark.parametrize(("tp_activations", "fwd", "kind", "bwd"), [
    ("replicated", "tp_embed_allreduce", "all-reduce", None),
    ("sharded", "tp_embed_reducescatter", "reduce-scatter", "tp_embed_grad_allgather"),
])
def test_the_embedding_lookup_sums_its_vocabulary_shards_over_tensor(tp_activations, fwd, kind,
                                                                     bwd):
    # 8 chips, fsdp=2 x tensor=4: 8 sequences, 4 per fsdp shard, n = 4 x 256 tokens per chip's
    # tensor group; each vocabulary shard's partial lookup is [n, d_model] bf16.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations=tp_activations)
    n = 4 * SEQ
    (red,) = _ops(trace, fwd)
    assert red.collective == kind and red.mesh_axes == ("tensor",)
    assert red.bytes == n * 512 * 2
    lookup = _ops(trace, "embed_lookup")[0]
    assert lookup.id in red.deps
    first = min(o.id for o in trace.ops if o.layer == 0)
    assert red.id < first
    if bwd is None:
        assert not [o for o in trace.ops if "embed_grad_allgather" in o.name]
    else:
        (g,) = _ops(trace, bwd)
        assert g.collective == "all-gather" and g.bytes == n * 512 * 2
        assert g.id in _ops(trace, "embed_grad")[0].deps


def test_no_tensor_axis_means_no_embedding_reduction():
    trace = _trace("fsdp=8", 8)
    assert not [o for o in trace.ops if o.name.startswith("tp_embed")]


def test_backward_matmuls_split_into_input_and_weight_gradients():
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations="replicated")
    n, D, F, tp = 4 * SEQ, 512, 1024, 4
    (dx,) = [o for o in trace.ops if o.name == "mlp_bwd" and o.layer == 1]
    (dw,) = [o for o in trace.ops if o.name == "mlp_bwd_weights" and o.layer == 1]
    # SwiGLU: 3 matrices; forward 2 n D F x 3 / tp; backward 2x that, half dX and half dW.
    assert dx.flops == dw.flops == 2 * n * D * F * 3 / tp
    # The input gradient's all-reduce over tensor waits for dX only; dW runs while it is in
    # flight (later in program order, not depending on it).
    (ar,) = [o for o in trace.ops if o.name == "tp_allreduce_mlp_bwd" and o.layer == 1]
    assert dx.id < dw.id and ar.id not in dw.deps
    nrm = [o for o in trace.ops if o.name == "norm_mlp_bwd" and o.layer == 1][0]
    assert ar.id in nrm.deps and dw.id < nrm.id
    # Replayed, the all-reduce is in flight while the dW matmul runs.
    from sim.chips import get_chip
    from sim.engine.replay import replay
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=(2, 4))
    ops = replay(trace, chip, topo).ops.set_index("op_id")
    assert ops.loc[ar.id, "start_s"] < ops.loc[dw.id, "end_s"]
    assert ops.loc[dw.id, "start_s"] < ops.loc[ar.id, "end_s"]
    (pw,) = [o for o in trace.ops if o.name == "attn_proj_bwd_weights" and o.layer == 1]
    (px,) = [o for o in trace.ops if o.name == "attn_proj_bwd" and o.layer == 1]
    assert pw.flops == px.flops
    end = [o for o in trace.ops if o.name == "norm_attn_bwd" and o.layer == 1][0]
    assert {dw.id, pw.id} <= set(end.deps)


@pytest.mark.parametrize(("split", "last"), [("per-layer", "dp_grad_allreduce"),
                                             ("per-matrix", "dp_grad_allreduce_norms")])
def test_blocking_data_parallel_all_reduce_holds_the_next_layer(split, last):
    chips = 8
    model = model_from_dict(SMALL)
    for mode in ("async", "blocking"):
        trace = compile_training_step(model, parse_mesh("fsdp=4", "data=2"), chips,
                                      TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                     remat=Remat.FULL, dp_allreduce=mode,
                                                     dp_grad_split=split))
        (ar,) = [o for o in trace.ops if o.name == last and o.layer == 1]
        nxt = [o for o in trace.ops if o.layer == 0 and ar.id in o.deps
               and o.kind != "collective"]
        assert bool(nxt) == (mode == "blocking")


def _dp_trace(dcn: str | None, split: str, mesh: str = "fsdp=4", **cfg):
    return compile_training_step(model_from_dict(SMALL), parse_mesh(mesh, dcn), 8,
                                 TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                dp_allreduce="blocking", dp_grad_split=split,
                                                **cfg))


def test_across_slices_each_weight_matrix_and_the_norm_scales_get_their_own_all_reduce():
    # fsdp=4 x 2 slices (XLA's 2-slice program, validation/xla_dcn_schedule.py): per layer one
    # cross-slice all-reduce per matrix of its bf16 gradient shard (V / 4) and one of the two
    # norm scales (f32, 2 D x 4 bytes), each after its own fsdp reduction and the one before
    # it; the same bytes as the per-layer form's one all-reduce. The final norm's scale goes
    # over the slices after the fsdp reduction of all of them.
    per_matrix = _dp_trace("data=2", "per-matrix")
    dps = [o for o in per_matrix.ops if o.layer == 1 and o.name.startswith("dp_grad_")]
    assert [o.name.removeprefix("dp_grad_allreduce_") for o in dps] == [*MATRIX_BYTES, "norms"]
    assert {o.mesh_axes for o in dps} == {("data",)} and {o.collective for o in dps} == {
        "all-reduce"}
    assert [o.bytes for o in dps] == [v / 4 for v in MATRIX_BYTES.values()] + [2 * D * 4]
    rs = _colls(per_matrix, "fsdp_grad_reducescatter_")
    assert all(rs[k].id in op.deps for k, op in zip(MATRIX_BYTES, dps, strict=False))
    assert all(prev.id in op.deps for prev, op in zip(dps, dps[1:], strict=False))
    (one,) = [o for o in _dp_trace("data=2", "per-layer").ops
              if o.layer == 1 and o.name.startswith("dp_grad_")]
    assert one.bytes == sum(MATRIX_BYTES.values()) / 4
    (nrm,) = _ops(per_matrix, "norm_grad_allreduce")
    assert nrm.mesh_axes == ("fsdp",) and nrm.bytes == (2 * 2 + 1) * D * 4
    (rest,) = [o for o in per_matrix.ops if o.name == "dp_grad_allreduce_norms"
               and o.layer == -1]
    assert rest.bytes == D * 4 and rest.mesh_axes == ("data",) and nrm.id in rest.deps
    (old,) = _ops(_dp_trace("data=2", "per-layer"), "norm_grad_allreduce")
    assert old.mesh_axes == ("data", "fsdp") and old.bytes == nrm.bytes
    # Within a slice (data over ICI) the reduction stays one all-reduce per layer.
    ici = _dp_trace(None, "per-matrix", mesh="data=2,fsdp=4")
    assert [o.name for o in ici.ops if o.layer == 1 and o.name.startswith("dp_grad_")] == [
        "dp_grad_allreduce"]


def test_per_matrix_cross_slice_all_reduces_pay_the_dcn_message_overhead_one_after_another():
    # Replayed on 2 v5e 2x2 slices with a large per-message overhead o: per layer 8 all-reduces
    # of 2 (N - 1) = 2 messages each, one after another and blocking, where the per-layer form
    # sends one: 7 more per layer, 2 x 7 x 2 o over the two layers (the transfers themselves
    # are 0.1 ms or less).
    from sim.chips import get_chip
    from sim.engine.replay import replay
    from topologies.slices import resolve_topology

    o = 20e-3
    chip = get_chip("v5e").with_overrides(dcn_message_overhead_s=o)
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=(2, 2), num_slices=2)
    steps = {split: replay(_dp_trace("data=2", split), chip, topo).step_time_s
             for split in ("per-layer", "per-matrix")}
    assert steps["per-matrix"] - steps["per-layer"] == pytest.approx(2 * 7 * 2 * o, rel=0.02)


def test_fsdp_grad_all_reduce_sums_each_whole_gradient_before_the_next_layer():
    # XLA's v6e program with async collective fusion and no collective matmuls all-reduces
    # every weight gradient whole by a synchronous collective (docs/model.md). Same V as the
    # reduce-scatter (tpusim's convention: the full unreduced operand), e.g. w_gate's
    # [d_model, d_ff] bf16 = 512 x 1024 x 2 bytes; the next layer's backward waits for it.
    rs = _trace("fsdp=4", 4)
    ar = _trace("fsdp=4", 4, fsdp_grad="all-reduce")
    pre = "fsdp_grad_"
    for trace, kind in ((rs, "reduce-scatter"), (ar, "all-reduce")):
        grads = [o for o in trace.ops if o.name.startswith(pre)]
        assert grads and {o.collective for o in grads} == {kind}
        assert {o.mesh_axes for o in grads} == {("fsdp",)}
    assert [o.bytes for o in rs.ops if o.name.startswith(pre)] == \
        [o.bytes for o in ar.ops if o.name.startswith(pre)]
    (gate,) = [o for o in ar.ops if o.name == "fsdp_grad_allreduce_w_gate" and o.layer == 1]
    assert gate.bytes == 512 * 1024 * 2
    for trace, waits in ((rs, False), (ar, True)):
        top = {o.id for o in trace.ops if o.name.startswith(pre) and o.layer == 1}
        nxt = [o for o in trace.ops if o.layer == 0 and o.kind != "collective"
               and top <= set(o.deps)]
        assert bool(nxt) == waits


def test_fsdp_grad_all_reduce_exposes_the_top_layers_reduction():
    # Replayed on v6e 2x2: with reduce-scatter the top layer's gradient reduction hides behind
    # the next layer's backward; all-reduced synchronously it delays that backward by at least
    # its own collective time (each all-reduce alone, concurrent on the same links: their
    # drain times add up, minus the overlap of their hop latencies).
    from sim.chips import get_chip
    from sim.engine.costs import collective_groups, cost_collective
    from sim.engine.replay import replay
    from topologies.slices import resolve_topology

    chip = get_chip("v6e")
    topo = resolve_topology(chip_name="v6e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=(2, 2))
    rs = _trace("fsdp=4", 4, remat=Remat.NONE)
    ar = _trace("fsdp=4", 4, remat=Remat.NONE, fsdp_grad="all-reduce")
    g = collective_groups(ar, topo)["fsdp"]
    costs = [cost_collective(chip, topo, "all-reduce", g, o.bytes, "auto")
             for o in ar.ops if o.name.startswith("fsdp_grad_") and o.layer == 1]
    drain = sum(c.time_s - c.latency_s for c in costs)
    r_rs, r_ar = replay(rs, chip, topo), replay(ar, chip, topo)
    assert r_ar.breakdown["exposed_comm_s"] - r_rs.breakdown["exposed_comm_s"] >= drain * 0.999
    assert r_ar.step_time_s > r_rs.step_time_s + drain * 0.999


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_each_dcn_message_costs_its_overhead_once_per_step(algorithm):
    from sim.chips import get_chip
    from sim.engine.costs import collective_groups, cost_collective
    from topologies.slices import resolve_topology
    from workloads.trace import Op, OpKind, Trace

    slices = 4
    base = get_chip("v5e").with_overrides(dcn_message_overhead_s=0.0)
    topo = resolve_topology(chip_name="v5e", wrap_rule=base.generation_rule,
                            max_pod_shape=base.max_pod_shape, shape=(2, 2), num_slices=slices)
    mesh = parse_mesh("fsdp=4", f"data={slices}")
    tr = Trace(mesh=mesh, ops=(Op(id=0, name="x", kind=OpKind.COLLECTIVE,
                                  collective="all-reduce", mesh_axes=("data",), bytes=4e6),))
    g = collective_groups(tr, topo)["data"]
    o = 1e-3
    t0 = cost_collective(base, topo, "all-reduce", g, 4e6, algorithm).time_s
    t1 = cost_collective(base.with_overrides(dcn_message_overhead_s=o), topo, "all-reduce", g,
                         4e6, algorithm).time_s
    # A ring all-reduce: 2 (N - 1) steps of one message; direct: 2 steps of N - 1 messages.
    assert t1 - t0 == pytest.approx(2 * (slices - 1) * o, rel=1e-9)


# -- FSDP gathers per weight matrix, their forms, windowed rings (docs/model.md) ------------------

D, H, K, HD, F, VOCAB = 512, 4, 2, 128, 1024, 1024
MATRIX_BYTES = {"wq": D * H * HD * 2, "wk": D * K * HD * 2, "wv": D * K * HD * 2,
                "wo": H * HD * D * 2, "w_gate": D * F * 2, "w_up": D * F * 2, "w_down": F * D * 2}


def _colls(trace, prefix, layer=1):
    return {o.name.removeprefix(prefix): o for o in trace.ops
            if o.name.startswith(prefix) and o.layer == layer and o.kind == "collective"}


def test_fsdp_gathers_and_reduce_scatters_one_collective_per_weight_matrix():
    trace = _trace("fsdp=8", 8)
    fwd = _colls(trace, "fsdp_allgather_fwd_")
    assert {k: o.bytes for k, o in fwd.items()} == MATRIX_BYTES
    assert all(o.mesh_axes == ("fsdp",) for o in fwd.values())
    rs = _colls(trace, "fsdp_grad_reducescatter_")
    assert {k: o.bytes for k, o in rs.items()} == MATRIX_BYTES  # bf16 gradients, plain
    # Each projection waits for its own matrices only.
    (qkv,) = [o for o in trace.ops if o.name == "qkv_proj" and o.layer == 1]
    assert {fwd[k].id for k in ("wq", "wk", "wv")} <= set(qkv.deps)
    assert fwd["w_gate"].id not in qkv.deps


def test_a_windowed_ring_sends_n_plus_one_shard_messages():
    # fsdp = 8: prologue + 8 ring steps of one 1/8 shard each = 9/8 of V, gathers and
    # gradient reduce-scatters alike (XLA's windowed_dot_general loops).
    trace = _trace("fsdp=8", 8, fsdp_gather="windowed")
    for prefix in ("fsdp_allgather_fwd_", "fsdp_allgather_bwd_", "fsdp_grad_reducescatter_"):
        got = {k: o.bytes for k, o in _colls(trace, prefix).items()}
        assert got == {k: v * 9 / 8 for k, v in MATRIX_BYTES.items()}
    (erc,) = _ops(trace, "fsdp_grad_reducescatter_embed")
    assert erc.bytes == VOCAB * D * 2 * 9 / 8
    # The windowed matmuls do not wait for their gathers; the layer's end does.
    fwd = _colls(trace, "fsdp_allgather_fwd_")
    (qkv,) = [o for o in trace.ops if o.name == "qkv_proj" and o.layer == 1]
    assert not set(qkv.deps) & {o.id for o in fwd.values()}
    (res,) = [o for o in trace.ops if o.name == "residual_mlp" and o.layer == 1]
    assert {o.id for o in fwd.values()} <= set(res.deps)


def _forms(trace, phase):
    """matrix -> form, read off the trace: a windowed gather carries 9/8 of V (and, forward,
    holds no HBM: the backward's gathers hold each matrix whole, docs/model.md "Memory")."""
    out = {}
    for k, o in _colls(trace, f"fsdp_allgather_{phase}_").items():
        base = MATRIX_BYTES[k.removesuffix("_dx")]
        out[k] = "windowed" if o.bytes == base * 9 / 8 else "plain"
        assert o.bytes in (base, base * 9 / 8)
        assert (o.alloc_bytes == 0) == (out[k] == "windowed" and phase == "fwd")
    return out


def test_mixed_forms_window_a_gather_that_feeds_one_matmul():
    # Forward: every matrix feeds one projection -> windowed. Backward under remat full: the
    # recomputation and the input gradient both read a matrix (plain gather), except the down
    # projection, whose recomputation is dead; wq and wk are gathered again for their input
    # gradients. Gradient reduce-scatters are windowed.
    trace = _trace("fsdp=8", 8, fsdp_gather="mixed-async")
    assert set(_forms(trace, "fwd").values()) == {"windowed"}
    bwd = _forms(trace, "bwd")
    assert bwd == {"wq": "plain", "wk": "plain", "wv": "plain", "wo": "plain",
                   "w_gate": "plain", "w_up": "plain", "w_down": "windowed",
                   "wq_dx": "plain", "wk_dx": "plain"}
    (px,) = [o for o in trace.ops if o.name == "attn_proj_bwd" and o.layer == 1]
    regathers = _colls(trace, "fsdp_allgather_bwd_")
    assert {regathers["wq_dx"].id, regathers["wk_dx"].id} <= set(px.deps)
    assert all(o.bytes == MATRIX_BYTES[k] * 9 / 8
               for k, o in _colls(trace, "fsdp_grad_reducescatter_").items())
    # Without remat only the input gradient reads a matrix in the backward: all windowed.
    none = _trace("fsdp=8", 8, fsdp_gather="mixed-async", remat=Remat.NONE)
    assert set(_forms(none, "bwd").values()) == {"windowed"}


def test_mixed_blocking_gathers_wait_for_the_previous_layer_and_tensor_rows_are_plain():
    trace = _trace("fsdp=2,tensor=4", 8, fsdp_gather="mixed-blocking",
                   tp_activations="replicated")
    fwd = _colls(trace, "fsdp_allgather_fwd_")
    # With a tensor axis the row-parallel matmuls (their outputs are reduced over tensor) do
    # not window: wo and w_down are plain (blocking) gathers, the rest windowed (9/8 -> 3/2
    # for fsdp = 2: one prologue + 2 steps of half the matrix).
    for k, o in fwd.items():
        v = MATRIX_BYTES[k] / 4
        assert o.bytes == (v if k in ("wo", "w_down") else v * 3 / 2), k
    (out0,) = [o for o in trace.ops if o.name == "residual_mlp" and o.layer == 0]
    assert out0.id in fwd["wo"].deps  # blocking: issued when the previous layer ends


def test_recomputation_drops_the_dead_down_projection_and_its_reduction():
    # remat full: the backward never reads a layer's output, so XLA removes the recomputed
    # down projection (and its all-reduce over tensor): dot FLOPs per layer = forward x 1 +
    # (forward - down projection) + backward x 2.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations="replicated")
    names = [o.name for o in trace.ops if o.layer == 1]
    assert "re-mlp_out" not in names and "re-tp_allreduce_mlp" not in names
    assert "re-out_proj" in names and "re-tp_allreduce_attn" in names
    n, tp = 4 * SEQ, 4
    # tensor = 4 > 2 KV heads: each shard keeps one (replicated) KV head.
    proj = 2 * n * D * (H / tp + 2 * 1) * HD + 2 * n * H * HD * D / tp
    mlp = 2 * n * D * F * 3 / tp
    down = 2 * n * F * D / tp
    score_matmuls = {"attn_scores", "attn_values", "attn_bwd", "flash_attention",
                     "flash_attention_bwd"}
    weights = [o for o in trace.ops if o.layer == 1 and o.unit == "mxu"
               and o.name.removeprefix("re-") not in score_matmuls]
    assert sum(o.flops for o in weights) == pytest.approx(4 * (proj + mlp) - down)


@pytest.mark.parametrize("tp_activations", ["replicated", "sharded"])
def test_embedding_tokens_loss_and_norm_gradient_collectives(tp_activations):
    # fsdp=2 x tensor=4, 8 chips: 8 sequences of 256 tokens, n = 1024 tokens per chip.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations=tp_activations)
    n = 4 * SEQ
    # The lookup's all-to-all: each chip's [n, d_model] bf16 buffer over the fsdp group.
    (lk,) = _ops(trace, "embed_lookup_alltoall")
    assert lk.mesh_axes == ("fsdp",) and lk.bytes == 2 * n * D * 2
    (ga,) = _ops(trace, "embed_grad_alltoall")
    assert ga.mesh_axes == ("fsdp",) and ga.bytes == lk.bytes
    # int32 token ids: over fsdp each chip's 1/tensor share, then over tensor all of them.
    fs = [o for o in trace.ops if o.name == "embed_tokens_allgather_fsdp"]
    ts = [o for o in trace.ops if o.name == "embed_tokens_allgather_tensor"]
    assert [o.bytes for o in fs] == [2 * n / 4 * 4] * 2
    assert [o.bytes for o in ts] == [2 * n * 4] * 2
    assert {o.id for o in fs + ts if o.phase == "fwd"} <= set(lk.deps)
    # The loss: bf16 row maxima, then f32 sum-exp and target logit, over tensor; the target
    # ids permuted over fsdp x tensor.
    (mx,) = _ops(trace, "tp_logits_max_allreduce")
    (lse,) = _ops(trace, "tp_logsumexp_allreduce")
    (tg,) = _ops(trace, "loss_targets_permute")
    assert (mx.bytes, lse.bytes, tg.bytes) == (n * 2, n * 4 * 2, n * 4)
    assert tg.collective == "collective-permute" and tg.mesh_axes == ("fsdp", "tensor")
    # Norm scales (2 per layer + the final norm) are replicated: one all-reduce of their
    # f32 gradients over fsdp (and tensor when the activations, hence the gradients, are
    # split over it).
    (nr,) = _ops(trace, "norm_grad_allreduce")
    axes = ("fsdp",) if tp_activations == "replicated" else ("fsdp", "tensor")
    assert nr.mesh_axes == axes and nr.bytes == (2 * 2 + 1) * D * 4
    (upd,) = _ops(trace, "adam_update")
    assert nr.id in upd.deps


# -- the XLA side of the cross-check (validation/xla_crosscheck.py) ------------------------------


def test_mesh_form_replica_groups_vary_over_the_named_axes():
    # 4 x 2 ids row-major: a group varies over axis_0 with axis_1 fixed.
    assert xdoc.parse_replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 8) == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert xdoc.parse_replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 8) == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert xdoc.parse_replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", 8) == \
        [list(range(8))]


def test_each_windowed_ring_takes_one_prologue_of_its_message_size():
    # One layer's backward: a windowed all-gather and a windowed reduce-scatter with equal
    # messages (2 ring steps each) and their two prologue permutes: N + 1 messages each.
    pairs = [[0, 1], [1, 0]]
    loop = dict(kind="collective-permute", in_loop=True, layer=0, phase="bwd", bytes=10,
                pair_list=pairs, count=2)
    ops = [dict(loop, loop="windowed-ag:while.1[x2]"), dict(loop, loop="windowed-rs:while.2[x2]")]
    ops += [dict(loop, in_loop=False, loop=None, count=1)] * 2
    xr = {"num_chips": 2, "mesh_axes": ["fsdp"], "mesh_shape": [2], "mesh_device_ids": [0, 1],
          "ops": ops}
    assert xdoc.xla_logical_bytes(xr) == {("all-gather", "fsdp"): 30,
                                          ("reduce-scatter", "fsdp"): 30}
    # One collective each: a loop once per run (2 trips), its prologue not at all.
    assert xdoc.xla_logical_counts(xr) == {("all-gather", "fsdp"): 1, ("reduce-scatter", "fsdp"): 1}


# -- a data axis (the v6e data=4 x fsdp=4 program) ------------------------------------------------

def test_with_a_data_axis_the_mixed_forms_are_plain_collectives():
    # Weights replicated over data are sharded over fewer chips than the program has: XLA
    # builds no windowed einsum, so every gather and gradient reduce-scatter carries V exactly
    # (fsdp = 4: 1/4 of each matrix per chip), blocking.
    trace = _trace("data=2,fsdp=4", 8, fsdp_gather="mixed-blocking")
    for prefix in ("fsdp_allgather_fwd_", "fsdp_allgather_bwd_", "fsdp_grad_reducescatter_"):
        got = {k: o.bytes for k, o in _colls(trace, prefix).items()}
        assert got == {k: MATRIX_BYTES[k.removesuffix("_dx")] for k in got}, prefix
    (erc,) = _ops(trace, "fsdp_grad_reducescatter_embed")
    assert erc.bytes == VOCAB * D * 2
    # The windowed form stays where the weights span every chip.
    windowed = _trace("fsdp=8", 8, fsdp_gather="mixed-blocking")
    assert _colls(windowed, "fsdp_grad_reducescatter_")["wq"].bytes == MATRIX_BYTES["wq"] * 9 / 8


@pytest.mark.parametrize("mode,prefetched", [("mixed-async", True), ("mixed-blocking", False)])
def test_over_more_than_32_chips_the_mixed_forms_gather_plainly_and_all_reduce_gradients(
        mode, prefetched):
    # XLA windows rings of 16 and 32 chips and none of 64 or 256 (FORM_PROBES of
    # validation/xla_crosscheck.py): over fsdp = 64 every gather is plain (V exactly; async on
    # v5e, blocking on v6e) and every gradient is all-reduced whole (V), none reduce-scattered.
    big = _trace("fsdp=64", 64, fsdp_gather=mode)
    for phase in ("fwd", "bwd"):
        got = _colls(big, f"fsdp_allgather_{phase}_")
        assert {k: o.bytes for k, o in got.items()} == \
            {k: MATRIX_BYTES[k.removesuffix("_dx")] for k in got}
        assert set(got) >= set(MATRIX_BYTES)
    ar = _colls(big, "fsdp_grad_allreduce_")
    assert {k: (o.collective, o.bytes) for k, o in ar.items()} == \
        {k: ("all-reduce", v) for k, v in MATRIX_BYTES.items()}
    assert not [o for o in big.ops if o.collective == "reduce-scatter"]
    (erc,) = _ops(big, "fsdp_grad_allreduce_embed")
    assert erc.collective == "all-reduce" and erc.bytes == VOCAB * D * 2
    # Synchronous, as compiled: layer 0's backward waits for layer 1's all-reduces.
    waits = set().union(*(o.deps for o in big.ops if o.layer == 0 and o.phase == "bwd"))
    assert {o.id for o in ar.values()} <= waits
    # Blocking gathers wait for the previous layer; async ones are prefetched (issued before
    # the layer before ends).
    (gq,) = [o for o in big.ops if o.name == "fsdp_allgather_fwd_wq" and o.layer == 1]
    (end0,) = [o for o in big.ops if o.name == "residual_mlp" and o.layer == 0]
    assert (end0.id in gq.deps) != prefetched
    # At 32 chips the forward still windows (a ring of N + 1 shard messages) and the
    # gradients are windowed reduce-scatters.
    ring = _trace("fsdp=32", 32, fsdp_gather=mode)
    fwd = _colls(ring, "fsdp_allgather_fwd_")
    assert {k: o.bytes for k, o in fwd.items()} == \
        {k: v * 33 / 32 for k, v in MATRIX_BYTES.items()}
    rs = _colls(ring, "fsdp_grad_reducescatter_")
    assert {k: o.collective for k, o in rs.items()} == dict.fromkeys(MATRIX_BYTES,
                                                                    "reduce-scatter")
    # The forced `windowed` mode windows at any ring length.
    forced = _colls(_trace("fsdp=64", 64, fsdp_gather="windowed"), "fsdp_allgather_fwd_")
    assert forced["wq"].bytes == MATRIX_BYTES["wq"] * 65 / 64


def test_with_a_data_axis_the_lookup_gradient_replicates_the_rows_when_they_are_smaller():
    # data=2 x fsdp=4, n = 256 tokens per chip: the lookup's all-to-all over fsdp as without a
    # data axis. Its gradient: all 8 chips' [n, d_model] bf16 rows (2 MiB) are smaller than
    # the table (vocab 8192: 8 MiB), so XLA all-gathers the rows over data x fsdp (the v6e
    # data=4 x fsdp=4 program: 256 MiB of rows against a 1002 MiB table).
    trace = compile_training_step(model_from_dict({**SMALL, "vocab_size": 8192}),
                                  parse_mesh("data=2,fsdp=4"), 8,
                                  TrainingConfig(seq_len=SEQ, batch_per_chip=1))
    n = SEQ
    (lk,) = _ops(trace, "embed_lookup_alltoall")
    assert lk.mesh_axes == ("fsdp",) and lk.bytes == 4 * n * D * 2
    (ga,) = _ops(trace, "embed_grad_allgather")
    assert ga.collective == "all-gather" and ga.mesh_axes == ("data", "fsdp")
    assert ga.bytes == 8 * n * D * 2
    assert not _ops(trace, "embed_grad_alltoall") and not _ops(trace, "embed_grad_table_allreduce")
    (sa,) = _ops(trace, "embed_grad_scatter_add")
    assert ga.id in sa.deps
    # The data all-reduce then sums both vocabulary matrices' fsdp shards.
    (ear,) = _ops(trace, "dp_grad_allreduce_embed")
    assert ear.bytes == 2 * 8192 * D * 2 / 4


def test_with_a_data_axis_the_lookup_gradient_replicates_the_table_when_it_is_smaller():
    # Vocab 1024: the 1 MiB table is smaller than the 2 MiB of rows, so each chip scatter-adds
    # its own rows into a whole zero table, all-reduced over data x fsdp (the data=2 x fsdp=8
    # memory programs: a 128 MiB table against 256 MiB of rows); only the output projection's
    # shard is left for the data all-reduce.
    trace = _trace("data=2,fsdp=4", 8)
    (tr,) = _ops(trace, "embed_grad_table_allreduce")
    assert tr.collective == "all-reduce" and tr.mesh_axes == ("data", "fsdp")
    assert tr.bytes == VOCAB * D * 2
    assert not _ops(trace, "embed_grad_allgather") and not _ops(trace, "embed_grad_alltoall")
    (ear,) = _ops(trace, "dp_grad_allreduce_embed")
    assert ear.bytes == VOCAB * D * 2 / 4


# -- XLA HLO forms the cross-check parser reads ------------------------------------------------

def test_an_all_reduce_scatter_fusion_is_a_reduce_scatter_and_its_fixup_permute_joins_it():
    # TPU's all-reduce-scatter fusion: an all-reduce whose result the fusion's ROOT only
    # dynamic-slices (one ring reduce-scatter); a padded one (8 rows into 2 x 5) moves the
    # extra rows to the next shard by a collective-permute of a slice of its result.
    groups = "replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add"
    meta = 'metadata={op_name="jit(step)/transpose(jvp(layer0))/dot_general"}'
    pairs = "channel_id=1, source_target_pairs={{0,1},{2,3}}"
    text = f"""HloModule m, num_partitions=4

%add (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}}

%all-reduce-scatter (input: bf16[8,4]) -> bf16[5,4] {{
  %input = bf16[8,4]{{1,0}} parameter(0)
  %z = bf16[] constant(0)
  %pad = bf16[10,4]{{1,0}} pad(%input, %z), padding=0_2x0_0
  %ar = bf16[10,4]{{1,0}} all-reduce(%pad), channel_id=3, {groups}
  %i = u32[] partition-id()
  %c = u32[] constant(0)
  ROOT %ds = bf16[5,4]{{1,0}} dynamic-slice(%ar, %i, %c), dynamic_slice_sizes={{5,4}}
}}

ENTRY %main (p: bf16[8,4]) -> bf16[3,4] {{
  %p = bf16[8,4]{{1,0}} parameter(0)
  %f = bf16[5,4]{{1,0}} fusion(%p), kind=kCustom, calls=%all-reduce-scatter, {meta}
  %sl = bf16[3,4]{{1,0}} slice(%f), slice={{[2:5], [0:4]}}
  %cp = (bf16[3,4]{{1,0}}, bf16[3,4]{{1,0}}, u32[], u32[]) collective-permute-start(%sl), {pairs}
  ROOT %d = bf16[3,4]{{1,0}} collective-permute-done(%cp)
}}
"""
    ops = hread.parse_hlo_collectives(text)
    assert sorted((o["kind"], o["bytes"], bool(o.get("fixup"))) for o in ops) == [
        ("collective-permute", 3 * 4 * 2, True), ("reduce-scatter", 10 * 4 * 2, False)]
    xr = {"num_chips": 4, "mesh_axes": ["data", "fsdp"], "mesh_shape": [2, 2],
          "mesh_device_ids": [0, 1, 2, 3], "ops": ops}
    assert xdoc.xla_logical_bytes(xr) == {("reduce-scatter", "fsdp"): 13 * 4 * 2}
    # tpusim import-hlo runs the fusion as one reduce-scatter of the padded operand too.
    from sim.chips import get_chip
    from tests.conftest import make_topology
    from workloads.hlo.lower import import_hlo

    trace = import_hlo(text, topology=make_topology(get_chip("v5e"), "2x2"), source="t").trace
    assert sorted((o.collective, o.bytes) for o in trace.ops if o.kind == "collective") == [
        ("collective-permute", 3 * 4 * 2), ("reduce-scatter", 10 * 4 * 2)]


def test_a_loop_whose_induction_variable_steps_through_a_copy_counts_its_real_trips():
    # i < 8, i += 2 read through copy(i) (a rotated loop): 4 trips, not 8.
    text = """HloModule m

%body (param: (u32[], bf16[4])) -> (u32[], bf16[4]) {
  %param = (u32[], bf16[4]{0}) parameter(0)
  %i = u32[] get-tuple-element(%param), index=0
  %ci = u32[] copy(%i)
  %two = u32[] constant(2)
  %next = u32[] add(%ci, %two)
  %x = bf16[4]{0} get-tuple-element(%param), index=1
  %cp = bf16[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (u32[], bf16[4]{0}) tuple(%next, %cp)
}

%cond (param: (u32[], bf16[4])) -> pred[] {
  %param = (u32[], bf16[4]{0}) parameter(0)
  %i = u32[] get-tuple-element(%param), index=0
  %c = u32[] constant(8)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: bf16[4]) -> bf16[4] {
  %a = bf16[4]{0} parameter(0)
  %z = u32[] constant(0)
  %init = (u32[], bf16[4]{0}) tuple(%z, %a)
  %w = (u32[], bf16[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %y = bf16[4]{0} get-tuple-element(%w), index=1
}
"""
    (op,) = hread.parse_hlo_collectives(text)
    assert op["count"] == 4


# -- rings over four chips (the v6e MoE program's expert weights over fsdp=4) -------------------

def test_a_ring_over_four_chips_is_written_out_gathers_send_three_shards():
    # N = 4: one bidirectional loop trip, so XLA unrolls the windowed einsum: a gather sends
    # N - 1 = 3 shards (3/4 of V); a gradient reduce-scatter sends 3 partial sums and a zero
    # accumulator each way (5/4), except the up projection's, whose dot is merged with the
    # gate's and shares its ring start (3/4).
    trace = _trace("fsdp=4", 4, fsdp_gather="mixed-blocking")
    fwd = _colls(trace, "fsdp_allgather_fwd_")
    assert {k: o.bytes for k, o in fwd.items()} == {k: v * 3 / 4 for k, v in MATRIX_BYTES.items()}
    rs = _colls(trace, "fsdp_grad_reducescatter_")
    assert {k: o.bytes for k, o in rs.items()} == {
        k: v * (3 / 4 if k == "w_up" else 5 / 4) for k, v in MATRIX_BYTES.items()}
    # Larger rings keep their loop: N + 1 messages (fsdp = 8: 9/8).
    eight = _trace("fsdp=8", 8, fsdp_gather="mixed-blocking")
    assert _colls(eight, "fsdp_allgather_fwd_")["wq"].bytes == MATRIX_BYTES["wq"] * 9 / 8
    assert _colls(eight, "fsdp_grad_reducescatter_")["w_up"].bytes == \
        MATRIX_BYTES["w_up"] * 9 / 8


def test_an_moe_layer_gathers_all_four_attention_matrices_again_for_their_input_gradients():
    moe = model_from_dict({**SMALL, "num_experts": 4, "experts_per_token": 2})
    trace = compile_training_step(moe, parse_mesh("fsdp=2,expert=2"), 4,
                                  TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                 fsdp_gather="mixed-blocking"))
    regathers = {o.name.removeprefix("fsdp_allgather_bwd_"): o for o in trace.ops
                 if o.layer == 1 and o.name.endswith("_dx")}
    assert set(regathers) == {"wq_dx", "wk_dx", "wv_dx", "wo_dx"}
    # Plain gathers of each matrix over fsdp x expert (V = the whole matrix).
    assert {k: o.bytes for k, o in regathers.items()} == {
        f"{k}_dx": MATRIX_BYTES[k] for k in ("wq", "wk", "wv", "wo")}
    (px,) = [o for o in trace.ops if o.name == "attn_proj_bwd" and o.layer == 1]
    assert {o.id for o in regathers.values()} <= set(px.deps)
    # A dense layer re-gathers q and k only.
    dense = {o.name for o in _trace("fsdp=4", 4, fsdp_gather="mixed-blocking").ops
             if o.layer == 1 and o.name.endswith("_dx")}
    assert dense == {"fsdp_allgather_bwd_wq_dx", "fsdp_allgather_bwd_wk_dx"}


def test_the_mixed_modes_pick_each_gradients_collective_by_its_own_ring():
    # fsdp=16 x expert=4 on 64 chips: the attention and router matrices are split over all 64
    # (more than XLA windows: a synchronous all-reduce of the whole gradient), the routed
    # experts over fsdp=16 only (a windowed reduce-scatter ring of 17 messages), as XLA
    # compiles the 750B MoE's fsdp=16 x expert=16 step (validation/xla_moe_schedule.py).
    moe = model_from_dict({**SMALL, "num_experts": 4, "experts_per_token": 2})
    trace = compile_training_step(moe, parse_mesh("fsdp=16,expert=4"), 64,
                                  TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                 fsdp_gather="mixed-blocking"))
    grads = {o.name: o for o in trace.ops if o.layer == 1 and o.name.startswith("fsdp_grad_")}
    assert {grads[f"fsdp_grad_allreduce_{k}"].collective for k in ("wq", "wo", "router")} \
        == {"all-reduce"}
    (up,) = [o for o in grads.values() if o.name.endswith("_expert_up")]
    assert up.name == "fsdp_grad_reducescatter_expert_up" and up.collective == "reduce-scatter"
    expert_up = 4 * 512 * 1024 * 2 / 4  # the chip's expert (4 experts over expert=4), bf16
    assert up.bytes == pytest.approx(expert_up * 17 / 16)
    # Only the synchronous all-reduces hold layer 0's backward back.
    waits = set().union(*(o.deps for o in trace.ops if o.layer == 0 and o.phase == "bwd"))
    assert grads["fsdp_grad_allreduce_wq"].id in waits and up.id not in waits


@pytest.mark.parametrize("gather", ["async", "blocking"])
def test_fsdp_grad_auto_reduce_scatters_up_to_32_chips_and_all_reduces_above(gather):
    # XLA's choice per matrix (`--fsdp-grad auto`): over an FSDP group of up to 32 chips each
    # gradient is reduce-scattered (async, hidden), above it all-reduced whole by a synchronous
    # collective that layer 0's backward waits for. V is the whole matrix gradient either way.
    for chips, kind in ((32, "reduce-scatter"), (64, "all-reduce")):
        trace = _trace(f"fsdp={chips}", chips, fsdp_gather=gather, fsdp_grad="auto")
        grads = _colls(trace, f"fsdp_grad_{kind.replace('-', '')}_")
        assert {k: (o.collective, o.bytes) for k, o in grads.items()} == {
            k: (kind, v) for k, v in MATRIX_BYTES.items()}
        assert not [o for o in trace.ops if o.name.startswith("fsdp_grad_")
                    and o.collective != kind]
        waits = set().union(*(o.deps for o in trace.ops if o.layer == 0 and o.phase == "bwd"))
        assert ({o.id for o in grads.values()} <= waits) == (kind == "all-reduce")
        assert not {o.id for o in grads.values()} & waits or kind == "all-reduce"
        (emb,) = [o for o in trace.ops if o.name.startswith("fsdp_grad_")
                  and o.name.endswith("_embed")]
        assert emb.collective == kind


def test_fsdp_grad_auto_goes_by_each_matrixs_own_group_with_plain_gathers():
    # fsdp=16 x expert=4 with async gathers: attention and router split 64 ways are all-reduced,
    # the routed experts split over fsdp=16 reduce-scattered (plain, not a ring: V is the chip's
    # expert_up gradient), as XLA compiles the 750B MoE; the mixed modes already do this, so
    # auto changes nothing there.
    moe = model_from_dict({**SMALL, "num_experts": 4, "experts_per_token": 2})

    def trace(**cfg):
        return compile_training_step(moe, parse_mesh("fsdp=16,expert=4"), 64,
                                     TrainingConfig(seq_len=SEQ, batch_per_chip=1, **cfg))
    grads = {o.name: o for o in trace(fsdp_grad="auto").ops
             if o.layer == 1 and o.name.startswith("fsdp_grad_")}
    assert {grads[f"fsdp_grad_allreduce_{k}"].bytes for k in ("wq", "wo")} == {
        MATRIX_BYTES["wq"]}
    (up,) = [o for o in grads.values() if o.name.endswith("_expert_up")]
    assert up.name == "fsdp_grad_reducescatter_expert_up"
    assert up.bytes == 4 * 512 * 1024 * 2 / 4
    mixed = [(o.name, o.collective, o.bytes, o.deps) for o in
             trace(fsdp_gather="mixed-blocking").ops]
    assert [(o.name, o.collective, o.bytes, o.deps) for o in
            trace(fsdp_gather="mixed-blocking", fsdp_grad="auto").ops] == mixed


def test_an_all_reduced_gradient_moves_twice_a_reduce_scatters_bytes():
    # Same V on a 16-chip wrapped ring (v5e x = 0..15), ring algorithm: a reduce-scatter puts
    # (N-1)/N V on the busiest link, an all-reduce 2(N-1)/N V (the reduce-scatter and then an
    # all-gather of the sums).
    from sim.chips import get_chip
    from sim.collectives import simulate_collective
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=(16,))
    (op,) = [o for o in _trace("fsdp=64", 64, fsdp_grad="auto").ops
             if o.name == "fsdp_grad_allreduce_w_up" and o.layer == 1]
    moved = {kind: simulate_collective(chip=chip, topology=topo, op=kind, axes=("x",),
                                       nbytes=int(op.bytes), algorithm="ring"
                                       ).bytes_on_busiest_link
             for kind in ("reduce-scatter", "all-reduce")}
    assert moved["reduce-scatter"] == pytest.approx(15 / 16 * op.bytes)
    assert moved["all-reduce"] == pytest.approx(2 * 15 / 16 * op.bytes)


def test_an_unrolled_rings_permutes_are_read_as_gather_or_reduce_scatter_steps():
    # Outside a windowed_dot_general loop: a permute of a weight shard (or of a received one,
    # relayed) is a gather step; one of a zero accumulator, or of a fusion adding a received
    # permute to a partial product, is a reduce-scatter step.
    dot = 'metadata={op_name="jit(step)/transpose(jvp(layer0))/ebcm,emh->ebch/dot_general"}'
    pairs = "source_target_pairs={{0,1},{1,0}}"
    tup = "(bf16[4]{0}, bf16[4]{0}, u32[], u32[])"
    start = f"{tup} collective-permute-start"
    attrs = f"{pairs}, {dot}"
    text = f"""HloModule m, num_partitions=2

%acc (a: bf16[4], b: bf16[4]) -> bf16[4] {{
  %a = bf16[4]{{0}} parameter(0)
  %b = bf16[4]{{0}} parameter(1)
  ROOT %s = bf16[4]{{0}} add(%a, %b)
}}

ENTRY %main (w: bf16[4], g: bf16[4]) -> bf16[4] {{
  %w = bf16[4]{{0}} parameter(0)
  %g = bf16[4]{{0}} parameter(1)
  %ag = {start}(%w), channel_id=1, {attrs}
  %agd = bf16[4]{{0}} collective-permute-done(%ag)
  %relay = {start}(%agd), channel_id=2, {attrs}
  %z = bf16[] constant(0)
  %zeros = bf16[4]{{0}} broadcast(%z), dimensions={{}}
  %rs0 = {start}(%zeros), channel_id=3, {attrs}
  %rs0d = bf16[4]{{0}} collective-permute-done(%rs0)
  %sum = bf16[4]{{0}} fusion(%rs0d, %g), kind=kLoop, calls=%acc
  %rs1 = {start}(%sum), channel_id=4, {attrs}
  ROOT %rs1d = bf16[4]{{0}} collective-permute-done(%rs1)
}}
"""
    roles = {o["channel"]: o["ring"] for o in hread.parse_hlo_collectives(text)}
    assert roles == {1: "ag", 2: "ag", 3: "rs0", 4: "rs"}
    xr = {"num_chips": 2, "mesh_axes": ["fsdp"], "mesh_shape": [2], "mesh_device_ids": [0, 1],
          "ops": hread.parse_hlo_collectives(text)}
    assert xdoc.xla_logical_bytes(xr) == {("all-gather", "fsdp"): 16,
                                          ("reduce-scatter", "fsdp"): 16}
    # Collectives: a gather ring per N - 1 = 1 message (2), a reduce-scatter ring per zero
    # start each way (one start here: half a ring).
    assert xdoc.xla_logical_counts(xr) == {("all-gather", "fsdp"): 2,
                                         ("reduce-scatter", "fsdp"): 0.5}


@pytest.mark.parametrize(("tp_activations", "name", "kind"), [
    ("replicated", "tp_allreduce_logits_bwd", "all-reduce"),
    ("sharded", "tp_reducescatter_logits_bwd", "reduce-scatter"),
])
def test_the_logits_input_gradient_is_summed_over_tensor_in_bf16(tp_activations, name, kind):
    # fsdp=2 x tensor=4: each vocabulary shard's input gradient [n, d_model] (n = 1024 tokens
    # per tensor group) is summed over tensor in bf16, as the compiled fsdp x tensor programs
    # keep that path (no f32 logits-path gradient), even with f32 weight gradients.
    n = 4 * SEQ
    for grad_dtype in ("bf16", "fp32"):
        trace = _trace("fsdp=2,tensor=4", 8, tp_activations=tp_activations,
                       grad_dtype=grad_dtype)
        (red,) = _ops(trace, name)
        assert (red.collective, red.mesh_axes, red.bytes) == (kind, ("tensor",), n * D * 2)
        (dx,) = _ops(trace, "logits_bwd")
        assert dx.id in red.deps
        # The last layer's backward starts from the reduced gradient.
        top = [o for o in trace.ops if o.layer == 1 and o.phase == "bwd" and red.id in o.deps]
        assert top
    # Without a tensor axis there is nothing to sum.
    assert not [o for o in _trace("fsdp=8", 8).ops if "logits_bwd" in o.name
                and o.kind == "collective"]


def test_the_incoming_gradient_is_gathered_over_tensor_alongside_the_recomputation():
    # fsdp=2 x tensor=4, activations sharded over tensor, remat full: each layer's incoming
    # gradient ([n, d_model] bf16, n = 1024) is all-gathered over tensor as soon as it exists,
    # not after the layer's recomputation, which does not need it.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations="sharded")
    by = {o.id: o for o in trace.ops}
    incoming = {1: "tp_reducescatter_logits_bwd", 0: "norm_attn_bwd"}
    for layer, src in incoming.items():
        (ag,) = [o for o in trace.ops if o.name == "tp_allgather_mlp_bwd" and o.layer == layer]
        assert (ag.collective, ag.mesh_axes, ag.bytes) == ("all-gather", ("tensor",),
                                                           4 * SEQ * D * 2)
        assert [(by[i].name, by[i].layer) for i in ag.deps] == [(src, -1 if layer == 1 else 1)]
        assert any(o.name.startswith("re-") and o.layer == layer and o.id < ag.id
                   for o in trace.ops)
