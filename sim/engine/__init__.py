"""The step engine: a program's ops costed and run on a pod (docs/model/).

* `costs`: the op-cost kernel (compute ops at their bound unit's rate, collectives simulated
  once per distinct group and bytes, explicit chip pairs); `memory`: HBM occupancy.
* `replay`: the representative-chip executor (one chip stands for its class); `result`:
  `StepResult` and the parts executors attach; `summary`: one chip's timeline summarised.
* `network`: the fluid link network and its max-min sharing (`FluidNetwork`, the scalar
  `SmallFluidNetwork`).
* `class_engine`: one SimPy actor per chip class (per chip, the oracle); `vector_engine`: the
  classes as numpy vectors in one heapq event loop (`vector_run`, over `vector_kinds`' state);
  `perchip` prepares the per-chip step both take; `critical_path` is the one critical-path walk
  both call; `executors` holds the choice of which runs
  (`simulate_chips`); `pipeline` composes and times pipeline stage programs.

The package imports nothing itself: import the module that holds a name
(`from sim.engine.replay import replay`).
"""
