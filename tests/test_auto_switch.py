"""A what-if that makes `auto` switch collective algorithms says so where the switch is what
slows the step (sim/runs/auto_switch.py): the switches are the collectives whose picks differ
between the two runs' own collectives tables, and the held step time is the step with every
gather and reduction pinned to the unperturbed pod's pick, found collective by collective."""

from __future__ import annotations

import pytest

import sim
from sim.chips import get_chip
from sim.collectives import simulate_collective
from sim.collectives.auto import HeldAlgorithms, picked_algorithm
from sim.engine.costs import collective_groups, op_group_axes, padded_collective_bytes
from sim.engine.executors import simulate_step
from topologies.groups import group_axes
from topologies.slices import resolve_topology
from workloads.trace import OpKind
from workloads.zoo import model_from_dict

TINY = {"name": "tiny", "num_layers": 2, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
        "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 1024}
KW = dict(chip="v5p", shape="4x4x4", seq_len=256, batch_per_chip=1, mesh="fsdp=64")
GATHERS = ("all-gather", "reduce-scatter", "all-reduce")


@pytest.fixture(scope="module")
def runs():
    model = model_from_dict(TINY)
    base = sim.train(**KW, model=model)
    what_if = sim.train(**KW, model=model, set={"ici_hop_latency_s": "x3"})
    return base, what_if


def test_a_what_if_whose_auto_switch_slows_the_step_names_both_algorithms_and_the_held_time(runs):
    base, what_if = runs
    section = what_if.summary["auto_switch"]
    # The switches: the gathers and reductions whose label differs between the two runs'
    # collectives tables (each run's own `auto`).
    expected = [(k, picked_algorithm(v["algorithm"]),
                 picked_algorithm(what_if.summary["collectives"][k]["algorithm"]))
                for k, v in base.summary["collectives"].items() if k.split()[0] in GATHERS
                and v["algorithm"] != what_if.summary["collectives"][k]["algorithm"]]
    assert expected and sorted(expected) == sorted(
        (s["collective"], s["baseline"], s["what_if"]) for s in section["switches"])
    # The held step: every gather and reduction pinned to its pick on the unperturbed pod,
    # each pick found by simulating that collective alone on the chip without the override.
    chip = get_chip("v5p").with_overrides(ici_hop_latency_s=3 * get_chip("v5p").ici_hop_latency_s)
    topo = resolve_topology(chip_name="v5p", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x4x4")
    trace = what_if.trace
    groups, dev, pins = collective_groups(trace, topo), {}, {}
    for op in trace.ops:
        if op.kind == OpKind.COLLECTIVE and op.collective in GATHERS:
            gaxes, _key = op_group_axes(topo, trace, op, groups, dev)
            v = padded_collective_bytes(op.collective, gaxes, op.bytes)
            alone = simulate_collective(chip=get_chip("v5p"), topology=topo, op=op.collective,
                                        axes=gaxes, nbytes=v)
            pins[HeldAlgorithms.key(op.collective, gaxes, v)] = picked_algorithm(alone.algorithm)
    held = simulate_step(trace, chip, topo, algorithm=HeldAlgorithms(tuple(pins.items())))
    assert section["held_step_time_s"] == held.step_time_s < what_if.step_time_s
    first = section["switches"][0]
    for word in (first["baseline"], first["what_if"], f"{held.step_time_s:.6g} s",
                 f"{what_if.step_time_s:.6g} s"):
        assert word in section["note"]


def test_no_section_without_a_switch(runs):
    base, _ = runs
    assert "auto_switch" not in base.summary  # no overrides: the unperturbed pod itself
    hbm = sim.train(**KW, model=model_from_dict(TINY), set={"hbm_bytes_per_s": "x2"})
    assert "auto_switch" not in hbm.summary  # the collectives do not read HBM numbers
    held = sim.train(**KW, model=model_from_dict(TINY),
                     set={"ici_hop_latency_s": "x3", "collective.algorithm": "multi-axis"})
    assert "auto_switch" not in held.summary  # an algorithm given is never switched


def test_held_algorithms_pin_the_named_collective_and_leave_the_rest_to_auto():
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="16x16")
    gaxes = group_axes(topo, ("x",))
    held = HeldAlgorithms(((HeldAlgorithms.key("all-gather", gaxes, 1 << 20), "ring"),))
    pinned = simulate_collective(chip=chip, topology=topo, op="all-gather", axes=gaxes,
                                 nbytes=1 << 20, algorithm=held)
    ring = simulate_collective(chip=chip, topology=topo, op="all-gather", axes=gaxes,
                               nbytes=1 << 20, algorithm="ring")
    assert pinned.algorithm == "ring" and pinned.time_s == ring.time_s
    other = simulate_collective(chip=chip, topology=topo, op="all-gather", axes=gaxes,
                                nbytes=2 << 20, algorithm=held)
    assert other.algorithm.startswith("auto (")


@pytest.mark.parametrize("command, kw", [("decode", {"batch": 8, "context_len": 64}),
                                         ("prefill", {"batch": 2, "prompt_len": 64})])
def test_decode_and_prefill_report_an_auto_switch_as_train_does(monkeypatch, command, kw):
    # The wiring: each inference step asks the same report with its own trace, chip, the chip
    # without the overrides and its step time, and prints the section's note.
    import sim.runs.inference as inference

    seen = []

    def report(trace, chip, base_chip, topology, step_time_s, simulate_held):
        seen.append((trace.meta.kind, chip.ici_hop_latency_s, base_chip.ici_hop_latency_s,
                     step_time_s, simulate_held(HeldAlgorithms(())) == step_time_s))
        return {"note": "auto switched (stand-in)", "held_step_time_s": 0.0, "switches": []}

    monkeypatch.setattr(inference, "auto_switch_report", report)
    r = getattr(sim, command)(chip="v5e", shape="2x2", model=model_from_dict(TINY),
                              mesh="tensor=4", set={"ici_hop_latency_s": "x3"}, **kw)
    base_latency = get_chip("v5e").ici_hop_latency_s
    step = r.summary["step_time_s" if command == "decode" else "time_s"]
    assert seen == [(command, 3 * base_latency, base_latency, step, True)]
    assert r.summary["auto_switch"]["note"] == "auto switched (stand-in)"
    # A fixed algorithm has nothing to switch: no report asked.
    seen.clear()
    getattr(sim, command)(chip="v5e", shape="2x2", model=model_from_dict(TINY), mesh="tensor=4",
                          algorithm="multi-axis", **kw)
    assert seen == []


def test_a_pipelined_step_reports_the_switches_of_its_stage_programs():
    # A pipeline's chips run their stages' programs: the switches are those programs'
    # gathers and reductions whose pick alone differs between the two chips, and the held time
    # is the schedule re-run with every one of them pinned to the unperturbed pod's pick.
    from sim.engine.pipeline import build_stage_programs, simulate_pipeline_chips
    from workloads.training import TrainingConfig

    model = model_from_dict({**TINY, "num_layers": 4})
    kw = dict(KW, mesh="pipeline=2,fsdp=32", microbatches=2)
    what_if = sim.train(**kw, model=model, set={"ici_hop_latency_s": "x3"})
    section = what_if.summary["auto_switch"]
    base_chip = get_chip("v5p")
    chip = base_chip.with_overrides(ici_hop_latency_s=3 * base_chip.ici_hop_latency_s)
    topo = resolve_topology(chip_name="v5p", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x4x4")
    mesh = what_if.trace.mesh
    cfg = TrainingConfig(seq_len=256, batch_per_chip=1, microbatches=2)
    pins, switched = {}, set()
    for prog in build_stage_programs(model, mesh, topo.num_chips, cfg).programs:
        groups, dev = collective_groups(prog, topo), {}
        for op in prog.ops:
            if op.kind == OpKind.COLLECTIVE and op.collective in GATHERS:
                gaxes, _key = op_group_axes(topo, prog, op, groups, dev)
                v = padded_collective_bytes(op.collective, gaxes, op.bytes)
                picks = [picked_algorithm(simulate_collective(
                    chip=c, topology=topo, op=op.collective, axes=gaxes, nbytes=v).algorithm)
                    for c in (base_chip, chip)]
                pins[HeldAlgorithms.key(op.collective, gaxes, v)] = picks[0]
                if picks[0] != picks[1]:
                    switched.add((op.collective, *picks))
    assert switched and switched == {(s["collective"].split()[0], s["baseline"], s["what_if"])
                                     for s in section["switches"]}
    held, _pipe = simulate_pipeline_chips(model, mesh, chip, topo, cfg,
                                          algorithm=HeldAlgorithms(tuple(pins.items())))
    assert section["held_step_time_s"] == held.step_time_s < what_if.step_time_s


def test_a_held_all_to_all_runs_the_algorithm_held_for_it():
    # `auto` picks `direct` for every all-to-all we tried, so a what-if rarely switches one;
    # holding one still pins it, as it pins a gather (and leaves a string algorithm alone).
    moe = model_from_dict({**TINY, "num_experts": 4, "experts_per_token": 2})
    run = sim.train(**dict(KW, mesh="fsdp=16,expert=4"), model=moe)
    trace, chip = run.trace, get_chip("v5p")
    topo = resolve_topology(chip_name="v5p", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x4x4")
    groups, dev, pins = collective_groups(trace, topo), {}, {}
    for op in trace.ops:
        if op.kind == OpKind.COLLECTIVE and op.collective == "all-to-all":
            gaxes, _key = op_group_axes(topo, trace, op, groups, dev)
            if sum(g.size > 1 for g in gaxes) != 1:
                continue  # a ring runs on one axis
            v = padded_collective_bytes(op.collective, gaxes, op.bytes)
            pins[HeldAlgorithms.key(op.collective, gaxes, v)] = "ring"
    assert pins
    held = simulate_step(trace, chip, topo, algorithm=HeldAlgorithms(tuple(pins.items())))

    def a2a(result):  # the one-axis all-to-alls' algorithms
        return {v["algorithm"] for k, v in result.collective_costs.items()
                if k.startswith("all-to-all") and "/" not in k.split()[1]}
    assert a2a(held) == {"ring"} and a2a(run.result) == {"auto (direct)"}
    fixed = sim.train(**dict(KW, mesh="fsdp=16,expert=4"), model=moe, algorithm="multi-axis")
    assert a2a(fixed.result) == {"auto (direct)"}  # a string algorithm: gathers only


def test_a_collective_on_faulty_links_names_the_healthy_pods_pick_a_step_would_keep(capsys):
    # `collective` lets auto pick for the faulty links; a step keeps the healthy pod's pick.
    # Where the two differ the result says which the step would run and what it costs here.
    from sim.cli import main

    kw = dict(chip="v5e", shape="8x8", op="all-reduce", axes="x", bytes="4KiB")
    faulty = sim.collective(**kw, dead_link=["0,0:x+"])
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="8x8")
    healthy = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes=("x",),
                                  nbytes=4096)
    pick = picked_algorithm(healthy.algorithm)
    section = faulty.summary["healthy_pick"]
    assert section["algorithm"] == pick != picked_algorithm(faulty.summary["algorithm"])
    held = sim.collective(**kw, dead_link=["0,0:x+"], algorithm=pick)
    assert section["time_s"] == held.summary["time_s"] > faulty.summary["time_s"]
    assert f"{held.summary['time_s']:.6g} s" in section["note"]
    # No faults, or an algorithm given: nothing to say.
    assert "healthy_pick" not in sim.collective(**kw).summary
    assert "healthy_pick" not in held.summary
    main(["collective", *[f"--{k}={v}" for k, v in kw.items()], "--dead-link", "0,0:x+"])
    assert f"note: on the healthy pod auto picks {pick}" in capsys.readouterr().out
