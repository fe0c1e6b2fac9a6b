"""What a plan ranks by (the plan request's `objective`): the step time, the dollars per step or the
joules per step; and what turns a step-time lower bound into a bound on the objective (its
least growth per second of step, and the part no candidate can avoid), so that the search
prunes by any objective as it does by time.
"""

from __future__ import annotations

import math
from typing import Any

from sim.energy import clock_energy_factor

# What `plan --objective` ranks by: the step time, the dollars per step (chip-hours: the same
# order as the time on one pod, listed for the column it reads) or the joules per step (the
# whole pod's, host and data centre included; `sim/energy.py`).
OBJECTIVES = ("time", "cost", "energy")


def objective_value(result: dict[str, Any], objective: str) -> float:
    """A simulated candidate's value under `objective` (lower is better)."""
    if objective == "energy":
        return float(result["energy"]["step_j"])
    if objective == "cost":
        v = result["cost"]["usd_per_step"]
        return math.nan if v is None else float(v)
    return float(result["step_time_s"])


def objective_per_second(chip, num_chips: int, objective: str) -> float:
    """The least the objective grows per second of step (what turns a step-time lower bound
    into a bound on it): 1 for time; the pod's price per second for cost; the pod's static
    power, host and data centre included, for energy (dynamic energy only adds). 0: no bound."""
    if objective == "cost":
        return (chip.usd_per_chip_hour or 0.0) * num_chips / 3600.0
    if objective == "energy":
        return chip.idle_power_w * num_chips * (1 + chip.host_power_share) * chip.pue
    return 1.0


def objective_floor(result: dict[str, Any], chip, num_chips: int, objective: str) -> float:
    """The part of the objective no candidate can avoid, beyond its growth per second: for
    energy, the model's FLOPs on the MXU at its cheapest energy per operation (remat and the
    rest only add), host and data centre included; 0 otherwise."""
    if objective != "energy":
        return 0.0
    j = min(chip.mxu_j_per_flop, chip.mxu_int8_j_per_op) * clock_energy_factor(chip)
    return (num_chips * float(result.get("model_flops_per_chip", 0.0)) * j
            * (1 + chip.host_power_share) * chip.pue)


__all__ = ["OBJECTIVES", "objective_floor", "objective_per_second", "objective_value"]
