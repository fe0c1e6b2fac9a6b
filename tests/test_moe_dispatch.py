"""The MoE dispatch form (`--moe-dispatch auto|all-to-all|all-gather`, docs/model/moe.md "The
dispatch form"): the collectives each form issues over `expert`, in closed form, and the
refusals of settings it cannot apply to."""

from __future__ import annotations

import pytest
import yaml

from sim.chips import get_chip
from sim.cli import main
from sim.engine.replay import replay
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.moe import MoeConfig, expert_capacity
from workloads.training import TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

MOE = {
    "name": "moe-test", "num_layers": 1, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
    "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 1024, "num_experts": 8,
    "experts_per_token": 2,
}
DENSE = {k: v for k, v in MOE.items() if k not in ("num_experts", "experts_per_token")}
SEQ, D, A = 512, 1024, 2  # tokens per chip (one sequence), d_model, bf16 activation bytes


def _trace(form: str, mesh: str = "fsdp=2,expert=4", cf: float | None = 1.25, **kw):
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=1, moe=MoeConfig(capacity_factor=cf),
                         moe_dispatch=form, **kw)
    return compile_training_step(model_from_dict(MOE), parse_mesh(mesh), 8, cfg)


def _over_expert(trace) -> dict[tuple[str, str], float]:
    """(op name, collective) -> bytes of the collectives over `expert` alone."""
    out: dict[tuple[str, str], float] = {}
    for o in trace.ops:
        if o.kind == "collective" and tuple(o.mesh_axes) == ("expert",):
            key = (o.name.removeprefix("re-"), o.collective)
            out[key] = out.get(key, 0.0) + o.bytes
    return out


def test_auto_is_the_all_to_all_form_on_tpusims_batch_split_over_expert():
    auto, a2a = _trace("auto"), _trace("all-to-all")
    assert [(o.name, o.bytes) for o in auto.ops] == [(o.name, o.bytes) for o in a2a.ops]
    assert any(o.collective == "all-to-all" for o in auto.ops if o.kind == "collective"
               and tuple(o.mesh_axes) == ("expert",))


def test_all_gather_form_moves_the_expert_groups_tokens_in_closed_form():
    ep, E, k = 4, 8, 2
    cap = expert_capacity(SEQ, E, k, 1.25)
    trace = _trace("all-gather")
    coll = _over_expert(trace)
    tokens = ep * SEQ * D * A  # the expert group's tokens, gathered
    # Forward: the tokens and the combine masks gathered; the experts' outputs still go back
    # by an all-to-all for the combine (the a2a form's buffer: E x cap slots of the chip's
    # sequence). Recomputation (remat full): the tokens and masks gathered again, no
    # all-to-all. Backward: the output gradient gathered, the top-k weights' gradient
    # all-reduced, the input gradient reduce-scattered.
    assert coll == {
        ("ep_token_allgather", "all-gather"): 2 * tokens,
        ("ep_mask_allgather", "all-gather"): 2 * ep * SEQ * E * cap * A,
        ("ep_combine", "all-to-all"): E * cap * D * A * ep,
        ("ep_grad_allgather", "all-gather"): tokens,
        ("ep_topk_grad_allreduce", "all-reduce"): ep * SEQ * k * A,
        ("ep_token_grad_reducescatter", "reduce-scatter"): tokens,
    }
    a2a = _over_expert(_trace("all-to-all"))
    assert a2a[("ep_dispatch", "all-to-all")] == 2 * E * cap * D * A * ep  # fwd + recompute
    assert ("ep_token_allgather", "all-gather") not in a2a


def test_all_gather_form_keeps_the_dense_dispatch_flops_and_reruns_the_router_on_the_group():
    ep, E = 4, 8
    ag, a2a = _trace("all-gather"), _trace("all-to-all")
    cap = expert_capacity(SEQ, E, 2, 1.25)

    def flops(trace, name):
        return sum(o.flops for o in trace.ops if o.name == name)

    for name in ("moe_dispatch", "re-moe_dispatch", "moe_combine", "expert_in", "expert_out",
                 "mlp_bwd", "moe_dispatch_bwd", "moe_combine_bwd"):
        assert flops(ag, name) == flops(a2a, name), name
    assert flops(ag, "moe_dispatch") == 2 * SEQ * E * cap * D
    router = 2 * SEQ * D * E  # one router matmul over the chip's own tokens
    assert flops(ag, "router") == flops(a2a, "router") == router
    assert flops(ag, "re-router") == ep * router
    assert flops(ag, "router_bwd") == ep * flops(a2a, "router_bwd") == 2 * ep * router


def _temporaries(trace) -> dict[str, float]:
    """op name -> the TEMPORARIES bytes allocated (+) or freed (-) when it ends."""
    out: dict[str, float] = {}
    for op_id, cat, delta in trace.meta.memory_events:
        if cat == "temporaries":
            name = trace.ops[int(op_id)].name
            out[name] = out.get(name, 0.0) + float(delta)
    return out


def test_all_gather_form_holds_the_recomputations_gathered_buffers_to_the_dispatch_backward():
    ep, E = 4, 8
    cap = expert_capacity(SEQ, E, 2, 1.25)
    tokens = ep * SEQ * D * A
    masks = ep * SEQ * E * cap * A
    ag = _temporaries(_trace("all-gather"))
    # The recomputation's gathered tokens and masks and the gathered output gradient, from
    # their gathers to the dispatch's backward (XLA's live ranges at its peak, docs/model/moe.md
    # "The dispatch form"); the forward's gathers are not held (the recomputation reruns them).
    assert ag["re-ep_token_allgather"] == tokens
    assert ag["re-ep_mask_allgather"] == masks
    assert ag["ep_grad_allgather"] == tokens
    assert ag["moe_dispatch_bwd"] == -(2 * tokens + masks)
    assert "ep_token_allgather" not in ag and "ep_mask_allgather" not in ag
    a2a = _temporaries(_trace("all-to-all"))
    assert not {"ep_grad_allgather", "moe_dispatch_bwd"} & set(a2a)
    # The peak rises by at most what is held (the rest of the step is the same program).
    peak = {f: _run_peak(f) for f in ("all-gather", "all-to-all")}
    assert 0 < peak["all-gather"] - peak["all-to-all"] <= 2 * tokens + masks


def _run_peak(form: str) -> float:
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x4")
    return replay(_trace(form), chip, topo).hbm_peak_bytes


def test_dropless_all_gather_form_is_maxtexts_ring_of_experts():
    ep, E = 4, 8
    trace = _trace("all-gather", cf=None)
    coll = _over_expert(trace)
    tokens = ep * SEQ * D * A
    logits = ep * SEQ * E * 4
    assert coll == {
        ("ep_token_allgather", "all-gather"): 2 * tokens,  # forward, recomputation
        ("ep_logits_allgather", "all-gather"): 2 * logits,
        ("ep_combine_reducescatter", "reduce-scatter"): tokens,  # forward only: dead in re-
        ("ep_grad_allgather", "all-gather"): tokens,
        ("ep_logits_grad_reducescatter", "reduce-scatter"): logits,
        ("ep_token_grad_reducescatter", "reduce-scatter"): tokens,
    }


@pytest.mark.parametrize("kw,needles", [
    (dict(moe_dispatch="scatter"), ("moe_dispatch", "'scatter'", "all-gather")),
])
def test_bad_dispatch_form_is_a_one_line_error(kw, needles):
    with pytest.raises(TpusimError) as e:
        TrainingConfig(seq_len=128, batch_per_chip=1, **kw)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value)


@pytest.mark.parametrize("model,mesh,needles", [
    (DENSE, "fsdp=8", ("moe_dispatch", "dense")),
    (MOE, "fsdp=8", ("moe_dispatch", "no expert axis", "expert=N")),
])
def test_an_explicit_form_needs_an_moe_model_and_an_expert_axis(model, mesh, needles):
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=1, moe_dispatch="all-gather")
    with pytest.raises(TpusimError) as e:
        compile_training_step(model_from_dict(model), parse_mesh(mesh), 8, cfg)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value)


def test_all_gather_with_async_all_to_alls_is_refused():
    with pytest.raises(TpusimError, match="has none"):
        _trace("all-gather", ep_alltoall="async")


def test_cli_names_the_flag(tmp_path, capsys):
    path = tmp_path / "dense.yaml"
    path.write_text(yaml.safe_dump(DENSE))
    rc = main(["train", "--chip", "v5e", "--shape", "2x4", "--model", str(path), "--seq-len",
               "128", "--batch-per-chip", "1", "--mesh", "fsdp=8", "--moe-dispatch",
               "all-gather"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1, err
    assert "--moe-dispatch all-gather" in err and "dense" in err
