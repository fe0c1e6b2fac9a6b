"""Fuzz the `tpusim` CLI outside CI: the saved corpus plus N generated inputs, each in its own
forked subprocess with a time limit and an address-space cap.

    .venv/bin/python -m validation.fuzz_cli --generated 2000 --seed 0 [--surfaces a,b] [--json FILE]

Every case is judged by `tests/fuzz_harness.judge` (exit 0 with finite outputs, or one
`tpusim: error:` line with exit 2 and nothing written; invalid inputs must not succeed; paths
that are not regular files are never replaced), and the process by its wall time (a hang is no
result within --timeout s) and peak RSS (over 2 GiB is a finding). The report counts each class
and lists the first examples of every problem.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from sim.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# The generators and the judge are the test suite's (tests/fuzz_inputs.py imports
# fuzz_harness by its bare name, as pytest puts tests/ on the path), so this runner reads them
# from there too.
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_harness as fh  # noqa: E402
import fuzz_inputs  # noqa: E402

RSS_LIMIT_BYTES = 2 << 30


def _child(case: dict, tmp: Path, timeout_s: float, wfd: int) -> None:
    # Cap the address space well above the 2 GiB finding threshold so a runaway run dies
    # instead of taking the machine down; RSS is measured by the parent.
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    try:
        run = fh.run_in_process(case, tmp, timeout_s=timeout_s)
        problems = fh.judge(case, run)
        msg = {"rc": run["rc"], "problems": problems, "stderr": run["stderr"][:300]}
    except BaseException as exc:  # noqa: BLE001
        msg = {"rc": None, "problems": [f"harness: {type(exc).__name__}: {exc}"], "stderr": ""}
    os.write(wfd, json.dumps(msg).encode())
    os._exit(0)


def run_case(case: dict, timeout_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tpusim-fuzz-"))
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(case, tmp, timeout_s, w)
    os.close(w)
    deadline = t0 + timeout_s + 15
    status = rusage = None
    while True:
        wpid, status, rusage = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, rusage = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    shutil.rmtree(tmp, ignore_errors=True)
    rss = rusage.ru_maxrss * 1024
    if data:
        res = json.loads(data)
    elif wall > timeout_s:
        res = {"rc": None, "problems": [f"hang: killed after {wall:.0f} s"], "stderr": ""}
    else:
        res = {"rc": None, "problems": [f"died: status {status} (memory cap?)"], "stderr": ""}
    if rss > RSS_LIMIT_BYTES:
        res["problems"].append(f"peak RSS {rss / 2**30:.2f} GiB > 2 GiB")
    res.update(id=case["id"], wall_s=wall, rss_bytes=rss,
               cpu_s=rusage.ru_utime + rusage.ru_stime)
    return res


def classify(problem: str) -> str:
    # "internal error" first: its message ends by pointing at the traceback.
    for key, label in (("internal error", "internal errors"), ("traceback", "tracebacks"),
                       ("hang", "hangs"),
                       ("peak RSS", "runs over 2 GiB"), ("died", "killed (memory cap)"),
                       ("silent success", "silent successes on invalid input"),
                       ("non-regular", "replaced non-regular output paths"),
                       ("partial output", "partial output on error")):
        if key in problem:
            return label
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generated", type=int, default=2000, help="generated cases (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    ap.add_argument("--no-corpus", action="store_true")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--surfaces", help="comma list of generators to draw from, evenly (default: "
                                       "every one, as tests/fuzz_inputs.SURFACES weights them)")
    args = ap.parse_args()
    surfaces = args.surfaces.split(",") if args.surfaces else None
    unknown = sorted(set(surfaces or ()) - set(fuzz_inputs.GENERATORS))
    if unknown:
        ap.error(f"--surfaces: no generator {', '.join(unknown)}; the generators are "
                 f"{', '.join(sorted(fuzz_inputs.GENERATORS))}")

    # Build the parser once in the parent (the imports are at the top) so forked children
    # start warm.
    build_parser()
    fh.base_trace()
    cases = [] if args.no_corpus else fh.load_corpus()
    rng = random.Random(args.seed)
    if surfaces:
        cases += [fuzz_inputs.GENERATORS[rng.choice(surfaces)](rng, i)
                  for i in range(args.generated)]
    else:
        cases += [fuzz_inputs.generate(rng, i) for i in range(args.generated)]
    t0 = time.perf_counter()
    results = []
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for n, case in enumerate(cases, 1):
        res = run_case(case, args.timeout)
        results.append(res)
        for p in res["problems"]:
            label = classify(p)
            counts[label] = counts.get(label, 0) + 1
            examples.setdefault(label, [])
            if len(examples[label]) < 5:
                examples[label].append(f"{case['id']}: {p[:200]}")
        if n % 100 == 0:
            print(f"  {n}/{len(cases)} cases, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    wall = time.perf_counter() - t0
    ok = sum(r["rc"] == 0 for r in results)
    err = sum(r["rc"] == 2 for r in results)
    print(f"{len(cases)} cases ({len(cases) - args.generated} corpus, {args.generated} generated, "
          f"seed {args.seed}) in {wall:.0f} s: {ok} exit 0, {err} exit 2")
    print(f"slowest case {max(r['wall_s'] for r in results):.1f} s wall, "
          f"{max(r['cpu_s'] for r in results):.1f} CPU-s; largest peak RSS "
          f"{max(r['rss_bytes'] for r in results) / 2**20:.0f} MiB; cases' CPU "
          f"{sum(r['cpu_s'] for r in results):.0f} s in all")
    # Per surface: the generator of a case is its id's middle part (gen-<surface>-<n>); saved
    # cases count under "corpus".
    surfaces: dict[str, list[int]] = {}
    for case, r in zip(cases, results, strict=True):
        cid = case["id"]
        name = cid.split("-", 1)[1].rsplit("-", 1)[0] if cid.startswith("gen-") else "corpus"
        tally = surfaces.setdefault(name, [0, 0, 0, 0])
        tally[0] += 1
        tally[1] += r["rc"] == 0
        tally[2] += r["rc"] == 2
        tally[3] += bool(r["problems"])
    print("  surface             cases  exit 0  exit 2  problems")
    for name, (n, ok0, err2, bad) in sorted(surfaces.items()):
        print(f"  {name:<18} {n:>6} {ok0:>7} {err2:>7} {bad:>9}")
    labels = ["tracebacks", "hangs", "runs over 2 GiB", "killed (memory cap)",
              "silent successes on invalid input", "replaced non-regular output paths",
              "partial output on error", "internal errors", "other"]
    for label in labels:
        print(f"  {label:<36} {counts.get(label, 0)}")
        for ex in examples.get(label, []):
            print(f"      {ex}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
