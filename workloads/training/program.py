"""The program builder a training step is emitted with: the step's dimensions per chip, the
ops it adds (weight and activation matmuls, possibly as windowed einsums; VPU fusions;
collectives over mesh axes; FSDP weight gathers), the HBM events it records, tensor
parallelism's entry and exit collectives, and how the weights are sharded (the matrices of a
layer, their FSDP groups, the parameters each chip holds). The layer program (`layer.py`),
the gradient reductions (`gradients.py`), the memory model (`hbm.py`) and the step
(`step.py`) build on it; what XLA decides about each gather and reduction comes from
`xla_rules.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from topologies.errors import TpusimError
from workloads.dtypes import Dtype, dtype_bytes
from workloads.memory import MemoryCategory
from workloads.moe import MoeRouting, plan_routing
from workloads.trace import Op, OpKind, TraceBuilder, Unit, replace_op
from workloads.training import xla_rules as xla
from workloads.training.config import TrainingConfig
from workloads.training.modes import Optimizer
from workloads.training.quant import dequant_flops, quantize_cost

# The op that casts the local weight shard to --gather-dtype, once per step.
WEIGHT_CAST = "weight_cast"

# The weight matrices each weight matmul of a layer reads (FSDP gathers one per matrix).
ATTN_KEYS = ("wq", "wk", "wv", "wo")
# MLA's down projections (d_model -> the query and key-value latents) are not split over
# `tensor`: each tensor shard computes the latents whole (MaxText's MLA shards their low-rank
# dimensions over fsdp only), and splits the heads' up projections and the output projection.
MLA_WHOLE_OVER_TENSOR = frozenset({"wq_a", "wkv_a"})
# An MTP module's projection of its two normalised inputs (2 d_model -> d_model).
MTP_PROJ = "mtp_proj"


@dataclass(frozen=True, slots=True, kw_only=True)
class Dims:
    """The step's sizes per chip."""

    n: float  # tokens per chip per microbatch (rows of the activations)
    ctx: int  # attention context (full sequence)
    tp: int
    fs: int
    dp: int
    ep: int
    pp: int
    sp: int
    layers: int  # layers on this pipeline stage


@dataclass(slots=True)
class Gathered:
    """The FSDP all-gathers of one layer's weights for one pass: matrix -> (op id, form)."""

    ops: dict[str, tuple[int, str]] = field(default_factory=dict)
    held_bytes: float = 0.0  # HBM the non-windowed gathers hold until the layer ends
    held: dict[str, float] = field(default_factory=dict)  # held_bytes by matrix

    def release(self, keys) -> float:
        """Bytes of the `keys` matrices still held, now released."""
        out = sum(self.held.pop(k, 0.0) for k in keys)
        self.held_bytes -= out
        return out

    def deps(self, keys) -> list[int]:
        """The gathers a matmul reading `keys` waits for (a windowed one streams its shards
        through the matmul itself)."""
        return sorted({self.ops[k][0] for k in keys if k in self.ops
                       and self.ops[k][1] != "windowed"})

    def windowed_keys(self, keys) -> set[str]:
        """The `keys` matrices this pass gathers by a windowed einsum."""
        return {k for k in keys if k in self.ops and self.ops[k][1] == "windowed"}

    def windowed(self, keys) -> bool:
        return bool(self.windowed_keys(keys))

    def ids(self, form: str | None = None) -> list[int]:
        return sorted({i for i, f in self.ops.values() if form is None or f == form})



@dataclass(frozen=True, slots=True)
class Q:
    """What an int8 matmul quantizes (`ProgramBuilder.mm`'s `q`), in elements per chip: its
    activation operands (round to nearest), its gradient operands (stochastic rounding), the
    weight elements it quantizes itself (none where each shard was quantized before its
    gather), the outputs it dequantizes; `k` the contraction length its per-channel scales
    are taken over. `kind`: weight, attention or logits (`quantize_attention`,
    `quantize_logits`)."""

    kind: str = "weight"
    act: float = 0.0
    sr: float = 0.0
    weight: float = 0.0
    out: float = 0.0
    k: float = 1.0


def with_changes(op, **changes):
    """`op` with some fields replaced (ops are frozen)."""
    if type(op) is Op:
        return replace_op(op, **changes)
    return dataclasses.replace(op, **changes)


class ProgramBuilder:
    """The ops, HBM events and sharding arithmetic of one training-step program."""

    # Which parts of the step this program holds (a pipeline chunk holds fewer).
    embed_on = True
    head_on = True
    sends_on = True
    # The weight cast (--gather-dtype) runs before the first forward of a whole step. A
    # pipeline chunk's forward is copied per microbatch and chunk (sim/engine/pipeline.py), while a
    # stage casts its weights once per step: the chunk holds it after its update instead.
    cast_per_pass = True

    def __init__(self, model, mesh, d: Dims, cfg: TrainingConfig, num_chips, global_seqs):
        self.m = model
        self.mesh = mesh
        self.d = d
        self.cfg = cfg
        self.num_chips = num_chips
        self.global_seqs = global_seqs
        self.b = TraceBuilder(fix=f"{{microbatches}} {cfg.microbatches} x {model.num_layers} "
                                  f"layers build it: use fewer microbatches or layers",
                              fix_params=("microbatches",))
        # Stored params (and their update) in param_dtype; what the layers gather and read
        # in gather_dtype (the cast of each shard before its gather, `weight_cast`).
        self.wb = dtype_bytes(cfg.param_dtype, "param_dtype")
        self.wc = dtype_bytes(cfg.weight_gather_dtype, "gather_dtype")
        self.gb = dtype_bytes(cfg.grad_dtype, "grad_dtype")
        # The local gradient shards are held in the params' dtype when the weights are cast for
        # their gathers: the scanned backward writes each layer's reduce-scattered gradient into
        # a stacked gradient of the params' dtype (f32 in the v5e and v6e fsdp=16 scanned
        # compiles with f32 weights; benchmarks/xla_memory.py `*_f32params`).
        self.gh = self.wb if self.wc != self.wb else self.gb
        # int8 training (workloads/training/quant.py): the MXU format of the quantized matmuls
        # and the bytes per element of a gathered weight (int8 where each shard is quantized
        # before its gather, as XLA compiles AQT's FSDP programs).
        self.qdt = cfg.matmul_dtype
        self.wq = float(Dtype.INT8.nbytes) if cfg.quantized else self.wc
        self.int8_gathers = cfg.quantized and cfg.quant_gather == "int8" and \
            d.fs * d.ep > 1
        self.wg = self.wq if self.int8_gathers else self.wc
        self.ob = dtype_bytes(cfg.optimizer_dtype, "optimizer_dtype")
        self.opt = Optimizer(cfg.optimizer)
        # Optimizer state per parameter (the moments, in --optimizer-dtype).
        self.state_bytes_per_param = self.opt.state_tensors * self.ob
        self.act = float(Dtype.BF16.nbytes)  # activations in bf16
        # Bytes per element of the output projection's weight gradient as its dot writes it
        # and its fsdp reduction carries it: f32 under `logits_dtype` fp32 (the f32 dot's
        # result, converted to the params' dtype only after the reduction), else the
        # gradients' dtype (docs/model/training.md "The logits path's dtype").
        self.head_gb = float(Dtype.FP32.nbytes) if cfg.logits_dtype == "fp32" else self.gb
        # Router skew and capacity (workloads/moe.py): a routing group is one sequence's local
        # shard, as MaxText computes expert capacity per sequence.
        self.routing: MoeRouting | None = (
            plan_routing(model, d.ep, cfg.seq_len // d.sp, cfg.moe) if model.is_moe else None
        )
        self.mem_events: list[list] = []  # [op id, MemoryCategory, +alloc / -free bytes]
        # Live ends of a recomputed layer besides the op layer_forward returns (ops whose
        # outputs only the backward reads, e.g. the recomputed attention when its output
        # projection came back from host memory).
        self.recompute_leaves: list[int] = []
        self.mlp_weights_done: int | None = None  # set by layer_backward
        # The attention's weight-gradient matmuls (set by layer_backward): the op before the
        # score gradient that writes the output and value projections' gradients (XLA computes
        # them first: they need no score gradient), and the one that writes the q and k ones.
        self.attn_early_grads_done: int | None = None
        self.attn_weights_done: int | None = None
        self.router_grad_done: int | None = None  # an MoE layer's router backward
        # The bf16 probabilities a recomputation writes for the backward (v5p under full),
        # held from its softmax to the layer's value-gradient matmul.
        self.bwd_probs_bytes = 0.0
        self.last_matmul: int | None = None  # the op the latest mm() emitted for its matmul
        self._quant_copy = 0.0  # the int8 copies of the latest quantize_op
        self.last_quant: int | None = None  # the latest quantize_op
        self._sr_held: dict[str, float] = {}  # a layer backward's random bits (layer.py)

    def mem(self, op_id, category: MemoryCategory, delta: float) -> None:
        """HBM changes by `delta` bytes of `category` when op `op_id` ends."""
        if op_id is None or delta == 0:
            return
        op = self.b.ops[op_id]
        if delta > 0:
            self.b.ops[op_id] = with_changes(op, alloc_bytes=op.alloc_bytes + delta)
        else:
            self.b.ops[op_id] = with_changes(op, free_bytes=op.free_bytes - delta)
        self.mem_events.append([op_id, str(category), float(delta)])

    # -- helpers ----------------------------------------------------------------------------
    # The FSDP gathers of the layer being emitted (None outside the layers or without fsdp).
    cur: Gathered | None = None

    def quantizes(self, kind: str) -> bool:
        """Matmuls of `kind` (weight, attention, logits) run in the quantized format."""
        cfg = self.cfg
        return cfg.quantized and (kind == "weight" or (kind == "attention"
                                                       and cfg.quantize_attention)
                                  or (kind == "logits" and cfg.quantize_logits))

    def quantize_op(self, name, q: Q, deps, layer, phase) -> int:
        """The VPU fusion that quantizes an int8 matmul's operands (and the dequantization
        of its outputs, `quant.dequant_flops`); its int8 copies are temporaries until the
        matmul has read them."""
        cfg, a = self.cfg, self.act
        weight = 0.0 if self.int8_gathers and q.kind == "weight" else q.weight
        total, flops, nbytes = 0.0, dequant_flops(q.out), 0.0
        for elems, sr in ((q.act, False), (q.sr, cfg.stochastic_rounding), (weight, False)):
            scales = elems / max(q.k, 1.0) if cfg.quant_scales == "per-channel" else \
                (1.0 if elems else 0.0)
            c = quantize_cost(elems, scales, sr=sr, act_bytes=a if elems is not weight
                              else self.wc)
            flops += c.flops
            nbytes += c.hbm_bytes
            total += c.copy_bytes
        op = self.vpu(f"{name}_quant", flops, nbytes, deps, layer, phase)
        self.mem(op, MemoryCategory.TEMPORARIES, total)
        self._quant_copy = total
        self.last_quant = op
        return op

    def mm(self, name, flops, w_bytes, in_bytes, out_bytes, deps, layer, phase, narrow_dim=0,
           keys=(), whole_bytes=0.0, acc_bytes=0.0, q: Q | None = None):
        """A weight matmul (or, without `w_bytes`, an activation matmul) on the MXU.

        Run as a windowed einsum of N ring steps (its matrices' gather or its gradient's
        reduce-scatter is windowed; docs/model.md "A windowed einsum"): `whole_bytes` is the
        part of `in_bytes` read whole by every pair of steps (activation operands without the
        FSDP-sharded dimension), `acc_bytes` the outputs summed over the steps (where the
        sharded dimension is contracted); the rest of the operands is read a 1/N slice a step,
        once in all, and the output is written once. Either may be a dict matrix -> bytes
        (a merged matmul whose matrices' gathers differ in form: only the windowed ones
        count)."""
        # Ring length of the windowed einsum the matmul runs as (1: plain): its matrices' gather
        # is windowed, or (a weight gradient) its reduce-scatter is.
        n = 1
        windowed: set[str] = set()
        if self.cur is not None and keys:
            if name.endswith("_weights"):
                windowed = {k for k in keys if self.rs_windowed_for(self.fsdp_group(k)[1])}
            else:
                windowed = self.cur.windowed_keys(keys)
            # The ring runs over the windowed matrices' group (a merged matmul may hold
            # matrices of the non-expert group that are not windowed).
            n = max(self.fsdp_group(k)[1] for k in windowed) if windowed else 1

        def part(x) -> float:
            if isinstance(x, dict):
                return sum(v for k, v in x.items() if k in windowed)
            return x
        if self.cur is not None and keys and not name.endswith("_weights"):
            deps = list(deps) + self.cur.deps(keys)
        dtype = "bf16"
        w_elems = w_bytes / self.wc if self.wc else 0.0
        if q is not None and self.quantizes(q.kind):
            # The operands are quantized first, then the matmul reads them as int8 (its
            # weights at 1 byte, its activation operands at half their bf16 bytes) and writes
            # its dequantized bf16 outputs.
            deps = [self.quantize_op(name, q, deps, layer, phase)]
            dtype = self.qdt
            w_bytes = w_elems * self.wq
            in_bytes = in_bytes * self.wq / self.act
            whole_bytes = {k: v * self.wq / self.act for k, v in whole_bytes.items()} \
                if isinstance(whole_bytes, dict) else whole_bytes * self.wq / self.act
        if n > 1 and w_bytes > 0:
            # A windowed einsum (collective matmul) runs as N ring steps, one weight shard
            # each; XLA's ring is bidirectional and each matmul fusion takes the two shards
            # that arrived from either side (the HLO of benchmarks/xla_crosscheck.py's
            # fsdp_v6e16_b4, whose loop buffers are in HBM). Where the sharded dimension is
            # contracted (forward q, k, v, gate, up; the input gradients of o and down) a pair
            # reads the activation's two slices along it (once in all) and its product joins
            # the partial sum: per loop trip of 4 steps one fusion writes the first pair's
            # product and the next reads it and the partial sum and writes their sum with the
            # second pair's, one output's worth of traffic per step, N in all. Where the
            # sharded dimension is the output's (forward o and down; the input gradients of q,
            # k, v, gate, up) or the weight gradient's, every pair reads the operand without
            # it whole (N / 2 reads) and writes its slices in place.
            in_bytes += max(n / 2 - 1, 0) * part(whole_bytes)
            out_bytes += (n - 1) * part(acc_bytes)
        op = self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.MXU, flops=flops,
                        hbm_bytes=w_bytes + in_bytes + out_bytes, deps=deps, layer=layer,
                        phase=phase, narrow_dim=narrow_dim,
                        **({"dtype": dtype} if dtype != "bf16" else {}))
        if dtype != "bf16":
            self.mem(op, MemoryCategory.TEMPORARIES, -self._quant_copy)
        self.last_matmul = op
        if n > 1 and w_bytes > 0 and name.endswith("_weights"):
            # A weight gradient (dW) whose reduce-scatter is a windowed ring: the gradient is
            # complete once its ring accumulators are.
            return self.ring_accumulators(name, op, w_elems * self.wc, layer, phase)
        return op

    def ring_accumulators(self, name, dep, w_bytes, layer, phase,
                          grad_bytes: float | None = None) -> int:
        """The accumulator traffic of a weight gradient's windowed reduce-scatter (a collective
        matmul), as the fusion of its own XLA runs it as, after the dW matmul (`NAME_accum`).

        `w_bytes` is the gathered matrices' size at the gather dtype; the accumulators hold
        the gradient's dtype (bf16 in XLA's programs: the add is done in f32 and converted
        back). In XLA's `windowed_dot_general_body_rs` loop (bidirectional ring, unrolled by
        2) every ring step's add fusion reads the partial sum arriving from the ring and the
        step's partial product and writes their sum (3 shards of |W| / N), and a select that
        zeroes the accumulators on the first step reads and writes each of the two accumulators
        once per two steps (1 shard per step): 4 x |W| bytes over the N steps, one add per
        gradient element (docs/model.md "Training steps")."""
        g = w_bytes / self.wc * (self.gb if grad_bytes is None else grad_bytes)
        return self.vpu(f"{name}_accum", w_bytes / self.wc, 4.0 * g, [dep], layer, phase)

    def vpu(self, name, flops, nbytes, deps, layer, phase, **kw):
        base = name.removeprefix("re-")
        if self.cfg.fuse_elementwise and base in xla.FUSED_ELEMENTWISE:
            # XLA fuses this elementwise op into the neighbouring matmul or norm fusion: its
            # FLOPs stay on the VPU but its operands never make a separate trip through HBM.
            nbytes = 0.0
        return self.b.add(name, kind=OpKind.COMPUTE, unit=Unit.VPU, flops=flops,
                          hbm_bytes=nbytes, deps=deps, layer=layer, phase=phase, **kw)

    def coll(self, name, kind, axes, nbytes, deps, layer, phase, **kw):
        axes = tuple(a for a in axes if self.mesh.size(a) > 1)
        if not axes or nbytes <= 0:
            return None
        return self.b.add(name, kind=OpKind.COLLECTIVE, collective=kind, mesh_axes=axes,
                          bytes=float(nbytes), deps=deps, layer=layer, phase=phase, **kw)

    # -- tensor parallelism ------------------------------------------------------------------
    # Activations between sublayers are either replicated over `tensor` (Megatron; XLA then
    # all-reduces each sublayer's output, reference/xla.md) or sharded over it (MaxText's
    # activation sharding: an all-gather before each sublayer's first matmul and a reduce-scatter
    # after its last, the same bytes on the wire, 1/tp of the norms and saved activations).
    # `collective-matmul` overlaps those collectives with the adjacent matmul (Wang et al.).
    @property
    def tp_sharded(self) -> bool:
        return self.cfg.tp_activations == "sharded" and self.d.tp > 1

    @property
    def tp_overlap(self) -> bool:
        return self.cfg.tp_comm == "collective-matmul"

    def rows(self) -> float:
        """Rows of the residual stream each chip holds (norms, residual adds, saved inputs)."""
        return self.d.n / self.d.tp if self.tp_sharded else self.d.n

    def tp_enter(self, tag, name, dep, layer, phase) -> tuple[list[int], list[int]]:
        """Before a sublayer's first matmul: (deps for the matmul, deps for its consumer)."""
        if not self.tp_sharded:
            return [], []
        ag = self.coll(f"{tag}tp_allgather_{name}", "all-gather", ("tensor",),
                       self.d.n * self.m.d_model * self.act, [dep], layer, phase)
        if ag is None:
            return [], []
        return ([], [ag]) if self.tp_overlap else ([ag], [])

    def tp_exit(self, tag, name, mm_id, last_matmuls, layer, phase,
                elem_bytes: float | None = None) -> list[int]:
        """After a sublayer's last matmul: deps for the residual that consumes its output
        (`elem_bytes` a byte per element of the reduced tensor, the activations' by default).

        With collective matmuls the reduction starts when the last matmul(s) producing its
        input can start (their own dependencies), and runs alongside them."""
        kind = "reduce-scatter" if self.tp_sharded else "all-reduce"
        short = "reducescatter" if self.tp_sharded else "allreduce"
        if self.tp_overlap:
            start = sorted({d for op in last_matmuls for d in self.b.ops[op].deps})
        else:
            start = [mm_id]
        c = self.coll(f"{tag}tp_{short}_{name}", kind, ("tensor",),
                      self.d.n * self.m.d_model * (self.act if elem_bytes is None
                                                   else elem_bytes), start, layer, phase)
        return [mm_id] + ([c] if c is not None else [])

    # -- per-layer shapes -------------------------------------------------------------------
    def attn_keys(self) -> tuple[str, ...]:
        """The attention's weight matrices (`ATTN_KEYS`, MLA's `TransformerSpec.mla_matrices`)."""
        if self.m.is_mla:
            return tuple(k for k, _ in self.m.mla_matrices())
        return ATTN_KEYS

    def mla_shard_params(self) -> list[tuple[str, float]]:
        """MLA's matrices and the parameters one tensor shard holds of each
        (`MLA_WHOLE_OVER_TENSOR`)."""
        tp = self.d.tp
        return [(k, p if k in MLA_WHOLE_OVER_TENSOR else p / tp)
                for k, p in self.m.mla_matrices()]

    def is_mtp_layer(self, layer: int) -> bool:
        """Layer `layer` is an MTP module's block (`TransformerSpec.mtp_layers`)."""
        return layer >= self.m.num_layers

    def layer_weight_bytes(self, moe: bool, layer: int | None = None) -> float:
        """bf16 matmul weights one tensor shard gathers for a layer (V of the FSDP gather);
        `layer` adds an MTP module's projection."""
        m, d = self.m, self.d
        att = m.attention_params_per_layer / d.tp
        if m.is_mla:
            att = sum(p for _, p in self.mla_shard_params())
        if layer is not None and self.is_mtp_layer(layer):
            att += 2 * m.d_model * m.d_model / d.tp
        if moe:
            routed = m.num_experts * m.mlp.num_matrices * m.d_model * m.expert_d_ff
            shared = m.moe_mlp_params_per_layer - m.router_params_per_layer - routed
            mlp = routed / (d.tp * d.ep) + shared / d.tp + m.router_params_per_layer
        else:
            mlp = m.dense_mlp_params_per_layer / d.tp
        return (att + mlp) * self.wc

    def layer_expert_weight_bytes(self, layer: int) -> float:
        """The routed experts' share of `layer_weight_bytes` (sharded over `expert`)."""
        if not self.layer_is_moe(layer):
            return 0.0
        m, d = self.m, self.d
        routed = m.num_experts * m.mlp.num_matrices * m.d_model * m.expert_d_ff
        return routed / (d.tp * d.ep) * self.wc

    @property
    def dp_split_per_matrix(self) -> bool:
        """`xla_rules.dp_split_per_matrix` for this run and mesh."""
        return xla.dp_split_per_matrix(self.cfg, self.mesh)

    def layer_norm_grad_bytes(self) -> float:
        """Gradients of one layer's norm scales, f32 (`norm_grad_bytes`)."""
        return self.m.norm_params_per_layer * 4

    def norm_grad_bytes(self) -> float:
        """Gradients of the norm scales this pipeline stage holds (replicated parameters), in
        f32: the norms compute in f32, and XLA's all-reduce of these gradients takes f32
        operands (converting to the parameter dtype after the reduction)."""
        return self.m.num_norm_params / self.d.pp * 4

    def layer_is_moe(self, layer: int) -> bool:
        return self.m.layer_is_moe(layer)

    def regather_keys(self, layer: int) -> tuple[str, ...]:
        """The attention matrices XLA gathers a second time for their input gradients (MLA:
        its query and key matrices, every attention matrix in an MoE layer; not read off a
        compile)."""
        if self.m.is_mla:
            keys = self.attn_keys() if self.layer_is_moe(layer) else self.attn_keys()[:-1]
            return tuple(f"{k}_dx" for k in keys)
        return xla.MOE_REGATHER_KEYS if self.layer_is_moe(layer) else xla.REGATHER_KEYS

    # MaxText's logical-axis rules shard a weight's `embed` dimension over fsdp and expert, except
    # the routed experts' (`embed_no_exp`: their own `exp` dimension takes the expert axis), so
    # the attention, router, shared-expert, dense-MLP and embedding weights are gathered from,
    # and their gradients reduce-scattered over, fsdp x expert (docs/model.md "MoE routing").
    def fsdp_group(self, key: str) -> tuple[tuple[str, ...], int]:
        """(mesh axes, chips) a weight matrix is FSDP-sharded over."""
        if key.startswith("expert"):
            return ("fsdp",), self.d.fs
        return ("fsdp", "expert"), self.d.fs * self.d.ep

    @property
    def fsdp_shards(self) -> int:
        """FSDP shards of the non-expert weights (fsdp x expert)."""
        return self.d.fs * self.d.ep

    def mlp_keys(self, layer: int) -> tuple[str, ...]:
        """The MLP's weight matrices (routed and shared experts and the router in an MoE
        layer)."""
        gated = self.m.mlp.num_matrices == 3
        if not self.layer_is_moe(layer):
            return ("w_gate", "w_up", "w_down") if gated else ("w_up", "w_down")
        keys = ["router"] + (["expert_gate"] if gated else []) + ["expert_up", "expert_down"]
        if self.m.num_shared_experts:
            keys += (["shared_gate"] if gated else []) + ["shared_up", "shared_down"]
        return tuple(keys)

    def layer_matrices(self, layer: int) -> list[tuple[str, float]]:
        """(matrix, bytes one tensor shard gathers) for each weight matrix of a layer; they sum
        to `layer_weight_bytes`."""
        m, d, wb = self.m, self.d, self.wc
        D, hd = m.d_model, m.head_dim
        q, kv = D * m.num_heads * hd / d.tp * wb, D * m.num_kv_heads * hd / d.tp * wb
        out = [("wq", q), ("wk", kv), ("wv", kv), ("wo", q)]
        if m.is_mla:
            out = [(k, p * wb) for k, p in self.mla_shard_params()]
        if self.is_mtp_layer(layer):
            out.append((MTP_PROJ, 2 * D * D / d.tp * wb))
        if not self.layer_is_moe(layer):
            return out + [(k, D * m.d_ff / d.tp * wb) for k in self.mlp_keys(layer)]
        routed = D * m.expert_d_ff * m.num_experts / (d.tp * d.ep) * wb
        shared = (m.moe_mlp_params_per_layer - m.router_params_per_layer
                  - m.num_experts * m.mlp.num_matrices * D * m.expert_d_ff)
        per_shared = shared / m.mlp.num_matrices / d.tp * wb
        for k in self.mlp_keys(layer):
            out.append((k, m.router_params_per_layer * wb if k == "router" else
                        routed if k.startswith("expert") else per_shared))
        return out

    @property
    def weights_replicated(self) -> bool:
        """The weights are replicated over a mesh axis (data or sequence): a weight operand is
        then sharded over fewer chips than the program has."""
        return self.d.dp > 1 or self.d.sp > 1

    # -- XLA's decisions for this program (`xla_rules`) --------------------------------------
    def rs_windowed_for(self, group: int) -> bool:
        """`xla_rules.rs_windowed` over an FSDP group of `group` chips."""
        return xla.rs_windowed(self.cfg, group, weights_replicated=self.weights_replicated)

    @property
    def forward_windowed(self) -> bool:
        """Some weight of the layers' forward is gathered by a windowed einsum."""
        return self.d.fs * self.d.ep > 1 and any(
            self.gather_form(layer, key, "fwd") == "windowed"
            for layer in range(self.d.layers)
            for key, _ in self.layer_matrices(layer))

    @property
    def rs_windowed(self) -> bool:
        """`rs_windowed_for` the non-expert weights' group (fsdp x expert)."""
        return self.rs_windowed_for(self.fsdp_shards)

    @property
    def mlp_grads_last(self) -> bool:
        """`xla_rules.mlp_grads_after_attention` of this run: the MLP's weight gradients run
        after the attention's backward (memory only: their operands live through it)."""
        return xla.mlp_grads_after_attention(self.cfg, rs_windowed=self.rs_windowed)

    def grad_kind_for(self, group: int) -> str:
        """`xla_rules.grad_kind` over an FSDP group of `group` chips."""
        return xla.grad_kind(self.cfg, group)

    @property
    def grad_kind(self) -> str:
        """`grad_kind_for` the non-expert weights' group (fsdp x expert)."""
        return self.grad_kind_for(self.fsdp_shards)

    @property
    def plain_gather_form(self) -> str:
        """`xla_rules.plain_gather_form` of this run."""
        return xla.plain_gather_form(self.cfg)

    def gather_form(self, layer: int, key: str, phase: str) -> str:
        """`xla_rules.gather_form` of one matrix of `layer` for one pass."""
        return xla.gather_form(self.cfg, key, phase, group=self.fsdp_group(key)[1],
                               weights_replicated=self.weights_replicated, tensor=self.d.tp,
                               parallel_block=self.m.parallel_block)

    def ring(self, group: int, kind: str = "all-gather", key: str = "") -> float:
        """`xla_rules.ring_messages` of a windowed ring over `group` chips."""
        return xla.ring_messages(group, kind, key, gated_mlp=self.m.mlp.num_matrices == 3)

    # -- FSDP weight gathers -----------------------------------------------------------------
    def fsdp_gather(self, layer: int, phase: str, after: list[int],
                    after_block: list[int]) -> Gathered | None:
        """One all-gather per weight matrix of a layer (XLA's granularity), each in its
        form: async ones are prefetched after `after` (one layer ahead), windowed and
        blocking ones are issued after `after_block` (the previous layer's end)."""
        if self.fsdp_shards == 1:
            return None
        out = Gathered()
        mats = self.layer_matrices(layer)
        if self.int8_gathers:
            # Each chip quantizes its shards of the layer's matrices before they are gathered
            # (XLA's compile of AQT's FSDP program: the rings carry int8 shards), and the
            # per-channel scales, taken over a contraction the shards split, are completed
            # from every shard's abs-max (a small all-gather per matrix).
            shard = sum(nb / self.wc / self.fsdp_group(k)[1] for k, nb in mats)
            c = quantize_cost(shard, 0.0, sr=False, act_bytes=self.wc)
            qop = self.vpu(f"weight_quant_{phase}", c.flops, c.hbm_bytes,
                           after if any(self.gather_form(layer, k, phase) == "async"
                                        for k, _ in mats) else after_block, layer, phase)
            after, after_block = [qop], [qop]
            mats = [(k, nb / self.wc * self.wq) for k, nb in mats]
        for key, nbytes in mats:
            form = self.gather_form(layer, key, phase)
            axes, group = self.fsdp_group(key)
            # A windowed einsum gathers through a ring of N + 1 collective-permutes (a
            # prologue, then one per step), each one shard: (N + 1) / N of V.
            g = self.coll(f"fsdp_allgather_{phase}_{key}", "all-gather", axes,
                          nbytes * (self.ring(group, "all-gather", key)
                                    if form == "windowed" else 1.0),
                          after if form == "async" else after_block, layer, phase)
            if g is None:
                continue
            out.ops[key] = (g, form)
            # A forward collective matmul streams the shards, never the whole matrix; the
            # backward gathers each matrix whole even then (XLA's compiled programs,
            # docs/model.md "Memory").
            if form != "windowed" or phase == "bwd":
                self.mem(g, MemoryCategory.GATHERED_WEIGHTS, nbytes)
                out.held_bytes += nbytes
                out.held[key] = out.held.get(key, 0.0) + nbytes
        return out

    def regather(self, layer: int, g: Gathered | None, after: list[int]) -> None:
        """XLA's second gathers of the query and key projections (all four attention
        matrices in an MoE layer) for their input gradients under remat full (mixed
        modes: `xla_rules.regathers_for_input_gradients`)."""
        if g is None or not xla.regathers_for_input_gradients(self.cfg):
            return
        sizes = dict(self.layer_matrices(layer))
        for key in self.regather_keys(layer):
            nbytes = sizes[key.removesuffix("_dx")] / self.wc * self.wg
            r = self.coll(f"fsdp_allgather_bwd_{key}", "all-gather",
                          self.fsdp_group(key)[0], nbytes, after, layer, "bwd")
            if r is not None:
                g.ops[key] = (r, self.gather_form(layer, key, "bwd"))
                self.mem(r, MemoryCategory.GATHERED_WEIGHTS, nbytes)
                g.held_bytes += nbytes
                g.held[key] = g.held.get(key, 0.0) + nbytes

    def end_layer(self, out: int, g: Gathered | None) -> None:
        """The layer ends when its windowed gathers have arrived; its gathered weights die
        with it."""
        if g is None:
            return
        b = self.b
        wid = g.ids("windowed")
        if wid:
            b.ops[out] = with_changes(b.ops[out], deps=tuple(sorted({*b.ops[out].deps, *wid})))
        self.mem(out, MemoryCategory.GATHERED_WEIGHTS, -g.held_bytes)

    # -- program size ------------------------------------------------------------------------
    def check_program_size(self, start: int, per_mb: int) -> None:
        """Refuse the step once its first microbatch is built (`per_mb` ops, from op `start`)
        if every microbatch cannot fit one program. Each later microbatch adds at least as many
        ops as the first (tests/test_training.py checks it: the middle ones add exactly as
        many, the last one its gradient reductions more), so `start + microbatches x per_mb` is
        a lower bound of the program: a step over the limit costs one microbatch's build, not
        the limit's (LLaMA-3-405B at microbatches=248, inside MIN_OPS_PER_LAYER's estimate,
        built 250,000 ops in 3.8 CPU-s before the builder refused it)."""
        mbs, limit = self.cfg.microbatches, self.b.max_ops
        least = start + mbs * per_mb
        if least <= limit:
            return
        # The last microbatch adds its gradient reductions (under one microbatch's ops):
        # one microbatch less than would fit leaves room for them.
        fit = max((limit - start) // per_mb - 1, 1)
        where = " per pipeline stage" if self.d.pp > 1 else ""
        raise TpusimError(
            f"{{microbatches}} {mbs} x {self.d.layers} layers{where} compiles to at least "
            f"{least:,} ops ({per_mb:,} per microbatch, counted on the first), over the "
            f"{limit:,} tpusim simulates in one program; "
            + (f"use at most {fit:,} microbatches" if fit > 1 else "use {microbatches} 1"),
               "microbatches")

    def local_params(self) -> float:
        m, d = self.m, self.d
        # Every weight is sharded over fsdp x expert: the routed experts' over expert by expert
        # and over fsdp on d_model, the others over both on d_model (`fsdp_group`).
        shards = d.tp * d.fs * d.ep
        att = m.num_attention_params / (shards * d.pp)
        mla_shard = sum(p for _, p in self.mla_shard_params()) if m.is_mla else 0.0
        if m.is_mla:
            # MLA's down projections are whole on every tensor shard.
            att = m.num_layers * mla_shard / (d.fs * d.ep * d.pp)
        if m.is_moe:
            dense_l = m.num_dense_layers
            mlp = dense_l * m.dense_mlp_params_per_layer / (shards * d.pp)
            mlp += m.num_moe_layers * (m.moe_mlp_params_per_layer / (shards * d.pp))
        else:
            mlp = m.num_mlp_params / (shards * d.pp)
        emb = m.num_embedding_params / shards
        norms = m.num_norm_params / d.pp
        # The MTP modules (never pipelined) are sharded as the layers are, norms replicated.
        mtp_norms = m.num_mtp_modules * (m.norm_params_per_layer + 3 * m.d_model)
        mtp = (m.num_mtp_params - mtp_norms) / shards + mtp_norms
        if m.is_mla:
            mtp += m.num_mtp_modules * (mla_shard / (d.fs * d.ep)
                                        - m.attention_params_per_layer / shards)
        return att + mlp + emb + norms + mtp
