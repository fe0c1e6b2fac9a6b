"""A schedule's streams run on the fluid network: one SimPy process per (stream, chunk), with
the chunks' pipelining and the phase barriers of lock-step parts, and the latency term those
same rules give when links are infinitely fast."""

from __future__ import annotations

import dataclasses

import simpy

from sim.collectives.algorithms import Schedule, step_bytes_per_chip


def latency_path_s(schedule: Schedule, lat: list[list[float]], chunks: int = 1) -> float:
    """The latency term: how long the schedule takes if links were infinitely fast.

    `lat[s][k]` is step k of stream s's latency (all its repetitions). Chunks and phase barriers
    follow `launch_streams`: chunk c starts step k after its step k-1 and chunk c-1's step k; with
    `sync_phases` a stream's first step of phase p waits until every stream has finished its
    steps of phases < p (for that chunk). time - latency is the bandwidth term."""
    streams = schedule.streams
    num_phases = 1 + max((st.phase for s_ in streams for st in s_), default=0)
    prev_chunk = [[0.0] * len(s_) for s_ in streams]
    end = 0.0
    for _c in range(chunks):
        fin = [[0.0] * len(s_) for s_ in streams]
        last = [0.0] * len(streams)  # finish of the stream's latest step so far
        pos = [0] * len(streams)
        for p in range(num_phases if schedule.sync_phases else 1):
            barrier = max(last) if p > 0 else 0.0
            for si, s_ in enumerate(streams):
                first = True
                while pos[si] < len(s_) and (not schedule.sync_phases or s_[pos[si]].phase == p):
                    k = pos[si]
                    start = max(last[si], prev_chunk[si][k])
                    if first and p > 0:
                        start = max(start, barrier)
                    first = False
                    fin[si][k] = start + lat[si][k]
                    last[si] = fin[si][k]
                    pos[si] += 1
        prev_chunk = fin
        end = max([end, *last])
    return end



def is_reduce_scatter(step) -> bool:
    return "RS" in step.label.split()



def launch_streams(env, net, batches, schedule, group, chip, represented, timeline,
                   chunks=1) -> None:
    """One SimPy process per (stream, chunk).

    With C chunks each stream's data is cut into C pieces that flow through its steps like a
    pipeline: chunk c runs step k once it has finished step k-1 and chunk c-1 has finished step
    k, so later phases overlap earlier ones. With `sync_phases`, a chunk starts phase p of any
    stream only when that chunk has finished phase p-1 in every stream (lock-step parts).
    """
    num_phases = 1 + max((st.phase for s in schedule.streams for st in s), default=0)
    phase_done: dict[tuple[int, int, int], simpy.Event] = {}
    if schedule.sync_phases:
        for c in range(chunks):
            for si in range(len(batches)):
                for p in range(num_phases):
                    phase_done[(c, si, p)] = env.event()
    for si, stream in enumerate(batches):
        steps = schedule.streams[si]
        if chunks > 1:
            stream = [dataclasses.replace(b, bytes_per_transfer=b.bytes_per_transfer / chunks)
                      for b in stream]
        finished = [[env.event() for _ in stream] for _ in range(chunks)]

        def proc(stream=stream, steps=steps, si=si, c=0, finished=finished):
            cur_phase = -1
            for k, (b, st) in enumerate(zip(stream, steps, strict=True)):
                if phase_done and st.phase != cur_phase:
                    for p in range(max(cur_phase, 0), st.phase):
                        ev = phase_done[(c, si, p)]
                        if not ev.triggered:
                            ev.succeed()
                    if st.phase > 0:
                        others = [phase_done[(c, sj, st.phase - 1)] for sj in range(len(batches))]
                        yield env.all_of(others)
                    cur_phase = st.phase
                if c > 0 and not finished[c - 1][k].processed:
                    yield finished[c - 1][k]
                t0 = env.now
                yield net.transfer(b)
                finished[c][k].succeed()
                per_chip = step_bytes_per_chip(st) * st.repeat / chunks
                timeline.append((group, chip, represented, si, k, st.label, t0, env.now,
                                 per_chip))
            for p in range(max(cur_phase, 0), num_phases):
                if phase_done and not phase_done[(c, si, p)].triggered:
                    phase_done[(c, si, p)].succeed()

        for c in range(chunks):
            env.process(proc(c=c))
