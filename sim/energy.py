"""Energy, power and cost of a simulated step or collective, computed after the run from what the
engine already produced (the trace's per-op work, each collective's bytes per link class, the op
timeline of every chip class, the step time); nothing here runs inside an engine.

The model (docs/model/energy.md): a chip's energy over a step is its dynamic energy, the work
each unit did times the chip's energy per unit of work (`ChipSpec.*_j_per_*`: MXU FLOPs by dtype,
VPU FLOPs, HBM bytes, bytes sent on ICI and DCN, PCIe bytes), plus its static power
(`idle_power_w`) for the whole step; the host adds `host_power_share` joules per chip joule and
the data centre `pue - 1` joules per IT joule. An op's dynamic energy is spread evenly over its
interval on the timeline, so power over time is piecewise constant; the peak is the highest
mean over a window of `POWER_WINDOW_S`. Energy is additive by construction: the units sum to
the total, steps add, a pod is the sum of its chip classes. Cost is chip-hours at
`usd_per_chip_hour` (a cloud price already covers power).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.groups import CLASS_NAMES, DCN_IN_CLASS, DCN_OUT_CLASS
from workloads.trace import OpKind, Trace

# The units a step's joules are split into (`step_j_by_unit`), chip units first.
CHIP_UNITS = ("mxu", "vpu", "hbm", "ici", "dcn", "pcie", "static")
UNITS = (*CHIP_UNITS, "host", "overhead")
# The window power is averaged over for its peak: the time constant of on-chip power management
# (DVFS and power capping act over milliseconds; assumed, docs/model/energy.md).
POWER_WINDOW_S = 1e-3
# The shortest interval an op's energy is spread over in the power timeline.
MIN_SPREAD_S = 1e-9
_ICI_CLASSES = tuple(c for i, c in enumerate(CLASS_NAMES) if i not in (DCN_OUT_CLASS,
                                                                      DCN_IN_CLASS))
_DCN_OUT = CLASS_NAMES[DCN_OUT_CLASS]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassEnergy:
    """One chip class's energy over the step, per chip of the class.

    Attributes:
        chip_class: the class (0 = chip 0's); chip: its representative's coordinates.
        num_chips: chips in the class.
        chip_j_by_unit: joules one chip of the class uses, by `UNITS` (host and overhead are its
            share).
        chip_power_w_mean: the chip's own power (the `CHIP_UNITS`) averaged over the step.
        chip_power_w_peak: the chip's highest power averaged over a `POWER_WINDOW_S` window.
        power_w: the chip's own power over the step, piecewise constant: (time s, watts from
            then on) at every change, from 0 to the step's end (`power_steps`); the Perfetto
            power counter and the power plot.
    """

    chip_class: int
    chip: str
    num_chips: int
    chip_j_by_unit: dict[str, float]
    chip_power_w_mean: float
    chip_power_w_peak: float
    power_w: tuple[tuple[float, float], ...] = field(default=(), compare=False, repr=False)

    @property
    def chip_j(self) -> float:
        return sum(self.chip_j_by_unit.values())


@dataclass(frozen=True, kw_only=True)
class Energy:
    """A step's (or collective's) energy for the whole pod, and its cost.

    Attributes:
        time_s: the step time the chips are powered for.
        num_chips: chips in the pod.
        step_j_by_unit: the pod's joules by `UNITS`; `step_j` their sum.
        chip_power_w_mean: chip power averaged over the step and the pod's chips (the chip
            alone: no host or data-centre share, as the measured chip figures are).
        chip_power_w_peak: the highest windowed power of any chip class.
        tokens: tokens the step produces (training tokens; output tokens in decode; prompt
            tokens in prefill), None where the run has none.
        usd_per_chip_hour: the price (None: the chip has no list price).
        classes: per chip class, its own figures.
        power_window_s: the window of the peak.
    """

    time_s: float
    num_chips: int
    step_j_by_unit: dict[str, float]
    chip_power_w_mean: float
    chip_power_w_peak: float
    tokens: float | None
    usd_per_chip_hour: float | None
    classes: tuple[ClassEnergy, ...] = field(default=())
    power_window_s: float = POWER_WINDOW_S

    @property
    def step_j(self) -> float:
        return sum(self.step_j_by_unit.values())

    @property
    def j_per_token(self) -> float | None:
        return self.step_j / self.tokens if self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        """The `energy` section of a result."""
        out = {
            "step_j": self.step_j,
            "step_j_per_chip": self.step_j / self.num_chips,
            "step_j_by_unit": dict(self.step_j_by_unit),
            "chip_power_w_mean": self.chip_power_w_mean,
            "chip_power_w_peak": self.chip_power_w_peak,
            "j_per_token": self.j_per_token,
            "power_window_s": self.power_window_s,
        }
        if len(self.classes) > 1:
            out["by_chip_class"] = [{
                "chip_class": c.chip_class, "chip": c.chip, "num_chips": c.num_chips,
                "chip_j": c.chip_j, "chip_power_w_mean": c.chip_power_w_mean,
                "chip_power_w_peak": c.chip_power_w_peak} for c in self.classes]
        return out

    def cost(self) -> dict[str, Any]:
        """The `cost` section: dollars per step, per million tokens and per hour of the job
        (null without a price; per million tokens also null without tokens)."""
        price = self.usd_per_chip_hour
        if price is None:
            return {"usd_per_step": None, "usd_per_million_tokens": None, "usd_per_hour": None,
                    "usd_per_chip_hour": None}
        per_hour = price * self.num_chips
        per_step = per_hour * self.time_s / 3600.0
        return {
            "usd_per_step": per_step,
            "usd_per_million_tokens": per_step / self.tokens * 1e6 if self.tokens else None,
            "usd_per_hour": per_hour,
            "usd_per_chip_hour": price,
        }


def power_overheads(chip: ChipSpec, chip_j: float) -> tuple[float, float]:
    """(host J, data-centre overhead J) on top of `chip_j` chip joules."""
    host = chip.host_power_share * chip_j
    return host, (chip.pue - 1.0) * (chip_j + host)


def clock_energy_factor(chip: ChipSpec) -> float:
    """How much an MXU or VPU operation's energy is at the chip's clock: `clock_scale **
    clock_energy_exponent` (1 at the nominal clock)."""
    return chip.clock_scale ** chip.clock_energy_exponent


def op_energies(trace: Trace, chip: ChipSpec, link_classes: dict[int, dict[str, float]],
                scale: dict[int, float] | None = None) -> np.ndarray:
    """Every op's dynamic joules on one chip, by unit: an array (ops x 6) in `CHIP_UNITS`
    order without `static`.

    A compute op: its FLOPs on its unit (int8 MXU ops at the int8 energy) and its HBM bytes. A
    collective: the bytes the chip sends on each link class (the class's bytes per link, which
    is what one chip sends on its link of that direction), ICI or DCN, each byte also read from
    and written to HBM once (sent from and received into buffers). A host transfer: its PCIe
    bytes, also through HBM. `scale`: per op id a factor on its work (MoE expert loads).
    """
    out = np.zeros((len(trace.ops), 6))
    clock = clock_energy_factor(chip)
    for op in trace.ops:
        k = 1.0 if scale is None else scale.get(op.id, 1.0)
        _op_row(op, chip, link_classes, k, clock, out[op.id])
    return out


def _op_row(op, chip: ChipSpec, link_classes: dict[int, dict[str, float]], k: float,
            clock: float, row: np.ndarray) -> None:
    """One op's dynamic joules by unit into `row` (`op_energies`' rule)."""
    if op.kind == OpKind.COMPUTE:
        if op.unit == "mxu":
            j = chip.mxu_int8_j_per_op if op.dtype in ("int8", "fp8") else chip.mxu_j_per_flop
            row[0] = op.flops * k * j * clock
        else:
            row[1] = op.flops * k * chip.vpu_j_per_flop * clock
        row[2] = op.hbm_bytes * k * chip.hbm_j_per_byte
    elif op.kind == OpKind.COLLECTIVE:
        per_link = link_classes.get(op.id, {})
        ici = sum(v for c, v in per_link.items() if c in _ICI_CLASSES) * k
        dcn = per_link.get(_DCN_OUT, 0.0) * k
        row[3] = ici * chip.ici_j_per_byte
        row[4] = dcn * chip.dcn_j_per_byte
        row[2] = 2.0 * (ici + dcn) * chip.hbm_j_per_byte
    elif op.kind == OpKind.HOST:
        row[5] = op.bytes * k * chip.pcie_j_per_byte
        row[2] = op.bytes * k * chip.hbm_j_per_byte


def class_op_energies(trace: Trace, chip: ChipSpec, link_classes: dict[int, dict[str, float]],
                      scale: dict[int, float] | None, base: np.ndarray) -> np.ndarray:
    """`op_energies(trace, chip, link_classes, scale)` from `base`, the same program's table
    without a scale: only the ops whose factor is not 1 are costed again, by the same rule
    (every chip class of a step shares its program, so a 512-class step costs its ops once,
    not 512 times; equal to the op-by-op table to the last bit, tests/test_energy.py)."""
    scaled = [(i, k) for i, k in (scale or {}).items() if k != 1.0]
    if not scaled:
        return base
    out = base.copy()
    clock = clock_energy_factor(chip)
    for i, k in scaled:
        out[i] = 0.0
        _op_row(trace.ops[i], chip, link_classes, k, clock, out[i])
    return out


def _ramps(start: np.ndarray, end: np.ndarray, joules: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """The breakpoints of the power of ops spreading `joules` evenly over [start, end] (ops of
    no energy left out), in time order, and the change of power at each: +j/d at a start,
    -j/d at an end. The last breakpoint is the last op's end."""
    keep = joules > 0
    s, e, j = start[keep], end[keep], joules[keep]
    # An op shorter than `MIN_SPREAD_S` (an instant one) deposits its energy over that long: a
    # nanosecond against a millisecond window moves nothing, and keeps the slopes finite. `d`
    # is recomputed as the difference of the floats, so every ramp adds up to its joules.
    e = np.maximum(e, s + MIN_SPREAD_S)
    d = e - s
    t = np.concatenate([s, e])
    slope = np.concatenate([j / d, -j / d])
    order = np.argsort(t, kind="stable")
    return t[order], slope[order]


def peak_power_w(start: np.ndarray, end: np.ndarray, joules: np.ndarray, time_s: float,
                 window_s: float = POWER_WINDOW_S) -> float:
    """The highest mean dynamic power over any window of `window_s` (the step's length if
    shorter) when each op's `joules` are spread evenly over [start, end].

    Exact: the cumulative energy is piecewise linear with breakpoints at the ops' starts and
    ends, so a window's energy is extremal when one of its edges sits on a breakpoint or the
    window sits at either end of the step.
    """
    if time_s <= 0 or len(joules) == 0 or not np.any(joules > 0):
        return 0.0
    t, slope = _ramps(start, end, joules)
    time_s = max(time_s, float(t[-1]))
    w = min(window_s, time_s)
    rate = np.cumsum(slope)  # power just after each breakpoint
    cum = np.concatenate([[0.0], np.cumsum(rate[:-1] * np.diff(t))])
    # Windows [b, b + w] and [b - w, b] for every breakpoint b, kept inside [0, time_s].
    lo = np.clip(np.concatenate([t, t - w, [0.0, time_s - w]]), 0.0, max(time_s - w, 0.0))
    hi = lo + w
    energy = np.interp(hi, t, cum, left=0.0) - np.interp(lo, t, cum, left=0.0)
    return float(max(energy.max() / w, 0.0))


def power_steps(start: np.ndarray, end: np.ndarray, joules: np.ndarray, time_s: float,
                idle_w: float) -> tuple[tuple[float, float], ...]:
    """A chip's power over [0, `time_s`] when each op's `joules` are spread evenly over its
    [start, end] (as `peak_power_w` spreads them) on top of `idle_w`: ((t, watts from t on),
    ...) at every change, the last at `time_s` back to idle. Integrating it gives the op
    joules plus `idle_w * time_s` (tests/test_energy.py)."""
    joules = np.asarray(joules, dtype=float)
    if not np.any(joules > 0):
        return ((0.0, float(idle_w)), (float(time_s), float(idle_w)))
    t, slope = _ramps(np.asarray(start, dtype=float), np.asarray(end, dtype=float), joules)
    last = np.r_[t[1:] != t[:-1], True]  # one value per distinct time, after all its changes
    t, rate = t[last], np.cumsum(slope)[last]
    rate = np.where(np.abs(rate) < 1e-9 * max(float(np.abs(slope).max()), 1.0), 0.0, rate)
    watts = idle_w + np.maximum(rate, 0.0)
    keep = np.r_[True, watts[1:] != watts[:-1]]  # drop samples that change nothing
    out = [(0.0, float(idle_w))] if t[0] > 0 else []
    out += zip(t[keep].tolist(), watts[keep].tolist(), strict=True)  # Python floats, exact
    if out[-1][0] < time_s:
        out.append((float(time_s), float(idle_w)))
    return tuple(out)


def _class_programs(result, trace: Trace):
    """[(class, representative, chips, program, link classes, (start, end))] of a step."""
    cls = result.classes
    labels = result.collectives.link_classes
    if cls is None:
        rows = result.op_rows
        start = np.array([r[8] for r in rows], dtype=float)
        end = np.array([r[9] for r in rows], dtype=float)
        return [(0, 0, result.num_chips, trace, labels, (start, end))]
    out = []
    for k in range(len(cls.counts)):
        prog, links = cls.program or trace, labels
        own = cls.programs.get(k)
        if own is not None:
            prog, links = own.trace, own.link_classes
        out.append((k, int(cls.reps[k]), int(cls.counts[k]), prog, links, cls.timelines[k]))
    return out


def step_energy(result, trace: Trace, chip: ChipSpec, *, tokens: float | None,
                op_scale: dict[int, np.ndarray] | None = None,
                window_s: float = POWER_WINDOW_S) -> Energy:
    """The energy of a simulated step (`StepResult`) of `trace` on `chip`.

    Args:
        result: the engine's StepResult (its chip classes and their timelines).
        trace: the program the step ran (each class's own program where classes differ).
        chip: the chip it ran on (its power coefficients and clock).
        tokens: tokens the step produces, for `j_per_token` (None: none).
        op_scale: {op id: per-chip factor} on a compute op's work (MoE expert loads), as the
            engine was given them.
        window_s: the window of the peak power, seconds.
    """
    t = float(result.step_time_s)
    pod = result.pod
    classes = []
    pod_j = dict.fromkeys(UNITS, 0.0)
    unscaled: dict[tuple[int, int], np.ndarray] = {}  # per (program, link classes): its table
    for k, rep, count, prog, links, (start, end) in _class_programs(result, trace):
        scale = None
        if op_scale:
            scale = {i: float(v[rep]) for i, v in op_scale.items()
                     if i < len(prog.ops)}
        key = (id(prog), id(links))
        if key not in unscaled:
            unscaled[key] = op_energies(prog, chip, links)
        per_op = class_op_energies(prog, chip, links, scale, unscaled[key])
        start = np.asarray(start, dtype=float)[: len(per_op)]
        end = np.asarray(end, dtype=float)[: len(per_op)]
        dyn = per_op.sum(axis=0)
        units = dict(zip(CHIP_UNITS, [*map(float, dyn), chip.idle_power_w * t], strict=True))
        chip_j = sum(units.values())
        units["host"], units["overhead"] = power_overheads(chip, chip_j)
        op_j = per_op.sum(axis=1)
        peak = chip.idle_power_w + peak_power_w(start, end, op_j, t, window_s)
        name = pod.coords_text(rep) if pod is not None else str(rep)
        classes.append(ClassEnergy(chip_class=k, chip=name, num_chips=count,
                                   chip_j_by_unit=units,
                                   chip_power_w_mean=chip_j / t if t > 0 else 0.0,
                                   chip_power_w_peak=peak,
                                   power_w=power_steps(start, end, op_j, t,
                                                       chip.idle_power_w)))
        for u, v in units.items():
            pod_j[u] += v * count
    n = result.num_chips
    chip_total = sum(pod_j[u] for u in CHIP_UNITS)
    return Energy(time_s=t, num_chips=n, step_j_by_unit=pod_j,
                  chip_power_w_mean=chip_total / (n * t) if t > 0 else 0.0,
                  chip_power_w_peak=max(c.chip_power_w_peak for c in classes),
                  tokens=tokens, usd_per_chip_hour=chip.usd_per_chip_hour,
                  classes=tuple(classes), power_window_s=window_s)


def collective_energy(res, chip: ChipSpec) -> Energy:
    """The energy of one collective (`CollectiveResult`) over its duration: every link's bytes
    at the ICI or DCN energy per byte, the DMA bytes of the chips in its groups at the HBM
    energy, every chip's static power. The peak is the busiest chip's mean power over the
    collective (the pod's chips run one collective, no timeline of their own)."""
    topo = res.pod
    t = float(res.time_s)
    n_ici = topo.num_ici_links
    lb = np.asarray(res.link_bytes, dtype=float)
    ici_per_chip = lb[:n_ici].reshape(-1, 2 * topo.ndim).sum(axis=1)  # rows: source chips
    dcn_out = lb[n_ici:n_ici + topo.num_chips] if len(lb) > n_ici else np.zeros(0)
    chips_in_groups = res.group_size * res.num_groups
    hbm = res.hbm_bytes_per_chip * chips_in_groups
    units = dict.fromkeys(UNITS, 0.0)
    units["ici"] = float(ici_per_chip.sum()) * chip.ici_j_per_byte
    units["dcn"] = float(dcn_out.sum()) * chip.dcn_j_per_byte
    units["hbm"] = hbm * chip.hbm_j_per_byte
    units["static"] = chip.idle_power_w * t * res.num_chips
    chip_j = sum(units[u] for u in CHIP_UNITS)
    units["host"], units["overhead"] = power_overheads(chip, chip_j)
    busiest = chip.ici_j_per_byte * float(ici_per_chip.max(initial=0.0))
    if len(dcn_out):
        busiest = max(busiest, float(np.max(chip.ici_j_per_byte * ici_per_chip[:len(dcn_out)]
                                            + chip.dcn_j_per_byte * dcn_out)))
    busiest += chip.hbm_j_per_byte * res.hbm_bytes_per_chip
    n = res.num_chips
    return Energy(time_s=t, num_chips=n, step_j_by_unit=units,
                  chip_power_w_mean=chip_j / (n * t) if t > 0 else 0.0,
                  chip_power_w_peak=chip.idle_power_w + (busiest / t if t > 0 else 0.0),
                  tokens=None, usd_per_chip_hour=chip.usd_per_chip_hour, power_window_s=t)


def energy_summary(energy: Energy) -> dict[str, Any]:
    """The `energy` and `cost` sections a result prints."""
    return {"energy": energy.to_dict(), "cost": energy.cost()}


def check_power_cap(chip: ChipSpec, cap_w: float) -> float:
    """`cap_w` as a per-chip power cap in watts, refused when no clock can meet it: below the
    chip's idle power (static power does not scale with the clock)."""
    if isinstance(cap_w, bool) or not isinstance(cap_w, (int, float)) \
            or not math.isfinite(cap_w) or cap_w <= 0:
        raise TpusimError(f"{{power_cap}} {cap_w!r} is not a power; give watts per chip > 0, "
                          f"e.g. {{power_cap}} 150", "power_cap")
    if cap_w <= chip.idle_power_w:
        raise TpusimError(
            f"{{power_cap}} {cap_w:g} W is at or below {chip.name}'s idle power "
            f"({chip.idle_power_w:.1f} W, idle_power_w), which no clock lowers; give a cap "
            f"above {chip.idle_power_w:.1f} W", "power_cap")
    return float(cap_w)
