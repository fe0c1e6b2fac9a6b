"""Tests for the studies in sim/studies/ and `tpusim sweep`: the study schema and its one-line
errors, rows that equal the single command's result, failed points as rows, resume, Ctrl-C,
local vs Dask."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sim.cli import main
from sim.studies.points import point_argv, point_request
from sim.studies.results import ERROR_COLUMN, WALL_COLUMN
from sim.studies.spec import load_study
from sim.studies.sweep import SweepConfig, run_study
from topologies.errors import TpusimError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    return str(path)


def _study(model: str, **extra) -> dict:
    s = {
        "command": "train",
        "base": {"chip": "v5e", "shape": "2x2", "model": model, "seq-len": 1024,
                 "batch-per-chip": 1, "mesh": "fsdp=4"},
        "grid": {"set.ici_link_bytes_per_s": ["x0.5", "x2"]},
        "zip": {"mesh": ["fsdp=4", "fsdp=2,tensor=2"], "remat": ["full", "minimal"]},
        "metrics": ["step_time_s", "mfu", "exposed_comm_s"],
        "plot": {"x": "set.ici_link_bytes_per_s", "y": "step_time_s", "hue": "mesh"},
    }
    s.update(extra)
    return s


def _single(capsys, argv: list[str]) -> dict:
    rc = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _no_wall(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=[WALL_COLUMN])


# -- schema ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"grids": {}}, "study key 'grids' is unknown"),
    ({"grid": {}, "zip": None}, "study grid is empty"),
    ({"grid": {"seq-len": []}}, "study grid.seq-len is an empty list"),
    ({"grid": {"bogus-flag": [1, 2]}}, "'bogus-flag' is not a flag of `tpusim train`"),
    ({"grid": {"out": ["a"]}}, "is an output flag"),
    ({"grid": {"set": [["ici_link_bytes_per_s=x2"]]}}, "give each override as its own key"),
    ({"grid": {"seq-len": 1024}}, "must be a list of values"),
    ({"zip": {"mesh": ["fsdp=4"], "remat": ["full", "none"]}}, "zip lists must have the same"),
    ({"command": "serve-sweep"}, "cannot be swept"),
    ({"plot": {"x": "seq-len", "y": "mfu"}}, "plot x 'seq-len' is not a key the study varies"),
    ({"grid": {"no-overlap": ["yes"]}}, "is a switch; give true or false"),
    ({"grid": {"wraparound": [False]}}, "takes a value, not true/false"),
    ({"grid": {"seq-len": list(range(1, 1001)), "batch-per-chip": list(range(1, 102))}},
     "study has 202,000 points (1000 x 101 x 2 zip rows), over the limit of 100,000 points"),
])
def test_study_schema_errors_are_one_line(tiny_model, change, message):
    s = _study(tiny_model)
    for k, v in change.items():
        if v is None:
            s.pop(k, None)
        else:
            s[k] = v
    with pytest.raises(TpusimError) as exc:
        load_study(s)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_sweep_table_prints_a_dash_for_what_a_point_lacks(tmp_path, capsys, tiny_model):
    # fsdp=8 does not fit the 2x2 pod: that point fails (no metrics); the other ran (no error).
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_study(tiny_model, grid={"mesh": ["fsdp=4", "fsdp=8"]},
                                       zip={}, plot=[], metrics=["step_time_s"])),
                     encoding="utf-8")
    rc = main(["sweep", str(study), "--out", str(tmp_path / "out"), "--workers", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    # Columns: step_time_s, status, error.
    assert rows["fsdp=4"][1:] == ["ok", "-"] and float(rows["fsdp=4"][0]) > 0
    assert rows["fsdp=8"][:2] == ["-", "error"] and rows["fsdp=8"][2] != "-"
    assert out.splitlines()[0].startswith("2 points (1 ok, 1 failed)")
    assert "NaN" not in out and "<NA>" not in out


def _assert_study_refused_before_running(tmp_path, capsys, study_dict, message):
    """`tpusim sweep` on this study exits 2 with one line about point 0 and writes nothing."""
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(study_dict), encoding="utf-8")
    rc = main(["sweep", str(study), "--out", str(tmp_path / "out"), "--workers", "1"])
    _out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("tpusim: error: study point 0") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


_COLLECTIVE_STUDY = {"command": "collective",
                     "base": {"chip": "v5e", "shape": "2x2", "op": "all-reduce", "axes": "x",
                              "bytes": "1MiB"},
                     "grid": {"bytes": ["1MiB", "2MiB"]}}


@pytest.mark.parametrize("base, message", [
    ({"chip": "v9z"}, "unknown chip 'v9z'"),
    ({"op": "all-reduse"}, "unknown --op 'all-reduse'; did you mean all-reduce?"),
    ({"algorithm": "rign"}, "unknown collective algorithm 'rign'"),
    ({"shape": ""}, "shape '' is not like 8x16"),
    ({"axes": "5"}, "--axes '5': '5' is not an axis of any pod; use x, y, z or dcn"),
    ({"slice": "v5p-7", "chip": None, "shape": None}, "v5p-7"),
])
def test_a_name_no_point_can_take_is_a_study_error_not_a_row_per_point(tmp_path, capsys, base,
                                                                       message):
    # An unknown chip, op, algorithm, slice, shape text or axis name failed every point, each
    # a row, and the study exited 0 ("4 points (4 failed)") (hard10).
    study = json.loads(json.dumps(_COLLECTIVE_STUDY))
    study["base"].update(base)
    study["base"] = {k: v for k, v in study["base"].items() if v is not None}
    _assert_study_refused_before_running(tmp_path, capsys, study, message)


def test_a_model_name_no_point_can_take_is_a_study_error(tmp_path, capsys, tiny_model):
    _assert_study_refused_before_running(
        tmp_path, capsys, _study(tiny_model, grid={"model": ["llama9-1b", tiny_model]},
                                 plot=None),
        "unknown model 'llama9-1b'")


@pytest.mark.parametrize("grid, message", [
    ({"set.not_a_field": [1]}, "not_a_field"),
    ({"set.hbm_bytes_per_s": [-1]}, "hbm_bytes_per_s"),
    ({"seq-len": ["abc"]}, "--seq-len 'abc' is not a whole number"),
    ({"axis-map": ["fsdp=x,fsdp=y"]}, "places 'fsdp' twice"),
])
def test_sweep_cli_rejects_a_value_the_command_cannot_take_before_running(
        tmp_path, capsys, tiny_model, grid, message):
    _assert_study_refused_before_running(
        tmp_path, capsys, _study(tiny_model, grid=grid, plot=None), message)


@pytest.mark.parametrize("zipped, message", [
    ({"mesh": ["fsdp", "fsdp=2,tensor=2"], "remat": ["full", "minimal"]},
     "'fsdp' is not name=size"),
    ({"mesh": ["fsdp=4", "fsdp=2,tensor=2"], "remat": ["qkv", "minimal"]},
     "--remat 'qkv' is not a remat policy"),
])
def test_sweep_cli_rejects_a_text_flag_the_command_cannot_parse_before_running(
        tmp_path, capsys, tiny_model, zipped, message):
    """Flags the command takes as text and parses when it runs (--mesh, --remat; --bytes and
    --axes of a collective) are parsed for every point first, like the typed ones."""
    _assert_study_refused_before_running(
        tmp_path, capsys, _study(tiny_model, zip=zipped, plot=None), message)


def test_points_are_grid_times_zip_with_varied_values_replacing_base(tiny_model):
    study = load_study(_study(tiny_model))
    points = study.points()
    assert [(p["set.ici_link_bytes_per_s"], p["mesh"]) for p in points] == [
        ("x0.5", "fsdp=4"), ("x0.5", "fsdp=2,tensor=2"), ("x2", "fsdp=4"),
        ("x2", "fsdp=2,tensor=2")]
    argv = point_argv(study, points[1])
    assert argv.count("--mesh") == 1 and argv[argv.index("--mesh") + 1] == "fsdp=2,tensor=2"
    assert argv[-2:] == ["--set", "ici_link_bytes_per_s=x0.5"]


# -- running -----------------------------------------------------------------------------------
def test_sweep_rows_equal_the_single_command_number_for_number(tmp_path, capsys, tiny_model):
    study = load_study(_study(tiny_model))
    df = run_study(study, SweepConfig(workers=2, out_dir=str(tmp_path / "out"), quiet=True))
    assert list(df["point"]) == [0, 1, 2, 3]
    assert df[ERROR_COLUMN].isna().all()
    for i, p in enumerate(study.points()):
        single = _single(capsys, point_argv(study, p))
        row = df.iloc[i]
        assert row["step_time_s"] == single["step_time_s"]
        assert row["mfu"] == single["mfu"]
        assert row["hbm_peak_bytes"] == single["hbm_peak_bytes"]
        assert row["exposed_comm_s"] == single["breakdown"]["exposed_comm_s"]
    # A faster ICI link never makes a step slower.
    fast = df[df["set.ici_link_bytes_per_s"] == "x2"]["step_time_s"].to_numpy()
    slow = df[df["set.ici_link_bytes_per_s"] == "x0.5"]["step_time_s"].to_numpy()
    assert (fast <= slow).all() and (fast < slow).any()
    out = tmp_path / "out"
    on_disk = pd.read_parquet(out / "results.parquet")
    pd.testing.assert_frame_equal(on_disk, df)
    assert len(pd.read_csv(out / "results.csv")) == 4
    meta = json.loads((out / "study.json").read_text())
    assert meta["study"] == study.to_dict()
    assert meta["timing"]["points"] == 4 and meta["timing"]["failed"] == 0
    assert (out / "plot_step_time_s_vs_set_ici_link_bytes_per_s.png").stat().st_size > 0


def test_points_run_in_one_worker_equal_each_point_run_with_cold_caches(tiny_model):
    """A worker keeps compiled traces, collective schedules and costs between points (the sweep
    speed-up): a point must give the very result it gives alone in a fresh process. Here every
    point runs after others that share its mesh or its chip numbers, and is compared, whole
    result including `inputs`, with the same point after every cache was emptied."""
    from sim.collectives import algorithms
    from sim.engine import costs as engine
    from sim.studies.points import run_point
    from workloads import training

    def cold():
        training.cache._TRACE_CACHE.clear()
        engine._COST_CACHE.clear()
        algorithms._SCHEDULE_CACHE.clear()

    s = _study(tiny_model, zip={"mesh": ["fsdp=4", "fsdp=4", "fsdp=2,tensor=2"],
                                "remat": ["full", "full", "minimal"],
                                "set.hbm_bytes_per_s": ["x1", "x1.5", "x1"]}, plot=None)
    study = load_study(s)
    argvs = [point_request(study, p) for p in study.points()]
    cold()
    warm = [run_point(a) for a in argvs]
    assert len(training.cache._TRACE_CACHE) == 2  # one trace per (mesh, remat), reused
    runs = []
    for a in argvs:
        cold()
        runs.append(run_point(a))
    assert all("result" in r for r in warm + runs)
    for w, r in zip(warm, runs, strict=True):
        assert w["result"] == r["result"]
    # The chip numbers reach the result: no two points give the same step time.
    assert len({r["result"]["step_time_s"] for r in runs}) == len(argvs)


def test_failed_points_are_rows_with_their_error(tiny_model):
    s = _study(tiny_model, grid={"mesh": ["fsdp=4", "fsdp=3", "fsdp=2,tensor=2"]}, plot=None)
    s.pop("zip")
    df = run_study(load_study(s), SweepConfig(workers=1, quiet=True))
    assert list(df["mesh"]) == ["fsdp=4", "fsdp=3", "fsdp=2,tensor=2"]
    assert df[ERROR_COLUMN].isna().tolist() == [True, False, True]
    assert "covers 3 chips but the pod has 4" in df[ERROR_COLUMN][1]
    assert pd.isna(df["step_time_s"][1]) and df["step_time_s"][0] > 0


def test_a_failed_points_error_names_the_flag_on_the_cli_and_the_argument_in_python(
        tmp_path, capsys, tiny_model):
    # interleaved needs as many microbatches as stages: the error names two settings, which
    # `sim.sweep` gives by Python name and `tpusim sweep` (table, parquet, csv) by flag, the
    # error travelling back from a worker process with its placeholders (two workers).
    s = _study(tiny_model, grid={"pipeline-schedule": ["gpipe", "interleaved"]}, zip={},
               plot=[], metrics=["step_time_s"])
    s["base"] = {**s["base"], "mesh": "fsdp=2,pipeline=2"}
    df = run_study(load_study(s), SweepConfig(workers=1, quiet=True))
    err = df[ERROR_COLUMN][1]
    assert df[ERROR_COLUMN].isna().tolist() == [True, False]
    assert err.startswith("pipeline_schedule interleaved needs at least as many microbatches")
    assert "raise microbatches or use pipeline_schedule gpipe" in err and "--" not in err
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(s), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["sweep", str(study), "--out", str(out), "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    flags = err.replace("pipeline_schedule", "--pipeline-schedule").replace(
        "microbatches 1 <", "--microbatches 1 <").replace("raise microbatches",
                                                          "raise --microbatches")
    assert flags.startswith("--pipeline-schedule interleaved needs") and flags != err
    assert flags[:60] in printed and "pipeline_schedule" not in printed
    for written in (pd.read_parquet(out / "results.parquet"), pd.read_csv(out / "results.csv")):
        assert written[ERROR_COLUMN][1] == flags


def test_a_failed_points_error_travels_to_the_pool_and_dask_with_its_placeholders(tiny_model):
    import pickle

    import cloudpickle

    from sim.runs import TrainRequest
    from sim.studies.points import run_point
    from topologies.errors import Said

    req = TrainRequest(chip="v5e", shape="2x2", model=tiny_model, seq_len=1024,
                       batch_per_chip=1, mesh="fsdp=2,pipeline=2",
                       pipeline_schedule="interleaved")
    err = run_point(req)["error"]
    assert isinstance(err, Said) and set(err.params) == {"pipeline_schedule", "microbatches"}
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps({"error": err}))["error"]  # the process pool's, Dask's
        assert isinstance(back, Said) and back == err
        assert (back.template, back.params) == (err.template, err.params)


def test_a_failed_candidates_error_in_the_plan_table_is_spelled_by_the_front_end():
    from sim.studies.plan_report import PLAN_COLUMNS, plan_table
    from topologies.errors import Said

    exc = TpusimError("{microbatches} 3 does not divide 2", "microbatches")
    row = {c: None for c in PLAN_COLUMNS} | {"rank": pd.NA, "fits_in_hbm": pd.NA,
                                            "error": Said(exc)}
    assert plan_table([], [row], False)["error"][0] == "microbatches 3 does not divide 2"
    flags = plan_table([], [row], False, lambda n: "--" + n)
    assert flags["error"][0] == "--microbatches 3 does not divide 2"
    assert str(flags["error"].dtype) == "string"


def test_resume_runs_only_the_missing_points_and_gives_the_same_rows(tmp_path, tiny_model):
    study = load_study(_study(tiny_model))
    out = tmp_path / "out"
    full = run_study(study, SweepConfig(workers=1, out_dir=str(out), quiet=True))
    with pytest.raises(TpusimError, match="already holds results.parquet; pass resume"):
        run_study(study, SweepConfig(workers=1, out_dir=str(out), quiet=True))
    # Keep points 0 and 2 only, as an interrupted run would have left them.
    full.iloc[[0, 2]].to_parquet(out / "results.parquet", index=False)
    ran = []
    resumed = run_study(study, SweepConfig(workers=1, out_dir=str(out), resume=True, quiet=True),
                        on_row=lambda r: ran.append(r["point"]))
    assert ran == [1, 3]
    pd.testing.assert_frame_equal(_no_wall(resumed), _no_wall(full))
    assert list(resumed[WALL_COLUMN][[0, 2]]) == list(full[WALL_COLUMN][[0, 2]])
    # Rows of another study are refused rather than mixed in.
    other = load_study(_study(tiny_model, base={**_study(tiny_model)["base"], "seq-len": 512}))
    with pytest.raises(TpusimError, match="not points of this study"):
        run_study(other, SweepConfig(workers=1, out_dir=str(out), resume=True, quiet=True))


def test_resume_refuses_result_columns_whose_kind_changed_without_declared_metrics(tmp_path):
    # No `metrics:`: the result columns are checked against the kinds tpusim recorded when it
    # wrote the file (text, NaN or true/false in a column of numbers, a column dropped or
    # added), each a one-line error before anything runs.
    study = load_study({"command": "collective",
                        "base": {"chip": "v5e", "shape": "4x4", "op": "all-gather", "axes": "x"},
                        "grid": {"bytes": ["64KiB", "1MiB", "2MiB"]}})
    out = tmp_path / "out"
    full = run_study(study, SweepConfig(workers=1, out_dir=str(out), quiet=True))
    assert full.attrs["tpusim_columns"]["time_s"] == ["num", True]
    assert full.attrs["tpusim_columns"]["algorithm"] == ["text", True]
    assert full.attrs["tpusim_columns"][ERROR_COLUMN] == ["none", False]

    def with_record(df, **columns):
        df = df.copy()
        df.attrs = {"tpusim_columns": {**full.attrs["tpusim_columns"], **columns}}
        return df

    def nan_in_row_1(df):
        df = df.copy()
        df.loc[1, "time_s"] = float("nan")
        return df

    edits = [
        (lambda df: df.assign(time_s=df["time_s"].astype(str)),
         "point 0: 'time_s' is '4.09"),
        (nan_in_row_1, "point 1 succeeded but has no 'time_s' (tpusim wrote one in every "
                       "succeeded row)"),
        (lambda df: df.assign(time_s=[True] * len(df)), "point 0: 'time_s' is True, but tpusim "
                                                        "wrote numbers in that column"),
        (lambda df: df.assign(algorithm=[1.5] * len(df)), "point 0: 'algorithm' is 1.5, but "
                                                          "tpusim wrote text in that column"),
        (lambda df: df.drop(columns=["latency_s"]), "has no column 'latency_s', which tpusim "
                                                    "wrote"),
        (lambda df: df.assign(zzz=1.0), "has a column tpusim did not write ('zzz')"),
        # The record itself edited: a kind that is not a name (unhashable), an unknown kind.
        (lambda df: with_record(df, time_s=[["num"], True]), "malformed record of its columns"),
        (lambda df: with_record(df, time_s=["float", True]), "malformed record of its columns"),
        (lambda df: with_record(df, time_s=["num", 1]), "malformed record of its columns"),
    ]
    for edit, message in edits:
        edit(full).to_parquet(out / "results.parquet", index=False)
        with pytest.raises(TpusimError, match="the file was edited") as exc:
            run_study(study, SweepConfig(workers=1, out_dir=str(out), resume=True, quiet=True))
        assert message in str(exc.value) and "\n" not in str(exc.value)
    # The file as tpusim wrote it resumes (nothing left to run).
    full.iloc[[0, 2]].to_parquet(out / "results.parquet", index=False)
    ran = []
    again = run_study(study, SweepConfig(workers=1, out_dir=str(out), resume=True, quiet=True),
                      on_row=lambda r: ran.append(r["point"]))
    assert ran == [1]
    pd.testing.assert_frame_equal(_no_wall(again), _no_wall(full))


# A Ctrl-C at a terminal reaches a foreground job whose SIGINT is at its default, which Python
# turns into KeyboardInterrupt. A job started in the background of a non-interactive shell
# (`bash -c '... &'`, nohup, some CI runners) inherits SIGINT *ignored* instead, and Python
# keeps an inherited SIG_IGN (it installs its handler only over SIG_DFL): a `tpusim sweep`
# started from such a test run would ignore the test's signal and finish every point. So the
# child is started as the terminal would start it: SIGINT back to its default, then `exec`
# of the same `python -m sim` (the handler set here is reset to SIG_DFL by exec, so the sweep
# process starts exactly as a foreground command does, whatever this process inherited).
_FOREGROUND_SIGINT = ("import os, signal, sys; "
                      "signal.signal(signal.SIGINT, signal.default_int_handler); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _foreground(argv: list[str]) -> list[str]:
    """`argv` (a `python ...` command line) run with SIGINT at its default, as at a terminal."""
    return [sys.executable, "-c", _FOREGROUND_SIGINT, *argv[1:]]


def test_foreground_child_takes_sigint_even_when_this_process_ignores_it():
    # The premise of the Ctrl-C test below: with SIGINT ignored here (as under `bash -c '...&'`)
    # a plain child inherits SIG_IGN, a `_foreground` child has Python's KeyboardInterrupt.
    probe = [sys.executable, "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        fg = subprocess.run(_foreground(probe), capture_output=True, text=True, check=True).stdout
    finally:
        signal.signal(signal.SIGINT, before)
    assert (plain.strip(), fg.strip()) == ("False", "True")


def test_ctrl_c_keeps_every_finished_row(tmp_path, tiny_model):
    # The interrupt must land mid-study. Rows reach the disk every `write_every_s` (2 s), so a
    # study that runs faster than that shows its first rows only when it has finished (on a
    # fast machine 96 tiny points did); and on a loaded one the child can finish its last
    # point between the parent seeing its first rows and the signal arriving. Such a run shows
    # nothing about an interruption, so the study is run again with twice the points, up to
    # seven times (768 points); every check below is made on a run that was interrupted with
    # points still to go.
    for attempt in range(7):
        n = 12 << attempt  # points: seq-len values x the two zipped meshes
        s = _study(tiny_model, grid={"seq-len": list(range(256, 256 + n // 2 * 4, 4))},
                   plot=None)
        study = tmp_path / f"s{attempt}.json"
        study.write_text(json.dumps(s), encoding="utf-8")
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen(
            _foreground([sys.executable, "-m", "sim", "sweep", str(study), "--out", str(out),
                         "--workers", "1", "--quiet"]),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        # Generous deadlines: under a loaded machine (a parallel suite beside other jobs) the
        # child's start-up and first point can take tens of seconds; the assertions below do
        # not depend on it.
        deadline = time.monotonic() + 180
        while not (out / "results.parquet").exists() and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.05)
        if proc.poll() is not None:
            _stdout, stderr = proc.communicate()
            assert proc.returncode == 0, stderr  # finished before any rows were written
            continue
        seen = len(pd.read_parquet(out / "results.parquet"))
        proc.send_signal(signal.SIGINT)
        _stdout, stderr = proc.communicate(timeout=180)
        if proc.returncode == 0 or (proc.returncode == 130 and
                                    len(pd.read_parquet(out / "results.parquet")) == n):
            continue  # the signal came after the last point
        break
    else:
        pytest.fail("no run of the study was interrupted with points to go in seven tries")
    assert proc.returncode == 130, (seen, stderr)
    assert "interrupted" in stderr.decode()
    df = pd.read_parquet(out / "results.parquet")
    assert seen <= len(df) < n
    assert list(df["point"]) == list(range(len(df)))
    assert df[ERROR_COLUMN].isna().all() and (df["step_time_s"] > 0).all()
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.parquet"]
    # --resume finishes the study from there.
    rc = subprocess.run(
        [sys.executable, "-m", "sim", "sweep", str(study), "--out", str(out), "--workers", "1",
         "--quiet", "--resume"], cwd=ROOT, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    assert rc == 0
    assert list(pd.read_parquet(out / "results.parquet")["point"]) == list(range(n))


def test_dask_local_cluster_gives_the_same_rows_as_the_local_pool(tiny_model):
    import distributed

    study = load_study(_study(tiny_model))
    local = run_study(study, SweepConfig(workers=1, quiet=True))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        on_dask = run_study(study, SweepConfig(dask=client, quiet=True))
    pd.testing.assert_frame_equal(_no_wall(on_dask), _no_wall(local))


def test_dask_address_that_does_not_answer_is_a_one_line_error_within_10_s(tmp_path, capsys,
                                                                           tiny_model):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    study = tmp_path / "s.json"
    study.write_text(json.dumps(_study(tiny_model)), encoding="utf-8")
    t0 = time.monotonic()
    rc = main(["sweep", str(study), "--dask", f"tcp://127.0.0.1:{port}", "--out",
               str(tmp_path / "out")])
    elapsed = time.monotonic() - t0
    _out, err = capsys.readouterr()
    assert rc == 2 and elapsed < 10
    assert err.startswith(f"tpusim: error: --dask tcp://127.0.0.1:{port}: no Dask scheduler")
    assert err.count("\n") == 1
    rc = main(["sweep", str(study), "--dask", "localhost:8786"])
    assert rc == 2 and "not a scheduler address" in capsys.readouterr().err


def test_python_api_sweep_returns_the_same_frame_as_the_study_runner(tiny_model):
    import sim

    s = _study(tiny_model, plot=None)
    df = sim.sweep(s)
    pd.testing.assert_frame_equal(_no_wall(df),
                                  _no_wall(run_study(load_study(s), SweepConfig(workers=1,
                                                                                quiet=True))))


# -- points that do not fit in HBM (issue 30) ------------------------------------------------
def _over_hbm_study(model: str) -> dict:
    # The 2-layer model on 4 v5e chips with remat none: batch 1 fits in 16 GB, batch 16 does
    # not (its saved activations alone are 16 x those of batch 1).
    return _study(model, base={"chip": "v5e", "shape": "2x2", "model": model, "seq-len": 2048,
                               "mesh": "fsdp=4", "remat": "none"},
                  grid={"batch-per-chip": [1, 16]}, zip={},
                  metrics=["step_time_s", "hbm_peak_bytes"],
                  plot={"x": "batch-per-chip", "y": "step_time_s"})


def _captured_figures(monkeypatch) -> list:
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


def test_a_point_over_hbm_is_marked_in_the_table_the_report_and_the_plot(tmp_path, capsys,
                                                                         tiny_model,
                                                                         monkeypatch):
    figs = _captured_figures(monkeypatch)
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_over_hbm_study(tiny_model)), encoding="utf-8")
    rc = main(["sweep", str(study), "--out", str(tmp_path / "out"), "--workers", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    df = pd.read_parquet(tmp_path / "out" / "results.parquet")
    cap = df["hbm_capacity_bytes"]
    assert list(df["hbm_peak_bytes"] <= cap) == [True, False]
    assert list(df["fits_in_hbm"]) == [True, False]
    assert list(df["status"]) == ["ok", "does not fit"]
    lines = out.splitlines()
    assert lines[0].startswith("2 points (1 ok, 1 does not fit in HBM, 0 failed)")
    assert lines[-1].split()[0] == "16" and "does not fit" in lines[-1]
    assert "does not fit" not in lines[-2]
    # The plot: the line goes through the point that fits only; the other is a hollow marker.
    (fig,) = figs
    ax = fig.axes[0]
    assert [list(line.get_xdata()) for line in ax.lines] == [[1]]
    (unfit,) = ax.collections
    assert [tuple(o) for o in unfit.get_offsets()] == [(16.0, df["step_time_s"][1])]
    assert unfit.get_facecolors().size == 0 or unfit.get_facecolors()[0][3] == 0
    assert unfit.get_label() == "does not fit in HBM"


def test_allow_oom_draws_the_point_over_hbm_like_the_others(tmp_path, tiny_model, monkeypatch):
    figs = _captured_figures(monkeypatch)
    df = run_study(load_study(_over_hbm_study(tiny_model)),
                   SweepConfig(workers=1, quiet=True, out_dir=str(tmp_path / "o"),
                               allow_oom=True))
    assert list(df["status"]) == ["ok", "does not fit"]  # the table still says so
    (fig,) = figs
    ax = fig.axes[0]
    assert [list(line.get_xdata()) for line in ax.lines] == [[1, 16]]
    assert not ax.collections


def test_python_sweep_rows_carry_the_status_of_each_point(tiny_model):
    import sim

    s = _over_hbm_study(tiny_model)
    s["grid"]["mesh"] = ["fsdp=4", "fsdp=8"]  # fsdp=8 does not fit the 4-chip pod: an error
    df = sim.sweep(s, workers=1)
    got = {(r["batch-per-chip"], r["mesh"]): r["status"] for r in df.to_dict("records")}
    assert got == {(1, "fsdp=4"): "ok", (1, "fsdp=8"): "error",
                   (16, "fsdp=4"): "does not fit", (16, "fsdp=8"): "error"}
    with pytest.raises(TpusimError, match="allow_oom"):
        sim.sweep(s, workers=1, allow_oom="yes")


def test_a_study_plot_list_is_bounded(tiny_model):
    from topologies.validate import MAX_STUDY_PLOTS

    one = {"x": "set.ici_link_bytes_per_s", "y": "step_time_s"}
    assert len(load_study(_study(tiny_model, plot=[one] * MAX_STUDY_PLOTS)).plots) == 32
    with pytest.raises(TpusimError, match="study plot lists 1,000 plots, over the limit of 32"):
        load_study(_study(tiny_model, plot=[one] * 1000))


def test_sweep_out_empty_is_an_error_not_lost_results(tmp_path, capsys, tiny_model,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_study(tiny_model)), encoding="utf-8")
    for out in ("", " "):
        rc = main(["sweep", str(study), "--out", out, "--workers", "1"])
        o, err = capsys.readouterr()
        assert rc == 2 and o == "" and err.count("\n") == 1
        assert "--out" in err and "names no directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml", "tiny.yaml"]
    with pytest.raises(TpusimError, match="names no directory"):
        SweepConfig(out_dir="")


# -- energy and cost as metrics (issue 26) ---------------------------------------------------
def test_energy_and_cost_are_sweep_metrics_equal_to_the_single_run(tiny_model):
    import sim

    s = _study(tiny_model, base={"chip": "v5e", "shape": "2x2", "model": tiny_model,
                                 "seq-len": 512, "batch-per-chip": 1, "mesh": "fsdp=4"},
               grid={"set.clock_scale": [1.0, 0.5]}, zip={},
               metrics=["energy_j", "energy_per_token_j", "cost_per_million_tokens_usd",
                        "chip_power_w_mean", "energy_mxu_j"], plot=None)
    df = sim.sweep(s)
    assert list(df["status"]) == ["ok", "ok"]
    for row, clock in zip(df.to_dict("records"), (1.0, 0.5), strict=True):
        run = sim.run(sim.TrainRequest(chip="v5e", shape="2x2", model=tiny_model, seq_len=512,
                                       batch_per_chip=1, mesh="fsdp=4",
                                       overrides={"clock_scale": str(clock)}))
        assert row["energy_j"] == run.energy["step_j"]
        assert row["energy_per_token_j"] == run.energy["j_per_token"]
        assert row["cost_per_million_tokens_usd"] == run.cost["usd_per_million_tokens"]
        assert row["energy_mxu_j"] == run.energy["step_j_by_unit"]["mxu"]
    # Half the clock: a slower step, a quarter of the MXU joules (energy per FLOP ~ clock^2).
    slow, fast = df.iloc[1], df.iloc[0]
    assert slow["step_time_s"] > fast["step_time_s"]
    assert slow["energy_mxu_j"] == pytest.approx(fast["energy_mxu_j"] / 4)
    assert "mxu" not in df.columns  # the sections' leaves are not columns of their own


def test_a_serve_point_that_does_not_fit_is_an_error_row_not_a_result(tiny_model):
    # `serve` refuses a replica whose weights leave no KV cache; in a study that point is a
    # row with status `error` and the reason, with no metrics, beside the point that runs.
    import sim

    s = {"command": "serve",
         "base": {"chip": "v5e", "shape": "2x2", "model": tiny_model, "rate": 100,
                  "requests": 20, "prompt-tokens": "fixed:64", "output-tokens": "fixed:8",
                  "set.hbm_bytes": "3e9"},
         "grid": {"mesh": ["tensor=4", "data=4"]},
         "metrics": ["tokens_per_s_per_chip"]}
    df = sim.sweep(s, workers=1).set_index("mesh")
    assert list(df["status"].loc[["tensor=4", "data=4"]]) == ["ok", "error"]
    assert "does not fit a replica's KV cache" in df[ERROR_COLUMN]["data=4"]
    assert df["tokens_per_s_per_chip"]["tensor=4"] > 0
    assert pd.isna(df["tokens_per_s_per_chip"]["data=4"])
