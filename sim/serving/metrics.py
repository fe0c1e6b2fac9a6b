"""A serving run's statistics: latencies (TTFT, TPOT, end to end, queueing) as mean and
percentiles, throughput and goodput under an SLO, KV-cache use, batches, queues and whether
the queue grows without bound.

Definitions (as serving benchmarks use them): TTFT = first token - arrival; TPOT = (finish -
first token) / (output tokens - 1), for requests of two tokens or more; e2e = finish - arrival;
queue = first scheduled - arrival. Rates are counts over the run's span, from the first arrival
to the last finish. A request meets the SLO when its TTFT and its TPOT (if it has one) are
within their bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from topologies.errors import TpusimError
from topologies.validate import short_repr

_SLO_KEYS = ("ttft", "tpot")


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    """Latency bounds in seconds (None: not bounded)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


def parse_slo(text: str | None) -> Slo:
    """`ttft=0.5,tpot=0.05` (seconds; either may be left out)."""
    fix = "write e.g. {slo} ttft=0.5,tpot=0.05 (seconds)"  # `slo` placeholders, as below
    if text is None:
        return Slo()
    got: dict[str, float] = {}
    for item in str(text).split(","):
        key, eq, value = item.strip().partition("=")
        key = key.strip().lower()
        if not eq or key not in _SLO_KEYS:
            raise TpusimError(f"{{slo}} {short_repr(text)}: {short_repr(item.strip())} is not "
                              f"ttft=S or tpot=S; {fix}", "slo")
        if key in got:
            raise TpusimError(f"{{slo}} {short_repr(text)} gives {key} twice; {fix}", "slo")
        v = value.strip().lower().removesuffix("s")
        try:
            x = float(v)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x <= 0:
            raise TpusimError(f"{{slo}} {short_repr(text)}: {key} {short_repr(value.strip())} "
                              f"must be a finite number of seconds > 0; {fix}", "slo")
        got[key] = x
    return Slo(ttft_s=got.get("ttft"), tpot_s=got.get("tpot"))


def percentiles(x: np.ndarray) -> dict[str, float | None]:
    """{mean, p50, p90, p99} of the finite values (None for none)."""
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p[0]), "p90": float(p[1]),
            "p99": float(p[2])}


def latencies(req: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT, e2e and queueing delay (NaN where undefined)."""
    out_tok = req["output_tokens"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tok > 1, (req["finish_s"] - req["first_token_s"]) / (out_tok - 1),
                        np.nan)
    return {"ttft_s": req["first_token_s"] - req["arrival_s"], "tpot_s": tpot,
            "e2e_s": req["finish_s"] - req["arrival_s"],
            "queue_s": req["scheduled_s"] - req["arrival_s"]}


def queue_stats(events: list[tuple], end_s: float) -> dict[str, float]:
    """Time-averaged and largest number of requests waiting, over [0, end_s] (`events`:
    (time, +1 or -1, ...) in time order)."""
    if not events or end_s <= 0:
        return {"mean": 0.0, "max": 0}
    t = np.fromiter((e[0] for e in events), dtype=np.float64, count=len(events))
    d = np.fromiter((e[1] for e in events), dtype=np.int64, count=len(events))
    q = np.cumsum(d)
    dt = np.diff(np.append(t, end_s))
    return {"mean": float((q * dt).sum() / end_s), "max": int(q.max())}


def summarize(sim, *, slo: Slo, num_chips: int, kv_blocks: list[int],
              max_batch: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The result fields of a finished `ServingSim`, and its per-request arrays."""
    req = sim.request_arrays()
    lat = latencies(req)
    n = int(req["arrival_s"].size)
    t0 = float(req["arrival_s"][0])
    t_end = float(np.nanmax(req["finish_s"]))
    span = max(t_end - t0, 1e-30)
    out_tokens = int(req["output_tokens"].sum())
    ok = np.ones(n, dtype=bool)
    if slo.ttft_s is not None:
        ok &= lat["ttft_s"] <= slo.ttft_s
    if slo.tpot_s is not None:
        ok &= ~(lat["tpot_s"] > slo.tpot_s)  # NaN (one-token requests) has no TPOT to miss
    good = int(ok.sum())
    its = sim.iterations
    dur = its.column("duration_s")
    batch = its.column("decode_batch").astype(np.float64)
    used = its.column("kv_blocks_used").astype(np.float64)
    rep_idx = its.column("replica")
    blocks = np.asarray(kv_blocks, dtype=np.float64)
    kv_util = float((used * dur / blocks[rep_idx]).sum() / (span * len(blocks))) \
        if len(its) else 0.0
    dec = batch > 0
    # Backlog when the last request arrives: requests in the system then. A stable system
    # holds a bounded number (about its batch slots); one past saturation, a share of all.
    t_last = float(req["arrival_s"][-1])
    backlog = int(np.sum(req["finish_s"] > t_last))
    slots = max_batch * len(blocks)
    saturated = n >= 200 and backlog > max(4 * slots, n // 10)
    busy = [r.busy_s / span for r in sim.replicas]
    s: dict[str, Any] = {
        "num_requests": n,
        "ttft_s": percentiles(lat["ttft_s"]),
        "tpot_s": percentiles(lat["tpot_s"]),
        "e2e_s": percentiles(lat["e2e_s"]),
        "queue_s": percentiles(lat["queue_s"]),
        "throughput_requests_per_s": n / span,
        "throughput_tokens_per_s": out_tokens / span,
        "tokens_per_s_per_chip": out_tokens / span / num_chips,
        "goodput_requests_per_s": good / span,
        "slo_attainment": good / n,
        "slo": slo.to_dict(),
        "preemptions": int(sim.preemptions),
        "swap_tokens": int(sim.swap_tokens),
        "prefix_hit_tokens": int(sim.prefix_hit_tokens),
        "kv_utilization": kv_util,
        "sim_events": int(sim.events),
        "num_iterations": len(its),
        "span_s": span,
        "offered_rate_per_s": (n - 1) / (t_last - t0) if t_last > t0 else None,
        "batch": {**percentiles(batch[dec]), "max": int(batch.max()) if len(its) else 0},
        "queue_length": queue_stats(sim.queue_events, t_end),
        "replica_utilization": {"mean": float(np.mean(busy)), "min": float(np.min(busy)),
                                "max": float(np.max(busy))},
        "backlog_at_last_arrival": backlog,
        "saturated": bool(saturated),
    }
    return s, {**req, **lat}
