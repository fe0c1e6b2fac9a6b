"""The `tpusim` command: one module per command family (collectives, training, inference,
studies, reruns), each registering its subcommands (simulating commands through
`common.add_command`: the positional argument, the pod group and --quiet, --set, then the
command's own flags; `common.add_output_args` for the step commands' outputs); every
simulating command is also a library call (`run_<command>(args) -> sim.runs.Run`) that `rerun`
and the Python API (`sim.api`) use.
`main` turns every `TpusimError` into one line on stderr, exit 2, and anything else (a bug)
into one `internal error: ...` line that says what to report.

Only the CLI (and the exporters in `sim/export/` it calls for `--out`/`--perfetto`/`--plots`)
touches the disk; the engine imports neither.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# numpy's import starts OpenBLAS's thread pool, about 0.07 CPU-s of every command's start-up
# (benchmarks/bench_startup.py). tpusim makes no BLAS call (tests/test_architecture.py holds
# the product code to none), so one thread changes no number: set before the first numpy
# import, which the CLI's own modules below do not make; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from sim.cli import (
    chakra,
    collectives,
    goodput,
    hlo,
    inference,
    reruns,
    serving,
    studies,
    training,
)
from sim.cli.common import OneCommand, Parser, flag_spelling, request_of
from sim.cli.progress import terminal_progress
from sim.runs.convert import parse_bytes, parse_coords
from topologies.errors import TpusimError
from topologies.progress import reporting
from topologies.validate import short_repr

__all__ = ["build_parser", "main", "parse", "parse_bytes", "parse_coords", "request_from_argv"]


def build_parser(only: str | None = None) -> Parser:
    """The `tpusim` parser with every command (`only`: with that command's alone, which is all
    a command line that names it needs)."""
    p = Parser(prog="tpusim", description="Discrete-event simulator of TPU pods.")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (they only appear on a terminal, on stderr, after 1 s)")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    target = sub if only is None else OneCommand(sub, only)
    for family in (collectives, training, inference, serving, goodput, studies, reruns, hlo,
                   chakra):
        family.register(target)
    p.set_defaults(commands=sub.choices)
    return p


def parser_for(argv: Sequence[str] | None) -> Parser:
    """The parser of a command line: the named command's alone when the line names a command
    (its first word not an option), else every command's (`--help`, a bare `tpusim` and a
    misspelt command, whose error lists them all)."""
    words = serve_plan_argv(sys.argv[1:] if argv is None else list(argv))
    name = next((w for w in words if not w.startswith("-")), None)
    if name is not None:
        p = build_parser(only=name)
        if name in p.get_default("commands"):
            return p
    return build_parser()


def parse(argv: Sequence[str] | None, *, parser: Parser | None = None) -> argparse.Namespace:
    """Parse a command line (one-line errors; arguments no command takes name the command)."""
    parser = parser or build_parser()
    words = serve_plan_argv(sys.argv[1:] if argv is None else list(argv))
    args, extra = parser.parse_known_args(words)
    if extra:
        # argparse would name only `tpusim`; the command that does not take them is the fix.
        cmd = next((c for c, p in (getattr(args, "commands", None) or {}).items()
                    if getattr(args, "func", None) is not None
                    and p.get_default("func") is args.func), None)
        what = short_repr(" ".join(extra))[1:-1]
        if cmd is None:
            parser.error(f"unrecognized arguments: {what}")
        raise TpusimError(f"unrecognized arguments: {what}: the {cmd} command does not take "
                          f"them (see `tpusim {cmd} --help` for its flags)")
    args.parser = parser
    return args


def serve_plan_argv(words: list[str]) -> list[str]:
    """`tpusim plan --serve ...` is `tpusim plan-serve ...` (the serving plan takes the serve
    command's workload flags, not the training plan's)."""
    if "--serve" not in words:
        return words
    i = next((k for k, w in enumerate(words) if not w.startswith("-")), None)
    if i is None or words[i] != "plan" or words.index("--serve") < i:
        return words
    return [*words[:i], "plan-serve", *(w for w in words[i + 1:] if w != "--serve")]


def request_from_argv(argv: Sequence[str], *, parser: Parser | None = None):
    """The typed request of a simulating command line (`["train", "--chip", "v5e", ...]`)."""
    # deferred: start-up
    from sim.runs.requests import REQUESTS, ReplayRequest

    args = parse(argv, parser=parser)
    cls = ReplayRequest if args.command == "export" else REQUESTS.get(args.command)
    if cls is None:
        raise TpusimError(f"tpusim {args.command} is not a simulating command; give one of "
                          f"{', '.join(REQUESTS)}")
    extra = {"as_command": args.command} if cls is ReplayRequest else {}
    return request_of(cls, args, **extra)


def dispatch(parser: Parser, argv: Sequence[str] | None) -> int:
    """Parse `argv` and run its command (raising `TpusimError`)."""
    args = parse(argv, parser=parser)
    if not getattr(args, "func", None):
        # A bare `tpusim` (or `tpusim --quiet`) is a usage error: one line on stderr naming
        # the fix, not the whole usage on stdout (where a script would read it as output).
        raise TpusimError("no command given; run `tpusim --help` for the commands, e.g. "
                          "`tpusim train --help`")
    # Progress bars on stderr, on a terminal only and not with --quiet: the runs report to
    # this callback for the extent of the command (sim/cli/progress.py).
    bars = terminal_progress(bool(args.quiet or getattr(args, "quiet_sub", False)))
    try:
        with reporting(bars):
            return int(args.func(args) or 0)
    finally:
        if bars is not None:
            bars.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = parser_for(argv)
    try:
        return dispatch(parser, argv)
    except TpusimError as exc:
        sys.stderr.write(f"tpusim: error: {one_line(error_text(exc, parser, argv))}\n")
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        sys.stderr.write("tpusim: interrupted\n")
        return 130
    except BrokenPipeError:  # pragma: no cover
        return 0
    except RecursionError:
        # Inputs are bounded in depth, so this is a bug; say so in one line.
        sys.stderr.write(f"tpusim: error: internal error: recursion too deep; {_REPORT}\n")
        return 2
    except MemoryError:
        sys.stderr.write("tpusim: error: out of memory; simulate a smaller pod, model or trace\n")
        return 2
    except Exception as exc:  # noqa: BLE001 - the last line of defence: never a traceback
        where = _where(exc)
        sys.stderr.write(
            f"tpusim: error: internal error: {type(exc).__name__}: "
            f"{one_line(str(exc))[:300]}{where}; {_REPORT}\n"
        )
        return 2


def error_text(exc: TpusimError, parser: Parser, argv: Sequence[str] | None) -> str:
    """A library error as the command line says it: each setting it names spelled as the flag
    that gives it (`seq_len` -> `--seq-len`, `common.flag_spelling`), the command's own flags
    first."""
    words = sys.argv[1:] if argv is None else list(argv)
    commands = parser.get_default("commands") or {}
    command = next((w for w in words if isinstance(w, str) and w in commands), None)
    return exc.render(flag_spelling(parser, command))


_REPORT = ("this is a bug in tpusim, please report it with the command line and input files "
           "(rerun with TPUSIM_DEBUG=1 for the traceback)")


def one_line(text: str) -> str:
    """Collapse whitespace so an error is always a single line, at most 2000 characters."""
    t = " ".join(text.split())
    t = t.removeprefix("tpusim: error: ").removeprefix("tpusim: ")
    return t if len(t) <= 2000 else t[:1997] + "..."


def _where(exc: BaseException) -> str:
    import os
    import traceback

    if os.environ.get("TPUSIM_DEBUG"):
        traceback.print_exception(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno})"
