"""`XlaCompilerSpec`: what a TPU generation's XLA compiler does to a training step's memory, as
tpusim models it, apart from the silicon (`sim.hardware.ChipSpec` holds one as `compiler`).

Each rule is true or false, false being "not seen": read off the live ranges of the compiled
`benchmarks/xla_memory.py` programs (docs/model.md "Memory"). A step compiled for a chip takes
its rules as the `TrainingConfig` fields of the same names; a chip YAML file and the `set`
overrides write them under the same names, beside the chip's own keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaCompilerSpec:
    """One generation's XLA compiler behaviour (each rule changes memory only).

    Attributes:
        score_exp_fusion: XLA's TPU compiler for this generation always fuses dot
            attention's score matmul with the softmax's exponentials (one output fusion writes
            the f32 exponentials; the f32 scores are never a buffer of their own). True on
            v6e; false on v5e and v5p, whose compiler fuses them only on some meshes and
            gather forms (workloads.memory.score_exp_fused). Read off the forward layer of the
            compiled `benchmarks/xla_memory.py` programs (docs/model.md "Memory"). It changes the
            memory of dot attention only (workloads.training.TrainingConfig.score_exp_fusion,
            set from the chip by sim/).
        score_grad_fusion: in a recomputing backward (remat full, minimal, offload) of dot
            attention the compiler recomputes the score gradient inside the fusions of the
            two matmuls that read it (dQ, dK) instead of writing it as a bf16 buffer. True on
            v5e. Read off the attention backward of the compiled `benchmarks/xla_memory.py`
            programs (workloads.memory.attention_backward_score_buffers).
        bwd_probs_buffer: a recomputing backward of dot attention writes the bf16
            probabilities as a buffer for the value-gradient matmul: under full in the
            recomputation (live from its softmax to that matmul), and, when the layer's
            projections are kept (minimal, offload), in the same fusion as the probability
            gradient, so they are live at the score gradient. True on v5p (same source).
        loss_after_backward: with one sequence per chip the compiler schedules the loss
            value (the gather of each token's target logit, which reads the f32 logits, and
            the sum whose all-reduce XLA combines with the final norm's gradient) after the
            backward layer loop, so the f32 logits live through it. True on v5e. Read off the
            v5e, v5p and v6e programs of `benchmarks/xla_memory.py` with one sequence per chip
            (workloads.memory.loss_value_logits_bytes).
        mlp_grad_after_attention: with windowed weight gathers (collective-matmul loops) the
            compiler schedules a layer's MLP weight-gradient rings after the attention's
            backward under full and minimal, so the MLP's recomputed tensors live through it
            (as they do under offload on every chip). True on v5e. Read off the score gradient
            of the windowed v5e, v5p and v6e programs of `benchmarks/xla_memory.py`
            (workloads.training's mlp_side_bytes).
        head_grad_after_backward: with windowed weight gathers over fsdp (no tensor axis)
            the compiler schedules the output projection's weight-gradient ring after the
            backward layer loop when the weights are cast before their gathers (f32 params
            gathered in bf16), so the bf16 logit gradients and the final norm's output live
            through the loop. True on v6e. Read off the windowed fsdp=16 v5e and v6e programs
            of `benchmarks/xla_memory.py` (workloads.memory.windowed_head_gradient_bytes).
    """

    score_exp_fusion: bool = False
    score_grad_fusion: bool = False
    bwd_probs_buffer: bool = False
    loss_after_backward: bool = False
    mlp_grad_after_attention: bool = False
    head_grad_after_backward: bool = False

    def rules(self) -> dict[str, bool]:
        """{rule: value}, in `COMPILER_RULES` order (the `TrainingConfig` fields)."""
        return {name: getattr(self, name) for name in COMPILER_RULES}


# The rules' names: chip YAML keys, `--set` keys and TrainingConfig fields alike.
COMPILER_RULES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(XlaCompilerSpec))
