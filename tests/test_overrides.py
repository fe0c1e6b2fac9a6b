"""Tests for sim/overrides.py and `--set KEY=VALUE` on every simulating command: values and units,
multipliers of the preset, the keys each command takes, one-line errors, and results that equal
the same what-if written as a chip or model YAML file (or a closed-form oracle)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from sim.chips import get_chip
from sim.cli import main
from sim.hardware import CHIP_FIELDS
from sim.overrides import allowed_keys, parse_overrides
from topologies.errors import TpusimError
from workloads.zoo import MODELS, model_from_dict

TINY = {
    "name": "tiny", "num_layers": 2, "d_model": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *argv: str) -> dict:
    rc, out, err = _cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def _one_line_error(capsys, *argv: str) -> str:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2, (argv, out, err)
    assert out == ""
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _without_inputs(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "inputs"}


# -- values ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "item, field, value",
    [("hbm_bytes_per_s=1.6e12", "hbm_bytes_per_s", 1.6e12),
     ("hbm_bytes_per_s=1.6TB/s", "hbm_bytes_per_s", 1.6e12),
     ("ici_link_bytes_per_s=180GB/s", "ici_link_bytes_per_s", 180e9),
     ("hbm_bytes=32GiB", "hbm_bytes", 32 * 2**30),
     ("ici_hop_latency_s=2us", "ici_hop_latency_s", 2e-6),
     ("dcn_latency_s=0.5ms", "dcn_latency_s", 5e-4),
     ("mxu_flops_per_s=459T", "mxu_flops_per_s", 459e12),
     ("mxu_flops_per_s=1.2PFLOP/s", "mxu_flops_per_s", 1.2e15),
     ("mxu_efficiency=0.9", "mxu_efficiency", 0.9),
     ("op_overhead_s=0", "op_overhead_s", 0.0),
     ("ici_links_per_chip=4", "ici_links_per_chip", 4),
     ("max_pod_shape=8x8x8", "max_pod_shape", (8, 8, 8))],
)
def test_set_values_accept_plain_numbers_and_units_of_the_field(item, field, value):
    chip = parse_overrides([item]).apply_chip(get_chip("v5p"))
    assert getattr(chip, field) == pytest.approx(value) if isinstance(value, float) \
        else getattr(chip, field) == value


def test_multiplier_scales_the_preset_value_exactly():
    base = get_chip("v5p")
    chip = parse_overrides(["ici_link_bytes_per_s=x2", "hbm_bytes_per_s=X0.5"]).apply_chip(base)
    assert chip.ici_link_bytes_per_s == 2 * base.ici_link_bytes_per_s
    assert chip.hbm_bytes_per_s == 0.5 * base.hbm_bytes_per_s
    # Every other field is untouched.
    for f in CHIP_FIELDS:
        if f not in ("ici_link_bytes_per_s", "hbm_bytes_per_s"):
            assert getattr(chip, f) == getattr(base, f), f


def test_model_overrides_apply_to_the_model_and_multipliers_stay_integers():
    m = MODELS.get("llama3-8b")
    ov = parse_overrides({"model.d_ff": 28672, "model.num_layers": "x0.5",
                          "model.tied_embeddings": "true"})
    out = ov.apply_model(m)
    assert (out.d_ff, out.num_layers, out.tied_embeddings) == (28672, 16, True)
    with pytest.raises(TpusimError, match="not a whole number"):
        parse_overrides({"model.num_layers": "x0.3"}).apply_model(m)


def test_a_later_value_for_the_same_key_wins():
    ov = parse_overrides(["hbm_bytes=x2", "hbm_bytes=x3"])
    assert ov.apply_chip(get_chip("v5e")).hbm_bytes == 3 * get_chip("v5e").hbm_bytes


def test_resolved_overrides_record_given_base_and_value():
    base = get_chip("v5e")
    ov = parse_overrides(["ici_link_bytes_per_s=x2"])
    assert ov.resolved(base) == {"ici_link_bytes_per_s": {
        "given": "x2", "base": base.ici_link_bytes_per_s,
        "value": 2 * base.ici_link_bytes_per_s}}


@pytest.mark.parametrize(
    "item, needle",
    [("hbm_bytes_per_s=0", "must be > 0"), ("hbm_bytes_per_s=-1e12", "must be > 0"),
     ("hbm_bytes_per_s=nan", "finite"), ("hbm_bytes_per_s=inf", "finite"),
     ("hbm_bytes_per_s=x0", "positive finite"), ("hbm_bytes_per_s=x-2", "positive finite"),
     ("hbm_bytes_per_s=xnan", "positive finite"), ("hbm_bytes_per_s=fast", "not a number"),
     ("hbm_bytes_per_s=3ms", "not a number"), ("ici_hop_latency_s=1GB", "not a number"),
     ("mxu_efficiency=1.5", "(0, 1]"), ("ici_links_per_chip=4.5", "whole number"),
     ("op_overhead_s=-1", "must be >= 0"), ("model.d_ff=0", "must be > 0"),
     ("model.mlp=tanh", "swiglu"), ("model.parallel_block=maybe", "true or false"),
     ("generation_rule=ring", "cube"), ("hbm_bytes", "is not KEY=VALUE")],
)
def test_bad_values_are_errors_naming_the_key_and_the_rule(item, needle):
    with pytest.raises(TpusimError, match="^set ") as exc:
        parse_overrides([item])
    assert needle in str(exc.value)
    # the CLI writes the setting as its flag
    assert exc.value.render(lambda n: "--" + n).startswith("--set ")


def test_a_multiplier_pushing_an_efficiency_above_one_is_an_error():
    with pytest.raises(TpusimError, match=r"exceeds 1"):
        parse_overrides(["mxu_efficiency=x2"]).apply_chip(get_chip("v5e"))


def test_unknown_keys_suggest_the_nearest_allowed_ones_of_the_commands_scope():
    from sim.cli import build_parser
    from sim.cli.common import flag_spelling

    listing = "sim.overrides.allowed_keys(CollectiveRequest.SET_SCOPE)"
    with pytest.raises(TpusimError) as exc:
        parse_overrides(["ici_bandwidth=x2"], ("chip", "topology"), command="tpusim collective",
                        listing=listing)
    msg = str(exc.value)
    assert "ici_bandwidth" in msg and "ici_link_bytes_per_s" in msg
    n = len(allowed_keys(("chip", "topology")))
    # Python names the call that lists the keys; the CLI, the command's --help.
    assert f"({n} in all; `{listing}` lists them)" in msg
    assert exc.value.render(flag_spelling(build_parser())).endswith(
        f"({n} in all; `tpusim collective --help` lists them)")
    with pytest.raises(TpusimError, match=r"did you mean topology.wraparound\?"):
        parse_overrides(["topology.wraparond=x"], ("chip", "topology"))
    with pytest.raises(TpusimError) as exc:
        parse_overrides(["model.d_fff=1"], ("chip", "topology"))
    assert "model.d_ff," not in str(exc.value)  # not suggested: not in this scope
    with pytest.raises(TpusimError, match=r"model fields are written model.d_ff"):
        parse_overrides(["d_ff=28672"])
    with pytest.raises(TpusimError, match=r"does not apply to tpusim replay"):
        parse_overrides(["model.d_ff=1"], ("chip",), command="tpusim replay")


def test_allowed_keys_cover_every_chip_and_model_field():
    keys = allowed_keys(("chip", "topology", "collective", "model"))
    assert set(CHIP_FIELDS) <= set(keys)
    assert {"topology.wraparound", "collective.algorithm", "model.d_ff"} <= set(keys)


# -- every command -----------------------------------------------------------------------------
def test_collective_set_link_bandwidth_matches_the_bidi_ring_closed_form(capsys):
    v, x = 32 << 20, 16
    w1, hop = 2 * 4.5e10, 2e-6  # v5e one-way link x2; hop latency 2 us
    d = _json(capsys, "collective", "--chip", "v5e", "--shape", "16x16", "--op", "all-gather",
              "--axes", "x", "--bytes", str(v), "--algorithm", "bidi-ring",
              "--set", "ici_link_bytes_per_s=x2", "--set", "ici_hop_latency_s=2us")
    assert d["time_s"] == pytest.approx((x // 2) * (hop + v / (x * w1)), rel=1e-9)


def test_collective_topology_and_algorithm_keys_equal_their_flags(capsys):
    pod = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x",
           "--bytes", "4MiB"]
    by_flag = _json(capsys, *pod, "--wraparound", "all", "--algorithm", "split-bidi-ring")
    by_set = _json(capsys, *pod, "--set", "topology.wraparound=all",
                   "--set", "collective.algorithm=split-bidi-ring")
    assert _without_inputs(by_set) == _without_inputs(by_flag)
    assert by_set["algorithm"] == "split-bidi-ring"


def test_compare_collectives_set_scales_the_line_row_by_its_closed_form(capsys):
    pod = ["compare-collectives", "--chip", "v5e", "--shape", "8x2", "--op", "all-gather",
           "--axes", "x", "--bytes", "8MiB"]
    base = {r["algorithm"]: r for r in _json(capsys, *pod)["results"] if r["applicable"]}
    fast = {r["algorithm"]: r for r in
            _json(capsys, *pod, "--set", "ici_link_bytes_per_s=x4")["results"] if r["applicable"]}
    # A bidirectional line of 8 (no wraparound): 7 steps of (L + V/(8 W1)).
    v, w1 = 8 << 20, 4.5e10
    assert base["line"]["time_s"] == pytest.approx(7 * (1e-6 + v / (8 * w1)), rel=1e-9)
    assert fast["line"]["time_s"] == pytest.approx(7 * (1e-6 + v / (8 * 4 * w1)), rel=1e-9)
    err = _one_line_error(capsys, *pod, "--set", "collective.algorithm=ring")
    assert "does not apply to tpusim compare-collectives" in err


def _chip_file(tmp_path: Path, **fields) -> str:
    path = tmp_path / "chip.yaml"
    path.write_text(yaml.safe_dump({"base": "v5e", "name": "v5e", **fields}))
    return str(path)


def test_train_set_equals_the_same_chip_and_model_written_as_yaml(tiny_yaml, tmp_path, capsys):
    v5e = get_chip("v5e")
    args = ["--shape", "2x2", "--seq-len", "128", "--batch-per-chip", "2", "--mesh",
            "fsdp=2,tensor=2"]
    by_set = _json(capsys, "train", "--chip", "v5e", "--model", tiny_yaml, *args,
                   "--set", "ici_link_bytes_per_s=x0.25", "--set", "hbm_bytes_per_s=410GB/s",
                   "--set", "model.d_ff=2048")
    model2 = tmp_path / "tiny2.yaml"
    model2.write_text(yaml.safe_dump({**TINY, "d_ff": 2048}))
    chip = _chip_file(tmp_path, ici_link_bytes_per_s=v5e.ici_link_bytes_per_s * 0.25,
                      hbm_bytes_per_s=4.1e11)
    by_file = _json(capsys, "train", "--chip", chip, "--model", str(model2), *args)
    assert _without_inputs(by_set) == _without_inputs(by_file)
    plain = _json(capsys, "train", "--chip", "v5e", "--model", tiny_yaml, *args)
    assert by_set["step_time_s"] > plain["step_time_s"]  # slower links and HBM, wider MLP
    # Wider MLP: model FLOPs grow by exactly 6 x (added MLP params) x tokens / chips.
    added = 3 * 256 * 1024 * 2  # 3 matrices x d_model x (2048-1024) x layers
    tokens = 2 * 4 * 128
    assert by_set["model_flops_per_chip"] - plain["model_flops_per_chip"] == \
        pytest.approx(6 * added * tokens / 4, rel=1e-9)


def test_compile_takes_model_keys_and_replay_export_take_chip_keys(tiny_yaml, tmp_path, capsys):
    pod = ["--chip", "v5e", "--shape", "2x2"]
    common = ["--seq-len", "128", "--batch-per-chip", "2", "--mesh", "fsdp=4"]
    path = tmp_path / "s.trace"
    rc, _, err = _cli(capsys, "compile", *pod, "--model", tiny_yaml, *common,
                      "--set", "model.num_layers=4", "-o", path)
    assert rc == 0, err
    trained = _json(capsys, "train", *pod, "--model", tiny_yaml, *common,
                    "--set", "model.num_layers=4", "--set", "mxu_flops_per_s=x0.5")
    replayed = _json(capsys, "replay", path, *pod, "--set", "mxu_flops_per_s=x0.5")
    for k in ("step_time_s", "breakdown", "hbm_peak_bytes", "model_flops_per_chip"):
        assert replayed[k] == trained[k], k
    pf = tmp_path / "s.pftrace"
    rc, _, err = _cli(capsys, "export", path, *pod, "--set", "mxu_flops_per_s=x0.5",
                      "--perfetto", pf)
    assert rc == 0 and pf.stat().st_size > 0, err
    assert "does not apply to tpusim compile" in _one_line_error(
        capsys, "compile", *pod, "--model", tiny_yaml, *common, "--set", "hbm_bytes=x2",
        "-o", tmp_path / "t.trace")
    assert "does not apply to tpusim replay" in _one_line_error(
        capsys, "replay", path, *pod, "--set", "model.d_ff=64")
    assert not (tmp_path / "t.trace").exists()


def test_decode_prefill_and_serve_sweep_set_equals_a_chip_file(tmp_path, capsys):
    v5e = get_chip("v5e")
    chip = _chip_file(tmp_path, hbm_bytes_per_s=2 * v5e.hbm_bytes_per_s, hbm_bytes=8e9)
    sets = ["--set", "hbm_bytes_per_s=x2", "--set", "hbm_bytes=8GB"]
    base = ["--shape", "2x2", "--model", "llama3-8b", "--mesh", "tensor=4"]
    for cmd, extra in (("decode", ["--batch", "8", "--context-len", "1024"]),
                       ("prefill", ["--batch", "1", "--prompt-len", "512"]),
                       ("serve-sweep", ["--context-len", "1024", "--batches", "1,8"])):
        by_set = _json(capsys, cmd, "--chip", "v5e", *base, *extra, *sets)
        by_file = _json(capsys, cmd, "--chip", chip, *base, *extra)
        assert _without_inputs(by_set) == _without_inputs(by_file), cmd
    # Decode is HBM-bound at batch 8: twice the bandwidth must make it faster.
    plain = _json(capsys, "decode", "--chip", "v5e", *base, "--batch", "8", "--context-len",
                  "1024")
    fast = _json(capsys, "decode", "--chip", "v5e", *base, "--batch", "8", "--context-len",
                 "1024", "--set", "hbm_bytes_per_s=x2")
    assert fast["step_time_s"] < plain["step_time_s"]
    assert fast["max_batch_that_fits"] == plain["max_batch_that_fits"]
    small = _json(capsys, "decode", "--chip", "v5e", *base, "--batch", "8", "--context-len",
                  "1024", "--set", "hbm_bytes=x0.5")
    assert small["max_batch_that_fits"] < plain["max_batch_that_fits"]


@pytest.mark.parametrize(
    "argv, needles",
    [(["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x",
       "--bytes", "1MiB", "--set", "ici_link_bytes_per_s=0"], ["must be > 0"]),
     (["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x",
       "--bytes", "1MiB", "--set", "hbm_bandwidth=x2"], ["hbm_bandwidth", "hbm_bytes_per_s"]),
     (["train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--seq-len", "128",
       "--batch-per-chip", "1", "--mesh", "fsdp=4", "--set", "model.d_ff=nan"], ["finite"]),
     (["decode", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "1",
       "--context-len", "128", "--mesh", "tensor=4", "--set", "topology.wraparound=q"],
      ["wraparound"]),
     (["prefill", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--batch", "1",
       "--prompt-len", "128", "--mesh", "tensor=4", "--set", "collective.algorithm=bogus"],
      ["bogus"])],
)
def test_bad_set_on_the_cli_is_one_line_exit_2(capsys, argv, needles):
    err = _one_line_error(capsys, *argv)
    for n in needles:
        assert n in err, (n, err)


def test_model_from_dict_round_trip_keeps_overridden_models_valid():
    m = parse_overrides({"model.num_kv_heads": 4}).apply_model(model_from_dict(TINY))
    assert m.num_kv_heads == 4
    with pytest.raises(TpusimError, match="num_kv_heads"):
        parse_overrides({"model.num_kv_heads": 3}).apply_model(model_from_dict(TINY))
    assert math.isclose(model_from_dict(m.to_dict()).num_params, m.num_params)


def test_attention_pattern_fields_are_overridable_and_validated_like_the_model_file():
    m = MODELS.get("gemma3-12b")
    out = parse_overrides({"model.attention_window": "4096", "model.global_layer_period": 0,
                           "model.qk_norm": "false"}).apply_model(m)
    assert (out.attention_window, out.global_layer_period, out.qk_norm) == (4096, 0, False)
    assert out.num_local_layers == 48
    # null turns the window off; the pattern must then go too (the model's own rule).
    full = parse_overrides({"model.attention_window": "null",
                            "model.global_layer_period": "0"}).apply_model(m)
    assert full.attention_window is None and full.num_global_layers == 48
    with pytest.raises(TpusimError, match="global_layer_period=6 is set but attention_window "
                                          "is null"):
        parse_overrides({"model.attention_window": "null"}).apply_model(m)
    with pytest.raises(TpusimError, match="model.attention_window=0"):
        parse_overrides({"model.attention_window": "0"})
    with pytest.raises(TpusimError, match="global_layer_period=64 does not fit num_layers=48"):
        parse_overrides({"model.global_layer_period": "64"}).apply_model(m)


# -- chip and model YAML read values with the --set parser (issue 30) --------------------------
@pytest.mark.parametrize("key,text", [
    ("mxu_flops_per_s", "918T"), ("mxu_flops_per_s", "918 TFLOP/s"),
    ("ici_link_bytes_per_s", "180GB/s"), ("hbm_bytes", "16GiB"), ("hbm_bytes", "32 GB"),
    ("ici_hop_latency_s", "2us"), ("op_overhead_s", "500ns"), ("hbm_bytes_per_s", "x2"),
    ("ici_link_bytes_per_s", "x0.5"), ("ici_links_per_chip", "x1"), ("mxu_efficiency", "0.5"),
])
def test_chip_yaml_takes_the_units_and_multipliers_set_takes(tmp_path, key, text):
    from sim.chips import load_chip

    path = tmp_path / "c.yaml"
    path.write_text(f"base: v5e\n{key}: {text}\n", encoding="utf-8")
    from_file = getattr(load_chip(str(path)), key)
    from_set = getattr(parse_overrides([f"{key}={text}"]).apply_chip(get_chip("v5e")), key)
    assert from_file == from_set
    assert from_file != getattr(get_chip("v5e"), key) or text in ("x1", "0.5")


def test_chip_yaml_multiplier_without_a_base_says_to_add_one(tmp_path):
    from sim.chips import load_chip

    path = tmp_path / "c.yaml"
    path.write_text("hbm_bytes_per_s: x2\n", encoding="utf-8")
    with pytest.raises(TpusimError, match=r"hbm_bytes_per_s = 'x2': a multiplier needs a base "
                                          r"preset .*add `base: v5e`"):
        load_chip(str(path))


@pytest.mark.parametrize("text,why", [("918Q", "not a number"), ("180GB/q", "not a number"),
                                      ("x0", "positive finite"), ("xabc", "not a number"),
                                      ("１８０GB/s", "not a number")])
def test_chip_yaml_refuses_the_texts_set_refuses_in_one_line(tmp_path, text, why):
    from sim.chips import load_chip

    path = tmp_path / "c.yaml"
    path.write_text(f"base: v5e\nici_link_bytes_per_s: '{text}'\n", encoding="utf-8")
    with pytest.raises(TpusimError, match=why) as file_err:
        load_chip(str(path))
    with pytest.raises(TpusimError, match=why):
        parse_overrides([f"ici_link_bytes_per_s={text}"])
    assert "\n" not in str(file_err.value)


def test_model_yaml_takes_multipliers_of_its_base_and_numbers_as_text(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("base: llama3-8b\nnum_layers: x2\nd_ff: '14336'\nvocab_size: '1e3'\n",
                    encoding="utf-8")
    from workloads.zoo import load_model

    m = load_model(str(path))
    base = MODELS.get("llama3-8b")
    via_set = parse_overrides(["model.num_layers=x2", "model.vocab_size=1e3"]).apply_model(base)
    assert (m.num_layers, m.d_ff, m.vocab_size) == (64, 14336, 1000)
    assert (via_set.num_layers, via_set.vocab_size) == (m.num_layers, m.vocab_size)


def test_model_yaml_multiplier_needs_a_base_and_a_whole_result(tmp_path):
    from workloads.zoo import load_model

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**TINY, "d_ff": "x2"}), encoding="utf-8")
    with pytest.raises(TpusimError, match=r"d_ff = 'x2': a multiplier needs a base model"):
        load_model(str(path))
    path.write_text("base: llama3-8b\nnum_layers: x1.1\n", encoding="utf-8")
    with pytest.raises(TpusimError, match=r"32 x 1.1 = 35.2 is not a whole number"):
        load_model(str(path))
