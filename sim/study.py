"""Studies: a base `tpusim` command and what varies (`grid`, `zip`) expand into points, run on a
local process pool or a Dask cluster; one results row per point, written as the points finish.

A point runs the very command a user would type (`tpusim train ... --json`), in-process in a
reused worker, so a row equals, number for number, what the single command returns.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.collectives import ALGORITHMS, parse_kind
from sim.hardware import load_chip
from sim.runs import REQUESTS, Request, run
from sim.runs.convert import parse_bytes
from sim.runs.inference import decode_config
from sim.runs.requests import flag_name, setting_kind
from sim.runs.train import training_config
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.progress import NO_TASK, ProgressCallback, reporting, stop_reporting, task
from topologies.scenario import scenario_from_flags
from topologies.slices import SLICES
from topologies.torus import AXIS_NAMES, DCN_AXIS, parse_shape, parse_wraparound
from topologies.validate import (
    MAX_STUDY_PLOTS,
    MAX_STUDY_POINTS,
    MAX_WORKERS,
    api_call,
    one_of,
    range_text,
    short_repr,
    split_list,
)
from workloads.models import load_model
from workloads.moe import MoeConfig
from workloads.training import parse_remat

STUDY_KEYS = ("command", "base", "grid", "zip", "metrics", "plot")
PLOT_KEYS = ("x", "y", "hue")
# Commands whose `--json` prints one result object (the others write tables or several results).
STUDY_COMMANDS = ("train", "collective", "decode", "prefill", "serve", "goodput")
# Flags a study may not set: the sweep itself decides how each point prints and writes.
_OUTPUT_FLAGS = ("json", "out", "perfetto", "plots", "trace-chips", "quiet", "help", "set")
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
SET_PREFIX = "set."
# Columns every results row has besides the point's inputs and outputs.
POINT_COLUMN = "point"
COMMAND_LINE_COLUMN = "command_line"
WALL_COLUMN = "wall_time_s"
ERROR_COLUMN = "error"
# What became of a point: it ran and fits in HBM (`ok`), it ran but its peak HBM is over the
# chip's capacity (`does not fit`: its numbers describe a run that cannot happen), or it failed
# (`error`). Points without an HBM verdict (a collective) are `ok` when they ran.
STATUS_COLUMN = "status"
FITS_COLUMN = "fits_in_hbm"
STATUS_OK, STATUS_DOES_NOT_FIT, STATUS_ERROR = "ok", "does not fit", "error"
STATUSES = (STATUS_OK, STATUS_DOES_NOT_FIT, STATUS_ERROR)


def status_counts_text(df) -> str:
    """`4 ok, 2 do not fit in HBM, 1 failed` for a results frame (zero counts left out, `ok`
    always shown)."""
    counts = df[STATUS_COLUMN].value_counts().to_dict() if len(df) else {}
    parts = [f"{counts.get(STATUS_OK, 0)} ok"]
    if counts.get(STATUS_DOES_NOT_FIT):
        n = counts[STATUS_DOES_NOT_FIT]
        parts.append(f"{n} {'does' if n == 1 else 'do'} not fit in HBM")
    parts.append(f"{counts.get(STATUS_ERROR, 0)} failed")
    return ", ".join(parts)


def point_status(row: Mapping[str, Any]) -> str:
    """`ok`, `does not fit` or `error` for one results row (from its `error` and
    `fits_in_hbm`)."""
    if not _is_missing(row.get(ERROR_COLUMN)):
        return STATUS_ERROR
    fits = row.get(FITS_COLUMN)
    if not _is_missing(fits) and not bool(fits):
        return STATUS_DOES_NOT_FIT
    return STATUS_OK


@dataclass(frozen=True, slots=True, kw_only=True)
class StudySpec:
    """A validated study: the base command's flags and the varied ones, in file order."""

    command: str
    base: tuple[tuple[str, Any], ...]
    grid: tuple[tuple[str, tuple[Any, ...]], ...]
    zip: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    metrics: tuple[str, ...] = ()
    plots: tuple[tuple[tuple[str, str], ...], ...] = ()

    @property
    def varied(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.grid) + tuple(k for k, _ in self.zip)

    def to_dict(self) -> dict[str, Any]:
        """The study as a plain mapping (what `study.json` records and `load_study` reads)."""
        d: dict[str, Any] = {"command": self.command, "base": dict(self.base),
                             "grid": {k: list(v) for k, v in self.grid}}
        if self.zip:
            d["zip"] = {k: list(v) for k, v in self.zip}
        if self.metrics:
            d["metrics"] = list(self.metrics)
        if self.plots:
            plots = [dict(p) for p in self.plots]
            d["plot"] = plots[0] if len(plots) == 1 else plots
        return d

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the grid (last key fastest) times the zipped rows (fastest)."""
        grid_lists = [v for _, v in self.grid]
        zip_rows = list(zip(*(v for _, v in self.zip), strict=True)) if self.zip else [()]
        gkeys = [k for k, _ in self.grid]
        zkeys = [k for k, _ in self.zip]
        out = []
        for combo in itertools.product(*grid_lists, zip_rows):
            p = dict(zip(gkeys, combo[:-1], strict=True))
            p.update(zip(zkeys, combo[-1], strict=True))
            out.append(p)
        return out


# -- the schema ------------------------------------------------------------------------------
def _flag_actions(command: str) -> dict[str, str]:
    """Flag name without dashes -> its kind (`switch`, `list` or `value`), for the command's own
    settings (its request's) and `set`."""
    cls = REQUESTS[command]
    return {flag_name(n): setting_kind(n) for n in cls.FLAGS}


def _norm_key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key.strip():
        raise TpusimError(f"study {where} key {short_repr(key)} is not a flag name; write e.g. "
                          f"seq-len")
    key = key.strip()
    if key.startswith(SET_PREFIX):
        return key
    return key.lstrip("-").replace("_", "-")


def _check_key(key: str, where: str, command: str, actions: dict[str, Any]) -> None:
    if key.startswith(SET_PREFIX):
        field = key[len(SET_PREFIX):]
        if not field:
            raise TpusimError(f"study {where} key {short_repr(key)} names no field; write e.g. "
                              f"set.ici_link_bytes_per_s")
        if "set" not in actions:
            raise TpusimError(
                f"study {where} key {short_repr(key)} needs `tpusim {command} --set`, which "
                f"this version "
                f"of tpusim does not have; vary a flag of the command instead"
            )
        return
    if key in _OUTPUT_FLAGS:
        raise TpusimError(
            f"study {where} key {short_repr(key)} is an output flag; a sweep prints and writes "
            f"its own "
            f"results (use --out on `tpusim sweep`)"
        )
    if key not in actions:
        allowed = sorted(k for k in actions if k not in _OUTPUT_FLAGS)
        raise TpusimError(
            f"study {where} key {short_repr(key)} is not a flag of `tpusim {command}`; "
            f"{one_of(key, allowed, listing=f'`tpusim {command} --help` lists them')} "
            f"(or set.FIELD for --set)"
        )


def _values(key: str, v: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(v, list):
        raise TpusimError(
            f"study {where}.{key} must be a list of values, got {short_repr(v)}; write "
            f"[{short_repr(v)}] for one"
        )
    if not v:
        raise TpusimError(f"study {where}.{key} is an empty list; give at least one value")
    for x in v:
        _check_value(key, x, where)
    return tuple(v)


def _check_bools(key: str, values: Iterable[Any], where: str, actions: dict[str, Any]) -> None:
    is_switch = actions.get(key) == "switch"
    for v in values:
        if isinstance(v, bool) and not is_switch:
            raise TpusimError(
                f"study {where}.{key} value {short_repr(v)}: --{key} takes a value, not "
                f"true/false (YAML "
                f"reads yes/no/on/off as true/false; quote it, e.g. 'no')"
            )
        if is_switch and not isinstance(v, bool):
            raise TpusimError(
                f"study {where}.{key} value {short_repr(v)}: --{key} is a switch; give true or "
                f"false"
            )


def _check_value(key: str, x: Any, where: str) -> None:
    if isinstance(x, (dict, list)) or x is None:
        raise TpusimError(
            f"study {where}.{key} value {short_repr(x)} must be a number, a string or "
            f"true/false"
        )
    if isinstance(x, float) and not math.isfinite(x):
        # YAML reads .nan, .inf and 1e400 as floats that no flag accepts (and that JSON
        # cannot record in study.json).
        raise TpusimError(
            f"study {where}.{key} value {x!r} is not a finite number; give a finite value "
            f"(quote it, e.g. '1e400', only if the flag takes text)"
        )


def load_study(source: str | os.PathLike | Mapping[str, Any]) -> StudySpec:
    """A study file (YAML/JSON) or mapping -> validated `StudySpec` (one-line errors)."""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        from topologies.yamlio import read_yaml_mapping

        data = read_yaml_mapping(Path(source), what="study")
    unknown = [k for k in data if k not in STUDY_KEYS]
    if unknown:
        raise TpusimError(
            f"study key {short_repr(unknown[0])} is unknown; {one_of(unknown[0], STUDY_KEYS)}"
        )
    command = data.get("command")
    if command not in STUDY_COMMANDS:
        raise TpusimError(
            f"study command {short_repr(command)} cannot be swept; "
            f"{one_of(command, STUDY_COMMANDS)}"
        )
    actions = _flag_actions(command)
    seen: dict[str, str] = {}

    def mapping(name: str, required: bool) -> dict:
        m = data.get(name)
        if m is None:
            if required:
                raise TpusimError(f"study has no {name!r}; add {name}: {{flag: value, ...}}")
            return {}
        if not isinstance(m, dict):
            raise TpusimError(
                f"study {name!r} must be a mapping of flag: value, got {short_repr(m)}"
            )
        out = {}
        for k, v in m.items():
            key = _norm_key(k, name)
            _check_key(key, name, command, actions)
            # A varied key may also sit in base (the example does): the varied values
            # replace the base value. Grid and zip must not both vary it.
            if key in seen and seen[key] != "base":
                raise TpusimError(
                    f"study key {short_repr(key)} appears in both {seen[key]} and {name}; give "
                    f"it once"
                )
            seen[key] = name
            out[key] = v
        return out

    base = mapping("base", True)
    grid = {k: _values(k, v, "grid") for k, v in mapping("grid", False).items()}
    zipped = {k: _values(k, v, "zip") for k, v in mapping("zip", False).items()}
    for where, m in (("base", base), ("grid", grid), ("zip", zipped)):
        for k, vs in m.items():
            _check_bools(k, vs if isinstance(vs, (list, tuple)) else [vs], where, actions)
    for k, v in base.items():
        if isinstance(v, list):
            if actions.get(k) != "list":
                raise TpusimError(
                    f"study base.{k} is a list, but --{k} takes one value; move it to grid "
                    f"to vary it"
                )
            for x in v:
                _check_value(k, x, "base")
        else:
            _check_value(k, v, "base")
    if "grid" in data and not data["grid"] and not data.get("zip"):
        raise TpusimError("study grid is empty; list at least one flag with the values it takes")
    if not grid and not zipped:
        raise TpusimError("study varies nothing; add grid: {flag: [values, ...]} (or zip)")
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        desc = ", ".join(f"{k} has {len(v)}" for k, v in zipped.items())
        raise TpusimError(f"study zip lists must have the same length ({desc}); even them out")
    total = math.prod(len(v) for v in grid.values()) * (lengths.pop() if lengths else 1)
    if total > MAX_STUDY_POINTS:
        sizes = " x ".join([str(len(v)) for v in grid.values()]
                           + ([f"{len(next(iter(zipped.values())))} zip rows"] if zipped else []))
        raise TpusimError(
            f"study has {total:,} points ({sizes}), over the limit of {MAX_STUDY_POINTS:,} "
            f"points one sweep may run; vary fewer values or split it into several studies"
        )
    metrics = data.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) and m for m in metrics):
        raise TpusimError(
            f"study metrics must be a list of result names such as [step_time_s, mfu], "
            f"got {short_repr(metrics)}"
        )
    varied = set(grid) | set(zipped)
    plots = _plots(data.get("plot"), varied)
    return StudySpec(
        command=command, base=tuple(base.items()),
        grid=tuple(grid.items()), zip=tuple(zipped.items()),
        metrics=tuple(metrics), plots=plots,
    )


def _plots(p: Any, varied: set[str]) -> tuple[tuple[tuple[str, str], ...], ...]:
    if p is None:
        return ()
    items = p if isinstance(p, list) else [p]
    if len(items) > MAX_STUDY_PLOTS:
        raise TpusimError(f"study plot lists {len(items):,} plots, over the limit of "
                          f"{MAX_STUDY_PLOTS}; keep the ones you will read (or split the study)")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise TpusimError(f"study plot must be {{x: KEY, y: METRIC, hue: KEY}}, got "
                              f"{short_repr(item)}")
        bad = [k for k in item if k not in PLOT_KEYS]
        if bad:
            raise TpusimError(
                f"study plot key {short_repr(bad[0])} is unknown; the keys are "
                f"{', '.join(PLOT_KEYS)}"
            )
        if "x" not in item or "y" not in item:
            raise TpusimError("study plot needs x (a varied key) and y (a result name)")
        norm = {}
        for k in PLOT_KEYS:
            if k not in item:
                continue
            v = item[k]
            if not isinstance(v, str) or not v:
                raise TpusimError(f"study plot {k} must be a name, got {short_repr(v)}")
            if k != "y":
                v = _norm_key(v, "plot")
                if v not in varied:
                    raise TpusimError(
                        f"study plot {k} {short_repr(v)} is not a key the study varies; use one "
                        f"of: "
                        f"{', '.join(sorted(varied))}"
                    )
            norm[k] = v
        out.append(tuple(norm.items()))
    return tuple(out)


# -- one point -------------------------------------------------------------------------------
def _arg_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def point_argv(study: StudySpec, point: Mapping[str, Any]) -> list[str]:
    """The `tpusim` arguments of one point (without `--json`), base flags first."""
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
        argv += ["--set", s]
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
    """Run one point's request in this process: {"result": {...}} (the command's `--json`
    object) or {"error": "..."}, plus the wall time. Never raises for a failed point (a bad
    mesh, out of memory, a bug)."""
    t0 = time.perf_counter()
    try:
        out: dict[str, Any] = {"result": run(req).to_dict()}
    except TpusimError as exc:
        out = {"error": str(exc)}
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


# -- running a study -------------------------------------------------------------------------
def check_workers(workers: Any) -> None:
    """A worker count: a whole number in [0, MAX_WORKERS] (0 = one per core)."""
    if not isinstance(workers, int) or isinstance(workers, bool) \
            or not 0 <= workers <= MAX_WORKERS:
        raise TpusimError(
            f"--workers {short_repr(workers)} must be "
            f"{range_text(0, MAX_WORKERS, integer=True)} (0 = one per core)"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """How to run a study: worker count, backend, output directory, resume."""

    workers: int = 0  # 0 = one per core
    dask: Any = None  # None, "local", "tcp://HOST:PORT" or a distributed.Client
    out_dir: str | None = None
    resume: bool = False
    # Report no progress, even where a callback is set (`topologies.progress.reporting`).
    quiet: bool = False
    # Plot the points that do not fit in HBM like the others (default: hollow grey, out of
    # the lines, so that no line leads the eye to a configuration that cannot run).
    allow_oom: bool = False
    write_every_s: float = 2.0  # how often finished rows are flushed to disk while running

    def __post_init__(self) -> None:
        check_workers(self.workers)
        if self.out_dir is not None and not str(self.out_dir).strip():
            # An empty --out wrote nothing and printed "-> ./results.parquet": the results lost.
            raise TpusimError(f"--out {short_repr(self.out_dir)} names no directory; give one "
                              f"(default sweep-out), e.g. --out runs/ici")
        if self.dask is not None and not isinstance(self.dask, str) \
                and not callable(getattr(self.dask, "submit", None)):
            raise TpusimError(
                f"dask={short_repr(self.dask)} is not a scheduler: give \"local\", an address "
                f"tcp://HOST:PORT or a distributed.Client"
            )
        if isinstance(self.dask, str) and self.dask != "local" \
                and not self.dask.startswith(("tcp://", "tls://", "inproc://")):
            raise TpusimError(
                f"--dask {short_repr(self.dask)} is not a scheduler address; give local or "
                f"tcp://HOST:PORT"
            )


# While a study runs, its rows are rewritten at most every `write_every_s`, and at least
# WRITE_COST_RATIO times as long apart as the last write took (1,000 rows of a training study
# take ~0.3 s to write as parquet and CSV: one every 6 s, not every 2 s).
WRITE_COST_RATIO = 20


def _num_workers(cfg: SweepConfig) -> int:
    return cfg.workers or max(os.cpu_count() or 1, 1)


def _worker_init() -> None:
    # Ctrl-C goes to the whole process group: the parent keeps finished rows and stops the
    # pool; workers finish (or drop) their point quietly instead of printing tracebacks.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the parent's progress callback: the progress is the parent's
    # (one tick per point), so the worker's own runs report to nobody.
    stop_reporting()


def _local_runner(n: int, fn: Callable[[Any], Any] = None):
    """Yields (index, fn(job)) as jobs finish on a pool of `n` reused worker processes
    (`fn` defaults to `run_point`; `n` = 1 runs them in this process)."""
    fn = fn or run_point

    def run(jobs: list[tuple[int, Any]]):
        if n == 1:
            for i, argv in jobs:
                with reporting(None):  # the point's own runs: the study's bar stands for them
                    out = fn(argv)
                yield i, out
            return
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ex = ProcessPoolExecutor(max_workers=n, initializer=_worker_init)
        try:
            futs = {ex.submit(fn, argv): i for i, argv in jobs}
            pending = set(futs)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=futs.__getitem__):
                    yield futs[f], f.result()
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    return run


DASK_CONNECT_TIMEOUT_S = 5


def _dask_client(dask: Any, n: int):
    """(client, closer) for --dask local, an address, or a given distributed.Client."""
    if not isinstance(dask, str):
        return dask, lambda: None
    try:
        from distributed import Client, LocalCluster
    except ImportError:  # pragma: no cover - distributed is a dependency
        raise TpusimError("--dask needs the `distributed` package; pip install distributed") \
            from None
    import logging

    if dask == "local":
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR)
        client = Client(cluster)

        def close():
            client.close()
            cluster.close()

        return client, close
    try:
        if dask.startswith("tcp://"):
            # A plain TCP connect first: a port nobody listens on is refused at once (the Dask
            # client would retry until its timeout), a silent host times out as the client would.
            import socket
            from urllib.parse import urlsplit

            u = urlsplit(dask)
            if u.hostname and u.port:
                socket.create_connection((u.hostname, u.port),
                                         timeout=DASK_CONNECT_TIMEOUT_S).close()
        client = Client(dask, timeout=f"{DASK_CONNECT_TIMEOUT_S}s")
    except Exception as exc:  # refused, timed out, or something that does not speak Dask
        raise TpusimError(
            f"--dask {dask if len(dask) <= 60 else dask[:57] + '...'}: no Dask scheduler "
            f"answered within "
            f"{DASK_CONNECT_TIMEOUT_S} s "
            f"({type(exc).__name__}); start one (`dask scheduler`) or use --dask local"
        ) from None
    return client, client.close


def _dask_runner(client, fn: Callable[[Any], Any] = None):
    fn = fn or run_point

    def run(jobs: list[tuple[int, Any]]):
        from distributed import as_completed

        tag = time.time_ns()  # fresh task keys: a shared scheduler may hold an earlier sweep's
        futs = {client.submit(fn, argv, pure=False, key=f"tpusim-point-{tag}-{i}"): i
                for i, argv in jobs}
        try:
            for f in as_completed(list(futs)):
                yield futs[f], f.result()
        finally:
            client.cancel(list(futs))

    return run


def _row(study: StudySpec, index: int, point: Mapping[str, Any], argv: list[str],
         outcome: Mapping[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {POINT_COLUMN: index}
    row.update(point)
    for k, v in study.base:
        if k not in point:
            row[k] = json.dumps(v) if isinstance(v, list) else v
    row[COMMAND_LINE_COLUMN] = shlex.join(["tpusim", *argv])
    if "result" in outcome:
        for k, v in flatten_result(outcome["result"]).items():
            # An output named like an input (`model`, `chip`) must not hide what was asked.
            row[f"result.{k}" if k in row else k] = v
    row[WALL_COLUMN] = outcome["wall_time_s"]
    row[ERROR_COLUMN] = outcome.get("error")
    row[STATUS_COLUMN] = point_status(row)
    return row


# `df.attrs` key of a results frame: {column: [kind, full]}, the kind of its values ("num",
# "bool", "text", or "none" when every cell is empty) and whether every succeeded row has one.
# pandas keeps attrs in results.parquet (and through a read/edit/write), so `--resume` checks
# each resumed row against the columns as tpusim wrote them.
COLUMNS_ATTR = "tpusim_columns"
_KINDS = {"num": "numbers", "bool": "true/false", "text": "text", "none": "nothing"}


def rows_frame(rows: Iterable[Mapping[str, Any]]):
    """Rows (any order) -> DataFrame sorted by point, columns in first-seen order, the wall
    time, error and status last; input columns mixing numbers and text become text. `attrs`
    records every column's kind (`COLUMNS_ATTR`)."""
    import pandas as pd

    rows = sorted(({**r, STATUS_COLUMN: point_status(r)} for r in rows),
                  key=lambda r: r[POINT_COLUMN])
    cols: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k not in (WALL_COLUMN, ERROR_COLUMN, STATUS_COLUMN):
                cols.setdefault(k)
    order = [*cols, WALL_COLUMN, ERROR_COLUMN, STATUS_COLUMN]
    df = pd.DataFrame.from_records(rows, columns=order)
    column_kinds: dict[str, str] = {}
    for c in df.columns:
        vals = [v for v in df[c] if v is not None and not (isinstance(v, float) and math.isnan(v))]
        kinds = {_kind(v) for v in vals}
        column_kinds[c] = "text" if len(kinds) > 1 else next(iter(kinds), "none")
        if len(kinds) > 1:
            df[c] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                     for v in df[c]]
        elif vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            df[c] = df[c].astype("Int64")  # stays integer when failed points leave gaps
        elif kinds == {"bool"}:
            df[c] = df[c].astype("boolean")
    df[ERROR_COLUMN] = df[ERROR_COLUMN].astype("string")
    df = df.reset_index(drop=True)
    ok = df[ERROR_COLUMN].isna()
    full = df.loc[ok].notna().all() if ok.any() else pd.Series(False, index=df.columns)
    df.attrs[COLUMNS_ATTR] = {c: [k, bool(full[c])] for c, k in column_kinds.items()}
    return df


def _kind(v: Any) -> str:
    return "bool" if isinstance(v, bool) else "num" if isinstance(v, (int, float)) else "text"


def _write_results(out: Path, rows: Iterable[Mapping[str, Any]]):
    from sim.export.output import atomic_write

    df = rows_frame(rows)
    atomic_write(out / "results.parquet", lambda p: df.to_parquet(p, index=False))
    atomic_write(out / "results.csv", lambda p: df.to_csv(p, index=False))
    return df


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("tpusim", "simpy", "numpy", "pandas", "networkx", "distributed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


# A results row is a few KB (a train row with its per-kind collective summaries ~10 KB); a
# resumed file may hold at most this much per point of the study, uncompressed, so a small file
# that would expand into gigabytes (3 M copies of one row compress to 33 KB) is refused from its
# metadata before it is read.
MAX_RESULT_ROW_BYTES = 1 << 20


def _load_previous(out: Path, study: StudySpec, points: list[dict[str, Any]],
                   argvs: list[list[str]]) -> dict[int, dict[str, Any]]:
    """--resume: rows of results.parquet, by point index. They must be rows this study wrote:
    at most one per point, each with the point's own values, an error that is text or empty,
    plain finite values, and the study's metrics in every row that succeeded."""
    import pandas as pd
    import pyarrow.parquet as pq

    path = out / "results.parquet"
    name = short_repr(str(path))
    fix = "delete it or use another --out"
    if not path.exists():
        return {}
    if not path.is_file():
        raise TpusimError(f"--resume: {name} is not a regular file (a directory, pipe or "
                          f"device), so it holds no results to resume; {fix}")
    try:
        meta = pq.ParquetFile(path).metadata
        n_rows = meta.num_rows
        n_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    except Exception as exc:
        raise TpusimError(f"--resume: {name} cannot be read ({type(exc).__name__}); {fix}") \
            from None
    if n_rows > len(argvs):
        raise TpusimError(f"--resume: {name} holds {n_rows:,} rows but this study has "
                          f"{len(argvs):,} points (one row each); it is not this study's "
                          f"results: {fix}")
    if n_bytes > MAX_RESULT_ROW_BYTES * len(argvs):
        raise TpusimError(f"--resume: {name} holds {n_bytes / 2**20:,.0f} MiB of data (the "
                          f"limit is {MAX_RESULT_ROW_BYTES >> 20} MiB per point of the study); it "
                          f"is not this study's results: {fix}")
    try:
        df = pd.read_parquet(path)
    except Exception as exc:
        raise TpusimError(f"--resume: {name} cannot be read ({type(exc).__name__}); {fix}") \
            from None
    if COMMAND_LINE_COLUMN not in df.columns:
        raise TpusimError(f"--resume: {name} is not a tpusim sweep result (no "
                          f"{COMMAND_LINE_COLUMN} column); use another --out")
    index = {shlex.join(["tpusim", *a]): i for i, a in enumerate(argvs)}
    stray = [c for c in df[COMMAND_LINE_COLUMN] if not isinstance(c, str) or c not in index]
    if stray:
        raise TpusimError(
            f"--resume: {name} holds {len(stray)} row(s) that are not points of this study "
            f"(e.g. {short_repr(stray[0])}); use another --out for a different study"
        )
    wanted = list(dict.fromkeys([*study.metrics, *(dict(p)["y"] for p in study.plots)]))
    absent = [m for m in wanted if m not in df.columns]
    if absent and len(df):
        raise TpusimError(
            f"--resume: {name} has no column {short_repr(absent[0])} (a metric of the study); "
            f"if `tpusim {study.command}` returns it, the file was written by another study or "
            f"edited: {fix}")
    columns = _written_columns(df, name, fix)
    if columns is not None and len(df):
        added = [c for c in df.columns if c not in columns]
        dropped = [c for c in columns if c not in df.columns]
        if added or dropped:
            what = (f"a column tpusim did not write ({short_repr(added[0])})" if added else
                    f"no column {short_repr(dropped[0])}, which tpusim wrote")
            raise TpusimError(f"--resume: {name} has {what}; the file was edited: {fix}")
    prev: dict[int, dict[str, Any]] = {}
    for rec in df.to_dict("records"):
        rec = {k: (None if _is_missing(v) else _plain(v)) for k, v in rec.items()}
        i = index[rec[COMMAND_LINE_COLUMN]]
        if i in prev:
            raise TpusimError(f"--resume: {name} holds point {i} twice; {fix}")
        _check_resumed_row(study, points[i], rec, wanted, f"--resume: {name} point {i}", fix)
        rec[POINT_COLUMN] = i
        # Keep empty cells too (e.g. inputs.flags.slice = None): dropping them would reorder
        # the columns of a resumed study against an uninterrupted one.
        prev[i] = rec
    # Then every row against the kinds of the columns as tpusim wrote them (where the file
    # records them): a column of numbers that now holds text, true/false or nothing.
    for i, rec in prev.items():
        _check_kinds(rec, columns or {}, f"--resume: {name} point {i}", fix)
    return prev


def _plain(v: Any) -> Any:
    """A numpy scalar as the Python number it holds (other values as they are)."""
    item = getattr(v, "item", None)
    if item is not None and getattr(v, "shape", None) == ():
        return item()
    return v


def _written_columns(df, name: str, fix: str) -> dict[str, tuple[str, bool]] | None:
    """The kind of every column as tpusim wrote the file (`COLUMNS_ATTR`); None for a file
    without that record (written before tpusim kept one)."""
    rec = df.attrs.get(COLUMNS_ATTR)
    if rec is None:
        return None
    if not isinstance(rec, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) == 2
            and isinstance(v[0], str) and v[0] in _KINDS
            and isinstance(v[1], bool) for k, v in rec.items()):
        raise TpusimError(f"--resume: {name} has a malformed record of its columns "
                          f"({COLUMNS_ATTR}); the file was edited: {fix}")
    return {k: (v[0], v[1]) for k, v in rec.items()}


def _check_kinds(rec: Mapping[str, Any], columns: Mapping[str, tuple[str, bool]], where: str,
                 fix: str) -> None:
    """A resumed row against the kinds of its columns as tpusim wrote them: a column of
    numbers holds numbers (not text or true/false, and not nothing where every succeeded row
    had one), and so on for text and true/false."""
    failed = rec.get(ERROR_COLUMN) is not None
    for k, (kind, full) in columns.items():
        v = rec.get(k)
        if v is None:
            if full and not failed:
                raise TpusimError(f"{where} succeeded but has no {short_repr(k)} (tpusim wrote "
                                  f"one in every succeeded row); the file was edited: {fix}")
        elif _kind(v) != kind:
            raise TpusimError(f"{where}: {short_repr(k)} is {short_repr(v)}, but tpusim wrote "
                              f"{_KINDS[kind]} in that column; the file was edited: {fix}")


def _check_resumed_row(study: StudySpec, point: Mapping[str, Any], rec: Mapping[str, Any],
                       wanted: list[str], where: str, fix: str) -> None:
    """One resumed row against what this study writes for its point (`_row`)."""
    why = "the file was edited or written by another study"
    for k, v in rec.items():
        if v is not None and not isinstance(v, (str, bool, int, float)):
            raise TpusimError(f"{where}: {short_repr(k)} is {short_repr(v)}, not a plain value "
                              f"(tpusim writes text, numbers and true/false); {why}: {fix}")
        # Text that reads as a non-finite number ("nan", "inf") would print as one.
        if isinstance(v, float) and not math.isfinite(v) or isinstance(v, str) and \
                v.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            raise TpusimError(f"{where}: {short_repr(k)} is {short_repr(v)} (numbers must be "
                              f"finite); {why}: {fix}")
    err = rec.get(ERROR_COLUMN)
    if err is not None and not isinstance(err, str):
        raise TpusimError(f"{where}: {ERROR_COLUMN} is {short_repr(err)}, not the text of an "
                          f"error; {why}: {fix}")
    expected = dict(point)
    for k, v in study.base:
        expected.setdefault(k, json.dumps(v) if isinstance(v, list) else v)
    for k, v in expected.items():
        if k not in rec:
            raise TpusimError(f"{where} has no column {short_repr(k)}; {why}: {fix}")
        got = rec[k]
        same = got == v if isinstance(got, (int, float)) and isinstance(v, (int, float)) \
            and not isinstance(got, bool) and not isinstance(v, bool) else str(got) == str(v)
        if not same:
            raise TpusimError(f"{where}: {short_repr(k)} is {short_repr(got)} but the point "
                              f"has {short_repr(v)}; {why}: {fix}")
    if err is None:
        for m in wanted:
            if rec.get(m) is None:
                raise TpusimError(f"{where} succeeded but has no {short_repr(m)} (a metric of "
                                  f"the study); {why}: {fix}")


def _is_missing(v: Any) -> bool:
    try:
        import pandas as pd

        return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
    except TypeError:
        return False


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
            raise TpusimError(f"study point {i} ({shlex.join(argv)}): {exc}") from None
        reqs.append(req)
    return reqs


def _check_texts(command: str, req: Request, seen: set[tuple[str, ...]]) -> None:
    """The settings a command takes as text and parses when it runs, parsed now: `--bytes abc`,
    `--axes x,,y`, a `--mesh`/`--dcn`/`--axis-map` that is not name=size, an unknown `--remat`
    are errors of the study, not failed rows. (Whether a mesh fits the pod needs the pod: that
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
            for axis in split_list(req.axes, "--axes", example="x,y"):
                if axis not in (*AXIS_NAMES, DCN_AXIS):
                    raise TpusimError(f"--axes {short_repr(req.axes)}: {short_repr(axis)} is "
                                      f"not an axis of any pod; use {', '.join(AXIS_NAMES)} or "
                                      f"{DCN_AXIS}, e.g. x,y")
    elif command != "goodput" or req.mesh is not None:  # goodput may give a step time instead
        parse_mesh(req.mesh, req.dcn, getattr(req, "axis_map", None))
        if command in ("train", "goodput"):
            parse_remat(req.remat)
    seen.add(key)


def _check_names(command: str, req: Request, seen: set[tuple[str, ...]]) -> None:
    """The names a point gives that no other setting can make valid: a chip (preset or file), a
    slice, a model (zoo name or file), a collective `--op` and `--algorithm`, a `--shape`'s
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
    `--shape` (`z` on a 2D shape, `x,,y`), and the run settings of train, decode and prefill
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
        from sim.runs.serve import check_settings  # the serving stack, loaded when swept

        check_settings(req)
    elif command == "goodput":
        from sim.runs.goodput import check_settings as check_goodput

        check_goodput(req)
        if req.model is not None:
            training_config(req, moe=MoeConfig())
    seen.add(key)


def run_study(study: StudySpec, cfg: SweepConfig,
              on_row: Callable[[dict[str, Any]], None] | None = None):
    """Run every point of `study` (skipping finished ones with `cfg.resume`) and return the
    results DataFrame; with `cfg.out_dir`, results/study.json/plots are written there."""
    points = study.points()
    argvs = [point_argv(study, p) for p in points]
    reqs = check_points(study, argvs)
    out = Path(cfg.out_dir) if cfg.out_dir else None
    if out is not None:
        from sim.export.output import check_output_dir

        check_output_dir(out)
        if (out / "results.parquet").exists() and not cfg.resume:
            raise TpusimError(
                f"{str(out)!r} already holds results.parquet; pass --resume to finish that "
                f"study, or give another --out"
            )
    rows: dict[int, dict[str, Any]] = _load_previous(out, study, points, argvs) \
        if out and cfg.resume else {}
    skipped = len(rows)
    jobs = [(i, r) for i, r in enumerate(reqs) if i not in rows]
    n = _num_workers(cfg)
    started = time.time()
    t0 = time.perf_counter()
    closer = lambda: None  # noqa: E731
    if cfg.dask is not None:
        client, closer = _dask_client(cfg.dask, n)
        runner = _dask_runner(client)
        backend = "dask"
    else:
        runner = _local_runner(min(n, max(len(jobs), 1)))
        backend = "local"
    # Metrics and plot axes are checked on the first successful row (resumed or new); until
    # then nothing is written, so a study naming a metric the command lacks leaves no output.
    needs_check = bool(study.metrics or study.plots)
    checked = False
    ok_prev = [r for r in rows.values() if _is_missing(r.get(ERROR_COLUMN))]
    if needs_check and ok_prev:
        _check_metrics(study, ok_prev[0])
        checked = True
    bar = task("sweep", total=len(points), unit="point", done=skipped) if not cfg.quiet \
        else NO_TASK
    failed = unfit = 0
    bad_metric = False
    interrupted = False
    last_write = -math.inf  # the first finished row is written at once, then every few s
    write_s = 0.0  # how long the last write took
    try:
        for i, outcome in runner(jobs):
            row = _row(study, i, points[i], argvs[i], outcome)
            rows[i] = row
            if not checked and "result" in outcome:
                try:
                    _check_metrics(study, row)
                except TpusimError:
                    bad_metric = True
                    raise
                checked = True
            if on_row:
                on_row(row)
            if row.get(STATUS_COLUMN) == STATUS_ERROR:
                failed += 1
            elif row.get(STATUS_COLUMN) == STATUS_DOES_NOT_FIT:
                unfit += 1
            bar.update(len(rows), detail=_sweep_detail(failed, unfit),
                       force=len(rows) == len(points))
            # Every write rewrites every row: on a long study, write less often, so that
            # writing takes at most 1/WRITE_COST_RATIO of the time.
            wait_s = max(cfg.write_every_s, WRITE_COST_RATIO * write_s)
            if out is not None and (checked or not needs_check) \
                    and time.perf_counter() - last_write >= wait_s:
                t_w = time.perf_counter()
                _write_results(out, rows.values())
                last_write = time.perf_counter()
                write_s = last_write - t_w
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        bar.close()
        closer()
        if out is not None and rows and not bad_metric:
            _write_results(out, rows.values())
    df = rows_frame(rows.values())
    if not checked and skipped and (df[ERROR_COLUMN].isna()).any():
        _check_metrics(study, df[df[ERROR_COLUMN].isna()].iloc[0].to_dict())
    if out is not None and not interrupted:
        from sim.export.output import write_json

        elapsed = time.perf_counter() - t0
        write_json(out / "study.json", {
            "study": study.to_dict(),
            "versions": _versions(),
            "timing": {
                "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "wall_s": elapsed,
                "points": len(points),
                "ran": len(jobs),
                "resumed": skipped,
                "failed": int(df[ERROR_COLUMN].notna().sum()),
                "backend": backend,
                "workers": n,
                "points_per_s": len(jobs) / elapsed if elapsed > 0 else None,
            },
        })
        plot_study(study, df, out, allow_oom=cfg.allow_oom)
    return df


def _sweep_detail(failed: int, unfit: int) -> str:
    """The sweep bar's line: the points that failed or do not fit so far."""
    parts = [f"{failed} failed"] if failed else []
    if unfit:
        parts.append(f"{unfit} do not fit in HBM")
    return ", ".join(parts)


def _check_metrics(study: StudySpec, row: Mapping[str, Any]) -> None:
    wanted = list(study.metrics) + [dict(p)["y"] for p in study.plots]
    missing = [m for m in wanted if m not in row]
    if missing:
        names = [k for k, v in row.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)
                 and k not in (POINT_COLUMN, WALL_COLUMN) and k not in dict(study.base)
                 and k not in study.varied and not k.startswith("inputs.")]
        raise TpusimError(
            f"study metric {short_repr(missing[0])} is not a result of `tpusim "
            f"{study.command}`; use one "
            f"of: {', '.join(names)}"
        )


# How a point that does not fit in HBM is drawn in a study plot: a hollow grey marker, off the
# lines (a line through it would present a run that cannot happen as a trend to follow).
UNFIT_STYLE = {"marker": "o", "facecolors": "none", "edgecolors": "#9a9a9a", "linewidths": 1.2}
UNFIT_LABEL = "does not fit in HBM"


def plot_study(study: StudySpec, df, out_dir: str | Path, *, allow_oom: bool = False) \
        -> list[Path]:
    """One PNG per `plot` entry: y against x, a line per hue value (and per value of every other
    varied key, so that no line mixes points); failed points are left out, points that do not
    fit in HBM are hollow grey markers off the lines (`allow_oom`: drawn like the others)."""
    if not study.plots:
        return []
    from sim.export.output import atomic_write
    from sim.export.plots import _fig

    plt = _fig()
    ran = df[df[ERROR_COLUMN].isna()]
    if STATUS_COLUMN in ran.columns and not allow_oom:
        ok = ran[ran[STATUS_COLUMN] == STATUS_OK]
        unfit = ran[ran[STATUS_COLUMN] == STATUS_DOES_NOT_FIT]
    else:
        ok, unfit = ran, ran.iloc[0:0]
    paths = []
    for spec in study.plots:
        p = dict(spec)
        x, y, hue = p["x"], p["y"], p.get("hue")
        if y not in ran.columns:
            continue
        others = [k for k in study.varied if k not in (x, hue)]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs_all = _ordered_values(study, x)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs_all)
        pos = {(v if numeric else str(v)): (v if numeric else k) for k, v in enumerate(xs_all)}

        def at(g, x=x, numeric=numeric, pos=pos):
            return [pos.get(v if numeric else str(v), math.nan) for v in g[x]]

        groups = [hue] if hue else []
        groups += others
        keyed = ok.groupby(groups, sort=False, dropna=False) if groups else [((), ok)]
        for key, g in keyed:
            key = key if isinstance(key, tuple) else (key,)
            label = ", ".join(f"{k}={v}" for k, v in zip(groups, key, strict=True))
            g = g.assign(_x=at(g))
            g = g.sort_values("_x")
            ax.plot(g["_x"], g[y], marker="o", label=label or None)
        if len(unfit):
            ax.scatter(at(unfit), unfit[y], label=UNFIT_LABEL, zorder=3, **UNFIT_STYLE)
        if not numeric:
            ax.set_xticks(range(len(xs_all)), [str(v) for v in xs_all])
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"tpusim {study.command}: {y} vs {x}")
        if groups or len(unfit):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / f"plot_{_safe(y)}_vs_{_safe(x)}.png"
        paths.append(atomic_write(path, lambda q, fig=fig: fig.savefig(q, dpi=110, format="png")))
        plt.close(fig)
    return paths


def _ordered_values(study: StudySpec, key: str) -> list[Any]:
    for k, v in study.grid + study.zip:
        if k == key:
            return list(dict.fromkeys(v))
    return []


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


@api_call("sim.sweep")
def sweep(study: str | os.PathLike | Mapping[str, Any], *, workers: int = 1, dask: Any = None,
          out: str | os.PathLike | None = None, resume: bool = False, quiet: bool = False,
          allow_oom: bool = False, progress: ProgressCallback | None = None):
    """`tpusim sweep` from Python: the study (a file or a mapping with the same keys) run on
    `workers` local processes (1: in this process) or on `dask` ("local", "tcp://HOST:PORT" or
    a `distributed.Client`); returns the results DataFrame, one row per point, and with `out`
    also writes results.parquet/csv, study.json and the plots there. Every row has a `status`
    (`ok`, `does not fit`, `error`); `allow_oom` plots the points that do not fit like the
    others. `progress`: called with a `ProgressUpdate` per finished point (task `sweep`: points
    done of all, the failed and unfit so far); `quiet` reports nothing even to an enclosing
    `reporting` block's callback."""
    if not isinstance(study, (str, os.PathLike, Mapping)):
        raise TpusimError(
            f"sim.sweep(study={short_repr(study)}): give a study file's path or a mapping of "
            f"its keys (command, base, grid, ...), not {type(study).__name__}")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise TpusimError(f"sim.sweep(out={short_repr(out)}): give a directory path or None, "
                          f"not {type(out).__name__}")
    for name, flag in (("resume", resume), ("quiet", quiet), ("allow_oom", allow_oom)):
        if not isinstance(flag, bool):
            raise TpusimError(f"sim.sweep({name}={short_repr(flag)}): give True or False")
    cfg = SweepConfig(workers=workers, dask=dask, out_dir=None if out is None else str(out),
                      resume=resume, quiet=quiet, allow_oom=allow_oom)
    if progress is None:
        return run_study(load_study(study), cfg)
    with reporting(progress):
        return run_study(load_study(study), cfg)


__all__ = [
    "sweep",
    "STATUSES",
    "STATUS_COLUMN",
    "point_status",
    "status_counts_text",
    "STUDY_COMMANDS",
    "STUDY_KEYS",
    "StudySpec",
    "SweepConfig",
    "flatten_result",
    "load_study",
    "plot_study",
    "point_argv",
    "rows_frame",
    "run_point",
    "run_study",
]
