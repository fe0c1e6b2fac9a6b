"""Collectives: an algorithm's schedule, routed onto the pod's links, run on the fluid network.

The modules, in the order data flows through them:

* `algorithms`: each collective algorithm as a `Schedule` of link-level steps, the `ALGORITHMS`
  registry (the names `algorithm` takes) and `build_schedule`.
* `routing`: steps to network batches, on link classes (symmetric mode) or on individual links
  (full detail); `LinkModel`, the links' rates and latencies from the chip.
* `inputs`: a collective's bytes, mode, slow and dead links and group axes, checked.
* `streams`: a schedule's streams run as SimPy processes (chunks, phase barriers) and the
  latency term.
* `full_detail`: whole replica groups link by link; `orbits`: strided groups on the
  representatives of the pod's translation symmetry.
* `auto`: the candidates `auto` simulates and the lower bound that prunes them.
* `result`: `CollectiveResult` and its link and timeline tables.
* `simulate`: `simulate_collective` (one collective, in the mode exact for it) and
  `collective_link_loads` (per-group times and link loads, for the step engine).

The names below are re-exported for `from sim.collectives import ...`.
"""

from sim.collectives.algorithms import (
    ALGORITHMS,
    AlgorithmInfo,
    CollectiveKind,
    Move,
    Schedule,
    Step,
    algorithm_names,
    applicable_algorithms,
    build_schedule,
    parse_kind,
    step_bytes_per_chip,
)
from sim.collectives.auto import AUTO_CANDIDATES
from sim.collectives.inputs import MODES, check_bytes, check_links_only
from sim.collectives.result import LINK_COLUMNS, TIMELINE_COLUMNS, CollectiveResult, link_table
from sim.collectives.routing import LINK_FIELDS, LinkModel, link_model
from sim.collectives.simulate import (
    GroupCollectiveLoads,
    collective_link_loads,
    simulate_collective,
)

__all__ = [
    "ALGORITHMS", "AUTO_CANDIDATES", "LINK_COLUMNS", "LINK_FIELDS", "MODES", "TIMELINE_COLUMNS",
    "AlgorithmInfo", "CollectiveKind", "CollectiveResult", "GroupCollectiveLoads", "LinkModel",
    "Move", "Schedule", "Step", "algorithm_names", "applicable_algorithms", "build_schedule",
    "check_bytes", "check_links_only", "collective_link_loads", "link_model", "link_table",
    "parse_kind", "simulate_collective", "step_bytes_per_chip",
]
