"""HLO modules that used to hang, eat memory or be accepted although XLA rejects them (issue 30's
fuzzing pass): each is now a one-line `TpusimError` (or, for a loop that does nothing, a quick
import), within a second of CPU."""

from __future__ import annotations

import time

import pytest

from topologies.errors import TpusimError
from workloads.hlo.files import entry_ops_lower_bound
from workloads.hlo.lower import import_hlo

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def _module(body: str, n: int = 4, extra: str = "") -> str:
    return f"HloModule m, num_partitions={n}{extra}\n\n{body}\n"


def _refused(text: str, topology, match: str) -> TpusimError:
    t0 = time.process_time()
    with pytest.raises(TpusimError, match=match) as exc:
        import_hlo(text, topology=topology)
    assert time.process_time() - t0 < 1.0
    assert "\n" not in str(exc.value)
    return exc.value


def _loop(trip: str, body_ops: str = "", root: str = "%t") -> str:
    return _module(f"""%body (t: (s32[], f32[128])) -> (s32[], f32[128]) {{
  %t = (s32[], f32[128]) parameter(0){body_ops}
  ROOT %r = (s32[], f32[128]) tuple(%i, %y)
}}

%cond (t: (s32[], f32[128])) -> pred[] {{
  %t = (s32[], f32[128]) parameter(0)
  ROOT %p = pred[] constant(true)
}}

ENTRY %main (x: f32[128]) -> (s32[], f32[128]) {{
  %x = f32[128] parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[128]) tuple(%z, %x)
  ROOT %w = (s32[], f32[128]) while(%t), condition=%cond, body=%body,
      backend_config={{"known_trip_count":{{"n":"{trip}"}}}}
}}""", n=1)


EMPTY_BODY = """
  %i = s32[] get-tuple-element(%t), index=0
  %y = f32[128] get-tuple-element(%t), index=1"""
ONE_OP_BODY = """
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[128] get-tuple-element(%t), index=1
  %y = f32[128] exponential(%x)"""


def test_a_while_of_a_trillion_trips_over_an_empty_body_imports_at_once(v5e, topo):
    # The body emits nothing and hands each trip the same value: the loop adds nothing.
    t0 = time.process_time()
    imp = import_hlo(_loop("1000000000000", EMPTY_BODY), topology=topo(v5e, "1x1"))
    assert time.process_time() - t0 < 1.0
    assert imp.inventory["while_loops"][0]["trip_count"] == 10 ** 12
    assert imp.inventory["num_trace_ops"] == 0


def test_a_while_of_a_trillion_trips_that_emits_ops_is_refused_at_the_op_cap(v5e, topo):
    # One op per trip: refused when the unrolled program passes the cap (not after 10^12).
    # Decided after the first trip (every trip emits the same ops), not after 250,000.
    _refused(_loop("1000000000000", ONE_OP_BODY), topo(v5e, "1x1"),
             "1,000,000,000,000 trips of 1 ops")
    # A loop that fits imports whole: 1,000 trips of one op.
    assert import_hlo(_loop("1000", ONE_OP_BODY), topology=topo(v5e, "1x1")).inventory[
        "num_trace_ops"] == 1000


def test_an_iota_replica_group_of_a_billion_devices_is_refused_before_it_is_listed(v5e, topo):
    text = _module("ENTRY %main (x: f32[8]) -> f32[8] {\n  %x = f32[8] parameter(0)\n"
                   "  ROOT %r = f32[8] all-reduce(%x), replica_groups=[1,1000000000]<="
                   "[1000000000], to_apply=%add\n}", extra="") .replace("\n\n", "\n\n" + ADD, 1)
    _refused(text, topo(v5e, "2x2"), "lists 1,000,000,000 devices but the module has 4")


def test_a_module_over_the_op_cap_in_its_entry_is_refused_before_the_parse(v5e, topo,
                                                                           monkeypatch):
    # At a cap of 2,000 ops (the rule is the same at 250,000, where the parse alone of the
    # module took ~18 CPU-s), the parser would fail on the first line if it were reached.
    import workloads.hlo.lower as lower

    monkeypatch.setattr(lower, "MAX_OPS", 2000)
    monkeypatch.setattr(lower, "parse_hlo", None)
    n = 2000
    lines = ["ENTRY %main (p: f32[128]) -> f32[128] {", "  %p = f32[128]{0} parameter(0)"]
    lines += [f"  %a{i} = f32[128]{{0}} add(f32[128]{{0}} %p, f32[128]{{0}} %p)"
              for i in range(n)]
    lines += ["  ROOT %r = f32[128]{0} negate(%p)", "}"]
    text = _module("\n".join(lines), n=1)
    assert entry_ops_lower_bound(text) == n + 1
    _refused(text, topo(v5e, "1x1"), f"at least {n + 1:,} trace ops, over the limit of 2,000")
    assert entry_ops_lower_bound(text.replace("f32[128]{0} add", "f32[]{0} add")) == 1


def test_an_array_larger_than_any_chip_is_refused(v5e, topo):
    text = _module(ADD + "\nENTRY %main (x: f32[1000000000000,256]) -> f32[1] {\n"
                   "  %x = f32[1000000000000,256] parameter(0)\n"
                   "  ROOT %g = f32[1000000000000,1024000000] all-gather(%x), dimensions={1}, "
                   "replica_groups={{0,1,2,3}}\n}")
    _refused(text, topo(v5e, "2x2"), r"over the limit of 2\^40 \(1 TiB\) for one array")
    _refused(text.replace("1000000000000", "4096000000000"), topo(v5e, "2x2"),
             "out of range")


ENTRY_WITH = "ENTRY %main (x: f32[8,16]) -> f32[8,8] {{\n  %x = f32[8,16] parameter(0)\n{}\n}}"


@pytest.mark.parametrize("body, match", [
    # Two instructions of one name.
    ("  %y = f32[8,16] negate(%x)\n  %y = f32[8,16] exponential(%x)\n"
     "  ROOT %r = f32[8,8] slice(%y), slice={[0:8], [0:8]}",
     "instruction %y is defined twice in computation 'main'"),
    # A permute with a source twice.
    ("  %y = f32[8,16] collective-permute(%x), source_target_pairs={{0,1},{0,2}}\n"
     "  ROOT %r = f32[8,8] slice(%y), slice={[0:8], [0:8]}",
     "lists device 0 as a source twice"),
    # ... and a target twice.
    ("  %y = f32[8,16] collective-permute(%x), source_target_pairs={{0,1},{2,1}}\n"
     "  ROOT %r = f32[8,8] slice(%y), slice={[0:8], [0:8]}",
     "lists device 1 as a target twice"),
    # A gather dimension past the rank.
    ("  %i = s32[4,1] constant({...})\n"
     "  ROOT %r = f32[8,8] gather(%x, %i), offset_dims={1}, collapsed_slice_dims={5}, "
     "start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}",
     r"collapsed_slice_dims=\{5\}, but its operand has rank 2"),
    # Contracting dims past the rank.
    ("  ROOT %r = f32[8,8] dot(%x, %x), lhs_contracting_dims={3}, rhs_contracting_dims={1}",
     r"lhs_contracting_dims \{3\}, but its lhs f32\[8,16\] has rank 2"),
    # Contracting dims of different sizes.
    ("  ROOT %r = f32[8,8] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "contracting dimensions do not match"),
])
def test_a_module_xla_rejects_is_refused(v5e, topo, body, match):
    _refused(_module(ENTRY_WITH.format(body)), topo(v5e, "2x2"), match)


def test_two_entry_computations_are_refused(v5e, topo):
    one = ENTRY_WITH.format("  ROOT %r = f32[8,8] slice(%x), slice={[0:8], [0:8]}")
    _refused(_module(one + "\n\n" + one.replace("%main", "%other")), topo(v5e, "2x2"),
             "'other' is a second ENTRY")


def test_partition_coordinates_outside_the_pod_are_refused(v5e, topo):
    body = _module(ENTRY_WITH.format("  ROOT %r = f32[8,8] slice(%x), slice={[0:8], [0:8]}"))
    for coords, match in (("0,0 1,0 0,1 2,1", "chip 2,1, which is outside the 2x2"),
                          ("0,0 1,0 0,1 1,-1", "outside the 2x2"),
                          ("0,0 1,0 0,1 1,x", "is not a list of chip coordinates"),
                          ("0,0 1,0 0,1 1,1,0", "outside the 2x2"),
                          ("0,0 1,0 0,1 1,1 0,0", "lists 5 chips")):
        _refused(f"// tpusim: partition_coords={coords}\n" + body, topo(v5e, "2x2"), match)


# -- found by the generated HLO modules (issue 30's fuzz pass) ----------------------------------
_NO_OPS = """HloModule scalars, num_partitions=16

%cond (t: (s32[], f16[])) -> pred[] {
  %t = (s32[], f16[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f16[])) -> (s32[], f16[]) {
  %t = (s32[], f16[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f16[] get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f16[] copy(%x)
  ROOT %o = (s32[], f16[]) tuple(%j, %y)
}

ENTRY %main (p0: f16[]) -> f16[] {
  %p0 = f16[] parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f16[]) tuple(%z, %p0)
  %w = (s32[], f16[]) while(%init), condition=%cond, body=%body
  ROOT %r = f16[] get-tuple-element(%w), index=1
}
"""


def test_a_module_of_scalar_ops_only_is_refused_by_replay_and_import_o_in_one_line(tmp_path,
                                                                                  capsys):
    """Scalar bookkeeping lowers to no trace ops: replay was an internal error (the per-chip
    engine's argmax of an empty step) and `import-hlo -o` wrote a trace replay refuses."""
    from sim.cli import main

    path = tmp_path / "scalars.hlo.txt"
    path.write_text(_NO_OPS, encoding="utf-8")
    pod = ["--chip", "v5e", "--shape", "4x4"]
    assert main(["import-hlo", str(path), *pod]) == 0  # the inventory: 0 trace ops
    assert "-> 0 trace ops" in capsys.readouterr().out
    for argv in (["replay", str(path), *pod, "--json"],
                 ["import-hlo", str(path), *pod, "-o", str(tmp_path / "t.trace")]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "lowers to no ops" in err
    assert not (tmp_path / "t.trace").exists()
