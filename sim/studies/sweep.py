"""Running a study (`tpusim sweep`, `sim.sweep`): every point checked before any runs, run on
the chosen backend (`sim.studies.backends`), one row per point gathered as they finish and
written every few seconds (so an interrupted study keeps its finished rows, and `resume`
runs only the others), then study.json (the study, versions, timing) and the plots.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.export.output import check_output_dir, write_json
from sim.studies.backends import (
    check_dask,
    check_workers,
    dask_client,
    dask_runner,
    local_runner,
    num_workers,
)
from sim.studies.plots import plot_study
from sim.studies.points import check_points, point_argv
from sim.studies.results import (
    ERROR_COLUMN,
    POINT_COLUMN,
    STATUS_COLUMN,
    STATUS_DOES_NOT_FIT,
    STATUS_ERROR,
    WALL_COLUMN,
    is_missing,
    package_versions,
    point_row,
    rows_frame,
    write_results,
)
from sim.studies.resume import load_previous
from sim.studies.spec import StudySpec, load_study
from topologies.errors import TpusimError, python_name
from topologies.progress import NO_TASK, ProgressCallback, reporting, task
from topologies.validate import api_call, short_repr


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
    # How the results write the settings a failed point's error names: by Python name (what
    # `sim.sweep` returns), or a front end's way (`tpusim sweep`: its flags).
    spell: Callable[[str], str] = python_name

    def __post_init__(self) -> None:
        check_workers(self.workers)
        if self.out_dir is not None and not str(self.out_dir).strip():
            # An empty --out wrote nothing and printed "-> ./results.parquet": the results lost.
            raise TpusimError(f"{{out}} {short_repr(self.out_dir)} names no directory; give one "
                              f"(default sweep-out), e.g. {{out}} runs/ici", "out")
        check_dask(self.dask)


# While a study runs, its rows are rewritten at most every `write_every_s`, and at least
# WRITE_COST_RATIO times as long apart as the last write took (1,000 rows of a training study
# take ~0.3 s to write as parquet and CSV: one every 6 s, not every 2 s).
WRITE_COST_RATIO = 20


def run_study(study: StudySpec, cfg: SweepConfig,
              on_row: Callable[[dict[str, Any]], None] | None = None):
    """Run every point of `study` (skipping finished ones with `cfg.resume`) and return the
    results DataFrame; with `cfg.out_dir`, results/study.json/plots are written there."""
    points = study.points()
    argvs = [point_argv(study, p) for p in points]
    reqs = check_points(study, argvs)
    out = Path(cfg.out_dir) if cfg.out_dir else None
    if out is not None:
        check_output_dir(out)
        if (out / "results.parquet").exists() and not cfg.resume:
            raise TpusimError(
                f"{str(out)!r} already holds results.parquet; pass {{resume}} to finish that "
                f"study, or give another {{out}}", "resume", "out"
            )
    rows: dict[int, dict[str, Any]] = load_previous(out, study, points, argvs) \
        if out and cfg.resume else {}
    skipped = len(rows)
    jobs = [(i, r) for i, r in enumerate(reqs) if i not in rows]
    n = num_workers(cfg.workers)
    started = time.time()
    t0 = time.perf_counter()
    closer = lambda: None  # noqa: E731
    if cfg.dask is not None:
        client, closer = dask_client(cfg.dask, n)
        runner = dask_runner(client)
        backend = "dask"
    else:
        runner = local_runner(min(n, max(len(jobs), 1)))
        backend = "local"
    # Metrics and plot axes are checked on the first successful row (resumed or new); until
    # then nothing is written, so a study naming a metric the command lacks leaves no output.
    needs_check = bool(study.metrics or study.plots)
    checked = False
    ok_prev = [r for r in rows.values() if is_missing(r.get(ERROR_COLUMN))]
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
            row = point_row(study, i, points[i], argvs[i], outcome)
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
                write_results(out, rows.values(), cfg.spell)
                last_write = time.perf_counter()
                write_s = last_write - t_w
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        bar.close()
        closer()
        if out is not None and rows and not bad_metric:
            write_results(out, rows.values(), cfg.spell)
    df = rows_frame(rows.values(), cfg.spell)
    if not checked and skipped and (df[ERROR_COLUMN].isna()).any():
        _check_metrics(study, df[df[ERROR_COLUMN].isna()].iloc[0].to_dict())
    if out is not None and not interrupted:
        elapsed = time.perf_counter() - t0
        write_json(out / "study.json", {
            "study": study.to_dict(),
            "versions": package_versions(),
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


__all__ = ["SweepConfig", "WRITE_COST_RATIO", "run_study", "sweep"]
