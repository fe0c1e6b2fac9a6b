"""The programs of the peak-HBM check (`validation.xla_memory`): the compiled decoders' configs
(chip, mesh, remat, batch, attention) and the other programs (MoE, decode), XLA's side (the
worker run under the jax python, the cache, what a dump shows) and tpusim's (the same step's
`hbm_peak_bytes`, its breakdown and host bytes).
"""


from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from topologies.mesh import parse_mesh
from validation import xla_compile, xla_live_ranges
from workloads.training import XLA_MAX_WINDOWED_RING, Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_memory.json"
DOC = REPO / "docs" / "validation.md"
MARKER, END = "<!-- peak-hbm -->", "<!-- /peak-hbm -->"

# A LLaMA-style decoder small enough to compile in tens of seconds: d_model 2048, 16 heads of
# 128 (8 KV heads), SwiGLU d_ff 8192, vocab 32768, untied embeddings.
DIMS = xla_compile.SMALL
LAYERS = 4
# The splash kernel's block sizes (every one of block_q, block_kv, block_kv_compute and the
# backward's): MaxText's default sa_block_* (base.yml).
FLASH_BLOCK = 512


def tpusim_model(layers: int = LAYERS, dims: str = "SMALL") -> dict:
    """The same decoder as a tpusim model (`dims`: the `xla_compile` widths, SMALL or WIDE)."""
    return xla_compile.tpusim_model_dict(getattr(xla_compile, dims), layers, "xla-memory")


# Physical topology, tpusim pod flags, per chip generation (and the large pods whose FSDP
# groups are longer than XLA's windowed rings).
CHIPS = {
    "v5e": ("v5e:4x4", ["--chip", "v5e", "--shape", "4x4"]),
    "v6e": ("v6e:4x4", ["--chip", "v6e", "--shape", "4x4"]),
    "v5p": ("v5p:2x2x4", ["--chip", "v5p", "--shape", "2x2x4"]),
    "v5p64": ("v5p:4x4x4", ["--chip", "v5p", "--shape", "4x4x4"]),
    "v6e256": ("v6e:16x16", ["--chip", "v6e", "--shape", "16x16"]),
    "v5e64": ("v5e:8x8", ["--chip", "v5e", "--shape", "8x8"]),
}
MESHES = {
    "fsdp": {"fsdp": 16},
    "fsdp_tp": {"fsdp": 4, "tensor": 4},
    "data_fsdp": {"data": 2, "fsdp": 8},
    "fsdp64": {"fsdp": 64},
    "fsdp256": {"fsdp": 256},
    "fsdp_tp8": {"fsdp": 8, "tensor": 8},
}


def _configs() -> dict[str, dict]:
    out = {}

    def add(chip, mesh, remat, seq=2048, batch=2, tp_act="replicated", f32_params=False,
            layers=LAYERS, dims="SMALL", attention="dot"):
        # The batch per chip is named when it is not the sequence length's usual one (2 at
        # seq 2048, 1 at seq 4096: 4096 tokens per chip), the layers when not `LAYERS`, the
        # widths when not `DIMS`.
        name = (f"{chip}_{mesh}_{remat}_s{seq}" + ("_tpsharded" if tp_act == "sharded" else "")
                + ("" if seq * batch == 4096 else f"_b{batch}")
                + ("_f32params" if f32_params else "")
                + ("" if layers == LAYERS else f"_l{layers}")
                + ("" if dims == "SMALL" else f"_{dims.lower()}")
                + ("" if attention == "dot" else f"_{attention}"))
        out[name] = dict(chip=chip, mesh=mesh, remat=remat, seq=seq, batch_per_chip=batch,
                         tp_activations=tp_act, f32_params=f32_params, layers=layers,
                         dims=dims, attention=attention)

    for chip in ("v5e", "v6e", "v5p"):
        for mesh in ("fsdp", "fsdp_tp", "data_fsdp"):
            for remat in ("none", "full"):
                add(chip, mesh, remat)
    for mesh in ("fsdp", "fsdp_tp", "data_fsdp"):
        add("v5e", mesh, "minimal")
    for chip in ("v6e", "v5p"):
        add(chip, "fsdp", "minimal")
    # v6e's fused scores (one f32 buffer instead of two) checked on a second v6e mesh.
    add("v6e", "data_fsdp", "minimal")
    for chip, mesh in (("v5e", "fsdp"), ("v5p", "fsdp_tp"), ("v6e", "fsdp")):
        add(chip, mesh, "offload")
    for remat in ("none", "full", "minimal"):
        add("v5e", "fsdp", remat, seq=4096, batch=1)
        add("v5p", "fsdp_tp", remat, seq=4096, batch=1)
    for remat in ("none", "full"):
        add("v5e", "fsdp_tp", remat, tp_act="sharded")
    # What makes v5e keep bf16 scores and the f32 logits at seq 4096 (one sequence per chip,
    # or the size of the scores): one sequence per chip at seq 2048, two at seq 4096; then the
    # rule (one sequence per chip) checked on another mesh, `offload`, and the other chips.
    add("v5e", "fsdp", "minimal", seq=2048, batch=1)
    add("v5e", "fsdp", "minimal", seq=4096, batch=2)
    add("v5e", "data_fsdp", "minimal", seq=4096, batch=1)
    add("v5e", "fsdp", "offload", seq=4096, batch=1)
    add("v5p", "fsdp", "minimal", seq=2048, batch=1)
    add("v6e", "fsdp", "minimal", seq=2048, batch=1)
    # Held out (compiled after the rules were written): `full` with one sequence per chip on
    # each chip, and one sequence per chip on fsdp=4 x tensor=4 (4 sequences over fsdp).
    for chip in ("v5e", "v5p", "v6e"):
        add(chip, "fsdp", "full", seq=2048, batch=1)
    add("v5e", "fsdp_tp", "minimal", seq=4096, batch=0.25)
    # f32 master weights cast to bf16 in each layer (MaxText's weight_dtype=float32,
    # dtype=bfloat16; tpusim --param-dtype fp32 --gather-dtype bf16).
    for chip in ("v5e", "v6e"):
        add(chip, "fsdp", "full", f32_params=True)
    # Checks of v6e keeping the logit gradients through the backward loop (read off the f32
    # `full` row), compiled before the rule was coded (tpusim's peaks without it written
    # down first, 2.090 and 0.995 GB): f32 weights under another remat, and `offload` with
    # one sequence per chip.
    add("v6e", "fsdp", "minimal", f32_params=True)
    add("v6e", "fsdp", "offload", seq=2048, batch=1)
    # FSDP groups longer than XLA's windowed rings (`XLA_MAX_WINDOWED_RING`, 32 chips): every
    # weight gathered plain and every weight gradient all-reduced whole (2 layers, to compile
    # in minutes on 64 and 256 chips).
    for chip, mesh in (("v5p64", "fsdp64"), ("v6e256", "fsdp256")):
        for remat in ("none", "full"):
            add(chip, mesh, remat, layers=2)
    # Held out (compiled after the whole-gradient rule was coded, tpusim's peaks written down
    # first): `minimal` on both, and v5e 8x8 at fsdp=64 (async gathers).
    for chip, mesh in (("v5p64", "fsdp64"), ("v6e256", "fsdp256")):
        add(chip, mesh, "minimal", layers=2)
    for remat in ("full", "minimal"):
        add("v5e64", "fsdp64", remat, layers=2)
    # The whole gradients at LLaMA-3-70B widths (1.7 GB a layer), also held out.
    add("v6e256", "fsdp256", "full", layers=2, dims="WIDE")
    # Held out for the size rule (written down first): LLaMA-3-8B widths, whose 112 MiB MLP
    # gradients tpusim all-reduces alone and whose 32 and 8 MiB attention ones it holds.
    add("v6e256", "fsdp256", "full", layers=2, dims="LLAMA3_8B")
    # Flash attention (issue 11): the same decoder with jax's Pallas splash-attention kernel
    # (MaxText's) in place of dot attention, blocks of `FLASH_BLOCK` queries and keys, on
    # each chip, fsdp and fsdp x tensor, remat full, minimal and none.
    for chip in ("v5e", "v6e", "v5p"):
        for mesh in ("fsdp", "fsdp_tp"):
            for remat in ("none", "full"):
                add(chip, mesh, remat, attention="splash")
    for chip in ("v5e", "v6e", "v5p"):
        add(chip, "fsdp", "minimal", attention="splash")
    add("v5e", "fsdp", "full", seq=4096, batch=1, attention="splash")
    # Compiled after the v6e fsdp x tensor `full` row showed its logits freed before the
    # backward loop (tpusim's peak for it written down first): the same under `minimal`.
    add("v6e", "fsdp_tp", "minimal", attention="splash")
    # After the v5e one-sequence row at seq 4096 (-21.0%): one sequence per chip at 2048.
    add("v5e", "fsdp", "full", seq=2048, batch=1, attention="splash")
    # Saved activations under tensor=8 (issue 29): fsdp=8 x tensor=8 on a 4x4x4 v5p, the
    # residual stream sharded over `tensor` (MaxText), 8 layers so the saved stacks dominate,
    # under `minimal` and MaxText's named policies (jax.checkpoint with the policy MaxText
    # uses, xla_compile.MAXTEXT_NAMED); tpusim's peaks written down before the compiles.
    for remat in ("minimal", "save_dot_except_mlpwi", "save_qkv_proj",
                  "save_dot_with_context_except_mlp", "full"):
        add("v5p64", "fsdp_tp8", remat, batch=0.5, tp_act="sharded", layers=8)
    return out


CONFIGS = _configs()

# The other kinds of program (issue 11: MoE and decode), as validation/xla_crosscheck.py
# compiles them: the MaxText-style dropping MoE training step on fsdp=4 x expert=4 v6e (with
# Adam here, like the dense rows, and without the final norm the crosscheck's program has
# since gained: a [tokens, d_model] buffer) and a one-token decode step of a
# 2-layer LLaMA-3-8B on tensor=8 v5e against a 2048-token KV cache (heads over `tensor`,
# argmax of the bf16 logits: tpusim's `--sampling greedy`).
OTHER = {
    "moe_v6e_fsdp_expert_full_s2048": dict(
        mode="moe_train", topology="v6e:4x4", pod=["--chip", "v6e", "--shape", "4x4"],
        mesh={"fsdp": 4, "expert": 4}, seq=2048, batch_per_chip=1, layers=2, remat="full",
        moe=dict(d_model=1024, d_ff=2048, num_experts=8, top_k=2, capacity_factor=1.25,
                 num_heads=8, head_dim=128, vocab_size=4096, router="maxtext")),
    # The same step with the final norm (as tpusim's models have it), whose replicated scale
    # gradient XLA all-reduces together with the loss value (the one-sequence logits rule).
    "moe_v6e_fsdp_expert_full_s2048_norm": dict(
        mode="moe_train", topology="v6e:4x4", pod=["--chip", "v6e", "--shape", "4x4"],
        mesh={"fsdp": 4, "expert": 4}, seq=2048, batch_per_chip=1, layers=2, remat="full",
        final_norm=True,
        moe=dict(d_model=1024, d_ff=2048, num_experts=8, top_k=2, capacity_factor=1.25,
                 num_heads=8, head_dim=128, vocab_size=4096, router="maxtext")),
    "decode_v5e_tp8_kv2048": dict(
        mode="decode", topology="v5e:2x4", pod=["--chip", "v5e", "--shape", "2x4"],
        mesh={"tensor": 8}, batch=8, kv_len=2048, layers=2, dims=xla_compile.LLAMA3_8B),
}
ALL = [*CONFIGS, *OTHER]


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _other_worker(name: str) -> dict:
    cfg = OTHER[name]
    mesh, devices = xla_compile.build_mesh(cfg["topology"], cfg["mesh"])
    if cfg["mode"] == "moe_train":
        lowered = xla_compile.lower_moe_train(mesh, seq=cfg["seq"], num_layers=cfg["layers"],
                                              optimizer="adam",
                                              final_norm=cfg.get("final_norm", False), **cfg["moe"])
    else:
        model = xla_compile.Decoder(mesh, cfg["dims"])
        lowered = model.lower_decode(cfg["layers"], cfg["batch"], cfg["kv_len"])
    compiled = lowered.compile()
    return {"config": name, "num_chips": int(devices.size), **xla_compile.memory_stats(compiled),
            **xla_compile.cost_stats(compiled), **gather_forms(compiled.as_text())}


def worker(name: str, dump: str | None) -> None:
    """Compile one program; besides `memory_analysis()` it records `hbm_peak_bytes`, the HBM
    peak of XLA's buffer assignment (`xla_live_ranges.hbm_peak` of the dump, written to a
    temporary directory when `dump` is None)."""
    with tempfile.TemporaryDirectory() as tmp:
        dump = dump or tmp
        xla_compile.init_jax(dump)
        result = _other_worker(name) if name in OTHER else _dense_worker(name)

        xla_compile.emit({**result, "hbm_peak_bytes": int(xla_live_ranges.hbm_peak(Path(dump)))})


def _dense_worker(name: str) -> dict:
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    cfg = CONFIGS[name]
    # The devices in topology order, reshaped: data outermost, tensor innermost.
    mesh, devices = xla_compile.build_mesh(CHIPS[cfg["chip"]][0], MESHES[cfg["mesh"]],
                                           placement="topology")
    n_chips = devices.size
    tp = "tensor" if "tensor" in mesh.axis_names else None
    bs = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    bs = bs[0] if len(bs) == 1 else bs
    # Residual stream between sublayers: replicated over `tensor` (Megatron; tpusim
    # --tp-activations replicated) or its sequence dim split over `tensor` (sharded).
    seq_ax = tp if cfg["tp_activations"] == "sharded" else None
    remat = cfg["remat"]
    # The weight matmuls' outputs are named for `offload` (MaxText's checkpoint_name tags); the
    # other policies leave the traced program as it was.
    if remat not in ("none", "full", "minimal"):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        from jax.ad_checkpoint import checkpoint_name as tag
    else:
        tag = xla_compile._identity_tag
    model = xla_compile.Decoder(mesh, getattr(xla_compile, cfg.get("dims", "SMALL")),
                                act_spec=P(bs, seq_ax, None), tag=tag,
                                param_dtype="float32" if cfg.get("f32_params") else "bfloat16",
                                attention=cfg.get("attention", "dot"), flash_block=FLASH_BLOCK)
    # The layers' weights stacked on a leading layer axis and scanned, as MaxText does
    # (scan_layers): one loop body, saved activations stacked per layer.
    params = model.params(cfg.get("layers", LAYERS), stacked=True)
    batch = int(round(cfg["batch_per_chip"] * n_chips))
    tokens = model.sds((batch, cfg["seq"]), P(bs, None), jnp.int32)
    compiled = model.lower_train(params, tokens, remat=remat, scan=True).compile()
    return {"config": name, "num_chips": int(n_chips), **xla_compile.memory_stats(compiled),
            **xla_compile.cost_stats(compiled), **gather_forms(compiled.as_text())}


def xla_hbm_peak(x: dict) -> float:
    """XLA's HBM peak of a cached program: `hbm_peak_bytes` (its buffer assignment), or
    `memory_analysis()`'s peak for a program compiled before that field existed (equal to it
    on every dense training program)."""
    return float(x.get("hbm_peak_bytes", x["peak_bytes"]))


def backfill_from_dumps(cache: dict, dirs: list[str]) -> list[str]:
    """Set `hbm_peak_bytes` of the cached programs that lack it from earlier dumps
    (DIR/PROGRAM, as `--dump DIR` writes them); the names filled."""
    done = []
    for name, x in sorted(cache.items()):
        if "hbm_peak_bytes" in x:
            continue
        for d in dirs:
            if list(Path(d, name).glob("*after_optimizations-live-range.txt")):
                x["hbm_peak_bytes"] = int(xla_live_ranges.hbm_peak(Path(d, name)))
                done.append(name)
                break
    return done


def gather_forms(hlo: str) -> dict:
    """How the optimized program gathers weights: windowed-einsum loops (collective matmuls),
    async and blocking all-gathers (counted once per HLO instruction, not per trip); and how
    it reduces gradients: reduce-scatters (plain, TPU all-reduce-scatter fusions, windowed
    loops) and synchronous all-reduces (no start/done pair)."""
    return {"windowed_ag_loops": len(re.findall(r"body=%[\w.]*windowed_dot_general_body_ag", hlo)),
            "reduce_scatters": len(re.findall(r"\breduce-scatter\(", hlo))
            + len(re.findall(r"calls=%all-reduce-scatter", hlo))
            + len(re.findall(r"body=%[\w.]*windowed_dot_general_body_rs", hlo)),
            "sync_all_reduces": len(re.findall(r"\ball-reduce\(", hlo)),
            # TPU wraps async collectives in "async collective fusions".
            "async_all_gathers": len(re.findall(r"\ball-gather-start\(", hlo))
            + len(re.findall(r"= \S+ fusion\([^\n]*async_collective_fusion", hlo))
            + len(re.findall(r"\basync-collective-start", hlo)),
            "all_gathers": len(re.findall(r"\ball-gather\(", hlo))}


def fsdp_gather_flag(xla: dict) -> str:
    """tpusim's --fsdp-gather for the form XLA chose: `windowed` when it turned weight gathers
    into collective-matmul loops, else `async` (start/done pairs) or `blocking`."""
    if xla.get("windowed_ag_loops"):
        return "windowed"
    return "async" if xla.get("async_all_gathers") else "blocking"


def fsdp_grad_flag(name: str, xla: dict) -> str:
    """tpusim's --fsdp-grad for a dense program: `all-reduce` when its FSDP group is longer
    than XLA's windowed rings (`XLA_MAX_WINDOWED_RING`), where XLA reduces every weight
    gradient by a synchronous all-reduce of the whole gradient, else `reduce-scatter`. A
    compile that read otherwise (a reduce-scatter in such a program) is an error: the rule
    would not hold."""
    if MESHES[CONFIGS[name]["mesh"]].get("fsdp", 1) <= XLA_MAX_WINDOWED_RING:
        return "reduce-scatter"
    if xla.get("reduce_scatters", 0):
        raise RuntimeError(f"{name}: XLA reduce-scatters {xla['reduce_scatters']} gradients "
                           f"over more than {XLA_MAX_WINDOWED_RING} chips; the all-reduce rule "
                           f"does not hold there")
    return "all-reduce"


# --------------------------------------------------------------------------------------------
# tpusim side and the table (runs under the project python)
# --------------------------------------------------------------------------------------------

def tpusim_other_peak(name: str, xla: dict) -> dict:
    """`tpusim train` (MoE) or `tpusim decode` with the program's model, mesh and batch."""
    cfg = OTHER[name]
    mesh = ",".join(f"{k}={v}" for k, v in cfg["mesh"].items())
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model.yaml")
        if cfg["mode"] == "moe_train":
            m = cfg["moe"]
            model.write_text(xla_compile.tpusim_model_yaml(xla_compile.tpusim_model_dict(
                dict(d_model=m["d_model"], num_heads=m["num_heads"],
                     num_kv_heads=m["num_heads"], head_dim=m["head_dim"], d_ff=m["d_ff"],
                     vocab_size=m["vocab_size"], num_experts=m["num_experts"],
                     experts_per_token=m["top_k"], moe_d_ff=m["d_ff"]),
                cfg["layers"], name)))
            cmd = [sys.executable, "-m", "sim", "train", *cfg["pod"], "--model", str(model),
                   "--seq-len", str(cfg["seq"]), "--batch-per-chip", str(cfg["batch_per_chip"]),
                   "--mesh", mesh, "--remat", cfg["remat"], "--attention", "dot",
                   "--capacity-factor", str(m["capacity_factor"]),
                   "--fsdp-gather", fsdp_gather_flag(xla), "--json"]
        else:
            model.write_text(xla_compile.tpusim_model_yaml(xla_compile.tpusim_model_dict(
                cfg["dims"], cfg["layers"], name)))
            cmd = [sys.executable, "-m", "sim", "decode", *cfg["pod"], "--model", str(model),
                   "--batch", str(cfg["batch"]), "--context-len", str(cfg["kv_len"]),
                   "--mesh", mesh, "--sampling", "greedy", "--json"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tpusim failed: {' '.join(cmd)}\n{r.stderr}")
    j = json.loads(r.stdout)
    return {"peak_bytes": j["hbm_peak_bytes"], "breakdown": j.get("hbm_peak_breakdown", {}),
            "host_bytes": 0.0}


def tpusim_peak(name: str, xla: dict) -> dict:
    if name in OTHER:
        return tpusim_other_peak(name, xla)
    cfg = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model.yaml")
        model.write_text(xla_compile.tpusim_model_yaml(tpusim_model(cfg.get("layers", LAYERS),
                                                        cfg.get("dims", "SMALL"))))
        mesh = ",".join(f"{k}={v}" for k, v in MESHES[cfg["mesh"]].items())
        cmd = [sys.executable, "-m", "sim", "train", *CHIPS[cfg["chip"]][1],
               "--model", str(model), "--seq-len", str(cfg["seq"]),
               "--batch-per-chip", str(cfg["batch_per_chip"]), "--mesh", mesh,
               "--remat", cfg["remat"],
               "--attention", "flash" if cfg.get("attention") == "splash" else "dot",
               "--tp-activations", cfg["tp_activations"],
               *(["--param-dtype", "fp32", "--gather-dtype", "bf16"]
                 if cfg.get("f32_params") else []),
               "--fsdp-gather", fsdp_gather_flag(xla),
               "--fsdp-grad", fsdp_grad_flag(name, xla), "--json"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tpusim train failed: {' '.join(cmd)}\n{r.stderr}")
    j = json.loads(r.stdout)
    return {"peak_bytes": j["hbm_peak_bytes"], "breakdown": j.get("hbm_peak_breakdown", {}),
            "host_bytes": tpusim_host_bytes(name) if cfg["remat"] == "offload" else 0.0}


def tpusim_host_bytes(name: str) -> float:
    """What tpusim's `offload` keeps in host memory by the end of the forward: every layer's
    offloaded set (the PCIe bytes of its `offload_activations` ops)."""
    cfg = CONFIGS[name]
    model = model_from_dict(tpusim_model(cfg.get("layers", LAYERS), cfg.get("dims", "SMALL")))
    axes = MESHES[cfg["mesh"]]
    mesh = parse_mesh(",".join(f"{k}={v}" for k, v in axes.items()))
    n_chips = 1
    for v in axes.values():
        n_chips *= v
    tc = TrainingConfig(seq_len=cfg["seq"], batch_per_chip=cfg["batch_per_chip"],
                        remat=Remat(cfg["remat"]), attention="dot",
                        tp_activations=cfg["tp_activations"])
    trace = compile_training_step(model, mesh, n_chips, tc)
    return sum(op.bytes for op in trace.ops if op.name == "offload_activations")


def run_xla(name: str, jax_python: str, dump: str | None) -> dict:
    return xla_compile.run_worker("validation.xla_memory", name, jax_python,
                                  ["--dump", str(Path(dump, name))] if dump else [])


