"""Compile small JAX programs for real TPU topologies on this CPU-only machine and write their
optimized HLO text as tpusim test fixtures (`tests/fixtures/hlo/*.hlo.txt`).

jax is not a tpusim dependency (optional extra `[hlo]`): run this with a throwaway venv:

    python3.11 -m venv /work/hlo-venv && /work/hlo-venv/bin/pip install "jax[tpu]==0.10.2"
    /work/hlo-venv/bin/python benchmarks/make_hlo_fixtures.py [--only NAME] [--out DIR]

Each fixture is gzipped (`NAME.hlo.txt.gz`; tpusim reads `.gz` directly) and holds
`compiled.as_text()` (the scheduled, TPU-optimized module) with two edits that
carry no cost information, to keep the fixtures small: `metadata={...}` attributes and the
source-location tables (FileNames/FunctionNames/FileLocations/StackFrames) are dropped, unless
`--keep-metadata`. A first comment line records where XLA placed each SPMD partition:
`// tpusim: partition_coords=x,y[,z] ...` (partition p runs on the chip at the p-th coordinate;
`jax.experimental.topologies.make_mesh` lays the mesh out as XLA's TPU runtime would). The
second comment line records the program's configuration as JSON (`// tpusim: config=...`), which
the tests and docs/validation.md use to recompute the expected numbers independently.

`spmd_windowed_einsum_v5e16.hlo.txt.gz` is the post-SPMD-partitioning dump of the
`windowed_einsum_v5e16` program, kept whole (metadata and source tables included): run
`build("windowed_einsum_v5e16", False)` with
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning"`, take
`DIR/*after_tpu-spmd-partitioning.before_tpu-call-inliner.txt` and put the two comment lines of
`windowed_einsum_v5e16` (same mesh, so the same placement) in front.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A LLaMA-style decoder (GQA, SwiGLU, RMSNorm, untied embeddings), small enough that each
# fixture is a few hundred KB of text. Same keys as a tpusim model YAML.
SMALL = dict(d_model=1024, num_heads=8, num_kv_heads=4, head_dim=128, d_ff=4096,
             vocab_size=8192)

FIXTURES = {
    # name: topology, mesh, program, model overrides, batch per chip, seq
    "train_fsdp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="train",
                             layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_tp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 4, "tensor": 4},
                                program="train", layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_v5p64": dict(topology="v5p:4x4x4", mesh={"fsdp": 64}, program="train",
                             layers=2, seq=1024, batch_per_chip=1),
    "train_fsdp_tp_v5p64": dict(topology="v5p:4x4x4", mesh={"fsdp": 16, "tensor": 4},
                                program="train", layers=2, seq=1024, batch_per_chip=1),
    "decode_tp8_v5e8": dict(topology="v5e:2x4", mesh={"tensor": 8}, program="decode",
                            layers=2, seq=1, batch_per_chip=1, kv_len=1024),
    "scan_fsdp_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="scan",
                            layers=4, seq=1024, batch_per_chip=1),
    "windowed_einsum_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="matmul",
                                  layers=1, seq=2048, batch_per_chip=1),
    # The speed benchmark's module (not committed): an 8-layer train step with metadata kept.
    "bench_train8_v5e16": dict(topology="v5e:4x4", mesh={"fsdp": 16}, program="train",
                               layers=8, seq=1024, batch_per_chip=1, bench=True),
}


def build(name: str, keep_metadata: bool) -> str:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = FIXTURES[name]
    d, h, kv, hd, ff, vocab = (SMALL[k] for k in ("d_model", "num_heads", "num_kv_heads",
                                                   "head_dim", "d_ff", "vocab_size"))
    n_layers = cfg["layers"]
    topo = topologies.get_topology_desc(platform="tpu", topology_name=cfg["topology"])
    names = tuple(cfg["mesh"])
    base = topologies.make_mesh(topo, tuple(cfg["mesh"].values()), names)
    mesh = Mesh(base.devices, names, axis_types=(AxisType.Auto,) * len(names))
    n_chips = base.devices.size
    tp = "tensor" if "tensor" in names else None
    fs = "fsdp" if "fsdp" in names else None
    bf = jnp.bfloat16

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))

    wspec = {"wq": P(fs, tp), "wk": P(fs, tp), "wv": P(fs, tp), "wo": P(tp, fs),
             "w1": P(fs, tp), "w3": P(fs, tp), "w2": P(tp, fs), "n1": P(None), "n2": P(None)}
    wshape = {"wq": (d, h * hd), "wk": (d, kv * hd), "wv": (d, kv * hd), "wo": (h * hd, d),
              "w1": (d, ff), "w3": (d, ff), "w2": (ff, d), "n1": (d,), "n2": (d,)}
    act_spec = P(fs, None, None)

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(jnp.float32)).astype(bf)

    def attention(q, k, v, causal):
        b, s, _ = q.shape
        t = k.shape[1]
        q = q.reshape(b, s, kv, h // kv, hd)
        k = k.reshape(b, t, kv, hd)
        v = v.reshape(b, t, kv, hd)
        sc = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / (hd ** 0.5)
        if causal:
            sc = jnp.where(jnp.tril(jnp.ones((s, t), bool)), sc, -1e30)
        p = jax.nn.softmax(sc, axis=-1).astype(bf)
        return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h * hd)

    def layer(x, w, cache=None):
        y = rms(x, w["n1"])
        q, k, v = y @ w["wq"], y @ w["wk"], y @ w["wv"]
        if cache is not None:
            k = jnp.concatenate([cache[0], k], axis=1)
            v = jnp.concatenate([cache[1], v], axis=1)
        x = x + attention(q, k, v, causal=cache is None) @ w["wo"]
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, act_spec))
        y = rms(x, w["n2"])
        x = x + (jax.nn.silu(y @ w["w1"]) * (y @ w["w3"])) @ w["w2"]
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, act_spec))

    program = cfg["program"]
    batch = int(cfg["batch_per_chip"] * n_chips)
    seq = cfg["seq"]
    top = {"embed": sds((vocab, d), P(tp, fs)), "unembed": sds((d, vocab), P(fs, tp)),
           "nf": sds((d,), P(None))}
    if program in ("train", "scan"):
        if program == "scan":
            stacked = {k: sds((n_layers, *wshape[k]), P(None, *wspec[k])) for k in wshape}
            params = dict(top, layers=stacked)
        else:
            params = dict(top, layers=[{k: sds(wshape[k], wspec[k]) for k in wshape}
                                       for _ in range(n_layers)])
        tokens = sds((batch, seq), P(fs, None), jnp.int32)

        def loss_fn(p, tok):
            x = jnp.take(p["embed"], tok, axis=0)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, act_spec))
            if program == "scan":
                def body(x, w):
                    return jax.checkpoint(layer)(x, w), None
                x, _ = jax.lax.scan(body, x, p["layers"])
            else:
                for w in p["layers"]:
                    x = jax.checkpoint(layer)(x, w)
            logits = (rms(x, p["nf"]) @ p["unembed"]).astype(jnp.float32)
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
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, mom, mom, tokens)
    elif program == "decode":
        t = cfg["kv_len"]
        params = dict(top, layers=[{k: sds(wshape[k], wspec[k]) for k in wshape}
                                   for _ in range(n_layers)])
        tokens = sds((batch, 1), P(None, None), jnp.int32)
        caches = [(sds((batch, t, kv * hd), P(None, None, tp)),
                   sds((batch, t, kv * hd), P(None, None, tp))) for _ in range(n_layers)]
        act_spec = P(None, None, None)

        def decode(p, caches, tok):
            x = jnp.take(p["embed"], tok, axis=0)
            for w, c in zip(p["layers"], caches, strict=True):
                x = layer(x, w, cache=c)
            return jnp.argmax(rms(x, p["nf"]) @ p["unembed"], axis=-1)

        lowered = jax.jit(decode).lower(params, caches, tokens)
    else:  # one FSDP matmul and its gradient: XLA's windowed einsum on v5e
        x = sds((batch, seq, d), P(fs, None, None))
        w = sds((d, ff), P(fs, None))

        def f(x, w):
            return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))

        lowered = jax.jit(jax.grad(f, argnums=1)).lower(x, w)

    text = lowered.compile().as_text()
    coords = " ".join(",".join(str(c) for c in dev.coords[:len(cfg["topology"].split(":")[1]
                                                                .split("x"))])
                      for dev in mesh.devices.flat)
    meta = dict(cfg, name=name, num_layers=n_layers, num_chips=n_chips, jax=jax.__version__,
                **SMALL)
    if not keep_metadata and not cfg.get("bench"):
        text = strip_metadata(text)
    return (f"// tpusim: partition_coords={coords}\n"
            f"// tpusim: config={json.dumps(meta, sort_keys=True)}\n{text}")


def strip_metadata(text: str) -> str:
    out = []
    skipping = False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
            continue
        if skipping:
            if line.startswith("%") or line.startswith("ENTRY"):
                skipping = False
            else:
                continue
        out.append(_META_RE.sub("", line))
    return "\n".join(out) + "\n"


# `, metadata={op_name="..." source_file="..." ...}`: strings may hold braces, so match them.
_META_RE = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma list of fixture names")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hlo"))
    ap.add_argument("--bench-out", default="/tmp", help="where the benchmark module goes")
    ap.add_argument("--keep-metadata", action="store_true")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(FIXTURES)
    for name in names:
        text = build(name, args.keep_metadata)
        out = Path(args.bench_out if FIXTURES[name].get("bench") else args.out)
        out.mkdir(parents=True, exist_ok=True)
        if FIXTURES[name].get("bench"):
            path = out / f"{name}.hlo.txt"
            path.write_text(text)
        else:
            path = out / f"{name}.hlo.txt.gz"
            # mtime=0: the same program gives byte-identical fixtures.
            path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        print(f"wrote {path} ({len(text) / 1024:.0f} KiB of text)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
