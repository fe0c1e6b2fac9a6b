"""What XLA schedules around an MoE layer's all-to-alls (docs/validation.md, effect 3).

Compiles, deviceless for a v6e 4x4 (jax[tpu], see docs/reference/xla.md), a MaxText-style
dropping MoE decoder (MaxText `RoutedMoE.dense_matmul` with a capacity factor: one-hot dispatch
and combine masks [batch, seq, experts, capacity], the einsums `BSM,BSEC->EBCM` and
`EBCM,BSEC->BSM`, experts sharded over `expert`, tokens over `fsdp` x `expert`), two scanned
layers under full remat, mesh fsdp=4 x expert=4, and reads the scheduled HLO:

* every all-to-all: the loop it sits in (forward or backward), the einsum it belongs to, its
  bytes, and whether it is synchronous (`all-to-all`) or async (`all-to-all-start`/`-done`,
  with compute scheduled between them);
* XLA's own cost estimate (`estimated_cycles`) of the dispatch einsum's convolution against a
  weight matmul of the same layer, per FLOP.

    /work/fid-venv/bin/python benchmarks/xla_moe_schedule.py            # compile (minutes)
    .venv/bin/python benchmarks/xla_moe_schedule.py --hlo moe.hlo.txt    # read a saved dump

Observed with jax/libtpu 0.10.2 (2026-11-30, 7 min of compile on a loaded 2-core machine): six
all-to-alls, all synchronous; forward: the dispatch and the combine; backward loop: the
combine's transpose, the recomputed dispatch, the dispatch's transpose and an f32 all-to-all of
the combine weights' gradient ([seq, experts, capacity] per sequence; XLA computes it where the
experts' outputs live instead of recomputing the combine all-to-all). The dispatch convolution
runs at the FLOP rate XLA's cost model gives the layer's weight matmuls.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

D, F, E, K, CF, SEQ, H, HD, L, V = 1024, 2048, 8, 2, 1.25, 2048, 8, 128, 2, 4096
FS, EP = 4, 4


def compile_program() -> str:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:4x4")
    base = topologies.make_mesh(topo, (FS, EP), ("fsdp", "expert"))
    mesh = Mesh(base.devices, ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    n = base.devices.size
    bf = jnp.bfloat16
    cap = int(max(-(-SEQ * K // E) * CF, CF))  # MaxText generate_masks, per sequence

    def ns(spec):
        return NamedSharding(mesh, spec)

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=ns(spec))

    batch = ("fsdp", "expert")
    lw = {"wq": ((D, H * HD), P("fsdp", None)), "wk": ((D, H * HD), P("fsdp", None)),
          "wv": ((D, H * HD), P("fsdp", None)), "wo": ((H * HD, D), P(None, "fsdp")),
          "gate": ((D, E), P("fsdp", None)),
          "w0": ((E, D, F), P("expert", "fsdp", None)),
          "w1": ((E, D, F), P("expert", "fsdp", None)),
          "wout": ((E, F, D), P("expert", None, "fsdp")),
          "n1": ((D,), P(None)), "n2": ((D,), P(None))}
    params = {"layers": [{k: sds(s, p) for k, (s, p) in lw.items()} for _ in range(L)],
              "embed": sds((V, D), P(None, "fsdp")), "unembed": sds((D, V), P("fsdp", None))}
    act = P(batch, None, None)

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (y * w).astype(bf)

    def moe(x, w):
        probs = jax.nn.softmax(jnp.einsum("bsm,me->bse", x, w["gate"]).astype(jnp.float32), -1)
        topw, topi = jax.lax.top_k(probs, K)
        oh = jax.nn.one_hot(topi, E, dtype=jnp.int32)  # [b, s, k, e]
        pos = (jnp.cumsum(oh.reshape(oh.shape[0], -1, E), axis=1) - 1).reshape(oh.shape)
        keep = (pos < cap) & (oh > 0)
        slot = jnp.where(keep, pos, cap)
        disp = jnp.sum(jax.nn.one_hot(slot, cap, dtype=bf) * keep[..., None], axis=2)
        comb = jnp.sum(jax.nn.one_hot(slot, cap, dtype=jnp.float32)
                       * (keep * topw[..., None])[..., None], axis=2).astype(bf)
        disp = jax.lax.with_sharding_constraint(disp, ns(P(batch, None, None, None)))
        xe = jnp.einsum("bsm,bsec->ebcm", x, disp)
        xe = jax.lax.with_sharding_constraint(xe, ns(P("expert", "fsdp", None, None)))
        hh = jax.nn.silu(jnp.einsum("ebcm,emh->ebch", xe, w["w0"])) * \
            jnp.einsum("ebcm,emh->ebch", xe, w["w1"])
        o = jnp.einsum("ebch,ehm->ebcm", hh, w["wout"])
        o = jax.lax.with_sharding_constraint(o, ns(P("expert", "fsdp", None, None)))
        return jax.lax.with_sharding_constraint(jnp.einsum("ebcm,bsec->bsm", o, comb), ns(act))

    def attn(y, w):
        b, s, _ = y.shape
        q = (y @ w["wq"]).reshape(b, s, H, HD)
        k = (y @ w["wk"]).reshape(b, s, H, HD)
        v = (y @ w["wv"]).reshape(b, s, H, HD)
        sc = jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -1e30)
        p = jax.nn.softmax(sc, -1).astype(bf)
        return jnp.einsum("bhst,bthd->bshd", p, v).reshape(b, s, H * HD) @ w["wo"]

    def layer(x, w):
        x = jax.lax.with_sharding_constraint(x + attn(rms(x, w["n1"]), w), ns(act))
        return jax.lax.with_sharding_constraint(x + moe(rms(x, w["n2"]), w), ns(act))

    def loss_fn(p, tok):
        x = jax.lax.with_sharding_constraint(jnp.take(p["embed"], tok, axis=0), ns(act))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *p["layers"])
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, stacked)
        logits = (x @ p["unembed"]).astype(jnp.float32)
        tgt = jnp.take_along_axis(logits, tok[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - tgt)

    def step(p, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        return loss, jax.tree.map(lambda a, b: (a - 1e-3 * b).astype(bf), p, g)

    tok = sds((n, SEQ), P(batch, None), jnp.int32)
    return jax.jit(step, donate_argnums=0).lower(params, tok).compile().as_text()


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) ([a-z][a-z0-9\-]*)\(")
_DT = {"bf16": 2, "f32": 4, "s32": 4, "f16": 2, "pred": 1, "s8": 1, "u32": 4}


def _bytes(shape: str) -> int:
    m = re.match(r"(\w+)\[([0-9,]*)\]", shape)
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _DT.get(m.group(1), 0)


def read_schedule(text: str) -> dict:
    """The all-to-alls of the scheduled HLO, each with its loop and form, and XLA's cycles per
    FLOP of the dispatch convolution against the weight matmuls (`dot_general` fusions)."""
    a2a, cycles = [], {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        meta = re.search(r'op_name="([^"]*)"', line)
        where = meta.group(1) if meta else ""
        if op.startswith("all-to-all"):
            a2a.append({"name": name, "form": "async" if op.endswith(("-start", "-done"))
                        else "sync", "op": op,
                        "loop": "backward" if "transpose(jvp" in where else "forward",
                        "einsum": next((c for c in reversed(where.split("/")) if "->" in c),
                                       where.split("/")[-1]),
                        "bytes": _bytes(shape)})
        cyc = re.search(r'estimated_cycles":"?(\d+)', line)
        if op == "fusion" and cyc and "jvp()/while/body" in where and "transpose" not in where:
            cycles[name] = (where.split("closed_call/")[-1], int(cyc.group(1)), shape)
    return {"all_to_all": a2a, "forward_fusions": cycles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hlo", type=Path, help="read this scheduled-HLO dump instead of compiling")
    ap.add_argument("--dump", type=Path, help="write the compiled HLO text here")
    args = ap.parse_args(argv)
    text = args.hlo.read_text() if args.hlo else compile_program()
    if args.dump:
        args.dump.write_text(text)
    s = read_schedule(text)
    print(f"{len(s['all_to_all'])} all-to-alls:")
    for a in s["all_to_all"]:
        print(f"  {a['loop']:<8} {a['form']:<5} {a['bytes'] / 2**20:8.2f} MiB  {a['einsum']}")
    print("forward fusions with XLA's estimated cycles (matmuls and the dispatch):")
    for name, (what, cyc, shape) in s["forward_fusions"].items():
        if "dot_general" in what:
            print(f"  {name:<28} {cyc:>8} cycles  {shape:<40} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
