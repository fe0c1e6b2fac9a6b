"""ICI/DCN links (and HBM) as a fluid network inside SimPy.

Resources are either individual directed links (full detail) or link *classes* (axis, direction)
when every chip does the same thing on a uniform torus (symmetric mode). Under translation
symmetry each link of a class carries exactly the traffic that one representative chip puts on
that class, so simulating the representative's transfers against class resources is exact
(see docs/model.md). Both modes share one fluid engine:

* A *batch* is one step of a collective: a set of transfers (bytes, path) that start together.
  It first waits its latency (hops x per-hop latency, the pipeline fill of a cut-through
  transfer), then its bytes drain. All of a batch's transfers drain at one speed (a fraction
  of their bytes per second), set by weighted max-min fairness (progressive filling): batches
  whose bottleneck is the same link split it in proportion to their bytes (so they drain
  together), and a batch held back elsewhere (by a busier link, or by its own cap, `max_speed`:
  a collective paced by a slow link on its route) leaves the bandwidth it cannot use to the
  others. A batch holds its links until it completes.
* Rates are recomputed only when a batch starts draining or completes, so the cost is per step,
  not per byte or per packet.

Max-min sharing is one function, `max_min_speeds`, over a batch axis of networks that share
their flows (`FluidNetwork` is one network; the vector executor's chips are the batch); beside
it, `max_min_speeds_scalar` is the same arithmetic on Python floats for one small network
(`SmallFluidNetwork`, the SimPy step executors), tested bit-equal to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import simpy


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """One collective step, routed onto resources (links or link classes).

    Attributes:
        res: resource index of every hop of every transfer, transfer by transfer.
        ptr: CSR offsets into `res` (len = num transfers + 1); every transfer has >= 1 hop.
        bytes_per_transfer: payload of each transfer, per repetition.
        latency_s: latency before the bytes drain (all repetitions).
        repeat: identical back-to-back repetitions folded into this batch.
    """

    res: np.ndarray
    ptr: np.ndarray
    bytes_per_transfer: np.ndarray
    latency_s: float
    repeat: int = 1
    max_speed: float = float("inf")  # cap on the fraction completed per second (compute-bound)
    src: np.ndarray | None = None  # full detail: source chip of each transfer
    dst: np.ndarray | None = None  # full detail: destination chip of each transfer

    @property
    def num_transfers(self) -> int:
        return len(self.ptr) - 1

    @property
    def hop_weights(self) -> np.ndarray:
        """Bytes (all repetitions) of the transfer that owns each entry of `res`."""
        if len(self.res) == len(self.ptr) - 1:  # one hop per transfer (link classes, HBM)
            return self.bytes_per_transfer * self.repeat
        return np.repeat(self.bytes_per_transfer * self.repeat, np.diff(self.ptr))

    def resource_bytes(self, num_resources: int) -> np.ndarray:
        """Bytes carried per resource by this batch (all repetitions)."""
        if len(self.res) == len(self.ptr) - 1:
            w = self.bytes_per_transfer * self.repeat
        else:
            w = np.repeat(self.bytes_per_transfer, np.diff(self.ptr)) * self.repeat
        return np.bincount(self.res, weights=w, minlength=num_resources)


class FluidNetwork:
    """Bandwidth shared by concurrent batches, advanced by SimPy events.

    Args:
        env: the SimPy environment.
        capacity_bytes_per_s: bandwidth of each resource.
        coalesce: batches admitted at the same instant share one rate computation (scheduled
            as a zero-delay event) instead of one each: the same result, far fewer events when
            hundreds of replica groups start their steps together.
    """

    def __init__(
        self, env: simpy.Environment, capacity_bytes_per_s: np.ndarray, *, coalesce: bool = False
    ) -> None:
        self.env = env
        self.capacity = np.asarray(capacity_bytes_per_s, dtype=float)
        self.num_resources = len(self.capacity)
        self.bytes = np.zeros(self.num_resources)
        self.busy_s = np.zeros(self.num_resources)
        self._active: dict[int, list] = {}  # id -> [batch, remaining fraction, speed, event]
        self._next_id = 0
        self._last_t = 0.0
        self._version = 0
        self._in_use = np.zeros(self.num_resources, dtype=bool)
        self.num_events = 0
        self._coalesce = coalesce
        self._flush_pending = False

    def transfer(self, batch: Batch) -> simpy.Event:
        """Start a batch now; the returned event fires when its last byte has arrived."""
        if not (math.isfinite(batch.latency_s) and batch.latency_s >= 0):
            # Invariant (inputs are validated): a NaN latency would stall the clock forever.
            raise RuntimeError(f"invariant violated: a batch latency of {batch.latency_s} s")
        done = self.env.event()
        self.bytes += batch.resource_bytes(self.num_resources)
        if batch.num_transfers == 0 or float(np.max(batch.bytes_per_transfer, initial=0)) <= 0:
            t = self.env.timeout(batch.latency_s)
            t.callbacks.append(lambda _ev: done.succeed())
            return done
        if batch.latency_s > 0:
            t = self.env.timeout(batch.latency_s)
            t.callbacks.append(lambda _ev: self._admit(batch, done))
        else:
            self._admit(batch, done)
        return done

    # -- fluid bookkeeping ------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_t
        if dt > 0 and self._active:
            for entry in self._active.values():
                entry[1] -= entry[2] * dt
            self.busy_s[self._in_use] += dt
        self._last_t = now

    def _admit(self, batch: Batch, done: simpy.Event) -> None:
        self._advance()
        bid = self._next_id
        self._next_id += 1
        # [batch, remaining fraction, speed, done event, bytes per hop (computed once)]
        self._active[bid] = [batch, 1.0, 0.0, done, batch.hop_weights]
        if not self._coalesce:
            self._reschedule()
        elif not self._flush_pending:
            # No time passes before the flush, so no batch's progress is lost by waiting.
            self._flush_pending = True
            self.env.timeout(0).callbacks.append(self._flush)

    def _flush(self, _ev) -> None:
        self._flush_pending = False
        self._advance()
        self._reschedule()

    def _reschedule(self) -> None:
        self.num_events += 1
        # Complete batches whose remaining work has drained (tolerate float dust).
        finished = [bid for bid, e in self._active.items() if e[1] <= 1e-12]
        for bid in finished:
            self._active.pop(bid)[3].succeed()
        self._in_use[:] = False
        if not self._active:
            return
        entries = list(self._active.values())
        speeds, self._in_use = self._max_min_speeds(entries)
        next_dt = np.inf
        for e, speed in zip(entries, speeds, strict=True):
            e[2] = speed
            next_dt = min(next_dt, e[1] / speed)
        self._version += 1
        version = self._version
        now = self.env.now
        if math.isnan(next_dt):  # rates or bytes were not finite
            raise RuntimeError("invariant violated: a fluid step of NaN seconds")
        if now + next_dt <= now:
            # The remaining work is below the float resolution of the clock: step by a few ulps
            # so that time always advances (the snap in _on_timer then completes the batch).
            next_dt = 4 * math.ulp(now)
        timer = self.env.timeout(max(next_dt, 0.0))
        timer.callbacks.append(lambda _ev: self._on_timer(version))

    def _max_min_speeds(self, entries: list) -> tuple[list[float], np.ndarray]:
        """Every active batch's speed (fraction of its bytes per second) by weighted max-min
        fairness (`max_min_speeds`, one network), and which resources carry bytes."""
        counts = [len(e[0].res) for e in entries]
        speed, in_use = max_min_speeds(
            np.concatenate([e[0].res for e in entries]), np.concatenate([e[4] for e in entries]),
            np.repeat(np.arange(len(entries)), counts), self.capacity[:, None],
            np.array([e[0].max_speed for e in entries], dtype=float)[:, None])
        return speed[:, 0].tolist(), in_use[:, 0]

    def _on_timer(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later reschedule
        self._advance()
        # The batch that set the timer is done; snap to zero whatever is left only by rounding
        # (a tiny fraction, or work that would finish within a few ulps of the clock).
        tol_s = 1e-12 * max(self.env.now, 1e-9)
        for e in self._active.values():
            if e[1] <= 1e-9 or (e[2] > 0 and e[1] / e[2] <= tol_s):
                e[1] = 0.0
        self._reschedule()


class SmallFluidNetwork(FluidNetwork):
    """`FluidNetwork` for a handful of resources (one chip's link classes and HBM, the step
    engines), kept in Python floats instead of NumPy arrays.

    A step replays thousands of small batches (one per collective op), and on arrays
    of ~10 elements NumPy's per-call overhead is most of the cost. The arithmetic is the parent's
    operation for operation (the same sums in `np.bincount`'s order, the same divisions and
    minima), so every time and byte count is the same to the last bit (tested).
    `bytes` and `busy_s` are read as arrays (fresh copies) once the run is over.
    """

    def __init__(self, env: simpy.Environment, capacity_bytes_per_s: np.ndarray) -> None:
        # The parent's state, except its arrays (`bytes`, `busy_s`, `_in_use`).
        self.env = env
        self.capacity = np.asarray(capacity_bytes_per_s, dtype=float)
        self.num_resources = len(self.capacity)
        self._cap = self.capacity.tolist()
        self._bytes = [0.0] * self.num_resources
        self._busy = [0.0] * self.num_resources
        self._used: list[int] = []  # resources carrying a batch now (ascending)
        self._hop_cache: dict[int, tuple] = {}
        self._active: dict[int, list] = {}
        self._next_id = 0
        self._last_t = 0.0
        self._version = 0
        self.num_events = 0
        self._coalesce = False
        self._flush_pending = False

    @property
    def bytes(self) -> np.ndarray:  # type: ignore[override]
        return np.array(self._bytes)

    @property
    def busy_s(self) -> np.ndarray:  # type: ignore[override]
        return np.array(self._busy)

    def _hops(self, batch: Batch) -> tuple[list[int], list[float]]:
        """(resource of every hop, bytes of every hop, all repetitions) as Python lists; kept
        per batch object (a collective's batch is shared by all its ops)."""
        hit = self._hop_cache.get(id(batch))
        if hit is not None and hit[0] is batch:
            return hit[1], hit[2]
        res = batch.res.tolist()
        if len(res) == len(batch.ptr) - 1:
            w = (batch.bytes_per_transfer * batch.repeat).tolist()
        else:
            w = batch.hop_weights.tolist()
        self._hop_cache[id(batch)] = (batch, res, w)  # holds the batch: its id stays its own
        return res, w

    def transfer(self, batch: Batch) -> simpy.Event:
        if not (math.isfinite(batch.latency_s) and batch.latency_s >= 0):
            raise RuntimeError(f"invariant violated: a batch latency of {batch.latency_s} s")
        res, w = self._hops(batch)
        # np.bincount's order: the batch's own sum per resource first, then added to the total.
        own: dict[int, float] = {}
        for r, x in zip(res, w, strict=True):
            own[r] = own.get(r, 0.0) + x
        for r, x in own.items():
            self._bytes[r] += x
        if batch.num_transfers == 0 or max(batch.bytes_per_transfer.tolist(), default=0) <= 0:
            done = self.env.event()
            t = self.env.timeout(batch.latency_s)
            t.callbacks.append(lambda _ev: done.succeed())
            return done
        return self._start(res, w, batch.latency_s, batch.max_speed)

    def count_bytes(self, resource: int, nbytes: float) -> None:
        """Count `nbytes` through `resource` without loading it: traffic that does not share
        the fluid resource (a compute op's HBM stream, paced by the op itself)."""
        self._bytes[resource] += nbytes

    def _start(self, res: list[int], w: list[float], latency_s: float,
               max_speed: float) -> simpy.Event:
        done = self.env.event()
        if latency_s > 0:
            t = self.env.timeout(latency_s)
            t.callbacks.append(lambda _ev: self._admit_hops(res, w, max_speed, done))
        else:
            self._admit_hops(res, w, max_speed, done)
        return done

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_t
        if dt > 0 and self._active:
            for entry in self._active.values():
                entry[1] -= entry[2] * dt
            busy = self._busy
            for r in self._used:
                busy[r] += dt
        self._last_t = now

    def _admit(self, batch: Batch, done: simpy.Event) -> None:
        res, w = self._hops(batch)
        self._admit_hops(res, w, batch.max_speed, done)

    def _admit_hops(self, res: list[int], w: list[float], max_speed: float,
                    done: simpy.Event) -> None:
        self._advance()
        bid = self._next_id
        self._next_id += 1
        # [cap on its speed, remaining fraction, speed, done event, hop resources, hop bytes]
        self._active[bid] = [max_speed, 1.0, 0.0, done, res, w]
        self._reschedule()

    def _reschedule(self) -> None:
        self.num_events += 1
        active = self._active
        finished = [bid for bid, e in active.items() if e[1] <= 1e-12]
        for bid in finished:
            active.pop(bid)[3].succeed()
        if not active:
            self._used = []
            return
        entries = list(active.values())
        self._max_min_speeds(entries)
        next_dt = math.inf
        for e in entries:
            next_dt = min(next_dt, e[1] / e[2])
        self._version += 1
        version = self._version
        now = self.env.now
        if math.isnan(next_dt):
            raise RuntimeError("invariant violated: a fluid step of NaN seconds")
        if now + next_dt <= now:
            next_dt = 4 * math.ulp(now)
        timer = self.env.timeout(max(next_dt, 0.0))
        timer.callbacks.append(lambda _ev: self._on_timer(version))

    def _max_min_speeds(self, entries: list) -> None:  # type: ignore[override]
        """`max_min_speeds_scalar` on this network's active batches: sets each entry's speed
        and `_used`."""
        self._used = max_min_speeds_scalar(entries, self._cap)


# -- max-min sharing (progressive filling) ---------------------------------------------------
def max_min_speeds(res: np.ndarray, weight: np.ndarray, owner: np.ndarray, capacity: np.ndarray,
                   cap_max: np.ndarray, *, load: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Weighted max-min fair speeds of F flows over R resources, in L networks at once (the
    batch axis): the same flows and hops in every network, each with its own capacities and
    speed caps (the vector executor's chips, whose HBM and compute caps scale with their speed;
    `FluidNetwork` is L = 1).

    A flow is a batch of transfers draining at one speed (a fraction of its bytes per second);
    a hop puts `weight` bytes of flow `owner` on resource `res`. Progressive filling: all
    unfrozen flows raise one common speed until a resource is full (its capacity left over by
    frozen flows, over the unfrozen flows' bytes on it) or a flow reaches its cap; those flows
    freeze at that speed, and the rest go on with what is left. Flows that share a bottleneck
    drain together (a resource's bandwidth is split in proportion to their bytes), but a flow
    held back elsewhere (by a busier resource, or by its own cap: a collective paced by a slow
    link, a compute op's HBM stream) leaves the bandwidth it cannot use to the others. When
    every flow's bottleneck is one resource, the first round freezes all at capacity / load, as
    proportional sharing does.

    Sums run hop by hop in the order given (np.bincount's: 0.0 plus every hop's bytes), so a
    network's speeds are the same to the last bit whichever batch it sits in, and the same as
    `max_min_speeds_scalar`'s on Python floats (tested).

    Args:
        res, weight, owner: per hop (H): resource index (< R), bytes (>= 0), flow index (< F).
        capacity: [R, L] bytes per second of each resource in each network.
        cap_max: [F, L] each flow's cap on its speed (inf: none).
        load: [R, L] or [R, 1], optional: the resources' loads with every flow unfrozen, if the
            caller has them (the same sums).

    Returns:
        ([F, L] speeds, [R, 1] (or the shape of `load`) whether each resource carries bytes).
    """
    nres, nlanes = capacity.shape
    nflows = cap_max.shape[0]
    if load is None:
        load = np.bincount(res, weights=weight, minlength=nres)[:, None]
    positive = weight > 0
    if not positive.all():  # a hop of no bytes neither loads a resource nor freezes its flow
        res, weight, owner = res[positive], weight[positive], owner[positive]
    if nlanes == 1:
        res_idx, own_idx = res, owner
    else:  # bin (resource, network) and (flow, network), hops major: sums in hop order
        lane = np.arange(nlanes)
        res_idx = (res[:, None] * nlanes + lane).ravel()
        own_idx = (owner[:, None] * nlanes + lane).ravel()
    w_col = weight[:, None]
    nbins = nres * nlanes
    in_use = load > 0
    cap_left = capacity
    if nflows == 1:
        # One flow loads every resource in use, so it freezes in the first round, at the least
        # of its fill levels and its cap (the loop below, once).
        fill = np.divide(cap_left, load, out=np.full(capacity.shape, np.inf), where=in_use)
        return np.maximum(np.minimum(fill.min(axis=0), cap_max[0]), 0.0)[None], in_use
    speed = np.zeros((nflows, nlanes))
    unfrozen = np.ones((nflows, nlanes), dtype=bool)
    level = np.zeros(nlanes)
    while True:
        loaded = load > 0
        fill = np.divide(cap_left, load, out=np.full(capacity.shape, np.inf), where=loaded)
        lam = np.maximum(np.minimum(fill.min(axis=0),
                                    np.where(unfrozen, cap_max, np.inf).min(axis=0)), level)
        full = loaded & (fill <= lam)
        # Flows with bytes on a full resource (frozen ones too: `now` keeps only the unfrozen).
        crossed = np.bincount(own_idx[full[res].ravel()], minlength=nflows * nlanes) > 0
        now = unfrozen & ((cap_max <= lam) | crossed.reshape(nflows, nlanes))
        speed = np.where(now, lam, speed)
        unfrozen &= ~now
        if not unfrozen.any():
            return speed, in_use
        # A network whose flows all froze at an infinite speed is done: nothing to take.
        finite = np.isfinite(lam)
        # Bytes per resource of the flows frozen now, and of those still unfrozen (a masked
        # hop adds 0.0, which changes no sum).
        took = np.bincount(res_idx, weights=(now[owner] * w_col).ravel(), minlength=nbins)
        cap_left = cap_left - took.reshape(nres, nlanes) * np.where(finite, lam, 0.0)
        level = np.where(finite, lam, level)
        load = np.bincount(res_idx, weights=(unfrozen[owner] * w_col).ravel(),
                           minlength=nbins).reshape(nres, nlanes)


def max_min_speeds_scalar(entries: list, cap: list[float]) -> list[int]:
    """`max_min_speeds` for one network, on Python floats: the documented specialisation the
    SimPy step executors use (`SmallFluidNetwork`: one chip's ~9 resources and a few batches,
    where NumPy's per-call overhead is most of the cost: 17 us a call against 65 us for
    `max_min_speeds` on 9 resources and 3 batches, entries built included). The same sums
    (per resource, 0.0 plus every hop's bytes in entry order), divisions and minima, so the
    same speeds to the last bit (tested on random networks).

    `entries` are lists [speed cap, _, speed, _, hop resources, hop bytes]; each entry's speed
    (index 2) is set. Returns the resources that carry bytes."""
    cap_left: dict[int, float] = {}  # capacity left by frozen batches (absent: all of it)
    level = 0.0
    unfrozen = entries
    used: list[int] = []
    first = True
    while True:
        load: dict[int, float] = {}
        for e in unfrozen:
            for r, x in zip(e[4], e[5], strict=True):
                load[r] = load.get(r, 0.0) + x
        if first:
            used = [r for r, x in load.items() if x > 0]
            first = False
        fill = {r: cap_left.get(r, cap[r]) / x for r, x in load.items() if x > 0}
        lam = max(min(min(fill.values(), default=math.inf), min(e[0] for e in unfrozen)),
                  level)
        if lam == math.inf:
            for e in unfrozen:
                e[2] = lam
            return used
        full = {r for r, f in fill.items() if f <= lam}
        now, rest = [], []
        for e in unfrozen:
            if e[0] <= lam or any(r in full and x > 0 for r, x in zip(e[4], e[5], strict=True)):
                e[2] = lam
                now.append(e)
            else:
                rest.append(e)
        if not rest:
            return used
        took: dict[int, float] = {}
        for e in now:
            for r, x in zip(e[4], e[5], strict=True):
                took[r] = took.get(r, 0.0) + x
        for r, x in took.items():
            cap_left[r] = cap_left.get(r, cap[r]) - x * lam
        level = lam
        unfrozen = rest
