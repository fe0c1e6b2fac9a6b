"""Validate tpusim's training-step predictions against measured MaxText runs on TPU v5e / v6e.

Reads `docs/reference/maxtext_runs.json` (public MaxText / tpu-recipes measurements, see
`maxtext.md` beside it), rebuilds every usable run in the simulator (model from its stored dims,
mesh from its parallelism, the slice, the number of slices, the remat policy), predicts the step
time under the shipped chip presets and compares it with the measured step time:

    .venv/bin/python -m validation.maxtext            # table + median errors
    .venv/bin/python -m validation.maxtext --fit      # also re-run the factor fit
    .venv/bin/python -m validation.maxtext --write    # fit + regenerate docs/validation.md
    .venv/bin/python -m validation.maxtext --write --reuse-fits validation/results/maxtext_fits.json

`--write` also saves the fit to `validation/results/maxtext_fits.json`, which `--reuse-fits`
and `python -m validation.check` (is every generated section current?) read.

The error is `(predicted - measured) / measured` of the step time (tokens/s per chip is
`batch x seq / step`, so its error is the reciprocal one). Medians are of the absolute error.
Cases graded `low` by the reference are shown, but kept out of the headline medians and the fit.

The fit (`--fit`, `--write`; 600-1,100 CPU-s, validation/README.md) works per chip generation on
physics knobs only, never a per-case constant: `mxu_efficiency` on a 0.01 grid minimising the
mean absolute log error on the odd-indexed cases of that generation (file order), with the
even-indexed ones held out; `hbm_efficiency` and `ici_efficiency` are scanned (MXU re-optimised)
on both halves to test whether the data identify them; the same fit on the even half and with
the other mappings of MaxText's custom remat policies checks robustness. The output is
deterministic (no timings, no dates, independent of `--jobs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from validation.maxtext_doc import (
    FITS_FILE,
    fits_text,
    load_fits,
    updated,
    write_collectives_section,
)
from validation.maxtext_fit import run_fits
from validation.maxtext_predict import DOC_FILE, predict_all, summary
from validation.maxtext_runs import (
    NAMED,
    ROOT,
    RUNS_FILE,
    load_cases,
)
from validation.maxtext_tables import print_fits, print_summary, print_table, shipped_factors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=RUNS_FILE, help="maxtext_runs.json to use")
    ap.add_argument("--fit", action="store_true",
                    help="re-run the efficiency fit (600-1,100 CPU-s)")
    ap.add_argument("--write", action="store_true",
                    help=f"fit and regenerate {DOC_FILE.relative_to(ROOT)}")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="worker processes for the fit (results do not depend on it)")
    ap.add_argument("--write-collectives", action="store_true",
                    help=f"regenerate only the XLA collective-bytes section of "
                         f"{DOC_FILE.relative_to(ROOT)} (seconds; no MaxText table, no fit)")
    ap.add_argument("--save-fits", type=Path,
                    help="also write the fit results to this JSON file")
    ap.add_argument("--reuse-fits", type=Path,
                    help="take the fit results from this JSON file (written by --save-fits "
                         "for the same code and reference file) instead of fitting again")
    args = ap.parse_args(argv)
    if not args.runs.is_file():
        print(f"reference file {args.runs} is absent; nothing to validate", file=sys.stderr)
        return 2
    if args.write_collectives:
        return write_collectives_section()
    cases, skips = load_cases(args.runs)
    preds = predict_all(cases)
    stats = summary(preds)
    print_table(preds)
    print_summary(stats)
    print("\nskipped:")
    for s in skips:
        print(f"  {s.id} ({s.chip}, {s.quality}): {s.reason}")
    if args.fit or args.write:
        if args.reuse_fits:
            fits = load_fits(args.reuse_fits)
        else:
            fits = run_fits(args.runs, args.jobs)
        if args.save_fits:
            args.save_fits.write_text(json.dumps([dataclasses.asdict(f) for f in fits]))
        print_fits(fits)
        shipped = shipped_factors()
        for f in fits:
            if f.subset == "odd" and f.custom_remat == NAMED:
                if abs(shipped[f.generation]["mxu_efficiency"] - f.mxu) > 1e-9:
                    print(f"\nNOTE: {f.generation} ships mxu_efficiency="
                          f"{shipped[f.generation]['mxu_efficiency']} but the fit gives {f.mxu}")
                if abs(shipped[f.generation]["dcn_message_overhead_s"] - f.dcn_message) > 1e-12:
                    print(f"\nNOTE: {f.generation} ships dcn_message_overhead_s="
                          f"{shipped[f.generation]['dcn_message_overhead_s']} but the fit gives "
                          f"{f.dcn_message}")
        if args.write:
            DOC_FILE.parent.mkdir(parents=True, exist_ok=True)
            # The sections after it (validation.hlo_import's on) are kept as they are.
            prev = DOC_FILE.read_text() if DOC_FILE.exists() else ""
            DOC_FILE.write_text(updated(prev, cases, skips, preds, stats, fits))
            FITS_FILE.write_text(fits_text(fits))
            print(f"\nwrote {DOC_FILE.relative_to(ROOT)} and {FITS_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
