"""Speed of `tpusim serve`: 100,000 Poisson requests (lognormal prompts of mean 1,000 tokens,
outputs of mean 250) for LLaMA-3-70B (int8 weights) on 16 v5e-8 replicas at 90% of
saturation, as one whole `tpusim serve --json` process (cost-model building included).

    python benchmarks/bench_serve.py                 # the headline case
    python benchmarks/bench_serve.py --requests 1000000
    python benchmarks/bench_serve.py --sweep 20      # a rate sweep, `tpusim sweep --workers 2`

Saturation is measured first, in this process: one replica given a burst of requests (far past
what it serves) decodes at its capacity; 16 replicas serve 16 times that, and the benchmark
offers 90% of it. Prints CPU (user + system of the child), wall, peak RSS, events, iterations
and requests per second and simulated seconds per wall second. It never passes or fails on
time.

`--sweep N`: a study of N rates from 10% to 120% of saturation (`--requests` each, default
10,000 there), run by one `tpusim sweep --workers 2` process: each worker builds the cost model
once and reuses it for every later point it runs. Prints the whole process's CPU (its workers
included), wall, peak RSS (the largest of the process and its workers), the summed events,
iterations and requests per wall second, and each point's saturation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POD = ["--model", "llama3-70b", "--slice", "v5e-8", "--mesh", "tensor=8",
       "--weight-dtype", "int8"]
LENGTHS = ["--prompt-tokens", "lognormal:1000,0.8", "--output-tokens", "lognormal:250,0.8"]


def capacity_per_replica() -> float:
    """Requests/s one replica serves when its queue never empties."""
    sys.path.insert(0, str(ROOT))
    from sim.api import serve

    r = serve(model="llama3-70b", slice="v5e-8", mesh="tensor=8", weight_dtype="int8",
              rate=1e6, requests=3000, prompt_tokens="lognormal:1000,0.8",
              output_tokens="lognormal:250,0.8")
    return r.throughput_requests_per_s


def sweep(a, cap: float) -> int:
    """The `--sweep N` case (see the module docstring)."""
    n = a.sweep
    requests = a.requests if a.requests != 100_000 else 10_000
    rates = [round(cap * a.replicas * (0.1 + 1.1 * k / (n - 1)), 4) for k in range(n)]
    study = {"command": "serve",
             "base": {"model": "llama3-70b", "slice": "v5e-8", "mesh": "tensor=8",
                      "weight-dtype": "int8", "prompt-tokens": "lognormal:1000,0.8",
                      "output-tokens": "lognormal:250,0.8", "replicas": a.replicas,
                      "router": "least-outstanding", "requests": requests,
                      "slo": "ttft=0.5,tpot=0.05"},
             "grid": {"rate": rates},
             "metrics": ["sim_events", "num_iterations", "num_requests", "span_s", "saturated",
                         "ttft_s.p99", "tpot_s.p99", "throughput_tokens_per_s"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "study.json"
        path.write_text(json.dumps(study))
        out = Path(tmp) / "out"
        argv = ["sweep", str(path), "--workers", "2", "--out", str(out), "--quiet"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sim", *argv], cwd=ROOT, check=True,
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t1
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        import pandas as pd

        df = pd.read_csv(out / "results.csv")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ev, its, req = (int(df[c].sum()) for c in ("sim_events", "num_iterations", "num_requests"))
    print(f"tpusim sweep ({n} rates x {requests:,} requests, {a.replicas} replicas) "
          f"--workers 2")
    print("| points | requests each | CPU s | wall s | peak RSS MiB | events | events/s | "
          "iterations/s | requests/s | sim s / wall s | saturated points |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {n} | {requests:,} | {cpu:.1f} | {wall:.1f} | {after.ru_maxrss / 1024:.0f} | "
          f"{ev:,} | {ev / wall:,.0f} | {its / wall:,.0f} | {req / wall:,.0f} | "
          f"{df['span_s'].sum() / wall:,.1f} | {int(df['saturated'].sum())} |")
    for r in df.to_dict("records"):
        print(f"  rate {r['rate']:8.3f}: p99 TTFT {r['ttft_s.p99']:.3f} s, p99 TPOT "
              f"{r['tpot_s.p99']:.4f} s, {r['throughput_tokens_per_s']:,.0f} tokens/s"
              + (" (saturated)" if r["saturated"] else ""))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--load", type=float, default=0.9, help="share of saturation offered")
    ap.add_argument("--sweep", type=int, default=0,
                    help="a study of this many rates instead (10%% to 120%% of saturation)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cap = capacity_per_replica()
    if a.sweep:
        print(f"capacity {cap:.3f} requests/s per replica")
        return sweep(a, cap)
    rate = a.load * cap * a.replicas
    print(f"capacity {cap:.3f} requests/s per replica (measured in {time.perf_counter() - t0:.1f}"
          f" s); offering {rate:.2f} requests/s to {a.replicas} replicas")
    argv = ["serve", *POD, *LENGTHS, "--replicas", str(a.replicas), "--router",
            "least-outstanding", "--rate", f"{rate:.6g}", "--requests", str(a.requests),
            "--slo", "ttft=0.5,tpot=0.05", "--json", "--quiet"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sim", *argv], cwd=ROOT, check=True,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t1
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rss_mib = after.ru_maxrss / 1024
    s = json.loads(proc.stdout)
    print(f"tpusim {' '.join(argv)}")
    print("| requests | replicas | load | CPU s | wall s | peak RSS MiB | events | events/s "
          "| iterations/s | requests/s | sim s / wall s | saturated | p99 TTFT s | p99 TPOT s "
          "| tokens/s/chip |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {s['num_requests']:,} | {a.replicas} | {a.load:.0%} | {cpu:.1f} | {wall:.1f} | "
          f"{rss_mib:.0f} | {s['sim_events']:,} | {s['sim_events'] / wall:,.0f} | "
          f"{s['num_iterations'] / wall:,.0f} | {s['num_requests'] / wall:,.0f} | "
          f"{s['span_s'] / wall:,.1f} | {s['saturated']} | {s['ttft_s']['p99']:.3f} | "
          f"{s['tpot_s']['p99']:.4f} | {s['tokens_per_s_per_chip']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
