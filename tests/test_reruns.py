"""Tests for self-describing results and `tpusim rerun`: every `--json` result and `--out`
summary records its resolved inputs, and rerunning a result reproduces it byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sim.chips import get_chip
from sim.cli import main
from topologies.mesh import parse_mesh, place_mesh
from topologies.slices import resolve_topology

TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}
TRAIN = ["train", "--chip", "v5e", "--shape", "2x2", "--seq-len", "128", "--batch-per-chip",
         "2", "--mesh", "fsdp=2,tensor=2", "--remat", "minimal", "--param-dtype", "fp32"]
DECODE = ["decode", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "8",
          "--context-len", "1024", "--mesh", "tensor=4", "--kv-dtype", "int8"]
COLLECTIVE = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-reduce", "--axes",
              "x,y", "--bytes", "4MiB", "--slow-link", "0,0:x+:0.5"]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _ok(capsys, *argv) -> str:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 0, err
    return out


def _one_line_error(capsys, *argv) -> str:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2, (out, err)
    assert out == "" and err.startswith("tpusim: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def _rerun_is_identical(capsys, tmp_path: Path, text: str) -> None:
    path = tmp_path / "result.json"
    path.write_text(text)
    again = _ok(capsys, "rerun", path, "--check")
    assert again == text


@pytest.mark.parametrize("argv", [COLLECTIVE, DECODE], ids=["collective", "decode"])
def test_rerun_reproduces_collective_and_decode_results_byte_for_byte(argv, tmp_path, capsys):
    text = _ok(capsys, *argv, "--set", "ici_link_bytes_per_s=x2", "--set", "hbm_bytes=x0.5",
               "--json")
    _rerun_is_identical(capsys, tmp_path, text)


def test_rerun_reproduces_train_from_json_and_from_an_out_summary(tiny_yaml, tmp_path, capsys):
    argv = [*TRAIN, "--model", tiny_yaml, "--set", "model.d_ff=x2", "--set",
            "hbm_bytes_per_s=1.2TB/s"]
    text = _ok(capsys, *argv, "--json", "--out", tmp_path / "out")
    summary = (tmp_path / "out" / "summary.json").read_text()
    assert summary == text
    _rerun_is_identical(capsys, tmp_path, text)
    assert _ok(capsys, "rerun", tmp_path / "out" / "summary.json") == text


def test_collective_records_its_perturbations_and_reruns_them_without_the_file(tmp_path, capsys):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"slow_link": ["1,1:y+:0.25"]}))
    text = _ok(capsys, *COLLECTIVE, "--scenario", scenario, "--json")
    assert json.loads(text)["inputs"]["perturbations"] == {
        "slow_link": ["1,1:y+:0.25", "0,0:x+:0.5"]}
    scenario.write_text(yaml.safe_dump({"slow_link": ["2,2:y+:0.9"]}))
    _rerun_is_identical(capsys, tmp_path, text)


def test_rerun_uses_the_recorded_specs_not_the_files_they_came_from(tiny_yaml, tmp_path, capsys):
    chip = tmp_path / "chip.yaml"
    chip.write_text(yaml.safe_dump({"base": "v5e", "hbm_bytes_per_s": 1e12}))
    text = _ok(capsys, *TRAIN[:2], chip, *TRAIN[3:], "--model", tiny_yaml, "--json")
    chip.write_text(yaml.safe_dump({"base": "v5e", "hbm_bytes_per_s": 5e11}))
    tiny_yaml.write_text(yaml.safe_dump({**TINY, "num_layers": 8}))
    _rerun_is_identical(capsys, tmp_path, text)


def test_train_inputs_record_chip_topology_model_mesh_batch_and_flags(tiny_yaml, capsys):
    d = json.loads(_ok(capsys, *TRAIN, "--model", tiny_yaml, "--set", "mxu_efficiency=0.5",
                       "--json"))
    inputs = d["inputs"]
    assert inputs["command"] == "train" and inputs["tpusim_version"]
    v5e = get_chip("v5e")
    assert inputs["chip"] == v5e.with_overrides(mxu_efficiency=0.5).to_dict()
    assert inputs["overrides"] == {"mxu_efficiency": {
        "given": "0.5", "base": v5e.mxu_efficiency, "value": 0.5}}
    assert inputs["topology"] == {"name": "2x2", "shape": [2, 2], "wraparound": [],
                                  "slices": 1, "num_chips": 4}
    assert inputs["model"] == {**TINY, **{k: v for k, v in inputs["model"].items()
                                          if k not in TINY}}
    topo = resolve_topology(chip_name="v5e", wrap_rule=v5e.generation_rule,
                            max_pod_shape=v5e.max_pod_shape, shape="2x2")
    placed = place_mesh(parse_mesh("fsdp=2,tensor=2"), topo)
    assert inputs["mesh"]["ici"] == {"fsdp": 2, "tensor": 2}
    assert inputs["mesh"]["placement"] == {
        n: [list(f) for f in p.factors] for n, p in placed.items()}
    t = inputs["training"]
    assert (t["seq_len"], t["batch_per_chip"], t["global_batch"], t["remat"]) == \
        (128, 2.0, 8.0, "minimal")
    assert (t["param_dtype"], t["grad_dtype"], t["optimizer_dtype"]) == ("fp32", "bf16", "fp32")
    assert t["tokens_per_step"] == 8 * 128
    assert inputs["flags"]["set"] == {"mxu_efficiency": "0.5"}
    assert inputs["flags"]["remat"] == "minimal" and "json" not in inputs["flags"]


@pytest.mark.parametrize("argv", [
    ["compare-collectives", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes",
     "x", "--bytes", "1MiB"],
    ["prefill", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "1",
     "--prompt-len", "256", "--mesh", "tensor=4"],
    ["serve-sweep", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b",
     "--context-len", "256", "--batches", "1,4", "--mesh", "tensor=4;data=2,tensor=2"],
], ids=["compare-collectives", "prefill", "serve-sweep"])
def test_every_json_result_records_inputs_and_reruns(argv, tmp_path, capsys):
    text = _ok(capsys, *argv, "--json")
    inputs = json.loads(text)["inputs"]
    assert inputs["command"] == argv[0]
    assert inputs["chip"] == get_chip("v5e").to_dict()
    _rerun_is_identical(capsys, tmp_path, text)


def test_serve_sweep_out_directory_records_inputs(tmp_path, capsys):
    _ok(capsys, "serve-sweep", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b",
        "--context-len", "256", "--batches", "1,2", "--mesh", "tensor=4", "--out", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["inputs"]["batches"] == [1, 2]
    assert [r["batch"] for r in summary["rows"]] == [1, 2]


def test_replay_rerun_needs_the_same_trace_file(tiny_yaml, tmp_path, capsys):
    trace = tmp_path / "s.trace"
    _ok(capsys, "compile", "--chips", "4", "--model", tiny_yaml, "--seq-len", "128",
        "--batch-per-chip", "2", "--mesh", "fsdp=4", "-o", trace)
    text = _ok(capsys, "replay", trace, "--chip", "v5e", "--shape", "2x2", "--json")
    _rerun_is_identical(capsys, tmp_path, text)
    trace.write_text(trace.read_text() + "\n")  # same program, other bytes
    err = _one_line_error(capsys, "rerun", tmp_path / "result.json")
    assert "has changed since the result was written" in err
    # A result whose trace record is gone (null, or no sha256) cannot check the file: refused,
    # where it used to replay whatever the path held without a word.
    d = json.loads(text)
    for edit in (None, {"path": str(trace)}, {**d["inputs"]["trace"], "sha256": "0" * 10}):
        d["inputs"]["trace"] = edit
        err = _one_line_error(capsys, "rerun", _write(tmp_path, d))
        assert "inputs.trace.sha256 is" in err and "cannot check it replays the same file" in err


def test_check_reports_the_fields_that_differ(tiny_yaml, tmp_path, capsys):
    d = json.loads(_ok(capsys, *TRAIN, "--model", tiny_yaml, "--json"))
    d["step_time_s"] *= 2
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d, indent=2) + "\n")
    rc, out, err = _cli(capsys, "rerun", path, "--check")
    assert rc == 1 and "differs" in err and "step_time_s" in err
    assert json.loads(out)["step_time_s"] == d["step_time_s"] / 2


def _write(tmp_path: Path, obj) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_malformed_rerun_files_are_one_line_errors(tiny_yaml, tmp_path, capsys):
    good = json.loads(_ok(capsys, *TRAIN, "--model", tiny_yaml, "--json"))
    assert "not JSON" in _one_line_error(capsys, "rerun", _write(tmp_path, "{oops"))
    assert "no \"inputs\"" in _one_line_error(capsys, "rerun", _write(tmp_path, [1, 2]))
    assert "does not exist" in _one_line_error(capsys, "rerun", tmp_path / "nope.json")
    bad = json.loads(json.dumps(good))
    bad["inputs"]["command"] = "demo"
    assert "cannot be rerun" in _one_line_error(capsys, "rerun", _write(tmp_path, bad))
    bad = json.loads(json.dumps(good))
    bad["inputs"]["flags"]["warp-speed"] = 9
    assert "warp-speed" in _one_line_error(capsys, "rerun", _write(tmp_path, bad))
    bad = json.loads(json.dumps(good))
    bad["inputs"]["chip"]["hbm_bytes"] = -1
    err = _one_line_error(capsys, "rerun", _write(tmp_path, bad))
    assert "inputs.chip" in err and "hbm_bytes" in err
    bad = json.loads(json.dumps(good))
    bad["inputs"]["overrides"] = {"hbm_bytes": 3}
    assert "inputs.overrides" in _one_line_error(capsys, "rerun", _write(tmp_path, bad))
