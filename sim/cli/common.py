"""What every `tpusim` command family shares: the one-line-error parser, size and coordinate
parsing, the pod arguments and their resolution, number formatting and JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from topologies.errors import TpusimError


class Parser(argparse.ArgumentParser):
    """argparse with single-line errors (no usage dump), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise TpusimError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def parse_bytes(text: str) -> int:
    """`33554432`, `32MiB`, `1GiB`, `4.5e6`, `10MB` -> bytes."""
    t = str(text).strip()
    units = {
        "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
        "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1,
    }
    low = t.lower()
    mult = 1
    for suffix, m in units.items():
        if low.endswith(suffix):
            low = low[: -len(suffix)].strip()
            mult = m
            break
    try:
        value = float(low) * mult
    except ValueError:
        raise TpusimError(
            f"--bytes {text!r} is not a size; give bytes such as 33554432, 32MiB or 1GiB"
        ) from None
    if not value.is_integer():
        raise TpusimError(f"--bytes {text!r} is not a whole number of bytes")
    return int(value)


def parse_coords(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise TpusimError(
            f"{flag} {text!r} is not chip coordinates; give integers like 0,0 or 1,2,3"
        ) from None


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
        help="auto (the generation's rule, default), none, all, or axes such as x,z",
    )
    g.add_argument("--slices", type=int, default=1, help="slices joined over DCN (default 1)")
    p.add_argument("--quiet", dest="quiet_sub", action="store_true", help="no progress bar")


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
    """(ChipSpec, Topology) from --chip/--slice/--shape/--wraparound/--slices."""
    from sim.hardware import load_chip
    from topologies.slices import SLICES, resolve_topology

    chip_arg = args.chip
    if chip_arg is None:
        if args.slice_name is None:
            raise TpusimError("give --chip (e.g. v5e) with --shape, or --slice (e.g. v5p-128)")
        chip_arg = SLICES.get(args.slice_name).chip
    chip = overrides(args).apply_chip(load_chip(chip_arg))
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


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
