"""The time to send a request's KV cache from a prefill replica to a decode replica
(disaggregated serving), from the network model: over DCN between slices, or ICI within one.

`dcn` (the default): the replicas are separate slices joined by DCN. The cache is spread over
the sending replica's chips as its decode program holds it, and every chip sends its share to
its counterpart in the other replica at once: a collective-permute across the slices of a
topology that is the smaller replica's slice twice over DCN
(`sim.collectives.simulate_collective`, the same fluid link model every DCN collective runs
on: each chip's DCN link at the chip's achieved rate, the DCN latency and the per-message
overhead). The larger replica's extra chips receive nothing, so the smaller sets the
parallelism; the chip with the slower DCN sets the rate.

A transfer's time on that model is affine in its bytes (fixed latency and overhead, then the
bytes over the rate), so the model is simulated once per configuration at two sizes and every
request's transfer is `fixed_s + s_per_byte x bytes per chip`; a test holds it equal to the
simulated permute of that request's bytes.

`ici`: each prefill replica and its decode replica are the two halves of one slice (as a
serving stack that splits one slice's chips into a prefill and a decode program does), so
they must be the same slice of the same chip. The pair is that slice doubled along its first
axis that the pod can hold twice over (wraparound by the slice rules for the doubled shape),
and every chip sends its share to the chip one replica further along that axis: the same
collective-permute on the ICI links, `n` hops each (`hops`, which the energy of the transfer
counts per link crossed, as a step's ICI energy does).
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

from sim.collectives.simulate import simulate_collective
from sim.hardware import ChipSpec
from topologies.errors import TpusimError
from topologies.slices import resolve_topology
from topologies.torus import Topology


class KvTransferPath(StrEnum):
    """Where a disaggregated request's KV cache travels from prefill to decode."""

    DCN = "dcn"  # separate slices joined by DCN
    ICI = "ici"  # the two halves of one slice


_PROBE_BYTES = 1 << 20  # per chip; the second probe is twice it


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KvTransfer:
    """`seconds(tokens)`: one request's cache of `tokens` cached tokens sent across."""

    fixed_s: float
    s_per_byte: float  # per byte one chip sends
    chips: int  # chips sending in parallel
    kv_bytes: Any  # tokens -> the cache's bytes (TransformerSpec.kv_cache_bytes, bound)
    path: KvTransferPath = KvTransferPath.DCN
    hops: int = 1  # links each byte crosses (ICI: the replica's extent along the pair's axis)
    pair_shape: tuple[int, ...] = ()  # ici: the slice both replicas are halves of

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.s_per_byte * self.kv_bytes(tokens) / self.chips

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": str(self.path), "chips": self.chips, "fixed_s": self.fixed_s,
                               "s_per_byte_per_chip": self.s_per_byte}
        if self.path is KvTransferPath.ICI:
            out["hops"] = self.hops
            out["pair_shape"] = "x".join(map(str, self.pair_shape))
        return out


def permute_time_s(chip, topology, nbytes_per_chip: int) -> float:
    """The network model's time for every chip of `topology` (one replica's slice, or its
    slices) to send `nbytes_per_chip` to its counterpart in a second copy of it over DCN."""
    both = dataclasses.replace(topology, num_slices=2 * topology.num_slices)
    return float(simulate_collective(chip=chip, topology=both, op="collective-permute",
                                     axes="dcn", nbytes=int(nbytes_per_chip),
                                     shift=topology.num_slices).time_s)


def ici_pair(chip: ChipSpec, topology: Topology) -> tuple[Topology, int]:
    """The slice two copies of `topology` make side by side, and the axis they are joined on:
    the first axis that the chip's pod can hold doubled."""
    if topology.num_slices != 1:
        raise TpusimError(
            f"{{kv_transfer}} 'ici' sends the cache within one slice, but each replica is "
            f"{topology.num_slices} slices over DCN; use {{kv_transfer}} 'dcn' or one-slice "
            f"replicas", "kv_transfer")
    for axis in range(topology.ndim):
        shape = tuple(2 * m if i == axis else m for i, m in enumerate(topology.shape))
        try:
            pair = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                                    max_pod_shape=chip.max_pod_shape, shape=shape)
        except TpusimError:
            continue
        return pair, axis
    raise TpusimError(
        f"{{kv_transfer}} 'ici' puts a prefill and a decode replica in one slice, but two "
        f"{topology.name} slices side by side do not fit a {chip.name} pod on any axis; "
        f"use {{kv_transfer}} 'dcn' or smaller replicas", "kv_transfer")


def ici_permute_time_s(chip: ChipSpec, pair: Topology, axis: int,
                       nbytes_per_chip: int) -> float:
    """The network model's time for every chip of one half of `pair` to send
    `nbytes_per_chip` to its counterpart in the other half (a shift by the half's extent along
    `axis`; every chip of the pair sends, so both halves' links are loaded as a permute does)."""
    return float(simulate_collective(chip=chip, topology=pair, op="collective-permute",
                                     axes=(pair.axis_names[axis],), nbytes=int(nbytes_per_chip),
                                     shift=pair.shape[axis] // 2).time_s)


def kv_transfer(prefill_pod, decode_pod, model, kv_bytes_per_elem: float,
                path: KvTransferPath = KvTransferPath.DCN) -> KvTransfer:
    """The transfer model between two replicas' pods (`resolve_pod` results), over `path`."""
    kv_bytes = lambda tokens: model.kv_cache_bytes(tokens, kv_bytes_per_elem)  # noqa: E731
    if path is KvTransferPath.ICI:
        pt, dt = prefill_pod.topology, decode_pod.topology
        if prefill_pod.chip != decode_pod.chip or pt.shape != dt.shape \
                or pt.num_slices != dt.num_slices:
            raise TpusimError(
                f"{{kv_transfer}} 'ici' makes each prefill replica and its decode replica the two "
                f"halves of one slice, so they must be the same slice of the same chip; got "
                f"{prefill_pod.chip.name} {pt.name} for prefill and {decode_pod.chip.name} "
                f"{dt.name} for decode; give both pools one slice or use {{kv_transfer}} 'dcn'",
                "kv_transfer")
        chip = prefill_pod.chip
        pair, axis = ici_pair(chip, pt)
        t1 = ici_permute_time_s(chip, pair, axis, _PROBE_BYTES)
        t2 = ici_permute_time_s(chip, pair, axis, 2 * _PROBE_BYTES)
        slope = (t2 - t1) / _PROBE_BYTES
        return KvTransfer(fixed_s=t1 - slope * _PROBE_BYTES, s_per_byte=slope,
                          chips=pt.num_chips, kv_bytes=kv_bytes, path=path,
                          hops=pt.shape[axis], pair_shape=pair.shape)
    small = min((prefill_pod, decode_pod), key=lambda p: p.topology.num_chips)
    chip = min((prefill_pod.chip, decode_pod.chip), key=lambda c: c.eff_dcn_bytes_per_s)
    t1 = permute_time_s(chip, small.topology, _PROBE_BYTES)
    t2 = permute_time_s(chip, small.topology, 2 * _PROBE_BYTES)
    slope = (t2 - t1) / _PROBE_BYTES
    return KvTransfer(fixed_s=t1 - slope * _PROBE_BYTES, s_per_byte=slope,
                      chips=small.topology.num_chips, kv_bytes=kv_bytes)
