"""A user's slice, mesh and model compiled by XLA into HLO text (`tpusim make-hlo-fixture`): the
inputs checked in tpusim's terms (each mistake one line, before jax starts), turned into a
`workloads.hlo.jaxgen.HloProgramConfig`, and compiled deviceless by `jax[tpu]`, in this python
when jax is importable here, else under `jax_python` (a venv of its own that has `jax[tpu]`:
`workloads/hlo/jaxgen.py` runs there as a script and needs nothing of tpusim).

The program is the HLO fixtures' dense LLaMA-style decoder (`jaxgen.Decoder`: GQA, SwiGLU,
RMSNorm, untied embeddings) at the model's widths and layer count: a training step with Adam
under a remat policy, the same with the layers scanned, or a one-token decode step. A model with
parts that decoder lacks (MoE, sliding windows, tied embeddings, another MLP, ...) is refused
rather than compiled as something else. jax's `make_mesh` needs every mesh axis to be a product
of whole physical axes; jax says so in one line when it is not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import tempfile
from pathlib import Path

from topologies.errors import TpusimError
from topologies.validate import one_of, short_repr
from workloads.hlo import jaxgen
from workloads.models import MlpKind, TransformerSpec

# tpusim's chip generations jax's deviceless TPU topologies name (`GEN:AxB[xC]`).
JAX_GENERATIONS = ("v4", "v5e", "v5p", "v6e")
MESH_AXES = ("data", "fsdp", "tensor")  # the axes the fixture decoder shards over
PINNED_JAX = "jax[tpu]==0.10.2"  # the version the fixtures and the cross-checks were made with
INSTALL_HINT = (f"python3.11 -m venv hlo-venv && hlo-venv/bin/pip install '{PINNED_JAX}' "
                f"makes one: about 350 MB of wheels, 1.3 GB installed, docs/howto/hlo.md")
# Fields the fixture decoder models; every other TransformerSpec field must keep its default.
_DECODER_FIELDS = ("name", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                   "d_ff", "mlp", "vocab_size")


def program_config(*, generation: str, shape: tuple[int, ...], mesh: str,
                   model: TransformerSpec, num_layers: int | None = None,
                   program: str = "train", seq_len: int = 1024, batch_per_chip: float = 1,
                   kv_len: int = 1024, remat: str = "full",
                   keep_metadata: bool = False) -> jaxgen.HloProgramConfig:
    """The program for a slice (`generation` and its `shape` in chips), a mesh (`fsdp=16,
    tensor=4`: axes of `MESH_AXES`) and a model, checked before jax is involved."""
    if generation not in JAX_GENERATIONS:
        raise TpusimError(f"{{chip}} {short_repr(generation)}: jax's deviceless TPU topologies "
                          f"know {', '.join(JAX_GENERATIONS)}; give one of them (or a {{slice}} "
                          f"of one)", "chip", "slice")
    chips = math.prod(shape)
    axes = _mesh_axes(mesh)
    if math.prod(axes.values()) != chips:
        raise TpusimError(f"{{mesh}} {mesh}: its axes multiply to {math.prod(axes.values())} "
                          f"chips, the slice has {chips}; give axes whose product is {chips}",
                          "mesh")
    _check_dense(model)
    layers = model.num_layers if num_layers is None else num_layers
    if program not in jaxgen.PROGRAMS[:3]:
        raise TpusimError(f"{{program}} {short_repr(program)}: "
                          f"{one_of(program, jaxgen.PROGRAMS[:3])}", "program")
    if remat not in jaxgen.REMATS:
        raise TpusimError(f"{{remat}} {short_repr(remat)}: {one_of(remat, jaxgen.REMATS)}", "remat")
    fsdp, tensor, data = (axes.get(a, 1) for a in ("fsdp", "tensor", "data"))
    batch = batch_per_chip * chips
    for what, value, size, axis in (
            ("num_heads", model.num_heads, tensor, "tensor"),
            ("num_kv_heads", model.num_kv_heads, tensor, "tensor"),
            ("d_ff", model.d_ff, tensor, "tensor"), ("vocab_size", model.vocab_size, tensor,
                                                     "tensor"),
            ("d_model", model.d_model, fsdp, "fsdp")):
        if value % size:
            raise TpusimError(f"{{mesh}} {mesh}: {axis}={size} does not divide the model's "
                              f"{what} = {value}; give a size that divides it", "mesh")
    if program != "decode" and (not float(batch).is_integer() or int(batch) % (fsdp * data)):
        raise TpusimError(f"{{batch_per_chip}} {batch_per_chip:g}: the {batch:g} sequences of the "
                          f"batch split over data x fsdp = {data * fsdp}; give a batch per chip "
                          f"that makes a whole multiple of it", "batch_per_chip")
    dims = {k: int(getattr(model, k)) for k in jaxgen.DIM_KEYS}
    return jaxgen.HloProgramConfig(
        topology=f"{generation}:{'x'.join(map(str, shape))}", mesh=axes, dims=dims,
        num_layers=layers, program=program, seq_len=seq_len, batch_per_chip=batch_per_chip,
        kv_len=kv_len, remat=remat, keep_metadata=keep_metadata, name=model.name)


def _mesh_axes(mesh: str) -> dict[str, int]:
    axes: dict[str, int] = {}
    for item in str(mesh).split(","):
        name, eq, size = (x.strip() for x in item.partition("="))
        if not (eq and name and size.isascii() and size.isdigit() and 1 <= len(size) <= 9
                and int(size) >= 1) or name in axes:
            raise TpusimError(f"{{mesh}} {short_repr(mesh)}: {short_repr(item.strip())} is not "
                              f"AXIS=SIZE with a whole SIZE >= 1, each axis once (e.g. "
                              f"fsdp=16,tensor=4)", "mesh")
        if name not in MESH_AXES:
            raise TpusimError(f"{{mesh}} {short_repr(mesh)}: the fixture program shards over "
                              f"{', '.join(MESH_AXES)}; {short_repr(name)} is not one of them "
                              f"({one_of(name, MESH_AXES)})", "mesh")
        axes[name] = int(size)
    return axes


def _check_dense(model: TransformerSpec) -> None:
    """The model is one the fixture decoder compiles as it is."""
    extra = [f.name for f in dataclasses.fields(TransformerSpec)
             if f.name not in _DECODER_FIELDS and getattr(model, f.name) != f.default]
    if model.mlp != MlpKind.SWIGLU:
        extra.insert(0, f"mlp {model.mlp}")
    if extra:
        raise TpusimError(
            f"{{model}} {model.name}: the fixture program is a dense LLaMA-style decoder (GQA, "
            f"SwiGLU, RMSNorm, untied embeddings), and {model.name} sets "
            f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}; give a model without "
            f"them (a model YAML with `base: {model.name}` resetting those keys)", "model")


def have_jax() -> bool:
    """jax is importable in this python."""
    return importlib.util.find_spec("jax") is not None


def compile_hlo(cfg: jaxgen.HloProgramConfig, *, jax_python: str | None = None) -> str:
    """The program's HLO text (with its `// tpusim:` lines), compiled in this python, or under
    `jax_python` when given (or when jax is missing here: then a one-line error says how to
    get one)."""
    if jax_python is None:
        if not have_jax():
            raise TpusimError(
                f"make-hlo-fixture compiles with {PINNED_JAX}, which this python lacks; give "
                f"{{jax_python}} hlo-venv/bin/python, the python of a venv that has it "
                f"({INSTALL_HINT})", "jax_python")
        try:
            return jaxgen.compile_program(cfg)
        except ValueError as exc:
            raise TpusimError(f"jax refuses the program: {exc}") from None
    py = Path(jax_python)
    if not py.is_file() or not os.access(py, os.X_OK):
        raise TpusimError(f"{{jax_python}} {short_repr(jax_python)} is not an executable file; "
                          f"give the python of a venv with {PINNED_JAX} ({INSTALL_HINT})",
                          "jax_python")
    with tempfile.TemporaryDirectory(prefix="tpusim-hlo-") as tmp:
        out = Path(tmp) / "program.hlo.txt"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("PYTHONPATH", None)  # the script needs nothing of tpusim
        done = subprocess.run([str(py), jaxgen.__file__], input=jaxgen.job_json(cfg, str(out)),
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode == 0 and out.is_file():
            return out.read_text(encoding="utf-8")
        err = done.stderr
        if "No module named 'jax'" in err or "No module named 'numpy'" in err:
            raise TpusimError(f"{{jax_python}} {jax_python} has no jax: install it there "
                              f"({py} -m pip install '{PINNED_JAX}'), or give the python of a "
                              f"venv that has it ({INSTALL_HINT})", "jax_python")
        lines = [ln for ln in err.splitlines() if ln.startswith("jax: ")]
        if lines:
            raise TpusimError(f"jax refuses the program: {lines[-1][5:][:400]}")
        last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()),
                    f"exit status {done.returncode}")
        raise TpusimError(f"{{jax_python}} {jax_python} failed to compile the program: "
                          f"{last[:300]}", "jax_python")
