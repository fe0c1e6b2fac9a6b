"""`tpusim make-hlo-fixture` (workloads/hlo/make.py over workloads/hlo/jaxgen.py): a user's
slice, mesh and model checked in one line each before jax starts; a one-line error naming the
install when jax is missing (here, or under --jax-python); and, where jax is importable (or
TPUSIM_JAX_PYTHON names a python that has it), a real compile replayed by `tpusim replay`."""

from __future__ import annotations

import json
import os
import sys

import pytest

from sim.cli import main
from workloads.hlo import jaxgen
from workloads.hlo.make import have_jax, program_config
from workloads.zoo import MODELS

BASE = ["make-hlo-fixture", "--chip", "v5e", "--shape", "2x2", "--mesh", "fsdp=4", "--model",
        "llama3-8b", "--layers", "1", "--seq-len", "256"]


def _error(capsys, tmp_path, *argv: str) -> str:
    out = tmp_path / "p.hlo.txt.gz"
    rc = main([*argv, "-o", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 2 and stdout == "" and err.count("\n") == 1 and err.startswith(
        "tpusim: error: "), err
    assert not out.exists()  # nothing written
    return err


@pytest.mark.skipif(have_jax(), reason="jax is importable here: nothing is missing")
def test_missing_jax_is_one_line_naming_the_install_and_jax_python(capsys, tmp_path):
    err = _error(capsys, tmp_path, *BASE)
    assert "compiles with jax[tpu]==0.10.2, which this python lacks" in err
    assert "--jax-python hlo-venv/bin/python" in err and "pip install 'jax[tpu]==0.10.2'" in err


def test_a_jax_python_that_is_no_executable_or_has_no_jax_is_one_line(capsys, tmp_path):
    err = _error(capsys, tmp_path, *BASE, "--jax-python", str(tmp_path / "nope"))
    assert "is not an executable file" in err
    if not have_jax():  # this python itself has no jax: a venv without it
        err = _error(capsys, tmp_path, *BASE, "--jax-python", sys.executable)
        assert "has no jax: install it there" in err


@pytest.mark.parametrize("change,says", [
    ({"--mesh": "fsdp=8"}, "its axes multiply to 8 chips, the slice has 4"),
    ({"--mesh": "fsdq=4"}, "'fsdq' is not one of them (use one of: data, fsdp, tensor)"),
    ({"--mesh": "fsdp=4,fsdp=1"}, "each axis once"),
    ({"--mesh": "tensor=4"}, None),  # fine: llama3-8b's 8 KV heads split 4 ways
    ({"--model": "gemma2-9b"}, "is a dense LLaMA-style decoder"),
    ({"--model": "mixtral-8x7b"}, "sets num_experts"),
    ({"--chip": "v3"}, "jax's deviceless TPU topologies know v4, v5e, v5p, v6e"),
    ({"--remat": "ful"}, "--remat 'ful': did you mean full?"),
    ({"--batch-per-chip": "0.5"}, "split over data x fsdp = 4"),
])
def test_inputs_are_checked_in_one_line_before_jax_starts(capsys, tmp_path, change, says):
    argv = list(BASE)
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    if says is None:
        # Valid: the config builds (the compile itself needs jax).
        cfg = program_config(generation="v5e", shape=(2, 2), mesh=change["--mesh"],
                             model=MODELS.get("llama3-8b"), num_layers=1)
        assert cfg.mesh == {"tensor": 4} and cfg.topology == "v5e:2x2"
        return
    assert says in _error(capsys, tmp_path, *argv)


def test_a_slice_names_jaxs_topology_and_the_config_round_trips_to_the_script(capsys,
                                                                             tmp_path):
    cfg = program_config(generation="v5p", shape=(4, 4, 4), mesh="fsdp=16,tensor=4",
                         model=MODELS.get("llama3-8b"), num_layers=2)
    assert cfg.topology == "v5p:4x4x4" and cfg.dims["d_model"] == 4096 and cfg.num_layers == 2
    job = json.loads(jaxgen.job_json(cfg, "/tmp/out.hlo.txt"))
    assert jaxgen.HloProgramConfig(**job["config"]) == cfg and job["out"] == "/tmp/out.hlo.txt"
    err = _error(capsys, tmp_path, "make-hlo-fixture", "--slice", "v5p-128", "--chip", "v5p",
                 "--mesh", "fsdp=64", "--model", "llama3-8b")
    assert "--slice names the chip and the shape" in err


def _compile_and_replay(capsys, tmp_path, extra: list[str]) -> None:
    out = tmp_path / "p.hlo.txt.gz"
    rc = main([*BASE, "--program", "decode", "--kv-len", "128", *extra, "-o", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert stdout.startswith(f"wrote {out}: decode program of llama3-8b on v5e:2x2")
    rc = main(["replay", str(out), "--chip", "v5e", "--shape", "2x2", "--json", "--quiet"])
    doc = json.loads(capsys.readouterr()[0])
    assert rc == 0 and doc["step_time_s"] > 0 and doc["num_collectives"] >= 1


@pytest.mark.skipif(not have_jax(), reason="needs jax[tpu] in this python")
def test_compiled_here_when_jax_is_importable_and_replays(capsys, tmp_path):
    _compile_and_replay(capsys, tmp_path, [])


@pytest.mark.skipif(not os.environ.get("TPUSIM_JAX_PYTHON"),
                    reason="set TPUSIM_JAX_PYTHON to a python with jax[tpu]")
def test_compiled_under_jax_python_and_replays(capsys, tmp_path):
    _compile_and_replay(capsys, tmp_path, ["--jax-python", os.environ["TPUSIM_JAX_PYTHON"]])


def test_the_jax_path_is_documented_as_a_user_meets_it():
    # Issue 30: the `hlo` extra's pin, its size on disk, its install time and the harmless
    # libtpu warnings a compile prints are in the how-to, and agree with pyproject.toml, the
    # command's own install hint and the README.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pin = re.search(r'^hlo = \["(jax\[tpu\]==[\d.]+)"\]', (root / "pyproject.toml").read_text(),
                    re.M).group(1)
    howto = (root / "docs/howto/hlo.md").read_text()
    assert f"pip install '{pin}'" in howto
    size = re.search(r"(\d+(?:\.\d+)?) GB on\s+disk", howto).group(1)
    assert f"a {size} GB venv of its own" in (root / "README.md").read_text()
    assert re.search(r"\d+ s wall, \d+ CPU-s for the `pip install`", howto)
    assert "harmless on a machine without a TPU" in howto and "libtpu" in howto
    from workloads.hlo.make import PINNED_JAX

    assert PINNED_JAX == pin
