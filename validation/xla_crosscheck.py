"""Cross-check tpusim's compiled training-step collectives against XLA's TPU compiler.

Two sides:

* **XLA**: a small JAX LLaMA-style decoder (`xla_compile.Decoder`: GQA, SwiGLU, RMSNorm, untied
  embeddings, Adam, `jax.checkpoint` per layer = remat full) is compiled for a real TPU
  topology on this CPU-only
  machine (`jax[tpu]` + `jax.experimental.topologies`, `JAX_PLATFORMS=cpu`). The optimized HLO
  (`compiled.as_text()`) is parsed and every collective is counted with its while-loop trip count,
  attributed to a layer through `jax.named_scope("layer{i}")` in the op metadata.
* **tpusim**: `python -m sim compile` with the same dimensions and mesh; collectives are read
  from the trace JSON.

jax is NOT a project dependency: install it into a separate venv (with tpusim's own
dependencies, which the worker imports with this module) and pass its python:

    python3.11 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install '.[hlo]'
    .venv/bin/python -m validation.xla_crosscheck --jax-python /tmp/jaxvenv/bin/python \
        --json validation/results/xla_collectives.json    # compile what the cache lacks

Without the jax python the XLA side is skipped with a message (tpusim side still printed).
This module is also the XLA worker (`--worker CONFIG`, run by the jax python).

Per program the cache (`--json`) also keeps XLA's per-op cost estimates (`op_costs`:
`estimated_cycles` times loop trip counts, by op_name) and the dot FLOPs per chip that
`tpusim import-hlo` counts in the module (`dot_flops`); docs/validation.md compares them with
tpusim's costed ops per op class (`render_op_costs_section`). Programs: dense training
(fsdp, fsdp x tensor, data x fsdp on v5e, v5p, v6e), a MaxText-style MoE training step and a
tensor-parallel decode step. `--reparse DIR` re-reads the HLO-derived fields from an earlier
`--dump DIR` without compiling.

Byte convention (both sides): tpusim's V = the array one replica group sees: all-gather =
gathered output, reduce-scatter / all-reduce = full unreduced operand, collective-permute = the
per-chip message. XLA bytes are taken from the per-device HLO shapes in the same way; counts and
bytes of ops inside while loops are multiplied by the loop's known trip count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from validation import xla_compile
from validation.xla_crosscheck_doc import RESULTS_FILE
from validation.xla_crosscheck_programs import (
    ALL_PROGRAMS,
    CONFIGS,
    FORM_PROBES,
    TPUSIM_VARIANTS,
    worker,
)
from validation.xla_crosscheck_sides import (
    analyze,
    forms,
    print_side_by_side,
    print_table,
    reparse,
    run_xla,
    summarize,
    tpusim_collectives,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="write the optimized XLA HLO text here")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON,
                    help="python of a venv with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--json", help="cache the XLA side in this JSON file (programs already in "
                                   f"it are not compiled again; the doc reads {RESULTS_FILE.name})")
    ap.add_argument("--recompile", action="store_true",
                    help="with --json: compile the selected programs even if cached")
    ap.add_argument("--reparse", metavar="DIR",
                    help="with --json: re-read the cached programs' collectives, op costs and "
                         "dot FLOPs from DIR/NAME.hlo.txt (an earlier --dump), no compile")
    ap.add_argument("--analyze", metavar="DIR",
                    help="print XLA's per-cycle rates read off DIR/NAME.hlo.txt (an earlier "
                         "--dump): fastest matmul fusion against the MXU peak, ring-accumulator "
                         "bytes against HBM, at XLA_CLOCK_HZ; no compile")
    ap.add_argument("--forms", metavar="DIR",
                    help="print the form XLA gave each training program's weight gathers and "
                         "gradient reductions, read off DIR/NAME.hlo.txt (an earlier --dump; "
                         f"the probes {', '.join(FORM_PROBES)} compile with --configs NAME "
                         "--dump DIR); no compile")
    args = ap.parse_args()
    if args.forms:
        print(forms(args.forms))
        return 0
    if args.analyze:
        print(analyze(args.analyze))
        return 0
    if args.worker:
        worker(args.worker, args.dump)
        return 0
    names = args.configs.split(",")
    unknown = [n for n in names if n not in ALL_PROGRAMS]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(ALL_PROGRAMS)}")
    probes = [n for n in names if n in FORM_PROBES]
    if probes and (args.json or args.reparse):
        ap.error(f"{', '.join(probes)}: form probes are not cached (they are not in the "
                 "collective-bytes table); compile them with --dump DIR and read them with "
                 "--forms DIR")

    if args.reparse:
        if not args.json:
            ap.error("--reparse needs --json (the cache to update)")
        cache = xla_compile.load_cache(Path(args.json))
        for name in names:
            hlo = Path(args.reparse, f"{name}.hlo.txt")
            if name in cache and hlo.is_file():
                cache[name]["xla"] = reparse(name, cache[name]["xla"], hlo.read_text())
                print(f"re-read {name} from {hlo}")
        xla_compile.write_cache(Path(args.json), cache, compact=True)
        return 0

    have_jax = xla_compile.have_jax(args.jax_python)
    if not have_jax:
        print(f"SKIP XLA side: {args.jax_python} missing or lacks jax[tpu] "
              "(docs/reference/xla.md says how to install it)")

    def compile_one(name: str) -> dict:
        return {"tpusim": {}, "xla": run_xla(name, args.jax_python, args.dump)}

    for name in names:
        cfg = ALL_PROGRAMS[name]
        print(f"\n=== {name}: {cfg['topology']} mesh {cfg['mesh']} layers={cfg['layers']} "
              f"seq={cfg['seq']} batch/chip={cfg['batch_per_chip']} ({cfg['mode']}) ===")
        xla_acc = None
        if have_jax:
            if args.json:
                res = xla_compile.compile_into_cache([name], Path(args.json), compile_one,
                                                     recompile=args.recompile, compact=True)[name]
            else:
                res = compile_one(name)
            xla_acc = summarize(res["xla"]["ops"], xla=True)
            print_table("XLA (optimized HLO; count x loop trip count)", xla_acc)
        for extra in TPUSIM_VARIANTS.get(name, []):
            label = " ".join(extra) or "(defaults)"
            acc = summarize(tpusim_collectives(name, extra), xla=False)
            print_table(f"tpusim {label}", acc)
            if xla_acc is not None:
                print(f"\n  side by side, tpusim {label} vs XLA:")
                print_side_by_side(acc, xla_acc)
        if name in FORM_PROBES:
            print("\n(a form probe: `--forms DIR` reads the module --dump wrote)")
        elif name not in TPUSIM_VARIANTS:
            print("\n(tpusim side of this program: docs/validation.md, from "
                  "`python -m validation.maxtext --write-collectives`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
