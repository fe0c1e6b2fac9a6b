"""How validation/xla_flash_cost.py reads what the Pallas flash-attention kernels' custom calls
say they cost, and what the committed compiles (validation/results/xla_flash_cost.json) and
the flash-attention peak-HBM rows (xla_memory.json) hold (docs/validation.md, "Flash
attention"). No compile: the caches are read as committed."""

from __future__ import annotations

import json

import pytest

from validation import xla_compile, xla_flash_cost, xla_memory_programs


@pytest.fixture(scope="module")
def fc():
    return xla_flash_cost


# A forward kernel with a cost estimate and 2.5 MB of scoped VMEM, its attributes running on
# to a second line (kernel metadata), then a backward kernel with neither, then an ordinary
# fusion with an estimated_cycles that is no custom call.
HLO = "\n".join([
    '  %flash_attention.1 = (bf16[2,16,2048,128]{3,2,1,0}) custom-call(%a, %b, %c), '
    'custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={',
    '"xprof_metadata":"{}"',
    '}}, backend_config={"flag_configs":[],"custom_call_config":{"body":"TUzvUgFN+/x=",'
    '"cost_estimate":{"flops":"69122129920","transcendentals":"134217728",'
    '"bytes_accessed":"134217728","remote_bytes_transferred":"0"},"needs_layout_passes":true},'
    '"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"2523136"}]}',
    '  %flash_mha_bwd_dq.1 = (bf16[2,16,2048,128]{3,2,1,0}) custom-call(%a), '
    'custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x"}}',
    '  %fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f, '
    'backend_config={"window_config":{"estimated_cycles":"800"}}',
])


def test_custom_calls_are_read_with_their_cost_estimate_cycles_and_vmem(fc):
    calls = fc.parse_custom_calls(HLO)
    assert [c["name"] for c in calls] == ["flash_attention.1", "flash_mha_bwd_dq.1"]
    fwd, bwd = calls
    assert fwd["cost_estimate"] == {"flops": 69122129920.0, "transcendentals": 134217728.0,
                                    "bytes_accessed": 134217728.0,
                                    "remote_bytes_transferred": 0.0}
    assert fwd["vmem_bytes"] == 2523136 and fwd["estimated_cycles"] is None
    # The other instruction's estimated_cycles is not the custom call's.
    assert bwd == {"name": "flash_mha_bwd_dq.1", "cost_estimate": None,
                   "estimated_cycles": None, "vmem_bytes": 0}


def test_tpusim_side_is_the_causal_half_forward_and_two_and_a_half_times_it_backward(fc):
    ops = fc.tpusim_flash_ops("v5e")
    # 2 sequences x 2048 queries x 16 heads x head_dim 128, each query against 1024 keys on
    # average (causal), 4 FLOPs per query-key-dim (two matmuls of 2 FLOPs).
    fwd = 4 * fc.BATCH_PER_CHIP * fc.SEQ * fc.HEADS * fc.HEAD_DIM * (fc.SEQ / 2)
    assert ops["flash_attention"]["flops"] == fwd
    assert ops["flash_attention_bwd"]["flops"] == 2.5 * fwd
    # q, k, v and the output in bf16.
    assert ops["flash_attention"]["hbm_bytes"] == \
        4 * fc.BATCH_PER_CHIP * fc.SEQ * fc.HEADS * fc.HEAD_DIM * 2


def test_only_the_flash_forward_declares_a_cost_and_it_counts_every_score(fc):
    cache = json.loads((xla_compile.RESULTS / "xla_flash_cost.json").read_text())
    assert set(cache) == set(fc.PROGRAMS)
    b, s, h, d = fc.BATCH_PER_CHIP, fc.SEQ, fc.HEADS, fc.HEAD_DIM
    for name, x in cache.items():
        calls = x["custom_calls"]
        assert len(calls) == 3 and all(c["estimated_cycles"] is None for c in calls), name
        declared = [c for c in calls if c["cost_estimate"]]
        if x["kernel"] == "splash":
            assert declared == [], name
            continue
        (fwd,) = declared
        assert fwd["name"].startswith("flash_attention")
        est = fwd["cost_estimate"]
        # The dense reference: both [s, s] matmuls whole, plus a few elementwise FLOPs per
        # score; one exp per score.
        dense = 4 * b * h * s * s * d
        assert dense <= est["flops"] <= dense + 8 * b * h * s * s
        assert est["transcendentals"] == b * h * s * s
        # cost_analysis() adds the declared FLOPs to the program's own (a few reductions).
        assert est["flops"] <= x["cost_analysis"]["flops"] <= 1.01 * est["flops"]


# v6e fsdp x tensor `full`: blocking gathers, so the logits are not kept through the backward
# loop under flash attention (+14.2% when they were); v5e with one sequence per chip keeps the
# logit gradients through it (-15.1% when it did not).
@pytest.mark.parametrize("name", ["v6e_fsdp_tp_full_s2048_splash",
                                  "v5e_fsdp_full_s2048_b1_splash"])
def test_flash_attention_peaks_are_within_ten_percent_of_the_compiled_splash_programs(name):
    mem = xla_memory_programs
    cache = json.loads(mem.CACHE.read_text())
    assert mem.CONFIGS[name]["attention"] == "splash"
    err = mem.tpusim_peak(name, cache[name])["peak_bytes"] / mem.xla_hbm_peak(cache[name]) - 1
    assert abs(err) <= 0.10
