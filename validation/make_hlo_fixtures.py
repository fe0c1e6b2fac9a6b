"""Compile small JAX programs for real TPU topologies on this CPU-only machine and write their
optimized HLO text as tpusim test fixtures (`tests/fixtures/hlo/*.hlo.txt`).

jax is not a tpusim dependency (optional extra `[hlo]`): run this with a throwaway venv:

    python3.11 -m venv /work/hlo-venv && /work/hlo-venv/bin/pip install "jax[tpu]==0.10.2"
    /work/hlo-venv/bin/python -m validation.make_hlo_fixtures [--only NAME] [--out DIR]

The same program on a bigger slice (what XLA compiles there, for `tpusim replay`):

    /work/hlo-venv/bin/python -m validation.make_hlo_fixtures --only train_fsdp_tp_v5p64 \
        --topology v5p:8x8x8 --mesh fsdp=64,tensor=8 --out big/
    tpusim replay big/train_fsdp_tp_v5p64.v5p-8x8x8.hlo.txt.gz --slice v5p-1024

(`--topology` is jax's TPU topology name, GEN:AxBxC; `--mesh` the program's mesh axes, each a
product of whole physical axes, as `jax.experimental.topologies.make_mesh` requires. The file
is named after the program and the topology. A program of your own: copy `build`'s pattern.)

Each fixture is gzipped (`NAME.hlo.txt.gz`; tpusim reads `.gz` directly) and holds
`compiled.as_text()` (the scheduled, TPU-optimized module) with two edits that
carry no cost information, to keep the fixtures small: `metadata={...}` attributes and the
source-location tables (FileNames/FunctionNames/FileLocations/StackFrames) are dropped, unless
`--keep-metadata`. A first comment line records where XLA placed each SPMD partition:
`// tpusim: partition_coords=x,y[,z] ...` (partition p runs on the chip at the p-th coordinate;
`jax.experimental.topologies.make_mesh` lays the mesh out as XLA's TPU runtime would). The
second comment line records the program's configuration as JSON (`// tpusim: config=...`), which
the tests and docs/validation.md use to recompute the expected numbers independently.

`spmd_windowed_einsum_v5e16.hlo.txt.gz` is the post-SPMD-partitioning dump of the
`windowed_einsum_v5e16` program, kept whole (metadata and source tables included): run
`build("windowed_einsum_v5e16", False)` with
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning"`, take
`DIR/*after_tpu-spmd-partitioning.before_tpu-call-inliner.txt` and put the two comment lines of
`windowed_einsum_v5e16` (same mesh, so the same placement) in front.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

from validation import xla_compile
from workloads.hlo import jaxgen

REPO = xla_compile.REPO

# A LLaMA-style decoder (GQA, SwiGLU, RMSNorm, untied embeddings), small enough that each
# fixture is a few hundred KB of text. Same keys as a tpusim model YAML.
SMALL = xla_compile.TINY

FIXTURES = {
    # name: topology, mesh, program, model overrides, batch per chip, seq
    "train_fsdp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="train",
                             layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_tp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 4, "tensor": 4},
                                program="train", layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_v5p64": dict(topology="v5p:4x4x4", mesh={"fsdp": 64}, program="train",
                             layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_tp_v5p64": dict(topology="v5p:4x4x4", mesh={"fsdp": 16, "tensor": 4},
                                program="train", layers=2, seq=1024, batch_per_chip=1),
    "decode_tp8_v5e8": dict(topology="v5e:2x4", mesh={"tensor": 8}, program="decode",
                            layers=2, seq=1, batch_per_chip=1, kv_len=1024),
    "scan_fsdp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="scan",
                            layers=4, seq=1024, batch_per_chip=1),
    "windowed_einsum_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="matmul",
                                  layers=1, seq=2048, batch_per_chip=1),
    # The speed benchmark's module (not committed): an 8-layer train step with metadata kept.
    "bench_train8_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="train",
                               layers=8, seq=1024, batch_per_chip=1, bench=True),
}


def build(name: str, keep_metadata: bool, *, topology: str | None = None,
          mesh_axes: dict[str, int] | None = None) -> str:
    """The HLO text of fixture `name`'s program, compiled for its own topology and mesh or for
    `topology` and `mesh_axes` (the same program on another slice), by
    `workloads.hlo.jaxgen.compile_program` (what `tpusim make-hlo-fixture` runs)."""
    cfg = dict(FIXTURES[name])
    if topology:
        cfg["topology"] = topology
    if mesh_axes:
        _check_mesh_axes(name, mesh_axes)
        cfg["mesh"] = mesh_axes
    program = jaxgen.HloProgramConfig(
        topology=cfg["topology"], mesh=cfg["mesh"], dims=SMALL, num_layers=cfg["layers"],
        program=cfg["program"], seq_len=cfg["seq"], batch_per_chip=cfg["batch_per_chip"],
        kv_len=cfg.get("kv_len", 1024), keep_metadata=keep_metadata or bool(cfg.get("bench")),
        name=name, extra={"bench": True} if cfg.get("bench") else {})
    try:
        return jaxgen.compile_program(program)
    except ValueError as exc:  # a mesh or topology jax refuses, as one line
        raise SystemExit(f"{name} on {exc}") from None


strip_metadata = jaxgen.strip_metadata


# jax's TPU topology names as the fixtures use them: GEN:AxB[xC].
_TOPOLOGY_RE = re.compile(r"[a-z0-9]+:[1-9][0-9]*(?:x[1-9][0-9]*)*")


def _check_mesh_axes(name: str, mesh_axes: dict[str, int]) -> None:
    if set(mesh_axes) != set(FIXTURES[name]["mesh"]):
        given = ",".join(f"{k}={v}" for k, v in mesh_axes.items())
        raise SystemExit(f"--mesh {given}: {name}'s program shards over the axes "
                         f"{','.join(FIXTURES[name]['mesh'])}; give a size to each of them")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything compiles (each mistake a one-line exit):
    `names` the fixtures to build, `mesh_axes` the --mesh sizes (None: each fixture's own)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma list of fixture names")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hlo"))
    ap.add_argument("--bench-out", default="/tmp", help="where the benchmark module goes")
    ap.add_argument("--keep-metadata", action="store_true")
    ap.add_argument("--topology", help="compile for this TPU topology instead, e.g. v5p:8x8x8 "
                                       "(the file is named NAME.v5p-8x8x8.hlo.txt.gz)")
    ap.add_argument("--mesh", help="with --topology: the program's mesh axes there, e.g. "
                                   "fsdp=64,tensor=8 (default: the fixture's)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        raise SystemExit(f"--only {args.only}: no fixture named {', '.join(unknown)}; the "
                         f"fixtures are {', '.join(FIXTURES)}")
    if args.topology is not None and not _TOPOLOGY_RE.fullmatch(args.topology):
        raise SystemExit(f"--topology {args.topology}: not a TPU topology name like v5p:8x8x8 "
                         f"(GEN:AxBxC)")
    mesh_axes = None
    if args.mesh:
        if not args.topology:
            raise SystemExit("--mesh goes with --topology (the fixtures keep their own mesh)")
        mesh_axes = {}
        for item in args.mesh.split(","):
            axis, eq, size = (x.strip() for x in item.partition("="))
            if not (eq and axis and size.isdigit() and int(size) >= 1) or axis in mesh_axes:
                raise SystemExit(f"--mesh {args.mesh}: {item.strip()!r} is not AXIS=SIZE with "
                                 f"a whole SIZE >= 1, each axis once (e.g. fsdp=64,tensor=8)")
            mesh_axes[axis] = int(size)
        for name in names:
            _check_mesh_axes(name, mesh_axes)
    args.names, args.mesh_axes = names, mesh_axes
    return args


def main() -> int:
    args = parse_args()
    names, mesh_axes = args.names, args.mesh_axes
    for name in names:
        text = build(name, args.keep_metadata, topology=args.topology, mesh_axes=mesh_axes)
        out = Path(args.bench_out if FIXTURES[name].get("bench") else args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{name}.{args.topology.replace(':', '-')}" if args.topology else name
        if FIXTURES[name].get("bench"):
            path = out / f"{stem}.hlo.txt"
            path.write_text(text)
        else:
            path = out / f"{stem}.hlo.txt.gz"
            # mtime=0: the same program gives byte-identical fixtures.
            path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        print(f"wrote {path} ({len(text) / 1024:.0f} KiB of text)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
