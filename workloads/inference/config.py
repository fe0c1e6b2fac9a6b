"""The run settings of one decode step or one prefill (`DecodeConfig`), checked as they are
built, and how the next token is chosen (`SAMPLING_MODES`, `check_sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from topologies.errors import TpusimError
from topologies.validate import MAX_BATCH, MAX_CHUNKS, MAX_TOKENS, one_of, short_repr
from workloads.dtypes import KV_CACHE_DTYPES, MATMUL_DTYPES, WEIGHT_STORAGE_DTYPES, storage_bytes
from workloads.models import TransformerSpec
from workloads.moe import MoeConfig

SAMPLE_TOP_K = 64  # candidates kept by top-k sampling
# How the next token is chosen from the logits: "top-k" (a draw among the SAMPLE_TOP_K
# largest) or "greedy" (their argmax). Their collectives over a vocabulary split over `tensor`
# are XLA's (`workloads/inference/program.py`, `InferenceCompiler.sample`).
SAMPLING_MODES = ("top-k", "greedy")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeConfig:
    """Run settings of one decode step or one prefill (what `tpusim decode` and `prefill` take).

    Attributes:
        batch: sequences decoded together (global, over all chips).
        context_len: tokens in each sequence's KV cache that a decode step attends to.
        weight_dtype: storage format of the weights (bytes only, unless matmul_dtype is int8).
        kv_dtype: storage format of the KV cache.
        matmul_dtype: MXU format of the weight matmuls (int8 runs at the int8 peak).
        prompt_len: prefill only: prompt tokens per sequence.
        prefill_chunk: prefill only: tokens per chunk (None = the whole prompt at once).
        moe: router skew and capacity factor (workloads/moe.py).
        sampling: "top-k" (a draw among the 64 largest logits) or "greedy" (their argmax).
    """

    batch: int
    context_len: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    matmul_dtype: str = "bf16"
    prompt_len: int | None = None
    prefill_chunk: int | None = None
    moe: MoeConfig = field(default_factory=MoeConfig)
    sampling: str = "top-k"

    def __post_init__(self) -> None:
        def _pos_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not _pos_int(self.batch):
            raise TpusimError(f"{{batch}} {self.batch!r} must be an integer >= 1 (sequences)",
                              "batch")
        if not _pos_int(self.context_len):
            raise TpusimError(f"{{context_len}} {self.context_len!r} must be an integer >= 1 "
                              f"(tokens in the KV cache)", "context_len")
        storage_bytes(WEIGHT_STORAGE_DTYPES, self.weight_dtype, "weight_dtype")
        storage_bytes(KV_CACHE_DTYPES, self.kv_dtype, "kv_dtype")
        # Any case, as the storage dtypes (`storage_bytes`) and the training dtypes take them.
        if not isinstance(self.matmul_dtype, str) or self.matmul_dtype.lower() not in \
                MATMUL_DTYPES:
            raise TpusimError(f"{{matmul_dtype}} {short_repr(self.matmul_dtype)} is not "
                              f"supported; {one_of(self.matmul_dtype, MATMUL_DTYPES)}",
                              "matmul_dtype")
        if self.sampling not in SAMPLING_MODES:
            raise TpusimError(f"{{sampling}} {short_repr(self.sampling)} is not supported; "
                              f"{one_of(self.sampling, SAMPLING_MODES)}", "sampling")
        if self.prompt_len is not None and not _pos_int(self.prompt_len):
            raise TpusimError(f"{{prompt_len}} {self.prompt_len!r} must be an integer >= 1",
                              "prompt_len")
        if self.prefill_chunk is not None and not _pos_int(self.prefill_chunk):
            raise TpusimError(f"{{prefill_chunk}} {self.prefill_chunk!r} must be an integer >= 1",
                              "prefill_chunk")
        for name, v, hi in (("batch", self.batch, MAX_BATCH),
                            ("context_len", self.context_len, MAX_TOKENS),
                            ("prompt_len", self.prompt_len, MAX_TOKENS)):
            if v is not None and v > hi:
                raise TpusimError(f"{{{name}}} {v:,} is over the limit of {hi:,}; give a "
                                  f"smaller value", name)
        if self.prompt_len is not None and self.prefill_chunk is not None:
            n = -(-self.prompt_len // self.prefill_chunk)
            if n > MAX_CHUNKS:
                raise TpusimError(
                    f"{{prompt_len}} {self.prompt_len:,} in {{prefill_chunk}} "
                    f"{self.prefill_chunk:,}-token chunks is {n:,} chunks, over the limit of "
                    f"{MAX_CHUNKS:,}; give chunks of at least "
                    f"{-(-self.prompt_len // MAX_CHUNKS):,} tokens", "prompt_len", "prefill_chunk"
                )

    @property
    def weight_bytes_per_param(self) -> float:
        return storage_bytes(WEIGHT_STORAGE_DTYPES, self.weight_dtype, "weight_dtype")

    @property
    def kv_bytes_per_elem(self) -> float:
        return storage_bytes(KV_CACHE_DTYPES, self.kv_dtype, "kv_dtype")



def check_sampling(model: TransformerSpec, cfg: DecodeConfig) -> None:
    """Top-k sampling needs at least k logits to choose among."""
    if cfg.sampling == "top-k" and model.vocab_size < SAMPLE_TOP_K:
        raise TpusimError(
            f"{{sampling}} top-k draws among the {SAMPLE_TOP_K} largest logits, but model "
            f"{model.name!r} has vocab_size={model.vocab_size}, fewer than {SAMPLE_TOP_K}; "
            f"use {{sampling}} greedy, or a vocabulary of at least {SAMPLE_TOP_K} tokens",
            "sampling")

