"""Progress of long runs: typed reports to a callback (topologies/progress.py) in the library,
drawn as bars on stderr by the CLI only when stderr is a terminal and --quiet is not given
(sim/cli/progress.py). The command-line tests run `tpusim` in a subprocess with stderr on a
pseudo-terminal (or a pipe) and stdout on a pipe; tiny pods and models keep them cheap, and
TPUSIM_PROGRESS_DELAY_S=0 shows bars that a run this short would otherwise not need."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import sim
from topologies.errors import TpusimError
from topologies.progress import (
    NO_TASK,
    ProgressUpdate,
    Task,
    current,
    reporting,
    task,
    tracked,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hlo"


# -- the library's reports --------------------------------------------------------------------
def test_no_callback_means_no_task_and_no_cost():
    assert current() is None
    assert task("x", total=3) is NO_TASK
    assert not NO_TASK.active and not NO_TASK.due()
    assert list(tracked([1, 2, 3], "x")) == [1, 2, 3]


def test_a_task_reports_its_first_and_last_update_and_holds_back_the_rest():
    seen: list[ProgressUpdate] = []
    with reporting(seen.append):
        t = task("work", total=1000, unit="item", interval_s=60.0)
        assert isinstance(t, Task) and t.active
        for _ in range(1000):
            t.advance()
        t.close(detail="done")
    assert [u.done for u in seen] == [0, 1000]
    assert seen[0].fraction == 0.0 and seen[-1].fraction == 1.0
    assert seen[-1].finished and not seen[0].finished and seen[-1].detail == "done"
    assert current() is None  # the block left nothing behind


def test_one_task_reports_at_a_time_the_outermost():
    seen: list[ProgressUpdate] = []
    with reporting(seen.append):
        with task("outer", total=2) as outer:
            assert task("inner", total=5) is NO_TASK
            assert list(tracked(range(3), "inner too")) == [0, 1, 2]
            outer.advance(2)
        assert task("next") is not NO_TASK  # the outer one closed: the next may report
    assert {u.task for u in seen} == {"outer", "next"}


def test_reporting_refuses_what_is_not_a_callable():
    with pytest.raises(TpusimError, match="progress=.* is not a callable"):
        with reporting("yes"):  # type: ignore[arg-type]
            pass


def _train(**extra):
    return dict(chip="v5e", shape="2x2", model="llama3-8b", seq_len=1024, batch_per_chip=1,
                mesh="fsdp=4", **extra)


def test_a_per_chip_step_reports_its_ops_and_gives_the_same_result(capsys):
    seen: list[ProgressUpdate] = []
    watched = sim.train(**_train(chip_variation=0.02, seed=3), progress=seen.append)
    alone = sim.train(**_train(chip_variation=0.02, seed=3))
    assert watched.to_dict() == alone.to_dict()  # reporting changes no event
    steps = [u for u in seen if u.task == "chip classes"]
    assert steps and steps[-1].finished and steps[-1].done == steps[-1].total > 0
    assert all(a.done <= b.done <= b.total for a, b in zip(steps, steps[1:], strict=False))
    assert "4 classes of 4 chips" in steps[0].detail
    assert capsys.readouterr() == ("", "")  # the library prints nothing


def test_vector_classes_report_the_slowest_chips_core():
    seen: list[ProgressUpdate] = []
    r = sim.train(chip="v5e", shape="4x8", model="llama3-8b", seq_len=512, batch_per_chip=1,
                  mesh="fsdp=32", chip_variation=0.02, progress=seen.append)
    assert r.num_chip_classes == 32
    vec = [u for u in seen if u.task == "vector classes"]
    assert vec and vec[-1].finished and vec[-1].done == vec[-1].total
    assert "32 chips" in vec[0].detail


def test_sweep_reports_points_failures_and_resumed_points(tmp_path):
    study = {"command": "collective",
             "base": {"chip": "v5e", "shape": "2x2", "op": "all-reduce", "axes": "x,y"},
             "grid": {"bytes": ["1MiB", "2MiB", "3"]}, "metrics": ["time_s"]}
    seen: list[ProgressUpdate] = []
    df = sim.sweep(study, workers=1, progress=seen.append)
    assert (df["status"] == "error").sum() == 1  # 3 bytes do not divide over 4 chips
    sweep = [u for u in seen if u.task == "sweep"]
    assert sweep[0].done == 0 and sweep[0].total == 3 and sweep[0].unit == "point"
    assert sweep[-1].finished and sweep[-1].done == 3 and sweep[-1].detail == "1 failed"
    assert {u.task for u in seen} == {"sweep"}  # the points' own runs report nothing
    seen.clear()
    sim.sweep(study, workers=1, progress=seen.append, quiet=True)
    assert seen == []


def test_plan_reports_groups_bounded_candidates_left_and_the_best(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    seen: list[ProgressUpdate] = []
    res = sim.plan(chip="v5e", shape="2x2", model=str(model), seq_len=1024, global_batch=8,
                   top=1, axes=("fsdp", "tensor"), remat=("full",), progress=seen.append)
    plan = [u for u in seen if u.task == "plan"]
    total = res.counts["bounded"] + res.counts["candidates"]
    assert plan[0].total == total and plan[-1].finished and plan[-1].done == total
    assert f"bounded {res.counts['bounded']}/{res.counts['bounded']}" in plan[-1].detail
    assert "left 0" in plan[-1].detail
    assert f"best {res.best['step_time_s']:.4g} s" in plan[-1].detail


def test_hlo_import_reports_tokenizing_parsing_and_lowering():
    seen: list[ProgressUpdate] = []
    sim.replay_trace(trace=str(FIXTURES / "windowed_einsum_v5e16.hlo.txt.gz"), chip="v5e",
                     shape="4x4", progress=seen.append)
    names = [u.task for u in seen if u.finished]
    assert names[:3] == ["HLO tokenize", "HLO parse", "HLO lower"]
    parse = next(u for u in seen if u.task == "HLO parse" and u.finished)
    assert parse.done == parse.total > 0


# -- the command line -------------------------------------------------------------------------
def _tpusim(args: list[str], *, tty: bool, timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run `python -m sim ARGS` with stdout on a pipe and stderr on a pseudo-terminal of 24 x 120
    (tty) or a pipe: (exit code, stdout, stderr as the terminal received it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TPUSIM_PROGRESS_DELAY_S="0")
    argv = [sys.executable, "-m", "sim", *args]
    if not tty:
        p = subprocess.run(argv, capture_output=True, env=env, cwd=ROOT, timeout=timeout_s)
        return p.returncode, p.stdout.decode(), p.stderr.decode()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    err = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                err += chunk
            elif p.poll() is not None:
                break
        out = p.stdout.read()
        p.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return p.returncode, out.decode(), err.decode(errors="replace")


def _tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    return str(path)


def _study(tmp_path: Path) -> str:
    path = tmp_path / "study.yaml"
    path.write_text("command: collective\nbase: {chip: v5e, shape: 2x2, op: all-reduce, "
                    "axes: \"x,y\"}\ngrid:\n  bytes: [1MiB, 2MiB, 4MiB]\nmetrics: [time_s]\n",
                    encoding="utf-8")
    return str(path)


_POD = ["--chip", "v5e", "--shape", "2x2"]


def _commands(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """command -> (arguments with --json, the task its bar names)."""
    tiny = _tiny(tmp_path)
    return {
        "plan": (["plan", *_POD, "--model", tiny, "--seq-len", "1024", "--global-batch", "8",
                  "--top", "1", "--workers", "1", "--axes", "fsdp,tensor", "--remat", "full",
                  "--out", "", "--json"], "plan"),
        "sweep": (["sweep", _study(tmp_path), "--workers", "1", "--out",
                   str(tmp_path / "sweep")], "sweep"),
        "train": (["train", *_POD, "--model", tiny, "--seq-len", "1024", "--batch-per-chip",
                   "1", "--mesh", "fsdp=4", "--chip-variation", "0.02", "--json"],
                  "chip classes"),
        # 32 chips each its own class: the vector executor's bar.
        "vector": (["train", "--chip", "v5e", "--shape", "4x8", "--model", tiny, "--seq-len",
                    "512", "--batch-per-chip", "1", "--mesh", "fsdp=32", "--chip-variation",
                    "0.02", "--json"], "vector classes"),
        # A pipelined step runs every stage's chips on the per-chip engine.
        "pipeline": (["train", *_POD, "--model", tiny, "--seq-len", "1024", "--batch-per-chip",
                      "1", "--mesh", "pipeline=2,fsdp=2", "--pipeline-schedule", "1f1b",
                      "--microbatches", "2", "--json"], "chip classes"),
        "perfetto": (["train", *_POD, "--model", tiny, "--seq-len", "1024", "--batch-per-chip",
                      "1", "--mesh", "fsdp=4", "--perfetto", str(tmp_path / "step.pftrace"),
                      "--trace-chips", "all", "--json"], "Perfetto export"),
        "import-hlo": (["import-hlo", str(FIXTURES / "windowed_einsum_v5e16.hlo.txt.gz"),
                        "--chip", "v5e", "--shape", "4x4", "--json"], "HLO parse"),
        "serve": (["serve", *_POD, "--model", tiny, "--mesh", "tensor=4", "--rate", "50",
                   "--requests", "100", "--prompt-tokens", "fixed:64", "--output-tokens",
                   "fixed:8", "--json"], "serve"),
    }


@pytest.mark.parametrize("command", ["plan", "sweep", "train", "vector", "pipeline",
                                     "perfetto", "import-hlo", "serve"])
def test_progress_appears_on_a_terminal_on_stderr_never_in_stdout(tmp_path, command):
    args, name = _commands(tmp_path)[command]
    rc, out, err = _tpusim(args, tty=True)
    assert rc == 0, err
    assert f"{name}:" in err and "%|" in err  # a bar with a total
    assert "%|" not in out and "\r" not in out
    if "--json" in args:
        json.loads(out)  # stdout is exactly the JSON
    # Every bar is erased when its task ends: the terminal's line is left blank.
    assert err.endswith("\r") and err.split("\r")[-2].strip() == ""


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_no_progress_when_stderr_is_a_pipe(tmp_path, command):
    args, _name = _commands(tmp_path)[command]
    rc, out, err = _tpusim(args, tty=False)
    assert rc == 0, err
    assert err == "" and "%|" not in out


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_turns_progress_off_on_a_terminal(tmp_path, where):
    args, _name = _commands(tmp_path)["train"]
    args = ["--quiet", *args] if where == "before" else [*args, "--quiet"]
    rc, out, err = _tpusim(args, tty=True)
    assert rc == 0, err
    assert "%|" not in err and "chip classes" not in err
    json.loads(out)
