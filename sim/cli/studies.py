"""Study subcommands: `sweep` (a study file's points on a local pool or a Dask cluster) and
`plan` (search the ways to run a training step). They register into `sim.cli` like the others.
"""

from __future__ import annotations

import argparse

from topologies.errors import TpusimError


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=0,
                   help="worker processes (default: one per core; 1 runs in this process)")
    p.add_argument("--dask",
                   help="run on a Dask cluster: local (start a LocalCluster of --workers "
                        "processes) or a scheduler address such as tcp://HOST:8786")


def _check_workers(args: argparse.Namespace) -> None:
    if args.workers < 0:
        raise TpusimError(f"--workers {args.workers} must be >= 1 (0 = one per core)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from sim.study import ERROR_COLUMN, SweepConfig, load_study, run_study

    _check_workers(args)
    study = load_study(args.study)
    cfg = SweepConfig(workers=args.workers, dask=args.dask, out_dir=args.out,
                      resume=args.resume, quiet=bool(args.quiet_sub))
    df = run_study(study, cfg)
    failed = int(df[ERROR_COLUMN].notna().sum())
    metrics = [m for m in study.metrics if m in df.columns]
    print(f"{len(df)} points ({failed} failed) -> {args.out}/results.parquet, results.csv, "
          f"study.json" + (", plots" if study.plots else ""))
    if metrics:
        import pandas as pd

        with pd.option_context("display.max_rows", 40, "display.width", 160):
            print(df[[*study.varied, *metrics, ERROR_COLUMN]].to_string(index=False))
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
    p.set_defaults(func=cmd_sweep)


def register(sub) -> None:
    for name, reg in [("sweep", _register_sweep)]:
        reg(sub, name)


__all__ = ["register"]
