"""Wall time, simulated events per second and peak memory of `tpusim train`, from a small slice
to the full 8960-chip v5p pod (LLaMA-3-70B, fsdp x tensor=4, seq 8192, 1 sequence per chip).

Run: python benchmarks/bench_training.py [--quick]. Numbers are measurements on the machine that
ran them; nothing here passes or fails on time. The headline case is the issue's target (whole
process <= 10 s, memory flat in the number of symmetric chips).

`--deep`: instead, a step at the documented layer limit (`MAX_LAYERS`, 4,096 decoder layers of
d_model 1024, seq 1024, on a v5e 2x2 with fsdp=4: ~205,000 ops) and at an eighth of it, as
whole processes: CPU (user + system), wall and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _measure import run_child, run_child_cpu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = [
    ("v5p", "4x4x4", "fsdp=16,tensor=4"),
    ("v5p", "8x8x8", "fsdp=128,tensor=4"),
    ("v5p", "8x16x16", "fsdp=512,tensor=4"),
    ("v5p", "16x16x16", "fsdp=1024,tensor=4"),
    ("v5p", "16x20x28", "fsdp=2240,tensor=4"),
]


def run(chip: str, shape: str, mesh: str, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "sim.cli", "--quiet", "train", "--chip", chip, "--shape", shape,
           "--model", "llama3-70b", "--seq-len", "8192", "--batch-per-chip", "1",
           "--mesh", mesh, "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    walls, rss, out = [], 0, None
    for _ in range(repeats):
        wall, rss_bytes, stdout, err, code = run_child(cmd, cwd=ROOT, env=env)
        if code != 0:
            raise SystemExit(f"{chip} {shape}: tpusim failed: {err.strip()}")
        walls.append(wall)
        rss = max(rss, rss_bytes // 1024)
        out = json.loads(stdout)
    wall = statistics.median(walls)
    return {
        "chip": chip, "shape": shape, "mesh": mesh, "num_chips": out["num_chips"],
        "wall_s": wall, "peak_rss_mib": rss / 1024, "sim_events": out["sim_events"],
        "events_per_s": out["sim_events"] / wall, "step_time_s": out["step_time_s"],
        "mfu": out["mfu"],
    }


def deep(layers: int) -> dict:
    """One `tpusim train` of a `layers`-layer model (the layer limit's case)."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"tpusim_bench_deep{layers}.yaml"
    path.write_text(f"name: deep{layers}\nnum_layers: {layers}\nd_model: 1024\nnum_heads: 8\n"
                    "num_kv_heads: 8\nhead_dim: 128\nd_ff: 4096\nmlp: swiglu\n"
                    "vocab_size: 32000\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "sim.cli", "--quiet", "train", "--chip", "v5e", "--shape",
           "2x2", "--model", str(path), "--seq-len", "1024", "--batch-per-chip", "1", "--mesh",
           "fsdp=4", "--json"]
    wall, cpu, rss, stdout, err, code = run_child_cpu(cmd, cwd=ROOT,
                                                      env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if code != 0:
        raise SystemExit(f"deep {layers}: tpusim failed: {err.strip()}")
    out = json.loads(stdout)
    return {"layers": layers, "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": rss / 2**20,
            "sim_events": out.get("sim_events"), "step_time_s": out["step_time_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="only the 8960-chip headline, once")
    ap.add_argument("--deep", action="store_true",
                    help="instead: steps of 512 and 4,096 layers (the layer limit)")
    args = ap.parse_args()
    if args.deep:
        from topologies.validate import MAX_LAYERS

        print(f"{'layers':>7} {'CPU s':>7} {'wall s':>7} {'RSS MiB':>8} {'events':>9} "
              f"{'step s':>9}")
        for layers in (MAX_LAYERS // 8, MAX_LAYERS):
            r = deep(layers)
            print(f"{r['layers']:>7} {r['cpu_s']:>7.2f} {r['wall_s']:>7.2f} "
                  f"{r['peak_rss_mib']:>8.1f} {r['sim_events'] or 0:>9} {r['step_time_s']:>9.4f}",
                  flush=True)
        return
    cases = CASES[-1:] if args.quick else CASES
    rows = [run(*c, repeats=1 if args.quick else 3) for c in cases]
    print(f"{'pod':<14} {'chips':>6} {'wall s':>7} {'RSS MiB':>8} {'events':>7} "
          f"{'events/s':>9} {'step s':>8} {'MFU':>6}")
    for r in rows:
        print(f"{r['chip']} {r['shape']:<10} {r['num_chips']:>6} {r['wall_s']:>7.2f} "
              f"{r['peak_rss_mib']:>8.1f} {r['sim_events']:>7} {r['events_per_s']:>9.0f} "
              f"{r['step_time_s']:>8.3f} {r['mfu']:>6.1%}")
    head = rows[-1]
    print(f"\nheadline: 8960-chip LLaMA-3-70B step, whole process {head['wall_s']:.2f} s "
          f"= {head['wall_s'] / 10:.2f} x the 10 s target")
    out = ROOT / "benchmarks" / "results" / ("training-quick.json" if args.quick else
                                             "training.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(),
        "python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
