"""The requests of the decode-step commands: one decode step (`tpusim decode`), a prefill
(`tpusim prefill`), latency against throughput over batch sizes (`tpusim serve-sweep`) and
requests served by replicas over time (`tpusim serve`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import field
from typing import Any, ClassVar

from sim.runs.requests.base import (
    PERTURB_FIELDS,
    POD_FIELDS,
    SPARE_FIELDS,
    PerturbedRequest,
    RequestBase,
    StepRequest,
    request_dataclass,
)
from topologies.validate import (
    MAX_BATCH,
    MAX_CHIPS,
    MAX_TOKENS,
    FlagError,
    ascii_float,
    int_flag,
    short_repr,
)

_INFERENCE = ("model", "batch", "context_len", "mesh", "dcn", "weight_dtype", "kv_dtype",
              "matmul_dtype", "sampling")


@request_dataclass
class _Decoding(RequestBase):
    """What every decode-step command has: the model, its KV cache and its number formats."""

    model: str | None = None
    context_len: int | None = None
    mesh: str | None = None
    dcn: str | None = None
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    matmul_dtype: str = "bf16"
    sampling: str = "top-k"


@request_dataclass
class DecodeRequest(StepRequest, _Decoding):
    """One decode step with a KV cache (`tpusim decode`)."""

    COMMAND: ClassVar[str] = "decode"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", *_INFERENCE, "algorithm", *PERTURB_FIELDS, *SPARE_FIELDS, "mode",
        "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "batch", "context_len", "mesh")

    batch: int | None = None
    algorithm: str = "auto"


@request_dataclass
class PrefillRequest(DecodeRequest):
    """The prefill of a batch of prompts (`tpusim prefill`)."""

    COMMAND: ClassVar[str] = "prefill"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", *_INFERENCE, "prompt_len", "prefill_chunk", "algorithm",
        *PERTURB_FIELDS, *SPARE_FIELDS, "mode", "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "batch", "prompt_len", "mesh")

    prompt_len: int | None = None
    prefill_chunk: int | None = None


_DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"


@request_dataclass
class ServeSweepRequest(_Decoding):
    """Decode latency against throughput over batch sizes (`tpusim serve-sweep`); `mesh` may
    list several meshes separated by `;`, the dtypes several separated by `,`."""

    COMMAND: ClassVar[str] = "serve-sweep"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", "model", "context_len", "mesh", "dcn", "weight_dtype",
        "kv_dtype", "matmul_dtype", "sampling", "expert_skew", "capacity_factor", "seed",
        "batches")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "context_len", "mesh")

    expert_skew: float = 0.0
    capacity_factor: float | None = None
    seed: int = 0
    batches: str = _DEFAULT_BATCHES


def _positive_number(name: str, fix: str) -> Callable[[Any], float]:
    """A finite number > 0 in ASCII for the setting `name` (the error quotes what was given;
    `fix` may name it as `{name}`)."""

    def conv(text: Any) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{{{name}}} {short_repr(text)} is not a number; {fix}",
                            name) from None
        if not math.isfinite(v) or v <= 0:
            raise FlagError(f"{{{name}}} {short_repr(text)} must be a finite number > 0; {fix}",
                            name)
        return v

    conv.__name__ = "number"
    return conv


# The most requests a serving run simulates (sim/serving/workload.py says why).
MAX_SERVE_REQUESTS = 10_000_000
_SERVE = ("arrival", "rate", "cv", "trace", "requests", "duration", "prompt_tokens",
          "output_tokens", "replicas", "router", "scheduler", "max_batch", "max_tokens_per_iter",
          "prefill_chunk", "kv_block_tokens", "preemption", "prefix_caching", "prefill_replicas",
          "decode_replicas", "prefill_mesh", "decode_mesh", "prefill_slice", "decode_slice",
          "kv_transfer", "slo", "exact_costs")


@request_dataclass
class ServeRequest(PerturbedRequest, _Decoding):
    """Requests served by replicas over time (`tpusim serve`): the workload (arrivals and
    lengths), the deployment (replicas of the pod and mesh, or prefill and decode pools) and
    each replica's scheduler; `seed` seeds the workload's draws as well as the perturbations."""

    COMMAND: ClassVar[str] = "serve"
    FLAGS: ClassVar[tuple[str, ...]] = (*POD_FIELDS, "overrides", "model", "mesh", "dcn",
                                        "weight_dtype", "kv_dtype", "matmul_dtype", "sampling",
                                        *_SERVE, "algorithm", *PERTURB_FIELDS, *SPARE_FIELDS,
                                        "mode")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "mesh")
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "rate": _positive_number("rate", "give requests per second, e.g. {rate} 10"),
        "cv": _positive_number("cv", "give the gaps' coefficient of variation, e.g. {cv} 2 "
                                       "(1 is Poisson)"),
        "duration": _positive_number("duration", "give seconds of arrivals, e.g. "
                                                   "{duration} 600"),
        "requests": int_flag("requests", hi=MAX_SERVE_REQUESTS),
        "replicas": int_flag("replicas", hi=MAX_CHIPS),
        "prefill_replicas": int_flag("prefill_replicas", lo=0, hi=MAX_CHIPS),
        "decode_replicas": int_flag("decode_replicas", lo=0, hi=MAX_CHIPS),
        "max_batch": int_flag("max_batch", hi=MAX_BATCH),
        "max_tokens_per_iter": int_flag("max_tokens_per_iter", hi=MAX_TOKENS),
        "kv_block_tokens": int_flag("kv_block_tokens", hi=MAX_TOKENS),
    }

    arrival: str = "poisson"
    rate: float | None = None
    cv: float | None = None
    trace: str | None = None
    requests: int | None = None
    duration: float | None = None
    prompt_tokens: str | None = None
    output_tokens: str | None = None
    replicas: int = 1
    router: str = "round-robin"
    scheduler: str = "continuous"
    max_batch: int = 256
    max_tokens_per_iter: int | None = None
    prefill_chunk: int | None = None
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    prefill_mesh: str | None = None
    decode_mesh: str | None = None
    prefill_slice: str | None = None
    decode_slice: str | None = None
    kv_block_tokens: int = 16
    slo: str | None = None
    exact_costs: bool = False
    algorithm: str = "auto"
    preemption: str = field(default="recompute", metadata={"quiet": True})
    prefix_caching: bool = field(default=False, metadata={"quiet": True})
    kv_transfer: str = field(default="dcn", metadata={"quiet": True})


