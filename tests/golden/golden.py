"""The golden set: commands across every command and mode whose outputs (stdout, stderr, exit
code and every file written) must stay byte-identical while the code is rearranged.

    python tests/golden/golden.py record          # write tests/golden/manifest.json
    python tests/golden/golden.py check [-j 2]    # exit 1 naming every case that differs
    python tests/golden/golden.py check --keep DIR   # keep each case's outputs for a diff

Each case runs `python -m sim ARGS` in an empty directory of its own, with the repository's
model/scenario/study files written there first. Only wall-time fields are blanked before
hashing (`wall_time_s`, study timing); everything else is compared as written.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANIFEST = HERE / "manifest.json"
HLO = Path("hlo")  # the fixtures, copied into each case's directory (paths are recorded)

FILES = {
    "scenario.yaml": "slow_chip:\n  - '1,1,1:0.7'\ndead_link:\n  - '0,0,0:y+'\n",
    "tiny.yaml": (
        "base: llama3-8b\nname: tiny\nnum_layers: 8\n"
    ),
    "study.yaml": (
        "command: train\n"
        "base: {chip: v5e, shape: 4x4, model: tiny.yaml, seq-len: 2048, batch-per-chip: 1,"
        " mesh: \"fsdp=16\"}\n"
        "grid:\n  set.ici_link_bytes_per_s: [x0.5, x2]\n"
        "zip:\n  remat: [full, minimal]\n  mesh: [\"fsdp=16\", \"fsdp=4,tensor=4\"]\n"
        "metrics: [step_time_s, mfu]\n"
        "plot: {x: set.ici_link_bytes_per_s, y: step_time_s}\n"
    ),
}

V5P = ["--slice", "v5p-128"]            # 4x4x4, 64 chips, wraps
V5E = ["--chip", "v5e", "--shape", "4x4"]
T8B = ["--model", "llama3-8b", "--seq-len", "4096", "--batch-per-chip", "1"]
TINY = ["--model", "tiny.yaml", "--seq-len", "2048", "--batch-per-chip", "1"]
DEC = ["--chip", "v5e", "--shape", "2x4", "--model", "llama3-8b", "--batch", "16",
       "--context-len", "4096", "--mesh", "tensor=8"]

# (name, argv, setup) ; setup: argv lists run before the case in the same directory
CASES: list[tuple[str, list[str], list[list[str]]]] = [
    # collectives
    ("coll_ar_v5e", ["collective", *V5E, "--op", "all-reduce", "--axes", "x,y",
                     "--bytes", "64MiB", "--json"], []),
    ("coll_ag_sym", ["collective", *V5P, "--op", "all-gather", "--axes", "x",
                     "--bytes", "32MiB", "--mode", "symmetric", "--json"], []),
    ("coll_rs_full", ["collective", *V5P, "--op", "reduce-scatter", "--axes", "x,y",
                      "--bytes", "32MiB", "--mode", "full", "--json"], []),
    ("coll_ar_perchip", ["collective", *V5E, "--op", "all-reduce", "--axes", "x,y",
                         "--bytes", "8MiB", "--mode", "per-chip", "--json"], []),
    ("coll_a2a", ["collective", *V5P, "--op", "all-to-all", "--axes", "x,y,z",
                  "--bytes", "16MiB", "--json"], []),
    ("coll_send", ["collective", *V5P, "--op", "send", "--src", "0,0,0", "--dst", "2,1,3",
                   "--bytes", "8MiB", "--json"], []),
    ("coll_permute", ["collective", *V5P, "--op", "collective-permute", "--axes", "y",
                      "--shift", "2", "--bytes", "8MiB", "--json"], []),
    ("coll_slowlink", ["collective", *V5P, "--op", "all-reduce", "--axes", "x,y,z",
                       "--bytes", "64MiB", "--slow-link", "0,0,0:x+:0.5", "--json"], []),
    ("coll_deadlink", ["collective", *V5P, "--op", "all-reduce", "--axes", "x,y,z",
                       "--bytes", "64MiB", "--dead-link", "0,0,0:x+", "--json"], []),
    ("coll_algo_chunks", ["collective", *V5P, "--op", "all-reduce", "--axes", "x",
                          "--bytes", "16MiB", "--algorithm", "bidi-ring", "--chunks", "4",
                          "--json"], []),
    ("coll_hier_slices", ["collective", *V5E, "--slices", "2", "--op", "all-reduce",
                          "--axes", "x,y,dcn", "--bytes", "32MiB", "--json"], []),
    ("coll_table", ["collective", *V5E, "--op", "all-gather", "--axes", "x,y",
                    "--bytes", "1MiB"], []),
    ("coll_outputs", ["collective", *V5E, "--op", "all-gather", "--axes", "x",
                      "--bytes", "4MiB", "--out", "o", "--perfetto", "c.pftrace",
                      "--plots", "p"], []),
    ("compare_json", ["compare-collectives", *V5E, "--op", "all-reduce", "--axes", "x,y",
                      "--bytes", "64MiB", "--json"], []),
    ("compare_table", ["compare-collectives", "--chip", "v5e", "--shape", "16x16",
                       "--op", "all-reduce", "--axes", "x,y", "--bytes", "64KiB"], []),
    # training
    ("train_sym", ["train", *V5P, *T8B, "--mesh", "fsdp=64", "--json"], []),
    ("train_table", ["train", *V5P, *T8B, "--mesh", "fsdp=16,tensor=4"], []),
    ("train_tp_minimal", ["train", *V5P, *T8B, "--mesh", "fsdp=16,tensor=4", "--remat",
                          "minimal", "--tp-comm", "collective-matmul", "--json"], []),
    ("train_slowchip", ["train", *V5P, *T8B, "--mesh", "fsdp=64", "--slow-chip",
                        "1,2,3:0.8", "--json"], []),
    ("train_deadlink", ["train", *V5P, *T8B, "--mesh", "fsdp=64", "--dead-link",
                        "0,0,0:x+", "--json"], []),
    ("train_variation", ["train", *V5P, *TINY, "--mesh", "fsdp=64", "--chip-variation",
                         "0.02", "--seed", "1", "--json"], []),
    ("train_perchip", ["train", *V5E, *TINY, "--mesh", "fsdp=16", "--slow-chip", "1,2:0.8",
                       "--mode", "per-chip", "--json"], []),
    ("train_scenario", ["train", *V5P, *TINY, "--mesh", "fsdp=16,tensor=4", "--scenario",
                        "scenario.yaml", "--json"], []),
    ("train_1f1b", ["train", *V5P, *TINY, "--mesh", "pipeline=4,fsdp=16", "--microbatches",
                    "4", "--json"], []),
    ("train_gpipe_slow", ["train", *V5P, *TINY, "--mesh", "pipeline=2,fsdp=32",
                          "--microbatches", "2", "--pipeline-schedule", "gpipe",
                          "--slow-chip", "0,0,0:0.9", "--json"], []),
    ("train_interleaved", ["train", *V5P, *TINY, "--mesh", "pipeline=4,fsdp=16",
                           "--microbatches", "4", "--pipeline-schedule", "interleaved",
                           "--virtual-stages", "2", "--json"], []),
    ("train_moe", ["train", *V5P, "--model", "mixtral-8x7b", "--seq-len", "4096",
                   "--batch-per-chip", "1", "--mesh", "expert=8,fsdp=8", "--expert-skew",
                   "1.2", "--capacity-factor", "1.25", "--seed", "3", "--json"], []),
    ("train_dcn", ["train", *V5E, "--slices", "2", *TINY, "--mesh", "fsdp=16", "--dcn",
                   "data=2", "--json"], []),
    ("train_set", ["train", *V5P, *T8B, "--mesh", "fsdp=64", "--set",
                   "ici_link_bytes_per_s=x2", "--set", "hbm_bytes_per_s=x0.5", "--json"], []),
    ("train_modes", ["train", *V5E, *TINY, "--mesh", "fsdp=4,tensor=4", "--no-overlap",
                     "--fsdp-gather", "blocking", "--fsdp-grad", "all-reduce",
                     "--attention", "dot", "--param-dtype", "fp32", "--gather-dtype", "bf16",
                     "--microbatches", "2", "--json"], []),
    ("train_outputs", ["train", *V5E, *TINY, "--mesh", "fsdp=16", "--slow-chip", "0,1:0.9",
                       "--out", "o", "--perfetto", "t.pftrace", "--plots", "p"], []),
    ("train_chrome", ["train", *V5E, *TINY, "--mesh", "fsdp=16", "--perfetto",
                      "t.json", "--json"], []),
    # inference
    ("decode_json", ["decode", *DEC, "--json"], []),
    ("decode_int8_outputs", ["decode", *DEC, "--weight-dtype", "int8", "--kv-dtype", "int8",
                             "--perfetto", "d.pftrace", "--out", "o", "--plots", "p"], []),
    ("decode_slow", ["decode", *DEC, "--slow-chip", "0,1:0.7", "--json"], []),
    ("decode_table", ["decode", *DEC], []),
    ("prefill_json", ["prefill", "--chip", "v5e", "--shape", "2x4", "--model", "llama3-8b",
                      "--batch", "2", "--prompt-len", "2048", "--mesh", "tensor=8", "--json"],
     []),
    ("prefill_chunked", ["prefill", "--chip", "v5e", "--shape", "2x4", "--model",
                         "llama3-8b", "--batch", "1", "--prompt-len", "4096",
                         "--prefill-chunk", "1024", "--mesh", "tensor=8", "--json"], []),
    ("serve_sweep", ["serve-sweep", "--chip", "v5e", "--shape", "2x4", "--model", "llama3-8b",
                     "--context-len", "4096", "--mesh", "tensor=8", "--batches", "1,4,16",
                     "--out", "o", "--json"], []),
    # traces
    ("compile_replay", ["replay", "t.trace", *V5E, "--json"],
     [["compile", "--chips", "16", *TINY, "--mesh", "fsdp=16", "-o", "t.trace"]]),
    ("replay_slow", ["replay", "t.trace", *V5E, "--slow-link", "0,0:x+:0.5", "--json"],
     [["compile", "--chips", "16", *TINY, "--mesh", "fsdp=4,tensor=4", "-o", "t.trace"]]),
    ("export_perfetto", ["export", "t.trace", *V5E, "--perfetto", "e.pftrace", "--json"],
     [["compile", "--chips", "16", *TINY, "--mesh", "fsdp=16", "-o", "t.trace"]]),
    ("import_hlo", ["import-hlo", str(HLO / "train_fsdp_tp_v5e16.hlo.txt.gz"), *V5E,
                    "--json"], []),
    ("import_hlo_table", ["import-hlo", str(HLO / "decode_tp8_v5e8.hlo.txt.gz"),
                          "--chip", "v5e", "--shape", "2x4"], []),
    ("replay_hlo", ["replay", str(HLO / "train_fsdp_v5e16.hlo.txt.gz"), *V5E, "--json"], []),
    ("replay_hlo_v5p", ["replay", str(HLO / "train_fsdp_tp_v5p64.hlo.txt.gz"), *V5P,
                        "--slow-link", "1,1,1:z-:0.5", "--json"], []),
    # presets, studies, reruns, demo, errors
    ("presets_json", ["presets", "--json"], []),
    ("presets_chip", ["presets", "--chip", "v5p"], []),
    ("sweep", ["sweep", "study.yaml", "--workers", "1", "--out", "s"], []),
    ("plan", ["plan", *V5E, "--model", "tiny.yaml", "--seq-len", "2048", "--global-batch",
              "16", "--workers", "1", "--json", "--out", "pl"], []),
    ("plan_exhaustive", ["plan", "--chip", "v5e", "--shape", "2x4", "--model", "tiny.yaml",
                         "--seq-len", "2048", "--global-batch", "8", "--remat", "full",
                         "--microbatches", "1", "--exhaustive", "--workers", "1", "--json",
                         "--out", ""], []),
    ("rerun_train", ["rerun", "r.json", "--check"],
     [["train", *V5E, *TINY, "--mesh", "fsdp=4,tensor=4", "--slow-chip", "1,1:0.8",
       "--set", "hbm_bytes_per_s=x2", "--json", ">r.json"]]),
    ("rerun_decode", ["rerun", "r.json", "--check"], [["decode", *DEC, "--json", ">r.json"]]),
    ("rerun_collective", ["rerun", "r.json"],
     [["collective", *V5E, "--op", "all-reduce", "--axes", "x,y", "--bytes", "8MiB",
       "--dead-link", "0,0:y+", "--json", ">r.json"]]),
    ("demo", ["demo", "--out", "d", "--json"], []),
    ("goodput", ["goodput", "--chip", "v4", "--shape", "4x4x8", "--step-time", "30",
                 "--steps", "5000", "--host-mtbf-hours", "300", "--chip-mtbf-hours", "20000",
                 "--repair-hours", "2", "--checkpoint-cost", "20", "--restart-cost", "120",
                 "--spare-cubes", "1", "--seeds", "3", "--json", "--out", "g", "--perfetto",
                 "g.pftrace"], []),
    ("goodput_train", ["goodput", "--chip", "v4", "--shape", "4x4x4", *TINY, "--mesh",
                       "fsdp=64", "--hours", "200", "--mtbf-hours", "20", "--repair-hours",
                       "4", "--no-ocs", "--seeds", "2"], []),
    ("err_mesh", ["train", *V5E, *TINY, "--mesh", "fsdp=3"], []),
    ("err_flag", ["collective", *V5E, "--op", "all-reduce", "--axes", "x", "--bytes",
                  "1MiB", "--bogus"], []),
    ("err_set", ["train", *V5E, *TINY, "--mesh", "fsdp=16", "--set", "nope=3"], []),
    ("err_slice", ["train", "--slice", "v5p-8960", *TINY, "--mesh", "fsdp=16"], []),
    ("err_goodput", ["goodput", "--chip", "v4", "--shape", "4x4x8", "--step-time", "10",
                     "--steps", "100", "--mtbf-hours", "0", "--repair-hours", "1"], []),
]

_WALL = ("wall_time_s", "wall_s", "elapsed_s", "cpu_s", "started_utc", "points_per_s")
_WALL_KEYS = re.compile(r'"(' + "|".join(_WALL) + r')": [^,\n}]+')


def _normalise(name: str, data: bytes) -> bytes:
    if name.endswith((".json", ".stdout", ".csv")):
        text = data.decode("utf-8", "replace")
        text = _WALL_KEYS.sub(lambda m: f'"{m.group(1)}": 0', text)
        if name.endswith(".csv"):
            text = _blank_csv_column(text, "wall_time_s")
        return text.encode()
    if name.endswith(".parquet"):
        import pandas as pd

        df = pd.read_parquet(io.BytesIO(data))
        if "wall_time_s" in df:
            df["wall_time_s"] = 0.0
        return (repr(df.dtypes.to_dict()) + df.to_csv()).encode()
    return data


def _blank_csv_column(text: str, col: str) -> str:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or col not in rows[0]:
        return text
    i = rows[0].index(col)
    for row in rows[1:]:
        if len(row) > i:
            row[i] = "0"
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _run(argv: list[str], cwd: Path) -> tuple[int, bytes, bytes]:
    out_file = None
    if argv and argv[-1].startswith(">"):
        out_file, argv = argv[-1][1:], argv[:-1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", "TPUSIM_GOLDEN": "1",
           "MPLBACKEND": "Agg"}
    p = subprocess.run([_python(), "-m", "sim", "--quiet", *argv], cwd=cwd, env=env,
                       capture_output=True, timeout=900)
    if out_file:
        (cwd / out_file).write_bytes(p.stdout)
    return p.returncode, p.stdout, p.stderr


def run_case(case, keep: Path | None = None) -> dict[str, str]:
    name, argv, setup = case
    with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
        d = Path(tmp)
        for fname, text in FILES.items():
            (d / fname).write_text(text)
        shutil.copytree(ROOT / "tests" / "fixtures" / "hlo", d / "hlo")
        before = {p.relative_to(d).as_posix() for p in d.rglob("*")}
        for s in setup:
            rc, _o, e = _run(s, d)
            if rc:
                return {"setup_error": e.decode()[-500:]}
        before = {p.relative_to(d).as_posix() for p in d.rglob("*")}
        rc, out, err = _run(argv, d)
        got = {"rc": str(rc), "stdout": _sha(_normalise(".stdout", out)),
               "stderr": _sha(err)}
        if rc and err:
            got["stderr_text"] = err.decode()[-400:]
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(d).as_posix()
            if p.is_file() and rel not in before:
                got[f"file:{rel}"] = _sha(_normalise(rel, p.read_bytes()))
        if keep is not None:
            dest = keep / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(d, dest)
            (dest / "_stdout").write_bytes(out)
            (dest / "_stderr").write_bytes(err)
        return got


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["record", "check"])
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--only", default=None, help="a regex on case names")
    ap.add_argument("--keep", type=Path, default=None, help="keep each case's outputs here")
    a = ap.parse_args()
    cases = [c for c in CASES if a.only is None or re.search(a.only, c[0])]
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        results = dict(zip([c[0] for c in cases],
                           ex.map(lambda c: run_case(c, a.keep), cases), strict=True))
    if a.action == "record":
        old = json.loads(MANIFEST.read_text()) if MANIFEST.exists() and a.only else {}
        old.update(results)
        MANIFEST.write_text(json.dumps(dict(sorted(old.items())), indent=1) + "\n")
        print(f"recorded {len(results)} cases in {MANIFEST}")
        return 0
    want = json.loads(MANIFEST.read_text())
    bad = []
    for name, got in results.items():
        exp = want.get(name)
        if exp != got:
            keys = sorted(k for k in {*got, *(exp or {})} if (exp or {}).get(k) != got.get(k))
            bad.append(f"{name}: {', '.join(keys)}")
    for line in bad:
        print("DIFFERS", line)
    print(f"{len(results) - len(bad)}/{len(results)} golden cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
