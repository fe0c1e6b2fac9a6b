"""Run settings of one training step: `TrainingConfig`, validated on construction (each mode
given as text is parsed into its `StrEnum` of `modes.py`), and its plain-dict form recorded in
trace files.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field

from topologies.errors import TpusimError
from topologies.validate import (
    MAX_BATCH,
    MAX_CHUNKS,
    MAX_TOKENS,
    interval_text,
    one_of,
    range_text,
    short_repr,
)
from workloads.dtypes import TRAINING_MATMUL_DTYPES, Dtype, dtype_bytes
from workloads.moe import MoeConfig
from workloads.training.modes import (
    FSDP_GATHER_MODES,
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
    QuantScales,
    Remat,
    TpActivations,
    TpComm,
    parse_optimizer,
    parse_remat,
)
from workloads.training.remat import RematPlan, check_custom_names, remat_plan
from workloads.training.xla_rules import XLA_MAX_WINDOWED_RING
from workloads.xla_compiler import COMPILER_RULES, XlaCompilerSpec


def check_stateless_optimizer(optimizer: str, optimizer_dtypes: tuple[str, ...]) -> None:
    """An optimizer with no state (SGD) takes no `optimizer_dtype` but the default: another
    one would change nothing (and repeat every candidate of a plan)."""
    if Optimizer(optimizer).state_tensors or all(
            dtype_bytes(d, "optimizer_dtype") == Dtype.FP32.nbytes for d in optimizer_dtypes):
        return
    raise TpusimError(
        f"{{optimizer_dtype}} {short_repr(','.join(optimizer_dtypes))} with {{optimizer}} "
        f"{Optimizer(optimizer).value}: it keeps no optimizer state, so the state's dtype changes "
        f"nothing; drop {{optimizer_dtype}} or use {{optimizer}} adam",
        "optimizer_dtype", "optimizer")


# `logits_dtype`'s and `mlp_act_dtype`'s values (fp32's other spelling, f32, reads as fp32).
LOGITS_DTYPES = ("bf16", "fp32")
MLP_ACT_DTYPES = ("bf16", "fp32")
# `embed_lookup`'s values: XLA's choice by rule, or one form forced (forward and gradient).
EMBED_LOOKUPS = ("auto", "all-to-all", "all-gather")


def _mode(choices: type[enum.StrEnum], value: object) -> enum.StrEnum | None:
    """`value` as a member of the mode `choices` (its exact text, or a member), else None."""
    try:
        return choices(value)
    except (ValueError, TypeError):
        return None


# The chip compiler's memory rules a TrainingConfig carries (sim/ sets them from the chip's
# XlaCompilerSpec).
COMPILER_RULE_FIELDS = COMPILER_RULES


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """Run settings of one training step (the `sim.train` settings of the same names)."""

    seq_len: int
    batch_per_chip: float
    remat: Remat = Remat.FULL
    # `--remat custom`'s MaxText tensor names kept on device and offloaded to host
    # (workloads/training/remat.py; empty for every other policy).
    remat_save: tuple[str, ...] = field(default=(), metadata={"recorded_when_set": True})
    remat_offload: tuple[str, ...] = field(default=(), metadata={"recorded_when_set": True})
    attention: Attention = Attention.FLASH
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
    fsdp_gather: FsdpGather = FsdpGather.ASYNC
    fuse_elementwise: bool = True
    tp_activations: TpActivations = TpActivations.SHARDED
    tp_comm: TpComm = TpComm.BLOCKING
    dp_allreduce: DpAllreduce = DpAllreduce.ASYNC
    # How each weight gradient is summed over fsdp: "reduce-scatter" (async, hidden behind
    # the backward; tpusim's default), "all-reduce": the whole gradient all-reduced by a
    # synchronous collective that blocks the core, each chip keeping its shard (XLA's v6e
    # program with async collective fusion and no collective matmuls, docs/model.md), or
    # "auto": per matrix, as XLA chooses by the length of the matrix's FSDP ring
    # (`xla_rules.grad_kind`).
    fsdp_grad: FsdpGrad = FsdpGrad.REDUCE_SCATTER
    # How the data-parallel gradient all-reduce crosses slices (a data or sequence axis over
    # DCN): "per-matrix", one all-reduce per weight matrix and one for each layer's norm
    # scales, one after another, as XLA compiles it (benchmarks/xla_dcn_schedule.py), or
    # "per-layer", one all-reduce of the layer's gradient shards (tpusim's earlier model).
    dp_grad_split: DpGradSplit = DpGradSplit.PER_MATRIX
    ep_alltoall: EpAlltoall = EpAlltoall.SYNC
    # How an MoE layer's tokens reach its experts over `expert` (docs/model/moe.md "The
    # dispatch form"): "all-to-all" (the tokens to their experts' chips and back), "all-gather"
    # (every chip of an expert group gathers the group's tokens, runs its own experts on them
    # and the combine's partial sums are reduced over `expert`) or "auto", XLA's choice for
    # the program (`xla_rules.moe_dispatch_form`). Recorded only when not the default.
    moe_dispatch: MoeDispatch = field(default=MoeDispatch.AUTO,
                                      metadata={"recorded_when_set": True})
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
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
    # int8 (AQT) training (docs/model/int8.md; `workloads/training/quant.py`): the MXU format
    # of the weight matmuls, forward and both backward matmuls (bf16, int8; fp8 where the chip
    # has an fp8 rate), with the quantization of their operands costed on the VPU. Recorded
    # only when not the default, so bf16 results read as before.
    matmul_dtype: str = field(default="bf16", metadata={"recorded_when_set": True})
    # The attention's score and value matmuls (forward and backward) and the output
    # projection to the logits (with its backward) in `matmul_dtype` too; MaxText's int8 keeps
    # both bf16 (its AQT config wraps the DenseGeneral layers and the MoE experts only).
    quantize_attention: bool = field(default=False, metadata={"recorded_when_set": True})
    quantize_logits: bool = field(default=False, metadata={"recorded_when_set": True})
    # One scale per row/column of an operand along the contraction (AQT's default) or one
    # per tensor.
    quant_scales: QuantScales = field(default=QuantScales.PER_CHANNEL,
                                      metadata={"recorded_when_set": True})
    # The format FSDP gathers carry the weights in: int8 (each chip quantizes its shard
    # before the gather, as XLA compiles MaxText's AQT program: its rings carry int8 shards,
    # validation/xla_int8.py) or bf16 (the gathered matrix is quantized per pass).
    quant_gather: str = field(default="int8", metadata={"recorded_when_set": True})
    # Stochastic rounding of the gradient operand of both backward matmuls (AQT's config_v3:
    # uniform noise from random bits), or round-to-nearest.
    stochastic_rounding: bool = field(default=True, metadata={"recorded_when_set": True})
    # The dtype of the output projection's dot (docs/model/training.md "The logits path's
    # dtype"): "bf16", its operands in bf16 and its logits cast to f32 for the loss (MaxText's
    # default, `logits_dot_in_fp32: False` with `cast_logits_to_fp32: True`), or "fp32", both
    # operands cast to f32 before the dot (`logits_dot_in_fp32: True`): at jax's default
    # precision the dot runs as one bf16 pass on bf16-rounded operands, so only the
    # projection's weight gradient is f32. Recorded only when not the default.
    logits_dtype: str = field(default="bf16", metadata={"recorded_when_set": True})
    # The dtype of the MLP's activation intermediates (docs/model/training.md "The MLP
    # activation's dtype"): "bf16" (MaxText's default, `activations_in_float32: False`) or
    # "fp32" (`activations_in_float32: True`: the gate and up projections' bf16 outputs cast
    # to f32 before the activation, the product cast back to bf16 for the down projection).
    # Recorded only when not the default.
    mlp_act_dtype: str = field(default="bf16", metadata={"recorded_when_set": True})
    # The embedding lookup's collective, forward and gradient (docs/model.md "Collectives as
    # XLA emits them"): "auto" (`xla_rules.embedding_lookup_alltoall` and
    # `embedding_grad_rows_gathered` decide), "all-to-all" (the activations' all-to-all over
    # the table's d_model shards, the gradient rows sent back by all-to-all) or "all-gather"
    # (the table all-gathered for the lookup, its gradient reduce-scattered as a weight's).
    # Recorded only when not the default.
    embed_lookup: str = field(default="auto", metadata={"recorded_when_set": True})

    def __post_init__(self) -> None:
        # The checks run in this order so that a config with several bad settings names the
        # same one first as it always has; each mode given as text becomes its enum where it
        # is checked.
        self._check_sizes()
        self._check_modes()
        self._check_schedule_and_dtypes()

    def _set_mode(self, name: str, choices: type[enum.StrEnum]) -> bool:
        """Parse the mode `name` into `choices`; False if its value names none."""
        member = _mode(choices, getattr(self, name))
        if member is None:
            return False
        object.__setattr__(self, name, member)
        return True

    def _check_sizes(self) -> None:
        if not isinstance(self.seq_len, int) or not 1 <= self.seq_len <= MAX_TOKENS:
            raise TpusimError(f"{{seq_len}} {short_repr(self.seq_len)} must be "
                              f"{range_text(1, MAX_TOKENS, integer=True)}", "seq_len")
        if not (isinstance(self.batch_per_chip, (int, float)) and 0 < self.batch_per_chip
                <= MAX_BATCH and math.isfinite(self.batch_per_chip)):
            raise TpusimError(
                f"{{batch_per_chip}} {short_repr(self.batch_per_chip)} must be in "
                f"{interval_text(0, MAX_BATCH, lo_open=True)} (sequences per chip)",
                "batch_per_chip"
            )
        if not isinstance(self.remat, Remat):
            # A policy given as text (the Python API): parsed here, so that a bad one is a
            # one-line error and not an AttributeError deep in the compiler.
            object.__setattr__(self, "remat", parse_remat(self.remat))
        for name in ("remat_save", "remat_offload"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = tuple(x.strip() for x in v.split(",") if x.strip())
            if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
                raise TpusimError(f"--{name.replace('_', '-')} {short_repr(v)} must be a list "
                                  f"of MaxText tensor names")
            object.__setattr__(self, name, tuple(v))
        if (self.remat_save or self.remat_offload) and self.remat != Remat.CUSTOM:
            raise TpusimError(f"{{remat_save}} and {{remat_offload}} name the tensors of "
                              f"{{remat}} custom, and {{remat}} is {self.remat}; use {{remat}} "
                              f"custom or drop them", "remat_save", "remat_offload", "remat")
        check_custom_names(self.remat_save, self.remat_offload)
        if not self._set_mode("attention", Attention):
            raise TpusimError(f"{{attention}} {short_repr(self.attention)} must be dot or flash",
                              "attention")
        for flag in COMPILER_RULE_FIELDS:
            if not isinstance(getattr(self, flag), bool):
                raise TpusimError(f"{flag} {short_repr(getattr(self, flag))} must be "
                                  f"true or false (the chip's {flag})")
        if isinstance(self.vocab_tiling, bool) or not isinstance(self.vocab_tiling, int) or \
                not 1 <= self.vocab_tiling <= MAX_CHUNKS:
            raise TpusimError(f"{{vocab_tiling}} {short_repr(self.vocab_tiling)} must be "
                              f"{range_text(1, MAX_CHUNKS, integer=True)} (1: no tiling)",
                              "vocab_tiling")
        if not isinstance(self.microbatches, int) or not 1 <= self.microbatches <= MAX_CHUNKS:
            raise TpusimError(f"{{microbatches}} {short_repr(self.microbatches)} must be "
                              f"{range_text(1, MAX_CHUNKS, integer=True)}", "microbatches")

    def _check_modes(self) -> None:
        if not self._set_mode("fsdp_gather", FsdpGather):
            raise TpusimError(
                f"{{fsdp_gather}} {short_repr(self.fsdp_gather)} is not a mode; "
                f"{one_of(self.fsdp_gather, FSDP_GATHER_MODES)}", "fsdp_gather"
            )
        if not self._set_mode("tp_activations", TpActivations):
            raise TpusimError(
                f"{{tp_activations}} {short_repr(self.tp_activations)} must be sharded or "
                f"replicated",
                "tp_activations"
            )
        if not self._set_mode("tp_comm", TpComm):
            raise TpusimError(
                f"{{tp_comm}} {short_repr(self.tp_comm)} must be blocking or collective-matmul",
                "tp_comm"
            )
        if not self._set_mode("dp_allreduce", DpAllreduce):
            raise TpusimError(
                f"{{dp_allreduce}} {short_repr(self.dp_allreduce)} must be async or blocking",
                "dp_allreduce"
            )
        if not self._set_mode("dp_grad_split", DpGradSplit):
            raise TpusimError(
                f"{{dp_grad_split}} {short_repr(self.dp_grad_split)} must be per-matrix (one "
                f"cross-slice all-reduce per weight matrix and one for the norm scales, as XLA "
                f"compiles it, default) or per-layer (one per layer)", "dp_grad_split"
            )
        if not self._set_mode("fsdp_grad", FsdpGrad):
            raise TpusimError(
                f"{{fsdp_grad}} {short_repr(self.fsdp_grad)} must be reduce-scatter (async, "
                f"default), all-reduce (synchronous, XLA's v6e program without collective "
                f"matmuls) or auto (XLA's choice per matrix: reduce-scatter over up to "
                f"{XLA_MAX_WINDOWED_RING} chips, all-reduce above)", "fsdp_grad"
            )
        if self.fsdp_grad == FsdpGrad.ALL_REDUCE and self.fsdp_gather == FsdpGather.WINDOWED:
            raise TpusimError(
                "{fsdp_grad} all-reduce with {fsdp_gather} windowed: a collective matmul "
                "reduce-scatters the gradient in its ring; use {fsdp_gather} async or blocking "
                "with it", "fsdp_grad", "fsdp_gather"
            )
        if self.fsdp_grad == FsdpGrad.AUTO and self.fsdp_gather == FsdpGather.WINDOWED:
            raise TpusimError(
                f"{{fsdp_grad}} auto with {{fsdp_gather}} windowed: windowed runs every gradient's "
                f"reduce-scatter as a collective-matmul ring at any ring length, where auto "
                f"all-reduces over more than {XLA_MAX_WINDOWED_RING} chips; use {{fsdp_gather}} "
                f"mixed-async or mixed-blocking (XLA's choice of both), async or blocking "
                f"with it", "fsdp_grad", "fsdp_gather"
            )
        if self.fsdp_grad == FsdpGrad.ALL_REDUCE and self.fsdp_gather.startswith("mixed"):
            raise TpusimError(
                f"{{fsdp_grad}} all-reduce with {{fsdp_gather}} {self.fsdp_gather}: the mixed "
                f"modes "
                f"choose each gradient's collective as XLA does (windowed reduce-scatter rings "
                f"up to {XLA_MAX_WINDOWED_RING} chips, synchronous all-reduces above); drop "
                f"{{fsdp_grad}}, or use {{fsdp_gather}} async or blocking with it",
                "fsdp_grad", "fsdp_gather"
            )
        if not self._set_mode("ep_alltoall", EpAlltoall):
            raise TpusimError(
                f"{{ep_alltoall}} {short_repr(self.ep_alltoall)} must be sync (XLA's default) or "
                f"async (libtpu's {{xla}}_tpu_enable_async_all_to_all)", "ep_alltoall", "xla"
            )
        if not self._set_mode("moe_dispatch", MoeDispatch):
            raise TpusimError(
                f"{{moe_dispatch}} {short_repr(self.moe_dispatch)} must be auto (XLA's choice, "
                f"default), all-to-all or all-gather (the tokens gathered over expert, the "
                f"combine reduced)", "moe_dispatch"
            )

    def _check_schedule_and_dtypes(self) -> None:
        if not self._set_mode("pipeline_schedule", PipelineSchedule):
            raise TpusimError(
                f"{{pipeline_schedule}} {short_repr(self.pipeline_schedule)} must be one of "
                f"{', '.join(PIPELINE_SCHEDULES)}", "pipeline_schedule"
            )
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TpusimError(f"{{virtual_stages}} {short_repr(v)} must be an integer >= 1",
                              "virtual_stages")
        if v > 1 and self.pipeline_schedule != PipelineSchedule.INTERLEAVED:
            raise TpusimError(
                f"{{virtual_stages}} {v} needs {{pipeline_schedule}} interleaved (gpipe and 1f1b "
                f"hold one chunk of layers per stage); drop it or switch the schedule",
                "virtual_stages", "pipeline_schedule"
            )
        if not isinstance(self.optimizer, Optimizer):
            object.__setattr__(self, "optimizer", parse_optimizer(self.optimizer))
        for name, v in (("param_dtype", self.param_dtype), ("grad_dtype", self.grad_dtype),
                        ("optimizer_dtype", self.optimizer_dtype)):
            dtype_bytes(v, name)
        if self.gather_dtype is not None:
            dtype_bytes(self.gather_dtype, "gather_dtype")
        check_stateless_optimizer(self.optimizer, (self.optimizer_dtype,))
        v = self.logits_dtype
        if isinstance(v, str) and v.lower() == "f32":
            v = "fp32"
        if not isinstance(v, str) or v.lower() not in LOGITS_DTYPES:
            raise TpusimError(f"{{logits_dtype}} {short_repr(v)} must be bf16 (the output "
                              f"projection's dot in bf16, its logits cast to f32: MaxText's "
                              f"default) or fp32 (the dot's operands in f32, MaxText's "
                              f"logits_dot_in_fp32)", "logits_dtype")
        object.__setattr__(self, "logits_dtype", v.lower())
        v = self.mlp_act_dtype
        if isinstance(v, str) and v.lower() == "f32":
            v = "fp32"
        if not isinstance(v, str) or v.lower() not in MLP_ACT_DTYPES:
            raise TpusimError(f"{{mlp_act_dtype}} {short_repr(v)} must be bf16 (the MLP's "
                              f"activation in bf16: MaxText's default) or fp32 (its "
                              f"intermediates in f32, MaxText's activations_in_float32)",
                              "mlp_act_dtype")
        object.__setattr__(self, "mlp_act_dtype", v.lower())
        v = self.embed_lookup
        if not isinstance(v, str) or v.lower() not in EMBED_LOOKUPS:
            raise TpusimError(f"{{embed_lookup}} {short_repr(v)} must be auto (XLA's choice "
                              f"by rule), all-to-all (the activations' all-to-all over the "
                              f"table's shards) or all-gather (the table gathered for the "
                              f"lookup)", "embed_lookup")
        object.__setattr__(self, "embed_lookup", v.lower())
        self._check_quantization()

    def _check_quantization(self) -> None:
        v = self.matmul_dtype
        names = ", ".join(d.value for d in TRAINING_MATMUL_DTYPES)
        if not isinstance(v, str) or v.lower() not in TRAINING_MATMUL_DTYPES:
            raise TpusimError(f"{{matmul_dtype}} {short_repr(v)} is not a training matmul "
                              f"format; use one of: {names}", "matmul_dtype")
        object.__setattr__(self, "matmul_dtype", v.lower())
        if not self._set_mode("quant_scales", QuantScales):
            raise TpusimError(f"{{quant_scales}} {short_repr(self.quant_scales)} must be "
                              f"per-channel (AQT's default) or per-tensor", "quant_scales")
        if self.quant_gather not in ("int8", "bf16"):
            raise TpusimError(f"{{quant_gather}} {short_repr(self.quant_gather)} must be int8 "
                              f"(each shard quantized before its gather, XLA's compile of "
                              f"MaxText's int8) or bf16 (quantized after it)", "quant_gather")
        for name in ("quantize_attention", "quantize_logits", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TpusimError(f"{name} {short_repr(getattr(self, name))} must be true or "
                                  f"false")
        if self.quantize_logits and self.logits_dtype != "bf16":
            raise TpusimError("{quantize_logits} with {logits_dtype} fp32: the output "
                              "projection's dot is either quantized or in f32; drop one",
                              "quantize_logits", "logits_dtype")
        if self.matmul_dtype == "bf16":
            given = [(name, value) for name, value, on in (
                ("quantize_attention", "", self.quantize_attention),
                ("quantize_logits", "", self.quantize_logits),
                ("quant_gather", " bf16", self.quant_gather != "int8"),
                ("quant_scales", " per-tensor", self.quant_scales != QuantScales.PER_CHANNEL),
                ("no_stochastic_rounding", "", not self.stochastic_rounding)) if on]
            if given:
                name, value = given[0]
                raise TpusimError(f"{{{name}}}{value} quantizes matmuls, and {{matmul_dtype}} is "
                                  f"bf16; add {{matmul_dtype}} int8 or drop {{{name}}}",
                                  name, "matmul_dtype")

    @property
    def remat_plan(self) -> RematPlan:
        """What the remat policy keeps, offloads and recomputes per layer."""
        return _plan(self.remat, self.remat_save, self.remat_offload)

    @property
    def compiler(self) -> XlaCompilerSpec:
        """The chip compiler's rules this step is compiled with."""
        return XlaCompilerSpec(**{name: getattr(self, name) for name in COMPILER_RULES})

    @property
    def quantized(self) -> bool:
        """The weight matmuls run in int8 or fp8 (`matmul_dtype`)."""
        return self.matmul_dtype != "bf16"

    @property
    def weight_gather_dtype(self) -> str:
        """The dtype weights are gathered and multiplied in (`gather_dtype`, else the params')."""
        return self.param_dtype if self.gather_dtype is None else self.gather_dtype


@functools.lru_cache(maxsize=256)
def _plan(policy: Remat, save: tuple[str, ...], offload: tuple[str, ...]) -> RematPlan:
    return remat_plan(policy, save, offload)


def training_config_to_dict(config: TrainingConfig) -> dict:
    """`config` as plain JSON values (`training_config_from_dict` reads it back)."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name == "moe":
            v = {g.name: getattr(v, g.name) for g in dataclasses.fields(v)}
        if f.metadata.get("recorded_when_set"):
            if v == f.default:
                continue  # recorded only when set (older traces have no such key)
            if isinstance(v, tuple):
                v = list(v)
        out[f.name] = str(v) if isinstance(v, enum.Enum) else v
    return out


def training_config_from_dict(data: dict, *, source: str = "trace") -> TrainingConfig:
    """The `TrainingConfig` written by `training_config_to_dict` (validated as on the CLI)."""
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
