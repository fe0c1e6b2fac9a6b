"""Compile one Transformer training step into an SPMD `Trace` (per-chip ops and collectives).

Per layer: FSDP weight all-gathers, norms, QKV/out/MLP matmuls, rotary, attention (dot or flash),
activations and residuals, tensor-parallel activation all-reduces, expert all-to-alls; the
backward pass (with the remat policy's recomputation), gradient reduce-scatters and data-parallel
all-reduces; embedding, output projection, loss and the Adam update. Pipeline stages, gradient
accumulation and host offload of activations are expressed in the same ops. FLOP counts follow
`tpu.md` §3-§4; HBM occupancy is recorded as categorised allocation events (`meta["memory_events"]`,
saved activations tensor by tensor from `workloads/memory.py`).
"""

from __future__ import annotations

import enum
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh, dcn_hint
from topologies.validate import (
    MAX_BATCH,
    MAX_CHUNKS,
    MAX_TOKENS,
    MAX_TRACE_OPS,
    interval_text,
    parse_choice,
    range_text,
    short_repr,
)
from workloads.memory import (
    LayerShapeSpec,
    MemoryCategory,
    attention_backward_score_buffers,
    attention_temporaries,
    deferred_head_gradient_bytes,
    loss_tensors,
    loss_value_logits_bytes,
    offloaded_tensors,
    one_sequence_per_chip,
    saved_tensors,
    score_exp_fused,
    windowed_head_gradient_bytes,
)
from workloads.models import TransformerSpec
from workloads.moe import MoeConfig, MoeRouting, dispatch_flops, plan_routing
from workloads.trace import OpKind, Trace, TraceBuilder, Unit


class Remat(enum.StrEnum):
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

    @property
    def recomputes_layer(self) -> bool:
        """The backward recomputes the layer's forward matmuls (all but the kept ones)."""
        return self in (Remat.FULL, Remat.QKV_OFFLOAD, Remat.QKVO_OFFLOAD)

    @property
    def kept_projections(self) -> frozenset[str]:
        """Projections whose outputs come back from host memory instead of being recomputed."""
        return {Remat.QKV_OFFLOAD: frozenset({"qkv"}),
                Remat.QKVO_OFFLOAD: frozenset({"qkv", "out"})}.get(self, frozenset())

    @property
    def offloads(self) -> bool:
        return self in (Remat.OFFLOAD, Remat.QKV_OFFLOAD, Remat.QKVO_OFFLOAD)


_DTYPE_BYTES = {"bf16": 2, "fp32": 4, "f32": 4, "int8": 1, "int4": 0.5, "fp8": 1}
# Ops a microbatch adds per layer at the least: 21.75 to 71.75 over a 4-layer model's meshes
# (data, fsdp, tensor, fsdp x tensor), remat policies and attention forms (tests/test_training.py
# checks the bound on them); 8 leaves room for forms not measured.
MIN_OPS_PER_LAYER = 8


# Elementwise ops XLA fuses into an adjacent matmul or norm (rotary into the QKV output,
# residual adds into the following norm): their FLOPs stay on the VPU but they make no HBM trip
# of their own. Norms, the softmax over a materialised score matrix, the MLP activation, the
# loss and the optimizer are fusions of their own that stream through HBM: in XLA's scanned
# programs (benchmarks/xla_memory.py) the SwiGLU product is a loop fusion reading the gate and
# up projections and writing their product, forward and backward (docs/model.md "Training
# steps").
_FUSED = frozenset({
    "rotary", "block_sum", "residual", "residual_attn", "residual_mlp", "rotary_bwd",
})

# How XLA issues FSDP weight all-gathers (reference/xla.md): `async` start/done pairs prefetched
# one layer ahead (MaxText's async-collective flags), `windowed` collective matmuls that overlap
# the gather with the layer's own matmuls (v5e's windowed einsum: no prefetch), `blocking`
# gathers the compute waits for (v5p's default compile of an FSDP x TP program).
# `mixed-async` and `mixed-blocking` pick the form per weight matrix as XLA's TPU compiler does
# without MaxText's flags (docs/model.md "Collectives as XLA emits them"): a gather whose matrix
# feeds one matmul of the pass is windowed, the others are plain gathers, async on v5e
# (`mixed-async`), blocking on v5p and v6e (`mixed-blocking`); gradient reduce-scatters are
# windowed. With weights replicated over data or sequence nothing is windowed.
FSDP_GATHER_MODES = ("async", "windowed", "blocking", "mixed-async", "mixed-blocking")
# The longest ring XLA builds a windowed einsum over: deviceless compiles of the 2-layer
# LLaMA-3-8B-wide step (benchmarks/xla_crosscheck.py FORM_PROBES, `--forms`) window every
# matrix they windowed at fsdp=16 over 32 chips too (v6e 4x8, also with d_model 2048: 64 rows a
# shard), and nothing over 64 (v6e and v5e 8x8, also with d_model 8192: 128 rows a shard) or
# 256 (v6e 16x16): the ring's length decides, not the shard's size. The mixed modes issue
# plain gathers and gradient all-reduces above it (`grad_kind`).
XLA_MAX_WINDOWED_RING = 32
# A weight gradient XLA all-reduces whole is all-reduced on its own, right after the matmul
# that writes it, from this size on; smaller ones are combined into tuple all-reduces that wait
# for the layer's other gradients. Bracketed by deviceless compiles (benchmarks/xla_memory.py,
# v6e fsdp=256): 32 MiB matrices combined (d_model 2048 x d_ff 8192: a layer's 120 MiB in one
# all-reduce), 128 MiB ones alone (d_model 8192: q and o; the 448 MiB MLP matrices too), as
# XLA's all-reduce combiner caps a combined all-reduce's size (none seen over 120 MiB: at
# LLaMA-3-8B widths a 112 MiB gradient goes with one 8 MiB one); 64 MiB is the bracket's
# middle.
XLA_ALLREDUCE_ALONE_BYTES = 64 * 2**20
# How weight gradients are summed over fsdp (`TrainingConfig.fsdp_grad`): `auto` is XLA's
# choice per matrix, a reduce-scatter over a group of up to `XLA_MAX_WINDOWED_RING` chips and a
# synchronous all-reduce of the whole gradient above (`grad_kind_for`).
FSDP_GRAD_MODES = ("reduce-scatter", "all-reduce", "auto")
# How the data-parallel gradient all-reduce crosses slices (`TrainingConfig.dp_grad_split`).
DP_GRAD_SPLITS = ("per-matrix", "per-layer")
# Pipeline schedules simulated by `sim/pipeline.py` (docs/model.md "Pipeline schedules").
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The op that casts the local weight shard to --gather-dtype, once per step.
WEIGHT_CAST = "weight_cast"


class Optimizer(enum.StrEnum):
    """The update rule, which decides the optimizer state kept per parameter and the update's
    cost (the state's dtype is `--optimizer-dtype`)."""

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
    return parse_choice(Optimizer, text, "--optimizer", "an optimizer")


def check_stateless_optimizer(optimizer: str, optimizer_dtypes: tuple[str, ...]) -> None:
    """An optimizer with no state (SGD) takes no --optimizer-dtype but the default: another
    one would change nothing (and repeat every candidate of a plan)."""
    if Optimizer(optimizer).state_tensors or all(
            dtype_bytes(d, "--optimizer-dtype") == _DTYPE_BYTES["fp32"] for d in optimizer_dtypes):
        return
    raise TpusimError(
        f"--optimizer-dtype {short_repr(','.join(optimizer_dtypes))} with --optimizer "
        f"{Optimizer(optimizer).value}: it keeps no optimizer state, so the state's dtype changes "
        f"nothing; drop --optimizer-dtype or use --optimizer adam")


def dtype_bytes(name: str, flag: str) -> float:
    """Bytes per element of the dtype `name` (any case), or the one-line error of `flag`."""
    if not isinstance(name, str):
        raise TpusimError(f"{flag} {short_repr(name)} must be a dtype name; use one of: "
                          f"{', '.join(_DTYPE_BYTES)}")
    try:
        return _DTYPE_BYTES[name.lower()]
    except KeyError:
        raise TpusimError(
            f"{flag} {short_repr(name)} is not a known dtype; use one of: "
            f"{', '.join(_DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """Run settings of one training step (see `tpusim train --help`)."""

    seq_len: int
    batch_per_chip: float
    remat: Remat = Remat.FULL
    attention: str = "flash"
    microbatches: int = 1
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    # The dtype the layers use their weights in: each weight shard is cast to it before its
    # FSDP gather, so gathers, gathered copies and the matmuls' weight reads are in it, while
    # the stored params and their update stay in `param_dtype` (flax's dtype=bfloat16 with
    # param_dtype=float32, MaxText's default). None: the param dtype (no cast).
    gather_dtype: str | None = None
    optimizer_dtype: str = "fp32"
    optimizer: Optimizer = Optimizer.ADAM
    overlap: bool = True
    fsdp_gather: str = "async"
    fuse_elementwise: bool = True
    tp_activations: str = "sharded"
    tp_comm: str = "blocking"
    dp_allreduce: str = "async"
    # How each weight gradient is summed over fsdp: "reduce-scatter" (async, hidden behind
    # the backward; tpusim's default), "all-reduce": the whole gradient all-reduced by a
    # synchronous collective that blocks the core, each chip keeping its shard (XLA's v6e
    # program with async collective fusion and no collective matmuls, docs/model.md), or
    # "auto": per matrix, as XLA chooses by the length of the matrix's FSDP ring
    # (`grad_kind_for`).
    fsdp_grad: str = "reduce-scatter"
    # How the data-parallel gradient all-reduce crosses slices (a data or sequence axis over
    # DCN): "per-matrix", one all-reduce per weight matrix and one for each layer's norm
    # scales, one after another, as XLA compiles it (benchmarks/xla_dcn_schedule.py), or
    # "per-layer", one all-reduce of the layer's gradient shards (tpusim before 2026-12-01).
    dp_grad_split: str = "per-matrix"
    ep_alltoall: str = "sync"
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    moe: MoeConfig = field(default_factory=MoeConfig)
    # The chip's compiler always fuses dot attention's score matmul with the softmax's
    # exponentials (sim/ sets it from ChipSpec.score_exp_fusion: v6e); other chips fuse on
    # some meshes: memory only, see workloads.memory.score_exp_fused.
    score_exp_fusion: bool = False
    # MaxText's `num_vocab_tiling`: the output projection and the loss run over this many
    # chunks of the tokens, and the backward recomputes each chunk's logits (1: no tiling).
    vocab_tiling: int = 1
    # What the chip's compiler keeps at a recomputing dot-attention backward's score gradient
    # (sim/ sets them from ChipSpec.score_grad_fusion: v5e, and ChipSpec.bwd_probs_buffer: v5p):
    # memory only, see workloads.memory.attention_backward_score_buffers.
    score_grad_fusion: bool = False
    bwd_probs_buffer: bool = False
    # With one sequence per chip the chip's compiler schedules the loss value after the
    # backward loop, keeping the f32 logits (sim/ sets it from ChipSpec.loss_after_backward:
    # v5e): memory only, see workloads.memory.loss_value_logits_bytes.
    loss_after_backward: bool = False
    # With windowed weight gathers the chip's compiler runs a layer's MLP weight-gradient
    # rings after the attention's backward (sim/ sets it from
    # ChipSpec.mlp_grad_after_attention: v5e): memory only, see mlp_side_bytes.
    mlp_grad_after_attention: bool = False
    # With windowed weight gathers and weights cast before them the chip's compiler runs the
    # output projection's weight-gradient ring after the backward loop, keeping the logit
    # gradients (sim/ sets it from ChipSpec.head_grad_after_backward: v6e): memory only, see
    # workloads.memory.windowed_head_gradient_bytes.
    head_grad_after_backward: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or not 1 <= self.seq_len <= MAX_TOKENS:
            raise TpusimError(f"--seq-len {short_repr(self.seq_len)} must be "
                              f"{range_text(1, MAX_TOKENS, integer=True)}")
        if not (isinstance(self.batch_per_chip, (int, float)) and 0 < self.batch_per_chip
                <= MAX_BATCH and math.isfinite(self.batch_per_chip)):
            raise TpusimError(
                f"--batch-per-chip {short_repr(self.batch_per_chip)} must be in "
                f"{interval_text(0, MAX_BATCH, lo_open=True)} (sequences per chip)"
            )
        if not isinstance(self.remat, Remat):
            # A policy given as text (the Python API): parsed here, so that a bad one is a
            # one-line error and not an AttributeError deep in the compiler.
            object.__setattr__(self, "remat", parse_remat(self.remat))
        if self.attention not in ("dot", "flash"):
            raise TpusimError(f"--attention {short_repr(self.attention)} must be dot or flash")
        for flag in ("score_exp_fusion", "score_grad_fusion", "bwd_probs_buffer",
                     "loss_after_backward", "mlp_grad_after_attention",
                     "head_grad_after_backward"):
            if not isinstance(getattr(self, flag), bool):
                raise TpusimError(f"{flag} {short_repr(getattr(self, flag))} must be "
                                  f"true or false (the chip's {flag})")
        if isinstance(self.vocab_tiling, bool) or not isinstance(self.vocab_tiling, int) or \
                not 1 <= self.vocab_tiling <= MAX_CHUNKS:
            raise TpusimError(f"--vocab-tiling {short_repr(self.vocab_tiling)} must be "
                              f"{range_text(1, MAX_CHUNKS, integer=True)} (1: no tiling)")
        if not isinstance(self.microbatches, int) or not 1 <= self.microbatches <= MAX_CHUNKS:
            raise TpusimError(f"--microbatches {short_repr(self.microbatches)} must be "
                              f"{range_text(1, MAX_CHUNKS, integer=True)}")
        if self.fsdp_gather not in FSDP_GATHER_MODES:
            raise TpusimError(
                f"--fsdp-gather {short_repr(self.fsdp_gather)} is not a mode; use one of: "
                f"{', '.join(FSDP_GATHER_MODES)}"
            )
        if self.tp_activations not in ("sharded", "replicated"):
            raise TpusimError(
                f"--tp-activations {short_repr(self.tp_activations)} must be sharded or replicated"
            )
        if self.tp_comm not in ("blocking", "collective-matmul"):
            raise TpusimError(
                f"--tp-comm {short_repr(self.tp_comm)} must be blocking or collective-matmul"
            )
        if self.dp_allreduce not in ("async", "blocking"):
            raise TpusimError(
                f"--dp-allreduce {short_repr(self.dp_allreduce)} must be async or blocking"
            )
        if self.dp_grad_split not in DP_GRAD_SPLITS:
            raise TpusimError(
                f"--dp-grad-split {short_repr(self.dp_grad_split)} must be per-matrix (one "
                f"cross-slice all-reduce per weight matrix and one for the norm scales, as XLA "
                f"compiles it, default) or per-layer (one per layer)"
            )
        if self.fsdp_grad not in FSDP_GRAD_MODES:
            raise TpusimError(
                f"--fsdp-grad {short_repr(self.fsdp_grad)} must be reduce-scatter (async, "
                f"default), all-reduce (synchronous, XLA's v6e program without collective "
                f"matmuls) or auto (XLA's choice per matrix: reduce-scatter over up to "
                f"{XLA_MAX_WINDOWED_RING} chips, all-reduce above)"
            )
        if self.fsdp_grad == "all-reduce" and self.fsdp_gather == "windowed":
            raise TpusimError(
                "--fsdp-grad all-reduce with --fsdp-gather windowed: a collective matmul "
                "reduce-scatters the gradient in its ring; use --fsdp-gather async or blocking "
                "with it"
            )
        if self.fsdp_grad == "auto" and self.fsdp_gather == "windowed":
            raise TpusimError(
                f"--fsdp-grad auto with --fsdp-gather windowed: windowed runs every gradient's "
                f"reduce-scatter as a collective-matmul ring at any ring length, where auto "
                f"all-reduces over more than {XLA_MAX_WINDOWED_RING} chips; use --fsdp-gather "
                f"mixed-async or mixed-blocking (XLA's choice of both), async or blocking "
                f"with it"
            )
        if self.fsdp_grad == "all-reduce" and self.fsdp_gather.startswith("mixed"):
            raise TpusimError(
                f"--fsdp-grad all-reduce with --fsdp-gather {self.fsdp_gather}: the mixed modes "
                f"choose each gradient's collective as XLA does (windowed reduce-scatter rings "
                f"up to {XLA_MAX_WINDOWED_RING} chips, synchronous all-reduces above); drop "
                f"--fsdp-grad, or use --fsdp-gather async or blocking with it"
            )
        if self.ep_alltoall not in ("sync", "async"):
            raise TpusimError(
                f"--ep-alltoall {short_repr(self.ep_alltoall)} must be sync (XLA's default) or "
                f"async (libtpu's --xla_tpu_enable_async_all_to_all)"
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise TpusimError(
                f"--pipeline-schedule {short_repr(self.pipeline_schedule)} must be one of "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TpusimError(f"--virtual-stages {short_repr(v)} must be an integer >= 1")
        if v > 1 and self.pipeline_schedule != "interleaved":
            raise TpusimError(
                f"--virtual-stages {v} needs --pipeline-schedule interleaved (gpipe and 1f1b "
                f"hold one chunk of layers per stage); drop it or switch the schedule"
            )
        if not isinstance(self.optimizer, Optimizer):
            parse_optimizer(self.optimizer)
        for flag, v in (("--param-dtype", self.param_dtype), ("--grad-dtype", self.grad_dtype),
                        ("--optimizer-dtype", self.optimizer_dtype)):
            dtype_bytes(v, flag)
        if self.gather_dtype is not None:
            dtype_bytes(self.gather_dtype, "--gather-dtype")
        check_stateless_optimizer(self.optimizer, (self.optimizer_dtype,))

    @property
    def weight_gather_dtype(self) -> str:
        """The dtype weights are gathered and multiplied in (`gather_dtype`, else the params')."""
        return self.param_dtype if self.gather_dtype is None else self.gather_dtype


def parse_remat(text: str) -> Remat:
    return parse_choice(Remat, text, "--remat", "a remat policy")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Dims:
    n: float  # tokens per chip per microbatch (rows of the activations)
    ctx: int  # attention context (full sequence)
    tp: int
    fs: int
    dp: int
    ep: int
    pp: int
    sp: int
    layers: int  # layers on this pipeline stage


def _check_pattern_per_stage(model: TransformerSpec, layers: int, split: str) -> None:
    # Every pipeline chunk compiles the same program (its layers numbered from 0): a mixed
    # local/global pattern must repeat whole within a chunk for that program to be each
    # chunk's.
    period = model.global_layer_period
    if model.attention_window is not None and period and layers % period:
        raise TpusimError(
            f"{split} gives each pipeline chunk {layers} layers, which does not hold whole "
            f"periods of the model's local/global pattern (global_layer_period={period}); pick "
            f"a pipeline size that leaves a multiple of {period} layers per chunk"
        )


def _check_divisible(what: str, value: int, axis: str, size: int, fix: str) -> None:
    if size > 1 and value % size:
        raise TpusimError(
            f"mesh axis {axis}={size} does not divide {what} = {value}; {fix}"
        )


# Compiled traces by compile input, most recently used last. The program depends on the mesh's
# axis sizes only (not their order or placement on the torus, which only the engine's
# collective groups see), so a study's points that differ in ICI bandwidth, in placement or in
# anything else the compiler does not read (every `plan` placement, every `sweep` point of a
# hardware grid) compile once per worker process. A 405B step is ~4k ops (~0.5 MB pickled),
# so 32 traces are a few tens of MB; fewer would thrash on a study cycling through 10 meshes
# and remat policies per hardware point (points run grid-major).
TRACE_CACHE_SIZE = 32
_TRACE_CACHE: OrderedDict[tuple, Trace] = OrderedDict()
_TRACE_LOCK = threading.Lock()


def compile_training_step(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> Trace:
    """The SPMD program of one training step for `num_chips` chips laid out as `mesh` (cached:
    an equal compile input returns an equal trace, on `mesh` itself).

    With a pipeline axis the meta also records the model and the settings
    (`pipeline_compile`), so that a replay of the trace file can compose the stage programs
    the schedule runs (`sim/pipeline.py`)."""
    key = (model, tuple(sorted(mesh.axes)), tuple(sorted(mesh.dcn_axes)), num_chips, config)
    with _TRACE_LOCK:
        hit = _TRACE_CACHE.get(key)
        if hit is not None:
            _TRACE_CACHE.move_to_end(key)
    if hit is None:
        hit = _compiler(model, mesh, num_chips, config).build()
        if mesh.size("pipeline") > 1:
            hit.meta["pipeline_compile"] = {"model": model.to_dict(),
                                            "config": training_config_to_dict(config)}
        with _TRACE_LOCK:
            _TRACE_CACHE[key] = hit
            while len(_TRACE_CACHE) > TRACE_CACHE_SIZE:
                _TRACE_CACHE.popitem(last=False)
    # The ops were validated against these axis names when compiled (the order does not
    # matter to them), so skip `Trace.__post_init__`, a full pass over the ~10k ops of a large
    # model. Ops are frozen and shared; meta gets a copy of its own (a caller may annotate it).
    out = object.__new__(Trace)
    for name, value in (("mesh", mesh), ("ops", hit.ops), ("meta", dict(hit.meta))):
        object.__setattr__(out, name, value)
    return out


def training_config_to_dict(config: TrainingConfig) -> dict:
    """`config` as plain JSON values (`training_config_from_dict` reads it back)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name == "moe":
            v = {g.name: getattr(v, g.name) for g in dataclasses.fields(v)}
        out[f.name] = str(v) if isinstance(v, enum.Enum) else v
    return out


def training_config_from_dict(data: dict, *, source: str = "trace") -> TrainingConfig:
    """The `TrainingConfig` written by `training_config_to_dict` (validated as on the CLI)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(TrainingConfig)}
    if not isinstance(data, dict) or not set(data) <= names or "seq_len" not in data:
        raise TpusimError(
            f"{source}: the recorded training settings are not a TrainingConfig; recompile the "
            f"trace with tpusim compile"
        )
    kw = dict(data)
    try:
        kw["remat"] = parse_remat(str(kw.get("remat", "full")))
        kw["moe"] = MoeConfig(**kw.get("moe", {}))
        return TrainingConfig(**kw)
    except TypeError as exc:
        raise TpusimError(
            f"{source}: the recorded training settings do not load ({exc}); recompile the trace "
            f"with tpusim compile"
        ) from None


def estimate_training_memory(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> dict[str, float]:
    """The compiler's HBM estimate per chip without building the trace (what `plan` prunes
    with): `static_bytes` (params and optimizer state; gradients are backward temporaries) and
    `activations_bytes` (saved activations at their peak, when the forward ends; together a
    lower bound of the step's peak), the same numbers as the trace's `static_hbm_bytes` and
    `activation_bytes_estimate`. Raises the compiler's errors for a mesh that cannot run."""
    c = _compiler(model, mesh, num_chips, config)
    p_local = c.local_params()
    return {"static_bytes": p_local * (c.wb + c.state_bytes_per_param),
            "activations_bytes": c.activation_peak()}


def _compiler(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> _Compiler:
    tp, fs, dp = mesh.size("tensor"), mesh.size("fsdp"), mesh.size("data")
    ep, pp, sp = mesh.size("expert"), mesh.size("pipeline"), mesh.size("sequence")
    if mesh.num_ici_devices * mesh.num_slices != num_chips:
        raise TpusimError(
            f"mesh {mesh.describe()} covers {mesh.num_ici_devices * mesh.num_slices} chips but "
            f"the pod has {num_chips}; make the mesh axes multiply to {num_chips}"
            + dcn_hint(mesh, num_chips)
        )
    _check_divisible("num_heads", model.num_heads, "tensor", tp,
                     "pick a tensor size that divides the head count")
    _check_divisible("d_ff", model.d_ff, "tensor", tp, "pick a tensor size that divides d_ff")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise TpusimError(
            f"mesh axis tensor={tp} neither divides nor is a multiple of num_kv_heads = "
            f"{model.num_kv_heads}; pick a tensor size compatible with the KV heads"
        )
    _check_divisible("seq_len", config.seq_len, "sequence", sp,
                     "pick a sequence size that divides --seq-len")
    _check_divisible("num_layers", model.num_layers, "pipeline", pp,
                     "pick a pipeline size that divides the layer count")
    _check_pattern_per_stage(model, model.num_layers // pp, f"pipeline={pp}")
    if ep > 1:
        if not model.is_moe:
            raise TpusimError(
                f"mesh axis expert={ep} needs an MoE model, but {model.name} is dense; drop expert"
            )
        _check_divisible("num_experts", model.num_experts, "expert", ep,
                         "pick an expert size that divides the expert count")
    global_seqs = config.batch_per_chip * num_chips
    if abs(global_seqs - round(global_seqs)) > 1e-9:
        raise TpusimError(
            f"--batch-per-chip {config.batch_per_chip} x {num_chips} chips is not a whole number "
            f"of sequences; change the batch"
        )
    global_seqs = int(round(global_seqs))
    if global_seqs < 1:  # a tiny positive value (1e-320) is within the tolerance of 0
        raise TpusimError(
            f"--batch-per-chip {config.batch_per_chip:g} x {num_chips} chips is under one "
            f"sequence; give at least 1/{num_chips} = {1 / num_chips:g} (one sequence per pod)"
        )
    batch_shards = dp * fs * ep
    if global_seqs % batch_shards:
        raise TpusimError(
            f"the global batch of {global_seqs} sequences is not divisible by data x fsdp x "
            f"expert = {batch_shards}; change --batch-per-chip or the mesh"
        )
    local_seqs = global_seqs // batch_shards
    if local_seqs % config.microbatches:
        raise TpusimError(
            f"--microbatches {config.microbatches} does not divide the {local_seqs} sequences "
            f"each data shard holds; pick a divisor of {local_seqs}"
        )
    # Each microbatch repeats its layers' forward and backward ops in the program (a pipeline
    # stage's program: the stage's layers): at least MIN_OPS_PER_LAYER each, so a count no
    # program of MAX_TRACE_OPS holds is refused before anything is built (LLaMA-3-405B at
    # --microbatches 64 built 404,098 ops in 17 CPU-s, and 4,096 would not have finished).
    layers = model.num_layers // pp
    least = config.microbatches * layers * MIN_OPS_PER_LAYER
    if least > MAX_TRACE_OPS:
        where = " per pipeline stage" if pp > 1 else ""
        raise TpusimError(
            f"--microbatches {config.microbatches} x {layers} layers{where} compiles to at least "
            f"{least:,} ops ({MIN_OPS_PER_LAYER} per layer and microbatch), over the "
            f"{MAX_TRACE_OPS:,} tpusim simulates in one program; use at most "
            f"{max(MAX_TRACE_OPS // (layers * MIN_OPS_PER_LAYER), 1):,} microbatches"
        )
    config.moe.check_model(model)
    if config.ep_alltoall == "async" and ep == 1:
        # Only the all-to-alls over an expert axis overlap: without one the flag changes
        # nothing, like --capacity-factor on a dense model.
        why = f"{model.name} is dense" if not model.is_moe else "the mesh has no expert axis"
        raise TpusimError(
            f"--ep-alltoall async overlaps the MoE all-to-alls over the expert axis, and this "
            f"run has none ({why}); drop --ep-alltoall"
            + ("" if not model.is_moe else " or add expert=N to the mesh"))
    loss_rows = local_seqs * config.seq_len / sp / config.microbatches
    if config.vocab_tiling > 1 and loss_rows % config.vocab_tiling:
        raise TpusimError(
            f"--vocab-tiling {config.vocab_tiling} does not divide the {loss_rows:g} tokens each "
            f"chip's loss processes per microbatch; pick a divisor of {loss_rows:g}"
        )
    d = _Dims(
        n=local_seqs * config.seq_len / sp / config.microbatches,
        ctx=config.seq_len,
        tp=tp, fs=fs, dp=dp, ep=ep, pp=pp, sp=sp,
        layers=model.num_layers // pp,
    )
    return _Compiler(model, mesh, d, config, num_chips, global_seqs)


def compile_pipeline_chunk(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig, *,
    first: bool, last: bool,
) -> Trace:
    """One microbatch through one pipeline chunk (num_layers / (pipeline x virtual_stages)
    layers): its forward, its backward and the stage's optimizer update, without
    stage-to-stage sends (the schedule simulation adds them). `first` holds the embedding,
    `last` the output projection and the loss."""
    import dataclasses

    pp, v = mesh.size("pipeline"), config.virtual_stages
    if model.num_layers % (pp * v):
        raise TpusimError(
            f"num_layers = {model.num_layers} is not divisible by pipeline x virtual stages = "
            f"{pp} x {v}; pick sizes whose product divides the layer count"
        )
    _check_pattern_per_stage(model, model.num_layers // (pp * v),
                             f"pipeline={pp} x virtual stages={v}")
    c = _compiler(model, mesh, num_chips, dataclasses.replace(config, microbatches=1))
    # One microbatch of the real microbatch size, through num_layers / (pp x V) layers.
    c.d = dataclasses.replace(c.d, n=c.d.n / config.microbatches,
                              layers=model.num_layers // (pp * v))
    c.embed_on, c.head_on, c.sends_on = first, last, False
    c.cast_per_pass = False
    return c.build()


@dataclass(slots=True)
class _Gathered:
    """The FSDP all-gathers of one layer's weights for one pass: matrix -> (op id, form)."""

    ops: dict[str, tuple[int, str]] = field(default_factory=dict)
    held_bytes: float = 0.0  # HBM the non-windowed gathers hold until the layer ends
    held: dict[str, float] = field(default_factory=dict)  # held_bytes by matrix

    def release(self, keys) -> float:
        """Bytes of the `keys` matrices still held, now released."""
        out = sum(self.held.pop(k, 0.0) for k in keys)
        self.held_bytes -= out
        return out

    def deps(self, keys) -> list[int]:
        """The gathers a matmul reading `keys` waits for (a windowed one streams its shards
        through the matmul itself)."""
        return sorted({self.ops[k][0] for k in keys if k in self.ops
                       and self.ops[k][1] != "windowed"})

    def windowed_keys(self, keys) -> set[str]:
        """The `keys` matrices this pass gathers by a windowed einsum."""
        return {k for k in keys if k in self.ops and self.ops[k][1] == "windowed"}

    def windowed(self, keys) -> bool:
        return bool(self.windowed_keys(keys))

    def ids(self, form: str | None = None) -> list[int]:
        return sorted({i for i, f in self.ops.values() if form is None or f == form})


# The weight matrices each weight matmul of a layer reads (FSDP gathers one per matrix).
_ATTN_KEYS = ("wq", "wk", "wv", "wo")
# Re-gathers XLA issues for the input-gradient matmuls of the query and key projections under
# remat full (the recomputation's copies are not kept alive across the layer's backward); in an
# MoE layer, whose backward holds the experts' buffers in between, of all four attention
# matrices (the compiled MoE step of benchmarks/xla_crosscheck.py).
_REGATHER_KEYS = ("wq_dx", "wk_dx")
_MOE_REGATHER_KEYS = ("wq_dx", "wk_dx", "wv_dx", "wo_dx")
# The up projection's weight gradient is computed by one dot merged with the gate's (XLA's dot
# merger: they share the layer input); an unrolled ring reduce-scatters both from one start.
_SHARES_GATE_RING = frozenset({"w_up", "expert_up", "shared_up"})
_ROW_PARALLEL = frozenset({"wo", "w_down", "expert_down", "shared_down"})


class _Compiler:
    # Which parts of the step this program holds (a pipeline chunk holds fewer).
    embed_on = True
    head_on = True
    sends_on = True
    # The weight cast (--gather-dtype) runs before the first forward of a whole step. A
    # pipeline chunk's forward is copied per microbatch and chunk (sim/pipeline.py), while a
    # stage casts its weights once per step: the chunk holds it after its update instead.
    cast_per_pass = True

    def __init__(self, model, mesh, d: _Dims, cfg: TrainingConfig, num_chips, global_seqs):
        self.m = model
        self.mesh = mesh
        self.d = d
        self.cfg = cfg
        self.num_chips = num_chips
        self.global_seqs = global_seqs
        self.b = TraceBuilder(fix=f"--microbatches {cfg.microbatches} x {model.num_layers} "
                                  f"layers build it: use fewer microbatches or layers")
        # Stored params (and their update) in --param-dtype; what the layers gather and read
        # in --gather-dtype (the cast of each shard before its gather, `weight_cast`).
        self.wb = dtype_bytes(cfg.param_dtype, "--param-dtype")
        self.wc = dtype_bytes(cfg.weight_gather_dtype, "--gather-dtype")
        self.gb = dtype_bytes(cfg.grad_dtype, "--grad-dtype")
        # The local gradient shards are held in the params' dtype when the weights are cast for
        # their gathers: the scanned backward writes each layer's reduce-scattered gradient into
        # a stacked gradient of the params' dtype (f32 in the v5e and v6e fsdp=16 scanned
        # compiles with f32 weights; benchmarks/xla_memory.py `*_f32params`).
        self.gh = self.wb if self.wc != self.wb else self.gb
        self.ob = dtype_bytes(cfg.optimizer_dtype, "--optimizer-dtype")
        self.opt = Optimizer(cfg.optimizer)
        # Optimizer state per parameter (the moments, in --optimizer-dtype).
        self.state_bytes_per_param = self.opt.state_tensors * self.ob
        self.act = 2.0  # activations in bf16
        # Router skew and capacity (workloads/moe.py): a routing group is one sequence's local
        # shard, as MaxText computes expert capacity per sequence.
        self.routing: MoeRouting | None = (
            plan_routing(model, d.ep, cfg.seq_len // d.sp, cfg.moe) if model.is_moe else None
        )
        self.mem_events: list[list] = []  # [op id, MemoryCategory, +alloc / -free bytes]
        # Live ends of a recomputed layer besides the op layer_forward returns (ops whose
        # outputs only the backward reads, e.g. the recomputed attention when its output
        # projection came back from host memory).
        self.recompute_leaves: list[int] = []
        self.mlp_weights_done: int | None = None  # set by layer_backward
        # The attention's weight-gradient matmuls (set by layer_backward): the op before the
        # score gradient that writes the output and value projections' gradients (XLA computes
        # them first: they need no score gradient), and the one that writes the q and k ones.
        self.attn_early_grads_done: int | None = None
        self.attn_weights_done: int | None = None
        self.router_grad_done: int | None = None  # an MoE layer's router backward
        # The bf16 probabilities a recomputation writes for the backward (v5p under full),
        # held from its softmax to the layer's value-gradient matmul.
        self.bwd_probs_bytes = 0.0
        self.last_matmul: int | None = None  # the op the latest mm() emitted for its matmul

    def mem(self, op_id, category: MemoryCategory, delta: float) -> None:
        """HBM changes by `delta` bytes of `category` when op `op_id` ends."""
        if op_id is None or delta == 0:
            return
        op = self.b.ops[op_id]
        if delta > 0:
            self.b.ops[op_id] = _with(op, alloc_bytes=op.alloc_bytes + delta)
        else:
            self.b.ops[op_id] = _with(op, free_bytes=op.free_bytes - delta)
        self.mem_events.append([op_id, str(category), float(delta)])

    # -- helpers ----------------------------------------------------------------------------
    # The FSDP gathers of the layer being emitted (None outside the layers or without fsdp).
    cur: _Gathered | None = None

    def mm(self, name, flops, w_bytes, in_bytes, out_bytes, deps, layer, phase, narrow_dim=0,
           keys=(), whole_bytes=0.0, acc_bytes=0.0):
        """A weight matmul (or, without `w_bytes`, an activation matmul) on the MXU.

        Run as a windowed einsum of N ring steps (its matrices' gather or its gradient's
        reduce-scatter is windowed; docs/model.md "A windowed einsum"): `whole_bytes` is the
        part of `in_bytes` read whole by every pair of steps (activation operands without the
        FSDP-sharded dimension), `acc_bytes` the outputs summed over the steps (where the
        sharded dimension is contracted); the rest of the operands is read a 1/N slice a step,
        once in all, and the output is written once. Either may be a dict matrix -> bytes
        (a merged matmul whose matrices' gathers differ in form: only the windowed ones
        count)."""
        # Ring length of the windowed einsum the matmul runs as (1: plain): its matrices' gather
        # is windowed, or (a weight gradient) its reduce-scatter is.
        n = 1
        windowed: set[str] = set()
        if self.cur is not None and keys:
            if name.endswith("_weights"):
                windowed = {k for k in keys if self.rs_windowed_for(self.fsdp_group(k)[1])}
            else:
                windowed = self.cur.windowed_keys(keys)
            # The ring runs over the windowed matrices' group (a merged matmul may hold
            # matrices of the non-expert group that are not windowed).
            n = max(self.fsdp_group(k)[1] for k in windowed) if windowed else 1

        def part(x) -> float:
            if isinstance(x, dict):
                return sum(v for k, v in x.items() if k in windowed)
            return x
        if self.cur is not None and keys and not name.endswith("_weights"):
            deps = list(deps) + self.cur.deps(keys)
        if n > 1 and w_bytes > 0:
            # A windowed einsum (collective matmul) runs as N ring steps, one weight shard
            # each; XLA's ring is bidirectional and each matmul fusion takes the two shards
            # that arrived from either side (the HLO of benchmarks/xla_crosscheck.py's
            # fsdp_v6e16_b4, whose loop buffers are in HBM). Where the sharded dimension is
            # contracted (forward q, k, v, gate, up; the input gradients of o and down) a pair
            # reads the activation's two slices along it (once in all) and its product joins
            # the partial sum: per loop trip of 4 steps one fusion writes the first pair's
            # product and the next reads it and the partial sum and writes their sum with the
            # second pair's, one output's worth of traffic per step, N in all. Where the
            # sharded dimension is the output's (forward o and down; the input gradients of q,
            # k, v, gate, up) or the weight gradient's, every pair reads the operand without
            # it whole (N / 2 reads) and writes its slices in place.
            in_bytes += max(n / 2 - 1, 0) * part(whole_bytes)
            out_bytes += (n - 1) * part(acc_bytes)
        op = self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.MXU, flops=flops,
                        hbm_bytes=w_bytes + in_bytes + out_bytes, deps=deps, layer=layer,
                        phase=phase, narrow_dim=narrow_dim)
        self.last_matmul = op
        if n > 1 and w_bytes > 0 and name.endswith("_weights"):
            # A weight gradient (dW) whose reduce-scatter is a windowed ring: the gradient is
            # complete once its ring accumulators are.
            return self.ring_accumulators(name, op, w_bytes, layer, phase)
        return op

    def ring_accumulators(self, name, dep, w_bytes, layer, phase) -> int:
        """The accumulator traffic of a weight gradient's windowed reduce-scatter (a collective
        matmul), as the fusion of its own XLA runs it as, after the dW matmul (`NAME_accum`).

        `w_bytes` is the gathered matrices' size at the gather dtype; the accumulators hold
        the gradient's dtype (bf16 in XLA's programs: the add is done in f32 and converted
        back). In XLA's `windowed_dot_general_body_rs` loop (bidirectional ring, unrolled by
        2) every ring step's add fusion reads the partial sum arriving from the ring and the
        step's partial product and writes their sum (3 shards of |W| / N), and a select that
        zeroes the accumulators on the first step reads and writes each of the two accumulators
        once per two steps (1 shard per step): 4 x |W| bytes over the N steps, one add per
        gradient element (docs/model.md "Training steps")."""
        g = w_bytes / self.wc * self.gb
        return self.vpu(f"{name}_accum", w_bytes / self.wc, 4.0 * g, [dep], layer, phase)

    def vpu(self, name, flops, nbytes, deps, layer, phase, **kw):
        base = name.removeprefix("re-")
        if self.cfg.fuse_elementwise and base in _FUSED:
            # XLA fuses this elementwise op into the neighbouring matmul or norm fusion: its
            # FLOPs stay on the VPU but its operands never make a separate trip through HBM.
            nbytes = 0.0
        return self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.VPU, flops=flops,
                          hbm_bytes=nbytes, deps=deps, layer=layer, phase=phase, **kw)

    def coll(self, name, kind, axes, nbytes, deps, layer, phase, **kw):
        axes = tuple(a for a in axes if self.mesh.size(a) > 1)
        if not axes or nbytes <= 0:
            return None
        return self.b.add(name, kind=OpKind.COLLECTIVE, collective=kind, mesh_axes=axes,
                          bytes=float(nbytes), deps=deps, layer=layer, phase=phase, **kw)

    # -- tensor parallelism ------------------------------------------------------------------
    # Activations between sublayers are either replicated over `tensor` (Megatron; XLA then
    # all-reduces each sublayer's output, reference/xla.md) or sharded over it (MaxText's
    # activation sharding: an all-gather before each sublayer's first matmul and a reduce-scatter
    # after its last, the same bytes on the wire, 1/tp of the norms and saved activations).
    # `collective-matmul` overlaps those collectives with the adjacent matmul (Wang et al.).
    @property
    def tp_sharded(self) -> bool:
        return self.cfg.tp_activations == "sharded" and self.d.tp > 1

    @property
    def tp_overlap(self) -> bool:
        return self.cfg.tp_comm == "collective-matmul"

    def rows(self) -> float:
        """Rows of the residual stream each chip holds (norms, residual adds, saved inputs)."""
        return self.d.n / self.d.tp if self.tp_sharded else self.d.n

    def tp_enter(self, tag, name, dep, layer, phase) -> tuple[list[int], list[int]]:
        """Before a sublayer's first matmul: (deps for the matmul, deps for its consumer)."""
        if not self.tp_sharded:
            return [], []
        ag = self.coll(f"{tag}tp_allgather_{name}", "all-gather", ("tensor",),
                       self.d.n * self.m.d_model * self.act, [dep], layer, phase)
        if ag is None:
            return [], []
        return ([], [ag]) if self.tp_overlap else ([ag], [])

    def tp_exit(self, tag, name, mm_id, last_matmuls, layer, phase) -> list[int]:
        """After a sublayer's last matmul: deps for the residual that consumes its output.

        With collective matmuls the reduction starts when the last matmul(s) producing its
        input can start (their own dependencies), and runs alongside them."""
        kind = "reduce-scatter" if self.tp_sharded else "all-reduce"
        short = "reducescatter" if self.tp_sharded else "allreduce"
        if self.tp_overlap:
            start = sorted({d for op in last_matmuls for d in self.b.ops[op].deps})
        else:
            start = [mm_id]
        c = self.coll(f"{tag}tp_{short}_{name}", kind, ("tensor",),
                      self.d.n * self.m.d_model * self.act, start, layer, phase)
        return [mm_id] + ([c] if c is not None else [])

    # -- per-layer shapes -------------------------------------------------------------------
    def layer_weight_bytes(self, moe: bool) -> float:
        """bf16 matmul weights one tensor shard gathers for a layer (V of the FSDP gather)."""
        m, d = self.m, self.d
        att = m.attention_params_per_layer / d.tp
        if moe:
            routed = m.num_experts * m.mlp.num_matrices * m.d_model * m.expert_d_ff
            shared = m.moe_mlp_params_per_layer - m.router_params_per_layer - routed
            mlp = routed / (d.tp * d.ep) + shared / d.tp + m.router_params_per_layer
        else:
            mlp = m.dense_mlp_params_per_layer / d.tp
        return (att + mlp) * self.wc

    def layer_expert_weight_bytes(self, layer: int) -> float:
        """The routed experts' share of `layer_weight_bytes` (sharded over `expert`)."""
        if not self.layer_is_moe(layer):
            return 0.0
        m, d = self.m, self.d
        routed = m.num_experts * m.mlp.num_matrices * m.d_model * m.expert_d_ff
        return routed / (d.tp * d.ep) * self.wc

    @property
    def dp_split_per_matrix(self) -> bool:
        """The data-parallel gradient all-reduce goes as one all-reduce per weight matrix and
        one for each layer's norm scales (`TrainingConfig.dp_grad_split`): across slices only
        (a data or sequence axis over DCN), where XLA compiles it so; within a slice it stays
        one per layer."""
        return self.cfg.dp_grad_split == "per-matrix" and (
            self.mesh.dcn_size("data") > 1 or self.mesh.dcn_size("sequence") > 1)

    def layer_norm_grad_bytes(self) -> float:
        """Gradients of one layer's norm scales, f32 (`norm_grad_bytes`)."""
        return self.m.norm_params_per_layer * 4

    def norm_grad_bytes(self) -> float:
        """Gradients of the norm scales this pipeline stage holds (replicated parameters), in
        f32: the norms compute in f32, and XLA's all-reduce of these gradients takes f32
        operands (converting to the parameter dtype after the reduction)."""
        return self.m.num_norm_params / self.d.pp * 4

    def layer_is_moe(self, layer: int) -> bool:
        return self.m.is_moe and layer >= self.m.first_dense_layers

    def regather_keys(self, layer: int) -> tuple[str, ...]:
        """The attention matrices XLA gathers a second time for their input gradients."""
        return _MOE_REGATHER_KEYS if self.layer_is_moe(layer) else _REGATHER_KEYS

    # MaxText's logical-axis rules shard a weight's `embed` dimension over fsdp and expert, except
    # the routed experts' (`embed_no_exp`: their own `exp` dimension takes the expert axis), so
    # the attention, router, shared-expert, dense-MLP and embedding weights are gathered from,
    # and their gradients reduce-scattered over, fsdp x expert (docs/model.md "MoE routing").
    def fsdp_group(self, key: str) -> tuple[tuple[str, ...], int]:
        """(mesh axes, chips) a weight matrix is FSDP-sharded over."""
        if key.startswith("expert"):
            return ("fsdp",), self.d.fs
        return ("fsdp", "expert"), self.d.fs * self.d.ep

    @property
    def fsdp_shards(self) -> int:
        """FSDP shards of the non-expert weights (fsdp x expert)."""
        return self.d.fs * self.d.ep

    def mlp_keys(self, layer: int) -> tuple[str, ...]:
        """The MLP's weight matrices (routed and shared experts and the router in an MoE
        layer)."""
        gated = self.m.mlp.num_matrices == 3
        if not self.layer_is_moe(layer):
            return ("w_gate", "w_up", "w_down") if gated else ("w_up", "w_down")
        keys = ["router"] + (["expert_gate"] if gated else []) + ["expert_up", "expert_down"]
        if self.m.num_shared_experts:
            keys += (["shared_gate"] if gated else []) + ["shared_up", "shared_down"]
        return tuple(keys)

    def layer_matrices(self, layer: int) -> list[tuple[str, float]]:
        """(matrix, bytes one tensor shard gathers) for each weight matrix of a layer; they sum
        to `layer_weight_bytes`."""
        m, d, wb = self.m, self.d, self.wc
        D, hd = m.d_model, m.head_dim
        q, kv = D * m.num_heads * hd / d.tp * wb, D * m.num_kv_heads * hd / d.tp * wb
        out = [("wq", q), ("wk", kv), ("wv", kv), ("wo", q)]
        if not self.layer_is_moe(layer):
            return out + [(k, D * m.d_ff / d.tp * wb) for k in self.mlp_keys(layer)]
        routed = D * m.expert_d_ff * m.num_experts / (d.tp * d.ep) * wb
        shared = (m.moe_mlp_params_per_layer - m.router_params_per_layer
                  - m.num_experts * m.mlp.num_matrices * D * m.expert_d_ff)
        per_shared = shared / m.mlp.num_matrices / d.tp * wb
        for k in self.mlp_keys(layer):
            out.append((k, m.router_params_per_layer * wb if k == "router" else
                        routed if k.startswith("expert") else per_shared))
        return out

    @property
    def weights_replicated(self) -> bool:
        """The weights are replicated over a mesh axis (data or sequence): a weight operand is
        then sharded over fewer chips than the program has."""
        return self.d.dp > 1 or self.d.sp > 1

    def rs_windowed_for(self, group: int) -> bool:
        """Gradient reduce-scatters over an FSDP group of `group` chips run as windowed rings
        (collective matmuls). In the mixed modes (XLA's own choice) only when the weights are
        sharded over every chip: XLA's SPMD partitioner builds a windowed einsum only for an
        operand split over all the program's partitions (the v6e data=4 x fsdp=4 program has
        none, docs/model.md), and over at most `XLA_MAX_WINDOWED_RING` chips."""
        if self.cfg.fsdp_gather.startswith("mixed") and (
                self.weights_replicated or group > XLA_MAX_WINDOWED_RING):
            return False
        return self.cfg.overlap and self.cfg.fsdp_gather in (
            "windowed", "mixed-async", "mixed-blocking")

    @property
    def forward_windowed(self) -> bool:
        """Some weight of the layers' forward is gathered by a windowed einsum."""
        return self.d.fs * self.d.ep > 1 and any(
            self.gather_form(layer, key, "fwd") == "windowed"
            for layer in range(self.d.layers)
            for key, _ in self.layer_matrices(layer))

    @property
    def rs_windowed(self) -> bool:
        """`rs_windowed_for` the non-expert weights' group (fsdp x expert)."""
        return self.rs_windowed_for(self.fsdp_shards)

    def grad_kind_for(self, group: int) -> str:
        """The collective that reduces a weight gradient over its FSDP group of `group` chips: a
        reduce-scatter, or, in the mixed modes over more chips than XLA windows
        (`XLA_MAX_WINDOWED_RING`), an all-reduce of the whole gradient, as XLA compiles it there
        (the fsdp=64 and fsdp=256 programs of benchmarks/xla_crosscheck.py `--forms` reduce
        every gradient that way, several per synchronous all-reduce, and the update slices its
        shard out): twice a reduce-scatter's ring traffic, and the next layer's backward waits
        for it. Each matrix by its own group: in a deviceless v6e compile of the 750B MoE
        (fsdp=16 x expert=16, `benchmarks/xla_moe_schedule.py --size 750b`) XLA all-reduces the
        gradients of the weights split 256 ways (attention, router) and reduces the routed
        experts' (split over fsdp=16) in rings. `--fsdp-grad all-reduce` asks for the
        synchronous all-reduce in any mode it allows, `--fsdp-grad auto` for this per-matrix
        choice with any gather mode it allows (`TrainingConfig.fsdp_grad`)."""
        if self.cfg.fsdp_grad == "all-reduce":
            return "all-reduce"
        if (self.cfg.fsdp_grad == "auto" or (self.cfg.fsdp_gather.startswith("mixed")
                                             and self.cfg.overlap)) \
                and group > XLA_MAX_WINDOWED_RING:
            return "all-reduce"
        return "reduce-scatter"

    @property
    def grad_kind(self) -> str:
        """`grad_kind_for` the non-expert weights' group (fsdp x expert)."""
        return self.grad_kind_for(self.fsdp_shards)

    @property
    def plain_gather_form(self) -> str:
        """How a weight gather that is no windowed einsum is issued: async or blocking (or
        windowed, when every gather is asked to be)."""
        if not self.cfg.overlap:
            return "blocking"
        return {"mixed-async": "async", "mixed-blocking": "blocking"}.get(
            self.cfg.fsdp_gather, self.cfg.fsdp_gather)

    def gather_form(self, layer: int, key: str, phase: str) -> str:
        """How the FSDP gather of one matrix for one pass is issued: async, windowed or
        blocking.

        The mixed modes follow XLA's choice (docs/model.md): a windowed einsum needs the
        gathered matrix to feed exactly one matmul of the pass (forward: its projection;
        backward under remat full: the recomputation and the input gradient both read it,
        except the MLP's down projection, whose recomputation is dead; without remat only the
        input gradient reads it) and, with a tensor axis, not a row-parallel matmul whose
        output is then reduced over `tensor` (forward); the other matrices are plain gathers."""
        plain = self.plain_gather_form
        if not self.cfg.overlap or not self.cfg.fsdp_gather.startswith("mixed-"):
            return plain
        if key.endswith("_dx") or self.weights_replicated \
                or self.fsdp_group(key)[1] > XLA_MAX_WINDOWED_RING:
            return plain
        if phase == "fwd":
            single = not (self.d.tp > 1 and key in _ROW_PARALLEL)
        elif self.cfg.remat.recomputes_layer:
            # Matrices the recomputation does not read: its dead last matmuls (a dense MLP's
            # down projection, a shared expert's, a parallel block's attention output) and
            # the projections whose outputs come back from host memory.
            kept = self.cfg.remat.kept_projections
            single = (key in ("w_down", "shared_down")
                      or (key == "wo" and (self.m.parallel_block or "out" in kept))
                      or (key in ("wq", "wk", "wv") and "qkv" in kept))
        else:
            single = True
        return "windowed" if single else plain

    # -- forward ----------------------------------------------------------------------------
    def check_program_size(self, start: int, per_mb: int) -> None:
        """Refuse the step once its first microbatch is built (`per_mb` ops, from op `start`)
        if every microbatch cannot fit one program. Each later microbatch adds at least as many
        ops as the first (tests/test_training.py checks it: the middle ones add exactly as
        many, the last one its gradient reductions more), so `start + microbatches x per_mb` is
        a lower bound of the program: a step over the limit costs one microbatch's build, not
        the limit's (LLaMA-3-405B at --microbatches 248, inside MIN_OPS_PER_LAYER's estimate,
        built 250,000 ops in 3.8 CPU-s before the builder refused it)."""
        mbs, limit = self.cfg.microbatches, self.b.max_ops
        least = start + mbs * per_mb
        if least <= limit:
            return
        # The last microbatch adds its gradient reductions (under one microbatch's ops):
        # one microbatch less than would fit leaves room for them.
        fit = max((limit - start) // per_mb - 1, 1)
        where = " per pipeline stage" if self.d.pp > 1 else ""
        raise TpusimError(
            f"--microbatches {mbs} x {self.d.layers} layers{where} compiles to at least "
            f"{least:,} ops ({per_mb:,} per microbatch, counted on the first), over the "
            f"{limit:,} tpusim simulates in one program; "
            + (f"use at most {fit:,} microbatches" if fit > 1 else "use --microbatches 1"))

    def layer_forward(self, layer, deps, gather, phase="fwd", recompute=False):
        """Ops of one layer's forward; returns the id of its output."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        hd, H, K = m.head_dim, m.num_heads, m.num_kv_heads
        k_loc = max(K / tp, 1.0)
        h_loc = H / tp
        self.cur = gather
        wdeps: list[int] = []  # the matmuls wait for their own matrices' gathers (`mm` keys)
        tag = "re-" if recompute else ""
        # Under a recomputing remat policy the backward reads the recomputed activations, not
        # the layer's output: the layer's last matmul(s) (the MLP's down projection, also the
        # attention output projection of a parallel block) and what follows them (their
        # reduction over `tensor`, the residual adds) are dead code XLA removes (docs/model.md
        # "Remat"; the imported HLO programs of docs/validation.md recompute every matmul but
        # those). Projections the policy brought back from host memory are not recomputed.
        kept = self.cfg.remat.kept_projections if recompute else frozenset()
        x = deps
        r = self.rows()
        # A norm reads its input twice (statistics, then the normalised rows) and writes once;
        # the forward of a scanned stack also copies the layer input into the saved stack.
        norm = self.vpu(f"{tag}norm_attn", 5 * r * D,
                        (3 + (2 if not recompute else 0)) * r * D * a, x, layer, phase)
        mm_deps, after = self.tp_enter(tag, "attn", norm, layer, phase)
        qkv_w = D * (H + 2 * K) * hd / tp
        if "qkv" in kept:
            qkv = norm  # q, k, v came back from host memory (a dependency of the layer input)
        else:
            qkv = self.mm(f"{tag}qkv_proj", 2 * n * D * (h_loc + 2 * k_loc) * hd,
                          qkv_w * self.wc, n * D * a, n * (h_loc + 2 * k_loc) * hd * a,
                          [norm] + wdeps + mm_deps, layer, phase, keys=("wq", "wk", "wv"),
                          acc_bytes=n * (h_loc + 2 * k_loc) * hd * a)
        if m.qk_norm:
            # RMSNorm over head_dim of every query and key head (Gemma 3): a norm fusion of
            # its own, as the pre-norms are (reads twice, writes once).
            qkv = self.vpu(f"{tag}qk_norm", 5 * n * (h_loc + k_loc) * hd,
                           3 * n * (h_loc + k_loc) * hd * a, [qkv], layer, phase)
        rope = self.vpu(f"{tag}rotary", 6 * n * (h_loc + k_loc) * hd,
                        2 * n * (h_loc + k_loc) * hd * a, [qkv] + after, layer, phase)
        att = self.attention_forward(layer, rope, phase, tag)
        if m.parallel_block:
            if recompute:
                # Both branches' last matmuls feed only the (dead) layer output.
                mlp_live = self.mlp_forward(layer, norm, wdeps, phase, tag, after, dead_tail=True)
                self.recompute_leaves.append(att)
                return mlp_live
            out = self.mm(f"{tag}out_proj", 2 * n * h_loc * hd * D, H * hd * D / tp * self.wc,
                          n * h_loc * hd * a, n * D * a, [att] + wdeps, layer, phase,
                          keys=("wo",), whole_bytes=n * h_loc * hd * a)
            mlp_out = self.mlp_forward(layer, norm, wdeps, phase, tag, after)
            summed = self.vpu(f"{tag}block_sum", n * D, 3 * n * D * a, [out, mlp_out], layer,
                              phase)
            exit_deps = self.tp_exit(tag, "block", summed, [out, mlp_out], layer, phase)
            return self.vpu(f"{tag}residual", r * D, 3 * r * D * a, exit_deps + list(x), layer,
                            phase)
        if "out" in kept:
            # The projection's output came back from host memory: the residual needs only it;
            # the recomputed attention output is read by the backward (its weight gradient).
            self.recompute_leaves.append(att)
            exit1 = []
        else:
            out = self.mm(f"{tag}out_proj", 2 * n * h_loc * hd * D, H * hd * D / tp * self.wc,
                          n * h_loc * hd * a, n * D * a, [att] + wdeps, layer, phase,
                          keys=("wo",), whole_bytes=n * h_loc * hd * a)
            exit1 = self.tp_exit(tag, "attn", out, [out], layer, phase)
        if m.post_norms:
            # The sublayer's output is normed before the residual add (Gemma 2 / 3).
            exit1 = [self.vpu(f"{tag}post_norm_attn", 5 * r * D, 3 * r * D * a,
                              exit1 or list(x), layer, phase)]
        res1 = self.vpu(f"{tag}residual_attn", r * D, 3 * r * D * a, exit1 + list(x), layer,
                        phase)
        norm2 = self.vpu(f"{tag}norm_mlp", 5 * r * D, 3 * r * D * a, [res1], layer, phase)
        mm_deps2, after2 = self.tp_enter(tag, "mlp", norm2, layer, phase)
        if recompute:
            return self.mlp_forward(layer, norm2, wdeps + mm_deps2, phase, tag, after2,
                                    dead_tail=True)
        mlp_out = self.mlp_forward(layer, norm2, wdeps + mm_deps2, phase, tag, after2)
        exit2 = self.tp_exit(tag, "mlp", mlp_out, [mlp_out], layer, phase)
        if m.post_norms:
            exit2 = [self.vpu(f"{tag}post_norm_mlp", 5 * r * D, 3 * r * D * a, exit2, layer,
                              phase)]
        return self.vpu(f"{tag}residual_mlp", r * D, 3 * r * D * a, exit2 + [res1], layer,
                        phase)

    def attention_forward(self, layer, dep, phase, tag):
        m, d, a = self.m, self.d, self.act
        n, tp, hd = d.n, d.tp, m.head_dim
        h_loc = m.num_heads / tp
        k_loc = max(m.num_kv_heads / tp, 1.0)
        ctx = d.ctx
        deps = [dep]
        if d.sp > 1:  # sequence parallelism: gather the other shards' keys and values
            kv = self.coll(f"{tag}sp_kv_allgather", "all-gather", ("sequence",),
                           2 * ctx * (n / (ctx / d.sp)) * k_loc * hd * a, [dep], layer, phase)
            deps.append(kv)
        s_loc = n * d.sp / ctx  # local sequences (each attends to its whole context)
        kv_bytes = s_loc * ctx * k_loc * hd * a  # K (or V) of every local sequence
        if self.cfg.attention == "flash":
            # Flash attention skips fully masked blocks (about half under a causal mask; all
            # but the window's in a local layer) and keeps the score matrix in VMEM: HBM sees
            # only Q, K, V and the output.
            flops = 4 * n * h_loc * hd * m.attended_keys_per_query(ctx, layer)
            nbytes = 2 * n * h_loc * hd * a + 2 * kv_bytes
            return self.mm(f"{tag}flash_attention", flops, 0.0, nbytes, 0.0, deps, layer, phase,
                           narrow_dim=hd)
        # Dot attention materialises every score and masks it afterwards (MaxText's
        # dot-product path: a full q.K^T, then the causal and sliding-window masks), so a
        # local layer costs what a global one does.
        scores = n * ctx * h_loc
        # Both attention matmuls tile head_dim: q.K^T contracts over it, P.V outputs it, so a
        # head_dim below the MXU width leaves part of the array idle (ChipSpec.mxu_fill).
        qk = self.mm(f"{tag}attn_scores", 2 * n * ctx * h_loc * hd, 0.0,
                     n * h_loc * hd * a + kv_bytes, scores * 4, deps, layer, phase,
                     narrow_dim=hd)
        sm = self.vpu(f"{tag}softmax", 5 * scores, scores * 4 + scores * a, [qk], layer, phase)
        av = self.mm(f"{tag}attn_values", 2 * n * ctx * h_loc * hd, 0.0,
                     scores * a + kv_bytes, n * h_loc * hd * a, [sm], layer, phase,
                     narrow_dim=hd)
        # The f32 scores (the softmax runs in place over them) and the probabilities the
        # value matmul reads are live together (workloads/memory.py): bf16, or f32 in the
        # forward of a policy that saves named/dot residuals (minimal, offload), where XLA
        # fuses the normalisation into the value matmul, and in a fused forward under full
        # (the value matmul reads the exponentials: nothing saves the probabilities); kept
        # probabilities are counted as saved from the softmax on.
        fused = score_exp_fused(
            chip_fuses=self.cfg.score_exp_fusion,
            sharded_axes=sum(1 for s in (d.dp, d.fs, d.tp, d.ep, d.pp, d.sp) if s > 1),
            score_bytes=4.0 * scores, remat=str(self.cfg.remat),
            plain_fsdp=bool(self.cur is not None and self.cur.ops
                            and not self.cur.windowed(self.cur.ops)))
        # With one sequence per chip XLA keeps the score matmul's bf16 output and the value
        # matmul's fusion exponentiates it as it reads it: the only score-sized buffer of the
        # forward (workloads/memory.py one_sequence_per_chip).
        bf16_scores = one_sequence_per_chip(sequences_per_chip=s_loc)
        f32_probs = tag == "" and not bf16_scores and (
            self.cfg.remat in (Remat.MINIMAL, Remat.OFFLOAD)
            or (self.cfg.remat == Remat.FULL and fused))
        probs_bytes = 4.0 if f32_probs else a
        temps = attention_temporaries(rows=n, context=ctx, local_heads=h_loc,
                                      probs_bytes=probs_bytes, score_exp_fusion=fused,
                                      bf16_scores=bf16_scores)
        if tag == "re-":
            # A recomputing backward writes the scores in bf16 from the q.K^T matmul (the dP
            # matmul's fusion rebuilds the exponentials from them): no f32 score buffer in the
            # backward of any program of benchmarks/xla_memory.py. They stand for the kept
            # probabilities, counted as recomputed from the softmax on.
            temps = scores * a
        saved = tag == "re-" or self.cfg.remat == Remat.NONE  # the probabilities are kept
        # Unsaved probabilities live from the softmax to the value matmul; bf16 scores stand
        # for them (the value matmul reads the scores).
        probs = scores * probs_bytes
        if tag == "re-" and self.cfg.bwd_probs_buffer and self.cfg.remat == Remat.FULL:
            # v5p's full backward writes the bf16 probabilities next to the recomputed scores,
            # read by the value-gradient matmul (freed in layer_backward; memory.py
            # attention_backward_score_buffers).
            self.bwd_probs_bytes = scores * a
            self.mem(sm, MemoryCategory.TEMPORARIES, self.bwd_probs_bytes)
        self.mem(qk, MemoryCategory.TEMPORARIES, temps)
        self.mem(sm, MemoryCategory.TEMPORARIES, -temps + (0.0 if saved else probs))
        self.mem(av, MemoryCategory.TEMPORARIES, 0.0 if saved else -probs)
        return av

    def mlp_forward(self, layer, dep, wdeps, phase, tag, after=(), dead_tail=False):
        """The MLP (or MoE) sublayer's forward; returns its output op. `dead_tail`: a
        recomputation whose output only the backward reads, so the ops after the last live
        one are left out (a dense MLP's down projection; an MoE layer's weighted combine of
        the experts' outputs, whose inputs the router's gradient still reads)."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        mats = m.mlp.num_matrices
        if self.layer_is_moe(layer):
            E, k, F = m.num_experts, m.experts_per_token, m.expert_d_ff
            rt = self.routing
            # Rows the (busiest) chip's experts process per local token: k when routing is
            # uniform and dropless, k x the hottest shard's load factor under skew, E x
            # capacity / group tokens on the dense dropping path (padded to capacity).
            rows = rt.expert_rows_per_token
            router = self.mm(f"{tag}router", 2 * n * D * E, D * E * self.wc, n * D * a,
                             n * E * 4, [dep], layer, phase, keys=("router",),
                             acc_bytes=n * E * 4)
            topk = self.vpu(f"{tag}topk_route", 4 * n * E, n * E * 4, [router], layer, phase)
            pre = topk
            if rt.dense_dispatch:
                # MaxText's dropping path: one-hot dispatch and combine masks [tokens, experts,
                # capacity] (bf16), then the dispatch einsum BSM,BSEC->EBCM on the MXU.
                mask = n * E * rt.capacity * a
                masks = self.vpu(f"{tag}moe_masks", 2 * n * E * rt.capacity, 2 * mask, [topk],
                                 layer, phase)
                pre = self.mm(f"{tag}moe_dispatch", dispatch_flops(n, E, rt.capacity, D), 0.0,
                              mask + n * D * a, n * rows * D * a, [masks], layer, phase)
            disp = self.coll(f"{tag}ep_dispatch", "all-to-all", ("expert",),
                             n * rows * D * a * d.ep, [pre], layer, phase)
            x = [pre] + ([disp] if disp is not None else [])
            w_bytes = (E / d.ep) * mats * D * F / tp * self.wc
            h = self.mm(f"{tag}expert_in", 2 * n * rows * D * F * (mats - 1) / tp,
                        w_bytes * (mats - 1) / mats, n * rows * D * a,
                        n * rows * F * (mats - 1) / tp * a, x + wdeps, layer, phase,
                        keys=("expert_gate", "expert_up"),
                        acc_bytes=n * rows * F * (mats - 1) / tp * a)
            act = self.vpu(f"{tag}expert_act", 8 * n * rows * F / tp,
                           n * rows * F * (mats - 1) / tp * a + n * rows * F / tp * a,
                           [h, *after], layer, phase)
            o = self.mm(f"{tag}expert_out", 2 * n * rows * F * D / tp, w_bytes / mats,
                        n * rows * F / tp * a, n * rows * D * a, [act] + wdeps, layer, phase,
                        keys=("expert_down",), whole_bytes=n * rows * F / tp * a)
            # A recomputation on the dense dropping path does not send the experts' outputs
            # back: XLA computes the combine weights' gradient where they live (expert-sharded)
            # and sends that gradient instead (`layer_backward`; the compiled program of
            # benchmarks/xla_moe_schedule.py).
            comb = None if dead_tail and rt.dense_dispatch else \
                self.coll(f"{tag}ep_combine", "all-to-all", ("expert",),
                          n * rows * D * a * d.ep, [o], layer, phase)
            out_deps = [o] + ([comb] if comb is not None else [])
            if m.num_shared_experts:
                sF = m.num_shared_experts * F
                live = (mats - 1) / mats if dead_tail else 1.0  # its down projection is dead
                sh = self.mm(f"{tag}shared_expert", 2 * n * D * sF * mats / tp * live,
                             mats * D * sF / tp * self.wc * live, n * D * a,
                             n * D * a if not dead_tail else n * sF * (mats - 1) / tp * a,
                             [dep] + wdeps, layer, phase,
                             keys=("shared_gate", "shared_up") + (() if dead_tail
                                                                   else ("shared_down",)),
                             acc_bytes=n * sF * (mats - 1) / tp * a,
                             whole_bytes=0.0 if dead_tail else n * sF / tp * a)
                out_deps.append(sh)
            if dead_tail:
                # The experts' outputs (back at their tokens) are read by the backward of the
                # combine weights (the router's gradient); the weighted sum itself is dead.
                self.recompute_leaves.extend(out_deps[:-1])
                return out_deps[-1]
            if rt.dense_dispatch:
                # The combine einsum EBCM,BSEC->BSM weights and sums the experts' outputs.
                cmb = self.mm(f"{tag}moe_combine", dispatch_flops(n, E, rt.capacity, D), 0.0,
                              n * E * rt.capacity * a + n * rows * D * a, n * D * a, out_deps,
                              layer, phase)
                if not m.num_shared_experts:
                    return cmb
                return self.vpu(f"{tag}expert_combine", n * D, 3 * n * D * a, [cmb, sh], layer,
                                phase)
            return self.vpu(f"{tag}expert_combine", 2 * n * k * D, (k + 1) * n * D * a,
                            out_deps, layer, phase)
        F = m.d_ff
        h = self.mm(f"{tag}mlp_in", 2 * n * D * F * (mats - 1) / tp,
                    (mats - 1) * D * F / tp * self.wc, n * D * a, n * F * (mats - 1) / tp * a,
                    [dep] + wdeps, layer, phase, keys=("w_gate", "w_up"),
                    acc_bytes=n * F * (mats - 1) / tp * a)
        act = self.vpu(f"{tag}mlp_act", 8 * n * F / tp,
                       n * F * (mats - 1) / tp * a + n * F / tp * a, [h, *after], layer, phase)
        if dead_tail:
            return act
        return self.mm(f"{tag}mlp_out", 2 * n * F * D / tp, D * F / tp * self.wc, n * F / tp * a,
                       n * D * a, [act] + wdeps, layer, phase, keys=("w_down",),
                       whole_bytes=n * F / tp * a)

    # -- whole step -------------------------------------------------------------------------
    def build(self) -> Trace:
        m, d, cfg, a = self.m, self.d, self.cfg, self.act
        b = self.b
        n, D, V = d.n, m.d_model, m.vocab_size
        G = MemoryCategory
        emb_w = V * D / d.tp * self.wc  # one vocabulary matrix (the output projection)
        emb_all = emb_w * (1 if m.tied_embeddings else 2)  # every embedding parameter
        # An untied, FSDP-sharded input table is never gathered: XLA looks rows up where they
        # live with an all-to-all of the activations, and sends their gradients back the same
        # way (docs/xla_crosscheck.md). Tied tables are gathered anyway for the logits.
        fse = self.fsdp_shards
        lookup_a2a = (not m.tied_embeddings) and fse > 1
        # The lookup's all-to-all runs over the table's d_model shards (fsdp, and expert in an
        # MoE mesh), each chip sending its [tokens, d_model / shards]-sized pieces (XLA: 16 MiB
        # per chip for 2048 tokens of d_model 4096, with or without a tensor axis).
        a2a_axes = ("fsdp", "expert")
        a2a_group = fse

        def token_gathers(after, phase):
            """The int32 token ids the lookup (and its gradient's scatter-add) needs from the
            whole group: gathered over fsdp (each chip's share of its tensor group's tokens),
            then over tensor (XLA's two small all-gathers, forward and backward)."""
            ids = []
            for axis, axes, nbytes in (("fsdp", a2a_axes, fse * n / d.tp * 4),
                                       ("tensor", ("tensor",), fse * n * 4)):
                g = self.coll(f"embed_tokens_allgather_{axis}", "all-gather", axes, nbytes,
                              after, -1, phase)
                if g is not None:
                    ids.append(g)
            return ids
        prev_compute = None
        last_grad_ops: list[int] = []
        grads_allocated = 0.0
        # Norm-scale gradient bytes already summed over the data-parallel axes per layer
        # (`dp_split_per_matrix`); the rest goes with the final norm reduction.
        layer_norms_reduced = 0.0
        layer_outputs: dict[tuple[int, int], int] = {}

        def ring(group: int, kind: str = "all-gather", key: str = "") -> float:
            """A windowed ring's messages of one shard each, over its V. XLA runs the ring in
            both directions, two steps per loop trip: N + 1 messages (a prologue, then N/4
            trips of 4). Over N = 4 the loop would make one trip and XLA writes the steps out
            instead (docs/model.md): a gather then sends N - 1 shards, a reduce-scatter N - 1
            partial sums and a zero accumulator each way (N + 1), except the up projection's,
            which shares the gate's ring start (N - 1)."""
            if group != 4:
                return (group + 1) / group
            if kind == "all-gather" or (key in _SHARES_GATE_RING
                                        and self.m.mlp.num_matrices == 3):
                return (group - 1) / group
            return (group + 1) / group

        def fsdp_gather(layer, mb, phase, after, after_block):
            """One all-gather per weight matrix of a layer (XLA's granularity), each in its
            form: async ones are prefetched after `after` (one layer ahead), windowed and
            blocking ones are issued after `after_block` (the previous layer's end)."""
            if fse == 1:
                return None
            out = _Gathered()
            for key, nbytes in self.layer_matrices(layer):
                form = self.gather_form(layer, key, phase)
                axes, group = self.fsdp_group(key)
                # A windowed einsum gathers through a ring of N + 1 collective-permutes (a
                # prologue, then one per step), each one shard: (N + 1) / N of V.
                g = self.coll(f"fsdp_allgather_{phase}_{key}", "all-gather", axes,
                              nbytes * (ring(group, "all-gather", key)
                                        if form == "windowed" else 1.0),
                              after if form == "async" else after_block, layer, phase)
                if g is None:
                    continue
                out.ops[key] = (g, form)
                # A forward collective matmul streams the shards, never the whole matrix; the
                # backward gathers each matrix whole even then (XLA's compiled programs,
                # docs/model.md "Memory").
                if form != "windowed" or phase == "bwd":
                    self.mem(g, G.GATHERED_WEIGHTS, nbytes)
                    out.held_bytes += nbytes
                    out.held[key] = out.held.get(key, 0.0) + nbytes
            return out

        def regather(layer, g, after):
            """XLA's second gathers of the query and key projections (all four attention
            matrices in an MoE layer) for their input gradients under remat full (mixed
            modes)."""
            if g is None or cfg.remat != Remat.FULL or not cfg.fsdp_gather.startswith("mixed") \
                    or not cfg.overlap:
                return
            sizes = dict(self.layer_matrices(layer))
            for key in self.regather_keys(layer):
                nbytes = sizes[key.removesuffix("_dx")]
                r = self.coll(f"fsdp_allgather_bwd_{key}", "all-gather",
                              self.fsdp_group(key)[0], nbytes, after, layer, "bwd")
                if r is not None:
                    g.ops[key] = (r, self.gather_form(layer, key, "bwd"))
                    self.mem(r, G.GATHERED_WEIGHTS, nbytes)
                    g.held_bytes += nbytes
                    g.held[key] = g.held.get(key, 0.0) + nbytes

        def end_layer(out, g):
            """The layer ends when its windowed gathers have arrived; its gathered weights die
            with it."""
            if g is None:
                return
            wid = g.ids("windowed")
            if wid:
                b.ops[out] = _with(b.ops[out], deps=tuple(sorted({*b.ops[out].deps, *wid})))
            self.mem(out, G.GATHERED_WEIGHTS, -g.held_bytes)

        table_reduced = False  # the input table's gradient all-reduced whole (data axis)
        # Weights stored in another dtype than they are gathered in (--gather-dtype): XLA casts
        # each local shard once per step (one convert fusion per matrix, reused by the forward
        # gather and the backward's re-gathers: the v5e fsdp=16 compile of f32 params cast to
        # bf16 in each layer, docs/model.md "Training steps"), before anything is gathered.
        cast = None
        p_cast = self.local_params()
        if self.wc != self.wb and self.cast_per_pass:
            cast = self.vpu(WEIGHT_CAST, p_cast, p_cast * (self.wb + self.wc), [], -1, "fwd")
        first_mb_start = len(b.ops)
        for mb in range(cfg.microbatches):
            if mb == 1:
                self.check_program_size(first_mb_start, len(b.ops) - first_mb_start)
            # Embedding lookup (stage 0).
            start = [prev_compute] if prev_compute is not None else \
                ([cast] if cast is not None else [])
            emb_g = self.coll("fsdp_allgather_embed", "all-gather", a2a_axes, emb_w, start, -1,
                              "fwd") if self.embed_on or self.head_on else None
            # XLA gathers the output projection right before the logits when the layers'
            # forward gathers are plain (every such program of benchmarks/xla_memory.py); the
            # windowed programs may hoist it to the step's start (v5e `full` and `minimal`,
            # v5p and v6e `minimal`), which tpusim keeps for them: the gathered matrix is
            # held from the gather (docs/model.md "Memory"). The gather is issued at the
            # start either way (its time is hidden behind the forward).
            late_head = (emb_g is not None and self.head_on and (lookup_a2a or not self.embed_on)
                         and not self.forward_windowed)
            if not late_head:
                self.mem(emb_g, G.GATHERED_WEIGHTS, emb_w)
            lk = None
            if not self.embed_on:
                # A later pipeline chunk: its input activations arrive from the previous one.
                lookup_a2a = False
            if lookup_a2a:
                tok = token_gathers(start, "fwd")
                lk = self.coll("embed_lookup_alltoall", "all-to-all", a2a_axes,
                               a2a_group * n * D * a, start + tok, -1, "fwd")
            table = lk if lookup_a2a else (emb_g if self.embed_on else None)
            x = b.add("embed_lookup" if self.embed_on else "stage_input", kind=OpKind.COMPUTE,
                      unit=Unit.VPU, flops=0.0,
                      hbm_bytes=2 * self.rows() * D * a if self.embed_on else 0.0,
                      deps=[prev_compute] + ([table] if table is not None else []),
                      layer=-1, phase="fwd")
            if emb_g is not None and not self.head_on:  # no logits here to keep it for
                self.mem(x, G.GATHERED_WEIGHTS, -emb_w)
            prev = x
            if self.embed_on and d.tp > 1:
                # The table's vocabulary is split over `tensor`: each shard looks up the rows it
                # holds (zeros elsewhere) and the partial embeddings are summed over `tensor`,
                # all-reduced to the replicated residual or reduce-scattered to the sharded one
                # (XLA, docs/model.md "Collectives as XLA emits them").
                red = self.coll("tp_embed_allreduce" if not self.tp_sharded
                                else "tp_embed_reducescatter",
                                "reduce-scatter" if self.tp_sharded else "all-reduce",
                                ("tensor",), n * D * a, [x], -1, "fwd")
                prev = red if red is not None else x
            # The first layer's prefetched gathers wait for the cast of the shards they send.
            pending = fsdp_gather(0, mb, "fwd", [cast] if cast is not None else [], [prev])
            # A scanned layer stack writes what each layer saves into [layers, ...] buffers that
            # XLA allocates whole before the forward loop and frees after the backward loop
            # (one buffer cannot be freed layer by layer): every layer's saved set is resident
            # from the first layer's forward to the last layer's backward.
            stack = sum(self.saved_bytes(layer) for layer in range(d.layers))
            self.mem(prev, G.SAVED_ACTIVATIONS, stack)
            # Under `offload` a layer's offloaded set is written to HBM by its matmuls and
            # copied to host asynchronously; the device copies live until the copies complete,
            # through the next layer's forward (workloads/memory.py offload_in_flight).
            in_flight = 0.0
            for layer in range(d.layers):
                g = pending
                inp = prev
                first_op = len(b.ops)
                out = self.layer_forward(layer, [prev], g)
                self.cur = None
                if g is not None and g.windowed(("w_gate", "w_up")):
                    self.mem_windowed_mlp_outputs(layer, first_op)
                # The gathered weights are freed once the layer is done.
                end_layer(out, g)
                if cfg.remat.offloads:
                    b.add("offload_activations", kind=OpKind.HOST,
                          bytes=self.offload_bytes(layer), deps=[out], layer=layer, phase="fwd")
                if cfg.remat == Remat.OFFLOAD:
                    self.mem_saved(self.offloaded(layer), first_op, out)
                    self.mem(out, G.SAVED_ACTIVATIONS, -in_flight)
                    in_flight = self.offload_bytes(layer)
                if layer + 1 < d.layers:
                    # Prefetch the next layer's weights as this layer starts (XLA's async
                    # all-gather, two layers of weights in flight); without overlap the gather
                    # waits for this layer to finish and blocks the next.
                    after = (g.ids() if g is not None else []) + [inp]
                    pending = fsdp_gather(layer + 1, mb, "fwd", after, [out])
                layer_outputs[(mb, layer)] = out
                prev = out
            if d.pp > 1 and self.sends_on:
                send = self.coll("pipeline_send_fwd", "collective-permute", ("pipeline",),
                                 self.rows() * D * a, [prev], d.layers - 1, "fwd")
                prev = send if send is not None else prev
            # The last layer's device copies complete with the loop (before the final norm).
            self.mem(prev, G.SAVED_ACTIVATIONS, -in_flight)
            if late_head:
                self.mem(prev, G.GATHERED_WEIGHTS, emb_w)
            held = 0.0  # logits-path bytes live through the backward loop
            head_accum = None  # the output projection's windowed-ring accumulators
            if not self.head_on:
                # A pipeline chunk before the last: its output gradient arrives from the next.
                final_norm = prev = b.add("stage_grad_input", kind=OpKind.COMPUTE,
                                          unit=Unit.VPU, flops=0.0, hbm_bytes=0.0, deps=[prev],
                                          layer=-1, phase="bwd")
            else:
                # Output projection and loss.
                r = self.rows()
                final_norm = self.vpu("final_norm", 5 * r * D, 3 * r * D * a, [prev], -1, "fwd")
                # Sharded activations are gathered over `tensor` before the vocab-split logits.
                lg_deps, lg_after = self.tp_enter("", "logits", final_norm, -1, "fwd")
                # Vocab tiling runs the projection chunk by chunk: each chunk reads the whole
                # (gathered) matrix, and only one chunk's logits exist at a time.
                tiles = cfg.vocab_tiling
                logits = self.mm("logits", 2 * n * D * V / d.tp, emb_w * tiles, n * D * a,
                                 n * V / d.tp * 4,
                                 [final_norm] + ([emb_g] if emb_g is not None else []) + lg_deps,
                                 -1, "fwd")
                # The loss over vocabulary shards: the row maxima (bf16, before the f32 convert)
                # and then the f32 sum of exponentials and the target logit are all-reduced
                # over tensor; the target ids reach the shards through one collective-permute
                # of each chip's n int32 ids over fsdp x tensor (XLA).
                mx = self.coll("tp_logits_max_allreduce", "all-reduce", ("tensor",), n * a,
                               [logits], -1, "loss")
                tg = self.coll("loss_targets_permute", "collective-permute", ("fsdp", "tensor"),
                               n * 4, start, -1, "loss") if d.fs > 1 and d.tp > 1 else None
                loss = self.vpu("softmax_xent", 6 * n * V / d.tp, 2 * n * V / d.tp * 4,
                                [logits, *lg_after] + [x for x in (mx, tg) if x is not None],
                                -1, "loss")
                lse = self.coll("tp_logsumexp_allreduce", "all-reduce", ("tensor",),
                                n * 4 * 2, [loss], -1, "loss")
                dlog_deps = [loss] + ([lse] if lse is not None else [])
                if tiles > 1:
                    # MaxText's vocab tiling keeps no logits for the backward (a custom VJP):
                    # the backward recomputes each chunk's logits and its softmax.
                    rl = self.mm("logits_recompute", 2 * n * D * V / d.tp, emb_w * tiles,
                                 n * D * a, n * V / d.tp * 4, dlog_deps, -1, "bwd")
                    dlog_deps = [self.vpu("softmax_xent_recompute", 6 * n * V / d.tp,
                                          2 * n * V / d.tp * 4, [rl], -1, "bwd")]
                dlog = self.vpu("dlogits", 4 * n * V / d.tp, 2 * n * V / d.tp * a, dlog_deps,
                                -1, "bwd")
                dx = self.mm("logits_bwd", 4 * n * D * V / d.tp, 2 * emb_w * tiles,
                             n * V / d.tp * a, n * D * a + emb_w, [dlog], -1, "bwd")
                if self.rs_windowed and fse > 1:
                    # The output projection's gradient is reduce-scattered by a windowed ring
                    # too (XLA's largest one: [d_model / N, vocab] accumulators).
                    head_accum = self.ring_accumulators("logits_bwd_weights", dx, emb_w, -1,
                                                        "bwd")
                # At the loss XLA holds the logits in f32 and a bf16 buffer for their
                # gradients (workloads/memory.py), plus the gathered output projection; all die
                # with the logits' backward matmul. Vocab tiling holds one chunk's at a time.
                lt = loss_tensors(rows=n / tiles, local_vocab=V / d.tp, act_bytes=a)
                held = deferred_head_gradient_bytes(
                    rows=n, d_model=D, local_vocab=V / d.tp, act_bytes=a, tensor=d.tp,
                    fsdp=d.fs, tp_activations=cfg.tp_activations, remat=str(cfg.remat),
                    residual_rows=self.rows(), attention=cfg.attention,
                    gather=self.plain_gather_form)
                held += windowed_head_gradient_bytes(
                    rows=n, d_model=D, local_vocab=V / d.tp, act_bytes=a, tensor=d.tp,
                    fsdp=fse, windowed=self.rs_windowed, cast_weights=self.wb != self.wc,
                    offload=cfg.remat.offloads, chip_defers=cfg.head_grad_after_backward,
                    vocab_tiling=tiles, residual_rows=self.rows(),
                    flash_one_sequence=cfg.attention == "flash" and cfg.loss_after_backward
                    and one_sequence_per_chip(sequences_per_chip=n * d.sp / d.ctx))
                # With one sequence per chip v5e's compiler keeps the f32 logits for the
                # loss value's target-logit gather, scheduled after the backward loop.
                held += loss_value_logits_bytes(rows=n, local_vocab=V / d.tp,
                                                sequences_per_chip=n * d.sp / d.ctx,
                                                vocab_tiling=tiles, tensor=d.tp,
                                                chip_defers=cfg.loss_after_backward)
                self.mem(logits, G.LOGITS, sum(t.num_bytes for t in lt))
                self.mem(dx, G.LOGITS, -sum(t.num_bytes for t in lt) + held)
                self.mem(dx, G.GATHERED_WEIGHTS, -emb_w if emb_g is not None else 0.0)
                # The input gradient is summed over the vocab shards (reduce-scattered when the
                # activations are sharded, all-reduced when they are replicated).
                dar_deps = self.tp_exit("", "logits_bwd", dx, [dx], -1, "bwd")
                prev = dar_deps[-1]
            # Backward through the layers in reverse.
            # The last layer's weights are gathered again while the loss is computed.
            pending = fsdp_gather(d.layers - 1, mb, "bwd", [final_norm], [prev])
            fetch_after = [final_norm]
            # Under an offloading policy the backward loop carries one HBM buffer per offloaded
            # tensor: a layer's fetch writes into the buffers the layer above read, and its
            # copies complete as the loop body (the backward of the layer above) ends. So the
            # fetched set is allocated in program order, at the end of the layer above's
            # backward (the top layer's after the final norm: XLA copies it back into the
            # buffers its forward copy to host has just released), whenever the PCIe transfer
            # lands (docs/model.md "Memory").
            fetch_alloc_at = final_norm
            dp_wait: list[int] = []  # blocking data-parallel reductions the next layer waits for
            for layer in reversed(range(d.layers)):
                g = pending
                deps = [prev] + dp_wait
                dp_wait = []  # this layer sets its own
                # Activation gradients in flight through a layer's backward: the residual
                # stream's gradient and a sublayer's input gradient before and after its
                # reduction over `tensor` (XLA's live ranges: three [tokens, d_model] bf16
                # gradient buffers in the backward loop body).
                grad_tmp = (self.rows() + 2 * d.n) * D * a
                self.mem(prev, G.TEMPORARIES, grad_tmp)
                # A recomputing policy's backward loop body reads the layer's entries of the
                # stacked saved buffers through copies (dynamic-slice fusions) that live for
                # the layer's backward (docs/model.md "Memory"); `none` reads them in place.
                copies = self.saved_bytes(layer) if cfg.remat in (
                    Remat.MINIMAL, Remat.FULL, Remat.OFFLOAD) else 0.0
                self.mem(prev, G.SAVED_ACTIVATIONS, copies)
                if cfg.remat.offloads:
                    # Fetched one layer ahead: when the backward of the layer above starts.
                    fetch = b.add("fetch_activations", kind=OpKind.HOST,
                                  bytes=self.offload_bytes(layer),
                                  deps=[layer_outputs[(mb, layer)], *fetch_after], layer=layer,
                                  phase="bwd")
                    fetch_after = [prev]
                    deps.append(fetch)
                    self.mem(fetch_alloc_at, G.SAVED_ACTIVATIONS, self.offload_bytes(layer))
                # What the remat policy recomputes lives from the recomputation until the end
                # of the layer's backward, next to what it kept.
                recomputed = sum(t.num_bytes for t in self.recomputed_set(layer)) - \
                    self.saved_bytes(layer) - (
                    self.offload_bytes(layer) if cfg.remat == Remat.OFFLOAD else 0.0)
                if cfg.remat.recomputes_layer:
                    first_op = len(b.ops)
                    self.recompute_leaves = []
                    inp = self.layer_forward(layer, deps, g, phase="bwd", recompute=True)
                    self.cur = None
                    regather(layer, g, [inp])
                    # The backward reads every live end of the recomputation (the last matmul
                    # of the layer and what follows it are dead code, see layer_forward).
                    deps = [inp] + self.recompute_leaves
                    # The recomputed tensors live from the recomputing op on; what came back
                    # from host memory lives from its fetch.
                    kept = {t.name for t in self.saved(layer)} | {
                        t.name for t in self.offloaded(layer) if cfg.remat != Remat.OFFLOAD}
                    self.mem_saved([t for t in self.recomputed_set(layer)
                                    if t.name not in kept], first_op, inp)
                    recomputed = 0.0
                elif cfg.remat in (Remat.MINIMAL, Remat.OFFLOAD):
                    # Recompute the cheap elementwise ops (norms, activations, rotary).
                    rr = self.rows()
                    re = self.vpu("re-elementwise", 20 * rr * D, 8 * rr * D * a, deps, layer,
                                  "bwd")
                    deps = [re]
                self.mem(deps[0] if cfg.remat != Remat.NONE else None, G.SAVED_ACTIVATIONS,
                         recomputed)
                inp = prev
                out = self.layer_backward(layer, deps, g, grad=prev)
                self.cur = None
                if g is not None:
                    # The MLP's gathered matrices die with their weight-gradient matmul, before
                    # the attention's backward (XLA frees a buffer after its last reader).
                    self.mem(self.mlp_weights_done, G.GATHERED_WEIGHTS,
                             -g.release(self.mlp_keys(layer)))
                # Under `full` and `minimal` the MLP's recomputed tensors and its copies of
                # the stack entries die with the MLP's weight-gradient matmul, before the
                # attention's backward (docs/model.md "Memory").
                mlp_copies, mlp_recomputed = self.mlp_side_bytes(layer)
                self.mem(self.mlp_weights_done, G.SAVED_ACTIVATIONS,
                         -(mlp_copies + mlp_recomputed))
                self.mem(out, G.TEMPORARIES, -grad_tmp)
                self.mem(out, G.SAVED_ACTIVATIONS, -(copies - mlp_copies))
                end_layer(out, g)
                fetch_alloc_at = out
                # What the layer recomputed or fetched dies with its backward (what it kept
                # stays in the stack until the loop ends).
                fetched_extra = sum(
                    t.num_bytes for t in self.offloaded(layer)
                    if t.name not in {r.name for r in self.recomputed_set(layer)}
                ) if cfg.remat.kept_projections else 0.0
                self.mem(out, G.SAVED_ACTIVATIONS, 0.0 if cfg.remat == Remat.NONE else
                         -(sum(t.num_bytes for t in self.recomputed_set(layer))
                           - self.saved_bytes(layer) + fetched_extra - mlp_recomputed))
                if layer > 0:
                    after = (g.ids() if g is not None else []) + [inp]
                    pending = fsdp_gather(layer - 1, mb, "bwd", after, [out])
                # Gradient reduce-scatters over each matrix's FSDP group (one per matrix; a
                # windowed one is a ring of N + 1 messages), then all-reduce over data (async).
                grad_bytes = self.layer_weight_bytes(self.layer_is_moe(layer)) / self.wc * self.gb
                expert_b = self.layer_expert_weight_bytes(layer) / self.wc * self.gb
                rs_ops = []
                rs_of: dict[str, int] = {}  # matrix -> its reduction over fsdp
                sync_ops = []  # the synchronous all-reduces among them
                # A gradient XLA all-reduces whole is written whole by its weight-gradient
                # matmul and lives until the all-reduce has read it (the update slices the
                # chip's shard out): the MLP's from the MLP's weight-gradient matmul, the
                # output and value projections' from before the attention's score gradient,
                # the query and key projections' from after it, to the layer's combined
                # all-reduce; one of XLA_ALLREDUCE_ALONE_BYTES or more is all-reduced alone
                # right after its matmul, and is not held (docs/model.md "Memory").
                whole_from = {"wo": self.attn_early_grads_done, "wv": self.attn_early_grads_done,
                              "wq": self.attn_weights_done, "wk": self.attn_weights_done,
                              "router": self.router_grad_done}
                for key, nbytes in self.layer_matrices(layer) if fse > 1 else []:
                    axes, group = self.fsdp_group(key)
                    kind = self.grad_kind_for(group)
                    op = self.coll(f"fsdp_grad_{kind.replace('-', '')}_{key}", kind, axes,
                                   nbytes / self.wc * self.gb
                                   * (ring(group, "reduce-scatter", key)
                                      if self.rs_windowed_for(group) else 1.0),
                                   [out], layer, "bwd")
                    if op is not None:
                        rs_ops.append(op)
                        rs_of[key] = op
                        if kind == "all-reduce":
                            sync_ops.append(op)
                            whole = nbytes / self.wc * self.gb
                            if whole < XLA_ALLREDUCE_ALONE_BYTES:
                                self.mem(whole_from.get(key, self.mlp_weights_done),
                                         G.WHOLE_GRADIENTS, whole)
                                self.mem(op, G.WHOLE_GRADIENTS, -whole)
                rs = rs_ops[-1] if rs_ops else None
                local_grad = ((grad_bytes - expert_b) / fse + expert_b / d.fs) \
                    / self.gb * self.gh
                if mb == 0:  # the local gradient shard lives from here until the update
                    self.mem(rs if rs is not None else out, G.GRADIENTS, local_grad)
                    grads_allocated += local_grad
                if mb == cfg.microbatches - 1:
                    # Weights are replicated over data and sequence: their gradient shards are
                    # summed over those axes too.
                    after = rs_ops or [out]
                    if self.dp_split_per_matrix:
                        # Across slices XLA sends one all-reduce per weight matrix (its gradient
                        # shard, after that matrix's reduction over fsdp) and one for the
                        # layer's norm scales (f32), never combined; the chip's DCN endpoint
                        # handles their messages one after another, so each waits for the one
                        # before (benchmarks/xla_dcn_schedule.py, docs/model.md).
                        dps = []
                        for key, nbytes in self.layer_matrices(layer):
                            dep = [rs_of[key]] if key in rs_of else [out]
                            op = self.coll(f"dp_grad_allreduce_{key}", "all-reduce",
                                           ("data", "sequence"),
                                           nbytes / self.wc * self.gb / self.fsdp_group(key)[1],
                                           dep + dps[-1:], layer, "bwd")
                            if op is not None:
                                dps.append(op)
                        op = self.coll("dp_grad_allreduce_norms", "all-reduce",
                                       ("data", "sequence"), self.layer_norm_grad_bytes(),
                                       [out] + dps[-1:], layer, "bwd")
                        if op is not None:
                            dps.append(op)
                            layer_norms_reduced += self.layer_norm_grad_bytes()
                    else:
                        dps = [o for o in (
                            self.coll("dp_grad_allreduce", "all-reduce", ("data", "sequence"),
                                      (grad_bytes - expert_b) / fse, after, layer, "bwd"),
                            self.coll("dp_grad_allreduce_experts", "all-reduce",
                                      ("data", "sequence"), expert_b / d.fs, after, layer,
                                      "bwd")) if o is not None]
                    last_grad_ops += rs_ops + dps
                    if cfg.dp_allreduce == "blocking" and d.dp > 1:
                        # Without XLA's data-parallel all-reduce overlap the layer's gradient
                        # reduction (over fsdp, then data) finishes before the next layer's
                        # backward starts (only with a data axis: the data-parallel overlap
                        # flags concern the data-parallel reduction).
                        dp_wait = dps
                else:
                    last_grad_ops += rs_ops
                # XLA's synchronous all-reduces: the core runs them right after the layer's
                # weight-gradient matmuls, before the next layer's backward (with --fsdp-grad
                # all-reduce, and in the mixed modes over more than XLA_MAX_WINDOWED_RING
                # chips: the v6e and v5e fsdp=64 and v6e fsdp=256 FORM_PROBES have top-level
                # synchronous all-reduces, no -start).
                dp_wait = dp_wait + sync_ops
                prev = out
            self.mem(prev, G.SAVED_ACTIVATIONS, -stack)
            self.mem(prev, G.LOGITS, -held)  # the deferred head weight gradient is done
            if d.pp > 1 and self.sends_on:
                send = self.coll("pipeline_send_bwd", "collective-permute", ("pipeline",),
                                 self.rows() * D * a, [prev], 0, "bwd")
                prev = send if send is not None else prev
            if self.embed_on:
                if self.tp_sharded:
                    # Every vocabulary shard scatters the gradients of all its tokens' rows:
                    # the sharded input gradient is gathered over `tensor` first.
                    eg = self.coll("tp_embed_grad_allgather", "all-gather", ("tensor",),
                                   n * D * a, [prev], -1, "bwd")
                    prev = eg if eg is not None else prev
                emb_bwd = self.vpu("embed_grad", n * D, 3 * n * D * a, [prev] + dp_wait, -1,
                                   "bwd")
                rows_v = d.dp * a2a_group * n * D * a  # every chip's gradient rows
                table_v = emb_w / self.wc * self.gb  # the chip's whole table gradient
                if lookup_a2a and d.dp > 1 and rows_v < table_v:
                    # With a data axis XLA's SPMD partitioner does not send the gradient rows
                    # back by all-to-all: it replicates the smaller of the scatter-add's
                    # updates and its table. Here the rows: every chip's [n, d_model] input
                    # gradient is all-gathered over data x fsdp (x expert), each chip keeps its
                    # fsdp group's rows and its d_model slice for the scatter-add, and the
                    # table's gradient is then summed over data (`dp_grad_allreduce_embed`).
                    # v6e data=4 x fsdp=4: 256 MiB of rows for n = 2048, d_model 4096
                    # against a 1002 MiB table (docs/model.md).
                    tok = token_gathers([prev], "bwd")
                    ga = self.coll("embed_grad_allgather", "all-gather",
                                   ("data",) + a2a_axes, rows_v, [emb_bwd] + tok, -1, "bwd")
                    emb_bwd = self.vpu("embed_grad_scatter_add", n * D, 3 * n * D * a,
                                       [emb_bwd] + ([ga] if ga is not None else []), -1, "bwd")
                elif lookup_a2a and d.dp > 1:
                    # ... and here the table: each chip scatter-adds its own rows into a zero
                    # table of the whole width and the table is all-reduced over data x fsdp
                    # (x expert), already summed over data (the v5e, v5p and v6e data=2 x
                    # fsdp=8 programs of benchmarks/xla_memory.py: a 128 MiB [32768, 2048]
                    # table against 256 MiB of rows).
                    emb_bwd = self.vpu("embed_grad_scatter_add", n * D,
                                       3 * n * D * a + 2 * table_v, [emb_bwd], -1, "bwd")
                    tr = self.coll("embed_grad_table_allreduce", "all-reduce",
                                   ("data",) + a2a_axes, table_v, [emb_bwd], -1, "bwd")
                    table_reduced = True
                    emb_bwd = tr if tr is not None else emb_bwd
                elif lookup_a2a:
                    tok = token_gathers([prev], "bwd")
                    ga = self.coll("embed_grad_alltoall", "all-to-all", a2a_axes,
                                   a2a_group * n * D * a, [emb_bwd] + tok, -1, "bwd")
                    emb_bwd = self.vpu("embed_grad_scatter_add", n * D, 3 * n * D * a,
                                       [emb_bwd] + ([ga] if ga is not None else []), -1, "bwd")
            else:  # a later pipeline chunk sends its input gradient back instead
                emb_bwd = prev
            erc = None
            if self.embed_on or self.head_on:
                erc = self.coll(f"fsdp_grad_{self.grad_kind.replace('-', '')}_embed",
                                self.grad_kind, a2a_axes,
                                emb_w / self.wc * self.gb
                                * (ring(fse, "reduce-scatter") if self.rs_windowed else 1.0),
                                [emb_bwd] + ([head_accum] if head_accum is not None else []),
                                -1, "bwd")
                if erc is not None:
                    last_grad_ops.append(erc)
                if mb == cfg.microbatches - 1:
                    ear = self.coll("dp_grad_allreduce_embed", "all-reduce", ("data", "sequence"),
                                    (emb_all - (emb_w if table_reduced else 0.0))
                                    / self.wc * self.gb / fse
                                    + (0.0 if fse > 1 or self.dp_split_per_matrix
                                       else self.norm_grad_bytes()),
                                    [erc if erc is not None else emb_bwd], -1, "bwd")
                    if ear is not None:
                        last_grad_ops.append(ear)
            if mb == 0:  # embedding and norm gradients: the rest of the local shard
                self.mem(erc if erc is not None else emb_bwd, G.GRADIENTS,
                         max(self.local_params() * self.gh - grads_allocated, 0.0))
            prev_compute = emb_bwd
        # The norm scales are replicated: their gradients are summed over fsdp and expert (and
        # tensor, if the activations are sharded over it; replicated ones give equal gradients
        # on every tensor shard) in one all-reduce (XLA combines them; f32), over the
        # data-parallel axes too when there is an FSDP axis (the v6e data x fsdp program: one
        # all-reduce over data x fsdp), else with the embedding's gradients
        # (`dp_grad_allreduce_embed`).
        nrm_axes = ("fsdp", "expert", "tensor") if self.tp_sharded else ("fsdp", "expert")
        if self.dp_split_per_matrix:
            # Across slices the layers' norm scales went over the data-parallel axes with their
            # layer (`dp_grad_allreduce_norms`); the rest (the final norm's) goes here, after
            # the reduction over fsdp and expert of them all.
            nrm = self.coll("norm_grad_allreduce", "all-reduce", nrm_axes,
                            self.norm_grad_bytes(), [prev_compute], -1, "bwd")
            rest = self.coll("dp_grad_allreduce_norms", "all-reduce", ("data", "sequence"),
                             self.norm_grad_bytes() - layer_norms_reduced,
                             [nrm if nrm is not None else prev_compute], -1, "bwd")
            last_grad_ops += [o for o in (nrm, rest) if o is not None]
        else:
            nrm = self.coll("norm_grad_allreduce", "all-reduce",
                            ("data", "sequence", *nrm_axes) if fse > 1 else nrm_axes,
                            self.norm_grad_bytes(), [prev_compute], -1, "bwd")
            if nrm is not None:
                last_grad_ops.append(nrm)
        # The update on the local parameter shard: reads the weights, the gradients and the
        # state, writes the weights and the state (Adam: tpu.md §4, bf16 params + fp32 moments).
        p_local = self.local_params()
        upd = self.vpu(f"{self.opt.value}_update", self.opt.update_flops_per_param * p_local,
                       p_local * (2 * self.wb + self.gb + 2 * self.state_bytes_per_param),
                       [prev_compute] + last_grad_ops, -1, "optimizer")
        self.mem(upd, G.GRADIENTS, -max(p_local * self.gh, grads_allocated))
        if self.wc != self.wb and not self.cast_per_pass:
            # A pipeline chunk's cast, last and alone (so its passes hold none): the stage
            # composition, the pass-level schedule and the plan's bound run it once, before
            # the stage's first pass (sim/pipeline.py).
            self.vpu(WEIGHT_CAST, p_cast, p_cast * (self.wb + self.wc), [upd], -1,
                     "optimizer")
        # Parameters and optimizer state are the program's (donated) arguments, resident for the
        # whole step; gradients are temporaries of the backward pass, as in XLA's program.
        static = p_local * (self.wb + self.state_bytes_per_param)
        meta = self.meta(p_local, static)
        return Trace(mesh=self.mesh, ops=tuple(b.ops), meta=meta)

    def layer_backward(self, layer, deps, gather, grad=None):
        """Backward of one layer: dX and dW matmuls (2x forward), elementwise grads, TP
        all-reduces of the input gradients."""
        m, d, a = self.m, self.d, self.act
        n, D, tp = d.n, m.d_model, d.tp
        hd, H, K = m.head_dim, m.num_heads, m.num_kv_heads
        h_loc = H / tp
        k_loc = max(K / tp, 1.0)
        mats = m.mlp.num_matrices
        self.cur = gather
        wd: list[int] = []  # the matmuls wait for their own matrices' gathers (`mm` keys)
        mkeys = self.mlp_keys(layer)
        rt = self.routing
        moe = self.layer_is_moe(layer)
        dense_disp = moe and rt.dense_dispatch
        if moe:
            F = m.expert_d_ff * rt.expert_rows_per_token
            w_mlp = (m.num_experts / d.ep) * mats * D * m.expert_d_ff / tp * self.wc
        else:
            F = m.d_ff
            w_mlp = mats * D * F / tp * self.wc
        fwd_mlp = 2 * n * D * F * mats / tp
        comb = None
        dcomb_deps: list[int] = []
        if m.post_norms and not m.parallel_block:
            # The gradient enters each sublayer through its post-norm's backward.
            r = self.rows()
            post = self.vpu("post_norm_mlp_bwd", 10 * r * D, 4 * r * D * a,
                            [grad] if grad is not None else list(deps), layer, "bwd")
            grad = post
            deps = list(deps) + [post]
        if dense_disp:
            # Combine einsum backward: gradients of the expert outputs and of the combine
            # weights (the router's gradient), two einsums of the forward's size. XLA computes
            # the combine weights' gradient where the experts' outputs live (sharded over
            # expert): the output gradient is first gathered over `expert` (every chip of an
            # expert group needs its fsdp group's sequences; async under the recipes'
            # collective-fusion flags), and the result goes back to the tokens' chips with an
            # all-to-all at the end of the MoE backward (`ep_combine_weights_grad`).
            gout = self.coll("ep_grad_allgather", "all-gather", ("expert",), d.ep * n * D * a,
                             [grad] if grad is not None else list(deps), layer, "bwd")
            mask = n * m.num_experts * rt.capacity * a
            cb = self.mm("moe_combine_bwd", 2 * dispatch_flops(n, m.num_experts, rt.capacity, D),
                         0.0, mask + n * D * a + n * rt.expert_rows_per_token * D * a,
                         n * rt.expert_rows_per_token * D * a + mask,
                         list(deps) + ([gout] if gout is not None else []), layer, "bwd")
            deps = [cb]
        if moe:
            # Transpose of the forward's combine all-to-all, before the experts' backward.
            comb = self.coll("ep_combine_bwd", "all-to-all", ("expert",),
                             n * rt.expert_rows_per_token * D * a * d.ep, deps, layer, "bwd")
            if comb is not None:
                deps = list(deps) + [comb]
        r = self.rows()
        first = deps[-1]
        # The incoming gradient is gathered over `tensor` as soon as it exists (alongside the
        # recomputation, which does not need it); an MoE layer's comes out of the combine.
        mm_deps, after = self.tp_enter("", "mlp_bwd", grad if grad is not None and not moe
                                       else first, layer, "bwd")
        # The backward matmuls are split as XLA schedules them: the input gradients (dX) are on
        # the critical path; the weight gradients (dW) only feed the gradient reduction, so
        # they run after the input gradient's collective is issued and hide it (a
        # tensor-parallel reduction, the MoE dispatch all-to-all).
        # Windowed, the gate and up projections' input gradients read the gradients of their
        # outputs whole on every ring step; the down projection's contracts the sharded d_model
        # and sums its [tokens, d_ff] output over the steps.
        dmlp = self.mm("mlp_bwd", fwd_mlp, w_mlp, 1.5 * n * F * mats / tp * a, n * D * a,
                       list(deps) + wd + mm_deps, layer, "bwd", keys=mkeys,
                       whole_bytes={k: n * F / tp * a for k in mkeys
                                    if k.endswith(("_gate", "_up"))},
                       acc_bytes={k: n * F / tp * a for k in mkeys if k.endswith("_down")})
        # Reads the gate/up projections and the product's gradient, writes their gradients.
        dact = self.vpu("mlp_act_bwd", 16 * n * F / tp, (2 * (mats - 1) + 1) * n * F / tp * a,
                        [dmlp, *after], layer,
                        "bwd")
        ar1 = None
        if moe:
            # Transpose of the forward's dispatch all-to-all, after the experts' backward. XLA's
            # all-to-alls are synchronous by default (benchmarks/xla_moe_schedule.py): the
            # weight gradients wait for it rather than hiding it. With libtpu's async
            # all-to-all (`--ep-alltoall async`) they start/done around independent work.
            ar1 = self.coll("ep_dispatch_bwd", "all-to-all", ("expert",),
                            n * rt.expert_rows_per_token * D * a * d.ep, [dact], layer, "bwd")
        sync = self.cfg.ep_alltoall == "sync"
        # A windowed reduce-scatter's ring steps each compute one d_model shard of the gradient:
        # they read the [tokens, d_ff] operands whole (the gate and up outputs' gradients, the
        # down projection's input) and the d_model ones a slice at a time.
        dmlp_w = self.mm("mlp_bwd_weights", fwd_mlp, w_mlp, 1.5 * n * F * mats / tp * a, 0.0,
                         [dact] + ([ar1] if ar1 is not None and sync else []), layer, "bwd",
                         keys=mkeys, whole_bytes={k: n * F / tp * a for k in mkeys
                                                  if k != "router"})
        self.mlp_weights_done = self.last_matmul  # the MLP matrices' last reader
        if dense_disp:
            # The combine weights' gradient back to the tokens' chips (synchronous: after the
            # experts' weight gradients, as XLA schedules it; async: as soon as it is
            # computed); the router's backward, and so the layer's input gradient, reads it.
            # MaxText builds the combine mask in the activation dtype (`generate_masks`: the
            # bf16 top-k weights times an int32 one-hot of the capacity slot, cut from cap + 1
            # slots to cap), so its gradient is bf16 and XLA sends it before the cut:
            # [tokens, E, cap + 1] (benchmarks/xla_moe_schedule.py, MaxText's router, at the
            # 750B's per-chip sizes and at the cross-check's).
            dc = self.coll("ep_combine_weights_grad", "all-to-all", ("expert",),
                           d.ep * n * m.num_experts * (rt.capacity + 1) * a,
                           [dmlp_w] if sync else [cb], layer, "bwd")
            dcomb_deps = [dc] if dc is not None else []
        if dense_disp:
            # Dispatch einsum backward: the input gradient only (the one-hot mask has none).
            ar1 = self.mm("moe_dispatch_bwd", dispatch_flops(n, m.num_experts, rt.capacity, D),
                          0.0, n * m.num_experts * rt.capacity * a
                          + n * rt.expert_rows_per_token * D * a, n * D * a,
                          [dact] + ([ar1] if ar1 is not None else []), layer, "bwd")
        if moe:
            # The router's backward: the combine weights' gradient through the top-k softmax
            # into the router logits, then the router matmul's input and weight gradients,
            # twice its forward FLOPs (the compiled MoE step's dot FLOPs: without them tpusim
            # had 4 n D E per layer fewer). Issued after the dispatch's backward, which does
            # not wait for the combine weights' gradient (a chip runs its ops in order).
            E = m.num_experts
            rb = self.mm("router_bwd", 4 * n * D * E, D * E * self.wc,
                         n * D * a + n * E * 4, n * D * a, dcomb_deps or [dact], layer, "bwd",
                         keys=("router",), whole_bytes=n * E * 4)
            dcomb_deps = [rb]
            self.router_grad_done = rb
        if m.parallel_block:
            # Both branches read the same normed input: their input gradients are summed and
            # reduced over `tensor` once, after the attention branch.
            mlp_exit = [dact]
        else:
            mlp_exit = self.tp_exit("", "mlp_bwd", dact, [dmlp], layer, "bwd")
        nrm = self.vpu("norm_mlp_bwd", 10 * r * D, 4 * r * D * a,
                       mlp_exit + [x for x in (ar1,) if x is not None] + dcomb_deps, layer,
                       "bwd")
        keys = m.attended_keys_per_query(d.ctx, layer) if self.cfg.attention == "flash" \
            else d.ctx  # dot attention computes every score (attention_forward)
        att_fwd_flops = 4 * n * h_loc * hd * keys
        att_factor = 2.5 if self.cfg.attention == "flash" else 2.0  # flash recomputes scores
        w_att = m.attention_params_per_layer / tp * self.wc
        proj_flops = 2 * n * D * (2 * h_loc + 2 * k_loc) * hd
        if m.parallel_block:
            mm_deps2, after2 = mm_deps, after
        else:
            if m.post_norms:
                nrm = self.vpu("post_norm_attn_bwd", 10 * r * D, 4 * r * D * a, [nrm], layer,
                               "bwd")
            mm_deps2, after2 = self.tp_enter("", "attn_bwd", nrm, layer, "bwd")
        # Windowed: the q, k, v input gradients read the projections' output gradients whole
        # on every ring step; the output projection's contracts the sharded d_model and sums
        # its output (the attention output's gradient) over the steps.
        dproj = self.mm("attn_proj_bwd", proj_flops, w_att,
                        1.5 * n * (h_loc + 2 * k_loc) * hd * a, n * D * a,
                        [nrm] + wd + mm_deps2, layer, "bwd",
                        keys=_ATTN_KEYS + self.regather_keys(layer),
                        whole_bytes={"wq": n * h_loc * hd * a, "wk": n * k_loc * hd * a,
                                     "wv": n * k_loc * hd * a},
                        acc_bytes={"wo": n * h_loc * hd * a})
        self.attn_early_grads_done = dproj
        kv_bytes = n * d.sp / d.ctx * d.ctx * k_loc * hd * a  # K or V of the local sequences
        datt_m = None
        if self.cfg.attention == "flash":
            # Reads Q, O, dO and K, V; writes dQ, dK, dV.
            datt = self.mm("flash_attention_bwd", att_factor * att_fwd_flops, 0.0,
                           4 * n * h_loc * hd * a + 4 * kv_bytes, 0.0, [dproj, *after2], layer,
                           "bwd", narrow_dim=hd)
        else:
            scores = n * d.ctx * h_loc
            datt_m = self.mm("attn_bwd", att_factor * att_fwd_flops, 0.0,
                             3 * scores * a + 2 * kv_bytes,
                             2 * n * h_loc * hd * a + 2 * kv_bytes, [dproj, *after2], layer,
                             "bwd", narrow_dim=hd)
            datt = self.vpu("softmax_bwd", 6 * scores, 3 * scores * a, [datt_m], layer, "bwd")
            # The bf16 score-sized buffers live at the score gradient, from the probability
            # gradient's matmul until the dQ and dK matmuls have read the score gradient; one
            # of them (the probabilities, or the recomputed scores they stand for) is already
            # counted as saved or recomputed.
            extra = (attention_backward_score_buffers(
                remat=str(self.cfg.remat), score_grad_fusion=self.cfg.score_grad_fusion,
                bwd_probs_buffer=self.cfg.bwd_probs_buffer) - 1) * scores * a
            self.mem(dproj, MemoryCategory.TEMPORARIES, extra - self.bwd_probs_bytes)
            self.mem(datt, MemoryCategory.TEMPORARIES, -extra)
            self.bwd_probs_bytes = 0.0
        rope = self.vpu("rotary_bwd", 6 * n * (h_loc + k_loc) * hd,
                        2 * n * (h_loc + k_loc) * hd * a, [datt], layer, "bwd")
        if m.qk_norm:
            rope = self.vpu("qk_norm_bwd", 10 * n * (h_loc + k_loc) * hd,
                            4 * n * (h_loc + k_loc) * hd * a, [rope], layer, "bwd")
        last = [datt_m if self.cfg.attention != "flash" else datt]
        att_exit = self.tp_exit("", "block_bwd" if m.parallel_block else "attn_bwd", rope,
                                last + ([dmlp] if m.parallel_block else []), layer, "bwd")
        # Windowed: the q, k, v output gradients and the attention output (o's input) are read
        # whole on every ring step; the layer input and o's output gradient a slice at a time.
        dproj_w = self.mm("attn_proj_bwd_weights", proj_flops, w_att,
                          1.5 * n * (h_loc + 2 * k_loc) * hd * a, 0.0, [rope], layer, "bwd",
                          keys=_ATTN_KEYS, whole_bytes=n * (2 * h_loc + 2 * k_loc) * hd * a)
        self.attn_weights_done = dproj_w
        return self.vpu("norm_attn_bwd", 10 * r * D, 4 * r * D * a,
                        att_exit + [dact, dmlp_w, dproj_w], layer, "bwd")

    # -- memory ---------------------------------------------------------------------------
    def layer_shape(self, layer: int) -> LayerShapeSpec:
        m, d = self.m, self.d
        moe = self.layer_is_moe(layer)
        ff = m.expert_d_ff * m.experts_per_token if moe else m.d_ff
        return LayerShapeSpec(
            rows=d.n, residual_rows=self.rows(), context=d.ctx, d_model=m.d_model,
            q_width=m.num_heads / d.tp * m.head_dim,
            kv_width=max(m.num_kv_heads / d.tp, 1.0) * m.head_dim,
            local_heads=m.num_heads / d.tp, ff_width=ff / d.tp,
            mlp_matrices=m.mlp.num_matrices, mlp_kind=str(m.mlp), parallel_block=m.parallel_block,
            num_experts=m.num_experts if moe else 0)

    def saved(self, layer: int, remat: Remat | None = None):
        return saved_tensors(self.layer_shape(layer), remat=str(remat or self.cfg.remat),
                             attention=self.cfg.attention, act_bytes=self.act)

    def mem_saved(self, tensors, first_op: int, fallback: int) -> None:
        """Allocate `tensors` as saved activations, each when its producer (among the ops from
        `first_op` on; `fallback` if the layer has no such op) ends."""
        by_name = {o.name.removeprefix("re-"): o.id for o in self.b.ops[first_op:]}
        for t in tensors:
            self.mem(by_name.get(t.producer, fallback), MemoryCategory.SAVED_ACTIVATIONS,
                     t.num_bytes)

    def mem_windowed_mlp_outputs(self, layer: int, first_op: int) -> None:
        """A windowed (collective-matmul) MLP input projection writes into output buffers XLA
        allocates at the start of the layer's forward, before the attention, and frees once
        the activation has read them: the gate/up outputs are live through the attention's
        peak. Source: the `AllocateBuffer` pair of `[tokens, d_ff]` buffers in every windowed
        program of `benchmarks/xla_memory.py` (v5e, v6e and v5p fsdp=16 under full, minimal and
        offload), live from before the score matmul to the activation."""
        if self.layer_is_moe(layer):
            return
        m, d = self.m, self.d
        by_name = {o.name: o.id for o in self.b.ops[first_op:]}
        end = by_name.get("mlp_act", by_name.get("mlp_in"))
        if end is None:
            return
        nbytes = (m.mlp.num_matrices - 1) * d.n * m.d_ff / d.tp * self.act
        self.mem(first_op, MemoryCategory.TEMPORARIES, nbytes)
        self.mem(end, MemoryCategory.TEMPORARIES, -nbytes)

    def recomputed_set(self, layer: int):
        """What a layer's backward holds after recomputing its forward (the set a backward
        fused with its forward reads: no stacked f32 residuals)."""
        return saved_tensors(self.layer_shape(layer), remat="none",
                             attention=self.cfg.attention, act_bytes=self.act, stacked=False)

    def mlp_side_bytes(self, layer: int) -> tuple[float, float]:
        """(copies of stack entries, recomputed tensors) of a dense layer's backward whose last
        reader is the MLP's backward (the mid residual, the MLP norm's output and statistics,
        the MLP's hidden and activation outputs, the attention's output projection the mid
        residual is rebuilt from): what dies with the MLP's weight-gradient matmul under
        `full` and `minimal`. Source: XLA's live ranges at the score gradient of the
        `benchmarks/xla_memory.py` programs (v6e fsdp=16 `full` and `minimal`, the data x
        fsdp programs): no tensor of the MLP's width is live there. Under `offload` (v5e and
        v6e fsdp=16) XLA schedules the MLP's weight-gradient matmuls after the attention's
        backward and they live through it, and so does v5e's compiler under `full` and
        `minimal` with windowed gathers (`mlp_grad_after_attention`: the gate, up and gated
        product, 3 x tokens x d_ff bf16, at the score gradient of the seven windowed v5e
        `full` and `minimal` programs, one or two sequences per chip; read off six, the
        seventh compiled after); MoE layers keep theirs too (not measured)."""
        if self.cfg.remat not in (Remat.FULL, Remat.MINIMAL) or self.layer_is_moe(layer) \
                or self.m.parallel_block \
                or (self.cfg.mlp_grad_after_attention and self.rs_windowed):
            return 0.0, 0.0
        side = {"residual_mid", "norm_mlp_stats", "norm_mlp_out", "mlp_hidden", "mlp_act_out",
                "attn_out_proj"}
        saved = {t.name: t.num_bytes for t in self.saved(layer)}
        copies = sum(b for name, b in saved.items() if name in side)
        recomputed = sum(t.num_bytes for t in self.recomputed_set(layer)
                         if t.name in side and t.name not in saved)
        return copies, recomputed

    def saved_bytes(self, layer: int, remat: Remat | None = None) -> float:
        """HBM one layer's saved activations take between its forward and its backward (with
        `remat`, those of that policy instead of the run's)."""
        return sum(t.num_bytes for t in self.saved(layer, remat))

    def offloaded(self, layer: int):
        """The tensors the remat policy moves to host memory per layer (and fetches back)."""
        return offloaded_tensors(self.layer_shape(layer), attention=self.cfg.attention,
                                 act_bytes=self.act, remat=str(self.cfg.remat))

    def offload_bytes(self, layer: int) -> float:
        """Bytes the remat policy moves to host memory per layer (and fetches back)."""
        return sum(t.num_bytes for t in self.offloaded(layer)) if self.cfg.remat.offloads \
            else 0.0
    def activation_peak(self) -> float:
        """Saved activations at their peak: every layer of the stage, times the microbatches
        in flight on a pipeline stage."""
        cfg, d = self.cfg, self.d
        inflight = min(cfg.microbatches, d.pp) if cfg.pipeline_schedule != "gpipe" else \
            cfg.microbatches
        saved_stage = sum(self.saved_bytes(layer) for layer in range(d.layers))
        return saved_stage * (inflight if d.pp > 1 else 1)


    def local_params(self) -> float:
        m, d = self.m, self.d
        # Every weight is sharded over fsdp x expert: the routed experts' over expert by expert
        # and over fsdp on d_model, the others over both on d_model (`fsdp_group`).
        shards = d.tp * d.fs * d.ep
        att = m.num_attention_params / (shards * d.pp)
        if m.is_moe:
            dense_l = m.num_dense_layers
            mlp = dense_l * m.dense_mlp_params_per_layer / (shards * d.pp)
            mlp += m.num_moe_layers * (m.moe_mlp_params_per_layer / (shards * d.pp))
        else:
            mlp = m.num_mlp_params / (shards * d.pp)
        emb = m.num_embedding_params / shards
        norms = m.num_norm_params / d.pp
        return att + mlp + emb + norms

    def meta(self, p_local: float, static: float) -> dict:
        m, d, cfg = self.m, self.d, self.cfg
        tokens_global = self.global_seqs * cfg.seq_len
        model_flops = m.training_flops(tokens_global, cfg.seq_len, causal=True)
        mt = m.maxtext_flops_per_device(cfg.batch_per_chip, cfg.seq_len, "matmul_causal")
        act_peak = self.activation_peak()
        return {
            "kind": "training",
            "model": m.name,
            "seq_len": cfg.seq_len,
            "batch_per_chip": cfg.batch_per_chip,
            "global_sequences": self.global_seqs,
            "num_chips": self.num_chips,
            "tokens_per_step": tokens_global,
            "model_flops_per_chip": model_flops / self.num_chips,
            "maxtext_flops_per_chip": mt,
            "remat": str(cfg.remat),
            "attention": cfg.attention,
            "microbatches": cfg.microbatches,
            "pipeline_stages": d.pp,
            "pipeline_schedule": cfg.pipeline_schedule,
            "virtual_stages": cfg.virtual_stages,
            # Activations one stage sends the next per microbatch (and gradients back).
            "pipeline_send_bytes": self.rows() * m.d_model * self.act,
            **({"moe": self.routing.summary(cfg.moe), "moe_scenario_applied": True}
               if self.routing is not None else {}),
            "overlap": cfg.overlap,
            "fsdp_gather": cfg.fsdp_gather,
            "fsdp_grad": cfg.fsdp_grad,
            "dp_grad_split": cfg.dp_grad_split,
            "optimizer": str(self.opt),
            "fuse_elementwise": cfg.fuse_elementwise,
            "tp_activations": cfg.tp_activations,
            "tp_comm": cfg.tp_comm,
            "params_per_chip": p_local,
            "static_hbm_bytes": static,
            "static_composition": {"params": p_local * self.wb,
                                   "optimizer": p_local * self.state_bytes_per_param},
            "static_breakdown": {
                "params": p_local * self.wb,
                "grads": p_local * self.gh,
                "optimizer": p_local * self.state_bytes_per_param,
            },
            "activation_bytes_estimate": act_peak,
            # The tensors the first layer keeps for its backward (per chip, one microbatch).
            "saved_activations_per_layer": {
                t.name: t.num_bytes for t in self.saved(0)},
            "memory_events": self.mem_events,
            # The loss's temporaries (pipeline stages add them to the last stage's peak).
            "logits_bytes": sum(t.num_bytes for t in loss_tensors(
                rows=d.n / cfg.vocab_tiling, local_vocab=m.vocab_size / d.tp,
                act_bytes=self.act))
            if self.head_on else 0.0,
        }


def _with(op, **changes):
    import dataclasses

    return dataclasses.replace(op, **changes)



__all__ = [
    "Remat",
    "TrainingConfig",
    "compile_pipeline_chunk",
    "compile_training_step",
    "training_config_from_dict",
    "training_config_to_dict",
    "estimate_training_memory",
    "parse_remat",
    "dtype_bytes",
]
