"""The Python API: one function per simulating command, taking either a typed request or the
command's settings as keywords by their Python names (`seq_len=8192`, the CLI's seq-len flag),
and returning a `sim.runs.Run` whose `.to_dict()` is the command's JSON result (a message in it
names settings by their Python names, where the CLI writes its flags).

    import sim
    req = sim.TrainRequest(slice="v5p-128", model="llama3-70b", seq_len=8192,
                           batch_per_chip=2, mesh={"fsdp": 16, "tensor": 4})
    base = sim.train(req)
    fast = sim.train(req.replace(overrides={"ici_link_bytes_per_s": "x2"}))
    same = sim.train(**base.inputs["flags"])          # the keyword form

Names or objects: `chip=` takes a preset name, a chip YAML path or a `ChipSpec`; `model=` a
zoo name, a YAML path or a `TransformerSpec`; `mesh=` a string or a {axis: size} dict;
`set=` (or `overrides=`) the what-if overrides as a dict. A run's `inputs["flags"]` are valid
keywords, so a recorded run is the base of the next what-if. Keywords become the same typed
request the CLI builds from argv, and `sim.run(request)` runs it: the two never disagree.
`progress=callback` (any function, with a request or keywords) receives a
`sim.ProgressUpdate` as the long parts of a run advance; nothing prints.
Studies over many points are `sim.sweep` (a DataFrame) and `sim.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sim.hardware import ChipSpec
from sim.runs import (
    CollectiveRequest,
    CompareCollectivesRequest,
    DecodeRequest,
    GoodputRequest,
    PrefillRequest,
    ReplayRequest,
    Request,
    Run,
    ServeRequest,
    ServeSweepRequest,
    TrainRequest,
    run,
)
from sim.runs.requests import mesh_text
from sim.runs.rerun import read_result, request_from_result
from topologies.errors import TpusimError
from topologies.validate import api_call, short_repr
from workloads.models import TransformerSpec


def request(cls: type[Request], fn: str, kwargs: dict[str, Any]) -> Request:
    """The typed request of keyword settings given to `sim.<fn>`."""
    kwargs = {k.replace("-", "_"): v for k, v in kwargs.items()}  # `inputs.flags` spelling too
    if "overrides" in kwargs:  # the request's own name for `set`: accept both
        if "set" in kwargs:
            raise TpusimError(f"sim.{fn}() got both set= and overrides=; give one")
        kwargs["set"] = kwargs.pop("overrides")
    objects: dict[str, Any] = {}
    for key, value in list(kwargs.items()):
        if key == "chip" and isinstance(value, ChipSpec):
            objects["chip_spec"], kwargs[key] = value, value.name
        elif key == "model" and isinstance(value, TransformerSpec):
            objects["model_spec"], kwargs[key] = value, value.name
        elif key == "set" and value is not None and not isinstance(value, Mapping):
            raise TpusimError(
                f"sim.{fn}(set=...) takes a dict such as {{'ici_link_bytes_per_s': 'x2'}}, got "
                f"{type(value).__name__}"
            )
        elif key == "mesh" and isinstance(value, Mapping):
            kwargs[key] = mesh_text(f"sim.{fn}", value)
    return cls.from_flags(kwargs, caller=f"sim.{fn}", **objects)


def _call(cls: type[Request], fn: str, req: Request | None, kwargs: dict[str, Any]) -> Run:
    # `progress=` is the run's, not a setting: a callback taking each ProgressUpdate.
    progress = kwargs.pop("progress", None)
    if req is not None:
        if kwargs:
            raise TpusimError(f"sim.{fn}() takes a request or keywords, not both; use "
                              f"request.replace({', '.join(kwargs)}=...)")
        if not isinstance(req, cls):
            raise TpusimError(f"sim.{fn}() takes a {cls.__name__}, got {short_repr(req)}; "
                              f"run any request with sim.run(request)")
        if isinstance(req, GoodputRequest) and cls is not GoodputRequest:
            # A GoodputRequest holds train's settings (it is a TrainRequest's subclass), but it
            # runs a whole job, not one step.
            raise TpusimError(f"sim.{fn}() takes a {cls.__name__}, got a GoodputRequest (tpusim "
                              f"goodput); run it with sim.goodput(request) or sim.run(request)")
        return run(req, progress=progress)
    return run(request(cls, fn, kwargs), progress=progress)


@api_call("sim.collective")
def collective(req: CollectiveRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim collective`: one collective on a pod.

    Settings: chip/slice/shape/wraparound/slices, op, axes, bytes (an int or text such as
    "32MiB"), algorithm, src/dst (send), shift (permute), mode, chunks, the perturbations
    (slow_link=[...], dead_link=[...], scenario=path) and set={...}. `Run.result` is the
    `CollectiveResult` (`.links` and `.timeline` tables).
    """
    return _call(CollectiveRequest, "collective", req, flags)


@api_call("sim.compare_collectives")
def compare_collectives(req: CompareCollectivesRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim compare-collectives`: one collective under every algorithm (`summary["results"]`
    has a row per algorithm; `Run.result` the CollectiveResults that applied)."""
    return _call(CompareCollectivesRequest, "compare_collectives", req, flags)


@api_call("sim.train")
def train(req: TrainRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim train`: one training step.

    Settings: the pod (chip/slice/shape/...), model, seq_len, batch_per_chip, mesh, dcn,
    axis_map, remat, attention, microbatches, param_dtype/grad_dtype/gather_dtype/
    optimizer_dtype, optimizer, pipeline_schedule, no_overlap, no_fusion, tp_activations,
    tp_comm, dp_allreduce, fsdp_grad, dp_grad_split, ep_alltoall, moe_dispatch, vocab_tiling,
    logits_dtype, mlp_act_dtype, embed_lookup, fsdp_gather, algorithm, the perturbations,
    set={...}.
    `Run.result` is the `StepResult` (`.ops`, `.units`, `.links`, `.memory`), `Run.trace` the
    compiled program.
    """
    return _call(TrainRequest, "train", req, flags)


@api_call("sim.replay_trace")
def replay(req: ReplayRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim replay`: a trace file written by `tpusim compile` (trace=path) on a pod."""
    return _call(ReplayRequest, "replay", req, flags)


@api_call("sim.decode")
def decode(req: DecodeRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim decode`: one decode step (model, batch, context_len, mesh, dcn, weight_dtype,
    kv_dtype, matmul_dtype, the pod, algorithm, perturbations, set={...})."""
    return _call(DecodeRequest, "decode", req, flags)


@api_call("sim.prefill")
def prefill(req: PrefillRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim prefill`: the prefill of a batch of prompts (prompt_len, prefill_chunk, and the
    decode settings)."""
    return _call(PrefillRequest, "prefill", req, flags)


@api_call("sim.serve_sweep")
def serve_sweep(req: ServeSweepRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim serve-sweep`: decode latency vs throughput over batches (batches="1,4,16"),
    meshes ("tensor=8;data=2,tensor=4") and dtypes; `Run.result` is the list of rows."""
    return _call(ServeSweepRequest, "serve_sweep", req, flags)


@api_call("sim.serve")
def serve(req: ServeRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim serve`: a stream of requests served over time. The workload (arrival
    poisson/gamma/trace, rate, cv, trace, requests or duration, prompt_tokens/output_tokens as
    "fixed:N", "uniform:A,B" or "lognormal:MEAN,SIGMA", seed), the deployment (the pod, mesh,
    dtypes, replicas, router; or prefill_replicas/decode_replicas with their meshes and
    slices), the scheduler (scheduler, max_batch, max_tokens_per_iter, prefill_chunk,
    kv_block_tokens, preemption "recompute" or "swap", prefix_caching), slo
    ("ttft=0.5,tpot=0.05"), exact_costs, the perturbations, set={...}.
    `Run.result` is a `ServeResult` (`.requests_frame()`, `.iterations_frame()`)."""
    return _call(ServeRequest, "serve", req, flags)


@api_call("sim.goodput")
def goodput(req: GoodputRequest | None = None, /, **flags: Any) -> Run:
    """`tpusim goodput`: a training job's goodput under chip and host failures. The job
    (step_time, or the `train` settings whose step the step model simulates; steps or hours),
    the failures (mtbf_hours for the slice, chip_mtbf_hours/host_mtbf_hours or
    host_availability per part, or failure_trace; repair_hours, chips_per_host), the spares
    (spare_cubes, no_ocs), checkpoints and restarts (checkpoint_interval: None searches for the
    best; checkpoint_cost, restart_cost, swap_cost, storage_bytes_per_s), seeds and seed,
    engine ("event-skip" or "simpy"). `Run.result` is a `GoodputResult` (`.seeds_frame()`,
    `.intervals_frame()`, `.events_frame()`)."""
    return _call(GoodputRequest, "goodput", req, flags)


@api_call("sim.rerun")
def rerun(result: Mapping[str, Any] | str | Path) -> Run:
    """Run a recorded result again from its `inputs` (a `Run.to_dict()`, a parsed JSON
    result, or the path of one); the new `.to_dict()` equals the recorded one."""
    source = "result"
    if isinstance(result, (str, Path)):
        # The rules of `tpusim rerun`: at most 32 MiB, JSON nested at most 32 deep, integers
        # of at most 30 digits, no NaN (json.loads alone raised RecursionError or ValueError).
        source = f"result file {str(result)!r}"
        result, _text = read_result(Path(result))
    return run(request_from_result(result, source=source))


__all__ = ["Run", "collective", "compare_collectives", "decode", "goodput", "prefill", "replay",
           "request", "rerun", "serve", "serve_sweep", "train"]
