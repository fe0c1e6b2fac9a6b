"""Fuzzing the CLI in-process: the saved corpus of inputs that once broke tpusim
(`tests/fuzz_corpus/*.jsonl`), hypothesis-generated inputs per surface (flags, chip YAML, model
YAML, trace files, study files, edited results, mutated HLO, odd collective placements, and
since harden3 sliding-window models, TPU all-reduce-scatter fusions and resumed results files),
outputs written into FIFOs and through symlinks, and byte-identical reruns.

Every run must end as "exit 0 with finite outputs" or "one `tpusim: error:` line, exit 2, and
nothing written", within a time budget; surely invalid inputs must be refused
(`tests/fuzz_harness.judge`). The long run (>= 2,000 inputs, each in a subprocess with memory
limits) is `validation/fuzz_cli.py`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import fuzz_inputs
import pytest
from fuzz_harness import TINY_MODEL, judge, load_corpus, run_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CORPUS = load_corpus()
TIME_BUDGET_S = 30.0


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_saved_corpus_case_is_an_answer_or_a_one_line_error(case, tmp_path):
    run = run_in_process(case, tmp_path, timeout_s=TIME_BUDGET_S)
    assert judge(case, run) == [], (case["argv"], run["stderr"][:500])


def test_corpus_covers_every_class_of_the_issue():
    ids = {c["id"] for c in CORPUS}
    for needed in ("trace-chips-billion", "slices-million", "layers-million", "billion-laughs",
                   "fifty-megabytes", "op-overhead-nan", "perfetto-into-fifo", "sexagesimal",
                   "out-and-perfetto-same-path", "batches-2000", "prefill-million-chunks"):
        assert needed in ids


_FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def _check_generated(surface: str, rng, tmp_path_factory) -> None:
    case = fuzz_inputs.GENERATORS[surface](rng, 0)
    tmp = tmp_path_factory.mktemp(surface)
    run = run_in_process(case, tmp, timeout_s=TIME_BUDGET_S)
    assert judge(case, run) == [], (run["argv"], case["expect"], run["stderr"][:500])


@_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_generated_flags_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("flags", rng, tmp_path_factory)


@_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_generated_chip_yaml_gives_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("chip_yaml", rng, tmp_path_factory)


@_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_generated_model_yaml_gives_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("model_yaml", rng, tmp_path_factory)


@_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_generated_trace_files_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("trace", rng, tmp_path_factory)


_FUZZ_NEW = settings(max_examples=5, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
# Generators whose examples are slow (HLO imports) or new: three examples in the suite, the
# rest in validation/fuzz_cli.py.
_FUZZ_FEW = settings(max_examples=3, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_study_files_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("study", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_edited_results_rerun_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("result", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_hlo_mutations_import_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("hlo", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_odd_placements_simulate_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("orbit", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_sliding_window_models_give_an_answer_or_a_one_line_error(rng,
                                                                            tmp_path_factory):
    _check_generated("gemma", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_resumed_results_files_resume_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("resume", rng, tmp_path_factory)


# fuzz8: the flags of the last two sessions, every number flag of every command, --scenario
# files and hostile HLO files.
@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_newer_train_flags_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("train8", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_newer_plan_flags_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("plan8", rng, tmp_path_factory)


@_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_generated_non_numbers_in_any_number_flag_are_a_one_line_error(rng, tmp_path_factory):
    _check_generated("numeric", rng, tmp_path_factory)


@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_scenario_files_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("scenario", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_hostile_hlo_files_give_an_answer_or_a_one_line_error(rng, tmp_path_factory):
    _check_generated("hlo_hostile", rng, tmp_path_factory)


# A compiled step of 8,105 instructions takes ~0.5 s to import: three examples here, the rest in
# validation/fuzz_cli.py.
@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_all_reduce_scatter_fusions_import_or_give_a_one_line_error(rng,
                                                                            tmp_path_factory):
    _check_generated("hlo_scatter", rng, tmp_path_factory)


# hard10: output paths (symlink loops, links to FIFOs, /proc) and Python API calls with odd
# values. Three examples each here, the rest in validation/fuzz_cli.py.
@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_output_paths_are_written_or_refused_in_one_line(rng, tmp_path_factory):
    _check_generated("outputs", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_api_calls_answer_or_raise_one_line_naming_the_call(rng, tmp_path_factory):
    _check_generated("api", rng, tmp_path_factory)


# Issue 30's surfaces: HLO modules written from scratch, train and decode studies, Chakra sets
# built with tpusim's writer, serving traces (validation/fuzz_cli.py runs thousands).
@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_hlo_modules_import_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("hlo_module", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_step_studies_sweep_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("step_study", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_chakra_sets_import_and_replay_or_give_a_one_line_error(rng,
                                                                         tmp_path_factory):
    _check_generated("chakra", rng, tmp_path_factory)


# A tpusim-exported Chakra set (made once) with its attributes, dependencies, nodes and files
# edited: replayed or refused in one line.
@_FUZZ_NEW
@given(rng=st.randoms(use_true_random=False))
def test_edited_chakra_exports_replay_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("chakra_export", rng, tmp_path_factory)


@_FUZZ_FEW
@given(rng=st.randoms(use_true_random=False))
def test_generated_serving_traces_serve_or_give_a_one_line_error(rng, tmp_path_factory):
    _check_generated("serve_trace", rng, tmp_path_factory)


def test_every_generator_is_drawn_by_the_long_run():
    assert set(fuzz_inputs.SURFACES) == set(fuzz_inputs.GENERATORS)


# -- outputs into special files ---------------------------------------------------------------
def _train_argv(tmp: Path, *extra: str) -> list[str]:
    (tmp / "tiny.yaml").write_text(TINY_MODEL)
    return ["train", "--chip", "v5e", "--shape", "2x2", "--model", str(tmp / "tiny.yaml"),
            "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "fsdp=4", "--quiet", *extra]


def test_perfetto_into_a_fifo_writes_through_it_and_keeps_the_fifo(tmp_path, capsys):
    from sim.cli import main

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = bytearray()

    def read() -> None:
        with open(fifo, "rb") as f:
            got.extend(f.read())

    reader = threading.Thread(target=read)
    reader.start()
    rc = main(_train_argv(tmp_path, "--perfetto", str(fifo)))
    reader.join(10)
    capsys.readouterr()
    assert rc == 0
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not replaced by a regular file
    regular = tmp_path / "regular.pftrace"
    assert main(_train_argv(tmp_path, "--perfetto", str(regular))) == 0
    assert bytes(got) == regular.read_bytes()  # the whole trace went through the pipe
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "regular.pftrace",
                                                          "tiny.yaml"]  # no temp files left


def test_a_character_device_is_written_in_place_not_replaced(tmp_path, capsys):
    from sim.export.output import write_bytes

    # /dev/null is the device of the issue; writing to it must leave it a character device.
    before = os.stat("/dev/null")
    write_bytes("/dev/null", b"discarded")
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_a_symlinked_output_is_followed_and_the_link_kept(tmp_path, capsys):
    from sim.cli import main

    target = tmp_path / "real.pftrace"
    link = tmp_path / "link.pftrace"
    link.symlink_to(target)
    assert main(_train_argv(tmp_path, "--perfetto", str(link))) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.is_file() and target.stat().st_size > 0


def test_an_output_file_ending_in_a_slash_is_refused_not_written_without_it(tmp_path, capsys):
    # Path() drops a trailing slash: `--perfetto out/` wrote a file named `out`.
    from sim.cli import main

    assert main(_train_argv(tmp_path, "--perfetto", f"{tmp_path}/out/")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ends with '/', which names a directory" in err
    assert not (tmp_path / "out").exists()


def test_a_loop_of_symlinks_is_refused_not_replaced_by_a_file(tmp_path, capsys):
    # realpath() of a loop is the link itself: the rename used to replace the link with the
    # trace (hard10).
    from sim.cli import main

    a, b = tmp_path / "a.pftrace", tmp_path / "b.pftrace"
    a.symlink_to(b)
    b.symlink_to(a)
    assert main(_train_argv(tmp_path, "--perfetto", str(a))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a loop of symbolic links; give a file name" in err
    assert a.is_symlink() and b.is_symlink()


def test_a_link_to_a_pipe_is_written_through_the_link(tmp_path):
    # /dev/stdout -> /proc/self/fd/1 resolves to /proc/PID/fd/pipe:[N] when stdout is a pipe,
    # a name that does not exist: `--perfetto /dev/stdout | ...` failed with "No such file or
    # directory". A link to a FIFO or device is written by its own name.
    from sim.export.output import write_bytes

    r, w = os.pipe()
    try:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{w}")
        write_bytes(link, b"through the link")
        assert os.read(r, 100) == b"through the link"
        assert link.is_symlink()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["stdout"]
    finally:
        os.close(r)
        os.close(w)


def test_a_regular_output_file_is_replaced_atomically(tmp_path):
    from sim.export.output import atomic_write

    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        atomic_write(path, lambda p: (p.write_text("half"), (_ for _ in ()).throw(
            RuntimeError("writer failed"))))
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


# -- determinism ------------------------------------------------------------------------------
def _digest(root: Path) -> dict[str, str]:
    # The two runs differ only in their directory, which summary.json records among its inputs.
    return {str(p.relative_to(root)):
            hashlib.sha256(p.read_bytes().replace(str(root).encode(), b"D")).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "tiny.yaml"}


def test_same_inputs_give_byte_identical_json_tables_perfetto_and_plots(tmp_path, capsys):
    from sim.cli import main

    outs = []
    for run in ("a", "b"):
        d = tmp_path / run
        d.mkdir()
        argv = _train_argv(d, "--json", "--out", str(d / "out"), "--perfetto",
                           str(d / "t.pftrace"), "--plots", str(d / "plots"))
        assert main(argv) == 0
        outs.append((capsys.readouterr().out.replace(str(d), "D"), _digest(d)))
    (json_a, files_a), (json_b, files_b) = outs
    assert json_a == json_b
    assert files_a == files_b
    assert any(k.endswith(".png") for k in files_a) and any(k.endswith(".parquet")
                                                           for k in files_a)


@pytest.mark.parametrize("value", ["nan", "-inf", "1e400", "9" * 400, "１"])
def test_every_number_flag_of_every_command_refuses_a_non_number_naming_the_flag(value,
                                                                                tmp_path):
    # The number flags are read off the parser (fuzz_inputs._numeric_flags: every integer,
    # number and float flag, --bytes, --workers), so a flag added later is checked too.
    flags = fuzz_inputs._numeric_flags()
    assert sum(len(f) for f in flags.values()) >= 50
    for cmd, names in flags.items():
        for flag in names:
            argv = list(fuzz_inputs.NUMERIC_BASES[cmd])
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
            case = {"argv": argv, "expect": "error",
                    "files": {"s.trace": {"trace": {"set": []}},
                              "p.txt": {"hlo": {"replace": []}}}}
            d = tmp_path / f"{cmd}{flag}"
            d.mkdir()
            run = run_in_process(case, d, timeout_s=TIME_BUDGET_S)
            assert judge(case, run) == [], (argv, run["stderr"][:300])
            assert flag in run["stderr"], (argv, run["stderr"][:300])
