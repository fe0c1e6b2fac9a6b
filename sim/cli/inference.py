"""Inference subcommands: `decode` (one generate step), `prefill` and `serve-sweep` (the
latency-throughput table over batch sizes). They register into `sim.cli` like `sim.cli.training`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from sim.cli import common as cli
from sim.cli.training import print_notes
from topologies.errors import TpusimError
from topologies.validate import (
    MAX_BATCH,
    MAX_CHUNKS,
    MAX_SWEEP_RUNS,
    MAX_TOKENS,
    int_flag,
    split_list,
)

SWEEP_COLUMNS = ("mesh", "weight_dtype", "kv_dtype", "batch", "step_time_s",
                 "tokens_per_s_per_chip", "fits", "hbm_peak_bytes")
_DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"


def _add_inference_args(p: argparse.ArgumentParser, *, batch: bool = True,
                        context_required: bool = True) -> None:
    p.add_argument("--model", required=True, help="zoo name (llama3-70b, ...) or a model YAML")
    if batch:
        p.add_argument("--batch", type=int_flag("--batch", hi=MAX_BATCH), required=True,
                       help="sequences decoded together" if context_required
                       else "prompts prefilled together")
    p.add_argument("--context-len", type=int_flag("--context-len", hi=MAX_TOKENS),
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


def _config(args: argparse.Namespace, batch: int, moe):
    from workloads.decode import DecodeConfig

    prompt = getattr(args, "prompt_len", None)
    if prompt is not None and prompt < 1:
        raise TpusimError(f"--prompt-len {prompt} must be >= 1 (tokens per prompt)")
    context = args.context_len if args.context_len is not None else prompt
    if context is None or context < 1:
        raise TpusimError(f"--context-len {context} must be >= 1 (tokens in each KV cache)")
    return DecodeConfig(
        batch=batch, context_len=context,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype, matmul_dtype=args.matmul_dtype,
        prompt_len=getattr(args, "prompt_len", None),
        prefill_chunk=getattr(args, "prefill_chunk", None),
        moe=moe, sampling=args.sampling,
    )


def _setup(args: argparse.Namespace):
    from topologies.mesh import parse_mesh

    chip, topo = cli.resolve_pod(args)
    if getattr(args, "perfetto", None):
        cli.check_trace_chips(args, topo.num_chips)
    model = cli.resolve_model(args)
    moe = cli.moe_config(args, cli.scenario_from_args(args, topo))
    return chip, topo, model, parse_mesh(args.mesh, args.dcn), moe


def _inputs(args, chip, topo, model, meshes, cfg) -> dict[str, Any]:
    from sim.runs import describe_config, describe_mesh

    inputs = cli.base_inputs(args, chip, topo)
    inputs["model"] = model.to_dict()
    described = [describe_mesh(m, topo) for m in meshes]
    if len(described) == 1:
        inputs["mesh"] = described[0]
    else:
        inputs["meshes"] = described
    inputs["decode"] = describe_config(cfg)
    inputs["algorithm"] = getattr(args, "algorithm", "auto")
    return inputs


def _run_decode(chip, topo, model, mesh, cfg, algorithm: str = "auto"):
    from sim.executors import Executor, simulate_step
    from workloads.decode import compile_decode_step

    trace = compile_decode_step(model, mesh, topo.num_chips, cfg)
    return trace, simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE,
                                algorithm=algorithm)


def _padded_batch(trace) -> int:
    """The batch SPMD actually runs: padded to a multiple of the data x expert shards (every
    shard holds whole sequences, so the busiest chip sets the step time)."""
    shards = trace.mesh.size("data") * trace.mesh.size("expert")
    return -(-int(trace.meta["batch"]) // shards) * shards


def decode_summary(trace, result, max_batch: int) -> dict[str, Any]:
    """The `tpusim decode --json` object (per-chip bytes unless suffixed `_total`)."""
    from sim.cli.training import per_chip_summary

    meta = trace.meta
    step = result.step_time_s
    return {
        "model": meta["model"],
        "chip": result.chip,
        "topology": result.topology,
        "num_chips": result.num_chips,
        "batch": meta["batch"],
        "padded_batch": _padded_batch(trace),
        "context_len": meta["context_len"],
        "weight_dtype": meta["weight_dtype"],
        "kv_dtype": meta["kv_dtype"],
        "matmul_dtype": meta["matmul_dtype"],
        "sharding": meta.get("sharding", "1d"),
        "step_time_s": step,
        "tokens_per_s": meta["batch"] / step,
        "tokens_per_s_per_chip": meta["batch"] / step / result.num_chips,
        "weights_bytes": meta["weights_bytes"],
        "kv_cache_bytes": meta["kv_cache_bytes"],
        "activation_bytes": meta["activation_bytes"],
        "weights_bytes_total": meta["weights_bytes_total"],
        "kv_cache_bytes_total": meta["kv_cache_bytes_total"],
        "hbm_peak_bytes": result.hbm_peak_bytes,
        "hbm_capacity_bytes": result.hbm_capacity_bytes,
        "fits_in_hbm": result.fits_in_hbm,
        "max_batch_that_fits": max_batch,
        "breakdown": {k: float(v) for k, v in result.breakdown.items()},
        "num_ops": result.num_ops,
        "collectives": result.collective_costs,
        **per_chip_summary(result),
        **({"moe": meta["moe"]} if "moe" in meta else {}),
    }


def _write_outputs(args, result, summary) -> list[str]:
    from sim.cli.training import _write_outputs as write

    return write(args, result, summary)


def run_decode(args: argparse.Namespace):
    """`tpusim decode` as a library call: a `Run` with the summary, inputs, StepResult, trace."""
    from sim.runs import Run
    from workloads.decode import compile_decode_step, max_batch_that_fits

    chip, topo, model, mesh, moe = _setup(args)
    cfg = _config(args, args.batch, moe)
    trace = compile_decode_step(model, mesh, topo.num_chips, cfg)
    result = cli.simulate_step(args, trace, chip, topo)
    max_b = max_batch_that_fits(model, mesh, topo.num_chips, cfg, chip.hbm_bytes)
    return Run(command="decode", summary=decode_summary(trace, result, max_b),
               inputs=_inputs(args, chip, topo, model, [mesh], cfg), result=result, trace=trace)


def cmd_decode(args: argparse.Namespace) -> int:
    from sim.cli.training import check_outputs

    check_outputs(args)
    run = run_decode(args)
    s, result = run.summary, run.result
    notes = _write_outputs(args, result, run.to_dict())
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
    from sim.engine import breakdown_label

    print("  critical path:")
    for k, v in s["breakdown"].items():
        share = v / s["step_time_s"] if s["step_time_s"] else 0.0
        print(f"    {breakdown_label(k):<22} {v * 1e3:10.3f} ms  {share:6.1%}")
    print_notes(args, notes)
    return 0


def run_prefill(args: argparse.Namespace):
    """`tpusim prefill` as a library call: a `Run` with the summary, inputs, StepResult, trace."""
    from sim.cli.training import per_chip_summary
    from sim.runs import Run
    from workloads.decode import compile_prefill

    chip, topo, model, mesh, moe = _setup(args)
    cfg = _config(args, args.batch, moe)
    trace = compile_prefill(model, mesh, topo.num_chips, cfg)
    result = cli.simulate_step(args, trace, chip, topo)
    meta = trace.meta
    t = result.step_time_s
    tokens = meta["batch"] * meta["prompt_len"]
    s = {
        "model": meta["model"], "chip": result.chip, "topology": result.topology,
        "num_chips": result.num_chips, "batch": meta["batch"],
        "sharding": meta.get("sharding", "1d"), "prompt_len": meta["prompt_len"],
        "prefill_chunk": meta["prefill_chunk"],
        "num_chunks": meta["num_chunks"], "time_s": t,
        "tokens_per_s_per_chip": tokens / t / result.num_chips,
        "weights_bytes": meta["weights_bytes"], "kv_cache_bytes": meta["kv_cache_bytes"],
        "hbm_peak_bytes": result.hbm_peak_bytes, "fits_in_hbm": result.fits_in_hbm,
        "breakdown": {k: float(v) for k, v in result.breakdown.items()},
        **per_chip_summary(result),
        **({"moe": meta["moe"]} if "moe" in meta else {}),
    }
    return Run(command="prefill", summary=s, inputs=_inputs(args, chip, topo, model, [mesh], cfg),
               result=result, trace=trace)


def cmd_prefill(args: argparse.Namespace) -> int:
    from sim.cli.training import check_outputs

    check_outputs(args)
    run = run_prefill(args)
    s, result = run.summary, run.result
    t = s["time_s"]
    notes = _write_outputs(args, result, run.to_dict())
    if args.json:
        cli.emit_json(run.to_dict())
        return 0
    print(f"{s['model']} prefill of {s['batch']} x {s['prompt_len']} tokens on {s['topology']} "
          f"{s['chip']} ({s['num_chips']} chips, {s['num_chunks']} chunk(s))")
    print(f"  time             {t:.4f} s")
    print(f"  tokens/s/chip    {s['tokens_per_s_per_chip']:.1f}")
    fit = "fits" if s["fits_in_hbm"] else "DOES NOT FIT"
    print(f"  HBM peak         {s['hbm_peak_bytes'] / 1e9:.2f} GB ({fit})")
    from sim.engine import breakdown_label

    print("  critical path:")
    for k, v in s["breakdown"].items():
        share = v / t if t else 0.0
        print(f"    {breakdown_label(k):<22} {v * 1e3:10.3f} ms  {share:6.1%}")
    print_notes(args, notes)
    return 0


def parse_batches(text: str) -> list[int]:
    items = split_list(text, "--batches", example="1,2,4,8")
    if len(items) > MAX_SWEEP_RUNS:
        raise TpusimError(
            f"--batches lists {len(items):,} batch sizes, over the limit of {MAX_SWEEP_RUNS}; "
            f"sweep fewer sizes (e.g. powers of two)"
        )
    parse = int_flag("--batches item", lo=1, hi=MAX_BATCH)
    try:
        out = [parse(x) for x in items]
    except argparse.ArgumentTypeError as exc:
        raise TpusimError(f"{exc}; write e.g. --batches 1,2,4,8") from None
    return sorted(set(out))


def sweep(chip, topo, model, mesh, cfg, batches: list[int],
          algorithm: str = "auto") -> list[dict[str, Any]]:
    """One replayed decode step per batch size: the latency-throughput table's rows."""
    from sim.progress import progress

    rows = []
    for b in progress(batches, desc=f"batches ({mesh.describe()})"):
        _trace, r = _run_decode(chip, topo, model, mesh, dataclasses.replace(cfg, batch=b),
                                algorithm)
        rows.append({"mesh": mesh.describe(), "weight_dtype": cfg.weight_dtype,
                     "kv_dtype": cfg.kv_dtype, "batch": b, "step_time_s": r.step_time_s,
                     "tokens_per_s_per_chip": b / r.step_time_s / topo.num_chips,
                     "fits": bool(r.fits_in_hbm), "hbm_peak_bytes": r.hbm_peak_bytes})
    return rows


def _pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fitting points not beaten on both latency and throughput by another fitting point."""
    ok = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_time_s"])
    front, best = [], -1.0
    for r in ok:
        if r["tokens_per_s_per_chip"] > best:
            front.append(r)
            best = r["tokens_per_s_per_chip"]
    return front


def _write_sweep(out: Path, rows: list[dict[str, Any]], title: str) -> list[Path]:
    import csv

    from sim.export.output import atomic_write

    def write_csv(p: Path) -> None:
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
            w.writeheader()
            w.writerows(rows)

    paths = [atomic_write(out / "serve_sweep.csv", write_csv)]
    import matplotlib
    from matplotlib.figure import Figure

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
    front = _pareto(rows)
    if front:
        ax.plot([r["step_time_s"] * 1e3 for r in front],
                [r["tokens_per_s_per_chip"] for r in front], "--", color="#4C72B0",
                label="Pareto front")
    ax.set_xlabel("decode step latency (ms)")
    ax.set_ylabel("throughput (tokens/s/chip)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()


def run_serve_sweep(args: argparse.Namespace):
    """`tpusim serve-sweep` as a library call: batch sizes x (optionally) several meshes
    (`;`-separated) x weight/KV dtypes; `Run.result` is the list of rows."""
    from sim.runs import Run, describe_mesh
    from topologies.mesh import parse_mesh
    from workloads.decode import max_batch_that_fits

    args = argparse.Namespace(**vars(args))  # the loop below sets one mesh / dtype at a time
    mesh_texts = split_list(args.mesh, "--mesh", sep=";", example="tensor=8;data=2,tensor=4")
    args.mesh = mesh_texts[0]
    chip, topo, model, _mesh, moe = _setup(args)
    batches = parse_batches(args.batches)
    mesh_texts = list(dict.fromkeys(mesh_texts))  # a repeated entry is swept once
    meshes = [parse_mesh(m, args.dcn) for m in mesh_texts]
    wdts = list(dict.fromkeys(split_list(args.weight_dtype, "--weight-dtype", example="bf16,int8")))
    kvdts = list(dict.fromkeys(split_list(args.kv_dtype, "--kv-dtype", example="bf16,int8")))
    runs = len(meshes) * len(wdts) * len(kvdts) * len(batches)
    if runs > MAX_SWEEP_RUNS:
        raise TpusimError(
            f"this sweep is {runs:,} decode steps ({len(meshes)} mesh(es) x {len(wdts)} weight "
            f"dtype(s) x {len(kvdts)} KV dtype(s) x {len(batches)} batch sizes), over the limit "
            f"of {MAX_SWEEP_RUNS}; sweep fewer combinations"
        )
    rows, max_b = [], {}
    for mesh in meshes:
        for wdt in wdts:
            for kvdt in kvdts:
                args.weight_dtype, args.kv_dtype = wdt, kvdt
                cfg = _config(args, batches[0], moe)
                rows += sweep(chip, topo, model, mesh, cfg, batches,
                              getattr(args, "algorithm", "auto"))
                max_b[f"{mesh.describe()} {wdt}/{kvdt}"] = max_batch_that_fits(
                    model, mesh, topo.num_chips, cfg, chip.hbm_bytes)
    several = len(max_b) > 1
    out = {"model": model.name, "chip": chip.name, "topology": topo.name,
           "context_len": args.context_len, "rows": rows,
           "pareto": [{k: r[k] for k in ("mesh", "weight_dtype", "kv_dtype", "batch")}
                      for r in _pareto(rows)]}
    if several:
        out["max_batch_that_fits"] = max_b
    else:
        out["max_batch_that_fits"] = next(iter(max_b.values()))
        out["pareto_batches"] = [r["batch"] for r in _pareto(rows)]
    inputs = cli.base_inputs(args, chip, topo)
    inputs["model"] = model.to_dict()
    inputs["meshes"] = [describe_mesh(m, topo) for m in meshes]
    inputs["batches"] = batches
    inputs["weight_dtypes"] = wdts
    inputs["kv_dtypes"] = kvdts
    inputs["context_len"] = args.context_len
    inputs["matmul_dtype"] = args.matmul_dtype
    inputs["algorithm"] = getattr(args, "algorithm", "auto")
    return Run(command="serve-sweep", summary=out, inputs=inputs, result=rows)


def cmd_serve_sweep(args: argparse.Namespace) -> int:
    from sim.cli.training import check_outputs

    check_outputs(args)
    run = run_serve_sweep(args)
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
                        cmd_decode, set_scope=("chip", "topology", "collective", "model"))
    _add_inference_args(p)
    cli.add_output_args(p, trace_chips=False)
    cli.add_step_perturbation_args(p)


def _register_prefill(sub, name: str) -> None:
    p = cli.add_command(sub, name, "simulate the prefill of a batch of prompts", cmd_prefill,
                        set_scope=("chip", "topology", "collective", "model"))
    _add_inference_args(p, context_required=False)
    p.add_argument("--prompt-len", type=int_flag("--prompt-len", hi=MAX_TOKENS), required=True,
                   help="prompt tokens per sequence")
    p.add_argument("--prefill-chunk", type=int_flag("--prefill-chunk", hi=MAX_TOKENS),
                   help=f"tokens per prefill chunk (default: all; at most {MAX_CHUNKS} chunks)")
    cli.add_output_args(p, trace_chips=False)
    cli.add_step_perturbation_args(p)


def _register_sweep(sub, name: str) -> None:
    p = cli.add_command(sub, name, "decode latency vs throughput over batch sizes",
                        cmd_serve_sweep, set_scope=("chip", "topology", "collective", "model"))
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
