"""A serving run as a Perfetto trace (the `perfetto` output of `tpusim serve`), built on
`sim/export/perfetto.py`'s `TracePlan` (native `.pftrace`, or Chrome JSON for `.json`; sized
before it is written, streamed to a temporary file renamed over the target).

One process per replica (named with its role, slice and mesh), with tracks:

* `iterations`: each iteration as a slice named by its batch composition (`decode 12 +
  prefill 2 (3,072 tokens)`), its args the composition (`decode_batch`,
  `decode_context_tokens`, `prefill_chunks`, `prefill_tokens`, `swap_tokens` when caches
  move to or from host memory) and the replica's state (`kv_blocks_used`, `queue_length` over
  all replicas);
* `requests NNNN`: the requests the replica holds, laid out on lanes (each to the lane free longest)
  (at most `MAX_REQUEST_LANES`; requests past them are left out of the lanes and the process
  name says how many), each request's phases as slices: `queued` (arrival to first scheduled),
  `prefill` (to its first token), `KV transfer` (disaggregated: to the cache's arrival at the
  decode replica) and `decode` (to its last token, on the replica that decodes it). The phases
  of one request are joined by flows, from its arrival through queueing, prefill and the KV
  transfer to its decode, across processes where the request moved. Args: the request's id,
  prompt and output tokens and preemptions. A phase shorter than 1 ns is left out (it would
  not nest) and the flow skips it.
* counters `KV blocks used` (at each iteration's start) and `queue length` (requests waiting
  at this replica, from every join and leave of its queue);
* counter `power (W)` (as a step's trace names it): one chip's mean power, its idle watts
  (`idle_power_w`) plus the iteration's dynamic joules on the replica's chips spread evenly
  over the iteration and its chips, back to idle between iterations. Swaps and KV transfers
  are not in it (the run's `energy` section counts them).

Times are simulated seconds from the first arrival's clock zero.
"""

from __future__ import annotations

import heapq
import math
from pathlib import Path

import numpy as np

from sim.export.perfetto import POWER_COUNTER, TracePlan, TraceProcess, check_span, chrome_events
from sim.export.pftrace import encode_tracks

MAX_REQUEST_LANES = 1024
REQUEST_TRACK = "requests"
# Phase ids: a request's op ids are PHASES * request + phase.
PHASES = 4
QUEUED, PREFILL, TRANSFER, DECODE = range(PHASES)
_PHASE_NAMES = ("queued", "prefill", "KV transfer", "decode")


def _ns(t: float) -> int:
    return round(t * 1e9)  # as the encoder rounds (pftrace._ns)


def _iteration_name(row) -> str:
    _rep, _role, _start, _dur, batch, _ctx, chunks, tokens, _q, _used, swapped = row
    parts = []
    if batch:
        parts.append(f"decode {batch}")
    if chunks:
        parts.append(f"prefill {chunks} ({tokens:,} tokens)")
    if swapped:
        parts.append(f"swap {swapped:,} tokens")
    return " + ".join(parts) or "idle"


def request_phases(req: dict[str, np.ndarray]) -> list[list[tuple[int, int, float, float]]]:
    """Per request, its phases as (replica, phase, start_s, end_s), in order; phases shorter
    than 1 ns once rounded are left out."""
    arrival, sched = req["arrival_s"].tolist(), req["scheduled_s"].tolist()
    first, moved = req["first_token_s"].tolist(), req["kv_transferred_s"].tolist()
    finish, rep, dec = req["finish_s"].tolist(), req["replica"].tolist(), \
        req["decode_replica"].tolist()
    out = []
    for i in range(len(arrival)):
        a, s, f, e = arrival[i], sched[i], first[i], finish[i]
        phases = [(rep[i], QUEUED, a, s), (rep[i], PREFILL, s, f)]
        if dec[i] >= 0:
            m = moved[i]
            phases += [(rep[i], TRANSFER, f, m), (dec[i], DECODE, m, e)]
        else:
            phases.append((rep[i], DECODE, f, e))
        out.append([p for p in phases if not (math.isnan(p[2]) or math.isnan(p[3]))
                    and _ns(p[3]) > _ns(p[2])])
    return out


def serving_tracks(summary: dict, result):
    """({replica: (tracks, counters)}, flows out, flows in, flow-out ids, flow-in ids,
    {replica: requests left out of its lanes}) of a serving run."""
    req = result.requests
    n = int(req["arrival_s"].size)
    num_rep = sum(p["replicas"] for p in summary["pools"])
    tracks: list[dict[str, list[tuple]]] = [{"iterations": []} for _ in range(num_rep)]
    counters: list[dict[str, list[tuple[float, float]]]] = [
        {"KV blocks used": [], "queue length": [(0.0, 0.0)]} for _ in range(num_rep)]
    power = result.replica_power
    joules = result.iteration_dynamic_j.tolist() if power else []
    if power:
        for r in range(num_rep):
            counters[r][POWER_COUNTER] = [(0.0, float(power[r][1]))]
    for k, row in enumerate(result.iterations):
        r, _role, start, dur, batch, ctx, chunks, tokens, queue, used, swapped = row
        if power:
            chips, idle = power[r]
            watts = counters[r][POWER_COUNTER]
            busy = idle + (joules[k] / (chips * dur) if dur > 0 else 0.0)
            if watts[-1][0] == start:  # an idle sample where the last iteration ended
                watts[-1] = (start, busy)
            else:
                watts.append((start, busy))
            watts.append((start + dur, float(idle)))
        args = {"decode_batch": batch, "decode_context_tokens": ctx, "prefill_chunks": chunks,
                "prefill_tokens": tokens, "kv_blocks_used": used, "queue_length": queue}
        if swapped:
            args["swap_tokens"] = swapped
        tracks[r]["iterations"].append((start, start + dur, _iteration_name(row), args, 0))
        counters[r]["KV blocks used"].append((start, float(used)))
    depth = [0] * num_rep
    for t, d, r in result.queue_events:
        depth[r] += d
        counters[r]["queue length"].append((t, float(depth[r])))
    phases = request_phases(req)
    prompt, output = req["prompt_tokens"].tolist(), req["output_tokens"].tolist()
    pre = req["preemptions"].tolist()
    # Lanes per replica: each request's stay there [first phase's start, last phase's end).
    stays: list[list[tuple[float, float, int, list]]] = [[] for _ in range(num_rep)]
    for rid, ph in enumerate(phases):
        by_rep: dict[int, list] = {}
        for p in ph:
            by_rep.setdefault(p[0], []).append(p)
        for r, ps in by_rep.items():
            stays[r].append((ps[0][2], ps[-1][3], rid, ps))
    shown = np.zeros(n * PHASES, dtype=bool)
    left_out = [0] * num_rep
    for r in range(num_rep):
        free_at: list[tuple[float, int]] = []  # heap of (free from, lane)
        rows: list[list[tuple]] = []
        for a, b, rid, ps in sorted(stays[r], key=lambda x: (x[0], x[1], x[2])):
            if free_at and free_at[0][0] <= a:
                k = heapq.heapreplace(free_at, (b, free_at[0][1]))[1]
            elif len(rows) >= MAX_REQUEST_LANES:
                left_out[r] += 1
                continue
            else:
                k = len(rows)
                heapq.heappush(free_at, (b, k))
                rows.append([])
            args = {"request": rid, "prompt_tokens": prompt[rid], "output_tokens": output[rid],
                    "preemptions": pre[rid]}
            for _r, phase, s, e in ps:
                op = PHASES * rid + phase
                rows[k].append((s, e, _PHASE_NAMES[phase], args, op))
                shown[op] = True
        width = len(str(max(len(rows) - 1, 0)))
        for k, rows_k in enumerate(rows):
            tracks[r][f"{REQUEST_TRACK} {k:0{width}d}"] = rows_k
    # Flows: each shown phase to the next shown phase of its request; the edge leaving op `o`
    # has id o + 1 (never 0).
    flow_out_ids = np.zeros(n * PHASES, dtype=np.uint64)
    flow_in_ids = np.zeros(n * PHASES, dtype=np.uint64)
    outs, ins = [], []
    for rid, ph in enumerate(phases):
        ops = [PHASES * rid + p[1] for p in ph if shown[PHASES * rid + p[1]]]
        for a, b in zip(ops, ops[1:], strict=False):
            flow_out_ids[a] = a + 1
            flow_in_ids[b] = a + 1
            outs.append(a)
            ins.append(b)
    return ([(tracks[r], counters[r]) for r in range(num_rep)], frozenset(outs),
            frozenset(ins), flow_out_ids, flow_in_ids, left_out)


def _replica_names(summary: dict, left_out: list[int]) -> list[str]:
    names = []
    for p in summary["pools"]:
        for _ in range(p["replicas"]):
            r = len(names)
            role = "" if p["role"] == "both" else f"{p['role']} "
            name = (f"{role}replica {r}: {p['slice']}, mesh {p['mesh']}, "
                    f"{p['kv_blocks']:,} KV blocks")
            if left_out[r]:
                name += f" ({left_out[r]:,} requests past {MAX_REQUEST_LANES} lanes not shown)"
            names.append(name)
    return names


def plan_serving_trace(summary: dict, result, path: str | Path) -> TracePlan:
    """Everything `export_serving` writes, encoded and sized but not yet written."""
    fin = result.requests["finish_s"]
    check_span(float(np.nanmax(fin)) if fin.size else 0.0, "the serving run")
    per_rep, outs, ins, out_ids, in_ids, left_out = serving_tracks(summary, result)

    def encode(key: int, as_json: bool):
        tracks, counters = per_rep[key]
        kw = {"flows_out": outs, "flows_in": ins, "flow_tracks": (REQUEST_TRACK,)}
        return chrome_events(tracks, counters, **kw) if as_json else \
            encode_tracks(tracks, counters, **kw)

    procs = [TraceProcess(chip=r, name=name, key=r)
             for r, name in enumerate(_replica_names(summary, left_out))]
    return TracePlan(Path(path), procs, encode, flows=lambda _p: (out_ids, in_ids),
                     what="the serving run")


def export_serving(summary: dict, result, path: str | Path) -> Path:
    """Write a serving run as a Perfetto trace (`.pftrace`) or Chrome JSON (`.json`)."""
    plan = plan_serving_trace(summary, result, path)
    plan.check_size()
    return plan.write()
