"""Compile one Transformer training step into an SPMD `Trace` (per-chip ops and collectives).

Per layer: FSDP weight all-gathers, norms, QKV/out/MLP matmuls, rotary, attention (dot or flash),
activations and residuals, tensor-parallel activation all-reduces, expert all-to-alls; the
backward pass (with the remat policy's recomputation), gradient reduce-scatters and data-parallel
all-reduces; embedding, output projection, loss and the Adam update. Pipeline stages, gradient
accumulation and host offload of activations are expressed in the same ops. FLOP counts follow
`tpu.md` §3-§4; HBM occupancy is recorded as categorised allocation events (`meta.memory_events`,
saved activations tensor by tensor from `workloads/memory.py`).

The package by concept:
    modes.py       every mode a step takes, as a `StrEnum`
    config.py      `TrainingConfig` (the run settings) and its recorded dict form
    remat.py       the remat policies (tpusim's and MaxText's names) as `RematPlan`s: what
                   each keeps in HBM, offloads to host and recomputes per layer
    xla_rules.py   every decision "as XLA compiles it": fusions, gather forms, gradient
                   collectives, ring messages, thresholds, what the chip's compiler defers
    program.py     the program builder: ops, HBM events, sharding of the weights, FSDP gathers
    layer.py       one layer's forward and backward
    hbm.py         saved, recomputed and offloaded activations and their HBM events
    gradients.py   the gradient reductions over fsdp and the data-parallel axes
    step.py        the whole step: embedding, the layer loops, loss, optimizer update, metadata
    compiler.py    the checks and entry points (`compile_training_step`, a pipeline chunk,
                   the HBM estimate)
    cache.py       the compiled-trace cache
"""

from workloads.dtypes import dtype_bytes
from workloads.training.cache import TRACE_CACHE_SIZE
from workloads.training.compiler import (
    MIN_OPS_PER_LAYER,
    Compiler,
    compile_pipeline_chunk,
    compile_training_step,
    estimate_training_memory,
    program_compiler,
)
from workloads.training.config import (
    TrainingConfig,
    check_stateless_optimizer,
    training_config_from_dict,
    training_config_to_dict,
)
from workloads.training.modes import (
    DP_GRAD_SPLITS,
    FSDP_GATHER_MODES,
    FSDP_GRAD_MODES,
    PIPELINE_SCHEDULES,
    Attention,
    DpAllreduce,
    DpGradSplit,
    EpAlltoall,
    FsdpGather,
    FsdpGrad,
    MoeDispatch,
    Optimizer,
    PipelineSchedule,
    Remat,
    TpActivations,
    TpComm,
    parse_optimizer,
    parse_remat,
)
from workloads.training.program import WEIGHT_CAST
from workloads.training.xla_rules import XLA_ALLREDUCE_ALONE_BYTES, XLA_MAX_WINDOWED_RING

# The step's program builder under its former private name (tests patch its methods).
_Compiler = Compiler

__all__ = [
    "_Compiler",
    "program_compiler",
    "DP_GRAD_SPLITS",
    "FSDP_GATHER_MODES",
    "FSDP_GRAD_MODES",
    "MIN_OPS_PER_LAYER",
    "PIPELINE_SCHEDULES",
    "TRACE_CACHE_SIZE",
    "WEIGHT_CAST",
    "XLA_ALLREDUCE_ALONE_BYTES",
    "XLA_MAX_WINDOWED_RING",
    "Attention",
    "Compiler",
    "DpAllreduce",
    "DpGradSplit",
    "EpAlltoall",
    "FsdpGather",
    "FsdpGrad",
    "MoeDispatch",
    "Optimizer",
    "PipelineSchedule",
    "Remat",
    "TpActivations",
    "TpComm",
    "TrainingConfig",
    "check_stateless_optimizer",
    "compile_pipeline_chunk",
    "compile_training_step",
    "dtype_bytes",
    "estimate_training_memory",
    "parse_optimizer",
    "parse_remat",
    "training_config_from_dict",
    "training_config_to_dict",
]
