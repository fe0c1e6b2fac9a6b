"""Tests for workloads/trace.py: `Trace` validation on construction, the JSON trace file format
(exact round trip, byte-stable re-serialization), one-line errors for malformed files, and
`tpusim replay` on a broken file.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.trace import OP_COLUMNS, TRACE_FORMAT, TRACE_VERSION, Op, OpKind, Trace, Unit
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 128, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 32, "d_ff": 256, "mlp": "swiglu", "vocab_size": 256,
}


def _compiled(mesh: str = "fsdp=2,tensor=2", chips: int = 4, **cfg) -> Trace:
    config = {"seq_len": 64, "batch_per_chip": 2, **cfg}
    return compile_training_step(
        model_from_dict(TINY), parse_mesh(mesh), chips, TrainingConfig(**config)
    )


def _small(**changes) -> Trace:
    """Three hand-written ops: a matmul, a gather that needs it, a VPU op that needs both."""
    ops = [
        Op(id=0, name="mm", unit=Unit.MXU, flops=2e9, hbm_bytes=1e6, layer=0, phase="fwd"),
        Op(id=1, name="ag", kind=OpKind.COLLECTIVE, collective="all-gather",
           mesh_axes=("fsdp",), bytes=4096.0, deps=(0,), alloc_bytes=4096.0),
        Op(id=2, name="add", unit=Unit.VPU, flops=10.0, hbm_bytes=24.0, deps=(0, 1),
           free_bytes=4096.0),
    ]
    for i, kw in changes.items():
        ops[int(i[1:])] = dataclasses.replace(ops[int(i[1:])], **kw)
    return Trace(mesh=parse_mesh("fsdp=4"), ops=tuple(ops), meta={"num_chips": 4})


# -- validation --------------------------------------------------------------------------------


def test_a_valid_hand_written_trace_is_accepted():
    t = _small()
    assert [op.id for op in t.ops] == [0, 1, 2]


@pytest.mark.parametrize("bad_id", [1, 5, -1])
def test_op_ids_must_be_0_1_2_in_order(bad_id):
    with pytest.raises(TpusimError, match=r"ids must be 0, 1, 2, \.\.\. in order"):
        _small(o0={"id": bad_id})


def test_duplicate_ids_are_refused():
    with pytest.raises(TpusimError, match=r"op #2 has id 1"):
        _small(o2={"id": 1})


@pytest.mark.parametrize("deps", [(1,), (2,), (5,), (-1,)])
def test_dependencies_must_point_backwards(deps):
    # op 1 may only depend on op 0.
    with pytest.raises(TpusimError, match=r"dependencies must point backwards"):
        _small(o1={"deps": deps})


def test_collective_over_an_axis_not_in_the_mesh_is_refused():
    with pytest.raises(TpusimError) as err:
        _small(o1={"mesh_axes": ("tensor",)})
    assert "tensor" in str(err.value) and "fsdp" in str(err.value)


def test_collective_without_axes_is_refused():
    with pytest.raises(TpusimError, match=r"is a collective over \(\)"):
        _small(o1={"mesh_axes": ()})


def test_collective_over_a_dcn_axis_is_accepted():
    ops = (Op(id=0, name="ar", kind=OpKind.COLLECTIVE, collective="all-reduce",
              mesh_axes=("data",), bytes=1024.0),)
    t = Trace(mesh=parse_mesh("fsdp=4", "data=2"), ops=ops)
    assert t.ops[0].mesh_axes == ("data",)


@pytest.mark.parametrize("field", ["flops", "hbm_bytes", "bytes", "duration_s"])
def test_negative_sizes_are_refused(field):
    with pytest.raises(TpusimError, match=r"negative size"):
        _small(o0={field: -1.0})


@pytest.mark.parametrize("field", ["alloc_bytes", "free_bytes"])
def test_negative_memory_sizes_are_refused(field):
    with pytest.raises(TpusimError, match=r"negative"):
        _small(o0={field: -1.0})


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_sizes_are_refused(value):
    with pytest.raises(TpusimError):
        _small(o0={"flops": value})


# -- JSON round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"remat": Remat.OFFLOAD, "attention": "dot"},  # host ops
        {"mesh": "pipeline=2,fsdp=2", "microbatches": 2},
    ],
    ids=["fsdp-tensor", "offload-dot", "pipeline"],
)
def test_json_round_trip_is_exact_field_by_field(kw):
    t = _compiled(**kw)
    back = Trace.from_json(t.to_json())
    assert back.mesh == t.mesh
    assert back.meta == t.meta
    assert len(back.ops) == len(t.ops)
    for a, b in zip(t.ops, back.ops, strict=True):
        for f in OP_COLUMNS:
            va, vb = getattr(a, f), getattr(b, f)
            assert va == vb, (a.id, f, va, vb)
            if isinstance(va, float):
                assert type(vb) is float and va.hex() == vb.hex(), (a.id, f)
        assert isinstance(b.kind, OpKind) and isinstance(b.unit, Unit)
        assert isinstance(b.mesh_axes, tuple) and isinstance(b.deps, tuple)
    assert back == t


def test_json_round_trip_of_a_multislice_mesh():
    t = compile_training_step(
        model_from_dict(TINY), parse_mesh("fsdp=2", "data=2"), 4,
        TrainingConfig(seq_len=32, batch_per_chip=1),
    )
    back = Trace.from_json(t.to_json())
    assert back.mesh.dcn_axes == (("data", 2),)
    assert back == t


def test_reserialization_is_byte_identical():
    text = _compiled(remat=Remat.OFFLOAD).to_json()
    again = Trace.from_json(text).to_json()
    assert again == text
    assert Trace.from_json(again).to_json().encode() == text.encode()


def test_file_layout_matches_the_documented_format():
    t = _small()
    doc = json.loads(t.to_json())
    assert list(doc) == ["format", "version", "mesh", "meta", "columns", "ops"]
    assert doc["format"] == TRACE_FORMAT == "tpusim-trace"
    assert doc["version"] == TRACE_VERSION == 3
    assert doc["mesh"] == {"ici": {"fsdp": 4}, "dcn": {}}
    assert doc["columns"] == [
        "id", "name", "kind", "unit", "flops", "hbm_bytes", "dtype", "collective", "mesh_axes",
        "bytes", "duration_s", "deps", "layer", "phase", "alloc_bytes", "free_bytes", "group",
        "narrow_dim",
    ]
    row = dict(zip(doc["columns"], doc["ops"][1], strict=True))
    assert row["kind"] == "collective" and row["collective"] == "all-gather"
    assert row["mesh_axes"] == ["fsdp"] and row["deps"] == [0] and row["bytes"] == 4096.0


def test_columns_may_come_in_any_order():
    t = _small()
    doc = json.loads(t.to_json())
    perm = list(reversed(range(len(doc["columns"]))))
    doc["columns"] = [doc["columns"][i] for i in perm]
    doc["ops"] = [[row[i] for i in perm] for row in doc["ops"]]
    assert Trace.from_json(json.dumps(doc)) == t


# -- malformed input ---------------------------------------------------------------------------


def _doc() -> dict:
    return json.loads(_small().to_json())


def _mutated(fn) -> str:
    d = _doc()
    fn(d)
    return json.dumps(d)


def _col(name: str) -> int:
    return OP_COLUMNS.index(name)


def _first_collective(d: dict) -> int:
    return next(i for i, row in enumerate(d["ops"]) if row[_col("kind")] == "collective")


MALFORMED = {
    "not-json": ("this is not json", r"is not a tpusim trace: invalid JSON at line 1"),
    "empty": ("", r"invalid JSON at line 1 column 1"),
    "truncated": (None, r"invalid JSON .*truncated or corrupted"),
    "json-list": ("[1, 2, 3]", r'missing "format": "tpusim-trace"'),
    "wrong-format": (
        _mutated(lambda d: d.update(format="chrome-trace")), r'missing "format": "tpusim-trace"'
    ),
    "no-format": (_mutated(lambda d: d.pop("format")), r'missing "format"'),
    "wrong-version": (
        _mutated(lambda d: d.update(version=4)), r"version 4; this tpusim reads versions 1, 2, 3"
    ),
    "version-as-string": (
        _mutated(lambda d: d.update(version="1")),
        r"version '1'; this tpusim reads versions 1, 2, 3"
    ),
    "row-missing-field": (
        _mutated(lambda d: d["ops"][1].pop()), r"op row 1 has 17 fields, expected 18"
    ),
    "row-extra-field": (
        _mutated(lambda d: d["ops"][0].append(0)), r"op row 0 has 19 fields, expected 18"
    ),
    "no-ops": (_mutated(lambda d: d.pop("ops")), r'"ops" must be a non-empty list of op rows'),
    "empty-program": (_mutated(lambda d: d.update(ops=[])), r'"ops" must be a non-empty list'),
    "no-mesh": (_mutated(lambda d: d.pop("mesh")), r'"mesh" must be \{"ici"'),
    "no-columns": (_mutated(lambda d: d.pop("columns")),
                   r'"columns" must name op columns from id, '),
    "unknown-kind": (
        _mutated(lambda d: d["ops"][0].__setitem__(_col("kind"), "magic")), r"'magic'"
    ),
    "unknown-column": (
        _mutated(lambda d: (d["columns"].append("colour"),
                            [r.append("red") for r in d["ops"]])),
        r"unknown op columns \['colour'\]",
    ),
    "bad-mesh-size": (
        _mutated(lambda d: d["mesh"]["ici"].__setitem__("fsdp", "four")), r'"mesh" must be'
    ),
    "nan-flops": (_mutated(lambda d: d["ops"][2].__setitem__(_col("flops"), float("nan"))),
                  r"holds NaN \(numbers must be finite\)"),
    "huge-int": ('{"format": "tpusim-trace", "version": 1, "x": ' + "9" * 400 + "}",
                 r"an integer of 400 digits"),
    "deep-nesting": ('{"format": "tpusim-trace", "version": 1, "x": ' + "[" * 10**5
                     + "]" * 10**5 + "}", r"nesting deeper than 32 levels"),
    "dict-name": (_mutated(lambda d: d["ops"][2].__setitem__(_col("name"), {"a": 1})),
                  r"op row 2 has name = \{'a': 1\}; it must be text"),
    "unhashable-axes": (_mutated(lambda d: d["ops"][0].__setitem__(_col("mesh_axes"), [["x"]])),
                        r"op row 0 has mesh_axes = \[\['x'\]\]; it must be a list of axis"),
    "huge-duration": (_mutated(lambda d: d["ops"][2].__setitem__(_col("duration_s"), 1e300)),
                      r"duration_s = 1e\+300; it must be a finite number in \[0, 86400\]"),
    "negative-narrow-dim": (
        _mutated(lambda d: d["ops"][0].__setitem__(_col("narrow_dim"), -128)),
        r"op row 0 has narrow_dim = -128; it must be a whole number in \[0, 1,000,000\]"),
    # hard10: an axis named twice was an internal error (overlapping axis factors); a send
    # without a peer reached `tpusim collective`'s "--op send needs --src and --dst"; a memory
    # event or static size of 1e308 summed to infinity (an internal error writing --json).
    "axis-twice": (_mutated(lambda d: d["ops"][_first_collective(d)].__setitem__(
        _col("mesh_axes"), ["fsdp", "fsdp"])),
        r"has mesh_axes = \['fsdp', 'fsdp'\]; it must be a list of axis names, each once"),
    "send-without-peer": (_mutated(lambda d: d["ops"][_first_collective(d)].__setitem__(
        _col("collective"), "send")), r"is a send without a device group of \[src, dst\] "
                                      r"pairs, so it has no peer"),
    "memory-event-1e308": (
        _mutated(lambda d: d["meta"].__setitem__("memory_events", [[0, "other", 1e308]] * 2)),
        r"'memory_events' must be a list of \[op id, category, bytes\] with bytes in "
        r"\[-1e24, 1e24\]"),
    "static-1e308": (_mutated(lambda d: d["meta"].__setitem__("static_hbm_bytes", 1e308)),
                     r"'static_hbm_bytes' = 1e\+308 is not a valid number \(give a finite "
                     r"number in \[0, 1e24\]\)"),
    "bad-dep": (_mutated(lambda d: d["ops"][1].__setitem__(_col("deps"), [3])),
                r"depends on 3"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_a_one_line_tpusim_error(case):
    text, match = MALFORMED[case]
    if text is None:
        full = _compiled().to_json()
        text = full[: len(full) // 2]
    with pytest.raises(TpusimError, match=match) as err:
        Trace.from_json(text, source="trace file 'x.trace'")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("trace file 'x.trace'") or "trace op" in msg


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["ops"][0].__setitem__(_col("flops"), "lots"),
        lambda d: d["ops"][0].__setitem__(_col("hbm_bytes"), None),
        lambda d: d.update(meta=[1, 2]),
    ],
    ids=["flops-string", "hbm-bytes-null", "meta-list"],
)
def test_wrongly_typed_fields_are_tpusim_errors(mutate):
    with pytest.raises(TpusimError):
        Trace.from_json(_mutated(mutate))


# -- CLI ---------------------------------------------------------------------------------------


def test_cli_replay_of_a_truncated_file_exits_2_with_one_line(tmp_path, capsys):
    good = tmp_path / "step.trace"
    rc = main(["compile", "--chips", "4", "--model", "llama3-8b", "--seq-len", "64",
               "--batch-per-chip", "1", "--mesh", "fsdp=4", "-o", str(good)])
    assert rc == 0 and good.is_file()
    capsys.readouterr()
    text = good.read_text()
    bad = tmp_path / "cut.trace"
    bad.write_text(text[: len(text) - 100])
    rc = main(["replay", str(bad), "--chip", "v5e", "--shape", "2x2"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("tpusim: error: ")
    assert "cut.trace" in err and "invalid JSON" in err


def test_cli_replay_of_a_missing_file_exits_2(tmp_path, capsys):
    rc = main(["replay", str(tmp_path / "nope.trace"), "--chip", "v5e", "--shape", "2x2"])
    _out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "does not exist" in err


@pytest.mark.parametrize("key, value", [
    ("static_hbm_bytes", "x"), ("pipeline_stages", "two"), ("model_flops_per_chip", None),
    ("num_chips", "x"), ("tokens_per_step", -1.0), ("microbatches", 0), ("model", {"a": 1}),
    ("overlap", None), ("overlap", 1), ("fuse_elementwise", "yes"), ("sharding", 2),
])
def test_malformed_meta_numbers_are_one_line_errors(key, value):
    from topologies.errors import TpusimError as _E

    base = json.loads(_training_trace_json())
    base["meta"][key] = value
    with pytest.raises(_E, match=key):
        Trace.from_json(json.dumps(base))


def test_training_trace_without_its_summary_fields_is_refused():
    from topologies.errors import TpusimError as _E

    base = json.loads(_training_trace_json())
    del base["meta"]["model"]
    with pytest.raises(_E, match="lacks model"):
        Trace.from_json(json.dumps(base))


def _training_trace_json() -> str:
    from topologies.mesh import parse_mesh as _pm
    from workloads.training import TrainingConfig as _tc
    from workloads.training import compile_training_step as _cts
    from workloads.zoo import model_from_dict as _md

    spec = _md({"name": "t", "num_layers": 1, "d_model": 128, "num_heads": 2, "num_kv_heads": 2,
                "head_dim": 64, "d_ff": 256, "mlp": "relu", "vocab_size": 256})
    return _cts(spec, _pm("fsdp=4"), 4, _tc(seq_len=64, batch_per_chip=1)).to_json()


def test_a_column_left_out_of_its_own_version_is_an_error_and_a_later_versions_is_not():
    # A version-3 file without `flops` replayed with zeros in it; now it is refused. Version 1
    # and 2 files lack the columns added after them and still load with their defaults.
    t = _small()

    def without(doc: dict, cols: list[str]) -> dict:
        keep = [i for i, c in enumerate(doc["columns"]) if c not in cols]
        doc["columns"] = [doc["columns"][i] for i in keep]
        doc["ops"] = [[row[i] for i in keep] for row in doc["ops"]]
        return doc

    for col in ("flops", "hbm_bytes", "deps", "free_bytes", "narrow_dim"):
        with pytest.raises(TpusimError, match=f"leaves out {col}, which every version-3"):
            Trace.from_json(json.dumps(without(_doc(), [col])))
    old = without(_doc(), ["group", "narrow_dim"])
    old["version"] = 1
    assert Trace.from_json(json.dumps(old)) == t
    old["version"] = 2
    with pytest.raises(TpusimError, match="leaves out group, which every version-2"):
        Trace.from_json(json.dumps(old))


# -- the typed metadata (workloads/trace_meta.py) ------------------------------------------------


def test_a_read_trace_has_typed_meta_fields_and_its_kind_as_a_string_enum():
    from workloads.trace_meta import TraceKind, TraceMeta

    t = Trace.from_json(_training_trace_json())
    assert isinstance(t.meta, TraceMeta)
    assert t.meta.kind is TraceKind.TRAINING and t.meta.kind == "training"
    assert t.meta.num_chips == 4 and t.meta.seq_len == 64
    assert t.meta.static_hbm_bytes == t.meta.static_breakdown["params"] + \
        t.meta.static_breakdown["optimizer"]
    assert t.meta.device_groups is None  # a key the file does not have


def test_meta_unknown_keys_are_kept_in_extra_and_written_back_in_their_place():
    base = json.loads(_training_trace_json())
    keys = list(base["meta"])
    # A user's note among the compiler's keys, with a nested value: reading keeps it, in place.
    meta = dict(base["meta"])
    base["meta"] = {k: v for i, k in enumerate(keys)
                    for k, v in ([(k, meta[k])] if i != 3 else [("my_note", {"run": [1, 2]}),
                                                                (k, meta[k])])}
    text = json.dumps(base, separators=(",", ":"))
    t = Trace.from_json(text)
    assert t.meta.extra == {"my_note": {"run": [1, 2]}}
    assert list(t.meta.to_dict()) == list(base["meta"])
    assert t.to_json() == text


def test_a_compiled_trace_meta_lists_its_keys_in_the_order_the_compiler_gave_them():
    t = _compiled()
    doc = json.loads(t.to_json())
    assert list(doc["meta"])[:4] == ["kind", "model", "seq_len", "batch_per_chip"]
    assert list(doc["meta"]) == list(t.meta.key_order)
    assert Trace.from_json(t.to_json()).meta == t.meta


def test_meta_is_frozen_and_its_writers_name_only_known_fields():
    from workloads.trace_meta import TraceMeta

    m = TraceMeta.of(kind="decode", batch=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.batch = 9
    with pytest.raises(TypeError):
        m["batch"] = 9  # no item assignment either
    with pytest.raises(TypeError):
        m["batch"]  # nor reads by string key: fields are attributes
    with pytest.raises(TypeError, match="no field"):
        TraceMeta.of(kind="decode", batchh=8)
    with pytest.raises(TypeError, match="no field"):
        m.with_(batchh=8)
    m2 = m.with_(num_chunks=3, batch=4)
    assert m2.key_order == ("kind", "batch", "num_chunks") and m2.batch == 4 and m.batch == 8


def test_meta_given_null_is_present_and_written_back_as_null():
    from workloads.trace_meta import TraceMeta

    m = TraceMeta.from_dict({"overlap": None, "num_chips": 4})
    assert m.overlap is None and "overlap" in m.key_order and m.to_dict() == {"overlap": None,
                                                                     "num_chips": 4}


def test_a_trace_of_an_unknown_kind_is_refused_naming_the_kinds():
    base = json.loads(_training_trace_json())
    base["meta"]["kind"] = "trainning"
    with pytest.raises(TpusimError, match="'trainning'.*training, decode, prefill, hlo, chakra"):
        Trace.from_json(json.dumps(base))


def test_meta_key_order_must_list_each_present_key_once():
    from workloads.trace_meta import TraceMeta

    with pytest.raises(ValueError, match="unlisted"):
        TraceMeta(batch=8, num_chips=2, key_order=("batch",))
    with pytest.raises(ValueError, match="once"):
        TraceMeta(batch=8, key_order=("batch", "batch"))
    with pytest.raises(TypeError, match="extra names fields"):
        TraceMeta(extra={"batch": 8})
