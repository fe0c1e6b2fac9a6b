"""`tpusim import-hlo`: read XLA's compiled HLO text, print its inventory and optionally write
the lowered trace. (`tpusim replay PROGRAM.txt` replays HLO text directly; see training.py.)
`tpusim make-hlo-fixture`: compile the fixtures' dense decoder for a user's slice, mesh and
model with `jax[tpu]` (deviceless) into HLO text for `replay` (workloads/hlo/make.py)."""

from __future__ import annotations

import argparse
from typing import Any

from sim.cli import common as cli
from topologies.errors import TpusimError
from topologies.validate import MAX_BATCH, MAX_LAYERS, MAX_TOKENS, float_flag, int_flag


def _print_inventory(inv: dict[str, Any], topo_name: str, chip: str) -> None:
    print(f"HLO module {inv['module']}: {inv['num_devices']} devices on {topo_name} {chip}, "
          f"{inv['num_computations']} computations, {inv['num_instructions']} instructions "
          f"-> {inv['num_trace_ops']} trace ops")
    print("  instructions by kind: " + ", ".join(
        f"{k} {v}" for k, v in list(inv["instructions_by_kind"].items())[:12])
        + (", ..." if len(inv["instructions_by_kind"]) > 12 else ""))
    print(f"  dot FLOPs per chip       {inv['dot_flops_per_chip']:.4g}")
    print(f"  VPU FLOPs per chip       {inv['vpu_flops_per_chip']:.4g}")
    print(f"  HBM bytes per chip       {cli.fmt_bytes(inv['hbm_bytes_per_chip'])}")
    peak = inv["hbm_peak"]
    print(f"  HBM peak per chip        {cli.fmt_bytes(peak['hbm_peak_bytes'])} (arguments "
          f"{cli.fmt_bytes(peak['parameter_bytes'])}, at {peak['peak_at']})")
    loops = inv["while_loops"]
    if loops:
        trips = sorted({(l_["trip_count"], l_["from"]) for l_ in loops})
        print(f"  while loops              {len(loops)} (trip counts: " + ", ".join(
            f"{t} from {h}" for t, h in trips) + ")")
    print(f"  collectives              {inv['num_collectives']} executed, "
          f"{cli.fmt_bytes(inv['collective_bytes_per_chip'])} (sum of V)")
    print(f"    {'kind':<20} {'physical axes':<16} {'group':>5} {'executions':>10} "
          f"{'bytes (V)':>12}")
    for r in inv["collectives"]:
        print(f"    {r['kind']:<20} {r['axes']:<16} {r['group_size']:>5} "
              f"{r['executions']:>10} {cli.fmt_bytes(r['bytes']):>12}")


def cmd_import_hlo(args: argparse.Namespace) -> int:
    from sim.export.output import atomic_write, check_output_file  # loaded when it runs
    from sim.runs.bind import resolve_pod
    from sim.runs.replay import check_hlo_has_ops, load_hlo
    from sim.runs.requests import ImportHloRequest

    if args.output is not None:
        # `-o ''` is a typo for a path, not "no file": refused, as the trace would be lost.
        check_output_file(args.output, "-o")
        cli.check_not_inputs(args, "-o", args.output)
    pod = resolve_pod(cli.request_of(ImportHloRequest, args))
    chip, topo = pod.chip, pod.topology
    imp = load_hlo(args.program, topo)
    if args.output is not None:
        check_hlo_has_ops(imp, args.program, "write as a trace (replay refuses a trace without "
                                             "ops)")
        text = imp.trace.to_json()
        cli.check_trace_file_size(text, "-o", "replay the HLO program itself (tpusim replay "
                                              "PROGRAM.txt) instead of a trace file")
        atomic_write(args.output, lambda p: p.write_text(text, encoding="utf-8"))
    if args.json:
        cli.emit_json(dict(imp.inventory, chip=chip.name, topology=topo.name))
    else:
        _print_inventory(imp.inventory, topo.name, chip.name)
        if args.output is not None:
            print(f"wrote {args.output}: {len(imp.trace.ops)} ops")
    return 0


def _register_import(sub, name: str) -> None:
    p = cli.add_command(sub, name, "read XLA's compiled HLO text: inventory and trace",
                        cmd_import_hlo,
                        positional=("program", "HLO module text (compiled.as_text() or an "
                                               "--xla_dump_to *.txt file; .gz accepted)"))
    p.add_argument("-o", "--output", help="also write the lowered trace (replay it with "
                                          "tpusim replay)")
    p.add_argument("--json", action="store_true", help="print the inventory as one JSON object")


def cmd_make_hlo_fixture(args: argparse.Namespace) -> int:
    from sim.export.output import atomic_write, check_output_file  # loaded when it runs
    from topologies.slices import SLICES, resolve_topology, untwisted_name
    from workloads.hlo.make import compile_hlo, program_config
    from workloads.zoo import load_model

    check_output_file(args.output, "-o")
    if args.slice_name is not None:
        spec = SLICES.get(untwisted_name(args.slice_name))
        generation, shape = spec.chip, tuple(spec.shape)
        if args.chip is not None or args.shape is not None:
            raise TpusimError("--slice names the chip and the shape; give --slice alone, or "
                              "--chip with --shape")
    elif args.chip is not None and args.shape is not None:
        # deferred: start-up
        from sim.chips import get_chip

        chip = get_chip(args.chip)
        generation = chip.name
        shape = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                                 max_pod_shape=chip.max_pod_shape, shape=args.shape).shape
    else:
        raise TpusimError("give --slice (e.g. v5p-128), or --chip (v4, v5e, v5p, v6e) with "
                          "--shape (e.g. 4x4x4)")
    cfg = program_config(generation=generation, shape=tuple(shape), mesh=args.mesh,
                         model=load_model(args.model), num_layers=args.layers,
                         program=args.program, seq_len=args.seq_len,
                         batch_per_chip=args.batch_per_chip, kv_len=args.kv_len,
                         remat=args.remat, keep_metadata=args.keep_metadata)
    text = compile_hlo(cfg, jax_python=args.jax_python)
    data = text.encode("utf-8")
    if args.output.endswith(".gz"):
        import gzip

        data = gzip.compress(data, compresslevel=9, mtime=0)  # the same program, the same bytes
    atomic_write(args.output, lambda p: p.write_bytes(data))
    print(f"wrote {args.output}: {cfg.program} program of {cfg.name} on {cfg.topology}, mesh "
          f"{','.join(f'{k}={v}' for k, v in cfg.mesh.items())} ({len(text) / 1024:.0f} KiB of "
          f"text); replay it with tpusim replay {args.output} "
          + (f"--slice {args.slice_name}" if args.slice_name else
             f"--chip {generation} --shape {'x'.join(map(str, shape))}"))
    return 0


def _register_make(sub, name: str) -> None:
    p = sub.add_parser(name, help="compile a dense decoder for a slice and mesh with jax[tpu] "
                                  "into HLO text to replay (needs jax: --jax-python)")
    p.add_argument("--slice", dest="slice_name", help="named slice, e.g. v5p-128")
    p.add_argument("--chip", help="v4, v5e, v5p or v6e (with --shape)")
    p.add_argument("--shape", help="the slice's shape in chips, e.g. 4x4x4 (with --chip)")
    p.add_argument("--mesh", required=True,
                   help="the program's mesh axes over data, fsdp and tensor, e.g. "
                        "fsdp=16,tensor=4 (their product is the chip count; each a product of "
                        "whole physical axes, as jax's make_mesh needs)")
    p.add_argument("--model", required=True,
                   help="a zoo name or model YAML of a dense LLaMA-style decoder (GQA, "
                        "SwiGLU, untied embeddings), e.g. llama3-8b")
    p.add_argument("--layers", type=int_flag("--layers", hi=MAX_LAYERS), default=None,
                   help="layers to compile (default: the model's; fewer compile faster)")
    p.add_argument("--program", default="train", choices=["train", "scan", "decode"],
                   help="train (an Adam step, the default), scan (the same over stacked "
                        "layers) or decode (one token against a --kv-len cache)")
    p.add_argument("--seq-len", type=int_flag("--seq-len", hi=MAX_TOKENS), default=1024,
                   help="tokens per sequence (default 1024)")
    p.add_argument("--batch-per-chip", type=float_flag("--batch-per-chip", lo=0.0,
                                                       hi=MAX_BATCH, lo_open=True),
                   default=1.0, help="sequences per chip (default 1)")
    p.add_argument("--kv-len", type=int_flag("--kv-len", hi=MAX_TOKENS), default=1024,
                   help="decode's KV-cache length (default 1024)")
    p.add_argument("--remat", default="full",
                   help="the training step's remat policy: none, full (default), minimal, "
                        "offload or a MaxText policy name")
    p.add_argument("--keep-metadata", action="store_true",
                   help="keep XLA's metadata attributes and source tables (larger text)")
    p.add_argument("--jax-python",
                   help="the python of a venv with jax[tpu]==0.10.2 to compile in (default: "
                        "this python, if it has jax)")
    p.add_argument("-o", "--output", required=True,
                   help="the HLO text to write (.gz: gzipped), for tpusim replay")
    p.set_defaults(func=cmd_make_hlo_fixture)


def register(sub) -> None:
    cli.register_commands(sub, [("import-hlo", _register_import),
                                ("make-hlo-fixture", _register_make)])
