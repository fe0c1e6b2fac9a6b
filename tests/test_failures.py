"""Failed chips and spare cubes (issue 27): on a v4/v5p slice of whole cubes with a spare, the
optical switches swap the failed chip's cube and the step runs as on the healthy slice (plus a
one-time reconfiguration); without a spare, with --no-ocs or without switches, the chip's links
are dead and routes detour around it, refused where the chip itself is needed; bad input is
one line."""

from __future__ import annotations

import json

import pytest

from sim.chips import get_chip
from sim.cli import main
from tests.conftest import make_topology
from topologies.errors import TpusimError
from topologies.scenario import Scenario, parse_failed_chip, scenario_from_dict


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _failures(*chips, spares=0, no_ocs=False):
    return Scenario(failed_chips=tuple(parse_failed_chip(c) for c in chips), spare_cubes=spares,
                    no_ocs=no_ocs)


def test_a_spare_swaps_the_failed_chips_cube_and_leaves_no_dead_link():
    topo = make_topology(get_chip("v4"), "4x4x8")
    f = _failures("1,2,5", "2,2,6", "0,0,0", spares=2).failures_for(topo)
    # 1,2,5 and 2,2,6 share cube (0,0,1); 0,0,0 is in cube (0,0,0): two cubes, two spares.
    assert f.swapped_cubes == ((0, 0, 0, 1), (0, 0, 0, 0)) and f.routed_chips == ()
    assert f.action == "cube swap" and f.spares_left == 0
    assert _failures("1,2,5", spares=1).dead_link_ids_for(topo) == ()


def test_without_a_spare_every_link_into_and_out_of_the_chip_is_dead():
    topo = make_topology(get_chip("v4"), "4x4x8")
    chip = topo.chip_id((1, 2, 5))
    for scenario in (_failures("1,2,5"), _failures("1,2,5", spares=3, no_ocs=True)):
        dead = scenario.dead_link_ids_for(topo)
        src, dst = topo.link_endpoints()
        assert len(dead) == 12
        assert {int(src[d]) for d in dead if dst[d] != chip} == {chip}
        assert sum(1 for d in dead if dst[d] == chip) == 6
        assert scenario.failures_for(topo).action == "route around"


def test_more_failed_cubes_than_spares_swaps_the_first_and_routes_around_the_rest():
    topo = make_topology(get_chip("v4"), "4x4x8")
    f = _failures("0,0,0", "0,0,4", spares=1).failures_for(topo)
    assert f.swapped_cubes == ((0, 0, 0, 0),) and f.routed_chips == (topo.chip_id((0, 0, 4)),)
    assert f.action == "cube swap and route around"
    assert "no spare left for the cube of 0,0,4" in f.why_not_swapped


def test_a_pod_without_switches_routes_around():
    topo = make_topology(get_chip("v5e"), "4x4")
    f = _failures("1,1").failures_for(topo)
    assert f.routed_chips == (topo.chip_id((1, 1)),) and "no optical switches" in \
        f.why_not_swapped


_TRAIN = ["train", "--chip", "v4", "--shape", "4x4x8", "--model", "llama3-8b", "--set",
          "model.num_layers=1", "--seq-len", "256", "--batch-per-chip", "1", "--mesh",
          "fsdp=128", "--json", "--quiet"]


def test_a_swapped_cube_runs_the_step_at_full_speed_plus_a_one_time_reconfiguration(capsys):
    rc, out, err = _run(capsys, *_TRAIN)
    healthy = json.loads(out)
    rc, out, err = _run(capsys, *_TRAIN, "--failed-chip", "1,2,5", "--spare-cubes", "2",
                        "--set", "ocs_reconfiguration_s=30")
    assert rc == 0, err
    swapped = json.loads(out)
    assert swapped["step_time_s"] == healthy["step_time_s"]
    f = swapped["failures"]
    assert f["action"] == "cube swap" and f["swapped_cubes"] == ["0,0,1"]
    assert f["reconfiguration_s"] == 30 and f["spare_cubes_left"] == 1
    assert "failures" not in healthy
    assert swapped["inputs"]["flags"]["failed-chip"] == ["1,2,5"]
    assert swapped["inputs"]["perturbations"]["failed_chip"] == ["1,2,5"]


def test_a_step_that_needs_the_failed_chip_without_a_spare_is_refused_in_one_line(capsys):
    for extra in ([], ["--spare-cubes", "1", "--no-ocs"]):
        rc, out, err = _run(capsys, *_TRAIN, "--failed-chip", "1,2,5", *extra)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert "--failed-chip 1,2,5: no spare cube replaces it" in err
        assert "give --spare-cubes N" in err


def test_a_send_past_the_failed_chip_routes_around_it(capsys):
    argv = ["collective", "--chip", "v4", "--shape", "4x4x8", "--op", "send", "--src", "0,0,0",
            "--dst", "2,0,0", "--bytes", "1MiB", "--json"]
    rc, out, _ = _run(capsys, *argv, "--failed-chip", "1,0,0")
    d = json.loads(out)
    assert rc == 0 and d["failures"]["action"] == "route around"
    assert d["failures"]["routed_around"] == ["1,0,0"] and d["failures"]["dead_links"] == 12
    # Half way round x both ways; the path through the failed chip is gone: one path, twice
    # the time of the healthy pair of paths (less the shared latency).
    healthy = d["detour"]["healthy_time_s"]
    assert d["time_s"] > 1.8 * healthy - 2e-6
    rc, out, _ = _run(capsys, *argv, "--failed-chip", "1,0,0", "--spare-cubes", "1")
    d = json.loads(out)
    assert d["failures"]["action"] == "cube swap" and d["detour"] is None
    assert d["time_s"] == pytest.approx(healthy)


def test_the_text_report_says_what_happened(capsys):
    rc, out, _ = _run(capsys, *[a for a in _TRAIN if a != "--json"], "--failed-chip", "1,2,5",
                      "--spare-cubes", "1")
    assert rc == 0
    assert "failed chips     1,2,5: cube 0,0,1 swapped for a spare (0 of 1 left)" in out


@pytest.mark.parametrize("extra, message", [
    (["--failed-chip", "4,0,0"], "--failed-chip 4,0,0: coordinate x=4 is outside the 4x4x8"),
    (["--failed-chip", "1,2"], "have 2 value(s)"),
    (["--failed-chip", "1,2,x"], "must be integers"),
    (["--failed-chip", "1,2,3", "--spare-cubes", "63"],
     "--spare-cubes 63: the v4 pod has 64 cubes and this slice takes 2, so at most 62"),
    (["--spare-cubes", "-1"], "--spare-cubes"),
])
def test_failure_bad_input_is_one_line(capsys, extra, message):
    rc, out, err = _run(capsys, "collective", "--chip", "v4", "--shape", "4x4x8", "--op",
                        "all-gather", "--axes", "x", "--bytes", "1MiB", *extra)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def test_spares_for_a_failed_chip_on_a_pod_without_switches_are_refused(capsys):
    argv = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "send", "--src", "0,0",
            "--dst", "2,0", "--bytes", "1MiB", "--spare-cubes", "1"]
    rc, _out, err = _run(capsys, *argv, "--failed-chip", "3,3")
    assert rc == 2 and "no optical switches to swap a cube in" in err
    # Without a failed chip spares change nothing (goodput's spares reach its step model so).
    rc, out, err = _run(capsys, *argv)
    assert rc == 0 and "failed chips" not in out


def test_a_scenario_file_carries_failed_chips_spares_and_the_twist(tmp_path, capsys):
    s = scenario_from_dict({"failed_chip": ["1,2,5", [0, 0, 0]], "spare_cubes": 2,
                            "no_ocs": False, "twist": True})
    assert s.failed_chips == ((1, 2, 5), (0, 0, 0)) and s.spare_cubes == 2 and s.twist
    assert scenario_from_dict(s.to_dict()) == s
    with pytest.raises(TpusimError, match="spare_cubes 'two' must be a whole number"):
        scenario_from_dict({"spare_cubes": "two"})
    path = tmp_path / "s.yaml"
    path.write_text("failed_chip: ['1,0,0']\nspare_cubes: 1\ntwist: true\n")
    rc, out, err = _run(capsys, "collective", "--chip", "v4", "--shape", "4x4x8", "--op",
                        "all-to-all", "--axes", "x,y,z", "--bytes", "1MiB", "--scenario",
                        str(path), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["topology"] == "4x4x8-twisted" and d["failures"]["action"] == "cube swap"
