"""tpusim's engine: chips, the ICI/DCN network, collectives, trace replay, exporters and the CLI.

The main entry points, importable from `sim` directly:
`simulate_collective` (one collective on a pod), `replay` (an SPMD trace on a pod),
`get_chip`/`load_chip` (chip presets or YAML), `sweep` (a study's points -> a DataFrame) and
`plan` (the best ways to run a training step).
"""

from sim.collective_sim import CollectiveResult, simulate_collective
from sim.engine import StepResult, replay
from sim.hardware import CHIPS, ChipSpec, get_chip, load_chip
from sim.planner import plan
from sim.study import sweep

__all__ = [
    "CHIPS",
    "ChipSpec",
    "CollectiveResult",
    "StepResult",
    "get_chip",
    "load_chip",
    "plan",
    "replay",
    "simulate_collective",
    "sweep",
]
