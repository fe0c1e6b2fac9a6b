"""Collectives as runs: `run_collective(CollectiveRequest)` simulates one collective;
`run_compare(CompareCollectivesRequest)` simulates it under every algorithm that applies."""

from __future__ import annotations

from sim.collectives.algorithms import CollectiveKind, algorithm_names, parse_kind
from sim.collectives.auto import picked_algorithm
from sim.collectives.inputs import check_bytes, check_links_only
from sim.collectives.simulate import simulate_collective
from sim.energy import collective_energy, energy_summary
from sim.runs.bind import (
    Pod,
    algorithm_of,
    base_inputs,
    reports_failures,
    resolve_pod,
    scenario_of,
)
from sim.runs.convert import parse_bytes, parse_coords
from sim.runs.requests import CollectiveRequest, CompareCollectivesRequest
from sim.runs.result import Run
from topologies.errors import Said, TpusimError
from topologies.groups import GroupGeometry, group_axes
from topologies.progress import tracked
from topologies.validate import split_list


def check_common_inputs(req: CollectiveRequest, topo) -> None:
    """The inputs wrong for every algorithm alike, so that compare-collectives names them
    as they are instead of as 'no algorithm applies'."""
    if req.op == "send" and (req.src is None or req.dst is None):
        raise TpusimError("{op} send needs {src} and {dst}, e.g. {src} 0,0 {dst} 3,3", "op", "src",
                          "dst")
    if req.op != "send" and not req.axes:
        raise TpusimError(f"{{op}} {req.op} needs {{axes}}, e.g. {{axes}} y or {{axes}} x,y", "op",
                          "axes")
    if req.axes:
        split_list(req.axes, "axes", example="x,y")
    try:
        kind = CollectiveKind(req.op)
    except ValueError:
        kind = None  # the simulation names an unknown op
    if kind == CollectiveKind.SEND:
        for flag, text in (("src", req.src), ("dst", req.dst)):
            topo.chip_id(tuple(parse_coords(text, flag)))  # on the pod
        check_bytes(parse_bytes(req.bytes), kind, 1, "bytes")
    elif kind is not None:
        # Axes the pod has, each once; bytes that split evenly over the groups they make.
        gaxes = group_axes(topo, tuple(a.strip() for a in req.axes.split(",") if a.strip()))
        check_bytes(parse_bytes(req.bytes), kind, GroupGeometry(topo, gaxes).group_size,
                    "bytes")
    scenario = scenario_of(req, topo)
    if scenario is not None:
        check_links_only(scenario)


def _simulate(req: CollectiveRequest, algorithm: str, pod: Pod, *, healthy: bool = False):
    """The collective under `algorithm`, on the request's faulty links (or the healthy pod's)."""
    check_common_inputs(req, pod.topology)
    return simulate_collective(
        chip=pod.chip,
        topology=pod.topology,
        op=req.op,
        axes=req.axes,
        nbytes=parse_bytes(req.bytes),
        algorithm=algorithm,
        shift=req.shift,
        src=parse_coords(req.src, "src") if req.src else None,
        dst=parse_coords(req.dst, "dst") if req.dst else None,
        scenario=None if healthy else scenario_of(req, pod.topology),
        mode=req.mode,
        chunks=req.chunks,
    )


@reports_failures
def run_collective(req: CollectiveRequest) -> Run:
    """One collective: a `Run` whose summary is the CollectiveResult's fields."""
    pod = resolve_pod(req)
    algorithm = algorithm_of(req)
    res = _simulate(req, algorithm, pod)
    inputs = base_inputs(req, pod)
    inputs["algorithm"] = algorithm
    summary = {**res.to_dict(), **energy_summary(collective_energy(res, pod.chip))}
    healthy = _healthy_pick(req, algorithm, pod, res)
    if healthy is not None:
        summary["healthy_pick"] = healthy
    return Run(command="collective", summary=summary, inputs=inputs, result=res)


def _healthy_pick(req: CollectiveRequest, algorithm: str, pod: Pod, res) -> dict | None:
    """Where slow or dead links make `auto` pick another algorithm than on the healthy pod:
    the healthy pod's pick and its time on these links. A step keeps that pick (the compiler
    picks for the pod it knows, `sim.engine.perchip`), so a collective alone and the same
    collective inside a step would otherwise disagree without a word."""
    if algorithm != "auto" or scenario_of(req, pod.topology) is None:
        return None
    faulty = picked_algorithm(res.algorithm)
    pick = picked_algorithm(_simulate(req, "auto", pod, healthy=True).algorithm)
    if pick == faulty:
        return None
    try:
        held: float | None = _simulate(req, pick, pod).time_s
        why, params = "", ()
    except TpusimError as exc:  # the healthy pick may not run on these links at all
        held, why, params = None, exc.template, exc.params
    note = (f"on the healthy pod auto picks {pick}, which a step keeps under these faults"
            + (f": it takes {held:.6g} s here against {res.time_s:.6g} s for {faulty}"
               if held is not None else f", and which does not run here ({why})"))
    return {"algorithm": pick, "time_s": held, "note": Said(TpusimError(note, *params))}


@reports_failures
def run_compare(req: CompareCollectivesRequest) -> Run:
    """One row per algorithm (n/a rows say why); `Run.result` is the list of CollectiveResults
    that applied."""
    kind = parse_kind(req.op)
    pod = resolve_pod(req)
    check_common_inputs(req, pod.topology)
    rows = []
    results = []
    refused: list[TpusimError] = []
    for name in tracked(algorithm_names(kind), "compare-collectives", unit="algorithm"):
        try:
            r = _simulate(req, name, pod)
        except TpusimError as exc:
            # The reason as data: Python names here, the CLI's flags where it prints it.
            rows.append({"algorithm": name, "applicable": False, "reason": Said(exc)})
            refused.append(exc)
            continue
        results.append(r)
        # Each algorithm's joules and dollars: the same bytes on more links, or longer, cost
        # differently (energy per byte moved, static power over the time).
        d = {**r.to_dict(), **energy_summary(collective_energy(r, pod.chip))}
        d["applicable"] = True
        rows.append(d)
    ok = [r for r in rows if r["applicable"]]
    if not ok:
        raise TpusimError(f"no algorithm applies to {req.op} here: {refused[0].template}",
                          *refused[0].params)
    best = min(r["time_s"] for r in ok)
    auto = next((r for r in ok if r["algorithm_requested"] == "auto"), None)
    pick = auto["algorithm"][len("auto ("):-1] if auto and auto["algorithm"].startswith(
        "auto (") else None
    for r in ok:
        r["vs_best"] = r["time_s"] / best if best > 0 else 1.0
        r["auto_pick"] = r["algorithm_requested"] == pick
    summary = {"op": req.op, "axes": req.axes, "bytes": parse_bytes(req.bytes),
               "auto_pick": pick, "results": rows}
    return Run(command="compare-collectives", summary=summary,
               inputs=base_inputs(req, pod), result=results)


def buffer_bytes_per_chip(op: str, nbytes: int, group_size: int) -> int:
    """Input plus output buffer one chip holds for a collective of V = `nbytes`."""
    shard = nbytes // max(group_size, 1)
    return {"all-gather": shard + nbytes, "reduce-scatter": nbytes + shard,
            "all-reduce": 2 * nbytes, "all-to-all": 2 * shard}.get(op, 2 * nbytes)
