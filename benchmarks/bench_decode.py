"""Wall time and peak memory of `tpusim decode` for LLaMA-3-405B on a v5p-128 (the inference
issue's speed target: <= 2 s as a whole process), plus smaller cases for scale.

Run: python benchmarks/bench_decode.py. Measurements only; nothing passes or fails on time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from _measure import run_child

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("llama3-8b", ["--chip", "v5e", "--shape", "4x2"], "tensor=8", 32, 8192),
    ("llama3-70b", ["--chip", "v5e", "--shape", "4x2"], "tensor=8", 32, 8192),
    ("llama3-405b", ["--slice", "v5p-128"], "tensor=64", 64, 8192),
    ("llama3-405b", ["--slice", "v5p-128"], "data=2,tensor=32", 64, 8192),
]


def main() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    print(f"{'model':<12} {'pod':<22} {'mesh':<18} {'batch':>5} {'wall s':>7} {'RSS MiB':>8} "
          f"{'step ms':>8} {'fits':>5}")
    for model, pod, mesh, batch, ctx in CASES:
        cmd = [sys.executable, "-m", "sim.cli", "--quiet", "decode", *pod, "--model", model,
               "--batch", str(batch), "--context-len", str(ctx), "--mesh", mesh, "--json"]
        walls, rss, out = [], 0, None
        for _ in range(3):
            wall, rss_bytes, stdout, err, code = run_child(cmd, cwd=ROOT, env=env)
            if code != 0:
                raise SystemExit(f"{model} {mesh}: {err.strip()}")
            walls.append(wall)
            rss = max(rss, rss_bytes // 1024)
            out = json.loads(stdout)
        print(f"{model:<12} {' '.join(pod):<22} {mesh:<18} {batch:>5} "
              f"{statistics.median(walls):>7.2f} {rss / 1024:>8.1f} "
              f"{out['step_time_s'] * 1e3:>8.2f} {str(out['fits_in_hbm']):>5}")


if __name__ == "__main__":
    main()
