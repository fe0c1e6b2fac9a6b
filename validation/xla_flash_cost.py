"""What XLA's compiled programs say a flash-attention kernel costs, against tpusim's flash
attention ops (issue 11, "dot and flash attention where the program can express it").

XLA side (`--compile`, needs a `jax[tpu]==0.10.2` python, `--jax-python`): the training-step
attention alone (`jax.grad` of the summed causal attention output, so the forward kernel and
both backward kernels are compiled) with jax's Pallas TPU kernels, as MaxText calls them
(`shard_map` over the batch on fsdp=16, the kernel on each chip's two sequences), compiled
deviceless for v5e 4x4, v6e 4x4 and v5p 2x2x4:

* `flash`: `jax.experimental.pallas.ops.tpu.flash_attention` (causal, every block 512);
* `splash`: `...splash_attention` (`make_splash_mha`, a causal mask, every block 512:
  MaxText's default sa_block_*; what the measured MaxText runs use).

Both at the attention widths of `xla_memory.py`'s decoder (16 heads of 128; 16 KV heads,
as the `flash` kernel needs as many KV heads as query heads), seq 2048, 2 sequences per
chip. Per program it records every `tpu_custom_call` of the optimized HLO (the dump's
`after_codegen` text, whose backend configs `compiled.as_text()` leaves out): its name, the
`cost_estimate` the kernel passed to `pallas_call` (flops, transcendentals, bytes accessed),
an `estimated_cycles` if XLA's cost model gave it one, and the VMEM it reserves; and
`compiled.cost_analysis()` (flops, transcendentals, bytes). Cached in
`validation/results/xla_flash_cost.json`.

tpusim side: the same attention in `tpusim train --attention flash` (a model of these widths,
fsdp=16, remat none): layer 0's `flash_attention` and `flash_attention_bwd` ops, their FLOPs,
HBM bytes and time alone on the chip (`sim.engine.costs.compute_op_times`, the fitted MXU
efficiency and head_dim fill included). The XLA estimate's time is its roofline at the chip's
peaks (max of FLOPs at the bf16 MXU peak and bytes at the HBM bandwidth, `sim/hardware.py`):
XLA gives a custom call no cycle estimate of its own. Nothing here changes tpusim's costs
(a change would need a refit of the MXU factors; docs/validation.md).

Run:
    .venv/bin/python -m validation.xla_flash_cost --compile --jax-python /work/fid-venv/bin/python
    .venv/bin/python -m validation.xla_flash_cost          # the table from the cache

This module is also the XLA worker (`--worker NAME`, under the jax python: a venv with
`pip install '.[hlo]'`).
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
import tempfile
from pathlib import Path

from sim.chips import get_chip
from sim.engine.costs import compute_op_times
from topologies.mesh import parse_mesh
from validation import xla_compile
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_flash_cost.json"

HEADS, HEAD_DIM, SEQ, BATCH_PER_CHIP, BLOCK = 16, 128, 2048, 2, 512
FSDP = 16
CHIPS = {"v5e": "v5e:4x4", "v6e": "v6e:4x4", "v5p": "v5p:2x2x4"}
KERNELS = ("flash", "splash")
PROGRAMS = {f"{chip}_{kernel}": (chip, kernel) for chip in CHIPS for kernel in KERNELS}


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _attention_fn(mesh, kernel: str):
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax
    from jax.sharding import PartitionSpec as P

    if kernel == "flash":
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        bs = fa.BlockSizes(block_q=BLOCK, block_k_major=BLOCK, block_k=BLOCK, block_b=1,
                           block_q_major_dkv=BLOCK, block_k_major_dkv=BLOCK,
                           block_k_dkv=BLOCK, block_q_dkv=BLOCK, block_k_major_dq=BLOCK,
                           block_k_dq=BLOCK, block_q_dq=BLOCK)

        def local(q, k, v):
            return fa.flash_attention(q, k, v, causal=True, sm_scale=HEAD_DIM ** -0.5,
                                      block_sizes=bs)
    else:
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as sm,
        )

        bs = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                           block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                           block_q_dq=BLOCK, block_kv_dq=BLOCK)
        mask = sm.MultiHeadMask([sm.CausalMask((SEQ, SEQ)) for _ in range(HEADS)])
        kern = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=bs)

        def local(q, k, v):
            return jax.vmap(kern)(q * HEAD_DIM ** -0.5, k, v)

    spec = P("fsdp", None, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)


_COST = re.compile(r'"cost_estimate":\{([^}]*)\}')
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
_VMEM = re.compile(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+",'
                   r'"size":"(\d+)"')


def parse_custom_calls(text: str) -> list[dict]:
    """Every `tpu_custom_call` instruction of an HLO text with backend configs: name,
    `cost_estimate` (a dict of floats, or None), `estimated_cycles` (or None), VMEM bytes."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        # The instruction's attributes run on until the next instruction's line.
        j = i + 1
        while j < len(lines) and not re.match(r"\s*(ROOT )?%[\w.\-]+ = ", lines[j]):
            j += 1
        ins = re.sub(r'"body":"[^"]*"', '"body":""', "\n".join(lines[i:j]))
        cost = _COST.search(ins)
        cyc = _CYCLES.search(ins)
        vmem = _VMEM.search(ins)
        out.append({
            "name": re.match(r"\s*(?:ROOT )?%([\w.\-]+)", line).group(1),
            "cost_estimate": None if cost is None else {
                k: float(v) for k, v in re.findall(r'"(\w+)":"?([\d.eE+-]+)"?', cost.group(1))},
            "estimated_cycles": None if cyc is None else int(cyc.group(1)),
            "vmem_bytes": 0 if vmem is None else int(vmem.group(1))})
    return out


def _worker(name: str) -> None:
    chip, kernel = PROGRAMS[name]
    with tempfile.TemporaryDirectory() as dump:
        xla_compile.init_jax(dump)
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh, devices = xla_compile.build_mesh(CHIPS[chip], {"fsdp": FSDP}, placement="topology")
        attn = _attention_fn(mesh, kernel)

        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32))

        shape = (FSDP * BATCH_PER_CHIP, HEADS, SEQ, HEAD_DIM)
        sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P("fsdp", None, None, None)))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(sds, sds, sds).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        files = [f for f in glob.glob(f"{dump}/*after_codegen.txt") if "jit_stage" not in f]
        if len(files) != 1:
            raise RuntimeError(f"expected one after_codegen dump, found {files}")
        calls = parse_custom_calls(Path(files[0]).read_text())
    xla_compile.emit({"program": name, "chip": chip, "kernel": kernel,
                      "num_chips": int(devices.size), "custom_calls": calls,
                      "cost_analysis": {k: float(cost.get(k, 0.0))
                                        for k in ("flops", "transcendentals", "bytes accessed")}})


# --------------------------------------------------------------------------------------------
# tpusim side and the table (runs under the project python)
# --------------------------------------------------------------------------------------------

def tpusim_flash_ops(chip_name: str) -> dict[str, dict]:
    """Layer 0's `flash_attention` and `flash_attention_bwd` in tpusim's step of the same
    attention: flops, HBM bytes and seconds alone on the chip."""
    dims = dict(xla_compile.SMALL, num_kv_heads=HEADS)
    model = model_from_dict(xla_compile.tpusim_model_dict(dims, 1, "xla-flash-cost"))
    tc = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH_PER_CHIP, remat=Remat.NONE,
                        attention="flash")
    trace = compile_training_step(model, parse_mesh(f"fsdp={FSDP}"), FSDP, tc)
    chip = get_chip(chip_name)
    out = {}
    for op in trace.ops:
        if op.layer == 0 and op.name in ("flash_attention", "flash_attention_bwd"):
            out[op.name] = {"flops": op.flops, "hbm_bytes": op.hbm_bytes,
                            "seconds": max(compute_op_times(chip, op)) + chip.op_overhead_s}
    if set(out) != {"flash_attention", "flash_attention_bwd"}:
        raise RuntimeError(f"tpusim's trace has {sorted(out)}, not both flash ops")
    return out


def roofline_s(chip_name: str, flops: float, nbytes: float) -> float:
    """XLA's estimate as time: FLOPs at the bf16 MXU peak or bytes at the HBM bandwidth."""
    chip = get_chip(chip_name)
    return max(flops / chip.mxu_flops_per_s, nbytes / chip.hbm_bytes_per_s)


def table(cache: dict) -> str:
    rows = ["| chip | kernel | custom call | XLA cost_estimate: GFLOP / G transcendentals / MB "
            "| estimated_cycles | tpusim op: GFLOP / MB | XLA / tpusim FLOPs | XLA roofline / "
            "tpusim time |",
            "|---|---|---|---|---:|---|---:|---:|"]
    for name in PROGRAMS:
        x = cache.get(name)
        if x is None:
            continue
        sim = tpusim_flash_ops(x["chip"])
        for c in x["custom_calls"]:
            op = "flash_attention_bwd" if re.search(r"bwd|dq|dkv", c["name"]) else \
                "flash_attention"
            s = sim[op]
            est = c["cost_estimate"]
            if est:
                xf, xb = est.get("flops", 0.0), est.get("bytes_accessed", 0.0)
                est_txt = (f"{xf / 1e9:.2f} / {est.get('transcendentals', 0.0) / 1e9:.3f} / "
                           f"{xb / 1e6:.0f}")
                ratio = f"{xf / s['flops']:.2f}"
                t_ratio = f"{roofline_s(x['chip'], xf, xb) / s['seconds']:.2f}"
            else:
                est_txt, ratio, t_ratio = "none", "n/a", "n/a"
            cyc = "none" if c["estimated_cycles"] is None else str(c["estimated_cycles"])
            rows.append(f"| {x['chip']} | {x['kernel']} | `{c['name']}` | {est_txt} | {cyc} | "
                        f"{op} {s['flops'] / 1e9:.2f} / {s['hbm_bytes'] / 1e6:.0f} | {ratio} | "
                        f"{t_ratio} |")
    return "\n".join(rows)


def section(cache: dict) -> str:
    """The doc's paragraph and table (docs/validation.md, in `xla_memory.py`'s section)."""
    fwd = [(x["chip"], c) for x in cache.values() for c in x["custom_calls"]
           if c["cost_estimate"]]
    none = sum(1 for x in cache.values() for c in x["custom_calls"] if not c["cost_estimate"])
    cycles = sum(1 for x in cache.values() for c in x["custom_calls"]
                 if c["estimated_cycles"] is not None)
    sim = {chip: tpusim_flash_ops(chip)["flash_attention"] for chip, _ in fwd}
    ratios = sorted({round(c["cost_estimate"]["flops"] / sim[chip]["flops"], 2)
                     for chip, c in fwd})
    byte_ratios = sorted({round(c["cost_estimate"].get("bytes_accessed", 0.0)
                                / sim[chip]["hbm_bytes"], 2) for chip, c in fwd})
    n_calls = sum(len(x["custom_calls"]) for x in cache.values())
    cyc_txt = (f"None of the {n_calls} custom calls has an `estimated_cycles`" if not cycles
               else f"{cycles} of the {n_calls} custom calls have an `estimated_cycles`")
    return "\n".join([
        "What the kernels' custom calls say they cost (`validation/xla_flash_cost.py`, "
        "cached in `validation/results/xla_flash_cost.json`): the attention alone "
        f"({HEADS} heads of {HEAD_DIM}, seq {SEQ}, {BATCH_PER_CHIP} sequences per chip on "
        f"fsdp={FSDP}, causal, blocks of {BLOCK}, forward and backward by `jax.grad`) with "
        "the splash kernel and with jax's older Pallas `flash_attention` kernel, on each "
        f"chip. {cyc_txt}: XLA's TPU cost model gives a Mosaic kernel no cycles, and "
        "`compiled.cost_analysis()` adds for it only what the "
        "kernel declared to `pallas_call` as its `cost_estimate`. The splash kernels "
        f"declare nothing, nor do the `flash_attention` backward kernels ({none} custom "
        "calls without an estimate). The `flash_attention` forward declares the cost of "
        "its reference implementation as XLA's cost analysis counts it (`pl.estimate_cost` "
        "of `mha_reference`): every score of the [seq, seq] matrix, the causal mask "
        "applied after the matmuls, so "
        f"{' / '.join(f'{r:.2f}' for r in ratios)}x tpusim's `flash_attention` FLOPs (the "
        "causal half: a kernel skips the blocks above the diagonal, docs/model.md), one "
        "transcendental per score (tpusim charges the softmax nothing: the kernel's exp "
        "runs on the VPU/EUP beside the MXU work, docs/validation.md, the v6e factor) "
        "and its operands' and results' bytes, "
        f"{' / '.join(f'{r:.2f}' for r in byte_ratios)}x tpusim's HBM bytes (q, k, v and "
        "the output; the kernel's declared results also hold its f32 row statistics, "
        "lane-padded). In time, that estimate's "
        "roofline at the chip's peaks over tpusim's op alone on the chip (fitted MXU "
        "efficiency, v6e's half-rate head_dim 128) is the last column. So no XLA estimate "
        "of the flash kernels' cost exists to check tpusim's against: the only one is the "
        "cost of the dense reference a kernel author attached to one forward kernel, not "
        "a compiler's model of the kernel, and tpusim's attention costs (and fitted "
        "factors) are unchanged.", "",
        table(cache)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--recompile", action="store_true", help="compile every program")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON,
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker)
        return 0
    if args.compile or args.recompile:
        cache = xla_compile.compile_into_cache(
            PROGRAMS, CACHE,
            lambda n: xla_compile.run_worker("validation.xla_flash_cost", n, args.jax_python),
            recompile=args.recompile,
            report=lambda n, r: f"{len(r['custom_calls'])} custom calls")
    else:
        cache = xla_compile.load_cache(CACHE)
    print(table(cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
