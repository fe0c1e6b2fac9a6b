"""Number formats tpusim models: one table of bytes per element, and the formats each use
takes (training's params, gradients and optimizer state; decode's weight storage, KV cache and
MXU format; the element types of an HLO program).

A format is named in any case on the command line and in the Python API (`bf16`, `BF16`); the
names each use accepts, and the order its errors list them in, are the tuples below.
"""

from __future__ import annotations

import enum

from topologies.errors import TpusimError
from topologies.validate import one_of, short_repr, subject


class Dtype(enum.StrEnum):
    """A number format of weights, activations, gradients, optimizer state or the KV cache."""

    BF16 = "bf16"
    FP32 = "fp32"
    F32 = "f32"  # the same format as fp32, under XLA's name
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"

    @property
    def nbytes(self) -> float:
        """Bytes per element (int4 packs two elements a byte; tpu.md §1.2 "Lower precision")."""
        return _BYTES[self]


_BYTES = {Dtype.BF16: 2, Dtype.FP32: 4, Dtype.F32: 4, Dtype.INT8: 1, Dtype.INT4: 0.5,
          Dtype.FP8: 1}

# Training's params (`--param-dtype`, `--gather-dtype`), gradients and optimizer state.
TRAINING_DTYPES = (Dtype.BF16, Dtype.FP32, Dtype.F32, Dtype.INT8, Dtype.INT4, Dtype.FP8)
# Decode's storage formats of the weights (`--weight-dtype`) and of the KV cache (`--kv-dtype`).
WEIGHT_STORAGE_DTYPES = (Dtype.BF16, Dtype.FP8, Dtype.INT8, Dtype.INT4)
KV_CACHE_DTYPES = (Dtype.BF16, Dtype.FP8, Dtype.INT8, Dtype.INT4)
# MXU formats the engine costs: the bf16 peak or the int8 peak (`Op.dtype == "int8"`).
MATMUL_DTYPES = (Dtype.BF16, Dtype.INT8)
# Training's matmul formats (`train --matmul-dtype`): fp8 only on a chip with an fp8 MXU
# rate (`ChipSpec.mxu_fp8_ops_per_s`; no preset has one, docs/model/int8.md).
TRAINING_MATMUL_DTYPES = (Dtype.BF16, Dtype.INT8, Dtype.FP8)

# Bytes per element of an HLO program's element types; sub-byte types round up (XLA packs
# them, but they are rare in programs tpusim replays and never dominate traffic).
HLO_ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f4e2m1fn": 1, "f8e8m0fnu": 1,
    "token": 0, "opaque": 0,
}


def _names(allowed: tuple[Dtype, ...]) -> list[str]:
    return [d.value for d in allowed]


def dtype_bytes(name: str, flag: str) -> float:
    """Bytes per element of the training dtype `name` (any case), or the one-line error naming
    the setting `flag` (a Python argument name, see `topologies.validate.subject`)."""
    who, params = subject(flag)
    if not isinstance(name, str):
        raise TpusimError(f"{who} {short_repr(name)} must be a dtype name; "
                          f"{one_of(name, _names(TRAINING_DTYPES))}", *params)
    if name.lower() not in TRAINING_DTYPES:
        raise TpusimError(
            f"{who} {short_repr(name)} is not a known dtype; "
            f"{one_of(name, _names(TRAINING_DTYPES))}", *params
        )
    return Dtype(name.lower()).nbytes


def storage_bytes(allowed: tuple[Dtype, ...], name: object, flag: str) -> float:
    """Bytes per element of the storage format `name` (any case) among `allowed` (decode's
    weights or KV cache), as a float, or the one-line error of the setting `flag` (a Python
    argument name, `topologies.validate.subject`)."""
    if not isinstance(name, str) or name.lower() not in allowed:
        what, params = subject(flag)
        raise TpusimError(f"{what} {short_repr(name)} is not a supported dtype; "
                          f"{one_of(name, _names(allowed))}", *params)
    return float(Dtype(name.lower()).nbytes)
