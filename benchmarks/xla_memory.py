"""Peak HBM of training steps: XLA's compiled programs against tpusim (issue 11, memory).

Two sides:

* **XLA** (`--compile`, needs a `jax[tpu]==0.10.2` python, `--jax-python`): a small LLaMA-style
  decoder (GQA, SwiGLU, RMSNorm in f32, untied embeddings, plain dot attention with f32
  scores, bf16 params, f32 Adam moments, layers scanned as MaxText's scan_layers) is compiled
  deviceless for a real TPU topology with each remat policy (`none`; `full` =
  `jax.checkpoint` per layer; `minimal` = `jax.checkpoint` with
  `checkpoint_dots_with_no_batch_dims`, MaxText's minimal policy; `offload` =
  `save_and_offload_only_these_names` sending the weight matmuls' outputs to pinned host
  memory, MaxText's minimal_offloaded) and mesh. Per program it
  records `compiled.memory_analysis()` (peak, temp, argument and host temp bytes),
  `compiled.cost_analysis()` (flops, bytes accessed) and how XLA gathered the weights. Results
  are cached in `benchmarks/results/xla_memory.json` so the table can be regenerated without
  jax.
* **tpusim**: `tpusim train --json` with the same model, mesh, batch, sequence length, remat and
  `--attention dot` (`hbm_peak_bytes`, `hbm_peak_breakdown`).

Run:
    .venv/bin/python benchmarks/xla_memory.py --compile --jax-python /work/fid-venv/bin/python
    .venv/bin/python benchmarks/xla_memory.py [--write]    # table from the cache

`--write` rewrites docs/validation.md from the `<!-- peak-hbm -->` marker on (the sections
before it belong to validate_maxtext.py and validate_hlo.py). This file is also the XLA worker
(`--worker NAME`, run under the jax python; it imports no tpusim code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "benchmarks" / "results" / "xla_memory.json"
DOC = REPO / "docs" / "validation.md"
MARKER = "<!-- peak-hbm -->"

# A LLaMA-style decoder small enough to compile in tens of seconds: d_model 2048, 16 heads of
# 128 (8 KV heads), SwiGLU d_ff 8192, vocab 32768, untied embeddings.
DIMS = dict(d_model=2048, num_heads=16, num_kv_heads=8, head_dim=128, d_ff=8192,
            vocab_size=32768)
LAYERS = 4

# Physical topology, tpusim pod flags, per chip generation.
CHIPS = {
    "v5e": ("v5e:4x4", ["--chip", "v5e", "--shape", "4x4"]),
    "v6e": ("v6e:4x4", ["--chip", "v6e", "--shape", "4x4"]),
    "v5p": ("v5p:2x2x4", ["--chip", "v5p", "--shape", "2x2x4"]),
}
MESHES = {
    "fsdp": {"fsdp": 16},
    "fsdp_tp": {"fsdp": 4, "tensor": 4},
    "data_fsdp": {"data": 2, "fsdp": 8},
}


def _configs() -> dict[str, dict]:
    out = {}

    def add(chip, mesh, remat, seq=2048, batch=2, tp_act="replicated"):
        name = f"{chip}_{mesh}_{remat}_s{seq}" + ("_tpsharded" if tp_act == "sharded" else "")
        out[name] = dict(chip=chip, mesh=mesh, remat=remat, seq=seq, batch_per_chip=batch,
                         tp_activations=tp_act)

    for chip in ("v5e", "v6e", "v5p"):
        for mesh in MESHES:
            for remat in ("none", "full"):
                add(chip, mesh, remat)
    for mesh in MESHES:
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
    return out


CONFIGS = _configs()


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _worker(name: str, dump: str | None) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if dump:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                   " --xla_dump_hlo_as_text").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = CONFIGS[name]
    d, h, kv, hd, ff, vocab = (DIMS[k] for k in ("d_model", "num_heads", "num_kv_heads",
                                                 "head_dim", "d_ff", "vocab_size"))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=CHIPS[cfg["chip"]][0])
    axes = MESHES[cfg["mesh"]]
    names, shape = tuple(axes), tuple(axes.values())
    # The devices in topology order, reshaped: data outermost, tensor innermost.
    devices = np.array(topo.devices).reshape(shape)
    mesh = Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))
    n_chips = devices.size
    tp = "tensor" if "tensor" in names else None
    fs = "fsdp" if "fsdp" in names else None
    bs = tuple(a for a in ("data", "fsdp") if a in names)
    bs = bs[0] if len(bs) == 1 else bs
    bf = jnp.bfloat16
    wspec = {"wq": P(fs, tp), "wk": P(fs, tp), "wv": P(fs, tp), "wo": P(tp, fs),
             "w1": P(fs, tp), "w3": P(fs, tp), "w2": P(tp, fs), "n1": P(None), "n2": P(None)}
    wshape = {"wq": (d, h * hd), "wk": (d, kv * hd), "wv": (d, kv * hd), "wo": (h * hd, d),
              "w1": (d, ff), "w3": (d, ff), "w2": (ff, d), "n1": (d,), "n2": (d,)}
    top_spec = {"embed": P(tp, fs), "unembed": P(fs, tp), "nf": P(None)}
    top_shape = {"embed": (vocab, d), "unembed": (d, vocab), "nf": (d,)}

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))

    params = {k: sds(top_shape[k], top_spec[k]) for k in top_shape}
    # The layers' weights stacked on a leading layer axis and scanned, as MaxText does
    # (scan_layers): one loop body, saved activations stacked per layer.
    params["layers"] = {k: sds((LAYERS, *wshape[k]), P(None, *wspec[k])) for k in wshape}
    # Residual stream between sublayers: replicated over `tensor` (Megatron; tpusim
    # --tp-activations replicated) or its sequence dim split over `tensor` (sharded).
    seq_ax = tp if cfg["tp_activations"] == "sharded" else None
    act_spec = P(bs, seq_ax, None)

    def constrain(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, act_spec))

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(jnp.float32)).astype(bf)

    def attention(q, k, v):
        b, s, _ = q.shape
        q = q.reshape(b, s, kv, h // kv, hd)
        k = k.reshape(b, s, kv, hd)
        v = v.reshape(b, s, kv, hd)
        sc = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / (hd ** 0.5)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -1e30)
        p = jax.nn.softmax(sc, axis=-1).astype(bf)
        return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h * hd)

    remat = cfg["remat"]
    # The weight matmuls' outputs are named for `offload` (MaxText's checkpoint_name tags:
    # query_proj, key_proj, value_proj, out_proj, mlpwi_0/1, mlpwo); the other policies leave
    # the traced program as it was.
    if remat == "offload":
        from jax.ad_checkpoint import checkpoint_name as tag
    else:
        def tag(x, _name):
            return x

    def layer(x, w):
        y = rms(x, w["n1"])
        a = attention(tag(y @ w["wq"], "query_proj"), tag(y @ w["wk"], "key_proj"),
                      tag(y @ w["wv"], "value_proj"))
        x = constrain(x + tag(a @ w["wo"], "out_proj"))
        y = rms(x, w["n2"])
        m = jax.nn.silu(tag(y @ w["w1"], "mlpwi_0")) * tag(y @ w["w3"], "mlpwi_1")
        return constrain(x + tag(m @ w["w2"], "mlpwo"))

    if remat == "full":
        layer_fn = jax.checkpoint(layer)
    elif remat == "minimal":
        layer_fn = jax.checkpoint(
            layer, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    elif remat == "offload":
        # tpusim's `offload`: the layer input stays in HBM (the scan carry a checkpointed body
        # saves), the minimal set (the weight matmuls' outputs) goes to pinned host memory,
        # everything else is recomputed: MaxText's `minimal_offloaded` policy.
        layer_fn = jax.checkpoint(
            layer, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=["query_proj", "key_proj", "value_proj",
                                              "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"],
                offload_src="device", offload_dst="pinned_host"))
    else:
        layer_fn = layer
    batch = int(round(cfg["batch_per_chip"] * n_chips))
    tokens = sds((batch, cfg["seq"]), P(bs, None), jnp.int32)

    def loss_fn(p, tok):
        x = constrain(jnp.take(p["embed"], tok, axis=0))
        x, _ = jax.lax.scan(lambda x, w: (layer_fn(x, w), None), x, p["layers"])
        x = rms(x, p["nf"])
        logits = (x @ p["unembed"]).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, tok[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - tgt)

    def step(p, m1, m2, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g.astype(jnp.float32), m1, g)
        m2 = jax.tree.map(lambda m, g: 0.95 * m + 0.05 * jnp.square(g.astype(jnp.float32)),
                          m2, g)
        p = jax.tree.map(lambda w, a, b: (w.astype(jnp.float32) - 1e-4 * a
                                          * jax.lax.rsqrt(b + 1e-8)).astype(bf), p, m1, m2)
        return loss, p, m1, m2

    mom = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                                      sharding=s.sharding), params)
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, mom, mom, tokens).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0]
    out = {"config": name, "num_chips": int(n_chips),
           "peak_bytes": int(mem.peak_memory_in_bytes),
           "temp_bytes": int(mem.temp_size_in_bytes),
           "argument_bytes": int(mem.argument_size_in_bytes),
           "output_bytes": int(mem.output_size_in_bytes),
           "alias_bytes": int(mem.alias_size_in_bytes),
           # What `offload` keeps in pinned host memory (not part of the HBM peak).
           "host_temp_bytes": int(getattr(mem, "host_temp_size_in_bytes", 0)),
           "flops": float(cost.get("flops", 0.0)),
           "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
           **gather_forms(compiled.as_text())}
    print("XLA_JSON " + json.dumps(out))


def gather_forms(hlo: str) -> dict:
    """How the optimized program gathers weights: windowed-einsum loops (collective matmuls),
    async and blocking all-gathers (counted once per HLO instruction, not per trip)."""
    import re

    return {"windowed_ag_loops": len(re.findall(r"body=%[\w.]*windowed_dot_general_body_ag", hlo)),
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


# --------------------------------------------------------------------------------------------
# tpusim side and the table (runs under the project python)
# --------------------------------------------------------------------------------------------

def tpusim_peak(name: str, xla: dict) -> dict:
    cfg = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model.yaml")
        model.write_text("name: xla-memory\nmlp: swiglu\ntied_embeddings: false\n"
                         f"num_layers: {LAYERS}\n"
                         + "".join(f"{k}: {v}\n" for k, v in DIMS.items()))
        mesh = ",".join(f"{k}={v}" for k, v in MESHES[cfg["mesh"]].items())
        cmd = [sys.executable, "-m", "sim", "train", *CHIPS[cfg["chip"]][1],
               "--model", str(model), "--seq-len", str(cfg["seq"]),
               "--batch-per-chip", str(cfg["batch_per_chip"]), "--mesh", mesh,
               "--remat", cfg["remat"], "--attention", "dot",
               "--tp-activations", cfg["tp_activations"],
               "--fsdp-gather", fsdp_gather_flag(xla), "--json"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tpusim train failed: {' '.join(cmd)}\n{r.stderr}")
    j = json.loads(r.stdout)
    return {"peak_bytes": j["hbm_peak_bytes"], "breakdown": j.get("hbm_peak_breakdown", {}),
            "host_bytes": tpusim_host_bytes(name) if cfg["remat"] == "offload" else 0.0}


def tpusim_host_bytes(name: str) -> float:
    """What tpusim's `offload` keeps in host memory by the end of the forward: every layer's
    offloaded set (the PCIe bytes of its `offload_activations` ops)."""
    sys.path.insert(0, str(REPO))
    from topologies.mesh import parse_mesh
    from workloads.models import model_from_dict
    from workloads.training import Remat, TrainingConfig, compile_training_step

    cfg = CONFIGS[name]
    model = model_from_dict(dict(name="xla-memory", mlp="swiglu", tied_embeddings=False,
                                 num_layers=LAYERS, **DIMS))
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
    cmd = [jax_python, str(Path(__file__).resolve()), "--worker", name]
    if dump:
        cmd += ["--dump", str(Path(dump, name))]
    # Deviceless compiles need no exclusive TPU: let several processes load libtpu.
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("XLA_JSON "):
            return json.loads(line[len("XLA_JSON "):])
    raise RuntimeError(f"XLA worker failed for {name}:\n{r.stderr[-3000:]}")


def describe(name: str) -> str:
    c = CONFIGS[name]
    mesh = " x ".join(f"{k}={v}" for k, v in MESHES[c["mesh"]].items())
    tp = ", tp-act sharded" if c["tp_activations"] == "sharded" else ""
    return (f"{CHIPS[c['chip']][0]} {mesh}, seq {c['seq']}, batch/chip {c['batch_per_chip']}, "
            f"remat {c['remat']}{tp}")


def table(cache: dict) -> tuple[str, list[float]]:
    rows, errs = [], []
    for name in CONFIGS:
        x = cache.get(name)
        if x is None:
            continue
        s = tpusim_peak(name, x)
        err = s["peak_bytes"] / x["peak_bytes"] - 1
        errs.append(err)
        top = sorted(s["breakdown"].items(), key=lambda kv: -kv[1])[:3]
        comp = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in top if v > 0)
        host = (f"{x.get('host_temp_bytes', 0) / 1e9:.2f} / {s['host_bytes'] / 1e9:.2f} GB"
                if CONFIGS[name]["remat"] == "offload" else "")
        rows.append(f"| {describe(name)} | {fsdp_gather_flag(x)} | "
                    f"{x['peak_bytes'] / 1e9:.2f} GB | {s['peak_bytes'] / 1e9:.2f} GB | "
                    f"{err:+.1%} | {comp} | {host} |")
    head = ["| program | weight gathers | XLA peak | tpusim peak | error | "
            "tpusim's largest categories (GB) | host memory, XLA / tpusim |",
            "|---|---|---:|---:|---:|---|---:|"]
    return "\n".join(head + rows), errs


def section(cache: dict) -> str:
    tab, errs = table(cache)
    abs_e = [abs(e) for e in errs]
    med = statistics.median(abs_e) if abs_e else float("nan")
    worst = max(errs, key=abs) if errs else float("nan")
    m = DIMS
    return "\n".join([
        MARKER, "",
        "## Peak HBM against XLA's compiled programs", "",
        "_Generated by `benchmarks/xla_memory.py --write` from the cached compiles in "
        "`benchmarks/results/xla_memory.json`._", "",
        f"XLA side: a LLaMA-style decoder (d_model {m['d_model']}, {m['num_heads']} heads / "
        f"{m['num_kv_heads']} KV heads of {m['head_dim']}, SwiGLU d_ff {m['d_ff']}, vocab "
        f"{m['vocab_size']}, untied embeddings, {LAYERS} layers scanned (`jax.lax.scan` over "
        "stacked weights, as MaxText), RMSNorm in f32, dot attention "
        "with f32 scores, bf16 params, f32 Adam moments, donated arguments) compiled deviceless "
        "by `jax[tpu]==0.10.2`; the peak is `compiled.memory_analysis().peak_memory_in_bytes`. "
        "tpusim side: `tpusim train --attention dot --remat R --tp-activations T --json` on the "
        "same model, mesh and batch (`hbm_peak_bytes`; the last column is the largest entries "
        "of `hbm_peak_breakdown`). Remat `minimal` is `jax.checkpoint` with "
        "`checkpoint_dots_with_no_batch_dims`. The residual stream is replicated over `tensor` "
        "unless the row says `tp-act sharded` (its sequence dim split over `tensor`).", "",
        tab, "",
        f"{len(errs)} programs: median |error| {med:.1%}, worst {worst:+.1%} (target: within "
        "10%).", "",
        "Remat `offload` is `jax.checkpoint` with `save_and_offload_only_these_names` "
        "(MaxText's `minimal_offloaded`: the weight matmuls' outputs, tagged with "
        "`checkpoint_name` as MaxText tags them, go to `pinned_host`; nothing else is saved, "
        "so the scan keeps only the layer input in HBM), the same split as tpusim's "
        "`--remat offload` (docs/model.md \"Memory\"); its last column compares XLA's "
        "`host_temp_size_in_bytes` with every layer's offloaded set in tpusim.", "",
        f"Not compiled yet (in `CONFIGS`; `--compile` adds them): "
        f"{', '.join(n for n in CONFIGS if n not in cache) or 'none'}.", "",
        "How the rules were read off these programs (`--dump DIR` keeps XLA's buffer "
        "assignment and live ranges; HBM occupancy over the schedule is the sum of the "
        "values live at each point, host (`S(5)`) buffers left out, which XLA's own peak "
        "listing in `*live-range.txt` mixes in): the saved stacks are allocated before the "
        "forward loop and die after the backward loop (v5e fsdp `minimal`; the same "
        "loop-carried stacks in the others); `minimal` keeps no MLP output projection (v5e "
        "fsdp `minimal`, checked on v6e and v5p). The forward's f32 scores are a buffer of "
        "their own, next to the f32 exponentials, in the v5e and v5p programs whose mesh "
        "has one sharded axis (fsdp `minimal`, `offload`, `none`); v6e (every program) and "
        "v5e and v5p on a mesh of two axes fuse the score matmul with the exponentials (one "
        "f32 buffer: the data x fsdp and fsdp x tensor `minimal` rows); the v5p fsdp x "
        "tensor `full` program at seq 4096 does not fuse (under `full` the peak is the same "
        "either way), so XLA's heuristic also weighs the size. Windowed programs still "
        "gather each weight whole in their backward (v5e, v6e, v5p fsdp `full`), and the "
        "MLP's matrices die with its weight-gradient matmul. The fsdp x tensor programs "
        "with activations replicated over `tensor` keep the bf16 logits and the final "
        "norm's output through the backward loop under `full`, `minimal` and `offload`, "
        "whatever the gather form (v5p `full`; checked on v5p `offload` and v5e "
        "`minimal`). A windowed MLP's gate/up output buffers are allocated at the start of "
        "the layer (v5e `minimal`; checked on the other windowed rows). A recomputing "
        "backward copies the layer's stack entries out of the stacks (every `minimal` "
        "program; checked on v5p `full` and `offload`). Under `offload` a layer's offloaded "
        "tensors stay in HBM until their copies to host complete, in the next layer's "
        "forward (v5e fsdp `offload`, whose peak is that next softmax; the v5p and v6e "
        "`offload` programs carry the same buffers). Each rule was fitted on the rows "
        "named and the other rows are its check. The host-memory column matches exactly in "
        "every `offload` program. "
        "Known remaining differences: the v6e fsdp `offload` row peaks in the backward "
        "of the last layer, where XLA holds three bf16 score-sized buffers (the recomputed "
        "probabilities, their gradient and the score gradient; v5e holds two, tpusim two), "
        "keeps the logit gradients through the backward loop (its output projection's "
        "weight gradient is scheduled after the loop, in no other fsdp-only program) and "
        "the MLP's fetched and recomputed tensors through the attention's backward (the "
        "v6e `full` program frees them before it): tpusim is ~0.45 GB low there. Adding "
        "the third score buffer on v5p and v6e alone puts their `full` rows 6-17% high, "
        "so it is not modelled. In the v5e programs the context of GQA attention sits in a "
        "tiled layout that pads the head-group dimension (a 16 MB tensor takes 128 MB), "
        "which tpusim does not model.", "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="XLA dump directory (worker: this program's; driver: one "
                                   "subdirectory per program)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--recompile", action="store_true", help="compile every selected program")
    ap.add_argument("--jax-python", default="/work/fid-venv/bin/python",
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of programs")
    ap.add_argument("--write", action="store_true",
                    help=f"rewrite docs/validation.md from the {MARKER} marker on")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.dump)
        return 0
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    if args.compile or args.recompile:
        for name in names:
            if name in cache and not args.recompile:
                continue
            print(f"compiling {name} ...", flush=True)
            try:
                cache[name] = run_xla(name, args.jax_python, args.dump)
            except RuntimeError as e:
                print(f"  FAILED: {str(e)[-400:]}", flush=True)
                continue
            # Merge with the file as it is now (another driver may have added programs).
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            disk = json.loads(CACHE.read_text()) if CACHE.exists() else {}
            cache = {**disk, **{k: v for k, v in cache.items() if k not in disk}, name: cache[name]}
            CACHE.write_text(json.dumps(dict(sorted(cache.items())), indent=1) + "\n")
            print(f"  peak {cache[name]['peak_bytes'] / 1e9:.3f} GB", flush=True)
    text = section({n: cache[n] for n in names if n in cache})
    if args.write:
        old = DOC.read_text()
        head = old[:old.index(MARKER)] if MARKER in old else old.rstrip("\n") + "\n\n"
        DOC.write_text(head + text)
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
