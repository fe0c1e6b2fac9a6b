"""The time to send a request's KV cache from a prefill replica to a decode replica
(disaggregated serving), from the network model.

The replicas are separate slices joined by DCN. The cache is spread over the sending replica's
chips as its decode program holds it, and every chip sends its share to its counterpart in the
other replica at once: a collective-permute across the slices of a topology that is the
smaller replica's slice twice over DCN (`sim.collective_sim.simulate_collective`, the same
fluid link model every DCN collective runs on: each chip's DCN link at the chip's achieved
rate, the DCN latency and the per-message overhead). The larger replica's extra chips receive
nothing, so the smaller sets the parallelism; the chip with the slower DCN sets the rate.

A transfer's time on that model is affine in its bytes (fixed latency and overhead, then the
bytes over the rate), so the model is simulated once per configuration at two sizes and every
request's transfer is `fixed_s + s_per_byte x bytes per chip`; a test holds it equal to the
simulated permute of that request's bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sim.collective_sim import simulate_collective

_PROBE_BYTES = 1 << 20  # per chip; the second probe is twice it


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KvTransfer:
    """`seconds(tokens)`: one request's cache of `tokens` cached tokens sent across."""

    fixed_s: float
    s_per_byte: float  # per byte one chip sends
    chips: int  # chips sending in parallel
    kv_bytes: Any  # tokens -> the cache's bytes (TransformerSpec.kv_cache_bytes, bound)

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.s_per_byte * self.kv_bytes(tokens) / self.chips

    def describe(self) -> dict[str, Any]:
        return {"path": "dcn", "chips": self.chips, "fixed_s": self.fixed_s,
                "s_per_byte_per_chip": self.s_per_byte}


def permute_time_s(chip, topology, nbytes_per_chip: int) -> float:
    """The network model's time for every chip of `topology` (one replica's slice, or its
    slices) to send `nbytes_per_chip` to its counterpart in a second copy of it over DCN."""
    both = dataclasses.replace(topology, num_slices=2 * topology.num_slices)
    return float(simulate_collective(chip=chip, topology=both, op="collective-permute",
                                     axes="dcn", nbytes=int(nbytes_per_chip),
                                     shift=topology.num_slices).time_s)


def kv_transfer(prefill_pod, decode_pod, model, kv_bytes_per_elem: float) -> KvTransfer:
    """The transfer model between two replicas' pods (`resolve_pod` results)."""
    small = min((prefill_pod, decode_pod), key=lambda p: p.topology.num_chips)
    chip = min((prefill_pod.chip, decode_pod.chip), key=lambda c: c.eff_dcn_bytes_per_s)
    t1 = permute_time_s(chip, small.topology, _PROBE_BYTES)
    t2 = permute_time_s(chip, small.topology, 2 * _PROBE_BYTES)
    slope = (t2 - t1) / _PROBE_BYTES
    return KvTransfer(fixed_s=t1 - slope * _PROBE_BYTES, s_per_byte=slope,
                      chips=small.topology.num_chips,
                      kv_bytes=lambda tokens: model.kv_cache_bytes(tokens, kv_bytes_per_elem))
