"""Two checkouts side by side on the same commands: one case per benchmark's workload (a training
step on every executor, a pipeline, a collective, decode, an HLO replay, the Perfetto export,
the plots, a sweep and a plan), each run as a whole `tpusim` process in each tree, interleaved,
so that load on the machine falls on every tree alike.

    python benchmarks/bench_trees.py --tree OLD_CHECKOUT [--repeats 3] [--cases NAME,...]

Each tree runs every case once first, untimed (it writes Python's bytecode cache, as an install
does). Prints per case and tree the CPU time of the process (user + system, with its workers:
min and median of the repeats), the wall median, the peak RSS, the simulation's events per CPU
second where the command reports `sim_events`, and each tree's CPU ratio to this checkout; and
whether the step time and event count agree between the trees (the physics changed on purpose
between some checkouts: docs/model/training.md "HBM"; a row that differs says so).
It never passes or fails on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _measure import run_child_cpu

ROOT = Path(__file__).resolve().parents[1]
LLAMA70 = ["--model", "llama3-70b", "--seq-len", "8192", "--batch-per-chip", "1"]
FULL_POD = ["--chip", "v5p", "--shape", "16x20x28", "--mesh", "fsdp=2240,tensor=4"]
STUDY = """command: train
base: {slice: v5p-128, model: llama3-70b, seq-len: 8192, batch-per-chip: 2,
       mesh: "fsdp=16,tensor=4"}
grid:
  set.ici_link_bytes_per_s: [x0.5, x1, x2]
  set.hbm_bytes_per_s: [x1, x2]
metrics: [step_time_s, mfu, exposed_comm_s]
"""
# (name, the benchmark whose workload it is, argv after `tpusim --quiet`); `{tmp}` is a fresh
# directory per run.
CASES = [
    ("train 8x16x16 (representative)", "bench_training.py",
     ["train", "--chip", "v5p", "--shape", "8x16x16", *LLAMA70, "--mesh", "fsdp=512,tensor=4",
      "--json"]),
    ("train 16x20x28 (representative)", "bench_training.py",
     ["train", *FULL_POD, *LLAMA70, "--json"]),
    ("slow chip + link 16x20x28 (class)", "bench_perchip.py",
     ["train", *FULL_POD, *LLAMA70, "--slow-chip", "3,5,7:0.8", "--slow-link", "0,0,0:x+:0.5",
      "--json"]),
    ("chip variation 8x8x8 (vector)", "bench_perchip.py",
     ["train", "--chip", "v5p", "--shape", "8x8x8", *LLAMA70, "--mesh", "fsdp=128,tensor=4",
      "--chip-variation", "0.02", "--seed", "1", "--json"]),
    ("pipeline 1f1b slow chip 4x4x4", "bench_perchip.py --pipeline",
     ["train", "--chip", "v5p", "--shape", "4x4x4", *LLAMA70, "--mesh",
      "pipeline=4,fsdp=4,tensor=4", "--microbatches", "4", "--pipeline-schedule", "1f1b",
      "--slow-chip", "1,2,3:0.8", "--json"]),
    ("collective per-chip v4 16x16x16", "bench_collectives.py",
     ["collective", "--chip", "v4", "--shape", "16x16x16", "--op", "all-reduce", "--axes",
      "x,y,z", "--bytes", "64MiB", "--algorithm", "per-axis-ring", "--mode", "per-chip",
      "--json"]),
    ("decode 405B v5p-128 tensor=64", "bench_decode.py",
     ["decode", "--slice", "v5p-128", "--model", "llama3-405b", "--batch", "64",
      "--context-len", "8192", "--mesh", "tensor=64", "--json"]),
    ("replay HLO fixture v5e 4x4", "bench_hlo.py",
     ["replay", str(ROOT / "tests/fixtures/hlo/train_fsdp_v5e16.hlo.txt.gz"), "--chip", "v5e",
      "--shape", "4x4", "--json"]),
    ("perfetto 256 chips all", "bench_export.py",
     ["train", "--chip", "v5e", "--shape", "16x16", "--model", "llama3-8b", "--seq-len", "8192",
      "--batch-per-chip", "1", "--mesh", "fsdp=256", "--perfetto", "{tmp}/t.pftrace",
      "--trace-chips", "all"]),
    ("plots 8x8x8 slow chip", "bench_plots.py",
     ["train", "--chip", "v5p", "--shape", "8x8x8", *LLAMA70, "--mesh", "fsdp=128,tensor=4",
      "--slow-chip", "3,5,7:0.8", "--plots", "{tmp}/plots"]),
    ("sweep 6 points, 1 worker", "bench_sweep.py",
     ["sweep", "{tmp}/study.yaml", "--workers", "1", "--out", "{tmp}/s"]),
    ("plan v5e 4x4 llama3-8b", "bench_sweep.py --plans",
     ["plan", "--chip", "v5e", "--shape", "4x4", "--model", "llama3-8b", "--seq-len", "4096",
      "--global-batch", "32", "--out", "{tmp}/plan", "--json"]),
]


def child_env(tree: Path) -> dict[str, str]:
    """The environment of a timed run: `tree` on the path, and Python's bytecode cache on (an
    installed tpusim has its `.pyc` files; without them every process compiles every module it
    imports, which on the checkouts measured here was a third of a small command's CPU)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(tree: Path, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_trees_") as tmp:
        (Path(tmp) / "study.yaml").write_text(STUDY, encoding="utf-8")
        words = [w.replace("{tmp}", tmp) for w in argv]
        # The fixture path names this checkout's copy; each tree reads its own.
        words = [w.replace(str(ROOT), str(tree)) for w in words]
        env = child_env(tree)
        wall, cpu, rss, out, err, code = run_child_cpu(
            [sys.executable, "-m", "sim.cli", "--quiet", *words], cwd=tree, env=env)
    if code != 0:
        raise SystemExit(f"{tree}: tpusim {' '.join(argv)} failed: {err.strip()[:500]}")
    step = events = None
    if "--json" in argv:
        data = json.loads(out)
        rows = data if isinstance(data, list) else [data]
        step = next((r.get("step_time_s") or r.get("time_s") for r in rows
                     if isinstance(r, dict)), None)
        events = next((r.get("sim_events") for r in rows if isinstance(r, dict)), None)
    return {"wall_s": wall, "cpu_s": cpu, "rss_mib": rss / 2**20, "step": step,
            "events": events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=[], required=True,
                    help="another checkout to time beside this one (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=None,
                    help="comma-separated substrings of the case names to run (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    trees = [ROOT, *[t.resolve() for t in a.tree]]
    wanted = [w.strip() for w in a.cases.split(",")] if a.cases else None
    cases = [c for c in CASES if wanted is None or any(w in c[0] for w in wanted)]
    rows = []
    print(f"{'case':<36} {'tree':<22} {'CPU s min/med':>14} {'wall med':>8} {'RSS MiB':>8} "
          f"{'ev/CPU-s':>9} {'CPU med vs first':>16}  same result")
    for name, bench, argv in cases:
        runs = {t: [] for t in trees}
        for t in trees:  # a warm-up run per tree: the bytecode cache and the file cache
            _run(t, argv)
        for _ in range(a.repeats):
            for t in trees:
                runs[t].append(_run(t, argv))
        first = None
        for t in trees:
            cpu = sorted(r["cpu_s"] for r in runs[t])
            med = statistics.median(cpu)
            first = first or med
            last = runs[t][-1]
            ev = f"{last['events'] / cpu[0]:9.0f}" if last["events"] else f"{'-':>9}"
            ref = runs[trees[0]][-1]
            same = ("yes" if (last["step"], last["events"]) == (ref["step"], ref["events"])
                    else f"no: step {last['step']} vs {ref['step']}, events {last['events']} "
                         f"vs {ref['events']}")
            print(f"{name:<36} {str(t)[-22:]:<22} {cpu[0]:6.2f}/{med:6.2f} "
                  f"{statistics.median(r['wall_s'] for r in runs[t]):8.2f} "
                  f"{max(r['rss_mib'] for r in runs[t]):8.0f} {ev} {med / first:15.2f}x  {same}",
                  flush=True)
            rows.append({"case": name, "benchmark": bench, "tree": str(t), "cpu_s": cpu,
                         "wall_s": [r["wall_s"] for r in runs[t]],
                         "rss_mib": max(r["rss_mib"] for r in runs[t]),
                         "step": last["step"], "events": last["events"]})
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
