"""The run layer: typed requests in, typed results out.

    from sim.runs import TrainRequest, run
    r = run(TrainRequest(slice="v5p-128", model="llama3-70b", seq_len=8192, batch_per_chip=2,
                         mesh={"fsdp": 16, "tensor": 4}))
    r.step_time_s, r.result.ops          # the summary's fields; the engine's tables

`run(request)` picks the runner for the request's type; every front end (the CLI, the Python
API, sweeps and plans) calls it. `rerun(result)` rebuilds a request from a result's `inputs`
and runs it again. `run(request, progress=callback)` reports the progress of a long run
(per-chip and vector steps, HLO import, serving) to `callback`, one `ProgressUpdate` at a time
(`topologies/progress.py`); nothing in the library prints.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sim.runs.requests import (
    REQUESTS,
    CollectiveRequest,
    CompareCollectivesRequest,
    DecodeRequest,
    GoodputRequest,
    PrefillRequest,
    ReplayRequest,
    Request,
    ServeRequest,
    ServeSweepRequest,
    TrainRequest,
)
from topologies.errors import TpusimError
from topologies.progress import ProgressCallback, ProgressUpdate, reporting
from topologies.validate import short_repr

if TYPE_CHECKING:
    from sim.runs.result import Run

__all__ = [
    "REQUESTS", "CollectiveRequest", "CompareCollectivesRequest", "DecodeRequest",
    "GoodputRequest", "PrefillRequest", "ProgressCallback", "ProgressUpdate", "ReplayRequest",
    "Request", "Run", "ServeRequest", "ServeSweepRequest", "TrainRequest",
    "describe_config", "describe_mesh", "describe_topology", "run", "runner",
]
# The result side (which needs the topology, and numpy) loads on first use.
_LAZY = {"Run", "describe_config", "describe_mesh", "describe_topology"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sim.runs' has no attribute {name!r}")
    value = getattr(importlib.import_module("sim.runs.result"), name)
    globals()[name] = value
    return value


def runner(request_type: type[Request]):
    """The function that runs requests of this type."""
    # The runners pull in the compilers and executors: loaded when the first run starts, so
    # that building requests (and `tpusim --help`) stays cheap.
    from sim.runs import collective, goodput, inference, replay, serve, train

    return {
        CollectiveRequest: collective.run_collective,
        CompareCollectivesRequest: collective.run_compare,
        TrainRequest: train.run_train,
        ReplayRequest: replay.run_replay,
        DecodeRequest: inference.run_decode,
        PrefillRequest: inference.run_prefill,
        ServeSweepRequest: inference.run_serve_sweep,
        ServeRequest: serve.run_serve,
        GoodputRequest: goodput.run_goodput,
    }[request_type]


def run(request: Request, *, progress: ProgressCallback | None = None) -> Run:
    """Simulate `request`; a `Run` (its `.summary`, `.inputs`, `.result`, `.trace`).
    `progress`: called with a `ProgressUpdate` as long parts of the run advance (None: the
    enclosing `topologies.progress.reporting` block's callback, if any)."""
    if not isinstance(request, Request):
        raise TpusimError(f"sim.run() takes a request such as TrainRequest(...), got "
                        f"{short_repr(request)}")
    if progress is None:
        return runner(type(request))(request)
    with reporting(progress):
        return runner(type(request))(request)
