"""Whole-process measurements shared by the benchmarks: wall time and the child's own peak RSS.

Runs one command in a fresh, small Python (no site, stdlib only) and reports on it. The timing
and `RUSAGE_CHILDREN` live in this helper, not in the benchmark process, because on Linux a
child's ru_maxrss starts from the memory high-water mark of the process that forked it (the
forked/vforked address space is carried through exec), and `RUSAGE_CHILDREN` is the maximum over
every child reaped so far. Measured from the benchmark itself, which grows as it imports numpy
and runs in-process simulations, every row would report the benchmark's size, not tpusim's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _maxrss_bytes(ru_maxrss: int) -> int:
    # Linux reports KiB, macOS bytes.
    return ru_maxrss if sys.platform == "darwin" else ru_maxrss * 1024


_HELPER = r"""
import json, resource, subprocess, sys, time
cmd = json.loads(sys.argv[1])
t0 = time.perf_counter()
done = subprocess.run(cmd, capture_output=True, check=False)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
sys.stdout.write(json.dumps({
    "wall_s": wall,
    "ru_maxrss": ru.ru_maxrss,
    "cpu_s": ru.ru_utime + ru.ru_stime,
    "code": done.returncode,
    "stdout": done.stdout.decode(errors="replace"),
    "stderr": done.stderr.decode(errors="replace"),
}))
"""


def run_child(cmd: list[str], *, cwd: Path, env: dict[str, str]
              ) -> tuple[float, int, str, str, int]:
    """Run `cmd` once: (wall seconds, peak RSS bytes, stdout, stderr, exit code).

    The wall time is `time.perf_counter` around `subprocess.run(cmd)`; the peak RSS is
    `resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` of a helper whose only child is `cmd`.
    """
    done = subprocess.run([sys.executable, "-S", "-c", _HELPER, json.dumps(cmd)],
                          capture_output=True, cwd=cwd, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark helper failed: {done.stderr.decode(errors='replace')}")
    r = json.loads(done.stdout)
    return r["wall_s"], _maxrss_bytes(r["ru_maxrss"]), r["stdout"], r["stderr"], r["code"]


def run_child_cpu(cmd: list[str], *, cwd: Path, env: dict[str, str]
                  ) -> tuple[float, float, int, str, str, int]:
    """`run_child` plus the child's CPU time (user + system seconds): (wall, cpu, peak RSS bytes,
    stdout, stderr, exit code). On a shared machine the CPU time is the steadier number."""
    done = subprocess.run([sys.executable, "-S", "-c", _HELPER, json.dumps(cmd)],
                          capture_output=True, cwd=cwd, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark helper failed: {done.stderr.decode(errors='replace')}")
    r = json.loads(done.stdout)
    return (r["wall_s"], r["cpu_s"], _maxrss_bytes(r["ru_maxrss"]), r["stdout"], r["stderr"],
            r["code"])
