"""Benchmark `tpusim collective` on pods from 64 to 8960 chips.

Run from anywhere (it is not a pytest test and never passes or fails on wall time):

    .venv/bin/python benchmarks/bench_collectives.py            # the whole ladder, 3 runs each
    .venv/bin/python benchmarks/bench_collectives.py --quick    # the two headline cases, once

For every pod in the ladder it measures three collectives:

* all-reduce over every axis of ~1 GiB (2**30 rounded down to a multiple of the chip count,
  since each chip holds V/N bytes: 2**30 itself is refused on 16x20x28 = 8960 chips, and the
  nearest multiple below it is 1073739520 = 8960 * 119837),
* all-gather along x of 1 GiB (rounded down the same way if x did not divide it),
* the same all-reduce with `--slow-link 0,..,0:x+:0.5`, which forces full per-link detail,
* the same all-reduce with `--dead-link 0,..,0:x+` (routes detour around it; the run also
  simulates the healthy pod to report the detour's cost),
* the same all-reduce with `--mode per-chip` (every chip of every group and every link),

plus the brute-force case ASTRA-sim's analytical backend is compared with: v4 16x16x16
all-reduce over x,y,z of 64 MiB, `--algorithm per-axis-ring --mode per-chip`.

Each case is measured twice:

* as a whole process, `tpusim collective ... --json` (the console script next to this Python,
  or `python -m sim.cli`), timed with `time.perf_counter` around `subprocess.run`: the median
  of `--repeats` runs, plus the child's peak resident set size (`RUSAGE_CHILDREN`, taken in a
  small helper process so that it is tpusim's own peak; see `run_child`);
* in-process, `simulate_collective(...)` alone on a freshly resolved chip and topology (median
  of `--repeats` calls), and one more call under `tracemalloc` for the peak traced heap.

It prints a table and writes a JSON file with the machine's details; the numbers describe the
machine that ran them. The 2 s figure for the headline cases is a target to compare against,
printed as a ratio; nothing here asserts on it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

from _measure import run_child as _run_child

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "collectives.json"
QUICK_OUT = REPO / "benchmarks" / "results" / "collectives-quick.json"
GIB = 1 << 30
TARGET_S = 2.0
SLOW_FACTOR = 0.5

# (chip, shape) from 64 to 8960 chips.
LADDER: list[tuple[str, str]] = [
    ("v5p", "4x4x4"),
    ("v5p", "8x8x8"),
    ("v5p", "8x16x16"),
    ("v5p", "16x16x16"),
    ("v5p", "16x20x28"),
    ("v4", "16x16x16"),
    ("v5e", "16x16"),
]
# (chip, shape, op, variant) of the cases the 2 s target is about.
HEADLINES = {("v5p", "16x20x28", "all-reduce", ""), ("v4", "16x16x16", "all-gather", ""),
             ("v4", "16x16x16", "all-reduce", "per-axis-ring per-chip")}


@dataclass(frozen=True)
class Case:
    chip: str
    shape: str
    op: str
    axes: str
    nbytes: int
    slow_link: str | None = None
    dead_link: str | None = None
    mode: str | None = None
    algorithm: str | None = None

    @property
    def dims(self) -> list[int]:
        return [int(d) for d in self.shape.split("x")]

    @property
    def num_chips(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def variant(self) -> str:
        parts = [self.algorithm or "", "slow-link" if self.slow_link else "",
                 "dead-link" if self.dead_link else "", self.mode or ""]
        return " ".join(p for p in parts if p)

    @property
    def headline(self) -> bool:
        return (self.chip, self.shape, self.op, self.variant) in HEADLINES

    @property
    def collective(self) -> str:
        return " ".join(p for p in (self.op, self.axes, self.variant) if p)

    def cli_args(self) -> list[str]:
        args = [
            "collective", "--chip", self.chip, "--shape", self.shape, "--op", self.op,
            "--axes", self.axes, "--bytes", str(self.nbytes), "--json",
        ]
        if self.slow_link:
            args += ["--slow-link", self.slow_link]
        if self.dead_link:
            args += ["--dead-link", self.dead_link]
        if self.mode:
            args += ["--mode", self.mode]
        if self.algorithm:
            args += ["--algorithm", self.algorithm]
        return args


def round_down(target: int, multiple: int) -> int:
    return target // multiple * multiple


def ladder_cases(*, quick: bool) -> list[Case]:
    cases = []
    for chip, shape in LADDER:
        dims = [int(d) for d in shape.split("x")]
        n = 1
        for d in dims:
            n *= d
        all_axes = ",".join("xyz"[: len(dims)])
        zero = ",".join("0" * len(dims))
        ar = round_down(GIB, n)
        ag = round_down(GIB, dims[0])  # the replica group is one x line: dims[0] chips
        cases += [
            Case(chip, shape, "all-reduce", all_axes, ar),
            Case(chip, shape, "all-gather", "x", ag),
            Case(chip, shape, "all-reduce", all_axes, ar, f"{zero}:x+:{SLOW_FACTOR}"),
            Case(chip, shape, "all-reduce", all_axes, ar, dead_link=f"{zero}:x+"),
            Case(chip, shape, "all-reduce", all_axes, ar, mode="per-chip"),
        ]
    cases.append(Case("v4", "16x16x16", "all-reduce", "x,y,z", 64 << 20,
                      algorithm="per-axis-ring", mode="per-chip"))
    if quick:
        cases = [c for c in cases if c.headline]
    return cases


# -- whole process ------------------------------------------------------------------------------
def cli_command() -> tuple[list[str], str]:
    """The `tpusim` console script installed beside this interpreter, else `python -m sim.cli`."""
    script = Path(sys.executable).parent / "tpusim"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)], str(script)
    return [sys.executable, "-m", "sim.cli"], f"{sys.executable} -m sim.cli"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Import the working tree's packages, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_child(cmd: list[str]) -> tuple[float, int, str, str, int]:
    """Run `cmd` once as a whole process (see benchmarks/_measure.py)."""
    return _run_child(cmd, cwd=REPO, env=child_env())


def measure_process(case: Case, repeats: int) -> dict:
    base, _label = cli_command()
    cmd = base + case.cli_args()
    walls, rsss, outputs = [], [], []
    for _ in range(repeats):
        wall, rss, out, err, code = run_child(cmd)
        if code != 0:
            return {"error": f"exit code {code}: {err.strip() or out.strip()}"}
        walls.append(wall)
        rsss.append(rss)
        outputs.append(json.loads(out))
    times = {o["time_s"] for o in outputs}
    return {
        "wall_s": walls,
        "wall_median_s": statistics.median(walls),
        "peak_rss_bytes": max(rsss),
        "result": outputs[-1],
        "deterministic": len(times) == 1,
    }


def measure_baseline(repeats: int) -> dict:
    """Wall time of an empty interpreter and of importing the simulator's modules."""
    empty = [sys.executable, "-c", "pass"]
    imports = [sys.executable, "-c", "import sim.cli, sim.collectives.simulate, topologies.slices"]
    out = {}
    for key, cmd in (("python_startup", empty), ("python_plus_imports", imports)):
        walls, rsss = [], []
        for _ in range(repeats):
            wall, rss, _o, err, code = run_child(cmd)
            if code != 0:
                out[key + "_s"] = None
                out[key + "_error"] = err.strip()
                break
            walls.append(wall)
            rsss.append(rss)
        else:
            out[key + "_s"] = statistics.median(walls)
            out[key + "_peak_rss_bytes"] = max(rsss)
    return out


# -- in process ---------------------------------------------------------------------------------
def _setup(case: Case):
    from sim.chips import get_chip
    from topologies.slices import resolve_topology

    chip = get_chip(case.chip)
    topo = resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        shape=case.shape,
    )
    return chip, topo


def _simulate(simulate_collective, case: Case, chip, topo):
    from topologies.scenario import scenario_from_flags

    return simulate_collective(
        chip=chip, topology=topo, op=case.op, axes=case.axes, nbytes=case.nbytes,
        slow_links=(case.slow_link,) if case.slow_link else (),
        scenario=scenario_from_flags(dead_link=[case.dead_link] if case.dead_link else []),
        mode=case.mode or "auto", algorithm=case.algorithm or "auto",
    )


def measure_in_process(case: Case, repeats: int) -> dict:
    from sim.collectives.simulate import simulate_collective  # imported before any timing
    from topologies.errors import TpusimError

    times = []
    res = None
    try:
        for _ in range(repeats):
            chip, topo = _setup(case)  # fresh objects: nothing cached from the previous call
            t0 = time.perf_counter()
            res = _simulate(simulate_collective, case, chip, topo)
            times.append(time.perf_counter() - t0)
        chip, topo = _setup(case)
        tracemalloc.start()
        try:
            _simulate(simulate_collective, case, chip, topo)
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    except TpusimError as exc:
        return {"error": str(exc)}
    median = statistics.median(times)
    return {
        "simulate_s": times,
        "simulate_median_s": median,
        "events_per_s": res.sim_events / median if median > 0 else None,
        "tracemalloc_peak_bytes": peak,
        "result": res.to_dict(),
    }


# -- report -------------------------------------------------------------------------------------
def _fmt_sim_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} us"


def _fmt_bytes(n: int) -> str:
    if n == 64 << 20:
        return "64 MiB"
    return "1 GiB" if n == GIB else f"{n} *"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


COLUMNS = (
    f"{'pod':<15} {'chips':>5}  {'collective':<42} {'V (bytes)':>12}  {'mode':<9} "
    f"{'events':>6} {'sim time':>10}  {'wall s':>7} {'in-proc s':>9} {'events/s':>9} "
    f"{'RSS MiB':>7} {'heap MiB':>8}"
)


def format_row(row: dict) -> str:
    c = row["case"]
    pod = f"{c['chip']} {c['shape']}" + (" !" if row["headline"] else "")
    head = f"{pod:<15} {c['num_chips']:>5}  {row['collective']:<42} {_fmt_bytes(c['bytes']):>12}"
    if "error" in row:
        return f"{head}  error: {row['error']}"
    p, i = row["process"], row["in_process"]
    r = i["result"]
    return (
        f"{head}  {r['mode']:<9} {r['sim_events']:>6} {_fmt_sim_time(r['time_s']):>10}  "
        f"{p['wall_median_s']:>7.3f} {i['simulate_median_s']:>9.4f} {i['events_per_s']:>9,.0f} "
        f"{_mib(p['peak_rss_bytes']):>7} {_mib(i['tracemalloc_peak_bytes']):>8}"
    )


def headline_lines(rows: list[dict]) -> list[str]:
    lines = [f"Headline cases (! above) against the {TARGET_S:g} s target for the whole command "
             f"(informational, not a test):"]
    for row in rows:
        if not row["headline"] or "error" in row:
            continue
        c = row["case"]
        wall = row["process"]["wall_median_s"]
        lines.append(
            f"  {c['chip']} {c['shape']} {row['collective']}, V = {c['bytes']} B: wall "
            f"{wall:.3f} s = {wall / TARGET_S:.3f} x target; simulate_collective "
            f"{row['in_process']['simulate_median_s']:.4f} s"
        )
    return lines


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_available"] = len(os.sched_getaffinity(0))
    for mod in ("numpy", "simpy"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except Exception:  # pragma: no cover - reported, not fatal
            info[f"{mod}_version"] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the headline cases, once")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per case, median reported (default 3, or 1 with --quick)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"JSON output (default {DEFAULT_OUT.relative_to(REPO)}, or "
                         f"{QUICK_OUT.relative_to(REPO)} with --quick)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        ap.error("--repeats must be >= 1")
    out_path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)

    sys.path.insert(0, str(REPO))  # in-process runs import the working tree too
    _cmd, cmd_label = cli_command()
    started = dt.datetime.now(dt.UTC)
    info = machine_info()
    print(f"tpusim collective benchmark, {started:%Y-%m-%d %H:%M} UTC, "
          f"{'quick' if args.quick else 'full ladder'}, {repeats} run(s) per case")
    print(f"machine: {info['platform']}, Python {info['python_version']}, "
          f"{info['cpu_count']} CPU(s)")
    print(f"command: {cmd_label} collective ... --json")
    baseline = measure_baseline(repeats)
    if baseline.get("python_startup_s") is not None:
        print(f"baseline: empty interpreter {baseline['python_startup_s']:.3f} s "
              f"({_mib(baseline['python_startup_peak_rss_bytes'])} MiB); interpreter + simulator "
              f"imports {baseline.get('python_plus_imports_s') or 0:.3f} s "
              f"({_mib(baseline.get('python_plus_imports_peak_rss_bytes'))} MiB)")
    print()
    print(COLUMNS)

    rows = []
    for case in ladder_cases(quick=args.quick):
        row = {
            "case": {"chip": case.chip, "shape": case.shape, "num_chips": case.num_chips,
                     "op": case.op, "axes": case.axes, "bytes": case.nbytes,
                     "bytes_rounded_from": GIB if case.nbytes != GIB else None,
                     "slow_link": case.slow_link, "dead_link": case.dead_link,
                     "mode": case.mode, "algorithm": case.algorithm,
                     "cli_args": case.cli_args()},
            "collective": case.collective,
            "headline": case.headline,
        }
        proc = measure_process(case, repeats)
        inproc = measure_in_process(case, repeats)
        if "error" in proc or "error" in inproc:
            row["error"] = proc.get("error") or inproc.get("error")
        else:
            row["process"] = proc
            row["in_process"] = inproc
            row["process_matches_in_process"] = (
                proc["result"]["time_s"] == inproc["result"]["time_s"]
                and proc["result"]["sim_events"] == inproc["result"]["sim_events"]
            )
        rows.append(row)
        print(format_row(row), flush=True)

    print("\n'!' = headline case; '*' = 2**30 rounded down to a multiple of the group size.")
    print("wall s: median whole `tpusim` process; in-proc s: median simulate_collective call;")
    print("RSS MiB: child peak resident set; heap MiB: tracemalloc peak of one in-process call.")
    print()
    for line in headline_lines(rows):
        print(line)
    mismatched = [r["collective"] for r in rows if r.get("process_matches_in_process") is False]
    if mismatched:
        print(f"note: CLI and in-process results differ for: {', '.join(mismatched)}")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "collectives",
        "date_utc": started.isoformat(timespec="seconds"),
        "quick": args.quick,
        "repeats": repeats,
        "target_s": TARGET_S,
        "command": cmd_label,
        "machine": info,
        "baseline": baseline,
        "cases": rows,
    }
    out_path.write_text(json.dumps(payload, indent=2) + "\n")
    try:
        shown = out_path.resolve().relative_to(REPO)
    except ValueError:
        shown = out_path
    print(f"\nwrote {shown}")
    # Errors (a case the simulator refused or crashed on) are failures; wall time never is.
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
