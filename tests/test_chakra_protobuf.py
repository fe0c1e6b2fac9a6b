"""tpusim's Chakra files read by an independent reader: Google's protobuf library, given Chakra's
schema (`ChakraProtoMsg`, et_def.proto's messages and field numbers, docs/reference/chakra.md
section 2) built here as descriptors. ASTRA-sim's feeder parses each record with the protobuf
C++ runtime against the same schema; this is that parse, not tpusim's own reader
(workloads/chakra/wire.py), so a field written with the wrong number or wire type shows as an
unknown field or a parse error here, whatever tpusim's reader makes of it. On top of the parse,
the rules ASTRA-sim's workload layer applies to what it reads (the same reference, section 4):
required attributes by node type and their members, collective kinds it simulates, ids unique,
dependencies on ids in the file, no communication node marked as a CPU op."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from workloads.chakra.wire import read_varint

F = descriptor_pb2.FieldDescriptorProto
REPEATED, OPTIONAL = F.LABEL_REPEATED, F.LABEL_OPTIONAL
# AttributeProto's `value` oneof: (number, name, scalar type); number + 1 is its list message.
SCALARS = [(3, "double", F.TYPE_DOUBLE), (5, "float", F.TYPE_FLOAT), (7, "int32", F.TYPE_INT32),
           (9, "int64", F.TYPE_INT64), (11, "uint32", F.TYPE_UINT32),
           (13, "uint64", F.TYPE_UINT64), (15, "sint32", F.TYPE_SINT32),
           (17, "sint64", F.TYPE_SINT64), (19, "fixed32", F.TYPE_FIXED32),
           (21, "fixed64", F.TYPE_FIXED64), (23, "sfixed32", F.TYPE_SFIXED32),
           (25, "sfixed64", F.TYPE_SFIXED64), (27, "bool", F.TYPE_BOOL),
           (29, "string", F.TYPE_STRING), (31, "bytes", F.TYPE_BYTES)]
NODE_TYPES = ["INVALID_NODE", "METADATA_NODE", "MEM_LOAD_NODE", "MEM_STORE_NODE", "COMP_NODE",
              "COMM_SEND_NODE", "COMM_RECV_NODE", "COMM_COLL_NODE"]
# Collective kinds ASTRA-sim simulates (ALL_REDUCE, ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER) or
# replays from their duration (BROADCAST); the others raise "Unsupported collective comm type".
ASTRA_COLLECTIVES = {0, 2, 5, 6, 7}


def _field(msg, name, number, ftype, label=OPTIONAL, type_name=None, oneof=None):
    f = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof
    return f


@pytest.fixture(scope="module")
def chakra_messages():
    fd = descriptor_pb2.FileDescriptorProto(name="tpusim_test_et_def.proto",
                                            package="ChakraProtoMsg", syntax="proto3")
    enum = fd.enum_type.add(name="NodeType")
    for i, n in enumerate(NODE_TYPES):
        enum.value.add(name=n, number=i)
    for _num, scalar, ftype in SCALARS:
        lst = fd.message_type.add(name=f"{scalar.capitalize()}List")
        _field(lst, "values", 1, ftype, REPEATED)
    attr = fd.message_type.add(name="AttributeProto")
    _field(attr, "name", 1, F.TYPE_STRING)
    _field(attr, "doc_string", 2, F.TYPE_STRING)
    attr.oneof_decl.add(name="value")
    for num, scalar, ftype in SCALARS:
        _field(attr, f"{scalar}_val", num, ftype, oneof=0)
        _field(attr, f"{scalar}_list", num + 1, F.TYPE_MESSAGE,
               type_name=f".ChakraProtoMsg.{scalar.capitalize()}List", oneof=0)
    meta = fd.message_type.add(name="GlobalMetadata")
    _field(meta, "version", 1, F.TYPE_STRING)
    _field(meta, "attr", 2, F.TYPE_MESSAGE, REPEATED, ".ChakraProtoMsg.AttributeProto")
    io = fd.message_type.add(name="IOInfo")
    for i, n in enumerate(("values", "shapes", "types"), start=1):
        _field(io, n, i, F.TYPE_STRING)
    node = fd.message_type.add(name="Node")
    _field(node, "id", 1, F.TYPE_UINT64)
    _field(node, "name", 2, F.TYPE_STRING)
    _field(node, "type", 3, F.TYPE_ENUM, type_name=".ChakraProtoMsg.NodeType")
    _field(node, "ctrl_deps", 4, F.TYPE_UINT64, REPEATED)
    _field(node, "data_deps", 5, F.TYPE_UINT64, REPEATED)
    _field(node, "start_time_micros", 6, F.TYPE_UINT64)
    _field(node, "duration_micros", 7, F.TYPE_UINT64)
    _field(node, "inputs", 8, F.TYPE_MESSAGE, type_name=".ChakraProtoMsg.IOInfo")
    _field(node, "outputs", 9, F.TYPE_MESSAGE, type_name=".ChakraProtoMsg.IOInfo")
    _field(node, "attr", 10, F.TYPE_MESSAGE, REPEATED, ".ChakraProtoMsg.AttributeProto")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("ChakraProtoMsg.GlobalMetadata")),
            get(pool.FindMessageTypeByName("ChakraProtoMsg.Node")))


def _records(path: Path) -> list[bytes]:
    """The length-prefixed records of a Chakra file (varint32 length, then the message)."""
    buf = path.read_bytes()
    if buf[:2] == b"\x1f\x8b":
        buf = gzip.decompress(buf)
    out, pos = [], 0
    while pos < len(buf):
        n, pos = read_varint(buf, pos, len(buf))
        out.append(buf[pos:pos + n])
        pos += n
    assert pos == len(buf)
    return out


def _no_unknown_fields(msg) -> None:
    """Every field of `msg` and its sub-messages is one the schema names."""
    assert len(UnknownFieldSet(msg)) == 0, (type(msg).__name__, msg)
    for fd, value in msg.ListFields():
        if fd.type == F.TYPE_MESSAGE:
            for sub in ([value] if isinstance(value, Message) else value):
                _no_unknown_fields(sub)


def _attrs(node) -> dict:
    return {a.name: a for a in node.attr}


def check_file_as_astra_sim_reads_it(path: Path, messages) -> dict[str, int]:
    """Parse every record of `path` with protobuf and apply ASTRA-sim's reading rules; the
    number of nodes by type."""
    Meta, Node = messages
    recs = _records(path)
    meta = Meta.FromString(recs[0])
    _no_unknown_fields(meta)
    assert meta.version, "GlobalMetadata.version must be set (an all-default record is length 0)"
    nodes = []
    for rec in recs[1:]:
        assert rec, "a zero-length record ends the trace for Chakra's Python reader"
        node = Node.FromString(rec)
        _no_unknown_fields(node)
        nodes.append(node)
    ids = [n.id for n in nodes]
    assert len(set(ids)) == len(ids), "node ids are unique within a file"
    known, counts = set(ids), {}
    for n in nodes:
        kind = NODE_TYPES[n.type]
        counts[kind] = counts.get(kind, 0) + 1
        assert set(n.data_deps) <= known and set(n.ctrl_deps) <= known, n.name
        a = _attrs(n)
        if kind.startswith("COMM"):
            assert not (a.get("is_cpu_op") and a["is_cpu_op"].bool_val), \
                "ASTRA-sim: Comm node should not be on CPU"
            assert a["comm_size"].WhichOneof("value") == "int64_val"
            assert a["comm_size"].int64_val >= 0
        if kind == "COMM_COLL_NODE":
            assert a["comm_type"].WhichOneof("value") == "int64_val"
            assert a["comm_type"].int64_val in ASTRA_COLLECTIVES, n.name
            if "involved_dim" in a:
                assert a["involved_dim"].WhichOneof("value") == "bool_list"
        if kind in ("COMM_SEND_NODE", "COMM_RECV_NODE"):
            for key in ("comm_src", "comm_dst", "comm_tag"):
                assert a[key].WhichOneof("value") == "int32_val", (n.name, key)
        if kind == "COMP_NODE" and "num_ops" in a:
            assert a["num_ops"].WhichOneof("value") == "int64_val"
        if "tensor_size" in a:
            assert a["tensor_size"].WhichOneof("value") == "uint64_val"
    return counts


def _export(tmp_path: Path, *argv: str) -> list[Path]:
    out = tmp_path / "et"
    done = subprocess.run([sys.executable, "-m", "sim", "--quiet", *argv, "--chakra", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    files = sorted(out.glob("*.et*"))
    assert files, f"no Chakra files in {out}"
    return files


TINY = ["--model", "llama3-8b", "--seq-len", "1024", "--batch-per-chip", "1"]


@pytest.mark.parametrize("argv", [
    ["train", "--chip", "v5e", "--shape", "2x2", *TINY, "--mesh", "fsdp=2,tensor=2"],
    ["train", "--chip", "v5e", "--shape", "2x2", *TINY, "--mesh", "pipeline=2,fsdp=2",
     "--microbatches", "2", "--chakra-every-chip"],
    ["decode", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "8",
     "--context-len", "1024", "--mesh", "tensor=4"],
], ids=["train", "pipeline", "decode"])
def test_exported_chakra_files_parse_with_protobuf_as_astra_sim_reads_them(tmp_path, argv,
                                                                        chakra_messages):
    files = _export(tmp_path, *argv)
    totals: dict[str, int] = {}
    for f in files:
        for kind, n in check_file_as_astra_sim_reads_it(f, chakra_messages).items():
            totals[kind] = totals.get(kind, 0) + n
    assert totals.get("COMM_COLL_NODE", 0) > 0 and totals.get("COMP_NODE", 0) > 0, totals
    if "pipeline=2" in " ".join(argv):
        assert totals.get("COMM_SEND_NODE", 0) > 0 and totals.get("COMM_RECV_NODE", 0) > 0


def test_the_schema_check_catches_a_field_written_with_the_wrong_wire_type(chakra_messages):
    """The check can fail: a Node whose `id` (field 1, a varint) is written length-delimited
    is no id to protobuf (it keeps the bytes as an unknown field, as the C++ runtime does), and
    a field number the schema lacks is reported the same way."""
    _meta, Node = chakra_messages
    wrong_wire = Node.FromString(bytes([0x0a, 0x01, 0x05]))  # field 1 with wire type 2
    assert wrong_wire.id == 0
    with pytest.raises(AssertionError):
        _no_unknown_fields(wrong_wire)
    unknown = Node.FromString(bytes([0x08, 0x01, 0xb8, 0x06, 0x01]))  # id=1, then field 103
    assert unknown.id == 1
    with pytest.raises(AssertionError):
        _no_unknown_fields(unknown)
    _no_unknown_fields(Node.FromString(bytes([0x08, 0x01, 0x18, 0x07])))  # id=1, COMM_COLL
