"""Tests for the fluid link network (sim/engine/network.py): sharing, timing and clock progress."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.network import (
    Batch,
    FluidNetwork,
    SmallFluidNetwork,
    max_min_speeds,
    max_min_speeds_scalar,
)


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


# -- max-min sharing (progressive filling) --------------------------------------------------


@pytest.mark.parametrize("cls", [FluidNetwork, SmallFluidNetwork])
def test_compute_op_beside_a_link_bound_collective_runs_at_its_mxu_time(cls):
    """Resources: one link class (1 GB/s) and HBM (1 GB/s). A collective puts 3 GB on the link
    (3 s) and 0.9 GB on HBM: the link holds it to 0.3 GB/s of HBM. A compute op streams 0.5 GB
    through HBM and its FLOPs take 1 s (max_speed 1/s): it needs 0.5 GB/s. 0.3 + 0.5 fits, so
    the op takes its 1 s. (Shared in proportion to bytes in flight, HBM would give it only
    0.5/1.4 of 1 GB/s and the op would take 1.4 s.)"""
    env = simpy.Environment()
    net = cls(env, np.array([1e9, 1e9]))
    coll = Batch(res=np.array([0, 1]), ptr=np.array([0, 1, 2]),
                 bytes_per_transfer=np.array([3e9, 0.9e9]), latency_s=0.0)
    done = _run(env, net, {"coll": (0.0, coll),
                           "op": (0.0, _batch([1], [0.5e9], max_speed=1.0))})
    assert done["op"] == pytest.approx(1.0, rel=1e-12)
    assert done["coll"] == pytest.approx(3.0, rel=1e-12)
    # HBM carried 0.8 GB/s for 1 s, then 0.3 GB/s: busy (carrying bytes) for all 3 s.
    assert net.busy_s.tolist() == pytest.approx([3.0, 3.0])


@pytest.mark.parametrize("cls", [FluidNetwork, SmallFluidNetwork])
def test_batches_bottlenecked_on_one_link_still_share_it_by_bytes(cls):
    """1 GB and 3 GB on one 1 GB/s link (the second also crosses an idle, faster link): both
    drain at the same fraction per second, 1/4 per s, and finish together at 4 s."""
    env = simpy.Environment()
    net = cls(env, np.array([1e9, 5e9]))
    b = Batch(res=np.array([0, 1]), ptr=np.array([0, 2]), bytes_per_transfer=np.array([3e9]),
              latency_s=0.0)
    done = _run(env, net, {"a": (0.0, _batch([0], [1e9])), "b": (0.0, b)})
    assert done["a"] == pytest.approx(4.0, rel=1e-12)
    assert done["b"] == pytest.approx(4.0, rel=1e-12)


@pytest.mark.parametrize("cls", [FluidNetwork, SmallFluidNetwork])
def test_three_resources_share_by_progressive_filling_as_solved_by_hand(cls):
    """Capacities R0 10, R1 6, R2 4 (GB/s); each batch is 1 unit of work with bytes (GB):
    A: R0 4, R1 2;  B: R1 2, R2 2;  C: R0 2;  D: R2 1 with max_speed 0.5/s.
    Filling from 0: D reaches its cap at 0.5 (R2 would fill at 4/3, R1 at 6/4, R0 at 10/6)
    and freezes; R2 then has 3.5 left for B alone (1.75), so R1 fills first, at 1.5: A and B
    freeze; R0 has 10 - 4 x 1.5 = 4 left for C alone: C runs at 2. C ends at 0.5 s; A and B,
    with 0.25 left, still freeze at 1.5 on R1 and end at 0.5 + 0.25/1.5 = 2/3 s; D ends at 2 s.
    (Proportional sharing gives B 4/3 and C 10/6 at the start instead.)"""
    env = simpy.Environment()
    net = cls(env, np.array([10e9, 6e9, 4e9]))
    two = np.array([0, 1, 2])
    starts = {
        "A": Batch(res=np.array([0, 1]), ptr=two, bytes_per_transfer=np.array([4e9, 2e9]),
                   latency_s=0.0),
        "B": Batch(res=np.array([1, 2]), ptr=two, bytes_per_transfer=np.array([2e9, 2e9]),
                   latency_s=0.0),
        "C": _batch([0], [2e9]),
        "D": _batch([2], [1e9], max_speed=0.5),
    }
    done = _run(env, net, {k: (0.0, b) for k, b in starts.items()})
    assert done["C"] == pytest.approx(0.5, rel=1e-12)
    assert done["A"] == pytest.approx(2 / 3, rel=1e-12)
    assert done["B"] == pytest.approx(2 / 3, rel=1e-12)
    assert done["D"] == pytest.approx(2.0, rel=1e-12)
    assert net.bytes.tolist() == pytest.approx([6e9, 4e9, 3e9])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_max_min_speeds_leave_every_batch_a_bottleneck_it_cannot_beat(seed):
    """The defining property of (weighted) max-min fairness: every batch is either at its
    max_speed, or crosses a full resource on which no batch runs faster than it (raising it
    would take bandwidth from a batch no faster). Checked on random overlapping batches."""
    rng = np.random.default_rng(seed)
    cap = rng.uniform(1e9, 1e11, size=7)
    env = simpy.Environment()
    net = FluidNetwork(env, cap)
    for _t0, b in _random_batches(rng, len(cap), 25):
        if float(np.max(b.bytes_per_transfer)) > 0:
            net.transfer(Batch(res=b.res, ptr=b.ptr, bytes_per_transfer=b.bytes_per_transfer,
                               latency_s=0.0, max_speed=b.max_speed))
    env.run(until=1e-12)
    entries = list(net._active.values())
    speed = np.array([e[2] for e in entries])
    use = np.zeros((len(entries), len(cap)))
    for i, e in enumerate(entries):
        use[i] = np.bincount(e[0].res, weights=e[4], minlength=len(cap))
    rate = use.T @ speed  # bytes per second on each resource
    assert (rate <= cap * (1 + 1e-9)).all()
    full = rate >= cap * (1 - 1e-9)
    limited = 0
    for i, e in enumerate(entries):
        if speed[i] >= e[0].max_speed * (1 - 1e-12):
            continue
        on = (use[i] > 0) & full
        fastest = [speed[use[:, r] > 0].max() for r in np.flatnonzero(on)]
        assert any(f <= speed[i] * (1 + 1e-9) for f in fastest), i
        limited += 1
    assert limited >= 3  # the property was exercised, not vacuous


# -- the max-min function itself: batch axis, scalar specialisation, closed forms --------------


@st.composite
def _networks(draw):
    """Random flows over a few resources, in `lanes` networks of their own capacities and caps:
    (res, weight, owner, capacity [R, L], cap_max [F, L])."""
    nres = draw(st.integers(1, 6))
    nflows = draw(st.integers(1, 6))
    lanes = draw(st.integers(1, 4))
    res, weight, owner = [], [], []
    for f in range(nflows):
        for _ in range(draw(st.integers(1, 3))):
            res.append(draw(st.integers(0, nres - 1)))
            weight.append(draw(st.sampled_from([0.0, 1.0, 3.0, 0.7, 2.5e9, 1e-3])))
            owner.append(f)
    caps = st.floats(1e-3, 1e12, allow_nan=False)
    capacity = np.array([[draw(caps) for _ in range(lanes)] for _ in range(nres)])
    limit = st.one_of(st.just(np.inf), st.floats(1e-3, 1e3, allow_nan=False))
    cap_max = np.array([[draw(limit) for _ in range(lanes)] for _ in range(nflows)])
    return (np.array(res, dtype=np.int64), np.array(weight), np.array(owner, dtype=np.int64),
            capacity, cap_max)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_networks())
def test_max_min_over_a_batch_axis_equals_each_network_alone_and_the_scalar_path(net):
    """Every network of the batch gets the speeds it gets alone (L = 1) and the same as the
    Python-float specialisation's, to the last bit (==, not approx)."""
    res, weight, owner, capacity, cap_max = net
    speed, _ = max_min_speeds(res, weight, owner, capacity, cap_max)
    assert speed.shape == cap_max.shape
    for lane in range(capacity.shape[1]):
        alone, in_use = max_min_speeds(res, weight, owner, capacity[:, [lane]],
                                       cap_max[:, [lane]])
        assert speed[:, lane].tolist() == alone[:, 0].tolist()
        entries = [[float(cap_max[f, lane]), 1.0, 0.0, None,
                    res[owner == f].tolist(), weight[owner == f].tolist()]
                   for f in range(cap_max.shape[0])]
        used = max_min_speeds_scalar(entries, capacity[:, lane].tolist())
        assert [e[2] for e in entries] == alone[:, 0].tolist()
        assert sorted(used) == np.flatnonzero(in_use[:, 0]).tolist()


def test_max_min_speeds_match_progressive_filling_solved_by_hand():
    """The three-resource case above, as speeds (GB and GB/s): A 1.5, B 1.5, C 2, D 0.5 (its
    cap). A second network with every capacity and cap doubled runs every flow at exactly twice
    the speed (filling scales with them), and flows on one resource alone share it by bytes."""
    res = np.array([0, 1, 1, 2, 0, 2])
    weight = np.array([4.0, 2.0, 2.0, 2.0, 2.0, 1.0])
    owner = np.array([0, 0, 1, 1, 2, 3])
    capacity = np.array([[10.0, 20.0], [6.0, 12.0], [4.0, 8.0]])
    cap_max = np.array([[np.inf, np.inf], [np.inf, np.inf], [np.inf, np.inf], [0.5, 1.0]])
    speed, in_use = max_min_speeds(res, weight, owner, capacity, cap_max)
    assert speed[:, 0].tolist() == pytest.approx([1.5, 1.5, 2.0, 0.5], rel=1e-15)
    assert (speed[:, 1] == 2 * speed[:, 0]).all()
    assert in_use[:, 0].tolist() == [True, True, True]
    # One 9 GB/s resource, flows of 1, 2 and 6 GB: all drain at 9 / (1 + 2 + 6) = 1 per s.
    one, _ = max_min_speeds(np.zeros(3, dtype=np.int64), np.array([1.0, 2.0, 6.0]),
                            np.arange(3), np.array([[9.0]]), np.full((3, 1), np.inf))
    assert one[:, 0].tolist() == [1.0, 1.0, 1.0]
