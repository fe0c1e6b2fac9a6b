"""When the slice's parts fail: a stream of failure times (seconds from the job's start, wall
clock), each with what failed (a chip or a host) and which one.

Every chip fails at rate 1/chip MTBF and every host at 1/host MTBF, each an exponential clock;
their superposition over the slice is one Poisson process of rate chips/chip MTBF + hosts/host
MTBF (or 1/MTBF given for the whole slice), a failure being a chip's with probability
(chips/chip MTBF) / rate. A failed part is replaced (by a spare cube or by its repair) with a
part of the same rate, so the rate stays constant; parts already down keep their clock too (an
overstatement of the rate by the share of parts that are down, under 1% whenever fewer than 1
part in 100 is; docs/model/goodput.md). Failures arrive in wall time whatever the job is doing.

`PoissonFailures` draws the stream lazily in chunks of `CHUNK` from numpy generators seeded by
(seed, history index), gaps and labels from separate streams, so the n-th failure is the same
however far the stream is read. `TraceFailures` reads a CSV (header) or JSON-lines file of
`time_s` (and optional `kind`: chip or host, and `unit`: which one) row by row into typed
arrays, refused past `MAX_FAILURES` rows.
"""

from __future__ import annotations

import csv
import json
import math
import os
from array import array
from pathlib import Path

import numpy as np

from sim.reliability.config import CHIP, HOST, MAX_FAILURES, PART, FailureConfig, SliceInventory
from topologies.errors import TpusimError
from topologies.validate import short_repr

CHUNK = 4096
# A trace file may hold at most this many bytes (MAX_FAILURES rows of ~100 bytes).
MAX_TRACE_BYTES = 256 << 20
TRACE_COLUMNS = ("time_s",)
OPTIONAL_COLUMNS = ("kind", "unit")
_KINDS = {"chip": CHIP, "host": HOST}


class FailureStream:
    """Failure times (sorted), kinds and units; `ensure(n)` makes at least `n` available
    unless the stream ends first (`finite` streams end)."""

    finite = False

    def __init__(self) -> None:
        self.times = np.empty(0)
        self.kinds = np.empty(0, dtype=np.int8)
        self.units = np.empty(0, dtype=np.int64)

    def ensure(self, n: int) -> int:
        return self.times.size

    def time(self, i: int) -> float:
        """The i-th failure's time, or infinity past the end of a finite stream; a drawn
        stream refuses to go past `MAX_FAILURES` (`TooManyFailures`)."""
        if i >= self.times.size and self.ensure(i + 1) <= i:
            if not self.finite:
                raise TooManyFailures(f"{MAX_FAILURES:,} failures")
            return math.inf
        if i >= MAX_FAILURES and not self.finite:
            raise TooManyFailures(f"{MAX_FAILURES:,} failures")
        return float(self.times[i])


class TooManyFailures(TpusimError):
    """A history needed more than `MAX_FAILURES` failures (the caller says of what)."""


class PoissonFailures(FailureStream):
    """Poisson arrivals at `rate_per_s`, seeded by (`seed`, `index`)."""

    def __init__(self, failures: FailureConfig, inventory: SliceInventory, *, seed: int,
                 index: int) -> None:
        super().__init__()
        ss = np.random.SeedSequence(entropy=seed, spawn_key=(index,))
        gaps_ss, labels_ss = ss.spawn(2)
        self._gaps = np.random.Generator(np.random.PCG64(gaps_ss))
        self._labels = np.random.Generator(np.random.PCG64(labels_ss))
        self._mean_gap = 1.0 / failures.rate_per_s
        self._chip_share = failures.chip_share
        self._counts = (max(inventory.num_chips, 1), max(inventory.num_hosts, 1))
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._last = 0.0

    def ensure(self, n: int) -> int:
        if n <= self.times.size:
            return self.times.size
        # At least double what is drawn (each call concatenates everything drawn so far).
        n = min(max(n, 2 * self.times.size, CHUNK), MAX_FAILURES)
        drawn = self.times.size
        while drawn < n:
            gaps = self._gaps.exponential(self._mean_gap, CHUNK)
            u = self._labels.random(CHUNK)
            v = self._labels.random(CHUNK)
            t = self._last + np.cumsum(gaps)
            self._last = float(t[-1])
            if self._chip_share is None:  # one rate for the slice: parts not told apart
                kinds = np.full(CHUNK, PART, dtype=np.int8)
                units = np.full(CHUNK, -1, dtype=np.int64)
            else:
                kinds = np.where(u < self._chip_share, CHIP, HOST).astype(np.int8)
                count = np.where(kinds == CHIP, self._counts[0], self._counts[1])
                units = np.minimum((v * count).astype(np.int64), count - 1)
            self._parts.append((t, kinds, units))
            drawn += CHUNK
        self.times = np.concatenate([p[0] for p in self._parts])
        self.kinds = np.concatenate([p[1] for p in self._parts])
        self.units = np.concatenate([p[2] for p in self._parts])
        return self.times.size


class TraceFailures(FailureStream):
    """The failures listed in a trace file (all read up front, row by row)."""

    finite = True

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.times, self.kinds, self.units = read_failure_trace(Path(path))


def failure_stream(failures: FailureConfig, inventory: SliceInventory, *, seed: int,
                   index: int) -> FailureStream:
    """The failures of history `index`: drawn, or the trace's (one history)."""
    if failures.trace is not None:
        return TraceFailures(failures.trace)
    return PoissonFailures(failures, inventory, seed=seed, index=index)


# -- trace files -------------------------------------------------------------------------------
_FIX = "fix the failure trace"


def _time(value, where: str) -> float:
    try:
        v = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise TpusimError(f"{where}: time_s {short_repr(value)} is not a finite number >= 0 "
                          f"(seconds from the job's start); {_FIX}", "failure_trace")
    return v


def _kind(value, where: str) -> int:
    if value is None or (isinstance(value, str) and not value.strip()):
        return PART
    k = _KINDS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if k is None:
        raise TpusimError(f"{where}: kind {short_repr(value)} is not chip or host; {_FIX} "
                          f"(or leave the column out)", "failure_trace")
    return k


def _unit(value, where: str) -> int:
    if value is None or (isinstance(value, str) and not value.strip()):
        return -1
    v = value
    if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():
        v = int(v.strip())
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 40:
        raise TpusimError(f"{where}: unit {short_repr(value)} is not a whole number >= 0 (the "
                          f"chip's or host's index); {_FIX}", "failure_trace")
    return v


def _rows(path: Path):
    """(line number, {column: value}) of a CSV (header first) or JSON-lines file, streamed."""
    name = path.name
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson", ".json")
    try:
        f = path.open("r", encoding="utf-8", newline="")
    except OSError as exc:
        raise TpusimError(f"{{failure_trace}} {str(path)!r}: cannot read it "
                          f"({exc.strerror or exc}); give a CSV or JSON-lines file",
                          "failure_trace") from None
    with f:
        if jsonl:
            try:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError:
                        row = None
                    if not isinstance(row, dict):
                        raise TpusimError(f"{{failure_trace}} {name} line {i}: not a JSON object; "
                                          f"write one object per line, e.g. "
                                          f'{{"time_s": 3600, "kind": "host"}}', "failure_trace")
                    if "time_s" not in row:
                        raise TpusimError(f"{{failure_trace}} {name} line {i}: no time_s; every "
                                          f"row needs time_s (seconds from the job's start)",
                                          "failure_trace")
                    yield i, row
            except UnicodeDecodeError:
                raise TpusimError(f"{{failure_trace}} {name} is not UTF-8 text; give a CSV or "
                                  f"JSON-lines file", "failure_trace") from None
            return
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TpusimError(f"{{failure_trace}} {name} is empty; give a header line time_s "
                              f"(optional kind, unit) and one row per failure",
                              "failure_trace") from None
        except (csv.Error, UnicodeDecodeError):
            raise TpusimError(f"{{failure_trace}} {name} is not a CSV file; give a header "
                              f"time_s (optional kind, unit)", "failure_trace") from None
        if "time_s" not in header:
            raise TpusimError(f"{{failure_trace}} {name}: the header "
                              f"{short_repr(','.join(header))} lacks time_s; it needs time_s "
                              f"(optional "
                              f"{', '.join(OPTIONAL_COLUMNS)})", "failure_trace")
        index = {c: header.index(c) for c in (*TRACE_COLUMNS, *OPTIONAL_COLUMNS) if c in header}
        try:
            for i, rec in enumerate(reader, 2):
                if not rec or all(not x.strip() for x in rec):
                    continue
                if len(rec) != len(header):
                    raise TpusimError(f"{{failure_trace}} {name} line {i}: {len(rec)} fields, the "
                                      f"header has {len(header)}; fix the row", "failure_trace")
                yield i, {c: rec[j] for c, j in index.items()}
        except (csv.Error, UnicodeDecodeError):
            raise TpusimError(f"{{failure_trace}} {name}: not a readable CSV file; give a header "
                              f"time_s and one row per failure", "failure_trace") from None


def read_failure_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, kinds, units) of a failure trace, checked row by row (sorted by time_s,
    finite, >= 0; at most `MAX_FAILURES` rows). A trace with a header and no rows is a job
    without failures."""
    if path.is_dir():
        raise TpusimError(f"{{failure_trace}} {str(path)!r} is a directory; give a CSV or "
                          f"JSON-lines file", "failure_trace")
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise TpusimError(f"{{failure_trace}} {str(path)!r}: cannot read it "
                          f"({exc.strerror or exc}); give a CSV or JSON-lines file",
                          "failure_trace") from None
    if size > MAX_TRACE_BYTES:
        raise TpusimError(f"{{failure_trace}} {path.name} is {size:,} bytes, over the "
                          f"{MAX_TRACE_BYTES:,} a failure trace may hold; cut it to the job's "
                          f"span", "failure_trace")
    times, kinds, units = array("d"), array("b"), array("q")
    last = 0.0
    for i, row in _rows(path):
        where = f"{{failure_trace}} {path.name} line {i}"  # the setting's placeholder
        t = _time(row["time_s"], where)
        if t < last:
            raise TpusimError(f"{where}: time_s {t:g} is before the previous row's {last:g}; "
                              f"sort the trace by time_s", "failure_trace")
        if len(times) >= MAX_FAILURES:
            raise TpusimError(f"{{failure_trace}} {path.name} has more than {MAX_FAILURES:,} "
                              f"rows, the most one history simulates; cut the trace",
                              "failure_trace")
        last = t
        times.append(t)
        kinds.append(_kind(row.get("kind"), where))
        units.append(_unit(row.get("unit"), where))
    return (np.frombuffer(times, dtype=np.float64).copy(),
            np.frombuffer(kinds, dtype=np.int8).copy(),
            np.frombuffer(units, dtype=np.int64).copy())
