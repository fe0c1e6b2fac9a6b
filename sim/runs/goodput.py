"""Goodput under failures as a run: a `GoodputRequest` checked in full, its pod resolved (the
chips, hosts and 4x4x4 cubes of the slice, the spare cubes the optical switches can swap in),
its step time taken as given or simulated by the step model (a `TrainRequest` run through
`sim.run`), the checkpoint and restart costs given or derived from the model's bytes and a
storage bandwidth, and the long-horizon simulation (`sim.reliability`) returned as a `Run` whose
`result` is a `GoodputResult` (every seed's outcome, the interval search, seed 0's timeline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sim import runs
from sim.reliability.config import (
    Engine,
    FailureConfig,
    GoodputConfig,
    JobConfig,
    SliceInventory,
)
from sim.reliability.job import LOST_CAUSES
from sim.reliability.simulate import GoodputOutcome, simulate_goodput
from sim.runs.bind import Pod, base_inputs, resolve_model, resolve_pod
from sim.runs.requests import GoodputRequest, TrainRequest
from sim.runs.result import Run
from topologies.errors import Said, TpusimError
from topologies.slices import CUBE_SIDE, is_cube_slice, num_cubes
from topologies.validate import short_repr

# Chips per host, from each generation's host topology (docs/reference/tpu.md §1.1, "host
# topology": 2x2x1 on v4, v5p and TPU7x; 4x2 on v3, v5e and v6e, "8 chips/host" on v5e; "A
# v5e/v6e host has 2 trays (8 chips)"). A chip not listed takes chips_per_host.
CHIPS_PER_HOST = {"v3": 8, "v4": 4, "v5p": 4, "v5e": 8, "v6e": 8, "tpu7x": 4}
DEFAULT_SEEDS = 10
_JOB_SETTINGS = ("{step_time} S, or the train flags ({model}, {seq_len}, {batch_per_chip}, "
                 "{mesh})")
# The Python names a goodput message may name (its request's fields; `set` for the overrides).
_NAMES = (*(f.name for f in dataclasses.fields(GoodputRequest)), "set")


def _name(name: str) -> str:
    """The placeholder of request field `name` (the overrides are `set`)."""
    return "{set}" if name == "overrides" else "{" + name + "}"


def _error(template: str) -> TpusimError:
    """A goodput error whose `{name}` placeholders are the request's fields it names."""
    return TpusimError(template, *(n for n in _NAMES if "{" + n + "}" in template))


def _said(template: str) -> Said:
    """Text of the result that names settings (`_error`'s placeholders), kept as a `Said`."""
    return Said(_error(template))


def check_settings(req: GoodputRequest) -> None:
    """The settings that need no pod, checked (one-line errors naming the setting, the rule
    and the fix). A sweep checks them for every point before the first runs."""
    defaults = {f.name: f.default for f in dataclasses.fields(GoodputRequest)}
    train_given = [n for n in GoodputRequest.STEP_MODEL
                   if getattr(req, n) != defaults[n] and getattr(req, n) != ()]
    if req.step_time is not None:
        if train_given or req.model_spec is not None:
            names = ", ".join(_name(n) for n in train_given) or "{model}"
            raise _error(f"{{step_time}} gives the step time, so the step model's flags do "
                         f"not apply: drop {names}, or drop {{step_time}} to simulate the "
                         f"step")
    elif req.model is None:
        raise _error(f"tpusim goodput needs the job's step: give {_JOB_SETTINGS}")
    else:
        missing = [_name(n) for n in ("seq_len", "batch_per_chip", "mesh")
                   if getattr(req, n) is None]
        if missing:
            raise _error(f"the step model needs {', '.join(missing)} with {{model}} (as "
                         f"tpusim train takes them); or give {{step_time}} S instead")
    if (req.steps is None) == (req.hours is None):
        raise _error("give the job's length as {steps} N (training steps) or {hours} H "
                     "(wall-clock hours), one of them" if req.steps is None else
                     "{steps} and {hours} both give the job's length; give one")
    rates = [n for n in ("chip_mtbf_hours", "host_mtbf_hours", "host_availability")
             if getattr(req, n) is not None]
    if req.failure_trace is not None:
        given = [_name(n) for n in ("mtbf_hours", *rates) if getattr(req, n) is not None]
        if given:
            raise _error(f"{{failure_trace}} lists the failures, so {', '.join(given)} "
                         f"does not apply; drop it (or drop {{failure_trace}})")
        if req.seeds is not None and req.seeds != 1:
            raise _error(f"{{seeds}} {req.seeds}: a failure trace is one history, the same "
                         f"for every seed; drop {{seeds}}")
    elif req.mtbf_hours is not None:
        if rates:
            raise _error(f"{{mtbf_hours}} is the whole slice's MTBF; "
                         f"{', '.join(_name(n) for n in rates)} give it part by part: "
                         f"give one or the other")
    elif not rates:
        raise _error("give how often the slice fails: {mtbf_hours} H (the whole slice), "
                     "{chip_mtbf_hours} H and/or {host_mtbf_hours} H (or "
                     "{host_availability} A), or {failure_trace} FILE")
    if req.host_mtbf_hours is not None and req.host_availability is not None:
        raise _error("{host_mtbf_hours} and {host_availability} both give the hosts' "
                     "failure rate; give one")
    if req.repair_hours is None:
        raise _error("give {repair_hours} H: how long a failed chip or host takes to come "
                     "back (repaired in place, or as a spare cube)")
    if req.host_availability is not None and req.repair_hours == 0:
        raise _error("{host_availability} needs {repair_hours} > 0 (availability is "
                     "MTBF / (MTBF + repair time)); give the repair time")
    if req.step_time is not None:
        for name in ("checkpoint_cost", "restart_cost"):
            if getattr(req, name) is None:
                raise _error(f"{_name(name)} is needed with {{step_time}} (no model to size "
                             f"a checkpoint from); give seconds, e.g. {_name(name)} "
                             f"{60 if name == 'checkpoint_cost' else 600}")
        if req.storage_bytes_per_s is not None:
            raise _error("{storage_bytes_per_s} sizes checkpoints from the model's bytes; "
                         "with {step_time} give {checkpoint_cost} and {restart_cost}")
    try:
        Engine(req.engine)
    except ValueError:
        raise _error(f"{{engine}} {short_repr(req.engine)} does not exist; use one of: "
                     f"{', '.join(e.value for e in Engine)}") from None
    job_s = req.steps * req.step_time if req.steps is not None and req.step_time is not None \
        else (req.hours * 3600 if req.hours is not None else None)
    if req.checkpoint_interval is not None and job_s is not None \
            and req.checkpoint_interval > job_s:
        raise _interval_error(req, job_s)


def _interval_error(req: GoodputRequest, job_s: float) -> TpusimError:
    what = (f"{job_s:,.6g} s of training ({req.steps:,} steps)" if req.steps is not None
            else f"{req.hours:g} hours of wall clock")
    return _error(f"{{checkpoint_interval}} {req.checkpoint_interval:g} s is longer than the "
                  f"job ({what}); give at most {job_s:,.6g}, or leave it out to search for "
                  f"the best")


@dataclass(frozen=True, kw_only=True)
class SliceParts:
    """The pod's side of a goodput run: the inventory and what it was built from."""

    inventory: SliceInventory
    pod_cubes: int
    chip: str


def slice_inventory(req: GoodputRequest, pod: Pod) -> SliceParts:
    """The chips, hosts and cubes of the request's slice and the spares that can be swapped
    in (one-line errors for spares a pod cannot have)."""
    chip, topo = pod.chip, pod.topology
    n = topo.num_chips
    cph = req.chips_per_host or CHIPS_PER_HOST.get(chip.name)
    if cph is None:
        raise _error(f"chip {chip.name!r} has no host size on record; give "
                     f"{{chips_per_host}} N (e.g. 4 for a 2x2x1 host, 8 for 4x2)")
    hosts = -(-n // cph)
    cubes_each = num_cubes(topo.shape) if is_cube_slice(chip.generation_rule, topo.shape) else 0
    cubes = cubes_each * topo.num_slices
    pod_cubes = num_cubes(tuple((s // CUBE_SIDE) * CUBE_SIDE for s in chip.max_pod_shape)) \
        if chip.generation_rule == "cube" and len(chip.max_pod_shape) == 3 else 0
    spares = req.spare_cubes
    if spares:
        if chip.generation_rule != "cube":
            raise _error(f"{{spare_cubes}} {spares}: {chip.name} has no optical circuit "
                         f"switches to swap a cube in (v4 and v5p slices of whole 4x4x4 "
                         f"cubes do); drop {{spare_cubes}}")
        if not cubes:
            raise _error(f"{{spare_cubes}} {spares}: slice {topo.name} is not made of whole "
                         f"4x4x4 cubes, so no cube can be swapped for it; use a shape of "
                         f"whole cubes (e.g. 4x4x8) or drop {{spare_cubes}}")
        free = (pod_cubes - cubes_each) * topo.num_slices
        if spares > free:
            raise _error(
                f"{{spare_cubes}} {spares} is more than the {free} free cubes of the pod (a "
                f"{chip.name} pod has {pod_cubes} cubes; slice {topo.name} takes {cubes_each}"
                f"{f' in each of {topo.num_slices} pods' if topo.num_slices > 1 else ''}); "
                f"give at most {free}")
    inv = SliceInventory(num_chips=n, num_hosts=hosts, chips_per_host=cph, num_cubes=cubes,
                         ocs=bool(cubes) and not req.no_ocs, spare_cubes=spares)
    return SliceParts(inventory=inv, pod_cubes=pod_cubes, chip=chip.name)


def failure_config(req: GoodputRequest, inv: SliceInventory) -> tuple[FailureConfig, dict]:
    """The failure model and its description for the summary."""
    repair_s = req.repair_hours * 3600
    desc: dict[str, Any] = {"repair_hours": req.repair_hours}
    if req.failure_trace is not None:
        desc["failure_trace"] = req.failure_trace
        return FailureConfig(repair_s=repair_s, trace=req.failure_trace), desc
    if req.mtbf_hours is not None:
        rate = 1.0 / (req.mtbf_hours * 3600)
        desc["slice_mtbf_hours"] = req.mtbf_hours
        return FailureConfig(repair_s=repair_s, rate_per_s=rate), desc
    host_mtbf = req.host_mtbf_hours
    if req.host_availability is not None:
        a = req.host_availability
        host_mtbf = req.repair_hours * a / (1 - a)
    chip_rate = inv.num_chips / (req.chip_mtbf_hours * 3600) if req.chip_mtbf_hours else 0.0
    host_rate = inv.num_hosts / (host_mtbf * 3600) if host_mtbf else 0.0
    rate = chip_rate + host_rate
    desc.update({"chip_mtbf_hours": req.chip_mtbf_hours, "host_mtbf_hours": host_mtbf,
                 "host_availability": (host_mtbf / (host_mtbf + req.repair_hours)
                                       if host_mtbf else None),
                 "slice_mtbf_hours": 1 / (rate * 3600)})
    return FailureConfig(repair_s=repair_s, rate_per_s=rate,
                         chip_share=chip_rate / rate), desc


def _train_request(req: GoodputRequest) -> TrainRequest:
    names = {f.name for f in dataclasses.fields(TrainRequest)}
    return TrainRequest(**{n: getattr(req, n) for n in names})


def checkpoint_bytes(trace, model) -> float:
    """Bytes one checkpoint holds: every parameter with its optimizer state, once (the shards
    of the whole model, not the replicas), at the step's dtypes."""
    meta = trace.meta
    per_chip = meta.params_per_chip
    comp = meta.static_composition
    per_param = (comp["params"] + comp["optimizer"]) / per_chip if per_chip else 0.0
    return float(model.num_params) * per_param


@dataclass(frozen=True, kw_only=True)
class GoodputResult:
    """The tables behind a goodput run: every seed's outcome at the interval used, the
    interval search, and seed 0's timeline (`events()`: (start_s, end_s, kind, detail))."""

    outcome: GoodputOutcome
    job: JobConfig
    interval_steps: int
    _events: list = field(default_factory=list, repr=False)

    def events(self) -> list[tuple]:
        """Seed 0's timeline (built on first use: the exports ask for it)."""
        if not self._events:
            self._events.extend(self.outcome.timeline())
        return self._events

    def seeds_frame(self):
        import pandas as pd

        rows = [{"seed_index": i, "goodput": o.goodput, "wall_hours": o.wall_s / 3600,
                 "useful_hours": o.useful_s / 3600, "failures": o.failures,
                 "cube_swaps": o.swaps, "checkpoints": o.checkpoints,
                 **{f"lost_{c}_s": o.lost_s[c] for c in LOST_CAUSES}}
                for i, o in enumerate(self.outcome.outcomes)]
        return pd.DataFrame(rows)

    def intervals_frame(self):
        import pandas as pd

        s = self.job.step_time_s
        return pd.DataFrame([{"checkpoint_interval_steps": k, "checkpoint_interval_s": k * s,
                              "goodput": v} for k, v in self.outcome.search.items()])

    def events_frame(self):
        import json

        import pandas as pd

        return pd.DataFrame([{"start_s": a, "end_s": b, "kind": k,
                              "detail": json.dumps(d, sort_keys=True)}
                             for a, b, k, d in self.events()])


def run_goodput(req: GoodputRequest) -> Run:
    """Simulate the goodput run of `req`; every setting is checked before anything runs."""
    check_settings(req)
    pod = resolve_pod(req)
    parts = slice_inventory(req, pod)
    inv = parts.inventory
    fail, fdesc = failure_config(req, inv)
    train_run = base_model = None
    sources: dict[str, str] = {}  # Said where a source names a setting
    ckpt_bytes = storage = None
    if req.step_time is not None:
        step_s = req.step_time
        sources["step_time_s"] = _said("given ({step_time})")
    else:
        treq = _train_request(req)
        train_run = runs.run(treq)  # the public entry point (its progress reporting)
        base_model, model = resolve_model(req)
        step_s = train_run.summary["step_time_s"]
        sources["step_time_s"] = "simulated (tpusim train with these flags)"
        ckpt_bytes = checkpoint_bytes(train_run.trace, model)
        storage = req.storage_bytes_per_s
        if storage is None:
            storage = pod.chip.eff_dcn_bytes_per_s * inv.num_chips
            sources["storage_bytes_per_s"] = (
                "the slice's DCN egress (dcn_bytes_per_s x dcn_efficiency x chips; "
                "docs/reference/tpu.md §1.1), an upper bound on what storage takes in")
        else:
            sources["storage_bytes_per_s"] = _said("given ({storage_bytes_per_s})")
    costs = {}
    for name, key in (("checkpoint_cost", "checkpoint_cost_s"), ("restart_cost",
                                                                   "restart_cost_s")):
        v = getattr(req, name)
        if v is not None:
            costs[key] = v
            sources[key] = _said(f"given ({_name(name)})")
        else:
            costs[key] = ckpt_bytes / storage
            sources[key] = ("the checkpoint's bytes written at the storage bandwidth" if
                            name == "checkpoint_cost" else
                            _said("the checkpoint's bytes read back at the storage bandwidth "
                                  "(give {restart_cost} to add rescheduling and compiling)"))
    sources["swap_cost_s"] = _said("given ({swap_cost})" if req.swap_cost else
                                   "assumed 0 ({swap_cost}; no public figure for an OCS cube "
                                   "swap)")
    steps = req.steps
    horizon = req.hours * 3600 if req.hours is not None else None
    job = JobConfig(step_time_s=step_s, steps=steps, horizon_s=horizon,
                    swap_cost_s=req.swap_cost, **costs)
    if req.checkpoint_interval is not None and req.checkpoint_interval > job.length_s:
        raise _interval_error(req, job.length_s)
    seeds = req.seeds or (1 if req.failure_trace is not None else DEFAULT_SEEDS)
    cfg = GoodputConfig(job=job, inventory=inv, failures=fail,
                        checkpoint_interval_s=req.checkpoint_interval, seeds=seeds,
                        seed=req.seed if req.seed is not None else 0,
                        engine=Engine(req.engine))
    outcome = simulate_goodput(cfg)
    sim_summary = outcome.summary
    summary: dict[str, Any] = {
        "goodput": sim_summary["goodput"],
        "goodput_ci95": sim_summary["goodput_ci95"],
        "best_checkpoint_interval_s": sim_summary["best_checkpoint_interval_s"],
        "lost_s_by_cause": sim_summary["lost_s_by_cause"],
        "expected_finish_hours": sim_summary["expected_finish_hours"],
        **{k: v for k, v in sim_summary.items()
           if k not in ("goodput", "goodput_ci95", "best_checkpoint_interval_s",
                        "lost_s_by_cause", "expected_finish_hours", "interval_search")},
        "step_time_s": step_s,
        "chip": parts.chip,
        "topology": pod.topology.name,
        "num_chips": inv.num_chips,
        "num_hosts": inv.num_hosts,
        "chips_per_host": inv.chips_per_host,
        "num_cubes": inv.num_cubes,
        "pod_cubes": parts.pod_cubes,
        "spare_cubes": inv.spare_cubes,
        "ocs": inv.ocs,
        "swaps_cubes": inv.swaps,
        **fdesc,
        "checkpoint_cost_s": job.checkpoint_cost_s,
        "restart_cost_s": job.restart_cost_s,
        "swap_cost_s": job.swap_cost_s,
        "checkpoint_bytes": ckpt_bytes,
        "storage_bytes_per_s": storage,
        "sources": sources,
    }
    if train_run is not None:
        t = train_run.summary
        summary["train"] = {k: t[k] for k in ("model", "mfu", "tokens_per_s_per_chip",
                                              "hbm_peak_bytes", "fits_in_hbm") if k in t}
    notes = []
    if inv.spare_cubes and not inv.ocs:
        notes.append("{no_ocs}: the spare cubes cannot be switched in, so every failure waits "
                     "for its repair")
    if train_run is not None and not train_run.summary.get("fits_in_hbm", True):
        notes.append("the step does not fit in HBM (train's fits_in_hbm is false): its time "
                     "describes a run that cannot happen")
    if notes:
        summary["note"] = _said("; ".join(notes))
    summary["interval_search"] = sim_summary["interval_search"]
    inputs = base_inputs(req, pod, base_model)
    if train_run is not None:
        for key in ("model", "mesh", "training", "algorithm"):
            inputs[key] = train_run.inputs[key]
    inputs["goodput"] = {
        "job": dataclasses.asdict(job), "failures": dataclasses.asdict(fail),
        "slice": dataclasses.asdict(inv), "checkpoint_interval_s": req.checkpoint_interval,
        "seeds": seeds, "seed": cfg.seed, "engine": str(cfg.engine)}
    result = GoodputResult(outcome=outcome, job=job,
                           interval_steps=sim_summary["checkpoint_interval_steps"])
    return Run(command="goodput", summary=summary, inputs=inputs, result=result,
               trace=train_run.trace if train_run is not None else None)

