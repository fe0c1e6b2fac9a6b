"""Training steps as runs: `run_train(TrainRequest)` compiles the step and simulates it (the
pipeline stages on the per-chip engine when the mesh has a pipeline axis) and returns a `Run`
whose summary is the result's JSON (`Run.to_dict`, what the CLI prints as JSON). Replays of
trace files and HLO text are `sim.runs.replay` (their readers are not a training step's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sim.energy import energy_summary, step_energy
from sim.engine.pipeline import build_stage_programs, check_schedule, simulate_pipeline_chips
from sim.runs.auto_switch import auto_switch_report
from sim.runs.bind import (
    algorithm_of,
    base_inputs,
    moe_config,
    per_chip_config,
    reports_failures,
    resolve_model,
    resolve_pod,
    scenario_of,
    simulate_step,
)
from sim.runs.power import simulate_with_cap
from sim.runs.requests import TrainRequest
from sim.runs.result import Run, describe_config, describe_mesh
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.moe import expert_op_scales
from workloads.training import (
    TrainingConfig,
    compile_training_step,
    parse_optimizer,
    parse_remat,
)


def training_config(req, moe=None, chip=None) -> TrainingConfig:
    """The TrainingConfig of a request's training settings (validated: every enum, range and
    dtype). `chip`: the ChipSpec the step runs on, whose compiler behaviour the trace's memory
    follows; None (a compile request's `chips` count, no chip) compiles with each of those
    rules off."""
    return TrainingConfig(
        seq_len=req.seq_len,
        batch_per_chip=req.batch_per_chip,
        remat=parse_remat(req.remat),
        remat_save=req.remat_save or (),
        remat_offload=req.remat_offload or (),
        attention=req.attention,
        microbatches=req.microbatches,
        param_dtype=req.param_dtype,
        grad_dtype=req.grad_dtype,
        gather_dtype=req.gather_dtype,
        optimizer_dtype=req.optimizer_dtype,
        optimizer=parse_optimizer(req.optimizer),
        overlap=not req.no_overlap,
        fsdp_gather=req.fsdp_gather,
        fuse_elementwise=not req.no_fusion,
        tp_activations=req.tp_activations,
        tp_comm=req.tp_comm,
        dp_allreduce=req.dp_allreduce,
        fsdp_grad=req.fsdp_grad,
        dp_grad_split=req.dp_grad_split,
        ep_alltoall=req.ep_alltoall,
        moe_dispatch=req.moe_dispatch,
        vocab_tiling=req.vocab_tiling,
        logits_dtype=req.logits_dtype,
        mlp_act_dtype=req.mlp_act_dtype,
        embed_lookup=req.embed_lookup,
        pipeline_schedule=req.pipeline_schedule or "1f1b",
        virtual_stages=req.virtual_stages,
        matmul_dtype=req.matmul_dtype,
        quantize_attention=req.quantize_attention,
        quantize_logits=req.quantize_logits,
        quant_scales=req.quant_scales,
        quant_gather=req.quant_gather,
        stochastic_rounding=not req.no_stochastic_rounding,
        moe=moe if moe is not None else moe_config(req),
        # TrainingConfig's defaults for these are false, as `compile --chips N` wants them.
        **(chip.compiler_rules() if chip is not None else {}),
    )


def compile_inputs(req, moe=None, chip=None):
    """(base model, model, LogicalMesh, TrainingConfig) that `compile_step` compiles."""
    if chip is not None:
        chip.check_matmul_dtype(str(req.matmul_dtype).lower())
    base_model, model = resolve_model(req)
    mesh = parse_mesh(req.mesh, req.dcn, req.axis_map)
    return base_model, model, mesh, training_config(req, moe, chip)


def compile_step(req, num_chips: int, moe=None, chip=None):
    """(trace, base model, model, TrainingConfig) of a request's training settings."""
    base_model, model, mesh, cfg = compile_inputs(req, moe, chip)
    return compile_training_step(model, mesh, num_chips, cfg), base_model, model, cfg


def training_summary(trace, result, chip) -> dict[str, Any]:
    """The result fields of a simulated training step (its `to_dict`)."""
    meta = trace.meta
    step = result.step_time_s
    if not step > 0:
        raise TpusimError(
            f"the step takes {step} s: the program does no work (every op has zero size), so "
            f"MFU and throughput are undefined; give a trace with compute or communication"
        )
    tokens_per_chip = meta.tokens_per_step / meta.num_chips
    out = {
        "model": meta.model,
        "chip": result.chip,
        "topology": result.topology,
        "num_chips": result.num_chips,
        "step_time_s": step,
        "mfu": meta.model_flops_per_chip / (step * chip.mxu_flops_per_s),
        "tokens_per_s_per_chip": tokens_per_chip / step,
        "model_flops_per_chip": meta.model_flops_per_chip,
        "maxtext_tflops_per_s_per_chip": meta.maxtext_flops_per_chip / step / 1e12,
        "hbm_peak_bytes": result.hbm_peak_bytes,
        "hbm_capacity_bytes": result.hbm_capacity_bytes,
        "fits_in_hbm": result.fits_in_hbm,
        "hbm_peak_breakdown": result.hbm_peak_breakdown,
        "breakdown": result.breakdown,
        "memory": {
            "static_bytes": meta.static_hbm_bytes,
            **meta.static_breakdown,
            "activations_estimate_bytes": meta.activation_bytes_estimate,
            "saved_activations_per_layer": meta.saved_activations_per_layer or {},
            "overflow_bytes": max(result.hbm_peak_bytes - result.hbm_capacity_bytes, 0.0),
        },
        "num_ops": result.num_ops,
        "sim_events": result.sim_events,
        "collectives": result.collective_costs,
        **per_chip_summary(result),
    }
    if meta.moe is not None:
        out["moe"] = meta.moe
    return out


def step_energy_of(trace, topo, tokens):
    """The energy function of a step of `trace` on `topo` (`simulate_with_cap`'s `energy_of`):
    its MoE expert loads as the engine was given them (none for pipeline stages, whose
    programs are their own), `tokens` for joules per token."""
    scales = {} if trace.mesh.size("pipeline") > 1 else expert_op_scales(trace, topo)
    return lambda result, chip: step_energy(result, trace, chip, tokens=tokens,
                                            op_scale=scales)


def with_energy(summary: dict[str, Any], energy, cap) -> dict[str, Any]:
    """`summary` with its `energy` and `cost` sections (and `power_cap` under a cap)."""
    summary.update(energy_summary(energy))
    if cap is not None:
        summary["power_cap"] = cap
    return summary


def per_chip_summary(result) -> dict[str, Any]:
    """The per-chip engine's result fields: how many chip classes were simulated, the chip
    that finished last and the critical path (chips, ops and links that set the step time)."""
    return {
        "num_chip_classes": result.num_chip_classes,
        "slowest_chip": result.slowest_chip,
        "critical_path": result.critical_path,
    }


@reports_failures
def run_train(req: TrainRequest) -> Run:
    """One training step: a `Run` with the step's summary, inputs, StepResult and trace."""
    pod = resolve_pod(req)
    chip, topo = pod.chip, pod.topology
    trace, base_model, model, cfg = compile_step(
        req, topo.num_chips, moe_config(req, scenario_of(req, topo)), chip=chip)
    if req.pipeline_schedule is not None or trace.mesh.size("pipeline") > 1:
        check_schedule(cfg.pipeline_schedule, trace.mesh.size("pipeline"), cfg.microbatches,
                       cfg.virtual_stages)
    piped = {}
    pipelined = trace.mesh.size("pipeline") > 1

    def step(c, algorithm):
        """(the step on chip `c` under `algorithm`, its PipelineResult or None)."""
        if pipelined:
            # Every stage's chips run the schedule's passes on the per-chip engine
            # (sim/engine/pipeline.py), with the request's perturbations; the bubble is what the
            # schedule produces.
            return simulate_pipeline_chips(
                model, trace.mesh, c, topo, cfg, base=pipeline_base(req, trace, topo),
                algorithm=algorithm)
        return simulate_step(req, trace, c, topo, algorithm=algorithm), None

    def simulate(c):
        r, piped["pipe"] = step(c, algorithm_of(req))
        return r

    result, chip, energy, cap = simulate_with_cap(
        req.power_cap, chip, simulate,
        step_energy_of(trace, topo, trace.meta.tokens_per_step))
    pipe = piped.get("pipe")
    inputs = base_inputs(req, pod, base_model)
    inputs["model"] = model.to_dict()
    inputs["mesh"] = describe_mesh(trace.mesh, topo)
    inputs["training"] = {**describe_config(cfg),
                          "global_batch": cfg.batch_per_chip * topo.num_chips,
                          "tokens_per_step": trace.meta.tokens_per_step}
    inputs["algorithm"] = algorithm_of(req)
    summary = training_summary(trace, result, chip)
    if pipe is not None:
        summary["pipeline"] = pipe.to_dict()
    if algorithm_of(req) == "auto":
        # A what-if on the chip's links may switch auto's picks: say so where that is what
        # slows the step (the section appears only then). A pipeline's chips run their stages'
        # programs, so its collectives are those programs' (built only where a pick may differ).
        programs = trace if not pipelined else (
            lambda: build_stage_programs(model, trace.mesh, topo.num_chips, cfg).programs)
        switch = auto_switch_report(programs, chip, pod.base_chip, topo, result.step_time_s,
                                    lambda held: step(chip, held)[0].step_time_s)
        if switch is not None:
            summary["auto_switch"] = switch
    with_energy(summary, energy, cap)
    return Run(command="train", summary=summary, inputs=inputs, result=result, trace=trace,
               energy_detail=energy)


def pipeline_base(req, trace, topo):
    """The request's perturbations for a pipeline run (its MoE expert loads come from the stage
    programs, not from the whole-step trace's op ids)."""
    return dataclasses.replace(per_chip_config(req, trace, topo), op_scale={})
