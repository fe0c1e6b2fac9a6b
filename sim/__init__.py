"""tpusim: a discrete-event simulator of TPU pods.

The Python API: typed requests (`sim.TrainRequest`, `sim.CollectiveRequest`,
`sim.DecodeRequest`, `sim.PrefillRequest`, `sim.ReplayRequest`, `sim.ServeSweepRequest`,
`sim.ServeRequest`, `sim.GoodputRequest`, `sim.CompareCollectivesRequest`) run by
`sim.run(request)`, or one function per command (`sim.train(request)` or
`sim.train(seq_len=..., ...)` with the settings as keywords; likewise `sim.collective`,
`sim.compare_collectives`, `sim.decode`, `sim.prefill`, `sim.serve_sweep`, `sim.serve`
(requests served over time), `sim.goodput` (a training job under failures),
`sim.replay_trace`, and `sim.rerun(result)`), each returning a `Run` whose `.to_dict()` is the
command's JSON result; `sim.sweep` (a study's points -> a DataFrame), `sim.plan` (the best ways
to run a training step) and `sim.plan_serving` (the deployment serving a workload within an SLO
with the most output tokens per second per chip; `sim.ServePlanConfig` its search space) run
studies. Lower level: `simulate_collective` (one collective on a
pod), `replay` (an SPMD trace on a pod), `get_chip`/`load_chip` (chip presets or YAML).

The names load on first use (PEP 562), so that `import sim.cli` and the CLI's help do not pay
for the whole run stack.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, attribute in it)
_EXPORTS = {
    "CHIPS": ("sim.chips", "CHIPS"),
    "ChipSpec": ("sim.hardware", "ChipSpec"),
    "get_chip": ("sim.chips", "get_chip"),
    "load_chip": ("sim.chips", "load_chip"),
    "CollectiveRequest": ("sim.runs.requests", "CollectiveRequest"),
    "CompareCollectivesRequest": ("sim.runs.requests", "CompareCollectivesRequest"),
    "DecodeRequest": ("sim.runs.requests", "DecodeRequest"),
    "GoodputRequest": ("sim.runs.requests", "GoodputRequest"),
    "PlanRequest": ("sim.runs.requests", "PlanRequest"),
    "PrefillRequest": ("sim.runs.requests", "PrefillRequest"),
    "ReplayRequest": ("sim.runs.requests", "ReplayRequest"),
    "ServeRequest": ("sim.runs.requests", "ServeRequest"),
    "ServeSweepRequest": ("sim.runs.requests", "ServeSweepRequest"),
    "TrainRequest": ("sim.runs.requests", "TrainRequest"),
    "Run": ("sim.runs.result", "Run"),
    "ProgressUpdate": ("topologies.progress", "ProgressUpdate"),
    "run": ("sim.runs", "run"),
    "collective": ("sim.api", "collective"),
    "compare_collectives": ("sim.api", "compare_collectives"),
    "decode": ("sim.api", "decode"),
    "goodput": ("sim.api", "goodput"),
    "prefill": ("sim.api", "prefill"),
    "replay_trace": ("sim.api", "replay"),
    "rerun": ("sim.api", "rerun"),
    "serve": ("sim.api", "serve"),
    "serve_sweep": ("sim.api", "serve_sweep"),
    "train": ("sim.api", "train"),
    "CollectiveResult": ("sim.collectives.result", "CollectiveResult"),
    "simulate_collective": ("sim.collectives.simulate", "simulate_collective"),
    "StepResult": ("sim.engine.result", "StepResult"),
    "replay": ("sim.engine.replay", "replay"),
    "plan": ("sim.studies.plan_search", "plan"),
    "plan_serving": ("sim.serving.plan", "plan_serving"),
    "ServePlanConfig": ("sim.serving.plan", "ServePlanConfig"),
    "sweep": ("sim.studies.sweep", "sweep"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'sim' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
