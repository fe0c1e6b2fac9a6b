"""Inference as runs: one decode step (`run_decode`), a prefill (`run_prefill`), and the
latency-throughput table over batch sizes (`run_serve_sweep`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sim.engine.executors import Executor
from sim.engine.executors import simulate_step as run_step
from sim.runs.auto_switch import auto_switch_report
from sim.runs.bind import (
    algorithm_of,
    base_inputs,
    moe_config,
    reports_failures,
    resolve_model,
    resolve_pod,
    scenario_of,
    simulate_step,
)
from sim.runs.power import simulate_with_cap
from sim.runs.requests import DecodeRequest, PrefillRequest, ServeSweepRequest
from sim.runs.result import Run, describe_config, describe_mesh
from sim.runs.train import per_chip_summary, step_energy_of, with_energy
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.progress import tracked
from topologies.validate import MAX_BATCH, MAX_SWEEP_RUNS, FlagError, int_flag, split_list
from workloads.inference import (
    DecodeConfig,
    compile_decode_step,
    compile_prefill,
    max_batch_that_fits,
)

SWEEP_COLUMNS = ("mesh", "weight_dtype", "kv_dtype", "batch", "step_time_s",
                 "tokens_per_s_per_chip", "fits", "hbm_peak_bytes")


def decode_config(req, batch: int, moe, *, weight_dtype=None, kv_dtype=None) -> DecodeConfig:
    """The DecodeConfig of a request's settings (`weight_dtype`/`kv_dtype` replace the
    request's, for a sweep over several)."""
    prompt = getattr(req, "prompt_len", None)
    if prompt is not None and prompt < 1:
        raise TpusimError(f"{{prompt_len}} {prompt} must be >= 1 (tokens per prompt)",
                          "prompt_len")
    context = req.context_len if req.context_len is not None else prompt
    if context is None or context < 1:
        raise TpusimError(f"{{context_len}} {context} must be >= 1 (tokens in each KV cache)",
                          "context_len")
    return DecodeConfig(
        batch=batch, context_len=context,
        weight_dtype=weight_dtype if weight_dtype is not None else req.weight_dtype,
        kv_dtype=kv_dtype if kv_dtype is not None else req.kv_dtype,
        matmul_dtype=req.matmul_dtype,
        prompt_len=prompt,
        prefill_chunk=getattr(req, "prefill_chunk", None),
        moe=moe, sampling=req.sampling,
    )


def _setup(req, mesh_text: str | None = None):
    pod = resolve_pod(req)
    base_model, model = resolve_model(req)
    moe = moe_config(req, scenario_of(req, pod.topology))
    mesh = parse_mesh(mesh_text if mesh_text is not None else req.mesh, req.dcn)
    return pod, base_model, model, mesh, moe


def _inputs(req, pod, base_model, model, meshes, cfg) -> dict[str, Any]:
    inputs = base_inputs(req, pod, base_model)
    inputs["model"] = model.to_dict()
    described = [describe_mesh(m, pod.topology) for m in meshes]
    if len(described) == 1:
        inputs["mesh"] = described[0]
    else:
        inputs["meshes"] = described
    inputs["decode"] = describe_config(cfg)
    inputs["algorithm"] = algorithm_of(req)
    return inputs


def padded_batch(trace) -> int:
    """The batch SPMD actually runs: padded to a multiple of the data x expert shards (every
    shard holds whole sequences, so the busiest chip sets the step time)."""
    shards = trace.mesh.size("data") * trace.mesh.size("expert")
    return -(-int(trace.meta.batch) // shards) * shards


def decode_summary(trace, result, max_batch: int) -> dict[str, Any]:
    """The result fields of a decode run (per-chip bytes unless suffixed `_total`)."""
    meta = trace.meta
    step = result.step_time_s
    return {
        "model": meta.model,
        "chip": result.chip,
        "topology": result.topology,
        "num_chips": result.num_chips,
        "batch": meta.batch,
        "padded_batch": padded_batch(trace),
        "context_len": meta.context_len,
        "weight_dtype": meta.weight_dtype,
        "kv_dtype": meta.kv_dtype,
        "matmul_dtype": meta.matmul_dtype,
        "sharding": meta.sharding or "1d",
        "step_time_s": step,
        "tokens_per_s": meta.batch / step,
        "tokens_per_s_per_chip": meta.batch / step / result.num_chips,
        "weights_bytes": meta.weights_bytes,
        "kv_cache_bytes": meta.kv_cache_bytes,
        "activation_bytes": meta.activation_bytes,
        "weights_bytes_total": meta.weights_bytes_total,
        "kv_cache_bytes_total": meta.kv_cache_bytes_total,
        "hbm_peak_bytes": result.hbm_peak_bytes,
        "hbm_capacity_bytes": result.hbm_capacity_bytes,
        "fits_in_hbm": result.fits_in_hbm,
        "max_batch_that_fits": max_batch,
        "breakdown": {k: float(v) for k, v in result.breakdown.items()},
        "num_ops": result.num_ops,
        "collectives": result.collective_costs,
        **per_chip_summary(result),
        **({"moe": meta.moe} if meta.moe is not None else {}),
    }


def _note_auto_switch(summary: dict, req, trace, chip, pod, step_time_s: float) -> None:
    """`auto_switch` in `summary` where a what-if on the chip's links made auto pick other
    algorithms and that is what slows the step (sim/runs/auto_switch.py), as `train` does."""
    if algorithm_of(req) != "auto":
        return
    topo = pod.topology
    switch = auto_switch_report(
        trace, chip, pod.base_chip, topo, step_time_s,
        lambda held: simulate_step(req, trace, chip, topo, algorithm=held).step_time_s)
    if switch is not None:
        summary["auto_switch"] = switch


@reports_failures
def run_decode(req: DecodeRequest) -> Run:
    """One decode step: a `Run` with the summary, inputs, StepResult and trace."""
    pod, base_model, model, mesh, moe = _setup(req)
    chip, topo = pod.chip, pod.topology
    cfg = decode_config(req, req.batch, moe)
    trace = compile_decode_step(model, mesh, topo.num_chips, cfg)
    # Joules per token count the output tokens: one per sequence of the batch per step.
    result, chip, energy, cap = simulate_with_cap(
        req.power_cap, chip, lambda c: simulate_step(req, trace, c, topo),
        step_energy_of(trace, topo, trace.meta.batch))
    max_b = max_batch_that_fits(model, mesh, topo.num_chips, cfg, chip.hbm_bytes)
    summary = decode_summary(trace, result, max_b)
    _note_auto_switch(summary, req, trace, chip, pod, result.step_time_s)
    summary = with_energy(summary, energy, cap)
    return Run(command="decode", summary=summary,
               inputs=_inputs(req, pod, base_model, model, [mesh], cfg), result=result,
               trace=trace, energy_detail=energy)


@reports_failures
def run_prefill(req: PrefillRequest) -> Run:
    """The prefill of a batch of prompts: a `Run` with the summary, inputs, StepResult, trace."""
    pod, base_model, model, mesh, moe = _setup(req)
    chip, topo = pod.chip, pod.topology
    cfg = decode_config(req, req.batch, moe)
    trace = compile_prefill(model, mesh, topo.num_chips, cfg)
    meta = trace.meta
    tokens = meta.batch * meta.prompt_len  # joules per token count the prompt tokens
    result, chip, energy, cap = simulate_with_cap(
        req.power_cap, chip, lambda c: simulate_step(req, trace, c, topo),
        step_energy_of(trace, topo, tokens))
    t = result.step_time_s
    s = {
        "model": meta.model, "chip": result.chip, "topology": result.topology,
        "num_chips": result.num_chips, "batch": meta.batch,
        "sharding": meta.sharding or "1d", "prompt_len": meta.prompt_len,
        "prefill_chunk": meta.prefill_chunk,
        "num_chunks": meta.num_chunks, "time_s": t,
        "tokens_per_s_per_chip": tokens / t / result.num_chips,
        "weights_bytes": meta.weights_bytes, "kv_cache_bytes": meta.kv_cache_bytes,
        "hbm_peak_bytes": result.hbm_peak_bytes, "fits_in_hbm": result.fits_in_hbm,
        "breakdown": {k: float(v) for k, v in result.breakdown.items()},
        **per_chip_summary(result),
        **({"moe": meta.moe} if meta.moe is not None else {}),
    }
    _note_auto_switch(s, req, trace, chip, pod, t)
    with_energy(s, energy, cap)
    return Run(command="prefill", summary=s,
               inputs=_inputs(req, pod, base_model, model, [mesh], cfg), result=result,
               trace=trace, energy_detail=energy)


def parse_batches(text: str) -> list[int]:
    """`1,4,16` -> sorted distinct batch sizes (at most `MAX_SWEEP_RUNS`)."""
    items = split_list(text, "batches", example="1,2,4,8")
    if len(items) > MAX_SWEEP_RUNS:
        raise TpusimError(
            f"{{batches}} lists {len(items):,} batch sizes, over the limit of {MAX_SWEEP_RUNS}; "
            f"sweep fewer sizes (e.g. powers of two)", "batches"
        )
    parse = int_flag("batches", lo=1, hi=MAX_BATCH)
    try:
        out = [parse(x) for x in items]
    except FlagError as exc:
        item = exc.template.replace("{batches}", "{batches} item", 1)
        raise TpusimError(f"{item}; write e.g. {{batches}} 1,2,4,8", *exc.params) from None
    return sorted(set(out))


def _decode_once(chip, topo, model, mesh, cfg, algorithm: str = "auto"):
    trace = compile_decode_step(model, mesh, topo.num_chips, cfg)
    return trace, run_step(trace, chip, topo, executor=Executor.REPRESENTATIVE,
                           algorithm=algorithm)


def sweep_rows(chip, topo, model, mesh, cfg, batches: list[int],
               algorithm: str = "auto") -> list[dict[str, Any]]:
    """One replayed decode step per batch size: the latency-throughput table's rows."""
    rows = []
    for b in tracked(batches, f"serve-sweep ({mesh.describe()})", unit="batch"):
        _trace, r = _decode_once(chip, topo, model, mesh, dataclasses.replace(cfg, batch=b),
                                 algorithm)
        rows.append({"mesh": mesh.describe(), "weight_dtype": cfg.weight_dtype,
                     "kv_dtype": cfg.kv_dtype, "batch": b, "step_time_s": r.step_time_s,
                     "tokens_per_s_per_chip": b / r.step_time_s / topo.num_chips,
                     "fits": bool(r.fits_in_hbm), "hbm_peak_bytes": r.hbm_peak_bytes})
    return rows


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fitting points not beaten on both latency and throughput by another fitting point."""
    ok = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_time_s"])
    front, best = [], -1.0
    for r in ok:
        if r["tokens_per_s_per_chip"] > best:
            front.append(r)
            best = r["tokens_per_s_per_chip"]
    return front


def run_serve_sweep(req: ServeSweepRequest) -> Run:
    """Batch sizes x (optionally) several meshes (`;`-separated) x weight/KV dtypes;
    `Run.result` is the list of rows."""
    mesh_texts = split_list(req.mesh, "mesh", sep=";", example="tensor=8;data=2,tensor=4")
    pod, base_model, model, _mesh, moe = _setup(req, mesh_texts[0])
    chip, topo = pod.chip, pod.topology
    batches = parse_batches(req.batches)
    mesh_texts = list(dict.fromkeys(mesh_texts))  # a repeated entry is swept once
    meshes = [parse_mesh(m, req.dcn) for m in mesh_texts]
    wdts = list(dict.fromkeys(split_list(req.weight_dtype, "weight_dtype", example="bf16,int8")))
    kvdts = list(dict.fromkeys(split_list(req.kv_dtype, "kv_dtype", example="bf16,int8")))
    runs = len(meshes) * len(wdts) * len(kvdts) * len(batches)
    if runs > MAX_SWEEP_RUNS:
        raise TpusimError(
            f"this sweep is {runs:,} decode steps ({len(meshes)} mesh(es) x {len(wdts)} weight "
            f"dtype(s) x {len(kvdts)} KV dtype(s) x {len(batches)} batch sizes), over the limit "
            f"of {MAX_SWEEP_RUNS}; sweep fewer combinations"
        )
    algorithm = algorithm_of(req)
    rows, max_b = [], {}
    for mesh in meshes:
        for wdt in wdts:
            for kvdt in kvdts:
                cfg = decode_config(req, batches[0], moe, weight_dtype=wdt, kv_dtype=kvdt)
                rows += sweep_rows(chip, topo, model, mesh, cfg, batches, algorithm)
                max_b[f"{mesh.describe()} {wdt}/{kvdt}"] = max_batch_that_fits(
                    model, mesh, topo.num_chips, cfg, chip.hbm_bytes)
    several = len(max_b) > 1
    out = {"model": model.name, "chip": chip.name, "topology": topo.name,
           "context_len": req.context_len, "rows": rows,
           "pareto": [{k: r[k] for k in ("mesh", "weight_dtype", "kv_dtype", "batch")}
                      for r in pareto(rows)]}
    if several:
        out["max_batch_that_fits"] = max_b
    else:
        out["max_batch_that_fits"] = next(iter(max_b.values()))
        out["pareto_batches"] = [r["batch"] for r in pareto(rows)]
    inputs = base_inputs(req, pod, base_model)
    inputs["model"] = model.to_dict()
    inputs["meshes"] = [describe_mesh(m, topo) for m in meshes]
    inputs["batches"] = batches
    inputs["weight_dtypes"] = wdts
    inputs["kv_dtypes"] = kvdts
    inputs["context_len"] = req.context_len
    inputs["matmul_dtype"] = req.matmul_dtype
    inputs["algorithm"] = algorithm
    return Run(command="serve-sweep", summary=out, inputs=inputs, result=rows)
