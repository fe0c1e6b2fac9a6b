"""A simulated run as a value (`Run`): the result fields a command prints as JSON, the
resolved inputs that produced them (recorded under `inputs`, so that a result describes itself and
`tpusim rerun` can reproduce it), and the result objects behind them (tables, traces).

`describe_*` turn chips, topologies, meshes and run settings into the plain JSON-ready dicts
recorded under `inputs`. Nothing here touches the disk.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from sim.hardware import ChipSpec
from topologies.mesh import LogicalMesh, place_mesh
from topologies.torus import AXIS_NAMES, Topology


@dataclass(frozen=True, kw_only=True)
class Run:
    """One command's result.

    Attributes:
        command: the `tpusim` command that ran (`train`, `collective`, `decode`, ...).
        summary: the result fields (`step_time_s`, `mfu`, ...), as JSON prints them.
        inputs: the resolved inputs (chip, topology, model, mesh, settings, flags, version).
        result: the engine's result object (`StepResult`, `CollectiveResult`, ...) with the
            pandas tables (`ops`, `links`, ...); None for commands that aggregate many runs.
        trace: the compiled `Trace`, for training, decode and prefill.
        energy_detail: the step's `sim.energy.Energy` object (its chip classes' power over the
            step), for the commands whose step the engine ran (train, replay, decode, prefill);
            `run.energy` is the result's `energy` section, as for every result field.

    Result fields read as attributes too: `run.step_time_s` is `run.summary["step_time_s"]`.
    """

    command: str
    summary: dict[str, Any]
    inputs: dict[str, Any]
    result: Any = field(default=None, repr=False, compare=False)
    trace: Any = field(default=None, repr=False, compare=False)
    energy_detail: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON (what the CLI prints for `json`): the result fields, then `inputs`."""
        return {**self.summary, "inputs": self.inputs}

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields; `__dict__` lookup avoids recursion while
        # the object is being unpickled (sweeps send runs between processes).
        summary = self.__dict__.get("summary")
        if summary is not None and name in summary:
            return summary[name]
        raise AttributeError(f"{type(self).__name__} has no field or result {name!r}")


def tpusim_version() -> str:
    """The installed package's version (`pyproject.toml`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tpusim")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def describe_chip(chip: ChipSpec) -> dict[str, Any]:
    """Every `ChipSpec` field (efficiencies included) under its chip YAML key."""
    return chip.to_dict()


def describe_topology(topology: Topology) -> dict[str, Any]:
    out = {
        "name": topology.name,
        "shape": list(topology.shape),
        "wraparound": [a for a, w in zip(AXIS_NAMES, topology.wraparound, strict=False) if w],
        "slices": topology.num_slices,
        "num_chips": topology.num_chips,
    }
    if topology.twisted:  # listed only when twisted: plain results read as before
        out["twisted"] = True
    return out


def describe_mesh(mesh: LogicalMesh, topology: Topology) -> dict[str, Any]:
    """The logical mesh and where each axis sits: [physical axis, size, stride] factors."""
    d = mesh.to_dict()
    d.pop("placement", None)
    d["placement"] = {
        name: [list(f) for f in p.factors] for name, p in place_mesh(mesh, topology).items()
    }
    return d


def describe_config(cfg: Any) -> dict[str, Any]:
    """A frozen `*Config` as a plain dict (enums as their text)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.metadata.get("recorded_when_set") and v == f.default:
            continue  # e.g. TrainingConfig.remat_save: only `--remat custom` has it
        if dataclasses.is_dataclass(v):  # a nested setting, e.g. TrainingConfig.moe
            v = describe_config(v)
        out[f.name] = str(v) if isinstance(v, enum.Enum) else v
    return out
