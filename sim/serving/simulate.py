"""The serving loop in SimPy: requests arrive, a router sends each to a replica, and each
replica's scheduler runs iterations, each timed by the cost model (`costs.py`).

Per replica, one SimPy process runs iteration after iteration while it has work and waits on an
event when it has none; one process issues the arrivals. Schedulers, as serving engines run them:

* `static`: when the replica is idle it takes up to `max_batch` waiting requests (as many as
  the KV cache holds at their full length), prefills them all in one iteration, then decodes
  the whole batch (finished sequences stay in it as padding) until its longest request ends.
* `continuous`: every iteration first continues the prompts being prefilled, then admits
  waiting requests (FIFO) while the batch has room (`max_batch` sequences), the iteration's
  token budget (`max_tokens_per_iter`: one token per decoding sequence plus the prompt tokens
  prefilled) allows, and the KV cache has free blocks for the prompt. Without `prefill_chunk`
  a prompt is prefilled whole in one iteration; with it, in chunks of at most that many tokens,
  sharing iterations with the decodes. A prefill's last chunk yields the first token; each
  decode step one more.

The KV cache is paged: `kv_block_tokens` tokens a block, the replica's blocks those its HBM
holds after the weights and working memory (`StepModel.kv_capacity_tokens`). A sequence takes a
new block when its cache fills the last; when none is free the most recently admitted sequence
is preempted (vLLM's policy): its blocks are freed and it goes back to the head of the queue,
to be prefilled again over its prompt and the tokens it has generated (`recompute`), or, with
`swap`, with its cache copied to host memory over PCIe (in the iteration that preempts it) and
copied back when it is readmitted (that iteration pays the copy, and it decodes from the next
without a prefill). A copy takes its cached tokens' bytes over the replica's chips, each over
its own PCIe link (`PoolSpec.swap_s_per_token`); host memory is taken as large enough.

Prefix caching (`prefix_caching`): after a request with a `prefix_id` is prefilled, the whole
blocks of its prefix (`Workload.prefix_lengths`, leaving its last prompt token) stay on the
replica as that id's cached prefix, shared by reference: a later request with the id admitted
there takes those blocks as its own first ones and prefills only the rest of its prompt (its
chunks priced after the cached tokens). Cached prefixes no running request uses are freed
least recently used first when blocks run short, before any sequence is preempted.

Disaggregated serving: prefill replicas run only prefill iterations, then send the request's
KV cache to a decode replica (the router's choice) in `transfer_s(tokens)`; the decode replica
admits it when it has blocks and a batch slot, and decodes it from its first token.

No per-token work: a decoding sequence's token count is `g0 + (iteration - joined)`, its finish
and next-block iterations sit in heaps, and the batch's summed context grows by the batch size
each iteration; so an iteration costs O(log batch) Python operations plus its admissions.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import simpy

from sim.engine.replay import run_env
from sim.serving.workload import Workload
from topologies.progress import task


class SchedulerKind(StrEnum):
    STATIC = "static"
    CONTINUOUS = "continuous"


class RouterKind(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_OUTSTANDING = "least-outstanding"
    LEAST_KV = "least-kv"


class PreemptionKind(StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class Role(StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """One replica's batching settings (`ServeRequest`'s scheduler settings)."""

    scheduler: SchedulerKind = SchedulerKind.CONTINUOUS
    max_batch: int = 256
    max_tokens_per_iter: int | None = None
    prefill_chunk: int | None = None
    kv_block_tokens: int = 16
    preemption: PreemptionKind = PreemptionKind.RECOMPUTE
    prefix_caching: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """Replicas of one configuration: their role, count, KV blocks each, and iteration costs."""

    role: Role
    replicas: int
    kv_blocks: int
    costs: object  # IterationCosts
    num_chips: int
    # Seconds to copy one cached token of one sequence between HBM and host memory: its bytes
    # over the replica's chips, each over its own PCIe link (swap preemption).
    swap_s_per_token: float = 0.0


# Iteration-table columns (one tuple per iteration, in this order).
ITERATION_COLUMNS = ("replica", "role", "start_s", "duration_s", "decode_batch",
                     "decode_context_tokens", "prefill_chunks", "prefill_tokens",
                     "queue_length", "kv_blocks_used", "swap_tokens")


class IterationLog:
    """The iteration rows (`ITERATION_COLUMNS`, one tuple each as `append` takes them), packed
    into numpy structured arrays of `CHUNK` rows as they fill: about 100 bytes a row instead of
    the 250 a tuple of Python numbers takes, so a million-request run's millions of iterations
    stay in bounded memory. Iterating yields the rows as tuples again, in order."""

    CHUNK = 1 << 16
    DTYPE = np.dtype([("replica", np.int64), ("role", "U7"), ("start_s", np.float64),
                      ("duration_s", np.float64), ("decode_batch", np.int64),
                      ("decode_context_tokens", np.int64), ("prefill_chunks", np.int64),
                      ("prefill_tokens", np.int64), ("queue_length", np.int64),
                      ("kv_blocks_used", np.int64), ("swap_tokens", np.int64)])

    def __init__(self) -> None:
        self._packed: list[np.ndarray] = []
        self._tail: list[tuple] = []
        self._n = 0

    def append(self, row: tuple) -> None:
        tail = self._tail
        tail.append(row)
        self._n += 1
        if len(tail) >= self.CHUNK:
            self._packed.append(np.array(tail, dtype=self.DTYPE))
            tail.clear()

    def __len__(self) -> int:
        return self._n

    def _chunks(self) -> list[np.ndarray]:
        if not self._tail:
            return self._packed
        return [*self._packed, np.array(self._tail, dtype=self.DTYPE)]

    def __iter__(self):
        for chunk in self._packed:
            yield from chunk.tolist()
        yield from self._tail

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def column(self, name: str) -> np.ndarray:
        """One column over every row, as a numpy array."""
        chunks = self._chunks()
        if not chunks:
            return np.zeros(0, dtype=self.DTYPE[name])
        return np.concatenate([c[name] for c in chunks])

    def columns(self) -> dict[str, np.ndarray]:
        return {name: self.column(name) for name in ITERATION_COLUMNS}


class _Replica:
    __slots__ = ("idx", "role", "cfg", "costs", "blocks", "free", "waiting", "prefill",
                 "running", "fin", "blk", "ctx_sum", "it", "wake", "outstanding", "busy_s",
                 "static_batch", "held", "swap_s_per_token", "swap_out", "prefixes",
                 "shared")

    def __init__(self, idx: int, role: Role, cfg: SchedulerConfig, costs, blocks: int,
                 swap_s_per_token: float = 0.0):
        self.idx, self.role, self.cfg, self.costs = idx, role, cfg, costs
        self.swap_s_per_token = swap_s_per_token
        self.swap_out = 0  # tokens swapped out while planning the next iteration
        # Cached prefixes, least recently used first: prefix id -> [blocks, tokens, users].
        self.prefixes: OrderedDict[int, list[int]] = OrderedDict()
        self.shared: dict[int, tuple[int, int]] = {}  # rid -> (prefix id, its shared blocks)
        self.blocks = self.free = blocks
        self.waiting: deque[int] = deque()  # request ids, FIFO (preempted ones at the head)
        self.prefill: list[list[int]] = []  # [rid, tokens done, tokens to prefill]
        self.running: dict[int, tuple[int, int]] = {}  # rid -> (joined iteration, g0)
        self.fin: list[tuple[int, int, int]] = []  # (last iteration, rid, generation)
        self.blk: list[tuple[int, int, int]] = []  # (iteration needing a block, rid, gen)
        self.ctx_sum = 0  # cached tokens over the running sequences, as the next step sees
        self.it = 0
        self.wake = None
        self.outstanding = 0
        self.busy_s = 0.0
        self.static_batch: list[int] | None = None
        self.held: dict[int, int] = {}  # rid -> blocks


class ServingSim:
    """One serving run over `workload` (see the module docstring). `run()` fills the
    per-request arrays and the iteration list."""

    def __init__(self, workload: Workload, pools: list[PoolSpec], cfg: SchedulerConfig, *,
                 router: RouterKind = RouterKind.ROUND_ROBIN, transfer_s=None,
                 iteration_joules: bool = False):
        self.w, self.cfg, self.router = workload, cfg, router
        # Each iteration's dynamic joules, in `iterations` order (for a power track), when
        # asked: one more interpolation per iteration.
        self.iteration_j: array | None = array("d") if iteration_joules else None
        n = workload.num_requests
        self.prompt = workload.prompt_tokens.tolist()
        self.output = workload.output_tokens.tolist()
        self.arrival = workload.arrival_s.tolist()
        nan = math.nan
        self.first_sched = [nan] * n
        self.first_token = [nan] * n
        self.finish = [nan] * n
        self.replica = [-1] * n
        self.decode_replica = [-1] * n
        self.transfer_done = [nan] * n
        self.preempted = [0] * n
        self.gen = [0] * n  # bumped on preemption: stale heap entries are skipped
        self.tokens_done = [0] * n  # tokens generated when (re)queued for prefill
        self.swapped = [False] * n  # preempted by swap: its cache waits in host memory
        self.swap_tokens = 0  # cached tokens copied over PCIe, out and in
        self.prefix = workload.prefix_id.tolist()
        # Each request's shareable prefix: whole blocks of its prefix, leaving at least its last
        # prompt token to prefill (its logits make the first token).
        self.share: list[int] | None = None
        if cfg.prefix_caching:
            bs = cfg.kv_block_tokens
            self.share = [min(k, p - 1) // bs * bs for k, p in
                          zip(workload.prefix_lengths().tolist(), self.prompt, strict=True)]
        self.prefix_hit_tokens = 0  # prompt tokens not prefilled: their prefix was cached
        self.iterations = IterationLog()
        # (time, +1 joined / -1 left a replica's queue, replica)
        self.queue_events: list[tuple[float, int, int]] = []
        self.events = 0
        self.preemptions = 0
        self.transfer_s = transfer_s
        self.front: list[_Replica] = []
        self.back: list[_Replica] = []
        k = 0
        for pool in pools:
            for _ in range(pool.replicas):
                rep = _Replica(k, pool.role, cfg, pool.costs, pool.kv_blocks,
                               pool.swap_s_per_token)
                k += 1
                (self.back if pool.role is Role.DECODE else self.front).append(rep)
        self.replicas = self.front + self.back
        self._rr = [0, 0]
        self.env = simpy.Environment()

    # -- routing ----------------------------------------------------------------------------
    def _route(self, reps: list[_Replica], which: int) -> _Replica:
        if self.router is RouterKind.ROUND_ROBIN:
            r = reps[self._rr[which] % len(reps)]
            self._rr[which] += 1
            return r
        if self.router is RouterKind.LEAST_OUTSTANDING:
            return min(reps, key=lambda r: (r.outstanding, r.idx))
        return min(reps, key=lambda r: ((r.blocks - r.free) / max(r.blocks, 1), r.outstanding,
                                        r.idx))

    def _poke(self, rep: _Replica) -> None:
        if rep.wake is not None and not rep.wake.triggered:
            rep.wake.succeed()

    # -- processes ----------------------------------------------------------------------------
    def _arrivals(self):
        env, t_prev = self.env, 0.0
        for rid, t in enumerate(self.arrival):
            if t > t_prev:
                yield env.timeout(t - t_prev)
                self.events += 1
                t_prev = t
            rep = self._route(self.front, 0)
            self.replica[rid] = rep.idx
            rep.outstanding += 1
            rep.waiting.append(rid)
            self.queue_events.append((env.now, 1, rep.idx))
            self._poke(rep)

    def _loop(self, rep: _Replica):
        env = self.env
        while True:
            plan = self._plan(rep)
            if plan is None:
                rep.wake = env.event()
                yield rep.wake
                rep.wake = None
                self.events += 1
                continue
            cost = plan[0]
            start = env.now
            yield env.timeout(cost)
            self.events += 1
            rep.busy_s += cost
            self._complete(rep, plan, start)

    # -- one iteration ----------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.kv_block_tokens)

    def _dequeue(self, rep: _Replica, rid: int) -> None:
        if math.isnan(self.first_sched[rid]):
            self.first_sched[rid] = self.env.now
        self.queue_events.append((self.env.now, -1, rep.idx))

    def _plan(self, rep: _Replica):
        """The next iteration's cost and composition (None: nothing to do)."""
        if self.cfg.scheduler is SchedulerKind.STATIC and rep.role is not Role.DECODE:
            return self._plan_static(rep)
        cfg, costs = self.cfg, rep.costs
        budget = cfg.max_tokens_per_iter if cfg.max_tokens_per_iter is not None else 1 << 62
        if rep.role is Role.DECODE:
            self._admit_decodes(rep)
        else:
            self._grow_blocks(rep)
        batch = len(rep.running)
        budget -= batch
        chunks: list[tuple[int, int, int]] = []  # (rid, tokens, cached)
        swaps: list[tuple[int, int]] = []  # (rid, tokens generated): caches swapped back in
        if rep.role is not Role.DECODE:
            chunk_cap = cfg.prefill_chunk if cfg.prefill_chunk is not None else 1 << 62
            for entry in rep.prefill:
                rid, done, target = entry
                t = min(target - done, chunk_cap, budget)
                if t <= 0 or (cfg.prefill_chunk is None and t < target - done):
                    break
                chunks.append((rid, t, done))
                budget -= t
            while rep.waiting and budget > 0 and \
                    batch + len(rep.prefill) + len(swaps) < cfg.max_batch:
                rid = rep.waiting[0]
                target = self.prompt[rid] + max(self.tokens_done[rid] - 1, 0)
                need = self._blocks_for(target)
                if self.swapped[rid] and need > rep.free:
                    self._evict(rep, need)
                if self.swapped[rid]:
                    if need > rep.free:
                        break
                    # Its cache comes back from host memory: no prefill, it decodes next.
                    rep.waiting.popleft()
                    self._dequeue(rep, rid)
                    rep.free -= need
                    rep.held[rid] = need
                    swaps.append((rid, self.tokens_done[rid]))
                    continue
                hit, pid = self._prefix_hit(rep, rid) if self.share is not None else (0, -1)
                need -= hit // cfg.kv_block_tokens  # its prefix's blocks are shared
                if need > rep.free:
                    self._evict(rep, need, keep=pid)
                    if need > rep.free:
                        break
                rest = target - hit
                if cfg.prefill_chunk is None:
                    if rest > budget and (chunks or batch):
                        break  # a whole prompt waits for an iteration with room for it
                    t = rest  # alone, a prompt over the budget still runs (else it never)
                else:
                    t = min(rest, chunk_cap, budget)
                rep.waiting.popleft()
                self._dequeue(rep, rid)
                rep.free -= need
                rep.held[rid] = need
                if hit:
                    entry = rep.prefixes[pid]
                    entry[2] += 1
                    rep.prefixes.move_to_end(pid)
                    rep.shared[rid] = (pid, hit // cfg.kv_block_tokens)
                    self.prefix_hit_tokens += hit
                rep.prefill.append([rid, hit, target])
                chunks.append((rid, t, hit))
                budget -= t
        swap_tokens = rep.swap_out + sum(self.prompt[r] + g - 1 for r, g in swaps)
        rep.swap_out = 0
        if not chunks and not batch and not swaps:
            return None if not swap_tokens else (swap_tokens * rep.swap_s_per_token, 0, 0, [],
                                                 [], swap_tokens)
        cost = sum(costs.prefill_s(t, c) for _, t, c in chunks)
        if batch:
            cost += costs.decode_s(batch, rep.ctx_sum)
        # Swaps copy over PCIe before the iteration's programs run (as vLLM's cache ops do).
        cost += swap_tokens * rep.swap_s_per_token
        return (cost, batch, rep.ctx_sum, chunks, swaps, swap_tokens)

    # -- prefix caching ---------------------------------------------------------------------
    def _prefix_hit(self, rep: _Replica, rid: int) -> tuple[int, int]:
        """(prompt tokens of `rid` already cached on `rep` as its prefix, the prefix id)."""
        pid = self.prefix[rid]
        if pid < 0 or self.swapped[rid]:
            return 0, -1
        entry = rep.prefixes.get(pid)
        return (min(entry[1], self.share[rid]) if entry is not None else 0), pid

    def _cache_prefix(self, rep: _Replica, rid: int) -> None:
        """After `rid`'s prefill, keep its prefix's blocks as the replica's cached prefix
        (when none is cached under its id yet): they pass from the request to the cache."""
        pid = self.prefix[rid]
        if pid < 0 or pid in rep.prefixes or rid in rep.shared:
            return
        k = self.share[rid] // self.cfg.kv_block_tokens
        if k <= 0:
            return
        rep.held[rid] -= k
        rep.prefixes[pid] = [k, self.share[rid], 1]
        rep.shared[rid] = (pid, k)

    def _release_prefix(self, rep: _Replica, rid: int) -> None:
        e = rep.shared.pop(rid, None)
        if e is not None:
            rep.prefixes[e[0]][2] -= 1  # its blocks stay cached until evicted

    def _evict(self, rep: _Replica, need: int, keep: int = -1) -> None:
        """Free cached prefixes no running request uses, least recently used first, until
        `need` blocks are free (or none is left to free); `keep` is not evicted."""
        if not rep.prefixes:
            return
        for pid in list(rep.prefixes):
            if rep.free >= need:
                return
            e = rep.prefixes[pid]
            if e[2] == 0 and pid != keep:
                del rep.prefixes[pid]
                rep.free += e[0]

    def _grow_blocks(self, rep: _Replica) -> None:
        """Give every running sequence whose cache fills its last block a new one this
        iteration, preempting the most recently admitted when none is free."""
        blk, it, gen = rep.blk, rep.it, self.gen
        while blk and blk[0][0] <= it:
            _, rid, g = heapq.heappop(blk)
            if g != gen[rid] or rid not in rep.running:
                continue
            if rep.free < 1:
                self._evict(rep, 1)
            while rep.free < 1 and rep.running:
                victim = next(reversed(rep.running))
                self._preempt(rep, victim)
                if victim == rid:
                    break
            if rid not in rep.running:
                continue
            rep.free -= 1
            rep.held[rid] += 1
            heapq.heappush(blk, (it + self.cfg.kv_block_tokens, rid, g))

    def _preempt(self, rep: _Replica, rid: int) -> None:
        joined, g0 = rep.running.pop(rid)
        g = g0 + (rep.it - joined)  # tokens generated so far
        rep.ctx_sum -= self.prompt[rid] + g - 1
        rep.free += rep.held.pop(rid)
        self._release_prefix(rep, rid)
        self.gen[rid] += 1
        self.preempted[rid] += 1
        self.preemptions += 1
        self.tokens_done[rid] = g
        if self.cfg.preemption is PreemptionKind.SWAP:
            self.swapped[rid] = True
            rep.swap_out += self.prompt[rid] + g - 1  # its cached tokens go to host memory
        rep.waiting.appendleft(rid)
        self.queue_events.append((self.env.now, 1, rep.idx))

    def _join(self, rep: _Replica, rid: int, g0: int, it: int) -> None:
        """`rid` decodes from iteration `it` on, having generated `g0` tokens."""
        p, o = self.prompt[rid], self.output[rid]
        rep.running[rid] = (it, g0)
        cached = p + g0 - 1
        rep.ctx_sum += cached
        heapq.heappush(rep.fin, (it + o - g0 - 1, rid, self.gen[rid]))
        bs = self.cfg.kv_block_tokens
        shared = rep.shared.get(rid)
        held = rep.held[rid] + (shared[1] if shared is not None else 0)
        # The step at iteration i writes token cached + (i - it) + 1; a new block when that
        # passes held * bs.
        heapq.heappush(rep.blk, (it + held * bs - cached, rid, self.gen[rid]))

    def _finish(self, rep: _Replica, rid: int) -> None:
        self.finish[rid] = self.env.now
        rep.free += rep.held.pop(rid)
        self._release_prefix(rep, rid)
        rep.outstanding -= 1

    def _complete(self, rep: _Replica, plan, start: float) -> None:
        cost, batch, ctx_sum, chunks, swaps, swap_tokens = plan
        now = self.env.now
        it = rep.it
        queue = sum(len(r.waiting) for r in self.replicas)
        self.iterations.append((rep.idx, rep.role.value, start, cost, batch, ctx_sum,
                                len(chunks), sum(t for _, t, _c in chunks), queue,
                                rep.blocks - rep.free, swap_tokens))
        if self.iteration_j is not None:
            self.iteration_j.append(rep.costs.iteration_joules(
                batch, ctx_sum, [(t, c) for _, t, c in chunks]))
        self.swap_tokens += swap_tokens
        # Decodes: every running sequence made a token; those at their last one finish.
        if batch:
            rep.ctx_sum += batch
            fin, gen = rep.fin, self.gen
            while fin and fin[0][0] <= it:
                _, rid, g = heapq.heappop(fin)
                if g != gen[rid] or rid not in rep.running:
                    continue
                joined, g0 = rep.running.pop(rid)
                rep.ctx_sum -= self.prompt[rid] + g0 + (it + 1 - joined) - 1
                self._finish(rep, rid)
        # Prefill chunks: a prompt whose last chunk ran yields its first token.
        if chunks:
            done_now = {rid: t for rid, t, _c in chunks}
            keep = []
            for entry in rep.prefill:
                rid = entry[0]
                if rid in done_now:
                    entry[1] += done_now[rid]
                if entry[1] < entry[2]:
                    keep.append(entry)
                    continue
                g0 = max(self.tokens_done[rid], 1)
                if self.share is not None:
                    self._cache_prefix(rep, rid)
                if math.isnan(self.first_token[rid]):
                    self.first_token[rid] = now
                if g0 >= self.output[rid]:
                    self._finish(rep, rid)
                elif rep.role is Role.PREFILL:
                    self._send(rep, rid)
                else:
                    self._join(rep, rid, g0, it + 1)
            rep.prefill = keep
        for rid, g in swaps:
            self.swapped[rid] = False
            self._join(rep, rid, g, it + 1)
        rep.it = it + 1

    # -- static batching --------------------------------------------------------------------
    def _plan_static(self, rep: _Replica):
        costs = rep.costs
        if rep.static_batch is None:
            if not rep.waiting:
                return None
            members: list[int] = []
            while rep.waiting and len(members) < self.cfg.max_batch:
                rid = rep.waiting[0]
                need = self._blocks_for(self.prompt[rid] + self.output[rid])
                if need > rep.free and members:
                    break
                rep.waiting.popleft()
                self._dequeue(rep, rid)
                rep.free -= need
                rep.held[rid] = need
                members.append(rid)
            rep.static_batch = members
            rep.it = 0
            chunks = [(rid, self.prompt[rid], 0) for rid in members]
            cost = sum(costs.prefill_s(t, 0) for _, t, _c in chunks)
            return (cost, 0, 0, chunks, [], 0)
        members = rep.static_batch
        b = len(members)
        ctx = sum(self.prompt[r] for r in members) + b * (rep.it - 1)
        return (costs.decode_s(b, ctx), b, ctx, [], [], 0)

    def _complete_static(self, rep: _Replica, plan, start: float) -> None:
        cost, batch, ctx, chunks, _swaps, _swapped = plan
        now = self.env.now
        members = rep.static_batch
        queue = sum(len(r.waiting) for r in self.replicas)
        self.iterations.append((rep.idx, rep.role.value, start, cost, batch, ctx, len(chunks),
                                sum(t for _, t, _c in chunks), queue, rep.blocks - rep.free, 0))
        if self.iteration_j is not None:
            self.iteration_j.append(rep.costs.iteration_joules(
                batch, ctx, [(t, c) for _, t, c in chunks]))
        it = rep.it  # 0: the prefill; k >= 1: the k-th decode step (token k + 1)
        for rid in members:
            if it == 0:
                self.first_token[rid] = now
            if self.output[rid] == it + 1:
                self.finish[rid] = now
        rep.it = it + 1
        if rep.it >= max(self.output[r] for r in members):
            for rid in members:
                rep.free += rep.held.pop(rid)
                rep.outstanding -= 1
            rep.static_batch = None

    # -- disaggregation ---------------------------------------------------------------------
    def _send(self, rep: _Replica, rid: int) -> None:
        """Free the prefill replica's blocks and ship the cache to a decode replica."""
        rep.free += rep.held.pop(rid)
        self._release_prefix(rep, rid)
        rep.outstanding -= 1
        dst = self._route(self.back, 1)
        self.decode_replica[rid] = dst.idx
        dst.outstanding += 1
        delay = self.transfer_s(self.prompt[rid]) if self.transfer_s else 0.0
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _ev, rid=rid, dst=dst: self._deliver(dst, rid))

    def _deliver(self, dst: _Replica, rid: int) -> None:
        self.events += 1
        self.transfer_done[rid] = self.env.now
        dst.waiting.append(rid)
        self._poke(dst)

    def _admit_decodes(self, rep: _Replica) -> None:
        self._grow_blocks(rep)
        while rep.waiting and len(rep.running) < self.cfg.max_batch:
            rid = rep.waiting[0]
            g0 = max(self.tokens_done[rid], 1)
            # A decode replica reserves the whole sequence (prompt and every output token) on
            # admission, so it never preempts what a prefill replica sent it.
            need = self._blocks_for(self.prompt[rid] + self.output[rid])
            if need > rep.free:
                break
            rep.waiting.popleft()
            rep.free -= need
            rep.held[rid] = need
            self._join(rep, rid, g0, rep.it)

    # -- run --------------------------------------------------------------------------------
    def run(self) -> None:
        env = self.env
        env.process(self._arrivals())
        for rep in self.replicas:
            env.process(self._static_or_loop(rep))
        # Progress: the requests arrived by the simulated time reached (their arrival times
        # are known in advance: a search, no counting in the loop).
        arrivals = self.w.arrival_s
        with task("serve", total=len(arrivals), unit="request") as t:
            run_env(env, t, lambda: int(np.searchsorted(arrivals, env.now, side="right")))

    def _static_or_loop(self, rep: _Replica):
        if self.cfg.scheduler is SchedulerKind.STATIC and rep.role is not Role.DECODE:
            env = self.env
            while True:
                plan = self._plan_static(rep)
                if plan is None:
                    rep.wake = env.event()
                    yield rep.wake
                    rep.wake = None
                    self.events += 1
                    continue
                start = env.now
                yield env.timeout(plan[0])
                self.events += 1
                rep.busy_s += plan[0]
                self._complete_static(rep, plan, start)
        else:
            yield from self._loop(rep)

    def request_arrays(self) -> dict[str, np.ndarray]:
        return {
            "arrival_s": self.w.arrival_s,
            "prompt_tokens": self.w.prompt_tokens,
            "output_tokens": self.w.output_tokens,
            "replica": np.asarray(self.replica, dtype=np.int64),
            "decode_replica": np.asarray(self.decode_replica, dtype=np.int64),
            "scheduled_s": np.asarray(self.first_sched),
            "first_token_s": np.asarray(self.first_token),
            "kv_transferred_s": np.asarray(self.transfer_done),
            "finish_s": np.asarray(self.finish),
            "preemptions": np.asarray(self.preempted, dtype=np.int64),
        }
