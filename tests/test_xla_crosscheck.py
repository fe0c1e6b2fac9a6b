"""XLA's per-op cost estimates as validation/xla_crosscheck.py reads them from a compiled HLO
module (`estimated_cycles` times the loop trip counts, classed by named scope and einsum), and
the replica-group forms its collective parser reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from validation import xla_crosscheck_doc as xdoc
from validation import xla_crosscheck_sides as sides
from validation import xla_hlo_read as hread


def _cfg(cycles: int) -> str:
    return f'backend_config={{"flag_configs":[],"estimated_cycles":"{cycles}"}}'


ATTN = 'metadata={op_name="jit(step)/jvp(layer0)/attention/bskgd,btkd->bkgst/dot_general"}'
NORM = 'metadata={op_name="jit(step)/transpose(jvp(layer1))/norm/rsqrt"}'
ADAM = 'metadata={op_name="jit(step)/adam/convert_element_type"}'
HEAD = 'metadata={op_name="jit(step)/transpose(jvp(head))/dot_general"}'

WINDOWED_BODY = ("body=%wide.windowed_dot_general_body_rs.1, "
                 'backend_config={"known_trip_count":{"n":"3"}}')

# A windowed reduce-scatter loop (trip count 3 from known_trip_count) holding a matmul fusion,
# an accumulator select without op_name and an accumulator add named after the head's dot, a
# plain loop (trip count 4 read off its condition: i < 8 stepping by 2) holding a norm fusion,
# and a top-level optimizer fusion and copy (no estimate).
MODULE = f"""HloModule jit_step

%fused_mm (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {{
  %p0 = bf16[8,8]{{1,0}} parameter(0)
  %p1 = bf16[8,8]{{1,0}} parameter(1)
  ROOT %convolution.1 = bf16[8,8]{{1,0}} convolution(%p0, %p1), dim_labels=bf_io->bf, {ATTN}
}}

%fused_acc (p0: bf16[8,8]) -> bf16[8,8] {{
  ROOT %p0 = bf16[8,8]{{1,0}} parameter(0)
}}

%fused_norm (p0: bf16[8,8]) -> bf16[8,8] {{
  %p0 = bf16[8,8]{{1,0}} parameter(0)
  ROOT %rsqrt.1 = bf16[8,8]{{1,0}} rsqrt(%p0), {NORM}
}}

%wide.windowed_dot_general_body_rs.1 (param: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {{
  %param = (s32[], bf16[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = bf16[8,8]{{1,0}} get-tuple-element(%param), index=1
  %fusion.2 = bf16[8,8]{{1,0}} fusion(%x, %x), kind=kOutput, calls=%fused_mm, {ATTN}, {_cfg(100)}
  %fusion.3 = bf16[8,8]{{1,0}} fusion(%fusion.2), kind=kLoop, calls=%fused_acc, {_cfg(10)}
  %fusion.6 = bf16[8,8]{{1,0}} fusion(%fusion.3), kind=kLoop, calls=%fused_acc, {HEAD}, {_cfg(4)}
  ROOT %t = (s32[], bf16[8,8]{{1,0}}) tuple(%i, %fusion.6)
}}

%cond.1 (param: (s32[], bf16[8,8])) -> pred[] {{
  %param = (s32[], bf16[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

%body.2 (param: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {{
  %param = (s32[], bf16[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  %x = bf16[8,8]{{1,0}} get-tuple-element(%param), index=1
  %fusion.4 = bf16[8,8]{{1,0}} fusion(%x), kind=kLoop, calls=%fused_norm, {NORM}, {_cfg(7)}
  ROOT %t = (s32[], bf16[8,8]{{1,0}}) tuple(%next, %fusion.4)
}}

%cond.2 (param: (s32[], bf16[8,8])) -> pred[] {{
  %param = (s32[], bf16[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %c = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

ENTRY %main (a: bf16[8,8]) -> bf16[8,8] {{
  %a = bf16[8,8]{{1,0}} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[8,8]{{1,0}}) tuple(%z, %a)
  %while.1 = (s32[], bf16[8,8]{{1,0}}) while(%init), condition=%cond.1, {WINDOWED_BODY}
  %while.2 = (s32[], bf16[8,8]{{1,0}}) while(%while.1), condition=%cond.2, body=%body.2
  %y = bf16[8,8]{{1,0}} get-tuple-element(%while.2), index=1
  %fusion.5 = bf16[8,8]{{1,0}} fusion(%y), kind=kLoop, calls=%fused_acc, {ADAM}, {_cfg(5)}
  ROOT %copy.1 = bf16[8,8]{{1,0}} copy(%fusion.5)
}}
"""


def test_estimated_cycles_are_multiplied_by_the_trip_counts_of_their_loops():
    got = {(c["op_name"].split("/", 1)[-1], c["loop"]): (c["cycles"], c["count"])
           for c in hread.parse_hlo_costs(MODULE)}
    assert got == {
        # 100 cycles x 3 trips (known_trip_count); its matmul is the attention einsum
        ("jvp(layer0)/attention/bskgd,btkd->bkgst/dot_general", "windowed-rs"): (300, 3),
        ("", "windowed-rs"): (30, 3),  # the accumulator select: 10 x 3
        ("transpose(jvp(head))/dot_general", "windowed-rs"): (12, 3),  # the add: 4 x 3
        # 7 cycles x ceil(8 / 2) trips read off the condition and the induction step
        ("transpose(jvp(layer1))/norm/rsqrt", ""): (28, 4),
        ("adam/convert_element_type", ""): (5, 1),  # the copy has no estimate
    }


def test_xla_ops_are_classed_by_named_scope_and_the_einsum_of_their_matmul():
    classes = {}
    for c in hread.parse_hlo_costs(MODULE):
        k = xdoc.xla_op_class(c["op_name"], c["matmul"], c["loop"])
        classes[k] = classes.get(k, 0) + c["cycles"]
    # Both accumulator fusions of the reduce-scatter loop, the head's named add included.
    assert classes == {"attention matmuls": 300, "windowed-einsum accumulators": 30 + 12,
                       "norms": 28, "optimizer update": 5}
    # In an all-gather loop a named copy of an output slice keeps its scope's class.
    assert xdoc.xla_op_class("jit(step)/jvp(layer0)/dot_general", "", "windowed-ag") == \
        "other elementwise"
    assert xdoc.xla_op_class("", "", "windowed-ag") == "windowed-einsum accumulators"
    assert xdoc.xla_op_class("jit(step)/jvp(layer3)/dot_general",
                           "jit(step)/jvp(layer3)/dot_general") == "layer matmuls"
    assert xdoc.xla_op_class("jit(step)/transpose(jvp(head))/dot_general", "") == \
        "embedding, logits and loss"
    assert xdoc.xla_op_class("jit(step)/jvp(layer0)/attention/exp", "") == "softmax and mask"
    assert xdoc.xla_op_class("jit(step)/jvp(layer0)/jit(silu)/mul", "") == "other elementwise"
    assert xdoc.xla_op_class("jit(step)/jvp(layer0)/add", "jit(step)/jvp(layer0)/bsm,bsec->ebcm/"
                           "dot_general") == "MoE dispatch and combine"
    assert xdoc.xla_op_class("", "", "") == "unattributed"


def test_fusion_stats_read_flops_and_accumulator_bytes_per_estimated_cycle():
    st = sides.hlo_fusion_stats(MODULE)
    # The matmul fusion: 2 x 8 x 8 x 8 FLOP in 100 cycles.
    assert st["mxu_flops_per_cycle"] == 2 * 8 * 8 * 8 / 100 and st["mxu_fusion"] == "fusion.2"
    # The reduce-scatter loop's two other fusions each read and write a bf16[8,8] (256 bytes),
    # in 10 and 4 cycles; the norm and optimizer fusions outside it do not count.
    assert (st["accum_bytes"], st["accum_cycles"], st["accum_max"]) == (512, 14, [256, 10])


def test_tpusim_ops_are_classed_by_name_unit_and_layer():
    def op(name, unit="vpu", layer=0, kind="compute"):
        return SimpleNamespace(name=name, unit=unit, layer=layer, kind=kind)

    assert xdoc.tpusim_op_class(op("re-qkv_proj", "mxu")) == "layer matmuls"
    assert xdoc.tpusim_op_class(op("re-attn_scores", "mxu")) == "attention matmuls"
    assert xdoc.tpusim_op_class(op("softmax_bwd")) == "softmax and mask"
    assert xdoc.tpusim_op_class(op("re-norm_mlp")) == "norms"
    assert xdoc.tpusim_op_class(op("mlp_act")) == "other elementwise"
    assert xdoc.tpusim_op_class(op("logits", "mxu", layer=-1)) == "embedding, logits and loss"
    assert xdoc.tpusim_op_class(op("adam_update", layer=-1)) == "optimizer update"
    assert xdoc.tpusim_op_class(op("moe_dispatch_bwd", "mxu")) == "MoE dispatch and combine"
    assert xdoc.tpusim_op_class(op("tp_allreduce_mlp", kind="collective")) == "collectives"
    assert xdoc.tpusim_op_class(op("logits_bwd_weights_accum", layer=-1)) == \
        "windowed-einsum accumulators"


# -- mesh replica groups with a device list (XLA's data x fsdp programs on v6e) ---------------

def test_mesh_replica_groups_map_mesh_positions_through_an_iota_device_list():
    from workloads.hlo.parser import replica_groups

    # Mesh [a=2, b=1, c=2]: position p = 2a + c. The device list is iota(4) reshaped to
    # [2,2] and transposed: [0, 2, 1, 3]. Varying a with c fixed: positions {0,2} -> devices
    # {0,1}; positions {1,3} -> devices {2,3} (without the list: [[0,2],[1,3]]).
    assert replica_groups("mesh['a'=2,'b'=1,'c'=2], device_ids=([2,2]T(1,0)) {'a'}", 4) == \
        [[0, 1], [2, 3]]
    assert replica_groups("mesh['a'=2,'b'=1,'c'=2] {'a'}", 4) == [[0, 2], [1, 3]]
    assert replica_groups("mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'b'}", 4) == \
        [[3, 1], [2, 0]]


@pytest.mark.parametrize("ids", ["0,0,1,2", "0,1,2", "[2,3]T(1,0)", "[2,2]T(0,0)"])
def test_a_device_list_that_is_not_the_mesh_devices_once_each_is_refused(ids):
    from topologies.errors import TpusimError
    from workloads.hlo.parser import replica_groups

    with pytest.raises(TpusimError, match="device_ids"):
        replica_groups(f"mesh['a'=2,'b'=2], device_ids=({ids}) {{'b'}}", 4)


def test_a_module_with_device_list_replica_groups_parses_and_both_readers_agree():
    from workloads.hlo.parser import parse_hlo, replica_groups

    groups = "mesh['a'=2,'b'=1,'c'=2], device_ids=([2,2]T(1,0)) {'a'}"
    rest = "dimensions={0}, use_global_device_ids=true"
    text = f"""HloModule m

ENTRY %main (p: bf16[4]) -> bf16[8] {{
  %p = bf16[4]{{0}} parameter(0)
  ROOT %ag = bf16[8]{{0}} all-gather(%p), channel_id=1, replica_groups={groups}, {rest}
}}
"""
    ins = parse_hlo(text).entry_computation.root
    assert replica_groups(ins.attrs["replica_groups"], 4) == [[0, 1], [2, 3]]
    (op,) = hread.parse_hlo_collectives(text)
    assert op["replica_groups"] == groups
    assert xdoc.parse_replica_groups(op["replica_groups"], 4) == [[0, 1], [2, 3]]


def test_a_computation_with_attributes_after_its_body_parses():
    # v6e modules put scatter-add reducers on the SparseCore: `}, execution_thread="sparsecore"`.
    from workloads.hlo.parser import parse_hlo

    text = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}, execution_thread="sparsecore"

ENTRY %main (p: f32[4]) -> f32[] {
  %p = f32[4]{0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %z), dimensions={0}, to_apply=%add
}
"""
    m = parse_hlo(text)
    assert list(m.computations) == ["add", "main"] and m.entry == "main"
    assert m.computations["add"].root.opcode == "add"



L1 = 'metadata={op_name="jit(step)/jvp(layer1)/dot_general"}'
_A, _B, _C = "bf16[4096,4096]", "bf16[4096,2048]", "bf16[64,4096]"
_VMEM, _HBM = "{1,0:T(8,128)(2,1)S(1)}", "{1,0:T(8,128)(2,1)}"
_LOOP = f"({_A}, {_B}, {_C}, u32[])"
_GROUPS = "replica_groups={{0,1}}"
# A windowed reduce-scatter loop carrying a 32 MiB buffer in VMEM (S(1)), a 16 MiB one in HBM
# and a small one; layer 1 gathers one matrix blocking and one async and all-reduces another.
FORMS_MODULE = "\n".join([
    "HloModule jit_step", "",
    # The all-reduce's reducer (the module is read by workloads.hlo.parser, which checks that
    # every called computation is defined).
    "%add (a: bf16[], b: bf16[]) -> bf16[] {",
    "  %a = bf16[] parameter(0)",
    "  %b = bf16[] parameter(1)",
    "  ROOT %s = bf16[] add(%a, %b)",
    "}", "",
    f"%wide.windowed_dot_general_body_rs.3 (wide.param: {_LOOP}) -> {_LOOP} {{",
    f"  %wide.param = ({_A}{_VMEM}, {_B}{_HBM}, {_C}{_VMEM}, u32[]{{:T(128)}}) parameter(0)",
    f"  ROOT %t = {_LOOP} tuple(%wide.param)",
    "}", "",
    f"ENTRY %main (p0: {_C}, p1: {_A}) -> {_A} {{",
    f"  %p0 = {_C}{{1,0}} parameter(0)",
    f"  %p1 = {_A}{{1,0}} parameter(1)",
    f"  %all-gather.1 = {_A}{{1,0}} all-gather(%p0), channel_id=1, {_GROUPS}, "
    f"dimensions={{0}}, {L1}",
    f"  %all-gather-start.2 = ({_C}{{1,0}}, {_A}{{1,0}}) all-gather-start(%p0), channel_id=2, "
    f"{_GROUPS}, dimensions={{0}}, {L1}",
    f"  %all-gather-done.2 = {_A}{{1,0}} all-gather-done(%all-gather-start.2), {L1}",
    f"  ROOT %all-reduce.3 = {_A}{{1,0}} all-reduce(%p1), channel_id=3, {_GROUPS}, "
    f"to_apply=%add, {L1}",
    "}", ""])


def test_gather_forms_count_windowed_loops_plain_collectives_and_where_loop_buffers_sit():
    # What `xla_crosscheck.py --forms` prints per program (docs/model.md, the ring-length rule).
    assert sides.gather_forms(FORMS_MODULE) == {
        "windowed_ag": 0, "windowed_rs": 1,
        "layer1": {"all-gather": 2, "all-reduce": 1, "async all-gather": 1},
        "big_loop_buffers_vmem": 1, "big_loop_buffers_hbm": 1}
