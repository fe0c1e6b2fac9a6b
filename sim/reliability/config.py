"""The settings of a goodput simulation, as plain frozen values (no pod, no request): the job
(`JobConfig`), the parts of the slice that fail and the spares that replace them
(`SliceInventory`), the failure model (`FailureConfig`), and the run (`GoodputConfig`: the
checkpoint interval or a search for it, seeds, the engine).

Times are seconds throughout; the command line's hours are converted by the runner
(sim/runs/goodput.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from topologies.errors import TpusimError


class Engine(StrEnum):
    """`event-skip`: failures, repairs, swaps and restarts are events; the checkpoints between
    two failures are counted in closed form, for every checkpoint interval at once (the
    default). `simpy`: every checkpoint too is an event of a SimPy process (the oracle, slower;
    the numbers are the same)."""

    EVENT_SKIP = "event-skip"
    SIMPY = "simpy"


# A history may hold at most this many failures (per seed): about 100 MB of arrays and a few
# seconds of simulation. A job that needs more (an MTBF far shorter than the job) is refused.
MAX_FAILURES = 2_000_000
MAX_SEEDS = 1000
# The most steps a job holds (as --steps takes them).
MAX_STEPS = 10**12
# The shortest mean time between failures a slice may have: one second.
MIN_MTBF_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfig:
    """The job: `steps` steps of `step_time_s` each (the job ends when the last is done), or
    a wall-clock window of `horizon_s` (the job trains until then). Checkpoints take
    `checkpoint_cost_s` to write, a restart `restart_cost_s` (reload and restore), and a cube
    swap through the optical switches `swap_cost_s` on top of the restart."""

    step_time_s: float
    steps: int | None = None
    horizon_s: float | None = None
    checkpoint_cost_s: float = 0.0
    restart_cost_s: float = 0.0
    swap_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
            raise TpusimError(f"step time {self.step_time_s!r} s must be a finite number > 0")
        if (self.steps is None) == (self.horizon_s is None):
            raise TpusimError("a job has either a number of steps or a wall-clock window")
        if self.horizon_s is not None and not self.horizon_s / self.step_time_s <= MAX_STEPS:
            raise TpusimError(
                f"a {self.horizon_s / 3600:g}-hour window of {self.step_time_s:g}-second steps "
                f"is over {MAX_STEPS:.0e} steps; give a longer step or a shorter window")
        for name in ("checkpoint_cost_s", "restart_cost_s", "swap_cost_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise TpusimError(f"{name} {v!r} must be a finite number >= 0")

    @property
    def length_s(self) -> float:
        """The job's length: its useful seconds (steps), or the window."""
        return self.steps * self.step_time_s if self.steps is not None else self.horizon_s

    @property
    def max_interval_steps(self) -> int:
        """The longest checkpoint interval in steps: the whole job."""
        if self.steps is not None:
            return self.steps
        n = self.horizon_s / self.step_time_s
        return max(int(n), 1) if math.isfinite(n) else MAX_STEPS


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceInventory:
    """The parts of the slice that fail, and what replaces them.

    `num_chips` chips on `num_hosts` hosts; `num_cubes` 4x4x4 cubes when the slice is made of
    them (v4, v5p), else 0. `ocs`: the cubes are joined by optical circuit switches that can
    swap one out (false for a pod without switches, or `no_ocs`); `spare_cubes`: free cubes
    of the pod the switches can swap in. With `swaps` (both), a failed part's cube is swapped
    for a spare and goes to repair, coming back as a spare; without, the job waits until the
    failed part is repaired in place."""

    num_chips: int
    num_hosts: int
    chips_per_host: int
    num_cubes: int = 0
    ocs: bool = False
    spare_cubes: int = 0

    @property
    def swaps(self) -> bool:
        return self.ocs and self.spare_cubes > 0

    def cube_of(self, kind: int, unit: int) -> int:
        """The cube holding chip or host `unit` (chips numbered cube by cube, hosts likewise);
        -1 on a slice without cubes."""
        if not self.num_cubes:
            return -1
        chips = unit if kind == CHIP else unit * self.chips_per_host
        return int(chips // (self.num_chips // self.num_cubes))


# What failed (the `kind` of a failure).
CHIP, HOST, PART = 0, 1, 2
KIND_WORDS = {CHIP: "chip", HOST: "host", PART: "part"}


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureConfig:
    """When parts fail: a Poisson process of `rate_per_s` over the slice (the sum of every
    chip's and host's rate), `chip_share` of its failures chips and the rest hosts (None: a
    rate given for the whole slice, its failures not told apart); or the failures of a trace
    file (`trace`). A failed part is repaired in `repair_s`."""

    repair_s: float
    rate_per_s: float | None = None
    chip_share: float | None = None
    trace: str | None = None

    def __post_init__(self) -> None:
        if (self.rate_per_s is None) == (self.trace is None):
            raise TpusimError("failures come from a rate or from a trace file, not both")
        if self.rate_per_s is not None and not (0 < self.rate_per_s <= 1 / MIN_MTBF_S):
            mtbf = 1 / self.rate_per_s if self.rate_per_s else math.inf
            raise TpusimError(f"the slice would fail every {mtbf:.3g} s on average; the MTBFs "
                              f"must make it at least {MIN_MTBF_S:g} s (give longer MTBFs)")
        if not (math.isfinite(self.repair_s) and self.repair_s >= 0):
            raise TpusimError(f"repair time {self.repair_s!r} s must be a finite number >= 0")

    @property
    def mtbf_s(self) -> float | None:
        """The slice's mean time between failures (None for a trace)."""
        return None if self.rate_per_s is None else 1.0 / self.rate_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputConfig:
    """One goodput run: `seeds` failure histories (seeded from `seed`), the job checkpointed
    every `checkpoint_interval_s` (rounded to whole steps; None: the interval that maximises
    the mean goodput is searched for and used)."""

    job: JobConfig
    inventory: SliceInventory
    failures: FailureConfig
    checkpoint_interval_s: float | None = None
    seeds: int = 10
    seed: int = 0
    engine: Engine = Engine.EVENT_SKIP

    def __post_init__(self) -> None:
        if not 1 <= self.seeds <= MAX_SEEDS:
            raise TpusimError(f"seeds {self.seeds} must be in [1, {MAX_SEEDS}]")
        if self.failures.trace is not None and self.seeds != 1:
            raise TpusimError("a failure trace is one history; it takes one seed")

    def interval_steps(self, interval_s: float) -> int:
        """A checkpoint interval in whole steps (at least one, at most the job)."""
        k_max = self.job.max_interval_steps
        n = interval_s / self.job.step_time_s
        if not n < k_max:
            return k_max
        return max(1, int(round(n)))
