"""The logits path's dtype against XLA: the output projection's dot in bf16 (its logits cast to
f32 for the loss, MaxText's default) and in f32 (MaxText's `logits_dot_in_fp32`), compiled
deviceless for a TPU topology, read back and compared with tpusim's `--logits-dtype`.

XLA side: the LLaMA-style decoder of `validation/xla_compile.py` (SMALL widths, 4 layers
scanned as MaxText's scan_layers, dot attention with f32 scores, bf16 params, f32 Adam
moments, donated arguments), its logits computed as `workloads.hlo.jaxgen.Decoder` does with
`logits_dtype` "bf16" (`(x @ w).astype(f32)`) or "fp32" (`x.astype(f32) @ w.astype(f32)`, at
jax's default matmul precision, as MaxText's `matmul_precision: default`). The two programs
differ only in the logits path, so the difference of their non-matmul bytes, all-gathered
bytes and peaks is what the f32 dot costs.

What is read off each compile (`--dump`: the module and its buffer assignment), as
`validation/xla_int8.py` reads it: dot FLOPs per chip by operand type (every dot times its
loop trips, as `tpusim import-hlo` counts them), the HBM peak of XLA's buffer assignment
(`xla_live_ranges.hbm_peak`), the non-matmul instructions' HBM bytes and the matmuls' HBM
bytes (operands and results, times loop trips) and the all-gathered bytes. tpusim side:
`tpusim train` on the same model, mesh and batch with `--logits-dtype bf16` or `fp32`.

Run (the XLA side needs a python with jax[tpu]==0.10.2; docs/xla_crosscheck.md):
    python -m validation.xla_logits                         # the table from the cache
    python -m validation.xla_logits --compile --jax-python /work/jaxvenv/bin/python
    python -m validation.xla_logits --write                 # rewrite its docs/validation.md section
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from validation import xla_compile
from validation.template import splice

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_logits.json"
DOC = REPO / "docs" / "validation.md"
MARKER = "<!-- logits-dtype -->"
END = "<!-- /logits-dtype -->"
# The dense decoder's programs: `xla_compile.DENSE_*` (shared with xla_int8 and xla_progflags).
CHIPS = xla_compile.DENSE_CHIPS

# name -> settings. `held_out`: compiled after the rules of docs/model/training.md "The logits
# path's dtype" were read off the others (tpusim's predictions, written before each compile,
# are in validation/results/xla_logits_predictions.txt).
CONFIGS = {
    "v5e_fsdp_full": dict(chip="v5e", mesh="fsdp", remat="full",
                          when="rules read off"),
    "v5p_fsdp_tp_full": dict(chip="v5p", mesh="fsdp_tp", remat="full", held_out=True,
                             when="held out; the tensor rule then read off"),
    "v5e_fsdp_tp_full": dict(chip="v5e", mesh="fsdp_tp", remat="full", held_out=True,
                             when="after every rule (held out)"),
}
FORMS = ("bf16", "fp32")


# --------------------------------------------------------------------------------------------
# jax side (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _worker(name: str, form: str, dump: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dump = dump or tmp
        xla_compile.init_jax(dump)
        # jax is optional: imported only where a program is compiled (the jax[tpu] python).
        from jax.sharding import PartitionSpec as P

        cfg = CONFIGS[name]
        mesh, devices = xla_compile.dense_mesh(cfg)
        model = xla_compile.Decoder(mesh, xla_compile.SMALL, act_spec=P("fsdp", None, None),
                                    logits_dtype=form)
        xla_compile.compile_dense_step(model, name, form, devices.size, cfg["remat"], dump)


# --------------------------------------------------------------------------------------------
# driver side (the project's python)
# --------------------------------------------------------------------------------------------

def run_xla(key: str, jax_python: str, dump: str | None) -> dict:
    """Compile one program (`name/form`) under the jax python and read its module back."""
    name, form = key.split("/")
    return xla_compile.compile_form("validation.xla_logits", name, form,
                                    CHIPS[CONFIGS[name]["chip"]][0], jax_python, dump)


def tpusim_flags(name: str, form: str) -> list[str]:
    return xla_compile.dense_tpusim_flags(CONFIGS[name], ["--logits-dtype", form])


def tpusim_side(name: str, form: str) -> dict:
    """tpusim's step of the same program (`xla_compile.dense_tpusim_side`)."""
    return xla_compile.dense_tpusim_side("xla-logits", tpusim_flags(name, form), name)


def predictions() -> str:
    """tpusim's numbers for every program and form, one line each (written to
    validation/results/xla_logits_predictions.txt before the compiles)."""
    lines = []
    for name in CONFIGS:
        for form in FORMS:
            t = tpusim_side(name, form)
            lines.append(
                f"{name} {form} peak {t['hbm_peak_bytes'] / 1e9:.4f} GB, dots "
                f"{ {d: round(v / 1e12, 4) for d, v in t['dot_flops'].items()} } TFLOP, "
                f"matmul bytes {t['mxu_bytes'] / 1e9:.3f} GB, non-matmul bytes "
                f"{t['vpu_bytes'] / 1e9:.3f} GB, gathered {t['allgather_bytes'] / 1e9:.4f} GB, "
                f"collectives {t['collective_bytes'] / 1e9:.4f} GB")
    return "\n".join(lines) + "\n"


def describe(name: str) -> str:
    return xla_compile.dense_describe(CONFIGS[name])


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def section(cache: dict) -> str:
    """The docs/validation.md section (between MARKER and END)."""
    lines = [MARKER, "## The logits path's dtype against XLA", "",
             "_Generated by `python -m validation.xla_logits --write` from the cached compiles "
             "in `validation/results/xla_logits.json`; tpusim's predictions, each written "
             "before its compile, are in `validation/results/xla_logits_predictions.txt`._", "",
             "XLA side: the decoder of the peak-HBM table above (SMALL widths, 4 layers "
             "scanned, dot attention, seq 2048, 2 sequences per chip, bf16 params, Adam) with "
             "the output projection's dot in bf16 and its logits cast to f32 (MaxText's "
             "default: `logits_dot_in_fp32: False`, `cast_logits_to_fp32: True`) and with "
             "both its operands cast to f32 before the dot (`logits_dot_in_fp32: True`, at "
             "jax's default matmul precision). tpusim side: `tpusim train --logits-dtype bf16` "
             "or `fp32` (`--attention dot --tp-activations replicated`, `--fsdp-gather "
             "mixed-async` on v5e, `mixed-blocking` on v5p). Dot FLOPs per chip by operand "
             "type as tpusim's HLO importer counts them (an f32 dot at default precision is "
             "counted at the bf16 rate, as it runs); the HBM peak of XLA's buffer assignment; "
             "per chip, the matmuls' and the other ops' HBM bytes (operands and results, times "
             "loop trips) and every collective's bytes. The v5e rules were read off its fp32 "
             "compile (the first rules, written before it, predicted a peak +32% above XLA's: "
             "docs/model/training.md); the v5p program was compiled after the rewrite, and the "
             "rule for the f32 input gradient under `tensor` read off it; the v5e fsdp x "
             "tensor program was compiled after that. XLA's collective bytes count an "
             "all-reduce's operand (its f32 input gradient under fp32 with `tensor`, though "
             "it writes bf16), as tpusim does.", "",
             "| program | compiled | logits dot | dot TFLOP, XLA / tpusim | XLA peak GB | "
             "tpusim | error | fp32 - bf16 peak MB, XLA / tpusim | matmul GB, XLA / tpusim | "
             "non-matmul GB, XLA / tpusim | collective GB, XLA / tpusim |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, cfg in CONFIGS.items():
        when = cfg["when"]
        sides = {f: (cache.get(f"{name}/{f}"), tpusim_side(name, f)) for f in FORMS
                 if f"{name}/{f}" in cache}
        for form, (x, t) in sides.items():
            err = t["hbm_peak_bytes"] / x["hbm_peak_bytes"] - 1
            delta = "" if form == "bf16" or "bf16" not in sides else (
                f"{(x['hbm_peak_bytes'] - sides['bf16'][0]['hbm_peak_bytes']) / 1e6:+.1f} / "
                f"{(t['hbm_peak_bytes'] - sides['bf16'][1]['hbm_peak_bytes']) / 1e6:+.1f}")
            xf = sum(x["dot_flops"].values()) / 1e12
            tf = sum(t["dot_flops"].values()) / 1e12
            lines.append(
                f"| {describe(name)} | {when} | {form} | {xf:.4f} / {tf:.4f} | "
                f"{_gb(x['hbm_peak_bytes'])} | {_gb(t['hbm_peak_bytes'])} | {err:+.1%} | "
                f"{delta} | {_gb(x['mxu_bytes'])} / {_gb(t['mxu_bytes'])} | "
                f"{_gb(x['vpu_bytes'])} / {_gb(t['vpu_bytes'])} | "
                f"{x['collective_bytes'] / 1e9:.4f} / {t['collective_bytes'] / 1e9:.4f} |")
    lines += ["", END]
    return "\n".join(lines)


def updated(doc: str, text: str | None = None) -> str:
    """`doc` (docs/validation.md's text) with this section regenerated (XLA's side from the
    cache, tpusim's recomputed), nothing else changed."""
    return splice(doc, MARKER, END, section(xla_compile.load_cache(CACHE)) if text is None
                  else text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--form", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="XLA dump directory (one subdirectory per program)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--jax-python", default="/work/jaxvenv/bin/python",
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--forms", default=",".join(FORMS), help="comma list of logits dtypes")
    ap.add_argument("--predict", action="store_true",
                    help="print tpusim's predictions of every program (before compiling)")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the logits-dtype section of docs/validation.md")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.form, args.dump)
        return 0
    if args.predict:
        print(predictions(), end="")
        return 0
    if args.compile:
        keys = [f"{n}/{f}" for n in CONFIGS for f in args.forms.split(",")]
        xla_compile.compile_into_cache(
            keys, CACHE, lambda k: run_xla(k, args.jax_python, args.dump),
            report=xla_compile.dots_report)
    text = section(xla_compile.load_cache(CACHE))
    if args.write:
        DOC.write_text(updated(DOC.read_text(), text))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
