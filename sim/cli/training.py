"""Subcommands beyond single collectives: `train`, `compile`, `replay`, `demo`.

They register themselves into `sim.cli` so the parser is built in one place.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from sim.cli import common as cli
from sim.cli.common import flag_spelling, fmt_time
from sim.runs.requests import CONVERTERS, CompileRequest, ReplayRequest, TrainRequest
from topologies.errors import TpusimError, render_said
from workloads.trace_meta import TraceKind


def add_training_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The step model's flags (`train`, `compile`; `goodput` without `required`: its step time
    may be given instead), in their `--help` order."""
    _add_shape_args(p, required)
    _add_remat_args(p)
    _add_precision_args(p)
    _add_schedule_args(p)
    _add_quant_args(p)


def _add_shape_args(p: argparse.ArgumentParser, required: bool) -> None:
    """The model, the tokens and the mesh it runs on."""
    p.add_argument("--model", required=required,
                   help="zoo name (llama3-70b, ...) or a model YAML")
    p.add_argument("--seq-len", type=CONVERTERS["seq_len"], required=required,
                   help="sequence length in tokens")
    p.add_argument("--batch-per-chip",
                   type=CONVERTERS["batch_per_chip"],
                   required=required, help="sequences per chip (global batch = this x chips)")
    p.add_argument("--mesh", required=required,
                   help="logical ICI mesh, e.g. fsdp=16,tensor=4 (data, fsdp, tensor, sequence, "
                        "expert, pipeline)")
    p.add_argument("--dcn", help="logical axes across slices, e.g. data=2")
    p.add_argument("--axis-map",
                   help="explicit placement, e.g. tensor=x,fsdp=y+z or tensor=x:4,fsdp=x:4+y+z: "
                        "every mesh axis of size > 1 once; a bare letter takes what is left of "
                        "that axis, x:K takes K chips (default: automatic, as jax's device "
                        "meshes)")


def _add_remat_args(p: argparse.ArgumentParser) -> None:
    """What the backward pass keeps, recomputes or offloads; the attention kernel."""
    p.add_argument("--remat", default="full",
                   help="remat policy (default full): tpusim's none, minimal, full, offload, "
                        "qkv-offload, qkvo-offload, or MaxText's remat_policy names "
                        "minimal_with_context, minimal_flash, save_dot_with_context_except_mlp, "
                        "save_dot_except_mlpwi, save_dot_except_mlp, save_qkv_proj, "
                        "save_out_proj, qkv_proj_offloaded, minimal_offloaded, custom "
                        "(docs/model/remat.md)")
    p.add_argument("--remat-save", default=None,
                   help="with --remat custom: MaxText tensor names kept on device, e.g. "
                        "query_proj,key_proj,value_proj,out_proj (decoder_layer_input, "
                        "query_proj, key_proj, value_proj, qkv_proj, context, out_proj, mlpwi, "
                        "mlpwi_0, mlpwi_1, mlpwo; default none: only the layer input)")
    p.add_argument("--remat-offload", default=None,
                   help="with --remat custom: MaxText tensor names offloaded to host memory "
                        "(same names; default none)")
    p.add_argument("--attention", default="flash", help="flash (default) or dot")


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    """Gradient accumulation, the dtypes of weights, gradients and optimizer state."""
    p.add_argument("--microbatches", type=CONVERTERS["microbatches"], default=1,
                   help="gradient accumulation steps (default 1)")
    p.add_argument("--param-dtype", default="bf16",
                   help="dtype of the stored weights and their update (default bf16)")
    p.add_argument("--grad-dtype", default="bf16",
                   help="dtype the weight gradients are reduced and kept in (default bf16)")
    p.add_argument("--gather-dtype", default=None,
                   help="dtype each weight shard is cast to before its FSDP gather, the "
                        "dtype the matmuls read weights in (default: --param-dtype, no cast); "
                        "--param-dtype fp32 --gather-dtype bf16 is MaxText's default "
                        "(weight_dtype=float32, dtype=bfloat16)")
    p.add_argument("--optimizer-dtype", default="fp32",
                   help="dtype of the optimizer state (default fp32)")
    p.add_argument("--optimizer", default="adam",
                   help="adam (default: two moments per parameter) or sgd (no state)")


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    """How the step's collectives and passes are scheduled (XLA's choices and what-ifs)."""
    p.add_argument("--pipeline-schedule", default=None,
                   help="gpipe, 1f1b (default with a pipeline axis) or interleaved; every "
                        "stage's chips run its passes on the per-chip engine (needs pipeline=P "
                        "in --mesh or --dcn)")
    p.add_argument("--virtual-stages", type=CONVERTERS["virtual_stages"], default=1,
                   help="layer chunks per stage for --pipeline-schedule interleaved (default 1)")
    p.add_argument("--no-overlap", action="store_true",
                   help="collectives block compute (what-if: no async overlap)")
    p.add_argument("--no-fusion", action="store_true",
                   help="charge every elementwise op its own HBM round trip (no XLA fusion)")
    p.add_argument("--tp-activations", default="sharded",
                   help="activations between sublayers: sharded over tensor (MaxText; all-gather "
                        "+ reduce-scatter, default) or replicated (Megatron; all-reduce)")
    p.add_argument("--tp-comm", default="blocking",
                   help="tensor-parallel collectives: blocking (XLA's default) or "
                        "collective-matmul (overlapped with the adjacent matmul)")
    p.add_argument("--dp-allreduce", default="async",
                   help="data-parallel gradient all-reduce: async (overlapped with the backward "
                        "pass, XLA's data-parallel overlap flags, default) or blocking (each "
                        "layer's reduction ends before the next layer's backward starts)")
    p.add_argument("--dp-grad-split", default="per-matrix",
                   help="the data-parallel gradient all-reduce across slices (a data or "
                        "sequence axis over DCN): per-matrix (one all-reduce per weight matrix "
                        "and one for each layer's norm scales, one after another, as XLA "
                        "compiles it; default) or per-layer (one all-reduce of the layer's "
                        "gradient shards); each pays the "
                        "chip's dcn_message_overhead_s per message")
    p.add_argument("--fsdp-grad", default="reduce-scatter",
                   help="weight gradients over fsdp: reduce-scatter (async, hidden behind the "
                        "backward pass, default), all-reduce (the whole gradient all-reduced "
                        "by a synchronous collective before the next layer's backward, each "
                        "chip keeping its shard: XLA's v6e program with async collective "
                        "fusion and no collective matmuls; needs --fsdp-gather async or "
                        "blocking) or auto (XLA's choice per matrix by its FSDP group: "
                        "reduce-scatter over up to 32 chips, all-reduce above; any "
                        "--fsdp-gather but windowed, and what the mixed modes do anyway)")
    p.add_argument("--ep-alltoall", default="sync",
                   help="MoE all-to-alls over expert: sync (XLA's default: no compute overlaps "
                        "them) or async (libtpu's --xla_tpu_enable_async_all_to_all: the "
                        "backward's overlap independent matmuls; needs an MoE model and an "
                        "expert axis)")
    p.add_argument("--moe-dispatch", default="auto",
                   help="how MoE tokens reach their experts over expert: all-to-all (to the "
                        "experts' chips and back), all-gather (every chip of an expert group "
                        "gathers the group's tokens, runs its own experts on them and the "
                        "combine's partial sums are reduced over expert) or auto (XLA's choice "
                        "for the program, default; docs/model/moe.md \"The dispatch form\"; "
                        "needs an MoE model and an expert axis unless auto)")
    p.add_argument("--vocab-tiling", type=CONVERTERS["vocab_tiling"], default=1,
                   help="MaxText's num_vocab_tiling: the output projection and loss run in this "
                        "many chunks of the tokens (one chunk's logits in HBM at a time) and "
                        "the backward recomputes each chunk's logits (default 1: no tiling; "
                        "at most 4,096, dividing the tokens each chip's loss processes per "
                        "microbatch)")
    p.add_argument("--logits-dtype", default="bf16",
                   help="the output projection's dot: bf16 (default, MaxText's: the dot in "
                        "bf16, its logits cast to f32 for the loss) or fp32 (MaxText's "
                        "logits_dot_in_fp32: both operands cast to f32; at jax's default "
                        "precision XLA runs the dot as one bf16 pass on bf16-rounded operands, "
                        "so only the projection's weight gradient is f32, held and "
                        "reduce-scattered in f32; docs/model/training.md)")
    p.add_argument("--mlp-act-dtype", default="bf16",
                   help="the dtype of the MLP's activation intermediates: bf16 (default, "
                        "MaxText's activations_in_float32: False) or fp32 (MaxText's "
                        "activations_in_float32: True: the gate and up projections' bf16 "
                        "outputs cast to f32 for the activation and its backward, the product "
                        "cast back to bf16 for the down projection; docs/model/training.md)")
    p.add_argument("--embed-lookup", default="auto",
                   help="the embedding lookup's collective, forward and gradient: auto "
                        "(default: XLA's choice by rule; an untied FSDP-sharded table is "
                        "looked up by an all-to-all of the activations, docs/model.md), "
                        "all-to-all (the activations' all-to-all over fsdp, the gradient rows "
                        "sent back the same way) or all-gather (the table all-gathered over "
                        "fsdp for the lookup, its gradient reduce-scattered with the other "
                        "weights')")


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    """The MXU format of the weight matmuls (int8 training) and the FSDP gathers."""
    p.add_argument("--matmul-dtype", default="bf16",
                   help="MXU format of the weight matmuls, forward and backward: bf16 "
                        "(default), int8 (MaxText's AQT int8 training: operands quantized on "
                        "the VPU, per-channel scales, stochastic rounding of the gradients; "
                        "docs/model/int8.md) or fp8 (a chip with an fp8 rate only: no preset "
                        "has one)")
    p.add_argument("--quantize-attention", action="store_true",
                   help="with --matmul-dtype int8: the attention's matmuls too (default: bf16, "
                        "as MaxText)")
    p.add_argument("--quantize-logits", action="store_true",
                   help="with --matmul-dtype int8: the output projection to the logits and its "
                        "backward too (default: bf16, as MaxText)")
    p.add_argument("--quant-scales", default="per-channel",
                   help="with --matmul-dtype int8: per-channel scales (default, AQT's "
                        "calibration: one per row or column along the contraction) or "
                        "per-tensor")
    p.add_argument("--quant-gather", default="int8",
                   help="with --matmul-dtype int8: FSDP gathers carry int8 weights, each shard "
                        "quantized before its gather (default: XLA's compile of MaxText's "
                        "int8), or bf16 (each gathered matrix quantized after it)")
    p.add_argument("--no-stochastic-rounding", action="store_true",
                   help="with --matmul-dtype int8: round the gradients to nearest (default: "
                        "stochastic rounding with random bits, AQT's config_v3)")
    p.add_argument("--fsdp-gather", default="async",
                   help="FSDP weight gathers (one per weight matrix): async (prefetched, "
                        "default), windowed (collective matmuls), blocking, or the per-matrix "
                        "mix XLA picks: mixed-async (v5e) or mixed-blocking (v5p, v6e), "
                        "which over more than 32 FSDP chips window nothing (plain gathers, "
                        "gradients all-reduced, as XLA compiles there)")


def _print_training(s: dict[str, Any]) -> None:
    # deferred: start-up
    from sim.engine.result import breakdown_label

    print(f"{s['model']} training step on {s['topology']} {s['chip']} ({s['num_chips']} chips)")
    print(f"  step time        {s['step_time_s']:.4f} s")
    print(f"  MFU              {s['mfu']:.1%}   (model FLOPs: 6*params*tokens + causal attention)")
    print(f"  tokens/s/chip    {s['tokens_per_s_per_chip']:.1f}")
    print(f"  MaxText TFLOP/s  {s['maxtext_tflops_per_s_per_chip']:.1f} per chip")
    fit = "fits" if s["fits_in_hbm"] else "DOES NOT FIT"
    print(f"  HBM peak         {s['hbm_peak_bytes'] / 1e9:.2f} GB of "
          f"{s['hbm_capacity_bytes'] / 1e9:.0f} GB ({fit})")
    if not s["fits_in_hbm"]:
        print(f"    overflow {s['memory']['overflow_bytes'] / 1e9:.2f} GB")
    print("  at the peak:     " + ", ".join(
        f"{k.replace('_', ' ')} {v / 1e9:.2f} GB" for k, v in s["hbm_peak_breakdown"].items()))
    if "pipeline" in s:
        pp = s["pipeline"]
        print("  per stage:       " + ", ".join(
            f"{i}: {b / 1e9:.2f} GB ({k} in flight)" for i, (b, k) in enumerate(zip(
                pp["stage_hbm_peak_bytes"], pp["peak_inflight_microbatches"], strict=True))))
        print(f"  pipeline         {pp['schedule']}, {pp['stages']} stages, "
              f"{pp['microbatches']} microbatches: bubble {pp['bubble_fraction']:.1%} of the "
              f"schedule's {pp['span_s']:.4f} s")
    print("  critical path:")
    for k, v in s["breakdown"].items():
        share = v / s["step_time_s"] if s["step_time_s"] else 0.0
        print(f"    {breakdown_label(k):<22} {v:10.4f} s  {share:6.1%}")
    if "auto_switch" in s:  # a what-if whose algorithm switch slows the step
        print(f"  note: {s['auto_switch']['note']}")
    cli.print_failures(s)
    cli.print_energy(s)


check_outputs = cli.check_outputs  # re-exported: other command families import it here


def write_outputs(args, run) -> list[str]:
    """Write a step's --out, --perfetto, --plots and --chakra (already validated); returns
    `wrote ...` lines."""
    result, summary, trace, energy = run.result, run.to_dict(), run.trace, run.energy_detail
    notes = []
    plan = chakra = None
    if getattr(args, "chakra", None):
        # deferred: start-up
        from sim.export.chakra import plan_chakra

        # Encoded before any output is written: a step that cannot be exported writes nothing.
        chakra = plan_chakra(trace, result, every_chip=args.chakra_every_chip)
    if getattr(args, "perfetto", None):
        # deferred: start-up
        from sim.export.perfetto import plan_step_trace

        # Everything the trace needs is checked before the first byte of any output: the
        # chip list, the span, and the size (a warning above WARN_TRACE_BYTES, an error over
        # MAX_TRACE_BYTES); the timelines are encoded here and streamed out below.
        if getattr(args, "chip_list", None) is None:
            cli.check_trace_chips(args, result.num_chips)
        # Parsed and range-checked before anything was simulated or written (check_trace_chips);
        # None = the default (chip 0, or one process per chip class).
        chips = args.chip_list if getattr(args, "trace_chips", None) else None
        plan = plan_step_trace(result, args.perfetto, chips=chips, energy=energy)
        plan.check_size(spell=flag_spelling(args.parser))
    if getattr(args, "out", None):
        # deferred: start-up
        from sim.export.output import write_tables

        tables = {"ops": result.ops, "units": result.units, "links": result.links,
                  "memory": result.memory}
        if result.classes is not None:
            tables["chips"] = result.chips
        write_tables(args.out, tables, summary)
        notes.append(f"wrote tables and summary.json into {cli.show_path(args.out)}/")
    if plan is not None:
        plan.write()
        shown = f"{len(chips)} chip(s)" if chips else "the default chips"
        notes.append(f"wrote Perfetto trace {cli.show_path(args.perfetto)} ({shown}; open it at "
                     f"ui.perfetto.dev)")
    if getattr(args, "plots", None):
        # deferred: start-up
        from sim.export.step_plots import plot_step

        plot_step(result, summary, args.plots, energy=energy)
        notes.append(f"wrote plots into {cli.show_path(args.plots)}/")
    if chakra is not None:
        chakra.write(args.chakra)
        notes.append(f"wrote {len(chakra.files)} Chakra file(s) into {cli.show_path(args.chakra)}/"
                     f" (replay them with tpusim replay {cli.show_path(args.chakra)})")
    return notes


def _windowed_ring_note(args, trace) -> list[str]:
    """`--fsdp-gather windowed` over a longer ring than XLA ever windows: say so (the step is
    a what-if; the mixed modes model what XLA compiles there, docs/model.md)."""
    # deferred: start-up
    from workloads.training import XLA_MAX_WINDOWED_RING

    ring = trace.mesh.size("fsdp") * trace.mesh.size("expert")
    if getattr(args, "fsdp_gather", None) != "windowed" or getattr(args, "no_overlap", False) \
            or ring <= XLA_MAX_WINDOWED_RING:
        return []
    return [f"note: --fsdp-gather windowed over {ring} chips: XLA builds no windowed einsum "
            f"over more than {XLA_MAX_WINDOWED_RING} (docs/model.md \"Collectives as XLA "
            "emits them\"); --fsdp-gather mixed-async (v5e) or mixed-blocking (v5p, v6e) "
            "models what it compiles"]


def _grad_ring_note(trace) -> list[str]:
    """Weight gradients reduce-scattered over a longer FSDP group than XLA ever reduce-scatters
    one (the default `--fsdp-grad reduce-scatter` there): say so, since XLA all-reduces them
    whole and synchronously, and v6e's preset MXU factor was fitted with that rule."""
    # deferred: start-up
    from workloads.training import XLA_MAX_WINDOWED_RING

    ring = max((math.prod(trace.mesh.size(a) for a in op.mesh_axes) for op in trace.ops
                if op.collective == "reduce-scatter" and op.name.startswith("fsdp_grad_")),
               default=0)
    if ring <= XLA_MAX_WINDOWED_RING:
        return []
    # The default stays reduce-scatter, and the note says why in one line: the 2023 v5e runs
    # (whose programs cannot be compiled again) fit only with it (docs/validation.md effect 7).
    return [f"note: weight gradients reduce-scattered over {ring} chips, the default "
            f"--fsdp-grad (v5e's fitted 2023 runs reduce-scattered); XLA (jax/libtpu 0.10.2) "
            f"all-reduces them whole over more than {XLA_MAX_WINDOWED_RING}, as --fsdp-grad auto "
            f"models (v6e's preset MXU factor was fitted with auto)"]


def print_notes(args, notes: list[str]) -> None:
    """The `wrote ...` lines after a text report (never inside --json output)."""
    if not getattr(args, "json", False):
        for n in notes:
            print(n)


def cmd_train(args: argparse.Namespace) -> int:
    from sim.runs.bind import resolve_pod  # the run stack, loaded when a command runs
    from sim.runs.train import run_train

    req = cli.request_of(TrainRequest, args)
    check_outputs(args)
    if getattr(args, "perfetto", None):
        cli.check_trace_chips(args, resolve_pod(req).topology.num_chips)  # before simulating
    run = run_train(req)
    notes = write_outputs(args, run)
    notes += _windowed_ring_note(args, run.trace) + _grad_ring_note(run.trace)
    if args.json:
        cli.emit_json(run.to_dict())
    else:
        _print_training(run.summary)
    print_notes(args, notes)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from sim.export.output import atomic_write, check_output_file  # loaded when it runs
    from sim.runs.bind import resolve_pod
    from sim.runs.train import compile_step

    req = cli.request_of(CompileRequest, args)
    # Before compiling (a large step takes seconds): -o that cannot be written, or that is the
    # --model file it compiles.
    check_output_file(args.output, "-o file")
    cli.check_not_inputs(args, "-o", args.output)
    chip = None
    if req.chips is not None:
        if req.chips < 1:
            raise TpusimError(f"--chips {req.chips} must be >= 1")
        given = [f"{flag} {v}" for flag, v, default in (
            ("--chip", req.chip, None), ("--slice", req.slice, None),
            ("--shape", req.shape, None), ("--slices", req.slices, 1),
            ("--wraparound", req.wraparound, "auto")) if v != default]
        if given:
            # The pod's chip decides the program's memory (its compiler rules, e.g. v5e's
            # loss_after_backward); --chips compiles with none of them, so it would drop it.
            raise TpusimError(
                f"--chips {req.chips} and {given[0]}: give one; --chips compiles for that many "
                f"chips of no particular generation (its compiler's memory rules off), "
                f"--chip/--slice/--shape (with --slices, --wraparound) for that pod")
        num_chips = req.chips
    else:
        pod = resolve_pod(req)
        chip, num_chips = pod.chip, pod.topology.num_chips
    trace = compile_step(req, num_chips, chip=chip)[0]
    text = trace.to_json()
    cli.check_trace_file_size(text, "-o", "use fewer --microbatches or layers, or simulate the "
                                          "step with `tpusim train` (no trace file)")
    atomic_write(args.output, lambda p: p.write_text(text, encoding="utf-8"))
    print(f"wrote {args.output}: {len(trace.ops)} ops for {num_chips} chips "
          f"(mesh {trace.mesh.describe()})")
    return 0


def replay_request(args: argparse.Namespace) -> ReplayRequest:
    return cli.request_of(ReplayRequest, args, as_command=args.command)


def cmd_replay(args: argparse.Namespace, quiet: bool = False) -> int:
    # deferred: start-up
    from sim.engine.result import breakdown_label
    from sim.runs.replay import run_replay

    req = replay_request(args)
    check_outputs(args)
    run = run_replay(req, check_trace_chips=lambda n: cli.check_trace_chips(args, n))
    trace, result, summary = run.trace, run.result, run.summary
    notes = write_outputs(args, run)
    if quiet:
        return 0
    if args.json:
        cli.emit_json(run.to_dict())
    elif trace.meta.kind == TraceKind.TRAINING:
        _print_training(summary)
    elif trace.meta.kind == TraceKind.CHAKRA:
        print(f"Chakra trace {summary['source']}: {summary['num_ranks']} rank(s) on "
              f"{summary['topology']} {summary['chip']} ({summary['num_chips']} chips), compute "
              f"{summary['chakra_compute']}")
        print(f"  step time        {result.step_time_s:.6f} s")
        print("  critical path:")
        for k, v in result.breakdown.items():
            share = v / result.step_time_s if result.step_time_s else 0.0
            print(f"    {breakdown_label(k):<22} {v:10.6f} s  {share:6.1%}")
        cli.print_failures(summary)
        cli.print_energy(summary)
        for a in summary["approximations"]:
            print(f"  approximated: {a}")
    elif trace.meta.kind == TraceKind.HLO:
        print(f"HLO module {summary['module']} on {summary['topology']} {summary['chip']} "
              f"({summary['num_chips']} chips)")
        print(f"  step time        {result.step_time_s:.6f} s")
        fits = "fits" if summary["fits_in_hbm"] else "DOES NOT FIT"
        print(f"  HBM peak         {summary['hbm_peak_bytes'] / 1e9:.3g} GB of "
              f"{summary['hbm_capacity_bytes'] / 1e9:.0f} GB ({fits}; from the program's "
              f"buffer live ranges, arguments {summary['hbm_peak']['parameter_bytes'] / 1e9:.2f}"
              f" GB)")
        print("  critical path:")
        for k, v in result.breakdown.items():
            share = v / result.step_time_s if result.step_time_s else 0.0
            print(f"    {breakdown_label(k):<22} {v:10.6f} s  {share:6.1%}")
        cli.print_failures(summary)
        cli.print_energy(summary)
    else:
        print(f"step time {result.step_time_s:.6f} s")
        cli.print_failures(summary)
        cli.print_energy(summary)
    print_notes(args, notes)
    return 0


def _register_train(sub, name: str) -> None:
    p = cli.add_command(sub, name, "simulate one training step", cmd_train,
                        set_scope=TrainRequest.SET_SCOPE)
    add_training_args(p)
    cli.add_output_args(p, trace_chips=True)
    cli.add_step_perturbation_args(p)


def _register_compile(sub, name: str) -> None:
    p = sub.add_parser(name, help="compile a training step into a trace file")
    cli.add_pod_args(p)
    p.add_argument("--chips", type=CONVERTERS["chips"],
                   help="chip count, instead of --chip/--shape/--slice")
    # compile only writes the program: the chip, topology and algorithm apply at replay.
    cli.add_set_arg(p, CompileRequest.SET_SCOPE)
    add_training_args(p)
    cli.add_moe_args(p)
    p.add_argument("-o", "--output", required=True, help="trace file to write (JSON)")
    p.set_defaults(func=cmd_compile)


def _trace_command(help_text: str, func):
    """`replay` and `export` take the same arguments: a trace file, a pod and the outputs."""

    def register(sub, name: str) -> None:
        # The model is compiled into the trace: model.* overrides belong to `tpusim compile`.
        p = cli.add_command(
            sub, name, help_text, func, set_scope=ReplayRequest.SET_SCOPE,
            positional=("trace", "a file written by `tpusim compile` (or `import-hlo -o`), "
                                 "XLA's compiled HLO text (PROGRAM.txt, .gz accepted), or a "
                                 "Chakra trace: PREFIX of PREFIX.<rank>.et files, their "
                                 "directory, or one .et/.et.gz file"))
        p.add_argument("--no-overlap", action="store_true",
                       help="collectives block compute (what-if: no async overlap)")
        p.add_argument("--chakra-compute", choices=("roofline", "recorded"),
                       default="roofline",
                       help="Chakra input: cost compute nodes on the chip model from their "
                            "FLOPs (num_ops) and bytes (tensor_size), as ASTRA-sim's roofline "
                            "mode does, falling back to the recorded duration where a node "
                            "carries neither (roofline, the default: the point is the TPU's "
                            "time); or replay every node at its recorded duration (recorded)")
        p.add_argument("--chakra-comm-group", metavar="FILE",
                       help="Chakra input: ASTRA-sim's communicator-group JSON (its "
                            "comm-group configuration), group id to ranks, e.g. "
                            "'{\"1\": [0, 1], \"2\": [2, 3]}': a collective whose pg_name is "
                            "an id runs over those ranks (over a process_group:init node's)")
        cli.add_output_args(p, trace_chips=True)
        cli.add_step_perturbation_args(p)

    return register


def cmd_export(args: argparse.Namespace) -> int:
    if not args.perfetto and not args.chakra:
        raise TpusimError("tpusim export needs --perfetto FILE (.pftrace, or .json for Chrome) "
                          "or --chakra DIR (Chakra execution traces)")
    args.json = False
    rc = cmd_replay(args, quiet=True)
    for path in (args.perfetto, args.chakra):
        if path:
            print(f"wrote {cli.show_path(path)}")
    return rc


def _register_demo(sub, name: str) -> None:
    p = sub.add_parser(name, help="run the demo: a collective comparison and a training step")
    p.add_argument("--out", default="demo-out", help="output directory (default demo-out)")
    p.add_argument("--json", action="store_true",
                   help="print summary.json (with its inputs) instead of the text report")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Simulate a LLaMA-3-8B step on a v5e-16 (mesh fsdp=4, tensor=4) and compare all-gather
    algorithms on the wrapped x axis of a 16x16 v5e; write a summary, a Perfetto trace, tables and
    plots into --out."""
    # deferred: start-up
    from sim.chips import get_chip
    from sim.collectives.simulate import simulate_collective
    from sim.engine.executors import Executor, simulate_step
    from sim.export.output import check_output_dir, write_json, write_tables
    from sim.runs.result import describe_chip, tpusim_version
    from sim.runs.train import training_summary
    from topologies.mesh import parse_mesh
    from topologies.slices import resolve_topology
    from workloads.training import Remat, TrainingConfig, compile_training_step
    from workloads.zoo import load_model

    check_output_dir(args.out, "--out directory")
    out = Path(args.out)
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, slice_name="v5e-16")
    model = load_model("llama3-8b")
    mesh = parse_mesh("fsdp=4,tensor=4")
    tcfg = TrainingConfig(seq_len=2048, batch_per_chip=1, remat=Remat.FULL, attention="flash")
    trace = compile_training_step(model, mesh, topo.num_chips, tcfg)
    result = simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE)
    summary = training_summary(trace, result, chip)
    # The algorithms differ only where an axis wraps around: v5e wraps axes of length 16, so
    # the comparison runs on the x axis of a full 16x16 pod (the 4x4 slice has no wraparound).
    ring_topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                                 max_pod_shape=chip.max_pod_shape, shape="16x16")
    collectives, auto = [], None
    for algo in ("auto", "ring", "bidi-ring", "split-bidi-ring", "line"):
        try:
            c = simulate_collective(chip=chip, topology=ring_topo, op="all-gather", axes="x",
                                    nbytes=32 << 20, algorithm=algo)
            collectives.append(render_said(c.to_dict(), flag_spelling(args.parser, "demo")))
            auto = auto or c
        except TpusimError as exc:
            collectives.append({"algorithm_requested": algo,
                                "error": exc.render(flag_spelling(args.parser, "demo"))})
    write_tables(out / "tables", {"ops": result.ops, "units": result.units,
                                  "links": result.links, "memory": result.memory}, summary)
    # deferred: start-up
    from sim.runs.result import describe_config, describe_mesh, describe_topology

    # What produced the numbers, as every result records it (the demo takes no model or pod
    # flags: these are its fixed inputs).
    inputs = {"command": "demo", "tpusim_version": tpusim_version(), "flags": {},
              "overrides": {}, "chip": describe_chip(chip), "topology": describe_topology(topo)}
    inputs["model"] = model.to_dict()
    inputs["mesh"] = describe_mesh(mesh, topo)
    inputs["training"] = {**describe_config(tcfg),
                          "global_batch": tcfg.batch_per_chip * topo.num_chips,
                          "tokens_per_step": trace.meta.tokens_per_step}
    inputs["algorithm"] = "auto"
    inputs["collective_comparison"] = {
        "op": "all-gather", "axes": "x", "bytes": 32 << 20,
        "topology": describe_topology(ring_topo),
        "algorithms": ["auto", "ring", "bidi-ring", "split-bidi-ring", "line"]}
    doc = {"training_step": summary, "mesh": mesh.describe(),
           "all_gather_32MiB_x_16x16_v5e": collectives, "inputs": inputs}
    write_json(out / "summary.json", doc)
    # deferred: start-up
    from sim.export.perfetto import export_step
    from sim.export.step_plots import plot_step

    export_step(result, out / "train_step.pftrace")
    plot_step(result, {**summary, "inputs": inputs}, out / "plots")
    if auto is not None:
        # deferred: start-up
        from sim.export.collective_plots import plot_collective

        plot_collective(auto, out / "plots" / "all_gather_x")
    if args.json:
        cli.emit_json(doc)
        return 0
    # deferred: start-up
    from topologies.mesh import place_mesh

    where = ", ".join(f"{n} on {'+'.join(a for a, _k, _s in p.factors)}"
                      for n, p in place_mesh(mesh, topo).items())
    batch = tcfg.batch_per_chip * topo.num_chips
    print(f"{model.name}, sequence length {tcfg.seq_len:,}, global batch {batch:g} "
          f"({tcfg.batch_per_chip:g} per chip, {trace.meta.tokens_per_step:,} tokens per "
          f"step), remat {tcfg.remat}, {tcfg.attention} attention")
    print(f"mesh {mesh.describe()} on {topo.name} {chip.name} ({where})")
    _print_training(summary)
    print("\nall-gather of 32 MiB over x (16 chips, wraparound) on a 16x16 v5e:")
    best = min(c["time_s"] for c in collectives if "time_s" in c)
    for c in collectives:
        if "time_s" in c:
            print(f"  {c['algorithm']:<22} {fmt_time(c['time_s']):>10}  "
                  f"{c['time_s'] / best:5.2f}x the fastest")
        else:
            print(f"  {c['algorithm_requested']:<22} n/a: {c['error']}")
    d = cli.show_path(out)
    print(f"\nwrote {d}/summary.json, {d}/train_step.pftrace, {d}/plots/*.png (the step's; "
          f"the auto all-gather's in {d}/plots/all_gather_x/), {d}/tables/")
    return 0


def register(sub) -> None:
    cli.register_commands(sub, [
        ("train", _register_train),
        ("compile", _register_compile),
        ("replay", _trace_command("replay a trace file on a pod", cmd_replay)),
        ("export", _trace_command("replay a trace file and export it to Perfetto or Chakra",
                                  cmd_export)),
        ("demo", _register_demo),
    ])
