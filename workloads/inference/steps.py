"""The entry points: the SPMD `Trace` of one decode step (every sequence emits one token) and
of a prefill of the prompts (optionally chunked), and the tpu.md §5 roofline of a decode step."""

from __future__ import annotations

import math

from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh
from workloads.inference.config import DecodeConfig, check_sampling
from workloads.inference.layout import layout, memory_plan
from workloads.inference.program import InferenceCompiler
from workloads.models import TransformerSpec
from workloads.trace import Trace, TraceBuilder


def compile_decode_step(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                        cfg: DecodeConfig) -> Trace:
    """The SPMD program of one decode step: every sequence of the batch emits one token.

    Args:
        model: the Transformer.
        mesh: logical mesh over `data`, `tensor` (heads, d_ff, vocab, KV heads), `expert`, and
            `fsdp` (2D weight-stationary: splits the weights' d_model; see `layer_2d`).
        num_chips: chips in the pod (must equal the mesh size).
        cfg: batch, context length and dtypes.
    """
    cfg.moe.check_model(model)
    check_sampling(model, cfg)
    lay = layout(model, mesh, num_chips, cfg.batch)
    plan = memory_plan(model, mesh, num_chips, cfg)
    c = InferenceCompiler(model, mesh, num_chips, cfg, lay)
    x = c.embed(None, lay.local_batch, "decode", plan["activation_bytes"])
    for layer in range(model.num_layers):
        x = c.layer(layer, x, 1, cfg.context_len, "decode")
    c.head(x, "decode", plan["activation_bytes"])
    return Trace(mesh=mesh, ops=tuple(c.b.ops), meta=c.meta("decode", plan))


def _check_prefill_size(b: TraceBuilder, model: TransformerSpec, cfg: DecodeConfig, start: int,
                        per_chunk: int) -> None:
    """Every chunk adds the same ops as the first (tests/test_decode.py checks it), so a prompt
    whose chunks cannot fit one program is refused once the first is built, not after building
    the limit's ops (LLaMA-3-405B, 65,536 tokens in 256 chunks: 250,000 ops, 1.6 CPU-s)."""
    chunks = -(-cfg.prompt_len // cfg.prefill_chunk)
    least = start + chunks * per_chunk
    if least <= b.max_ops:
        return
    # The head after the last chunk needs room too (a few ops, under one chunk's).
    fit = max((b.max_ops - start) // per_chunk - 1, 1)
    raise TpusimError(
        f"{{prompt_len}} {cfg.prompt_len:,} in {chunks:,} chunks of {{prefill_chunk}} "
        f"{cfg.prefill_chunk:,} x {model.num_layers} layers compiles to at least {least:,} ops "
        f"({per_chunk:,} per chunk, counted on the first), over the {b.max_ops:,} tpusim "
        f"simulates in one program; use a {{prefill_chunk}} of at least "
        f"{-(-cfg.prompt_len // fit):,} tokens "
        + (f"(at most {fit:,} chunks)" if fit > 1 else "(the whole prompt in one chunk)"),
        "prompt_len", "prefill_chunk")


def compile_prefill(model: TransformerSpec, mesh: LogicalMesh, num_chips: int,
                    cfg: DecodeConfig, *, cached_len: int = 0) -> Trace:
    """The SPMD program of prefilling `cfg.prompt_len` tokens of every sequence.

    With `prefill_chunk`, the prompt is processed in chunks; each chunk attends causally to
    itself and to the cache written by the earlier chunks, and re-reads the weights.
    `cached_len` tokens before them are already in the KV cache (the earlier chunks of a
    prompt prefilled one chunk per serving iteration, sim/serving): every token attends to them
    too. `cfg.context_len` should then cover `cached_len + prompt_len` (the cache it holds).
    """
    if isinstance(cached_len, bool) or not isinstance(cached_len, int) or cached_len < 0:
        raise TpusimError(f"cached_len {cached_len!r} must be a whole number >= 0 (tokens "
                          f"already in the KV cache)")
    if cfg.prompt_len is None:
        raise TpusimError("prefill needs {prompt_len} (prompt tokens per sequence)", "prompt_len")
    cfg.moe.check_model(model)
    check_sampling(model, cfg)
    lay = layout(model, mesh, num_chips, cfg.batch)
    plan = memory_plan(model, mesh, num_chips, cfg)
    c = InferenceCompiler(model, mesh, num_chips, cfg, lay)
    P = cfg.prompt_len
    chunk = min(cfg.prefill_chunk or P, P)
    x = None
    start = 0
    first = len(c.b.ops)
    while start < P:
        if start == chunk:  # the first chunk is built: refuse now a prompt that cannot fit
            _check_prefill_size(c.b, model, cfg, first, len(c.b.ops) - first)
        t = min(chunk, P - start)
        x = c.embed(x, lay.local_batch * t, "prefill",
                    plan["activation_bytes"] if start == 0 else 0.0)
        for layer in range(model.num_layers):
            x = c.layer(layer, x, t, cached_len + start, "prefill")
        start += t
    c.head(x, "prefill", plan["activation_bytes"])
    meta = c.meta("prefill", plan)
    meta = meta.with_(num_chunks=math.ceil(P / chunk))
    if cached_len:
        meta = meta.with_(cached_len=cached_len)
    return Trace(mesh=mesh, ops=tuple(c.b.ops), meta=meta)


def decode_roofline_s(model: TransformerSpec, num_chips: int, cfg: DecodeConfig,
                      hbm_bytes_per_s: float, flops_per_s: float) -> float:
    """tpu.md §5 lower bound of a decode step on `num_chips` chips (whole-pod rates):
    `B·KV/W_total + max(2·B·P/C_total, P_bytes/W_total)` with P = active parameters."""
    kv = cfg.batch * model.kv_cache_bytes(cfg.context_len, cfg.kv_bytes_per_elem)
    p = model.num_active_params
    w_tot, c_tot = hbm_bytes_per_s * num_chips, flops_per_s * num_chips
    return kv / w_tot + max(2 * cfg.batch * p / c_tot, p * cfg.weight_bytes_per_param / w_tot)

