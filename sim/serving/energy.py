"""A serving run's energy and cost, from its iterations' compositions and the step model's
per-unit energy (`sim/energy.py`), computed after the run.

Every engine run behind the cost model (a grid node, or with `exact` costs a distinct
composition) also gives the replica's dynamic joules by unit for that step (`step_energy`: MXU,
VPU, HBM, ICI, DCN and PCIe work times the chip's energy per unit of work). An iteration's time
is a weighted sum of node times (bilinear interpolation), so its dynamic energy is taken as the
same weighted sum of the nodes' energies: the run's dynamic energy is each node's summed weight
times its joules (`IterationCosts.dynamic_joules`), exact with `exact` costs. On top:

* swaps (preemption by swap): each cached token's bytes cross PCIe once each way, read from or
  written to HBM, at the replica chip's `pcie_j_per_byte` and `hbm_j_per_byte`;
* KV transfers (disaggregated): each request's cache bytes on DCN at the prefill chip's
  `dcn_j_per_byte` (or, within one slice, on every ICI link they cross at its
  `ici_j_per_byte`: bytes times the hops), read from the sender's HBM and written to the
  receiver's (both at the prefill chip's `hbm_j_per_byte`);
* static power: every chip of every replica draws `idle_power_w` for the whole span, busy or
  idle (the span rates are counted over: the first arrival to the last finish);
* the host's share (`host_power_share`) and the data centre's (`pue - 1`) on each pool's chip
  joules, as for a step.

Energy is additive by construction: units sum to the total, pools sum to the run. Joules per
token are over output tokens. Cost is chip-hours over the span at each pool's
`usd_per_chip_hour` (null when a pool's chip has no price).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.energy import CHIP_UNITS, UNITS, power_overheads
from sim.serving.costs import DYNAMIC_UNITS


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolWork:
    """What one pool did over a run, beyond its iterations' step energy.

    Attributes:
        role: the pool's role ("both", "prefill", "decode").
        replicas: replicas in the pool; chips_per_replica: chips each.
        chip: the replicas' ChipSpec (power coefficients, price).
        costs: the pool's IterationCosts (every replica's iterations priced through it).
        swap_bytes: bytes its replicas copied between HBM and host memory (out and in).
        sent_bytes: KV-cache bytes its replicas sent to decode replicas.
        sent_ici_hops: 0 when they went over DCN; else the ICI links each byte crossed.
    """

    role: str
    replicas: int
    chips_per_replica: int
    chip: Any
    costs: Any
    swap_bytes: float = 0.0
    sent_bytes: float = 0.0
    sent_ici_hops: int = 0

    @property
    def num_chips(self) -> int:
        return self.replicas * self.chips_per_replica


def pool_joules(pool: PoolWork, span_s: float) -> tuple[dict[str, float], float]:
    """The pool's joules by `UNITS` over the span, and the highest chip power (W) among the
    step compositions its iterations used."""
    dyn, peak = pool.costs.dynamic_joules()
    chip = pool.chip
    units = dict.fromkeys(UNITS, 0.0)
    units.update(zip(DYNAMIC_UNITS, dyn, strict=True))
    units["pcie"] += pool.swap_bytes * chip.pcie_j_per_byte
    units["hbm"] += (pool.swap_bytes + 2.0 * pool.sent_bytes) * chip.hbm_j_per_byte
    if pool.sent_ici_hops:
        units["ici"] += pool.sent_bytes * pool.sent_ici_hops * chip.ici_j_per_byte
    else:
        units["dcn"] += pool.sent_bytes * chip.dcn_j_per_byte
    units["static"] = chip.idle_power_w * pool.num_chips * span_s
    chip_j = sum(units[u] for u in CHIP_UNITS)
    units["host"], units["overhead"] = power_overheads(chip, chip_j)
    return units, max(peak, chip.idle_power_w)


def serving_energy(pools: list[PoolWork], *, span_s: float,
                   output_tokens: int,
                   iterations: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `energy` and `cost` sections of a serving run. Its step is an iteration: `step_j`
    and `usd_per_step` are the run's joules and dollars per iteration of any replica (idle
    time included), so they compare with a decode step's."""
    total = dict.fromkeys(UNITS, 0.0)
    by_pool, peak = [], 0.0
    chips = sum(p.num_chips for p in pools)
    for p in pools:
        units, pk = pool_joules(p, span_s)
        for u, v in units.items():
            total[u] += v
        peak = max(peak, pk)
        chip_j = sum(units[u] for u in CHIP_UNITS)
        by_pool.append({"role": p.role, "num_chips": p.num_chips, "energy_j": sum(units.values()),
                        "energy_j_by_unit": units,
                        "chip_power_w_mean": chip_j / (p.num_chips * span_s)
                        if span_s > 0 else 0.0,
                        "chip_power_w_peak": pk})
    energy_j = sum(total.values())
    chip_total = sum(total[u] for u in CHIP_UNITS)
    energy = {
        "energy_j": energy_j,
        "energy_j_per_chip": energy_j / chips,
        "energy_j_by_unit": total,
        "j_per_token": energy_j / output_tokens if output_tokens else None,
        "chip_power_w_mean": chip_total / (chips * span_s) if span_s > 0 else 0.0,
        "chip_power_w_peak": peak,
        "by_pool": by_pool,
        "step_j": energy_j / iterations if iterations else None,
        "step_j_by_unit": {u: v / iterations for u, v in total.items()} if iterations
        else None,
    }
    prices = [p.chip.usd_per_chip_hour for p in pools]
    if any(x is None for x in prices):
        cost = {"usd_total": None, "usd_per_million_tokens": None, "usd_per_hour": None,
                "usd_per_chip_hour": None, "usd_per_step": None}
    else:
        per_hour = sum(x * p.num_chips for x, p in zip(prices, pools, strict=True))
        usd = per_hour * span_s / 3600.0
        cost = {"usd_total": usd,
                "usd_per_million_tokens": usd / output_tokens * 1e6 if output_tokens else None,
                "usd_per_hour": per_hour,
                "usd_per_chip_hour": prices[0] if len(set(prices)) == 1 else None,
                "usd_per_step": usd / iterations if iterations else None}
    return energy, cost
