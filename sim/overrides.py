"""What-if overrides, `set` `KEY=VALUE`: parsed and validated into an `Overrides`, then applied to
a chip (`ChipSpec` fields), a model (`model.<TransformerSpec field>`), the topology's wraparound
(`topology.wraparound`) and the collective algorithm (`collective.algorithm`).

A numeric value is a plain number (`1.8e11`), a number with a unit suited to the field
(`180GB/s`, `32GiB`, `2us`, `459T`), or `xF`, a multiplier of the preset's (or the chip/model
file's) value: `set={"ici_link_bytes_per_s": "x2"}`, read by `topologies/quantities.py`, the parser
chip and model YAML files use too. Building an `Overrides` never touches the disk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sim.hardware import (
    CHIP_BOOL_FIELDS,
    CHIP_FIELDS,
    NULLABLE_CHIP_FIELDS,
    WRAP_RULES,
    ChipSpec,
)
from topologies.errors import TpusimError
from topologies.quantities import parse_quantity
from topologies.validate import MAX_MODEL_DIM, ascii_int, one_of, short_repr
from workloads.models import MODEL_FIELDS, MlpKind, TransformerSpec

# The groups of keys a command can accept (`scope`); each command lists the ones it simulates.
CHIP = "chip"
TOPOLOGY = "topology"
COLLECTIVE = "collective"
MODEL = "model"
SCOPES = (CHIP, TOPOLOGY, COLLECTIVE, MODEL)

TOPOLOGY_KEYS = ("topology.wraparound",)
COLLECTIVE_KEYS = ("collective.algorithm",)
MODEL_KEYS = tuple(f"model.{f}" for f in MODEL_FIELDS)

# Chip fields whose valid range includes 0 (every other numeric chip field must be > 0).
_CHIP_ZERO_OK = ("op_overhead_s", "dcn_message_overhead_s", "ocs_hop_latency_s",
                 "ocs_reconfiguration_s",
                 "mxu_fp8_ops_per_s",
                 "mxu_j_per_flop",
                 "mxu_int8_j_per_op", "vpu_j_per_flop", "hbm_j_per_byte", "ici_j_per_byte",
                 "dcn_j_per_byte", "pcie_j_per_byte", "idle_power_w", "host_power_share",
                 "usd_per_chip_hour", "clock_energy_exponent")
_CHIP_INT = ("ici_links_per_chip", "tensorcores_per_chip", "mxu_dim")
_CHIP_TEXT = ("name", "generation_rule")
# Model fields: integers >= 1, integer counts >= 0 (MoE), booleans, text.
_MODEL_INT_POS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff",
                  "vocab_size", "moe_d_ff", "attention_window", "kv_lora_rank", "q_lora_rank",
                  "v_head_dim", "moe_layer_period", "attention_chunk_size")
_MODEL_INT_ZERO_OK = ("num_experts", "experts_per_token", "num_shared_experts",
                      "first_dense_layers", "global_layer_period", "qk_rope_head_dim",
                      "num_mtp_modules")
_MODEL_BOOL = ("tied_embeddings", "parallel_block", "post_norms", "qk_norm")
# Model fields whose null means "not set" (d_ff for the experts; full attention everywhere; no
# MLA, a full-rank query, values as wide as head_dim; no chunked attention).
_MODEL_NULLABLE = ("moe_d_ff", "attention_window", "kv_lora_rank", "q_lora_rank", "v_head_dim",
                   "attention_chunk_size")

@dataclass(frozen=True, slots=True, kw_only=True)
class Override:
    """One `KEY=VALUE`: the key, the text given, and a multiplier or an absolute value."""

    key: str
    given: Any
    multiplier: float | None = None  # `xF`
    value: Any = None  # absolute (number, text, bool, tuple or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Overrides:
    """Validated overrides, grouped by what they change. Empty by default (no change)."""

    chip: tuple[Override, ...] = ()
    model: tuple[Override, ...] = ()
    wraparound: str | None = None
    algorithm: str | None = None
    given: tuple[tuple[str, Any], ...] = ()  # every KEY=VALUE as given, in order

    def __bool__(self) -> bool:
        return bool(self.given)

    def as_dict(self) -> dict[str, Any]:
        """The overrides as given: {key: value text}, the form `parse_overrides` accepts."""
        return dict(self.given)

    def apply_chip(self, chip: ChipSpec) -> ChipSpec:
        """`chip` with the chip overrides applied (validated like a preset)."""
        if not self.chip:
            return chip
        changes = {o.key: _resolve(o, getattr(chip, o.key), "") for o in self.chip}
        return chip.with_overrides(**changes)

    def apply_model(self, model: TransformerSpec) -> TransformerSpec:
        """`model` with the `model.*` overrides applied (validated like a zoo model)."""
        if not self.model:
            return model
        changes = {}
        for o in self.model:
            field = o.key.removeprefix("model.")
            changes[field] = _resolve(o, getattr(model, field), "model.")
        return dataclasses.replace(model, **changes)

    def resolved(self, chip: ChipSpec | None = None,
                 model: TransformerSpec | None = None) -> dict[str, dict[str, Any]]:
        """{key: {"given", "base", "value"}} for every chip and model override (for `inputs`)."""
        out: dict[str, dict[str, Any]] = {}
        for group, spec, prefix in ((self.chip, chip, ""), (self.model, model, "model.")):
            if spec is None:
                continue
            for o in group:
                base = getattr(spec, o.key.removeprefix(prefix))
                out[o.key] = {"given": o.given, "base": _jsonable(base),
                              "value": _jsonable(_resolve(o, base, prefix))}
        return out


def allowed_keys(scope: Iterable[str]) -> list[str]:
    """Every key a command with this scope accepts, in a stable order."""
    scope = set(scope)
    keys: list[str] = []
    if CHIP in scope:
        keys += list(CHIP_FIELDS)
    if TOPOLOGY in scope:
        keys += list(TOPOLOGY_KEYS)
    if COLLECTIVE in scope:
        keys += list(COLLECTIVE_KEYS)
    if MODEL in scope:
        keys += list(MODEL_KEYS)
    return keys


def set_pairs(items: Iterable[str]) -> dict[str, str]:
    """`KEY=VALUE` texts (the CLI's repeated set flag) as {key: value}, later wins; an item that
    is not KEY=VALUE is an error."""
    pairs: dict[str, str] = {}
    for item in items:
        text = str(item)
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise TpusimError(
                f"{{set}} {text!r} is not KEY=VALUE; write e.g. {{set}} ici_link_bytes_per_s=x2",
                "set"
            )
        pairs[key.strip()] = value.strip()
    return pairs


def parse_overrides(items: Iterable[str] | Mapping[str, Any] | None,
                    scope: Iterable[str] = SCOPES, *, command: str = "this command",
                    listing: str | None = None) -> Overrides:
    """`["ici_link_bytes_per_s=x2", "model.d_ff=28672"]` (or the same as a dict) -> Overrides.

    Args:
        items: `KEY=VALUE` strings (the CLI's repeated set flag) or a {key: value} mapping (the
            Python API's `set=`). A later value for the same key replaces an earlier one.
        scope: the key groups the command accepts (`chip`, `topology`, `collective`, `model`).
        command: the command's name, for error messages.
        listing: the Python call that lists the keys the command takes, which an unknown
            key's error names (a placeholder: the CLI writes the command's help).

    Raises:
        TpusimError: a malformed item, an unknown key (the message lists the allowed ones), or
            a value that is not valid for its field (non-positive, NaN, not a number, ...).
    """
    scope = tuple(scope)
    pairs: dict[str, Any] = {}
    if items is None:
        items = ()
    if isinstance(items, Mapping):
        for k, v in items.items():
            pairs[str(k).strip()] = v
    else:
        pairs = set_pairs(items)
    allowed = allowed_keys(scope)
    chip, model = [], []
    wrap = algo = None
    for key, value in pairs.items():
        if key not in allowed:
            raise TpusimError(_unknown_key(key, command, allowed, listing), "set",
                              *([listing] if listing else []))
        if key in CHIP_FIELDS:
            chip.append(_parse_chip(key, value))
        elif key.startswith("model."):
            model.append(_parse_model(key, value))
        elif key == "topology.wraparound":
            wrap = _text(key, value)
        elif key == "collective.algorithm":
            algo = _text(key, value)
    return Overrides(chip=tuple(chip), model=tuple(model), wraparound=wrap, algorithm=algo,
                     given=tuple(pairs.items()))


def _unknown_key(key: str, command: str, allowed: list[str], listing: str | None) -> str:
    """The template of an unknown key's error; `listing`: the Python call that lists the keys
    (a placeholder, which the CLI writes as the command's help)."""
    why = "is not a key tpusim knows"
    if key in CHIP_FIELDS or key in TOPOLOGY_KEYS or key in COLLECTIVE_KEYS or key in MODEL_KEYS:
        why = f"does not apply to {command}"
    elif key in MODEL_FIELDS:
        why = f"is not a chip field (model fields are written model.{key})"
    where = f"`{{{listing}}}` lists them" if listing else ""
    return f"{{set}} {key} {why}; {one_of(key, allowed, listing=where)}"


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TpusimError(f"{{set}} {key}={value!r} must be non-empty text", "set")
    return value.strip()


def _check_range(key: str, value: float, *, zero_ok: bool, integer: bool) -> None:
    if not math.isfinite(value):
        raise TpusimError(f"{{set}} {key}={value}: must be a finite number", "set")
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise TpusimError(
            f"{{set}} {key}={_fmt(value)}: must be {bound}"
            + ("" if zero_ok else " (a non-positive value is not a chip or model)")
            + "; give a positive value or a multiplier such as x2", "set"
        )
    if integer and not float(value).is_integer():
        raise TpusimError(f"{{set}} {key}={_fmt(value)}: must be a whole number", "set")


def _bool(key: str, value: Any) -> Override:
    if isinstance(value, bool):
        return Override(key=key, given=value, value=value)
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise TpusimError(f"{{set}} {key}={value}: write true or false", "set")
    return Override(key=key, given=value, value=text == "true")


def _parse_chip(key: str, value: Any) -> Override:
    if key in CHIP_BOOL_FIELDS:
        return _bool(key, value)
    if key in _CHIP_TEXT:
        text = _text(key, value)
        if key == "generation_rule" and text not in WRAP_RULES:
            raise TpusimError(
                f"{{set}} generation_rule={text}: not a wraparound rule; "
                f"{one_of(text, WRAP_RULES)}", "set"
            )
        return Override(key=key, given=value, value=text)
    if key == "max_pod_shape":
        text = _text(key, str(value))
        try:
            shape = tuple(ascii_int(s, max_digits=9) for s in text.lower().split("x"))
        except ValueError:
            shape = ()
        if not shape or any(n < 1 for n in shape):
            raise TpusimError(f"{{set}} max_pod_shape={text}: write a shape such as 16x16x16",
                              "set")
        return Override(key=key, given=value, value=shape)
    if key in NULLABLE_CHIP_FIELDS and str(value).strip().lower() in ("none", "null"):
        return Override(key=key, given=value, value=None)
    q = _quantity(key, key, value)
    if q.multiplier is not None:
        return Override(key=key, given=value, multiplier=q.multiplier)
    v = q.value
    _check_range(key, v, zero_ok=key in _CHIP_ZERO_OK, integer=key in _CHIP_INT)
    if key.endswith("_efficiency") and v > 1:
        raise TpusimError(
            f"{{set}} {key}={_fmt(v)}: an efficiency is the achievable fraction of the peak, in "
            f"(0, 1]; give e.g. 0.9 (or a multiplier such as x0.9)", "set"
        )
    return Override(key=key, given=value, value=int(v) if key in _CHIP_INT else v)


def _parse_model(key: str, value: Any) -> Override:
    field = key.removeprefix("model.")
    if field == "name":
        return Override(key=key, given=value, value=_text(key, value))
    if field == "mlp":
        text = _text(key, value)
        if text not in set(MlpKind):
            raise TpusimError(f"{{set}} {key}={text}: not an MLP kind; {one_of(text, MlpKind)}",
                              "set")
        return Override(key=key, given=value, value=MlpKind(text))
    if field in _MODEL_BOOL:
        return _bool(key, value)
    if field in _MODEL_NULLABLE and str(value).strip().lower() in ("none", "null"):
        return Override(key=key, given=value, value=None)
    q = _quantity(key, field, value)
    if q.multiplier is not None:
        return Override(key=key, given=value, multiplier=q.multiplier)
    v = q.value
    _check_range(key, v, zero_ok=field in _MODEL_INT_ZERO_OK, integer=True)
    if v > MAX_MODEL_DIM:
        # Refused here, with the text given: past 2^53 the float no longer holds the integer
        # written (a 40-digit value came back as 10000000000000000303786028427003666890752).
        raise TpusimError(f"{{set}} {key}={short_repr(value)}: over the limit of "
                          f"{MAX_MODEL_DIM:,} of every model size; give a smaller value", "set")
    return Override(key=key, given=value, value=int(v))


def _resolve(o: Override, base: Any, prefix: str) -> Any:
    """The override's value for a field whose preset value is `base`."""
    if o.multiplier is None:
        return o.value
    field = o.key.removeprefix(prefix)
    if base is None or isinstance(base, (bool, str, tuple)):
        raise TpusimError(
            f"{{set}} {o.key}={o.given}: a multiplier needs a numeric preset value, and "
            f"{field} is {base!r}; give an absolute value", "set"
        )
    v = base * o.multiplier
    if field in _CHIP_INT or prefix:  # integer fields (every numeric model field is one)
        if not float(v).is_integer():
            raise TpusimError(
                f"{{set}} {o.key}={o.given}: {base} x {o.multiplier:g} = {v:g} is not a whole "
                f"number; {field} counts whole units", "set"
            )
        return int(v)
    if field.endswith("_efficiency") and v > 1:
        raise TpusimError(
            f"{{set}} {o.key}={o.given}: {base:g} x {o.multiplier:g} = {v:g} exceeds 1; an "
            f"efficiency is a fraction of the peak in (0, 1]", "set"
        )
    return float(v)


def _quantity(key: str, field: str, value: Any):
    """`parse_quantity` of override `key` (field `field`), its errors naming `set`."""
    try:
        return parse_quantity(f"{{set}} {key}={value}", field, value)
    except TpusimError as exc:  # the message names the setting as the placeholder
        raise TpusimError(exc.template, *exc.params, "set") from None


def _fmt(v: float) -> str:
    return f"{v:g}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, MlpKind):
        return str(v)
    return v
