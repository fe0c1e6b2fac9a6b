"""Tests for the fluid link network (sim/network.py): sharing, timing and clock progress."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import simpy

from sim.network import Batch, FluidNetwork, SmallFluidNetwork


def _batch(res, nbytes, latency=0.0, **kw):
    res = np.asarray(res, dtype=np.int64)
    return Batch(res=res, ptr=np.arange(len(res) + 1, dtype=np.int64),
                 bytes_per_transfer=np.asarray(nbytes, dtype=float), latency_s=latency, **kw)


def _run(env, net, starts):
    done = {}

    def proc(name, t0, batch):
        yield env.timeout(t0)
        yield net.transfer(batch)
        done[name] = env.now

    for name, (t0, batch) in starts.items():
        env.process(proc(name, t0, batch))
    env.run()
    return done


def test_one_transfer_takes_latency_plus_bytes_over_bandwidth():
    env = simpy.Environment()
    net = FluidNetwork(env, np.array([1e9]))
    done = _run(env, net, {"a": (0.0, _batch([0], [2e9], latency=0.5))})
    assert done["a"] == pytest.approx(2.5)


def test_two_equal_transfers_on_one_link_share_it_and_finish_together():
    env = simpy.Environment()
    net = FluidNetwork(env, np.array([1e9]))
    done = _run(env, net, {"a": (0.0, _batch([0], [1e9])), "b": (0.0, _batch([0], [1e9]))})
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)


def test_a_late_transfer_slows_an_earlier_one_and_total_bytes_are_conserved():
    env = simpy.Environment()
    net = FluidNetwork(env, np.array([1e9]))
    done = _run(env, net, {"a": (0.0, _batch([0], [2e9])), "b": (1.0, _batch([0], [1e9]))})
    # The link is never idle while work remains: 3e9 bytes at 1e9 B/s end at t = 3.
    assert max(done.values()) == pytest.approx(3.0)
    assert net.bytes[0] == pytest.approx(3e9)
    assert net.busy_s[0] == pytest.approx(3.0)


def test_max_speed_caps_a_compute_bound_batch():
    env = simpy.Environment()
    net = FluidNetwork(env, np.array([1e12]))
    done = _run(env, net, {"a": (0.0, _batch([0], [1e9], max_speed=0.5))})
    assert done["a"] == pytest.approx(2.0)  # 1 ms of bytes, but 2 s of FLOPs


def test_tiny_transfer_late_in_time_completes_instead_of_stalling_the_clock():
    """A transfer whose remaining time is below the clock's float resolution used to re-arm a
    zero-length timer forever; time must always advance."""
    env = simpy.Environment()
    net = FluidNetwork(env, np.array([1e12, 1e12]))

    def alarm(_sig, _frame):
        raise TimeoutError("the simulation clock stopped advancing")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    try:
        done = _run(env, net, {
            "big": (1000.0, _batch([0], [3e12])),
            "tiny": (1000.0, _batch([1], [3.3e-4])),
            "tiny2": (1000.5, _batch([0, 1], [1e-3, 7e-5])),
        })
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert done["big"] == pytest.approx(1003.0, rel=1e-9)
    assert 1000.0 <= done["tiny"] <= 1000.0 + 1e-9
    assert done["tiny2"] >= 1000.5


def _random_batches(rng, nres, count):
    """Overlapping batches of one or several hops (repeats, latencies, compute caps, zero-byte
    ones): (start time, batch)."""
    out = []
    for i in range(count):
        ntr = int(rng.integers(1, 4))
        hops = rng.integers(1, 3, size=ntr)
        res = rng.integers(0, nres, size=int(hops.sum()))
        nbytes = rng.uniform(1e6, 1e9, size=ntr) * (0.0 if i % 11 == 5 else 1.0)
        out.append((float(rng.uniform(0, 2.0)), Batch(
            res=res.astype(np.int64), ptr=np.concatenate([[0], np.cumsum(hops)]).astype(np.int64),
            bytes_per_transfer=nbytes, latency_s=float(rng.choice([0.0, 1e-6, 3e-3])),
            repeat=int(rng.integers(1, 3)),
            max_speed=float(rng.choice([np.inf, 50.0, 2.0])))))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_network_equals_the_array_network_to_the_last_bit(seed):
    """The step engines' Python-float network does the parent's arithmetic in the same order:
    every completion time, byte count, busy time and event count is identical (==, not approx)."""
    rng = np.random.default_rng(seed)
    cap = rng.uniform(1e9, 1e11, size=9)
    starts = {f"b{i}": sb for i, sb in enumerate(_random_batches(rng, len(cap), 60))}
    out = []
    for cls in (FluidNetwork, SmallFluidNetwork):
        env = simpy.Environment()
        net = cls(env, cap)
        done = _run(env, net, starts)
        out.append((done, net.bytes.tolist(), net.busy_s.tolist(), net.num_events))
    assert len(out[0][0]) == len(starts)
    assert out[0] == out[1]
