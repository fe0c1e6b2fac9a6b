"""XLA's compiled TPU programs from JAX, deviceless: a dense LLaMA-style decoder (the HLO test
fixtures' program) compiled by `jax[tpu]` for a real TPU topology on a CPU-only machine, as the
HLO text `tpusim import-hlo` and `tpusim replay` read (`compiled.as_text()`).

This module imports nothing of tpusim and imports jax only inside the functions that compile,
so it runs under a python that has `jax[tpu]==0.10.2` and nothing else (numpy comes with jax):
`tpusim make-hlo-fixture` (sim/cli/hlo.py) calls `compile_program` in its own python when jax
is importable there, or runs this file as a script under its `jax_python` (a venv of its own:
`python3.11 -m venv hlo-venv && hlo-venv/bin/pip install 'jax[tpu]==0.10.2'`, docs/hlo.md);
validation/make_hlo_fixtures.py builds the committed fixtures with it and validation/
xla_compile.py's cross-checks use its decoder, mesh and remat policies.

The model (`Decoder`): GQA attention, SwiGLU MLP, RMSNorm in f32, untied embeddings, plain dot
attention with f32 scores (causal in training, against a KV cache in decode), bf16 weights,
MaxText-like logical sharding (embed dim on `fsdp`, heads / d_ff / vocab on `tensor`, the batch
on `data` x `fsdp`); a training step with Adam (f32 moments, donated arguments) under a remat
policy (`remat_layer`), and a one-token decode step; `attention="splash"` puts jax's Pallas
splash-attention TPU kernel (MaxText's flash attention) in place of dot attention in training.

The text written (`compile_program`) is `compiled.as_text()` with two comment lines in front:
`// tpusim: partition_coords=x,y[,z] ...` (where XLA's runtime runs each SPMD partition, as
`jax.experimental.topologies.make_mesh` lays the mesh out; tpusim places the partitions by it)
and `// tpusim: config={...}` (the program's settings as JSON); `metadata={...}` attributes and
the source-location tables are dropped unless `keep_metadata` (they carry no cost).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

DIM_KEYS = ("d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size")


def init_jax(dump: str | None = None, pass_re: str | None = None) -> None:
    """Deviceless compiles on the CPU host; `dump` makes XLA write its pass dumps there."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Deviceless compiles need no exclusive TPU: let several processes load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if dump:
        flags = f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
        if pass_re:
            flags += f" --xla_dump_hlo_pass_re={pass_re}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()


def build_mesh(topology: str, axes: dict[str, int], placement: str = "make_mesh"):
    """(mesh, its devices array) for a TPU topology such as "v5e:4x4" and named axis sizes.

    placement "make_mesh": `jax.experimental.topologies.make_mesh` (lays the mesh out as the
    TPU runtime would: a snake ring on a 4x4 v5e); "topology": the devices in topology order
    reshaped to the axis sizes (first axis outermost, last innermost); "hybrid_ring_64x4":
    MaxText's custom mesh of that name (axes of 64 and 4 on a 16x16). Axes are `Auto` (jax
    0.10's default Explicit rejects Megatron-style einsums)."""
    init_jax()
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    names, shape = tuple(axes), tuple(axes.values())
    if placement == "make_mesh":
        devices = topologies.make_mesh(topo, shape, names).devices
    elif placement == "topology":
        devices = np.array(topo.devices).reshape(shape)
    elif placement == "hybrid_ring_64x4":
        devices = _hybrid_ring_64x4(topo.devices, shape)
    else:
        raise ValueError(f"placement {placement!r}: use 'make_mesh', 'topology' or "
                         "'hybrid_ring_64x4'")
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names)), devices


# The 2x2 block's chips in ring order (dx, dy): each a torus neighbour of the next.
_BLOCK_RING = ((0, 0), (1, 0), (1, 1), (0, 1))


def _hybrid_ring_64x4(devices, shape: tuple[int, ...]):
    """MaxText's `hybrid_ring_64x4` device order on a 16x16 slice (`max_utils.
    reshape_mesh_to_rings`): mesh index (i, j) of shape (64, 4) is block i of the 8x8 grid of
    2x2 blocks (x-major) and chip j of that block's 4-ring."""
    if tuple(shape) != (64, 4):
        raise ValueError(f"hybrid_ring_64x4 needs mesh axes of 64 and 4, got {shape}")
    at = {tuple(d.coords[:2]): d for d in devices}
    out = np.empty(shape, dtype=object)
    for i in range(64):
        bx, by = divmod(i, 8)
        for j, (dx, dy) in enumerate(_BLOCK_RING):
            out[i, j] = at[(2 * bx + dx, 2 * by + dy)]
    return out


def partition_coords(devices, topology: str) -> str:
    """Where each SPMD partition runs: "x,y[,z]" per device in mesh order (fixtures' header)."""
    ndim = len(topology.split(":")[1].split("x"))
    return " ".join(",".join(str(c) for c in dev.coords[:ndim]) for dev in devices.flat)


def _identity_tag(x, _name):
    return x


class Decoder:
    """The dense LLaMA-style decoder on a mesh.

    dims: widths (`DIM_KEYS`). act_spec: the residual stream's PartitionSpec (the default is
    the batch over data x fsdp, sequence and embed replicated). scopes: wrap the pieces in
    `jax.named_scope` ("embed", "layer{i}", "head", "adam"; "norm" around each RMSNorm and
    "attention" around the attention core inside them) so the HLO metadata says where each op
    came from (xla_crosscheck attributes collectives and per-op costs by it). tag: a
    `checkpoint_name`-like function applied to each weight matmul's output (MaxText's names:
    query_proj, key_proj, value_proj, out_proj, mlpwi_0, mlpwi_1, mlpwo). attention: "dot"
    (f32 scores through HBM) or "splash": jax's Pallas splash-attention TPU kernel, as
    MaxText calls it (`splash_attention`: causal mask, q scaled by 1/sqrt(head_dim) before
    it, [batch, heads, seq, head_dim] layout, the kernel vmapped over the local batch inside a
    `shard_map` whose batch is on data x fsdp and heads on `tensor`; GQA by the kernel's own
    grouping, unfused dq and dkv backward kernels) with every block size `flash_block`
    (MaxText's default sa_block_* is 512). weight_dot: the weight matmuls' dot (AQT's int8
    one in validation/xla_int8.py), None for bf16. logits_dtype: "bf16" (the output
    projection's dot in bf16, its logits cast to f32 for the loss: MaxText's default
    `logits_dot_in_fp32: False` with `cast_logits_to_fp32: True`) or "fp32" (both operands
    cast to f32 before the dot, MaxText's `logits_dot_in_fp32: True`). mlp_act_dtype: "bf16"
    (the SwiGLU's activation and product in the activations' dtype, MaxText's default
    `activations_in_float32: False`) or "fp32" (the gate and up projections' bf16 outputs
    cast to f32 before the activation, the product cast back to bf16 for the down
    projection: MaxText's `MlpBlock` with `activations_in_float32: True`). embed_lookup:
    "auto" (`jnp.take` of the sharded table: XLA's own choice) or "all-gather" (the table's
    d_model replicated by a sharding constraint before the lookup, its vocabulary still split
    over `tensor`, so XLA gathers it over fsdp)."""

    def __init__(self, mesh, dims: dict, *, act_spec=None, scopes: bool = False,
                 tag: Callable = _identity_tag, param_dtype: str = "bfloat16",
                 attention: str = "dot", flash_block: int = 512,
                 weight_dot: Callable | None = None, logits_dtype: str = "bf16",
                 mlp_act_dtype: str = "bf16", embed_lookup: str = "auto"):
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        self.mesh = mesh
        self.dims = dims
        self.d, self.h, self.kv, self.hd, self.ff, self.vocab = (dims[k] for k in DIM_KEYS)
        names = mesh.axis_names
        self.tp = "tensor" if "tensor" in names else None
        self.fs = "fsdp" if "fsdp" in names else None
        # The batch is split over data and fsdp (weights only over fsdp).
        bs = tuple(a for a in ("data", "fsdp") if a in names) or None
        self.bs = bs[0] if bs is not None and len(bs) == 1 else bs
        self.act_spec = P(self.bs, None, None) if act_spec is None else act_spec
        self.scopes = scopes
        self.tag = tag
        # weight_dot(x, w, seed): the weight matmuls' dot (None: bf16 `x @ w`), e.g.
        # validation/xla_int8.aqt_dot; `seed` a traced uint32 (from the step's tokens).
        self.weight_dot = weight_dot
        self._seed = None
        if logits_dtype not in ("bf16", "fp32"):
            raise ValueError(f"logits_dtype {logits_dtype!r}: use 'bf16' or 'fp32'")
        self.logits_dtype = logits_dtype
        if mlp_act_dtype not in ("bf16", "fp32"):
            raise ValueError(f"mlp_act_dtype {mlp_act_dtype!r}: use 'bf16' or 'fp32'")
        self.mlp_act_dtype = mlp_act_dtype
        if embed_lookup not in ("auto", "all-gather"):
            raise ValueError(f"embed_lookup {embed_lookup!r}: use 'auto' or 'all-gather'")
        self.embed_lookup = embed_lookup
        self.bf = jnp.bfloat16
        if attention not in ("dot", "splash"):
            raise ValueError(f"attention {attention!r}: use 'dot' or 'splash'")
        self.attention_kind = attention
        self.flash_block = flash_block
        # The stored weights' dtype: "float32" is flax's param_dtype=float32 with
        # dtype=bfloat16 (MaxText's default): f32 master weights, each cast to bf16 right
        # before its matmul / lookup, the Adam update in f32 written back in f32.
        if param_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"param_dtype {param_dtype!r}: use 'bfloat16' or 'float32'")
        self.pdt = jnp.dtype(param_dtype)
        fs, tp = self.fs, self.tp
        d, h, kv, hd, ff, vocab = self.d, self.h, self.kv, self.hd, self.ff, self.vocab
        self.wspec = {"wq": P(fs, tp), "wk": P(fs, tp), "wv": P(fs, tp), "wo": P(tp, fs),
                      "w1": P(fs, tp), "w3": P(fs, tp), "w2": P(tp, fs), "n1": P(None),
                      "n2": P(None)}
        self.wshape = {"wq": (d, h * hd), "wk": (d, kv * hd), "wv": (d, kv * hd),
                       "wo": (h * hd, d), "w1": (d, ff), "w3": (d, ff), "w2": (ff, d),
                       "n1": (d,), "n2": (d,)}
        self.top_spec = {"embed": P(tp, fs), "unembed": P(fs, tp), "nf": P(None)}
        self.top_shape = {"embed": (vocab, d), "unembed": (d, vocab), "nf": (d,)}

    # -- inputs ------------------------------------------------------------------------------

    def sds(self, shape, spec, dtype=None):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        from jax.sharding import NamedSharding

        return jax.ShapeDtypeStruct(shape, self.bf if dtype is None else dtype,
                                    sharding=NamedSharding(self.mesh, spec))

    def params(self, n_layers: int, stacked: bool = False) -> dict:
        """The weights (bf16, or f32 with `param_dtype="float32"`): a list of per-layer dicts,
        or (stacked) one dict of [layers, ...] arrays for `jax.lax.scan`, as MaxText's
        scan_layers."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        from jax.sharding import PartitionSpec as P

        dt = self.pdt
        p = {k: self.sds(self.top_shape[k], self.top_spec[k], dt) for k in self.top_shape}
        if stacked:
            p["layers"] = {k: self.sds((n_layers, *self.wshape[k]), P(None, *self.wspec[k]),
                                       dt) for k in self.wshape}
        else:
            p["layers"] = [{k: self.sds(self.wshape[k], self.wspec[k], dt)
                            for k in self.wshape} for _ in range(n_layers)]
        return p

    def scope(self, name: str):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax

        return jax.named_scope(name) if self.scopes else contextlib.nullcontext()

    def constrain(self, x):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        from jax.sharding import NamedSharding

        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.act_spec))

    # -- the model ---------------------------------------------------------------------------

    def rms(self, x, w):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp

        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(jnp.float32)).astype(self.bf)

    def attention(self, q, k, v, causal: bool):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp

        if self.attention_kind == "splash":
            if not causal:
                raise ValueError("splash attention is the training step's causal attention")
            return self.splash_attention(q, k, v)
        kv, h, hd = self.kv, self.h, self.hd
        b, s, _ = q.shape
        t = k.shape[1]
        q = q.reshape(b, s, kv, h // kv, hd)
        k = k.reshape(b, t, kv, hd)
        v = v.reshape(b, t, kv, hd)
        sc = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / (hd ** 0.5)
        if causal:
            sc = jnp.where(jnp.tril(jnp.ones((s, t), bool)), sc, -1e30)
        p = jax.nn.softmax(sc, axis=-1).astype(self.bf)
        return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h * hd)

    def splash_attention(self, q, k, v):
        """Causal GQA attention by the Pallas splash kernel (MaxText's `tpu_flash_attention`
        with its default layouts and the block sizes all `flash_block`)."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as sm,
        )
        from jax.sharding import PartitionSpec as P

        kv, h, hd = self.kv, self.h, self.hd
        b, s, _ = q.shape
        tp = self.mesh.shape["tensor"] if self.tp else 1
        blk = min(self.flash_block, s)
        q = (q.reshape(b, s, h, hd) * (hd ** -0.5)).astype(self.bf).transpose(0, 2, 1, 3)
        k = k.reshape(b, s, kv, hd).transpose(0, 2, 1, 3)
        v = v.reshape(b, s, kv, hd).transpose(0, 2, 1, 3)
        sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                              block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                              block_q_dq=blk, block_kv_dq=blk)
        # One kernel for a chip's heads: the heads are split over `tensor` by the shard_map.
        mask = sm.MultiHeadMask([sm.CausalMask((s, s)) for _ in range(h // tp)])
        kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)
        spec = P(self.bs, self.tp, None, None)

        @jax.shard_map(mesh=self.mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)
        def local(q, k, v):
            return jax.vmap(kernel)(q, k, v)

        return local(q, k, v).transpose(0, 2, 1, 3).reshape(b, s, h * hd)

    def layer(self, x, w, i: int = 0, cache=None):
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp

        tag = self.tag
        # f32 master weights are cast to bf16 where they are used (flax's dtype=bfloat16).
        w = {k: (v if k in ("n1", "n2") else v.astype(self.bf)) for k, v in w.items()}
        with self.scope(f"layer{i}"):
            with self.scope("norm"):
                y = self.rms(x, w["n1"])
            q = tag(self.wmm(y, w["wq"]), "query_proj")
            k = tag(self.wmm(y, w["wk"]), "key_proj")
            v = tag(self.wmm(y, w["wv"]), "value_proj")
            with self.scope("attention"):
                if cache is not None:
                    k = jnp.concatenate([cache[0], k], axis=1)
                    v = jnp.concatenate([cache[1], v], axis=1)
                a = tag(self.attention(q, k, v, causal=cache is None), "context")
            x = self.constrain(x + tag(self.wmm(a, w["wo"]), "out_proj"))
            with self.scope("norm"):
                y = self.rms(x, w["n2"])
            g = tag(self.wmm(y, w["w1"]), "mlpwi_0")
            u = tag(self.wmm(y, w["w3"]), "mlpwi_1")
            if self.mlp_act_dtype == "fp32":
                m = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(self.bf)
            else:
                m = jax.nn.silu(g) * u
            return self.constrain(x + tag(self.wmm(m, w["w2"]), "mlpwo"))

    def wmm(self, x, w):
        """A weight matmul: bf16 `x @ w`, or `weight_dot`."""
        if self.weight_dot is None:
            return x @ w
        return self.weight_dot(x, w, self._seed)

    def loss(self, p, tok, remat: str = "full", scan: bool = False):
        """Mean next-token cross-entropy, each layer under `remat_layer(remat)`; scan: the
        layers are stacked and run by `jax.lax.scan` (one loop body, as MaxText)."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if self.weight_dot is not None:
            # A traced seed for the stochastic rounding (a constant key could be folded).
            self._seed = tok[0, 0].astype(jnp.uint32)
        with self.scope("embed"):
            table = p["embed"].astype(self.bf)
            if self.embed_lookup == "all-gather":
                table = jax.lax.with_sharding_constraint(table, NamedSharding(self.mesh,
                                                                           P(self.tp, None)))
            x = self.constrain(jnp.take(table, tok, axis=0))
        if scan:
            body = remat_layer(lambda x, w: self.layer(x, w), remat)
            x, _ = jax.lax.scan(lambda x, w: (body(x, w), None), x, p["layers"])
        else:
            for i, w in enumerate(p["layers"]):
                x = remat_layer(lambda x, w, i=i: self.layer(x, w, i), remat)(x, w)
        with self.scope("head"):
            with self.scope("norm"):
                x = self.rms(x, p["nf"])
            if self.logits_dtype == "fp32":
                f32 = jnp.float32
                logits = x.astype(f32) @ p["unembed"].astype(f32)
            else:
                logits = (x @ p["unembed"].astype(self.bf)).astype(jnp.float32)
            lse = jax.nn.logsumexp(logits, axis=-1)
            tgt = jnp.take_along_axis(logits, tok[..., None], axis=-1)[..., 0]
            return jnp.mean(lse - tgt)

    def train_step(self, loss_fn: Callable):
        """One Adam step of loss_fn(params, tokens): (loss, params, m1, m2)."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp

        pdt = self.pdt

        def step(p, m1, m2, tok):
            loss, g = jax.value_and_grad(loss_fn)(p, tok)
            with self.scope("adam"):
                m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g.astype(jnp.float32), m1, g)
                m2 = jax.tree.map(lambda m, g: 0.95 * m + 0.05 * jnp.square(
                    g.astype(jnp.float32)), m2, g)
                p = jax.tree.map(lambda w, a, b: (w.astype(jnp.float32) - 1e-4 * a
                                                  * jax.lax.rsqrt(b + 1e-8)).astype(pdt),
                                 p, m1, m2)
            return loss, p, m1, m2

        return step

    def lower_train(self, params: dict, tokens, remat: str = "full", scan: bool = False):
        """The lowered Adam step of `loss` with f32 moments shaped and sharded as the params."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp

        mom = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                                          sharding=s.sharding), params)
        def loss_fn(p, tok):
            return self.loss(p, tok, remat, scan)

        return jax.jit(self.train_step(loss_fn), donate_argnums=(0, 1, 2)).lower(
            params, mom, mom, tokens)

    def lower_decode(self, n_layers: int, batch: int, kv_len: int, sampling: str = "argmax",
                     logits_f32: bool = False, top_k: int = 64):
        """One new token per sequence against a per-layer KV cache of kv_len (heads on
        `tensor`); the residual is replicated. sampling "argmax" (greedy) or "top-k" (the
        `top_k` largest logits, then a categorical draw among them; the key is an argument);
        logits_f32: the logits are cast to f32 before sampling (MaxText's
        `cast_logits_to_fp32`), else they stay bf16 (the HLO fixture's program)."""
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        if sampling not in ("argmax", "top-k"):
            raise ValueError(f"sampling {sampling!r}: use 'argmax' or 'top-k'")
        params = self.params(n_layers)
        tokens = self.sds((batch, 1), P(None, None), jnp.int32)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32,
                                   sharding=jax.sharding.NamedSharding(self.mesh, P(None)))
        cache_spec = P(None, None, self.tp)
        caches = [(self.sds((batch, kv_len, self.kv * self.hd), cache_spec),
                   self.sds((batch, kv_len, self.kv * self.hd), cache_spec))
                  for _ in range(n_layers)]
        # The decode step keeps the residual replicated (one token per sequence).
        self.act_spec = P(None, None, None)

        def decode(p, caches, tok, key=None):
            x = jnp.take(p["embed"], tok, axis=0)
            for i, w in enumerate(p["layers"]):
                x = self.layer(x, w, i, cache=caches[i])
            with self.scope("head"):
                with self.scope("norm"):
                    y = self.rms(x, p["nf"])
                logits = y @ p["unembed"]
                if logits_f32:
                    logits = logits.astype(jnp.float32)
                if sampling == "argmax":
                    return jnp.argmax(logits, axis=-1)
                vals, idx = jax.lax.top_k(logits, top_k)
                pick = jax.random.categorical(jax.random.wrap_key_data(key), vals, axis=-1)
                return jnp.take_along_axis(idx, pick[..., None], axis=-1)[..., 0]

        if sampling == "argmax":
            return jax.jit(decode).lower(params, caches, tokens)
        return jax.jit(decode).lower(params, caches, tokens, key)


_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
MAXTEXT_NAMED = {
    "save_dot_with_context_except_mlp": (_QKV + ("context", "out_proj"), ()),
    "save_dot_except_mlpwi": (_QKV + ("out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": (_QKV + ("out_proj",), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "qkv_proj_offloaded": ((), ("query_proj", "key_proj", "value_proj")),
}


def remat_layer(layer: Callable, remat: str):
    """The layer under a remat policy: "none", "full" (`jax.checkpoint`), "minimal"
    (`checkpoint_dots_with_no_batch_dims`), "offload" (MaxText's minimal_offloaded: the
    tagged weight-matmul outputs go to pinned host memory, nothing else is saved),
    "minimal_with_context" (minimal and the tagged `context`), or one of MaxText's named
    policies (`MAXTEXT_NAMED`: save / offload only these names)."""
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax

    cp = jax.checkpoint_policies
    if remat == "none":
        return layer
    if remat == "full":
        return jax.checkpoint(layer)
    if remat == "minimal":
        return jax.checkpoint(layer, policy=cp.checkpoint_dots_with_no_batch_dims)
    if remat == "minimal_with_context":
        return jax.checkpoint(layer, policy=cp.save_from_both_policies(
            cp.checkpoint_dots_with_no_batch_dims, cp.save_only_these_names("context")))
    if remat == "offload":
        return jax.checkpoint(
            layer, policy=cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=["query_proj", "key_proj", "value_proj",
                                              "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"],
                offload_src="device", offload_dst="pinned_host"))
    if remat in MAXTEXT_NAMED:
        saved, offloaded = MAXTEXT_NAMED[remat]
        if not offloaded:
            return jax.checkpoint(layer, policy=cp.save_only_these_names(*saved))
        return jax.checkpoint(layer, policy=cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst="pinned_host"))
    raise ValueError(f"remat {remat!r}: use none, full, minimal, minimal_with_context, offload "
                     f"or one of {', '.join(MAXTEXT_NAMED)}")



# -- one program, as `tpusim make-hlo-fixture` and the fixtures compile it ----------------------
PROGRAMS = ("train", "scan", "decode", "matmul")
REMATS = ("none", "full", "minimal", "minimal_with_context", "offload", *MAXTEXT_NAMED)


@dataclass(frozen=True, kw_only=True)
class HloProgramConfig:
    """One program to compile: `topology` is jax's TPU topology name (`v5p:4x4x4`), `mesh` the
    program's mesh axes (`data`, `fsdp`, `tensor`: their product is the topology's device count,
    each a product of whole physical axes as `make_mesh` requires), `dims` the decoder's widths
    (`DIM_KEYS`), `program` one of `PROGRAMS` (a training step, the same with `jax.lax.scan` over
    stacked layers, a one-token decode step against a `kv_len` cache, or one FSDP matmul and its
    gradient), `batch_per_chip` sequences per chip."""

    topology: str
    mesh: dict[str, int]
    dims: dict[str, int]
    num_layers: int
    program: str = "train"
    seq_len: int = 1024
    batch_per_chip: float = 1
    kv_len: int = 1024
    remat: str = "full"
    keep_metadata: bool = False
    name: str = ""
    extra: dict = field(default_factory=dict)  # more keys for the config comment line


def compile_program(cfg: HloProgramConfig) -> str:
    """The HLO text of `cfg`'s program compiled deviceless for its topology, with the two
    `// tpusim:` comment lines in front. Raises ValueError (one line) for a mesh or topology jax
    refuses."""
    init_jax()
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if cfg.program not in PROGRAMS:
        raise ValueError(f"program {cfg.program!r}: use one of {', '.join(PROGRAMS)}")
    try:
        mesh, devices = build_mesh(cfg.topology, dict(cfg.mesh))
    except Exception as exc:  # jax's ValueError / JaxRuntimeError, as one line
        mesh_text = ",".join(f"{k}={v}" for k, v in cfg.mesh.items())
        raise ValueError(f"{cfg.topology} with mesh {mesh_text}: "
                         f"{' '.join(str(exc).split())[:300]} (give mesh axes whose product is "
                         f"the topology's device count, each a product of whole physical "
                         f"axes)") from None
    n_chips = devices.size
    model = Decoder(mesh, cfg.dims)
    batch = int(cfg.batch_per_chip * n_chips)
    seq = cfg.seq_len
    if cfg.program in ("train", "scan"):
        params = model.params(cfg.num_layers, stacked=cfg.program == "scan")
        tokens = model.sds((batch, seq), P(model.fs, None), jnp.int32)
        lowered = model.lower_train(params, tokens, remat=cfg.remat,
                                    scan=cfg.program == "scan")
    elif cfg.program == "decode":
        lowered = model.lower_decode(cfg.num_layers, batch, cfg.kv_len)
    else:  # one FSDP matmul and its gradient: XLA's windowed einsum on v5e
        x = model.sds((batch, seq, model.d), P(model.fs, None, None))
        w = model.sds((model.d, model.ff), P(model.fs, None))

        def f(x, w):
            return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))

        lowered = jax.jit(jax.grad(f, argnums=1)).lower(x, w)
    text = lowered.compile().as_text()
    coords = partition_coords(devices, cfg.topology)
    meta = {**cfg.extra, "topology": cfg.topology, "mesh": dict(cfg.mesh),
            "program": cfg.program, "layers": cfg.num_layers, "seq": seq,
            "batch_per_chip": cfg.batch_per_chip, "name": cfg.name,
            "num_layers": cfg.num_layers, "num_chips": int(n_chips), "jax": jax.__version__,
            **cfg.dims}
    if cfg.program == "decode":
        meta["kv_len"] = cfg.kv_len
    if cfg.remat != "full":
        meta["remat"] = cfg.remat
    if not cfg.keep_metadata:
        text = strip_metadata(text)
    return (f"// tpusim: partition_coords={coords}\n"
            f"// tpusim: config={json.dumps(meta, sort_keys=True)}\n{text}")


def strip_metadata(text: str) -> str:
    """`text` without `metadata={...}` attributes and the source-location tables."""
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
    """Script mode, for a python that has jax and not tpusim (`tpusim make-hlo-fixture`
    with a `jax_python`): reads `{"config": {...}, "out": PATH}` (`job_json`) on stdin, compiles the
    program and writes its text to PATH; a refusal is one line on stderr and exit status 2."""
    job = json.loads(sys.stdin.read())
    cfg = HloProgramConfig(**job["config"])
    try:
        text = compile_program(cfg)
    except ValueError as exc:
        print(f"jax: {exc}", file=sys.stderr)
        return 2
    with open(job["out"], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


def job_json(cfg: HloProgramConfig, out: str) -> str:
    """What `main` reads: the program's settings and the file to write."""
    return json.dumps({"config": asdict(cfg), "out": out}, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
