"""The `tpusim` command: one module per command family (collectives, training, inference,
studies), each registering its subcommands; `main` turns every `TpusimError` into one line on
stderr, exit 2.

Only the CLI (and the exporters in `sim/export/` it calls for `--out`/`--perfetto`/`--plots`)
touches the disk; the engine imports neither.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sim.cli.common import Parser, parse_bytes, parse_coords
from topologies.errors import TpusimError

__all__ = ["build_parser", "main", "parse_bytes", "parse_coords"]


def build_parser() -> Parser:
    from sim.cli import collectives, inference, studies, training

    p = Parser(prog="tpusim", description="Discrete-event simulator of TPU pods.")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (it only appears on a terminal, after 1 s)")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    for family in (collectives, training, inference, studies):
        family.register(sub)
    return p


def dispatch(parser: Parser, argv: Sequence[str] | None) -> int:
    """Parse `argv` and run its command (raising `TpusimError`); `main` and the sweep's
    workers (which reuse one parser for many points) both run commands through here."""
    args = parser.parse_args(argv)
    from sim import progress

    progress.QUIET = bool(args.quiet or getattr(args, "quiet_sub", False))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "set_scope", None) is not None:
        from sim.cli.common import resolve_overrides

        resolve_overrides(args)
    return int(args.func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return dispatch(build_parser(), argv)
    except TpusimError as exc:
        sys.stderr.write(f"tpusim: error: {exc}\n")
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        sys.stderr.write("tpusim: interrupted\n")
        return 130
    except BrokenPipeError:  # pragma: no cover
        return 0
