"""What every `tpusim` command family shares: the one-line-error parser, size and coordinate
parsing, the pod arguments and their resolution, number formatting and JSON output."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from sim.overrides import set_pairs
from sim.runs.requests import CONVERTERS, REQUESTS
from topologies.errors import TpusimError
from topologies.validate import (
    CAPACITY_FACTOR_RANGE,
    MAX_SLICES,
    FlagError,
    one_of,
    short_repr,
)

# A value that starts with "-" but that argparse does not take for a negative number (it knows
# only -1 and -1.5): -inf, -nan, -1e5, -.5.
_DASHED_NUMBER = re.compile(r"-(?:[0-9.].*|inf|infinity|nan)", re.I | re.S)


class Parser(argparse.ArgumentParser):
    """argparse with single-line errors (no usage dump), exit code 2."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # `--seed -inf` would end in argparse's "argument --seed: expected one argument",
        # which names neither the value nor the fix: a flag that takes one value is given the
        # dashed number that follows it (as `--seed=-inf`), so its own check names the value.
        if args is not None:
            args, out = list(args), []
            i = 0
            while i < len(args):
                a = args[i]
                act = self._flag_action(a) if isinstance(a, str) else None
                if act is not None and act.nargs is None and i + 1 < len(args) \
                        and isinstance(args[i + 1], str) and _DASHED_NUMBER.fullmatch(args[i + 1]) \
                        and args[i + 1] not in self._option_string_actions:
                    out.append(f"{a}={args[i + 1]}")
                    i += 2
                    continue
                out.append(a)
                i += 1
            args = out
        return super().parse_known_args(args, namespace)

    def _flag_action(self, text: str):
        """The action of the flag `text` names: exactly, or by a unique prefix (argparse's
        abbreviations: `--see` is `--seed`); None otherwise (ambiguous, `--x=v`, not a flag)."""
        act = self._option_string_actions.get(text)
        if act is None and self.allow_abbrev and text.startswith("--") and "=" not in text:
            hits = {id(t[0]): t[0] for t in self._get_option_tuples(text)}
            act = next(iter(hits.values())) if len(hits) == 1 else None
        return act

    def _get_value(self, action, arg_string):
        # The settings' converters raise `FlagError` (a `TpusimError`, which argparse would
        # report as "invalid value"): their message names the flag, so argparse reports it as is.
        if callable(action.type):
            try:
                return action.type(arg_string)
            except FlagError as exc:
                raise argparse.ArgumentError(action, exc.render(flag_spelling(self))) from None
            except (TypeError, ValueError):
                pass  # argparse's own wording, below
        return super()._get_value(action, arg_string)

    def error(self, message: str) -> None:  # type: ignore[override]
        # A validating `type=` (FlagError) already names its flag: drop argparse's prefix.
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.S)
        if m and m.group(2).startswith(m.group(1)):
            message = m.group(2)
        message = " ".join(message.split())
        # argparse's `choices=` error lists every choice: suggest the nearest ones instead.
        m = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: (.*?) \(choose from (.*)\)$",
                     message, re.S)
        if m:
            import ast

            try:
                value = ast.literal_eval(m.group(2))
            except (ValueError, SyntaxError):
                value = m.group(2)
            choices = re.findall(r"'((?:[^'\\]|\\.)*)'", m.group(3))
            what = "command" if m.group(1) == "command" else m.group(1)
            message = f"unknown {what} {short_repr(value)}; {one_of(value, choices)}"
        raise TpusimError(f"{message[:500]} (see `{self.prog} --help`)")


# The Python calls a library message names as placeholders (a hint where to look), written as
# the command that does the same on the command line; and a request's listings,
# `help(TrainRequest)` (its settings) and `sim.overrides.allowed_keys(TrainRequest.SET_SCOPE)`
# (its override keys), both `tpusim train --help`.
TOPOLOGY_KEYS_CALL = "sim.overrides.allowed_keys(('chip',))"  # `tpusim topology`'s set keys
API_COMMANDS = {"sim.get_chip('v5e').to_dict()": "tpusim presets --json --chip v5e",
                TOPOLOGY_KEYS_CALL: "tpusim topology --help"}
_REQUEST_LISTING = re.compile(
    r"(?:help\((\w+)\)|sim\.overrides\.allowed_keys\((\w+)\.SET_SCOPE\))")


def api_command(name: str) -> str | None:
    """The command a Python call that a message names stands for (`API_COMMANDS`, a request's
    listing), or None."""
    if name in API_COMMANDS:
        return API_COMMANDS[name]
    m = _REQUEST_LISTING.fullmatch(name)
    if m is None:
        return None
    cls = m.group(1) or m.group(2)
    command = next((c for c, r in REQUESTS.items() if r.__name__ == cls), None)
    return None if command is None else f"tpusim {command} --help"


def flag_spelling(parser: argparse.ArgumentParser, command: str | None = None):
    """How this command line spells a setting a library error names (`TpusimError.render`):
    the option string of the parser's argument whose dest is the Python name (`seq_len` ->
    `--seq-len`, `quiet_sub` -> `--quiet`), the `command`'s subparser first, then the parser's
    own arguments, then every subcommand's; a name no argument has as its dest (`slice`,
    `bytes`, an override key) is `--` and the name with `-` for `_`; a Python call a message
    points to (`API_COMMANDS`) is the command that does the same."""
    options: dict[str, str] = {}
    # argparse keeps a parser's arguments in `_actions`, its subcommands' parsers in the
    # `choices` of its subparsers action.
    subs = [act.choices for act in parser._actions
            if isinstance(act, argparse._SubParsersAction)]
    chosen = [c[command] for c in subs if command in c]
    for p in (*chosen, parser, *(sp for c in subs for sp in c.values())):
        for act in p._actions:
            if act.option_strings:
                longs = [o for o in act.option_strings if o.startswith("--")]
                options.setdefault(act.dest, (longs or act.option_strings)[0])

    def spell(name: str) -> str:
        return api_command(name) or options.get(name) or "--" + name.replace("_", "-")

    return spell


def fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} us"


def fmt_bytes(b: float) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:.2f} {unit}"
    return f"{b:.0f} B"


# -- pod arguments shared by every simulating command ---------------------------------------
def add_pod_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pod")
    g.add_argument("--chip", help="chip preset (v4, v5e, v5p, v6e, v3, tpu7x) or a chip YAML file")
    g.add_argument("--slice", dest="slice_name", help="named slice, e.g. v5p-128 (4x4x4)")
    g.add_argument("--shape", help="explicit ICI shape, e.g. 8x16 or 4x4x4 (x, y, z order)")
    g.add_argument(
        "--wraparound", default="auto",
        help="auto (the generation's rule, default), none, all, or axes of the shape such "
             "as x,z or xz (each once)",
    )
    g.add_argument("--slices", type=CONVERTERS["slices"], default=1,
                   help=f"slices joined over DCN (default 1, at most {MAX_SLICES})")
    g.add_argument("--twist", action="store_true",
                   help="a twisted torus: the short axes' wraparound links land half the long "
                        "side along it (v4/v5p shapes k x k x 2k and k x 2k x 2k, each side a "
                        "multiple of 4; also a slice name ending in -twisted, e.g. "
                        "v4-256-twisted; default: plain)")
    p.add_argument("--quiet", dest="quiet_sub", action="store_true", help="no progress bar")


def add_command(sub, name: str, help_text: str, func, *,
                set_scope: tuple[str, ...] | None = None,
                positional: tuple[str, str] | None = None) -> argparse.ArgumentParser:
    """A simulating command's parser: its `positional` argument (name, help) if any, the pod
    group and `--quiet`, `--set` over `set_scope` (None: no --set), and `func` to run. The
    command's own arguments are added to the returned parser after these, so `--help` lists
    every command's arguments in the same order."""
    p = sub.add_parser(name, help=help_text)
    if positional is not None:
        p.add_argument(positional[0], help=positional[1])
    add_pod_args(p)
    if set_scope is not None:
        add_set_arg(p, set_scope)
    p.set_defaults(func=func)
    return p


def add_output_args(p: argparse.ArgumentParser, *, trace_chips: bool) -> None:
    """`--json`, `--out`, `--perfetto` (`--trace-chips` for steps with per-chip timelines),
    `--plots` and the collective `--algorithm` of the step-simulating commands."""
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write op/unit/link/memory tables (CSV+Parquet) + summary.json")
    p.add_argument("--perfetto", help="write a Perfetto trace (.pftrace; .json for Chrome)")
    if trace_chips:
        p.add_argument("--trace-chips",
                       help="chips to show in the Perfetto trace, e.g. 0-15 or all (default: "
                            "chip 0, which stands for every chip by SPMD symmetry)")
    p.add_argument("--plots", help="write PNG plots into this directory")
    p.add_argument("--chakra", metavar="DIR",
                   help="write the step as Chakra execution traces (ASTRA-sim's input) into DIR: "
                        "tpusim.<class>.et, one per chip class, the class's chips in its "
                        "metadata (default: no export; docs/howto/chakra.md)")
    p.add_argument("--chakra-every-chip", action="store_true",
                   help="with --chakra: one file per chip, tpusim.<rank>.et for every rank, as "
                        "ASTRA-sim reads them (default: one per chip class)")
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm for gathers/reductions (default auto)")


class OneCommand:
    """The subcommands action of a parser that will parse one command: only `wanted`'s parser
    is built (`register_commands` skips the others). A command's parser costs its flags'
    `add_argument` calls, and building all 25 commands' was about half of a small command's
    own CPU (`tpusim collective` on v4 16x16x16: 16 of 27 ms)."""

    def __init__(self, sub, wanted: str):
        self.sub, self.wanted = sub, wanted

    def wants(self, name: str) -> bool:
        return name == self.wanted

    def add_parser(self, name: str, **kwargs):
        return self.sub.add_parser(name, **kwargs)


def register_commands(sub, commands) -> None:
    """Register each (name, register(sub, name)) of a command family, in order (with a
    `OneCommand`, only the command it wants)."""
    for name, reg in commands:
        if not isinstance(sub, OneCommand) or sub.wants(name):
            reg(sub, name)


def add_set_arg(p: argparse.ArgumentParser, scope: tuple[str, ...]) -> None:
    """`--set KEY=VALUE` (repeatable), accepting the key groups in `scope` (sim/overrides.py)."""
    # deferred: start-up
    from sim.overrides import allowed_keys

    examples = {"chip": "ici_link_bytes_per_s=x2", "topology": "topology.wraparound=none",
                "collective": "collective.algorithm=ring", "model": "model.d_ff=28672"}
    p.add_argument(
        "--set", dest="set", action="append", default=[], metavar="KEY=VALUE",
        help="what-if override (repeatable), e.g. "
             + ", ".join(f"--set {examples[s]}" for s in scope)
             + f"; xF multiplies the preset value. Keys: {', '.join(allowed_keys(scope))}",
    )
    p.set_defaults(set_scope=scope)


# -- flags: what a command was given, recorded under `inputs` and replayed by `rerun` --------
# Flags that say where output goes; they do not change a result, so results do not record them.
OUTPUT_FLAGS = frozenset({"json", "out", "perfetto", "plots", "trace-chips", "quiet", "output",
                          "chakra", "chakra-every-chip"})


# Flags that send the command line to another command before it is parsed (`plan --serve`
# is `plan-serve`, sim.cli.serve_plan_argv): no setting of the command they appear on.
_REDIRECT_FLAGS = frozenset({"serve"})


def flag_specs(p: argparse.ArgumentParser) -> tuple[tuple[str, str, str], ...]:
    """(flag name without dashes, argparse dest, kind) for every input flag of a subcommand;
    kind is `positional`, `switch` (store_true), `append` or `value`."""
    specs = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if a.option_strings:
            name = max(a.option_strings, key=len).lstrip("-")
            kind = ("switch" if isinstance(a, argparse._StoreTrueAction)
                    else "append" if isinstance(a, argparse._AppendAction) else "value")
        else:
            name, kind = a.dest, "positional"
        if name not in OUTPUT_FLAGS and name not in _REDIRECT_FLAGS:
            specs.append((name, a.dest, kind))
    return tuple(specs)


# -- MoE router settings -------------------------------------------------------------------
def add_moe_args(p: argparse.ArgumentParser) -> None:
    """`--expert-skew/--capacity-factor/--seed` for `compile` (which has no pod to perturb; the
    simulating commands take them through `add_perturbation_args`)."""
    g = p.add_argument_group("MoE routing")
    g.add_argument("--expert-skew", type=CONVERTERS["expert_skew"], default=0.0, metavar="S",
                   help="router imbalance: expert loads follow Zipf(S) (0 = uniform, default; "
                        "MoE models only)")
    g.add_argument("--capacity-factor", type=CONVERTERS["capacity_factor"], default=None,
                   metavar="C",
                   help="MaxText's dropping path: each expert takes at most C x tokens x top_k "
                        "/ num_experts tokens per sequence, the rest are dropped; dense one-hot "
                        f"dispatch/combine einsums are charged; C in "
                        f"{CAPACITY_FACTOR_RANGE.interval}, at least one token per expert "
                        f"(default: dropless)")
    g.add_argument("--seed", type=CONVERTERS["seed"], default=0,
                   help="which chip of the expert axis holds the hottest experts in each layer "
                        "(default 0)")


def emit_json(obj: Any) -> None:
    """Print one JSON object; a NaN or infinity in it is an internal error (never printed)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


def show_path(path: str | Path) -> str:
    """A path as the user should read it: no doubled or trailing slashes."""
    return os.path.normpath(str(path))


# -- outputs: every one validated before the first byte is written ----------------------------
def check_outputs(args: argparse.Namespace) -> None:
    """Validate every output path (and their collisions) before simulating, so a bad one
    writes nothing. `--trace-chips` is checked against the pod by `check_trace_chips`."""
    # deferred: start-up
    from sim.export.output import check_output_dir, check_output_file

    out = getattr(args, "out", None)
    plots = getattr(args, "plots", None)
    perfetto = getattr(args, "perfetto", None)
    if getattr(args, "trace_chips", None) is not None and not perfetto:
        raise TpusimError("--trace-chips selects chips for --perfetto; add --perfetto FILE")
    chakra = getattr(args, "chakra", None)
    if getattr(args, "chakra_every_chip", False) and chakra is None:
        raise TpusimError("--chakra-every-chip selects the files of --chakra; add --chakra DIR")
    for flag, value in (("--out", out), ("--plots", plots), ("--perfetto", perfetto),
                        ("--chakra", chakra)):
        if value is not None and not str(value).strip():
            raise TpusimError(f"{flag} is empty; give a path, or leave {flag} out")
    if chakra is not None:
        check_output_dir(chakra, "--chakra directory")
        check_not_inputs(args, "--chakra", chakra, directory=True)
    if out is not None:
        check_output_dir(out, "--out directory")
        check_not_inputs(args, "--out", out, directory=True)
    if plots is not None:
        check_output_dir(plots, "--plots directory")
        check_not_inputs(args, "--plots", plots, directory=True)
    if perfetto is not None:
        check_output_file(perfetto, "--perfetto file")
        check_not_inputs(args, "--perfetto", perfetto)
        real = os.path.realpath(perfetto)
        for flag, d in (("--out", out), ("--plots", plots)):
            if d is None:
                continue
            rd = os.path.realpath(d)
            if real == rd or rd.startswith(real + os.sep):
                raise TpusimError(
                    f"--perfetto {show_path(perfetto)} and {flag} {show_path(d)} are the same "
                    f"path; give the trace a file name of its own"
                )
            if os.path.dirname(real) == rd and os.path.basename(real) in _dir_outputs(args, flag):
                raise TpusimError(
                    f"--perfetto {show_path(perfetto)} would be overwritten by the {flag} files; "
                    f"give the trace another name"
                )


# The input files a command may read, by argument: an output must not be one of them.
_INPUT_ARGS = (("trace", "the trace file"), ("program", "the HLO program"),
               ("model", "the --model file"), ("chip", "the --chip file"),
               ("scenario", "the --scenario file"), ("failure_trace", "the --failure-trace file"))


def check_not_inputs(args: argparse.Namespace, flag: str, path: Any, *,
                     directory: bool = False) -> None:
    """An output that would overwrite a file the command reads is refused before anything runs:
    `tpusim export t.trace --perfetto t.trace` replaced the trace it had just read (and
    `compile --model m.yaml -o m.yaml` the model). A directory output is checked for the files
    it writes (`_dir_outputs`)."""
    if path is None or not str(path).strip():
        return
    real = os.path.realpath(path)
    for dest, what in _INPUT_ARGS:
        given = getattr(args, dest, None)
        if not isinstance(given, str) or not given or not os.path.isfile(given):
            continue
        src = os.path.realpath(given)
        if directory:
            hit = os.path.dirname(src) == real and os.path.basename(src) in _dir_outputs(args,
                                                                                         flag)
        else:
            hit = src == real or (os.path.exists(path) and os.path.samefile(path, given))
        if hit:
            raise TpusimError(
                f"{flag} {show_path(path)} would overwrite {what} {show_path(given)}, which "
                f"this command reads; give the output another name")


def check_trace_file_size(text: str, flag: str, fix: str) -> None:
    """A trace about to be written must be one `tpusim replay` reads: a 239,934-op LLaMA-3-405B
    step (inside the 250,000-op limit) compiled to 41 MB, over the 32 MiB a trace file may
    hold, so `compile -o` wrote a file that `replay` then refused (hard10)."""
    # deferred: start-up
    from topologies.validate import MAX_TRACE_FILE_BYTES

    size = len(text.encode("utf-8"))
    if size > MAX_TRACE_FILE_BYTES:
        raise TpusimError(
            f"{flag}: the trace is {size:,} bytes, over the {MAX_TRACE_FILE_BYTES:,} a trace file "
            f"may hold (replay would refuse it), so nothing was written; {fix}")


def _dir_outputs(args: argparse.Namespace, flag: str) -> set[str]:
    """File names a command writes into its --out / --plots directory."""
    if flag == "--out":
        names = {"summary.json", "serve_sweep.csv", "serve_sweep_pareto.png"}
        for t in ("ops", "units", "links", "memory", "timeline", "chips", "seeds", "intervals",
                  "events"):
            names |= {f"{t}.csv", f"{t}.parquet"}
        return names
    return {"timeline.png", "breakdown.png", "utilization.png", "links_on_torus.png",
            "collective_timeline.png", "collective_links.png", "chip_compute.png",
            "chip_collective_wait.png", "chip_slowdown.png", "goodput_timeline.png",
            "goodput_vs_interval.png"}


def check_trace_chips(args: argparse.Namespace, num_chips: int) -> None:
    """Parse `--trace-chips` against the pod (before anything runs); stores `args.chip_list`."""
    # deferred: start-up
    from sim.export.perfetto import parse_chip_list

    args.chip_list = parse_chip_list(getattr(args, "trace_chips", None), num_chips)


# -- perturbations shared by collective, train, decode, prefill and replay ------------------
def add_perturbation_args(p: argparse.ArgumentParser, *, description: str | None = None) -> None:
    """The scenario flags (see `topologies/scenario.py`); list flags are repeatable."""
    g = p.add_argument_group("perturbations (repeatable; also in a --scenario YAML)",
                             description)
    g.add_argument("--scenario", help="scenario YAML file (keys slow_chip, slow_link, dead_link, "
                                      "chip_variation, seed, expert_skew, capacity_factor, "
                                      "failed_chip, spare_cubes, no_ocs, twist)")
    g.add_argument("--slow-chip", action="append", default=[], metavar="X,Y[,Z]:FACTOR",
                   help="that chip's MXU, VPU and HBM run at FACTOR (> 1 = faster)")
    g.add_argument("--slow-link", action="append", default=[],
                   metavar="X,Y[,Z]:AXISDIR[:FACTOR]",
                   help="the link leaving the chip along AXISDIR (x+, y-, ...) runs at FACTOR "
                        "of its bandwidth (default 0.5; > 1 = faster)")
    g.add_argument("--dead-link", action="append", default=[], metavar="X,Y[,Z]:AXISDIR",
                   help="that directed link carries nothing; routes detour around it")
    g.add_argument("--chip-variation", type=CONVERTERS["chip_variation"], default=None,
                   metavar="SIGMA",
                   help="every chip's speed drawn from a lognormal, median 1, log-sd SIGMA")
    g.add_argument("--seed", type=CONVERTERS["seed"], default=None,
                   help="seed of the --chip-variation draw and of which chips hold the MoE "
                        "router's hottest experts (default 0)")
    g.add_argument("--expert-skew", type=CONVERTERS["expert_skew"], default=None,
                   metavar="S", help="MoE router imbalance: expert loads drawn Zipf(S) "
                                     "(default 0: uniform)")
    g.add_argument("--capacity-factor", type=CONVERTERS["capacity_factor"], default=None,
                   metavar="C", help=f"MoE expert capacity (tokens above it are dropped); C "
                                     f"in {CAPACITY_FACTOR_RANGE.interval}, at least one token "
                                     f"per expert (default: dropless)")
    g.add_argument("--failed-chip", action="append", default=[], metavar="X,Y[,Z]",
                   help="that chip has failed: on a v4/v5p slice of whole cubes with a spare "
                        "(--spare-cubes) its cube is swapped for one (full speed, plus the "
                        "one-time ocs_reconfiguration_s); otherwise its links are dead and "
                        "routes detour around it, refused where the chip itself is needed")
    if "--spare-cubes" in p._option_string_actions:
        return  # goodput: its own spares and switches, for its failures
    g.add_argument("--spare-cubes", type=CONVERTERS["spare_cubes"], default=None, metavar="N",
                   help="spare 4x4x4 cubes the optical switches may swap in for cubes holding "
                        "a --failed-chip (default 0; at most the pod's cubes the slice leaves "
                        "free)")
    g.add_argument("--no-ocs", action="store_true",
                   help="a static pod: the switches do not swap cubes, so a --failed-chip is "
                        "routed around whatever the spares (default: they swap)")


def add_step_perturbation_args(p: argparse.ArgumentParser, *, power_cap: bool = True) -> None:
    """The perturbation flags plus the step engine's `--mode` (train, replay, decode, prefill,
    serve) and, unless `power_cap` is false (serve: not yet capped), `--power-cap`."""
    add_perturbation_args(p)
    p.add_argument("--mode", default="auto", choices=["auto", "per-chip"],
                   help="auto (default): chips whose whole step is identical are simulated "
                        "once (exact); "
                        "per-chip: one actor per chip, every chip's links its own (the oracle)")
    if not power_cap:
        return
    p.add_argument("--power-cap", type=CONVERTERS["power_cap"], default=None, metavar="W",
                   help="per-chip power cap in watts: when the chip's peak power over a 1 ms "
                        "window exceeds it, the MXU and VPU clock scales down (DVFS) until it "
                        "fits; the result's power_cap section shows the clock reached and the "
                        "slowdown (default: no cap)")


# -- argv -> request ---------------------------------------------------------------------------
# The few settings whose argparse dest differs from their request field.
_DESTS = {"slice": "slice_name", "bytes": "nbytes", "overrides": "set"}


def request_of(cls, args: argparse.Namespace, **extra):
    """The typed request of a parsed command line (its `--set` overrides validated now, so a
    bad one is refused before anything else is checked)."""
    kw = {}
    for name in cls.FLAGS:
        v = getattr(args, _DESTS.get(name, name), None)
        if name == "overrides":
            v = set_pairs(v or ())
        if v is not None:
            kw[name] = v
    req = cls(**kw, **extra)
    req.parsed_overrides()
    return req


# -- energy and cost ---------------------------------------------------------------------------
_UNIT_WORDS = {"mxu": "MXU", "vpu": "VPU", "hbm": "HBM", "ici": "ICI", "dcn": "DCN",
               "pcie": "PCIe", "static": "static", "host": "host", "overhead": "overhead"}


def print_failures(s: dict[str, Any]) -> None:
    """The failed-chips line of a text report (the result's `failures` section, if any)."""
    f = s.get("failures")
    if not f or not f["failed_chips"]:
        return
    parts = []
    if f["swapped_cubes"]:
        parts.append(f"cube {'; '.join(f['swapped_cubes'])} swapped for a spare "
                     f"({f['spare_cubes_left']} of {f['spare_cubes']} left), "
                     f"{fmt_time(f['reconfiguration_s'])} once to reconfigure the switches, "
                     f"the slice whole again")
    if f["routed_around"]:
        parts.append(f"{', '.join(f['routed_around'])} routed around ({f['dead_links']} dead "
                     f"links; {f['why_not_swapped']})")
    print(f"  failed chips     {', '.join(f['failed_chips'])}: {'; '.join(parts)}")


def print_energy(s: dict[str, Any], *, per: str = "step") -> None:
    """The energy, power and cost lines of a text report (`s`: the result's summary with its
    `energy` and `cost` sections; `per`: what one run is, "step" or "collective")."""
    e, c = s.get("energy"), s.get("cost")
    if e is None:
        return
    total = e["step_j"]
    parts = ", ".join(f"{_UNIT_WORDS[u]} {v / total:.0%}" for u, v in e["step_j_by_unit"].items()
                      if total > 0 and v / total >= 0.005)
    print(f"  energy           {total:.4g} J per {per} ({e['step_j_per_chip']:.4g} J per chip): "
          f"{parts}")
    print(f"  chip power       {e['chip_power_w_mean']:.1f} W mean, "
          f"{e['chip_power_w_peak']:.1f} W peak ({e['power_window_s'] * 1e3:.3g} ms window)")
    for k in e.get("by_chip_class", ())[:8]:
        print(f"    class {k['chip_class']:<3} chip {k['chip']:<10} x{k['num_chips']:<5} "
              f"{k['chip_power_w_mean']:.1f} W mean, {k['chip_power_w_peak']:.1f} W peak")
    cap = s.get("power_cap")
    if cap is not None:
        state = (f"clock {cap['clock_scale']:.3f}, {cap['slowdown']:.3f}x the uncapped step "
                 f"time (peak {cap['uncapped_chip_power_w_peak']:.1f} W uncapped)"
                 if cap["capped"] else
                 f"not reached (peak {cap['uncapped_chip_power_w_peak']:.1f} W)")
        print(f"  power cap        {cap['cap_w']:g} W: {state}")
    if c is None or c["usd_per_hour"] is None:
        print("  cost             no list price for this chip (set usd_per_chip_hour)")
        return
    tok = (f", ${c['usd_per_million_tokens']:.4g} per million tokens"
           if c["usd_per_million_tokens"] is not None else "")
    jpt = f"{e['j_per_token']:.4g} J per token, " if e["j_per_token"] is not None else ""
    print(f"  cost             {jpt}${c['usd_per_step']:.4g} per {per}{tok} "
          f"(${c['usd_per_hour']:.2f} per hour at ${c['usd_per_chip_hour']:.2f} per chip-hour)")
