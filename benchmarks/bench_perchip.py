"""Wall time, peak memory, chip classes and events of the per-chip engine on the 8960-chip v5p
pod (LLaMA-3-70B, seq 8192, 1 sequence per chip, fsdp=2240,tensor=4): unperturbed, one slow chip
plus one slow link, and chip-to-chip variation (every chip its own class), the last also on
smaller pods to show how the cost grows with the number of classes; and a pipelined step (1F1B,
4 stages, 4 microbatches: every stage its own program with point-to-point sends,
sim/engine/pipeline.py) healthy and with a slow chip, on 64 chips and on the full pod, and with chip
variation on 256, 1024 and 8960 chips (vector classes).

Run: python benchmarks/bench_perchip.py [--quick] [--pipeline] [--cases WORDS] [--timeout S].
Numbers are measurements on the machine that ran them; nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from _measure import run_child_cpu

ROOT = Path(__file__).resolve().parents[1]
POD = ("v5p", "16x20x28", "fsdp=2240,tensor=4")
CASES = [
    ("unperturbed", POD, []),
    # The README's question: one chip at 80% speed on the full pod (its exact command).
    ("slow chip (README)", POD, ["--fsdp-grad", "auto", "--slow-chip", "3,5,7:0.8"]),
    ("slow chip + slow link", POD, ["--slow-chip", "3,5,7:0.8", "--slow-link", "0,0,0:x+:0.5"]),
    ("chip variation 0.02", ("v5p", "4x4x4", "fsdp=16,tensor=4"),
     ["--chip-variation", "0.02", "--seed", "1"]),
    # 512 chips: 1/6 of the full pod's CPU, the quick check for the vector engine's speed.
    ("chip variation 0.02", ("v5p", "8x8x8", "fsdp=128,tensor=4"),
     ["--chip-variation", "0.02", "--seed", "1"]),
    ("chip variation 0.02", POD, ["--chip-variation", "0.02", "--seed", "1"]),
]
# The brute-force collective: every chip and every link simulated.
COLLECTIVE = ["collective", "--chip", "v4", "--shape", "16x16x16", "--op", "all-reduce",
              "--axes", "x,y,z", "--bytes", "64MiB", "--algorithm", "per-axis-ring",
              "--mode", "per-chip", "--json"]
# Pipelined: 1F1B over 4 stages (LLaMA-3-70B's 80 layers, 20 per stage), 4 microbatches.
PIPE = ["--microbatches", "4", "--pipeline-schedule", "1f1b"]
PIPE_CASES = [
    ("pipeline 1f1b", ("v5p", "4x4x4", "pipeline=4,fsdp=4,tensor=4"), PIPE),
    ("pipeline 1f1b slow chip", ("v5p", "4x4x4", "pipeline=4,fsdp=4,tensor=4"),
     [*PIPE, "--slow-chip", "1,2,3:0.8"]),
    ("pipeline 1f1b", ("v5p", "16x20x28", "pipeline=4,fsdp=560,tensor=4"), PIPE),
    ("pipeline 1f1b slow chip", ("v5p", "16x20x28", "pipeline=4,fsdp=560,tensor=4"),
     [*PIPE, "--slow-chip", "3,5,7:0.8"]),
    ("pipeline 1f1b slow link", ("v5p", "16x20x28", "pipeline=4,fsdp=560,tensor=4"),
     [*PIPE, "--slow-link", "0,0,0:x+:0.5"]),
    # Every chip its own class: vector classes with one program per stage (256 chips is the
    # largest of these the class engine can also run: 1.26M class-ops).
    ("pipeline 1f1b chip var", ("v5p", "4x8x8", "pipeline=4,fsdp=16,tensor=4"),
     [*PIPE, "--chip-variation", "0.02", "--seed", "1"]),
    ("pipeline 1f1b chip var", ("v5p", "8x8x16", "pipeline=4,fsdp=64,tensor=4"),
     [*PIPE, "--chip-variation", "0.02", "--seed", "1"]),
    ("pipeline 1f1b chip var", ("v5p", "16x20x28", "pipeline=4,fsdp=560,tensor=4"),
     [*PIPE, "--chip-variation", "0.02", "--seed", "1"]),
]


def run(label: str, pod: tuple[str, str, str], extra: list[str], timeout_s: float) -> dict:
    chip, shape, mesh = pod
    if extra == COLLECTIVE:
        cmd = ["timeout", str(int(timeout_s)), sys.executable, "-m", "sim.cli", "--quiet", *extra]
        extra = ["--mode", "per-chip"]
    else:
        cmd = ["timeout", str(int(timeout_s)), sys.executable, "-m", "sim.cli", "--quiet",
               "train", "--chip", chip, "--shape", shape, "--model", "llama3-70b", "--seq-len",
               "8192", "--batch-per-chip", "1", "--mesh", mesh, "--json", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    wall, cpu, rss, stdout, err, code = run_child_cpu(cmd, cwd=ROOT, env=env)
    row = {"case": label, "shape": shape, "mesh": mesh, "flags": " ".join(extra),
           "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": rss / 2**20}
    if code == 124:
        row["status"] = f"timed out after {timeout_s:.0f} s"
        return row
    if code == 2:  # a one-line refusal (e.g. too many chip classes for this version)
        row["status"] = err.strip().removeprefix("tpusim: error: ")
        return row
    if code != 0:
        raise SystemExit(f"{label} {shape}: tpusim failed: {err.strip()}")
    out = json.loads(stdout)
    row.update(status="ok", num_chips=out["num_chips"],
               num_chip_classes=out.get("num_chip_classes", out["num_chips"]),
               sim_events=out["sim_events"], events_per_s=out["sim_events"] / cpu,
               step_time_s=out.get("step_time_s", out.get("time_s")),
               slowest_chip=out.get("slowest_chip", ""))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="only the three full-pod cases that finish (unperturbed, the README's "
                         "slow chip, slow chip + slow link)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="give up on a case after this many seconds (default 600)")
    ap.add_argument("--pipeline", action="store_true", help="only the pipelined cases")
    ap.add_argument("--cases", default=None,
                    help="only the cases whose label and pod contain every one of these "
                         "comma-separated words, e.g. README or 'chip var,16x20x28'")
    args = ap.parse_args()
    brute = ("brute-force collective", ("v4", "16x16x16", "-"), COLLECTIVE)
    cases = PIPE_CASES if args.pipeline else CASES[:3] if args.quick else [
        *CASES, brute, *PIPE_CASES]
    if args.cases:
        words = args.cases.split(",")
        cases = [c for c in [*CASES, brute, *PIPE_CASES]
                 if all(w in f"{c[0]} {c[1][1]}" for w in words)]
    rows = [run(*c, timeout_s=args.timeout) for c in cases]
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'case':<24} {'pod':<10} {'classes':>7} {'events':>9} {'events/s':>9} "
          f"{'wall s':>7} {'CPU s':>7} {'RSS MiB':>8} {'step s':>10}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['case']:<24} {r['shape']:<10} {r['status']} (CPU {r['cpu_s']:.0f} s, RSS "
                  f"{r['peak_rss_mib']:.0f} MiB)")
            continue
        print(f"{r['case']:<24} {r['shape']:<10} {r['num_chip_classes']:>7} "
              f"{r['sim_events']:>9} {r['events_per_s']:>9.0f} {r['wall_s']:>7.2f} "
              f"{r['cpu_s']:>7.2f} {r['peak_rss_mib']:>8.1f} {r['step_time_s']:>10.6f}")
    out = ROOT / "benchmarks" / "results" / (
        "perchip-pipeline.json" if args.pipeline else "perchip-quick.json" if args.quick
        else "perchip.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
