"""Checkpoints and lost work on a slice's history (`sim.reliability.history`), in closed form.

In every up window the job trains `k` steps (`tau = k x step` seconds), writes a checkpoint
(`c` seconds), and again: a window of length L holds n = floor(L / (tau + c)) whole periods,
each committing k steps. A failure at r = L - n (tau + c) into the next period loses
min(r, tau) of training (`recomputation`) and max(r - tau, 0) of an unfinished checkpoint
write, so the job restarts from its last committed checkpoint. With R steps left at a window's
start, the job finishes in it when R x step + c x (ceil(R / k) - 1) <= L (no checkpoint after
the last step). With a wall-clock window instead (a goodput request's `hours`), the job trains
until the horizon and the work done by then is useful, checkpointed or not.

Wall time = useful time + the lost time by cause, exactly (`LOST_CAUSES`): recomputation,
checkpoint writes, and the downtime of the history (restarts, cube swaps, waiting for repair,
waiting for a spare). The sums are numpy over the windows, so any interval costs O(windows)
without a new simulation. `search` finds the interval that maximises the mean goodput over the
seeds; `young_daly_s` and `daly_s` are the formulas it is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.reliability.config import JobConfig
from sim.reliability.history import DOWN_CAUSES, END_FAILURE, END_HORIZON, History

LOST_CAUSES = ("recomputation", "checkpoint_writes", *DOWN_CAUSES)
# A timeline draws every training segment and checkpoint up to this many; past it, one slice
# per up window.
MAX_TIMELINE_SEGMENTS = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One history at one checkpoint interval: the wall time, the useful time, the lost time
    by cause (`LOST_CAUSES`), failures and cube swaps until the job ended."""

    wall_s: float
    useful_s: float
    lost_s: dict[str, float]
    failures: int
    swaps: int
    checkpoints: int

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 1.0


def _periods(history: History, job: JobConfig, k: int):
    s, c = job.step_time_s, job.checkpoint_cost_s
    tau = k * s
    p = tau + c
    L = history.length
    finite = np.isfinite(L)
    n = np.zeros(L.size)
    n[finite] = np.floor(L[finite] / p)
    r = np.where(finite, L - n * p, 0.0)
    return tau, c, n, r, finite


def evaluate(history: History, job: JobConfig, k: int) -> Outcome | None:
    """The job on `history` checkpointed every `k` steps; None when the history is too short
    for the job to finish (steps jobs; extend it and ask again)."""
    if job.steps is None:
        return _evaluate_window(history, job, k)
    s = job.step_time_s
    tau, c, n, r, finite = _periods(history, job, k)
    N = job.steps
    committed = n * k  # steps a closed window commits
    before = np.concatenate(([0.0], np.cumsum(np.where(finite, committed, 0.0))[:-1]))
    remaining = N - before
    segs = np.ceil(np.maximum(remaining, 0) / k)
    need = remaining * s + c * np.maximum(segs - 1, 0)
    fin = (remaining > 0) & (need <= history.length)
    if not fin.any():
        return None
    j = int(np.argmax(fin))
    wall = float(history.start[j] + need[j])
    rj, nj = r[:j], n[:j]
    lost = {"recomputation": float(np.minimum(rj, tau).sum()),
            "checkpoint_writes": float((nj * c).sum() + np.maximum(rj - tau, 0).sum()
                                       + c * max(segs[j] - 1, 0))}
    down = history.down[:j + 1].sum(axis=0)
    lost.update({cause: float(v) for cause, v in zip(DOWN_CAUSES, down, strict=True)})
    return Outcome(wall_s=wall, useful_s=N * s, lost_s=lost,
                   failures=int(history.failures_before[j]),
                   swaps=int(history.swaps_before[j]),
                   checkpoints=int(nj.sum() + max(segs[j] - 1, 0)))


def committed_steps(history: History, job: JobConfig, k: int) -> float:
    """Steps the closed windows of `history` commit at `k` steps a checkpoint (however many
    the job has): a steps job's progress on a history too short for it."""
    _tau, _c, n, _r, finite = _periods(history, job, k)
    return float((n[finite] * k).sum())


def _evaluate_window(history: History, job: JobConfig, k: int) -> Outcome:
    """A wall-clock window: the whole history, the last window cut by the horizon."""
    tau, c, n, r, _finite = _periods(history, job, k)
    last = history.end == END_HORIZON
    fail = history.end == END_FAILURE
    useful = float((n * tau).sum() + np.minimum(r[last], tau).sum())
    lost = {"recomputation": float(np.minimum(r[fail], tau).sum()),
            "checkpoint_writes": float((n * c).sum() + np.maximum(r - tau, 0).sum())}
    down = history.down.sum(axis=0)
    lost.update({cause: float(v) for cause, v in zip(DOWN_CAUSES, down, strict=True)})
    return Outcome(wall_s=float(job.horizon_s), useful_s=useful, lost_s=lost,
                   failures=int(history.failures_before[-1]),
                   swaps=int(history.swaps_before[-1]), checkpoints=int(n.sum()))


# -- the interval search --------------------------------------------------------------------------
GRID_POINTS = 33
_PHI = (1 + 5 ** 0.5) / 2


def search(mean_goodput: Callable[[int], float | None], k_max: int,
           hints: tuple[int, ...] = ()) -> tuple[int, dict[int, float | None]]:
    """The checkpoint interval in steps, in [1, k_max], that maximises `mean_goodput` (None:
    the job did not finish there, never the best): a log-spaced grid of `GRID_POINTS` (and the
    `hints`), then a golden-section search on whole steps between the best point's neighbours.
    Returns (best, every interval evaluated -> its value)."""
    seen: dict[int, float | None] = {}

    def f(k: int) -> float:
        if k not in seen:
            seen[k] = mean_goodput(k)
        v = seen[k]
        return -math.inf if v is None else v

    for h in hints:  # first: a good hint bounds how far the others are followed
        if 1 <= h <= k_max:
            f(h)
    grid = sorted({*np.unique(np.round(np.geomspace(1, k_max, GRID_POINTS)).astype(np.int64))
                   .tolist(), *(h for h in hints if 1 <= h <= k_max)})
    for k in grid:
        f(k)
    best = max(grid, key=lambda k: (f(k), -k))
    i = grid.index(best)
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while b - a > 3:
        x = b - int(round((b - a) / _PHI))
        y = a + int(round((b - a) / _PHI))
        if x >= y:
            break
        if f(x) >= f(y):
            b = y
        else:
            a = x
    for k in range(a, b + 1):
        f(k)
    best = max(seen, key=lambda k: (f(k), -k))
    return best, dict(sorted(seen.items()))


def young_daly_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval, sqrt(2 x checkpoint cost x MTBF) (Young 1974;
    Daly 2006 eq. 7)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37): sqrt(2 c M) [1 + sqrt(c / 2M) / 3 +
    (c / 2M) / 9] - c for c < 2M, else M."""
    c, m = checkpoint_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def daly_expected_wall_s(work_s: float, tau_s: float, checkpoint_cost_s: float,
                         restart_s: float, mtbf_s: float) -> float:
    """Daly's exact expected wall time (Daly 2006, eq. 13) for `work_s` of work in segments of
    `tau_s`, each followed by a checkpoint, exponential failures of mean `mtbf_s` striking
    training, checkpoints and restarts alike, and a restart of `restart_s` after each:
    M e^(R/M) (e^((tau + c)/M) - 1) x work / tau."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((tau_s + checkpoint_cost_s) / m) \
        * work_s / tau_s


# -- the timeline --------------------------------------------------------------------------------
def _end_window(history: History, job: JobConfig, k: int) -> tuple[int, int]:
    """(the window a steps job ends in, the steps committed before it); for a wall-clock
    window, (the last window, -1)."""
    if job.steps is None:
        return history.size - 1, -1
    _tau, _c, n, _r, finite = _periods(history, job, k)
    committed = np.where(finite, n * k, 0.0)
    before = np.concatenate(([0.0], np.cumsum(committed)[:-1]))
    remaining = job.steps - before
    segs = np.ceil(np.maximum(remaining, 0) / k)
    need = remaining * job.step_time_s + job.checkpoint_cost_s * np.maximum(segs - 1, 0)
    fin = (remaining > 0) & (need <= history.length)
    j = int(np.argmax(fin))
    return j, int(before[j])


def timeline(history: History, down_events: list[tuple], job: JobConfig, k: int,
             outcome: Outcome) -> tuple[list[tuple], bool]:
    """The job's life as `(start_s, end_s, kind, detail)` events up to its end: training
    segments (`train`: steps first..last, `kept` or lost), checkpoint writes (`checkpoint`:
    `committed` or not), and the history's downtime, failures and repairs (`down_events`),
    sorted by time. Past `MAX_TIMELINE_SEGMENTS` segments, one `train` slice per up window
    (its checkpoints counted in its detail); the flag says whether that happened."""
    s, c = job.step_time_s, job.checkpoint_cost_s
    tau, _c, n, r, finite = _periods(history, job, k)
    end_t = outcome.wall_s
    j, before_j = _end_window(history, job, k)
    events: list[tuple] = [e for e in down_events if e[0] < end_t]
    horizon = job.steps is None
    last_segs = 0 if horizon else -(-(job.steps - before_j) // k)
    coarse = float(n[:j + (1 if horizon else 0)].sum()) + last_segs > MAX_TIMELINE_SEGMENTS
    step = 0
    for i in range(j + 1):
        ws = float(history.start[i])
        p = tau + c
        if i == j and not horizon:
            remaining = job.steps - before_j
            segs = -(-remaining // k)
            if coarse:
                events.append((ws, end_t, "train", {"window": i, "checkpoints": segs - 1}))
                continue
            t = ws
            for m in range(segs):
                seg = min(k, remaining - m * k)
                events.append((t, t + seg * s, "train",
                               {"steps": [step, step + seg - 1], "kept": True}))
                step += seg
                t += seg * s
                if m < segs - 1:
                    if c > 0:
                        events.append((t, t + c, "checkpoint",
                                       {"after_step": step - 1, "committed": True}))
                    t += c
            continue
        ni = int(n[i])
        if coarse:
            wend = ws + float(history.length[i]) if finite[i] else end_t
            events.append((ws, wend, "train", {"window": i, "checkpoints": ni}))
            step += ni * k
            continue
        for m in range(ni):
            t = ws + m * p
            events.append((t, t + tau, "train", {"steps": [step, step + k - 1], "kept": True}))
            if c > 0:
                events.append((t + tau, t + p, "checkpoint",
                               {"after_step": step + k - 1, "committed": True}))
            step += k
        ri = float(r[i])
        t = ws + ni * p
        kept = horizon and i == j
        seg = k if horizon else min(k, job.steps - step)  # the last segment may be shorter
        if ri > 0:
            done = min(seg, int(ri // s)) if kept else seg
            events.append((t, t + min(ri, tau), "train",
                           {"steps": [step, step + max(done, 1) - 1], "kept": kept}))
        if ri > tau:
            events.append((t + tau, t + ri, "checkpoint",
                           {"after_step": step + k - 1, "committed": False}))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    return events, coarse
