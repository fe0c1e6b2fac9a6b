"""Tests for topologies/scenario.py: flag and YAML parsing of perturbations, their validation
against a pod, resolution to chip and link ids, and the CLI's one-line errors for bad ones."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.cli import main
from topologies.errors import TpusimError
from topologies.scenario import (
    SCENARIO_KEYS,
    Scenario,
    load_scenario,
    scenario_from_dict,
    scenario_from_flags,
)
from topologies.torus import build_torus
from workloads.moe import MoeConfig

POD_3D = build_torus((4, 4, 4), (True, True, True))
POD_2D_LINE = build_torus((4, 2), (False, False))


def test_flags_resolve_to_chip_and_link_ids_and_repeats_multiply():
    s = scenario_from_flags(
        slow_chip=["1,2,3:0.8", "1,2,3:0.5", "0,0,0:1.5"],
        slow_link=["0,0,0:x+:0.5", "0,0,0:x+:0.5", "3,3,3:z-"],
        dead_link=["2,0,0:y-"],
    )
    chips = s.slow_chip_factors_for(POD_3D)
    assert chips == {POD_3D.chip_id((1, 2, 3)): pytest.approx(0.4), 0: 1.5}
    links = s.slow_link_factors_for(POD_3D)
    x_plus_0 = POD_3D.ici_link_id(0, 0, +1)
    z_minus = POD_3D.ici_link_id(POD_3D.chip_id((3, 3, 3)), 2, -1)
    assert links == {x_plus_0: 0.25, z_minus: 0.5}  # the factor defaults to 0.5, as before
    dead = POD_3D.ici_link_id(POD_3D.chip_id((2, 0, 0)), 1, -1)
    assert s.dead_link_ids_for(POD_3D) == (dead,)
    f = s.link_factors_for(POD_3D)
    assert f[dead] == 0 and f[x_plus_0] == 0.25 and np.count_nonzero(f != 1) == 3
    speed = s.chip_speed_factors_for(POD_3D)
    assert speed[0] == 1.5 and np.count_nonzero(speed != 1) == 2


def test_chip_variation_is_a_seeded_lognormal_with_median_one():
    pod = build_torus((16, 16), (True, True))
    a = Scenario(chip_variation_sigma=0.1, seed=3).chip_speed_factors_for(pod)
    b = Scenario(chip_variation_sigma=0.1, seed=3).chip_speed_factors_for(pod)
    c = Scenario(chip_variation_sigma=0.1, seed=4).chip_speed_factors_for(pod)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert len(np.unique(a)) == pod.num_chips  # every chip differs
    logs = np.log(a)
    assert abs(np.median(logs)) < 0.02  # median 1; 256 draws: s.e. of the median ~0.008
    assert np.std(logs) == pytest.approx(0.1, rel=0.15)


def test_healthy_scenario_is_all_ones():
    s = Scenario()
    assert s.is_healthy and not s.perturbs_links and not s.perturbs_chips
    assert np.all(s.chip_speed_factors_for(POD_3D) == 1)
    assert np.all(s.link_factors_for(POD_3D) == 1)


def test_multi_slice_coordinates_take_an_optional_slice_index():
    pod = build_torus((4, 4), (True, True), num_slices=2)
    s = scenario_from_flags(slow_chip=["1,1:0.5", "1,1,1:0.25"])
    assert s.slow_chip_factors_for(pod) == {5: 0.5, 16 + 5: 0.25}


def test_yaml_round_trip_gives_the_same_scenario(tmp_path):
    s = scenario_from_flags(
        slow_chip=["3,1,2:0.8"], slow_link=["0,0,0:x+:0.1"], dead_link=["1,1,1:z+"],
        chip_variation=0.02, seed=7, expert_skew=1.2, capacity_factor=1.25,
        failed_chip=["1,2,3"], spare_cubes=2, no_ocs=True, twist=True,
    )
    path = tmp_path / "s.yaml"
    path.write_text(s.to_yaml())
    back = load_scenario(path)
    assert back == s
    assert set(s.to_dict()) == set(SCENARIO_KEYS)


def test_yaml_mapping_entries_equal_flag_strings():
    a = scenario_from_dict({
        "slow_chip": [{"chip": [3, 1, 2], "factor": 0.8}],
        "slow_link": [{"chip": [0, 0, 0], "link": "x+", "factor": 2}],
        "dead_link": [{"chip": [1, 1, 1], "link": "z+"}],
    })
    b = scenario_from_flags(slow_chip=["3,1,2:0.8"], slow_link=["0,0,0:x+:2.0"],
                            dead_link=["1,1,1:z+"])
    assert a == b


BAD = {
    "outside the pod": (dict(slow_chip=["4,0:0.5"]), "x=4 is outside the 4x2 pod"),
    "too many coordinates": (dict(slow_chip=["1,1,1:0.5"]), "have 3 value(s)"),
    "too few coordinates": (dict(dead_link=["1:x+"]), "have 1 value(s)"),
    "axis the pod lacks": (dict(slow_link=["0,0:z+:0.5"]), "has no z axis"),
    "zero factor": (dict(slow_chip=["0,0:0"]), "must be a finite number > 0"),
    "negative factor": (dict(slow_link=["0,0:x+:-1"]), "must be a finite number > 0"),
    "nan factor": (dict(slow_chip=["0,0:nan"]), "must be a finite number > 0"),
    "inf factor": (dict(slow_link=["0,0:x+:inf"]), "must be a finite number > 0"),
    "unwrapped edge": (dict(dead_link=["3,0:x+"]), "edge of an axis without wraparound"),
    "bad axisdir": (dict(dead_link=["0,0:w+"]), "axis letter and a direction"),
    "malformed": (dict(dead_link=["0,0:x+:0.5"]), "is not like 0,0:x+"),
    "slow and dead": (dict(slow_link=["0,0:x+"], dead_link=["0,0:x+"]),
                      "both as slow_link and dead_link"),
    "negative sigma": (dict(chip_variation=-0.1), "^chip_variation "),
    "nan sigma": (dict(chip_variation=math.nan), "^chip_variation "),
    "negative seed": (dict(seed=-1), "^seed -1 "),
    "inf skew": (dict(expert_skew=math.inf), "^expert_skew "),
    "skew past float's range": (dict(expert_skew=10**400), "^expert_skew "),
    "capacity past float's range": (dict(capacity_factor=10**400), "^capacity_factor "),
    "zero capacity": (dict(capacity_factor=0.0), "^capacity_factor "),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_perturbations_are_one_line_errors(case):
    kw, match = BAD[case]
    with pytest.raises(TpusimError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        scenario_from_flags(**kw).validate(POD_2D_LINE)
    assert "\n" not in str(e.value)


def test_unknown_yaml_keys_are_errors_listing_the_allowed_ones():
    with pytest.raises(TpusimError, match="unknown key.*slow-chip; did you mean slow_chip\\?"):
        scenario_from_dict({"slow-chip": ["0,0:0.5"]})


CLI_BAD = {
    "slow chip outside the pod": (["--slow-chip", "9,0:0.5"], "outside the 4x4 pod"),
    "nan link factor": (["--slow-link", "0,0:x+:nan"], "finite number > 0"),
    "dead link off the edge": (["--dead-link", "3,0:x+"], "has no x+ link"),
    "chip perturbation on a collective": (["--slow-chip", "0,0:0.5"], "links only"),
    "sigma not a number": (["--chip-variation", "lots"], "is not a number"),
    "missing scenario file": (["--scenario", "/nonexistent.yaml"], "does not exist"),
}


@pytest.mark.parametrize("case", CLI_BAD)
def test_bad_perturbation_flags_exit_2_with_one_line(capsys, case):
    extra, match = CLI_BAD[case]
    rc = main(["collective", "--chip", "v5e", "--shape", "4x4", "--wraparound", "none", "--op",
               "all-gather", "--axes", "x", "--bytes", "1024", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("tpusim: error: ") and err.count("\n") == 1
    assert match in err


def test_scenario_file_and_flags_add_up(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("slow_link:\n  - 0,0:x+:0.5\n")
    base = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes",
            "x", "--bytes", "1MiB", "--algorithm", "ring", "--json"]
    import json

    def run(*extra):
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["time_s"]

    from_file = run("--scenario", str(path))
    from_flag = run("--slow-link", "0,0:x+:0.5")
    both = run("--scenario", str(path), "--slow-link", "0,0:x+:0.5")
    assert from_file == from_flag
    assert both > from_flag  # 0.5 x 0.5 on the same link


def test_a_faster_link_is_allowed_and_never_slows_a_collective(capsys):
    import json

    base = ["collective", "--chip", "v5e", "--shape", "8", "--wraparound", "all", "--op",
            "all-gather", "--axes", "x", "--bytes", "8MiB", "--algorithm", "ring", "--json"]
    assert main(base) == 0
    healthy = json.loads(capsys.readouterr().out)["time_s"]
    assert main([*base, "--slow-link", "0:x+:2"]) == 0
    fast = json.loads(capsys.readouterr().out)
    # A ring step waits for its slowest link: one faster link changes nothing.
    assert fast["mode"] == "full" and fast["time_s"] == pytest.approx(healthy, rel=1e-12)


def test_number_ranges_hold_their_bounds_and_state_them_one_way():
    # One range per setting, shared by the scenario, the MoE router and the CLI's messages.
    from sim.runs.requests.base import _FLOAT_RANGES
    from topologies.scenario import CAPACITY_FACTOR_RANGE, CHIP_VARIATION_RANGE, EXPERT_SKEW_RANGE

    assert CAPACITY_FACTOR_RANGE.text == "a finite number in (0, 1e6]"
    # --help states the same range (the train/decode MoE group and the perturbation group).
    from sim.cli import build_parser

    commands = build_parser().get_default("commands")
    for name in ("compile", "train", "collective", "decode"):
        helps = {a.help for a in commands[name]._actions if "--capacity-factor" in
                 a.option_strings}
        assert helps and all("C in (0, 1e6], at least one token per expert" in h
                             for h in helps), name
    assert [CAPACITY_FACTOR_RANGE.holds(v) for v in (0, 1e-9, 1e6, 1e6 + 1)] == \
        [False, True, True, False]
    assert [CHIP_VARIATION_RANGE.holds(v) for v in (0, 1, 1.0000001, -1e-12)] == \
        [True, True, False, False]
    for bad in (float("nan"), float("inf"), True, "1", None, 10**400, -10**400):
        assert not EXPERT_SKEW_RANGE.holds(bad)
    assert _FLOAT_RANGES["expert_skew"] == EXPERT_SKEW_RANGE.text == \
        "a finite number in [0, 100]"
    with pytest.raises(TpusimError, match=r"in \(0, 1e6\]"):
        MoeConfig(capacity_factor=0.0)


def test_every_number_range_is_stated_by_one_formatter_with_plain_exponents():
    # One function (topologies.validate.range_text) prints every range: ints with thousands
    # separators, floats as %g with the exponent as a plain integer (1e6, not %g's 1e+06).
    from topologies.scenario import (
        CAPACITY_FACTOR_RANGE,
        CHIP_VARIATION_RANGE,
        EXPERT_SKEW_RANGE,
        parse_slow_link,
    )
    from topologies.validate import FlagError, bound_text, float_flag, number, range_text

    bounds = (0, 1, 1_024, 16_777_216, 0.5, 1e6, 1e21, 1e24, 1e-6, 1.5e-18, 86400.0, -2.5e10)
    assert [bound_text(x) for x in bounds] == [
        "0", "1", "1,024", "16,777,216", "0.5", "1e6", "1e21", "1e24", "1e-6", "1.5e-18",
        "86400", "-2.5e10"]
    assert range_text(0, 1e6, lo_open=True) == "a finite number in (0, 1e6]"
    assert range_text(1, 4096, integer=True) == "a whole number in [1, 4,096]"
    assert range_text(1e-18) == "a finite number >= 1e-18"
    # NumberRange states its range as number() does, and accepts exactly what number() accepts
    # (the acceptance rule is unchanged; only the wording is shared).
    for r in (CAPACITY_FACTOR_RANGE, CHIP_VARIATION_RANGE, EXPERT_SKEW_RANGE):
        with pytest.raises(TpusimError) as exc:
            number(-5, "x", lo=r.low, hi=r.high, lo_open=r.low_open)
        assert str(exc.value).endswith(f"give {r.text}")
        for v in (r.low, r.high, r.high * (1 + 1e-9), r.low - 1e-9, r.low + 1e-300,
                  (r.low + r.high) / 2):
            try:
                number(v, "x", lo=r.low, hi=r.high, lo_open=r.low_open)
                ok = True
            except TpusimError:
                ok = False
            assert ok == r.holds(v), (r, v)
    # The messages that used to print %g's exponents: a chip's efficiency, a flag, a slow-link
    # factor, a trace field.
    msgs = []
    for call in (lambda: number(2, "ici_efficiency", lo=1e-6, hi=1),
                 lambda: float_flag("--x", lo=1e-18, hi=1e21)("0"),
                 lambda: parse_slow_link("0,0:x+:2000000")):
        with pytest.raises((TpusimError, FlagError)) as exc:
            call()
        msgs.append(str(exc.value))
    assert "[1e-6, 1]" in msgs[0] and "[1e-18, 1e21]" in msgs[1] and "[1e-6, 1e6]" in msgs[2]
    assert not any("e+" in m or "e-0" in m for m in msgs), msgs
