"""`tpusim serve`: requests served over time by replicas with continuous or static batching,
chunked prefill, a paged KV cache and a router (sim/serving). Registers into `sim.cli` like
the other command families."""

from __future__ import annotations

import argparse
from pathlib import Path

from sim.cli import common as cli
from sim.cli.common import check_outputs
from sim.runs.requests import CONVERTERS, ServeRequest
from topologies.errors import TpusimError, render_said
from topologies.validate import short_repr


def _fmt(stat: dict, scale: float = 1e3) -> str:
    if stat["mean"] is None:
        return "n/a"
    return "  ".join(f"{k} {stat[k] * scale:9.2f}" for k in ("mean", "p50", "p90", "p99"))


def print_report(s: dict) -> None:
    """The text report of a serving run."""
    print(f"{s['model']} served by {s['num_replicas']} replica(s), {s['num_chips']} "
          f"{s['chip']} chips, {s['scheduler']} batching, {s['router']} router")
    for p in s["pools"]:
        print(f"  {p['role']:<8} x{p['replicas']:<3} {p['slice']} mesh {p['mesh']}: "
              f"KV {p['kv_capacity_tokens']:,} tokens ({p['kv_blocks']:,} blocks of "
              f"{p['kv_block_tokens']}); cost model: "
              + ("engine per composition" if p["cost_model"]["exact"] else
                 f"{p['cost_model']['grid_points']} grid points"))
    t = s.get("kv_transfer")
    if t is not None:
        how = (f"ICI within one {t['pair_shape']} slice ({t['hops']} hop(s))"
               if t["path"] == "ici" else "DCN between slices")
        print(f"  KV transfer      over {how}: {t['fixed_s'] * 1e6:.1f} us + "
              f"{t['s_per_byte_per_chip'] * 1e9:.4f} ns per byte on each of {t['chips']} chips")
    print(f"  requests         {s['num_requests']:,} over {s['span_s']:.2f} s "
          f"({s['num_iterations']:,} iterations, {s['sim_events']:,} events)")
    print("  latency (ms)")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end to end"),
                       ("queue_s", "queueing")):
        print(f"    {label:<14} {_fmt(s[key])}")
    print(f"  throughput       {s['throughput_requests_per_s']:.3f} requests/s, "
          f"{s['throughput_tokens_per_s']:.1f} output tokens/s, "
          f"{s['tokens_per_s_per_chip']:.1f} tokens/s/chip")
    slo = s["slo"]
    if slo["ttft_s"] is not None or slo["tpot_s"] is not None:
        bounds = ", ".join(f"{k[:-2]} <= {v:g} s" for k, v in slo.items() if v is not None)
        print(f"  goodput          {s['goodput_requests_per_s']:.3f} requests/s "
              f"({s['slo_attainment']:.1%} meet {bounds})")
    b = s["batch"]
    print(f"  batch            mean {b['mean'] or 0:.1f}, p99 {b['p99'] or 0:.0f}, max "
          f"{b['max']}; queue mean {s['queue_length']['mean']:.2f}, max "
          f"{s['queue_length']['max']}")
    print(f"  KV cache         {s['kv_utilization']:.1%} used on average; "
          f"{s['preemptions']:,} preemption(s)"
          + (f" by swap ({s['swap_tokens']:,} tokens over PCIe)"
             if s["preemption"] == "swap" and s["preemptions"] else ""))
    if s["prefix_caching"]:
        print(f"  prefix cache     {s['prefix_hit_tokens']:,} prompt tokens not prefilled "
              f"(cached prefixes)")
    print(f"  replicas busy    {s['replica_utilization']['mean']:.1%} on average")
    e, c = s["energy"], s["cost"]
    per_token = f", {e['j_per_token']:.3g} J per output token" if e["j_per_token"] else ""
    print(f"  energy           {e['energy_j'] / 1e3:,.3f} kJ{per_token}; chips draw "
          f"{e['chip_power_w_mean']:.1f} W on average")
    if c["usd_total"] is not None:
        per_m = (f", ${c['usd_per_million_tokens']:,.4g} per million output tokens"
                 if c["usd_per_million_tokens"] is not None else "")
        print(f"  cost             ${c['usd_per_hour']:,.2f} per hour{per_m}")
    if s.get("note"):
        print(f"  note             {s['note']}")


def cmd_serve(args: argparse.Namespace) -> int:
    from sim.runs.serve import run_serve  # the run stack, loaded when it runs

    req = cli.request_of(ServeRequest, args)
    check_outputs(args)
    run = run_serve(req)
    # The summary's note names a setting (a Said): written as this command's flag.
    out = render_said(run.to_dict(), cli.flag_spelling(args.parser, "serve"))
    summary = {k: v for k, v in out.items() if k != "inputs"}
    trace = None
    if args.perfetto:
        # deferred: start-up
        from sim.export.serving_trace import plan_serving_trace

        trace = plan_serving_trace(summary, run.result, args.perfetto)  # sized first
        trace.check_size(spell=cli.flag_spelling(args.parser))
    if args.out:
        # deferred: start-up
        from sim.export.output import write_tables

        res = run.result
        write_tables(Path(args.out), {"requests": res.requests_frame(),
                                      "iterations": res.iterations_frame()}, out)
    if args.plots:
        # deferred: start-up
        from sim.export.serving_plots import plot_serving

        plot_serving(summary, run.result, args.plots)
    if trace is not None:
        trace.write()
    if args.json:
        cli.emit_json(out)
        return 0
    print_report(summary)
    if args.out:
        print(f"wrote {cli.show_path(args.out)}/requests.csv/.parquet, iterations.csv/.parquet "
              f"and summary.json")
    if args.plots:
        print(f"wrote {cli.show_path(args.plots)}/latency_cdf.png and kv_queue.png")
    if args.perfetto:
        print(f"wrote {cli.show_path(args.perfetto)}")
    return 0


def _add_dtype_args(p) -> None:
    p.add_argument("--weight-dtype", default="bf16", help="bf16 (default), fp8, int8 or int4")
    p.add_argument("--kv-dtype", default="bf16", help="bf16 (default), fp8, int8 or int4")
    p.add_argument("--matmul-dtype", default="bf16",
                   help="bf16 (default) or int8 (weight matmuls at the int8 peak)")
    p.add_argument("--sampling", default="top-k",
                   help="how the next token is chosen: top-k (default) or greedy, as decode "
                        "takes it")


def _add_workload_args(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--arrival", default="poisson",
                   help="poisson (default), gamma (gaps with coefficient of variation --cv) or "
                        "trace (--trace FILE)")
    g.add_argument("--rate", type=ServeRequest.OWN_CONVERTERS["rate"],
                   help="requests per second (poisson, gamma)")
    g.add_argument("--cv", type=ServeRequest.OWN_CONVERTERS["cv"],
                   help="gamma arrivals: the gaps' coefficient of variation (default 1: as "
                        "Poisson; above 1 bursty)")
    g.add_argument("--trace", help="CSV (header) or JSON-lines file with arrival_s, "
                                   "prompt_tokens, output_tokens (optional prefix_id and "
                                   "prefix_tokens), sorted by arrival_s")
    g.add_argument("--requests", type=ServeRequest.OWN_CONVERTERS["requests"],
                   help="stop after N requests (or the trace's first N)")
    g.add_argument("--duration", type=ServeRequest.OWN_CONVERTERS["duration"],
                   help="stop arrivals after S seconds")
    g.add_argument("--prompt-tokens", help="prompt lengths: fixed:N, uniform:A,B or "
                                           "lognormal:MEAN,SIGMA (MEAN in tokens, SIGMA the "
                                           "log-sd)")
    g.add_argument("--output-tokens", help="output lengths, as --prompt-tokens")


def _add_scheduler_args(d) -> None:
    d.add_argument("--router", default="round-robin",
                   help="round-robin (default), least-outstanding or least-kv")
    d.add_argument("--scheduler", default="continuous",
                   help="continuous (default: requests join at the next iteration) or static "
                        "(a batch runs to its end)")
    d.add_argument("--max-batch", type=ServeRequest.OWN_CONVERTERS["max_batch"], default=256,
                   help="most sequences in an iteration (default 256)")
    d.add_argument("--max-tokens-per-iter", type=ServeRequest.OWN_CONVERTERS[
                       "max_tokens_per_iter"],
                   help="token budget of an iteration: one per decoding sequence plus the "
                        "prompt tokens prefilled (default: no limit)")
    d.add_argument("--prefill-chunk", type=CONVERTERS["prefill_chunk"],
                   help="prefill prompts in chunks of at most this many tokens, sharing "
                        "iterations with decodes (default: whole prompts)")
    d.add_argument("--kv-block-tokens", type=ServeRequest.OWN_CONVERTERS["kv_block_tokens"],
                   default=16, help="tokens per paged KV-cache block (default 16)")
    d.add_argument("--preemption", default="recompute",
                   help="when KV blocks run out, the newest sequence is preempted: recompute "
                        "(default: its blocks are freed and it is prefilled again) or swap (its "
                        "cache is copied to host memory over PCIe and back)")
    d.add_argument("--prefix-caching", action="store_true",
                   help="keep each prefilled prompt prefix (by the trace's prefix_id) on its "
                        "replica: a later request with the id prefills only the rest of its "
                        "prompt (blocks shared; unused ones evicted least recently used first)")


def _register_serve(sub, name: str) -> None:
    p = cli.add_command(sub, name, "serve a stream of requests: continuous batching, chunked "
                                   "prefill, paged KV, latency SLOs", cmd_serve,
                        set_scope=ServeRequest.SET_SCOPE)
    p.add_argument("--model", required=True, help="zoo name (llama3-70b, ...) or a model YAML")
    p.add_argument("--mesh", required=True,
                   help="each replica's logical mesh over data, tensor, expert and fsdp, e.g. "
                        "tensor=8 (as decode and prefill take it)")
    p.add_argument("--dcn", help="logical axes across slices, e.g. data=2")
    _add_dtype_args(p)
    _add_workload_args(p)
    d = p.add_argument_group("deployment and scheduler")
    d.add_argument("--replicas", type=ServeRequest.OWN_CONVERTERS["replicas"], default=1,
                   help="replicas of the pod (each --slice/--shape with --mesh) behind the "
                        "router (default 1)")
    _add_scheduler_args(d)
    d.add_argument("--prefill-replicas", type=ServeRequest.OWN_CONVERTERS["prefill_replicas"],
                   help="disaggregated: replicas that only prefill (with --decode-replicas)")
    d.add_argument("--decode-replicas", type=ServeRequest.OWN_CONVERTERS["decode_replicas"],
                   help="disaggregated: replicas that only decode; KV caches move over DCN "
                        "(or ICI: --kv-transfer)")
    d.add_argument("--prefill-mesh", help="the prefill replicas' mesh (default --mesh)")
    d.add_argument("--decode-mesh", help="the decode replicas' mesh (default --mesh)")
    d.add_argument("--prefill-slice", help="the prefill replicas' slice (default the pod's)")
    d.add_argument("--decode-slice", help="the decode replicas' slice (default the pod's)")
    d.add_argument("--kv-transfer", default="dcn",
                   help="how KV caches move from prefill to decode replicas: dcn (default: "
                        "separate slices joined by DCN) or ici (each prefill replica and its "
                        "decode replica are the two halves of one slice, joined by ICI)")
    o = p.add_argument_group("results")
    o.add_argument("--slo", help="latency bounds for goodput, e.g. ttft=0.5,tpot=0.05 "
                                 "(seconds; default none)")
    o.add_argument("--exact-costs", action="store_true",
                   help="time every distinct iteration with the step engine (slow; the oracle) "
                        "instead of the cost model interpolated on its grid")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--out", help="write requests.csv/.parquet, iterations.csv/.parquet and "
                                 "summary.json here")
    o.add_argument("--plots", help="write latency_cdf.png (TTFT, TPOT, end-to-end and queueing "
                                   "CDFs) and kv_queue.png (KV blocks and queue over time) here")
    o.add_argument("--perfetto",
                   help="write a Perfetto trace (.pftrace; .json for Chrome): a process per "
                        "replica with its iterations, its requests' phases joined by flows "
                        "(queued, prefill, KV transfer, decode) and counters of KV blocks, "
                        "queue length and one chip's power")
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm for gathers/reductions (default auto)")
    cli.add_step_perturbation_args(p, power_cap=False)


def _split(text: str) -> tuple[int, int] | None:
    if text == "colocated":
        return None
    p_, sep, d_ = text.partition(":")
    if not sep or not (p_.isdigit() and d_.isdigit()) or int(p_) < 1 or int(d_) < 1:
        raise TpusimError(
            f"{{splits}} entry {short_repr(text)} is not a deployment; give colocated or "
            f"PREFILL:DECODE replicas (each at least 1), e.g. colocated,1:2", "splits")
    return int(p_), int(d_)


def _list(text: str | None, conv, name: str) -> tuple:
    if text is None:
        return ()
    items = [w.strip() for w in text.split(",")]
    if not all(items):
        raise TpusimError(f"{{{name}}} {short_repr(text)} has an empty entry; give a comma "
                              f"list, e.g. {_EXAMPLES[name]}", name)
    return tuple(conv(w) for w in items)


_EXAMPLES = {"replica_slices": "v5e-4,v5e-8", "splits": "colocated,1:2",
             "weight_dtypes": "bf16,int8",
             "kv_dtypes": "bf16,int8", "max_batches": "64,256",
             "token_budgets": "none,2048"}


def _budget(text: str):
    return None if text == "none" else ServeRequest.OWN_CONVERTERS["max_tokens_per_iter"](text)


def cmd_plan_serve(args: argparse.Namespace) -> int:
    # The run stack and the search, loaded when it runs.
    from sim.export.output import check_output_dir, write_tables
    from sim.runs.bind import resolve_model
    from sim.serving.plan import ServePlanConfig, plan_serving

    meshes = tuple(args.meshes_tried or ())
    cfg = ServePlanConfig(
        replica_slices=_list(args.replica_slices, str, "replica_slices"), meshes=meshes,
        weight_dtypes=_list(args.weight_dtypes, str, "weight_dtypes"),
        kv_dtypes=_list(args.kv_dtypes, str, "kv_dtypes"),
        max_batches=_list(args.max_batches, ServeRequest.OWN_CONVERTERS["max_batch"],
                          "max_batches"),
        max_tokens_per_iter=_list(args.token_budgets, _budget, "token_budgets"),
        splits=_list(args.splits, _split, "splits") or (None,),
        max_replicas=args.max_replicas, attainment=args.attainment)
    # The base's mesh is replaced by each candidate's; the first (or one chip's worth) stands
    # in so the request is whole.
    base = cli.request_of(ServeRequest, args, mesh=meshes[0] if meshes else "tensor=1")
    if args.out:
        check_output_dir(args.out)
    plan = plan_serving(base, cfg)
    # A row refused by its run says why naming settings (a Said): written as serve's flags.
    spell = cli.flag_spelling(args.parser, "serve")
    rows = render_said(plan.rows, spell)
    summary = {"num_candidates": len(rows), "runs": plan.runs, "best": plan.best,
               "rows": rows}
    if args.out:
        write_tables(args.out, {"candidates": plan.table(spell)}, summary)
    if args.json:
        cli.emit_json(summary)
        return 0
    print(f"plan --serve: {resolve_model(base)[1].name} at "
          f"{base.rate:g} requests/s within {base.slo} ({cfg.attainment:.0%} of requests): "
          f"{len(plan.rows)} candidates, {plan.runs} serving runs")
    print(f"  {'slice':<10} {'split':<9} {'mesh':<18} {'weights':<7} {'KV':<5} {'batch':>5} "
          f"{'budget':>7} "
          f"{'replicas':>8} {'chips':>5} {'tok/s/chip':>10} {'TTFT p99':>9} {'TPOT p99':>9}")
    for r in rows:
        budget = "-" if r["max_tokens_per_iter"] is None else f"{r['max_tokens_per_iter']:,}"
        head = (f"  {r['slice']:<10} {r['split']:<9} {r['mesh']:<18} {r['weight_dtype']:<7} "
                f"{r['kv_dtype']:<5} "
                f"{r['max_batch']:>5} {budget:>7} ")
        if r["meets_slo"]:
            print(head + f"{r['replicas']:>8} {r['num_chips']:>5} "
                         f"{r['tokens_per_s_per_chip']:>10.1f} "
                         f"{r['ttft_p99_s'] * 1e3:>7.1f}ms {r['tpot_p99_s'] * 1e3:>7.2f}ms")
        else:
            print(head + f"{'-':>8}  {r['note']}")
    b = plan.best
    if b is None:
        print(f"  best: none meets the SLO with at most {cfg.max_replicas} replicas; raise "
              f"--max-replicas, relax --slo or widen the search")
    else:
        print(f"  best: {b['slice']} {b['split']} {b['mesh']}, weights {b['weight_dtype']}, KV "
              f"{b['kv_dtype']}, batch {b['max_batch']}: {b['replicas']} replicas "
              f"({b['num_chips']} chips), {b['tokens_per_s_per_chip']:.1f} output tokens/s "
              f"per chip")
    if args.out:
        print(f"  wrote {cli.show_path(args.out)}/candidates.csv, candidates.parquet, "
              "summary.json")
    return 0


def _register_plan_serve(sub, name: str) -> None:
    p = cli.add_command(sub, name, "search serving deployments (replicas, meshes, dtypes, "
                                   "batch limits, prefill:decode splits) for the most output "
                                   "tokens/s per chip within an SLO at a rate; also spelled "
                                   "`tpusim plan --serve`", cmd_plan_serve,
                        set_scope=ServeRequest.SET_SCOPE)
    p.add_argument("--model", required=True, help="zoo name (llama3-70b, ...) or a model YAML")
    p.add_argument("--dcn", help="logical axes across slices, e.g. data=2")
    _add_dtype_args(p)
    _add_workload_args(p)
    d = p.add_argument_group("scheduler (each candidate's, unless searched below)")
    _add_scheduler_args(d)
    d.add_argument("--kv-transfer", default="dcn",
                   help="split deployments: dcn (default) or ici, as serve takes it")
    g = p.add_argument_group("search space")
    g.add_argument("--replica-slices", dest="replica_slices",
                   help="replica slices to try: slice names or shapes of the chip, e.g. "
                        "v5e-4,v5e-8 (default the pod's --slice/--shape)")
    g.add_argument("--mesh", action="append", dest="meshes_tried",
                   help="a replica mesh to try; repeat for more (default: every data x tensor "
                        "split of each replica slice's chips)")
    g.add_argument("--splits", help="deployments to try: colocated and PREFILL:DECODE ratios, "
                                    "e.g. colocated,1:2 (default colocated)")
    g.add_argument("--weight-dtypes", help="weight dtypes to try, e.g. bf16,int8 (default "
                                           "--weight-dtype)")
    g.add_argument("--kv-dtypes", help="KV-cache dtypes to try (default --kv-dtype)")
    g.add_argument("--max-batches", help="batch limits to try, e.g. 64,256 (default "
                                         "--max-batch)")
    g.add_argument("--token-budgets", help="per-iteration token budgets to try, none for no "
                                           "budget, e.g. none,2048 (default "
                                           "--max-tokens-per-iter)")
    g.add_argument("--max-replicas", type=ServeRequest.OWN_CONVERTERS["replicas"], default=16,
                   help="the most replicas a deployment may use (default 16)")
    g.add_argument("--attainment", type=float, default=0.99,
                   help="the share of requests that must meet both SLO bounds (default 0.99)")
    o = p.add_argument_group("results")
    o.add_argument("--slo", required=True,
                   help="the latency bounds to meet, e.g. ttft=0.5,tpot=0.05 (seconds)")
    o.add_argument("--exact-costs", action="store_true",
                   help="time every distinct iteration with the step engine (slow)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--out", help="write candidates.csv/.parquet and summary.json here")
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm for gathers/reductions (default auto)")
    cli.add_step_perturbation_args(p, power_cap=False)


def register(sub) -> None:
    cli.register_commands(sub, [("serve", _register_serve),
                                ("plan-serve", _register_plan_serve)])
