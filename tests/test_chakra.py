"""Chakra execution traces: the wire format (the documented bytes, every attribute member), the
reader's rules on malformed files (one line naming the file, the node and the rule), ordering
(forward dependencies, ids not in the file, self and control cycles), the inventory, and replay
on a torus against tpusim's own collective and closed-form compute times. Every file here is
built in the test from the documented format (docs/reference/chakra.md)."""

from __future__ import annotations

import gzip
import json

import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.collectives import simulate_collective
from topologies.errors import TpusimError
from workloads.chakra import reader
from workloads.chakra.reader import inventory, order_nodes, read_set
from workloads.chakra.wire import (
    Attr,
    CommType,
    GlobalMetadata,
    IOInfo,
    Member,
    Node,
    NodeType,
    bool_list_attr,
    coll_node,
    comp_node,
    decode_node,
    encode_file,
    encode_node,
    frame,
    int64_attr,
    p2p_node,
    records,
    string_attr,
)

MIB = 1 << 20


def write_set(tmp_path, name, programs, *, gz=False, version="0.0.4"):
    """PREFIX.<rank>.et(.gz) files, one per list of nodes; returns the PREFIX."""
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    for r, nodes in enumerate(programs):
        data = encode_file(GlobalMetadata(version=version), nodes)
        p = d / f"{name}.{r}.et"
        if gz:
            p = p.with_name(p.name + ".gz")
            data = gzip.compress(data, mtime=0)
        p.write_bytes(data)
    return str(d / name)


def microbenchmark(tmp_path, kind: CommType, ranks: int, size=MIB):
    """ASTRA-sim's microbenchmark shape: one COMM_COLL_NODE per rank, rank r's node has id r."""
    return write_set(tmp_path, kind.name.lower(), [
        [coll_node(r, f"{kind.name.lower()}_{ranks}npus_1MB", kind, size)] for r in range(ranks)])


# -- the wire format -------------------------------------------------------------------------
def test_encoder_writes_the_documented_bytes_of_astra_sims_all_reduce_rank_1():
    # docs/reference/chakra.md §1: all_reduce/4npus_1MB/all_reduce.1.et, 83 bytes.
    want = (bytes.fromhex("07") + b"\x0a\x05" + b"0.0.4" + bytes.fromhex("4a") + b"\x08\x01"
            + b"\x12\x14" + b"all_reduce_4npus_1MB" + b"\x18\x07"
            + b"\x52\x0e\x0a\x09is_cpu_op\xd8\x01\x00"
            + b"\x52\x0d\x0a\x09comm_type\x48\x00"
            + b"\x52\x0f\x0a\x09comm_size\x48\x80\x80\x40")
    got = encode_file(GlobalMetadata(version="0.0.4"),
                      [coll_node(1, "all_reduce_4npus_1MB", CommType.ALL_REDUCE, MIB)])
    assert got == want and len(got) == 83


@pytest.mark.parametrize("member,value", [
    (Member.DOUBLE, 1.5), (Member.FLOAT, 0.25), (Member.INT32, -7), (Member.INT64, -(1 << 40)),
    (Member.UINT32, 4_000_000_000), (Member.UINT64, (1 << 64) - 1), (Member.SINT32, -3),
    (Member.SINT64, -(1 << 50)), (Member.FIXED32, 123), (Member.FIXED64, 1 << 60),
    (Member.SFIXED32, -5), (Member.SFIXED64, -(1 << 60)), (Member.BOOL, True),
    (Member.STRING, "héllo"), (Member.BYTES, b"\x00\xff"),
])
def test_every_attribute_member_and_its_list_round_trip(member, value):
    lst = (value, value) if member != Member.BOOL else (True, False, True)
    n = Node(id=5, name="n", type=NodeType.COMP_NODE, data_deps=(1, 300), ctrl_deps=(2,),
             duration_micros=9, inputs=IOInfo(values="[1]", shapes="[[2]]", types="['t']"),
             attrs={"a": Attr(member, value), "l": Attr(member, lst, True)})
    b = encode_node(n)
    assert decode_node(b, 0, len(b)) == n


def test_unpacked_dependency_lists_and_unknown_fields_are_read():
    # A writer may emit repeated uint64 unpacked, and later schema fields this one lacks.
    b = b"\x08\x03" + b"\x28\x01" + b"\x28\x02" + b"\x18\x04" + b"\xa8\x06\x05"  # field 101
    n = decode_node(b, 0, len(b))
    assert (n.id, n.data_deps, n.type) == (3, (1, 2), 4)


# -- malformed input: one line naming the file, the node and the rule ------------------------
def _bad(tmp_path, data: bytes, name="bad.0.et") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(TpusimError) as e:
        read_set(str(p))
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    return msg


META = frame(b"\x0a\x050.0.4")


def test_a_bad_length_prefix_is_refused(tmp_path):
    assert "over 32 bits" in _bad(tmp_path, META + b"\xff\xff\xff\xff\x7f" + b"\x08\x01")
    assert "bad length prefix" in _bad(tmp_path, META + b"\x80\x80\x80\x80\x80\x01")


def test_a_truncated_message_is_refused(tmp_path):
    node = frame(encode_node(coll_node(0, "ar", CommType.ALL_REDUCE, MIB)))
    assert "truncated" in _bad(tmp_path, META + node[:-3])
    # A field inside the message claiming more than the message holds.
    inner = b"\x08\x00\x12\x50ab"
    assert "truncated" in _bad(tmp_path, META + frame(inner))


def test_an_unknown_node_type_is_refused_naming_the_node(tmp_path):
    msg = _bad(tmp_path, META + frame(encode_node(Node(id=42, name="weird", type=9))))
    assert "node 42" in msg and "'weird'" in msg and "unknown node type 9" in msg


def test_a_comm_node_with_no_comm_size_is_refused(tmp_path):
    n = coll_node(3, "ar", CommType.ALL_REDUCE, MIB)
    del n.attrs["comm_size"]
    msg = _bad(tmp_path, META + frame(encode_node(n)))
    assert "node 3" in msg and "no comm_size" in msg
    s = p2p_node(4, "s", send=True, src=0, dst=1, tag=0, comm_size=8)
    del s.attrs["comm_dst"]
    assert "no comm_dst" in _bad(tmp_path, META + frame(encode_node(s)))


def test_huge_counts_are_refused(tmp_path):
    assert "1 PiB" in _bad(tmp_path, META + frame(encode_node(
        coll_node(1, "ar", CommType.ALL_REDUCE, 1 << 62))))
    assert "num_ops" in _bad(tmp_path, META + frame(encode_node(
        comp_node(1, "mm", num_ops=-1))))
    assert "over a day" in _bad(tmp_path, META + frame(encode_node(
        comp_node(1, "mm", duration_micros=10**15))))
    assert "comm_type" in _bad(tmp_path, META + frame(encode_node(
        coll_node(1, "ar", 12, MIB))))


def test_a_node_count_over_the_limit_is_refused_before_decoding_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_TRACE_OPS", 3)
    nodes = b"".join(frame(encode_node(comp_node(i, "c", duration_micros=1))) for i in range(5))
    assert "more than 3 nodes" in _bad(tmp_path, META + nodes)


def test_a_dependency_cycle_is_refused_naming_a_node_on_it(tmp_path):
    nodes = [comp_node(1, "a", data_deps=(3,)), comp_node(2, "b", data_deps=(1,)),
             comp_node(3, "c", data_deps=(2,)), comp_node(4, "free")]
    msg = _bad(tmp_path, encode_file(GlobalMetadata(), nodes))
    assert "node 1 ('a', record 2)" in msg and "cycle" in msg  # record 1 is the metadata


def test_a_gzip_bomb_stops_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_FILE_BYTES", 1 << 20)
    bomb = gzip.compress(META + b"\x00" * (8 << 20))  # 8 MiB of zeros in ~8 KB
    assert len(bomb) < 64 << 10
    assert "gzip bomb" in _bad(tmp_path, bomb, "bomb.0.et.gz")
    assert "truncated" in _bad(tmp_path, gzip.compress(META + b"x" * 1000)[:-10], "t.0.et.gz")


def test_empty_and_metadata_only_files_are_refused(tmp_path):
    assert "empty" in _bad(tmp_path, b"")
    assert "no nodes" in _bad(tmp_path, META)


def test_duplicate_ids_and_missing_ranks_are_refused(tmp_path):
    assert "appears 2 times" in _bad(tmp_path, encode_file(
        GlobalMetadata(), [comp_node(1, "a"), comp_node(1, "b")]))
    prefix = microbenchmark(tmp_path, CommType.ALL_REDUCE, 3)
    (tmp_path / "all_reduce" / "all_reduce.1.et").unlink()
    with pytest.raises(TpusimError, match="no rank 1"):
        read_set(prefix)


# -- ordering --------------------------------------------------------------------------------
def test_forward_deps_are_ordered_and_deps_on_absent_ids_dropped():
    # PyTorch traces: a data dep on a larger id, a ctrl dep on an id not in the file, a node
    # naming itself as its control parent, and a kernel and its launcher naming each other.
    nodes = [comp_node(10, "a", data_deps=(12,), ctrl_deps=(999,)),
             comp_node(11, "b", ctrl_deps=(11,)),
             comp_node(12, "c"),
             comp_node(13, "op", ctrl_deps=(14,)), comp_node(14, "kernel", ctrl_deps=(13,))]
    o = order_nodes("f", nodes)
    assert [n.id for n in o.nodes] == [11, 12, 10, 13, 14]
    assert (o.missing_dep_ids, o.forward_deps, o.self_deps, o.ctrl_cycle_deps) == (1, 1, 1, 1)


def test_the_inventory_counts_a_pytorch_shaped_trace(tmp_path):
    # The copied PyTorch trace's shapes: host ops, GPU kernels with durations, all-reduces and
    # broadcasts with comm_type, host-side c10d calls without one, gzip, forward deps.
    nodes = [comp_node(1, "aten::mm", duration_micros=50, is_cpu_op=True, ctrl_deps=(7777,)),
             comp_node(2, "sm80_gemm", duration_micros=120, data_deps=(1,)),
             coll_node(3, "nccl:all_reduce", CommType.ALL_REDUCE, 8196000, data_deps=(2,),
                       involved_dim=bool_list_attr([True])),
             coll_node(4, "nccl:broadcast", CommType.BROADCAST, 212480, duration_micros=30,
                       data_deps=(6,)),
             Node(id=5, name="c10d::allreduce_", type=NodeType.COMM_COLL_NODE,
                  duration_micros=8, attrs={"is_cpu_op": Attr(Member.BOOL, True)}),
             comp_node(6, "aten::add", duration_micros=5, is_cpu_op=True,
                       op_schema=string_attr("aten::add(Tensor a) -> Tensor"))]
    prefix = write_set(tmp_path, "chakra", [nodes], gz=True, version="")
    inv = inventory(read_set(prefix + ".0.et.gz"))
    assert inv["num_ranks"] == 1 and inv["num_nodes"] == 6
    assert inv["nodes_by_type"] == {"COMM_COLL_NODE": 3, "COMP_NODE": 3}
    assert inv["collectives_by_kind"] == {"ALL_REDUCE": {"count": 1, "comm_bytes": 8196000},
                                          "BROADCAST": {"count": 1, "comm_bytes": 212480}}
    assert inv["comm_bytes"] == 8196000 + 212480
    assert (inv["deps_to_missing_ids"], inv["forward_data_deps"]) == (1, 1)
    assert inv["duration_micros"] == 50 + 120 + 30 + 8 + 5


# -- replay ----------------------------------------------------------------------------------
def _replay(argv, capsys):
    capsys.readouterr()
    assert main(["replay", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind,ranks,shape,op,v_ranks", [
    (CommType.ALL_REDUCE, 4, "2x2", "all-reduce", 1),
    (CommType.ALL_GATHER, 4, "2x2", "all-gather", 4),
    (CommType.REDUCE_SCATTER, 8, "2x4", "reduce-scatter", 1),
    (CommType.ALL_TO_ALL, 8, "2x4", "all-to-all", 8),
])
def test_a_microbenchmark_replays_in_the_time_of_tpusims_own_collective(
        tmp_path, capsys, kind, ranks, shape, op, v_ranks):
    prefix = microbenchmark(tmp_path, kind, ranks)
    out = _replay([prefix, "--chip", "v5e", "--shape", shape], capsys)
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    want = simulate_collective(chip=chip, topology=topo, op=op, axes="x,y",
                               nbytes=MIB * v_ranks).time_s
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)
    assert out["num_ranks"] == ranks


def test_recorded_compute_replays_the_durations_along_the_dependency_chain(tmp_path, capsys):
    nodes = [comp_node(1, "a", duration_micros=5, num_ops=10**9),
             comp_node(2, "b", duration_micros=7, data_deps=(1,)),
             comp_node(3, "c", duration_micros=11, data_deps=(2,), is_cpu_op=True)]
    prefix = write_set(tmp_path, "t", [nodes])
    out = _replay([prefix, "--chip", "v5e", "--shape", "1x1", "--chakra-compute", "recorded"],
                  capsys)
    assert out["step_time_s"] == pytest.approx(23e-6, rel=1e-12)
    assert out["inputs"]["trace"]["chakra_compute"] == "recorded"


def test_roofline_compute_is_the_slower_of_flops_and_bytes_on_the_chip(tmp_path, capsys):
    chip = get_chip("v5e")
    flops = 2e12
    nodes = [comp_node(1, "mm", num_ops=int(flops), tensor_size=1, duration_micros=1)]
    prefix = write_set(tmp_path, "t", [nodes])
    out = _replay([prefix, "--chip", "v5e", "--shape", "1x1"], capsys)
    from workloads.trace import Op, Unit

    t_flops = flops / chip.unit_rate(Op(id=0, name="mm", unit=Unit.MXU, flops=flops))
    assert out["step_time_s"] == pytest.approx(t_flops + chip.op_overhead_s, rel=1e-6)
    assert t_flops > 1e-3  # the recorded 1 µs is not what was replayed


def test_a_ring_of_sends_replays_as_one_shift_on_the_torus(tmp_path, capsys):
    n = 4
    progs = [[p2p_node(1, "send", send=True, src=r, dst=(r + 1) % n, tag=7, comm_size=MIB),
              p2p_node(2, "recv", send=False, src=(r - 1) % n, dst=r, tag=7, comm_size=MIB),
              comp_node(3, "after", duration_micros=3, data_deps=(2,))] for r in range(n)]
    prefix = write_set(tmp_path, "ring", progs)
    out = _replay([prefix, "--chip", "v5e", "--shape", "4x1", "--chakra-compute", "recorded"],
                  capsys)
    assert out["step_time_s"] > 3e-6 + MIB / get_chip("v5e").ici_link_bytes_per_s * 0.99


def test_process_groups_from_the_metadata_node_split_the_job(tmp_path, capsys):
    pgs = json.dumps([{"pg_name": "1", "ranks": [0, 1]}, {"pg_name": "2", "ranks": [2, 3]}])
    progs = []
    for r in range(4):
        meta = Node(id=0, name="process_group:init", type=NodeType.METADATA_NODE,
                    inputs=IOInfo(values=f"[[{pgs}]]"))
        progs.append([meta, coll_node(1, "ar", CommType.ALL_REDUCE, MIB, data_deps=(0,),
                                      pg_name="1" if r < 2 else "2")])
    prefix = write_set(tmp_path, "pg", progs)
    out = _replay([prefix, "--chip", "v5e", "--shape", "4x1"], capsys)
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x1")
    pair = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x",
                               nbytes=MIB).time_s
    assert out["step_time_s"] == pytest.approx(pair, rel=1e-6)


def test_a_slow_link_slows_a_microbenchmark(tmp_path, capsys):
    prefix = microbenchmark(tmp_path, CommType.ALL_GATHER, 4)
    plain = _replay([prefix, "--chip", "v5e", "--shape", "4x1"], capsys)["step_time_s"]
    slow = _replay([prefix, "--chip", "v5e", "--shape", "4x1", "--slow-link", "0,0:x+:0.25"],
                   capsys)["step_time_s"]
    assert slow > plain * 1.2


def test_ranks_that_do_not_fit_the_pod_or_disagree_on_a_collective_are_refused(tmp_path,
                                                                               capsys):
    prefix = microbenchmark(tmp_path, CommType.ALL_REDUCE, 4)
    assert main(["replay", prefix, "--chip", "v5e", "--shape", "2x4"]) == 2
    assert "4 ranks but the 2x4 pod has 8 chips" in capsys.readouterr().err
    progs = [[coll_node(0, "ar", CommType.ALL_GATHER if r == 2 else CommType.ALL_REDUCE, MIB)]
             for r in range(4)]
    diff = write_set(tmp_path, "diff", progs)
    assert main(["replay", diff, "--chip", "v5e", "--shape", "2x2"]) == 2
    err = capsys.readouterr().err
    assert "diff.0.et': node 0 ('ar') is a collective over ranks 0, 1, 2, 3" in err
    assert "rank 2's node" in err and err.count("\n") == 1


def test_ranks_whose_sizes_differ_run_each_at_its_own_size(tmp_path, capsys):
    # Rank 2's all-reduce buffer is twice the others': one program at its size, the others at
    # half of it; the collective ends when its largest member has drained, so the step is the
    # 2 MiB all-reduce's, and the 1 MiB one on every rank is faster.
    args = ["--chip", "v5e", "--shape", "2x2"]
    progs = [[coll_node(0, "ar", CommType.ALL_REDUCE, MIB * (1 + (r == 2)))] for r in range(4)]
    uneven = _replay([write_set(tmp_path, "uneven", progs), *args], capsys)
    big = _replay([microbenchmark(tmp_path, CommType.ALL_REDUCE, 4, 2 * MIB), *args], capsys)
    small = _replay([microbenchmark(tmp_path / "s", CommType.ALL_REDUCE, 4), *args], capsys)
    assert small["step_time_s"] < uneven["step_time_s"] <= big["step_time_s"] * (1 + 1e-9)
    assert any("sizes differ between ranks" in a for a in uneven["approximations"])


def _two_stages(tmp_path, name, *, recv_tag=7, flops=10**12):
    """Rank 0 computes and sends 1 MiB to rank 1 (tag 7); rank 1 receives it and computes."""
    return write_set(tmp_path, name, [
        [comp_node(1, "f0", num_ops=flops),
         p2p_node(2, "send", send=True, src=0, dst=1, tag=7, comm_size=MIB, data_deps=(1,))],
        [p2p_node(1, "recv", send=False, src=0, dst=1, tag=recv_tag, comm_size=MIB),
         comp_node(2, "f1", num_ops=flops, data_deps=(1,))]])


def test_ranks_running_different_programs_replay_each_on_its_chip(tmp_path, capsys):
    from sim.engine.perchip import p2p_cost
    from topologies.slices import resolve_topology

    prefix = _two_stages(tmp_path, "stages")
    out = _replay([prefix, "--chip", "v5e", "--shape", "2x1"], capsys)
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape="2x1")
    send = p2p_cost(chip, topo, 0, 1, MIB, {}).time_s
    one = _replay([write_set(tmp_path, "one", [[comp_node(1, "f", num_ops=10**12)]]),
                   "--chip", "v5e", "--shape", "2x1"], capsys)["step_time_s"]
    # The chain: rank 0's compute, the transfer, rank 1's compute (closed form from its parts).
    assert out["step_time_s"] == pytest.approx(2 * one + send, rel=1e-9)
    assert any("different programs" in a for a in out["approximations"])
    capsys.readouterr()
    assert main(["import-chakra", prefix, "--json"]) == 0  # the inventory says so too
    inv = json.loads(capsys.readouterr().out)
    assert inv["num_distinct_programs"] == 2
    assert any("different programs" in a for a in inv["approximations"])


def _stages_of_uneven_ranks(tmp_path, name, *, even=False):
    """Two stages on a 2x2, each rank at its own sizes: ranks 0 and 1 compute 4F and F FLOPs
    and send 1 MiB and 2 MiB to ranks 2 and 3, which receive, compute F and 4F and run an
    all-to-all of 1 MiB and 2 MiB per rank over their line along y (involved_dim). `even`: every
    rank at the largest sizes."""
    f = 10**12
    big = (lambda r: True) if even else (lambda r: r in (0, 3))
    mib = (lambda r: 2 * MIB) if even else (lambda r: MIB * (1 + r % 2))
    stage0 = [[comp_node(1, "fwd", num_ops=4 * f if big(r) else f),
               p2p_node(2, "send", send=True, src=r, dst=r + 2, tag=1, comm_size=mib(r),
                        data_deps=(1,))] for r in (0, 1)]
    stage1 = [[p2p_node(1, "recv", send=False, src=r - 2, dst=r, tag=1, comm_size=mib(r - 2)),
               comp_node(2, "fwd", num_ops=4 * f if big(r) else f, data_deps=(1,)),
               coll_node(3, "a2a", CommType.ALL_TO_ALL, mib(r), data_deps=(2,),
                         involved_dim=bool_list_attr([False, True]))] for r in (2, 3)]
    return write_set(tmp_path, name, stage0 + stage1)


def test_stages_whose_ranks_differ_in_sizes_replay_each_rank_at_its_own(tmp_path, capsys):
    from sim.engine.perchip import p2p_cost

    pod = ["--chip", "v5e", "--shape", "2x2"]
    out = _replay([_stages_of_uneven_ranks(tmp_path, "uneven"), *pod], capsys)
    chip, topo = _v5e("2x2")

    def compute(flops):  # one compute node on every chip: the chip model's time for it
        prefix = write_set(tmp_path / f"c{flops}", "c", [[comp_node(1, "c", num_ops=flops)]])
        return _replay([prefix, *pod], capsys)["step_time_s"]

    f1, f4 = compute(10**12), compute(4 * 10**12)
    s1, s2 = (p2p_cost(chip, topo, src, src + 2, b, {}).time_s for src, b in ((0, MIB),
                                                                            (1, 2 * MIB)))
    # Chips 2 and 3 of a 2x2 share x: the all-to-all is over y, at its largest member's V.
    a2a = simulate_collective(chip=chip, topology=topo, op="all-to-all", axes="y",
                              nbytes=2 * 2 * MIB).time_s
    # Rank 3 (F, the 2 MiB send, 4F) arrives at the all-to-all last; rank 2 (4F, 1 MiB, F)
    # waits for it; the all-to-all ends when its larger member has drained.
    want = max(f4 + s1 + f1, f1 + s2 + f4) + a2a
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)
    even = _replay([_stages_of_uneven_ranks(tmp_path, "even", even=True), *pod], capsys)
    assert even["step_time_s"] == pytest.approx(f4 + s2 + f4 + a2a, rel=1e-9)
    assert out["step_time_s"] < even["step_time_s"] - 0.5 * (f4 - f1)
    notes = out["approximations"]
    assert any("different programs" in a for a in notes)
    assert any("sizes differ between ranks" in a and a.endswith("(2)") for a in notes), notes
    capsys.readouterr()
    assert main(["import-chakra", str(tmp_path / "uneven" / "uneven"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["approximations"] == notes


def test_a_collective_two_stages_share_runs_at_its_largest_members_size(tmp_path, capsys):
    # Ranks 0 and 1 run different programs (rank 0 computes F before its all-reduce, rank 1
    # waits 10 us before it and computes F after) and all-reduce 1 MiB and 3 MiB together:
    # each program's collective is at 3 MiB, rank 0 at a third of it, so the step is the
    # compute, the 3 MiB all-reduce, the compute.
    f = 10**12
    progs = [[comp_node(1, "c", num_ops=f), coll_node(2, "ar", CommType.ALL_REDUCE, MIB,
                                                      data_deps=(1,))],
             [comp_node(1, "wait", duration_micros=10),
              coll_node(2, "ar", CommType.ALL_REDUCE, 3 * MIB, data_deps=(1,)),
              comp_node(3, "c", num_ops=f, data_deps=(2,))]]
    pod = ["--chip", "v5e", "--shape", "2x1"]
    prefix = write_set(tmp_path, "shared", progs)
    out = _replay([prefix, *pod], capsys)
    chip, topo = _v5e("2x1")
    ar = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x",
                             nbytes=3 * MIB).time_s
    one = _replay([write_set(tmp_path, "one", [[comp_node(1, "c", num_ops=f)]]), *pod],
                  capsys)["step_time_s"]
    assert out["step_time_s"] == pytest.approx(one + ar + one, rel=1e-9)
    cset = read_set(prefix)
    from workloads.chakra.convert import chakra_trace

    imp = chakra_trace(cset, topo)
    assert [p.ops[1].bytes for p in imp.programs] == [3 * MIB, 3 * MIB]
    assert imp.op_scale == {1: (1 / 3, 1.0)}


def test_compute_whose_flops_and_bytes_differ_by_different_factors_is_each_ranks_own(
        tmp_path, capsys):
    # Rank 0 computes 4F then F, rank 1 F then 4F, both over the same 1 MiB: one factor per
    # chip cannot scale FLOPs and not bytes, so each rank runs its own program at its exact
    # sizes (the hottest rank's FLOPs on both would be 4F + 4F).
    from workloads.chakra.convert import chakra_trace

    f = 10**12

    def prog(a, b):
        return [comp_node(1, "c1", num_ops=a, tensor_size=MIB),
                comp_node(2, "c2", num_ops=b, tensor_size=MIB, data_deps=(1,))]

    pod = ["--chip", "v5e", "--shape", "2x1"]
    prefix = write_set(tmp_path, "ratio", [prog(4 * f, f), prog(f, 4 * f)])
    out = _replay([prefix, *pod], capsys)

    def compute(flops):
        one = write_set(tmp_path / f"c{flops}", "c", [[comp_node(1, "c", num_ops=flops,
                                                                 tensor_size=MIB)]])
        return _replay([one, *pod], capsys)["step_time_s"]

    assert out["step_time_s"] == pytest.approx(compute(4 * f) + compute(f), rel=1e-9)
    imp = chakra_trace(read_set(prefix), _v5e("2x1")[1])
    assert len(imp.programs) == 2 and not imp.op_scale


def test_host_transfers_that_differ_between_ranks_run_at_each_ranks_own_size(tmp_path,
                                                                             capsys):
    # A host transfer's bytes are not scaled per chip: ranks that differ there run programs of
    # their own. Rank 0 stores 4 MiB then computes F, rank 1 stores 1 MiB then computes 4F.
    f = 10**12
    progs = [[Node(id=1, name="store", type=NodeType.MEM_STORE_NODE,
                   attrs={"tensor_size": int64_attr(b)}),
              comp_node(2, "c", num_ops=flops, data_deps=(1,))]
             for b, flops in ((4 * MIB, f), (MIB, 4 * f))]
    pod = ["--chip", "v5e", "--shape", "2x1"]
    out = _replay([write_set(tmp_path, "host", progs), *pod], capsys)
    chip = get_chip("v5e")

    def compute(flops):
        prefix = write_set(tmp_path / f"c{flops}", "c", [[comp_node(1, "c", num_ops=flops)]])
        return _replay([prefix, *pod], capsys)["step_time_s"]

    pcie = chip.pcie_bytes_per_s
    want = max(4 * MIB / pcie + compute(f), MIB / pcie + compute(4 * f))
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)
    assert any("different programs" in a for a in out["approximations"])


def test_a_stages_process_group_runs_over_its_block_of_the_torus(tmp_path, capsys):
    # 4x2: stage 0 is ranks 0-3 (x 0-1), stage 1 ranks 4-7 (x 2-3). Each stage all-reduces over
    # its process group, a 2x2 block, and stage 0 sends to stage 1 between: each all-reduce
    # takes the time of the same groups' all-reduce in a set of one program (the stage's block,
    # not the whole pod its ranks' coordinates span).
    from sim.engine.perchip import p2p_cost

    pgs = json.dumps([{"pg_name": "1", "ranks": [0, 1, 2, 3]},
                      {"pg_name": "2", "ranks": [4, 5, 6, 7]}])

    def meta():
        return Node(id=0, name="process_group:init", type=NodeType.METADATA_NODE,
                    inputs=IOInfo(values=f"[[{pgs}]]"))

    progs = [[meta(), coll_node(1, "ar", CommType.ALL_REDUCE, MIB, pg_name="1", data_deps=(0,)),
              p2p_node(2, "send", send=True, src=r, dst=r + 4, tag=0, comm_size=MIB,
                       data_deps=(1,))] for r in range(4)]
    progs += [[meta(), p2p_node(1, "recv", send=False, src=r - 4, dst=r, tag=0, comm_size=MIB,
                                data_deps=(0,)),
               coll_node(2, "ar", CommType.ALL_REDUCE, MIB, pg_name="2", data_deps=(1,))]
              for r in range(4, 8)]
    pod = ["--chip", "v5e", "--shape", "4x2"]
    out = _replay([write_set(tmp_path, "blocks", progs), *pod], capsys)
    one = [[meta(), coll_node(1, "ar", CommType.ALL_REDUCE, MIB, pg_name="1" if r < 4 else "2",
                              data_deps=(0,))] for r in range(8)]
    ar = _replay([write_set(tmp_path, "one", one), *pod], capsys)["step_time_s"]
    chip, topo = _v5e("4x2")
    whole = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x,y",
                                nbytes=MIB).time_s
    assert ar < whole  # the block's all-reduce is not the pod's
    send = p2p_cost(chip, topo, 0, 4, MIB, {}).time_s
    assert out["step_time_s"] == pytest.approx(ar + send + ar, rel=1e-9)


def test_a_send_without_its_receive_is_refused_naming_both_sides(tmp_path, capsys):
    prefix = _two_stages(tmp_path, "lonely", recv_tag=8)
    assert main(["replay", prefix, "--chip", "v5e", "--shape", "2x1"]) == 2
    err = capsys.readouterr().err
    assert "lonely.0.et': node 2 ('send') sends comm_tag 7 to rank 1, which has no " \
           "COMM_RECV_NODE of that tag from rank 0" in err and err.count("\n") == 1


def test_import_chakra_json_has_the_documented_fields(tmp_path, capsys):
    prefix = microbenchmark(tmp_path, CommType.ALL_TO_ALL, 8)
    capsys.readouterr()
    assert main(["import-chakra", str(tmp_path / "all_to_all"), "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    assert inv["num_ranks"] == 8 and inv["nodes_by_type"] == {"COMM_COLL_NODE": 8}
    assert inv["collectives_by_kind"] == {"ALL_TO_ALL": {"count": 8, "comm_bytes": 8 * MIB}}
    assert inv["comm_bytes"] == 8 * MIB and inv["approximations"] == []
    assert main(["import-chakra", prefix]) == 0
    assert "ALL_TO_ALL" in capsys.readouterr().out


def test_identical_rank_files_are_decoded_once(tmp_path):
    nodes = [comp_node(i, "c", duration_micros=1, data_deps=(i - 1,) if i else ())
             for i in range(50)] + [coll_node(50, "ar", CommType.ALL_REDUCE, MIB,
                                              data_deps=(49,))]
    prefix = write_set(tmp_path, "spmd", [nodes] * 6)
    cset = read_set(prefix)
    assert cset.num_ranks == 6 and all(r.nodes is cset.ranks[0].nodes for r in cset.ranks)
    assert len({r.digest for r in cset.ranks}) == 1
    assert records  # the record iterator is public for the exporter's tests
    assert int64_attr(3).value == 3


def test_a_chakra_replay_result_reruns_to_the_same_step(tmp_path, capsys):
    nodes = [comp_node(1, "a", duration_micros=5, num_ops=10**12),
             coll_node(2, "ar", CommType.ALL_REDUCE, MIB, data_deps=(1,))]
    prefix = write_set(tmp_path, "t", [nodes])
    out = _replay([prefix, "--chip", "v5e", "--shape", "2x2", "--chakra-compute", "recorded"],
                  capsys)
    assert out["inputs"]["flags"]["chakra-compute"] == "recorded"
    res = tmp_path / "r.json"
    res.write_text(json.dumps(out))
    assert main(["rerun", str(res)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step_time_s"] == out["step_time_s"]
    roof = _replay([prefix, "--chip", "v5e", "--shape", "2x2"], capsys)
    assert "chakra-compute" not in roof["inputs"]["flags"]  # the default is not recorded
    assert roof["step_time_s"] != out["step_time_s"]


def test_a_chakra_replay_takes_every_what_if_and_output_of_a_trace_replay(tmp_path, capsys):
    # Four ranks: an HBM-bound compute node (1 GiB) then a 1 MiB all-gather, on a 2x2.
    progs = [[comp_node(1, "gemm", num_ops=10**9, tensor_size=1 << 30),
              coll_node(2, "ag", CommType.ALL_GATHER, MIB, data_deps=(1,))] for _r in range(4)]
    prefix = write_set(tmp_path, "w", progs)
    pod = [prefix, "--chip", "v5e", "--shape", "2x2"]
    plain = _replay(pod, capsys)["step_time_s"]
    for extra in (["--set", "hbm_bytes_per_s=4e11"], ["--slow-chip", "0,0:0.5"],
                  ["--dead-link", "0,0:y+"], ["--chip-variation", "0.05", "--seed", "1"]):
        assert _replay([*pod, *extra], capsys)["step_time_s"] > plain * 1.001, extra
    out = _replay([*pod, "--perfetto", str(tmp_path / "s.pftrace"), "--plots",
                   str(tmp_path / "plots"), "--out", str(tmp_path / "tables"), "--chakra",
                   str(tmp_path / "again")], capsys)
    assert out["step_time_s"] == plain
    assert (tmp_path / "s.pftrace").stat().st_size > 0
    assert any((tmp_path / "plots").glob("*.png")) and (tmp_path / "tables" / "chips.csv").exists()
    # The replay's own export replays to the same step.
    assert _replay([str(tmp_path / "again"), *pod[1:]], capsys)["step_time_s"] == plain


# -- involved_dim: ASTRA-sim's per-dimension flags -------------------------------------------
def _v5e(shape):
    from topologies.slices import resolve_topology

    chip = get_chip("v5e")
    return chip, resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                                  max_pod_shape=chip.max_pod_shape, shape=shape)


@pytest.mark.parametrize("flags,axes", [([True, False], "x"), ([False, True], "y"),
                                        ([True, True, False, False], "x,y"), ([True], "x,y")])
def test_involved_dim_runs_a_whole_job_collective_on_the_dimensions_it_names(
        tmp_path, capsys, flags, axes):
    # 2x4: every rank's all-gather of 1 MiB runs over its line of the named dimensions only;
    # flags past the pod's two are ignored, and dimensions past a short list are involved.
    progs = [[coll_node(r, "ag", CommType.ALL_GATHER, MIB, involved_dim=bool_list_attr(flags))]
             for r in range(8)]
    prefix = write_set(tmp_path, "ag", progs)
    out = _replay([prefix, "--chip", "v5e", "--shape", "2x4"], capsys)
    chip, topo = _v5e("2x4")
    members = 2 if axes == "x" else 4 if axes == "y" else 8
    want = simulate_collective(chip=chip, topology=topo, op="all-gather", axes=axes,
                               nbytes=MIB * members).time_s
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)
    short = any("fewer flags than the pod has dimensions" in a for a in out["approximations"])
    assert short == (len(flags) == 1)
    # One file alone runs on every chip: the same lines.
    one = write_set(tmp_path, "one", progs[:1])
    assert _replay([one + ".0.et", "--chip", "v5e", "--shape", "2x4"], capsys)[
        "step_time_s"] == pytest.approx(want, rel=1e-9)


def test_a_collective_on_no_dimension_costs_nothing_and_a_named_group_ignores_the_flags(
        tmp_path, capsys):
    progs = [[coll_node(r, "ar", CommType.ALL_REDUCE, MIB,
                        involved_dim=bool_list_attr([False, False]))] for r in range(4)]
    out = _replay([write_set(tmp_path, "none", progs), "--chip", "v5e", "--shape", "2x2"],
                  capsys)
    assert out["step_time_s"] == 0.0
    # pg_name names the group (ranks 0..3 in a line of 4): its ranks, whatever the flags say.
    pgs = json.dumps([{"pg_name": "1", "ranks": [0, 1, 2, 3]}])
    named = []
    for _r in range(4):
        meta = Node(id=0, name="process_group:init", type=NodeType.METADATA_NODE,
                    inputs=IOInfo(values=f"[[{pgs}]]"))
        named.append([meta, coll_node(1, "ar", CommType.ALL_REDUCE, MIB, data_deps=(0,),
                                      pg_name="1", involved_dim=bool_list_attr([True, False]))])
    out = _replay([write_set(tmp_path, "named", named), "--chip", "v5e", "--shape", "4x1"],
                  capsys)
    chip, topo = _v5e("4x1")
    want = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x",
                               nbytes=MIB).time_s
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)
    assert any("not read on collectives of a named process group" in a
               for a in out["approximations"])


def test_involved_dim_that_is_not_a_bool_list_is_refused(tmp_path):
    n = coll_node(2, "ar", CommType.ALL_REDUCE, MIB)
    n.attrs["involved_dim"] = int64_attr(1)
    msg = _bad(tmp_path, META + frame(encode_node(n)))
    assert "node 2 ('ar', record 2)" in msg and "involved_dim must be a bool_list" in msg


# -- ASTRA-sim's communicator-group file (--chakra-comm-group) --------------------------------
def _pg_set(tmp_path, name, *, metadata=None):
    """Four ranks, each an all-reduce of 1 MiB in process group "1" (ranks 0, 1) or "2"."""
    progs = []
    for r in range(4):
        nodes = [coll_node(1, "ar", CommType.ALL_REDUCE, MIB, pg_name="1" if r < 2 else "2")]
        if metadata is not None:
            nodes = [Node(id=0, name="process_group:init", type=NodeType.METADATA_NODE,
                          inputs=IOInfo(values=f"[[{json.dumps(metadata)}]]")), *nodes]
        progs.append(nodes)
    return write_set(tmp_path, name, progs)


def test_a_comm_group_file_defines_the_groups_pg_name_names(tmp_path, capsys):
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"1": [0, 1], "2": [2, 3]}))
    prefix = _pg_set(tmp_path, "pg")
    assert main(["replay", prefix, "--chip", "v5e", "--shape", "4x1"]) == 2
    assert "names process group '1', which no METADATA_NODE" in capsys.readouterr().err
    out = _replay([prefix, "--chip", "v5e", "--shape", "4x1", "--chakra-comm-group",
                   str(groups)], capsys)
    chip, topo = _v5e("2x1")
    pair = simulate_collective(chip=chip, topology=topo, op="all-reduce", axes="x",
                               nbytes=MIB).time_s
    assert out["step_time_s"] == pytest.approx(pair, rel=1e-6)
    # Over a METADATA_NODE's groups of the same ids (which make one group of 4): the file's.
    whole = _pg_set(tmp_path, "meta", metadata=[{"pg_name": "1", "ranks": [0, 1, 2, 3]},
                                                {"pg_name": "2", "ranks": [0, 1, 2, 3]}])
    again = _replay([whole, "--chip", "v5e", "--shape", "4x1", "--chakra-comm-group",
                     str(groups)], capsys)
    assert again["step_time_s"] == pytest.approx(pair, rel=1e-6)
    assert any("comm-group file and by a METADATA_NODE" in a for a in again["approximations"])
    # The result records the file (and its digest): it reruns to the same step, and not once
    # the file changed.
    assert again["inputs"]["flags"]["chakra-comm-group"] == str(groups)
    res = tmp_path / "r.json"
    res.write_text(json.dumps(again))
    assert main(["rerun", str(res)]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == again["step_time_s"]
    groups.write_text(json.dumps({"1": [0, 1, 2, 3], "2": [0, 1, 2, 3]}))
    assert main(["rerun", str(res)]) == 2
    assert "has changed since the result was written" in capsys.readouterr().err


def test_process_groups_that_are_not_blocks_of_the_torus_are_listed_as_approximated(
        tmp_path, capsys):
    # On a 4x1, ranks {0, 1} and {2, 3} are blocks of x; {0, 3} and {1, 2} are not (their
    # all-reduces run over the whole of x): the replay says so.
    pod = ["--chip", "v5e", "--shape", "4x1"]
    note = "not blocks of the torus"
    block = _replay([_pg_set(tmp_path, "blocks", metadata=[
        {"pg_name": "1", "ranks": [0, 1]}, {"pg_name": "2", "ranks": [2, 3]}]), *pod], capsys)
    assert not any(note in a for a in block["approximations"])
    odd = _pg_set(tmp_path, "odd", metadata=[{"pg_name": "1", "ranks": [0, 3]},
                                            {"pg_name": "2", "ranks": [1, 2]}])
    progs = read_set(odd)
    assert [rp.nodes[1].attr("pg_name") for rp in progs.ranks] == ["1", "1", "2", "2"]
    # rank r's all-reduce names its own group: ranks 1 and 3 swap theirs
    for r, pg in ((1, "2"), (3, "1")):
        nodes = [progs.ranks[r].nodes[0],
                 coll_node(1, "ar", CommType.ALL_REDUCE, MIB, pg_name=pg)]
        (tmp_path / "odd" / f"odd.{r}.et").write_bytes(encode_file(GlobalMetadata(), nodes))
    out = _replay([odd, *pod], capsys)
    assert any(note in a and a.endswith("(1)") for a in out["approximations"]), out
    assert out["step_time_s"] >= block["step_time_s"]


@pytest.mark.parametrize("text,rule", [
    ("[1, 2]", "must be a non-empty JSON object"),
    ("{\"1\": [0, 1", "is not JSON"),
    ("{\"a\": [0, 1]}", "a group id is a decimal integer"),
    ("{\"1\": [0, 0]}", "lists a rank twice"),
    ("{\"1\": [0, true]}", "must be a non-empty list of ranks"),
    ("{\"1\": []}", "must be a non-empty list of ranks"),
    ("{\"1\": [0, 9]}", "lists rank 9, but chakra trace"),
    ("[" * 5000 + "]" * 5000, "is not JSON"),
])
def test_a_bad_comm_group_file_is_one_line_naming_the_file_the_group_and_the_rule(
        tmp_path, capsys, text, rule):
    bad = tmp_path / "g.json"
    bad.write_text(text)
    prefix = _pg_set(tmp_path, "pg")
    for cmd in (["replay", prefix, "--chip", "v5e", "--shape", "4x1"], ["import-chakra", prefix]):
        assert main([*cmd, "--chakra-comm-group", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and rule in err and "--chakra-comm-group" in err
        assert str(bad) in err


def test_comm_groups_of_a_file_that_is_not_chakra_or_missing_are_refused(tmp_path, capsys):
    import sim

    prefix = _pg_set(tmp_path, "pg")
    with pytest.raises(TpusimError, match="comm-group file .* does not exist.*as chakra_comm"):
        sim.replay_trace(trace=prefix, chip="v5e", shape="4x1",
                         chakra_comm_group=str(tmp_path / "no"))
    trace = tmp_path / "s.trace"
    trace.write_text("{}")
    assert main(["replay", str(trace), "--chip", "v5e", "--shape", "4x1",
                 "--chakra-comm-group", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "--chakra-comm-group is a Chakra trace's communicator groups" in err
