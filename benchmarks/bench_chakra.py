"""Chakra import and export, whole process (CPU and wall seconds, peak RSS, events/s):

1. `tpusim replay PREFIX` of a 64-rank set of 100,000 nodes per rank (written by tpusim's own
   writer: a chain of compute nodes with FLOPs and bytes, an all-reduce over the job every 100
   nodes; every rank runs the same program, as data-parallel traces do, so the reader decodes
   the node records once and checks the other 63 ranks' by digest) on a v5e 8x8;
2. `tpusim replay PREFIX` of a 64-rank set of several programs, ~100,000 nodes in all (`--stages`
   pipeline stages of 64 / stages ranks each, a 2x8 block of the v5e 8x8 per stage at 4 stages:
   per microbatch a receive from the previous stage, a chain of compute nodes with an all-reduce
   over the stage's process group every 40 nodes, a send to the next stage; each rank's compute
   FLOPs and bytes its own, 1 to 1.75 times the stage's least, as an uneven load makes them),
   so the reader decodes every rank and the replay runs each stage's program on the per-chip
   engine, each chip at its own sizes; the first, middle and last stages are three programs;
3. the 8,960-chip LLaMA-3-70B step (v5p 16x20x28, fsdp=2240 x tensor=4, seq 8192) simulated with
   and without `--chakra DIR` (one file per chip class): the difference is the export.

Run: .venv/bin/python benchmarks/bench_chakra.py [--quick] [--stages N]. Never passes or fails
on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import run_child_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_set(d: Path, ranks: int, nodes: int) -> str:
    from workloads.chakra.wire import CommType, GlobalMetadata, coll_node, comp_node, encode_file

    prog = []
    for i in range(nodes):
        deps = (i - 1,) if i else ()
        if i % 100 == 99:
            prog.append(coll_node(i, f"all_reduce_{i}", CommType.ALL_REDUCE, 4 << 20,
                                  data_deps=deps))
        else:
            prog.append(comp_node(i, f"gemm_{i}", num_ops=2 * 1024**3, tensor_size=8 << 20,
                                  duration_micros=10, data_deps=deps))
    data = encode_file(GlobalMetadata(version="0.0.4"), prog)
    for r in range(ranks):
        (d / f"bench.{r}.et").write_bytes(data)
    return str(d / "bench")


def write_stages(d: Path, ranks: int, stages: int, nodes: int) -> tuple[str, int]:
    """(PREFIX, nodes in all) of a `ranks`-rank pipeline of `stages` stages with about `nodes`
    nodes in all (the module docstring, case 2)."""
    import json

    from workloads.chakra.wire import (
        CommType,
        GlobalMetadata,
        IOInfo,
        Node,
        NodeType,
        coll_node,
        comp_node,
        encode_file,
        p2p_node,
    )

    per = ranks // stages
    micro = 8
    chain = max(nodes // ranks // micro - 2, 1)
    groups = [{"pg_name": str(s + 1), "ranks": list(range(s * per, (s + 1) * per))}
              for s in range(stages)]
    total = 0
    for r in range(ranks):
        s = r // per
        load = 1 + (r % 4) / 4  # each rank its own FLOPs and bytes
        prog = [Node(id=0, name="process_group:init", type=NodeType.METADATA_NODE,
                     inputs=IOInfo(values=f"[[{json.dumps(groups)}]]"))]
        for m in range(micro):
            last = prog[-1].id
            if s > 0:
                prog.append(p2p_node(last + 1, f"recv_{m}", send=False, src=r - per, dst=r,
                                     tag=m, comm_size=16 << 20, data_deps=(last,)))
            for i in range(chain):
                last = prog[-1].id
                if i % 40 == 39:
                    prog.append(coll_node(last + 1, f"all_reduce_{m}_{i}", CommType.ALL_REDUCE,
                                          4 << 20, pg_name=str(s + 1), data_deps=(last,)))
                else:
                    prog.append(comp_node(last + 1, f"gemm_{m}_{i}",
                                          num_ops=int(2 * 1024**3 * load),
                                          tensor_size=int((8 << 20) * load),
                                          duration_micros=10, data_deps=(last,)))
            if s < stages - 1:
                last = prog[-1].id
                prog.append(p2p_node(last + 1, f"send_{m}", send=True, src=r, dst=r + per,
                                     tag=m, comm_size=16 << 20, data_deps=(last,)))
        total += len(prog)
        (d / f"stages.{r}.et").write_bytes(encode_file(GlobalMetadata(version="0.0.4"), prog))
    return str(d / "stages"), total


def measure(cmd: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    wall, cpu, rss, out, err, code = run_child_cpu(cmd, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[3:8])}: tpusim failed: {err.strip()}")
    doc = json.loads(out) if out.strip().startswith("{") else {}
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": rss / 2**20,
            "sim_events": doc.get("sim_events"), "step_time_s": doc.get("step_time_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10,000 nodes per rank, no export")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages of case 2 (a factor "
                                                          "of 64; default 4)")
    args = ap.parse_args()
    if args.stages < 2 or 64 % args.stages:
        raise SystemExit(f"--stages {args.stages} must be a factor of 64 of at least 2")
    nodes = 10_000 if args.quick else 100_000
    py = [sys.executable, "-m", "sim.cli", "--quiet"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = write_set(Path(tmp), 64, nodes)
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        r = measure([*py, "replay", prefix, "--chip", "v5e", "--shape", "8x8", "--json"])
        r.update(ranks=64, nodes_per_rank=nodes, set_bytes=size)
        rows[f"import_replay_64x{nodes}"] = r
        multi = Path(tmp) / "stages"
        multi.mkdir()
        prefix, total = write_stages(multi, 64, args.stages, nodes)
        r = measure([*py, "replay", prefix, "--chip", "v5e", "--shape", "8x8", "--json"])
        r.update(ranks=64, stages=args.stages, nodes=total,
                 set_bytes=sum(p.stat().st_size for p in multi.iterdir()))
        rows[f"stages{args.stages}_64r_{total}n"] = r
        if not args.quick:
            train = [*py, "train", "--chip", "v5p", "--shape", "16x20x28", "--model",
                     "llama3-70b", "--seq-len", "8192", "--batch-per-chip", "1", "--mesh",
                     "fsdp=2240,tensor=4", "--json"]
            rows["train_8960"] = measure(train)
            out = Path(tmp) / "export"
            rows["train_8960_chakra"] = measure([*train, "--chakra", str(out)])
            rows["train_8960_chakra"]["files"] = len(list(out.iterdir()))
            rows["train_8960_chakra"]["bytes"] = sum(p.stat().st_size for p in out.iterdir())
    print(f"{'case':<28} {'wall s':>7} {'CPU s':>7} {'RSS MiB':>8} {'events':>8} "
          f"{'events/s':>9}")
    for name, r in rows.items():
        ev = r.get("sim_events") or 0
        print(f"{name:<28} {r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {r['peak_rss_mib']:>8.1f} "
              f"{ev:>8} {ev / r['wall_s']:>9.0f}")
    if "train_8960_chakra" in rows:
        a, b = rows["train_8960"], rows["train_8960_chakra"]
        print(f"\nexport of the 8960-chip step by class: +{b['wall_s'] - a['wall_s']:.2f} s wall, "
              f"+{b['cpu_s'] - a['cpu_s']:.2f} CPU s ({b['files']} file(s), {b['bytes']:,} B)")
    res = ROOT / "benchmarks" / "results" / ("chakra-quick.json" if args.quick else
                                             "chakra.json")
    res.parent.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(),
        "python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
