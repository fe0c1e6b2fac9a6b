"""The request of a training job's goodput under failures (`tpusim goodput`): the `train`
settings, the job's length, the failures, repairs, spares and checkpoints."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from sim.runs.requests.base import (
    PERTURB_FIELDS,
    POD_FIELDS,
    request_dataclass,
)
from sim.runs.requests.training import TRAINING_FIELDS, TrainRequest
from topologies.validate import (
    MAX_CHIPS,
    FlagError,
    ascii_float,
    int_flag,
    short_repr,
)


def _bounded_number(name: str, *, lo: float, hi: float, lo_open: bool, hi_open: bool = False,
                    fix: str) -> Callable[[Any], float]:
    """A finite number in [lo, hi] (open ends where said), in ASCII, for the setting `name`;
    the error names the value, the rule and `fix` (which may name it as `{name}`)."""
    who = f"{{{name}}}"

    def conv(text: Any) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{who} {short_repr(text)} is not a number; {fix}", name) from None
        if not math.isfinite(v):
            raise FlagError(f"{who} {short_repr(text)} is not finite; {fix}", name)
        if v < lo or (lo_open and v <= lo):
            rule = f"{'>' if lo_open else '>='} {lo:g}"
        elif v > hi or (hi_open and v >= hi):
            rule = f"{'<' if hi_open else '<='} {hi:g}"
        else:
            return v
        raise FlagError(f"{who} {short_repr(text)} breaks the rule: it must be {rule}; {fix}",
                        name)

    conv.__name__ = "number"
    return conv


# The longest job `goodput` simulates: a century of wall clock or of steps.
MAX_GOODPUT_HOURS = 876_600.0
MAX_GOODPUT_STEPS = 10**12
_GOODPUT = ("step_time", "steps", "hours", "mtbf_hours", "chip_mtbf_hours", "host_mtbf_hours",
            "host_availability", "failure_trace", "repair_hours", "chips_per_host",
            "spare_cubes", "no_ocs", "checkpoint_interval", "checkpoint_cost", "restart_cost",
            "swap_cost", "storage_bytes_per_s", "seeds", "engine")
_MTBF_FIX = "give hours between failures, e.g. {{{name}}} {eg}"


@request_dataclass
class GoodputRequest(TrainRequest):
    """A training job's goodput under failures (`tpusim goodput`): the job (a step time, or
    the `train` settings whose step `sim.run` simulates; steps or wall-clock hours), the
    failures (an MTBF for the slice, per chip and per host, or a trace file), repairs, spare
    cubes and the optical switches, checkpoints and restarts, and the seeds. `seed` seeds the
    failure draws as well as the perturbations."""

    COMMAND: ClassVar[str] = "goodput"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", *_GOODPUT, *TRAINING_FIELDS, "algorithm", *PERTURB_FIELDS,
        "mode", "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "step_time": _bounded_number(
            "step_time", lo=0.0, hi=1e7, lo_open=True,
            fix="give the seconds one training step takes, e.g. {step_time} 12.5 (or the train "
                "flags, to simulate it)"),
        "steps": int_flag("steps", hi=MAX_GOODPUT_STEPS),
        "hours": _bounded_number(
            "hours", lo=0.0, hi=MAX_GOODPUT_HOURS, lo_open=True,
            fix="give the job's wall-clock hours, e.g. {hours} 720 (a month)"),
        **{name: _bounded_number(name, lo=0.0, hi=1e12, lo_open=True,
                                 fix=_MTBF_FIX.format(name=name, eg=eg))
           for name, eg in (("mtbf_hours", "12"), ("chip_mtbf_hours", "5e6"),
                            ("host_mtbf_hours", "5e5"))},
        "host_availability": _bounded_number(
            "host_availability", lo=0.0, hi=1.0, lo_open=True, hi_open=True,
            fix="give the share of time a host is up, e.g. {host_availability} 0.995"),
        "repair_hours": _bounded_number("repair_hours", lo=0.0, hi=1e6, lo_open=False,
            fix="give the hours a failed chip or host takes to come back, e.g. "
                "{repair_hours} 4"),
        "chips_per_host": int_flag("chips_per_host", hi=64),
        "spare_cubes": int_flag("spare_cubes", lo=0, hi=MAX_CHIPS),
        **{name: _bounded_number(name, lo=0.0, hi=1e9, lo_open=False,
                                 fix=f"give seconds >= 0, e.g. {{{name}}} {eg}")
           for name, eg in (("checkpoint_cost", "60"), ("restart_cost", "600"),
                            ("swap_cost", "30"))},
        "checkpoint_interval": _bounded_number("checkpoint_interval", lo=0.0, hi=1e12, lo_open=True,
            fix="give seconds of training between checkpoints, e.g. {checkpoint_interval} "
                "1800, or leave it out to search for the best"),
        "storage_bytes_per_s": _bounded_number("storage_bytes_per_s", lo=0.0, hi=1e15, lo_open=True,
            fix="give the checkpoint storage's bytes per second for the whole slice, e.g. "
                "{storage_bytes_per_s} 2e10"),
        "seeds": int_flag("seeds", hi=1000),
    }
    # The train flags the step model reads: none of them applies with --step-time.
    STEP_MODEL: ClassVar[tuple[str, ...]] = ("overrides", *TRAINING_FIELDS, "algorithm",
                                             *(p for p in PERTURB_FIELDS if p != "seed"), "mode",
                                             "power_cap")

    step_time: float | None = None
    steps: int | None = None
    hours: float | None = None
    mtbf_hours: float | None = None
    chip_mtbf_hours: float | None = None
    host_mtbf_hours: float | None = None
    host_availability: float | None = None
    failure_trace: str | None = None
    repair_hours: float | None = None
    chips_per_host: int | None = None
    spare_cubes: int = 0
    no_ocs: bool = False
    checkpoint_interval: float | None = None
    checkpoint_cost: float | None = None
    restart_cost: float | None = None
    swap_cost: float = 0.0
    storage_bytes_per_s: float | None = None
    seeds: int | None = None
    engine: str = "event-skip"


