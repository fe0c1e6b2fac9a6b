"""Chakra traces no one here wrote, replayed: ASTRA-sim's per-rank microbenchmarks against the
per-dimension ring formula, and Chakra's own PyTorch-derived test trace against its manifest.

Each microbenchmark runs with ASTRA-sim's conventions: `comm_size` read as its Ring algorithm
reads it (docs/reference/chakra.md §4), a unidirectional ring (`collective.algorithm=ring`) on
an N x 1 torus with wraparound, every link at B = 50 GB/s one way with L = 500 ns per hop and no
efficiency factor. The formula is the ring's, per dimension: N-1 steps for an all-gather,
reduce-scatter or all-to-all and 2(N-1) for an all-reduce, each L plus its message over B
(messages: comm_size / N, an all-gather's comm_size). tpusim's own algorithms on the v5e preset
(the shape with N chips, `auto`) are shown beside. The PyTorch trace's inventory must equal the
manifest's counts exactly, and it replays on a v5e 2x2.

The trace files are third-party data, read from ../shared/reference/chakra/ (never copied into
the repository); `--write` puts the table into docs/validation.md between its chakra markers.

Run: .venv/bin/python -m validation.chakra [--write] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sim
from sim.runs.requests import ReplayRequest
from validation.template import splice
from workloads.chakra.reader import inventory, read_set

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (a worktree sits one level deeper).
SHARED = next((p / "shared" / "reference" / "chakra" for p in (ROOT.parent, ROOT.parent.parent)
               if (p / "shared" / "reference" / "chakra").is_dir()),
              ROOT.parent / "shared" / "reference" / "chakra")
DOC = ROOT / "docs" / "validation.md"
BEGIN, END = "<!-- chakra -->", "<!-- /chakra -->"
BANDWIDTH_BYTES_PER_S = 50e9
LATENCY_S = 500e-9
MICRO = [("all_reduce", 4), ("all_reduce", 16), ("all_gather", 4), ("all_gather", 16),
         ("reduce_scatter", 8), ("all_to_all", 8)]
V5E_SHAPE = {4: "2x2", 8: "2x4", 16: "4x4"}


def ring_formula_s(kind: str, n: int, comm_size: int) -> float:
    """ASTRA-sim's ring on one dimension of n NPUs (B, L as above)."""
    if kind == "all_reduce":
        return 2 * (n - 1) * (LATENCY_S + comm_size / n / BANDWIDTH_BYTES_PER_S)
    if kind == "all_gather":
        return (n - 1) * (LATENCY_S + comm_size / BANDWIDTH_BYTES_PER_S)
    return (n - 1) * (LATENCY_S + comm_size / n / BANDWIDTH_BYTES_PER_S)


def astra_conventions(prefix: str, n: int) -> float:
    req = ReplayRequest(trace=prefix, chip="v5e", shape=f"{n}x1", wraparound="all", overrides={
        "ici_link_bytes_per_s": str(BANDWIDTH_BYTES_PER_S),
        "ici_hop_latency_s": str(LATENCY_S), "ici_efficiency": "1",
        "collective.algorithm": "ring"})
    return sim.run(req).summary["step_time_s"]


def own_algorithms(prefix: str, n: int) -> float:
    return sim.run(ReplayRequest(trace=prefix, chip="v5e", shape=V5E_SHAPE[n])).summary[
        "step_time_s"]


def table(root: Path) -> tuple[str, bool]:
    """The section's tables from the shared copies under `root`, and whether every check held."""
    manifest = json.loads((root / "manifest.json").read_text())
    by_path = {f["path"]: f for f in manifest["files"]}
    lines = ["| trace | ranks | tpusim, ASTRA-sim conventions | ring formula | difference | "
             "tpusim's own algorithms (v5e, auto) |", "|---|---|---|---|---|---|"]
    ok = True
    for kind, n in MICRO:
        prefix = root / "astra-sim-microbenchmarks" / kind / f"{n}npus_1MB" / kind
        cset = read_set(str(prefix))
        size = by_path[f"astra-sim-microbenchmarks/{kind}/{n}npus_1MB/{kind}.0.et"][
            "total_comm_bytes"]
        assert cset.num_ranks == n
        got = astra_conventions(str(prefix), n)
        want = ring_formula_s(kind, n, size)
        own = own_algorithms(str(prefix), n)
        diff = got / want - 1
        # A step applies collective.algorithm to gathers and reductions; an all-to-all runs
        # `auto` (direct: every pair on its own route), which loads a ring's links unevenly.
        note = "" if kind != "all_to_all" else " (direct: a step runs all-to-all with auto)"
        ok &= abs(diff) < 1e-6 or kind == "all_to_all"
        lines.append(f"| `{kind}/{n}npus_1MB` | {n} | {got * 1e6:.3f} µs{note} | "
                     f"{want * 1e6:.3f} µs | {diff:+.2%} | {own * 1e6:.3f} µs |")
    pt = root / "chakra-tests" / "feeder_tests_trace" / "chakra.0.et.gz"
    entry = by_path["chakra-tests/feeder_tests_trace/chakra.0.et.gz"]
    inv = inventory(read_set(str(pt)))
    checks = {
        "nodes": (inv["num_nodes"], entry["num_nodes"]),
        "nodes by type": (inv["nodes_by_type"], entry["node_count_by_type"]),
        "collectives by kind": ({k: v["count"] for k, v in inv["collectives_by_kind"].items()},
                                entry["collective_count_by_comm_type"]),
        "comm bytes": (inv["comm_bytes"], entry["total_comm_bytes"]),
        "recorded duration (µs)": (inv["duration_micros"], entry["total_duration_micros"]),
        "data deps pointing forward": (inv["forward_data_deps"],
                                       entry["data_deps_pointing_forward"]),
        "deps on ids not in the file": (inv["deps_to_missing_ids"],
                                        entry["ctrl_deps_to_ids_not_in_file"]
                                        + entry["data_deps_to_ids_not_in_file"]),
    }
    lines += ["", "Chakra's PyTorch-derived test trace (`chakra.0.et.gz`, 1 rank), "
              "tpusim's inventory against the manifest:", "",
              "| count | tpusim | manifest | equal |", "|---|---|---|---|"]
    for name, (a, b) in checks.items():
        ok &= a == b
        lines.append(f"| {name} | {a} | {b} | {'yes' if a == b else 'NO'} |")
    times = {c: sim.run(ReplayRequest(trace=str(pt), chip="v5e", shape="2x2",
                                      chakra_compute=c)).summary["step_time_s"]
             for c in ("roofline", "recorded")}
    lines += ["", f"Replayed on a v5e 2x2 (the one file on every chip; its 5 all-reduces over "
              f"the 4 chips): {times['roofline'] * 1e3:.3f} ms (`roofline`: its nodes carry no "
              f"num_ops, so every compute node takes its recorded duration) and "
              f"{times['recorded'] * 1e3:.3f} ms (`recorded`); the recorded durations sum to "
              f"{inv['duration_micros'] / 1e3:.3f} ms, the 5 all-reduces' included, which the "
              f"replay replaces by their time on the torus; the rest runs in dependency order "
              f"on one core."]
    return "\n".join(lines), ok


def block(tables: str) -> str:
    """The section, from its begin marker to its end marker."""
    return (f"{BEGIN}\n## Chakra traces (ASTRA-sim's microbenchmarks, Chakra's PyTorch "
            f"trace)\n\nWritten by `python -m validation.chakra --write` from the shared "
            f"copies of the traces (not in the repository; docs/reference/chakra.md §8). "
            f"ASTRA-sim's conventions: a unidirectional ring on an N x 1 torus with "
            f"wraparound, links at {BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s one way, "
            f"{LATENCY_S * 1e9:g} ns per hop, no efficiency factor; the formula is the "
            f"ring's per dimension (N-1 steps, 2(N-1) for an all-reduce, each the latency "
            f"plus its message: comm_size / N, an all-gather's comm_size).\n\n{tables}\n"
            f"{END}")


def updated(doc: str, root: Path = SHARED) -> str:
    """`doc` (docs/validation.md's text) with this section regenerated from the shared copies
    under `root`, nothing else changed."""
    return splice(doc, BEGIN, END, block(table(root)[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(SHARED), help="the shared Chakra reference folder")
    ap.add_argument("--write", action="store_true", help="write the table into docs/validation.md")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if not (root / "manifest.json").is_file():
        print(f"validation.chakra: {root} holds no manifest.json; give the shared Chakra "
              f"reference folder with --root", file=sys.stderr)
        return 2
    tables, ok = table(root)
    print(tables)
    if args.write:
        DOC.write_text(splice(DOC.read_text(), BEGIN, END, block(tables)))
        print(f"wrote {DOC}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
