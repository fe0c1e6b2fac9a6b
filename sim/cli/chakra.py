"""`tpusim import-chakra`: read a Chakra per-rank trace set and print its inventory (`tpusim
replay PREFIX` replays it; see training.py)."""

from __future__ import annotations

import argparse
from typing import Any

from sim.cli import common as cli


def _print_inventory(inv: dict[str, Any]) -> None:
    print(f"Chakra trace {inv['source']}: {inv['num_ranks']} rank(s), "
          f"{inv['num_distinct_programs']} distinct program(s), {inv['num_nodes']} nodes")
    print("  nodes by type: " + ", ".join(f"{k} {v}" for k, v in inv["nodes_by_type"].items()))
    print(f"  comm bytes (sum of comm_size)  {cli.fmt_bytes(inv['comm_bytes'])}")
    if inv["collectives_by_kind"]:
        print(f"    {'kind':<22} {'count':>8} {'comm bytes':>12}")
        for k, r in inv["collectives_by_kind"].items():
            print(f"    {k:<22} {r['count']:>8} {cli.fmt_bytes(r['comm_bytes']):>12}")
    print(f"  recorded duration              {inv['duration_micros'] / 1e6:.6f} s (sum)")
    print(f"  dependencies: {inv['deps_to_missing_ids']} on ids not in the file (dropped), "
          f"{inv['forward_data_deps']} data deps pointing forward (ordered), "
          f"{inv['self_deps_dropped']} self deps and {inv['ctrl_cycle_deps_dropped']} control "
          f"deps closing a cycle (dropped)")
    for a in inv["approximations"]:
        print(f"  approximated at replay: {a}")


def cmd_import_chakra(args: argparse.Namespace) -> int:
    # deferred: start-up
    from workloads.chakra.comm_group import check_ranks, read_comm_groups
    from workloads.chakra.convert import replay_notes
    from workloads.chakra.reader import inventory, read_set

    groups = None
    if args.chakra_comm_group is not None:
        groups, _digest = read_comm_groups(args.chakra_comm_group)
    cset = read_set(args.trace)
    if groups and cset.num_ranks > 1:  # one file alone: its ranks are a pod's chips
        check_ranks(groups, cset.num_ranks, cset.source, args.chakra_comm_group)
    inv = inventory(cset, replay_notes(cset, args.chakra_compute, groups))
    if args.json:
        cli.emit_json(inv)
    else:
        _print_inventory(inv)
    return 0


def _register_import(sub, name: str) -> None:
    p = sub.add_parser(name, help="read a Chakra execution trace: its inventory")
    p.add_argument("trace", help="PREFIX of PREFIX.<rank>.et files (.et.gz too), their "
                                 "directory, or one .et/.et.gz file")
    p.add_argument("--chakra-compute", choices=("roofline", "recorded"), default="roofline",
                   help="how replay would cost compute nodes, for the approximations listed "
                        "(default roofline; see tpusim replay)")
    p.add_argument("--chakra-comm-group", metavar="FILE",
                   help="ASTRA-sim's communicator-group JSON (group id to ranks), for the "
                        "approximations listed (see tpusim replay)")
    p.add_argument("--json", action="store_true", help="print the inventory as one JSON object")
    p.set_defaults(func=cmd_import_chakra)


def register(sub) -> None:
    cli.register_commands(sub, [("import-chakra", _register_import)])
