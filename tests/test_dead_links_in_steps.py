"""Dead links in a whole step (sim/engine/class_engine.py with collective rerouting): the
equivalence classes agree with the brute-force per-chip engine, a detour never makes the step
faster, and a cut replica group is one CLI error line."""

from __future__ import annotations

import json

import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.engine.executors import simulate_chips
from sim.engine.perchip import PerChipConfig
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.training import TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny1", "num_layers": 1, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}
PODS = {  # name: (chip, shape, wraparound, mesh, dead link (coords, axis, direction))
    "2x2 wrapped": ("v5e", "2x2", "all", "fsdp=2,tensor=2", ((0, 0), 0, +1)),
    "4x4 wrapped": ("v5e", "4x4", "all", "fsdp=4,tensor=4", ((1, 2), 0, +1)),
    "4x4 line": ("v5e", "4x4", "none", "fsdp=4,tensor=4", ((1, 0), 1, +1)),
    "4x4x4": ("v5p", "4x4x4", "auto", "fsdp=16,tensor=4", ((0, 0, 0), 2, +1)),
}


def _setup(chip_name, shape, wrap, mesh):
    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape, wraparound=wrap)
    trace = compile_training_step(model_from_dict(TINY), parse_mesh(mesh, None), topo.num_chips,
                                  TrainingConfig(seq_len=128, batch_per_chip=2))
    return chip, topo, trace


@pytest.mark.parametrize("pod", PODS)
def test_a_dead_link_in_a_step_agrees_with_brute_force_and_never_helps(pod):
    chip_name, shape, wrap, mesh, (coords, axis, d) = PODS[pod]
    chip, topo, trace = _setup(chip_name, shape, wrap, mesh)
    dead = (topo.ici_link_id(topo.chip_id(coords), axis, d),)
    healthy = simulate_chips(trace, chip, topo)
    fast = simulate_chips(trace, chip, topo, config=PerChipConfig(dead_links=dead))
    brute = simulate_chips(trace, chip, topo,
                           config=PerChipConfig(dead_links=dead, mode="per-chip"))
    assert fast.step_time_s == pytest.approx(brute.step_time_s, rel=1e-9)
    assert list(fast.chips.finish_s) == pytest.approx(list(brute.chips.finish_s), rel=1e-9)
    assert fast.slowest_chip == brute.slowest_chip
    assert fast.step_time_s >= healthy.step_time_s * (1 - 1e-12)
    assert fast.link_bytes[dead[0]] == 0


def _train(*extra):
    return ["train", "--chip", "v5e", "--shape", "4x4", "--model", "llama3-8b", "--seq-len",
            "128", "--batch-per-chip", "1", "--mesh", "fsdp=4,tensor=4", *extra]


def test_cli_train_takes_a_dead_link(capsys, tmp_path):
    import yaml

    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY))
    argv = ["train", "--chip", "v5e", "--shape", "4x4", "--wraparound", "all", "--model",
            str(model), "--seq-len", "128", "--batch-per-chip", "2", "--mesh",
            "fsdp=4,tensor=4", "--json"]
    assert main(argv) == 0
    healthy = json.loads(capsys.readouterr().out)
    assert main([*argv, "--dead-link", "1,2:x+"]) == 0
    dead = json.loads(capsys.readouterr().out)
    assert dead["step_time_s"] > healthy["step_time_s"]
    assert dead["num_chip_classes"] > 1


def test_cli_train_with_a_cut_group_is_one_error_line(capsys, tmp_path):
    import yaml

    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY))
    out_dir = tmp_path / "never"
    # (0,0) of a 4x4 mesh without wraparound has only x+ and y+ links: kill both.
    rc = main(["train", "--chip", "v5e", "--shape", "4x4", "--wraparound", "none", "--model",
               str(model), "--seq-len", "128", "--batch-per-chip", "2", "--mesh",
               "fsdp=4,tensor=4", "--dead-link", "0,0:x+", "--dead-link", "0,0:y+",
               "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: dead links ") and err.count("\n") == 1
    assert "disconnect chip (0,0)" in err
    assert not out_dir.exists()
