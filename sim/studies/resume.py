"""Resuming a study (`resume`): the rows of an earlier run of the same study read back from
results.parquet. They must be rows this study wrote (at most one per point, each with the
point's own values, plain finite values of the kinds tpusim recorded for their columns, the
study's metrics in every row that succeeded); anything else is a one-line error that names
the file and the row, so that an edited or foreign file is never mixed into a study's results.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from sim.studies.results import (
    COLUMNS_ATTR,
    COMMAND_LINE_COLUMN,
    ERROR_COLUMN,
    KIND_NAMES,
    POINT_COLUMN,
    is_missing,
    value_kind,
)
from sim.studies.spec import StudySpec
from topologies.errors import TpusimError
from topologies.validate import short_repr

# A results row is a few KB (a train row with its per-kind collective summaries ~10 KB); a
# resumed file may hold at most this much per point of the study, uncompressed, so a small file
# that would expand into gigabytes (3 M copies of one row compress to 33 KB) is refused from its
# metadata before it is read.
MAX_RESULT_ROW_BYTES = 1 << 20


def load_previous(out: Path, study: StudySpec, points: list[dict[str, Any]],
                  argvs: list[list[str]]) -> dict[int, dict[str, Any]]:
    """`resume`: rows of results.parquet, by point index. They must be rows this study wrote:
    at most one per point, each with the point's own values, an error that is text or empty,
    plain finite values, and the study's metrics in every row that succeeded."""
    try:
        return _load_previous(out, study, points, argvs)
    except TpusimError as exc:
        # Its message names the settings `resume` and `out` as placeholders (`_load_previous`
        # and the row checks it calls).
        raise TpusimError(exc.template, *dict.fromkeys((*exc.params, "resume", "out"))) \
            from None


def _load_previous(out: Path, study: StudySpec, points: list[dict[str, Any]],
                   argvs: list[list[str]]) -> dict[int, dict[str, Any]]:
    path = out / "results.parquet"
    name = short_repr(str(path))
    fix = "delete it or use another {out}"
    if not path.exists():
        return {}
    if not path.is_file():
        raise TpusimError(f"{{resume}}: {name} is not a regular file (a directory, pipe or "
                          f"device), so it holds no results to resume; {fix}", "resume")
    try:
        meta = pq.ParquetFile(path).metadata
        n_rows = meta.num_rows
        n_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    except Exception as exc:
        raise TpusimError(f"{{resume}}: {name} cannot be read ({type(exc).__name__}); {fix}",
                          "resume") \
            from None
    if n_rows > len(argvs):
        raise TpusimError(f"{{resume}}: {name} holds {n_rows:,} rows but this study has "
                          f"{len(argvs):,} points (one row each); it is not this study's "
                          f"results: {fix}", "resume")
    if n_bytes > MAX_RESULT_ROW_BYTES * len(argvs):
        raise TpusimError(f"{{resume}}: {name} holds {n_bytes / 2**20:,.0f} MiB of data (the "
                          f"limit is {MAX_RESULT_ROW_BYTES >> 20} MiB per point of the study); it "
                          f"is not this study's results: {fix}", "resume")
    try:
        df = pd.read_parquet(path)
    except Exception as exc:
        raise TpusimError(f"{{resume}}: {name} cannot be read ({type(exc).__name__}); {fix}",
                          "resume") \
            from None
    if COMMAND_LINE_COLUMN not in df.columns:
        raise TpusimError(f"{{resume}}: {name} is not a tpusim sweep result (no "
                          f"{COMMAND_LINE_COLUMN} column); use another {{out}}", "resume", "out")
    index = {shlex.join(["tpusim", *a]): i for i, a in enumerate(argvs)}
    stray = [c for c in df[COMMAND_LINE_COLUMN] if not isinstance(c, str) or c not in index]
    if stray:
        raise TpusimError(
            f"{{resume}}: {name} holds {len(stray)} row(s) that are not points of this study "
            f"(e.g. {short_repr(stray[0])}); use another {{out}} for a different study",
            "resume", "out"
        )
    wanted = list(dict.fromkeys([*study.metrics, *(dict(p)["y"] for p in study.plots)]))
    absent = [m for m in wanted if m not in df.columns]
    if absent and len(df):
        raise TpusimError(
            f"{{resume}}: {name} has no column {short_repr(absent[0])} (a metric of the study); "
            f"if `tpusim {study.command}` returns it, the file was written by another study or "
            f"edited: {fix}", "resume")
    columns = _written_columns(df, name, fix)
    if columns is not None and len(df):
        added = [c for c in df.columns if c not in columns]
        dropped = [c for c in columns if c not in df.columns]
        if added or dropped:
            what = (f"a column tpusim did not write ({short_repr(added[0])})" if added else
                    f"no column {short_repr(dropped[0])}, which tpusim wrote")
            raise TpusimError(f"{{resume}}: {name} has {what}; the file was edited: {fix}",
                              "resume")
    prev: dict[int, dict[str, Any]] = {}
    for rec in df.to_dict("records"):
        rec = {k: (None if is_missing(v) else _plain(v)) for k, v in rec.items()}
        i = index[rec[COMMAND_LINE_COLUMN]]
        if i in prev:
            raise TpusimError(f"{{resume}}: {name} holds point {i} twice; {fix}", "resume")
        _check_resumed_row(study, points[i], rec, wanted, f"{{resume}}: {name} point {i}", fix)
        rec[POINT_COLUMN] = i
        # Keep empty cells too (e.g. inputs.flags.slice = None): dropping them would reorder
        # the columns of a resumed study against an uninterrupted one.
        prev[i] = rec
    # Then every row against the kinds of the columns as tpusim wrote them (where the file
    # records them): a column of numbers that now holds text, true/false or nothing.
    for i, rec in prev.items():
        _check_kinds(rec, columns or {}, f"{{resume}}: {name} point {i}", fix)
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
            and isinstance(v[0], str) and v[0] in KIND_NAMES
            and isinstance(v[1], bool) for k, v in rec.items()):
        raise TpusimError(f"{{resume}}: {name} has a malformed record of its columns "
                          f"({COLUMNS_ATTR}); the file was edited: {fix}", "resume")
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
        elif value_kind(v) != kind:
            raise TpusimError(f"{where}: {short_repr(k)} is {short_repr(v)}, but tpusim wrote "
                              f"{KIND_NAMES[kind]} in that column; the file was edited: {fix}")


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


__all__ = ["MAX_RESULT_ROW_BYTES", "load_previous"]
