"""`tpusim collective`, `compare-collectives`, `topology` and `presets`."""

from __future__ import annotations

import argparse

from sim.cli.common import (
    TOPOLOGY_KEYS_CALL,
    add_command,
    add_perturbation_args,
    check_outputs,
    emit_json,
    flag_spelling,
    fmt_bytes,
    fmt_time,
    print_energy,
    print_failures,
    register_commands,
    request_of,
)
from sim.runs.requests import CONVERTERS, CollectiveRequest, CompareCollectivesRequest
from topologies.errors import TpusimError, render_said


def _add_collective_args(p: argparse.ArgumentParser, *, with_algorithm: bool) -> None:
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
                            "per-axis-ring, hierarchical, halving-doubling, direct")
    p.add_argument("--src", help="send: source chip coordinates, e.g. 0,0")
    p.add_argument("--dst", help="send: destination chip coordinates, e.g. 3,3")
    p.add_argument("--shift", type=CONVERTERS["shift"], default=1,
                   help="collective-permute: shift by k chips (default 1)")
    add_perturbation_args(p, description=(
        "a collective runs on links only: it takes --slow-link, --dead-link and a scenario's "
        "link entries, and refuses the chip and MoE ones"))
    p.add_argument("--mode", default="auto", choices=["auto", "symmetric", "full", "per-chip"],
                   help="auto (default): one representative chip where exact, else full "
                        "per-link detail; symmetric or full force one; per-chip: every chip "
                        "and every link of the pod (brute force)")
    p.add_argument("--chunks", type=CONVERTERS["chunks"], default=1,
                   help="pipeline the data in this many chunks so phases overlap (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_collective(args: argparse.Namespace) -> int:
    from sim.runs.collective import run_collective  # the run stack, loaded when it runs

    req = request_of(CollectiveRequest, args)
    check_outputs(args)
    run = run_collective(req)
    res = run.result
    plan = None
    if args.perfetto:
        # deferred: start-up
        from sim.export.perfetto import plan_collective_trace

        plan = plan_collective_trace([res], args.perfetto)  # before the first byte of output
        plan.check_size(spell=flag_spelling(args.parser))
    _warn_if_over_hbm(req, res)
    # Refused candidates' reasons name settings by Python name: spelled here as flags.
    out = render_said(run.to_dict(), flag_spelling(args.parser, "collective"))
    if args.out:
        # deferred: start-up
        from sim.export.output import write_tables

        write_tables(args.out, {"links": res.links, "timeline": res.timeline}, out)
    if plan is not None:
        plan.write()
    if args.plots:
        # deferred: start-up
        from sim.export.collective_plots import plot_collective

        plot_collective(res, args.plots)
    if args.json:
        emit_json(out)
        return 0
    what = f"{res.op} over {','.join(res.axes)}" if res.axes else res.op
    print(
        f"{what} on {res.topology} {res.chip} ({res.num_chips} chips, {res.num_groups} group(s) "
        f"of {res.group_size}), V = {res.bytes:,} B ({fmt_bytes(res.bytes)})"
    )
    algo = res.algorithm
    if res.auto_candidates:
        n = sum(1 for c in res.auto_candidates if c.get("time_s") is not None
                or "lower_bound_s" in c)
        algo += f", the fastest of {n} applicable (compare-collectives lists them)"
    print(f"  algorithm       {algo}")
    print(f"  time            {fmt_time(res.time_s)} (latency {fmt_time(res.latency_s)} + "
          f"bandwidth and contention {fmt_time(res.bandwidth_s)})")
    print(
        f"  busiest link    {fmt_bytes(res.bytes_on_busiest_link)}, "
        f"{res.max_link_utilization:.0%} of its bandwidth"
    )
    print(f"  HBM per chip    {fmt_bytes(res.hbm_bytes_per_chip)} read+written")
    print(f"  simulation      {res.mode}, {res.num_steps} step(s), {res.sim_events} events")
    if res.detour is not None:
        d = res.detour
        print(
            f"  dead links      {'; '.join(d['dead_links'])}: {d['rerouted_transfers']:,} "
            f"transfer(s) detoured, +{d['extra_hops']:,} hops, "
            f"+{fmt_bytes(d['extra_link_bytes'])} on links, "
            f"+{fmt_time(d['extra_time_s'])} vs healthy ({fmt_time(d['healthy_time_s'])})"
        )
    if "healthy_pick" in out:  # faults made auto re-pick: what a step would run instead
        print(f"  note: {out['healthy_pick']['note']}")
    print_failures(run.summary)
    print_energy(run.summary, per="collective")
    return 0


def _warn_if_over_hbm(req, res) -> None:
    """A collective whose buffers cannot fit in one chip's HBM still simulates (the links do
    not care), but the program could not run: say so on stderr."""
    # deferred: start-up
    from sim.runs.bind import resolve_pod
    from sim.runs.collective import buffer_bytes_per_chip

    chip = resolve_pod(req).chip
    need = buffer_bytes_per_chip(res.op, res.bytes, res.group_size)
    if need > chip.hbm_bytes:
        import sys

        sys.stderr.write(
            f"tpusim: warning: the {res.op} buffers take {fmt_bytes(need)} per chip (input + "
            f"output), more than the {fmt_bytes(chip.hbm_bytes)} of HBM of a {chip.name}; the "
            f"time is for the links only, a real program would not fit\n"
        )


def cmd_compare(args: argparse.Namespace) -> int:
    from sim.runs.collective import run_compare  # the run stack, loaded when it runs

    req = request_of(CompareCollectivesRequest, args)
    check_outputs(args)
    run = run_compare(req)
    # Each n/a row's reason names settings by Python name: spelled here as flags.
    out = render_said(run.to_dict(), flag_spelling(args.parser, "compare-collectives"))
    rows, results = out["results"], run.result
    ok = [r for r in rows if r["applicable"]]
    if args.perfetto:
        # deferred: start-up
        from sim.export.perfetto import plan_collective_trace

        plan = plan_collective_trace(results, args.perfetto)
        plan.check_size(spell=flag_spelling(args.parser))
        plan.write()
    if args.json:
        emit_json(out)
        return 0
    first = ok[0]
    print(
        f"{args.op} over {args.axes or '-'} on {first['topology']} {first['chip']}, "
        f"V = {first['bytes']:,} B"
    )
    print(f"  {'algorithm':<20} {'time':>10} {'latency':>10} {'bandwidth':>10} {'vs best':>8} "
          f"{'busiest link':>13} {'util':>5} {'steps':>5} {'energy':>9}  mode")
    # Why an algorithm does not apply, once per distinct reason, as footnotes under the table
    # (the reasons are long, and several algorithms share one).
    reasons: dict[str, int] = {}
    for r in rows:
        if not r["applicable"]:
            why = _reason_words(r["algorithm"], r["reason"])
            mark = reasons.setdefault(why, len(reasons) + 1)
            print(f"  {r['algorithm']:<20} {'n/a':>10}  [{mark}]")
            continue
        mark = "*" if r.get("auto_pick") else " "
        print(
            f"{mark} {_algo_label(r):<20} {fmt_time(r['time_s']):>10} "
            f"{fmt_time(r['latency_s']):>10} {fmt_time(r['bandwidth_s']):>10} "
            f"{r['vs_best']:>7.2f}x {fmt_bytes(r['bytes_on_busiest_link']):>13} "
            f"{r['max_link_utilization']:>5.0%} {r['num_steps']:>5} "
            f"{_joules(r['energy']['step_j']):>9}  {r['mode']}"
        )
    if run.summary["auto_pick"]:
        print("latency = the time with infinitely fast links (hops x per-hop latency, step after "
              "step);\nbandwidth = the rest (bytes draining, contention); * = auto's pick, the "
              "fastest that applies;\nenergy = the pod's joules (bytes moved, DMA, static "
              "power over the time, host and PUE)")
    for why, mark in reasons.items():
        print(f"[{mark}] n/a: {why}")
    return 0


def _joules(j: float) -> str:
    return f"{j:.3g} J" if j >= 1e-3 else f"{j * 1e3:.3g} mJ"


def _reason_words(algorithm: str, reason: str) -> str:
    """An algorithm's reason for not applying, without its own name in front ("algorithm 'ring'
    runs on one axis but ..." -> "runs on one axis but ..."), so that algorithms refused for
    the same reason share one footnote."""
    for head in (f"algorithm {algorithm!r} ", f"algorithm {algorithm} "):
        if reason.startswith(head):
            return reason[len(head):]
    return reason


def cmd_topology(args: argparse.Namespace) -> int:
    """Diameter, average hops, bisection and all-to-all bound of one slice, and with
    `--twist` the twisted wiring's beside the plain one's (topologies/metrics.py)."""
    # deferred: start-up
    from sim.chips import load_chip
    from sim.overrides import parse_overrides, set_pairs
    from topologies.metrics import compare_report
    from topologies.slices import SLICES, resolve_topology, untwisted_name

    ov = parse_overrides(dict(set_pairs(args.set or ())), ("chip",), command="tpusim topology",
                         listing=TOPOLOGY_KEYS_CALL)
    # A report on the wiring: without --chip or --slice, a v4's (the chip the twist was
    # published for), so that `tpusim topology --shape 4x4x8 --twist` runs as written.
    name = args.chip or (SLICES.get(untwisted_name(args.slice_name)).chip
                         if args.slice_name else "v4")
    if args.slice_name is None and args.shape is None:
        raise TpusimError("give the slice as --shape AxBxC (e.g. 4x4x8) or --slice NAME (e.g. "
                          "v4-256); see `tpusim topology --help`")
    chip = ov.apply_chip(load_chip(name))
    twist = bool(args.twist) or (args.slice_name is not None
                                 and untwisted_name(args.slice_name) != args.slice_name)
    kw = dict(chip_name=chip.name, wrap_rule=chip.generation_rule,
              max_pod_shape=chip.max_pod_shape, shape=args.shape,
              slice_name=untwisted_name(args.slice_name) if args.slice_name else None,
              wraparound=args.wraparound, num_slices=args.slices)
    twisted = resolve_topology(**kw, twist=True) if twist else None
    plain = resolve_topology(**kw)
    rep = compare_report(plain, twisted, chip.ici_link_bytes_per_s)
    rep = {"chip": chip.name, "shape": list(plain.shape), **rep}
    if args.json:
        emit_json(rep)
        return 0
    p, t = rep["plain"], rep["twisted"]
    print(f"topology {'x'.join(map(str, plain.shape))} of {chip.name} ({p['num_chips']:,} chips, "
          f"{p['num_links']:,} directed links of {chip.ici_link_bytes_per_s / 1e9:g} GB/s one "
          f"way{'; one slice of ' + str(plain.num_slices) if plain.num_slices > 1 else ''})")
    cols = [("plain", p)] + ([("twisted", t)] if t else [])
    head = "".join(f"{c:>13}" for c, _ in cols) + ("   twisted/plain" if t else "")
    print(f"  {'':<24}{head}")

    def row(label, key, fmt):
        cells = "".join(f"{fmt(m[key]) if m[key] is not None else '-':>13}" for _, m in cols)
        ratio = rep.get("twisted_over_plain", {}).get(key) if t else None
        extra = f"{ratio:>15.3f}x" if ratio is not None else ""
        print(f"  {label:<24}{cells}{extra}")

    row("diameter (hops)", "diameter_hops", str)
    row("average hops", "average_hops", lambda v: f"{v:.3f}")
    row("bisection (links)", "bisection_links", str)
    row("bisection bandwidth", "bisection_bytes_per_s", lambda v: f"{v / 1e12:.3f} TB/s")
    row("all-to-all per chip", "all_to_all_bytes_per_s_per_chip",
        lambda v: f"{v / 1e9:.2f} GB/s")
    cuts = ", ".join(f"{c} {m['bisection_cut']}" for c, m in cols)
    bounds = " / ".join(str(m["bisection_lower_bound_links"]) for _, m in cols)
    print(f"  bisection: the fewest links one way across a slab cut ({cuts}); every balanced "
          f"cut has at least {bounds} (spectral bound)")
    print("  all-to-all per chip: what each chip sends per second when every pair exchanges "
          "the same bytes over its shortest paths (the busiest link's bound)")
    if not t:
        # deferred: start-up
        from topologies.slices import can_twist

        if can_twist(chip.generation_rule, plain.shape):
            print("  this shape can twist: add --twist to compare the twisted wiring")
    return 0


def _algo_label(r: dict) -> str:
    """`auto (bidi-ring)` for auto rows, else the algorithm asked for."""
    return r["algorithm"] if r["algorithm_requested"] == "auto" else r["algorithm_requested"]


def cmd_presets(args: argparse.Namespace) -> int:
    """Chip presets (every field under its chip YAML key, with where each efficiency factor
    comes from) and named slices; `--chip X --json` prints one chip file."""
    # deferred: start-up
    from sim.chips import CHIPS, efficiency_sources, load_chip, power_sources
    from topologies.slices import SLICES, default_wraparound

    if args.chip:
        chip = load_chip(args.chip)
        if args.json:
            emit_json(chip.to_dict())  # exactly the chip YAML keys: a valid --chip file
            return 0
        for key, value in chip.to_dict().items():
            print(f"{key:<22} {value}")
        print()
        # A value set by hand says so naming the overrides (a Said): written as the flag.
        spell = flag_spelling(args.parser, "presets")
        _print_sources(render_said({chip.name: efficiency_sources(chip)}, spell))
        _print_power(render_said({chip.name: power_sources(chip)}, spell))
        return 0
    chips = [c.to_dict() for _name, c in CHIPS.items()]
    # A source that names a setting is a Said: written as the flag.
    spell = flag_spelling(args.parser, "presets")
    sources = render_said({name: efficiency_sources(c) for name, c in CHIPS.items()}, spell)
    power = render_said({name: power_sources(c) for name, c in CHIPS.items()}, spell)
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
        emit_json({"chips": chips, "efficiency_sources": sources, "power_sources": power,
                   "slices": slices})
        return 0
    print(f"{'chip':<7} {'bf16 TF/s':>9} {'HBM GB':>7} {'HBM TB/s':>9} {'ICI GB/s':>9} "
          f"{'links':>5} {'DCN GB/s':>9}  max pod")
    for c in chips:
        print(
            f"{c['name']:<7} {c['mxu_flops_per_s'] / 1e12:>9.0f} {c['hbm_bytes'] / 1e9:>7.0f} "
            f"{c['hbm_bytes_per_s'] / 1e12:>9.2f} {c['ici_link_bytes_per_s'] / 1e9:>9.0f} "
            f"{c['ici_links_per_chip']:>5} {c['dcn_bytes_per_s'] / 1e9:>9.2f}  "
            f"{'x'.join(map(str, c['max_pod_shape']))}"
        )
    print("(ICI GB/s is one link, one direction; bidirectional is twice that)\n")
    _print_sources(sources)
    _print_power(power)
    print(f"{'slice':<16} {'chip':<5} {'shape':>9} {'chips':>6}  wraparound")
    for s in slices:
        print(f"{s['name']:<16} {s['chip']:<5} {s['shape']:>9} {s['num_chips']:>6}  "
              f"{s['wraparound']}")
    return 0


def _print_sources(sources: dict[str, dict[str, dict]]) -> None:
    """The efficiency table (fraction of each peak achieved), then where each value came from;
    the assumed defaults are listed once."""
    print("efficiency factors (achievable fraction of each peak; 1.0 = the textbook roofline)")
    print(f"{'chip':<12} {'mxu':>5} {'vpu':>5} {'hbm':>5} {'ici':>5} {'dcn':>5} "
          f"{'op overhead':>12} {'DCN message':>12}")
    for name, src in sources.items():
        v = {k: e["value"] for k, e in src.items()}
        print(f"{name:<12} {v['mxu_efficiency']:>5.2f} {v['vpu_efficiency']:>5.2f} "
              f"{v['hbm_efficiency']:>5.2f} {v['ici_efficiency']:>5.2f} "
              f"{v['dcn_efficiency']:>5.2f} {v['op_overhead_s'] * 1e6:>9.2f} us "
              f"{v['dcn_message_overhead_s'] * 1e6:>9.1f} us")
    print("where they come from:")
    assumed = {}
    for name, src in sources.items():
        for field, e in src.items():
            if e["kind"] == "assumed":
                assumed.setdefault(e["source"], []).append(field)
                continue
            print(f"  {name} {field} = {e['value']:g}: {e['kind']}, {e['source']}")
    for source, fields in assumed.items():
        # deferred: start-up
        from sim.chips import EFFICIENCY_FIELDS

        names = sorted(set(fields), key=EFFICIENCY_FIELDS.index)
        print(f"  the rest ({'/'.join(f.removesuffix('_efficiency') for f in names)}): "
              f"assumed, {source}")
    print()


def _print_power(sources: dict[str, dict[str, dict]]) -> None:
    """The power and price table (docs/model/energy.md), then where each value came from; the
    assumed values shared by every chip are listed once."""
    print("power and price (energy per operation or byte, static power, host share, PUE, "
          "price)")
    print(f"{'chip':<12} {'MXU pJ/F':>8} {'int8 pJ':>7} {'VPU pJ/F':>8} {'HBM pJ/B':>8} "
          f"{'ICI pJ/B':>8} {'DCN pJ/B':>8} {'PCIe pJ/B':>9} {'idle W':>7} {'host':>5} "
          f"{'PUE':>5} {'$/chip-h':>8}")
    for name, src in sources.items():
        v = {k: e["value"] for k, e in src.items()}
        price = "-" if v["usd_per_chip_hour"] is None else f"{v['usd_per_chip_hour']:.2f}"
        print(f"{name:<12} {v['mxu_j_per_flop'] * 1e12:>8.3f} "
              f"{v['mxu_int8_j_per_op'] * 1e12:>7.3f} {v['vpu_j_per_flop'] * 1e12:>8.3f} "
              f"{v['hbm_j_per_byte'] * 1e12:>8.1f} {v['ici_j_per_byte'] * 1e12:>8.1f} "
              f"{v['dcn_j_per_byte'] * 1e12:>8.1f} {v['pcie_j_per_byte'] * 1e12:>9.1f} "
              f"{v['idle_power_w']:>7.1f} {v['host_power_share']:>5.2f} {v['pue']:>5.3f} "
              f"{price:>8}")
    print("where they come from:")
    shared: dict[str, list[str]] = {}
    for name, src in sources.items():
        for field, e in src.items():
            if e["kind"] in ("assumed", "published") and "list price" not in e["source"]:
                if field not in shared.setdefault(e["source"], []):
                    shared[e["source"]].append(field)
                continue
            value = "-" if e["value"] is None else f"{e['value']:.4g}"
            print(f"  {name} {field} = {value}: {e['kind']}, {e['source']}")
    kinds = {e["source"]: e["kind"] for src in sources.values() for e in src.values()}
    for source, fields in shared.items():
        print(f"  {'/'.join(fields)}: {kinds[source]}, {source}")
    print()


def _register_collective(sub, name: str) -> None:
    c = add_command(sub, name, "simulate one collective", cmd_collective,
                    set_scope=CollectiveRequest.SET_SCOPE)
    _add_collective_args(c, with_algorithm=True)
    c.add_argument("--out", help="write links/timeline tables (CSV+Parquet) and summary.json")
    c.add_argument("--perfetto", help="write a Perfetto trace (.pftrace, or .json for Chrome)")
    c.add_argument("--plots", help="write PNG plots (links on the torus, step timeline) here")


def _register_compare(sub, name: str) -> None:
    # compare-collectives runs every algorithm, so collective.algorithm is not its to take.
    cc = add_command(sub, name, "one collective under every algorithm",
                     cmd_compare, set_scope=CompareCollectivesRequest.SET_SCOPE)
    _add_collective_args(cc, with_algorithm=False)
    cc.add_argument("--perfetto",
                    help="write every algorithm's steps as one trace, a process per algorithm")


def _register_topology(sub, name: str) -> None:
    tp = add_command(sub, name, "diameter, hops, bisection and all-to-all bound of a "
                     "slice (with --twist: plain against twisted; chip v4 unless --chip or "
                     "--slice says)", cmd_topology, set_scope=("chip",))
    tp.add_argument("--json", action="store_true", help="print one JSON object")


def _register_presets(sub, name: str) -> None:
    pr = sub.add_parser(name, help="list chip presets (with the source of every efficiency "
                                   "factor) and named slices")
    pr.add_argument("--chip", help="one chip: a preset name or a chip YAML file; with --json, "
                                   "print it as a chip file (tpusim presets --json --chip v5p "
                                   "> my.yaml)")
    pr.add_argument("--json", action="store_true",
                    help="print chips (under the chip YAML keys), the source of every "
                         "efficiency factor and the slices as one JSON object")
    pr.set_defaults(func=cmd_presets)


def register(sub) -> None:
    register_commands(sub, [("collective", _register_collective),
                            ("compare-collectives", _register_compare),
                            ("topology", _register_topology), ("presets", _register_presets)])
