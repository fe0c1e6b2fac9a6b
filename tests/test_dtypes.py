"""The one dtype table (workloads/dtypes.py): each use's names, their order in its errors, the
bytes per element, and the HLO element types the parser reads."""

import pytest

from topologies.errors import TpusimError
from workloads.dtypes import HLO_ELEMENT_BYTES, Dtype, dtype_bytes
from workloads.hlo import parser
from workloads.inference import DecodeConfig


def test_the_training_dtypes_take_any_case_and_list_their_names_in_order():
    assert dtype_bytes("BF16", "--param-dtype") == 2 and dtype_bytes("int4", "--x") == 0.5
    assert Dtype.FP32.nbytes == Dtype.F32.nbytes == 4
    with pytest.raises(TpusimError, match=r"^--grad-dtype 'f16' is not a known dtype; did you "
                                          r"mean bf16\? \(6 in all\)$"):
        dtype_bytes("f16", "--grad-dtype")
    with pytest.raises(TpusimError, match=r"^--grad-dtype 2 must be a dtype name; the nearest "
                                          r"are .* \(6 in all\)$"):
        dtype_bytes(2, "--grad-dtype")


def test_decode_storage_formats_are_floats_of_the_same_table_and_name_theirs_in_order():
    cfg = DecodeConfig(batch=1, context_len=8, weight_dtype="INT4", kv_dtype="fp8")
    assert (cfg.weight_bytes_per_param, cfg.kv_bytes_per_elem) == (0.5, 1.0)
    assert type(DecodeConfig(batch=1, context_len=8).weight_bytes_per_param) is float
    with pytest.raises(TpusimError, match=r"^kv_dtype 'fp32' is not a supported dtype; use one "
                                          r"of: bf16, fp8, int8, int4$"):
        DecodeConfig(batch=1, context_len=8, kv_dtype="fp32")
    with pytest.raises(TpusimError, match=r"^matmul_dtype 'fp8' is not supported; use one of: "
                                          r"bf16, int8$"):
        DecodeConfig(batch=1, context_len=8, matmul_dtype="fp8")


def test_the_hlo_parser_reads_the_one_table():
    assert parser.DTYPE_BYTES is HLO_ELEMENT_BYTES
    assert HLO_ELEMENT_BYTES["bf16"] == Dtype.BF16.nbytes
