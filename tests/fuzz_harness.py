"""Running one fuzz case against `tpusim` and judging the outcome (shared by the fuzz tests and
`validation/fuzz_cli.py`).

A case is a dict: `argv` (strings; `{tmp}` stands for the case's scratch directory), `files`
(name -> text, or `{"parts": [[text, times], ...]}` for big inputs, `{"trace": {"set": ...}}`
for a patched copy of a tiny training trace (see `patched_trace`), `{"result": {"set": ...}}`
for a patched collective result (`base_result`; `"base": "train" | "decode"` for a step
on a sliding-window model), `{"results": {"edit": [...]}}` for an edited
`results.parquet` of the tiny study `STUDY` (`edited_results`: resumed by `sweep --resume`),
`{"hlo": {"replace": [[old, new], ...]}}` for
an edited compiled HLO module (`base_hlo`; `"fixture"` names another module of
tests/fixtures/hlo than the default windowed einsum),
`{"latin1": text}` for a file of arbitrary bytes (one per character, fuzz8),
or `{"fifo": true}` / `{"symlink": target}` for special output targets), an optional `api`
(`{"fn": "train", "kwargs": {...}}`: a Python API call instead of `argv`, see `run_api`), and
`expect`: `"ok"`
(must exit 0), `"error"` (must be a one-line error, exit 2) or `"any"` (either). The verdict is a
list of problems: empty means the run behaved.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent / "fuzz_corpus"

# A tiny model and the base command lines the generated cases start from.
TINY_MODEL = (
    "name: tiny\nnum_layers: 2\nd_model: 256\nnum_heads: 4\nnum_kv_heads: 4\nhead_dim: 64\n"
    "d_ff: 512\nmlp: swiglu\nvocab_size: 1024\n"
)
POD = ["--chip", "v5e", "--shape", "2x2"]
COLLECTIVE = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather",
              "--axes", "x", "--bytes", "1MiB"]
TRAIN = ["train", *POD, "--model", "{tmp}/tiny.yaml", "--seq-len", "128",
         "--batch-per-chip", "1", "--mesh", "fsdp=4"]
DECODE = ["decode", *POD, "--model", "{tmp}/tiny.yaml", "--batch", "4", "--context-len", "128",
          "--mesh", "tensor=4"]
PREFILL = ["prefill", *POD, "--model", "{tmp}/tiny.yaml", "--batch", "4", "--prompt-len", "128",
           "--mesh", "tensor=4"]
SWEEP = ["serve-sweep", *POD, "--model", "{tmp}/tiny.yaml", "--context-len", "128",
         "--mesh", "tensor=4", "--batches", "1,4"]
# A plan small enough to finish in about a second (two axes, one remat policy, one count).
PLAN = ["plan", *POD, "--model", "{tmp}/tiny.yaml", "--seq-len", "128", "--global-batch", "4",
        "--workers", "1", "--out", "", "--axes", "data,fsdp", "--remat", "full",
        "--microbatches", "1"]
HLO_DIR = Path(__file__).resolve().parent / "fixtures" / "hlo"
HLO_FIXTURE_NAME = "spmd_windowed_einsum_v5e16"
# A module with TPU "all-reduce-scatter" fusions (an all-reduce whose result is dynamic-sliced:
# run as a reduce-scatter), the surface `gen_hlo_scatter` mutates.
HLO_SCATTER_FIXTURE = "train_fsdp_tp_v5e16"


def load_corpus() -> list[dict[str, Any]]:
    """Every saved case, in file then line order (`tests/fuzz_corpus/*.jsonl`)."""
    cases = []
    for path in sorted(CORPUS_DIR.glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("//"):
                case = json.loads(line)
                case.setdefault("id", f"{path.stem}:{n}")
                cases.append(case)
    return cases


def materialize(case: dict[str, Any], tmp: Path) -> list[str]:
    """Write the case's input files into `tmp` and return its argv with `{tmp}` filled in."""
    files = {"tiny.yaml": TINY_MODEL, **case.get("files", {})}
    for name, content in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict) and content.get("fifo"):
            os.mkfifo(p)
        elif isinstance(content, dict) and "symlink" in content:
            os.symlink(str(content["symlink"]).replace("{tmp}", str(tmp)), p)
        elif isinstance(content, dict) and "latin1" in content:  # bytes, one per character
            p.write_bytes(content["latin1"].encode("latin-1"))
        elif isinstance(content, dict) and "trace" in content:
            p.write_text(patched_trace(content["trace"]), encoding="utf-8")
        elif isinstance(content, dict) and "hlo" in content:
            text = base_hlo(content["hlo"].get("fixture", HLO_FIXTURE_NAME))
            for old, new in content["hlo"]["replace"]:
                assert old in text, old  # the corpus case still mutates something
                text = text.replace(old, new, 1)
            p.write_text(text, encoding="utf-8")
        elif isinstance(content, dict) and "results" in content:
            p.write_bytes(edited_results(content["results"].get("edit", [])))
        elif isinstance(content, dict) and "result" in content:
            p.write_text(_patched(base_result(content["result"].get("base", "collective")),
                                  content["result"]), encoding="utf-8")
        elif isinstance(content, dict):
            with p.open("w", encoding="utf-8") as f:
                for text, times in content["parts"]:
                    for _ in range(int(times)):
                        f.write(text)
        else:
            p.write_text(content, encoding="utf-8")
    return [a.replace("{tmp}", str(tmp)) for a in case["argv"]]


_BASE_TRACE: list[str] = []


def base_trace() -> str:
    """The tiny model's training step for 4 chips (fsdp=4), as `tpusim compile` writes it."""
    if not _BASE_TRACE:
        import yaml

        from topologies.mesh import parse_mesh
        from workloads.training import TrainingConfig, compile_training_step
        from workloads.zoo import model_from_dict

        model = model_from_dict(yaml.safe_load(TINY_MODEL))
        trace = compile_training_step(model, parse_mesh("fsdp=4"), 4,
                                      TrainingConfig(seq_len=128, batch_per_chip=1))
        _BASE_TRACE.append(trace.to_json())
    return _BASE_TRACE[0]


_BASE_RESULT: dict[str, str] = {}
# A sliding-window model with every harden3 key (`base_result("train" | "decode")`).
WINDOW_MODEL = TINY_MODEL.replace("num_layers: 2", "num_layers: 4") + (
    "attention_window: 16\nglobal_layer_period: 2\npost_norms: true\nqk_norm: true\n")


def base_result(kind: str = "collective") -> str:
    """A `--json` result, as `tpusim rerun` reads it: a 4x4 all-gather's (default), or a
    training step (`--vocab-tiling 2`) or decode step (`--sampling greedy`) of the 2x2 pod on
    `WINDOW_MODEL`."""
    if kind not in _BASE_RESULT:
        import tempfile

        from sim.cli import main

        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "w.yaml").write_text(WINDOW_MODEL, encoding="utf-8")
            argv = {
                "collective": COLLECTIVE + ["--slow-link", "0,0:x+:0.5", "--set",
                                            "hbm_bytes=x2"],
                "train": [a.replace("{tmp}/tiny.yaml", f"{d}/w.yaml") for a in TRAIN]
                + ["--vocab-tiling", "2"],
                "decode": [a.replace("{tmp}/tiny.yaml", f"{d}/w.yaml") for a in DECODE]
                + ["--sampling", "greedy"],
            }[kind]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(argv + ["--json", "--quiet"]) == 0, argv
        _BASE_RESULT[kind] = out.getvalue()
    return _BASE_RESULT[kind]


_HLO_TEXT: dict[str, str] = {}


# A three-point collective study (`sweep {tmp}/s.yaml --out {tmp}/o --resume`).
STUDY = ("command: collective\nbase: {chip: v5e, shape: 4x4, op: all-gather, axes: x}\n"
         "grid: {bytes: [64KiB, 1MiB, 2MiB]}\nmetrics: [time_s]\nplot: {x: bytes, y: time_s}\n")
_BASE_RESULTS: list[Any] = []


def edited_results(edits: list[list[Any]]) -> bytes:
    """The `results.parquet` that `STUDY` writes, with `edits` applied in order:
    `["set", column, row or null (every row), JSON value]`, `["drop", column]`,
    `["repeat", times]` (the rows `times` times over), `["keep", n]` (the first n rows),
    `["narrow", [columns]]` (only those columns: a cheap frame to repeat a million times);
    since fuzz8 the record of the columns' kinds tpusim keeps in the file
    (`sim.studies.results.COLUMNS_ATTR`) hand-edited, `["record", JSON value]` (the whole
    record) or `["record", column, JSON value]` (one column's entry; a None value deletes
    it), and the file's bytes `["truncate", fraction]` (cut to that share of its length) or
    `["flip", fraction, byte]` (the byte at that share of its length replaced)."""
    import tempfile

    import numpy as np
    import pandas as pd

    if not _BASE_RESULTS:
        from sim.studies.spec import load_study
        from sim.studies.sweep import SweepConfig, run_study

        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "s.yaml").write_text(STUDY, encoding="utf-8")
            run_study(load_study(str(Path(d) / "s.yaml")),
                      SweepConfig(workers=1, out_dir=str(Path(d) / "o"), quiet=True))
            _BASE_RESULTS.append(pd.read_parquet(Path(d) / "o" / "results.parquet"))
    import copy

    from sim.studies.results import COLUMNS_ATTR

    df = _BASE_RESULTS[0].copy()
    df.attrs = copy.deepcopy(_BASE_RESULTS[0].attrs)
    raw: list[list[Any]] = []  # byte edits, applied to the written file
    for edit in edits:
        op = edit[0]
        if op == "record" and len(edit) == 2:
            df.attrs[COLUMNS_ATTR] = edit[1]
        elif op == "record":
            rec = df.attrs.get(COLUMNS_ATTR)
            if isinstance(rec, dict):
                if edit[2] is None:
                    rec.pop(str(edit[1]), None)
                else:
                    rec[str(edit[1])] = edit[2]
        elif op in ("truncate", "flip"):
            raw.append(edit)
        if op == "set":
            _, col, row, value = edit
            col = str(col)
            if row is None:
                df[col] = [value] * len(df) if isinstance(value, (list, dict)) else value
            elif 0 <= int(row) < len(df):
                df[col] = df[col].astype(object) if col in df.columns else None
                df.at[int(row), col] = value
        elif op == "drop" and edit[1] in df.columns:
            df = df.drop(columns=[edit[1]])
        elif op == "repeat" and len(df) * int(edit[1]) <= 1_000_000:  # bound the harness
            df = df.iloc[np.tile(np.arange(len(df)), int(edit[1]))].reset_index(drop=True)
        elif op == "narrow":
            df = df[list(dict.fromkeys(c for c in edit[1] if c in df.columns))]
        elif op == "keep":
            df = df.iloc[: int(edit[1])]
    buf = io.BytesIO()
    try:
        df.to_parquet(buf, index=False)
    except (ValueError, TypeError):  # pyarrow's ArrowInvalid / ArrowTypeError among them
        # A column of mixed types has no parquet type: store its cells as text (empty stays).
        for c in df.columns:
            if df[c].dtype == object:
                df[c] = [None if v is None else str(v) for v in df[c]]
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
    data = bytearray(buf.getvalue())
    for edit in raw:
        at = min(max(int(float(edit[1]) * len(data)), 0), len(data))
        if edit[0] == "truncate":
            del data[at:]
        elif at < len(data):
            data[at] = int(edit[2]) & 0xFF
    return bytes(data)


def base_hlo(name: str = HLO_FIXTURE_NAME) -> str:
    """The text of a compiled HLO module of tests/fixtures/hlo (default: a small windowed
    einsum on a 16-chip v5e)."""
    import gzip

    if name not in _HLO_TEXT:
        if not name.replace("_", "").isalnum():
            raise ValueError(f"not a fixture name: {name!r}")
        _HLO_TEXT[name] = gzip.decompress((HLO_DIR / f"{name}.hlo.txt.gz").read_bytes()).decode(
            "utf-8")
    return _HLO_TEXT[name]


def patched_trace(patch: dict[str, Any]) -> str:
    """The base trace with `patch["set"]` = [[path, raw JSON text], ...] applied (paths like
    `ops/4/flops` or `meta/num_chips`; the raw text may be NaN, 1e999 or a 400-digit number)."""
    return _patched(base_trace(), patch)


def _patched(base: str, patch: dict[str, Any]) -> str:
    if not patch.get("set"):
        return base  # unchanged, byte for byte
    doc = json.loads(base)
    cols = doc.get("columns", [])
    raws = {}
    for n, (path, raw) in enumerate(patch.get("set", [])):
        keys = path.split("/")
        node = doc
        for k in keys[:-1]:
            if isinstance(node, list) and k.isdigit() and int(k) < len(node):
                node = node[int(k)]
            elif isinstance(node, dict):
                node = node.setdefault(k, {})
            else:
                node = None  # an earlier patch replaced the container: nothing to patch
                break
        if not isinstance(node, (dict, list)):
            continue
        last = keys[-1]
        if isinstance(node, list) and len(keys) >= 3 and keys[-3] == "ops" and cols:
            last = cols.index(last) if last in cols else int(last)
        elif isinstance(node, list):
            if not last.isdigit():
                continue
            last = int(last)
        if isinstance(node, list) and not 0 <= last < len(node):
            continue
        marker = f"@@RAW{n}@@"
        raws[marker] = raw
        node[last] = marker
    text = json.dumps(doc, separators=(",", ":"))
    for marker, raw in raws.items():
        text = text.replace(json.dumps(marker), raw)
    return text


def _snapshot(tmp: Path) -> dict[str, tuple[int, int]]:
    """(mode, size) of everything under `tmp`, without following symlinks or opening FIFOs."""
    out = {}
    for root, dirs, files in os.walk(tmp):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            out[os.path.relpath(p, tmp)] = (stat.S_IFMT(st.st_mode), st.st_size)
    return out


def _drain_fifos(tmp: Path, stop: threading.Event) -> list[threading.Thread]:
    """Open the reading end of every FIFO in `tmp` so a writer never blocks forever."""
    threads = []
    for p in tmp.rglob("*"):
        if stat.S_ISFIFO(os.lstat(p).st_mode):
            def reader(p=p):
                fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    while not stop.is_set():
                        try:
                            if not os.read(fd, 1 << 16):
                                stop.wait(0.01)
                        except BlockingIOError:
                            stop.wait(0.01)
                finally:
                    os.close(fd)

            t = threading.Thread(target=reader, daemon=True)
            t.start()
            threads.append(t)
    return threads


class _Timeout(BaseException):
    pass


def run_in_process(case: dict[str, Any], tmp: Path, *, timeout_s: float = 20.0) -> dict[str, Any]:
    """Run `sim.cli.main` on the case in this process; returns rc, stdout, stderr, files."""
    from sim.cli import main

    argv = materialize(case, tmp)
    before = _snapshot(tmp)
    out, err = io.StringIO(), io.StringIO()
    stop = threading.Event()
    readers = _drain_fifos(tmp, stop)
    crash = None
    use_alarm = threading.current_thread() is threading.main_thread() and timeout_s > 0

    def on_alarm(_sig, _frame):
        raise _Timeout

    old = signal.signal(signal.SIGALRM, on_alarm) if use_alarm else None
    if use_alarm:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = run_api(case["api"], tmp) if "api" in case else main(_quieted(argv))
    except _Timeout:
        rc, crash = None, f"hang: no result within {timeout_s:g} s"
    except BaseException as exc:  # noqa: BLE001 - anything escaping main is a finding
        import traceback

        rc, crash = None, "traceback: " + "".join(
            traceback.format_exception_only(type(exc), exc)).strip()
    finally:
        os.chdir(cwd)
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        stop.set()
        for t in readers:
            t.join(1)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "crash": crash,
            "before": before, "after": _snapshot(tmp), "argv": argv}


def api_value(v: Any, tmp: Path) -> Any:
    """A JSON-encoded Python value of an `api` case: `{tmp}` filled in, and the forms JSON
    lacks decoded: {"$bytes": text}, {"$tuple": [...]}, {"$set": [...]}, {"$object": null},
    {"$complex": [re, im]}, {"$dict": [[key, value], ...]} (keys of any type)."""
    if isinstance(v, str):
        return v.replace("{tmp}", str(tmp))
    if isinstance(v, list):
        return [api_value(x, tmp) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (k, x), = v.items()
            decode = {"$bytes": lambda: str(x).encode(), "$tuple": lambda: tuple(x),
                      "$set": lambda: set(x), "$object": object,
                      "$complex": lambda: complex(*x),
                      "$dict": lambda: {a: api_value(b, tmp) for a, b in x}}
            if k in decode:
                return decode[k]()
        return {k: api_value(x, tmp) for k, x in v.items()}
    return v


def run_api(spec: dict[str, Any], tmp: Path) -> int:
    """Call `sim.<fn>(**kwargs)` as a notebook would: 0 (the result's dict printed as JSON when
    it has one), or 2 with the TpusimError as the CLI prints it. Anything else escapes, as a
    finding."""
    import sim
    from topologies.errors import TpusimError

    kwargs = api_value(spec["kwargs"], tmp)
    try:
        res = getattr(sim, spec["fn"])(**kwargs)
    except TpusimError as exc:
        print(f"tpusim: error: {exc}", file=sys.stderr)
        return 2
    if hasattr(res, "to_dict"):
        print(json.dumps(res.to_dict(), allow_nan=False))
    return 0


def _quieted(argv: list[str]) -> list[str]:
    """`argv` with --quiet where the command takes it (its own flag, else the top-level one:
    `rerun` and `presets` have none of their own)."""
    if "--quiet" in argv:
        return argv
    if not _OWN_QUIET:
        from sim.cli import build_parser

        sub = build_parser()._subparsers._group_actions[0].choices
        _OWN_QUIET.update(c for c, p in sub.items() if "--quiet" in p._option_string_actions)
    return argv + ["--quiet"] if argv and argv[0] in _OWN_QUIET else ["--quiet", *argv]


_OWN_QUIET: set[str] = set()


def _finite(obj: Any) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_finite(v) for v in obj)
    return True


def judge(case: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """The problems with one run (empty list: it behaved)."""
    problems = []
    if run["crash"]:
        return [run["crash"]]
    rc, err, out = run["rc"], run["stderr"], run["stdout"]
    expect = case.get("expect", "any")
    check_differs = rc == 1 and run["argv"][:1] == ["rerun"] and "--check" in run["argv"] \
        and err.startswith("tpusim: rerun differs from ") and err.count("\n") == 1
    if rc not in (0, 2) and not check_differs:  # `rerun --check` exits 1 naming the fields
        problems.append(f"exit code {rc}")
    if rc == 2:
        lines = err.strip("\n").split("\n")
        if len(lines) != 1 or not lines[0].startswith("tpusim: error: "):
            problems.append(f"error is not one `tpusim: error:` line: {err[:300]!r}")
        elif lines[0].startswith("tpusim: error: tpusim: error"):
            problems.append(f"doubled prefix: {lines[0][:200]!r}")
        if "internal error" in err:
            problems.append(f"internal error: {err[:300]!r}")
        if len(err) > 2000:
            problems.append(f"error message of {len(err)} characters")
        if case.get("match") and case["match"] not in err:
            problems.append(f"error does not mention {case['match']!r}: {err[:300]!r}")
        # Validate-first: a refused run creates or changes nothing.
        changed = sorted(k for k, v in run["after"].items() if run["before"].get(k) != v)
        if changed:
            problems.append(f"partial output on error: {changed[:5]}")
    if rc == 0:
        if expect == "error":
            problems.append(f"silent success on invalid input: {out[:200]!r}")
        if "--json" in run["argv"]:
            try:
                doc = json.loads(out, parse_constant=lambda c: float(c))
            except ValueError:
                problems.append(f"--json output is not JSON: {out[:200]!r}")
            else:
                if not _finite(doc):
                    problems.append("non-finite number in --json output")
        for bad in ("nan", "inf"):
            if any(w.lower() in (bad, f"-{bad}", f"{bad}%") for w in out.split()):
                problems.append(f"{bad} in the output")
    if expect == "ok" and rc != 0:
        problems.append(f"valid input refused: {err[:300]!r}")
    # Nothing that was not a regular file is ever replaced by one.
    for k, (mode, _size) in run["before"].items():
        now = run["after"].get(k)
        if mode != stat.S_IFREG and (now is None or now[0] != mode):
            problems.append(f"non-regular path {k} replaced or removed")
    return problems
