"""What progress reporting costs a run: the same run with nobody watching, with a callback that
only counts the updates (the library's own cost: the counter checks in the engine loops and
the updates they send), and with the `tpusim` command's terminal bars drawn into /dev/null
(tqdm's drawing too), in turn, in one process.

    python benchmarks/bench_progress.py                   # every case, 9 rounds
    python benchmarks/bench_progress.py --cases vector --rounds 7

Cases (each run once first to warm the caches, so that every timed run does the same work):
`vector` (a per-chip step on 32 varied chips, vector classes), `classes` (a 512-layer model's
step on the class engine, ~26,000 ops), `hlo` (importing and replaying the 1.8 MB HLO
fixture), `serve` (10,000 requests on one replica; the cost model is cached after the warm-up
run, so this times the serving simulation). Reports the fastest CPU seconds
(`time.process_time`, this process) of each mode over the rounds (the least disturbed run: on
a shared machine the run-to-run noise, +-20% under load, is far above the cost measured), the
overhead against nobody watching, and the updates a run sends. The modes run interleaved, in
an order that rotates every round, so load and caches affect all alike. Never passes or fails
on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _deep_model(layers: int) -> str:
    path = Path(tempfile.gettempdir()) / f"tpusim_bench_deep{layers}.yaml"
    path.write_text(f"name: deep{layers}\nnum_layers: {layers}\nd_model: 1024\nnum_heads: 8\n"
                    "num_kv_heads: 8\nhead_dim: 128\nd_ff: 4096\nmlp: swiglu\n"
                    "vocab_size: 32000\n", encoding="utf-8")
    return str(path)


def _cases() -> dict:
    import sim

    tiny = Path(tempfile.gettempdir()) / "tpusim_bench_tiny.yaml"
    tiny.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    return {
        "vector": lambda progress: sim.train(
            chip="v5e", shape="4x8", model="llama3-8b", seq_len=2048, batch_per_chip=1,
            mesh="fsdp=32", chip_variation=0.02, seed=1, progress=progress),
        "classes": lambda progress: sim.train(
            chip="v5e", shape="2x2", model=_deep_model(512), seq_len=1024, batch_per_chip=1,
            mesh="fsdp=4", progress=progress),
        "hlo": lambda progress: sim.replay_trace(
            trace=str(ROOT / "tests/fixtures/hlo/train_fsdp_v5e16.hlo.txt.gz"), chip="v5e",
            shape="4x4", progress=progress),
        "serve": lambda progress: sim.serve(
            chip="v5e", shape="2x2", model=str(tiny), mesh="tensor=4", rate=200,
            requests=10_000, prompt_tokens="fixed:256", output_tokens="fixed:32",
            progress=progress),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="vector,classes,hlo,serve")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    from sim.cli.progress import TerminalProgress

    cases = _cases()
    devnull = open(os.devnull, "w")  # noqa: SIM115 - open for the whole benchmark
    print(f"{'case':<8} {'nobody s':>9} {'counted s':>9} {'bars s':>9} {'counted':>8} "
          f"{'bars':>8} {'updates':>8}  (fastest CPU s of {a.rounds} rounds, interleaved)")
    for name in a.cases.split(","):
        fn = cases[name]
        fn(None)  # warm the caches
        times: dict[str, list[float]] = {"nobody": [], "counted": [], "bars": []}
        updates = 0
        modes = list(times)
        for r in range(a.rounds):
            for mode in modes[r % 3:] + modes[:r % 3]:
                seen: list = []
                cb = {"nobody": None, "counted": seen.append,
                      "bars": TerminalProgress(stream=devnull, delay_s=0.0)}[mode]
                t0 = time.process_time()
                fn(cb)
                times[mode].append(time.process_time() - t0)
                if mode == "counted":
                    updates = len(seen)
        best = {m: min(v) for m, v in times.items()}
        over = {m: best[m] / best["nobody"] - 1 for m in ("counted", "bars")}
        print(f"{name:<8} {best['nobody']:>9.3f} {best['counted']:>9.3f} {best['bars']:>9.3f} "
              f"{over['counted']:>+8.2%} {over['bars']:>+8.2%} {updates:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
