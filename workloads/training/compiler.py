"""Compile one Transformer training step into an SPMD `Trace` (per-chip ops and collectives):
the checks that a model, a mesh and the run settings make a program, the entry points (a whole
step, cached; one pipeline chunk; the HBM estimate without a build), and `Compiler`, the
step's program builder assembled from the package's parts.
"""

from __future__ import annotations

import dataclasses

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh, dcn_hint
from topologies.validate import MAX_TRACE_OPS
from workloads.models import TransformerSpec
from workloads.trace import Trace
from workloads.trace_meta import TraceMeta
from workloads.training import cache
from workloads.training.config import TrainingConfig, training_config_to_dict
from workloads.training.program import Dims
from workloads.training.step import StepProgram

# Ops a microbatch adds per layer at the least: 21.75 to 71.75 over a 4-layer model's meshes
# (data, fsdp, tensor, fsdp x tensor), remat policies and attention forms (tests/test_training.py
# checks the bound on them); 8 leaves room for forms not measured.
MIN_OPS_PER_LAYER = 8


class Compiler(StepProgram):
    """The program builder of one training step (or pipeline chunk) for one compile input."""


def _check_pattern_per_stage(model: TransformerSpec, layers: int, split: str) -> None:
    # Every pipeline chunk compiles the same program (its layers numbered from 0): a mixed
    # local/global pattern, and the dense/MoE one, must repeat whole within a chunk for that
    # program to be each chunk's; the first chunk's dense layers and the MTP modules after the
    # last one would make the chunks differ.
    period = model.global_layer_period
    if model.local_attention_span is not None and period and layers % period:
        raise TpusimError(
            f"{split} gives each pipeline chunk {layers} layers, which does not hold whole "
            f"periods of the model's local/global pattern (global_layer_period={period}); pick "
            f"a pipeline size that leaves a multiple of {period} layers per chunk"
        )
    if layers == model.num_layers:
        return
    moe_period = model.moe_layer_period
    if model.is_moe and moe_period > 1 and layers % moe_period:
        raise TpusimError(
            f"{split} gives each pipeline chunk {layers} layers, which does not hold whole "
            f"periods of the model's dense/MoE pattern (moe_layer_period={moe_period}); pick "
            f"a pipeline size that leaves a multiple of {moe_period} layers per chunk"
        )
    for field in ("first_dense_layers", "num_mtp_modules"):
        if getattr(model, field):
            raise TpusimError(
                f"{split} splits the layers into pipeline chunks, and every chunk runs the "
                f"same program: {field}={getattr(model, field)} (layers only the first or the "
                f"last chunk has) is not modelled with a pipeline axis; drop pipeline from the "
                f"mesh, or set {field} to 0 with {{set}} model.{field}=0", "set"
            )


def _check_divisible(what: str, value: int, axis: str, size: int, fix: str,
                     *params: str) -> None:
    """`fix` may name settings as placeholders (`params`, TpusimError's)."""
    if size > 1 and value % size:
        raise TpusimError(
            f"mesh axis {axis}={size} does not divide {what} = {value}; {fix}", *params
        )


def compile_training_step(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> Trace:
    """The SPMD program of one training step for `num_chips` chips laid out as `mesh` (cached:
    an equal compile input returns an equal trace, on `mesh` itself).

    With a pipeline axis the meta also records the model and the settings
    (`pipeline_compile`), so that a replay of the trace file can compose the stage programs
    the schedule runs (`sim/engine/pipeline.py`)."""
    key = (model, tuple(sorted(mesh.axes)), tuple(sorted(mesh.dcn_axes)), num_chips, config)
    hit = cache.cached(key)
    if hit is None:
        hit = program_compiler(model, mesh, num_chips, config).build()
        if mesh.size("pipeline") > 1:
            hit = _with_meta(hit, hit.meta.with_(pipeline_compile={
                "model": model.to_dict(), "config": training_config_to_dict(config)}))
        cache.store(key, hit)
    # The ops were validated against these axis names when compiled (the order does not
    # matter to them), so skip `Trace.__post_init__`, a full pass over the ~10k ops of a large
    # model. Ops and meta are frozen and shared.
    return _with_meta(hit, hit.meta, mesh)


def _with_meta(trace: Trace, meta: TraceMeta, mesh: LogicalMesh | None = None) -> Trace:
    """`trace` with `meta` (and `mesh`), without re-validating its ops."""
    out = object.__new__(Trace)
    for name, value in (("mesh", mesh or trace.mesh), ("ops", trace.ops), ("meta", meta)):
        object.__setattr__(out, name, value)
    return out


def estimate_training_memory(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> dict[str, float]:
    """The compiler's HBM estimate per chip without building the trace (what `plan` prunes
    with): `static_bytes` (params and optimizer state; gradients are backward temporaries) and
    `activations_bytes` (saved activations at their peak, when the forward ends; together a
    lower bound of the step's peak), the same numbers as the trace's `static_hbm_bytes` and
    `activation_bytes_estimate`. Raises the compiler's errors for a mesh that cannot run."""
    c = program_compiler(model, mesh, num_chips, config)
    p_local = c.local_params()
    return {"static_bytes": p_local * (c.wb + c.state_bytes_per_param),
            "activations_bytes": c.activation_peak()}


def program_compiler(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig
) -> Compiler:
    tp, fs, dp = mesh.size("tensor"), mesh.size("fsdp"), mesh.size("data")
    ep, pp, sp = mesh.size("expert"), mesh.size("pipeline"), mesh.size("sequence")
    if mesh.num_ici_devices * mesh.num_slices != num_chips:
        raise TpusimError(
            f"mesh {mesh.describe()} covers {mesh.num_ici_devices * mesh.num_slices} chips but "
            f"the pod has {num_chips}; make the mesh axes multiply to {num_chips}"
            + dcn_hint(mesh, num_chips), "dcn", "slices"
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
                     "pick a sequence size that divides {seq_len}", "seq_len")
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
            f"{{batch_per_chip}} {config.batch_per_chip} x {num_chips} chips is not a whole number "
            f"of sequences; change the batch", "batch_per_chip"
        )
    global_seqs = int(round(global_seqs))
    if global_seqs < 1:  # a tiny positive value (1e-320) is within the tolerance of 0
        raise TpusimError(
            f"{{batch_per_chip}} {config.batch_per_chip:g} x {num_chips} chips is under one "
            f"sequence; give at least 1/{num_chips} = {1 / num_chips:g} (one sequence per pod)",
            "batch_per_chip"
        )
    batch_shards = dp * fs * ep
    if global_seqs % batch_shards:
        raise TpusimError(
            f"the global batch of {global_seqs} sequences is not divisible by data x fsdp x "
            f"expert = {batch_shards}; change {{batch_per_chip}} or the mesh", "batch_per_chip"
        )
    local_seqs = global_seqs // batch_shards
    if local_seqs % config.microbatches:
        raise TpusimError(
            f"{{microbatches}} {config.microbatches} does not divide the {local_seqs} sequences "
            f"each data shard holds; pick a divisor of {local_seqs}", "microbatches"
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
            f"{{microbatches}} {config.microbatches} x {layers} layers{where} compiles to at least "
            f"{least:,} ops ({MIN_OPS_PER_LAYER} per layer and microbatch), over the "
            f"{MAX_TRACE_OPS:,} tpusim simulates in one program; use at most "
            f"{max(MAX_TRACE_OPS // (layers * MIN_OPS_PER_LAYER), 1):,} microbatches",
            "microbatches"
        )
    config.moe.check_model(model)
    if config.ep_alltoall == "async" and ep == 1:
        # Only the all-to-alls over an expert axis overlap: without one the flag changes
        # nothing, like --capacity-factor on a dense model.
        why = f"{model.name} is dense" if not model.is_moe else "the mesh has no expert axis"
        raise TpusimError(
            f"{{ep_alltoall}} async overlaps the MoE all-to-alls over the expert axis, and this "
            f"run has none ({why}); drop {{ep_alltoall}}"
            + ("" if not model.is_moe else " or add expert=N to the mesh"), "ep_alltoall")
    if config.moe_dispatch != "auto" and ep == 1:
        # Both forms move tokens over an expert axis: without one the flag changes nothing.
        why = f"{model.name} is dense" if not model.is_moe else "the mesh has no expert axis"
        raise TpusimError(
            f"{{moe_dispatch}} {config.moe_dispatch} chooses how MoE tokens cross the expert "
            f"axis, and this run has none ({why}); drop {{moe_dispatch}}"
            + ("" if not model.is_moe else " or add expert=N to the mesh"), "moe_dispatch")
    if config.moe_dispatch == "all-gather" and config.ep_alltoall == "async":
        raise TpusimError(
            "{ep_alltoall} async overlaps the MoE all-to-alls, and {moe_dispatch} all-gather "
            "has none (its gathers and reductions are synchronous, as XLA compiles them); "
            "drop one", "ep_alltoall", "moe_dispatch")
    loss_rows = local_seqs * config.seq_len / sp / config.microbatches
    if config.vocab_tiling > 1 and loss_rows % config.vocab_tiling:
        raise TpusimError(
            f"{{vocab_tiling}} {config.vocab_tiling} does not divide the {loss_rows:g} tokens each "
            f"chip's loss processes per microbatch; pick a divisor of {loss_rows:g}", "vocab_tiling"
        )
    d = Dims(
        n=local_seqs * config.seq_len / sp / config.microbatches,
        ctx=config.seq_len,
        tp=tp, fs=fs, dp=dp, ep=ep, pp=pp, sp=sp,
        # The MTP modules' blocks run as layers after the main ones (`StepProgram`).
        layers=model.num_layers // pp + (model.num_mtp_modules if pp == 1 else 0),
    )
    return Compiler(model, mesh, d, config, num_chips, global_seqs)


def compile_pipeline_chunk(
    model: TransformerSpec, mesh: LogicalMesh, num_chips: int, config: TrainingConfig, *,
    first: bool, last: bool,
) -> Trace:
    """One microbatch through one pipeline chunk (num_layers / (pipeline x virtual_stages)
    layers): its forward, its backward and the stage's optimizer update, without
    stage-to-stage sends (the schedule simulation adds them). `first` holds the embedding,
    `last` the output projection and the loss."""
    pp, v = mesh.size("pipeline"), config.virtual_stages
    if model.num_layers % (pp * v):
        raise TpusimError(
            f"num_layers = {model.num_layers} is not divisible by pipeline x virtual stages = "
            f"{pp} x {v}; pick sizes whose product divides the layer count"
        )
    _check_pattern_per_stage(model, model.num_layers // (pp * v),
                             f"pipeline={pp} x virtual stages={v}")
    c = program_compiler(model, mesh, num_chips, dataclasses.replace(config, microbatches=1))
    # One microbatch of the real microbatch size, through num_layers / (pp x V) layers.
    c.d = dataclasses.replace(c.d, n=c.d.n / config.microbatches,
                              layers=model.num_layers // (pp * v))
    c.embed_on, c.head_on, c.sends_on = first, last, False
    c.cast_per_pass = False
    return c.build()
