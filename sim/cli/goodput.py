"""`tpusim goodput`: a training job's goodput under failures of chips and hosts, with repairs,
spare cubes swapped in by the optical switches, checkpoints and restarts (sim/reliability). The
step time is given (`--step-time`) or simulated by the step model from `train`'s flags.
Registers into `sim.cli` like the other command families."""

from __future__ import annotations

import argparse
from pathlib import Path

from sim.cli import common as cli
from sim.cli.common import check_outputs
from sim.cli.training import add_training_args
from sim.runs.requests import GoodputRequest
from topologies.errors import render_said

_CAUSE_WORDS = {"recomputation": "recomputation", "checkpoint_writes": "checkpoint writes",
                "restarts": "restarts", "cube_swaps": "cube swaps",
                "waiting_for_repair": "waiting for repair",
                "waiting_for_spare": "waiting for a spare"}


def _ci(ci: dict, fmt: str) -> str:
    if ci["low"] is None:
        return ""
    return f" (95% CI {format(ci['low'], fmt)} to {format(ci['high'], fmt)})"


def _hours(s: float) -> str:
    return f"{s / 3600:,.2f} h"


def print_report(s: dict) -> None:
    """The text report of a goodput run."""
    where = (f"{s['num_chips']:,} {s['chip']} chips ({s['topology']}), {s['num_hosts']:,} "
             f"hosts of {s['chips_per_host']}")
    if s["num_cubes"]:
        where += f", {s['num_cubes']} cube{'s' if s['num_cubes'] != 1 else ''}"
    print(f"goodput of a training job on {where}")
    spares = (f"{s['spare_cubes']} spare cube(s) swapped in by the optical switches"
              if s["swaps_cubes"] else
              "no spare cubes: a failure waits for its repair" if s["ocs"] else
              "--no-ocs, a static pod: a failure waits for its repair" if s["num_cubes"] else
              "no optical switches (a static pod): a failure waits for its repair")
    print(f"  recovery         {spares}")
    mtbf = s.get("slice_mtbf_hours")
    fails = (f"the slice fails every {mtbf:,.4g} h on average" if mtbf else
             f"failures from {s.get('failure_trace')}")
    if s.get("host_availability") is not None:
        fails += f" (host availability {s['host_availability']:.4%})"
    print(f"  failures         {fails}; repairs take {s['repair_hours']:g} h")
    print(f"  step             {s['step_time_s']:.6g} s, {s['sources']['step_time_s']}")
    print(f"  costs            checkpoint {s['checkpoint_cost_s']:.4g} s, restart "
          f"{s['restart_cost_s']:.4g} s, cube swap {s['swap_cost_s']:.4g} s")
    print(f"  goodput          {s['goodput']:.2%}{_ci(s['goodput_ci95'], '.2%')} over "
          f"{s['seeds']} seed(s)")
    how = "searched" if s["checkpoint_interval_searched"] else "given"
    print(f"  checkpoints      every {s['checkpoint_interval_s']:,.6g} s "
          f"({s['checkpoint_interval_steps']:,} steps, {how}); best "
          f"{s['best_checkpoint_interval_s']:,.6g} s at {s['best_goodput']:.2%}")
    if s["young_daly_interval_s"] is not None:
        print(f"  Young-Daly       sqrt(2 x checkpoint cost x MTBF) = "
              f"{s['young_daly_interval_s']:,.6g} s (Daly's higher order "
              f"{s['daly_interval_s']:,.6g} s)")
    if s["job_hours"] is None:
        print(f"  finish           {s['expected_finish_hours']:,.2f} h"
              f"{_ci(s['expected_finish_hours_ci95'], ',.2f')} for {s['useful_hours']:,.2f} h "
              f"of training")
    else:
        print(f"  trained          {s['useful_hours']:,.2f} h ({s['steps']:,.0f} steps) in the "
              f"{s['job_hours']:g} h window")
    print(f"  events           {s['failures']:,.1f} failures, {s['cube_swaps']:,.1f} cube swaps, "
          f"{s['checkpoints']:,.1f} checkpoints (means over the seeds)")
    lost = s["lost_s_by_cause"]
    total = sum(lost.values())
    print(f"  lost             {_hours(total)}")
    for cause, v in lost.items():
        if v > 0:
            print(f"    {_CAUSE_WORDS[cause]:<20} {_hours(v):>12}  "
                  f"{v / total if total else 0:6.1%}")
    if s.get("note"):
        print(f"  note             {s['note']}")


def cmd_goodput(args: argparse.Namespace) -> int:
    from sim.runs.goodput import run_goodput  # the run stack, loaded when it runs

    req = cli.request_of(GoodputRequest, args)
    check_outputs(args)
    run = run_goodput(req)
    res = run.result
    # The summary's sources and note name settings (Said): written as this command's flags.
    out = render_said(run.to_dict(), cli.flag_spelling(args.parser, "goodput"))
    summary = {k: v for k, v in out.items() if k != "inputs"}
    if args.out:
        # deferred: start-up
        from sim.export.output import write_tables

        write_tables(Path(args.out), {"seeds": res.seeds_frame(),
                                      "intervals": res.intervals_frame(),
                                      "events": res.events_frame()}, out)
    if args.plots:
        # deferred: start-up
        from sim.export.goodput_plots import plot_goodput

        plot_goodput(summary, res, args.plots)
    if args.perfetto:
        # deferred: start-up
        from sim.export.goodput_trace import export_goodput

        export_goodput(summary, res, args.perfetto)
    if args.json:
        cli.emit_json(out)
        return 0
    print_report(summary)
    if args.out:
        print(f"wrote {cli.show_path(args.out)}/seeds, intervals, events (.csv/.parquet) and "
              f"summary.json")
    if args.plots:
        print(f"wrote {cli.show_path(args.plots)}/goodput_timeline.png and "
              f"goodput_vs_interval.png")
    if args.perfetto:
        print(f"wrote {cli.show_path(args.perfetto)}")
    return 0


def _register_goodput(sub, name: str) -> None:
    conv = GoodputRequest.OWN_CONVERTERS
    p = cli.add_command(sub, name, "a training job's goodput under chip and host failures: "
                                   "checkpoints, restarts, repairs, spare cubes", cmd_goodput,
                        set_scope=GoodputRequest.SET_SCOPE)
    g = p.add_argument_group("the job")
    g.add_argument("--step-time", type=conv["step_time"], metavar="S",
                   help="seconds one training step takes (or the train flags below, whose step "
                        "the step model simulates)")
    g.add_argument("--steps", type=conv["steps"], metavar="N",
                   help="the job is N steps; it ends when the last is done")
    g.add_argument("--hours", type=conv["hours"], metavar="H",
                   help="the job is H hours of wall clock; it trains until then (instead of "
                        "--steps)")
    f = p.add_argument_group("failures and repairs")
    f.add_argument("--mtbf-hours", type=conv["mtbf_hours"], metavar="H",
                   help="the whole slice's mean time between failures")
    f.add_argument("--chip-mtbf-hours", type=conv["chip_mtbf_hours"], metavar="H",
                   help="each chip's MTBF, multiplied out over the slice's chips")
    f.add_argument("--host-mtbf-hours", type=conv["host_mtbf_hours"], metavar="H",
                   help="each host's MTBF, multiplied out over the slice's hosts")
    f.add_argument("--host-availability", type=conv["host_availability"], metavar="A",
                   help="each host's availability in (0, 1), MTBF / (MTBF + repair): the host "
                        "MTBF is --repair-hours x A / (1 - A) (instead of --host-mtbf-hours)")
    f.add_argument("--failure-trace", metavar="FILE",
                   help="CSV (header) or JSON-lines file of failures: time_s (seconds from the "
                        "job's start, sorted), optional kind (chip or host) and unit (its "
                        "index); instead of the MTBFs (one history)")
    f.add_argument("--repair-hours", type=conv["repair_hours"], metavar="H",
                   help="hours a failed chip or host takes to come back (required)")
    f.add_argument("--chips-per-host", type=conv["chips_per_host"], metavar="N",
                   help="chips per host (default: the generation's host, 4 on v4/v5p, 8 on "
                        "v5e/v6e; docs/reference/tpu.md)")
    o = p.add_argument_group("spare cubes and optical switches")
    o.add_argument("--spare-cubes", type=conv["spare_cubes"], default=0, metavar="N",
                   help="free 4x4x4 cubes of the pod the optical switches swap in for a cube "
                        "with a failed part (v4, v5p slices of whole cubes; default 0: a "
                        "failure waits for its repair)")
    o.add_argument("--no-ocs", action="store_true",
                   help="a static pod: no cube can be swapped in, every failure waits for its "
                        "repair")
    c = p.add_argument_group("checkpoints and restarts")
    c.add_argument("--checkpoint-interval", type=conv["checkpoint_interval"], metavar="S",
                   help="seconds of training between checkpoints, rounded to whole steps "
                        "(default: the interval that maximises goodput, searched)")
    c.add_argument("--checkpoint-cost", type=conv["checkpoint_cost"], metavar="S",
                   help="seconds a checkpoint write stops training (default with the train "
                        "flags: the model's parameters and optimizer state over "
                        "--storage-bytes-per-s)")
    c.add_argument("--restart-cost", type=conv["restart_cost"], metavar="S",
                   help="seconds from a whole slice to training again: reload, restore (default "
                        "with the train flags: the checkpoint read back over "
                        "--storage-bytes-per-s)")
    c.add_argument("--swap-cost", type=conv["swap_cost"], default=0.0, metavar="S",
                   help="seconds a cube swap adds before the restart (default 0, assumed: no "
                        "public figure)")
    c.add_argument("--storage-bytes-per-s", type=conv["storage_bytes_per_s"], metavar="B",
                   help="checkpoint storage bandwidth of the whole slice (default: the slice's "
                        "DCN egress, an upper bound)")
    r = p.add_argument_group("run")
    r.add_argument("--seeds", type=conv["seeds"], metavar="K",
                   help="failure histories simulated, each seeded from --seed (default 10; 1 "
                        "with --failure-trace); results are their means with 95%% confidence "
                        "intervals")
    r.add_argument("--engine", default="event-skip",
                   help="event-skip (default: checkpoints counted in closed form between "
                        "failures) or simpy (every checkpoint an event; the oracle, slower, the "
                        "same numbers)")
    t = p.add_argument_group("the step model (train's flags, instead of --step-time)")
    add_training_args(t, required=False)
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm for gathers/reductions (default auto)")
    o = p.add_argument_group("results")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--out", help="write seeds, intervals and events tables (.csv/.parquet) and "
                                 "summary.json here")
    o.add_argument("--plots", help="write goodput_timeline.png (seed 0's job over time) and "
                                   "goodput_vs_interval.png (the interval search) here")
    o.add_argument("--perfetto", help="write seed 0's job as a Perfetto trace (.pftrace; .json "
                                      "for Chrome)")
    cli.add_step_perturbation_args(p)
    for action in p._actions:  # goodput's --seed seeds the failures too
        if action.dest == "seed":
            action.help = ("seed of the failure draws (history i is seeded by (seed, i)), and "
                           "of the step model's --chip-variation and MoE router (default 0)")


def register(sub) -> None:
    cli.register_commands(sub, [("goodput", _register_goodput)])
