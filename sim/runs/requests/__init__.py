"""Typed, frozen requests: one class per simulating command, what every front end builds.

A request holds a run's settings under their Python names (`seq_len`, `batch_per_chip`,
`overrides`, ...), already checked and converted (an `int` for `seq_len`, a tuple of texts for
`slow_link`); `sim.run(request)` simulates it and returns a `sim.runs.Run`. The CLI turns argv
into a request, the Python API turns keywords into one, a sweep point and a plan candidate are
requests shipped to workers (they pickle), and `rerun` rebuilds one from a result's `inputs`.

Each field is a setting of the command of the same name with `_` for `-` (`overrides` is the
command line's `set` flag); `flags()` is the record of them under those names, in the command's
order, which results carry as `inputs.flags`. The pod is named (`chip`, `slice`, `shape`,
`wraparound`, `slices`) or given as objects (`chip_spec`, `model_spec`, `scenario_spec`: they
replace loading the named preset or file, and are what `rerun` uses so that a result reruns the
same after a preset or file changed).

The modules: `base` the converters and the shared base classes, `collective`, `training`
(`train`, `compile`, `replay`, `import-hlo`, `plan`), `inference` (`decode`, `prefill`,
`serve-sweep`, `serve`) and `goodput`, one request class per command.
"""

from __future__ import annotations

from sim.runs.requests.base import (
    CONVERTERS,
    SEED_RANGE,
    RequestBase,
    flag_name,
    mesh_text,
    scenario_number,
    seed,
    setting_kind,
    setting_name,
)
from sim.runs.requests.collective import CollectiveRequest, CompareCollectivesRequest
from sim.runs.requests.goodput import MAX_GOODPUT_HOURS, MAX_GOODPUT_STEPS, GoodputRequest
from sim.runs.requests.inference import (
    MAX_SERVE_REQUESTS,
    DecodeRequest,
    PrefillRequest,
    ServeRequest,
    ServeSweepRequest,
)
from sim.runs.requests.training import (
    EXHAUSTIVE_MAX_SIMULATIONS,
    CompileRequest,
    ImportHloRequest,
    PlanRequest,
    ReplayRequest,
    TrainRequest,
)

__all__ = [
    "CONVERTERS", "EXHAUSTIVE_MAX_SIMULATIONS", "MAX_GOODPUT_HOURS", "MAX_GOODPUT_STEPS",
    "MAX_SERVE_REQUESTS", "REQUESTS", "SEED_RANGE", "CollectiveRequest",
    "CompareCollectivesRequest", "CompileRequest", "DecodeRequest", "GoodputRequest",
    "ImportHloRequest", "PlanRequest", "PrefillRequest", "ReplayRequest", "Request",
    "ServeRequest", "ServeSweepRequest", "TrainRequest", "flag_name", "mesh_text",
    "scenario_number", "seed", "setting_kind", "setting_name",
]

# Every request class that `sim.run` runs, by its command.
REQUESTS: dict[str, type[RequestBase]] = {
    cls.COMMAND: cls for cls in (CollectiveRequest, CompareCollectivesRequest, TrainRequest,
                                 ReplayRequest, DecodeRequest, PrefillRequest, ServeSweepRequest,
                                 ServeRequest, GoodputRequest)
}
Request = RequestBase
