"""Cross-check tpusim's compiled training-step collectives against XLA's TPU compiler.

Two sides:

* **XLA**: a small JAX LLaMA-style decoder (`xla_compile.Decoder`: GQA, SwiGLU, RMSNorm, untied
  embeddings, Adam, `jax.checkpoint` per layer = remat full) is compiled for a real TPU
  topology on this CPU-only
  machine (`jax[tpu]` + `jax.experimental.topologies`, `JAX_PLATFORMS=cpu`). The optimized HLO
  (`compiled.as_text()`) is parsed and every collective is counted with its while-loop trip count,
  attributed to a layer through `jax.named_scope("layer{i}")` in the op metadata.
* **tpusim**: `python -m sim compile` with the same dimensions and mesh; collectives are read
  from the trace JSON.

jax is NOT a project dependency: install it into a separate venv (with tpusim's own
dependencies, which the worker imports with this module) and pass its python:

    python3.11 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install '.[hlo]'
    .venv/bin/python -m validation.xla_crosscheck --jax-python /tmp/jaxvenv/bin/python \
        --json validation/results/xla_collectives.json    # compile what the cache lacks

Without the jax python the XLA side is skipped with a message (tpusim side still printed).
This module is also the XLA worker (`--worker CONFIG`, run by the jax python).

Per program the cache (`--json`) also keeps XLA's per-op cost estimates (`op_costs`:
`estimated_cycles` times loop trip counts, by op_name) and the dot FLOPs per chip that
`tpusim import-hlo` counts in the module (`dot_flops`); docs/validation.md compares them with
tpusim's costed ops per op class (`render_op_costs_section`). Programs: dense training
(fsdp, fsdp x tensor, data x fsdp on v5e, v5p, v6e), a MaxText-style MoE training step and a
tensor-parallel decode step. `--reparse DIR` re-reads the HLO-derived fields from an earlier
`--dump DIR` without compiling.

Byte convention (both sides): tpusim's V = the array one replica group sees: all-gather =
gathered output, reduce-scatter / all-reduce = full unreduced operand, collective-permute = the
per-chip message. XLA bytes are taken from the per-device HLO shapes in the same way; counts and
bytes of ops inside while loops are multiplied by the loop's known trip count.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sim.chips import get_chip
from sim.engine import compute_op_times, replay
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from validation import xla_compile
from workloads.hlo.costs import conv_flops
from workloads.hlo.lower import import_hlo
from workloads.hlo.parser import (
    Computation,
    HloModule,
    Instruction,
    Shape,
    backend_config,
    dot_dims,
    parse_hlo,
    replica_groups,
    source_target_pairs,
)
from workloads.inference import DecodeConfig, compile_decode_step
from workloads.moe import MoeConfig
from workloads.trace import OpKind
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import load_model, model_from_dict

REPO = xla_compile.REPO

# LLaMA-3-8B widths, fewer layers.
DIMS = xla_compile.LLAMA3_8B

# name -> configuration. batch_per_chip follows tpusim's convention (global = this x chips).
CONFIGS = {
    "fsdp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    "fsdp_tp_v5p64": dict(topology="v5p:4x4x4", mesh={"fsdp": 16, "tensor": 4}, layers=2,
                          seq=2048, batch_per_chip=0.25, mode="train"),
    # Wider set (issue 11): v6e, data x fsdp, and a narrower model on v5e (the form XLA picks
    # for each weight gather depends on the generation and the matrix size, docs/model.md).
    "fsdp_v6e16": dict(topology="v6e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    "data_fsdp_v6e16": dict(topology="v6e:4x4", mesh={"data": 4, "fsdp": 4}, layers=2,
                            seq=2048, batch_per_chip=1, mode="train"),
    # f32 master weights cast to bf16 in each layer (flax param_dtype=float32, dtype=bfloat16:
    # what nearly every MaxText run measured trained with), f32 Adam update written back f32.
    "fsdp_v6e16_f32": dict(topology="v6e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                           batch_per_chip=1, mode="train", param_dtype="float32"),
    "fsdp_v5e16_f32": dict(topology="v5e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                           batch_per_chip=1, mode="train", param_dtype="float32"),
    "fsdp_v5p16": dict(topology="v5p:2x2x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    "fsdp_v5e16_small": dict(topology="v5e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                             batch_per_chip=1, mode="train", dims="SMALL"),
    # Decode with f32 logits (tpusim's are f32; MaxText's cast_logits_to_fp32), greedy
    # (argmax) and top-k sampling: tpusim's `--sampling greedy` and `top-k`.
    "decode_tp8_v5e8": dict(topology="v5e:2x4", mesh={"tensor": 8}, layers=2, seq=1,
                            batch_per_chip=1, mode="decode", kv_len=2048, sampling="argmax",
                            logits_f32=True),
    "decode_topk_tp8_v5e8": dict(topology="v5e:2x4", mesh={"tensor": 8}, layers=2, seq=1,
                                 batch_per_chip=1, mode="decode", kv_len=2048,
                                 sampling="top-k", logits_f32=True),
    # MoE (issue 11: dense and MoE): xla_moe_schedule.py's MaxText-style dropping MoE.
    "moe_fsdp_ep_v6e16": dict(topology="v6e:4x4", mesh={"fsdp": 4, "expert": 4}, layers=2,
                              seq=2048, batch_per_chip=1, mode="moe_train", final_norm=True,
                              moe=dict(d_model=1024, d_ff=2048, num_experts=8, top_k=2,
                                       capacity_factor=1.25, num_heads=8, head_dim=128,
                                       vocab_size=4096, router="maxtext")),
}

# Programs compiled only to read which form XLA gives each weight gather and gradient reduction
# (`--forms DIR`, docs/model.md "Collectives as XLA emits them"); not in the collective-bytes
# table. Windowed einsums at large N (issue 11): up to which ring length XLA still builds them.
FORM_PROBES = {
    "fsdp_v6e64": dict(topology="v6e:8x8", mesh={"fsdp": 64}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    "fsdp_v6e32": dict(topology="v6e:4x8", mesh={"fsdp": 32}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    "fsdp_v5e64": dict(topology="v5e:8x8", mesh={"fsdp": 64}, layers=2, seq=2048,
                       batch_per_chip=1, mode="train"),
    # 4 sequences per chip: operands too large for VMEM (a ring step's operands are streamed
    # from HBM).
    "fsdp_v6e16_b4": dict(topology="v6e:4x4", mesh={"fsdp": 16}, layers=2, seq=2048,
                          batch_per_chip=4, mode="train"),
    # Which bound stops the windowing: the ring's length (32 windows, 64 not) or the shard's
    # rows (d_model / N >= 128)? A narrower model over 32 chips (64 rows a shard) and a wider
    # one over 64 (LLaMA-3-70B widths: 128 rows) tell them apart.
    "fsdp_v6e32_small": dict(topology="v6e:4x8", mesh={"fsdp": 32}, layers=2, seq=2048,
                             batch_per_chip=1, mode="train", dims="SMALL"),
    "fsdp_v6e64_wide": dict(topology="v6e:8x8", mesh={"fsdp": 64}, layers=2, seq=2048,
                            batch_per_chip=1, mode="train", dims="WIDE"),
    "fsdp_v6e256": dict(topology="v6e:16x16", mesh={"fsdp": 256}, layers=2, seq=2048,
                        batch_per_chip=1, mode="train"),
}
ALL_PROGRAMS = {**CONFIGS, **FORM_PROBES}

# The narrower model of `fsdp_v5e16_small` (xla_memory.py's decoder).
SMALL = xla_compile.SMALL
# LLaMA-3-70B widths (fsdp_v6e64_wide).
WIDE = xla_compile.WIDE

# tpusim option variants tried for each training configuration.
TPUSIM_VARIANTS = {
    "fsdp_v5e16": [[], ["--fsdp-gather", "windowed"], ["--fsdp-gather", "blocking"],
                   ["--remat", "none"]],
    "fsdp_tp_v5p64": [[], ["--tp-activations", "replicated"],
                      ["--tp-activations", "replicated", "--fsdp-gather", "blocking"],
                      ["--tp-activations", "replicated", "--remat", "none"]],
}

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _worker(name: str, dump_dir: str | None) -> None:
    xla_compile.init_jax()
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    cfg = ALL_PROGRAMS[name]
    dims = cfg.get("dims", DIMS)
    if isinstance(dims, str):
        dims = globals()[dims]
    if cfg["mode"] == "moe_train":
        dims = {k: cfg["moe"].get(k, DIMS[k]) for k in DIMS}
    n_layers = cfg["layers"]
    names = tuple(cfg["mesh"])
    shape = tuple(cfg["mesh"].values())
    mesh, devices = xla_compile.build_mesh(cfg["topology"], cfg["mesh"])
    n_chips = devices.size
    # Named scopes (embed, layer{i}, head, adam) attribute each collective to its layer.
    model = xla_compile.Decoder(mesh, dims, scopes=True,
                                param_dtype=cfg.get("param_dtype", "bfloat16"))
    batch = int(cfg["batch_per_chip"] * n_chips)
    if cfg["mode"] == "train":
        tokens = model.sds((batch, cfg["seq"]), P(model.bs, None), jnp.int32)
        lowered = model.lower_train(model.params(n_layers), tokens,
                                    remat=cfg.get("remat", "full"))
    elif cfg["mode"] == "moe_train":
        lowered = xla_compile.lower_moe_train(mesh, seq=cfg["seq"], num_layers=n_layers,
                                              scopes=True, final_norm=cfg.get("final_norm", False),
                                              **cfg["moe"])
    else:  # decode: one new token per sequence against a KV cache of kv_len
        lowered = model.lower_decode(n_layers, batch, cfg["kv_len"],
                                     sampling=cfg.get("sampling", "argmax"),
                                     logits_f32=cfg.get("logits_f32", False))

    compiled = lowered.compile()
    text = compiled.as_text()
    if dump_dir:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        Path(dump_dir, f"{name}.hlo.txt").write_text(text)
    ops = parse_hlo_collectives(text)
    costs = parse_hlo_costs(text)
    mem = compiled.memory_analysis()
    # The mesh's device order lets the caller map replica groups to mesh axes.
    out = {"config": name, "num_chips": n_chips, "ops": ops,
           "mesh_axes": list(names), "mesh_shape": list(shape),
           "mesh_device_ids": [int(dv.id) for dv in devices.flat],
           "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
           "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
           "output_bytes": getattr(mem, "output_size_in_bytes", None),
           "alias_bytes": getattr(mem, "alias_size_in_bytes", None),
           "peak_bytes": getattr(mem, "peak_memory_in_bytes", None),
           "op_costs": costs}
    xla_compile.emit(out)


# --------------------------------------------------------------------------------------------
# Reading the compiled module (workloads.hlo.parser; used by the worker)
# --------------------------------------------------------------------------------------------

_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_CYCLES_RE = re.compile(r'"estimated_cycles":"?(\d+)')
_LAYER_RE = re.compile(r"layer(\d+)")
_COLL_BASE = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter", "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce", "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}


def op_name(ins: Instruction) -> str:
    """The `op_name` of an instruction's metadata ("" without one)."""
    m = _OP_NAME_RE.search(ins.attrs.get("metadata", ""))
    return m.group(1) if m else ""


def estimated_cycles(ins: Instruction) -> int | None:
    """XLA's cost-model estimate in the instruction's backend config (None without one)."""
    m = _CYCLES_RE.search(ins.attrs.get("backend_config", ""))
    return int(m.group(1)) if m else None


def _callee(ins: Instruction, key: str) -> str | None:
    """The computation an attribute such as `body=%b` or `calls=%f` names."""
    return ins.attrs.get(key, "").lstrip("%") or None


def _leaf_bytes(shape: Shape) -> list[int]:
    """Bytes of each array of a shape (one entry for an array, one per leaf of a tuple)."""
    return [leaf.nbytes for leaf in shape.leaves()]


def _int_literal(ins: Instruction) -> int | None:
    """The value of an integer constant (None for anything else)."""
    m = re.match(r"\d+", ins.literal) if ins.opcode == "constant" else None
    return int(m.group(0)) if m else None


def _root(comp: Computation) -> Instruction | None:
    """The instruction marked ROOT (None if none is)."""
    return next((i for i in comp.instructions if i.is_root), None)


def _instructions(module: HloModule, name: str | None) -> tuple[Instruction, ...]:
    comp = module.computations.get(name or "")
    return comp.instructions if comp is not None else ()


def trip_count(module: HloModule, ins: Instruction) -> int:
    """A while loop's trip count: XLA's `known_trip_count`, else read off the condition's
    limit and the induction variable's step (1 if neither can be read)."""
    known = backend_config(ins).get("known_trip_count")
    if isinstance(known, dict) and int(known.get("n", 0) or 0):
        return int(known["n"])
    body = _instructions(module, _callee(ins, "condition"))
    consts = [c for i in body if (c := _int_literal(i)) is not None]
    if not (any(i.attrs.get("direction") == "LT" for i in body) and len(consts) == 1):
        return 1
    limit = consts[0]
    # induction variable: the tuple index the condition compares; its step is the constant
    # added to it in the body (windowed-einsum loops are unrolled by 2, so step is often 2).
    k = next((i.attrs["index"] for i in body
              if i.opcode == "get-tuple-element" and "index" in i.attrs), None)
    step = 1
    bbody = _instructions(module, _callee(ins, "body"))
    params_ = {i.name for i in bbody if i.opcode == "parameter"}
    gtes = {i.name for i in bbody if i.opcode == "get-tuple-element"
            and len(i.operands) == 1 and i.operands[0] in params_
            and i.attrs.get("index") == k}
    # The induction variable may reach its increment through copies (a loop rotated by the
    # scheduler: `add(copy(gte), 2)`); without following them a loop unrolled by 2 would count
    # twice its trips (the MoE program's bidirectional windowed einsums).
    grew = True
    while grew:
        more = {i.name for i in bbody if i.opcode in ("copy", "bitcast")
                and len(i.operands) == 1 and i.operands[0] in gtes}
        grew = not more <= gtes
        gtes |= more
    cvals = {i.name: c for i in bbody if (c := _int_literal(i)) is not None}
    root = next((i for i in bbody if i.is_root and i.opcode == "tuple"), None)
    nxt = None
    if root is not None and k is not None and int(k) < len(root.operands):
        nxt = root.operands[int(k)]
    for i in bbody:
        if i.opcode == "add" and (nxt is None or i.name == nxt):
            if any(r in gtes for r in i.operands):
                c = [cvals[r] for r in i.operands if r in cvals]
                if c:
                    step = c[0]
                    break
    return -(-limit // max(step, 1))


def parse_hlo_collectives(text: str) -> list[dict]:
    """Every collective of a compiled module as the cross-check counts it: kind, whether
    async, executions (loop trip counts applied), bytes (V), layer and phase from its
    `op_name`, the loop it runs in, its replica groups or source-target pairs, its channel."""
    module = parse_hlo(text, source="XLA module")
    comps = module.computations
    shapes = module.shapes
    by_name = {ins.name: ins for comp in comps.values() for ins in comp.instructions}

    def operand_bytes(ins: Instruction) -> list[int]:
        """Bytes of each operand (a tuple-shaped operand: its first array)."""
        return [b for ref in ins.operands for b in _leaf_bytes(shapes[ref])[:1]
                if ref in shapes]

    def first_operand(ins: Instruction | None) -> str:
        return ins.operands[0] if ins is not None and ins.operands else ""

    results: list[dict] = []

    def sliced_all_reduces(comp: str) -> set[str]:
        """All-reduces of a fused computation whose result is only dynamic-sliced by its ROOT:
        TPU's all-reduce-scatter fusion (`SingleInputAllReduceScatterFusion`, a computation
        named `all-reduce-scatter*`), one ring reduce-scatter, not an all-reduce."""
        c = comps.get(comp)
        root = _root(c) if c is not None else None
        if root is None or root.opcode != "dynamic-slice":
            return set()
        src = first_operand(root)
        return {i.name for i in c.instructions if i.opcode == "all-reduce" and i.name == src}

    def padded_scatter_fixup(ins: Instruction) -> bool:
        """A collective-permute of a slice of an all-reduce-scatter fusion's result: XLA pads
        a gradient whose reduce-scatter it splits unevenly (a [4096, 4096] one into 4 x 1040
        rows in the v6e data x fsdp program) and moves each shard's extra rows to its
        neighbour afterwards. It is the tail of that reduce-scatter, counted with it."""
        sl = by_name.get(first_operand(ins))
        if sl is None or sl.opcode != "slice":
            return False
        fu = by_name.get(first_operand(sl))
        called = _callee(fu, "calls") if fu is not None else None
        return bool(fu is not None and fu.opcode == "fusion" and called
                    and sliced_all_reduces(called))

    def ring_role(ins: Instruction) -> str:
        """What an unrolled windowed einsum's collective-permute carries (a ring over few chips
        that XLA writes out step by step instead of a `windowed_dot_general` loop): "rs0", a
        reduce-scatter ring's start (a zero accumulator), "rs", its partial sums (a fusion
        adding a received permute to a partial product, reached through copies and tuple
        elements), or "ag", a gather's weight shards (the weights themselves, or a received
        shard relayed)."""
        seen = set()
        src = first_operand(ins)
        while src in by_name and src not in seen:
            seen.add(src)
            prod = by_name[src]
            op = prod.opcode
            if op == "broadcast":
                return "rs0"  # a reduce-scatter ring's start: a zero accumulator
            if op == "fusion":
                body = _instructions(module, _callee(prod, "calls"))
                received = any(getattr(by_name.get(r), "opcode", None)
                               == "collective-permute-done" for r in prod.operands)
                return "rs" if received and any(i.opcode == "add" for i in body) else "ag"
            if op not in ("copy", "bitcast", "copy-start", "copy-done", "get-tuple-element"):
                return "ag"
            src = first_operand(prod)
        return "ag"

    def visit(comp: str, mult: int, ctx_name: str, loop: str | None, seen: tuple,
              fused: bool = False):
        if comp in seen or comp not in comps:
            return
        scatter = sliced_all_reduces(comp) if fused else set()
        for ins in comps[comp].instructions:
            op = ins.opcode
            name = op_name(ins) or ctx_name
            base = _COLL_BASE.get(op)
            if base == "all-reduce" and ins.name in scatter:
                base = "reduce-scatter"
            fixup = base == "collective-permute" and padded_scatter_fixup(ins)
            role = ring_role(ins) if (
                base == "collective-permute" and not fixup
                and name.endswith("dot_general")
                and not (loop or "").startswith("windowed")) else None
            if base is not None:
                # TPU "async collective fusions" put one collective (one channel_id) into a
                # start fusion plus continuation fusions: count it once (deduplicated below).
                async_ = op.endswith("-start") or fused
                ch = ins.attrs.get("channel_id")
                if base == "all-gather":
                    sizes = _leaf_bytes(ins.shape)
                    nbytes = max(sizes) if sizes else 0
                elif base == "collective-permute":
                    sizes = _leaf_bytes(ins.shape) if async_ else operand_bytes(ins)
                    nbytes = sizes[0] if sizes else 0
                else:
                    nbytes = sum(operand_bytes(ins))
                ml = _LAYER_RE.search(name)
                pairs = source_target_pairs(ins.attrs.get("source_target_pairs", ""))
                results.append(dict(
                    kind=base, async_=async_, count=mult, bytes=nbytes,
                    layer=int(ml.group(1)) if ml else -1,
                    phase="bwd" if "transpose" in name else "fwd",
                    in_loop=loop is not None, loop=loop, op_name=name[-120:],
                    replica_groups=ins.attrs.get("replica_groups", ""),
                    pairs=len(pairs), pair_list=[[a, b] for a, b in pairs],
                    opcode=op, channel=int(ch) if ch and not fixup else None,
                    **({"fixup": True} if fixup else {}),
                    **({"ring": role} if role else {})))
            if op == "async-start":
                # async wrapper around e.g. reduce-scatter: visit the wrapped computation.
                for c in ins.called():
                    visit(c, mult, name, loop, seen + (comp,))
            elif op == "while":
                n = trip_count(module, ins)
                body = _callee(ins, "body")
                if body:
                    tag = ("windowed-ag" if "_ag" in body else
                           "windowed-rs" if "_rs" in body else "loop")
                    visit(body, mult * n, name, f"{tag}:{ins.name}[x{n}]", seen + (comp,))
            elif op in ("call", "conditional", "fusion"):
                for c in ins.called():
                    visit(c, mult, name, loop, seen + (comp,), fused or op == "fusion")
        return

    visit(module.entry, 1, "", None, ())
    # one logical collective per channel_id; keep the occurrence with the smallest multiplier
    # (an async all-gather started outside a loop whose continuation is sunk into it runs once).
    best: dict = {}
    rest = []
    for r in results:
        if r["channel"] is None:
            rest.append(r)
        elif r["channel"] not in best or r["count"] < best[r["channel"]]["count"]:
            best[r["channel"]] = r
    out = rest + list(best.values())
    for r in out:
        if r["count"] == 1:
            r["in_loop"] = False
    return out


def parse_hlo_costs(text: str) -> list[dict]:
    """XLA's own per-op cost: every instruction whose backend config carries
    `estimated_cycles` (XLA's TPU cost model; collectives and custom calls carry none),
    multiplied by the trip counts of the while loops around it, summed per (op_name, the
    op_name of the matmul inside its fusion or "", opcode, the windowed-einsum loop it sits in:
    "windowed-ag" (an all-gather einsum, `_body_ag`), "windowed-rs" (a reduce-scatter one,
    `_body_rs`) or ""): `cycles` (total), `count` (executions) and `instrs` (HLO
    instructions)."""
    module = parse_hlo(text, source="XLA module")
    comps = module.computations

    def matmul_name(comp: str | None, seen: tuple = ()) -> str:
        """The op_name of the first convolution or dot of a fused computation (or of a fusion
        nested in it): which einsum the fusion computes."""
        for ins in _instructions(module, comp):
            if ins.opcode in ("convolution", "dot"):
                return op_name(ins) or "?"
            if ins.opcode == "fusion" and comp not in seen:
                for c in ins.called():
                    found = matmul_name(c, seen + (comp,))
                    if found:
                        return found
        return ""

    acc: dict[tuple, list] = {}

    def visit(comp: str, mult: int, loop: str, seen: tuple) -> None:
        if comp in seen or comp not in comps:
            return
        for ins in comps[comp].instructions:
            cyc = estimated_cycles(ins)
            if cyc is not None:
                if ins.opcode == "fusion":
                    mm = matmul_name(_callee(ins, "calls"))
                else:
                    mm = op_name(ins) or "?" if ins.opcode in ("convolution", "dot") else ""
                a = acc.setdefault((op_name(ins), mm, ins.opcode, loop), [0, 0, 0])
                a[0] += cyc * mult
                a[1] += mult
                a[2] += 1
            body = _callee(ins, "body")
            if ins.opcode == "while" and body:
                tag = loop
                if "windowed_dot_general_body" in body:
                    tag = "windowed-rs" if "_body_rs" in body else "windowed-ag"
                visit(body, mult * trip_count(module, ins), tag, seen + (comp,))
            elif ins.opcode in ("call", "conditional", "async-start"):
                for c in ins.called():
                    visit(c, mult, loop, seen + (comp,))

    visit(module.entry, 1, "", ())
    return [dict(op_name=k[0], matmul=k[1], opcode=k[2], loop=k[3], cycles=v[0], count=v[1],
                 instrs=v[2]) for k, v in sorted(acc.items())]


# --------------------------------------------------------------------------------------------
# tpusim side and comparison (runs under the project python)
# --------------------------------------------------------------------------------------------

def _dims_override(cfg: dict) -> dict:
    """The model widths a configuration changes from LLaMA-3-8B's (`dims`)."""
    dims = cfg.get("dims")
    if dims is None:
        return {}
    dims = globals()[dims] if isinstance(dims, str) else dims
    return {k: v for k, v in dims.items() if DIMS.get(k) != v}


def _chip_and_shape(cfg: dict) -> tuple[str, str]:
    """The chip name and torus shape of a configuration's `topology` ("v5e:4x4")."""
    chip_name, shape = cfg["topology"].split(":")
    return chip_name, shape


def _tpusim_pod(cfg: dict) -> list[str]:
    """tpusim's pod flags for a configuration (derived from its `topology`)."""
    chip_name, shape = _chip_and_shape(cfg)
    return ["--chip", chip_name, "--shape", shape]


def tpusim_collectives(name: str, extra: list[str]) -> list[dict]:
    cfg = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model.yaml")
        model.write_text(f"base: llama3-8b\nname: crosscheck\nnum_layers: {cfg['layers']}\n"
                         + "".join(f"{k}: {v}\n" for k, v in _dims_override(cfg).items()))
        trace = Path(tmp, "x.trace")
        mesh = ",".join(f"{k}={v}" for k, v in cfg["mesh"].items())
        cmd = [sys.executable, "-m", "sim", "compile", "--quiet", *_tpusim_pod(cfg),
               "--model", str(model), "--seq-len", str(cfg["seq"]),
               "--batch-per-chip", str(cfg["batch_per_chip"]), "--mesh", mesh, *extra,
               "-o", str(trace)]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tpusim compile failed: {' '.join(cmd)}\n{r.stderr}")
        d = json.loads(trace.read_text())
    cols = d["columns"]
    out = []
    for row in d["ops"]:
        o = dict(zip(cols, row, strict=True))
        if o["kind"] != "collective":
            continue
        out.append(dict(kind=o["collective"], count=1, bytes=float(o["bytes"]),
                        layer=int(o["layer"]), phase=o["phase"], name=o["name"],
                        axes=",".join(o["mesh_axes"])))
    return out


def run_xla(name: str, jax_python: str, dump_dir: str | None) -> dict:
    """The XLA side of one program: the worker's result plus the dot FLOPs per chip that
    tpusim's HLO importer counts in the compiled module (`xla_dot_flops`)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = dump_dir or tmp
        xr = xla_compile.run_worker("validation.xla_crosscheck", name, jax_python,
                                    ["--dump", where])
        xr["dot_flops"] = xla_dot_flops(name, Path(where, f"{name}.hlo.txt").read_text())
    return xr


def _pod(name: str):
    """(ChipSpec, Topology) of a configuration's TPU topology."""
    chip_name, shape = _chip_and_shape(CONFIGS[name])
    chip = get_chip(chip_name)
    return chip, resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                                  max_pod_shape=chip.max_pod_shape, shape=shape)


def xla_dot_flops(name: str, hlo: str) -> float:
    """MXU FLOPs per chip of a compiled module, as `tpusim import-hlo` counts them (every
    convolution and dot, times its loop trip counts; docs/hlo.md)."""
    trace = import_hlo(hlo, topology=_pod(name)[1], source=name).trace
    return float(sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == "mxu"))


def hlo_fusion_stats(text: str) -> dict:
    """What XLA's cost model assumes per cycle, read off one compiled module (`--analyze`):
    the fastest matmul fusion (MXU FLOPs of its convolutions and dots, nested fusions
    included, over its `estimated_cycles`: `mxu_flops_per_cycle`, `mxu_fusion`), and the
    non-matmul fusions of the windowed reduce-scatter loops (the ring accumulators): their
    operand and result bytes and estimated cycles summed over the instructions (not weighted
    by trip counts: `accum_bytes`, `accum_cycles`) and those of the one moving the most bytes
    (`accum_max`: [bytes, cycles])."""
    m = parse_hlo(text, source="XLA module")

    def shape(comp, name):
        ins = comp.by_name.get(name)
        return ins.shape if ins is not None else m.shapes[name]

    def flops(cname: str, depth: int = 0) -> float:
        comp = m.computations.get(cname)
        if comp is None or depth > 16:
            return 0.0
        total = 0.0
        for ins in comp.instructions:
            if ins.opcode == "dot":
                lhs = shape(comp, ins.operands[0])
                k = 1
                for dim in dot_dims(ins)["lhs_contracting_dims"]:
                    k *= lhs.dims[dim]
                total += 2.0 * ins.shape.num_elements * k
            elif ins.opcode == "convolution":
                total += conv_flops(shape(comp, ins.operands[0]), shape(comp, ins.operands[1]),
                                    ins.shape, ins.attrs.get("dim_labels", ""),
                                    ins.attrs.get("window", ""))
            elif ins.opcode == "fusion":
                total += sum(flops(c, depth + 1) for c in ins.called())
        return total

    best = (0.0, "")
    acc_bytes = acc_cycles = 0
    acc_max = [0, 0]
    for comp in m.computations.values():
        rs_loop = "windowed_dot_general_body_rs" in comp.name
        for ins in comp.instructions:
            cycles = estimated_cycles(ins)
            if ins.opcode != "fusion" or not cycles:
                continue
            f = sum(flops(c) for c in ins.called())
            if f > 0:
                best = max(best, (f / cycles, ins.name))
            elif rs_loop:
                nbytes = ins.shape.nbytes + sum(shape(comp, o).nbytes for o in ins.operands)
                acc_bytes += nbytes
                acc_cycles += cycles
                if nbytes > acc_max[0]:
                    acc_max = [nbytes, cycles]
    return {"mxu_flops_per_cycle": best[0], "mxu_fusion": best[1], "accum_bytes": acc_bytes,
            "accum_cycles": acc_cycles, "accum_max": acc_max}


def analyze(dump_dir: str) -> str:
    """`--analyze DIR`: per compiled module DIR/NAME.hlo.txt of a known program, XLA's fastest
    matmul fusion against the chip's MXU peak per cycle at `XLA_CLOCK_HZ`, and the bytes its
    ring-accumulator fusions move per second at that clock against the chip's HBM bandwidth
    (the checks behind the clocks, docs/validation.md "Per-op costs")."""
    lines = []
    for name in CONFIGS:
        path = Path(dump_dir, f"{name}.hlo.txt")
        if not path.is_file():
            continue
        chip_name = _chip_and_shape(CONFIGS[name])[0]
        chip, clock = get_chip(chip_name), XLA_CLOCK_HZ[chip_name]
        st = hlo_fusion_stats(path.read_text())
        peak = chip.mxu_flops_per_s / clock
        line = (f"{name} ({chip_name} at {clock / 1e9:.3g} GHz): fastest matmul fusion "
                f"{st['mxu_fusion']} {st['mxu_flops_per_cycle']:,.0f} FLOP/cycle = "
                f"{100 * st['mxu_flops_per_cycle'] / peak:.1f}% of {peak:,.0f}")
        if st["accum_cycles"]:
            hbm = chip.hbm_bytes_per_s
            b, c = st["accum_max"]
            line += (f"; ring-accumulator fusions {st['accum_bytes'] / 1e6:,.1f} MB in "
                     f"{st['accum_cycles']:,} cycles = "
                     f"{100 * st['accum_bytes'] * clock / st['accum_cycles'] / hbm:.0f}% of HBM "
                     f"(largest: {b / 1e6:,.1f} MB in {c:,} cycles = "
                     f"{100 * b * clock / c / hbm:.0f}%)")
        lines.append(line)
    return "\n".join(lines) or f"no NAME.hlo.txt of a known program in {dump_dir}"


def gather_forms(text: str) -> dict:
    """How a compiled training step issues its weight gathers and gradient reductions: the
    windowed-einsum loops (`windowed_dot_general_body_ag` / `_rs` computations), and per layer
    (layer 1, away from the embedding and the head) the plain collectives by kind, with how
    many of the all-gathers are async; plus, over the windowed loops, how many of their
    loop-carried bf16 buffers of 16 MiB or more XLA placed in VMEM (`S(1)`) and how many in HBM.
    """
    module = parse_hlo(text, source="XLA module")
    loops = {"ag": 0, "rs": 0}
    big_vmem = big_hbm = 0
    for cname, comp in module.computations.items():
        m = re.search(r"windowed_dot_general_body_(ag|rs)", cname)
        if not m:
            continue
        loops[m.group(1)] += 1
        param = next((i for i in comp.instructions if i.opcode == "parameter"), None)
        if param is None:
            continue
        for leaf in param.shape.leaves():
            if leaf.dtype in ("bf16", "f32") and leaf.nbytes >= 16 * 2**20:
                big_vmem += "S(1)" in leaf.layout
                big_hbm += "S(1)" not in leaf.layout
    per_layer: dict[str, int] = collections.Counter()
    for op in parse_hlo_collectives(text):
        if op["layer"] != 1 or op["in_loop"]:
            continue
        kind = op["kind"]
        per_layer[kind] += op["count"]
        if kind == "all-gather" and op["async_"]:
            per_layer["async all-gather"] += op["count"]
    return {"windowed_ag": loops["ag"], "windowed_rs": loops["rs"],
            "layer1": dict(sorted(per_layer.items())), "big_loop_buffers_vmem": big_vmem,
            "big_loop_buffers_hbm": big_hbm}


def forms(dump_dir: str) -> str:
    """`--forms DIR`: `gather_forms` of each known program compiled into DIR/NAME.hlo.txt."""
    lines = []
    for name, cfg in ALL_PROGRAMS.items():
        path = Path(dump_dir, f"{name}.hlo.txt")
        if not path.is_file() or cfg["mode"] != "train":
            continue
        dims = cfg.get("dims", DIMS)
        dims = globals()[dims] if isinstance(dims, str) else dims
        n = cfg["mesh"].get("fsdp", 1)
        f = gather_forms(path.read_text())
        lines.append(f"{name} ({cfg['topology']}, mesh {cfg['mesh']}, d_model {dims['d_model']}"
                     f" = {dims['d_model'] // n} rows per fsdp shard, "
                     f"{cfg['batch_per_chip'] * cfg['seq']:g} tokens per chip): windowed "
                     f"loops in the step {f['windowed_ag']} gathers + {f['windowed_rs']} "
                     f"reduce-scatters; layer 1 "
                     f"outside them: {f['layer1'] or 'nothing'}; loop buffers >= 16 MiB in "
                     f"VMEM {f['big_loop_buffers_vmem']}, in HBM {f['big_loop_buffers_hbm']}")
    return "\n".join(lines) or f"no NAME.hlo.txt of a known training program in {dump_dir}"


def reparse(name: str, xr: dict, hlo: str) -> dict:
    """A cached XLA side with every field read from the HLO text recomputed from `hlo` (the
    module the worker compiled, kept by `--dump`): collectives, op costs, dot FLOPs."""
    return {**xr, "ops": parse_hlo_collectives(hlo), "op_costs": parse_hlo_costs(hlo),
            "dot_flops": xla_dot_flops(name, hlo)}


def _layer_label(layer: int) -> str:
    return f"L{layer}" if layer >= 0 else "top"


def summarize(ops: list[dict], xla: bool) -> dict:
    """(layer, phase, kind+flavour) -> [count, bytes]"""
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    for o in ops:
        kind = o["kind"]
        if xla:
            flav = (o["loop"].split(":")[0] if o["in_loop"] else
                    ("async" if o["async_"] else "sync"))
            kind = f"{kind} ({flav})"
        key = (_layer_label(o["layer"]), o["phase"], kind)
        acc[key][0] += o["count"]
        acc[key][1] += o["count"] * o["bytes"]
    return acc


def fmt_bytes(b: float) -> str:
    if b == 0:
        return "-"
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= s:
            return f"{b / s:.1f}{unit}"
    return f"{b:.0f}B"


def print_table(title: str, acc: dict) -> None:
    print(f"\n{title}")
    print(f"  {'layer':5} {'phase':5} {'collective':34} {'count':>6} {'total bytes':>12}")
    for key in sorted(acc, key=lambda k: (k[0] == "top", k[0], k[1], k[2])):
        c, b = acc[key]
        print(f"  {key[0]:5} {key[1]:5} {key[2]:34} {c:6d} {fmt_bytes(b):>12}")


def print_side_by_side(sim: dict, xla: dict) -> None:
    """Per layer and collective base kind: tpusim count/bytes vs XLA count/bytes."""
    def by_kind(acc):
        out = collections.defaultdict(lambda: [0, 0.0])
        for (layer, _phase, kind), (c, b) in acc.items():
            out[(layer, kind.split(" (")[0])][0] += c
            out[(layer, kind.split(" (")[0])][1] += b
        return out
    s, x = by_kind(sim), by_kind(xla)
    print(f"  {'layer':5} {'collective':20} {'tpusim n':>9} {'tpusim V':>10} "
          f"{'XLA n':>7} {'XLA bytes':>10}")
    for key in sorted(set(s) | set(x), key=lambda k: (k[0] == "top", k)):
        sc, sb = s.get(key, (0, 0.0))
        xc, xb = x.get(key, (0, 0.0))
        print(f"  {key[0]:5} {key[1]:20} {sc:9d} {fmt_bytes(sb):>10} {xc:7d} {fmt_bytes(xb):>10}")


# --------------------------------------------------------------------------------------------
# Bytes by logical kind and mesh axis (docs/validation.md; runs under the project python)
# --------------------------------------------------------------------------------------------

# Cached XLA results (`--json` output of the XLA side), so the doc regenerates without jax.
RESULTS_FILE = xla_compile.RESULTS / "xla_collectives.json"
# The tpusim flags that mirror each XLA program like-for-like: the program keeps the residual
# stream replicated over `tensor` (Megatron style), which is `--tp-activations replicated`.
LIKE_FOR_LIKE = {
    "fsdp_v5e16": {"fsdp_gather": "mixed-async"},
    "fsdp_v5e16_small": {"fsdp_gather": "mixed-async"},
    "fsdp_v6e16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_v5e16_f32": {"fsdp_gather": "mixed-async", "param_dtype": "fp32",
                       "gather_dtype": "bf16"},
    "fsdp_v6e16_f32": {"fsdp_gather": "mixed-blocking", "param_dtype": "fp32",
                       "gather_dtype": "bf16"},
    "data_fsdp_v6e16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_v5p16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_tp_v5p64": {"tp_activations": "replicated", "fsdp_gather": "mixed-blocking"},
    "moe_fsdp_ep_v6e16": {"fsdp_gather": "mixed-blocking"},
}


def _device_coords(xr: dict) -> dict[int, tuple[int, ...]]:
    """Device id -> its coordinates on the program's mesh (row-major over the mesh shape)."""
    shape = xr["mesh_shape"]
    coords = itertools.product(*(range(n) for n in shape))
    return {int(d): c for d, c in zip(xr["mesh_device_ids"], coords, strict=True)}


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """HLO `replica_groups=` as device-id lists (`tpusim import-hlo`'s reader: explicit
    `{{0,1},{2,3}}`, iota `[G,S]<=[d0,d1]T(1,0)`, mesh `mesh['axis_0'=16,'axis_1'=4]
    {'axis_0'}` with or without `device_ids=(...)`, or empty / `{}`: one group of every
    device)."""
    return replica_groups(text.strip() or "{}", num_devices)


def _axes_spanned(xr: dict, sets: list[list[int]]) -> str:
    """The mesh axes along which the members of each set differ (union over the sets)."""
    coords = _device_coords(xr)
    names = xr["mesh_axes"]
    spanned = set()
    for members in sets:
        cs = [coords[d] for d in members if d in coords]
        for k, name in enumerate(names):
            if len({c[k] for c in cs}) > 1:
                spanned.add(name)
    return ",".join(a for a in names if a in spanned) or "-"


def _xla_logical_ops(xr: dict):
    """(logical kind, mesh axes, bytes, collectives) per collective of an XLA program, bytes in
    tpusim's V convention (`xla_logical_bytes`), collectives as `xla_logical_counts` counts
    them."""
    n = xr["num_chips"]
    sizes = dict(zip(xr["mesh_axes"], xr["mesh_shape"], strict=True))
    loops: dict[tuple, list[str]] = collections.defaultdict(list)
    seen_loops = set()
    for o in xr["ops"]:
        if o["kind"] == "collective-permute" and o["in_loop"]:
            tag = o["loop"].split(":")[0]
            kind = {"windowed-ag": "all-gather", "windowed-rs": "reduce-scatter"}.get(tag)
            key = (o["layer"], o["phase"], o["bytes"])
            if kind and (key, o["loop"]) not in seen_loops:
                seen_loops.add((key, o["loop"]))
                loops[key].append(kind)
    for kinds in loops.values():
        kinds.sort()  # "all-gather" < "reduce-scatter"
    counted_loops = set()
    for o in xr["ops"]:
        if o.get("fixup"):  # a padded reduce-scatter's row moves (parse_hlo_collectives)
            yield "reduce-scatter", _axes_spanned(xr, o["pair_list"]), o["count"] * o["bytes"], 0
            continue
        calls = o["count"]
        if o["kind"] == "collective-permute":
            axes = _axes_spanned(xr, o.get("pair_list") or [])
            tag = o["loop"].split(":")[0] if o["in_loop"] else ""
            if tag.startswith("windowed"):
                kind = {"windowed-ag": "all-gather", "windowed-rs": "reduce-scatter"}[tag]
                # The ring is one collective per run of its loop (count = runs x trips).
                trips = int(re.search(r"\[x(\d+)\]", o["loop"]).group(1))
                calls = 0 if o["loop"] in counted_loops else o["count"] // trips
                counted_loops.add(o["loop"])
            else:
                # A prologue is issued before its loop (inside a scanned layer's loop body
                # when the layers are scanned).
                pending = loops.get((o["layer"], o["phase"], o["bytes"]))
                role = o.get("ring", "")
                if pending:
                    kind, calls = pending.pop(0), 0
                elif role == "ag":  # a written-out gather ring: N - 1 messages
                    group = 1
                    for a in axes.split(","):
                        group *= sizes.get(a, 1)
                    kind, calls = "all-gather", o["count"] / max(group - 1, 1)
                elif role in ("rs", "rs0"):  # a reduce-scatter ring starts from zeros each way
                    kind, calls = "reduce-scatter", o["count"] / 2 if role == "rs0" else 0
                else:
                    kind = "collective-permute"
        else:
            kind = o["kind"]
            groups = parse_replica_groups(o.get("replica_groups", ""), n)
            axes = _axes_spanned(xr, groups)
            if kind == "all-to-all":  # the HLO operand is one chip's buffer; V is the group's
                o = dict(o, bytes=o["bytes"] * len(groups[0]))
        yield kind, axes, o["count"] * o["bytes"], calls


def xla_logical_bytes(xr: dict) -> dict[tuple[str, str], float]:
    """(logical kind, mesh axes) -> bytes of an XLA program, tpusim's V convention.

    A windowed einsum's ring is the all-gather (loop `_ag`) or reduce-scatter (`_rs`) it
    decomposes: its per-chip messages over the N ring steps sum to the V of that collective.
    Each ring's first step is issued before the loop as one async collective-permute of the
    same message size (N + 1 messages in all); the prologues of a layer and phase are handed
    to its loops of that message size one each (all-gather loops first: a layer's backward
    holds both kinds with equal messages); in a scanned program they sit in the scan's loop
    body. Permutes matched to no loop are the steps of an unrolled ring (a windowed einsum over
    few chips written out step by step) when `parse_hlo_collectives` gave them a `ring` role
    (gather or reduce-scatter), else collective-permutes.
    """
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for kind, axes, nbytes, _calls in _xla_logical_ops(xr):
        out[(kind, axes)] += nbytes
    return dict(out)


def xla_logical_counts(xr: dict) -> dict[tuple[str, str], float]:
    """(logical kind, mesh axes) -> collectives per step of an XLA program: each collective
    instruction once per execution, except a windowed einsum's ring, which is one collective
    (its loop once per run, its prologue none; a written-out gather ring per N - 1 messages, a
    written-out reduce-scatter ring per zero start each way), and a padded reduce-scatter's
    fix-up permute (part of it)."""
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for kind, axes, _nbytes, calls in _xla_logical_ops(xr):
        out[(kind, axes)] += calls
    return dict(out)


def tpusim_trace(name: str):
    """tpusim's compiled step for the same program (the config's model widths, mesh, batch,
    sequence or context length, remat full, dot attention and the like-for-like flags)."""


    cfg = CONFIGS[name]
    mesh = parse_mesh(",".join(f"{k}={v}" for k, v in cfg["mesh"].items()))
    chips = 1
    for v in cfg["mesh"].values():
        chips *= v
    if cfg["mode"] == "decode":
        model = dataclasses.replace(load_model("llama3-8b"), num_layers=cfg["layers"],
                                    **_dims_override(cfg))
        # The program's new token attends to the kv_len cached tokens and to itself: tpusim's
        # context (the tokens a decode step attends to) is kv_len + 1.
        dc = DecodeConfig(batch=int(cfg["batch_per_chip"] * chips),
                          context_len=cfg["kv_len"] + 1,
                          sampling="greedy" if cfg.get("sampling") == "argmax" else "top-k")
        return compile_decode_step(model, mesh, chips, dc)
    moe = {}
    if cfg["mode"] == "moe_train":
        m = cfg["moe"]
        model = model_from_dict(xla_compile.tpusim_model_dict(
            dict(d_model=m["d_model"], num_heads=m["num_heads"], num_kv_heads=m["num_heads"],
                 head_dim=m["head_dim"], d_ff=m["d_ff"], vocab_size=m["vocab_size"],
                 num_experts=m["num_experts"], experts_per_token=m["top_k"],
                 moe_d_ff=m["d_ff"]), cfg["layers"], name))
        moe = {"moe": MoeConfig(capacity_factor=m["capacity_factor"])}
    else:
        model = dataclasses.replace(load_model("llama3-8b"), num_layers=cfg["layers"],
                                    **_dims_override(cfg))
    tc = TrainingConfig(seq_len=cfg["seq"], batch_per_chip=cfg["batch_per_chip"],
                        remat=Remat.FULL, attention="dot", **LIKE_FOR_LIKE.get(name, {}), **moe)
    return compile_training_step(model, mesh, chips, tc)


def tpusim_dot_flops(name: str) -> float:
    """MXU FLOPs per chip of tpusim's compiled step for the same program."""
    return float(sum(o.flops for o in tpusim_trace(name).ops
                     if o.kind == "compute" and o.unit == "mxu"))


def tpusim_logical_bytes(name: str) -> dict[tuple[str, str], float]:
    """(kind, mesh axes) -> V bytes of tpusim's compiled step for the same program."""
    return tpusim_logical(name)[0]


def tpusim_logical(name: str) -> tuple[dict, dict]:
    """(kind, mesh axes) -> (V bytes, collectives) of tpusim's compiled step."""
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: dict[tuple[str, str], int] = collections.defaultdict(int)
    for o in tpusim_trace(name).ops:
        if o.kind == "collective":
            out[(o.collective, ",".join(o.mesh_axes))] += o.bytes
            calls[(o.collective, ",".join(o.mesh_axes))] += 1
    return dict(out), dict(calls)


# --------------------------------------------------------------------------------------------
# Per-op costs: XLA's estimated cycles against tpusim's costed ops, per op class
# --------------------------------------------------------------------------------------------

# XLA's estimated cycles -> seconds at the chip's clock. Check: at these clocks XLA's estimate
# for the step's largest matmul (the logits) is 96-98% of the chip's MXU peak on v5e and v5p
# (docs/validation.md), i.e. XLA counts cycles of the whole chip (both megacore cores on v5p).
XLA_CLOCK_HZ = {
    "v5e": 1.5e9,   # docs/reference/tpu.md §1.2 (MXU row: 5e13 FLOP/s per MXU at 1.5 GHz)
    "v5p": 1.75e9,  # docs/reference/tpu.md §1.2 (VPU row: "v5p clock ≈ 1.75 GHz")
    # Derived from cited numbers (no reference states it): 918e12 FLOP/s (maxtext.md §5;
    # tpu.md §1.1: 9.2e14) / (1 TensorCore (sim/hardware.py's v6e: Google Cloud's v6e page)
    # x 4 MXUs per core (tpu.md §1.2, scalar-core row: "drives the VPU, 4 MXUs") x 256 x 256
    # (tpu.md §1.2, v6e's arrays) x 2 FLOP) = 1.751e9. Corroborated by Google's Trillium
    # announcement (May 2024: 4.7x v5e's peak per chip from "expanding the size of matrix
    # multiply units (MXUs) and increasing the clock speed": 1.5 GHz x 918 / 197 / 4 = 1.75 GHz
    # with 4x the MACs per array; twice the arrays would mean a lower clock, 0.875 GHz) and by
    # XLA's own estimates (OP_COSTS_EXPLAIN): identical HBM-bound fusions come out at the same
    # fraction of each chip's HBM bandwidth on v5e, v5p and v6e at these clocks.
    "v6e": 1.75e9,
}

OP_CLASSES = ("layer matmuls", "attention matmuls", "softmax and mask", "norms",
              "other elementwise", "windowed-einsum accumulators", "MoE router",
              "MoE dispatch and combine", "embedding, logits and loss", "optimizer update",
              "unattributed", "collectives")
_ATTN_EINSUMS = ("bskgd,btkd->bkgst", "bkgst,btkd->bskgd", "bshd,bthd->bhst", "bhst,bthd->bshd")
_DISPATCH_EINSUMS = ("bsm,bsec->ebcm", "ebcm,bsec->bsm")


def xla_op_class(op_name: str, matmul: str, loop: str = "") -> str:
    """The class of one XLA instruction from its op_name, that of the matmul in its fusion
    ("" if none) and its loop ("windowed-ag" / "windowed-rs" in a windowed einsum): named
    scopes of `xla_compile.Decoder` / `lower_moe_train` (layer{i}, norm, attention, router, embed,
    head, adam / sgd) and the einsum it computes. Every fusion of a windowed reduce-scatter
    loop but its matmuls works on the ring's accumulators (a select zeroing them, without an
    op_name, and the add of each step's partial product, named after the dot), whichever
    matrix it is; in an all-gather loop the named ones copy output slices into place."""
    both = op_name + " " + matmul
    if not matmul and (loop == "windowed-rs" or (loop.startswith("windowed") and not op_name)):
        return "windowed-einsum accumulators"
    if not op_name and not matmul:
        return "unattributed"
    if re.search(r"(^|/)(adam|sgd)(/|$)", op_name):
        return "optimizer update"
    if re.search(r"\b(head|embed)\b", both):
        return "embedding, logits and loss"
    if matmul:
        if "/attention/" in matmul or any(e in matmul for e in _ATTN_EINSUMS):
            return "attention matmuls"
        if any(e in matmul for e in _DISPATCH_EINSUMS):
            return "MoE dispatch and combine"
        return "MoE router" if "/router/" in matmul else "layer matmuls"
    if "/attention/" in op_name:
        return "softmax and mask"
    if "/router/" in op_name:
        return "MoE router"
    if "/norm/" in op_name:
        return "norms"
    return "other elementwise"


def tpusim_op_class(op) -> str:
    """The class of one op of tpusim's compiled step (by its name, unit and layer)."""
    if op.kind == "collective":
        return "collectives"
    name = op.name[3:] if op.name.startswith("re-") else op.name
    if name.startswith("adam"):
        return "optimizer update"
    if name.endswith("_accum"):
        return "windowed-einsum accumulators"
    if op.layer < 0:
        return "embedding, logits and loss"
    if name.startswith(("attn_scores", "attn_values", "attn_bwd")) or name == "attention":
        return "attention matmuls"
    if name.startswith("softmax"):
        return "softmax and mask"
    if name.startswith("norm_"):
        return "norms"
    if name.startswith(("router", "topk_route", "moe_masks")):
        return "MoE router"
    if name.startswith(("moe_dispatch", "moe_combine")):
        return "MoE dispatch and combine"
    return "layer matmuls" if op.unit == "mxu" else "other elementwise"


def xla_class_seconds(xr: dict, chip: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for c in xr.get("op_costs", []):
        out[xla_op_class(c["op_name"], c["matmul"], c.get("loop", ""))] += \
            c["cycles"] / XLA_CLOCK_HZ[chip]
    return dict(out)


def tpusim_class_seconds(name: str) -> tuple[dict[str, float], float, float]:
    """Per class, the summed time of tpusim's ops (compute ops at their cost alone on the chip,
    `sim.engine.compute_op_times` plus the per-op overhead, like XLA's per-op estimates;
    collectives as simulated in the replay), the replay's step time, and the summed replay
    durations of the compute ops (longer where their HBM traffic shares the bandwidth with
    collective DMA)."""
    chip, topo = _pod(name)
    trace = tpusim_trace(name)
    res = replay(trace, chip, topo)
    dur = {int(i): e - s for i, s, e in zip(res.ops["op_id"], res.ops["start_s"], res.ops["end_s"],
                                           strict=True)}
    out: dict[str, float] = collections.defaultdict(float)
    replayed = 0.0
    for op in trace.ops:
        if op.kind == OpKind.COMPUTE:
            out[tpusim_op_class(op)] += max(compute_op_times(chip, op)) + chip.op_overhead_s
            replayed += dur[op.id]
        else:
            out[tpusim_op_class(op)] += dur[op.id]
    return dict(out), res.step_time_s, replayed


def logical_table(name: str, xr: dict) -> tuple[list[tuple], list[float]]:
    """Rows (kind, axes, XLA bytes, tpusim bytes, error or None, XLA collectives, tpusim
    collectives) and the byte errors of the rows both programs have."""
    x, xc_ = xla_logical_bytes(xr), xla_logical_counts(xr)
    t, tc = tpusim_logical(name)
    rows, errs = [], []
    for key in sorted(set(x) | set(t)):
        xb, tb = x.get(key, 0.0), t.get(key, 0.0)
        err = (tb - xb) / xb if xb > 0 else None
        if err is not None:
            errs.append(err)
        rows.append((*key, xb, tb, err, xc_.get(key, 0), tc.get(key, 0)))
    return rows, errs


WIDER_SET_NOTES = """What the wider set showed (read off their HLO; docs/model.md "Collectives as
XLA emits them" has each rule):

* **data_fsdp_v6e16** (v6e, data=4 x fsdp=4): with the weights replicated over data XLA builds
  no windowed einsum, so tpusim's mixed modes issue plain gathers and reduce-scatters there.
  XLA's gradient reduce-scatters are TPU all-reduce-scatter fusions (an all-reduce whose result
  the fusion only dynamic-slices: one ring reduce-scatter); the parser read them as
  all-reduces of whole gradients until this session (the 100% miss of before). One gradient
  ([4096, 4096]) is padded to 4 x 1040 rows and its extra rows moved to the next shard by a
  collective-permute, counted with its reduce-scatter (padding and permutes: 1.75 MiB, 0.1%,
  not modelled by tpusim). The lookup's gradient is all-gathered over data x fsdp (256 MiB of
  rows, smaller than the 1002 MiB table; with a smaller table XLA all-reduces the table
  instead) rather than all-to-all'ed, and the norm scales' gradients are all-reduced over
  data x fsdp at once.
* **moe_fsdp_ep_v6e16**: the program shards as MaxText's logical-axis rules do (every
  non-expert weight's d_model over fsdp x expert, the experts' over fsdp, their `exp`
  dimension over expert, tokens over fsdp x expert) and now has the final norm MaxText's
  decoder (and tpusim's model) has before the output projection. Three readings of the HLO
  were wrong: the windowed rings' trip counts (the loop counter steps through a copy: every
  ring was counted twice), their prologues (issued inside the scanned layer's body, so left
  as collective-permutes), and the expert weights' rings over fsdp = 4, which XLA writes out
  step by step in the layer's body (read as collective-permutes; now as gather or
  reduce-scatter steps by what they send). tpusim's side: such a 4-chip ring gathers N - 1
  shards and the up projection's gradient shares the gate's ring start (13 reduce-scatter
  messages per layer, as compiled); an MoE layer gathers all four attention matrices again
  for their input gradients; the router's backward matmuls (its dot FLOPs were 0.012% short).
  Left: tpusim gathers the token ids over fsdp x expert for the lookup's gradient too, which
  this program does not (0.125 MiB, +0.2% of the fsdp,expert gathers).
* **decode_tp8_v5e8**, **decode_topk_tp8_v5e8** (f32 logits, as tpusim's decode has them and
  as we read MaxText's `cast_logits_to_fp32` default, which the references do not cover): the
  embedding lookup's all-reduce over `tensor`
  and the sampling collectives of `--sampling greedy` (two tiny all-gathers) and `top-k`
  (all-to-alls of the logits and their indices into whole rows for XLA's sort and back, the
  64 best spread from the first shard by collective-permutes, an all-gather and an all-reduce
  for the draw). The new token also attends to itself: tpusim's context is KV cache + 1."""


def _mode_label(cfg: dict) -> str:
    """What a program heading says beyond the dense training step's widths."""
    if cfg["mode"] == "decode":
        pick = {"argmax": "argmax", "top-k": "top-64 draw"}[cfg.get("sampling", "argmax")]
        dt = "f32" if cfg.get("logits_f32") else "bf16"
        return f", decode step (KV cache {cfg['kv_len']}, {pick} of the {dt} logits)"
    if cfg["mode"] == "moe_train":
        m = cfg["moe"]
        return (f", MoE train step (d_model {m['d_model']}, {m['num_experts']} experts of d_ff "
                f"{m['d_ff']}, top-{m['top_k']}, capacity factor {m['capacity_factor']}, "
                f"{m['num_heads']} heads, vocab {m['vocab_size']}, SGD)")
    if cfg.get("param_dtype") == "float32":
        return (", f32 weights cast to bf16 in each layer (tpusim `--param-dtype fp32 "
                "--gather-dtype bf16`)")
    return ""


def render_collectives_section(results: dict) -> str:
    """The docs/validation.md section: per program, bytes by kind and axis, XLA vs tpusim."""
    def mib(b: float) -> str:
        if not b:
            return "-"
        return f"{b / 2**20:,.1f}" if b >= 2**20 else f"{b / 2**20:.4f}"

    lines = ["## Collective bytes against XLA's compiled programs", "",
             "_Generated by `python -m validation.maxtext --write` (or `--write-collectives`) "
             "from the cached XLA side "
             "(`validation/results/xla_collectives.json`, written by "
             "`python -m validation.xla_crosscheck --json`; refresh it with jax[tpu]) and "
             "tpusim's compiled step with like-for-like "
             "flags (remat full, the program's mesh and batch, `--tp-activations replicated` "
             "where the program replicates the residual over `tensor`, and the gather forms "
             "XLA picks by itself: `--fsdp-gather mixed-async` on v5e, "
             "`mixed-blocking` on v5p and v6e)._", "",
             "Bytes are V per replica group in MiB, summed over the step (tpusim's convention; "
             "docs/xla_crosscheck.md). XLA's windowed-einsum rings are counted as the all-gather "
             "or reduce-scatter they decompose (their N + 1 per-step messages, prologue "
             "included, sum to (N + 1) / N of its V, which tpusim's windowed collectives carry "
             "too); axes are the mesh axes a replica group or a permute's chip pairs span. "
             "Error = (tpusim - XLA) / XLA; `-100%` is a collective tpusim does not emit, `new` "
             "one XLA does not. Target (issue 11): within 3% for every kind and axis. n: "
             "collectives per step (`xla_logical_counts`: XLA's instructions once per "
             "execution, a windowed ring one collective, its loop counted once per run and its "
             "prologue not at all, a written-out ring per N - 1 gather messages or per zero "
             "start each way; tpusim's collective ops). Counts are reported, not targeted: "
             "XLA merges some collectives (one ring for the gate and up gradients of a "
             "written-out ring, combined all-reduces of several gradients).", ""]
    all_errs: list[float] = []
    base_errs: list[float] = []
    names: list[str] = []
    base_names: list[str] = []
    for name in sorted(results):
        xr = results[name].get("xla")
        if not xr or "mesh_device_ids" not in xr:
            continue
        cfg = CONFIGS[name]
        rows, errs = logical_table(name, xr)
        all_errs += errs
        names.append(name)
        if cfg["mode"] == "train" and "data" not in cfg["mesh"]:
            base_errs += errs
            base_names.append(name)
        widths = _dims_override(cfg)
        lines += [f"### {name}: {cfg['topology']}, mesh "
                  + ", ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
                  + f", {cfg['layers']} layers, seq {cfg['seq']}, batch/chip "
                  f"{cfg['batch_per_chip']}"
                  + ("".join(f", {k} {v}" for k, v in widths.items()) if widths else "")
                  + _mode_label(cfg), "",
                  "| kind | axes | XLA MiB | tpusim MiB | error | XLA n | tpusim n |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for kind, axes, xb, tb, err, xn, tn in rows:
            e = "new" if err is None else f"{100 * err:+.1f}%"
            xn_ = f"{xn:g}" if xn == int(xn) else f"{xn:.1f}"
            lines.append(f"| {kind} | {axes} | {mib(xb)} | {mib(tb)} | {e} | {xn_ or '-'} | "
                         f"{tn or '-'} |")
        if errs:
            lines += ["", f"Median |error| {100 * statistics.median(abs(e) for e in errs):.1f}%, "
                      f"worst {100 * max(abs(e) for e in errs):.1f}% over the {len(errs)} "
                      f"kinds and axes XLA emits.", ""]
        if xr.get("dot_flops"):
            xd, td = xr["dot_flops"], tpusim_dot_flops(name)
            lines += [f"Dot FLOPs per chip: XLA {xd / 1e12:.6f} TFLOP, tpusim {td / 1e12:.6f} "
                      + ("(exact)." if xd == td else f"({100 * (td - xd) / xd:+.3f}%)."), ""]
    if any(CONFIGS[n]["mode"] != "train" or "data" in CONFIGS[n]["mesh"] for n in names):
        lines += [WIDER_SET_NOTES, ""]
    missing = [n for n in CONFIGS if n not in results]
    if missing:
        lines += ["In `CONFIGS` but not compiled yet (`--json` compiles them): "
                  + ", ".join(missing) + ".", ""]
    for label, errs in ((f"Dense fsdp and fsdp x tensor training ({len(base_names)} programs: "
                         f"{', '.join(base_names)})", base_errs),
                        (f"All {len(names)} programs", all_errs)):
        if errs:
            med = statistics.median(abs(e) for e in errs)
            worst = max(abs(e) for e in errs)
            lines += [f"{label}: median |error| {100 * med:.1f}%, worst {100 * worst:.1f}% "
                      f"(target 3%: **{'met' if worst <= 0.03 else 'NOT met'}**).", ""]
    return "\n".join(lines)


def op_cost_rows(name: str, xr: dict) -> tuple[list[tuple], float, float]:
    """Rows (class, XLA s or None, tpusim s) of one program in OP_CLASSES order (classes
    neither side has are left out; XLA has no estimate for collectives), tpusim's step and its
    compute ops' summed replay durations."""
    chip = CONFIGS[name]["topology"].split(":")[0]
    x = xla_class_seconds(xr, chip)
    t, step, replayed = tpusim_class_seconds(name)
    rows = [(k, None if k == "collectives" else x.get(k, 0.0), t.get(k, 0.0))
            for k in OP_CLASSES if x.get(k) or t.get(k)]
    return rows, step, replayed


def render_op_costs_section(results: dict) -> str:
    """The docs/validation.md section: per program and op class, XLA's estimated time against
    tpusim's costed time."""
    def ms(v: float | None) -> str:
        return "no estimate" if v is None else ("-" if not v else f"{v * 1e3:.2f}")

    def ratio(x: float | None, t: float) -> str:
        return f"{t / x:.2f}" if x and t else "-"

    lines = ["## Per-op costs: XLA's estimates against tpusim", "",
             "_Generated with the collective-bytes section above, from the same cache "
             "(`op_costs`: every instruction's `estimated_cycles` as `xla_crosscheck.py`'s "
             "worker reads them from the compiled HLO)._", "",
             "XLA's TPU compiler puts its own cost estimate on every instruction it schedules "
             "(`estimated_cycles` in the backend config; collectives and custom calls carry "
             "none). Summed per op class (instructions in a loop times its trip count) "
             "and converted at the chip's clock (v5e 1.5 GHz, v5p and v6e 1.75 GHz; "
             "`XLA_CLOCK_HZ`), against the summed costs of tpusim's ops of the same class in "
             "the same step (a compute op alone on the chip, as XLA estimates it: FLOPs at the "
             "fitted MXU/VPU rate or bytes at the HBM rate, whichever takes longer, plus the "
             "per-op overhead; collectives as simulated in the replay, most of them overlapped "
             "with compute). An XLA instruction's class comes "
             "from the named scope of its op_name (`layer{i}/norm`, `layer{i}/attention`, "
             "`router`, `embed`, `head`, `adam`) and the einsum of the matmul in its fusion; "
             "a fusion that holds a matmul counts as that matmul. tpusim is not tuned to these "
             "estimates: they are XLA's model, not measurements.", ""]
    totals: list[tuple[str, float, float]] = []
    accum: list[str] = []
    accum_only_tpusim: list[str] = []
    stretch: list[tuple[float, str, float, float]] = []  # replay / alone, name, replay, alone
    for name in sorted(results):
        xr = results[name].get("xla")
        if not xr or not xr.get("op_costs"):
            continue
        cfg = CONFIGS[name]
        rows, step, replayed = op_cost_rows(name, xr)
        lines += [f"### {name}: {cfg['topology']}, mesh "
                  + ", ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
                  + f", {cfg['mode'].replace('_', ' ')}", "",
                  "| op class | XLA estimate ms | tpusim ms | tpusim / XLA |",
                  "|---|---:|---:|---:|"]
        xt = tt = 0.0
        for k, xv, tv in rows:
            lines.append(f"| {k} | {ms(xv)} | {ms(tv)} | {ratio(xv, tv)} |")
            if k != "collectives":
                xt += xv or 0.0
                tt += tv
        lines += [f"| **compute, all classes** | **{ms(xt)}** | **{ms(tt)}** | "
                  f"**{ratio(xt, tt)}** |", "",
                  f"tpusim's step (replay, collectives overlapped): {step * 1e3:.2f} ms; its "
                  f"compute ops take {replayed * 1e3:.2f} ms there.", ""]
        totals.append((name, xt, tt))
        stretch.append((replayed / tt if tt else 1.0, name, replayed, tt))
        by_class = {k: (xv, tv) for k, xv, tv in rows}
        xa, ta = by_class.get("windowed-einsum accumulators", (0.0, 0.0))
        if xa:
            accum.append(f"{name} {100 * xa / xt:.1f}%")
        elif ta:
            accum_only_tpusim.append(name)
    if totals:

        v5e_mxu = get_chip("v5e").mxu_efficiency
        worst = max(stretch)
        lines += ["Compute totals, tpusim / XLA: " + ", ".join(
            f"{n} {t / x:.2f}" for n, x, t in totals) + ".", "", OP_COSTS_EXPLAIN.format(
                v5e_mxu=v5e_mxu, v6e_mxu=get_chip("v6e").mxu_efficiency, v5e_inv=1 / v5e_mxu,
                accum=", ".join(accum) or "none of these programs",
                stretch=f"{worst[1]}: {worst[2] * 1e3:.2f} ms against {worst[3] * 1e3:.2f} ms",
                accum_only_tpusim=(
                    " " + ", ".join(accum_only_tpusim) + ": XLA has no windowed loops there, "
                    "tpusim's like-for-like form still reduce-scatters through windowed rings, "
                    "with their accumulators." if accum_only_tpusim else "")), ""]
    return "\n".join(lines)


OP_COSTS_EXPLAIN = """What the tables say:

* **Matmuls.** tpusim costs a matmul at the fitted MXU efficiency ({v5e_mxu:g} of peak on v5e
  and v5p, {v6e_mxu:g} on v6e; fitted on measured MaxText step times, above) or at its HBM bytes if
  those take longer; XLA's model costs the large matmuls near the MXU peak: at the clocks
  above its estimate for the logits matmul is 97-98% of the peak on v5e and v5p (its fastest
  fusions: 128,302 FLOP per cycle on v5e, 97.9% of 4 MXUs x 128 x 128 x 2; 256,468 on v5p,
  97.8% of twice that). The fitted efficiency alone makes tpusim's compute-bound matmuls
  1/{v5e_mxu:g} = {v5e_inv:.2f}x XLA's estimate on v5e; it is fitted on measured steps, which
  XLA's static estimate does not see, and is not re-tuned to XLA here. XLA's model also charges the
  per-step accumulation of a windowed all-gather einsum that contracts the gathered dimension
  (q, k, v, gate, up forward): on v5e those loops' matmul fusions are estimated at 1.39-2.29x
  their FLOPs at peak, the other windowed loops' at 1.04-1.24x. tpusim charges that partial
  sum one output's worth of HBM traffic per ring step, and the output-gathered and
  reduce-scatter rings' whole operands one read per two steps (docs/model.md, "A windowed
  einsum"), all in HBM, where XLA keeps some of these buffers in VMEM at these sizes. The
  other differences between the matmul rows (v5p's tensor-split matmuls, v6e, the MoE
  experts) are not analysed yet.
* **The v6e clock** (1.75 GHz, `XLA_CLOCK_HZ`) is derived, not read off a reference: 918
  TFLOP/s (MaxText's peak; tpu.md's 9.2e14) over one TensorCore (Google Cloud's v6e page, as
  `sim/hardware.py` records) of 4 MXUs (tpu.md §1.2: the scalar core "drives the VPU, 4
  MXUs") of 256 x 256 x 2 FLOP per cycle (tpu.md §1.2) = 1.751 GHz. Google's Trillium
  announcement agrees (4.7x v5e's peak from larger MXUs and a higher clock: 1.5 GHz x 918 /
  197 / 4 = 1.75 GHz; twice the arrays would mean 0.875 GHz, a lower clock). XLA's estimates
  agree on its HBM side: the output projection's windowed-ring
  accumulator fusions have the same shapes in every fsdp=16 program, and at these clocks the
  select (131 MB moved) runs at 41% of v5e's HBM bandwidth, 36% of v5p's and 41% of v6e's,
  the add (394 MB) at 61%, 54% and 68%; at 0.875 GHz v6e's would be half of that
  (`xla_crosscheck.py --analyze DIR` prints these rates from the `--dump` modules). On its MXU
  side they do not: XLA's v6e model gives some matmul fusions 838,861 FLOP per cycle (a
  [2048, 4096] x [4096, 4096] matmul from VMEM in 81,920 cycles), 1.6x the 524,288 of 4
  arrays; most large v6e matmuls come out at 450,000-490,000 (86-94%) and the logits at 63%
  and 89%. So XLA's v6e model does not bound every matmul by the 918 TFLOP/s peak at this
  clock; the v6e matmul rows carry that uncertainty.
* **Attention.** tpusim costs dot attention's score and P.V matmuls by their bytes (f32 scores
  written and read back, HBM-bound at these sizes). XLA's estimate for its attention matmul
  fusions is 2.4-3.1x tpusim's on v5e and v5p, 1.35x on v6e and 0.9x on the MoE program.
  Which of the mask and softmax work XLA fuses into the score matmul differs by generation and
  mesh (docs/model.md, "Memory"), so compare the attention-matmul and softmax rows together:
  with them, XLA is 1.7x tpusim on v5e, 2.1x on v5p, 1.1x on v6e. These fusions are HBM-bound,
  and XLA's model moves bytes at about half to two thirds of the HBM peak wherever it can be
  checked (the ring accumulators above and below, `--analyze`), tpusim at the peak
  (`hbm_efficiency` 1.0: the MaxText fit cannot identify it), which accounts for most of the
  v5e and v5p gaps; the bytes per score are docs/model.md's.
* **MoE router.** The program builds its masks as MaxText's `generate_masks` does (`xla_compile.
  lower_moe_train(router="maxtext")`: the bf16 top-k weights times an int32 one-hot of the
  capacity slot, a bf16 combine mask). Most of XLA's router estimate (1.23 of 1.82 ms) is two
  copies per layer in the backward: relayouts of the combine mask's gradient
  ([tokens, experts, capacity + 1] bf16, 2048 x 8 x 641, 21 MB) on either side of its
  all-to-all, 537,972 cycles (0.31 ms) each, about 12x the time to read and write it at v6e's
  HBM rate. The program's first version built the combine mask in f32 and cast it: XLA's
  router estimate was 7.13 ms, nearly all of it (6.6 ms) two one-hot fusions per layer and
  pass over [tokens, top-k, experts, capacity] (21 M elements), 0.82 ms each, 60x the time to
  write the mask (the inputs hold the expert index in the lane dimension, the output in the
  sublanes: presumably a relayout), and the gradient went through the all-to-all in f32.
  tpusim's `moe_masks` keeps the bytes (both masks written) and FLOPs cost, and no relayout;
  the measured MoE runs (above) are predicted slow, not fast, so nothing in them asks for
  XLA's relayouts.
* **Decode.** XLA's estimate for the decode step's weight matmuls (0.05 ms) is below the time
  to read those weights from HBM (2 layers x 218 M parameters / 8 chips in bf16 = 109 MB, 0.13
  ms at v5e's 8.2e11 B/s), which tpusim charges. The compiled program streams the weights
  into VMEM with asynchronous copies (`copy-start`/`copy-done`, one a cross-program prefetch)
  and slices (`slice-start`/`slice-done`, joined by `ConcatBitcast` custom calls); the matmul
  fusions read their weights from VMEM (`S(1)` layouts), so their estimates leave the HBM
  read out, and the copies, like collectives, carry no estimate. The bytes still cross HBM
  once per step, overlapped with other work, and at M = 8 rows that read is the step's
  bound: tpusim, which charges it to the matmuls, is right, and the sum of XLA's per-op
  estimates is not a step time here.
* **tpusim's replay against its costs alone.** The rows charge each compute op its cost alone
  on the chip, as XLA's estimates do, and so does tpusim's replay: a compute op streams HBM at
  its own pace beside the collectives' DMA (docs/model/training.md, "HBM"), so its compute ops
  take their costs alone there too ("its compute ops take ... there" under each table; the
  largest ratio, {stretch}). Until 2026-12-03 compute and collective DMA shared HBM max-min and
  the same ops took longer beside the DMA (fsdp_v5e16: all compute ops 125.6 ms against
  120.5 ms alone, the step 153.6 ms), which let a faster link slow a step; until 2026-11-30
  they shared it in proportion to the bytes in flight (the compute ops 136.2 ms, the step
  162.2 ms, at the MXU factor then, 0.78).
* **Norms and other elementwise work** cannot be compared row by row: XLA fuses RMSNorm, the
  residual adds and the SwiGLU product into the neighbouring matmul fusions, which these tables
  count as matmuls (a fusion that holds a matmul is that matmul). Compare the totals.
* **Windowed-einsum accumulators** ({accum} of XLA's compute estimate): every fusion of
  XLA's windowed reduce-scatter loops but the matmuls (a select zeroing the two accumulators,
  without an op_name, and the add of each ring step's partial product, named after the dot),
  against tpusim's `*_accum` ops: 4 x |W| bytes of each windowed gradient reduce-scatter
  through HBM (docs/model.md, "Training steps"). XLA keeps the smaller matrices' accumulators
  in VMEM (`S(1)`) yet estimates those fusions at about the same cost per byte as the output
  projection's HBM-resident ones (v5e: 580 and 502 GB/s of bytes moved), so tpusim charges
  all of them at the HBM rate.{accum_only_tpusim}
* **Unattributed**: other instructions without an op_name, mostly layout copies of weights
  and activations between fusions (they carry estimates too); tpusim has no such ops.
* **Optimizer update**: the MoE program's update is SGD (XLA side) against tpusim's Adam.
* **Collectives**: XLA's cost model puts no estimate on collectives; tpusim's row is the summed
  simulated time of its collectives, most of it overlapped with compute (the step time shows
  how much), so it is not part of the compute totals."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="write the optimized XLA HLO text here")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON,
                    help="python of a venv with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--json", help="cache the XLA side in this JSON file (programs already in "
                                   f"it are not compiled again; the doc reads {RESULTS_FILE.name})")
    ap.add_argument("--recompile", action="store_true",
                    help="with --json: compile the selected programs even if cached")
    ap.add_argument("--reparse", metavar="DIR",
                    help="with --json: re-read the cached programs' collectives, op costs and "
                         "dot FLOPs from DIR/NAME.hlo.txt (an earlier --dump), no compile")
    ap.add_argument("--analyze", metavar="DIR",
                    help="print XLA's per-cycle rates read off DIR/NAME.hlo.txt (an earlier "
                         "--dump): fastest matmul fusion against the MXU peak, ring-accumulator "
                         "bytes against HBM, at XLA_CLOCK_HZ; no compile")
    ap.add_argument("--forms", metavar="DIR",
                    help="print the form XLA gave each training program's weight gathers and "
                         "gradient reductions, read off DIR/NAME.hlo.txt (an earlier --dump; "
                         f"the probes {', '.join(FORM_PROBES)} compile with --configs NAME "
                         "--dump DIR); no compile")
    args = ap.parse_args()
    if args.forms:
        print(forms(args.forms))
        return 0
    if args.analyze:
        print(analyze(args.analyze))
        return 0
    if args.worker:
        _worker(args.worker, args.dump)
        return 0
    names = args.configs.split(",")
    unknown = [n for n in names if n not in ALL_PROGRAMS]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(ALL_PROGRAMS)}")
    probes = [n for n in names if n in FORM_PROBES]
    if probes and (args.json or args.reparse):
        ap.error(f"{', '.join(probes)}: form probes are not cached (they are not in the "
                 "collective-bytes table); compile them with --dump DIR and read them with "
                 "--forms DIR")

    if args.reparse:
        if not args.json:
            ap.error("--reparse needs --json (the cache to update)")
        cache = xla_compile.load_cache(Path(args.json))
        for name in names:
            hlo = Path(args.reparse, f"{name}.hlo.txt")
            if name in cache and hlo.is_file():
                cache[name]["xla"] = reparse(name, cache[name]["xla"], hlo.read_text())
                print(f"re-read {name} from {hlo}")
        xla_compile.write_cache(Path(args.json), cache, compact=True)
        return 0

    have_jax = xla_compile.have_jax(args.jax_python)
    if not have_jax:
        print(f"SKIP XLA side: {args.jax_python} missing or lacks jax[tpu] "
              "(docs/reference/xla.md says how to install it)")

    def compile_one(name: str) -> dict:
        return {"tpusim": {}, "xla": run_xla(name, args.jax_python, args.dump)}

    for name in names:
        cfg = ALL_PROGRAMS[name]
        print(f"\n=== {name}: {cfg['topology']} mesh {cfg['mesh']} layers={cfg['layers']} "
              f"seq={cfg['seq']} batch/chip={cfg['batch_per_chip']} ({cfg['mode']}) ===")
        xla_acc = None
        if have_jax:
            if args.json:
                res = xla_compile.compile_into_cache([name], Path(args.json), compile_one,
                                                     recompile=args.recompile, compact=True)[name]
            else:
                res = compile_one(name)
            xla_acc = summarize(res["xla"]["ops"], xla=True)
            print_table("XLA (optimized HLO; count x loop trip count)", xla_acc)
        for extra in TPUSIM_VARIANTS.get(name, []):
            label = " ".join(extra) or "(defaults)"
            acc = summarize(tpusim_collectives(name, extra), xla=False)
            print_table(f"tpusim {label}", acc)
            if xla_acc is not None:
                print(f"\n  side by side, tpusim {label} vs XLA:")
                print_side_by_side(acc, xla_acc)
        if name in FORM_PROBES:
            print("\n(a form probe: `--forms DIR` reads the module --dump wrote)")
        elif name not in TPUSIM_VARIANTS:
            print("\n(tpusim side of this program: docs/validation.md, from "
                  "`python -m validation.maxtext --write-collectives`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
