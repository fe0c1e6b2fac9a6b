"""Compile inference steps into SPMD `Trace`s: one decode (generate) step of a batch of sequences
with a KV cache, and the prefill of their prompts (optionally chunked); plus the HBM plan that
gives the largest batch that fits. Formulas follow `reference/tpu.md` §3 and §5.

Two shardings: 1D (Megatron: `tensor` splits heads, d_ff and vocab) and, when the mesh has an
`fsdp` axis, 2D weight-stationary (tpu.md §5): `fsdp=X` splits the weights' d_model dimension,
`tensor=YZ` their heads/d_ff/vocab dimension, and the activations move instead of the weights.

The package by concept:
    config.py    `DecodeConfig` (the run settings) and the sampling modes
    layout.py    the split of the model and the batch over the mesh, and the HBM plan
    program.py   the program builder: layers, attention, MLP and MoE, embedding, head, sampling
    steps.py     the entry points (`compile_decode_step`, `compile_prefill`) and the roofline
"""

from workloads.inference.config import SAMPLING_MODES, DecodeConfig
from workloads.inference.layout import max_batch_that_fits, memory_plan
from workloads.inference.steps import compile_decode_step, compile_prefill, decode_roofline_s

__all__ = [
    "SAMPLING_MODES",
    "DecodeConfig",
    "compile_decode_step",
    "compile_prefill",
    "decode_roofline_s",
    "max_batch_that_fits",
    "memory_plan",
]
