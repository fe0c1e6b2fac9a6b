"""What every `tpusim` command family shares: the one-line-error parser, size and coordinate
parsing, the pod arguments and their resolution, number formatting and JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.scenario import CAPACITY_FACTOR_RANGE, CHIP_VARIATION_RANGE, EXPERT_SKEW_RANGE
from topologies.validate import (
    MAX_BYTES,
    MAX_SLICES,
    FlagError,
    ascii_float,
    ascii_int,
    int_flag,
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

    def error(self, message: str) -> None:  # type: ignore[override]
        # A validating `type=` (FlagError) already names its flag: drop argparse's prefix.
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.S)
        if m and m.group(2).startswith(m.group(1)):
            message = m.group(2)
        message = " ".join(message.split())
        raise TpusimError(f"{message[:500]} (see `{self.prog} --help`)")


# Byte suffixes, case-sensitive: `Mb`/`Gib` would be bits, so they are refused, not guessed.
_BYTE_UNITS = {
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1,
}


def parse_bytes(text: str, flag: str = "--bytes") -> int:
    """`33554432`, `32MiB`, `1GiB`, `4.5e6`, `10MB` -> bytes (at most `MAX_BYTES`)."""
    t = str(text).strip()
    m = re.fullmatch(r"([0-9.eE+-]+)\s*([A-Za-z]*)", t)
    hint = (f"give bytes such as 33554432, 32MiB or 1GiB (suffixes: "
            f"{', '.join(_BYTE_UNITS)}; case matters, b/Mb/Gib would be bits)")
    if not m or (m.group(2) and m.group(2) not in _BYTE_UNITS):
        raise TpusimError(f"{flag} {short_repr(text)} is not a size; {hint}")
    try:
        value = float(m.group(1)) * _BYTE_UNITS.get(m.group(2), 1)
    except ValueError:
        raise TpusimError(f"{flag} {short_repr(text)} is not a size; {hint}") from None
    if value < 0:
        raise TpusimError(f"{flag} {short_repr(text)} must be > 0 (a size in bytes)")
    if value > MAX_BYTES:
        raise TpusimError(
            f"{flag} {short_repr(text)} is over the limit of {MAX_BYTES:,} bytes (1 PiB); give a "
            f"smaller size"
        )
    if not value.is_integer():
        raise TpusimError(f"{flag} {short_repr(text)} is not a whole number of bytes")
    return int(value)


def parse_coords(text: str, flag: str) -> tuple[int, ...]:
    parts = str(text).split(",")
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\s*[0-9]{1,6}\s*", p) for p in parts):
        raise TpusimError(
            f"{flag} {short_repr(text)} is not chip coordinates; give 1 to 3 integers >= 0 like "
            f"0,0 or 1,2,3"
        )
    return tuple(int(c) for c in parts)


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
    g.add_argument("--slices", type=int_flag("--slices", lo=1, hi=MAX_SLICES), default=1,
                   help=f"slices joined over DCN (default 1, at most {MAX_SLICES})")
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
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm for gathers/reductions (default auto)")


def register_commands(sub, commands) -> None:
    """Register each (name, register(sub, name)) of a command family, in order."""
    for name, reg in commands:
        reg(sub, name)


def add_set_arg(p: argparse.ArgumentParser, scope: tuple[str, ...]) -> None:
    """`--set KEY=VALUE` (repeatable), accepting the key groups in `scope` (sim/overrides.py)."""
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


def resolve_overrides(args: argparse.Namespace) -> None:
    """Parse `--set` into `args.overrides`; `topology.wraparound` and `collective.algorithm`
    replace `--wraparound` and `--algorithm` (an override is applied last)."""
    from sim.overrides import parse_overrides

    ov = parse_overrides(args.set, args.set_scope, command=f"tpusim {args.command}")
    args.overrides = ov
    if ov.wraparound is not None:
        args.wraparound = ov.wraparound
    if ov.algorithm is not None:
        args.algorithm = ov.algorithm


def overrides(args: argparse.Namespace):
    """The command's parsed `--set` overrides (empty when the command takes none)."""
    from sim.overrides import Overrides

    return getattr(args, "overrides", None) or Overrides()


def resolve_pod(args: argparse.Namespace):
    """(ChipSpec, Topology) from --chip/--slice/--shape/--wraparound/--slices and `--set`.

    A chip object handed over by the Python API or `rerun` (`args.chip_spec`) replaces loading
    `--chip`; the preset or file's chip, before overrides, is kept as `args.base_chip`.
    """
    from sim.hardware import load_chip
    from topologies.slices import SLICES, resolve_topology

    base = getattr(args, "chip_spec", None)
    if base is None:
        chip_arg = args.chip
        if chip_arg is None:
            if args.slice_name is None:
                raise TpusimError("give --chip (e.g. v5e) with --shape, or --slice (e.g. v5p-128)")
            chip_arg = SLICES.get(args.slice_name).chip
        base = load_chip(chip_arg)
    args.base_chip = base
    chip = overrides(args).apply_chip(base)
    topo = resolve_topology(
        chip_name=chip.name,
        wrap_rule=chip.generation_rule,
        max_pod_shape=chip.max_pod_shape,
        slice_name=args.slice_name,
        shape=args.shape,
        wraparound=args.wraparound,
        num_slices=args.slices,
    )
    return chip, topo


def resolve_model(args: argparse.Namespace):
    """The model from --model (or `args.model_spec`), with the `model.*` overrides applied."""
    from workloads.models import load_model

    base = getattr(args, "model_spec", None)
    if base is None:
        base = load_model(args.model)
    args.base_model = base
    return overrides(args).apply_model(base)


# -- flags: what a command was given, recorded under `inputs` and replayed by `rerun` --------
# Flags that say where output goes; they do not change a result, so results do not record them.
OUTPUT_FLAGS = frozenset({"json", "out", "perfetto", "plots", "trace-chips", "quiet", "output"})


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
        if name not in OUTPUT_FLAGS:
            specs.append((name, a.dest, kind))
    return tuple(specs)


def record_flags(args: argparse.Namespace) -> dict[str, Any]:
    """{flag: value} as given (defaults filled in); `set` as {key: value}, later wins."""
    out: dict[str, Any] = {}
    for name, dest, _kind in args.flag_specs:
        v = getattr(args, dest, None)
        if name == "set":
            pairs: dict[str, str] = {}
            for item in v or ():
                key, _, value = str(item).partition("=")
                pairs[key.strip()] = value.strip()
            v = pairs
        elif isinstance(v, list):
            v = list(v)
        out[name] = v
    return out


def argv_from_flags(command: str, flags: dict[str, Any],
                    specs: tuple[tuple[str, str, str], ...], *,
                    caller: str | None = None) -> list[str]:
    """The command line that gives these flags (the inverse of `record_flags`). `caller`: the
    Python API function they were given to (`sim.train`), which a wrong type names instead of
    a recorded result file."""
    known = {name: kind for name, _dest, kind in specs}
    unknown = sorted(set(flags) - set(known))
    if unknown:
        raise TpusimError(
            f"tpusim {command} has no flag(s) {', '.join(unknown)}; it takes: "
            f"{', '.join(known)}"
        )
    head, tail = [command], []
    for name, value in flags.items():
        kind = known[name]
        _check_flag_value(command, name, kind, value, caller)
        if kind == "positional":
            head.append(str(value))
        elif kind == "switch":
            if value:
                tail.append(f"--{name}")
        elif kind == "append":
            items = value.items() if isinstance(value, dict) else None
            if items is not None:
                tail += [f"--{name}={k}={v}" for k, v in items]
            else:
                tail += [f"--{name}={v}" for v in (value or ())]
        elif value is not None:
            tail.append(f"--{name}={value}")
    return head + tail


def _check_flag_value(command: str, name: str, kind: str, value: Any,
                      caller: str | None = None) -> None:
    """A recorded flag's value has the type `record_flags` writes for its kind (a result file
    edited by hand, or a Python API call, may hold anything)."""
    from topologies.validate import short_repr

    scalar = (str, int, float)
    if kind == "switch":
        ok = isinstance(value, bool) or value is None
        want = "true or false"
    elif kind == "append":
        ok = value is None or (isinstance(value, list) and all(
            isinstance(v, scalar) and not isinstance(v, bool) for v in value)) or (
            isinstance(value, dict) and all(isinstance(v, scalar) and not isinstance(v, bool)
                                            for v in value.values()))
        want = "a list of values" + (" (an object KEY: VALUE for set)" if name == "set" else "")
    else:
        ok = value is None or (isinstance(value, scalar) and not isinstance(value, bool))
        want = "one number or text"
    if not ok and caller is not None:
        key = name.replace("-", "_")
        raise TpusimError(
            f"{caller}({key}={short_repr(value)}): {key} takes "
            f"{_API_WANT.get(key if key == 'set' else kind, _API_WANT[''])}"
        )
    if not ok:
        raise TpusimError(
            f"inputs.flags.{short_repr(name)} of tpusim {command} is {short_repr(value)}; it "
            f"must be {want} (the result file was edited); restore it or rerun the command"
        )


# What a flag's keyword takes in a Python API call (`sim.train(seed=...)`), by kind of flag.
_API_WANT = {"switch": "True or False",
             "append": "a list of values such as ['0,0:x+:0.5'] (one per flag given)",
             "set": "a dict of keys to numbers or text such as {'ici_link_bytes_per_s': 'x2'}",
             "": "one number or text, as its flag takes on the command line (e.g. 8 or 'full')"}


def base_inputs(args: argparse.Namespace, chip=None, topology=None) -> dict[str, Any]:
    """The `inputs` every result carries: command, version, flags, overrides, chip, topology."""
    from sim.runs import describe_chip, describe_topology, tpusim_version

    out: dict[str, Any] = {
        "command": args.command,
        "tpusim_version": tpusim_version(),
        "flags": args.flags,
        "overrides": overrides(args).resolved(getattr(args, "base_chip", None),
                                              getattr(args, "base_model", None)),
    }
    if chip is not None:
        out["chip"] = describe_chip(chip)
    if topology is not None:
        out["topology"] = describe_topology(topology)
        if hasattr(args, "scenario"):  # the command takes perturbations: record the merged set
            out["perturbations"] = scenario_from_args(args, topology).to_dict()
    return out


# -- MoE router settings -------------------------------------------------------------------
def add_moe_args(p: argparse.ArgumentParser) -> None:
    """`--expert-skew/--capacity-factor/--seed` for `compile` (which has no pod to perturb; the
    simulating commands take them through `add_perturbation_args`)."""
    g = p.add_argument_group("MoE routing")
    g.add_argument("--expert-skew", type=_float_arg("--expert-skew"), default=0.0, metavar="S",
                   help="router imbalance: expert loads follow Zipf(S) (0 = uniform, default; "
                        "MoE models only)")
    g.add_argument("--capacity-factor", type=_float_arg("--capacity-factor"), default=None,
                   metavar="C",
                   help="MaxText's dropping path: each expert takes at most C x tokens x top_k "
                        "/ num_experts tokens per sequence, the rest are dropped; dense one-hot "
                        f"dispatch/combine einsums are charged; C in "
                        f"{CAPACITY_FACTOR_RANGE.interval}, at least one token per expert "
                        f"(default: dropless)")
    g.add_argument("--seed", type=_seed_arg, default=0,
                   help="which chip of the expert axis holds the hottest experts in each layer "
                        "(default 0)")


def moe_config(args: argparse.Namespace, scenario=None):
    """`MoeConfig` from a validated `Scenario` (simulating commands) or from the `add_moe_args`
    flags (`compile`)."""
    from workloads.moe import MoeConfig

    if scenario is not None:
        return MoeConfig(expert_skew=float(scenario.expert_skew),
                         capacity_factor=scenario.capacity_factor, seed=int(scenario.seed))
    return MoeConfig(expert_skew=args.expert_skew, capacity_factor=args.capacity_factor,
                     seed=args.seed)


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
    from sim.export.output import check_output_dir, check_output_file

    out = getattr(args, "out", None)
    plots = getattr(args, "plots", None)
    perfetto = getattr(args, "perfetto", None)
    if getattr(args, "trace_chips", None) is not None and not perfetto:
        raise TpusimError("--trace-chips selects chips for --perfetto; add --perfetto FILE")
    for flag, value in (("--out", out), ("--plots", plots), ("--perfetto", perfetto)):
        if value is not None and not str(value).strip():
            raise TpusimError(f"{flag} is empty; give a path, or leave {flag} out")
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
               ("scenario", "the --scenario file"))


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
        for t in ("ops", "units", "links", "memory", "timeline", "chips"):
            names |= {f"{t}.csv", f"{t}.parquet"}
        return names
    return {"timeline.png", "breakdown.png", "utilization.png", "links_on_torus.png",
            "collective_timeline.png", "chip_finish_times.png"}


def check_trace_chips(args: argparse.Namespace, num_chips: int) -> None:
    """Parse `--trace-chips` against the pod (before anything runs); stores `args.chip_list`."""
    from sim.export.perfetto import parse_chip_list

    args.chip_list = parse_chip_list(getattr(args, "trace_chips", None), num_chips)


# -- perturbations shared by collective, train, decode, prefill and replay ------------------
def add_perturbation_args(p: argparse.ArgumentParser, *, description: str | None = None) -> None:
    """The scenario flags (see `topologies/scenario.py`); list flags are repeatable."""
    g = p.add_argument_group("perturbations (repeatable; also in a --scenario YAML)",
                             description)
    g.add_argument("--scenario", help="scenario YAML file (keys slow_chip, slow_link, dead_link, "
                                      "chip_variation, seed, expert_skew, capacity_factor)")
    g.add_argument("--slow-chip", action="append", default=[], metavar="X,Y[,Z]:FACTOR",
                   help="that chip's MXU, VPU and HBM run at FACTOR (> 1 = faster)")
    g.add_argument("--slow-link", action="append", default=[],
                   metavar="X,Y[,Z]:AXISDIR[:FACTOR]",
                   help="the link leaving the chip along AXISDIR (x+, y-, ...) runs at FACTOR "
                        "of its bandwidth (default 0.5; > 1 = faster)")
    g.add_argument("--dead-link", action="append", default=[], metavar="X,Y[,Z]:AXISDIR",
                   help="that directed link carries nothing; routes detour around it")
    g.add_argument("--chip-variation", type=_float_arg("--chip-variation"), default=None,
                   metavar="SIGMA",
                   help="every chip's speed drawn from a lognormal, median 1, log-sd SIGMA")
    g.add_argument("--seed", type=_seed_arg, default=None,
                   help="seed of the --chip-variation draw and of which chips hold the MoE "
                        "router's hottest experts (default 0)")
    g.add_argument("--expert-skew", type=_float_arg("--expert-skew"), default=None,
                   metavar="S", help="MoE router imbalance: expert loads drawn Zipf(S) "
                                     "(default 0: uniform)")
    g.add_argument("--capacity-factor", type=_float_arg("--capacity-factor"), default=None,
                   metavar="C", help=f"MoE expert capacity (tokens above it are dropped); C "
                                     f"in {CAPACITY_FACTOR_RANGE.interval}, at least one token "
                                     f"per expert (default: dropless)")


# The ranges `Scenario` and `MoeConfig` check (and say in their errors).
_FLOAT_RANGES = {"--chip-variation": CHIP_VARIATION_RANGE.text,
                 "--expert-skew": EXPERT_SKEW_RANGE.text,
                 "--capacity-factor": CAPACITY_FACTOR_RANGE.text}


def _float_arg(flag: str):
    """A number flag whose range the `Scenario` / `MoeConfig` checks (with the same key in a
    --scenario file): read in ASCII and finite here, so that the error quotes what was given
    (`1e400`, not the `inf` it reads as)."""
    rng = _FLOAT_RANGES[flag]

    def conv(text: str) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{flag} {short_repr(text)} is not a number; give {rng}") from None
        if not math.isfinite(v):
            raise FlagError(f"{flag} {short_repr(text)} is not finite; give {rng}")
        return v

    conv.__name__ = "number"  # as `float_flag`'s (the fuzz generators find number flags by it)
    return conv


# Numpy's generators take seeds below 2^63 (as `Scenario` checks for a --scenario file).
SEED_RANGE = "a whole number in [0, 2^63)"


def _seed_arg(text: str) -> int:
    try:
        v = ascii_int(text)
    except ValueError:
        raise FlagError(f"--seed {short_repr(text)} is not a whole number in ASCII digits; "
                        f"give {SEED_RANGE}") from None
    if not 0 <= v < 2**63:
        raise FlagError(f"--seed {short_repr(v)} is out of range; give {SEED_RANGE}")
    return v


_seed_arg.__name__ = "integer"  # as `int_flag`'s


def scenario_from_args(args: argparse.Namespace, topology):
    """The `Scenario` of `--scenario FILE` plus the perturbation flags, validated against
    `topology` (one-line error for anything that does not fit). Flags add to the file's lists
    and override its scalars."""
    from topologies.scenario import Scenario, load_scenario, scenario_from_flags

    recorded = getattr(args, "scenario_spec", None)
    if recorded is not None:  # `rerun`: the scenario the result recorded, not the file's today
        recorded.validate(topology)
        return recorded
    base = load_scenario(args.scenario) if getattr(args, "scenario", None) else Scenario()
    flags = scenario_from_flags(
        slow_chip=getattr(args, "slow_chip", []) or [],
        slow_link=getattr(args, "slow_link", []) or [],
        dead_link=getattr(args, "dead_link", []) or [],
        chip_variation=(args.chip_variation if getattr(args, "chip_variation", None) is not None
                        else 0.0),
        seed=args.seed if getattr(args, "seed", None) is not None else 0,
        expert_skew=(args.expert_skew if getattr(args, "expert_skew", None) is not None
                     else 0.0),
        capacity_factor=getattr(args, "capacity_factor", None),
    )
    scenario = base.merged(flags)
    scenario.validate(topology)
    return scenario


def add_step_perturbation_args(p: argparse.ArgumentParser) -> None:
    """The perturbation flags plus the step engine's `--mode` (train, replay, decode, prefill)."""
    add_perturbation_args(p)
    p.add_argument("--mode", default="auto", choices=["auto", "per-chip"],
                   help="auto (default): chips whose whole step is identical are simulated "
                        "once (exact); "
                        "per-chip: one actor per chip, every chip's links its own (the oracle)")


def simulate_step(args: argparse.Namespace, trace, chip, topology, *, overlap=None):
    """Replay `trace` with the perturbations of `args` on the per-chip engine (one chip class,
    and `replay`'s result to the last bit, when nothing is perturbed)."""
    from sim.executors import simulate_step as run_step

    config = per_chip_config(args, trace, topology)
    return run_step(trace, chip, topology, executor=getattr(args, "mode", "auto") or "auto",
                    config=config, algorithm=args.algorithm, overlap=overlap)


def check_router_matches_trace(scenario, trace) -> None:
    """`--expert-skew/--capacity-factor` shape the compiled MoE program (its all-to-all volumes
    and expert matmuls): a step compiled here applies them; a trace compiled earlier (`replay`)
    carries its own router, so other values are refused rather than silently ignored."""
    moe = trace.meta.get("moe")
    if not trace.meta.get("moe_scenario_applied") or not isinstance(moe, dict):
        raise TpusimError(
            "--expert-skew/--capacity-factor apply to MoE models only, and this trace has no "
            "MoE router (a dense model, or written by an older tpusim); drop them"
        )
    skew = float(moe.get("expert_skew", 0.0))
    cap = moe.get("capacity_factor")
    if skew != float(scenario.expert_skew) or (cap is None) != (scenario.capacity_factor is None) \
            or (cap is not None and float(cap) != float(scenario.capacity_factor)):
        raise TpusimError(
            f"this trace was compiled with --expert-skew {skew:g}"
            + (f" --capacity-factor {float(cap):g}" if cap is not None else "")
            + f", not --expert-skew {float(scenario.expert_skew):g}"
            + (f" --capacity-factor {float(scenario.capacity_factor):g}"
               if scenario.capacity_factor is not None else "")
            + "; the router is part of the compiled program, so recompile it with tpusim compile "
              "and those flags"
        )


def per_chip_config(args: argparse.Namespace, trace, topology):
    """The per-chip engine's `PerChipConfig` for the perturbation flags of `args` (and the MoE
    expert loads of `trace`)."""
    from sim.perchip import PerChipConfig

    scenario = scenario_from_args(args, topology)
    if scenario.expert_skew or scenario.capacity_factor is not None:
        check_router_matches_trace(scenario, trace)
    from workloads.moe import expert_op_scales

    return PerChipConfig(
        # An uneven MoE router loads the chips holding the hot experts (workloads/moe.py).
        op_scale=expert_op_scales(trace, topology),
        speed=scenario.chip_speed_factors_for(topology) if scenario.perturbs_chips else None,
        link_factors=scenario.slow_link_factors_for(topology),
        dead_links=scenario.dead_link_ids_for(topology),
        mode=getattr(args, "mode", "auto") or "auto",
    )
