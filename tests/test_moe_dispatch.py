"""The MoE dispatch form (`--moe-dispatch auto|all-to-all|all-gather`, docs/model/moe.md "The
dispatch form"): the collectives each form issues over `expert`, in closed form, and the
refusals of settings it cannot apply to."""

from __future__ import annotations

import pytest
import yaml

from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
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
    ep = 4
    trace = _trace("all-gather")
    coll = _over_expert(trace)
    assert not any(kind == "all-to-all" for _, kind in coll)
    tokens = ep * SEQ * D * A  # the expert group's tokens, gathered
    # Forward and its recomputation under remat full: the tokens gathered, the combine's
    # partial sums reduce-scattered back; backward: the output gradient gathered, the input
    # gradient's partial sums reduce-scattered.
    assert coll[("ep_token_allgather", "all-gather")] == 2 * tokens
    assert coll[("ep_grad_allgather", "all-gather")] == tokens
    assert coll[("ep_token_grad_reducescatter", "reduce-scatter")] == tokens
    assert coll[("ep_combine_reducescatter", "reduce-scatter")] == tokens


def test_all_gather_form_keeps_the_dense_dispatch_flops_and_runs_the_router_on_the_group():
    ep = 4
    ag, a2a = _trace("all-gather"), _trace("all-to-all")
    cap = expert_capacity(SEQ, 8, 2, 1.25)

    def flops(trace, name):
        return sum(o.flops for o in trace.ops if o.name.removeprefix("re-") == name)

    for name in ("moe_dispatch", "moe_combine", "expert_in", "expert_out", "mlp_bwd"):
        assert flops(ag, name) == flops(a2a, name), name
    assert next(o for o in ag.ops if o.name == "moe_dispatch").flops == 2 * SEQ * 8 * cap * D
    # The router sees the ep chips' tokens (forward and recomputation).
    assert flops(ag, "router") == ep * flops(a2a, "router") == 2 * 2 * ep * SEQ * D * 8


def test_dropless_all_gather_form_is_maxtexts_ring_of_experts():
    ep = 4
    trace = _trace("all-gather", cf=None)
    coll = _over_expert(trace)
    assert not any(kind == "all-to-all" for _, kind in coll)
    tokens = ep * SEQ * D * A
    assert coll[("ep_token_allgather", "all-gather")] == 2 * tokens  # forward, recomputation
    assert coll[("ep_combine_reducescatter", "reduce-scatter")] == tokens
    assert coll[("ep_grad_allgather", "all-gather")] == tokens
    assert coll[("ep_token_grad_reducescatter", "reduce-scatter")] == tokens


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
