"""What a step returns: `StepResult` (the step time, its breakdown, HBM, the exporters' tables)
and the parts the executors attach to it (`ChipClasses`, `ClassProgram`, `CollectiveLabels`),
with the tables' column names and the breakdown's words."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sim.engine.memory import as_floats, hbm_occupancy
from topologies.errors import TpusimError
from topologies.groups import (
    GroupAxis,
)
from topologies.torus import Topology
from workloads.memory import MEMORY_CATEGORIES
from workloads.trace import OpKind, Trace

OP_COLUMNS = [
    "chip", "op_id", "name", "kind", "unit", "bound", "layer", "phase", "start_s", "end_s",
    "flops", "bytes", "collective", "mesh_axes",
]
UNIT_COLUMNS = ["chip", "unit", "busy_s", "utilization"]
LINK_CLASS_COLUMNS = ["link_class", "bytes_per_link", "busy_s", "utilization"]
# The memory table: HBM occupancy after every change, in total and by category.
MEMORY_COLUMNS = ["chip", "time_s", "hbm_bytes", *MEMORY_CATEGORIES]
CHIP_COLUMNS = [
    "chip", "coords", "chip_class", "finish_s", "mxu_busy_s", "vpu_busy_s", "hbm_busy_s",
    "pcie_busy_s", "collective_wait_s",
]
BREAKDOWN_KEYS = ("mxu_compute_s", "vpu_s", "hbm_bound_s", "exposed_comm_s", "pipeline_bubble_s")
# The breakdown in words, for text reports and plots (the JSON keeps the field names).
BREAKDOWN_LABELS = {"mxu_compute_s": "MXU compute", "vpu_s": "VPU compute",
                    "hbm_bound_s": "HBM-bound ops", "exposed_comm_s": "exposed communication",
                    "pipeline_bubble_s": "pipeline bubble"}


def breakdown_label(key: str) -> str:
    """The words for a breakdown field (`exposed_comm_s` -> "exposed communication")."""
    return BREAKDOWN_LABELS.get(key, key.removesuffix("_s").replace("_", " "))


class ClassProgram(NamedTuple):
    """A chip class's own program (pipeline stages run different ones): the program, its ops'
    bound units, and per collective or send op its link classes (bytes per link of that
    class) and algorithm."""

    trace: Trace
    bound: list[str]
    link_classes: dict[int, dict[str, float]]
    algorithms: dict[int, str]


@dataclass(frozen=True, kw_only=True)
class CollectiveLabels:
    """The reported chip's collectives, for the exporters: per collective (or send) op id its
    physical group axes, the link classes it loads with its bytes per link of that class, and
    its algorithm; and every link class's capacity (bytes/s per link)."""

    axes: dict[int, tuple[GroupAxis, ...]] = field(default_factory=dict)
    link_classes: dict[int, dict[str, float]] = field(default_factory=dict)
    algorithms: dict[int, str] = field(default_factory=dict)
    class_capacity: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ChipClasses:
    """The per-chip engine's chip classes (`sim.engine.perchip.chip_classes`).

    Attributes:
        of_chip: every chip's class.
        reps: each class's representative (its first chip); counts: its number of chips.
        rows: per class (finish s, MXU, VPU, HBM and PCIe busy s, collective wait s).
        timelines: per class, its ops' (start, end) arrays.
        program: the reported (slowest) chip's program, whose HBM events the memory table has.
        programs: per class its own program where classes run several (pipeline stages).
        titles: per class a title (its pipeline stage), for the Perfetto processes.
        p2p: the point-to-point sends (`PointToPoint`) and the program of each class, or None.
        op_scale: the run's per-chip factors on ops' sizes ({op id: per chip}; MoE expert loads).
    """

    of_chip: np.ndarray
    reps: np.ndarray
    counts: np.ndarray
    rows: list[tuple]
    timelines: dict[int, tuple[np.ndarray, np.ndarray]]
    program: Trace | None = None
    programs: dict[int, ClassProgram] = field(default_factory=dict)
    titles: dict[int, str] = field(default_factory=dict)
    p2p: tuple | None = None
    op_scale: Mapping[int, np.ndarray] = field(default_factory=dict)


@dataclass(kw_only=True)
class StepResult:
    """A replayed step: scalars plus pandas tables built on demand.

    The parts the exporters read: the tables' rows (`op_rows`, `unit_rows`, `link_class_rows`,
    `memory_rows`), the pod (`pod`), the collectives' labels (`collectives`), on the per-chip
    engine the bytes and capacity of every link (`link_bytes`, `link_capacity`, by link id)
    and the chip classes (`classes`); `vector_stats` when vector classes ran."""

    step_time_s: float
    breakdown: dict[str, float]
    hbm_peak_bytes: float
    hbm_capacity_bytes: float
    hbm_peak_breakdown: dict[str, float]
    fits_in_hbm: bool
    num_ops: int
    sim_events: int
    chip: str
    topology: str
    num_chips: int
    collective_costs: dict[str, Any] = field(default_factory=dict)
    op_rows: list[tuple] = field(default_factory=list, repr=False)
    unit_rows: list[tuple] = field(default_factory=list, repr=False)
    link_class_rows: list[tuple] = field(default_factory=list, repr=False)
    memory_rows: list[tuple] = field(default_factory=list, repr=False)
    pod: Topology | None = field(default=None, repr=False)
    collectives: CollectiveLabels = field(default_factory=CollectiveLabels, repr=False)
    # Per-chip engine (`sim.engine.executors.simulate_chips`); the representative replay leaves the
    # defaults (one class, every chip like chip 0).
    num_chip_classes: int = 1
    slowest_chip: str = ""
    critical_path: list[dict[str, Any]] = field(default_factory=list)
    classes: ChipClasses | None = field(default=None, repr=False)
    link_bytes: np.ndarray | None = field(default=None, repr=False)  # per link id
    link_capacity: np.ndarray | None = field(default=None, repr=False)
    vector_stats: dict[str, int] | None = field(default=None, repr=False)

    @property
    def ops(self):
        import pandas as pd

        return pd.DataFrame(self.op_rows, columns=OP_COLUMNS)

    @property
    def units(self):
        import pandas as pd

        return pd.DataFrame(self.unit_rows, columns=UNIT_COLUMNS)

    @property
    def links(self):
        """One row per link class (`LINK_CLASS_COLUMNS`); on a slice of 4x4x4 cubes joined by
        optical switches (v4, v5p) also `ocs_links`, how many of the class's links go through
        a switch (between cubes) rather than stay inside a cube."""
        import pandas as pd

        df = pd.DataFrame(self.link_class_rows, columns=LINK_CLASS_COLUMNS)
        pod = self.pod
        if pod is not None and getattr(pod, "ocs", False):
            nl = 2 * pod.ndim
            mask = pod.ocs_link_mask()[: pod.num_ici_links]
            per = np.bincount(np.flatnonzero(mask) % nl, minlength=nl)
            names = {"xyz"[c // 2] + "+-"[c % 2]: int(per[c]) for c in range(nl)}
            df["ocs_links"] = [names.get(str(c), 0) for c in df["link_class"]]
        return df

    @property
    def memory(self):
        import pandas as pd

        return pd.DataFrame(self.memory_rows, columns=MEMORY_COLUMNS)

    def for_class(self, k: int, static_hbm_bytes: float = 0.0) -> StepResult:
        """This result as seen by chip class `k` (per-chip engine): its op timeline (same program
        as the class that finished last) and its HBM occupancy; scalars stay the step's."""
        cls = self.classes
        if cls is None or k not in cls.timelines:
            return self
        start, end = cls.timelines[k]
        rep = int(cls.reps[k])
        mem_trace = cls.program
        own = cls.programs.get(k)
        labels = {}
        if own is not None and own.trace is not cls.program:  # another program (stage)
            mem_trace = own.trace
            ops = [(rep,) + r[1:] for r in op_rows(own.trace, own.bound, start, end)]
            labels = {"collectives": dataclasses.replace(
                self.collectives, link_classes=own.link_classes, algorithms=own.algorithms)}
        else:
            ops = [(rep,) + r[1:8] + (float(start[r[1]]), float(end[r[1]])) + r[10:]
                   for r in self.op_rows]
        if mem_trace is None:
            mem = [(rep, 0.0, static_hbm_bytes, *(0.0 for _ in MEMORY_CATEGORIES))]
        else:
            _, _, rows = hbm_occupancy(mem_trace, end, 1)
            mem = [(rep,) + r[1:] for r in rows]
        return dataclasses.replace(self, op_rows=ops, memory_rows=mem, **labels)

    @property
    def chips(self):
        """One row per chip (CHIP_COLUMNS): its class, finish time, busy time per unit and time
        spent waiting for the other members of its collectives. Needs the per-chip engine."""
        import pandas as pd

        if self.classes is None or self.pod is None:
            raise TpusimError("the per-chip table needs the per-chip engine (simulate_chips)")
        topo = self.pod
        label = self.classes.of_chip
        rows = np.asarray(self.classes.rows, dtype=float)[label]
        coords = topo.all_coords()[np.arange(topo.num_chips) % topo.chips_per_slice]
        text = [",".join(map(str, r)) for r in coords.tolist()]
        if topo.num_slices > 1:
            text = [f"{t},{i // topo.chips_per_slice}" for i, t in enumerate(text)]
        return pd.DataFrame({
            "chip": np.arange(topo.num_chips), "coords": text, "chip_class": label,
            "finish_s": rows[:, 0], "mxu_busy_s": rows[:, 1], "vpu_busy_s": rows[:, 2],
            "hbm_busy_s": rows[:, 3], "pcie_busy_s": rows[:, 4],
            "collective_wait_s": rows[:, 5],
        }, columns=CHIP_COLUMNS)


def op_rows(trace, bound, start, end) -> list[tuple]:
    """The ops table's rows (OP_COLUMNS; chip 0) of one chip's timeline."""
    start, end = as_floats(start), as_floats(end)
    return [(
        0, o.id, o.name, str(o.kind), str(o.unit) if o.kind == OpKind.COMPUTE else bound[o.id],
        bound[o.id], o.layer, o.phase, start[o.id], end[o.id], float(o.flops),
        float(o.hbm_bytes if o.kind == OpKind.COMPUTE else o.bytes), o.collective,
        ",".join(o.mesh_axes),
    ) for o in trace.ops]
