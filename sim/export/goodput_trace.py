"""A goodput run's job life as a Perfetto trace (its `perfetto` file), built on
`sim/export/perfetto.py`'s `TracePlan` (native `.pftrace`, or Chrome JSON for `.json`; sized
before it is written, streamed to a temporary file renamed over the target).

One process, seed 0's training job, with tracks: `training and checkpoints` (each segment of
steps, kept or lost, and each checkpoint write, committed or cut short), `recovery` (cube
swaps, restarts, waiting for a repair or a spare), `failures` (a 1 ms slice per failure named
by what failed), `repairs N` (each part under repair, laid out on as few lanes as do not
overlap, at most `MAX_REPAIR_LANES`), and counters `steps committed` and, with spare cubes,
`spare cubes free`. Times are wall-clock seconds from the job's start.
"""

from __future__ import annotations

from pathlib import Path

from sim.export.perfetto import TracePlan, TraceProcess, check_span, chrome_events
from sim.export.pftrace import encode_tracks

MAX_REPAIR_LANES = 64
_FAILURE_MARK_S = 1e-3


def _name(kind: str, d: dict) -> str:
    if kind == "train":
        if "window" in d:
            return f"training ({d['checkpoints']} checkpoints)"
        first, last = d["steps"]
        return f"steps {first}-{last}" + ("" if d["kept"] else " (lost)")
    if kind == "checkpoint":
        return f"checkpoint after step {d['after_step']}" + ("" if d["committed"] else
                                                           " (cut short)")
    if kind == "restart":
        return "restart" + ("" if d["completed"] else " (interrupted)")
    if kind == "swap":
        return "cube swap"
    if kind == "wait_repair":
        return "waiting for repair"
    if kind == "wait_spare":
        return "waiting for a spare cube"
    return kind


def _args(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, list):
            v = "-".join(str(x) for x in v)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            continue  # unknown (a unit a trace did not name)
        out[k] = v
    return out


def job_tracks(summary: dict, result) -> tuple[dict[str, list[tuple]], dict[str, list]]:
    """(tracks, counters) of seed 0's job (see the module docstring)."""
    events = result.events()
    training, recovery, failures = [], [], []
    repairs: list[tuple[float, float, str, dict]] = []
    committed = [(0.0, 0.0)]
    spares = summary["spare_cubes"] if summary["swaps_cubes"] else None
    changes = []
    op = 0
    for a, b, kind, d in events:
        op += 1
        if kind in ("train", "checkpoint"):
            if b > a:
                training.append((a, b, _name(kind, d), _args(d), op))
            if kind == "checkpoint" and d.get("committed"):
                committed.append((b, float(d["after_step"] + 1)))
        elif kind in ("restart", "swap", "wait_repair", "wait_spare"):
            if b > a:
                recovery.append((a, b, _name(kind, d), _args(d), op))
        elif kind == "failure":
            what = d["kind"] + (f" {d['unit']}" if d.get("unit", -1) >= 0 else "")
            if d.get("cube", -1) >= 0:
                what += f" (cube {d['cube']})"
            failures.append((a, a + _FAILURE_MARK_S, f"{what} fails", _args(d), op))
        elif kind == "repair":
            repairs.append((a, b, f"repair of {d['kind']}" +
                            (f" {d['unit']}" if d.get("unit", -1) >= 0 else ""), _args(d)))
            changes.append((b, 1))
        elif kind == "swap_in":
            changes.append((a, -d["cubes"]))
    # Failure marks never overlap (two failures within 1 ms share the gap).
    failures.sort(key=lambda r: r[0])
    for i in range(len(failures) - 1):
        a, b, *rest = failures[i]
        nxt = failures[i + 1][0]
        if b > nxt:
            failures[i] = (a, max(nxt, a), *rest)
    tracks: dict[str, list[tuple]] = {"training and checkpoints": training,
                                      "recovery": recovery, "failures": failures}
    lanes: list[float] = []
    lane_rows: list[list[tuple]] = []
    for a, b, name, args in sorted(repairs, key=lambda r: (r[0], r[1])):
        for i, free_at in enumerate(lanes):
            if free_at <= a:
                lanes[i] = b
                lane_rows[i].append((a, b, name, args, 0))
                break
        else:
            if len(lanes) < MAX_REPAIR_LANES:
                lanes.append(b)
                lane_rows.append([(a, b, name, args, 0)])
    for i, rows in enumerate(lane_rows):
        tracks[f"repairs {i}"] = rows
    end = result.outcome.outcomes[0].wall_s
    final = result.job.steps if result.job.steps is not None else \
        result.outcome.outcomes[0].useful_s / result.job.step_time_s
    committed.append((end, float(final)))
    counters = {"steps committed": committed}
    if spares is not None:
        n, pts = spares, [(0.0, float(spares))]
        for when, d in sorted(changes):
            if when > end:
                break
            n += d
            pts.append((when, float(n)))
        counters["spare cubes free"] = pts
    return tracks, counters


def export_goodput(summary: dict, result, path: str | Path) -> Path:
    """Write seed 0's job as a Perfetto trace (`.pftrace`) or Chrome JSON (`.json`)."""
    check_span(result.outcome.outcomes[0].wall_s, "the job")
    tracks, counters = job_tracks(summary, result)

    def encode(_key, as_json: bool):
        return chrome_events(tracks, counters) if as_json else encode_tracks(tracks, counters)

    name = (f"training job, seed 0: {summary['num_chips']:,} {summary['chip']} chips, "
            f"goodput {summary['goodput']:.1%}")
    plan = TracePlan(Path(path), [TraceProcess(chip=0, name=name, key=0)], encode, what="the job")
    plan.check_size()
    return plan.write()
