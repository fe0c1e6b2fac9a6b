"""Tests for the Python API (`import sim`): keyword-only entry points that mirror the CLI, accept
names or spec objects and overrides as a dict, and return `Run`s whose `.to_dict()` is exactly
the command's `--json` (reasons kept as data name Python arguments where the CLI names flags)."""

from __future__ import annotations

import json
import pickle

import pytest
import yaml

import sim
from sim.chips import get_chip
from sim.cli import build_parser, main
from sim.cli.common import flag_spelling
from topologies.errors import TpusimError, render_said
from workloads.zoo import model_from_dict

TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}


def _cli_json_text(capsys, *argv) -> str:
    rc = main([str(a) for a in argv] + ["--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def _as_cli_text(run) -> str:
    # Byte for byte, but for the reasons a result keeps as data (a candidate `auto` refused):
    # they name settings by Python argument, and the command line spells them as its flags.
    spell = flag_spelling(build_parser(), run.command)
    return json.dumps(render_said(run.to_dict(), spell), indent=2) + "\n"


@pytest.mark.parametrize("command, argv, kwargs", [
    ("collective",
     ["--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x", "--bytes",
      "4MiB", "--set", "ici_link_bytes_per_s=x2"],
     dict(chip="v5e", shape="4x4", op="all-gather", axes="x", bytes="4MiB",
          set={"ici_link_bytes_per_s": "x2"})),
    ("train",
     ["--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--seq-len", "256",
      "--batch-per-chip", "1", "--mesh", "fsdp=2,tensor=2", "--set", "model.num_layers=2"],
     dict(chip="v5e", shape="2x2", model="llama3-8b", seq_len=256, batch_per_chip=1,
          mesh="fsdp=2,tensor=2", set={"model.num_layers": 2})),
    ("decode",
     ["--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "8",
      "--context-len", "1024", "--mesh", "tensor=4", "--kv-dtype", "int8"],
     dict(chip="v5e", shape="2x2", model="llama3-8b", batch=8, context_len=1024,
          mesh="tensor=4", kv_dtype="int8")),
    ("prefill",
     ["--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "1",
      "--prompt-len", "256", "--mesh", "tensor=4"],
     dict(chip="v5e", shape="2x2", model="llama3-8b", batch=1, prompt_len=256,
          mesh="tensor=4")),
], ids=["collective", "train", "decode", "prefill"])
def test_api_to_dict_is_the_cli_json_byte_for_byte(command, argv, kwargs, capsys):
    run = getattr(sim, command)(**kwargs)
    assert run.command == command
    assert _as_cli_text(run) == _cli_json_text(capsys, command, *argv)


def test_api_accepts_spec_objects_and_a_mesh_dict(tmp_path):
    chip = get_chip("v5e").with_overrides(hbm_bytes_per_s=1.0e12)
    model = model_from_dict(TINY)
    by_objects = sim.train(chip=chip, shape="2x2", model=model, seq_len=128,
                           batch_per_chip=2, mesh={"fsdp": 2, "tensor": 2})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    by_names = sim.train(chip="v5e", shape="2x2", model=path, seq_len=128, batch_per_chip=2,
                         mesh="fsdp=2,tensor=2", set={"hbm_bytes_per_s": "1e12"})
    assert by_objects.summary == by_names.summary
    assert by_objects.inputs["chip"] == by_names.inputs["chip"] == chip.to_dict()
    assert by_objects.inputs["model"] == by_names.inputs["model"]
    # The recorded flags of a run feed the next what-if directly.
    flags = by_names.inputs["flags"]
    slower = sim.train(**{**flags, "set": {**flags["set"], "op_overhead_s": "10us"}})
    assert slower.inputs["chip"]["hbm_bytes_per_s"] == 1e12
    assert slower.inputs["chip"]["op_overhead_s"] == pytest.approx(1e-5)
    assert slower.step_time_s > by_names.step_time_s


def test_run_fields_read_as_attributes_and_survive_pickling():
    run = sim.collective(chip="v5e", shape="4x4", op="all-reduce", axes="x,y", bytes=1 << 20)
    assert run.time_s == run.summary["time_s"] > 0
    assert len(run.result.links) > 0
    with pytest.raises(AttributeError, match="no field or result"):
        _ = run.nonsense
    back = pickle.loads(pickle.dumps(run))
    assert back.to_dict() == run.to_dict()


def test_rerun_of_an_api_result_gives_the_same_dict():
    run = sim.decode(chip="v5e", shape="2x2", model="llama3-8b", batch=4, context_len=512,
                     mesh="tensor=4", set={"hbm_bytes": "x0.5"})
    assert sim.rerun(run.to_dict()).to_dict() == run.to_dict()


def test_api_errors_name_the_function_and_what_it_takes():
    with pytest.raises(TpusimError, match=r"sim.train\(\) got unknown keyword\(s\) seqlen;"):
        sim.train(chip="v5e", shape="2x2", model="llama3-8b", seqlen=128)
    with pytest.raises(TpusimError, match=r"takes a dict"):
        sim.collective(chip="v5e", shape="4x4", op="all-gather", axes="x", bytes=1024,
                       set=["hbm_bytes=x2"])
    with pytest.raises(TpusimError, match=r"hbm_bandwidth .*hbm_bytes_per_s"):
        sim.collective(chip="v5e", shape="4x4", op="all-gather", axes="x", bytes=1024,
                       set={"hbm_bandwidth": "x2"})
    with pytest.raises(TpusimError, match=r"must be > 0"):
        sim.decode(chip="v5e", shape="2x2", model="llama3-8b", batch=1, context_len=64,
                   mesh="tensor=4", set={"hbm_bytes_per_s": 0})


def test_an_api_keyword_of_the_wrong_type_is_named_with_the_call_not_a_result_file():
    # Before, a notebook's sim.train(seed=b'x') was told "inputs.flags.'seed' ... (the result
    # file was edited)": the message for a hand-edited --json result.
    base = dict(chip="v5e", shape="2x2", model="llama3-8b", seq_len=128, batch_per_chip=1,
                mesh="fsdp=4")
    for key, value, want in [
            ("seed", b"x", r"sim.train\(seed=b'x'\): seed takes one number or text"),
            ("seq_len", [128], r"sim.train\(seq_len=\[128\]\): seq_len takes one number"),
            ("no_overlap", "yes", r"no_overlap takes True or False"),
            ("slow_link", "0,0:x+:0.5", r"slow_link takes a list of values such as"),
            ("set", {"model.num_layers": None}, r"set takes a dict of keys to numbers or text"),
            # A mesh dict's entry must be a name and a whole size: a key holding mesh syntax
            # used to add an axis of its own.
            ("mesh", {"fsdp=2,tensor": 2}, r"sim.train\(mesh=...\) entry 'fsdp=2,tensor': 2 is "
                                           r"not an axis name and a whole size"),
            ("mesh", {"fsdp": 4.0}, r"entry 'fsdp': 4.0 is not"),
            ("mesh", {"fsdp": True}, r"entry 'fsdp': True is not"),
            # ... and so did a size written as text holding more than digits.
            ("mesh", {"fsdp": "2,tensor=2"}, r"entry 'fsdp': '2,tensor=2' is not an axis name "
                                             r"and a whole size")]:
        with pytest.raises(TpusimError, match=want) as exc:
            sim.train(**{**base, key: value})
        assert "result file" not in str(exc.value) and "\n" not in str(exc.value)


def test_api_rerun_of_a_path_reads_it_with_the_cli_rules(tmp_path):
    # json.loads alone raised RecursionError (deep nesting) and ValueError (5,000 digits) and
    # took NaN; a directory or a missing file named no fix.
    cases = {"deep.json": ("[" * 100_000 + "]" * 100_000, r"nesting deeper than 32 levels"),
             "digits.json": ('{"inputs": ' + "9" * 5000 + "}", r"an integer of 5000 digits"),
             "nan.json": ('{"inputs": NaN}', r"holds NaN")}
    for name, (text, want) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(TpusimError, match=want):
            sim.rerun(tmp_path / name)
    with pytest.raises(TpusimError, match=r"is a directory; give '.*summary.json'"):
        sim.rerun(tmp_path)
    with pytest.raises(TpusimError, match=r"does not exist; give a file written by json"):
        sim.rerun(str(tmp_path / "missing.json"))


def test_api_studies_refuse_arguments_of_the_wrong_type_before_running(tmp_path):
    study = {"command": "collective", "base": {"chip": "v5e", "shape": "2x2", "op": "all-reduce",
                                               "axes": "x"}, "grid": {"bytes": ["1MiB"]}}
    for kwargs, want in [({"study": None}, r"sim.sweep\(study=None\): give a study file's path"),
                         ({"study": study, "dask": 5}, r"dask=5 is not a scheduler"),
                         ({"study": study, "out": 5}, r"sim.sweep\(out=5\): give a directory"),
                         ({"study": study, "resume": "yes"}, r"resume='yes'\): give True or")]:
        with pytest.raises(TpusimError, match=want):
            sim.sweep(**kwargs)
    plan = dict(model="llama3-8b", seq_len=128, global_batch=16, chip="v5e", shape="2x2")
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    for kwargs, want in [({"overrides": ["x2"]}, r"sim.plan\(overrides=\['x2'\]\): give a dict"),
                         ({"dask": 5}, r"dask=5 is not a scheduler"),
                         ({"out": 5}, r"sim.plan\(out=5\): give a directory"),
                         # Checked before the search, as `tpusim plan --out` does.
                         ({"out": str(blocker)}, r"is an existing file, not a directory")]:
        with pytest.raises(TpusimError, match=want):
            sim.plan(**plan, **kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda: sim.train(sim.TrainRequest(slice="v5p-8", model="llama3-8b", seq_len=8,
                                        batch_per_chip=1, mesh="fsdp=4"), "x"),
     r"sim.train\(\): too many positional arguments"),
    (lambda: sim.collective(None, "v5e"), r"sim.collective\(\): too many positional"),
    (lambda: sim.sweep("study.yaml", 2), r"sim.sweep\(\): too many positional arguments"),
    (lambda: sim.sweep("study.yaml", workerz=2), r"sim.sweep\(\): got an unexpected keyword"),
    (lambda: sim.plan("llama3-8b"), r"sim.plan\(\): too many positional arguments"),
    (lambda: sim.rerun(), r"sim.rerun\(\): missing a required argument: 'result'"),
    (lambda: sim.run(3), r"sim.run\(\) takes a request"),
])
def test_a_call_that_does_not_match_the_api_is_a_one_line_tpusim_error(call, match):
    with pytest.raises(TpusimError, match=match) as exc:
        call()
    assert "\n" not in str(exc.value)
