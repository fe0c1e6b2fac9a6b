"""How validation/xla_moe_pair.py reads XLA's cost estimates of the matched dense / MoE pair
(docs/validation.md, effect 3): cycles and matmul FLOPs per instruction with loop trip counts,
a fusion of several matmuls split among them by FLOPs, and the classes it compares with
tpusim's ops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from validation import xla_moe_pair


@pytest.fixture(scope="module")
def pair():
    return xla_moe_pair


def _meta(name: str) -> str:
    return f'metadata={{op_name="jit(step)/{name}"}}'


def _cfg(cycles: int) -> str:
    return f'backend_config={{"flag_configs":[],"estimated_cycles":"{cycles}"}}'


EXPERT = "transpose(jvp())/while/body/closed_call/checkpoint/layer0/ebcm,emh->ebch/dot_general"
PROJ = "transpose(jvp())/while/body/closed_call/checkpoint/layer0/attention/reshape"
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
TRIPS = 'backend_config={"known_trip_count":{"n":"2"}}'
C40 = _cfg(40)
HEAD = _meta("transpose(jvp())/head/mul")
REMAT = ("transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/layer0/"
         "bsm,bsec->ebcm/dot_general")

# A layer loop of 2 trips (known_trip_count) holding one fusion of two matmuls, an expert
# einsum [8,4]x[4,16] (1,024 FLOPs) and a projection [8,4]x[4,8] (512 FLOPs), estimated at 300
# cycles, and a recomputed dispatch dot [8,4]x[4,4] (256 FLOPs, 40 cycles); outside the loop
# a head fusion of 7 cycles.
MODULE = f"""HloModule jit_step

%fused_two (p0: bf16[8,4], p1: bf16[4,16], p2: bf16[4,8]) -> bf16[8,16] {{
  %p0 = bf16[8,4]{{1,0}} parameter(0)
  %p1 = bf16[4,16]{{1,0}} parameter(1)
  %p2 = bf16[4,8]{{1,0}} parameter(2)
  %dot.1 = bf16[8,16]{{1,0}} dot(%p0, %p1), {DOT}, {_meta(EXPERT)}
  %dot.2 = bf16[8,8]{{1,0}} dot(%p0, %p2), {DOT}, {_meta(PROJ)}
  ROOT %t = bf16[8,16]{{1,0}} add(%dot.1, %dot.1)
}}

%fused_head (p0: bf16[8,16]) -> bf16[8,16] {{
  ROOT %p0 = bf16[8,16]{{1,0}} parameter(0)
}}

%body.1 (param: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {{
  %param = (s32[], bf16[8,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = bf16[8,4]{{1,0}} get-tuple-element(%param), index=1
  %w = bf16[4,16]{{1,0}} constant({{...}})
  %v = bf16[4,8]{{1,0}} constant({{...}})
  %u = bf16[4,4]{{1,0}} constant({{...}})
  %fusion.1 = bf16[8,16]{{1,0}} fusion(%x, %w, %v), calls=%fused_two, {_meta(EXPERT)}, {_cfg(300)}
  %dot.3 = bf16[8,4]{{1,0}} dot(%x, %u), {DOT}, {_meta(REMAT)}, {C40}
  ROOT %t = (s32[], bf16[8,4]{{1,0}}) tuple(%i, %dot.3)
}}

%cond.1 (param: (s32[], bf16[8,4])) -> pred[] {{
  %param = (s32[], bf16[8,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %c = s32[] constant(2)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

ENTRY %main (a: bf16[8,4], h: bf16[8,16]) -> bf16[8,16] {{
  %a = bf16[8,4]{{1,0}} parameter(0)
  %h = bf16[8,16]{{1,0}} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], bf16[8,4]{{1,0}}) tuple(%z, %a)
  %while.1 = (s32[], bf16[8,4]{{1,0}}) while(%init), condition=%cond.1, body=%body.1, {TRIPS}
  ROOT %fusion.9 = bf16[8,16]{{1,0}} fusion(%h), kind=kLoop, calls=%fused_head, {HEAD}, {_cfg(7)}
}}
"""


def test_a_fusion_of_two_matmuls_is_split_by_their_flops_and_multiplied_by_the_trips(pair):
    def short(name):
        return name.rsplit("/", 2)[-2] if name.count("/") > 1 else name

    got = {(short(c["op_name"]), short(c["matmul"])): (c["cycles"], c["flops"])
           for c in pair.hlo_costs(MODULE)}
    assert got == {
        # 300 cycles x 2 trips, split 1,024 : 512 FLOPs
        ("ebcm,emh->ebch", "ebcm,emh->ebch"): (400, 2 * 1024),
        ("ebcm,emh->ebch", "attention"): (200, 2 * 512),
        ("bsm,bsec->ebcm", "bsm,bsec->ebcm"): (80, 2 * 256),
        ("head", ""): (7, 0),
    }


def test_layer_classes_name_the_matmul_by_its_einsum_and_split_forward_backward_recompute(pair):
    classes = pair.layer_classes(pair.hlo_costs(MODULE))
    # The projection carries the attention scope's op_name but no attention einsum.
    assert classes["weight matmuls"]["cycles"] == 200
    assert classes["expert matmuls"] == {"cycles": 400, "cycles_backward": 400,
                                         "flops": 2048, "flops_backward": 2048}
    assert classes["dispatch and combine"]["flops_recompute"] == 512
    assert "head" not in str(classes)  # outside the layers


def test_xla_and_tpusim_ops_fall_in_the_same_classes(pair):
    x = pair.xla_class
    assert x("jit(step)/jvp()/layer0/attention/bskgd,btkd->bkgst/dot_general",
             "jit(step)/jvp()/layer0/attention/bskgd,btkd->bkgst/dot_general") == "attention"
    assert x("jit(step)/jvp()/layer0/attention/exp", "") == "attention"
    assert x("jit(step)/jvp()/layer0/ebcm,bsec->bsm/dot_general",
             "jit(step)/jvp()/layer0/ebcm,bsec->bsm/dot_general") == "dispatch and combine"
    assert x("jit(step)/jvp()/layer0/router/cumsum", "") == "router and masks"
    assert x("jit(step)/jvp()/layer0/norm/rsqrt", "") == "norms and elementwise"
    assert x("jit(step)/jvp()/layer0/dot_general", "jit(step)/jvp()/layer0/dot_general") == \
        "weight matmuls"
    assert x("jit(step)/sgd/sub", "") is None

    def op(name, unit="mxu", layer=3):
        return SimpleNamespace(name=name, unit=unit, layer=layer)

    t = pair.tpusim_class
    assert t(op("attn_proj_bwd_weights"), moe=True) == "weight matmuls"
    assert t(op("re-flash_attention"), moe=True) == "attention"
    assert t(op("mlp_bwd"), moe=True) == "expert matmuls"
    assert t(op("mlp_bwd"), moe=False) == "weight matmuls"
    assert t(op("re-expert_out"), moe=True) == "expert matmuls"
    assert t(op("expert_act", unit="vpu"), moe=True) == "norms and elementwise"
    assert t(op("re-moe_dispatch"), moe=True) == "dispatch and combine"
    assert t(op("moe_masks", unit="vpu"), moe=True) == "router and masks"
    assert t(op("lm_head", layer=-1), moe=True) is None


def test_a_flag_variant_is_read_as_its_cycles_over_the_programs_without_it(pair):
    def costs(expert, attn, norm):
        return {"costs": [
            {"op_name": "jit(step)/jvp()/layer0/ebcm,emh->ebch/dot_general",
             "matmul": "jit(step)/jvp()/layer0/ebcm,emh->ebch/dot_general",
             "cycles": expert, "flops": 1.0},
            {"op_name": "jit(step)/jvp()/layer0/attention/exp", "matmul": "",
             "cycles": attn, "flops": 0.0},
            {"op_name": "jit(step)/jvp()/layer0/norm/rsqrt", "matmul": "",
             "cycles": norm, "flops": 0.0}]}

    v = next(iter(pair.VARIANTS))
    cache = {"mixtral-8x7b": costs(300, 50, 100), f"mixtral-8x7b+{v}": costs(150, 100, 100)}
    rows = pair.variant_rows(cache)[v]
    assert list(rows) == ["mixtral-8x7b"]  # the LLaMA has no pair in this cache
    assert rows["mixtral-8x7b"] == {"expert matmuls": 0.5, "attention": 2.0,
                                    "norms and elementwise": 1.0,
                                    "layer but attention": 250 / 400}
