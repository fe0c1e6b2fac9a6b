"""int8 training against XLA: AQT's int8 matmuls (MaxText's `quantization=int8`) compiled
deviceless for TPU topologies, read back and compared with tpusim's `--matmul-dtype int8`.

XLA side: the LLaMA-style decoder of `validation/xla_compile.py` (SMALL widths, 4 layers
scanned as MaxText's scan_layers, dot attention with f32 scores, bf16 params, f32 Adam
moments, donated arguments) with every weight matmul (q, k, v, out, the gated MLP's three)
run by AQT's dot_general (`aqtp==0.9.0`, `aqt.jax.v2`) configured as MaxText's
`_get_int8_quant_config` (`MaxText/layers/quantizations.py`; docs/reference/int8.md): AQT's
`config_v3` with 8 bits forward, for the input gradient (`dlhs`) and for the weight gradient
(`drhs`; MaxText sets it whenever `quantization_local_shard_count` is not 0, and its default
-1 becomes the slice count), int32 accumulators, stochastic rounding of the gradient operand
(`jax.uniform` noise) drawn with jax's `unsafe_rbg` PRNG (MaxText's `jax_default_prng_impl`),
per-channel scales (AQT's default calibration: the abs-max over the contraction axis). The
embedding, the attention einsums and the logits stay bf16, as MaxText's layers leave them.
Each program is compiled twice, with the AQT dot and with the plain bf16 `x @ w`, so that the
quantization's own bytes are the difference of two programs alike in all else.

What is read off each compile (`--dump`: the module and its buffer assignment): dot FLOPs per
chip by operand type (s8 x s8, bf16; every dot and convolution times its loop trips, as
`tpusim import-hlo` counts them), the HBM peak of XLA's buffer assignment
(`xla_live_ranges.hbm_peak`), the non-matmul instructions' HBM bytes (fusions and
instructions without a dot, their operands and result, times loop trips: tpusim's HLO
importer's count) and the all-gathered bytes. tpusim side: `tpusim train` on the same model,
mesh and batch with `--matmul-dtype int8` or bf16 (`--attention dot --tp-activations
replicated`, the remat policy and the gather forms as the program has them).

Run (the XLA side needs a python with jax[tpu]==0.10.2 and aqtp; docs/xla_crosscheck.md):
    python -m validation.xla_int8                         # the table from the cache
    python -m validation.xla_int8 --compile --jax-python /work/jaxvenv/bin/python
    python -m validation.xla_int8 --write                 # rewrite its docs/validation.md section
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from validation import xla_compile
from validation.template import splice

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_int8.json"
DOC = REPO / "docs" / "validation.md"
MARKER = "<!-- int8 -->"
END = "<!-- /int8 -->"
# The dense decoder's programs (`xla_compile.DENSE_*`, shared with xla_logits and
# xla_progflags).
CHIPS, MESHES = xla_compile.DENSE_CHIPS, xla_compile.DENSE_MESHES
LAYERS, SEQ, BATCH_PER_CHIP = (xla_compile.DENSE_LAYERS, xla_compile.DENSE_SEQ,
                               xla_compile.DENSE_BATCH_PER_CHIP)

# name -> settings. `compiled`: when, relative to the rules of docs/model/int8.md (held out:
# compiled after the rules it checks were written down, with tpusim's peak written down
# first in validation/results/xla_int8_predictions.txt; docs/validation.md tells the story).
READ_OFF = "rules read off"
CONFIGS = {
    "v5e_fsdp_full": dict(chip="v5e", mesh="fsdp", remat="full", compiled=READ_OFF),
    "v5e_fsdp_save_dot_except_mlpwi": dict(chip="v5e", mesh="fsdp",
                                           remat="save_dot_except_mlpwi", compiled=READ_OFF),
    "v5p_fsdp_tp_full": dict(chip="v5p", mesh="fsdp_tp", remat="full",
                             compiled="held out from the first rules (+37.0%), then read off"),
    "v5p_fsdp_tp_save_dot_except_mlpwi": dict(
        chip="v5p", mesh="fsdp_tp", remat="save_dot_except_mlpwi",
        compiled="held out from the first rules (+32.5%)"),
    "v5p_fsdp_full": dict(chip="v5p", mesh="fsdp", remat="full", compiled=READ_OFF),
    "v5e_fsdp_tp_full": dict(chip="v5e", mesh="fsdp_tp", remat="full",
                             compiled="held out (-14.8%), then read off"),
    "v5e_fsdp_tp_save_dot_except_mlpwi": dict(chip="v5e", mesh="fsdp_tp",
                                              remat="save_dot_except_mlpwi",
                                              compiled="held out"),
}
# The program's two forms: AQT int8 weight matmuls, and the same program in bf16.
FORMS = ("int8", "bf16")


# --------------------------------------------------------------------------------------------
# jax side (runs under the jax python, with aqtp)
# --------------------------------------------------------------------------------------------

def aqt_dot(slices: int = 1):
    """MaxText's int8 AQT dot_general (`_get_int8_quant_config`), as a weight matmul
    `dot(x, w, seed)` of `x[..., d]` and `w[d, f]`; `seed` a traced uint32 from which each
    call draws its own key (MaxText's flax module makes one per call from the `aqt` rng)."""
    # jax and aqtp are optional: imported only where a program is compiled.
    import jax
    import jax.numpy as jnp
    from aqt.jax.v2 import config as aqt_config

    cfg = aqt_config.config_v3(
        fwd_bits=8, dlhs_bits=8, drhs_bits=8, rng_type="jax.uniform", dlhs_local_aqt=None,
        drhs_local_aqt=aqt_config.LocalAqt(contraction_axis_shard_count=slices),
        fwd_accumulator_dtype=jnp.int32, dlhs_accumulator_dtype=jnp.int32,
        drhs_accumulator_dtype=jnp.int32)
    calls = [0]

    def dot(x, w, seed):
        calls[0] += 1
        key = jax.random.fold_in(jax.random.key(seed), calls[0])
        dg = aqt_config.set_context(cfg, key, train_step=None)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return dg(x, w, dims).astype(x.dtype)

    return dot


def _worker(name: str, form: str, dump: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dump = dump or tmp
        # MaxText's libtpu flag (train.py): each chip draws the random bits of its own shard
        # (without it the partitioner generates every stochastic-rounding noise tensor whole,
        # at the global batch, on every chip).
        flag = "--xla_tpu_spmd_rng_bit_generator_unsafe=true"
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flag}"
        xla_compile.init_jax(dump)
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        import jax
        from jax.sharding import PartitionSpec as P

        # MaxText's PRNG (train.py: jax_default_prng_impl = unsafe_rbg).
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        cfg = CONFIGS[name]
        mesh, devices = xla_compile.dense_mesh(cfg)
        remat = cfg["remat"]
        if remat not in ("none", "full", "minimal"):
            from jax.ad_checkpoint import checkpoint_name as tag
        else:
            tag = xla_compile._identity_tag
        model = xla_compile.Decoder(mesh, xla_compile.SMALL, act_spec=P("fsdp", None, None),
                                    tag=tag, weight_dot=aqt_dot() if form == "int8" else None)
        xla_compile.compile_dense_step(model, name, form, devices.size, remat, dump)


# --------------------------------------------------------------------------------------------
# driver side (the project's python)
# --------------------------------------------------------------------------------------------

def run_xla(key: str, jax_python: str, dump: str | None) -> dict:
    """Compile one program (`name/form`) under the jax python and read its module back."""
    name, form = key.split("/")
    return xla_compile.compile_form("validation.xla_int8", name, form,
                                    CHIPS[CONFIGS[name]["chip"]][0], jax_python, dump)


def tpusim_flags(name: str, form: str) -> list[str]:
    return xla_compile.dense_tpusim_flags(
        CONFIGS[name], ["--matmul-dtype", "int8"] if form == "int8" else [])


def tpusim_side(name: str, form: str) -> dict:
    """tpusim's step of the same program (`xla_compile.dense_tpusim_side`: MXU FLOPs by
    dtype, non-matmul bytes, gathers)."""
    return xla_compile.dense_tpusim_side("xla-int8", tpusim_flags(name, form), name)


def rows(cache: dict) -> list[dict]:
    """Per program (both forms cached): XLA's and tpusim's numbers side by side."""
    out = []
    for name, cfg in CONFIGS.items():
        if f"{name}/int8" not in cache or f"{name}/bf16" not in cache:
            continue
        x8, xb = cache[f"{name}/int8"], cache[f"{name}/bf16"]
        t8, tb = tpusim_side(name, "int8"), tpusim_side(name, "bf16")
        out.append({"name": name, "cfg": cfg, "xla": x8, "xla_bf16": xb, "tpusim": t8,
                    "tpusim_bf16": tb})
    return out


def describe(name: str) -> str:
    return xla_compile.dense_describe(CONFIGS[name])


def section(cache: dict) -> str:
    """The docs/validation.md section (between MARKER and END)."""
    lines = [MARKER, "## int8 training against XLA (AQT)", "",
             "_Generated by `python -m validation.xla_int8 --write` from the cached compiles in "
             "`validation/results/xla_int8.json`._", "",
             "XLA side: the decoder of the peak-HBM table above (SMALL widths, 4 layers "
             "scanned, dot attention, seq 2048, 2 sequences per chip, bf16 params, Adam) with "
             "every weight matmul run by AQT's int8 dot_general as MaxText's "
             "`quantization=int8` configures it (`aqtp==0.9.0`, `config_v3`: int8 forward, "
             "input and weight gradients, per-channel scales, stochastic rounding of the "
             "gradients with jax's `unsafe_rbg` bits and MaxText's libtpu flag "
             "`--xla_tpu_spmd_rng_bit_generator_unsafe=true`), each compiled again in bf16. "
             "tpusim side: `tpusim train --matmul-dtype int8 --attention dot "
             "--tp-activations replicated` with the program's remat policy and gather forms "
             "(`mixed-async` on v5e, `mixed-blocking` on v5p). Dot FLOPs per chip by operand "
             "type as tpusim's HLO importer counts them (every dot and convolution times its "
             "loop trips; s8 x s8 dots are int8); the HBM peak of XLA's buffer assignment; "
             "the non-matmul ops' HBM bytes (fusions and instructions without a dot, their "
             "operands and results, times loop trips), whose int8 - bf16 difference is the "
             "quantization's traffic.", "",
             "| program | compiled | XLA int8 / bf16 dot TFLOP | tpusim int8 / bf16 | "
             "XLA peak | tpusim peak | error | XLA bf16 peak | non-matmul GB, XLA int8 - bf16 "
             "| tpusim int8 - bf16 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows(cache):
        x, t = r["xla"], r["tpusim"]
        xd, td = x["dot_flops"], t["dot_flops"]
        err = t["hbm_peak_bytes"] / x["hbm_peak_bytes"] - 1
        when = r["cfg"]["compiled"]
        lines.append(
            f"| {describe(r['name'])} | {when} | {xd.get('int8', 0) / 1e12:.4f} / "
            f"{xd.get('bf16', 0) / 1e12:.4f} | {td.get('int8', 0) / 1e12:.4f} / "
            f"{td.get('bf16', 0) / 1e12:.4f} | {x['hbm_peak_bytes'] / 1e9:.3f} GB | "
            f"{t['hbm_peak_bytes'] / 1e9:.3f} GB | {err:+.1%} | "
            f"{r['xla_bf16']['hbm_peak_bytes'] / 1e9:.3f} GB | "
            f"{(x['vpu_bytes'] - r['xla_bf16']['vpu_bytes']) / 1e9:+.2f} | "
            f"{(t['vpu_bytes'] - r['tpusim_bf16']['vpu_bytes']) / 1e9:+.2f} |")
    lines += ["", (Path(__file__).parent / "templates" / "int8.md").read_text().strip(), "",
              END]
    return "\n".join(lines) + "\n"


def updated(doc: str, text: str | None = None) -> str:
    """`doc` (docs/validation.md's text) with this section regenerated (XLA's side from the
    cache, tpusim's recomputed), nothing else changed."""
    text = section(xla_compile.load_cache(CACHE)) if text is None else text
    return splice(doc, MARKER, END, text.rstrip("\n"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--form", default="int8", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="XLA dump directory (one subdirectory per program)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--jax-python", default="/work/jaxvenv/bin/python",
                    help="python with jax[tpu]==0.10.2 and aqtp (default %(default)s)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of programs")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the int8 section of docs/validation.md")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.form, args.dump)
        return 0
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if args.compile:
        keys = [f"{n}/{f}" for n in names for f in FORMS]
        xla_compile.compile_into_cache(
            keys, CACHE, lambda k: run_xla(k, args.jax_python, args.dump),
            report=xla_compile.dots_report)
    cache = xla_compile.load_cache(CACHE)
    text = section({k: v for k, v in cache.items() if k.split("/")[0] in names})
    if args.write:
        DOC.write_text(updated(DOC.read_text(), text))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
