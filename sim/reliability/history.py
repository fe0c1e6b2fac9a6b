"""The slice's life, failure by failure: when the job can train (up windows) and what each
stretch of downtime between two windows was spent on. The event-skip engine: failures, repairs,
cube swaps and restarts are events, in one loop over the failure stream; the checkpoints inside
a window do not change when the next failure comes (failures arrive in wall time, whatever the
job is doing), so they are left to `sim.reliability.job`, which counts them in closed form for any
checkpoint interval.

The rules (docs/model/goodput.md):

* A failure takes its part out: with `SliceInventory.swaps` (optical switches and spare cubes)
  its cube leaves the slice for repair and returns `repair_s` later as a spare; otherwise the
  part is repaired in place in `repair_s`. Several repairs run at once.
* The job stops at a failure (the work since its last checkpoint is lost; `job.py`), whether it
  was training, writing a checkpoint or restarting. With swaps it takes a free spare at once
  (`swap_cost_s`, then `restart_cost_s`); with none free it waits for the first repaired cube
  (`waiting for a spare`). Without swaps it waits until every failed part is back
  (`waiting for repair`), then restarts (`restart_cost_s`).
* Failures keep arriving during restarts and waits: a restart they interrupt starts over once
  the slice is whole again; during a wait they add repairs.
* At equal times a repair comes before a failure, and a restart's end before a failure.

`History` holds the windows as arrays: start, length (infinite for the last window of a trace
that ran out), how it ended (a failure, the horizon, open), and per window the downtime spent
before it by cause, the failures before it and the swaps before it. `HistoryBuilder.extend`
grows it (the failure stream is drawn lazily), so a job that needs a longer history gets one.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass

import numpy as np

from sim.reliability.config import (
    KIND_WORDS,
    MAX_FAILURES,
    FailureConfig,
    JobConfig,
    SliceInventory,
)
from sim.reliability.failures import FailureStream, TooManyFailures

# A stretch of downtime that sees more failures than this never ends in practice (each repair
# brings more failures than it clears): the history is refused.
EPISODE_MAX_FAILURES = 100_000
# How a window ends.
END_FAILURE, END_HORIZON, END_OPEN = 0, 1, 2
# Downtime causes, in the order of `History.down` columns.
DOWN_CAUSES = ("restarts", "cube_swaps", "waiting_for_repair", "waiting_for_spare")
_RESTART, _SWAP, _WAIT_REPAIR, _WAIT_SPARE = range(4)


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """Up windows (arrays of one entry per window); `down[i]` the downtime before window i
    by cause (`DOWN_CAUSES`), `failures_before[i]` / `swaps_before[i]` the failures and swaps
    before window i starts."""

    start: np.ndarray
    length: np.ndarray
    end: np.ndarray
    down: np.ndarray  # (windows, 4)
    failures_before: np.ndarray
    swaps_before: np.ndarray
    complete: bool  # the history reaches its end (horizon or an exhausted trace)

    @property
    def size(self) -> int:
        return self.start.size

    @property
    def span_s(self) -> float:
        """Wall time the history covers (to the end of its last closed window)."""
        if not self.size:
            return 0.0
        last = self.length[-1]
        return float(self.start[-1] + (last if math.isfinite(last) else 0.0))


class HistoryBuilder:
    """Builds a `History` window by window from a failure stream (see the module docstring).
    `log=True` records every downtime phase, failure and repair in `events` as
    `(start_s, end_s, kind, detail)` for the timeline exports."""

    def __init__(self, stream: FailureStream, job: JobConfig, inventory: SliceInventory,
                 failures: FailureConfig, *, log: bool = False) -> None:
        self.stream = stream
        self.inv = inventory
        self.repair_s = failures.repair_s
        self.restart_s = job.restart_cost_s
        self.swap_s = job.swap_cost_s if inventory.swaps else 0.0
        self.horizon = job.horizon_s
        self.swaps = inventory.swaps
        self.events: list[tuple] | None = [] if log else None
        # State.
        self.idx = 0  # next failure
        self.free = inventory.spare_cubes if inventory.swaps else 0
        self.missing = 0
        self.repairs: list[float] = []  # when each part under repair comes back (a heap)
        self._times: list[float] = []  # the stream's failure times read so far
        self.ws = 0.0  # the open window's start
        self.acc = [0.0, 0.0, 0.0, 0.0]
        self.nswaps = 0
        self.done = False
        # Windows.
        self._start = array("d")
        self._len = array("d")
        self._end = array("b")
        self._down = array("d")  # 4 per window (DOWN_CAUSES)
        self._fail = array("q")
        self._swaps = array("q")
        self._pre = ((0.0, 0.0, 0.0, 0.0), 0, 0)  # the open window's downtime, failures, swaps
        self._cache: History | None = None

    # -- the loop -----------------------------------------------------------------------------
    def extend(self, windows: int, until_s: float = math.inf) -> History:
        """Grow the history to at least `windows` windows, or until a window starts past
        `until_s`, or to its end; the history so far."""
        if not self.done and len(self._start) < windows and self.ws <= until_s:
            self._advance(windows, until_s)
        return self.history()

    def run(self) -> History:
        """The whole history (a horizon or a finite trace must end it)."""
        if not self.done:
            self._advance(None, math.inf)
        return self.history()

    def _more(self, idx: int) -> int:
        """Make failure `idx` available in `self._times` if the stream has it; the count."""
        stream = self.stream
        if idx >= MAX_FAILURES and not stream.finite:
            raise TooManyFailures(f"{MAX_FAILURES:,} failures")
        n = stream.ensure(idx + 1)
        if n > len(self._times):
            self._times.extend(stream.times[len(self._times):n].tolist())
        if idx >= len(self._times) and not stream.finite:
            raise TooManyFailures(f"{MAX_FAILURES:,} failures")
        return len(self._times)

    def _log_failure(self, i: int, t: float) -> None:
        kind = int(self.stream.kinds[i])
        unit = int(self.stream.units[i])
        cube = self.inv.cube_of(kind, unit) if unit >= 0 else -1
        self.events.append((t, t, "failure", {"kind": KIND_WORDS[kind], "unit": unit,
                                              "cube": cube, "index": i}))
        self.events.append((t, t + self.repair_s, "repair", {"index": i,
                                                             "kind": KIND_WORDS[kind],
                                                             "unit": unit}))

    def _log_restart(self, t: float, spent: float, completed: bool) -> None:
        sw = self.swap_s
        s = min(spent, sw)
        if sw > 0 and s > 0:
            self.events.append((t, t + s, "swap", {"completed": s >= sw}))
        if spent - s > 0 or (completed and self.restart_s == 0):
            self.events.append((t + s, t + spent, "restart", {"completed": completed}))

    # Long: the per-failure event loop, in one frame with its state in locals (a month-long job
    # has thousands of failures; split into calls, each window would pay for them).
    def _advance(self, target: int | None, until_s: float) -> None:
        """The event loop (one pass per window: training until the next failure, then the
        downtime until the job runs again), until `target` windows or the end. Written with
        local variables: it runs once per failure."""
        inf = math.inf
        times = self._times
        ntimes = len(times)
        idx = self.idx
        h = self.horizon if self.horizon is not None else inf
        repair, swaps = self.repair_s, self.swaps
        sw, rs = self.swap_s, self.restart_s
        restart_len = sw + rs
        heap = self.repairs
        push, pop = heapq.heappush, heapq.heappop
        free, missing, nswaps = self.free, self.missing, self.nswaps
        ws = self.ws
        a_restart, a_swap, a_wait = self.acc[_RESTART], self.acc[_SWAP], 0.0
        wait_col = _WAIT_SPARE if swaps else _WAIT_REPAIR
        wait_word = "wait_spare" if swaps else "wait_repair"
        a_wait = self.acc[wait_col]
        pre_down, pre_fail, pre_swaps = self._pre
        starts, lens, ends = self._start, self._len, self._end
        downs, fails, swps = self._down, self._fail, self._swaps
        log = self.events is not None
        done = False

        starts_add, lens_add, ends_add = starts.append, lens.append, ends.append
        downs_add, fails_add, swps_add = downs.extend, fails.append, swps.append

        def close(end_t: float, how: int) -> None:  # the rare ends (horizon, open)
            starts_add(ws)
            lens_add(end_t - ws if how != END_OPEN else inf)
            ends_add(how)
            downs_add(pre_down)
            fails_add(pre_fail)
            swps_add(pre_swaps)

        while (target is None or len(starts) < target) and ws <= until_s:
            if idx >= ntimes:
                ntimes = self._more(idx)
            f = times[idx] if idx < ntimes else inf
            if f >= h:
                close(h, END_HORIZON)
                done = True
                break
            if f == inf:
                close(inf, END_OPEN)
                done = True
                break
            starts_add(ws)
            lens_add(f - ws)
            ends_add(END_FAILURE)
            downs_add(pre_down)
            fails_add(pre_fail)
            swps_add(pre_swaps)
            t = f
            # The failure at t.
            if log:
                self._log_failure(idx, t)
            idx += 1
            missing += 1
            push(heap, t + repair)
            first = idx
            wait_t = -1.0  # when the current stretch of waiting began (-1: not waiting)
            # Downtime until the job runs again.
            while True:
                if idx - first > EPISODE_MAX_FAILURES:
                    raise TooManyFailures(
                        f"{EPISODE_MAX_FAILURES:,} failures in one stretch of downtime (parts "
                        f"fail faster than repairs bring the slice back)")
                while heap and heap[0] <= t:
                    pop(heap)
                    if swaps:
                        free += 1
                    else:
                        missing -= 1
                if swaps and missing and free:
                    n = missing if missing < free else free
                    free -= n
                    missing -= n
                    nswaps += n
                    if log:
                        self.events.append((t, t, "swap_in", {"cubes": n}))
                if idx >= ntimes:
                    ntimes = self._more(idx)
                f = times[idx] if idx < ntimes else inf
                if missing == 0:
                    if log and wait_t >= 0 and t > wait_t:
                        self.events.append((wait_t, t, wait_word, {}))
                    wait_t = -1.0
                    end = t + restart_len
                    if h < end and h <= f:
                        spent = h - t
                        s = spent if spent < sw else sw
                        a_swap += s
                        a_restart += spent - s
                        if log:
                            self._log_restart(t, spent, False)
                        t = h
                        done = True
                        break
                    if f < end:
                        spent = f - t
                        s = spent if spent < sw else sw
                        a_swap += s
                        a_restart += spent - s
                        if log:
                            self._log_restart(t, spent, False)
                        t = f
                        if log:
                            self._log_failure(idx, t)
                        idx += 1
                        missing += 1
                        push(heap, t + repair)
                        continue
                    a_swap += sw
                    a_restart += rs
                    if log:
                        self._log_restart(t, restart_len, True)
                    t = end
                    break
                r = heap[0]
                nxt = r if r <= f else f
                if wait_t < 0:
                    wait_t = t
                if h <= nxt:
                    a_wait += h - t
                    if log and h > wait_t:
                        self.events.append((wait_t, h, wait_word, {}))
                    t = h
                    done = True
                    break
                a_wait += nxt - t
                t = nxt
                if f < r:
                    if log:
                        self._log_failure(idx, t)
                    idx += 1
                    missing += 1
                    push(heap, t + repair)
            # The next window opens at t (at the horizon: an empty last window).
            ws = t
            pre_down = (a_restart, a_swap, 0.0, a_wait) if swaps else \
                (a_restart, a_swap, a_wait, 0.0)
            pre_fail, pre_swaps = idx, nswaps
            a_restart = a_swap = a_wait = 0.0
            if done:
                close(h, END_HORIZON)
                break
        self.idx, self.free, self.missing, self.nswaps = idx, free, missing, nswaps
        self.ws = ws
        acc = [a_restart, a_swap, 0.0, 0.0]
        acc[wait_col] = a_wait
        self.acc = acc
        self._pre = (pre_down, pre_fail, pre_swaps)
        self.done = done
        self._cache = None

    # -- the result ---------------------------------------------------------------------------
    def history(self) -> History:
        if self._cache is None:
            def arr(a, dtype):
                return np.frombuffer(a, dtype=dtype).copy() if len(a) else np.empty(0, dtype)

            self._cache = History(
                start=arr(self._start, np.float64),
                length=arr(self._len, np.float64),
                end=arr(self._end, np.int8),
                down=arr(self._down, np.float64).reshape(-1, len(DOWN_CAUSES)),
                failures_before=arr(self._fail, np.int64),
                swaps_before=arr(self._swaps, np.int64),
                complete=self.done)
        return self._cache
