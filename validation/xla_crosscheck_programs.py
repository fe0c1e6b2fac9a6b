"""The programs of the XLA cross-check (`validation.xla_crosscheck`): the compiled training
steps and the gather-form probes, tpusim's variants of them, the chips' clocks that turn XLA's
estimated cycles into seconds, and the worker that compiles one program under the jax python.
"""

from __future__ import annotations

from pathlib import Path

from validation import xla_compile
from validation.xla_hlo_read import parse_hlo_collectives, parse_hlo_costs

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
    # Held out (issue 29): compiled after the embedding gradient's size rule
    # (`xla_rules.embedding_grad_whole_vocab`) and tpusim's predictions were written down
    # (validation/results/xla_embed_grad_predictions.txt); the rule picks the rows (a 250.5 MiB
    # table against 16 MiB of rows a chip) where its former form (tensor > 1) picked the table.
    "fsdp_tp_v5e16_8b": dict(topology="v5e:4x4", mesh={"fsdp": 4, "tensor": 4}, layers=2,
                             seq=2048, batch_per_chip=0.25, mode="train",
                             when="after the embedding gradient's size rule was written "
                                  "down, with tpusim's predictions (held out: "
                                  "validation/results/xla_embed_grad_predictions.txt); the "
                                  "rule held: no reduce-scatter over tensor, the all-to-alls "
                                  "exact. The fsdp rows miss: XLA builds no windowed loop "
                                  "here and has 5 reduce-scatters to tpusim's 15 (not read "
                                  "off yet)"),
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

def named_dims(dims):
    """A configuration's model widths: a dict, or the name of one of this module's (`SMALL`)."""
    return globals()[dims] if isinstance(dims, str) else dims


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def worker(name: str, dump_dir: str | None) -> None:
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

