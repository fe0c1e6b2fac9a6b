"""Tests for sim/cli.py: `tpusim collective`, `compare-collectives` and `presets` in text and JSON,
agreement with the Python API, and one-line errors (exit code 2, no traceback).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sim.chips import (
    CHIPS,
    EFFICIENCY_FIELDS,
    chip_from_dict,
    efficiency_sources,
    get_chip,
    load_chip,
)
from sim.cli import build_parser, main, parse_bytes
from sim.cli.common import flag_spelling
from sim.collectives import CollectiveKind, algorithm_names, simulate_collective
from sim.energy import collective_energy, energy_summary
from sim.hardware import CHIP_FIELDS
from topologies.errors import TpusimError, render_said
from topologies.slices import SLICES, resolve_topology

JSON_FIELDS = ("time_s", "algorithm", "num_chips", "group_size", "bytes_on_busiest_link",
               "max_link_utilization")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *argv: str) -> dict:
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    assert err == ""
    return json.loads(out)


def _api(chip_name: str, shape: str | None = None, *, slice_name: str | None = None,
         wrap: str = "auto", slices: int = 1, **kw):
    chip = get_chip(chip_name)
    topology = resolve_topology(
        chip_name=chip.name, wrap_rule=chip.generation_rule, max_pod_shape=chip.max_pod_shape,
        slice_name=slice_name, shape=shape, wraparound=wrap, num_slices=slices,
    )
    return simulate_collective(chip=chip, topology=topology, **kw)


# -- parse_bytes ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [("33554432", 33554432), ("32MiB", 32 << 20), ("1GiB", 1 << 30), ("1.5KiB", 1536),
     ("10MB", 10_000_000), ("4.5e6", 4_500_000), ("2 kB", 2000), ("7B", 7), ("3 KB", 3000)],
)
def test_parse_bytes_understands_units(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "1.5", "0.3KiB", "nan", "inf", "MiB", "1Mb", "1Gib",
                                  "7b", "2 kb", "1mib", "-4096", "1e300", "1 PB"])
def test_parse_bytes_refuses_non_sizes(text):
    # The library names the Python argument; the CLI spells it as the flag.
    with pytest.raises(TpusimError, match="^bytes ") as caught:
        parse_bytes(text)
    assert caught.value.render(lambda name: "--" + name).startswith("--bytes ")


# -- collective ----------------------------------------------------------------------------
BOOK_ARGS = ("collective", "--chip", "v5e", "--shape", "8x4", "--op", "all-gather", "--axes",
             "y", "--bytes", "32MiB")


def test_collective_json_has_the_documented_fields_and_matches_the_api(capsys):
    d = _json(capsys, *BOOK_ARGS)
    for f in JSON_FIELDS:
        assert f in d, f
    r = _api("v5e", "8x4", op="all-gather", axes="y", nbytes=32 << 20)
    inputs = d.pop("inputs")
    # The result's fields, then its energy and cost (sim/energy.py's, on the same result);
    # refused candidates' reasons spelled as flags (`render_said`), as the CLI prints them.
    energy = energy_summary(collective_energy(r, get_chip("v5e")))
    spell = flag_spelling(build_parser(), "collective")
    assert d == json.loads(json.dumps(render_said({**r.to_dict(), **energy}, spell)))
    assert inputs["chip"] == get_chip("v5e").to_dict()
    assert d["bytes"] == 33554432
    assert d["num_chips"] == 32 and d["group_size"] == 4 and d["num_groups"] == 8
    assert d["time_s"] == pytest.approx(3 * (1e-6 + (32 << 20) / 4 / 4.5e10), rel=1e-9)
    assert d["bytes_on_busiest_link"] == 3 * (32 << 20) / 4
    assert 0 < d["max_link_utilization"] <= 1


def test_collective_text_reports_time_algorithm_and_pod(capsys):
    rc, out, err = _run(capsys, *BOOK_ARGS)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("all-gather over y on 8x4 v5e (32 chips, 8 group(s) of 4)")
    assert "33,554,432 B (32.00 MiB)" in lines[0]
    assert any("auto (multi-axis)" in ln for ln in lines)
    time_line = next(ln for ln in lines if ln.strip().startswith("time"))
    assert time_line.split()[1:3] == ["562.24", "us"]
    assert "(latency 3.00 us + bandwidth and contention 559.24 us)" in time_line  # 3 hops
    busiest = next(ln for ln in lines if "busiest link" in ln)
    assert "24.00 MiB" in busiest
    assert "full" in next(ln for ln in lines if "simulation" in ln)


def test_collective_on_a_named_slice(capsys):
    d = _json(capsys, "collective", "--slice", "v5p-128", "--op", "all-reduce", "--axes",
              "x,y,z", "--bytes", "64MiB")
    assert d["chip"] == "v5p" and d["topology"] == "4x4x4" and d["num_chips"] == 64
    assert d["mode"] == "symmetric"
    r = _api("v5p", slice_name="v5p-128", op="all-reduce", axes="x,y,z", nbytes=64 << 20)
    assert d["time_s"] == r.time_s


def test_collective_over_dcn_between_two_slices(capsys):
    d = _json(capsys, "collective", "--chip", "v5e", "--shape", "4x4", "--slices", "2", "--op",
              "all-gather", "--axes", "dcn", "--bytes", "32MiB")
    chip = get_chip("v5e")
    assert d["num_chips"] == 32 and d["group_size"] == 2 and d["num_groups"] == 16
    assert d["topology"] == "2x(4x4)" and d["axes"] == ["dcn"]
    # One DCN step: latency, one message's overhead, half the array through the NIC.
    assert d["time_s"] == pytest.approx(
        chip.dcn_latency_s + chip.dcn_message_overhead_s + (16 << 20) / chip.dcn_bytes_per_s,
        rel=1e-9)


def test_collective_send_between_corners(capsys):
    d = _json(capsys, "collective", "--chip", "v5e", "--shape", "4x4", "--op", "send", "--src",
              "0,0", "--dst", "3,3", "--bytes", "1MiB")
    # tpus Q5: 6 hops without wraparound, 2 dimension orders share the bytes.
    assert d["time_s"] == pytest.approx(6e-6 + (1 << 20) / (2 * 4.5e10), rel=1e-9)
    assert d["op"] == "send" and d["group_size"] == 2
    assert d["bytes_on_busiest_link"] == (1 << 20) / 2


def test_collective_permute_with_shift(capsys):
    d = _json(capsys, "collective", "--chip", "v5e", "--shape", "16x16", "--op",
              "collective-permute", "--shift", "2", "--axes", "x", "--bytes", "1MiB")
    assert d["time_s"] == pytest.approx(2e-6 + 2 * (1 << 20) / 4.5e10, rel=1e-9)
    assert d["bytes_on_busiest_link"] == 2 * (1 << 20)


def test_collective_with_a_slow_link_is_slower_and_matches_the_api(capsys):
    base = _json(capsys, *BOOK_ARGS)
    slow = _json(capsys, *BOOK_ARGS, "--slow-link", "0,0:y+:0.5")
    assert slow["time_s"] > base["time_s"]
    assert slow["mode"] == "full"
    r = _api("v5e", "8x4", op="all-gather", axes="y", nbytes=32 << 20,
             slow_links=("0,0:y+:0.5",))
    assert slow["time_s"] == r.time_s
    twice = _json(capsys, *BOOK_ARGS, "--slow-link", "0,0:y+:0.5", "--slow-link",
                  "0,0:y+:0.5")
    assert twice["time_s"] > slow["time_s"]  # repeated flags compound (0.25)


def test_collective_algorithm_and_wraparound_flags(capsys):
    d = _json(capsys, "collective", "--chip", "v5e", "--shape", "8x4", "--wraparound", "all",
              "--op", "all-gather", "--axes", "y", "--bytes", "32MiB", "--algorithm",
              "bidi-ring")
    assert d["algorithm"] == "bidi-ring" and d["algorithm_requested"] == "bidi-ring"
    assert d["time_s"] == pytest.approx((32 << 20) / 9e10 + 2e-6, rel=1e-9)  # 377 us case


def test_collective_mode_full_gives_the_same_time_as_symmetric(capsys):
    args = ("collective", "--chip", "v5e", "--shape", "16x16", "--op", "all-reduce", "--axes",
            "x,y", "--bytes", "16MiB")
    sym = _json(capsys, *args, "--mode", "symmetric")
    full = _json(capsys, *args, "--mode", "full")
    assert sym["mode"] == "symmetric" and full["mode"] == "full"
    assert full["time_s"] == pytest.approx(sym["time_s"], rel=1e-9)


# -- compare-collectives ---------------------------------------------------------------------
def test_compare_collectives_json_lists_every_algorithm(capsys):
    d = _json(capsys, "compare-collectives", "--chip", "v5e", "--shape", "8x4", "--op",
              "all-gather", "--axes", "y", "--bytes", "32MiB")
    assert d["op"] == "all-gather" and d["bytes"] == 32 << 20
    rows = {r["algorithm_requested"] if r["applicable"] else r["algorithm"]: r
            for r in d["results"]}
    assert list(rows) == algorithm_names(CollectiveKind.ALL_GATHER)
    for name in ("bidi-ring", "split-bidi-ring"):  # no wraparound on a v5e 4-axis
        assert rows[name]["applicable"] is False
        assert "wraparound" in rows[name]["reason"]
    ok = [r for r in d["results"] if r["applicable"]]
    assert min(r["vs_best"] for r in ok) == 1.0
    for r in ok:
        api = _api("v5e", "8x4", op="all-gather", axes="y", nbytes=32 << 20,
                   algorithm=r["algorithm_requested"])
        assert r["time_s"] == api.time_s
        assert r["vs_best"] == pytest.approx(r["time_s"] / min(x["time_s"] for x in ok))
    assert rows["line"]["time_s"] == rows["auto"]["time_s"]  # auto uses a line here


def test_compare_collectives_json_for_all_to_all_on_a_ring(capsys):
    d = _json(capsys, "compare-collectives", "--chip", "v5e", "--shape", "16x16", "--op",
              "all-to-all", "--axes", "x", "--bytes", "16MiB")
    names = [r.get("algorithm_requested", r["algorithm"]) for r in d["results"]]
    assert names == algorithm_names(CollectiveKind.ALL_TO_ALL)
    assert all(r["applicable"] for r in d["results"])


def test_compare_collectives_text_has_one_row_per_algorithm(capsys):
    rc, out, err = _run(capsys, "compare-collectives", "--chip", "v5e", "--shape", "8x4",
                        "--op", "all-gather", "--axes", "y", "--bytes", "32MiB")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("all-gather over y on 8x4 v5e")
    names = algorithm_names(CollectiveKind.ALL_GATHER)
    body = [ln[2:] for ln in lines[2:2 + len(names)]]
    assert [ln.split()[0] for ln in body] == names
    bidi = next(ln for ln in body if ln.startswith("bidi-ring"))
    split = next(ln for ln in body if ln.startswith("split-bidi-ring"))
    # The reason is a footnote, printed once for the two ring algorithms that share it.
    assert bidi.split()[1:] == ["n/a", "[1]"] and split.split()[1:] == ["n/a", "[1]"]
    notes = [ln for ln in lines if ln.startswith("[")]
    assert notes == ["[1] n/a: needs a ring, but axis y (size 4) has no wraparound; use line "
                     "or auto, or give --wraparound all (or include y)"]
    assert out.count("has no wraparound") == 1
    auto = next(ln for ln in body if ln.startswith("auto"))
    assert "562.24 us" in auto and "1.00x" in auto
    # Exactly one row is marked as auto's pick: multi-axis, which on one axis without
    # wraparound is the line (tied with line and hierarchical; the first candidate wins ties).
    marked = [ln for ln in lines[2:2 + len(names)] if ln.startswith("* ")]
    assert [ln.split()[1] for ln in marked] == ["multi-axis"]


def test_compare_collectives_shows_why_auto_picks_over_several_axes(capsys):
    """The issue's case: a 64 KiB all-reduce over x,y on a 16x16 v5e is latency bound. auto
    once took multi-axis (4 phases x 15 hops = 60 us of latency) though direct is faster; it
    now takes the fastest candidate, and every row splits its time into the latency term
    (hops x 1 us along the critical path) and the rest."""
    d = _json(capsys, "compare-collectives", "--chip", "v5e", "--shape", "16x16", "--op",
              "all-reduce", "--axes", "x,y", "--bytes", "64KiB")
    ok = {r["algorithm_requested"]: r for r in d["results"] if r["applicable"]}
    assert ok["auto"]["time_s"] == min(r["time_s"] for r in ok.values())
    assert ok["auto"]["time_s"] < ok["direct"]["time_s"] < ok["multi-axis"]["time_s"]
    assert d["auto_pick"] == ok["auto"]["algorithm"][len("auto ("):-1]
    assert [n for n, r in ok.items() if r["auto_pick"]] == [d["auto_pick"]]
    L = 1e-6
    # multi-axis: RS x, RS y, AG y, AG x, each a split ring of 15 hops; hierarchical: the same
    # with bidirectional rings of 8 hops; direct: two steps over routes of 8 + 8 hops.
    assert ok["multi-axis"]["latency_s"] == pytest.approx(60 * L, rel=1e-9)
    assert ok["hierarchical"]["latency_s"] == pytest.approx(32 * L, rel=1e-9)
    assert ok["direct"]["latency_s"] == pytest.approx(32 * L, rel=1e-9)
    for r in ok.values():
        assert r["latency_s"] + r["bandwidth_s"] == pytest.approx(r["time_s"], rel=1e-12)
        assert r["bandwidth_s"] > 0
    cands = {c["algorithm"]: c for c in ok["auto"]["auto_candidates"]}
    assert cands["hierarchical"]["time_s"] == ok["hierarchical"]["time_s"]
    assert cands["ring"]["time_s"] is None and "one axis" in cands["ring"]["reason"]
    for name, c in cands.items():  # simulated, or skipped by a lower bound that holds
        if c["time_s"] is not None:
            assert c["time_s"] == ok[name]["time_s"]
        elif "lower_bound_s" in c:
            assert ok["auto"]["time_s"] <= c["lower_bound_s"] <= ok[name]["time_s"]


def test_collective_text_names_auto_s_pick_and_splits_latency_from_bandwidth(capsys):
    rc, out, err = _run(capsys, "collective", "--chip", "v5e", "--shape", "16x16", "--op",
                        "all-reduce", "--axes", "x,y", "--bytes", "64KiB")
    assert rc == 0 and err == ""
    algo = next(ln for ln in out.splitlines() if ln.strip().startswith("algorithm"))
    assert "auto (hierarchical), the fastest of 4 applicable" in algo
    time_line = next(ln for ln in out.splitlines() if ln.strip().startswith("time"))
    assert "33.50 us (latency 32.00 us + bandwidth and contention 1.50 us)" in time_line


def test_compare_collectives_with_no_applicable_algorithm_is_an_error(capsys):
    rc, out, err = _run(capsys, "compare-collectives", "--chip", "v5e", "--shape", "4x4",
                        "--op", "collective-permute", "--axes", "x,y", "--bytes", "1024")
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: no algorithm applies")


@pytest.mark.parametrize("extra, message", [
    (("--op", "all-gather", "--axes", "x", "--chip-variation", "0.1"),
     "a collective is simulated on links only: --slow-chip, --chip-variation"),
    (("--op", "send", "--dst", "1,1"), "--op send needs --src and --dst"),
    (("--op", "all-gather"), "--op all-gather needs --axes"),
    (("--op", "all-gather", "--axes", "q"), "axis 'q' is not in the 4x4 topology"),
    (("--op", "all-reduce", "--axes", "x,x"), "axis 'x' is given twice in --axes"),
    (("--op", "all-reduce", "--axes", "dcn"), "axis 'dcn' needs several slices"),
    (("--op", "send", "--src", "0,0", "--dst", "9,9"), "chip coordinates (9, 9) are outside"),
    (("--op", "reduce-scatter", "--axes", "x", "--bytes", "1026"),
     "--bytes 1026 is not divisible by the group size 4"),
])
def test_compare_collectives_names_an_input_wrong_for_every_algorithm_as_it_is(
        capsys, extra, message):
    # Not "no algorithm applies ...": the input, not the algorithms, is what to fix.
    rc, out, err = _run(capsys, "compare-collectives", "--chip", "v5e", "--shape", "4x4",
                        "--bytes", "1MiB", *extra)
    assert rc == 2 and out == ""
    assert err.startswith(f"tpusim: error: {message}"), err


# -- presets --------------------------------------------------------------------------------
def test_presets_json_lists_every_chip_and_slice(capsys):
    d = _json(capsys, "presets")
    chips = {c["name"]: c for c in d["chips"]}
    assert list(chips) == CHIPS.names()
    assert chips["v5e"]["ici_link_bytes_per_s"] == 4.5e10
    assert chips["v5p"]["max_pod_shape"] == [16, 20, 28]
    assert chips["v4"]["generation_rule"] == "cube"
    # Exactly the chip YAML keys, so every entry is a chip file (ocs_hop_latency_s and
    # mxu_fp8_ops_per_s are listed only when set, ocs_reconfiguration_s only off its default:
    # no preset sets them).
    for name, c in chips.items():
        assert list(c) == [f for f in CHIP_FIELDS
                           if f not in ("ocs_hop_latency_s", "mxu_fp8_ops_per_s",
                                        "ocs_reconfiguration_s")]
        assert chip_from_dict(c) == get_chip(name)
    slices = {s["name"]: s for s in d["slices"]}
    assert list(slices) == SLICES.names()
    assert slices["v5p-128"] == {"name": "v5p-128", "chip": "v5p", "shape": "4x4x4",
                                 "num_chips": 64, "wraparound": "xyz"}
    assert slices["v5e-256"]["wraparound"] == "xy"
    assert slices["v5e-128"]["wraparound"] == "y"
    assert slices["v5e-16"]["wraparound"] == "none"


def test_presets_text_has_a_row_per_chip_and_slice(capsys):
    rc, out, err = _run(capsys, "presets")
    assert rc == 0 and err == ""
    rows: dict[str, str] = {}
    for ln in out.splitlines():
        if ln.strip():
            rows.setdefault(ln.split()[0], ln)  # a chip's first line is its row of the table
    for name in CHIPS.names():
        assert name in rows
    assert rows["v5p"].split()[-1] == "16x20x28"
    v5e = get_chip("v5e").mxu_efficiency
    assert f"v5e mxu_efficiency = {v5e:g}: fitted" in out
    assert f"v5p mxu_efficiency = {v5e:g}: carried over" in out
    assert "v5e dcn_message_overhead_s" in out
    assert rows["v5e-256"].split() == ["v5e-256", "v5e", "16x16", "256", "xy"]
    assert "one link, one direction" in out


def test_presets_json_of_one_chip_is_a_chip_file_that_loads_back(capsys, tmp_path):
    rc, out, err = _run(capsys, "presets", "--json", "--chip", "v5p")
    assert rc == 0 and err == ""
    path = tmp_path / "my.yaml"
    path.write_text(out)
    assert load_chip(str(path)) == get_chip("v5p")
    # Edit one number: the file still loads, and presets marks that factor as given.
    data = json.loads(out)
    data["hbm_efficiency"] = 0.9
    path.write_text(json.dumps(data))
    assert load_chip(str(path)).hbm_efficiency == 0.9
    assert efficiency_sources(load_chip(str(path)))["hbm_efficiency"]["kind"] == "given"


def test_every_preset_efficiency_factor_says_where_it_came_from(capsys):
    sources = _json(capsys, "presets")["efficiency_sources"]
    assert list(sources) == CHIPS.names()
    for name, src in sources.items():
        assert list(src) == list(EFFICIENCY_FIELDS)
        for field, e in src.items():
            assert e["value"] == getattr(get_chip(name), field)
            assert e["kind"] in ("fitted", "carried over", "assumed") and e["source"]
            # A factor away from the roofline is never merely assumed.
            if e["kind"] == "assumed":
                assert e["value"] == (0.0 if field.endswith("overhead_s") else 1.0)
    assert sources["v5e"]["mxu_efficiency"]["kind"] == "fitted"
    assert sources["v6e"]["mxu_efficiency"]["kind"] == "fitted"
    assert sources["v5p"]["mxu_efficiency"]["kind"] == "carried over"
    assert "validation.md" in sources["v5e"]["mxu_efficiency"]["source"]


# -- errors ---------------------------------------------------------------------------------
def _bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base: [v5e\n  hbm: : :\n", encoding="utf-8")
    return str(path)


BASE = ("collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather")
ERRORS = {
    "unknown chip": (("collective", "--chip", "v9", "--shape", "4x4", "--op", "all-gather",
                      "--axes", "x", "--bytes", "1024"), "unknown chip 'v9'"),
    "unknown slice": (("collective", "--slice", "v5p-999", "--op", "all-gather", "--axes", "x",
                       "--bytes", "1024"), "unknown slice 'v5p-999'"),
    "shape/slice size mismatch": (("collective", "--slice", "v5p-128", "--shape", "4x4x8",
                                   "--op", "all-gather", "--axes", "x", "--bytes", "1024"),
                                  "has 128 chips but slice v5p-128 has 64"),
    "axis not in topology": ((*BASE, "--axes", "z", "--bytes", "1024"), "axis 'z'"),
    "zero bytes": ((*BASE, "--axes", "x", "--bytes", "0"), "must be > 0"),
    "negative bytes": ((*BASE, "--axes", "x", "--bytes", "-4"), "must be > 0"),
    "bytes not divisible": ((*BASE, "--axes", "x", "--bytes", "1022"), "not divisible"),
    "bidi-ring without wraparound": ((*BASE, "--axes", "x", "--bytes", "1024", "--algorithm",
                                      "bidi-ring"), "no wraparound"),
    "missing --bytes": ((*BASE, "--axes", "x"), "--bytes"),
    "missing --axes": ((*BASE, "--bytes", "1024"), "--axes"),
    "bad size": ((*BASE, "--axes", "x", "--bytes", "lots"), "is not a size"),
    "shape too big": (("collective", "--chip", "v5e", "--shape", "32x4", "--op", "all-gather",
                       "--axes", "x", "--bytes", "1024"), "does not fit"),
    "unknown op": (("collective", "--chip", "v5e", "--shape", "4x4", "--op", "gather", "--axes",
                    "x", "--bytes", "1024"), "unknown --op"),
    "unknown algorithm": ((*BASE, "--axes", "x", "--bytes", "1024", "--algorithm", "warp"),
                          "unknown collective algorithm"),
    "send without --dst": (("collective", "--chip", "v5e", "--shape", "4x4", "--op", "send",
                            "--src", "0,0", "--bytes", "1024"), "--dst"),
    "send to too few coordinates": (("collective", "--chip", "v5e", "--shape", "4x4", "--op",
                                     "send", "--src", "0", "--dst", "3,3", "--bytes", "1024"),
                                    "coordinates"),
    "bad slow link": ((*BASE, "--axes", "x", "--bytes", "1024", "--slow-link", "3,0:x+:0.5"),
                      "has no x+ link"),
    "bad wraparound": ((*BASE, "--axes", "x", "--bytes", "1024", "--wraparound", "q"),
                       "--wraparound"),
    "unknown command": (("teleport",), "unknown command 'teleport'"),
    "misspelt command": (("trian",), "unknown command 'trian'; did you mean train?"),
    "misspelt choice": (("collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather",
                         "--axes", "x", "--bytes", "1MiB", "--mode", "fulll"),
                        "unknown --mode 'fulll'; use one of: auto, symmetric, full, per-chip"),
    "bad --slices": ((*BASE, "--axes", "x", "--bytes", "1024", "--slices", "two"),
                     "--slices"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_is_one_error_line_and_exit_code_2(capsys, case):
    argv, match = ERRORS[case]
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.startswith("tpusim: error: ")
    assert err.count("\n") == 1 and err.endswith("\n")
    assert "Traceback" not in err
    assert match in err


def test_malformed_chip_yaml_is_one_error_line(capsys, tmp_path):
    path = _bad_yaml(tmp_path)
    rc, out, err = _run(capsys, "collective", "--chip", path, "--shape", "4x4", "--op",
                        "all-gather", "--axes", "x", "--bytes", "1024")
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: chip file")
    assert "not valid YAML" in err and err.count("\n") == 1


def test_chip_yaml_unknown_key_is_one_error_line(capsys, tmp_path):
    path = tmp_path / "chip.yaml"
    path.write_text("base: v5e\nwarp: 9\n", encoding="utf-8")
    rc, out, err = _run(capsys, "collective", "--chip", str(path), "--shape", "4x4", "--op",
                        "all-gather", "--axes", "x", "--bytes", "1024")
    assert rc == 2 and err.count("\n") == 1 and "unknown key(s) warp" in err


def test_custom_chip_yaml_drives_the_simulation(capsys, tmp_path):
    path = tmp_path / "fast.yaml"
    path.write_text("base: v5e\nici_link_bytes_per_s: 9.0e+10\n", encoding="utf-8")
    fast = _json(capsys, *BOOK_ARGS[:2], str(path), *BOOK_ARGS[3:])
    base = _json(capsys, *BOOK_ARGS)
    assert fast["chip"] == "v5e-custom"
    assert fast["time_s"] - 3e-6 == pytest.approx((base["time_s"] - 3e-6) / 2, rel=1e-9)


def test_collective_whose_buffers_exceed_hbm_warns_but_answers(capsys):
    # 64 GiB all-gathered over 4 chips: each holds 16 GiB in + 64 GiB out, over v5e's 16 GB.
    rc = main(["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather",
               "--axes", "x", "--bytes", "64GiB", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out)["time_s"] > 0
    assert err.startswith("tpusim: warning: the all-gather buffers take 80.00 GiB per chip")
    rc = main(["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather",
               "--axes", "x", "--bytes", "64MiB", "--json"])
    assert rc == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["--bytes", "1Mb"], "--bytes '1Mb' is not a size"),
    (["--axes", "x,,y"], "--axes 'x,,y' has an empty item"),
    (["--slices", "1000000"],
     "--slices 1000000 is out of range; give a whole number in [1, 1,024]"),
    (["--chunks", "1000000000"], "--chunks 1000000000 is out of range"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_flag_errors_state_the_rule_once_without_a_doubled_prefix(capsys, argv, message):
    base = {"--bytes": "1MiB", "--axes": "x"}
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    args = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather"]
    for k, v in {**base, **flags}.items():
        args += [k, v]
    if argv == ["--frobnicate"]:
        args.append("--frobnicate")
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("tpusim: error: ") and "tpusim: error: tpusim" not in err
    assert "error: tpusim collective:" not in err
    assert message in err


def test_demo_report_states_the_sequence_length_and_batch_it_simulated(capsys, tmp_path):
    rc, out, err = _run(capsys, "demo", "--out", str(tmp_path / "demo"))
    assert rc == 0, err
    head = out.splitlines()[0]
    assert head == ("llama3-8b, sequence length 2,048, global batch 16 (1 per chip, 32,768 "
                    "tokens per step), remat full, flash attention")
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["inputs"]["training"]["seq_len"] == 2048
    assert summary["inputs"]["training"]["global_batch"] == 16


def test_demo_json_is_its_summary_and_carries_its_inputs(capsys, tmp_path):
    rc, out, err = _run(capsys, "demo", "--out", str(tmp_path / "demo"), "--json")
    assert rc == 0, err
    printed = json.loads(out)
    assert printed == json.loads((tmp_path / "demo" / "summary.json").read_text())
    inputs = printed["inputs"]
    assert inputs["command"] == "demo" and inputs["tpusim_version"]
    assert inputs["chip"] == get_chip("v5e").to_dict()
    assert inputs["topology"]["shape"] == [4, 4] and inputs["model"]["name"] == "llama3-8b"
    assert inputs["mesh"]["ici"] == {"fsdp": 4, "tensor": 4}
    assert inputs["training"]["seq_len"] == 2048 and inputs["training"]["remat"] == "full"
    assert inputs["collective_comparison"]["topology"]["shape"] == [16, 16]
    assert printed["training_step"]["num_chips"] == 16


def test_simulating_commands_register_pod_quiet_and_set_in_one_order():
    """`sim.cli.common.add_command` builds every simulating command the same way: its
    positional argument, the pod group (--chip, --slice, --shape, --wraparound, --slices,
    --twist), --quiet, then --set (where the command takes what-if overrides), then its own
    flags."""
    from sim.cli import build_parser

    pod = ["--chip", "--slice", "--shape", "--wraparound", "--slices", "--twist", "--quiet"]
    commands = build_parser().get_default("commands")
    checked = []
    for name, sp in commands.items():
        flags = [a.option_strings[-1] for a in sp._actions if a.option_strings][1:]  # no -h
        if "--chip" not in flags or name in ("presets", "compile", "make-hlo-fixture"):
            # presets has no pod; compile puts --chips between pod and --set; make-hlo-fixture
            # compiles with jax and simulates nothing (its pod is jax's topology: no
            # --wraparound, --slices, --set)
            continue
        assert flags[:len(pod)] == pod, name
        has_set = "--set" in flags
        assert has_set == (name not in ("import-hlo",)), name
        if has_set:
            assert flags[len(pod)] == "--set", name
        assert sp.get_default("func") is not None, name
        checked.append(name)
    assert sorted(checked) == sorted(["collective", "compare-collectives", "train", "replay",
                                      "export", "decode", "prefill", "serve-sweep", "serve", "plan",
                                      "plan-serve",
                                      "import-hlo", "topology", "goodput"])


@pytest.mark.parametrize("shape,mesh,noted", [("8x8", "fsdp=64", True), ("4x8", "fsdp=32", False),
                                              ("8x8", "fsdp=32,data=2", False)])
def test_train_notes_a_windowed_ring_longer_than_xla_ever_windows(capsys, shape, mesh, noted):
    argv = ("train", "--chip", "v6e", "--shape", shape, "--model", "llama3-8b", "--set",
            "model.num_layers=1", "--seq-len", "512", "--batch-per-chip", "1", "--mesh", mesh,
            "--fsdp-gather", "windowed", "--quiet")
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    note = [line for line in out.splitlines() if line.startswith("note: --fsdp-gather windowed")]
    assert note == (["note: --fsdp-gather windowed over 64 chips: XLA builds no windowed "
                     "einsum over more than 32 (docs/model.md \"Collectives as XLA emits them\"); "
                     "--fsdp-gather mixed-async (v5e) or mixed-blocking (v5p, v6e) models what it "
                     "compiles"] if noted else [])
    # Never inside --json output; never for the mixed modes, which follow XLA's rule.
    _json(capsys, *argv)
    rc, out, _ = _run(capsys, *argv[:-2], "mixed-blocking", "--quiet")
    assert rc == 0 and "note: --fsdp-gather" not in out


@pytest.mark.parametrize("shape,mesh,flags,ring", [
    ("8x8", "fsdp=64", (), 64),  # the default reduce-scatters over 64 chips
    ("4x8", "fsdp=32", (), 0),
    ("8x8", "fsdp=32,data=2", (), 0),
    ("8x8", "fsdp=64", ("--fsdp-grad", "auto"), 0),  # all-reduced whole, as XLA does
    ("8x8", "fsdp=64", ("--fsdp-gather", "mixed-blocking"), 0),
    ("8x8", "fsdp=64", ("--fsdp-gather", "mixed-blocking", "--no-overlap"), 64),
])
def test_train_notes_gradients_reduce_scattered_over_more_chips_than_xla_does(capsys, shape,
                                                                                mesh, flags,
                                                                                ring):
    # v6e's preset MXU factor was fitted with --fsdp-grad auto: a default run over FSDP groups
    # of more than 32 chips reduce-scatters what XLA all-reduces whole, and says so.
    argv = ("train", "--chip", "v6e", "--shape", shape, "--model", "llama3-8b", "--set",
            "model.num_layers=1", "--seq-len", "512", "--batch-per-chip", "1", "--mesh", mesh,
            *flags, "--quiet")
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    note = [line for line in out.splitlines() if line.startswith("note: weight gradients")]
    assert note == ([f"note: weight gradients reduce-scattered over {ring} chips, the default "
                     "--fsdp-grad (v5e's fitted 2023 runs reduce-scattered); XLA (jax/libtpu "
                     "0.10.2) all-reduces them whole over more than 32, as --fsdp-grad auto "
                     "models (v6e's preset MXU factor was fitted with auto)"]
                    if ring else [])
    # The report comes first: the note is after it, on one line.
    if ring:
        assert out.splitlines()[0].startswith("llama3-8b training step on ")
        assert out.splitlines()[-1] == note[0]
    # Never inside --json output.
    _json(capsys, *argv)


def test_every_help_text_closes_the_parentheses_and_backquotes_it_opens():
    """Help texts are wrapped prose: an unbalanced `(`/`)` or backquote is a leftover of an edit
    (`plan --exhaustive`'s help once ended in a stray `)`). Intervals such as `(0, 1e6]` are
    notation, not parentheses."""
    import argparse
    import re

    from sim.cli import build_parser

    interval = re.compile(r"[(\[][-+\d.e]+, *[-+\d.e]+[)\]]")
    checked, bad = 0, []
    for name, sp in build_parser().get_default("commands").items():
        for action in sp._actions:
            text = action.help
            if not text or text == argparse.SUPPRESS:
                continue
            checked += 1
            depth, low = 0, 0
            for ch in interval.sub("", text):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                low = min(low, depth)
            if depth or low or text.count("`") % 2:
                bad.append((name, action.option_strings, text))
    assert checked > 200 and bad == []


_TRAIN = ("train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--set",
          "model.num_layers=1", "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "fsdp=4")
_DECODE = ("decode", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--set",
           "model.num_layers=1", "--batch", "4", "--context-len", "128", "--mesh", "tensor=4")
_COLLECTIVE = ("collective", "--chip", "v5e", "--shape", "4x4", "--axes", "x", "--bytes", "1MiB")


@pytest.mark.parametrize("base, flag", [
    *((_TRAIN, f) for f in ("--attention", "--fsdp-gather", "--tp-activations", "--tp-comm",
                            "--dp-allreduce", "--fsdp-grad", "--dp-grad-split",
                            "--pipeline-schedule", "--remat",
                            "--optimizer")),
    *((_DECODE, f) for f in ("--sampling", "--weight-dtype", "--kv-dtype")),
    (_COLLECTIVE, "--op"),
])
def test_a_long_bad_choice_is_named_cut_short_in_a_one_line_error(capsys, base, flag):
    # A 5,000-character value is quoted cut (short_repr), not whole: the line names the flag
    # and the choices, well under the CLI's 2,000-character cap.
    rc, out, err = _run(capsys, *base, flag, "x" * 5000)
    assert rc == 2 and out == "" and err.count("\n") == 1, err[:300]
    assert flag in err and "xxxx" in err and len(err) < 400, err[:300]


# -- numbers as written (fuzz8) ------------------------------------------------------------
_TINY_TRAIN = ("train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--set",
               "model.num_layers=1", "--seq-len", "128", "--batch-per-chip", "1")


@pytest.mark.parametrize("argv, named", [
    ((*_TRAIN, "--seed", "-inf"), "--seed '-inf'"),
    ((*_TRAIN, "--chip-variation", "-inf"), "--chip-variation '-inf' is not finite"),
    ((*_TRAIN, "--seq-len", "-1e5"), "--seq-len '-1e5' is not a whole number"),
    ((*_COLLECTIVE, "--op", "collective-permute", "--shift", "-nan"),
     "--shift '-nan' is not a whole number"),
    # A flag abbreviated as argparse allows (a unique prefix) takes its dashed number too.
    ((*_TRAIN, "--see", "-inf"), "--seed '-inf'"),
    ((*_TRAIN, "--seq", "-1e5"), "--seq-len '-1e5' is not a whole number"),
])
def test_a_dashed_number_after_a_flag_is_its_value_and_the_error_names_it(capsys, argv, named):
    # argparse reads -inf, -nan and -1e5 as unknown flags ("argument --seed: expected one
    # argument": neither the value nor the fix); they are the flag's value, and its own check
    # quotes them.
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert named in err and "expected one argument" not in err, err


@pytest.mark.parametrize("argv, named", [
    ((*_TRAIN, "--seed", "１"), "--seed '１' is not a whole number in ASCII digits"),
    ((*_TRAIN, "--seed", "1_0"), "--seed '1_0' is not a whole number in ASCII digits"),
    ((*_TRAIN, "--chip-variation", "0_1"), "--chip-variation '0_1' is not a number"),
    ((*_TRAIN, "--slow-chip", "０,0:0.5"), "chip coordinates '０,0' must be integers"),
    ((*_TRAIN, "--slow-link", "0,0:x+:0_5"), "factor '0_5' is not a number"),
    ((*_TRAIN, "--set", "hbm_bytes=x１"), "'１' is not a number"),
    ((*_TRAIN, "--set", "model.d_ff=１０２４"), "--set model.d_ff=１０２４: not a number"),
    ((*_TINY_TRAIN, "--mesh", "fsdp=４"), "size '４' of fsdp is not an integer"),
    (("train", "--chip", "v5e", "--shape", "２x2", *_TRAIN[5:]), "shape '２x2' is not like"),
    (("train", "--chip", "v5e", "--shape", "2_2", *_TRAIN[5:]), "shape '2_2' is not like"),
    ((*_TRAIN, "--perfetto", "/dev/null", "--trace-chips", "０-1"), "--trace-chips '０-1'"),
    ((*_COLLECTIVE, "--op", "send", "--src", "０,0", "--dst", "1,0"), "--src '０,0'"),
    # Two signs are no number either: the flag's own check names it and the range (argparse's
    # "invalid integer value" named neither).
    ((*_TRAIN, "--seq-len=+-5"), "--seq-len '+-5' is not a whole number; give a whole number in"),
])
def test_numbers_in_flags_are_read_in_ascii_digits_only(capsys, argv, named):
    # Python's int() and float() read a full-width "１" and underscores ("0_5" is 5.0, "2_2"
    # is 22): each of these was once taken as that number; now each is a one-line error.
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert named in err, err


def test_ascii_number_readers_take_plain_numbers_and_nothing_else():
    from topologies.validate import ascii_float, ascii_int

    assert ascii_int(" +42 ") == 42 and ascii_int("-7") == -7 and ascii_int("0" * 30) == 0
    assert ascii_float("1e3") == 1000.0 and ascii_float(".5") == 0.5 and ascii_float("-2.") == -2
    assert math.isinf(ascii_float("-inf")) and math.isnan(ascii_float("NaN"))
    for bad in ("１", "1_0", "", "1e", "0x10", "1" * 31, "٣", "1 0", "+-5", "--5"):
        with pytest.raises(ValueError):
            ascii_int(bad)
    for bad in ("１.5", "0_5", "", "e5", "1e5e5", "1,5", "infinit", "0x1p3"):
        with pytest.raises(ValueError):
            ascii_float(bad)


def test_compile_checks_the_seed_range_as_the_simulating_commands_do(capsys, tmp_path):
    argv = ("compile", "--chips", "4", "--model", "mixtral-8x7b", "--set", "model.num_layers=1",
            "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "expert=4", "-o",
            str(tmp_path / "t.trace"), "--expert-skew", "1")
    for seed in ("-1", str(2**63), "9" * 40):
        rc, out, err = _run(capsys, *argv, "--seed", seed)
        assert rc == 2 and err.count("\n") == 1, err
        assert "give a whole number in [0, 2^63)" in err, err
    assert not (tmp_path / "t.trace").exists()
    rc, out, err = _run(capsys, *argv, "--seed", str(2**63 - 1))
    assert rc == 0, err


def test_a_non_finite_perturbation_flag_is_quoted_as_given(capsys):
    # float("1e400") is inf: the error names the 1e400 that was typed, and the range.
    for flag, rng in (("--chip-variation", "[0, 1]"), ("--expert-skew", "[0, 100]"),
                      ("--capacity-factor", "(0, 1e6]")):
        rc, out, err = _run(capsys, *_TRAIN, flag, "1e400")
        assert rc == 2 and err.count("\n") == 1, err
        assert f"{flag} '1e400' is not finite; give a finite number in {rng}" in err, err


def test_a_batch_per_chip_under_one_sequence_per_pod_is_refused_naming_the_flag(capsys):
    # 1e-320 x 4 chips rounds to 0 sequences, which once surfaced as "tokens=0 must be a
    # positive number" (no flag named).
    base = [a for a in _TINY_TRAIN if a not in ("--batch-per-chip", "1")]
    for b in ("1e-320", "1e-10", "0.1"):
        rc, out, err = _run(capsys, *base, "--batch-per-chip", b, "--mesh", "tensor=4")
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"tpusim: error: --batch-per-chip {float(b):g} x 4 chips"), err
    rc, out, err = _run(capsys, *base, "--batch-per-chip", "0.25", "--mesh", "tensor=4")
    assert rc == 0, err


def test_an_output_that_is_an_input_file_is_refused_before_anything_runs(tmp_path, capsys):
    # `tpusim export t.trace --perfetto t.trace` replaced the trace it had just read with the
    # Perfetto output, and `compile --model m.yaml -o m.yaml` the model (hard10).
    model = tmp_path / "m.yaml"
    model.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    (tmp_path / "same.yaml").hardlink_to(model)  # another name for the same file
    trace = tmp_path / "t.trace"
    compile_ = ["compile", "--chips", "4", "--model", str(model), "--seq-len", "128",
                "--batch-per-chip", "1", "--mesh", "fsdp=4"]
    assert main([*compile_, "-o", str(trace)]) == 0
    capsys.readouterr()
    kept = {p: p.read_bytes() for p in (model, trace)}
    pod = ["--chip", "v5e", "--shape", "2x2", "--quiet"]
    train = ["train", *pod, "--model", str(model), "--seq-len", "128", "--batch-per-chip", "1",
             "--mesh", "fsdp=4"]
    for argv, what in [
            (["export", str(trace), *pod, "--perfetto", str(trace)], "the trace file"),
            (["replay", str(trace), *pod, "--perfetto", f"{tmp_path}/./t.trace"],
             "the trace file"),
            ([*compile_, "-o", str(model)], "the --model file"),
            ([*compile_, "-o", str(tmp_path / "same.yaml")], "the --model file"),
            ([*train, "--perfetto", str(model)], "the --model file")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"would overwrite {what} " in err, err
        assert "which this command reads; give the output another name" in err
    assert {p: p.read_bytes() for p in kept} == kept


def test_compile_never_writes_a_trace_larger_than_replay_reads(tmp_path, capsys, monkeypatch):
    # A 239,934-op LLaMA-3-405B step (inside the 250,000-op limit) compiled to 41 MB, over the
    # 32 MiB a trace file may hold: `compile -o` wrote what `replay` refused (hard10). Here the
    # limit is lowered under a tiny step's size.
    import topologies.validate as validate

    out = tmp_path / "t.trace"
    argv = ["compile", "--chips", "4", "--model", "llama3-8b", "--set", "model.num_layers=2",
            "--seq-len", "128", "--batch-per-chip", "1", "--mesh", "fsdp=4", "-o", str(out)]
    assert main(argv) == 0
    size = out.stat().st_size
    out.unlink()
    capsys.readouterr()
    monkeypatch.setattr(validate, "MAX_TRACE_FILE_BYTES", size - 1)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"tpusim: error: -o: the trace is {size:,} bytes, over the {size - 1:,} a "
                   f"trace file may hold (replay would refuse it), so nothing was written; use "
                   f"fewer --microbatches or layers, or simulate the step with `tpusim train` "
                   f"(no trace file)\n")
    assert not out.exists()


@pytest.mark.parametrize("argv", [[], ["--quiet"]])
def test_bare_tpusim_is_one_error_line_on_stderr(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == ("tpusim: error: no command given; run `tpusim --help` for the commands, "
                   "e.g. `tpusim train --help`\n")


def test_import_hlo_output_empty_is_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hlo = Path(__file__).parent / "fixtures/hlo/windowed_einsum_v5e16.hlo.txt.gz"
    rc = main(["import-hlo", str(hlo),
               "--chip", "v5e", "--shape", "4x4", "-o", ""])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err == "tpusim: error: -o '' is empty; give a path\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,says,never", [
    ("step.hlo.txt.gz", "step.hlo.txt.gz' does not exist; HLO text is what XLA compiles",
     "tpusim compile"),
    ("module.hlo.txt", "`tpusim make-hlo-fixture` compiles one", "tpusim compile"),
    ("step.trace", "step.trace' does not exist; write one with `tpusim compile",
     "make-hlo-fixture"),
    ("step.pftrace", "a Perfetto trace is what --perfetto writes", "make-hlo-fixture"),
])
def test_replay_of_a_missing_file_hints_at_what_makes_that_kind_of_file(capsys, tmp_path, name,
                                                                        says, never):
    rc, out, err = _run(capsys, "replay", str(tmp_path / name), "--chip", "v5e", "--shape", "4x4")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert says in err and never not in err
    assert err.startswith("tpusim: error: HLO file " if ".hlo" in name else
                          "tpusim: error: trace file ")


# -- one command's parser ------------------------------------------------------------------------
ONE_COMMAND_LINES = [
    ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x",
     "--bytes", "1MiB"],
    ["--quiet", "train", "--chip", "v5e", "--shape", "4x4", "--model", "llama3-8b",
     "--seq-len", "4096", "--batch-per-chip", "1", "--mesh", "fsdp=16", "--set",
     "ici_link_bytes_per_s=x2"],
    ["decode", "--slice", "v5e-8", "--model", "llama3-8b", "--batch", "8", "--context-len",
     "1024", "--mesh", "tensor=8"],
    ["plan", "--serve", "--slice", "v5e-8", "--model", "llama3-8b", "--slo", "ttft=0.5"],
    ["presets", "--json"],
    ["rerun", "result.json", "--check"],
]


@pytest.mark.parametrize("argv", ONE_COMMAND_LINES, ids=lambda a: a[0] if a[0] != "--quiet"
                         else a[1])
def test_a_command_line_parses_the_same_with_its_command_alone(argv):
    """`main` builds only the named command's parser (`parser_for`): the namespace is the full
    parser's, field for field (the oracle), and no other command's parser is built."""
    from sim.cli import parse, parser_for

    one, full = parser_for(argv), build_parser()
    got, want = vars(parse(argv, parser=one)), vars(parse(argv, parser=full))
    assert len(one.get_default("commands")) == 1
    for d in (got, want):
        d.pop("parser"), d.pop("commands")
    assert got == want


def test_a_misspelt_command_gets_the_whole_parser_and_its_suggestion(capsys):
    from sim.cli import parser_for

    assert len(parser_for(["trian", "--chip", "v5e"]).get_default("commands")) > 20
    assert len(parser_for(["--help"]).get_default("commands")) > 20
    assert main(["trian", "--chip", "v5e"]) == 2
    assert "train" in capsys.readouterr().err
