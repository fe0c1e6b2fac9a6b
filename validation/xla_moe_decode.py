"""Which dispatch form XLA compiles for an MoE decode step: a small MoE decoder's one-token
decode step with its batch (and KV cache) split over `expert`, as tpusim's decode lays it out
(`workloads/inference/layout.py`: the sequences over data x expert, the routed experts over
`expert`, the other weights whole on every chip), compiled deviceless for a TPU topology, and
its collectives over `expert` read back and set beside `tpusim decode`'s.

XLA side (`lower_moe_decode`): 2 unscanned layers, each RMSNorm, multi-head attention of the
new token against its sequence's bf16 KV cache (the new key and value written into the cache
at the step's position, the caches donated), RMSNorm, the MoE, residuals; the final norm, the
output projection and the argmax of the bf16 logits (tpusim's `--sampling greedy`). The MoE is
MaxText's `RoutedMoE.dense_matmul` in either of its two forms: `dropping` (capacity_factor > 0:
MaxText's router and one-hot dispatch and combine masks at the capacity of one token's
sequence, the einsums `BSM,BSEC->EBCM` and `EBCM,BSEC->BSM`, the experts' operands constrained
to the experts over `expert`; MaxText keeps the masks in inference, only the load-balance loss
is skipped there) or `dense` (capacity_factor <= 0: every token through every expert,
`BSM,EMH->BSEH`, then `BSEM,BSE->BSM` against the top-k weights). What is read off: every
collective's bytes by kind and mesh axes in tpusim's convention and the dot FLOPs per chip.

Run (the XLA side needs a python with jax[tpu]==0.10.2; docs/xla_crosscheck.md):
    python -m validation.xla_moe_decode                      # the table from the cache
    python -m validation.xla_moe_decode --compile --jax-python /work/jaxvenv/bin/python
    python -m validation.xla_moe_decode --write              # rewrite its docs section
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

from validation import xla_compile
from validation.template import splice

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_moe_decode.json"
DOC = REPO / "docs" / "validation.md"
MARKER = "<!-- moe-decode -->"
END = "<!-- /moe-decode -->"
LAYERS = 2
DIMS = dict(d_model=1024, d_ff=2048, num_experts=8, top_k=2, num_heads=8, head_dim=128,
            vocab_size=4096)
CONFIGS = {
    "v5e_ep8_dropping": dict(topology="v5e:2x4", mesh={"expert": 8}, batch=64, kv_len=1024,
                             moe_matmul="dropping", capacity_factor=1.25,
                             when="rule read off"),
    "v5e_ep8_dropping_b512": dict(topology="v5e:2x4", mesh={"expert": 8}, batch=512,
                                  kv_len=1024, moe_matmul="dropping", capacity_factor=1.25,
                                  when="rule read off"),
    "v5e_ep8_dropping_b4096": dict(topology="v5e:2x4", mesh={"expert": 8}, batch=4096,
                                   kv_len=128, moe_matmul="dropping", capacity_factor=1.25,
                                   when="rule read off"),
    "v5e_ep8_dense": dict(topology="v5e:2x4", mesh={"expert": 8}, batch=64, kv_len=1024,
                          moe_matmul="dense", capacity_factor=0.0,
                          when="rule read off"),
    # Compiled after the decode rule (`workloads.inference.program.moe_dispatch_form`) and
    # tpusim's predictions were written down: another chip, a data axis, 2 experts a chip.
    "v6e_data2_ep4_dropping": dict(topology="v6e:2x4", mesh={"data": 2, "expert": 4},
                                   batch=256, kv_len=2048, moe_matmul="dropping",
                                   capacity_factor=2.0,
                                   when="after the rule (held out)"),
}


# --------------------------------------------------------------------------------------------
# jax side (runs under the jax python)
# --------------------------------------------------------------------------------------------

def lower_moe_decode(mesh, *, batch: int, kv_len: int, moe_matmul: str,
                     capacity_factor: float):
    """(jax python) The MoE decode step of the module docstring, lowered."""
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    D, F, E, K = DIMS["d_model"], DIMS["d_ff"], DIMS["num_experts"], DIMS["top_k"]
    H, HD, V = DIMS["num_heads"], DIMS["head_dim"], DIMS["vocab_size"]
    bf = jnp.bfloat16
    # MaxText generate_masks: capacity per sequence of one new token.
    cap = int(max(-(-1 * K // E) * capacity_factor, capacity_factor))

    def ns(spec):
        return NamedSharding(mesh, spec)

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=ns(spec))

    rep = P()
    lw = {"wq": (D, H * HD), "wk": (D, H * HD), "wv": (D, H * HD), "wo": (H * HD, D),
          "n1": (D,), "n2": (D,), "gate": (D, E)}
    layers = [{k: sds(s, rep) for k, s in lw.items()} | {
        "w0": sds((E, D, F), P("expert")), "w1": sds((E, D, F), P("expert")),
        "wout": sds((E, F, D), P("expert"))} for _ in range(LAYERS)]
    params = {"layers": layers, "embed": sds((V, D), rep), "unembed": sds((D, V), rep),
              "nf": sds((D,), rep)}
    # The sequences over data x expert (`layout.py`).
    bax = ("data", "expert") if "data" in mesh.axis_names else "expert"
    # The experts' operands: the batch over data only (MaxText's `activation_batch_no_exp`).
    nox = "data" if "data" in mesh.axis_names else None
    cache = [sds((batch, kv_len, H, HD), P(bax)) for _ in range(2 * LAYERS)]
    tokens = sds((batch,), P(bax), jnp.int32)
    pos = jax.ShapeDtypeStruct((), jnp.int32)
    act = P(bax, None, None)

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * w) \
            .astype(bf)

    def moe(x, w):
        logits = jnp.einsum("bsm,me->bse", x, w["gate"])
        if moe_matmul == "dense":
            topw, topi = jax.lax.top_k(logits, K)
            topw = jax.nn.softmax(topw.astype(jnp.float32), axis=-1).astype(bf)
            b, s, _ = x.shape
            weights = jnp.zeros((b, s, E), dtype=bf).at[
                jnp.arange(b)[:, None, None], jnp.arange(s)[:, None], topi].set(topw)
            hh = jax.nn.silu(jnp.einsum("bsm,emh->bseh", x, w["w0"])) * \
                jnp.einsum("bsm,emh->bseh", x, w["w1"])
            o = jnp.einsum("bseh,ehm->bsem", hh, w["wout"])
            out = jnp.einsum("bsem,bse->bsm", o.astype(jnp.float32),
                             weights.astype(jnp.float32)).astype(bf)
            return jax.lax.with_sharding_constraint(out, ns(act))
        disp, comb = xla_compile.maxtext_moe_masks(logits, K, E, cap)
        disp = jax.lax.with_sharding_constraint(disp, ns(P(bax, None, None, None)))
        xe = jnp.einsum("bsm,bsec->ebcm", x, disp)
        xe = jax.lax.with_sharding_constraint(xe, ns(P("expert", nox, None, None)))
        hh = jax.nn.silu(jnp.einsum("ebcm,emh->ebch", xe, w["w0"])) * \
            jnp.einsum("ebcm,emh->ebch", xe, w["w1"])
        o = jnp.einsum("ebch,ehm->ebcm", hh, w["wout"])
        o = jax.lax.with_sharding_constraint(o, ns(P("expert", nox, None, None)))
        return jax.lax.with_sharding_constraint(jnp.einsum("ebcm,bsec->bsm", o, comb),
                                                ns(act))

    def step(p, caches, tok, t):
        x = jax.lax.with_sharding_constraint(p["embed"][tok][:, None, :], ns(act))
        out = []
        for i, w in enumerate(p["layers"]):
            y = rms(x, w["n1"])
            q = (y @ w["wq"]).reshape(batch, H, HD)
            k = (y @ w["wk"]).reshape(batch, 1, H, HD)
            v = (y @ w["wv"]).reshape(batch, 1, H, HD)
            kc = jax.lax.dynamic_update_slice(caches[2 * i], k, (0, t, 0, 0))
            vc = jax.lax.dynamic_update_slice(caches[2 * i + 1], v, (0, t, 0, 0))
            s = jnp.einsum("bhd,bthd->bht", q, kc).astype(jnp.float32) / HD ** 0.5
            s = jnp.where(jnp.arange(kv_len)[None, None, :] <= t, s, -1e30)
            a = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1).astype(bf), vc)
            x = x + (a.reshape(batch, 1, H * HD) @ w["wo"])
            x = x + moe(rms(x, w["n2"]), w)
            out += [kc, vc]
        logits = rms(x, p["nf"])[:, 0, :] @ p["unembed"]
        return jnp.argmax(logits, -1).astype(jnp.int32), out

    return jax.jit(step, donate_argnums=(1,)).lower(params, cache, tokens, pos)


def _worker(name: str, dump: str) -> None:
    cfg = CONFIGS[name]
    xla_compile.init_jax()
    mesh, devices = xla_compile.build_mesh(cfg["topology"], cfg["mesh"])
    compiled = lower_moe_decode(mesh, batch=cfg["batch"], kv_len=cfg["kv_len"],
                                moe_matmul=cfg["moe_matmul"],
                                capacity_factor=cfg["capacity_factor"]).compile()
    Path(dump).mkdir(parents=True, exist_ok=True)
    Path(dump, "module.hlo.txt.gz").write_bytes(gzip.compress(compiled.as_text().encode()))
    xla_compile.emit({"config": name, "num_chips": int(devices.size),
                      "mesh_axes": list(cfg["mesh"]), "mesh_shape": list(cfg["mesh"].values()),
                      "mesh_device_ids": [int(dv.id) for dv in devices.flat],
                      **xla_compile.memory_stats(compiled)})


# --------------------------------------------------------------------------------------------
# driver side (the project's python)
# --------------------------------------------------------------------------------------------

def run_xla(name: str, jax_python: str, dump: str | None) -> dict:
    """Compile one program under the jax python: dot FLOPs and collective bytes by (kind,
    axes)."""
    # deferred: these import tpusim's HLO reader, which the jax worker (importing this
    # module) does not have.
    from validation.xla_crosscheck_doc import xla_logical_bytes
    from validation.xla_hlo_read import parse_hlo_collectives

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(dump, name) if dump else Path(tmp)
        result = xla_compile.run_worker("validation.xla_moe_decode", name, jax_python,
                                        ["--dump", str(where)])
        text = gzip.decompress(Path(where, "module.hlo.txt.gz").read_bytes()).decode()
    counts = xla_compile.module_counts(text, CONFIGS[name]["topology"], name)
    result["ops"] = parse_hlo_collectives(text)
    by_kind = {f"{k}|{a}": v for (k, a), v in sorted(xla_logical_bytes(result).items())}
    return {"config": name, "num_chips": result["num_chips"],
            "peak_bytes": result["peak_bytes"], "dot_flops": counts["dot_flops"],
            "collectives": by_kind}


def tpusim_side(name: str) -> dict:
    """`tpusim decode` of the same step: its collectives by (kind, axes) and dot FLOPs."""
    cfg = CONFIGS[name]
    dims = dict(d_model=DIMS["d_model"], num_heads=DIMS["num_heads"],
                num_kv_heads=DIMS["num_heads"], head_dim=DIMS["head_dim"], d_ff=DIMS["d_ff"],
                vocab_size=DIMS["vocab_size"], num_experts=DIMS["num_experts"],
                experts_per_token=DIMS["top_k"], moe_d_ff=DIMS["d_ff"])
    # deferred: driver side only (the jax worker imports this module without tpusim's
    # simulator on its path).
    from topologies.mesh import parse_mesh
    from workloads.inference import compile_decode_step
    from workloads.inference.config import DecodeConfig
    from workloads.moe import MoeConfig
    from workloads.zoo import model_from_dict

    model = model_from_dict(xla_compile.tpusim_model_dict(dims, LAYERS, "xla-moe-decode"))
    mesh = parse_mesh(",".join(f"{k}={v}" for k, v in cfg["mesh"].items()))
    cf = cfg["capacity_factor"] if cfg["capacity_factor"] > 0 else None
    trace = compile_decode_step(model, mesh, mesh.num_ici_devices, DecodeConfig(
        batch=cfg["batch"], context_len=cfg["kv_len"], sampling="greedy",
        moe=MoeConfig(capacity_factor=cf)))
    coll: dict[str, float] = {}
    for o in trace.ops:
        if o.kind == "collective":
            key = f"{o.collective}|{','.join(o.mesh_axes)}"
            coll[key] = coll.get(key, 0.0) + o.bytes
    return {"dot_flops": xla_compile.trace_counts(trace.ops)["dot_flops"],
            "collectives": dict(sorted(coll.items()))}


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def _cells(coll: dict) -> str:
    return "; ".join(f"{k.replace('|', ' over ')} {_mib(v)}" for k, v in coll.items()) or "none"


def section(cache: dict) -> str:
    """The docs/validation.md section (between MARKER and END)."""
    lines = [MARKER, "## The MoE dispatch form of a decode step against XLA", "",
             "_Generated by `python -m validation.xla_moe_decode --write` from the cached "
             "compiles in `validation/results/xla_moe_decode.json`._", "",
             "XLA side: a small MoE decoder's one-token decode step (`xla_moe_decode."
             "lower_moe_decode`: 2 layers, d_model 1024, 8 experts of d_ff 2048 top-2, 8 heads, "
             "a bf16 KV cache, greedy sampling) with its batch and KV cache split over "
             "data x `expert` and the routed experts over `expert`, as `tpusim decode` "
             "lays out such a mesh, the MoE as MaxText's `dense_matmul` with a capacity factor "
             "(one-hot masks at one token's capacity) or without (every token through every "
             "expert). tpusim side: `tpusim decode --mesh ... --batch B --context-len T "
             "--sampling greedy` (`--capacity-factor C` on the dropping rows). Collectives "
             "per chip in tpusim's convention (MiB), dot FLOPs per chip.", "",
             "What the compiles show: XLA gathers the expert group's tokens over `expert` and "
             "reduce-scatters the combine's partial sums back; no token crosses by an "
             "all-to-all (the dropping masks do, two small all-to-alls a layer). That is the "
             "all-gather form, unlike the training programs with the batch split over expert "
             "(their all-to-alls, \"The MoE dispatch form against XLA\" above). The rule "
             "(`workloads.inference.program.moe_dispatch_form`: a decode step dispatches in "
             "the all-gather form, a prefill, not compiled, by all-to-alls) was read off the "
             "four v5e rows; tpusim's prediction for the v6e data=2 x expert=4 row was "
             "written before its compile (`validation/results/"
             "xla_moe_decode_predictions.txt`): every collective over `expert` as predicted. "
             "Dot FLOPs: on the dropping rows tpusim counts 0.4-4.0% more than XLA's module; "
             "dropless, MaxText's `dense_matmul` runs every token through every local expert "
             "(2.7x tpusim's, which runs each token through its top-k experts only, as a "
             "sparse kernel does): the dropless decode's expert work is not checked by this "
             "program.", "",
             "| program | compiled | XLA's collectives | tpusim's collectives | dot GFLOP, "
             "XLA / tpusim |",
             "|---|---|---|---|---|"]
    for name, cfg in CONFIGS.items():
        x = cache.get(name)
        if x is None:
            continue
        t = tpusim_side(name)
        lines.append(
            f"| {cfg['topology']} {' x '.join(f'{k}={v}' for k, v in cfg['mesh'].items())}, "
            f"batch {cfg['batch']}, cache {cfg['kv_len']}, "
            f"{cfg['moe_matmul']}"
            + (f" (cf {cfg['capacity_factor']})" if cfg["capacity_factor"] > 0 else "")
            + f" | {cfg['when']} | {_cells(x['collectives'])} | {_cells(t['collectives'])} | "
            f"{sum(x['dot_flops'].values()) / 1e9:.3f} / "
            f"{sum(t['dot_flops'].values()) / 1e9:.3f} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="keep each compiled module here (one subdirectory each)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--jax-python", default="/work/jaxvenv/bin/python",
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--programs", default=",".join(CONFIGS), help="comma list of programs")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the moe-decode section of docs/validation.md")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.dump)
        return 0
    if args.compile:
        xla_compile.compile_into_cache(
            args.programs.split(","), CACHE, lambda k: run_xla(k, args.jax_python, args.dump),
            report=lambda k, r: json.dumps(r["collectives"]))
    text = section(xla_compile.load_cache(CACHE))
    if args.write:
        DOC.write_text(splice(DOC.read_text(), MARKER, END, text))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
