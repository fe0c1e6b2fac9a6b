"""The Chakra wire format: the schema (message and field numbers of `et_def.proto`, package
`ChakraProtoMsg`, as docs/reference/chakra.md lists them), and a bounded encoder and decoder.

A Chakra file is records back to back, each an unsigned varint length (uint32: 1 to 5 bytes)
and then that many bytes of one protobuf message: `GlobalMetadata` first, then one `Node` per
record until the end of the file. Whole-file gzip is optional. The decoder is written by hand
against the field numbers below (rather than generated from a .proto) so that every length and
count is checked against the bytes that are left before anything is allocated: a malformed
file is one `ChakraFormatError` naming the record and the rule, in memory bounded by the input.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field
from typing import Any


class NodeType(enum.IntEnum):
    """`ChakraProtoMsg.NodeType`."""

    INVALID_NODE = 0
    METADATA_NODE = 1
    MEM_LOAD_NODE = 2
    MEM_STORE_NODE = 3
    COMP_NODE = 4
    COMM_SEND_NODE = 5
    COMM_RECV_NODE = 6
    COMM_COLL_NODE = 7


class CommType(enum.IntEnum):
    """`ChakraProtoMsg.CollectiveCommType`."""

    ALL_REDUCE = 0
    REDUCE = 1
    ALL_GATHER = 2
    GATHER = 3
    SCATTER = 4
    BROADCAST = 5
    ALL_TO_ALL = 6
    REDUCE_SCATTER = 7
    REDUCE_SCATTER_BLOCK = 8
    BARRIER = 9


# -- the schema: field numbers ---------------------------------------------------------------
# GlobalMetadata: 1 version (string), 2 attr (repeated AttributeProto).
GM_VERSION, GM_ATTR = 1, 2
# Node.
N_ID, N_NAME, N_TYPE, N_CTRL, N_DATA, N_START, N_DUR, N_IN, N_OUT, N_ATTR = range(1, 11)
# IOInfo: 1 values, 2 shapes, 3 types (strings).
# AttributeProto: 1 name, 2 doc_string, 3..32 the oneof `value`: odd = a scalar, the next
# even number = its list message (one field, `repeated values = 1`).
A_NAME, A_DOC = 1, 2


class Member(enum.IntEnum):
    """The scalar members of `AttributeProto.value` (a list member is the number + 1)."""

    DOUBLE = 3
    FLOAT = 5
    INT32 = 7
    INT64 = 9
    UINT32 = 11
    UINT64 = 13
    SINT32 = 15
    SINT64 = 17
    FIXED32 = 19
    FIXED64 = 21
    SFIXED32 = 23
    SFIXED64 = 25
    BOOL = 27
    STRING = 29
    BYTES = 31


# Per scalar member: (wire type, struct format for fixed widths or "" for varints).
_VARINTS = {Member.INT32, Member.INT64, Member.UINT32, Member.UINT64, Member.SINT32,
            Member.SINT64, Member.BOOL}
_FIXED = {Member.DOUBLE: "<d", Member.FLOAT: "<f", Member.FIXED32: "<I", Member.FIXED64: "<Q",
          Member.SFIXED32: "<i", Member.SFIXED64: "<q"}
_ZIGZAG = {Member.SINT32, Member.SINT64}
_SIGNED = {Member.INT32, Member.INT64}
_TEXT = {Member.STRING, Member.BYTES}


@dataclass(frozen=True, slots=True)
class Attr:
    """One `AttributeProto`: the oneof member it sets (a scalar `Member`, or its list when
    `is_list`) and the value (a tuple for a list)."""

    member: Member
    value: Any
    is_list: bool = False


@dataclass(slots=True, kw_only=True)
class IOInfo:
    values: str = ""
    shapes: str = ""
    types: str = ""


@dataclass(slots=True, kw_only=True)
class Node:
    """One `ChakraProtoMsg.Node` (`type` is kept as the integer read: unknown types are
    refused by the reader, which names the node)."""

    id: int
    name: str = ""
    type: int = 0
    ctrl_deps: tuple[int, ...] = ()
    data_deps: tuple[int, ...] = ()
    start_time_micros: int = 0
    duration_micros: int = 0
    inputs: IOInfo | None = None
    outputs: IOInfo | None = None
    attrs: dict[str, Attr] = field(default_factory=dict)

    def attr(self, name: str, default: Any = None) -> Any:
        a = self.attrs.get(name)
        return default if a is None else a.value


@dataclass(slots=True, kw_only=True)
class GlobalMetadata:
    version: str = ""
    attrs: dict[str, Attr] = field(default_factory=dict)


class ChakraFormatError(ValueError):
    """A record that breaks the wire format; the reader adds the file and the record."""


# -- decoding --------------------------------------------------------------------------------
def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at `pos` (at most 10 bytes)."""
    b = buf[pos] if pos < end else -1
    if 0 <= b < 0x80:  # the common one-byte case
        return b, pos + 1
    result = shift = 0
    while True:
        if pos >= end:
            raise ChakraFormatError("a varint runs past the end of its message (truncated)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ChakraFormatError("a varint is longer than 10 bytes")


def _fields(buf: bytes, pos: int, end: int):
    """(field number, wire type, value) of a message's fields; length-delimited values come as
    (start, end) positions into `buf`, checked against what is left."""
    while pos < end:
        tag, pos = read_varint(buf, pos, end)
        num, wt = tag >> 3, tag & 7
        if num == 0:
            raise ChakraFormatError("a field has number 0 (not a protobuf message)")
        if wt == 0:
            v, pos = read_varint(buf, pos, end)
        elif wt == 2:
            n, pos = read_varint(buf, pos, end)
            if n > end - pos:
                raise ChakraFormatError(
                    f"field {num} claims {n:,} bytes but its message has {end - pos:,} left "
                    f"(truncated)")
            v = (pos, pos + n)
            pos += n
        elif wt == 1 or wt == 5:
            w = 8 if wt == 1 else 4
            if w > end - pos:
                raise ChakraFormatError(f"field {num} is cut short (truncated)")
            v = buf[pos:pos + w]
            pos += w
        else:
            raise ChakraFormatError(f"field {num} has wire type {wt}, which Chakra never writes")
        yield num, wt, v


def _text(buf: bytes, span: tuple[int, int]) -> str:
    return bytes(buf[span[0]:span[1]]).decode("utf-8", errors="replace")


def _uints(buf: bytes, wt: int, v: Any) -> list[int]:
    """A repeated uint64 field's values, packed (wire 2) or one unpacked value (wire 0)."""
    if wt == 0:
        return [v]
    if wt != 2:
        raise ChakraFormatError("a dependency list has the wrong wire type")
    out = []
    pos, end = v
    while pos < end:
        x, pos = read_varint(buf, pos, end)
        out.append(x)
    return out


def _scalar(member: Member, wt: int, v: Any, buf: bytes) -> Any:
    if member in _VARINTS:
        if wt != 0:
            raise ChakraFormatError(f"attribute member {member.name.lower()} is not a varint")
        if member == Member.BOOL:
            return bool(v)
        if member in _ZIGZAG:
            return (v >> 1) ^ -(v & 1)
        if member in _SIGNED and v >= 1 << 63:
            return v - (1 << 64)
        if member == Member.INT32:
            return v
        return v
    if member in _FIXED:
        want = 1 if struct.calcsize(_FIXED[member]) == 8 else 5
        if wt != want:
            raise ChakraFormatError(f"attribute member {member.name.lower()} has the wrong width")
        return struct.unpack(_FIXED[member], v)[0]
    if wt != 2:
        raise ChakraFormatError(f"attribute member {member.name.lower()} is not length-delimited")
    raw = bytes(buf[v[0]:v[1]])
    return raw.decode("utf-8", errors="replace") if member == Member.STRING else raw


def _list(member: Member, span: tuple[int, int], buf: bytes) -> tuple:
    out: list = []
    for num, wt, v in _fields(buf, span[0], span[1]):
        if num != 1:
            continue
        if wt == 2 and member not in _TEXT:  # packed numbers
            pos, end = v
            if member in _VARINTS:
                while pos < end:
                    x, pos = read_varint(buf, pos, end)
                    out.append(_scalar(member, 0, x, buf))
            else:
                w = struct.calcsize(_FIXED[member])
                if (end - pos) % w:
                    raise ChakraFormatError(f"a packed {member.name.lower()} list is cut short")
                out.extend(x[0] for x in struct.iter_unpack(_FIXED[member], buf[pos:end]))
        else:
            out.append(_scalar(member, wt, v, buf))
    return tuple(out)


def _attribute(buf: bytes, span: tuple[int, int]) -> tuple[str, Attr | None]:
    name, attr = "", None
    for num, wt, v in _fields(buf, span[0], span[1]):
        if num == A_NAME and wt == 2:
            name = _text(buf, v)
        elif 3 <= num <= 32:
            if num % 2:
                attr = Attr(Member(num), _scalar(Member(num), wt, v, buf))
            else:
                if wt != 2:
                    raise ChakraFormatError(f"attribute list member {num} is not a message")
                attr = Attr(Member(num - 1), _list(Member(num - 1), v, buf), True)
    return name, attr


def _io(buf: bytes, span: tuple[int, int]) -> IOInfo:
    io = IOInfo()
    for num, wt, v in _fields(buf, span[0], span[1]):
        if wt == 2 and num == 1:
            io.values = _text(buf, v)
        elif wt == 2 and num == 2:
            io.shapes = _text(buf, v)
        elif wt == 2 and num == 3:
            io.types = _text(buf, v)
    return io


def decode_metadata(buf: bytes, start: int, end: int) -> GlobalMetadata:
    gm = GlobalMetadata()
    for num, wt, v in _fields(buf, start, end):
        if num == GM_VERSION and wt == 2:
            gm.version = _text(buf, v)
        elif num == GM_ATTR and wt == 2:
            name, attr = _attribute(buf, v)
            if attr is not None:
                gm.attrs[name] = attr
    return gm


def decode_node(buf: bytes, start: int, end: int) -> Node:
    """One Node record's message (fields this schema does not know are skipped, as protobuf
    readers do)."""
    node = Node(id=0)
    ctrl: list[int] = []
    data: list[int] = []
    for num, wt, v in _fields(buf, start, end):
        if num == N_ID and wt == 0:
            node.id = v
        elif num == N_NAME and wt == 2:
            node.name = _text(buf, v)
        elif num == N_TYPE and wt == 0:
            node.type = v
        elif num == N_CTRL:
            ctrl += _uints(buf, wt, v)
        elif num == N_DATA:
            data += _uints(buf, wt, v)
        elif num == N_START and wt == 0:
            node.start_time_micros = v
        elif num == N_DUR and wt == 0:
            node.duration_micros = v
        elif num == N_IN and wt == 2:
            node.inputs = _io(buf, v)
        elif num == N_OUT and wt == 2:
            node.outputs = _io(buf, v)
        elif num == N_ATTR and wt == 2:
            name, attr = _attribute(buf, v)
            if attr is not None:
                node.attrs[name] = attr
    node.ctrl_deps = tuple(ctrl)
    node.data_deps = tuple(data)
    return node


def records(buf: bytes):
    """(start, end) of each length-framed record of a whole (decompressed) file. A length of 0
    ends the trace, as Chakra's Python reader does."""
    pos, end = 0, len(buf)
    while pos < end:
        try:
            n, p = read_varint(buf, pos, min(end, pos + 5))
        except ChakraFormatError:
            raise ChakraFormatError(
                "a bad length prefix (its varint runs past 5 bytes or the end of the file)") \
                from None
        if n >= 1 << 32:
            raise ChakraFormatError("a record length is over 32 bits (a bad length prefix)")
        if n == 0:
            return
        if n > end - p:
            raise ChakraFormatError(
                f"a record claims {n:,} bytes but the file has {end - p:,} left (truncated, "
                f"or a bad length prefix)")
        yield p, p + n
        pos = p + n


# -- encoding --------------------------------------------------------------------------------
def _put_varint(out: bytearray, v: int) -> None:
    if v < 0:
        v += 1 << 64  # int32/int64: a negative number is its 64-bit two's complement
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _put_tag(out: bytearray, num: int, wt: int) -> None:
    _put_varint(out, (num << 3) | wt)


def _put_bytes(out: bytearray, num: int, data: bytes) -> None:
    _put_tag(out, num, 2)
    _put_varint(out, len(data))
    out += data


def _scalar_bytes(member: Member, value: Any) -> tuple[int, bytes]:
    """(wire type, payload) of one scalar value."""
    b = bytearray()
    if member in _VARINTS:
        v = int(value)
        if member in _ZIGZAG:
            v = (v << 1) ^ (v >> 63)
        _put_varint(b, v)
        return 0, bytes(b)
    if member in _FIXED:
        fmt = _FIXED[member]
        return (1 if struct.calcsize(fmt) == 8 else 5), struct.pack(fmt, value)
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return 2, data


def encode_attr(name: str, attr: Attr) -> bytes:
    out = bytearray()
    _put_bytes(out, A_NAME, name.encode("utf-8"))
    if not attr.is_list:
        wt, payload = _scalar_bytes(attr.member, attr.value)
        _put_tag(out, int(attr.member), wt)
        if wt == 2:
            _put_varint(out, len(payload))
        out += payload
        return bytes(out)
    inner = bytearray()
    if attr.member in _TEXT:
        for x in attr.value:
            _put_bytes(inner, 1, _scalar_bytes(attr.member, x)[1])
    elif attr.value:
        _put_bytes(inner, 1, b"".join(_scalar_bytes(attr.member, x)[1] for x in attr.value))
    _put_bytes(out, int(attr.member) + 1, bytes(inner))
    return bytes(out)


def _check_number(what: str, v: Any) -> None:
    if isinstance(v, float) and not math.isfinite(v):
        raise ChakraFormatError(f"{what} is {v!r}; Chakra stores finite numbers")


def encode_metadata(gm: GlobalMetadata) -> bytes:
    out = bytearray()
    # Always set: an all-default message serializes to 0 bytes, which readers take as the end.
    _put_bytes(out, GM_VERSION, (gm.version or "0.0.4").encode("utf-8"))
    for name, a in gm.attrs.items():
        _put_bytes(out, GM_ATTR, encode_attr(name, a))
    return bytes(out)


def encode_node(node: Node) -> bytes:
    out = bytearray()
    _put_tag(out, N_ID, 0)  # written even at 0, so that no Node is ever 0 bytes long
    _put_varint(out, node.id)
    if node.name:
        _put_bytes(out, N_NAME, node.name.encode("utf-8"))
    if node.type:
        _put_tag(out, N_TYPE, 0)
        _put_varint(out, int(node.type))
    for num, deps in ((N_CTRL, node.ctrl_deps), (N_DATA, node.data_deps)):
        if deps:
            b = bytearray()
            for d in deps:
                _put_varint(b, d)
            _put_bytes(out, num, bytes(b))
    for num, v in ((N_START, node.start_time_micros), (N_DUR, node.duration_micros)):
        if v:
            _put_tag(out, num, 0)
            _put_varint(out, int(v))
    for num, io in ((N_IN, node.inputs), (N_OUT, node.outputs)):
        if io is not None:
            b = bytearray()
            for k, s in ((1, io.values), (2, io.shapes), (3, io.types)):
                if s:
                    _put_bytes(b, k, s.encode("utf-8"))
            _put_bytes(out, num, bytes(b))
    for name, a in node.attrs.items():
        _check_number(f"node {node.id} attribute {name}", a.value)
        _put_bytes(out, N_ATTR, encode_attr(name, a))
    return bytes(out)


def frame(message: bytes) -> bytes:
    """One record: the varint length, then the message."""
    out = bytearray()
    _put_varint(out, len(message))
    out += message
    return bytes(out)


def encode_file(metadata: GlobalMetadata, nodes) -> bytes:
    """A whole (uncompressed) Chakra file: the metadata record, then one record per node."""
    parts = [frame(encode_metadata(metadata))]
    parts += [frame(encode_node(n)) for n in nodes]
    return b"".join(parts)


# Attribute helpers with the members ASTRA-sim's reader expects (docs/reference/chakra.md §4).
def int64_attr(v: int) -> Attr:
    return Attr(Member.INT64, int(v))


def bool_attr(v: bool) -> Attr:
    return Attr(Member.BOOL, bool(v))


def uint64_attr(v: int) -> Attr:
    return Attr(Member.UINT64, int(v))


def string_attr(v: str) -> Attr:
    return Attr(Member.STRING, str(v))


def int32_attr(v: int) -> Attr:
    return Attr(Member.INT32, int(v))


def bool_list_attr(vs) -> Attr:
    return Attr(Member.BOOL, tuple(bool(v) for v in vs), True)


# Nodes as ASTRA-sim's reader expects them (the attribute members of docs/reference/chakra.md
# §4): what tpusim's exporter writes, and what the tests and notebooks build traces from.
def comp_node(id: int, name: str, *, duration_micros: int = 0, num_ops: int | None = None,
              tensor_size: int | None = None, data_deps=(), ctrl_deps=(),
              is_cpu_op: bool = False, **attrs: Attr) -> Node:
    a = {"is_cpu_op": bool_attr(is_cpu_op)}
    if num_ops is not None:
        a["num_ops"] = int64_attr(num_ops)
    if tensor_size is not None:
        a["tensor_size"] = uint64_attr(tensor_size)
    a.update(attrs)
    return Node(id=id, name=name, type=NodeType.COMP_NODE, duration_micros=int(duration_micros),
                data_deps=tuple(data_deps), ctrl_deps=tuple(ctrl_deps), attrs=a)


def coll_node(id: int, name: str, comm_type: CommType, comm_size: int, *, data_deps=(),
              ctrl_deps=(), pg_name: str | None = None, duration_micros: int = 0,
              **attrs: Attr) -> Node:
    a = {"is_cpu_op": bool_attr(False), "comm_type": int64_attr(int(comm_type)),
         "comm_size": int64_attr(comm_size)}
    if pg_name is not None:
        a["pg_name"] = string_attr(pg_name)
    a.update(attrs)
    return Node(id=id, name=name, type=NodeType.COMM_COLL_NODE, data_deps=tuple(data_deps),
                ctrl_deps=tuple(ctrl_deps), duration_micros=int(duration_micros), attrs=a)


def p2p_node(id: int, name: str, *, send: bool, src: int, dst: int, tag: int, comm_size: int,
             data_deps=(), ctrl_deps=()) -> Node:
    a = {"is_cpu_op": bool_attr(False), "comm_src": int32_attr(src), "comm_dst": int32_attr(dst),
         "comm_tag": int32_attr(tag), "comm_size": int64_attr(comm_size)}
    return Node(id=id, name=name,
                type=NodeType.COMM_SEND_NODE if send else NodeType.COMM_RECV_NODE,
                data_deps=tuple(data_deps), ctrl_deps=tuple(ctrl_deps), attrs=a)
