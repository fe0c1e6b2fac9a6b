"""Training steps and trace replays as runs: `run_train(TrainRequest)` compiles the step and
simulates it (the pipeline stages on the per-chip engine when the mesh has a pipeline axis);
`run_replay(ReplayRequest)` replays a trace file or XLA's compiled HLO text. Both return a
`Run` whose summary is the result's JSON (`Run.to_dict`, what the CLI prints as JSON).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sim.energy import energy_summary, step_energy
from sim.engine.executors import simulate_chips
from sim.engine.perchip import PointToPoint
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
from sim.runs.requests import ReplayRequest, TrainRequest
from sim.runs.result import Run, describe_config, describe_mesh
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.validate import MAX_TRACE_FILE_BYTES
from topologies.yamlio import read_text_bounded
from workloads.hlo.files import is_hlo_text, read_hlo_file
from workloads.hlo.lower import import_hlo
from workloads.moe import expert_op_scales
from workloads.trace import Trace
from workloads.trace_meta import TraceKind
from workloads.training import (
    TrainingConfig,
    compile_training_step,
    parse_optimizer,
    parse_remat,
    training_config_from_dict,
)
from workloads.zoo import model_from_dict


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


def load_hlo(path: str, topo):
    """(HloImport) for an HLO file on `topo`; its warnings go to stderr."""
    imp = import_hlo(read_hlo_file(path), topology=topo, source=path)
    for w in imp.warnings:
        sys.stderr.write(f"tpusim: warning: {w}\n")
    return imp


def check_hlo_has_ops(imp, path: str, what: str) -> None:
    """An HLO module that lowers to no ops (parameters, constants, tuples and scalar
    bookkeeping only: nothing runs on the chips) has nothing to `what` (replay, or write as a
    trace, which `replay` would refuse): one line, as for a trace file without ops."""
    if not imp.trace.ops:
        raise TpusimError(
            f"HLO module {imp.inventory['module']} ({path}) lowers to no ops: only parameters, "
            f"constants, tuples and scalar ops, so nothing runs on the chips and there is "
            f"nothing to {what}; give a program that computes or communicates")


def is_hlo(path: Path) -> bool:
    """Whether `path` (or, for `.gz`, its contents) starts like HLO module text."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                head = f.read(4096)
        else:
            with open(path, "rb") as f:
                head = f.read(4096)
    except (OSError, EOFError):
        return False
    return is_hlo_text(head.decode("utf-8", errors="replace"))


def hlo_summary(inv: dict[str, Any], result) -> dict[str, Any]:
    """The replay summary of an imported HLO program: step time plus its inventory totals."""
    return {
        "module": inv["module"], "chip": result.chip, "topology": result.topology,
        "num_chips": result.num_chips, "step_time_s": result.step_time_s,
        "breakdown": result.breakdown, "dot_flops_per_chip": inv["dot_flops_per_chip"],
        "collective_bytes_per_chip": inv["collective_bytes_per_chip"],
        "num_collectives": inv["num_collectives"], "num_ops": result.num_ops,
        "sim_events": result.sim_events, "collectives": result.collective_costs,
        # The program's HBM peak comes from its buffers' live ranges in XLA's schedule (the
        # trace has no memory events): the chip's HBM against it.
        "hbm_peak_bytes": float(inv["hbm_peak"]["hbm_peak_bytes"]),
        "hbm_capacity_bytes": float(result.hbm_capacity_bytes),
        "fits_in_hbm": inv["hbm_peak"]["hbm_peak_bytes"] <= result.hbm_capacity_bytes,
        "hbm_peak": inv["hbm_peak"],
    }


def is_chakra(spec: str) -> bool:
    """Whether `replay`'s input names a Chakra trace: a `.et`/`.et.gz` file, a directory, or a
    PREFIX whose `PREFIX.<rank>.et` files exist (any other path is a tpusim trace or HLO)."""
    p = Path(spec)
    if p.name.endswith((".et", ".et.gz")) or p.is_dir():
        return True
    if p.exists():
        return False
    return (p.parent / f"{p.name}.0.et").is_file() or (p.parent / f"{p.name}.0.et.gz").is_file()


def load_chakra(spec: str, topo, compute: str, comm_group: str | None = None):
    """(ChakraImport, the bytes `inputs.trace.sha256` digests: each rank file's SHA-256, and
    the comm-group file's) of a Chakra set converted for `topo`."""
    # deferred: start-up (the Chakra reader and wire format load for a Chakra replay only)
    from workloads.chakra.comm_group import check_ranks, read_comm_groups
    from workloads.chakra.convert import chakra_trace
    from workloads.chakra.reader import read_set

    groups, digest = read_comm_groups(comm_group) if comm_group is not None else (None, None)
    cset = read_set(spec)
    if groups:  # one file alone runs on every chip: its ranks are the pod's chips
        check_ranks(groups, cset.num_ranks if cset.num_ranks > 1 else topo.num_chips,
                    cset.source, comm_group)
    imp = chakra_trace(cset, topo, compute, comm_groups=groups)
    raw = "".join(f"{r.path}:{r.digest}\n" for r in cset.ranks)
    if digest is not None:
        raw += f"{comm_group}:{digest}\n"
    return imp, raw.encode("utf-8")


def chakra_summary(imp, result) -> dict[str, Any]:
    """The replay summary of a Chakra set: step time plus what the conversion approximated."""
    return {
        "source": imp.trace.meta.source, "chip": result.chip, "topology": result.topology,
        "num_chips": result.num_chips, "num_ranks": imp.num_ranks,
        "chakra_compute": imp.trace.meta.chakra_compute,
        "step_time_s": result.step_time_s, "breakdown": result.breakdown,
        "num_ops": result.num_ops, "sim_events": result.sim_events,
        "collectives": result.collective_costs, "approximations": list(imp.approximations),
    }


def missing_trace_error(path: Path) -> TpusimError:
    """What to say when `replay`'s input does not exist: where a file of that kind comes from
    (a trace file from `tpusim compile`, HLO text from XLA, a Perfetto trace is an output)."""
    name = path.name.lower().removesuffix(".gz")
    what = "trace file"
    if name.endswith((".hlo.txt", ".hlo", ".txt")):
        what, hint = "HLO file", (
            "HLO text is what XLA compiles (`compiled.as_text()`, an --xla_dump_to *.txt file); "
            "`tpusim make-hlo-fixture` compiles one for a slice and mesh (docs/howto/hlo.md)")
    elif name.endswith((".pftrace", ".perfetto-trace")):
        hint = ("a Perfetto trace is what {perfetto} writes, not a program; replay a trace file "
                "(`tpusim compile -o step.trace`), HLO text or a Chakra trace")
    else:
        hint = ("write one with `tpusim compile ... -o FILE` (or `tpusim import-hlo PROGRAM "
                "-o FILE` from HLO text)")
    kind = "a directory, not a file" if path.is_dir() else "does not exist"
    return TpusimError(f"{what} {str(path)!r} {kind}; {hint}", "perfetto")


@reports_failures
def run_replay(req: ReplayRequest, *, check_trace_chips=None) -> Run:
    """A trace file (or HLO text) replayed on the pod. The file's SHA-256 is recorded in
    `inputs`; when the request carries `trace_sha256` (`rerun`), a file that changed since is
    an error. `check_trace_chips(num_chips)`: the front end's check of its trace-chip list,
    called once the pod is known and before anything is simulated."""
    path = Path(req.trace)
    hlo = chakra = None
    if is_chakra(req.trace):
        pod = resolve_pod(req)
        chakra, raw = load_chakra(req.trace, pod.topology, req.chakra_compute,
                                  req.chakra_comm_group)
        trace = chakra.trace
    elif req.chakra_comm_group is not None:
        raise TpusimError(f"{{chakra_comm_group}} is a Chakra trace's communicator groups, but "
                          f"{str(path)!r} is not a Chakra trace (PREFIX of PREFIX.<rank>.et "
                          f"files, their directory or one .et file); drop {{chakra_comm_group}}",
                          "chakra_comm_group")
    elif not path.is_file():
        raise missing_trace_error(path)
    elif is_hlo(path):
        # XLA's compiled HLO text: import it for this pod, then replay like any trace.
        pod = resolve_pod(req)
        imp = load_hlo(str(path), pod.topology)  # refuses oversized files before reading them
        trace, hlo = imp.trace, imp.inventory
        check_hlo_has_ops(imp, str(path), "replay")
        raw = path.read_bytes()
    else:
        # Checks the size limit before reading a byte (the digest below needs the raw bytes).
        text = read_text_bounded(path, what="trace", limit=MAX_TRACE_FILE_BYTES,
                                 hint="write one with `tpusim compile ... -o FILE`")
        raw = text.encode("utf-8")
        trace = Trace.from_json(text, source=f"trace file {str(path)!r}")
        pod = resolve_pod(req)
    chip, topo = pod.chip, pod.topology
    digest = hashlib.sha256(raw).hexdigest()
    expected = req.trace_sha256
    if expected is not None and expected != digest:
        raise TpusimError(
            f"trace file {str(path)!r} has changed since the result was written (SHA-256 "
            f"{digest[:12]}... instead of {str(expected)[:12]}...); rerun needs the same file"
        )
    if check_trace_chips is not None:
        check_trace_chips(topo.num_chips)
    n = trace.meta.num_chips
    if n is not None and n != topo.num_chips:
        raise TpusimError(
            f"trace {str(path)!r} was compiled for {n} chips but the pod has {topo.num_chips}; "
            f"replay it on a {n}-chip pod or recompile"
        )
    piped = {}

    def simulate(c):
        if chakra is not None and (chakra.programs or chakra.op_scale):
            return _replay_programs(req, chakra, c, topo)
        if trace.meta.kind == TraceKind.TRAINING and trace.mesh.size("pipeline") > 1:
            r, piped["pipe"] = _replay_pipeline(req, trace, c, topo, path)
            return r
        return simulate_step(req, trace, c, topo, overlap=False if req.no_overlap else None)

    tokens = trace.meta.tokens_per_step if trace.meta.kind == TraceKind.TRAINING else None
    result, chip, energy, cap = simulate_with_cap(req.power_cap, chip, simulate,
                                                  step_energy_of(trace, topo, tokens))
    pipe = piped.get("pipe")
    if hlo is not None:
        summary = {**hlo_summary(hlo, result), **per_chip_summary(result)}
    elif chakra is not None:
        summary = {**chakra_summary(chakra, result), **per_chip_summary(result)}
    elif trace.meta.kind == TraceKind.TRAINING:
        summary = training_summary(trace, result, chip)
    else:
        summary = {"step_time_s": result.step_time_s, "breakdown": result.breakdown,
                   **per_chip_summary(result)}
    if pipe is not None:
        summary["pipeline"] = pipe.to_dict()
    with_energy(summary, energy, cap)
    inputs = base_inputs(req, pod)
    kind = None if trace.meta.kind is None else str(trace.meta.kind)
    inputs["trace"] = {"path": str(path), "sha256": digest, "kind": kind,
                       "model": trace.meta.model}
    if chakra is not None:
        inputs["trace"]["chakra_compute"] = str(req.chakra_compute)
    inputs["mesh"] = describe_mesh(trace.mesh, topo)
    inputs["algorithm"] = algorithm_of(req)
    return Run(command=req.command, summary=summary, inputs=inputs, result=result, trace=trace,
               energy_detail=energy)


def _replay_programs(req, imp, chip, topo):
    """A Chakra set whose chips run several programs (an exported pipeline step) or one program
    at per-chip sizes (an uneven MoE router's loads): each chip its own program and sizes on
    the per-chip engine, the sends between programs point-to-point transfers, with the
    request's perturbations."""
    p2p = imp.p2p
    cfg = dataclasses.replace(
        per_chip_config(req, imp.trace, topo),
        op_scale={i: np.asarray(col, dtype=float) for i, col in imp.op_scale.items()})
    if imp.programs:
        cfg = dataclasses.replace(
            cfg, programs=imp.programs,
            program_of_chip=np.asarray(imp.program_of_chip, dtype=np.int64),
            p2p=None if p2p is None else PointToPoint(
                peer_of_chip=tuple(np.asarray(nb, dtype=np.int64) for nb in p2p["peers"]),
                sends=tuple(p2p["sends"]), recvs=tuple(p2p["recvs"])))
    return simulate_chips(imp.trace, chip, topo, config=cfg, algorithm=algorithm_of(req),
                          overlap=False if req.no_overlap else None)


def _replay_pipeline(req, trace, chip, topo, path):
    """A compiled pipeline step: the stage programs composed again from the model and settings
    the trace records, run on the per-chip engine as `train` runs them."""
    rec = trace.meta.pipeline_compile
    if not isinstance(rec, dict) or "model" not in rec or "config" not in rec:
        raise TpusimError(
            f"trace {str(path)!r} has a pipeline axis but does not record its model and settings "
            f"(written by an older tpusim), so its stage programs cannot be composed; recompile "
            f"it with tpusim compile"
        )
    source = f"trace {str(path)!r}"
    model = model_from_dict(rec["model"], source=source)
    cfg = training_config_from_dict(rec["config"], source=source)
    check_schedule(cfg.pipeline_schedule, trace.mesh.size("pipeline"), cfg.microbatches,
                   cfg.virtual_stages)
    if req.no_overlap:
        cfg = dataclasses.replace(cfg, overlap=False)
    return simulate_pipeline_chips(model, trace.mesh, chip, topo, cfg,
                                   base=pipeline_base(req, trace, topo),
                                   algorithm=algorithm_of(req),
                                   overlap=False if req.no_overlap else None)
