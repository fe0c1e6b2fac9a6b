"""A request bound to the pod: its overrides (`set`) parsed, the chip and model loaded and
overridden, the topology built, the scenario validated against that topology, and the `inputs`
every result records. Pure functions of the request (nothing is stored on it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sim.chips import load_chip
from sim.hardware import ChipSpec
from sim.overrides import Overrides
from sim.runs.requests import Request
from sim.runs.result import describe_chip, describe_topology, tpusim_version
from topologies.errors import TpusimError
from topologies.scenario import (
    SCENARIO_SETTINGS,
    Failures,
    Scenario,
    load_scenario,
    scenario_from_flags,
)
from topologies.slices import CUBE_SIDE, SLICES, num_cubes, resolve_topology, untwisted_name
from topologies.torus import Topology
from workloads.models import TransformerSpec
from workloads.moe import MoeConfig, expert_op_scales
from workloads.zoo import load_model

if TYPE_CHECKING:
    from sim.engine.perchip import PerChipConfig


@dataclass(frozen=True)
class Pod:
    """The chip (before and after the overrides) and the topology a request runs on."""

    base_chip: ChipSpec
    chip: ChipSpec
    topology: Topology


def wraparound_of(req: Request, ov: Overrides) -> str:
    """`topology.wraparound` overrides the request's `wraparound` (an override applies last)."""
    return ov.wraparound if ov.wraparound is not None else req.wraparound


def algorithm_of(req: Request) -> str:
    """`collective.algorithm` overrides the request's `algorithm`."""
    ov = req.parsed_overrides()
    return ov.algorithm if ov.algorithm is not None else getattr(req, "algorithm", "auto")


def resolve_pod(req: Request) -> Pod:
    """The chip (the request's `chip_spec`, else its preset or YAML; then the overrides) and the
    topology of `slice` / `shape` / `wraparound` / `slices`."""
    ov = req.parsed_overrides()
    base = req.chip_spec
    if base is None:
        chip_arg = req.chip
        if chip_arg is None:
            if req.slice is None:
                raise TpusimError("give {chip} (e.g. v5e) with {shape}, or {slice} (e.g. "
                                  "v5p-128)", "chip", "shape", "slice")
            chip_arg = SLICES.get(untwisted_name(req.slice)).chip
        base = load_chip(chip_arg)
    chip = ov.apply_chip(base)
    topo = resolve_topology(
        chip_name=chip.name,
        wrap_rule=chip.generation_rule,
        max_pod_shape=chip.max_pod_shape,
        slice_name=req.slice,
        shape=req.shape,
        wraparound=wraparound_of(req, ov),
        num_slices=req.slices,
        twist=req.twist or scenario_twists(req),
    )
    return Pod(base_chip=base, chip=chip, topology=topo)


def resolve_model(req: Request) -> tuple[TransformerSpec, TransformerSpec]:
    """(the model before the overrides, the model with the `model.*` overrides applied)."""
    base = req.model_spec if req.model_spec is not None else load_model(req.model)
    return base, req.parsed_overrides().apply_model(base)


def scenario_twists(req: Request) -> bool:
    """Whether the request's scenario (its file, or a recorded `scenario_spec`) says
    `twist: true`: the pod is then built twisted, as with the `twist` setting."""
    if req.scenario_spec is not None:
        return bool(req.scenario_spec.twist)
    path = getattr(req, "scenario", None)
    return bool(path) and load_scenario(path).twist


def scenario_of(req: Request, topology: Topology) -> Scenario:
    """The scenario file plus the perturbation settings, validated against `topology` (one-line
    error for anything that does not fit). Settings add to the file's lists and override its
    scalars. A recorded `scenario_spec` (`rerun`) replaces both."""
    if req.scenario_spec is not None:
        req.scenario_spec.validate(topology)
        return req.scenario_spec
    path = getattr(req, "scenario", None)
    base = load_scenario(path) if path else Scenario()
    chip_variation = getattr(req, "chip_variation", None)
    seed = getattr(req, "seed", None)
    expert_skew = getattr(req, "expert_skew", None)
    failed = bool(getattr(req, "failed_chip", ()) or base.failed_chips)
    flags = scenario_from_flags(
        slow_chip=list(getattr(req, "slow_chip", ())),
        slow_link=list(getattr(req, "slow_link", ())),
        dead_link=list(getattr(req, "dead_link", ())),
        chip_variation=chip_variation if chip_variation is not None else 0.0,
        seed=seed if seed is not None else 0,
        expert_skew=expert_skew if expert_skew is not None else 0.0,
        capacity_factor=getattr(req, "capacity_factor", None),
        failed_chip=list(getattr(req, "failed_chip", ())),
        # Spares and the switches matter to failed chips only (goodput's own spares, for its
        # failures over time, reach its step model without one: they change nothing there).
        spare_cubes=(getattr(req, "spare_cubes", None) or 0) if failed else 0,
        no_ocs=bool(getattr(req, "no_ocs", False)) and failed,
    )
    scenario = base.merged(flags)
    scenario.validate(topology)
    return scenario


def takes_perturbations(req: Request) -> bool:
    return hasattr(req, "slow_link")


def base_inputs(req: Request, pod: Pod | None = None,
                base_model: TransformerSpec | None = None) -> dict[str, Any]:
    """The `inputs` every result carries: command, version, flags, overrides, chip, topology
    (and the merged perturbations, for commands that take them)."""
    out: dict[str, Any] = {
        "command": req.command,
        "tpusim_version": tpusim_version(),
        "flags": req.flags(),
        "overrides": req.parsed_overrides().resolved(pod.base_chip if pod else None, base_model),
    }
    if pod is not None:
        out["chip"] = describe_chip(pod.chip)
        out["topology"] = describe_topology(pod.topology)
        if takes_perturbations(req):
            out["perturbations"] = scenario_of(req, pod.topology).to_dict()
    return out


def moe_config(req: Request, scenario: Scenario | None = None) -> MoeConfig:
    """`MoeConfig` from a validated `Scenario`, or from the request's own router settings."""
    if scenario is not None:
        return MoeConfig(expert_skew=float(scenario.expert_skew),
                         capacity_factor=scenario.capacity_factor, seed=int(scenario.seed))
    return MoeConfig(expert_skew=req.expert_skew, capacity_factor=req.capacity_factor,
                     seed=req.seed)


def check_router_matches_trace(scenario: Scenario, trace) -> None:
    """The router settings shape the compiled MoE program (its all-to-all volumes and expert
    matmuls): a step compiled here applies them; a trace compiled earlier (`replay`) carries its
    own router, so other values are refused rather than silently ignored."""
    moe = trace.meta.moe
    if not trace.meta.moe_scenario_applied or not isinstance(moe, dict):
        raise TpusimError(
            "{expert_skew}/{capacity_factor} apply to MoE models only, and this trace has no "
            "MoE router (a dense model, or written by an older tpusim); drop them", "expert_skew",
            "capacity_factor"
        )
    skew = float(moe.get("expert_skew", 0.0))
    cap = moe.get("capacity_factor")
    if skew != float(scenario.expert_skew) or (cap is None) != (scenario.capacity_factor is None) \
            or (cap is not None and float(cap) != float(scenario.capacity_factor)):
        raise TpusimError(
            f"this trace was compiled with {{expert_skew}} {skew:g}"
            + (f" {{capacity_factor}} {float(cap):g}" if cap is not None else "")
            + f", not {{expert_skew}} {float(scenario.expert_skew):g}"
            + (f" {{capacity_factor}} {float(scenario.capacity_factor):g}"
               if scenario.capacity_factor is not None else "")
            + "; the router is part of the compiled program, so recompile it with tpusim compile "
              "and those flags", "expert_skew", "capacity_factor"
        )


def per_chip_config(req: Request, trace, topology: Topology) -> PerChipConfig:
    """The per-chip engine's `PerChipConfig` for the request's perturbations (and the MoE
    expert loads of `trace`)."""
    # deferred: start-up (as `simulate_step`: the engine's modules, for a step only)
    from sim.engine.perchip import PerChipConfig

    scenario = scenario_of(req, topology)
    if scenario.expert_skew or scenario.capacity_factor is not None:
        check_router_matches_trace(scenario, trace)
    return PerChipConfig(
        # An uneven MoE router loads the chips holding the hot experts (workloads/moe.py).
        op_scale=expert_op_scales(trace, topology),
        speed=scenario.chip_speed_factors_for(topology) if scenario.perturbs_chips else None,
        link_factors=scenario.slow_link_factors_for(topology),
        dead_links=scenario.dead_link_ids_for(topology),
        mode=getattr(req, "mode", "auto") or "auto",
    )


def simulate_step(req: Request, trace, chip: ChipSpec, topology: Topology, *, overlap=None,
                  algorithm=None):
    """Replay `trace` with the request's perturbations on the per-chip engine (one chip class,
    and `replay`'s result to the last bit, when nothing is perturbed); `algorithm` (default:
    the request's) may hold some collectives' algorithms (`HeldAlgorithms`)."""
    # deferred: start-up (the collective commands bind pods here and never run a step: the
    # executors and their engines are six modules they would load for nothing)
    from sim.engine.executors import simulate_step as run_step

    return run_step(trace, chip, topology, executor=getattr(req, "mode", "auto") or "auto",
                    config=per_chip_config(req, trace, topology),
                    algorithm=algorithm_of(req) if algorithm is None else algorithm,
                    overlap=overlap)


# -- failed chips and spare cubes --------------------------------------------------------------
def _cube_text(cube: tuple[int, ...], multi: bool) -> str:
    return ",".join(map(str, cube[1:] + ((cube[0],) if multi else ())))


def failure_report(req: Request, pod: Pod) -> dict[str, Any] | None:
    """The result's `failures` section (None when the request names no failed chip, spare or
    `no_ocs`): which cubes were swapped for spares and what that costs once
    (`ChipSpec.ocs_reconfiguration_s`), which chips are routed around and why. Refuses spares
    a pod cannot hold: none without optical switches (a generation without them, or a slice
    smaller than a cube), and no more than the cubes the slice leaves free in the pod."""
    found = _failures(req, pod)
    return None if found is None else found[0]


def _failures(req: Request, pod: Pod) -> tuple[dict[str, Any], Failures] | None:
    """`failure_report`'s section and the `Failures` it reports (whose `why_not_swapped` is a
    template an error builds on)."""
    scenario = scenario_of(req, pod.topology)
    if not scenario.failed_chips:
        return None  # spares and no_ocs alone change nothing
    topo, chip = pod.topology, pod.chip
    n = scenario.spare_cubes
    if n and not topo.ocs and not scenario.no_ocs:
        raise TpusimError(
            f"{{spare_cubes}} {n}: the {topo.name} {chip.name} pod has no optical switches to swap "
            f"a cube in (only v4/v5p slices of whole 4x4x4 cubes have); drop {{spare_cubes}}, or "
            f"give {{no_ocs}} to say the pod is static", "spare_cubes", "no_ocs")
    if n and topo.ocs:
        have = num_cubes(tuple((m // CUBE_SIDE) * CUBE_SIDE for m in chip.max_pod_shape))
        used = num_cubes(topo.shape) * topo.num_slices
        if n > have - used:
            raise TpusimError(
                f"{{spare_cubes}} {n}: the {chip.name} pod has {have} cubes and this slice takes "
                f"{used}, so at most {max(have - used, 0)} are free to be spares; give "
                f"{{spare_cubes}} {max(have - used, 0)} or fewer, or a smaller slice",
                "spare_cubes")
    f = scenario.failures_for(topo)
    multi = topo.num_slices > 1
    text = lambda c: ",".join(map(str, topo.coords(c)))  # noqa: E731
    return {
        "failed_chips": [text(c) for c in f.failed_chips],
        "action": f.action,
        "swapped_cubes": [_cube_text(c, multi) for c in f.swapped_cubes],
        "spare_cubes": int(n),
        "spare_cubes_left": f.spares_left,
        "reconfiguration_s": chip.ocs_reconfiguration_s if f.swapped_cubes else 0.0,
        "routed_around": [text(c) for c in f.routed_chips],
        "dead_links": len(f.dead_links),
        "why_not_swapped": str(TpusimError(f.why_not_swapped, *SCENARIO_SETTINGS)),
    }, f


_WHAT = {"train": "step", "replay": "step", "export": "step", "decode": "decode step",
         "prefill": "prefill", "compare-collectives": "collective", "serve": "replica's step"}


def reports_failures(run_fn):
    """A runner that handles failed chips (`failed_chip`): its result gains the `failures` section
    (`failure_report`), and a failed chip routed around that a transfer needs (its own sends
    or receives: no route reaches a chip whose links are all dead) is refused in one line
    naming the chip and the fix."""

    @functools.wraps(run_fn)
    def run(req, *args, **kw):
        if not takes_perturbations(req) or not (
                getattr(req, "failed_chip", ()) or getattr(req, "scenario", None)
                or req.scenario_spec is not None):
            return run_fn(req, *args, **kw)
        found = _failures(req, resolve_pod(req))
        if found is None:
            return run_fn(req, *args, **kw)
        report, failures = found
        try:
            out = run_fn(req, *args, **kw)
        except TpusimError as exc:
            if report["routed_around"] and "has no live link" in str(exc):
                detail = str(exc).split(" has no live link", 1)[1].split(", and a", 1)[0]
                detail = detail.strip(" ()") or "its own sends and receives"
                raise TpusimError(
                    f"{{failed_chip}} {', '.join(report['routed_around'])}: no spare cube "
                    f"replaces it ({failures.why_not_swapped}), so its links are dead, and "
                    f"the {_WHAT.get(req.command, req.command)} needs the chip itself "
                    f"({detail}): no route reaches "
                    f"it; give {{spare_cubes}} N on a v4/v5p slice of whole cubes (its cube is "
                    f"swapped), or leave the chip out of the slice", "failed_chip",
                    *SCENARIO_SETTINGS) from None
            raise
        out.summary["failures"] = report
        return out

    return run
