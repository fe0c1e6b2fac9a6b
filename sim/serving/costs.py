"""The time of one serving iteration, from tpusim's own step model.

An iteration runs the decode program over the sequences that are generating (one token each)
and the prefill program of each prompt chunk scheduled with them, one after the other on the
replica's chips, as JetStream runs its prefill and generate programs: so its time is
`decode(B, C) + sum of prefill(t_i after c_i cached tokens)`. A decode step's attention reads
every sequence's cache, which is linear in the summed context, so a batch of sequences at
different context lengths costs what the same batch at their mean context costs (exact for
full attention; a sliding-window layer, whose cache stops growing at its window, is taken at
the mean too). The batch is padded to a multiple of the data x expert (x fsdp) shards, as the
decode program pads it.

`StepModel` runs the engine (`workloads/inference/` compiled, replayed by `sim.engine.executors`
with the replica's perturbations): the oracle, memoised per distinct composition. `IterationCosts`
is built from it once per replica configuration: exact at the points of a grid over batch x context
(decode) and chunk tokens x cached tokens (prefill), bilinear between them; a test holds it within
1% of the engine on random compositions. With `exact=True` it asks the engine for every distinct
composition instead (a serve request's `exact_costs`).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections import OrderedDict
from typing import Any

from topologies.errors import TpusimError
from workloads.inference import DecodeConfig, compile_decode_step, compile_prefill, memory_plan

# The units of an iteration's dynamic energy (`sim.energy.CHIP_UNITS` without static power,
# which a serving run adds for its whole span).
DYNAMIC_UNITS = ("mxu", "vpu", "hbm", "ici", "dcn", "pcie")
# Grid ratios: the decode time is close to linear in the context (the KV reads) and in the
# batch once past the weight-bound regime, so a geometric grid with these steps keeps
# bilinear interpolation within 1% of the engine (tests/test_serving.py checks it on random
# compositions); the prefill time bends where a chunk turns from weight-bound to compute-bound.
_BATCH_RATIO = 1.5
_CONTEXT_RATIO = 2.0
_CHUNK_RATIO = 1.5
_CACHED_RATIO = 4.0
# Grids kept in one process (a sweep's points that share a replica configuration reuse one).
_GRID_CACHE: OrderedDict[str, tuple] = OrderedDict()
_GRID_CACHE_SIZE = 16


def geometric_points(lo: int, hi: int, ratio: float) -> list[int]:
    """Whole numbers from `lo` to `hi` (both in), each about `ratio` times the last."""
    pts = [lo]
    while pts[-1] < hi:
        pts.append(min(hi, max(pts[-1] + 1, int(math.ceil(pts[-1] * ratio)))))
    return pts


class StepModel:
    """One replica's engine: the simulated time of a decode step (`decode_s`) and of one
    prompt chunk's prefill (`prefill_s`), memoised."""

    def __init__(self, *, chip, topology, model, mesh, config: DecodeConfig, simulate,
                 energy=None):
        self.chip, self.topology, self.model, self.mesh = chip, topology, model, mesh
        self.config = config
        self._simulate = simulate  # trace -> StepResult (the request's perturbations bound)
        self._energy = energy  # (trace, StepResult) -> sim.energy.Energy, or None
        self._decode: dict[tuple[int, int], float] = {}
        self._prefill: dict[tuple[int, int], float] = {}
        # Per composition: the replica's dynamic joules by unit (`DYNAMIC_UNITS`) and its
        # chips' peak power (W), from the same engine run as the time.
        self._decode_e: dict[tuple[int, int], tuple[float, ...]] = {}
        self._prefill_e: dict[tuple[int, int], tuple[float, ...]] = {}
        self.engine_runs = 0
        # The batch the decode program pads to: a multiple of the data x expert shards (and of
        # data x fsdp under 2D weight-stationary sharding, which splits the batch over fsdp).
        dp, ep, fs = mesh.size("data"), mesh.size("expert"), mesh.size("fsdp")
        self.batch_quantum = math.lcm(dp * ep, dp * fs) if fs > 1 else dp * ep

    def padded(self, batch: int) -> int:
        q = self.batch_quantum
        return -(-batch // q) * q

    def decode_s(self, batch: int, context: int) -> float:
        key = (self.padded(batch), context)
        t = self._decode.get(key)
        if t is None:
            cfg = dataclasses.replace(self.config, batch=key[0], context_len=context,
                                      prompt_len=None, prefill_chunk=None)
            trace = compile_decode_step(self.model, self.mesh, self.topology.num_chips, cfg)
            result = self._simulate(trace)
            t = self._decode[key] = float(result.step_time_s)
            self._decode_e[key] = self._joules(trace, result)
            self.engine_runs += 1
        return t

    def _joules(self, trace, result) -> tuple[float, ...]:
        if self._energy is None:
            return (0.0,) * (len(DYNAMIC_UNITS) + 1)
        e = self._energy(trace, result)
        return (*(float(e.step_j_by_unit[u]) for u in DYNAMIC_UNITS),
                float(e.chip_power_w_peak))

    def decode_joules(self, batch: int, context: int) -> tuple[float, ...]:
        """(dynamic joules by `DYNAMIC_UNITS`..., peak chip W) of `decode_s(batch, context)`."""
        self.decode_s(batch, context)
        return self._decode_e[(self.padded(batch), context)]

    def prefill_joules(self, tokens: int, cached: int) -> tuple[float, ...]:
        """As `decode_joules`, for `prefill_s(tokens, cached)`."""
        self.prefill_s(tokens, cached)
        return self._prefill_e[(tokens, cached)]

    def prefill_s(self, tokens: int, cached: int) -> float:
        key = (tokens, cached)
        t = self._prefill.get(key)
        if t is None:
            cfg = dataclasses.replace(self.config, batch=1, context_len=cached + tokens,
                                      prompt_len=tokens, prefill_chunk=None)
            trace = compile_prefill(self.model, self.mesh, self.topology.num_chips, cfg,
                                    cached_len=cached)
            result = self._simulate(trace)
            t = self._prefill[key] = float(result.step_time_s)
            self._prefill_e[key] = self._joules(trace, result)
            self.engine_runs += 1
        return t

    def kv_capacity_tokens(self, max_batch: int) -> tuple[int, dict[str, float]]:
        """Cached tokens the replica holds: HBM left on each chip after the weights and the
        working set of a `max_batch` decode step (memory_plan, as `max_batch_that_fits`
        counts it), over the bytes a token takes; and the plan it came from (bytes per chip)."""
        cfg = dataclasses.replace(self.config, batch=self.padded(max_batch), context_len=1,
                                  prompt_len=None, prefill_chunk=None)
        plan = memory_plan(self.model, self.mesh, self.topology.num_chips, cfg)
        free = self.chip.hbm_bytes - plan["weights_bytes"] - plan["activation_bytes"]
        q = self.batch_quantum * 64
        big = dataclasses.replace(cfg, batch=q)
        one = memory_plan(self.model, self.mesh, self.topology.num_chips, big)
        two = memory_plan(self.model, self.mesh, self.topology.num_chips,
                          dataclasses.replace(big, context_len=2))
        per_chip_token = (two["kv_cache_bytes"] - one["kv_cache_bytes"])  # q seqs, 1 token
        # Tokens per chip's worth of free HBM, for q sequences spread over the replica.
        tokens = int(max(free, 0.0) / per_chip_token * q) if per_chip_token > 0 else 0
        return tokens, {"weights_bytes": plan["weights_bytes"],
                        "activation_bytes": plan["activation_bytes"],
                        "kv_free_bytes": max(free, 0.0),
                        "kv_bytes_per_token": per_chip_token / q * self.topology.num_chips}


class _Grid2:
    """Bilinear interpolation over a rectangular grid of engine times (pure Python: it runs
    once per iteration, where numpy's per-call overhead would dominate)."""

    __slots__ = ("xs", "ys", "v")

    def __init__(self, xs: list[int], ys: list[int], values: list[list[float]]):
        self.xs, self.ys, self.v = xs, ys, values

    def weights(self) -> list[list[float]]:
        """A zero weight per grid node, for `__call__`'s `w`."""
        return [[0.0] * len(self.ys) for _ in self.xs]

    def __call__(self, x: float, y: float, w: list[list[float]] | None = None) -> float:
        """The value at (x, y); with `w`, each of the four nodes' interpolation weight is
        added to it (the value is linear in the nodes', so any other quantity known at the
        nodes sums over a run as the weights times its node values)."""
        xs, ys, v = self.xs, self.ys, self.v
        i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2) if len(xs) > 1 else 0
        j = min(max(bisect_right(ys, y) - 1, 0), len(ys) - 2) if len(ys) > 1 else 0
        if len(xs) == 1:
            fx, i1 = 0.0, i
        else:
            fx, i1 = (x - xs[i]) / (xs[i + 1] - xs[i]), i + 1
        if len(ys) == 1:
            fy, j1 = 0.0, j
        else:
            fy, j1 = (y - ys[j]) / (ys[j + 1] - ys[j]), j + 1
        a = v[i][j] + (v[i][j1] - v[i][j]) * fy
        b = v[i1][j] + (v[i1][j1] - v[i1][j]) * fy
        if w is not None:
            gx, gy = 1.0 - fx, 1.0 - fy
            wi, wi1 = w[i], w[i1]
            wi[j] += gx * gy
            wi[j1] += gx * fy
            wi1[j] += fx * gy
            wi1[j1] += fx * fy
        return a + (b - a) * fx


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CostBounds:
    """The largest composition a run can ask for: batch, context and chunk tokens."""

    max_batch: int
    max_context: int
    max_chunk: int


class IterationCosts:
    """The time of a decode step at (batch, mean context) and of a prefill chunk at (tokens,
    cached tokens): interpolated on the engine's grid, or the engine itself (`exact`)."""

    def __init__(self, step: StepModel, bounds: CostBounds, *, exact: bool = False,
                 cache_key: str | None = None, progress=None):
        self.step, self.bounds, self.exact = step, bounds, exact
        self.grid_points = 0
        self._jgrids = None  # iteration_joules' grids of node joules, built when first asked
        # What the run asked for, to price its energy afterwards: per distinct composition a
        # count (exact), or per grid node its summed interpolation weight.
        self._dec_n: dict[tuple[int, int], int] = {}
        self._pre_n: dict[tuple[int, int], int] = {}
        if exact:
            return
        hit = _GRID_CACHE.get(cache_key) if cache_key is not None else None
        if hit is not None:
            _GRID_CACHE.move_to_end(cache_key)
            self._dec, self._pre, self.grid_points, self._dec_j, self._pre_j = hit
            self.cached = True
            self._dec_w, self._pre_w = self._dec.weights(), self._pre.weights()
            return
        self.cached = False
        q = step.batch_quantum
        bs = [k * q for k in geometric_points(1, -(-bounds.max_batch // q), _BATCH_RATIO)]
        cs = geometric_points(1, bounds.max_context, _CONTEXT_RATIO)
        ts = geometric_points(1, bounds.max_chunk, _CHUNK_RATIO)
        # Cached tokens from 0; a chunk never starts past max_context.
        ks = [0] + geometric_points(64, max(bounds.max_context, 64), _CACHED_RATIO)
        points = [(b, c) for b in bs for c in cs]
        prefill_points = [(t, k) for t in ts for k in ks]
        it = progress(points + prefill_points) if progress else points + prefill_points
        dec_vals: dict[tuple[int, int], float] = {}
        pre_vals: dict[tuple[int, int], float] = {}
        for n, p in enumerate(it):
            if n < len(points):
                dec_vals[p] = step.decode_s(*p)
            else:
                pre_vals[p] = step.prefill_s(*p)
        self._dec = _Grid2(bs, cs, [[dec_vals[(b, c)] for c in cs] for b in bs])
        self._pre = _Grid2(ts, ks, [[pre_vals[(t, k)] for k in ks] for t in ts])
        self._dec_j = [[step.decode_joules(b, c) for c in cs] for b in bs]
        self._pre_j = [[step.prefill_joules(t, k) for k in ks] for t in ts]
        self._dec_w, self._pre_w = self._dec.weights(), self._pre.weights()
        self.grid_points = len(points) + len(prefill_points)
        if cache_key is not None:
            _GRID_CACHE[cache_key] = (self._dec, self._pre, self.grid_points, self._dec_j,
                                      self._pre_j)
            while len(_GRID_CACHE) > _GRID_CACHE_SIZE:
                _GRID_CACHE.popitem(last=False)

    def decode_s(self, batch: int, context_sum: float) -> float:
        """A decode step of `batch` sequences holding `context_sum` cached tokens in all."""
        if self.exact:
            key = (batch, max(1, int(context_sum / batch + 0.5)))
            self._dec_n[key] = self._dec_n.get(key, 0) + 1
            return self.step.decode_s(*key)
        return self._dec(self.step.padded(batch), context_sum / batch, self._dec_w)

    def prefill_s(self, tokens: int, cached: int) -> float:
        """The prefill of `tokens` prompt tokens after `cached` already in the cache."""
        if self.exact:
            key = (tokens, cached)
            self._pre_n[key] = self._pre_n.get(key, 0) + 1
            return self.step.prefill_s(tokens, cached)
        return self._pre(tokens, cached, self._pre_w)

    def iteration_joules(self, batch: int, context_sum: float,
                         chunks: list[tuple[int, int]]) -> float:
        """The dynamic joules (all `DYNAMIC_UNITS`, the replica's chips) of one iteration: a
        decode step of `batch` sequences holding `context_sum` tokens (none if `batch` is 0)
        and the prefill `chunks` as (tokens, cached); interpolated as its time is (the
        same nodes and weights, on the nodes' joules), or the engine's (`exact`). Counts
        nothing toward `dynamic_joules`."""
        n = len(DYNAMIC_UNITS)
        if self.exact:
            j = sum(sum(self.step.prefill_joules(t, c)[:n]) for t, c in chunks)
            if batch:
                j += sum(self.step.decode_joules(batch, max(1, int(context_sum / batch
                                                                    + 0.5)))[:n])
            return j
        if self._jgrids is None:
            d, p = self._dec, self._pre
            self._jgrids = (
                _Grid2(d.xs, d.ys, [[sum(e[:n]) for e in row] for row in self._dec_j]),
                _Grid2(p.xs, p.ys, [[sum(e[:n]) for e in row] for row in self._pre_j]))
        dec, pre = self._jgrids
        j = sum(pre(t, c) for t, c in chunks)
        if batch:
            j += dec(self.step.padded(batch), context_sum / batch)
        return j

    def dynamic_joules(self) -> tuple[list[float], float]:
        """The dynamic joules by `DYNAMIC_UNITS` of every iteration priced so far (on every
        replica sharing this model), and the highest peak chip power among the compositions
        they touched: node values weighted as the times were interpolated, or each distinct
        composition's engine figures times its count (`exact`)."""
        total = [0.0] * len(DYNAMIC_UNITS)
        peak = 0.0
        if self.exact:
            pairs = [(n, self.step.decode_joules(*k)) for k, n in sorted(self._dec_n.items())]
            pairs += [(n, self.step.prefill_joules(*k)) for k, n in sorted(self._pre_n.items())]
        else:
            pairs = [(w, e) for ws, es in ((self._dec_w, self._dec_j), (self._pre_w, self._pre_j))
                     for wr, er in zip(ws, es, strict=True)
                     for w, e in zip(wr, er, strict=True) if w > 0]
        for w, e in pairs:
            for u in range(len(total)):
                total[u] += w * e[u]
            peak = max(peak, e[-1])
        return total, peak


def check_bounds(bounds: CostBounds) -> None:
    if bounds.max_batch < 1 or bounds.max_context < 1 or bounds.max_chunk < 1:
        raise TpusimError(f"internal: cost-model bounds {bounds} must be positive")


def describe_costs(costs: IterationCosts) -> dict[str, Any]:
    """What a result records of its cost model (the same whether the grid was built for this
    run or reused from an earlier one in the process, so that outputs stay byte-identical)."""
    return {"exact": costs.exact, "grid_points": costs.grid_points}
