"""Serving as a run: a `ServeRequest` checked in full, its replicas bound to their pods and
costed (`sim.serving.costs`), its workload generated or read, the SimPy loop run
(`sim.serving.simulate`) and its statistics (`sim.serving.metrics`) returned as a `Run` whose
`result` is a `ServeResult` (one row per request and per iteration)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
from sim.runs.requests import ServeRequest
from sim.runs.result import Run, describe_mesh
from sim.runs.train import step_energy_of
from sim.serving.costs import CostBounds, IterationCosts, StepModel, describe_costs
from sim.serving.energy import PoolWork, serving_energy
from sim.serving.metrics import parse_slo, summarize
from sim.serving.simulate import (
    IterationLog,
    PoolSpec,
    PreemptionKind,
    Role,
    RouterKind,
    SchedulerConfig,
    SchedulerKind,
    ServingSim,
)
from sim.serving.transfer import KvTransferPath, kv_transfer
from sim.serving.workload import ArrivalKind, WorkloadConfig, generate, parse_lengths
from topologies.errors import Said, TpusimError
from topologies.mesh import parse_mesh
from topologies.progress import tracked
from topologies.validate import MAX_TOKENS, one_of, short_repr
from workloads.inference import DecodeConfig

REQUEST_COLUMNS = ("request", "arrival_s", "prompt_tokens", "output_tokens", "replica",
                   "decode_replica", "scheduled_s", "first_token_s", "kv_transferred_s",
                   "finish_s", "ttft_s", "tpot_s", "e2e_s", "queue_s", "preemptions")


@dataclass(frozen=True, kw_only=True)
class ServeResult:
    """The tables of a serving run: `requests` (column -> array, one row per request, every
    timestamp), `iterations` (an `IterationLog`: rows in `ITERATION_COLUMNS` order) and
    `queue_events` (time, +1 joined or -1 left a replica's queue, replica), in time order;
    `iteration_dynamic_j` and `replica_power` for the chips' power over time."""

    requests: dict[str, np.ndarray]
    iterations: IterationLog
    queue_events: list[tuple] = field(default_factory=list)
    # Per iteration (in `iterations` order) its dynamic joules on the replica's chips, and per
    # replica (its chips, one chip's idle watts): what the power track draws.
    iteration_dynamic_j: np.ndarray = field(default_factory=lambda: np.zeros(0))
    replica_power: tuple[tuple[int, float], ...] = ()

    def requests_frame(self):
        import pandas as pd

        n = self.requests["arrival_s"].size
        cols = {"request": np.arange(n, dtype=np.int64)}
        cols.update({c: self.requests[c] for c in REQUEST_COLUMNS[1:]})
        return pd.DataFrame(cols)

    def iterations_frame(self):
        import pandas as pd

        return pd.DataFrame(self.iterations.columns())


def _enum(cls, value: str, name: str):
    try:
        return cls(value)
    except ValueError:
        raise TpusimError(f"{{{name}}} {short_repr(value)} does not exist; "
                          f"{one_of(value, [m.value for m in cls])}", name) from None


def workload_config(req: ServeRequest) -> WorkloadConfig:
    """The workload settings, checked (one-line errors naming the setting, the rule, the
    fix)."""
    arrival = _enum(ArrivalKind, req.arrival, "arrival")
    if req.requests is not None and req.duration is not None:
        raise TpusimError("{requests} and {duration} both say when arrivals stop; give one",
                          "requests", "duration")
    if arrival is ArrivalKind.TRACE:
        if req.trace is None:
            raise TpusimError("{arrival} trace needs {trace} FILE (CSV or JSON lines with "
                              "arrival_s, prompt_tokens, output_tokens)", "arrival", "trace")
        for name, v in (("rate", req.rate), ("cv", req.cv),
                        ("prompt_tokens", req.prompt_tokens),
                        ("output_tokens", req.output_tokens)):
            if v is not None:
                raise TpusimError(f"{{{name}}} does not apply to {{arrival}} trace (the trace "
                                  f"gives arrivals and lengths); drop it", name, "arrival")
        return WorkloadConfig(arrival=arrival, trace=req.trace, num_requests=req.requests,
                              duration_s=req.duration)
    if req.trace is not None:
        raise TpusimError("{trace} is read with {arrival} trace; add it, or drop {trace}",
                          "trace", "arrival")
    if req.rate is None:
        raise TpusimError(f"{{arrival}} {arrival} needs {{rate}} (requests per second, > 0)",
                          "arrival", "rate")
    if req.cv is not None and arrival is not ArrivalKind.GAMMA:
        raise TpusimError("{cv} is the gamma arrivals' burstiness; add {arrival} gamma or drop "
                          "{cv}", "cv", "arrival")
    if req.requests is None and req.duration is None:
        raise TpusimError("give {requests} N or {duration} S (when arrivals stop)",
                          "requests", "duration")
    for name, v in (("prompt_tokens", req.prompt_tokens),
                    ("output_tokens", req.output_tokens)):
        if v is None:
            raise TpusimError(f"{{{name}}} is needed with {{arrival}} {arrival}; give a "
                              f"distribution, e.g. {{{name}}} lognormal:1000,0.8", name,
                              "arrival")
    return WorkloadConfig(
        arrival=arrival, rate_per_s=req.rate, cv=req.cv if req.cv is not None else 1.0,
        num_requests=req.requests, duration_s=req.duration,
        prompt_tokens=parse_lengths(req.prompt_tokens, "prompt_tokens"),
        output_tokens=parse_lengths(req.output_tokens, "output_tokens"),
        seed=req.seed if req.seed is not None else 0)


def scheduler_config(req: ServeRequest) -> SchedulerConfig:
    sched = _enum(SchedulerKind, req.scheduler, "scheduler")
    if sched is SchedulerKind.STATIC and (req.prefill_chunk is not None
                                          or req.max_tokens_per_iter is not None):
        raise TpusimError("{prefill_chunk} and {max_tokens_per_iter} shape continuous "
                          "batching's iterations; use {scheduler} continuous or drop them",
                          "prefill_chunk", "max_tokens_per_iter", "scheduler")
    if req.prefill_chunk is not None and req.max_tokens_per_iter is not None and \
            req.max_tokens_per_iter <= 1:
        raise TpusimError(f"{{max_tokens_per_iter}} {req.max_tokens_per_iter} leaves no room "
                          f"for a prefill chunk; give at least 2 (e.g. 2048)",
                          "max_tokens_per_iter")
    try:
        preemption = PreemptionKind(req.preemption)
    except ValueError:
        raise TpusimError(f"{{preemption}} {short_repr(req.preemption)} does not exist; "
                          f"{one_of(req.preemption, [m.value for m in PreemptionKind])}",
                          "preemption") from None
    if sched is SchedulerKind.STATIC and req.prefix_caching:
        raise TpusimError("{prefix_caching} shares cached prompt prefixes between the requests "
                          "of continuous batching; use {scheduler} continuous or drop it",
                          "prefix_caching", "scheduler")
    return SchedulerConfig(scheduler=sched, max_batch=req.max_batch,
                           max_tokens_per_iter=req.max_tokens_per_iter,
                           prefill_chunk=req.prefill_chunk,
                           kv_block_tokens=req.kv_block_tokens, preemption=preemption,
                           prefix_caching=req.prefix_caching)


def _pool_request(req: ServeRequest, slice_name: str | None, mesh: str | None) -> ServeRequest:
    if slice_name is None:
        return req if mesh is None else req.replace(mesh=mesh)
    return req.replace(slice=slice_name, shape=None, chip=None, chip_spec=None,
                       mesh=mesh if mesh is not None else req.mesh)


def _step_model(req: ServeRequest, moe) -> tuple[Any, Any, StepModel, Any]:
    pod = resolve_pod(req)
    base_model, model = resolve_model(req)
    mesh = parse_mesh(req.mesh, req.dcn)
    cfg = DecodeConfig(batch=1, context_len=1, weight_dtype=req.weight_dtype,
                       kv_dtype=req.kv_dtype, matmul_dtype=req.matmul_dtype, moe=moe,
                       sampling=req.sampling)
    chip, topo = pod.chip, pod.topology
    step = StepModel(chip=chip, topology=topo, model=model, mesh=mesh, config=cfg,
                     simulate=lambda trace: simulate_step(req, trace, chip, topo),
                     energy=lambda trace, result: step_energy_of(trace, topo, None)(result,
                                                                                    chip))
    # The layout checks (mesh size, divisibility) before anything else runs.
    step.kv_capacity_tokens(1)
    return pod, base_model, step, mesh


def _pool_key(req: ServeRequest, pod, step: StepModel, bounds: CostBounds) -> str:
    scen = scenario_of(req, pod.topology)
    return json.dumps({"chip": pod.chip.to_dict(), "topology": pod.topology.name,
                       "shape": list(pod.topology.shape), "slices": pod.topology.num_slices,
                       "wrap": list(pod.topology.wraparound), "model": step.model.to_dict(),
                       "mesh": step.mesh.describe(), "config": repr(step.config),
                       "scenario": scen.to_dict(), "algorithm": algorithm_of(req),
                       "mode": req.mode, "bounds": repr(bounds)}, sort_keys=True, default=str)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_settings(req: ServeRequest):
    """The settings of `req` that need no pod, checked: (workload, scheduler, SLO, router,
    disaggregated or not). A sweep checks them for every point before the first runs."""
    wcfg = workload_config(req)
    scfg = scheduler_config(req)
    slo = parse_slo(req.slo)
    router = _enum(RouterKind, req.router, "router")
    disagg = req.prefill_replicas is not None or req.decode_replicas is not None
    if disagg:
        if not req.prefill_replicas or not req.decode_replicas:
            raise TpusimError(
                f"a disaggregated split needs both pools: {{prefill_replicas}} "
                f"{req.prefill_replicas or 0} and {{decode_replicas}} "
                f"{req.decode_replicas or 0}; give each at least 1 (or neither, for replicas "
                f"that do both)", "prefill_replicas", "decode_replicas")
        if scfg.scheduler is SchedulerKind.STATIC:
            raise TpusimError("disaggregated pools batch continuously; drop {scheduler} static",
                              "scheduler")
        if req.replicas != 1:
            raise TpusimError("{replicas} counts replicas that prefill and decode; with "
                              "{prefill_replicas}/{decode_replicas} give the pools' sizes only",
                              "replicas", "prefill_replicas", "decode_replicas")
    elif any(v is not None for v in (req.prefill_mesh, req.decode_mesh, req.prefill_slice,
                                     req.decode_slice)):
        raise TpusimError("{prefill_mesh}/{decode_mesh}/{prefill_slice}/{decode_slice} shape "
                          "the disaggregated pools; add {prefill_replicas} and "
                          "{decode_replicas}", "prefill_mesh", "decode_mesh", "prefill_slice",
                          "decode_slice", "prefill_replicas", "decode_replicas")
    kv_transfer_path(req, disagg)
    return wcfg, scfg, slo, router, disagg


def kv_transfer_path(req: ServeRequest, disagg: bool) -> KvTransferPath:
    """Where the KV caches of `req`'s disaggregated pools travel, checked."""
    try:
        path = KvTransferPath(req.kv_transfer)
    except ValueError:
        raise TpusimError(f"{{kv_transfer}} {short_repr(req.kv_transfer)} does not exist; "
                          f"{one_of(req.kv_transfer, [m.value for m in KvTransferPath])}",
                          "kv_transfer") from None
    if path is not KvTransferPath.DCN and not disagg:
        raise TpusimError("{kv_transfer} says how a disaggregated split moves KV caches; add "
                          "{prefill_replicas} and {decode_replicas} or drop it",
                          "kv_transfer", "prefill_replicas", "decode_replicas")
    return path


@reports_failures
def run_serve(req: ServeRequest) -> Run:
    """Simulate the serving run of `req`; every setting is checked before the loop runs."""
    wcfg, scfg, slo, router, disagg = check_settings(req)
    moe = moe_config(req, scenario_of(req, resolve_pod(req).topology))
    if disagg:
        specs = [(Role.PREFILL, req.prefill_replicas,
                  _pool_request(req, req.prefill_slice, req.prefill_mesh)),
                 (Role.DECODE, req.decode_replicas,
                  _pool_request(req, req.decode_slice, req.decode_mesh))]
    else:
        specs = [(Role.BOTH, req.replicas, req)]
    bound = [(role, count, preq, *_step_model(preq, moe)) for role, count, preq in specs]
    workload = generate(wcfg)
    longest = int((workload.prompt_tokens + workload.output_tokens).max())
    if longest > MAX_TOKENS:
        raise TpusimError(
            f"the longest request ({longest:,} tokens, prompt and output) is over the "
            f"{MAX_TOKENS:,}-token context a decode step takes; use shorter prompt or output "
            f"lengths")
    max_prompt = int(workload.prompt_tokens.max())
    pools, pool_info, kv_blocks = [], [], []
    bs = scfg.kv_block_tokens
    for role, count, preq, pod, _base, step, mesh in bound:
        capacity, plan = step.kv_capacity_tokens(scfg.max_batch)
        blocks = capacity // bs
        where = f"{role} replica" if disagg else "replica"
        if blocks * bs < longest:
            raise TpusimError(
                f"the longest request ({longest:,} tokens, prompt and output) does not fit a "
                f"{where}'s KV cache even alone: {pod.topology.name} with mesh "
                f"{mesh.describe()} holds {blocks * bs:,} tokens after "
                f"{plan['weights_bytes'] / 1e9:.1f} GB of weights per chip; use shorter "
                f"lengths, {{kv_dtype}} int8, a smaller "
                f"{{max_batch}} or a bigger slice", "kv_dtype", "max_batch")
        # Bounds rounded up to powers of two, so that sweep points with other draws share a
        # cost model.
        if role is Role.DECODE:
            chunk = 1
        elif scfg.prefill_chunk is not None:
            chunk = min(scfg.prefill_chunk, _pow2(longest))
        else:
            chunk = _pow2(longest)
        bounds = CostBounds(max_batch=scfg.max_batch, max_context=_pow2(longest),
                            max_chunk=chunk)
        costs = IterationCosts(
            step, bounds, exact=req.exact_costs, cache_key=_pool_key(preq, pod, step, bounds),
            progress=lambda pts, _r=role: tracked(pts, f"serve: cost model ({_r} replicas)",
                                                 unit="point"))
        chips = pod.topology.num_chips
        pools.append(PoolSpec(role=role, replicas=count, kv_blocks=blocks, costs=costs,
                              num_chips=chips,
                              swap_s_per_token=plan["kv_bytes_per_token"]
                              / (chips * pod.chip.pcie_bytes_per_s)))
        kv_blocks += [blocks] * count
        pool_info.append({"role": str(role), "replicas": count, "slice": pod.topology.name,
                          "num_chips": pod.topology.num_chips, "mesh": mesh.describe(),
                          "kv_blocks": blocks, "kv_block_tokens": bs,
                          "kv_capacity_tokens": blocks * bs,
                          "weights_bytes_per_chip": plan["weights_bytes"],
                          "kv_bytes_per_token": plan["kv_bytes_per_token"],
                          "cost_model": describe_costs(costs)})
    if scfg.prefill_chunk is None and scfg.max_tokens_per_iter is not None and \
            scfg.max_tokens_per_iter < max_prompt:
        raise TpusimError(
            f"{{max_tokens_per_iter}} {scfg.max_tokens_per_iter:,} is below the longest "
            f"prompt ({max_prompt:,} tokens), which is prefilled whole without "
            f"{{prefill_chunk}}; add {{prefill_chunk}} or raise the budget",
            "max_tokens_per_iter", "prefill_chunk")
    transfer = None
    if disagg:
        step_p = bound[0][5]
        transfer = kv_transfer(bound[0][3], bound[1][3], step_p.model,
                               step_p.config.kv_bytes_per_elem,
                               path=kv_transfer_path(req, disagg))
    sim = ServingSim(workload, pools, scfg, router=router, iteration_joules=True,
                     transfer_s=transfer.seconds if transfer is not None else None)
    sim.run()
    num_chips = sum(p.replicas * p.num_chips for p in pools)
    summary, arrays = summarize(sim, slo=slo, num_chips=num_chips, kv_blocks=kv_blocks,
                                max_batch=scfg.max_batch)
    energy, cost = serving_energy(_pool_work(sim, pools, bound, pool_info, workload, transfer),
                                  span_s=summary["span_s"],
                                  output_tokens=int(workload.output_tokens.sum()),
                                  iterations=len(sim.iterations))
    first = bound[0]
    _role, _count, _preq, pod0, base0, step0, mesh0 = first
    summary = {"model": step0.model.name, "chip": pod0.chip.name,
               "num_replicas": sum(p.replicas for p in pools), "num_chips": num_chips,
               "scheduler": str(scfg.scheduler), "router": str(router),
               "preemption": str(scfg.preemption), "prefix_caching": scfg.prefix_caching,
               **summary,
               "pools": pool_info, "energy": energy, "cost": cost}
    if transfer is not None:
        summary["kv_transfer"] = transfer.describe()
    if summary["saturated"]:
        summary["note"] = Said(TpusimError(
            f"saturated: {summary['backlog_at_last_arrival']:,} of "
            f"{summary['num_requests']:,} requests were still in the system when the last "
            f"arrived; the queue grows without bound at this rate (lower {{rate}} or add "
            f"replicas)", "rate"))
    inputs = base_inputs(req, pod0, base0)
    inputs["model"] = step0.model.to_dict()
    inputs["mesh"] = describe_mesh(mesh0, pod0.topology)
    inputs["algorithm"] = algorithm_of(req)
    inputs["workload"] = {
        "arrival": str(wcfg.arrival), "rate_per_s": wcfg.rate_per_s, "cv": wcfg.cv,
        "trace": wcfg.trace, "num_requests": workload.num_requests,
        "duration_s": wcfg.duration_s,
        "prompt_tokens": wcfg.prompt_tokens.describe() if wcfg.prompt_tokens else None,
        "output_tokens": wcfg.output_tokens.describe() if wcfg.output_tokens else None,
        "seed": wcfg.seed}
    return Run(command="serve", summary=summary, inputs=inputs,
               result=ServeResult(requests=arrays, iterations=sim.iterations,
                                 iteration_dynamic_j=np.array(sim.iteration_j or (), dtype=float),
                                 replica_power=tuple(
                                     (p.num_chips, b[3].chip.idle_power_w)
                                     for p, b in zip(pools, bound, strict=True)
                                     for _ in range(p.replicas)),
                                 queue_events=sim.queue_events))


def _pool_work(sim: ServingSim, pools: list[PoolSpec], bound, pool_info,
               workload, transfer) -> list[PoolWork]:
    """What each pool did beyond its iterations' steps: the bytes its replicas swapped over
    PCIe and sent to decode replicas (over DCN, or ICI when `transfer` says so)."""
    hops = transfer.hops if transfer is not None and \
        transfer.path is KvTransferPath.ICI else 0
    swapped = np.bincount(sim.iterations.column("replica"),
                          weights=sim.iterations.column("swap_tokens"),
                          minlength=len(sim.replicas)).tolist()
    out, first = [], 0
    sent_to = np.asarray(sim.decode_replica) >= 0
    for pool, b, info in zip(pools, bound, pool_info, strict=True):
        step = b[5]
        reps = range(first, first + pool.replicas)
        first += pool.replicas
        sent = 0.0
        if pool.role is Role.PREFILL and sent_to.any():
            lengths, counts = np.unique(workload.prompt_tokens[sent_to], return_counts=True)
            kvb = step.config.kv_bytes_per_elem
            sent = float(sum(step.model.kv_cache_bytes(int(p), kvb) * int(c)
                             for p, c in zip(lengths, counts, strict=True)))
        out.append(PoolWork(role=str(pool.role), replicas=pool.replicas,
                            chips_per_replica=pool.num_chips, chip=b[3].chip,
                            costs=pool.costs,
                            swap_bytes=sum(swapped[r] for r in reps)
                            * info["kv_bytes_per_token"],
                            sent_bytes=sent, sent_ici_hops=hops))
    return out
