"""int8 (AQT) training's costs, one home: which matmuls of a step run in int8, what quantizing
their operands costs on the VPU (its FLOPs and HBM bytes, the scales, the random bits of
stochastic rounding), and what the int8 copies take in HBM and on the wire.

The model is MaxText's `quantization=int8` (docs/model/int8.md, docs/reference/int8.md): AQT's
`config_v3` with 8 bits for the forward matmul and both backward ones (the input gradient
`dlhs`, the weight gradient `drhs`), int32 accumulation, per-channel scales (the abs-max of each
row or column along the contraction, AQT's default calibration), and stochastic rounding of the
gradient operand of both backward matmuls (`jax.uniform` noise: 32 random bits per element).
An int8 matmul's operands are quantized right before it: an operand is read twice (its
abs-max, then the scaled, rounded, clipped cast) and written once as int8, and its scales are
written and read by the matmul's output fusion, which dequantizes the int32 products (two
multiplies an element, no HBM trip of their own). What the compiled programs do beyond that
(`validation/xla_int8.py`, docs/validation.md "int8 training against XLA") is written down as
the rules below, each with the compile it was read off.

Per weight matmul of a layer, forward (and again in a remat recomputation), `X[n, K] W[K, N]`:
X quantized per row, W per column; input gradient `dY[n, N] W^T`: dY per row with stochastic
rounding, W per row (a quantization of its own: AQT's config_v3 does not reuse the forward's,
`use_fwd_quant=False`); weight gradient `X^T dY`: X and dY per column over the tokens, dY with
stochastic rounding. A merged matmul (q, k, v; gate and up) quantizes its shared input once:
the same abs-max and cast of the same tensor, which XLA computes once.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.dtypes import Dtype

# VPU FLOPs to quantize one element: |x|, the running max, the multiply by the inverse scale,
# the clip, the round (the cast to int8 is free). Counted, not fitted.
QUANT_FLOPS_PER_ELEMENT = 5
# ... and to add stochastic-rounding noise: the random bits' conversion to a float in [0, 1),
# the - 0.5 and the add (jax.random.uniform(key) - 0.5 as AQT's JaxUniform draws it); the
# bits themselves come from the TPU's random-bit generator (`rng-bit-generator` with
# MaxText's unsafe_rbg PRNG), costed as their bytes.
SR_FLOPS_PER_ELEMENT = 3
# Dequantizing an int32 product: times the two operands' scales (in the matmul's output
# fusion).
DEQUANT_FLOPS_PER_ELEMENT = 2
# Bytes per element of quantization's HBM traffic, per quantized operand element: the bf16
# operand read by the abs-max reduction and again by the quantizing cast, the int8 copy
# written.
QUANT_READS = 2
# The random bits of one stochastically rounded element: 32 bits written by the generator and
# read by the quantizing fusion.
SR_BITS_BYTES = 2 * 4
# Random bits per stochastically rounded element (u32, `rng-bit-generator`).
RANDOM_BITS_BYTES = 4
# Memory (read off validation/xla_int8.py's v5e fsdp=16 `full` int8 compile, docs/validation.md;
# where it holds re-read off v5p fsdp=16 and fsdp=4 x tensor=4 compiles, and checked on a v5e
# fsdp=4 x tensor=4 one compiled after): with async plain weight gathers
# (`xla_rules.sr_bits_early`, v5e) XLA generates the random bits of a layer's backward early,
# after the MLP's input gradients, and keeps them to their quantizing fusions, so at the
# attention's score gradient every weight gradient's output-gradient noise of the layer (gate,
# up, down, q, k, v, o) and the q, k, v input gradients' noise are live (448 MiB of the 468 MiB
# by which the v5e program's peak exceeds its bf16 twin's); with blocking ones (v5p) each
# generator runs right before its quantization and nothing is held. `LayerProgram.sr_bits_held`
# holds them from the MLP's input-gradient quantization to the matmuls that consume them (the
# MLP's weight gradients run last in int8, `xla_rules.mlp_grads_after_attention`).
SR_HELD_RULE = ("with async gathers, random bits from the layer backward's start to their "
                "quantization; with blocking ones, none held")
# A scale is f32 (written by the quantization, read by the dequantizing output fusion).
SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class QuantCost:
    """One quantization's work: VPU FLOPs, HBM bytes, and the int8 copy (bytes) it leaves for
    its matmul."""

    flops: float
    hbm_bytes: float
    copy_bytes: float


def quantize_cost(elements: float, scales: float, *, sr: bool, act_bytes: float
                  ) -> QuantCost:
    """Quantizing `elements` bf16 elements with `scales` scales (rows or columns per-channel,
    one per-tensor), with stochastic rounding's noise or without."""
    if elements <= 0:
        return QuantCost(0.0, 0.0, 0.0)
    int8 = float(Dtype.INT8.nbytes)
    flops = QUANT_FLOPS_PER_ELEMENT * elements + (SR_FLOPS_PER_ELEMENT * elements if sr else 0.0)
    nbytes = elements * (QUANT_READS * act_bytes + int8) + 2 * SCALE_BYTES * scales
    if sr:
        nbytes += SR_BITS_BYTES * elements
    return QuantCost(flops, nbytes, elements * int8)


def dequant_flops(out_elements: float) -> float:
    """VPU FLOPs of dequantizing an int8 matmul's int32 outputs (fused into its output)."""
    return DEQUANT_FLOPS_PER_ELEMENT * out_elements
