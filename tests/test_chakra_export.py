"""Chakra export (`--chakra DIR`): the files are Chakra that the reader accepts, they hold the
step's collectives with ASTRA-sim's comm_size meaning and every chip's replica group, and a round
trip (export, then replay the files) reproduces the direct step time: exactly from the ops the
nodes carry, and within 1% from the Chakra fields alone (as another reader sees them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.engine.executors import simulate_step
from topologies.slices import resolve_topology
from workloads.chakra.convert import chakra_trace
from workloads.chakra.reader import inventory, read_set

POD = ["--chip", "v5e", "--shape", "2x2"]
TRAIN = ["train", *POD, "--model", "llama3-8b", "--seq-len", "256", "--batch-per-chip", "1",
         "--mesh", "fsdp=2,tensor=2", "--set", "model.num_layers=2", "--quiet"]
DECODE = ["decode", *POD, "--model", "llama3-8b", "--set", "model.num_layers=2", "--batch",
          "8", "--context-len", "256", "--mesh", "tensor=4", "--quiet"]


def _run(argv, capsys):
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _plain_step(prefix: str, compute: str) -> float:
    """The step time of the files read as any Chakra reader reads them (no tpusim_op)."""
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2")
    imp = chakra_trace(read_set(prefix), topo, compute, tpusim_ops=False)
    return simulate_step(imp.trace, chip, topo).step_time_s


@pytest.mark.parametrize("argv", [TRAIN, DECODE], ids=["train", "decode"])
def test_export_then_replay_reproduces_the_step(tmp_path, capsys, argv):
    direct = _run([*argv, "--chakra", str(tmp_path / "c")], capsys)["step_time_s"]
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == ["tpusim.0.et"]  # one chip class on a healthy pod
    again = _run(["replay", str(tmp_path / "c"), *POD], capsys)
    assert again["step_time_s"] == pytest.approx(direct, rel=1e-12)
    # Every chip's file, read from the Chakra fields alone: within 1% either way of costing.
    _run([*argv, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"], capsys)
    assert len(list((tmp_path / "e").iterdir())) == 4
    for compute in ("roofline", "recorded"):
        assert _plain_step(str(tmp_path / "e"), compute) == pytest.approx(direct, rel=0.01)


def test_a_prefill_exports_and_replays_to_the_same_time(tmp_path, capsys):
    prefill = ["prefill", *POD, "--model", "llama3-8b", "--set", "model.num_layers=2", "--batch",
               "2", "--prompt-len", "256", "--mesh", "tensor=4", "--quiet"]
    direct = _run([*prefill, "--chakra", str(tmp_path / "p")], capsys)["time_s"]
    again = _run(["replay", str(tmp_path / "p"), *POD], capsys)["step_time_s"]
    assert again == pytest.approx(direct, rel=1e-12)


def test_collective_permutes_export_as_sends_and_receives_listed_as_approximated(tmp_path,
                                                                               capsys):
    # XLA's windowed einsum (HLO fixture, v5e 4x4): its ring of collective-permutes is what
    # Chakra cannot say; each becomes a send to the next rank of its group and a receive from
    # the previous one, the files' metadata says so, and the files replay from the Chakra
    # fields alone within 1% of the direct replay.
    hlo = str(Path(__file__).parent / "fixtures" / "hlo" / "windowed_einsum_v5e16.hlo.txt.gz")
    pod = ["--chip", "v5e", "--shape", "4x4"]
    direct = _run(["replay", hlo, *pod], capsys)["step_time_s"]
    capsys.readouterr()
    assert main(["export", hlo, *pod, "--chakra", str(tmp_path / "e"), "--chakra-every-chip",
                 "--quiet"]) == 0
    cset = read_set(str(tmp_path / "e"))
    inv = inventory(cset)
    sends, recvs = inv["nodes_by_type"]["COMM_SEND_NODE"], inv["nodes_by_type"]["COMM_RECV_NODE"]
    assert sends == recvs > 0
    pairs = {(n.attr("comm_src"), n.attr("comm_dst"), n.attr("comm_tag"))
             for rp in cset.ranks for n in rp.nodes if n.type == 5}
    assert pairs == {(n.attr("comm_src"), n.attr("comm_dst"), n.attr("comm_tag"))
                     for rp in cset.ranks for n in rp.nodes if n.type == 6}
    for rp in cset.ranks:
        notes = rp.metadata.attrs["tpusim_approximations"].value
        assert any(a.startswith("collective-permute: a COMM_SEND_NODE") for a in notes)
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="4x4")
    for compute in ("roofline", "recorded"):
        imp = chakra_trace(cset, topo, compute, tpusim_ops=False)
        assert simulate_step(imp.trace, chip, topo).step_time_s == pytest.approx(direct,
                                                                                 rel=0.01)


def test_the_files_name_each_chips_groups_and_astra_sims_comm_size(tmp_path, capsys):
    _run([*DECODE, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"], capsys)
    cset = read_set(str(tmp_path / "e"))
    inv = inventory(cset)
    assert inv["num_ranks"] == 4
    trace = _run(["replay", str(tmp_path / "e"), *POD], capsys)
    assert trace["num_ranks"] == 4
    for rp in cset.ranks:
        init = [n for n in rp.nodes if n.name == "process_group:init"]
        pgs = {g["pg_name"]: g["ranks"] for g in json.loads(init[0].inputs.values[2:-2])} \
            if init else {}
        for n in rp.nodes:
            op = n.attr("tpusim_op")
            if op is None or json.loads(op)[1] != "collective":
                continue
            fields = json.loads(op)
            kind, v = fields[6], fields[8]
            size = n.attr("comm_size")
            if kind not in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter"):
                continue
            pg = n.attr("pg_name")
            group = 4 if pg == "0" else len(pgs[pg])
            assert pg == "0" or rp.metadata.attrs["tpusim_rank"].value in pgs[pg]
            if kind in ("all-gather", "all-to-all"):
                assert size == round(v / group)
            elif kind in ("all-reduce", "reduce-scatter"):
                assert size == round(v)


def test_a_perturbed_step_exports_its_classes_and_replays_with_the_same_perturbation(
        tmp_path, capsys):
    slow = ["--slow-link", "0,0:x+:0.25"]
    direct = _run([*TRAIN, *slow, "--chakra", str(tmp_path / "c")], capsys)
    files = sorted((tmp_path / "c").iterdir())
    assert len(files) == direct["num_chip_classes"] > 1
    again = _run(["replay", str(tmp_path / "c"), *POD, *slow], capsys)
    assert again["step_time_s"] == pytest.approx(direct["step_time_s"], rel=1e-9)


def test_export_of_a_trace_file_and_bad_requests(tmp_path, capsys):
    trace = tmp_path / "s.trace"
    assert main(["compile", *TRAIN[1:-1], "-o", str(trace)]) == 0
    direct = _run(["replay", str(trace), *POD], capsys)["step_time_s"]
    assert main(["export", str(trace), *POD, "--chakra", str(tmp_path / "x")]) == 0
    assert _run(["replay", str(tmp_path / "x"), *POD], capsys)["step_time_s"] == \
        pytest.approx(direct, rel=1e-12)
    assert main([*TRAIN, "--chakra-every-chip"]) == 2
    assert "add --chakra DIR" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "x"), "--chip", "v5e", "--shape", "2x4"]) == 2
    assert "exported from a 4-chip pod" in capsys.readouterr().err
    assert main(["export", str(trace), *POD]) == 2
    assert "--chakra DIR" in capsys.readouterr().err


PIPE = ["train", *POD, "--model", "llama3-8b", "--seq-len", "256", "--batch-per-chip", "1",
        "--mesh", "pipeline=2,fsdp=2", "--microbatches", "2", "--set", "model.num_layers=2",
        "--quiet"]


@pytest.mark.parametrize("every", [False, True], ids=["by-class", "every-chip"])
def test_a_pipeline_step_exports_each_stage_and_replays_to_the_same_time(tmp_path, capsys,
                                                                         every):
    extra = ["--chakra-every-chip"] if every else []
    direct = _run([*PIPE, "--chakra", str(tmp_path / "c"), *extra], capsys)
    cset = read_set(str(tmp_path / "c"))
    assert cset.num_ranks == (4 if every else 2)
    assert inventory(cset)["num_distinct_programs"] == cset.num_ranks
    # Stage-to-stage transfers are sends and receives paired by tag across the stages' ranks.
    sends, recvs = {}, {}
    for rp in cset.ranks:
        for nd in rp.nodes:
            if nd.type == 5:  # COMM_SEND_NODE
                sends[(nd.attr("comm_src"), nd.attr("comm_dst"), nd.attr("comm_tag"))] = nd
            elif nd.type == 6:  # COMM_RECV_NODE
                recvs[(nd.attr("comm_src"), nd.attr("comm_dst"), nd.attr("comm_tag"))] = nd
    assert sends and sends.keys() == recvs.keys()
    assert all(s != d for s, d, _t in sends)
    again = _run(["replay", str(tmp_path / "c"), *POD], capsys)
    assert again["step_time_s"] == pytest.approx(direct["step_time_s"], rel=1e-12)


def test_a_pipeline_export_read_from_the_chakra_fields_alone_keeps_the_step_time(tmp_path,
                                                                                capsys):
    import numpy as np

    from sim.engine.executors import simulate_chips
    from sim.engine.perchip import PerChipConfig, PointToPoint

    direct = _run([*PIPE, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"],
                  capsys)["step_time_s"]
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2")
    for compute in ("roofline", "recorded"):
        imp = chakra_trace(read_set(str(tmp_path / "e")), topo, compute, tpusim_ops=False)
        assert len(imp.programs) == 2 and sorted(set(imp.program_of_chip)) == [0, 1]
        p2p = imp.p2p
        cfg = PerChipConfig(
            programs=imp.programs, program_of_chip=np.asarray(imp.program_of_chip),
            p2p=PointToPoint(peer_of_chip=tuple(np.asarray(nb) for nb in p2p["peers"]),
                             sends=tuple(p2p["sends"]), recvs=tuple(p2p["recvs"])))
        step = simulate_chips(imp.trace, chip, topo, config=cfg).step_time_s
        assert step == pytest.approx(direct, rel=0.01)


def test_collectives_name_their_dimensions_and_replay_from_them_alone(tmp_path, capsys):
    # fsdp=2 x tensor=2 on a 2x2: each collective runs along x or along y, and its involved_dim
    # says which; with every pg_name made the whole job, the flags alone give the same groups.
    import dataclasses

    from workloads.chakra.wire import encode_file, string_attr

    direct = _run([*TRAIN, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"], capsys)
    cset = read_set(str(tmp_path / "e"))
    seen = set()
    for rp in cset.ranks:
        rank = rp.metadata.attrs["tpusim_rank"].value
        init = [n for n in rp.nodes if n.name == "process_group:init"]
        pgs = {g["pg_name"]: g["ranks"] for g in json.loads(init[0].inputs.values[2:-2])}
        nodes = []
        for n in rp.nodes:
            if n.type == 7:  # COMM_COLL_NODE
                flags = n.attrs["involved_dim"].value
                members = pgs.get(n.attr("pg_name"), [0, 1, 2, 3])
                # chip c of a 2x2 is (x, y) = divmod(c, 2): a line along x shares y, ...
                xs, ys = {c // 2 for c in members}, {c % 2 for c in members}
                assert flags == (len(xs) > 1, len(ys) > 1) and rank in members
                seen.add(flags)
                n = dataclasses.replace(n, attrs={**n.attrs, "pg_name": string_attr("0")})
            nodes.append(n)
        Path(rp.path).write_bytes(encode_file(rp.metadata, nodes))
    assert {(True, False), (False, True)} <= seen
    assert _plain_step(str(tmp_path / "e"), "roofline") == pytest.approx(
        direct["step_time_s"], rel=0.01)


MOE = ["train", *POD, "--model", "mixtral-8x7b", "--seq-len", "256", "--batch-per-chip", "1",
       "--mesh", "fsdp=2,expert=2", "--set", "model.num_layers=2", "--expert-skew", "1.5",
       "--quiet"]


def test_a_skewed_moe_router_writes_each_ranks_expert_loads_and_reads_them_back(tmp_path,
                                                                               capsys):
    import numpy as np

    from sim.engine.executors import simulate_chips
    from sim.engine.perchip import PerChipConfig

    direct = _run([*MOE, "--chakra", str(tmp_path / "c")], capsys)
    assert direct["num_chip_classes"] > 1  # the hot expert's chips are a class of their own
    again = _run(["replay", str(tmp_path / "c"), *POD], capsys)
    assert again["step_time_s"] == pytest.approx(direct["step_time_s"], rel=1e-12)
    _run([*MOE, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"], capsys)
    cset = read_set(str(tmp_path / "e"))
    # Each rank's file holds its own sizes: an expert op's FLOPs differ between the ranks by
    # the factor the file names (the hottest rank's are the compiled program's).
    sizes = {}
    for rank, rp in enumerate(cset.ranks):
        for nd in rp.nodes:
            if nd.attr("tpusim_scale") is not None:
                sizes.setdefault(nd.id, {})[rank] = (nd.attr("num_ops"), nd.attr("comm_size"),
                                                    nd.attr("tpusim_scale"))
    assert sizes
    for op_id, by_rank in sizes.items():
        op = json.loads(next(n for n in cset.ranks[0].nodes if n.id == op_id).attr("tpusim_op"))
        for num_ops, _comm, f in by_rank.values():
            assert 0 < f < 1
            if num_ops is not None:
                assert num_ops == round(op[3] * f)  # OP_FIELDS[3]: flops
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2")
    assert _run(["replay", str(tmp_path / "e"), *POD], capsys)["step_time_s"] == \
        pytest.approx(direct["step_time_s"], rel=1e-12)
    for compute in ("roofline", "recorded"):
        imp = chakra_trace(cset, topo, compute, tpusim_ops=False)
        assert imp.op_scale and not imp.programs
        cfg = PerChipConfig(op_scale={i: np.asarray(c) for i, c in imp.op_scale.items()})
        step = simulate_chips(imp.trace, chip, topo, config=cfg).step_time_s
        assert step == pytest.approx(direct["step_time_s"], rel=0.01)
        # Every chip at the hottest rank's sizes is another step (the loads matter).
        assert simulate_chips(imp.trace, chip, topo).step_time_s != pytest.approx(step,
                                                                                  rel=0.005)


def _programs_config(imp, *, scale=True):
    """The per-chip engine's config of a Chakra import of several programs."""
    import numpy as np

    from sim.engine.perchip import PerChipConfig, PointToPoint

    p2p = imp.p2p
    return PerChipConfig(
        programs=imp.programs, program_of_chip=np.asarray(imp.program_of_chip),
        op_scale={i: np.asarray(c) for i, c in imp.op_scale.items()} if scale else {},
        p2p=PointToPoint(peer_of_chip=tuple(np.asarray(nb) for nb in p2p["peers"]),
                         sends=tuple(p2p["sends"]), recvs=tuple(p2p["recvs"])))


def _mxu_busy(result) -> float:
    """MXU busy seconds summed over every chip (each class's times its chips)."""
    cl = result.classes
    return float(sum(row[1] * n for row, n in zip(cl.rows, cl.counts, strict=True)))


def test_a_skewed_moe_pipeline_read_from_the_chakra_fields_alone_keeps_each_ranks_loads(
        tmp_path, capsys):
    # Stages run different programs and, under the skewed router, each stage's ranks their own
    # expert loads: read as another reader reads the files, each rank runs its own sizes.
    from sim.engine.executors import simulate_chips

    pipe_moe = [*MOE[:MOE.index("--mesh")], "--mesh", "pipeline=2,expert=2", "--microbatches",
                "2", *MOE[MOE.index("--mesh") + 2:]]
    direct = _run([*pipe_moe, "--chakra", str(tmp_path / "e"), "--chakra-every-chip"],
                  capsys)["step_time_s"]
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x2")
    cset = read_set(str(tmp_path / "e"))
    exact = chakra_trace(cset, topo)  # from tpusim_op: the program as simulated
    run = simulate_chips(exact.trace, chip, topo, config=_programs_config(exact))
    assert run.step_time_s == pytest.approx(direct, rel=1e-12)
    for compute in ("roofline", "recorded"):
        imp = chakra_trace(cset, topo, compute, tpusim_ops=False)
        assert len(imp.programs) == 2 and imp.op_scale
        step = simulate_chips(imp.trace, chip, topo, config=_programs_config(imp))
        assert step.step_time_s == pytest.approx(direct, rel=0.01)
        assert step.num_chip_classes == run.num_chip_classes
    # The hot expert's rank sets the step, so the loads show in the chips' work: every chip's
    # MXU time is its own (within 1%), where every chip at the hottest rank's sizes is far off.
    imp = chakra_trace(cset, topo, "roofline", tpusim_ops=False)
    own = simulate_chips(imp.trace, chip, topo, config=_programs_config(imp))
    top = simulate_chips(imp.trace, chip, topo, config=_programs_config(imp, scale=False))
    assert _mxu_busy(own) == pytest.approx(_mxu_busy(run), rel=0.01)
    assert _mxu_busy(top) > 1.2 * _mxu_busy(run)


def test_a_tpusim_scale_that_is_not_a_factor_is_one_line(tmp_path, capsys):
    import dataclasses

    from workloads.chakra.wire import Attr, Member, encode_file

    _run([*MOE, "--chakra", str(tmp_path / "c")], capsys)
    rp = read_set(str(tmp_path / "c")).ranks[0]
    nodes = [dataclasses.replace(n, attrs={**n.attrs, "tpusim_scale": Attr(Member.DOUBLE, -2.0)})
             if n.attr("tpusim_scale") is not None else n for n in rp.nodes]
    assert nodes != rp.nodes
    Path(rp.path).write_bytes(encode_file(rp.metadata, nodes))
    assert main(["replay", str(tmp_path / "c"), *POD]) == 2
    err = capsys.readouterr().err
    assert "tpusim_scale = -2.0 must be a factor in (0, 1e6]; re-export the step with --chakra" \
        in err and err.count("\n") == 1
