"""A Chakra set tpusim exported and then edited by hand (what the `chakra_export` fuzz surface
draws, tests/fuzz_inputs.py): each edit that breaks the program tpusim replays it from is one
line naming the set or the file and the node, never a traceback; an edit another writer could
make (every process group named the whole job) keeps the step, read from involved_dim."""

from __future__ import annotations

import dataclasses

import pytest

from sim.cli import main
from workloads.chakra.reader import read_set
from workloads.chakra.wire import encode_file, int64_attr

TRAIN = ["train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--seq-len", "128",
         "--batch-per-chip", "1", "--mesh", "fsdp=2,tensor=2", "--set", "model.num_layers=1",
         "--quiet"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("export") / "c"
    assert main([*TRAIN, "--chakra", str(d)]) == 0
    return d


def _edit(src, dst, edit):
    dst.mkdir()
    for rp in read_set(str(src)).ranks:
        nodes = [edit(n) for n in rp.nodes]
        (dst / rp.path.rsplit("/", 1)[1]).write_bytes(encode_file(rp.metadata, nodes))
    return dst


def _refused(capsys, d) -> str:
    capsys.readouterr()
    assert main(["replay", str(d), "--chip", "v5e", "--shape", "2x2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err
    return err


def test_a_tpusim_op_of_another_member_is_refused_naming_the_node(exported, tmp_path, capsys):
    # It was a TypeError from json.loads (an int where the JSON text goes).
    d = _edit(exported, tmp_path / "e", lambda n: dataclasses.replace(
        n, attrs={**n.attrs, "tpusim_op": int64_attr(3)}) if n.id == 4 else n)
    err = _refused(capsys, d)
    assert "node 4: tpusim_op is not JSON" in err and "tpusim.0.et" in err


def test_a_forward_dependency_added_to_a_tpusim_op_names_the_set(exported, tmp_path, capsys):
    d = _edit(exported, tmp_path / "e", lambda n: dataclasses.replace(
        n, data_deps=(*n.data_deps, 10**9)) if n.id == 5 else n)
    err = _refused(capsys, d)
    assert f"chakra trace '{d}" in err and "depends on 1000000000" in err


def test_a_two_slice_export_replays_from_its_involved_dim_alone(tmp_path, capsys):
    # involved_dim's last flag is the DCN dimension: with every pg_name made the whole job,
    # the flags alone give each collective its slice-crossing (or slice-local) group.
    import json

    from sim.chips import get_chip
    from sim.engine.executors import simulate_step
    from topologies.slices import resolve_topology
    from workloads.chakra.convert import chakra_trace
    from workloads.chakra.wire import string_attr

    argv = [*TRAIN, "--slices", "2", "--dcn", "data=2", "--json", "--chakra", str(tmp_path / "e"),
            "--chakra-every-chip"]
    capsys.readouterr()
    assert main(argv) == 0
    direct = json.loads(capsys.readouterr().out)["step_time_s"]
    flags = set()

    def whole_job(n):
        if n.type != 7:  # COMM_COLL_NODE
            return n
        flags.add(n.attrs["involved_dim"].value)
        return dataclasses.replace(n, attrs={**n.attrs, "pg_name": string_attr("0")})

    d = _edit(tmp_path / "e", tmp_path / "w", whole_job)
    assert (False, False, True) in flags and (True, False, False) in flags
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2", num_slices=2)
    imp = chakra_trace(read_set(str(d)), topo, "roofline", tpusim_ops=False)
    assert simulate_step(imp.trace, chip, topo).step_time_s == pytest.approx(direct, rel=0.01)
