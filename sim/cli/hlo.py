"""`tpusim import-hlo`: read XLA's compiled HLO text, print its inventory and optionally write
the lowered trace. (`tpusim replay PROGRAM.txt` replays HLO text directly; see training.py.)"""

from __future__ import annotations

import argparse
from typing import Any

from sim.cli import common as cli


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
    from sim.runs.requests import ImportHloRequest
    from sim.runs.train import load_hlo

    if args.output is not None:
        # `-o ''` is a typo for a path, not "no file": refused, as the trace would be lost.
        check_output_file(args.output, "-o")
        cli.check_not_inputs(args, "-o", args.output)
    pod = resolve_pod(cli.request_of(ImportHloRequest, args))
    chip, topo = pod.chip, pod.topology
    imp = load_hlo(args.program, topo)
    if args.output is not None:
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


def register(sub) -> None:
    _register_import(sub, "import-hlo")
