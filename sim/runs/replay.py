"""Trace replays as runs: `run_replay(ReplayRequest)` replays a trace file (tpusim's own, or a
Chakra set) or XLA's compiled HLO text on the request's pod, and returns a `Run` whose summary
is the result's JSON, as `sim.runs.train.run_train` does for a compiled step (whose summary,
energy and pipeline helpers it shares).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sim.engine.executors import simulate_chips
from sim.engine.perchip import PointToPoint
from sim.engine.pipeline import check_schedule, simulate_pipeline_chips
from sim.runs.bind import (
    algorithm_of,
    base_inputs,
    per_chip_config,
    reports_failures,
    resolve_pod,
    simulate_step,
)
from sim.runs.power import simulate_with_cap
from sim.runs.requests import ReplayRequest
from sim.runs.result import Run, describe_mesh
from sim.runs.train import (
    per_chip_summary,
    pipeline_base,
    step_energy_of,
    training_summary,
    with_energy,
)
from topologies.errors import TpusimError
from topologies.validate import MAX_TRACE_FILE_BYTES
from topologies.yamlio import read_text_bounded
from workloads.hlo.files import is_hlo_text, read_hlo_file
from workloads.hlo.lower import import_hlo
from workloads.trace import Trace
from workloads.trace_meta import TraceKind
from workloads.training import (
    training_config_from_dict,
)
from workloads.zoo import model_from_dict


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
