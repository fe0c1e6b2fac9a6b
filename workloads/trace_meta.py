"""A trace's metadata: what the compiler knew about the program that the ops do not say.

`TraceMeta` is the typed, frozen form of a trace file's `"meta"` object. The compilers write it
(`TraceMeta.of(...)`, keyword by keyword, in the order the file lists them), the engine, the
run layer and the exporters read it by attribute, and a trace file's reader turns the JSON
object into one (`TraceMeta.from_dict`, after `workloads.trace._check_meta` has checked it).
Reading is lossless: a key no field names (a user-written file's own notes) goes to `extra`,
and `to_dict()` gives back the file's object with the same keys in the same order, so a trace
written, read and written again is byte-identical.

`key_order` records which keys the trace has and in which order; a field the trace does not
have is `None` (a key given as null is present, and written back as null). Per-chip sizes are
bytes on one chip (the busiest when the work does not divide evenly); FLOPs are per chip per
step.

Fields (writer; readers):

- `kind` (`TraceKind`): which compiler wrote the program: training (`tpusim compile`), decode /
  prefill (the inference compilers), hlo (`import-hlo`), chakra (`import-chakra`).
- `model` (text): the model's name. All compilers; reports.
- `num_chips`: chips the program was compiled for. All compilers; run layer, exporters.
- training (`workloads/training/step.py`): `seq_len` (tokens), `batch_per_chip`,
  `global_sequences`, `tokens_per_step` (tokens per step, whole pod), `model_flops_per_chip`
  and `maxtext_flops_per_chip` (FLOPs per chip per step: 6·N·D plus attention, and MaxText's
  count), `remat`, `attention`, `pipeline_schedule`, `fsdp_gather`, `fsdp_grad`,
  `dp_grad_split`, `optimizer`, `tp_activations`, `tp_comm` (the settings' names),
  `microbatches`, `pipeline_stages`, `virtual_stages` (counts), `pipeline_send_bytes` (bytes one
  stage sends the next per microbatch), `overlap`, `fuse_elementwise` (flags),
  `params_per_chip` (parameters), `static_hbm_bytes` (bytes resident all step: parameters,
  gradients, optimizer state), `static_composition` (memory category -> bytes, the part of the
  static bytes the memory timeline starts with), `static_breakdown` (params / grads / optimizer
  -> bytes), `activation_bytes_estimate` (peak activation bytes), `saved_activations_per_layer`
  (tensor name -> bytes the first layer keeps for its backward), `memory_events` ([op id,
  memory category, bytes] rows: HBM allocated (+) or freed (-) when the op ends),
  `logits_bytes` (the loss's temporaries), `pipeline_compile` (the model and the settings, so
  a replay can compose a pipeline's stage programs; `workloads/training/compiler.py`),
  `pipeline_stage` (the stage of a composed stage program; `sim/engine/pipeline.py`, never
  written). Readers: `sim/engine/memory.py` (memory timeline), `sim/runs/train.py`,
  `sim/runs/goodput.py`, `sim/studies/plan_bounds.py`, `sim/engine/pipeline.py`, the reports.
- `moe` (the routing's summary) and `moe_scenario_applied`: training and inference compilers
  of a mixture-of-experts model; the MoE report.
- decode / prefill (`workloads/inference/program.py`, `steps.py`): `batch`, `context_len`,
  `prompt_len`, `prefill_chunk`, `local_batch` (sequences/tokens), `weight_dtype`, `kv_dtype`,
  `matmul_dtype`, `sharding` ("1d" or "2d-weight-stationary"), `kv_batch_split`,
  `weights_bytes`, `kv_cache_bytes`, `activation_bytes` (bytes per chip), `weights_bytes_total`,
  `kv_cache_bytes_total` (bytes, whole model / whole batch), `num_chunks` and `cached_len`
  (prefill). Readers: `sim/runs/inference.py`, the serving model.
- hlo / chakra imports: `source` (the file read), `module` (the HLO module's name),
  `device_groups` (list of {"groups": [[chip, ...], ...]} or {"pairs": [[src, dst], ...]}, the
  groups a collective op's `group` column indexes), `chakra_ranks`, `chakra_compute`,
  `approximations` (text notes).

The values are stored as given (lists and dicts as JSON has them); the object is frozen, and
readers must not change the containers either.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class TraceKind(enum.StrEnum):
    """Which compiler wrote a trace (`meta.kind`)."""

    TRAINING = "training"
    DECODE = "decode"
    PREFILL = "prefill"
    HLO = "hlo"
    CHAKRA = "chakra"


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceMeta:
    """A trace's metadata (see the module docstring for each field's units, writer and readers).

    Read by attribute; `to_dict()` is the file's object. There is no lookup by string key: a
    key no field names is in `extra`, and `key_order` says which keys the trace has."""

    kind: TraceKind | None = None
    model: str | None = None
    num_chips: int | None = None
    # training
    seq_len: int | None = None
    batch_per_chip: float | None = None
    global_sequences: int | None = None
    tokens_per_step: float | None = None
    model_flops_per_chip: float | None = None
    maxtext_flops_per_chip: float | None = None
    remat: str | None = None
    attention: str | None = None
    microbatches: int | None = None
    pipeline_stages: int | None = None
    pipeline_schedule: str | None = None
    virtual_stages: int | None = None
    pipeline_send_bytes: float | None = None
    moe: Mapping[str, Any] | None = None
    moe_scenario_applied: bool | None = None
    overlap: bool | None = None
    fsdp_gather: str | None = None
    fsdp_grad: str | None = None
    dp_grad_split: str | None = None
    optimizer: str | None = None
    fuse_elementwise: bool | None = None
    tp_activations: str | None = None
    tp_comm: str | None = None
    params_per_chip: float | None = None
    static_hbm_bytes: float | None = None
    static_composition: Mapping[str, float] | None = None
    static_breakdown: Mapping[str, float] | None = None
    activation_bytes_estimate: float | None = None
    saved_activations_per_layer: Mapping[str, float] | None = None
    memory_events: list | None = None
    logits_bytes: float | None = None
    pipeline_compile: Mapping[str, Any] | None = None
    pipeline_stage: int | None = None
    # decode / prefill
    batch: int | None = None
    context_len: int | None = None
    prompt_len: int | None = None
    prefill_chunk: int | None = None
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    matmul_dtype: str | None = None
    local_batch: float | None = None
    sharding: str | None = None
    kv_batch_split: int | None = None
    weights_bytes: float | None = None
    kv_cache_bytes: float | None = None
    activation_bytes: float | None = None
    weights_bytes_total: float | None = None
    kv_cache_bytes_total: float | None = None
    num_chunks: int | None = None
    cached_len: int | None = None
    # imports
    source: str | None = None
    module: str | None = None
    device_groups: list | None = None
    chakra_ranks: int | None = None
    chakra_compute: str | None = None
    approximations: list | None = None
    # keys no field names (a user-written file's), kept so that reading is lossless
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the keys the trace has, in file order (None: the set fields in declaration order, then
    # `extra`'s keys)
    key_order: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and not isinstance(self.kind, TraceKind):
            object.__setattr__(self, "kind", TraceKind(self.kind))
        clash = [k for k in self.extra if k in FIELD_NAMES]
        if clash:
            raise TypeError(f"TraceMeta.extra names fields {clash}; give them as fields")
        if self.key_order is None:
            present = [n for n in _FIELD_ORDER if getattr(self, n) is not None]
            object.__setattr__(self, "key_order", (*present, *self.extra))
        else:
            order = set(self.key_order)
            unlisted = [n for n in _FIELD_ORDER if getattr(self, n) is not None
                        and n not in order] + [k for k in self.extra if k not in order]
            stray = [k for k in order if k not in FIELD_NAMES and k not in self.extra]
            if unlisted or stray or len(order) < len(self.key_order):
                raise ValueError(f"TraceMeta.key_order {self.key_order} must list each key "
                                 f"present once (unlisted {unlisted}, unknown {stray})")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def of(cls, **values: Any) -> TraceMeta:
        """The metadata with these fields, listed in the file in the order given (a compiler's
        writer). A field given as None is written as null; an unknown name is a TypeError."""
        unknown = [k for k in values if k not in FIELD_NAMES]
        if unknown:
            raise TypeError(f"TraceMeta has no field(s) {unknown}")
        return cls(**values, key_order=tuple(values))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TraceMeta:
        """A trace file's `"meta"` object (checked by `workloads.trace._check_meta`), keys that
        name no field kept in `extra`, the file's key order kept."""
        if isinstance(d, TraceMeta):
            return d
        known = {k: v for k, v in d.items() if k in FIELD_NAMES}
        extra = {k: v for k, v in d.items() if k not in FIELD_NAMES}
        return cls(**known, extra=extra, key_order=tuple(d))

    def with_(self, **values: Any) -> TraceMeta:
        """A copy with these fields set (a new key goes last, as in a dict)."""
        unknown = [k for k in values if k not in FIELD_NAMES]
        if unknown:
            raise TypeError(f"TraceMeta has no field(s) {unknown}")
        order = self.key_order + tuple(k for k in values if k not in self.key_order)
        return dataclasses.replace(self, **values, key_order=order)

    def to_dict(self) -> dict[str, Any]:
        """The trace file's `"meta"` object: the keys present, in `key_order`."""
        return {k: self._value(k) for k in self.key_order}

    def _value(self, key: str) -> Any:
        if key in FIELD_NAMES:
            v = getattr(self, key)
            return str(v) if key == "kind" and v is not None else v
        return self.extra[key]


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(TraceMeta)
                     if f.name not in ("extra", "key_order"))
FIELD_NAMES = frozenset(_FIELD_ORDER)
