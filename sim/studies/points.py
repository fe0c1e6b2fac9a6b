"""One point of a study: its typed request (the base settings with the point's values, every
value as its text, as the command line would give it), the checks every point passes before
any runs (a value no setting can make valid is an error of the study, not a failed row), its
run in this process (the command's own runner, so a row equals, number for number, what the
single command returns) and its result flattened into scalar columns.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping
from typing import Any

from sim.chips import load_chip
from sim.collectives.algorithms import ALGORITHMS, parse_kind
from sim.runs import REQUESTS, Request, run
from sim.runs.convert import parse_bytes
from sim.runs.goodput import check_settings as check_goodput
from sim.runs.inference import decode_config
from sim.runs.requests import flag_name
from sim.runs.serve import check_settings as check_serve
from sim.runs.train import training_config
from sim.studies.spec import SET_PREFIX, StudySpec
from topologies.errors import Said, TpusimError
from topologies.mesh import parse_mesh
from topologies.scenario import scenario_from_flags
from topologies.slices import SLICES
from topologies.torus import AXIS_NAMES, DCN_AXIS, parse_shape, parse_wraparound
from topologies.validate import short_repr, split_list
from workloads.moe import MoeConfig
from workloads.training import parse_remat
from workloads.zoo import load_model

# Result keys that are tables of their own, not scalars of the point.
_NOT_SCALARS = ("collectives",)
# The energy and cost sections become metrics under names of their own (`energy_j`, ...):
# {metric: (section, field)}, plus `energy_<unit>_j` per unit of `step_j_by_unit`; the sections
# themselves are not flattened (their leaf names, `mxu` or `host`, would read as anything).
ENERGY_METRICS = {
    "energy_j": ("energy", "step_j"),
    "energy_per_chip_j": ("energy", "step_j_per_chip"),
    "energy_per_token_j": ("energy", "j_per_token"),
    "chip_power_w_mean": ("energy", "chip_power_w_mean"),
    "chip_power_w_peak": ("energy", "chip_power_w_peak"),
    "cost_per_step_usd": ("cost", "usd_per_step"),
    "cost_per_million_tokens_usd": ("cost", "usd_per_million_tokens"),
    "cost_per_hour_usd": ("cost", "usd_per_hour"),
    "clock_scale": ("power_cap", "clock_scale"),
    "power_cap_slowdown": ("power_cap", "slowdown"),
}
_SECTIONS = ("energy", "cost", "power_cap")


# -- one point -------------------------------------------------------------------------------
def _arg_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def point_argv(study: StudySpec, point: Mapping[str, Any]) -> list[str]:
    """The `tpusim` arguments of one point (its `command_line` column, without the JSON
    output), base flags first: each setting as the flag of its study key."""
    argv = [study.command]
    sets = []
    merged = dict(study.base)
    merged.update(point)  # varied values replace the base value of the same flag
    for key, v in merged.items():
        if key.startswith(SET_PREFIX):
            sets.append(f"{key[len(SET_PREFIX):]}={_arg_text(v)}")
            continue
        if isinstance(v, bool):
            # A true/false flag: present when true (e.g. no-overlap: true).
            if v:
                argv.append(f"--{key}")
            continue
        for x in v if isinstance(v, list) else [v]:
            argv += [f"--{key}", _arg_text(x)]
    for s in sets:
        argv += [f"--{flag_name('overrides')}", s]
    return argv


def point_request(study: StudySpec, point: Mapping[str, Any]) -> Request:
    """The typed request of one point: the base settings, the point's values replacing them,
    every value as its text (as the command line would give it)."""
    flags: dict[str, Any] = {}
    sets: dict[str, str] = {}
    merged = dict(study.base)
    merged.update(point)  # varied values replace the base value of the same flag
    for key, v in merged.items():
        if key.startswith(SET_PREFIX):
            sets[key[len(SET_PREFIX):]] = _arg_text(v)
        elif isinstance(v, bool):
            flags[key] = v  # a switch (true or false)
        elif isinstance(v, list):
            flags[key] = [_arg_text(x) for x in v]
        else:
            flags[key] = _arg_text(v)
    if sets:
        flags["set"] = sets
    return REQUESTS[study.command].from_flags(flags, source=f"tpusim {study.command}")


def run_point(req: Request) -> dict[str, Any]:
    """Run one point's request in this process: {"result": {...}} (the run's `to_dict()`)
    or {"error": ...}, a `Said` that keeps the settings it names as placeholders (a front end
    writes them its own way), plus the wall time. Never raises for a failed point (a bad
    mesh, out of memory, a bug)."""
    t0 = time.perf_counter()
    try:
        out: dict[str, Any] = {"result": run(req).to_dict()}
    except TpusimError as exc:
        out = {"error": Said(exc)}  # pickles with its placeholders (pool and Dask workers)
    except Exception as exc:  # a bug in one point must not take the study down
        out = {"error": f"internal error: {type(exc).__name__}: {exc}"}
    out["wall_time_s"] = time.perf_counter() - t0
    return out


def flatten_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """A command's JSON result -> scalar columns. Nested sections (`breakdown`, `memory`) give
    their leaf names when those are unique, dotted paths otherwise; `inputs` keeps its dotted
    prefix; lists become JSON text; per-collective tables are left out (not point scalars)."""
    flat: list[tuple[tuple[str, ...], Any]] = []

    def walk(prefix: tuple[str, ...], obj: Any) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                if not prefix and (k in _NOT_SCALARS or k in _SECTIONS):
                    continue
                walk(prefix + (str(k),), v)
        elif isinstance(obj, (list, tuple)):
            flat.append((prefix, json.dumps(obj)))
        else:
            flat.append((prefix, obj))

    walk((), result)
    leaves: dict[str, int] = {}
    for path, _ in flat:
        leaves[path[-1]] = leaves.get(path[-1], 0) + 1
    out = {}
    for path, v in flat:
        short = len(path) == 1 or (path[0] != "inputs" and leaves[path[-1]] == 1)
        out[path[-1] if short else ".".join(path)] = v
    out.update(energy_metrics(result))
    return out


def energy_metrics(result: Mapping[str, Any]) -> dict[str, Any]:
    """The `ENERGY_METRICS` of a result (and `energy_<unit>_j` per unit) that it has."""
    out: dict[str, Any] = {}
    for name, (section, key) in ENERGY_METRICS.items():
        part = result.get(section)
        if isinstance(part, Mapping) and key in part:
            out[name] = part[key]
    energy = result.get("energy")
    if isinstance(energy, Mapping):
        for unit, j in (energy.get("step_j_by_unit") or {}).items():
            out[f"energy_{unit}_j"] = j
    return out


# -- checked before any point runs -----------------------------------------------------------
def check_points(study: StudySpec, argvs: list[list[str]]) -> list[Request]:
    """Every point's request, built before any runs: a value the command cannot take
    (`seq-len: abc`, `bytes: abc`, `mesh: fsdp`, `set.nonsense: 1`, `set.hbm_bytes_per_s: -1`)
    is a study error, not a row. Errors that need the simulation (a mesh that does not fit the
    pod, out of memory) become rows."""
    checked: set[tuple] = set()
    seen_text: set[tuple[str, ...]] = set()
    reqs = []
    for i, (point, argv) in enumerate(zip(study.points(), argvs, strict=True)):
        try:
            req = point_request(study, point)
            _check_texts(study.command, req, seen_text)
            if req.overrides and req.overrides not in checked:
                req.parsed_overrides()
                checked.add(req.overrides)
        except TpusimError as exc:
            raise TpusimError(f"study point {i} ({shlex.join(argv)}): {exc.template}",
                              *exc.params) from None
        reqs.append(req)
    return reqs


def _check_texts(command: str, req: Request, seen: set[tuple[str, ...]]) -> None:
    """The settings a command takes as text and parses when it runs, parsed now: `bytes: abc`,
    `axes: x,,y`, a `mesh`/`dcn`/`axis-map` that is not name=size, an unknown `remat` are
    errors of the study, not failed rows. (Whether a mesh fits the pod needs the pod: that
    stays a row.) Each distinct combination is parsed once."""
    _check_values(command, req, seen)
    _check_names(command, req, seen)
    key = tuple(str(getattr(req, a, None)) for a in
                ("bytes", "axes", "mesh", "dcn", "axis_map", "remat"))
    if key in seen:
        return
    if command == "collective":
        parse_bytes(req.bytes)
        if req.axes:
            # A name that is no pod's axis fails at every point (`axes: 5`); whether the pod
            # has a `z` or a `dcn` axis depends on the point's shape and slices: that stays a row.
            for axis in split_list(req.axes, "axes", example="x,y"):
                if axis not in (*AXIS_NAMES, DCN_AXIS):
                    raise TpusimError(f"{{axes}} {short_repr(req.axes)}: {short_repr(axis)} is "
                                      f"not an axis of any pod; use {', '.join(AXIS_NAMES)} or "
                                      f"{DCN_AXIS}, e.g. x,y", "axes")
    elif command != "goodput" or req.mesh is not None:  # goodput may give a step time instead
        parse_mesh(req.mesh, req.dcn, getattr(req, "axis_map", None))
        if command in ("train", "goodput"):
            parse_remat(req.remat)
    seen.add(key)


def _check_names(command: str, req: Request, seen: set[tuple[str, ...]]) -> None:
    """The names a point gives that no other setting can make valid: a chip (preset or file), a
    slice, a model (zoo name or file), a collective's `op` and `algorithm`, a `shape`'s
    text. An unknown one used to fail every point it was in, each a row, and the study exit 0
    ("4 points (4 failed)"). Whether the chip, shape and mesh fit together needs them all: that
    stays a row. Each distinct value is checked once."""
    checks = [("chip", req.chip), ("slice", req.slice), ("shape", req.shape),
              ("model", getattr(req, "model", None))]
    if command == "collective":
        checks += [("op", req.op), ("algorithm", req.algorithm)]
    for what, value in checks:
        key = ("name", what, str(value))
        if value is None or key in seen:
            continue
        if what == "chip":
            load_chip(value)
        elif what == "slice":
            SLICES.get(value)
        elif what == "shape":
            parse_shape(value)
        elif what == "model":
            load_model(value)
        elif what == "op":
            parse_kind(value)
        else:
            ALGORITHMS.get(value)
        seen.add(key)


def _check_values(command: str, req: Request, seen: set[tuple[str, ...]]) -> None:
    """The values a command validates only when it runs and that no other setting can make
    valid: the perturbation scalars (`capacity-factor: -1`), `wraparound` against the point's
    `shape` (`z` on a 2D shape, `x,,y`), and the run settings of train, decode and prefill
    (`sampling: beam`, `ep-alltoall: bogus`, a `vocab-tiling` out of range): errors of the
    study, not failed rows. Errors that depend on the model or the pod (a vocab tiling that
    does not divide the tokens, a mesh that does not fit) stay rows. Each distinct set of
    settings is checked once."""
    key = ("values", *(f"{k}={v}" for k, v in sorted(req.flags().items())))
    if key in seen:
        return
    if hasattr(req, "capacity_factor"):
        scenario_from_flags(
            slow_chip=[], slow_link=[], dead_link=[],
            chip_variation=req.chip_variation if req.chip_variation is not None else 0.0,
            seed=req.seed if req.seed is not None else 0,
            expert_skew=req.expert_skew if req.expert_skew is not None else 0.0,
            capacity_factor=req.capacity_factor)
    if req.shape and req.wraparound:
        parse_wraparound(req.wraparound, parse_shape(req.shape))
    if command == "train":
        training_config(req, moe=MoeConfig())
    elif command in ("decode", "prefill"):
        decode_config(req, req.batch, MoeConfig())
    elif command == "serve":
        check_serve(req)
    elif command == "goodput":
        check_goodput(req)
        if req.model is not None:
            training_config(req, moe=MoeConfig())
    seen.add(key)


__all__ = ["ENERGY_METRICS", "check_points", "energy_metrics", "flatten_result", "point_argv",
           "point_request", "run_point"]
