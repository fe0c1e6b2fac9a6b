"""A goodput run: `seeds` failure histories, the checkpoint interval searched for (or given),
every seed's outcome at that interval, and the summary with 95% confidence intervals over the
seeds (Student's t; none for one seed).

The interval that maximises the mean goodput over the seeds is searched on the same histories
(common random numbers: every interval sees the same failures, so the comparison is not
noise). A steps job's history is drawn as far as the job needs: the reference interval (the
given one, else Young-Daly's) as far as it takes to finish, other candidates to 1.5x the
shortest wall time any interval has reached on that history (a candidate that has not finished
by then has under 2/3 of the best goodput on that seed and is left out of the search). A job
whose pace says it would need more than `MAX_FAILURES` failures to finish is refused once it
has seen `PACE_CHECK_FAILURES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.reliability.config import MAX_FAILURES, Engine, GoodputConfig
from sim.reliability.failures import TooManyFailures, failure_stream
from sim.reliability.history import History, HistoryBuilder
from sim.reliability.job import (
    LOST_CAUSES,
    Outcome,
    committed_steps,
    daly_s,
    evaluate,
    search,
    timeline,
    young_daly_s,
)
from sim.reliability.stats import mean_ci
from topologies.errors import TpusimError
from topologies.progress import task

# A search candidate is followed up to this multiple of the shortest wall time any interval
# has reached on the same history.
SEARCH_WALL_FACTOR = 1.5
# Past this many failures, a history is checked for whether the job can finish within
# MAX_FAILURES at the pace it has made so far (a hopeless job is refused early, not at the cap).
PACE_CHECK_FAILURES = 20_000
# A history too short for the job grows by this factor of wall time at a time.
GROWTH = 1.25
# At most this many failures over all seeds of a run (about 10-30 s of CPU), and this many
# SimPy events (failures and checkpoints) for the oracle, which takes ~100 us an event.
MAX_TOTAL_FAILURES = 10_000_000
MAX_SIMPY_EVENTS = 2_000_000
# Seed 0's timeline (the exports) is drawn for at most this many failures.
MAX_TIMELINE_FAILURES = 200_000


@dataclass(slots=True)
class _Seed:
    builder: HistoryBuilder
    limit_s: float = math.inf
    outcomes: dict[int, Outcome | None] = field(default_factory=dict)

    def outcome(self, cfg: GoodputConfig, k: int, *, bounded: bool) -> Outcome | None:
        if k in self.outcomes:
            return self.outcomes[k]
        job = cfg.job
        hist = self.builder.history()
        while True:
            out = evaluate(hist, job, k)
            if out is not None or self.builder.done:
                break
            reach = max(hist.span_s, self.builder.ws)
            if bounded and reach > self.limit_s:
                break
            seen = int(hist.failures_before[-1]) if hist.size else 0
            if seen >= PACE_CHECK_FAILURES:
                done = committed_steps(hist, job, k)
                if done <= 0 or seen * job.steps / done > MAX_FAILURES:
                    raise TooManyFailures(f"{MAX_FAILURES:,} failures")
            # Grow the history by a quarter (the job takes at least its own length).
            until = max(GROWTH * reach, GROWTH * job.length_s)
            if bounded:
                until = min(until, self.limit_s)
            hist = self.builder.extend(hist.size + 1 if until <= reach else 1 << 62, until)
        if out is not None:
            self.limit_s = min(self.limit_s, SEARCH_WALL_FACTOR * out.wall_s)
        self.outcomes[k] = out
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputOutcome:
    """What a run found: the summary fields, every seed's outcome at the interval used
    (`interval_steps`), the search (interval in steps -> mean goodput, None where the job had
    not finished), seed 0's history, and (SimPy engine) seed 0's events as it logged them;
    `timeline()` gives seed 0's events for the exports either way."""

    cfg: GoodputConfig
    interval_steps: int
    summary: dict[str, Any]
    outcomes: list[Outcome]
    search: dict[int, float | None]
    history: History
    events: list[tuple]

    def timeline(self) -> list[tuple]:
        """Seed 0's job as `(start_s, end_s, kind, detail)` events, sorted by time: the
        SimPy engine's log, or seed 0's history drawn again with its downtime logged and the
        checkpoints added in closed form (the same draws: the same history)."""
        if self.events:
            return self.events
        first = self.outcomes[0]
        if first.failures > MAX_TIMELINE_FAILURES:
            raise TpusimError(
                f"seed 0 saw {first.failures:,} failures; the timeline ({{plots}}, {{perfetto}}, "
                f"{{out}} events) draws at most {MAX_TIMELINE_FAILURES:,}: simulate a shorter job "
                f"or a longer MTBF for the exports", "plots", "perfetto", "out")
        cfg = self.cfg
        b = HistoryBuilder(failure_stream(cfg.failures, cfg.inventory, seed=cfg.seed, index=0),
                           cfg.job, cfg.inventory, cfg.failures, log=True)
        k = self.interval_steps
        if cfg.job.steps is None:
            hist = b.run()
            out = evaluate(hist, cfg.job, k)
        else:
            hist = b.extend(max(self.history.size, 1))
            out = evaluate(hist, cfg.job, k)
            while out is None:
                hist = b.extend(2 * hist.size)
                out = evaluate(hist, cfg.job, k)
        events, _coarse = timeline(hist, b.events or [], cfg.job, k, out)
        return events


def _too_many(cfg: GoodputConfig, k: int | None, exc: TooManyFailures) -> TpusimError:
    m = cfg.failures.mtbf_s
    every = f"the slice fails every {m:,.4g} s on average" if m else "the slice fails often"
    where = (f" (checkpointing every {k * cfg.job.step_time_s:,.6g} s)" if k is not None
             else "")
    return TpusimError(
        f"the job does not finish within {exc}{where}: {every}, against restarts of "
        f"{cfg.job.restart_cost_s:g} s and a job of {cfg.job.length_s:,.6g} s; give a longer "
        f"MTBF, a shorter job, or cheaper restarts (or leave {{checkpoint_interval}} out)",
        "checkpoint_interval")


def _budget(cfg: GoodputConfig, per_seed: float) -> None:
    total = per_seed * cfg.seeds
    if total > MAX_TOTAL_FAILURES:
        raise TpusimError(
            f"{cfg.seeds} seeds of about {per_seed:,.0f} failures each is {total:,.0f} "
            f"failures, over the {MAX_TOTAL_FAILURES:,} one run simulates; give fewer {{seeds}}, "
            f"a shorter job or a longer MTBF", "seeds")


def simulate_goodput(cfg: GoodputConfig, *, log: bool = True) -> GoodputOutcome:
    """Run `cfg`: the summary (see docs/results.md, goodput) and the outcomes behind it
    (`log`: the SimPy engine keeps seed 0's events)."""
    job, fail = cfg.job, cfg.failures
    if job.horizon_s is not None and fail.rate_per_s is not None:
        expected = fail.rate_per_s * job.horizon_s
        if expected > MAX_FAILURES:
            raise TpusimError(
                f"{job.horizon_s / 3600:g} hours at one failure every "
                f"{1 / fail.rate_per_s:,.4g} s is about {expected:,.0f} failures, over the "
                f"{MAX_FAILURES:,} one history may hold; give a shorter {{hours}} or a longer "
                f"MTBF", "hours")
        _budget(cfg, expected)
    with task("goodput", total=cfg.seeds, unit="history") as progress:
        k, best_k, curve, outcomes, hist0, events = _run(cfg, progress, log)
    mtbf = fail.mtbf_s
    yd = young_daly_s(job.checkpoint_cost_s, mtbf) if mtbf else None
    summary = _summary(cfg, k, best_k, curve, outcomes, yd, mtbf)
    return GoodputOutcome(cfg=cfg, interval_steps=k, summary=summary, outcomes=outcomes,
                          search=curve, history=hist0, events=events)


def _run(cfg: GoodputConfig, progress, log: bool):
    """The histories, the search and the outcomes at the interval used (see
    `simulate_goodput`); `progress` counts the histories, then the SimPy runs."""
    job, inv, fail = cfg.job, cfg.inventory, cfg.failures
    seeds = [_Seed(HistoryBuilder(failure_stream(fail, inv, seed=cfg.seed, index=i), job, inv,
                                  fail))
             for i in range(cfg.seeds)]
    k_max = job.max_interval_steps
    mtbf = fail.mtbf_s
    yd = young_daly_s(job.checkpoint_cost_s, mtbf) if mtbf else None
    yd_k = cfg.interval_steps(yd) if yd else None
    given_k = cfg.interval_steps(cfg.checkpoint_interval_s) \
        if cfg.checkpoint_interval_s is not None else None
    ref_k = given_k or yd_k or k_max
    try:
        if job.steps is None:
            for sd in seeds:
                sd.builder.run()
        for i, sd in enumerate(seeds):
            out = sd.outcome(cfg, ref_k, bounded=False)
            if i == 0 and job.steps is not None:
                _budget(cfg, out.failures)
            progress.advance()
    except TooManyFailures as exc:
        raise _too_many(cfg, ref_k, exc) from None

    def mean_goodput(k: int) -> float | None:
        try:
            outs = [sd.outcome(cfg, k, bounded=True) for sd in seeds]
        except TooManyFailures:
            return None
        if any(o is None for o in outs):
            return None
        return float(np.mean([o.goodput for o in outs]))

    progress.update(detail="searching the checkpoint interval", force=True)
    best_k, curve = search(mean_goodput, k_max, hints=tuple(k for k in (ref_k, yd_k) if k))
    k = given_k if given_k is not None else best_k
    outcomes = [sd.outcome(cfg, k, bounded=False) for sd in seeds]
    hist0 = seeds[0].builder.history()
    events: list[tuple] = []
    if cfg.engine is Engine.SIMPY:
        # deferred: the SimPy oracle (and simpy) loads only when engine="simpy" asks for it
        from sim.reliability.reference import simulate as simulate_simpy

        events_n = sum(o.failures + o.checkpoints for o in outcomes)
        if events_n > MAX_SIMPY_EVENTS:
            raise TpusimError(
                f"{{engine}} simpy would simulate {events_n:,} failures and checkpoints, over "
                f"the {MAX_SIMPY_EVENTS:,} the oracle takes (about 100 us each); use the "
                f"default engine (the same numbers) or fewer {{seeds}}", "engine", "seeds")

        sim_outs = []
        progress.update(0, detail="SimPy engine", force=True)
        for i in range(cfg.seeds):
            stream = failure_stream(fail, inv, seed=cfg.seed, index=i)
            out, ev = simulate_simpy(stream, job, inv, fail, k, log=(i == 0 and log))
            sim_outs.append(out)
            progress.advance()
            if i == 0:
                events = ev
        outcomes = sim_outs
    return k, best_k, curve, outcomes, hist0, events


def _ci(values: list[float], hi_bound: float = math.inf) -> dict[str, float | None]:
    """The 95% interval of the mean, clipped to the quantity's range ([0, hi_bound])."""
    lo, hi = mean_ci(values)
    if lo is None:
        return {"low": None, "high": None}
    return {"low": min(max(lo, 0.0), hi_bound), "high": min(max(hi, 0.0), hi_bound)}


def _summary(cfg: GoodputConfig, k: int, best_k: int, curve: dict[int, float | None],
             outcomes: list[Outcome], yd: float | None, mtbf: float | None) -> dict[str, Any]:
    job, inv = cfg.job, cfg.inventory
    s = job.step_time_s
    good = [o.goodput for o in outcomes]
    walls_h = [o.wall_s / 3600 for o in outcomes]
    out: dict[str, Any] = {
        "goodput": float(np.mean(good)),
        "goodput_ci95": _ci(good, 1.0),
        "checkpoint_interval_s": k * s,
        "checkpoint_interval_steps": k,
        "checkpoint_interval_searched": cfg.checkpoint_interval_s is None,
        "best_checkpoint_interval_s": best_k * s,
        "best_checkpoint_interval_steps": best_k,
        "best_goodput": curve[best_k],
        "young_daly_interval_s": yd,
        "daly_interval_s": daly_s(job.checkpoint_cost_s, mtbf) if mtbf else None,
        "job_hours": None if job.horizon_s is None else job.horizon_s / 3600,
        "expected_finish_hours": float(np.mean(walls_h)),
        "expected_finish_hours_ci95": _ci(walls_h),
        "useful_hours": float(np.mean([o.useful_s for o in outcomes])) / 3600,
        "steps": job.steps if job.steps is not None else
        float(np.mean([o.useful_s for o in outcomes])) / s,
        "lost_s_by_cause": {c: float(np.mean([o.lost_s[c] for o in outcomes]))
                            for c in LOST_CAUSES},
        "lost_s_by_cause_ci95": {c: _ci([o.lost_s[c] for o in outcomes]) for c in LOST_CAUSES},
        "failures": float(np.mean([o.failures for o in outcomes])),
        "failures_ci95": _ci([float(o.failures) for o in outcomes]),
        "cube_swaps": float(np.mean([o.swaps for o in outcomes])),
        "checkpoints": float(np.mean([o.checkpoints for o in outcomes])),
        "seeds": cfg.seeds,
        "engine": str(cfg.engine),
        "interval_search": [{"checkpoint_interval_s": kk * s, "checkpoint_interval_steps": kk,
                             "goodput": v} for kk, v in curve.items()],
    }
    if not inv.swaps:
        out["cube_swaps"] = 0.0
    return out
