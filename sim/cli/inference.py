"""Inference subcommands: `decode` (one generate step), `prefill` and `serve-sweep` (the
latency-throughput table over batch sizes). They register into `sim.cli` like `sim.cli.training`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.cli import common as cli
from sim.cli.common import check_outputs
from sim.cli.training import print_notes, write_outputs
from sim.runs.requests import CONVERTERS, DecodeRequest, PrefillRequest, ServeSweepRequest
from topologies.validate import (
    MAX_CHUNKS,
)

_DEFAULT_BATCHES = ServeSweepRequest.batches  # the request's default, stated in --help


def _add_inference_args(p: argparse.ArgumentParser, *, batch: bool = True,
                        context_required: bool = True) -> None:
    p.add_argument("--model", required=True, help="zoo name (llama3-70b, ...) or a model YAML")
    if batch:
        p.add_argument("--batch", type=CONVERTERS["batch"], required=True,
                       help="sequences decoded together" if context_required
                       else "prompts prefilled together")
    p.add_argument("--context-len", type=CONVERTERS["context_len"],
                   required=context_required,
                   help="tokens in each sequence's KV cache" if context_required
                   else "tokens in each sequence's KV cache after the prefill (default: "
                        "--prompt-len; more reserves room for the tokens decoded next)")
    p.add_argument("--mesh", required=True,
                   help="logical mesh over data, tensor, expert and fsdp, e.g. tensor=8 or "
                        "data=2,tensor=4. fsdp=X,tensor=YZ selects 2D weight-stationary "
                        "sharding (tpu.md §5): fsdp splits the weights' d_model (not a "
                        "weight gather: the activations move) and the batch of attention/KV; "
                        "the batch must be a multiple of data x fsdp (docs/inference.md)")
    p.add_argument("--dcn", help="logical axes across slices, e.g. data=2")
    p.add_argument("--weight-dtype", default="bf16", help="bf16 (default), fp8, int8 or int4")
    p.add_argument("--kv-dtype", default="bf16", help="bf16 (default), fp8, int8 or int4")
    p.add_argument("--matmul-dtype", default="bf16",
                   help="bf16 (default) or int8 (weight matmuls at the int8 peak)")
    p.add_argument("--sampling", default="top-k",
                   help="how the next token is chosen: top-k (default; a draw among the 64 "
                        "largest logits: a vocabulary of at least 64) or greedy (their argmax); "
                        "each with the collectives XLA emits over a vocabulary split over "
                        "tensor (docs/inference.md)")


def _with_trace_chips(args, run, req):
    """`run(req)`, with --perfetto's chip list checked against the pod before it simulates."""
    if getattr(args, "perfetto", None):
        # deferred: start-up
        from sim.runs.bind import resolve_pod

        cli.check_trace_chips(args, resolve_pod(req).topology.num_chips)
    return run(req)


def cmd_decode(args: argparse.Namespace) -> int:
    from sim.runs.inference import run_decode  # the run stack, loaded when it runs

    req = cli.request_of(DecodeRequest, args)
    check_outputs(args)
    run = _with_trace_chips(args, run_decode, req)
    s = run.summary
    notes = write_outputs(args, run)
    if args.json:
        cli.emit_json(run.to_dict())
        return 0
    print(f"{s['model']} decode step on {s['topology']} {s['chip']} ({s['num_chips']} chips), "
          f"batch {s['batch']}, context {s['context_len']}, {s['sharding']} sharding")
    print(f"  step time        {s['step_time_s'] * 1e3:.3f} ms")
    print(f"  tokens/s/chip    {s['tokens_per_s_per_chip']:.1f}")
    print(f"  weights          {s['weights_bytes'] / 1e9:.2f} GB per chip "
          f"({s['weight_dtype']})")
    print(f"  KV cache         {s['kv_cache_bytes'] / 1e9:.2f} GB per chip ({s['kv_dtype']})")
    fit = "fits" if s["fits_in_hbm"] else "DOES NOT FIT"
    print(f"  HBM peak         {s['hbm_peak_bytes'] / 1e9:.2f} GB of "
          f"{s['hbm_capacity_bytes'] / 1e9:.0f} GB ({fit}); largest batch that fits: "
          f"{s['max_batch_that_fits']}")
    if s["padded_batch"] != s["batch"]:
        print(f"  note             batch {s['batch']} is padded to {s['padded_batch']}, a multiple "
              f"of the data x expert shards: the step costs as much as batch "
              f"{s['padded_batch']}")
    # deferred: start-up
    from sim.engine.result import breakdown_label

    print("  critical path:")
    for k, v in s["breakdown"].items():
        share = v / s["step_time_s"] if s["step_time_s"] else 0.0
        print(f"    {breakdown_label(k):<22} {v * 1e3:10.3f} ms  {share:6.1%}")
    if "auto_switch" in s:  # a what-if whose algorithm switch slows the step
        print(f"  note: {s['auto_switch']['note']}")
    cli.print_failures(s)
    cli.print_energy(s)
    print_notes(args, notes)
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    from sim.runs.inference import run_prefill  # the run stack, loaded when it runs

    req = cli.request_of(PrefillRequest, args)
    check_outputs(args)
    run = _with_trace_chips(args, run_prefill, req)
    s = run.summary
    t = s["time_s"]
    notes = write_outputs(args, run)
    if args.json:
        cli.emit_json(run.to_dict())
        return 0
    print(f"{s['model']} prefill of {s['batch']} x {s['prompt_len']} tokens on {s['topology']} "
          f"{s['chip']} ({s['num_chips']} chips, {s['num_chunks']} chunk(s))")
    print(f"  time             {t:.4f} s")
    print(f"  tokens/s/chip    {s['tokens_per_s_per_chip']:.1f}")
    fit = "fits" if s["fits_in_hbm"] else "DOES NOT FIT"
    print(f"  HBM peak         {s['hbm_peak_bytes'] / 1e9:.2f} GB ({fit})")
    # deferred: start-up
    from sim.engine.result import breakdown_label

    print("  critical path:")
    for k, v in s["breakdown"].items():
        share = v / t if t else 0.0
        print(f"    {breakdown_label(k):<22} {v * 1e3:10.3f} ms  {share:6.1%}")
    if "auto_switch" in s:  # a what-if whose algorithm switch slows the step
        print(f"  note: {s['auto_switch']['note']}")
    cli.print_failures(s)
    cli.print_energy(s)
    print_notes(args, notes)
    return 0


def _write_sweep(out: Path, rows: list[dict[str, Any]], title: str) -> list[Path]:
    import csv

    from sim.export.output import atomic_write  # the writers, loaded when they write
    from sim.runs.inference import SWEEP_COLUMNS

    def write_csv(p: Path) -> None:
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
            w.writeheader()
            w.writerows(rows)

    paths = [atomic_write(out / "serve_sweep.csv", write_csv)]
    import matplotlib
    from matplotlib.figure import Figure

    # deferred: start-up
    from sim.export.plots import save

    # A bare Figure (no pyplot: a notebook's backend stays as it was) under the plots' fixed
    # style, written without the software stamp: same rows, same bytes.
    with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
        fig = Figure(figsize=(7, 4.5))
        ax = fig.add_subplot()
        _draw_sweep(ax, rows, title)
        fig.tight_layout()
        paths.append(save(fig, out / "serve_sweep_pareto.png"))
    return paths


def _draw_sweep(ax, rows: list[dict[str, Any]], title: str) -> None:
    configs = list(dict.fromkeys(f"{r['mesh']} {r['weight_dtype']}/{r['kv_dtype']}"
                                 for r in rows))
    palette = ["#4C72B0", "#55A868", "#8172B2", "#CCB974", "#64B5CD", "#8C8C8C"]
    for i, cfg_label in enumerate(configs):
        mine = [r for r in rows if f"{r['mesh']} {r['weight_dtype']}/{r['kv_dtype']}" ==
                cfg_label]
        for fits, marker in ((True, "o"), (False, "x")):
            pts = [r for r in mine if r["fits"] == fits]
            if pts:
                lbl = (cfg_label if len(configs) > 1 else "fits in HBM") if fits else \
                    (f"{cfg_label} (OOM)" if len(configs) > 1 else "OOM")
                ax.scatter([r["step_time_s"] * 1e3 for r in pts],
                           [r["tokens_per_s_per_chip"] for r in pts],
                           color=palette[i % len(palette)] if fits or len(configs) > 1
                           else "#C44E52", marker=marker, label=lbl)
    for r in rows:
        ax.annotate(str(r["batch"]), (r["step_time_s"] * 1e3, r["tokens_per_s_per_chip"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    from sim.runs.inference import pareto  # loaded with the run it draws

    front = pareto(rows)
    if front:
        ax.plot([r["step_time_s"] * 1e3 for r in front],
                [r["tokens_per_s_per_chip"] for r in front], "--", color="#4C72B0",
                label="Pareto front")
    ax.set_xlabel("decode step latency (ms)")
    ax.set_ylabel("throughput (tokens/s/chip)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()


def cmd_serve_sweep(args: argparse.Namespace) -> int:
    from sim.runs.inference import run_serve_sweep  # the run stack, loaded when it runs

    req = cli.request_of(ServeSweepRequest, args)
    check_outputs(args)
    run = run_serve_sweep(req)
    rows, max_b = run.summary["rows"], run.summary["max_batch_that_fits"]
    several = isinstance(max_b, dict)
    if not several:
        max_b = {"": max_b}
    meshes = run.inputs["meshes"]
    what = "several configurations" if several else \
        f"mesh {rows[0]['mesh'] if rows else meshes[0]}"
    title = (f"{run.summary['model']} decode, {run.summary['topology']} {run.summary['chip']}, "
             f"{what}, context {run.summary['context_len']}")
    if args.out:
        # deferred: start-up
        from sim.export.output import write_json

        _write_sweep(Path(args.out), rows, title)
        write_json(Path(args.out) / "summary.json", run.to_dict())
    if args.json:
        cli.emit_json(run.to_dict())
        return 0
    print(title)
    cfg_col = several
    head = f"{'configuration':<28} " if cfg_col else ""
    print(f"{head}{'batch':>6} {'step ms':>10} {'tok/s/chip':>11}  fits")
    for r in rows:
        label = f"{r['mesh']} {r['weight_dtype']}/{r['kv_dtype']}"
        pre = f"{label:<28} " if cfg_col else ""
        print(f"{pre}{r['batch']:>6} {r['step_time_s'] * 1e3:>10.3f} "
              f"{r['tokens_per_s_per_chip']:>11.1f}  {'yes' if r['fits'] else 'no'}")
    for label, b in max_b.items():
        print(f"largest batch that fits{' (' + label + ')' if several else ''}: {b}")
    if args.out:
        print(f"wrote {cli.show_path(args.out)}/serve_sweep.csv, serve_sweep_pareto.png and "
              "summary.json")
    return 0


def _register_decode(sub, name: str) -> None:
    p = cli.add_command(sub, name, "simulate one decode (generate) step with a KV cache",
                        cmd_decode, set_scope=DecodeRequest.SET_SCOPE)
    _add_inference_args(p)
    cli.add_output_args(p, trace_chips=False)
    cli.add_step_perturbation_args(p)


def _register_prefill(sub, name: str) -> None:
    p = cli.add_command(sub, name, "simulate the prefill of a batch of prompts", cmd_prefill,
                        set_scope=PrefillRequest.SET_SCOPE)
    _add_inference_args(p, context_required=False)
    p.add_argument("--prompt-len", type=CONVERTERS["prompt_len"], required=True,
                   help="prompt tokens per sequence")
    p.add_argument("--prefill-chunk", type=CONVERTERS["prefill_chunk"],
                   help=f"tokens per prefill chunk (default: all; at most {MAX_CHUNKS} chunks)")
    cli.add_output_args(p, trace_chips=False)
    cli.add_step_perturbation_args(p)


def _register_sweep(sub, name: str) -> None:
    p = cli.add_command(sub, name, "decode latency vs throughput over batch sizes",
                        cmd_serve_sweep, set_scope=ServeSweepRequest.SET_SCOPE)
    _add_inference_args(p, batch=False)
    cli.add_moe_args(p)
    p.add_argument("--batches", default=_DEFAULT_BATCHES,
                   help=f"comma-separated batch sizes (default {_DEFAULT_BATCHES}); --mesh may "
                        f"list several meshes separated by ';' and --weight-dtype/--kv-dtype "
                        f"several dtypes separated by ',' to sweep them too")
    p.add_argument("--out", help="write serve_sweep.csv, serve_sweep_pareto.png and "
                                  "summary.json here")
    p.add_argument("--json", action="store_true", help="print one JSON object")



def register(sub) -> None:
    cli.register_commands(sub, [
        ("decode", _register_decode),
        ("prefill", _register_prefill),
        ("serve-sweep", _register_sweep),
    ])
