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
