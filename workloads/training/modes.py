"""Every mode a training step takes, each a `StrEnum` whose values are the strings the CLI, the
Python API, study files and recorded traces use (`str(mode)` is its text).
"""

from __future__ import annotations

import enum

from topologies.validate import parse_choice


class Remat(enum.StrEnum):
    """The remat policy of every layer: tpusim's own names and MaxText's `remat_policy` names
    (what each keeps, offloads and recomputes: `workloads/training/remat.py`)."""

    NONE = "none"
    MINIMAL = "minimal"
    FULL = "full"
    OFFLOAD = "offload"
    # The tpu-recipes' MaxText `custom` policies: the decoder-layer input and the outputs of the
    # q, k, v projections (and, with `qkvo-offload`, of the attention output projection) are
    # offloaded to host memory and fetched back for the backward pass; everything else is
    # recomputed, as under `full`, except those projections.
    QKV_OFFLOAD = "qkv-offload"
    QKVO_OFFLOAD = "qkvo-offload"
    # MaxText's names (`full` and `minimal` are the same names as tpusim's; docs/model/remat.md).
    MINIMAL_WITH_CONTEXT = "minimal_with_context"
    MINIMAL_FLASH = "minimal_flash"
    SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP = "save_dot_with_context_except_mlp"
    SAVE_DOT_EXCEPT_MLPWI = "save_dot_except_mlpwi"
    SAVE_DOT_EXCEPT_MLP = "save_dot_except_mlp"
    SAVE_QKV_PROJ = "save_qkv_proj"
    SAVE_OUT_PROJ = "save_out_proj"
    QKV_PROJ_OFFLOADED = "qkv_proj_offloaded"
    MINIMAL_OFFLOADED = "minimal_offloaded"
    CUSTOM = "custom"


class Attention(enum.StrEnum):
    """Dot attention materialises the score matrix in HBM; flash keeps it in VMEM."""

    DOT = "dot"
    FLASH = "flash"


class FsdpGather(enum.StrEnum):
    """How XLA issues FSDP weight all-gathers (reference/xla.md): `async` start/done pairs
    prefetched one layer ahead (MaxText's async-collective flags), `windowed` collective
    matmuls that overlap the gather with the layer's own matmuls (v5e's windowed einsum: no
    prefetch), `blocking` gathers the compute waits for (v5p's default compile of an FSDP x TP
    program). `mixed-async` and `mixed-blocking` pick the form per weight matrix as XLA's TPU
    compiler does without MaxText's flags (docs/model.md "Collectives as XLA emits them"): a
    gather whose matrix feeds one matmul of the pass is windowed, the others are plain
    gathers, async on v5e (`mixed-async`), blocking on v5p and v6e (`mixed-blocking`);
    gradient reduce-scatters are windowed. With weights replicated over data or sequence
    nothing is windowed (`xla_rules.gather_form`)."""

    ASYNC = "async"
    WINDOWED = "windowed"
    BLOCKING = "blocking"
    MIXED_ASYNC = "mixed-async"
    MIXED_BLOCKING = "mixed-blocking"


class TpActivations(enum.StrEnum):
    """Activations between sublayers replicated over `tensor` (Megatron) or sharded over it
    (MaxText's activation sharding)."""

    SHARDED = "sharded"
    REPLICATED = "replicated"


class TpComm(enum.StrEnum):
    """Tensor-parallel collectives issued blocking, or overlapped with the adjacent matmul
    (collective matmuls, Wang et al.)."""

    BLOCKING = "blocking"
    COLLECTIVE_MATMUL = "collective-matmul"


class DpAllreduce(enum.StrEnum):
    """The data-parallel gradient all-reduce overlapped with the backward, or finished before
    the next layer's backward starts."""

    ASYNC = "async"
    BLOCKING = "blocking"


class FsdpGrad(enum.StrEnum):
    """How weight gradients are summed over fsdp: `auto` is XLA's choice per matrix, a
    reduce-scatter over a group of up to `XLA_MAX_WINDOWED_RING` chips and a synchronous
    all-reduce of the whole gradient above (`xla_rules.grad_kind`)."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    AUTO = "auto"


class DpGradSplit(enum.StrEnum):
    """How the data-parallel gradient all-reduce crosses slices."""

    PER_MATRIX = "per-matrix"
    PER_LAYER = "per-layer"


class EpAlltoall(enum.StrEnum):
    """The MoE all-to-alls synchronous (XLA's default) or async (libtpu's
    --xla_tpu_enable_async_all_to_all)."""

    SYNC = "sync"
    ASYNC = "async"


class MoeDispatch(enum.StrEnum):
    """How an MoE layer's tokens reach the experts over `expert` and their outputs come back:
    all-to-alls, or the tokens all-gathered and the combine's partial sums reduced
    (`xla_rules.moe_dispatch_form`); `auto` is XLA's choice for the program."""

    AUTO = "auto"
    ALL_TO_ALL = "all-to-all"
    ALL_GATHER = "all-gather"


class QuantScales(enum.StrEnum):
    """The scales of an int8 matmul's operands (`quant_scales`): one per row or column along
    the contraction (AQT's default calibration, MaxText's int8) or one per tensor."""

    PER_CHANNEL = "per-channel"
    PER_TENSOR = "per-tensor"


class PipelineSchedule(enum.StrEnum):
    """Pipeline schedules simulated by `sim/engine/pipeline.py` (docs/model.md "Pipeline
    schedules")."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


# The modes' texts, in the order errors list them.
FSDP_GATHER_MODES = tuple(m.value for m in FsdpGather)
FSDP_GRAD_MODES = tuple(m.value for m in FsdpGrad)
DP_GRAD_SPLITS = tuple(m.value for m in DpGradSplit)
PIPELINE_SCHEDULES = tuple(m.value for m in PipelineSchedule)


class Optimizer(enum.StrEnum):
    """The update rule, which decides the optimizer state kept per parameter and the update's
    cost (the state's dtype is `optimizer_dtype`)."""

    # Two moments per parameter (tpu.md §4: bf16 params + two fp32 moments, 10 bytes per
    # parameter); MaxText's default (adamw).
    ADAM = "adam"
    # Plain SGD, no state: w -= lr * g (optax.sgd without momentum; the custom 750B MoE runs of
    # docs/reference/maxtext_runs.json used it, maxtext.md).
    SGD = "sgd"

    @property
    def state_tensors(self) -> int:
        """Parameter-sized tensors of optimizer state."""
        return 2 if self is Optimizer.ADAM else 0

    @property
    def update_flops_per_param(self) -> int:
        # Adam: both moments' EMAs, the bias corrections, sqrt, divide, weight decay and the step
        # (~12 VPU ops per parameter); SGD: one multiply-add.
        return 12 if self is Optimizer.ADAM else 2


def parse_optimizer(text: str) -> Optimizer:
    return parse_choice(Optimizer, text, "optimizer", "an optimizer")


def parse_remat(text: str) -> Remat:
    return parse_choice(Remat, text, "remat", "a remat policy")
