"""Study subcommands: `sweep` (a study file's points on a local pool or a Dask cluster) and
`plan` (search the ways to run a training step). They register into `sim.cli` like the others.
"""

from __future__ import annotations

import argparse

from sim.cli import common as cli
from sim.runs.requests import EXHAUSTIVE_MAX_SIMULATIONS, PlanRequest
from topologies.validate import whole_flag


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=whole_flag("--workers"), default=0,
                   help="worker processes (default: one per core; 1 runs in this process)")
    p.add_argument("--dask",
                   help="run on a Dask cluster: local (start a LocalCluster of --workers "
                        "processes) or a scheduler address such as tcp://HOST:8786")


def cmd_sweep(args: argparse.Namespace) -> int:
    # The studies stack (the run layer, pandas) loads when a sweep runs, not for `--help`.
    from sim.studies.backends import check_workers
    from sim.studies.results import ERROR_COLUMN, STATUS_COLUMN, status_counts_text
    from sim.studies.spec import load_study
    from sim.studies.sweep import SweepConfig, run_study

    check_workers(args.workers)
    study = load_study(args.study)
    # A failed point's error names its settings as the point's command spells them.
    cfg = SweepConfig(workers=args.workers, dask=args.dask, out_dir=args.out,
                      resume=args.resume, quiet=bool(args.quiet_sub),
                      allow_oom=bool(args.allow_oom),
                      spell=cli.flag_spelling(args.parser, study.command))
    df = run_study(study, cfg)
    metrics = [m for m in study.metrics if m in df.columns]
    print(f"{len(df)} points ({status_counts_text(df)}) -> {cli.show_path(args.out)}/"
          "results.parquet, results.csv, study.json" + (", plots" if study.plots else ""))
    if metrics:
        import pandas as pd

        with pd.option_context("display.max_rows", 40, "display.width", 160):
            # A failed point has no metrics and a point that ran no error: "-", not NaN or
            # <NA> (na_rep does not reach a text column's NA). The status says which rows
            # describe a run that cannot happen (over HBM).
            shown = df[[*study.varied, *metrics, STATUS_COLUMN, ERROR_COLUMN]].copy()
            shown[ERROR_COLUMN] = shown[ERROR_COLUMN].astype(object).where(
                shown[ERROR_COLUMN].notna(), "-")
            print(shown.to_string(index=False, na_rep="-"))
    return 0


def _register_sweep(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a study file: a base command and the flags it varies")
    p.add_argument("study", help="study file (YAML or JSON): command, base, grid, zip, metrics, "
                                 "plot")
    _add_backend_args(p)
    p.add_argument("--out", default="sweep-out",
                   help="directory for results.parquet/csv, study.json and plots "
                        "(default sweep-out)")
    p.add_argument("--resume", action="store_true",
                   help="skip the points already in OUT/results.parquet")
    p.add_argument("--quiet", dest="quiet_sub", action="store_true", help="no progress bar")
    p.add_argument("--allow-oom", action="store_true",
                   help="draw the points that do not fit in HBM in the plots like the others "
                        "(default: hollow grey markers, left out of the lines); their status "
                        "column still says `does not fit`")
    p.set_defaults(func=cmd_sweep)


def cmd_plan(args: argparse.Namespace) -> int:
    # The plan search (the run layer, pandas, matplotlib for the plot) loads when it runs.
    from sim.export.output import check_output_dir, write_json
    from sim.studies.plan_report import plan_summary
    from sim.studies.plan_search import search
    from sim.studies.plots import plot_cost_frontier, plot_frontier

    req = cli.request_of(PlanRequest, args)
    if args.out:
        check_output_dir(args.out)
    # A failed candidate's error names its settings as `train` (what each candidate runs)
    # spells them.
    res, cfg = search(req, quiet=bool(args.quiet_sub),
                      spell=cli.flag_spelling(args.parser, "train"))
    summary = plan_summary(res, cfg.top)
    if args.out:
        from pathlib import Path

        # deferred: start-up
        from sim.export.output import write_tables

        write_tables(args.out, {"candidates": res.table}, summary)
        plot_frontier(res, Path(args.out) / "frontier.png")
        plot_cost_frontier(res, Path(args.out) / "frontier_cost.png")
        write_json(Path(args.out) / "summary.json", summary)
    if args.json:
        cli.emit_json(summary)
        return 0
    c = res.counts
    print(f"plan: {res.model} on {res.pod}, seq {cfg.seq_len}, global batch "
          f"{cfg.global_batch}: {c['candidates']} candidates ({c['pruned_by_memory']} pruned by "
          f"the memory estimate), {c['simulated']} simulated, {c['skipped_by_bound']} skipped "
          f"by their lower bound, {c['fit']} fit; {res.wall_s:.1f} s")
    top = res.top(cfg.top)
    if not len(top):
        print("  " + res.explanation)
        return 0
    extra = cfg.objective != "time"  # the column the winner is picked by
    pods = "shape" in top.columns
    print(f"  {'#':>2} " + (f"{'slice':<16} " if pods else "")
          + f"{'mesh':<34} {'placement':<34} {'remat':<12} {'mb':>3} {'step':>10} "
          f"{'MFU':>6} {'tok/s/chip':>10} {'HBM GB':>7}"
          + (f" {'J/token':>8} {'$/Mtok':>8}" if extra else "") + "  bound")
    for r in top.itertuples(index=False):
        where = f"{r.shape + (' twisted' if r.twist else ''):<16} " if pods else ""
        print(f"  {r.rank:>2} {where}{r.mesh:<34} {r.placement:<34} {r.remat:<12} "
              f"{r.microbatches:>3} "
              f"{cli.fmt_time(r.step_time_s):>10} {r.mfu:>6.1%} {r.tokens_per_s_per_chip:>10.1f} "
              f"{r.hbm_peak_bytes / 1e9:>7.1f}"
              + (f" {r.energy_per_token_j:>8.4f} {r.cost_per_million_tokens_usd:>8.4f}"
                 if extra else "") + f"  {r.bound}")
    print(f"  best: {res.explanation}")
    if args.out:
        print(f"  wrote {cli.show_path(args.out)}/candidates.csv, candidates.parquet, "
              "summary.json, frontier.png")
    return 0


def _register_plan(sub, name: str) -> None:
    p = cli.add_command(sub, name, "search meshes, placements, remat, microbatches and dtypes "
                                   "for a training step; print the best", cmd_plan,
                        set_scope=PlanRequest.SET_SCOPE)
    p.add_argument("--serve", action="store_true",
                   help="search serving deployments instead: `tpusim plan --serve` is "
                        "`tpusim plan-serve` (see its --help for its flags)")
    p.add_argument("--model", required=True, help="zoo name (llama3-70b, ...) or a model YAML")
    p.add_argument("--seq-len", type=PlanRequest.OWN_CONVERTERS["seq_len"], required=True,
                   help="sequence length in tokens")
    p.add_argument("--global-batch", type=whole_flag("--global-batch"), required=True,
                   help="sequences per step")
    p.add_argument("--top", type=whole_flag("--top"), default=5,
                   help="how many to print (default 5)")
    _add_backend_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--exhaustive", action="store_true",
                   help="simulate every candidate to the end (no pruning by lower bounds, no "
                        "refusal by the HBM bound, no early stop over HBM): the brute-force "
                        "check of the default search, which gives the same top K; refused "
                        "before anything runs if that is more than --max-simulations")
    p.add_argument("--max-simulations", type=whole_flag("--max-simulations"), default=None,
                   help=f"the most candidates --exhaustive may simulate (default "
                        f"{EXHAUSTIVE_MAX_SIMULATIONS}; with --exhaustive only)")
    p.add_argument("--out", default="plan-out",
                   help="write candidates.csv/parquet, summary.json, frontier.png and "
                        "frontier_cost.png here (default plan-out; empty to skip)")
    p.add_argument("--objective", default="time", choices=["time", "cost", "energy"],
                   help="what picks the winner: time (default: the step time), cost (dollars "
                        "per step at the chip's usd_per_chip_hour) or energy (the pod's joules "
                        "per step, host and data centre included)")
    g = p.add_argument_group("search space")
    g.add_argument("--axes", default="data,fsdp,pipeline,expert,sequence,tensor",
                   help="mesh axes to use (default all; expert only for MoE models)")
    g.add_argument("--max-tensor", type=whole_flag("--max-tensor"), default=8,
                   help="largest tensor axis (default 8)")
    g.add_argument("--max-data", type=whole_flag("--max-data"), default=4,
                   help="largest data axis (default 4)")
    g.add_argument("--max-sequence", type=whole_flag("--max-sequence"), default=2,
                   help="largest sequence axis (default 2)")
    g.add_argument("--max-pipeline", type=whole_flag("--max-pipeline"), default=4,
                   help="largest pipeline axis (default 4)")
    g.add_argument("--max-expert", type=whole_flag("--max-expert"), default=64,
                   help="largest expert axis (default 64)")
    g.add_argument("--default-placement", action="store_true",
                   help="only jax's default axis order (no other placements on the torus)")
    g.add_argument("--remat", default="full,minimal,none",
                   help="remat policies allowed (default full,minimal,none; any --remat name of "
                        "train but custom)")
    g.add_argument("--microbatches", default="1,2,4",
                   help="microbatch counts allowed (times the pipeline size; the fewest that "
                        "fits is used; default 1,2,4)")
    g.add_argument("--param-dtype", default="bf16", help="allowed param dtypes (default bf16)")
    g.add_argument("--grad-dtype", default="bf16", help="allowed gradient dtypes (default bf16)")
    g.add_argument("--optimizer-dtype", default="fp32",
                   help="allowed optimizer-state dtypes (default fp32)")
    g.add_argument("--optimizer", default="adam",
                   help="the update rule of every candidate: adam (default) or sgd")
    g.add_argument("--gather-dtype", default=None,
                   help="the dtype every candidate's weights are gathered and multiplied in "
                        "(default: its --param-dtype, no cast); --param-dtype fp32 "
                        "--gather-dtype bf16 is MaxText's default, as on train")
    g.add_argument("--shapes", default=None, metavar="all|SHAPES",
                   help="also search the slice's shape: all (every shape of the pod's chip "
                        "count its generation can build: whole 4x4x4 cubes on v4/v5p) or a "
                        "comma list such as 4x4x16,4x8x8 (default: the --shape/--slice given)")
    g.add_argument("--wiring", default="auto", choices=["auto", "plain", "twisted"],
                   help="which wirings to search: auto (default: plain, and twisted where the "
                        "shape can twist, v4/v5p k x k x 2k and k x 2k x 2k), plain or twisted "
                        "(--twist is twisted)")


def register(sub) -> None:
    cli.register_commands(sub, [("sweep", _register_sweep), ("plan", _register_plan)])


__all__ = ["register"]
