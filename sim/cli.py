"""The `tpusim` command: argument parsing, one-line errors, and text/JSON output.

Only this module (and explicit `--out`/`--perfetto`/`--plots` writers) touches the disk. Every
`TpusimError` becomes one line on stderr and exit code 2; so do argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from topologies.errors import TpusimError

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


class _Parser(argparse.ArgumentParser):
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


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} us"


def _fmt_bytes(b: float) -> str:
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


def resolve_pod(args: argparse.Namespace):
    """(ChipSpec, Topology) from --chip/--slice/--shape/--wraparound/--slices."""
    from sim.hardware import load_chip
    from topologies.slices import SLICES, resolve_topology

    chip_arg = args.chip
    if chip_arg is None:
        if args.slice_name is None:
            raise TpusimError("give --chip (e.g. v5e) with --shape, or --slice (e.g. v5p-128)")
        chip_arg = SLICES.get(args.slice_name).chip
    chip = load_chip(chip_arg)
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


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# -- collective -------------------------------------------------------------------------------
def _add_collective_args(p: argparse.ArgumentParser, *, with_algorithm: bool) -> None:
    add_pod_args(p)
    p.add_argument("--op", required=True,
                   help="all-gather, reduce-scatter, all-reduce, all-to-all, "
                        "collective-permute or send")
    p.add_argument("--axes", default="",
                   help="physical axes of the replica group, e.g. y or x,y (dcn across slices)")
    p.add_argument("--bytes", dest="nbytes", required=True,
                   help="V: the whole array as one replica group sees it (e.g. 33554432, 32MiB)")
    if with_algorithm:
        p.add_argument("--algorithm", default="auto",
                       help="auto (default), ring, bidi-ring, split-bidi-ring, line, multi-axis, "
                            "per-axis-ring, halving-doubling, direct")
    p.add_argument("--src", help="send: source chip coordinates, e.g. 0,0")
    p.add_argument("--dst", help="send: destination chip coordinates, e.g. 3,3")
    p.add_argument("--shift", type=int, default=1, help="collective-permute: shift by k chips")
    p.add_argument("--slow-link", action="append", default=[],
                   help="degrade one link: COORDS:AXISDIR[:FACTOR], e.g. 0,0:x+:0.5 (repeatable)")
    p.add_argument("--mode", default="auto", choices=["auto", "symmetric", "full"],
                   help="auto: one representative chip where exact, else full per-link detail")
    p.add_argument("--chunks", type=int, default=1,
                   help="pipeline the data in this many chunks so phases overlap (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_collective(args: argparse.Namespace, algorithm: str):
    from sim.collective_sim import simulate_collective

    chip, topo = resolve_pod(args)
    if args.op == "send" and (args.src is None or args.dst is None):
        raise TpusimError("--op send needs --src and --dst, e.g. --src 0,0 --dst 3,3")
    if args.op != "send" and not args.axes:
        raise TpusimError(f"--op {args.op} needs --axes, e.g. --axes y or --axes x,y")
    return simulate_collective(
        chip=chip,
        topology=topo,
        op=args.op,
        axes=args.axes,
        nbytes=parse_bytes(args.nbytes),
        algorithm=algorithm,
        shift=args.shift,
        src=parse_coords(args.src, "--src") if args.src else None,
        dst=parse_coords(args.dst, "--dst") if args.dst else None,
        slow_links=tuple(args.slow_link),
        mode=args.mode,
        chunks=args.chunks,
    )


def cmd_collective(args: argparse.Namespace) -> int:
    from sim.commands import check_outputs

    check_outputs(args)
    res = _run_collective(args, args.algorithm)
    if args.out:
        from sim.output import write_tables

        write_tables(args.out, {"links": res.links, "timeline": res.timeline}, res.to_dict())
    if args.perfetto:
        from sim.perfetto import export_collective

        export_collective(res, args.perfetto)
    if args.plots:
        from sim.plots import plot_collective

        plot_collective(res, args.plots)
    if args.json:
        _emit_json(res.to_dict())
        return 0
    what = f"{res.op} over {','.join(res.axes)}" if res.axes else res.op
    print(
        f"{what} on {res.topology} {res.chip} ({res.num_chips} chips, {res.num_groups} group(s) "
        f"of {res.group_size}), V = {res.bytes:,} B ({_fmt_bytes(res.bytes)})"
    )
    print(f"  algorithm       {res.algorithm}")
    print(f"  time            {_fmt_time(res.time_s)}")
    print(
        f"  busiest link    {_fmt_bytes(res.bytes_on_busiest_link)}, "
        f"{res.max_link_utilization:.0%} of its bandwidth"
    )
    print(f"  HBM per chip    {_fmt_bytes(res.hbm_bytes_per_chip)} read+written")
    print(f"  simulation      {res.mode}, {res.num_steps} step(s), {res.sim_events} events")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from sim.collectives import CollectiveKind, algorithm_names

    try:
        kind = CollectiveKind(args.op)
    except ValueError:
        raise TpusimError(
            f"unknown --op {args.op!r}; use one of: {', '.join(k.value for k in CollectiveKind)}"
        ) from None
    from sim.commands import check_outputs
    from sim.progress import progress

    check_outputs(args)
    rows = []
    results = []
    for name in progress(algorithm_names(kind), desc="algorithms"):
        try:
            r = _run_collective(args, name)
        except TpusimError as exc:
            rows.append({"algorithm": name, "applicable": False, "reason": str(exc)})
            continue
        results.append(r)
        d = r.to_dict()
        d["applicable"] = True
        rows.append(d)
    ok = [r for r in rows if r["applicable"]]
    if not ok:
        raise TpusimError(
            f"no algorithm applies to {args.op} here: {rows[0]['reason']}"
        )
    best = min(r["time_s"] for r in ok)
    for r in ok:
        r["vs_best"] = r["time_s"] / best if best > 0 else 1.0
    if args.perfetto:
        from sim.perfetto import export_collectives

        export_collectives(results, args.perfetto)
    if args.json:
        _emit_json({"op": args.op, "axes": args.axes, "bytes": parse_bytes(args.nbytes),
                    "results": rows})
        return 0
    first = ok[0]
    print(
        f"{args.op} over {args.axes or '-'} on {first['topology']} {first['chip']}, "
        f"V = {first['bytes']:,} B"
    )
    print(f"{'algorithm':<16} {'time':>12} {'vs best':>8} {'busiest link':>14} {'util':>6} "
          f"{'steps':>6}  mode")
    for r in rows:
        if not r["applicable"]:
            print(f"{r['algorithm']:<16} {'n/a':>12}  {r['reason']}")
            continue
        print(
            f"{_algo_label(r):<16} {_fmt_time(r['time_s']):>12} {r['vs_best']:>7.2f}x "
            f"{_fmt_bytes(r['bytes_on_busiest_link']):>14} {r['max_link_utilization']:>6.0%} "
            f"{r['num_steps']:>6}  {r['mode']}"
        )
    return 0


def _algo_label(r: dict) -> str:
    """`auto (bidi-ring)` for auto rows, else the algorithm asked for."""
    return r["algorithm"] if r["algorithm_requested"] == "auto" else r["algorithm_requested"]


def cmd_presets(args: argparse.Namespace) -> int:
    from sim.hardware import CHIPS
    from topologies.slices import SLICES, default_wraparound

    chips = []
    for name, c in CHIPS.items():
        chips.append({
            "name": name,
            "bf16_flops_per_s": c.mxu_flops_per_s,
            "int8_ops_per_s": c.mxu_int8_ops_per_s,
            "vpu_flops_per_s": c.vpu_flops_per_s,
            "hbm_bytes": c.hbm_bytes,
            "hbm_bytes_per_s": c.hbm_bytes_per_s,
            "ici_link_bytes_per_s": c.ici_link_bytes_per_s,
            "ici_links_per_chip": c.ici_links_per_chip,
            "dcn_bytes_per_s": c.dcn_bytes_per_s,
            "max_pod_shape": "x".join(map(str, c.max_pod_shape)),
            "wraparound_rule": c.generation_rule,
        })
    slices = []
    for name, s in SLICES.items():
        rule = CHIPS.get(s.chip).generation_rule
        wrap = default_wraparound(rule, s.shape)
        slices.append({
            "name": name, "chip": s.chip, "shape": "x".join(map(str, s.shape)),
            "num_chips": s.num_chips,
            "wraparound": "".join(a for a, w in zip("xyz", wrap, strict=False) if w) or "none",
        })
    if args.json:
        _emit_json({"chips": chips, "slices": slices})
        return 0
    print(f"{'chip':<7} {'bf16 TF/s':>9} {'HBM GB':>7} {'HBM TB/s':>9} {'ICI GB/s':>9} "
          f"{'links':>5} {'DCN GB/s':>9}  max pod")
    for c in chips:
        print(
            f"{c['name']:<7} {c['bf16_flops_per_s'] / 1e12:>9.0f} {c['hbm_bytes'] / 1e9:>7.0f} "
            f"{c['hbm_bytes_per_s'] / 1e12:>9.2f} {c['ici_link_bytes_per_s'] / 1e9:>9.0f} "
            f"{c['ici_links_per_chip']:>5} {c['dcn_bytes_per_s'] / 1e9:>9.2f}  "
            f"{c['max_pod_shape']}"
        )
    print("(ICI GB/s is one link, one direction; bidirectional is twice that)\n")
    print(f"{'slice':<16} {'chip':<5} {'shape':>9} {'chips':>6}  wraparound")
    for s in slices:
        print(f"{s['name']:<16} {s['chip']:<5} {s['shape']:>9} {s['num_chips']:>6}  "
              f"{s['wraparound']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tpusim", description="Discrete-event simulator of TPU pods.")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (it only appears on a terminal, after 1 s)")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("collective", help="simulate one collective")
    _add_collective_args(c, with_algorithm=True)
    c.add_argument("--out", help="write links/timeline tables (CSV+Parquet) and summary.json")
    c.add_argument("--perfetto", help="write a Perfetto trace (.pftrace, or .json for Chrome)")
    c.add_argument("--plots", help="write PNG plots (links on the torus, step timeline) here")
    c.set_defaults(func=cmd_collective)

    cc = sub.add_parser("compare-collectives", help="one collective under every algorithm")
    _add_collective_args(cc, with_algorithm=False)
    cc.add_argument("--perfetto",
                    help="write every algorithm's steps as one trace, a process per algorithm")
    cc.set_defaults(func=cmd_compare)

    pr = sub.add_parser("presets", help="list chip presets and named slices")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_presets)

    for name, register in _EXTRA_COMMANDS:
        register(sub, name)
    return p


# Later capabilities (training, decode, demo, export) register themselves here.
_EXTRA_COMMANDS: list[tuple[str, Callable[[Any, str], None]]] = []


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from sim import commands  # noqa: F401  (registers the remaining subcommands)

        parser = build_parser()
        args = parser.parse_args(argv)
        from sim import progress

        progress.QUIET = bool(args.quiet or getattr(args, "quiet_sub", False))
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except TpusimError as exc:
        sys.stderr.write(f"tpusim: error: {exc}\n")
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        sys.stderr.write("tpusim: interrupted\n")
        return 130
    except BrokenPipeError:  # pragma: no cover
        return 0


if __name__ == "__main__":  # pragma: no cover
    # Run the importable module's main, so the subcommand registry is the one commands use.
    from sim.cli import main as _main

    sys.exit(_main())
