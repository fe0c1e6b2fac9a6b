"""Speed of `tpusim goodput`: a month-long job on a 3,072-chip v4 slice (12x16x16, 768 hosts)
with thousands of failures, in process (`sim.reliability.simulate.simulate_goodput`: the
failure histories, the checkpoint interval search and the summary) and as whole `tpusim goodput
--json` processes.

    python benchmarks/bench_goodput.py            # every case
    python benchmarks/bench_goodput.py --quick    # the headline case only

Prints CPU (process time), wall, peak memory (tracemalloc in process; the child's peak RSS for
whole processes), failures per history and failures simulated per CPU second. It never passes
or fails on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import run_child_cpu  # noqa: E402

MONTH = ["--chip", "v4", "--shape", "12x16x16", "--step-time", "10", "--hours", "720",
         "--repair-hours", "8", "--checkpoint-cost", "30", "--restart-cost", "300"]


def _config(availability: float, spares: int, seeds: int, engine: str = "event-skip",
            steps: int | None = None):
    from sim.reliability.config import (
        Engine,
        FailureConfig,
        GoodputConfig,
        JobConfig,
        SliceInventory,
    )

    repair = 8 * 3600.0
    host_mtbf = repair * availability / (1 - availability)
    job = JobConfig(step_time_s=10.0, steps=steps, horizon_s=None if steps else 720 * 3600.0,
                    checkpoint_cost_s=30.0, restart_cost_s=300.0)
    inv = SliceInventory(num_chips=3072, num_hosts=768, chips_per_host=4, num_cubes=48,
                         ocs=True, spare_cubes=spares)
    fail = FailureConfig(repair_s=repair, rate_per_s=768 / host_mtbf, chip_share=0.0)
    return GoodputConfig(job=job, inventory=inv, failures=fail, seeds=seeds,
                         engine=Engine(engine))


def in_process(name: str, cfg, *, log: bool) -> dict:
    from sim.reliability.simulate import simulate_goodput

    simulate_goodput(_config(0.999, 4, 1), log=False)  # imports and first-call costs
    tracemalloc.start()
    c0, w0 = time.process_time(), time.perf_counter()
    out = simulate_goodput(cfg, log=log)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    s = out.summary
    return {"case": name, "cpu_s": cpu, "wall_s": wall, "peak_mib": peak / 2**20,
            "failures": s["failures"], "seeds": s["seeds"], "goodput": s["goodput"],
            "intervals": len(out.search), "failures_per_cpu_s": s["failures"] * s["seeds"] / cpu}


def whole(name: str, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wall, cpu, rss, out, err, code = run_child_cpu(
        [sys.executable, "-m", "sim", "goodput", *argv, "--json", "--quiet"], cwd=ROOT, env=env)
    if code:
        raise SystemExit(f"{name}: exit {code}: {err}")
    import json

    s = json.loads(out)
    return {"case": name, "cpu_s": cpu, "wall_s": wall, "peak_mib": rss / 2**20,
            "failures": s["failures"], "seeds": s["seeds"], "goodput": s["goodput"],
            "intervals": len(s["interval_search"]),
            "failures_per_cpu_s": s["failures"] * s["seeds"] / cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the headline case only")
    a = ap.parse_args()
    rows = [in_process("month, 98% hosts, 16 spares, 1 seed (headline)", _config(0.98, 16, 1),
                       log=False)]
    if not a.quick:
        rows += [
            in_process("month, 98% hosts, 16 spares, 10 seeds", _config(0.98, 16, 10),
                       log=False),
            in_process("month, 99.5% hosts, static, 10 seeds", _config(0.995, 0, 10),
                       log=False),
            in_process("month of steps (259,200), 99.5% hosts, 16 spares, 10 seeds",
                       _config(0.995, 16, 10, steps=259_200), log=False),
            in_process("month, 98% hosts, 16 spares, 1 seed, --engine simpy",
                       _config(0.98, 16, 1, engine="simpy"), log=True),
            whole("tpusim goodput, 99.5% hosts, 16 spares, 10 seeds (process)",
                  [*MONTH, "--host-availability", "0.995", "--spare-cubes", "16"]),
            whole("tpusim goodput, the step model (llama3-8b on v4 4x4x8), 10 seeds (process)",
                  ["--chip", "v4", "--shape", "4x4x8", "--model", "llama3-8b", "--seq-len",
                   "2048", "--batch-per-chip", "1", "--mesh", "fsdp=128", "--steps",
                   "1000000", "--host-mtbf-hours", "2000", "--repair-hours", "4",
                   "--spare-cubes", "2", "--storage-bytes-per-s", "2e9"]),
        ]
    print("| case | CPU s | wall s | peak MiB | failures per seed | seeds | intervals searched "
          "| failures / CPU s | goodput |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['cpu_s']:.3f} | {r['wall_s']:.3f} | {r['peak_mib']:.1f} | "
              f"{r['failures']:,.0f} | {r['seeds']} | {r['intervals']} | "
              f"{r['failures_per_cpu_s']:,.0f} | {r['goodput']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
