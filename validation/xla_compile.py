"""The XLA side shared by the modules that compile JAX programs deviceless for real TPU
topologies (make_hlo_fixtures, xla_crosscheck, xla_memory, xla_moe_schedule) and read the
results back (hlo_import): the JAX models, the mesh, the deviceless compile and the
compile-and-cache loop.

jax is not a tpusim dependency. The functions that build and compile programs import jax
lazily and run under a python with `jax[tpu]==0.10.2` (docs/reference/xla.md; the driver
modules run themselves as a worker, `python -m validation.NAME --worker`, under
`--jax-python`: a venv with `pip install '.[hlo]'`); everything else here runs under the
project's python too and imports no tpusim code but that module (which imports none).

The models (one place, so every script compiles the same decoder):

* a LLaMA-style dense decoder (`Decoder`, with the mesh, the deviceless compile and the remat
  policies in `workloads/hlo/jaxgen.py`, which `tpusim make-hlo-fixture` runs too; re-exported
  here): GQA, SwiGLU, RMSNorm in f32, untied embeddings, plain dot attention with f32 scores
  (causal in training, against a KV cache in decode), bf16 weights, MaxText-like logical
  sharding (embed dim on `fsdp`, heads / d_ff / vocab on `tensor`, the batch on `data` x
  `fsdp`); a training step with Adam (f32 moments, donated arguments) and a one-token decode
  step; `attention="splash"` puts jax's Pallas splash-attention TPU kernel (MaxText's flash
  attention) in place of dot attention in training;
* a MaxText-style dropping MoE decoder (`moe_train_step`): one-hot dispatch and combine masks
  with a capacity factor, experts sharded over `expert`, SGD update.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The cached XLA results (committed, so the tables regenerate without jax).
RESULTS = REPO / "validation" / "results"
# A venv with jax[tpu]==0.10.2 (docs/reference/xla.md says how to make one).
DEFAULT_JAX_PYTHON = "/work/fid-venv/bin/python"
# The line a worker prints its result on (one JSON object).
RESULT_PREFIX = "XLA_JSON "

# Model widths, same keys as a tpusim model YAML.
LLAMA3_8B = dict(d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, d_ff=14336,
                 vocab_size=128256)
# Small enough to compile in tens of seconds and to commit as an HLO fixture.
TINY = dict(d_model=1024, num_heads=8, num_kv_heads=4, head_dim=128, d_ff=4096,
            vocab_size=8192)
# Narrower, with more layers the layers decide the peak: the memory cross-check's model.
SMALL = dict(d_model=2048, num_heads=16, num_kv_heads=8, head_dim=128, d_ff=8192,
             vocab_size=32768)
# LLaMA-3-70B widths (Meta's model card: d_model 8192, 64 heads, 8 KV heads, d_ff 28672,
# vocab 128256).
WIDE = dict(d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128, d_ff=28672,
            vocab_size=128256)


# --------------------------------------------------------------------------------------------
# jax side (runs under the jax python)
# --------------------------------------------------------------------------------------------

# Bytes per element of the HLO dtypes the schedule readers meet.
HLO_DTYPE_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "f16": 2, "pred": 1, "s8": 1, "u32": 4}


def hlo_shape_bytes(shape: str, *, tuple_first: bool = False) -> int:
    """Bytes of an HLO array shape such as `bf16[8,4096]{1,0}` (0 for a shape it cannot read).
    `tuple_first`: for a tuple shape `(bf16[...], ...)`, the first element's bytes (else 0)."""
    m = re.match(r"\(?(\w+)\[([0-9,]*)\]" if tuple_first else r"(\w+)\[([0-9,]*)\]", shape)
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * HLO_DTYPE_BYTES.get(m.group(1), 0)


# The deviceless compile, the mesh and the dense decoder live in workloads/hlo/jaxgen.py (the
# `tpusim make-hlo-fixture` command compiles them too); re-exported here for the drivers.
from workloads.hlo import jaxgen as _jaxgen  # noqa: E402

DIM_KEYS = _jaxgen.DIM_KEYS
MAXTEXT_NAMED = _jaxgen.MAXTEXT_NAMED
Decoder = _jaxgen.Decoder
_identity_tag = _jaxgen._identity_tag
build_mesh = _jaxgen.build_mesh
init_jax = _jaxgen.init_jax
partition_coords = _jaxgen.partition_coords
remat_layer = _jaxgen.remat_layer


def maxtext_moe_masks(logits, K: int, E: int, cap: int):
    """(jax python) MaxText's `RoutedMoE.get_topk` (softmax over the k in f32, cast to the bf16
    activation dtype), `reshape_and_update_weights` and `generate_masks` on router logits
    [batch, seq, experts] at capacity `cap` per sequence: (the dispatch mask, the bf16 combine
    mask), each [batch, seq, experts, cap]."""
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax
    import jax.numpy as jnp

    bf = jnp.bfloat16
    b, s, _ = logits.shape
    topw, topi = jax.lax.top_k(logits, K)
    topw = jax.nn.softmax(topw.astype(jnp.float32), axis=-1).astype(bf)
    weights = jnp.zeros((b, s, E), dtype=bf).at[
        jnp.arange(b)[:, None, None], jnp.arange(s)[:, None], topi].set(topw)
    expert_mask = jax.nn.one_hot(topi, num_classes=E, dtype=jnp.int32)
    fused = expert_mask.reshape(b, s * K, E)
    count_fused = jnp.cumsum(fused, axis=1)
    count = count_fused.reshape(b, s, K, E)
    trunc = expert_mask * jnp.less_equal(count, cap)
    combined = jnp.sum(trunc, axis=2)
    weights = weights * combined
    position = jnp.sum((fused * count_fused).reshape(b, s, K, E), axis=2) * combined
    in_cap = jax.nn.one_hot(position, num_classes=cap + 1, dtype=jnp.int32)
    comb = (weights[..., None] * in_cap)[..., 1:]
    return comb.astype(bool), comb


# Long: one JAX program whose closures (router, experts, attention, layer, loss, the two
# optimizer steps) share the mesh, the widths and the sharding specs; it is checked only by
# compiling under the jax[tpu] python, which the project's environment does not have.
def lower_moe_train(mesh, *, d_model: int, d_ff: int, num_experts: int, top_k: int,
                    capacity_factor: float, seq: int, num_heads: int, head_dim: int,
                    num_layers: int, vocab_size: int, scopes: bool = False,
                    optimizer: str = "sgd", final_norm: bool = False,
                    router: str = "f32", num_kv_heads: int | None = None,
                    batch_per_chip: int = 1, attention_block: int = 0,
                    moe_matmul: str = "dropping", tokens_over_expert: bool = True,
                    moe_tokens_gathered: bool = False):
    """A MaxText-style dropping MoE decoder's SGD training step, lowered (MaxText
    `RoutedMoE.dense_matmul` with a capacity factor: one-hot dispatch and combine masks [batch,
    seq, experts, capacity], the einsums `BSM,BSEC->EBCM` and `EBCM,BSEC->BSM`, experts over
    `expert`, tokens over `fsdp` x `expert`, one sequence per chip; every other weight's d_model
    over `fsdp` x `expert`, as MaxText's logical-axis rules shard it), layers scanned under full
    remat (`nothing_saveable`), plain multi-head dot attention, RMSNorm in f32 (weight not
    upcast), untied embeddings; final_norm: an RMSNorm before the output projection, as
    MaxText's decoder has (and tpusim's models). router: "f32" (softmax over the experts in
    f32, top-k of the probabilities, combine weights built in f32 and cast to bf16) or
    "maxtext" (MaxText's `get_topk` / `reshape_and_update_weights` / `generate_masks`: top-k of
    the bf16 logits, softmax over the k in f32 cast to bf16, the [batch, seq, experts] weights
    in bf16 times an int32 one-hot of the capacity slot: a bf16 combine mask, and the dispatch
    mask its `astype(bool)`). scopes: `jax.named_scope` around "embed",
    "layer0" (the scanned body; "norm", "attention" (the core) and "router" (gating and masks)
    inside), "head" and "sgd". optimizer: "sgd" (the update in bf16, no state) or "adam" (f32
    moments shaped and sharded as the weights, donated, as `Decoder.train_step`: the peak-HBM
    comparison). num_kv_heads: grouped-query attention with that many key/value heads (default:
    num_heads, plain multi-head). batch_per_chip: sequences per chip (capacity is per sequence,
    as MaxText's). num_experts=0: the same decoder with a dense SwiGLU MLP of d_ff in place of
    the MoE (weights [d_model, d_ff] / [d_ff, d_model], d_model over fsdp x expert; no router):
    the dense half of a matched pair (`xla_moe_pair.py`). attention_block: causal attention
    in blocks of that many queries, each against the keys up to its last query and under its
    own `jax.checkpoint` (as a flash kernel skips the masked blocks and keeps no scores): what
    lets the runs' batches of long sequences fit a chip (0: one [seq, seq] score matrix).
    moe_matmul: "dropping" (the capacity-factor path above), "ring" (MaxText's dropless
    `sparse_matmul` with `use_ring_of_experts`: an explicit `shard_map` over the mesh in which
    each chip gathers its expert group's tokens and router logits over `expert`, routes every
    gathered token, sorts its own experts' assignments and runs them by `jax.lax.ragged_dot`
    (the grouped matmul megablox computes), and reduce-scatters the weighted outputs back;
    the experts' weights enter it over `expert` only, gathered over fsdp before it) or "dense"
    (MaxText `RoutedMoE.dense_matmul` with capacity_factor <= 0: every token through every expert,
    `BSM,EMH->BSEH`, `BSEH,EHM->BSEM`, then `BSEM,BSE->BSM` in f32 against the [batch, seq,
    experts] top-k weights; no masks and no sharding constraint inside the MoE, so XLA picks
    the collectives). tokens_over_expert: the batch sharded over fsdp x expert (MaxText's
    `activation_batch` with `expert` in it); False: over fsdp only, replicated over expert.
    moe_tokens_gathered: the residual stream over fsdp x expert, but the MoE block's input and
    its masks constrained to the batch over fsdp only (MaxText's `activation_batch_no_exp`),
    its output back over fsdp x expert: every chip of an expert group sees its fsdp group's
    tokens."""
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    D, F, E, K, CF, SEQ = d_model, d_ff, num_experts, top_k, capacity_factor, seq
    H, HD, L, V = num_heads, head_dim, num_layers, vocab_size
    KV = H if num_kv_heads is None else num_kv_heads
    n = mesh.devices.size
    bf = jnp.bfloat16
    dense = E == 0
    # MaxText generate_masks, per sequence
    cap = 0 if dense or moe_matmul == "dense" else int(max(-(-SEQ * K // E) * CF, CF))

    def scope(name):
        return jax.named_scope(name) if scopes else contextlib.nullcontext()

    def ns(spec):
        return NamedSharding(mesh, spec)

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=ns(spec))

    batch = ("fsdp", "expert") if tokens_over_expert else ("fsdp",)
    # MaxText's logical-axis rules: a weight's `embed` dimension goes to fsdp and expert, except
    # the routed experts' (`embed_no_exp`: fsdp only; their `exp` dimension takes expert).
    fe = ("fsdp", "expert")
    lw = {"wq": ((D, H * HD), P(fe, None)), "wk": ((D, KV * HD), P(fe, None)),
          "wv": ((D, KV * HD), P(fe, None)), "wo": ((H * HD, D), P(None, fe)),
          "n1": ((D,), P(None)), "n2": ((D,), P(None))}
    if dense:
        lw.update({"w0": ((D, F), P(fe, None)), "w1": ((D, F), P(fe, None)),
                   "wout": ((F, D), P(None, fe))})
    else:
        lw.update({"gate": ((D, E), P(fe, None)),
                   "w0": ((E, D, F), P("expert", "fsdp", None)),
                   "w1": ((E, D, F), P("expert", "fsdp", None)),
                   "wout": ((E, F, D), P("expert", None, "fsdp"))})
    params = {"layers": [{k: sds(s, p) for k, (s, p) in lw.items()} for _ in range(L)],
              "embed": sds((V, D), P(None, fe)), "unembed": sds((D, V), P(fe, None))}
    if final_norm:
        params["nf"] = sds((D,), P(None))
    act = P(batch, None, None)

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (y * w).astype(bf)

    def maxtext_masks(logits):
        return maxtext_moe_masks(logits, K, E, cap)

    def dense_moe(x, w):
        # MaxText dense_matmul at capacity_factor <= 0: get_topk, reshape_and_update_weights.
        b, s, _ = x.shape
        logits = jnp.einsum("bsm,me->bse", x, w["gate"])
        topw, topi = jax.lax.top_k(logits, K)
        topw = jax.nn.softmax(topw.astype(jnp.float32), axis=-1).astype(bf)
        weights = jnp.zeros((b, s, E), dtype=bf).at[
            jnp.arange(b)[:, None, None], jnp.arange(s)[:, None], topi].set(topw)
        hh = jax.nn.silu(jnp.einsum("bsm,emh->bseh", x, w["w0"])) * \
            jnp.einsum("bsm,emh->bseh", x, w["w1"])
        o = jnp.einsum("bseh,ehm->bsem", hh, w["wout"])
        out = jnp.einsum("bsem,bse->bsm", o.astype(jnp.float32),
                         weights.astype(jnp.float32)).astype(bf)
        return jax.lax.with_sharding_constraint(out, ns(act))

    def ring_local(xl, ll, w0, w1, wo):
        # One chip's shard of MaxText's ring of experts: the expert group's tokens and router
        # logits gathered, top-k routing of every gathered token, the assignments to this
        # shard's experts sorted by expert and run through them (`ragged_dot`), unsorted,
        # weighted and summed, and the partial sums reduce-scattered back.
        ep = jax.lax.axis_size("expert")
        xg = jax.lax.all_gather(xl, "expert", axis=0, tiled=True)
        lg = jax.lax.all_gather(ll, "expert", axis=0, tiled=True)
        b, s, _ = xg.shape
        xf, lf = xg.reshape(b * s, D), lg.reshape(b * s, E)
        topw, topi = jax.lax.top_k(lf, K)
        topw = jax.nn.softmax(topw.astype(jnp.float32), axis=-1).astype(bf)
        e_loc = E // ep
        local = topi.reshape(-1) - jax.lax.axis_index("expert") * e_loc
        mine = (local >= 0) & (local < e_loc)
        key = jnp.where(mine, local, e_loc)
        order = jnp.argsort(key)
        sizes = jnp.bincount(key, length=e_loc + 1)[:e_loc].astype(jnp.int32)
        xs = xf[order // K]
        hh = jax.nn.silu(jax.lax.ragged_dot(xs, w0, sizes)) * jax.lax.ragged_dot(xs, w1, sizes)
        o = jax.lax.ragged_dot(hh, wo, sizes)
        o = jnp.zeros_like(o).at[order].set(o).reshape(b * s, K, D)
        wk = (topw * mine.reshape(b * s, K)).astype(bf)
        y = jnp.einsum("tkm,tk->tm", o, wk).reshape(b, s, D)
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

    def ring_moe(x, w):
        logits = jnp.einsum("bsm,me->bse", x, w["gate"])
        spec, wspec = P(batch, None, None), P("expert", None, None)
        return jax.shard_map(ring_local, mesh=mesh, in_specs=(spec, spec, wspec, wspec, wspec),
                             out_specs=spec, check_vma=False)(
            x, logits, w["w0"], w["w1"], w["wout"])

    def moe(x, w):
        if dense:
            return (jax.nn.silu(x @ w["w0"]) * (x @ w["w1"])) @ w["wout"]
        if moe_matmul == "dense":
            return dense_moe(x, w)
        if moe_matmul == "ring":
            return ring_moe(x, w)
        if moe_tokens_gathered:
            x = jax.lax.with_sharding_constraint(x, ns(P("fsdp", None, None)))
        with scope("router"):
            if router == "maxtext":
                disp, comb = maxtext_masks(jnp.einsum("bsm,me->bse", x, w["gate"]))
            else:
                probs = jax.nn.softmax(
                    jnp.einsum("bsm,me->bse", x, w["gate"]).astype(jnp.float32), -1)
                topw, topi = jax.lax.top_k(probs, K)
                oh = jax.nn.one_hot(topi, E, dtype=jnp.int32)  # [b, s, k, e]
                pos = (jnp.cumsum(oh.reshape(oh.shape[0], -1, E), axis=1) - 1).reshape(oh.shape)
                keep = (pos < cap) & (oh > 0)
                slot = jnp.where(keep, pos, cap)
                disp = jnp.sum(jax.nn.one_hot(slot, cap, dtype=bf) * keep[..., None], axis=2)
                comb = jnp.sum(jax.nn.one_hot(slot, cap, dtype=jnp.float32)
                               * (keep * topw[..., None])[..., None], axis=2).astype(bf)
        disp = jax.lax.with_sharding_constraint(
            disp, ns(P("fsdp" if moe_tokens_gathered else batch, None, None, None)))
        xe = jnp.einsum("bsm,bsec->ebcm", x, disp)
        xe = jax.lax.with_sharding_constraint(xe, ns(P("expert", "fsdp", None, None)))
        hh = jax.nn.silu(jnp.einsum("ebcm,emh->ebch", xe, w["w0"])) * \
            jnp.einsum("ebcm,emh->ebch", xe, w["w1"])
        o = jnp.einsum("ebch,ehm->ebcm", hh, w["wout"])
        o = jax.lax.with_sharding_constraint(o, ns(P("expert", "fsdp", None, None)))
        return jax.lax.with_sharding_constraint(jnp.einsum("ebcm,bsec->bsm", o, comb), ns(act))

    def attend(q, k, v, q0):
        # Causal GQA attention of the queries starting at position q0 against the keys before
        # and among them.
        b, s, t = q.shape[0], q.shape[1], k.shape[1]
        q = q.reshape(b, s, KV, H // KV, HD)
        sc = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
        mask = (q0 + jnp.arange(s))[:, None] >= jnp.arange(t)[None, :]
        sc = jnp.where(mask, sc, -1e30)
        p = jax.nn.softmax(sc, -1).astype(bf)
        return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, H * HD)

    def blocked_attention(q, k, v, blk):
        outs = []
        for q0 in range(0, q.shape[1], blk):
            f = jax.checkpoint(lambda q, k, v, q0=q0: attend(q, k, v, q0))
            outs.append(f(q[:, q0:q0 + blk], k[:, :q0 + blk], v[:, :q0 + blk]))
        return jnp.concatenate(outs, axis=1)

    def attn(y, w):
        b, s, _ = y.shape
        q = (y @ w["wq"]).reshape(b, s, H, HD)
        k = (y @ w["wk"]).reshape(b, s, KV, HD)
        v = (y @ w["wv"]).reshape(b, s, KV, HD)
        with scope("attention"):
            if attention_block:
                o = blocked_attention(q, k, v, attention_block)
            elif KV == H:
                sc = jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32)
                sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -1e30)
                p = jax.nn.softmax(sc, -1).astype(bf)
                o = jnp.einsum("bhst,bthd->bshd", p, v).reshape(b, s, H * HD)
            else:  # grouped-query, as `Decoder.attention`
                q = q.reshape(b, s, KV, H // KV, HD)
                sc = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
                sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -1e30)
                p = jax.nn.softmax(sc, -1).astype(bf)
                o = jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, H * HD)
        return o @ w["wo"]

    def norm(x, w):
        with scope("norm"):
            return rms(x, w)

    def layer(x, w):
        with scope("layer0"):
            x = jax.lax.with_sharding_constraint(x + attn(norm(x, w["n1"]), w), ns(act))
            return jax.lax.with_sharding_constraint(x + moe(norm(x, w["n2"]), w), ns(act))

    def loss_fn(p, tok):
        with scope("embed"):
            x = jax.lax.with_sharding_constraint(jnp.take(p["embed"], tok, axis=0), ns(act))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *p["layers"])
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, stacked)
        with scope("head"):
            if final_norm:
                x = norm(x, p["nf"])
            logits = (x @ p["unembed"]).astype(jnp.float32)
            tgt = jnp.take_along_axis(logits, tok[..., None], -1)[..., 0]
            return jnp.mean(jax.nn.logsumexp(logits, -1) - tgt)

    def step(p, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        with scope("sgd"):
            return loss, jax.tree.map(lambda a, b: (a - 1e-3 * b).astype(bf), p, g)

    def adam_step(p, m1, m2, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        with scope("adam"):
            m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g.astype(jnp.float32), m1, g)
            m2 = jax.tree.map(lambda m, g: 0.95 * m + 0.05 * jnp.square(g.astype(jnp.float32)),
                              m2, g)
            p = jax.tree.map(lambda w, a, b: (w.astype(jnp.float32) - 1e-4 * a
                                              * jax.lax.rsqrt(b + 1e-8)).astype(bf), p, m1, m2)
        return loss, p, m1, m2

    tok = sds((n * batch_per_chip, SEQ), P(batch, None), jnp.int32)
    if optimizer == "adam":
        mom = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                                          sharding=s.sharding), params)
        return jax.jit(adam_step, donate_argnums=(0, 1, 2)).lower(params, mom, mom, tok)
    if optimizer != "sgd":
        raise ValueError(f"optimizer {optimizer!r}: use sgd or adam")
    return jax.jit(step, donate_argnums=0).lower(params, tok)


# MaxText's named remat policies (`Decoder.get_remat_policy` in MaxText/layers/decoders.py,
# docs/reference/maxtext_remat.md): the names each saves on device and offloads to host.
def memory_stats(compiled) -> dict:
    """`compiled.memory_analysis()` as a dict of ints (bytes per device; host_temp_bytes is
    what lives in pinned host memory, not part of the HBM peak)."""
    mem = compiled.memory_analysis()
    return {"peak_bytes": int(mem.peak_memory_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "host_temp_bytes": int(getattr(mem, "host_temp_size_in_bytes", 0))}


def cost_stats(compiled) -> dict:
    """`compiled.cost_analysis()`'s flops and bytes (a loop body counted once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0]
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def emit(result: dict) -> None:
    """A worker's result, on the line `run_worker` reads."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# driver side (any python)
# --------------------------------------------------------------------------------------------

def have_jax(jax_python: str) -> bool:
    return Path(jax_python).exists() and subprocess.run(
        [jax_python, "-c", "import jax, libtpu"], capture_output=True).returncode == 0


def run_worker(module: str, name: str, jax_python: str,
               extra: Iterable[str] = ()) -> dict:
    """Run `python -m MODULE --worker NAME [extra]` under the jax python, with this checkout
    first on its path; its `emit`ted result."""
    cmd = [jax_python, "-m", module, "--worker", name, *extra]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=path)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"XLA worker failed for {name}:\n{r.stderr[-3000:]}")


def load_cache(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def cache_text(cache: dict, compact: bool = False) -> str:
    """A cache file's text: programs sorted by name; `compact`: no whitespace (long op lists)."""
    text = json.dumps(dict(sorted(cache.items())), separators=(",", ":")) if compact else \
        json.dumps(dict(sorted(cache.items())), indent=1)
    return text + "\n"


def write_cache(path: Path, cache: dict, compact: bool = False) -> None:
    """Write `cache_text(cache, compact)` to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cache_text(cache, compact))


def compile_into_cache(names: Iterable[str], path: Path, compile_one: Callable[[str], dict],
                       *, recompile: bool = False, compact: bool = False,
                       report: Callable[[str, dict], str] | None = None) -> dict:
    """Compile each program missing from the JSON cache at `path` (every one with
    `recompile`) and store it there as soon as it is done, merged with the file as it is then
    (another driver may have added programs meanwhile). A failed compile is reported and
    skipped. Returns the cache."""
    cache = load_cache(path)
    for name in names:
        if name in cache and not recompile:
            continue
        print(f"compiling {name} ...", flush=True)
        try:
            result = compile_one(name)
        except RuntimeError as e:
            print(f"  FAILED: {str(e)[-400:]}", flush=True)
            continue
        disk = load_cache(path)
        cache = {**disk, **{k: v for k, v in cache.items() if k not in disk}, name: result}
        write_cache(path, cache, compact)
        if report:
            print(f"  {report(name, result)}", flush=True)
    return cache


def tpusim_model_dict(dims: dict, num_layers: int, name: str, base: str | None = None) -> dict:
    """A tpusim model (the dict `workloads.zoo.model_from_dict` reads) with these widths:
    from a zoo model (`base`) or from scratch (SwiGLU, untied embeddings, as `Decoder`)."""
    head = {"base": base} if base else {"mlp": "swiglu", "tied_embeddings": False}
    return {**head, "name": name, "num_layers": num_layers, **dims}


def tpusim_model_yaml(model: dict) -> str:
    return "".join(f"{k}: {v}\n" for k, v in model.items())


# --------------------------------------------------------------------------------------------
# driver side (the project's python): one program's numbers, XLA's and tpusim's, as the
# dtype cross-checks (validation/xla_int8.py, validation/xla_logits.py) compare them
# --------------------------------------------------------------------------------------------

def trace_counts(ops) -> dict:
    """MXU FLOPs by dtype, the matmuls' and the other compute ops' HBM bytes, all-gathered and
    all collective bytes (and those by collective kind) of a tpusim trace's ops (each as the
    trace counts it)."""
    flops: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    mxu_bytes = vpu_bytes = gathered = collective = 0.0
    for o in ops:
        if o.kind == "compute" and o.unit == "mxu":
            flops[o.dtype] = flops.get(o.dtype, 0.0) + o.flops
            mxu_bytes += o.hbm_bytes
        elif o.kind == "compute":
            vpu_bytes += o.hbm_bytes
        elif o.kind == "collective":
            collective += o.bytes
            kind = str(o.collective)
            by_kind[kind] = by_kind.get(kind, 0.0) + o.bytes
            if o.collective == "all-gather":
                gathered += o.bytes
    return {"dot_flops": flops, "mxu_bytes": mxu_bytes, "vpu_bytes": vpu_bytes,
            "allgather_bytes": gathered, "collective_bytes": collective,
            "collective_bytes_by_kind": dict(sorted(by_kind.items()))}


def module_counts(text: str, physical: str, source: str) -> dict:
    """`trace_counts` of a compiled module as tpusim's HLO importer reads it (each op times
    its loop trips) on the pod `physical` (`"v5e:4x4"`)."""
    # deferred: the jax worker imports this module under the jax[tpu] python, which has none of
    # tpusim's other dependencies; only the driver reads modules.
    from sim.chips import get_chip
    from topologies.slices import resolve_topology
    from workloads.hlo.lower import import_hlo

    chip, shape = physical.split(":")
    c = get_chip(chip)
    topo = resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape, shape=shape)
    return trace_counts(import_hlo(text, topology=topo, source=source).trace.ops)


def compile_form(module: str, name: str, form: str, physical: str, jax_python: str,
                 dump: str | None) -> dict:
    """Compile program `name` in `form` by `python -m MODULE --worker NAME --form FORM` under
    the jax python (its module kept in `dump`/NAME_FORM if given) and read the module back:
    the worker's result and `module_counts`."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(dump, f"{name}_{form}") if dump else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        result = run_worker(module, name, jax_python, ["--form", form, "--dump", str(where)])
        text = gzip.decompress(Path(where, "module.hlo.txt.gz").read_bytes()).decode()
        return {**result, **module_counts(text, physical, name)}


def tpusim_step(model: dict, flags: list[str], source: str) -> tuple[dict, object]:
    """tpusim's side of a program: `tpusim train --json` and the compiled trace (`tpusim
    compile`) of `model` with `flags`, each a whole process as a user runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "model.yaml")
        path.write_text(tpusim_model_yaml(model))
        trace_file = Path(tmp, "step.json")
        subprocess.run([sys.executable, "-m", "sim", "compile", "--model", str(path), "-o",
                        str(trace_file), *flags], check=True, capture_output=True, cwd=REPO)
        trace = trace_file.read_text()
        run = subprocess.run([sys.executable, "-m", "sim", "train", "--model", str(path),
                              "--json", *flags], check=True, capture_output=True, text=True,
                             cwd=REPO)
    # deferred: driver side only (see `module_counts`).
    from workloads.trace import Trace

    return json.loads(run.stdout), Trace.from_json(trace, source=source)


# -- the dense decoder's one-choice cross-checks -----------------------------------------------
# validation/xla_int8.py, xla_logits.py and xla_progflags.py compile one decoder (SMALL widths,
# DENSE_LAYERS scanned layers, dot attention, bf16 params, Adam) on the same pods, meshes and
# batch, varying one choice (the weight matmuls' format, the logits dot's dtype, the MLP's
# activation dtype, the embedding lookup), and run tpusim on the same step: these are their
# shared pieces. A program's settings name its `chip` and `mesh` (keys of the tables below)
# and its `remat`.
DENSE_CHIPS = {"v5e": ("v5e:4x4", ["--chip", "v5e", "--shape", "4x4"]),
               "v5p": ("v5p:2x2x4", ["--chip", "v5p", "--shape", "2x2x4"])}
DENSE_MESHES = {"fsdp": {"fsdp": 16}, "fsdp_tp": {"fsdp": 4, "tensor": 4}}
DENSE_LAYERS, DENSE_SEQ, DENSE_BATCH_PER_CHIP = 4, 2048, 2


def dense_mesh(cfg: dict):
    """(jax python) The program's (mesh, devices) on its physical topology."""
    return build_mesh(DENSE_CHIPS[cfg["chip"]][0], DENSE_MESHES[cfg["mesh"]],
                      placement="topology")


def compile_dense_step(model, name: str, form: str, n_chips: int, remat: str, dump: str) -> None:
    """(jax python) Compile `model`'s training step on the dense programs' batch (tokens split
    over fsdp) and emit the worker's result: memory statistics and the HBM peak of XLA's buffer
    assignment; the module is kept in `dump` for `compile_form` to read back."""
    # deferred: jax is optional (the jax[tpu] python that compiles has it)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from validation import xla_live_ranges

    params = model.params(DENSE_LAYERS, stacked=True)
    tokens = model.sds((int(DENSE_BATCH_PER_CHIP * n_chips), DENSE_SEQ), P("fsdp", None),
                       jnp.int32)
    compiled = model.lower_train(params, tokens, remat=remat, scan=True).compile()
    text = compiled.as_text()
    out = {"config": name, "form": form, "num_chips": int(n_chips), **memory_stats(compiled),
           "hbm_peak_bytes": int(xla_live_ranges.hbm_peak(Path(dump)))}
    Path(dump, "module.hlo.txt.gz").write_bytes(gzip.compress(text.encode()))
    emit(out)


def dense_tpusim_flags(cfg: dict, choice: list[str]) -> list[str]:
    """`tpusim train` flags of the same step, with the `choice` flags the program varies."""
    mesh = ",".join(f"{k}={v}" for k, v in DENSE_MESHES[cfg["mesh"]].items())
    gather = "mixed-async" if cfg["chip"] == "v5e" else "mixed-blocking"
    return [*DENSE_CHIPS[cfg["chip"]][1], "--mesh", mesh, "--seq-len", str(DENSE_SEQ),
            "--batch-per-chip", str(DENSE_BATCH_PER_CHIP), "--remat", cfg["remat"],
            "--attention", "dot", "--tp-activations", "replicated", "--fsdp-gather", gather,
            *choice]


def dense_tpusim_side(model_name: str, flags: list[str], source: str) -> dict:
    """tpusim's step of a dense program: HBM peak (and its breakdown) and `trace_counts`."""
    doc, trace = tpusim_step(tpusim_model_dict(SMALL, DENSE_LAYERS, model_name), flags, source)
    return {"hbm_peak_bytes": doc["hbm_peak_bytes"], **trace_counts(trace.ops),
            "hbm_peak_breakdown": doc["hbm_peak_breakdown"]}


def dense_describe(cfg: dict) -> str:
    """A dense program's row label: physical topology, mesh, remat."""
    mesh = " x ".join(f"{k}={v}" for k, v in DENSE_MESHES[cfg["mesh"]].items())
    return f"{DENSE_CHIPS[cfg['chip']][0]} {mesh}, remat {cfg['remat']}"


def dots_report(_key: str, result: dict) -> str:
    """`compile_into_cache`'s line for a compiled dense program: its peak and dot FLOPs."""
    dots = {d: round(v / 1e12, 4) for d, v in result["dot_flops"].items()}
    return f"peak {result['hbm_peak_bytes'] / 1e9:.3f} GB, dots {dots}"
