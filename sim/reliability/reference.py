"""The goodput simulation in SimPy, every event an event: the brute-force oracle of the
event-skip engine (`engine="simpy"`).

Processes: the failure source (one timeout per failure of the stream, each starting a repair
process and interrupting the job if it is training, writing a checkpoint or restarting), one
repair process per failure (the part comes back in place, or as a spare cube with swaps), and
the job: k steps of training, a checkpoint write, again, until its steps are done (or the
horizon); on an interruption it loses the work since its last committed checkpoint, takes free
spares (with swaps), waits until the slice is whole, and restarts (swap, then restart cost),
starting over when a failure interrupts the restart. The rules are those of
`sim.reliability.history`; the results must equal the event-skip engine's on the same failures
(tests/test_goodput.py), so each time is accumulated as the engine does.
"""

from __future__ import annotations

import math

import simpy

from sim.reliability.config import KIND_WORDS, FailureConfig, JobConfig, SliceInventory
from sim.reliability.failures import FailureStream
from sim.reliability.job import LOST_CAUSES, Outcome


class _Job:
    def __init__(self, stream: FailureStream, job: JobConfig, inv: SliceInventory,
                 failures: FailureConfig, k: int, log: bool) -> None:
        self.env = simpy.Environment()
        self.stream, self.job, self.inv, self.k = stream, job, inv, k
        self.repair_s = failures.repair_s
        self.swaps = inv.swaps
        self.swap_s = job.swap_cost_s if inv.swaps else 0.0
        self.free = inv.spare_cubes if inv.swaps else 0
        self.missing = 0
        self.phase = "train"
        self.phase_t = 0.0
        self.seg_t = 0.0  # the current segment's start
        self.seg = 0  # its steps
        self.committed = 0
        self.useful_s = 0.0
        self.lost = dict.fromkeys(LOST_CAUSES, 0.0)
        self.failures = 0
        self.nswaps = 0
        self.checkpoints = 0
        self.wake: simpy.Event | None = None
        self.wait_t: float | None = None
        self.finished_at: float | None = None
        self.events: list[tuple] | None = [] if log else None
        self.proc = self.env.process(self._run())
        self.env.process(self._failures())

    def _log(self, *e) -> None:
        if self.events is not None:
            self.events.append(e)

    # -- failures and repairs -----------------------------------------------------------------
    def _failures(self):
        i = 0
        while True:
            f = self.stream.time(i)
            if math.isinf(f):
                return
            yield self.env.timeout(f - self.env.now)
            if self.finished_at is not None:
                return
            self.failures += 1
            self.missing += 1
            kind, unit = int(self.stream.kinds[i]), int(self.stream.units[i])
            self._log(f, f, "failure", {"kind": KIND_WORDS[kind], "unit": unit,
                                        "cube": self.inv.cube_of(kind, unit) if unit >= 0
                                        else -1, "index": i})
            self._log(f, f + self.repair_s, "repair", {"index": i, "kind": KIND_WORDS[kind],
                                                       "unit": unit})
            self.env.process(self._repair())
            if self.phase in ("train", "checkpoint", "restart"):
                self.proc.interrupt()
            i += 1

    def _repair(self):
        yield self.env.timeout(self.repair_s)
        if self.swaps:
            self.free += 1
        else:
            self.missing -= 1
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    # -- the job ------------------------------------------------------------------------------
    def _run(self):
        env, job, k = self.env, self.job, self.k
        s, c, N = job.step_time_s, job.checkpoint_cost_s, job.steps
        while True:
            try:
                while True:
                    self.seg = k if N is None else min(k, N - self.committed)
                    self.phase, self.seg_t = "train", env.now
                    yield env.timeout(self.seg * s)
                    if N is not None and self.committed + self.seg >= N:
                        self._log(self.seg_t, env.now, "train",
                                  {"steps": [self.committed, self.committed + self.seg - 1],
                                   "kept": True})
                        self.committed = N
                        self.useful_s = N * s
                        self.finished_at = env.now
                        self.phase = "done"
                        return
                    self.phase, self.phase_t = "checkpoint", env.now
                    yield env.timeout(c)
                    self.lost["checkpoint_writes"] += c
                    self._log(self.seg_t, self.seg_t + self.seg * s, "train",
                              {"steps": [self.committed, self.committed + self.seg - 1],
                               "kept": True})
                    if c > 0:
                        self._log(self.phase_t, env.now, "checkpoint",
                                  {"after_step": self.committed + self.seg - 1,
                                   "committed": True})
                    self.committed += self.seg
                    self.useful_s = self.committed * s
                    self.checkpoints += 1
            except simpy.Interrupt:
                self._lose()
            yield from self._recover()

    def _lose(self) -> None:
        now, s = self.env.now, self.job.step_time_s
        if self.phase == "train":
            spent = now - self.seg_t
            self.lost["recomputation"] += spent
            if spent > 0:
                self._log(self.seg_t, now, "train",
                          {"steps": [self.committed, self.committed + self.seg - 1],
                           "kept": False})
        else:  # a checkpoint write
            self.lost["recomputation"] += self.seg * s
            self.lost["checkpoint_writes"] += now - self.phase_t
            self._log(self.seg_t, self.seg_t + self.seg * s, "train",
                      {"steps": [self.committed, self.committed + self.seg - 1],
                       "kept": False})
            if now > self.phase_t:
                self._log(self.phase_t, now, "checkpoint",
                          {"after_step": self.committed + self.seg - 1, "committed": False})

    def _recover(self):
        env = self.env
        wait = "waiting_for_spare" if self.swaps else "waiting_for_repair"
        self.wait_t = None  # when the current stretch of waiting began
        while True:
            if self.swaps and self.missing and self.free:
                n = min(self.missing, self.free)
                self.free -= n
                self.missing -= n
                self.nswaps += n
                self._log(env.now, env.now, "swap_in", {"cubes": n})
            if self.missing == 0:
                self._end_wait()
                self.phase, self.phase_t = "restart", env.now
                try:
                    yield env.timeout(self.swap_s + self.job.restart_cost_s)
                    self._restart_spent(True)
                    return
                except simpy.Interrupt:
                    self._restart_spent(False)
                    continue
            self.phase, self.phase_t = "wait", env.now
            if self.wait_t is None:
                self.wait_t = env.now
            self.wake = env.event()
            yield self.wake
            self.wake = None
            self.lost[wait] += env.now - self.phase_t

    def _end_wait(self, at: float | None = None) -> None:
        t = self.env.now if at is None else at
        if self.wait_t is not None and t > self.wait_t:
            self._log(self.wait_t, t, "wait_spare" if self.swaps else "wait_repair", {})
        self.wait_t = None

    def _restart_spent(self, completed: bool) -> None:
        t0, spent = self.phase_t, self.env.now - self.phase_t
        sw = min(spent, self.swap_s)
        self.lost["cube_swaps"] += sw
        self.lost["restarts"] += spent - sw
        if self.swap_s > 0 and sw > 0:
            self._log(t0, t0 + sw, "swap", {"completed": sw >= self.swap_s})
        if spent - sw > 0 or (completed and self.job.restart_cost_s == 0):
            self._log(t0 + sw, t0 + spent, "restart", {"completed": completed})

    # -- the end ------------------------------------------------------------------------------
    def run(self) -> Outcome:
        h = self.job.horizon_s
        if h is None:
            self.env.run(until=self.proc)
            wall = self.finished_at
        else:
            self.env.run(until=h)
            wall = h
            self._cut(h)
        return Outcome(wall_s=wall, useful_s=self.useful_s, lost_s=dict(self.lost),
                       failures=self.failures, swaps=self.nswaps, checkpoints=self.checkpoints)

    def _cut(self, h: float) -> None:
        """The horizon: the work done so far is useful, the phase under way is cut."""
        s = self.job.step_time_s
        if self.phase == "train":
            self.useful_s += h - self.seg_t
            if h > self.seg_t:
                self._log(self.seg_t, h, "train",
                          {"steps": [self.committed, self.committed
                                     + max(min(self.seg, int((h - self.seg_t) // s)), 1) - 1],
                           "kept": True})
        elif self.phase == "checkpoint":
            self.useful_s += self.seg * s
            self.lost["checkpoint_writes"] += h - self.phase_t
            self._log(self.seg_t, self.seg_t + self.seg * s, "train",
                      {"steps": [self.committed, self.committed + self.seg - 1], "kept": True})
            if h > self.phase_t:
                self._log(self.phase_t, h, "checkpoint",
                          {"after_step": self.committed + self.seg - 1, "committed": False})
        elif self.phase == "restart":
            self._restart_spent(False)
        elif self.phase == "wait":
            wait = "waiting_for_spare" if self.swaps else "waiting_for_repair"
            self.lost[wait] += h - self.phase_t
            self._end_wait(h)


def simulate(stream: FailureStream, job: JobConfig, inventory: SliceInventory,
             failures: FailureConfig, k: int, *, log: bool = False) -> tuple[Outcome, list]:
    """The job on `stream`'s failures, checkpointed every `k` steps, as SimPy processes:
    (its outcome, its events when `log`)."""
    j = _Job(stream, job, inventory, failures, k, log)
    out = j.run()
    events = sorted(j.events or [], key=lambda e: (e[0], e[1], e[2]))
    return out, events
