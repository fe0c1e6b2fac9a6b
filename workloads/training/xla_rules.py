"""How XLA compiles a training step, as tpusim models it: every decision the compiler takes
that the step's program follows (which elementwise ops fuse, the form of each FSDP gather,
the collective that sums each weight gradient and how many messages its ring sends, the
thresholds XLA's passes use, what the data-parallel and embedding gradients become and
what the chip's compiler defers), each with the compiled programs it was read off.

The rules are functions of the run settings and of the sharding they apply to; the step's
program builder (`program.py`, `layer.py`, `gradients.py`, `step.py`) asks them and emits
what they say.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from topologies.mesh import LogicalMesh
    from workloads.training.config import TrainingConfig

# Elementwise ops XLA fuses into an adjacent matmul or norm (rotary into the QKV output,
# residual adds into the following norm): their FLOPs stay on the VPU but they make no HBM trip
# of their own. Norms, the softmax over a materialised score matrix, the MLP activation, the
# loss and the optimizer are fusions of their own that stream through HBM: in XLA's scanned
# programs (benchmarks/xla_memory.py) the SwiGLU product is a loop fusion reading the gate and
# up projections and writing their product, forward and backward (docs/model.md "Training
# steps").
FUSED_ELEMENTWISE = frozenset({
    "rotary", "block_sum", "residual", "residual_attn", "residual_mlp", "rotary_bwd",
})

# The longest ring XLA builds a windowed einsum over: deviceless compiles of the 2-layer
# LLaMA-3-8B-wide step (benchmarks/xla_crosscheck.py FORM_PROBES, `--forms`) window every
# matrix they windowed at fsdp=16 over 32 chips too (v6e 4x8, also with d_model 2048: 64 rows a
# shard), and nothing over 64 (v6e and v5e 8x8, also with d_model 8192: 128 rows a shard) or
# 256 (v6e 16x16): the ring's length decides, not the shard's size. The mixed modes issue
# plain gathers and gradient all-reduces above it (`grad_kind`).
XLA_MAX_WINDOWED_RING = 32

# A weight gradient XLA all-reduces whole is all-reduced on its own, right after the matmul
# that writes it, from this size on; smaller ones are combined into tuple all-reduces that wait
# for the layer's other gradients. Bracketed by deviceless compiles (benchmarks/xla_memory.py,
# v6e fsdp=256): 32 MiB matrices combined (d_model 2048 x d_ff 8192: a layer's 120 MiB in one
# all-reduce), 128 MiB ones alone (d_model 8192: q and o; the 448 MiB MLP matrices too), as
# XLA's all-reduce combiner caps a combined all-reduce's size (none seen over 120 MiB: at
# LLaMA-3-8B widths a 112 MiB gradient goes with one 8 MiB one); 64 MiB is the bracket's
# middle.
XLA_ALLREDUCE_ALONE_BYTES = 64 * 2**20

# Re-gathers XLA issues for the input-gradient matmuls of the query and key projections under
# remat full (the recomputation's copies are not kept alive across the layer's backward); in an
# MoE layer, whose backward holds the experts' buffers in between, of all four attention
# matrices (the compiled MoE step of benchmarks/xla_crosscheck.py).
REGATHER_KEYS = ("wq_dx", "wk_dx")
MOE_REGATHER_KEYS = ("wq_dx", "wk_dx", "wv_dx", "wo_dx")

# The up projection's weight gradient is computed by one dot merged with the gate's (XLA's dot
# merger: they share the layer input); an unrolled ring reduce-scatters both from one start.
SHARES_GATE_RING = frozenset({"w_up", "expert_up", "shared_up"})

# The matrices whose outputs are q, k and v (MLA's low-rank projections among them).
QKV_MATRICES = frozenset({"wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b"})

# Row-parallel matrices: with a tensor axis their forward output is reduced over `tensor`, so
# XLA does not window their gather (`gather_form`).
ROW_PARALLEL = frozenset({"wo", "w_down", "expert_down", "shared_down"})


def is_mixed(cfg: TrainingConfig) -> bool:
    """The gather mode is one of XLA's own per-matrix choices (`mixed-async`,
    `mixed-blocking`)."""
    return cfg.fsdp_gather.startswith("mixed")


def ring_messages(group: int, kind: str = "all-gather", key: str = "",
                  gated_mlp: bool = True) -> float:
    """A windowed ring's messages of one shard each, over its V. XLA runs the ring in
    both directions, two steps per loop trip: N + 1 messages (a prologue, then N/4
    trips of 4). Over N = 4 the loop would make one trip and XLA writes the steps out
    instead (docs/model.md): a gather then sends N - 1 shards, a reduce-scatter N - 1
    partial sums and a zero accumulator each way (N + 1), except the up projection's,
    which shares the gate's ring start (N - 1)."""
    if group != 4:
        return (group + 1) / group
    if kind == "all-gather" or (key in SHARES_GATE_RING and gated_mlp):
        return (group - 1) / group
    return (group + 1) / group


def rs_windowed(cfg: TrainingConfig, group: int, *, weights_replicated: bool) -> bool:
    """Gradient reduce-scatters over an FSDP group of `group` chips run as windowed rings
    (collective matmuls). In the mixed modes (XLA's own choice) only when the weights are
    sharded over every chip: XLA's SPMD partitioner builds a windowed einsum only for an
    operand split over all the program's partitions (the v6e data=4 x fsdp=4 program has
    none, docs/model.md), and over at most `XLA_MAX_WINDOWED_RING` chips."""
    if is_mixed(cfg) and (weights_replicated or group > XLA_MAX_WINDOWED_RING):
        return False
    return cfg.overlap and cfg.fsdp_gather in ("windowed", "mixed-async", "mixed-blocking")


def grad_kind(cfg: TrainingConfig, group: int) -> str:
    """The collective that reduces a weight gradient over its FSDP group of `group` chips: a
    reduce-scatter, or, in the mixed modes over more chips than XLA windows
    (`XLA_MAX_WINDOWED_RING`), an all-reduce of the whole gradient, as XLA compiles it there
    (the fsdp=64 and fsdp=256 programs of validation/xla_crosscheck.py's gather-forms run reduce
    every gradient that way, several per synchronous all-reduce, and the update slices its
    shard out): twice a reduce-scatter's ring traffic, and the next layer's backward waits
    for it. Each matrix by its own group: in a deviceless v6e compile of the 750B MoE
    (fsdp=16 x expert=16, `validation/xla_moe_schedule.py` at its 750b size) XLA all-reduces the
    gradients of the weights split 256 ways (attention, router) and reduces the routed
    experts' (split over fsdp=16) in rings. `fsdp_grad` all-reduce asks for the
    synchronous all-reduce in any mode it allows, `fsdp_grad` auto for this per-matrix
    choice with any gather mode it allows (`TrainingConfig.fsdp_grad`)."""
    if cfg.fsdp_grad == "all-reduce":
        return "all-reduce"
    if (cfg.fsdp_grad == "auto" or (is_mixed(cfg) and cfg.overlap)) \
            and group > XLA_MAX_WINDOWED_RING:
        return "all-reduce"
    return "reduce-scatter"


def plain_gather_form(cfg: TrainingConfig) -> str:
    """How a weight gather that is no windowed einsum is issued: async or blocking (or
    windowed, when every gather is asked to be)."""
    if not cfg.overlap:
        return "blocking"
    return str({"mixed-async": "async", "mixed-blocking": "blocking"}.get(
        cfg.fsdp_gather, cfg.fsdp_gather))


def gather_form(cfg: TrainingConfig, key: str, phase: str, *, group: int,
                weights_replicated: bool, tensor: int, parallel_block: bool) -> str:
    """How the FSDP gather of one matrix (`key`, sharded over `group` chips) for one pass is
    issued: async, windowed or blocking.

    The mixed modes follow XLA's choice (docs/model.md): a windowed einsum needs the
    gathered matrix to feed exactly one matmul of the pass (forward: its projection;
    backward under remat full: the recomputation and the input gradient both read it,
    except the MLP's down projection, whose recomputation is dead; without remat only the
    input gradient reads it) and, with a tensor axis, not a row-parallel matmul whose
    output is then reduced over `tensor` (forward); the other matrices are plain gathers."""
    plain = plain_gather_form(cfg)
    if not cfg.overlap or not cfg.fsdp_gather.startswith("mixed-"):
        return plain
    if key.endswith("_dx") or weights_replicated or group > XLA_MAX_WINDOWED_RING:
        return plain
    if phase == "fwd":
        single = not (tensor > 1 and key in ROW_PARALLEL)
    elif cfg.remat_plan.recomputes_layer:
        # Matrices the recomputation does not read: its dead last matmuls (a dense MLP's
        # down projection, a shared expert's, a parallel block's attention output) and
        # the projections whose outputs come back from host memory.
        kept = cfg.remat_plan.kept_projections
        single = (key in ("w_down", "shared_down")
                  or (key == "wo" and (parallel_block or "out" in kept))
                  or (key in QKV_MATRICES and "qkv" in kept)
                  or (key in ("w_gate", "w_up") and "mlp_in" in kept))
    else:
        single = True
    return "windowed" if single else plain


def regathers_for_input_gradients(cfg: TrainingConfig) -> bool:
    """XLA gathers the query and key projections (all four attention matrices in an MoE
    layer: `MOE_REGATHER_KEYS`) a second time for their input gradients: under remat full in
    the mixed modes (the recomputation's copies are not kept alive across the backward)."""
    return cfg.remat_plan.rule == "full" and is_mixed(cfg) and cfg.overlap


def dp_split_per_matrix(cfg: TrainingConfig, mesh: LogicalMesh) -> bool:
    """The data-parallel gradient all-reduce goes as one all-reduce per weight matrix and
    one for each layer's norm scales (`TrainingConfig.dp_grad_split`): across slices only
    (a data or sequence axis over DCN), where XLA compiles it so; within a slice it stays
    one per layer."""
    return cfg.dp_grad_split == "per-matrix" and (
        mesh.dcn_size("data") > 1 or mesh.dcn_size("sequence") > 1)


def allreduced_alone(nbytes: float) -> bool:
    """A whole weight gradient of `nbytes` is all-reduced alone right after its matmul, not
    held for the layer's combined all-reduce (`XLA_ALLREDUCE_ALONE_BYTES`)."""
    return nbytes >= XLA_ALLREDUCE_ALONE_BYTES


def embedding_lookup_alltoall(*, tied: bool, shards: int) -> bool:
    """An untied, FSDP-sharded input table is never gathered: XLA looks rows up where they
    live with an all-to-all of the activations, and sends their gradients back the same
    way (docs/xla_crosscheck.md). Tied tables are gathered anyway for the logits."""
    return (not tied) and shards > 1


def embedding_grad_whole_vocab(*, tensor: int, rows_bytes: float, table_bytes: float) -> bool:
    """With the vocabulary split over `tensor` (and the rows looked up by all-to-all) XLA either
    scatter-adds the gradient rows into a table of the whole vocabulary, [vocab, d_model /
    fsdp], on every tensor shard, all-reduces it over `tensor` and slices the chip's shard
    (its all-reduce-scatter fusion, a reduce-scatter as tpusim's HLO importer reads it), or
    sends the rows back over fsdp by all-to-all and scatters only those its shard holds: the
    smaller of the table (`table_bytes`, per chip) and the rows (`rows_bytes`, the chip's
    [tokens, d_model] gradient rows, the all-to-all's buffer), the comparison of
    `embedding_grad_rows_gathered`. Three deviceless compiles fit it: the table in the v5e
    fsdp=4 x tensor=4 program of `validation/xla_progflags.py` (32 MiB for vocab 32768 and
    d_model 2048 / 4 against 64 MiB of rows) and in the committed HLO fixture of v5p fsdp=16 x
    tensor=4 (`train_fsdp_tp_v5p64`: 1 MiB for vocab 8192 and d_model 1024 / 16 against 8 MiB),
    the rows in the v5p fsdp=16 x tensor=4 program of `validation/xla_crosscheck.py`
    (`fsdp_tp_v5p64`, LLaMA-3-8B widths: a 62.6 MiB table against 16 MiB of rows, no
    reduce-scatter over `tensor`)."""
    return tensor > 1 and not embedding_grad_rows_gathered(rows_bytes=rows_bytes,
                                                           table_bytes=table_bytes)


def gathered_table_grad_kind(*, tensor: int) -> str:
    """The collective that sums the gradient of an input table gathered for the lookup
    (`embed_lookup` all-gather: the table's d_model replicated before `jnp.take`): XLA
    scatter-adds the rows into a zero table of the whole width and all-reduces it (v5e
    fsdp=16: one synchronous all-reduce of the [vocab, d_model] table, each chip slicing its
    shard after), or, with the vocabulary split over `tensor`, reduce-scatters it over fsdp
    (v5e fsdp=4 x tensor=4: its all-reduce-scatter fusion, a reduce-scatter as tpusim's HLO
    importer reads it); the compiles of `validation/xla_progflags.py`."""
    return "reduce-scatter" if tensor > 1 else "all-reduce"


def embedding_grad_rows_gathered(*, rows_bytes: float, table_bytes: float) -> bool:
    """XLA's SPMD partitioner replicates the smaller of the embedding gradient's scatter-add
    updates (the gradient rows, `rows_bytes`) and its table (`table_bytes`): True for the
    rows. With a data axis it does not send the rows back by all-to-all: the rows are every
    chip's, all-gathered, when they are smaller (v6e data=4 x fsdp=4: 256 MiB of rows for n =
    2048, d_model 4096 against a 1002 MiB table, docs/model.md), else the table, all-reduced
    (the v5e, v5p and v6e data=2 x fsdp=8 programs of benchmarks/xla_memory.py: a 128 MiB
    [32768, 2048] table against 256 MiB of rows). With the vocabulary split over `tensor` the
    same comparison decides between the rows' all-to-all and a whole-vocabulary table
    (`embedding_grad_whole_vocab`)."""
    return rows_bytes < table_bytes


def head_gathered_late(*, lookup_alltoall: bool, holds_embedding: bool,
                       forward_windowed: bool) -> bool:
    """XLA gathers the output projection right before the logits when the layers' forward
    gathers are plain (every such program of benchmarks/xla_memory.py); the windowed
    programs may hoist it to the step's start (v5e `full` and `minimal`, v5p and v6e
    `minimal`), which tpusim keeps for them: the gathered matrix is held from the gather
    (docs/model.md "Memory"). A tied table gathered for the lookup is held from then on."""
    return (lookup_alltoall or not holds_embedding) and not forward_windowed


def mlp_grads_after_attention(cfg: TrainingConfig, *, rs_windowed: bool) -> bool:
    """The chip's compiler runs a layer's MLP weight-gradient rings after the attention's
    backward with windowed weight gathers (`TrainingConfig.mlp_grad_after_attention`: the
    seven windowed v5e `full` and `minimal` programs of benchmarks/xla_memory.py), and every
    compiler does with int8 weight matmuls: in the AQT programs of `validation/xla_int8.py`
    (v5e fsdp=16, v5p fsdp=16 and fsdp=4 x tensor=4, `full`) the gate and up projections'
    weight gradients are the layer's last matmuls, and their recomputed outputs and output
    gradients are live at the attention's score gradient, on v5p too, whose bf16 programs
    free them before it (docs/model/int8.md)."""
    return (cfg.mlp_grad_after_attention and rs_windowed) or cfg.quantized


def sr_bits_early(cfg: TrainingConfig) -> bool:
    """XLA issues a layer backward's stochastic-rounding random bits early and holds them to
    their quantizations (`quant.SR_HELD_RULE`) where the plain weight gathers are async
    collectives (v5e fsdp=16 `full`: every weight gradient's and the q, k, v input
    gradients' `rng-bit-generator` together, after the MLP's input gradients); with blocking
    ones (v5p fsdp=16 and fsdp=4 x tensor=4 `full`, the same program otherwise) each
    generator runs right before the fusion that reads its bits, a few instructions earlier,
    and no bits are held (`validation/xla_int8.py`)."""
    return plain_gather_form(cfg) == "async"


def moe_dispatch_form(cfg: TrainingConfig) -> str:
    """How an MoE layer's tokens reach its experts over `expert`: "all-to-all" or "all-gather"
    (`TrainingConfig.moe_dispatch`; docs/model/moe.md "The dispatch form").

    `auto` is XLA's choice, which follows how the program shards the MoE block's tokens, not
    the mesh's sizes. Deviceless compiles (jax/libtpu 0.10.2) of the MaxText-style dropping MoE
    (`validation.xla_compile.lower_moe_train`, MaxText's router, 2 layers under remat full)
    with its batch split over fsdp x expert move the tokens by all-to-alls at every size
    tried: v6e 4x4 fsdp=4 x expert=4 with 8 experts top-2 (sequences of 512 and 2,048) and 64
    experts top-8, fsdp=8 x expert=2, and v6e 2x4 expert=8 (one expert per chip). With the MoE
    block's input constrained to the batch over fsdp only (`moe_tokens_gathered`, MaxText's
    `activation_batch_no_exp`) XLA gathers the tokens instead (the all-gather form); with the
    batch over fsdp only everywhere (`tokens_over_expert=False`) it all-reduces the combine
    over expert and sends no token by all-to-all. tpusim's batch is always split over
    data x fsdp x expert, so `auto` is the all-to-all form."""
    if cfg.moe_dispatch == "all-gather":
        return "all-gather"
    return "all-to-all"
