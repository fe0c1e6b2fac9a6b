"""Training goodput under failures (`tpusim goodput`): a long-horizon discrete-event simulation
of one training job on a slice, its events being failures of chips and hosts, repairs, cube
swaps through the optical circuit switches, restarts and checkpoints.

* `config.py`: the settings (`GoodputConfig`: the job, the slice's parts, the failure model).
* `failures.py`: when parts fail: Poisson arrivals per chip and per host, or a trace file.
* `history.py`: the slice's up and down time, failure by failure (the event-skip engine).
* `job.py`: checkpoints and lost work on that history, for any checkpoint interval at once;
  the interval search and Young-Daly.
* `reference.py`: the same job in SimPy, every checkpoint, failure, repair, swap and restart an
  event (the brute-force oracle, `engine="simpy"`).
* `simulate.py`: seeds, the search and the summary with confidence intervals.

docs/model/goodput.md states the model and its assumptions.
"""

from sim.reliability.config import (
    Engine,
    FailureConfig,
    GoodputConfig,
    JobConfig,
    SliceInventory,
)

__all__ = ["Engine", "FailureConfig", "GoodputConfig", "JobConfig", "SliceInventory"]
