"""Start-up cost of small commands: CPU time (user + system, of the child process) of
`tpusim --help` and `tpusim presets`, run as whole processes, several times each.

    python benchmarks/bench_startup.py                     # this checkout
    python benchmarks/bench_startup.py --tree OLD_CHECKOUT # side by side, in one run

Prints min / median / max CPU-s and wall-s per command and tree, and the CPU ratio of each
tree to the first. It never passes or fails on time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (["--help"], ["presets"], ["presets", "--json"])


def _env(tree: Path) -> dict[str, str]:
    """`tree` on the path, with Python's bytecode cache on: an installed tpusim has its `.pyc`
    files, and a process that compiles every module it imports measures the compiler."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _one(tree: Path, argv: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from sim.cli import main; "
                    "sys.exit(main(sys.argv[1:]))", *argv], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL, env=_env(tree))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=[],
                    help="another checkout to time beside this one (repeatable)")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    trees = [ROOT, *a.tree]
    print(f"{'command':<16} {'tree':<28} {'CPU s min/med/max':>22} {'wall s med':>10} "
          f"{'CPU vs first':>12}")
    for argv in COMMANDS:
        first = None
        # Interleaved, so that load on the machine falls on every tree alike.
        runs = {t: [] for t in trees}
        for t in trees:  # untimed: writes the bytecode cache
            _one(t, argv)
        for _ in range(a.repeats):
            for t in trees:
                runs[t].append(_one(t, argv))
        for t in trees:
            cpu = sorted(c for c, _w in runs[t])
            wall = statistics.median(w for _c, w in runs[t])
            med = statistics.median(cpu)
            first = first or med
            print(f"{' '.join(argv):<16} {str(t)[-28:]:<28} "
                  f"{cpu[0]:6.3f}/{med:6.3f}/{cpu[-1]:6.3f} {wall:10.3f} {med / first:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
