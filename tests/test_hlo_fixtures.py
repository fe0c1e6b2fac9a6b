"""The committed HLO fixtures (real XLA TPU compiles, validation/make_hlo_fixtures.py): each
inventory against numbers computed independently here — dot FLOPs from the program's
dimensions in closed form, collectives against the independent regex-based counter of
validation/xla_hlo_read.py — and the replay of each one."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from sim.chips import get_chip
from sim.engine.replay import replay
from tests.conftest import make_topology
from validation import make_hlo_fixtures, xla_hlo_read
from workloads.hlo.lower import import_hlo

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hlo"
POD = {"v5e:4x4": ("v5e", "4x4"), "v5e:2x4": ("v5e", "2x4"), "v5p:4x4x4": ("v5p", "4x4x4")}


def _crosscheck():
    return xla_hlo_read  # the cross-check's reader of compiled HLO


_CACHE: dict[str, tuple] = {}


def load(name: str):
    """(text, config, chip, topology, HloImport) of one fixture, imported once per session."""
    if name not in _CACHE:
        text = gzip.open(FIXTURES / f"{name}.hlo.txt.gz", "rt").read()
        cfg = json.loads(re.search(r"^// tpusim: config=(.*)$", text, re.M).group(1))
        chip_name, shape = POD[cfg["topology"]]
        chip = get_chip(chip_name)
        topo = make_topology(chip, shape)
        _CACHE[name] = (text, cfg, chip, topo, import_hlo(text, topology=topo, source=name))
    return _CACHE[name]


def params_per_layer(c: dict) -> int:
    d, hd = c["d_model"], c["head_dim"]
    return 2 * d * c["num_heads"] * hd + 2 * d * c["num_kv_heads"] * hd + 3 * d * c["d_ff"]


def train_dot_flops(c: dict) -> float:
    """Per chip: every weight matmul forward, rematerialized forward and two backward matmuls
    (8 x tokens x params), except the last matmul of each layer (w2), whose rematerialized
    forward is dead code (only its input is needed for the backward); attention scores and
    P.V (2 s^2 h hd per sequence each) forward, rematerialized and backward (x2); the
    unembedding forward and backward (6 x tokens x d x vocab); the embedding is a gather."""
    t = c["batch_per_chip"] * c["seq"]
    layers = c["num_layers"] * 2 * t * (4 * params_per_layer(c) - c["d_ff"] * c["d_model"])
    attn = c["num_layers"] * 8 * 2 * c["seq"] ** 2 * c["num_heads"] * c["head_dim"] * \
        c["batch_per_chip"]
    return layers + attn + 6 * t * c["d_model"] * c["vocab_size"]


TRAIN = ["train_fsdp_v5e16", "train_fsdp_tp_v5e16", "train_fsdp_v5p64", "train_fsdp_tp_v5p64",
         "scan_fsdp_v5e16"]
ALL = TRAIN + ["decode_tp8_v5e8", "windowed_einsum_v5e16", "spmd_windowed_einsum_v5e16"]


@pytest.mark.parametrize("name", TRAIN)
def test_train_step_dot_flops_match_the_closed_form(name):
    _text, cfg, _chip, _topo, imp = load(name)
    assert imp.inventory["dot_flops_per_chip"] == train_dot_flops(cfg)


def test_decode_dot_flops_match_the_closed_form():
    _text, c, _chip, _topo, imp = load("decode_tp8_v5e8")
    b, tp = c["batch_per_chip"] * c["num_chips"], c["mesh"]["tensor"]
    params = c["num_layers"] * params_per_layer(c) + c["d_model"] * c["vocab_size"]
    # Weight matmuls split over tensor; attention's P.V on the MXU against kv_len + 1 keys
    # (q.K for one query token is a multiply-reduce on the VPU, so it is not a dot).
    pv = c["num_layers"] * 2 * b * (c["kv_len"] + 1) * c["num_heads"] * c["head_dim"] // tp
    assert imp.inventory["dot_flops_per_chip"] == 2 * b * params // tp + pv


def test_scanned_layers_unroll_by_the_loop_trip_count():
    _text, c, _chip, _topo, imp = load("scan_fsdp_v5e16")
    # The layer scan is a while loop over the stacked weights; XLA gives no known_trip_count
    # here, so the induction variable finds it (num_layers), like every windowed-einsum loop.
    loops = imp.inventory["while_loops"]
    assert loops and all(lp["from"] == "induction variable" for lp in loops)
    assert {lp["trip_count"] for lp in loops} == {c["num_layers"]}


def test_windowed_einsum_dot_flops_and_ring_permutes():
    _text, c, _chip, _topo, imp = load("windowed_einsum_v5e16")
    t = c["batch_per_chip"] * c["seq"]
    # x @ w forward and the weight gradient x^T @ dy: 2 x 2 t d ff per chip.
    assert imp.inventory["dot_flops_per_chip"] == 2 * 2 * t * c["d_model"] * c["d_ff"]
    perm = [r for r in imp.inventory["collectives"] if r["kind"] == "collective-permute"]
    # The gather of w is a ring of one-hop permutes (make_mesh's snake ring on the 4x4).
    assert perm and all(r["axes"].startswith("pairs:") for r in perm)
    gid = {o.group for o in imp.trace.ops if o.collective == "collective-permute"}
    from topologies.groups import route_pairs

    _t, _c, _chip2, topo, _i = load("windowed_einsum_v5e16")
    for g in gid:
        _cls, hops = route_pairs(topo, imp.trace.meta.device_groups[g]["pairs"])
        assert hops == 1


def test_the_post_spmd_partitioning_dump_imports_with_its_plain_dots():
    # XLA's dump right after SPMD partitioning (metadata and source tables kept): plain dots,
    # one op per collective, a while loop of 8 steps. Each step's dot contracts both ring
    # directions' 64-row chunks (2 x 64, the other direction masked), which later passes
    # remove, so it holds 1.5x the optimized module's matmul FLOPs.
    _text, c, _chip, _topo, imp = load("spmd_windowed_einsum_v5e16")
    t, d, ff = c["batch_per_chip"] * c["seq"], c["d_model"], c["d_ff"]
    assert imp.inventory["while_loops"] == [
        {"name": "while", "trip_count": 8, "from": "induction variable"}]
    assert imp.inventory["dot_flops_per_chip"] == 8 * 2 * 2 * t * ff * 128 + 2 * t * d * ff
    assert imp.inventory["instructions_by_kind"]["dot"] == 3


@pytest.mark.parametrize("name", ALL)
def test_collectives_match_an_independent_count(name):
    text, _cfg, _chip, _topo, imp = load(name)
    ref: dict[str, list] = {}
    for o in _crosscheck().parse_hlo_collectives(text):
        r = ref.setdefault(o["kind"], [0, 0.0])
        r[0] += o["count"]
        r[1] += o["count"] * o["bytes"]
    got: dict[str, list] = {}
    for r in imp.inventory["collectives"]:
        g = got.setdefault(r["kind"], [0, 0.0, r["group_size"]])
        g[0] += r["executions"]
        # The cross-check counts an all-to-all's per-chip buffer; V is the whole array of the
        # group (group size x that).
        g[1] += r["bytes"] / (r["group_size"] if r["kind"] == "all-to-all" else 1)
    assert {k: v[:2] for k, v in got.items()} == ref
    inv = imp.inventory
    assert inv["num_collectives"] == sum(v[0] for v in ref.values())


@pytest.mark.parametrize("name", ALL)
def test_fixture_replays(name):
    _text, _cfg, chip, topo, imp = load(name)
    res = replay(imp.trace, chip, topo)
    bd = res.breakdown
    assert res.step_time_s == pytest.approx(sum(bd.values()))
    # The step cannot beat its MXU work at peak x efficiency, nor its HBM traffic.
    inv = imp.inventory
    assert res.step_time_s >= inv["dot_flops_per_chip"] / (
        chip.mxu_flops_per_s * chip.mxu_efficiency)
    assert res.step_time_s >= inv["hbm_bytes_per_chip"] / (
        chip.hbm_bytes_per_s * chip.hbm_efficiency)
    assert res.num_ops == inv["num_trace_ops"]


def test_import_hlo_cli_writes_a_trace_that_replays_like_the_program(tmp_path, capsys):
    from sim.cli import main

    prog = str(FIXTURES / "decode_tp8_v5e8.hlo.txt.gz")
    out = tmp_path / "d.trace"
    pod = ["--chip", "v5e", "--shape", "2x4"]
    assert main(["import-hlo", prog, *pod, "--json", "-o", str(out)]) == 0
    inv = json.loads(capsys.readouterr().out)
    assert inv["num_collectives"] == load("decode_tp8_v5e8")[4].inventory["num_collectives"]
    assert main(["--quiet", "replay", prog, *pod, "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert main(["--quiet", "replay", str(out), *pod, "--json"]) == 0
    via_file = json.loads(capsys.readouterr().out)
    assert direct["step_time_s"] == via_file["step_time_s"] > 0
    assert direct["dot_flops_per_chip"] == inv["dot_flops_per_chip"]
    assert direct["inputs"]["trace"]["kind"] == "hlo"


def test_a_slow_link_on_the_windowed_einsum_ring_slows_the_imported_step():
    from sim.engine.executors import simulate_chips
    from sim.engine.perchip import PerChipConfig

    _text, _cfg, chip, topo, imp = load("windowed_einsum_v5e16")
    base = replay(imp.trace, chip, topo).step_time_s
    link = topo.ici_link_id(topo.chip_id((0, 0)), 0, +1)  # on make_mesh's snake ring
    slow = simulate_chips(imp.trace, chip, topo,
                          config=PerChipConfig(link_factors={link: 0.25})).step_time_s
    assert slow > base * 1.2


@pytest.mark.parametrize("argv,message", [
    (["--only", "nosuch"], "--only nosuch: no fixture named nosuch; the fixtures are "),
    (["--topology", "v5p8x8x8"], "--topology v5p8x8x8: not a TPU topology name"),
    (["--mesh", "fsdp=16"], "--mesh goes with --topology"),
    (["--topology", "v5e:8x8", "--mesh", "fsdp"], "'fsdp' is not AXIS=SIZE"),
    (["--topology", "v5e:8x8", "--mesh", "fsdp=x"], "'fsdp=x' is not AXIS=SIZE"),
    (["--topology", "v5e:8x8", "--mesh", "fsdp=0"], "'fsdp=0' is not AXIS=SIZE"),
    (["--topology", "v5e:8x8", "--mesh", "fsdp=8,fsdp=8"], "each axis once"),
    (["--only", "train_fsdp_v5e16,train_fsdp_tp_v5e16", "--topology", "v5e:8x8", "--mesh",
      "fsdp=64"], "--mesh fsdp=64: train_fsdp_tp_v5e16's program shards over the axes "
                  "fsdp,tensor"),
])
def test_make_hlo_fixtures_refuses_bad_flags_in_one_line_before_compiling(argv, message):
    # Checked before jax is imported: a typo costs no compile and prints no traceback.
    with pytest.raises(SystemExit) as e:
        make_hlo_fixtures.parse_args(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_make_hlo_fixtures_reads_a_mesh_for_another_topology():
    args = make_hlo_fixtures.parse_args(
        ["--only", "train_fsdp_tp_v5p64", "--topology", "v5p:8x8x8", "--mesh",
         "fsdp=64, tensor=8"])
    assert args.names == ["train_fsdp_tp_v5p64"]
    assert args.mesh_axes == {"fsdp": 64, "tensor": 8}
