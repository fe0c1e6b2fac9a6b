"""Where the time of `--plots` goes: matplotlib's import, building each figure and writing each
PNG, for training steps, a per-chip step, a collective and the largest torus.

Run: python benchmarks/bench_plots.py [--before REV] [--repeats N]. Each case runs in a fresh
Python process (so the imports are counted, as in a `tpusim ... --plots` run): the run is
simulated first (not counted), then the plots are timed in wall and CPU seconds. `--before REV`
times the plot modules of `sim/export/` as they were at git revision REV on the same results
(for a before/after table; the old module, `plots.py` alone, drew with pyplot). Numbers are
measurements on the machine that ran them; nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # The demo's step (LLaMA-3-8B, v5e 4x4): ~1,400 ops; the torus drawn per link class.
    "train 8B v5e 4x4": ("train", dict(chip="v5e", shape="4x4", model="llama3-8b", seq_len=2048,
                                       batch_per_chip=1, mesh="fsdp=4,tensor=4")),
    # A 70B step on 512 chips: ~3,500 ops on the timeline.
    "train 70B v5p 8x8x8": ("train", dict(chip="v5p", shape="8x8x8", model="llama3-70b",
                                          seq_len=8192, batch_per_chip=1,
                                          mesh="fsdp=128,tensor=4")),
    # Per-chip engine with a slow link and chip: the per-link torus (4 z slices) and finish map.
    "train 8B v5p 4x4x4 slow": ("train", dict(chip="v5p", shape="4x4x4", model="llama3-8b",
                                              seq_len=2048, batch_per_chip=1,
                                              mesh="fsdp=16,tensor=4",
                                              slow_link=["0,0,0:x+:0.5"],
                                              slow_chip=["1,1,1:0.8"])),
    # A collective with a dead link: 1,024 links drawn one by one.
    "collective 16x16 dead link": ("collective", dict(chip="v5e", shape="16x16", op="all-reduce",
                                                      axes="x", bytes="32MiB",
                                                      dead_link=["3,3:x+"])),
    # The largest pod drawn per link: 16x20x28 (28 z panels, 53,760 links), synthetic values.
    "torus 16x20x28 per link": ("torus", dict(chip="v5p", shape="16x20x28")),
}

_CHILD = r"""
import json, sys, time, importlib.util, subprocess
case, kind, flags, before = json.loads(sys.argv[1])
import sim
import numpy as np
if kind == "train":
    run = sim.train(**flags)
elif kind == "collective":
    run = sim.collective(**flags)
else:
    from sim.chips import get_chip
    from topologies.slices import resolve_topology
    chip = get_chip(flags["chip"])
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=flags["shape"])
    util = np.random.default_rng(0).random(topo.num_links)
import types
# The plot modules in the order they import each other (a revision before the split into
# step, torus and collective plots has the first alone).
NAMES = ("plots", "torus_plots", "step_plots", "collective_plots")
plots = types.SimpleNamespace()
for name in NAMES:
    if before:
        done = subprocess.run(["git", "show", f"{before}:sim/export/{name}.py"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            continue
        spec = importlib.util.spec_from_loader(f"sim.export.{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"sim.export.{name}"] = mod  # the next modules import this revision's
        exec(compile(done.stdout, f"old_{name}.py", "exec"), mod.__dict__)
    else:
        mod = importlib.import_module(f"sim.export.{name}")
    plots.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
out = "/tmp/tpusim_bench_plots/" + str(abs(hash(case)))
w0, c0 = time.perf_counter(), time.process_time()
import matplotlib
matplotlib.use("Agg")  # what both versions end up using; timed as the import
import matplotlib.figure
t_import = (time.perf_counter() - w0, time.process_time() - c0)
w1, c1 = time.perf_counter(), time.process_time()
if kind == "train":
    paths = plots.plot_step(run.result, run.to_dict(), out)
elif kind == "collective":
    paths = plots.plot_collective(run.result, out)
elif before:
    from pathlib import Path
    paths = [plots.draw_torus(topo, util, "synthetic", Path(out) / "t.png")]
else:
    from pathlib import Path
    paths = [plots.plot_torus(topo, util, Path(out) / "t.png", caption="synthetic",
                              what="synthetic", capacity=np.ones(topo.num_links))]
t_plots = (time.perf_counter() - w1, time.process_time() - c1)
print(json.dumps({"import_wall_s": t_import[0], "import_cpu_s": t_import[1],
                  "plots_wall_s": t_plots[0], "plots_cpu_s": t_plots[1],
                  "files": len(paths),
                  "bytes": sum(__import__("os").path.getsize(p) for p in paths)}))
"""


# Each plot alone, at 256 and at 8,960 chips (`--per-plot`): the per-chip maps of a straggler,
# the torus of a step simulated per link class (drawn per link where a mesh axis takes a factor
# of a physical axis), and a collective's plots with a dead link (its per-link timeline).
SIZES = {
    "step 256 v5e 16x16": ("train", dict(chip="v5e", shape="16x16", model="llama3-8b",
                                         seq_len=2048, batch_per_chip=1,
                                         mesh="fsdp=64,tensor=4")),
    "step 256 slow chip": ("train", dict(chip="v5e", shape="16x16", model="llama3-8b",
                                         seq_len=2048, batch_per_chip=1,
                                         mesh="fsdp=64,tensor=4", slow_chip=["5,9:0.7"])),
    "step 8960 v5p pod": ("train", dict(slice="v5p-pod", model="llama3-70b", seq_len=8192,
                                        batch_per_chip=1, mesh="fsdp=2240,tensor=4",
                                        fsdp_grad="auto")),
    "step 8960 slow chip": ("train", dict(slice="v5p-pod", model="llama3-70b", seq_len=8192,
                                          batch_per_chip=1, mesh="fsdp=2240,tensor=4",
                                          fsdp_grad="auto", slow_chip=["3,5,7:0.8"])),
    "collective 256 dead link": ("collective", dict(chip="v5e", shape="16x16",
                                                    op="all-reduce", axes="x",
                                                    bytes="32MiB", dead_link=["3,3:x+"])),
    "collective 8960 dead link": ("collective", dict(slice="v5p-pod", op="all-gather",
                                                     axes="x", bytes="32MiB",
                                                     dead_link=["3,3,3:x+"])),
}

_PER_PLOT = r"""
import json, resource, sys, time
case, kind, flags = json.loads(sys.argv[1])
import sim
run = sim.train(**flags) if kind == "train" else sim.collective(**flags)
rss_sim = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import sim.export.collective_plots as collective_plots
import sim.export.plots as plots
import sim.export.step_plots as step_plots
import sim.export.torus_plots as torus_plots
MODULES = (plots, torus_plots, step_plots, collective_plots)
timed = []  # (name, wall, cpu) per figure built

def timing(name, fn):
    def wrap(*a, **k):
        w, c = time.perf_counter(), time.process_time()
        out = fn(*a, **k)
        timed.append([name(a, k) if callable(name) else name, time.perf_counter() - w,
                      time.process_time() - c])
        return out
    return wrap

for attr, name in (("_timeline", "timeline.png"), ("_breakdown", "breakdown.png"),
                   ("_utilization", "utilization.png"), ("torus_figure", "links_on_torus.png"),
                   ("_collective_timeline", "collective_timeline.png"),
                   ("collective_links_figure", "collective_links.png"),
                   ("step_link_shares", "links_on_torus.png")):
    for mod in MODULES:  # wherever a caller looks the name up
        if hasattr(mod, attr):
            setattr(mod, attr, timing(name, getattr(mod, attr)))
torus_plots.chip_map_figure = timing(lambda a, k: "chip map: " + k["label"],
                                     torus_plots.chip_map_figure)
w0, c0 = time.perf_counter(), time.process_time()
import matplotlib.figure  # noqa: the import, counted apart
imp = (time.perf_counter() - w0, time.process_time() - c0)
figs = (step_plots.step_figures(run.result, run.to_dict()) if kind == "train"
        else collective_plots.collective_figures(run.result))
saves = {}
out = "/tmp/tpusim_bench_plots/" + str(abs(hash(case)))
from pathlib import Path
for name, fig in figs.items():
    w, c = time.perf_counter(), time.process_time()
    plots.save(fig, Path(out) / name)
    saves[name] = (time.perf_counter() - w, time.process_time() - c)
print(json.dumps({"import": imp, "built": timed, "saved": saves, "rss_sim_mib": rss_sim,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "chips": run.result.num_chips if kind == "train" else run.result.num_chips}))
"""


def per_plot(case: str) -> dict:
    kind, flags = SIZES[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _PER_PLOT, json.dumps([case, kind, flags])],
                          capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{case}: failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main_per_plot(cases: list[str]) -> None:
    """Each plot's build and write time (wall and CPU seconds) at 256 and 8,960 chips, and the
    process's peak RSS after the run and after the plots."""
    print(f"{'case':<26} {'plot':<44} {'wall s':>7} {'CPU s':>7}")
    for case in cases:
        r = per_plot(case)
        built = {}
        for name, w, c in r["built"]:
            # A figure built inside another (the torus inside the step's) counts once, its own.
            b = built.setdefault(name, [0.0, 0.0])
            b[0] += w
            b[1] += c
        chip_maps = iter(n for n in ("chip_compute.png", "chip_collective_wait.png",
                                     "chip_slowdown.png"))
        for name, (w, c) in built.items():
            file = next(chip_maps) if name.startswith("chip map") else name
            sw, sc = r["saved"].get(file, (0.0, 0.0))
            print(f"{case:<26} {file + ' (build + write)':<44} {w + sw:7.2f} {c + sc:7.2f}",
                  flush=True)
        print(f"{case:<26} {'peak RSS: after the run / after the plots':<44} "
              f"{r['rss_sim_mib']:7.0f} {r['rss_mib']:7.0f} MiB", flush=True)


def run(case: str, before: str | None) -> dict:
    kind, flags = CASES[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([case, kind, flags, before])],
                          capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{case}: failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", help="also time the plot modules of this git revision")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", help="comma-separated subset of the case names")
    ap.add_argument("--per-plot", action="store_true",
                    help="time each plot alone at 256 and 8,960 chips (the SIZES cases)")
    args = ap.parse_args()
    if args.per_plot:
        main_per_plot(args.cases.split(",") if args.cases else list(SIZES))
        return
    cases = args.cases.split(",") if args.cases else list(CASES)
    versions = [("now", None)] + ([(args.before, args.before)] if args.before else [])
    print(f"{'case':<28} {'version':<9} {'import s':>9} {'plots wall s':>13} "
          f"{'plots CPU s':>12} {'files':>6} {'KiB':>6}")
    for case in cases:
        for name, rev in versions:
            rows = [run(case, rev) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{case:<28} {name[:9]:<9} {med['import_wall_s']:9.2f} "
                  f"{med['plots_wall_s']:13.2f} {med['plots_cpu_s']:12.2f} "
                  f"{int(med['files']):6d} {med['bytes'] / 1024:6.0f}", flush=True)


if __name__ == "__main__":
    main()
