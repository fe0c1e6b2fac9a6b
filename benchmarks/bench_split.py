"""Where a command's CPU goes, in two checkouts side by side: each case of `bench_trees.py` run
in each tree with a timer around the entry function of each phase both trees have (the modules
moved between the trees, so each phase names its entry in both layouts), plan and sweep with
`--workers 1` so that all their work is in the timed process.

    python benchmarks/bench_split.py --tree OLD_CHECKOUT [--cases NAME,...] [--repeats 3]

A phase's seconds are the process CPU time spent inside its entry function, over every call
(a plan simulates and bounds many candidates), counted once where entries nest; `other` is the
rest of the process (imports, parsing, printing). The timers wrap a few functions only (no
profiler), so the seconds are the command's own. A phase only one tree has (the newer tree's
energy, or its extra figures inside `outputs`) is work the other tree does not do. Medians of
the repeats, interleaved. It never passes or fails on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_trees import CASES, ROOT, STUDY, child_env

# phase -> the entry functions ("module:function") of that phase in either layout (before the
# move: sim/cli/common.py, sim/chip_engine.py, sim/planner.py, ...; after it: sim/engine/,
# sim/runs/, sim/studies/, sim/export/); a tree has one of them or none.
PHASES: dict[str, tuple[str, ...]] = {
    "compile": ("sim.cli.training:_compile", "sim.runs.train:compile_step",
                "sim.cli.hlo:load_hlo", "sim.runs.replay:load_hlo"),
    "simulate": ("sim.cli.common:simulate_step", "sim.engine.executors:simulate_step",
                 "sim.pipeline:simulate_pipeline_chips",
                 "sim.engine.pipeline:simulate_pipeline_chips",
                 "sim.collective_sim:simulate_collective",
                 "sim.collectives.simulate:simulate_collective"),
    # The newer tree's: a sweep point, plan candidate or step that `auto` switched algorithm
    # for is re-run with the base point's algorithms (issue 30), and every step's energy.
    "auto-switch": ("sim.runs.auto_switch:auto_switch_report",),
    "energy": ("sim.energy:step_energy", "sim.energy:collective_energy"),
    "bounds": ("sim.planner:lower_bounds", "sim.studies.plan_jobs:lower_bounds",
               "sim.planner:sharper_bound", "sim.studies.plan_jobs:sharper_bound"),
    "outputs": ("sim.cli.training:_write_outputs", "sim.cli.training:write_outputs",
                "sim.study:plot_study", "sim.studies.plots:plot_study",
                "sim.planner:plot_frontier", "sim.studies.plots:plot_frontier"),
}

# Run in the tree's process: wrap each phase's entry in its module as that module loads (so
# every `from x import f` binding made later is the wrapper), run the command, write {phase:
# CPU s} to argv[2].
DRIVER = r"""
import functools, importlib.machinery, json, sys, time
phases, out, argv = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
spent = dict.fromkeys(phases, 0.0)
depth = [0]
def wrap(phase, f):
    @functools.wraps(f)
    def timed(*a, **k):
        if depth[0]:
            return f(*a, **k)
        depth[0] += 1
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            spent[phase] += time.process_time() - t0
            depth[0] -= 1
    return timed
wanted = {}
for phase, entries in phases.items():
    for entry in entries:
        mod, name = entry.split(":")
        wanted.setdefault(mod, []).append((name, phase))
class Wrapping:
    # Wraps a phase's entry as its module finishes loading, before any importer reads it (no
    # module is imported that the command would not import itself).
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in wanted:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            for fname, phase in wanted[name]:
                f = module.__dict__.get(fname)
                if f is not None:
                    module.__dict__[fname] = wrap(phase, f)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Wrapping)
import sim.cli
try:
    code = sim.cli.main(argv)
finally:
    spent["total"] = time.process_time()  # the process's CPU since its start
    json.dump(spent, open(out, "w"))
sys.exit(code)
"""


def _words(argv: list[str], tree: Path, tmp: str) -> list[str]:
    words = [w.replace("{tmp}", tmp).replace(str(ROOT), str(tree)) for w in argv]
    if words[0] in ("plan", "sweep"):
        if "--workers" in words:
            words[words.index("--workers") + 1] = "1"
        else:
            words += ["--workers", "1"]
    return ["--quiet", *words]


def timed_run(tree: Path, argv: list[str]) -> dict[str, float]:
    """{phase: CPU s, total, other} of one run of `argv` in `tree`."""
    with tempfile.TemporaryDirectory(prefix="bench_split_") as tmp:
        Path(tmp, "study.yaml").write_text(STUDY, encoding="utf-8")
        out = Path(tmp) / "phases.json"
        cmd = [sys.executable, "-c", DRIVER, json.dumps(PHASES), str(out),
               *_words(argv, tree, tmp)]
        done = subprocess.run(cmd, cwd=tree, env=child_env(tree), capture_output=True,
                              text=True, check=False)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{tree}: {' '.join(argv)} failed: {done.stderr.strip()[:400]}")
        got = json.loads(out.read_text(encoding="utf-8"))
    got["other"] = got["total"] - sum(got[p] for p in PHASES)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="the other checkout")
    ap.add_argument("--cases", default=None,
                    help="comma-separated substrings of bench_trees.py's case names")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    trees = [ROOT, a.tree.resolve()]
    wanted = [w.strip() for w in a.cases.split(",")] if a.cases else None
    cases = [c for c in CASES if wanted is None or any(w in c[0] for w in wanted)]
    cols = ["total", *PHASES, "other"]
    print(f"{'case':<36} {'tree':<14} " + " ".join(f"{c:>9}" for c in cols), flush=True)
    rows = []
    for name, _bench, argv in cases:
        for t in trees:  # a warm-up run per tree: the bytecode cache
            timed_run(t, argv)
        runs = {t: [] for t in trees}
        for _ in range(a.repeats):
            for t in trees:
                runs[t].append(timed_run(t, argv))
        med = {t: {c: statistics.median(r[c] for r in runs[t]) for c in cols} for t in trees}
        for t in trees:
            print(f"{name:<36} {t.name[:14]:<14} "
                  + " ".join(f"{med[t][c]:9.2f}" for c in cols), flush=True)
        ratio = [med[trees[0]][c] / med[trees[1]][c] if med[trees[1]][c] > 0.005 else None
                 for c in cols]
        print(f"{'':<36} {'this / other':<14} "
              + " ".join(f"{r:8.2f}x" if r is not None else f"{'-':>9}" for r in ratio),
              flush=True)
        rows.append({"case": name, "median_cpu_s": {str(t): med[t] for t in trees}})
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
