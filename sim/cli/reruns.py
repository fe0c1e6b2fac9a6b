"""`tpusim rerun RESULT.json`: run a recorded result again from its `inputs` and print the same
JSON, byte for byte (`--check` compares it with the file). The rebuilding is the run layer's
(`sim/runs/rerun.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sim.cli.common import flag_spelling, register_commands
from topologies.errors import render_said


def cmd_rerun(args: argparse.Namespace) -> int:
    from sim.runs.rerun import read_result, rerun  # the run stack, loaded when it runs

    path = Path(args.result)
    data, text = read_result(path)
    run = rerun(data, source=f"result file {str(path)!r}")
    # Reasons kept as data (a refused candidate's) name settings by Python name: spelled here
    # as the command's flags, as the command itself printed them.
    result = render_said(run.to_dict(), flag_spelling(args.parser, run.command))
    out = json.dumps(result, indent=2, sort_keys=False) + "\n"
    sys.stdout.write(out)
    if args.check and out != text:
        old, new = data, result
        keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        sys.stderr.write(f"tpusim: rerun differs from {path} in: {', '.join(keys) or 'format'}\n")
        return 1
    return 0


def _register_rerun(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a recorded result again from its inputs")
    p.add_argument("result", help="a --json result, or an --out directory's summary.json")
    p.add_argument("--check", action="store_true",
                   help="exit 1 (naming the fields) if the new result is not byte-identical")
    p.set_defaults(func=cmd_rerun)


def register(sub) -> None:
    register_commands(sub, [("rerun", _register_rerun)])
