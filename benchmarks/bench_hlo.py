"""Wall time and peak memory of `tpusim replay PROGRAM.txt` (HLO import + replay) as a whole
process: the committed 2-layer train-step fixture (1.8 MB of HLO text) and, if given, the 8-layer
train step that `make_hlo_fixtures.py` writes to /tmp (7.9 MB with metadata). The issue's target
is <= 5 s for a 2 MB module. Measurements only; nothing passes or fails on time.

Run: python benchmarks/bench_hlo.py [--big /tmp/bench_train8_v5e16.hlo.txt] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from pathlib import Path

from _measure import run_child

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hlo" / "train_fsdp_v5e16.hlo.txt.gz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", default="/tmp/bench_train8_v5e16.hlo.txt")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cases = [("train_fsdp_v5e16 (2 layers)", FIXTURE)]
    if Path(args.big).is_file():
        cases.append(("bench_train8_v5e16 (8 layers)", Path(args.big)))
    print(f"{'module':<30} {'text MB':>8} {'ops':>6} {'wall s':>7} {'min s':>6} {'RSS MiB':>8} "
          f"{'step ms':>8} {'wall/5s':>7}")
    for label, path in cases:
        size = len(gzip.open(path).read()) if path.suffix == ".gz" else path.stat().st_size
        cmd = [sys.executable, "-m", "sim.cli", "--quiet", "replay", str(path), "--chip", "v5e",
               "--shape", "4x4", "--json"]
        walls, rss, out = [], 0, None
        for _ in range(args.repeats):
            wall, rss_bytes, stdout, err, code = run_child(cmd, cwd=ROOT, env=env)
            if code != 0:
                raise SystemExit(f"{label}: {err.strip()}")
            walls.append(wall)
            rss = max(rss, rss_bytes)
            out = json.loads(stdout)
        med = statistics.median(walls)
        print(f"{label:<30} {size / 1e6:>8.2f} {out['num_ops']:>6} {med:>7.2f} {min(walls):>6.2f} "
              f"{rss / 2**20:>8.1f} {out['step_time_s'] * 1e3:>8.3f} {med / 5:>7.2f}")


if __name__ == "__main__":
    main()
