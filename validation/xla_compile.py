"""The XLA side shared by the modules that compile JAX programs deviceless for real TPU
topologies (make_hlo_fixtures, xla_crosscheck, xla_memory, xla_moe_schedule) and read the
results back (hlo_import): the JAX models, the mesh, the deviceless compile and the
compile-and-cache loop.

jax is not a tpusim dependency. The functions that build and compile programs import jax
lazily and run under a python with `jax[tpu]==0.10.2` (docs/reference/xla.md; the driver
modules run themselves as a worker, `python -m validation.NAME --worker`, under
`--jax-python`: a venv with `pip install '.[hlo]'`); everything else here runs under the
project's python too and imports no tpusim code.

The models (one place, so every script compiles the same decoder):

* a LLaMA-style dense decoder (`Decoder`): GQA, SwiGLU, RMSNorm in f32, untied embeddings,
  plain dot attention with f32 scores (causal in training, against a KV cache in decode), bf16
  weights, MaxText-like logical sharding (embed dim on `fsdp`, heads / d_ff / vocab on
  `tensor`, the batch on `data` x `fsdp`); a training step with Adam (f32 moments, donated
  arguments) and a one-token decode step; `attention="splash"` puts jax's Pallas
  splash-attention TPU kernel (MaxText's flash attention) in place of dot attention in
  training;
* a MaxText-style dropping MoE decoder (`moe_train_step`): one-hot dispatch and combine masks
  with a capacity factor, experts sharded over `expert`, SGD update.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# The cached XLA results (committed, so the tables regenerate without jax).
RESULTS = REPO / "validation" / "results"
# A venv with jax[tpu]==0.10.2 (docs/reference/xla.md says how to make one).
DEFAULT_JAX_PYTHON = "/work/fid-venv/bin/python"
# The line a worker prints its result on (one JSON object).
RESULT_PREFIX = "XLA_JSON "

DIM_KEYS = ("d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size")
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
    one in validation/xla_int8.py), None for bf16."""

    def __init__(self, mesh, dims: dict, *, act_spec=None, scopes: bool = False,
                 tag: Callable = _identity_tag, param_dtype: str = "bfloat16",
                 attention: str = "dot", flash_block: int = 512,
                 weight_dot: Callable | None = None):
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
            m = jax.nn.silu(tag(self.wmm(y, w["w1"]), "mlpwi_0")) * \
                tag(self.wmm(y, w["w3"]), "mlpwi_1")
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

        if self.weight_dot is not None:
            # A traced seed for the stochastic rounding (a constant key could be folded).
            self._seed = tok[0, 0].astype(jnp.uint32)
        with self.scope("embed"):
            x = self.constrain(jnp.take(p["embed"].astype(self.bf), tok, axis=0))
        if scan:
            body = remat_layer(lambda x, w: self.layer(x, w), remat)
            x, _ = jax.lax.scan(lambda x, w: (body(x, w), None), x, p["layers"])
        else:
            for i, w in enumerate(p["layers"]):
                x = remat_layer(lambda x, w, i=i: self.layer(x, w, i), remat)(x, w)
        with self.scope("head"):
            with self.scope("norm"):
                x = self.rms(x, p["nf"])
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


def lower_moe_train(mesh, *, d_model: int, d_ff: int, num_experts: int, top_k: int,
                    capacity_factor: float, seq: int, num_heads: int, head_dim: int,
                    num_layers: int, vocab_size: int, scopes: bool = False,
                    optimizer: str = "sgd", final_norm: bool = False,
                    router: str = "f32", num_kv_heads: int | None = None,
                    batch_per_chip: int = 1, attention_block: int = 0):
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
    lets the runs' batches of long sequences fit a chip (0: one [seq, seq] score matrix)."""
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
    cap = 0 if dense else int(max(-(-SEQ * K // E) * CF, CF))

    def scope(name):
        return jax.named_scope(name) if scopes else contextlib.nullcontext()

    def ns(spec):
        return NamedSharding(mesh, spec)

    def sds(shp, spec, dt=bf):
        return jax.ShapeDtypeStruct(shp, dt, sharding=ns(spec))

    batch = ("fsdp", "expert")
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
        # MaxText RoutedMoE.get_topk (softmax over the k in f32, cast to the bf16 activation
        # dtype), reshape_and_update_weights and generate_masks, line for line.
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

    def moe(x, w):
        if dense:
            return (jax.nn.silu(x @ w["w0"]) * (x @ w["w1"])) @ w["wout"]
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
        disp = jax.lax.with_sharding_constraint(disp, ns(P(batch, None, None, None)))
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


def write_cache(path: Path, cache: dict, compact: bool = False) -> None:
    """The cache, programs sorted by name; `compact`: no whitespace (long op lists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(sorted(cache.items())), separators=(",", ":")) if compact else \
        json.dumps(dict(sorted(cache.items())), indent=1)
    path.write_text(text + "\n")


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
    """A tpusim model (the dict `workloads.models.model_from_dict` reads) with these widths:
    from a zoo model (`base`) or from scratch (SwiGLU, untied embeddings, as `Decoder`)."""
    head = {"base": base} if base else {"mlp": "swiglu", "tied_embeddings": False}
    return {**head, "name": name, "num_layers": num_layers, **dims}


def tpusim_model_yaml(model: dict) -> str:
    return "".join(f"{k}: {v}\n" for k, v in model.items())
