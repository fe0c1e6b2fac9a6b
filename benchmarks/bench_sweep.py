"""Wall time, points per second and peak memory of `tpusim sweep` and `tpusim plan`.

* sweep: the issue's study (LLaMA-3-70B on a 64-chip v5p-128, seq 8192, 2 sequences per chip)
  widened to `--points` points: ICI link bandwidth x0.5..x2.75 in steps of 0.25 (the grid) times
  five meshes with two remat policies (the zip), on `--workers` local processes (or `--dask
  local`). The issue's target: 1,000 points in <= 5 min with --workers 2.
* plan: LLaMA-3-405B on the full 8960-chip v5p pod (16x20x28), seq 8192, one sequence per
  chip, default search space, --workers 2. The issue's target: <= 2 min. `--plans` names the
  plans to run (comma list of PLANS' keys): `405b` (this one, the default), and the three of
  docs/howto/studies.md: `70b-v5p128`, `70b-v5e256`, `405b-ici2`.

Run: python benchmarks/bench_sweep.py [--points 1000] [--workers 2] [--skip-plan] [--out F];
     python benchmarks/bench_sweep.py --skip-sweep --plans 70b-v5p128,70b-v5e256,405b-ici2.
Numbers are measurements on the machine that ran them (shared machines are noisy; the load
average is recorded); nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from _measure import run_child

ROOT = Path(__file__).resolve().parents[1]


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int, str, str, int]:
    """(wall s, CPU s of the whole process tree, peak RSS bytes, stdout, stderr, exit code).
    CPU time (user + system of every descendant) is what a loaded shared machine distorts
    least; wall time / CPU time shows how busy the machine was."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, rss, out, err, code = run_child(cmd, cwd=ROOT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, rss, out, err, code


ZIP_MESHES = ["fsdp=16,tensor=4", "fsdp=64", "fsdp=32,tensor=2", "fsdp=8,tensor=8",
              "data=2,fsdp=32"]


def study(points: int) -> dict:
    if points % 10:
        raise SystemExit("--points must be a multiple of 10 (the zip has 10 rows)")
    n_ici = points // 10
    return {
        "command": "train",
        "base": {"slice": "v5p-128", "model": "llama3-70b", "seq-len": 8192,
                 "batch-per-chip": 2},
        "grid": {"set.ici_link_bytes_per_s": [f"x{0.5 + 0.25 * k:g}" for k in range(n_ici)]},
        "zip": {"mesh": [m for m in ZIP_MESHES for _ in (0, 1)],
                "remat": ["full", "minimal"] * len(ZIP_MESHES)},
        "metrics": ["step_time_s", "mfu", "exposed_comm_s"],
    }


def tpusim() -> list[str]:
    return [sys.executable, "-m", "sim.cli", "--quiet"]


def bench_sweep(points: int, workers: int, dask: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        path = Path(tmp) / "study.json"
        path.write_text(json.dumps(study(points)), encoding="utf-8")
        cmd = [*tpusim(), "sweep", str(path), "--out", str(Path(tmp) / "out"),
               "--workers", str(workers)] + (["--dask", dask] if dask else [])
        load = os.getloadavg()[0]
        wall, cpu, rss, _out, err, code = measure(cmd, env)
        if code != 0:
            raise SystemExit(f"sweep failed: {err.strip()}")
        meta = json.loads((Path(tmp) / "out" / "study.json").read_text())
        import pandas as pd

        df = pd.read_parquet(Path(tmp) / "out" / "results.parquet")
    return {
        "case": "sweep", "points": points, "workers": workers, "backend": dask or "local",
        "wall_s": wall, "cpu_s": cpu, "points_per_s": points / wall,
        "per_point_wall_s_median": float(df["wall_time_s"].median()),
        "failed": int(meta["timing"]["failed"]), "peak_rss_mib_process_tree": rss / 2**20,
        "load_avg_1min_at_start": load,
    }


# The plans measured: name -> the `tpusim plan` flags (docs/howto/studies.md's examples, and
# the 405B plan); every one with --workers, --json and --out "".
PLANS = {
    "405b": ["--chip", "v5p", "--shape", "16x20x28", "--model", "llama3-405b", "--seq-len",
             "8192", "--global-batch", "8960"],
    "70b-v5p128": ["--slice", "v5p-128", "--model", "llama3-70b", "--seq-len", "8192",
                   "--global-batch", "128"],
    "70b-v5e256": ["--chip", "v5e", "--shape", "16x16", "--model", "llama3-70b", "--seq-len",
                   "8192", "--global-batch", "256", "--top", "10"],
    "405b-ici2": ["--chip", "v5p", "--shape", "16x20x28", "--model", "llama3-405b",
                  "--seq-len", "8192", "--global-batch", "8960", "--set",
                  "ici_link_bytes_per_s=x2", "--remat", "full,minimal", "--max-tensor", "16"],
}


def bench_plan(workers: int, name: str = "405b") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [*tpusim(), "plan", *PLANS[name], "--workers", str(workers), "--json", "--out", ""]
    load = os.getloadavg()[0]
    wall, cpu, rss, out, err, code = measure(cmd, env)
    if code != 0:
        raise SystemExit(f"plan failed: {err.strip()}")
    s = json.loads(out)
    return {
        "case": f"plan {name}", "command": " ".join(["tpusim", *cmd[len(tpusim()):]]),
        "workers": workers, "wall_s": wall, "cpu_s": cpu,
        "searched": s["searched"], "best": {k: s["best"][k] for k in
                                            ("mesh", "placement", "remat", "microbatches",
                                             "step_time_s", "mfu")},
        "explanation": s["explanation"], "peak_rss_mib_process_tree": rss / 2**20,
        "load_avg_1min_at_start": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dask", help="also run the sweep on --dask local (or an address)")
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--plans", default="405b",
                    help=f"plans to run, comma-separated, of {', '.join(PLANS)} (default 405b)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sweep.json"))
    args = ap.parse_args()
    rows = []
    if not args.skip_sweep:
        rows.append(bench_sweep(args.points, args.workers, None))
        print(json.dumps(rows[-1]), flush=True)
        if args.dask:
            rows.append(bench_sweep(args.points, args.workers, args.dask))
            print(json.dumps(rows[-1]), flush=True)
    if not args.skip_plan:
        for name in args.plans.split(","):
            if name not in PLANS:
                raise SystemExit(f"--plans {name!r}: give some of {', '.join(PLANS)}")
            rows.append(bench_plan(args.workers, name))
            print(json.dumps(rows[-1]), flush=True)
    result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                          "platform": platform.platform()},
              "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
