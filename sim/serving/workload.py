"""The requests a serving run sees: arrival times and prompt and output lengths.

Arrivals are a Poisson process at a rate, a gamma renewal process with a given coefficient of
variation of the gaps (CV 1 is Poisson; above 1, bursty), or read from a trace file (CSV with a
header, or JSON lines) with columns `arrival_s`, `prompt_tokens`, `output_tokens` and optional
`prefix_id` (requests with one id share a prompt prefix: a system prompt, an earlier turn) and
`prefix_tokens` (how many of the prompt's tokens that prefix is; without it, the prompt of the
first request with that id). Lengths are `fixed:N`, `uniform:A,B` (whole numbers, both ends
included) or `lognormal:MEAN,SIGMA` (MEAN the mean in tokens, SIGMA the log-sd; rounded, at
least 1). One numpy `Generator(PCG64(seed))` draws everything, in a fixed order (gaps, then
prompts, then outputs), so a seed gives the same requests on every machine. A trace file is
read line by line into typed arrays (about 40 bytes a row), and refused past `MAX_REQUESTS`
rows.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from topologies.errors import TpusimError
from topologies.validate import MAX_TOKENS, short_repr, subject

# The most requests one run simulates (a trace is refused past it, before it is all read):
# about 0.3 GB of per-request state, and tens of minutes of simulation.
MAX_REQUESTS = 10_000_000
_TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
_OPTIONAL_COLUMNS = ("prefix_id", "prefix_tokens")


class ArrivalKind(StrEnum):
    POISSON = "poisson"
    GAMMA = "gamma"
    TRACE = "trace"


class LengthKind(StrEnum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthSpec:
    """A distribution of token counts: `fixed` (a), `uniform` (a..b) or `lognormal` (mean a,
    log-sd b)."""

    kind: LengthKind
    a: float
    b: float = 0.0

    def describe(self) -> str:
        if self.kind is LengthKind.FIXED:
            return f"fixed:{int(self.a)}"
        if self.kind is LengthKind.UNIFORM:
            return f"uniform:{int(self.a)},{int(self.b)}"
        return f"lognormal:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        if self.kind is LengthKind.UNIFORM:
            return (self.a + self.b) / 2
        return float(self.a)

    @property
    def max_tokens(self) -> int | None:
        """The largest length it can draw (None: unbounded, lognormal)."""
        if self.kind is LengthKind.FIXED:
            return int(self.a)
        if self.kind is LengthKind.UNIFORM:
            return int(self.b)
        return None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind is LengthKind.FIXED:
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind is LengthKind.UNIFORM:
            return rng.integers(int(self.a), int(self.b) + 1, size=n, dtype=np.int64)
        # The underlying normal's mean that gives the distribution mean `a`.
        mu = math.log(self.a) - self.b ** 2 / 2
        x = np.rint(rng.lognormal(mu, self.b, size=n))
        return np.clip(x, 1, MAX_TOKENS).astype(np.int64)


def parse_lengths(text: str, name: str) -> LengthSpec:
    """`fixed:N`, `uniform:A,B` or `lognormal:MEAN,SIGMA` (one-line errors naming the setting
    `name`, a Python argument name: `topologies.validate.subject`)."""
    flag, params = subject(name)
    fix = f"write e.g. {flag} fixed:512, uniform:100,2000 or lognormal:1000,0.8"
    if not isinstance(text, str) or ":" not in text:
        raise TpusimError(f"{flag} {short_repr(text)} is not a distribution; {fix}", *params)
    kind_text, _, rest = text.strip().partition(":")
    try:
        kind = LengthKind(kind_text.strip().lower())
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)}: unknown distribution "
                          f"{short_repr(kind_text)}; {fix}", *params) from None
    parts = [p.strip() for p in rest.split(",")]
    want = 1 if kind is LengthKind.FIXED else 2
    if len(parts) != want:
        raise TpusimError(f"{flag} {short_repr(text)}: {kind} takes {want} number(s); {fix}",
                          *params)
    if kind is LengthKind.LOGNORMAL:
        try:
            mean, sigma = float(parts[0]), float(parts[1])
        except ValueError:
            raise TpusimError(f"{flag} {short_repr(text)}: MEAN and SIGMA must be numbers; "
                              f"{fix}", *params) from None
        if not (math.isfinite(mean) and 1 <= mean <= MAX_TOKENS):
            raise TpusimError(f"{flag} {short_repr(text)}: MEAN must be in [1, {MAX_TOKENS:,}] "
                              f"tokens; {fix}", *params)
        if not (math.isfinite(sigma) and 0 <= sigma <= 4):
            raise TpusimError(f"{flag} {short_repr(text)}: SIGMA (the log-sd) must be in "
                              f"[0, 4]; {fix}", *params)
        return LengthSpec(kind=kind, a=mean, b=sigma)
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)}: token counts must be whole numbers; "
                          f"{fix}", *params) from None
    if any(not 1 <= v <= MAX_TOKENS for v in nums):
        raise TpusimError(f"{flag} {short_repr(text)}: token counts must be in "
                          f"[1, {MAX_TOKENS:,}]; {fix}", *params)
    if kind is LengthKind.UNIFORM and nums[0] > nums[1]:
        raise TpusimError(f"{flag} {short_repr(text)}: A must be <= B; {fix}", *params)
    return LengthSpec(kind=kind, a=float(nums[0]), b=float(nums[-1]))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    """How requests arrive and how long they are (`ServeRequest`'s workload settings)."""

    arrival: ArrivalKind = ArrivalKind.POISSON
    rate_per_s: float | None = None
    cv: float = 1.0
    trace: str | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    prompt_tokens: LengthSpec | None = None
    output_tokens: LengthSpec | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The requests, in arrival order: parallel arrays (seconds, tokens; prefix -1 = none;
    prefix tokens -1 = not given, None: no column)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_id: np.ndarray
    prefix_tokens: np.ndarray | None = None

    def prefix_lengths(self) -> np.ndarray:
        """Each request's shared prefix in tokens (0 without a prefix): its `prefix_tokens`,
        or the prompt of the first request with its `prefix_id`, at most its own prompt."""
        n = self.num_requests
        out = np.zeros(n, dtype=np.int64)
        first: dict[int, int] = {}
        ids, prompts = self.prefix_id.tolist(), self.prompt_tokens.tolist()
        given = self.prefix_tokens.tolist() if self.prefix_tokens is not None else [-1] * n
        for i in range(n):
            pid = ids[i]
            if pid < 0:
                continue
            length = given[i] if given[i] >= 0 else first.setdefault(pid, prompts[i])
            out[i] = min(length, prompts[i])
        return out

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.size)


def _gaps(cfg: WorkloadConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    rate = float(cfg.rate_per_s)
    if cfg.arrival is ArrivalKind.POISSON:
        return rng.exponential(1.0 / rate, size=n)
    shape = 1.0 / cfg.cv ** 2  # gamma gaps of mean 1/rate and CV `cv`
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def generate(cfg: WorkloadConfig) -> Workload:
    """The requests of `cfg` (a trace file read, or arrivals and lengths drawn)."""
    if cfg.arrival is ArrivalKind.TRACE:
        return read_trace(Path(cfg.trace), num_requests=cfg.num_requests,
                          duration_s=cfg.duration_s)
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    if cfg.num_requests is not None:
        n = cfg.num_requests
        # The first request arrives at 0: a run starts with work, and its span is the
        # requests' own.
        t = np.concatenate(([0.0], np.cumsum(_gaps(cfg, rng, n - 1))))
    else:
        # Draw gaps in blocks until past the duration (the same draws as one long block).
        expect = cfg.duration_s * cfg.rate_per_s
        if expect > MAX_REQUESTS:
            raise TpusimError(
                f"{{duration}} {cfg.duration_s:g} s at {{rate}} {cfg.rate_per_s:g} is about "
                f"{expect:,.0f} requests, over the limit of {MAX_REQUESTS:,}; give a shorter "
                f"{{duration}} or {{requests}} N", "duration", "rate", "requests")
        parts, end, total = [np.zeros(1)], 0.0, 1
        block = max(int(expect * 1.1) + 16, 64)
        while end <= cfg.duration_s and total <= MAX_REQUESTS:
            g = np.cumsum(_gaps(cfg, rng, block)) + end
            parts.append(g)
            end = float(g[-1])
            total += block
        t = np.concatenate(parts)
        t = t[t < cfg.duration_s]
        n = int(t.size)
        if n > MAX_REQUESTS:
            raise TpusimError(f"{{duration}} {cfg.duration_s:g} s draws {n:,} requests, over the "
                              f"limit of {MAX_REQUESTS:,}; give a shorter {{duration}}",
                              "duration")
    prompts = cfg.prompt_tokens.sample(rng, n)
    outputs = cfg.output_tokens.sample(rng, n)
    return Workload(arrival_s=t, prompt_tokens=prompts, output_tokens=outputs,
                    prefix_id=np.full(n, -1, dtype=np.int64))


# -- trace files ------------------------------------------------------------------------------
def _whole(given, column: str, where: str, lo: int) -> int:
    value = None if isinstance(given, bool) else given
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isascii() and text.isdigit() else None
    if not isinstance(value, int) or value < lo or value > MAX_TOKENS:
        raise TpusimError(f"{where}: {column} {short_repr(given)} is not a whole number in "
                          f"[{lo}, {MAX_TOKENS:,}]; fix the trace file", "trace")
    return value


def _number(value, where: str) -> float:
    try:
        v = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise TpusimError(f"{where}: arrival_s {short_repr(value)} is not a finite number "
                          f">= 0 (seconds); fix the trace file", "trace")
    return v


def _rows(path: Path):
    """(line number, {column: value}) of a CSV (header first) or JSON-lines file, streamed."""
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson", ".json")
    try:
        f = path.open("r", encoding="utf-8", newline="")
    except OSError as exc:
        raise TpusimError(f"{{trace}} {str(path)!r}: cannot read it ({exc.strerror or exc}); "
                          f"give a CSV or JSON-lines file", "trace") from None
    with f:
        if jsonl:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise TpusimError(f"{{trace}} {path.name} line {i}: not a JSON object; "
                                      f"write one object per line", "trace") from None
                if not isinstance(row, dict):
                    raise TpusimError(f"{{trace}} {path.name} line {i}: not a JSON object; "
                                      f"write one object per line", "trace")
                missing = [c for c in _TRACE_COLUMNS if c not in row]
                if missing:
                    raise TpusimError(f"{{trace}} {path.name} line {i}: missing "
                                      f"{', '.join(missing)}; every row needs "
                                      f"{', '.join(_TRACE_COLUMNS)}", "trace")
                yield i, row
            return
        import csv

        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TpusimError(f"{{trace}} {path.name} is empty; give a header line "
                              f"{','.join(_TRACE_COLUMNS)} and one row per request",
                              "trace") from None
        except (csv.Error, UnicodeDecodeError):
            raise TpusimError(f"{{trace}} {path.name} is not a CSV file; give a header "
                              f"{','.join(_TRACE_COLUMNS)}", "trace") from None
        missing = [c for c in _TRACE_COLUMNS if c not in header]
        if missing:
            raise TpusimError(f"{{trace}} {path.name}: the header lacks column(s) "
                              f"{', '.join(missing)}; it needs {', '.join(_TRACE_COLUMNS)} "
                              f"(optional {', '.join(_OPTIONAL_COLUMNS)})", "trace")
        index = {c: header.index(c) for c in (*_TRACE_COLUMNS, *_OPTIONAL_COLUMNS)
                 if c in header}
        try:
            for i, rec in enumerate(reader, 2):
                if not rec or all(not x.strip() for x in rec):
                    continue
                if len(rec) != len(header):
                    raise TpusimError(f"{{trace}} {path.name} line {i}: {len(rec)} fields, the "
                                      f"header has {len(header)}; fix the row", "trace")
                yield i, {c: rec[j] for c, j in index.items()}
        except (csv.Error, UnicodeDecodeError):
            raise TpusimError(f"{{trace}} {path.name}: not a readable CSV file; give a header "
                              f"{','.join(_TRACE_COLUMNS)} and one row per request",
                              "trace") from None


def read_trace(path: Path, *, num_requests: int | None = None,
               duration_s: float | None = None) -> Workload:
    """A trace file's requests (the first `num_requests`, or those arriving before
    `duration_s`), streamed: rows are checked as they are read and held as typed arrays."""
    if path.is_dir():
        raise TpusimError(f"{{trace}} {str(path)!r} is a directory; give a CSV or JSON-lines "
                          f"file", "trace")
    arr, pro, out, pre, ptok = array("d"), array("q"), array("q"), array("q"), array("q")
    last = 0.0
    for i, row in _rows(path):
        where = f"{{trace}} {path.name} line {i}"  # the `trace` placeholder
        t = _number(row["arrival_s"], where)
        if t < last:
            raise TpusimError(f"{where}: arrival_s {t:g} is before the previous row's "
                              f"{last:g}; sort the trace by arrival_s", "trace")
        if duration_s is not None and t >= duration_s:
            break
        if len(arr) >= MAX_REQUESTS:
            raise TpusimError(f"{{trace}} {path.name} has more than {MAX_REQUESTS:,} rows, the "
                              f"most one run simulates; cut the trace or give {{requests}} N",
                              "trace", "requests")
        last = t
        arr.append(t)
        pro.append(_whole(row["prompt_tokens"], "prompt_tokens", where, 1))
        out.append(_whole(row["output_tokens"], "output_tokens", where, 1))
        p = row.get("prefix_id")
        pre.append(-1 if p is None or (isinstance(p, str) and not p.strip())
                   else _whole(p, "prefix_id", where, 0))
        k = row.get("prefix_tokens")
        ptok.append(-1 if k is None or (isinstance(k, str) and not k.strip())
                    else _whole(k, "prefix_tokens", where, 0))
        if num_requests is not None and len(arr) >= num_requests:
            break
    if not arr:
        raise TpusimError(f"{{trace}} {path.name} holds no requests"
                          + (f" before {{duration}} {duration_s:g} s" if duration_s else "")
                          + f"; give rows {','.join(_TRACE_COLUMNS)}", "trace", "duration")
    return Workload(arrival_s=np.frombuffer(arr, dtype=np.float64).copy(),
                    prompt_tokens=np.frombuffer(pro, dtype=np.int64).copy(),
                    output_tokens=np.frombuffer(out, dtype=np.int64).copy(),
                    prefix_id=np.frombuffer(pre, dtype=np.int64).copy(),
                    prefix_tokens=np.frombuffer(ptok, dtype=np.int64).copy())
