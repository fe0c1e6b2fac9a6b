"""Two program choices against XLA: the dtype of the MLP's activation intermediates
(`--mlp-act-dtype`) and the embedding lookup's collective (`--embed-lookup`), each program
compiled deviceless for a TPU topology in each form, read back and compared with tpusim.

XLA side: the LLaMA-style decoder of `validation/xla_compile.py` (SMALL widths, 4 layers
scanned as MaxText's scan_layers, dot attention with f32 scores, bf16 params, f32 Adam
moments, donated arguments) with
* `mlp_act_dtype` "bf16" (the SwiGLU in bf16, MaxText's default `activations_in_float32:
  False`) or "fp32" (the gate and up projections' bf16 outputs cast to f32 before the
  activation, the product cast back to bf16 before the down projection, as MaxText's
  `MlpBlock` does with `activations_in_float32: True`);
* `embed_lookup` "auto" (`jnp.take` of the [vocab / tensor, d_model / fsdp] table: XLA's
  own choice) or "all-gather" (the table replicated by a sharding constraint before the
  lookup).
The two forms of a program differ only in that choice, so the difference of their bytes and
peaks is what the choice costs.

What is read off each compile (`--dump`: the module and its buffer assignment), as
`validation/xla_logits.py` reads it (`xla_compile.compile_form`): dot FLOPs per chip by
operand type, the HBM peak of XLA's buffer assignment, the matmuls' and the other ops' HBM
bytes and every collective's bytes by kind. tpusim side: `tpusim train` on the same model,
mesh and batch with the flag.

Run (the XLA side needs a python with jax[tpu]==0.10.2; docs/xla_crosscheck.md):
    python -m validation.xla_progflags                      # the table from the cache
    python -m validation.xla_progflags --predict            # tpusim's numbers (before compiling)
    python -m validation.xla_progflags --compile --jax-python /work/jaxvenv/bin/python
    python -m validation.xla_progflags --write              # rewrite its docs/validation.md section
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from validation import xla_compile
from validation.template import splice

REPO = xla_compile.REPO
CACHE = xla_compile.RESULTS / "xla_progflags.json"
DOC = REPO / "docs" / "validation.md"
MARKER = "<!-- program-flags -->"
END = "<!-- /program-flags -->"
# The dense decoder's programs (`xla_compile.DENSE_*`, shared with xla_int8 and xla_logits).
CHIPS, MESHES = xla_compile.DENSE_CHIPS, xla_compile.DENSE_MESHES
LAYERS, SEQ, BATCH_PER_CHIP = (xla_compile.DENSE_LAYERS, xla_compile.DENSE_SEQ,
                               xla_compile.DENSE_BATCH_PER_CHIP)
# The flag each program varies, its forms (the default first) and tpusim's option for it.
FLAGS = {"mlp": (("bf16", "fp32"), "--mlp-act-dtype"),
         "embed": (("auto", "all-gather"), "--embed-lookup")}

# name -> settings. `when`: where the program stands in the order rules were written and
# compiles made (tpusim's predictions, each written before its compile, are in
# validation/results/xla_progflags_predictions.txt).
CONFIGS = {
    "mlp_v5e_fsdp_full": dict(flag="mlp", chip="v5e", mesh="fsdp", remat="full",
                              when="first rule checked"),
    "mlp_v5e_fsdp_none": dict(flag="mlp", chip="v5e", mesh="fsdp", remat="none",
                              when="first rule missed; the f32 gate and up read off"),
    "mlp_v5p_fsdp_tp_full": dict(flag="mlp", chip="v5p", mesh="fsdp_tp", remat="full",
                                 when="held out"),
    "mlp_v5p_fsdp_tp_none": dict(flag="mlp", chip="v5p", mesh="fsdp_tp", remat="none",
                                 when="held out"),
    "embed_v5e_fsdp_tp_full": dict(flag="embed", chip="v5e", mesh="fsdp_tp", remat="full",
                                   when="auto as predicted but the gradient's reduce-scatter "
                                        "over tensor; both tensor rules read off"),
    "embed_v5e_fsdp_full": dict(flag="embed", chip="v5e", mesh="fsdp", remat="full",
                                when="the all-gather form's all-reduce read off"),
    "embed_v5p_fsdp_tp_full": dict(flag="embed", chip="v5p", mesh="fsdp_tp", remat="full",
                                   when="held out"),
}
# Programs that are another's (the default forms of the two flags are the same decoder): the
# cache entry read for them.
SAME_PROGRAM = {"embed_v5p_fsdp_tp_full/auto": "mlp_v5p_fsdp_tp_full/bf16"}
# Collective kinds as the table abbreviates them.
SHORT_KINDS = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR",
               "all-to-all": "A2A", "collective-permute": "CP"}


def forms(name: str) -> tuple[str, ...]:
    return FLAGS[CONFIGS[name]["flag"]][0]


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
        choice = {"mlp_act_dtype": form} if cfg["flag"] == "mlp" else {"embed_lookup": form}
        model = xla_compile.Decoder(mesh, xla_compile.SMALL, act_spec=P("fsdp", None, None),
                                    **choice)
        xla_compile.compile_dense_step(model, name, form, devices.size, cfg["remat"], dump)


# --------------------------------------------------------------------------------------------
# driver side (the project's python)
# --------------------------------------------------------------------------------------------

def run_xla(key: str, jax_python: str, dump: str | None) -> dict:
    """Compile one program (`name/form`) under the jax python and read its module back."""
    name, form = key.split("/")
    return xla_compile.compile_form("validation.xla_progflags", name, form,
                                    CHIPS[CONFIGS[name]["chip"]][0], jax_python, dump)


def tpusim_flags(name: str, form: str) -> list[str]:
    cfg = CONFIGS[name]
    values, option = FLAGS[cfg["flag"]]
    return xla_compile.dense_tpusim_flags(cfg, [option, form] if form != values[0] else [])


def tpusim_side(name: str, form: str) -> dict:
    """tpusim's step of the same program (`xla_compile.dense_tpusim_side`)."""
    return xla_compile.dense_tpusim_side("xla-progflags", tpusim_flags(name, form), name)


def _by_kind(d: dict) -> str:
    return ", ".join(f"{k} {v / 1e9:.4f}" for k, v in d.get("collective_bytes_by_kind",
                                                            {}).items())


def predictions(names=None) -> str:
    """tpusim's numbers for every program and form, one line each (written to
    validation/results/xla_progflags_predictions.txt before the compiles)."""
    lines = []
    for name in names or CONFIGS:
        for form in forms(name):
            t = tpusim_side(name, form)
            lines.append(
                f"{name} {form} peak {t['hbm_peak_bytes'] / 1e9:.4f} GB, dots "
                f"{ {d: round(v / 1e12, 4) for d, v in t['dot_flops'].items()} } TFLOP, "
                f"matmul bytes {t['mxu_bytes'] / 1e9:.3f} GB, non-matmul bytes "
                f"{t['vpu_bytes'] / 1e9:.3f} GB, collectives GB: {_by_kind(t)}")
    return "\n".join(lines) + "\n"


def describe(name: str) -> str:
    return xla_compile.dense_describe(CONFIGS[name])


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def _kinds(x: dict, t: dict) -> str:
    """Collective GB by kind, XLA / tpusim (every kind either side has)."""
    xk, tk = x.get("collective_bytes_by_kind", {}), t.get("collective_bytes_by_kind", {})
    return "; ".join(
        f"{SHORT_KINDS.get(k, k)} {xk.get(k, 0.0) / 1e9:.3f} / {tk.get(k, 0.0) / 1e9:.3f}"
        for k in sorted(set(xk) | set(tk)))


def _kind_deltas(x: dict, xb: dict, t: dict, tb: dict) -> str:
    """Collective MB by kind of a form minus its program's default form, XLA / tpusim (the
    kinds either side changes by more than 0.5 MB)."""
    def delta(a, b, k):
        return (a.get("collective_bytes_by_kind", {}).get(k, 0.0)
                - b.get("collective_bytes_by_kind", {}).get(k, 0.0)) / 1e6

    kinds = set(x.get("collective_bytes_by_kind", {})) | set(t.get("collective_bytes_by_kind",
                                                                   {}))
    kinds |= set(xb.get("collective_bytes_by_kind", {})) | set(
        tb.get("collective_bytes_by_kind", {}))
    parts = [f"{SHORT_KINDS.get(k, k)} {delta(x, xb, k):+.1f} / {delta(t, tb, k):+.1f}"
             for k in sorted(kinds)
             if abs(delta(x, xb, k)) > 0.5 or abs(delta(t, tb, k)) > 0.5]
    return "; ".join(parts) or "none"


def section(cache: dict) -> str:
    """The docs/validation.md section (between MARKER and END)."""
    lines = [MARKER, "## Program choices against XLA: the MLP's activation dtype and the "
             "embedding lookup", "",
             "_Generated by `python -m validation.xla_progflags --write` from the cached "
             "compiles in `validation/results/xla_progflags.json`; tpusim's predictions, each "
             "written before its compile, are in "
             "`validation/results/xla_progflags_predictions.txt`._", "",
             "XLA side: the decoder of the peak-HBM table above (SMALL widths, 4 layers "
             "scanned, dot attention, seq 2048, 2 sequences per chip, bf16 params, Adam) with "
             "the SwiGLU in bf16 or in f32 (MaxText's `activations_in_float32`: the gate and "
             "up outputs cast to f32 before the activation, the product cast back to bf16), "
             "and with the embedding table looked up as XLA chooses (`jnp.take` of the "
             "sharded table) or replicated first (a sharding constraint: XLA gathers it). "
             "tpusim side: `tpusim train --mlp-act-dtype bf16|fp32` or `--embed-lookup "
             "auto|all-gather` (`--attention dot --tp-activations replicated`, `--fsdp-gather "
             "mixed-async` on v5e, `mixed-blocking` on v5p). Dot FLOPs per chip by operand "
             "type as tpusim's HLO importer counts them; the HBM peak of XLA's buffer "
             "assignment; per chip, the matmuls' and the other ops' HBM bytes (operands and "
             "results, times loop trips) and the collectives' bytes by kind (AG all-gather, "
             "RS reduce-scatter, AR all-reduce, A2A all-to-all, CP collective-permute; a "
             "windowed ring's messages are collective-permutes in XLA's module and counted "
             "under its gather or reduce-scatter by tpusim, so those three kinds compare as a "
             "sum), and what each form changes against its program's default form. "
             "`compiled` says where each program stands in the order rules were written and "
             "compiles made (docs/model/training.md has the rules).", "",
             "| program | compiled | form | dot TFLOP, XLA / tpusim | XLA peak GB | tpusim | "
             "error | form - default peak MB, XLA / tpusim | form - default collective MB "
             "by kind, XLA / tpusim | matmul GB, XLA / tpusim | non-matmul GB, XLA / tpusim "
             "| collective GB by kind, XLA / tpusim |",
             "|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for name, cfg in CONFIGS.items():
        base = forms(name)[0]
        keys = {f: SAME_PROGRAM.get(f"{name}/{f}", f"{name}/{f}") for f in forms(name)}
        sides = {f: (cache[k], tpusim_side(name, f)) for f, k in keys.items() if k in cache}
        for form, (x, t) in sides.items():
            err = t["hbm_peak_bytes"] / x["hbm_peak_bytes"] - 1
            delta = kinds = ""
            if form != base and base in sides:
                (xb, tb) = sides[base]
                delta = (f"{(x['hbm_peak_bytes'] - xb['hbm_peak_bytes']) / 1e6:+.1f} / "
                         f"{(t['hbm_peak_bytes'] - tb['hbm_peak_bytes']) / 1e6:+.1f}")
                kinds = _kind_deltas(x, xb, t, tb)
            xf = sum(x["dot_flops"].values()) / 1e12
            tf = sum(t["dot_flops"].values()) / 1e12
            lines.append(
                f"| {describe(name)} | {cfg['when']} | {form} | {xf:.4f} / {tf:.4f} | "
                f"{_gb(x['hbm_peak_bytes'])} | {_gb(t['hbm_peak_bytes'])} | {err:+.1%} | "
                f"{delta} | {kinds} | {_gb(x['mxu_bytes'])} / {_gb(t['mxu_bytes'])} | "
                f"{_gb(x['vpu_bytes'])} / {_gb(t['vpu_bytes'])} | {_kinds(x, t)} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--form", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="XLA dump directory (one subdirectory per program)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--jax-python", default="/work/jaxvenv/bin/python",
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--only", default="",
                    help="comma list of `program/form` keys to compile (default: all)")
    ap.add_argument("--predict", action="store_true",
                    help="print tpusim's predictions of every program (before compiling)")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the program-flags section of docs/validation.md")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.form, args.dump)
        return 0
    if args.predict:
        only = {k.split("/")[0] for k in args.only.split(",") if k}
        print(predictions([n for n in CONFIGS if not only or n in only]), end="")
        return 0
    if args.compile:
        keys = [k for k in args.only.split(",") if k] or \
            [f"{n}/{f}" for n in CONFIGS for f in forms(n) if f"{n}/{f}" not in SAME_PROGRAM]
        xla_compile.compile_into_cache(
            keys, CACHE, lambda k: run_xla(k, args.jax_python, args.dump),
            report=xla_compile.dots_report)
    text = section(xla_compile.load_cache(CACHE))
    if args.write:
        DOC.write_text(splice(DOC.read_text(), MARKER, END, text))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
