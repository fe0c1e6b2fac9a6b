"""Streaming Perfetto export: wall time, peak RSS, file size and packets/s of a training step
written with `--trace-chips all` on 16, 64 and 256 chips.

Each pod runs LLaMA-3-8B, seq 8192, one sequence per chip, `--mesh fsdp=N` on a v5e (4x4, 8x8,
16x16) as a whole `tpusim train` process three ways: without a trace (the simulation alone),
with `--perfetto X.pftrace --trace-chips all`, and with the Chrome JSON variant (`X.json`). The
export's cost is the difference between the first two; packets are counted by walking the
file's length-delimited framing (each `Trace.packet` is field 1). The issue's target: the
256-chip `.pftrace` in <= 10 s wall and <= 1 GiB peak RSS (before streaming: 67 s, 7.3 GB,
409 MB file).

Run: python benchmarks/bench_export.py [--runs 3] [--chips 16,64,256] [--out F].
Numbers are measurements on the machine that ran them (shared machines are noisy; the load
average is recorded); nothing here passes or fails on time.
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
PODS = {16: "4x4", 64: "8x8", 256: "16x16"}


def count_packets(path: Path) -> int:
    """TracePackets in a .pftrace: walk the `Trace.packet` (field 1, length-delimited) framing."""
    data = path.read_bytes()
    n = pos = 0
    end = len(data)
    while pos < end:
        if data[pos] != 0x0A:
            raise ValueError(f"{path}: byte {pos} is not a Trace.packet field")
        pos += 1
        length = shift = 0
        while True:
            b = data[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        pos += length
        n += 1
    if pos != end:
        raise ValueError(f"{path}: the last packet runs past the end of the file")
    return n


def _cmd(chips: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sim.cli", "train", "--chip", "v5e", "--shape", PODS[chips],
            "--model", "llama3-8b", "--seq-len", "8192", "--batch-per-chip", "1", "--mesh",
            f"fsdp={chips}", "--quiet", *extra]


def measure(cmd: list[str], runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for _ in range(runs):
        wall, cpu, rss, _out, err, code = run_child_cpu(cmd, cwd=ROOT, env=env)
        if code != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()}")
        rows.append((wall, cpu, rss, err.strip()))
    return {"wall_s": statistics.median(r[0] for r in rows),
            "cpu_s": statistics.median(r[1] for r in rows),
            "rss_bytes": max(r[2] for r in rows), "stderr": rows[-1][3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="runs per row (median wall/CPU)")
    ap.add_argument("--chips", default="16,64,256", help="pods to run (16, 64, 256)")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    sizes = [int(c) for c in args.chips.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpusim-bench-export-") as tmp:
        for n in sizes:
            base = measure(_cmd(n, []), args.runs)
            for fmt in ("pftrace", "json"):
                path = Path(tmp) / f"step{n}.{fmt}"
                r = measure(_cmd(n, ["--perfetto", str(path), "--trace-chips", "all"]),
                            args.runs)
                size = path.stat().st_size
                packets = count_packets(path) if fmt == "pftrace" else None
                if fmt == "json":
                    with open(path, encoding="utf-8") as f:
                        packets_json = len(json.load(f)["traceEvents"])
                else:
                    packets_json = None
                export_s = r["wall_s"] - base["wall_s"]
                rows.append({
                    "chips": n, "pod": PODS[n], "format": fmt, "wall_s": r["wall_s"],
                    "cpu_s": r["cpu_s"], "sim_only_wall_s": base["wall_s"],
                    "sim_only_cpu_s": base["cpu_s"], "export_wall_s": export_s,
                    "export_cpu_s": r["cpu_s"] - base["cpu_s"], "rss_bytes": r["rss_bytes"],
                    "sim_only_rss_bytes": base["rss_bytes"], "file_bytes": size,
                    "packets": packets if packets is not None else packets_json,
                    "packets_per_cpu_s": (packets if packets is not None else packets_json)
                    / max(r["cpu_s"] - base["cpu_s"], 1e-9),
                    "warning": r["stderr"],
                })
                path.unlink()
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.runs} run(s) per row")
    print(f"{'chips':>5} {'format':<7} {'wall s':>7} {'CPU s':>6} {'sim CPU':>7} "
          f"{'export CPU':>10} {'RSS MiB':>8} {'sim RSS':>8} {'file MB':>8} {'packets':>9} "
          f"{'packets/s':>10}")
    for r in rows:
        print(f"{r['chips']:>5} {r['format']:<7} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} "
              f"{r['sim_only_cpu_s']:>7.2f} {r['export_cpu_s']:>10.2f} "
              f"{r['rss_bytes'] / 2**20:>8.1f} {r['sim_only_rss_bytes'] / 2**20:>8.1f} "
              f"{r['file_bytes'] / 1e6:>8.1f} {r['packets']:>9,} {r['packets_per_cpu_s']:>10,.0f}")
    print("wall/CPU s: the whole `tpusim train` process with the trace; sim CPU: the same run "
          "without --perfetto;\nexport CPU = the difference; packets: TracePackets (.pftrace) or "
          "trace events (.json), per second of export CPU")
    for r in rows:
        if r["warning"]:
            print(f"{r['chips']} {r['format']}: {r['warning']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"load_average": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
