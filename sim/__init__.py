"""tpusim's engine: chips, the ICI/DCN network, collectives, trace replay, exporters and the CLI.

The Python API mirrors the CLI (`sim/api.py`): `sim.collective(...)`, `sim.compare_collectives`,
`sim.train(...)`, `sim.decode(...)`, `sim.prefill(...)`, `sim.serve_sweep(...)`,
`sim.replay_trace(...)` and `sim.rerun(result)` take the commands' flags as keywords and return
a `Run` whose `.to_dict()` is the command's `--json`; `sim.sweep` (a study's points -> a
DataFrame) and `sim.plan` (the best ways to run a training step) run studies. Lower level:
`simulate_collective` (one collective on a pod), `replay` (an SPMD trace on a pod),
`get_chip`/`load_chip` (chip presets or YAML).
"""

from sim.api import (
    collective,
    compare_collectives,
    decode,
    prefill,
    rerun,
    serve_sweep,
    train,
)
from sim.api import replay as replay_trace
from sim.collective_sim import CollectiveResult, simulate_collective
from sim.engine import StepResult, replay
from sim.hardware import CHIPS, ChipSpec, get_chip, load_chip
from sim.planner import plan
from sim.runs import Run
from sim.study import sweep

__all__ = [
    "CHIPS",
    "ChipSpec",
    "CollectiveResult",
    "Run",
    "StepResult",
    "collective",
    "compare_collectives",
    "decode",
    "prefill",
    "replay_trace",
    "rerun",
    "serve_sweep",
    "train",
    "get_chip",
    "load_chip",
    "plan",
    "replay",
    "simulate_collective",
    "sweep",
]
