"""The Python API: one keyword-only function per `tpusim` command, taking the command's flags by
their Python names (`seq_len=8192` for `--seq-len 8192`) and returning a `sim.runs.Run` whose
`.to_dict()` is exactly what the command prints with `--json`.

    import sim
    base = sim.train(slice="v5p-128", model="llama3-70b", seq_len=8192, batch_per_chip=2,
                     mesh="fsdp=16,tensor=4")
    fast = sim.train(**{**base.inputs["flags"], "set": {"ici_link_bytes_per_s": "x2"}})

A run's `inputs["flags"]` are valid keywords, so a recorded run is the base of the next
what-if (spec objects are recorded by name: pass the object again). Names or objects: `chip=`
takes a preset name, a chip YAML path or a `ChipSpec`; `model=` a zoo
name, a YAML path or a `TransformerSpec`; `mesh=` a string or a {axis: size} dict. `set=` takes
the `--set` overrides as a dict. Each call runs the CLI's own code (same parser, defaults and
one-line errors, raised as `TpusimError`), so the two never disagree. Studies over many points
are `sim.sweep` (a DataFrame) and `sim.plan`, in `sim/study.py` and `sim/planner.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sim.hardware import ChipSpec
from sim.runs import Run
from topologies.errors import TpusimError
from workloads.models import TransformerSpec


def _run(command: str, fn: str, kwargs: dict[str, Any]) -> Run:
    from sim import progress
    from sim.cli import build_parser, prepare
    from sim.cli.common import argv_from_flags, flag_specs
    from sim.cli.reruns import _runner

    kwargs = {k.replace("-", "_"): v for k, v in kwargs.items()}  # `inputs.flags` spelling too
    parser = build_parser()
    specs = flag_specs(parser.get_default("commands")[command])
    known = {name.replace("-", "_"): name for name, _dest, _kind in specs}
    if "overrides" in kwargs:  # `sim.plan` spells the overrides this way; accept both
        if "set" in kwargs:
            raise TpusimError(f"sim.{fn}() got both set= and overrides=; give one")
        kwargs["set"] = kwargs.pop("overrides")
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TpusimError(
            f"sim.{fn}() got unknown keyword(s) {', '.join(unknown)}; it takes: "
            f"{', '.join(known)}"
        )
    chip_spec = model_spec = None
    flags: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "chip" and isinstance(value, ChipSpec):
            chip_spec, value = value, value.name
        elif key == "model" and isinstance(value, TransformerSpec):
            model_spec, value = value, value.name
        elif key == "mesh" and isinstance(value, Mapping):
            value = _mesh_text(fn, value)
        elif key == "set" and value is not None and not isinstance(value, Mapping):
            raise TpusimError(
                f"sim.{fn}(set=...) takes a dict such as {{'ici_link_bytes_per_s': 'x2'}}, got "
                f"{type(value).__name__}"
            )
        elif isinstance(value, Path):
            value = str(value)
        if value is not None:
            flags[known[key]] = value
    argv = argv_from_flags(command, flags, specs, caller=f"sim.{fn}")
    args = prepare(argv, parser=parser, chip_spec=chip_spec, model_spec=model_spec)
    progress.QUIET = True  # library calls draw no progress bars
    return _runner(command)(args)


def _mesh_text(fn: str, mesh: Mapping) -> str:
    """`{axis: size}` as the --mesh text; an axis that is not a plain name (`"fsdp=2,tensor"`
    would smuggle a second axis into the text) or a size that is not a whole number (an int, or
    text of digits alone: `"2,tensor=4"` would, too) is an error naming the entry."""
    import re

    from topologies.validate import short_repr

    for axis, size in mesh.items():
        # A size given as text must be digits alone: "2,tensor=4" smuggled an axis, too.
        if not (isinstance(axis, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", axis)) or \
                isinstance(size, bool) or not isinstance(size, (int, str)) or \
                isinstance(size, str) and not re.fullmatch(r"[0-9]+", size.strip()):
            raise TpusimError(
                f"sim.{fn}(mesh=...) entry {short_repr(axis)}: {short_repr(size)} is not an "
                f"axis name and a whole size; give e.g. {{'fsdp': 16, 'tensor': 4}}")
    return ",".join(f"{axis}={size}" for axis, size in mesh.items())


def collective(**flags: Any) -> Run:
    """`tpusim collective`: one collective on a pod.

    Flags: chip/slice/shape/wraparound/slices, op, axes, bytes (an int or text such as
    "32MiB"), algorithm, src/dst (send), shift (permute), mode, chunks, the perturbations
    (slow_link=[...], dead_link=[...], scenario=path) and set={...}. `Run.result` is the
    `CollectiveResult` (`.links` and `.timeline` tables).
    """
    return _run("collective", "collective", flags)


def compare_collectives(**flags: Any) -> Run:
    """`tpusim compare-collectives`: one collective under every algorithm (`summary["results"]`
    has a row per algorithm; `Run.result` the CollectiveResults that applied)."""
    return _run("compare-collectives", "compare_collectives", flags)


def train(**flags: Any) -> Run:
    """`tpusim train`: one training step.

    Flags: the pod (chip/slice/shape/...), model, seq_len, batch_per_chip, mesh, dcn, axis_map,
    remat, attention, microbatches, param_dtype/grad_dtype/gather_dtype/optimizer_dtype,
    optimizer, pipeline_schedule, no_overlap, no_fusion, tp_activations, tp_comm, dp_allreduce,
    fsdp_grad, dp_grad_split, ep_alltoall, vocab_tiling, fsdp_gather, algorithm, the
    perturbations, set={...}.
    `Run.result` is the `StepResult` (`.ops`, `.units`, `.links`, `.memory`), `Run.trace` the
    compiled program.
    """
    return _run("train", "train", flags)


def replay(**flags: Any) -> Run:
    """`tpusim replay`: a trace file written by `tpusim compile` (trace=path) on a pod."""
    return _run("replay", "replay", flags)


def decode(**flags: Any) -> Run:
    """`tpusim decode`: one decode step (model, batch, context_len, mesh, dcn, weight_dtype,
    kv_dtype, matmul_dtype, the pod, algorithm, perturbations, set={...})."""
    return _run("decode", "decode", flags)


def prefill(**flags: Any) -> Run:
    """`tpusim prefill`: the prefill of a batch of prompts (prompt_len, prefill_chunk, and the
    decode flags)."""
    return _run("prefill", "prefill", flags)


def serve_sweep(**flags: Any) -> Run:
    """`tpusim serve-sweep`: decode latency vs throughput over batches (batches="1,4,16"),
    meshes ("tensor=8;data=2,tensor=4") and dtypes; `Run.result` is the list of rows."""
    return _run("serve-sweep", "serve_sweep", flags)


def rerun(result: Mapping[str, Any] | str | Path) -> Run:
    """Run a recorded result again from its `inputs` (a `Run.to_dict()`, a parsed `--json`
    result, or the path of one); the new `.to_dict()` equals the recorded one."""
    from sim.cli.reruns import read_result
    from sim.cli.reruns import rerun as _rerun

    source = "result"
    if isinstance(result, (str, Path)):
        # The rules of `tpusim rerun`: at most 32 MiB, JSON nested at most 32 deep, integers
        # of at most 30 digits, no NaN (json.loads alone raised RecursionError or ValueError).
        source = f"result file {str(result)!r}"
        result, _text = read_result(Path(result))
    from sim import progress

    progress.QUIET = True
    return _rerun(result, source=source)


__all__ = ["Run", "collective", "compare_collectives", "decode", "prefill", "replay", "rerun",
           "serve_sweep", "train"]
