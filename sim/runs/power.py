"""A step's energy as part of its run, and the power cap (`power_cap`, in W): when the chip's
windowed peak power exceeds the cap, its MXU and VPU clock (`ChipSpec.clock_scale`) comes down,
as DVFS does, until the peak fits.

The cap is a fixed point over whole-step simulations with a scaled chip, never a change inside
an engine: simulate at the chip's clock; if the peak fits, that is the answer; else bisect the
clock on (`MIN_CLOCK`, 1] x the chip's clock for the highest clock whose step fits (power falls
as the clock falls: the same work is spread over a longer step and costs less per operation),
keeping only clocks that were simulated and fit, so the result never exceeds the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.energy import Energy, check_power_cap
from sim.hardware import ChipSpec
from topologies.errors import TpusimError

# The lowest clock the search tries (a fraction of the chip's clock), and how many halvings it
# makes: the clock it returns is within 2^-CAP_ITERATIONS of the highest that fits.
MIN_CLOCK = 1.0 / 16.0
CAP_ITERATIONS = 10


def simulate_with_cap(cap_w: float | None, chip: ChipSpec,
                      simulate: Callable[[ChipSpec], Any],
                      energy_of: Callable[[Any, ChipSpec], Energy]
                      ) -> tuple[Any, ChipSpec, Energy, dict[str, Any] | None]:
    """(result, the chip as run, its Energy, the `power_cap` section or None without a cap).

    Args:
        cap_w: the per-chip cap in watts (None: no cap).
        chip: the chip as bound (overrides applied).
        simulate: runs the whole step on a chip and returns its result.
        energy_of: the Energy of a result on a chip.
    """
    cap = None if cap_w is None else check_power_cap(chip, cap_w)  # before simulating
    result = simulate(chip)
    energy = energy_of(result, chip)
    if cap is None:
        return result, chip, energy, None
    base_time = float(result.step_time_s)
    uncapped_peak = energy.chip_power_w_peak
    sims = 1
    if uncapped_peak > cap:
        def at(scale: float):
            c = chip.with_overrides(clock_scale=chip.clock_scale * scale)
            r = simulate(c)
            return c, r, energy_of(r, c)

        lo = MIN_CLOCK
        best = at(lo)
        sims += 1
        if best[2].chip_power_w_peak > cap:
            raise TpusimError(
                f"{{power_cap}} {cap:g} W: even at {lo:.1%} of the clock the chip peaks at "
                f"{best[2].chip_power_w_peak:.1f} W (HBM, links and idle power do not follow "
                f"the clock); give a cap above that", "power_cap")
        hi = 1.0
        for _ in range(CAP_ITERATIONS):
            mid = 0.5 * (lo + hi)
            trial = at(mid)
            sims += 1
            if trial[2].chip_power_w_peak <= cap:
                lo, best = mid, trial
            else:
                hi = mid
        chip, result, energy = best
    section = {
        "cap_w": cap,
        "clock_scale": chip.clock_scale,
        "uncapped_step_time_s": base_time,
        "uncapped_chip_power_w_peak": uncapped_peak,
        "slowdown": float(result.step_time_s) / base_time if base_time > 0 else 1.0,
        "capped": uncapped_peak > cap,
        "simulations": sims,
    }
    return result, chip, energy, section
