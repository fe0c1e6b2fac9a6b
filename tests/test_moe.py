"""MoE routing: Zipf router skew, capacity-factor dropping and MaxText's dense one-hot dispatch,
in training and decode (workloads/moe.py, docs/model.md "MoE routing")."""

from __future__ import annotations

import math
import re

import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.engine.replay import replay
from tests.conftest import make_topology
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.inference import DecodeConfig, compile_decode_step
from workloads.moe import MoeConfig, expert_capacity, expert_shares, plan_routing, shard_shares
from workloads.training import TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

# Wide enough that the expert matmuls are MXU-bound on a v5e.
MOE = {
    "name": "moe-test", "num_layers": 1, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
    "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 1024, "num_experts": 8,
    "experts_per_token": 2,
}
DENSE = {k: v for k, v in MOE.items() if k not in ("num_experts", "experts_per_token")}
SEQ = 512


def _train(moe: MoeConfig, mesh: str = "expert=4", model: dict = MOE):
    chip = get_chip("v5e")
    topo = make_topology(chip, "2x2")
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=1, moe=moe)
    trace = compile_training_step(model_from_dict(model), parse_mesh(mesh), 4, cfg)
    return trace, replay(trace, chip, topo)


def _flops(trace, *names: str) -> float:
    return sum(o.flops for o in trace.ops if o.name.removeprefix("re-") in names)


def test_zipf_shares_follow_the_closed_form_and_never_exceed_one_over_k():
    h4 = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert expert_shares(4, 1, 1.0) == pytest.approx([1 / h4, 0.5 / h4, 1 / 3 / h4, 0.25 / h4])
    assert expert_shares(8, 2, 0.0) == [0.125] * 8
    # S = 3, k = 2: expert 1 would take 1/1.2 of the assignments; it is capped at 1/2 and the
    # rest share 1/2 in Zipf proportions.
    s = expert_shares(8, 2, 3.0)
    rest = [(r + 1) ** -3.0 for r in range(1, 8)]
    assert s[0] == 0.5
    assert s[1:] == pytest.approx([0.5 * v / sum(rest) for v in rest])
    assert math.isclose(sum(s), 1.0)


@pytest.mark.parametrize("experts,k,ep", [(8, 2, 2), (8, 2, 4), (16, 2, 4), (64, 8, 8),
                                          (4, 2, 2), (8, 1, 8)])
def test_the_hottest_shard_load_never_falls_as_skew_grows(experts, k, ep):
    prev = 0.0
    for i in range(121):
        shares = shard_shares(expert_shares(experts, k, i / 20), ep)
        assert shares[0] == max(shares)
        assert shares[0] >= prev - 1e-12
        prev = shares[0]
    assert prev > 1 / ep  # at S = 6 the skew shows


def test_training_step_time_is_non_decreasing_in_skew_and_s0_is_the_unskewed_step():
    base_trace, base = _train(MoeConfig())
    s0_trace, s0 = _train(MoeConfig(expert_skew=0.0, seed=7))
    assert s0.step_time_s == base.step_time_s
    assert s0_trace.ops == base_trace.ops
    times = [base.step_time_s] + [_train(MoeConfig(expert_skew=s))[1].step_time_s
                                  for s in (0.5, 1.0, 2.0, 4.0)]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False)), times
    assert times[-1] > 1.3 * times[0]


def test_skew_scales_expert_matmuls_and_all_to_alls_by_the_hot_shard_load():
    base, _ = _train(MoeConfig())
    skewed, _ = _train(MoeConfig(expert_skew=1.0))
    load = shard_shares(expert_shares(8, 2, 1.0), 4)[0] * 4
    assert skewed.meta.moe["max_load_factor"] == pytest.approx(load)
    for name in ("expert_in", "expert_out", "ep_dispatch"):
        b = next(o for o in base.ops if o.name == name)
        s = next(o for o in skewed.ops if o.name == name)
        assert (s.flops or s.bytes) == pytest.approx(load * (b.flops or b.bytes))
    # The router and the attention do not change.
    assert _flops(skewed, "router", "qkv_proj") == _flops(base, "router", "qkv_proj")


def test_without_an_expert_axis_skew_moves_no_work():
    # Every chip holds every expert: an uneven router changes which expert works, not how much.
    _, base = _train(MoeConfig(), mesh="fsdp=4")
    _, skewed = _train(MoeConfig(expert_skew=2.0), mesh="fsdp=4")
    assert skewed.step_time_s == pytest.approx(base.step_time_s, rel=1e-12)


def test_dense_dispatch_flops_follow_the_closed_form():
    trace, _ = _train(MoeConfig(capacity_factor=1.25))
    # One 512-token sequence per chip is one routing group: capacity = ceil(512 x 2 / 8) x 1.25.
    cap = 160
    assert expert_capacity(SEQ, 8, 2, 1.25) == cap
    assert trace.meta.moe["expert_capacity"] == cap
    n, experts, d_model = SEQ, 8, 1024
    einsum = 2 * n * experts * cap * d_model
    fwd = [o for o in trace.ops if o.phase == "fwd"]
    assert next(o for o in fwd if o.name == "moe_dispatch").flops == einsum
    assert next(o for o in fwd if o.name == "moe_combine").flops == einsum
    assert next(o for o in trace.ops if o.name == "moe_dispatch_bwd").flops == einsum
    assert next(o for o in trace.ops if o.name == "moe_combine_bwd").flops == 2 * einsum
    # Experts compute their padded capacity: E x cap rows per sequence instead of k x tokens.
    dropless, _ = _train(MoeConfig())
    assert _flops(trace, "expert_in") == pytest.approx(
        _flops(dropless, "expert_in") * experts * cap / (2 * SEQ))
    # The all-to-all moves the padded [experts, capacity, d_model] buffer.
    a2a = next(o for o in fwd if o.name == "ep_dispatch")
    assert a2a.bytes == experts * cap * d_model * 2 * 4


def test_capacity_drops_cut_the_hot_chips_expert_work():
    skewed, t_skew = _train(MoeConfig(expert_skew=2.0))
    capped, t_cap = _train(MoeConfig(expert_skew=2.0, capacity_factor=1.0))
    assert _flops(capped, "expert_in", "expert_out") < _flops(skewed, "expert_in", "expert_out")
    moe = capped.meta.moe
    shares = expert_shares(8, 2, 2.0)
    cap = expert_capacity(SEQ, 8, 2, 1.0)
    dropped = sum(max(SEQ * 2 * s - cap, 0) for s in shares) / (SEQ * 2)
    assert moe["dropped_fraction"] == pytest.approx(dropped) and dropped > 0.2
    assert t_cap.step_time_s < t_skew.step_time_s
    # With no skew and C = 1, nothing is dropped (expected loads sit exactly at capacity).
    assert plan_routing(model_from_dict(MOE), 4, SEQ, MoeConfig(capacity_factor=1.0)
                        ).dropped_fraction == 0.0


def test_decode_skew_loads_the_hot_chip_and_s0_is_unchanged():
    chip = get_chip("v5e")
    topo = make_topology(chip, "2x2")
    model, mesh = model_from_dict(MOE), parse_mesh("expert=4")

    def step(moe):
        tr = compile_decode_step(model, mesh, 4, DecodeConfig(batch=64, context_len=256, moe=moe))
        return tr, replay(tr, chip, topo).step_time_s

    base_tr, base = step(MoeConfig())
    s0_tr, s0 = step(MoeConfig(expert_skew=0.0, seed=3))
    assert s0 == base and s0_tr.ops == base_tr.ops
    _, skew = step(MoeConfig(expert_skew=2.0))
    assert skew > base
    cap_tr, _ = step(MoeConfig(capacity_factor=1.0))
    # Decode routes one token per sequence: capacity max(ceil(k/E) x C, C) = 1 per expert, so
    # the dense path computes all E experts for every token.
    assert cap_tr.meta.moe["expert_capacity"] == 1
    rows = next(o for o in cap_tr.ops if o.name == "expert_in").flops
    rows_dropless = next(o for o in base_tr.ops if o.name == "expert_in").flops
    assert rows == pytest.approx(rows_dropless * 8 / 2)


@pytest.mark.parametrize("kw,needle", [
    ({"expert_skew": -1.0}, "expert_skew -1.0 must be a finite number in [0, 100]"),
    ({"expert_skew": 100.5}, "expert_skew 100.5 must be a finite number in [0, 100]"),
    ({"expert_skew": float("nan")}, "expert_skew nan"),
    ({"expert_skew": float("inf")}, "expert_skew inf"),
    ({"capacity_factor": 0.0}, "capacity_factor 0.0 must be a finite number in (0, 1e6]"),
    ({"capacity_factor": 1e6 + 1}, "capacity_factor 1000001.0 must be a finite number"),
    ({"capacity_factor": float("nan")}, "capacity_factor nan"),
    # Past float's range: refused (not an OverflowError), the value cut short in the message.
    ({"expert_skew": 10**400}, "expert_skew <integer of 401 digits> must be"),
    ({"capacity_factor": -10**400}, "capacity_factor <integer of 401 digits> must"),
])
def test_bad_router_settings_are_one_line_errors(kw, needle):
    with pytest.raises(TpusimError, match=re.escape(needle)) as e:
        MoeConfig(**kw)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


def test_router_settings_on_a_dense_model_are_refused():
    with pytest.raises(TpusimError, match="expert_skew 1.0 needs an MoE model"):
        _train(MoeConfig(expert_skew=1.0), mesh="fsdp=4", model=DENSE)
    with pytest.raises(TpusimError, match="capacity_factor 1.25 needs an MoE model"):
        compile_decode_step(model_from_dict(DENSE), parse_mesh("tensor=4"), 4,
                            DecodeConfig(batch=4, context_len=64,
                                         moe=MoeConfig(capacity_factor=1.25)))


def test_cli_expert_skew_on_a_dense_model_exits_2_with_one_line(capsys):
    rc = main(["train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b",
               "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "fsdp=4",
               "--expert-skew", "1.5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "tpusim: error: --expert-skew 1.5 needs an MoE model" in err
    rc = main(["decode", "--chip", "v5e", "--shape", "2x2", "--model", "mixtral-8x7b",
               "--batch", "8", "--context-len", "64", "--mesh", "tensor=4",
               "--expert-skew", "nan"])
    assert rc == 2 and "--expert-skew 'nan' is not finite" in capsys.readouterr().err


def test_scenario_yaml_sets_the_router_as_the_flags_do(tmp_path, capsys):
    args = ["train", "--chip", "v5e", "--shape", "2x2", "--model", "mixtral-8x7b",
            "--seq-len", "256", "--batch-per-chip", "1", "--mesh", "fsdp=2,expert=2", "--json"]
    assert main(args + ["--expert-skew", "1.5", "--capacity-factor", "1.25"]) == 0
    flags = capsys.readouterr().out
    path = tmp_path / "router.yaml"
    path.write_text("expert_skew: 1.5\ncapacity_factor: 1.25\n", encoding="utf-8")
    assert main(args + ["--scenario", str(path)]) == 0
    yaml_out = capsys.readouterr().out
    import json

    a, b = json.loads(flags), json.loads(yaml_out)
    a = a.get("summary", a)
    b = b.get("summary", b)
    assert a["step_time_s"] == b["step_time_s"]
    assert a["moe"] == b["moe"] and a["moe"]["expert_capacity"] == 80  # ceil(256 x 2 / 8) x 1.25


def test_per_chip_engine_loads_the_chips_that_hold_the_hot_experts():
    from sim.engine.executors import simulate_chips
    from sim.engine.perchip import PerChipConfig
    from workloads.moe import expert_op_scales

    chip = get_chip("v5e")
    topo = make_topology(chip, "2x2")
    trace, rep = _train(MoeConfig(expert_skew=1.5, seed=1))
    _, uniform = _train(MoeConfig())
    scales = expert_op_scales(trace, topo)
    load = trace.meta.moe["max_load_factor"]
    assert scales and all(s.max() == 1.0 for s in scales.values())
    # Skew moves expert work between chips, it does not add any: per op, the chips' work sums
    # to the uniform router's.
    for s in scales.values():
        assert s.sum() * load == pytest.approx(4.0)
    res = simulate_chips(trace, chip, topo, config=PerChipConfig(op_scale=scales))
    assert res.num_chip_classes > 1
    chips = res.chips
    assert chips.mxu_busy_s.max() > 1.05 * chips.mxu_busy_s.min()
    # The synchronous step waits for the hot chip of every layer: no longer than the program
    # that is hot everywhere, longer than the balanced router's.
    assert uniform.step_time_s < res.step_time_s <= rep.step_time_s * (1 + 1e-9)
    assert expert_op_scales(_train(MoeConfig())[0], topo) == {}


def test_skewed_all_to_alls_move_each_chips_own_volume():
    # The compiled all-to-alls carry the hottest shard's tokens; on the per-chip engine each
    # chip moves its own shard's share of them (its expert-op factor), so a colder chip's DMA
    # reads and writes that many fewer HBM bytes: closed form from the healthy collective cost.
    from sim.engine.costs import collective_groups, cost_collective
    from sim.engine.executors import simulate_chips
    from sim.engine.perchip import PerChipConfig
    from workloads.moe import expert_op_scales

    chip = get_chip("v5e")
    topo = make_topology(chip, "2x2")
    trace, _ = _train(MoeConfig(expert_skew=1.5, seed=1))
    scales = expert_op_scales(trace, topo)
    a2a = [i for i in scales if trace.ops[i].collective == "all-to-all"]
    assert {trace.ops[i].name.removeprefix("re-") for i in a2a} == {
        "ep_dispatch", "ep_combine", "ep_combine_bwd", "ep_dispatch_bwd"}
    full = simulate_chips(trace, chip, topo, config=PerChipConfig(op_scale=scales))
    hot_volume = simulate_chips(trace, chip, topo, config=PerChipConfig(
        op_scale={i: s for i, s in scales.items() if i not in a2a}))
    gaxes = collective_groups(trace, topo)["expert"]
    hbm_bw = chip.hbm_bytes_per_s * chip.hbm_efficiency
    saved = sum(cost_collective(chip, topo, "all-to-all", gaxes, trace.ops[i].bytes).hbm_bytes
                * (1.0 - scales[i]) for i in a2a) / hbm_bw
    assert saved.max() > 0 and saved.min() == 0.0  # the hot chip of a layer moves it all
    got = hot_volume.chips.hbm_busy_s.to_numpy() - full.chips.hbm_busy_s.to_numpy()
    assert got == pytest.approx(saved, rel=1e-9)
    # Every member still waits for the last one to drain: the step is not shorter than the
    # slowest member's, and the colder chips wait longer in their collectives.
    assert full.step_time_s <= hot_volume.step_time_s * (1 + 1e-12)
    assert full.chips.collective_wait_s.max() > hot_volume.chips.collective_wait_s.max()


def test_replay_applies_the_compiled_router_and_refuses_another(tmp_path, capsys):
    import json

    import yaml

    model = tmp_path / "moe.yaml"
    model.write_text(yaml.safe_dump(MOE), encoding="utf-8")
    pod = ["--chip", "v5e", "--shape", "2x2"]
    moe_trace, dense_trace = tmp_path / "moe.trace", tmp_path / "dense.trace"
    dense = tmp_path / "dense.yaml"
    dense.write_text(yaml.safe_dump(DENSE), encoding="utf-8")
    assert main(["compile", *pod, "--model", str(model), "--seq-len", "128", "--batch-per-chip",
                 "1", "--mesh", "expert=4", "--expert-skew", "1.5", "-o", str(moe_trace)]) == 0
    assert main(["compile", *pod, "--model", str(dense), "--seq-len", "128",
                 "--batch-per-chip", "1", "--mesh", "fsdp=4", "-o", str(dense_trace)]) == 0
    capsys.readouterr()
    # The same router as compiled: applied (the replay equals the plain replay of the trace).
    assert main(["replay", str(moe_trace), *pod, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["replay", str(moe_trace), *pod, "--json", "--expert-skew", "1.5"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == plain["step_time_s"]
    # Another router, or any router on a dense trace: one line, exit 2, never ignored.
    for trace, flags, needle in [
        (moe_trace, ["--expert-skew", "0.5"], "compiled with --expert-skew 1.5, not"),
        (moe_trace, ["--capacity-factor", "1.25"], "recompile it with tpusim compile"),
        (dense_trace, ["--expert-skew", "1.5"], "MoE models only"),
    ]:
        rc = main(["replay", str(trace), *pod, "--json", *flags])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("group_tokens, balanced", [(128, 64), (6, 3), (14, 7), (20, 10)])
def test_a_zero_capacity_refusal_suggests_a_factor_that_works(group_tokens, balanced):
    # E = 4 experts, k = 2: ceil(g k / E) = g / 2 balanced tokens per expert, so C works from
    # 1 / balanced on. The 3-digit value is rounded up: 1/64 rounded to nearest (0.0156) still
    # leaves int(64 x 0.0156) = 0 tokens.
    e, k = 4, 2
    with pytest.raises(TpusimError, match="give at least") as info:
        plan_routing(model_from_dict({**MOE, "num_experts": e, "experts_per_token": k}), 4,
                     group_tokens,
                     MoeConfig(capacity_factor=0.5 / balanced))
    given = float(str(info.value).rsplit(" ", 1)[1])
    assert expert_capacity(group_tokens, e, k, given) == 1
    below = given - 10.0 ** (math.floor(math.log10(given)) - 2)  # one step of the last digit
    assert expert_capacity(group_tokens, e, k, below) == 0
