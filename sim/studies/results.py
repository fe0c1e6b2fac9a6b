"""A study's results: one row per point (its varied and base values, the command line that
reproduces it, the flattened result, the wall time, the error and the status: `ok`, `does not
fit` in HBM, or `error`), gathered into a DataFrame whose `attrs` record every column's kind,
and written as results.parquet and results.csv.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from sim.export.output import atomic_write
from sim.studies.points import flatten_result
from sim.studies.spec import StudySpec
from topologies.errors import python_name, render_said

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
    if not is_missing(row.get(ERROR_COLUMN)):
        return STATUS_ERROR
    fits = row.get(FITS_COLUMN)
    if not is_missing(fits) and not bool(fits):
        return STATUS_DOES_NOT_FIT
    return STATUS_OK


def point_row(study: StudySpec, index: int, point: Mapping[str, Any], argv: list[str],
              outcome: Mapping[str, Any]) -> dict[str, Any]:
    """The results row of point `index` from its outcome (`run_point`'s)."""
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
KIND_NAMES = {"num": "numbers", "bool": "true/false", "text": "text", "none": "nothing"}


def rows_frame(rows: Iterable[Mapping[str, Any]], spell: Callable[[str], str] = python_name):
    """Rows (any order) -> DataFrame sorted by point, columns in first-seen order, the wall
    time, error and status last; input columns mixing numbers and text become text. `attrs`
    records every column's kind (`COLUMNS_ATTR`). An error (a `Said`) names its settings as
    `spell` writes them: by Python name (default), or a front end's way (the CLI: flags)."""
    rows = sorted(({**r, ERROR_COLUMN: render_said(r.get(ERROR_COLUMN), spell),
                    STATUS_COLUMN: point_status(r)} for r in rows),
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
        kinds = {value_kind(v) for v in vals}
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


def value_kind(v: Any) -> str:
    return "bool" if isinstance(v, bool) else "num" if isinstance(v, (int, float)) else "text"


def write_results(out: Path, rows: Iterable[Mapping[str, Any]],
                  spell: Callable[[str], str] = python_name):
    """results.parquet and results.csv of `rows` in `out` (errors spelled by `spell`)."""
    df = rows_frame(rows, spell)
    atomic_write(out / "results.parquet", lambda p: df.to_parquet(p, index=False))
    atomic_write(out / "results.csv", lambda p: df.to_csv(p, index=False))
    return df


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("tpusim", "simpy", "numpy", "pandas", "networkx", "distributed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def is_missing(v: Any) -> bool:
    """An empty cell: None, pandas' NA or a float NaN."""
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


__all__ = ["COLUMNS_ATTR", "COMMAND_LINE_COLUMN", "ERROR_COLUMN", "FITS_COLUMN", "KIND_NAMES",
           "POINT_COLUMN", "STATUSES", "STATUS_COLUMN", "STATUS_DOES_NOT_FIT",
           "STATUS_ERROR", "STATUS_OK", "WALL_COLUMN", "is_missing", "package_versions",
           "point_row", "point_status", "rows_frame", "status_counts_text", "value_kind",
           "write_results"]
